"""attention_bwd_sm90 (head dims <= 128): the big kernel's grid / walk options ported, both opt-in -
``lpt_grid`` (causal, dense, not deterministic: a 1-D grid running the key tiles heaviest first in
L2-sized sections of (batch, kv head) pairs; rtk::attn::key_tile_lpt) and ``stagger`` (non-causal,
not deterministic: each CTA's walk over the query tiles starts at its diagonal tile and wraps;
rtk::attn::walk_tile), at block_m 128 (d <= 64) and 64 (d72-128).

CPU: the options' rules (the one rule both families share), defaults untouched, the key-tile step
counts the sections are sized from against a brute-force count (block_m 64 and 128, block_n 128),
the 1-D grid's mapping and the staggered walk each covering every tile once, the launch grid and
its section argument, the section sizing on FlashAttention's grid, and builds without spills whose
SASS holds the default's GEMMs (the options add none).
GPU (``-m gpu``, sm_90 only): tests/test_attention_bwd.py's float64 reference and 2x error rule
into NaN-poisoned outputs through each option's explicit config (GQA / MQA, seqlen_q != seqlen_k
both ways, odd lengths, one-tile and long walks, a last 128-row step holding one 64-row dQ tile,
strided views, several lpt sections with a short last one), lpt's dK / dV bit-identical to the
3-D grid's (the same CTAs' work, launched in another order), stagger on varlen (with and without
a window), and both through the op's own dispatch with its launch plans replayed.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import attention_bwd_sm90 as B90
from rtkernels.ops import attention_bwd_sm90_big as BIG
from rtkernels.ops.attention_bwd_sm90 import AttentionBwdSm90Config as Cfg

import test_attention_bwd as bwd_tests   # the backward's GPU case runner (tests/ is on sys.path)


def _cfg(dtype, d, causal, **opts):
    """The op's config for (dtype, d, causal), not deterministic, with ``opts`` replaced."""
    return B90.choose_config(dtype, d, causal, False).replace(**opts)


# ---- GPU helpers, shared with the big kernel's option tests (test_attention_bwd_sm90_big_*) ----------
def lpt_sections_case(monkeypatch, cfg, section_bytes: int, want: int) -> None:
    """``cfg`` (lpt_grid, causal, bf16) with LPT_SECTION_BYTES = ``section_bytes`` on batch 5, GQA
    2:1 (one kv head), sq 300 < sk 333: the model picks sections of ``want`` pairs and every key tile
    of every pair still runs once (the float64 check)."""
    from rtkernels import device
    monkeypatch.setattr(B90, "LPT_SECTION_BYTES", section_bytes)
    B90.lpt_group.cache_clear()
    try:
        g = B90.lpt_group(cfg, 5, 300, 333, 1, 2, device.sm_count())
        print(f"lpt sections of {g} pairs")
        assert g == want, g
        bwd_tests._gpu_case(5, 300, 333, 2, 1, cfg.head_dim, True, cfg.dtype, hopper=cfg)
    finally:
        B90.lpt_group.cache_clear()


def fresh_backward_plans(monkeypatch, module, choose):
    """``module.choose_config`` replaced by ``choose``, the masked-build memo and both backward plan
    caches emptied; returns rtkernels.ops.attention_bwd, whose plans then hold what ``choose`` picked."""
    from rtkernels.ops._arrays import LaunchPlans
    A = importlib.import_module("rtkernels.ops.attention_bwd")
    monkeypatch.setattr(module, "choose_config", choose)
    monkeypatch.setattr(B90, "_MASKED_CLEAN", {})
    monkeypatch.setattr(A, "_BACKWARD_PLANS", LaunchPlans())
    monkeypatch.setattr(A, "_VARLEN_BACKWARD_PLANS", LaunchPlans())
    return A


