"""rtkernels.dist on the CPU: layouts, the per-(rank, step) blocks against the global causal mask,
the whole ring (forward and backward) on simulated ranks with float64 NumPy kernels, the merge
math, the merge kernel's compile, the launcher and the communicator plumbing.

GPU tests: tests/test_ring_gpu.py (simulated ranks on one GPU), tests/test_ring_multigpu.py (NCCL).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import rtkernels as rtk
import rtkernels.dist as rd
from rtkernels.dist import comm as rcomm
from rtkernels.dist import schedule
from rtkernels.dist.ring import NumpyKernels
from rtkernels.errors import ConfigError
from rtkernels.ops.attention_merge import AttentionMergeConfig, attention_merge_reference, threads_per_row

WORLDS = (2, 4, 8)


# ---- layouts --------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", rd.LAYOUTS)
@pytest.mark.parametrize("world", (1,) + WORLDS)
def test_positions_partition_the_sequence(layout, world):
    L = 6
    pos = np.concatenate([rd.positions(layout, r, world, L) for r in range(world)])
    assert sorted(pos.tolist()) == list(range(world * L))
    for r in range(world):   # local order follows global order: step 0's block is an ordinary causal one
        assert np.all(np.diff(rd.positions(layout, r, world, L)) > 0)


@pytest.mark.parametrize("layout", rd.LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
def test_shard_unshard_round_trip(layout, world):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4 * world, 3, 8))
    shards = [rd.shard(x, r, world, layout) for r in range(world)]
    for r, s in enumerate(shards):
        assert s.flags.c_contiguous
        np.testing.assert_array_equal(s, x[:, rd.positions(layout, r, world, 4)])
    np.testing.assert_array_equal(rd.unshard(shards, layout), x)
    lse = rng.standard_normal((2, 3, 4 * world))   # (batch, heads, seqlen): dim=2
    np.testing.assert_array_equal(rd.unshard([rd.shard(lse, r, world, layout, dim=2) for r in range(world)],
                                             layout, dim=2), lse)


def test_uneven_lengths_are_config_errors():
    x = np.zeros((1, 10, 2, 8))
    with pytest.raises(ConfigError, match=r"x_full.shape\[1\]=10 does not split into 4 .* multiple of 4"):
        rd.shard(x, 0, 4, "striped")
    with pytest.raises(ConfigError, match=r"multiple of 8"):
        rd.shard(x, 0, 4, "zigzag")
    rd.shard(x, 0, 5, "zigzag")   # 10 = 2 * 5 chunks of 1
    q = np.zeros((1, 3, 2, 8))
    with pytest.raises(ConfigError, match=r"q.shape\[1\]=3 is odd.*zigzag"):
        rd.ring_attention(q, q, q, layout="zigzag", comm=rd.SingleComm())
    with pytest.raises(ConfigError, match="layout"):
        rd.ring_attention(q, q, q, layout="ring", comm=rd.SingleComm())


# ---- schedule: every (rank, step) block against the global causal mask ------------------------
def _global_mask(layout, causal, rank, src, world, L):
    pq = rd.positions(layout, rank, world, L)[:, None]
    pk = rd.positions(layout, src, world, L)[None, :]
    return pk <= pq if causal else np.ones((L, L), bool)


@pytest.mark.parametrize("layout", rd.LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_are_the_global_mask_projected_onto_each_rank_pair(layout, world, causal):
    for L in ((2, 6, 8) if layout == "zigzag" else (1, 2, 5, 8)):
        for rank in range(world):
            steps = rd.plan(layout, causal, rank, world, L)
            assert len(steps) == world and steps[0].q_rows == (0, L) and steps[0].k_rows == (0, L)
            for t, blk in enumerate(steps):
                src = schedule.source_rank(rank, t, world)
                want = _global_mask(layout, causal, rank, src, world, L)
                got = schedule.block_mask(blk, L)
                assert np.array_equal(got, want), (layout, world, causal, L, rank, t, blk)
                if blk is not None:   # no row or column of the block is entirely masked (no wasted tiles)
                    sub = got[blk.q_rows[0]:blk.q_rows[1], blk.k_rows[0]:blk.k_rows[1]]
                    assert sub.any(axis=1).all() and sub.any(axis=0).all()
                    assert blk.pairs() == int(want.sum())


@pytest.mark.parametrize("world", WORLDS)
def test_striped_and_zigzag_balance_the_causal_ring(world):
    L = 64
    for layout in ("striped", "zigzag"):
        for t in range(world):
            work = [rd.plan(layout, True, r, world, L)[t] for r in range(world)]
            pairs = [b.pairs() for b in work]
            assert max(pairs) - min(pairs) <= (L if layout == "striped" else 0), (layout, t, pairs)
    # the lock-step critical path: contiguous waits on its busiest rank every step
    crit = {lay: schedule.critical_path(lay, True, world, L) for lay in rd.LAYOUTS}
    assert crit["contiguous"] / crit["striped"] >= 1.45 and crit["contiguous"] / crit["zigzag"] >= 1.45
    assert schedule.critical_path("striped", False, world, L) == world * L * L


# ---- the ring on simulated CPU ranks (float64 reference kernels, NaN-poisoned buffers) ---------
def _full(q, k, v, do, causal, scale):
    K = NumpyKernels()
    o = np.empty_like(q)
    lse = K.attention(q, k, v, causal, scale, o)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    K.attention_backward(do, q, k, v, o, lse, causal, scale, dq, dk, dv)
    return o, lse, dq, dk, dv


def _run_ring(world, layout, causal, q, k, v, do, scale):
    def rank_fn(comm):
        sh = [rd.shard(x, comm.rank, world, layout) for x in (q, k, v, do)]
        o, lse = rd.ring_attention(*sh[:3], causal=causal, softmax_scale=scale, layout=layout, comm=comm,
                                   return_lse=True)
        return (o, lse) + rd.ring_attention_backward(sh[3], *sh[:3], o, lse, causal=causal, softmax_scale=scale,
                                                     layout=layout, comm=comm)
    sim = rd.SimulatedComm(world, device="cpu")
    res = sim.run(rank_fn)
    return sim, [rd.unshard([r[i] for r in res], layout, dim=2 if i == 1 else 1) for i in range(5)]


@pytest.mark.parametrize("layout", rd.LAYOUTS)
@pytest.mark.parametrize("world", (1,) + WORLDS)
@pytest.mark.parametrize("causal", [False, True])
def test_ring_matches_full_attention_forward_and_backward(layout, world, causal):
    rng = np.random.default_rng(world * 10 + causal)
    L, B, H, Hkv, D = 6, 2, 4, 2, 8
    S = L * world
    q, do = (rng.standard_normal((B, S, H, D)) for _ in range(2))
    k, v = (rng.standard_normal((B, S, Hkv, D)) for _ in range(2))
    scale = 0.37
    sim, got = _run_ring(world, layout, causal, q, k, v, do, scale)
    ref = _full(q, k, v, do, causal, scale)
    for name, g, r in zip(("o", "lse", "dq", "dk", "dv"), got, ref):
        assert not np.isnan(g).any(), f"{name}: NaN (a buffer read before it was written)"
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-10, err_msg=name)
    # world - 1 K/V shifts forward; world - 1 K/V + world dK/dV shifts backward
    assert sim.rounds == (0 if world == 1 else 3 * world - 2)


def test_simulated_comm_reports_mismatched_shifts():
    sim = rd.SimulatedComm(2, device="cpu")

    def rank_fn(comm):
        n = 3 if comm.rank == 0 else 4
        comm.shift([np.zeros(n)], [np.zeros(n)], after=None)
    with pytest.raises(ConfigError, match=r"round 0: rank 0 receives \[\(\(3,\).*rank 1 sends"):
        sim.run(rank_fn)

    def failing(comm):
        if comm.rank == 1:
            raise RuntimeError("boom")
        comm.shift([np.zeros(1)], [np.zeros(1)], after=None)   # would wait forever without the abort
    with pytest.raises(RuntimeError, match="boom"):
        sim.run(failing)


# ---- merge math --------------------------------------------------------------------------------
def test_merge_of_two_key_sets_is_attention_over_their_union():
    rng = np.random.default_rng(3)
    B, S, H, D, nk = 2, 7, 3, 8, 9
    q = rng.standard_normal((B, S, H, D))
    k, v = rng.standard_normal((B, nk, H, D)), rng.standard_normal((B, nk, H, D))
    K = NumpyKernels()
    o, oa, ob = (np.empty((B, S, H, D)) for _ in range(3))
    lse = K.attention(q, k, v, False, 0.5, o)
    lse_a = K.attention(q, k[:, :4], v[:, :4], False, 0.5, oa)
    lse_b = K.attention(q, k[:, 4:], v[:, 4:], False, 0.5, ob)
    m, lm = attention_merge_reference(oa, lse_a, ob, lse_b)
    np.testing.assert_allclose(m, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lm, lse, rtol=1e-12)
    # a block of rows 2..5 only: rows outside keep a; rows inside merge
    m2, lm2 = attention_merge_reference(oa, lse_a, ob[:, 2:5], lse_b[:, :, 2:5], rows=(2, 5))
    np.testing.assert_allclose(m2[:, 2:5], o[:, 2:5], atol=1e-12)
    np.testing.assert_array_equal(m2[:, :2], oa[:, :2])
    np.testing.assert_array_equal(lm2[:, :, 5:], lse_a[:, :, 5:])


def test_merge_reference_handles_empty_rows_and_garbage_in_them():
    oa = np.full((1, 3, 1, 4), np.nan)             # empty rows may hold anything
    lse_a = np.full((1, 1, 3), -np.inf)
    ob = np.arange(12.0).reshape(1, 3, 1, 4)
    lse_b = np.array([[[0.5, -np.inf, 2.0]]])
    ob[0, 1] = np.nan
    o, lse = attention_merge_reference(oa, lse_a, ob, lse_b)
    np.testing.assert_array_equal(o[0, 0, 0], ob[0, 0, 0])
    np.testing.assert_array_equal(o[0, 1, 0], 0.0)  # both empty: 0 and -inf, no NaN
    np.testing.assert_array_equal(lse[0, 0], [0.5, -np.inf, 2.0])
    o2, lse2 = attention_merge_reference(None, None, ob, lse_b)   # no a: b itself
    np.testing.assert_array_equal(lse2, lse_b)


# ---- merge kernel: config and compile (NVRTC, no GPU) --------------------------------------------
@pytest.mark.parametrize("bad", [dict(vec=8), dict(vec=3), dict(combine="max"), dict(threads_per_row=3),
                                 dict(threads_per_row=64), dict(dtype_out="float64"), dict(block_size=48)])
def test_merge_config_rejects(bad):
    with pytest.raises(ConfigError) as e:
        AttentionMergeConfig(**bad)
    assert "attention_merge" in str(e.value) and next(iter(bad)) in str(e.value)


def test_merge_threads_per_row_cover_head_dims():
    assert threads_per_row(64, 4) == 16 and threads_per_row(128, 4) == 32 and threads_per_row(256, 4) == 32
    assert threads_per_row(8, 4) == 2 and threads_per_row(24, 4) == 8 and threads_per_row(6, 2) == 4


MERGE_CONFIGS = [
    AttentionMergeConfig(dtype_a="float32", dtype_b="bfloat16", dtype_out="float32", vec=4, threads_per_row=32),
    AttentionMergeConfig(dtype_a="bfloat16", dtype_b="bfloat16", dtype_out="float32", vec=4, threads_per_row=16),
    AttentionMergeConfig(dtype_a="float32", dtype_b="float16", dtype_out="float16", vec=2, threads_per_row=8),
    AttentionMergeConfig(dtype_a="float32", dtype_b="bfloat16", dtype_out="float32", combine="sum", vec=4),
    AttentionMergeConfig(dtype_b="bfloat16", dtype_out="float32", combine="sum", has_a=False, vec=1),
]


@pytest.fixture(scope="module")
def merge_kernels():
    return [rtk.get_kernel(c, arch="sm_90") for c in MERGE_CONFIGS]


def test_merge_kernel_compiles_without_spills(merge_kernels):
    from rtkernels.inspect import sass_stats
    for cfg, k in zip(MERGE_CONFIGS, merge_kernels):
        r = k.resources
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, (cfg, r)
        stats = sass_stats(k.sass)
        if cfg.vec == 4 and "float32" in (cfg.dtype_a, cfg.dtype_out):
            assert stats["ldg_128"] + stats.get("stg_128", 0) >= 1, cfg   # float4 accesses
    # log-sum-exp weights only in the merge kernels; rows shared by part of a warp sync on their lanes
    assert "MUFU.EX2" in merge_kernels[0].sass and "MUFU.EX2" not in merge_kernels[3].sass
    assert "WARPSYNC" in merge_kernels[1].sass
    assert merge_kernels[4].config.dtype_a == "bfloat16"   # no a: one key whatever dtype_a was given


def test_merge_template_renders_the_config(merge_kernels):
    src = merge_kernels[2].source
    for line in ("using TA = float;", "using TB = __half;", "using TO = __half;", "constexpr bool kLse = true;",
                 "constexpr int kVec = 2;", "constexpr int kThreadsPerRow = 8;"):
        assert line in src


# ---- launcher and communicator plumbing ------------------------------------------------------------
def _launch(tmp_path, body, n=2, extra=()):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    return subprocess.run([sys.executable, "-m", "rtkernels.dist.run", "-n", str(n), *extra, str(script)],
                          env=env, capture_output=True, text=True, timeout=60)


def test_launcher_sets_the_environment(tmp_path):
    r = _launch(tmp_path, """
        import os
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NCCL_NVLS_ENABLE",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
        os.write(1, (" ".join(f"{k}={os.environ[k]}" for k in keys) + "\\n").encode())   # one write per rank
    """)
    assert r.returncode == 0, r.stderr
    lines = sorted(line for line in r.stdout.split("\n") if line)
    assert [l.split()[0] for l in lines] == ["RANK=0", "RANK=1"]
    for line in lines:
        assert "WORLD_SIZE=2" in line and "NCCL_NVLS_ENABLE=0" in line and "TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in line \
            and "NVSHMEM_DISABLE_NVLS=1" in line and "MASTER_ADDR=127.0.0.1" in line


def test_launcher_stops_the_others_when_one_fails(tmp_path):
    r = _launch(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(60)
    """)
    assert r.returncode == 3
    r = _launch(tmp_path, "import time; time.sleep(60)\n", extra=("--timeout", "1"))
    assert r.returncode == 124 and "timeout" in r.stderr


