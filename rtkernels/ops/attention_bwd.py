"""attention_backward: FlashAttention-2 backward, compiled for the exact head dim at run time.

``dq, dk, dv = attention_backward(do, q, k, v, o, lse, causal=False, softmax_scale=None,
deterministic=False, dq=None, dk=None, dv=None)``

Same layouts and rules as :func:`rtkernels.ops.attention.attention` (its input checks are
reused).  Kernels (templates/attention_bwd.cu.j2): ``attention_bwd_dot`` (delta = rowsum(dO*O),
zeroes the f32 dQ accumulator and the flush counters), ``attention_bwd`` (one CTA per key tile
and kv head: dK, dV in registers, summed over the GQA group inside the CTA - deterministic, no
atomics; dQ partials into the f32 accumulator by reductions - ``dq_mode`` "red" from registers,
"staged"/"bulk" through each warp's shared rows, with ``deterministic=True`` in a fixed order per
query tile), then ``attention_bwd_dq_convert``; or ``dq_mode="pass"``: no dQ in
``attention_bwd``, ``attention_bwd_dq`` (a dQ pass per query tile, no atomics) instead.
Measurements behind the heuristics: ``tools/bench_attention_bwd.py --sweep`` (H200).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from .._env import getenv
from ..config import register_family
from ..errors import ConfigError
from ._arrays import LaunchPlans, _is_torch, cupy_stream, default_stream, empty_as, same_memory, torch_view_as
from . import views as _views
from .attention import (AttentionShape, check_inputs, check_output, read_inputs, _device_arch, _device_of,
                        _elem_strides, _smem_limit, _to_f32)
from .attention_mask import check_varlen, first_without_spills, mask_spec, padded_offset_rows
from .rowwise import _ClassOrInstance

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
    deterministic : bit-identical dQ: "staged" flushes ordered per query tile, or "pass".
    block_m : query rows per step of attention_bwd: 16, 32, 64 or 128 (divides the 128-row padding
        of the lse/delta rows).
    block_n : keys per attention_bwd CTA: 16 per warp, or 8 per warp (two warps share 16 keys and
        split the head dim of dK/dV between them).
    num_warps : 2, 4 or 8 (attention_bwd).
    dq_block_n : keys per step of the deterministic dQ pass, multiple of 16 in [16, 128].
    dq_num_warps : warps of the dQ pass (16 query rows each): 2, 4 or 8.
    dq_mode : how attention_bwd's dQ partials reach the f32 accumulator: "red" (8-byte reductions
        from the mma registers; not deterministic), "staged" (each warp's unit through its own
        shared rows, then coalesced 16-byte reductions), "bulk" (staged, then one TMA-engine bulk
        reduction per row on sm_90; "staged" on sm_80), or "pass" (none: the separate
        attention_bwd_dq kernel; deterministic only).  "staged"/"bulk" with deterministic=True add
        the key tiles' partials in a fixed order per (query tile, unit).  Default: "pass" if
        deterministic else "red".
    ds_stages : dS^T buffers.  2: the dQ product of step i runs at the start of step i + 1 (one
        barrier per step instead of two); not with "pass".
    layout : "keys16" (each warp: 16 keys x all queries, P^T/dS^T stay in registers) or "pair"
        (two warps share 32 keys, each half the queries and half of dK/dV's columns, exchanging
        P^T/dS^T halves through shared memory: fewer ldmatrix per mma; block_m >= 32).
    kv_regs : hold the K and V A fragments of a warp's 16 keys in registers for the whole query
        loop instead of re-reading them from shared memory every step (2 x head_dim/4 registers).
    """

    family: ClassVar[str] = FAMILY
    template: ClassVar[str] = "attention_bwd.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = KERNELS
    expects_tensor_cores: ClassVar[bool] = True
    # varlen adds the scalar loads of cu_seqlens and the schedule, the main kernel's only LDGs
    expected_global_width = _ClassOrInstance(128, lambda c: None if c.is_varlen else 128)

    deterministic: bool = False
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    dq_block_n: int = 64
    dq_num_warps: int = 4
    dq_mode: str = "auto"
    kv_regs: bool = False
    ds_stages: int = 1
    layout: str = "keys16"

    DQ_MODES: ClassVar[tuple[str, ...]] = ("red", "staged", "bulk", "pass")

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
        if not isinstance(self.kv_regs, bool):
            self._fail("kv_regs", "True or False")
        if self.dq_mode == "auto" and isinstance(self.deterministic, bool):
            object.__setattr__(self, "dq_mode", "pass" if self.deterministic else "red")
        self._check_choice("dq_mode", ("staged", "bulk", "pass") if self.deterministic else ("red", "staged", "bulk"))
        self._check_choice("ds_stages", (1, 2) if self.dq_mode != "pass" else (1,))
        self._check_choice("layout", ("keys16", "pair"))
        if self.layout == "pair":
            if self.block_n != 16 * self.num_warps:
                self._fail("block_n", f"16 keys per warp with layout='pair': {16 * self.num_warps} with "
                                      f"num_warps={self.num_warps}")
            if self.block_m not in (32, 64, 128):
                self._fail("block_m", "32, 64 or 128 with layout='pair'")

    # ---- derived values (the template re-checks them with static_assert) --------------
    @property
    def d_split(self) -> int:
        """Warps that share 16 keys, each with a slice of dK/dV's columns."""
        return self.num_warps * 16 // self.block_n

    @property
    def dq_mt(self) -> int:
        """m-tiles (16 query rows) per dQ unit of 4 column tiles: 2 while every warp still gets a unit."""
        col_units = -(-(self.head_dim // 8) // 4)
        return 2 if (self.block_m % 32 == 0 and (self.block_m // 32) * col_units >= self.num_warps) else 1

    @property
    def dq_units(self) -> int:
        return (self.block_m // (16 * self.dq_mt)) * -(-(self.head_dim // 8) // 4)

    @property
    def shared_mem_bytes(self) -> int:
        """attention_bwd: K, V, 2 x (Q, dO), ds_stages x dS^T (not "pass"), 2 x (lse, delta), and
        per warp a staged f32 dQ unit ("staged", "bulk": dq_mt * 16 rows x 36)."""
        rs = _odd_stride(self.head_dim_padded)
        pair = self.layout == "pair"
        ds = 0 if (self.dq_mode == "pass" and not pair) else self.ds_stages * self.block_n * _odd_stride(self.block_m)
        ds += self.block_n * _odd_stride(self.block_m) if pair else 0   # P^T
        staged = self.num_warps * self.dq_mt * 16 * 36 * 4 if self.dq_mode in ("staged", "bulk") else 0
        return 2 * (2 * self.block_n * rs + 4 * self.block_m * rs + ds) + 16 * self.block_m + staged

    @property
    def dq_in_main(self) -> bool:
        return self.dq_mode != "pass"

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
        p["dq_mode_id"] = self.DQ_MODES.index(self.dq_mode)
        return p

    @classmethod
    def heuristic_defaults(cls, params: dict[str, Any], arch: str | None) -> dict[str, Any]:
        tile = ("block_m", "block_n", "num_warps", "dq_block_n", "dq_num_warps")
        variant = ("dq_mode", "kv_regs", "ds_stages", "layout")
        if all(f in params for f in tile):
            return {}
        from .. import device
        base = cls(**{f: params[f] for f in ("dtype", "head_dim", "deterministic") + cls.MASK_FIELDS if f in params})
        cfg = choose_config(base.dtype, base.head_dim, base.causal, base.deterministic,
                            arch or device.current_arch(), **base.mask_flags())
        # no tile field given: exactly the op's config; some given: fill the rest of the tile only
        # (a chosen layout/dq mode may not fit a tile picked by hand)
        given = any(f in params for f in tile)
        return {f: getattr(cfg, f) for f in tile + (() if given else variant)}


# ---- heuristics ---------------------------------------------------------------------------
class Tile(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    dq_block_n: int
    dq_num_warps: int
    why: str
    dq_mode: str | None = "red"     # deterministic=False; None: this tile is only used when deterministic
    det_mode: str | None = "pass"   # deterministic=True; None: this tile is not used when deterministic
    kv_regs: bool = False
    ds_stages: int = 1
    layout: str = "keys16"
    causal: bool | None = None      # only for this causal flag (None: both)


# (lowest head_dim, highest head_dim) -> tiles in order of preference; the first that fits the
# target's shared memory per block is used.  Register counts: ptxas of NVRTC 13.5 for sm_80 and
# sm_90, both dtypes, causal and not; timings: tools/bench_attention_bwd.py --sweep on an H200.
HEURISTICS: list[tuple[int, int, tuple[Tile, ...]]] = [
    (8, 64, (
        Tile(64, 128, 8, 64, 4,
             "H200 sweep, d64 non-causal 2k/4k/8k: pair staged kv ds2 189/199/219 TFLOP/s (pair red ds2 172/179/194, "
             "keys16 128x128 red 174/181/197); 128x128 pair red: 198/206/226 but at the register limit (spills 8-16 B "
             "with NVRTC 13.0 or 13.5 depending on causal/ds_stages); causal: kv pair spills on NVRTC 13.0",
             "staged", None, True, 2, "pair", False),
        Tile(64, 128, 8, 64, 4,
             "d64 causal 2k/4k/8k: pair red ds2 127/164/185 (keys16 128x128 red 126/159/177); deterministic: dQ pass "
             "(pair, dq 64 keys x 4 warps, Q/dO fragments in registers) 122-183; the ordered flush 97-146",
             "red", "pass", False, 2, "pair"),
        Tile(64, 64, 4, 64, 4,
             "FA2's d<=64 shape class where 64x128 does not fit (99 KiB smem); K/V fragments in registers (32 regs)",
             "red", "pass", True),
    )),
    (120, 120, (
        Tile(32, 64, 4, 32, 4,
             "d120: 64x64 w4 spills 24/32 B on sm_80 (causal, not deterministic); 32-query steps: 242 regs, 0 spills"),
    )),
    (72, 128, (
        Tile(64, 128, 8, 64, 4,
             "H200 sweep, d128 2k/4k/8k: pair staged ds2 213/219/245, causal 169/197/222 TFLOP/s (keys16 64x128 staged "
             "184/188/207, keys16 64x64 red 162/166/181): two warps per 32 keys cut ldmatrix per mma by ~20%; staged "
             "dQ (16-byte reductions of each warp's 32x32 unit) beat red by 1-3% and bulk by 8-12%; 227 KiB smem",
             "staged", None, False, 2, "pair"),
        Tile(64, 128, 8, 64, 4,
             "deterministic d128: main kernel without dQ (pair, 177 KiB) + the dQ pass (64 keys x 4 warps, Q/dO "
             "fragments in registers; 128 keys spills): 190/206/205, causal 157/185/201 TFLOP/s = 0.83-1.06 of the "
             "default (ordered flush: 162/183/185, 138/162/176)",
             None, "pass", False, 1, "pair"),
        Tile(64, 64, 4, 64, 4,
             "sm_80 (163 KiB): keys16 64x64, 255 regs, 0 spills; H200 d128 4k 166, deterministic (pass) 171"),
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


def _make(dtype, head_dim, causal, deterministic, t: Tile, **mask_flags) -> AttentionBwdConfig:
    return AttentionBwdConfig(dtype=dtype, head_dim=head_dim, causal=causal, deterministic=deterministic,
                              block_m=t.block_m, block_n=t.block_n, num_warps=t.num_warps, dq_block_n=t.dq_block_n,
                              dq_num_warps=t.dq_num_warps, dq_mode=(mode := t.det_mode if deterministic else t.dq_mode),
                              kv_regs=t.kv_regs, ds_stages=t.ds_stages if mode != "pass" else 1, layout=t.layout,
                              **mask_flags)


def used_kernels(cfg: AttentionBwdConfig) -> tuple[str, ...]:
    """The entry points the op launches for ``cfg``."""
    return ("attention_bwd_dot", "attention_bwd") + (
        ("attention_bwd_dq",) if cfg.dq_mode == "pass" else ("attention_bwd_dq_convert",))


def _fits(cfg: AttentionBwdConfig, limit: int) -> bool:
    return max(cfg.shared_mem_bytes, cfg.dq_shared_mem_bytes if cfg.dq_mode == "pass" else 0) <= limit


def choose_config(dtype: str, head_dim: int, causal: bool, deterministic: bool, arch: str,
                  **mask_flags) -> AttentionBwdConfig:
    """The config the heuristics pick for (dtype, head_dim, causal, deterministic, arch);
    ``mask_flags``: the other compile-time mask fields (has_window, has_softcap, is_varlen).  Masked
    variants take the first candidate whose kernels ptxas builds without spills (NVRTC 13.5, all
    three options: the deterministic d128 pair tile spills 4 B in attention_bwd and 12 B in the dQ
    pass, so it falls back to the 64x64 tile)."""
    limit = _smem_limit(arch)
    options = []
    for t in candidates(head_dim):
        if (t.det_mode if deterministic else t.dq_mode) is None or t.causal not in (None, causal):
            continue
        cfg = _make(dtype, head_dim, causal, deterministic, t, **mask_flags)
        if _fits(cfg, limit):
            if not any(mask_flags.values()):
                return cfg
            options.append(cfg)
    if options:
        return first_without_spills(options, arch, used_kernels)
    raise ConfigError(f"{FAMILY}: no tile for head_dim={head_dim} fits {arch}'s {limit} B of shared memory per "
                      f"block", family=FAMILY, field="head_dim", value=head_dim, allowed="a smaller head_dim")


def heuristic_configs(arch: str = "sm_90", dtypes=("float16", "bfloat16")) -> list[AttentionBwdConfig]:
    """Every config the heuristics can pick on ``arch``: the no-spill sweep compiles these."""
    return [choose_config(dt, d, c, det, arch) for d in range(8, 257, 8) for dt in dtypes for c in (False, True)
            for det in (False, True)]


# Tile space of the --sweep benchmark (head dims 64 and 128): (block_m, block_n, num_warps, kv_regs, ds_stages,
# layout, dq modes when not deterministic, dq modes when deterministic).  Earlier H200 sweeps (TFLOP/s at 4k
# non-causal / causal) pruned the rest: "bulk" (one TMA reduction per 128-byte row) lost to "staged" by 5-10%
# everywhere (d128 pair 198 vs 219); keys16 64x64 w4 at d128 with ds2 (124) and 32x128 w8 pair (180-185)
# lost to 64x128 pair (213-219); the ordered (deterministic) flush lost to the dQ pass by 8-20%; ptxas
# spills kv_regs at d128 (16-80 B) and 128x64 w4 at d64 (4 B).
SWEEP_TILES = {
    64: ((64, 128, 8, False, 2, "pair", ("red", "staged"), ("staged", "pass")),
         (64, 128, 8, True, 2, "pair", ("red", "staged"), ()),
         (128, 128, 8, False, 1, "pair", ("red",), ()),
         (128, 128, 8, False, 1, "keys16", ("red",), ()),
         (64, 64, 4, True, 1, "keys16", (), ("pass",))),
    128: ((64, 128, 8, False, 2, "pair", ("red", "staged"), ("staged",)),
          (64, 128, 8, False, 1, "pair", ("staged",), ("pass",)),
          (64, 128, 8, False, 1, "keys16", ("staged",), ()),
          (64, 64, 4, False, 1, "keys16", ("red",), ("pass",))),
}
# dQ pass kernels timed with each "pass" candidate: (dq_block_n, dq_num_warps); d128 with 128 keys spills
# (Q/dO fragments in registers: 304-316 B).
SWEEP_DQ_PASS = {64: ((64, 4), (128, 4), (32, 8)), 128: ((64, 4), (32, 8))}


def tile_space(dtype: str, head_dim: int, causal: bool, deterministic: bool, arch: str, *,
               prune_spills: bool = False) -> list[AttentionBwdConfig]:
    """The heuristic's choice first, then every sweep candidate that fits ``arch``'s shared memory
    (duplicates removed); ``prune_spills`` compiles each and drops those ptxas spills."""
    limit = _smem_limit(arch)
    out = [choose_config(dtype, head_dim, causal, deterministic, arch)]
    for bm, bn, w, kv, ds, layout, modes, det_modes in SWEEP_TILES.get(head_dim, ()):
        for mode in (det_modes if deterministic else modes):
            for dqn, dqw in (SWEEP_DQ_PASS.get(head_dim, ((64, 4),)) if mode == "pass" else ((64, 4),)):
                cfg = AttentionBwdConfig(dtype=dtype, head_dim=head_dim, causal=causal, deterministic=deterministic,
                                         block_m=bm, block_n=bn, num_warps=w, dq_block_n=dqn, dq_num_warps=dqw,
                                         dq_mode=mode, kv_regs=kv, ds_stages=ds if mode != "pass" else 1,
                                         layout=layout)
                if _fits(cfg, limit) and cfg not in out:
                    out.append(cfg)
    if prune_spills:
        from ..kernel import get_kernel

        def clean(c):
            names = ("attention_bwd", "attention_bwd_dq") if c.dq_mode == "pass" else ("attention_bwd",)
            rs = [get_kernel(c, n, arch=arch).resources for n in names]
            return not any(r.spill_stores or r.spill_loads for r in rs)
        out = [c for c in out if clean(c)]
    return out


def describe(cfg) -> str:
    """Short tile label for tables: ``64x128 w8 staged kv`` (``sm90 s2`` for the Hopper kernel)."""
    if isinstance(cfg, _sm90.AttentionBwdSm90Config):
        split = (f" cols {cfg.split}/{cfg.head_dim - cfg.split} {cfg.layout} {cfg.dq_mode}"   # the big kernel
                 + (f" do{cfg.do_stages}" if cfg.do_stages else "") + (" ds1" if cfg.ds_buffers == 1 else "")
                 if hasattr(cfg, "split") else "")
        order = (" lpt" if cfg.lpt_grid else "") + (" stg" if cfg.stagger else "")
        det = " det" if cfg.deterministic else ""
        return f"sm90 {cfg.block_m}x{cfg.block_n} s{cfg.num_stages}{split}{order}{det}"
    return (f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} {cfg.dq_mode}" + (" kv" if cfg.kv_regs else "")
            + (" ds2" if cfg.ds_stages == 2 else "") + (" pair" if cfg.layout == "pair" else "")
            + (f" dq{cfg.dq_block_n}w{cfg.dq_num_warps}" if cfg.dq_mode == "pass" else ""))


# ---- the op -------------------------------------------------------------------------------
_KERNELS: dict = {}
_DOT_THREADS = 256
LSE_PAD = 128   # the template's LSE_PAD: lse_log2/delta rows per (batch, head) padded to this


def _kernels_for(dtype: str, head_dim: int, causal: bool, deterministic: bool, arch: str,
                 config: AttentionBwdConfig | None = None, mask_flags: tuple = ()):
    """({name: Kernel}, config), memoized per key; ``mask_flags``: (name, value) pairs of the other
    compile-time mask fields."""
    key = (dtype, head_dim, causal, deterministic, arch, mask_flags) if config is None else (config, arch)
    hit = _KERNELS.get(key)
    if hit is None:
        from ..kernel import get_kernel
        cfg = config or choose_config(dtype, head_dim, causal, deterministic, arch, **dict(mask_flags))
        hit = _KERNELS[key] = ({n: get_kernel(cfg, n, arch=arch) for n in used_kernels(cfg)}, cfg)
    return hit


# Backward configs whose kernels compile_ahead has started (or found built), by (dtype, head_dim,
# causal, device): each is asked once per process.
_AHEAD: set = set()


def compile_ahead(dtype: str, head_dim: int, causal: bool, device: int) -> None:
    """Start building the dense backward's kernels for a forward that will be differentiated (the
    torch layer calls it as ``torch.ops.rtk.attention`` records for autograd), on a background
    thread, so that a cold first training step compiles the forward and the backward at once
    instead of one after the other (NVRTC runs without the GIL).  The backward then finds its
    kernels built, or waits for the build in flight (build_module builds a key once).  Cheap once
    per (dtype, head_dim, causal, device); nothing for inputs the backward would refuse (the call
    itself reports them); any failure here is left for the backward call to meet.
    ``RTKERNELS_COMPILE_AHEAD=0`` turns it off."""
    key = (dtype, head_dim, causal, device)
    if key in _AHEAD:
        return
    _AHEAD.add(key)
    if getenv("RTKERNELS_COMPILE_AHEAD", "1") == "0" or dtype not in ("float16", "bfloat16") \
            or not (8 <= head_dim <= 256 and head_dim % 8 == 0):
        return

    def build():
        try:
            arch = _device_arch(device)
            if _sm90.is_sm90(arch) and _sm90.picks(head_dim, causal, (), dtype, False):
                _sm90.kernels_for(_sm90.choose_config(dtype, head_dim, causal, False), arch)
            else:
                _kernels_for(dtype, head_dim, causal, False, arch)
        except Exception:   # (the backward call builds again and raises it there, where it belongs)
            pass
    import threading
    threading.Thread(target=build, name="rtk-compile-ahead", daemon=True).start()


def _bad(field: str, value: Any, message: str) -> ConfigError:
    return ConfigError(f"{FAMILY}: {message}", family=FAMILY, field=field, value=value, allowed=message)


def _dot_lanes(head_dim: int) -> int:
    return 1 << max(0, (head_dim // 8 - 1).bit_length())


def attention_backward(do, q, k, v, o, lse, causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False, dq=None, dk=None, dv=None, *, cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                       window: tuple[int, int] | None = None, softcap: float | None = None, dtype: str | None = None,
                       stream=None, config: AttentionBwdConfig | None = None):
    """FlashAttention-2 backward: gradients of ``o = attention(q, k, v, causal, softmax_scale, ...)``.

    Parameters
    ----------
    do : gradient of o, q's shape and dtype.  Any view: the fully broadcast dO of
        ``o.sum().backward()`` (every stride 0) is copied, as below.
    q, k, v, o : as for :func:`rtkernels.ops.attention.attention` (o its output); float16 or
        bfloat16 (torch tensors, or uint16 CuPy arrays with ``dtype="bfloat16"``).  Read in place:
        last dimension contiguous, other strides non-negative multiples of 8 elements, 16-byte
        aligned start; on sm_90 (the Hopper kernels, head_dim <= 256) also no stride 0 or overlap
        (K/V ``expand``-ed over heads or batch).  Every other view of do, q, k, v, o and lse is
        copied to a compact array on the call's stream first (the call then keeps no launch
        plan).  K/V broadcast over heads are not folded into GQA here: dk and dv keep one gradient
        per (broadcast) head, as their shapes say.  Packed (total, heads, head_dim) with
        cu_seqlens (the same view rules).
    lse : float32 (batch, nheads, seqlen_q) - (nheads, total_q) with cu_seqlens - the forward's
        log-sum-exp (natural log; -inf for rows that see no key: their gradients are 0).
    causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, window, softcap : exactly as given to the
        forward (the gradient goes through the softcap).  max_seqlen_q / max_seqlen_k: hints as in
        the forward - when either is missing cu_seqlens is read back and checked (**a
        device-to-host copy and a stream synchronization**).  With both (ints) on the Hopper
        kernels (sm_90, head_dim <= 256) the call keeps a launch plan: later calls with the same
        array signatures, hints and options replay it - new cu_seqlens contents and new data
        included - without the checks, and CUDA graphs (CuPy or torch) capture such a call, its
        temporaries living in the stream's workspace (rtkernels.ops.workspace).  The mma.sync
        kernels (other GPUs; masked builds that spill on sm_90) take the full path every call,
        with their temporaries in the same workspace: CuPy calls capture too; torch tensors do not
        (the full path views them through DLPack, whose stream handshake is illegal under capture).
    deterministic : bit-identical results run to run: dQ from a separate pass per query tile (or
        added in a fixed order) instead of float32 atomics.  (dK and dV are deterministic either way.)
    dq, dk, dv : optional outputs (shapes of q, k, v; same dtype and device; last dimension
        contiguous, other strides multiples of 8 elements, 16-byte aligned).  Broadcast or
        overlapping outputs are rejected (their writes would race).
    dtype : "bfloat16" to read uint16 CuPy arrays as bfloat16 bits.
    stream : CuPy stream, torch stream or raw handle (default: current CuPy stream, or torch's
        current stream for torch inputs).
    config : an :class:`AttentionBwdConfig` to run instead of the heuristics' choice (benchmark
        sweeps, tests); its dtype, head_dim, mask fields and deterministic must match the call.

    Returns
    -------
    ``(dq, dk, dv)`` in the input dtype, the same kind of arrays as q.  With GQA/MQA, dk and dv
    are summed over the query heads that share a kv head.

    Raises
    ------
    ConfigError : bad dtype, shape, head_dim, strides, devices, lse, outputs, window, softcap or
        cu_seqlens; nothing launched.
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        plan_key = _varlen_backward_plan_key((do, q, k, v, o, lse), (dq, dk, dv), cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic, dtype,
                                             config, window, softcap)
        vplan = _VARLEN_BACKWARD_PLANS.get(plan_key)
        if vplan is not None:
            return vplan.replay((do, q, k, v, o, lse), (dq, dk, dv), cu_seqlens_q, cu_seqlens_k, stream, plan_key[1])
    else:
        plan_key = _backward_plan_key((do, q, k, v, o, lse), (dq, dk, dv), causal, softmax_scale, deterministic,
                                      dtype, config, window, softcap)
        plan = _BACKWARD_PLANS.get(plan_key)
        if plan is not None:
            return _replay_backward(plan, (do, q, k, v, o, lse), (dq, dk, dv), stream)
    from ._arrays import as_device_array, new_like, dtype_name   # (below the replays: ~0.5 us a call)
    import cupy
    spec = mask_spec(causal, window, softcap, varlen, family=FAMILY)
    p = check_inputs({"do": do, "q": q, "k": k, "v": v, "o": o}, dtype, softmax_scale, FAMILY, varlen=varlen)
    do_, q_, k_, v_, o_ = (p.views[n] for n in ("do", "q", "k", "v", "o"))
    dt, dev, softmax_scale = p.dtype, p.device, p.softmax_scale
    batch, seqlen_q, nheads, head_dim = q_.shape     # varlen: (1, total_q, nheads, head_dim)
    seqlen_k = p.seqlen_k
    causal, deterministic = spec.causal, bool(deterministic)
    lse_ = as_device_array(lse, FAMILY, "lse")
    lse_shape = (nheads, seqlen_q) if varlen else (batch, nheads, seqlen_q)
    if tuple(lse_.shape) != lse_shape or str(lse_.dtype) != "float32" or _device_of(lse_) != dev:
        raise _bad("lse", lse_.shape, f"lse must be a float32 array of shape {lse_shape} on device "
                                      f"{dev} (the forward's), got {lse_.dtype} {tuple(lse_.shape)} on device "
                                      f"{_device_of(lse_)}")
    vl = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqlen_q, seqlen_k, dev,
                      FAMILY) if varlen else None
    flags = tuple(spec.flags().items())[1:]   # all but causal
    if config is not None:
        want = (dt, head_dim, causal, deterministic, *dict(flags).values())
        if not isinstance(config, (AttentionBwdConfig, _sm90.AttentionBwdSm90Config)) or (
                config.dtype, config.head_dim, config.causal, config.deterministic,
                *config.mask_flags().values()) != want:
            raise _bad("config", config, f"config must be an AttentionBwdConfig or AttentionBwdSm90Config with "
                                         f"(dtype, head_dim, causal, deterministic, has_window, has_softcap, "
                                         f"is_varlen) = {want}")

    with cupy.cuda.Device(dev):
        outs = []
        for name, given, shape in (("dq", dq, q_.shape), ("dk", dk, k_.shape), ("dv", dv, k_.shape)):
            shape = tuple(shape[1:]) if varlen else tuple(shape)
            arr = new_like(q, shape, dt) if given is None else given
            view = as_device_array(arr, FAMILY, name)
            if given is not None:
                odt = "bfloat16" if (dt == "bfloat16" and str(view.dtype) == "uint16") else dtype_name(given)
                if tuple(view.shape) != shape or odt != dt or _device_of(view) != dev:
                    raise _bad(name, view.shape, f"{name} must be a {dt} array of shape {shape} on device "
                                                 f"{dev}, got {odt} {tuple(view.shape)} on device {_device_of(view)}")
            outs.append((arr, view[None] if varlen else view))
        (dq_o, dq_), (dk_o, dk_), (dv_o, dv_) = outs
        for name, view in (("dq", dq_), ("dk", dk_), ("dv", dv_)):
            check_output(FAMILY, name, view)
        if batch == 0 or nheads == 0:
            return dq_o, dk_o, dv_o
        if seqlen_q == 0 or seqlen_k == 0:
            # nothing to attend: every gradient is 0 (dq is empty or all its rows see no key)
            for view in (dq_, dk_, dv_):
                view.fill(0)
            return dq_o, dk_o, dv_o
        arch = _device_arch(dev)
        stream = default_stream(q, stream)
        # the Hopper kernel (picked, or asked for by config) reads q, k, v and dO through tensor maps;
        # picks() with the mask options (a spilling masked build keeps the mma.sync kernel), after
        # the arch test (it compiles a masked build to read its spills)
        tma = isinstance(config, _sm90.AttentionBwdSm90Config) or (
            config is None and _sm90.is_sm90(arch) and _sm90.picks(head_dim, causal, flags, dt, deterministic))
        # Inputs the kernels cannot read as they are (a dO expanded from o.sum().backward(), K/V
        # broadcast over heads or batch on the Hopper kernel's path, negative strides) are copied.
        (do_, q_, k_, v_, o_), staged = read_inputs(FAMILY, (("do", do_), ("q", q_), ("k", k_), ("v", v_),
                                                             ("o", o_)), stream, tma)
        lse_c, lse_staged = _views.read_view(FAMILY, "lse", lse_, stream, lambda i: i.kind == _views.CONTIGUOUS)
        staged |= lse_staged
        s_do, s_q, s_k, s_v, s_o = (_elem_strides(x, n) for x, n in ((do_, "do"), (q_, "q"), (k_, "k"), (v_, "v"),
                                                                   (o_, "o")))
        s_dq, s_dk, s_dv = (_elem_strides(view, n) for view, n in ((dq_, "dq"), (dk_, "dk"), (dv_, "dv")))

        if isinstance(config, _sm90.AttentionBwdSm90Config):
            if not _sm90.runnable(arch, (do_, q_, k_, v_, o_), seqlen_k):
                raise _bad("config", config, f"an AttentionBwdSm90Config runs on sm_90 with TMA-addressable inputs "
                                             f"(device is {arch})")
            hopper = config
        elif config is None and _sm90.eligible(arch, (do_, q_, k_, v_, o_), seqlen_k, head_dim, causal, flags, dt,
                                               deterministic):
            hopper = _sm90.choose_config(dt, head_dim, causal, deterministic, **dict(flags))
        else:
            hopper = None
        scale = float(softmax_scale)
        mask_args = spec.kernel_args(seqlen_q, seqlen_k)   # dense: the lengths; varlen: the totals
        if varlen:   # per-head buffers: each sequence at its padded start (rtk/attn_mask.cuh)
            rows = padded_offset_rows(seqlen_q, vl.batch, LSE_PAD)
            lse2_shape, dot_grid = (nheads, rows), (-(-rows // (_DOT_THREADS // _dot_lanes(head_dim))), nheads, 1)
        else:
            sq_pad = -(-seqlen_q // LSE_PAD) * LSE_PAD
            lse2_shape, dot_grid = (batch, nheads, sq_pad), (-(-sq_pad // (_DOT_THREADS // _dot_lanes(head_dim))),
                                                             nheads, batch)
        strides = (s_o, s_do, s_dq, s_dk, s_dv)
        if hopper is not None and varlen:   # temporaries in the stream's workspace (VarlenBackwardPlan)
            vplan = _sm90.VarlenBackwardPlan.record(hopper, arch, (do_, q_, k_, v_, o_), (dq_o, dk_o, dv_o), strides,
                                                    scale, dot_grid, mask_args, vl, rows)
            vplan.run((do_, q_, k_, v_, o_, lse_c), (dq_, dk_, dv_), vl.cu_q, vl.cu_k, q, dev, stream)
            if plan_key is not None and not staged and same_memory(
                    (do_, q_, k_, v_, o_, lse_c, dq_, dk_, dv_, vl.cu_q, vl.cu_k),
                    (do, q, k, v, o, lse, dq_o, dk_o, dv_o, cu_seqlens_q, cu_seqlens_k)):
                _VARLEN_BACKWARD_PLANS.put(plan_key, vplan)
            return dq_o, dk_o, dv_o
        if hopper is not None:
            with cupy_stream(stream):   # workspaces return to the pool only after this stream's work
                lse2 = cupy.empty(lse2_shape, cupy.float32)
                delta = cupy.empty(lse2_shape, cupy.float32)
            _sm90.launch(hopper, arch, q_, k_, v_, o_, do_, lse_c, lse2, delta, dq_, dk_, dv_, strides, scale,
                         dot_grid, stream, mask_args=mask_args)
            if plan_key is not None and not staged:
                _remember_backward(plan_key, hopper, arch, (do_, q_, k_, v_, o_, lse_), (dq_o, dk_o, dv_o),
                                   lse2.shape, strides, scale, dot_grid, mask_args)
            return dq_o, dk_o, dv_o
        kerns, cfg = _kernels_for(dt, head_dim, causal, deterministic, arch, config, flags)
        _launch_mma(kerns, cfg, arch, vl, (do_, q_, k_, v_, o_), lse_c, lse2_shape, (dq_, dk_, dv_),
                    (s_do, s_q, s_k, s_v, s_o, s_dq, s_dk, s_dv), scale, dot_grid, mask_args, stream, q, dev)
    return dq_o, dk_o, dv_o


def _launch_mma(kerns, cfg, arch, vl, views, lse_c, lse2_shape, grads, strides, scale, dot_grid, mask_args, stream,
                like, dev):
    """The mma.sync kernels: pre-pass, attention_bwd, then the dQ pass or the dQ conversion.
    Temporaries: dense calls take them from CuPy's pool; varlen calls from one buffer of the
    stream's workspace (:func:`_varlen_mma_temporaries`; ``like``, ``dev``: the caller's q and
    device), so a CUDA graph can capture them as it captures the Hopper kernels' plans."""
    import cupy
    do_, q_, k_, v_, o_ = views
    dq_, dk_, dv_ = grads
    s_do, s_q, s_k, s_v, s_o, s_dq, s_dk, s_dv = strides
    batch, seqlen_q, nheads, head_dim = q_.shape
    seqlen_k, nheads_kv = k_.shape[1], k_.shape[2]
    group = nheads // nheads_kv
    in_main = cfg.dq_mode != "pass"
    rows = lse2_shape[-1]
    if vl is None:
        with cupy_stream(stream):   # the pool hands them out again only after this stream's work
            lse2, delta = cupy.empty(lse2_shape, cupy.float32), cupy.empty(lse2_shape, cupy.float32)
            dq_accum = cupy.empty((batch, nheads, seqlen_q, head_dim), cupy.float32) if in_main else None
            dq_count = (cupy.empty((batch, nheads, -(-seqlen_q // cfg.block_m), cfg.dq_units, 4), cupy.int32)
                        if (cfg.deterministic and in_main) else None)
        cu_q, cu_k, nb = None, None, batch
        grid, sched = (-(-seqlen_k // cfg.block_n), nheads_kv, batch), None
        dq_grid, dq_sched = (-(-seqlen_q // cfg.dq_block_m), nheads, batch), None
    else:
        (lse2, delta, dq_accum, dq_count, sched, dq_sched), slots = _varlen_mma_temporaries(
            cfg, arch, vl, nheads, head_dim, rows, like, dev, stream)
        cu_q, cu_k, nb = vl.cu_q, vl.cu_k, vl.batch
        grid, dq_grid = (nheads_kv * slots[0],), (nheads * slots[1],)
    kerns["attention_bwd_dot"].launch(dot_grid, (_DOT_THREADS,), o_, do_, lse_c, lse2, delta,
                                      None if vl else dq_accum, None if vl else dq_count, seqlen_q, *s_o[:3],
                                      *s_do[:3], cu_q, nb, stream=stream)
    kerns["attention_bwd"].launch(
        grid, (cfg.threads_per_block,),
        do_, q_, k_, v_, lse2, delta, dq_accum, dq_count, dk_, dv_, seqlen_q, seqlen_k, group,
        nheads, *s_q[:3], *s_k[:3], *s_v[:3], *s_do[:3], *s_dk[:3], *s_dv[:3], scale, cu_q, cu_k, sched, nb,
        *mask_args, shared_mem=cfg.shared_mem_bytes, stream=stream)
    if not in_main:
        kerns["attention_bwd_dq"].launch(
            dq_grid, (32 * cfg.dq_num_warps,),
            do_, q_, k_, v_, lse2, delta, dq_, seqlen_q, seqlen_k, group,
            *s_q[:3], *s_k[:3], *s_v[:3], *s_do[:3], *s_dq[:3], scale, cu_q, cu_k, dq_sched, nheads, nb, *mask_args,
            shared_mem=cfg.dq_shared_mem_bytes, stream=stream)
    else:
        chunks = head_dim // 8
        grid = ((-(-rows * chunks // 256), nheads, 1) if vl else (-(-seqlen_q * chunks // 256), nheads, batch))
        kerns["attention_bwd_dq_convert"].launch(grid, (256,), dq_accum, dq_, seqlen_q, *s_dq[:3], scale, cu_q, nb,
                                                 stream=stream)


def _varlen_mma_temporaries(cfg, arch, vl, nheads: int, head_dim: int, rows: int, like, dev: int, stream):
    """((lse2, delta, dq_accum, dq_count, key-tile schedule, query-tile schedule), (key slots,
    query slots)) of a varlen call on the mma.sync kernels: device addresses in ONE buffer of the
    stream's workspace (ops/workspace.py, as the Hopper kernels' VarlenBackwardPlan), each part at
    its own offset - the two schedules (attention_bwd's key tiles, the dQ pass's query tiles) and
    the rest are alive in the same call.  dq_accum and dq_count are zeroed here (the pre-pass's
    rows are padded rows, not the accumulators' own); the schedules are written on the stream.
    None for the parts the config does not use (dq_mode "pass": no accumulator or counters, and the
    query-tile schedule; not deterministic: no counters)."""
    import cupy
    from ..kernel import DevicePtr
    from ._arrays import address
    from .attention_mask import schedule_launch, schedule_slots
    from .workspace import carve, stream_handle, stream_workspace
    in_main = cfg.dq_mode != "pass"
    slots_k = schedule_slots(vl, cfg.block_n, keys=True)
    slots_q = 0 if in_main else schedule_slots(vl, cfg.dq_block_m)
    offsets, nbytes = carve((4 * nheads * rows, 4 * nheads * rows, 4 * nheads * rows * head_dim if in_main else 0,
                             16 * nheads * (rows // cfg.block_m) * cfg.dq_units if cfg.deterministic and in_main else 0,
                             8 * slots_k, 8 * slots_q))
    base = address(stream_workspace(like, dev, stream, nbytes, 0)[0])
    parts = tuple(None if off is None else DevicePtr(base + off) for off in offsets)
    if in_main:   # dq_accum and dq_count lie back to back: one memset
        cupy.cuda.runtime.memsetAsync(parts[2], 0, offsets[4] - offsets[2], stream_handle(stream))
    schedule_launch(vl.batch, vl.total_k, vl.total_q, cfg.block_n, slots_k, cfg.causal, arch).run(
        vl.cu_k, vl.cu_q, parts[4], stream)
    if not in_main:
        schedule_launch(vl.batch, vl.total_q, vl.total_k, cfg.dq_block_m, slots_q, cfg.causal, arch).run(
            vl.cu_q, vl.cu_k, parts[5], stream)
    return parts, (slots_k, slots_q)


# ---- per-signature launch plans (Hopper kernel) -----------------------------------------------
# As the forward's (rtkernels.ops.attention): check_inputs, views, stride checks and dispatch cost
# ~230 us of host time per call with torch tensors (H200 host, 2026-11-21); their outcome depends
# only on the arrays' signatures and the options, so a repeated signature rebuilds the views from
# the addresses (no checks), allocates the outputs and workspaces and launches.
_BACKWARD_PLANS = LaunchPlans(1024)


class _BackwardPlan(NamedTuple):
    cfg: Any
    arch: str
    view_dtypes: tuple   # CuPy dtypes of do, q, k, v, o, lse (bfloat16 as uint16)
    out_shapes: tuple    # dq, dk, dv
    out_dtype: Any       # of the arrays handed back (torch or CuPy dtype)
    lse2_shape: tuple
    strides: tuple       # element strides of o, do, dq, dk, dv
    scale: float
    dot_grid: tuple
    torch: bool
    mask_args: tuple     # (window_left, window_right, softcap)


def _backward_plan_key(arrays, outs, causal, softmax_scale, deterministic, dtype, config, window=None, softcap=None):
    if not _sm90.ENABLED:
        return None
    return _BACKWARD_PLANS.key(tuple(arrays) + tuple(outs), (bool(causal), softmax_scale, bool(deterministic),
                                                               dtype, config, window, softcap,
                                                               getenv("RTKERNELS_ARCH")))


def _remember_backward(key, cfg, arch, views, outs, lse2_shape, strides, scale, dot_grid, mask_args) -> None:
    _BACKWARD_PLANS.put(key, _BackwardPlan(cfg, arch, tuple(v.dtype for v in views),
                                             tuple(tuple(o.shape) for o in outs), outs[0].dtype, tuple(lse2_shape),
                                             strides, scale, dot_grid, _is_torch(outs[0]), tuple(mask_args)))


# Varlen calls (Hopper kernels): the full path cost 358-524 us of host time per call on an H200
# host (CuPy arrays, d128, 16 x 512 tokens, 2026-11-26) against ~15 us for a dense replay.  As for
# the forward's varlen plans (rtkernels.ops.attention._VARLEN_PLANS), what the path decides depends
# on the arrays' signatures (cu_seqlens' included), the max_seqlen hints and the options, not on
# cu_seqlens' contents (the kernels read them on the device), so a call with both hints as ints
# keeps its _sm90.VarlenBackwardPlan and later calls replay it - no host read, so capturable; its
# temporaries live in the stream's workspace (the plan's docstring).  The mma.sync kernels (masked
# builds the Hopper kernels do not take, or sm_80/89) keep the full path (its host cost every
# call), its temporaries in the same workspace (_varlen_mma_temporaries), so CuPy calls capture too
# (torch tensors do not: the full path's DLPack views make the legacy stream wait on the capture).
_VARLEN_BACKWARD_PLANS = LaunchPlans(256)


def _varlen_backward_plan_key(arrays, outs, cu_q, cu_k, max_q, max_k, causal, softmax_scale, deterministic, dtype,
                              config, window, softcap):
    """The plan key of a varlen backward call, or None (a missing or non-int hint: the full path
    reads cu_seqlens, and its checks report bad hints)."""
    if type(max_q) is not int or type(max_k) is not int or not _sm90.ENABLED:
        return None
    return _VARLEN_BACKWARD_PLANS.key(tuple(arrays) + tuple(outs) + (cu_q, cu_k),
                                      (bool(causal), softmax_scale, bool(deterministic), dtype, config, window,
                                       softcap, max_q, max_k, getenv("RTKERNELS_ARCH")))


def _replay_backward(plan: _BackwardPlan, arrays, outs, stream):
    import cupy
    q = arrays[1]
    res = tuple(given if given is not None else empty_as(q, shape, plan.out_dtype)
                for given, shape in zip(outs, plan.out_shapes))
    if plan.torch:
        dev = q.get_device()
        views = tuple(torch_view_as(a, dt, dev) for a, dt in zip(arrays, plan.view_dtypes))
        out_views = tuple(torch_view_as(r, plan.view_dtypes[1], dev) for r in res)
    else:
        views, out_views = arrays, res
    do_, q_, k_, v_, o_, lse_ = views
    stream = default_stream(q, stream)
    with cupy_stream(stream):
        lse2, delta = cupy.empty(plan.lse2_shape, cupy.float32), cupy.empty(plan.lse2_shape, cupy.float32)
    _sm90.launch(plan.cfg, plan.arch, q_, k_, v_, o_, do_, lse_, lse2, delta, *out_views, plan.strides, plan.scale,
                 plan.dot_grid, stream, mask_args=plan.mask_args)
    return res


# ---- reference ----------------------------------------------------------------------------
def attention_backward_reference(do, q, k, v, causal: bool = False, softmax_scale: float | None = None, *,
                                 dtype: str | None = None, compute: str = "float32", round_to: str | None = None,
                                 window=None, softcap=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Direct-formula backward in CuPy: ``(dq, dk, dv)`` as float32/float64 arrays.

    P = softmax(score [masked]) recomputed from q, k with score = scale q k^T, or with a softcap
    c * tanh(scale q k^T / c) (rows with no visible key: P = 0), dV = P^T dO, dP = dO V^T,
    dS = P * (dP - rowsum(dP * P)) [* (1 - tanh^2) through the cap], dQ = scale dS K,
    dK = scale dS^T Q; dK, dV summed over each GQA group.  Windows, softcap and varlen
    (cu_seqlens: per-sequence dense references) as in :func:`rtkernels.ops.attention.attention`,
    from the same mask spec.  ``round_to`` rounds P, dS and the products to that dtype (a
    framework's low-precision run) for the 2x error rule.  One (batch, head) at a time.
    """
    import cupy
    spec = mask_spec(causal, window, softcap, cu_seqlens_q is not None or cu_seqlens_k is not None)
    ft = cupy.float64 if compute == "float64" else cupy.float32
    dof, qf, kf, vf = (_to_f32(a, dtype).astype(ft) for a in (do, q, k, v))
    scale = 1.0 / math.sqrt(qf.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if not spec.is_varlen:
        return _backward_reference_dense(dof, qf, kf, vf, spec, scale, round_to, ft)
    cq, ck = (cupy.asnumpy(cupy.asarray(c)).astype(int) for c in (cu_seqlens_q, cu_seqlens_k))
    dq, dk, dv = cupy.zeros(qf.shape, ft), cupy.zeros(kf.shape, ft), cupy.zeros(vf.shape, ft)
    for b in range(len(cq) - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        g = _backward_reference_dense(dof[None, rq], qf[None, rq], kf[None, rk], vf[None, rk], spec, scale, round_to,
                                      ft)
        dq[rq], dk[rk], dv[rk] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _backward_reference_dense(dof, qf, kf, vf, spec, scale: float, round_to, ft):
    import cupy
    from .attention import _round
    batch, sq, nheads, d = qf.shape
    sk, nheads_kv = kf.shape[1], kf.shape[2]
    group = nheads // nheads_kv
    rnd = (lambda x: _round(x.astype(cupy.float32), round_to).astype(ft)) if round_to else (lambda x: x)
    dq = cupy.zeros((batch, sq, nheads, d), ft)
    dk = cupy.zeros((batch, sk, nheads_kv, d), ft)
    dv = cupy.zeros((batch, sk, nheads_kv, d), ft)
    if sq == 0 or sk == 0:
        return dq, dk, dv
    visible = spec.visible(sq, sk, cupy)
    for b in range(batch):
        for h in range(nheads):
            hk = h // group
            s = scale * (qf[b, :, h] @ kf[b, :, hk].T)
            if spec.has_softcap:
                t = cupy.tanh(s / spec.softcap)
                s = spec.softcap * t
            s = cupy.where(visible, s, -cupy.inf)
            m = s.max(axis=1, keepdims=True)
            m = cupy.where(cupy.isfinite(m), m, 0)
            p = cupy.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            p = rnd(p / cupy.where(l > 0, l, 1))
            g = dof[b, :, h]
            dv[b, :, hk] += rnd(p.T @ g)
            dp = g @ vf[b, :, hk].T
            ds = p * (dp - (dp * p).sum(axis=1, keepdims=True))
            if spec.has_softcap:
                ds = ds * (1 - t * t)
            ds = rnd(ds)
            dq[b, :, h] = rnd(scale * (ds @ kf[b, :, hk]))
            dk[b, :, hk] += rnd(scale * (ds.T @ qf[b, :, h]))
    return dq, dk, dv


from . import attention_bwd_sm90 as _sm90  # noqa: E402  (imports attention_sm90, not this module)
