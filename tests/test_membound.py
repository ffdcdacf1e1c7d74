"""softmax / log-softmax, RMSNorm, LayerNorm and row reductions (rtkernels/ops/rowwise.py).

CPU: config and argument errors, the heuristics' width classes, every config the heuristics can
choose compiles for sm_80 and sm_90 without spills, 128-bit global accesses in the SASS of the
vectorized configs, and NumPy models of the per-thread (max, sum) / (count, mean, M2) combines.
GPU (-m gpu): against float64 references over awkward widths, strided and misaligned rows,
-inf / all-equal / huge-magnitude rows, every dtype, with NaN-poisoned outputs.
"""
import math

import numpy as np
import pytest
from sweep import FULL_SWEEP

import rtkernels as rtk
from rtkernels.arch import arch_number
from rtkernels.errors import ConfigError
from rtkernels.inspect import sass_stats
from rtkernels.ops import rowwise as rw
from rtkernels.ops import rowwise_bwd as rb
from rtkernels.ops.rowwise import NormConfig, ReduceConfig, SoftmaxConfig

ARCHS = ("sm_80", "sm_90")


# ---- configs and arguments (CPU) -------------------------------------------------------------
@pytest.mark.parametrize("cls, params, field", [
    (SoftmaxConfig, dict(dtype="float16", vec=16), "vec"),
    (SoftmaxConfig, dict(dtype="float32", vec=8), "vec"),
    (SoftmaxConfig, dict(dtype="int8"), "dtype"),
    (SoftmaxConfig, dict(block_size=256, threads_per_row=64), "threads_per_row"),
    (SoftmaxConfig, dict(block_size=48), "block_size"),
    (SoftmaxConfig, dict(vecs_per_thread=0), "vecs_per_thread"),
    (SoftmaxConfig, dict(threads_per_row=32, block_size=128, cluster_size=2), "cluster_size"),
    (SoftmaxConfig, dict(threads_per_row=256, block_size=256, cluster_size=3), "cluster_size"),
    (SoftmaxConfig, dict(threads_per_row=256, block_size=256, cluster_size=2, two_pass=True), "two_pass"),
    (SoftmaxConfig, dict(threads_per_row=32, block_size=128, two_pass=True), "two_pass"),
    (NormConfig, dict(dtype="float16", weight_dtype="bfloat16"), "weight_dtype"),
    (ReduceConfig, dict(dtype="float64"), "dtype"),
])
def test_config_errors_name_the_field(cls, params, field):
    with pytest.raises(ConfigError) as e:
        cls(**params)
    assert e.value.field == field and field in str(e.value)


def test_config_derived_values():
    c = SoftmaxConfig(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, vecs_per_thread=4,
                      cluster_size=8)
    assert (c.row_class, c.chunk_elements, c.min_arch, c.expected_global_width) == ("cluster", 65536, 90, 128)
    assert c.grid(3) == 24
    g = SoftmaxConfig(dtype="float32", vec=4, threads_per_row=8, block_size=128, vecs_per_thread=2)
    assert (g.row_class, g.rows_per_block, g.grid(33)) == ("group", 16, 3)
    assert NormConfig(dtype="float16", vec=1, weight_dtype="float32").expected_global_width == 16
    assert rtk.compile("softmax", dtype="float32", vec=4, arch="sm_90", kernel="log_softmax_rows").name \
        == "log_softmax_rows"


@pytest.mark.parametrize("call, field", [
    (lambda x: rw.softmax(x, axis=0), "axis"),
    (lambda x: rw.softmax(x, axis=True), "axis"),
    (lambda x: rw.reduce(x, op="mean"), "op"),
    (lambda x: rw.reduce(x, op="sum", axis=-2), "axis"),
    (lambda x: rw.softmax(x.astype(np.int32)), "dtype"),
    (lambda x: rw.softmax(x, dtype="bfloat16"), "dtype"),   # float16 data is not bfloat16 bits
])
def test_op_argument_errors_before_any_device_work(call, field):
    x = np.zeros((4, 8), dtype=np.float16)   # host arrays: these errors come first
    with pytest.raises(ConfigError) as e:
        call(x)
    assert e.value.field == field


def test_public_api_exposes_the_ops():
    for name in ("softmax", "rmsnorm", "layernorm", "reduce"):
        assert getattr(rtk, name) is getattr(rw, name)


def test_host_arrays_are_rejected_clearly():
    with pytest.raises((ConfigError, TypeError), match="device|CUDA"):
        rw.softmax(np.zeros((4, 8), dtype=np.float32))


