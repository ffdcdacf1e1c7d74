"""matmul: tiled tensor-core GEMM with a fused bias + activation epilogue.

>>> c = rtk.matmul(a, b)                                   # (M, K) @ (K, N)
>>> c = rtk.matmul(a, b, bias=bias, activation="gelu")     # act(a @ b + bias), one pass over C
>>> c = rtk.matmul(a, b, trans_b=True)                     # a @ b.T without a copy

float16 / bfloat16 run on tensor cores: on sm_90 (H100 / H200) the warp-specialized, persistent
TMA + wgmma kernel of :mod:`rtkernels.ops.matmul_sm90` whenever TMA can address the operands
(16-byte aligned base and strides, K >= 1); everywhere else, and for such inputs (e.g. K = 9
bfloat16 rows), the mma.sync m16n8k16 kernel with a cp.async multi-stage pipeline
(templates/matmul.cu.j2).  float32 runs a SIMT FFMA kernel (no tf32).  Tile sizes come from
wave-aware heuristics (:func:`heuristic_config`, :func:`matmul_sm90.heuristic_config`), or from
the autotuner with ``RTKERNELS_AUTOTUNE=1``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import arch as arch_mod
from .. import autotune, device
from .._env import getenv, getenv_raw
from ..config import KernelConfig, register_family
from ..errors import ConfigError
from ..kernel import get_kernel
from . import gemv
from . import matmul_fp8 as _fp8
from .matmul_common import activation_reference, tune_bucket
from . import matmul_sm90 as m90
from . import views
from ._arrays import (Launch, LaunchPlans, OutputPlan, _is_torch, address, as_device_array, cupy_stream,
                      default_stream, dtype_name, new_like, same_memory)
from .workspace import captured_buffer, stream_workspace

ACTIVATIONS = m90.ACTIVATIONS   # one list for both kernels' shared epilogue
_DTYPES = ("float16", "bfloat16", "float32")
# sm_90's opt-in per block (227 KiB); smaller archs are pruned by the autotuner
_SMEM_LIMIT = arch_mod.limits("sm_90").max_smem_per_block_optin
# On sm_90 float16 / bfloat16 go to the Hopper kernel whenever TMA can address them; False (or
# RTKERNELS_MATMUL_SM90=0 at import) sends them to the mma.sync kernel there too, so that its
# aligned, even-K paths are tested and benchmarked on the Hopper machines we have.
USE_SM90 = os.environ.get("RTKERNELS_MATMUL_SM90", "1") != "0"
# What the Hopper kernel's consumers multiply with: "wgmma" (the product's path, ~1.0x cuBLAS), or
# "sync" (RTKERNELS_MATMUL_SM90_MMA=sync): ldmatrix + mma.sync m16n8k16 fed by the same TMA
# producer, to measure the sm_80 instruction on Hopper without cp.async's issue cost.
SM90_MMA = os.environ.get("RTKERNELS_MATMUL_SM90_MMA", "wgmma")
# RTKERNELS_MATMUL_SPLIT_K=S: the Hopper kernel (wgmma consumers) splits K S ways (clamped to the
# k-blocks; 1: never) instead of as its heuristic chooses; a measurement and test knob, read when a
# call signature is first planned (it is part of the plan keys).
SPLIT_K_ENV = "RTKERNELS_MATMUL_SPLIT_K"
# RTKERNELS_MATMUL_STREAM_K=1: the Hopper kernel (wgmma consumers) runs the stream-K schedule on
# its heuristic's tile; 0: never; unset: the heuristic weighs it (matmul_sm90.heuristic_config).
# Until 2026-11-26 the heuristic did not: where its model chose stream-K, it measured 0.40-0.62x
# cuBLAS (512 x {6144, 10240, 14336, 28672} x K, H100 2026-11-25) because the tiles sharing a B
# column ran their k-blocks at different times and each re-read B from DRAM (ncu, H200: 171 MB
# against 57 MB for whole tiles at 512x6144x4096); the kernel's lanes fix that (see
# templates/matmul_sm90.cu.j2, "Lanes").  Read like RTKERNELS_MATMUL_SPLIT_K; the two cannot both
# force a schedule.
STREAM_K_ENV = "RTKERNELS_MATMUL_STREAM_K"
# RTKERNELS_MATMUL_CLUSTER_K=2: the Hopper kernel (wgmma consumers) runs its heuristic's tile as
# cluster-K (matmul_sm90.MatmulSm90Config.cluster_k: two CTAs per tile, each over half of K, the
# partials summed through distributed shared memory; the ring cut to fit the receive buffer); 1 or
# unset: the heuristic's schedule (rule 2b's two-way thin splits run as cluster-K).  A measurement and
# test knob read like RTKERNELS_MATMUL_SPLIT_K; it cannot be combined with that or
# RTKERNELS_MATMUL_STREAM_K=1, and either of those replaces the heuristic's cluster-K.
CLUSTER_K_ENV = "RTKERNELS_MATMUL_CLUSTER_K"
# float16 / bfloat16 with at most 16 rows of C (the batch folded in) run the GEMV kernel
# (ops/gemv.py, :func:`_plan_gemv`); False (or RTKERNELS_MATMUL_GEMV=0 at import) leaves them to
# the tile kernels, to benchmark and test one against the other.
USE_GEMV = os.environ.get("RTKERNELS_MATMUL_GEMV", "1") != "0"


@register_family
@dataclass(frozen=True)
class MatmulConfig(KernelConfig):
    """One matmul specialization: tiles, pipeline depth, operand layouts, load widths, epilogue.

    ``a_kmajor``: A's K dimension is contiguous (a row-major (M, K)); else M is.
    ``b_kmajor``: B's K dimension is contiguous (``trans_b`` of a row-major (N, K)); else N is.
    ``vec_a`` / ``vec_b``: elements per global load (8 = 16 bytes), lowered by the host when a
    stride or base pointer is not aligned for wider ones.
    ``edge_a`` / ``edge_b``: the operand's contiguous extent (K if K-major, else M / N) is not a
    multiple of ``vec_a`` / ``vec_b`` (a padded row stride, a single row), so a row's last chunk
    may be partial: it is loaded element by element, never read whole past the row.
    ``even_k``: K is a multiple of ``block_k``, so the kernel drops all K bounds checks (the
    host sets it per call; False is always correct).
    ``ldsm_first``: the double-buffered main loop issues the next k step's ldmatrix before the
    k-tile's refill copies (~10% faster: 461 -> 510 TFLOP/s, 128x256x32 at 4096^3 on an H200);
    False issues the copies first, which the 64-deep tiles' K-tail path needs to stay in
    registers.
    ``copy_steps``: the refill copies of a k-tile are spread over its first ``copy_steps`` k steps
    of 16 (1: all issued in the first step); needs ``ldsm_first`` and 16-byte loads.
    ``l2_prefetch``: L2 fetch-size hint of the 16-byte copies in bytes (0: none, 64, 128, 256).
    """

    family: ClassVar[str] = "matmul"
    template: ClassVar[str] = "matmul.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("matmul",)
    expected_global_width: ClassVar[int | None] = 128
    dtype: str = "bfloat16"
    block_m: int = 128
    block_n: int = 256
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 4
    warps_m: int = 2
    group_m: int = 8
    a_kmajor: bool = True
    b_kmajor: bool = False
    vec_a: int = 8
    vec_b: int = 8
    edge_a: bool = False
    edge_b: bool = False
    has_bias: bool = False
    activation: str = "none"
    even_k: bool = False
    ldsm_first: bool = True
    copy_steps: int = 1
    l2_prefetch: int = 0

    @property
    def expects_tensor_cores(self) -> bool:
        return self.dtype != "float32"

    def __post_init__(self):
        if self.activation is None:
            object.__setattr__(self, "activation", "none")
        self._check_dtype("dtype", _DTYPES)
        self._check_choice("activation", ACTIVATIONS)
        for f in ("a_kmajor", "b_kmajor", "edge_a", "edge_b", "has_bias", "even_k", "ldsm_first"):
            if not isinstance(getattr(self, f), bool):
                self._fail(f, "True or False")
        for edge, vec in (("edge_a", "vec_a"), ("edge_b", "vec_b")):
            if getattr(self, edge) and getattr(self, vec) == 1:
                self._fail(edge, f"False with {vec}=1 (a one-element chunk is never partial)")
        self._check_int("block_m", 16, 256, multiple_of=16)
        self._check_int("block_n", 16, 256, multiple_of=16)
        self._check_int("num_warps", 1, 16, power_of_two=True)
        self._check_int("warps_m", 1, self.num_warps, power_of_two=True)
        self._check_int("group_m", 1, 64)
        if self.num_warps % self.warps_m:
            self._fail("warps_m", f"a divisor of num_warps={self.num_warps}")
        if self.dtype == "float32":
            self._check_int("block_k", 4, 32, power_of_two=True)
            if self.num_warps != 8:
                self._fail("num_warps", "8 for float32 (the SIMT kernel is a 16 x 16 thread grid)")
            self._check_int("block_m", 16, 128, multiple_of=16)
            self._check_int("block_n", 16, 128, multiple_of=16)
            self._check_int("num_stages", 1, 1)
            self._check_int("vec_a", 1, 1)
            self._check_int("vec_b", 1, 1)
            self._check_int("copy_steps", 1, 1)
            self._check_choice("l2_prefetch", (0,))
            return
        self._check_int("block_k", 16, 128, power_of_two=True)
        self._check_int("num_stages", 2, 8)
        self._check_int("vec_a", 1, 8, power_of_two=True)
        self._check_int("vec_b", 1, 8, power_of_two=True)
        self._check_int("copy_steps", 1, self.block_k // 16)
        if self.copy_steps > 1 and not (self.ldsm_first and self.vec_a == 8 and self.vec_b == 8):
            self._fail("copy_steps", "1 unless ldsm_first and vec_a == vec_b == 8 (the double-buffered loop)")
        if self.copy_steps == self.block_k // 16 and self.copy_steps > 1 and self.num_stages < 3:
            self._fail("copy_steps", "below block_k / 16 with 2 stages (copies committed after the barrier)")
        self._check_choice("l2_prefetch", (0, 64, 128, 256))
        warps_n = self.num_warps // self.warps_m
        if self.block_m % (16 * self.warps_m):
            self._fail("block_m", f"a multiple of 16 * warps_m = {16 * self.warps_m}")
        if self.block_n % (16 * warps_n):
            self._fail("block_n", f"a multiple of 16 * (num_warps / warps_m) = {16 * warps_n}")
        acc = (self.block_m // self.warps_m) * (self.block_n // warps_n) // 32
        if acc > 128:
            self._fail("block_n", f"such that a warp's tile has at most 64 x 64 accumulators (got "
                                  f"{self.block_m // self.warps_m} x {self.block_n // warps_n}: it would spill)")
        threads = self.num_warps * 32
        for name, vec in (("vec_a", self.vec_a), ("vec_b", self.vec_b)):
            outer = self.block_m if name == "vec_a" else self.block_n
            if (outer * self.block_k // vec) % threads:
                self._fail(name, f"such that the {outer} x {self.block_k} tile splits into whole "
                                 f"{vec}-element chunks per thread ({threads} threads)")
        if self.shared_mem_bytes > _SMEM_LIMIT:
            self._fail("num_stages", f"small enough for {_SMEM_LIMIT} bytes of shared memory "
                                     f"(needs {self.shared_mem_bytes})")

    @property
    def use_mma(self) -> bool:
        return self.dtype != "float32"

    @property
    def threads_per_block(self) -> int:
        return self.num_warps * 32

    @property
    def shared_mem_bytes(self) -> int:
        """Dynamic shared memory: the cp.async ring, or the C tile the epilogue stages through it
        if that is larger (0 for the SIMT path, whose tiles are static)."""
        if not self.use_mma:
            return 0
        ring = self.num_stages * (self.block_m + self.block_n) * self.block_k * 2
        return max(ring, self.block_m * self.block_n * 2)

    def template_params(self):
        p = super().template_params()
        p.update(use_mma=self.use_mma, activation_id=ACTIVATIONS.index(self.activation),
                 shared_mem_bytes=self.shared_mem_bytes)
        return p


# ---- heuristics ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    warps_m: int
    blocks_per_sm: int   # resident CTAs per SM (ptxas registers / smem on sm_90)
    efficiency: float    # relative tensor-core throughput per resident SM
    why: str
    # Main-loop options, applied where the problem allows them (see _config): refill copies
    # spread over k steps, and the L2 fetch size of the copies.
    copy_steps: int = 1
    l2_prefetch: int = 0


# Each tile's efficiency is reasoned from its arithmetic intensity per byte of shared memory
# traffic (block_m * block_n / (block_m + block_n)): 85 for 128x256, 64 for 128x128, 43 for
# 128x64, 32 for 64x64; mma.sync on H100 needs ~80+ to keep the tensor pipes fed.
# blocks_per_sm from the ptxas report (test_matmul prints it) and the smem ring.
# Registers (sm_90, bf16, even K): 128x256x32 232, 256x128x32 232, 128x128x32/4 warps 238
# (2 CTAs/SM), 128x256x64 254, all without spills.
# Measured on an H200 (2026-11-21, bf16, TFLOP/s at 4096^3 / 8192^3, cuBLAS 781 / 783):
# 128x256x32/4 510 / 452, 256x128x32/4 ~490 / 480, 128x256x64/4 490 / 504, x64/3 487 / 455.
# Fourth session (tools/bench_matmul.py --sweep --passes 3: three interleaved passes, cuBLAS
# 789 / 790): 128x256x32/4 508 / 504 (its three 8192^3 passes 502-516), 128x256x64/4 490 / 452
# (448-473); the first, single-pass sweep had 507 / 456 and 489 / 456.  The 64-deep tile no
# longer earns its 192 KiB ring at long K: the 32-deep tile serves every K.  Neither main-loop
# option helps it: copies spread over both k steps with 256-byte L2 fetches 509 / 479, with 6
# stages 509 / 489; an L2 prefetch of B's rows 4-8 tiles ahead (prefetch.global.L2) 432 / 404.
TC_TILES = (
    _Tile(128, 256, 32, 8, 4, 2, 1, 1.00, "64x64 warp tiles, 96 KiB ring: the large-problem workhorse"),
    _Tile(256, 128, 32, 8, 4, 4, 1, 1.00, "same work as 128x256, better when N is the short side"),
    _Tile(128, 128, 32, 4, 4, 2, 2, 0.85, "64x64 warp tiles with half the CTA: fills the last wave"),
    _Tile(128, 64, 32, 4, 4, 2, 3, 0.65, "thin N or many small tiles"),
    _Tile(64, 64, 32, 4, 4, 2, 4, 0.50, "tiny/skinny problems: most CTAs"),
)
# Extra shapes the autotuner may try (never picked by the heuristic without a measurement;
# fourth-session TFLOP/s at 4096^3 / 8192^3 beside 508 / 504 for the heuristic's tile).
TUNE_ONLY = (
    _Tile(128, 256, 64, 8, 3, 2, 1, 1.00, "half the barriers per K; 144 KiB ring (487 / 455 TFLOP/s)"),
    _Tile(256, 128, 64, 8, 3, 4, 1, 1.00, "fewer barriers per K; 144 KiB ring"),
    _Tile(128, 256, 32, 8, 3, 2, 1, 1.00, "shallower ring, 2 CTAs of smem"),
    _Tile(128, 256, 64, 8, 4, 2, 1, 1.00, "the third session's long-K tile (490 / 452)"),
    _Tile(128, 256, 32, 8, 4, 2, 1, 1.00, "copies over both k steps, 256-byte L2 fetches (509 / 479)",
          copy_steps=2, l2_prefetch=256),
    _Tile(128, 256, 32, 8, 6, 2, 1, 1.00, "the same with 6 stages: five tiles in flight (509 / 489)",
          copy_steps=2, l2_prefetch=256),
    _Tile(128, 256, 64, 8, 4, 2, 1, 1.00, "64-deep, copies over 3 of its 4 k steps (502 / 469)", copy_steps=3),
)
# Narrow loads (vec_a or vec_b < 8: unaligned strides such as K % 8 != 0) issue up to 8x
# more copies per thread; 64x32 warp tiles over 8 warps keep their addresses in registers
# (128x256 with 1-element A loads spills 308 bytes on sm_90).
NARROW_TILES = (
    _Tile(128, 128, 32, 8, 4, 2, 2, 0.80, "8 warps of 64x32: half the accumulators, room for per-chunk addresses"),
    _Tile(64, 64, 32, 4, 4, 2, 4, 0.50, "tiny/skinny problems"),
)
# float32 SIMT: 128x128 (8x8 per thread) when it still gives every SM a tile, else 64x64.
F32_TILES = (
    _Tile(128, 128, 16, 8, 1, 1, 1, 1.0, "8x8 outputs per thread"),
    _Tile(64, 64, 16, 8, 1, 1, 2, 0.6, "4x4 outputs per thread, 4x the CTAs"),
)


def estimated_cost(tile: _Tile, m: int, n: int, batch: int, sm_count: int) -> float:
    """Relative time: waves x (work an SM does per wave) / efficiency.

    One wave runs ``blocks_per_sm`` CTAs per SM side by side, each ``block_m * block_n`` of C;
    a nearly empty last wave costs as much as a full one, which is what moves 1793^2 from
    128x128 to 128x256 tiles on 132 SMs.
    """
    tiles = arch_mod.matmul_tiles(m, n, tile.block_m, tile.block_n, batch=batch)
    w = arch_mod.waves(tiles, sm_count, tile.blocks_per_sm)
    return w.waves * tile.blocks_per_sm * tile.block_m * tile.block_n / tile.efficiency


def _ldsm_first_ok(block_k: int, even_k: bool) -> bool:
    """Whether the ldmatrix-before-refill order fits: the K-tail copies of the 64-deep tiles leave
    no registers for the refill behind the ldmatrix (ptxas: 4-28 bytes of spill at 255
    registers), so they refill first."""
    return even_k or block_k != 64


def _choose_tile(dtype: str, m: int, n: int, batch: int, sm_count: int, narrow: bool = False) -> _Tile:
    tiles = F32_TILES if dtype == "float32" else NARROW_TILES if narrow else TC_TILES
    # ties go to the smaller tile: less work wasted on the zero-filled border
    return min(tiles, key=lambda t: (estimated_cost(t, m, n, batch, sm_count), t.block_m * t.block_n))


def _config(tile: _Tile, dtype: str, k: int | None = None, **layout) -> MatmulConfig:
    if k is not None:
        layout = {**layout, "even_k": dtype != "float32" and k % tile.block_k == 0}
    even = layout.get("even_k", False)
    first = _ldsm_first_ok(tile.block_k, even) and layout.get("ldsm_first", True)
    if not first:
        layout = {**layout, "ldsm_first": False}
    # Spread copies need the double-buffered loop's 16-byte loads and ldmatrix-first order, and
    # a K without tail: the tail's second copy path does not fit in registers beside them
    # (ptxas sm_90: 4-12 bytes of spill for the 64-deep tiles).
    tc = dtype != "float32"
    wide = tc and layout.get("vec_a", 8) == 8 and layout.get("vec_b", 8) == 8
    opts = dict(copy_steps=tile.copy_steps if wide and first and even else 1,
                l2_prefetch=tile.l2_prefetch if tc else 0)
    return MatmulConfig(dtype=dtype, block_m=tile.block_m, block_n=tile.block_n, block_k=tile.block_k,
                        num_warps=tile.num_warps, num_stages=tile.num_stages, warps_m=tile.warps_m,
                        **{**opts, **layout})


def heuristic_config(dtype: str, m: int, n: int, k: int, batch: int = 1, *, sm_count: int | None = None,
                     arch: str | None = None, **layout) -> MatmulConfig:
    """The heuristic's config for a problem; ``layout``: a_kmajor, b_kmajor, vec_a, vec_b, has_bias, activation.

    ``arch`` does not change the choice: every heuristic tile's ring fits sm_80+ (96 KiB at most).
    """
    if sm_count is None:
        sm_count = device.sm_count() if device.has_gpu() else 132
    if dtype == "float32":
        layout = {**layout, "vec_a": 1, "vec_b": 1}
    narrow = min(layout.get("vec_a", 8), layout.get("vec_b", 8)) < 8
    tile = _choose_tile(dtype, m, n, batch, sm_count, narrow)
    return _config(tile, dtype, k, **layout)


def candidate_configs(dtype: str, k: int | None = None, **layout) -> list[MatmulConfig]:
    """Every config the autotuner considers for this dtype, layout (and K, for ``even_k``)."""
    if dtype == "float32":
        layout = {**layout, "vec_a": 1, "vec_b": 1}
        return [_config(t, dtype, k, **layout) for t in F32_TILES]
    out = []
    narrow = min(layout.get("vec_a", 8), layout.get("vec_b", 8)) < 8
    for t in NARROW_TILES if narrow else TC_TILES + TUNE_ONLY:
        try:
            out.append(_config(t, dtype, k, **layout))
        except ConfigError:
            pass   # e.g. a narrow vec that does not split this tile evenly
    return out


_bucket = tune_bucket


# ---- the op -----------------------------------------------------------------------------
def _resolve_dtype(x, view, name: str, dtype) -> str:
    if dtype is None:
        return dtype_name(x)
    from .. import dtypes
    want = dtypes.canonical(dtype, family="matmul", field="dtype", allowed=_DTYPES)
    have = dtype_name(x)
    if want == "bfloat16" and have in ("uint16", "int16", "bfloat16"):
        return want
    if have != want:
        raise ConfigError(f"matmul: {name} has dtype {have}, but dtype={want!r} was given", field=name, value=have)
    return want


def _layout(name: str, outer: str, shape, strides) -> tuple[bool, int]:
    """(k_major, leading stride) of an operand given its logical (rows, cols) extents and element
    strides: K-major when K steps by one element, else outer-major when M (for A) or N (for B)
    does; the leading stride is the other dim's (0: one row or column read for every index).

    For A the logical dims are (M, K) and outer = "M"; for B they are (K, N), passed here
    reordered as (N, K) so the second dim is always K.  A dim of extent 1 (or 0) is never
    stepped, so any stride serves it - but only such a dim: a stride 0 over an extent > 1 (a
    broadcast) is a real stride that reads one element for every index, never a unit stride.
    (Reading it as "no stride" sent ``x.expand(M, K)`` (strides (0, 0)) to the K-major loads,
    which then read K contiguous elements where there is one: issue 26.)
    """
    (d_outer, d_k), (s_outer, s_k) = shape, strides
    if d_k > 1 and s_k == 1:
        return True, s_outer if d_outer > 1 else 0
    if d_outer > 1 and s_outer == 1:
        return False, s_k if d_k > 1 else 0
    if d_k <= 1:
        return True, s_outer if d_outer > 1 else 0
    if d_outer <= 1:
        return False, s_k
    raise ConfigError(f"matmul: {name} has element strides {outer}={s_outer}, K={s_k}; one of its two matrix "
                      "dimensions must have unit stride", field=name, value=(s_outer, s_k),
                      allowed="unit inner stride")


def _reads_in_place(info) -> bool:
    """Whether both kernels read a matmul operand view as it is: one of its two matrix dims steps by
    one element (or has extent 1), no negative stride, and no overlap but broadcasts (stride 0:
    the kernels' addressing, ``row * ld + col``, reads one row or column for every index exactly;
    TMA cannot encode it, so the Hopper path stages such operands or leaves them to mma.sync).
    Anything else is staged as a compact copy; misaligned elements are rejected."""
    return info.kind in (views.CONTIGUOUS, views.UNIT, views.STRIDED) and not info.overlapping and (
        info.unit(-1) or info.unit(-2))


def _vec(ptr: int, *strides: int) -> int:
    """Widest load (elements of 2 bytes) the alignment of base and strides allows."""
    for v in (8, 4, 2):
        if ptr % (2 * v) == 0 and all(s % v == 0 for s in strides):
            return v
    return 1


def _elem_strides(view, name: str) -> tuple[int, ...]:
    out = []
    for s in view.strides:
        if s % view.itemsize:
            raise ConfigError(f"matmul: {name} has byte strides {view.strides}, not whole elements", field=name)
        out.append(s // view.itemsize)
    return tuple(out)


# ---- per-signature launch plans ---------------------------------------------------------------
# The checks, layout analysis and dispatch below cost 40-80 us of host time per call (H200 host,
# 2026-11-21; cupy.matmul: 17-26 us).  Their outcome depends only on each array's dtype, shape,
# strides, 16-byte alignment and device plus the options, so the first call with a signature
# records the launch (an OutputPlan) and later calls allocate ``out`` if needed, look up the
# tensor maps for the new addresses (Hopper kernel) and launch.
_LAUNCHES = LaunchPlans()


def _plan_key(a, b, bias, out, activation, trans_a, trans_b, dtype):
    """The LaunchPlans key.  With tuning on, the first call of a signature tunes (full path) and
    its plan records the winner's launch; tuning on and off never share a plan.  The environment
    is keyed as stored (getenv_raw: no decode per call; a value the full path reads differently,
    such as RTKERNELS_AUTOTUNE=0 against unset, only makes another plan)."""
    return _LAUNCHES.key((a, b, bias, out), (activation, bool(trans_a), bool(trans_b), dtype, USE_SM90,
                                             SM90_MMA, USE_GEMV, getenv_raw("RTKERNELS_AUTOTUNE"),
                                             getenv_raw("RTKERNELS_ARCH"), getenv_raw(SPLIT_K_ENV),
                                             getenv_raw(STREAM_K_ENV), getenv_raw(CLUSTER_K_ENV)))


def _launch(key, launch: Launch, maps, views, arrays, stream, stages=(None, None), read=None) -> None:
    """Run ``launch`` on the views and keep it as the signature's plan when no view is a copy.
    ``views``, ``arrays``: A, B, bias, C; ``maps``: see :func:`_args`.  With A and / or B staged
    (``stages``: a :class:`_Stage` or None each) ``views`` holds the copies and ``read`` the views
    they were made from: the plan (a :class:`_StagedPlan`) is kept when those read the caller's
    arrays in place and bias and C are the caller's."""
    staged = stages != (None, None)
    same = (same_memory(read, arrays[:2]) and same_memory(views[2:], arrays[2:])) if staged else \
        same_memory(views, arrays)
    if maps is not None and maps[4] is not None:   # split-K: the stream's workspace follows C
        ws = _split_workspace(maps[4], arrays[0], stream)
        views, arrays = (*views, *ws), (*arrays, *ws)
    launch.run(_args(maps, views), stream)
    if key is not None and same:
        plan = OutputPlan.of(launch, arrays[3], maps, like=arrays[0])
        _LAUNCHES.put(key, _StagedPlan(plan, stages) if staged else plan)


