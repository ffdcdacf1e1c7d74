"""Training-step kernels: norm / softmax backward, fused cross-entropy, multi-tensor AdamW.

CPU: config errors, the heuristics' row classes, a few representative configs compile without
spills (one module each, shared through a module fixture), argument errors before any device work,
and the float64 references checked against finite differences and hand formulas.
GPU (-m gpu): every op against float64 references over awkward widths / vocabularies with fresh
random inputs and NaN-poisoned outputs; torch autograd / F.cross_entropy / torch.optim.AdamW where
torch is importable.
"""
import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError
from rtkernels.inspect import sass_stats
from rtkernels.ops import adamw as aw
from rtkernels.ops import cross_entropy as ce
from rtkernels.arch import arch_number
from rtkernels.ops import rowwise as rw
from rtkernels.ops import rowwise_bwd as rb
from rtkernels.ops.adamw import AdamWConfig
from rtkernels.ops.cross_entropy import CrossEntropyConfig
from rtkernels.ops.rowwise_bwd import NormBwdConfig, SoftmaxBwdConfig


# ---- configs (CPU) --------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, params, field", [
    (NormBwdConfig, dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, smem_rows=True), "smem_rows"),
    (NormBwdConfig, dict(dtype="float16", weight_dtype="bfloat16"), "weight_dtype"),
    (SoftmaxBwdConfig, dict(dtype="float32", vec=4, threads_per_row=256, block_size=256, persistent=True),
     "persistent"),
    (CrossEntropyConfig, dict(dtype="bfloat16", vec=4, ragged=True), "ragged"),
    (CrossEntropyConfig, dict(dtype="bfloat16", vec=8, target_dtype="float32"), "target_dtype"),
    (AdamWConfig, dict(param_dtype="float16", grad_dtype="bfloat16"), "grad_dtype"),
    (AdamWConfig, dict(vec=3), "vec"),
])
def test_config_errors_name_the_field(cls, params, field):
    with pytest.raises(ConfigError) as e:
        cls(**params)
    assert e.value.field == field and field in str(e.value)