@pytest.mark.parametrize("n, dtype, arch, row_class", [
    (1, "float16", "sm_90", "group"), (1000, "float16", "sm_90", "group"), (4096, "float16", "sm_90", "block"),
    (8192, "float32", "sm_90", "block"), (16384, "float32", "sm_90", "cluster"), (65536, "bfloat16", "sm_90", "cluster"),
    (16384, "bfloat16", "sm_90", "block"),  # measured table (H200): a 512-thread block beat the cluster
    (262144, "float32", "sm_90", "cluster"), (16384, "float16", "sm_80", "block"),
    (65536, "float16", "sm_80", "two_pass"),
])
def test_plan_width_classes(n, dtype, arch, row_class):
    size = rtk.dtypes.itemsize(dtype)
    cfg = rw.plan("softmax", n, dtype, 16 // size if n % (16 // size) == 0 else 1, arch)
    assert cfg.row_class == row_class
    if row_class != "two_pass":
        assert cfg.chunk_elements >= n          # the whole row fits the register array


# ---- widths between powers of two (rowwise.fit_width) --------------------------------------------
@pytest.mark.parametrize("n, op, shape", [
    # measured picks (H200, 2026-11-28, rowwise.py's widths section): (threads per row, vectors per thread)
    (5120, "rmsnorm", (128, 5)), (5120, "layernorm", (128, 5)), (5120, "softmax", (128, 5)),
    (1280, "layernorm", (32, 5)), (2560, "softmax", (64, 5)), (4608, "rmsnorm", (128, 5)),
    (6144, "rmsnorm", (256, 3)), (6144, "layernorm", (128, 6)), (6144, "softmax", (128, 6)),
    (12288, "rmsnorm", (512, 3)), (12288, "softmax", (256, 6)), (768, "layernorm", (32, 3)),
    # rows at least 7/8 full and powers of two keep the table's config
    (3584, "rmsnorm", (128, 4)), (7168, "softmax", (256, 4)), (4096, "layernorm", (128, 4)),
    (16384, "softmax", (512, 4)),
    # rows in shared memory (smem_rows) may take up to 16 vectors per thread
    (18944, "softmax", (128, 10)), (151936, "softmax", (256, 10)), (50264, "layernorm", (128, 13)),
    (65536, "softmax", (256, 8)),
])
def test_plan_refits_rows_between_powers_of_two(n, op, shape):
    fam, layer = ("softmax", False) if op == "softmax" else ("norm", op == "layernorm")
    cfg = rw.plan(fam, n, "bfloat16", 8, "sm_90", weight_dtype="bfloat16", layer=layer)
    table = rw.plan(fam, n, "bfloat16", 8, "sm_90", weight_dtype="bfloat16", layer=layer, fit=False)
    assert (cfg.threads_per_row, cfg.vecs_per_thread) == shape
    assert cfg.chunk_elements >= n
    if cfg != table:   # the refit keeps everything but the row's shape (and the cap's threads per SM)
        assert cfg.replace(threads_per_row=table.threads_per_row, block_size=table.block_size,
                           vecs_per_thread=table.vecs_per_thread, min_blocks=table.min_blocks) == table
        # the register cap never asks for more threads per SM than the table's (fewer when a thread
        # holds more vectors, or when shared-memory slices fit fewer blocks)
        assert cfg.min_blocks * cfg.block_size <= max(table.min_blocks * table.block_size, cfg.block_size)
        assert not cfg.smem_rows or cfg.min_blocks * cfg.shared_mem_bytes <= rw._SMEM_MAX


def test_refit_never_fills_a_row_worse_and_stays_within_its_cap():
    for threads, vecs in ((32, 4), (64, 4), (128, 4), (256, 4), (512, 4), (256, 8), (512, 2)):
        for fewest in (False, True):
            for share in range(threads * vecs // 2 + 1, threads * vecs + 1):
                t, v = rw.fit_choice(share, threads, vecs, fewest)
                assert t * v >= share and t <= threads and t & (t - 1) == 0
                assert v <= max(vecs, min(6, vecs * 3 // 2))
                ts, vs = rw.fit_choice(share, threads, vecs, fewest, smem_rows=True)
                assert ts * vs >= share and vs <= 16 and share / (ts * vs) >= share / (t * v) - 1e-12
                assert share / (t * v) >= share / (threads * vecs) - 1e-12


def test_heuristic_configs_list_every_refit_plan_can_return():
    listed = {cfg for _, cfg, _ in rw.heuristic_configs("sm_90")}
    for fam, layer in (("softmax", False), ("norm", False), ("norm", True)):
        for dtype, vec in (("bfloat16", 8), ("float32", 4)):
            for wdt in ((dtype, "float32") if fam == "norm" else (None,)):
                for n in list(range(vec, 70000, 24 * vec)) + [5120, 4608, 18944, 151936]:
                    assert rw.plan(fam, n, dtype, vec, "sm_90", weight_dtype=wdt, layer=layer) in listed, (fam, n)
    # unmeasured: sm_80 and rows read in narrower vectors keep the table's config
    assert rw.plan("softmax", 5120, "bfloat16", 8, "sm_80") == rw.plan("softmax", 5120, "bfloat16", 8, "sm_80",
                                                                       fit=False)
    assert rw.plan("softmax", 5121, "bfloat16", 1, "sm_90") == rw.plan("softmax", 5121, "bfloat16", 1, "sm_90",
                                                                       fit=False)


def test_plan_measured_sm90_choices():
    sm = rw.plan("softmax", 4096, "bfloat16", 8, "sm_90")
    assert (sm.block_size, sm.vecs_per_thread, sm.streaming) == (128, 4, False)       # plain hints won
    assert rw.plan("softmax", 1 << 20, "bfloat16", 8, "sm_90").streaming                # two passes keep .cs
    s64 = rw.plan("softmax", 65536, "bfloat16", 8, "sm_90")
    assert (s64.cluster_size, s64.cluster_push, s64.smem_rows, s64.shared_mem_bytes) == (4, True, True, 32768)
    assert rw.plan("norm", 65536, "bfloat16", 8, "sm_90", weight_dtype="float32", layer=True).smem_rows
    assert rw.plan("softmax", 4096, "bfloat16", 8, "sm_80").streaming                   # measured on sm_90 only
    s256 = rw.plan("softmax", 262144, "bfloat16", 8, "sm_90")
    assert (s256.row_class, s256.block_size, s256.shared_mem_bytes, s256.max_registers) == ("cluster", 512, 65536, 40)
    r16 = rw.plan("norm", 16384, "bfloat16", 8, "sm_90", weight_dtype="bfloat16")
    assert (r16.ring_rows, r16.min_blocks, r16.param_slots, r16.two_pass) == (3, 2, 1, False)
    assert rw.plan("norm", 16384, "bfloat16", 8, "sm_90", weight_dtype="float32").two_pass
    l4 = rw.plan("norm", 4096, "float16", 8, "sm_90", weight_dtype="float16", layer=True)
    assert (l4.min_blocks, l4.param_slots, l4.max_registers) == (7, 1, 72)
    assert rw.plan("norm", 4096, "float16", 8, "sm_90", weight_dtype="float32", layer=True).min_blocks == 1
    ln = rw.plan("norm", 16384, "bfloat16", 8, "sm_90", weight_dtype="bfloat16", layer=True)
    assert (ln.prefetch, ln.min_blocks, ln.streaming) == (False, 2, True)              # LayerNorm keeps .cs


def test_plan_never_needs_more_than_8_block_clusters_or_1024_threads():
    for arch in ARCHS:
        for _, cfg, _ in rw.heuristic_configs(arch):
            assert cfg.cluster_size <= 8 and cfg.block_size <= 1024
            assert arch == "sm_90" or cfg.cluster_size == 1


def _register_footprints(arch):
    """(config, kernels) the heuristics use; lane-group configs merged across threads_per_row (it
    only changes the shuffle distances, not what a thread holds)."""
    seen = {}
    for _, cfg, names in rw.heuristic_configs(arch):
        key = cfg.replace(threads_per_row=32) if cfg.row_class == "group" else cfg
        seen.setdefault(key, set()).update(names)
    return [(cfg, tuple(sorted(names))) for cfg, names in seen.items()]


def _compile_all(arch, configs):
    bad = []
    for cfg, names in configs:
        for name in names:
            r = rtk.get_kernel(cfg, name, arch=arch).resources
            if r.spill_stores or r.spill_loads:
                bad.append((cfg.key(), name, r))
    return bad


def _at_risk(cfg):
    # Register caps below 255 come from __launch_bounds__ >= 512 threads; 16-byte vectors hold the most.
    return cfg.block_size >= 512 or cfg.row_class in ("two_pass", "cluster") or \
        cfg.vec * rtk.dtypes.itemsize(cfg.dtype) == 16


@pytest.mark.parametrize("arch", ARCHS)
def test_heuristic_configs_at_risk_compile_without_spills(arch):
    configs = [(c, names) for c, names in _register_footprints(arch) if _at_risk(c)]
    assert configs
    assert _compile_all(arch, configs) == []


@pytest.mark.slow
@pytest.mark.skipif(not FULL_SWEEP, reason="~220 s of compiles in CI: the at-risk configs above are compiled there; "
                                           "set RTKERNELS_TEST_FULL_SWEEP=1 for every config")
@pytest.mark.parametrize("arch", ARCHS)
def test_every_heuristic_config_compiles_without_spills(arch):
    assert _compile_all(arch, _register_footprints(arch)) == []


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family, kernel, n", [
    ("softmax", "softmax_rows", 1024), ("softmax", "softmax_rows", 8192), ("softmax", "log_softmax_rows", 32768),
    ("norm", "rmsnorm_rows", 4096), ("norm", "layernorm_rows", 65536), ("reduce", "reduce_sum_rows", 4096),
    ("reduce", "reduce_argmax_rows", 4096),
])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_vectorized_path_uses_128_bit_global_accesses(arch, family, kernel, n, dtype):
    vec = 16 // rtk.dtypes.itemsize(dtype)
    cfg = rw.plan(family, n, dtype, vec, arch, layer=kernel == "layernorm_rows")
    k = rtk.get_kernel(cfg, kernel, arch=arch)
    stats = sass_stats(k.sass)
    if getattr(cfg, "smem_rows", False):
        assert "UBLKCP" in k.sass       # the row arrives by one bulk copy per block, not LDG
    else:
        assert stats["ldg_128"] >= cfg.vecs_per_thread, k.sass[:2000]
    assert stats["ldl"] == 0 and stats["stl"] == 0
    if family != "reduce":
        assert stats["stg_128"] >= 1 and stats["global_stores"] == stats["stg_128"]
    if cfg.cluster_size > 1:   # the cluster barrier (at least once) and the exchange of block totals
        assert "UCGABAR" in k.sass and ("STAS" in k.sass if getattr(cfg, "cluster_push", False) else "LD" in k.sass)


def test_narrow_vectors_when_alignment_forbids_16_bytes():
    assert rw._pick_vec(2, 4096, (256, 512), (4096,)) == 8
    assert rw._pick_vec(2, 4096, (258, 512), (4096,)) == 1          # base pointer off by one element
    assert rw._pick_vec(2, 4100, (256, 512), (4100,)) == 4          # 4100 = 4 * 1025
    assert rw._pick_vec(4, 1000, (256,), (1002,)) == 2              # the row stride allows pairs only
    assert rw._pick_vec(4, 7, (256,), ()) == 1


@pytest.mark.parametrize("family, n", [("softmax", 50257), ("softmax", 4001), ("softmax", 1001), ("softmax", 300001),
                                       ("softmax_bwd", 4001), ("softmax_bwd", 300001)])
def test_ragged_rows_keep_128_bit_bodies(family, n):
    """Odd widths read ragged (rowwise.vector_access) keep 16-byte loads (or the bulk copy) and
    stores in the body; the edges are the only 16-bit accesses."""
    plan = rw.plan if family == "softmax" else rb.plan_bwd
    cfg = rw.as_ragged(plan(family, -(-n // 8) * 8, "bfloat16", 8, "sm_90"))
    assert cfg.ragged
    k = rtk.get_kernel(cfg, cfg.kernels[0], arch="sm_90")
    stats = sass_stats(k.sass)
    assert stats["ldl"] == 0 and stats["stl"] == 0
    assert stats["stg_128"] >= 1 and stats["stg_16"] >= 1 and stats["global_stores"] == stats["stg_128"] + stats["stg_16"]
    assert "UBLKCP" in k.sass if cfg.smem_rows else stats["ldg_128"] >= cfg.vecs_per_thread


def test_vector_access_reads_odd_widths_ragged():
    assert rw.vector_access(2, 50257, 8, (256, 1 << 20), (50257, 50257)) == (8, True)
    assert rw.vector_access(2, 50257, 8, (256, (1 << 20) + 2), (50257, 50257)) == (1, False)   # out's phase differs
    assert rw.vector_access(2, 4096, 8, (256, 512), (4096, 4096)) == (8, False)                # aligned: not ragged
    assert rw.vector_access(2, 31, 8, (256, 512), (31, 31)) == (1, False)                      # < 4 vectors: narrow
    assert rw.vector_access(4, 4001, 1, (260, 1028), ()) == (4, True)                           # one row, same phase
    sm = rw.as_ragged(rw.plan("softmax", 50264, "bfloat16", 8, "sm_90"))
    assert sm.ragged and sm.smem_rows
    with pytest.raises(ConfigError, match="ragged"):
        rw.SoftmaxConfig(dtype="bfloat16", vec=4, ragged=True)
    with pytest.raises(ConfigError, match="ragged"):
        rw.SoftmaxConfig(dtype="bfloat16", vec=8, threads_per_row=128, block_size=128, prefetch=True, ragged=True)
    with pytest.raises(ConfigError, match="ragged"):   # a ragged config on aligned rows
        rw.check_config_ragged(rw.as_ragged(rw.plan("softmax", 50264, "bfloat16", 8, "sm_90")), False, "softmax")
    # a caller's config without ragged gets the narrow vectors on ragged rows
    assert rw.rows_access(2, 50257, 8, (256, 1 << 20), (50257, 50257), rw.plan("softmax", 50257, "bfloat16", 1,
                                                                               "sm_90")) == (1, False)
    assert rw.rows_access(2, 50257, 8, (256, 1 << 20), (50257, 50257)) == (8, True)
    with pytest.raises(ConfigError, match="ragged"):
        rb.SoftmaxBwdConfig(dtype="float32", vec=2, ragged=True)
    listed = {cfg for _, cfg, _ in rw.heuristic_configs("sm_90")}
    assert rw.as_ragged(rw.plan("softmax", 50264, "bfloat16", 8, "sm_90")) in listed
    assert rw.as_ragged(rb.plan_bwd("softmax_bwd", 50264, "bfloat16", 8, "sm_90")) in \
        {cfg for _, cfg in rb.heuristic_configs("sm_90")}


def test_row_layout_collapses_leading_dims():
    class V:   # the attributes _row_layout reads from a CuPy view
        def __init__(self, shape, strides, item=2):
            self.shape, self.strides, self.itemsize, self.ndim = shape, tuple(s * item for s in strides), item, len(shape)
    assert rw._row_layout(V((2, 3, 8), (24, 8, 1))) == (6, 8, 8)
    assert rw._row_layout(V((2, 3, 8), (60, 20, 1))) == (6, 8, 20)     # row slice of a wider array
    assert rw._row_layout(V((2, 3, 8), (40, 10, 1))) is None           # 40 != 3 * 10: needs a copy
    assert rw._row_layout(V((3, 8), (1, 3))) is None                   # transposed
    assert rw._row_layout(V((1, 1, 8), (0, 0, 1))) == (1, 8, 8)
    assert rw._row_layout(V((5, 1), (7, 3))) == (5, 1, 7)


# ---- NumPy models of the kernels' combines (CPU) -----------------------------------------------
def _model_softmax(x, threads, log=False):
    """float32 model of softmax_row_resident: per-thread (m, e = exp(x - m_ref), s), xor-tree combine."""
    f = np.float32
    x = x.astype(f)
    parts = np.array_split(x, threads)
    states, cache = [], []
    for p in parts:
        m = f(np.nanmax(p)) if p.size and not np.all(np.isnan(p)) else f(-np.inf)
        m_ref = f(0) if m == -np.inf else m
        with np.errstate(invalid="ignore", over="ignore"):
            d = (p - m_ref).astype(f)
            e = np.exp(d).astype(f)
        states.append((m, f(e.sum(dtype=f))))
        cache.append((m_ref, d, e))

    def combine(a, b):
        m = f(max(a[0], b[0]))
        if m == -np.inf:
            return (m, f(0))
        with np.errstate(invalid="ignore", over="ignore"):
            return (m, f(a[1] * np.exp(f(a[0] - m)) + b[1] * np.exp(f(b[0] - m))))
    while len(states) > 1:   # butterfly: pairwise, like the shuffles
        states = [combine(states[i], states[i + 1]) for i in range(0, len(states), 2)]
    M, S = states[0]
    out = []
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for m_ref, d, e in cache:
            if M == -np.inf:
                out.append(np.full_like(d, -np.inf if log else 0))
            elif log:
                out.append(d + f((m_ref - M) - np.log(S)))
            else:
                out.append(e * f(np.exp(f(min(m_ref, M) - M)) / S))
    return np.concatenate(out)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("case", ["random", "huge", "neg_inf_row", "some_neg_inf", "neg_inf_thread", "equal", "nan"])
def test_softmax_combine_model(case, log):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(64).astype(np.float32)
    if case == "huge":
        x = x * 1e4 - 2e4
    elif case == "neg_inf_row":
        x[:] = -np.inf
    elif case == "some_neg_inf":
        x[::3] = -np.inf
    elif case == "neg_inf_thread":   # a whole thread's slice is -inf while the max is very negative
        x = x - 1e4
        x[:8] = -np.inf
    elif case == "equal":
        x[:] = 3.0
    elif case == "nan":
        x[5] = np.nan
    y = _model_softmax(x, threads=8, log=log)
    ref = rw.softmax_reference(x.astype(np.float64), log_softmax=log)
    if case == "nan":
        assert np.all(np.isnan(y)) and np.all(np.isnan(ref))
        return
    assert not np.any(np.isnan(y))
    if case == "equal" and not log:
        assert np.all(y == np.float32(1) / np.float32(64))
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(y), finite) and np.all(y[~finite] == ref[~finite])
    np.testing.assert_allclose(y[finite], ref[finite], rtol=2e-6, atol=1e-30 if not log else 1e-3)


def test_chan_combine_model_is_symmetric_and_exact_enough():
    f = np.float32

    def combine(a, b):
        n = f(a[0] + b[0])
        if n == 0:
            return (f(0), f(0), f(0))
        inv = f(1) / n
        d = f(b[1] - a[1])
        return (n, f((a[0] * a[1] + b[0] * b[1]) * inv), f(a[2] + b[2] + d * d * (a[0] * b[0] * inv)))
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(4096) * 3 + 1000).astype(f)
    parts = np.array_split(x, 64) + [np.zeros(0, f)] * 64   # threads past the row end hold nothing
    st = [(f(p.size), f(p.mean()) if p.size else f(0), f(((p - p.mean()) ** 2).sum()) if p.size else f(0))
          for p in parts]
    assert combine(st[0], st[1]) == combine(st[1], st[0])
    while len(st) > 1:
        st = [combine(st[i], st[i + 1]) for i in range(0, len(st), 2)]
    x64 = x.astype(np.float64)
    assert st[0][0] == 4096
    assert abs(st[0][1] - x64.mean()) < 1e-4
    assert abs(st[0][2] / 4096 - x64.var()) / x64.var() < 1e-4   # E[x^2]-E[x]^2 in float32 would lose it all


@pytest.mark.parametrize("case", ["offset", "outlier_first", "outlier_later", "constant", "huge"])
def test_shifted_single_pass_stats_model(case):
    """norm.cu.j2's per-thread LayerNorm statistics: sums of d = x - c and d^2 around c = the first
    element, in float32, then mean = c + s1/k, M2 = s2 - s1^2/k; against float64 on 32 values."""
    f = np.float32
    rng = np.random.default_rng(len(case))
    x = rng.standard_normal(32)
    if case == "offset":
        x = x * 3 + 1000
    elif case == "outlier_first":
        x[0] = 1e4
    elif case == "outlier_later":
        x[17] = -1e4
    elif case == "constant":
        x[:] = 0.7
    else:
        x = rng.uniform(-6e4, 6e4, 32)
    x = x.astype(np.float16).astype(f)     # values a 16-bit input can hold
    c = x[0]
    s1 = s2 = f(0)
    for v in x:
        d = f(v - c)
        s1 = f(s1 + d)
        s2 = f(f(d * d) + s2)
    dm = f(s1 * f(1 / f(32)))
    mean, m2 = f(c + dm), max(f(s2 - f(s1 * dm)), f(0))
    x64 = x.astype(np.float64)
    m2_ref = ((x64 - x64.mean()) ** 2).sum()
    assert abs(mean - x64.mean()) <= 1e-6 * np.abs(x64).max() + 1e-30
    # a few dozen ulps of s2 at worst (c an outlier): far below bfloat16/float16 output rounding
    assert abs(m2 - m2_ref) <= 64 * 2 ** -24 * max(float(s2), 1e-30), (m2, m2_ref)


# ---- GPU ---------------------------------------------------------------------------------------
WIDTHS = (1, 7, 31, 32, 33, 1000, 4096, 8191, 32768, 262144)
DTYPES = ("float16", "bfloat16", "float32")
MAX_ELEMENTS = 1 << 21     # rows = 1e5 is cut to this many elements per test (memory/time)
_TOL = {"float16": 2 ** -10, "bfloat16": 2 ** -7, "float32": 2e-5}


def _rows_for(rows, n):
    return max(1, min(rows, MAX_ELEMENTS // n))


def _gpu():
    import cupy as cp
    from gpu_util import f32_from_bf16_bits, poison, random_array, to_f64
    return cp, random_array, to_f64, poison, f32_from_bf16_bits


def _store(cp, host64, dtype):
    """(device array holding host64 rounded to dtype, float64 copy of exactly the stored values)."""
    from gpu_util import bf16_bits_from_f32, f32_from_bf16_bits
    if dtype == "bfloat16":
        bits = bf16_bits_from_f32(host64.astype(np.float32))
        return cp.asarray(bits), f32_from_bf16_bits(bits).astype(np.float64)
    h = host64.astype(dtype)
    return cp.asarray(h), h.astype(np.float64)


def _check(y, ref, dtype, atol, to_f64):
    got = to_f64(y, dtype)
    assert got.shape == ref.shape
    assert not np.any(np.isnan(got) & ~np.isnan(ref)), "NaN in the output (poison not overwritten?)"
    same_inf = np.isinf(ref)
    assert np.array_equal(got[same_inf], ref[same_inf])
    fin = np.isfinite(ref)
    err = np.abs(got[fin] - ref[fin])
    bound = atol + _TOL[dtype] * np.abs(ref[fin])
    assert np.all(err <= bound), f"max err {err.max() if err.size else 0:.3g}, worst excess " \
                                 f"{(err - bound).max() if err.size else 0:.3g}"


def _ref_rounded(ref, dtype):
    """The reference rounded to the output dtype (what a perfect kernel would store)."""
    from gpu_util import bf16_bits_from_f32, f32_from_bf16_bits
    if dtype == "bfloat16":
        return f32_from_bf16_bits(bf16_bits_from_f32(ref.astype(np.float32))).astype(np.float64)
    return ref.astype(dtype).astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 100000])
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_gpu(dtype, n, rows):
    cp, random_array, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(n * 7 + rows)
    r = _rows_for(rows, n)
    x, x64 = random_array(rng, (r, n), dtype, scale=3.0)
    for log in (False, True):
        out = poison(cp.empty_like(x))
        y = rw.softmax(x, out=out, log_softmax=log, dtype=dtype)
        assert y is out
        ref = rw.softmax_reference(x64, log_softmax=log)
        _check(y, ref, dtype, 1e-6 if not log else 1e-5, to_f64)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 100000])
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_gpu(dtype, n, rows):
    cp, random_array, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(n * 11 + rows)
    r = _rows_for(rows, n)
    x, x64 = random_array(rng, (r, n), dtype, scale=2.0)
    w, w64 = random_array(rng, (n,), dtype)
    b, b64 = random_array(rng, (n,), dtype)
    y = rw.rmsnorm(x, w, eps=1e-6, out=poison(cp.empty_like(x)), dtype=dtype)
    _check(y, rw.rmsnorm_reference(x64, w64, 1e-6), dtype, _TOL[dtype], to_f64)
    y = rw.layernorm(x, w, b, eps=1e-5, out=poison(cp.empty_like(x)), dtype=dtype)
    _check(y, rw.layernorm_reference(x64, w64, b64, 1e-5), dtype, 4 * _TOL[dtype], to_f64)


# Widths whose configs are refitted (rowwise.fit_width): 4-6 vectors per thread at half the
# table's threads, 3 at its threads, and a cluster row of 5 per thread.
MODEL_WIDTHS = (768, 1280, 1536, 2560, 4608, 5120, 6144, 12288, 18944)


@pytest.mark.gpu
@pytest.mark.parametrize("n", MODEL_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_refitted_widths_gpu(dtype, n):
    cp, random_array, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(n * 13)
    r = _rows_for(1000, n) | 1    # an odd row count: lane groups and blocks end mid-block
    x, x64 = random_array(rng, (r, n), dtype, scale=3.0)
    w, w64 = random_array(rng, (n,), dtype)
    b, b64 = random_array(rng, (n,), dtype)
    vec = 16 // rtk.dtypes.itemsize(dtype)
    for fam, layer in (("softmax", False), ("norm", False), ("norm", True)):
        cfg = rw.plan(fam, n, dtype, vec, "sm_90", weight_dtype=dtype, layer=layer)
        assert cfg != rw.plan(fam, n, dtype, vec, "sm_90", weight_dtype=dtype, layer=layer, fit=False) or \
            n * 8 // 7 >= cfg.chunk_elements or cfg.two_pass, "the case no longer exercises a refit"
    for log in (False, True):
        y = rw.softmax(x, out=poison(cp.empty_like(x)), log_softmax=log, dtype=dtype)
        _check(y, rw.softmax_reference(x64, log_softmax=log), dtype, 1e-6 if not log else 1e-5, to_f64)
    y = rw.rmsnorm(x, w, eps=1e-6, out=poison(cp.empty_like(x)), dtype=dtype)
    _check(y, rw.rmsnorm_reference(x64, w64, 1e-6), dtype, _TOL[dtype], to_f64)
    y = rw.layernorm(x, w, b, eps=1e-5, out=poison(cp.empty_like(x)), dtype=dtype)
    _check(y, rw.layernorm_reference(x64, w64, b64, 1e-5), dtype, 4 * _TOL[dtype], to_f64)


# Odd widths: rows start at every 2- (4-) byte offset, so softmax reads them ragged (16-byte body,
# scalar head and tail per row, rowwise.vector_access): lane groups (33, 1001), a block (4001), shared-
# memory cluster slices (50257, 151643) and two passes (300001).
RAGGED_WIDTHS = (33, 1001, 4001, 50257, 151643, 300001)


def _flat_rows(flat, off, rows, n):
    """rows x n contiguous rows starting `off` elements into `flat` (a device or host array)."""
    return flat[off:off + rows * n].reshape(rows, n)


@pytest.mark.gpu
@pytest.mark.parametrize("n", RAGGED_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_ragged_rows_gpu(dtype, n):
    cp, _, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(n + 5)
    rows = max(3, min(37, MAX_ELEMENTS // n)) | 1
    size = rtk.dtypes.itemsize(dtype)
    for off, out_off in ((0, None), (3, 3), (5, 5), (0, 1)):   # (0, 1): phases differ -> narrow vectors
        host = rng.standard_normal(rows * n + 16) * 3.0
        rows64 = _flat_rows(host, off, rows, n)              # a view: edits land in `host`
        rows64[0] = -np.inf                                  # all -inf: 0 (log: -inf)
        rows64[1, 0] = 40.0                                  # the row's max in its first element (a head)
        rows64[2, -1] = 40.0                                 # ... in its last (a tail)
        flat, flat64 = _store(cp, host, dtype)
        x = _flat_rows(flat, off, rows, n)
        x64 = _flat_rows(flat64, off, rows, n)
        obig = poison(cp.empty(rows * n + 16, dtype=flat.dtype))
        out = None if out_off is None else _flat_rows(obig, out_off, rows, n)
        optr = out.data.ptr if out is not None else 256 * 1024   # a new array: a 256-byte aligned base
        vec, ragged = rw.vector_access(size, n, rows, (x.data.ptr, optr), (n, n))
        assert ragged == (out_off != 1), (off, out_off, vec)
        for log in (False, True):
            y = rw.softmax(x, out=None if out is None else poison(out), log_softmax=log, dtype=dtype)
            _check(y, rw.softmax_reference(x64, log_softmax=log), dtype, 1e-6 if not log else 1e-5, to_f64)
            if out is not None:   # nothing outside the output's rows was written
                assert np.all(np.isnan(to_f64(obig[:out_off], dtype)))
                assert np.all(np.isnan(to_f64(obig[out_off + rows * n:], dtype)))
        if out_off is None:   # a caller's narrow-vector config still reads these rows narrow
            narrow = rw.plan("softmax", n, dtype, 1, "sm_90")
            y = rw.softmax(x, dtype=dtype, config=narrow)
            _check(y, rw.softmax_reference(x64), dtype, 1e-6, to_f64)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 100000])
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_gpu(dtype, n, rows):
    cp, random_array, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(n * 13 + rows)
    r = _rows_for(rows, n)
    x, x64 = random_array(rng, (r, n), dtype)
    for op in ("sum", "max", "min"):
        out = poison(cp.empty((r,), dtype=x.dtype))
        y = rw.reduce(x, op=op, out=out, dtype=dtype)
        ref = rw.reduce_reference(x64, op)
        if op == "sum":   # float32 accumulation (<= ~80 sequential adds), then one rounding to dtype
            atol = 4e-6 * np.abs(x64).sum(axis=-1) + 1e-30
            got = to_f64(y, dtype)
            assert np.all(np.abs(got - ref) <= atol + _TOL[dtype] * np.abs(ref)), op
        else:             # an element of the row: exact
            assert np.array_equal(to_f64(y, dtype), ref), op
    y = rw.reduce(x, op="argmax", dtype=dtype)
    assert str(y.dtype) == "int64"
    assert np.array_equal(cp.asnumpy(y), rw.reduce_reference(x64, "argmax"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [33, 1000, 4096, 32768])
def test_strided_and_misaligned_rows_gpu(dtype, n):
    cp, random_array, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(n)
    big, big64 = random_array(rng, (64, n + 8), dtype)
    odd, odd64 = random_array(rng, (64, n + 9), dtype)
    views = {"row_stride": (big[:, :n], big64[:, :n]),                 # stride n + 8: still vectorized
             "misaligned": (big[:, 1:n + 1], big64[:, 1:n + 1]),       # base pointer off by one element
             "odd_stride": (odd[:, :n], odd64[:, :n])}                  # stride n + 9: scalar
    for name, (x, x64) in views.items():
        ref = rw.softmax_reference(x64)
        _check(rw.softmax(x, dtype=dtype), ref, dtype, 1e-6, to_f64)
        w, w64 = random_array(rng, (x.shape[-1],), dtype)
        _check(rw.rmsnorm(x, w, dtype=dtype), rw.rmsnorm_reference(x64, w64), dtype, _TOL[dtype], to_f64)
        assert np.array_equal(cp.asnumpy(rw.reduce(x, op="argmax", dtype=dtype)), rw.reduce_reference(x64, "argmax"))
        # strided output too
        obig = poison(cp.empty((64, n + 9), dtype=big.dtype))
        o = obig[:, 3:3 + x.shape[-1]]
        rw.softmax(x, out=o, dtype=dtype)
        _check(o, ref, dtype, 1e-6, to_f64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_launch_plans_replay_per_signature_gpu(dtype):
    """Second calls with a signature replay the first call's launch; anything that changes a
    decision (alignment, strides, out given or not, options) is a different plan."""
    cp, random_array, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(17)
    n = 1000
    rw._PLANS.clear()
    big, big64 = random_array(rng, (2, 48, n + 8), dtype)
    w, w64 = random_array(rng, (n,), dtype)
    b, b64 = random_array(rng, (n,), dtype)
    calls = [(big[0, :, :n], big64[0, :, :n]), (big[1, :, :n], big64[1, :, :n]),     # same signature
             (big[0, :, 1:n + 1], big64[0, :, 1:n + 1]),                            # 2-byte offset: narrower vec
             (big[1, :, 1:n + 1], big64[1, :, 1:n + 1])]
    for x, x64 in calls:
        for log in (False, True):
            _check(rw.softmax(x, log_softmax=log, dtype=dtype), rw.softmax_reference(x64, log), dtype,
                   1e-6 if not log else 1e-5, to_f64)
            out = poison(cp.empty(x.shape, dtype=x.dtype))
            assert rw.softmax(x, log_softmax=log, out=out, dtype=dtype) is out
            _check(out, rw.softmax_reference(x64, log), dtype, 1e-6 if not log else 1e-5, to_f64)
        _check(rw.rmsnorm(x, w, eps=1e-6, dtype=dtype), rw.rmsnorm_reference(x64, w64, 1e-6), dtype,
               _TOL[dtype], to_f64)
        _check(rw.layernorm(x, w, b, eps=1e-5, dtype=dtype), rw.layernorm_reference(x64, w64, b64, 1e-5), dtype,
               4 * _TOL[dtype], to_f64)
        _check(rw.layernorm(x, w, b, eps=0.5, dtype=dtype), rw.layernorm_reference(x64, w64, b64, 0.5), dtype,
               4 * _TOL[dtype], to_f64)
        y = rw.reduce(x, op="argmax", dtype=dtype)
        assert str(y.dtype) == "int64" and y.shape == (48,)
        assert np.array_equal(cp.asnumpy(y), rw.reduce_reference(x64, "argmax"))
    # 2 alignments x (softmax, log-softmax) x (out new, given) + rmsnorm, layernorm x 2 eps, argmax
    assert len(rw._PLANS) == 2 * (4 + 1 + 2 + 1)
    # a replayed signature still rejects what its first call would have rejected
    with pytest.raises(ConfigError, match="axis"):
        rw.softmax(calls[0][0], axis=0, dtype=dtype)
    other = "float32" if dtype != "float32" else "float16"
    with pytest.raises(ConfigError, match="dtype"):
        rw.softmax(calls[0][0], dtype=other)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_shapes_and_copied_views_gpu(dtype):
    cp, random_array, to_f64, _, _ = _gpu()
    rng = np.random.default_rng(5)
    x, x64 = random_array(rng, (3, 5, 1000), dtype)
    _check(rw.softmax(x, dtype=dtype), rw.softmax_reference(x64), dtype, 1e-6, to_f64)
    assert rw.reduce(x, op="max", dtype=dtype).shape == (3, 5)
    xt, xt64 = x.transpose(1, 0, 2), x64.transpose(1, 0, 2)       # leading dims not collapsible: copied
    _check(rw.softmax(xt, dtype=dtype), rw.softmax_reference(xt64), dtype, 1e-6, to_f64)
    xc, xc64 = x[:, :, ::2], x64[:, :, ::2]                          # last axis not contiguous: copied
    _check(rw.softmax(xc, dtype=dtype, axis=2), rw.softmax_reference(xc64), dtype, 1e-6, to_f64)
    v, v64 = random_array(rng, (777,), dtype)                         # 1-D: one row, 0-d reduction
    assert rw.reduce(v, op="argmax", dtype=dtype).shape == ()
    _check(rw.softmax(v, dtype=dtype), rw.softmax_reference(v64), dtype, 1e-6, to_f64)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [7, 1000, 8192, 65536, 262144])
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_rows_gpu(dtype, n):
    cp, _, to_f64, poison, _ = _gpu()
    rows = 6
    h = np.random.default_rng(n).standard_normal((rows, n)) * 3
    h[0] = -np.inf                                 # all -inf: softmax 0, log-softmax -inf
    h[1, ::3] = -np.inf                            # some -inf
    h[2] = 0.5                                     # all equal: exactly fp32(1/n)
    big = 1e4 if dtype != "float32" else 1e30
    h[3] = np.random.default_rng(1).uniform(-big, big, n)   # huge magnitudes: no overflow
    h[4] = -big
    h[4, n // 2] = big / 2                         # one dominant element
    h[5, :] = np.random.default_rng(2).standard_normal(n) - 1e4 if dtype != "bfloat16" else -1e4
    h[5, : max(1, n // 4)] = -np.inf               # a leading stretch (whole threads) of -inf, max very negative
    x, x64 = _store(cp, h, dtype)
    for log in (False, True):
        y = rw.softmax(x, out=poison(cp.empty_like(x)), log_softmax=log, dtype=dtype)
        got = to_f64(y, dtype)
        assert not np.any(np.isnan(got))
        ref = rw.softmax_reference(x64, log_softmax=log)
        if not log:
            assert np.all(got[0] == 0)
            expect = np.float32(1) / np.float32(n)
            assert np.all(got[2] == _ref_rounded(np.array([expect], np.float64), dtype)[0])
            assert abs(got[4, n // 2] - 1) <= _TOL[dtype]
        else:
            assert np.all(got[0] == -np.inf)
        _check(y, ref, dtype, 1e-6 if not log else 1e-5, to_f64)
    am = rw.reduce(x, op="argmax", dtype=dtype)
    assert np.array_equal(cp.asnumpy(am), rw.reduce_reference(x64, "argmax"))   # all -inf row -> 0
    h[1, 5 % n] = np.nan                                                         # NaN: max is NaN, argmax finds it
    x, x64 = _store(cp, h, dtype)
    assert np.isnan(to_f64(rw.reduce(x, op="max", dtype=dtype), dtype)[1])
    assert cp.asnumpy(rw.reduce(x, op="argmax", dtype=dtype))[1] == 5 % n
    assert np.all(np.isnan(to_f64(rw.softmax(x, dtype=dtype), dtype)[1]))


ROW_CLASS_CONFIGS = [   # every row class at widths the heuristics would not give it on this GPU
    (4096, dict(threads_per_row=128, block_size=128, vecs_per_thread=2, two_pass=True)),     # 2 chunks
    (33000, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, two_pass=True)),    # ragged chunks
    (32768, dict(threads_per_row=1024, block_size=1024, vecs_per_thread=4)),                 # sm_80 big block
    (1000, dict(threads_per_row=8, block_size=64, vecs_per_thread=16)),                      # narrow groups
    (5000, dict(threads_per_row=128, block_size=128, vecs_per_thread=8, cluster_size=2)),    # cluster, ragged
    (70000, dict(threads_per_row=256, block_size=256, vecs_per_thread=8, cluster_size=8)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n, fields", ROW_CLASS_CONFIGS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_row_class_gpu(dtype, n, fields):
    from rtkernels import device
    if fields.get("cluster_size", 1) > 1 and arch_number(device.current_arch()) < 90:
        pytest.skip("clusters need sm_90")
    cp, random_array, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(n)
    size = rtk.dtypes.itemsize(dtype)
    vec = 16 // size if n % (16 // size) == 0 else 1
    fields = dict(fields)
    if size == 4:   # the table is written for 16-bit elements: same elements per thread
        fields["vecs_per_thread"] = min(32, fields["vecs_per_thread"] * 2)
    if not fields.get("two_pass") and fields["threads_per_row"] * fields.get("cluster_size", 1) \
            * fields["vecs_per_thread"] * vec < n:
        pytest.skip("does not hold this width with scalar access")
    rows = 37
    x, x64 = random_array(rng, (rows, n), dtype, scale=4.0)
    w, w64 = random_array(rng, (n,), dtype)
    b, b64 = random_array(rng, (n,), dtype)
    scfg = SoftmaxConfig(dtype=dtype, vec=vec, **fields)
    for log in (False, True):
        y = rw.softmax(x, log_softmax=log, out=poison(cp.empty_like(x)), dtype=dtype, config=scfg)
        _check(y, rw.softmax_reference(x64, log_softmax=log), dtype, 1e-6 if not log else 1e-5, to_f64)
    ncfg = NormConfig(dtype=dtype, weight_dtype=dtype, vec=vec, **fields)
    _check(rw.rmsnorm(x, w, out=poison(cp.empty_like(x)), dtype=dtype, config=ncfg),
           rw.rmsnorm_reference(x64, w64), dtype, _TOL[dtype], to_f64)
    if fields["block_size"] <= 512:
        _check(rw.layernorm(x, w, b, out=poison(cp.empty_like(x)), dtype=dtype, config=ncfg),
               rw.layernorm_reference(x64, w64, b64), dtype, 4 * _TOL[dtype], to_f64)
    rfields = {k: v for k, v in fields.items() if k != "two_pass"}
    rcfg = ReduceConfig(dtype=dtype, vec=vec, **rfields)
    assert np.array_equal(cp.asnumpy(rw.reduce(x, op="argmax", dtype=dtype, config=rcfg)),
                          rw.reduce_reference(x64, "argmax"))
    assert np.array_equal(to_f64(rw.reduce(x, op="max", dtype=dtype, config=rcfg), dtype),
                          rw.reduce_reference(x64, "max"))


@pytest.mark.gpu
def test_float32_weights_with_half_activations_gpu():
    cp, random_array, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(9)
    x, x64 = random_array(rng, (300, 4096), "bfloat16")
    w, w64 = random_array(rng, (4096,), "float32")
    b, b64 = random_array(rng, (4096,), "float32")
    _check(rw.layernorm(x, w, b, dtype="bfloat16"), rw.layernorm_reference(x64, w64, b64), "bfloat16",
           4 * _TOL["bfloat16"], to_f64)


@pytest.mark.gpu
def test_torch_tensors_gpu():
    torch = pytest.importorskip("torch")
    x = torch.randn(64, 3000, device="cuda", dtype=torch.bfloat16)
    y = rw.softmax(x)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=1e-6, rtol=2 ** -7)
    w = torch.randn(3000, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(rw.rmsnorm(x, w).float(),
                               torch.nn.functional.rms_norm(x.float(), (3000,), w.float(), 1e-6),
                               atol=2 ** -6, rtol=2 ** -7)
    a = rw.reduce(x, op="argmax")
    assert a.dtype == torch.int64 and torch.equal(a, torch.argmax(x.float(), -1))


@pytest.mark.gpu
def test_torch_side_stream_and_replayed_plans_gpu():
    """torch tensors launch on torch's current stream: inputs written on a side stream right before
    each call, outputs read there after it, no synchronize in between; repeated signatures replay."""
    torch = pytest.importorskip("torch")
    rw._PLANS.clear()
    s = torch.cuda.Stream()
    g = torch.Generator(device="cuda").manual_seed(4)
    got = []
    with torch.cuda.stream(s):
        w = torch.randn(3000, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(3000, device="cuda", dtype=torch.bfloat16, generator=g)
        for trial in range(3):
            x = torch.randn(4096, 3000, device="cuda", dtype=torch.bfloat16, generator=g)
            x.mul_(2.0)   # queued on s right before the op reads x
            y = rw.softmax(x)
            z = rw.layernorm(x, w, b)
            z.add_(1.0)   # queued on s right after the op writes z
            o = torch.empty_like(x)
            rw.rmsnorm(x, w, out=o)
            got.append((x, y, z, o, rw.reduce(x, op="argmax")))
    s.synchronize()
    for x, y, z, o, a in got:
        xf = x.float()
        torch.testing.assert_close(y.float(), torch.softmax(xf, -1), atol=1e-6, rtol=2 ** -7)
        ref = torch.nn.functional.layer_norm(xf, (3000,), w.float(), b.float(), 1e-5) + 1.0
        torch.testing.assert_close(z.float(), ref, atol=2 ** -5, rtol=2 ** -6)
        torch.testing.assert_close(o.float(), torch.nn.functional.rms_norm(xf, (3000,), w.float(), 1e-6),
                                   atol=2 ** -6, rtol=2 ** -7)
        assert torch.equal(a, torch.argmax(xf, -1))
    assert len(rw._PLANS) == 4


@pytest.mark.gpu
def test_empty_inputs_gpu():
    import cupy as cp
    assert rw.softmax(cp.zeros((0, 16), cp.float32)).shape == (0, 16)
    assert rw.reduce(cp.zeros((0, 16), cp.float32), op="sum").shape == (0,)
    with pytest.raises(ConfigError, match="empty"):
        rw.reduce(cp.zeros((4, 0), cp.float32), op="max")
    # documented: float16 sums round once to float16, so 262144 overflows to inf
    assert float(rw.reduce(cp.ones((1, 262144), cp.float16), op="sum")[0]) == math.inf
    assert float(rw.reduce(cp.ones((1, 262144), cp.float32), op="sum")[0]) == 262144


# ---- signature parsing, new knobs, empty layouts (CPU) -------------------------------------
def test_signature_parsing_skips_cluster_dims_and_launch_bounds():
    from rtkernels.kernel import kernel_names, parse_signature
    src = ('using T = float;\n'
           'extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(256, 2)\n'
           'rows(const T* __restrict__ x, T* y, long long n, int w) {}\n'
           'extern "C" __global__ void __launch_bounds__(128) plain(float* a) {}\n')
    assert kernel_names(src) == ["rows", "plain"]
    sig = parse_signature(src, "rows")
    assert [(p.kind, p.ctype) for p in sig] == [("pointer", "T*"), ("pointer", "T*"), ("scalar", "long long"),
                                                 ("scalar", "int")]
    # the cluster templates put the attribute on the definitions: names and types come through
    cfg = SoftmaxConfig(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, vecs_per_thread=4,
                        cluster_size=2)
    src = rtk.get_kernel(cfg, "softmax_rows", arch="sm_90").source
    assert "__cluster_dims__(2, 1, 1)" in src and kernel_names(src) == ["softmax_rows", "log_softmax_rows"]
    assert [p.decl.split()[-1] for p in parse_signature(src, "softmax_rows")] == \
        ["x", "y", "rows", "n", "x_row_stride", "y_row_stride"]


@pytest.mark.parametrize("cls, params, field", [
    (SoftmaxConfig, dict(threads_per_row=256, block_size=256, cluster_push=True), "cluster_push"),
    (SoftmaxConfig, dict(threads_per_row=32, block_size=32, cluster_size=2, cluster_push=True), "cluster_push"),
    (NormConfig, dict(threads_per_row=256, block_size=256, persistent=1), "persistent"),
    (NormConfig, dict(threads_per_row=256, block_size=256, two_pass=True, prefetch=True), "prefetch"),
    (SoftmaxConfig, dict(recompute=1), "recompute"),
    (SoftmaxConfig, dict(block_size=1024, threads_per_row=1024, min_blocks=4), "min_blocks"),
])
def test_new_knobs_are_validated(cls, params, field):
    with pytest.raises(ConfigError) as e:
        cls(**params)
    assert field in str(e.value)


def test_prefetch_grid_is_one_resident_wave():
    cfg = SoftmaxConfig(dtype="bfloat16", vec=8, threads_per_row=128, block_size=128, vecs_per_thread=4,
                        prefetch=True)
    assert cfg.grid(10 ** 6, 132 * 6) == 132 * 6 and cfg.grid(100, 132 * 6) == 100
    assert cfg.replace(prefetch=False).grid(10 ** 6, 132 * 6) == 10 ** 6
    assert SoftmaxConfig(block_size=256, threads_per_row=256, min_blocks=4).max_registers == 64


def test_empty_layouts_need_no_strides():
    # size-0 arrays may carry 0-strides (CuPy / DLPack): no layout check may reject them
    for shape, strides in (((0, 16), (0, 0)), ((4, 0), (0, 0)), ((0,), (0,))):
        v = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, strides)
        assert rw._row_layout(v) is not None


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fields", [
    dict(threads_per_row=128, block_size=128, vecs_per_thread=4, prefetch=True),
    dict(threads_per_row=128, block_size=128, vecs_per_thread=4, recompute=True),
    dict(threads_per_row=32, block_size=128, vecs_per_thread=4, prefetch=True, recompute=True),
])
def test_prefetch_and_recompute_compile_without_spills(arch, fields):
    k = rtk.get_kernel(SoftmaxConfig(dtype="bfloat16", vec=8, **fields), "log_softmax_rows", arch=arch)
    assert k.resources.spill_stores == 0 and sass_stats(k.sass)["ldg_128"] >= 2 * fields["vecs_per_thread"]


# ---- rows staged through shared memory (ring_rows / bulk_stages) ---------------------------------
_B8 = dict(dtype="bfloat16", vec=8)


@pytest.mark.parametrize("cls, params, field", [
    (SoftmaxConfig, dict(_B8, threads_per_row=128, block_size=128, ring_rows=2, bulk_stages=2), "bulk_stages"),
    (SoftmaxConfig, dict(dtype="bfloat16", vec=4, threads_per_row=128, block_size=128, ring_rows=2), "ring_rows"),
    (SoftmaxConfig, dict(_B8, threads_per_row=128, block_size=128, ring_rows=2, two_pass=True), "ring_rows"),
    (SoftmaxConfig, dict(_B8, threads_per_row=128, block_size=128, bulk_stages=2, prefetch=True), "bulk_stages"),
    (SoftmaxConfig, dict(_B8, threads_per_row=32, block_size=128, bulk_stages=2), "bulk_stages"),
    (SoftmaxConfig, dict(_B8, threads_per_row=1024, block_size=1024, vecs_per_thread=8, ring_rows=2), "ring_rows"),
    (SoftmaxConfig, dict(_B8, ring_rows=9), "ring_rows"),
    (NormConfig, dict(_B8, weight_dtype="bfloat16", param_slots=3), "param_slots"),
])
def test_staging_knobs_are_validated(cls, params, field):
    with pytest.raises(ConfigError) as e:
        cls(**params)
    assert field in str(e.value)


def test_staged_configs_derived_values():
    c = SoftmaxConfig(**_B8, threads_per_row=512, block_size=512, vecs_per_thread=4, bulk_stages=3, min_blocks=2)
    assert (c.staged, c.shared_mem_bytes, c.min_arch, c.max_registers) == (True, 3 * 512 * 4 * 16, 90, 64)
    r = c.replace(bulk_stages=0, ring_rows=2, cluster_size=4)
    assert (r.shared_mem_bytes, r.min_arch, r.grid(1000, 264)) == (2 * 512 * 4 * 16, 90, 264)
    assert r.grid(1000, 266) == 264 and r.grid(10, 264) == 40   # whole clusters; few rows: one per cluster
    assert SoftmaxConfig(**_B8).shared_mem_bytes == 0 and not SoftmaxConfig(**_B8).staged


# (width, rows, fields).  The GPU test shrinks the persistent grid to 16 blocks, so every block
# walks many rows through its ring or stages (wrap-around, mbarrier parity flips, rows past the
# end); ragged widths leave partial segments and partial slots.
STAGED_CONFIGS = [
    (1000, 300, dict(threads_per_row=32, block_size=128, vecs_per_thread=4, ring_rows=2, min_blocks=8)),
    (4096, 200, dict(threads_per_row=128, block_size=128, vecs_per_thread=4, ring_rows=3, min_blocks=8)),
    (4000, 200, dict(threads_per_row=128, block_size=128, vecs_per_thread=4, bulk_stages=2, min_blocks=8)),
    (16384, 100, dict(threads_per_row=512, block_size=512, vecs_per_thread=4, ring_rows=2, min_blocks=2)),
    (16000, 100, dict(threads_per_row=512, block_size=512, vecs_per_thread=4, bulk_stages=3, min_blocks=2)),
    (16384, 100, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=2, ring_rows=2,
                      min_blocks=4, streaming=False)),
    (65536, 40, dict(threads_per_row=512, block_size=512, vecs_per_thread=4, cluster_size=4, ring_rows=2,
                     min_blocks=2)),
    (60000, 40, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, bulk_stages=2,
                     min_blocks=4)),
    (16384, 100, dict(threads_per_row=512, block_size=512, vecs_per_thread=4, streaming=False)),   # plain hints
    (65536, 40, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, two_pass=True, streaming=False)),
]


def _staged_id(case):
    n, rows, f = case
    return f"{n}x{rows}-b{f['block_size']}c{f.get('cluster_size', 1)}" + \
        (f"-ring{f['ring_rows']}" if "ring_rows" in f else f"-bulk{f['bulk_stages']}" if "bulk_stages" in f else "") + \
        ("-nocs" if f.get("streaming") is False else "")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", STAGED_CONFIGS, ids=_staged_id)
def test_staged_configs_compile(arch, case):
    _, _, fields = case
    scfg = SoftmaxConfig(**_B8, **fields)
    if scfg.min_arch > int(arch[3:]):
        pytest.skip("clusters / bulk copies need sm_90")
    for cfg, name in ((scfg, "softmax_rows"), (NormConfig(**_B8, weight_dtype="bfloat16", param_slots=1, **fields),
                                               "rmsnorm_rows")):
        k = rtk.get_kernel(cfg, name, arch=arch)
        # (the norms at a 64-register cap may spill a few bytes; the heuristics' choices are checked above)
        assert name != "softmax_rows" or k.resources.spill_stores == 0, (cfg.key(), k.resources)
        stats = sass_stats(k.sass)
        assert stats["stg_128"] >= 1 and stats["global_stores"] == stats["stg_128"]
        if cfg.bulk_stages:
            assert "UBLKCP" in k.sass and "SYNCS" in k.sass    # bulk copy, mbarrier wait
        elif cfg.ring_rows:
            assert "LDGSTS" in k.sass and "LDGDEPBAR" in k.sass
        if not cfg.streaming:
            assert ".EF" not in k.sass    # no evict-first hints
        if name == "softmax_rows" and cfg.staged:
            assert stats["ldg_128"] == 0     # every row load goes through shared memory


@pytest.mark.gpu
@pytest.mark.parametrize("case", STAGED_CONFIGS, ids=_staged_id)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_staged_rows_gpu(dtype, case, monkeypatch):
    from rtkernels import device
    n, rows, fields = case
    monkeypatch.setattr(rw, "_resident_blocks", lambda k, cfg: 16)   # many rows per block
    if (fields.get("cluster_size", 1) > 1 or fields.get("bulk_stages")) and \
            arch_number(device.current_arch()) < 90:
        pytest.skip("clusters / bulk copies need sm_90")
    # row stride n + 8 (still 16-byte rows) except at 4096, where the rows are contiguous
    _three_ops_on_strided_rows(dtype, n, rows, fields, seed=n + rows, norm_fields=dict(param_slots=1, **fields),
                               contiguous=n == 4096)


@pytest.mark.gpu
def test_staged_special_rows_gpu():
    """-inf / all-equal / NaN rows through a ring: the zero-filled and stale slots must not leak."""
    cp, _, to_f64, poison, _ = _gpu()
    n, rows = 4000, 3000     # the real persistent grid: ~1000 blocks, 2-3 rows each
    h = np.random.default_rng(3).standard_normal((rows, n)) * 3
    h[::7] = -np.inf
    h[1::7] = 0.5
    h[2::7, : n // 3] = -np.inf
    x, x64 = _store(cp, h, "bfloat16")
    for fields in (dict(threads_per_row=128, block_size=128, vecs_per_thread=4, ring_rows=2, min_blocks=8),
                   dict(threads_per_row=128, block_size=128, vecs_per_thread=4, bulk_stages=2, min_blocks=8)):
        cfg = SoftmaxConfig(dtype="bfloat16", vec=8, **fields)
        if cfg.min_arch > 80:
            from rtkernels import device
            if arch_number(device.current_arch()) < 90:
                continue
        y = rw.softmax(x, out=poison(cp.empty_like(x)), dtype="bfloat16", config=cfg)
        got = to_f64(y, "bfloat16")
        assert not np.any(np.isnan(got)) and np.all(got[::7] == 0)
        _check(y, rw.softmax_reference(x64), "bfloat16", 1e-6, to_f64)


# ---- cluster rows exchanging block totals by st.async + mbarrier (cluster_push) -------------------
# (width, rows, fields, persistent grid in blocks or None).  The persistent cases shrink the grid so
# that every cluster walks many rows: both slot sets and barrier parities are reused many times.
PUSH_CONFIGS = [
    (65536, 40, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, cluster_push=True,
                     min_blocks=4), None),
    (65536, 40, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, cluster_push=True,
                     persistent=True, prefetch=True, min_blocks=2), 16),
    (60000, 41, dict(threads_per_row=512, block_size=512, vecs_per_thread=4, cluster_size=4, cluster_push=True,
                     persistent=True, min_blocks=2), 16),
    (16384, 100, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=2, cluster_push=True,
                      persistent=True, prefetch=True, min_blocks=2), 6),
    (5000, 37, dict(threads_per_row=128, block_size=128, vecs_per_thread=8, cluster_size=2, cluster_push=True,
                    min_blocks=4), None),
    (65536, 40, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, persistent=True,
                     prefetch=True, min_blocks=2), 16),     # barrier clusters, persistent + prefetch
]


def _push_id(case):
    n, rows, f, grid = case
    return f"{n}x{rows}-b{f['block_size']}c{f['cluster_size']}" + ("-push" if f.get("cluster_push") else "") + \
        (f"-grid{grid}" if grid else "") + ("-pf" if f.get("prefetch") else "")


def _norm_fields(fields):
    """Norm configs of the same shape: one weight (+ bias) vector at a time within 64-80 registers."""
    f = dict(fields)
    if 65536 // (f["block_size"] * f.get("min_blocks", 1)) <= 80:
        f["param_slots"] = 1
    return f


def _row_kernels_sm90(fields):
    """(config, kernel name, Kernel, SASS stats) of the four row kernels built with these fields
    for sm_90, each checked spill-free."""
    for cfg, names in ((SoftmaxConfig(**_B8, **fields), ("softmax_rows", "log_softmax_rows")),
                       (NormConfig(**_B8, weight_dtype="bfloat16", **_norm_fields(fields)),
                        ("rmsnorm_rows", "layernorm_rows"))):
        for name in names:
            k = rtk.get_kernel(cfg, name, arch="sm_90")
            assert k.resources.spill_stores == 0, (cfg.key(), name, k.resources)
            yield cfg, name, k, sass_stats(k.sass)


def test_cluster_push_knobs():
    c = SoftmaxConfig(**_B8, threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8,
                      cluster_push=True, persistent=True, min_blocks=4)
    assert (c.row_class, c.min_arch, c.grid(1000, 132 * 4), c.grid(10, 132 * 4)) == ("cluster", 90, 528, 80)
    assert c.replace(persistent=False).grid(1000, 132 * 4) == 8000
    assert c.replace(prefetch=True).grid(1000, 132 * 4) == 528     # prefetch walks rows too


@pytest.mark.parametrize("case", PUSH_CONFIGS, ids=_push_id)
def test_cluster_push_configs_compile(case):
    _, _, fields, _ = case
    for cfg, name, k, stats in _row_kernels_sm90(fields):
        assert stats["ldg_128"] >= fields["vecs_per_thread"] and stats["global_stores"] == stats["stg_128"]
        if cfg.cluster_push:
            # st.async pushes, an mbarrier wait, one cluster barrier (arrive + wait) before the first push
            assert "STAS" in k.sass and "SYNCS.PHASECHK" in k.sass
            assert k.sass.count("UCGABAR_ARV") == 1 and "LDSM" not in k.sass
        else:
            assert "UCGABAR_ARV" in k.sass


def _three_ops_on_strided_rows(dtype, n, rows, fields, seed, norm_fields=None, contiguous=False):
    """softmax (and log), RMSNorm and LayerNorm with the given config fields (norm_fields for the
    norms: default the softmax fields mapped by _norm_fields) on rows of width n (row stride n + 8,
    or contiguous rows drawn after the strided ones; poisoned outputs) against the float64 references."""
    cp, random_array, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(seed)
    big, big64 = random_array(rng, (rows, n + 8), dtype, scale=3.0)
    x, x64 = (big[:, :n], big64[:, :n]) if not contiguous else random_array(rng, (rows, n), dtype, scale=3.0)
    w, w64 = random_array(rng, (n,), dtype)
    b, b64 = random_array(rng, (n,), dtype)
    scfg = SoftmaxConfig(dtype=dtype, vec=8, **fields)
    for log in (False, True):
        y = rw.softmax(x, log_softmax=log, out=poison(cp.empty((rows, n), dtype=x.dtype)), dtype=dtype, config=scfg)
        _check(y, rw.softmax_reference(x64, log_softmax=log), dtype, 1e-6 if not log else 1e-5, to_f64)
    ncfg = NormConfig(dtype=dtype, weight_dtype=dtype, vec=8,
                      **(_norm_fields(fields) if norm_fields is None else norm_fields))
    _check(rw.rmsnorm(x, w, out=poison(cp.empty((rows, n), dtype=x.dtype)), dtype=dtype, config=ncfg),
           rw.rmsnorm_reference(x64, w64), dtype, _TOL[dtype], to_f64)
    _check(rw.layernorm(x, w, b, out=poison(cp.empty((rows, n), dtype=x.dtype)), dtype=dtype, config=ncfg),
           rw.layernorm_reference(x64, w64, b64), dtype, 4 * _TOL[dtype], to_f64)


@pytest.mark.gpu
@pytest.mark.parametrize("case", PUSH_CONFIGS, ids=_push_id)
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_cluster_push_rows_gpu(dtype, case, monkeypatch):
    _three_ops_case_gpu(dtype, case, monkeypatch, "clusters need sm_90", seed_offset=0)


_SPECIAL_VARIANTS = {   # cluster rows through pushed totals: registers or a shared-memory slice
    "push": (dict(cluster_push=True, min_blocks=2), None),
    "push-persistent": (dict(cluster_push=True, persistent=True, prefetch=True, min_blocks=2), 16),
    "smem": (dict(cluster_push=True, smem_rows=True, min_blocks=6), None),
    "smem-16blocks": (dict(cluster_push=True, smem_rows=True, min_blocks=6), 16),
}


def _shrink_grid(monkeypatch, fields, grid):
    """Make every block (cluster) walk several rows: a persistent config's resident wave, or for the
    others a grid capped at `grid` blocks (the kernels loop over rows for any grid)."""
    if not grid:
        return
    if fields.get("persistent") or fields.get("prefetch"):
        monkeypatch.setattr(rw, "_resident_blocks", lambda k, cfg, _g=grid: _g)
    else:
        orig = rw._RowConfig.grid
        monkeypatch.setattr(rw._RowConfig, "grid", lambda self, rows, resident=None, _g=grid: min(orig(self, rows), _g))


def _three_ops_case_gpu(dtype, case, monkeypatch, why, seed_offset):
    """A (width, rows, fields, grid) case through _three_ops_on_strided_rows (skipped below sm_90),
    the grid shrunk by _shrink_grid (persistent configs: their resident wave)."""
    from rtkernels import device
    if arch_number(device.current_arch()) < 90:
        pytest.skip(why)
    n, rows, fields, grid = case
    _shrink_grid(monkeypatch, fields, grid)
    _three_ops_on_strided_rows(dtype, n, rows, fields, seed=n + rows + seed_offset)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(_SPECIAL_VARIANTS))
def test_cluster_push_special_rows_gpu(variant, monkeypatch):
    """-inf / all-equal / huge / offset / NaN rows through pushed cluster totals, one cluster per row
    or 2 clusters walking 15 rows each."""
    from rtkernels import device
    if arch_number(device.current_arch()) < 90:
        pytest.skip("clusters need sm_90")
    extra, grid = _SPECIAL_VARIANTS[variant]
    fields = dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, **extra)
    _shrink_grid(monkeypatch, fields, grid)
    cp, _, to_f64, poison, _ = _gpu()
    n, rows = 65536, 30
    h = np.random.default_rng(5).standard_normal((rows, n)) * 3
    h[::6] = -np.inf
    h[1::6] = 0.5
    h[2::6] = np.random.default_rng(6).uniform(-1e4, 1e4, (len(h[2::6]), n))
    h[3::6, : n // 3] = -np.inf
    h[4::6] = -1e4
    h[4::6, n - 1] = 1e4 / 2
    h[5::6] += 1000                                # mean far from 0 next to a small spread (LayerNorm's M2)
    x, x64 = _store(cp, h, "bfloat16")
    cfg = SoftmaxConfig(dtype="bfloat16", vec=8, **fields)
    for log in (False, True):
        y = rw.softmax(x, out=poison(cp.empty_like(x)), log_softmax=log, dtype="bfloat16", config=cfg)
        got = to_f64(y, "bfloat16")
        assert not np.any(np.isnan(got))
        if log:
            assert np.all(got[::6] == -np.inf)
        else:
            assert np.all(got[::6] == 0) and np.all(got[1::6] == _ref_rounded(np.array([1 / n]), "bfloat16")[0])
        _check(y, rw.softmax_reference(x64, log_softmax=log), "bfloat16", 1e-6 if not log else 1e-5, to_f64)
    w = cp.full(n, 0x3F80, dtype=cp.uint16)        # 1.0
    b = cp.zeros(n, dtype=cp.uint16)
    ncfg = NormConfig(dtype="bfloat16", weight_dtype="bfloat16", vec=8, **_norm_fields(fields))
    fin = np.isfinite(h).all(axis=1)
    for name, ref in (("rmsnorm", rw.rmsnorm_reference(x64[fin], np.ones(n))),
                      ("layernorm", rw.layernorm_reference(x64[fin], np.ones(n), np.zeros(n)))):
        y = rw.rmsnorm(x, w, out=poison(cp.empty_like(x)), dtype="bfloat16", config=ncfg) if name == "rmsnorm" else \
            rw.layernorm(x, w, b, out=poison(cp.empty_like(x)), dtype="bfloat16", config=ncfg)
        _check(y[cp.asarray(fin)], ref, "bfloat16", 4 * _TOL["bfloat16"], to_f64)
    h[1, 7] = np.nan
    x, _ = _store(cp, h, "bfloat16")
    assert np.all(np.isnan(to_f64(rw.softmax(x, dtype="bfloat16", config=cfg), "bfloat16")[1]))


# ---- a block's slice of the row in shared memory (smem_rows) -----------------------------------
# (width, rows, fields, grid cap in blocks or None).  Ragged widths leave a partial slice and, at
# 50000 over 8 slices of 1024 vectors, a block with nothing to copy; capped grids walk many rows
# per block through the same slice (barrier before each copy, mbarrier parity flips).
SMEM_CONFIGS = [
    (65536, 40, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, cluster_push=True,
                     smem_rows=True, min_blocks=6), None),
    (65536, 40, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, cluster_push=True,
                     smem_rows=True, min_blocks=6), 16),
    (50000, 37, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, cluster_push=True,
                     smem_rows=True, min_blocks=6), None),
    (60000, 41, dict(threads_per_row=512, block_size=512, vecs_per_thread=4, cluster_size=4, smem_rows=True,
                     min_blocks=2), None),                     # barrier clusters
    (16384, 100, dict(threads_per_row=256, block_size=256, vecs_per_thread=8, smem_rows=True, min_blocks=6), 8),
    (16000, 100, dict(threads_per_row=256, block_size=256, vecs_per_thread=8, smem_rows=True, min_blocks=6), None),
    (4000, 300, dict(threads_per_row=128, block_size=128, vecs_per_thread=4, smem_rows=True, min_blocks=12), 16),
    (1000, 50, dict(threads_per_row=128, block_size=128, vecs_per_thread=4, smem_rows=True, min_blocks=12), None),
]


