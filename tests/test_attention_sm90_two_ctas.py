"""attention_sm90 ctas_per_sm=2: 64-row tiles (one consumer warpgroup) built for two CTAs per SM.

CPU: validation messages, the per-CTA shared-memory limit against the occupancy calculator, the
register split (__launch_bounds__(256, 2): 128 a thread at launch, setmaxnreg 24 / 232 or 40 / 216
walking), the persistent grid (2 x SMs), the barrier model of the persistent walk with that split
(a split past the CTA's pool deadlocks), and three builds (d64 causal 64x128 walking, d128 causal
64x64 walking, d128 non-causal 64x64 one CTA per tile): no spills or local memory, 128 registers,
setmaxnreg in the SASS, no ptxas wgmma notes, 2 blocks per SM by registers, shared memory and
barriers.
GPU (``-m gpu``, sm_90): the driver's occupancy of each build (2 CTAs per SM); the float64
reference and 2x error rule with poisoned outputs over awkward shapes, walking (device grid, and
2- and 6-CTA grids where every CTA walks many tiles) and one CTA per tile; the output against the
same tile built for one CTA per SM, bit for bit.  Cheap first: a wrong phase or register split
hangs, so one tiny shape runs first (run under ``timeout``).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.arch import occupancy
from rtkernels.errors import ConfigError
from rtkernels.ops import attention_sm90 as A90
from rtkernels.ops.attention_sm90 import AttentionSm90Config

from test_attention_sm90_persistent import (PTXAS_NOTES, TINY, _need_sm90, case_id, run_and_check,
                                              _random_walk, _simulate_walk)

TWO = dict(block_m=64, num_stages=2, intra_overlap=True, pingpong=False, ctas_per_sm=2)


def _two_config(dtype, d, causal, persistent=True):
    """The tests' tile: 64 x 128 keys up to d64, 64 x 64 up to d128 (64 x 128 needs 2 x 64 KiB of
    K/V there: more than half the SM)."""
    block_n = 128 if d <= 64 else 64
    return AttentionSm90Config(dtype=dtype, head_dim=d, causal=causal, block_n=block_n, persistent=persistent,
                               **TWO)


# ---- config -------------------------------------------------------------------------------
def test_two_ctas_validation_messages():
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=64, block_m=128, block_n=64, ctas_per_sm=2)
    assert "ctas_per_sm" in str(e.value) and "block_m=64" in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=64, block_m=64, block_n=64, ctas_per_sm=3)
    assert "ctas_per_sm" in str(e.value), str(e.value)
    # d256 fits shared memory at 64 x 32 but its 64x256 wgmma does not fit 128 registers (ptxas C7602)
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=256, block_n=32, **TWO)
    assert "ctas_per_sm" in str(e.value) and "head_dim > 128" in str(e.value), str(e.value)
    # fits one CTA per SM (227 KiB) but not half the SM: the message names ctas_per_sm and the limit
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=128, block_n=128, persistent=True, **{**TWO})
    msg = str(e.value)
    assert "ctas_per_sm" in msg and str(A90.smem_limit(2)) in msg and "1 for" in msg, msg
    assert AttentionSm90Config(head_dim=128, block_n=128, persistent=True, **{**TWO, "ctas_per_sm": 1})


def test_per_cta_shared_memory_limit_matches_the_occupancy_calculator():
    lim = A90.smem_limit(2)
    assert lim == 115712 and A90.smem_limit(1) == A90.SMEM_LIMIT_SM90
    assert occupancy("sm_90", 256, 128, 0, lim).blocks_per_sm == 2
    assert occupancy("sm_90", 256, 128, 0, lim + 1).blocks_per_sm == 1
    # d64 64x128 walking: two Q buffers fit; d128 64x64 too; d64 at 3 stages only with one
    assert _two_config("bfloat16", 64, True).q_buffers == 2
    assert _two_config("bfloat16", 128, True).q_buffers == 2
    s3 = AttentionSm90Config(head_dim=64, block_n=128, persistent=True, **{**TWO, "num_stages": 3})
    assert s3.q_buffers == 1 and s3.shared_mem_bytes <= lim
    for d in (64, 80, 96, 128):
        for p in (False, True):
            assert _two_config("bfloat16", d, True, p).shared_mem_bytes <= lim


@pytest.mark.parametrize("persistent", [False, True])
def test_register_split_fits_half_the_register_file(persistent):
    cfg = _two_config("bfloat16", 64, True, persistent)
    p, c = cfg.register_split
    assert cfg.launch_registers == 128 and cfg.threads_per_block == 256
    assert 128 * p + 128 * c == cfg.threads_per_block * cfg.launch_registers   # the CTA's whole pool
    assert (p, c) == ((40, 216) if persistent else (24, 232))
    tp = cfg.template_params()
    assert (tp["ctas_per_sm"], tp["producer_regs"], tp["consumer_regs"]) == (2, p, c)
    # one CTA per SM keeps the old 64-row kernel: no split, no cap
    one = cfg.replace(ctas_per_sm=1)
    assert one.register_split == (256, 256) and one.launch_registers == 255


def test_persistent_grid_is_two_per_sm():
    cfg = _two_config("bfloat16", 64, True)
    assert A90.persistent_grid(cfg, 32, 512, 32, 132) == 264
    assert A90.persistent_grid(cfg, 1, 100, 1, 132) == 2             # never more CTAs than tiles
    assert A90.persistent_grid(cfg.replace(ctas_per_sm=1), 32, 512, 32, 132) == 132


def test_bench_tiles_spell_ctas_per_sm():
    import importlib.util
    from pathlib import Path
    path = Path(rtk.__file__).resolve().parent.parent / "tools" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("_bench_attention_tiles", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = mod.parse_tiles("64x128ovpstc2,64x64s3ov,128x128ovpstflat")
    assert t[0]["ctas_per_sm"] == 2 and t[0]["persistent"] and t[0]["block_m"] == 64
    assert t[1]["ctas_per_sm"] == 1 and t[2]["flat_walk"] and t[2]["ctas_per_sm"] == 1
    assert mod._short90(_two_config("bfloat16", 64, True)).endswith(" pst c2")


def test_model_walk_with_the_two_cta_split():
    """The persistent walk's barrier model with one consumer warpgroup and the config's split (the
    producer's setmaxnreg.dec pays the consumer's .inc within the CTA's 32768): no deadlock, every
    warp's GEMM order; a consumer asking 8 more than the pool deadlocks."""
    rng = np.random.default_rng(11)
    cfg = _two_config("bfloat16", 64, True)
    regs = (cfg.launch_registers, *cfg.register_split)
    for q_bufs in (1, 2):
        for _ in range(4):
            _simulate_walk(_random_walk(rng, 1), 2, 1, q_bufs, True, True, rng, regs)
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate_walk([(3, [3]), (2, [2])], 2, 1, 2, True, True, rng, (regs[0], regs[1], regs[2] + 8))


# ---- builds: 3 compiles, shared ---------------------------------------------------------------
BUILD_CASES = [(64, True, True), (128, True, True), (128, False, False)]


@pytest.fixture(scope="module")
def built_two():
    from concurrent.futures import ThreadPoolExecutor
    cfgs = [_two_config("bfloat16", d, c, p) for d, c, p in BUILD_CASES]
    with ThreadPoolExecutor(2) as ex:   # NVRTC releases the GIL
        kerns = list(ex.map(lambda c: rtk.get_kernel(c, arch="sm_90a"), cfgs))
    return {case: (c, k) for case, c, k in zip(BUILD_CASES, cfgs, kerns)}


@pytest.mark.parametrize("case", BUILD_CASES, ids=lambda c: "d{}_{}_{}".format(
    c[0], "causal" if c[1] else "full", "walk" if c[2] else "grid"))
def test_two_cta_builds_fit_two_per_sm_without_spills(built_two, case):
    cfg, k = built_two[case]
    r = k.resources
    assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (cfg, r)
    assert r.registers == cfg.launch_registers == 128, (cfg, r)
    occ = occupancy("sm_90", cfg.threads_per_block, r.registers, r.shared_static, cfg.shared_mem_bytes,
                    barriers=r.barriers)
    assert occ.blocks_per_sm == 2, (cfg.key(), occ, occ.limits)
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", k.sass, re.M)
    names = {o.split(".")[0] for o in ops}
    assert {"UTMALDG", "UTMASTG", "SYNCS", "USETMAXREG"} <= names, names
    assert f"HGMMA.64x{cfg.block_n}x16.F32" in k.sass and f"HGMMA.64x{cfg.head_dim}x16.F32" in k.sass
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "no local memory"
    assert not any(c in k.module.log for c in PTXAS_NOTES), k.module.log


# ---- GPU ------------------------------------------------------------------------------------
# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype): cheap first
CASES = [
    TINY,
    (1, 1, 1, 1, 1, 128, False, "float16"),
    (3, 7, 7, 5, 5, 64, True, "bfloat16"),
    (3, 129, 129, 5, 1, 64, False, "float16"),
    (2, 512, 512, 4, 2, 64, True, "bfloat16"),
    (3, 513, 513, 5, 5, 128, True, "float16"),
    (3, 1000, 1000, 5, 1, 128, True, "bfloat16"),
    (3, 1000, 513, 5, 5, 80, False, "float16"),
    (3, 1000, 1, 5, 1, 128, True, "bfloat16"),     # causal, seqlen_q > seqlen_k: rows that see no key
    (3, 300, 77, 3, 1, 64, True, "float16"),       # ... and tiles whose every row sees none
    (3, 1, 1000, 5, 5, 64, True, "float16"),
    (1, 129, 2049, 5, 1, 128, True, "bfloat16"),
    (2, 1024, 1024, 16, 16, 64, False, "bfloat16"),
    (2, 777, 901, 3, 1, 96, False, "bfloat16"),
    (2, 2049, 2049, 3, 1, 128, False, "bfloat16"),
]
_KERNELS: dict = {}


@pytest.fixture(scope="module")
def prebuilt():
    """Every config the GPU tests launch, compiled in parallel once (NVRTC releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    _need_sm90()
    cfgs = {_two_config(c[7], c[5], c[6], p) for c in CASES for p in (False, True)}
    cfgs |= {_two_config("bfloat16", *c) for c in BUILD_CASES}
    with ThreadPoolExecutor(16) as ex:
        for cfg, k in zip(cfgs, ex.map(lambda c: rtk.get_kernel(c, arch="sm_90a"), cfgs)):
            _KERNELS[cfg] = k


def _kernel(cfg):
    if cfg not in _KERNELS:
        _KERNELS[cfg] = rtk.get_kernel(cfg, arch="sm_90a")
    return _KERNELS[cfg]


def _check_case(case, sm_count, persistent=True, seed=None):
    d, causal, dtype = case[5:]
    cfg = _two_config(dtype, d, causal, persistent)
    return cfg, run_and_check(cfg, _kernel(cfg), case, sm_count, seed)


@pytest.mark.gpu
def test_gpu_two_ctas_tiny_first():
    _need_sm90()
    _check_case(TINY, None)
    _check_case(TINY, None, persistent=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", BUILD_CASES, ids=lambda c: "d{}_{}_{}".format(
    c[0], "causal" if c[1] else "full", "walk" if c[2] else "grid"))
def test_gpu_driver_keeps_two_ctas_per_sm(prebuilt, case):
    """cuOccupancyMaxActiveBlocksPerMultiprocessor with the launch's shared memory: 2 (the driver
    picks a carveout that holds both)."""
    _need_sm90()
    from cuda.bindings import driver as cu
    from rtkernels import device
    cfg = _two_config("bfloat16", *case)
    kern, dev = _kernel(cfg), device.current_device()
    fn = kern.function(dev)
    kern._raise_smem_limit(fn, dev, cfg.shared_mem_bytes)
    err, n = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(cu.CUfunction(fn.ptr), cfg.threads_per_block,
                                                            cfg.shared_mem_bytes)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    assert int(n) == 2, f"{cfg.key()}: the driver keeps {int(n)} per SM (smem {cfg.shared_mem_bytes} B)"


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [True, False], ids=["walk", "grid"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_two_ctas_device_grid(prebuilt, case, persistent):
    _need_sm90()
    _check_case(case, None, persistent)


@pytest.mark.gpu
@pytest.mark.parametrize("sm_count", [1, 3])
@pytest.mark.parametrize("case", CASES[2:], ids=case_id)
def test_gpu_two_ctas_small_grid_walks_many_tiles(prebuilt, case, sm_count):
    """2 or 6 CTAs for up to ~200 tiles: every barrier goes through many phases per CTA."""
    _need_sm90()
    _check_case(case, sm_count)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(2, 1000, 1000, 5, 1, 128, True, "bfloat16"), (2, 777, 901, 4, 2, 64, False,
                                                                                  "float16")], ids=case_id)
def test_gpu_two_ctas_match_the_one_cta_build(prebuilt, case):
    """The same tile built for one CTA per SM (no register split, no cap) computes the same sums
    in the same order: O and lse equal bit for bit."""
    _need_sm90()
    import cupy as cp
    from gpu_util import poison
    cfg, (q, k, v, o, lse) = _check_case(case, None)
    ref_cfg = cfg.replace(ctas_per_sm=1)
    o2, lse2 = poison(cp.empty_like(o)), poison(cp.empty_like(lse))
    A90.launch(_kernel(ref_cfg), ref_cfg, q, k, v, o2, lse2, case[5] ** -0.5)
    cp.cuda.get_current_stream().synchronize()
    differ = int((o2.view(cp.uint16) != o.view(cp.uint16)).sum())
    assert differ == 0, f"{case}: {differ} of {o.size} outputs differ from the one-CTA build's"
    assert cp.array_equal(lse2, lse), f"{case}: lse differs from the one-CTA build's"
