"""matmul on Hopper: TMA + wgmma, warp-specialized and persistent (templates/matmul_sm90.cu.j2).

:func:`rtkernels.matmul` calls :func:`launch` on sm_90 devices when :func:`eligible` says the
tensor memory accelerator can address the operands (16-byte aligned bases and strides, K >= 1);
everything else (sm_80/86/89, K = 9 bfloat16 rows, float32) runs the mma.sync kernel of
``matmul.py``.  The op's argument checks live there; this module has the config, the heuristic
and the launch.  ``mma="sync"`` swaps the wgmma consumers for ldmatrix + mma.sync ones behind the
same TMA producer (a measurement of the sm_80 instruction on Hopper; see docs/RESULTS.md).
"""
from __future__ import annotations

from dataclasses import dataclass
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


class HopperMatmulTile:
    """What the Hopper matmul configs share (bf16/fp16 here, fp8 in matmul_fp8): three warpgroups,
    the C staging buffer's width and the shared-memory total.  Needs the fields block_m, block_n,
    num_stages, tma_store, epilogue_n and the property stage_bytes."""

    def _check_epilogue_and_smem(self) -> None:
        """epilogue_n divides the tile in 64-column steps, and the ring with the smallest epilogue
        staging fits shared memory."""
        if self.epilogue_n:
            self._check_int("epilogue_n", 64, self.block_n, multiple_of=64)
            if self.block_n % self.epilogue_n:
                self._fail("epilogue_n", f"0 or a divisor of block_n={self.block_n} that is a multiple of 64")
        if self.shared_mem_bytes > _SMEM_LIMIT:
            self._fail("num_stages", f"small enough for {_SMEM_LIMIT} bytes of shared memory (needs "
                                     f"{self.shared_mem_bytes} with the smallest epilogue staging)")

    @property
    def threads_per_block(self) -> int:
        return 384

    def _smem(self, epi_n: int) -> int:
        c = self.block_m * epi_n * 2 if self.tma_store else 0
        return 1024 + self.num_stages * self.stage_bytes + c + 16 * self.num_stages

    @property
    def epi_n(self) -> int:
        """Columns per epilogue pass: ``epilogue_n``, or the widest divisor of block_n (>= 64)
        whose staging buffer fits beside the ring."""
        if self.epilogue_n or not self.tma_store:
            return self.epilogue_n or self.block_n
        n = self.block_n
        while n > 64 and (self.block_n % n or self._smem(n) > _SMEM_LIMIT):
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
    """

    family: ClassVar[str] = "matmul_sm90"
    template: ClassVar[str] = "matmul_sm90.cu.j2"
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

    def __post_init__(self):
        if self.activation is None:
            object.__setattr__(self, "activation", "none")
        self._check_dtype("dtype", _DTYPES)
        self._check_choice("activation", ACTIVATIONS)
        self._check_choice("mma", MMA_KINDS)
        for f in ("a_kmajor", "b_kmajor", "has_bias", "tma_store"):
            if not isinstance(getattr(self, f), bool):
                self._fail(f, "True or False")
        self._check_choice("block_m", (128, 256))
        self._check_int("block_n", 64, 256, multiple_of=64)
        self._check_int("block_k", 64, 64)
        self._check_int("num_stages", 2, 8)
        self._check_int("group_m", 1, 64)
        self._check_int("split_k", 1, MAX_SPLIT_K)
        if self.split_k > 1 and self.mma != "wgmma":
            self._fail("split_k", "1 with mma='sync' (the partials are stored from wgmma accumulators)")
        if (self.block_m // 2) * self.block_n // 128 > 128:
            self._fail("block_n", f"at most {128 * 128 // (self.block_m // 2)} for block_m={self.block_m} "
                                  "(128 accumulators per consumer thread; more would spill)")
        if self.mma == "sync" and self.tma_store:
            self._fail("tma_store", "False with mma='sync' (its warps store C directly)")
        self._check_epilogue_and_smem()

    @property
    def stage_bytes(self) -> int:
        return (self.block_m + self.block_n) * self.block_k * 2

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
TILES = (
    _Tile(128, 256, 4, 1.00, "two m64n256 chains, 4 x 48 KiB ring: 709 / 802 TFLOP/s at 4096 / 8192"),
    _Tile(256, 128, 4, 0.93, "2 x m64n128 per warpgroup: 692-710 / 694-697 (0.99x / 0.87x of 128x256)"),
    _Tile(128, 128, 6, 0.91, "half the tile, for SM fill on mid-size problems: 675-693 / 685-691 (0.97x / 0.86x)"),
    _Tile(128, 64, 8, 0.55, "thin N (N <= 64) or small problems only: 433 / 409 (0.61x / 0.51x)"),
)
# Tried by the autotuner, never picked without a measurement.
TUNE_ONLY = (
    _Tile(128, 256, 3, 1.00, "one 256-column epilogue pass, shallower ring: 702-714 / 724-736 (1.01x / 0.92x)"),
    _Tile(128, 192, 5, 0.89, "3 N boxes: 623-638 / 698-701 (0.89x / 0.88x); 128x192 tiles divide 6144-wide N"),
    _Tile(256, 128, 3, 0.89, "shallower ring: 645 / 677"),
)


def estimated_cost(tile: _Tile, m: int, n: int, batch: int, sm_count: int) -> float:
    tiles = arch_mod.matmul_tiles(m, n, tile.block_m, tile.block_n, batch=batch)
    rounds = -(-tiles // sm_count)
    return rounds * tile.block_m * tile.block_n / tile.efficiency


# ---- split-K ------------------------------------------------------------------------------------
# With fewer output tiles than SMs (M = 128 x N = 4096: 16 tiles of 128 x 256 on 132 SMs) most SMs
# idle; splitting each tile's K range over ``split_k`` work units fills them, at the price of a
# float32 partial per unit that the tile's last unit reads back.  The cost model extends
# rounds x tile area / efficiency with K (the unsplit choice is unchanged: for split_k = 1 the
# cost is the old one times (k-blocks + SPLIT_FILL_KBLOCKS), the same for every tile):
#   rounds(units = tiles x split_k) x [tile MACs of ceil(k-blocks / split_k) + fill) / efficiency
#                                      + PARTIAL_BYTE_MACS x partial bytes x (1 + split_k)]
# (one partial written by each unit, split_k read by a tile's last one, on the round's critical path).
# The constants are reasoned, not yet measured (tools/bench_matmul.py --splitk-sweep refits them):
# * PARTIAL_BYTE_MACS = 32: an SM's tensor cores do 2048 bf16 MACs per clock (989 TFLOP/s over 132
#   SMs at 1.83 GHz) and it moves ~64 bytes per clock to or from L2, where the partials live.
# * SPLIT_FILL_KBLOCKS = 1: a unit's fixed cost (the ring's first TMA round trip, ~1 us, against
#   ~0.5 us per 128 x 256 k-block at full rate; the epilogue is paid once per tile either way).
# * MIN_KBLOCKS_PER_SPLIT = 4: the ring is 4-6 stages deep; a unit shorter than its ring never
#   reaches steady state, and its fill and partial outweigh its main loop.
# * splits are considered only when the tiles alone leave SMs idle (tiles < SMs): above one round
#   a split only trades the last round's quantization for partial traffic.
SPLITS = (1, 2, 3, 4, 6, 8)
PARTIAL_BYTE_MACS = 32.0
SPLIT_FILL_KBLOCKS = 1.0
MIN_KBLOCKS_PER_SPLIT = 4


def k_blocks(k: int) -> int:
    """64-deep k-blocks of K (the last one zero-filled by TMA)."""
    return max(1, -(-k // 64))


def split_cost(tile: _Tile, m: int, n: int, k: int, batch: int, sm_count: int, split_k: int) -> float:
    """Relative time of ``tile`` with ``split_k`` splits (see the model above)."""
    kb = k_blocks(k)
    split_k = min(split_k, kb)
    units = arch_mod.matmul_tiles(m, n, tile.block_m, tile.block_n, batch=batch, split_k=split_k)
    rounds = -(-units // sm_count)
    area = tile.block_m * tile.block_n
    unit = area * 64 * (-(-kb // split_k) + SPLIT_FILL_KBLOCKS) / tile.efficiency
    if split_k > 1:
        unit += PARTIAL_BYTE_MACS * area * 4 * (1 + split_k)
    return rounds * unit


def splits_for(tile: _Tile, m: int, n: int, k: int, batch: int, sm_count: int) -> tuple[int, ...]:
    """The split counts the heuristic weighs for ``tile``: 1, and more only while the tiles leave
    SMs idle and each split keeps MIN_KBLOCKS_PER_SPLIT k-blocks."""
    tiles = arch_mod.matmul_tiles(m, n, tile.block_m, tile.block_n, batch=batch)
    if tiles >= sm_count:
        return (1,)
    most = k_blocks(k) // MIN_KBLOCKS_PER_SPLIT
    return tuple(s for s in SPLITS if s == 1 or s <= most)


def workspace_bytes(cfg: "MatmulSm90Config", m: int, n: int, k: int, batch: int) -> int:
    """Split-K partials: one float32 tile per (tile, split); 0 for split_k = 1."""
    splits = min(cfg.split_k, k_blocks(k))
    if splits == 1:
        return 0
    return arch_mod.matmul_tiles(m, n, cfg.block_m, cfg.block_n, batch=batch, split_k=splits) * \
        cfg.block_m * cfg.block_n * 4


def counter_bytes(cfg: "MatmulSm90Config", m: int, n: int, batch: int) -> int:
    """Split-K counters: one int32 per (tile, consumer warpgroup); 0 for split_k = 1."""
    if cfg.split_k == 1:
        return 0
    return arch_mod.matmul_tiles(m, n, cfg.block_m, cfg.block_n, batch=batch) * 2 * 4


def _config(tile: _Tile, dtype: str, split_k: int = 1, **layout) -> MatmulSm90Config:
    return MatmulSm90Config(dtype=dtype, block_m=tile.block_m, block_n=tile.block_n, num_stages=tile.num_stages,
                            split_k=split_k, **layout)


def heuristic_config(dtype: str, m: int, n: int, k: int, batch: int = 1, *, sm_count: int = 132,
                     **layout) -> MatmulSm90Config:
    """The heuristic's config; ``layout``: a_kmajor, b_kmajor, has_bias, activation, tma_store, mma."""
    # mma.sync warps hold block_m / 2 rows: a 256-row tile gives 128 x 32 warp tiles, which read
    # twice the fragment bytes per HMMA of 64 x 64 (the shared-memory bandwidth mma.sync is short of)
    wgmma = layout.get("mma", "wgmma") == "wgmma"
    tiles = TILES if wgmma else [t for t in TILES if t.block_m == 128]
    # ties go to fewer splits, then to the smaller tile (less work wasted on the zero-filled border)
    choices = [(split_cost(t, m, n, k, batch, sm_count, s), s, t.block_m * t.block_n, i)
               for i, t in enumerate(tiles) for s in (splits_for(t, m, n, k, batch, sm_count) if wgmma else (1,))]
    _, split_k, _, i = min(choices)
    return _config(tiles[i], dtype, split_k, **layout)


