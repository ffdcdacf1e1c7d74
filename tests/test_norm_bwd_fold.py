"""The norm backward's column sums folded into its rows kernel (NormBwdConfig.fold_colsum).

The rows kernel is launched cooperatively (Kernel.launch_cooperative), meets a grid-wide barrier
after its partial dweight / dbias rows, and then every block sums column tiles of them; where the
driver refuses the cooperative grid the op falls back to the two kernels (rows + norm_bwd_colsum).

CPU: the knobs' validation, the heuristic's choice, the tile rule, the launch plumbing (a
cooperative Launch is never bound), and a few fold kernels compiled (one module fixture): no
spills, no more registers than the unfolded kernel's occupancy allows, the barrier and the L2
discard in the PTX.
GPU (-m gpu): widths 1 .. 65536 with grids of one worker and of >= 3 waves of rows (up to 100k
rows), float16 / bfloat16 / float32, saved and recomputed statistics, poisoned outputs, the same
bits twice, the fold against the two kernels, the fallback when the driver refuses, and CUDA-graph
capture + replay (CuPy and torch) with the barrier's counters back at zero after every launch.
"""
import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.arch import arch_number
from rtkernels.errors import ConfigError
from rtkernels.ops import rowwise_bwd as rb
from rtkernels.ops._arrays import Launch
from rtkernels.ops.rowwise_bwd import NormBwdConfig

ROWS_KERNELS = ("rmsnorm_bwd_rows", "layernorm_bwd_rows")


# ---- configs and plans (CPU) ---------------------------------------------------------------------
@pytest.mark.parametrize("field", ["fold_colsum", "discard_partials"])
def test_fold_knobs_are_bools(field):
    with pytest.raises(ConfigError) as e:
        NormBwdConfig(dtype="bfloat16", weight_dtype="bfloat16", vec=8, threads_per_row=256, block_size=256,
                      **{field: 1})
    assert e.value.field == field and field in str(e.value)


@pytest.mark.parametrize("n", [1024, 4096, 16384])
def test_heuristic_folds_resident_rows(n):
    for layer in (False, True):
        cfg = rb.plan_bwd("norm_bwd", n, "bfloat16", 8, "sm_90", layer=layer)
        assert cfg.fold_colsum == rb._NORM_BWD_FOLD[cfg.row_class] and cfg.discard_partials
    # rows too wide for registers keep the two kernels (their grid is not the heuristic's concern)
    cfg = rb.plan_bwd("norm_bwd", 1 << 20, "bfloat16", 8, "sm_90")
    assert cfg.two_pass and not cfg.fold_colsum


@pytest.mark.parametrize("n, blocks, block, parts, tile4", [
    (4096, 396, 256, 396, 4),      # 4k RMSNorm block rows: 256 tiles, one per block, 2 rounds
    (16384, 248, 256, 62, 8),      # 16k cluster rows: whole 128-byte lines, 1 round per tile
    (1024, 132 * 3, 128, 132 * 3, 1),   # 1k lane groups: 256 tiles of one float4, 1 round each
    (1, 1, 128, 1, 8),             # one worker: one tile of everything
    (7, 5, 64, 5, 8),
])
def test_fold_tile_rule(n, blocks, block, parts, tile4):
    assert rb._fold_tile4(n, blocks, block, parts) == tile4


def test_cooperative_launch_is_never_bound():
    k = object()
    assert not Launch(k, (1,), (32,), 0, ()).cooperative
    with pytest.raises(TypeError):
        Launch(k, (1,), (32,), 0, (), cooperative=True).bind(())


# ---- a few fold kernels compile (CPU) --------------------------------------------------------------
COMPILED = [   # (label, heuristic config with the fold, arch)
    ("1k lane groups", rb.plan_bwd("norm_bwd", 1024, "bfloat16", 8, "sm_90", layer=True), "sm_90"),
    ("4k block rows", rb.plan_bwd("norm_bwd", 4096, "bfloat16", 8, "sm_90"), "sm_90"),
    ("16k cluster rows, sums in shared memory", rb.plan_bwd("norm_bwd", 16384, "bfloat16", 8, "sm_90", layer=True),
     "sm_90"),
]