def test_env_defaults_to_one_rank(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(k, raising=False)
    env = rcomm.read_env()
    assert (env["rank"], env["world_size"], env["local_rank"]) == (0, 1, 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ConfigError, match="RANK=5"):
        rcomm.read_env()
    with pytest.raises(TypeError, match="comm must be"):
        rcomm.resolve("nccl")


def test_launcher_leaves_the_command_arguments_alone():
    from rtkernels.dist.run import _split
    assert _split(["-n", "2", "s.py", "-q", "--help"]) == (["-n", "2"], ["s.py", "-q", "--help"])
    assert _split(["-n2", "--timeout=5", "-m", "pytest", "-x", "-n", "4"]) == \
        (["-n2", "--timeout=5"], ["-m", "pytest", "-x", "-n", "4"])
    assert _split(["--nproc", "2", "--master-port", "1234", "b.py"]) == (["--nproc", "2", "--master-port", "1234"],
                                                                         ["b.py"])


def test_torch_ring_attention_autograd_wiring(monkeypatch):
    """rtkernels.torch.ring_attention's autograd (CPU, float64): the ring's NumPy reference kernels on
    one rank stand in for the CUDA ones, and loss.backward()'s gradients equal torch autograd
    through plain attention."""
    torch = pytest.importorskip("torch")
    import rtkernels.torch.dist as td

    def fwd(q, k, v, **kw):
        o, lse = rd.ring_attention(q.numpy(), k.numpy(), v.numpy(), **kw)
        return torch.from_numpy(o), torch.from_numpy(lse)

    def bwd(do, q, k, v, o, lse, **kw):
        return tuple(torch.from_numpy(x) for x in rd.ring_attention_backward(
            *(t.numpy() for t in (do, q, k, v, o, lse)), **kw))

    monkeypatch.setattr(td, "_ring_forward", fwd)
    monkeypatch.setattr(td, "_ring_backward", bwd)
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(2, 9, h, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2, 4))
    for causal in (False, True):
        a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
        o, lse = td.ring_attention(a, b, c, causal=causal, softmax_scale=0.3, comm=rd.SingleComm())
        o.backward(do)
        assert not lse.requires_grad
        ra, rb, rc = (t.clone().requires_grad_(True) for t in (q, k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", ra, rb.repeat_interleave(2, dim=2)) * 0.3
        if causal:
            s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
        ro = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), rc.repeat_interleave(2, dim=2))
        ro.backward(do)
        for x, y in ((o, ro), (a.grad, ra.grad), (b.grad, rb.grad), (c.grad, rc.grad)):
            assert torch.allclose(x, y, atol=1e-10), float((x - y).abs().max())
