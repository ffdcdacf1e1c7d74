"""attention_sm90: the Hopper (sm_90a) FlashAttention forward behind ``rtk.attention`` on sm_90.

Same contract as :mod:`rtkernels.ops.attention` (layouts, GQA, bottom-right causal, lse,
fp16/bf16, every head dim that is a multiple of 8 up to 256); only the machinery differs:
TMA loads through 4-D tensor maps built over the arrays' own strides, a producer warpgroup
streaming K/V through an mbarrier ring, consumer warpgroups computing with wgmma, and a TMA
store of O (templates/attention_fwd_sm90.cu.j2).  :func:`eligible` says when the op may use it;
everything else (sm_80/86/89, arrays TMA cannot address) keeps the mma.sync kernel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from .. import arch as _arch
from ..config import register_family
from ..errors import ConfigError
from ._arrays import Launch
from .attention_shape import AttentionShape

FAMILY = "attention_sm90"
SMEM_LIMIT_SM90 = _arch.limits("sm_90").max_smem_per_block_optin   # 227 KiB on H100/H200
_ALIGN_SLACK = 1024                   # the template rounds the dynamic smem base up to 1 KiB
LAUNCH_REGISTER_FILE = _arch.limits("sm_90").registers_per_block   # 64 Ki 32-bit registers
_SM90 = _arch.limits("sm_90")


def smem_limit(ctas_per_sm: int) -> int:
    """Dynamic shared memory one CTA may take so that ``ctas_per_sm`` of them share an SM: the SM's
    228 KiB split, less the 1 KiB the driver reserves per CTA, in its 128-byte allocation units
    (2 CTAs: 115712 B); one CTA: the 227 KiB opt-in cap."""
    if ctas_per_sm == 1:
        return SMEM_LIMIT_SM90
    per = _SM90.max_smem_per_sm // ctas_per_sm // _SM90.smem_allocation_unit * _SM90.smem_allocation_unit
    return per - _SM90.reserved_smem_per_block


@register_family
@dataclass(frozen=True)
class AttentionSm90Config(AttentionShape):
    """One specialization of the Hopper forward kernel.

    Parameters
    ----------
    dtype, head_dim, causal : as :class:`rtkernels.ops.attention.AttentionConfig`.
    block_m : query rows per CTA: 64 per consumer warpgroup (64, 128 or 192).
    block_n : keys per K/V tile (wgmma N of Q K^T), multiple of 16 in [16, 256].
    num_stages : K/V ring depth (2 or 3).
    intra_overlap : issue S_n = Q K_n^T together with O += P_{n-1} V_{n-1} so the softmax of one
        tile runs under the other's GEMM (off: the plain S -> softmax -> P V order).
    pingpong : the consumer warpgroups (block_m=128 or 192) take turns, round robin, issuing GEMMs,
        so one's softmax overlaps another's GEMMs (named barriers).
    softmax_under_pv : with intra_overlap, wait for P_{n-1} V_{n-1} only after tile n's softmax,
        so the exponentials run under that GEMM (off: wait before the softmax and release V_{n-1}
        one softmax earlier).
    p_smem : stage P in shared memory (this warpgroup's rows of a block_m x block_n tile, swizzled as
        a Q tile) and read both operands of O += P V from there (wgmma SS) instead of P from
        registers: the P registers live only until stored, so three warpgroups overlap S and P V at
        128-key tiles where P in registers spills (d80 192x128 with overlap: 48 B), at the cost of
        the stores, a barrier per key tile and block_m x ceil(block_n / 64) x 128 B of shared memory
        (FlashAttention-4's sm90 choice for head dims 65-96: 192x144, causal 192x128).  Not with
        flat_walk.  Opt-in while it is measured.
    rescale_under_qk : with intra_overlap (not flat_walk): rescale O by the previous tile's
        correction after S_n = Q K_n^T is issued, before P_{n-1} V_{n-1} (a second wgmma fence), so
        the head_dim / 2 multiplies per thread run under the S GEMM instead of ahead of both issues
        (FlashAttention-4's sm90 order for head dims > 128: d256's 128 per thread per key tile).
        Opt-in while it is measured.
    exp2_poly : of every 8 exponentials of the softmax, how many a polynomial computes on the FMA
        pipe instead of the MUFU unit (0-8; ``rtk::poly_exp2``): for kernels the 16-per-clock MUFU
        unit bounds, as softcap's extra tanh per score makes it.
    fixed_max : with has_softcap, bfloat16: the softmax takes its exponentials against a fixed
        reference instead of the running row max - capped scores lie in [-softcap, softcap] - so no
        row max, no correction and no rescale of O (``softmax_tile`` in the template; the host takes
        it where :func:`softcap_fixed_max` says the cap's range fits float's exponents).
    persistent : one CTA per SM walks the (query tile, head, batch) tiles, causal heaviest first,
        loading the next tile's Q and K/V while the current one computes and stores (dense inputs
        only; two Q buffers where shared memory holds them, see :attr:`q_buffers`).
    flat_walk : with persistent (two Q buffers) and intra_overlap, no window: each consumer
        warpgroup runs one loop over its (tile, key tile) steps, so the GEMMs do not drain at a tile
        boundary - the next tile's first S = Q K^T is issued with the current tile's last P V and
        the tile's epilogue (O normalized, staged in a buffer of its own, stored) runs under the
        following S GEMM.  Opt-in while it is measured.
    l2_walk : with persistent and causal: walk the tiles in sections of (batch, head) pairs whose
        K/V the host sizes to L2 (:func:`walk_group`), heaviest first within each section, instead
        of heaviest first over every pair (which re-reads every pair's K/V from HBM at each query
        tile level: the CPU model counts ~4x the once-only K/V traffic at S=512, ~8x at 1k for
        64-row tiles).  Opt-in while it is measured.
    ctas_per_sm : CTAs the kernel is built to keep resident per SM (1 or 2).  2, for 64-row tiles
        (one consumer warpgroup) at head_dim <= 128: __launch_bounds__(256, 2) caps the launch at
        128 registers a thread, setmaxnreg moves the producer's to the consumer (see
        :attr:`register_split`), the tile must fit half the SM's shared memory
        (:func:`smem_limit`), and a persistent grid is 2 x SMs - two independent 64-row walks per
        SM, one's softmax and epilogue under the other's GEMMs (cuDNN's structure at short causal
        lengths, in two CTAs).  Opt-in while it is measured.
    lpt_grid : causal, one CTA per tile (not persistent, dense): a 1-D grid whose index runs the
        tiles heaviest first within sections of (batch, head) pairs sized to L2 (:func:`lpt_group`),
        so the hardware's dispatcher hands each freed SM the heaviest tile left (longest processing
        time first, FlashAttention-4's sm90 causal order).  Off: the (query tile, head, batch) grid
        runs each pair's tiles heaviest first but pair after pair, so the last pairs' heaviest
        tiles start in the last wave (a greedy model of the dispatcher: 13% over the even split at
        d256 128x80 S=4k, 3.5-6.5% at d64-128 S=4k/16k; sectioned heaviest first: 0.2-1%).
        Opt-in while it is measured.
    """

    family: ClassVar[str] = FAMILY
    template: ClassVar[str] = "attention_fwd_sm90.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("attention_fwd_sm90",)
    needs_arch_specific: ClassVar[bool] = True
    expects_tensor_cores: ClassVar[bool] = True
    expected_global_width: ClassVar[int | None] = None   # TMA moves the tiles; only lse is stored per thread

    block_m: int = 128
    block_n: int = 128
    num_stages: int = 2
    intra_overlap: bool = True
    pingpong: bool = False
    softmax_under_pv: bool = True
    rescale_under_qk: bool = False
    p_smem: bool = False
    exp2_poly: int = 0
    fixed_max: bool = False
    persistent: bool = False
    flat_walk: bool = False
    l2_walk: bool = False
    ctas_per_sm: int = 1
    lpt_grid: bool = False

    def __post_init__(self):
        self._check_shape()
        self._check_choice("block_m", (64, 128, 192))
        self._check_int("block_n", 16, 256, multiple_of=16)
        self._check_choice("num_stages", (2, 3))
        self._check_choice("intra_overlap", (False, True))
        self._check_choice("pingpong", (False, True))
        self._check_choice("softmax_under_pv", (False, True))
        self._check_int("exp2_poly", 0, 8)
        self._check_choice("fixed_max", (False, True))
        if self.fixed_max and not (self.has_softcap and self.dtype == "bfloat16"):
            self._fail("fixed_max", "False unless has_softcap=True and dtype='bfloat16' (only capped scores are "
                                    "bounded; a float16 P cannot hold the fixed reference's range)")
        self._check_choice("persistent", (False, True))
        self._check_choice("flat_walk", (False, True))
        self._check_choice("ctas_per_sm", (1, 2))
        self._check_choice("l2_walk", (False, True))
        self._check_choice("lpt_grid", (False, True))
        self._check_choice("rescale_under_qk", (False, True))
        self._check_choice("p_smem", (False, True))
        if self.p_smem and self.flat_walk:
            self._fail("p_smem", "False with flat_walk=True (its loop keeps P in registers)")
        if self.rescale_under_qk and (not self.intra_overlap or self.flat_walk):
            self._fail("rescale_under_qk", "False unless intra_overlap=True and flat_walk=False (flat_walk's loop "
                                           "already rescales under the S GEMM)")
        if self.lpt_grid and not (self.causal and not self.persistent and not self.is_varlen):
            self._fail("lpt_grid", "False unless causal=True, persistent=False and without cu_seqlens (it orders "
                                   "the causal tiles of a dense grid of one CTA per tile)")
        if self.l2_walk and not (self.persistent and self.causal):
            self._fail("l2_walk", "False unless persistent=True and causal=True (the non-causal walk already runs "
                                  "a head's query tiles together)")
        if self.ctas_per_sm > 1 and self.consumers != 1:
            self._fail("ctas_per_sm", "1 unless block_m=64 (two CTAs of one consumer warpgroup share an SM; "
                                      "wider tiles take its registers alone)")
        if self.ctas_per_sm > 1 and self.head_dim > 128:
            # ptxas (NVRTC 13.5) rejects d256 at 64x32: "C7602 Insufficient registers (128) ... target
            # of 158" at its O += P V (wgmma 64x256, 128 accumulators) - one instruction's operands
            # must fit the launch cap, though the consumer's code past setmaxnreg uses more (d64:
            # up to R165).  d136-192 not tried.
            self._fail("ctas_per_sm", "1 for head_dim > 128 (its O accumulator's wgmma needs more than the "
                                      "128 registers two CTAs per SM launch with)")
        if self.persistent and self.is_varlen:
            self._fail("persistent", "False with cu_seqlens (varlen tiles come from the schedule table, one per CTA)")
        if self.pingpong and self.consumers < 2:
            self._fail("pingpong", "False unless block_m >= 128 (two or three consumer warpgroups take turns)")
        if self.persistent and self.pingpong:
            # The first pingpong tile walked persistently hung (d128 causal, H100, 2026-11-25) - as
            # did the same tile without pingpong: the 2-consumer register split (register_split).
            # Turns are balanced within each tile, but the CPU model does not carry them across
            # tiles yet, so the walk keeps rejecting them.
            self._fail("persistent", "False with pingpong=True (the warpgroups' turn-taking does not carry across "
                                     "tiles)")
        if self.flat_walk:
            self._check_flat_walk()
        limit = self.smem_limit
        if self.shared_mem_bytes > limit:
            if self.persistent and self._smem_bytes(1, False) <= limit:
                self._fail("persistent", f"False for block_m={self.block_m}, block_n={self.block_n}, num_stages="
                                         f"{self.num_stages} at head_dim={self.head_dim}: its Q buffer's release "
                                         f"barriers take {self._smem_bytes(1, True)} B of shared memory, sm_90 has "
                                         f"{limit} B{self._per_cta}")
            if self.ctas_per_sm > 1 and self.shared_mem_bytes <= SMEM_LIMIT_SM90:
                self._fail("ctas_per_sm", f"1 for block_m={self.block_m}, block_n={self.block_n}, num_stages="
                                          f"{self.num_stages} at head_dim={self.head_dim}: it needs "
                                          f"{self.shared_mem_bytes} B of shared memory, {self.ctas_per_sm} CTAs "
                                          f"per SM get {limit} B each")
            self._fail("block_n", f"a tile that fits sm_90's {limit} B of shared memory{self._per_cta}: block_m="
                                  f"{self.block_m}, block_n={self.block_n}, num_stages={self.num_stages} at "
                                  f"head_dim={self.head_dim} needs {self.shared_mem_bytes} B")

    def _check_flat_walk(self) -> None:
        # The flattened loop carries GEMMs from one tile of the walk into the next: it needs the
        # walk, the next tile's Q in a second buffer and the overlapped GEMM order; a window moves
        # each tile's first key tile (not modelled: kept out).
        if not self.persistent:
            self._fail("flat_walk", "False unless persistent=True (it runs the persistent walk's tiles as one loop)")
        if not self.intra_overlap:
            self._fail("flat_walk", "False unless intra_overlap=True")
        if self.has_window:
            self._fail("flat_walk", "False with a sliding window")
        if self._smem_bytes(2, True, True) > self.smem_limit:
            self._fail("flat_walk", f"False for block_m={self.block_m}, block_n={self.block_n}, num_stages="
                                    f"{self.num_stages} at head_dim={self.head_dim}: two Q tiles and an O tile "
                                    f"take {self._smem_bytes(2, True, True)} B of shared memory, sm_90 has "
                                    f"{self.smem_limit} B{self._per_cta}")

    @classmethod
    def heuristic_defaults(cls, params: dict[str, Any], arch: str | None) -> dict[str, Any]:
        """No tile field given: the op's own config for (dtype, head_dim, causal), so
        ``rtk report attention_sm90 --sweep head_dim=...`` shows what rtk.attention runs; some
        given: the rest keep the dataclass defaults (a hand-picked tile is taken as written)."""
        # (the walk / order flags alone keep the tile)
        if any(f in params for f in _TILE_FIELDS if f not in ("persistent", "flat_walk", "l2_walk", "lpt_grid")):
            return {}
        try:   # no base object: the dataclass's default tile does not fit every head dim
            cfg = choose_config(params.get("dtype", cls.dtype), params.get("head_dim", cls.head_dim),
                                params.get("causal", cls.causal),
                                **{f: params[f] for f in cls.MASK_FIELDS[1:] if f in params})
        except (ConfigError, TypeError, ValueError, KeyError):
            return {}   # the constructor then reports the bad field itself
        tile = {f: getattr(cfg, f) for f in _TILE_FIELDS}
        if params.get("persistent"):
            tile["pingpong"] = False   # the walk runs without turns (validation says why)
            tile["lpt_grid"] = False   # the walk has its own order
        return tile

    # ---- derived values (the template re-checks them with static_assert) --------------
    @property
    def consumers(self) -> int:
        return self.block_m // 64

    @property
    def num_warps(self) -> int:
        return 4 * (1 + self.consumers)

    @property
    def d_blocks(self) -> int:
        """64-column (128-byte, one TMA box) blocks of a Q/K/V tile row."""
        return -(-self.head_dim // 64)

    @property
    def q_buffers(self) -> int:
        """Q tiles in shared memory: 2 when persistent and they fit (the next tile's Q lands while
        this one computes; d <= 128 at 2 stages: e.g. d128 128x128 takes 2 x 32 + 128 KiB of K/V),
        else 1 (d192 / d256 tiles fill shared memory with one: the next Q loads after the epilogue)."""
        return 2 if self.persistent and self._smem_bytes(2, True) <= self.smem_limit else 1

    @property
    def smem_limit(self) -> int:
        """Shared memory the config may take: :func:`smem_limit` of its ``ctas_per_sm``."""
        return smem_limit(self.ctas_per_sm)

    @property
    def _per_cta(self) -> str:
        return f" per CTA at ctas_per_sm={self.ctas_per_sm}" if self.ctas_per_sm > 1 else ""

    @property
    def shared_mem_bytes(self) -> int:
        """q_buffers x Q tile (+ an O tile with flat_walk) + num_stages x (K tile + V tile), each
        D_BLOCKS x rows x 128 B, the mbarriers and 1 KiB of slack for aligning the base to the 128-byte swizzle's 1 KiB period."""
        return self._smem_bytes(self.q_buffers, self.persistent, self.flat_walk)

    def _smem_bytes(self, q_buffers: int, persistent: bool, o_buffer: bool = False) -> int:
        """Bytes for ``q_buffers`` Q tiles, the K/V ring, the barriers and the slack; ``o_buffer``: plus
        flat_walk's O staging tile (block_m rows, laid out as a Q tile)."""
        q = self.block_m * 128 * self.d_blocks
        kv = self.block_n * 128 * self.d_blocks
        p = self.block_m * 128 * -(-self.block_n // 64) if self.p_smem else 0   # 64-key blocks of the P tile
        bars = 8 * (q_buffers * (2 if persistent else 1) + 4 * self.num_stages)   # + q_free[] when persistent
        return (q_buffers + (1 if o_buffer else 0)) * q + 2 * self.num_stages * kv + p + bars + _ALIGN_SLACK

    @property
    def launch_registers(self) -> int:
        """Registers per thread the CTA holds at launch: __launch_bounds__(threads, ctas_per_sm) caps
        ptxas at the 64 Ki file / (threads x ctas_per_sm) in whole 8-register units (384 threads:
        168, not 170.7; 512: 128; 256 threads twice per SM: 128)."""
        return min(255, LAUNCH_REGISTER_FILE // (self.threads_per_block * self.ctas_per_sm) // 8 * 8)

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread after setmaxnreg.  setmaxnreg.inc waits until
        the pool of the CTA's launch registers (``threads x launch_registers``) can pay for it, so
        the split must fit that pool, not the 64 Ki file: at 384 threads the pool is 64512."""
        if self.consumers == 1:
            if self.ctas_per_sm == 1:
                return 256, 256        # 256 threads: every thread may already hold 255 (no setmaxnreg)
            # Two CTAs per SM: each holds 256 x 128 = 32768 at launch.  The producer keeps 24 (40
            # walking persistently, as at two consumers), the consumer takes the rest: 128 * 24 +
            # 128 * 232 = 128 * 40 + 128 * 216 = 32768.
            pool = self.threads_per_block * self.launch_registers
            producer = 40 if self.persistent else 24
            return producer, (pool - 128 * producer) // 128 // 8 * 8
        if self.consumers == 2:
            # 128 * 24 + 256 * 240 = 64512, the whole pool.  Persistent: the producer walks the tiles
            # too (24 spilled 4-16 B of its loop state), so it keeps 40 and the consumers take 232
            # (d128 / d192 / d256 tiles 0 spills, NVRTC 13.5): 128 * 40 + 256 * 232 = 64512.  (The
            # first persistent split, 32 / 240, asked 65536 of 64512: the consumers' setmaxnreg.inc
            # never returned - the hang of every 128-row persistent tile, H100 2026-11-25.)
            return (40, 232) if self.persistent else (24, 240)
        return 32, 160                 # 128 * 32 + 384 * 160 = 65536 = 512 x 128

    def template_params(self) -> dict[str, Any]:
        p = super().template_params()
        p["smem_bytes"] = self.shared_mem_bytes
        p["q_buffers"] = self.q_buffers
        p["producer_regs"], p["consumer_regs"] = self.register_split
        p["fixed_max_headroom"], p["fixed_max_floor"] = FIXED_MAX_HEADROOM, FIXED_MAX_FLOOR
        return p


# ---- heuristics ---------------------------------------------------------------------------
class Tile(NamedTuple):
    block_m: int
    block_n: int
    num_stages: int
    intra_overlap: bool
    pingpong: bool
    why: str
    softmax_under_pv: bool = True
    persistent: bool = False
    flat_walk: bool = False
    ctas_per_sm: int = 1
    l2_walk: bool = False
    lpt_grid: bool = False
    rescale_under_qk: bool = False
    p_smem: bool = False


_TILE_FIELDS = tuple(f for f in Tile._fields if f != "why")   # the config fields a Tile sets


# (lowest head_dim, highest head_dim, causal or None for both) -> tile.  Timings: H200, bf16,
# seqlen 4096 (16k tokens, hidden 2048), TFLOP/s non-causal / causal; head dims <= 128 from one
# same-run A/B of 2026-11-21 (round 2: back-to-back launches, 3 interleaved rounds, median; the
# committed kernel's own tile measured beside them), the rest from tools/bench_attention.py
# --tune-sm90 of the same day.  Register/spill figures: ptxas of NVRTC 13.5, sm_90a.
HEURISTICS: list[tuple[int, int, bool | None, Tile]] = [
    (8, 64, False, Tile(192, 128, 2, True, False,
                        "d64 non-causal: 3 consumer warpgroups, overlap: 505 TFLOP/s vs 491 with round-robin "
                        "turns, 477 at 192x144 without overlap, 425 for 128x192 pingpong; the softmax-bound "
                        "small head dim gains most from warpgroups in flight; O 32 + S 64 + P 32 fit the 160 "
                        "registers each, 0 spills")),
    (8, 64, True, Tile(192, 128, 2, True, False, lpt_grid=True, why=(
        "causal d64, session 11 (H200 2026-11-26, tools/bench_attention.py --fwd-ab, current pick "
        "timed twice for the run's noise, <= 0.3%): 192x112 455 / 542 -> 192x128 with the 1-D "
        "heaviest-first grid in L2-sized sections (lpt_grid) 460 / 554 TFLOP/s at 4k / 16k; the "
        "3-D grid ran each (batch, head)'s heaviest tiles one pair after another, so the last pairs' "
        "heaviest tiles started in the last wave (greedy dispatch model: 3.5-6.5% over an even "
        "split, lpt sections 0.2%)"))),
    (72, 96, True, Tile(192, 112, 2, True, False, lpt_grid=True, why=(
        "causal d80, session 11 (as d64's row): 192x112 490 / 568 -> with lpt_grid 500 / 581 at 4k / "
        "16k.  Session 4, when this row also held d64: causal d64: 418 vs 411 at 192x144 without "
        "overlap, 404 with turns, 365 for 128x128 pingpong; d96: 468 vs 459 with turns, 456 at "
        "192x144, 448 for 128x128 pingpong; with each warpgroup stopping at its own rows' last tile "
        "(no turns): d64 at 2k 380 vs 353 for 128x128 overlap, d96 531 (d128's 128x128 pingpong: "
        "575); O + S + P = 48 + 56 + 28 at d96 fit 160 registers (192x128 spills)"))),
    (72, 88, False, Tile(192, 112, 2, True, False, why=(
        "non-causal d80, session 11 (H200 2026-11-26, --fwd-ab): 192x128 without overlap 555 / 556 "
        "-> 192x112 with overlap 566 / 585 TFLOP/s at 4k / 16k (16k had fallen below 4k: 2150 CTAs "
        "of 192x128 leave a 4.2% last-wave tail, and no overlap, since 192x128 with overlap spills "
        "48 B at d80); d96-128 keep the row below (d128: 192x128 still the fastest)"))),
    (96, 128, False, Tile(192, 128, 2, False, False,
                          "non-causal d96 / d112 / d128: 572 / 578 / 621 without overlap vs 568 / 571 / - with "
                          "overlap + turns at 192x112 / 192x96 (192x128 with overlap spills) and 482 / 520 / 604 "
                          "for 128x128 overlap + pingpong; without overlap S and P never live together, so "
                          "three warpgroups keep 128-key tiles in 160 registers (<= 156 at d128) and the warp "
                          "schedulers interleave one's softmax with the others' GEMMs")),
    (104, 128, True, Tile(128, 128, 2, True, True,
                          "causal d112 / d128: 477 / 524 TFLOP/s vs 475 / 518 at 128x176, 471 / - for 192x96 "
                          "with turns, 463 / 505 for 192x128 without overlap; Q 32 KiB + 2 x (K + V) 128 KiB; "
                          "<= 187 of 240 registers, 0 spills")),
    (136, 192, None, Tile(128, 112, 2, True, True,
                          "d160 678 / 559, d192 711 / 618 TFLOP/s (bench_attention); 3 column blocks: Q 48 KiB + "
                          "2 x (K + V) 168 KiB = 217 KiB fits 227; O 96 + S 56 + P 28 registers, 0 spills")),
    (200, 256, True, Tile(128, 80, 2, True, False, rescale_under_qk=True, lpt_grid=True, why=(
        "causal d256, session 11 (H200 2026-11-26, --fwd-ab): 128x80 pingpong 638 / 779 -> 128x80 "
        "without turns, O rescaled while the QK GEMM runs (rescale_under_qk, as FA4 does at d256) and "
        "lpt_grid 689 at 4k (1.08x; 16k: rq alone 783); the 3-D grid's greedy dispatch model put "
        "causal d256 4k at 13.4% over an even split"))),
    (200, 256, False, Tile(128, 80, 2, True, True,
                          "d256: 660 / 548 TFLOP/s vs 671 / 551 without pingpong (noise) and 619 / 503 at 64-key "
                          "tiles; 4 column blocks: Q 64 KiB + 2 x (K + V) 160 KiB = 225 KiB fits 227; O 128 + S 40 "
                          "+ P 20 registers, 0 spills")),
]


def candidate(head_dim: int, causal: bool) -> Tile:
    for lo, hi, c, tile in HEURISTICS:
        if lo <= head_dim <= hi and (c is None or c == causal):
            return tile
    raise ConfigError.bad_value(FAMILY, "head_dim", head_dim, "a multiple of 8 in [8, 256]")


def choose_config(dtype: str, head_dim: int, causal: bool, seqlen_k: int | None = None,
                  **mask_flags) -> AttentionSm90Config:
    """The config the heuristics pick for (dtype, head_dim, causal) on sm_90; ``seqlen_k``: the
    call's keys per sequence, where a :data:`SHORT_SCHEDULE` row may give short dense problems
    another tile and the persistent walk (None: the per-head-dim choice); ``mask_flags``: the other
    compile-time mask fields (has_window, has_softcap, is_varlen).  Masked variants take the
    heuristic's tile unless ptxas spills it, then the first of :data:`_MASKED_FALLBACK` that fits
    and does not (NVRTC 13.5: softcap spills 32-56 B in the 192x128 non-overlapped d120-128 tile;
    all three options together also d96 causal and d112).  Persistent tiles of
    RTKERNELS_SM90_PERSISTENT=1 take the same fallback, without pingpong (which the walk does not
    support): the tile walk's state spilled 4-8 B of d128's 192x128 tile."""
    poly = exp2_poly_share(head_dim, causal, bool(mask_flags.get("has_softcap")), bool(mask_flags.get("fixed_max")))
    row = short_entry(head_dim, causal, seqlen_k, mask_flags)
    if row is not None:   # checked without spills over the row's head dims (see SHORT_SCHEDULE)
        t = SHORT_SCHEDULE[row][4]
        return AttentionSm90Config(dtype=dtype, head_dim=head_dim, causal=causal,
                                   **{f: getattr(t, f) for f in _TILE_FIELDS}, exp2_poly=poly)
    t = candidate(head_dim, causal)
    if persistent_choice(t, dtype, head_dim, causal, mask_flags):
        t = t._replace(persistent=True, pingpong=False, lpt_grid=False)   # the walk: no turns, its own order
    if mask_flags.get("is_varlen"):
        t = t._replace(lpt_grid=False)   # varlen tiles come from the schedule table
    cfg = AttentionSm90Config(dtype=dtype, head_dim=head_dim, causal=causal,
                              **{f: getattr(t, f) for f in _TILE_FIELDS}, exp2_poly=poly, **mask_flags)
    if not any(mask_flags.values()) and not t.persistent:
        return cfg
    from .attention_mask import first_without_spills
    options = [cfg]
    for block_n in _MASKED_FALLBACK:
        try:
            options.append(AttentionSm90Config(dtype=dtype, head_dim=head_dim, causal=causal, block_m=128,
                                               block_n=block_n, intra_overlap=True, pingpong=not t.persistent,
                                               exp2_poly=poly, persistent=t.persistent, lpt_grid=t.lpt_grid,
                                               rescale_under_qk=t.rescale_under_qk, p_smem=t.p_smem,
                                               **mask_flags))
        except ConfigError:
            pass   # does not fit shared memory
    return first_without_spills(list(dict.fromkeys(options)), "sm_90a")


# Exponentials moved from the MUFU unit to the FMA pipe (AttentionSm90Config.exp2_poly), of every 8.
# Reasoning: per score the MUFU unit takes 1/16 SM clock per op, the tensor cores (4 * head_dim
# FLOPs) / ~4270 FLOP per clock (H100 dense bf16): 0.06 clock at d64, 0.12 at d128, and softcap's
# tanh makes two MUFU ops (0.125 clock).  Measured (H100, 2026-11-25, seqlen 4096, 16k tokens,
# softcap 50, TFLOP/s for exp2_poly 0 / 2 / 4 / 6; bench_attention_masks --softcap --exp2-poly):
#   d64 non-causal 289 / 310 / 288 / 268      d64 causal 281 / 277 / 261 / 226
#   d128 non-causal 489 / 526 / 513 / 487     d128 causal 452 / 444 / 431 / 409
# so MUFU is not what softcap mostly costs (the plain kernel: 509 / 430 / 654 / 578): 2 of 8 gains
# 7% without a causal mask and nothing with one (its diagonal tiles' mask work competes for the
# same FMA pipe).  The plain kernels keep 0: their tiles sit at the register limit, and 2 of 8
# spilled the d64 192x128 tile (dense d64 fell from 509 to 394).
_EXP2_POLY_SOFTCAP = {False: 2, True: 0}   # by causal
_EXP2_POLY_DENSE = 0
# With fixed_max (no running max): 0.  The SASS of the d64 192x128 main loop falls from 745-821 to
# 533 instructions per 64 scores (plain: 527) - the max tree, shuffles, correction and O rescale go
# - and 2 of 8 emulated exponentials spill 4 B in that tile (NVRTC 13.5; the fallback is the 128x128
# pingpong tile).  Measured (H200, 2026-11-26, --softcap --variants, softcap / plain at S=4k, cap
# 50, poly 0 / 2 / 4): d64 0.658 / 0.585 / 0.552, d64 causal 0.694 / 0.692 / 0.621, d128 causal
# 0.764 / 0.767 / 0.738.
_EXP2_POLY_FIXED_MAX = 0


def exp2_poly_share(head_dim: int, causal: bool, has_softcap: bool, fixed_max: bool = False) -> int:
    """The heuristic's exp2_poly; ``RTKERNELS_SM90_EXP2_POLY`` (0-8) overrides it for tuning runs
    (read when a config is chosen: set it before the first call of a shape)."""
    env = os.environ.get("RTKERNELS_SM90_EXP2_POLY")
    if env:
        return int(env)
    if fixed_max:
        return _EXP2_POLY_FIXED_MAX
    return _EXP2_POLY_SOFTCAP[bool(causal)] if has_softcap else _EXP2_POLY_DENSE


# fixed_max (softcap): P = 2^(c (t - ref)) with c = softcap * log2(e), t = tanh(.) in [-1, 1] and
# c (1 - ref) = E = clamp(2c - FIXED_MAX_FLOOR, 0, FIXED_MAX_HEADROOM), so P <= 2^E and a row's
# largest P >= 2^(E - 2c) >= 2^-FLOOR.  Reasoned, not tuned: HEADROOM 64 keeps l = sum P (<= 2^84
# at 2^20 keys) and O = P V finite for |v| < 2^44 (bfloat16 activations are nowhere near); FLOOR 88
# keeps every key within 2^-38 of the row's largest P a normal float (ex2.approx.ftz flushes below
# 2^-126; those keys weigh < 2^-38 of the row, far under bfloat16's 2^-9).  Softcap 30 gets E = 0
# (P <= 1, as with a running max), 50 (Gemma 2) E = 56.
FIXED_MAX_HEADROOM = 64
FIXED_MAX_FLOOR = 88
SOFTCAP_FIXED_MAX_LIMIT = (FIXED_MAX_HEADROOM + FIXED_MAX_FLOOR) / (2 * 1.4426950408889634)   # 52.68


def softcap_fixed_max(dtype: str, softcap: float, head_dim: int = 64, causal: bool = True) -> bool:
    """Whether the Hopper forward takes ``fixed_max`` for this call: a bfloat16 softcap up to
    :data:`SOFTCAP_FIXED_MAX_LIMIT`, at head dims <= 64 or causal.  Measured (H200, 2026-11-26,
    S=4k, cap 50, tools/bench_attention_masks.py --softcap --variants, softcap / plain speed, running
    max -> fixed): d64 0.592 -> 0.659 non-causal, 0.651 -> 0.693 causal; d128 causal 0.757 -> 0.764;
    d128 non-causal 0.749 -> 0.697 (0.738 with exp2_poly 4): there the running max with 2 of 8
    exponentials on the FMA pipe stays (the tile has no overlap, so the max tree was hidden behind
    the other warpgroups' GEMMs anyway; reasoned).  ``RTKERNELS_SM90_SOFTCAP_FIXED_MAX=0`` turns it
    off, ``=1`` on at every head dim (A/B runs; read when a config is chosen: set it before the first
    call of a shape)."""
    env = os.environ.get("RTKERNELS_SM90_SOFTCAP_FIXED_MAX", "").strip()
    if env not in ("", "0", "1"):
        raise ConfigError.bad_value(FAMILY, "RTKERNELS_SM90_SOFTCAP_FIXED_MAX", env, "0 or 1")
    where = env == "1" or head_dim <= 64 or causal
    return env != "0" and where and dtype == "bfloat16" and 0 < softcap <= SOFTCAP_FIXED_MAX_LIMIT


# Short dense calls: per call, a SHORT_SCHEDULE row may replace the per-head-dim config (HEURISTICS,
# tuned at S=4k) by another tile and the persistent tile walk.  RTKERNELS_SM90_PERSISTENT: unset, the
# rows decide; 0, the per-head-dim configs everywhere (no row, no walk: the A/B baseline); 1, the
# per-head-dim tile walks persistently wherever it can run (dense inputs, pingpong off since the walk
# rejects it, the tile with its barriers fits shared memory), no row - for tuning runs.
#
# Row: (lowest head_dim, highest head_dim, causal, most key tiles, tile): a dense call whose seqlen_k
# makes at most that many key tiles of the row's own block_n runs the row's tile.  Key tiles, not
# query tiles against the SMs: at d64 on FlashAttention's grid S=512 (batch 32) and S=1k (batch 16)
# both make 3072 query tiles of 192 rows, 23 per SM, and the walk gained only at S=512 - what it saves
# is each CTA's fixed cost (launch, barrier setup, the exposed Q + first K/V load, the store), paid
# once per query tile whose main loop is only a few key tiles.  Causal d <= 128 rows also take
# 128-row query tiles (reasoned: the diagonal tile's masked part is a smaller share of less work, and
# the walk, heaviest first, evens the SMs' finishing times).  Causal rows walk in L2-sized sections
# (l2_walk): heaviest first over ALL (batch, head) pairs, every query-tile level swept every pair's
# K/V - more than L2 holds - so each level re-read them from HBM (CPU model: 4-8x the K/V bytes; the
# walk ran 20-35% below one CTA per tile); sections of pairs whose K/V fit L2 read them about once.
#
# Measured: H200, 2026-11-26, `tools/bench_attention.py --short-ab` (bf16, FlashAttention's grid:
# 16k tokens, hidden 2048; old, new and 9 tiles plain and persistent, SDPA cuDNN, 3 interleaved
# rounds, median), TFLOP/s old -> row's tile (cuDNN); only where the row's tile beat the
# per-head-dim config by more than 2% (the rest keep it: no extra compile).  The same config timed
# twice in that run differed by up to 3.5% (d128 non-causal S=1k: 545 / 526).  Head dims between
# the measured ones take the nearest measured head dim's tile family (d8-56 d64's, d72-96 d80's,
# d104-120 d128's, d136-248 d256's; d136-192's per-head-dim tile is 128x112 pingpong, not d256's
# 128x80: d160 / d192 were timed apart on 2026-11-26 (H100, `--short-ab --head-dims 160,192`): d256's
# S=512 rows gain there too (causal 261 -> 273 / 284 -> 294, non-causal 417 -> 444 / 457 -> 490), its
# causal S=1k walk does not (d192 426 -> 376), so that row starts at d200).  Every row's tile builds
# without spills or local memory over its whole range (NVRTC 13.5, sm_90a; bf16, ptxas at
# d8/32/56/64, 72/88/96, 104/112/120/128, 136/152/176/192/200/224/248/256).
SHORT_SCHEDULE: list[tuple[int, int, bool, int, Tile]] = [
    (8, 64, False, 4, Tile(192, 128, 2, True, False, persistent=True, why=(
        "d64 non-causal S=512 (4 key tiles): 331 -> 376 (387) walking the per-head-dim tile (H100 "
        "2026-11-25: 1.16x); at 1k (8 key tiles) 424 -> 421: kept off"))),
    (8, 64, True, 16, Tile(128, 128, 2, True, False, persistent=True, l2_walk=True, why=(
        "d64 causal, the walk in L2-sized sections (H200 2026-11-26, old -> row (cuDNN)): S=512 195 -> 237 "
        "(267; heaviest-first walk over all pairs 231); 1k 279 -> 323 (344; two 64x128 CTAs per SM 306); "
        "2k 382 -> 397 (399); at 4k 452 vs 449: kept off"))),
    (72, 96, False, 8, Tile(192, 128, 2, False, False, persistent=True, why=(
        "d80 non-causal S=512: 346 -> 410 (349); 1k: 426 -> 452 (367) walking the per-head-dim tile "
        "(H100 2026-11-25: 1.19x / 1.05x); 128x128 overlap walking 394 / 434"))),
    (72, 96, True, 8, Tile(128, 128, 2, True, False, persistent=True, l2_walk=True, why=(
        "d80 causal, the walk in L2-sized sections (H200 2026-11-26): S=512 209 -> 267 (234; the "
        "heaviest-first walk 247); 1k 306 -> 353 (296; 309); at 2k 420 vs 416: kept off"))),
    (104, 128, False, 8, Tile(128, 128, 2, True, False, persistent=True, why=(
        "d128 non-causal S=512: 423 -> 492 (514); 1k: 545 -> 559 (574; the old config's second copy "
        "526); the per-head-dim 192x128 spills 4 B walking (NVRTC 13.5), 192x64 walking 462 / 492"))),
    (104, 128, True, 32, Tile(128, 128, 2, True, False, persistent=True, l2_walk=True, why=(
        "d128 causal, the walk in L2-sized sections (H200 2026-11-26): S=512 288 -> 350 (352; two 64x64 "
        "CTAs per SM 308, the heaviest-first walk 287); 1k 412 -> 472 (445); 2k 517 -> 562 (521); 4k "
        "592 -> 607 (576)"))),
    (136, 256, False, 8, Tile(128, 64, 2, True, False, persistent=True, why=(
        "d256 non-causal S=512 (8 key tiles of 64): 476 -> 490 (516), 128x80 walking 483; at 1k "
        "593 -> 555: kept off"))),
    (136, 256, True, 8, Tile(128, 64, 2, True, False, why=(
        "d256 causal S=512: 320 -> 329 (334), one CTA per tile (walking: 266 - the walk lost at every "
        "causal d256 cell, 0.81-0.85x; in L2-sized sections 339 vs 342, H200 2026-11-26)"))),
    (200, 256, True, 16, Tile(128, 64, 2, True, False, persistent=True, l2_walk=True, why=(
        "not d136-192: there the per-head-dim 128x112 pingpong tile beat this row's walk at causal S=1k "
        "(H100 2026-11-26, --short-ab --head-dims 160,192: d192 426 vs 376 (cuDNN 453), d160 396 vs 396).  "
        "d256 causal S=1k, the walk in L2-sized sections (H200 2026-11-26): 452 -> 477 (469); at 2k "
        "562 vs 562: kept off"))),
]


def short_entry(head_dim: int, causal: bool, seqlen_k: int | None, mask_flags: dict | None = None) -> int | None:
    """Index of the :data:`SHORT_SCHEDULE` row a call with ``seqlen_k`` keys per sequence runs, or
    None: the per-head-dim config (``seqlen_k`` None, masks / varlen - the rows were measured on
    dense inputs - or ``RTKERNELS_SM90_PERSISTENT`` set).  A few comparisons: the plan memo keeps
    the result per signature, so replayed calls never get here."""
    if seqlen_k is None or (mask_flags and any(mask_flags.values())) or _persistent_env() != "":
        return None
    for i, (lo, hi, c, most, tile) in enumerate(SHORT_SCHEDULE):
        if lo <= head_dim <= hi and c == causal and -(-seqlen_k // tile.block_n) <= most:
            return i
    return None


def _persistent_env() -> str:
    env = os.environ.get("RTKERNELS_SM90_PERSISTENT", "").strip()
    if env not in ("", "0", "1"):
        raise ConfigError.bad_value(FAMILY, "RTKERNELS_SM90_PERSISTENT", env, "0 or 1")
    return env


def persistent_choice(tile: Tile, dtype: str, head_dim: int, causal: bool, mask_flags: dict) -> bool:
    """The per-head-dim config's ``persistent``: ``RTKERNELS_SM90_PERSISTENT=1`` (read when a config
    is chosen: set it before the first call of a shape), where the walk can run."""
    if _persistent_env() != "1" or mask_flags.get("is_varlen"):
        return False
    try:
        AttentionSm90Config(dtype=dtype, head_dim=head_dim, causal=causal, **mask_flags,
                            **{f: getattr(tile, f) for f in _TILE_FIELDS
                               if f not in ("persistent", "pingpong", "lpt_grid")}, persistent=True)
    except ConfigError:
        return False   # its barriers do not fit beside the tile
    return True


# Key tiles of the masked fallback: two consumer warpgroups with 240 registers each (the causal
# d104-256 shape), the widest tile that fits first.
_MASKED_FALLBACK = (128, 112, 96, 80, 64)


def heuristic_configs(dtypes=("float16", "bfloat16")) -> list[AttentionSm90Config]:
    """Every config the heuristics can pick for dense inputs (head_dim 8..256 step 8 x dtype x
    causal, and the short schedule's where an entry covers the head dim)."""
    out = []
    for d in range(8, 257, 8):
        for dt in dtypes:
            for c in (False, True):
                out.append(choose_config(dt, d, c))
                if any(lo <= d <= hi and cc == c for lo, hi, cc, _, _ in SHORT_SCHEDULE):
                    out.append(choose_config(dt, d, c, seqlen_k=1))
    return list(dict.fromkeys(out))


def tile_space(dtype: str, head_dim: int, causal: bool, tiles=None) -> list[AttentionSm90Config]:
    """Candidates for the autotuner: the heuristic's tile first, then 128-row CTAs with 64..192-key
    tiles (intra-warpgroup overlap, pingpong, or both) and 192-row CTAs (head_dim <= 128) - or the
    tile fields ``tiles`` instead - those that fit shared memory (spilling ones are pruned from the
    ptxas report before anything launches)."""
    if tiles is None:
        tiles = _default_tiles(head_dim)
    out = [choose_config(dtype, head_dim, causal)]
    for t in tiles:
        try:
            out.append(AttentionSm90Config(dtype=dtype, head_dim=head_dim, causal=causal, **t))
        except ConfigError:
            pass   # does not fit shared memory
    return list(dict.fromkeys(out))


def _default_tiles(head_dim: int) -> list[dict]:
    tiles = [dict(block_m=128, block_n=n, intra_overlap=ov, pingpong=pp)
             for n in (64, 80, 96, 112, 128, 144, 160, 176, 192)
             for ov, pp in ((True, False), (True, True), (False, True))]
    if head_dim <= 128:   # 3 consumer warpgroups get 160 registers each: O + S + P fit only for small D
        tiles += [dict(block_m=192, block_n=n, pingpong=pp) for n in (64, 80, 96, 112, 128) for pp in (False, True)]
    return tiles


# ---- dispatch and launch ------------------------------------------------------------------
# Switch for tests and benchmarks: False sends every call to the mma.sync kernel.
ENABLED = True
_TMA_STRIDE_LIMIT = 2 ** 40   # bytes


def is_sm90(arch: str) -> bool:
    return arch in ("sm_90", "sm_90a")


def eligible(arch: str, views, seqlen_k: int) -> bool:
    """Whether the Hopper kernel can take these arrays: an sm_90 device, at least one key (a
    tensor map has no zero-length dimension) and strides TMA can encode.  The op's own checks
    (16-byte aligned bases, strides in whole 16-byte units, contiguous last dimension) already hold."""
    if not (ENABLED and is_sm90(arch)) or seqlen_k < 1:
        return False
    return all(tma_strides(v) for v in views)


def tma_strides(view) -> bool:
    """Whether a tensor map encodes the view's strides: non-negative, below 2^40 bytes, and positive
    wherever the extent exceeds 1 (a broadcast's stride 0 has no encoding; extent-1 dims get one
    from :func:`_map_strides`)."""
    return all(0 <= s < _TMA_STRIDE_LIMIT and (s > 0 or n <= 1) for n, s in zip(view.shape, view.strides))


def _map_strides(view) -> tuple[int, ...]:
    """Element strides for a tensor map: a size-1 dimension is never stepped, but the driver
    wants a positive 16-byte multiple there too, so it gets the extent of what lies inside it."""
    out = [s // view.itemsize for s in view.strides]
    span = 1
    for i in range(len(out) - 1, -1, -1):
        if view.shape[i] == 1 and i < len(out) - 1:
            out[i] = -(-span // 8) * 8
        span = max(span, out[i] * view.shape[i])
    return tuple(out)


def map_specs(cfg: AttentionSm90Config, q_, k_, v_, o_) -> tuple:
    """(shape, strides, box) of the four tensor maps: Q and O boxes of (block_m resp. 64) rows x 64
    columns, K/V boxes of block_n rows x 64 columns; 64 columns = 128 bytes, the SW128 swizzle span.
    Everything but the base addresses, so a launch plan can keep them."""
    box = lambda rows: (1, rows, 1, 64)   # noqa: E731
    return tuple((tuple(a.shape), _map_strides(a), box(rows))
                 for a, rows in ((q_, cfg.block_m), (k_, cfg.block_n), (v_, cfg.block_n), (o_, 64)))


def tensor_maps(cfg: AttentionSm90Config, q_, k_, v_, o_, specs=None):
    """The four by-value tensor maps of q_, k_, v_, o_ (CuPy views or base addresses; ``specs``
    from :func:`map_specs` when the arguments are addresses)."""
    from ..tma import tensor_map
    specs = specs or map_specs(cfg, q_, k_, v_, o_)
    return tuple(tensor_map(a, cfg.dtype, shape, strides, box)
                 for a, (shape, strides, box) in zip((q_, k_, v_, o_), specs))


_NO_MASK = (0, 0, 0.0)   # (window_left, window_right, softcap) of a config without those options
def persistent_grid(cfg: AttentionSm90Config, batch: int, seqlen_q: int, nheads: int, sm_count: int) -> int:
    """CTAs of a persistent launch: ``cfg.ctas_per_sm`` per SM (1: the CTA holds the SM's registers
    by setmaxnreg; 2: the 64-row tiles built for two), never more than there are tiles (from the
    shapes only: a CUDA graph replays it unchanged)."""
    tiles = -(-seqlen_q // cfg.block_m) * nheads * batch
    return max(1, min(tiles, sm_count * cfg.ctas_per_sm))


def recorded_launch(kern, cfg: AttentionSm90Config, q_, k_, softmax_scale: float, mask_args=_NO_MASK,
                    sm_count: int | None = None) -> Launch:
    """The launch for q_, k_ shapes without its array arguments (the four tensor maps, then lse);
    ``mask_args``: (window_left, window_right, softcap) from AttentionMask.kernel_args;
    ``sm_count``: the SMs a persistent config's grid fills (default: the current device's; tests
    pass a few to make each CTA walk many tiles), or lpt_grid's sections are balanced over."""
    batch, seqlen_q, nheads, _ = q_.shape
    seqlen_k, nheads_kv = k_.shape[1], k_.shape[2]
    # o, its strides, cu_seqlens and the schedule are varlen's (attention.VarlenForwardPlan.run)
    tail = (seqlen_q, seqlen_k, nheads // nheads_kv, float(softmax_scale), None, 0, 0, None, None, None, nheads,
            *mask_args)
    if sm_count is None and (cfg.persistent or cfg.lpt_grid):
        from .. import device
        sm_count = device.sm_count()
    if cfg.persistent:
        grid = persistent_grid(cfg, batch, seqlen_q, nheads, sm_count)
        extra = (walk_group(cfg, batch, seqlen_q, seqlen_k, nheads, nheads // nheads_kv, grid),) if cfg.l2_walk else ()
        return Launch(kern, (grid,), (cfg.threads_per_block,), cfg.shared_mem_bytes, (*tail, batch, *extra))
    if cfg.lpt_grid:
        group = lpt_group(cfg, batch, seqlen_q, seqlen_k, nheads, nheads // nheads_kv, sm_count)
        return Launch(kern, (-(-seqlen_q // cfg.block_m) * nheads * batch,), (cfg.threads_per_block,),
                      cfg.shared_mem_bytes, (*tail, batch, group))
    return Launch(kern, (-(-seqlen_q // cfg.block_m), nheads, batch), (cfg.threads_per_block,),
                  cfg.shared_mem_bytes, tail)


def launch(kern, cfg: AttentionSm90Config, q_, k_, v_, o_, lse_, softmax_scale: float, stream=None,
           maps=None, mask_args=_NO_MASK, sm_count: int | None = None) -> None:
    """One launch over CuPy views q_, k_, v_, o_ (bfloat16 as uint16) and lse_ (or None); ``maps``:
    their :func:`tensor_maps`, when the caller encoded them once for repeated launches;
    ``sm_count``: as :func:`recorded_launch`."""
    recorded_launch(kern, cfg, q_, k_, softmax_scale, mask_args, sm_count).run(
        (*(maps or tensor_maps(cfg, q_, k_, v_, o_)), lse_), stream)


_KERNELS: dict = {}


def kernel_for(dtype: str, head_dim: int, causal: bool, arch: str = "sm_90a", mask_flags: tuple = (),
               seqlen_k: int | None = None):
    """(Kernel, config), memoized per (dtype, head_dim, causal, arch, mask_flags, short-schedule
    row, RTKERNELS_SM90_PERSISTENT): mask_flags are (name, value) pairs of the other compile-time
    mask fields; ``seqlen_k`` the call's keys per sequence (dense calls: a :data:`SHORT_SCHEDULE`
    row may pick another config)."""
    row = short_entry(head_dim, causal, seqlen_k, dict(mask_flags))
    key = (dtype, head_dim, causal, arch, mask_flags, row, _persistent_env())
    hit = _KERNELS.get(key)
    if hit is None:
        from ..kernel import get_kernel
        cfg = choose_config(dtype, head_dim, causal, seqlen_k if row is not None else None, **dict(mask_flags))
        hit = _KERNELS[key] = (get_kernel(cfg, arch=arch), cfg)
    return hit


def linear_tiles(m_tiles: int, heads: int, batch: int, causal: bool,
                 group: int | None = None) -> list[tuple[int, int, int]]:
    """(tile, head, batch) of each linear tile index of the persistent walk, in index order: the
    mirror of ``rtk::attn::linear_tile`` (rtk/attn_mask.cuh) that the CPU tests check; ``group``:
    l2_walk's pairs per section (``rtk::attn::linear_tile_grouped``)."""
    out = []
    pairs = heads * batch
    for t in range(m_tiles * pairs):
        if group is not None:
            s, loc = divmod(t, group * m_tiles)
            mt, r = divmod(loc, min(group, pairs - s * group))
            pair = s * group + r
            out.append((m_tiles - 1 - mt, pair % heads, pair // heads))
        elif causal:
            mt, r = divmod(t, heads * batch)
            out.append((m_tiles - 1 - mt, r % heads, r // heads))
        else:
            r, tile = divmod(t, m_tiles)
            out.append((tile, r % heads, r // heads))
    return out


# l2_walk's section: the K/V of the pairs the CTAs stream at once should stay in L2 until every
# query tile of those pairs has read them.  Reasoned, not tuned: H100/H200 have 50 MB of L2 in two
# halves, and lines every SM reads may sit in both, so a section's K/V gets 16 MiB (the rest holds
# Q / O and the next section's first loads).  The CPU model (walk_cost; FlashAttention's grid,
# 16k tokens, hidden 2048) counts K/V read from HBM, as multiples of once, heaviest first over all
# pairs -> sectioned: d128 S=512 64x64 at 264 CTAs 4.2 -> 1.06, d64 1k 64x128 8.1 -> 1.03, d64 2k
# 15 -> 1.3, d128 1k 128x128 at 132 CTAs 4.2 -> 1.06.
L2_SECTION_BYTES = 16 << 20


def walk_cost(m_tiles: int, pairs: int, grid: int, group: int, key_tiles) -> float:
    """Max over the CTAs of (key tiles + 1 per tile) of the static walk (CTA c takes linear tiles c,
    c + grid, ...) in sections of ``group`` pairs, over the mean; ``key_tiles[m]``: query tile m's."""
    import numpy as np
    kt = np.asarray(key_tiles, dtype=np.int64) + 1              # + the tile's fixed cost, as one key tile
    t = np.arange(m_tiles * pairs, dtype=np.int64)
    s, loc = np.divmod(t, group * m_tiles)
    gs = np.minimum(group, pairs - s * group)
    work = kt[m_tiles - 1 - loc // gs]
    per_cta = np.bincount(t % grid, weights=work, minlength=grid)
    return float(per_cta.max() / per_cta.mean())


def causal_key_tiles(cfg: AttentionSm90Config, seqlen_q: int, seqlen_k: int) -> list[int]:
    """Key tiles each query tile visits under the bottom-right causal mask (query row i sees keys
    <= i + seqlen_k - seqlen_q), at least one: the work the walk and lpt_grid's models weigh."""
    diag = seqlen_k - seqlen_q
    return [max(1, -(-max(0, min(seqlen_k, min((m + 1) * cfg.block_m, seqlen_q) + diag)) // cfg.block_n))
            for m in range(-(-seqlen_q // cfg.block_m))]


def section_size(pairs: int, per_pair: int, budget: int, cost, steps: int) -> int:
    """(batch, head) pairs per section: at most what keeps a section's ``per_pair`` bytes each
    within ``budget``, and of up to ``steps`` + 1 sizes from half that up, the one ``cost(size)``
    rates most even (3 decimals); ties: the larger.  The walk's and both lpt_grid orders' rule."""
    most = max(1, min(pairs, budget // per_pair))
    sizes = range(most, max(1, most // 2) - 1, -max(1, most // steps))
    return min(sizes, key=lambda g: (round(cost(g), 3), -g))


def walk_group(cfg: AttentionSm90Config, batch: int, seqlen_q: int, seqlen_k: int, nheads: int, kv_group: int,
               grid: int) -> int:
    """l2_walk's (batch, head) pairs per section: at most what keeps a section's K/V within
    :data:`L2_SECTION_BYTES` (a GQA group's heads share theirs), and of the sizes from half that up,
    the one whose static walk is the most even (sections whose tile count nears a multiple of the
    grid hand the same CTAs the heavy tiles of every section: 1.2-1.4x the mean in the model);
    ties: the larger.  From the shapes only (a CUDA graph replays it)."""
    pairs = nheads * batch
    per_pair = max(1, 2 * seqlen_k * cfg.head_dim * 2 // kv_group)   # K and V, 16-bit
    key_tiles = causal_key_tiles(cfg, seqlen_q, seqlen_k)
    m_tiles = len(key_tiles)
    return section_size(pairs, per_pair, L2_SECTION_BYTES,
                        lambda g: walk_cost(m_tiles, pairs, grid, g, key_tiles), steps=32)


# lpt_grid's sections: the dispatcher keeps one CTA per tile in flight on every SM, from one or two
# sections at a time.  Reasoned, then checked on the greedy model below (FlashAttention's grid, 132
# SMs, key tiles + 1.5 per tile): sections of K/V <= 16 MiB left 4-8% over the even split at d80
# S=4k/16k (no size in [most/2, most] balances), <= 32 MiB 0.1-1% in every causal cell of d64-256
# at S=2k-16k; FA4's sm90 LPT order gives its sections 50 MB.
LPT_SECTION_BYTES = 32 << 20


def dispatch_cost(m_tiles: int, pairs: int, slots: int, group: int, key_tiles) -> float:
    """Finishing time of the last CTA over the mean work per slot, when a dispatcher hands the tiles
    of lpt_grid's order (sections of ``group`` pairs, heaviest first in each) to whichever of
    ``slots`` frees first; a tile costs its key tiles + 1.5 (its fixed cost, as that many key
    tiles: reasoned).  ``key_tiles[m]``: query tile m's."""
    import heapq
    cost = [k + 1.5 for k in key_tiles]
    free = [0.0] * slots
    total = 0.0
    for s0 in range(0, pairs, group):
        gs = min(group, pairs - s0)
        for m in range(m_tiles - 1, -1, -1):
            c = cost[m]
            total += gs * c
            for _ in range(gs):
                heapq.heapreplace(free, free[0] + c)
    return max(free) / (total / slots)


def lpt_group(cfg: AttentionSm90Config, batch: int, seqlen_q: int, seqlen_k: int, nheads: int, kv_group: int,
              sm_count: int) -> int:
    """lpt_grid's (batch, head) pairs per section: at most what keeps a section's K/V within
    :data:`LPT_SECTION_BYTES` (a GQA group's heads share theirs), and of up to 9 sizes from half
    that up, the one :func:`dispatch_cost` finds most even (a section whose tile count nears a
    multiple of the slots hands the same SMs every section's heavy tiles: up to 15% over the even
    split in the model); ties: the larger.  From the shapes only (a CUDA graph replays it); a few
    ms of host time per shape (the plan memo keeps the launch)."""
    pairs = nheads * batch
    per_pair = max(1, 2 * seqlen_k * cfg.head_dim * 2 // kv_group)   # K and V, 16-bit
    key_tiles = causal_key_tiles(cfg, seqlen_q, seqlen_k)
    slots = sm_count * cfg.ctas_per_sm
    return section_size(pairs, per_pair, LPT_SECTION_BYTES,
                        lambda g: dispatch_cost(len(key_tiles), pairs, slots, g, key_tiles), steps=8)