def varlen_backward_rounds(d: int, dtype: str) -> None:
    """Packed sequences (test_attention_varlen's short mix, non-causal) with and without a sliding
    window; seed 2 replays seed 1's plan with new data."""
    V = importlib.import_module("test_attention_varlen")
    for seed, window in ((1, None), (2, None), (3, (100, 30))):
        V._varlen_backward(np.random.default_rng(seed), V.SHORT_Q, V.SHORT_K, 6, 2, d, dtype, False, window)


# ---- CPU: rules ------------------------------------------------------------------------------
def test_default_rule():
    """At d <= 128 the op takes lpt_grid for dense causal, non-deterministic calls from
    LPT_MIN_HEAD_DIM up (measured at d64 / d96 / d128), and stagger nowhere."""
    for c in B90.heuristic_configs():
        if c.head_dim <= B90.MAX_HEAD_DIM:
            want = c.causal and not c.deterministic and c.head_dim >= B90.LPT_MIN_HEAD_DIM
            assert c.lpt_grid == want and not c.stagger, c
    assert B90.choose_config("bfloat16", 128, True, False).lpt_grid
    assert not B90.choose_config("bfloat16", 96, True, False).lpt_grid
    for flags in (dict(is_varlen=True), dict(has_window=True), dict(has_softcap=True)):
        assert not B90.choose_config("bfloat16", 128, True, False, **flags).lpt_grid, flags


@pytest.mark.parametrize("bad", [dict(lpt_grid=True), dict(lpt_grid=True, causal=True, deterministic=True),
                                 dict(lpt_grid=True, causal=True, is_varlen=True), dict(lpt_grid="yes", causal=True),
                                 dict(stagger=True, causal=True), dict(stagger=True, deterministic=True),
                                 dict(stagger="yes")])
@pytest.mark.parametrize("d", [64, 128])
def test_rules_name_the_argument(bad, d):
    """One rule for both families (AttentionBwdSm90Config._check_grid_order): the error names the option."""
    name = "lpt_grid" if "lpt_grid" in bad else "stagger"
    with pytest.raises(ConfigError, match=name) as e:
        Cfg(head_dim=d, **bad)
    assert "attention_bwd_sm90" in str(e.value)
    with pytest.raises(ConfigError, match=name):
        BIG.AttentionBwdSm90BigConfig(head_dim=192, **bad)


def test_options_accepted_where_they_apply():
    """lpt_grid: dense causal, both block_m; stagger: non-causal, also varlen and windows (a walk
    order only); neither changes shared memory; each is its own cache key."""
    for d, bm in ((64, 128), (64, 64), (96, 64), (128, 64)):
        base = Cfg(head_dim=d, block_m=bm, causal=True)
        lpt = base.replace(lpt_grid=True)
        assert lpt.shared_mem_bytes == base.shared_mem_bytes and lpt.key() != base.key()
        stg = base.replace(causal=False, stagger=True)
        assert stg.shared_mem_bytes == base.shared_mem_bytes and stg.key() != base.replace(causal=False).key()
    Cfg(head_dim=96, stagger=True, is_varlen=True, has_window=True)
    Cfg(head_dim=64, block_m=128, stagger=True, is_varlen=True)
    assert bwd_describe(Cfg(head_dim=64, causal=True, lpt_grid=True)).endswith(" lpt")
    assert bwd_describe(Cfg(head_dim=64, stagger=True)).endswith(" stg")


def bwd_describe(cfg):
    return importlib.import_module("rtkernels.ops.attention_bwd").describe(cfg)


# ---- CPU: the grid and the walk -----------------------------------------------------------------
@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (77, 1000), (1000, 77), (128, 128), (129, 257), (2048, 2048),
                                   (1, 300), (300, 1)])
