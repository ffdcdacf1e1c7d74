"""attention_decode's rows mode with warpgroup MMAs (mma="wgmma", sm_90a): a warpgroup per 64 query
rows of one kv head computes S = Q K^T and O += P V with wgmma, K/V read from the TMA stages.
CPU: config validation, the heuristic's choices, a few compiles (HGMMA, no mma.sync / ldmatrix,
no spills, three CTAs per SM at 4 warps).  GPU (``-m gpu``): against the float64 reference over
contiguous / paged caches, ragged lengths (0 and 1 among them), appends, padding rows (fewer than
64 rows per kv head), 8 warps, several row tiles, 64-key tiles, causal or not, both dtypes, NaN
cache tails, a bad page id, CUDA-graph replays, and the cluster merge against the float64 reference
and the group merge (bit for bit).  Also the online softmax's lazy rescale
(lazy_rescale: O rescaled only in tiles where a row's maximum moved) in every MMA / warp split.

Uses test_attention_kvcache's helpers (inputs, reference check, poisoned outputs)."""
from __future__ import annotations

import importlib
import re

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError
from rtkernels.ops.attention_kvcache import AttentionDecodeConfig, choose_config

from test_attention_kvcache import (_bad_page_gives_nan_for_that_sequence_only, _call, _check,
                                    _cluster_merge_against_reference_and, _make, _plan_of, _run, _seed, variant)

FIXTURES = (variant,)   # pytest fixtures shared with test_attention_kvcache (used by argument name)

kv_mod = importlib.import_module("rtkernels.ops.attention_kvcache")
WG = dict(warp_split="rows", loader="tma", kv_heads=1, num_warps=4, rows=64, block_n=32, num_stages=4,
          dtype="bfloat16", head_dim=128, mma="wgmma")


# ---- config ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,field", [
    (dict(mma="hgmma"), "mma"),
    (dict(warp_split="keys", rows=32, num_warps=4, num_stages=3, block_n=16), "mma"),
    (dict(loader="cp.async", num_stages=3), "mma"),
    (dict(kv_heads=2, num_warps=4, rows=32), "kv_heads"),
    (dict(num_warps=2, rows=32), "num_warps"),
    (dict(num_warps=6, rows=96), "num_warps"),
    (dict(head_dim=192, q_in_regs=False), "head_dim"),
    (dict(q_in_regs=False), "q_in_regs"),
    (dict(lazy_rescale="yes"), "lazy_rescale"),
])
def test_config_rejects(bad, field):
    with pytest.raises(ConfigError) as e:
        AttentionDecodeConfig(**{**WG, **bad})
    assert "attention_decode" in str(e.value) and field in str(e.value), str(e.value)


def test_config_is_arch_specific_only_with_wgmma():
    assert AttentionDecodeConfig(**WG).needs_arch_specific
    assert not AttentionDecodeConfig(**{**WG, "mma": "sync"}).needs_arch_specific
    assert not AttentionDecodeConfig().needs_arch_specific


