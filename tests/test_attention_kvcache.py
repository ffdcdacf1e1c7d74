"""attention_kvcache / attention_decode: config, heuristics, checks, references and compile (CPU);
correctness against a float64 reference, graph capture and bad inputs (GPU, ``-m gpu``).

CPU tests compile a handful of configs only (CI runs on two cores); the slow-marked sweep
compiles every head dim.  GPU tests follow FlashAttention's rule per sequence: the kernel's error
against the float64 reference is at most twice the error of the same reference computed with
scores, probabilities and output rounded to the input dtype; outputs are poisoned (NaN) first.
"""
from __future__ import annotations

import importlib
import math
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels import inspect as rtk_inspect
from rtkernels.errors import ConfigError
from rtkernels.ops.attention_kvcache import (ARGS_DTYPE, DECODE_ARGS, DECODE_PTRS, HEURISTICS, MAX_SPLITS,
                                             MIN_KEYS_PER_SPLIT, PTRS_DTYPE, AttentionDecodeConfig,
                                             attention_kvcache, attention_kvcache_reference, check,
                                             check_kvcache_inputs, choose_config, choose_num_splits,
                                             combine_reference, max_rows, rows_for)

kv_mod = importlib.import_module("rtkernels.ops.attention_kvcache")


# ---- config ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(head_dim=7), dict(head_dim=264), dict(dtype="float32"), dict(rows=8), dict(rows=128),
    dict(rows=32, head_dim=256), dict(block_n=24), dict(block_n=128), dict(num_warps=3), dict(num_stages=1),
    dict(num_stages=7), dict(paged="yes"), dict(q_in_regs="no"), dict(warp_split="heads"), dict(kv_heads=2),
    dict(kv_heads=3, warp_split="rows"), dict(num_warps=4, warp_split="rows", kv_heads=8, rows=16),
    dict(rows=16, warp_split="rows", num_warps=4, kv_heads=2), dict(num_warps=9, warp_split="rows", rows=144),
    dict(schedule="persistent"), dict(schedule="streamk", warp_split="rows", rows=64, num_warps=4),
    dict(group_merge=4, schedule="streamk"), dict(group_merge=3, warp_split="rows", rows=64, num_warps=4),
    dict(group_merge=8, warp_split="rows", rows=64, num_warps=4, head_dim=64),
])
def test_config_rejects(bad):
    with pytest.raises(ConfigError) as e:
        AttentionDecodeConfig(**bad)
    assert "attention_decode" in str(e.value) and next(iter(bad)) in str(e.value)


def test_config_smem_matches_the_template_layout():
    c = AttentionDecodeConfig(dtype="bf16", head_dim=128, rows=16, block_n=16, num_warps=4, num_stages=3)
    # Q 16 rows x 136 + 4 warps x 3 stages x 16 keys x (136 + 136), in 16-bit elements
    assert c.shared_mem_bytes == 2 * (16 * 136 + 4 * 3 * 16 * 272)
    c = AttentionDecodeConfig(head_dim=64, rows=64, block_n=16, num_warps=4, num_stages=3)
    # the merge (4 warps x 64 rows x 72 floats + statistics) is larger than the ring here
    assert c.shared_mem_bytes == 4 * (4 * 64 * 72 + 2 * 4 * 64 + 2 * 64)
    assert c.bytes_in_flight == 4 * 2 * 16 * 2 * 64 * 2
    # rows mode: no Q tile with q_in_regs; 3 stages x 8 kv heads x 16 keys x (K 136 + V 136)
    c = AttentionDecodeConfig(head_dim=128, warp_split="rows", kv_heads=8, num_warps=8, rows=16, block_n=16)
    assert c.shared_mem_bytes == 2 * 3 * 8 * 16 * 272 and c.bytes_in_flight == 8 * 2 * 16 * 2 * 128 * 2
    # ... and with Q in shared memory: kv_heads x rows rows of Q (d256: 264 elements per row)
    c = AttentionDecodeConfig(head_dim=256, warp_split="rows", kv_heads=2, num_warps=8, rows=64, block_n=32,
                              num_stages=2, q_in_regs=False)
    assert c.shared_mem_bytes == 2 * (2 * 64 * 264 + 2 * 2 * 32 * (264 + 264))
    assert rtk.families()["attention_decode"] is AttentionDecodeConfig


def _c_struct_fields(source: str, name: str):
    body = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", source, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.match(r"(?:const\s+)?(long long|int\*|int|unsigned|float\*|float|T\*)\s+(.*)", decl)
        ctype, names = m.group(1), [n.strip() for n in m.group(2).split(",")]
        fields += [(n, {"long long": "i8", "int": "i4", "unsigned": "u4", "float": "f4"}.get(ctype, "u8"))
                   for n in names]
    return fields


def test_args_struct_matches_the_template():
    """DecodeArgs / DecodePtrs in the template and DECODE_ARGS / DECODE_PTRS on the host: same
    names, order and types, and NumPy's packed size equals C's (8-byte fields first, an even
    number of 4-byte ones)."""
    from rtkernels.render import template_dir
    src = (template_dir() / "attention_decode.cu.j2").read_text()
    assert _c_struct_fields(src, "DecodeArgs") == list(DECODE_ARGS)
    assert [n for n, _ in _c_struct_fields(src, "DecodePtrs")] == list(DECODE_PTRS)
    assert PTRS_DTYPE.itemsize == 8 * len(DECODE_PTRS)
    c_size = sum(int(t[1]) for _, t in DECODE_ARGS)
    assert ARGS_DTYPE.itemsize == c_size and c_size % 8 == 0
    assert sum(t in ("i4", "u4", "f4") for _, t in DECODE_ARGS) % 2 == 0


