"""attention_bwd_sm90_big's options for head dims 200..256 (layout "kt"): the split dO ring
(do_stages: dO released after the dV GEMM), the bulk dQ reduction staged in the Q/dO ring stage
(dq_mode="ring": two stages and the bulk reduction together at d256) and lpt_grid (causal key tiles
heaviest first across (batch, kv head) pairs in L2-sized sections).

CPU: shared-memory bytes of the options, the lpt order's host mirror (every tile once, heaviest
first per section) and its section sizing on the greedy dispatch model, the key-tile walk lengths
against a brute-force count, builds without spills with the expected HGMMA / reduction counts.
GPU (``-m gpu``, sm_90 only): tests/test_attention_bwd.py's float64 reference and 2x error rule
through each option (d200, d216, d248, d256; causal, GQA/MQA, seqlen_q != seqlen_k, odd lengths,
several lpt sections with a short last one), deterministic split-ring runs bit-identical.
"""
from __future__ import annotations

import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import attention_bwd_sm90 as B90
from rtkernels.ops import attention_bwd_sm90_big as BIG
from rtkernels.ops.attention_bwd_sm90_big import AttentionBwdSm90BigConfig as Cfg

from rtkernels.ops.attention_bwd import describe as BIG_DESCRIBE

import test_attention_bwd as bwd_tests   # the backward's GPU case runner (tests/ is on sys.path)
from test_attention_bwd_sm90_lpt import lpt_sections_case   # the options' shared GPU cases


def test_kt_options_shared_memory():
    """d256 "kt": "ring" keeps the shared two-stage ring's bytes (no staging tile; "bulk" needs one
    stage), one dO stage saves a 32 KiB tile, two keep the bytes but add two barriers; d152 / d216
    "ring" take one more (unloaded) 32-column block per tile so the wider warpgroup's f32 dQ half
    (88 / 120 columns) fits."""
    base = Cfg(head_dim=256)
    tile = 8 * 64 * 64 + 64 * 4
    assert base.replace(dq_mode="ring").shared_mem_bytes == base.shared_mem_bytes <= B90.SMEM_LIMIT_SM90
    with pytest.raises(ConfigError, match="num_stages"):
        base.replace(dq_mode="bulk")
    assert base.replace(do_stages=1).shared_mem_bytes == base.shared_mem_bytes - tile + 8 * 2
    assert base.replace(do_stages=2).shared_mem_bytes == base.shared_mem_bytes + 8 * 4 <= B90.SMEM_LIMIT_SM90
    with pytest.raises(ConfigError, match="num_stages"):
        base.replace(do_stages=1, dq_mode="bulk")   # 3 tiles + the 64 KiB staging tile
    for d, cols in ((152, 88), (216, 120)):
        c = Cfg(head_dim=d)
        r = c.replace(dq_mode="ring")
        assert max(c.split, d - c.split) == cols and r.d_blocks == c.d_blocks + 1, d
        assert 64 * cols * 4 <= r.d_blocks * 64 * 64 and r.shared_mem_bytes <= B90.SMEM_LIMIT_SM90, d
    for d in range(136, 257, 8):
        r = Cfg(head_dim=d, dq_mode="ring")
        assert 64 * max(r.split, d - r.split) * 4 <= r.d_blocks * 64 * 64 <= 8 * 64 * 64, d
        assert r.shared_mem_bytes <= B90.SMEM_LIMIT_SM90, d


def test_lpt_order_covers_every_tile_heaviest_first():
    for n_tiles, pairs, group in ((32, 64, 8), (7, 5, 2), (5, 3, 3), (4, 6, 4), (1, 3, 2)):
        order = B90.lpt_order(n_tiles, pairs, group)
        assert sorted(order) == [(n, p) for n in range(n_tiles) for p in range(pairs)], (n_tiles, pairs, group)
        for s0 in range(0, pairs, group):
            sec = order[s0 * n_tiles:(s0 + min(group, pairs - s0)) * n_tiles]
            assert {p for _, p in sec} == set(range(s0, min(pairs, s0 + group)))
            assert [n for n, _ in sec] == sorted(n for n, _ in sec)   # key tile 0 (the heaviest) first


