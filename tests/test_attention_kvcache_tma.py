"""attention_decode's TMA loader (loader="tma": keys mode's per-warp rings, rows mode's CTA ring
with a producer thread and full / empty mbarriers, filled by Hopper tensor copies) and cp.async's
L2 prefetch qualifier (l2_prefetch): config, layout and heuristics, a few compiles (CPU); the TMA
path against the float64 reference over contiguous / paged (16, 48, 64, 256) / transposed caches,
ragged lengths, GQA 1-16, head dims 64-256, both dtypes, splits, stream-K, NaN cache tails and
CUDA-graph replays with new lengths and block tables, in both warp splits, and the rows mode's
forced cp.async ring beside it (GPU, ``-m gpu``).

Uses test_attention_kvcache's helpers (inputs, reference check, poisoned outputs)."""
from __future__ import annotations

import dataclasses
import importlib
import re

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels import inspect as rtk_inspect
from rtkernels.errors import ConfigError
from rtkernels.ops.attention_kvcache import AttentionDecodeConfig, check, choose_config

from test_attention_kvcache import (Fake, _bad_page_gives_nan_for_that_sequence_only, _call, _check,
                                   _cluster_merge_against_reference_and, _make, _run, _seed, _views)

kv_mod = importlib.import_module("rtkernels.ops.attention_kvcache")
TMA = dict(loader="tma")


# ---- config ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(loader="bulk"), dict(l2_prefetch=32), dict(l2_prefetch=True),
    dict(num_stages=2, loader="tma", warp_split="rows", kv_heads=4, num_warps=4, rows=16),   # no slack stage
])
def test_config_rejects(bad):
    with pytest.raises(ConfigError) as e:
        AttentionDecodeConfig(**bad)
    assert "attention_decode" in str(e.value) and next(iter(bad)) in str(e.value)


def test_tma_smem_layout():
    c = AttentionDecodeConfig(dtype="bfloat16", head_dim=128, rows=16, block_n=16, num_warps=4, num_stages=3,
                              loader="tma")
    # 1 KB alignment slack + 4 warps x 3 stages x (K + V) x 16 keys x 128 (unpadded) + Q 16 x 136,
    # 16-bit elements; then 12 mbarriers
    assert c.shared_mem_bytes == 1024 + 2 * (4 * 3 * 2 * 16 * 128 + 16 * 136) + 8 * 12
    assert c.shared_mem_bytes <= 113 * 1024, "two CTAs per sm_90 SM, as the cp.async tile"
    c = AttentionDecodeConfig(head_dim=64, rows=48, block_n=16, num_warps=4, num_stages=2, loader="tma")
    merge = 4 * (4 * 48 * 72 + 2 * 4 * 48 + 2 * 48)   # the warps' merge is the larger here
    assert c.shared_mem_bytes == merge + 8 * 8
    assert c.bytes_in_flight == 4 * 1 * 16 * 2 * 64 * 2
    # a head dim not a multiple of 64: whole 64-column boxes in the ring (the copy zero-fills past d)
    c = AttentionDecodeConfig(dtype="bfloat16", head_dim=96, rows=16, block_n=16, num_warps=4, num_stages=3,
                              loader="tma")
    assert c.tma_columns == 128
    assert c.shared_mem_bytes == 1024 + 2 * (4 * 3 * 2 * 16 * 128 + 16 * 104) + 8 * 12
    # rows mode: one CTA ring of 4 stages x (K + V) x 2 kv heads x 32 keys x 128, no Q tile (q_in_regs),
    # full + empty mbarriers per stage; 2 tiles in flight (the last stage is the producer's slack)
    c = AttentionDecodeConfig(dtype="bfloat16", head_dim=128, rows=32, block_n=32, num_warps=4, num_stages=4,
                              warp_split="rows", kv_heads=2, loader="tma")
    assert c.shared_mem_bytes == 1024 + 2 * 4 * 2 * 2 * 32 * 128 + 8 * 2 * 4
    assert c.bytes_in_flight == 2 * 2 * 32 * 2 * 128 * 2
    # ... d192 (3 column blocks) with Q in shared memory (2 heads x 64 rows x 200 elements)
    c = AttentionDecodeConfig(dtype="float16", head_dim=192, rows=64, block_n=16, num_warps=8, num_stages=3,
                              warp_split="rows", kv_heads=2, loader="tma", q_in_regs=False)
    assert c.shared_mem_bytes == 1024 + 2 * (3 * 2 * 2 * 16 * 192 + 2 * 64 * 200) + 8 * 2 * 3


def test_choose_config_loader(monkeypatch):
    c = choose_config("bfloat16", 128, 4, True, False, "sm_90", loader="tma")
    assert c.loader == "tma" and c.warp_split == "keys" and c.shared_mem_bytes <= 113 * 1024
    # many rows: the rows mode's own TMA ring (keys mode's with warp_split="keys")
    c = choose_config("bfloat16", 128, 64, False, True, "sm_90", loader="tma")
    assert c.loader == "tma" and c.warp_split == "rows" and c.rows == 64 and c.num_stages >= 3
    c = choose_config("bfloat16", 128, 64, False, True, "sm_90", loader="tma", warp_split="keys")
    assert c.loader == "tma" and c.warp_split == "keys" and c.rows == 32
    for d, arch in ((128, "sm_80"), (128, "sm_89"), (80, "sm_86")):
        for ws in ("keys", "rows"):
            with pytest.raises(ConfigError, match="loader"):
                choose_config("bfloat16", d, 4, False, False, arch, loader="tma", warp_split=ws)
    with pytest.raises(ConfigError, match="num_stages"):
        choose_config("bfloat16", 128, 64, False, False, "sm_90", loader="tma", num_stages=2)
    # the default: TMA in keys mode on sm_90 at every head dim, cp.async elsewhere
    assert kv_mod.DECODE_LOADER == "tma" or kv_mod.os.environ.get("RTKERNELS_DECODE_LOADER")
    monkeypatch.setattr(kv_mod, "DECODE_LOADER", "tma")
    assert choose_config("bfloat16", 128, 4, False, False, "sm_90").loader == "tma"
    assert choose_config("float16", 256, 16, True, True, "sm_90").loader == "tma"
    assert choose_config("bfloat16", 80, 4, False, False, "sm_90").loader == "tma"
    assert choose_config("bfloat16", 128, 4, False, False, "sm_80").loader == "cp.async"
    # many rows: the rows mode with its TMA ring, 2 CTAs per SM, 2 tiles in flight (d128 Sq16 x group 4)
    c = choose_config("bfloat16", 128, 64, False, True, "sm_90")
    assert c.warp_split == "rows" and c.loader == "tma" and c.num_stages == 4 and c.block_n == 32, c
    assert c.shared_mem_bytes <= 113 * 1024 and c.bytes_in_flight == 2 * 32 * 512
    for d, rows_total, paged in ((256, 128, True), (64, 300, False), (80, 48, True), (192, 64, False)):
        c = choose_config("float16", d, rows_total, paged, True, "sm_90")
        assert c.warp_split == "rows" and c.loader == "tma" and c.num_stages >= 3, c
    assert choose_config("bfloat16", 128, 64, False, True, "sm_80").loader == "cp.async"
    # RTKERNELS_DECODE_LOADER=cp.async: back to the cp.async rings in both modes
    monkeypatch.setattr(kv_mod, "DECODE_LOADER", "cp.async")
    assert choose_config("bfloat16", 128, 4, False, False, "sm_90").loader == "cp.async"
    c = choose_config("bfloat16", 128, 64, False, True, "sm_90")
    assert c.warp_split == "rows" and c.loader == "cp.async" and c.num_stages == 3
    c = choose_config("bfloat16", 128, 4, False, False, "sm_90", l2_prefetch=256)
    assert c.l2_prefetch == 256


