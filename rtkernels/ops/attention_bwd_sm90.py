"""attention_bwd_sm90: the Hopper (sm_90a) FlashAttention backward behind ``rtk.attention_backward``.

Same contract as :mod:`rtkernels.ops.attention_bwd` (layouts, GQA, bottom-right causal, lse,
fp16/bf16, ``deterministic``); the main kernel differs (templates/attention_bwd_sm90.cu.j2): a
producer warpgroup streams Q, dO, lse and delta tiles by TMA, two consumer warpgroups own 64 keys
each and compute S^T, dP^T, dV, dK and (alternating) dQ with wgmma.  The pre-pass (delta,
lse*log2e) and the dQ conversion are this module's own entry points (rtk/attn_bwd_sm90.cuh).
Head dims up to 128: beyond that, dK and dV alone would need 256 accumulator registers per
thread; head dims 136..256 run attention_bwd_sm90_big (the head dim split between the consumer
warpgroups) through this module's :func:`picks`, :func:`choose_config` and :func:`launch`.  Both
families share two grid / walk options (config fields, defined here): ``lpt_grid`` (:func:`main_grid`,
:func:`lpt_group`) and ``stagger``.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import device
from ..config import register_family
from ..kernel import DevicePtr
from ..tma import tensor_map
from ._arrays import address, empty_as, torch_stream_ptr
from .attention_shape import AttentionShape
from .attention_sm90 import SMEM_LIMIT_SM90, _map_strides, dispatch_cost, is_sm90, section_size, tma_strides
from .workspace import carve, stream_handle, stream_workspace

FAMILY = "attention_bwd_sm90"
MAX_HEAD_DIM = 128
_ALIGN_SLACK = 1024
_BLOCK_M = 64        # query rows per step of attention_bwd_sm90_big (and this family's default block_m)
_DQ_ROWS = 64        # rows of one dQ accumulator tile (the template's DQ_ROWS; dq_convert's unit)
_CONSUMERS = 2
# block_m 128: Q and dO tiles of 128 rows in one 64-column block each (head_dim <= 64: one block;
# at 72..128 two blocks make the two-stage ring alone 128 KiB and the config 300+ KiB), S^T and dP^T
# of 64 keys x 128 queries (64 f32 registers each) beside dK and dV (head_dim / 2 each).
BLOCK_M128_MAX_HEAD_DIM = 64


@register_family
@dataclass(frozen=True)
class AttentionBwdSm90Config(AttentionShape):
    """One specialization of the Hopper backward kernel.

    Parameters
    ----------
    dtype, head_dim, causal : as :class:`rtkernels.ops.attention_bwd.AttentionBwdConfig`;
        head_dim a multiple of 8 in [8, 128].
    deterministic : add the key tiles' dQ partials in a fixed order per query tile (bit-identical
        results run to run) instead of unordered float32 reductions.
    num_stages : depth of the Q/dO/lse/delta ring (2 or 3).
    block_m : query rows per step, 64 or 128 (128 up to head_dim 64, two ring stages).  Each step
        runs S^T, dP^T, dV and dK over block_m queries and, on one consumer warpgroup (alternating),
        dQ = dS K for them; 128 halves the steps a key tile walks - the per-step hand-overs (ring
        stage, dS^T barrier, dQ slot) and the pipeline fill at each sequence's start - for 64 more
        registers per consumer thread (FlashAttention-3/4's sm90 choice at head dim 64).
    lpt_grid : causal, not deterministic, without cu_seqlens: a 1-D grid whose index runs the key
        tiles heaviest first (key tile 0 sees every query tile) within sections of (batch, kv
        head) pairs sized to L2 (:func:`lpt_group`), so the dispatcher starts the long CTAs of every
        pair before the short ones.  The 3-D grid runs pair after pair: the last pairs' heaviest
        tiles start in the last wave and finish alone (the greedy model, FlashAttention's grid at
        d256: 1.065 / 1.056 of the even split at S 2k / 4k, 1.003 in sections).
    stagger : non-causal, not deterministic: each head's walk over the query tiles starts at the
        CTA's diagonal tile (its first key / block_m, modulo the walk) and wraps.  The grid starts the
        key tiles of a (batch, kv head) pair side by side and, their work being equal, they step
        together: without it every CTA of the pair on an SM (its seqlen_k / block_n key tiles, up to
        one per SM) loads the same Q / dO tile and reduces into the same dQ tile at the same moment;
        with it they spread over the pair's tiles as the causal walk's diagonal start spreads them
        (reasoned; the pair's Q / dO / f32 dQ rows in flight, <= 132 tiles of 64 or 128 rows, stay
        within L2: 17 MB at d256).  A/B at head dims <= 128: tools/ab_bwd_lpt128.sh.
    """

    family: ClassVar[str] = FAMILY
    template: ClassVar[str] = "attention_bwd_sm90.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("attention_bwd_sm90", "attention_bwd_sm90_dot", "attention_bwd_sm90_dq_convert")
    # (the three compile at once, each its own module: a cold backward waits for the main kernel alone,
    # 0.45 -> 0.40 s at d128 causal, 0.45 -> 0.38 at d256 causal; NVRTC 13.5, 2 cores)
    module_per_kernel: ClassVar[bool] = True
    needs_arch_specific: ClassVar[bool] = True
    expects_tensor_cores: ClassVar[bool] = True
    expected_global_width: ClassVar[int | None] = None   # TMA loads; dK/dV/dQ leave from mma registers
    tma_box_cols: ClassVar[int] = 64   # Q/dO/K/V tiles in column blocks of 64 (128-byte swizzle)
    tma_swizzle: ClassVar[int] = 128

    deterministic: bool = False
    num_stages: int = 2
    block_m: int = _BLOCK_M
    lpt_grid: bool = False
    stagger: bool = False

    def __post_init__(self):
        self._check_shape()
        if self.head_dim > MAX_HEAD_DIM:
            self._fail("head_dim", f"a multiple of 8 in [8, {MAX_HEAD_DIM}] (dK and dV of 64 keys x head_dim stay "
                                   "in one warpgroup's registers; larger head dims use attention_backward)")
        self._check_choice("deterministic", (False, True))
        self._check_choice("num_stages", (2, 3))
        self._check_choice("block_m", (64, 128))
        if self.block_m == 128 and self.head_dim > BLOCK_M128_MAX_HEAD_DIM:
            self._fail("block_m", f"64 at head_dim > {BLOCK_M128_MAX_HEAD_DIM} (Q and dO tiles of 128 rows in more "
                                  f"than one 64-column block exceed shared memory; head_dim={self.head_dim})")
        if self.block_m == 128 and (self.has_window or self.has_softcap):
            # ptxas (NVRTC 13.5, sm_90a, d64 bf16, 40 / 232 registers): plain, causal, varlen and
            # deterministic builds are clean at 128 rows, but the window's per-element bounds spill
            # 80 B (non-causal), softcap's tanh 64 B (causal), all three options 176 B
            self._fail("block_m", "64 with a window or softcap (their per-score work beside 128-row S^T and dP^T "
                                  "spills registers at 128)")
        self._check_grid_order()
        if self.shared_mem_bytes > SMEM_LIMIT_SM90:
            self._fail("num_stages", f"a ring that fits sm_90's {SMEM_LIMIT_SM90} B of shared memory: "
                                     f"{self.shared_mem_bytes} B at head_dim={self.head_dim}")

    def _check_grid_order(self) -> None:
        """lpt_grid and stagger (this family's and attention_bwd_sm90_big's rule)."""
        self._check_choice("lpt_grid", (False, True))
        if self.lpt_grid and not (self.causal and not self.deterministic and not self.is_varlen):
            self._fail("lpt_grid", "False unless causal=True, deterministic=False and without cu_seqlens (it orders "
                                   "the key tiles of a dense causal grid heaviest first; the deterministic order "
                                   "and varlen's schedule have their own)")
        self._check_choice("stagger", (False, True))
        if self.stagger and (self.causal or self.deterministic):
            self._fail("stagger", "False with causal=True (the causal walk already starts at the diagonal) or "
                                  "deterministic=True (the ordered dQ flush walks in key-tile turns)")

    @property
    def num_warps(self) -> int:
        return 4 * (1 + _CONSUMERS)

    @property
    def block_n(self) -> int:
        return 64 * _CONSUMERS

    @property
    def d_blocks(self) -> int:
        return -(-self.head_dim // 64)

    @property
    def shared_mem_bytes(self) -> int:
        """K and V (block_n rows), num_stages x (Q, dO tiles of block_m rows + block_m lse and delta
        values), two dS^T buffers (block_n x block_m x 2 B), two f32 dQ tiles (64 x head_dim: a
        128-row step fills both, each tile leaving by its own bulk reduction), the mbarriers and
        1 KiB to align the base."""
        kv = 2 * self.d_blocks * self.block_n * 128
        ring = self.num_stages * (2 * self.d_blocks * self.block_m * 128 + 2 * self.block_m * 4)
        ds = 2 * self.block_n * self.block_m * 2
        dq = 2 * _DQ_ROWS * self.head_dim * 4
        bars = 8 * (1 + 2 * self.num_stages + 4)
        return kv + ring + ds + dq + bars + _ALIGN_SLACK

    def template_params(self) -> dict[str, Any]:
        from .attention_bwd import LSE_PAD
        p = super().template_params()
        p.update(consumers=_CONSUMERS, smem_bytes=self.shared_mem_bytes, lse_pad=LSE_PAD,
                 producer_regs=self.register_split[0], consumer_regs=self.register_split[1])
        return p

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread after setmaxnreg.  The CTA starts with 168 per
        thread (384 threads under one 64 Ki file, rounded down to 8) and setmaxnreg only moves
        registers within the CTA: consumers may gain what the producer gives up,
        2 x (C - 168) <= 168 - P.  24/240 spills 8-52 bytes in the producer warpgroup (TMA issue +
        the dQ warp's bookkeeping); 32/240 asks for 1 Ki more registers than the CTA owns and
        hangs (H200, 2026-11-21).  At 232, ptxas spills only head_dim 120 non-causal (372 B): that
        case stays on the mma.sync kernel (:func:`eligible`).  Varlen and windows put their
        bookkeeping (sequence offsets, padded rows, window ranges) on the producer side: at 40 it
        spills 8 B at d64 causal varlen (NVRTC 13.5), so those variants give it 48 and the
        consumers 224 (128 x 48 + 256 x 224 = 63488)."""
        return (48, 224) if (self.is_varlen or self.has_window) else (40, 232)

    def launch_grid(self, batch: int, seqlen_q: int, seqlen_k: int, nheads_kv: int,
                    kv_group: int) -> tuple[tuple, tuple]:
        """(grid, trailing kernel arguments) of a dense launch: a CTA per (key tile, kv head, batch),
        or lpt_grid's 1-D grid and section size (:func:`main_grid`)."""
        return main_grid(self, batch, seqlen_q, seqlen_k, nheads_kv, kv_group)


# ---- lpt_grid: heaviest key tiles first (this family's and attention_bwd_sm90_big's) ----------------
# lpt_grid's sections: the CTAs resident at once (one per SM) walk the query tiles of one or two
# sections' (batch, kv head) pairs, whose Q, dO (16-bit) and f32 dQ accumulator rows they all
# read / add into; a section's share of those stays within this many bytes so L2 keeps them between
# the CTAs of a pair.  Reasoned as the forward's LPT_SECTION_BYTES (50 MB of L2 on H100 / H200,
# the rest for the K / V tiles and the next section's first loads); FlashAttention's grid at d256:
# 8 pairs per section at S 2k, 4 at 4k, 1 at 16k (the 3-D grid's own order).
LPT_SECTION_BYTES = 32 << 20


def key_tile_steps(cfg: AttentionBwdSm90Config, seqlen_q: int, seqlen_k: int) -> list[int]:
    """Query steps (block_m rows) each key tile (block_n keys) walks per query head (bottom-right
    causal, no window): the mirror of ``Mask::query_range`` (rtk/attn_mask.cuh) - key tile n from
    the step of row n * block_n - (seqlen_k - seqlen_q) on."""
    m_tiles = -(-seqlen_q // cfg.block_m)
    diag = seqlen_k - seqlen_q
    return [m_tiles - (max(0, n * cfg.block_n - diag) // cfg.block_m) for n in range(-(-seqlen_k // cfg.block_n))]


def lpt_order(n_tiles: int, pairs: int, group: int) -> list[tuple[int, int]]:
    """(key tile, pair) of each lpt_grid block index, in index order: the templates' mapping
    (rtk::attn::key_tile_lpt) - sections of ``group`` pairs, key tile 0 of each pair first, pairs
    fastest.  The CPU tests check it covers every tile once."""
    out = []
    for t in range(n_tiles * pairs):
        s, loc = divmod(t, group * n_tiles)
        rank, r = divmod(loc, min(group, pairs - s * group))
        out.append((rank, s * group + r))
    return out


@functools.lru_cache(maxsize=256)
def lpt_group(cfg: AttentionBwdSm90Config, batch: int, seqlen_q: int, seqlen_k: int, nheads_kv: int,
              kv_group: int, sm_count: int) -> int:
    """lpt_grid's (batch, kv head) pairs per section: at most what keeps a section's Q, dO and f32
    dQ rows within :data:`LPT_SECTION_BYTES`, and of up to 9 sizes from half that up, the one the
    forward's greedy dispatcher model (rtkernels.ops.attention_sm90.dispatch_cost: one CTA per SM,
    a key tile costs its query steps + 1.5 for its K / V load and dK / dV store, reasoned) finds
    most even; ties: the larger.  From the shapes only (a CUDA graph replays it); memoized (a few
    ms of host time per new shape)."""
    pairs = nheads_kv * batch
    per_pair = max(1, kv_group * seqlen_q * cfg.head_dim * (2 + 2 + 4))
    # dispatch_cost walks its list from the last entry (its heaviest first): the key tiles reversed
    work = [kv_group * w for w in reversed(key_tile_steps(cfg, seqlen_q, seqlen_k))]
    return section_size(pairs, per_pair, LPT_SECTION_BYTES,
                        lambda g: dispatch_cost(len(work), pairs, sm_count, g, work), steps=8)


def main_grid(cfg: AttentionBwdSm90Config, batch: int, seqlen_q: int, seqlen_k: int, nheads_kv: int,
              kv_group: int) -> tuple[tuple, tuple]:
    """(grid, trailing kernel arguments) of a dense launch: (key tiles, kv heads, batch) and none,
    or with lpt_grid one block per key tile of every pair and :func:`lpt_group`'s section size."""
    n_tiles = -(-seqlen_k // cfg.block_n)
    if not cfg.lpt_grid:
        return (n_tiles, nheads_kv, batch), ()
    group = lpt_group(cfg, batch, seqlen_q, seqlen_k, nheads_kv, kv_group, device.sm_count())
    return (n_tiles * nheads_kv * batch,), (group,)


# ---- heuristics ---------------------------------------------------------------------------
# Query rows per step the op picks where a 128-row config exists (head_dim <= 64, no window or
# softcap): 128.  Measured (H200, 2026-11-26, bf16 d64, FA4 in the same run, TFLOP/s block_m 64 ->
# 128; tools/bench_attention_bwd.py --alt block_m=128, bench_attention_masks.py --varlen --backward
# --bwd-alt block_m=128): dense 2k 396 -> 422, 4k 475 -> 526, causal 2k 283 -> 344, causal 4k 405
# -> 440 (FA4 399 / 460 / 288 / 421); deterministic 322 -> 369, 394 -> 408; varlen causal 16k / 32k
# / 64k tokens 409 -> 455, 420 -> 466, 400 -> 445 (FA4 505 / 501 / 476).  Each 128-row step does
# half the steps' fixed work (barriers, the dQ slot hand-off, per-step TMA issue) per key tile,
# as FA4's sm90 backward at d64 does.  False restores 64 everywhere (A/B).
BLOCK_M_128 = True


# Causal calls (dense, not deterministic) from this head dim up take lpt_grid: the key tiles
# heaviest first in L2-sized sections instead of the 3-D grid's pair-after-pair order.  Measured
# (H100, 2026-11-26, bf16, FA4 and cuDNN in the same interleaved rounds, tools/ab_bwd_lpt128.sh;
# TFLOP/s at S 2k / 4k / 16k, 3-D grid -> lpt): d128 395 / 485 / 554 -> 403 / 503 / 587 (1.02 /
# 1.04 / 1.06); d96 378 / 462 / 545 -> 373 / 467 / 510 (0.99 / 1.01 / 0.94); d64 (128-row steps)
# 0.98 / 1.01 / 0.96.  d120 goes with d128 (unmeasured), d104-112 with d96.  stagger (non-causal)
# ran 0.97-1.01x at d64-128: not taken.
LPT_MIN_HEAD_DIM = 120


def query_step(head_dim: int, **mask_flags) -> int:
    """block_m the op picks: 128 where :data:`BLOCK_M_128` is on and the 128-row kernel builds clean
    (:class:`AttentionBwdSm90Config`'s rule), else 64."""
    ok = head_dim <= BLOCK_M128_MAX_HEAD_DIM and not (mask_flags.get("has_window") or mask_flags.get("has_softcap"))
    return 128 if (BLOCK_M_128 and ok) else _BLOCK_M


def choose_config(dtype: str, head_dim: int, causal: bool, deterministic: bool, **mask_flags) -> AttentionBwdSm90Config:
    """The config the op runs: head dims <= 128 this family's kernel, 136..256 attention_bwd_sm90_big's
    (:mod:`rtkernels.ops.attention_bwd_sm90_big`, which splits the head dim between the consumer
    warpgroups).  Two ring stages: Q/dO of the next tile land while this one computes, and 8+ KiB
    more per stage buys nothing once a step's GEMMs outlast its loads.  ``mask_flags``: the other
    compile-time mask fields (has_window, has_softcap, is_varlen)."""
    if head_dim > MAX_HEAD_DIM:
        from . import attention_bwd_sm90_big as big
        return big.choose_config(dtype, head_dim, causal, deterministic, **mask_flags)
    lpt = causal and not deterministic and not any(mask_flags.values()) and head_dim >= LPT_MIN_HEAD_DIM
    return AttentionBwdSm90Config(dtype=dtype, head_dim=head_dim, causal=causal, deterministic=deterministic,
                                  block_m=query_step(head_dim, **mask_flags), lpt_grid=lpt, **mask_flags)


def heuristic_configs(dtypes=("float16", "bfloat16")) -> list[AttentionBwdSm90Config]:
    """Every config the op can dispatch to."""
    return [choose_config(dt, d, c, det) for dt in dtypes for d in range(8, MAX_HEAD_DIM + 1, 8)
            for c in (False, True) for det in (False, True) if picks(d, c)]


# ---- dispatch and launch ------------------------------------------------------------------
ENABLED = True


# (head_dim, causal) whose Hopper kernel spills (ptxas of NVRTC 13.5, sm_90a); checked by the tests.
# (120, False) spilled 372 B; since the mask options' rewrite of the range code it builds clean under
# NVRTC 13.5 (2026-11, CPU), but stays on the mma.sync kernel until a GPU run (NVRTC 13.0 there)
# shows it clean and correct.
SPILLING = {(120, False)}


def picks(head_dim: int, causal: bool, mask_flags: tuple = (), dtype: str = "bfloat16",
          deterministic: bool = False) -> bool:
    """The op's rule for a (head_dim, causal, mask options) on sm_90, before looking at the arrays -
    the one place that sends a backward to a Hopper kernel: switched on, head_dim <= 128 (this
    family) or 136..256 (attention_bwd_sm90_big, switched by its own ``ENABLED``), and not a
    spilling case.  Masked variants: ptxas's report of the build itself, compiled here on first
    use (it is the build the op then runs); a spilling one keeps the mma.sync kernel, except for
    the small bookkeeping spill :func:`bookkeeping_spill_only` allows (softcap at d128 causal,
    NVRTC 13.5: 8 B).  The three options together at d128 spill more and stay on the mma.sync
    kernel; no head dim > 128 spills."""
    if head_dim > MAX_HEAD_DIM:
        from . import attention_bwd_sm90_big as big
        if not (ENABLED and big.ENABLED and head_dim <= big.MAX_HEAD_DIM):
            return False
    elif not (ENABLED and (head_dim, bool(causal)) not in SPILLING):
        return False
    if not any(v for _, v in mask_flags):
        return True
    key = (head_dim, bool(causal), mask_flags, dtype, bool(deterministic), query_step(head_dim, **dict(mask_flags)))
    if key not in _MASKED_CLEAN:
        from ..kernel import get_kernel
        cfg = choose_config(dtype, head_dim, causal, deterministic, **dict(mask_flags))
        r = get_kernel(cfg, cfg.kernels[0], arch="sm_90a").resources
        _MASKED_CLEAN[key] = bookkeeping_spill_only(r)
    return _MASKED_CLEAN[key]


_MASKED_CLEAN: dict = {}

# A masked variant may spill at most this many bytes (two 32-bit values) and still run here.  Softcap at
# d128 causal (NVRTC 13.5, 40 / 232 registers) stores two loop-bookkeeping integers once, in the prologue,
# and reloads them about once per query tile (9 LDL in the SASS, none among the per-score math);
# the alternative, the mma.sync backward, ran at 0.45x of the plain Hopper backward (H100, 2026-11-25).
BOOKKEEPING_SPILL_BYTES = 8


def bookkeeping_spill_only(resources) -> bool:
    """No spill, or one of at most :data:`BOOKKEEPING_SPILL_BYTES` stored bytes (the softcap case)."""
    return resources.spill_stores <= BOOKKEEPING_SPILL_BYTES and resources.stack_frame <= BOOKKEEPING_SPILL_BYTES


def runnable(arch: str, views, seqlen_k: int) -> bool:
    """An sm_90 device, at least one key and strides a tensor map can encode (the forward's rules)."""
    return is_sm90(arch) and seqlen_k >= 1 and all(tma_strides(v) for v in views)


def eligible(arch: str, views, seqlen_k: int, head_dim: int, causal: bool = False, mask_flags: tuple = (),
             dtype: str = "bfloat16", deterministic: bool = False) -> bool:
    """Whether rtk.attention_backward picks this kernel by itself: :func:`picks` and :func:`runnable`."""
    return runnable(arch, views, seqlen_k) and picks(head_dim, causal, mask_flags, dtype, deterministic)


_KERNELS: dict = {}


def kernels_for(cfg: AttentionBwdSm90Config, arch: str = "sm_90a"):
    """(main kernel, pre-pass, dQ conversion), memoized per (config, arch); a cold config compiles
    the three modules at once (get_kernels)."""
    key = (cfg, arch)
    hit = _KERNELS.get(key)
    if hit is None:
        from ..kernel import get_kernels
        hit = _KERNELS[key] = get_kernels(cfg, cfg.kernels, arch=arch)
    return hit


def launch(cfg: AttentionBwdSm90Config, arch: str, q_, k_, v_, o_, do_, lse_, lse2, delta, dq_, dk_, dv_, strides,
           softmax_scale: float, dot_grid, stream=None, mask_args=(0, 0, 0.0)) -> None:
    """Pre-pass (delta and lse*log2e into lse2/delta, the op's padded buffers, on ``dot_grid``),
    main kernel and dQ conversion over dense CuPy views (bfloat16 as uint16).  ``strides``: the
    element strides of o, do, dq, dk, dv; ``mask_args``: (window_left, window_right, softcap).
    Varlen calls run a :class:`VarlenBackwardPlan` instead."""
    import cupy
    from ..kernel import _StreamPtr
    from ._arrays import cupy_stream
    from .attention_bwd import _DOT_THREADS   # the template's DOT_THREADS
    kern, dot, convert = kernels_for(cfg, arch)
    s_o, s_do, s_dq, s_dk, s_dv = strides
    batch, seqlen_q, nheads, _ = q_.shape
    seqlen_k, nheads_kv = k_.shape[1], k_.shape[2]
    dot.launch(dot_grid, (_DOT_THREADS,), o_, do_, lse_, lse2, delta, seqlen_q, *s_o[:3], *s_do[:3], None, batch,
               stream=stream)
    maps = tuple(tensor_map(a, cfg.dtype, shape, strides_, box, swizzle=cfg.tma_swizzle)
                 for a, (shape, strides_, box) in zip((q_, k_, v_, do_), map_specs(cfg, q_, k_, v_, do_)))
    m_tiles = -(-seqlen_q // _DQ_ROWS)
    # f32 dQ tiles in the consumers' fragment order, and (deterministic) 4 int32 per query tile for
    # the ordered additions (one 16-byte acquire load each); zeroed on the launch stream
    with cupy_stream(stream):
        dq_accum = cupy.empty((batch, nheads, m_tiles, _DQ_ROWS * cfg.head_dim), cupy.float32)
        count = cupy.empty((batch, nheads, m_tiles, 4), cupy.int32) if cfg.deterministic else None
    sptr = cupy.cuda.get_current_stream().ptr if stream is None else (
        stream.ptr if hasattr(stream, "ptr") else _StreamPtr(stream).ptr)
    for buf in (dq_accum, count):
        if buf is not None:
            cupy.cuda.runtime.memsetAsync(buf.data.ptr, 0, buf.nbytes, sptr)
    grid, tail = cfg.launch_grid(batch, seqlen_q, seqlen_k, nheads_kv, nheads // nheads_kv)
    kern.launch(grid, (cfg.threads_per_block,), *maps,
                lse2, delta, dq_accum, count, dk_, dv_, seqlen_q, seqlen_k, nheads // nheads_kv, nheads,
                *s_dk[:3], *s_dv[:3], float(softmax_scale), None, None, None, batch, *mask_args, *tail,
                shared_mem=cfg.shared_mem_bytes, stream=stream)
    convert.launch((m_tiles, nheads, batch), (128,), dq_accum, dq_, seqlen_q, *s_dq[:3], float(softmax_scale), None,
                   batch, stream=stream)


def map_specs(cfg: AttentionBwdSm90Config, q_, k_, v_, do_) -> tuple:
    """(shape, strides, box) of the Q, K, V and dO tensor maps - everything but the base addresses,
    so a launch plan can keep them: boxes one swizzle span wide (64 columns = 128 bytes, SW128; or
    the big kernel's 32 = 64 bytes, SW64) of block_m query rows or block_n key rows."""
    box = lambda rows: (1, rows, 1, cfg.tma_box_cols)   # noqa: E731
    return tuple((tuple(a.shape), _map_strides(a), box(rows))
                 for a, rows in ((q_, cfg.block_m), (k_, cfg.block_n), (v_, cfg.block_n), (do_, cfg.block_m)))


# ---- varlen: one plan for the full path and the replays ----------------------------------------------
@dataclass(frozen=True)
class VarlenBackwardPlan:
    """A varlen backward on the Hopper kernels (this family's and attention_bwd_sm90_big's): the
    pre-pass, the dQ accumulators' zeroing, the schedule pre-kernel, the main kernel and the dQ
    conversion, with everything but the addresses and cu_seqlens' contents fixed.

    The full path builds one from its checked views (:meth:`record`) and runs it (:meth:`run`); a
    call with both max_seqlen hints keeps it (rtkernels.ops.attention_bwd), and later calls with
    the same signatures run it on their own arrays (:meth:`replay`): no checks, no views, no host
    read of cu_seqlens.  Every temporary - lse*log2e and delta (heads x padded rows, f32), the f32
    dQ accumulator, the deterministic order's counters and the schedule table - is a slice of ONE
    buffer, the stream's workspace (ops/workspace.py: kept for good, so a CUDA graph that captured
    the call - CuPy or torch - replays into memory it still owns), at fixed 256-byte aligned
    offsets (workspace.carve), so the parts alive together in a call never overlap.  The price: that buffer stays allocated at the largest
    size a stream asked for (the accumulator is heads x padded rows x head_dim x 4 bytes, e.g. 64
    MiB for 16 heads x 8k tokens at d128) - the memory CuPy's pool would have cached for the
    per-call arrays anyway, minus what it could have lent to other arrays between calls.
    """
    kernels: tuple              # (main, pre-pass, dQ conversion)
    cfg: object
    specs: tuple                # the Q, K, V, dO tensor maps' (shape, strides, box)
    out_shapes: tuple           # dq, dk, dv as the caller sees them
    out_dtype: object           # of the arrays handed back (torch or CuPy dtype)
    torch: bool
    dot_grid: tuple
    dot_block: tuple            # the pre-pass's threads (the template's DOT_THREADS)
    grid: tuple                 # the main kernel's: kv heads x schedule slots
    m_tiles: int                # 64-row dQ tiles of each head's padded rows
    scalars: tuple              # total_q, total_k, group, nheads, sequences, softmax_scale
    strides: tuple              # element strides (first three) of o, do, dq, dk, dv
    mask_args: tuple
    offsets: tuple              # byte offsets of lse2, delta, dq_accum, counters (or None), the table
    zero_bytes: int             # dq_accum and the counters, contiguous: one memset
    nbytes: int                 # the workspace the call needs
    sched: object               # the schedule pre-kernel's launch (attention_mask.ScheduleLaunch)

    @classmethod
    def record(cls, cfg, arch: str, views, outs, strides, softmax_scale: float, dot_grid, mask_args, vl,
               rows: int) -> "VarlenBackwardPlan":
        """The plan of a call: ``views`` the checked (1, total, heads, head_dim) views of do, q, k,
        v, o; ``outs`` the dq, dk, dv handed back; ``rows`` the padded rows of each head's
        lse2/delta (a multiple of 128)."""
        from ._arrays import _is_torch
        from .attention_bwd import _DOT_THREADS
        from .attention_mask import schedule_launch, schedule_slots
        do_, q_, k_, v_, _ = views
        _, total_q, nheads, head_dim = q_.shape
        total_k, nheads_kv = k_.shape[1], k_.shape[2]
        m_tiles = rows // _DQ_ROWS
        slots = schedule_slots(vl, cfg.block_n, keys=True)
        # key tiles of the packed sequences; descending where the deterministic causal order needs it
        sched = schedule_launch(vl.batch, vl.total_k, vl.total_q, cfg.block_n, slots, cfg.causal and cfg.deterministic,
                                arch)
        offsets, nbytes = carve((4 * nheads * rows, 4 * nheads * rows, 4 * nheads * rows * head_dim,
                                 16 * nheads * m_tiles if cfg.deterministic else 0, 8 * slots))
        return cls(kernels_for(cfg, arch), cfg, map_specs(cfg, q_, k_, v_, do_), tuple(tuple(o.shape) for o in outs),
                   outs[0].dtype, _is_torch(outs[0]), tuple(dot_grid), (_DOT_THREADS,), (nheads_kv * slots,), m_tiles,
                   (total_q, total_k, nheads // nheads_kv, nheads, vl.batch, float(softmax_scale)),
                   tuple(tuple(s[:3]) for s in strides), tuple(mask_args), offsets, offsets[4] - offsets[2], nbytes,
                   sched)

    def run(self, arrays, grads, cu_q, cu_k, like, dev: int, stream) -> None:
        """Launch on ``arrays`` (do, q, k, v, o, lse) and ``grads`` (dq, dk, dv): CuPy views or the
        caller's CuPy arrays / torch tensors (the kernels take addresses); ``like``: the caller's
        q (the workspace's kind); ``stream``: a CuPy stream, raw handle or None (CuPy's current)."""
        import cupy
        do, q, k, v, o, lse = arrays
        dq, dk, dv = grads
        kern, dot, convert = self.kernels
        cfg = self.cfg
        s_o, s_do, s_dq, s_dk, s_dv = self.strides
        total_q, total_k, group, nheads, nb, scale = self.scalars
        base = address(stream_workspace(like, dev, stream, self.nbytes, 0)[0])
        lse2, delta, accum, count, table = (None if off is None else DevicePtr(base + off) for off in self.offsets)
        dot.launch(self.dot_grid, self.dot_block, o, do, lse, lse2, delta, total_q, *s_o, *s_do, cu_q, nb,
                   stream=stream)
        cupy.cuda.runtime.memsetAsync(accum, 0, self.zero_bytes, stream_handle(stream))
        self.sched.run(cu_k, cu_q, table, stream)
        maps = tuple(tensor_map(address(a), cfg.dtype, shape, strides, box, swizzle=cfg.tma_swizzle)
                     for a, (shape, strides, box) in zip((q, k, v, do), self.specs))
        kern.launch(self.grid, (cfg.threads_per_block,), *maps,
                    lse2, delta, accum, count, dk, dv, total_q, total_k, group, nheads, *s_dk, *s_dv, scale, cu_q,
                    cu_k, table, nb, *self.mask_args, shared_mem=cfg.shared_mem_bytes, stream=stream)
        convert.launch((self.m_tiles, nheads, 1), (128,), accum, dq, total_q, *s_dq, scale, cu_q, nb, stream=stream)

    def replay(self, arrays, grads, cu_q, cu_k, stream, dev: int):
        """A later call with the recorded signatures: the outputs not given are allocated, then
        :meth:`run` on the caller's arrays.  Returns (dq, dk, dv)."""
        q = arrays[1]
        if self.torch and stream is None:
            stream = torch_stream_ptr(sys.modules["torch"], dev)
        res = tuple(given if given is not None else empty_as(q, shape, self.out_dtype)
                    for given, shape in zip(grads, self.out_shapes))
        self.run(arrays, res, cu_q, cu_k, q, dev, stream)
        return res