@dataclass
class _StagedPlan:
    """A launch plan whose operands A and / or B are staged (``stages``: a :class:`_Stage` or None
    each): a replay queues their copies from the call's operands, then replays ``main`` (the Hopper
    kernel's OutputPlan) on the copies.  Without it a staged call ran the full argument path, 170-280
    us of host time (H200, 2026-11-22) - 2.15x torch.matmul's per-call latency at 1793^3 (H100,
    2026-11-26) where the GPU work is ~65 us."""
    main: OutputPlan
    stages: tuple


class _Address:
    """A staged copy as the replays read an array: its base address (``data_ptr()`` for a torch
    plan, ``data.ptr`` for a CuPy one) - the copy itself stays alive until the launch is queued,
    and is freed with this object.  (``data`` is a property: an attribute holding ``self`` made a
    reference cycle that kept every copy until the garbage collector ran, so CuPy's pool had no
    block to reuse and allocated anew - 150-320 us per call at 1793^3, H100, 2026-11-26.)"""
    __slots__ = ("ptr", "buf")

    def __init__(self, buf):
        self.buf = buf
        self.ptr = buf.data.ptr

    @property
    def data(self):
        return self

    def data_ptr(self) -> int:
        return self.ptr


def _split_workspace(sizes, like, stream):
    """(partials, counters) of a split-K launch on ``stream``: ops/workspace.py's buffers of that
    (device, stream), of ``like``'s kind (so a plan's replays hand the launch arrays of one kind);
    ``sizes``: (partial bytes, counter bytes)."""
    dev = like.get_device() if _is_torch(like) else device.current_device()
    return stream_workspace(like, dev, stream, *sizes)


