"""attention_backward: FlashAttention-2 backward, compiled for the exact head dim at run time.

``dq, dk, dv = attention_backward(do, q, k, v, o, lse, causal=False, softmax_scale=None,
deterministic=False, dq=None, dk=None, dv=None)``

Same layouts and rules as :func:`rtkernels.ops.attention.attention` (its input checks are
reused).  Kernels (templates/attention_bwd.cu.j2): ``attention_bwd_dot`` (delta = rowsum(dO*O),
zeroes the f32 dQ accumulator), ``attention_bwd`` (one CTA per key tile and kv head: dK, dV in
registers, summed over the GQA group inside the CTA - deterministic, no atomics; dQ by f32
reductions into the accumulator unless deterministic), then ``attention_bwd_dq_convert``, or
with ``deterministic=True`` ``attention_bwd_dq`` (a dQ pass per query tile, no atomics).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from ..config import register_family
from ..errors import ConfigError
from .attention import (AttentionShape, check_inputs, _device_arch, _device_of, _elem_strides, _smem_limit,
                        _to_f32)

FAMILY = "attention_backward"
KERNELS = ("attention_bwd_dot", "attention_bwd", "attention_bwd_dq_convert", "attention_bwd_dq")


def _odd_stride(elems: int) -> int:
    """Row stride (elements) of an odd number of 16-byte chunks, as in the template."""
    return ((elems // 8) | 1) * 8


@register_family
@dataclass(frozen=True)
class AttentionBwdConfig(AttentionShape):
    """One specialization of the FlashAttention-2 backward kernels.

    Parameters
    ----------
    dtype : "float16" or "bfloat16".
    head_dim : multiple of 8 in [8, 256].
    causal : bottom-right aligned causal mask.
    deterministic : compile attention_bwd without the dQ reductions (the dQ pass kernel runs).
    block_m : query rows per step of attention_bwd: 16, 32, 64 or 128 (divides the 128-row padding
        of the lse/delta rows).
    block_n : keys per attention_bwd CTA: 16 per warp, or 8 per warp (two warps share 16 keys and
        split the head dim of dK/dV between them).
    num_warps : 2, 4 or 8 (attention_bwd).
    dq_block_n : keys per step of the deterministic dQ pass, multiple of 16 in [16, 128].
    dq_num_warps : warps of the dQ pass (16 query rows each): 2, 4 or 8.
    """

    family: ClassVar[str] = FAMILY
    template: ClassVar[str] = "attention_bwd.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = KERNELS
    expects_tensor_cores: ClassVar[bool] = True
    expected_global_width: ClassVar[int | None] = 128

    deterministic: bool = False
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    dq_block_n: int = 64
    dq_num_warps: int = 4

    def __post_init__(self):
        self._check_shape()
        self._check_choice("deterministic", (False, True))
        self._check_choice("num_warps", (2, 4, 8))
        self._check_choice("dq_num_warps", (2, 4, 8))
        self._check_choice("block_m", (16, 32, 64, 128))
        self._check_int("dq_block_n", 16, 128, multiple_of=16)
        if self.block_n not in (16 * self.num_warps, 8 * self.num_warps):
            self._fail("block_n", f"16 or 8 keys per warp: {16 * self.num_warps} or {8 * self.num_warps} "
                                  f"with num_warps={self.num_warps}")

    # ---- derived values (the template re-checks them with static_assert) --------------
    @property
    def d_split(self) -> int:
        """Warps that share 16 keys, each with a slice of dK/dV's columns."""
        return self.num_warps * 16 // self.block_n

    @property
    def shared_mem_bytes(self) -> int:
        """attention_bwd: K, V, 2 x (Q, dO), dS^T (not deterministic), 2 x (lse, delta)."""
        rs = _odd_stride(self.head_dim_padded)
        ds = 0 if self.deterministic else self.block_n * _odd_stride(self.block_m)
        return 2 * (2 * self.block_n * rs + 4 * self.block_m * rs + ds) + 16 * self.block_m

    @property
    def dq_block_m(self) -> int:
        return 16 * self.dq_num_warps

    @property
    def dq_shared_mem_bytes(self) -> int:
        """attention_bwd_dq: Q, dO, 2 x (K, V), lse and delta of its rows."""
        return 2 * (2 * self.dq_block_m + 4 * self.dq_block_n) * _odd_stride(self.head_dim_padded) + 8 * self.dq_block_m

    def template_params(self) -> dict[str, Any]:
        p = super().template_params()
        p["smem_bytes"] = self.shared_mem_bytes
        p["dq_smem_bytes"] = self.dq_shared_mem_bytes
        return p

    @classmethod
    def heuristic_defaults(cls, params: dict[str, Any], arch: str | None) -> dict[str, Any]:
        tile = ("block_m", "block_n", "num_warps", "dq_block_n", "dq_num_warps")
        if all(f in params for f in tile):
            return {}
        from .. import device
        base = cls(**{f: params[f] for f in ("dtype", "head_dim", "causal", "deterministic") if f in params})
        cfg = choose_config(base.dtype, base.head_dim, base.causal, base.deterministic,
                            arch or device.current_arch())
        return {f: getattr(cfg, f) for f in tile}