def test_choose_config_wgmma(monkeypatch):
    # asked for: the rows mode with one kv head, a warpgroup per 64 rows (padding rows below 64)
    for rows_total, warps in ((32, 4), (64, 4), (72, 8), (128, 8), (600, 8)):
        c = choose_config("bfloat16", 128, rows_total, False, True, "sm_90", nheads_kv=8, mma="wgmma")
        assert (c.mma, c.warp_split, c.kv_heads, c.loader, c.num_warps, c.rows) == \
            ("wgmma", "rows", 1, "tma", warps, 16 * warps), (rows_total, c)
        assert c.block_n == kv_mod.WGMMA_BLOCK_N and c.q_in_regs
    c = choose_config("float16", 64, 64, True, False, "sm_90", mma="wgmma", block_n=64, num_stages=3)
    assert (c.block_n, c.num_stages, c.paged) == (64, 3, True)
    c = choose_config("float16", 64, 64, True, False, "sm_90", mma="wgmma", lazy_rescale=True)
    assert c.lazy_rescale and c.mma == "wgmma" and not choose_config("float16", 64, 4, True, False, "sm_80").lazy_rescale
    # where it cannot serve: a clear error naming the argument
    for arch, d in (("sm_80", 128), ("sm_89", 64)):
        with pytest.raises(ConfigError, match="mma"):
            choose_config("bfloat16", d, 64, False, True, arch, mma="wgmma")
    with pytest.raises(ConfigError, match="mma"):
        choose_config("bfloat16", 192, 64, False, True, "sm_90", mma="wgmma")
    with pytest.raises(ConfigError, match="mma"):
        choose_config("bfloat16", 128, 64, False, True, "sm_90", mma="wgmma", loader="cp.async")
    with pytest.raises(ConfigError, match="mma"):
        choose_config("bfloat16", 128, 64, False, True, "sm_90", mma="wgmma", warp_split="keys")
    # the default (DECODE_MMA, measured): wgmma for > 32 rows, and 17-32 rows on contiguous caches;
    # "sync" switches back
    monkeypatch.setattr(kv_mod, "DECODE_MMA", "sync")
    assert choose_config("bfloat16", 128, 64, False, True, "sm_90").mma == "sync"
    monkeypatch.setattr(kv_mod, "DECODE_MMA", "wgmma")
    assert choose_config("bfloat16", 128, 64, False, True, "sm_90").mma == "wgmma"
    assert choose_config("bfloat16", 128, 64, True, True, "sm_90").mma == "wgmma"       # paged rows mode
    c = choose_config("bfloat16", 128, 32, False, True, "sm_90")                         # Sq8 x group 4
    assert (c.mma, c.warp_split) == ("wgmma", "rows"), c
    assert choose_config("bfloat16", 128, 32, True, True, "sm_90").warp_split == "keys"  # paged: keys mode
    assert choose_config("bfloat16", 192, 64, False, True, "sm_90").mma == "sync"       # head_dim > 128
    assert choose_config("bfloat16", 128, 4, False, True, "sm_90").mma == "sync"        # keys mode
    assert choose_config("bfloat16", 256, 64, False, True, "sm_90").mma == "sync"       # Q too big for registers
    assert choose_config("bfloat16", 128, 64, False, True, "sm_80").mma == "sync"       # no wgmma
    assert choose_config("bfloat16", 128, 64, False, True, "sm_90", loader="cp.async").mma == "sync"


def test_plan_takes_the_variant_and_falls_back_without_a_tensor_map():
    x = _fake_problem()
    kv_mod.set_variant(dict(mma="wgmma"))
    try:
        plan = kv_mod.make_plan(x, causal=True, return_lse=False, num_splits=None, torch=False, out_dtype="bfloat16",
                                f32=None, arch="sm_90", sms=132, variant=kv_mod._VARIANT)
        assert plan.config.mma == "wgmma" and plan.config.warp_split == "rows" and plan.tma is not None
        # a cache no tensor map describes (broadcast heads): cp.async and mma.sync, whatever was asked
        strides = dict(x.strides)
        strides["k_cache"] = (strides["k_cache"][0], strides["k_cache"][1], 0, 1)
        plan = kv_mod.make_plan(x._replace(strides=strides), causal=True, return_lse=False, num_splits=None,
                                torch=False, out_dtype="bfloat16", f32=None, arch="sm_90", sms=132,
                                variant=kv_mod._VARIANT)
        assert plan.config.mma == "sync" and plan.config.loader == "cp.async" and plan.tma is None
    finally:
        kv_mod.set_variant(None)


def _fake_problem():
    """Sq16 x group 4 over a contiguous (8, 8192, 8, 128) bf16 cache, as check() reports it."""
    b, sq, h, hkv, d, cap = 8, 16, 32, 8, 128, 8192
    q = (sq * h * d, h * d, d, 1)
    k = (cap * hkv * d, hkv * d, d, 1)
    return kv_mod.Problem("bfloat16", 0, b, sq, h, hkv, d, False, cap, 0, 0, 0, d ** -0.5,
                          {"q": q, "k_cache": k, "v_cache": k, "out": q, "cache_seqlens": (1,)}, (b, cap, hkv, d))


OFF = {"cluster": "off"}   # the merges before the cluster merge (its bench variant)


