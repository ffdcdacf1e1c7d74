"""Memory-bound row operations over the last axis: softmax, log-softmax, RMSNorm, LayerNorm, reductions.

>>> y = rtk.softmax(x)                       # also log_softmax=True
>>> y = rtk.rmsnorm(x, weight, eps=1e-6)
>>> y = rtk.layernorm(x, weight, bias, eps=1e-5)
>>> s = rtk.reduce(x, op="argmax")           # "sum" | "max" | "min" | "argmax"

Every op reads float16, bfloat16 or float32 rows and computes in float32.  Any leading shape is
flattened to rows.  Views (:mod:`rtkernels.ops.views`): x is read in place when one row stride
reaches every row (leading dims collapsible, last axis contiguous) - contiguous arrays, row slices
such as ``big[:, :n]``, rows broadcast by ``expand`` (row stride 0) and reversed rows (negative
row stride).  Other views (a strided or broadcast last axis, transposes, overlapping rows) are
copied to a contiguous array on the call's stream first (one extra pass; no launch plan); so are
weight / bias that are not n consecutive elements.  ``out`` must be reachable the same way and
must not alias itself (a broadcast or overlapping out is rejected: its writes would race);
reduce's out must be contiguous.  Elements not aligned to their size are rejected.  Only the last axis
is reduced: ``axis`` must be -1 (or ``ndim - 1``); move the axis yourself (``x.swapaxes(a, -1)``)
for anything else.  bfloat16 travels as torch tensors or as uint16 CuPy arrays with
``dtype="bfloat16"``.

How a row is processed (one config field each, chosen on the host by :func:`plan`):

* ``vec`` - elements per global access: 16 bytes when n, the row strides and every base pointer
  allow, else the widest narrower vector that divides them all (down to scalar).  Softmax (and
  its backward) keep 16 bytes for rows that do not start on 16 (an odd width) when the arrays'
  rows share their addresses mod 16: ``ragged`` rows, a vector body between scalar head and tail.
* ``threads_per_row`` <= 32 - a group of lanes owns a row, several rows per block, no barriers
  (short rows); ``threads_per_row == block_size`` - a block owns a row (warp shuffles + one shared
  memory round); ``cluster_size`` > 1 (sm_90) - a cluster of blocks owns a row and combines the
  block results through distributed shared memory.
* ``vecs_per_thread`` - a compile-time count, so the row lives in a register array indexed only
  by constants: 1 read + 1 write per element.  The tables pick threads and vectors per power of
  two of the row's vectors; on sm_90 they are refitted to the row's own count (:func:`fit_width`).  ``two_pass`` - rows too wide for the registers
  of a block (and, on sm_80, of a cluster) take 2 reads + 1 write: softmax keeps an online
  (max, sum) over the first pass, the norms their statistics.
* ``cluster_push`` (clusters) - each block sends its total to every block of the cluster with
  ``st.async`` onto an mbarrier instead of two cluster barriers per row.  ``smem_rows`` (sm_90) -
  a block's slice of the row lands in shared memory by one bulk copy and is read back from there,
  so registers no longer cap the blocks resident per SM (the 32k-256k defaults on sm_90).

Semantics fixed here: softmax of an all -inf row is 0 (log-softmax -inf); NaN or +inf in a row
makes the row NaN; all-equal rows give exactly fp32(1/n).  LayerNorm uses the biased variance.
``reduce`` returns x's dtype for sum/max/min (sum accumulated in float32) and int64 for argmax
(first occurrence; NaN counts as the maximum, as in NumPy); max/min propagate NaN.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np

from .. import arch as _arch
from ..arch import arch_number
from .. import device, dtypes
from ..config import KernelConfig, register_family
from ..errors import ConfigError
from ..kernel import get_kernel
from . import views
from ._arrays import (Launch, LaunchPlans, OutputPlan, as_device_array, default_stream, device_pointer, dtype_name,
                      empty_as, new_like, same_memory)

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
REDUCE_OPS = ("sum", "max", "min", "argmax")
MAX_WIDTH = 1 << 30   # two_pass handles any width whose element index fits in an int
# dynamic shared memory per block on sm_90, 227 KiB (sm_80: 163 KiB, checked at launch)
_SMEM_MAX = _arch.limits("sm_90").max_smem_per_block_optin


# ---- configs ------------------------------------------------------------------------------
class _ClassOrInstance:
    """A class attribute with a per-instance refinement: ``cls.attr`` is ``class_value``,
    ``config.attr`` is ``fn(config)`` (inspect reads either)."""

    def __init__(self, class_value, fn):
        self.class_value, self.fn = class_value, fn

    def __get__(self, obj, cls=None):
        return self.class_value if obj is None else self.fn(obj)


@dataclass(frozen=True)
class _RowConfig(KernelConfig):
    """Fields shared by the row families; see the module docstring for their meaning."""

    dtype: str = "float16"
    vec: int = 8
    threads_per_row: int = 32
    block_size: int = 128
    vecs_per_thread: int = 4
    cluster_size: int = 1
    min_blocks: int = 1
    cluster_push: bool = False   # cluster rows: block totals pushed with st.async + mbarrier, no cluster barrier
    persistent: bool = False     # one resident wave of blocks (or clusters) walks all rows
    smem_rows: bool = False      # sm_90: a block's slice of the row lands in shared memory by one bulk copy

    def __post_init__(self):
        self._check_dtype("dtype", FLOAT_DTYPES)
        self._check_int("vec", 1, 16 // dtypes.itemsize(self.dtype), power_of_two=True)
        self._check_int("block_size", 32, 1024, power_of_two=True)
        self._check_int("threads_per_row", 1, self.block_size, power_of_two=True)
        if 32 < self.threads_per_row < self.block_size:
            self._fail("threads_per_row", f"a power of two <= 32 (lane groups) or block_size={self.block_size} "
                                          "(a block per row)")
        self._check_int("vecs_per_thread", 1, 32)
        self._check_choice("cluster_size", (1, 2, 4, 8))
        if self.cluster_size > 1 and self.threads_per_row != self.block_size:
            self._fail("cluster_size", f"1 unless threads_per_row == block_size (clusters split whole-block rows; "
                                       f"threads_per_row={self.threads_per_row})")
        for name in ("cluster_push", "persistent", "smem_rows"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "True or False")
        if self.cluster_push and (self.cluster_size == 1 or self.block_size < 64):
            self._fail("cluster_push", f"False unless cluster_size > 1 and block_size >= 64 (cluster_size="
                                       f"{self.cluster_size}, block_size={self.block_size})")
        if self.smem_rows:
            if self.threads_per_row != self.block_size or self.vec * dtypes.itemsize(self.dtype) != 16:
                self._fail("smem_rows", "False unless a block (or cluster) owns each row and vec * itemsize == 16 "
                                        f"(threads_per_row={self.threads_per_row}, vec={self.vec}, {self.dtype})")
            if getattr(self, "two_pass", False) or getattr(self, "prefetch", False) or self.persistent or \
                    getattr(self, "ring_rows", 0) or getattr(self, "bulk_stages", 0):
                self._fail("smem_rows", "False with two_pass, prefetch, persistent, ring_rows or bulk_stages")
            if self.shared_mem_bytes > _SMEM_MAX:
                self._fail("smem_rows", f"False for slices over {_SMEM_MAX} B ({self.shared_mem_bytes} B)")
        self._check_int("min_blocks", 1, 32)
        if self.min_blocks * self.block_size > 2048:
            self._fail("min_blocks", f"at most {2048 // self.block_size} (2048 threads per SM) with "
                                     f"block_size={self.block_size}")
        if getattr(self, "prefetch", False) and getattr(self, "two_pass", False):
            self._fail("prefetch", "False with two_pass (prefetch overlaps whole resident rows)")
        ring, stages = getattr(self, "ring_rows", 0), getattr(self, "bulk_stages", 0)
        if ring or stages:
            name = "ring_rows" if ring else "bulk_stages"
            if ring and stages:
                self._fail("bulk_stages", f"0 when ring_rows={ring} (one staging scheme)")
            if self.vec * dtypes.itemsize(self.dtype) != 16:
                self._fail(name, f"0 unless vec * itemsize == 16 bytes (vec={self.vec}, {self.dtype})")
            if getattr(self, "two_pass", False) or getattr(self, "prefetch", False):
                self._fail(name, "0 with two_pass or prefetch (staging feeds resident rows)")
            if stages and (self.threads_per_row != self.block_size or self.block_size < 64):
                self._fail("bulk_stages", "0 unless a block (>= 64 threads) or cluster owns each row "
                                          f"(threads_per_row={self.threads_per_row}, block_size={self.block_size})")
            if self.shared_mem_bytes > _SMEM_MAX:
                self._fail(name, f"small enough for {_SMEM_MAX} B of shared memory per block "
                                 f"({self.shared_mem_bytes} B requested)")
        if getattr(self, "two_pass", False):
            if self.threads_per_row != self.block_size:
                self._fail("two_pass", "False unless threads_per_row == block_size (two-pass rows are per block)")
            if self.cluster_size != 1:
                self._fail("two_pass", "False when cluster_size > 1 (a cluster holds its row in registers)")

    # Bits per global access intended: 128 for the family, vec * itemsize for one config (a
    # misaligned input's scalar config is narrow on purpose).
    expected_global_width = _ClassOrInstance(128, lambda c: 8 * c.vec * dtypes.itemsize(c.dtype))

    # derived values
    @property
    def threads_per_block(self) -> int:
        return self.block_size

    @property
    def rows_per_block(self) -> int:
        return self.block_size // self.threads_per_row

    @property
    def row_class(self) -> str:
        if getattr(self, "two_pass", False):
            return "two_pass"
        if self.cluster_size > 1:
            return "cluster"
        return "group" if self.threads_per_row <= 32 and self.rows_per_block > 1 else "block"

    @property
    def chunk_elements(self) -> int:
        """Elements one pass of the row's threads covers: the resident capacity of a row."""
        return self.threads_per_row * self.cluster_size * self.vecs_per_thread * self.vec

    @property
    def staged(self) -> bool:
        """Rows loaded ahead through shared memory (ring_rows or bulk_stages)."""
        return bool(getattr(self, "ring_rows", 0) or getattr(self, "bulk_stages", 0))

    @property
    def shared_mem_bytes(self) -> int:
        """Dynamic shared memory at launch: the ring, the bulk stages or the row slice (16-byte vectors)."""
        ring, stages = getattr(self, "ring_rows", 0), getattr(self, "bulk_stages", 0)
        return 16 * self.block_size * self.vecs_per_thread * (ring or stages or int(self.smem_rows))

    @property
    def min_arch(self) -> int:
        return 90 if self.cluster_size > 1 or getattr(self, "bulk_stages", 0) or self.smem_rows else 80

    @property
    def max_registers(self) -> int:
        """Register cap: min_blocks blocks of block_size threads resident per SM (65536 registers,
        allocated per warp in units of 8 per thread)."""
        return min(255, 65536 // (self.block_size * self.min_blocks) // 8 * 8)

    def compile_options(self):
        # A hard register cap instead of __launch_bounds__: with launch bounds ptxas trades a few
        # spilled bytes for one more resident block (seen: 64 registers + 8 B spills at 128
        # threads where 91 registers fit).  The cap keeps min_blocks blocks of block_size resident.
        from ..compiler import CompileOptions
        return CompileOptions(max_registers=self.max_registers)

    def grid(self, rows: int, resident_blocks: int | None = None) -> int:
        """Blocks for `rows` rows (kernels loop over rows, so a capped grid stays correct).

        A prefetching config walks several rows per block: its grid is one resident wave
        (``resident_blocks``: blocks per SM x SMs), or fewer when the rows run out first."""
        if self.threads_per_row < self.block_size:
            blocks = -(-rows // self.rows_per_block)
        else:
            blocks = rows * self.cluster_size
        if (getattr(self, "prefetch", False) or self.staged or self.persistent) and resident_blocks:
            blocks = min(blocks, max(self.cluster_size, resident_blocks // self.cluster_size * self.cluster_size))
        cap = (2 ** 31 - 1) // self.cluster_size * self.cluster_size
        return max(0, min(blocks, cap))


@register_family
@dataclass(frozen=True)
class SoftmaxConfig(_RowConfig):
    """Softmax / log-softmax over rows (templates/softmax.cu.j2)."""

    family: ClassVar[str] = "softmax"
    template: ClassVar[str] = "softmax.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("softmax_rows", "log_softmax_rows")
    two_pass: bool = False
    recompute: bool = False   # resident rows kept packed as loaded; exp() evaluated twice
    prefetch: bool = False    # the next row's loads in flight during this row's reduction
    ring_rows: int = 0        # > 0: loads this many rows per thread ahead through shared memory
    bulk_stages: int = 0      # > 0 (sm_90): row stages per block filled by cp.async.bulk
    streaming: bool = True    # evict-first (.cs) loads and stores of x and y
    # rows not starting on 16 bytes (an odd width): 16-byte vectors from each row's first 16-byte
    # boundary, the head and tail elements as scalars (vector_access decides; x and y rows share
    # their addresses mod 16)
    ragged: bool = False

    def __post_init__(self):
        for name in ("two_pass", "recompute", "prefetch", "streaming", "ragged"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "True or False")
        self._check_int("ring_rows", 0, 8)
        self._check_int("bulk_stages", 0, 8)
        super().__post_init__()
        check_ragged(self)


def check_ragged(cfg) -> None:
    """``ragged`` rows (softmax and its backward) need 16-byte vectors and no rows loaded ahead."""
    if not cfg.ragged:
        return
    if cfg.vec * dtypes.itemsize(cfg.dtype) != 16:
        cfg._fail("ragged", f"False unless vec * itemsize == 16 (vec={cfg.vec}, {cfg.dtype})")
    ahead = [f for f in ("prefetch", "ring_rows", "bulk_stages") if getattr(cfg, f, 0)]
    if ahead:
        cfg._fail("ragged", f"False with {', '.join(ahead)} (ragged rows are resident, two-pass or smem_rows)")


@register_family
@dataclass(frozen=True)
class NormConfig(_RowConfig):
    """RMSNorm / LayerNorm over rows (templates/norm.cu.j2); weight/bias may be wider than x."""

    family: ClassVar[str] = "norm"
    template: ClassVar[str] = "norm.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("rmsnorm_rows", "layernorm_rows")
    weight_dtype: str = "float16"
    two_pass: bool = False
    prefetch: bool = False    # the next row's loads in flight during this row's reduction
    ring_rows: int = 0        # > 0: loads this many rows per thread ahead through shared memory
    bulk_stages: int = 0      # > 0 (sm_90): row stages per block filled by cp.async.bulk
    param_slots: int = 4      # weight (+ bias) vectors loaded at once in the write phase
    streaming: bool = True    # evict-first (.cs) loads and stores of x and y
    stats: bool = False       # also write float32 rstd (and LayerNorm's mean) per row, for the backward

    def __post_init__(self):
        for name in ("two_pass", "prefetch", "streaming", "stats"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "True or False")
        self._check_int("ring_rows", 0, 8)
        self._check_int("bulk_stages", 0, 8)
        self._check_int("param_slots", 1, 8, power_of_two=True)
        super().__post_init__()
        # Same as x, or float32 (mixed precision); other mixes only multiply the compiled variants.
        self._check_dtype("weight_dtype", tuple(dict.fromkeys((self.dtype, "float32"))))


@register_family
@dataclass(frozen=True)
class ReduceConfig(_RowConfig):
    """sum / max / min / argmax over rows (templates/reduce.cu.j2); always one pass."""

    family: ClassVar[str] = "reduce"
    template: ClassVar[str] = "reduce.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("reduce_sum_rows", "reduce_max_rows", "reduce_min_rows",
                                          "reduce_argmax_rows")

    # Loads are vec-wide, but the one result per row is a scalar store: no width to hold it to.
    expected_global_width = None


# ---- heuristics ---------------------------------------------------------------------------
# Reasoned, not yet measured on a GPU (tools/bench_membound.py --sweep measures the alternatives).
#
# Register budget per thread for a resident row: softmax keeps its row as float32 after the exp
# (32 floats: 56-64 registers, log-softmax 71-79 on sm_90); the norms keep the loaded vectors
# packed plus the weight (and bias) vectors of the write phase, so 32 16-bit or 16 32-bit
# elements (RMSNorm 56-80, LayerNorm 87-96 registers).  More per thread buys little: 16-byte
# loads x vecs_per_thread x ~1000 threads per SM keep > 32 KiB in flight per SM, above the
# H100/H200 bandwidth-latency product (~4.2 TB/s x ~0.8 us / 132 SMs ~= 25 KiB).
_ELEMS_PER_THREAD = {"softmax": {2: 32, 4: 32}, "norm": {2: 32, 4: 16}, "reduce": {2: 32, 4: 16}}
# Each slot costs a predicate and address arithmetic besides its data: narrow vectors with 16-32
# slots spill at 512+ threads (seen: 32 scalar slots 84 B, LayerNorm with 16 4-byte slots 8 B).
_MAX_VECS_PER_THREAD = 8
# Threads per block for a block-owned row before splitting the row over a cluster: 256 threads
# (~64 registers) leave 4 blocks per SM, so while one block sits in its reduction barrier the
# others keep loading; a 1024-thread block would be alone on its SM and stall it every row.
_BLOCK_PREFERRED = 256
# Largest block when even a cluster of 8 preferred blocks cannot hold the row (>= 64k elements).
# The norms' weight (+ bias) vectors need 70-80 registers: 1024 threads (64 max) spill.
_BLOCK_MAX = {"softmax": 1024, "norm": 512, "layernorm": 512, "reduce": 512}
# Block rows may load the block's next row before reducing the current one (a persistent grid of
# one resident wave).  Measured (H200, bf16, 2026-11-21, bench_membound.py --sweep): it lost 4-14%
# for softmax and RMSNorm at 4k-8k and won only for LayerNorm at 8k-16k, so it is off by default
# and the measured table below turns it on where it won.
_PREFETCH_BLOCK_ROWS = False
_GROUP_BLOCK = 128   # lane-group rows: 4 warps, 4..128 rows per block
_TWO_PASS_BLOCK = 512


def _SMEM_CLUSTER(cluster: int, blocks_per_sm: int = 6) -> dict:
    """Rows split over `cluster` blocks whose slices land in shared memory, block totals pushed by
    st.async: 256x8 (32 KiB slices) at 40 registers leaves 6 blocks (192 KiB) per SM, 512x8 (64 KiB)
    3 blocks; the register cap keeps that many resident."""
    return dict(cluster_size=cluster, cluster_push=cluster > 1, smem_rows=True, min_blocks=blocks_per_sm,
                param_slots=1)


# Session 3 (H200, 2026-11-21, tools/bench_membound.py --candidates, bf16, 64 MiB, copy 4198-4225
# GB/s): from 32k up a row is split over a cluster of 2-8 blocks whose slices arrive in shared memory
# by one bulk copy each (smem_rows) and whose totals travel by st.async (cluster_push); LayerNorm
# takes its statistics in one pass.  Entries below say which numbers are from which round.
# Measured choices on sm_90 for 2-byte dtypes with 16-byte vectors: (family, layernorm?, vectors
# per row rounded up to a power of two) -> (threads per row = block, vectors per thread, prefetch,
# two_pass[, fields that replace these with 16-bit weights]).  H200, bf16, 64 MiB of x,
# tools/bench_membound.py --quick --sweep (round 0, device copy 4231 GB/s) and --candidates
# (rounds 1-2, 2026-11-21, copy 4187-4220 GB/s; percentages are of that 1 GiB copy).  "cluster" is
# what the reasoned rules below pick; "ring" = ring_rows (rows staged through shared memory).
# Staging (ring_rows / bulk_stages, 1-3 rows ahead, persistent grid) lost 1-6% everywhere except
# RMSNorm 16k, and clusters of 2-8 blocks behind cluster barriers lost 25-60% (round 1): the SM has
# more bytes in flight than the bandwidth-latency product needs; a 64 MiB op is ~32 us and its ramp-up and
# tail cost more than phases inside it (the device copy itself reaches 77% at 64 MiB, rtkernels'
# elementwise 90%; the row ops reach 90-97% of copy at 512 MiB, LayerNorm 64k 72%).
_MEASURED_SM90_16BIT = {
    ("softmax", False, 512): (128, 4, False, False),    # 4k: 3723 GB/s (88.2%) plain hints, 3565 with .cs
    ("softmax", False, 1024): (256, 4, False, False),   # 8k:  3537 (83.9%, round 0, .cs)
    ("softmax", False, 2048): (512, 4, False, False),   # 16k: 3619 (85.8%) plain vs 3468 .cs; cluster x2 2855
    # 32k: as 64k on 2 blocks 3461 (82.4%) vs two passes 3248-3272 (77.4-77.9%), the old 512x8
    # registers-only tile 2675 (63.7%, 128 registers: one block per SM).
    ("softmax", False, 4096): (256, 8, False, False, _SMEM_CLUSTER(2)),
    # 64k (session 3): each of 4 blocks brings its 32 KiB slice in by one bulk copy and reads it
    # back three times (32 registers, 6 blocks per SM), totals pushed by st.async: 3441 (81.7%)
    # vs two passes 3239 (76.9%), registers-only push clusters 3378 (80.2%), barrier clusters
    # (round 0) 2714; a persistent cluster grid lost 14-35%.
    ("softmax", False, 8192): (256, 8, False, False, _SMEM_CLUSTER(4)),
    ("softmax", False, 16384): (256, 8, False, False, _SMEM_CLUSTER(8)),   # 128k: 3425 (81.6%) vs 2635 (62.8%)
    # 256k: 8 blocks of 512x8 with 64 KiB slices (3 per SM) 3116 (74.2%) vs two passes 1024x2 2561
    # (61.0%), barrier clusters (round 1) 1975.
    ("softmax", False, 32768): (512, 8, False, False, _SMEM_CLUSTER(8, blocks_per_sm=3)),
    # RMSNorm 4k: 128x4 3712 (88.0%) vs 256x2 3625 (85.9%); 1k lane groups 89.2% plain vs 87.5% .cs.
    ("norm", False, 512): (128, 4, False, False),
    ("norm", False, 1024): (256, 4, False, False),      # 8k:  3700 (87.7%)
    # 16k: 512x4 rows through a 3-row ring 3567 (84.5%) and 3522 (84.1%) vs two passes 3520 / 3494
    # (83.4%); the ring needs 64 registers (param_slots=1), so float32 weights keep two passes.
    ("norm", False, 2048): (512, 4, False, True, dict(two_pass=False, ring_rows=3, min_blocks=2, param_slots=1)),
    # 32k: 2 blocks 3309 (78.8%), 512x8 in registers 3321, two passes 3292 (all within noise).
    ("norm", False, 4096): (256, 8, False, False, _SMEM_CLUSTER(2)),
    # 64k: slices in shared memory as softmax: 512x4 in 4 blocks 3400 (80.7%), 256x8 x4 3377, 256x4
    # x8 3395 vs two passes 3099 (73.6%) and registers-only push clusters 3269 (77.6%).
    ("norm", False, 8192): (512, 4, False, False, dict(_SMEM_CLUSTER(4), min_blocks=4)),
    # 128k: 256x8 over 8 blocks 3295 (78.5%) vs two passes 2577 (61.4%).
    ("norm", False, 16384): (256, 8, False, False, _SMEM_CLUSTER(8)),
    # 256k: 512x8 over 8 blocks 3168 (75.5%) vs two passes 2441 (58.2%).
    ("norm", False, 32768): (512, 8, False, False, _SMEM_CLUSTER(8, blocks_per_sm=3)),
    # LayerNorm 4k: 128x4 capped at 72 registers (7 blocks per SM), one weight/bias vector at a time:
    # 3556 / 3642 (84.7 / 86.2%, session 3, one-pass statistics) vs 6 blocks with 2 in flight 3519 /
    # 3516 (83.8 / 83.2%); uncapped (96 registers, 5 blocks) 3243-3353 (77-80%).
    ("norm", True, 512): (128, 4, False, False, dict(min_blocks=7, param_slots=1)),
    ("norm", True, 1024): (256, 4, True, False),        # 8k:  3269 (77.5%) vs 2845 without prefetch
    # LayerNorm 16k (session 3, one-pass statistics): 512x4 at 64 registers (2 blocks per SM), one
    # weight/bias vector at a time 3370 / 3406 (80.3 / 80.8%) vs the prefetching 512x4 (127
    # registers, 1 block) 3310 / 3309 (78.9 / 78.5%), slices in shared memory 3128-3191 (74-76%).
    ("norm", True, 2048): (512, 4, False, False, dict(min_blocks=2, param_slots=1)),
    ("norm", True, 4096): (256, 8, False, False, _SMEM_CLUSTER(2)),    # 32k: 3097 (73.8%) vs 2923 (69.6%)
    # 64k: shared-memory slices, 256x8 in 4 blocks 3038 (72.1%) vs two passes 512x2 2851 (67.7%),
    # registers-only push clusters 2791-2833 (66-67%).
    ("norm", True, 8192): (256, 8, False, False, _SMEM_CLUSTER(4)),
    ("norm", True, 16384): (256, 8, False, False, _SMEM_CLUSTER(8)),   # 128k: 3014 (71.8%) vs 2637 (62.8%)
    # 256k: 512x8 over 8 blocks 2828 (67.4%) vs two passes 2368 (56.4%).
    ("norm", True, 32768): (512, 8, False, False, _SMEM_CLUSTER(8, blocks_per_sm=3)),
}
# Plain loads and stores (streaming=False) for resident softmax and RMSNorm rows: +3.7 / +4.4 /
# +4.4% for softmax at 1k / 4k / 16k, +1.9% RMSNorm 1k, +-0 RMSNorm 4k and LayerNorm (kept .cs);
# two-pass rows keep evict-first: without it their second read misses L2 (-10% at 64k).
_PLAIN_HINTS_SM90_16BIT = ("softmax", "rmsnorm")


def _pow2_ceil(v: int) -> int:
    return 1 if v <= 1 else 1 << (int(v) - 1).bit_length()


# ---- widths between powers of two ---------------------------------------------------------------
# The tables above are per power of two of vectors; a row of 5120 16-bit elements (640 vectors)
# took the 8k config (256 threads x 4 vectors = 1024 slots) and left 38% of its slots empty: fewer
# bytes in flight per thread for the same registers and blocks per SM.  The configs are therefore
# refitted to the row (fit_width) where another shape fills it better: power-of-two thread counts
# from the table's down to a warp (the table's own if narrower), at most 1.5x the table's vectors
# per thread and at most 6 (4 -> 6: 48 16-bit elements; 8 stays 8); among the best filled, RMSNorm
# takes the most threads and softmax / LayerNorm / cross-entropy the fewest (their two reductions
# per row cost per thread of the row).  Measured (H200, 2026-11-28, bf16, 64 MiB of x, % of the 1
# GiB copy, table config -> refit, threads x vectors; `row_widths_survey_session30_*`):
#   width    RMSNorm               LayerNorm             softmax
#   1280     87.8 -> 89.7 (32x5)   66.1 -> 85.0          80.9 -> 89.3
#   1536     89.9 -> 89.7 (64x3)   73.4 -> 81.9 (32x6)   87.7 -> 89.7 (32x6)
#   2560     85.8 -> 89.0 (64x5)   69.8 -> 86.0          79.3 -> 89.7
#   3072     90.0 -> 90.7 (128x3)  77.8 -> 83.6 (64x6)   86.6 -> 89.1 (64x6)
#   4608     72.1 -> 88.9 (128x5)  63.1 -> 74.2          73.1 -> 89.8
#   5120     76.4 -> 89.7 (128x5)  66.9 -> 80.0          76.1 -> 88.9
#   6144     82.1 -> 89.6 (256x3)  71.9 -> 82.2 (128x6)  83.9 -> 88.6 (128x6)
#   12288    82.2 -> 83.5 (512x3)  70.7 -> 75.9 (256x6)  79.1 -> 88.2 (256x6)
# (the other tie-break lost up to 12 points: LayerNorm 1280 at 64 x 3 73.1, softmax 12288 at
# 512 x 3 80.2).  Rows at least 7/8 full keep the table's config (3584, 7168, 14336: 7 vectors per
# thread at half the threads lost 1-15 points), as do the powers of two themselves, rows read in
# vectors under 16 bytes (misaligned inputs) and sm_80 (neither measured).
_FIT_MAX_VECS = 6
# Rows in shared memory (smem_rows: each block's slice lands by one bulk copy and registers never hold
# it) may take up to 16 vectors per thread, as cross_entropy's widest slices.  Measured (H200,
# 2026-11-28, bf16, % of the 1 GiB copy, `smem_refit_*`): the refit at the table's threads against
# half of them with twice the vectors: softmax 18944 (2 x 256 x 5 / 2 x 128 x 10) 75.9 / 81.1,
# 151936 (8 x 512 x 5 / 8 x 256 x 10) 68.1 / 75.2, 50264 (4 x 256 x 7 / 4 x 128 x 13) 71.9 / 77.2;
# cross-entropy (loss + grad, 4096 tokens) 151936 65.9 / 83.8, 200064 (8 x 512 x 7 / 8 x 256 x 13)
# 69.7 / 85.8, 50264 74.4 / 83.9.  Blocks per SM (2-11) moved these by under a point.
_FIT_MAX_VECS_SMEM = 16
_FIT_FEWEST_THREADS = ("softmax", "layernorm")   # (cross_entropy.plan passes fewest=True itself)


def _fit_cap(vecs: int, smem_rows: bool = False) -> int:
    """Most vectors per thread a refit may take: 1.5x the table's, at most 6 (the table's 8 stays);
    16 for rows in shared memory."""
    return _FIT_MAX_VECS_SMEM if smem_rows else max(vecs, min(_FIT_MAX_VECS, vecs * 3 // 2))


def _fit_candidates(share: int, threads: int, cap: int):
    """(fill, threads, vectors) of each power-of-two thread count from ``threads`` down to a warp."""
    t = threads
    while t >= min(32, threads):
        v = -(-share // t)
        if v <= cap:
            yield share / (t * v), t, v
        t //= 2


def fit_choice(share: int, threads: int, vecs: int, fewest: bool = False, smem_rows: bool = False) -> tuple[int, int]:
    """(threads, vectors per thread) for a block's ``share`` of a row's vectors, refitted from a
    config of ``threads`` x ``vecs`` (see above): the table's pair unless another fills the row
    better; among the best filled, the fewest threads (``fewest``) or the most."""
    cands = list(_fit_candidates(share, threads, _fit_cap(vecs, smem_rows)))
    best = max(u for u, _, _ in cands)
    if best <= share / (threads * vecs) + 1e-9:
        return threads, vecs
    ties = [(t, v) for u, t, v in cands if u >= best - 1e-9]
    return min(ties) if fewest else max(ties)


def fit_choices(lo: int, hi: int, threads: int, vecs: int, fewest: bool = False,
                smem_rows: bool = False) -> set[tuple[int, int]]:
    """Every :func:`fit_choice` over shares lo..hi: between two shares where some candidate's
    vector count steps (k * t + 1) every candidate's fill scales alike, so one share per interval
    decides (heuristic_configs lists the refitted configs without walking every width)."""
    cap = _fit_cap(vecs, smem_rows)
    points = {lo, hi}
    t = threads
    while t >= min(32, threads):
        points.update(k * t + 1 for k in range(1, cap + 1) if lo < k * t + 1 <= hi)
        t //= 2
    return {fit_choice(p, threads, vecs, fewest, smem_rows) for p in points}


def refit(cfg: KernelConfig, threads: int, vecs: int) -> KernelConfig:
    """``cfg`` with ``threads`` per row and ``vecs`` per thread (and as many threads per block for
    block and cluster rows).  A register cap (min_blocks) keeps its threads per SM, fewer where a
    thread holds more vectors in registers - the same vectors per SM - so that the larger row
    still fits (LayerNorm 4k's 7 x 128 threads at 72 registers: 64 x 6 per row spilled 36 B at 14
    blocks of 64, none at 9); rows in shared memory keep the threads per SM that their slices fit."""
    if (threads, vecs) == (cfg.threads_per_row, cfg.vecs_per_thread):
        return cfg
    fields = dict(threads_per_row=threads, vecs_per_thread=vecs)
    if cfg.row_class != "group":
        fields["block_size"] = threads
        if cfg.min_blocks > 1:
            per_sm = cfg.min_blocks * cfg.block_size
            held = _SMEM_MAX // (16 * threads * vecs) if cfg.smem_rows else \
                per_sm * cfg.vecs_per_thread // (vecs * threads)
            fields["min_blocks"] = max(1, min(2048 // threads, per_sm // threads, held))
    return cfg.replace(**fields)


def _refittable(cfg: KernelConfig) -> bool:
    """Measured only for 16-byte vectors of rows held whole (not reduce's chunks, not two passes)."""
    return cfg.family != "reduce" and not cfg.two_pass and cfg.vec * dtypes.itemsize(cfg.dtype) == 16


def fit_width(cfg: KernelConfig, nvec: int, fewest: bool) -> KernelConfig:
    """``cfg`` (a power-of-two table's row config) refitted to rows of ``nvec`` vectors."""
    if not _refittable(cfg):
        return cfg
    share = -(-nvec // cfg.cluster_size)
    return refit(cfg, *fit_choice(share, cfg.threads_per_row, cfg.vecs_per_thread, fewest, cfg.smem_rows))


def _op_name(family: str, layer: bool) -> str:
    """The op a family's config serves (the norm family serves two, by ``layer``)."""
    return "layernorm" if layer else ("rmsnorm" if family == "norm" else family)


def plan(family: str, n: int, dtype: str, vec: int, arch: str, *, rows: int = 1 << 20, sms: int = 132,
         weight_dtype: str | None = None, layer: bool = False, fit: bool = True) -> KernelConfig:
    """The heuristic config for rows of ``n`` elements accessed ``vec`` at a time.

    The tables pick a config per power of two >= n / vec; ``fit`` (the default) then refits its
    threads and vectors per thread to the row's own vector count (:func:`fit_width`), so widths
    between powers of two fill their registers; ``fit=False`` gives the table's config (the
    benches' A/B).  ``rows`` and ``sms`` matter only to ``reduce``, which spreads a few wide rows
    over a cluster on sm_90.
    """
    size = dtypes.itemsize(dtype)
    exact = -(-n // vec)
    nvec = _pow2_ceil(exact)
    vmax = min(_MAX_VECS_PER_THREAD, max(1, _ELEMS_PER_THREAD[family][size] // vec))
    need = _pow2_ceil(-(-nvec // vmax))          # threads if every thread holds vmax vectors
    hopper = arch_number(arch) >= 90
    common = dict(dtype=dtype, vec=vec)
    if family == "norm":
        common["weight_dtype"] = weight_dtype or dtype
    cfg = _plan(family, size, nvec, vmax, need, hopper, common, rows, sms, layer, vec)
    op = _op_name(family, layer)
    if hopper and size == 2 and op in _PLAIN_HINTS_SM90_16BIT and not getattr(cfg, "two_pass", False):
        cfg = cfg.replace(streaming=False)
    if fit and hopper:
        cfg = fit_width(cfg, exact, op in _FIT_FEWEST_THREADS)
    return cfg


def _plan(family, size, nvec, vmax, need, hopper, common, rows, sms, layer, vec):
    measured = _MEASURED_SM90_16BIT.get((family, layer, nvec)) if hopper and size == 2 and vec == 8 else None
    if measured is not None:
        threads, vecs, prefetch, two_pass = measured[:4]
        fields = dict(threads_per_row=threads, block_size=threads, vecs_per_thread=vecs, prefetch=prefetch,
                      two_pass=two_pass)
        names = {f.name for f in dataclasses.fields(_CONFIG_CLASS[family])}
        extra = {k: v for k, v in (measured[4] if len(measured) > 4 else {}).items() if k in names}
        wide_weights = family == "norm" and dtypes.itemsize(common["weight_dtype"]) > 2
        if wide_weights:
            # float32 weights: the prefetching and register-capped tiles spill (see the table); the
            # row's split over a cluster stays (the tile holds the row only with it).
            fields["prefetch"] = False
            fields.update({k: v for k, v in extra.items()
                           if k in ("cluster_size", "cluster_push", "persistent", "smem_rows")})
        else:
            fields.update(extra)
        return _make(family, common, **fields)
    if need <= 32:                                # (a) a lane group per row
        group = need
        return _make(family, common, threads_per_row=group, block_size=_GROUP_BLOCK,
                     vecs_per_thread=_pow2_ceil(-(-nvec // group)))
    if family == "reduce":
        # One pass whatever the width: a block loops over chunks; few wide rows on sm_90 spread
        # over a cluster so that more SMs pull on one row.
        block = min(need, _BLOCK_PREFERRED)
        cluster = 1
        if hopper and rows < sms:
            cluster = max(1, min(8, need // block, _pow2_floor(max(1, sms // max(rows, 1)))))
        return _make(family, common, threads_per_row=block, block_size=block, vecs_per_thread=vmax,
                     cluster_size=cluster)
    block_max = _BLOCK_MAX["layernorm" if layer else family]
    if need <= _BLOCK_PREFERRED:                  # (b) a block per row, in registers
        return _make(family, common, threads_per_row=need, block_size=need,
                     vecs_per_thread=_pow2_ceil(-(-nvec // need)), prefetch=_PREFETCH_BLOCK_ROWS)
    if hopper and need <= 8 * block_max:          # (b') a cluster per row, in registers
        block = max(_BLOCK_PREFERRED, need // 8)
        # block totals pushed by st.async (no cluster barriers): +15-25% at 64k on an H200, session 3
        return _make(family, common, threads_per_row=block, block_size=block, vecs_per_thread=vmax,
                     cluster_size=need // block, cluster_push=True)
    if need <= block_max:                         # (b'') sm_80: one big block still beats 2 reads
        return _make(family, common, threads_per_row=need, block_size=need, vecs_per_thread=vmax)
    # (c) too wide for registers: two passes over the row.
    return _make(family, common, threads_per_row=_TWO_PASS_BLOCK, block_size=_TWO_PASS_BLOCK,
                 vecs_per_thread=vmax, two_pass=True)


def _pow2_floor(v: int) -> int:
    return 1 << (int(v).bit_length() - 1)


_CONFIG_CLASS = {"softmax": SoftmaxConfig, "norm": NormConfig, "reduce": ReduceConfig}


def _make(family: str, common: dict, **fields) -> KernelConfig:
    return _CONFIG_CLASS[family](**common, **fields)


def heuristic_configs(arch: str) -> list[tuple[str, KernelConfig, tuple[str, ...]]]:
    """Every (family, config, kernels it runs) that :func:`plan` can return for ``arch``: each
    power of two's table config and its refits to the widths below it (:func:`fit_width`).

    Widths beyond 2**20 add nothing: they all take the same two_pass configs.
    """
    seen: dict = {}
    for family in ("softmax", "norm", "reduce"):
        for dtype in FLOAT_DTYPES:
            size = dtypes.itemsize(dtype)
            wdts = tuple(dict.fromkeys((dtype, "float32"))) if family == "norm" else (None,)
            vec = 16 // size
            while vec >= 1:
                k = 0
                while (1 << k) * vec <= 1 << 20:
                    n = (1 << k) * vec
                    for wdt in wdts:
                        for layer in ((False, True) if family == "norm" else (False,)):
                            for rows in ((1, 2, 4, 8, 16, 32, 64, 128, 1 << 20) if family == "reduce"
                                         else (1 << 20,)):
                                base = plan(family, n, dtype, vec, arch, rows=rows, weight_dtype=wdt, layer=layer,
                                            fit=False)
                                names = (("layernorm_rows",) if layer else ("rmsnorm_rows",)) \
                                    if family == "norm" else base.kernels
                                cfgs = _refits(base, k, family, layer, arch)
                                if family == "softmax":
                                    cfgs += ragged_variants(cfgs, k)
                                for cfg in cfgs:
                                    seen.setdefault((family, cfg), set()).update(names)
                    k += 1
                vec //= 2
    return [(family, cfg, tuple(sorted(names))) for (family, cfg), names in seen.items()]


def _refits(base: KernelConfig, k: int, family: str, layer: bool, arch: str) -> list[KernelConfig]:
    """``base`` (the table's config for rows of 2**k vectors) as :func:`plan` refits it for every
    row of 2**(k-1) + 1 .. 2**k vectors."""
    if not _refittable(base) or arch_number(arch) < 90:
        return [base]
    cl = base.cluster_size
    lo, hi = -(-((1 << k) // 2 + 1) // cl), -(-(1 << k) // cl)
    op = _op_name(family, layer)
    return [refit(base, t, v) for t, v in sorted(fit_choices(lo, hi, base.threads_per_row, base.vecs_per_thread,
                                                             op in _FIT_FEWEST_THREADS, base.smem_rows))]


# ---- array plumbing -------------------------------------------------------------------------
def _dtype_of(x, dtype, op: str) -> str:
    dt = dtype_name(x)   # uint16 stays "uint16" (bfloat16 bits with dtype="bfloat16")
    if dtype is not None:
        want = dtypes.canonical(dtype, family=op, field="dtype", allowed=FLOAT_DTYPES)
        if not (dt == want or (dt == "uint16" and want == "bfloat16")):
            raise ConfigError(f"{op}: dtype={dtype!r} does not match the array's dtype {dt} "
                              "(dtype='bfloat16' reads uint16 arrays as bfloat16 bits)",
                              family=op, field="dtype", value=dtype, allowed=", ".join(FLOAT_DTYPES))
        return want
    if dt not in FLOAT_DTYPES:
        raise ConfigError(f"{op}: x has dtype {dt}; allowed: {', '.join(FLOAT_DTYPES)} "
                          "(uint16 bfloat16 bits need dtype='bfloat16')",
                          family=op, field="dtype", value=dt, allowed=", ".join(FLOAT_DTYPES))
    return dt


def _ndim(x) -> int:
    shape = getattr(x, "shape", None)
    if shape is None:
        shape = as_device_array(x, "rtkernels", "x").shape
    return len(shape)


def _check_axis(axis, ndim: int, op: str) -> None:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or axis not in (-1, ndim - 1):
        raise ConfigError(f"{op}: axis={axis!r} is not allowed; axis must be -1 or {ndim - 1} (the last axis). "
                          "For another axis, move it last first (x.swapaxes(axis, -1)).",
                          family=op, field="axis", value=axis, allowed=f"-1, {ndim - 1}")


def _row_layout(v) -> tuple[int, int, int] | None:
    """(rows, n, row stride in elements) when one stride reaches every row, else None."""
    if v.ndim == 0:
        return None
    item = v.itemsize
    shape, strides = v.shape, [s // item for s in v.strides]
    n = int(shape[-1])
    rows = int(math.prod(shape[:-1]))
    if rows == 0 or n == 0:
        # Nothing is read or written; empty arrays carry arbitrary strides (CuPy and DLPack give
        # 0-strides to size-0 dimensions), which would fail the checks below.
        return rows, n, n
    if n > 1 and strides[-1] != 1:
        return None
    lead = [(int(d), int(s)) for d, s in zip(shape[:-1], strides[:-1]) if d != 1]
    if not lead:
        return rows, n, n
    for (_, s0), (d1, s1) in zip(lead, lead[1:]):
        if s0 != s1 * d1:
            return None
    return rows, n, lead[-1][1]


def _rows_of(x, op: str, stream, name: str = "x"):
    """A device view of x and its row layout: x itself when one row stride reaches every row (row
    broadcasts - stride 0 - and negative row strides included: the kernels address row r at
    ``x + r * stride`` in 64-bit integers), else a compact copy made on the call's ``stream``."""
    v = as_device_array(x, op, name)
    if v.ndim == 0:
        raise ConfigError(f"{op}: {name} must have at least one dimension, got a scalar")
    views.check_readable(op, name, views.of(v))
    lay = _row_layout(v)
    if lay is None:
        v = views.compact(v, default_stream(x, stream))   # documented: such views cost one extra copy
        lay = _row_layout(v)
    return v, lay


def _out_rows(out, x, shape, dtype: str, op: str):
    if out is None:
        out = new_like(x, shape, dtype)
    ov = as_device_array(out, op, "out")
    odt = dtype_name(out)
    if tuple(ov.shape) != tuple(shape) or not (odt == dtype or (odt == "uint16" and dtype == "bfloat16")):
        raise ConfigError(f"{op}: out must be a {dtype} array of shape {tuple(shape)}, got {odt} {tuple(ov.shape)}",
                          family=op, field="out", value=f"{odt}{tuple(ov.shape)}", allowed=f"{dtype}{tuple(shape)}")
    info = views.of(ov)
    accepted = "pass a contiguous array or a row slice (a contiguous last axis, rows one stride apart)"
    views.check_output(op, "out", info, accepted)
    lay = _row_layout(ov) if ov.ndim else (1, 1, 1)
    if lay is None:
        raise views.reject(op, "out", info, "cannot be reached with one row stride and a contiguous last axis",
                           accepted)
    return out, ov, lay   # (rows closer than their width overlap: check_output rejected them)


def _pick_vec(size: int, n: int, ptrs, strides) -> int:
    """Widest power-of-two vector (<= 16 bytes) that divides n, every stride and every pointer."""
    vec = 16 // size
    while vec > 1 and (n % vec or any(p % (vec * size) for p in ptrs) or any(s % vec for s in strides)):
        vec //= 2
    return vec


def _access(size: int, n: int, rows: int, ptrs, strides) -> tuple[int, bool]:
    """(the widest vector every row allows (:func:`_pick_vec`), whether the rows can be read ragged
    instead): ragged when that vector is under 16 bytes, the row holds at least 4 16-byte vectors
    (else its edges would be most of it) and every row of every array has the address mod 16 of
    the first array's row (equal bases mod 16, row strides equal mod 16 bytes)."""
    full = 16 // size
    strides = strides if rows > 1 else ()
    vec = _pick_vec(size, n, ptrs, strides)
    if vec == full or n < 4 * full:
        return vec, False
    same = all((p - ptrs[0]) % 16 == 0 for p in ptrs) and all(((s - strides[0]) * size) % 16 == 0 for s in strides)
    return vec, same


def vector_access(size: int, n: int, rows: int, ptrs, strides) -> tuple[int, bool]:
    """(vec, ragged): 16-byte vectors when n, the strides and the pointers allow; else 16-byte
    vectors from each row's first 16-byte boundary with its head and tail as scalars (``ragged``,
    see :func:`_access`); else the widest narrower vector (:func:`_pick_vec`)."""
    vec, ragged = _access(size, n, rows, ptrs, strides)
    return (16 // size if ragged else vec), ragged


def rows_access(size: int, n: int, rows: int, ptrs, strides, config=None) -> tuple[int, int]:
    """(vec, narrow) for an op that reads ragged rows (softmax and its backward): narrow is 0, or
    for ragged rows (:func:`vector_access`) the narrow vector their plan falls back to where its
    config cannot read them ragged (:func:`as_ragged`); a caller's config without ``ragged`` gets
    the narrow vectors (narrow 0)."""
    narrow, ragged = _access(size, n, rows, ptrs, strides)
    if not ragged:
        return narrow, 0
    if config is not None and not getattr(config, "ragged", False):
        return narrow, 0
    return 16 // size, narrow


def _ptr(v) -> int:
    return int(v.data.ptr)


@lru_cache(maxsize=None)
def _arch_info() -> tuple[str, int]:
    arch = device.current_arch()
    sms = device.sm_count() if device.has_gpu() else 132
    return arch, sms


@lru_cache(maxsize=4096)
def _planned(family: str, n_padded: int, dtype: str, vec: int, arch: str, rows_bucket: int, sms: int,
             weight_dtype: str | None, layer: bool, narrow: int = 0) -> KernelConfig:
    """:func:`plan` memoized; ``narrow`` > 0: ragged rows (:func:`rows_access`), read ragged where the
    config can be, else in ``narrow`` vectors (n_padded is then a multiple of narrow too, and of the
    same power-of-two bucket as n)."""
    def planned(v):
        return plan(family, n_padded, dtype, v, arch, rows=rows_bucket, sms=sms, weight_dtype=weight_dtype,
                    layer=layer)
    cfg = planned(vec)
    return ragged_or_narrow(cfg, lambda: planned(narrow)) if narrow else cfg


def ragged_or_narrow(cfg: KernelConfig, narrow_plan) -> KernelConfig:
    """``cfg`` for ragged rows (:func:`as_ragged`), or ``narrow_plan()`` where it cannot be."""
    ragged = as_ragged(cfg)
    return ragged if ragged is not None else narrow_plan()


# Ragged rows' edges cost registers: 1024-thread blocks (64 registers) spilled 8-116 B with them
# (softmax_bwd 8 x 1024 x 4 on sm_90, softmax float32 1024 x 8 on sm_80), and softmax_bwd's 512 x 8
# did too.  Such rows take 512 threads with twice the vectors where that stays within 6 per thread
# (softmax_bwd 8 x 1024 x 3, 151936 columns), else narrow vectors.
RAGGED_MAX_BLOCK = 512


def as_ragged(cfg: KernelConfig) -> KernelConfig | None:
    """A planned softmax (or backward) config for ragged rows (:func:`vector_access`): the same
    shape - the row's body has at most the aligned row's vectors - reading no rows ahead; None
    where no such shape fits the registers (see RAGGED_MAX_BLOCK)."""
    if cfg.block_size > RAGGED_MAX_BLOCK:
        if cfg.two_pass or cfg.vecs_per_thread * 2 > _FIT_MAX_VECS or cfg.row_class == "group":
            return None
        cfg = refit(cfg, RAGGED_MAX_BLOCK, cfg.vecs_per_thread * cfg.block_size // RAGGED_MAX_BLOCK)
    fields = {f: 0 if f != "prefetch" else False for f in ("prefetch", "ring_rows", "bulk_stages")
              if getattr(cfg, f, 0)}
    return cfg.replace(ragged=True, **fields)


def ragged_variants(cfgs, k: int) -> list[KernelConfig]:
    """The configs rows between 2**(k-1) and 2**k vectors read ragged with (odd widths; rows of
    at least 4 vectors, 16-byte ones), for heuristic_configs."""
    wide = [c for c in cfgs if k >= 2 and c.vec * dtypes.itemsize(c.dtype) == 16]
    return [r for r in map(as_ragged, wide) if r is not None]


def check_config_ragged(config, ragged: bool, op: str) -> None:
    """A caller's ragged config needs rows that :func:`vector_access` reads ragged (a config
    without it gets narrow vectors on such rows: :func:`rows_access`)."""
    if getattr(config, "ragged", False) and not ragged:   # ragged: rows_access's narrow > 0
        raise ConfigError(f"{op}: config.ragged=True but these rows are 16-byte aligned, or do not share their "
                          "addresses mod 16 across the arrays", family=op, field="config", value=config,
                          allowed="ragged=False")


def _config_for(family: str, config, n: int, dtype: str, vec: int, rows: int, op: str,
                weight_dtype: str | None = None, layer: bool = False, narrow: int = 0) -> KernelConfig:
    """The caller's config checked against these rows, or the heuristic's (``narrow``: see
    :func:`rows_access`)."""
    arch, sms = _arch_info()
    if config is None:
        # Only reduce looks at rows (fewer rows than SMs); bucket them so the memo stays small.
        rows_bucket = _pow2_floor(max(rows, 1)) if family == "reduce" and rows < sms else 1 << 20
        return _planned(family, -(-n // vec) * vec, dtype, vec, arch, rows_bucket, sms,
                        weight_dtype, layer, narrow)
    if not isinstance(config, _CONFIG_CLASS[family]):
        raise ConfigError(f"{op}: config must be a {_CONFIG_CLASS[family].__name__}, got {type(config).__name__}",
                          family=op, field="config", value=config)
    if family == "softmax":
        check_config_ragged(config, bool(narrow), op)
    if config.dtype != dtype or (weight_dtype and config.weight_dtype != weight_dtype):
        raise ConfigError(f"{op}: config.dtype={config.dtype!r} does not match the input ({dtype})",
                          family=op, field="config", value=config)
    if vec % config.vec:
        raise ConfigError(f"{op}: config.vec={config.vec} needs n, strides and pointers aligned to "
                          f"{config.vec} elements; this input allows vec <= {vec}", family=op, field="config")
    if not getattr(config, "two_pass", True) and config.chunk_elements < n:
        raise ConfigError(f"{op}: config holds {config.chunk_elements} elements per row in registers, the row has "
                          f"{n}; raise vecs_per_thread/threads_per_row/cluster_size or set two_pass=True",
                          family=op, field="config")
    return config


_RESIDENT: dict = {}


def resident_on_device(k, block_size: int, shared_dynamic: int = 0, cluster_size: int = 1) -> int:
    """Blocks (clusters of ``cluster_size`` blocks) of kernel ``k`` resident on the whole device at
    once, from its ptxas resources - for clusters at most what the driver says fits
    (:func:`driver_clusters`); memoized per kernel and launch shape.  Shared by every family that
    sizes a grid of workers to one wave (row ops, their backward, AdamW)."""
    key = (k, block_size, shared_dynamic, cluster_size)
    got = _RESIDENT.get(key)
    if got is None:
        from ..arch import occupancy
        arch, sms = _arch_info()
        r = k.resources
        occ = occupancy(arch, block_size, r.registers, r.shared_static, shared_dynamic, barriers=r.barriers)
        got = max(1, sms * max(1, occ.blocks_per_sm) // cluster_size)
        if cluster_size > 1:
            got = min(got, driver_clusters(k, block_size, shared_dynamic, cluster_size) or got)
        _RESIDENT[key] = got
    return got


def driver_clusters(k, block_size: int, shared_dynamic: int, cluster_size: int) -> int | None:
    """Clusters of ``k`` the current device runs at once (cuOccupancyMaxActiveClusters), or None where
    the driver does not say.  A cluster's blocks share one GPC, so SMs x blocks per SM / cluster can
    overcount: on an H100, 62 four-block clusters of norm_bwd fit where that count gave 66, and the
    extra 4 ran as a second wave (16k norm backward at 49% of copy instead of 74%, 2026-11-25).
    Memoized per kernel, launch shape and device."""
    from .. import device
    try:
        dev = device.current_device()
    except Exception:   # noqa: BLE001 - no GPU: nothing to ask
        return None
    key = (k, block_size, shared_dynamic, cluster_size, dev)
    if key not in _CLUSTERS:
        got = None
        try:
            from cuda.bindings import driver as cu
            fn = k.function(dev)
            if shared_dynamic > 48 * 1024:
                k._raise_smem_limit(fn, dev, shared_dynamic)
            lc = cu.CUlaunchConfig()
            lc.gridDimX, lc.gridDimY, lc.gridDimZ = cluster_size, 1, 1
            lc.blockDimX, lc.blockDimY, lc.blockDimZ = block_size, 1, 1
            lc.sharedMemBytes = shared_dynamic
            lc.numAttrs = 0   # the kernel's own __cluster_dims__
            err, n = cu.cuOccupancyMaxActiveClusters(cu.CUfunction(fn.ptr), lc)
            if err == cu.CUresult.CUDA_SUCCESS and int(n) > 0:
                got = int(n)
        except Exception:   # noqa: BLE001 - an older driver / binding: the block count stands
            got = None
        _CLUSTERS[key] = got
    return _CLUSTERS[key]


_CLUSTERS: dict = {}


def _resident_blocks(k, cfg) -> int | None:
    """Blocks of this kernel resident on the whole device at once (prefetching and staged configs)."""
    if not (getattr(cfg, "prefetch", False) or cfg.staged or cfg.persistent):
        return None
    return resident_on_device(k, cfg.block_size, cfg.shared_mem_bytes)


# ---- per-signature launch plans --------------------------------------------------------------
# The checks and the planning above cost 55-100 us of Python per call (H200 host, 2026-11-21:
# rtk.softmax 61 us, rtk.layernorm 106 us, against 7 us for a CuPy RawKernel launch), which made
# these ops host-bound on any tensor under ~200 MiB of traffic.  Everything they decide depends
# only on the arrays' dtypes, shapes, strides, 16-byte alignment (the vector width) and device,
# plus the op's scalar options, so calls on CuPy arrays or torch tensors remember the decision per
# signature and a later call with the same signature only allocates ``out`` (when not given) and
# launches.  Other array kinds (CAI, DLPack) take the full path every call.
_PLANS = LaunchPlans()


def _launch(key, launch: Launch, views, arrays, stream) -> None:
    """Run ``launch`` on the views (the arrays', output last) and keep it as the signature's plan
    when no view is a copy."""
    launch.run(views, default_stream(arrays[0], stream))
    if key is not None and same_memory(views, arrays):
        _PLANS.put(key, OutputPlan.of(launch, arrays[-1], like=arrays[0]))


def _replay(plan: OutputPlan, inputs: tuple, out, stream, dev: int):
    out = plan.output(inputs[0], out)
    # the launch bound once per plan: a replay passes the arrays' addresses, nothing is converted;
    # a torch plan with no stream given launches on torch's current stream on the key's device
    plan.replay((*inputs, out), stream, None, dev)
    return out


# ---- public ops -------------------------------------------------------------------------------
def softmax(x, axis: int = -1, out=None, log_softmax: bool = False, *, dtype: str | None = None, stream=None,
            config: SoftmaxConfig | None = None):
    """Softmax (or log-softmax) over the last axis.

    Parameters
    ----------
    x : CuPy array / torch tensor / CAI or DLPack object, float16, bfloat16 or float32, any
        leading shape; the last axis holds 1 .. 2**30 elements.  Rows stay on chip (registers, or
        on sm_90 from 32k up shared-memory slices of a cluster; one read) up to 262144 elements on
        sm_90 and 32768 on sm_80 with 16-byte access; wider rows take two reads.  (Norms: 131072 /
        65536 for float32 on sm_90, 16384 / 8192 on sm_80.)
        Views: read in place when one row stride reaches every row (contiguous arrays, row
        slices, rows ``expand``-ed from one row, reversed rows); any other view (a strided or
        broadcast last axis, transposes, overlapping rows) is copied first on the call's stream.
    axis : -1 (or ``x.ndim - 1``) only.
    out : optional array of x's shape and dtype: rows reachable with one row stride, a contiguous
        last axis, no two indices on one element (a broadcast or overlapping out is rejected).
    log_softmax : return ``x - max - log(sum(exp(x - max)))``.
    dtype : ``"bfloat16"`` to read a uint16 CuPy array as bfloat16 bits.
    stream : CuPy stream, torch stream or raw handle (default: CuPy's current stream, or torch's
        current stream when x is a torch tensor).
    config : a :class:`SoftmaxConfig` overriding the heuristic (tuning, benchmarks).

    Returns
    -------
    ``out`` (new if None): same kind of array as ``x``.  All -inf rows give 0 (log: -inf).
    """
    key = _PLANS.key((x, out), ("softmax", bool(log_softmax), axis, dtype, config)) if type(axis) is int else None
    plan = _PLANS.get(key)
    if plan is not None:
        return _replay(plan, (x,), out, stream, key[1])
    op = "log_softmax" if log_softmax else "softmax"
    dt = _dtype_of(x, dtype, op)
    _check_axis(axis, _ndim(x), op)
    xv, (rows, n, xs) = _rows_of(x, op, stream)
    _check_width(n, op)
    out, ov, (_, _, ys) = _out_rows(out, x, xv.shape, dt, op)
    if rows == 0 or n == 0:
        return out
    size = dtypes.itemsize(dt)
    ptrs, strides = (_ptr(xv), _ptr(ov)), (xs, ys)
    vec, narrow = rows_access(size, n, rows, ptrs, strides, config)
    cfg = _config_for("softmax", config, n, dt, vec, rows, op, narrow=narrow)
    k = get_kernel(cfg, "log_softmax_rows" if log_softmax else "softmax_rows")
    _launch(key, Launch(k, (cfg.grid(rows, _resident_blocks(k, cfg)),), (cfg.block_size,), cfg.shared_mem_bytes,
                        (rows, n, xs, ys)), (xv, ov), (x, out), stream)
    return out


def rmsnorm(x, weight, eps: float = 1e-6, out=None, *, dtype: str | None = None, stream=None,
            config: NormConfig | None = None, return_stats: bool = False):
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last axis.

    Parameters
    ----------
    x : float16 / bfloat16 / float32 array, any leading shape (see :func:`softmax`).
    weight : ``n`` elements, float16 / bfloat16 / float32 (may differ from x's dtype); a view that is
        not n consecutive elements (``expand``-ed, strided) is copied first.
    eps, out, dtype, stream, config : as in :func:`softmax` (config: a :class:`NormConfig`).
    return_stats : also return ``rstd`` = ``rsqrt(mean(x**2) + eps)``, float32 of shape
        ``x.shape[:-1]`` (what :func:`rmsnorm_backward` takes).  Written by the same kernel (its
        ``stats=True`` variant); without it the kernel is the one that writes y alone.

    Returns
    -------
    ``y``, or ``(y, rstd)`` with ``return_stats``.
    """
    return _norm("rmsnorm", x, weight, None, eps, out, dtype, stream, config, return_stats)


def layernorm(x, weight, bias, eps: float = 1e-5, out=None, *, dtype: str | None = None, stream=None,
              config: NormConfig | None = None, return_stats: bool = False):
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the last axis (biased variance).

    Parameters
    ----------
    x : float16 / bfloat16 / float32 array, any leading shape (see :func:`softmax`).
    weight, bias : ``n`` elements each, one dtype (may differ from x's); other views copied first.
    eps, out, dtype, stream, config : as in :func:`softmax` (config: a :class:`NormConfig`).
    return_stats : also return ``mean`` and ``rstd`` = ``rsqrt(var + eps)``, float32 of shape
        ``x.shape[:-1]`` each (what :func:`layernorm_backward` takes).

    Returns
    -------
    ``y``, or ``(y, mean, rstd)`` with ``return_stats``.
    """
    return _norm("layernorm", x, weight, bias, eps, out, dtype, stream, config, return_stats)


def _norm(op, x, weight, bias, eps, out, dtype, stream, config, return_stats=False):
    inputs = (x, weight) if bias is None else (x, weight, bias)
    if return_stats:
        return _norm_with_stats(op, inputs, eps, out, dtype, stream, config)
    key = _PLANS.key(inputs + (out,), (op, eps, dtype, config)) if type(eps) is float else None
    plan = _PLANS.get(key)
    if plan is not None:
        return _replay(plan, inputs, out, stream, key[1])
    launch, views, out = _norm_launch(op, inputs, eps, out, dtype, config, stats=False, stream=stream)
    if launch is not None:
        _launch(key, launch, views, (*inputs, out), stream)
    return out


def _norm_with_stats(op, inputs, eps, out, dtype, stream, config):
    """The forward that also writes float32 (mean,) rstd per row; a plan per signature like
    :func:`_norm`'s (its record keeps the statistics' shape and array kind)."""
    x = inputs[0]
    nstats = 2 if op == "layernorm" else 1
    key = _PLANS.key(inputs + (out,), (op + "+stats", eps, dtype, config)) if type(eps) is float else None
    plan = _PLANS.get(key)
    if plan is not None:
        out = plan.output(x, out)
        stats = [empty_as(x, plan.extra, _float32_of(x)) for _ in range(nstats)]
        if plan.torch:
            dev = x.get_device()
            plan.launch.run([device_pointer(a, dev) for a in (*inputs, out, *stats)], default_stream(x, stream))
        else:
            plan.launch.run((*inputs, out, *stats), stream)
        return (out, *stats)
    launch, views, out = _norm_launch(op, inputs, eps, out, dtype, config, stats=True, stream=stream)
    shape = tuple(views[0].shape[:-1]) if launch is not None else tuple(_shape_of(x)[:-1])
    stats = [empty_as(x, shape, _float32_of(x)) for _ in range(nstats)]
    if launch is None:
        return (out, *stats)
    svs = [as_device_array(s, op, "stats") for s in stats]
    views = (*views, *svs)
    launch.run(views, default_stream(x, stream))
    if key is not None and same_memory(views, (*inputs, out, *stats)):
        _PLANS.put(key, OutputPlan.of(launch, out, extra=shape))
    return (out, *stats)


def _float32_of(x):
    """float32 as the dtype object of x's array library (torch or CuPy)."""
    if type(x).__module__.startswith("torch"):
        import torch
        return torch.float32
    return np.float32


def _shape_of(x):
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else tuple(as_device_array(x, "rtkernels", "x").shape)


def _norm_launch(op, inputs, eps, out, dtype, config, stats: bool, stream=None):
    """Checks, output and the Launch of a norm forward: (launch or None when empty, views
    (x, weight[, bias], out), out).  ``stats``: the kernel variant that writes the statistics."""
    x, weight = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    dt = _dtype_of(x, dtype, op)
    xv, (rows, n, xs) = _rows_of(x, op, stream)
    _check_width(n, op)
    params = []
    wdt = None
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None and name == "bias" and op == "rmsnorm":
            continue
        if p is None:
            raise ConfigError(f"{op}: {name} is required", family=op, field=name)
        pv = as_device_array(p, op, name)
        pdt = dtype_name(p)
        if pdt == "uint16" and dt == "bfloat16":
            pdt = "bfloat16"
        if pdt not in FLOAT_DTYPES:
            raise ConfigError(f"{op}: {name} has dtype {pdt}; allowed: {', '.join(FLOAT_DTYPES)}",
                              family=op, field=name, value=pdt, allowed=", ".join(FLOAT_DTYPES))
        if wdt is not None and pdt != wdt:
            raise ConfigError(f"{op}: weight and bias must share a dtype, got {wdt} and {pdt}", family=op, field=name)
        if pdt not in (dt, "float32"):
            raise ConfigError(f"{op}: {name} has dtype {pdt}; with {dt} x it must be {dt} or float32",
                              family=op, field=name, value=pdt, allowed=f"{dt}, float32")
        wdt = pdt
        if pv.size != n:
            raise ConfigError(f"{op}: {name} must hold {n} elements (x.shape[-1]), got shape {pv.shape}",
                              family=op, field=name, value=tuple(pv.shape), allowed=f"({n},)")
        # read as n consecutive elements: any other view (expanded, strided) is copied, n elements
        pv, _ = views.read_view(op, name, pv, default_stream(x, stream), lambda i: i.kind == views.CONTIGUOUS)
        params.append(pv)
    if not isinstance(eps, (int, float, np.floating)) or isinstance(eps, bool) or not eps >= 0:
        raise ConfigError(f"{op}: eps={eps!r} is not allowed; eps must be a float >= 0", family=op, field="eps")
    out, ov, (_, _, ys) = _out_rows(out, x, xv.shape, dt, op)
    if rows == 0 or n == 0:
        return None, (xv, *params, ov), out
    size = dtypes.itemsize(dt)
    vec = _pick_vec(size, n, (_ptr(xv), _ptr(ov)), (xs, ys) if rows > 1 else ())
    wsize = dtypes.itemsize(wdt)
    while vec > 1 and any(_ptr(p) % min(16, vec * wsize) for p in params):
        vec //= 2   # weights load in pieces of at most 16 bytes
    cfg = _config_for("norm", config, n, dt, vec, rows, op, weight_dtype=wdt, layer=op == "layernorm")
    if stats:
        cfg = cfg.replace(stats=True)
    k = get_kernel(cfg, op + "_rows")
    launch = Launch(k, (cfg.grid(rows, _resident_blocks(k, cfg)),), (cfg.block_size,), cfg.shared_mem_bytes,
                    (rows, n, xs, ys, float(eps)))
    return launch, (xv, *params, ov), out


def reduce(x, op: str = "sum", axis: int = -1, *, out=None, dtype: str | None = None, stream=None,
           config: ReduceConfig | None = None):
    """Reduce the last axis: ``"sum"``, ``"max"``, ``"min"`` (x's dtype) or ``"argmax"`` (int64).

    Sum accumulates in float32 and rounds once to x's dtype (float16 sums beyond 65504 give inf).
    max/min propagate NaN; argmax gives the first maximum, and a row with NaN gives its first NaN
    (NumPy's rules).  The result has shape ``x.shape[:-1]``; ``out`` must be contiguous.  Other
    parameters (and the views of x read in place or copied) as in :func:`softmax`.
    """
    if op not in REDUCE_OPS:
        raise ConfigError(f"reduce: op={op!r} is not allowed; op must be one of {', '.join(map(repr, REDUCE_OPS))}",
                          family="reduce", field="op", value=op, allowed=", ".join(REDUCE_OPS))
    key = _PLANS.key((x, out), ("reduce", op, axis, dtype, config)) if type(axis) is int else None
    plan = _PLANS.get(key)
    if plan is not None:
        return _replay(plan, (x,), out, stream, key[1])
    name = f"reduce({op})"
    dt = _dtype_of(x, dtype, name)
    _check_axis(axis, _ndim(x), name)
    xv, (rows, n, xs) = _rows_of(x, name, stream)
    _check_width(n, name)
    if n == 0:
        raise ConfigError(f"{name}: the last axis is empty; a reduction needs at least one element",
                          family="reduce", field="x", value=tuple(xv.shape))
    odt = "int64" if op == "argmax" else dt
    shape = xv.shape[:-1]
    out, ov, _ = _out_rows(out, x, shape, odt, name)
    if not ov.flags.c_contiguous:   # one result per row, written at out[row]
        raise views.reject(name, "out", views.of(ov), "is not contiguous", "pass a contiguous array")
    if rows == 0:
        return out
    size = dtypes.itemsize(dt)
    vec = _pick_vec(size, n, (_ptr(xv),), (xs,) if rows > 1 else ())
    cfg = _config_for("reduce", config, n, dt, vec, rows, name)
    k = get_kernel(cfg, f"reduce_{op}_rows")
    _launch(key, Launch(k, (cfg.grid(rows),), (cfg.block_size,), 0, (rows, n, xs)), (xv, ov), (x, out), stream)
    return out


def _check_width(n: int, op: str) -> None:
    if n > MAX_WIDTH:
        raise ConfigError(f"{op}: x.shape[-1]={n} is not allowed; the last axis must have at most {MAX_WIDTH} "
                          "elements", family=op, field="x.shape[-1]", value=n, allowed=f"[1, {MAX_WIDTH}]")


# ---- float64 references (host, NumPy) ------------------------------------------------------------
def softmax_reference(x: np.ndarray, log_softmax: bool = False) -> np.ndarray:
    """float64 softmax over the last axis with this module's conventions (all -inf row -> 0 / -inf)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    all_ninf = m == -np.inf
    m_ref = np.where(all_ninf, 0.0, m)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        d = x - m_ref
        s = np.sum(np.exp(d), axis=-1, keepdims=True)
        if log_softmax:
            y = d - np.log(s)
            return np.where(all_ninf, -np.inf, y)
        y = np.exp(d) / s
        return np.where(all_ninf, 0.0, y)


def rmsnorm_reference(x: np.ndarray, weight: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def layernorm_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.asarray(weight, np.float64) + np.asarray(bias, np.float64)


def reduce_reference(x: np.ndarray, op: str = "sum") -> np.ndarray:
    """float64 sum / max / min (NaN-propagating) or int64 argmax (first occurrence, NaN first)."""
    x = np.asarray(x, dtype=np.float64)
    if op == "sum":
        return np.sum(x, axis=-1)
    if op == "max":
        return np.max(x, axis=-1)
    if op == "min":
        return np.min(x, axis=-1)
    if op == "argmax":
        return np.argmax(x, axis=-1).astype(np.int64)
    raise ConfigError.bad_value("reduce", "op", op, "one of " + ", ".join(REDUCE_OPS))


__all__ = ["softmax", "rmsnorm", "layernorm", "reduce", "SoftmaxConfig", "NormConfig", "ReduceConfig", "plan",
           "softmax_reference", "rmsnorm_reference", "layernorm_reference", "reduce_reference"]
