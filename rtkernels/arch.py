"""Per-architecture SM limits, the theoretical-occupancy calculator, and wave counts.

Everything here is pure arithmetic: no driver, no GPU.  The occupancy model follows the
one the CUDA driver itself uses (``cuOccupancyMaxActiveBlocksPerMultiprocessor``), as
published in the toolkit's ``cuda_occupancy.h`` (shipped in the ``nvidia-cuda-runtime``
wheel's include folder), and the GPU test in ``tests/test_arch.py`` checks that the two
agree exactly over a sweep of real kernels.

Sources of the numbers (cited per field in ``ARCHS`` below):

* [PG]  CUDA C++ Programming Guide, "Compute Capabilities" -> "Technical Specifications
        per Compute Capability" table (threads/blocks/warps per SM, registers, shared memory
        per SM and per block) and the per-architecture sections (carveout sizes, the 1 KB of
        shared memory reserved per block on 8.x/9.x).
* [TG]  NVIDIA Ampere / Ada / Hopper Tuning Guides, "Shared Memory" / "Occupancy"
        (carveout options: A100 0..164 KB, 8.6/8.9 0..100 KB, H100 0..228 KB).
* [OCC] ``cuda_occupancy.h`` (CUDA 13): register allocation unit (256, per warp),
        4 register sub-partitions per SM, shared-memory allocation granularity (128 B on
        8.x/9.x), blocks per SM per minor version, carveout rounding, barrier limit.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple

KIB = 1024


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    """Per-SM resource limits of one compute capability (all sizes in bytes or registers)."""

    name: str                           # "sm_90"
    compute_capability: tuple[int, int]
    max_threads_per_sm: int             # [PG] "Maximum number of resident threads per SM"
    max_blocks_per_sm: int              # [PG] "Maximum number of resident blocks per SM"; [OCC]
    max_smem_per_sm: int                # [PG] "Maximum amount of shared memory per SM"
    max_smem_per_block_optin: int       # [PG] "Maximum amount of shared memory per thread block"
    smem_carveouts_kib: tuple[int, ...]  # [TG] "shared memory capacity can be set to ..."; [OCC]
    warp_size: int = 32                 # [PG]
    max_threads_per_block: int = 1024   # [PG]
    registers_per_sm: int = 64 * KIB    # [PG] "Number of 32-bit registers per SM" (64 K)
    registers_per_block: int = 64 * KIB  # [PG] "Maximum number of 32-bit registers per thread block"
    max_registers_per_thread: int = 255  # [PG] "Maximum number of 32-bit registers per thread"
    # [OCC] registers are granted per warp in units of 256 (a thread's count x 32, rounded up).
    register_allocation_unit: int = 256
    # [OCC] "warp allocation granularity": the register file is split over 4 sub-partitions
    # (one per warp scheduler); a warp takes all its registers from one, so a sub-partition
    # holds floor(16384 / regs_per_warp) warps and the SM 4x that - not floor(65536 / ...).
    # The hardware's per-block check also rounds a block's warps up to a multiple of 4.
    warp_allocation_granularity: int = 4
    smem_per_block_default: int = 48 * KIB   # [PG] above this a kernel must opt in (dynamic smem only)
    smem_allocation_unit: int = 128     # [OCC] cudaOccSMemAllocationGranularity: 128 B on 8.x / 9.x
    reserved_smem_per_block: int = 1 * KIB  # [PG] "1 KB of shared memory is reserved for system use" (8.x, 9.x)
    # [OCC] block barriers limit residency on 9.x: 2 x max_blocks_per_sm barriers per SM (0 = no limit).
    barrier_slots_per_sm: int = 0

    @property
    def max_warps_per_sm(self) -> int:
        """[PG] "Maximum number of resident warps per SM"."""
        return self.max_threads_per_sm // self.warp_size

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["max_warps_per_sm"] = self.max_warps_per_sm
        return d


ARCHS: dict[str, ArchLimits] = {
    # A100. [PG] 2048 threads, 32 blocks, 164 KB/SM, 163 KB/block; [TG] Ampere Tuning Guide
    # carveouts 0, 8, 16, 32, 64, 100, 132, 164 KB.
    "sm_80": ArchLimits("sm_80", (8, 0), max_threads_per_sm=2048, max_blocks_per_sm=32,
                        max_smem_per_sm=164 * KIB, max_smem_per_block_optin=163 * KIB,
                        smem_carveouts_kib=(0, 8, 16, 32, 64, 100, 132, 164)),
    # GA10x (RTX 30xx, A10, A40). [PG] 1536 threads, 16 blocks, 100 KB/SM, 99 KB/block;
    # [TG] Ampere Tuning Guide: carveouts 0, 8, 16, 32, 64, 100 KB.
    "sm_86": ArchLimits("sm_86", (8, 6), max_threads_per_sm=1536, max_blocks_per_sm=16,
                        max_smem_per_sm=100 * KIB, max_smem_per_block_optin=99 * KIB,
                        smem_carveouts_kib=(0, 8, 16, 32, 64, 100)),
    # Ada (RTX 40xx, L4, L40). [PG] 1536 threads, 24 blocks, 100 KB/SM, 99 KB/block;
    # [TG] Ada Tuning Guide: carveouts as 8.6.
    "sm_89": ArchLimits("sm_89", (8, 9), max_threads_per_sm=1536, max_blocks_per_sm=24,
                        max_smem_per_sm=100 * KIB, max_smem_per_block_optin=99 * KIB,
                        smem_carveouts_kib=(0, 8, 16, 32, 64, 100)),
    # H100 / H200. [PG] 2048 threads, 32 blocks, 228 KB/SM, 227 KB/block; [TG] Hopper Tuning
    # Guide: carveouts 0, 8, 16, 32, 64, 100, 132, 164, 196, 228 KB.  [OCC] 2 barriers per block slot.
    "sm_90": ArchLimits("sm_90", (9, 0), max_threads_per_sm=2048, max_blocks_per_sm=32,
                        max_smem_per_sm=228 * KIB, max_smem_per_block_optin=227 * KIB,
                        smem_carveouts_kib=(0, 8, 16, 32, 64, 100, 132, 164, 196, 228),
                        barrier_slots_per_sm=64),
}

_ARCH_RE = re.compile(r"^(?:sm_|compute_)?(\d)\.?(\d)[af]?$")


def limits(arch: str | ArchLimits) -> ArchLimits:
    """Limits for ``arch`` ("sm_90", "sm_90a", "compute_80", "8.6" or an ArchLimits).

    The arch-specific suffix (``sm_90a``) changes the instruction set, not the SM's
    resources, so it maps to the plain arch.
    """
    if isinstance(arch, ArchLimits):
        return arch
    m = _ARCH_RE.match(str(arch).strip())
    name = f"sm_{m.group(1)}{m.group(2)}" if m else str(arch)
    if name not in ARCHS:
        from .errors import ConfigError
        raise ConfigError.bad_value("occupancy", "arch", arch, "one of " + ", ".join(ARCHS)
                                    + " (an 'a' suffix such as sm_90a is accepted)")
    return ARCHS[name]


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


LIMITERS = ("threads", "blocks", "registers", "shared_memory", "barriers")


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """Theoretical occupancy of one kernel launch configuration on one SM.

    ``limits`` holds the blocks per SM each resource alone would allow (None: that resource
    sets no limit, e.g. a kernel using no barriers).  ``limiter`` is the binding one; on a tie
    it prefers, in order, threads, blocks, registers, shared_memory, barriers, so a register
    or shared-memory limiter is named only when spending less of it could not be outdone by
    the thread/block caps anyway.  ``limiters`` lists every tied limit.
    """

    arch: str
    threads_per_block: int
    registers_per_thread: int
    smem_static: int
    smem_dynamic: int
    blocks_per_sm: int
    warps_per_sm: int
    max_warps_per_sm: int
    occupancy_fraction: float
    limiter: str
    limiters: tuple[str, ...]
    limits: dict[str, int | None]
    registers_per_block: int       # allocated: per-warp rounding included
    smem_per_block: int            # allocated: static + dynamic + reserved, rounded to the unit
    smem_per_sm: int               # the carveout the calculation assumed

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["limiters"] = list(self.limiters)
        return d

    def __str__(self) -> str:
        return (f"{self.blocks_per_sm} blocks/SM, {self.warps_per_sm}/{self.max_warps_per_sm} warps "
                f"({self.occupancy_fraction:.0%}), limited by {self.limiter}")


def occupancy(arch: str | ArchLimits, threads_per_block: int, registers_per_thread: int,
              smem_static: int = 0, smem_dynamic: int = 0, *, barriers: int = 0,
              carveout: int | None = None, max_dynamic_smem: int | None = None) -> Occupancy:
    """Blocks and warps resident per SM, and which resource binds.

    Parameters
    ----------
    arch : target, e.g. ``"sm_90"`` (``"sm_90a"`` is the same SM).
    threads_per_block : launch block size (x*y*z).
    registers_per_thread : the kernel's register count (ptxas ``Used N registers``).
    smem_static, smem_dynamic : shared memory in bytes, static (ptxas ``bytes smem``) and the
        dynamic amount passed at launch.
    barriers : block barriers the kernel uses (ptxas ``used N barriers``); limits residency
        on sm_90 only, as in the driver.
    carveout : preferred shared-memory carveout in percent (the
        ``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`` value); None is the driver
        default, which plans with the largest carveout.  A preference too small for one block
        is overridden by the smallest carveout that fits one, as the driver does.
    max_dynamic_smem : the kernel's ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` attribute.  None assumes
        it was raised to at least ``smem_dynamic`` (rtkernels does so at launch); pass the
        driver default (48 KiB - static) to model a kernel that never opted in.

    Returns
    -------
    Occupancy; ``blocks_per_sm == 0`` means this configuration cannot launch.
    """
    lim = limits(arch)
    threads_per_block, regs = int(threads_per_block), int(registers_per_thread)
    smem_static, smem_dynamic = int(smem_static), int(smem_dynamic)
    if threads_per_block <= 0 or regs < 0 or smem_static < 0 or smem_dynamic < 0:
        from .errors import ConfigError
        raise ConfigError(f"occupancy: threads_per_block={threads_per_block}, registers={regs}, "
                          f"smem_static={smem_static}, smem_dynamic={smem_dynamic}; threads must be "
                          "positive and the others non-negative", family="occupancy")
    warps_per_block = -(-threads_per_block // lim.warp_size)

    # Threads (warp slots).
    if threads_per_block > lim.max_threads_per_block:
        by_threads = 0
    else:
        by_threads = lim.max_warps_per_sm // warps_per_block

    by_blocks = lim.max_blocks_per_sm

    # Registers: granted per warp, from one of the SM's sub-partitions.
    regs_per_warp = _round_up(regs * lim.warp_size, lim.register_allocation_unit)
    regs_per_block = regs_per_warp * warps_per_block
    regs_hw_check = regs_per_warp * _round_up(warps_per_block, lim.warp_allocation_granularity)
    by_registers: int | None
    if (regs > lim.max_registers_per_thread or regs_per_block > lim.registers_per_block
            or regs_hw_check > lim.registers_per_block):
        by_registers = 0
    elif regs_per_warp == 0:
        by_registers = None
    else:
        per_sub = lim.registers_per_sm // lim.warp_allocation_granularity
        warps_fit = (per_sub // regs_per_warp) * lim.warp_allocation_granularity
        by_registers = warps_fit // warps_per_block

    # Shared memory: the driver reserves 1 KiB per block and allocates in 128 B units.
    smem_block = _round_up(smem_static + smem_dynamic + lim.reserved_smem_per_block,
                           lim.smem_allocation_unit)
    max_dyn = smem_dynamic if max_dynamic_smem is None else int(max_dynamic_smem)
    # As the driver: the opt-in cap applies once the function's largest possible footprint
    # (static + reserved + its max-dynamic attribute) exceeds the 48 KiB default.
    opted_in = smem_static + lim.reserved_smem_per_block + max_dyn > lim.smem_per_block_default
    dyn_ok = smem_dynamic <= max_dyn
    block_cap = (lim.max_smem_per_block_optin if opted_in else lim.smem_per_block_default)
    block_cap += lim.reserved_smem_per_block
    carveouts = [c * KIB for c in lim.smem_carveouts_kib]
    if carveout is None:
        preferred = lim.max_smem_per_sm
    else:
        if not 0 <= int(carveout) <= 100:
            from .errors import ConfigError
            raise ConfigError.bad_value("occupancy", "carveout", carveout, "None or a percentage in [0, 100]")
        preferred = _carveout_at_least(carveouts, int(carveout) * lim.max_smem_per_sm // 100)
    if not dyn_ok or smem_block > block_cap:
        by_smem = 0
        smem_sm = preferred
    else:
        smem_sm = preferred if preferred >= smem_block else _carveout_at_least(carveouts, smem_block)
        by_smem = smem_sm // smem_block

    by_barriers: int | None = None
    if lim.barrier_slots_per_sm and barriers > 0:
        by_barriers = lim.barrier_slots_per_sm // int(barriers)

    table: dict[str, int | None] = {"threads": by_threads, "blocks": by_blocks,
                                    "registers": by_registers, "shared_memory": by_smem,
                                    "barriers": by_barriers}
    bounded = {k: v for k, v in table.items() if v is not None}
    blocks = min(bounded.values())
    tied = tuple(k for k in LIMITERS if table[k] is not None and table[k] == blocks)
    warps = blocks * warps_per_block
    return Occupancy(arch=lim.name, threads_per_block=threads_per_block, registers_per_thread=regs,
                     smem_static=smem_static, smem_dynamic=smem_dynamic, blocks_per_sm=blocks,
                     warps_per_sm=warps, max_warps_per_sm=lim.max_warps_per_sm,
                     occupancy_fraction=warps / lim.max_warps_per_sm, limiter=tied[0], limiters=tied,
                     limits=table, registers_per_block=regs_per_block, smem_per_block=smem_block,
                     smem_per_sm=smem_sm)


def _carveout_at_least(carveouts: list[int], size: int) -> int:
    """The smallest carveout option >= size (the largest when none is)."""
    for c in carveouts:
        if c >= size:
            return c
    return carveouts[-1]


# ---- waves -----------------------------------------------------------------------------
class Waves(NamedTuple):
    """``waves``: how many rounds of resident blocks the grid needs; ``tail_efficiency``:
    how full the last round is (1.0 = every slot busy)."""

    waves: int
    tail_efficiency: float


def arch_number(arch: str) -> int:
    """The SM version of a target name as one number: "sm_90a" -> 90, "sm_80" -> 80."""
    return int("".join(ch for ch in arch.split("_", 1)[1] if ch.isdigit()))


def waves(num_tiles: int, sm_count: int, blocks_per_sm: int = 1) -> Waves:
    """Rounds needed to run ``num_tiles`` blocks with ``sm_count * blocks_per_sm`` slots.

    >>> waves(98, 108), waves(120, 108)      # 1792^2 vs 1793^2 matmul, 256x128 tiles, A100
    (Waves(waves=1, tail_efficiency=0.907...), Waves(waves=2, tail_efficiency=0.111...))
    """
    num_tiles, sm_count, blocks_per_sm = int(num_tiles), int(sm_count), int(blocks_per_sm)
    if sm_count <= 0 or blocks_per_sm <= 0 or num_tiles < 0:
        from .errors import ConfigError
        raise ConfigError(f"waves: num_tiles={num_tiles}, sm_count={sm_count}, blocks_per_sm="
                          f"{blocks_per_sm}; SMs and blocks per SM must be positive", family="waves")
    slots = sm_count * blocks_per_sm
    if num_tiles == 0:
        return Waves(0, 1.0)
    n = -(-num_tiles // slots)
    return Waves(n, (num_tiles - (n - 1) * slots) / slots)


def wave_summary(num_tiles: int, sm_count: int, blocks_per_sm: int = 1) -> dict[str, Any]:
    """Waves plus the figures a report prints: slots, tail tiles and whole-run efficiency."""
    w = waves(num_tiles, sm_count, blocks_per_sm)
    slots = sm_count * blocks_per_sm
    return {"tiles": int(num_tiles), "sm_count": int(sm_count), "blocks_per_sm": int(blocks_per_sm),
            "slots": slots, "waves": w.waves, "tail_tiles": int(num_tiles) - (w.waves - 1) * slots if w.waves else 0,
            "tail_efficiency": w.tail_efficiency,
            # share of slot-time doing work if every tile takes equally long
            "efficiency": (num_tiles / (w.waves * slots)) if w.waves else 1.0}


def matmul_tiles(m: int, n: int, block_m: int, block_n: int, *, batch: int = 1, split_k: int = 1) -> int:
    """Output tiles (= thread blocks) of a tiled matmul: one block per block_m x block_n tile."""
    return math.ceil(m / block_m) * math.ceil(n / block_n) * int(batch) * int(split_k)


def attention_tiles(batch: int, heads: int, seqlen_q: int, block_m: int, *, num_splits: int = 1) -> int:
    """Thread blocks of a FlashAttention-style forward: one per (batch, head, block_m query rows)."""
    return int(batch) * int(heads) * math.ceil(seqlen_q / block_m) * int(num_splits)