@pytest.fixture(scope="module")
def compiled():
    out = {}
    for label, cfg, arch in COMPILED:   # (lane groups: the heuristic's two kernels; the fold is forced)
        out[label] = {fold: {name: rtk.get_kernel(cfg.replace(fold_colsum=fold), name, arch=arch)
                             for name in ROWS_KERNELS} for fold in (True, False)}
    return out


def test_fold_kernels_compile_without_spills(compiled):
    from rtkernels.inspect import sass_stats
    bad = [(label, name, k.resources) for label, ks in compiled.items() for name, k in ks[True].items()
           if k.resources.spill_stores or k.resources.spill_loads or sass_stats(k.sass)["ldl"]]
    assert bad == []


def test_fold_keeps_the_blocks_per_sm(compiled):
    """The fold's tail runs after the row loop: it must not cost the rows kernel a block per SM
    (registers, or its 1-2 KiB of static shared memory)."""
    from rtkernels.arch import occupancy
    for label, cfg, arch in COMPILED:
        occ = {}
        for fold in (True, False):
            for name, k in compiled[label][fold].items():
                r = k.resources
                occ[fold, name] = occupancy(arch, cfg.block_size, r.registers, r.shared_static, cfg.shared_mem_bytes,
                                            barriers=r.barriers).blocks_per_sm
        for name in ROWS_KERNELS:
            assert occ[True, name] == occ[False, name], (label, name, occ)


def test_cooperative_limit_raises_the_smem_limit_first(compiled, monkeypatch):
    """The driver counts a block asking for more dynamic shared memory than the function allows as
    one that never fits: the grid must be sized after the limit is raised, as the launch raises it
    (bulk_rows=2's 64 KiB of stages was refused on an H200 before, 2026-11-26).  The driver is
    faked here: 0 blocks per SM until the limit covers the request."""
    import cupy
    from rtkernels import kernel as kmod
    k = compiled["4k block rows"][True]["rmsnorm_bwd_rows"]
    fn = type("FakeFunction", (), {"ptr": -12345})()
    allowed = {"bytes": 48 * 1024 - k.resources.shared_static}   # the function's dynamic limit
    monkeypatch.setattr(kmod.device, "_props", lambda dev: {"cooperativeLaunch": 1})
    monkeypatch.setattr(kmod.device, "sm_count", lambda dev: 132)
    monkeypatch.setattr(k, "_raise_smem_limit", lambda f, dev, nbytes: allowed.update(bytes=nbytes)
                        or k._smem_set.__setitem__(dev, nbytes))
    monkeypatch.setattr(cupy.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor",
                        lambda ptr, threads, smem: 3 if smem <= allowed["bytes"] else 0)
    saved = dict(k._smem_set)
    try:
        assert k.cooperative_limit(128, 64 * 1024, dev=0, fn=fn) == 3 * 132
        assert allowed["bytes"] == 64 * 1024
        assert k.cooperative_limit(128, 1024, dev=0, fn=fn) == 3 * 132   # under 48 KiB: nothing to raise
    finally:
        k._smem_set.clear()
        k._smem_set.update(saved)
        for key in [key for key in kmod._COOPERATIVE if key[0] == fn.ptr]:
            del kmod._COOPERATIVE[key]


def test_fold_kernels_meet_at_a_grid_barrier(compiled):
    for label, ks in compiled.items():
        for name, k in ks[True].items():
            ptx = k.ptx
            # arrive with release, wait with acquire, drop the summed partial lines from L2
            assert "red.release.gpu.global.add.s32" in ptx and "ld.acquire.gpu.global.s32" in ptx, (label, name)
            assert "discard.global.L2" in ptx and "ld.global.cg.v4.f32" in ptx, (label, name)
        for name, k in ks[False].items():
            assert "ld.acquire.gpu" not in k.ptx, (label, name)


