"""attention_kvcache: attention against a KV cache for decoding (flash-decoding), contiguous or paged.

``o = attention_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None,
causal=True, softmax_scale=None, return_lse=False, num_splits=None, out=None, stream=None)``
has the semantics of FlashAttention's ``flash_attn_with_kvcache``.  One kernel family,
``attention_decode`` (templates/attention_decode.cu.j2), with three entry points: the split-KV
attention kernel (which also merges the splits' partial results, "fused": by the last CTA of a
group to finish, or - the group merge - by every CTA of the group in a cooperative launch, or -
the cluster merge, 2-8 splits - by the CTAs of a thread-block cluster through distributed shared
memory), the combine kernel that merges them as a launch of its own when they are many and the
grid cannot be resident at once, and the append kernel that writes k_new / v_new into the cache
first.

The call reads top-down: check (shapes, dtypes, strides, devices; cheap, no device reads) ->
plan (config from :func:`choose_config`, splits from :func:`choose_num_splits`, grid, the
by-value argument struct) -> launch.  Plans are kept per call signature (:class:`LaunchPlans`),
so a decoding loop pays for the checks once; a replay packs the arrays' addresses into one
by-value struct and launches.  Nothing on the per-call path reads device data: the grid is
sized from shapes (the cache's capacity), each CTA reads its sequence's length itself, and
out-of-range cache contents (lengths, page ids) are caught on the device, where they turn that
sequence's output into NaN.  :func:`check_kvcache_inputs` (or ``validate=True``) checks them on
the host instead, with a synchronization.

Split-KV partial results and the fused merge's counters live in a workspace per (device,
stream), allocated on first use and kept (never freed, so a CUDA graph that captured a call can
replay it): calls on one stream share it in stream order, calls on different streams get their
own.  A graph replays its captured workspace: do not replay it concurrently with eager calls on
the stream it was captured on.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np

from .._env import getenv_raw
from ..config import register_family
from ..errors import ConfigError, LaunchError
from ._arrays import (Launch, LaunchPlans, _is_torch, address, as_device_array, default_stream, dtype_name,
                      empty_as, remember)
from .attention import AttentionShape, _device_arch, _device_of, _dtype_of, _elem_strides, _smem_limit
from .workspace import stream_workspace

FAMILY = "attention_decode"
OP = "attention_kvcache"
MAX_SPLITS = 128          # the combine kernel keeps one weight per split in shared memory
COMBINE_THREADS = 256     # one output row per combine CTA
APPEND_THREADS = 256
_GRID_X_MAX = 2 ** 31 - 1
WARP_SPLITS = ("keys", "rows")
SCHEDULES = ("split", "streamk")
LOADERS = ("cp.async", "tma")
MMAS = ("sync", "wgmma")
# Split counts the cluster merge compiles for (AttentionDecodeConfig.cluster_merge): one portable
# thread-block cluster (at most 8 CTAs) per split group.
CLUSTER_MERGE_SPLITS = (2, 3, 4, 5, 6, 7, 8)
# ... and the plans take it by default up to this many splits (beyond, the bench's variant
# combine:cluster asks for it).  Measured at 2 splits (2026-11-27, `tools/bench_decode.py --variants
# off=cluster:off`, 32/8 heads seqlen_q 16 unless noted, % of copy contiguous / paged16, the merge before
# -> the cluster merge; `decode_cluster_merge_2split_ab_*`, `decode_cluster_merge_even_share_ab_*`):
# H100 B8 S8k d128 88.9 / 85.2 -> 91.2 / 85.0, seqlen_q 8 91.5 / 82.0 -> 93.3 / 82.5, d96 74.1 / 74.4 ->
# 75.7 / 74.4; H200 B16 S8k d128 94.0 / 86.2 -> 97.1 / 88.1.  Clusters of a GPC's CTAs do not tile the SMs: the driver co-schedules 30 four-CTA or 15 eight-CTA
# clusters at one CTA per SM on an H200 (120 of 132 SMs), 62 / 30 at two, against 66 two-CTA
# clusters (every SM; cuOccupancyMaxActiveClusters, 2026-11-27).  So the split grids of 3-8 splits
# (about two CTAs per SM) fit only by packing three CTAs on some SMs while others idle, which cost
# more than the merge saves (seqlen_q 16 B4 S8k, 8 splits: 41.1 us against the group merge's 40.3).
CLUSTER_MERGE_DEFAULT_MAX_SPLITS = 2
# The keys mode's split grids (decoding: seqlen_q x group <= 16 rows per kv head) take it up to
# this many splits: there a grid is about one CTA per SM, where eight-CTA clusters fit (H100,
# 2026-11-27, B1 S32k 32/8 d128, 8 splits of 64 CTAs, per-CTA stamps: main loops end 43.7-45.0 us,
# the store of the partials ~1.1 us and the last CTA's merge ~2 us after the last of them).
KEYS_CLUSTER_MERGE_MAX_SPLITS = 8
L2_PREFETCHES = (0, 64, 128, 256)


@register_family
@dataclass(frozen=True)
class AttentionDecodeConfig(AttentionShape):
    """One specialization of the decode kernels (split-KV attention, combine, append).

    Parameters
    ----------
    dtype : "float16" or "bfloat16" (q, caches and o; float32 accumulation and partials).
    head_dim : multiple of 8 in [8, 256].
    causal : bottom-right causal mask compiled in (only matters for seqlen_q > 1).
    warp_split : how the CTA's warps share its work.  "keys": every warp holds all ``rows`` rows
        of one kv head and streams its own key tiles through its own cp.async ring (no CTA
        barrier; the warps' results merged at the end).  "rows": one CTA-wide ring of key tiles
        of ``kv_heads`` kv heads, and each warp computes 16 rows of one of those heads.
    rows : query rows per kv head per CTA (seqlen_q x heads of one GQA group, padded to 16).
        keys: 16, 32, 48 or 64 with rows x head_dim <= 4096 (every warp keeps O for all rows in
        registers); rows: 16 x (num_warps / kv_heads).
    kv_heads : kv heads per CTA (rows mode; 1 in keys mode): 1, 2, 4 or 8.
    block_n : keys per tile (16, 32 or 64).
    num_warps : 1 to 8 (keys mode: 1, 2, 4 or 8).
    num_stages : depth of the cp.async ring (2..6): num_stages - 1 tiles in flight.
    paged : K/V addressed through a block table (page sizes: multiples of 16).
    q_in_regs : keep Q's A fragments in registers (keys mode: read from shared memory once; rows
        mode: loaded from global memory straight into registers, no Q tile in shared memory).
    schedule : "split": one CTA per (row tile, split, sequence, head group).  "streamk" (keys mode,
        one row tile): a grid of a few CTAs per SM sharing all key tiles equally (template header).
    loader : how K/V tiles reach shared memory.  "cp.async": every lane copies 16-byte chunks
        (sm_80+).  "tma" (sm_90+): Hopper tensor copies (one per 64 columns x block_n keys x
        kv_heads heads, or x 16 keys of one page; columns past head_dim zero-filled) into
        128-byte-swizzled stages completing on an mbarrier per stage; the launch passes a tensor
        map of each cache.  Keys mode: lane 0 of each warp fills its warp's ring.  Rows mode: one
        producer thread fills the CTA's ring (num_stages >= 3: num_stages - 2 tiles in flight, a
        stage refilled once every warp released it on its "empty" mbarrier).  The op's default on
        sm_90 (see DECODE_LOADER).
    l2_prefetch : bytes a K/V miss brings into L2 (0: the default; 64, 128, 256): cp.async's
        ``.L2::<n>B`` qualifier, or the tensor maps' L2 promotion with loader "tma".
    mma : "sync" (mma.sync m16n8k16, K/V fragments by ldmatrix; sm_80+) or "wgmma" (rows mode with
        loader "tma", kv_heads 1, 4 or 8 warps, Q in registers, head_dim <= 128: each warpgroup's 64
        rows take S = Q K^T and O += P V as Hopper warpgroup MMAs reading K/V from the TMA stages;
        compiled for sm_90a).
    lazy_rescale : skip the online softmax's rescale of O in a key tile where no row of the warp
        has a new running maximum (a warp vote; exact: the correction is then 1).
    group_merge : 0, or compile the group merge loading this many splits per round trip: 2, 4, 8
        or 16 (at most 4 at head_dim <= 64).  Rows mode: every CTA of a split group merges a
        share of the partials, on a cooperative launch (see GROUP_MERGE_MIN_SPLITS); keys mode
        (schedule "split"): the last CTA to arrive merges every unit with the same loads, one L2
        round trip for splits <= group_merge (see _keys_merge).  Only the plans that use it
        compile it: the merge's code more than doubled the d128 rows kernel's SASS, and calls
        without it ran ~1% slower with it compiled in (H100, 2026-11-27).
    cluster_merge : 0, or the split count (2 to 8) of a TMA kernel (schedule "split", either
        mode) whose splits of one (sequence, head group) form a thread-block cluster and merge
        through distributed shared memory (no float32 partials in global memory, no counters, no
        cooperative launch; see CLUSTER_MERGE_SPLITS).  Only plans of exactly that many splits
        launch it.
    l2_evict_first : loader "tma": the K/V copies carry an L2 evict-first policy (see
        L2_EVICT_FIRST).
    merges : the in-kernel merges of the splits behind DecodeArgs.fused compiled into the
        kernel: "all" (each behind its runtime switch: the register merges of 2 to
        REG_MERGE_MAX_SPLITS splits in the rows mode, the unit merge, the serial merge, and with
        group_merge > 0 both group merges), "none" (with group_merge > 0: the cooperative group
        merge, any number of batches), "coop" (the cooperative group merge of splits that fit one
        batch, group_merge > 0: what a plan launches unless its splits pass group_merge_loads),
        "units", "serial", "group" (the keys mode's last CTA with the group merge's loads:
        group_merge > 0, its splits in one batch), or "regs2" ... "regs4" (the rows mode's register
        merge of exactly that many splits).  A plan compiles only the one it launches (see
        merges_for): the unused ones cost NVRTC time - the unit merge ~45% of a keys kernel's
        compile, the register merges ~60% of a rows kernel's (NVRTC 13.5, d96).  The cluster merge
        has its own field.
    """

    family: ClassVar[str] = FAMILY
    template: ClassVar[str] = "attention_decode.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("attention_decode", "attention_decode_combine", "attention_decode_append")
    # a plan launches the combine kernel only where its splits do not merge in the launch, the
    # append kernel only with k_new: each compiles alone (the two were ~15% of a keys kernel's
    # NVRTC time, NVRTC 13.5)
    module_per_kernel: ClassVar[bool] = True
    # The combine and append entry points have no MMA, so the family-wide flag stays off; the
    # tests check HMMA in the attention kernel's SASS.
    expects_tensor_cores: ClassVar[bool] = False
    expected_global_width: ClassVar[int | None] = None   # K/V arrive by cp.async; lengths, page ids, Q fragments are LDG

    rows: int = 16
    block_n: int = 16
    num_warps: int = 4
    num_stages: int = 3
    paged: bool = False
    q_in_regs: bool = True
    warp_split: str = "keys"
    kv_heads: int = 1
    schedule: str = "split"
    loader: str = "cp.async"
    l2_prefetch: int = 0
    mma: str = "sync"
    lazy_rescale: bool = False
    group_merge: int = 0
    cluster_merge: int = 0
    l2_evict_first: bool = False
    merges: str = "all"

    def __post_init__(self):
        self._check_shape()
        self._check_choice("warp_split", WARP_SPLITS)
        self._check_choice("block_n", (16, 32, 64))
        self._check_int("num_stages", 2, 6)
        self._check_choice("paged", (False, True))
        self._check_choice("q_in_regs", (False, True))
        self._check_choice("kv_heads", (1, 2, 4, 8))
        self._check_choice("schedule", SCHEDULES)
        if self.schedule == "streamk" and self.warp_split != "keys":
            self._fail("schedule", "'split' with warp_split='rows' ('streamk' is keys mode only)")
        self._check_choice("loader", LOADERS)
        self._check_choice("l2_prefetch", L2_PREFETCHES)
        if self.loader == "tma" and self.warp_split == "rows" and self.num_stages < 3:
            self._fail("num_stages", "3 to 6 with loader='tma' and warp_split='rows' (the producer refills a "
                                     "stage one tile after every warp released it)")
        if self.warp_split == "keys":
            self._check_choice("rows", (16, 32, 48, 64))
            self._check_choice("num_warps", (1, 2, 4, 8))
            if self.kv_heads != 1:
                self._fail("kv_heads", "1 with warp_split='keys' (one kv head per CTA)")
            if self.rows * self.head_dim > 4096:
                self._fail("rows", f"at most {4096 // self.head_dim // 16 * 16} at head_dim={self.head_dim} (every "
                                   "warp holds O for all rows in registers: rows x head_dim <= 4096)")
        else:
            self._check_int("num_warps", 1, 8)
            if self.num_warps % self.kv_heads:
                self._fail("num_warps", f"a multiple of kv_heads={self.kv_heads} (warp_split='rows': every kv head "
                                        "gets the same warps)")
            want = 16 * (self.num_warps // self.kv_heads)
            if self.rows != want:
                self._fail("rows", f"{want} = 16 x num_warps / kv_heads (warp_split='rows': 16 rows per warp)")
        self._check_choice("mma", MMAS)
        self._check_choice("lazy_rescale", (False, True))
        self._check_choice("group_merge", (0, 2, 4, 8, 16))
        if self.group_merge and self.schedule == "streamk":
            self._fail("group_merge", "0 with schedule='streamk' (stream-K merges its items itself)")
        if self.group_merge > group_merge_loads(self.head_dim):
            self._fail("group_merge", f"0, 2 or 4 at head_dim={self.head_dim} (at most "
                                      f"{group_merge_loads(self.head_dim)} partial loads in flight)")
        self._check_choice("l2_evict_first", (False, True))
        if self.l2_evict_first and self.loader != "tma":
            self._fail("l2_evict_first", "False with loader='cp.async' (the hint rides on the tensor copies)")
        self._check_choice("cluster_merge", (0, *CLUSTER_MERGE_SPLITS))
        self._check_choice("merges", MERGES)
        rows_split = self.warp_split == "rows" and self.schedule == "split"
        allowed = ("all", "none", "units", "serial") + (("coop",) if self.group_merge else ()) \
            + (("group",) if self.group_merge and self.warp_split == "keys" else ()) \
            + (tuple(m for m in MERGES if m.startswith("regs")) if rows_split else ())
        if self.merges not in allowed:
            self._fail("merges", f"{', '.join(map(repr, allowed))} with warp_split={self.warp_split!r}, "
                                 f"schedule={self.schedule!r}, group_merge={self.group_merge} (the register "
                                 "merges are the split rows mode's, 'coop' needs group_merge > 0, 'group' "
                                 "the keys mode with group_merge > 0)")
        if self.cluster_merge and (self.schedule != "split" or self.loader != "tma" or self.group_merge):
            self._fail("cluster_merge", f"0 with schedule={self.schedule!r}, loader={self.loader!r}, "
                                        f"group_merge={self.group_merge} (the cluster merge: the split schedule, "
                                        "TMA stages, no group merge)")
        if self.mma == "wgmma":
            # one warpgroup per 64 rows of one kv head, B operands straight from the TMA stages
            if self.warp_split != "rows":
                self._fail("mma", "'sync' with warp_split='keys' ('wgmma' is rows mode only)")
            if self.loader != "tma":
                self._fail("mma", "'sync' with loader='cp.async' ('wgmma' reads K/V from the TMA stages)")
            if self.kv_heads != 1:
                self._fail("kv_heads", "1 with mma='wgmma' (a warpgroup's MMAs read one kv head's keys)")
            if self.num_warps not in (4, 8):
                self._fail("num_warps", "4 or 8 with mma='wgmma' (whole warpgroups of 64 rows)")
            if not self.q_in_regs or self.head_dim > 128:
                self._fail("head_dim" if self.head_dim > 128 else "q_in_regs",
                           "head_dim <= 128 with q_in_regs=True for mma='wgmma' (Q's A fragments in registers)")

    # ---- derived values (the template re-checks them with static_assert) --------------
    @property
    def shared_mem_bytes(self) -> int:
        """keys: the larger of the main loop's buffers (Q tile + each warp's ring of K and V
        tiles, rows padded to odd 16-byte chunks) and the end's merge of the warps (float32 O per
        warp and row, strides of 8 or 24 words mod 32, plus row statistics) laid over them.
        rows: the Q tiles of the CTA's kv heads (none with q_in_regs) + the CTA's ring.
        TMA: 1 KB to align the ring(s) to the swizzle's 1024-byte period, the ring(s) (unpadded
        rows of whole 64-column blocks), Q; the keys mode's merge laid over them; then the 8-byte
        mbarriers (keys: one per warp and stage; rows: full and empty per stage)."""
        qk = ((self.head_dim_padded // 8) | 1) * 8
        vs = ((self.head_dim // 8) | 1) * 8
        rows_mode = self.warp_split == "rows"
        q_tile = (0 if self.q_in_regs else self.kv_heads * self.rows * qk) if rows_mode else self.rows * qk
        red_stride = self.head_dim + 8 if self.head_dim % 16 == 0 else self.head_dim
        merge = 0 if rows_mode else \
            4 * (self.num_warps * self.rows * red_stride + 2 * self.num_warps * self.rows + 2 * self.rows)
        if self.loader == "tma":
            rings = 1 if rows_mode else self.num_warps
            ring = rings * self.num_stages * 2 * self.kv_heads * self.block_n * self.tma_columns * 2
            # the cluster merge's O rows (head_dim + 4 floats each) and lse, laid over the ring (rows
            # mode) or past the warp merge's buffers (keys mode)
            cm = self.kv_heads * self.rows * (self.head_dim + 5) * 4 if self.cluster_merge else 0
            cm_end = ((1024 if rows_mode else -(-merge // 16) * 16) + cm) if cm else 0
            body = -(-max(1024 + ring + 2 * q_tile, cm_end, merge) // 8) * 8
            return body + 8 * self.num_stages * (2 if rows_mode else self.num_warps)
        if rows_mode:
            return 2 * (q_tile + self.num_stages * self.kv_heads * self.block_n * (qk + vs))
        pipe = 2 * (self.rows * qk + self.num_warps * self.num_stages * self.block_n * (qk + vs))
        return max(pipe, merge)

    @property
    def needs_arch_specific(self) -> bool:   # the family-wide ClassVar, per config here
        """mma "wgmma" compiles for the arch-specific target (sm_90a)."""
        return self.mma == "wgmma"

    @property
    def tma_columns(self) -> int:
        """loader "tma": columns of a K (or V) row in shared memory: head_dim rounded up to the
        64-column boxes (the copy zero-fills columns past head_dim)."""
        return -(-self.head_dim // 64) * 64

    @property
    def bytes_in_flight(self) -> int:
        """K/V bytes one CTA keeps requested while it computes: num_stages - 1 tiles (per warp in
        keys mode, per CTA of kv_heads heads in rows mode; the rows mode's TMA ring num_stages - 2,
        its last stage the producer's slack)."""
        tiles = self.num_warps if self.warp_split == "keys" else self.kv_heads
        ahead = self.num_stages - (2 if self.warp_split == "rows" and self.loader == "tma" else 1)
        return tiles * ahead * self.block_n * 2 * self.head_dim * 2

    def template_params(self) -> dict[str, Any]:
        p = super().template_params()
        p.update(smem_bytes=self.shared_mem_bytes, ptrs_bytes=PTRS_DTYPE.itemsize, args_bytes=ARGS_DTYPE.itemsize,
                 combine_threads=COMBINE_THREADS, max_splits=MAX_SPLITS, append_threads=APPEND_THREADS,
                 reg_merge_max_splits=REG_MERGE_MAX_SPLITS, group_merge_loads=group_merge_loads(self.head_dim),
                 cluster_merge_batch=group_merge_batch(self.cluster_merge, self.head_dim) if self.cluster_merge else 1,
                 **self.merge_paths)
        return p

    @property
    def reg_merge_splits(self) -> tuple[int, ...]:
        """The split counts whose register merge is compiled (rows mode; see ``merges``)."""
        if self.warp_split != "rows" or self.schedule != "split":
            return ()
        if self.merges == "all":
            return tuple(range(2, REG_MERGE_MAX_SPLITS + 1))
        return (int(self.merges[4:]),) if self.merges.startswith("regs") else ()

    @property
    def merge_paths(self) -> dict[str, Any]:
        """What of the in-kernel merges the template emits (``merges``, ``group_merge``), by its
        flag names: the one place that says which value compiles which path."""
        every = self.merges == "all"
        return {"reg_merge_splits": self.reg_merge_splits,
                "unit_merge": every or self.merges == "units",
                "serial_merge": every or self.merges == "serial",
                # group_merge > 0: the cooperative group merge (DecodeArgs.fused 4; merges "coop": its
                # splits in one batch, no loop for later ones), or the keys mode's last CTA with its
                # loads, one batch (fused 1; merges "group")
                "coop_group_merge": bool(self.group_merge) and self.merges in ("all", "none", "coop"),
                "coop_one_batch": self.merges == "coop",
                "last_group_merge": bool(self.group_merge) and self.warp_split == "keys"
                                    and self.merges in ("all", "group")}

    @classmethod
    def heuristic_defaults(cls, params: dict[str, Any], arch: str | None) -> dict[str, Any]:
        """Tile fields (and the loader: TMA in keys mode on sm_90; the TMA copies' L2 policy)
        not given come from :func:`choose_config` for one decode step of a GQA group of ``rows`` (default 16) query
        rows of one kv head."""
        tile = ("rows", "block_n", "num_warps", "num_stages", "q_in_regs", "warp_split", "kv_heads", "loader")
        if all(f in params for f in tile):
            return {}
        from .. import device
        base = {f: params[f] for f in ("dtype", "head_dim", "causal", "paged") if f in params}
        try:
            probe = cls(**base)
            cfg = choose_config(probe.dtype, probe.head_dim, params.get("rows", 16), probe.paged, probe.causal,
                                arch or device.current_arch(), nheads_kv=params.get("kv_heads", 1),
                                warp_split=params.get("warp_split"), loader=params.get("loader"))
        except (ConfigError, TypeError):
            return {}   # the constructor then reports the bad field itself
        out = {f: getattr(cfg, f) for f in tile}
        if "l2_evict_first" not in params:
            out["l2_evict_first"] = cfg.l2_evict_first
        return out


# ---- the by-value argument structs (DecodePtrs / DecodeArgs in the template, same order and types)
DECODE_PTRS: tuple[str, ...] = ("q", "k", "v", "o", "lse", "o_part", "lse_part", "counters", "cache_seqlens",
                                "block_table", "k_new", "v_new")
PTRS_DTYPE = np.dtype([(name, "<u8") for name in DECODE_PTRS])
_PACK_PTRS = struct.Struct("<%dQ" % len(DECODE_PTRS)).pack
DECODE_ARGS: tuple[tuple[str, str], ...] = (
    *((f"{a}_{s}", "i8") for a in ("q", "k", "v", "o", "kn", "vn") for s in ("batch", "seq", "head")),
    ("bt_batch", "i8"), ("cs_stride", "i8"),
    ("batch", "i4"), ("seqlen_q", "i4"), ("nheads_kv", "i4"), ("group", "i4"),
    ("seqlen_new", "i4"), ("capacity", "i4"), ("num_splits", "i4"), ("row_tiles", "i4"),
    ("page_size", "i4"), ("num_blocks", "i4"), ("order", "i4"), ("fused", "i4"),
    ("page_magic", "u4"), ("page_shift", "i4"), ("softmax_scale", "f4"), ("scale_log2", "f4"),
)
# 8-byte fields first, then an even number of 4-byte ones: NumPy's packed layout equals C's.
ARGS_DTYPE = np.dtype([(name, "<" + t) for name, t in DECODE_ARGS])


# ---- heuristics ---------------------------------------------------------------------------
class Tile(NamedTuple):
    block_n: int
    num_warps: int
    num_stages: int
    why: str


# keys mode: (lowest head_dim, highest head_dim) -> tiles in order of preference; the first that
# fits the target's shared memory per block is used.  Measured on an H100 (2026-11-25, bf16,
# tools/bench_decode.py --tiles): 16:4:3, 16:4:5, 16:8:3, 32:4:3 within +-3% of each other at
# every decode shape - the tile is not the limiter; the defaults stay.  A CTA keeps num_warps x
# (num_stages - 1) tiles in flight, and Little's law asks ~25 KB (H100, 3.35 TB/s x ~1 us / 132
# SMs) to ~36 KB (H200) per SM; these keep 48-128 KB per CTA in flight so one CTA per SM is
# enough, and stay under ~113 KB of shared memory (two CTAs per sm_90 SM) where the head dim allows.
HEURISTICS: list[tuple[int, int, tuple[Tile, ...]]] = [
    (8, 64, (
        Tile(32, 4, 3, "d64: 32-key tiles (8 KB of K+V per warp tile, as d128's 16-key tiles); 4 warps x 2 tiles "
                       "= 64 KB in flight; 2 x 9 KB x 3 stages x 4 warps = 110 KB smem: 2 CTAs per sm_90 SM"),
        Tile(32, 4, 2, "fallback when smem is short: 32 KB in flight"),
        Tile(16, 4, 2, "last resort"),
    )),
    (72, 128, (
        Tile(16, 4, 3, "d128: 16 keys x 512 B = 8 KB per warp tile; 4 warps x 2 tiles = 64 KB in flight per CTA; "
                       "104 KB smem: 2 CTAs per sm_90 SM"),
        Tile(16, 4, 2, "fallback when smem is short (sm_86/89: 99 KiB): 32 KB in flight"),
        Tile(16, 2, 2, "last resort"),
    )),
    (136, 256, (
        Tile(16, 4, 3, "d256: 16 KB per warp tile; 4 warps x 2 tiles = 128 KB in flight; 211 KB smem (sm_90 "
                       "only, 1 CTA per SM)"),
        Tile(16, 4, 2, "sm_80 (163 KiB): 64 KB in flight, 143 KB smem"),
        Tile(16, 2, 2, "sm_86/89 (99 KiB): 32 KB in flight"),
    )),
]

# "Lean" memory: a device whose DRAM streams under LEAN_MEMORY_GBS_PER_SM per SM (device.dram_gbs /
# SMs: an H100 SXM 25.4, an H200 36.5).  Three rules below were fitted on an H100 (2026-11-26) and lost
# on an H200 the same day (`decode_h200_rules_check_*`, `decode_h200_lean_vs_deep_*`, % of copy, the
# H100 rule -> the other): paged16 caches split as contiguous ones (H200 B8 S8k 83.3 -> 86.5, B1
# S128k 88.8 -> 93.4 with PAGED_FILL), compute-heavy rows at one CTA per SM (H200 seqlen_q 16 B8 S8k
# 62.9 -> 76.7, B16 S4k 67.8 -> 79.2, seqlen_q 8 65.2 -> 85.0 at two), 16-key d64 tiles (H200 B16 S4k
# 16/16 92.9 -> 96.0 with 32 keys); on the H100 each rule set wins its own cells back the other way
# (`decode_h100_lean_vs_deep_*`: seqlen_q 16 B16 S4k 93.1 against 82.5, d64 97.2 against 95.9).
# Each SM must keep about its bandwidth x latency in flight (Little's law), so the faster memory
# wants more CTAs and bigger tiles per SM; those rules apply where the memory is lean, the others
# elsewhere and where the driver does not report its memory (None).  Reasoned from those two devices.
LEAN_MEMORY_GBS_PER_SM = 30.0
# Pages of at least this many keys split as contiguous caches on any memory (TMA loader; since the
# keys mode reads its page ids a batch ahead, its pages of any size do: choose_num_splits): one
# block-table read per 64 keys.  Measured (H200, 2026-11-26, `decode_h200_lean_vs_deep_*`, paged64,
# PAGED_FILL -> contiguous rule): B1 S32k 72.5 -> 76.4, B8 S8k 87.1 -> 89.6, B1 S128k 95.3 -> 96.9,
# seqlen_q 4 B8 S8k 84.9 -> 88.3; paged16 there kept PAGED_FILL (86.5 / 93.4 against 83.3 / 88.8).
LONG_PAGE = 64


def lean_memory(gbs_per_sm: float | None) -> bool:
    """Whether the decode plan takes the lean-memory rules (see LEAN_MEMORY_GBS_PER_SM)."""
    return gbs_per_sm is not None and 0 < gbs_per_sm < LEAN_MEMORY_GBS_PER_SM


# keys mode, contiguous caches read by TMA at head dims <= 64 on lean memory: 16-key tiles (a warp tile
# of K+V is 4 KB at d64; the table's 32-key tile elsewhere, and for paged caches and cp.async).
# Measured (H100, 2026-11-26, `tools/bench_decode.py --variants n16=block_n:16`, % of copy, 32-key ->
# 16-key tiles): B16 S4k 16/16 d64 95.5 -> 98.0 (95.4 -> 97.7 and, two-warp, 97.9 in a second run;
# cuDNN 97.9), B8 S8k 16/16 96.7 -> 99.1, B32 S4k 16/16 98.0 -> 99.3, B16 S4k 32/8 89.5 -> 90.3, B4 S16k
# 84.2 -> 84.7, B1 S128k 92.4 -> 93.5, seqlen_q 4 B8 S8k 82.6 -> 83.4, d48 B16 S4k 16/16 74.7 -> 88.4,
# d32 76.6 -> 76.8; lost: B64 S2k 16/16 97.2 -> 95.3, B1 S32k 68.4 -> 67.9.  Twice the CTAs fit an SM
# (the smaller ring), which the many-CTA grids use.  Paged caches keep 32 keys (paged16 mixed: B16 90.4
# -> 91.9, B8 S8k 87.8 -> 84.6).
TMA_CONTIG_SMALL_HEAD_DIM = 64
TMA_CONTIG_SMALL_HEAD_TILE = Tile(16, 4, 3, "contiguous TMA caches at d <= 64: 16-key tiles (see above)")

# Which warp split serves which row count (rows = seqlen_q x GQA group per kv head).
# Keys mode up to 32 rows, rows mode above.  Measured (H100, 2026-11-25, seqlen_q 16 x group 4 = 64
# rows, B8 S8k 32/8 d128): keys mode with two 32-row tiles 67% of copy, the rows mode 51% - but that
# rows mode ran 64 CTAs (one row tile, no split: half the SMs) and its 64-key tiles spilled (36 B at
# 255 registers, causal).  ncu of the keys mode there (H200, 2026-11-26): one warp per scheduler
# issuing every 2.6 cycles (latency-bound, ALU the busiest pipe), L2 hit rate 62% (the second row
# tile re-reads K/V), DRAM at 39% of peak.  The rows mode reads K/V once for up to 128 rows,
# rescales O once per 32 keys instead of 16 and, split to two CTAs per SM (COMPUTE_FILL then), runs two
# warps per scheduler.  Reasoned from that profile; tools/bench_decode.py --variants times both.
ROWS_MODE_ABOVE = 32
# Decoding (<= 16 rows): "keys" until the rows mode's several-kv-heads-per-CTA variant (each CTA
# reads a key's kv_heads x head_dim run contiguously, the DRAM-locality hypothesis of issue #15)
# is measured against it: keys mode reached 93-95% of copy at 1 split on an H100 (2026-11-25).
# tools/bench_decode.py --variants times both in one run; RTKERNELS_DECODE_WARP_SPLIT overrides.
DECODE_WARP_SPLIT = os.environ.get("RTKERNELS_DECODE_WARP_SPLIT") or "keys"   # read at import
# K/V loader where TMA can serve (sm_90+, a cache a tensor map can describe - see tma_strides):
# "tma", in both warp splits.  Keys mode: measured (H200, 2026-11-26, tools/bench_decode.py --variants tma=loader:tma,
# bf16, % of the copy rate, cp.async -> tma, cuDNN beside): B64 S2k 94.3 -> 100 (101), B128 S1k
# 91.7 -> 96.5 (99.0), B16 S4k d64 89.3 -> 96.1 (96.9), B8 S8k 86.7 -> 92.1 (90.3), Sq4 B8 S8k
# 80.9 -> 85.7 (cuDNN 32.6); paged 16 / 64 +5-10 points (B128 S1k paged16 89.0 -> 96.0, B16 S4k
# d64 paged16 82.5 -> 92.5).  Why (issue #15): the cp.async ring streamed ~30 GB/s per SM with
# 64-128 KB in flight, past Little's law's ~48-64 KB, so the request path was the limit: a d128
# 16-key tile is 64 cp.async instructions per lane, a TMA tile 4 copies issued by one lane (167
# registers instead of 194).  Many rows (> ROWS_MODE_ABOVE) keep the rows mode (its cp.async ring:
# Sq16 B8 S8k 66.1% against 61.6% for TMA keys mode, same run), now with a TMA ring of its own
# (one producer thread, full / empty mbarriers): the cp.async ring's 128 threads issue 16 cp.async
# each per 32-key d128 tile between two CTA barriers, the same request-path limit the keys mode
# lost to TMA.  Measured (H200, 2026-11-26, --variants cp=loader:cp.async, B8 S8k 32/8 d128, % of
# copy cp.async -> tma): Sq16 67.7 -> 71.4 (paged16 48.8 -> 59.7), Sq64 19.2 -> 19.9; the cp.async
# rows ring stays for sm_80 and caches no map describes.
# RTKERNELS_DECODE_LOADER=cp.async switches both modes back (read at import).
DECODE_LOADER = os.environ.get("RTKERNELS_DECODE_LOADER") or "tma"
# The rows mode's MMAs for more than 16 rows per kv head on sm_90 (head_dim <= 128): "wgmma" (a
# warpgroup per 64 rows, K/V read from the TMA stages; see the template's header for the SASS count
# behind it) or "sync" (mma.sync per warp).  Measured (H200, 2026-11-26, tools/bench_decode.py
# --variants "wg=mma:wgmma", 32/8 heads d128, % of copy contiguous / paged16, default -> wgmma):
# Sq16 B8 S8k 71.6 / 59.9 -> 77.4 / 66.5, Sq16 B1 S32k 64.0 / 54.8 -> 67.9 / 59.8 (rows mode:
# wgmma everywhere it can run); Sq8 B8 S8k (32 rows, keys mode by default) 79.7 / 77.4 -> 84.2 /
# 71.3: the wgmma rows mode (32 padding rows) takes contiguous caches with 17-32 rows per kv head,
# paged ones keep the keys mode.  Skipping O's rescale when no row's max moved (lazy_rescale)
# gained nothing (70.0 vs 71.6, 79.9 vs 79.7): off.  RTKERNELS_DECODE_MMA=sync switches back
# (read at import).
DECODE_MMA = os.environ.get("RTKERNELS_DECODE_MMA") or "wgmma"
# The TMA loader's K/V copies carry an L2 evict-first policy: a cache is read once per step, so its
# lines should not push out what each call re-reads (cache_seqlens, block tables, the split
# partials) or what the kernels around it reuse (in a serving step every layer reads the same
# lengths and block table).  Measured (H200, 2026-11-27, tools/bench_decode.py --variants
# "ef=l2_evict_first:1", same rounds, 32/8 heads d128, % of copy contiguous / paged16, off -> on):
# B1 S32k 84.8 / 80.8 -> 86.6 / 83.3 (per-CTA stamps: the length read after entry 0.83 -> 0.58 us,
# now an L2 hit), B8 S8k 98.1 / 95.2 -> 98.5 / 95.9, B64 S2k 100 / 97.7 -> 101 / 98.0, B128 S1k
# 64/8 98.3 / 94.7 -> 98.2 / 95.3, seqlen_q 16 B8 S8k 84.8 / 78.7 -> 88.1 / 81.0, seqlen_q 8 B4 S8k
# 76.7 / 69.5 -> 80.5 / 72.0; a second H200 run and an H100 run alike (no cell lost more than 0.1;
# H100 seqlen_q 8 / 16 B4 S8k +4.2 / +4.7).  The cp.async loader keeps plain loads (sm_80-89, caches
# no map describes).  RTKERNELS_DECODE_L2_EVICT_FIRST=0 turns it off (read at import).
L2_EVICT_FIRST = os.environ.get("RTKERNELS_DECODE_L2_EVICT_FIRST", "1") != "0"

# Splits: no split shorter than this many keys (each split writes rows x head_dim float32
# partials that the merge reads back: at 256 keys that traffic is 1/32 of the split's K/V
# bytes per query row).  Reasoned.
MIN_KEYS_PER_SPLIT = 256
# A decode grid of fewer CTAs than SMs is split until it fills every resident slot once
# (ctas_per_sm x SMs CTAs, the kernel's occupancy: 2 for the d<=128 keys-mode tiles on sm_90).
# Measured, H200 (2026-11-26, bf16, copy 4.23 TB/s): one CTA pulls ~34 GB/s and an SM ~30-34 GB/s
# with one or two CTAs, so the HBM needs ~125+ busy SMs: B8 S8k 32/8 (64 CTAs) ran 51.5% of copy
# unsplit against 85.7% at 2 splits (128 CTAs); seqlen_q 8 there (64 CTAs of 32 rows) 46.2 / 72.4 /
# 73.9% at 1 / 2 / 4 splits: the second CTA per SM adds a little.  A grid of >= one CTA per SM is
# not split: B16 S4k d64 (256 CTAs) 88.2% unsplit vs 82.5% at 2; B64 S2k (512) 93.1 vs 86.8;
# B128 S1k (1024) 90.8 vs 82.1 - each extra CTA per SM costs its own ramp and merge.
# H100 (2026-11-25, .gpu/splits_sweep.json), where 64 CTAs already pulled 3 TB/s: B8 S8k 93.0% at
# 1 split, 86.5% at 4 (the old rule: no split above 0.45 CTA per SM); B1 S32k 77.1% at 16 splits,
# 70.6% at 33 and B1 S128k 94.2 / 91.6 / 88.9% at 8 / 16 / 33 - with the first combine (a serial
# loop, ~0.33 us per split, since replaced), which those many-split figures include.
# On lean memory (H100) the keys mode's grid is split until it keeps LEAN_GRID_BYTES_IN_FLIGHT of
# K/V requested (the config's bytes_in_flight per CTA), not until it fills every SM: about the
# DRAM's bandwidth x loaded latency (Little's law: 2.94 TB/s x ~1.4 us), past which more CTAs add
# only their ramps, partials and merge.  Measured (H100, 2026-11-27, `tools/bench_decode.py --splits
# 1,2,4,8,16`, 32/8 heads d128, 64 KiB per CTA, % of copy by forced splits, `decode_split_sweep_*`):
# B1 S32k 50.0 / 87.5 / 85.5 at 4 / 8 / 16 splits (the fill rule's 16), B2 S32k 96.2 / 95.1 at 4 / 8,
# B4 S16k 96.0 / 95.1 at 2 / 4, B8 S8k 99.3 / 94.1 at 1 / 2, B1 S128k 101 / 100 at 8 / 16, 64/8 B2
# S16k 85.8 / 84.9 at 4 / 8, seqlen_q 4 B4 S8k 82.3 / 82.4 at 2 / 4; d64 16/16 (32 KiB per CTA) B1
# S32k 67.7 / 86.1 / 83.5 at 4 / 8 / 16: 64 CTAs of 64 KiB, 128 of 32 KiB - the bytes, not the CTAs.
# The same A/B (`decode_lean_split_ab_*`, fill rule -> this one, same runs): B8 S8k 94.9 -> 99.3,
# seqlen_q 4 B8 S8k 93.4 -> 98.1, seqlen_q 2 B1 S32k 79.9 -> 84.5, B1 S32k 85.8 -> 86.7, B1 S128k 100 ->
# 101, B2 S32k 93.5 -> 94.2, 64/8 B2 S16k 83.6 -> 84.6.  The TMA loader's contiguous caches at
# head_dim <= 128 only (the cp.async ring, sm_80's, was not measured):
# paged caches lost everywhere at the fewer CTAs (paged16 B8 S8k 90.0 -> 72.0, B1 S32k 82.4 -> 66.5;
# paged64 93.2 -> 88.6: each page's block-table read waits in line), and d256's CTAs (128 KiB in
# flight) stream no faster than d128's (B1 S32k 16/2: 57.9 -> 49.0 at 16 splits; 32 CTAs, 49%).
# Deep memory (H200) keeps filling every SM: one CTA there pulls ~34 GB/s and B8 S8k ran 51.5% of
# copy at 64 CTAs against 85.7% at 128 (see above).
LEAN_GRID_BYTES_IN_FLIGHT = 4 << 20
LEAN_IN_FLIGHT_HEAD_DIM_MAX = 128
# Paged caches on lean memory (keys mode, TMA, d128 tiles: 64 < head_dim <= 128) lose at the
# contiguous rule's few CTAs (above), but since the page ids come a batch ahead (2026-11-27) a grid
# of half the SMs or more streams best unsplit, with a 4-stage ring when it holds at most one CTA
# per SM (three tiles in flight per warp, 96 KiB per CTA).  Measured (H100, 2026-11-27,
# `tools/bench_decode.py --splits 1,2,4,8,16 --variants s4=num_stages:4`, 32/8 heads d128, paged16,
# % of copy, `decode_paged_lean_splits_*`): B8 S8k (64 CTAs) 91.4 at the fill rule's 2 splits, 92.1
# at 1, 93.7 at 1 with 4 stages (91.1 at 2 with 4); seqlen_q 4 B8 S8k 90.2 / 91.3 / 92.7; and in
# two more runs of the same session 90.5 / 91.7 / 92.8 and 89.4 / 89.9 / 91.7.  Grids under half the
# SMs keep the fill rule: B4 S16k (32 CTAs) 91.6 at its 4 splits, 89.1 at 2 (89.8 with 4 stages);
# B2 S32k 91.5 at 8, 89.2 at 4; B1 S32k 83.1 at 16, 81.0 at 8.  Deeper rings gain nothing at the
# fill rule's split counts (90.3-91.9 against 90.5-91.6 at 2-8 splits).  The rule against the fill
# rule in one run (`decode_paged_lean_rule_ab_*`, paged16 / paged64): B8 S8k 90.4 / 91.2 -> 92.1 /
# 93.6, seqlen_q 4 B8 S8k 89.3 / 90.0 -> 92.4 / 94.1, B16 S8k (128 CTAs) 97.9 / 98.2 -> 98.1 / 98.3.
LEAN_PAGED_UNSPLIT_CTAS_PER_SM = 0.45
LEAN_PAGED_STAGES = 4
LEAN_PAGED_HEAD_DIMS = (64, 128)   # (lo, hi]: the keys mode's 16-key d128 tiles, where it was measured
PAGED_FILL = 2        # paged caches: CTAs per SM below which a grid that fills every SM once still splits
# CTAs of many query rows (>= HEAVY_ROWS per kv head: speculative decoding, chunked prefill) are
# compute-heavy: ~rows x 4 FLOP per K/V byte (64 FLOP/B at 64 rows).  Their grids split until every
# SM holds compute_fill(head_dim) CTAs: on lean memory COMPUTE_FILL (one) above d64 (the wgmma rows
# mode from d112, or at one CTA per SM unsplit: COMPUTE_FILL_LEAN_WGMMA_HEAD_DIM), else
# COMPUTE_FILL_SMALL_HEAD (two; d <= 64's CTAs do the same softmax work per key for half the bytes).
# Their partials are heavier too (rows x head_dim float32 per split against keys x head_dim x 4
# bytes of K/V): at least HEAVY_KEYS_PER_ROW x rows keys per split keeps them <= 1/16 of the K/V bytes.
# Measured (H100, 2026-11-26, `tools/bench_decode.py --splits 1,2,4,8,16 --variants
# "cf=combine:fused;ck=combine:kernel"`, wgmma rows mode, 32/8 heads, % of copy by forced splits):
# d128 seqlen_q 16: B16 S4k (128 CTAs) 92.5 at 1 split against 75.4 at the old rule's 2; B8 S8k (64)
# 85.6 at 2 (fused) against 81.0 at 4; B4 S8k seqlen_q 8 (32) 77.3 at 4 against 77.0 at 8; B2 S16k
# (16) 75.6 at 8 against 72.7 at 16; B1 S32k (8) 73.5 at 16 against 72.5 at 32, seqlen_q 8 78.5
# against 75.8 at 33; B32 S2k (256) unsplit either way (90.2).  One CTA per SM keeps the partials
# (32 KB per split of 64 rows at d128: 6% of B8 S8k's K/V bytes at 4 splits) and their merge small.
# d64 seqlen_q 16 B8 S8k (64 CTAs): 57.9 at 2 splits, 67.8 at 4 (71.6 fused): two CTAs per SM.
# Paged caches keep two CTAs per SM at every head dim: one CTA's producer thread waits on each
# page's block-table read, and at one CTA per SM paged16 fell to 58.9 / 63.2 / 53.7% at seqlen_q 16
# B8 S8k / B16 S4k / B4 S8k (79.5 at B8 with two).  That was the rows mode; the keys mode (which
# serves paged caches of 17-32 rows per kv head: seqlen_q 5-8 at GQA 4) reads its page ids a batch
# ahead, and at head dims above 64 fills one CTA per SM (COMPUTE_FILL) on either memory: measured
# (2026-11-27, `tools/bench_decode.py`, 32/8 heads d128 seqlen_q 8, % of copy paged16 / paged64, two
# CTAs per SM -> one, same rounds).  H100 (`decode_paged_keys_heavy_rule_ab_*`): B1 S32k 74.2 / 75.0 ->
# 80.5 / 81.1, B2 S16k 76.6 / 77.8 -> 79.8 / 80.9, B4 S8k 77.1 / 77.4 -> 80.1 / 80.3, B8 S8k 86.7 / 86.8
# -> 90.8 / 92.6, B16 S4k 91.0 -> 93.1 / 92.9.  H200 (`decode_paged_keys_heavy_one_per_sm_*`): B1 S32k
# 68.7 / 68.5 -> 75.3 / 76.4, B2 S16k 72.0 / 72.2 -> 75.2 / 76.1, B4 S8k 72.2 / 72.4 -> 74.5 / 75.9, B8
# S8k 83.5 / 82.9 -> 91.1 / 92.2, B16 S4k 90.1 / 91.6 -> 93.3 / 94.9.
HEAVY_ROWS = 32
COMPUTE_FILL = 1
COMPUTE_FILL_SMALL_HEAD = 2
HEAVY_KEYS_PER_ROW = 16
# Deep memory (an H200), the wgmma rows mode at d <= 64 over a contiguous cache: four CTAs per SM
# (as many as its 128-register tiles keep resident; the plan caps it at the kernel's occupancy).
# Such a CTA does the softmax work of a d128 one for half the bytes, and the deep memory asks more
# bytes in flight than two of them keep.  Measured (H200, 2026-11-27, `tools/bench_decode.py
# --splits 2,4,8,16,32`, 32/8 heads d64, % of copy, `decode_h200_rows_d64_splits_*`): seqlen_q 16 B8
# S8k (64 CTAs) 64.5 at the two-per-SM rule's 4 splits against 71.4 at 8; B16 S4k (128) 64.9 at 2
# against 70.9 at 4; seqlen_q 8 B4 S8k (32 rows per kv head) 53.7 at 8 against 55.4 at 16; B4 S8k
# (52.4 / 51.6 at 8 / 16), B1 S32k (47.8 at 32) and 64/8 B2 S16k seqlen_q 8 (50.8 at 16; 47.9 at 32)
# keep their counts (the key floor: HEAVY_KEYS_PER_ROW x rows keys per split).  Paged caches lost
# with more splits then (2026-11-27: paged16 B8 S8k 52.5 at 4, 41.4 at 8; B16 S4k 52.4 at 2, 43.6 at
# 4), but gain on today's kernel - page ids read a batch ahead since, and checked where used; which
# change turned it is not isolated (H200, 2026-11-29, `--layouts paged16,contig --splits 2,4,8,16`,
# seqlen_q 16 32/8 d64, % of copy, `decode_paged_splits_session37_*`): B8 S8k 55.4 at the two-per-SM
# rule's 4 splits against 73.1 at 8 (contiguous 78.2), B16 S4k 56.8 at 2 against 72.8 at 4 (77.1), B4
# S8k 48.2 at 8 against 56.0 at 16 (56.0; the key floor keeps it at 8).  d96 keeps two per SM (B16 S4k
# 68.1 at 2 against 51.1 at 4; B4 S8k 57.5 at 8 against 43.7 at 16), as do d80 and d128.
COMPUTE_FILL_DEEP_SMALL_HEAD = 4
# Lean memory, the wgmma rows mode over a contiguous cache below this head dim, grids of fewer CTAs
# than SMs: two CTAs per SM (COMPUTE_FILL_SMALL_HEAD), not one.  One 64-row CTA per SM is latency-
# bound there (fewer K/V bytes per key to hide its softmax behind; 3 CTAs of these tiles fit an SM).
# Measured (H100, 2026-11-28, `tools/bench_decode.py`, 32/8 heads, % of copy, one CTA per SM -> two,
# two alternating runs, `decode_lean_wgmma_fill_ab_session29_*`): seqlen_q 16 B4 S8k (32 CTAs) d72
# 53.0 / 53.1 -> 64.4 / 64.8, d80 58.0 / 58.5 -> 68.1 / 68.3, d96 68.1 / 68.5 -> 72.3 / 72.4, B2 S16k
# d96 68.0 / 68.7 -> 72.8 / 72.5, B1 S32k d96 68.3 / 68.5 -> 71.1 / 70.9, B8 S8k (64) d96 76.7 / 77.7 ->
# 78.1 / 78.3; seqlen_q 8 B2 S16k d96 70.0 / 70.5 -> 74.6 / 74.7.  d112 lost (B4 S8k 75.7 / 76.5 ->
# 73.3 / 73.6, seqlen_q 8 B2 S16k 78.8 / 79.3 -> 76.5 / 77.1) and d128 was level (81.3): from d112 one
# CTA per SM (d104 measured level either way with LEAN_WGMMA_SHALLOW_STAGES: 70.1 / 70.8 -> 70.0 /
# 70.6).  A grid of at least LEAN_WGMMA_UNSPLIT_CTAS_PER_SM keeps one CTA per SM (unsplit): B16 S4k d96
# (128 CTAs, 0.97 per SM) 78.6 / 78.4 unsplit -> 75.6 / 75.7 at two splits, where 64 CTAs (0.48)
# gained; between, unmeasured.  With LEAN_WGMMA_SHALLOW_STAGES, against the tree before (the same
# runs' numbers, `decode_lean_wgmma_rules_ab_session29_*`): d72 52.5 / 52.8 -> 63.8 / 63.3, d80 58.2
# / 58.5 -> 67.9 / 67.9, d96 B4 S8k 68.4 / 68.7 -> 74.0 / 74.2, B2 S16k 68.2 / 68.5 -> 74.2 / 74.4, B8
# S8k 77.2 / 77.6 -> 83.1 / 83.1, B1 S32k 68.4 / 68.1 -> 72.7 / 73.1, seqlen_q 8 B2 S16k 70.6 / 70.2
# -> 76.2 / 76.7; paged16, d64, d128 and seqlen_q 1 kept their plans in that tree (level).
COMPUTE_FILL_LEAN_WGMMA_HEAD_DIM = 112
LEAN_WGMMA_UNSPLIT_CTAS_PER_SM = 0.9
# Those two-per-SM grids (at least LEAN_WGMMA_SHALLOW_CTAS_PER_SM) at head dims in
# LEAN_WGMMA_SHALLOW_HEAD_DIMS [lo, hi) take a ring of LEAN_WGMMA_SHALLOW_STAGES: one tile in
# flight per CTA, ~3 MB over the grid instead of ~6 (an H100's DRAM streamed best at ~4 MB in flight
# in the keys mode too, see LEAN_GRID_BYTES_IN_FLIGHT).  Measured (H100, 2026-11-28,
# `tools/bench_decode.py --variants "s3=num_stages:3;s5=num_stages:5"`, 32/8 heads, % of copy, two
# runs, 4 -> 3 stages, `decode_lean_wgmma_stages_session29_*`): seqlen_q 16 d96 B4 S8k 72.8 / 72.8 ->
# 74.5 / 74.7, B2 S16k 72.6 / 72.9 -> 74.8 / 74.8, B8 S8k 78.5 / 78.1 -> 83.9 / 83.4, B1 S32k 71.5 /
# 71.7 -> 73.5 / 73.8, d104 B4 S8k 67.5 / 67.5 -> 71.0 / 71.0; seqlen_q 8 B2 S16k d96 75.0 / 75.1 ->
# 76.9 / 76.9.  Not taken: d80 (67.3 / 67.4 -> 65.3 / 65.5), d72 (63.6 / 64.1 -> 65.6 / 66.1, next to
# d80's loss), d64's four CTAs per SM (B4 S8k 73.1 / 73.2 -> 69.3 / 68.8), one CTA per SM (B16 S4k
# d96 unsplit 78.1 / 78.5 -> 70.6 / 70.8; d112 / d128 lost 5-8 points at 3 stages), and 5 stages
# (level to -2 at two per SM; +0.5-1.5 at d128 seqlen_q 8, one per SM: LEAN_WGMMA_DEEP_STAGES).
# Paged caches (two CTAs per SM at every head dim, PAGED_FILL) take the same three stages at d96-d104
# (paged16, same rounds, two runs, `decode_lean_wgmma_paged_stages_session29_*`): seqlen_q 16 d96 B4
# S8k 70.6 / 70.7 -> 71.6 / 71.8, B8 S8k 77.4 / 77.9 -> 79.5 / 79.6, B1 S32k 69.1 / 69.6 -> 70.3 / 70.7,
# B16 S4k (2 splits) 77.5 / 76.9 -> 82.1 / 82.7; d64 (66.2 / 66.6 -> 63.3) and d80 (68.5 -> 66.7 / 66.9)
# lost, d128 was level; five stages lost 0.5-2.5 on paged caches.
LEAN_WGMMA_SHALLOW_HEAD_DIMS = (96, 112)
LEAN_WGMMA_SHALLOW_CTAS_PER_SM = 1.8
LEAN_WGMMA_SHALLOW_STAGES = 3
# And its grids of at most one CTA per SM (d112+ by COMPUTE_FILL, or unsplit ones) from d96 take
# LEAN_WGMMA_DEEP_STAGES: three tiles in flight per CTA instead of two.  Measured (H100, 2026-11-28,
# variants in the same rounds, two runs, 4 -> 5 stages, `decode_lean_wgmma_deep_stages_session29_*`,
# % of copy): d128 seqlen_q 8 B4 S8k 85.0 / 85.4 -> 85.4 / 86.2, B2 S16k 85.7 / 85.4 -> 86.5 / 86.4, B1
# S32k 84.9 / 84.9 -> 85.7 / 85.8, B16 S4k 97.0 / 97.2 -> 97.5 / 97.9; seqlen_q 6 B4 S8k 84.9 / 85.7 ->
# 86.1 / 86.8; seqlen_q 5 B2 S16k 86.2 / 83.4 -> 86.7 / 85.0; seqlen_q 16 B4 S8k 82.5 / 82.3 -> 83.5 /
# 83.4, B1 S32k 83.5 / 83.5 -> 84.3 / 84.5; d120 seqlen_q 8 B4 S8k 77.9 / 76.7 -> 78.2 / 78.4; d112 B1
# S32k 77.6 / 77.6 -> 77.9 / 78.2; d96 seqlen_q 16 B16 S4k (unsplit) 78.1 / 78.5 -> 79.3 / 79.8.  Lost:
# d128 B8 S8k (2 splits, 128 CTAs) seqlen_q 8 96.0 / 95.8 -> 95.5 / 95.5, seqlen_q 16 94.0 / 93.9 ->
# 93.6 / 93.8.  Six stages: between the two.
LEAN_WGMMA_DEEP_STAGES = 5


def compute_fill(head_dim: int, paged: bool = False, lean: bool = False, wgmma: bool = False,
                 full_wave: bool = False) -> int:
    """CTAs per SM a compute-heavy decode grid is split to (see COMPUTE_FILL; one CTA per SM only on
    lean memory, see LEAN_MEMORY_GBS_PER_SM; four for the wgmma rows mode's small heads on deep
    memory, see COMPUTE_FILL_DEEP_SMALL_HEAD; two for its heads below d112 on lean memory unless the
    grid unsplit already nearly fills the SMs once, ``full_wave``, see COMPUTE_FILL_LEAN_WGMMA_HEAD_DIM)."""
    lean_wgmma_small = wgmma and head_dim < COMPUTE_FILL_LEAN_WGMMA_HEAD_DIM and not full_wave
    if lean and head_dim > 64 and not paged and not lean_wgmma_small:
        return COMPUTE_FILL
    if wgmma and not lean and head_dim <= 64:
        return COMPUTE_FILL_DEEP_SMALL_HEAD
    return COMPUTE_FILL_SMALL_HEAD


# The partials one fused merge (the last CTA of a group) reads: above this many bytes a combine
# launch of its own (one CTA per output row, all SMs) is faster than one CTA reading them.  Keys
# mode: 32 KB, reasoned (a CTA keeps ~32 KB of loads in flight, ~1 us each round trip); at 64 KB
# it measured level (H100, 2026-11-26, fused / combine launch, % of copy: B1 S32k 64/8 79.6 / 80.1,
# seqlen_q 2 79.5 / 79.6, d256 88.1 / 88.8, B2 S16k seqlen_q 2 80.8 / 80.3).  Rows mode: 64 KB,
# measured (the sweep above): 64 KB of partials (2 splits x 64 rows x d128) fused wins - seqlen_q 16
# B8 S8k 85.6 / 82.5, B16 S4k 82.3 / 75.4, seqlen_q 12 B8 S8k 85.3 / 82.8, d64 seqlen_q 16 B8 S8k at
# 4 splits 71.6 / 67.8; 128 KB is level (82.9 / 82.9, 76.4 / 76.9); 256 KB and more lose (B4 S8k
# seqlen_q 8 at 8 splits 70.4 / 76.8, B1 S32k 42-54 / 72-78).
FUSED_COMBINE_MAX_BYTES = 32 * 1024
FUSED_COMBINE_MAX_BYTES_ROWS = 64 * 1024
# The rows mode merges up to REG_MERGE_MAX_SPLITS splits from the last CTA's registers (the
# template's register_merge: each thread loads the other splits' partials at its own accumulator
# positions - the first chunk with their lse, one L2 round trip per <= 64 registers of loads (32
# from 3 splits on), no shared memory), whatever their bytes: 2 splits x 64 rows x d128 is one
# round trip where the unit merge above takes five.  Measured (H100, 2026-11-26, two runs,
# `tools/bench_decode.py --variants "ru=merge:units;ck=combine:kernel"`, 32/8 heads, contiguous, %
# of copy, run 1 / run 2), registers against the unit merge (ru) at the same splits: seqlen_q 16 B8
# S8k (2 splits) 88.7 / 89.9 against 85.5 / 86.4 (paged16 81.9 / 83.1 against 79.2 / 80.0);
# seqlen_q 8 B8 S8k 90.9 / 92.5 against 88.9 / 90.1; d96 seqlen_q 16 B8 (2) 73.2 / 73.8 against
# 70.7 / 71.2 (paged16 +5.4 / +5.8); d64 seqlen_q 16 B8 (4 splits) 76.4 / 74.7 against 73.8 / 72.4;
# and at 4 splits of d128 (128 KB, which went to the combine launch) seqlen_q 16 B4 S8k 73.8 /
# 73.9 against 72.6 / 72.2 (the combine launch forced: 72.1), seqlen_q 12 74.9 against 74.3.
# d128 keeps 167 registers; d64 goes from 119 to 124 (still 4 CTAs per SM).
REG_MERGE_MAX_SPLITS = 4
# AttentionDecodeConfig.merges
MERGES = ("all", "none", "coop", "units", "serial", "group",
          *(f"regs{n}" for n in range(2, REG_MERGE_MAX_SPLITS + 1)))


# The rows mode's group merge (a cooperative split grid: every CTA of a (sequence, head group, row
# tile) waits for the others and merges a share of their partials; templates/attention_decode.cu.j2,
# group_merge) from GROUP_MERGE_MIN_SPLITS splits on, and on paged caches from 2.  It replaces the
# combine launch (5.3-5.8 us of a 55-61 us seqlen_q 16 call at 8-16 splits: the split kernel timed
# alone, tools/decode_split_probe.py) and the last CTA's serial merge.  Measured (H100, 2026-11-27,
# the tree before and after in alternating processes, twice; `tools/bench_decode.py --quick`, 32/8
# heads, % of copy, contiguous): seqlen_q 16 B1 S32k (16 splits: the combine launch before) 76.0 /
# 74.8 -> 77.4 / 77.2, B2 S16k (8) 76.3 / 75.4 -> 77.4 / 77.7, B4 S8k (4: the register merge
# before) 74.5 / 73.7 -> 76.9 / 77.2, seqlen_q 8 B4 S8k 76.8 / 75.9 -> 79.5 / 79.7, B1 S32k 77.8 /
# 76.7 -> 79.3 / 79.5, d64 seqlen_q 16 B8 S8k (4) 75.6 / 75.1 -> 77.9 / 76.5; paged16 seqlen_q 16
# B4 S8k 68.7 / 68.3 -> 73.5 / 73.9, B2 S16k 71.1 / 70.7 -> 73.1 / 73.5, B8 S8k (2 splits) 83.1 /
# 82.6 -> 84.8 / 83.5, d96 74.9 / 74.7 -> 75.7 / 76.5, B1 S32k level (72.1 / 71.0 -> 72.1 / 72.0).
# At 2 splits on contiguous caches the last CTA's register merge stays ahead (the variant
# combine:group, another call: seqlen_q 16 B8 S8k 89.9 / 88.9 against 88.6 / 88.1, seqlen_q 8 91.9 /
# 92.2 against 90.3 / 91.2, d96 74.7 / 75.2 against 73.6 / 74.2).  The keys mode keeps its merges
# (its partials are a few rows: see the template).
GROUP_MERGE_MIN_SPLITS = 3
# The keys mode takes it where its partials would go to the combine launch (more than
# FUSED_COMBINE_MAX_BYTES per group: 8-16 query rows x 16 splits and more).  Measured (H200,
# 2026-11-27, `tools/bench_decode.py --variants grp=combine:group`, 32/8 heads d128, two events
# around each queue, % of copy, combine launch -> group merge, contiguous / paged16): seqlen_q 2 B1
# S32k (16 splits) 78.4 / 75.3 -> 81.1 / 78.2, seqlen_q 4 77.5 / 74.1 -> 80.3 / 76.8.  Where the keys
# mode merges in the launch already (the last CTA, a cluster) it was level or lost 0.3-0.8.  On an
# H100 (same day, combine:kernel against it): paged16 seqlen_q 2 / 4 B1 S32k (16 splits) 80.6 / 79.5
# -> 82.5 / 81.6; d256 16/2 B1 S32k (66 splits, one CTA per SM) lost, 59.4 -> 57.9: head dims up to
# KEYS_GROUP_MERGE_HEAD_DIM_MAX only.
KEYS_GROUP_MERGE = True
KEYS_GROUP_MERGE_HEAD_DIM_MAX = 128


def group_merge_loads(head_dim: int) -> int:
    """The group merge's float4 partial loads a thread keeps in flight (the template's GM_LOADS):
    16 above d64, 4 at d <= 64 (whose rows-mode tiles are register-bound)."""
    return 16 if head_dim > 64 else 4


def group_merge_batch(num_splits: int, head_dim: int) -> int:
    """AttentionDecodeConfig.group_merge for a split count: the splits of a unit per round trip
    (a power of two >= num_splits, at most group_merge_loads), the rest of the loads going to
    more units at once."""
    cap = group_merge_loads(head_dim)
    return next((n for n in (2, 4, 8, 16) if n >= num_splits and n <= cap), cap)


# (config, device) pairs whose cooperative launch a device refused (a LaunchError: the
# driver co-schedules fewer CTAs than the occupancy model said, or none): their plans merge as
# before from then on.
_GROUP_REFUSED: set = set()


def _refusal_key(cfg, device) -> tuple:
    """_GROUP_REFUSED's entry for a config as the tile heuristics gave it (no group merge, every
    in-kernel merge) on a device."""
    return cfg.replace(group_merge=0, merges="all"), device


class _GroupRefused(LaunchError):
    """The device refused a group-merge plan's cooperative split grid (nothing of it launched)."""


def _group_merge(want, merge, cfg, p, num_splits: int, ctas: int, arch: str, sms: int, combine_launch: bool = False):
    """(config, kernel) of the group merge for a split grid (see GROUP_MERGE_MIN_SPLITS), or None:
    rows mode, or the keys mode where its partials would otherwise go to the combine launch
    (``combine_launch``; see KEYS_GROUP_MERGE), every CTA resident at once by the occupancy model (the cooperative launch checks
    the driver's count), not refused before on this device; the bench's variants combine:group /
    fused / kernel and merge:* decide for themselves.  Only a grid that can fit compiles the
    group kernel (a bound from shared memory and threads first), and a plan that takes it does
    not compile the kernel without it."""
    # by default: the rows mode's grids of enough splits; the keys mode's where the combine launch would run
    by_default = num_splits >= (2 if p.paged else GROUP_MERGE_MIN_SPLITS) and (cfg.warp_split == "rows" or (
        combine_launch and KEYS_GROUP_MERGE and cfg.head_dim <= KEYS_GROUP_MERGE_HEAD_DIM_MAX))
    if _refusal_key(cfg, p.device) in _GROUP_REFUSED:
        return None
    if want != "group" and (want is not None or merge is not None or not by_default):
        return None
    from ..arch import occupancy
    from ..kernel import get_kernel
    grid = ctas * num_splits
    if grid > occupancy(arch, cfg.threads_per_block, 1, 0, cfg.shared_mem_bytes).blocks_per_sm * sms:
        return None
    batch = group_merge_batch(num_splits, p.head_dim)
    # One batch (merges "coop"), the usual case, compiles without the later batches' loop: the d96 rows
    # plan's kernel 0.44 -> 0.36 s of NVRTC 13.5 here, its cold first call 1.33-1.39 -> 1.10-1.15 s on an
    # H100 host (NVRTC 13.0); speed level, paged16 seqlen_q 4 B1 S32k 81.7-82.0 -> 82.9-83.1% of copy
    # (H100, 2026-11-28, two alternating runs).
    gcfg = cfg.replace(group_merge=batch, merges="coop" if num_splits <= batch else "none")
    gkernel = get_kernel(gcfg, "attention_decode", arch=arch)
    return (gcfg, gkernel) if grid <= _ctas_per_sm(gcfg, gkernel, arch) * sms else None


# The rows mode's splits of one group merge through distributed shared memory when they fit one
# thread-block cluster (CLUSTER_MERGE_SPLITS) and every cluster of the grid is resident at once:
# the template's cluster_merge.  It replaces the group merge and the register merge there.
# Residency: a cluster's CTAs must share a GPC, and left to itself the scheduler packed clusters 3
# CTAs to an SM where the kernel fits 3, leaving 8 SMs idle: their CTAs' main loops ran 35.6 us
# against 31.5 on SMs of 2 (H200, 2026-11-27, B4 S8k seqlen_q 16 d128, 8 splits, per-CTA stamps of
# tools/decode_timeline.py), and the call ended later than the group merge's (41.1 / 40.3 us).  So the
# launch asks enough shared memory that no SM holds more than the grid's even share; grids whose
# clusters do not all fit then keep the merges before (CLUSTER_MERGE_DEFAULT_MAX_SPLITS says which fit).
def _cluster_merge(v: dict, cfg, num_splits: int, ctas: int, row_tiles: int, arch: str, sms: int):
    """(config, kernel, dynamic shared memory to launch with) of the cluster merge for a split grid,
    or None: rows mode with wgmma (where it was measured) or the keys mode's TMA split grid, one row
    tile (a cluster is consecutive splits), up to CLUSTER_MERGE_DEFAULT_MAX_SPLITS splits in the rows
    mode and KEYS_CLUSTER_MERGE_MAX_SPLITS in the keys mode (2-8 under the variant combine:cluster),
    one resident wave of clusters at the even share of CTAs per SM (the occupancy model and the
    driver's cluster count); the bench's variants cluster:off, any merge or another combine keep
    the merges before."""
    if v.get("cluster") == "off" or v.get("merge") is not None or v.get("combine") not in (None, "cluster"):
        return None
    keys = cfg.warp_split == "keys" and cfg.loader == "tma"   # (stream-K plans never get here)
    if not (keys or cfg.mma == "wgmma") or row_tiles != 1 or num_splits not in CLUSTER_MERGE_SPLITS:
        return None
    default_max = KEYS_CLUSTER_MERGE_MAX_SPLITS if keys else CLUSTER_MERGE_DEFAULT_MAX_SPLITS
    if num_splits > default_max and v.get("combine") != "cluster":
        return None
    from ..arch import occupancy
    from ..kernel import get_kernel
    from .rowwise import driver_clusters
    ccfg = cfg.replace(cluster_merge=num_splits, merges="none")
    kernel = get_kernel(ccfg, "attention_decode", arch=arch)
    threads, regs = ccfg.threads_per_block, kernel.resources.registers
    per_sm = min(_ctas_per_sm(ccfg, kernel, arch), -(-ctas * num_splits // sms))   # the even share
    smem = ccfg.shared_mem_bytes
    while occupancy(arch, threads, regs, 0, smem).blocks_per_sm > per_sm:
        smem += 1024
    fit = per_sm * sms // num_splits
    fit = min(fit, driver_clusters(kernel, threads, smem, num_splits) or fit)
    return (ccfg, kernel, smem) if ctas <= fit else None


# The keys mode's last CTA merges with the group merge's loads (every split's lse and partial
# chunk of its units at once: one L2 round trip) when the splits fit one batch of
# group_merge_loads, instead of the unit merge (a round trip for every lse, the weights through
# shared memory, then one per batch of 8 splits): the merge is a serial tail after the whole grid
# (B1 S32k, 16 splits: 54.9 us whole, 51.0 us without the merge).  Measured (H100, 2026-11-27,
# `tools/decode_split_probe.py --variants units=merge:units`, 32/8 heads, seqlen_q 1, us of two
# runs; the variant is the unit merge on the same release/acquire counters): B1 S32k d128 (16
# splits) 54.6 / 54.5 -> 53.5 / 53.5 (85.8% of copy; 51.1 / 51.4 without any merge), B2 S32k (8)
# 97.3 / 97.3 -> 96.2 / 96.3, B1 S128k (16) 183.4 / 183.7 -> 182.1 / 182.6, B8 S8k (2) 97.0 / 97.1
# -> 96.7 / 96.8, d64 B1 S32k (16 splits: past d64's batch of 4, so the unit merge either way)
# level.  No kernel changed its registers' occupancy (d96 146 -> 209 registers at 2 CTAs per SM).
def _keys_merge(cfg, p, num_splits: int, merge):
    """The keys-mode config whose last CTA merges in one round trip (see above), or ``cfg`` (rows
    mode, stream-K, a variant's merge - merge:units is the baseline - or more splits than one batch)."""
    if (cfg.warp_split != "keys" or cfg.schedule != "split" or merge is not None
            or num_splits > group_merge_loads(p.head_dim)):
        return cfg
    return cfg.replace(group_merge=group_merge_batch(num_splits, p.head_dim))


def merges_for(cfg, num_splits: int, fused: bool, merge) -> str:
    """AttentionDecodeConfig.merges of a split-schedule plan: the one in-kernel merge its
    DecodeArgs.fused selects (``merge``: None, or the bench's variant "serial" / "units"), or
    "none" where the splits do not merge by their last CTA (one split, the combine launch, the
    cooperative group merge, the cluster merge)."""
    if num_splits == 1 or not fused or merge in ("group", "cluster"):
        return "none"
    if merge in ("serial", "units"):
        return merge
    if cfg.warp_split == "rows" and num_splits <= REG_MERGE_MAX_SPLITS:
        return f"regs{num_splits}"
    if cfg.warp_split == "keys" and cfg.group_merge:
        if num_splits > cfg.group_merge:   # (_keys_merge's batch holds every split: the kernel loads one batch)
            raise RuntimeError(f"{OP}: internal: {num_splits} splits past the keys-mode merge's batch of "
                               f"{cfg.group_merge}")
        return "group"
    return "units"


def candidates(head_dim: int) -> tuple[Tile, ...]:
    for lo, hi, tiles in HEURISTICS:
        if lo <= head_dim <= hi:
            return tiles
    raise ConfigError.bad_value(FAMILY, "head_dim", head_dim, "a multiple of 8 in [8, 256]")


def max_rows(head_dim: int) -> int:
    """keys mode: the most query rows one CTA takes at this head dim: each warp holds O (rows x
    head_dim / 32 registers per thread) and S (rows x 16 / 32 at 16-key tiles), and rows x
    (head_dim + 16) <= 4608 keeps the two at d128's 32 rows (231-246 registers, no spill); d64 at
    64 rows reached 255 on sm_80 (NVRTC 13.5), so it gets 48.  At most 64 rows."""
    return max(16, min(64, 4608 // (head_dim + 16) // 16 * 16))


def rows_for(rows_total: int, head_dim: int) -> int:
    """keys mode: query rows per CTA for seqlen_q x group rows: all of them (rounded up to 16) when
    they fit."""
    return min(max_rows(head_dim), max(16, -(-rows_total // 16) * 16))


def _kv_heads_for(nheads_kv: int, want: int | None) -> int:
    """kv heads per CTA: the largest of 8, 4, 2, 1 (at most ``want``) dividing nheads_kv."""
    for kv in (8, 4, 2, 1):
        if kv <= (want or 8) and nheads_kv % kv == 0:
            return kv
    return 1


# rows mode: at least this many warps per CTA (extra warps take padding rows: their MMAs are idle
# issue slots in a memory-bound loop), and at most this many 16-byte K (and V) chunks per thread
# and tile.  Measured with NVRTC 13.5 (sm_80, sm_90; paged, causal): 16-32 chunks per thread (1-2
# warps copying 64-key tiles, or d256 tiles of 8 kv heads) spilled 4-740 bytes at 255 registers,
# each chunk's page id and address held for the next tile; 8 chunks at 4-8 warps: 145-240 registers.
ROWS_MODE_MIN_WARPS = 4
MAX_LOAD_ITERS = 8
# rows mode with TMA: ring depths to try, deepest first.  The producer refills the stage of tile
# n - 2 while the warps compute tile n (one stage of slack, so no warp waits for the slowest one),
# so 4 stages keep the cp.async ring's 2 tiles in flight: d128, 32-key tiles of one kv head = 2 x
# 16 KB per CTA, 65 KB of shared memory (two CTAs per sm_90 SM, as COMPUTE_FILL_SMALL_HEAD asks).
# Reasoned; tools/bench_decode.py --variants times num_stages 3 and 5 against it.
ROWS_TMA_STAGES = (4, 3)


def _rows_config(dtype, head_dim, rows_total, paged, causal, arch, nheads_kv, kv_heads=None, block_n=None,
                 num_stages=None, l2_prefetch=0, loader="cp.async", num_warps=None,
                 mma="sync") -> AttentionDecodeConfig:
    """warp_split="rows": 16 rows per warp, up to 128 rows per head (8 warps) for many rows; for
    decoding (<= 16 rows) one warp per kv head and up to 8 kv heads per CTA; at least
    ROWS_MODE_MIN_WARPS warps.  Tiles: ~128 (d <= 64: 256, d > 128: 64) key rows of K+V per stage
    over the CTA's heads (64 KB of K+V at d128, as the keys mode's 4 warps x 16 keys x 2 stages)
    and (cp.async) at most MAX_LOAD_ITERS chunks per thread; 3 stages where the shared memory
    allows, else 2 (TMA: ROWS_TMA_STAGES, else 3); else 16-key tiles; else fewer kv heads, else
    fewer rows per CTA.  Reasoned, to be measured (tools/bench_decode.py --variants).
    mma "wgmma": one kv head, a warpgroup per 64 rows (4 warps up to 64 rows, padding rows
    included; 8 warps above, or when ``num_warps`` asks), 32-key tiles by default."""
    if mma == "wgmma":
        return _wgmma_rows_config(dtype, head_dim, rows_total, paged, causal, arch, block_n, num_stages, l2_prefetch,
                                  loader, num_warps)
    tma = loader == "tma"
    hd_pad = -(-head_dim // 16) * 16
    chunks = head_dim // 8
    limit = _smem_limit(arch)
    target = 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64
    need_rw = min(8, max(1, -(-rows_total // 16)))
    kv0 = _kv_heads_for(nheads_kv, kv_heads if kv_heads else (8 if rows_total <= 16 else 1))
    while need_rw >= 1:
        kv = kv0
        while kv >= 1:
            rw = max(need_rw, -(-ROWS_MODE_MIN_WARPS // kv))
            threads = 32 * kv * rw
            # TMA: the ring's stages are cheap to deepen, so first look for a tile two CTAs fit on
            # one SM (COMPUTE_FILL_SMALL_HEAD) before taking the whole shared memory (reasoned)
            for budget in ((limit // 2 - 1024, limit) if tma else (limit,)):
                if kv * rw > 8:
                    break
                for bn in ((block_n,) if block_n else (64, 32, 16)):
                    iters = 0 if tma else -(-kv * bn * chunks // threads)   # TMA: no copy in the threads
                    # S of a 16-row warp is bn / 2 registers: <= 32, and <= 16 beside d >= 128's O
                    # (d128, 64-key tiles, causal: 255 registers and 36 B of spills, NVRTC 13.5 sm_90)
                    too_big = bn > max(16, target // kv) or (hd_pad >= 128 and bn > 32)
                    if not block_n and (too_big or (bn > 16 and iters > MAX_LOAD_ITERS)):
                        continue
                    if not block_n and iters > MAX_LOAD_ITERS and kv > 1:
                        break   # even 16-key tiles are too many chunks per thread: fewer kv heads
                    for stages in ((num_stages,) if num_stages else ROWS_TMA_STAGES if tma else (3, 2)):
                        cfg = AttentionDecodeConfig(dtype=dtype, head_dim=head_dim, causal=causal, rows=16 * rw,
                                                    block_n=bn, num_warps=kv * rw, num_stages=stages, paged=paged,
                                                    q_in_regs=hd_pad <= 128, warp_split="rows", kv_heads=kv,
                                                    loader=loader, l2_prefetch=l2_prefetch)
                        if cfg.shared_mem_bytes <= budget:
                            return cfg
            kv //= 2
        need_rw //= 2
    raise ConfigError(f"{OP}: no rows-mode tile for head_dim={head_dim} fits {arch}'s {limit} B of shared memory per "
                      "block", family=FAMILY, field="head_dim", value=head_dim, allowed="a smaller head_dim")


# mma "wgmma": the rows mode's key tile and ring depths.  32 keys: S is 16 registers beside O's 64
# and Q's 32 at d128 (the mma.sync rows mode's tile); 64 keys halves the softmax's per-tile row
# bookkeeping (max, shuffles, rescale of O) per key for 16 more registers - tools/bench_decode.py
# --variants times block_n 64 and deeper rings.  Reasoned, to be measured.
WGMMA_BLOCK_N = 32


def _wgmma_rows_config(dtype, head_dim, rows_total, paged, causal, arch, block_n, num_stages, l2_prefetch, loader,
                       num_warps) -> AttentionDecodeConfig:
    # (the config's own checks refuse head_dim > 128 and loader "cp.async" for mma "wgmma")
    warps = num_warps or (4 if rows_total <= 64 else 8)
    limit = _smem_limit(arch)
    for stages in ((num_stages,) if num_stages else ROWS_TMA_STAGES):
        cfg = AttentionDecodeConfig(dtype=dtype, head_dim=head_dim, causal=causal, rows=16 * warps,
                                    block_n=block_n or WGMMA_BLOCK_N, num_warps=warps, num_stages=stages, paged=paged,
                                    q_in_regs=True, warp_split="rows", kv_heads=1, loader=loader,
                                    l2_prefetch=l2_prefetch, mma="wgmma")
        if cfg.shared_mem_bytes <= limit:
            return cfg
    raise ConfigError(f"{OP}: no wgmma rows-mode tile for head_dim={head_dim} fits {arch}'s {limit} B of shared "
                      "memory per block", family=FAMILY, field="num_stages", value=num_stages, allowed="fewer stages")


def tma_capable(head_dim: int, arch: str) -> bool:
    """Whether loader="tma" can serve this head dim on this arch (sm_90+; any head dim of the
    family: 64-column boxes, the columns past head_dim filled with zeros by the copy)."""
    from ..compiler import parse_arch
    return head_dim % 8 == 0 and int(parse_arch(arch)[1]) >= 90


def choose_config(dtype: str, head_dim: int, rows_total: int, paged: bool, causal: bool, arch: str, *,
                  lazy_rescale: bool = False, lean_memory: bool = False, l2_evict_first: bool | None = None,
                  **tile) -> AttentionDecodeConfig:
    """The config the heuristics pick (:func:`_choose_tile`; ``tile``: its keyword overrides), with
    ``lazy_rescale`` (a tuning variant: no rescale of O in a tile where no row's maximum moved);
    ``lean_memory``: the device's DRAM is lean per SM (:func:`lean_memory`); ``l2_evict_first``:
    the TMA copies' L2 policy (None: L2_EVICT_FIRST; cp.async configs never carry it)."""
    cfg = _choose_tile(dtype, head_dim, rows_total, paged, causal, arch, lean_memory=lean_memory, **tile)
    if cfg.loader == "tma" and (L2_EVICT_FIRST if l2_evict_first is None else l2_evict_first):
        cfg = cfg.replace(l2_evict_first=True)
    return cfg.replace(lazy_rescale=True) if lazy_rescale else cfg


def _choose_tile(dtype: str, head_dim: int, rows_total: int, paged: bool, causal: bool, arch: str, *,
                 nheads_kv: int = 1, warp_split: str | None = None, kv_heads: int | None = None,
                 block_n: int | None = None, num_stages: int | None = None,
                 num_warps: int | None = None, schedule: str = "split", loader: str | None = None,
                 l2_prefetch: int = 0, mma: str | None = None, lean_memory: bool = False) -> AttentionDecodeConfig:
    """The config the heuristics pick for ``rows_total`` = seqlen_q x (nheads / nheads_kv) query
    rows per kv head, ``nheads_kv`` kv heads; the keyword tile fields override the heuristics
    (tuning: tools/bench_decode.py --variants).  ``loader`` None: DECODE_LOADER where the config
    allows it (keys mode, :func:`tma_capable`), else "cp.async"; "tma" given explicitly also
    raises ConfigError where TMA cannot serve.  ``mma`` None: DECODE_MMA where the config allows it
    (rows mode, sm_90+, head_dim <= 128), else "sync"; "wgmma" given explicitly implies the rows mode
    and raises ConfigError where it cannot serve."""
    if loader == "tma" and not tma_capable(head_dim, arch):
        raise ConfigError.bad_value(FAMILY, "loader", loader, f"'cp.async' at head_dim={head_dim} on {arch} "
                                    "('tma' needs sm_90+)")
    if mma == "wgmma" and not tma_capable(head_dim, arch):
        raise ConfigError.bad_value(FAMILY, "mma", mma, f"'sync' on {arch} ('wgmma' needs sm_90+)")
    if mma not in (None,) + MMAS:
        raise ConfigError.bad_value(FAMILY, "mma", mma, "'sync' or 'wgmma'")
    if loader is None:
        loader = "tma" if DECODE_LOADER == "tma" and tma_capable(head_dim, arch) else "cp.async"
    wgmma_ok = (DECODE_MMA == "wgmma" and mma is None and loader == "tma" and head_dim <= 128 and not kv_heads
                and tma_capable(head_dim, arch))
    if warp_split is None:
        # 17-32 rows: the wgmma rows mode on contiguous caches only (measured: see DECODE_MMA)
        wg_small = wgmma_ok and not paged and 16 < rows_total <= ROWS_MODE_ABOVE
        warp_split = "rows" if rows_total > ROWS_MODE_ABOVE or mma == "wgmma" or wg_small else DECODE_WARP_SPLIT
    if warp_split not in WARP_SPLITS:
        raise ConfigError.bad_value(FAMILY, "warp_split", warp_split, "'keys' or 'rows'")
    if warp_split == "rows":
        if mma is None:
            mma = "wgmma" if (wgmma_ok and rows_total > 16) else "sync"
        return _rows_config(dtype, head_dim, rows_total, paged, causal, arch, nheads_kv, kv_heads, block_n,
                            num_stages, l2_prefetch, loader, num_warps, mma)
    if mma == "wgmma":
        raise ConfigError.bad_value(FAMILY, "mma", mma, "'sync' with warp_split='keys' ('wgmma' is rows mode only)")
    rows = rows_for(rows_total, head_dim)
    limit = _smem_limit(arch)
    tiles = candidates(head_dim)
    if lean_memory and loader == "tma" and not paged and head_dim <= TMA_CONTIG_SMALL_HEAD_DIM:
        tiles = (TMA_CONTIG_SMALL_HEAD_TILE,) + tiles
    if block_n or num_stages or num_warps:
        base = tiles[0]
        tiles = (Tile(block_n or base.block_n, num_warps or base.num_warps, num_stages or base.num_stages,
                      "override"),) + tiles
    for t in tiles:
        # S for the tile lives in rows / 16 x block_n / 8 x 4 registers: at most 32.
        bn = t.block_n
        while rows * bn > 1024 and bn > 16:
            bn //= 2
        hd_pad = -(-head_dim // 16) * 16
        cfg = AttentionDecodeConfig(dtype=dtype, head_dim=head_dim, causal=causal, rows=rows, block_n=bn,
                                    num_warps=t.num_warps, num_stages=t.num_stages, paged=paged,
                                    q_in_regs=rows * hd_pad <= 2048,   # Q fragments: <= 32 registers
                                    schedule=schedule, loader=loader, l2_prefetch=l2_prefetch)
        if cfg.shared_mem_bytes <= limit:
            return cfg
    raise ConfigError(f"{OP}: no tile for head_dim={head_dim} fits {arch}'s {limit} B of shared memory per block",
                      family=FAMILY, field="head_dim", value=head_dim, allowed="a smaller head_dim")


# Two warps per CTA (four CTAs per SM instead of two) for unsplit contiguous grids of more than one
# CTA per SM.  Measured (H200, 2026-11-26, `tools/bench_decode.py --variants w2=num_warps:2`, % of
# copy, the default timed twice within 0.4): B64 S2k 32/8 d128 (512 CTAs) 101 -> 104, B128 S1k 64/8
# (1024 CTAs) 97.0 -> 98.9 - the last partial wave of 264 slots shrinks; B16 S4k d64 (256 CTAs, one
# wave) 99.0 -> 99.1.  The rule then started above two CTAs per SM; on an H100 (2026-11-26, same
# bench, two runs) grids of one to two CTAs per SM gain too: B16 S4k 16/16 d96 (256 CTAs) 76.8 -> 86.2,
# d64 94.1 -> 95.4 and 94.5 -> 96.0, B24 S4k 32/8 d128 (192) 93.5 -> 95.3; B32 S4k 32/8 d128 (256)
# 99.1 / 99.7 -> 98.9 / 99.3 (level).  Paged caches lost (H200: B128 paged16 97.4 -> 95.6, B16 94.5
# -> 90.7) and a split grid (B8 S8k) fell 93.9 -> 70.5: both keep four warps.  Head dims <= 128
# (d256's rings keep two CTAs per SM at two warps: nothing to gain).
TWO_WARP_HEAD_DIM_MAX = 128


def _two_warp_tile(cfg: AttentionDecodeConfig) -> bool:
    """A config the two-warp rule may replace: the keys mode's four-warp TMA tile on a contiguous cache."""
    return (not cfg.paged and cfg.warp_split == "keys" and cfg.loader == "tma" and cfg.schedule == "split"
            and cfg.num_warps == 4 and cfg.head_dim <= TWO_WARP_HEAD_DIM_MAX)


def _two_warp_ctas(cfg, fields: dict, ctas: int, sms: int, splits) -> bool:
    return "num_warps" not in fields and not splits and _two_warp_tile(cfg) and ctas > sms


def choose_num_splits(ctas: int, capacity: int, sms: int, paged: bool = False, rows: int = 1,
                      ctas_per_sm: int = 1, heavy_fill: int = COMPUTE_FILL_SMALL_HEAD,
                      cta_bytes_in_flight: int = 0) -> int:
    """Splits of each sequence's keys for ``ctas`` CTAs without splitting (batch x kv-head groups
    x row tiles) over a cache of ``capacity`` keys per sequence, on ``sms`` SMs holding
    ``ctas_per_sm`` CTAs of this kernel each (its occupancy).

    - a grid of >= one CTA per SM is not split (measured, see the comment above MIN_KEYS_PER_SPLIT:
      splits there only add CTAs, each with its own ramp, partials and merge);
    - a smaller grid is split until it fills ``ctas_per_sm`` x sms CTAs.  The op asks one CTA per
      SM on deep memory (B8 S8k 32/8: 64 CTAs -> 2 splits; B1 S32k: 8 CTAs -> 16, merged in the launch): measured
      against filling both resident slots of the d128 tiles (H200, 2026-11-26, % of copy, fill 1 /
      fill 2): B8 S8k 86.1 / 84.0, B1 S32k 74.3 / 69.1 (33 splits need the separate combine
      launch), B1 S128k 91.0 / 89.9; unsplit B8 S8k ran 51.3 (half the SMs idle).
    - ``paged``: paged caches (each page waits on a block-table read): split until PAGED_FILL CTAs
      per SM.  On lean memory (:func:`lean_memory`) the op passes False for paged caches its TMA
      loader reads, and for its pages of LONG_PAGE keys or more on any memory: those split as
      contiguous ones (H100, 2026-11-26, `tools/bench_decode.py --variants pc=split_rule:contig`, %
      of copy paged16 / paged64, PAGED_FILL -> contiguous rule): B1 S32k 75.4 / 75.9 -> 79.0 / 80.4
      (and 76.0 / 76.9 -> 79.7 / 80.1 in a second run), B1 S128k 92.6 / 94.7 -> 94.6 / 95.5, B2 S32k
      88.3 / 88.7 -> 89.9 / 90.6, B4 S16k 87.6 / 89.5 -> 88.7 / 90.6, B8 S8k 86.1 / 89.3 -> 90.1 / 90.4
      (88.4 / 88.9 -> 88.2 / 90.2 in the first run), B16 S8k seqlen_q 2 92.8 / 94.9 -> 96.2 / 97.4, B8
      S8k 16/16 d64 87.3 / 88.6 -> 86.9 / 94.7, seqlen_q 4 B8 S8k 86.0 / 86.9 -> 86.4 / 89.3 and B1 S32k
      73.3 / 74.6 -> 76.4 / 77.5: fewer CTAs, and B1's 16 splits merge in the launch (33 needed the
      combine launch).  The block-table wait that PAGED_FILL hid is off the critical path once one
      lane issues whole-tile tensor copies a tile ahead - on lean memory: on an H200 PAGED_FILL
      still won (see LEAN_MEMORY_GBS_PER_SM) until the keys mode read its page ids a batch ahead;
      since, the op passes False for TMA-read pages in keys mode on any memory (H200, 2026-11-27,
      `decode_h200_paged_rule_*`, paged16 PAGED_FILL -> contiguous rule, two runs: B1 S32k 73.4 ->
      77.8 and 71.5 -> 77.6, B1 S128k 96.9 -> 99.2 and 94.9 -> 97.1, B8 S8k 90.5 -> 91.0 and 88.7 ->
      88.3, seqlen_q 4 B8 S8k 88.2 -> 88.9 and 86.1 -> 86.3, d64 16/16 95.8 -> 95.2 and 92.4 -> 92.4).
      The rows mode's TMA pages, read a batch ahead too since, measured level under either rule on
      an H200 (2026-11-27, seqlen_q 16 paged16, default / contiguous rule: B8 S8k 79.5 / 79.5, B4 S8k
      66.4 / 66.9, B1 S32k 65.2 / 65.1, d64 52.3 / 52.4): they keep PAGED_FILL below LONG_PAGE keys.
    - (A paged grid of >= LEAN_PAGED_UNSPLIT_CTAS_PER_SM on lean memory is not split: the op's
      :func:`_heuristic_splits` decides that before calling here.)
    - ``cta_bytes_in_flight`` > 0 (the op passes it on lean memory: keys mode, TMA, contiguous
      caches, head_dim <= LEAN_IN_FLIGHT_HEAD_DIM_MAX): the grid splits
      only until it keeps LEAN_GRID_BYTES_IN_FLIGHT requested, at most the slots above (B1 S32k
      32/8 d128: 8 splits, not 16).
    - CTAs of ``rows`` >= HEAVY_ROWS query rows per kv head split until every SM holds
      ``heavy_fill`` of them (the op passes :func:`compute_fill` of the head dim;
      HEAVY_KEYS_PER_ROW x rows keys per split at least).
    No split shorter than MIN_KEYS_PER_SPLIT keys, at most MAX_SPLITS.  Shapes only (never the
    actual lengths): the plan must not read device data.
    """
    if ctas <= 0:
        return 1
    if rows >= HEAVY_ROWS:
        # compute-heavy CTAs (``rows`` query rows per kv head): fill every SM heavy_fill times
        if ctas >= heavy_fill * sms:
            return 1
        min_keys = max(MIN_KEYS_PER_SPLIT, HEAVY_KEYS_PER_ROW * rows)
        return max(1, min(heavy_fill * sms // ctas, capacity // min_keys, MAX_SPLITS))
    slots = max(1, ctas_per_sm) * sms
    if paged and ctas < PAGED_FILL * sms:
        # A paged CTA waits on a block-table read before each page's copies, so one CTA per SM
        # leaves bandwidth idle: B8 S8k 32/8 d128 paged16 ran 61.8% of copy unsplit (64 CTAs) vs
        # 83.8% at 4 splits (256 CTAs, two per SM), contiguous 87.5% / 86.1% (H100, 2026-11-25).
        return max(1, min(max(slots, PAGED_FILL * sms) // ctas, capacity // MIN_KEYS_PER_SPLIT, MAX_SPLITS))
    if ctas >= sms:
        return 1
    if cta_bytes_in_flight > 0:
        slots = min(slots, -(-LEAN_GRID_BYTES_IN_FLIGHT // cta_bytes_in_flight))
    return max(1, min(slots // ctas, capacity // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def _old_num_splits(ctas: int, capacity: int, sms: int, paged: bool, rows: int) -> int:
    """The rule before 2026-11-26 (H100-fitted: no split from 0.45 CTA per SM, else one CTA per SM;
    paged grids from 0.45 to 2 CTAs per SM split to two): tools/bench_decode.py's A/B baseline
    (variant split_rule "old")."""
    if rows >= HEAVY_ROWS or ctas <= 0:
        return choose_num_splits(ctas, capacity, sms, paged, rows)
    if paged and 0.45 * sms <= ctas < PAGED_FILL * sms:
        return max(1, min(PAGED_FILL * sms // ctas, capacity // MIN_KEYS_PER_SPLIT, MAX_SPLITS))
    if ctas >= 0.45 * sms:
        return 1
    return max(1, min(sms // ctas, capacity // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def heuristic_configs(arch: str = "sm_90", dtypes=("float16", "bfloat16"), head_dims=None,
                      merges: bool = False) -> list[AttentionDecodeConfig]:
    """Every config the heuristics can pick on ``arch`` (head_dim 8..256 step 8 x dtype x paged x
    causal x rows per kv head 1..128 (keys and rows mode) x kv heads 1..8 for decoding): what
    `rtk report attention_decode` and the slow no-spill test compile.  ``merges``: each also with
    every other ``merges`` value a plan compiles (merges_for; ptxas allocates each build's
    registers anew)."""
    head_dims = head_dims or range(8, 257, 8)
    out = []
    for d in head_dims:
        for dt in dtypes:
            for paged in (False, True):
                for causal in (False, True):
                    for rows_total in (1, 16):
                        for lean in (False, True):   # lean memory: d <= 64's 16-key tiles
                            keys = choose_config(dt, d, rows_total, paged, causal, arch, warp_split="keys",
                                                 lean_memory=lean)
                            out.append(keys)
                            if _two_warp_tile(keys):   # large unsplit grids (_two_warp_ctas)
                                out.append(choose_config(dt, d, rows_total, paged, causal, arch, warp_split="keys",
                                                         num_warps=2, lean_memory=lean))
                            if _lean_pages(keys, lean, None, rows_total) and keys.num_stages < LEAN_PAGED_STAGES:
                                out.append(choose_config(dt, d, rows_total, paged, causal, arch, warp_split="keys",
                                                         num_stages=LEAN_PAGED_STAGES, lean_memory=lean))
                        for nkv in (1, 2, 4, 8):
                            out.append(choose_config(dt, d, rows_total, paged, causal, arch, nheads_kv=nkv,
                                                     warp_split="rows"))
                    for rows_total in (32, 48, 64, 128):
                        cfg = choose_config(dt, d, rows_total, paged, causal, arch)
                        out.append(cfg)
                        # the lean-memory ring depths a plan sets (_lean_wgmma_stages)
                        out += [cfg.replace(num_stages=n) for n in _lean_wgmma_rings(cfg) if n]
    if merges:
        out += [c.replace(merges=m) for c in out if c.schedule == "split"
                for m in ("none", "units", *(f"regs{n}" for n in c.reg_merge_splits))]
    return list(dict.fromkeys(out))


# ---- checks (shapes, dtypes, strides, devices: the host's part, no device data read) ---------
def _bad(field: str, value: Any, message: str) -> ConfigError:
    return ConfigError(f"{OP}: {message}", family=OP, field=field, value=value, allowed=message)


class Problem(NamedTuple):
    """What the checks found: the sizes and element strides the plan is built from."""
    dtype: str
    device: int
    batch: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    paged: bool
    capacity: int
    page_size: int
    num_blocks: int
    seqlen_new: int
    softmax_scale: float
    strides: dict        # name -> element strides (q, k_cache, v_cache, k_new, v_new, out, block_table, cache_seqlens)
    cache_shape: tuple = ()   # k_cache's (and v_cache's) shape


def _int_strides(view, name: str) -> tuple[int, ...]:
    item = view.itemsize
    if any(s % item for s in view.strides):
        raise _bad(name, view.strides, f"{name} has strides {view.strides} bytes, not whole int32 elements")
    return tuple(s // item for s in view.strides)


def check(views: dict, dtype: str | None, softmax_scale, num_splits, arrays: dict | None = None) -> Problem:
    """Check the arrays and options; raise ConfigError naming the argument, its value and what is
    allowed.  ``views``: name -> CuPy view (or anything with shape, strides, dtype, itemsize,
    data.ptr, device.id); ``arrays``: the caller's objects, whose dtypes count (a torch bfloat16
    tensor's view is uint16); default the views."""
    arrays = arrays or views
    q_, kc, vc = views["q"], views["k_cache"], views["v_cache"]
    cs, bt = views.get("cache_seqlens"), views.get("block_table")
    kn, vn, out = views.get("k_new"), views.get("v_new"), views.get("out")
    floats = {n: v for n, v in views.items() if n in ("q", "k_cache", "v_cache", "k_new", "v_new")}
    dts = {n: _dtype_of(arrays[n], n, dtype, OP) for n in floats}
    if len(set(dts.values())) != 1:
        raise _bad("dtype", dts, ", ".join(dts) + " must have the same dtype, got "
                   + ", ".join(f"{n}={d}" for n, d in dts.items()))
    dt = dts["q"]
    for name, view in floats.items():
        if view.ndim != 4:
            raise _bad(name, tuple(view.shape), f"{name} must be 4-D, got shape {tuple(view.shape)}")
    batch, seqlen_q, nheads, head_dim = q_.shape
    if tuple(vc.shape) != tuple(kc.shape):
        raise _bad("v_cache", tuple(vc.shape), f"v_cache must have k_cache's shape {tuple(kc.shape)}, got "
                                               f"{tuple(vc.shape)}")
    nblk, page_or_seq, nheads_kv, kd = kc.shape
    if kd != head_dim:
        raise _bad("k_cache", tuple(kc.shape), f"k_cache's head_dim (last dim) {kd} must equal q's {head_dim}")
    if head_dim % 8 or not 8 <= head_dim <= 256:
        raise ConfigError.bad_value(OP, "head_dim", head_dim, "a multiple of 8 in [8, 256] (q.shape[-1])")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise _bad("k_cache", tuple(kc.shape), f"nheads={nheads} (q.shape[2]) must be a multiple of nheads_kv="
                                               f"{nheads_kv} (k_cache.shape[2])")
    # cache_seqlens: int32 (batch,), or None (every cache full; the kernels read no lengths)
    if cs is not None and (dtype_name(cs) != "int32" or cs.ndim != 1 or cs.shape[0] != batch):
        raise _bad("cache_seqlens", (dtype_name(cs), tuple(cs.shape)),
                   f"cache_seqlens must be an int32 array of shape (batch,) = ({batch},) or None, got "
                   f"{dtype_name(cs)} {tuple(cs.shape)}")
    if cs is None and kn is not None:
        raise _bad("cache_seqlens", None, "k_new / v_new are appended at cache_seqlens: pass cache_seqlens with "
                                          "them (None means every cache is already full)")
    strides = {"cache_seqlens": (0,) if cs is None else _int_strides(cs, "cache_seqlens")}
    paged = bt is not None
    if paged:
        if dtype_name(bt) != "int32" or bt.ndim != 2 or bt.shape[0] != batch or bt.shape[1] < 1:
            raise _bad("block_table", (dtype_name(bt), tuple(bt.shape)),
                       f"block_table must be an int32 array of shape (batch, max_blocks_per_seq) = ({batch}, >= 1), "
                       f"got {dtype_name(bt)} {tuple(bt.shape)}")
        strides["block_table"] = _int_strides(bt, "block_table")
        if bt.shape[1] > 1 and strides["block_table"][1] != 1:
            raise _bad("block_table", strides["block_table"], "block_table's rows must be contiguous (stride 1 in "
                                                              f"the last dim), got strides {strides['block_table']}")
        page_size, num_blocks = page_or_seq, nblk
        if page_size % 16 or page_size == 0:
            raise _bad("k_cache", tuple(kc.shape), f"a paged cache's page_size (k_cache.shape[1]) must be a positive "
                                                   f"multiple of 16, got {page_size}")
        if num_blocks == 0:
            raise _bad("k_cache", tuple(kc.shape), "a paged cache needs at least one page (k_cache.shape[0] >= 1)")
        capacity = bt.shape[1] * page_size
    else:
        page_size, num_blocks = 0, 0
        if nblk < batch:
            raise _bad("k_cache", tuple(kc.shape), f"k_cache must hold a row per sequence: shape[0] = {nblk} < batch "
                                                   f"= {batch} (q.shape[0]); for a paged cache pass block_table")
        capacity = page_or_seq
    if capacity >= 2 ** 31 - 2 ** 16:
        raise _bad("k_cache", tuple(kc.shape), f"the cache's capacity {capacity} keys per sequence must stay below 2^31")
    seqlen_new = 0
    if (kn is None) != (vn is None):
        raise _bad("k_new" if kn is None else "v_new", None, "k_new and v_new must be given together")
    if kn is not None:
        want = (batch, kn.shape[1], nheads_kv, head_dim)
        for name, view in (("k_new", kn), ("v_new", vn)):
            if tuple(view.shape) != want:
                raise _bad(name, tuple(view.shape), f"{name} must be (batch, seqlen_new, nheads_kv, head_dim) = "
                                                    f"{want}, got {tuple(view.shape)}")
        seqlen_new = kn.shape[1]
        if seqlen_new > capacity:
            raise _bad("k_new", tuple(kn.shape), f"seqlen_new = {seqlen_new} (k_new.shape[1]) exceeds the cache's "
                                                 f"capacity of {capacity} keys per sequence")
    if out is not None:
        odt = dtype_name(arrays["out"])
        odt = "bfloat16" if (dt == "bfloat16" and odt == "uint16") else odt
        if tuple(out.shape) != tuple(q_.shape) or odt != dt:
            raise _bad("out", (odt, tuple(out.shape)), f"out must be a {dt} array of q's shape {tuple(q_.shape)}, got "
                                                       f"{odt} {tuple(out.shape)}")
    devs = {n: _device_of(v) for n, v in views.items() if v is not None}
    if len(set(devs.values())) != 1:
        raise _bad("device", devs, "all arrays must be on the same device, got "
                   + ", ".join(f"{n} on {d}" for n, d in devs.items()))
    empty = batch == 0 or nheads == 0
    for name in ("q", "k_cache", "v_cache", "k_new", "v_new", "out"):
        view = views.get(name)
        if view is not None and not (empty or view.size == 0):
            strides[name] = _elem_strides(view, name, OP)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise _bad("softmax_scale", softmax_scale, f"softmax_scale must be a positive finite float, got "
                                                   f"{softmax_scale!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer))
                                   or not 0 <= num_splits <= MAX_SPLITS):
        raise _bad("num_splits", num_splits, f"num_splits must be None or 0 (heuristic) or an int in [1, {MAX_SPLITS}], "
                                             f"got {num_splits!r}")
    return Problem(dt, devs["q"], batch, seqlen_q, nheads, nheads_kv, head_dim, paged, capacity, page_size, num_blocks,
                   seqlen_new, float(softmax_scale), strides, tuple(int(n) for n in kc.shape))


# ---- plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What one call signature launches: the launches (append, combine may be None; split None
    when there is no query row) with their by-value DecodeArgs, the outputs' shapes and dtypes (in
    the library the outputs are made with) and the workspace the splits need."""
    split: Launch | None
    combine: Launch | None
    append: Launch | None
    config: AttentionDecodeConfig | None
    num_splits: int
    fused: bool           # the last CTA of a group merges the splits (else the combine launch)
    out_shape: tuple
    out_dtype: object
    lse_shape: tuple | None
    f32: object
    part_bytes: int       # workspace: o_part (float32) then lse_part (float32); 0 without splits
    lse_part_offset: int  # bytes from the workspace start to lse_part
    counter_bytes: int    # int32 counters of the fused merge (zero between launches)
    torch: bool
    device: int
    tma: tuple | None = None   # loader "tma": the caches' (dtype, shape, strides, box, l2 promotion) for tensor maps
    # (k_cache, v_cache addresses) -> their tensor maps: a serving loop passes each layer's caches at
    # the same addresses every step, and two lookups in rtkernels.tma's memo (a key of eight fields
    # each) were the largest piece of a replay's Python (host_model.py, development CPU, 2026-11-27)
    maps: dict = field(default_factory=dict, compare=False, repr=False)


def _args(p: Problem, cfg: AttentionDecodeConfig | None, num_splits: int, row_tiles: int, order: int = 1,
          fused: int = 0) -> np.void:
    """The by-value DecodeArgs for these sizes and strides."""
    a = np.zeros((), ARGS_DTYPE)
    h, d = p.nheads, p.head_dim
    new_out = (p.seqlen_q * h * d, h * d, d, 1)   # the contiguous o the op allocates when out is None
    for name, key in (("q", "q"), ("k", "k_cache"), ("v", "v_cache"), ("o", "out"), ("kn", "k_new"), ("vn", "v_new")):
        st = p.strides.get(key, new_out if key == "out" else None)
        if st is not None:
            a[f"{name}_batch"], a[f"{name}_seq"], a[f"{name}_head"] = st[:3]
    if p.paged:
        a["bt_batch"] = p.strides["block_table"][0]
    a["cs_stride"] = p.strides["cache_seqlens"][0]
    a["batch"], a["seqlen_q"], a["nheads_kv"], a["group"] = p.batch, p.seqlen_q, p.nheads_kv, p.nheads // p.nheads_kv
    a["seqlen_new"], a["capacity"], a["num_splits"], a["row_tiles"] = p.seqlen_new, p.capacity, num_splits, row_tiles
    a["page_size"], a["num_blocks"], a["order"], a["fused"] = p.page_size, p.num_blocks, order, int(fused)
    if p.paged:
        a["page_magic"], a["page_shift"] = page_divisor(p.page_size)
    a["softmax_scale"], a["scale_log2"] = p.softmax_scale, p.softmax_scale * math.log2(math.e)
    return a[()]


def page_divisor(page_size: int) -> tuple[int, int]:
    """(magic, shift) with key // page_size == (umulhi(key, magic) + key) >> shift for every
    0 <= key < 2^31 (Granlund-Montgomery with a 33-bit multiplier whose top bit is the ``+ key``;
    no overflow since key + umulhi(key, magic) <= 2 key < 2^32): the kernels divide keys by the
    runtime page size without a division instruction sequence."""
    shift = (page_size - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - page_size)) // page_size + 1, shift


# CTA order: kv-head groups fastest (1) puts the CTAs of one (sequence, split) - which read the
# same keys' rows, one kv head each - next to each other in launch order, so they run at the
# same time and their reads of one key's contiguous nheads_kv x head_dim run meet in DRAM and
# L2 (issue #15's locality hypothesis; splits fastest (0) was the first version's order).
# Reasoned; tools/bench_decode.py --variants times both.
ORDER = {"splits": 0, "heads": 1}
DEFAULT_ORDER = "heads"

# Tuning hook for tools/bench_decode.py --variants: config fields (warp_split, kv_heads, block_n,
# num_stages, num_warps, schedule, loader, l2_prefetch), order ("splits"/"heads"), combine ("fused"/"kernel"), merge
# ("serial": the fused merge of session 10, a few dependent L2 round trips per row, as a baseline; "units": the
# unit merge where the rows mode would merge from registers), num_splits
# and split_rule ("decode": choose_num_splits without its HEAVY_ROWS rule; "old": the rule before
# 2026-11-26, no split from 0.45 CTA per SM; "fill2": small grids split to the kernel's occupancy, not one CTA
# per SM; "contig": paged caches split as contiguous ones, without PAGED_FILL - H200 2026-11-26: B1 S32k
# paged16 ran 33 splits + the combine launch, 70.5% of copy, where contiguous ran 16 fused, 78.8%; at 32
# forced splits the two were 71.9 / 75.5 - the default for TMA-read pages on lean memory or of LONG_PAGE
# keys since, and for the keys mode's TMA-read pages on any memory since 2026-11-27; "paged": PAGED_FILL for every paged cache, the rule before; "fill": on lean memory too, small
# keys-mode grids split to one CTA per SM, the rule before LEAN_GRID_BYTES_IN_FLIGHT; "two": heavy grids at most two CTAs
# per SM, the rule before COMPUTE_FILL_DEEP_SMALL_HEAD; "one": lean memory's heavy grids one CTA per SM
# above d64 at every size and 4 stages, the rules before COMPUTE_FILL_LEAN_WGMMA_HEAD_DIM), memory ("lean" / "deep": the
# rule set of LEAN_MEMORY_GBS_PER_SM whatever the device) overriding the
# heuristics; part of every plan's key.  None in normal use.
_VARIANT: dict | None = None
# DecodeArgs.fused of a fused merge by the variant's "merge" (None: 1, the default merge)
MERGE_CODES = {None: 1, "serial": 2, "units": 3, "group": 4, "cluster": 5}
_VARIANT_KEY: tuple | None = None


def set_variant(variant: dict | None) -> None:
    """Override the heuristics for later calls (a tuning aid for benchmarks, not an API):
    ``{"warp_split": "rows", "kv_heads": 8, "order": "splits", "combine": "kernel", ...}``."""
    global _VARIANT, _VARIANT_KEY
    _VARIANT = dict(variant) if variant else None
    _VARIANT_KEY = tuple(sorted(_VARIANT.items())) if _VARIANT else None


def _lean_pages(cfg: AttentionDecodeConfig, lean: bool, rule: str | None, head_rows: int) -> bool:
    """A paged cache on lean memory that LEAN_PAGED_UNSPLIT_CTAS_PER_SM / LEAN_PAGED_STAGES take
    (keys mode, TMA, 64 < head_dim <= 128, fewer than HEAVY_ROWS rows per kv head: where they were
    measured); the bench's split rules "fill" (the rule before) and "paged" / "contig" turn it off."""
    return (lean and cfg.paged and cfg.warp_split == "keys" and cfg.loader == "tma" and head_rows < HEAVY_ROWS
            and LEAN_PAGED_HEAD_DIMS[0] < cfg.head_dim <= LEAN_PAGED_HEAD_DIMS[1]
            and rule not in ("fill", "fill2", "paged", "contig"))


def _lean_wgmma_rings(cfg: AttentionDecodeConfig) -> tuple[int | None, int | None]:
    """(shallow, deep): the ring depths a lean-memory plan may give this config (one warpgroup per
    CTA, where they were measured): LEAN_WGMMA_SHALLOW_STAGES for its heavy two-per-SM grids in
    LEAN_WGMMA_SHALLOW_HEAD_DIMS (contiguous or paged caches), LEAN_WGMMA_DEEP_STAGES for a
    contiguous cache's grids of at most one CTA per SM from the same low head dim (d96); None where
    neither applies.  heuristic_configs lists both."""
    if cfg.mma != "wgmma" or cfg.num_warps != 4:
        return None, None
    lo, hi = LEAN_WGMMA_SHALLOW_HEAD_DIMS
    return (LEAN_WGMMA_SHALLOW_STAGES if lo <= cfg.head_dim < hi else None,
            LEAN_WGMMA_DEEP_STAGES if cfg.head_dim >= lo and not cfg.paged else None)


def _lean_wgmma_stages(cfg: AttentionDecodeConfig, head_rows: int, grid: int, sms: int) -> int | None:
    """The ring depth of a wgmma rows grid of ``grid`` CTAs on lean memory (the caller checks the
    memory; see _lean_wgmma_rings); None: the config's own."""
    shallow, deep = _lean_wgmma_rings(cfg)
    if shallow and head_rows >= HEAVY_ROWS and grid >= LEAN_WGMMA_SHALLOW_CTAS_PER_SM * sms:
        return shallow
    return deep if deep and grid <= sms else None


def _heuristic_splits(p: Problem, cfg: AttentionDecodeConfig, ctas: int, head_rows: int, lean: bool,
                      rule: str | None, arch: str, sms: int) -> int:
    """The split count of a plan that gives none: choose_num_splits with what the config, the cache
    and the memory ask of it; ``rule``: the bench variant's split_rule (None in normal use)."""
    split_rows = 1 if rule == "decode" else head_rows   # "decode": the rule before HEAVY_ROWS
    if rule == "old":
        return _old_num_splits(ctas, p.capacity, sms, p.paged, split_rows)
    if _lean_pages(cfg, lean, rule, head_rows) and ctas >= LEAN_PAGED_UNSPLIT_CTAS_PER_SM * sms:
        return 1
    per_sm = 1
    if rule == "fill2":
        from ..kernel import get_kernel
        per_sm = _ctas_per_sm(cfg, get_kernel(cfg, "attention_decode", arch=arch), arch)
    # PAGED_FILL for paged caches (choose_num_splits), except TMA-read ones in keys mode (its page ids
    # a batch ahead), on lean memory or with pages of at least LONG_PAGE keys; the bench's "paged":
    # for every paged cache, "contig": for none
    pages_as_contig = (cfg.loader == "tma" and (cfg.warp_split == "keys" or lean or p.page_size >= LONG_PAGE)
                       and rule != "paged")
    paged_rule = p.paged and rule != "contig" and not pages_as_contig
    # lean memory, keys mode, TMA, contiguous, d <= 128 (where it was measured): split to
    # LEAN_GRID_BYTES_IN_FLIGHT (the bench's "fill": to every SM, as elsewhere)
    by_bytes = (lean and cfg.warp_split == "keys" and cfg.loader == "tma" and not p.paged
                and rule not in ("fill", "fill2") and p.head_dim <= LEAN_IN_FLIGHT_HEAD_DIM_MAX)
    # (the keys mode's TMA pages above d64: one CTA per SM on any memory, see COMPUTE_FILL - heavy
    # rows reach the keys mode only up to d128, where 32 rows x head_dim fit its 4096; d64 and the
    # bench's split_rule "paged", the rule before, keep two)
    keys_pages = (p.paged and cfg.warp_split == "keys" and cfg.loader == "tma" and p.head_dim > 64
                  and rule != "paged")
    heavy_fill = COMPUTE_FILL if keys_pages else compute_fill(
        p.head_dim, p.paged, lean, cfg.mma == "wgmma" and cfg.warp_split == "rows" and rule != "two",
        ctas >= LEAN_WGMMA_UNSPLIT_CTAS_PER_SM * sms or rule == "one")
    if heavy_fill > COMPUTE_FILL_SMALL_HEAD and head_rows >= HEAVY_ROWS:
        # no more CTAs per SM than stay resident (a second wave, and no group merge, past that); the
        # kernel without a merge is compiled for its registers even where the plan then launches the
        # group merge's (one more compile at a signature's first call, cached on disk)
        from ..kernel import get_kernel
        heavy_fill = min(heavy_fill, max(COMPUTE_FILL_SMALL_HEAD,
                                         _ctas_per_sm(cfg, get_kernel(cfg, "attention_decode", arch=arch), arch)))
    return choose_num_splits(ctas, p.capacity, sms, paged_rule, split_rows, per_sm,
                             heavy_fill, cfg.bytes_in_flight if by_bytes else 0)


def make_plan(p: Problem, *, causal: bool, return_lse: bool, num_splits, torch: bool, out_dtype, f32,
              arch: str, sms: int, variant: dict | None = None, gbs_per_sm: float | None = None) -> Plan:
    """Config, kernels, splits, grid and arguments for a checked problem; ``gbs_per_sm``: the
    device's DRAM bandwidth per SM (None: unknown; see LEAN_MEMORY_GBS_PER_SM)."""
    from ..kernel import get_kernel
    v = variant or {}
    memory = v.get("memory")   # bench variant: "lean" / "deep" force either rule set
    lean = memory == "lean" or (memory != "deep" and lean_memory(gbs_per_sm))
    group = p.nheads // p.nheads_kv
    causal = bool(causal) and p.seqlen_q > 1   # one query row sees every key either way
    out_shape = (p.batch, p.seqlen_q, p.nheads, p.head_dim)
    lse_shape = (p.batch, p.nheads, p.seqlen_q) if return_lse else None
    empty = p.batch == 0 or p.nheads == 0
    if empty or (p.seqlen_q == 0 and p.seqlen_new == 0):
        return Plan(None, None, None, None, 1, False, out_shape, out_dtype, lse_shape, f32, 0, 0, 0, torch, p.device)
    rows_total = p.seqlen_q * group
    fields = {f: v[f] for f in ("warp_split", "kv_heads", "block_n", "num_stages", "num_warps", "schedule", "loader",
                                "l2_prefetch", "mma", "lazy_rescale", "l2_evict_first") if f in v}
    map_strides = tuple(tma_strides(p.cache_shape, p.strides[n]) if n in p.strides else None
                        for n in ("k_cache", "v_cache"))
    if None in map_strides:
        # an empty cache (a zero dimension), a broadcast or reversed one: no tensor map can
        # describe it, so this call streams it with cp.async (whatever the default or a variant asks)
        fields["loader"] = "cp.async"
        fields["mma"] = "sync"   # wgmma reads the TMA stages
    cfg = choose_config(p.dtype, p.head_dim, max(rows_total, 1), p.paged, causal, arch, nheads_kv=p.nheads_kv,
                        lean_memory=lean, **fields)
    if cfg.schedule == "streamk" and rows_total > cfg.rows:   # stream-K takes one row tile per item
        fields["schedule"] = "split"
        cfg = choose_config(p.dtype, p.head_dim, max(rows_total, 1), p.paged, causal, arch, nheads_kv=p.nheads_kv,
                            lean_memory=lean, **fields)
    head_groups = p.nheads_kv // cfg.kv_heads
    row_tiles = max(1, -(-rows_total // cfg.rows))
    ctas = row_tiles * p.batch * head_groups
    if _two_warp_ctas(cfg, fields, ctas, sms, num_splits or v.get("num_splits")):
        cfg = choose_config(p.dtype, p.head_dim, max(rows_total, 1), p.paged, causal, arch, nheads_kv=p.nheads_kv,
                            lean_memory=lean, **fields, num_warps=2)
    head_rows = min(cfg.rows, max(rows_total, 1))   # query rows per kv head of a CTA: its FLOPs per K/V byte
    cta_rows = cfg.kv_heads * head_rows
    if cfg.schedule == "streamk":
        return _streamk_plan(p, cfg, arch, sms, out_shape, out_dtype, lse_shape, f32, torch, map_strides)
    kernel = None   # the split kernel, compiled once the merge is chosen (the group merge's is its own)
    if not (num_splits or v.get("num_splits")):
        num_splits = _heuristic_splits(p, cfg, ctas, head_rows, lean, v.get("split_rule"), arch, sms)
    num_splits = int(num_splits or v.get("num_splits"))
    if (num_splits == 1 and ctas <= sms and _lean_pages(cfg, lean, v.get("split_rule"), head_rows)
            and "num_stages" not in fields and cfg.num_stages < LEAN_PAGED_STAGES):
        # an unsplit paged grid of at most one CTA per SM on lean memory: a deeper ring (see
        # LEAN_PAGED_STAGES); the tile heuristics fall back if its stages do not fit
        cfg = choose_config(p.dtype, p.head_dim, max(rows_total, 1), p.paged, causal, arch, nheads_kv=p.nheads_kv,
                            lean_memory=lean, **fields, num_stages=LEAN_PAGED_STAGES)
    stages = _lean_wgmma_stages(cfg, head_rows, ctas * num_splits, sms) if lean else None
    if stages and "num_stages" not in fields and v.get("split_rule") != "one":
        # see LEAN_WGMMA_SHALLOW_HEAD_DIMS / LEAN_WGMMA_DEEP_STAGES (a ring's depth changes no split)
        cfg = cfg.replace(num_stages=stages)
    if ctas * num_splits > _GRID_X_MAX:
        raise _bad("q", out_shape, f"batch x nheads_kv x seqlen_q x group = {ctas} CTAs x {num_splits} splits "
                                   f"exceeds a grid's {_GRID_X_MAX}")
    rows_all = p.batch * p.seqlen_q * p.nheads
    fused = False
    merge = v.get("merge")
    cluster = _cluster_merge(v, cfg, num_splits, ctas, row_tiles, arch, sms) if rows_total > 0 else None
    split_smem = None   # dynamic shared memory of the split launch: the config's, or the cluster merge's ask
    if cluster is not None:
        (cfg, kernel, split_smem), fused, merge = cluster, True, "cluster"
    elif num_splits > 1:
        # the register merge (rows mode, few splits) needs no shared memory; the unit merge its
        # weights (rounded to 16 bytes) and its split groups' float4 sums (<= one per thread)
        in_regs = cfg.warp_split == "rows" and num_splits <= REG_MERGE_MAX_SPLITS and merge is None
        fits = in_regs or 16 + 16 * -(-cta_rows * num_splits // 4) + 16 * cfg.threads_per_block <= cfg.shared_mem_bytes
        want = v.get("combine")
        fused_max = FUSED_COMBINE_MAX_BYTES_ROWS if cfg.warp_split == "rows" else FUSED_COMBINE_MAX_BYTES
        fused = fits and (want == "fused" or (want is None and (
            in_regs or num_splits * cta_rows * p.head_dim * 4 <= fused_max)))
        group = _group_merge(want, merge, cfg, p, num_splits, ctas, arch, sms, combine_launch=not fused) \
            if rows_total > 0 else None
        if group is not None:
            cfg, kernel = group
            fused, merge = True, "group"
        elif fused:
            cfg = _keys_merge(cfg, p, num_splits, merge)
    if kernel is None and rows_total > 0:
        cfg = cfg.replace(merges=merges_for(cfg, num_splits, fused, merge))
        kernel = get_kernel(cfg, "attention_decode", arch=arch)
    order = 0 if merge == "cluster" else ORDER[v.get("order", DEFAULT_ORDER)]   # a cluster: one group's splits
    # a.fused: 0 none / the combine launch, 1 the merge (from registers in the rows mode's few-split
    # case), 2 the first (serial) merge (variant merge:serial), 3 the unit merge (variant merge:units),
    # 4 the group merge (every CTA of a group merges a share; a cooperative launch), 5 the cluster
    # merge (the same through a cluster's distributed shared memory)
    args = _args(p, cfg, num_splits, row_tiles, order, MERGE_CODES.get(merge, 1) if fused else 0)
    split = combine = None
    append = _append_launch(p, cfg, args, arch)
    part_bytes = lse_off = counter_bytes = 0
    if rows_total > 0:
        split = Launch(kernel, (ctas * num_splits,), (cfg.threads_per_block,), split_smem or cfg.shared_mem_bytes, (args,),
                       cooperative=merge == "group")
        if num_splits > 1 and merge != "cluster":   # (the cluster merge keeps its partials on chip)
            lse_off = 4 * num_splits * rows_all * p.head_dim
            part_bytes = lse_off + 4 * num_splits * rows_all
            if fused:
                counter_bytes = (8 if merge == "group" else 4) * ctas   # group: [in, out] per group
            else:
                combine = Launch(get_kernel(cfg, "attention_decode_combine", arch=arch), (rows_all,),
                                 (COMBINE_THREADS,), 0, (args,))
    return Plan(split, combine, append, cfg, num_splits, fused, out_shape, out_dtype, lse_shape, f32, part_bytes,
                lse_off, counter_bytes, torch, p.device, _tma_spec(p, cfg, map_strides))


def _tma_spec(p: Problem, cfg: AttentionDecodeConfig, map_strides: tuple) -> tuple | None:
    """loader "tma": what the per-call tensor maps of k_cache and v_cache are built from (they
    depend on the caches' addresses, so :func:`_execute` encodes them - memoized by address and
    shape in rtkernels.tma, host work only, capturable): 4-D maps over the caches as they are,
    with their element strides (:func:`tma_strides`), dims ordered (batch or num_blocks, nheads_kv,
    seq or page_size, head_dim) whatever the strides - keys inside heads, so a box of several kv
    heads lands as one block of key rows per head - and a box of kv_heads heads x block_n keys
    (paged: 16 keys, one page's group) x 64 columns; columns past head_dim (head dims not a
    multiple of 64) are the map's out-of-bounds, which the copy fills with zeros.  ``map_strides``:
    (k_cache's, v_cache's) from :func:`tma_strides`."""
    if cfg.loader != "tma":
        return None
    order = (0, 2, 1, 3)
    shape = tuple(p.cache_shape[i] for i in order)
    k_strides, v_strides = map_strides
    box = (1, cfg.kv_heads, 16 if p.paged else cfg.block_n, 64)
    return (p.dtype, shape, tuple(k_strides[i] for i in order), tuple(v_strides[i] for i in order), box,
            cfg.l2_prefetch)


def tma_strides(shape: tuple, strides: tuple, itemsize: int = 2) -> tuple | None:
    """Element strides a tensor map of a cache of this shape and these strides can be encoded
    with, or None where no tensor map can describe it (the call then uses cp.async).

    A size-1 dimension's stride is never used to address anything (check() records it as 0, and
    torch leaves it arbitrary), but the driver wants every stride positive and a multiple of 16
    bytes: such a dimension gets the array's span rounded up to 16 bytes, as if the next entry
    followed the array.  None for a dimension of several entries with stride 0 (a broadcast
    cache, e.g. torch's expand), a negative stride (a reversed view), a stride that is not a
    whole number of 16 bytes or >= 2**40 bytes, or a dimension over 2**32 entries - the mma.sync
    path reads all of those exactly with its own address arithmetic."""
    if len(shape) != len(strides) or not shape or 0 in shape:
        return None
    if shape[-1] > 1 and strides[-1] != 1:
        return None
    chunk = max(1, 16 // itemsize)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides) if n > 1 and s > 0)
    fill = -(-span // chunk) * chunk
    out = []
    for n, s in zip(shape[:-1], strides[:-1]):
        if n > 2 ** 32:
            return None
        if n == 1:
            s = fill
        elif s <= 0 or s % chunk or s * itemsize >= 2 ** 40:
            return None
        out.append(int(s))
    return (*out, 1)


def _tensor_maps(spec: tuple, k_addr: int, v_addr: int):
    from ..tma import tensor_map
    dtype, shape, k_strides, v_strides, box, l2 = spec
    return (tensor_map(k_addr, dtype, shape, k_strides, box, swizzle=128, l2_promotion=l2),
            tensor_map(v_addr, dtype, shape, v_strides, box, swizzle=128, l2_promotion=l2))


# Address pairs one plan keeps maps for.  The layers of a model share one plan (their caches have
# the same shapes), so a serving loop needs one pair per layer: 64 covers models of up to 64
# layers; past that (or for caches that move every call) a miss asks rtkernels.tma's memo, as
# before the per-plan memo.  More than _arrays' default for the ops' activations, which rarely
# keep their addresses.
PLAN_MAPS_MAX = 64


def _plan_maps(plan: Plan, k_addr: int, v_addr: int) -> tuple:
    """The K and V tensor maps of a replay (memoized per plan and address pair; the plan's shape,
    strides and box are fixed, so the addresses decide the maps)."""
    maps = plan.maps.get((k_addr, v_addr))
    if maps is None:
        maps = remember(plan.maps, (k_addr, v_addr), _tensor_maps(plan.tma, k_addr, v_addr), PLAN_MAPS_MAX)
    return maps


def _append_launch(p: Problem, cfg: AttentionDecodeConfig, args, arch: str) -> Launch | None:
    """The k_new / v_new append into the cache (one thread per 16-byte chunk), or None without them."""
    if p.seqlen_new <= 0:
        return None
    from ..kernel import get_kernel
    n = p.batch * p.seqlen_new * p.nheads_kv * (p.head_dim // 8)
    return Launch(get_kernel(cfg, "attention_decode_append", arch=arch), (-(-n // APPEND_THREADS),),
                  (APPEND_THREADS,), 0, (args,))


def _ctas_per_sm(cfg: AttentionDecodeConfig, kernel, arch: str) -> int:
    """CTAs of this kernel resident per SM (registers, shared memory, threads); 1 without a kernel."""
    if kernel is None:
        return 1
    from ..arch import occupancy
    occ = occupancy(arch, cfg.threads_per_block, kernel.resources.registers, 0, cfg.shared_mem_bytes)
    return max(1, occ.blocks_per_sm)


def _streamk_plan(p: Problem, cfg: AttentionDecodeConfig, arch: str, sms: int, out_shape, out_dtype, lse_shape, f32,
                  torch: bool, map_strides: tuple) -> Plan:
    """schedule="streamk": as many CTAs as fit on the SMs at once (the kernel's occupancy), never more
    than the work units (key tiles of all items at full capacity); partials: two slots of rows x
    head_dim float32 (and rows lse) per CTA; a merge counter per (sequence, kv head)."""
    from ..kernel import get_kernel
    cfg = cfg.replace(merges="none")   # (its items merge themselves)
    kernel = get_kernel(cfg, "attention_decode", arch=arch)
    per_sm = _ctas_per_sm(cfg, kernel, arch)
    units = p.batch * p.nheads_kv * max(1, -(-p.capacity // cfg.block_n))
    grid = max(1, min(per_sm * sms, units))
    args = _args(p, cfg, 1, 1)
    append = _append_launch(p, cfg, args, arch)
    split = None
    if p.seqlen_q > 0:
        split = Launch(kernel, (grid,), (cfg.threads_per_block,), cfg.shared_mem_bytes, (args,))
    lse_off = 4 * grid * 2 * cfg.rows * p.head_dim
    return Plan(split, None, append, cfg, 1, False, out_shape, out_dtype, lse_shape, f32,
                lse_off + 4 * grid * 2 * cfg.rows, lse_off, 4 * p.batch * p.nheads_kv, torch, p.device,
                _tma_spec(p, cfg, map_strides))


# ---- workspace (split-KV partials, fused-merge counters) per (device, stream): ops/workspace.py ----
def _workspace(plan: Plan, like, stream) -> tuple[int, int]:
    """(partials address, counters address) for a launch on ``stream`` (see ops/workspace.py)."""
    parts, counters = stream_workspace(like, plan.device, stream, plan.part_bytes, plan.counter_bytes)
    return (address(parts) if parts is not None else 0), (address(counters) if counters is not None else 0)


def _execute(plan: Plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out, stream):
    """Allocate the outputs, pack the arrays' addresses and run the plan's launches on
    ``stream``.  The arrays are the caller's torch tensors (plan.torch) or CuPy arrays."""
    o = out if out is not None else empty_as(q, plan.out_shape, plan.out_dtype)
    lse = empty_as(q, plan.lse_shape, plan.f32) if plan.lse_shape is not None else None
    stream = default_stream(q, stream)
    if plan.split is None and plan.append is None:
        return (o, lse) if plan.lse_shape is not None else o
    # The addresses travel in one by-value struct: a CuPy MemoryPointer per torch tensor cost
    # 2-10 us of host time each, a DevicePtr argument per array ~0.6 us; a data_ptr() well
    # under one.  The arrays stay owned by the caller (and o, lse by this frame) and live on the
    # stream the kernels run on.
    if plan.torch:
        addr = [0 if x is None else x.data_ptr() for x in (q, k_cache, v_cache, o, lse)]
        tail = [0 if x is None else x.data_ptr() for x in (cache_seqlens, block_table, k_new, v_new)]
    else:
        addr = [0 if x is None else x.data.ptr for x in (q, k_cache, v_cache, o, lse)]
        tail = [0 if x is None else x.data.ptr for x in (cache_seqlens, block_table, k_new, v_new)]
    parts = counters = lse_part = 0
    if plan.part_bytes:
        parts, counters = _workspace(plan, q, stream)
        lse_part = parts + plan.lse_part_offset
    ptrs = np.frombuffer(_PACK_PTRS(*addr, parts, lse_part, counters, *tail), PTRS_DTYPE)[0]
    if plan.append is not None:
        plan.append.run((ptrs,), stream)
    if plan.split is not None:
        head = (ptrs, *_plan_maps(plan, addr[1], addr[2])) if plan.tma is not None else (ptrs,)
        if plan.split.cooperative:
            try:
                plan.split.run(head, stream)
            except LaunchError as exc:   # (the append, if any, ran: planning again rewrites the same rows)
                raise _GroupRefused(str(exc)) from exc
        else:
            plan.split.run(head, stream)
    if plan.combine is not None:
        plan.combine.run((ptrs,), stream)
    return (o, lse) if plan.lse_shape is not None else o


# check_inputs' views, stride checks, config choice and argument packing cost far more host time
# than a decoding step's kernels; they depend only on each array's dtype, shape, strides, 16-byte
# alignment and device plus the options, so the first call with a signature records its plan.
_PLANS = LaunchPlans(1024)
_SMS: dict = {}


def _sm_count(dev: int) -> int:
    n = _SMS.get(dev)
    if n is None:
        from .. import device
        n = _SMS[dev] = device.sm_count(dev)
    return n


def _gbs_per_sm(dev: int) -> float | None:
    """The device's peak DRAM bandwidth per SM (GB/s), None where the driver does not report it."""
    from .. import device
    gbs = device.dram_gbs(dev)
    return gbs / _sm_count(dev) if gbs else None


def attention_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None,
                      causal: bool = True, softmax_scale: float | None = None, return_lse: bool = False,
                      num_splits: int | None = None, out=None, dtype: str | None = None, validate: bool = False,
                      stream=None):
    """Attention of new query rows against a KV cache (FlashAttention's ``flash_attn_with_kvcache``).

    Parameters
    ----------
    q : (batch, seqlen_q, nheads, head_dim) device array; seqlen_q from 1 (decoding) to a few
        hundred (speculative verification, chunked prefill).  float16 or bfloat16; head_dim a
        multiple of 8 up to 256.  CuPy arrays (bfloat16 as uint16 bits with ``dtype="bfloat16"``),
        torch CUDA tensors, or any ``__cuda_array_interface__`` / DLPack array.  Strides are free
        except: last dimension contiguous, the others multiples of 8 elements, 16-byte aligned
        start (slices of a packed qkv array qualify).
    k_cache, v_cache : the cache, same dtype as q.  Contiguous: (batch_cache, seqlen_cache,
        nheads_kv, head_dim) with batch_cache >= batch (sequence b uses entry b).  Paged:
        (num_blocks, page_size, nheads_kv, head_dim) with page_size a multiple of 16, plus
        ``block_table``.  nheads % nheads_kv == 0 (GQA / MQA: one CTA serves all query heads of
        a kv head, so each cache byte is read once).
    cache_seqlens : int32 (batch,): the number of keys already in each sequence's cache (ragged
        batches are the normal case).  Not modified, also not when k_new is appended.  None: every
        sequence's cache is full (seqlen_cache keys, or max_blocks_per_seq x page_size when paged;
        not with k_new) - how :func:`rtkernels.attention` runs dense calls with few query rows.
    k_new, v_new : optional (batch, seqlen_new, nheads_kv, head_dim): written into the cache at
        positions cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1 (through the block
        table when paged; in place) before the attention, which then sees
        cache_seqlens[b] + seqlen_new keys.
    block_table : int32 (batch, max_blocks_per_seq): page ids of each sequence's cache, in order;
        capacity = max_blocks_per_seq x page_size.  Entries past a sequence's length are never read.
    causal : mask aligned bottom-right per sequence: query i sees key j iff
        ``j <= i + seqlen_k - seqlen_q`` (seqlen_k = cache_seqlens[b] + seqlen_new).  A query
        row that sees no key (e.g. an empty cache) gets o = 0 and lse = -inf.
    softmax_scale : positive finite float; default ``1 / sqrt(head_dim)``.
    return_lse : also return the log-sum-exp (natural log), float32 (batch, nheads, seqlen_q).
    num_splits : None or 0: the heuristic (:func:`choose_num_splits`); else the number of parts
        (1..128) each sequence's keys are cut into; more than one merges the parts' partial
        results (in the attention launch, or in a combine kernel).
    out : optional output array (q's shape and dtype, last dimension contiguous).
    dtype : "bfloat16" to read uint16 CuPy arrays as bfloat16 bits (else taken from the arrays).
    validate : also run :func:`check_kvcache_inputs` (reads cache_seqlens and block_table on the
        host: synchronizes, so not for CUDA-graph capture).
    stream : CuPy stream, torch stream or raw handle; default CuPy's current stream, or torch's
        current stream for torch inputs.

    Returns
    -------
    o, or ``(o, lse)`` with return_lse; the same kind of array as q.

    Raises
    ------
    ConfigError : before anything is launched, for wrong shapes, dtypes, strides, devices, page
        sizes or options.

    Notes
    -----
    Which checks run where, and why.  The host checks everything it can see without reading
    device memory - shapes, dtypes, strides, alignment, devices - on every new call signature
    (ConfigError, nothing launched).  The *contents* of cache_seqlens and block_table are read
    only on the device, so the call never synchronizes and can be captured in a CUDA graph and
    replayed with new lengths and tables: a sequence whose cache_seqlens[b] is negative or whose
    cache_seqlens[b] + seqlen_new exceeds the capacity, or whose block table holds a page id
    outside [0, num_blocks) among the pages it uses, gets NaN in o and lse; no kernel reads or
    writes out of range, and k_new is not appended for it.  :func:`check_kvcache_inputs` (or
    ``validate=True``) performs the same content checks on the host and raises ConfigError
    naming block_table or cache_seqlens.
    """
    arrays = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out)
    key = _PLANS.key(arrays, (bool(causal), softmax_scale, bool(return_lse), num_splits, dtype,
                              getenv_raw("RTKERNELS_ARCH"), _VARIANT_KEY))
    plan = _PLANS.get(key)
    if plan is None:
        plan, arrays = _new_plan(key, arrays, causal, softmax_scale, return_lse, num_splits, dtype)
    if validate:
        check_kvcache_inputs(k_cache, cache_seqlens, block_table, seqlen_new=0 if k_new is None else k_new.shape[1])
    try:
        return _launch(plan, key, arrays, stream)
    except _GroupRefused:   # plan again without the group merge (for this config from now on)
        _GROUP_REFUSED.add(_refusal_key(plan.config, plan.device))
        plan, arrays = _new_plan(key, arrays, causal, softmax_scale, return_lse, num_splits, dtype)
        return _launch(plan, key, arrays, stream)


def _new_plan(key, arrays, causal, softmax_scale, return_lse, num_splits, dtype):
    """(plan, arrays to launch on) of a call signature, the plan recorded under ``key`` if it has one."""
    plan, views = _plan(arrays, causal, softmax_scale, return_lse, num_splits, dtype)
    if key is not None:
        _PLANS.put(key, plan)
    elif not plan.torch:   # arrays no plan can hold (CAI / DLPack objects): launch on their CuPy views
        arrays = tuple(views.get(n) if a is not None and n != "out" else a for n, a in zip(_NAMES, arrays))
    return plan, arrays


def _launch(plan, key, arrays, stream):
    if key is not None:   # a plan's arrays are all on the current device
        return _execute(plan, *arrays, stream)
    import cupy
    with cupy.cuda.Device(plan.device):
        return _execute(plan, *arrays, stream)


_NAMES = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "k_new", "v_new", "out")


def _plan(arrays, causal, softmax_scale, return_lse, num_splits, dtype):
    import cupy
    given = {n: a for n, a in zip(_NAMES, arrays) if a is not None}
    views = {n: as_device_array(a, OP, n) for n, a in given.items()}
    p = check(views, dtype, softmax_scale, num_splits, given)
    torch = _is_torch(arrays[0])
    if torch:
        import torch as _torch
        out_dtype, f32 = arrays[0].dtype, _torch.float32
    else:
        out_dtype, f32 = views["q"].dtype, cupy.float32
    with cupy.cuda.Device(p.device):
        arch = _device_arch(p.device)
        plan = make_plan(p, causal=causal, return_lse=return_lse, num_splits=num_splits, torch=torch,
                         out_dtype=out_dtype, f32=f32, arch=arch, sms=_sm_count(p.device), variant=_VARIANT,
                         gbs_per_sm=_gbs_per_sm(p.device))
    return plan, views


# ---- host-side content check ------------------------------------------------------------------
def _host(x) -> np.ndarray:
    if x is None or isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        return x.detach().cpu().numpy()
    import cupy
    return cupy.asnumpy(as_device_array(x, OP, "array"))


def check_kvcache_inputs(k_cache, cache_seqlens, block_table=None, *, seqlen_new: int = 0) -> None:
    """Check the *contents* of cache_seqlens and block_table on the host (copies them there:
    synchronizes).  :func:`attention_kvcache` never reads them on the host - the kernels check
    them on the device and answer NaN for a bad sequence, which keeps the call capturable in a
    CUDA graph - so call this where a clear error is worth a synchronization.

    Raises ConfigError naming ``cache_seqlens`` (an entry < 0, or entry + seqlen_new above the
    cache's capacity: seqlen_cache, or max_blocks_per_seq x page_size) or ``block_table`` (a
    page id outside [0, num_blocks) among the pages entry + seqlen_new keys occupy).
    Accepts device arrays and NumPy arrays.
    """
    shape = tuple(k_cache.shape)
    if block_table is None:
        capacity = shape[1]
    else:
        table = _host(block_table)
        page_size, num_blocks = shape[1], shape[0]
        capacity = table.shape[1] * page_size
    if cache_seqlens is None:   # every cache full: a paged one uses every page of its row
        lens = np.full(0 if block_table is None else table.shape[0], capacity - seqlen_new, np.int64)
    else:
        lens = _host(cache_seqlens).astype(np.int64).reshape(-1)
    for b, n in enumerate(lens):
        if n < 0:
            raise _bad("cache_seqlens", int(n), f"cache_seqlens[{b}] = {int(n)} is negative")
        if n + seqlen_new > capacity:
            raise _bad("cache_seqlens", int(n), f"cache_seqlens[{b}] = {int(n)} plus seqlen_new = {seqlen_new} exceeds "
                                                f"the cache's capacity of {capacity} keys per sequence")
        if block_table is not None:
            used = table[b, :-(-(int(n) + seqlen_new) // page_size)]
            wrong = np.nonzero((used < 0) | (used >= num_blocks))[0]
            if wrong.size:
                j = int(wrong[0])
                raise _bad("block_table", int(used[j]), f"block_table[{b}, {j}] = {int(used[j])} is outside [0, "
                                                        f"num_blocks = {num_blocks}) (sequence {b} uses its first "
                                                        f"{used.size} pages)")


# ---- references (NumPy, float64) ------------------------------------------------------------
def _round_np(x: np.ndarray, dtype: str | None) -> np.ndarray:
    """Round to float16/bfloat16 (nearest even), kept as float64; None: unchanged."""
    if dtype is None:
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def append_kvcache_reference(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None):
    """Copies of the caches with k_new / v_new written at cache_seqlens (NumPy arrays)."""
    kc, vc = np.array(k_cache), np.array(v_cache)
    if k_new is None:
        return kc, vc
    for b, n in enumerate(np.asarray(cache_seqlens).reshape(-1)):
        for j in range(k_new.shape[1]):
            pos = int(n) + j
            if block_table is None:
                kc[b, pos], vc[b, pos] = k_new[b, j], v_new[b, j]
            else:
                page = block_table[b, pos // kc.shape[1]]
                kc[page, pos % kc.shape[1]], vc[page, pos % kc.shape[1]] = k_new[b, j], v_new[b, j]
    return kc, vc


def attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None,
                                causal: bool = True, softmax_scale: float | None = None,
                                round_to: str | None = None):
    """Dense per-sequence attention in float64 on the host: ``(o, lse)`` as NumPy arrays.

    Same conventions as :func:`attention_kvcache`: k_new / v_new appended at cache_seqlens
    (the inputs are not modified), GQA, causal aligned bottom-right per sequence with
    seqlen_k = cache_seqlens[b] + seqlen_new, o = 0 and lse = -inf for a row without keys.
    Inputs are NumPy arrays of values (any float dtype; bfloat16 decoded by the caller) and
    integer arrays; the contents must be valid (:func:`check_kvcache_inputs`).
    ``round_to="float16"|"bfloat16"`` imitates running it in that dtype (scores, probabilities
    and output rounded): FlashAttention's test rule compares errors against that.
    """
    q = np.asarray(q, dtype=np.float64)
    table = None if block_table is None else np.asarray(block_table)
    if cache_seqlens is None:   # every cache full
        capacity = k_cache.shape[1] * (1 if table is None else table.shape[1])
        cache_seqlens = np.full(q.shape[0], capacity, np.int64)
    lens = np.asarray(cache_seqlens).reshape(-1).astype(np.int64)
    kc, vc = append_kvcache_reference(np.asarray(k_cache, np.float64), np.asarray(v_cache, np.float64), lens,
                                      None if k_new is None else np.asarray(k_new, np.float64),
                                      None if v_new is None else np.asarray(v_new, np.float64), table)
    batch, sq, nheads, d = q.shape
    nheads_kv = kc.shape[2]
    group = nheads // nheads_kv
    sn = 0 if k_new is None else k_new.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    o = np.zeros((batch, sq, nheads, d))
    lse = np.full((batch, nheads, sq), -np.inf)
    for b in range(batch):
        sk = int(lens[b]) + sn
        if table is None:
            kb, vb = kc[b, :sk], vc[b, :sk]
        else:
            ps = kc.shape[1]
            pages = table[b, :-(-sk // ps)] if sk else table[b, :0]
            kb = kc[pages].reshape(-1, nheads_kv, d)[:sk]
            vb = vc[pages].reshape(-1, nheads_kv, d)[:sk]
        visible = np.ones((sq, sk), bool)
        if causal:
            visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        for h in range(nheads):
            s = _round_np(scale * (q[b, :, h] @ kb[:, h // group].T), round_to)
            s = np.where(visible, s, -np.inf)
            m = s.max(axis=1, keepdims=True) if sk else np.full((sq, 1), -np.inf)
            seen = np.isfinite(m)
            m = np.where(seen, m, 0.0)
            p = np.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            safe = np.where(l > 0, l, 1.0)
            o[b, :, h] = np.where(seen, _round_np(_round_np(p / safe, round_to) @ vb[:, h // group], round_to), 0.0)
            lse[b, h] = np.where(seen[:, 0], m[:, 0] + np.log(safe[:, 0]), -np.inf)
    return o, lse


def combine_reference(o_parts: np.ndarray, lse_parts: np.ndarray):
    """The combine kernel's math in NumPy: merge per-split normalized outputs ``o_parts``
    (splits, ..., head_dim) with their log-sum-exps ``lse_parts`` (splits, ...) into ``(o, lse)``.
    A split with lse = -inf has no key and weight 0 (its o_part is never read); all -inf gives
    o = 0, lse = -inf; any NaN lse gives NaN."""
    lse_parts = np.asarray(lse_parts, np.float64)
    nan = np.isnan(lse_parts).any(axis=0)
    m = np.max(np.where(np.isnan(lse_parts), -np.inf, lse_parts), axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.where(np.isneginf(lse_parts) | np.isnan(lse_parts), 0.0, np.exp(lse_parts - m_safe))
    total = w.sum(axis=0)
    o_safe = np.where(w[..., None] > 0, np.asarray(o_parts, np.float64), 0.0)
    o = (w[..., None] * o_safe).sum(axis=0) / np.where(total > 0, total, 1.0)[..., None]
    lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return np.where(nan[..., None], np.nan, o), np.where(nan, np.nan, lse)


__all__ = ["attention_kvcache", "check_kvcache_inputs", "AttentionDecodeConfig", "attention_kvcache_reference",
           "append_kvcache_reference", "combine_reference", "choose_config", "choose_num_splits"]
