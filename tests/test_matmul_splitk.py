"""Split-K in the Hopper matmul (ops/matmul_sm90.py split_k, templates/matmul_sm90.cu.j2 reduce_splits):
config validation, the heuristic's choice, a NumPy model of the (tile, split) walk, one sm_90a
compile; on a GPU, float64 references over awkward shapes with the split forced
(RTKERNELS_MATMUL_SPLIT_K), the fused epilogue, run-to-run bit equality, per-stream workspaces and
CUDA-graph replay."""
import re

import numpy as np
import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import matmul as mm
from rtkernels.ops import matmul_sm90 as m90
from rtkernels.ops.matmul_sm90 import MatmulSm90Config


# ---- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(split_k=0), dict(split_k=m90.MAX_SPLIT_K + 1), dict(split_k=2.0),
                                 dict(split_k=True), dict(split_k=2, mma="sync", tma_store=False)])
def test_bad_split_k_names_it(bad):
    with pytest.raises(ConfigError) as e:
        MatmulSm90Config(**bad)
    assert e.value.field == "split_k" and "split_k" in str(e.value) and "matmul_sm90" in str(e.value)


def test_forced_split_k_env_is_checked(monkeypatch):
    for v in ("0", "x", str(m90.MAX_SPLIT_K + 1)):
        monkeypatch.setenv(mm.SPLIT_K_ENV, v)
        with pytest.raises(ConfigError) as e:
            mm._forced_split_k()
        assert e.value.field == mm.SPLIT_K_ENV and mm.SPLIT_K_ENV in str(e.value)
    monkeypatch.setenv(mm.SPLIT_K_ENV, "3")
    assert mm._forced_split_k() == 3
    monkeypatch.delenv(mm.SPLIT_K_ENV)
    assert mm._forced_split_k() is None


def test_split_k_1_keeps_the_unsplit_signature():
    """split_k = 1 renders the kernel without workspace parameters (its SASS is the unsplit kernel's:
    compared once with the tree before split-K, 784 identical instructions)."""
    from rtkernels.render import render
    one = render(MatmulSm90Config.template, MatmulSm90Config().template_params()).source
    two = render(MatmulSm90Config.template, MatmulSm90Config(split_k=2).template_params()).source
    sig = lambda src: src[src.index("matmul_sm90("):src.index("{", src.index("matmul_sm90("))]  # noqa: E731
    assert "partials" not in sig(one) and "float* __restrict__ partials" in sig(two)