def candidate_configs(dtype: str, **layout) -> list[MatmulSm90Config]:
    out = []
    for t in TILES + TUNE_ONLY:
        try:
            out.append(_config(t, dtype, **layout))
        except ConfigError:
            pass
    return out


def split_candidates(dtype: str, m: int, n: int, k: int, batch: int, sm_count: int, **layout) -> list[MatmulSm90Config]:
    """Split-K configs the autotuner adds for this shape: each heuristic tile with the split count
    the model likes best for it (none where no split is weighed, or for mma.sync consumers)."""
    if layout.get("mma", "wgmma") != "wgmma":
        return []
    out = []
    for t in TILES:
        splits = [s for s in splits_for(t, m, n, k, batch, sm_count) if s > 1]
        if splits:
            best = min(splits, key=lambda s: split_cost(t, m, n, k, batch, sm_count, s))
            out.append(_config(t, dtype, best, **layout))
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
    split_k to the k-blocks), at most one per SM."""
    units = -(-m // cfg.block_m) * -(-n // cfg.block_n) * batch * min(cfg.split_k, k_blocks(k))
    return max(1, min(units, sm_count))


def tensor_maps(cfg: MatmulSm90Config, a_desc, b_desc, c_desc):
    """The three tensor-map arguments; each ``*_desc`` is (ptr, shape, strides) from operand_maps."""
    from ..tma import tensor_map
    a_box = (1, cfg.block_m, 64) if cfg.a_kmajor else (1, 64, 64)
    b_box = (1, cfg.block_n, 64) if cfg.b_kmajor else (1, 64, 64)
    ma = tensor_map(a_desc[0], cfg.dtype, a_desc[1], a_desc[2], a_box)
    mb = tensor_map(b_desc[0], cfg.dtype, b_desc[1], b_desc[2], b_box)
    mc = tensor_map(c_desc[0], cfg.dtype, c_desc[1], c_desc[2], (1, cfg.block_m // 2, 64)) if cfg.tma_store else ma
    return ma, mb, mc