def _smem_id(case):
    n, rows, f, grid = case
    return f"{n}x{rows}-b{f['block_size']}v{f['vecs_per_thread']}c{f.get('cluster_size', 1)}" + \
        ("-push" if f.get("cluster_push") else "") + (f"-grid{grid}" if grid else "")


@pytest.mark.parametrize("cls, params, field", [
    (SoftmaxConfig, dict(dtype="bfloat16", vec=4, threads_per_row=128, block_size=128, smem_rows=True), "smem_rows"),
    (SoftmaxConfig, dict(_B8, threads_per_row=32, block_size=128, smem_rows=True), "smem_rows"),
    (NormConfig, dict(_B8, weight_dtype="bfloat16", threads_per_row=128, block_size=128, two_pass=True,
                      smem_rows=True), "smem_rows"),
    (SoftmaxConfig, dict(_B8, threads_per_row=1024, block_size=1024, vecs_per_thread=16, smem_rows=True), "smem_rows"),
])
def test_smem_rows_knobs_are_validated(cls, params, field):
    with pytest.raises(ConfigError) as e:
        cls(**params)
    assert field in str(e.value)


def test_smem_rows_derived_values():
    c = SoftmaxConfig(**_B8, threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, smem_rows=True)
    assert (c.shared_mem_bytes, c.min_arch, c.grid(100, 1000)) == (16384, 90, 800)