@pytest.mark.parametrize("splits,variant,fused,code", [
    (2, OFF, True, 1),                    # 64 KB: the last CTA's register merge
    (3, OFF, True, 4),                    # from GROUP_MERGE_MIN_SPLITS on: the group merge
    (6, OFF, True, 4),                    # 64 x 6 CTAs: within the 3 x 132 resident at once
    (7, OFF, False, 0),                   # 64 x 7: more, so past 64 KB of partials the combine launch
    (2, None, True, 5),                   # the default at 2 splits: the cluster merge
    (3, None, True, 4),                   # more: the merges before (CLUSTER_MERGE_DEFAULT_MAX_SPLITS)
    (4, {"combine": "cluster"}, True, 5),  # the bench's variant: 2-8 splits where the clusters fit
    (7, {"combine": "cluster"}, False, 0),   # 64 x 7 CTAs past 3 x 132 resident at once: the merges before
    (4, {"combine": "fused"}, True, 1),   # the register merge forced (<= REG_MERGE_MAX_SPLITS)
    (5, {"combine": "kernel"}, False, 0),
    (2, {"merge": "units"}, True, 3),     # the bench's unit-merge variant: fused by the 64 KB rule
    (4, {"merge": "units"}, False, 0),
    (2, {"merge": "serial"}, True, 2),
    (2, {"combine": "group"}, True, 4),
])
def test_rows_mode_merges(splits, variant, fused, code):
    """The rows mode's merges: by groups from GROUP_MERGE_MIN_SPLITS splits (a cooperative launch,
    two counters per group), from the last CTA's registers below (DecodeArgs.fused 1) whatever the
    partials' bytes; the variants keep the other merges for A/Bs."""
    assert kv_mod.REG_MERGE_MAX_SPLITS == 4 and kv_mod.GROUP_MERGE_MIN_SPLITS == 3
    plan = kv_mod.make_plan(_fake_problem(), causal=True, return_lse=False, num_splits=splits, torch=False,
                            out_dtype="bfloat16", f32=None, arch="sm_90", sms=132, variant=variant)
    assert plan.config.warp_split == "rows" and plan.num_splits == splits
    assert plan.fused == fused and (plan.combine is None) == fused, plan
    assert int(plan.split.tail[0]["fused"]) == code
    assert plan.split.cooperative == (code == 4)
    assert plan.counter_bytes == (0 if not fused or code == 5 else (8 if code == 4 else 4) * plan.split.grid[0] // splits)
    # the cluster merge: the splits' partials stay on chip (no workspace), one cluster per group
    assert (plan.part_bytes == 0) == (code == 5) and (plan.config.cluster_merge == (splits if code == 5 else 0))
    assert int(plan.split.tail[0]["order"]) == (0 if code == 5 else kv_mod.ORDER[kv_mod.DEFAULT_ORDER])


@pytest.mark.parametrize("splits,group", [(3, True), (7, False)])
def test_group_plans_compile_only_the_kernel_they_launch(monkeypatch, splits, group):
    """A group-merge plan compiles the group kernel only; a grid that cannot be resident at once
    (64 x 7 CTAs against 3 x 132 by shared memory alone) does not compile it at all."""
    import rtkernels.kernel as kernel_mod
    real, built = kernel_mod.get_kernel, []

    def spy(cfg, name, **kw):
        built.append((name, cfg.group_merge))
        return real(cfg, name, **kw)
    monkeypatch.setattr(kernel_mod, "get_kernel", spy)
    plan = kv_mod.make_plan(_fake_problem(), causal=True, return_lse=False, num_splits=splits, torch=False,
                            out_dtype="bfloat16", f32=None, arch="sm_90", sms=132, variant=OFF)
    assert plan.split.cooperative == group
    assert {g for n, g in built if n == "attention_decode"} == ({plan.config.group_merge} if group else {0}), built


def test_cluster_merge_plans(monkeypatch):
    """The cluster merge: rows mode with wgmma, one row tile, 2 splits by default (2-8 under the
    bench's combine:cluster), every cluster resident at once at the even share of CTAs per SM; the
    plan compiles the cluster kernel only.  Elsewhere the merges before."""
    import rtkernels.kernel as kernel_mod
    real, built = kernel_mod.get_kernel, []

    def spy(cfg, name, **kw):
        built.append((name, cfg.cluster_merge))
        return real(cfg, name, **kw)
    monkeypatch.setattr(kernel_mod, "get_kernel", spy)
    plan = kv_mod.make_plan(_fake_problem(), causal=True, return_lse=False, num_splits=2, torch=False,
                            out_dtype="bfloat16", f32=None, arch="sm_90", sms=132)
    assert plan.config.cluster_merge == 2 and not plan.split.cooperative and plan.combine is None
    assert {c for n, c in built if n == "attention_decode"} == {2}, built
    # the launch asks the shared memory that keeps 128 CTAs one per SM (the even share)
    assert plan.split.shared_mem > plan.config.shared_mem_bytes
    from rtkernels.arch import occupancy
    assert occupancy("sm_90", 128, plan.split.kernel.resources.registers, 0, plan.split.shared_mem).blocks_per_sm == 1
    k = plan.split.kernel
    assert k.resources.spill_stores == 0 and k.resources.spill_loads == 0
    assert "UCGABAR_ARV" in k.sass and "UCGABAR_WAIT" in k.sass and "NANOSLEEP" not in k.sass   # no global barrier
    assert kv_mod._ctas_per_sm(plan.config, k, "sm_90") == 3
    # too many clusters to be resident at once (a small device): the merges before
    small = kv_mod.make_plan(_fake_problem(), causal=True, return_lse=False, num_splits=2, torch=False,
                             out_dtype="bfloat16", f32=None, arch="sm_90", sms=40)
    assert small.config.cluster_merge == 0
    # several row tiles (seqlen_q 48 x group 4 = 192 rows): a cluster would not be one group's splits
    x = _fake_problem()
    q = (48 * 32 * 128, 32 * 128, 128, 1)
    x = x._replace(seqlen_q=48, strides={**x.strides, "q": q, "out": q})
    rows = kv_mod.make_plan(x, causal=True, return_lse=False, num_splits=2, torch=False, out_dtype="bfloat16",
                            f32=None, arch="sm_90", sms=132)
    assert rows.config.cluster_merge == 0 and rows.split.grid[0] > 8 * 8 * 2


@pytest.mark.parametrize("bad", [dict(cluster_merge=9), dict(cluster_merge=1), dict(cluster_merge=4, group_merge=4)])
def test_cluster_merge_config_rejects(bad):
    with pytest.raises(ConfigError, match="cluster_merge"):
        AttentionDecodeConfig(**{**WG, **bad})
    with pytest.raises(ConfigError, match="cluster_merge"):
        AttentionDecodeConfig(warp_split="keys", rows=16, cluster_merge=4)


@pytest.mark.parametrize("d,batch", [(128, 16), (64, 4)])
def test_group_merge_compiles_without_spills_at_the_same_occupancy(d, batch):
    """The group merge is compiled only into the kernels of plans that use it (group_merge > 0):
    without it the kernel is the one before; with it, no spill and the same CTAs per SM."""
    cfg = choose_config("bfloat16", d, 64, False, True, "sm_90", mma="wgmma")
    assert cfg.group_merge == 0
    plain = rtk.get_kernel(cfg, "attention_decode", arch="sm_90")
    group = rtk.get_kernel(cfg.replace(group_merge=kv_mod.group_merge_batch(batch, d)), "attention_decode",
                           arch="sm_90")
    assert kv_mod.group_merge_batch(batch, d) == (16 if d > 64 else 4)
    assert group.resources.spill_stores == 0 and group.resources.spill_loads == 0
    assert kv_mod._ctas_per_sm(cfg, group, "sm_90") == kv_mod._ctas_per_sm(cfg, plain, "sm_90")
    assert "NANOSLEEP" in group.sass and "NANOSLEEP" not in plain.sass   # the group barrier's wait
    # release / acquire from thread 0 (rtk/common.cuh), no fence.sc per thread; the count out by
    # atom.inc, not a warp-aggregated atomicAdd whose answer is shuffled out before the barrier
    assert "MEMBAR.SC.GPU" not in group.sass and "ATOMG.E.INC" in group.sass


def test_decode_timeline_patches_the_template(tmp_path, monkeypatch):
    """tools/decode_timeline.py's anchors are in the template once each, and the patched copy
    renders its stamps on both merge paths (cluster and group): the tool's measurements stay
    possible as the template changes (CPU: rendering only)."""
    import importlib.util
    import pathlib
    import sys
    import rtkernels.render as render
    path = pathlib.Path(__file__).resolve().parent.parent / "tools" / "decode_timeline.py"
    spec = importlib.util.spec_from_file_location("rtk_tools_decode_timeline", path)
    tl = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tl
    spec.loader.exec_module(tl)
    dst = tmp_path / "templates"
    tl.patched_templates(str(render.template_dir()), str(dst))
    monkeypatch.setattr(render, "template_dir", lambda: dst)
    def source(cfg):   # (a config renders only the merges it compiles: one of the two per config)
        return render.render(cfg.template, cfg.template_params(), family=cfg.family).source

    cfg = AttentionDecodeConfig(**{**WG, "cluster_merge": 2})
    src = source(cfg)
    assert src.count("rtk_record(split);") == 1 and "rtk_stamps[65536 * %d]" % tl.STAMPS in src
    assert src.count("rtk_t1 = rtk_now();") == 1 and src.count("rtk_t2 = rtk_now();") == 1
    assert src.count("+ 11] = rtk_t0;") == 1   # the kernel's first instruction, either mode
    # (the cluster call stays in the text behind its if constexpr; the group merge's is rendered where compiled)
    assert source(cfg.replace(cluster_merge=0, group_merge=4)).count("rtk_record(split);") == 2
    # the keys mode: every warp's loop end, the CTA's, its stored partial, both merges' ends
    keys = AttentionDecodeConfig(warp_split="keys", rows=16, loader="tma", dtype="bfloat16", head_dim=128,
                                 cluster_merge=8)
    src = source(keys)
    assert "rtk_s[6 + (warp & 3)] = rtk_now();" in src and "rtk_s[1] = rtk_now();" in src
    assert src.count("+ 10] = rtk_now();") == 1 and "rtk_s[2] = rtk_now(); rtk_s[3] = rtk_s[2];" in src
    assert source(keys.replace(cluster_merge=0, group_merge=16, merges="group")).count("+ 10] = rtk_now();") == 2


# ---- compile (a few: CI has two cores) --------------------------------------------------------
def _opcodes(sass):
    return re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)