def test_key_tile_steps_match_brute_force(bm, sq, sk):
    """Query steps a 128-key tile walks: those holding a row that sees one of its keys (bottom-right)."""
    cfg = Cfg(head_dim=64, causal=True, block_m=bm)
    diag = sk - sq
    want = [sum(1 for m in range(-(-sq // bm)) if any(n * 128 <= i + diag for i in range(bm * m, min(sq, bm * m + bm))))
            for n in range(-(-sk // 128))]
    got = B90.key_tile_steps(cfg, sq, sk)
    assert got == want, (bm, sq, sk)
    assert got[0] == max(got)


def _device_lpt(t, n_tiles, heads, batch, group):
    """rtk::attn::key_tile_lpt, line by line: (key tile, kv head, batch) of block t."""
    per_section = group * n_tiles
    s = t // per_section
    loc = t - s * per_section
    gs = min(group, heads * batch - s * group)
    mt = loc // gs
    pair = s * group + (loc - mt * gs)
    tile = n_tiles - 1 - mt             # linear_tile_grouped's heaviest-first tile ...
    return n_tiles - 1 - tile, pair % heads, pair // heads   # ... flipped: key tile 0 first


@pytest.mark.parametrize("batch,heads,sq,sk,group", [(16, 32, 1024, 1024, 64), (4, 16, 4096, 4096, 12),
                                                     (5, 1, 300, 333, 3), (3, 2, 255, 255, 4), (2, 3, 77, 1000, 6),
                                                     (1, 1, 1, 1, 1)])
def test_lpt_grid_covers_every_tile_once_heaviest_first(batch, heads, sq, sk, group):
    """The 1-D grid of the d <= 128 kernel (128-key tiles): every (key tile, kv head, batch) of the
    3-D grid exactly once, the host mirror (lpt_order) agreeing with the device's mapping, and each
    section's key tiles in non-increasing work."""
    cfg = Cfg(head_dim=64, causal=True, block_m=128, lpt_grid=True)
    n_tiles = -(-sk // cfg.block_n)
    grid, tail = (n_tiles * heads * batch,), (group,)
    got = [_device_lpt(t, n_tiles, heads, batch, group) for t in range(grid[0])]
    assert sorted(got) == [(n, h, b) for n in range(n_tiles) for h in range(heads) for b in range(batch)]
    assert [(n, b * heads + h) for n, h, b in got] == B90.lpt_order(n_tiles, heads * batch, group)
    steps = B90.key_tile_steps(cfg, sq, sk)
    pairs = heads * batch
    for s0 in range(0, pairs, group):
        lo, hi = s0 * n_tiles, min(pairs, s0 + group) * n_tiles
        work = [steps[n] for n, _, _ in got[lo:hi]]
        assert work == sorted(work, reverse=True), (s0, work)
    assert tail == (group,)


def test_main_grid(monkeypatch):
    """3-D (key tiles of 128, kv heads, batch) by default; lpt_grid: 1-D with the section size."""
    from rtkernels import device
    monkeypatch.setattr(device, "sm_count", lambda device=None: 132)
    B90.lpt_group.cache_clear()
    cfg = Cfg(head_dim=128, causal=True)
    assert cfg.launch_grid(8, 2048, 2048, 16, 1) == ((16, 16, 8), ())
    lpt = cfg.replace(lpt_grid=True)
    assert lpt.launch_grid(8, 2048, 2048, 16, 1) == ((16 * 16 * 8,), (16,))
    g = B90.lpt_group(lpt, 8, 2048, 2048, 4, 4, 132)   # GQA 4:1: a pair's rows are 4x, its sections shorter
    assert lpt.launch_grid(8, 2048, 2048, 4, 4) == ((16 * 4 * 8,), (g,)) and g <= 4


def _walk(cfg, sq, sk, n):
    """The query tiles key tile n visits in order (rtk::attn::walk_start / walk_tile, non-causal)."""
    m_min, m_max = 0, -(-sq // cfg.block_m)
    start = (n * cfg.block_n // cfg.block_m) % (m_max - m_min) if cfg.stagger and m_max > m_min else 0
    return [i + start if i + start < m_max else i + start - (m_max - m_min) for i in range(m_min, m_max)]


@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (77, 1000), (1000, 77), (64, 64), (4097, 4097)])
def test_staggered_walk_visits_every_tile_once_from_the_diagonal(bm, sq, sk):
    cfg = Cfg(head_dim=64, block_m=bm, stagger=True)
    m_tiles = -(-sq // bm)
    firsts = []
    for n in range(-(-sk // 128)):
        walk = _walk(cfg, sq, sk, n)
        assert sorted(walk) == list(range(m_tiles)), (n, walk)
        firsts.append(walk[0])
    # each key tile starts at its diagonal step (modulo the walk): a pair's key tiles start apart
    assert firsts == [(n * 128 // bm) % m_tiles for n in range(len(firsts))]
    apart = min(len(firsts), max(1, m_tiles // (128 // bm)))
    assert len(set(firsts[:apart])) == apart, firsts


@pytest.mark.parametrize("d,seqlen", [(64, 2048), (64, 4096), (128, 2048), (128, 4096), (128, 8192)])
def test_lpt_group_on_the_fa_grid(d, seqlen):
    """FlashAttention's grid (16k tokens, hidden 2048), 132 SMs: sections within 32 MiB of Q / dO /
    f32 dQ rows, and the greedy dispatch model's finish within 2% of the even split where the 3-D
    grid's is 3-7% late."""
    from rtkernels.ops.attention_sm90 import dispatch_cost
    cfg = B90.choose_config("bfloat16", d, True, False).replace(lpt_grid=True)
    batch, heads = 16384 // seqlen, 2048 // d
    g = B90.lpt_group(cfg, batch, seqlen, seqlen, heads, 1, 132)
    assert 1 <= g and g * seqlen * d * 8 <= B90.LPT_SECTION_BYTES, g
    work = list(reversed(B90.key_tile_steps(cfg, seqlen, seqlen)))
    lpt, grid3d = (dispatch_cost(len(work), heads * batch, 132, x, work) for x in (g, 1))
    assert lpt <= 1.02 and grid3d >= 1.025 and lpt < grid3d, (g, lpt, grid3d)


# ---- CPU: builds ----------------------------------------------------------------------------------
BUILDS = {   # name: config; HGMMA per step: S^T, dP^T over the head dim, dV, dK over the step, dQ over 128 keys
    "lpt_d64_bf16": _cfg("bfloat16", 64, True, lpt_grid=True),
    "stg_d64_fp16": _cfg("float16", 64, False, stagger=True),
    "lpt_d128_fp16": _cfg("float16", 128, True, lpt_grid=True),
    "stg_d128_bf16": _cfg("bfloat16", 128, False, stagger=True),
    "stg_d96_varlen_bf16": B90.choose_config("bfloat16", 96, False, False, is_varlen=True).replace(stagger=True),
}


@pytest.fixture(scope="module")
def built():
    from rtkernels.kernel import get_kernel
    return {name: get_kernel(cfg, arch="sm_90a") for name, cfg in BUILDS.items()}


@pytest.mark.parametrize("name", list(BUILDS))
def test_option_builds_clean(built, name):
    """No spills or local memory, the default's GEMMs and dQ bulk reductions; only lpt_grid's kernel
    takes the section size (the last argument) and reads no schedule."""
    cfg, k = BUILDS[name], built[name]
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), (name, r)
    assert not [line for line in k.module.log.splitlines() if "wgmma" in line], name
    sass = k.sass
    d_steps, m_steps, halves = -(-cfg.head_dim // 16), cfg.block_m // 16, cfg.block_m // 64
    assert sass.count("HGMMA.") == 2 * d_steps + 2 * m_steps + 8 * halves, (name, sass.count("HGMMA."))
    assert "UTMALDG" in sass and "UBLKRED" in sass and "LDL" not in sass and "STL" not in sass, name
    assert ("int lpt_group)" in k.source) == cfg.lpt_grid, name


def test_window_stagger_spill_within_the_ops_allowance():
    """stagger beside a window on varlen (producer at 48 registers): ptxas (NVRTC 13.5) keeps one
    producer-side loop value in local memory (4 B at d64 - d96, none at d128; the unrolled Q / dO
    issue loop's offsets) - within the op's bookkeeping allowance (picks() runs it), nothing among
    the consumers' per-score math (the one STL / LDL pair sits after the producer's setmaxnreg)."""
    from rtkernels.kernel import get_kernel
    cfg = B90.choose_config("bfloat16", 64, False, False, is_varlen=True, has_window=True).replace(stagger=True)
    k = get_kernel(cfg, arch="sm_90a")
    assert B90.bookkeeping_spill_only(k.resources), k.resources
    lines = k.sass.splitlines()
    dealloc = next(i for i, line in enumerate(lines) if "SETMAXREG.DEALLOC" in line)
    local = [i for i, line in enumerate(lines) if "STL" in line or "LDL" in line]
    assert len(local) <= 2 and all(i > dealloc for i in local), local


# ---- GPU -------------------------------------------------------------------------------------
def _require_sm90():
    import cupy as cp
    from rtkernels.ops.attention import _device_arch
    if not B90.is_sm90(_device_arch(cp.cuda.runtime.getDevice())):
        pytest.skip("the Hopper backward needs an sm_90 device")


CASES = [   # batch, sq, sk, h, hkv, d, causal, dtype, options (over the op's config: block_m 128 at d <= 64)
    # lpt_grid (causal): 128-key tiles heaviest first in sections
    (3, 255, 255, 16, 2, 64, True, "bfloat16", dict(lpt_grid=True)),             # GQA 8:1, 3 x 2 pairs
    (2, 1000, 1000, 4, 4, 128, True, "float16", dict(lpt_grid=True)),
    (2, 77, 1000, 6, 3, 96, True, "bfloat16", dict(lpt_grid=True)),              # sq < sk: 8 key tiles, 2 steps
    (2, 1000, 77, 4, 2, 64, True, "float16", dict(lpt_grid=True)),               # sq > sk: rows that see no key
    (1, 2048, 2048, 2, 1, 128, True, "bfloat16", dict(lpt_grid=True)),           # 32-step walks
    (2, 17, 4097, 4, 1, 32, True, "float16", dict(lpt_grid=True)),               # MQA, 33 key tiles, one step
    (1, 1, 1, 2, 1, 64, True, "bfloat16", dict(lpt_grid=True)),                  # one row, one key
    (1, 193, 500, 2, 1, 64, True, "float16", dict(lpt_grid=True)),               # last 128-row step: one dQ tile
    (2, 500, 193, 4, 2, 64, True, "bfloat16", dict(lpt_grid=True, block_m=64)),  # d64 with 64-row steps
    (2, 300, 301, 4, 2, 80, True, "float16", dict(lpt_grid=True)),
    # stagger (non-causal): CTA n starts at step n * 128 / block_m modulo the walk
    (2, 255, 300, 4, 2, 64, False, "bfloat16", dict(stagger=True)),              # GQA, odd lengths
    (1, 2048, 2048, 2, 1, 128, False, "float16", dict(stagger=True)),            # 32-step walks
    (2, 1000, 77, 8, 1, 96, False, "bfloat16", dict(stagger=True)),              # MQA, one key tile, 16-step walks
    (3, 77, 1000, 4, 4, 64, False, "float16", dict(stagger=True)),               # one-step walks, 8 key tiles
    (1, 64, 64, 2, 1, 80, False, "bfloat16", dict(stagger=True)),                # one step per CTA
    (2, 300, 301, 4, 2, 128, False, "bfloat16", dict(stagger=True)),
    (1, 193, 4097, 2, 1, 64, False, "float16", dict(stagger=True)),              # the one-tile last step mid-walk
    (2, 500, 193, 4, 2, 64, False, "bfloat16", dict(stagger=True, block_m=64)),  # d64 with 64-row steps
    (3, 255, 255, 16, 2, 32, False, "float16", dict(stagger=True)),              # GQA 8:1
    (1, 4097, 1000, 2, 1, 64, False, "bfloat16", dict(stagger=True, block_m=64, num_stages=3)),  # 3 stages
]


def _case_config(d, causal, dtype, opts):
    return _cfg(dtype, d, causal, **opts)


def gpu_configs() -> set:
    """Every config the GPU tests below build (tools/prebuild_bwd_ab.py prebuilds them too)."""
    cfgs = {_case_config(c[5], c[6], c[7], c[8]) for c in CASES} | set(_varlen_configs()) | set(_op_configs())
    pairs = (("float16", 128), ("bfloat16", 64))   # the strided and bitwise tests' (dtype, head dim)
    cfgs |= {_cfg(dt, d, True) for dt, d in pairs}
    cfgs |= {_cfg(dt, d, c, **{"lpt_grid" if c else "stagger": True}) for dt, d in pairs for c in (False, True)}
    return cfgs


@pytest.fixture(scope="module")
def prebuilt():
    """:func:`gpu_configs` compiled up front on all cores (NVRTC releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    from rtkernels import device
    if not device.has_gpu() or not device.device_arch().startswith("sm_90"):
        return
    arch = device.current_arch()
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda c: B90.kernels_for(c, arch), gpu_configs()))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype,opts", CASES)
def test_gpu_options(batch, sq, sk, h, hkv, d, causal, dtype, opts, prebuilt):
    """Each option's explicit config against the float64 reference (the 2x error rule)."""
    _require_sm90()
    cfg = _case_config(d, causal, dtype, opts)
    print(f"case batch={batch} sq={sq} sk={sk} h={h}/{hkv} d={d} causal={causal} {dtype} {bwd_describe(cfg)} {cfg}")
    bwd_tests._gpu_case(batch, sq, sk, h, hkv, d, causal, dtype, hopper=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [("float16", 128), ("bfloat16", 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_strided_inputs_and_custom_scale(dtype, d, causal, prebuilt):
    _require_sm90()
    cfg = _cfg(dtype, d, causal, **{"lpt_grid" if causal else "stagger": True})
    print(f"strided {bwd_describe(cfg)} {cfg}")
    bwd_tests._gpu_case(2, 333, 333, 4, 4, d, causal, dtype, softmax_scale=0.3, strided=True, hopper=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("section_bytes,want", [(1, 1), (3 * 2 * 300 * 128 * 8, 3)])
def test_gpu_lpt_sections(monkeypatch, section_bytes, want, prebuilt):
    """lpt_grid over several sections (one pair each; 3 of 5 pairs - a pair's rows: 2 query heads x
    300 rows x 128 x (2 + 2 + 4) B - the last section short): every key tile of every pair still
    runs once (bf16 d128, causal, GQA 2:1, batch 5, sq 300 < sk 333; 15 CTAs: every section size
    ties on the model, the largest wins)."""
    _require_sm90()
    lpt_sections_case(monkeypatch, _cfg("bfloat16", 128, True, lpt_grid=True), section_bytes, want)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype", [(64, "bfloat16"), (128, "float16")])
def test_gpu_lpt_dk_dv_match_the_3d_grid_bitwise(d, dtype, prebuilt):
    """lpt_grid only reorders the CTAs: each key tile's dK / dV (summed by its own CTA over the same
    walk) is bit-identical to the 3-D grid's; dQ (unordered float32 additions) within the 2x rule."""
    import cupy as cp
    _require_sm90()
    base = _cfg(dtype, d, True)
    args = (2, 1000, 1200, 8, 2, d, True, dtype)
    a = bwd_tests._gpu_case(*args, seed=21, hopper=base)
    b = bwd_tests._gpu_case(*args, seed=21, hopper=base.replace(lpt_grid=True))
    for name, x, y in zip(("dk", "dv"), a[1:], b[1:]):
        diff = x.view(cp.uint16) != y.view(cp.uint16)
        assert not bool(diff.any()), f"d{d} {dtype} lpt_grid: {name} differs from the 3-D grid's at {int(diff.sum())}"


# ---- varlen and the op's dispatch ------------------------------------------------------------------
MIX_Q = [1, 2, 17, 0, 128, 1000, 4097, 0, 300]
MIX_K = [1, 5, 17, 3, 128, 1000, 4097, 0, 257]


def _varlen_configs():
    return [B90.choose_config(dt, d, False, False, is_varlen=True).replace(stagger=True)
            for dt, d in (("bfloat16", 64), ("float16", 128))]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype", [(64, "bfloat16"), (128, "float16")])
def test_gpu_stagger_varlen(d, dtype, prebuilt):
    """Packed sequences (empty ones, keys != queries): each CTA's walk starts at its diagonal within
    its own sequence."""
    import cupy as cp
    from gpu_util import poison, random_array
    from rtkernels.ops.attention_bwd import attention_backward
    V = importlib.import_module("test_attention_varlen")
    _require_sm90()
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    cu_q, cu_k, q, k, v, o, lse = V._varlen_forward(rng, MIX_Q, MIX_K, 4, 2, d, dtype, False)
    do = random_array(rng, q.shape, dtype)[0]
    grads = [poison(cp.empty(a.shape, a.dtype)) for a in (q, k, v)]
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    cfg = B90.choose_config(dtype, d, False, False, is_varlen=True).replace(stagger=True)
    mask = dict(causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    attention_backward(do, q, k, v, o, lse, dq=grads[0], dk=grads[1], dv=grads[2], max_seqlen_q=max(MIX_Q),
                       max_seqlen_k=max(MIX_K), config=cfg, **mask, **extra)
    cp.cuda.get_current_stream().synchronize()
    V._backward_check(do, q, k, v, dtype, grads, f"stagger varlen d{d} {dtype} {cfg}", **mask)


OP_CASES = [(64, "bfloat16"), (128, "float16")]


def _op_configs():
    """The configs test_gpu_options_through_the_op dispatches (choose_config wrapped)."""
    out = []
    for d, dt in OP_CASES:
        out += [_cfg(dt, d, True, lpt_grid=True), _cfg(dt, d, False, stagger=True)]
        out += [B90.choose_config(dt, d, False, False, **flags).replace(stagger=True)
                for flags in (dict(is_varlen=True), dict(is_varlen=True, has_window=True))]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype", OP_CASES)
def test_gpu_options_through_the_op(monkeypatch, d, dtype, prebuilt):
    """lpt_grid on every dense causal dispatch and stagger on every non-causal one (choose_config
    wrapped), fresh launch plans: dense calls twice each (the second replays the plan, whose launch
    recomputes the 1-D grid and section size), then packed sequences with and without a sliding
    window (varlen plans, seed 2 replaying seed 1's); every plan recorded ran an option."""
    _require_sm90()
    plain = B90.choose_config

    def ordered(dtype, head_dim, causal, deterministic, **mask_flags):
        cfg = plain(dtype, head_dim, causal, deterministic, **mask_flags)
        if head_dim > B90.MAX_HEAD_DIM or deterministic:
            return cfg
        if causal:
            return cfg if mask_flags.get("is_varlen") else cfg.replace(lpt_grid=True)
        return cfg.replace(stagger=True)

    A = fresh_backward_plans(monkeypatch, B90, ordered)
    for seed in (1, 2):
        bwd_tests._gpu_case(2, 300, 517, 4, 2, d, True, dtype, seed=seed)
        bwd_tests._gpu_case(2, 517, 300, 4, 2, d, False, dtype, seed=seed)
    plans = [p.cfg for p in A._BACKWARD_PLANS._plans.values()]
    assert len(plans) == 2 and all(c.lpt_grid != c.stagger for c in plans), plans
    varlen_backward_rounds(d, dtype)
    plans = [p.cfg for p in A._VARLEN_BACKWARD_PLANS._plans.values()]
    assert plans and all(c.stagger for c in plans), plans
