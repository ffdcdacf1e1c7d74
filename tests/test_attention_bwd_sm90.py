"""attention_bwd_sm90: the Hopper backward (TMA + wgmma, two consumer warpgroups) behind
rtk.attention_backward on sm_90 for head dims up to 128.

CPU: config validation, every config the op can pick compiles for sm_90a without spills or local
memory, and its SASS holds the wgmma (HGMMA), TMA (UTMALDG) and dQ reductions (REDG) it is built on.
GPU (``-m gpu``, sm_90 only): the backward's reference and 2x error rule (tests/test_attention_bwd.py)
through the Hopper kernel explicitly: every head dim 8..128, ragged and causal seqlens with
seqlen_q != seqlen_k, GQA/MQA, strided views, deterministic runs bit-identical (also under
random shapes beside a concurrent kernel: the stress test of issue 22); the mma.sync fall-backs
(the switch off) still give the same answers; head dims 136..256: tests/test_attention_bwd_sm90_big.py.
"""
from __future__ import annotations

import importlib

import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError
from rtkernels.ops import attention_bwd_sm90 as B90
from rtkernels.ops.attention_bwd_sm90 import AttentionBwdSm90Config
from rtkernels.ops._arrays import LaunchPlans

import test_attention_bwd as bwd_tests   # the backward's GPU case runner and grids (tests/ is on sys.path)

HEAD_DIMS = list(range(8, 129, 8))


@pytest.mark.parametrize("bad", [dict(head_dim=136), dict(head_dim=12), dict(dtype="float32"), dict(num_stages=1),
                                 dict(num_stages=4), dict(deterministic="yes"), dict(block_m=96), dict(block_m=32),
                                 dict(block_m=128, head_dim=72), dict(block_m=128, has_window=True),
                                 dict(block_m=128, has_softcap=True), dict(block_m=128, num_stages=3)])
def test_config_rejects(bad):
    with pytest.raises(ConfigError) as e:
        AttentionBwdSm90Config(**bad)
    assert "attention_bwd_sm90" in str(e.value) and any(name in str(e.value) for name in bad)


def test_config_derived_values():
    c = AttentionBwdSm90Config(dtype="bf16", head_dim=80)
    assert c.dtype == "bfloat16" and c.d_blocks == 2 and c.block_n == 128 and c.threads_per_block == 384
    # K, V 128 rows x 2 blocks x 128 B; 2 stages x (Q, dO 64 x 2 x 128 B + lse, delta 2 x 256 B);
    # dS^T 2 x 128 x 128 B; dQ 2 x 64 x 80 x 4 B; 9 barriers; 1 KiB slack
    assert c.shared_mem_bytes == (2 * 128 * 2 * 128 + 2 * (2 * 64 * 2 * 128 + 512) + 2 * 128 * 128 + 2 * 64 * 80 * 4
                                  + 8 * 9 + 1024)
    assert rtk.families()["attention_bwd_sm90"] is AttentionBwdSm90Config and AttentionBwdSm90Config.needs_arch_specific
    assert B90.heuristic_configs(("bfloat16",))[0].shared_mem_bytes <= B90.SMEM_LIMIT_SM90
    # block_m 128: Q, dO tiles of 128 rows, dS^T of 128 queries; still two 64-row dQ slots
    c = AttentionBwdSm90Config(dtype="bf16", head_dim=64, block_m=128, causal=True, is_varlen=True)
    assert c.shared_mem_bytes == (2 * 128 * 128 + 2 * (2 * 128 * 128 + 1024) + 2 * 128 * 256 + 2 * 64 * 64 * 4
                                  + 8 * 9 + 1024) <= B90.SMEM_LIMIT_SM90
    assert AttentionBwdSm90Config().block_m == 64 and c.key() != c.replace(block_m=64).key()


def test_query_step_switch(monkeypatch):
    """block_m 128 by default where the 128-row kernel exists; the switch off gives 64 everywhere."""
    monkeypatch.setattr(B90, "BLOCK_M_128", False)
    assert all(c.block_m == 64 for c in B90.heuristic_configs(("bfloat16",)))
    monkeypatch.setattr(B90, "BLOCK_M_128", True)
    assert {c.block_m for c in B90.heuristic_configs(("bfloat16",)) if c.head_dim <= 64} == {128}
    assert B90.choose_config("bfloat16", 64, True, True, is_varlen=True).block_m == 128
    assert B90.choose_config("bfloat16", 72, True, False).block_m == 64
    assert B90.choose_config("bfloat16", 64, False, False, has_softcap=True).block_m == 64
    assert B90.choose_config("bfloat16", 192, False, False).block_m == 64   # attention_bwd_sm90_big: always 64


