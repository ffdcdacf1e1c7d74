"""Cluster-K in the Hopper matmul (ops/matmul_sm90.py cluster_k, templates/matmul_sm90.cu.j2
"Cluster-K"): two CTAs of a cluster split each tile's k-blocks and sum the partials through
distributed shared memory.  Config validation, the ring depths that fit beside the receive buffer,
the grid, the RTKERNELS_MATMUL_CLUSTER_K knob, one sm_90a compile; on a GPU, float64 references
over awkward shapes (one k-block: rank 0's range is empty; more tiles than clusters: the exchange
buffer reused tile after tile), the fused epilogue through both store paths, batches and
run-to-run bit equality."""
import numpy as np
import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import matmul as mm
from rtkernels.ops import matmul_sm90 as m90
from rtkernels.ops.matmul_sm90 import MatmulSm90Config


# ---- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(cluster_k=0), dict(cluster_k=3), dict(cluster_k=True), dict(cluster_k=2.0),
                                 dict(cluster_k=2, split_k=2), dict(cluster_k=2, stream_k=True),
                                 dict(cluster_k=2, mma="sync", tma_store=False)])
def test_bad_cluster_k_names_it(bad):
    with pytest.raises(ConfigError) as e:
        MatmulSm90Config(block_n=128, num_stages=4, **bad)
    assert e.value.field == "cluster_k" and "cluster_k" in str(e.value) and "matmul_sm90" in str(e.value)


def test_receive_buffer_takes_ring_stages():
    """The receive buffer (block_m / 2 x block_n float32) comes out of the ring: the deepest ring that fits
    is what cluster_stages returns, one stage more does not fit."""
    for (bm, bn), want in {(128, 64): 8, (128, 128): 5, (128, 192): 4, (128, 256): 3}.items():
        st = m90.cluster_stages(bm, bn)
        assert st == want, (bm, bn, st)
        cfg = MatmulSm90Config(block_m=bm, block_n=bn, num_stages=st, cluster_k=2)
        plain = MatmulSm90Config(block_m=bm, block_n=bn, num_stages=st)
        # the same ring and C staging (the epilogue may stage fewer columns beside the buffer)
        assert cfg.shared_mem_bytes == plain._smem(cfg.epi_n) + bm // 2 * bn * 4 + 16 <= m90._SMEM_LIMIT
        if st < 8:
            with pytest.raises(ConfigError):
                MatmulSm90Config(block_m=bm, block_n=bn, num_stages=st + 1, cluster_k=2)
    c = m90.with_cluster_k(m90.heuristic_config("bfloat16", 128, 8192, 8192, b_kmajor=True), 2)
    assert (c.cluster_k, c.split_k, c.stream_k) == (2, 1, False) and c.num_stages <= 8


@pytest.mark.parametrize("m, n, sms", [(128, 8192, 132), (128, 6144, 132), (3000, 5000, 132), (7, 64, 132),
                                       (128, 4096, 114)])
