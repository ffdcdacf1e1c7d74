"""Backward of the row ops: RMSNorm / LayerNorm (dx, dweight, dbias) and softmax / log-softmax (dx).

>>> y, rstd = rtk.rmsnorm(x, w, return_stats=True)
>>> dx, dw = rtk.rmsnorm_backward(dy, x, w, rstd)                   # rstd=None: recomputed (eps=...)
>>> y, mean, rstd = rtk.layernorm(x, w, b, return_stats=True)
>>> dx, dw, db = rtk.layernorm_backward(dy, x, w, b, mean, rstd)
>>> dx = rtk.softmax_backward(dy, y)                                 # log=True: y is log_softmax's output

Same conventions as the forward (``rowwise``): float16 / bfloat16 / float32 rows over the last axis,
any leading shape, rows reachable with one row stride (other views are copied), float32 math;
weights of x's dtype or float32.  The row machinery is the forward's: lane groups, a block or (sm_90)
a cluster of blocks per row, chosen on the host by :func:`plan_bwd` (same config fields as the
forward: ``vec``, ``threads_per_row``, ``block_size``, ``vecs_per_thread``, ``cluster_size``,
``cluster_push``, ``two_pass``; the norm backward's workers also ``ring_rows`` / ``prefetch``: the
next rows in flight through a shared-memory ring or a second register set while one row is
reduced and written, or (sm_90) ``bulk_rows``: the next rows of each row team in shared-memory
stages filled by cp.async.bulk, and ``blocks_per_sm`` / ``balance``: how many workers walk the rows).

dweight / dbias are **deterministic**: the rows kernel runs one resident wave of workers, each
adding its rows' ``dy * xhat`` (and ``dy``) into float32 registers for the columns it owns and
writing one float32 partial row; the partial rows of each column are summed in a fixed order and
rounded once to the weight's dtype - by the rows kernel itself after a grid-wide barrier
(``fold_colsum``: a cooperative launch, so that every worker is resident; where the driver refuses
it, the two kernels run instead; the default for block and cluster rows) or by a second kernel (the
default for lane-group rows). The bits depend on the grid (the SM count
and the config) and on which of the two sums them, so they repeat run to run on one GPU model. Extra
memory: ``2 * parts * n`` float32 (LayerNorm; RMSNorm half), parts = workers / merge_cluster, e.g.
132 x 4096 columns = 2.2 MB. There is no atomics mode. The rows kernel's column sums may live in
shared memory (``acc_smem``), the workers of a cluster may merge theirs on chip before writing
(``merge_cluster``), and the kernel for the saved statistics is compiled apart from the one that
recomputes them (``split_stats``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np

from .. import dtypes
from ..arch import arch_number
from ..config import KernelConfig, register_family
from ..errors import ConfigError, LaunchError
from ..kernel import get_kernel
from . import rowwise as rw
from ._arrays import (Launch, LaunchPlans, OutputPlan, _is_torch, as_device_array, default_stream, device_pointer,
                      dtype_name, empty_as, new_like, same_memory)
from .rowwise import FLOAT_DTYPES, _RowConfig
from .workspace import stream_workspace


# ---- configs ----------------------------------------------------------------------------------
def _check_plain_rows(cfg: _RowConfig) -> None:
    """The forward's staging knobs do not exist in the backward kernels (two input streams)."""
    for name in ("smem_rows", "persistent"):
        if getattr(cfg, name):
            cfg._fail(name, f"False ({cfg.family} keeps its rows in registers; the norm backward's grid is "
                            "always one resident wave)")


@dataclass(frozen=True)
class _BwdRowConfig(_RowConfig):
    """What the backward row families share: the two-pass switch and streaming stores, and no
    forward staging knobs."""

    def __post_init__(self):
        for name in ("two_pass", "streaming"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "True or False")
        super().__post_init__()
        _check_plain_rows(self)