@pytest.mark.parametrize("case", SMEM_CONFIGS, ids=_smem_id)
def test_smem_rows_compile(case):
    _, _, fields, _ = case
    for cfg, name, k, stats in _row_kernels_sm90(fields):
        assert "UBLKCP" in k.sass and "SYNCS" in k.sass          # the bulk copy and its mbarrier wait
        assert stats["global_stores"] == stats["stg_128"] >= 1
        # x arrives only by the bulk copy: the only 128-bit global loads left are the weights
        if name.endswith("softmax_rows"):
            assert stats["ldg_128"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("case", SMEM_CONFIGS, ids=_smem_id)
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_smem_rows_gpu(dtype, case, monkeypatch):
    _three_ops_case_gpu(dtype, case, monkeypatch, "bulk copies need sm_90", seed_offset=1)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16384, 32768, 50000, 65536, 131072])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_default_wide_rows_gpu(dtype, n):
    """The heuristics' own configs (no config=) for the widths whose defaults the session-3 tables
    changed (shared-memory slices over clusters, 16-bit LayerNorm tiles), 16-bit and float32 weights."""
    cp, random_array, to_f64, poison, _ = _gpu()
    rng = np.random.default_rng(n + 3)
    rows = 24
    big, big64 = random_array(rng, (rows, n + 8), dtype, scale=3.0)
    x, x64 = big[:, :n], big64[:, :n]
    for log in (False, True):
        y = rw.softmax(x, log_softmax=log, out=poison(cp.empty((rows, n), dtype=x.dtype)), dtype=dtype)
        _check(y, rw.softmax_reference(x64, log_softmax=log), dtype, 1e-6 if not log else 1e-5, to_f64)
    for wdt in (dtype, "float32"):
        w, w64 = random_array(rng, (n,), wdt)
        b, b64 = random_array(rng, (n,), wdt)
        _check(rw.rmsnorm(x, w, out=poison(cp.empty((rows, n), dtype=x.dtype)), dtype=dtype),
               rw.rmsnorm_reference(x64, w64), dtype, _TOL[dtype], to_f64)
        _check(rw.layernorm(x, w, b, out=poison(cp.empty((rows, n), dtype=x.dtype)), dtype=dtype),
               rw.layernorm_reference(x64, w64, b64), dtype, 4 * _TOL[dtype], to_f64)
