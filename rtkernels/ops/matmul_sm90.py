"""matmul on Hopper: TMA + wgmma, warp-specialized and persistent (templates/matmul_sm90.cu.j2).

:func:`rtkernels.matmul` calls :func:`launch` on sm_90 devices when :func:`eligible` says the
tensor memory accelerator can address the operands (16-byte aligned bases and strides, K >= 1);
everything else (sm_80/86/89, K = 9 bfloat16 rows, float32) runs the mma.sync kernel of
``matmul.py``.  The op's argument checks live there; this module has the config, the heuristic
and the launch.  ``mma="sync"`` swaps the wgmma consumers for ldmatrix + mma.sync ones behind the
same TMA producer (a measurement of the sm_80 instruction on Hopper; see docs/RESULTS.md).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from .. import arch as arch_mod
from ..config import KernelConfig, register_family
from ..errors import ConfigError

# Epilogue activations, indexed the same way by both matmul kernels (rtk::activate in rtk/gemm.cuh).
ACTIVATIONS = ("none", "relu", "gelu", "silu")
_DTYPES = ("float16", "bfloat16")
MMA_KINDS = ("wgmma", "sync")
_SMEM_LIMIT = arch_mod.limits("sm_90").max_smem_per_block_optin   # 227 KiB opt-in per block
_PRODUCER_REGS, _CONSUMER_REGS = 40, 232   # 40 + 2 * 232 = 3 * 168, the (384, 1) launch's allotment
MAX_SPLIT_K = 16   # the workspace is split_k tiles of float32 per output tile: more is memory, not speed
# cluster_k: the partials move through one receive buffer per CTA, a consumer warpgroup's rows; the
# hand-over pairs warpgroup w of one CTA with rank w of the other, so two CTAs per cluster
CLUSTER_KS = (1, 2)


class HopperMatmulTile:
    """What the Hopper matmul configs share (bf16/fp16 here, fp8 in matmul_fp8): three warpgroups,
    the C staging buffer's width and the shared-memory total.  Needs the fields block_m, block_n,
    num_stages, tma_store, epilogue_n and the property stage_bytes."""

    def _check_epilogue_and_smem(self) -> None:
        """epilogue_n steps over the TMA-stored columns in 64-column boxes (dividing them, unless the
        kernel takes a shorter last pass: ragged_epilogue), and the ring with the smallest epilogue
        staging fits shared memory."""
        if self.epilogue_n:
            self._check_int("epilogue_n", 64, max(64, self.tma_n), multiple_of=64)
            if self.tma_n % self.epilogue_n and not self.ragged_epilogue:
                self._fail("epilogue_n", f"0 or a divisor of {self.tma_n} that is a multiple of 64")
        if self.shared_mem_bytes > _SMEM_LIMIT:
            self._fail("num_stages", f"small enough for {_SMEM_LIMIT} bytes of shared memory (needs "
                                     f"{self.shared_mem_bytes} with the smallest epilogue staging)")

    @property
    def threads_per_block(self) -> int:
        return 384

    def _smem(self, epi_n: int) -> int:
        c = self.block_m * epi_n * 2 if self.tma_store else 0
        return 1024 + self.num_stages * self.stage_bytes + c + 16 * self.num_stages + self._exchange_smem()

    def _exchange_smem(self) -> int:
        """Shared memory beyond the ring and the C staging (the bf16/fp16 kernel's cluster-K exchange)."""
        return 0

    @property
    def tma_n(self) -> int:
        """Columns of the tile the TMA epilogue stores: block_n in whole 64-column boxes (the kernel
        writes the rest of a block_n off that grid, K-major B only, with direct stores); 0 without
        tma_store."""
        return self.block_n // 64 * 64 if self.tma_store else 0

    # The kernel's last epilogue pass may be narrower than the others (the bf16/fp16 kernel's).
    ragged_epilogue: ClassVar[bool] = False

    @property
    def epi_n(self) -> int:
        """Columns per epilogue pass: ``epilogue_n``, or the widest multiple of 64 (a divisor of
        tma_n unless ragged_epilogue) whose staging buffer fits beside the ring."""
        if self.epilogue_n or not self.tma_store:
            return self.epilogue_n or self.block_n
        n = self.tma_n
        while n > 64 and ((self.tma_n % n and not self.ragged_epilogue) or self._smem(n) > _SMEM_LIMIT):
            n -= 64
        return n

    @property
    def shared_mem_bytes(self) -> int:
        """1 KiB of alignment slack, the ring, the C staging buffer, 2 mbarriers per stage."""
        return self._smem(self.epi_n)


@register_family
@dataclass(frozen=True)
class MatmulSm90Config(HopperMatmulTile, KernelConfig):
    """One Hopper matmul specialization.

    ``block_m`` x ``block_n``: the output tile of one CTA; two consumer warpgroups own
    ``block_m / 2`` rows each.  ``block_k`` is 64 (one 128-byte swizzle row of 16-bit values).
    ``num_stages``: depth of the TMA ring.  ``group_m``: tile rows swept together for L2 reuse.
    ``a_kmajor`` / ``b_kmajor``: which operand dimension is contiguous (as in MatmulConfig).
    ``tma_store``: stage C through shared memory and store it with TMA (the output's base and
    row/batch strides 16-byte aligned); False writes C with direct 4-byte stores.
    ``epilogue_n``: columns staged per epilogue pass (0: the widest that fits beside the ring).
    ``mma``: "wgmma", or "sync": the consumers multiply with ldmatrix + mma.sync m16n8k16 (the
    sm_80 instruction, fed by the same TMA producer; see ``SM90_MMA`` in matmul.py) and store C
    directly (``tma_store`` False).
    ``split_k``: K-splits per output tile (1: one CTA-unit per tile, the unsplit kernel).  Above 1
    the persistent walk runs (tile, split) units, each over a contiguous range of k-blocks; the
    last split of a tile to finish sums the float32 partials of all splits in split order (a
    workspace of :func:`workspace_bytes`, counters of :func:`counter_bytes`) and runs the epilogue,
    in the same launch.  wgmma consumers only.  The kernel uses min(split_k, k-blocks) splits.
    ``stream_k``: the stream-K schedule (with split_k = 1, wgmma consumers): the last one or two
    waves' worth of tiles are cut into equal k-block ranges, one per CTA of the grid, that may span
    tile boundaries (the tiles before them run whole); partials are reduced like split-K's, in k
    order (:func:`stream_k_partition` models it; the grid is the host's choice, see
    :func:`grid_size`).  Its workspace: two float32 tiles per CTA.
    ``cluster_k``: 1, or 2: split-K inside a cluster of two CTAs (with split_k = 1, no stream-K,
    wgmma consumers).  Both CTAs of a cluster run the same tile, each over one half of its
    k-blocks; consumer warpgroup w of rank 1 - w hands its float32 partial to rank w through
    distributed shared memory, and rank w's warpgroup w adds it (k order, bit-reproducible) and
    stores its rows -- no global workspace, no counters, no re-read through L2.  The receive
    buffer (block_m / 2 x block_n float32) takes shared memory from the ring: 128 x 128 fits 5
    stages, 128 x 64 8, 128 x 256 3 (:func:`cluster_stages`).  Grid: whole clusters, at most
    one CTA per SM (:func:`grid_size`).
    """

    family: ClassVar[str] = "matmul_sm90"
    template: ClassVar[str] = "matmul_sm90.cu.j2"
    # 128 x 232: 192 TMA columns in passes of 128 + 64 - with three passes of 64 (128 staged
    # columns do not divide 192) the bias + GELU epilogue spilled 8 bytes
    ragged_epilogue: ClassVar[bool] = True
    kernels: ClassVar[tuple[str, ...]] = ("matmul_sm90",)
    needs_arch_specific: ClassVar[bool] = True
    expects_tensor_cores: ClassVar[bool] = True
    expected_global_width: ClassVar[int | None] = None   # operands and C move by TMA, not LDG/STG
    dtype: str = "bfloat16"
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 4
    group_m: int = 8
    a_kmajor: bool = True
    b_kmajor: bool = False
    has_bias: bool = False
    activation: str = "none"
    tma_store: bool = True
    epilogue_n: int = 0
    mma: str = "wgmma"
    split_k: int = 1
    stream_k: bool = False
    cluster_k: int = 1

    def __post_init__(self):
        if self.activation is None:
            object.__setattr__(self, "activation", "none")
        self._check_dtype("dtype", _DTYPES)
        self._check_choice("activation", ACTIVATIONS)
        self._check_choice("mma", MMA_KINDS)
        for f in ("a_kmajor", "b_kmajor", "has_bias", "tma_store", "stream_k"):
            if not isinstance(getattr(self, f), bool):
                self._fail(f, "True or False")
        self._check_choice("block_m", (128, 256))
        self._check_int("block_n", 64, 256, multiple_of=8)
        if self.block_n % 64 and not (self.b_kmajor and self.mma == "wgmma"):
            self._fail("block_n", f"a multiple of 64 with b_kmajor={self.b_kmajor}, mma={self.mma!r} (a block_n off "
                                  "the 64-column grid needs B K-major, loaded as one box, and wgmma consumers)")
        self._check_int("block_k", 64, 64)
        self._check_int("num_stages", 2, 8)
        self._check_int("group_m", 1, 64)
        self._check_int("split_k", 1, MAX_SPLIT_K)
        if self.split_k > 1 and self.mma != "wgmma":
            self._fail("split_k", "1 with mma='sync' (the partials are stored from wgmma accumulators)")
        if self.stream_k and self.split_k > 1:
            self._fail("stream_k", f"False with split_k={self.split_k} (one schedule: split-K or stream-K)")
        if self.stream_k and self.mma != "wgmma":
            self._fail("stream_k", "False with mma='sync' (the partials are stored from wgmma accumulators)")
        self._check_int("cluster_k", min(CLUSTER_KS), max(CLUSTER_KS))
        if self.cluster_k > 1 and (self.split_k > 1 or self.stream_k):
            self._fail("cluster_k", f"1 with split_k={self.split_k}, stream_k={self.stream_k} "
                                    "(one schedule: split-K, stream-K or cluster-K)")
        if self.cluster_k > 1 and self.mma != "wgmma":
            self._fail("cluster_k", "1 with mma='sync' (the partials are handed over from wgmma accumulators)")
        if (self.block_m // 2) * self.block_n // 128 > 128:
            self._fail("block_n", f"at most {128 * 128 // (self.block_m // 2)} for block_m={self.block_m} "
                                  "(128 accumulators per consumer thread; more would spill)")
        if self.mma == "sync" and self.tma_store:
            self._fail("tma_store", "False with mma='sync' (its warps store C directly)")
        self._check_epilogue_and_smem()

    @property
    def stage_bytes(self) -> int:
        return (self.block_m + self.block_n) * self.block_k * 2

    def _exchange_smem(self) -> int:
        """cluster_k = 2: the receive buffer (one consumer warpgroup's float32 rows) and its two mbarriers."""
        return (self.block_m // 2) * self.block_n * 4 + 16 if self.cluster_k > 1 else 0

    def template_params(self):
        p = super().template_params()
        p.update(activation_id=ACTIVATIONS.index(self.activation), epilogue_n=self.epi_n,
                 shared_mem_bytes=self.shared_mem_bytes, producer_regs=_PRODUCER_REGS,
                 consumer_regs=_CONSUMER_REGS)
        return p


# ---- heuristics ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tile:
    block_m: int
    block_n: int
    num_stages: int
    efficiency: float   # relative tensor-core throughput when the SMs are busy
    why: str


# The persistent grid runs ceil(tiles / SMs) rounds of one tile per SM, so the cost model is
# rounds x tile area / efficiency (as matmul.py's, with one CTA per SM).
# Efficiencies: TFLOP/s relative to 128x256/4, bf16 4096^3 and 8192^3 on an H200 (132 SMs), from
# `tools/bench_matmul.py --sweep-sm90` (two runs; 128x256/4: 697-709 and 787-802 TFLOP/s, i.e.
# 0.96-0.97x and 1.01x cuBLAS).  m64n256 wgmmas read the fewest operand bytes per FLOP, so the
# widest tile wins once the problem fills the SMs.  group_m = 8: at 8192^3, 2, 4 and 16 lost 8-12%
# (704 / 709 / 733 vs 802; at 4096^3 all within 1%).  Kernel time through rtk.matmul, calls
# queued back to back (`tools/bench_matmul.py --quick`): 802 / 810 TFLOP/s = 1.00x / 1.01x cuBLAS
# (Triton, plain tiled: 766 / 773); the sweep's figures above are lower for both because it
# synchronizes after every call.
# Checked on partial waves with whole tiles launched directly (H200 2026-11-26, `--streamk-ab`,
# 128x256 / 128x192 / 128x128 us): the model's pick ran fastest at 512x6144x4096 (128x192: 44.9 /
# 37.2 / 46.1), 512x14336x4096 (128x256: 85.8 / 100 / 90.7), 512x28672x4096 (128x128: 173 / 165 /
# 162) and 3000x5000x2000 (128x256: 93.0 / 94.6 / 118); at 512x10240x8192 it picks 128x128 (131)
# where 128x192 ran 125, and stream-K (120) runs there instead (see the schedules below).
TILES = (
    _Tile(128, 256, 4, 1.00, "two m64n256 chains, 4 x 48 KiB ring: 709 / 802 TFLOP/s at 4096 / 8192"),
    _Tile(256, 128, 4, 0.93, "2 x m64n128 per warpgroup: 692-710 / 694-697 (0.99x / 0.87x of 128x256)"),
    # 3 N boxes: 623-638 / 698-701 (0.89x / 0.88x) at the squares; picked where its tile count fills
    # the last wave that 128x256's and 128x128's leave ragged: 512x6144x4096 is 4 x 32 = 128 tiles
    # (one wave of 132) against 96 of 128x256 and 192 (1.45 waves) of 128x128, and ran 37.2 us
    # against 44.9 / 46.1 (1.02x / 0.84x / 0.82x cuBLAS, H200 2026-11-26, `--streamk-ab`).
    _Tile(128, 192, 5, 0.89, "3 N boxes, 5 x 40 KiB ring: the wave filler between 128x256 and 128x128"),
    _Tile(128, 128, 6, 0.91, "half the tile, for SM fill on mid-size problems: 675-693 / 685-691 (0.97x / 0.86x)"),
    _Tile(128, 64, 8, 0.55, "thin N (N <= 64) or small problems only: 433 / 409 (0.61x / 0.51x)"),
)
# Tried by the autotuner, never picked without a measurement.
TUNE_ONLY = (
    _Tile(128, 256, 3, 1.00, "one 256-column epilogue pass, shallower ring: 702-714 / 724-736 (1.01x / 0.92x)"),
    _Tile(256, 128, 3, 0.89, "shallower ring: 645 / 677"),
)


def estimated_cost(tile: _Tile, m: int, n: int, batch: int, sm_count: int) -> float:
    tiles = arch_mod.matmul_tiles(m, n, tile.block_m, tile.block_n, batch=batch)
    rounds = -(-tiles // sm_count)
    return rounds * tile.block_m * tile.block_n / tile.efficiency


# ---- schedules: data-parallel, split-K, stream-K ----------------------------------------------
# The data-parallel schedule runs whole tiles, one per SM per round.  With fewer tiles than SMs
# (M = 128 x N = 4096: 32 tiles of 128 x 128 on 132 SMs), or a last round that leaves SMs idle
# (96, 160 or 480 tiles on 132 SMs), two schedules cut tiles along K instead, at the price of a
# float32 partial per piece that the tile's last piece reads back:
# * split-K (split_k = s): every tile in s equal k-ranges, one work unit each;
# * stream-K (stream_k): the last one or two waves' tiles as one k-block space, split evenly over
#   the CTAs (each CTA one contiguous range across tile boundaries); the rest runs whole.
# The model, in microseconds, fitted to the H100 (132 SMs) sweep of 2026-11-25
# (`tools/bench_matmul.py --splitk-sweep`, bf16, W (N, K); docs/data/matmul_splitk_sweep*.json):
#   time = max(compute, DRAM floor) + fixup
#   compute = rounds x (k-blocks per unit + SPLIT_FILL_KBLOCKS) x k-block time of the tile
#             (stream-K: ceil(tiles x k-blocks / SMs) + fill, the same on every CTA)
#   k-block time = KBLOCK_US x tile area / (128 x 256) / efficiency (TILES)
#   DRAM floor = (A + B + C bytes) / DRAM_BYTES_PER_US + DRAM_RAMP_US
#   fixup = FIXUP_US_PER_KIB x KiB of one float32 tile (0 for the data-parallel schedule)
# * KBLOCK_US = 0.69: a 128 x 256 k-block per SM with the SMs busy: 512x8192x8192 (128 tiles, one
#   round of 128 k-blocks) 89.8 us, 2048x4096x4096 (256 tiles, 2 rounds of 64) 88.7 us.
# * DRAM floor: the M = 128 shapes are bound by reading the weight once, whatever the split:
#   128x14336x4096 unsplit (112 tiles of 128 x 128) 47.9 us, 128x8192x28672 170 us (2.6-2.8 TB/s
#   over the weight); 128x4096x4096 never went below 23.0 us (s1 25.4, s2 23.0, s3 23.7, s4 24.1
#   on 32 / 64 / 96 / 128 SMs): bytes / 2.9 TB/s + 6 us fits these within 10%.
# * fixup: splitting costs a near-constant 4-5 us per 128 x 128 tile (64 KiB of partial) and 8-10 us
#   per 128 x 256 tile, whatever the split count: 128x4096x4096 128 x 128 s2-s4 23.0-24.1 us against
#   an 18.8 us floor, 128 x 256 s2 31.1 us against 22.8 us of main loop, s4-s8 28.1-32.1 us.
# * stream-K's fixup, STREAM_K_FIXUP_US = 14: what its 128 x 256 schedule ran above its compute term,
#   H200 2026-11-26 (`--streamk-ab`, lanes): 512 x {10240 x 8192, 14336 x 4096, 28672 x 4096,
#   6144 x 4096} and 3000x5000x2000 ran 120 / 89.8 / 169 / 47.2 / 102 us against 108 / 75.9 /
#   151 / 33.1 / 81.4 us of compute: 11.7-20.6 us more, median 14 (split-K's 8.4 us for a 128 x 256
#   tile, the value before, left stream-K 3-14% faster in the model than it ran).
# * the autotuner's split-K candidates (splits_for) only while the tiles leave two thirds of the
#   SMs idle (tiles <= SMs / SPLIT_MAX_TILES_DIV) and the units fit one round (tiles x s <= SMs):
#   128x6144x4096's 48 tiles of 128 x 128 ran 27.5 us unsplit and 29.5 us at s2; every split past
#   one round lost (512x4096x4096 128 x 128: s1 27.3, s2 38.7 us; 128x4096x4096 128 x 128 s6 / s8
#   33.7 / 33.9 us); its stream-K candidates above that (stream_k_weighed).
# * SCHEDULE_MARGIN: a cut schedule must beat whole tiles by 5% in the model (its error on the
#   sweeps is 5-10%).
# * MIN_KBLOCKS_PER_SPLIT = 4: the ring is 4-6 stages deep; a split shorter than its ring never
#   reaches steady state (the autotuner's candidates, splits_for / stream_k_weighed).
#
# The heuristic (heuristic_config), refit to the H200 A/B of 2026-11-26 where whole tiles of the
# right shape beat both cut schedules at every shape but one:
# 1. whole tiles of the TILES entry with the least estimated_cost (rounds x tile area / efficiency;
#    128x192 fills the waves the others leave ragged, see TILES);
# 2. split-K where the whole tiles keep at most SPLIT_MAX_FILL of the SMs busy and K is long: the
#    SPLIT_TILE tiles cut into the most splits s of SPLITS that fit one round (tiles x s <= SMs) and
#    keep SPLIT_MIN_KBLOCKS k-blocks each.  128x4096x14336 (64 tiles of 128 x 64, 224 k-blocks):
#    128 x 128 s3 41.4 us = 0.96x cuBLAS, s4 42.1, s2 45.1, whole 128 x 64 46.9, stream-K 128 x 64 /
#    128 x 128 50.4 / 44.8, 128 x 256 s4 49.5 (twice the partial per tile).  With 64 k-blocks the
#    fixup eats the gain: 128x4096x4096 whole 128 x 64 17.6 us, 128 x 128 s2-s4 19.6-19.8.
#    More than half the SMs busy: whole tiles (128x6144x4096 128 x 64 20.5 us, 128 x 128 s2 23.6;
#    128x8192x8192 128 x 64 43.1, 128 x 128 s2 44.9).
# 2b. thin tiles split to fill the SMs once (measured, H200 2026-11-26, `--streamk-ab --ab-shapes
#    128x4096x4096`: 128 x 64 s2 0.941x cuBLAS against whole 128 x 64 0.927x; the llm grid the same
#    day: 0.942x): where rule 2 splits nothing and the whole-tile pick is THIN_SPLIT_TILE
#    (128 x 64) keeping at most SPLIT_MAX_FILL of the SMs busy, its tiles in the most splits s of
#    SPLITS that fit one round and keep THIN_SPLIT_MIN_KBLOCKS k-blocks each.  Why: at M = 128 every
#    CTA streams its W columns at a near-constant rate (H200 grid 2026-11-26, W bytes / (kernel time
#    - 5 us of launch and ramp) / CTAs: 28-42 GB/s for 128 x 64 on 64 and 128 CTAs, 30-36 GB/s for
#    128 x 128 / 128 x 256 on 80-112 CTAs), so 64 CTAs leave half of the DRAM rate unused; with
#    s = 2 every SM streams a distinct half of its tile's W once.  The partial of a 128 x 64 tile is
#    32 KiB, a quarter of the 128 x 128 split's reads at the tile's last split (s2-s4 of 128 x 128
#    lost 2 us at 128x4096x4096 to their 64-192 KiB per tile).  128x4096x4096: 64 tiles -> 128 units
#    of 32 k-blocks (whole: 17.6 us, 0.93x).  The schedule model cannot rank it: its DRAM floor
#    (2.9 TB/s, fitted on the H100) is above what cuBLAS runs on the H200 (16.4 us).  2b is tried
#    before 2: at 128x4096x14336 (rule 2's own example) 128 x 64 s2 ran 0.978x / 0.994x cuBLAS
#    against rule 2's 128 x 128 s3 0.953x / 0.970x in two H200 runs (2026-11-26, sessions 10 and
#    11, `--lastcells-ab`): the thin split's partials are a quarter of the wide one's.
#    Two splits run as cluster-K (a 2-CTA cluster per tile, rank 1's f32 half-sum stored into rank
#    0's shared memory; no workspace, no second pass over global memory): H100 2026-11-26,
#    `--lastcells-ab`, cuBLAS in the same rounds: 128x4096x14336 s2 51.5 us -> c2 48.7 (1.09x ->
#    1.15x cuBLAS), 128x4096x4096 20.8 -> 19.5 (0.86x -> 0.92x; whole tiles 19.4).
# 3. stream-K of 128 x 256 tiles only where (a) there is at least one full wave of them (below it,
#    at M = 128, every stream-K schedule lost to whole tiles or split-K: 0.49-0.89x cuBLAS against
#    0.92-0.96x), (b) every wave shape of WAVE_TILES leaves the SMs idle for more than
#    1 - STREAM_K_MAX_FILL of its rounds, and (c) the model puts it SCHEDULE_MARGIN below the best
#    of them.  512x10240x8192: 160 / 216 / 320 tiles fill 61 / 82 / 81% of their 2 / 2 / 3 rounds;
#    stream-K 120 us (0.93x) against 125 (128x192) and 131 (128x128).  Not at 512x14336x4096 (fill
#    85%: 128x256 whole 85.8 us, stream-K 89.8; (c) says 89.9 against 89.7 modelled), 512x6144x4096
#    and 512x28672x4096 (97%: 37.2 / 162 us whole, 45.7-48.4 / 169 streamed) nor 3000x5000x2000
#    (91%: 93.0 whole, 102 streamed).
SPLITS = (1, 2, 3, 4, 6, 8)
KBLOCK_US = 0.69
DRAM_BYTES_PER_US = 2.9e6
DRAM_RAMP_US = 6.0
FIXUP_US_PER_KIB = 0.066
STREAM_K_FIXUP_US = 14.0
SPLIT_FILL_KBLOCKS = 1.0
SPLIT_MAX_TILES_DIV = 3
SCHEDULE_MARGIN = 0.95
MIN_KBLOCKS_PER_SPLIT = 4
SPLIT_MAX_FILL = 0.5
SPLIT_TILE = (128, 128)
SPLIT_MIN_KBLOCKS = 64
THIN_SPLIT_TILE = (128, 64)
THIN_SPLIT_MIN_KBLOCKS = 32   # 4 passes of the 8-stage ring per split
STREAM_K_TILE = (128, 256)
WAVE_TILES = ((128, 256), (128, 192), (128, 128))
STREAM_K_MAX_FILL = 0.9


# ---- tiles off the 64-column grid (K-major B) ---------------------------------------------------
# With B K-major (a linear layer's weight W (N, K), ``x @ W.T``) B is one TMA box of block_n rows,
# and wgmma takes any N that is a multiple of 8, so block_n need not be 64, 128, 192 or 256: a
# width that divides N into as many column tiles as fill the SMs' last round costs the problem
# less padded work.  3000x5000x2000: 128 x 256 gives 24 x 20 = 480 tiles, 3.64 rounds of 132 (a
# quarter of the SMs idle in the 4th); 128 x 232 gives 24 x 22 = 528, 4 rounds of equal tiles, 9%
# less work on every SM (cuBLAS picks 152 x 256 tiles there, the N of its wgmma fitted to M).  The
# kernel stores the columns past the last whole 64-column box with direct stores (TMA_N).
# Measured (H100, 2026-11-26, `tools/bench_matmul.py --lastcells-ab`, x @ W.T bf16, cuBLAS in the
# same rounds; the heuristic's pick before -> the flexible tile):
#   512x10240x8192   stream-K 128x256 0.926x -> 128x160 0.975x (whole 128x256 0.692x, 128x128 0.873x)
#   512x14336x4096   128x256 1.02x -> 128x224 1.07x
#   512x28672x4096   128x128 0.969x -> 128x224 0.986x
#   3000x5000x2000   128x256 0.848x -> 128x232 0.863x (the model said 8% less work: the rest of the
#                    gap is elsewhere - both warpgroups' epilogue runs while the tensor cores idle)
#   128x28672x4096   1.02x either way (bound by reading W)
# and where the model puts them level, not taken: 2048x14336x4096 128x256 1.00x vs 128x224 0.968x,
# 8192^3 1.06x vs 1.00x (224) / 0.97x (240): at equal rounds a narrower tile reads more operand
# bytes per FLOP, and the large squares are where that shows.
FLEX_NS = tuple(range(136, 256, 8))
# A flexible tile is taken only where the model puts it this far below the best of TILES: the
# model's rounds x area ignores what the odd width costs (the direct stores of its last columns).
FLEX_MARGIN = 0.95


def flex_efficiency(block_n: int) -> float:
    """Efficiency of a 128-row tile of width ``block_n`` for the cost model: linear between
    128 x 128's 0.91 and 128 x 256's 1.00 (TILES; narrower m64nN wgmmas read more operand bytes
    per FLOP)."""
    return 0.91 + 0.09 * (block_n - 128) / 128


@lru_cache(maxsize=None)
def flex_stages(block_n: int) -> int:
    """The deepest ring (at most 6 stages, as 128 x 128's) of a 128 x ``block_n`` tile whose
    shared memory fits with one 64-column epilogue pass."""
    return deepest_ring(6, 3, block_m=128, block_n=block_n, b_kmajor=True, epilogue_n=64) or 2


def deepest_ring(most: int, least: int, **fields) -> int | None:
    """The largest num_stages from ``most`` down to ``least`` with which ``MatmulSm90Config(**fields)``
    validates (its shared memory fits), or None."""
    for st in range(most, least - 1, -1):
        try:
            MatmulSm90Config(**{**fields, "num_stages": st})
            return st
        except ConfigError:
            continue
    return None


# GELU's epilogue beside 116-120 accumulators: 128 x 232 and 128 x 240 spill 4 bytes (ptxas 13.0;
# 224 and 248 do not), so with GELU the widths stop at 224 (tests/test_matmul_sm90.py compiles every
# width the heuristic may pick, with each activation, and checks for spills).
FLEX_MAX_N_GELU = 224


def flex_tiles(m: int, n: int, batch: int, sm_count: int, activation: str = "none") -> list[_Tile]:
    """The 128 x block_n tiles (block_n in FLEX_NS, at most FLEX_MAX_N_GELU with GELU), least
    estimated_cost first; ties go to the wider tile (fewer operand bytes per FLOP)."""
    widths = [bn for bn in FLEX_NS if activation != "gelu" or bn <= FLEX_MAX_N_GELU]
    tiles = [_Tile(128, bn, flex_stages(bn), flex_efficiency(bn), "flexible N") for bn in widths]
    return sorted(tiles, key=lambda t: (estimated_cost(t, m, n, batch, sm_count), -t.block_n))


def flex_tile(m: int, n: int, batch: int, sm_count: int, activation: str = "none") -> _Tile:
    """Rule 4's candidate: the first of :func:`flex_tiles`."""
    return flex_tiles(m, n, batch, sm_count, activation)[0]


def k_blocks(k: int) -> int:
    """64-deep k-blocks of K (the last one zero-filled by TMA)."""
    return max(1, -(-k // 64))


def _kblock_us(tile: _Tile) -> float:
    return KBLOCK_US * tile.block_m * tile.block_n / (128 * 256) / tile.efficiency


def dram_floor_us(m: int, n: int, k: int, batch: int) -> float:
    """The model's lower bound on any schedule's time: the operands and C moved once (16-bit)."""
    return 2.0 * batch * (m * k + k * n + m * n) / DRAM_BYTES_PER_US + DRAM_RAMP_US


def schedule_us(tile: _Tile, m: int, n: int, k: int, batch: int, sm_count: int, split_k: int = 1,
                stream_k: bool = False, floor: bool = True) -> float:
    """Modelled time of ``tile`` with ``split_k`` splits or the stream-K schedule (see above);
    ``floor``: with the DRAM floor."""
    kb = k_blocks(k)
    tiles = arch_mod.matmul_tiles(m, n, tile.block_m, tile.block_n, batch=batch)
    per = _kblock_us(tile)
    fix = FIXUP_US_PER_KIB * tile.block_m * tile.block_n * 4 / 1024
    if stream_k:
        compute = (-(-tiles * kb // sm_count) + SPLIT_FILL_KBLOCKS) * per
        # G dividing the tiles leaves nothing to stream; other tiles' fixup scaled by their area
        fix = STREAM_K_FIXUP_US * tile.block_m * tile.block_n / (128 * 256) if tiles % sm_count else 0.0
    else:
        split_k = min(split_k, kb)
        rounds = -(-tiles * split_k // sm_count)
        compute = rounds * (-(-kb // split_k) + SPLIT_FILL_KBLOCKS) * per
        fix = fix if split_k > 1 else 0.0
    return (max(compute, dram_floor_us(m, n, k, batch)) if floor else compute) + fix


def split_cost(tile: _Tile, m: int, n: int, k: int, batch: int, sm_count: int, split_k: int) -> float:
    """Modelled time of ``tile`` with ``split_k`` splits (schedule_us with the floor)."""
    return schedule_us(tile, m, n, k, batch, sm_count, split_k)


def splits_for(tile: _Tile, m: int, n: int, k: int, batch: int, sm_count: int) -> tuple[int, ...]:
    """The split counts the heuristic weighs for ``tile``: 1, and more only while the tiles leave
    two thirds of the SMs idle, the units fit one round and each keeps MIN_KBLOCKS_PER_SPLIT
    k-blocks."""
    tiles = arch_mod.matmul_tiles(m, n, tile.block_m, tile.block_n, batch=batch)
    if tiles > sm_count // SPLIT_MAX_TILES_DIV:
        return (1,)
    most = k_blocks(k) // MIN_KBLOCKS_PER_SPLIT
    return tuple(s for s in SPLITS if s == 1 or (s <= most and tiles * s <= sm_count))


def stream_k_weighed(tile: _Tile, m: int, n: int, k: int, batch: int, sm_count: int) -> bool:
    """Whether the heuristic weighs stream-K for ``tile``: more tiles than split-K takes, a last
    round that leaves SMs idle, and MIN_KBLOCKS_PER_SPLIT k-blocks per CTA at least."""
    tiles = arch_mod.matmul_tiles(m, n, tile.block_m, tile.block_n, batch=batch)
    return (tiles > sm_count // SPLIT_MAX_TILES_DIV and tiles % sm_count != 0
            and tiles * k_blocks(k) >= MIN_KBLOCKS_PER_SPLIT * sm_count)


def stream_k_partition(tiles: int, k_tiles: int, grid: int, lanes: int = 1):
    """The stream-K schedule of templates/matmul_sm90.cu.j2 (Walk, unit_at, fixup_of), in Python:
    (sk_tiles, ctas) where ``ctas[c]`` lists CTA c's work units in order as (tile, kb0, kb1, segs,
    seg, slot, slots): ``segs`` pieces of the tile (1: whole, no partial), this one's index ``seg``
    in k order, its workspace slot and the slots of all the tile's pieces in k order (None for
    whole tiles).  ``lanes`` (R, dividing ``grid`` and ``tiles``): groups of R CTAs share each
    range, CTA gR + r running tile jR + r of every set j its group's range meets."""
    full, rem = divmod(tiles, grid)
    sk_tiles = 0 if rem == 0 else (rem + grid if full >= 1 else rem)
    S = sk_tiles // lanes * k_tiles
    P = min(grid // lanes, S)
    group_of = lambda i: ((i + 1) * P - 1) // S   # noqa: E731 - the owner of iteration i
    start = lambda g: g * S // P                  # noqa: E731
    ctas = []
    for c in range(grid):
        g, r = divmod(c, lanes)
        units = []
        if g < P:
            it0, it1 = start(g), start(g + 1)
            for j in range(it0 // k_tiles, (it1 - 1) // k_tiles + 1):
                lo = j * k_tiles
                g_first, g_last = group_of(lo), group_of(lo + k_tiles - 1)
                segs = g_last - g_first + 1
                kb0, kb1 = max(it0, lo) - lo, min(it1, lo + k_tiles) - lo
                t = j * lanes + r
                if segs == 1:
                    units.append((t, kb0, kb1, 1, 0, None, None))
                    continue
                c_first = g_first * lanes + r
                first = 2 * c_first + (0 if start(g_first) == lo else 1)
                slots = [first] + [2 * (c_first + i * lanes) for i in range(1, segs)]
                units.append((t, kb0, kb1, segs, g - g_first, 2 * c + (0 if lo + kb0 == it0 else 1), slots))
        units += [(t, 0, k_tiles, 1, 0, None, None) for t in range(sk_tiles + c, tiles, grid)]
        ctas.append(units)
    return sk_tiles, ctas


def tail_args(cfg: "MatmulSm90Config", m: int, sm_count: int) -> tuple:
    """The kernel's arguments after the shared ones: stream-K's lanes, none for other schedules."""
    return (stream_k_lanes(cfg, m, sm_count),) if cfg.stream_k else ()


def stream_k_lanes(cfg: "MatmulSm90Config", m: int, sm_count: int) -> int:
    """Stream-K's lanes R: how many tiles of one B column (consecutive in the tile walk) run the
    same k-blocks side by side.  The most that divide the tile rows of every group_m group (the
    sets must not straddle a column) and the SM count (the grid stays one CTA per SM), up to
    group_m.  Measured reason: see "Lanes" in templates/matmul_sm90.cu.j2 (without them the
    phase read B once per tile row from DRAM)."""
    tiles_m = -(-m // cfg.block_m)
    rows = tiles_m if tiles_m <= cfg.group_m else math.gcd(tiles_m, cfg.group_m)
    return max(r for r in range(1, rows + 1) if rows % r == 0 and sm_count % r == 0)


def workspace_bytes(cfg: "MatmulSm90Config", m: int, n: int, k: int, batch: int, grid: int = 0) -> int:
    """Split-K partials: one float32 tile per (tile, split); stream-K: two per CTA of ``grid``;
    0 for neither."""
    area4 = cfg.block_m * cfg.block_n * 4
    if cfg.stream_k:
        return 2 * grid * area4
    splits = min(cfg.split_k, k_blocks(k))
    if splits == 1:
        return 0
    return arch_mod.matmul_tiles(m, n, cfg.block_m, cfg.block_n, batch=batch, split_k=splits) * area4


def counter_bytes(cfg: "MatmulSm90Config", m: int, n: int, batch: int, grid: int = 0) -> int:
    """Split-K / stream-K counters: one int32 per (tile, consumer warpgroup) (stream-K: of its
    first 2 x ``grid`` tiles, where its pieces are); 0 for neither."""
    tiles = arch_mod.matmul_tiles(m, n, cfg.block_m, cfg.block_n, batch=batch)
    if cfg.stream_k:
        return min(tiles, 2 * grid) * 2 * 4
    return 0 if cfg.split_k == 1 else tiles * 2 * 4


def _config(tile: _Tile, dtype: str, split_k: int = 1, stream_k: bool = False, **layout) -> MatmulSm90Config:
    return MatmulSm90Config(dtype=dtype, block_m=tile.block_m, block_n=tile.block_n, num_stages=tile.num_stages,
                            split_k=split_k, stream_k=stream_k, **layout)


def cluster_stages(block_m: int, block_n: int, cluster_k: int = 2, tma_store: bool = True,
                   b_kmajor: bool = False) -> int:
    """The deepest ring (at most the TILES entry's depth, else 8) that fits shared memory beside
    the cluster-K receive buffer: 128 x 64 8 stages, 128 x 128 5, 128 x 192 4, 128 x 256 3."""
    most = next((t.num_stages for t in TILES if (t.block_m, t.block_n) == (block_m, block_n)), 8)
    st = deepest_ring(most, 2, block_m=block_m, block_n=block_n, cluster_k=cluster_k, tma_store=tma_store,
                      b_kmajor=b_kmajor)
    if st is not None:
        return st
    raise ConfigError.bad_value("matmul_sm90", "cluster_k", cluster_k,
                                f"1 for a {block_m} x {block_n} tile (its receive buffer leaves no room for a ring)")


def with_cluster_k(cfg: MatmulSm90Config, cluster_k: int) -> MatmulSm90Config:
    """``cfg`` as a cluster-K schedule (split_k 1, no stream-K, the ring cut to fit; 1: ``cfg`` without
    cluster-K, its ring back at the tile's own depth)."""
    if cluster_k == 1:
        if cfg.cluster_k == 1:
            return cfg
        depth = next((t.num_stages for t in TILES if (t.block_m, t.block_n) == (cfg.block_m, cfg.block_n)),
                     cfg.num_stages)
        return dataclasses.replace(cfg, cluster_k=1, num_stages=depth)
    st = min(cfg.num_stages, cluster_stages(cfg.block_m, cfg.block_n, cluster_k, cfg.tma_store, cfg.b_kmajor))
    return dataclasses.replace(cfg, split_k=1, stream_k=False, cluster_k=cluster_k, num_stages=st)


def whole_tile_fill(tile: _Tile, m: int, n: int, batch: int, sm_count: int) -> float:
    """The share of its rounds' SM slots that whole tiles of ``tile`` keep busy: tiles / (rounds x SMs)."""
    tiles = arch_mod.matmul_tiles(m, n, tile.block_m, tile.block_n, batch=batch)
    return tiles / (-(-tiles // sm_count) * sm_count)


def _tile(shape: tuple[int, int]) -> _Tile:
    return next(t for t in TILES if (t.block_m, t.block_n) == shape)


def heuristic_split_k(dp: _Tile, m: int, n: int, k: int, batch: int, sm_count: int) -> int:
    """Rule 2 above: the split count of SPLIT_TILE tiles where whole tiles of ``dp`` keep at most
    SPLIT_MAX_FILL of the SMs busy and K is long; 1 elsewhere."""
    if arch_mod.matmul_tiles(m, n, dp.block_m, dp.block_n, batch=batch) > SPLIT_MAX_FILL * sm_count:
        return 1
    return _one_round_split(arch_mod.matmul_tiles(m, n, *SPLIT_TILE, batch=batch), k, sm_count, SPLIT_MIN_KBLOCKS)


def thin_split_k(dp: _Tile, m: int, n: int, k: int, batch: int, sm_count: int) -> int:
    """Rule 2b above: the split count of ``dp``'s own tiles where ``dp`` is THIN_SPLIT_TILE and its
    whole tiles keep at most SPLIT_MAX_FILL of the SMs busy; 1 elsewhere."""
    tiles = arch_mod.matmul_tiles(m, n, dp.block_m, dp.block_n, batch=batch)
    if (dp.block_m, dp.block_n) != THIN_SPLIT_TILE or tiles > SPLIT_MAX_FILL * sm_count:
        return 1
    return _one_round_split(tiles, k, sm_count, THIN_SPLIT_MIN_KBLOCKS)


def _one_round_split(tiles: int, k: int, sm_count: int, min_kblocks: int) -> int:
    """The most splits of SPLITS whose ``tiles`` x s units fit one round on the SMs with at least
    ``min_kblocks`` k-blocks each (1 when none does)."""
    return max(s for s in SPLITS if s == 1 or (tiles * s <= sm_count and k_blocks(k) // s >= min_kblocks))


def stream_k_pays(m: int, n: int, k: int, batch: int, sm_count: int) -> bool:
    """Rule 3 above: a full wave of STREAM_K_TILE tiles, a ragged last wave for every shape of
    WAVE_TILES, and the model's stream-K time SCHEDULE_MARGIN below their best."""
    sk = _tile(STREAM_K_TILE)
    if arch_mod.matmul_tiles(m, n, sk.block_m, sk.block_n, batch=batch) <= sm_count:
        return False
    wave = [_tile(s) for s in WAVE_TILES]
    if max(whole_tile_fill(t, m, n, batch, sm_count) for t in wave) >= STREAM_K_MAX_FILL:
        return False
    whole = min(schedule_us(t, m, n, k, batch, sm_count) for t in wave)
    return schedule_us(sk, m, n, k, batch, sm_count, stream_k=True) < SCHEDULE_MARGIN * whole


def heuristic_config(dtype: str, m: int, n: int, k: int, batch: int = 1, *, sm_count: int = 132,
                     stream_k: bool = False, rows_128b: bool = False, **layout) -> MatmulSm90Config:
    """The heuristic's config (rules 1-5 and 2b above); ``layout``: a_kmajor, b_kmajor, has_bias, activation,
    tma_store, mma.  ``stream_k``: also weigh the stream-K schedule (rtk.matmul does unless
    RTKERNELS_MATMUL_STREAM_K=0; see matmul.STREAM_K_ENV).  ``rows_128b``: every row of A and B starts
    on a 128-byte boundary (rule 5 applies only where they do not; False assumes the worst)."""
    # mma.sync warps hold block_m / 2 rows: a 256-row tile gives 128 x 32 warp tiles, which read
    # twice the fragment bytes per HMMA of 64 x 64 (the shared-memory bandwidth mma.sync is short of)
    wgmma = layout.get("mma", "wgmma") == "wgmma"
    tiles = TILES if wgmma else [t for t in TILES if t.block_m == 128]
    # 1. whole tiles; ties go to the smaller tile (less work wasted on the zero-filled border)
    dp = min(tiles, key=lambda t: (estimated_cost(t, m, n, batch, sm_count), t.block_m * t.block_n))
    if not wgmma:   # the partials are stored from wgmma accumulators
        return _config(dp, dtype, **layout)
    # 2b before 2: where the whole-tile pick is the thin tile, its own split wins (see 2b)
    split_k = thin_split_k(dp, m, n, k, batch, sm_count)
    if split_k == 2:   # the same two halves of K, summed on chip (2b's cluster-K note)
        return with_cluster_k(_config(dp, dtype, **layout), 2)
    if split_k > 1:
        return _config(dp, dtype, split_k, **layout)
    split_k = heuristic_split_k(dp, m, n, k, batch, sm_count)
    if split_k > 1:
        return _config(_tile(SPLIT_TILE), dtype, split_k, **layout)
    # 4. a tile off the 64-column grid where it fills the rounds (K-major B; before stream-K, which
    #    it beat where both apply: see FLEX_NS)
    if layout.get("b_kmajor"):
        flex = flex_tile(m, n, batch, sm_count, layout.get("activation") or "none")
        if estimated_cost(flex, m, n, batch, sm_count) < FLEX_MARGIN * estimated_cost(dp, m, n, batch, sm_count):
            return short_k_ring(_config(flex, dtype, **layout), k, rows_128b)
    if stream_k and stream_k_pays(m, n, k, batch, sm_count):
        return _config(_tile(STREAM_K_TILE), dtype, stream_k=True, **layout)
    return short_k_ring(_config(dp, dtype, **layout), k, rows_128b)


# 5. Short K: a whole-tile config whose C staging fits only part of the tile beside its ring (so
#    the epilogue runs in passes) takes one ring stage less where that makes it one pass, when K is
#    at most SHORT_K_KBLOCKS k-blocks.  Measured (H100, 2026-11-26, `--lastcells-ab`, two runs):
#    3000x5000x2000 (32 k-blocks) 128x232/4 (passes of 128 + 64) 0.842-0.844x cuBLAS, /3 (one pass
#    of 192) 0.879-0.881x; 128x256/4 0.850-0.855x, /3 0.880x.  Two 64-column staging buffers
#    instead, the ring kept (double-buffered passes, tried and removed), gained 1% (0.854x): the
#    passes themselves cost, not the wait for the TMA store's read.  With 64 k-blocks the deeper
#    ring wins: 4096^3 128x256 /4 1.00x, /3 0.985x; 512x14336x4096 128x232 /4 1.03-1.04x, /3 0.98x.
#    Only for rows off the 128-byte grid (K = 2000: 4000-byte rows): where A's and B's rows are
#    128-byte aligned the deeper ring wins at short K too (H100, 2026-11-27, --lastcells-ab, same
#    rounds, /3 against /4): 3000x5000x2048 0.926-0.929 / 0.950-0.951, 3000x5000x1024 0.898-0.911
#    / 0.942-0.953, 3072x5104x2048 0.924 / 0.949, 3000x5000x1984 0.928 / 0.937, 128 x 256 at
#    8192x4096x256 1.03 / 1.10, 2048x4096x128 1.04 / 1.07, 2048x16384x128 1.02-1.03 / 1.04; while at
#    K = 2000 /3 still wins: 3000x5000x2000 0.877-0.882 / 0.838-0.845, 3072x5104x2000 0.897 / 0.86.
SHORT_K_KBLOCKS = 32


def short_k_ring(cfg: MatmulSm90Config, k: int, rows_128b: bool = False) -> MatmulSm90Config:
    """Rule 5: ``cfg`` with one ring stage less where K is short, the operands' rows are off the
    128-byte grid (not ``rows_128b``) and that makes its epilogue one pass."""
    if rows_128b or k_blocks(k) > SHORT_K_KBLOCKS or not cfg.tma_store or cfg.epi_n >= cfg.tma_n or \
            cfg.num_stages <= 2:
        return cfg
    shorter = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return shorter if shorter.epi_n == shorter.tma_n else cfg


def candidate_configs(dtype: str, **layout) -> list[MatmulSm90Config]:
    out = []
    for t in TILES + TUNE_ONLY:
        try:
            out.append(_config(t, dtype, **layout))
        except ConfigError:
            pass
    return out


def split_candidates(dtype: str, m: int, n: int, k: int, batch: int, sm_count: int, **layout) -> list[MatmulSm90Config]:
    """Split-K / stream-K configs the autotuner adds for this shape: each heuristic tile with the
    split count the model likes best for it, and with stream-K where it is weighed (none for
    mma.sync consumers)."""
    if layout.get("mma", "wgmma") != "wgmma":
        return []
    out = []
    for t in TILES:
        splits = [s for s in splits_for(t, m, n, k, batch, sm_count) if s > 1]
        if splits:
            best = min(splits, key=lambda s: split_cost(t, m, n, k, batch, sm_count, s))
            out.append(_config(t, dtype, best, **layout))
        if stream_k_weighed(t, m, n, k, batch, sm_count):
            out.append(_config(t, dtype, stream_k=True, **layout))
    return out


# ---- eligibility and launch -----------------------------------------------------------------
def _tma_stride(s: int, extent: int, inner_bytes: int) -> int | None:
    """A stride (elements) the tensor map accepts, or None; a dim of extent 1 has no real stride
    and gets a harmless 16-byte multiple."""
    if extent == 1:
        return max(8, -(-inner_bytes // 16) * 8)
    return s if s > 0 and s % 8 == 0 else None


def operand_maps(ptr: int, rows: int, cols: int, ld: int, batch: int, batch_stride: int):
    """(shape, strides) outermost-first of a (batch, rows, cols) operand with unit column stride,
    or None when TMA cannot address it."""
    if ptr % 16:
        return None
    ld_ = _tma_stride(ld, rows, cols * 2)
    if ld_ is None:
        return None
    bs = _tma_stride(batch_stride, batch, rows * ld_ * 2)
    if bs is None:
        return None
    return (batch, rows, cols), (bs, ld_, 1)


def grid_size(m: int, n: int, batch: int, cfg: MatmulSm90Config, sm_count: int, k: int = 1) -> int:
    """CTAs of the persistent grid: one per work unit (tile x split; ``k`` for the clamp of
    split_k to the k-blocks), at most one per SM; stream-K: one per SM (at most one per k-block:
    the kernel gives every sharing CTA one k-block at least), a multiple of its lanes (R divides
    the SM count and the tiles, so that is the same number); cluster-K: cluster_k CTAs per tile, at
    most one CTA per SM, whole clusters."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n) * batch
    if cfg.cluster_k > 1:
        # whole clusters, one CTA per SM: SMs pair up within a TPC, so sm_count / 2 two-CTA clusters
        # are co-resident (reasoned; a grid past that would only queue, no CTA waits on another cluster)
        return max(1, min(tiles, sm_count // cfg.cluster_k)) * cfg.cluster_k
    units = tiles * (k_blocks(k) if cfg.stream_k else min(cfg.split_k, k_blocks(k)))
    grid = max(1, min(units, sm_count))
    if cfg.stream_k:
        lanes = stream_k_lanes(cfg, m, sm_count)
        grid = max(lanes, grid // lanes * lanes)
    return grid


def tensor_maps(cfg: MatmulSm90Config, a_desc, b_desc, c_desc):
    """The three tensor-map arguments; each ``*_desc`` is (ptr, shape, strides) from operand_maps."""
    from ..tma import tensor_map
    a_box = (1, cfg.block_m, 64) if cfg.a_kmajor else (1, 64, 64)
    b_box = (1, cfg.block_n, 64) if cfg.b_kmajor else (1, 64, 64)
    ma = tensor_map(a_desc[0], cfg.dtype, a_desc[1], a_desc[2], a_box)
    mb = tensor_map(b_desc[0], cfg.dtype, b_desc[1], b_desc[2], b_box)
    mc = tensor_map(c_desc[0], cfg.dtype, c_desc[1], c_desc[2], (1, cfg.block_m // 2, 64)) if cfg.tma_store else ma
    return ma, mb, mc