# ==== GPU ===========================================================================================
def _gpu():
    from test_training_ops import _gpu as g
    return g()


def _resident_rows(cfg, layer, given=True):
    """Rows that make the fold's grid >= 3 waves' worth of rows per worker: 3 x its workers x rows per block + 17."""
    name = ("layernorm_bwd_rows" if layer else "rmsnorm_bwd_rows") + ("" if given else "_recompute")
    k = rtk.get_kernel(cfg, name)
    workers = min(rb._resident_workers(k, cfg), rb._cooperative_workers(k, cfg))
    return 3 * workers * cfg.rows_per_block + 17


def _cfg_for(n, dtype, layer):
    from rtkernels import device
    from rtkernels.ops import rowwise as rw
    vec = 1
    size = np.dtype("float16" if dtype == "bfloat16" else dtype).itemsize
    while vec * 2 * size <= 16 and n % (vec * 2) == 0:
        vec *= 2
    return rb.plan_bwd("norm_bwd", rw._pow2_ceil(-(-n // vec)) * vec, dtype, vec, device.current_arch(),
                       weight_dtype=dtype, layer=layer)


def _poisoned_pool(cp, poison, n, dtype):
    """Leave NaN bytes where the op's dweight / dbias are likely to be allocated (the pool's blocks)."""
    for _ in range(2):
        a = poison(cp.empty(max(n, 1), dtype="float32" if dtype == "float32" else "uint16"))
        del a


def _check_fold(n, rows, dtype, tag):
    from test_training_ops import _close, _rmsnorm_dx_scale, _row_rms
    cp, random_array, to_f64, poison = _gpu()
    rng = np.random.default_rng(n * 7 + rows)
    x, x64 = random_array(rng, (rows, n), dtype, scale=2.0)
    dy, dy64 = random_array(rng, (rows, n), dtype)
    w, w64 = random_array(rng, (n,), dtype)
    b, _ = random_array(rng, (n,), dtype)
    what = f"{tag} n={n} rows={rows} {dtype}"
    # the heuristic's tiles with the fold forced (lane-group rows default to the two kernels)
    fold_rms = _cfg_for(n, dtype, False).replace(fold_colsum=True)
    fold_ln = _cfg_for(n, dtype, True).replace(fold_colsum=True)
    # RMSNorm, saved and recomputed statistics
    rstd = cp.asarray((1 / np.sqrt(np.mean(x64 ** 2, -1) + 1e-6)).astype(np.float32))
    ref_dx, ref_dw = rb.rmsnorm_backward_reference(dy64, x64, w64, 1e-6)
    for stats in (None, rstd):
        dx = poison(cp.empty_like(x))
        _poisoned_pool(cp, poison, n, dtype)
        _, got_dw = rtk.rmsnorm_backward(dy, x, w, stats, eps=1e-6, out=dx, dtype=dtype, config=fold_rms)
        s = "given" if stats is not None else "recomputed"
        _close(to_f64(dx, dtype), ref_dx, dtype, f"rmsnorm dx (stats {s}) {what}",
               row_scale=_rmsnorm_dx_scale(dy64, x64, w64, ref_dx), atol=1e-6)
        _close(to_f64(got_dw, dtype), ref_dw, dtype, f"rmsnorm dweight (stats {s}) {what}",
               atol=1e-5 * np.abs(dy64 * x64).sum(0) * 2)
    # LayerNorm
    ref_dx, ref_dw, ref_db = rb.layernorm_backward_reference(dy64, x64, w64, 1e-5)
    mean = cp.asarray(x64.mean(-1).astype(np.float32))
    lrstd = cp.asarray((1 / np.sqrt(x64.var(-1) + 1e-5)).astype(np.float32))
    scale = _row_rms(ref_dx) + _row_rms(dy64 * w64) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    for stats in ((None, None), (mean, lrstd)):
        dx = poison(cp.empty_like(x))
        _poisoned_pool(cp, poison, n, dtype)
        _, got_dw, got_db = rtk.layernorm_backward(dy, x, w, b, *stats, eps=1e-5, out=dx, dtype=dtype,
                                                   config=fold_ln)
        s = "given" if stats[0] is not None else "recomputed"
        _close(to_f64(dx, dtype), ref_dx, dtype, f"layernorm dx (stats {s}) {what}", row_scale=scale, atol=1e-6)
        _close(to_f64(got_dw, dtype), ref_dw, dtype, f"layernorm dweight (stats {s}) {what}",
               atol=2e-5 * np.abs(dy64).sum(0) * 4)
        _close(to_f64(got_db, dtype), ref_db, dtype, f"layernorm dbias (stats {s}) {what}",
               atol=1e-5 * np.abs(dy64).sum(0))
    # the same bits twice (the heuristic's path, and the fold), the heuristic's call = its config's,
    # and the fold against the two kernels: dx bit for bit (the same row math), dweight / dbias to
    # float32 rounding of a different summation order
    cfg = _cfg_for(n, dtype, True)
    a = rtk.layernorm_backward(dy, x, w, b, mean, lrstd, dtype=dtype)
    c = rtk.layernorm_backward(dy, x, w, b, mean, lrstd, dtype=dtype)
    f1 = rtk.layernorm_backward(dy, x, w, b, mean, lrstd, dtype=dtype, config=fold_ln)
    f2 = rtk.layernorm_backward(dy, x, w, b, mean, lrstd, dtype=dtype, config=fold_ln)
    two = rtk.layernorm_backward(dy, x, w, b, mean, lrstd, dtype=dtype, config=fold_ln.replace(fold_colsum=False))
    for name, u, v, g, h in zip(("dx", "dweight", "dbias"), a, c, f1, f2):
        assert cp.array_equal(u, v), f"{what}: two runs differ in {name}"
        assert cp.array_equal(g, h), f"{what}: two folded runs differ in {name}"
    for name, u, v in zip(("dx", "dweight", "dbias"), a, f1 if cfg.fold_colsum else two):
        assert cp.array_equal(u, v), \
            f"{what}: the heuristic's {name} differs from its config's (fold={cfg.fold_colsum})"
    assert cp.array_equal(f1[0], two[0]), f"{what}: dx of the fold != dx of the two kernels"
    for name, u, v in zip(("dweight", "dbias"), f1[1:], two[1:]):
        _close(to_f64(u, dtype), to_f64(v, dtype), dtype, f"{what}: fold vs two kernels {name}",
               atol=2e-5 * np.abs(dy64).sum(0) * 4)
    refused = [c for c in (fold_ln, fold_rms) if c in rb._FOLD_REFUSED]
    print(f"{what}: fold={cfg.fold_colsum} row_class={cfg.row_class} cluster={cfg.launch_cluster} "
          f"refused={[(c.row_class, c.launch_cluster) for c in refused]}")
    # cooperative launches without clusters must be taken on any device that has them
    assert not [c for c in refused if c.launch_cluster == 1], f"{what}: cooperative launch refused"


FOLD_CASES = [   # (n, rows or "waves", dtype): one worker, >= 3 waves of rows, 100k rows
    (1, 1, "bfloat16"), (1, 100_000, "bfloat16"), (7, "waves", "float16"), (7, 100_000, "float32"),
    (33, 1, "float32"), (33, "waves", "bfloat16"), (1000, "waves", "bfloat16"), (1000, 3001, "float16"),
    (4097, 1, "bfloat16"), (4097, "waves", "bfloat16"), (4096, "waves", "float32"),
    (65536, 1, "bfloat16"), (65536, "waves", "bfloat16"), (16384, "waves", "float16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n, rows, dtype", FOLD_CASES)
def test_fold_against_reference_gpu(n, rows, dtype):
    if rows == "waves":
        rows = max(_resident_rows(_cfg_for(n, dtype, layer), layer, given) for layer in (False, True)
                   for given in (False, True))
    _check_fold(n, rows, dtype, "fold")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1024, 4096, 16384])
def test_fold_fallback_when_refused_gpu(n, monkeypatch):
    """A device that refuses the cooperative grid (forced here: the limit read as 0): the op runs
    the two kernels, gives the same results, and remembers the refusal for the config."""
    from rtkernels import kernel as kmod
    cp, random_array, to_f64, poison = _gpu()
    rng = np.random.default_rng(n)
    rows = 777
    x, _ = random_array(rng, (rows, n), "bfloat16")
    dy, _ = random_array(rng, (rows, n), "bfloat16")
    w, _ = random_array(rng, (n,), "bfloat16")
    b, _ = random_array(rng, (n,), "bfloat16")
    cfg = _cfg_for(n, "bfloat16", True).replace(fold_colsum=True)   # (1k lane groups: forced)
    want = rtk.layernorm_backward(dy, x, w, b, dtype="bfloat16", config=cfg.replace(fold_colsum=False))
    saved = set(rb._FOLD_REFUSED)
    try:
        rb._PLANS.clear()
        rtk.layernorm_backward(dy, x, w, b, dtype="bfloat16", config=cfg)   # a plan with the fold (unless refused)
        monkeypatch.setattr(kmod, "_cooperative_limit", lambda *a: 0)
        for step in range(3):   # the plan's replay refused -> planned again; then that plan's replays
            got = rtk.layernorm_backward(dy, x, w, b, dtype="bfloat16", config=cfg)
            for name, u, v in zip(("dx", "dweight", "dbias"), got, want):
                assert cp.array_equal(u, v), f"n={n} call {step}: the fallback's {name} differs from the two kernels"
        assert cfg in rb._FOLD_REFUSED
        rb._PLANS.clear()
        rb._FOLD_REFUSED.discard(cfg)
        got = rtk.layernorm_backward(dy, x, w, b, dtype="bfloat16", config=cfg)   # the full path refused at once
        assert cfg in rb._FOLD_REFUSED and all(cp.array_equal(u, v) for u, v in zip(got, want)), n
    finally:
        rb._FOLD_REFUSED.clear()
        rb._FOLD_REFUSED.update(saved)
        rb._PLANS.clear()


def _graph_inputs(cp, random_array, n, rows, seed):
    rng = np.random.default_rng(seed)
    return [random_array(rng, shape, "bfloat16")[0] for shape in ((rows, n), (rows, n), (n,), (n,))]


@pytest.mark.gpu
@pytest.mark.parametrize("n, rows", [(1024, 5000), (4096, 3001), (16384, 700)])
def test_fold_graph_capture_cupy_gpu(n, rows):
    """Captured once and replayed on new data three times: the same bits as eager calls, so the
    barrier's counters are back at zero after every launch (a stale count would let the tail read
    partial rows not yet written, or hang)."""
    cp, random_array, to_f64, poison = _gpu()
    x, dy, w, b = _graph_inputs(cp, random_array, n, rows, n)
    ln = dict(config=_cfg_for(n, "bfloat16", True).replace(fold_colsum=True))    # (1k: forced)
    rms = dict(config=_cfg_for(n, "bfloat16", False).replace(fold_colsum=True))
    mean = cp.zeros(rows, cp.float32)
    rstd = cp.ones(rows, cp.float32)
    dx = cp.empty_like(x)
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        rtk.layernorm_backward(dy, x, w, b, mean, rstd, out=dx, dtype="bfloat16", **ln)   # compile, plan
        rtk.rmsnorm_backward(dy, x, w, rstd, out=dx, dtype="bfloat16", **rms)
        g_dx2 = cp.empty_like(x)
        s.synchronize()
        s.begin_capture()
        _, g_dw, g_db = rtk.layernorm_backward(dy, x, w, b, mean, rstd, out=dx, dtype="bfloat16", **ln)
        _, g_rdw = rtk.rmsnorm_backward(dy, x, w, rstd, out=g_dx2, dtype="bfloat16", **rms)
        graph = s.end_capture()
    for step in range(3):
        nx, ndy, nw, nb = _graph_inputs(cp, random_array, n, rows, 100 + step)
        for dst, src in ((x, nx), (dy, ndy), (w, nw), (b, nb)):
            dst[...] = src
        mean[...] = cp.asarray(np.random.default_rng(step).standard_normal(rows).astype(np.float32)) * 0.1
        rstd[...] = 1.0 + 0.1 * step
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        e_dx, e_dw, e_db = rtk.layernorm_backward(dy, x, w, b, mean, rstd, dtype="bfloat16", **ln)
        e_dx2, e_rdw = rtk.rmsnorm_backward(dy, x, w, rstd, dtype="bfloat16", **rms)
        cp.cuda.Device().synchronize()
        for name, u, v in (("layernorm dx", dx, e_dx), ("dweight", g_dw, e_dw), ("dbias", g_db, e_db),
                           ("rmsnorm dx", g_dx2, e_dx2), ("rmsnorm dweight", g_rdw, e_rdw)):
            assert cp.array_equal(u, v), f"n={n} rows={rows} replay {step}: {name} differs from an eager call"


@pytest.mark.gpu
def test_fold_graph_capture_torch_gpu():
    torch = pytest.importorskip("torch")
    n, rows = 4096, 2001
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    dy, w = torch.randn_like(x), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    _, rstd = rtk.rmsnorm(x, w, return_stats=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            rtk.rmsnorm_backward(dy, x, w, rstd)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_dx, g_dw = rtk.rmsnorm_backward(dy, x, w, rstd)
    for step in range(3):
        x.copy_(torch.randn_like(x))
        dy.copy_(torch.randn_like(dy))
        _, r = rtk.rmsnorm(x, w, return_stats=True)
        rstd.copy_(r)
        graph.replay()
        e_dx, e_dw = rtk.rmsnorm_backward(dy, x, w, rstd)
        torch.cuda.synchronize()
        assert torch.equal(g_dx, e_dx) and torch.equal(g_dw, e_dw), f"replay {step} differs from an eager call"
        ref = (dy.double() * (x.double() * rstd.double()[:, None])).sum(0)
        torch.testing.assert_close(g_dw.double(), ref, rtol=2e-2, atol=1e-2 * ref.abs().max().item())


# the fold on configs the heuristic does not pick: merged clusters (one partial row per cluster;
# the non-zero ranks leave the row loop early and still meet the grid barrier), narrow lane groups
# merged by 2, a two_pass grid, the shared-memory ring, bulk stages
FOLD_KNOBS = [
    (4096, 2001, dict(threads_per_row=256, block_size=256, vecs_per_thread=2, acc_smem=True, merge_cluster=4,
                      min_blocks=4)),
    (200, 1001, dict(threads_per_row=8, block_size=64, vecs_per_thread=4, acc_smem=True, merge_cluster=2)),
    (40000, 37, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, two_pass=True)),
    (3000, 517, dict(threads_per_row=128, block_size=128, vecs_per_thread=4, ring_rows=2)),
    (1024, 3001, dict(threads_per_row=16, block_size=128, vecs_per_thread=8, bulk_rows=2)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n, rows, fields", FOLD_KNOBS)
def test_fold_knob_classes_gpu(n, rows, fields):
    from test_rowwise_bwd import _check_config
    from rtkernels import device
    cfg = NormBwdConfig(dtype="bfloat16", weight_dtype="bfloat16", vec=8, fold_colsum=True, **fields)
    if cfg.min_arch > arch_number(device.current_arch()):
        pytest.skip(f"needs sm_{cfg.min_arch}")
    _check_config(cfg, n, rows, f"fold {fields}")
    refused = cfg in rb._FOLD_REFUSED
    print(f"fold {fields}: launch_cluster={cfg.launch_cluster} refused={refused}")
    assert not (refused and cfg.launch_cluster == 1), f"{fields}: cooperative launch refused"