def _args(maps, arrays):
    """The kernel's array arguments for (A, B, bias, C[, partials, counters]): with ``maps`` (the
    Hopper kernel's config, A, B, C tensor maps without addresses (C None for direct stores) and
    the split-K workspace sizes or None) the three encoded maps, bias, C and the workspace; else
    the four arrays."""
    if maps is None:
        return list(arrays)
    cfg, a_map, b_map, c_map, _ = maps
    a, b, bias, c = arrays[:4]
    return [*m90.tensor_maps(cfg, (address(a), *a_map), (address(b), *b_map),
                             None if c_map is None else (address(c), *c_map)), bias, c, *arrays[4:]]


def _replay(plan, a, b, bias, out, stream, dev: int):
    """A plan's launch on the call's arrays; ``dev``: the plan key's device."""
    if type(plan) is _GemvPlan:
        return gemv.replay(plan.plan, (b, a, None, None, bias), out, stream)
    stages, plan = (plan.stages, plan.main) if type(plan) is _StagedPlan else (None, plan)
    out = plan.output(a, out)
    ops = (a, b)
    if stages is not None:   # the staging copies from the call's operands, then the kernel on them
        s = default_stream(a, stream)
        ops = tuple(v if st is None else _Address(_pad_rows(v, st, s)) for v, st in zip(ops, stages))
    arrays = (*ops, bias, out)
    if plan.extra is not None and plan.extra[4] is not None:   # split-K: this stream's workspace
        stream = default_stream(a, stream) if plan.torch else stream
        arrays += _split_workspace(plan.extra[4], a, stream)
    # the launch bound once per plan; the Hopper kernel's tensor maps converted once per address set;
    # a torch plan given no stream launches on torch's current stream on ``dev`` (one C call there)
    plan.replay(arrays, stream, None if plan.extra is None else _args, dev)
    return out