def test_grid_is_whole_clusters_at_most_one_cta_per_sm(m, n, sms):
    cfg = MatmulSm90Config(block_m=128, block_n=128, num_stages=5, cluster_k=2)
    tiles = -(-m // 128) * -(-n // 128)
    g = m90.grid_size(m, n, 1, cfg, sms, k=4096)
    assert g % 2 == 0 and g <= sms and g == 2 * min(tiles, sms // 2), (m, n, sms, g)


def test_forced_cluster_k_env_is_checked(monkeypatch):
    for v in ("0", "3", "x", "2.0"):
        monkeypatch.setenv(mm.CLUSTER_K_ENV, v)
        with pytest.raises(ConfigError) as e:
            mm._forced_cluster_k()
        assert e.value.field == mm.CLUSTER_K_ENV and mm.CLUSTER_K_ENV in str(e.value)
    for v, want in (("2", 2), ("1", 1), ("", None)):
        monkeypatch.setenv(mm.CLUSTER_K_ENV, v)
        assert mm._forced_cluster_k() == want
    monkeypatch.delenv(mm.CLUSTER_K_ENV)
    assert mm._forced_cluster_k() is None


# ---- compile ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bn", [128, 64])
def test_cluster_k_compiles_clean_for_sm90a(bn):
    """The two M = 128 candidates with the fused bias + GELU epilogue: no spills under the consumers'
    232 registers, a cluster barrier after the inits, one 16-byte remote store per 4-accumulator
    group and no global workspace traffic (no atomics)."""
    import rtkernels as rtk
    from rtkernels.inspect import sass_stats
    cfg = MatmulSm90Config(dtype="bfloat16", block_n=bn, num_stages=m90.cluster_stages(128, bn), b_kmajor=True,
                           has_bias=True, activation="gelu", cluster_k=2)
    k = rtk.get_kernel(cfg, arch="sm_90")
    r = k.resources
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0 and r.registers == 168, r
    assert "warning" not in k.module.log, k.module.log
    s = sass_stats(k.sass)
    assert s["ldl"] == 0 and s["stl"] == 0 and s["hgmma"] > 0 and s["utmastg"] > 0
    groups = 64 * bn // 128 // 4    # float4 groups per consumer thread
    assert k.sass.count("ST.E.128") == groups, "the partial is not handed over as one 16-byte store per group"
    assert "UCGABAR_ARV" in k.sass and "UCGABAR_WAIT" in k.sass, "no cluster barrier after the mbarrier inits"
    assert "ATOMG" not in k.sass and "LDG.E.128.STRONG.GPU" not in k.sass


# ---- GPU -------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _tile_kernels_only(monkeypatch):
    """C of <= 16 rows would otherwise take rtk.matmul's GEMV route."""
    monkeypatch.setattr(mm, "USE_GEMV", False)


def _plan_of(m, n, k, batch=1):
    """(config, grid) of the Hopper plan made for (m, n, k, batch) under RTKERNELS_MATMUL_CLUSTER_K=2."""
    hits = [(plan[1], plan[2]) for key, plan in mm._plans90.items() if key[1:5] == (m, n, k, batch) and key[15] == 2]
    return hits[-1] if hits else (None, None)


# (M, N, K): the M = 128 cells (one tile row; 96 / 64 clusters), K of one k-block (rank 0 multiplies
# nothing), two k-blocks, a ragged K, and more tiles than the 66 clusters of 132 SMs (each cluster
# walks several tiles, the receive buffer handed back between them)
CLUSTER_SHAPES = [(128, 6144, 4096), (7, 4100, 64), (129, 72, 65), (300, 4100, 1000), (1000, 4100, 700),
                  (128, 8192, 1000), (2049, 520, 129)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", CLUSTER_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_forced_cluster_k(dtype, shape, monkeypatch):
    """RTKERNELS_MATMUL_CLUSTER_K=2 on the heuristic's tile against float64 (2x cuBLAS's own error),
    output poisoned with NaN."""
    from gpu_util import poison, to_f64
    import rtkernels as rtk
    from test_matmul_splitk import _aligned, _check, _cublas, _dt, _empty, _sm90_gpu
    _sm90_gpu()
    monkeypatch.setenv(mm.CLUSTER_K_ENV, "2")
    M, N, K = shape
    rng = np.random.default_rng(M * 3 + N + K)
    a, ah = _aligned(rng, M, K, dtype)
    b, bh = _aligned(rng, K, N, dtype)
    out = poison(_empty((M, N), dtype))
    rtk.matmul(a, b, out=out, dtype=_dt(dtype))
    cfg, grid = _plan_of(M, N, K)
    assert cfg is not None and cfg.cluster_k == 2 and grid % 2 == 0, (cfg, grid)
    tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    what = f"{dtype} {shape} cluster-K {cfg.block_m}x{cfg.block_n}/{cfg.num_stages}, {tiles} tiles on {grid} CTAs"
    _check(to_f64(out, dtype), ah @ bh, _cublas(a, b, dtype), what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape, trans_b, pad", [((128, 4096, 4104), True, 0), ((300, 264, 1000), True, 1),
                                                 ((7, 129, 520), False, 0)])
def test_gpu_cluster_k_bias_gelu_and_direct_stores(dtype, shape, trans_b, pad, monkeypatch):
    """The fused bias + GELU epilogue after the hand-over, through the TMA store (N = 4096) and (odd C
    row stride or odd N) the direct stores; nothing written past the output's columns."""
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    from test_matmul_splitk import _aligned, _check, _cublas, _dt, _empty, _sm90_gpu
    _sm90_gpu()
    monkeypatch.setenv(mm.CLUSTER_K_ENV, "2")
    M, N, K = shape
    rng = np.random.default_rng(M + N + 5)
    a, ah = _aligned(rng, M, K, dtype)
    b, bh = _aligned(rng, *((N, K) if trans_b else (K, N)), dtype)
    bias, biash = random_array(rng, (N,), dtype)
    full = poison(_empty((M, N + pad), dtype))
    out = full[:, :N]
    rtk.matmul(a, b, bias=bias, activation="gelu", out=out, trans_b=trans_b, dtype=_dt(dtype))
    cfg, grid = _plan_of(M, N, K)
    assert cfg.cluster_k == 2, cfg
    ref = mm.matmul_reference(ah, bh, bias=biash, activation="gelu", trans_b=trans_b)
    peer = mm._act_np(_cublas(a, b, dtype, trans_b) + biash, "gelu")
    got = to_f64(full, dtype)
    _check(got[:, :N], ref, peer, f"{dtype} {shape} bias+gelu cluster-K (tma_store={cfg.tma_store}, grid {grid})")
    if pad:
        assert np.isnan(got[:, N:]).all(), "wrote past the output's columns"


@pytest.mark.gpu
def test_gpu_cluster_k_batched_and_deterministic(monkeypatch):
    """A batch of 3 over a broadcast B, three calls: the same bits each time (the sum is rank 0's
    partial + rank 1's whichever CTA owns the rows), and float64's result within 2x cuBLAS's error."""
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    from test_matmul_splitk import _check, _cublas, _empty, _sm90_gpu
    _sm90_gpu()
    monkeypatch.setenv(mm.CLUSTER_K_ENV, "2")
    B, M, N, K = 3, 130, 200, 700
    rng = np.random.default_rng(12)
    a, ah = random_array(rng, (B, M, K), "bfloat16")
    b, bh = random_array(rng, (K, N), "bfloat16")
    outs = []
    for _ in range(3):
        out = poison(_empty((B, M, N), "bfloat16"))
        rtk.matmul(a, b, out=out, dtype="bfloat16")
        outs.append(out.get())
    cfg, grid = _plan_of(M, N, K, B)
    assert cfg.cluster_k == 2, cfg
    assert all(np.array_equal(o.view(np.uint16), outs[0].view(np.uint16)) for o in outs[1:]), "bits differ"
    _check(to_f64(out, "bfloat16"), ah @ bh, _cublas(a, b[None].repeat(B, 0), "bfloat16"),
           f"batched cluster-K {cfg.block_m}x{cfg.block_n} on {grid} CTAs")