@register_family
@dataclass(frozen=True)
class NormBwdConfig(_BwdRowConfig):
    """RMSNorm / LayerNorm backward (templates/norm_bwd.cu.j2): the rows kernel and the
    column sum of its partial dweight / dbias rows."""

    family: ClassVar[str] = "norm_bwd"
    template: ClassVar[str] = "norm_bwd.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("rmsnorm_bwd_rows", "layernorm_bwd_rows", "rmsnorm_bwd_rows_recompute",
                                          "layernorm_bwd_rows_recompute", "norm_bwd_colsum")
    weight_dtype: str = "float16"
    two_pass: bool = False
    streaming: bool = True    # evict-first (.cs) loads of dy, x and stores of dx
    # How a worker keeps its next rows in flight while it reduces and writes one (resident rows):
    prefetch: bool = False    # the next row's dy, x (and statistics) in a second register set
    ring_rows: int = 0        # > 0: this many rows ahead through shared memory (cp.async, 16-byte vectors)
    blocks_per_sm: int = 0    # > 0: at most this many worker blocks per SM (fewer partial rows); 0: all resident
    # The fewest workers that take no more rows each than a full wave would (8192 rows on 264
    # resident workers: 256 x 32 rows, not 264 with 8 of them walking a 32nd row alone at the end):
    # the same rows per worker on the critical path, no latency-bound last row, fewer partial rows.
    balance: bool = True
    # The float32 dweight / dbias column sums of resident rows in this thread's words of shared
    # memory instead of 16-32 registers held across the row loop (see _NORM_BWD_ACC_SMEM).
    acc_smem: bool = False
    # > 1 (sm_90, acc_smem, lane-group or block rows): clusters of this many independent workers
    # whose sums block 0 adds through distributed shared memory at the end: one partial row (two
    # for LayerNorm) per cluster instead of per block (see _NORM_BWD_MERGE).
    merge_cluster: int = 1
    # *_bwd_rows compiled for the saved statistics only (the recompute path in its own kernel,
    # *_bwd_rows_recompute); False: one kernel with both paths, as the first version (its registers).
    split_stats: bool = True
    # > 0 (sm_90): each row team (lane group, block, a cluster row's block) keeps this many of its
    # next rows in flight in shared-memory stages filled by cp.async.bulk - one lane per team
    # issues them, completion on an mbarrier per stage (see the template's BwdBulk).
    bulk_rows: int = 0
    # The column sums in the rows kernel (launched cooperatively: a grid-wide barrier after the
    # partial rows, then every block sums column tiles of them from L2) instead of the second
    # kernel norm_bwd_colsum; the host falls back to the two kernels where the driver refuses the
    # cooperative grid (see _NORM_BWD_FOLD and the template's fold_colsum).
    fold_colsum: bool = False
    # fold_colsum: drop each summed 128-byte line of partial rows from L2 (discard.global.L2) so
    # that the partial rows are never written back to DRAM.
    discard_partials: bool = True
    # Resident rows: each thread's weight vectors loaded once before the row loop and held packed in
    # registers (vecs_per_thread x 16 bytes), instead of loaded from L1 twice per row (_NORM_BWD_HOLD_W:
    # the heuristic's choice for resident rows).
    hold_weight: bool = False

    def __post_init__(self):
        for name in ("prefetch", "balance", "acc_smem", "split_stats", "fold_colsum", "discard_partials",
                     "hold_weight"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "True or False")
        self._check_int("ring_rows", 0, 8)
        self._check_int("blocks_per_sm", 0, 32)
        self._check_int("bulk_rows", 0, 4)
        super().__post_init__()
        if self.bulk_rows:
            if self.vec * dtypes.itemsize(self.dtype) != 16:
                self._fail("bulk_rows", f"0 unless vec * itemsize == 16 bytes (vec={self.vec}, {self.dtype})")
            if self.two_pass or self.prefetch or self.ring_rows:
                self._fail("bulk_rows", f"0 with two_pass, prefetch or ring_rows (two_pass={self.two_pass}, "
                                        f"prefetch={self.prefetch}, ring_rows={self.ring_rows})")
        self._check_dtype("weight_dtype", tuple(dict.fromkeys((self.dtype, "float32"))))
        self._check_choice("merge_cluster", (1, 2, 4, 8))
        if self.merge_cluster > 1 and (not self.acc_smem or self.cluster_size > 1 or self.two_pass):
            self._fail("merge_cluster", f"1 unless acc_smem=True with lane-group or block rows (acc_smem="
                                        f"{self.acc_smem}, cluster_size={self.cluster_size}, two_pass={self.two_pass})")
        if self.hold_weight and self.two_pass:
            self._fail("hold_weight", "False with two_pass (a two-pass thread walks many columns)")
        if self.acc_smem and self.two_pass:
            self._fail("acc_smem", "False with two_pass (its chunk's sums are in registers already)")
        if self.shared_mem_bytes > rw._SMEM_MAX:
            self._fail("bulk_rows" if self.bulk_rows else "acc_smem" if self.acc_smem else "ring_rows",
                       f"a setting that needs at most {rw._SMEM_MAX} B of shared memory per block "
                       f"({self.shared_mem_bytes} B requested)")
        if self.blocks_per_sm and self.blocks_per_sm * self.block_size > 2048:
            self._fail("blocks_per_sm", f"at most {2048 // self.block_size} (2048 threads per SM) with "
                                        f"block_size={self.block_size}, or 0")

    @property
    def shared_mem_bytes(self) -> int:
        """Dynamic shared memory: ring_rows stages of dy and x (16 bytes per slot each) and the
        saved statistics (two floats per thread), or bulk_rows stages of dy and x; then with acc_smem the dweight and dbias sums
        (float32, vecs_per_thread * vec per thread each; RMSNorm's kernel leaves the dbias half
        unused - one size for the config's kernels)."""
        ring = self.ring_rows * self.block_size * (32 * self.vecs_per_thread + 8)
        ring += self.bulk_rows * self.block_size * 32 * self.vecs_per_thread   # dy and x per stage
        return ring + (8 * self.block_size * self.vecs_per_thread * self.vec if self.acc_smem else 0)

    @property
    def min_arch(self) -> int:
        return 90 if self.merge_cluster > 1 or self.bulk_rows else super().min_arch

    @property
    def launch_cluster(self) -> int:
        """Blocks per cluster at launch: a row's cluster, or merge_cluster workers."""
        return self.cluster_size * self.merge_cluster


@register_family
@dataclass(frozen=True)
class SoftmaxBwdConfig(_BwdRowConfig):
    """Softmax / log-softmax backward (templates/softmax_bwd.cu.j2)."""

    family: ClassVar[str] = "softmax_bwd"
    template: ClassVar[str] = "softmax_bwd.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("softmax_bwd_rows", "log_softmax_bwd_rows")
    two_pass: bool = False
    streaming: bool = True    # evict-first (.cs) loads of dy, y and stores of dx
    ragged: bool = False      # rows not starting on 16 bytes: rowwise.SoftmaxConfig.ragged

    def __post_init__(self):
        if not isinstance(self.ragged, bool):
            self._fail("ragged", "True or False")
        super().__post_init__()
        rw.check_ragged(self)