@pytest.mark.parametrize("family, n, dtype, arch, row_class", [
    ("norm_bwd", 1000, "bfloat16", "sm_90", "group"), ("norm_bwd", 2048, "float32", "sm_90", "block"),
    ("norm_bwd", 4096, "bfloat16", "sm_90", "block"),
    ("norm_bwd", 16384, "bfloat16", "sm_90", "cluster"), ("norm_bwd", 65536, "bfloat16", "sm_90", "cluster"),
    ("norm_bwd", 65536, "float32", "sm_90", "two_pass"), ("norm_bwd", 16384, "bfloat16", "sm_80", "two_pass"),
    ("softmax_bwd", 4096, "float32", "sm_90", "block"), ("softmax_bwd", 65536, "bfloat16", "sm_90", "cluster"),
    ("softmax_bwd", 65536, "bfloat16", "sm_80", "two_pass"),
])
def test_plan_bwd_row_classes(family, n, dtype, arch, row_class):
    size = rtk.dtypes.itemsize(dtype)
    cfg = rb.plan_bwd(family, n, dtype, 16 // size, arch)
    assert cfg.row_class == row_class
    if row_class != "two_pass":
        assert cfg.chunk_elements >= n


def test_cross_entropy_plan_and_vector_access():
    big = ce.plan(128256, "bfloat16", 8, "sm_90", grad=True)
    assert (big.smem_rows, big.cluster_size, big.cluster_push, big.shared_mem_bytes) == (True, 8, True, 32768)
    assert big.chunk_elements >= 128256
    huge = ce.plan(256000, "float32", 4, "sm_90", grad=True)
    assert huge.smem_rows and huge.chunk_elements >= 256000 and huge.shared_mem_bytes <= rw._SMEM_MAX
    assert ce.plan(128256, "bfloat16", 8, "sm_80", grad=True).two_pass
    assert ce.plan(1000, "bfloat16", 8, "sm_90").row_class == "group"
    assert ce.plan(1, "float32", 1, "sm_90").chunk_elements >= 1
    # 50257 bfloat16: rows start at every 2-byte offset; logits and a contiguous grad share them
    assert rw.vector_access(2, 50257, 8, (256, 1 << 20), (50257, 50257)) == (8, True)
    assert rw.vector_access(2, 50257, 8, (256, (1 << 20) + 2), (50257, 50257)) == (1, False)   # grad offset
    assert rw.vector_access(2, 128256, 8, (256, 512), (128256, 128256)) == (8, False)
    assert rw.vector_access(4, 7, 3, (256,), (7,)) == (1, False)                              # too short
    # vocabularies between powers of two refit their slices (rowwise.fit_width): 151936 fills 8 x 256 x 10
    qwen = ce.plan(151936, "bfloat16", 8, "sm_90", grad=True)
    assert (qwen.cluster_size, qwen.threads_per_row, qwen.vecs_per_thread, qwen.min_blocks) == (8, 256, 10, 4)
    assert qwen.chunk_elements >= 151936 and qwen.smem_rows
    assert ce.plan(151936, "bfloat16", 8, "sm_90", grad=True, fit=False).vecs_per_thread == 8
    gpt2 = ce.plan(50257, "bfloat16", 8, "sm_90", grad=True, ragged=True)
    assert (gpt2.cluster_size, gpt2.threads_per_row, gpt2.vecs_per_thread) == (4, 128, 13)
    assert ce.plan(151936, "bfloat16", 8, "sm_80", grad=True) == ce.plan(151936, "bfloat16", 8, "sm_80", grad=True,
                                                                         fit=False)


def test_adamw_config_chunks():
    assert aw.plan("bfloat16", "bfloat16", "float32", True).chunk == 4096
    assert aw.plan("float32", "float32", "float32", False).chunk == 4096


# ---- a few representative kernels compile without spills (CPU, sm_90) -------------------------------
REPRESENTATIVE = [
    ("norm_bwd 4k bf16", lambda: rb.plan_bwd("norm_bwd", 4096, "bfloat16", 8, "sm_90"),
     ("rmsnorm_bwd_rows", "layernorm_bwd_rows", "norm_bwd_colsum")),
    ("norm_bwd 64k fp32 two_pass", lambda: rb.plan_bwd("norm_bwd", 65536, "float32", 4, "sm_90"),
     ("layernorm_bwd_rows",)),
    ("softmax_bwd 64k bf16 cluster", lambda: rb.plan_bwd("softmax_bwd", 65536, "bfloat16", 8, "sm_90"),
     ("softmax_bwd_rows", "log_softmax_bwd_rows")),
    ("ce 128k bf16 smem cluster", lambda: ce.plan(128256, "bfloat16", 8, "sm_90", grad=True),
     ("cross_entropy_rows", "cross_entropy_count", "cross_entropy_reduce")),
    ("ce 50257 bf16 ragged smoothing", lambda: ce.plan(50257, "bfloat16", 8, "sm_90", grad=True, smoothing=True,
                                                       ragged=True), ("cross_entropy_rows",)),
    ("ce 1000 fp32 groups", lambda: ce.plan(1000, "float32", 4, "sm_90", grad=True, target_dtype="int32"),
     ("cross_entropy_rows",)),
    ("ce 151936 bf16 refitted slices", lambda: ce.plan(151936, "bfloat16", 8, "sm_90", grad=True),
     ("cross_entropy_rows",)),
    ("softmax_bwd 12288 bf16 refitted cluster", lambda: rb.plan_bwd("softmax_bwd", 12288, "bfloat16", 8, "sm_90"),
     ("softmax_bwd_rows", "log_softmax_bwd_rows")),
    ("adamw bf16 master", lambda: aw.plan("bfloat16", "bfloat16", "float32", True), ("adamw_multi",)),
    ("adamw fp32", lambda: aw.plan("float32", "float32", "float32", False), ("adamw_multi",)),
]


@pytest.fixture(scope="module")
def representative_kernels():
    out = {}
    for label, make, names in REPRESENTATIVE:
        cfg = make()
        out[label] = (cfg, {name: rtk.get_kernel(cfg, name, arch="sm_90") for name in names})
    return out


def test_representative_kernels_compile_without_spills(representative_kernels):
    bad = [(label, name, k.resources) for label, (_, ks) in representative_kernels.items() for name, k in ks.items()
           if k.resources.spill_stores or k.resources.spill_loads]
    assert bad == []


def test_representative_kernels_use_wide_accesses(representative_kernels):
    for label, (cfg, ks) in representative_kernels.items():
        main = ks[next(iter(ks))]
        stats = sass_stats(main.sass)
        assert stats["ldl"] == 0 and stats["stl"] == 0, label
        if getattr(cfg, "smem_rows", False):
            assert "UBLKCP" in main.sass, label           # the row arrives by bulk copies
        else:
            assert stats["ldg_128"] >= 1, label
        assert stats["stg_128"] >= 1, label
        if getattr(cfg, "cluster_size", 1) > 1:
            assert "STAS" in main.sass, label             # block totals pushed by st.async


def test_forward_stats_variant_signature():
    base = rw.plan("norm", 4096, "bfloat16", 8, "sm_90", layer=True)
    k = rtk.get_kernel(base.replace(stats=True), "layernorm_rows", arch="sm_90")
    names = [p.decl.split()[-1] for p in k.signature]
    assert names[:6] == ["x", "weight", "bias", "y", "mean_out", "rstd_out"]
    assert k.resources.spill_stores == 0


# ---- argument errors before any device work (CPU) ------------------------------------------------
def test_argument_errors_before_device_work():
    x = np.zeros((4, 8), np.float32)
    t = np.zeros(4, np.int64)
    with pytest.raises(ConfigError) as e:
        rtk.cross_entropy(x, t, reduction="avg")
    assert e.value.field == "reduction"
    with pytest.raises(ConfigError) as e:
        rtk.cross_entropy(x, t, label_smoothing=1.5)
    assert e.value.field == "label_smoothing"
    with pytest.raises(ConfigError) as e:
        rtk.layernorm_backward(x, x, x[0], x[0], mean=t)
    assert e.value.field == "rstd"
    with pytest.raises(ConfigError) as e:
        rtk.adamw_step([x], [x, x], [x], [x], lr=1e-3, step=1)
    assert e.value.field == "grads"
    assert rtk.adamw_step([], [], [], [], lr=1e-3, step=1) is None


def test_public_api():
    for name in ("rmsnorm_backward", "layernorm_backward", "softmax_backward", "cross_entropy", "adamw_step"):
        assert callable(getattr(rtk, name))


# ---- float64 references (CPU) ---------------------------------------------------------------------
def _numeric_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + h
        fp = f(x)
        x[i] = old - h
        fm = f(x)
        x[i] = old
        g[i] = (fp - fm) / (2 * h)
    return g


def test_norm_backward_references_match_finite_differences():
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((3, 7)) * 2 + 0.5, rng.standard_normal((3, 7))
    w, b = rng.standard_normal(7), rng.standard_normal(7)
    dx, dw = rb.rmsnorm_backward_reference(dy, x, w, 1e-6)
    np.testing.assert_allclose(dx, _numeric_grad(lambda z: np.sum(dy * rw.rmsnorm_reference(z, w, 1e-6)), x.copy()),
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dw, _numeric_grad(lambda z: np.sum(dy * rw.rmsnorm_reference(x, z, 1e-6)), w.copy()),
                               rtol=1e-6, atol=1e-8)
    dx, dw, db = rb.layernorm_backward_reference(dy, x, w, 1e-5)
    f = lambda z: np.sum(dy * rw.layernorm_reference(z, w, b, 1e-5))  # noqa: E731
    np.testing.assert_allclose(dx, _numeric_grad(f, x.copy()), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dw, _numeric_grad(lambda z: np.sum(dy * rw.layernorm_reference(x, z, b)), w.copy()),
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(db, dy.sum(axis=0))


def _rmsnorm_dx_float32(dy, x, w, eps, rstd_ulps=0, bug=None):
    """norm_bwd.cu.j2's RMSNorm dx in float32 arithmetic (rstd = rsqrtf(mean(x^2) + eps) moved by
    rstd_ulps ulp: rsqrtf's error), or with a bug: "drop" (no xhat * ct term), "no_eps"."""
    f = np.float32
    x, dy, w = x.astype(f), dy.astype(f), w.astype(f)
    n = x.shape[-1]
    g = dy * w
    ss, s = np.sum(x * x, -1, keepdims=True, dtype=f), np.sum(g * x, -1, keepdims=True, dtype=f)
    rstd = (1 / np.sqrt(ss.astype(np.float64) / n + (0.0 if bug == "no_eps" else eps))).astype(f)
    for _ in range(abs(rstd_ulps)):
        rstd = np.nextafter(rstd, f(np.inf) if rstd_ulps > 0 else f(0))
    ct = rstd * s * f(1 / n)
    v = g if bug == "drop" else g - (x * rstd) * ct
    return (rstd * v).astype(np.float64)


@pytest.mark.parametrize("n", [1, 7, 33])
def test_rmsnorm_dx_tolerance_separates_rounding_from_bugs(n):
    """The GPU test's dx bound (_rmsnorm_dx_scale) accepts float32 arithmetic with rsqrtf's 2 ulp
    (at n = 1 the two terms cancel to ~1e-7 of their size) and still rejects a dropped term or a
    missing eps - on the GPU test's own inputs."""
    rng = np.random.default_rng(n)
    rows = _rows_for(n)
    x = (rng.standard_normal((rows, n)) * 2).astype(np.float32).astype(np.float64)
    dy = rng.standard_normal((rows, n)).astype(np.float32).astype(np.float64)
    w = rng.standard_normal(n).astype(np.float32).astype(np.float64)
    ref, _ = rb.rmsnorm_backward_reference(dy, x, w, 1e-6)
    scale = _rmsnorm_dx_scale(dy, x, w, ref)
    for ulps in (-2, 0, 2):
        _close(_rmsnorm_dx_float32(dy, x, w, 1e-6, ulps), ref, "float32", f"float32 dx ({ulps} ulp rstd)",
               row_scale=scale, atol=1e-6)
    for bug in ("drop", "no_eps"):
        if n > 1 and bug == "no_eps":
            continue   # eps = 1e-6 against mean(x^2) ~ 4: below float32 resolution there
        with pytest.raises(AssertionError):
            _close(_rmsnorm_dx_float32(dy, x, w, 1e-6, bug=bug), ref, "float32", bug, row_scale=scale, atol=1e-6)


@pytest.mark.parametrize("log", [False, True])
def test_softmax_backward_reference_matches_finite_differences(log):
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((2, 9)), rng.standard_normal((2, 9))
    y = rw.softmax_reference(x, log_softmax=log)
    dx = rb.softmax_backward_reference(dy, y, log=log)
    np.testing.assert_allclose(dx, _numeric_grad(lambda z: np.sum(dy * rw.softmax_reference(z, log)), x.copy()),
                               rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_reference(reduction, smoothing):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 11)) * 3
    t = np.array([3, -100, 0, 10, 7])
    loss, g = ce.cross_entropy_reference(x, t, label_smoothing=smoothing, reduction=reduction)
    total = lambda z: np.sum(ce.cross_entropy_reference(z, t, label_smoothing=smoothing,  # noqa: E731
                                                        reduction=reduction)[0])
    np.testing.assert_allclose(g, _numeric_grad(total, x.copy()), rtol=1e-6, atol=1e-8)
    # torch's formula, written out for one row
    p = np.exp(x[0] - x[0].max()) / np.exp(x[0] - x[0].max()).sum()
    row0 = (1 - smoothing) * -np.log(p[3]) + smoothing * -np.log(p).mean()
    per = ce.cross_entropy_reference(x, t, label_smoothing=smoothing, reduction="none")[0]
    assert abs(per[0] - row0) < 1e-12 and per[1] == 0.0
    if reduction == "mean":
        assert abs(loss - per.sum() / 4) < 1e-12
    all_ignored = ce.cross_entropy_reference(x, np.full(5, -100), reduction=reduction, label_smoothing=smoothing)
    assert np.all(all_ignored[1] == 0)
    if reduction == "mean":
        assert np.isnan(all_ignored[0])


def test_adamw_reference_first_step():
    p, g = np.array([1.0, -2.0, 3.0]), np.array([0.5, -0.25, 0.0])
    m = v = np.zeros(3)
    out, m1, v1 = aw.adamw_reference(p, g, m, v, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    # the first step moves each weight by lr * sign(g) (bias-corrected m / sqrt(v) = g / |g|)
    expect = p * (1 - 0.1 * 0.01) - 0.1 * g / (np.abs(g) + 1e-8)
    np.testing.assert_allclose(out, expect, rtol=1e-7)
    np.testing.assert_allclose(m1, 0.1 * g)
    np.testing.assert_allclose(v1, 0.001 * g * g)


# ==== GPU =============================================================================================
DTYPES = ("float16", "bfloat16", "float32")
_TOL = {"float16": 2 ** -10, "bfloat16": 2 ** -7, "float32": 2e-6}


def _gpu():
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    return cp, random_array, to_f64, poison


def _close(got, ref, dtype, what, row_scale=None, atol=0.0):
    """|got - ref| <= tol(dtype) * (|ref| + row_scale) + atol, with a message that locates the worst."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert not np.any(np.isnan(got) & ~np.isnan(ref)), f"{what}: NaN in the output (poison not overwritten?)"
    scale = np.abs(ref) + (0.0 if row_scale is None else row_scale)
    bound = _TOL[dtype] * scale + atol
    err = np.abs(got - ref)
    if not np.all(err <= bound):
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"{what} ({dtype}, shape {ref.shape}): max err {err.max():.3g}; worst at {i}: got "
                             f"{got[i]:.6g}, ref {ref[i]:.6g}, bound {bound[i]:.3g}")


def _stored(cp, host64, dtype):
    """(device array of host64 rounded to dtype, float64 copy of exactly the stored values)."""
    from gpu_util import bf16_bits_from_f32, f32_from_bf16_bits
    if dtype == "bfloat16":
        bits = bf16_bits_from_f32(host64.astype(np.float32))
        return cp.asarray(bits), f32_from_bf16_bits(bits).astype(np.float64)
    h = host64.astype(dtype)
    return cp.asarray(h), h.astype(np.float64)


def _row_rms(a):
    a = np.asarray(a, np.float64)
    return np.sqrt(np.mean(a * a, axis=-1, keepdims=True)) + 1e-30


def _rmsnorm_dx_scale(dy64, x64, w64, ref_dx, eps=1e-6):
    """Per-row error scale of RMSNorm's dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w: the
    magnitude of the two terms that cancel (rms(g) * rstd) besides rms(dx).  Where they cancel -
    n = 1, where dx = rstd * g * eps * rstd^2 is ~1e-7 of either term - float32 rounding of the
    terms (a few ulp of ~rstd * |g|) is the error, not rms(dx)."""
    rstd = 1 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return _row_rms(ref_dx) + _row_rms(dy64 * w64) * rstd


NORM_WIDTHS = (1, 7, 33, 1000, 4097, 6000, 65536)   # 4097 and 6000: the 512-thread block rows (sm_90)
# softmax_backward's rows refitted to 3 vectors per thread (rowwise_bwd.plan_bwd): a block, a cluster
SOFTMAX_BWD_REFIT_WIDTHS = (5120, 12288)


def _rows_for(n):
    return {1: 300, 7: 257, 33: 513, 1000: 700, 4097: 97, 6000: 131, 65536: 13, 5120: 101, 12288: 67}[n]


@pytest.mark.gpu
@pytest.mark.parametrize("n", NORM_WIDTHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_norm_backward_gpu(dtype, n):
    cp, random_array, to_f64, poison = _gpu()
    rng = np.random.default_rng(n)
    rows = _rows_for(n)
    x, x64 = random_array(rng, (rows, n), dtype, scale=2.0)
    dy, dy64 = random_array(rng, (rows, n), dtype)
    w, w64 = random_array(rng, (n,), dtype)
    b, _ = random_array(rng, (n,), dtype)
    # the saved statistics as the forward gives them (float32), computed on the host: this test
    # compiles no forward kernels (test_norm_forward_stats_gpu checks the forward's)
    rstd = cp.asarray((1 / np.sqrt(np.mean(x64 ** 2, -1) + 1e-6)).astype(np.float32))
    ref_dx, ref_dw = rb.rmsnorm_backward_reference(dy64, x64, w64, 1e-6)
    for stats in (None, rstd):
        dx = poison(cp.empty_like(x))
        got_dx, got_dw = rtk.rmsnorm_backward(dy, x, w, stats, eps=1e-6, out=dx, dtype=dtype)
        assert got_dx is dx
        _close(to_f64(dx, dtype), ref_dx, dtype, f"rmsnorm dx (stats {'given' if stats is not None else 'recomputed'})",
               row_scale=_rmsnorm_dx_scale(dy64, x64, w64, ref_dx), atol=1e-6)
        _close(to_f64(got_dw, dtype), ref_dw, dtype, "rmsnorm dweight",
               atol=1e-5 * np.abs(dy64 * x64).sum(0) * 2)
    ref_dx, ref_dw, ref_db = rb.layernorm_backward_reference(dy64, x64, w64, 1e-5)
    mean = cp.asarray(x64.mean(-1).astype(np.float32))
    rstd = cp.asarray((1 / np.sqrt(x64.var(-1) + 1e-5)).astype(np.float32))
    for stats in ((None, None), (mean, rstd)):
        dx = poison(cp.empty_like(x))
        _, got_dw, got_db = rtk.layernorm_backward(dy, x, w, b, *stats, eps=1e-5, out=dx, dtype=dtype)
        what = f"layernorm (stats {'given' if stats[0] is not None else 'recomputed'})"
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w: at n = 1 the terms cancel
        # exactly (dx = 0) and float32 leaves a few ulp of rstd * |g| (rstd = 1/sqrt(eps) ~ 316):
        # -3.3e-5 against 0 on an H100 (2026-11-25); the bound scales with those terms
        lrstd = 1 / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
        _close(to_f64(dx, dtype), ref_dx, dtype, what + " dx",
               row_scale=_row_rms(ref_dx) + _row_rms(dy64 * w64) * lrstd, atol=1e-6)
        _close(to_f64(got_dw, dtype), ref_dw, dtype, what + " dweight", atol=2e-5 * np.abs(dy64).sum(0) * 4)
        _close(to_f64(got_db, dtype), ref_db, dtype, what + " dbias", atol=1e-5 * np.abs(dy64).sum(0))
    # deterministic: the same bits twice
    a = rtk.layernorm_backward(dy, x, w, b, eps=1e-5, dtype=dtype)
    c = rtk.layernorm_backward(dy, x, w, b, eps=1e-5, dtype=dtype)
    for u, v in zip(a, c):
        assert cp.array_equal(u, v)


@pytest.mark.gpu
@pytest.mark.parametrize("n, dtype", [(33, "bfloat16"), (1000, "float32"), (4097, "bfloat16"), (65536, "bfloat16")])
def test_norm_forward_stats_gpu(n, dtype):
    """return_stats: the statistics against float64, y bit-identical to the plain forward's, and the
    backward from them equal to the backward that recomputes them (up to float32 rounding)."""
    cp, random_array, to_f64, poison = _gpu()
    rng = np.random.default_rng(n + 5)
    x, x64 = random_array(rng, (_rows_for(n), n), dtype, scale=2.0)
    dy, dy64 = random_array(rng, x.shape, dtype)
    w, w64 = random_array(rng, (n,), dtype)
    b, b64 = random_array(rng, (n,), dtype)
    y, rstd = rtk.rmsnorm(x, w, eps=1e-6, dtype=dtype, return_stats=True, out=poison(cp.empty_like(x)))
    assert str(rstd.dtype) == "float32" and rstd.shape == x.shape[:-1]
    assert cp.array_equal(y, rtk.rmsnorm(x, w, eps=1e-6, dtype=dtype))
    np.testing.assert_allclose(cp.asnumpy(rstd), 1 / np.sqrt(np.mean(x64 ** 2, -1) + 1e-6), rtol=2e-6)
    ref_dx, _ = rb.rmsnorm_backward_reference(dy64, x64, w64, 1e-6)
    _close(to_f64(rtk.rmsnorm_backward(dy, x, w, rstd, dtype=dtype)[0], dtype), ref_dx, dtype, "dx from saved rstd",
           row_scale=_row_rms(ref_dx), atol=1e-6)
    y, mean, rstd = rtk.layernorm(x, w, b, eps=1e-5, dtype=dtype, return_stats=True)
    assert cp.array_equal(y, rtk.layernorm(x, w, b, eps=1e-5, dtype=dtype))
    np.testing.assert_allclose(cp.asnumpy(mean), x64.mean(-1), rtol=2e-6, atol=2e-6 * np.abs(x64).max())
    np.testing.assert_allclose(cp.asnumpy(rstd), 1 / np.sqrt(x64.var(-1) + 1e-5), rtol=2e-5)
    # torch tensors get torch statistics
    torch = pytest.importorskip("torch")
    xt = torch.randn(8, n, device="cuda")
    yt, mt, rt = rtk.layernorm(xt, torch.ones(n, device="cuda"), torch.zeros(n, device="cuda"), return_stats=True)
    assert isinstance(mt, torch.Tensor) and mt.dtype == torch.float32 and rt.shape == (8,)
    torch.testing.assert_close(mt, xt.double().mean(-1).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_norm_backward_float16_and_float32_weights_gpu():
    cp, random_array, to_f64, poison = _gpu()
    rng = np.random.default_rng(3)
    for dtype, wdt, n in (("float16", "float16", 1000), ("bfloat16", "float32", 4096)):
        x, x64 = random_array(rng, (300, n), dtype)
        dy, dy64 = random_array(rng, (300, n), dtype)
        w, w64 = random_array(rng, (n,), wdt)
        b, _ = random_array(rng, (n,), wdt)
        dx, dw, db = rtk.layernorm_backward(dy, x, w, b, eps=1e-5, out=poison(cp.empty_like(x)), dtype=dtype)
        rdx, rdw, rdb = rb.layernorm_backward_reference(dy64, x64, w64, 1e-5)
        assert str(dw.dtype) == ("uint16" if wdt == "bfloat16" else wdt)
        _close(to_f64(dx, dtype), rdx, dtype, "dx", row_scale=_row_rms(rdx))
        _close(to_f64(dw, wdt), rdw, dtype, "dweight", atol=1e-4 * np.abs(dy64).sum(0))
        _close(to_f64(db, wdt), rdb, dtype, "dbias", atol=1e-5 * np.abs(dy64).sum(0))


NORM_CLASS_CONFIGS = [   # every row class at widths the heuristics would not give it
    (4096, dict(threads_per_row=128, block_size=128, vecs_per_thread=2, two_pass=True)),    # 4 chunks
    (33000, dict(threads_per_row=256, block_size=256, vecs_per_thread=2, two_pass=True)),   # ragged chunks
    (200, dict(threads_per_row=8, block_size=64, vecs_per_thread=4)),                       # narrow groups
    (5000, dict(threads_per_row=128, block_size=128, vecs_per_thread=8, cluster_size=2)),   # barrier cluster
    (20000, dict(threads_per_row=256, block_size=256, vecs_per_thread=2, cluster_size=8, cluster_push=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n, fields", NORM_CLASS_CONFIGS)
def test_row_backward_every_row_class_gpu(n, fields):
    from rtkernels import device
    if fields.get("cluster_size", 1) > 1 and arch_number(device.current_arch()) < 90:
        pytest.skip("clusters need sm_90")
    cp, random_array, to_f64, poison = _gpu()
    dtype, rows = "bfloat16", 37
    rng = np.random.default_rng(n)
    x, x64 = random_array(rng, (rows, n), dtype, scale=3.0)
    dy, dy64 = random_array(rng, (rows, n), dtype)
    w, w64 = random_array(rng, (n,), dtype)
    b, _ = random_array(rng, (n,), dtype)
    cfg = NormBwdConfig(dtype=dtype, weight_dtype=dtype, vec=8, **fields)
    rdx, rdw, rdb = rb.layernorm_backward_reference(dy64, x64, w64, 1e-5)
    dx, dw, db = rtk.layernorm_backward(dy, x, w, b, eps=1e-5, out=poison(cp.empty_like(x)), dtype=dtype, config=cfg)
    _close(to_f64(dx, dtype), rdx, dtype, f"layernorm dx {fields}", row_scale=_row_rms(rdx))
    _close(to_f64(dw, dtype), rdw, dtype, "dweight", atol=1e-4 * np.abs(dy64).sum(0))
    _close(to_f64(db, dtype), rdb, dtype, "dbias", atol=1e-5 * np.abs(dy64).sum(0))
    scfg = SoftmaxBwdConfig(dtype=dtype, vec=8, **fields)
    for log in (False, True):
        yy, yy64 = _stored(cp, rw.softmax_reference(x64, log_softmax=log), dtype)
        got = rtk.softmax_backward(dy, yy, log=log, out=poison(cp.empty_like(x)), dtype=dtype, config=scfg)
        ref = rb.softmax_backward_reference(dy64, yy64, log=log)
        _close(to_f64(got, dtype), ref, dtype, f"softmax_backward log={log} {fields}", row_scale=_row_rms(ref),
               atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("n", NORM_WIDTHS + SOFTMAX_BWD_REFIT_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_backward_gpu(dtype, n):
    cp, random_array, to_f64, poison = _gpu()
    rng = np.random.default_rng(n + 1)
    rows = _rows_for(n)
    _, x64 = random_array(rng, (rows, n), dtype, scale=2.0)
    dy, dy64 = random_array(rng, (rows, n), dtype)
    for log in (False, True):
        # y as a forward would store it (computed on the host: no forward kernels to compile)
        y, y64 = _stored(cp, rw.softmax_reference(x64, log_softmax=log), dtype)
        dx = poison(cp.empty_like(dy))
        assert rtk.softmax_backward(dy, y, log=log, out=dx, dtype=dtype) is dx
        ref = rb.softmax_backward_reference(dy64, y64, log=log)
        _close(to_f64(dx, dtype), ref, dtype, f"softmax_backward log={log}", row_scale=_row_rms(ref), atol=1e-7)


@pytest.mark.gpu
# lane groups, a block, a cluster, a cluster of 1024-thread rows taken as 512 x 6 (rowwise.as_ragged), two passes
@pytest.mark.parametrize("n", (33, 4001, 50257, 151643, 300001))
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_backward_ragged_rows_gpu(dtype, n):
    """Odd widths: dy, y and dx rows share their addresses mod 16, so the rows are read ragged
    (16-byte body, scalar head and tail; rowwise.vector_access) - or, where dx's differ, narrow."""
    cp, _, to_f64, poison = _gpu()
    rng = np.random.default_rng(n + 11)
    rows = max(3, min(29, (1 << 21) // n)) | 1
    size = rtk.dtypes.itemsize(dtype)
    for off, out_off in ((0, None), (3, 3), (0, 1)):
        x64 = rng.standard_normal((rows, n)) * 2.0
        d_host = np.zeros(rows * n + 16)
        y_host = np.zeros(rows * n + 16)
        d_host[off:off + rows * n] = rng.standard_normal(rows * n)
        for log in (False, True):
            y_host[off:off + rows * n] = rw.softmax_reference(x64, log_softmax=log).ravel()
            dflat, dflat64 = _stored(cp, d_host, dtype)
            yflat, yflat64 = _stored(cp, y_host, dtype)
            dy, y = (a[off:off + rows * n].reshape(rows, n) for a in (dflat, yflat))
            dy64, y64 = (a[off:off + rows * n].reshape(rows, n) for a in (dflat64, yflat64))
            obig = poison(cp.empty(rows * n + 16, dtype=dflat.dtype))
            out = None if out_off is None else obig[out_off:out_off + rows * n].reshape(rows, n)
            optr = out.data.ptr if out is not None else 256 * 1024   # a new array: a 256-byte aligned base
            assert rw.vector_access(size, n, rows, (y.data.ptr, dy.data.ptr, optr), (n, n, n))[1] == (out_off != 1)
            dx = rtk.softmax_backward(dy, y, log=log, out=out, dtype=dtype)
            ref = rb.softmax_backward_reference(dy64, y64, log=log)
            _close(to_f64(dx, dtype), ref, dtype, f"softmax_backward ragged log={log} off={off}/{out_off}",
                   row_scale=_row_rms(ref), atol=1e-7)
            if out is not None:
                assert np.all(np.isnan(to_f64(obig[:out_off], dtype)))
                assert np.all(np.isnan(to_f64(obig[out_off + rows * n:], dtype)))


@pytest.mark.gpu
def test_norm_backward_matches_torch_autograd_float64_gpu():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (33, 4097):
        x = torch.randn(64, n, device="cuda", dtype=torch.float32, generator=g) * 2 + 0.3
        dy = torch.randn(64, n, device="cuda", dtype=torch.float32, generator=g)
        w = torch.randn(n, device="cuda", dtype=torch.float32, generator=g)
        b = torch.randn(n, device="cuda", dtype=torch.float32, generator=g)
        xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
        F.layer_norm(xd, (n,), wd, bd, 1e-5).backward(dy.double())
        dx, dw, db = rtk.layernorm_backward(dy, x, w, b, eps=1e-5)
        for got, ref, what in ((dx, xd.grad, "dx"), (dw, wd.grad, "dweight"), (db, bd.grad, "dbias")):
            assert isinstance(got, torch.Tensor)
            err = (got.double() - ref).abs().max().item()
            assert err <= 2e-5 * ref.abs().max().item() + 1e-6, (n, what, err)
        xd, wd = (t.double().requires_grad_() for t in (x, w))
        F.rms_norm(xd, (n,), wd, 1e-6).backward(dy.double())
        y, rstd = rtk.rmsnorm(x, w, eps=1e-6, return_stats=True)
        dx, dw = rtk.rmsnorm_backward(dy, x, w, rstd)
        assert (dx.double() - xd.grad).abs().max().item() <= 2e-5 * xd.grad.abs().max().item()
        assert (dw.double() - wd.grad).abs().max().item() <= 2e-5 * wd.grad.abs().max().item()


# ---- cross-entropy -----------------------------------------------------------------------------------
VOCABS = (1, 1000, 50257, 128256, 151936, 256000)   # 50257, 151936: refitted slices (cross_entropy.plan)


def _ce_rows(v):
    return {1: 33, 1000: 300, 50257: 9, 128256: 5, 151936: 4, 256000: 3}[v]


def _targets(rng, rows, v, ignore_frac=0.25):
    t = rng.integers(0, v, rows).astype(np.int64)
    t[rng.random(rows) < ignore_frac] = -100
    return t


@pytest.mark.gpu
@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cross_entropy_gpu(dtype, v):
    cp, random_array, to_f64, poison = _gpu()
    rng = np.random.default_rng(v)
    rows = _ce_rows(v)
    x, x64 = random_array(rng, (rows, v), dtype, scale=3.0)
    t = _targets(rng, rows, v)
    t[0] = v - 1        # the last class (in a ragged tail when v is odd)
    td = cp.asarray(t)
    for reduction, smoothing in (("mean", 0.0), ("sum", 0.1), ("none", 0.0), ("mean", 0.2)):
        g = poison(cp.empty_like(x))
        loss, got_g = rtk.cross_entropy(x, td, reduction=reduction, label_smoothing=smoothing, return_grad=True,
                                        grad_out=g, dtype=dtype)
        assert got_g is g and str(loss.dtype) == "float32"
        ref_l, ref_g = ce.cross_entropy_reference(x64, t, label_smoothing=smoothing, reduction=reduction)
        what = f"cross_entropy {reduction} eps={smoothing} V={v}"
        np.testing.assert_allclose(cp.asnumpy(loss), ref_l, rtol=2e-5, atol=2e-5, err_msg=what)
        _close(to_f64(g, dtype), ref_g, dtype, what + " grad", atol=1e-7 * (1 if reduction != "mean" else 1))
        if smoothing == 0.0 and reduction == "mean":   # the loss-only kernel (one more compile per case)
            alone = rtk.cross_entropy(x, td, reduction=reduction, label_smoothing=smoothing, dtype=dtype)
            assert cp.array_equal(alone, loss), what + ": loss without the gradient differs"


@pytest.mark.gpu
def test_cross_entropy_special_batches_gpu():
    cp, random_array, to_f64, poison = _gpu()
    rng = np.random.default_rng(9)
    x, x64 = random_array(rng, (6, 5000), "bfloat16")
    ignored = cp.full(6, -100, dtype=cp.int64)
    for reduction in ("mean", "sum", "none"):
        g = poison(cp.empty_like(x))
        loss, _ = rtk.cross_entropy(x, ignored, reduction=reduction, return_grad=True, grad_out=g, dtype="bfloat16")
        ref = ce.cross_entropy_reference(x64, np.full(6, -100), reduction=reduction)[0]
        if reduction == "mean":
            assert np.isnan(float(loss)) and np.isnan(ref)        # torch: 0 / 0
        else:
            assert np.all(cp.asnumpy(loss) == 0)
        assert np.all(to_f64(g, "bfloat16") == 0)
    # custom ignore_index, int32 targets, a target out of range -> NaN row
    t = np.array([4999, 7, -1, 0, 5000, 3], np.int32)
    loss, g = rtk.cross_entropy(x, cp.asarray(t), ignore_index=-1, reduction="none", return_grad=True,
                                dtype="bfloat16")
    lh, gh = cp.asnumpy(loss), to_f64(g, "bfloat16")
    assert lh[2] == 0 and np.all(gh[2] == 0)
    assert np.isnan(lh[4]) and np.all(np.isnan(gh[4]))
    ok = [0, 1, 3, 5]
    ref_l, ref_g = ce.cross_entropy_reference(x64[ok], t[ok].astype(np.int64), reduction="none")
    np.testing.assert_allclose(lh[ok], ref_l, rtol=2e-5, atol=2e-5)
    _close(gh[ok], ref_g, "bfloat16", "grad", atol=1e-7)
    # in place: the gradient overwrites the logits
    x2 = x.copy()
    t2 = cp.asarray(np.array([1, 2, 3, -100, 5, 6]))
    loss_a, g_a = rtk.cross_entropy(x, t2, return_grad=True, dtype="bfloat16")
    loss_b, g_b = rtk.cross_entropy(x2, t2, return_grad=True, grad_out=x2, dtype="bfloat16")
    assert g_b is x2 and cp.array_equal(g_a, x2) and float(loss_a) == float(loss_b)


@pytest.mark.gpu
@pytest.mark.parametrize("v", [7, 4099, 50257])
def test_cross_entropy_strided_and_unaligned_rows_gpu(v):
    """Rows of a wider array (the row stride is not 16 bytes) and a logits view one element in."""
    cp, random_array, to_f64, poison = _gpu()
    rng = np.random.default_rng(v + 3)
    big, big64 = random_array(rng, (11, v + 3), "bfloat16")
    t = _targets(rng, 11, v)
    for x, x64 in ((big[:, :v], big64[:, :v]), (big[:, 1:v + 1], big64[:, 1:v + 1])):
        gbig = poison(cp.empty_like(big))
        g = gbig[:, 1:v + 1] if x.data.ptr != big.data.ptr else gbig[:, :v]
        loss, _ = rtk.cross_entropy(x, cp.asarray(t), reduction="sum", return_grad=True, grad_out=g,
                                    label_smoothing=0.05, dtype="bfloat16")
        ref_l, ref_g = ce.cross_entropy_reference(x64, t, reduction="sum", label_smoothing=0.05)
        np.testing.assert_allclose(float(loss), ref_l, rtol=2e-5)
        _close(to_f64(g, "bfloat16"), ref_g, "bfloat16", f"grad V={v}", atol=1e-7)


@pytest.mark.gpu
def test_torch_side_stream_and_replayed_plans_gpu():
    """torch tensors launch on torch's current stream: inputs written on a side stream right before
    each call and outputs changed right after it, no synchronize in between; the second and third
    calls of a signature replay the first call's plan."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    s = torch.cuda.Stream()
    g = torch.Generator(device="cuda").manual_seed(7)
    got = []
    with torch.cuda.stream(s):
        w = torch.randn(3000, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(3000, device="cuda", dtype=torch.bfloat16, generator=g)
        for trial in range(3):
            x = torch.randn(512, 3000, device="cuda", dtype=torch.bfloat16, generator=g)
            dy = torch.randn(512, 3000, device="cuda", dtype=torch.bfloat16, generator=g)
            t = torch.randint(0, 3000, (512,), device="cuda", generator=g)
            x.mul_(2.0)                    # queued on s right before the ops read x
            dx, dw, db = rtk.layernorm_backward(dy, x, w, b)
            loss, dlogits = rtk.cross_entropy(x, t, return_grad=True)
            sdx = rtk.softmax_backward(dy, x)
            dlogits.mul_(1.0)              # queued on s right after the op writes it
            got.append((x, dy, t, dx, dw, db, loss, dlogits.clone(), sdx))
    s.synchronize()
    for x, dy, t, dx, dw, db, loss, dlogits, sdx in got:
        xf, wf, bf = (a.float().requires_grad_() for a in (x, w, b))
        F.layer_norm(xf, (3000,), wf, bf, 1e-5).backward(dy.float())
        torch.testing.assert_close(dx.float(), xf.grad, atol=2e-2, rtol=2 ** -6)
        torch.testing.assert_close(dw.float(), wf.grad, atol=2e-1, rtol=2 ** -6)
        torch.testing.assert_close(db.float(), bf.grad, atol=2e-1, rtol=2 ** -6)
        lf = x.float().requires_grad_()
        ref = F.cross_entropy(lf, t)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(dlogits.float(), lf.grad, rtol=2 ** -7, atol=1e-7)
        yf = x.float()
        ref_s = yf * (dy.float() - (dy.float() * yf).sum(-1, keepdim=True))
        torch.testing.assert_close(sdx.float(), ref_s, rtol=2 ** -7, atol=2 ** -7 * ref_s.abs().max().item())


CE_CLASS_CONFIGS = [   # row classes at vocabularies the heuristics would not give them
    (50257, dict(threads_per_row=512, block_size=512, vecs_per_thread=4, two_pass=True)),
    (20000, dict(threads_per_row=256, block_size=256, vecs_per_thread=8, cluster_size=2, smem_rows=True)),
    (20000, dict(threads_per_row=1024, block_size=1024, vecs_per_thread=4)),
    (3000, dict(threads_per_row=16, block_size=128, vecs_per_thread=32)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("v, fields", CE_CLASS_CONFIGS)
def test_cross_entropy_every_row_class_gpu(v, fields):
    from rtkernels import device
    if (fields.get("cluster_size", 1) > 1 or fields.get("smem_rows")) and \
            arch_number(device.current_arch()) < 90:
        pytest.skip("clusters / bulk copies need sm_90")
    cp, random_array, to_f64, poison = _gpu()
    rng = np.random.default_rng(v)
    x, x64 = random_array(rng, (21, v), "bfloat16", scale=2.0)
    t = _targets(rng, 21, v)
    ragged = v % 8 != 0
    cfg = CrossEntropyConfig(dtype="bfloat16", vec=8, ragged=ragged, grad=True, smoothing=True, **fields)
    g = poison(cp.empty_like(x))
    loss, _ = rtk.cross_entropy(x, cp.asarray(t), label_smoothing=0.1, return_grad=True, grad_out=g,
                                dtype="bfloat16", config=cfg)
    ref_l, ref_g = ce.cross_entropy_reference(x64, t, label_smoothing=0.1)
    np.testing.assert_allclose(float(loss), ref_l, rtol=2e-5)
    _close(to_f64(g, "bfloat16"), ref_g, "bfloat16", f"grad {fields}", atol=1e-7)


@pytest.mark.gpu
def test_cross_entropy_matches_torch_gpu():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    gen = torch.Generator(device="cuda").manual_seed(1)
    for v, dtype in ((32000, torch.bfloat16), (50257, torch.float16), (1000, torch.float32)):
        x = (torch.randn(64, v, device="cuda", generator=gen) * 2).to(dtype)
        t = torch.randint(0, v, (64,), device="cuda", generator=gen)
        t[::5] = -100
        for smoothing in (0.0, 0.1):
            # a fresh leaf each time: x.float() of float32 x is x itself, whose .grad would
            # accumulate across iterations (smoothing 0.1's gradient compared with the sum of two)
            xr = x.detach().float().clone().requires_grad_()
            ref = F.cross_entropy(xr, t, label_smoothing=smoothing)
            ref.backward()
            loss, g = rtk.cross_entropy(x, t, label_smoothing=smoothing, return_grad=True)
            assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float32 and g.dtype == dtype
            torch.testing.assert_close(loss, ref.detach(), rtol=2e-5, atol=2e-5)
            torch.testing.assert_close(g.float(), xr.grad, rtol=2 ** -7, atol=1e-7)


# ---- AdamW --------------------------------------------------------------------------------------------
def _shapes(rng, count=50):
    shapes = []
    for i in range(count):
        kind = i % 5
        if kind == 0:
            shapes.append((int(rng.integers(1, 5000)),))               # biases, odd sizes
        elif kind == 1:
            shapes.append((int(rng.integers(1, 300)), int(rng.integers(1, 300))))
        elif kind == 2:
            shapes.append((int(rng.integers(1, 9)), int(rng.integers(1, 40)), int(rng.integers(1, 70))))
        elif kind == 3:
            shapes.append((1,))
        else:
            shapes.append((256, int(rng.integers(100, 1100))))        # several chunks
    return shapes


@pytest.mark.gpu
def test_adamw_matches_torch_foreach_false_gpu():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = _shapes(rng)
    ref = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    ours = [torch.nn.Parameter(p.clone()) for p in ref]   # leaves that require grad, as an optimizer sees them
    m = [torch.zeros_like(p, requires_grad=False) for p in ref]
    v = [torch.zeros_like(p, requires_grad=False) for p in ref]
    for p in ref:
        p.requires_grad_()
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, foreach=False)
    grads = [torch.zeros_like(p) for p in ref]
    for step in range(1, 21):
        for r, g in zip(ref, grads):
            g.copy_(torch.randn(r.shape, device="cuda", generator=gen))
            r.grad = g.clone()
        opt.step()
        rtk.adamw_step(ours, grads, m, v, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, step=step)
    worst = max(((o.detach() - r.detach()).abs().max() / r.detach().abs().max().clamp_min(1e-30)).item()
                for o, r in zip(ours, ref))
    assert worst <= 1e-6, worst
    st = [opt.state[r] for r in ref]
    assert max(((a - s["exp_avg"]).abs().max() / s["exp_avg"].abs().max()).item() for a, s in zip(m, st)) <= 1e-6
    assert max(((a - s["exp_avg_sq"]).abs().max() / s["exp_avg_sq"].abs().max()).item() for a, s in zip(v, st)) <= 1e-6


@pytest.mark.gpu
def test_adamw_bf16_master_weights_and_device_scalars_gpu():
    """bf16 params with fp32 masters against the fp32 reference; lr and step as device scalars,
    captured in a CUDA graph and replayed."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = _shapes(rng, 20)
    master = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    ref = [p.clone() for p in master]
    params = [p.to(torch.bfloat16) for p in master]
    grads = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    m, v = [torch.zeros_like(p) for p in master], [torch.zeros_like(p) for p in master]
    rm, rv = [torch.zeros_like(p) for p in master], [torch.zeros_like(p) for p in master]
    lr = torch.full((1,), 3e-3, device="cuda")
    step = torch.zeros((1,), device="cuda")
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    # warm up (builds the table and loads the kernel outside the capture), then restart from the
    # same state
    rtk.adamw_step(params, grads, m, v, lr=lr, step=step + 1, master_params=master, **kw)
    for a, b in zip(master, ref):
        a.copy_(b)
    for a in (*m, *v):
        a.zero_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            step.add_(1)
            rtk.adamw_step(params, grads, m, v, lr=lr, step=step, master_params=master, **kw)
    torch.cuda.current_stream().wait_stream(s)
    step.zero_()
    for t in range(1, 11):
        for g, r in zip(grads, ref):
            g.copy_(torch.randn(r.shape, device="cuda", generator=gen).to(torch.bfloat16))
        if t == 6:
            lr.fill_(1e-3)
        graph.replay()
        lr_t = 3e-3 if t < 6 else 1e-3
        for i in range(len(ref)):
            p, a, b = (torch.from_numpy(z).cuda() for z in aw.adamw_reference(   # float64 chain
                ref[i].double().cpu().numpy(), grads[i].double().cpu().numpy(), rm[i].double().cpu().numpy(),
                rv[i].double().cpu().numpy(), lr=lr_t, step=t, **kw))
            ref[i], rm[i], rv[i] = p, a, b
    torch.cuda.synchronize()
    worst = max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(master, ref))
    assert worst <= 2e-6, worst
    assert all(torch.equal(p, mm.to(torch.bfloat16)) for p, mm in zip(params, master))


@pytest.mark.gpu
def test_adamw_cupy_mixed_groups_and_cache_gpu():
    """CuPy arrays of two dtype groups (float32; float16 params with float16 states), maximize,
    an unaligned view; the cached table is reused while the lists are the same objects."""
    cp, _, _, _ = _gpu()
    rng = np.random.default_rng(2)
    shapes = _shapes(rng, 12)
    ps = [cp.asarray(rng.standard_normal(s), dtype=cp.float32 if i % 2 else cp.float16) for i, s in enumerate(shapes)]
    base = cp.zeros(1001, cp.float32)
    ps.append(base[1:])                                   # 4-byte aligned only: the scalar path
    gs = [cp.asarray(rng.standard_normal(p.shape), dtype=p.dtype) for p in ps]
    ms = [cp.zeros_like(p) for p in ps]
    vs = [cp.zeros_like(p) for p in ps]
    kw = dict(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, maximize=True)
    ref = [(cp.asnumpy(p).astype(np.float64), np.zeros(p.shape), np.zeros(p.shape)) for p in ps]
    aw.clear_cache()
    for step in (1, 2, 3):
        # float16 tensors round p, m, v every step: their reference step starts from what is stored
        start = [(cp.asnumpy(p).astype(np.float64), cp.asnumpy(m).astype(np.float64),
                  cp.asnumpy(v).astype(np.float64)) if p.dtype == cp.float16 else r
                 for r, p, m, v in zip(ref, ps, ms, vs)]
        rtk.adamw_step(ps, gs, ms, vs, step=step, **kw)
        ref = [aw.adamw_reference(*r[:1], cp.asnumpy(g).astype(np.float64), *r[1:], step=step, **kw)
               for r, g in zip(start, gs)]
        for p, (rp, _, _) in zip(ps, ref):
            tol = 1e-6 if p.dtype == cp.float32 else 2 ** -10
            got = cp.asnumpy(p).astype(np.float64)
            err = np.max(np.abs(got - rp))
            assert err <= tol * max(1.0, np.abs(rp).max()), (step, p.shape, str(p.dtype), err)
    assert len(aw._CACHE) == 1
