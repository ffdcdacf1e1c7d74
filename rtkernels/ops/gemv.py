"""The GEMV family (templates/quant_gemv.cu.j2): few rows of x (M <= 16) against a weight read once.

Two ops run it: :func:`rtkernels.quantized_matmul` (int8 / uint8 / float8 e4m3 weights, dequantized
in registers) and :func:`rtkernels.matmul` for M <= 16 rows (float16 / bfloat16 weights in x's
dtype, K-major as ``w.T`` of an nn.Linear weight or N-major as a row-major (K, N) ``b``; see
``matmul._plan_gemv``).  This module holds what both share: the config, its heuristic, the
candidate tilings of the benchmark's sweep, the load widths, and the launch (one kernel, split-K
included; x_half's conversion before it) with its launch plan.  It imports no op, so both ops import it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .. import device
from ..arch import arch_number
from ..config import KernelConfig, register_family
from ..errors import ConfigError
from ..kernel import get_kernel
from ._arrays import Launch, OutputPlan, _is_torch, default_stream, remember, same_memory
from .matmul_sm90 import ACTIVATIONS
from .workspace import carve, stream_workspace

WEIGHT_DTYPES = ("int8", "uint8", "float8_e4m3")   # quantized weights
DENSE_DTYPES = ("float16", "bfloat16")             # unquantized weights: x's dtype
SCALE_DTYPES = ("float32", "float16", "bfloat16")
GEMV_MAX_ROWS = 16          # rows of x the GEMV kernel takes (two m16n8k16 column tiles)
GROUP_MULTIPLE = 64         # group scales apply per 64-element block of K (4 lanes x 16 bytes)
# Shared memory for the cross-warp sums: up to 64 KiB lets two CTAs share an SM on sm_80+ (the
# N-major dense tiling with two m tiles and 8 warps along K needs 56 KiB)
_SMEM_LIMIT = 64 * 1024
# staged / cluster configs (sm_90): the 228 KiB of an SM's shared memory over ctas_per_sm CTAs, less
# the 1 KiB the hardware reserves per CTA, at most the 227 KiB one CTA may opt into
_SM90_SMEM_PER_SM = 228 * 1024
_SM90_SMEM_MAX = 227 * 1024
CLUSTER_MAX = 8   # portable cluster size: split_k with cluster=True


def register_estimate(row_tiles: int, unroll: int, m_tiles: int, group: bool, zeros: bool, *, dense: bool = False,
                      n_major: bool = False, staged: bool = False) -> int:
    """Registers the quant_gemv kernel needs per thread at least, from its arrays: the slots'
    weights (4 per 16-byte load: 2 loads per row tile and slot, N-major 1), their group scales /
    zero points (2 per row tile and slot each), x of the current and the next item (2 x the x
    elements a lane reads per item / 2, per m tile: 16 for 8-bit weights, 8 dense K-major, 4
    N-major), the accumulators (4 per row tile and m tile; twice with group scales: the block's own
    sum), plus about 40 for addresses, loop state and the dequantization temporaries.  A floor that
    rejects configs bound to spill: ptxas (NVRTC 13.5, sm_90) gave the heuristic's configs 100-128
    registers under a cap of 128 (this estimate: 88-112), and none of them spills under 112
    (tests/test_quant_matmul.py, HEADROOM; the dense modes: tests/test_gemv.py).  ``staged``: the
    slots live in shared memory, so the weights of one slot only (scales and zero points stay per
    slot).  N-major: see below."""
    if n_major:
        # Dense N-major: 16 weight registers per slot (one slot staged), x and accumulators as
        # above, and 28 for the rest: a slot's k-row addresses are computed when it is issued (not
        # held per slot, as this estimate assumed until session 9) and nothing is dequantized.
        # Against the least cap ptxas fits without a spill (NVRTC 13.5, sm_90a, 16 warps, cluster
        # split, bf16 and fp16 with bias + silu): unroll 4, one m tile 105..112 (this: 112);
        # unroll 2, two m tiles 113..120 (100); unroll 2, one m tile and unroll 1, two m tiles
        # <= 88 (80, 84).  Unroll 4 with two m tiles (132) stays rejected.
        return (1 if staged else unroll) * 4 * row_tiles + 4 * m_tiles + 4 * row_tiles * m_tiles + 28
    weights = 4 * 2 * row_tiles
    side = (2 * row_tiles if group else 0) + (2 * row_tiles if zeros else 0)
    slots = weights + unroll * side if staged else unroll * (weights + side)
    acc = 4 * row_tiles * m_tiles * (2 if group else 1)
    x_elems = 8 if dense else 16
    return slots + x_elems * m_tiles + acc + 40


@register_family
@dataclass(frozen=True)
class QuantGemvConfig(KernelConfig):
    """One GEMV specialization (templates/quant_gemv.cu.j2; its header explains the layout).

    ``dtype``: x, bias and out; ``weight_dtype``: int8, uint8 or float8_e4m3, or ``dtype`` itself
    for an unquantized (dense) weight (no scales); ``n_major``: a dense weight stored N-major (a
    row-major (K, N) ``b``: each lane reads 8 n of 4 k rows, a warp 64 weight rows, so
    ``row_tiles`` is 4); else K-major (rows of K, as nn.Linear stores it); ``scale_dtype``;
    ``group_size``: 0 for one scale per row, else a multiple of 64; ``has_zeros``: integer weights
    with zero points.  Tiling: a warp owns ``row_tiles`` * 16 weight rows of a tile and a slice of
    K, and keeps ``unroll`` items (K blocks of 64 bytes per row: 64 elements of 8-bit weights, 32 of
    dense ones, 2 * row_tiles 16-byte loads per lane; N-major 16 k, 4 loads) in flight,
    refilling a block's registers as soon as it is consumed; a CTA has ``num_warps`` warps,
    ``warps_k`` of them along K (partials summed in shared memory once per tile) and the rest along
    N; ``split_k`` CTAs along K (float32 partials that the last split of a tile to arrive adds in
    split order, in the same launch).
    ``ctas_per_sm``: CTAs sharing an SM (the register cap 65536 / (threads * ctas_per_sm), or
    ``max_registers`` when given); ``persistent``: launch at most SMs * ctas_per_sm CTAs that walk
    the N tiles (so loads run on across tile ends) instead of one CTA per tile.  ``m_tiles``: 1 for
    up to 8 rows of x, 2 for up to 16.  ``w_vec`` bytes per weight load and ``x_vec`` elements per
    x load, lowered by the host when K, a stride or a base is not aligned for 16 bytes.
    ``staged`` (sm_80+ cp.async): the ``unroll`` slots live in shared memory
    (``num_warps * unroll * loads_per_slot * 512`` bytes), so the bytes in flight are not bounded
    by registers; needs ``w_vec`` >= 4 (measured slower than register slots: no heuristic picks it).  ``cluster`` (sm_90): the ``split_k`` (2..8) CTAs of a tile
    form a cluster and add their sums through distributed shared memory (no workspace).
    ``x_half`` (bfloat16 x, quantized weights): a first kernel (quant_gemv_xhalf) writes x as float16
    scaled by a power of two per row into the stream's workspace, and the GEMV runs its float16
    MMAs on that copy (float16's dequantization costs 1 instruction per weight, bfloat16's 2.5; the
    template's header has the numerics and the PDL hand-over).  ``x_shared`` (with ``x_half``, M <= 8):
    each CTA makes that copy in its own shared memory instead (:meth:`x_shared_bytes` more per CTA,
    no conversion kernel).  ``x_grid`` (with ``x_half``, ``split_k`` 1): the GEMV's own first CTAs
    make the copy in the workspace for the whole grid while the other CTAs' first weight blocks load
    (no conversion kernel; the template's header says why the wait cannot deadlock).
    """

    family: ClassVar[str] = "quant_gemv"
    template: ClassVar[str] = "quant_gemv.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("quant_gemv", "quant_dequantize", "quant_gemv_xhalf")
    dtype: str = "bfloat16"
    weight_dtype: str = "int8"
    scale_dtype: str = "float32"
    group_size: int = 0
    has_zeros: bool = False
    has_bias: bool = False
    activation: str = "none"
    m_tiles: int = 1
    row_tiles: int = 1
    unroll: int = 4
    num_warps: int = 8
    warps_k: int = 8
    split_k: int = 1
    ctas_per_sm: int = 2
    persistent: bool = True
    max_registers: int = 0
    n_major: bool = False
    w_vec: int = 16
    x_vec: int = 8
    staged: bool = False
    cluster: bool = False
    x_half: bool = False
    x_shared: bool = False
    x_grid: bool = False

    expects_tensor_cores: ClassVar[bool] = True
    # (no expected_global_width: inspect holds loads and stores to it, and the outputs are M x N
    # scalar stores; tests/test_quant_matmul.py checks the 128-bit weight and x loads instead)

    def __post_init__(self):
        if self.activation is None:
            object.__setattr__(self, "activation", "none")
        self._check_dtype("dtype", DENSE_DTYPES)
        if self.weight_dtype in DENSE_DTYPES:
            if self.weight_dtype != self.dtype:
                self._fail("weight_dtype", f"{self.dtype!r} (an unquantized weight has x's dtype) or one of "
                                           + ", ".join(WEIGHT_DTYPES))
        else:
            self._check_choice("weight_dtype", WEIGHT_DTYPES + DENSE_DTYPES)
        self._check_dtype("scale_dtype", SCALE_DTYPES)
        self._check_choice("activation", ACTIVATIONS)
        for f in ("has_zeros", "has_bias", "persistent", "n_major", "staged", "cluster", "x_half", "x_shared",
                  "x_grid"):
            if not isinstance(getattr(self, f), bool):
                self._fail(f, "True or False")
        if self.group_size != 0:
            self._check_int("group_size", GROUP_MULTIPLE, 1 << 30, multiple_of=GROUP_MULTIPLE)
        if self.has_zeros and self.weight_dtype == "float8_e4m3":
            self._fail("has_zeros", "False for float8_e4m3 weights (zero points are for integer weights)")
        self._check_choice("m_tiles", (1, 2))
        self._check_choice("row_tiles", (1, 2, 4))
        self._check_int("unroll", 1, 16 if self.staged else 8)
        self._check_int("num_warps", 1, 16, power_of_two=True)
        self._check_int("warps_k", 1, self.num_warps, power_of_two=True)
        self._check_int("split_k", 1, 64)
        self._check_int("ctas_per_sm", 1, 64 // self.num_warps)
        if self.max_registers != 0:
            self._check_int("max_registers", 32, 255, multiple_of=8)
        self._check_choice("w_vec", (1, 2, 4, 8, 16))
        self._check_choice("x_vec", (1, 2, 4, 8))
        if self.dense:
            if self.group_size:
                self._fail("group_size", "0 for an unquantized weight (it has no scales)")
            if self.has_zeros:
                self._fail("has_zeros", "False for an unquantized weight")
            if self.w_vec == 1:
                self._fail("w_vec", "2, 4, 8 or 16 bytes for a 16-bit weight (whole elements)")
        if self.x_half and (self.dtype != "bfloat16" or self.dense):
            self._fail("x_half", "False unless x is bfloat16 and the weight quantized (x_half converts a bfloat16 x "
                                 "to float16 for the float16 dequantization)")
        if self.x_shared and not (self.x_half and self.m_tiles == 1):
            self._fail("x_shared", "False unless x_half=True and m_tiles=1 (a CTA's own float16 copy of at most 8 rows)")
        if self.x_grid and not (self.x_half and not self.x_shared and self.split_k == 1):
            self._fail("x_grid", "False unless x_half=True, x_shared=False and split_k=1 (the grid's first CTAs make "
                                 "the copy for CTAs that each hold a whole row of K)")
        if self.n_major:
            if not self.dense:
                self._fail("n_major", f"False for {self.weight_dtype} weights (N-major is for unquantized "
                                      "float16 / bfloat16 weights)")
            if self.row_tiles != 4:
                self._fail("row_tiles", "4 with n_major (8 lanes x 8 consecutive n: 64 rows per warp)")
        if self.staged and self.w_vec < 4:
            self._fail("w_vec", "4, 8 or 16 with staged=True (cp.async moves 4, 8 or 16 bytes)")
        if self.cluster and not 2 <= self.split_k <= CLUSTER_MAX:
            self._fail("cluster", f"False unless split_k is 2..{CLUSTER_MAX} (split_k={self.split_k}: the "
                                  "cluster is the split-K CTAs of a tile)")
        if self.x_vec > self.x_elems:
            self._fail("x_vec", f"at most {self.x_elems} (the x elements a lane reads per item)")
        # the slots, x and accumulators must fit the register cap or they spill (every slot's loads
        # are in flight at once); register_estimate is checked against ptxas by the CPU tests
        need = self.registers_needed
        if self.max_registers == 0 and need > self.register_cap:   # an explicit cap is left to ptxas
            self._fail("unroll", f"such that about {need} registers (row_tiles={self.row_tiles}, "
                                 f"unroll={self.unroll}, m_tiles={self.m_tiles}) fit the cap of "
                                 f"{self.register_cap} (ctas_per_sm={self.ctas_per_sm}, "
                                 f"num_warps={self.num_warps}); lower unroll, row_tiles or ctas_per_sm")
        if self.staged or self.cluster:
            limit = min(_SM90_SMEM_MAX, _SM90_SMEM_PER_SM // self.ctas_per_sm - 1024)
            if self.shared_mem_bytes > limit:
                self._fail("unroll", f"such that the staged slots and sums ({self.shared_mem_bytes} bytes) fit the "
                                     f"{limit} bytes of shared memory each of ctas_per_sm={self.ctas_per_sm} CTAs "
                                     "gets; lower unroll, warps_k or ctas_per_sm")
        elif self.shared_mem_bytes > _SMEM_LIMIT:
            self._fail("warps_k", f"such that the cross-warp sums fit {_SMEM_LIMIT // 1024} KiB of shared memory "
                                  f"(needs {self.shared_mem_bytes} bytes)")

    @property
    def dense(self) -> bool:
        """An unquantized weight (x's dtype, no scales)."""
        return self.weight_dtype in DENSE_DTYPES

    @property
    def block_k(self) -> int:
        """K per item (the template's kBlockK)."""
        return 16 if self.n_major else 64 // (2 if self.dense else 1)

    @property
    def x_elems(self) -> int:
        """x elements a lane reads per item and x row (kXElems)."""
        return 4 if self.n_major else self.block_k // 4

    @property
    def loads_per_slot(self) -> int:
        """16-byte weight loads per lane and slot (kLoads)."""
        return self.row_tiles if self.n_major else 2 * self.row_tiles

    @property
    def threads_per_block(self) -> int:
        return self.num_warps * 32

    @property
    def warps_n(self) -> int:
        return self.num_warps // self.warps_k

    @property
    def cta_rows(self) -> int:
        """Weight rows (outputs along N) per CTA tile."""
        return 16 * self.row_tiles * self.warps_n

    @property
    def register_cap(self) -> int:
        """Registers per thread the kernel is compiled for (__maxnreg__): ``max_registers``, or the
        most that let ``ctas_per_sm`` CTAs share an SM's 65536 (a multiple of 8, at most 255)."""
        if self.max_registers:
            return self.max_registers
        return min(255, 65536 // (self.threads_per_block * self.ctas_per_sm)) // 8 * 8

    @property
    def registers_needed(self) -> int:
        return register_estimate(self.row_tiles, self.unroll, self.m_tiles, self.group_size > 0, self.has_zeros,
                                 dense=self.dense, n_major=self.n_major, staged=self.staged)

    @property
    def bytes_in_flight_per_sm(self) -> int:
        """Weight bytes each SM keeps requested: CTAs x warps x slots x loads per slot x 16 B x 32."""
        return self.ctas_per_sm * self.num_warps * self.unroll * self.loads_per_slot * 16 * 32

    @property
    def shared_mem_bytes(self) -> int:
        """Two buffers (by tile parity) of the partial sums of warps 1.. along K (float32 accumulator
        fragments of 32 lanes), the cluster's exchange (one such set per warp along N) and the
        staged slots (512 bytes per warp, slot and load)."""
        frag = self.warps_n * self.row_tiles * self.m_tiles * 4 * 32 * 4
        red = 2 * (self.warps_k - 1) * frag
        xch = frag if self.cluster else 0
        stages = self.num_warps * self.unroll * self.loads_per_slot * 512 if self.staged else 0
        return red + xch + stages

    @property
    def x_copy_in_workspace(self) -> bool:
        """x_half's float16 copy lives in the stream workspace (made by the conversion kernel or, x_grid,
        by the GEMV's own CTAs), not in each CTA's shared memory."""
        return self.x_half and not self.x_shared

    def x_shared_bytes(self, m: int, k: int) -> int:
        """Shared memory x_shared adds to a CTA for M x K (:func:`shared_copy_bytes`); 0 without it."""
        return shared_copy_bytes(self.num_warps, m, k) if self.x_shared else 0

    def template_params(self):
        p = super().template_params()
        p.update(weight_kind_id=3 if self.dense else WEIGHT_DTYPES.index(self.weight_dtype),
                 zero_ctype="signed char" if self.weight_dtype == "int8" else "unsigned char",
                 activation_id=ACTIVATIONS.index(self.activation), register_cap=self.register_cap,
                 xhalf_threads=X_HALF_THREADS)
        return p

    def tiles(self, n: int) -> int:
        return -(-n // self.cta_rows)

    def grid(self, n: int, sm_count: int) -> tuple[int, int, int]:
        """Persistent: as few CTAs as give every CTA the same number of tiles (within one) in the
        rounds that sm_count * ctas_per_sm CTAs would need, so no last round runs on a fraction of
        the CTAs, whose bytes in flight cannot hold the DRAM rate (14336 x 4096: 896 tiles were 3
        rounds of 264 CTAs and one of 104; now 4 rounds of 224).  A/B against min(tiles, slots) in
        the same run (H100, 2026-11-27, % of copy, int8 M = 1 / 4 / 16, dense bf16 K-major M = 1 /
        16): 10240 x 8192 74.0 -> 79.0, 73.5 -> 78.0, 61.9 -> 64.5, dense 89.1 -> 93.8, 87.3 ->
        91.3; 14336 x 4096 70.7 -> 73.6, 68.3 -> 71.6, 57.5 -> 59.3; 6144 x 4096 50.3 -> 52.9,
        M = 16 41.5 -> 44.3; within half a point where the tiles fill whole rounds."""
        t = self.tiles(n)
        if not self.persistent:
            return (t, self.split_k, 1)
        rounds = -(-t // (sm_count * self.ctas_per_sm))
        return (-(-t // rounds), self.split_k, 1)

    def tag(self) -> str:
        """Short name of the tiling (benchmark tables)."""
        return (f"{'n' if self.n_major else ''}r{self.row_tiles}u{self.unroll}w{self.num_warps}k{self.warps_k}"
                f"s{self.split_k}c{self.ctas_per_sm}{'p' if self.persistent else ''}{'m' if self.staged else ''}"
                f"{'x' if self.cluster else ''}{'h' if self.x_half else ''}{'s' if self.x_shared else ''}"
                f"{'g' if self.x_grid else ''}")


# ---- heuristics ---------------------------------------------------------------------------------
# Reasoned from the bytes each SM must keep in flight and from the 2026-11-25 sweep (H100, the
# earlier kernel that issued an iteration's loads and waited for them: row_tiles 1 beat 2 and 4 at
# every shape, 4096 x 4096 37.9 -> 44.6% of copy, 14336 x 4096 58.1 -> 74.4%):
# * Little's law: an H100 SM's share of 3 TB/s is ~22.6 B/ns; at ~1-1.5 us of loaded DRAM latency an
#   SM must keep 23-34 KB of weight requests outstanding, all the time.  With the slots refilled
#   as soon as they are consumed, in flight per SM = ctas_per_sm x num_warps x unroll x 2 row_tiles
#   x 16 B x 32 lanes: 2 x 8 x 4 x 2 x 16 x 32 = 64 KiB (2x margin for the moments a warp waits at
#   the per-tile barrier or on x);
# * row_tiles 1: the N tiles are 16 rows, so the tiles split evenly over the SMs (N = 14336: 896
#   tiles, at most 7 per SM against 6.8 on average) and the register cap of 2 CTAs of 8 warps
#   (128) holds unroll 4 of one row tile with room (see register_estimate);
# * 8 warps along K (the base; M <= 8 now splits them 2 x 4, below): a tile's 16 rows x K bytes
#   are read by 8 warps at once (K / 8 per warp, 64 * unroll consecutive bytes of each row per
#   round), summed once per tile in shared memory;
# * persistent: 2 x SMs CTAs walk the tiles, a warp's next tile loading while it finishes this one
#   (no per-CTA ramp-up; the last round of tiles is the only tail);
# * split_k only when the tiles leave SMs without a CTA (N < ~2100 on 132 SMs), and only as far as
#   every warp keeps two 64-element blocks: the partials cost a second launch and
#   4 * split_k * M * N bytes.
_TILE_FIELDS = ("row_tiles", "unroll", "num_warps", "warps_k", "split_k", "ctas_per_sm", "persistent",
                "max_registers", "staged", "cluster", "x_half", "x_shared", "x_grid")   # what config= overrides
_WARPS = 8
_WARPS_K = 8
_CTAS_PER_SM = 2
_UNROLL = 4
_FILL = 0.95             # CTAs >= 95% of the SMs count as filling them (N = 4096: 128 of 132)


# Refit from the session-8 run (H100, 2026-11-25, tools/bench_quant_matmul.py --sweep-dense; % of
# the device copy, cuBLAS in the same run), against the session-7 tables
# (docs/data/bench_quant_matmul_session7_2026-11-25_h100.txt):
# * quantized, M <= 8: 8 warps along K, unroll 4 (r1u4w8k8s1c2p) at every N.  The session-7 retune
#   split them 2 x 4 (N x K) where 32-row tiles fill both CTA slots, from that session's sweep
#   (8192 x 28672: 87.1 vs 84.8), but the main tables disagree: with 2 x 4, int8 M = 1 went
#   28672 x 8192 80.3 -> 70.4, 8192 x 28672 78.3 -> 73.5, 10240 x 8192 63.3 -> 55.8, 8192^2
#   66.3 -> 62.9, and only 14336 x 4096 gained (58.9 -> 59.7).  32-row tiles also quantize
#   badly: 28672 x 8192 has 896 of them for 264 CTAs (3.4 rounds: the 4th a third full).
# * quantized, M = 9..16 (two m tiles): unroll 2, 8 warps along K (r1u2w8k8s1c2p): within a point of
#   session 7's unroll 4 at the small shapes and +2 to +4.7 at 10240 / 28672 x 8192 (56.0 vs 53.9,
#   71.7 vs 67.0).  Half the slots leave registers for the second m tile's x and accumulators.
# Group-scale and float8 weights run the same tilings (within a point of int8 per-channel at every
# shape and M in both sessions).
# * dense K-major, M <= 8: the quantized tiling, warps 2 x 4 where 32-row tiles fill both CTA slots
#   (the 16-bit rows halve the items per tile, so the quantization above costs less): at or above
#   cuBLAS at every shape (4096^2 68.1 vs 61.5, 28672 x 8192 97.0 vs 91.5, 8192 x 28672 97.6 vs 94.5).
# * dense K-major, M = 9..16: unroll 4 (the weight loads are half the quantized ones' registers:
#   about 96 under the cap of 128), and where 16-row tiles fill four CTA slots per SM (N >= ~8000)
#   4 warps x 4 CTAs (r1u4w4k4s1c4p): sweep 14336 x 4096 86.7 against r1u4w8k8s1c2p 82.6 and the
#   former r1u2w8k8s1c2p 77.9 (cuBLAS 87.7); 4096^2 r1u4w8k8s1c2p 64.2 against 60.7 (the 4 x 4
#   CTAs, 58.1, leave slots empty there; cuBLAS 59.7).  Four warps along K sum half the partials of
#   eight at each tile end, twice the accumulators of M <= 8.
# * dense N-major (64-row warps, 8 along K): two CTAs per SM at unroll 2 (M <= 8) or 1 (M = 9..16:
#   2 m tiles need ~108 registers at unroll 1, 152 at unroll 2 under ptxas, NVRTC 13.5), 32 KiB in
#   flight per SM at M = 16, and every tile resident at once up to 264 tiles (N = 16896).  The sweep:
#   14336 x 4096 M = 1 nr4u2w8k8s1c2p 89.0 against the former one CTA of unroll 4 84.3; M = 16
#   nr4u1w8k8s1c2p 82.8 against 64.0; 10240 x 8192 (160 tiles: 28 SMs ran a second round on one
#   CTA per SM) M = 1 75.6, M = 16 50.8 with the former.  Split-K (one launch now) where the tiles
#   do not fill both CTA slots of every SM: 4096^2 M = 1 split 4 58.3 against split 2 54.9, M = 16
#   51.4 against 47.0 (the two-launch split of that run; cuBLAS 68.2 / 60.8 there, which no swept
#   tiling reached).
#
# Session 18 (H100, 2026-11-27; the template's cursor loop, ~25% fewer instructions per item): the
# 17 tile candidates at 4 shapes, int8 % of copy, heuristic / best: M = 1 28672 x 8192 92.6 / 92.8,
# 8192 x 28672 90.7 / 91.4, 8192^2 75.9 / 77.4, 14336 x 4096 71.1 / 72.3 (kept); M = 16 78.4 /
# 82.1 (unroll 6), 78.5 / 81.5 (row_tiles 2), 65.8 / 67.4, 56.8 / 60.5 (4 x 4 CTAs): a different
# winner per shape, none a rule (docs/data/gemv_sweep_session18_2026-11-27_h100.json).
# The cursor loop cost the dense N-major session-8 tiling at two m tiles (unroll 1) 3-7 points (same
# run, old / new template, M = 16: 10240 x 8192 77.6 / 71.3, 28672 x 8192 90.2 / 86.8, 14336 x
# 4096 84.4 / 80.8; why is not understood: its item loop is shorter), but it fits unroll 2 (126
# registers; 152 before) and 3 (128, but 44 bytes of spill with bias + silu).  Unroll 1 / 2 / 3 in
# one run (M = 16, % of copy): 10240 x 8192 70.8 / 79.0 / 80.9, 28672 x 8192 85.4 / 88.6 / 91.9,
# 14336 x 4096 79.8 / 84.9 / 85.7; the split configs (fit, w16) lose with more slots (8192^2 86.2
# / 85.1 / 79.5, 8192 x 28672 95.6 / 94.3 / 90.5).  So the sm_90 rule's s8 branch takes unroll 2
# with two m tiles (docs/data/gemv_nmajor_unroll_session18_2026-11-27_h100.json).  The sm_80
# base keeps unroll 1 (not measured there).
#
# Session 9, measured (H200, 2026-11-26, tools/bench_quant_matmul.py --nmajor-ab; % of the device
# copy, 4.19 TB/s; cuBLAS in the same run).  The first sm_90 tiling kept the slots in shared memory
# (QuantGemvConfig.staged: cp.async, then ld.shared back) and split K over clusters; it lost
# everywhere: 14336 x 4096 M = 1 43.5 against the register slots' 82.7, 28672 x 8192 47.1 against
# 92.3, 8192^2 46.2 against 73.8, at 3, 4 or 5 slots alike (43.4 / 43.5 / 42.9) and with a global
# split (8192^2 42.4).  Why (SASS, NVRTC 13.5): per 16 bytes the staged slot costs an LDGSTS, an
# LDS.128 back and three padding LDS, against one LDG: ~36 instructions per 16 bytes of the main
# loop at M = 1 against ~27 (neither issue-bound: an SM's 4 warp-instructions per clock against
# ~16-18 weight bytes per clock of its DRAM share); the slots' own waits are the register
# slots' (DEPBAR.LE SB0, slots - 1, per item).  What the numbers point at is a cap on the copies' rate, not on the bytes in flight: a
# plateau at ~43% that the slot count (96 to 160 KiB requested per SM) does not move, where Little's
# law would need ~9 us of latency.  The likeliest cap was the shared-memory side of the copies: the
# N-major lanes of one 128-byte weight row (8 lanes, 16 bytes each) wrote their pieces 64 bytes
# apart, 4 bank-conflicting wavefronts per row, 16 per copy of 512 bytes (plus 4 to read back)
# against the register slots' none; the template now writes a row's pieces contiguously (one
# wavefront) and the A/B's "staged" variant measures whether that was it.  Staged slots stay a
# config option (and the quantized sweep's) but no heuristic picks them.
#
# The cluster split on the session-8 register tiling (s8+cluster) is the best variant where K is
# split: 4096^2 M = 1 / 4 / 16 40.8 / 40.6 / 34.8 against the global split's 36.5 / 28.0 / 17.8,
# 6144 x 4096 47.8 / 46.9 / 41.2 against 38.8 / 33.3 / 22.4, 4096 x 14336 M = 16 48.8 against 42.7;
# but at 4096 x 14336 M = 1 the global split won (68.3 against 58.2; M = 4 58.8 / 58.7).  The
# global split's cost is its tail: the last arriving split adds, in one warp, per lane 8 outputs x
# split_k dependent L2 reads at M <= 8 (16 x split_k with two m tiles), after every other split
# has finished, a fixed cost that a long K slice per CTA amortizes; the cluster's is a cluster
# barrier and co-scheduled CTAs (why that costs 10 points at 4096 x 14336 M = 1 is not known).
# Round 1 chose from these a cluster where the K slice per CTA was short or two m tiles doubled the
# tail; round 2 (below) replaced that choice.
#
# Round 2 (H200, 2026-11-26, --nmajor-ab, % of copy 4.23 TB/s; cuBLAS in the same run), per class
# of shape, with tiles = N / 64 (one warp along N) against the S = 132 SMs:
#   N x K        M = 1 / 4 / 16   s8              round 1         w16             fit             cuBLAS
#   4096^2       (64 tiles)       35.7/27.5/17.5  39.9/39.3/34.0  46.8/46.0/44.9  (= round 1)     53.3/53.9/52.9
#   4096x14336   (64)             66.5/57.9/41.9  66.5/57.9/48.2  72.8/72.9/70.3  (= round 1)     83.7/82.8/83.0
#   6144x4096    (96)             38.2/32.7/22.2  47.5/46.4/40.7  54.6/53.8/ -    61.7/61.0/52.3  63.6/65.9/65.5
#   8192^2       (128)            72.8/72.7/55.3  (= s8)          79.3/80.1/ -    79.9/79.9/76.8  88.1/88.4/88.6
#   8192x28672   (128)            82.3/82.2/60.8  (= s8)          94.2/95.0/ -    91.2/92.3/87.9  101.2/100.7/99.4
#   14336x4096   (224)            81.1/80.9/70.2  (= s8)          73.9/73.5/ -    (not a split)   84.3/85.9/84.6
#   28672x8192   (448)            91.5/91.6/79.3  (= s8)          86.4/87.1/ -    (not a split)   98.6/101.1/100.2
# (w16: one CTA of 16 warps along K per SM, split floor(S / tiles) as a cluster, unroll 4 / 2 with
# two m tiles; fit: the session-8 CTAs (2 per SM, 8 warps) with the largest split whose CTAs fit
# one wave of 2 per SM, floor(2S / tiles), as a cluster; "-": a config not valid there.)  u4
# (session-8 CTAs with unroll 4 / 2) was within 1.5 points of the row's winner at 8192^2 / 8192 x
# 28672 M <= 4 (80.8/79.7, 94.0/93.4) and at 14336 / 28672 M = 16 (71.4, 81.8), never clearly
# ahead: not a rule of its own (fewer variants).  The rule these numbers give:
# * tiles > S (N > ~8400): the session-8 tiling (s8: 2 CTAs per SM, one wave up to 2S tiles,
#   persistent beyond).  A CTA of 16 warps per SM would need a second, partial wave (224 tiles on
#   132 SMs: 73.9 against 81.1).
# * tiles <= S, and the w16 split puts a CTA on >= 95% of the SMs (or as many as fit's would):
#   w16.  16 warps along K keep 64 / 128 KiB of weight requests in flight per SM in one CTA, and
#   its 15 partial sums meet once per tile in shared memory; 4096^2 46.8 against fit's 39.9 (fit
#   is round 1's split there), 4096 x 14336 72.8 against the global split's 66.5, 8192 x 28672
#   94.2 / 95.0 against fit's 91.2 / 92.3, and a tie at 8192^2 (79.3 / 80.1 against 79.9 / 79.9).
# * otherwise (6144: 96 tiles leave 36 SMs idle at one CTA per SM; two m tiles where w16 would
#   not split: its 15 partial sets of two m tiles need 120 KiB, over the 64 KiB a config without
#   the cluster gets): fit, 6144 61.7 / 61.0 / 52.3 against w16's 54.6 / 53.8, 8192^2 M = 16 76.8
#   against s8's 55.3.  Its split is a cluster where the K slice per CTA is at most _CLUSTER_K or
#   two m tiles double the global split's tail (round 1: 6144 x 4096's 2048 as a cluster in the
#   fit column; 4096 x 14336 M = 1's 3584, split 4: global 66.5 against cluster 57.5).
# Registers (ptxas, NVRTC 13.5, sm_90a): w16 128 of 128 at unroll 4 (one m tile) and 2 (two), with
# bias + gelu / silu, fp16 and bf16, loads of 16 / 8 / 4 / 2 bytes and x of 8 / 4 / 2 bytes, no
# spill; but no headroom: under a cap of 112 unroll 4 spills 20-48 bytes unless the split is a
# cluster with 16-byte loads, and unroll 2 with two m tiles 4 / 8 bytes (stores / loads), so
# tests/test_gemv.py checks them at their own cap (as the GPU host's NVRTC does when it runs that
# file).  fit is the session-8 CTA with another split: 108 / 119 registers of 128 at M = 1 / 16.
# RTKERNELS_GEMV_SM90=0 keeps the session-8 tiling on sm_90 (the A/B baseline).
USE_SM90_NMAJOR = os.environ.get("RTKERNELS_GEMV_SM90", "1") != "0"
_CLUSTER_K = 2048
_WIDE_WARPS = 16   # w16: warps (all along K) of its one CTA per SM


def _nmajor_sm90(cfg: QuantGemvConfig, n: int, k: int, sm_count: int) -> QuantGemvConfig:
    """The sm_90 dense N-major config by the round-2 rule above, from the session-8 one ``cfg``
    (2 CTAs of 8 warps along K per SM, register slots): s8 where the 64-row tiles outnumber the
    SMs, else one CTA of 16 warps per SM split over K as a cluster (w16) where that fills the SMs,
    else the session-8 CTAs with the split that fits one wave of two per SM (fit)."""
    tiles = cfg.tiles(n)
    if tiles > sm_count:
        # two m tiles: unroll 2 (session 18: the cursor loop fits it in 126 registers, 112 under the
        # headroom cap, where the session-8 loop needed 152)
        return cfg.replace(unroll=2) if cfg.m_tiles == 2 else cfg
    nblk = -(-k // cfg.block_k)
    # split-K CTAs per tile: as many as one (w16) or two (fit) CTA slots per SM give each tile, at
    # most a portable cluster, and every warp at least two K blocks (session 8's floor)
    wide = max(1, min(CLUSTER_MAX, sm_count // tiles, nblk // (2 * _WIDE_WARPS)))
    fit = max(1, min(CLUSTER_MAX, 2 * sm_count // tiles, nblk // (2 * cfg.warps_k)))
    busy_wide, busy_fit = tiles * wide, min(tiles * fit, sm_count)   # SMs with a CTA
    if busy_wide >= min(busy_fit, math.ceil(_FILL * sm_count)) and (cfg.m_tiles == 1 or wide > 1):
        # twice the session-8 slots: 4, or 2 with two m tiles (the one CTA gets 128 registers)
        return cfg.replace(num_warps=_WIDE_WARPS, warps_k=_WIDE_WARPS, ctas_per_sm=1, unroll=2 * cfg.unroll,
                           split_k=wide, cluster=wide > 1)
    cluster = fit > 1 and (cfg.m_tiles == 2 or k <= _CLUSTER_K * fit)
    return cfg.replace(split_k=fit, cluster=cluster)


def heuristic_config(dtype: str, m: int, n: int, k: int, *, weight_dtype: str = "int8",
                     scale_dtype: str = "float32", group_size: int = 0, has_zeros: bool = False,
                     has_bias: bool = False, activation: str = "none", n_major: bool = False, w_vec: int = 16,
                     x_vec: int = 8, sm_count: int | None = None, sm90: bool | None = None,
                     x_half: bool | None = None, x_shared: bool | None = None,
                     x_grid: bool | None = None) -> QuantGemvConfig:
    """The config the ops run for (M <= 16, N, K), the weight kind and layout, and the load widths.
    ``sm90``: the sm_90 N-major rule (:func:`_nmajor_sm90`); default: the target arch is sm_90 and
    RTKERNELS_GEMV_SM90 is not 0.  Quantized weights with per-row scales at M = 9..16 take two row
    tiles per warp where the grid allows (:func:`_two_row_tiles`), group scales at M <= 8 where rows
    are long or M >= 6 (:func:`_group_row_tiles`).  ``x_half`` / ``x_shared`` /
    ``x_grid``: convert a bfloat16 x to float16 (QuantGemvConfig.x_half), in each CTA's shared memory
    (x_shared) or by the grid's first CTAs (x_grid, where split_k is 1); default: :func:`x_half_mode`."""
    if sm_count is None:
        sm_count = device.sm_count() if device.has_gpu() else 132
    if sm90 is None:
        sm90 = USE_SM90_NMAJOR and device.current_arch().startswith("sm_90")
    need = math.ceil(_FILL * sm_count)
    m_tiles = 1 if m <= 8 else 2
    dense = weight_dtype in DENSE_DTYPES
    # ptxas (NVRTC 13.5, sm_90) under a cap of 112, 16 below the 128 the kernel gets (margin for
    # other NVRTC versions, tests/test_quant_matmul.py): unroll 4 fits every one-m-tile variant
    # without spilling.  Narrower loads (K, a stride or a base not 16-byte aligned: a byte-by-byte
    # weight load builds each register from 4 loads and shifts) spilled 8 bytes at unroll 4 under
    # 112: unroll 2 there.
    warps, ctas, fill = _WARPS, _CTAS_PER_SM, need
    if n_major:
        row_tiles, warps_k = 4, _WARPS_K
        unroll = 2 if m_tiles == 1 else 1
        fill = 2 * need   # both CTA slots of every SM (see above)
    else:
        row_tiles = 1
        # two m tiles, quantized: 2 slots, but 4 with group scales and no zero points (session 18, H100,
        # same rounds, int8 g128 M = 16, 2 -> 4 slots, % of copy: 28672 x 8192 73.8 -> 79.8, 8192 x
        # 28672 72.6 -> 77.7, 10240 x 8192 60.0 -> 63.7, 4096 x 14336 60.8 -> 63.7, 14336 x 4096 57.5
        # -> 60.2, 8192^2 63.5 -> 65.6, 4096^2 40.0 -> 39.1; M = 12 alike.  Per-row scales gained
        # -2.6 .. +2.4: kept at 2.  docs/data/gemv_m16_unroll_session18_*).  128 registers without
        # spill under NVRTC 13.0 (24 dtype / kind / epilogue variants) and 13.5, none to spare: the
        # compile test checks these at their own cap
        group_wide = m_tiles == 2 and group_size > 0 and not has_zeros and not dense
        unroll = _UNROLL if (m_tiles == 1 or dense or group_wide) and w_vec == 16 else 2
        warps_k = _WARPS_K
        if dense and m_tiles == 1 and -(-n // 32) >= 2 * need:
            warps_k = _WARPS_K // 2
        elif dense and m_tiles == 2 and w_vec == 16 and -(-n // 16) >= 4 * need:
            warps, warps_k, ctas = 4, 4, 4
    tiles = -(-n // (16 * row_tiles * (warps // warps_k)))
    block_k = 16 if n_major else (32 if dense else 64)
    nblk = -(-k // block_k)
    split = 1
    if tiles < need:
        split = max(1, min(-(-fill // tiles), nblk // (2 * warps_k), 16))
    x_vec = min(x_vec, 4 if n_major else 8)
    cfg = QuantGemvConfig(dtype=dtype, weight_dtype=weight_dtype, scale_dtype=scale_dtype, group_size=group_size,
                          has_zeros=has_zeros, has_bias=has_bias, activation=activation or "none",
                          m_tiles=m_tiles, row_tiles=row_tiles, unroll=unroll, num_warps=warps,
                          warps_k=warps_k, split_k=split, ctas_per_sm=ctas, persistent=True,
                          n_major=n_major, w_vec=w_vec, x_vec=x_vec)
    if n_major:
        return _nmajor_sm90(cfg, n, k, sm_count) if sm90 else cfg
    auto_half, auto_shared, auto_grid = x_half_mode(cfg, m, n, k, sm_count)
    x_half = auto_half if x_half is None else x_half
    x_shared = (auto_shared if x_shared is None else x_shared) and x_half and m_tiles == 1
    x_grid = (auto_grid if x_grid is None else x_grid) and x_half and not x_shared and split == 1
    cfg = cfg.replace(x_half=x_half, x_shared=x_shared, x_grid=x_grid)
    if m_tiles == 2 and not dense and group_size == 0 and not has_zeros and w_vec == 16 and split == 1:
        return _two_row_tiles(cfg, n, sm_count)
    if m_tiles == 1 and not dense and group_size > 0 and w_vec == 16 and split == 1 and not x_shared:
        return _group_row_tiles(cfg, m, n, k, sm_count)
    return cfg


# RTKERNELS_GEMV_XHALF=0: bfloat16 x runs the bfloat16 MMAs (the A/B baseline of x_half).
# The conversion's CTA: 256 threads (~100 registers each: a row of up to 16k elements held in
# registers) leave room on their SM for one of the GEMV's 8-warp CTAs, which 512 did not.
X_HALF_THREADS = 256
USE_X_HALF = os.environ.get("RTKERNELS_GEMV_XHALF", "1") != "0"
# Where the conversion kernel's copy pays: the float16 path's gain against its ~2 us (the template's header).
# Measured (H200, 2026-11-28, bfloat16 x, the same weights, % of the 1 GiB copy, interleaved rounds,
# bf16 MMAs -> x_half (this kernel pair) -> float16 x; docs/data/gemv_xhalf_late_variant_session32_*,
# its "late" column; the other runs of gemv_xhalf_*session32_* agree within ~1.5 points):
#   per-row scales, M = 1 / 4 / 16:
#     28672x8192 84.5 -> 90.2 / 82.6 -> 88.3 / 70.4 -> 81.6 (fp16 93.1 / 92.2 / 85.0)
#     14336x4096 64.4 -> 68.7 / 62.8 -> 66.8 / 55.8 -> 59.8    10240x8192 67.6 -> 73.8 / 65.7 -> 71.7 / 57.2 -> 63.3
#     8192x28672 86.7 -> 84.1 / 84.9 -> 80.0 / 74.3 -> 79.7    8192x8192  72.9 -> 70.6 / 71.0 -> 66.7 / 59.4 -> 62.2
#     6144x4096  49.2 -> 49.9 / 48.8 -> 47.0 / 40.9 -> 40.6    4096x14336 73.3 -> 68.0 / 70.0 -> 62.1 / 56.1 -> 56.0
#     4096x4096  50.3 -> 43.6 / 46.1 -> 40.3 / 40.9 -> 35.9
#   int8 group 128, M = 1 / 16: 28672x8192 69.9 -> 86.5 / 61.8 -> 64.5, 8192^2 61.4 -> 66.6 / 55.2 -> 52.4,
#     4096^2 45.8 -> 40.9 / 38.0 -> 33.0
#   uint8 group 128 with zero points, M = 1 / 16: 28672x8192 65.2 -> 68.2 / 54.0 -> 59.7, 8192^2 59.2 -> 56.0 /
#     50.6 -> 52.4, 4096^2 43.7 -> 38.8 / 38.9 -> 35.2
#   the conversion alone, queued: 1.8-2.0 us at K <= 8192, 2.3 at 14336, 4.2-4.5 at 28672
#   bench_quant_matmul (separate processes, RTKERNELS_GEMV_XHALF=0 / 1) also: int8 g128 M = 4 14336x4096
#     54 -> 61, 10240x8192 56 -> 63, 28672x8192 69 -> 83, 8192x28672 70 -> 68; M = 16 10240x8192 49 -> 50.
# So the smallest N that takes it, by scales and m tiles (one: M <= 8, two: M = 9..16); the rest lose up
# to 6 points (small weights, where 2 us is a large share; 8192 x 28672 at one m tile, whose bfloat16
# path is least issue-bound; group scales at two m tiles, whose per-block scaling dilutes the gain).
X_HALF_MIN_N = {   # (scales: "row" / "group" / "zeros", m tiles) -> N
    ("row", 1): 10240, ("row", 2): 6144, ("group", 1): 8192, ("group", 2): 28672,
    ("zeros", 1): 10240, ("zeros", 2): 8192}


def shared_copy_bytes(num_warps: int, m: int, k: int) -> int:
    """A CTA's own float16 copy of M x K (x_shared): the warps' row maxima, the rows' multipliers and
    the rows, each an odd number of 16-byte units long (the template's ldxs: a quarter warp's loads
    of two rows hit distinct banks)."""
    return (num_warps * 8 + 8) * 4 + 2 * m * (-(-k // 8) | 1) * 8


def x_shared_fits(cfg: QuantGemvConfig, m: int, k: int) -> bool:
    """Whether ``cfg``'s CTAs per SM each fit their own float16 copy of M x K (x_shared)."""
    per_cta = cfg.shared_mem_bytes + shared_copy_bytes(cfg.num_warps, m, k)
    return per_cta <= _SM90_SMEM_MAX and cfg.ctas_per_sm * (per_cta + 1024) <= _SM90_SMEM_PER_SM


# x_shared (each CTA's own copy: no conversion kernel, no 2 us) from N = 6144 up to K = 8192, at M = 1
# (M <= 4 with zero points).
# Measured (H200, 2026-11-28, % of the 1 GiB copy, M = 1, bf16 MMAs / conversion kernel / CTA's own
# copy / float16 x; docs/data/gemv_xshared_ab_session32_*):
#   per-row int8: 6144x4096 49.1 / 49.5 / 52.7 / 57.2, 14336x4096 64.8 / 68.9 / 71.0 / 74.6, 8192^2
#     72.7 / 70.8 / 73.0 / 76.5, 10240x8192 67.4 / 73.4 / 76.6 / 78.5, 28672x8192 84.4 / 90.3 / 91.0 / 93.2
#   int8 g128: 14336x4096 56.0 / 63.8 / 70.1 / 69.0, 8192^2 61.5 / 66.9 / 72.6 / 72.7, 28672x8192 70.2 /
#     86.9 / 91.4 / 89.6
#   uint8 g128 + zero points: 14336x4096 51.9 / 54.0 / 68.0 / 58.5, 8192^2 59.0 / 55.9 / 71.0 / 59.6,
#     28672x8192 65.3 / 68.4 / 90.5 / 68.8 (x from shared memory frees the zero-point path's registers)
# and it loses where each CTA's copy weighs more: 4096 rows (one tile per CTA: 4096^2 50.1 / 44.4,
# 4096x14336 73.0 / 65.7, the bf16 MMAs against the CTA's copy) and K = 28672 (8192x28672 86.6 / 81.1).
# At M = 4 / 8 the copy's rows, staged one after another, cost more than the conversion kernel (int8
# per-row M = 4, bf16 / kernel's copy / CTA's copy: 28672x8192 82.8 / 88.4 / 83.9, 8192^2 69.2 / 66.4 /
# 58.3; M = 8 14336x4096 62.6 / 64.2 / 49.4; rows padded to an odd number of 16-byte units, so a
# quarter warp's loads of 2 rows x 4 lanes hit distinct banks: +0-6 points), but zero points gain at
# M = 4 as at M = 1 (uint8 g128 M = 4: 28672x8192 63.7 / 66.1 / 81.7, 14336x4096 51.1 / 52.2 / 56.8,
# 8192^2 55.6 / 52.5 / 55.8; M = 8 14336x4096 50.6 / 50.5 / 47.0).
# Zero points at M = 2..4 now take the grid's copy below N = 28672 (below).  Staging all of a CTA's rows
# at once (4 per pass) instead of one after another was level (int8 M = 4 28672x8192 83.4, 8192^2
# 58.1; H200, 2026-11-28, docs/data/gemv_xshared_batched_session33_*): the copy's cost is the L2 reads
# of M x K x 2 bytes per CTA, not the rows' latency.
X_SHARED_MIN_N = 6144
X_SHARED_MAX_K = 8192
X_SHARED_RULES = (("row", 1, X_SHARED_MIN_N), ("group", 1, X_SHARED_MIN_N), ("zeros", 1, X_SHARED_MIN_N),
                  ("zeros", 4, 28672))   # (scales, largest M, smallest N)

# x_grid (the GEMV's first CTAs make the copy for the grid: no conversion kernel, no copy per CTA) where
# it beat the conversion kernel, the bf16 MMAs and (M <= 4) a CTA's own copy.  Measured (H200,
# 2026-11-28, two runs, % of the 1 GiB copy, bf16 MMAs / conversion kernel / grid / CTA's own copy;
# docs/data/gemv_xgrid_ab_session33_*, gemv_xgrid_variants_session33_*):
#   uint8 g128 + zero points: M = 4 14336x4096 51.0 / 52.3 / 60.7 / 56.7, 8192^2 55.5 / 52.1 / 59.7 / 55.6,
#     10240x8192 53.1 / 54.0 / 60.5 / 56.5, 6144x4096 41.9 / 39.1 / 42.3 / 36.3, 28672x8192 63.8 / 65.9 /
#     77.7 / 81.8 (the CTA's copy keeps N = 28672); M = 16 28672x8192 54.0 / 59.6 / 62.2, 8192x28672 53.4 /
#     57.7 / 61.5, 14336x4096 44.6 / 46.9 / 47.6, 10240x8192 44.7 / 47.4 / 48.8; K = 28672 (no CTA copy)
#     M = 1 8192x28672 64.3 / 61.9 / 73.8;
#   int8 g128, M = 16: 28672x8192 61.6 / 64.4 / 66.7, 8192x28672 60.3 / 63.6 / 65.0, 10240x8192 48.2 / 49.7 /
#     51.6, but 8192^2 54.1 / 52.3 / 52.7 and 14336x4096 47.9 / 46.0 / 47.5 (hence the weight-size bound);
#     M = 4 8192x28672 71.8 / 68.6 / 72.9 (K > 8192: the conversion kernel reads each row twice), where at
#     K = 8192 the conversion kernel won (28672x8192 83.3 / 78.2, 10240x8192 62.7 / 60.8);
#   per-row int8 lost to the conversion kernel (28672x8192 M = 1 / 4 / 16 90.3 / 89.8, 88.9 / 89.2, 81.5 /
#     77.4; 10240x8192 M = 16 63.4 / 60.1): the converting CTAs start their weights later, a tail the
#     leanest path feels most.
# (A variant whose converting CTAs issued their first weight blocks before converting lost 5-12 points
# everywhere; one that read the conversion kernel's copy with ld.global instead of the read-only path
# was level.)  With the converting CTAs ahead of the tile grid where the SMs hold them (grid_copy_extra,
# docs/data/gemv_xgrid_hybrid_session33_*, one run, bf16 / conversion kernel / grid / CTA copy): int8 g128
# M = 4 10240x8192 56.1 / 62.7 / 65.6 / 58.8, 28672x8192 70.0 / 83.0 / 83.8 / 83.7, 8192x28672 71.7 /
# 68.9 / 75.1; zero points M = 4 14336x4096 51.0 / 52.4 / 62.1 / 56.8.  So group scales at M = 2..8
# take it from 10240x8192 weights (14336x4096 and 8192^2 unmeasured this way: the conversion kernel).
# Per-row scales stay off it (28672x8192 M = 1 / 4 / 16: 89.7 / 89.3 / 81.9 kernel, 89.6 / 88.4 /
# 80.8 grid; M = 8 84.3 / 86.8, one cell, not taken).
# Session 35: smaller weights take it too where the converting CTAs fit beside the tile grid ("beside":
# grid_copy_extra > 0, so no tile CTA converts): against bf16 MMAs or the conversion kernel (its launch
# and ~2 us), and at M = 9..16 with the copy interleaved for the loads (session 34).  Measured (H200,
# 2026-11-28, % of copy, the rules before -> these, each config passed as config=, interleaved rounds, min
# of five medians; docs/data/gemv_xgrid_rule{,2,3}_ab_session35_*, probes in gemv_xi_*_session35_*,
# gemv_xgrid_*_probe_session35_*; the benchmark, bench_quant_matmul_session35_* against session 34's run,
# agrees where its shapes changed: int8 g128 M = 4 14336x4096 60.9 -> 64.6, 8192^2 60.5 -> 65.0, 6144x4096
# 42.8 -> 46.0; M = 16 14336x4096 48.2 -> 50.9, 6144x4096 37.0 -> 38.5):
#   group scales (int8 g128; g64 alike), M = 2 / 4 / 8 / 16: 8192^2 64.0 -> 68.5, 63.5 -> 67.1, 61.4 -> 64.5
#     (M = 16: 256 tile CTAs, no room: unchanged); 14336x4096 61.7 -> 64.8, 60.3 -> 63.9, 58.8 -> 61.0, 47.5 ->
#     50.3; 8192x4096 53.3 -> 55.7, 51.2 -> 54.7, 49.5 -> 51.9; 5120x13824 42.5 -> 51.9, 42.6 -> 50.8, 42.6 ->
#     49.4, 36.6 -> 41.3; 13824x5120 M = 9..16 +6 .. +7.5; 142 cells from 5120x4096 to 14336x4096, none
#     below -0.2.  4096 rows lost (M = 2..8: 4096^2 -1 .. -1.6, 4096x14336 -2 .. -4.7; M = 16 -3 .. -6):
#     hence N >= 5120.  Where 256 tile CTAs fill the slots at M = 9..16 it lost too (8192x4096 -2 .. -2.8).
#   zero points at 5120 rows (from 6144 above), M = 1 / 2 / 8 / 16: 5120x4096 35.8 -> 39.6, 35.2 -> 38.7,
#     34.3 -> 37.0, 29.5 -> 31.2; 5120x13824 41.6 -> 50.5, 41.6 -> 50.0, 41.5 -> 46.5, 32.9 -> 38.5.
#   per-row scales stay off it: at M = 2..8 from 8192 x 8192 weights this A/B (the config passed as
#     config=, old and new alternating) read +0.8 .. +5.2 (8192^2 M = 4 69.1 -> 72.4, 28672x8192 M = 8 82.3 ->
#     87.5), but the benchmark's own loop (rtk and cuBLAS alternating, tools/bench_quant_matmul.py run_case,
#     old and new rules alternating in one process; docs/data/perrow_grid_bench_check_session35_*) read the
#     grid slower at every cell: M = 4 / 8 28672x8192 87.4 -> 82.2 / 83.2 -> 81.7, 8192x28672 83.3 -> 77.6 /
#     80.7 -> 76.8, 10240x8192 70.1 -> 67.0 / 66.5 -> 66.2, 8192^2 68.7 -> 66.9 / 68.1 -> 66.1.  The two methods
#     agree on every group-scaled cell both ran (and on the per-row configs before the change); why they part
#     on the per-row grid is not known, so it is not taken.
#   M = 1 (x_shared where it fits first): against bf16 MMAs 5120x4096 g128 37.4 -> 41.1, 5120x13824 42.8 ->
#     52.4, 6144x14336 53.3 -> 61.9 (g64 +2.4 .. +3.6, zero points +3.8 / +8.8); against the conversion
#     kernel one converting CTA per row was level or lost (g128 8192x28672 81.3 / 81.3, 10240x14336 72.3 /
#     72.3; g64 76.2 -> 66.6, 73.6 -> 70.6): so M = 1 takes it only below the conversion kernel's N.
USE_X_GRID = os.environ.get("RTKERNELS_GEMV_XGRID", "1") != "0"   # 0: the rule never takes x_grid (A/B)


class GridRule(NamedTuple):
    """Where x_grid applies: the weight's scales ("row" / "group" / "zeros"), M in ``m`` (a range),
    N >= min_n (and <= max_n when given), K >= min_k, N x K >= min_nk; ``beside``: only where the
    converting CTAs fit beside the tile grid (:func:`copy_ctas_fit`)."""
    scales: str
    m: tuple[int, int]
    min_n: int = 0
    min_k: int = 0
    min_nk: int = 0
    beside: bool = False
    max_n: int | None = None

    def takes(self, cfg: "QuantGemvConfig", m: int, n: int, k: int, sm_count: int) -> bool:
        return (self.m[0] <= m <= self.m[1] and n >= self.min_n and k >= self.min_k and n * k >= self.min_nk
                and (self.max_n is None or n <= self.max_n)
                and (not self.beside or copy_ctas_fit(cfg, m, cfg.grid(n, sm_count)[0], sm_count)))


X_GRID_RULES = (
    GridRule("zeros", (1, 16), min_n=6144),
    GridRule("group", (2, 8), min_n=8192, min_nk=10240 * 8192),
    GridRule("group", (9, 16), min_nk=10240 * 8192),
    # session 35 (above)
    GridRule("group", (2, 16), min_n=5120, beside=True),
    GridRule("group", (1, 1), min_n=5120, beside=True, max_n=X_HALF_MIN_N[("group", 1)] - 1),
    GridRule("zeros", (1, 16), min_n=5120, beside=True),
)


def x_half_mode(cfg: QuantGemvConfig, m: int, n: int, k: int, sm_count: int) -> tuple[bool, bool, bool]:
    """(x_half, x_shared, x_grid) for ``cfg`` (its x_half fields ignored) on (M, N, K): a CTA's own
    copy by X_SHARED_RULES (where it fits); else the grid's by X_GRID_RULES (one CTA along K); else
    the conversion kernel's by X_HALF_MIN_N."""
    if not x_half_applies(cfg.dtype, cfg.weight_dtype):
        return False, False, False
    scales = _scales_kind(cfg.group_size, cfg.has_zeros)
    if (k <= X_SHARED_MAX_K and any(s == scales and m <= top and n >= low for s, top, low in X_SHARED_RULES)
            and x_shared_fits(cfg, m, k)):
        return True, True, False
    if USE_X_GRID and cfg.split_k == 1 and any(r.scales == scales and r.takes(cfg, m, n, k, sm_count)
                                               for r in X_GRID_RULES):
        return True, False, True
    return n >= X_HALF_MIN_N[(scales, 1 if m <= 8 else 2)], False, False


def _scales_kind(group_size: int, has_zeros: bool) -> str:
    """The rule tables' key for a weight's scales: "row", "group" or "zeros"."""
    return "zeros" if has_zeros else "group" if group_size else "row"


def x_half_applies(dtype: str, weight_dtype: str) -> bool:
    """Whether a float16 copy of x can pay at all (QuantGemvConfig.x_half): a bfloat16 x, integer
    weights, sm_90+ (the conversion's kernel hands over to the GEMV with PDL).  float8 e4m3 weights
    dequantize to bfloat16 as cheaply as to float16 (bits moved under the exponent, one multiply): the
    copy only adds its kernel there (H200, 2026-11-28, g128, % of copy, bf16 -> x_half: 28672 x 8192
    M = 1 67.6 -> 66.3, 8192^2 59.6 -> 55.5)."""
    return (USE_X_HALF and dtype == "bfloat16" and weight_dtype in ("int8", "uint8")
            and arch_number(device.current_arch()) >= 90)


# Quantized weights with per-row scales at M = 9..16 (two m tiles): two row tiles per warp where the
# grid stays as balanced.  Each lane's x fragments (32 registers at two m tiles) then serve two row
# tiles' weights, half the x loads and conversions per weight byte.  Measured (H200, 2026-11-28, int8
# M = 9 / 16 through config=, % of the 1 GiB copy, interleaved rounds; docs/data/
# gemv_m16_row_tiles_session31_*), r1u2 (this rule's base) against the winner:
#   14336x4096 47.3 / 46.3 -> 55.6 / 55.4 (r2, 4 warps along K)   28672x8192 61.9 / 60.8 -> 71.8 / 70.5 (same)
#   8192x28672 65.1 / 64.0 -> 75.3 / 74.0 (r2)                      8192x8192  55.5 / 54.6 -> 60.5 / 58.7 (r2)
#   10240x8192 50.2 / 49.4 -> 58.3 / 57.1 (r2, 4 CTAs of 4 warps)   6144x4096  37.5 / 37.2 -> 40.5 / 40.5 (r2)
#   4096x4096 and 4096x14336: r1u2 (41.1 / 56.4; r2 34.1 / 50.2: one CTA per SM of 128 32-row tiles)
# float8 e4m3 alike (14336x4096 M = 16 46.4 -> 55.6, 8192x28672 63.8 -> 75.0).  H100 (session 18's sweep,
# r2 with 8 warps along K): 8192x28672 +3.0, 14336x4096 +2.5, 8192^2 +0.8, 28672x8192 -0.9.  One row tile
# stays only where two would leave fewer than _TWO_ROW_TILES_MIN_WARPS of its resident warps (4096
# rows as 32-row tiles: 128 CTAs, one per SM).  Among the two-row-tile shapes the busiest SM decides: its
# CTAs (rounded up) x tiles per CTA x rows per tile - 10240 rows as 320 32-row tiles on 2 x 132 CTA slots
# run 160 CTAs of 2 tiles (28 SMs with two: 128 rows; 47.1) where 4 CTAs of 4 warps per SM run 320 CTAs of
# one (96 rows; 58.3).  Against one row tile that count does not decide: 28672 rows leave r1u2's busiest SM
# 224 rows and the 64-row tiles' 256, and the 64-row tiles win by 10 points.  Registers: 128 of 128 (NVRTC
# 13.5, sm_90a), no spill in any dtype / weight / epilogue but the 64-row tiles with bias + SiLU in bfloat16
# (4 bytes): those take the 64-row tiles without an activation only.  None has the compile test's 16
# registers of headroom (16-28 bytes of spill at 112), so it checks them at their own cap, as the group
# configs' 4 slots.
_TWO_ROW_TILES = (   # (fields, taken with an activation)
    (dict(row_tiles=2, unroll=2, warps_k=4), False),                                     # 64-row tiles
    (dict(row_tiles=2, unroll=2), True),                                                 # 32-row tiles
    (dict(row_tiles=2, unroll=2, num_warps=4, warps_k=4, ctas_per_sm=4), True))          # 4 CTAs per SM
_TWO_ROW_TILES_MIN_WARPS = 0.7


# Group scales (with or without zero points) at one m tile (M <= 8): two row tiles per warp (32-row
# tiles, 2 slots: the same weight bytes in flight as one row tile's 4) where rows are long or M >= 6, on
# a grid as balanced as one row tile's.  A lane's x fragments then serve 32 weight rows, not 16: half
# the x loads per weight byte, which grow with M and with the K a warp walks.  Measured (H200,
# 2026-11-28, two runs, % of the 1 GiB copy, interleaved rounds, one row tile x 4 slots -> 32-row tiles,
# the same x copy; docs/data/gemv_group_row_tiles_session34_*):
#   8192x28672 (the same busiest-SM rows, 64), M = 1 / 2 / 4 / 8: int8 g128 76.5 -> 81.1, 77.5 -> 80.5,
#     75.2 -> 78.9, 73.3 -> 77.1; uint8 g128 + zero points 73.9 -> 78.4, 71.2 -> 77.4, 69.5 -> 76.5,
#     66.4 -> 75.2 (M = 6 67.7 -> 76.0); float8 e4m3 g128 70.8 -> 74.3, -, 70.1 -> 72.7, 68.1 -> 72.1;
#     int8 g128 with float16 x 81.1 -> 82.3, -, 75.6 -> 78.4, 73.5 -> 76.6
#   8192^2 (64 rows either way), int8 g128 / uint8 g128 + zero points: M = 8 57.6 -> 62.6 / 57.4 -> 62.7,
#     M = 6 59.0 -> 62.7 / 58.8 -> 62.5, M = 4 60.8 -> 62.3 / 61.2 -> 62.5 but M = 2 64.4 -> 63.5 /
#     65.5 -> 63.3; float8 M = 8 60.0 -> 59.6; int8 g64 float16 x M = 8 63.3 -> 65.2
#   14336x4096 (128 rows either way), uint8 + zero points M = 8 57.4 -> 60.5, M = 6 61.0 -> 60.9; int8
#     M = 8 59.9 -> 59.9
#   28672x8192 (224 -> 256 busiest rows): won with the grid's copy (uint8 + zero points M = 8 70.8 -> 77.6,
#     M = 6 74.7 -> 78.3), lost without a copy (float8 M = 8 68.3 -> 64.9, int8 float16 x 77.1 -> 74.7);
#     hence _GROUP_ROW_SLACK with the grid's copy only
#   lost where the busiest SM gets more rows still: 10240 rows 96 -> 128 (M = 8 62.2 -> 57.7 / 57.7 ->
#     54.5), 4096 rows 32 -> 64 (4096x14336 M = 8 59.1 -> 49.3); 6144x4096 M = 8 43.0 -> 41.4 / 42.9 ->
#     43.5 (hence N >= 8192).
# Per-row scales at one m tile lost everywhere (28672x8192 M = 8 83.9 -> 79.9, 8192x28672 M = 4
# 83.7 -> 77.6), and so did 64-row tiles (4 warps along K) and 4 CTAs of 4 warps at 8192x28672 (-11..-15),
# and at two m tiles (M = 16) one CTA per SM with 2 row tiles x 2-4 slots (int8 g128 28672x8192 65.3 ->
# 56.4-59.3; two CTAs would need ~144 registers).
GROUP_ROW_TILES_MIN_N = 8192
GROUP_ROW_TILES_MIN_K = 16384   # below it, M >= GROUP_ROW_TILES_MIN_M
GROUP_ROW_TILES_MIN_M = 6
_GROUP_ROW_SLACK = 1.15   # busiest-SM rows the 32-row tiles may add with the grid's copy (28672: 256 / 224)


def _group_row_tiles(cfg: QuantGemvConfig, m: int, n: int, k: int, sm_count: int) -> QuantGemvConfig:
    """``cfg`` with two row tiles of 2 slots where the measured rule above takes them, else ``cfg``."""
    if n < GROUP_ROW_TILES_MIN_N or (k < GROUP_ROW_TILES_MIN_K and m < GROUP_ROW_TILES_MIN_M):
        return cfg
    if cfg.x_grid and cfg.has_zeros and cfg.weight_dtype == "int8":
        # (int8 weights with zero points, through the grid's copy: 32-row tiles spilled 4 bytes under
        # NVRTC 13.0 (the GPU host's), bias or not, group 128; none of the other 96 checked there did)
        return cfg
    two = cfg.replace(row_tiles=2, unroll=2)
    slack = _GROUP_ROW_SLACK if cfg.x_grid else 1.0
    if busiest_sm_rows(two, n, sm_count) > slack * busiest_sm_rows(cfg, n, sm_count):
        return cfg
    return two


def busiest_sm_rows(cfg: QuantGemvConfig, n: int, sm_count: int) -> int:
    """Weight rows that the busiest SM walks under ``cfg``'s persistent grid: CTAs per SM (rounded
    up) x tiles per CTA x rows per tile."""
    t = cfg.tiles(n)
    g = cfg.grid(n, sm_count)[0]
    return -(-g // sm_count) * -(-t // g) * cfg.cta_rows


def resident_warps(cfg: QuantGemvConfig, n: int, sm_count: int) -> int:
    """Warps of ``cfg``'s grid for N = ``n`` (split-K CTAs not counted: the rule runs unsplit)."""
    return cfg.grid(n, sm_count)[0] * cfg.num_warps


def _two_row_tiles(cfg: QuantGemvConfig, n: int, sm_count: int) -> QuantGemvConfig:
    """Of _TWO_ROW_TILES, those keeping _TWO_ROW_TILES_MIN_WARPS of ``cfg``'s resident warps, the one
    whose busiest SM walks the fewest rows (the first of a tie); ``cfg`` where none does."""
    floor = _TWO_ROW_TILES_MIN_WARPS * resident_warps(cfg, n, sm_count)
    best, best_rows = cfg, None
    for v, with_activation in _TWO_ROW_TILES:
        if cfg.activation != "none" and not with_activation:
            continue
        try:
            c = cfg.replace(**v)
        except ConfigError:
            continue
        rows = busiest_sm_rows(c, n, sm_count)
        if resident_warps(c, n, sm_count) >= floor and (best_rows is None or rows < best_rows):
            best, best_rows = c, rows
    return best


def candidate_configs(base: QuantGemvConfig) -> list[QuantGemvConfig]:
    """Tile variants of ``base`` for the benchmark's sweep (same dtypes, widths and epilogue): the
    slots in flight (unroll) for three CTA shapes of 16 warps per SM, then one knob at a time
    around ``base``: 8 warps as 2 x 4 (N x K), 3 CTAs per SM (24 warps, 80 registers), not
    persistent, row_tiles 2."""
    variants = [dict(row_tiles=1, unroll=u, num_warps=nw, warps_k=nw, ctas_per_sm=16 // nw)
                for nw in (8, 4, 16) for u in (2, 4, 6, 8)]
    variants += [dict(num_warps=8, warps_k=4), dict(ctas_per_sm=3, unroll=2), dict(persistent=False),
                 dict(row_tiles=2, unroll=2)]
    if base.n_major:   # 64-row warps: slots x CTAs per SM, warps along K, the split
        splits = sorted({1, max(1, base.split_k // 2), base.split_k, 2 * base.split_k})
        variants = [dict(unroll=u, ctas_per_sm=c, warps_k=wk, split_k=sk)
                    for u, c in ((1, 2), (2, 2), (2, 1), (4, 1), (1, 3)) for wk in (8, 4) for sk in splits]
    out, seen = [], set()
    for v in variants:
        try:
            c = base.replace(**v)
        except ConfigError:
            continue
        if c.key() not in seen:
            seen.add(c.key())
            out.append(c)
    return out


def _vec_width(k: int, ptr: int, stride: int | None, itemsize: int, widest: int) -> int:
    """Widest load (elements) dividing K, the row stride (when rows > 1) and the base address."""
    v = widest
    while v > 1 and (k % v or ptr % (v * itemsize) or (stride is not None and stride % v)):
        v //= 2
    return v




def vec_width(k: int, ptr: int, stride: int | None, itemsize: int, widest: int) -> int:
    """Widest load (elements of ``itemsize`` bytes) dividing K, the row stride (when rows > 1)
    and the base address."""
    return _vec_width(k, ptr, stride, itemsize, widest)


# ---- launch -------------------------------------------------------------------------------------
# The kernel's arrays: (w, x, scales, zeros, bias, out) and the split-K workspace (float32 partials,
# int32 counters; None without split-K); its scalars (M, N, K, ldw, ldx, ldo, ngroups).
def workspace_bytes(cfg: QuantGemvConfig, m: int, n: int) -> tuple[int, int]:
    """(partial bytes, counter bytes) of a launch of ``cfg`` on M x N outputs: (split_k, M, N)
    float32 partials and one counter per (tile, warp along N); (0, 0) without split-K or with a
    cluster split (its sums meet in shared memory); x_grid: the copy's counter pair."""
    if cfg.x_grid:
        return 0, 8
    if cfg.split_k == 1 or cfg.cluster:
        return 0, 0
    return 4 * cfg.split_k * m * n, 4 * cfg.tiles(n) * cfg.warps_n


def half_row_stride(k: int) -> int:
    """The kernels' ``ldh`` argument: K rounded up to 8, the row stride of x_half's float16 copy in the
    workspace (16-byte rows; at two m tiles and one row tile the copy is interleaved instead and ``ldh``
    only says that it exists; :func:`half_copy_elems` sizes both)."""
    return -(-k // 8) * 8


def half_copy_elems(cfg: QuantGemvConfig, k: int) -> int:
    """Halves of x_half's copy in the workspace: per 64-element K block and m tile, 8 rows x 64
    (interleaved for the GEMV's loads at two m tiles and one row tile, the template's xi_offset; rows
    of :func:`half_row_stride` elsewhere, which this holds too: M <= 8 x m_tiles)."""
    return -(-k // 64) * 64 * 8 * cfg.m_tiles


class Workspace(NamedTuple):
    """What a launch keeps in its stream's workspace (ops/workspace.py): byte offsets in the
    partials buffer of the split-K partials, x_half's float16 copy of x and its row multipliers
    (None: not used), that buffer's bytes and the counters' bytes."""
    offsets: tuple
    part_bytes: int
    counter_bytes: int


def workspace(cfg: QuantGemvConfig, m: int, n: int, k: int) -> Workspace | None:
    """The stream workspace of a launch of ``cfg`` on (M, N, K); None where it needs none."""
    part, ctr = workspace_bytes(cfg, m, n)
    copy = cfg.x_copy_in_workspace
    xh = 2 * half_copy_elems(cfg, k) if copy else 0
    offsets, total = carve((part, xh, 4 * m if copy else 0))
    return Workspace(offsets, total, ctr) if total or ctr else None


def _workspace_arrays(ws: Workspace, like, stream, memo: dict | None = None) -> tuple:
    """(partials, counters, x_half's copy, its multipliers): arrays of ``like``'s kind in
    ``stream``'s workspace (None where ``ws`` has none).  ``memo`` keeps the views made of one
    buffer (a plan's replays: the stream's buffers change only when they grow)."""
    dev = like.get_device() if _is_torch(like) else device.current_device()
    parts, counters = stream_workspace(like, dev, stream, ws.part_bytes, ws.counter_bytes)
    key = (id(parts), id(counters))
    hit = memo.get(key) if memo is not None else None
    if hit is not None:
        return hit
    views_ = [None if o is None or parts is None else parts[o:] for o in ws.offsets]
    out = (views_[0], counters, views_[1], views_[2])
    if memo is not None:
        remember(memo, key, out)
    return out


class GemvExtra(NamedTuple):
    """A GEMV plan's workspace and, with x_half, the conversion's plan (its arrays: x, the copy,
    the multipliers), the views of the workspace its replays made, and whether the GEMV makes the
    copy itself (x_grid)."""
    workspace: Workspace | None
    convert: OutputPlan | None
    views: dict
    grid: bool = False


def launch(cfg: QuantGemvConfig, ints: tuple, views_: tuple, arrays: tuple, stream):
    """Launch ``cfg`` on the views (w, x, scales, zeros, bias, out) with the scalars ``ints`` (M, N, K,
    ldw, ldx, ldo, ngroups); returns the launch plan (for :func:`replay`), or None when a view is a
    copy of its array (``arrays``: the caller's, same order), so that replaying would read the wrong
    memory.  Split-K runs in the same launch (the last split of a tile to arrive sums the partials)
    on the stream's workspace; with x_half the conversion runs first, into that workspace, and the
    GEMV reads its copy (:func:`half_copy_elems`)."""
    m, n, k = ints[0], ints[1], ints[2]
    smem = cfg.shared_mem_bytes + cfg.x_shared_bytes(m, k)
    if smem > _SM90_SMEM_MAX:
        raise ConfigError(f"quant_gemv: x_shared=True needs {smem} bytes of shared memory per CTA for M = {m}, K = {k} "
                          f"(at most {_SM90_SMEM_MAX}); pass x_shared=False (the conversion kernel's copy)",
                          field="x_shared", value=True)
    kern = get_kernel(cfg, "quant_gemv")
    sms = device.sm_count()
    grid, block = cfg.grid(n, sms), (cfg.threads_per_block, 1, 1)
    xextra = grid_copy_extra(cfg, m, grid[0], sms)
    grid = (grid[0] + xextra, *grid[1:])
    keep = same_memory(views_, arrays)
    ws = workspace(cfg, m, n, k)
    parts, counters, xh, xscale = (_workspace_arrays(ws, arrays[1], stream) if ws is not None
                                   else (None, None, None, None))
    convert = None
    x = views_[1]
    ldh = half_row_stride(k) if cfg.x_copy_in_workspace else 0
    if ldh and not cfg.x_grid:
        convert = Launch(get_kernel(cfg, "quant_gemv_xhalf"), (m, 1, 1), (X_HALF_THREADS, 1, 1), 0,
                         (k, ints[4], ldh))
        convert.run((x, xh, xscale), stream)
        x, ints = xh, (*ints[:4], ldh, *ints[5:])
    main = Launch(kern, grid, block, smem, (*ints, ldh, xextra))
    main.run((views_[0], x, *views_[2:], parts, counters, *_x_copies(cfg.x_grid, xh, xscale)), stream)
    if not keep:
        return None
    conv_plan = OutputPlan.of(convert, arrays[1]) if convert is not None else None
    return OutputPlan.of(main, arrays[5], extra=GemvExtra(ws, conv_plan, {}, cfg.x_grid), like=arrays[1])


def replay(plan: OutputPlan, inputs: tuple, out, stream):
    """Replay a plan of :func:`launch` on ``inputs`` (w, x, scales, zeros, bias) and ``out``."""
    x = inputs[1]
    out = plan.output(x, out)
    stream = default_stream(x, stream) if plan.torch else stream
    extra = plan.extra
    if extra.workspace is None:
        plan.replay((*inputs, out, None, None, None, None, None), stream)
        return out
    parts, counters, xh, xscale = _workspace_arrays(extra.workspace, x, stream, extra.views)
    if extra.convert is not None:
        extra.convert.replay((x, xh, xscale), stream)
        inputs = (inputs[0], xh, *inputs[2:])
    plan.replay((*inputs, out, parts, counters, *_x_copies(extra.grid, xh, xscale)), stream)
    return out


def grid_copy_extra(cfg: QuantGemvConfig, m: int, tile_ctas: int, sm_count: int) -> int:
    """x_grid's converting CTAs ahead of ``tile_ctas`` (the kernel's xextra): M where the SMs hold
    them beside the tile grid (ctas_per_sm each), so that no tile CTA waits for a slot or converts;
    else 0 (the first tile CTAs convert too).  Measured (H200, 2026-11-28, % of copy, extra CTAs /
    tile CTAs converting, docs/data/gemv_xgrid_extra_ctas_session33_*, gemv_xgrid_ab_session33_*):
    per-row int8 28672x8192 M = 1 / 4 92.1 / 89.8, 89.5 / 89.2; where M more exceed the slots (256
    tile CTAs + 16 of 264) 8 tile CTAs start late: int8 g128 28672x8192 M = 16 60.8 / 66.7."""
    return m if cfg.x_grid and copy_ctas_fit(cfg, m, tile_ctas, sm_count) else 0


def copy_ctas_fit(cfg: QuantGemvConfig, m: int, tile_ctas: int, sm_count: int) -> bool:
    """Whether the SMs hold x_grid's M converting CTAs beside ``tile_ctas`` of ``cfg`` at once."""
    return tile_ctas + m <= sm_count * cfg.ctas_per_sm


def _x_copies(x_grid: bool, xh, xscale) -> tuple:
    """The kernel's (xscale, xcopy, xmul) arrays: the conversion kernel's multipliers (read-only in
    the GEMV), or with x_grid the copy and multipliers the GEMV writes itself."""
    return (None, xh, xscale) if x_grid else (xscale, None, None)