# ---- heuristics -------------------------------------------------------------------------------
# Elements of each input a thread holds per row.  softmax_bwd keeps dy and y packed (32 16-bit
# elements of each = 32 registers, the forward norms' footprint).  norm_bwd also keeps two float32
# accumulators per element it owns (dweight, dbias): 16 elements -> 16 packed + 32 accumulator
# registers + the weight vectors, ~90-110 registers; 2-3 blocks of 256 per SM, which at 64 B of
# loads per thread in flight still keeps ~32 KiB per SM in flight (the bandwidth-latency product
# is ~25 KiB per SM on H100/H200, rowwise.py).
_BWD_ELEMS_PER_THREAD = {"softmax_bwd": {2: 32, 4: 16}, "norm_bwd": {2: 16, 4: 8}}
# norm_bwd writes one float32 partial row (two for LayerNorm) per resident worker, P * n * 8 bytes
# against rows * n * 6 of dy, x and dx: with a block per row of 1k elements (64 threads) P would be
# ~1300 (10 MB, ~11% of a 64 MiB case).  Short rows therefore go to lane groups holding 32 16-bit
# elements of each input (110-160 registers: 3 blocks of 128 threads per SM, P ~ 400, 3 MB at 1k;
# 256-thread blocks would halve P but leave one block, 32 KiB of loads in flight, per SM).
_BWD_GROUP_ELEMS = {"softmax_bwd": {2: 32, 4: 16}, "norm_bwd": {2: 32, 4: 16}}
_BWD_GROUP_BLOCK = {"softmax_bwd": 128, "norm_bwd": 128}
_BWD_BLOCK_PREFERRED = 256     # as the forward: 4 blocks per SM overlap one block's barrier
_BWD_BLOCK_MAX = {"softmax_bwd": 1024, "norm_bwd": 512}   # norm_bwd: 128 registers at 512 threads
_BWD_TWO_PASS_BLOCK = 256
# norm_bwd's resident workers walk their rows (the grid is one wave, for the partial dweight rows),
# so nothing overlaps a row's reduction and stores but what the worker itself keeps in flight.
# Measured (H100, 2026-11-25, bench_training.py --quick --variants, bf16, 192 MiB per case, % of a
# 1 GiB copy, RMSNorm / LayerNorm at 1k, 4k, 16k):
#   direct loads, balanced workers   82.1 / 82.7   80.6 / 69.4   74.1 / 61.8
#   prefetch (second register set)   83.8 / 79.0   76.7 / 70.1   72.1 / 66.5
#   ring of 2 rows (cp.async, smem)  80.7 / 74.2   73.4 / 67.0   67.3 / 60.0
#   ring 3 / ring 3-4 at 1 block/SM  78.9 / 74.1   74.2 / 65.1   ~57 / ~48
# (the first version, before the cluster grid was sized by cuOccupancyMaxActiveClusters: 49 / 46% at
# 16k - 66 clusters launched where 62 fit, a second wave).  Loading ahead does not pay: 2-3 resident
# workers per SM already overlap each other's rows, and the ring's shared-memory round trip costs
# more than it hides.  Direct loads everywhere; ring_rows / prefetch stay as tuning knobs.
# Per row class (lane groups, a block, a cluster per row):
_NORM_BWD_RING_ROWS = {"group": 0, "block": 0, "cluster": 0}
_NORM_BWD_BLOCKS_PER_SM = {"group": 0, "block": 0, "cluster": 0}   # 0: every block that fits
# Occupancy is what the rows kernel lacks (ncu, H200, 2026-11-25: 8192 x 16384 RMSNorm / LayerNorm
# at 53% / 43% of DRAM peak with 2 blocks of 256 per SM - register-limited, 25% occupancy, 0.56
# eligible warps per scheduler, 58% of stalls on global loads; 32768 x 4096 RMSNorm at 79% with 3).
# Knobs that buy blocks per SM: the saved-statistics kernel without the recompute path
# (split_stats, 7-14 registers), the dweight / dbias sums in shared memory (acc_smem, 8-32), a
# 64-register cap (min_blocks), and merge_cluster (sm_90: 4 workers sum their partial rows on chip,
# so more workers do not mean more partial rows).  Measured (H200, 2026-11-26, bench_training.py
# --quick --variants, bf16, 192 MiB per case, % of a 1 GiB copy, RMSNorm / LayerNorm):
#                                        1k group      4k block      16k cluster
#   first version (ptxas's registers)    76.2 / 72.5   71.4 / 57.0   62.0 / 47.5
#   + split_stats                        76.7 / 72.7   72.0 / 57.0   62.2 / 47.7
#   + acc_smem                           70.1 / 69.3   70.6 / 60.5   62.5 / 54.9
#   + acc_smem + 64 registers            (spills)      71.1 / 60.7   67.5 / 59.1
#   + acc_smem + merge_cluster 4         66.0 / 61.8   67.6 / 57.8   -
# split_stats is free; acc_smem + the cap pay where registers bound the blocks per SM (16k: 3 -> 4
# blocks of 256; 4k LayerNorm: 3 -> 4) and cost where they did not (1k lane groups: the shared
# round trip per row, ~10% more instructions; 4k RMSNorm: 72.0 without, 71.1 with); merging
# clusters lost everywhere (the merge's cluster barriers hold every worker of a cluster at the end).
# Per row class, (RMSNorm, LayerNorm):
_NORM_BWD_ACC_SMEM = {"group": (False, False), "block": (False, True), "cluster": (True, True)}
_NORM_BWD_MERGE = {"group": 1, "block": 1, "cluster": 1}   # sm_90; kept as a knob
# Threads per SM the register cap aims at (min_blocks = this / block_size; 0: no cap): 1024 = 64
# registers, which ptxas meets without spilling for 16-element threads with acc_smem (16k cluster
# rows: 72 -> 63 RMSNorm, 80 -> 63 LayerNorm, +3% instructions; 4 blocks of 256 per SM instead of
# 3).  Lane groups (32 elements per thread) spill under 64 and keep ptxas's choice.
_NORM_BWD_THREADS_PER_SM = {"group": (0, 0), "block": (0, 1024), "cluster": (1024, 1024)}
# Bulk-copy stages (bulk_rows, sm_90, 16-byte vectors) per row class, (RMSNorm, LayerNorm): None =
# direct loads with the tables above; (rows in flight per row team, acc_smem, threads per SM for
# the register cap) = bulk stages with those occupancy knobs in place of the tables' (the stages
# take the shared memory the sums would, so the measured winner pairs them with register sums).
# Measured (H200, 2026-11-26, bench_training.py --quick --variants, bf16, 192 MiB per case, % of a
# 1 GiB copy; the stage protocol of that run armed unwaited stages and took the saved statistics
# by cp.async onto the stage barrier - both synccheck's "Missing wait" - fixed since: the same bulk
# copies, the statistics by plain loads a row ahead):
#                                        1k group      4k block      16k cluster
#   direct loads (the tables above)      76.2 / 71.8   74.9 / 66.0   70.0 / 64.5
#   bulk 2, the tables' sums and cap     73.3 / 70.4   75.2 / 67.4   68.5 / 60.2
#   bulk 2, sums in registers, no cap    (as above)    (as) / 71.0   63.4 / 59.7
# LayerNorm 4k is the one clear win (+5): 264 workers (2 blocks of 256 per SM, 114 registers)
# with two rows each in flight through the stages, against 528 capped workers loading directly -
# half the partial rows (8.6 MB of dweight + dbias instead of 17 MB, 9% of the case, written and
# folded) and more bytes in flight per SM.  Re-measured with the first protocol fix (H200,
# 2026-11-26, --variants bulk, in the same rounds): LayerNorm 4k 71.1 vs 66.2 direct; RMSNorm 4k
# 74.6 (bulk 2) vs 75.1: no win.  Check run with the final protocol (one expect-tx arrive per
# stage, statistics by plain loads; H200, 2026-11-26): compute-sanitizer synccheck / racecheck /
# memcheck 0 errors on norm_backward_bulk + norm_backward, and in the same rounds (% of copy, rtk
# = the default after this change vs the old direct loads): LayerNorm 2k 71.6 vs 65.6, 4k 71.3 vs
# 66.1 - adopted for LayerNorm's block class; RMSNorm 2k 73.7 (bulk 2) vs 73.7, 4k 74.1 vs 74.9:
# not.  Lane groups (1k): one stage per team (bulk 1, the tables' sums) 78.5 / 74.0 vs direct 76.3
# / 71.8, and 77.8 / 74.3 vs 76.5 / 72.4 in the run before - adopted for both ops.
# With the weight held in registers (hold_weight, below), RMSNorm's block rows gain from the stages too,
# and LayerNorm's 256-thread cluster rows (H200, 2026-11-28, bench_training.py --quick --variants bulk2 /
# direct, 64 MiB of x, GB/s, direct / bulk 2, two runs each; docs/data/norm_bwd_bulk_{variants,direct}_*_session31_*):
#   RMSNorm    1536 3240-3250 / 3470-3500   2048 3380-3390 / 3380-3410   2560 3070-3090 / 3350-3380
#              3072 3230-3240 / 3520-3530   3584 3370 / 3520-3530        4096 3350-3370 / 3340-3400
#   LayerNorm  16k 2940-2980 / 3030-3050    32k 2890-2900 / 2890-2910    64k (512-thread clusters: one
#              block per SM with the stages) 2310-2320 / 2060: direct there
# RMSNorm 16k 3320-3340 / 3280-3310: direct.  The 512-thread block rows (4608-8192) were mixed (8192 +2 /
# +4%, 4608 and 5120 -1 to -2%): direct.
_NORM_BWD_BULK = {"group": ((1, False, 0), (1, False, 0)), "block": ((2, False, 0), (2, False, 0)),
                  "cluster": (None, (2, True, 1024))}