_plans: dict = {}


def matmul(a, b, *, bias=None, activation: str | None = None, out=None, trans_a: bool = False,
           trans_b: bool = False, dtype: str | tuple[str, str] | None = None, scale_a=None, scale_b=None,
           out_dtype: str | None = None, stream=None):
    """``activation(a @ b + bias)`` on the GPU, computed in float32 and stored in the input dtype
    (fp8 operands: ``activation(scale_a * scale_b * (a @ b) + bias)`` stored in ``out_dtype``).

    Parameters
    ----------
    a : (M, K) or (B, M, K) array; with ``trans_a`` its last two dims are (K, M).
    b : (K, N) or (B, K, N) array; with ``trans_b`` its last two dims are (N, K).  A 2-D
        operand is broadcast over the other's batch.
    bias : optional (N,) array of the same dtype, added before the activation.
    activation : None, "relu", "gelu" (erf form) or "silu".
    out : optional output of shape (M, N) / (B, M, N), same dtype, unit stride along N.
    trans_a, trans_b : use the transpose of the last two dims (no copy is made).
    dtype : "bfloat16" to read uint16 CuPy arrays as bfloat16 bits; "float8_e4m3fn" (or
        "float8_e4m3") / "float8_e5m2", or a pair of them (a's, b's), to read uint8 CuPy arrays
        as fp8 bits.
    scale_a, scale_b : fp8 only: float32 device arrays, per tensor (one element) or per row of
        ``a`` ((M,) or (M, 1)) / per column of ``b`` ((N,) or (1, N)); read by the kernel, never
        on the host (CUDA-graph capturable).
    out_dtype : fp8 only: "bfloat16" (default), "float16" or "float32"; ``bias`` may be any of
        the three.
    stream : CuPy stream, torch stream or raw handle (default: CuPy's current stream, or torch's
        current stream when a is a torch tensor).

    float16 / bfloat16 use tensor cores, float32 a SIMT kernel.  float8 e4m3 / e5m2 operands (torch
    float8 tensors, or uint8 arrays with ``dtype=``) run the Hopper fp8 kernel of
    :mod:`rtkernels.ops.matmul_fp8` (sm_90 only, 2-D, K a multiple of 16; a ``b`` that is not the
    transpose of a row-major (N, K) array, and an ``a`` that is not row-major, are transposed into
    a K-major copy first, as 8-bit wgmma requires).

    Views (:mod:`rtkernels.ops.views`): an operand one of whose last two dims steps by one element
    is read in place, whatever its other strides - row / column slices, transposes, a batch
    broadcast (batch stride 0) and rows or columns broadcast by ``expand`` (a row stride 0: every
    index reads one row) included; on sm_90 the TMA kernel takes those whose base and strides are
    16-byte aligned and positive, the others run the mma.sync kernel or, from 2^24 M*N*K*batch,
    are copied to aligned rows first.  Operands with no unit-stride matrix dim (``x[::2, ::2]``, a
    scalar or column ``expand``-ed over both dims such as the ``torch.ones(()).expand(M, N)`` of a
    backward), negative strides (CuPy flips) or overlapping rows (``as_strided``) are staged: a
    compact copy on the call's stream, then the same paths.  A bias that is not contiguous is
    copied too.  ``out`` must have unit stride along N, non-negative strides and no two indices
    on one element (an ``expand``-ed or overlapping output is rejected: its writes would race).
    Elements not aligned to their size are rejected.  Calls that stage A or B for the Hopper kernel
    keep a plan that repeats the staging copies (other copies keep none).
    """
    if scale_a is not None or scale_b is not None or out_dtype is not None:
        return _fp8.matmul_fp8(a, b, bias=bias, activation=activation, out=out, trans_a=trans_a, trans_b=trans_b,
                               dtype=dtype, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, stream=stream)
    plan_key = _plan_key(a, b, bias, out, activation, trans_a, trans_b, dtype)
    launch = _LAUNCHES.get(plan_key)
    if launch is not None:
        return _replay(launch, a, b, bias, out, stream, plan_key[1])
    if _fp8.wants_fp8(a, b, dtype, None, None, None):
        return _fp8.matmul_fp8(a, b, bias=bias, activation=activation, out=out, trans_a=trans_a, trans_b=trans_b,
                               dtype=dtype, stream=stream)
    if activation not in (None, *ACTIVATIONS):
        raise ConfigError.bad_value("matmul", "activation", activation, "None, 'relu', 'gelu' or 'silu'")
    act = activation or "none"
    stream = default_stream(a, stream)
    av, bv = as_device_array(a, "matmul", "a"), as_device_array(b, "matmul", "b")
    da, db = _resolve_dtype(a, av, "a", dtype), _resolve_dtype(b, bv, "b", dtype)
    if da != db:
        raise ConfigError(f"matmul: a is {da} and b is {db}; both operands must have the same dtype "
                          f"({', '.join(_DTYPES)})", field="dtype", value=(da, db))
    if da not in _DTYPES:
        raise ConfigError.bad_value("matmul", "dtype", da, "one of " + ", ".join(_DTYPES))
    for name, v in (("a", av), ("b", bv)):
        if v.ndim not in (2, 3):
            raise ConfigError(f"matmul: {name} has shape {v.shape}; expected 2-D (rows, cols) or 3-D "
                              "(batch, rows, cols)", field=name, value=v.shape)
    if trans_a:
        av = av.swapaxes(-1, -2)
    if trans_b:
        bv = bv.swapaxes(-1, -2)
    m, k = av.shape[-2:]
    k2, n = bv.shape[-2:]
    if k != k2:
        raise ConfigError(f"matmul: a is {m} x {k}{' (after trans_a)' if trans_a else ''} and b is {k2} x {n}"
                          f"{' (after trans_b)' if trans_b else ''}; a.shape[-1] must equal b.shape[-2]",
                          field="shape", value=(av.shape, bv.shape))
    ba = av.shape[0] if av.ndim == 3 else None
    bb = bv.shape[0] if bv.ndim == 3 else None
    if ba is not None and bb is not None and ba != bb and 1 not in (ba, bb):
        raise ConfigError(f"matmul: batch sizes differ (a: {ba}, b: {bb}); they must be equal or one must be 1",
                          field="shape", value=(av.shape, bv.shape))
    batch = max(ba or 1, bb or 1)
    # Operands one of whose matrix dims steps by one element are read in place (any other stride,
    # broadcasts included); negative, overlapping and unit-less views as a compact copy.
    av, _ = views.read_view("matmul", "a", av, stream, _reads_in_place)
    bv, _ = views.read_view("matmul", "b", bv, stream, _reads_in_place)
    sa, sb = _elem_strides(av, "a"), _elem_strides(bv, "b")
    a_kmajor, lda = _layout("a" + (" (after trans_a)" if trans_a else ""), "M", (m, k), sa[-2:])
    b_kmajor, ldb = _layout("b" + (" (after trans_b)" if trans_b else ""), "N", (n, k), (sb[-1], sb[-2]))
    batch_a = sa[0] if av.ndim == 3 and av.shape[0] > 1 else 0
    batch_b = sb[0] if bv.ndim == 3 and bv.shape[0] > 1 else 0
    out_shape = (batch, m, n) if (ba is not None or bb is not None) else (m, n)

    if out is None:
        out = new_like(a, out_shape, da)
        cv = as_device_array(out, "matmul", "out")
    else:
        cv = as_device_array(out, "matmul", "out")
        dc = _resolve_dtype(out, cv, "out", dtype)
        if dc != da or cv.shape != out_shape:
            raise ConfigError(f"matmul: out is {dc} {cv.shape}; expected {da} {out_shape}", field="out",
                              value=(dc, cv.shape))
    out_info = views.of(cv)
    accepted = "pass an output with unit stride along N, non-negative strides and rows that do not overlap"
    views.check_output("matmul", "out", out_info, accepted)
    sc = _elem_strides(cv, "out")
    if out_info.kind != views.EMPTY and ((n > 1 and sc[-1] != 1) or out_info.kind == views.NEGATIVE):
        raise views.reject("matmul", "out", out_info, "cannot be written by rows", accepted)
    ldc = sc[-2] if m > 1 else 0
    batch_c = sc[0] if cv.ndim == 3 and batch > 1 else 0

    if bias is not None:
        biv = as_device_array(bias, "matmul", "bias")
        dbias = _resolve_dtype(bias, biv, "bias", dtype)
        if dbias != da or biv.shape != (n,):
            raise ConfigError(f"matmul: bias must be a {da} array of shape ({n},), got {dbias} {biv.shape}",
                              field="bias", value=(dbias, biv.shape))
        # the epilogue reads bias[col]: any other view (expanded, strided) is copied, n elements
        biv, _ = views.read_view("matmul", "bias", biv, stream, lambda i: i.kind == views.CONTIGUOUS)
    else:
        biv = None

    if m == 0 or n == 0 or batch == 0:
        return out
    tiles_limit = 2 ** 31 - 1
    if batch > 65535:
        raise ConfigError(f"matmul: batch={batch} is more than the 65535 the grid's z dimension holds",
                          field="batch", value=batch, allowed="<= 65535")
    if max(m, n, k) >= 2 ** 31:
        raise ConfigError(f"matmul: M, N, K = {m}, {n}, {k}; each must be < 2^31", field="shape")

    gv = _plan_gemv(da, m, n, k, batch, int(av.data.ptr), int(bv.data.ptr), a_kmajor, b_kmajor, lda, ldb, ldc,
                    batch_a, batch_b, batch_c, biv is not None, act)
    if gv is not None:
        cfg, ints = gv
        plan = gemv.launch(cfg, ints, (bv, av, None, None, biv, cv), (b, a, None, None, bias, out), stream)
        if plan is not None:
            _LAUNCHES.put(plan_key, _GemvPlan(plan))
        return out

    if da != "float32" and k > 0 and USE_SM90 and device.current_arch() == "sm_90":
        work = m * n * k * batch
        stages, read = (None, None), None
        realign = realign_pays(m, n, k, batch)
        if work >= STAGE_MIN_WORK or realign:
            read = (av, bv)   # the operands as read in place (or compact copies: then no plan)
            bt = bv.swapaxes(-1, -2)
            av, lda, batch_a, st_a = _tma_operand(av, a_kmajor, lda, batch_a, work, realign, stream, a)
            bt2, ldb, batch_b, st_b = _tma_operand(bt, b_kmajor, ldb, batch_b, work, realign, stream, b)
            bv = bv if bt2 is bt else bt2.swapaxes(-1, -2)
            stages = (st_a, st_b)
        done = _plan_sm90(da, m, n, k, batch, av, bv, biv, cv, a_kmajor, b_kmajor, lda, ldb, ldc, batch_a, batch_b,
                          batch_c, act, stream)
        if done is not None:
            _launch(plan_key, *done, (av, bv, biv, cv), (a, b, bias, out), stream, stages, read)
            return out

    if da == "float32":
        vec_a = vec_b = 1
    else:
        vec_a = _vec(av.data.ptr, lda, batch_a)
        vec_b = _vec(bv.data.ptr, ldb, batch_b)
    # 16-byte stores of C chunks need a 16-byte aligned base and row/batch strides in whole chunks
    c_vec = 8 if (da != "float32" and cv.data.ptr % 16 == 0 and ldc % 8 == 0 and batch_c % 8 == 0) else 1
    layout = dict(a_kmajor=a_kmajor, b_kmajor=b_kmajor, vec_a=vec_a, vec_b=vec_b, has_bias=biv is not None,
                  activation=act)
    # A row that ends inside a vec chunk (its extent not a multiple of vec: a padded stride, a single
    # row) has that chunk loaded element by element; named only when set, so that other calls keep
    # their autotuning keys.
    layout.update({e: True for e, vec, extent in (("edge_a", vec_a, k if a_kmajor else m),
                                                  ("edge_b", vec_b, k if b_kmajor else n)) if extent % vec})
    dev = device.current_device()
    memo_key = (da, m, n, k, batch, tuple(layout.items()), dev, autotune.enabled())
    plan = _plans.get(memo_key)
    if plan is None:
        cfg = heuristic_config(da, m, n, k, batch, sm_count=device.sm_count(), **layout)
        if autotune.enabled():
            cfg = _tuned(cfg, da, m, n, k, batch, layout, av, bv, biv, cv,
                         (lda, ldb, ldc, batch_a, batch_b, batch_c, c_vec), stream)
            # a winner stored for this K bucket may come from a K of other parity: even_k must
            # describe this K, or the kernel would read past it
            even = da != "float32" and k % cfg.block_k == 0
            if cfg.even_k != even:
                # (and the 64-deep tiles' K-tail path refills first, with neither main-loop
                # option, as _config sets it)
                first = cfg.ldsm_first and _ldsm_first_ok(cfg.block_k, even)
                cfg = dataclasses.replace(cfg, even_k=even, ldsm_first=first,
                                          copy_steps=cfg.copy_steps if even and first else 1)
        kern = get_kernel(cfg)
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        if tiles > tiles_limit:
            raise ConfigError(f"matmul: {tiles} tiles exceed the grid limit", field="shape")
        plan = _plans[memo_key] = (kern, (tiles, 1, batch), (cfg.threads_per_block, 1, 1), cfg.shared_mem_bytes)
    kern, grid, block, smem = plan
    _launch(plan_key, Launch(kern, grid, block, smem, (m, n, k, lda, ldb, ldc, batch_a, batch_b, batch_c, c_vec)),
            None, (av, bv, biv, cv), (a, b, bias, out), stream)
    return out