def test_page_divisor_divides_every_key():
    """The kernels' key // page_size without a division: (umulhi(key, magic) + key) >> shift."""
    keys = np.concatenate([np.arange(1 << 16), np.random.default_rng(0).integers(0, 2 ** 31 - 2 ** 16, 1 << 16),
                           np.arange(2 ** 31 - 2 ** 16 - 4096, 2 ** 31 - 2 ** 16)]).astype(np.uint64)
    for ps in list(range(16, 4097, 16)) + [2 ** 20, 2 ** 31 - 2 ** 16 - 16]:
        magic, shift = kv_mod.page_divisor(ps)
        assert 0 < magic < 2 ** 32
        q = (((keys * np.uint64(magic)) >> np.uint64(32)) + keys) >> np.uint64(shift)
        assert np.array_equal(q, keys // np.uint64(ps)), ps


def test_template_renders_constexpr_block():
    from rtkernels.render import render
    cfg = AttentionDecodeConfig(dtype="bfloat16", head_dim=80, rows=48, block_n=16, paged=True, causal=True)
    src = render(cfg.template, cfg.template_params(), family="attention_decode").source
    for line in ("using T = __nv_bfloat16;", "constexpr int HEAD_DIM = 80;", "constexpr int ROWS = 48;",
                 "constexpr bool PAGED = true;", "constexpr bool IS_CAUSAL = true;",
                 "constexpr bool ROWS_MODE = false;", "constexpr int KV_HEADS = 1;",
                 f"constexpr int SMEM_BYTES = {cfg.shared_mem_bytes};",
                 f"constexpr int ARGS_BYTES = {ARGS_DTYPE.itemsize};"):
        assert line in src
    assert src.count('extern "C" __global__') == 3 and "{{" not in src


# ---- heuristics ---------------------------------------------------------------------------------
def test_rows_and_tiles_cover_every_head_dim_and_fit():
    from rtkernels import arch
    for d in range(8, 257, 8):
        assert max_rows(d) * d <= 4096 or max_rows(d) == 16
        assert rows_for(1, d) == 16 and rows_for(8, d) == 16 and rows_for(10_000, d) == max_rows(d)
        for a in ("sm_80", "sm_86", "sm_89", "sm_90"):
            for rows_total in (1, 8, 32, 128):
                for kw in (dict(), dict(warp_split="keys"), dict(warp_split="rows", nheads_kv=8)):
                    cfg = choose_config("float16", d, rows_total, True, True, a, **kw)
                    assert cfg.shared_mem_bytes <= arch.limits(a).max_smem_per_block_optin
                    warp_rows = 16 if cfg.warp_split == "rows" else cfg.rows
                    assert warp_rows * cfg.block_n <= 1024 or cfg.block_n == 16   # S in <= 32 registers
                    assert cfg.warp_split == kw.get("warp_split", "rows" if rows_total > kv_mod.ROWS_MODE_ABOVE else "keys")
                    if cfg.warp_split == "rows" and cfg.loader == "cp.async":   # the no-spill budget of the
                        iters = -(-cfg.kv_heads * cfg.block_n * (d // 8) // cfg.threads_per_block)   # CTA-wide copy
                        assert cfg.num_warps >= kv_mod.ROWS_MODE_MIN_WARPS and iters <= kv_mod.MAX_LOAD_ITERS, cfg
                    elif cfg.warp_split == "rows":   # TMA: one producer thread, a stage of slack
                        assert cfg.num_warps >= kv_mod.ROWS_MODE_MIN_WARPS and cfg.num_stages >= 3, cfg
    # rows mode: 16 rows per warp, up to 8 warps; decoding packs up to 8 kv heads (dividing nheads_kv)
    assert choose_config("bfloat16", 128, 64, False, True, "sm_90", warp_split="rows").num_warps == 4
    assert choose_config("bfloat16", 128, 300, False, True, "sm_90", warp_split="rows").rows == 128
    for nkv, kv in ((8, 8), (12, 4), (6, 2), (5, 1), (32, 8)):
        assert choose_config("bfloat16", 128, 4, False, False, "sm_90", nheads_kv=nkv, warp_split="rows").kv_heads == kv
    assert rows_for(4 * 8, 128) == 32 and rows_for(16 * 8, 128) == 32 and rows_for(3 * 16, 64) == 48
    for lo, hi, tiles in HEURISTICS:
        assert lo % 8 == 0 and hi % 8 == 0 and tiles and all(t.why for t in tiles)
    # decode at d128 keeps >= 48 KB in flight per CTA on sm_90 (Little's law: ~25-36 KB per SM)
    assert choose_config("bfloat16", 128, 8, False, False, "sm_90").bytes_in_flight >= 48 * 1024


def test_num_splits_heuristic():
    sms = 132
    # a grid of >= one CTA per SM: no split (H200: B64 S2k 512 CTAs 93.1% unsplit vs 86.8% at 2)
    assert choose_num_splits(132, 1 << 20, sms) == 1
    assert choose_num_splits(1024, 1024, sms) == 1
    # fewer CTAs than SMs: fill every SM once (H200: B8 S8k, 64 CTAs, 51.5% unsplit, 86.1% at 2 splits,
    # 84.0% at 4 = both resident slots)
    assert choose_num_splits(64, 8192, sms) == 2
    assert choose_num_splits(64, 8192, sms, ctas_per_sm=2) == 4
    assert choose_num_splits(100, 8192, sms, ctas_per_sm=2) == 2
    assert choose_num_splits(8, 32768, sms) == 16
    assert choose_num_splits(8, 32768, sms, ctas_per_sm=2) == 33
    assert choose_num_splits(128, 8192, sms, ctas_per_sm=1) == 1   # one CTA per SM already (8-warp tiles)
    # paged: two CTAs per SM whatever the occupancy (block-table reads)
    assert choose_num_splits(64, 8192, sms, paged=True, ctas_per_sm=1) == 4
    assert choose_num_splits(132, 8192, sms, paged=True) == 2
    # short caches: no split shorter than MIN_KEYS_PER_SPLIT keys
    assert choose_num_splits(8, 1024, sms) == 1024 // MIN_KEYS_PER_SPLIT
    assert choose_num_splits(1, 100, sms) == 1
    # at most MAX_SPLITS, never more CTAs than resident slots, and below one CTA per SM every slot filled
    assert choose_num_splits(1, 1 << 24, sms) == MAX_SPLITS
    for per_sm in (1, 2, 3):
        for ctas in range(1, 300):
            s = choose_num_splits(ctas, 1 << 20, sms, ctas_per_sm=per_sm)
            assert 1 <= s <= MAX_SPLITS and (s == 1 or ctas * s <= per_sm * sms)
            assert ctas >= sms or s == MAX_SPLITS or ctas * (s + 1) > per_sm * sms, (ctas, per_sm, s)   # filled
    # lean memory (H100), keys mode: split until the grid keeps LEAN_GRID_BYTES_IN_FLIGHT requested
    # (H100 2026-11-27: B1 S32k d128 87.5% of copy at 8 splits, 85.5 at 16; B8 S8k 99.3 unsplit, 94.1 at 2;
    # d64 16/16 B1 S32k 86.1 at 8, 67.7 at 4)
    d128 = choose_config("bfloat16", 128, 4, False, False, "sm_90", lean_memory=True).bytes_in_flight
    d64 = choose_config("bfloat16", 64, 1, False, False, "sm_90", lean_memory=True).bytes_in_flight
    assert (d128, d64) == (64 << 10, 32 << 10)
    lean_splits = [choose_num_splits(c, 32768, sms, cta_bytes_in_flight=d128) for c in (8, 16, 32, 64, 128)]
    assert lean_splits == [8, 4, 2, 1, 1]
    assert choose_num_splits(16, 32768, sms, cta_bytes_in_flight=d64) == 8
    assert choose_num_splits(8, 32768, sms, cta_bytes_in_flight=1) == 16      # never past the slots
    assert choose_num_splits(8, 1024, sms, cta_bytes_in_flight=d128) == 1024 // MIN_KEYS_PER_SPLIT
    assert choose_num_splits(64, 8192, sms, paged=True, cta_bytes_in_flight=d128) == 4   # PAGED_FILL first
    for ctas in range(1, 300):
        s = choose_num_splits(ctas, 1 << 20, sms, cta_bytes_in_flight=d128)
        assert s == 1 or (ctas * s * d128 <= kv_mod.LEAN_GRID_BYTES_IN_FLIGHT and ctas * s <= sms), (ctas, s)
    # the old rule (the A/B baseline): no split from 0.45 CTA per SM
    assert kv_mod._old_num_splits(64, 8192, sms, False, 1) == 1
    assert kv_mod._old_num_splits(8, 32768, sms, False, 1) == 16
    # compute-heavy CTAs (>= HEAVY_ROWS query rows per kv head): heavy_fill per SM (the op: one above
    # d64, two at d <= 64 - compute_fill), >= 16 x rows keys per split
    heavy = kv_mod.HEAVY_ROWS
    lean = dict(lean=True)
    assert [kv_mod.compute_fill(d, **lean) for d in (128, 96, 64)] == [1, 1, 2]
    assert kv_mod.compute_fill(128, paged=True, **lean) == 2 and kv_mod.compute_fill(128) == 2   # paged, unknown memory
    # deep memory, the wgmma rows mode: four per SM at d <= 64, contiguous or paged
    assert [kv_mod.compute_fill(d, wgmma=True) for d in (128, 96, 64, 32)] == [2, 2, 4, 4]
    assert kv_mod.compute_fill(64, paged=True, wgmma=True) == 4 and kv_mod.compute_fill(96, paged=True, wgmma=True) == 2
    assert kv_mod.compute_fill(64, wgmma=True, **lean) == 2
    assert kv_mod.compute_fill(64) == 2   # mma.sync rows mode / keys mode
    # lean memory, wgmma rows mode: two below d112 (COMPUTE_FILL_LEAN_WGMMA_HEAD_DIM), one from d112 and
    # for grids with a CTA for every SM unsplit
    assert [kv_mod.compute_fill(d, wgmma=True, **lean) for d in (128, 112, 104, 96, 72, 64)] == [1, 1, 2, 2, 2, 2]
    assert kv_mod.compute_fill(96, wgmma=True, full_wave=True, **lean) == 1
    assert kv_mod.compute_fill(96, paged=True, wgmma=True, **lean) == 2
    assert choose_num_splits(64, 8192, sms, rows=64, heavy_fill=1) == 2   # B8 S8k 32/8 d128, seqlen_q 16: 128 CTAs
    assert choose_num_splits(64, 8192, sms, rows=64) == 4          # two per SM (the default): 256 CTAs
    assert choose_num_splits(128, 8192, sms, rows=64, heavy_fill=1) == 1  # B16 S4k: one CTA per SM already
    assert choose_num_splits(8, 32768, sms, rows=64, heavy_fill=1) == 16  # B1 S32k
    assert choose_num_splits(150, 8192, sms, rows=heavy - 1) == 1  # below: the decode rule (>= 1 CTA per SM)
    assert choose_num_splits(150, 8192, sms, rows=64, heavy_fill=1) == 1
    assert choose_num_splits(264, 8192, sms, rows=64) == 1
    assert choose_num_splits(8, 2048, sms, rows=128) == 2048 // (kv_mod.HEAVY_KEYS_PER_ROW * 128)
    for fill in (1, 2):
        for ctas in range(1, 300):
            s = choose_num_splits(ctas, 1 << 20, sms, rows=64, heavy_fill=fill)
            assert 1 <= s <= MAX_SPLITS and (s == 1 or ctas * s <= fill * sms), (fill, ctas, s)


def _decode_problem(b, sq, h, hkv, d, cap):
    """A contiguous bf16 problem as check() reports it (no arrays)."""
    q = (sq * h * d, h * d, d, 1)
    k = (cap * hkv * d, hkv * d, d, 1)
    return kv_mod.Problem("bfloat16", 0, b, sq, h, hkv, d, False, cap, 0, 0, 0, d ** -0.5,
                          {"q": q, "k_cache": k, "v_cache": k, "out": q, "cache_seqlens": (1,)}, (b, cap, hkv, d))


@pytest.mark.parametrize("d,splits,variant,one_trip", [
    (128, 16, None, True),                  # B1 S32k's 16 splits: one batch of 16 loads
    (64, 4, {"cluster": "off"}, True),      # d64: 4 loads in flight
    (64, 8, {"cluster": "off"}, False),     # past them: the unit merge
    (128, 16, {"merge": "units"}, False),   # the bench's baseline
])
def test_keys_mode_last_cta_merges_in_one_trip(d, splits, variant, one_trip):
    """The keys mode's last CTA merges with the group merge's loads (kv_mod._keys_merge) while
    the splits fit one batch; the kernel that does it compiles without spills.  (2-8 splits merge
    in a cluster by default: cluster:off is the last CTA's merge.)"""
    plan = kv_mod.make_plan(_decode_problem(1, 1, 32, 8, d, 32768), causal=False, return_lse=False,
                            num_splits=splits, torch=False, out_dtype="bfloat16", f32=None, arch="sm_90", sms=132,
                            variant=variant)
    cfg = plan.config
    assert cfg.warp_split == "keys" and plan.fused and plan.combine is None and not plan.split.cooperative
    assert (cfg.group_merge > 0) == one_trip, cfg
    assert cfg.group_merge in (0, kv_mod.group_merge_batch(splits, d))
    assert int(plan.split.tail[0]["fused"]) == (3 if variant and "merge" in variant else 1)
    assert cfg.merges == ("group" if one_trip else "units")   # the one merge it launches (merges_for)
    res = plan.split.kernel.resources
    assert res.spill_stores == 0 and res.spill_loads == 0
    # the counters release / acquire from thread 0 (rtk::last_block_to_arrive): no fence.sc per thread
    assert "MEMBAR.SC.GPU" not in plan.split.kernel.sass and "ATOMG.E.ADD.S32.STRONG.GPU" in plan.split.kernel.sass


def _rows_problem(b, sq, d, cap, paged=False):
    """A bf16 problem of 32 / 8 heads as check() reports it (page 16 when paged)."""
    p = _decode_problem(b, sq, 32, 8, d, cap)
    if not paged:
        return p
    nb = b * cap // 16
    k = (16 * 8 * d, 8 * d, d, 1)
    return p._replace(paged=True, page_size=16, num_blocks=nb, cache_shape=(nb, 16, 8, d),
                      strides={**p.strides, "k_cache": k, "v_cache": k, "block_table": (cap // 16, 1)})


@pytest.mark.parametrize("b,sq,d,cap,paged,splits,variant,merges,code", [
    (64, 1, 128, 2048, False, None, None, "none", 0),            # one split: o written directly
    (1, 1, 128, 32768, False, 16, {"cluster": "off"}, "group", 1),  # keys: the merge in one round trip
    (1, 1, 64, 32768, False, 8, {"cluster": "off"}, "units", 1),  # ... past its loads: the unit merge
    (1, 1, 128, 32768, False, 16, {"merge": "serial"}, "serial", 2),
    (8, 16, 128, 8192, False, 2, {"cluster": "off"}, "regs2", 1),  # rows: the register merge of 2 splits
    (8, 16, 128, 8192, False, 3, {"cluster": "off", "combine": "fused"}, "regs3", 1),
    (8, 16, 128, 8192, False, 8, {"cluster": "off", "combine": "fused"}, "units", 1),
    (8, 16, 128, 8192, False, 8, {"cluster": "off", "combine": "kernel"}, "none", 0),   # the combine launch
    (1, 16, 128, 32768, True, 16, None, "coop", 4),               # the group merge (cooperative), one batch
    (1, 16, 64, 32768, True, 8, {"combine": "group"}, "none", 4),  # ... past d64's batch of 4: its loop
    (1, 1, 128, 32768, False, 4, None, "none", 5),                # the cluster merge
])
def test_plans_compile_only_the_merge_they_launch(b, sq, d, cap, paged, splits, variant, merges, code):
    """A plan's split kernel holds the one in-kernel merge its DecodeArgs.fused selects
    (merges_for), the template emits that one alone, and each entry point is its own module (the
    combine kernel only where a plan launches it)."""
    plan = kv_mod.make_plan(_rows_problem(b, sq, d, cap, paged), causal=sq > 1, return_lse=False,
                            num_splits=splits, torch=False, out_dtype="bfloat16", f32=None, arch="sm_90", sms=132,
                            variant=variant)
    cfg = plan.config
    assert (cfg.merges, int(plan.split.tail[0]["fused"])) == (merges, code), cfg
    src = plan.split.kernel.source
    assert "attention_decode_combine(" not in src and "attention_decode_append(" not in src
    assert ("serial_merge(p, a, w" in src) == (merges == "serial")
    assert ("// weights: a group of G lanes per row" in src) == (merges == "units")
    assert ("group_barrier_wait(counters" in src) == (code == 4)   # the cooperative group merge
    assert ("GM_SB, true>(p, a, 0, 1" in src) == (merges == "group")   # the keys mode's last CTA, one batch
    assert ("GM_SB, true>(p, a, split" in src) == (merges == "coop")   # the cooperative merge, one batch
    assert re.findall(r"register_merge<(\d)>\(p, a", src) == ([merges[4:]] if merges.startswith("regs") else [])
    assert (plan.combine is not None) == (merges == "none" and code == 0 and plan.num_splits > 1)
    if plan.combine is not None:
        assert "extern \"C\" __global__ void __launch_bounds__(COMBINE_THREADS)" in plan.combine.kernel.source
        assert "attention_decode(" not in plan.combine.kernel.source


def test_every_merge_in_one_kernel_outside_plans():
    """A config built by name (rtk.compile, rtk report) keeps every merge behind its runtime
    switch; a register merge outside the rows mode, or an unknown value, is refused."""
    cfg = choose_config("bfloat16", 128, 64, False, True, "sm_90")
    assert cfg.merges == "all" and cfg.reg_merge_splits == (2, 3, 4)
    from rtkernels.render import render
    src = render(cfg.template, cfg.template_params(), family=cfg.family).source
    assert re.findall(r"register_merge<(\d)>\(p, a", src) == ["2", "3", "4"]
    assert "serial_merge(p, a, w" in src and "attention_decode_combine(" in src   # (no entry: all three)
    with pytest.raises(ConfigError, match="merges.*rows mode"):
        choose_config("bfloat16", 128, 4, False, False, "sm_90").replace(merges="regs2")
    with pytest.raises(ConfigError, match="merges"):
        cfg.replace(merges="regs5")


@pytest.mark.parametrize("cfg_kw,merges", [
    (dict(d=64, rows=64, paged=True, group_merge=4), "none"),   # the d64 group merge: 130 registers unbounded
    (dict(d=64, rows=64, paged=True, group_merge=4), "coop"),
    (dict(d=128, rows=64, paged=True, group_merge=16), "coop"),
    (dict(d=128, rows=8, paged=True), "units"),
    (dict(d=128, rows=64, paged=False), "regs2"),
])
def test_specialized_merges_compile_clean_at_the_same_occupancy(cfg_kw, merges):
    """ptxas allocates each build anew: a kernel with one merge has no spill and at least the CTAs
    per SM of the same config with every merge (the d64 warpgroup kernels ask for four; see
    MIN_CTAS in the template)."""
    kw = dict(cfg_kw)
    cfg = choose_config("bfloat16", kw.pop("d"), kw.pop("rows"), kw.pop("paged"), True, "sm_90")
    cfg = cfg.replace(**kw)
    one = rtk.get_kernel(cfg.replace(merges=merges), "attention_decode", arch="sm_90")
    every = rtk.get_kernel(cfg, "attention_decode", arch="sm_90")
    r = one.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), r
    assert kv_mod._ctas_per_sm(cfg, one, "sm_90") >= kv_mod._ctas_per_sm(cfg, every, "sm_90")


# ---- references -----------------------------------------------------------------------------------
def _dense(q, k, v, scale, visible):
    s = scale * q @ k.T
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    return p @ v / p.sum(axis=1, keepdims=True), (m + np.log(p.sum(axis=1, keepdims=True)))[:, 0]


def test_reference_paged_equals_contiguous_with_append_and_gqa():
    rng = np.random.default_rng(0)
    b, sq, h, hkv, d, ps, sn = 3, 5, 8, 2, 16, 16, 3
    lens = np.array([0, 17, 40])
    cap = 48
    q = rng.standard_normal((b, sq, h, d))
    kc = rng.standard_normal((b, cap, hkv, d))
    vc = rng.standard_normal((b, cap, hkv, d))
    kn, vn = rng.standard_normal((b, sn, hkv, d)), rng.standard_normal((b, sn, hkv, d))
    # the same cache as shuffled pages
    nblk = b * cap // ps
    perm = rng.permutation(nblk)
    table = perm.reshape(b, cap // ps).astype(np.int32)
    kp, vp = np.zeros((nblk, ps, hkv, d)), np.zeros((nblk, ps, hkv, d))
    for bi in range(b):
        for j in range(cap // ps):
            kp[table[bi, j]] = kc[bi, j * ps:(j + 1) * ps]
            vp[table[bi, j]] = vc[bi, j * ps:(j + 1) * ps]
    for causal in (False, True):
        o1, l1 = attention_kvcache_reference(q, kc, vc, lens, k_new=kn, v_new=vn, causal=causal)
        o2, l2 = attention_kvcache_reference(q, kp, vp, lens, k_new=kn, v_new=vn, block_table=table, causal=causal)
        np.testing.assert_allclose(o1, o2, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(l1), np.isneginf(l2))
        # against a direct formula: sequence 1, head 5 (kv head 1), bottom-right causal
        keys = np.concatenate([kc[1, :17, 1], kn[1, :, 1]])
        vals = np.concatenate([vc[1, :17, 1], vn[1, :, 1]])
        sk = keys.shape[0]
        vis = np.ones((sq, sk), bool) if not causal else np.arange(sk)[None] <= np.arange(sq)[:, None] + sk - sq
        o_ref, l_ref = _dense(q[1, :, 5], keys, vals, 1 / math.sqrt(d), vis)
        np.testing.assert_allclose(o1[1, :, 5], o_ref, atol=1e-12)
        np.testing.assert_allclose(l1[1, 5], l_ref, atol=1e-12)
    # sequence 0 has only its 3 new keys: causal rows 0 and 1 (5 queries, 3 keys) see none
    o, lse = attention_kvcache_reference(q, kc, vc, lens, k_new=kn, v_new=vn, causal=True)
    assert np.all(o[0, :2] == 0) and np.all(np.isneginf(lse[0, :, :2])) and np.all(np.isfinite(lse[0, :, 2:]))


def test_combine_math_merges_partials_like_the_full_softmax():
    """Partials over key chunks (some empty) merged by combine_reference - the combine kernel's
    math - equal attention over all keys; -inf everywhere gives 0 / -inf; NaN propagates."""
    rng = np.random.default_rng(1)
    sq, d, sk = 4, 32, 100
    q = rng.standard_normal((1, sq, 1, d))
    k, v = rng.standard_normal((1, sk, 1, d)), rng.standard_normal((1, sk, 1, d))
    full_o, full_l = attention_kvcache_reference(q, k, v, np.array([sk]), causal=False)
    cuts = [0, 0, 13, 64, 64, 100, 100]     # empty splits included
    parts_o, parts_l = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        o, lse = attention_kvcache_reference(q, k[:, lo:hi], v[:, lo:hi], np.array([hi - lo]), causal=False)
        if hi == lo:
            o = np.full_like(o, np.nan)     # never written by the kernel: must not be read
        parts_o.append(o[0, :, 0])
        parts_l.append(lse[0, 0])
    o, lse = combine_reference(np.stack(parts_o), np.stack(parts_l))
    np.testing.assert_allclose(o, full_o[0, :, 0], atol=1e-12)
    np.testing.assert_allclose(lse, full_l[0, 0], atol=1e-12)
    o, lse = combine_reference(np.full((3, sq, d), np.nan), np.full((3, sq), -np.inf))
    assert np.all(o == 0) and np.all(np.isneginf(lse))
    bad_l = np.stack(parts_l)
    bad_l[2, 1] = np.nan
    o, lse = combine_reference(np.stack(parts_o), bad_l)
    assert np.all(np.isnan(o[1])) and np.isnan(lse[1]) and np.all(np.isfinite(o[[0, 2, 3]]))


def test_host_content_check_names_the_argument():
    kc = np.zeros((10, 16, 2, 64), np.float16)          # 10 pages of 16
    table = np.array([[3, 1, 99], [0, -1, 5]], np.int32)  # 48 keys capacity
    check_kvcache_inputs(kc, np.array([32, 16], np.int32), table)   # uses pages 3,1 and 0: fine
    with pytest.raises(ConfigError, match=r"block_table\[0, 2\] = 99"):
        check_kvcache_inputs(kc, np.array([33, 0], np.int32), table)
    with pytest.raises(ConfigError, match=r"block_table\[1, 1\] = -1"):
        check_kvcache_inputs(kc, np.array([0, 16], np.int32), table, seqlen_new=1)
    with pytest.raises(ConfigError, match=r"cache_seqlens\[1\] = -2"):
        check_kvcache_inputs(kc, np.array([0, -2], np.int32), table)
    with pytest.raises(ConfigError, match=r"cache_seqlens\[0\] = 47 plus seqlen_new = 2 exceeds"):
        check_kvcache_inputs(kc, np.array([47, 0], np.int32), table, seqlen_new=2)
    contiguous = np.zeros((2, 100, 2, 64), np.float16)
    check_kvcache_inputs(contiguous, np.array([100, 0], np.int32))
    with pytest.raises(ConfigError, match="cache_seqlens"):
        check_kvcache_inputs(contiguous, np.array([101, 0], np.int32))


# ---- host checks on array descriptions (no GPU: fakes with shape, strides, dtype, pointer) -------
class Fake:
    """What check() reads from a CuPy view: shape, strides, dtype, itemsize, data.ptr, device.id."""

    def __init__(self, shape, dtype="float16", strides=None, ptr=1 << 20, device=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize, self.ndim, self.size = self.dtype.itemsize, len(self.shape), int(np.prod(self.shape))
        if strides is None:
            strides, acc = [], self.itemsize
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= n
        self.strides = tuple(strides)
        self.data, self.device = SimpleNamespace(ptr=ptr), SimpleNamespace(id=device)


def _views(**change):
    v = dict(q=Fake((2, 1, 8, 64)), k_cache=Fake((2, 100, 2, 64)), v_cache=Fake((2, 100, 2, 64)),
             cache_seqlens=Fake((2,), "int32"))
    v.update(change)
    return {n: a for n, a in v.items() if a is not None}


def test_checks_accept_contiguous_paged_and_append():
    p = check(_views(), None, None, None)
    assert (p.batch, p.seqlen_q, p.nheads, p.nheads_kv, p.capacity, p.paged) == (2, 1, 8, 2, 100, False)
    assert p.softmax_scale == pytest.approx(1 / 8)
    p = check(_views(k_cache=Fake((7, 32, 2, 64)), v_cache=Fake((7, 32, 2, 64)), block_table=Fake((2, 5), "int32"),
                     k_new=Fake((2, 3, 2, 64)), v_new=Fake((2, 3, 2, 64))), None, 0.5, 4)
    assert (p.paged, p.capacity, p.page_size, p.num_blocks, p.seqlen_new) == (True, 160, 32, 7, 3)
    # bfloat16 bits in uint16 arrays with dtype=
    p = check(_views(**{n: Fake(s, "uint16") for n, s in (("q", (2, 1, 8, 64)), ("k_cache", (2, 100, 2, 64)),
                                                          ("v_cache", (2, 100, 2, 64)))}), "bfloat16", None, None)
    assert p.dtype == "bfloat16"
    # a slice of packed qkv: q strides (s*3*h*d, 3*h*d, d, 1)
    qkv = Fake((2, 4, 3, 8, 64))
    q = Fake((2, 4, 8, 64), strides=(qkv.strides[0], qkv.strides[1], qkv.strides[3], 2))
    assert check(_views(q=q), None, None, None).strides["q"] == (4 * 3 * 8 * 64, 3 * 8 * 64, 64, 1)


def test_checks_take_full_caches_without_lengths():
    """cache_seqlens=None: every cache full (what rtk.attention's dense calls with few query rows
    pass); the kernels then read no lengths (cs_stride 0, a null pointer); k_new needs lengths."""
    p = check(_views(cache_seqlens=None), None, None, None)
    assert p.capacity == 100 and p.strides["cache_seqlens"] == (0,) and kv_mod._args(p, None, 1, 1)["cs_stride"] == 0
    p = check(_views(cache_seqlens=None, k_cache=Fake((7, 32, 2, 64)), v_cache=Fake((7, 32, 2, 64)),
                     block_table=Fake((2, 5), "int32")), None, None, None)
    assert p.paged and p.capacity == 160
    with pytest.raises(ConfigError, match="cache_seqlens"):
        check(_views(cache_seqlens=None, k_new=Fake((2, 3, 2, 64)), v_new=Fake((2, 3, 2, 64))), None, None, None)
    # the host content check and the reference read "full" the same way
    kc = np.zeros((10, 16, 2, 64), np.float16)
    check_kvcache_inputs(np.zeros((2, 100, 2, 64), np.float16), None)
    check_kvcache_inputs(kc, None, np.array([[3, 1], [0, 5]], np.int32))
    with pytest.raises(ConfigError, match=r"block_table\[1, 1\] = 10"):
        check_kvcache_inputs(kc, None, np.array([[3, 1], [0, 10]], np.int32))
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3, 4, 8)), rng.standard_normal((2, 20, 2, 8)), rng.standard_normal((2, 20, 2, 8))
    full = attention_kvcache_reference(q, k, v, None)
    same = attention_kvcache_reference(q, k, v, np.array([20, 20], np.int32))
    assert all(np.array_equal(a, b) for a, b in zip(full, same))


def test_args_struct_holds_strides_and_sizes():
    kc = Fake((7, 32, 2, 64))
    views = _views(k_cache=kc, v_cache=Fake((7, 32, 2, 64), strides=(2 * 4096 * 2, 128 * 2, 64 * 2, 2)),
                   block_table=Fake((2, 5), "int32"), cache_seqlens=Fake((2,), "int32", strides=(8,)),
                   k_new=Fake((2, 3, 2, 64)), v_new=Fake((2, 3, 2, 64)))
    p = check(views, None, None, None)
    a = kv_mod._args(p, None, 3, 1)
    assert (a["q_batch"], a["q_seq"], a["q_head"]) == (512, 0, 64)          # seqlen_q 1: stride never used
    assert (a["o_batch"], a["o_seq"], a["o_head"]) == (512, 512, 64)        # no out: the contiguous one made
    assert (a["k_batch"], a["k_seq"], a["k_head"]) == (4096, 128, 64)
    assert (a["v_batch"], a["v_seq"], a["v_head"]) == (8192, 128, 64)
    assert (a["kn_batch"], a["kn_seq"], a["kn_head"]) == (384, 128, 64)
    assert (a["bt_batch"], a["cs_stride"]) == (5, 2)
    assert (a["batch"], a["seqlen_q"], a["nheads_kv"], a["group"], a["seqlen_new"]) == (2, 1, 2, 4, 3)
    assert (a["capacity"], a["num_splits"], a["row_tiles"], a["page_size"], a["num_blocks"]) == (160, 3, 1, 32, 7)
    assert a["softmax_scale"] == np.float32(0.125) and a["scale_log2"] == np.float32(0.125 * math.log2(math.e))
    out = Fake((2, 1, 8, 64), strides=(4096, 4096, 256, 2))
    p = check({**views, "out": out}, None, None, None)
    a = kv_mod._args(p, None, 1, 1)
    assert (a["o_batch"], a["o_seq"], a["o_head"]) == (2048, 0, 128)


@pytest.mark.parametrize("change,words", [
    (dict(q=Fake((2, 1, 8, 64), "float32")), "float32"),
    (dict(k_cache=Fake((2, 100, 2, 64), "float32"), v_cache=Fake((2, 100, 2, 64), "float32")), "k_cache has dtype"),
    (dict(q=Fake((2, 8, 64))), "4-D"),
    (dict(v_cache=Fake((2, 99, 2, 64))), "v_cache must have"),
    (dict(k_cache=Fake((2, 100, 2, 32)), v_cache=Fake((2, 100, 2, 32))), "head_dim"),
    (dict(q=Fake((2, 1, 7, 64))), "multiple of nheads_kv"),
    (dict(q=Fake((2, 1, 8, 60)), k_cache=Fake((2, 100, 2, 60)), v_cache=Fake((2, 100, 2, 60))), "head_dim"),
    (dict(cache_seqlens=Fake((2,), "int64")), "cache_seqlens must be an int32"),
    (dict(cache_seqlens=Fake((3,), "int32")), "cache_seqlens must be an int32"),
    (dict(k_cache=Fake((1, 100, 2, 64)), v_cache=Fake((1, 100, 2, 64))), "row per sequence"),
    (dict(block_table=Fake((2, 4), "int64")), "block_table must be an int32"),
    (dict(block_table=Fake((3, 4), "int32")), "block_table must be an int32"),
    (dict(k_cache=Fake((9, 24, 2, 64)), v_cache=Fake((9, 24, 2, 64)), block_table=Fake((2, 4), "int32")),
     "multiple of 16"),
    (dict(block_table=Fake((2, 4), "int32", strides=(4, 8))), "contiguous"),
    (dict(k_new=Fake((2, 3, 2, 64))), "k_new and v_new"),
    (dict(k_new=Fake((2, 3, 2, 64)), v_new=Fake((2, 4, 2, 64))), "v_new must be"),
    (dict(k_new=Fake((2, 101, 2, 64)), v_new=Fake((2, 101, 2, 64))), "exceeds the cache's capacity"),
    (dict(out=Fake((2, 1, 8, 64), "float32")), "out must be"),
    (dict(out=Fake((2, 2, 8, 64))), "out must be"),
    (dict(q=Fake((2, 1, 8, 64), strides=(2048, 2048, 256, 4))), "contiguous last dimension"),
    (dict(q=Fake((2, 1, 8, 64), ptr=(1 << 20) + 8)), "16-byte aligned"),
    (dict(k_cache=Fake((2, 100, 2, 64), device=1)), "same device"),
])
def test_checks_reject_bad_inputs_naming_the_argument(change, words):
    with pytest.raises(ConfigError, match=words):
        check(_views(**change), None, None, None)


@pytest.mark.parametrize("kw,words", [
    (dict(softmax_scale=-1.0), "softmax_scale"), (dict(softmax_scale=float("inf")), "softmax_scale"),
    (dict(num_splits=MAX_SPLITS + 1), "num_splits"), (dict(num_splits=-1), "num_splits"),
    (dict(num_splits=2.0), "num_splits"),
])
def test_checks_reject_bad_options(kw, words):
    with pytest.raises(ConfigError, match=words):
        check(_views(), None, kw.get("softmax_scale"), kw.get("num_splits"))


def test_uint16_without_dtype_is_rejected():
    with pytest.raises(ConfigError, match="uint16"):
        check(_views(q=Fake((2, 1, 8, 64), "uint16")), None, None, None)


# ---- compile: a handful of heuristic configs (the sweep is the slow test below) ----------------
COMPILE_CASES = [   # (arch, dtype, head_dim, rows_total, paged, causal, choose_config keywords)
    ("sm_90", "bfloat16", 128, 4, False, False, {}),                               # decode: keys
    ("sm_90", "float16", 64, 8, False, True, dict(lean_memory=True)),              # keys, d <= 64: 16-key TMA tiles
    ("sm_90", "bfloat16", 128, 4, True, False, dict(lean_memory=True, num_stages=4)),  # LEAN_PAGED_STAGES
    ("sm_90", "float16", 128, 64, True, True, dict(mma="sync")),                   # rows: 4 warps, 64-key tiles
    ("sm_90", "bfloat16", 64, 16, True, False, dict(warp_split="rows", nheads_kv=8)),  # decode: 8 kv heads per CTA
    ("sm_90", "bfloat16", 80, 4, False, True, dict(warp_split="rows", nheads_kv=4)),   # padded head dim
    ("sm_90", "float16", 256, 128, True, True, {}),                                # rows: Q in shared memory
    ("sm_80", "bfloat16", 128, 8, True, False, {}),
    ("sm_80", "float16", 256, 16, False, True, {}),
    ("sm_90", "bfloat16", 128, 8, True, False, dict(schedule="streamk")),             # stream-K: keys mode
]


def test_l2_evict_first_rides_on_the_tensor_copies_only():
    tma = choose_config("bfloat16", 128, 4, False, False, "sm_90")
    assert tma.loader == "tma" and tma.l2_evict_first == kv_mod.L2_EVICT_FIRST
    assert not choose_config("bfloat16", 128, 4, False, False, "sm_90", l2_evict_first=False).l2_evict_first
    cp = choose_config("bfloat16", 128, 4, False, False, "sm_80")
    assert cp.loader == "cp.async" and not cp.l2_evict_first
    with pytest.raises(ConfigError, match="l2_evict_first.*cp.async"):
        cp.replace(l2_evict_first=True)


def _opcodes(sass):
    return re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)


@pytest.mark.parametrize("arch,dtype,d,rows_total,paged,causal,kw", COMPILE_CASES)
def test_heuristic_configs_compile_clean(arch, dtype, d, rows_total, paged, causal, kw):
    cfg = choose_config(dtype, d, rows_total, paged, causal, arch, **kw)
    main = rtk.get_kernel(cfg, "attention_decode", arch=arch)
    ops = _opcodes(main.sass)
    assert any(o.startswith("HMMA.16816.F32") for o in ops), "mma.sync m16n8k16"
    if cfg.loader == "cp.async":
        assert any(o.startswith("LDGSTS.E.BYPASS.128") for o in ops), "16-byte cp.async.cg"
    else:   # sm_90's default: tensor copies (test_attention_kvcache_tma.py looks closer)
        assert any(o.startswith("UTMALDG.4D") for o in ops), "4-D tensor copies"
        # ... carrying the L2 evict-first policy (attention_kvcache.L2_EVICT_FIRST): a cache-policy operand
        copies = [ln for ln in main.sass.splitlines() if "UTMALDG.4D" in ln]
        assert cfg.l2_evict_first and all("desc[" in ln for ln in copies), copies[:2]
    assert any(o == "LDSM.16.M88.4" for o in ops) and any(o.startswith("LDSM.16.MT88") for o in ops)
    if cfg.warp_split == "keys":
        assert any(o == "STG.E.128" for o in ops), "16-byte output stores"
    else:
        assert any(o.startswith("BAR.SYNC") for o in ops), "rows mode: CTA barriers (cp.async: one per tile)"
    assert any(o.startswith("ATOMG") or o.startswith("RED") for o in ops), "the fused merge's counter"
    for name in cfg.kernels:
        k = rtk.get_kernel(cfg, name, arch=arch)
        r = k.resources
        assert not (r.spill_stores or r.spill_loads or r.stack_frame), f"{name} {cfg}: {r}"
        assert not any(o.startswith(("LDL", "STL")) for o in _opcodes(k.sass)), f"{name}: local memory"
        assert not rtk_inspect.flags(k), rtk_inspect.flags(k)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RTKERNELS_TEST_FULL_SWEEP") != "1",
                    reason="~250 compiles per arch: set RTKERNELS_TEST_FULL_SWEEP=1 (CI compiles COMPILE_CASES only)")
@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
def test_every_heuristic_config_compiles_without_spills(arch):
    """Every config the heuristics can choose (head dims 8..256, rows, paged, causal; bfloat16).
    Spot-checked 2026-11-25 with NVRTC 13.5 (head dims 8..256 in 15 steps on sm_90, 8 on sm_80,
    rows 16 and the largest, paged and not, causal and not): no spills; the tightest are d128 at
    32 rows and d56 at 64 rows, 231-246 registers.  Rows mode, paged + causal (the most
    registers), 2026-11-25: 23 head dims on sm_90 and 2 on sm_80, 128 configs, no spill; the
    tightest d248 at 64 rows (244 registers)."""
    from concurrent.futures import ThreadPoolExecutor
    cfgs = kv_mod.heuristic_configs(arch, dtypes=("bfloat16",))

    def build(cfg):
        return cfg, [rtk.get_kernel(cfg, n, arch=arch).resources for n in cfg.kernels]

    with ThreadPoolExecutor(2) as ex:
        bad = [(c, rs) for c, rs in ex.map(build, cfgs) if any(r.spill_stores or r.stack_frame for r in rs)]
    assert not bad, bad


def test_compile_by_name_fills_tiles_from_the_heuristics():
    k = rtk.compile("attention_decode", head_dim=128, dtype="bfloat16", paged=True, arch="sm_90")
    assert k.config == choose_config("bfloat16", 128, 16, True, False, "sm_90")


# ==== GPU =======================================================================================
DTYPES = ("float16", "bfloat16")


def _arr(rng, shape, dtype, scale=1.0):
    from gpu_util import random_array
    return random_array(rng, shape, dtype, scale)


def _make(seed, batch, sq, h, hkv, d, dtype, page_size=None, capacity=600, seqlen_new=0, lens=None,
          q_from_qkv=False, hnd=False):
    """Inputs on the device and their float64 host copies.  Paged caches get shuffled pages and
    unused block-table entries that are out of range (they must never be read).  ``hnd``: a
    contiguous cache stored (batch, nheads_kv, capacity, head_dim), passed as its transposed view."""
    import cupy as cp
    rng = np.random.default_rng(seed)
    if lens is None:
        lens = rng.integers(0, capacity - seqlen_new + 1, size=batch)
        lens[: min(batch, 2)] = [0, 1][: min(batch, 2)]     # empty and one-key caches in every batch
    lens = np.asarray(lens, np.int32)
    if q_from_qkv:   # q as a strided slice of a packed (batch, sq, 3, h, d) array
        qkv, qkv_h = _arr(rng, (batch, sq, 3, h, d), dtype)
        q, q_h = qkv[:, :, 1], qkv_h[:, :, 1]
    else:
        q, q_h = _arr(rng, (batch, sq, h, d), dtype)
    if page_size is None and hnd:
        kc, kc_h = (x.transpose(0, 2, 1, 3) for x in _arr(rng, (batch, hkv, capacity, d), dtype))
        vc, vc_h = (x.transpose(0, 2, 1, 3) for x in _arr(rng, (batch, hkv, capacity, d), dtype))
        table = table_h = None
    elif page_size is None:
        kc, kc_h = _arr(rng, (batch, capacity, hkv, d), dtype)
        vc, vc_h = _arr(rng, (batch, capacity, hkv, d), dtype)
        table = table_h = None
    else:
        per_seq = -(-capacity // page_size)
        nblk = batch * per_seq + 3
        kc, kc_h = _arr(rng, (nblk, page_size, hkv, d), dtype)
        vc, vc_h = _arr(rng, (nblk, page_size, hkv, d), dtype)
        table_h = np.full((batch, per_seq + 2), 1 << 30, np.int32)          # spare entries: never read
        ids = rng.permutation(nblk)[: batch * per_seq].reshape(batch, per_seq)
        for b in range(batch):
            used = -(-(int(lens[b]) + seqlen_new) // page_size)
            table_h[b, :used] = ids[b, :used]
        table = cp.asarray(table_h)
    kn = vn = kn_h = vn_h = None
    if seqlen_new:
        kn, kn_h = _arr(rng, (batch, seqlen_new, hkv, d), dtype)
        vn, vn_h = _arr(rng, (batch, seqlen_new, hkv, d), dtype)
    return SimpleNamespace(q=q, kc=kc, vc=vc, lens=cp.asarray(lens), table=table, kn=kn, vn=vn, q_h=q_h, kc_h=kc_h,
                           vc_h=vc_h, lens_h=lens, table_h=table_h, kn_h=kn_h, vn_h=vn_h, dtype=dtype)


def _call(x, out=None, **kw):
    extra = {"dtype": "bfloat16"} if x.dtype == "bfloat16" else {}
    return attention_kvcache(x.q, x.kc, x.vc, x.lens, k_new=x.kn, v_new=x.vn, block_table=x.table, out=out,
                             **extra, **kw)


def _check(x, o, lse, causal=True, softmax_scale=None, what=""):
    """Per sequence: FlashAttention's 2x rule against the float64 reference, exact zeros / -inf
    for rows without keys, lse within 1e-3, no NaN; and the cache holds the appended rows."""
    from gpu_util import to_f64
    ref, lse_ref = attention_kvcache_reference(x.q_h, x.kc_h, x.vc_h, x.lens_h, k_new=x.kn_h, v_new=x.vn_h,
                                               block_table=x.table_h, causal=causal, softmax_scale=softmax_scale)
    low, _ = attention_kvcache_reference(x.q_h, x.kc_h, x.vc_h, x.lens_h, k_new=x.kn_h, v_new=x.vn_h,
                                         block_table=x.table_h, causal=causal, softmax_scale=softmax_scale,
                                         round_to=x.dtype)
    got = to_f64(o, x.dtype)
    floor = 2 ** -11 if x.dtype == "float16" else 2 ** -8
    assert not np.isnan(got).any(), f"{what}: NaN in o at {np.argwhere(np.isnan(got))[:4].tolist()}"
    for b in range(got.shape[0]):
        den = max(np.linalg.norm(ref[b]), 1e-30)
        err, err_low = np.linalg.norm(got[b] - ref[b]) / den, np.linalg.norm(low[b] - ref[b]) / den
        assert err <= 2 * err_low + floor, (f"{what}: sequence {b} (cache_seqlens={int(x.lens_h[b])}): rel err "
                                            f"{err:.3e} vs reference-in-{x.dtype} {err_low:.3e}; max abs err "
                                            f"{np.abs(got[b] - ref[b]).max():.3e}")
        empty = np.isneginf(lse_ref[b])          # (h, sq) rows that see no key
        assert np.all(got[b].transpose(1, 0, 2)[empty] == 0), f"{what}: sequence {b}: rows without keys not 0"
    if lse is not None:
        lse = lse.get() if hasattr(lse, "get") else lse.cpu().numpy()
        assert lse.shape == lse_ref.shape and not np.isnan(lse).any(), f"{what}: lse shape/NaN"
        assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)), f"{what}: -inf rows differ"
        fin = np.isfinite(lse_ref)
        d = np.abs(lse[fin] - lse_ref[fin]) / np.maximum(np.abs(lse_ref[fin]), 1.0)
        assert d.size == 0 or d.max() <= 1e-3, f"{what}: lse rel err {d.max():.2e}"
    if x.kn is not None:   # the append wrote k_new / v_new into the cache, and nothing else
        kc_ref, vc_ref = kv_mod.append_kvcache_reference(x.kc_h, x.vc_h, x.lens_h, x.kn_h, x.vn_h, x.table_h)
        assert np.array_equal(to_f64(x.kc, x.dtype), kc_ref), f"{what}: k_cache after append"
        assert np.array_equal(to_f64(x.vc, x.dtype), vc_ref), f"{what}: v_cache after append"
    assert np.array_equal(x.lens.get(), x.lens_h), "cache_seqlens modified"


def _run(seed, batch, sq, h, hkv, d, dtype, page_size=None, causal=True, seqlen_new=0, capacity=600, lens=None,
         **kw):
    import cupy as cp
    from gpu_util import poison
    x = _make(seed, batch, sq, h, hkv, d, dtype, page_size, capacity, seqlen_new, lens,
              kw.pop("q_from_qkv", False), kw.pop("hnd", False))
    out = poison(cp.empty((batch, sq, h, d), x.q.dtype))
    o, lse = _call(x, out=out, causal=causal, return_lse=True, **kw)
    assert o is out
    cp.cuda.get_current_stream().synchronize()
    what = (f"seed={seed} batch={batch} sq={sq} h={h}/{hkv} d={d} {dtype} page={page_size} causal={causal} "
            f"new={seqlen_new} {kw}")
    print(what)
    _check(x, o, lse, causal, kw.get("softmax_scale"), what)
    return x


def poison_like(a):
    import cupy as cp
    from gpu_util import poison
    return poison(cp.empty(a.shape, a.dtype))


def _seed():
    return int(np.random.SeedSequence().entropy % 2 ** 32)


# (batch, seqlen_q, nheads, nheads_kv, head_dim, dtype, page_size, causal, seqlen_new, capacity)
GPU_CASES = [
    (4, 1, 32, 8, 128, "bfloat16", None, True, 0, 700),      # decode, GQA 4
    (3, 1, 16, 16, 64, "float16", 16, True, 0, 500),         # MHA, page 16
    (5, 1, 16, 2, 128, "bfloat16", 64, True, 1, 900),        # GQA 8, page 64, one appended row
    (2, 1, 16, 1, 256, "float16", 256, True, 0, 1300),       # MQA 16, page 256
    (3, 4, 32, 8, 128, "bfloat16", 16, True, 4, 500),        # speculative: 4 rows x group 4
    (2, 16, 16, 2, 80, "float16", None, True, 16, 400),      # 16 rows x group 8 = 128 rows, d80
    (2, 300, 4, 2, 64, "bfloat16", 64, True, 300, 700),      # chunked prefill: 300 new rows over pages
    (3, 1, 8, 8, 96, "float16", 32, True, 0, 400),
    (2, 2, 12, 4, 192, "bfloat16", None, True, 2, 300),
    (4, 4, 16, 4, 128, "float16", None, False, 0, 600),      # non-causal, several rows
    (2, 1, 4, 4, 256, "bfloat16", 16, True, 1, 1000),
    (3, 16, 32, 8, 128, "bfloat16", 48, True, 2, 1000),     # rows mode (64 rows), page 48: one per chunk
    (3, 1, 32, 8, 128, "float16", 80, True, 1, 1000),       # keys mode, page 80
]


def _default_loader(plan, d):
    """The loader the default heuristics must pick for this plan on this GPU: TMA in both warp
    splits on sm_90+ (RTKERNELS_DECODE_LOADER may switch it off), else cp.async."""
    from rtkernels.ops.attention import _device_arch
    tma = kv_mod.DECODE_LOADER == "tma" and kv_mod.tma_capable(d, _device_arch(0))
    return "tma" if tma else "cp.async"


def _plan_for(x, splits=None):
    arrays = (x.q, x.kc, x.vc, x.lens, x.table, x.kn, x.vn, None)
    return kv_mod._plan(arrays, True, None, True, splits, "bfloat16" if x.dtype == "bfloat16" else None)[0]


# The default loader (TMA on sm_90: keys mode's warp rings, rows mode's producer ring) and the
# cp.async rings forced (sm_80's path, and the fallback for caches no tensor map describes), on
# every case.
LOADERS = [None, dict(loader="cp.async")]
LOADER_IDS = ("default", "cpasync")


@pytest.mark.gpu
@pytest.mark.parametrize("loader", LOADERS, ids=LOADER_IDS)
@pytest.mark.parametrize("batch,sq,h,hkv,d,dtype,page,causal,new,cap", GPU_CASES)
def test_gpu_against_float64_reference(variant, loader, batch, sq, h, hkv, d, dtype, page, causal, new, cap):
    variant(loader)
    x = _run(_seed(), batch, sq, h, hkv, d, dtype, page, causal, new, cap)
    plan = _plan_for(x)
    print(plan.config)
    assert plan.config.loader == (_default_loader(plan, d) if loader is None else "cp.async"), plan.config


@pytest.mark.gpu
@pytest.mark.parametrize("loader", LOADERS, ids=LOADER_IDS)
@pytest.mark.parametrize("d,dtype", [(40, "float16"), (64, "bfloat16"), (72, "float16"), (80, "bfloat16"),
                                     (96, "float16"), (128, "bfloat16"), (192, "float16"), (256, "bfloat16"),
                                     (80, "float16"), (96, "bfloat16")])
def test_gpu_head_dims_decode(variant, loader, d, dtype):
    """Head dims that are not multiples of 64 (TMA: 64-column boxes, the rest zero-filled) or of
    16 (40, 72: a padded K step and an odd 8-column V tile)."""
    variant(loader)
    x = _run(_seed(), 3, 1, 16, 2, d, dtype, 16 if d % 64 else 64, True, 1, 333)
    plan = _plan_for(x)
    assert plan.config.loader == (_default_loader(plan, d) if loader is None else "cp.async"), plan.config


@pytest.mark.gpu
@pytest.mark.parametrize("batch,hkv,d,dtype,page,new", [(40, 8, 128, "bfloat16", None, 1), (20, 16, 64, "float16", None, 0),
                                                       (70, 4, 96, "bfloat16", None, 2), (40, 8, 128, "bfloat16", 16, 1),
                                                       (17, 16, 96, "float16", None, 1), (9, 16, 64, "bfloat16", 64, 0)])
def test_gpu_two_warp_ctas_for_large_unsplit_grids(batch, hkv, d, dtype, page, new):
    """More than one CTA per SM on a contiguous cache runs two warps per CTA (four CTAs per SM;
    attention_kvcache._two_warp_ctas); a paged cache of the same shape keeps four warps.  Ragged
    lengths, an append, poisoned outputs, the float64 reference."""
    from rtkernels.device import sm_count
    from rtkernels.ops.attention import _device_arch
    if not kv_mod.tma_capable(d, _device_arch(0)) or kv_mod.DECODE_LOADER != "tma":
        pytest.skip("the rule applies to the TMA loader (sm_90+)")
    if batch * hkv <= sm_count():
        pytest.skip(f"{batch * hkv} CTAs fit one CTA per SM on this GPU")
    x = _run(_seed(), batch, 1, hkv * 2, hkv, d, dtype, page, True, new, 300)
    plan = _plan_for(x)
    assert plan.config.num_warps == (4 if page else 2), plan.config


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["batch1", "one_kv_head", "batch1_one_kv_head", "broadcast_batch", "reversed"])
def test_gpu_caches_of_any_strides_run_on_the_default_path(case):
    """Size-1 dims (batch 1, one kv head: stride 0 or arbitrary, which the tensor map must not be
    given - the H200 run of 2026-11-26 failed there), a broadcast cache (stride 0 over batch: no
    tensor map, cp.async) and a reversed view (negative stride: cp.async)."""
    import cupy as cp
    batch, hkv = (1 if "batch1" in case else 3), (1 if "one_kv_head" in case else 4)
    x = _make(_seed(), batch, 1, 8, hkv, 128, "bfloat16", None, 700, lens=[699, 1, 350][:batch])
    if case == "broadcast_batch":   # every sequence reads sequence 0's cache
        x.kc, x.vc = (cp.broadcast_to(c[:1], c.shape) for c in (x.kc, x.vc))
        x.kc_h, x.vc_h = (np.broadcast_to(c[:1], c.shape) for c in (x.kc_h, x.vc_h))
    if case == "reversed":   # the keys in reverse order in memory
        x.kc, x.vc, x.kc_h, x.vc_h = (c[:, ::-1] for c in (x.kc, x.vc, x.kc_h, x.vc_h))
    for splits in (None, 1, 5):
        out = poison_like(x.q)
        o, lse = _call(x, out=out, return_lse=True, num_splits=splits)
        cp.cuda.Device().synchronize()
        _check(x, o, lse, True, None, f"{case} splits={splits}")
    plan = _plan_for(x)
    want = "cp.async" if case in ("broadcast_batch", "reversed") else _default_loader(plan, 128)
    assert plan.config.loader == want, (case, plan.config)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, 17, MAX_SPLITS])
def test_gpu_forced_splits_agree(num_splits):
    # one long and several short sequences; more splits than some sequences have tiles
    _run(_seed(), 3, 2, 16, 4, 128, "bfloat16", 64, True, 0, 3000, lens=[2999, 5, 0], num_splits=num_splits)


@pytest.mark.gpu
def test_gpu_long_sequence_uses_the_combine_path():
    x = _run(_seed(), 1, 1, 32, 8, 128, "bfloat16", None, True, 0, 20000, lens=[19999])
    plan, _ = kv_mod._plan((x.q, x.kc, x.vc, x.lens, None, None, None, None), True, None, False, None, "bfloat16")
    assert plan.num_splits > 1 and (plan.fused or plan.combine is not None), plan


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 32])
def test_gpu_full_caches_without_lengths(page):
    """cache_seqlens=None reads every cache whole: the same o and lse, bit for bit, as lengths
    equal to the capacity (contiguous, and paged with every page of a row used)."""
    import cupy as cp
    x = _make(_seed(), 3, 4, 16, 4, 128, "bfloat16", page, 320, lens=[320, 320, 320])
    if page is not None:   # no spare block-table entries: a full cache uses every page of its row
        x.table, x.table_h = x.table[:, :320 // page], x.table_h[:, :320 // page]
    o_full, lse_full = attention_kvcache(x.q, x.kc, x.vc, None, block_table=x.table, dtype="bfloat16",
                                         return_lse=True, out=poison_like(x.q))
    o_lens, lse_lens = _call(x, out=poison_like(x.q), return_lse=True)
    cp.cuda.Device().synchronize()
    assert cp.array_equal(o_full, o_lens) and cp.array_equal(lse_full, lse_lens)
    _check(x, o_full, lse_full, True, None, f"full caches page={page}")


# rtk.attention's dense calls with few query rows run on this kernel (attention.decode_route):
# (batch, seqlen_q, nheads, nheads_kv, head_dim, seqlen_k, causal, dtype, layout)
ROUTE_CASES = [   # (K/V of >= 16 MiB: below it calls stay dense)
    (3, 1, 32, 8, 128, 1400, True, "bfloat16", "bshd"),     # decode, GQA 4
    (2, 4, 16, 2, 64, 17000, True, "float16", "bhsd"),      # speculative rows, HF's (b, h, s, d) storage
    (2, 16, 8, 2, 80, 14000, False, "bfloat16", "bshd"),    # 64 rows per kv head, not causal
    (1, 16, 16, 16, 96, 2817, True, "float16", "bhsd"),     # MHA on a small grid, odd key count
    (1, 100, 16, 2, 128, 16500, True, "bfloat16", "bshd"),  # long keys, a small dense grid
    (2, 20, 24, 4, 96, 11000, True, "float16", "bhsd"),     # GQA 6 x seqlen_q 20: 120 rows per kv head
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,h,hkv,d,sk,causal,dtype,layout", ROUTE_CASES)
def test_gpu_dense_attention_routes_to_decode(monkeypatch, batch, sq, h, hkv, d, sk, causal, dtype, layout):
    """rtk.attention on few query rows runs the decode kernel over the whole k / v (a DecodeRoute
    plan): o and lse against the float64 reference by the 2x rule, the backward from its lse as
    accurate as from the dense kernel's, and RTKERNELS_ATTENTION_DECODE=0 keeps the dense kernel."""
    import cupy as cp
    from rtkernels.ops import attention as attn_mod
    from rtkernels.ops.attention_bwd import attention_backward_reference
    assert attn_mod.decode_route(batch, sq, sk, h, hkv, d)
    x = _make(_seed(), batch, sq, h, hkv, d, dtype, None, sk, lens=[sk] * batch, hnd=layout == "bhsd")
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    results = {}
    plans = []   # the decode plans made: one, by the first routed call (the route holds it)
    real_plan = kv_mod._plan
    monkeypatch.setattr(kv_mod, "_plan", lambda *a: plans.append(1) or real_plan(*a))
    for route in ("1", "0"):
        monkeypatch.setenv(attn_mod.DECODE_ENV, route)
        attn_mod._FORWARD_PLANS._plans.clear()
        for call in range(2):   # the full path, then the plan's replay
            o, lse = rtk.attention(x.q, x.kc, x.vc, causal=causal, out=poison_like(x.q), **extra)
            cp.cuda.Device().synchronize()
            _check(x, o, lse, causal, None, f"route={route} call={call}")
        assert len(plans) == 1, (route, len(plans))
        routed = [p for p in attn_mod._FORWARD_PLANS._plans.values() if isinstance(p, attn_mod.DecodeRoute)]
        assert bool(routed) == (route == "1"), route
        results[route] = (o, lse)
    rng = np.random.default_rng(_seed())
    do, do_h = _arr(rng, (batch, sq, h, d), dtype)
    ref = attention_backward_reference(do, x.q, x.kc, x.vc, causal, dtype=dtype if dtype == "bfloat16" else None,
                                       compute="float64")
    errs = {}
    for route, (o, lse) in results.items():
        grads = rtk.attention_backward(do, x.q, x.kc, x.vc, o, lse, causal, **extra)
        errs[route] = [float(cp.linalg.norm(cp.asarray(_f32(g, dtype)) - r) / cp.linalg.norm(r))
                       for g, r in zip(grads, ref)]
    for e_route, e_dense, name in zip(errs["1"], errs["0"], ("dq", "dk", "dv")):
        assert e_route <= 1.5 * e_dense + 1e-3, (name, errs)


@pytest.mark.gpu
def test_gpu_dense_attention_routes_to_decode_torch_and_graphs():
    """torch tensors in transformers' layout (k, v views of (batch, kv_heads, seqlen, head_dim)
    storage) on the routed path: against SDPA in float32, and captured in a CUDA graph, replayed
    with new queries (the decode kernel's workspace and launches are graph-safe)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(_seed())
    q = torch.randn(3, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(3, 8, 1800, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
            for _ in range(2))

    def ref(q):
        r = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)),
                                                             enable_gqa=True)
        return r.transpose(1, 2)

    o, lse = rtk.attention(q, k, v, causal=True)
    assert (o - ref(q)).abs().max().item() < 2e-2 and lse.shape == (3, 32, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, _ = rtk.attention(q, k, v, causal=True)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_g, rtk.attention(q, k, v, causal=True)[0])
        assert (o_g - ref(q)).abs().max().item() < 2e-2


def _f32(a, dtype):
    import cupy as cp
    from gpu_util import to_f64
    return cp.asarray(to_f64(a, dtype))


# Variants of the kernel (kv_mod.set_variant: what tools/bench_decode.py --variants times): each
# must agree with the reference wherever the heuristics might pick it.
VARIANTS = [
    dict(warp_split="keys", order="splits", combine="kernel"),
    dict(warp_split="keys", order="heads", combine="fused"),
    dict(warp_split="rows", combine="fused"),
    dict(warp_split="rows", order="splits", combine="kernel"),
    dict(warp_split="rows", kv_heads=2, block_n=32),
    dict(warp_split="rows", kv_heads=1, num_stages=3),
    dict(warp_split="rows", loader="cp.async", kv_heads=2, block_n=32),
    dict(warp_split="rows", loader="cp.async", kv_heads=1, num_stages=2),
]
# (batch, seqlen_q, nheads, nheads_kv, head_dim, dtype, page_size, seqlen_new, capacity, num_splits)
VARIANT_CASES = [
    (4, 1, 32, 8, 128, "bfloat16", None, 0, 900, 5),     # decode GQA 4, 8 kv heads
    (3, 1, 16, 16, 64, "float16", 16, 1, 500, 3),        # MHA d64, paged, append
    (2, 4, 24, 4, 80, "bfloat16", 32, 4, 700, 7),        # speculative 4 rows x group 6, padded head dim
    (2, 1, 8, 2, 256, "float16", 64, 0, 600, None),      # d256: Q in shared memory in rows mode
    (3, 16, 16, 4, 128, "bfloat16", None, 0, 800, 2),    # 64 rows: rows mode's home; keys mode: 2 row tiles
]


@pytest.fixture
def variant():
    yield kv_mod.set_variant
    kv_mod.set_variant(None)


def _plan_of(x, splits=None, lse=True):
    arrays = (x.q, x.kc, x.vc, x.lens, x.table, x.kn, x.vn, None)
    plan, _ = kv_mod._plan(arrays, True, None, lse, splits, "bfloat16" if x.dtype == "bfloat16" else None)
    return plan


def _cluster_merge_against_reference_and(variant, x, on: dict, off: dict, what: str, bitwise) -> None:
    """At 2, 3, 5 and 8 splits: under the variant ``on`` the call merges its splits in a cluster (no
    workspace) and passes the float64 reference with poisoned outputs; under ``off`` (a merge before
    the cluster's) so does the same call, and where ``bitwise(off_plan, splits)`` the two agree bit
    for bit (the same arithmetic in the same split order).  Shared by the keys and rows modes' tests."""
    import cupy as cp
    from gpu_util import poison, to_f64
    for splits in (2, 3, 5, 8):
        results = []
        for fields, cluster in ((on, True), (off, False)):
            variant(fields)
            o, lse = _call(x, out=poison(cp.empty(x.q.shape, x.q.dtype)), return_lse=True, num_splits=splits)
            cp.cuda.Device().synchronize()
            plan = _plan_of(x, splits)
            assert (plan.config.cluster_merge == splits and plan.part_bytes == 0) if cluster \
                else plan.config.cluster_merge == 0, plan.config
            _check(x, o, lse, True, None, f"{what} {'cluster' if cluster else 'other'} merge splits={splits}")
            results.append((o, lse, plan))
        (o, lse, _), (o2, lse2, off_plan) = results
        if bitwise(off_plan, splits):
            assert np.array_equal(to_f64(o, "bfloat16"), to_f64(o2, "bfloat16")), f"{what} splits={splits}: o differs"
            assert np.array_equal(cp.asnumpy(lse), cp.asnumpy(lse2)), f"{what} splits={splits}: lse differs"


def _bad_page_gives_nan_for_that_sequence_only(seqlen_q):
    """Under the variant set by the caller: a page id past the pool in sequence 1's table turns that
    sequence's output and lse into NaN and leaves the others finite."""
    import cupy as cp
    from gpu_util import to_f64
    x = _make(_seed(), 3, seqlen_q, 16, 4, 128, "bfloat16", 16, 4000, lens=[3990, 3990, 3990])
    x.table_h[1, 100] = 1 << 30
    x.table.set(x.table_h)
    o, lse = _call(x, return_lse=True)
    cp.cuda.Device().synchronize()
    got = to_f64(o, "bfloat16")
    assert np.isnan(got[1]).all() and np.isnan(lse.get()[1]).all(), "sequence 1 must be NaN"
    assert not np.isnan(got[[0, 2]]).any() and not np.isnan(lse.get()[[0, 2]]).any(), "others must be finite"


@pytest.mark.gpu
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("batch,sq,h,hkv,d,dtype,page,new,cap,splits", VARIANT_CASES)
def test_gpu_variants_against_float64_reference(variant, v, batch, sq, h, hkv, d, dtype, page, new, cap, splits):
    variant(v)
    x = _run(_seed(), batch, sq, h, hkv, d, dtype, page, True, new, cap, num_splits=splits)
    arrays = (x.q, x.kc, x.vc, x.lens, x.table, x.kn, x.vn, None)
    plan, _ = kv_mod._plan(arrays, True, None, True, splits, "bfloat16" if dtype == "bfloat16" else None)
    print(plan.config, "splits", plan.num_splits, "fused", plan.fused)
    assert plan.config.warp_split == v["warp_split"] and (splits is None or plan.num_splits == splits)
    if splits and splits > 1 and v.get("combine") == "kernel":
        assert plan.combine is not None and not plan.fused


# The fused merge's ways through the partials (templates/attention_decode.cu.j2, after the
# counter): the rows mode's <= REG_MERGE_MAX_SPLITS splits from the last CTA's registers
# (register_merge: one chunk of loads, or several from 3 splits on at d128); else by units - few
# (row, column chunk) units: split groups summed in shared memory; >= 8 splits: a unit at a time,
# splits in batches of 8; fewer splits: 4 units at a time (the last batch partial).  merge="units"
# sends the rows mode's few splits through the units too.  The keys mode's splits that fit one
# batch of group_merge_loads (d > 64: 16, else 4) go through the group merge's loads instead (one
# round trip: _keys_merge), and merge="units" keeps them on the unit merge.
# (batch, seqlen_q, nheads, nheads_kv, head_dim, warp_split, num_splits, lens)
MERGE_CASES = [
    (3, 1, 8, 8, 64, "keys", 9, [700, 0, 1]),        # 1 row x 16 chunks: 4 split groups of 9 splits
    (2, 1, 4, 4, 80, "keys", 3, [650, 33]),          # 20 chunks, 3 splits: 2 split groups
    (1, 1, 32, 8, 128, "keys", 16, [799]),           # B1 decode: 4 rows x 32 chunks = the threads, 16 splits
    (2, 1, 16, 2, 128, "keys", 40, [800, 17]),       # 8 rows, 40 splits (empty ones too): batches of 8
    (2, 3, 16, 4, 128, "keys", 3, [700, 2]),         # 12 rows x 32 chunks: 3 units a thread, causal
    (2, 16, 16, 4, 128, "rows", 5, [800, 300]),      # rows mode, 64 rows x 32 chunks: 16 units a thread
    (2, 4, 24, 4, 96, "keys", 2, [500, 0]),          # 24 rows, d96 (24 chunks)
    (2, 16, 16, 4, 128, "rows", 2, [800, 300]),      # rows mode, 2 splits: registers, one chunk
    (3, 12, 32, 8, 128, "rows", 4, [900, 0, 5]),     # 48 of 64 rows, 4 splits (some without keys): 6 chunks
    (2, 16, 24, 8, 64, "rows", 3, [700, 40]),        # d64, group 3 (48 rows), 3 splits: 2 chunks
]


@pytest.mark.gpu
@pytest.mark.parametrize("merge", [None, "serial", "units"], ids=["merge", "serial", "units"])
@pytest.mark.parametrize("batch,sq,h,hkv,d,split,splits,lens", MERGE_CASES)
def test_gpu_fused_merge_paths(variant, merge, batch, sq, h, hkv, d, split, splits, lens):
    """The fused merge (the last CTA of a group merges the splits' partials) against the float64
    reference on every path of its loads, with empty sequences and splits without keys; lse too."""
    variant(dict(warp_split=split, combine="fused", **({"merge": merge} if merge else {})))
    x = _run(_seed(), batch, sq, h, hkv, d, "bfloat16", None, True, 0, max(lens) + 1, lens=lens,
             num_splits=splits)
    plan, _ = kv_mod._plan((x.q, x.kc, x.vc, x.lens, None, None, None, None), True, None, True, splits, "bfloat16")
    print(plan.config, "splits", plan.num_splits, "fused", plan.fused)
    assert plan.fused and plan.num_splits == splits and plan.config.warp_split == split, plan
    one_trip = split == "keys" and merge is None and splits <= kv_mod.group_merge_loads(d)
    assert (plan.config.group_merge > 0) == one_trip, plan.config   # (keys mode: _keys_merge)


# The group merge (combine="group", rows mode): a cooperative split grid in which every CTA of a
# group merges a share of its (row, column chunk) units - several units per round trip for few
# splits, batches of splits past GM_LOADS, empty sequences and splits without keys; paged too.
GROUP_CASES = [c for c in MERGE_CASES if c[5] == "rows"] + [
    (2, 16, 32, 8, 128, "rows", 17, [900, 1]),      # 17 splits > GM_LOADS (16): a second batch
    (1, 8, 32, 8, 128, "rows", 7, [1000]),          # 32 rows, 7 splits: 2 units x 8 splits a round trip
    (3, 16, 16, 4, 64, "rows", 9, [800, 0, 300]),   # d64 (GM_LOADS 4): batches of 4 splits
    (2, 12, 8, 2, 64, "rows", 2, [500, 499]),       # d64, 2 splits: 2 units a round trip
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,h,hkv,d,split,splits,lens", GROUP_CASES)
@pytest.mark.parametrize("page", [None, 16], ids=("contig", "paged16"))
def test_gpu_group_merge(variant, batch, sq, h, hkv, d, split, splits, lens, page):
    """The group merge against the float64 reference (and lse), on a cooperative launch."""
    variant(dict(warp_split=split, combine="group"))
    x = _run(_seed(), batch, sq, h, hkv, d, "bfloat16", page, True, 0, max(lens) + 1, lens=lens,
             num_splits=splits)
    plan = _plan_for(x, splits)
    print(plan.config, "splits", plan.num_splits, "fused", plan.fused)
    assert plan.fused and plan.split.cooperative and plan.num_splits == splits, plan
    assert plan.counter_bytes == 8 * (plan.split.grid[0] // splits), plan


@pytest.mark.gpu
def test_gpu_group_merge_refused_plans_again(monkeypatch):
    """A device that refuses the group merge's cooperative grid (LaunchError before the launch):
    the call plans again without it and still matches the reference; later calls skip it."""
    from rtkernels.errors import LaunchError
    from rtkernels.kernel import Kernel
    real = Kernel.launch_cooperative
    refused = []

    def refuse(self, *args, **kw):
        refused.append(self.name)
        raise LaunchError(f"{self.name}: refused (test)")
    monkeypatch.setattr(Kernel, "launch_cooperative", refuse)
    try:
        x = _make(_seed(), 1, 16, 32, 8, 128, "bfloat16", None, 3000, lens=[2999])
        plan = _plan_for(x, 6)
        assert plan.split.cooperative, plan   # seqlen_q 16 x group 4, 6 splits: the group merge
        o, lse = _call(x, out=poison_like(x.q), num_splits=6, return_lse=True)
        _check(x, o, lse, True, None, "refused group merge")
        assert refused and kv_mod._refusal_key(plan.config, plan.device) in kv_mod._GROUP_REFUSED
        assert kv_mod._refusal_key(plan.config, plan.device)[0].merges == "all"   # the heuristics' config
        assert not _plan_for(x, 6).split.cooperative
    finally:
        monkeypatch.setattr(Kernel, "launch_cooperative", real)
        kv_mod._GROUP_REFUSED.clear()
        kv_mod._PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("sq", [4, 16])
def test_gpu_group_merge_bad_page_gives_nan_for_that_sequence_only(variant, sq):
    variant(dict(warp_split="rows", combine="group", num_splits=5))
    _bad_page_gives_nan_for_that_sequence_only(sq)


@pytest.mark.gpu
@pytest.mark.parametrize("loader", LOADERS, ids=LOADER_IDS)
@pytest.mark.parametrize("sq,hkv", [(16, 4), (64, 4), (300, 8), (33, 2)])
def test_gpu_rows_mode_many_rows(variant, loader, sq, hkv):
    """Many query rows per kv head (speculative verification, chunked prefill): the rows mode
    (the default above 32 rows per kv head), one or several row tiles of up to 128 rows, causal
    bottom-right, with and without splits; its TMA ring (sm_90) and its cp.async ring."""
    variant(dict(warp_split="rows", **(loader or {})))
    for splits in (None, 3):
        x = _run(_seed(), 2, sq, 16, hkv, 128, "bfloat16", 16 if sq > 50 else None, True, min(sq, 8), 900,
                 num_splits=splits)
        plan, _ = kv_mod._plan((x.q, x.kc, x.vc, x.lens, x.table, x.kn, x.vn, None), True, None, True, splits,
                               "bfloat16")
        assert plan.config.warp_split == "rows", plan.config


# schedule="streamk" (opt-in): the grid shares all key tiles equally; items cut by CTA boundaries
# are merged by their last CTA.  Cases: one long sequence over every CTA, many short items per CTA,
# ragged lengths with 0 and 1, pages, appends, several query rows (causal), padded head dims.
STREAMK_CASES = [   # (batch, seqlen_q, nheads, nheads_kv, head_dim, dtype, page_size, seqlen_new, capacity, lens)
    (1, 1, 32, 8, 128, "bfloat16", None, 0, 20000, [19999]),
    (1, 1, 8, 1, 128, "float16", 64, 1, 9000, [8000]),
    (37, 1, 16, 4, 128, "bfloat16", None, 0, 300, None),
    (6, 1, 16, 16, 64, "float16", 16, 0, 1500, None),
    (5, 4, 24, 4, 80, "bfloat16", 32, 4, 900, None),
    (3, 2, 16, 2, 256, "float16", None, 2, 700, None),
    (2, 1, 8, 8, 96, "bfloat16", None, 0, 40, [0, 1]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,h,hkv,d,dtype,page,new,cap,lens", STREAMK_CASES)
def test_gpu_streamk_against_float64_reference(variant, batch, sq, h, hkv, d, dtype, page, new, cap, lens):
    variant(dict(schedule="streamk"))
    x = _run(_seed(), batch, sq, h, hkv, d, dtype, page, True, new, cap, lens)
    plan, _ = kv_mod._plan((x.q, x.kc, x.vc, x.lens, x.table, x.kn, x.vn, None), True, None, True, None,
                           "bfloat16" if dtype == "bfloat16" else None)
    print(plan.config, "grid", plan.split.grid)
    assert plan.config.schedule == "streamk" and plan.split.grid[0] > 1, plan


@pytest.mark.gpu
def test_gpu_streamk_graph_replay_with_new_lengths(variant):
    """Captured once; replays with new ragged lengths move every CTA boundary (W is read on the
    device); the merge counters are back at zero after every launch."""
    import cupy as cp
    from gpu_util import to_f64
    variant(dict(schedule="streamk"))
    cap = 3000
    x = _make(_seed(), 5, 1, 32, 8, 128, "bfloat16", 16, cap, lens=[cap] * 5)
    out = cp.empty(x.q.shape, x.q.dtype)
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        _call(x, out=out, return_lse=True)
        s.synchronize()
        s.begin_capture()
        _, lse = _call(x, out=out, return_lse=True)
        graph = s.end_capture()
    rng = np.random.default_rng(_seed())
    for step, fixed in enumerate(([0, 1, cap, 17, 2999], None, None, [cap] * 5)):
        x.lens_h = np.array(fixed if fixed else rng.integers(0, cap + 1, size=5), np.int32)
        x.lens.set(x.lens_h)
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        _check(x, out, lse, True, None, f"stream-K graph replay {step} lens {x.lens_h.tolist()}")
        eager, lse_eager = _call(x, return_lse=True)
        cp.cuda.Device().synchronize()
        assert np.array_equal(to_f64(eager, "bfloat16"), to_f64(out, "bfloat16")), f"replay {step} != eager"


@pytest.mark.gpu
def test_gpu_streamk_bad_page_gives_nan_for_that_sequence_only(variant):
    variant(dict(schedule="streamk"))
    _bad_page_gives_nan_for_that_sequence_only(1)


@pytest.mark.gpu
@pytest.mark.parametrize("v", [dict(warp_split="keys"), dict(warp_split="rows")], ids=("keys", "rows"))
def test_gpu_transposed_cache_layout(variant, v):
    """A (batch, nheads_kv, seqlen, head_dim) cache passed as its transposed view: any strides."""
    variant(v)
    _run(_seed(), 3, 2, 16, 4, 128, "float16", None, True, 2, 700, hnd=True, num_splits=3)
    _run(_seed(), 3, 1, 16, 4, 64, "bfloat16", None, True, 0, 500, hnd=True)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 48, 64, 80, 256])   # 48, 80: the page divisor's non-power-of-two path
def test_gpu_appends_cross_page_boundaries(page):
    # every sequence ends one key before a page boundary, then appends 3 keys
    lens = [page - 1, 2 * page - 1, 3 * page - 2, 0]
    _run(_seed(), 4, 3, 8, 2, 128, "float16", page, True, 3, 4 * page, lens=lens)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_strided_q_and_custom_scale(dtype):
    _run(_seed(), 3, 4, 8, 2, 128, dtype, 16, True, 0, 300, q_from_qkv=True, softmax_scale=0.3)


@pytest.mark.gpu
def test_gpu_no_lse_plan_replay_and_new_lengths():
    """A second call with the same signature replays the plan; new cache_seqlens take effect."""
    import cupy as cp
    x = _make(_seed(), 4, 1, 16, 4, 128, "float16", 16, 800)
    o1 = _call(x)
    n = len(kv_mod._PLANS)
    x.lens_h = np.array([799, 3, 0, 400], np.int32)
    table_h = np.array(x.table_h)
    for b in range(4):   # pages for the longer lengths
        used = -(-int(x.lens_h[b]) // 16)
        table_h[b, :used] = (np.arange(used) * 4 + b) % x.kc.shape[0]
    x.table_h = table_h
    x.lens.set(x.lens_h)
    x.table.set(table_h)
    o2 = _call(x)
    assert len(kv_mod._PLANS) == n and o2.shape == o1.shape
    cp.cuda.get_current_stream().synchronize()
    _check(x, o2, None, True, None, "replay")


@pytest.mark.gpu
def test_gpu_bad_contents_give_nan_for_that_sequence_only():
    """Out-of-range page ids and cache_seqlens: NaN for that sequence, nothing out of range read
    (run under compute-sanitizer to see the latter), the other sequences correct; validate=True
    raises instead."""
    import cupy as cp
    from gpu_util import to_f64
    x = _make(_seed(), 4, 2, 8, 2, 64, "bfloat16", 16, 160, seqlen_new=1, lens=[40, 100, 3, 7])
    x.table_h[1, 2] = 10 ** 6          # a page sequence 1 uses
    x.table.set(x.table_h)
    lens = x.lens_h.copy()
    lens[2] = -5                       # negative
    lens[3] = 160                      # + 1 new row > capacity 160
    x.lens.set(lens)
    o, lse = _call(x, return_lse=True)
    cp.cuda.get_current_stream().synchronize()
    got, lse = to_f64(o, "bfloat16"), lse.get()
    for b in (1, 2, 3):
        assert np.isnan(got[b]).all() and np.isnan(lse[b]).all(), f"sequence {b} should be NaN"
    assert not np.isnan(got[0]).any() and not np.isnan(lse[0]).any()
    with pytest.raises(ConfigError, match="block_table|cache_seqlens"):
        _call(x, validate=True)


# Both modes read their page ids 32 16-key groups at a time, a batch ahead.  The keys mode: lane l
# of each warp holds group l % GROUPS of the warp's tile 32 / GROUPS * batch + l / GROUPS; the rows
# mode (TMA): warp 0's lanes hold the CTA's next 32 groups, its thread 0 takes them by shuffles.
# Caches long enough that a warp (a CTA) crosses several batches at one and a few splits, lengths
# ending inside a batch, 16- and 32-key tiles (d64: two pages per tile) and the rows mode's 16-key
# d256 tiles (32 tiles a batch), pages of 16 / 32 / 64 keys, the TMA and the cp.async loader, the
# rows mode's wgmma and mma.sync.
# (batch, nheads, nheads_kv, head_dim, page_size, lens, num_splits, seqlen_q, variant)
PAGE_BATCH_CASES = [
    (3, 32, 8, 128, 16, [5000, 2049, 7777], 1, 1, None),
    (3, 32, 8, 128, 64, [4100, 8192, 1], 3, 1, None),
    (2, 16, 16, 64, 16, [6000, 4097], 1, 1, None),
    (2, 16, 16, 64, 16, [6000, 4097], 2, 1, dict(loader="cp.async")),
    (2, 8, 2, 96, 32, [3333, 8000], None, 1, None),
    (2, 32, 8, 128, 16, [5000, 2049], 1, 16, None),
    (2, 16, 4, 64, 32, [6000, 4097], 2, 16, None),
    (2, 32, 8, 128, 16, [3001, 4500], 1, 16, dict(mma="sync")),
    (1, 16, 2, 256, 16, [5000], 1, 8, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,h,hkv,d,page,lens,splits,sq,tile", PAGE_BATCH_CASES)
def test_gpu_paged_long_caches_cross_page_id_batches(variant, batch, h, hkv, d, page, lens, splits, sq, tile):
    import cupy as cp
    from gpu_util import to_f64
    if tile:
        variant(tile)
    x = _run(_seed(), batch, sq, h, hkv, d, "bfloat16", page, True, 0, 8192, lens=lens, num_splits=splits)
    plan = _plan_of(x, splits)
    cfg = plan.config
    assert cfg.warp_split == ("keys" if sq == 1 else "rows") and cfg.paged, cfg
    assert all(getattr(cfg, f) == v for f, v in (tile or {}).items()), cfg
    # a bad page id past the first batches of every warp: that sequence alone becomes NaN
    bad = max(range(batch), key=lambda i: lens[i])
    x.table_h[bad, (lens[bad] - 1) // page] = -7
    x.table.set(x.table_h)
    o, lse = _call(x, return_lse=True, num_splits=splits)
    cp.cuda.get_current_stream().synchronize()
    got, lse = to_f64(o, "bfloat16"), lse.get()
    assert np.isnan(got[bad]).all() and np.isnan(lse[bad]).all()
    for i in set(range(batch)) - {bad}:
        assert not np.isnan(got[i]).any() and not np.isnan(lse[i]).any(), i


@pytest.mark.gpu
def test_gpu_empty_batch_and_zero_length_everywhere():
    import cupy as cp
    x = _make(_seed(), 3, 2, 4, 2, 64, "float16", None, 50, lens=[0, 0, 0])
    o, lse = _call(x, return_lse=True)
    cp.cuda.get_current_stream().synchronize()
    assert float(cp.abs(o.astype(cp.float32)).max()) == 0 and bool(cp.isneginf(lse).all())
    x = _make(_seed(), 2, 1, 4, 2, 64, "float16", None, 50)
    x.q = cp.zeros((0, 1, 4, 64), cp.float16)
    x.lens = cp.zeros((0,), cp.int32)
    o = _call(x)
    assert o.shape == (0, 1, 4, 64)


@pytest.mark.gpu
def test_gpu_bad_inputs_raise_before_launch():
    import cupy as cp
    from gpu_util import poison
    x = _make(_seed(), 2, 1, 8, 2, 64, "float16", 16, 64)
    out = poison(cp.empty(x.q.shape, x.q.dtype))
    cases = [
        (dict(q=x.q.astype(cp.float32)), "float32"),
        (dict(lens=x.lens.astype(cp.int64)), "cache_seqlens"),
        (dict(table=x.table.astype(cp.int64)), "block_table"),
        (dict(table=x.table[:1]), "block_table"),
        (dict(kc=x.kc[:, :8], vc=x.vc[:, :8]), "multiple of 16"),
        (dict(kn=cp.zeros((2, 1, 2, 64), cp.float16)), "k_new and v_new"),
        (dict(q=cp.ones((2, 1, 8, 128), cp.float16)[..., ::2]), "contiguous last dimension"),
    ]
    for change, words in cases:
        y = SimpleNamespace(**{**vars(x), **change})
        with pytest.raises(ConfigError, match=words):
            _call(y, out=out)
    with pytest.raises(ConfigError, match="num_splits"):
        _call(x, out=out, num_splits=1000)
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.isnan(out.astype(cp.float32)).all()), "an error case launched a kernel"


@pytest.mark.gpu
def test_gpu_torch_bfloat16_graph_capture_replays_with_new_inputs():
    """Captured once, replayed with new q, cache_seqlens and block table: same as eager calls."""
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, hkv, d, ps, cap = 4, 32, 8, 128, 16, 2048
    nblk = b * cap // ps
    kc = torch.randn(nblk, ps, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(nblk, ps, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.tensor([5, 2000, 0, 700], device="cuda", dtype=torch.int32)
    table = torch.randperm(nblk, device="cuda", generator=g).to(torch.int32).reshape(b, cap // ps)
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):   # warm with the captured call's own signature: compile, plan, module load
            rtk.attention_kvcache(q, kc, vc, lens, block_table=table, out=out, return_lse=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = rtk.attention_kvcache(q, kc, vc, lens, block_table=table, out=out, return_lse=True)
    for step in range(3):
        q.copy_(torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g))
        lens.copy_(torch.randint(0, cap, (b,), device="cuda", generator=g, dtype=torch.int32))
        table.copy_(torch.randperm(nblk, device="cuda", generator=g).to(torch.int32).reshape(b, cap // ps))
        graph.replay()
        eager, lse_eager = rtk.attention_kvcache(q, kc, vc, lens, block_table=table, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {step}: max diff {(out.float() - eager.float()).abs().max()}"
        assert torch.equal(lse, lse_eager)
    # and against SDPA in float32 for the last inputs
    for bi in range(b):
        n = int(lens[bi])
        if n == 0:
            assert out[bi].abs().max().item() == 0
            continue
        pages = table[bi, : -(-n // ps)].long()
        k = kc[pages].reshape(-1, hkv, d)[:n].float().transpose(0, 1).repeat_interleave(h // hkv, 0)
        v = vc[pages].reshape(-1, hkv, d)[:n].float().transpose(0, 1).repeat_interleave(h // hkv, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(q[bi].float().transpose(0, 1), k, v)
        assert (out[bi].float() - ref.transpose(0, 1)).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_gpu_torch_error_rule_against_sdpa_in_bfloat16():
    """FlashAttention's rule with PyTorch as the low-precision peer: error vs float64 <= 2x the
    error of SDPA run in bfloat16 on the same (gathered, GQA-expanded) inputs."""
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(1)
    b, sq, h, hkv, d, n = 2, 4, 16, 4, 128, 1500
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(b, 2048, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(b, 2048, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
    o = rtk.attention_kvcache(q, kc, vc, lens, causal=True)
    mask = torch.ones(sq, n, dtype=torch.bool, device="cuda").tril(n - sq)

    def sdpa(dt):
        qt = q.to(dt).transpose(1, 2)
        k = kc[:, :n].to(dt).transpose(1, 2).repeat_interleave(h // hkv, 1)
        v = vc[:, :n].to(dt).transpose(1, 2).repeat_interleave(h // hkv, 1)
        return torch.nn.functional.scaled_dot_product_attention(qt, k, v, attn_mask=mask).transpose(1, 2)

    ref = sdpa(torch.float64)
    err = (o.double() - ref).abs().max().item()
    err_peer = (sdpa(torch.bfloat16).double() - ref).abs().max().item()
    assert err <= 2 * err_peer + 1e-3, f"max err {err:.3e} vs SDPA bf16 {err_peer:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["fused", "kernel", "group"])
@pytest.mark.parametrize("warm_capture_stream", [True, False], ids=("warm", "cold"))
def test_gpu_cupy_graph_capture_with_splits(variant, combine, warm_capture_stream):
    """CuPy stream capture of a split call (partials, fused-merge counters in the workspace):
    replays with new lengths match eager calls and the reference, three times in a row (the
    counters are back at zero after every launch).  'cold': the capture stream never ran the op,
    so its workspace is made (and zeroed) inside the capture."""
    import cupy as cp
    from gpu_util import to_f64
    variant(dict(combine=combine, **({"warp_split": "rows"} if combine == "group" else {})))   # (group: rows mode)
    x = _make(_seed(), 3, 1, 32, 8, 128, "bfloat16", 16, 2000, lens=[2000, 2000, 2000])   # every page mapped
    x.lens_h = np.array([1999, 700, 3], np.int32)
    x.lens.set(x.lens_h)
    out = cp.empty(x.q.shape, x.q.dtype)
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        if warm_capture_stream:
            _call(x, out=out, num_splits=6)
        else:
            with cp.cuda.Stream(non_blocking=True) as other:   # plan and module made on another stream
                _call(x, out=out, num_splits=6)
                other.synchronize()
        s.synchronize()
        s.begin_capture()
        _, lse = _call(x, out=out, num_splits=6, return_lse=True)
        graph = s.end_capture()
    plan, _ = kv_mod._plan((x.q, x.kc, x.vc, x.lens, x.table, None, None, out), True, None, True, 6, "bfloat16")
    assert plan.num_splits == 6 and plan.fused == (combine != "kernel"), plan
    assert plan.split.cooperative == (combine == "group"), plan
    rng = np.random.default_rng(_seed())
    for step in range(3):
        x.lens_h = rng.integers(0, 2000, size=3).astype(np.int32)
        x.lens_h[step] = 0
        x.lens.set(x.lens_h)
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        _check(x, out, lse, True, None, f"cupy graph {combine} replay {step}")
        eager, lse_eager = _call(x, num_splits=6, return_lse=True)
        cp.cuda.Device().synchronize()
        assert np.array_equal(to_f64(eager, "bfloat16"), to_f64(out, "bfloat16")), f"replay {step} != eager"
        assert np.array_equal(lse_eager.get(), lse.get())


@pytest.mark.gpu
@pytest.mark.parametrize("loader", LOADERS, ids=LOADER_IDS)
@pytest.mark.parametrize("page", [None, 16], ids=("contig", "paged16"))
def test_gpu_speculative_default_rows_mode_graph_replay(variant, loader, page):
    """seqlen_q 16 x group 4 = 64 rows per kv head: the default is the rows mode with the heavy
    split rule (several splits, combine launch or fused merge); captured in a CuPy graph and
    replayed with new lengths (ragged, 0 and 1 among them) and, paged, new block tables, against
    the reference each time; the default loader (TMA on sm_90) and the cp.async ring."""
    import cupy as cp
    from gpu_util import to_f64
    variant(loader)
    cap = 2048   # 24 CTAs of 64 rows: 2 splits (>= 1024 keys each)
    x = _make(_seed(), 3, 16, 32, 8, 128, "bfloat16", page, cap, lens=[cap - 16] * 3)   # every page mapped
    out = cp.empty(x.q.shape, x.q.dtype)
    arrays = (x.q, x.kc, x.vc, x.lens, x.table, None, None, out)
    plan, _ = kv_mod._plan(arrays, True, None, True, None, "bfloat16")
    print(plan.config, "splits", plan.num_splits, "fused", plan.fused)
    assert plan.config.warp_split == "rows" and plan.num_splits > 1, plan
    assert plan.config.loader == (_default_loader(plan, 128) if loader is None else "cp.async"), plan.config
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        _call(x, out=out)
        s.synchronize()
        s.begin_capture()
        _, lse = _call(x, out=out, return_lse=True)
        graph = s.end_capture()
    rng = np.random.default_rng(_seed())
    for step, fixed in enumerate(([0, 1, cap - 16], None, None)):
        x.lens_h = np.array(fixed if fixed else rng.integers(0, cap - 16, size=3), np.int32)
        x.lens.set(x.lens_h)
        if page:   # the same pages (the first cap - 16 keys' worth), each sequence's in a new order
            for b in range(3):
                used = -(-(cap - 16) // page)
                x.table_h[b, :used] = rng.permutation(x.table_h[b, :used])
            x.table.set(x.table_h)
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        _check(x, out, lse, True, None, f"rows-mode graph replay {step} lens {x.lens_h.tolist()}")
        eager, lse_eager = _call(x, return_lse=True)
        cp.cuda.Device().synchronize()
        assert np.array_equal(to_f64(eager, "bfloat16"), to_f64(out, "bfloat16")), f"replay {step} != eager"


@pytest.mark.gpu
def test_gpu_cupy_graph_capture_single_split():
    """CuPy stream capture (out given, one split: no allocation inside the capture)."""
    import cupy as cp
    x = _make(_seed(), 2, 1, 8, 2, 64, "float16", None, 300, lens=[100, 250])
    out = cp.empty(x.q.shape, x.q.dtype)
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        _call(x, out=out, num_splits=1)
        s.synchronize()
        s.begin_capture()
        _call(x, out=out, num_splits=1)
        graph = s.end_capture()
    x.lens_h = np.array([299, 7], np.int32)
    x.lens.set(x.lens_h)
    cp.cuda.Device().synchronize()
    graph.launch(s)
    s.synchronize()
    _check(x, out, None, True, None, "cupy graph")