@pytest.mark.parametrize("dtype,d,rows_total,paged,causal,kw,per_sm", [
    ("bfloat16", 128, 64, False, True, {}, 3),                  # speculative Sq16 x group 4: one warpgroup
    ("float16", 128, 64, True, True, dict(block_n=64, num_stages=3), 2),   # paged, 64-key tiles (97 KB)
    ("bfloat16", 80, 128, True, False, {}, 1),                  # d80 (a zero-filled half block), 2 warpgroups
])
def test_wgmma_configs_compile_clean(dtype, d, rows_total, paged, causal, kw, per_sm):
    cfg = choose_config(dtype, d, rows_total, paged, causal, "sm_90", mma="wgmma", **kw)
    k = rtk.get_kernel(cfg, "attention_decode", arch="sm_90")
    ops = _opcodes(k.sass)
    hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32\S*\s[^;]*", k.sass)
    assert any(n == str(cfg.block_n) for n in hgmma), "S = Q K^T as m64 x block_n wgmma"
    assert re.search(r"HGMMA\.64x%dx16\.F32\S*\s[^;]*tnspB" % d, k.sass), "O += P V, V read N-major"
    assert not any(o.startswith(("HMMA", "LDSM")) for o in ops), "no mma.sync / ldmatrix left in the kernel"
    assert any(o.startswith("UTMALDG.4D") for o in ops)
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), f"{cfg}: {r}"
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local memory"
    got = kv_mod._ctas_per_sm(cfg, k, "sm_90")
    assert got >= per_sm, f"{cfg}: {got} CTAs per SM ({r.registers} registers, {cfg.shared_mem_bytes} B)"
    print(cfg, r, got)