# The column sums folded into the rows kernel (fold_colsum, a cooperative launch: a grid barrier
# after the partial rows, then every block sums column tiles of them from L2, _fold_tile4) instead
# of the second kernel norm_bwd_colsum.  Measured (H200, 2026-11-26, bench_training.py --quick
# --variants fold, bf16, 192 MiB per case, % of a 1 GiB copy, RMSNorm / LayerNorm):
#                                        1k group      4k block      16k cluster
#   two kernels (rows + norm_bwd_colsum) 77.0 / 72.7   71.5 / 61.3   67.0 / 58.5
#   fold, summed lines dropped from L2   75.3 / 71.5   75.6 / 66.0   70.8 / 64.6
#   fold, summed lines kept in L2        75.3 / 71.7   75.9 / 66.3   69.9 / 64.7
#   fold + merge_cluster 4 (acc_smem)    67.0 / 63.6   72.7 / 66.3   -
# The fold wins where a worker's partial row is long and the second kernel's tail, launch gap and
# DRAM round trip of the partials weigh (4k: +4 / +5 points, 16k: +4 / +6); at 1k the lane groups'
# 400-530 partial rows of 4 KB cost the fold's tail more than the second kernel (1024-thread
# blocks, all SMs) pays: the two kernels win by ~1.5 points.  Dropping the summed lines
# (discard_partials) is level with keeping them (within +-0.3 at 4k, +0.9 / -0.1 at 16k): kept on.
# Merging clusters first loses or ties everywhere: off (_NORM_BWD_MERGE).  Clusters fold through a
# cooperative launch of the __cluster_dims__ kernel (the driver took it: 16k cluster 4, 64k
# cluster 8); where a driver refuses, the op falls back to the two kernels once and remembers
# (_FOLD_REFUSED).
_NORM_BWD_FOLD = {"group": False, "block": True, "cluster": True}
# Each thread's weight vectors held packed in registers across its rows (hold_weight) instead of loaded
# from L1 at both uses of every row: the loads no longer sit between a row's arrival and its math.
# Measured (H200, 2026-11-28, bench_training.py --quick --variants hold, bf16, 64 MiB of x, GB/s of the
# heuristic / with hold_weight, two alternations; docs/data/norm_bwd_hold_weight_*_session31_*):
#   RMSNorm    1k 3500 / 3580   4k 3250 / 3330   5120 3080 / 3160   8k 3270 / 3360   16k 3060 / 3300
#   LayerNorm  1k 3280 / 3460   4k 3070 / 3230   5120 2750 / 2810   8k 2910 / 2960   16k 2760 / 2970
# (+2 to +8%, every row class: lane groups with bulk stages, blocks, 512-thread blocks, clusters).  The
# packed words cost 8 registers per 16 elements once rtk::forget stops ptxas from hoisting their float
# conversions out of the row loop (4k RMSNorm 72 -> 80, still 3 blocks of 256 per SM; 96 without it).
# float32 weights beside 16-bit rows (32 bytes a slot) stay loaded: under the 64-register caps of 8k /
# 16k they spilled 4-12 bytes (NVRTC 13.5, sm_90a).
_NORM_BWD_HOLD_W = True


# norm_bwd rows of 512 threads' worth (8k 16-bit elements, 16 per thread) on sm_90: one block of
# 512 threads per row (the sums in shared memory, two blocks per SM, loads direct) instead of a
# 2-block cluster of 256 - no cluster to place within a GPC.  Measured (H100, 2026-11-26,
# bench_training.py --quick --variants, bf16, 192 MiB, % of a 1 GiB copy, RMSNorm / LayerNorm,
# same rounds): cluster 2 x 256 82.1 / 77.4, block of 512 84.8 / 80.3, block of 256 x 32 elements
# 77.3 / 72.5; repeated on another H100 (2026-11-27): 83.6 / 79.4 against 81.5 / 77.1.  (16k stays
# on 4-block clusters: 2 x 512 ran 84.0 / 76.3 against 82.7 / 79.1.)
_NORM_BWD_BIG_BLOCK = 512


# softmax_bwd rows between powers of two (sm_90, 16-byte vectors, rows of >= 256 threads): the
# table's threads, as few vectors per thread as hold the row (rowwise.py's widths section says why).
# Measured (H200, 2026-11-28, bf16, 64 MiB of x, % of the 1 GiB copy; `row_widths_survey_session30_*`):
# 4608 83.6 -> 93.5 (256 x 3), 5120 87.1 -> 94.0, 6144 90.3 -> 92.1, 12288 (2 x 256 x 3) 85.1 -> 90.0.
# Narrower rows were level either way (1280-3072, 64-128 threads: within 1 point) and half the
# threads with more vectors was no better; norm_bwd (its register caps and partial rows sized per
# table config) lost or tied with either refit at most widths (2560: +3 to +6) and keeps its table.
_SOFTMAX_BWD_FIT_MIN_THREADS = 256


