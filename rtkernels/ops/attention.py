"""attention: FlashAttention-2 forward, compiled for the exact head dim at run time.

``o, lse = attention(q, k, v, causal=False, softmax_scale=None, return_lse=True, out=None)``

q is (batch, seqlen_q, nheads, head_dim), k and v are (batch, seqlen_k, nheads_kv, head_dim)
(FlashAttention's layout); head_dim is any multiple of 8 in [8, 256] and each value gets its
own kernel (templates/attention_fwd.cu.j2).  The tile shape comes from one place,
:func:`choose_config`, which reads :data:`HEURISTICS`; an autotuner can later replace the
lookup without touching the wrapper.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from .. import arch as _arch
from .. import autotune as _autotune
from .._env import getenv_raw
from ..config import register_family
from ..errors import ConfigError
from . import views as _views
from ._arrays import LaunchPlans, OutputPlan, address, default_stream, empty_as, same_memory
from .rowwise import _ClassOrInstance
from .attention_mask import Varlen, check_varlen, first_without_spills, mask_spec, schedule, schedule_slots
from .attention_shape import AttentionShape
from . import attention_sm90 as _sm90

FAMILY = "attention"


@register_family
@dataclass(frozen=True)
class AttentionConfig(AttentionShape):
    """One specialization of the FlashAttention-2 forward kernel.

    Parameters
    ----------
    dtype : "float16" or "bfloat16" (q, k, v and o; float32 accumulation).
    head_dim : multiple of 8 in [8, 256].
    causal : bottom-right aligned causal mask (compiled in: the non-causal kernel has no mask code
        on interior tiles either way, but the causal one skips tiles and needs the diagonal test).
    has_window, has_softcap, is_varlen : the other compile-time parts of the mask
        (:class:`rtkernels.ops.attention_mask.AttentionMask`).
    block_m : query rows per thread block, 16 or 32 per warp (block_m / num_warps).
    block_n : keys per K/V tile, multiple of 16 in [16, 256].
    num_warps : 1, 2, 4 or 8.
    num_stages : 2 = K/V double buffer; 1 = FlashAttention-2's K/V interleave (less smem).
    q_in_regs : keep the Q tile's A fragments in registers instead of re-reading shared memory.
    """

    family: ClassVar[str] = FAMILY
    template: ClassVar[str] = "attention_fwd.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("attention_fwd",)
    expects_tensor_cores: ClassVar[bool] = True
    # Q/K/V move by cp.async and O by 16-byte stores; varlen adds the scalar loads of cu_seqlens
    # and the schedule (the only LDGs), so nothing there is meant to be 128-bit.
    expected_global_width = _ClassOrInstance(128, lambda c: None if c.is_varlen else 128)

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    q_in_regs: bool = False

    def __post_init__(self):
        self._check_shape()
        self._check_choice("q_in_regs", (False, True))
        self._check_choice("num_warps", (1, 2, 4, 8))
        self._check_choice("num_stages", (1, 2))
        self._check_int("block_n", 16, 256, multiple_of=16)
        if self.block_m not in (16 * self.num_warps, 32 * self.num_warps):
            self._fail("block_m", f"16 or 32 rows per warp: {16 * self.num_warps} or {32 * self.num_warps} "
                                  f"with num_warps={self.num_warps}")

    # ---- derived values (the template re-checks them with static_assert) --------------
    @property
    def shared_mem_bytes(self) -> int:
        """Dynamic shared memory: Q tile + num_stages x (K tile + V tile), rows padded to an odd
        number of 16-byte chunks (the template's bank-conflict-free layout)."""
        qk_stride = ((self.head_dim_padded // 8) | 1) * 8
        v_stride = ((self.head_dim // 8) | 1) * 8
        elems = self.block_m * qk_stride + self.num_stages * self.block_n * (qk_stride + v_stride)
        return 2 * elems

    def template_params(self) -> dict[str, Any]:
        p = super().template_params()
        p["smem_bytes"] = self.shared_mem_bytes
        return p

    @classmethod
    def heuristic_defaults(cls, params: dict[str, Any], arch: str | None) -> dict[str, Any]:
        """Tile fields not given come from :func:`choose_config` for (dtype, head_dim, mask, arch)."""
        tile = ("block_m", "block_n", "num_warps", "num_stages", "q_in_regs")
        if all(f in params for f in tile):
            return {}
        from .. import device
        base = cls(**{f: params[f] for f in ("dtype", "head_dim") + cls.MASK_FIELDS if f in params})
        cfg = choose_config(base.dtype, base.head_dim, base.causal, arch or device.current_arch(),
                            **base.mask_flags())
        return {f: getattr(cfg, f) for f in tile}


# ---- heuristics ---------------------------------------------------------------------------
class Tile(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    q_in_regs: bool
    why: str


# (lowest head_dim, highest head_dim, causal or None for both) -> tiles in order of preference;
# the first that fits the target's shared memory per block is used.  Reasons are ptxas reports
# (NVRTC 13.5, sm_80 and sm_90, both dtypes); measured timings are added after GPU runs.
HEURISTICS: list[tuple[int, int, bool | None, tuple[Tile, ...]]] = [
    # Timings: H200, bf16, FlashAttention's grid at seqlen 4096 (16k tokens, hidden 2048), tools/
    # bench_attention.py --tune, 2026-11-21.  Register/spill figures: ptxas of NVRTC 13.5 (the PyPI
    # wheel) for sm_80 and sm_90; a tile that spills under 13.5 is not chosen even where the GPU
    # host's NVRTC 13.0 compiled it without spills and it timed faster.
    (64, 64, True, (
        Tile(128, 128, 4, 2, False,
             "causal d64: 302 TFLOP/s vs 286 for 128x64 w4 s2 (+5.6%); 255 regs, 0 spills on sm_80 and sm_90 "
             "(the non-causal kernel of this tile spills 32-96 B, so only the causal one uses it)"),
        Tile(128, 64, 4, 2, False, "fallback"),
    )),
    (8, 64, None, (
        Tile(128, 64, 4, 2, False,
             "d64 non-causal: fastest of 24 tiles (318 TFLOP/s; 128x128 w4 s1 309, 64x64 w2 s2 297). 32 rows/warp "
             "halves K/V ldmatrix traffic per mma vs 16; 126-240 regs, 0 spills; <= 54 KiB smem"),
        Tile(128, 64, 4, 1, False, "same tile, single K/V buffer: fallback when smem is short"),
    )),
    (72, 136, None, (
        Tile(128, 64, 4, 1, False,
             "d128: fastest of 24 tiles (361 TFLOP/s non-causal, 307 causal; next 128x32 w4 s2 at 329/284). d96 "
             "causal ran 10% faster double-buffered (295 vs 269) but that tile spills 24 B at d96 and 72-100 B at "
             "d112-136 under NVRTC 13.5; this one stays <= 255 regs, 0 spills"),
        Tile(128, 32, 4, 1, False, "smaller K/V tiles: fallback when smem is short (sm_86/89 at 99 KiB)"),
    )),
    (144, 200, None, (
        Tile(128, 128, 8, 2, False,
             "d160: 291 TFLOP/s non-causal / 263 causal vs 241 / 208 for the earlier 128x64 w8 s1 (+21% / +26%); "
             "240-242 regs, 0 spills; fits sm_90's 227 KiB only up to d160"),
        Tile(128, 64, 8, 2, False,
             "d192: 295 / 255 TFLOP/s vs 247 / 218 for 128x64 w8 s1 (+19% / +17%) and 279 / 251 for 64x64 w4 s1; "
             "194-229 regs, 0 spills"),
        Tile(64, 64, 4, 1, False, "fallback when 128-row tiles do not fit smem (sm_86/89: 99 KiB)"),
        Tile(64, 32, 4, 1, False, "last resort for the smallest smem budgets"),
    )),
    (208, 256, None, (
        Tile(64, 64, 4, 1, False,
             "d256: 312 TFLOP/s non-causal / 268 causal vs 283 / 252 for 128x64 w8 s2 and 275 / 230 for 128x64 w8 "
             "s1 (+13% / +17%); 214-240 regs, 0 spills; fits every sm_8x/9x smem budget"),
        Tile(64, 32, 4, 1, False, "last resort for the smallest smem budgets"),
    )),
]


# Masked variants (window, softcap, varlen) hold a few more registers than the dense kernel, and
# the dense tiles sit at the register limit: each masked config takes the first candidate that
# ptxas (this NVRTC) builds without spills, ending with 16-row warps (half the accumulators).
# NVRTC 13.5, sm_90, bf16: softcap alone spills 12-68 B at d64 causal and d160-168, varlen 8 B at
# d120 causal; all three options together 11 of the 64 (head_dim, causal) configs.
_MASKED_FALLBACK = (Tile(64, 64, 4, 1, False, "masked fallback: 16 rows per warp"),
                    Tile(64, 32, 4, 1, False, "masked fallback for the smallest smem budgets"))


def _smem_limit(arch: str) -> int:
    try:
        return _arch.limits(arch).max_smem_per_block_optin
    except ConfigError:
        return 99 * 1024   # unknown arch: assume the smallest sm_8x/sm_12x budget


def candidates(head_dim: int, causal: bool) -> tuple[Tile, ...]:
    for lo, hi, c, tiles in HEURISTICS:
        if lo <= head_dim <= hi and (c is None or c == causal):
            return tiles
    raise ConfigError.bad_value(FAMILY, "head_dim", head_dim, "a multiple of 8 in [8, 256]")


def choose_config(dtype: str, head_dim: int, causal: bool, arch: str, **mask_flags) -> AttentionConfig:
    """The config the heuristics pick for (dtype, head_dim, causal, arch); ``mask_flags``: the
    other compile-time mask fields (has_window, has_softcap, is_varlen), same tiles."""
    limit = _smem_limit(arch)
    tiles = candidates(head_dim, causal)
    if any(mask_flags.values()):
        tiles = tiles + _MASKED_FALLBACK
    fits = []
    for t in tiles:
        cfg = AttentionConfig(dtype=dtype, head_dim=head_dim, causal=causal, block_m=t.block_m,
                              block_n=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages,
                              q_in_regs=t.q_in_regs, **mask_flags)
        if cfg.shared_mem_bytes <= limit:
            if not any(mask_flags.values()):
                return cfg
            fits.append(cfg)
    if fits:
        return first_without_spills(fits, arch)
    raise ConfigError(f"attention: no tile for head_dim={head_dim} fits {arch}'s {limit} B of shared memory per "
                      f"block", family=FAMILY, field="head_dim", value=head_dim, allowed="a smaller head_dim")


def tile_space(dtype: str, head_dim: int, causal: bool, arch: str) -> list[AttentionConfig]:
    """Candidates the autotuner times: the heuristic's tiles plus 64/128-row tiles with 16 or 32 rows
    per warp, 32/64/128-key tiles, single or double K/V buffer - those that fit shared memory.
    (Spilling ones are pruned from the ptxas report before anything is launched.)"""
    limit = _smem_limit(arch)
    out = [choose_config(dtype, head_dim, causal, arch)]
    for t in candidates(head_dim, causal):
        out.append(AttentionConfig(dtype=dtype, head_dim=head_dim, causal=causal, block_m=t.block_m,
                                   block_n=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages,
                                   q_in_regs=t.q_in_regs))
    for block_m in (64, 128):
        for rows in (16, 32):
            warps = block_m // rows
            if warps not in (2, 4, 8):
                continue
            for block_n in (32, 64, 128):
                for stages in (1, 2):
                    out.append(AttentionConfig(dtype=dtype, head_dim=head_dim, causal=causal, block_m=block_m,
                                               block_n=block_n, num_warps=warps, num_stages=stages))
    return [c for c in dict.fromkeys(out) if c.shared_mem_bytes <= limit]


def _seqlen_bucket(n: int) -> int:
    """Autotune key part: powers of two from 128 (tile choice changes slowly with length)."""
    return max(128, 1 << (max(n, 1) - 1).bit_length())


def heuristic_configs(arch: str = "sm_90", dtypes=("float16", "bfloat16")) -> list[AttentionConfig]:
    """Every config the heuristics can pick on ``arch`` (head_dim 8..256 step 8 x dtype x causal):
    the sweep `rtk report attention` and the no-spill test compile."""
    return [choose_config(dt, d, c, arch) for d in range(8, 257, 8) for dt in dtypes for c in (False, True)]


# ---- the op -------------------------------------------------------------------------------
_FLOATS = ("float16", "bfloat16")
_GRID_YZ_MAX = 65535


def _kernel_for(dtype: str, head_dim: int, causal: bool, arch: str, mask_flags: tuple = ()):
    """(Kernel, config), memoized: a hot call neither rebuilds the config nor re-renders.
    ``mask_flags``: (name, value) pairs of the other compile-time mask fields."""
    key = (dtype, head_dim, causal, arch, mask_flags)
    hit = _KERNELS.get(key)
    if hit is None:
        from ..kernel import get_kernel
        cfg = choose_config(dtype, head_dim, causal, arch, **dict(mask_flags))
        hit = _KERNELS[key] = (get_kernel(cfg, arch=arch), cfg)
    return hit


_KERNELS: dict = {}


def _bad(field: str, value: Any, message: str, op: str = FAMILY) -> ConfigError:
    return ConfigError(f"{op}: {message}", family=op, field=field, value=value, allowed=message)


def _elem_strides(view, name: str, op: str = FAMILY) -> tuple[int, ...]:
    """Strides in elements; the last must be 1 and the others whole 16-byte chunks (cp.async).
    ``op``: the op named in errors."""
    item = view.itemsize
    shape, strides = view.shape, view.strides
    out = []
    for dim, (n, s) in enumerate(zip(shape, strides)):
        if s % item:
            raise _bad(name, strides, f"{name} has stride {s} bytes in dim {dim}, not a whole number of elements", op)
        out.append(0 if n == 1 else s // item)   # a size-1 dim's stride is never used
    if 0 in shape:   # an empty array (a varlen batch with no keys at all): no stride is ever used
        return tuple(0 for _ in out)
    if shape[-1] > 1 and out[-1] != 1:
        raise _bad(name, strides, f"{name} must have a contiguous last dimension (stride 1), got strides "
                                  f"{tuple(s // item for s in strides)} elements; pass {name}.copy() or a "
                                  "contiguous view", op)
    if any(s % 8 for s in out[:-1]):
        raise _bad(name, strides, f"{name} strides {tuple(out)} (elements) must be multiples of 8 (16-byte rows "
                                  f"for cp.async) in every dimension but the last; pass a contiguous copy", op)
    if view.data.ptr % 16:
        raise _bad(name, view.data.ptr, f"{name} must start at a 16-byte aligned address (got {view.data.ptr:#x}); "
                                        "pass a contiguous copy", op)
    return tuple(out)


def _direct(info) -> bool:
    """Whether the mma.sync kernels read a q/k/v/o/do view as it is: a 16-byte aligned base, a
    unit-stride last dim and every other stride a multiple of 16 bytes (cp.async moves 16-byte
    chunks of rows).  Their addressing is ``sum(index * stride)`` in 64-bit integers, so stride 0
    (broadcast), overlapping and negative strides (a reversed view, tests/test_attention_sm90.py)
    read exactly; the Hopper kernels' tensor maps need :attr:`ViewInfo.tma` on top."""
    return info.kind in (_views.CONTIGUOUS, _views.UNIT, _views.NEGATIVE) and info.unit(-1) and \
        info.address % 16 == 0 and all(n == 1 or s % 16 == 0 for n, s in zip(info.shape[:-1], info.strides[:-1]))


def read_inputs(family: str, named, stream, tma: bool):
    """(views, staged): the input views the kernels read, each as given when :func:`_direct` (and
    with ``tma``, the Hopper kernel's case, when a tensor map can encode it), else a compact copy
    made on ``stream``; ``staged``: whether any is a copy (then the call keeps no launch plan, which
    would replay on the caller's arrays).  Misaligned elements are rejected, naming the argument."""
    ok = (lambda i: i.tma and _direct(i)) if tma else _direct
    out, staged = [], False
    for name, view in named:
        view, copied = _views.read_view(family, name, view, stream, ok)
        out.append(view)
        staged |= copied
    return out, staged


def check_output(family: str, name: str, view) -> None:
    """An output the kernels write: no two indices on one element (broadcast or overlapping views
    would race), then the input rules (:func:`_elem_strides`)."""
    _views.check_output(family, name, _views.of(view),
                        "pass an array whose elements are distinct, with a contiguous last dimension, other "
                        "strides multiples of 8 elements and a 16-byte aligned start")


def collapse_broadcast_heads(k_, v_):
    """K and V broadcast over their heads (head stride 0, e.g. ``k[:, :, :1].expand(b, s, h, d)``)
    are multi-query attention: every query head reads one K/V head.  Their first head alone is the
    same problem with nheads_kv = 1 (GQA), read in place by both kernels, which a tensor map can
    encode (stride 0 it cannot).  Only for the forward: the backward's dk / dv have k's shape, one
    gradient per broadcast head, which a collapsed K would sum."""
    if k_.ndim == 4 and k_.shape[2] > 1 and k_.strides[2] == 0 and v_.strides[2] == 0:
        return k_[:, :, :1], v_[:, :, :1]
    return k_, v_


def _dtype_of(x, name: str, dtype: str | None, op: str = FAMILY) -> str:
    from ._arrays import dtype_name
    actual = dtype_name(x)
    if dtype is not None:
        want = _canonical_float(dtype)
        if actual == "uint16" and want == "bfloat16":
            return "bfloat16"
        if actual != want:
            raise _bad(name, actual, f"{name} has dtype {actual}, but dtype={want!r} was given "
                                     "(uint16 arrays are read as bfloat16 bits only with dtype='bfloat16')", op)
        return want
    if actual == "uint16":
        raise _bad(name, actual, f"{name} has dtype uint16; to pass bfloat16 bits in a uint16 CuPy array, "
                                 f"call {op}(..., dtype='bfloat16')", op)
    if actual not in _FLOATS:
        raise _bad(name, actual, f"{name} has dtype {actual}; allowed: float16, bfloat16", op)
    return actual


def _canonical_float(dtype) -> str:
    from .. import dtypes
    return dtypes.canonical(dtype, family=FAMILY, field="dtype", allowed=_FLOATS)


def _device_of(view) -> int:
    return int(view.device.id)


class Inputs(NamedTuple):
    views: dict          # name -> zero-copy CuPy view
    dtype: str
    device: int
    seqlen_k: int
    nheads_kv: int
    softmax_scale: float


def check_inputs(arrays: dict, dtype: str | None, softmax_scale, family: str, varlen: bool = False) -> Inputs:
    """The checks rtk.attention and rtk.attention_backward share, in one place.

    ``arrays`` maps names to arrays and must hold q, k and v; any other entry (do, o) must have
    q's shape.  ``varlen``: the arrays are packed (total, nheads, head_dim) and the views come back
    as (1, total, nheads, head_dim), so everything after sees one layout.  Raises ConfigError
    naming the array, the value and what is allowed.
    """
    from ._arrays import as_device_array

    def bad(field, value, message):
        return ConfigError(f"{family}: {message}", family=family, field=field, value=value, allowed=message)

    names = list(arrays)
    listing = ", ".join(names[:-1]) + " and " + names[-1]
    views = {n: as_device_array(a, family, n) for n, a in arrays.items()}
    dts = {n: _dtype_of(a, n, dtype) for n, a in arrays.items()}
    if len(set(dts.values())) != 1:
        raise bad("dtype", dts, f"{listing} must have the same dtype, got "
                  + ", ".join(f"{n}={d}" for n, d in dts.items()))
    for name, view in views.items():
        if view.ndim != (3 if varlen else 4):
            layout = ("3-D (total, nheads, head_dim) with cu_seqlens" if varlen else
                      "4-D (batch, seqlen, nheads, head_dim) (or 3-D packed sequences with cu_seqlens_q/k)")
            raise bad(name, view.shape, f"{name} must be {layout}, got shape {tuple(view.shape)}")
    if varlen:
        views = {n: view[None] for n, view in views.items()}
    q_, k_, v_ = views["q"], views["k"], views["v"]
    batch, seqlen_q, nheads, head_dim = q_.shape
    _, seqlen_k, nheads_kv, _ = k_.shape
    if v_.shape != k_.shape:
        raise bad("v", v_.shape, f"v must have k's shape {tuple(k_.shape)}, got {tuple(v_.shape)}")
    if k_.shape[0] != batch or k_.shape[3] != head_dim:
        raise bad("k", k_.shape, f"k must be (batch={batch}, seqlen_k, nheads_kv, head_dim={head_dim}) to match q "
                                 f"{tuple(q_.shape)}, got {tuple(k_.shape)}")
    for name, view in views.items():
        if name not in ("q", "k", "v") and view.shape != q_.shape:
            raise bad(name, view.shape, f"{name} must have q's shape {tuple(q_.shape)}, got {tuple(view.shape)}")
    if head_dim % 8 or not 8 <= head_dim <= 256:
        raise ConfigError.bad_value(family, "head_dim", head_dim, "a multiple of 8 in [8, 256] (q.shape[-1])")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise bad("nheads_kv", nheads_kv, f"nheads={nheads} must be a multiple of nheads_kv={nheads_kv} "
                                          "(k.shape[2])")
    devs = {n: _device_of(view) for n, view in views.items()}
    if len(set(devs.values())) != 1:
        raise bad("device", devs, f"{listing} must be on the same device, got "
                  + ", ".join(f"{n} on {d}" for n, d in devs.items()))
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise bad("softmax_scale", softmax_scale, f"softmax_scale must be a positive finite float, got "
                                                  f"{softmax_scale!r}")
    if batch > _GRID_YZ_MAX or nheads > _GRID_YZ_MAX:
        raise bad("q", q_.shape, f"batch and nheads must be at most {_GRID_YZ_MAX} (grid dimensions), got "
                                 f"batch={batch}, nheads={nheads}")
    return Inputs(views, dts["q"], devs["q"], seqlen_k, nheads_kv, float(softmax_scale))


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = True,
              out=None, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, window: tuple[int, int] | None = None, softcap: float | None = None,
              dtype: str | None = None, stream=None):
    """FlashAttention-2 forward: ``softmax(softmax_scale * q k^T [+ mask]) v``.

    Dense calls with few query rows (decoding through a model's own attention call) run on the
    KV-cache decode kernel over the whole of k and v where :func:`decode_route` says it is faster
    (the same o and lse; ``RTKERNELS_ATTENTION_DECODE=0`` keeps them on the dense kernels).

    Parameters
    ----------
    q : (batch, seqlen_q, nheads, head_dim) device array, or (total_q, nheads, head_dim) with
        cu_seqlens (varlen).
    k, v : (batch, seqlen_k, nheads_kv, head_dim), or (total_k, nheads_kv, head_dim) with
        cu_seqlens; ``nheads % nheads_kv == 0`` (GQA / MQA read each K/V head for its group of
        query heads, nothing is repeated in memory).
        Accepted arrays: CuPy arrays, torch CUDA tensors, and any ``__cuda_array_interface__`` or
        DLPack device array.  float16 or bfloat16, all three the same.  bfloat16 comes as torch
        tensors, or as uint16 CuPy arrays of bfloat16 bits together with ``dtype="bfloat16"``.
        Views read in place (no copy): last dimension contiguous, other strides non-negative
        multiples of 8 elements and a 16-byte aligned start - contiguous arrays, slices of a packed
        (batch, seqlen, 3, nheads, head_dim) qkv array.  K and V broadcast over their heads
        (``k[:, :, :1].expand(...)``, head stride 0) run as nheads_kv = 1, in place.  Other stride-0
        (broadcast), overlapping or negative strides are read in place by the mma.sync kernel; on
        sm_90 the Hopper kernel's tensor maps cannot encode them, so such inputs are copied.
        Everything else (a strided last dimension, odd strides or offsets) is copied to a
        compact array on the call's stream first; a call that copies keeps no launch plan.
        Elements not aligned to their size raise ConfigError.
    causal : mask aligned to the bottom-right corner: query i sees key j iff
        ``j <= i + seqlen_k - seqlen_q`` (within each sequence when varlen).  A query that sees no
        key gets o = 0 and lse = -inf.  The same as ``window=(-1, 0)``.
    softmax_scale : positive finite float; default ``1 / sqrt(head_dim)``.
    return_lse : also return the log-sum-exp (natural log) per (batch, head, query row).
    out : optional output array for o: shape of q, same dtype and device, last dimension contiguous,
        other strides multiples of 8 elements, 16-byte aligned.  A broadcast (stride 0) or
        overlapping out is rejected: its writes would race.
    cu_seqlens_q, cu_seqlens_k : int32 (batch + 1,) device arrays starting at 0, non-decreasing,
        ending at total_q / total_k: sequence b is rows ``cu[b]:cu[b+1]`` of q resp. k and v
        (FlashAttention's varlen layout; sequences may be empty, and q and k lengths may differ).
        Both or neither.  The packed q, k, v follow the view rules above (staged the same way);
        varlen calls keep no launch plan.
    max_seqlen_q, max_seqlen_k : the longest sequences (hints).  The grid never needs them (a
        schedule pre-kernel hands out the tiles), but when either is missing cu_seqlens is read
        back to the host to compute it - **a device-to-host copy and a stream synchronization**
        - and checked (starts at 0, non-decreasing, ends at the totals: ConfigError otherwise).
        With both given nothing is read (CUDA-graph capture works) and cu_seqlens is trusted:
        the kernels clamp every sequence into the arrays, so a malformed one gives wrong values
        for its sequences but no access outside the arrays.
    window : ``(left, right)``, -1 = unbounded (FlashAttention's convention): query i sees key j
        iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``.  With ``causal=True`` right is 0
        (``window=(left, 0)`` is the usual sliding window).  Key tiles outside every row's window
        are skipped: the work scales with the window.
    softcap : c > 0 caps the scores: ``c * tanh(softmax_scale * q.k / c)`` before the softmax
        (Gemma 2); None or 0 for none.
    dtype : "bfloat16" to read uint16 CuPy arrays as bfloat16 bits (else taken from the arrays).
    stream : CuPy stream, torch stream or raw handle; default the current CuPy stream, or torch's
        current stream when the inputs are torch tensors.

    Returns
    -------
    ``(o, lse)`` or ``o`` when ``return_lse`` is False.  o has q's shape and dtype and is the same
    kind of array as q (torch in, torch out; CuPy in, CuPy out - uint16 bits for bfloat16); lse is
    float32 (batch, nheads, seqlen_q), or (nheads, total_q) with cu_seqlens, contiguous.

    Raises
    ------
    ConfigError : wrong dtype, shape, head_dim (a multiple of 8 in [8, 256]), strides, devices,
        out, window, softcap or cu_seqlens; nothing is launched.
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        plan_key = _varlen_plan_key(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    softmax_scale, return_lse, dtype, window, softcap)
        vplan = _VARLEN_PLANS.get(plan_key)
        if vplan is not None:
            return vplan.replay(q, k, v, out, cu_seqlens_q, cu_seqlens_k, return_lse, stream, plan_key[1])
    else:
        plan_key = _forward_plan_key(q, k, v, out, causal, softmax_scale, return_lse, dtype, window, softcap)
        plan = _FORWARD_PLANS.get(plan_key)
        if plan is not None:
            if plan.__class__ is DecodeRoute:
                return plan.run(q, k, v, out, return_lse, stream)
            return _replay_forward(plan, q, k, v, out, return_lse, stream, plan_key[1])
    # the full path is a function of its own: its nested ``run`` closes over 18 of its variables,
    # and a function with closed-over variables makes a cell for each at every call - plan hits
    # included (~6k instructions, ~1 us a call on the development CPU, 2026-11-26)
    return _attention_full(q, k, v, causal, softmax_scale, return_lse, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, window, softcap, dtype, stream, varlen, plan_key)


def _attention_full(q, k, v, causal, softmax_scale, return_lse, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, window, softcap, dtype, stream, varlen, plan_key):
    """:func:`attention` without a launch plan: check, choose, launch, and record the plan
    (``plan_key``: the call's LaunchPlans key, or None)."""
    from ._arrays import as_device_array, new_like   # (off the replay path: an import costs ~0.5 us a call)
    import cupy
    spec = mask_spec(causal, window, softcap, varlen, family=FAMILY)
    p = check_inputs({"q": q, "k": k, "v": v}, dtype, softmax_scale, FAMILY, varlen=varlen)
    dt, dev, softmax_scale = p.dtype, p.device, p.softmax_scale
    q_ = p.views["q"]
    k_, v_ = collapse_broadcast_heads(p.views["k"], p.views["v"])
    batch, seqlen_q, nheads, head_dim = q_.shape     # varlen: (1, total_q, nheads, head_dim)
    seqlen_k, nheads_kv = k_.shape[1], k_.shape[2]
    causal = spec.causal
    vl = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqlen_q, seqlen_k, dev,
                      FAMILY) if varlen else None
    user_shape = tuple(q_.shape[1:]) if varlen else tuple(q_.shape)

    empty = batch == 0 or seqlen_q == 0 or nheads == 0
    # (not with K/V broadcast over their heads: the decode kernel would read the one head per query
    # head, where the dense kernels read it as multi-query attention)
    if spec.dense and not empty and p.views["k"].shape[2] == nheads_kv and \
            decode_route(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, q_.dtype.itemsize):
        from .attention_kvcache import attention_kvcache   # (see DecodeRoute)
        try:
            if plan_key is None:   # (no launch plan for this call: see _forward_plan_key)
                return attention_kvcache(q, k, v, None, causal=causal, softmax_scale=softmax_scale,
                                         return_lse=return_lse, out=out, dtype=dtype, stream=stream)
            route = DecodeRoute(q, k, v, out, causal, softmax_scale, return_lse, dtype)   # planned once
        except ConfigError:   # arrays the decode kernel does not take: the dense path
            pass
        else:
            result = route.run(q, k, v, out, return_lse, stream)   # (the plan serves this call too)
            _FORWARD_PLANS.put(plan_key, route)
            return result
    with cupy.cuda.Device(dev):
        arch = _device_arch(dev)
        stream = default_stream(q, stream)
        staged = False
        if not empty:
            # the Hopper kernel (whenever it may run) reads through tensor maps: stage what they cannot
            # encode.  Varlen views are (1, total, nheads, head_dim): the same rules, the same copies.
            tma = _sm90.ENABLED and _sm90.is_sm90(arch) and seqlen_k >= 1
            (q_, k_, v_), staged = read_inputs(FAMILY, (("q", q_), ("k", k_), ("v", v_)), stream, tma)
            sq_, sk_, sv_ = (_elem_strides(view, n) for view, n in ((q_, "q"), (k_, "k"), (v_, "v")))
        o = new_like(q, user_shape, dt) if out is None else out
        o_ = as_device_array(o, FAMILY, "out")
        if out is not None:
            from ._arrays import dtype_name
            odt = "bfloat16" if (dt == "bfloat16" and str(o_.dtype) == "uint16") else dtype_name(o)
            if tuple(o_.shape) != user_shape or odt != dt or _device_of(o_) != dev:
                raise _bad("out", o_.shape, f"out must be a {dt} array of shape {user_shape} on device {dev}, "
                                            f"got {odt} {tuple(o_.shape)} on device {_device_of(o_)}")
            if not empty:
                check_output(FAMILY, "out", o_)
        if varlen:
            o_ = o_[None]
        so_ = None if empty else _elem_strides(o_, "out")
        lse_shape = (nheads, seqlen_q) if varlen else (batch, nheads, seqlen_q)
        lse = new_like(q, lse_shape, "float32") if return_lse else None
        if empty:
            return (o, lse) if return_lse else o
        lse_ = as_device_array(lse, FAMILY, "lse") if return_lse else None

        mask_args = spec.kernel_args(seqlen_q, seqlen_k)   # dense: the lengths; varlen: the totals
        flags = tuple(spec.flags().items())[1:]             # all but causal
        # sm_90: the TMA/wgmma kernel (rtkernels.ops.attention_sm90) whenever TMA can address
        # the arrays; everything else, and other archs, the mma.sync kernel below.
        hopper = _sm90.eligible(arch, (q_, k_, v_, o_), seqlen_k)
        tune = _autotune.enabled() and spec.dense
        if hopper:
            # short dense problems may take another schedule (attention_sm90.SHORT_SCHEDULE): chosen here,
            # once per signature - later calls replay the recorded launch
            # softcap: a fixed exponent reference instead of the running max where the cap's range fits
            # (attention_sm90.softcap_fixed_max); part of the kernel's memo key like the mask flags
            capped = spec.has_softcap and _sm90.softcap_fixed_max(dt, spec.softcap, head_dim, causal)
            fixed = (("fixed_max", True),) if capped else ()
            kern, cfg = _sm90.kernel_for(dt, head_dim, causal, arch, flags + fixed, None if varlen else seqlen_k)
            if not tune:
                if varlen:   # one plan for this call and, with both hints, the later ones
                    vplan = VarlenForwardPlan.record(kern, cfg, (q_, k_, v_, o_), o, lse, softmax_scale, mask_args,
                                                     vl, causal, arch)
                    vplan.run(q_, k_, v_, o_, lse_, vl.cu_q, vl.cu_k, q, dev, stream)
                    if plan_key is not None and not staged and same_memory((q_, k_, v_, o_), (q, k, v, o)):
                        _VARLEN_PLANS.put(plan_key, vplan)
                    return (o, lse) if return_lse else o
                _sm90.launch(kern, cfg, q_, k_, v_, o_, lse_, softmax_scale, stream, mask_args=mask_args)
                if plan_key is not None and not staged:
                    _remember_forward(plan_key, kern, cfg, (q_, k_, v_, o_), o, lse, softmax_scale, mask_args, q)
                return (o, lse) if return_lse else o
        else:
            kern, cfg = _kernel_for(dt, head_dim, causal, arch, flags)
        args = (q_, k_, v_, o_, lse_, seqlen_q, seqlen_k, nheads // nheads_kv,
                sq_[0], sq_[1], sq_[2], sk_[0], sk_[1], sk_[2], sv_[0], sv_[1], sv_[2], so_[0], so_[1], so_[2],
                float(softmax_scale))

        def run(c, k=None):
            k = k or _get_kernel(c, arch)
            if isinstance(c, _sm90.AttentionSm90Config):
                _sm90.launch(k, c, q_, k_, v_, o_, lse_, softmax_scale, stream)
                return
            if varlen:
                sched, slots = _schedule_for(vl, c.block_m, causal, arch, stream, q, dev)
                k.launch((nheads * slots,), (c.threads_per_block,), *args, vl.cu_q, vl.cu_k, sched, nheads,
                         *mask_args, shared_mem=c.shared_mem_bytes, stream=stream)
                return
            k.launch((-(-seqlen_q // c.block_m), nheads, batch), (c.threads_per_block,), *args, None, None, None,
                     nheads, *mask_args, shared_mem=c.shared_mem_bytes, stream=stream)

        if tune:
            key = {"dtype": dt, "head_dim": head_dim, "causal": causal, "arch": arch,
                   "seqlen_q": _seqlen_bucket(seqlen_q), "seqlen_k": _seqlen_bucket(seqlen_k)}
            space = tile_space(dt, head_dim, causal, arch)
            if hopper:   # both kernels compete; the entry keeps this family's name
                space = _sm90.tile_space(dt, head_dim, causal) + space
            best = _autotune.pick(FAMILY, key, space, run, cfg, arch=arch, kernel=None)
            if best != cfg:
                kern, cfg = _get_kernel(best, arch), best
        run(cfg, kern)
    return (o, lse) if return_lse else o


def _schedule_for(vl: Varlen, block: int, descending: bool, arch: str, stream, like, dev: int):
    """(schedule table, slots) for ``block``-row tiles of the query sequences (keys set the work),
    the table in the stream's workspace (ops/workspace.py, made like the caller's ``like`` on
    ``dev``: kept for good, so a CUDA graph that captured the call replays into memory it still
    owns) - the mma.sync forward's; the Hopper one's is VarlenForwardPlan.run."""
    from .workspace import stream_workspace
    slots = schedule_slots(vl, block)
    table = stream_workspace(like, dev, stream, 8 * slots, 0)[0]
    return schedule(vl.cu_q, vl.cu_k, vl.batch, vl.total_q, vl.total_k, block, slots, descending, arch, stream,
                    table), slots


# ---- dense calls with few query rows: the split-KV decode kernel ---------------------------------
# This module's kernels give a CTA a tile of query rows of one (batch, head): with a few rows per
# sequence the grid is batch x heads CTAs of mostly idle rows, every query head of a GQA group reads
# the group's K/V again, and at batch 1 a long key range runs on `heads` CTAs.  The KV-cache kernel
# (attention_kvcache, issue 15) packs a group's query rows into one CTA and splits the keys across
# the GPU; with cache_seqlens=None it reads the whole cache, which is exactly a dense call (same
# bottom-right causal mask, same o and lse).  Measured (H200, 2026-11-28, 252 cells: head dims 64 /
# 128, GQA 1 / 4 / 8, batch 1-128, keys 256-32k, seqlen_q 1-256, causal or not; bf16 torch
# tensors, GPU time of calls queued back to back, the two paths interleaved;
# docs/data/attention_decode_route_probe_session36_*), dense -> decode kernel:
#   seqlen_q <= 16 with seqlen_q x group <= 64 rows per kv head (126 cells): faster or level in
#     every cell, 0.986-12.8x (d64 GQA 8 B1 S32k 217 -> 17 us, d128 GQA 4 B8 S8k 193 -> 65 us, d128
#     MHA B32 S2k 135 -> 125 us); below 1.05 only d128 GQA 4 seqlen_q 16 B8 S1k (0.986 / 1.028).
#   more rows: the dense kernel wins from batch 8 at group 1-4 (seqlen_q 64-256: 0.40-1.19x, d128
#     0.40-1.03x), except where its grid is a fraction of the GPU over long keys: batch 1, 16-32 heads,
#     32k keys, seqlen_q 16-128: 1.67-5.2x (14 cells; seqlen_q 256: 0.88-3.1x, not taken).
#   GQA with 65-512 rows per kv head at seqlen_q 8-32 (H200, 2026-11-29, 99 cells of >= 16 MiB of
#     K/V: d64 / d96 / d128, groups 4 / 8 / 16 (32/8, 32/4, 64/8, 32/2 heads), batch 1-64, keys 1k-32k;
#     docs/data/attention_decode_route_rows_probe_session37_*): 1.22-6.2x in the 95 cells whose keys
#     are >= 2k or whose dense grid holds >= 512 CTAs (d128 64/8 seqlen_q 16 B8 S1k 46 -> 31 us); the
#     decode kernel's short splits of 128-256 rows run ~31 us at 1k keys, so a dense grid of 256 CTAs
#     there wins (the other 4: d128 32/4 and 32/8, B8 S1k, seqlen_q 16 / 32, 0.81-0.84x).  Multi-head
#     attention at seqlen_q 32 stays dense (B8: 0.98-0.99x; 21 cells measured).
# Host time (H200 host, torch tensors, d128 GQA 4 B1 S2k, 8 MiB of K/V; host_decode_route_session36_*):
# a routed call enqueues in 33 us against 23 for a dense plan replay (the decode plan's arguments and
# its launches), while its GPU time is 6 against 22 us.  An eager loop waits for the slower of the
# two, so routing pays there only where the dense kernel's GPU time exceeds ~33 us: K/V of at least
# 16 MiB with GQA or a small dense grid (B1 S4k d128 GQA 4: 39 -> 10 us of GPU), and for multi-head
# attention on a full grid (1.05-1.4x faster only) at least 128 MiB, where both are GPU-bound.
# Calls queued behind others (pipelines, CUDA graphs) gain at any size.
# RTKERNELS_ATTENTION_DECODE=0 keeps every call dense.
DECODE_ENV = "RTKERNELS_ATTENTION_DECODE"
DECODE_MAX_SEQLEN_Q = 16
DECODE_MAX_ROWS = 64          # seqlen_q x group
DECODE_MIN_KEYS = 256         # the smallest key count measured
DECODE_MIN_KV_BYTES = 16 << 20
DECODE_MHA_MIN_KV_BYTES = 128 << 20   # group 1 on a full dense grid
DECODE_SMALL_GRID = 32        # dense CTAs (batch x heads x 128-row query tiles) that leave most SMs idle
DECODE_GQA_MAX_SEQLEN_Q = 32  # GQA: more rows per kv head, when the keys are long or the dense grid is large
DECODE_GQA_MAX_ROWS = 512
DECODE_GQA_KEYS = 2048
DECODE_GQA_GRID = 512
DECODE_LONG_KEYS = 16384      # ... over this many keys any seqlen_q up to:
DECODE_LONG_MAX_SEQLEN_Q = 128


def decode_route(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_kv: int, head_dim: int,
                 itemsize: int = 2) -> bool:
    """Whether a dense call (no window, softcap or varlen) runs on the KV-cache decode kernel
    (see the measurements above); ``itemsize``: bytes per element of k and v."""
    kv_bytes = batch * seqlen_k * nheads_kv * head_dim * 2 * itemsize
    if seqlen_k < DECODE_MIN_KEYS or kv_bytes < DECODE_MIN_KV_BYTES or getenv_raw(DECODE_ENV) in (b"0", "0"):
        return False
    dense_ctas = batch * nheads * -(-seqlen_q // 128)
    small_grid = dense_ctas <= DECODE_SMALL_GRID
    rows = seqlen_q * (nheads // nheads_kv)
    if seqlen_q <= DECODE_MAX_SEQLEN_Q and rows <= DECODE_MAX_ROWS:
        return nheads_kv < nheads or small_grid or kv_bytes >= DECODE_MHA_MIN_KV_BYTES
    if nheads_kv < nheads and seqlen_q <= DECODE_GQA_MAX_SEQLEN_Q and rows <= DECODE_GQA_MAX_ROWS and \
            (seqlen_k >= DECODE_GQA_KEYS or dense_ctas >= DECODE_GQA_GRID):
        return True
    return small_grid and seqlen_q <= DECODE_LONG_MAX_SEQLEN_Q and seqlen_k >= DECODE_LONG_KEYS


class DecodeRoute:
    """A dense call signature's plan that runs the KV-cache decode kernel over the whole of k and v
    as a full cache (``cache_seqlens=None``): its plan, made once, replayed directly."""
    __slots__ = ("plan", "causal", "softmax_scale", "dtype", "_kv")

    def __init__(self, q, k, v, out, causal: bool, softmax_scale, return_lse: bool, dtype):
        # imported here: attention_kvcache imports this module's checks at its top
        from . import attention_kvcache as kv
        self._kv, self.causal, self.softmax_scale, self.dtype = kv, causal, softmax_scale, dtype
        self.plan = kv._plan((q, k, v, None, None, None, None, out), causal, softmax_scale, return_lse, None,
                             dtype)[0]

    def run(self, q, k, v, out, return_lse: bool, stream):
        if self.plan is not None:
            try:
                return self._kv._execute(self.plan, q, k, v, None, None, None, None, out, stream)
            except self._kv._GroupRefused:   # the cooperative merge was refused: attention_kvcache replans
                self.plan = None
        return self._kv.attention_kvcache(q, k, v, None, causal=self.causal, softmax_scale=self.softmax_scale,
                                          return_lse=return_lse, out=out, dtype=self.dtype, stream=stream)


# ---- per-signature launch plans (Hopper kernel, heuristic tiles) ---------------------------------
# check_inputs, the views of torch tensors, the stride checks and the tensor-map lookups cost
# ~120 us of host time per rtk.attention call with torch tensors (H200 host, 2026-11-21: 5-20x
# the kernel of a decoding-sized problem).  What they decide depends only on each array's dtype,
# shape, strides, 16-byte alignment and device plus the options, so the first call with a
# signature records the launch and later ones allocate the outputs, look up the four tensor maps
# for the new base addresses (rtkernels.tma memoizes them) and launch.  torch tensors launch on
# torch's current stream (as the full path does) from their addresses, without views.
_FORWARD_PLANS = LaunchPlans(1024)


def _forward_plan_key(q, k, v, out, causal, softmax_scale, return_lse, dtype, window=None, softcap=None):
    # the environment as stored (no decode per call); RTKERNELS_AUTOTUNE=1 takes the full path
    if not _sm90.ENABLED or (getenv_raw("RTKERNELS_AUTOTUNE") is not None and _autotune.enabled()):
        return None
    return _FORWARD_PLANS.key((q, k, v, out), (bool(causal), softmax_scale, bool(return_lse), dtype, window, softcap,
                                                  getenv_raw("RTKERNELS_ARCH"), getenv_raw(DECODE_ENV)))


def _remember_forward(key, kern, cfg, views, o, lse, softmax_scale, mask_args, q) -> None:
    """The plan: the launch, o's allocation (like q's where q is laid out as o), and as ``extra``
    the config, the tensor maps' (shape, strides, box) and lse's (shape, dtype) or None."""
    _FORWARD_PLANS.put(key, OutputPlan.of(_sm90.recorded_launch(kern, cfg, views[0], views[1], softmax_scale,
                                                                mask_args), o,
                                          (cfg, _sm90.map_specs(cfg, *views),
                                           None if lse is None else (tuple(lse.shape), lse.dtype)), like=q))


# ---- varlen launch plans -----------------------------------------------------------------------
# A varlen call's full path (checks, views, the schedule's and the kernel's argument lists) cost
# 218 us of host time per forward call on an H200 host (CuPy arrays, 2026-11-26; 14 us for a
# dense call replaying its plan), so at 16 x 512 tokens the host, not the GPU, set the pace.  What
# the path decides depends on the arrays' signatures (cu_seqlens included: int32, contiguous,
# batch + 1), the max_seqlen hints (the schedule's slots, the grid) and the options - not on
# cu_seqlens' contents, which the kernels read on the device - so a call with both hints records
# its two launches and later calls with the same key replay them (no host read: capturable).
_VARLEN_PLANS = LaunchPlans(256)


def _varlen_plan_key(q, k, v, out, cu_q, cu_k, max_q, max_k, causal, softmax_scale, return_lse, dtype, window,
                     softcap):
    """The plan key of a varlen forward call, or None (a missing or non-int hint: the full path
    reads cu_seqlens, and its checks report bad hints)."""
    if type(max_q) is not int or type(max_k) is not int or not _sm90.ENABLED:
        return None
    if getenv_raw("RTKERNELS_AUTOTUNE") is not None and _autotune.enabled():
        return None
    return _VARLEN_PLANS.key((q, k, v, out, cu_q, cu_k),
                             (bool(causal), softmax_scale, bool(return_lse), dtype, window, softcap, max_q, max_k,
                              getenv_raw("RTKERNELS_ARCH")))


@dataclass(frozen=True)
class VarlenForwardPlan:
    """A varlen forward on the Hopper kernel: the schedule pre-kernel's launch and the kernel's,
    with everything but the addresses and cu_seqlens' contents fixed (tensor-map specs, o's
    strides, slots, scalars).  The full path builds one from its checked views (:meth:`record`)
    and runs it (:meth:`run`); a call with both max_seqlen hints keeps it, and later calls with
    the same signatures run it on their own arrays (:meth:`replay`)."""
    kern: object
    cfg: object
    specs: tuple                # the four tensor maps' (shape, strides, box)
    out_shape: tuple
    lse_shape: tuple | None
    o_strides: tuple            # o's element strides along tokens and heads
    scalars: tuple              # total_q, total_k, group, softmax_scale
    nheads: int
    slots: int
    mask_args: tuple
    sched: object               # the schedule pre-kernel's launch (attention_mask.ScheduleLaunch)

    @classmethod
    def record(cls, kern, cfg, views, o, lse, softmax_scale, mask_args, vl, causal, arch):
        from .attention_mask import schedule_launch
        q_, k_, _, o_ = views
        slots = schedule_slots(vl, cfg.block_m)
        _, total_q, nheads, _ = q_.shape
        total_k, nheads_kv = k_.shape[1], k_.shape[2]
        item = o_.itemsize
        return cls(kern, cfg, _sm90.map_specs(cfg, *views), tuple(o.shape),
                   None if lse is None else tuple(lse.shape), (o_.strides[1] // item, o_.strides[2] // item),
                   (total_q, total_k, nheads // nheads_kv, float(softmax_scale)), nheads, slots, tuple(mask_args),
                   schedule_launch(vl.batch, vl.total_q, vl.total_k, cfg.block_m, slots, bool(causal), arch))

    def run(self, q, k, v, o, lse, cu_q, cu_k, like, dev: int, stream) -> None:
        """Launch on q, k, v, o, lse (or None): the full path's CuPy views or a caller's arrays (the
        kernels take addresses); ``like``: the caller's q (the workspace's kind)."""
        from .workspace import stream_workspace
        table = stream_workspace(like, dev, stream, 8 * self.slots, 0)[0]   # graph-safe: kept for good
        self.sched.run(cu_q, cu_k, table, stream)
        maps = _sm90.tensor_maps(self.cfg, address(q), address(k), address(v), address(o), specs=self.specs)
        total_q, total_k, group, scale = self.scalars
        # O leaves through plain stores (its tensor map is passed but not used)
        self.kern.launch((self.nheads * self.slots,), (self.cfg.threads_per_block,), *maps, lse, total_q, total_k,
                         group, scale, o, self.o_strides[0], self.o_strides[1], cu_q, cu_k, table, self.nheads,
                         *self.mask_args, shared_mem=self.cfg.shared_mem_bytes, stream=stream)

    def replay(self, q, k, v, out, cu_q, cu_k, return_lse, stream, dev):
        """A later call with the recorded signatures: outputs allocated, then :meth:`run`."""
        from ._arrays import torch_stream_ptr
        import cupy
        torch = not isinstance(q, cupy.ndarray)
        if torch and stream is None:
            stream = torch_stream_ptr(sys.modules["torch"], dev)
        o = out if out is not None else empty_as(q, self.out_shape, q.dtype)
        lse = empty_as(q, self.lse_shape, (sys.modules["torch"].float32 if torch else cupy.float32)) \
            if return_lse else None
        self.run(q, k, v, o, lse, cu_q, cu_k, q, dev, stream)
        return (o, lse) if return_lse else o


def _forward_args(extra, arrays) -> tuple:
    """The Hopper kernel's array arguments for (q, k, v, o, lse): four tensor maps and lse."""
    cfg, specs, _ = extra
    return (*_sm90.tensor_maps(cfg, *(address(a) for a in arrays[:4]), specs=specs), arrays[4])


def _replay_forward(plan: OutputPlan, q, k, v, out, return_lse, stream, dev: int):
    o = plan.output(q, out)
    if return_lse:
        shape, dt = plan.extra[2]
        lse = q.new_empty(shape, dtype=dt) if plan.torch else empty_as(q, shape, dt)
    else:
        lse = None
    # the four tensor maps encoded and converted once per (q, k, v, o, lse) addresses, which a
    # loop keeps getting from the caching allocator; the launch's other arguments once per plan;
    # torch's current stream on the key's device when no stream is given
    plan.replay((q, k, v, o, lse), stream, _forward_args, dev)
    return (o, lse) if return_lse else o


def _get_kernel(cfg: AttentionConfig, arch: str):
    from ..kernel import get_kernel
    return get_kernel(cfg, arch=arch)


def _device_arch(dev: int) -> str:
    import os
    from .. import device
    return os.environ.get("RTKERNELS_ARCH") or device.device_arch(dev)


# ---- reference ----------------------------------------------------------------------------
def _to_f32(x, dtype: str | None):
    """A float32 CuPy copy of a device array's values (bfloat16 bits decoded)."""
    import cupy
    from ._arrays import as_device_array, dtype_name
    view = as_device_array(x, FAMILY, "input")
    dt = dtype or dtype_name(x)
    if dt == "bfloat16" or (dt == "uint16" and dtype == "bfloat16"):
        bits = cupy.ascontiguousarray(view).view(cupy.uint16)
        return (bits.astype(cupy.uint32) << 16).view(cupy.float32)
    return view.astype(cupy.float32)


def _round(x, dtype: str):
    """Round float32 values to float16/bfloat16 (nearest even), kept as float32."""
    import cupy
    if dtype == "float16":
        return x.astype(cupy.float16).astype(cupy.float32)
    b = cupy.ascontiguousarray(x, dtype=cupy.float32).view(cupy.uint32)
    b = (b + cupy.uint32(0x7FFF) + ((b >> 16) & cupy.uint32(1))) & cupy.uint32(0xFFFF0000)
    return b.view(cupy.float32)


def attention_reference(q, k, v, causal: bool = False, softmax_scale: float | None = None, *,
                        dtype: str | None = None, compute: str = "float32", round_to: str | None = None,
                        window=None, softcap=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Plain CuPy attention for tests and benchmarks: ``(o, lse)`` as float32/float64 CuPy arrays.

    Same layouts and conventions as :func:`attention` (GQA, bottom-right causal, windows,
    softcap, varlen through cu_seqlens - then per-sequence dense references; o = 0 and lse = -inf
    for a row that sees no key).  The mask comes from the same normalized spec the kernels get
    (:func:`rtkernels.ops.attention_mask.mask_spec`).  ``compute`` is "float32" or "float64".
    ``round_to="float16"|"bfloat16"`` imitates running the reference in that dtype (scores, capped
    scores, probabilities and output rounded to it, as a framework's low-precision matmuls would):
    FlashAttention's test rule compares the kernel's error with that reference's error.
    Scores are materialized one (batch, head) at a time: O(seqlen_q * seqlen_k) memory.
    """
    import cupy
    spec = mask_spec(causal, window, softcap, cu_seqlens_q is not None or cu_seqlens_k is not None)
    ft = cupy.float64 if compute == "float64" else cupy.float32
    qf, kf, vf = (_to_f32(a, dtype).astype(ft) for a in (q, k, v))
    scale = 1.0 / math.sqrt(qf.shape[-1]) if softmax_scale is None else float(softmax_scale)
    rnd = (lambda x: _round(x.astype(cupy.float32), round_to).astype(ft)) if round_to else (lambda x: x)
    if not spec.is_varlen:
        return _reference_dense(qf, kf, vf, spec, scale, rnd, ft)
    cq, ck = (cupy.asnumpy(cupy.asarray(c)).astype(int) for c in (cu_seqlens_q, cu_seqlens_k))
    o = cupy.zeros(qf.shape, ft)
    lse = cupy.full((qf.shape[1], qf.shape[0]), -cupy.inf, ft)
    for b in range(len(cq) - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ob, lb = _reference_dense(qf[None, rq], kf[None, rk], vf[None, rk], spec, scale, rnd, ft)
        o[rq], lse[:, rq] = ob[0], lb[0]
    return o, lse


def _reference_dense(qf, kf, vf, spec, scale: float, rnd, ft):
    """(o, lse) of dense (batch, seqlen, heads, dim) arrays under ``spec`` (one sequence per batch)."""
    import cupy
    batch, sq, nheads, d = qf.shape
    sk, nheads_kv = kf.shape[1], kf.shape[2]
    group = nheads // nheads_kv
    o = cupy.zeros((batch, sq, nheads, d), ft)
    lse = cupy.full((batch, nheads, sq), -cupy.inf, ft)
    visible = spec.visible(sq, sk, cupy)
    for b in range(batch):
        for h in range(nheads):
            s = rnd(scale * (qf[b, :, h] @ kf[b, :, h // group].T))
            if spec.has_softcap:
                s = rnd(spec.score(s, cupy))
            s = cupy.where(visible, s, -cupy.inf)
            m = s.max(axis=1, keepdims=True) if sk else cupy.full((sq, 1), -cupy.inf, ft)
            seen = cupy.isfinite(m)
            m = cupy.where(seen, m, 0)
            p = cupy.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            safe_l = cupy.where(l > 0, l, 1)
            o[b, :, h] = cupy.where(seen, rnd(rnd(p / safe_l) @ vf[b, :, h // group]), 0)
            lse[b, h] = cupy.where(seen[:, 0], m[:, 0] + cupy.log(safe_l[:, 0]), -cupy.inf)
    return o, lse