# ==== GPU =======================================================================================


# (batch, seqlen_q, nheads, nheads_kv, head_dim, dtype, page_size, seqlen_new, capacity, num_splits, causal, fields)
WGMMA_CASES = [
    (3, 16, 32, 8, 128, "bfloat16", None, 4, 1000, None, True, {}),   # Sq16 x 4 = 64 rows: one warpgroup
    (3, 16, 32, 8, 128, "bfloat16", 16, 4, 1000, None, True, {}),     # ... page 16: a copy per 16-key group
    (3, 8, 32, 8, 128, "float16", None, 8, 900, None, True, {}),      # Sq8 x 4 = 32 rows (32 padding rows)
    (3, 16, 32, 8, 128, "float16", 64, 2, 900, 3, False, {}),         # not causal, page 64, 3 splits
    (2, 16, 16, 2, 128, "bfloat16", 64, 16, 700, 3, True, {}),        # 128 rows: two warpgroups
    (2, 32, 8, 2, 64, "bfloat16", 256, 32, 1300, None, True, {}),     # d64, 128 rows, page 256
    (2, 16, 32, 8, 64, "bfloat16", None, 4, 9000, 8, True, {}),       # d64, 8 splits (deep memory's fill of 4 per SM)
    (3, 12, 24, 4, 80, "bfloat16", 48, 3, 500, None, True, {}),       # d80 (zero-filled columns), 72 rows, page 48
    (2, 300, 4, 2, 64, "float16", 64, 300, 700, None, True, {}),      # chunked prefill: 600 rows, 5 row tiles
    (4, 4, 8, 8, 64, "bfloat16", None, 0, 37, None, True, {}),        # capacity 37: a tile past the cache's end
    (3, 16, 32, 8, 128, "bfloat16", 16, 4, 1000, 2, True, dict(block_n=64, num_stages=3)),   # 64-key tiles
    (3, 16, 32, 8, 96, "float16", None, 1, 800, None, True, dict(block_n=64, num_stages=5)),
    (3, 16, 32, 8, 128, "bfloat16", 16, 4, 1000, None, True, dict(num_stages=6)),           # deeper ring
    (4, 16, 32, 8, 96, "bfloat16", None, 2, 3000, 8, True, dict(num_stages=3)),  # LEAN_WGMMA_SHALLOW_STAGES' ring
    (4, 16, 32, 8, 96, "bfloat16", 16, 2, 3000, 8, True, dict(num_stages=3)),    # ... over pages
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,h,hkv,d,dtype,page,new,cap,splits,causal,fields", WGMMA_CASES)
def test_gpu_wgmma_against_float64_reference(variant, batch, sq, h, hkv, d, dtype, page, new, cap, splits, causal,
                                             fields):
    """Ragged lengths (0 and 1 among them), appends, poisoned outputs, FlashAttention's 2x rule
    per sequence (test_attention_kvcache._check)."""
    variant(dict(mma="wgmma", **fields))
    x = _run(_seed(), batch, sq, h, hkv, d, dtype, page, causal, new, cap, num_splits=splits)
    plan = _plan_of(x, splits)
    print(plan.config, "splits", plan.num_splits, "fused", plan.fused)
    assert plan.config.mma == "wgmma" and plan.config.warp_split == "rows", plan.config
    assert all(getattr(plan.config, f) == v for f, v in fields.items()), plan.config


@pytest.mark.gpu
@pytest.mark.parametrize("d,page", [(128, None), (128, 16), (64, None)], ids=("d128", "d128-paged16", "d64"))
def test_gpu_cluster_merge_against_reference_and_group_merge(variant, d, page):
    """The cluster merge (splits merged through distributed shared memory) at 2-8 splits: ragged
    lengths (0 and 1: splits without keys), an append, poisoned outputs, the float64 reference; and
    bit for bit the group merge's result (the same arithmetic in the same split order) from 3
    splits on."""
    # 3 x 4 groups: at most 96 CTAs, whose clusters the driver fits at one CTA per SM (15 of 8 CTAs)
    x = _make(_seed(), 3, 16, 16, 4, d, "bfloat16", page, 3000, lens=[0, 1, 2998], seqlen_new=2)
    _cluster_merge_against_reference_and(variant, x, dict(mma="wgmma", combine="cluster"),
                                         dict(mma="wgmma", cluster="off"), f"rows d={d} page={page}",
                                         lambda off, splits: splits >= kv_mod.GROUP_MERGE_MIN_SPLITS)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16], ids=("contig", "paged16"))
