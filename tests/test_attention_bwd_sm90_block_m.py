"""attention_bwd_sm90 with 128 query rows per step (``block_m=128``, head dims <= 64) on the GPU.

Every case runs the explicit config (a silent fall-back to another kernel cannot pass for it) into
NaN-poisoned outputs and checks all three gradients against the float64 reference with the 2x rule
(tests/test_attention_bwd.py, tests/test_attention_varlen.py): head dims 8..64, both dtypes, causal
or not, seqlen_q != seqlen_k both ways, lengths whose last 128-row step holds a single 64-row dQ
tile (the accumulator has no room for the second: the kernel skips it), GQA/MQA, strided views,
deterministic runs bit-identical, varlen mixes with empty sequences, and the op's own dispatch with
the switch (``BLOCK_M_128``) on - the varlen launch plan and its replay included.  The block_m 64
kernel is the same tests' subject in tests/test_attention_bwd_sm90.py and test_attention_varlen.py.
CPU checks of the config and build: tests/test_attention_bwd_sm90.py.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from rtkernels.ops import attention_bwd_sm90 as B90
from rtkernels.ops.attention_bwd_sm90 import AttentionBwdSm90Config

import test_attention_bwd as bwd_tests   # the backward's GPU case runner (tests/ is on sys.path)

pytestmark = pytest.mark.gpu


def _require_sm90():
    import cupy as cp
    from rtkernels.ops.attention import _device_arch
    if not B90.is_sm90(_device_arch(cp.cuda.runtime.getDevice())):
        pytest.skip("the Hopper backward needs an sm_90 device")


@pytest.fixture(scope="module", autouse=True)
def _warm_kernels():
    """Every block_m 128 build the tests below run, compiled up front on all cores (NVRTC releases
    the GIL; one by one they would take most of the time budget)."""
    from concurrent.futures import ThreadPoolExecutor
    from rtkernels import device
    _require_sm90()
    arch = device.current_arch()
    cfgs = {_cfg(("float16", "bfloat16")[(d // 8 + c) % 2], d, c, d in (8, 40, 56)) for d in (8, 32, 40, 56, 64)
            for c in (False, True)}
    cfgs |= {_cfg(dt, 64, c, det) for dt in ("float16", "bfloat16") for c in (False, True) for det in (False, True)}
    cfgs |= {_cfg("float16", 48, True)}
    cfgs |= {_cfg(dt, 64, c, det, is_varlen=True) for dt in ("float16", "bfloat16") for c in (False, True)
             for det in (False, True)}
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda c: B90.kernels_for(c, arch), cfgs))


def _cfg(dtype, d, causal, det=False, **flags):
    return AttentionBwdSm90Config(dtype=dtype, head_dim=d, causal=causal, deterministic=det, block_m=128, **flags)


def _case(batch, sq, sk, h, hkv, d, causal, dtype, det=False, **kw):
    _require_sm90()
    print(f"block_m=128 batch={batch} sq={sq} sk={sk} h={h}/{hkv} d={d} causal={causal} {dtype} det={det} {kw}")
    return bwd_tests._gpu_case(batch, sq, sk, h, hkv, d, causal, dtype, deterministic=det,
                               hopper=_cfg(dtype, d, causal, det), **kw)


@pytest.mark.parametrize("d", [8, 32, 40, 56, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(d, causal):
    dtype = ("float16", "bfloat16")[(d // 8 + causal) % 2]
    _case(2, 113, 203, 4, 2, d, causal, dtype, det=d in (8, 40, 56))


# (sq, sk): one row; one key; a 128-row step whose second dQ tile lies past seqlen_q (65, 193:
# ceil(sq / 64) odd); exact multiples; keys past queries and queries past keys; causal rows with
# no key (sq > sk); several steps with a ragged tail.
SEQLENS = [(1, 1), (1, 300), (300, 1), (65, 65), (193, 500), (500, 193), (128, 128), (256, 384), (1000, 999),
           (2049, 2047)]


@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(sq, sk, causal):
    _case(1, sq, sk, 2, 1, 64, causal, "float16" if (sq + sk) % 2 else "bfloat16", det=(sq % 2 == 1))


@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype,det", [
    (3, 255, 255, 16, 2, 64, True, "bfloat16", False),    # GQA 8:1
    (2, 113, 1000, 8, 1, 64, False, "float16", True),     # MQA, deterministic
    (1, 1000, 255, 8, 1, 48, True, "float16", False),     # MQA, causal rows that see no key
    (1, 2048, 2048, 2, 2, 64, True, "bfloat16", True),
    (2, 17, 4097, 4, 1, 64, True, "float16", False),
])
def test_combined(batch, sq, sk, h, hkv, d, causal, dtype, det):
    _case(batch, sq, sk, h, hkv, d, causal, dtype, det=det)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_strided_inputs_and_custom_scale(dtype):
    _case(2, 333, 333, 4, 4, 64, True, dtype, softmax_scale=0.3, strided=True)


@pytest.mark.parametrize("causal,hkv", [(False, 4), (True, 2), (True, 1)])
def test_deterministic_is_bit_identical(causal, hkv):
    import cupy as cp
    a = _case(2, 700, 900, 4, hkv, 64, causal, "bfloat16", det=True, seed=11)
    b = _case(2, 700, 900, 4, hkv, 64, causal, "bfloat16", det=True, seed=11)
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        diff = x.view(cp.uint16) != y.view(cp.uint16)
        assert not bool(diff.any()), f"{name}: {int(diff.sum())} elements differ between two deterministic runs"


# ---- varlen ------------------------------------------------------------------------------------------
def _varlen(lens_q, lens_k, h, hkv, d, dtype, causal, det=False, seed=None):
    """Forward (checked) then the block_m 128 backward with its explicit config, checked per gradient."""
    import cupy as cp
    from gpu_util import poison, random_array
    from rtkernels.ops.attention_bwd import attention_backward
    V = importlib.import_module("test_attention_varlen")
    _require_sm90()
    seed = int(np.random.SeedSequence().entropy % 2**32) if seed is None else seed
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    cu_q, cu_k, q, k, v, o, lse = V._varlen_forward(rng, lens_q, lens_k, h, hkv, d, dtype, causal)
    do = random_array(rng, q.shape, dtype)[0]
    grads = [poison(cp.empty(a.shape, a.dtype)) for a in (q, k, v)]
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    mask = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out = attention_backward(do, q, k, v, o, lse, deterministic=det, dq=grads[0], dk=grads[1], dv=grads[2],
                             max_seqlen_q=int(max(lens_q)), max_seqlen_k=int(max(lens_k)),
                             config=_cfg(dtype, d, causal, det, is_varlen=True), **mask, **extra)
    assert all(a is b for a, b in zip(out, grads))
    cp.cuda.get_current_stream().synchronize()
    where = (f"block_m=128 varlen backward lens_q={list(lens_q)} lens_k={list(lens_k)} h={h} hkv={hkv} d={d} "
             f"{dtype} causal={causal} deterministic={det}")
    V._backward_check(do, q, k, v, dtype, grads, where, **mask)
    return grads


# the mix (1, 2, 17, 128, 1000, 4097, empty sequences, keys != queries) and short sequences
# whose lengths end a 128-row step on its first half (65, 193)
MIX_Q = [1, 2, 17, 0, 128, 1000, 4097, 0, 300]
MIX_K = [1, 5, 17, 3, 128, 1000, 4097, 0, 257]
SHORT = [65, 0, 193, 1, 64, 129, 300]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", ["mix", "short"])
def test_varlen(causal, lens):
    lq, lk = (MIX_Q, MIX_K) if lens == "mix" else (SHORT, SHORT[::-1])
    _varlen(lq, lk, 4, 2, 64, "bfloat16" if causal else "float16", causal)


def test_varlen_deterministic_is_bit_identical():
    import cupy as cp
    a = _varlen(MIX_Q, MIX_K, 4, 2, 64, "bfloat16", True, det=True, seed=5)
    b = _varlen(MIX_Q, MIX_K, 4, 2, 64, "bfloat16", True, det=True, seed=5)
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        diff = x.view(cp.uint16) != y.view(cp.uint16)
        assert not bool(diff.any()), f"{name}: {int(diff.sum())} elements differ between two deterministic runs"


def test_op_dispatch_with_the_switch(monkeypatch):
    """BLOCK_M_128 on: default calls (no config) run block_m 128 at d64 - dense, and varlen through
    a recorded launch plan and its replay with new data - and stay within the 2x rule."""
    _require_sm90()
    from rtkernels.ops._arrays import LaunchPlans
    A = importlib.import_module("rtkernels.ops.attention_bwd")
    monkeypatch.setattr(B90, "BLOCK_M_128", True)
    monkeypatch.setattr(A, "_BACKWARD_PLANS", LaunchPlans())
    monkeypatch.setattr(A, "_VARLEN_BACKWARD_PLANS", LaunchPlans())
    assert B90.choose_config("bfloat16", 64, True, False, is_varlen=True).block_m == 128
    for seed in (1, 2):
        bwd_tests._gpu_case(1, 300, 257, 4, 2, 64, True, "bfloat16", seed=seed)
    assert [p.cfg.block_m for p in A._BACKWARD_PLANS._plans.values()] == [128]
    V = importlib.import_module("test_attention_varlen")
    for seed in (3, 4):   # the second call replays the plan the first recorded
        V._varlen_backward(np.random.default_rng(seed), MIX_Q, MIX_K, 4, 2, 64, "bfloat16", True)
    assert [p.cfg.block_m for p in A._VARLEN_BACKWARD_PLANS._plans.values()] == [128]