def matmul_positional(a, b, bias, activation, trans_a, trans_b):
    """:func:`matmul` with its options positional and no ``out``, ``dtype`` or stream: the CUDA
    kernel of ``torch.ops.rtk.matmul`` (whose schema has exactly these arguments).  A plan hit
    replays here, without the keyword call into :func:`matmul` and its fp8 test (~0.3 us of the
    custom op's 1.2 us of Python over the direct call, development CPU, 2026-11-26); anything else
    is :func:`matmul` itself."""
    plan_key = _plan_key(a, b, bias, None, activation, trans_a, trans_b, None)
    plan = _LAUNCHES.get(plan_key)
    if plan is not None:
        return _replay(plan, a, b, bias, None, None, plan_key[1])
    return matmul(a, b, bias=bias, activation=activation, trans_a=trans_a, trans_b=trans_b)


# ---- M <= 16: the GEMV route ---------------------------------------------------------------------
@dataclass(frozen=True)
class _GemvPlan:
    """A launch plan of the GEMV route (``gemv.launch``'s; its arrays are (b, a, -, -, bias, out))."""
    plan: object


def _rows(m: int, ld: int, batch: int, batch_stride: int) -> int | None:
    """The one row stride that reaches all ``batch`` x ``m`` rows of an operand (row i of batch j
    at j * batch_stride + i * ld), or None when there is none."""
    if batch == 1:
        return ld if m > 1 else 0
    if m == 1:
        return batch_stride
    return ld if batch_stride == m * ld else None