# ---- heuristic ------------------------------------------------------------------------------
def test_heuristic_splits_few_tiles_only():
    few = m90.heuristic_config("bfloat16", 128, 4096, 4096, sm_count=132)
    assert few.split_k > 1, few
    assert m90.grid_size(128, 4096, 1, few, 132, 4096) > 64   # at least half the SMs get a unit
    for shape in ((8192, 8192, 8192), (4096, 4096, 4096), (2048, 4096, 4096)):
        assert m90.heuristic_config("bfloat16", *shape, sm_count=132).split_k == 1, shape
    # short K: every split would keep fewer than MIN_KBLOCKS_PER_SPLIT k-blocks
    assert m90.heuristic_config("bfloat16", 128, 4096, 256, sm_count=132).split_k == 1
    # mma.sync consumers never split
    assert m90.heuristic_config("bfloat16", 128, 4096, 4096, sm_count=132, mma="sync", tma_store=False).split_k == 1
    for m, n, k in ((128, 4096, 14336), (128, 8192, 28672), (512, 4096, 14336)):
        c = m90.heuristic_config("bfloat16", m, n, k, sm_count=132)
        assert -(-k // 64) // c.split_k >= m90.MIN_KBLOCKS_PER_SPLIT, c
    assert all(c.split_k > 1 for c in m90.split_candidates("bfloat16", 128, 4096, 4096, 1, 132))
    assert m90.split_candidates("bfloat16", 8192, 8192, 8192, 1, 132) == []


def test_split_cost_reduces_to_the_unsplit_model():
    """For split_k = 1 the K-aware cost is the old one times (k-blocks + fill): the same choice."""
    for t in m90.TILES:
        for m, n, k in ((1793, 1793, 1793), (8192, 1024, 512), (300, 4100, 129)):
            ratio = m90.split_cost(t, m, n, k, 1, 132, 1) / m90.estimated_cost(t, m, n, 1, 132)
            assert ratio == pytest.approx(64 * (m90.k_blocks(k) + m90.SPLIT_FILL_KBLOCKS))


def _units(tiles, k_tiles, split_k):
    """NumPy model of walk_of / unit_at: (tile, split, kb0, kb1) of every work unit."""
    splits = max(1, min(split_k, k_tiles))
    out = []
    for u in range(tiles * splits):
        t, s = divmod(u, splits)
        out.append((t, s, s * k_tiles // splits, (s + 1) * k_tiles // splits))
    return out, splits


@pytest.mark.parametrize("tiles, k_tiles, split_k", [(16, 64, 4), (7, 3, 8), (5, 65, 6), (1, 1, 16), (33, 10, 3)])
def test_split_ranges_are_balanced_and_cover_k(tiles, k_tiles, split_k):
    units, splits = _units(tiles, k_tiles, split_k)
    assert splits == min(split_k, k_tiles)
    for t in range(tiles):
        mine = [u for u in units if u[0] == t]
        assert [u[1] for u in mine] == list(range(splits))
        assert mine[0][2] == 0 and mine[-1][3] == k_tiles
        assert all(a[3] == b[2] for a, b in zip(mine, mine[1:]))      # contiguous, in split order
        sizes = [u[3] - u[2] for u in mine]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    cfg = MatmulSm90Config(block_m=128, block_n=128, num_stages=6, split_k=split_k)
    m, n, k = 128 * tiles, 128, 64 * k_tiles
    assert m90.grid_size(m, n, 1, cfg, 132, k) == min(len(units), 132)
    assert m90.workspace_bytes(cfg, m, n, k, 1) == (len(units) * 128 * 128 * 4 if splits > 1 else 0)
    assert m90.counter_bytes(cfg, m, n, 1) == tiles * 2 * 4


# ---- compile ----------------------------------------------------------------------------------
def test_split_config_compiles_clean_for_sm90a():
    """The heuristic's split config for 128 x 4096 x 4096 with the fused epilogue: no spills under the
    consumers' 232 registers, 16-byte L2-only partial stores/loads, one counter atomic per unit."""
    import rtkernels as rtk
    from rtkernels.inspect import sass_stats
    cfg = m90.heuristic_config("bfloat16", 128, 4096, 4096, sm_count=132, has_bias=True, activation="gelu")
    assert cfg.split_k > 1
    k = rtk.get_kernel(cfg, arch="sm_90")
    r = k.resources
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0 and r.registers == 168, r
    assert "C7508" not in k.module.log and "serializ" not in k.module.log.lower(), k.module.log
    s = sass_stats(k.sass)
    assert s["ldl"] == 0 and s["stl"] == 0 and s["hgmma"] > 0 and s["utmastg"] > 0
    groups = cfg.block_m // 2 * cfg.block_n // 128 // 4    # float4 groups per consumer thread
    assert len(re.findall(r"STG\.E\.128\.STRONG\.GPU", k.sass)) == groups, "partial stores not 16-byte .cg"
    assert len(re.findall(r"LDG\.E\.128\.STRONG\.GPU", k.sass)) >= groups
    assert "ATOMG.E.ADD" in k.sass and "BAR.RED.OR" in k.sass


# ---- GPU -------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _tile_kernels_only(monkeypatch):
    """These tests exercise the Hopper tile kernel's split-K: C of <= 16 rows would otherwise take
    rtk.matmul's GEMV route (tests/test_gemv.py covers that one)."""
    import rtkernels.ops.matmul as mm
    monkeypatch.setattr(mm, "USE_GEMV", False)


def _sm90_gpu():
    from rtkernels import device
    if device.current_arch() != "sm_90":
        pytest.skip("needs an sm_90 GPU")


def _split_of(m, n, k, batch=1, forced=None):
    """split_k of the Hopper plan made for (m, n, k, batch) under RTKERNELS_MATMUL_SPLIT_K=forced
    (None if there is none)."""
    hits = [plan[1].split_k for key, plan in mm._plans90.items() if key[1:5] == (m, n, k, batch) and
            key[13] == forced]
    return hits[-1] if hits else None


def _empty(shape, dtype):
    import cupy as cp
    return cp.empty(shape, dtype=cp.uint16 if dtype == "bfloat16" else dtype)


def _check(got, ref, peer, what):
    err = np.abs(got - ref).max()
    peer_err = np.abs(peer - ref).max()
    scale = max(np.abs(ref).max(), 1.0)
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten or NaN)"
    assert err <= 2 * peer_err + 1e-6 * scale, f"{what}: max error {err:.3g} vs cuBLAS {peer_err:.3g}"


def _cublas(a, b, dtype, trans_b=False):
    from test_matmul import _cublas as peer
    return peer(a, b, dtype, False, trans_b)


def _dt(dtype):
    return dtype if dtype == "bfloat16" else None


def _aligned(rng, rows, cols, dtype):
    """Random (rows, cols) values as a column slice of rows padded to 16 bytes (so that TMA takes
    any cols, K = 65 included, and the Hopper kernel runs it): (device view, float64 host copy)."""
    from gpu_util import random_array
    dev, host = random_array(rng, (rows, -(-cols // 8) * 8), dtype)
    return dev[:, :cols], host[:, :cols]


SPLIT_SHAPES = [(1, 72, 4104), (7, 4100, 129), (129, 72, 65), (300, 4100, 1000), (129, 256, 64), (300, 520, 4104),
                (128, 4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, split_k", [("bfloat16", 2), ("bfloat16", 8), ("float16", 3)])
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_forced_split(dtype, shape, split_k, monkeypatch):
    """Forced splits (clamped to the k-blocks: K = 64 runs unsplit, K = 65 in 2) against float64."""
    from gpu_util import poison, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    monkeypatch.setenv(mm.SPLIT_K_ENV, str(split_k))
    M, N, K = shape
    rng = np.random.default_rng(M * 7 + N + K + split_k)
    a, ah = _aligned(rng, M, K, dtype)
    b, bh = _aligned(rng, K, N, dtype)
    out = poison(_empty((M, N), dtype))
    rtk.matmul(a, b, out=out, dtype=_dt(dtype))
    assert _split_of(M, N, K, forced=split_k) == min(split_k, -(-K // 64))
    _check(to_f64(out, dtype), ah @ bh, _cublas(a, b, dtype), f"{dtype} {shape} split_k={split_k}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape, trans_b, pad", [((129, 4096, 4104), False, 0), ((300, 264, 1000), True, 1),
                                                 ((7, 129, 520), True, 0)])
def test_gpu_split_bias_gelu_and_direct_stores(dtype, shape, trans_b, pad, monkeypatch):
    """The fused bias + GELU epilogue after the reduction, through the TMA store (N = 4096) and (odd C
    row stride or odd N) the direct stores."""
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    monkeypatch.setenv(mm.SPLIT_K_ENV, "4")
    M, N, K = shape
    rng = np.random.default_rng(M + N)
    a, ah = _aligned(rng, M, K, dtype)
    b, bh = _aligned(rng, *((N, K) if trans_b else (K, N)), dtype)
    bias, biash = random_array(rng, (N,), dtype)
    full = poison(_empty((M, N + pad), dtype))
    out = full[:, :N]
    rtk.matmul(a, b, bias=bias, activation="gelu", out=out, trans_b=trans_b, dtype=_dt(dtype))
    assert _split_of(M, N, K, forced=4) == 4
    ref = mm.matmul_reference(ah, bh, bias=biash, activation="gelu", trans_b=trans_b)
    peer = mm._act_np(_cublas(a, b, dtype, trans_b) + biash, "gelu")
    got = to_f64(full, dtype)
    _check(got[:, :N], ref, peer, f"{dtype} {shape} bias+gelu split 4")
    if pad:
        assert np.isnan(got[:, N:]).all(), "wrote past the output's columns"


@pytest.mark.gpu
def test_gpu_split_batched(monkeypatch):
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    monkeypatch.setenv(mm.SPLIT_K_ENV, "3")
    B, M, N, K = 3, 130, 200, 700
    rng = np.random.default_rng(11)
    a, ah = random_array(rng, (B, M, K), "bfloat16")
    b, bh = random_array(rng, (K, N), "bfloat16")
    out = poison(_empty((B, M, N), "bfloat16"))
    rtk.matmul(a, b, out=out, dtype="bfloat16")
    assert _split_of(M, N, K, B, forced=3) == 3
    _check(to_f64(out, "bfloat16"), ah @ bh, _cublas(a, b[None].repeat(B, 0), "bfloat16"), "batched split 3")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_heuristic_split_is_deterministic(dtype):
    """The heuristic splits 128 x 4096 x 4096; two calls (the second a plan replay) give the same bits,
    and the counters are back at zero after them."""
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    from rtkernels.ops import workspace
    _sm90_gpu()
    M, N, K = 128, 4096, 4096
    rng = np.random.default_rng(1)
    a, ah = random_array(rng, (M, K), dtype)
    b, bh = random_array(rng, (K, N), dtype)
    outs = []
    for _ in range(3):
        out = poison(_empty((M, N), dtype))
        rtk.matmul(a, b, out=out, dtype=_dt(dtype))
        outs.append(out.get())
    last = out
    split = _split_of(M, N, K)
    assert split > 1, split
    assert all(np.array_equal(o.view(np.uint16), outs[0].view(np.uint16)) for o in outs[1:]), "run-to-run bits differ"
    _check(to_f64(last, dtype), ah @ bh, _cublas(a, b, dtype), f"{dtype} heuristic split {split}")
    cp.cuda.Device().synchronize()
    ws = workspace._WORKSPACES[(cp.cuda.Device().id, cp.cuda.get_current_stream().ptr, False)]
    assert not ws.counters.view(cp.int32).any(), "a counter was left non-zero"


@pytest.mark.gpu
def test_gpu_streams_get_their_own_workspace(monkeypatch):
    """Two streams, each with its own split calls in flight: separate counter buffers, right results."""
    import cupy as cp
    from gpu_util import random_array, to_f64
    import rtkernels as rtk
    from rtkernels.ops import workspace
    _sm90_gpu()
    monkeypatch.setenv(mm.SPLIT_K_ENV, "6")
    M, N, K = 256, 1024, 2048
    rng = np.random.default_rng(2)
    data = [(random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16")) for _ in range(2)]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = [_empty((M, N), "bfloat16") for _ in range(2)]
    cp.cuda.Device().synchronize()
    for _ in range(5):
        for s, ((a, _), (b, _)), o in zip(streams, data, outs):
            rtk.matmul(a, b, out=o, dtype="bfloat16", stream=s)
    cp.cuda.Device().synchronize()
    dev = cp.cuda.Device().id
    c0 = workspace._WORKSPACES[(dev, streams[0].ptr, False)].counters
    c1 = workspace._WORKSPACES[(dev, streams[1].ptr, False)].counters
    assert c0.data.ptr != c1.data.ptr
    for ((a, ah), (b, bh)), o in zip(data, outs):
        _check(to_f64(o, "bfloat16"), ah @ bh, _cublas(a, b, "bfloat16"), "two streams")


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_gpu_split_cuda_graph_replay(warm, monkeypatch):
    """CuPy stream capture of a split call, replayed twice on new inputs in the captured buffers:
    each replay matches the reference and an eager call bit for bit (counters back at zero after
    every launch).  'cold': the capture stream never ran a split call, so its workspace is made
    (and its counters zeroed) inside the capture."""
    import cupy as cp
    from gpu_util import random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    monkeypatch.setenv(mm.SPLIT_K_ENV, "4")
    M, N, K = 128 + 64 * warm, 2048, 1024
    rng = np.random.default_rng(3)
    a, _ = random_array(rng, (M, K), "bfloat16")
    b, _ = random_array(rng, (K, N), "bfloat16")
    out = _empty((M, N), "bfloat16")
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        if warm:
            rtk.matmul(a, b, out=out, dtype="bfloat16")
        else:
            with cp.cuda.Stream(non_blocking=True) as other:   # plan and module made on another stream
                rtk.matmul(a, b, out=out, dtype="bfloat16")
                other.synchronize()
        s.synchronize()
        s.begin_capture()
        rtk.matmul(a, b, out=out, dtype="bfloat16")
        graph = s.end_capture()
    for step in range(2):
        a2, ah2 = random_array(rng, (M, K), "bfloat16")
        b2, bh2 = random_array(rng, (K, N), "bfloat16")
        a[...] = a2
        b[...] = b2
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        _check(to_f64(out, "bfloat16"), ah2 @ bh2, _cublas(a, b, "bfloat16"), f"graph replay {step}")
        eager = rtk.matmul(a, b, dtype="bfloat16")
        cp.cuda.Device().synchronize()
        assert np.array_equal(eager.get(), out.get()), f"replay {step} != eager"


@pytest.mark.gpu
def test_gpu_split_torch_replay(monkeypatch):
    """torch tensors: the first call plans, the next ones replay the plan with the stream's
    workspace (a torch tensor); results equal the first call's bits."""
    torch = pytest.importorskip("torch")
    import rtkernels as rtk
    _sm90_gpu()
    monkeypatch.setenv(mm.SPLIT_K_ENV, "3")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(100, 3000, device="cuda", generator=g).bfloat16()
    b = torch.randn(3000, 640, device="cuda", generator=g).bfloat16()
    bias = torch.randn(640, device="cuda", generator=g).bfloat16()
    first = rtk.matmul(a, b, bias=bias, activation="gelu")
    again = [rtk.matmul(a, b, bias=bias, activation="gelu") for _ in range(3)]
    torch.cuda.synchronize()
    assert _split_of(100, 640, 3000, forced=3) == 3
    ref = torch.nn.functional.gelu(a.double() @ b.double() + bias.double())
    peer = torch.nn.functional.gelu((a @ b + bias).double())
    err, peer_err = (first.double() - ref).abs().max().item(), (peer - ref).abs().max().item()
    assert err <= 2 * peer_err + 1e-6, f"torch split 3: max error {err:.3g} vs cuBLAS {peer_err:.3g}"
    assert all(torch.equal(x, first) for x in again), "replays differ from the first call"