def test_gpu_wgmma_nan_past_the_sequences_is_never_used(variant, page):
    """Whole TMA boxes bring the cache's rows past a sequence (NaN here) into the stage; the kernel
    zeroes them (generic proxy, fenced for the wgmma's async-proxy reads) before P V."""
    import cupy as cp
    from gpu_util import poison
    variant(dict(mma="wgmma"))
    cap = 640
    x = _make(_seed(), 5, 16, 16, 4, 128, "bfloat16", page, cap, lens=[0, 1, 31, 333, cap])
    for b, n in enumerate(x.lens_h):
        if page is None:
            poison(x.kc[b, n:]), poison(x.vc[b, n:])
            continue
        for j in range(x.table_h.shape[1]):
            pg = int(x.table_h[b, j])
            if 0 <= pg < x.kc.shape[0] and max(0, int(n) - j * page) < page:
                first = max(0, int(n) - j * page)
                poison(x.kc[pg, first:]), poison(x.vc[pg, first:])
    x.kc_h, x.vc_h = np.nan_to_num(x.kc_h), np.nan_to_num(x.vc_h)
    for splits in (None, 3):
        out = poison(cp.empty(x.q.shape, x.q.dtype))
        o, lse = _call(x, out=out, return_lse=True, num_splits=splits)
        cp.cuda.Device().synchronize()
        _check(x, o, lse, True, None, f"wgmma NaN tails page={page} splits={splits}")
    assert _plan_of(x).config.mma == "wgmma"