def _plan_gemv(dtype, m, n, k, batch, a_ptr, b_ptr, a_kmajor, b_kmajor, lda, ldb, ldc, batch_a, batch_b, batch_c,
               has_bias, act, sm_count=None):
    """(config, scalars) of the GEMV kernel (ops/gemv.py) for C with at most 16 rows, the batch
    folded in, when it reads the operands in place; None leaves the call to the tile kernels.

    Decode-time GEMMs (a few rows of A against a weight B) are bound by reading B once: the tile
    kernels' 128-row tiles give N = 4096 16 CTAs on 132 SMs, the GEMV every SM a share of B's
    bytes.  B is the weight (rows of K: K-major, ``w.T`` of an nn.Linear weight; rows of N:
    N-major, a row-major (K, N) array), any strides with one unit-stride dim, one B for the whole
    batch; A's rows (and C's) must be one stride apart each, with K contiguous in A.  Those that
    are not (A column-major with M > 1, A batches not one stride apart, a batched B) go to the tile
    kernels.
    """
    rows = m * batch
    if not USE_GEMV or dtype == "float32" or k == 0 or rows > gemv.GEMV_MAX_ROWS or batch_b:
        return None
    if not a_kmajor and k > 1:
        return None
    ldx, ldo = _rows(m, lda, batch, batch_a), _rows(m, ldc, batch, batch_c)
    if ldx is None or ldo is None:
        return None
    n_major = not b_kmajor
    # 16-byte weight loads need the weight's rows (K-major: K elements; N-major: N), their stride
    # and base in whole 16 bytes; else the widest that divides all three (bytes)
    w_vec = gemv.vec_width(2 * (n if n_major else k), b_ptr, 2 * ldb if (k if n_major else n) > 1 else None, 1, 16)
    x_vec = gemv.vec_width(k, a_ptr, ldx if rows > 1 else None, 2, 8)
    cfg = gemv.heuristic_config(dtype, rows, n, k, weight_dtype=dtype, has_bias=has_bias, activation=act,
                                n_major=n_major, w_vec=w_vec, x_vec=x_vec, sm_count=sm_count)
    return cfg, (rows, n, k, ldb, ldx, ldo, 0)


# Operands TMA cannot address (a row stride or base that is not 16-byte aligned: K = 1793, a view
# starting one column in) are copied into buffers with 128-byte aligned rows when the problem is at
# least this big (M N K batch), so the Hopper kernel runs instead of the mma.sync kernel's narrow
# loads.  bf16 1793^3 on an H200: 51 TFLOP/s through the narrow loads (cuBLAS 103), see
# docs/RESULTS.md for the staged path.  Below it, the copies' launches cost more than they save.
STAGE_MIN_WORK = 1 << 24
# Operands TMA can address but whose rows are not 32-byte aligned (one 32-byte sector) load slowly:
# fp16 3000^3 runs at 335 TFLOP/s on such rows and 584 on the same values in 128-byte rows (H200,
# 2026-11-22); bf16 x @ W.T (H100, 2026-11-27, rtk / cuBLAS in the same rounds) 1500x6000x1496 0.54x
# against 0.91x at K = 1536, 3000x5000x1000 0.67x against 0.90x at K = 1024 (rows 32-byte but not
# 128-byte aligned cost much less: 3000x5000x2000 0.88x, 0.93x at K = 2048).  The copy moves 4 bytes
# per operand element (read + write) and the slow rows cost the kernel up to 40% of its time, so the
# copies pay where 0.4 * 2 M N K / R > 4 (M + N) K / BW: M N / (M + N) > 2 R / (0.4 BW) ~ 1100 with
# R ~ 650 TFLOP/s, BW ~ 3 TB/s (H100), whatever K and the batch.  Measured with the copies (same
# run): 1500x6000x1496 0.54 -> 0.64x, 3000x5000x1000 0.67 -> 0.77x, 4096x4096x1000 0.65 -> 0.78x,
# 2600^3 0.64 -> 0.72x, 16384x4096x200 0.73 -> 0.80x; but 2048x4096x200 0.87 -> 0.63x, where the two
# copy launches' fixed cost outweighs a 15 us kernel: hence also M N K >= REALIGN_MIN_WORK.  At 2040^3
# (M N / (M + N) = 1020) the copies cost more than they save (H200, 2026-11-22).  The old rule
# (M N K >= 2^34 alone) left 1500x6000x1496 and 3000x5000x1000 on the slow rows.
REALIGN_MIN_MN = 1024
REALIGN_MIN_WORK = 1 << 33


