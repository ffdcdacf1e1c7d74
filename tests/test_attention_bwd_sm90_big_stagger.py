"""attention_bwd_sm90_big: the staggered non-causal walk (``stagger``: each CTA's walk over the query
tiles starts at its diagonal tile and wraps) and a third Q stage beside one dO stage
(``num_stages=3, do_stages=1``: what fits at d256 "kt"), both opt-in A/B options.

CPU: the options' rules and shared-memory bytes, builds without spills with the base's HGMMA /
reduction counts (the wrap adds no GEMM), defaults untouched.
GPU (``-m gpu``, sm_90 only): tests/test_attention_bwd.py's float64 reference and 2x error rule
through each option (both layouts; d136..256; GQA / MQA, seqlen_q != seqlen_k both ways, odd
lengths, walks of one tile and of 32, deterministic with three Q stages bit-identical), and stagger
through the op's own dispatch for varlen and a window (tests/test_attention_varlen.py's runner).
"""
from __future__ import annotations

import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import attention_bwd_sm90 as B90
from rtkernels.ops import attention_bwd_sm90_big as BIG
from rtkernels.ops.attention_bwd_sm90_big import AttentionBwdSm90BigConfig as Cfg

import test_attention_bwd as bwd_tests   # the backward's GPU case runner (tests/ is on sys.path)
from test_attention_bwd_sm90_lpt import fresh_backward_plans, varlen_backward_rounds   # shared GPU cases


def test_stagger_rules():
    """Non-causal and not deterministic only, both layouts; the error names the argument."""
    for d in (136, 192, 256):
        for dt in (False, True):
            cfg = BIG.choose_config("bfloat16", d, False, dt)
            assert cfg.stagger == (not dt)   # the default for non-causal, non-deterministic calls
            if not dt:
                assert cfg.replace(stagger=False).shared_mem_bytes == cfg.shared_mem_bytes
    for bad in (dict(causal=True), dict(deterministic=True), dict(stagger="yes")):
        with pytest.raises(ConfigError, match="stagger"):
            Cfg(head_dim=256, **{"stagger": True, **bad})
    assert not BIG.choose_config("bfloat16", 256, True, False).stagger


def test_three_q_stages_fit_beside_one_do_stage_at_d256():
    """d256 "kt": a third shared Q + dO stage exceeds 227 KiB (three 64 KiB stages, K / V 64 KiB);
    three Q stages with one dO stage hold the same four 32 KiB tiles as the shared two-stage ring
    (+ two barriers, + 64 lse floats - 64 delta floats).  "ring" keeps two shared stages."""
    base = Cfg(head_dim=256)
    with pytest.raises(ConfigError, match="num_stages"):
        base.replace(num_stages=3)
    s3 = base.replace(num_stages=3, do_stages=1)
    assert s3.shared_mem_bytes == base.shared_mem_bytes + 8 * 4 <= B90.SMEM_LIMIT_SM90
    with pytest.raises(ConfigError, match="dq_mode"):
        base.replace(num_stages=3, dq_mode="ring")
    with pytest.raises(ConfigError, match="num_stages"):
        base.replace(num_stages=4, do_stages=1)
    for d in range(200, 257, 8):
        assert Cfg(head_dim=d, num_stages=3, do_stages=1).shared_mem_bytes <= B90.SMEM_LIMIT_SM90, d


BUILDS = {   # name: config fields, HGMMA per step
    "stagger_ring_d256": (dict(dtype="bfloat16", head_dim=256, dq_mode="ring", stagger=True), 2 * 16 + 3 * 4),
    "stagger_qk_d192": (dict(dtype="float16", head_dim=192, layout="qk", key_block=96, dq_mode="bulk",
                             do_stages=1, ds_buffers=1, stagger=True), 54),
    "s3do1_lpt_d256": (dict(dtype="bfloat16", head_dim=256, causal=True, num_stages=3, do_stages=1, lpt_grid=True),
                       2 * 16 + 3 * 4),
}


@pytest.fixture(scope="module")
def built():
    from rtkernels.kernel import get_kernel
    return {name: (Cfg(**kw), get_kernel(Cfg(**kw), arch="sm_90a")) for name, (kw, _) in BUILDS.items()}


@pytest.mark.parametrize("name", list(BUILDS))
def test_option_builds_clean(built, name):
    """No spills or local memory, no serialized wgmma, the base's GEMMs and dQ reductions."""
    cfg, k = built[name]
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), (name, r)
    assert not [line for line in k.module.log.splitlines() if "wgmma" in line], name
    sass = k.sass
    assert sass.count("HGMMA.") == BUILDS[name][1], (name, sass.count("HGMMA."))
    reds = [line for line in sass.splitlines() if "REDG.E.ADD.F32x4" in line]
    if cfg.dq_mode == "red":
        assert len(reds) == max(cfg.split, cfg.head_dim - cfg.split) // 8 and "UBLKRED" not in sass, name
    else:
        assert sass.count("UBLKRED") == 1 and not reds, name
    assert "UTMALDG" in sass and "LDL" not in sass and "STL" not in sass, name


# ---- GPU -------------------------------------------------------------------------------------
def _require_sm90():
    from rtkernels.ops.attention import _device_arch
    import cupy as cp
    if not B90.is_sm90(_device_arch(cp.cuda.runtime.getDevice())):
        pytest.skip("the Hopper backward needs an sm_90 device")