def _softmax_bwd_fit(cfg: KernelConfig, share: int) -> KernelConfig:
    return rw.refit(cfg, cfg.threads_per_row, -(-share // cfg.threads_per_row))


def _fits_softmax_bwd(cfg: KernelConfig, arch: str) -> bool:
    return (cfg.family == "softmax_bwd" and arch_number(arch) >= 90 and not cfg.two_pass
            and cfg.vec * dtypes.itemsize(cfg.dtype) == 16
            and cfg.threads_per_row * cfg.cluster_size >= _SOFTMAX_BWD_FIT_MIN_THREADS)


def plan_bwd(family: str, n: int, dtype: str, vec: int, arch: str, *, weight_dtype: str | None = None,
             layer: bool = False, fit: bool = True) -> KernelConfig:
    """The heuristic config of ``family`` ("norm_bwd" or "softmax_bwd") for rows of ``n`` elements
    accessed ``vec`` at a time: per power of two >= n / vec, and for softmax_bwd (``fit``, sm_90)
    refitted to the row's own vector count.  ``layer``: the config for layernorm_backward
    (norm_bwd's occupancy knobs differ by op where measured)."""
    cfg = _plan_bwd(family, n, dtype, vec, arch, weight_dtype, layer)
    if fit and _fits_softmax_bwd(cfg, arch):
        nvec = -(-n // vec)
        cfg = _softmax_bwd_fit(cfg, -(-nvec // cfg.cluster_size))
    return cfg


def _plan_bwd(family, n, dtype, vec, arch, weight_dtype, layer):
    size = dtypes.itemsize(dtype)
    nvec = rw._pow2_ceil(-(-n // vec))
    vmax = min(8, max(1, _BWD_ELEMS_PER_THREAD[family][size] // vec))
    need = rw._pow2_ceil(-(-nvec // vmax))
    hopper = arch_number(arch) >= 90
    cls = NormBwdConfig if family == "norm_bwd" else SoftmaxBwdConfig
    common = dict(dtype=dtype, vec=vec)
    if family == "norm_bwd":
        common["weight_dtype"] = weight_dtype or dtype

    def make(block, **fields):
        # min_blocks=1: the register cap is what one block of `block` threads allows (128 at 512
        # threads: norm_bwd's 16-bit LayerNorm takes 95-135 registers and needs no more).
        cfg = cls(**common, block_size=block, **fields)
        if family == "norm_bwd" and not cfg.two_pass:
            cls_ = cfg.row_class
            wide = vec * size == 16
            bulk = _NORM_BWD_BULK[cls_][int(layer)] if wide and hopper else None
            if cls_ == "cluster" and block > _BWD_BLOCK_PREFERRED:
                bulk = None   # 512-thread cluster rows: the stages leave one block per SM (above)
            stages, acc, threads = bulk or (0, _NORM_BWD_ACC_SMEM[cls_][int(layer)],
                                            _NORM_BWD_THREADS_PER_SM[cls_][int(layer)])
            cfg = cfg.replace(ring_rows=_NORM_BWD_RING_ROWS[cls_] if wide and not stages else 0,
                              blocks_per_sm=_NORM_BWD_BLOCKS_PER_SM[cls_], acc_smem=acc,
                              merge_cluster=_NORM_BWD_MERGE[cls_] if acc and hopper else 1,
                              bulk_rows=stages, fold_colsum=_NORM_BWD_FOLD[cls_],
                              min_blocks=max(1, threads // cfg.block_size),
                              hold_weight=_NORM_BWD_HOLD_W and vec * dtypes.itemsize(common["weight_dtype"]) <= 16)
        return cfg

    gmax = min(8, max(1, _BWD_GROUP_ELEMS[family][size] // vec))
    group = rw._pow2_ceil(-(-nvec // gmax))
    if group <= 32:                                         # a lane group per row
        return make(_BWD_GROUP_BLOCK[family], threads_per_row=group,
                    vecs_per_thread=rw._pow2_ceil(-(-nvec // group)))
    if need <= _BWD_BLOCK_PREFERRED:                        # a block per row
        return make(need, threads_per_row=need, vecs_per_thread=rw._pow2_ceil(-(-nvec // need)))
    block_max = _BWD_BLOCK_MAX[family]
    if family == "norm_bwd" and hopper and need == _NORM_BWD_BIG_BLOCK:   # 8k rows: one block, see there
        return make(need, threads_per_row=need, vecs_per_thread=vmax).replace(
            acc_smem=True, bulk_rows=0, ring_rows=0, min_blocks=max(1, 1024 // need))
    if hopper and need <= 8 * block_max:                    # a cluster per row (totals by st.async)
        block = max(_BWD_BLOCK_PREFERRED, need // 8)
        return make(block, threads_per_row=block, vecs_per_thread=vmax, cluster_size=need // block,
                    cluster_push=True)
    if need <= block_max:                                   # sm_80: one big block
        return make(need, threads_per_row=need, vecs_per_thread=vmax)
    return make(_BWD_TWO_PASS_BLOCK, threads_per_row=_BWD_TWO_PASS_BLOCK, vecs_per_thread=vmax, two_pass=True)


@lru_cache(maxsize=1024)
def _planned(family, n_padded, dtype, vec, arch, weight_dtype, layer, narrow=0):
    """:func:`plan_bwd` memoized; ``narrow``: as rowwise._planned's."""
    def planned(v):
        return plan_bwd(family, n_padded, dtype, v, arch, weight_dtype=weight_dtype, layer=layer)
    cfg = planned(vec)
    return rw.ragged_or_narrow(cfg, lambda: planned(narrow)) if narrow else cfg


def heuristic_configs(arch: str) -> list[tuple[str, KernelConfig]]:
    """Every (family, config) :func:`plan_bwd` can return for ``arch`` (widths up to 2**20)."""
    seen = {}
    for family in ("norm_bwd", "softmax_bwd"):
        for dtype in FLOAT_DTYPES:
            size = dtypes.itemsize(dtype)
            wdts = tuple(dict.fromkeys((dtype, "float32"))) if family == "norm_bwd" else (None,)
            vec = 16 // size
            while vec >= 1:
                for k in range(21):
                    if (1 << k) * vec > 1 << 20:
                        break
                    for wdt in wdts:
                        for layer in ((False, True) if family == "norm_bwd" else (False,)):
                            base = plan_bwd(family, (1 << k) * vec, dtype, vec, arch, weight_dtype=wdt, layer=layer,
                                            fit=False)
                            cfgs = [base]
                            if _fits_softmax_bwd(base, arch):   # every refit of the rows below 2**k vectors
                                cl, t = base.cluster_size, base.threads_per_row
                                lo, hi = -(-((1 << k) // 2 + 1) // cl), -(-(1 << k) // cl)
                                cfgs += [_softmax_bwd_fit(base, v * t) for v in range(-(-lo // t), -(-hi // t) + 1)]
                            if family == "softmax_bwd":   # odd widths
                                cfgs += rw.ragged_variants(cfgs, k)
                            for cfg in cfgs:
                                seen.setdefault(cfg, family)
                vec //= 2
    return [(family, cfg) for cfg, family in seen.items()]


def _config_for(family: str, config, n: int, dtype: str, vec: int, op: str, weight_dtype: str | None = None,
                narrow: int = 0):
    arch, _ = rw._arch_info()
    cls = NormBwdConfig if family == "norm_bwd" else SoftmaxBwdConfig
    if config is None:
        return _planned(family, -(-n // vec) * vec, dtype, vec, arch, weight_dtype,
                        op == "layernorm_backward", narrow)
    if not isinstance(config, cls):
        raise ConfigError(f"{op}: config must be a {cls.__name__}, got {type(config).__name__}", family=op,
                          field="config", value=config)
    if family == "softmax_bwd":
        rw.check_config_ragged(config, bool(narrow), op)
    if config.dtype != dtype or (weight_dtype and config.weight_dtype != weight_dtype):
        raise ConfigError(f"{op}: config dtypes ({config.dtype}"
                          + (f", weight {config.weight_dtype}" if weight_dtype else "")
                          + f") do not match the inputs ({dtype}" + (f", weight {weight_dtype}" if weight_dtype else "")
                          + ")", family=op, field="config", value=config)
    if vec % config.vec:
        raise ConfigError(f"{op}: config.vec={config.vec} needs n, strides and pointers aligned to {config.vec} "
                          f"elements; these inputs allow vec <= {vec}", family=op, field="config")
    if not config.two_pass and config.chunk_elements < n:
        raise ConfigError(f"{op}: config holds {config.chunk_elements} elements per row in registers, the row has "
                          f"{n}; raise vecs_per_thread/threads_per_row/cluster_size or set two_pass=True",
                          family=op, field="config")
    return config


def _cluster_capacity(k, cfg) -> int | None:
    """Clusters of the rows kernel the driver runs at once (:func:`rowwise.driver_clusters`)."""
    return rw.driver_clusters(k, cfg.block_size, cfg.shared_mem_bytes, cfg.cluster_size)


def _resident_workers(k, cfg) -> int:
    """Workers (blocks, or clusters) of the rows kernel in its one wave: every one resident on the
    device at once, or ``blocks_per_sm`` per SM when that is fewer.  A worker that finds no room
    waits for a whole worker to finish - a second wave that doubles the kernel's time - so clusters
    are counted by the driver (which places them GPC by GPC), not by SMs x blocks per SM."""
    workers = rw.resident_on_device(k, cfg.block_size, cfg.shared_mem_bytes, cfg.launch_cluster)
    if getattr(cfg, "blocks_per_sm", 0):
        _, sms = rw._arch_info()
        workers = min(workers, max(1, sms * cfg.blocks_per_sm // cfg.launch_cluster))
    return workers * cfg.merge_cluster   # merge_cluster: each block of a cluster is a worker


# ---- array checks shared by the ops -------------------------------------------------------------
def _same_rows(a, name: str, like_shape, dt: str, op: str, dtype, stream=None):
    """A row view of ``a`` (dy / y): x's shape and dtype."""
    adt = rw._dtype_of(a, dtype, op)
    av, lay = rw._rows_of(a, op, stream, name)
    if tuple(av.shape) != tuple(like_shape) or adt != dt:
        raise ConfigError(f"{op}: {name} must be a {dt} array of shape {tuple(like_shape)}, got {adt} "
                          f"{tuple(av.shape)}", family=op, field=name, value=f"{adt}{tuple(av.shape)}",
                          allowed=f"{dt}{tuple(like_shape)}")
    return av, lay


def _param_view(p, name: str, n: int, dt: str, op: str):
    pv = as_device_array(p, op, name)
    pdt = dtype_name(p)
    if pdt == "uint16" and dt == "bfloat16":
        pdt = "bfloat16"
    if pdt not in (dt, "float32"):
        raise ConfigError(f"{op}: {name} has dtype {pdt}; with {dt} x it must be {dt} or float32", family=op,
                          field=name, value=pdt, allowed=f"{dt}, float32")
    if pv.size != n or not pv.flags.c_contiguous:
        raise ConfigError(f"{op}: {name} must be {n} contiguous elements (x.shape[-1]), got shape {pv.shape}",
                          family=op, field=name, value=tuple(pv.shape), allowed=f"({n},)")
    return pv, pdt


def _stats_view(s, name: str, rows: int, op: str):
    sv = as_device_array(s, op, name)
    sdt = dtype_name(s)
    if sdt != "float32" or sv.size != rows or not sv.flags.c_contiguous:
        raise ConfigError(f"{op}: {name} must be {rows} contiguous float32 values (one per row of x, as "
                          f"return_stats=True gives them), got {sdt} of shape {tuple(sv.shape)}", family=op,
                          field=name, value=f"{sdt}{tuple(sv.shape)}", allowed=f"float32 ({rows},)")
    return sv


def _eps_ok(eps, op):
    if not isinstance(eps, (int, float, np.floating)) or isinstance(eps, bool) or not eps >= 0:
        raise ConfigError(f"{op}: eps={eps!r} is not allowed; eps must be a float >= 0", family=op, field="eps")


# ---- norm backward ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _NormBwdPlan:
    """A norm backward's launches and what they need allocated per call."""
    rows: Launch            # arrays: dy, x, weight, [mean], rstd, dx, partial, scratch (+ counters, dweight, dbias)
    colsum: Launch | None   # arrays: partial, dweight, dbias; None: the rows kernel folds them (cooperative)
    dx: OutputPlan          # dx's shape / dtype / kind (its launch field is unused)
    partial_shape: tuple
    scratch_rows: int       # 0: no scratch
    dweight_shape: tuple
    weight_dtype: object
    has_bias: bool
    device: int = 0         # fold: the device whose stream workspace holds the barrier's counters


_PLANS = LaunchPlans()
# fold_colsum configs whose cooperative launch a device refused (a LaunchError: too many blocks at
# once, a cluster shape the cooperative path does not take, no cooperative launches): their calls
# take the two-kernel path from then on.
_FOLD_REFUSED: set = set()


class _FoldRefused(Exception):
    """A plan's cooperative launch was refused: the caller plans again without the fold."""


def rmsnorm_backward(dy, x, weight, rstd=None, *, eps: float = 1e-6, out=None, dtype: str | None = None,
                     stream=None, config: NormBwdConfig | None = None):
    """Backward of :func:`rtkernels.rmsnorm`: ``(dx, dweight)`` for ``y = x * rstd * weight``.

    Parameters
    ----------
    dy, x : float16 / bfloat16 / float32 arrays of one shape and dtype (rows over the last axis).
    weight : the forward's weight (``n`` contiguous elements, x's dtype or float32).
    rstd : the forward's ``rstd`` (``rmsnorm(..., return_stats=True)``): float32, one per row.  None
        recomputes it from x with ``eps`` in the same single pass over the row.
    eps : the forward's eps (used only when rstd is None).
    out : optional dx array (x's shape and dtype; may be ``dy`` itself).
    dtype, stream : as in :func:`rtkernels.softmax`.
    config : a :class:`NormBwdConfig` overriding the heuristic.

    Returns
    -------
    ``(dx, dweight)``: dx like x; dweight in weight's dtype and shape, summed over rows in float32
    by a deterministic two-stage reduction (see the module docstring).
    """
    return _norm_bwd("rmsnorm_backward", dy, x, weight, None, None, rstd, eps, out, dtype, stream, config)[:2]


def layernorm_backward(dy, x, weight, bias=None, mean=None, rstd=None, *, eps: float = 1e-5, out=None,
                       dtype: str | None = None, stream=None, config: NormBwdConfig | None = None):
    """Backward of :func:`rtkernels.layernorm`: ``(dx, dweight, dbias)``.

    Parameters
    ----------
    dy, x : float16 / bfloat16 / float32 arrays of one shape and dtype.
    weight, bias : the forward's parameters (bias only sets dbias's dtype and shape; None gives
        ``dbias=None``).
    mean, rstd : the forward's statistics (``layernorm(..., return_stats=True)``), float32, one per
        row; both or neither.  None recomputes them with ``eps`` in the same single pass over the row.
    eps, out, dtype, stream, config : as in :func:`rmsnorm_backward`.

    Returns
    -------
    ``(dx, dweight, dbias)``; dweight / dbias deterministic (two-stage float32 reduction).
    """
    if (mean is None) != (rstd is None):
        missing = "rstd" if rstd is None else "mean"
        raise ConfigError(f"layernorm_backward: pass both mean and rstd (the forward's statistics) or neither; "
                          f"{missing} is None", family="layernorm_backward", field=missing)
    return _norm_bwd("layernorm_backward", dy, x, weight, bias, mean, rstd, eps, out, dtype, stream, config)


def _norm_bwd(op, dy, x, weight, bias, mean, rstd, eps, out, dtype, stream, config):
    layer = op == "layernorm_backward"
    key = _PLANS.key((dy, x, weight, bias, mean, rstd, out), (op, eps, dtype, config)) \
        if type(eps) is float else None
    plan = _PLANS.get(key)
    if plan is not None:
        try:
            return _norm_bwd_replay(plan, (dy, x, weight, mean, rstd) if layer else (dy, x, weight, rstd), out,
                                    stream)
        except _FoldRefused:   # planned again below, without the fold (nothing was launched)
            _PLANS.put(key, None)
    # check
    dt = rw._dtype_of(x, dtype, op)
    xv, (rows, n, xs) = rw._rows_of(x, op, stream)
    rw._check_width(n, op)
    dyv, (_, _, dys) = _same_rows(dy, "dy", xv.shape, dt, op, dtype, stream)
    wv, wdt = _param_view(weight, "weight", n, dt, op)
    if bias is not None:
        _, bdt = _param_view(bias, "bias", n, dt, op)
        if bdt != wdt:
            raise ConfigError(f"{op}: weight and bias must share a dtype, got {wdt} and {bdt}", family=op,
                              field="bias")
    _eps_ok(eps, op)
    # the kernels take (mean,) rstd pointers; null ones recompute the statistics
    stats = [None, None] if layer else [None]
    if rstd is not None:
        stats[-1] = _stats_view(rstd, "rstd", rows, op)
        if layer:
            stats[0] = _stats_view(mean, "mean", rows, op)
    out, ov, (_, _, dxs) = rw._out_rows(out, x, xv.shape, dt, op)
    dweight = new_like(x, tuple(wv.shape), wdt)
    dbias = new_like(x, tuple(wv.shape), wdt) if layer and bias is not None else None
    if n == 0:
        return out, dweight, dbias
    # plan
    size = dtypes.itemsize(dt)
    vec = rw._pick_vec(size, n, (rw._ptr(xv), rw._ptr(dyv), rw._ptr(ov)), (xs, dys, dxs) if rows > 1 else ())
    while vec > 1 and rw._ptr(wv) % min(16, vec * dtypes.itemsize(wdt)):
        vec //= 2
    cfg = _config_for("norm_bwd", config, n, dt, vec, op, weight_dtype=wdt)
    if cfg.fold_colsum and (rows == 0 or cfg in _FOLD_REFUSED):   # (no rows: the column kernel writes zeros)
        cfg = cfg.replace(fold_colsum=False)
    fold = cfg.fold_colsum
    k = get_kernel(cfg, ("layernorm_bwd_rows" if layer else "rmsnorm_bwd_rows")
                   + ("" if rstd is not None else "_recompute"))
    units = -(-rows // cfg.rows_per_block)
    resident = _resident_workers(k, cfg)
    if fold:   # at most what the driver co-schedules (it refuses a cooperative grid beyond that)
        resident = min(resident, _cooperative_workers(k, cfg))
    workers = min(units, resident)
    if cfg.balance and units > resident:
        workers = -(-units // -(-units // resident))   # as many rows each as ceil(units / resident)
    m = cfg.merge_cluster
    workers = -(-workers // m) * m             # whole clusters (resident is a multiple of m)
    # float4-aligned partial rows; whole 128-byte lines when the fold sums them (so that a line is
    # one tile's, which may drop it from L2)
    ldp = -(-n // 32) * 32 if fold else -(-n // 4) * 4
    nparts = (2 if layer else 1) * (workers // m)
    blocks = workers * cfg.cluster_size
    head = (rows, n, dys, xs, dxs, ldp, float(eps))
    if fold:
        tile4 = _fold_tile4(n, blocks, cfg.block_size, workers // m)
        rows_launch = Launch(k, (blocks,), (cfg.block_size,), cfg.shared_mem_bytes, (*head, tile4), cooperative=True)
        colsum = None
    else:
        rows_launch = Launch(k, (blocks,), (cfg.block_size,), cfg.shared_mem_bytes, head)
        cols = _colsum_columns(n)
        colsum = Launch(get_kernel(cfg, "norm_bwd_colsum"), (-(-n // cols), 2 if dbias is not None else 1),
                        (1024,), 0, (workers // m, n, ldp, cols))
    plan = _NormBwdPlan(rows_launch, colsum, OutputPlan.of(rows_launch, out), (max(nparts, 1), ldp),
                        rows if cfg.two_pass else 0, tuple(wv.shape), dweight.dtype, dbias is not None,
                        _device_of(x) if fold else 0)
    # launch
    s = default_stream(x, stream)
    partial, scratch = _workspace(x, plan)
    pv = as_device_array(partial, op, "workspace")
    sv = as_device_array(scratch, op, "workspace") if scratch is not None else None
    dwv = as_device_array(dweight, op, "dweight")
    dbv = as_device_array(dbias, op, "dbias") if dbias is not None else None
    views = (dyv, xv, wv, *stats, ov)
    if fold:
        cv = as_device_array(_counters(x, plan, s), op, "workspace")
        try:
            rows_launch.run((*views, pv, sv, cv, dwv, dbv), s)
        except LaunchError:
            _FOLD_REFUSED.add(cfg)   # (cfg is `config` when one was passed)
            return _norm_bwd(op, dy, x, weight, bias, mean, rstd, eps, out, dtype, stream, config)
    else:
        if rows:
            rows_launch.run((*views, pv, sv), s)
        colsum.run((pv, dwv, dbv), s)
    arrays = (dy, x, weight, mean, rstd, out) if layer else (dy, x, weight, rstd, out)
    if key is not None and same_memory(views, arrays) and rows:
        _PLANS.put(key, plan)
    return out, dweight, dbias


def _cooperative_workers(k, cfg) -> int:
    """Workers of the rows kernel a cooperative launch may have: the blocks the driver runs at once
    (Kernel.cooperative_limit, what the launch checks the grid against: the same block and dynamic
    shared memory as the launch) in whole workers."""
    limit = k.cooperative_limit(cfg.block_size, cfg.shared_mem_bytes)
    clusters = limit // cfg.launch_cluster
    return max(1, clusters) * cfg.merge_cluster


def _fold_tile4(n: int, blocks: int, block: int, parts: int) -> int:
    """float4 columns per tile of the fold's column sums (1, 2, 4 or 8): the fewest dependent
    rounds on the busiest block - ceil(tiles / blocks) tiles, each ceil(parts / (lanes x 4)) rounds
    of L2 loads, lanes = block / tile4 - and among equals the widest tile (8: one 128-byte line of
    each partial row, which the block may then drop from L2).  E.g. 4k RMSNorm, 396 block workers of
    256 threads: 4 (256 tiles, one per block, 2 rounds) where 8 takes 4 rounds and 1 three tiles;
    16k cluster rows, 248 blocks, 62 partial rows: 8 (512 tiles, 2-3 per block, 1 round each).
    (REASONED from the loads' latency, not measured.)  Not a function of dbias: dweight's bits do
    not depend on whether the bias is passed."""
    n4 = -(-n // 4)
    best = None
    for tile4 in (8, 4, 2, 1):
        lanes = max(1, block // tile4)
        cost = -(-(-(-n4 // tile4)) // blocks) * -(-parts // (lanes * 4))
        if best is None or cost < best[0]:
            best = (cost, tile4)
    return best[1]


def _device_of(x) -> int:
    from .. import device
    return x.get_device() if _is_torch(x) else device.current_device()


def _counters(like, plan: _NormBwdPlan, stream):
    """Two int32 counters of the stream's workspace for the fold's grid barrier: zero between
    launches (the barrier's last block leaves them so), per stream (ops/workspace.py: launches in
    flight on two streams would count each other's blocks)."""
    return stream_workspace(like, plan.device, stream, 0, 8)[1]


def _colsum_columns(n: int) -> int:
    """Columns per block of norm_bwd_colsum: 32 (128-byte rows of partials per lane) while that
    still gives two blocks per SM, else 16 or 8 (n = 1k: 128 blocks of 8 columns, 128 lanes summing
    ~4 partial rows each, instead of 32 blocks whose lanes sum ~16 in two dependent rounds)."""
    _, sms = rw._arch_info()
    for cols in (32, 16):
        if -(-n // cols) >= 2 * sms:
            return cols
    return 8


def _workspace(like, plan: _NormBwdPlan):
    """The float32 partial rows (and two_pass's per-row constants), of ``like``'s array kind."""
    f32 = rw._float32_of(like)
    partial = empty_as(like, plan.partial_shape, f32)
    scratch = empty_as(like, (plan.scratch_rows, 4), f32) if plan.scratch_rows else None
    return partial, scratch


def _norm_bwd_replay(plan: _NormBwdPlan, inputs, out, stream):
    x = inputs[1]
    out = plan.dx.output(x, out)
    partial, scratch = _workspace(x, plan)
    dweight = empty_as(x, plan.dweight_shape, plan.weight_dtype)
    dbias = empty_as(x, plan.dweight_shape, plan.weight_dtype) if plan.has_bias else None
    arrays = inputs   # (mean,) rstd may be None: null pointers
    s = default_stream(x, stream)
    fold = plan.colsum is None
    tail = (_counters(x, plan, s), dweight, dbias) if fold else ()
    if plan.dx.torch:
        dev = x.get_device()
        ptr = lambda a: device_pointer(a, dev)  # noqa: E731
        rows_args = [ptr(a) for a in (*arrays, out, partial, scratch, *tail)]
    else:
        rows_args = (*arrays, out, partial, scratch, *tail)
    try:
        plan.rows.run(rows_args, s)
    except LaunchError:
        if not fold:
            raise
        _FOLD_REFUSED.add(plan.rows.kernel.config)
        raise _FoldRefused() from None
    if not fold:
        if plan.dx.torch:
            plan.colsum.run([ptr(a) for a in (partial, dweight, dbias)], s)
        else:
            plan.colsum.run((partial, dweight, dbias), s)
    return out, dweight, dbias


# ---- softmax backward ---------------------------------------------------------------------------
def softmax_backward(dy, y, *, log: bool = False, out=None, dtype: str | None = None, stream=None,
                     config: SoftmaxBwdConfig | None = None):
    """Backward of :func:`rtkernels.softmax` over the last axis, from the forward's output ``y``.

    ``dx = y * (dy - sum(dy * y))``; with ``log=True`` (y from ``softmax(..., log_softmax=True)``)
    ``dx = dy - exp(y) * sum(dy)``.  dy, y: one shape and dtype (float16 / bfloat16 / float32);
    out: optional dx (may be dy); dtype, stream, config as in :func:`rtkernels.softmax`.  Rows of
    an odd width keep 16-byte loads when dy, y and dx rows share their addresses mod 16 (the
    usual case: contiguous arrays of one shape), as the forward's do.
    """
    op = "softmax_backward"
    key = _PLANS.key((dy, y, out), (op, bool(log), dtype, config))
    plan = _PLANS.get(key)
    if plan is not None:
        return rw._replay(plan, (dy, y), out, stream, key[1])
    dt = rw._dtype_of(y, dtype, op)
    yv, (rows, n, ys) = rw._rows_of(y, op, stream, "y")
    rw._check_width(n, op)
    dyv, (_, _, dys) = _same_rows(dy, "dy", yv.shape, dt, op, dtype, stream)
    out, ov, (_, _, dxs) = rw._out_rows(out, y, yv.shape, dt, op)
    if rows == 0 or n == 0:
        return out
    size = dtypes.itemsize(dt)
    ptrs, strides = (rw._ptr(yv), rw._ptr(dyv), rw._ptr(ov)), (ys, dys, dxs)
    vec, narrow = rw.rows_access(size, n, rows, ptrs, strides, config)
    cfg = _config_for("softmax_bwd", config, n, dt, vec, op, narrow=narrow)
    k = get_kernel(cfg, "log_softmax_bwd_rows" if log else "softmax_bwd_rows")
    launch = Launch(k, (cfg.grid(rows),), (cfg.block_size,), 0, (rows, n, dys, ys, dxs))
    views = (dyv, yv, ov)
    launch.run(views, default_stream(y, stream))
    if key is not None and same_memory(views, (dy, y, out)):
        _PLANS.put(key, OutputPlan.of(launch, out))
    return out


# ---- float64 references (host, NumPy) ------------------------------------------------------------
def rmsnorm_backward_reference(dy, x, weight, eps: float = 1e-6):
    """float64 (dx, dweight) of ``y = x / sqrt(mean(x^2) + eps) * weight``."""
    dy, x, w = (np.asarray(a, np.float64) for a in (dy, x, weight))
    n = x.shape[-1]
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    g = dy * w
    dx = rstd * (g - xhat * np.sum(g * xhat, axis=-1, keepdims=True) / n)
    return dx, np.sum((dy * xhat).reshape(-1, n), axis=0)


def layernorm_backward_reference(dy, x, weight, eps: float = 1e-5):
    """float64 (dx, dweight, dbias) of ``y = (x - mean) / sqrt(var + eps) * weight + bias``."""
    dy, x, w = (np.asarray(a, np.float64) for a in (dy, x, weight))
    n = x.shape[-1]
    mean = np.mean(x, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(np.mean((x - mean) ** 2, axis=-1, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    g = dy * w
    dx = rstd * (g - np.mean(g, axis=-1, keepdims=True) - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
    return dx, np.sum((dy * xhat).reshape(-1, n), axis=0), np.sum(dy.reshape(-1, n), axis=0)


def softmax_backward_reference(dy, y, log: bool = False):
    """float64 dx from the forward's output y (softmax, or log-softmax with ``log``)."""
    dy, y = np.asarray(dy, np.float64), np.asarray(y, np.float64)
    if log:
        return dy - np.exp(y) * np.sum(dy, axis=-1, keepdims=True)
    return y * (dy - np.sum(dy * y, axis=-1, keepdims=True))


__all__ = ["rmsnorm_backward", "layernorm_backward", "softmax_backward", "NormBwdConfig", "SoftmaxBwdConfig",
           "plan_bwd", "rmsnorm_backward_reference", "layernorm_backward_reference", "softmax_backward_reference"]