def rows_on_128b_grid(ptr: int, ld: int, batch_stride: int = 0) -> bool:
    """Whether every row of a 16-bit operand (base ``ptr``, row and batch strides in elements) starts
    on a 128-byte boundary (matmul_sm90's rule 5 reads it for A and B)."""
    return ptr % 128 == 0 and ld % 64 == 0 and batch_stride % 64 == 0


def realign_pays(m: int, n: int, k: int, batch: int = 1) -> bool:
    """Whether operands with rows off the 32-byte sector grid are worth copying into 128-byte rows
    (see REALIGN_MIN_MN)."""
    return m * n >= REALIGN_MIN_MN * (m + n) and m * n * k * batch >= REALIGN_MIN_WORK


@register_family
@dataclass(frozen=True)
class PadRowsConfig(KernelConfig):
    """The staging copy of a 16-bit (batch, rows, cols) operand with any even-byte base and strides
    into 128-byte aligned rows (templates/pad_rows.cu.j2): ``chunks_per_thread`` 16-byte chunks of
    a row per thread, ``block_size`` threads per block."""

    family: ClassVar[str] = "pad_rows"
    template: ClassVar[str] = "pad_rows.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("pad_rows",)
    expected_global_width: ClassVar[int | None] = 128
    block_size: int = 128
    chunks_per_thread: int = 4

    def __post_init__(self):
        self._check_int("block_size", 32, 1024, power_of_two=True)
        self._check_int("chunks_per_thread", 1, 16)

    @property
    def threads_per_block(self) -> int:
        return self.block_size


# block 128, 4 chunks per thread: 3.9 TB/s (read + write) for 8191 x 8191 bf16 rows on an H200
# (2026-11-22); cudaMemcpy2DAsync: 1.6 TB/s
_PAD = PadRowsConfig()