def test_tma_plan_maps_the_caches_as_they_are():
    """The plan's tensor-map spec: 4-D over the cache's own shape and strides, box of 64 columns x
    block_n keys (contiguous) or x 16 keys (paged: one page's group); an empty cache falls back."""
    kv_mod.set_variant(dict(loader="tma", l2_prefetch=256))
    try:
        p = check(_views(q=Fake((2, 1, 8, 128)), k_cache=Fake((3, 100, 2, 128)), v_cache=Fake((3, 100, 2, 128))),
                  None, None, None)
        plan = kv_mod.make_plan(p, causal=True, return_lse=False, num_splits=None, torch=False, out_dtype="float16",
                                f32="float32", arch="sm_90", sms=132, variant=kv_mod._VARIANT)
        assert plan.config.loader == "tma"
        # dims (batch, kv heads, keys, head_dim): keys inside heads, whatever the strides
        assert plan.tma == ("float16", (3, 2, 100, 128), (25600, 128, 256, 1), (25600, 128, 256, 1),
                            (1, 1, plan.config.block_n, 64), 256)
        paged = _views(q=Fake((2, 1, 8, 128)), k_cache=Fake((9, 48, 2, 128)), v_cache=Fake((9, 48, 2, 128)),
                       block_table=Fake((2, 4), "int32"))
        p = check(paged, None, None, None)
        plan = kv_mod.make_plan(p, causal=True, return_lse=False, num_splits=None, torch=False, out_dtype="float16",
                                f32="float32", arch="sm_90", sms=132, variant=kv_mod._VARIANT)
        assert plan.tma[1] == (9, 2, 48, 128) and plan.tma[4] == (1, 1, 16, 64)
        # rows mode: a box of the CTA's kv_heads heads x block_n keys (paged: x 16 keys)
        kv_mod.set_variant(dict(loader="tma", warp_split="rows", kv_heads=2))
        plan = kv_mod.make_plan(p, causal=True, return_lse=False, num_splits=None, torch=False, out_dtype="float16",
                                f32="float32", arch="sm_90", sms=132, variant=kv_mod._VARIANT)
        assert plan.config.warp_split == "rows" and plan.config.kv_heads == 2 and plan.config.loader == "tma"
        assert plan.tma[1] == (9, 2, 48, 128) and plan.tma[2] == (48 * 256, 128, 256, 1)
        assert plan.tma[4] == (1, 2, 16, 64)
        p = check(_views(q=Fake((2, 16, 8, 128)), k_cache=Fake((3, 100, 2, 128)), v_cache=Fake((3, 100, 2, 128))),
                  None, None, None)
        kv_mod.set_variant(dict(l2_prefetch=256))
        plan = kv_mod.make_plan(p, causal=True, return_lse=False, num_splits=None, torch=False, out_dtype="float16",
                                f32="float32", arch="sm_90", sms=132, variant=kv_mod._VARIANT)
        assert plan.config.warp_split == "rows" and plan.config.loader == "tma"   # 64 rows: the default
        assert plan.tma[4] == (1, 1, plan.config.block_n, 64)
        p = check(_views(q=Fake((2, 1, 8, 128)), k_cache=Fake((2, 0, 2, 128)), v_cache=Fake((2, 0, 2, 128))),
                  None, None, None)
        plan = kv_mod.make_plan(p, causal=True, return_lse=False, num_splits=None, torch=False, out_dtype="float16",
                                f32="float32", arch="sm_90", sms=132, variant=kv_mod._VARIANT)
        assert plan.tma is None and (plan.config is None or plan.config.loader == "cp.async")
    finally:
        kv_mod.set_variant(None)