# ---- heuristics ---------------------------------------------------------------------------
class Tile(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    dq_block_n: int
    dq_num_warps: int
    why: str


# (lowest head_dim, highest head_dim) -> tiles in order of preference; the first that fits the
# target's shared memory per block is used.  Reasons: ptxas of NVRTC 13.5 for sm_80 and sm_90,
# both dtypes, causal and not, deterministic and not (registers / spills); no GPU timing yet -
# the lead's H200 run of tools/bench_attention_bwd.py decides between the listed candidates.
HEURISTICS: list[tuple[int, int, tuple[Tile, ...]]] = [
    (8, 64, (
        Tile(64, 64, 4, 64, 4,
             "FA2's d<=64 shape class (64 queries x 64 keys); 16 keys per warp keeps S^T/dP^T at 64 f32 "
             "registers and dK+dV at <= 64; ptxas: see tests (0 spills); 2 CTAs/SM fit in smem at d64"),
    )),
    (120, 120, (
        Tile(32, 64, 4, 32, 4,
             "d120: 64x64 w4 spills 24/32 B on sm_80 (causal, not deterministic); 32-query steps: 242 regs, 0 spills"),
    )),
    (72, 128, (
        Tile(64, 64, 4, 64, 4,
             "d128: dK+dV 128 f32 regs/thread + S^T/dP^T 64; 255 regs, 0 spills on sm_80/sm_90 (NVRTC 13.5; at the "
             "limit: if the GPU host's NVRTC spills, 32x64 w4 below is 238-242 regs); 112 KiB smem: 2 CTAs/SM on "
             "sm_90"),
        Tile(32, 64, 4, 32, 4, "fallback when smem is short (sm_86/89: 99 KiB); 214-242 regs, 0 spills"),
    )),
    (136, 256, (
        Tile(32, 64, 8, 32, 4,
             "d>128: 8 warps, two per 16 keys, each with half of dK/dV's columns (<= 128 f32 regs); 32-query "
             "steps keep S^T/dP^T at 32 regs; dQ pass 64x32 keeps dQ (<= 128 regs) + S/dP (32) spill-free"),
        Tile(16, 32, 4, 16, 2, "last resort for the smallest smem budgets (sm_86/89 at d>=200)"),
    )),
]


def candidates(head_dim: int) -> tuple[Tile, ...]:
    for lo, hi, tiles in HEURISTICS:
        if lo <= head_dim <= hi:
            return tiles
    raise ConfigError.bad_value(FAMILY, "head_dim", head_dim, "a multiple of 8 in [8, 256]")


def _make(dtype, head_dim, causal, deterministic, t: Tile) -> AttentionBwdConfig:
    return AttentionBwdConfig(dtype=dtype, head_dim=head_dim, causal=causal, deterministic=deterministic,
                              block_m=t.block_m, block_n=t.block_n, num_warps=t.num_warps, dq_block_n=t.dq_block_n,
                              dq_num_warps=t.dq_num_warps)


def choose_config(dtype: str, head_dim: int, causal: bool, deterministic: bool, arch: str) -> AttentionBwdConfig:
    """The config the heuristics pick for (dtype, head_dim, causal, deterministic, arch)."""
    limit = _smem_limit(arch)
    for t in candidates(head_dim):
        cfg = _make(dtype, head_dim, causal, deterministic, t)
        if max(cfg.shared_mem_bytes, cfg.dq_shared_mem_bytes) <= limit:
            return cfg
    raise ConfigError(f"{FAMILY}: no tile for head_dim={head_dim} fits {arch}'s {limit} B of shared memory per "
                      f"block", family=FAMILY, field="head_dim", value=head_dim, allowed="a smaller head_dim")


def heuristic_configs(arch: str = "sm_90", dtypes=("float16", "bfloat16")) -> list[AttentionBwdConfig]:
    """Every config the heuristics can pick on ``arch``: the no-spill sweep compiles these."""
    return [choose_config(dt, d, c, det, arch) for d in range(8, 257, 8) for dt in dtypes for c in (False, True)
            for det in (False, True)]


# ---- the op -------------------------------------------------------------------------------
_KERNELS: dict = {}
_DOT_THREADS = 256
LSE_PAD = 128   # the template's LSE_PAD: lse_log2/delta rows per (batch, head) padded to this


def _kernels_for(dtype: str, head_dim: int, causal: bool, deterministic: bool, arch: str):
    """({name: Kernel}, config), memoized per key."""
    key = (dtype, head_dim, causal, deterministic, arch)
    hit = _KERNELS.get(key)
    if hit is None:
        from ..kernel import get_kernel
        cfg = choose_config(dtype, head_dim, causal, deterministic, arch)
        names = ("attention_bwd_dot", "attention_bwd") + (
            ("attention_bwd_dq",) if deterministic else ("attention_bwd_dq_convert",))
        hit = _KERNELS[key] = ({n: get_kernel(cfg, n, arch=arch) for n in names}, cfg)
    return hit


def _bad(field: str, value: Any, message: str) -> ConfigError:
    return ConfigError(f"{FAMILY}: {message}", family=FAMILY, field=field, value=value, allowed=message)


def _dot_lanes(head_dim: int) -> int:
    return 1 << max(0, (head_dim // 8 - 1).bit_length())


def attention_backward(do, q, k, v, o, lse, causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False, dq=None, dk=None, dv=None, *, dtype: str | None = None,
                       stream=None):
    """FlashAttention-2 backward: gradients of ``o = attention(q, k, v, causal, softmax_scale)``.

    Parameters
    ----------
    do : gradient of o, q's shape and dtype.
    q, k, v, o : as for :func:`rtkernels.ops.attention.attention` (o its output); float16 or
        bfloat16 (torch tensors, or uint16 CuPy arrays with ``dtype="bfloat16"``), last dimension
        contiguous, other strides multiples of 8 elements, 16-byte aligned.
    lse : float32 (batch, nheads, seqlen_q), the forward's log-sum-exp (natural log; -inf for
        rows that see no key: their gradients are 0).
    causal, softmax_scale : exactly as given to the forward.
    deterministic : bit-identical results run to run: dQ from a separate pass per query tile
        instead of float32 atomics.  (dK and dV are deterministic either way.)
    dq, dk, dv : optional outputs (shapes of q, k, v; same dtype and device; strides as for q).
    dtype : "bfloat16" to read uint16 CuPy arrays as bfloat16 bits.
    stream : CuPy stream, torch stream or raw handle (default: current CuPy stream, or torch's
        current stream for torch inputs).

    Returns
    -------
    ``(dq, dk, dv)`` in the input dtype, the same kind of arrays as q.  With GQA/MQA, dk and dv
    are summed over the query heads that share a kv head.

    Raises
    ------
    ConfigError : bad dtype, shape, head_dim, strides, devices, lse or outputs; nothing launched.
    """
    from ._arrays import as_device_array, new_like, _is_torch, dtype_name
    import cupy

    p = check_inputs({"do": do, "q": q, "k": k, "v": v, "o": o}, dtype, softmax_scale, FAMILY)
    do_, q_, k_, v_, o_ = (p.views[n] for n in ("do", "q", "k", "v", "o"))
    dt, dev, softmax_scale = p.dtype, p.device, p.softmax_scale
    batch, seqlen_q, nheads, head_dim = q_.shape
    seqlen_k, nheads_kv = p.seqlen_k, p.nheads_kv
    lse_ = as_device_array(lse, FAMILY, "lse")
    if tuple(lse_.shape) != (batch, nheads, seqlen_q) or str(lse_.dtype) != "float32" or _device_of(lse_) != dev:
        raise _bad("lse", lse_.shape, f"lse must be a float32 array of shape {(batch, nheads, seqlen_q)} on device "
                                      f"{dev} (the forward's), got {lse_.dtype} {tuple(lse_.shape)} on device "
                                      f"{_device_of(lse_)}")
    causal, deterministic = bool(causal), bool(deterministic)

    with cupy.cuda.Device(dev):
        outs = []
        for name, given, like, shape in (("dq", dq, q, q_.shape), ("dk", dk, k, k_.shape), ("dv", dv, k, k_.shape)):
            arr = new_like(q, tuple(shape), dt) if given is None else given
            view = as_device_array(arr, FAMILY, name)
            if given is not None:
                odt = "bfloat16" if (dt == "bfloat16" and str(view.dtype) == "uint16") else dtype_name(given)
                if tuple(view.shape) != tuple(shape) or odt != dt or _device_of(view) != dev:
                    raise _bad(name, view.shape, f"{name} must be a {dt} array of shape {tuple(shape)} on device "
                                                 f"{dev}, got {odt} {tuple(view.shape)} on device {_device_of(view)}")
            outs.append((arr, view))
        (dq_o, dq_), (dk_o, dk_), (dv_o, dv_) = outs
        if batch == 0 or nheads == 0:
            return dq_o, dk_o, dv_o
        if seqlen_q == 0 or seqlen_k == 0:
            # nothing to attend: every gradient is 0 (dq is empty or all its rows see no key)
            for view in (dq_, dk_, dv_):
                view.fill(0)
            return dq_o, dk_o, dv_o
        s_do, s_q, s_k, s_v, s_o = (_elem_strides(p.views[n], n) for n in ("do", "q", "k", "v", "o"))
        s_dq, s_dk, s_dv = (_elem_strides(view, n) for view, n in ((dq_, "dq"), (dk_, "dk"), (dv_, "dv")))
        lse_c = cupy.ascontiguousarray(lse_)

        arch = _device_arch(dev)
        kerns, cfg = _kernels_for(dt, head_dim, causal, deterministic, arch)
        if stream is None and _is_torch(q):
            torch = sys.modules["torch"]
            stream = torch.cuda.current_stream(dev).cuda_stream
        scale = float(softmax_scale)
        sq_pad = -(-seqlen_q // LSE_PAD) * LSE_PAD
        lse2 = cupy.empty((batch, nheads, sq_pad), cupy.float32)
        delta = cupy.empty((batch, nheads, sq_pad), cupy.float32)
        dq_accum = None if deterministic else cupy.empty((batch, nheads, seqlen_q, head_dim), cupy.float32)
        rows_per_cta = _DOT_THREADS // _dot_lanes(head_dim)
        kerns["attention_bwd_dot"].launch((-(-sq_pad // rows_per_cta), nheads, batch), (_DOT_THREADS,),
                                          o_, do_, lse_c, lse2, delta, dq_accum, seqlen_q, *s_o[:3], *s_do[:3],
                                          stream=stream)
        kerns["attention_bwd"].launch(
            (-(-seqlen_k // cfg.block_n), nheads_kv, batch), (cfg.threads_per_block,),
            do_, q_, k_, v_, lse2, delta, dq_accum, dk_, dv_, seqlen_q, seqlen_k, nheads // nheads_kv, nheads,
            *s_q[:3], *s_k[:3], *s_v[:3], *s_do[:3], *s_dk[:3], *s_dv[:3], scale,
            shared_mem=cfg.shared_mem_bytes, stream=stream)
        if deterministic:
            kerns["attention_bwd_dq"].launch(
                (-(-seqlen_q // cfg.dq_block_m), nheads, batch), (32 * cfg.dq_num_warps,),
                do_, q_, k_, v_, lse2, delta, dq_, seqlen_q, seqlen_k, nheads // nheads_kv,
                *s_q[:3], *s_k[:3], *s_v[:3], *s_do[:3], *s_dq[:3], scale,
                shared_mem=cfg.dq_shared_mem_bytes, stream=stream)
        else:
            kerns["attention_bwd_dq_convert"].launch(
                (-(-seqlen_q * (head_dim // 8) // 256), nheads, batch), (256,), dq_accum, dq_, seqlen_q,
                *s_dq[:3], scale, stream=stream)
    return dq_o, dk_o, dv_o


# ---- reference ----------------------------------------------------------------------------
def attention_backward_reference(do, q, k, v, causal: bool = False, softmax_scale: float | None = None, *,
                                 dtype: str | None = None, compute: str = "float32", round_to: str | None = None):
    """Direct-formula backward in CuPy: ``(dq, dk, dv)`` as float32/float64 arrays.

    P = softmax(scale q k^T [masked]) recomputed from q, k (rows with no visible key: P = 0),
    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)), dQ = scale dS K, dK = scale dS^T Q;
    dK, dV summed over each GQA group.  ``round_to`` rounds P, dS and the products to that dtype
    (a framework's low-precision run) for the 2x error rule.  One (batch, head) at a time.
    """
    import cupy
    from .attention import _round
    ft = cupy.float64 if compute == "float64" else cupy.float32
    dof, qf, kf, vf = (_to_f32(a, dtype).astype(ft) for a in (do, q, k, v))
    batch, sq, nheads, d = qf.shape
    sk, nheads_kv = kf.shape[1], kf.shape[2]
    group = nheads // nheads_kv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    rnd = (lambda x: _round(x.astype(cupy.float32), round_to).astype(ft)) if round_to else (lambda x: x)
    dq = cupy.zeros((batch, sq, nheads, d), ft)
    dk = cupy.zeros((batch, sk, nheads_kv, d), ft)
    dv = cupy.zeros((batch, sk, nheads_kv, d), ft)
    if sq == 0 or sk == 0:
        return dq, dk, dv
    if causal:
        visible = cupy.arange(sk)[None, :] <= cupy.arange(sq)[:, None] + (sk - sq)
    for b in range(batch):
        for h in range(nheads):
            hk = h // group
            s = scale * (qf[b, :, h] @ kf[b, :, hk].T)
            if causal:
                s = cupy.where(visible, s, -cupy.inf)
            m = s.max(axis=1, keepdims=True)
            m = cupy.where(cupy.isfinite(m), m, 0)
            p = cupy.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            p = rnd(p / cupy.where(l > 0, l, 1))
            g = dof[b, :, h]
            dv[b, :, hk] += rnd(p.T @ g)
            dp = g @ vf[b, :, hk].T
            ds = rnd(p * (dp - (dp * p).sum(axis=1, keepdims=True)))
            dq[b, :, h] = rnd(scale * (ds @ kf[b, :, hk]))
            dk[b, :, hk] += rnd(scale * (ds.T @ qf[b, :, h]))
    return dq, dk, dv