@pytest.mark.parametrize("sq,sk", [(1000, 1000), (77, 1000), (1000, 77), (64, 64), (65, 129), (2048, 2048)])
def test_key_tile_steps_match_brute_force(sq, sk):
    """Query tiles a key tile walks: those holding a row that sees one of its keys (bottom-right)."""
    cfg = Cfg(head_dim=256, causal=True)
    diag = sk - sq
    want = []
    for n in range(-(-sk // 64)):
        first_key = n * 64
        want.append(sum(1 for m in range(-(-sq // 64))
                        if any(first_key <= i + diag for i in range(64 * m, min(sq, 64 * m + 64)))))
    got = B90.key_tile_steps(cfg, sq, sk)
    assert got == want, (sq, sk)
    assert got[0] == max(got)


@pytest.mark.parametrize("d,seqlen,group", [(256, 2048, 8), (256, 4096, 4), (256, 16384, 1), (200, 2048, 8)])
def test_lpt_group_on_the_fa_grid(d, seqlen, group):
    """FlashAttention's grid (16k tokens, hidden 2048), 132 SMs: sections of 32 MiB of Q / dO / dQ
    rows, and the dispatch model's finish within 1% of the even split where the 3-D grid's is
    5-7% late (S 2k / 4k)."""
    from rtkernels.ops.attention_sm90 import dispatch_cost
    cfg = Cfg(head_dim=d, causal=True, lpt_grid=True)
    batch, heads = 16384 // seqlen, 2048 // d
    g = B90.lpt_group(cfg, batch, seqlen, seqlen, heads, 1, 132)
    assert g == group
    work = list(reversed(B90.key_tile_steps(cfg, seqlen, seqlen)))
    lpt, grid3d = (dispatch_cost(len(work), heads * batch, 132, x, work) for x in (g, 1))
    assert lpt <= 1.01 and (seqlen > 4096 or grid3d >= 1.04), (lpt, grid3d)


def test_main_grid(monkeypatch):
    from rtkernels import device
    monkeypatch.setattr(device, "sm_count", lambda device=None: 132)
    cfg = Cfg(head_dim=256, causal=True)
    assert B90.main_grid(cfg, 8, 2048, 2048, 8, 1) == ((32, 8, 8), ())
    assert B90.main_grid(cfg.replace(lpt_grid=True), 8, 2048, 2048, 8, 1) == ((32 * 8 * 8,), (8,))
    # GQA: a CTA walks its kv head's 4 query heads: a pair's rows are 4x, the sections 4x shorter
    assert B90.main_grid(cfg.replace(lpt_grid=True), 8, 2048, 2048, 2, 4) == ((32 * 2 * 8,), (2,))


KT_BUILDS = {   # name: config fields (bf16 / fp16 alternate), checked HGMMA / reductions below
    "ring_lpt_d256": dict(dtype="bfloat16", head_dim=256, causal=True, dq_mode="ring", lpt_grid=True),
    "do1_d256": dict(dtype="float16", head_dim=256, causal=True, do_stages=1),
    "do2_det_d248": dict(dtype="bfloat16", head_dim=248, causal=False, do_stages=2, deterministic=True),
    "ring_d216": dict(dtype="float16", head_dim=216, causal=False, dq_mode="ring"),
}


@pytest.fixture(scope="module")
def kt_built():
    from rtkernels.kernel import get_kernel
    return {name: (Cfg(**kw), get_kernel(Cfg(**kw), arch="sm_90a")) for name, kw in KT_BUILDS.items()}


@pytest.mark.parametrize("name", list(KT_BUILDS))
def test_kt_option_builds_clean(kt_built, name):
    """No spills, no serialized wgmma; per step S^T and dP^T over the head dim, dV, dK over 64
    queries, dQ over 64 keys (the options add no GEMM); "ring": one bulk reduction and no register
    reductions, otherwise one 16-byte reduction per 8-column block of the wider half."""
    cfg, k = kt_built[name]
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), (name, r)
    assert not [line for line in k.module.log.splitlines() if "wgmma" in line], name
    sass = k.sass
    assert sass.count("HGMMA.") == 2 * -(-cfg.head_dim // 16) + 3 * 4, name
    reds = [line for line in sass.splitlines() if "REDG.E.ADD.F32x4" in line]
    if cfg.dq_mode == "ring":
        assert sass.count("UBLKRED") == 1 and not reds, name
    else:
        assert len(reds) == max(cfg.split, cfg.head_dim - cfg.split) // 8 and "UBLKRED" not in sass, name
    assert "UTMALDG" in sass and "LDL" not in sass and "STL" not in sass, name


# ---- GPU -------------------------------------------------------------------------------------
def _require_sm90():
    from rtkernels.ops.attention import _device_arch
    import cupy as cp
    if not B90.is_sm90(_device_arch(cp.cuda.runtime.getDevice())):
        pytest.skip("the Hopper backward needs an sm_90 device")


KT_CASES = [   # batch, sq, sk, h, hkv, d, causal, dtype, options
    (2, 113, 203, 4, 2, 256, True, "bfloat16", dict(dq_mode="ring")),
    (3, 255, 255, 16, 2, 256, False, "float16", dict(dq_mode="ring")),            # GQA 8:1
    (1, 2048, 2048, 2, 1, 248, True, "bfloat16", dict(dq_mode="ring")),           # many steps per CTA
    (2, 300, 301, 4, 2, 216, False, "bfloat16", dict(dq_mode="ring")),           # the extra tile block
    (1, 1000, 77, 8, 1, 200, True, "float16", dict(dq_mode="ring")),             # MQA, rows that see no key
    (1, 77, 77, 2, 1, 256, False, "float16", dict(dq_mode="ring")),              # one step per CTA
    (2, 113, 1000, 8, 1, 256, False, "bfloat16", dict(do_stages=1)),             # MQA
    (1, 1000, 1000, 4, 2, 200, True, "float16", dict(do_stages=1)),
    (2, 17, 4097, 4, 1, 248, True, "bfloat16", dict(do_stages=2)),
    (1, 4097, 1000, 2, 1, 256, True, "float16", dict(do_stages=2, deterministic=True)),
    (2, 300, 301, 4, 2, 200, False, "bfloat16", dict(do_stages=1, deterministic=True)),
    (3, 255, 255, 16, 2, 256, True, "bfloat16", dict(lpt_grid=True)),            # GQA, 3 x 2 pairs
    (2, 1000, 1000, 4, 4, 200, True, "float16", dict(lpt_grid=True, dq_mode="ring")),
    (2, 77, 1000, 6, 3, 256, True, "bfloat16", dict(lpt_grid=True, do_stages=1)),  # sq < sk
    (2, 1000, 77, 4, 2, 248, True, "float16", dict(lpt_grid=True, do_stages=2)),   # sq > sk
    (1, 2048, 2048, 2, 1, 256, True, "bfloat16", dict(lpt_grid=True, dq_mode="ring")),
]


def _kt_config(d, causal, dtype, opts):
    det = opts.get("deterministic", False)
    fields = dict(layout="kt", key_block=64, num_stages=2, dq_mode="red")
    return BIG.choose_config(dtype, d, causal, det).replace(**{**fields, **opts})


def _host_configs():
    """The configs test_gpu_host_nvrtc_builds_kt_options_clean builds."""
    return [Cfg(dtype="bfloat16", head_dim=d, causal=causal, **extra) for d in (200, 256) for causal in (False, True)
            for extra in (dict(dq_mode="ring"), dict(do_stages=1), dict(do_stages=2),
                          *((dict(lpt_grid=True), dict(lpt_grid=True, dq_mode="ring")) if causal else ()))]


@pytest.fixture(scope="module")
def prebuilt():
    """Every config the GPU tests below build, compiled once in parallel worker processes into the
    disk cache (about 40 configs: one at a time they would take most of the run); nothing without
    an sm_90 device."""
    from gpu_util import prebuild_sm90
    cfgs = {_kt_config(c[5], c[6], c[7], c[8]) for c in KT_CASES} | set(_host_configs())
    cfgs.add(Cfg(dtype="bfloat16", head_dim=256, causal=True, lpt_grid=True, dq_mode="ring"))
    cfgs.add(Cfg(dtype="bfloat16", head_dim=256, causal=True, deterministic=True, do_stages=1))
    prebuild_sm90(BIG.FAMILY, cfgs)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype,opts", KT_CASES)
def test_gpu_kt_options(batch, sq, sk, h, hkv, d, causal, dtype, opts, prebuilt):
    """Layout "kt" with each option against the float64 reference (the 2x error rule)."""
    _require_sm90()
    det = opts.get("deterministic", False)
    cfg = _kt_config(d, causal, dtype, opts)
    print(f"kt case batch={batch} sq={sq} sk={sk} h={h}/{hkv} d={d} causal={causal} {dtype} {cfg}")
    bwd_tests._gpu_case(batch, sq, sk, h, hkv, d, causal, dtype, deterministic=det, hopper=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("section_bytes", [1, 3 * 2 * 300 * 256 * 8])
def test_gpu_lpt_sections(monkeypatch, section_bytes, prebuilt):
    """lpt_grid over several sections (one pair each; 3 of 5 pairs - a pair's rows: 2 query heads x
    300 rows x 256 x (2 + 2 + 4) B - the last section short): every key tile of every pair still
    runs once (bf16 d256, causal, GQA 2:1, batch 5, sq 300 < sk 333; 30 CTAs: every section size
    ties on the model, the largest wins)."""
    _require_sm90()
    cfg = Cfg(dtype="bfloat16", head_dim=256, causal=True, lpt_grid=True, dq_mode="ring")
    lpt_sections_case(monkeypatch, cfg, section_bytes, 1 if section_bytes == 1 else 3)


@pytest.mark.gpu
def test_gpu_kt_split_ring_deterministic_is_bit_identical(prebuilt):
    import cupy as cp
    _require_sm90()
    cfg = Cfg(dtype="bfloat16", head_dim=256, causal=True, deterministic=True, do_stages=1)
    a, b = (bwd_tests._gpu_case(2, 700, 900, 4, 2, 256, True, "bfloat16", deterministic=True, seed=11, hopper=cfg)
            for _ in range(2))
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        diff = x.view(cp.uint16) != y.view(cp.uint16)
        assert not bool(diff.any()), f"kt split ring d256 causal: {name} differs at {int(diff.sum())} elements"


@pytest.mark.gpu
def test_gpu_host_nvrtc_builds_kt_options_clean(prebuilt):
    """The configs the A/B bench times at d256 (and d200), built by the GPU host's NVRTC (13.0 spilled
    more than the CPU's 13.5 in earlier sessions): no spill beyond loop bookkeeping, no serialized
    wgmma."""
    _require_sm90()
    from rtkernels.kernel import get_kernel
    bad = []
    for cfg in _host_configs():
        k = get_kernel(cfg, arch="sm_90a")
        notes = [line for line in k.module.log.splitlines() if "wgmma" in line]
        print(cfg.head_dim, cfg.causal, BIG_DESCRIBE(cfg), k.resources, len(notes))
        if not B90.bookkeeping_spill_only(k.resources) or notes:
            bad.append((cfg, k.resources, notes))
    assert not bad, bad