def _decode_plan(batch, seqlen, sq=1, h=32, hkv=8, d=128, page=16, variant=None, arch="sm_90", gbs_per_sm=25.4):
    """make_plan for a (paged: ``page`` keys a page; None: contiguous) cache of ``seqlen`` keys per
    sequence under a bench variant, on 132 SMs of ``gbs_per_sm`` (25.4: an H100's, lean)."""
    kv_mod.set_variant(variant)
    try:
        if page:
            pages = batch * seqlen // page
            views = _views(q=Fake((batch, sq, h, d)), k_cache=Fake((pages, page, hkv, d)),
                           v_cache=Fake((pages, page, hkv, d)), block_table=Fake((batch, seqlen // page), "int32"),
                           cache_seqlens=Fake((batch,), "int32"))
        else:
            views = _views(q=Fake((batch, sq, h, d)), k_cache=Fake((batch, seqlen, hkv, d)),
                           v_cache=Fake((batch, seqlen, hkv, d)), cache_seqlens=Fake((batch,), "int32"))
        return kv_mod.make_plan(check(views, None, None, None), causal=True, return_lse=False, num_splits=None,
                                torch=False, out_dtype="float16", f32="float32", arch=arch, sms=132,
                                variant=kv_mod._VARIANT, gbs_per_sm=gbs_per_sm)
    finally:
        kv_mod.set_variant(None)


def test_tma_paged_caches_split_as_contiguous_ones_on_lean_memory():
    """Pages the TMA loader reads in keys mode (its page ids a batch ahead) split as a contiguous
    cache does by the fill rule on any memory (B1 S32k 32/8: 16 splits, one CTA per SM, merged in the
    launch), while on lean memory the contiguous cache itself splits only to
    LEAN_GRID_BYTES_IN_FLIGHT (8); the rows mode's 16-key pages on deep memory (an H200's 37, or
    unknown) and cp.async pages (sm_80, the variant loader=cp.async) take PAGED_FILL's 33 (merged
    by groups in the launch); the bench variants split_rule=paged / contig / fill and memory=lean / deep force
    either."""
    def plan(paged, variant, arch="sm_90", gbs_per_sm=25.4, page=16):
        return _decode_plan(1, 32768, page=page if paged else None, variant=variant, arch=arch, gbs_per_sm=gbs_per_sm)
    contig = plan(False, None)
    tma = plan(True, None)
    assert (contig.num_splits, contig.fused) == (8, True)
    assert tma.config.loader == "tma" and (tma.num_splits, tma.fused) == (16, True)
    assert plan(True, dict(memory="lean"), gbs_per_sm=None).num_splits == 16
    assert plan(False, dict(memory="lean"), gbs_per_sm=None).num_splits == 8
    assert plan(False, dict(split_rule="fill")).num_splits == 16     # the lean rule's A/B baseline
    assert plan(False, dict(loader="cp.async")).num_splits == 16     # the cp.async ring: not measured, the fill rule
    deep_contig = plan(False, None, gbs_per_sm=None)
    assert deep_contig.num_splits == 16 and deep_contig.fused
    assert plan(True, dict(split_rule="contig"), gbs_per_sm=None).num_splits == deep_contig.num_splits
    for deep in (plan(True, None, gbs_per_sm=37.2), plan(True, None, gbs_per_sm=None), plan(True, dict(memory="deep"))):
        assert (deep.num_splits, deep.fused) == (16, True), (deep.num_splits, deep.fused)
    old = plan(True, dict(split_rule="paged"))
    # (33 splits x 4 rows: past FUSED_COMBINE_MAX_BYTES, so merged by groups - KEYS_GROUP_MERGE)
    assert old.num_splits == 33 and old.split.cooperative and old.combine is None, (old.num_splits, old.fused)
    # the rows mode's pages (a batch ahead too, level under either rule on an H200): PAGED_FILL on deep
    # memory below LONG_PAGE keys
    rows = dict(warp_split="rows", kv_heads=1)
    assert plan(True, rows, gbs_per_sm=37.2).num_splits > plan(False, rows, gbs_per_sm=37.2).num_splits
    assert plan(True, rows, gbs_per_sm=37.2, page=64).num_splits == plan(False, rows, gbs_per_sm=37.2).num_splits
    for cp_pages in (plan(True, dict(loader="cp.async")), plan(True, None, arch="sm_80")):
        assert cp_pages.config.loader == "cp.async" and cp_pages.num_splits > tma.num_splits, cp_pages.num_splits


def test_replays_memoize_tensor_maps_per_plan_and_address_pair(monkeypatch):
    """A replay's K / V tensor maps come from the plan's own memo of (k_cache, v_cache) addresses
    (kvcache._plan_maps): the same objects for the same caches (rtkernels.tma's memo is not asked
    again), new maps for moved caches, the same bytes as _tensor_maps, and a bounded memo."""
    from rtkernels import tma

    def encode(ptr, *rest):   # the driver's encoding, stood in: the map records its address
        out = np.zeros((), tma.TENSOR_MAP_DTYPE)
        out["opaque"][0] = ptr
        return out[()]
    monkeypatch.setattr(tma, "_encode", encode)
    plan = _decode_plan(1, 32768, page=None)
    assert plan.tma is not None and plan.maps == {}
    base = 0x7F00_0000_0000
    k, v = kv_mod._plan_maps(plan, base, base + (1 << 30))
    again = kv_mod._plan_maps(plan, base, base + (1 << 30))
    assert again[0] is k and again[1] is v
    assert (int(k["opaque"][0]), int(v["opaque"][0])) == (base, base + (1 << 30))
    direct = kv_mod._tensor_maps(plan.tma, base, base + (1 << 30))
    assert k.tobytes() == direct[0].tobytes() and v.tobytes() == direct[1].tobytes()
    moved = kv_mod._plan_maps(plan, base + (2 << 30), base + (3 << 30))
    assert int(moved[0]["opaque"][0]) == base + (2 << 30) and moved[0] is not k
    monkeypatch.setattr(tma, "tensor_map", lambda *a, **kw: pytest.fail("a memoized pair asked rtkernels.tma"))
    assert kv_mod._plan_maps(plan, base, base + (1 << 30))[0] is k
    monkeypatch.undo()
    monkeypatch.setattr(tma, "_encode", encode)
    for i in range(kv_mod.PLAN_MAPS_MAX + 3):
        kv_mod._plan_maps(plan, base + (i + 8) * (1 << 30), base + (i + 200) * (1 << 30))
    assert 0 < len(plan.maps) <= kv_mod.PLAN_MAPS_MAX
    assert plan == dataclasses.replace(plan, maps={})   # the memo is not part of the plan's value


def test_keys_mode_heavy_pages_fill_one_cta_per_sm():
    """Paged caches of 32 rows per kv head (seqlen_q 8 at GQA 4: the keys mode, its page ids read a
    batch ahead) split to one CTA per SM (COMPUTE_FILL) on lean and deep memory; two under the bench's
    split_rule=paged (the rule before), at d64, and in the rows mode (seqlen_q 16), whose producer
    waits on each page's block-table read."""
    for batch in (1, 2, 4, 8, 16):   # 8 kv heads: 8 x batch CTAs before splitting
        for gbs in (25.4, 37.2):   # an H100's DRAM per SM (lean), an H200's
            one = _decode_plan(batch, 32768 // batch, sq=8, gbs_per_sm=gbs)
            assert one.config.warp_split == "keys" and one.num_splits == 132 // (8 * batch), (batch, one.num_splits)
        two = 264 // (8 * batch)
        assert _decode_plan(batch, 32768 // batch, sq=8, variant=dict(split_rule="paged")).num_splits == two
    assert _decode_plan(4, 8192, sq=8, d=64).num_splits == 8   # d64: two per SM
    rows = _decode_plan(8, 8192, sq=16)
    assert rows.config.warp_split == "rows" and rows.num_splits == 4   # 64 CTAs x 4: two per SM


def test_lean_memory_wgmma_rows_small_heads_fill_two_ctas_per_sm():
    """COMPUTE_FILL_LEAN_WGMMA_HEAD_DIM: on lean memory the wgmma rows mode (seqlen_q 16 at GQA 4, a
    contiguous cache) splits grids below one CTA per SM to two per SM under d112, one from d112; a
    grid with a CTA for every SM stays unsplit, and the bench's split_rule=one is the rule before.
    LEAN_WGMMA_SHALLOW_STAGES: d96-d104's two-per-SM grids take three stages; LEAN_WGMMA_DEEP_STAGES:
    grids of at most one CTA per SM five."""
    def plan(batch, d, sq=16, **kw):
        pl = _decode_plan(batch, 32768 // batch, sq=sq, d=d, page=None, **kw)
        assert pl.config.warp_split == "rows" and pl.config.mma == "wgmma", pl.config
        return pl.num_splits, pl.config.num_stages
    # LEAN_WGMMA_SHALLOW_STAGES: three stages for d96-d104 at two CTAs per SM; LEAN_WGMMA_DEEP_STAGES:
    # five for grids of at most one CTA per SM; four elsewhere
    assert [plan(4, d) for d in (80, 96, 104, 112, 128)] == [(8, 4), (8, 3), (8, 3), (4, 5), (4, 5)]   # 32 CTAs
    assert plan(8, 96) == (4, 3) and plan(16, 96) == (1, 5)            # 64 CTAs; 128: unsplit
    assert plan(2, 96, sq=8) == (16, 3)                                # 32 rows per kv head: heavy too
    assert plan(8, 128, sq=8) == (2, 5) and plan(16, 128, sq=8) == (1, 5)   # 128 CTAs, split in two or not
    assert plan(4, 128, sq=5) == (4, 5)                                # 20 rows per kv head
    assert plan(2, 64, sq=5) == (8, 4)                                 # d64: not measured
    assert plan(4, 96, variant=dict(split_rule="one")) == (4, 4)       # the rules before
    assert plan(4, 96, variant=dict(num_stages=4)) == (8, 4)           # a variant's ring stays
    assert plan(4, 96, gbs_per_sm=37.2) == (8, 4) and plan(4, 128, gbs_per_sm=37.2) == (8, 4)   # deep memory
    paged = [_decode_plan(4, 8192, sq=16, d=d, page=16).config.num_stages for d in (80, 96, 128)]
    assert paged == [4, 3, 4]   # paged: three stages at d96-d104 only (five lost there)
    # what `rtk report attention_decode` and the slow no-spill test compile includes those rings
    listed = {(c.head_dim, c.num_stages, c.paged) for c in kv_mod.heuristic_configs("sm_90", ("bfloat16",), (96, 128))
              if c.mma == "wgmma"}
    assert {(96, 3, False), (96, 3, True), (96, 5, False), (128, 5, False)} <= listed, listed


def test_lean_memory_pages_from_half_the_sms_stream_unsplit_with_a_deeper_ring():
    """LEAN_PAGED_UNSPLIT_CTAS_PER_SM / LEAN_PAGED_STAGES: on lean memory a keys-mode paged grid (TMA,
    d128) of >= 0.45 CTA per SM is not split and takes 4 stages while it holds <= one CTA per SM;
    smaller grids, deep memory, d64, heavy rows and the bench's split_rule=fill keep the fill rule's
    plan."""
    def plan(batch, seqlen, **kw):
        pl = _decode_plan(batch, seqlen, **kw)
        return pl.config.warp_split, pl.num_splits, pl.config.num_stages
    assert plan(8, 8192) == ("keys", 1, 4)                  # 64 CTAs
    assert plan(8, 8192, sq=4) == ("keys", 1, 4)            # 16 rows per kv head
    assert plan(8, 8192, page=64) == ("keys", 1, 4)
    assert plan(16, 4096, h=64, hkv=16) == ("keys", 1, 3)   # 256 CTAs: two per SM, the tile's 3 stages
    assert plan(4, 16384) == ("keys", 4, 3)                 # 32 CTAs: the fill rule
    assert plan(8, 8192, gbs_per_sm=37.2) == ("keys", 2, 3)   # deep memory
    assert plan(8, 8192, variant=dict(split_rule="fill")) == ("keys", 2, 3)   # the bench's baseline
    assert plan(8, 8192, variant=dict(num_stages=3)) == ("keys", 1, 3)       # a variant's ring stays
    assert plan(8, 8192, d=64) == ("keys", 2, 3)            # d64: not measured
    assert plan(8, 8192, sq=8)[1] > 1                       # 32 rows per kv head: heavy, not measured


def test_keys_mode_split_grids_merge_in_a_cluster():
    """The keys mode's TMA split grids of 2-8 splits (KEYS_CLUSTER_MERGE_MAX_SPLITS) merge through a
    cluster's distributed shared memory: no workspace, no counters, no cooperative launch, splits
    adjacent in launch order, the launch's shared memory padded to the even share of CTAs per SM
    (one here); the bench's cluster:off keeps the last CTA's merge; more splits than a cluster
    (deep memory's 16 at B1 S32k), cp.async rings and stream-K never take it."""
    from rtkernels.arch import occupancy
    plan = _decode_plan(1, 32768, page=None)   # lean memory: 8 splits of 8 kv heads
    c = plan.config
    assert (c.warp_split, c.loader, plan.num_splits, c.cluster_merge, c.group_merge) == ("keys", "tma", 8, 8, 0)
    assert plan.fused and plan.combine is None and not plan.split.cooperative
    assert plan.part_bytes == 0 and plan.counter_bytes == 0
    assert int(plan.split.tail[0]["fused"]) == 5 and int(plan.split.tail[0]["order"]) == 0
    k = plan.split.kernel
    assert occupancy("sm_90", c.threads_per_block, k.resources.registers, 0, plan.split.shared_mem).blocks_per_sm == 1
    assert k.resources.spill_stores == 0 and k.resources.spill_loads == 0
    assert "UCGABAR_ARV" in k.sass and "UCGABAR_WAIT" in k.sass and "ATOMG" not in k.sass   # no global counter
    off = _decode_plan(1, 32768, page=None, variant=dict(cluster="off"))
    assert (off.num_splits, off.config.cluster_merge, off.config.group_merge) == (8, 0, 8) and off.counter_bytes > 0
    assert _decode_plan(2, 32768, page=None).config.cluster_merge == 4
    assert _decode_plan(1, 32768, page=None, gbs_per_sm=None).config.cluster_merge == 0   # 16 splits
    assert _decode_plan(1, 32768, page=None, variant=dict(loader="cp.async")).config.cluster_merge == 0
    assert _decode_plan(1, 32768, page=None, variant=dict(schedule="streamk")).config.cluster_merge == 0
    assert _decode_plan(8, 8192, page=None).num_splits == 1   # unsplit: nothing to merge


def test_keys_mode_partials_past_the_fused_bytes_merge_by_groups():
    """KEYS_GROUP_MERGE: a keys-mode split grid whose partials would go to the combine launch (16
    splits x 16 rows at d128: 128 KB a group, past FUSED_COMBINE_MAX_BYTES) merges by groups in the
    launch instead (a cooperative grid, two counters per group); the variant combine:kernel keeps
    the combine launch; the last CTA's merge (few rows) and the cluster keep theirs."""
    grp = _decode_plan(1, 32768, sq=4, page=None, gbs_per_sm=None)   # deep memory: 16 splits
    c = grp.config
    assert (c.warp_split, grp.num_splits, c.cluster_merge) == ("keys", 16, 0) and c.group_merge > 0
    assert grp.fused and grp.combine is None and grp.split.cooperative and int(grp.split.tail[0]["fused"]) == 4
    assert grp.counter_bytes == 8 * 8   # [in, out] per (sequence, kv head)
    res = grp.split.kernel.resources
    assert res.spill_stores == 0 and res.spill_loads == 0
    kernel = _decode_plan(1, 32768, sq=4, page=None, gbs_per_sm=None, variant=dict(combine="kernel"))
    assert not kernel.fused and kernel.combine is not None and not kernel.split.cooperative
    one = _decode_plan(1, 32768, page=None, gbs_per_sm=None)   # 4 rows: the last CTA's one-trip merge
    assert int(one.split.tail[0]["fused"]) == 1 and not one.split.cooperative


def test_lean_memory_threshold():
    assert kv_mod.lean_memory(3352 / 132) and not kv_mod.lean_memory(4900 / 132)
    assert not kv_mod.lean_memory(None) and not kv_mod.lean_memory(0.0)


def _tma_plan(**views):
    p = check(_views(**views), None, None, None)
    return kv_mod.make_plan(p, causal=True, return_lse=False, num_splits=None, torch=False, out_dtype="float16",
                            f32="float32", arch="sm_90", sms=132, variant=kv_mod._VARIANT)


def _strides_of(shape):
    acc, out = 1, []
    for n in reversed(shape):
        out.insert(0, acc)
        acc *= n
    return out


def test_tma_maps_of_size_one_dims_get_valid_strides():
    """batch 1 or one kv head: check() records a size-1 dim's stride as 0 (torch leaves it
    arbitrary); the map gets the array's span there (positive, whole 16 bytes) - the H200 run of
    2026-11-26 failed with 'strides[k]=0' at B1 S32k and at nheads_kv=1."""
    from rtkernels.tma import check_tensor_map
    for shape in ((1, 300, 8, 128), (2, 300, 1, 256), (1, 64, 1, 64), (5, 16, 1, 96)):
        for bogus in (0, 3, -8):   # whatever the array says for its size-1 dims
            st = [s if n > 1 else bogus for n, s in zip(shape, _strides_of(shape))]
            k = Fake(shape, strides=[2 * x for x in st])
            plan = _tma_plan(q=Fake((shape[0], 1, 8 * shape[2], shape[3])), k_cache=k, v_cache=k,
                             cache_seqlens=Fake((shape[0],), "int32"))
            assert plan.config.loader == "tma", plan.config
            _, mshape, ks, vs, box, _ = plan.tma
            assert ks == vs and ks[-1] == 1 and all(s > 0 and s % 8 == 0 for s in ks[:-1]), ks
            order = (0, 2, 1, 3)   # the map's (batch, kv heads, keys, head_dim)
            assert mshape == tuple(shape[i] for i in order)
            for n, s, want in zip(mshape, ks, (_strides_of(shape)[i] for i in order)):
                assert n == 1 or s == want, (shape, ks)
            check_tensor_map(1 << 20, "float16", mshape, ks, box)   # what the driver would be given


def test_tma_falls_back_to_cp_async_where_no_map_can_describe_the_cache():
    """A broadcast cache (stride 0 over several entries, e.g. torch expand) or a reversed view
    cannot be a tensor map: the call uses the cp.async ring, no error (also when a variant asks
    for TMA)."""
    shape = (3, 200, 2, 128)
    good = _strides_of(shape)
    for name, st in (("broadcast batch", [0] + good[1:]), ("broadcast heads", good[:2] + [0, 1]),
                     ("reversed keys", [good[0], -good[1]] + good[2:])):
        k = Fake(shape, strides=[2 * x for x in st])
        for v in (None, dict(loader="tma")):
            kv_mod.set_variant(v)
            try:
                plan = _tma_plan(q=Fake((3, 1, 8, 128)), k_cache=k, v_cache=Fake(shape),
                                 cache_seqlens=Fake((3,), "int32"))
            finally:
                kv_mod.set_variant(None)
            assert plan.config.loader == "cp.async" and plan.tma is None, (name, v, plan.config)
    assert kv_mod.tma_strides(shape, tuple(good)) == tuple(good)
    assert kv_mod.tma_strides(shape, (good[0], good[1], 12, 1)) is None   # 24 bytes: not whole 16-byte rows
    assert kv_mod.tma_strides((1, 5, 1, 8), (0, 8, 0, 1)) == (40, 8, 40, 1)


def _tma_lands(r: int, hh: int, col: int, block_n: int, kv_heads: int, box_rows: int) -> int:
    """Where the tensor copies put element (key r of the tile, kv head hh, column col) of a K (or V)
    tile, in 16-bit elements from the tile's start, from the copy's own rules: copy (column block
    col // 64, key group r // box_rows) lands at the start its issuer gives it (blocks of kv_heads x
    block_n x 64, groups after one another) as a box [kv_heads][box_rows][64 columns] of 128-byte
    rows, and CU_TENSOR_MAP_SWIZZLE_128B XORs byte address bits [4, 7) - the 16-byte chunk - with
    bits [7, 10) of the shared address (every copy's start is 1024-byte aligned)."""
    start = (col // 64) * kv_heads * block_n * 64 + (r // box_rows) * kv_heads * box_rows * 64
    byte = 2 * start + (hh * box_rows + r % box_rows) * 128 + (col % 64) * 2
    byte ^= ((byte >> 7) & 7) << 4
    return byte // 2


def _t_row(r, hh, dc, block_n, kv_heads, box_rows):
    """The template's t_row (mirrored)."""
    return dc * kv_heads * block_n * 64 + (r // box_rows) * kv_heads * box_rows * 64 + (hh * box_rows + r % box_rows) * 64


@pytest.mark.parametrize("block_n,head_dim,kv_heads,box_rows", [
    (16, 128, 1, 16), (32, 64, 1, 32), (16, 256, 1, 16), (16, 72, 1, 16), (32, 40, 1, 32), (16, 96, 1, 16),
    (32, 64, 1, 16),                         # keys mode, paged: two 16-key copies per tile
    (32, 128, 4, 32), (64, 80, 2, 64),       # rows mode: one box of kv_heads heads per column block
    (32, 128, 2, 16), (64, 72, 8, 16),       # rows mode, paged: a box per 16-key group
])
def test_tma_fragment_addresses_follow_the_swizzle(block_n, head_dim, kv_heads, box_rows):
    """The template's k_frag_row / v_frag_row / v_frag_row_x2 arithmetic (mirrored here, from each
    kv head's base t_row(0, hh, 0)) addresses the row and 16-byte column chunk ldmatrix wants from
    each lane, in the layout the hardware writes; head dims not a multiple of 64 / 16 included
    (padded K steps, odd V tile), one or several kv heads and key groups per copy; and
    tma_zero_tail's t_row covers each row's 8 chunks of a block exactly."""
    n_tiles_o = head_dim // 8
    for hh in range(kv_heads):
        base = _t_row(0, hh, 0, block_n, kv_heads, box_rows)

        def row(r, dc):
            return _t_row(r, 0, dc, block_n, kv_heads, box_rows)

        for lane in range(32):
            k_row0, kc, vc, r7 = (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1, lane >> 4, lane & 7
            for np_ in range(block_n // 16):
                for kk in range(-(-head_dim // 16)):
                    got = base + k_row0 * 64 + row(np_ * 16, kk // 4) + (((2 * (kk % 4) + kc) ^ r7) << 3)
                    want = _tma_lands(k_row0 + np_ * 16, hh, kk * 16 + kc * 8, block_n, kv_heads, box_rows)
                    assert got == want, (hh, lane, np_, kk)
            for kk in range(block_n // 16):
                for dp in range(n_tiles_o // 2):
                    got = base + (lane & 15) * 64 + row(kk * 16, dp // 4) + (((2 * (dp % 4) + vc) ^ r7) << 3)
                    want = _tma_lands((lane & 15) + kk * 16, hh, dp * 16 + vc * 8, block_n, kv_heads, box_rows)
                    assert got == want, (hh, lane, kk, dp)
                if n_tiles_o % 2:
                    c = n_tiles_o - 1
                    got = base + (lane & 15) * 64 + row(kk * 16, c // 8) + (((c % 8) ^ r7) << 3)
                    assert got == _tma_lands((lane & 15) + kk * 16, hh, c * 8, block_n, kv_heads, box_rows), \
                        (hh, lane, kk, "x2")
    # every (key, head, column block) row is one 128-byte row of the tile, all distinct
    d_boxes = -(-head_dim // 64)
    starts = sorted(_t_row(r, hh, dc, block_n, kv_heads, box_rows)
                    for r in range(block_n) for hh in range(kv_heads) for dc in range(d_boxes))
    assert starts == list(range(0, d_boxes * kv_heads * block_n * 64, 64))


# ---- compile (a few: CI has two cores) --------------------------------------------------------
def _opcodes(sass):
    return re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)


@pytest.mark.parametrize("dtype,d,rows_total,paged,causal,kw", [
    ("bfloat16", 128, 4, False, False, {}),
    ("float16", 128, 32, True, True, dict(warp_split="keys")),   # 32 rows: two m-tiles per warp
    ("bfloat16", 256, 16, True, False, {}),
    ("bfloat16", 64, 4, False, False, dict(schedule="streamk")),
    ("float16", 72, 8, True, True, {}),                    # d72: padded K step, odd V tile, 2 boxes
    # rows mode: the CTA ring, one producer thread, full / empty mbarriers
    # speculative Sq16 x group 4 (4 warps, 32-key tiles) through mma.sync: the default there is
    # wgmma (attention_kvcache.DECODE_MMA; test_attention_kvcache_wgmma.py builds it)
    ("bfloat16", 128, 64, False, True, dict(mma="sync")),
    ("float16", 128, 64, True, True, dict(mma="sync")),    # ... paged: a copy per 16-key group
    ("bfloat16", 256, 128, True, True, {}),                # 8 warps, Q in shared memory (cp.async, once)
    ("float16", 72, 16, False, True, dict(warp_split="rows", nheads_kv=4)),   # a box of 4 kv heads, padded d
])
def test_tma_configs_compile_clean(dtype, d, rows_total, paged, causal, kw):
    cfg = choose_config(dtype, d, rows_total, paged, causal, "sm_90", loader="tma", **kw)
    k = rtk.get_kernel(cfg, "attention_decode", arch="sm_90")
    ops = _opcodes(k.sass)
    assert any(o.startswith("UTMALDG.4D") for o in ops), "4-D tensor copies"
    assert any(o.startswith("SYNCS") for o in ops), "mbarrier arrive / wait"
    assert any(o.startswith("HMMA.16816.F32") for o in ops)
    assert any(o == "LDSM.16.M88.4" for o in ops) and any(o.startswith("LDSM.16.MT88") for o in ops)
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), f"{cfg}: {r}"
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local memory"
    assert not rtk_inspect.flags(k), rtk_inspect.flags(k)
    if cfg.warp_split == "rows":
        # K/V by tensor copies only (Q_IN_REGS: no cp.async at all); the warps release stages on
        # the empty barriers (plain arrives) besides the producer's arrive.expect_tx
        assert cfg.q_in_regs == (not any(o.startswith("LDGSTS") for o in ops)), "cp.async only for Q in smem"
        assert sum(o.startswith("SYNCS.ARRIVE") for o in ops) >= 2, "producer and consumer arrivals"
    print(cfg, r)


# The many-CTA shapes' occupancy variants (tools/bench_decode.py --variants, issue #15: B64 S2k,
# B128 S1k, B16 S4k d64 at 2 CTAs per SM): smaller rings / fewer warps for 3-4 CTAs per SM, or 8
# warps for 1.  (head_dim, variant fields, CTAs per SM the tile must reach on sm_90)
OCCUPANCY_VARIANTS = [
    (128, dict(num_warps=2), 4),                   # 2 warps x 3 stages x 8 KB: 54 KB
    (128, dict(num_stages=2), 3),                  # 71 KB; 167 registers x 128 threads x 3 fits 64K
    (128, dict(num_warps=2, num_stages=4), 3),     # 71 KB, 3 tiles in flight per warp
    (64, dict(lean_memory=True), 4),               # d64 16-key tiles (4 KB of K+V, lean memory's): 53 KB
    (64, dict(), 2),                               # d64 32-key tiles (the default elsewhere): 104 KB
    (64, dict(num_warps=2), 4),                    # d64 32-key tiles, 2 warps: 53 KB
    (64, dict(num_warps=2, lean_memory=True), 8),  # d64 16-key tiles, 2 warps (lean memory, two-warp rule): 27 KB
]


@pytest.mark.parametrize("d,fields,per_sm", OCCUPANCY_VARIANTS)
def test_occupancy_variants_reach_their_residency(d, fields, per_sm):
    cfg = choose_config("bfloat16", d, 4, False, False, "sm_90", loader="tma", warp_split="keys", **fields)
    k = rtk.get_kernel(cfg, "attention_decode", arch="sm_90")
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), f"{cfg}: {r}"
    got = kv_mod._ctas_per_sm(cfg, k, "sm_90")
    assert got == per_sm, f"{cfg}: {got} CTAs per SM ({r.registers} registers, {cfg.shared_mem_bytes} B), want {per_sm}"


def test_l2_prefetch_qualifier_reaches_the_ptx():
    cfg = choose_config("bfloat16", 128, 4, False, False, "sm_90", l2_prefetch=128, loader="cp.async")
    k = rtk.get_kernel(cfg, "attention_decode", arch="sm_90")
    assert "cp.async.cg.shared.global.L2::128B" in k.ptx
    r = k.resources
    assert not (r.spill_stores or r.stack_frame), r


# ==== GPU =======================================================================================
from test_attention_kvcache import _plan_of, variant  # noqa: E402

FIXTURES = (variant,)   # pytest fixtures shared with test_attention_kvcache (used by argument name)


# (batch, seqlen_q, nheads, nheads_kv, head_dim, dtype, page_size, seqlen_new, capacity, num_splits)
TMA_CASES = [
    (4, 1, 32, 8, 128, "bfloat16", None, 0, 900, None),  # decode GQA 4, contiguous
    (5, 1, 32, 8, 128, "float16", None, 1, 1000, 5),     # append, 5 splits
    (3, 1, 16, 16, 64, "float16", 16, 1, 500, 3),        # MHA d64 (32-key tiles: two 16-key copies), page 16
    (3, 1, 16, 2, 128, "bfloat16", 64, 1, 900, None),    # GQA 8, page 64
    (2, 1, 16, 1, 256, "float16", 256, 0, 1300, 2),      # MQA 16, d256, page 256
    (3, 1, 16, 4, 192, "bfloat16", 48, 2, 700, None),    # d192 (3 column blocks), page 48
    (3, 4, 32, 8, 128, "bfloat16", 16, 4, 500, None),    # speculative: 16 rows
    (3, 16, 32, 8, 128, "bfloat16", None, 2, 800, 2),    # 64 rows: two 32-row tiles (keys mode forced)
    (4, 1, 8, 8, 64, "bfloat16", None, 0, 37, None),     # capacity 37: a tile past the cache's end (zero-filled)
]


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["fused", "kernel"])
@pytest.mark.parametrize("batch,sq,h,hkv,d,dtype,page,new,cap,splits", TMA_CASES)
def test_gpu_tma_against_float64_reference(variant, combine, batch, sq, h, hkv, d, dtype, page, new, cap, splits):
    """The keys mode's TMA rings (per-warp rings, lane 0 issuing)."""
    variant(dict(loader="tma", warp_split="keys", combine=combine))
    x = _run(_seed(), batch, sq, h, hkv, d, dtype, page, True, new, cap, num_splits=splits)
    plan = _plan_of(x, splits)
    print(plan.config, "splits", plan.num_splits, "fused", plan.fused)
    assert plan.config.loader == "tma" and plan.tma is not None and plan.config.warp_split == "keys", plan.config


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [
    dict(num_warps=2), dict(num_stages=2), dict(num_warps=2, num_stages=4), dict(block_n=16), dict(num_warps=8),
    dict(schedule="streamk", num_warps=2),
], ids=("w2", "s2", "w2s4", "n16", "w8", "skw2"))
@pytest.mark.parametrize("case", [
    (6, 1, 32, 8, 128, "bfloat16", None, 1, 900),   # GQA 4, ragged lengths, an append
    (3, 1, 16, 16, 64, "float16", 16, 0, 500),      # MHA d64, page 16
], ids=("d128", "d64paged16"))
def test_gpu_occupancy_variants_against_float64_reference(variant, fields, case):
    """The bench's occupancy variants for the many-CTA shapes (see OCCUPANCY_VARIANTS)."""
    batch, sq, h, hkv, d, dtype, page, new, cap = case
    variant(dict(loader="tma", warp_split="keys", **fields))
    x = _run(_seed(), batch, sq, h, hkv, d, dtype, page, True, new, cap)
    cfg = _plan_of(x).config
    print(cfg)
    assert cfg.loader == "tma" and all(getattr(cfg, f) == v for f, v in fields.items()), cfg


# Rows mode (> 32 query rows per kv head: speculative verification, chunked prefill; or forced for
# decoding with several kv heads per CTA): the CTA ring filled by one producer thread, against the
# forced cp.async ring.  (batch, seqlen_q, nheads, nheads_kv, head_dim, dtype, page_size,
# seqlen_new, capacity, num_splits)
ROWS_CASES = [
    (3, 8, 32, 8, 128, "bfloat16", None, 8, 900, None),  # Sq8 x group 4 = 32 rows (4 warps, 2 pad)
    (3, 16, 32, 8, 128, "bfloat16", 16, 4, 1000, None),  # Sq16 x 4 = 64 rows, page 16: a copy per page
    (2, 16, 16, 2, 128, "float16", 64, 16, 700, 3),      # 128 rows (8 warps), page 64, 3 splits
    (2, 32, 8, 2, 64, "bfloat16", 256, 32, 1300, None),  # d64, 128 rows, page 256, 64-key tiles
    (2, 16, 8, 1, 256, "float16", None, 2, 600, 2),      # d256 MQA: 128 rows, Q in shared memory
    (3, 12, 24, 4, 80, "bfloat16", 48, 3, 500, None),    # d80 (2 column blocks, zero-filled), 72 rows, page 48
    (2, 300, 4, 2, 64, "bfloat16", 64, 300, 700, None),  # chunked prefill: 600 rows, 5 row tiles
    (4, 1, 16, 16, 72, "float16", 16, 1, 400, None),     # decode, 8 kv heads per CTA (one box), padded d
    (4, 1, 32, 8, 128, "bfloat16", None, 0, 900, 4),     # decode, 8 kv heads per CTA, contiguous
    (4, 4, 8, 8, 64, "bfloat16", None, 0, 37, None),     # capacity 37: a tile past the cache's end
]


@pytest.mark.gpu
@pytest.mark.parametrize("loader", ["tma", "cp.async"])
@pytest.mark.parametrize("batch,sq,h,hkv,d,dtype,page,new,cap,splits", ROWS_CASES)
def test_gpu_rows_mode_tma_and_cp_async_against_float64_reference(variant, loader, batch, sq, h, hkv, d, dtype, page,
                                                                  new, cap, splits):
    """Ragged lengths (0 and 1 among them), appends, GQA 1-8, pages 16-256, splits, poisoned
    outputs, both dtypes; each case run on the rows mode's TMA ring and on its cp.async ring."""
    variant(dict(warp_split="rows", loader=loader))
    x = _run(_seed(), batch, sq, h, hkv, d, dtype, page, True, new, cap, num_splits=splits)
    plan = _plan_of(x, splits)
    print(plan.config, "splits", plan.num_splits, "fused", plan.fused)
    assert plan.config.warp_split == "rows" and plan.config.loader == loader, plan.config
    assert (plan.tma is not None) == (loader == "tma")


@pytest.mark.gpu
@pytest.mark.parametrize("l2", [0, 256])
@pytest.mark.parametrize("page", [None, 16, 64], ids=("contig", "paged16", "paged64"))
@pytest.mark.parametrize("sq", [1, 16], ids=("keys", "rows"))
def test_gpu_tma_nan_past_the_sequences_is_never_used(variant, sq, l2, page):
    """TMA moves whole boxes, so a tile past a sequence's end brings the cache's next rows (NaN
    here) into shared memory: the kernel zeroes them before P V (keys mode: the warp; rows mode:
    the CTA, then a barrier).  Ragged lengths with 0, 1 and one short of a tile; seqlen_q 16 x
    group 4 runs the rows mode."""
    import cupy as cp
    from gpu_util import poison
    variant(dict(loader="tma", l2_prefetch=l2))
    cap = 640
    x = _make(_seed(), 5, sq, 16, 4, 128, "bfloat16", page, cap, lens=[0, 1, 15, 333, cap])
    for b, n in enumerate(x.lens_h):   # every cache entry a sequence does not use: NaN
        if page is None:
            poison(x.kc[b, n:]), poison(x.vc[b, n:])
            continue
        for j in range(x.table_h.shape[1]):
            pg = int(x.table_h[b, j])
            if not 0 <= pg < x.kc.shape[0]:
                continue
            first = max(0, int(n) - j * page)
            if first < page:
                poison(x.kc[pg, first:]), poison(x.vc[pg, first:])
    used = np.zeros(x.kc.shape[0], bool) if page else None
    if page:   # pages no sequence uses at all: NaN too
        for b, n in enumerate(x.lens_h):
            used[x.table_h[b, : -(-int(n) // page)]] = True
        for pg in np.nonzero(~used)[0]:
            poison(x.kc[int(pg)]), poison(x.vc[int(pg)])
    x.kc_h, x.vc_h = np.nan_to_num(x.kc_h), np.nan_to_num(x.vc_h)   # the reference never reads them either
    for splits in (None, 3):
        out = poison(cp.empty(x.q.shape, x.q.dtype))
        o, lse = _call(x, out=out, return_lse=True, num_splits=splits)
        cp.cuda.Device().synchronize()
        _check(x, o, lse, True, None, f"NaN tails sq={sq} page={page} l2={l2} splits={splits}")
    plan = _plan_of(x)
    assert plan.config.loader == "tma" and plan.config.warp_split == ("rows" if sq > 8 else "keys"), plan.config


@pytest.mark.gpu
def test_gpu_tma_transposed_cache_and_streamk(variant):
    variant(dict(loader="tma"))
    _run(_seed(), 3, 2, 16, 4, 128, "float16", None, True, 2, 700, hnd=True, num_splits=3)
    _run(_seed(), 3, 1, 16, 4, 64, "bfloat16", None, True, 0, 500, hnd=True)
    variant(dict(loader="tma", schedule="streamk"))
    for page in (None, 16):
        x = _run(_seed(), 5, 1, 32, 8, 128, "bfloat16", page, True, 1, 1500)
        assert _plan_of(x).config.schedule == "streamk"


@pytest.mark.gpu
@pytest.mark.parametrize("sq,d,page", [(1, 128, None), (4, 128, 16), (1, 64, None), (2, 96, 64)],
                         ids=("sq1-d128", "sq4-d128-paged16", "sq1-d64", "sq2-d96-paged64"))
def test_gpu_keys_mode_cluster_merge_against_reference_and_last_cta_merge(variant, sq, d, page):
    """The keys mode's cluster merge at 2-8 splits: ragged lengths (0 and 1: splits without keys), an
    append, poisoned outputs, the float64 reference; and bit for bit the last CTA's merge where that
    is the group merge's arithmetic (the same split order and formula)."""
    # 3 x 4 groups: at most 96 CTAs, whose clusters the driver fits at one CTA per SM
    x = _make(_seed(), 3, sq, 16, 4, d, "bfloat16", page, 3000, lens=[0, 1, 2998], seqlen_new=2)
    keys = dict(loader="tma", warp_split="keys")
    _cluster_merge_against_reference_and(variant, x, keys, dict(keys, cluster="off"), f"keys sq={sq} d={d} page={page}",
                                         lambda off, splits: off.fused and off.config.group_merge >= splits)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,d,page,extra", [(3, 4, 128, None, {}), (3, 2, 128, 16, {}),
                                                  (2, 4, 256, None, {"combine": "group"}), (3, 3, 64, 64, {}),
                                                  (3, 4, 96, 16, {"loader": "cp.async"})],
                         ids=("sq4-d128", "sq2-d128-paged16", "sq4-d256", "sq3-d64-paged64", "sq4-d96-paged16-cp"))
def test_gpu_keys_mode_group_merge_against_reference(variant, batch, sq, d, page, extra):
    """The keys mode's group merge (partials past FUSED_COMBINE_MAX_BYTES: every CTA of a group
    merges a share after a barrier, a cooperative launch) at 12-20 splits, every CTA resident (d256
    through the bench's combine:group: its default keeps the combine launch; the cp.async ring as
    where no tensor map describes a cache): ragged lengths (0 and 1: splits without keys), an
    append, poisoned outputs, the float64 reference."""
    import cupy as cp
    from gpu_util import poison
    x = _make(_seed(), batch, sq, 16, 4, d, "bfloat16", page, 3000, lens=[0, 1, 2998][:batch], seqlen_new=2)
    for splits in ((12, 16) if d > 128 else (12, 16, 20)):   # d256: one CTA per SM
        variant({"loader": "tma", "warp_split": "keys", **extra})
        out = poison(cp.empty(x.q.shape, x.q.dtype))
        o, lse = _call(x, out=out, return_lse=True, num_splits=splits)
        cp.cuda.Device().synchronize()
        plan = _plan_of(x, splits)
        assert plan.config.warp_split == "keys" and plan.split.cooperative, plan.config
        assert int(plan.split.tail[0]["fused"]) == 4
        _check(x, o, lse, True, None, f"keys group merge sq={sq} d={d} page={page} splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64, 256])
def test_gpu_tma_appends_cross_page_boundaries(variant, page):
    variant(dict(loader="tma"))
    _run(_seed(), 4, 3, 8, 2, 128, "float16", page, True, 3, 4 * page, lens=[page - 1, 2 * page - 1, 3 * page - 2, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("sq", [1, 16], ids=("keys", "rows"))
def test_gpu_tma_bad_page_gives_nan_for_that_sequence_only(variant, sq):
    variant(dict(loader="tma"))
    _bad_page_gives_nan_for_that_sequence_only(sq)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16, 64], ids=("contig", "paged16", "paged64"))
@pytest.mark.parametrize("sq", [1, 4, 16], ids=("keys", "keys-group", "rows"))
def test_gpu_tma_graph_replay_with_new_lengths_and_block_tables(variant, sq, page):
    """CuPy stream capture of a TMA call with splits: the tensor maps travel as kernel parameters
    (they depend on the caches' addresses only), so replays see new cache_seqlens and, paged, a
    new block table (the pages permuted) - against the reference and an eager call each time;
    seqlen_q 1 merges 6 splits in clusters, seqlen_q 4 (16 rows x 10 splits: 80 KB of partials a
    group) by groups on a cooperative grid, seqlen_q 16 x group 4 runs the rows mode's producer ring."""
    import cupy as cp
    from gpu_util import to_f64
    variant(dict(loader="tma"))
    splits = 10 if sq == 4 else 6   # seqlen_q 4: past a cluster's 8, and 240 CTAs resident at once
    cap = 2000
    x = _make(_seed(), 3, sq, 32, 8, 128, "bfloat16", page, cap, lens=[cap] * 3)   # every page mapped
    out = cp.empty(x.q.shape, x.q.dtype)
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        _call(x, out=out, num_splits=splits)
        s.synchronize()
        s.begin_capture()
        _, lse = _call(x, out=out, num_splits=splits, return_lse=True)
        graph = s.end_capture()
    plan = _plan_of(x, splits)
    assert plan.config.loader == "tma" and plan.config.warp_split == ("rows" if sq > 8 else "keys"), plan.config
    assert (plan.config.cluster_merge == 6) == (sq == 1) and (sq != 4 or plan.split.cooperative), plan.config
    rng = np.random.default_rng(_seed())
    for step in range(3):
        x.lens_h = rng.integers(0, cap, size=3).astype(np.int32)
        x.lens_h[step] = [0, 1, cap][step]
        x.lens.set(x.lens_h)
        if page:   # the same pages, each sequence's in a new order
            for b in range(3):
                used = -(-cap // page)
                x.table_h[b, :used] = rng.permutation(x.table_h[b, :used])
            x.table.set(x.table_h)
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        _check(x, out, lse, True, None, f"tma graph replay {step} page={page} lens {x.lens_h.tolist()}")
        eager, _ = _call(x, num_splits=splits, return_lse=True)
        cp.cuda.Device().synchronize()
        assert np.array_equal(to_f64(eager, "bfloat16"), to_f64(out, "bfloat16")), f"replay {step} != eager"