@dataclass(frozen=True)
class _Stage:
    """How an operand is staged (:func:`_pad_rows`): ``nb`` x ``rows`` x ``cols`` 16-bit elements
    read at row stride ``ld`` and batch stride ``batch_stride`` from the operand's base, into rows
    ``ldp`` apart of a new buffer of CuPy dtype ``dtype``."""
    rows: int
    cols: int
    nb: int
    ld: int
    batch_stride: int
    dtype: object

    @property
    def ldp(self) -> int:
        return -(-self.cols // 64) * 64


def _pad_rows(src, st: _Stage, stream, like=None):
    """The staging copy of ``st`` from ``src`` (an array whose base address is the operand's) into
    a new (nb, rows, ldp) CuPy buffer with rows 128 bytes apart, queued on ``stream``.  While the
    stream is captured into a CUDA graph the buffer is made by ``like``'s library (the caller's
    operand: torch or CuPy) and kept (ops/workspace.py, :func:`captured_buffer`)."""
    import cupy
    cs = cupy_stream(stream)
    shape = (st.nb, st.rows, st.ldp)
    nbytes = st.nb * st.rows * st.ldp * 2
    kept = captured_buffer(src if like is None else like, nbytes, cs)
    if kept is not None:
        # a CuPy view by address (DLPack's stream handshake would make the legacy stream wait on
        # the capturing one: cudaErrorStreamCaptureImplicit)
        mem = cupy.cuda.UnownedMemory(address(kept), nbytes, kept)
        buf = cupy.ndarray(shape, st.dtype, cupy.cuda.MemoryPointer(mem, 0))
    else:
        with cs:   # CuPy's pool reuses a block only on the stream it was allocated on: after our reads
            buf = cupy.empty(shape, dtype=st.dtype)
    per_row = -(-st.cols // (8 * _PAD.block_size * _PAD.chunks_per_thread))
    get_kernel(_PAD).launch((st.nb * st.rows * per_row,), (_PAD.block_size,), src, buf, st.rows, st.cols, st.ld,
                            st.batch_stride, st.ldp // 8, per_row, stream=cs)
    return buf


def _tma_operand(v, kmajor: bool, ld: int, batch_stride: int, work: int, realign: bool, stream, like=None):
    """Operand ``v`` ((.., outer, K) as the kernel sees it: A, or B transposed) as (array, ld,
    batch stride, stage) for the TMA kernel: ``v`` itself (stage None), or a copy with 128-byte
    aligned rows (:func:`_pad_rows`, ``stage`` how) when TMA cannot address ``v`` and ``work`` >=
    STAGE_MIN_WORK, or when its rows are not 32-byte aligned and ``realign`` (:func:`realign_pays`).
    ``like``: the caller's operand (see :func:`_pad_rows`)."""
    stored = v if kmajor else v.swapaxes(-1, -2)          # (.., rows, cols), cols contiguous
    nb = stored.shape[0] if stored.ndim == 3 and batch_stride else 1
    rows, cols = stored.shape[-2:]
    ptr = int(v.data.ptr)
    if m90.operand_maps(ptr, rows, cols, ld, nb, batch_stride) is not None:
        sector = ptr % 32 == 0 and (rows == 1 or ld % 16 == 0) and (nb == 1 or batch_stride % 16 == 0)
        if sector or not realign:
            return v, ld, batch_stride, None
    elif work < STAGE_MIN_WORK:
        return v, ld, batch_stride, None
    st = _Stage(rows, cols, nb, ld if rows > 1 else 0, batch_stride, stored.dtype)
    buf = _pad_rows(stored, st, stream, like)
    view = buf[:, :, :cols] if nb > 1 else buf[0, :, :cols]
    return (view if kmajor else view.swapaxes(-1, -2)), st.ldp, (rows * st.ldp if nb > 1 else 0), st


_plans90: dict = {}


def _plan_sm90(dtype, m, n, k, batch, av, bv, biv, cv, a_kmajor, b_kmajor, lda, ldb, ldc, batch_a, batch_b,
               batch_c, act, stream):
    """The Hopper kernel's launch (ops/matmul_sm90.py) if TMA can address A and B: (:class:`Launch`,
    (config, A, B, C tensor maps without addresses)); None otherwise.  ``stream``: where a tuning
    call (RTKERNELS_AUTOTUNE=1) times its candidates.

    A batch stride of 0 (a 2-D operand broadcast over the batch) becomes a batch extent of 1
    that the kernel does not index.  C goes through a TMA store when it is 16-byte addressable,
    else through direct stores.
    """
    a_rows, a_cols = (m, k) if a_kmajor else (k, m)
    b_rows, b_cols = (n, k) if b_kmajor else (k, n)
    a_map = m90.operand_maps(av.data.ptr, a_rows, a_cols, lda, batch if batch_a else 1, batch_a)
    b_map = m90.operand_maps(bv.data.ptr, b_rows, b_cols, ldb, batch if batch_b else 1, batch_b)
    if a_map is None or b_map is None:
        return None
    c_map = m90.operand_maps(cv.data.ptr, m, n, ldc, batch if batch_c else 1, batch_c)
    tma_store = c_map is not None and SM90_MMA == "wgmma"
    dev = device.current_device()
    forced = _forced_split_k()
    stream_k = _forced_stream_k()
    cluster_k = _forced_cluster_k()
    if forced is not None and stream_k:
        raise ConfigError(f"matmul: {SPLIT_K_ENV}={forced} with {STREAM_K_ENV}=1; set at most one of them",
                          field=STREAM_K_ENV, value="1", allowed=f"0 or unset while {SPLIT_K_ENV} is set")
    if cluster_k is not None and cluster_k > 1 and (forced is not None or stream_k):
        raise ConfigError(f"matmul: {CLUSTER_K_ENV}={cluster_k} with {SPLIT_K_ENV} or {STREAM_K_ENV}=1; set at "
                          "most one of them", field=CLUSTER_K_ENV, value=str(cluster_k),
                          allowed=f"1 or unset while {SPLIT_K_ENV} or {STREAM_K_ENV}=1 is set")
    # rows of A and B on the 128-byte grid (the heuristic's rule 5 reads it)
    rows_128b = rows_on_128b_grid(int(av.data.ptr), lda, batch_a) and rows_on_128b_grid(int(bv.data.ptr), ldb, batch_b)
    key = (dtype, m, n, k, batch, a_kmajor, b_kmajor, biv is not None, act, tma_store, SM90_MMA, dev,
           autotune.enabled(), forced, stream_k, cluster_k, rows_128b)
    plan = _plans90.get(key)
    if plan is None:
        layout = dict(a_kmajor=a_kmajor, b_kmajor=b_kmajor, has_bias=biv is not None, activation=act,
                      tma_store=tma_store, mma=SM90_MMA)
        sms = device.sm_count()
        cfg = m90.heuristic_config(dtype, m, n, k, batch, sm_count=sms, stream_k=stream_k is not False,
                                   rows_128b=rows_128b, **layout)
        if -(-m // cfg.block_m) * -(-n // cfg.block_n) * batch > 2 ** 31 - 1:   # the kernel counts tiles in int
            return None
        if (forced is not None or stream_k) and SM90_MMA == "wgmma":
            cfg = m90.with_cluster_k(cfg, 1)   # a forced schedule replaces the heuristic's cluster-K
        if forced is not None and SM90_MMA == "wgmma":
            cfg = dataclasses.replace(cfg, split_k=min(forced, m90.k_blocks(k)), stream_k=False)
        if stream_k and SM90_MMA == "wgmma":
            cfg = dataclasses.replace(cfg, split_k=1, stream_k=True)
        if cluster_k is not None and cluster_k > 1 and SM90_MMA == "wgmma":
            cfg = m90.with_cluster_k(cfg, cluster_k)
        if autotune.enabled():
            cfg = _tuned_sm90(cfg, dtype, m, n, k, batch, layout, av, bv, biv, cv, a_map, b_map, c_map, ldc,
                              batch_c, stream)
        # ... and work units (tiles x splits)
        if arch_mod.matmul_tiles(m, n, cfg.block_m, cfg.block_n, batch=batch, split_k=cfg.split_k) > 2 ** 31 - 1:
            return None
        # stream-K counts its phase's k-blocks (< 2 x grid x k-blocks) in int
        if cfg.stream_k and 2 * sms * m90.k_blocks(k) > 2 ** 31 - 1:
            cfg = dataclasses.replace(cfg, stream_k=False)
        # a split kernel takes the workspace arguments even where K leaves one split (then null)
        grid = m90.grid_size(m, n, batch, cfg, sms, k)
        split = None
        if cfg.split_k > 1 or cfg.stream_k:
            split = (m90.workspace_bytes(cfg, m, n, k, batch, grid), m90.counter_bytes(cfg, m, n, batch, grid))
        lanes = m90.tail_args(cfg, m, sms)   # stream-K's lanes (matmul_sm90.stream_k_lanes)
        plan = _plans90[key] = (get_kernel(cfg), cfg, grid, split, lanes)
    kern, cfg, grid, split, lanes = plan
    c_aligned = int(cv.data.ptr % 4 == 0 and ldc % 2 == 0 and batch_c % 2 == 0)
    scalars = (m, n, k, batch, int(batch_a != 0), int(batch_b != 0), ldc, batch_c, c_aligned, *lanes)
    return (Launch(kern, (grid, 1, 1), (cfg.threads_per_block, 1, 1), cfg.shared_mem_bytes, scalars),
            (cfg, a_map, b_map, c_map if tma_store else None, split))


def _forced_split_k() -> int | None:
    """RTKERNELS_MATMUL_SPLIT_K as an int (None when unset)."""
    v = getenv(SPLIT_K_ENV)
    if v is None or v == "":
        return None
    try:
        s = int(v)
    except ValueError:
        s = 0
    if not 1 <= s <= m90.MAX_SPLIT_K:
        raise ConfigError(f"matmul: {SPLIT_K_ENV}={v!r}; expected an integer in [1, {m90.MAX_SPLIT_K}]",
                          field=SPLIT_K_ENV, value=v, allowed=f"1..{m90.MAX_SPLIT_K}")
    return s


def _forced_cluster_k() -> int | None:
    """RTKERNELS_MATMUL_CLUSTER_K as an int (None when unset)."""
    v = getenv(CLUSTER_K_ENV)
    if v is None or v == "":
        return None
    if v not in tuple(map(str, m90.CLUSTER_KS)):
        allowed = " or ".join(map(str, m90.CLUSTER_KS))
        raise ConfigError(f"matmul: {CLUSTER_K_ENV}={v!r}; expected {allowed}", field=CLUSTER_K_ENV, value=v,
                          allowed=allowed)
    return int(v)


def _forced_stream_k() -> bool | None:
    """RTKERNELS_MATMUL_STREAM_K as True (1) / False (0), None when unset."""
    v = getenv(STREAM_K_ENV)
    if v is None or v == "":
        return None
    if v not in ("0", "1"):
        raise ConfigError(f"matmul: {STREAM_K_ENV}={v!r}; expected 0 or 1", field=STREAM_K_ENV, value=v,
                          allowed="0 or 1")
    return v == "1"


def _tuned_sm90(default, dtype, m, n, k, batch, layout, av, bv, biv, cv, a_map, b_map, c_map, ldc, batch_c,
                stream):
    key = {"dtype": dtype, "m": _bucket(m), "n": _bucket(n), "k": _bucket(k), "batch": _bucket(batch), **layout}
    scratch = autotune._clone(cv, autotune._span(cv))
    sets = autotune.rotated_copies([av, bv])
    counter = [0]
    sms = device.sm_count()
    c_aligned = int(scratch.data.ptr % 4 == 0 and ldc % 2 == 0 and batch_c % 2 == 0)

    def run(cfg):
        a_, b_ = sets[counter[0] % len(sets)]
        counter[0] += 1
        ma, mb, mc = m90.tensor_maps(cfg, (a_.data.ptr, *a_map), (b_.data.ptr, *b_map),
                                     (scratch.data.ptr, *c_map) if cfg.tma_store else None)
        ws = ()
        grid = m90.grid_size(m, n, batch, cfg, sms, k)
        if cfg.split_k > 1 or cfg.stream_k:
            ws = _split_workspace((m90.workspace_bytes(cfg, m, n, k, batch, grid),
                                   m90.counter_bytes(cfg, m, n, batch, grid)), scratch, stream)
        lanes = m90.tail_args(cfg, m, sms)
        get_kernel(cfg).launch((grid, 1, 1), (cfg.threads_per_block, 1, 1), ma,
                               mb, mc, biv, scratch, *ws, m, n, k, batch, int(a_map[0][0] > 1), int(b_map[0][0] > 1),
                               ldc, batch_c, c_aligned, *lanes, shared_mem=cfg.shared_mem_bytes, stream=stream)

    cands = m90.candidate_configs(dtype, **layout) + m90.split_candidates(dtype, m, n, k, batch, sms, **layout)
    return autotune.pick("matmul_sm90", key, cands, run, default)


def _tuned(default, dtype, m, n, k, batch, layout, av, bv, biv, cv, ints, stream):
    lda, ldb, ldc, batch_a, batch_b, batch_c, c_vec = ints
    key = {"dtype": dtype, "m": _bucket(m), "n": _bucket(n), "k": _bucket(k), "batch": _bucket(batch), **layout}
    scratch = autotune._clone(cv, autotune._span(cv))   # same strides as out, which stays untouched
    sets = autotune.rotated_copies([av, bv])
    counter = [0]

    def run(cfg):
        a_, b_ = sets[counter[0] % len(sets)]
        counter[0] += 1
        kern = get_kernel(cfg)
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        kern.launch((tiles, 1, batch), (cfg.threads_per_block, 1, 1), a_, b_, biv, scratch, m, n, k, lda, ldb,
                    ldc, batch_a, batch_b, batch_c, c_vec, shared_mem=cfg.shared_mem_bytes, stream=stream)

    return autotune.pick("matmul", key, candidate_configs(dtype, k, **layout), run, default)


# ---- reference ----------------------------------------------------------------------------
_act_np = activation_reference


def matmul_reference(a: np.ndarray, b: np.ndarray, *, bias: np.ndarray | None = None, activation: str | None = None,
                     trans_a: bool = False, trans_b: bool = False) -> np.ndarray:
    """float64 NumPy reference of :func:`matmul` (host arrays of any float dtype)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if trans_a:
        a = np.swapaxes(a, -1, -2)
    if trans_b:
        b = np.swapaxes(b, -1, -2)
    c = np.matmul(a, b)
    if bias is not None:
        c = c + np.asarray(bias, dtype=np.float64)
    return _act_np(c, activation)