@pytest.mark.gpu
def test_gpu_wgmma_bad_page_gives_nan_for_that_sequence_only(variant):
    variant(dict(mma="wgmma"))
    _bad_page_gives_nan_for_that_sequence_only(16)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [4, 2], ids=("group-merge", "cluster-merge"))
@pytest.mark.parametrize("page", [None, 16], ids=("contig", "paged16"))
def test_gpu_wgmma_graph_replay_with_new_lengths(variant, page, splits):
    """A captured call replayed with new cache_seqlens (and, paged, permuted pages) matches the
    reference and an eager call bit for bit - through the group merge (4 splits: a cooperative
    launch, counters in the workspace) and the cluster merge (2 splits)."""
    import cupy as cp
    from gpu_util import to_f64
    variant(dict(mma="wgmma"))
    cap = 2000
    x = _make(_seed(), 3, 16, 32, 8, 128, "bfloat16", page, cap, lens=[cap] * 3)
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
    assert plan.config.mma == "wgmma" and (plan.config.cluster_merge == 2) == (splits == 2), plan.config
    rng = np.random.default_rng(_seed())
    for step in range(3):
        x.lens_h = rng.integers(0, cap, size=3).astype(np.int32)
        x.lens_h[step] = [0, 1, cap][step]
        x.lens.set(x.lens_h)
        if page:
            for b in range(3):
                used = -(-cap // page)
                x.table_h[b, :used] = rng.permutation(x.table_h[b, :used])
            x.table.set(x.table_h)
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        _check(x, out, lse, True, None, f"wgmma graph replay {step} page={page} lens {x.lens_h.tolist()}")
        eager, _ = _call(x, num_splits=splits, return_lse=True)
        cp.cuda.Device().synchronize()
        assert np.array_equal(to_f64(eager, "bfloat16"), to_f64(out, "bfloat16")), f"replay {step} != eager"


@pytest.mark.gpu
@pytest.mark.parametrize("sq,fields", [
    (1, {}), (8, {}), (16, {}), (16, dict(mma="wgmma")), (4, dict(warp_split="rows", kv_heads=4)),
], ids=("keys16", "keys32", "rows", "rows-wgmma", "rows-4heads"))
@pytest.mark.parametrize("scale", [1.0, 8.0], ids=("randn", "peaked"))
def test_gpu_lazy_rescale_against_float64_reference(variant, sq, fields, scale):
    """The rescale skipped in tiles where no row's running maximum moved: exact by construction,
    checked where maxima move often (softmax_scale 8 / sqrt(d): peaked scores) and rarely, with
    splits and appends."""
    import cupy as cp
    from gpu_util import poison
    variant(dict(lazy_rescale=True, **fields))
    sm_scale = scale / np.sqrt(128)
    for page, splits in ((None, None), (16, 3)):
        x = _make(_seed(), 4, sq, 32, 8, 128, "bfloat16", page, 1500, seqlen_new=sq)
        out = poison(cp.empty(x.q.shape, x.q.dtype))
        o, lse = _call(x, out=out, return_lse=True, num_splits=splits, softmax_scale=sm_scale)
        cp.cuda.Device().synchronize()
        _check(x, o, lse, True, sm_scale, f"lazy rescale sq={sq} {fields} scale={scale} page={page}")
        cfg = _plan_of(x, splits).config
        assert cfg.lazy_rescale and all(getattr(cfg, f) == v for f, v in fields.items()), cfg