CASES = [   # batch, sq, sk, h, hkv, d, causal, dtype, options (over the dispatched config, whose
    # non-causal d200-256 default is ring dQ + stagger: "red" given where a case means it)
    # stagger, "kt" (64 keys: CTA n starts at query tile n mod the walk)
    (2, 255, 300, 4, 2, 256, False, "bfloat16", dict(stagger=True, dq_mode="red")),   # GQA, odd lengths
    (1, 2048, 2048, 2, 1, 256, False, "float16", dict(stagger=True, dq_mode="ring")),  # 32-tile walks
    (2, 1000, 77, 8, 1, 200, False, "bfloat16", dict(stagger=True, dq_mode="red")),   # MQA, 2 key tiles, 16-tile walks
    (3, 77, 1000, 4, 4, 248, False, "float16", dict(stagger=True, dq_mode="ring")),    # 2-tile walks, 16 key tiles
    (1, 64, 64, 2, 1, 216, False, "bfloat16", dict(stagger=True, dq_mode="ring")),     # one step per CTA
    (2, 300, 301, 4, 2, 256, False, "bfloat16", dict(stagger=True, dq_mode="red", num_stages=3, do_stages=1)),
    # stagger, "qk" (96 keys: CTA n starts at tile 3n / 2 mod the walk)
    (2, 77, 1000, 6, 2, 192, False, "bfloat16", dict(stagger=True)),
    (1, 1000, 1000, 4, 4, 176, False, "float16", dict(stagger=True)),
    (3, 255, 255, 16, 2, 136, False, "float16", dict(stagger=True)),                   # GQA 8:1
    (1, 2048, 2048, 2, 1, 192, False, "bfloat16", dict(stagger=True)),
    # three Q stages, one dO stage ("kt", red dQ)
    (1, 1000, 1000, 4, 2, 256, True, "bfloat16", dict(dq_mode="red", num_stages=3, do_stages=1)),   # + lpt_grid
    (2, 17, 4097, 4, 1, 248, True, "float16", dict(dq_mode="red", num_stages=3, do_stages=1, lpt_grid=False)),
    (2, 113, 1000, 8, 1, 200, False, "float16", dict(dq_mode="red", num_stages=3, do_stages=1)),   # MQA
    (1, 4097, 1000, 2, 1, 256, True, "bfloat16", dict(num_stages=3, do_stages=1, deterministic=True)),
]


def _config(d, causal, dtype, opts):
    det = opts.get("deterministic", False)
    return BIG.choose_config(dtype, d, causal, det).replace(**opts)


OP_CASES = [(192, "bfloat16"), (256, "float16")]   # test_gpu_stagger_through_the_op's head dims


def _op_configs():
    """The staggered configs test_gpu_stagger_through_the_op dispatches: varlen with and without a
    window, and dense."""
    return [BIG.choose_config(dt, d, False, False, **flags).replace(stagger=True) for d, dt in OP_CASES
            for flags in (dict(is_varlen=True), dict(is_varlen=True, has_window=True), {})]


def gpu_configs() -> set:
    """Every config the GPU tests below build (tools/prebuild_bwd_ab.py prebuilds them too)."""
    return {_config(c[5], c[6], c[7], c[8]) for c in CASES} | set(_op_configs())


@pytest.fixture(scope="module")
def prebuilt():
    """The GPU cases' configs compiled once in parallel worker processes into the disk cache."""
    from gpu_util import prebuild_sm90
    prebuild_sm90(BIG.FAMILY, gpu_configs())


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype,opts", CASES)
def test_gpu_options(batch, sq, sk, h, hkv, d, causal, dtype, opts, prebuilt):
    """Each option against the float64 reference (the 2x error rule)."""
    _require_sm90()
    det = opts.get("deterministic", False)
    cfg = _config(d, causal, dtype, opts)
    print(f"case batch={batch} sq={sq} sk={sk} h={h}/{hkv} d={d} causal={causal} {dtype} {cfg}")
    bwd_tests._gpu_case(batch, sq, sk, h, hkv, d, causal, dtype, deterministic=det, hopper=cfg)


@pytest.mark.gpu
def test_gpu_three_q_stages_deterministic_is_bit_identical(prebuilt):
    import cupy as cp
    _require_sm90()
    cfg = Cfg(dtype="bfloat16", head_dim=256, causal=True, deterministic=True, num_stages=3, do_stages=1)
    a, b = (bwd_tests._gpu_case(2, 700, 900, 4, 2, 256, True, "bfloat16", deterministic=True, seed=11, hopper=cfg)
            for _ in range(2))
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        diff = x.view(cp.uint16) != y.view(cp.uint16)
        assert not bool(diff.any()), f"d256 causal s3 do1 deterministic: {name} differs at {int(diff.sum())} elements"


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype", OP_CASES)
def test_gpu_stagger_through_the_op_varlen_and_window(monkeypatch, d, dtype, prebuilt):
    """stagger on every non-causal dispatch (choose_config wrapped), fresh launch plans: packed
    sequences (lengths 0, 1, 17, 128, 200, ...) with and without a sliding window (varlen walks
    differ per sequence), the varlen plan replayed with new data, and a dense call with seqlen_q !=
    seqlen_k; every plan recorded ran a staggered config."""
    _require_sm90()
    plain = BIG.choose_config

    def staggered(dtype, head_dim, causal, deterministic, **mask_flags):
        cfg = plain(dtype, head_dim, causal, deterministic, **mask_flags)
        return cfg if causal or deterministic else cfg.replace(stagger=True)

    A = fresh_backward_plans(monkeypatch, BIG, staggered)
    varlen_backward_rounds(d, dtype)
    plans = [p.cfg for p in A._VARLEN_BACKWARD_PLANS._plans.values()]
    assert plans and all(c.stagger for c in plans), plans
    bwd_tests._gpu_case(2, 300, 517, 4, 2, d, False, dtype)
    plans = [p.cfg for p in A._BACKWARD_PLANS._plans.values()]
    assert plans and all(c.stagger for c in plans), plans