def test_dispatch_rules():
    class V:
        def __init__(self, strides, shape=(4, 512, 16, 64)):
            self.strides, self.shape = strides, shape
    views = (V((1 << 20, 2048, 128, 2)),)
    assert not B90.runnable("sm_90", (V((0, 2048, 128, 2)),), 100)   # a batch broadcast: tensor maps have no stride 0
    assert B90.eligible("sm_90", views, 100, 128)
    assert B90.eligible("sm_90", views, 100, 136)         # head dims > 128: attention_bwd_sm90_big
    assert not B90.eligible("sm_80", views, 100, 64)
    assert not B90.eligible("sm_90", views, 0, 64)        # no key: nothing for a tensor map to address
    assert not B90.eligible("sm_90", views, 100, 120, False) and B90.eligible("sm_90", views, 100, 120, True)
    assert B90.runnable("sm_90", views, 100) and not B90.runnable("sm_86", views, 100)


@pytest.mark.slow
@pytest.mark.parametrize("causal,det", [(False, False), (True, True)])
def test_dispatched_configs_compile_without_spills(causal, det):
    from rtkernels.kernel import get_kernel
    for d in HEAD_DIMS:
        dt = ("float16", "bfloat16")[d // 8 % 2]
        k = get_kernel(B90.choose_config(dt, d, causal, det), arch="sm_90a")
        r = k.resources
        spills = bool(r.spill_stores or r.spill_loads or r.stack_frame)
        # the op never dispatches a spilling case (SPILLING lists those; (120, False) has built
        # without spills under NVRTC 13.5 since the mask options, and stays listed until measured)
        assert not spills or (d, causal) in B90.SPILLING, (d, causal, r)


@pytest.mark.parametrize("d,causal,det", [(64, False, False), (128, True, True), (72, True, False)])
def test_sass_has_wgmma_tma_and_reductions(d, causal, det):
    from rtkernels.kernel import get_kernel
    # the 64-row step (d64 dispatches 128 rows: test_block_m_128_builds_clean covers that one)
    sass = get_kernel(B90.choose_config("bfloat16", d, causal, det).replace(block_m=64), arch="sm_90a").sass
    d_steps, m_steps, n_steps = -(-d // 16), 4, 8
    # per step: S^T and dP^T over the head dim, dV and dK over the query tile, dQ over 128 keys
    assert sass.count("HGMMA") == 2 * d_steps + 2 * m_steps + n_steps
    # dQ tiles leave through one bulk reduction each (UBLKRED), not per-thread REDs
    assert "UTMALDG" in sass and "UBLKRED" in sass and "LDL" not in sass and "STL" not in sass
    conv = get_kernel(B90.choose_config("bfloat16", d, causal, det), "attention_bwd_sm90_dq_convert", arch="sm_90a")
    assert "LDG.E.128" in conv.sass and "STG.E.128" in conv.sass and conv.resources.spill_stores == 0


@pytest.mark.parametrize("causal,det,varlen", [(False, False, False), (True, True, True)])
def test_block_m_128_builds_clean(causal, det, varlen):
    """128 query rows per step at head_dim 64: no spill or local memory, and per step 2 x 4 k-steps
    of S^T / dP^T, 2 x 8 of dV / dK over 128 queries, 2 x 8 of dQ (one m64 wgmma chain per half)."""
    from rtkernels.kernel import get_kernel
    cfg = AttentionBwdSm90Config(dtype="bfloat16", head_dim=64, causal=causal, deterministic=det, is_varlen=varlen,
                                 block_m=128)
    k = get_kernel(cfg, arch="sm_90a")
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), r
    sass = k.sass
    assert sass.count("HGMMA") == 2 * 4 + 2 * 8 + 2 * 8
    assert "UTMALDG" in sass and sass.count("UBLKRED") >= 1 and "LDL" not in sass and "STL" not in sass


def test_every_consumer_thread_releases_its_ring_stage():
    """Issue 22: each consumer thread arrives on empty[stage] after its own lse/delta loads, so
    the release orders them without relying on another barrier (racecheck reported the lane-0-only
    release as 4102 WAR hazards): the arrive on empty[] is not predicated on a lane."""
    import re
    from rtkernels.kernel import get_kernel
    cfg = B90.choose_config("bfloat16", 128, True, True)
    sass = get_kernel(cfg, arch="sm_90a").sass
    bars = cfg.shared_mem_bytes - 1024 - 8 * (1 + 2 * cfg.num_stages + 4)   # the template's BAR_OFFSET
    empty0 = bars + 8 * (1 + cfg.num_stages)                                # kv, full[], then empty[]
    arrives = [line for line in sass.splitlines() if "SYNCS.ARRIVE" in line and f"+{empty0:#x}]" in line]
    assert arrives, f"no arrive on empty[0] (smem offset {empty0:#x}) found in the SASS"
    assert not any(re.search(r"@!?U?P[0-9T]", line) for line in arrives), arrives


def test_dq_tile_order_is_a_permutation_that_convert_inverts():
    """Model of dq_tile_index (consumer register i of thread tid -> tile slot) and of the
    conversion's read: every (row, col) of a 64 x d tile lands in exactly one slot, and reading
    slot j*512 + tid*4 + e back gives the row/col the convert kernel assumes."""
    for d in (8, 40, 128):
        slot_of = {}
        for tid in range(128):
            warp, lane = divmod(tid, 32)
            for i in range(d // 2):
                j, e = divmod(i, 4)
                row = 16 * warp + lane // 4 + 8 * (e // 2)
                col = 8 * j + 2 * (lane % 4) + e % 2
                slot_of[(row, col)] = (i // 4) * 512 + tid * 4 + i % 4
        assert sorted(slot_of.values()) == list(range(64 * d))
        assert set(slot_of) == {(r, c) for r in range(64) for c in range(d)}
        for tid in range(128):   # the convert kernel: float4 j of thread tid = rows r, r + 8, cols c, c + 1
            warp, lane = divmod(tid, 32)
            r, c = 16 * warp + lane // 4, 2 * (lane % 4)
            for j in range(d // 8):
                base = j * 512 + tid * 4
                assert [slot_of[(r, 8 * j + c)], slot_of[(r, 8 * j + c + 1)], slot_of[(r + 8, 8 * j + c)],
                        slot_of[(r + 8, 8 * j + c + 1)]] == [base, base + 1, base + 2, base + 3]


# ---- GPU -------------------------------------------------------------------------------------
def _require_sm90():
    from rtkernels.ops.attention import _device_arch
    import cupy as cp
    if not B90.is_sm90(_device_arch(cp.cuda.runtime.getDevice())):
        pytest.skip("the Hopper backward needs an sm_90 device")


def _case(*args, config=True, **kw):
    """bwd_tests._gpu_case through the Hopper kernel (its config given explicitly, so a silent
    fall-back to the mma.sync kernel cannot pass for it)."""
    _require_sm90()
    batch, sq, sk, h, hkv, d, causal, dtype = args
    return bwd_tests._gpu_case(*args, **kw, hopper=B90.choose_config(dtype, d, causal, kw.get("deterministic", False))
                               if config else None)


@pytest.mark.gpu
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dims(d, causal):
    dtype = ("float16", "bfloat16")[(d // 8 + causal) % 2]
    # (an explicit config runs even where the op would not pick it: the spilling case is still right)
    _case(2, 113, 203, 4, 2, d, causal, dtype, deterministic=(d % 3 == 0))


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", bwd_tests.SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_seqlens(sq, sk, causal):
    _case(*bwd_tests.seqlen_args(sq, sk, causal))


# the backward's combined cases, head dims beyond 128 brought to 120 (this kernel's range), plus
# long queries over fewer keys, causal and deterministic
COMBINED = [(*c[:5], c[5] if c[5] <= 128 else 120, *c[6:]) for c in bwd_tests.COMBINED_CASES] + [
    (1, 4097, 1000, 2, 1, 128, True, "bfloat16", True)]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype,det", COMBINED)
def test_gpu_combined(batch, sq, sk, h, hkv, d, causal, dtype, det):
    _case(batch, sq, sk, h, hkv, d, causal, dtype, deterministic=det)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_strided_inputs_and_custom_scale(dtype):
    _case(2, 333, 333, 4, 4, 72, True, dtype, softmax_scale=0.3, strided=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,hkv", [(64, False, 4), (128, True, 2), (40, True, 1)])
def test_gpu_deterministic_is_bit_identical(d, causal, hkv):
    import cupy as cp
    a = _case(2, 700, 900, 4, hkv, d, causal, "bfloat16", deterministic=True, seed=11)
    b = _case(2, 700, 900, 4, hkv, d, causal, "bfloat16", deterministic=True, seed=11)
    for x, y in zip(a, b):
        assert bool((x.view(cp.uint16) == y.view(cp.uint16)).all())


@pytest.mark.gpu
def test_gpu_deterministic_stress_bit_identical():
    """Issue 22's stress test: random shapes and inputs; every deterministic backward runs three
    times - alone, then beside a memory- and SM-bound kernel on another stream (other TMA latencies,
    other SMs and CTA order), then alone again - and must give the same bits, free of NaN and close
    to the unordered (default) run."""
    _require_sm90()
    import cupy as cp
    import numpy as np
    from gpu_util import random_array
    from rtkernels.ops.attention import attention
    from rtkernels.ops.attention_bwd import attention_backward
    rng = np.random.default_rng(22)
    main, side = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    noise = rtk.elementwise("y = x * 2 + 1")
    with side:
        big = cp.ones(1 << 26, cp.float32)                  # 256 MiB: longer than any backward below
        big_out = cp.empty_like(big)
    for it in range(16):
        d, causal = int(rng.choice([64, 128])), bool(rng.integers(2))
        hkv = int(rng.choice([1, 2]))
        batch, h = int(rng.integers(1, 3)), hkv * int(rng.choice([1, 2]))
        sq, sk = (int(x) for x in rng.integers(1, 700, size=2))
        what = f"iteration {it}: batch={batch} sq={sq} sk={sk} h={h}/{hkv} d={d} causal={causal}"
        with main:
            q, k, v, do = (random_array(rng, s, "bfloat16")[0] for s in ((batch, sq, h, d), (batch, sk, hkv, d),
                                                                        (batch, sk, hkv, d), (batch, sq, h, d)))
            o, lse = attention(q, k, v, causal=causal, dtype="bfloat16")
            cfg = B90.choose_config("bfloat16", d, causal, True)
            runs = []
            for busy in (False, True, False):
                if busy:
                    side.wait_event(main.record())
                    noise(big, out=big_out, stream=side)   # queued first: the backward starts beside it
                runs.append(attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=True, config=cfg,
                                               dtype="bfloat16", stream=main))
            loose = attention_backward(do, q, k, v, o, lse, causal=causal, dtype="bfloat16", stream=main,
                                       config=B90.choose_config("bfloat16", d, causal, False))
        main.synchronize()
        side.synchronize()
        for name, first, again, again2, other in zip(("dq", "dk", "dv"), *runs, loose):
            a = first.view(cp.uint16)
            for r, x in enumerate((again, again2), 1):
                diff = a != x.view(cp.uint16)
                assert not bool(diff.any()), f"{what}: {name} of run {r} differs from run 0 at " \
                                             f"{int(diff.sum())} elements, first {np.argwhere(diff.get())[0]}"
            f0 = (first.astype(cp.uint32) << 16).view(cp.float32)
            f1 = (other.astype(cp.uint32) << 16).view(cp.float32)
            assert not bool(cp.isnan(f0).any()), f"{what}: NaN in {name}"
            den = float(cp.linalg.norm(f1))
            rel = float(cp.linalg.norm(f0 - f1)) / (den if den > 0 else 1.0)
            assert rel < 1e-2, f"{what}: {name} deterministic vs default rel diff {rel:.3g}"


@pytest.mark.gpu
def test_gpu_default_dispatch_and_fallbacks(monkeypatch):
    """Default calls reach the Hopper kernel for d <= 128 (same answers as the explicit config) and
    attention_bwd_sm90_big for d 136; with the switch off the mma.sync kernel answers within the
    same error rule."""
    _require_sm90()
    bwd_tests._gpu_case(1, 300, 257, 4, 2, 128, True, "bfloat16")
    bwd_tests._gpu_case(1, 300, 257, 4, 2, 136, True, "float16")
    monkeypatch.setattr(B90, "ENABLED", False)
    bwd_tests._gpu_case(1, 300, 257, 4, 2, 64, False, "bfloat16")


@pytest.mark.gpu
def test_gpu_config_mismatch_raises():
    _require_sm90()
    import cupy as cp
    A = importlib.import_module("rtkernels.ops.attention_bwd")
    q = cp.ones((1, 16, 2, 64), cp.float16)
    lse = cp.zeros((1, 2, 16), cp.float32)
    with pytest.raises(ConfigError, match="config must be"):
        A.attention_backward(q, q, q, q, q, lse, config=AttentionBwdSm90Config(dtype="float16", head_dim=128))


@pytest.mark.gpu
def test_gpu_launch_plans_replay_per_signature_cupy(monkeypatch):
    """Repeated signatures replay the first call's launches (fresh data each time, outputs given
    and not); deterministic and causal are other plans."""
    _require_sm90()
    A = importlib.import_module("rtkernels.ops.attention_bwd")
    monkeypatch.setattr(A, "_BACKWARD_PLANS", LaunchPlans())
    for seed in (1, 2, 3):
        bwd_tests._gpu_case(1, 300, 257, 4, 2, 64, True, "bfloat16", seed=seed)
        bwd_tests._gpu_case(2, 200, 200, 2, 2, 128, False, "float16", seed=seed, deterministic=True)
    assert len(A._BACKWARD_PLANS) == 2
    import numpy as np
    from gpu_util import random_array
    g = np.random.default_rng(7)
    q, k, v, do = (random_array(g, (1, 96, 2, 64), "float16")[0] for _ in range(4))
    o, lse = rtk.attention(q, k, v)
    first = A.attention_backward(do, q, k, v, o, lse)          # outputs allocated by the op
    again = A.attention_backward(do, q, k, v, o, lse)          # replayed: same bits (deterministic dK/dV)
    for x, y in zip(first[1:], again[1:]):
        assert bool((x == y).all())
    assert len(A._BACKWARD_PLANS) == 3


@pytest.mark.gpu
def test_gpu_launch_plans_replay_per_signature_torch(monkeypatch):
    """torch tensors: replays go to torch's current stream (inputs written on a side stream right
    before each call) and match autograd's SDPA gradients."""
    _require_sm90()
    torch = pytest.importorskip("torch")
    A = importlib.import_module("rtkernels.ops.attention_bwd")
    monkeypatch.setattr(A, "_BACKWARD_PLANS", LaunchPlans())
    s = torch.cuda.Stream()
    g = torch.Generator(device="cuda").manual_seed(2)
    for trial in range(3):
        with torch.cuda.stream(s):
            q, k, v, do = (torch.randn(1, 300, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(4))
            q.mul_(1.5)
            o, lse = rtk.attention(q, k, v, causal=True)
            dq, dk, dv = A.attention_backward(do, q, k, v, o, lse, causal=True)
            qt, kt, vt = (x.float().transpose(1, 2).requires_grad_() for x in (q, k, v))
            mask = torch.ones(300, 300, dtype=torch.bool, device="cuda").tril()
            ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
            ref.backward(do.float().transpose(1, 2))
        s.synchronize()
        for got, r in ((dq, qt.grad), (dk, kt.grad), (dv, vt.grad)):
            r = r.transpose(1, 2)
            assert got.dtype == torch.bfloat16
            assert ((got.float() - r).norm() / r.norm()).item() < 2e-2
    assert len(A._BACKWARD_PLANS) == 1


def test_compile_ahead_builds_the_backward_once_on_a_thread(monkeypatch):
    """compile_ahead (the torch layer's hook on a forward that records for autograd) builds the
    backward's kernels on a background thread - what the backward call then finds in the memo -
    once per (dtype, head_dim, causal, device); RTKERNELS_COMPILE_AHEAD=0 and inputs the backward
    refuses start nothing; a failure stays in the thread (the backward call meets it)."""
    import threading
    from rtkernels.ops import attention_bwd as bwd
    monkeypatch.setattr(bwd, "_AHEAD", set())
    monkeypatch.setattr(bwd, "_device_arch", lambda dev: "sm_90")
    started = []
    real_thread = threading.Thread

    def tracking(*a, **kw):
        t = real_thread(*a, **kw)
        if kw.get("name") == "rtk-compile-ahead":   # (not get_kernels' pool threads)
            started.append(t)
        return t
    monkeypatch.setattr(threading, "Thread", tracking)
    cfg = B90.choose_config("float16", 72, True, False)
    monkeypatch.setattr(B90, "_KERNELS", {})
    bwd.compile_ahead("float16", 72, True, 0)
    bwd.compile_ahead("float16", 72, True, 0)             # (the second call: nothing)
    assert len(started) == 1 and started[0].daemon
    started[0].join(300)
    assert (cfg, "sm_90") in B90._KERNELS
    assert B90.kernels_for(cfg, "sm_90") is B90._KERNELS[(cfg, "sm_90")]
    monkeypatch.setenv("RTKERNELS_COMPILE_AHEAD", "0")
    bwd.compile_ahead("float16", 64, True, 0)
    monkeypatch.delenv("RTKERNELS_COMPILE_AHEAD")
    bwd.compile_ahead("float32", 64, True, 0)
    bwd.compile_ahead("float16", 60, True, 0)
    assert len(started) == 1
    monkeypatch.setattr(bwd, "_device_arch", lambda dev: 1 / 0)   # (no device: the thread swallows it)
    bwd.compile_ahead("float16", 64, False, 1)
    started[1].join(60)
    assert not started[1].is_alive()
