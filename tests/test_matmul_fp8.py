"""fp8 matmul on Hopper (ops/matmul_fp8.py, templates/matmul_fp8_sm90.cu.j2, templates/transpose8.cu.j2).

CPU: config validation, the generated wgmma_fp8.cuh, compile of the heuristic's tiles and of every
e4m3 / e5m2 pair (one module-scoped set of kernels shared by the SASS / ptxas tests), the fp8
decoding of the float64 reference, argument errors raised before anything touches a GPU.
GPU (torch for float8 tensors and torch._scaled_mm, the error reference): odd M / N, each scale kind,
each output dtype, bias + activation, both operand layouts, CuPy uint8 operands, poisoned outputs,
CUDA-graph capture reading the scale on the device, clear errors for K % 16 != 0.
"""
import importlib.util
import pathlib
import re
import zlib

import numpy as np
import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import matmul_fp8 as f8
from rtkernels.ops.matmul_fp8 import MatmulFp8Config

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---- config validation ---------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    (dict(a_dtype="float8_e4m4"), "a_dtype"),
    (dict(b_dtype="bfloat16"), "b_dtype"),
    (dict(out_dtype="float8_e4m3fn"), "out_dtype"),
    (dict(bias_dtype="int8", has_bias=True), "bias_dtype"),
    (dict(block_m=64), "block_m"),
    (dict(block_n=96), "block_n"),
    (dict(block_k=64), "block_k"),
    (dict(block_n=256), "block_n"),                              # 128 + 128 promoted registers
    (dict(block_n=256, block_m=256, promote_interval=0), "block_n"),   # 256 accumulators
    (dict(num_stages=1), "num_stages"),
    (dict(num_stages=8), "num_stages"),                          # 8 x 32 KiB ring > 227 KiB
    (dict(promote_interval=-1), "promote_interval"),
    (dict(scale_a="col"), "scale_a"),
    (dict(scale_b="row"), "scale_b"),
    (dict(out_dtype="float32"), "tma_store"),                    # TMA store epilogue is 16-bit
    (dict(epilogue_n=96), "epilogue_n"),
    (dict(activation="tanh"), "activation"),
    (dict(has_bias=1), "has_bias"),
])
def test_config_errors(bad, field):
    with pytest.raises(ConfigError) as e:
        MatmulFp8Config(**bad)
    assert e.value.field == field and "matmul_fp8_sm90" in str(e.value)


def test_config_derived():
    c = MatmulFp8Config()
    assert c.a_dtype == "float8_e4m3fn" and MatmulFp8Config(a_dtype="float8_e4m3").a_dtype == "float8_e4m3fn"
    assert c.stage_bytes == (128 + 128) * 128 and c.threads_per_block == 384 and c.needs_arch_specific
    for t in f8.TILES + f8.TUNE_ONLY + f8.FAST_ACCUM_TILES:
        cfg = f8._config(t)
        assert cfg.shared_mem_bytes <= 227 * 1024, (t, cfg.shared_mem_bytes)
        assert f8._config(t, out_dtype="float32", tma_store=False).epi_n == t.block_n
    assert f8._config(f8.TILES[0]).epi_n == 64      # 5 x 40 KiB ring leaves room for 64 columns


def test_heuristic_choices():
    # the widest promoted tile for big squares, 128x128 where it fills the waves better
    assert f8.heuristic_config(8192, 8192, 8192).block_n == 192
    assert f8.heuristic_config(4096, 4096, 4096).block_n == 128   # 32 x 32 tiles: 8 rounds vs 6 of 704 at 0.96
    assert f8.heuristic_config(512, 4096, 4096).block_n in (128, 192)
    assert f8.heuristic_config(16, 64, 4096).block_n == 64
    for c in (f8.heuristic_config(m, n, 4096) for m, n in ((1, 1), (7, 129), (1793, 1793), (16384, 28672))):
        assert c.promote_interval == 1   # the default keeps _scaled_mm's (promoted) accuracy


def test_wgmma_fp8_header_matches_generator():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "tools" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.HEADER_FP8.read_text() == gen.generate_fp8(), "run: python tools/gen_wgmma.py"
    text = gen.HEADER_FP8.read_text()
    for ta in ("e4m3", "e5m2"):
        for tb in ("e4m3", "e5m2"):
            for n in gen.SHAPES_FP8:
                assert f"m64n{n}k32.f32.{ta}.{tb} " in text


# ---- compile, ptxas and SASS (one set of kernels for the module) ----------------------------
def _compiled_configs():
    heur = [f8._config(t) for t in f8.TILES]
    pairs = [
        f8._config(f8.TILES[1], a_dtype="float8_e4m3fn", b_dtype="float8_e5m2", has_bias=True, activation="gelu",
                   scale_a="row", scale_b="col", out_dtype="float16"),
        f8._config(f8.TILES[2], a_dtype="float8_e5m2", b_dtype="float8_e4m3fn", out_dtype="float32", tma_store=False,
                   has_bias=True, bias_dtype="float32", scale_a="tensor", scale_b="tensor", activation="silu"),
        f8._config(f8.TILES[0], a_dtype="float8_e5m2", b_dtype="float8_e5m2", tma_store=False, scale_b="col",
                   activation="relu"),
    ]
    return heur + pairs + [f8._config(f8.FAST_ACCUM_TILES[0])]


@pytest.fixture(scope="module")
def kernels():
    import rtkernels as rtk
    return [(cfg, rtk.get_kernel(cfg, arch="sm_90")) for cfg in _compiled_configs()]


def _short(t: str) -> str:
    return {"float8_e4m3fn": "E4M3", "float8_e5m2": "E5M2"}[t]


def test_compiles_clean_no_spills(kernels):
    for cfg, k in kernels:
        assert k.module.arch == "sm_90a"
        r = k.resources
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, (cfg, r)
        assert r.registers == 168, (cfg, r)    # the (384, 1) cap; setmaxnreg hands 232 to the consumers
        log = k.module.log
        # setmaxnreg ignored (C7508), wgmma serialized or waits injected by ptxas (C7517 / C7510)
        assert not re.search(r"C75(08|10|17)|serializ", log), (cfg, log)


def test_sass_has_fp8_wgmma_and_tma(kernels):
    from rtkernels.inspect import sass_stats
    for cfg, k in kernels:
        sass = k.sass
        want = f"QGMMA.64x{cfg.block_n}x32.F32.{_short(cfg.a_dtype)}.{_short(cfg.b_dtype)}"
        found = re.findall(r"QGMMA\.[\w.]+", sass)
        # one k32 instruction per m64 block and 32 K of the 128-deep step, nothing else
        assert found == [want] * (cfg.block_m // 128 * 4), (cfg, found)
        s = sass_stats(sass)
        assert "UTMALDG" in sass and s["ldl"] == 0 and s["stl"] == 0
        assert ("UTMASTG" in sass) == cfg.tma_store, cfg
        assert "HGMMA" not in sass
        # promotion: one full wait per K step in the promoted kernels, the one-group pipeline otherwise
        depbar = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", sass)
        if cfg.promote_interval:
            assert "0" in depbar, (cfg, depbar)
        else:
            assert "1" in depbar, (cfg, depbar)


def test_transpose_kernel_compiles():
    import rtkernels as rtk
    for vec in (True, False):
        k = rtk.get_kernel(f8.Fp8TransposeConfig(vec_in=vec), arch="sm_90")
        assert k.resources.spill_stores == 0 and k.resources.stack_frame == 0


# ---- the reference's fp8 decoding ------------------------------------------------------------
def test_fp8_decoding():
    e4 = f8.fp8_to_float(np.array([0x00, 0x01, 0x08, 0x38, 0x7E, 0xFE, 0x7F, 0xFF, 0x3C], np.uint8), "float8_e4m3fn")
    assert list(e4[:6]) == [0.0, 2.0 ** -9, 2.0 ** -6, 1.0, 448.0, -448.0] and np.isnan(e4[6:8]).all()
    assert e4[8] == 1.5
    e5 = f8.fp8_to_float(np.array([0x01, 0x3C, 0x7B, 0x7C, 0xFC, 0x7D, 0x3E], np.uint8), "float8_e5m2")
    assert list(e5[:5]) == [2.0 ** -16, 1.0, 57344.0, np.inf, -np.inf] and np.isnan(e5[5]) and e5[6] == 1.5
    for t, top in (("float8_e4m3fn", 0x7E), ("float8_e5m2", 0x7B)):
        v = f8.fp8_to_float(np.arange(top + 1, dtype=np.uint8), t)
        assert (np.diff(v) > 0).all()   # every positive code, strictly increasing


def test_reference_scales_and_bias():
    a = np.array([[0x38, 0x40]], np.uint8)              # e4m3: 1.0, 2.0
    b = np.array([[0x38], [0x38]], np.uint8)            # 1.0, 1.0
    c = f8.matmul_fp8_reference(a, b, scale_a=np.float32(0.5), scale_b=np.array([4.0]), bias=np.array([1.0]),
                                activation="relu")
    assert c.tolist() == [[(1.0 + 2.0) * 0.5 * 4.0 + 1.0]]


# ---- argument errors before any device work ------------------------------------------------
def test_argument_errors_on_cpu():
    import rtkernels as rtk
    x = np.zeros((4, 16), np.float32)
    with pytest.raises(ConfigError) as e:
        rtk.matmul(x, x.T.copy(), scale_a=x)          # not fp8
    assert e.value.field == "a" and "float8_e4m3fn" in str(e.value)
    u = np.zeros((4, 16), np.uint8)
    with pytest.raises(ConfigError) as e:
        rtk.matmul(u, u.T, dtype="float8_e4m4")
    assert e.value.field == "dtype" and "float8_e5m2" in str(e.value)
    with pytest.raises(ConfigError) as e:
        rtk.matmul(u, u.T, dtype="float8_e4m3", out_dtype="float8_e4m3fn")
    assert "host array" in str(e.value) or e.value.field == "out_dtype"
    assert f8.wants_fp8(u, u, ("float8_e4m3", "float8_e5m2"), None, None, None)
    assert not f8.wants_fp8(x, x, "bfloat16", None, None, None)


# ---- GPU -------------------------------------------------------------------------------------
def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs torch with an sm_90 GPU")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8 dtypes")
    return torch


_TDT = {"float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}


def _fp8(torch, rng, shape, dtype, spread=1.0):
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * spread).cuda()
    return x.to(getattr(torch, dtype))


def _scale(torch, rng, kind, length, per):
    if kind == "none":
        return None
    if kind == "tensor":
        return torch.tensor(float(rng.uniform(0.25, 2.0)), dtype=torch.float32, device="cuda")
    v = torch.from_numpy(rng.uniform(0.25, 2.0, length).astype(np.float32)).cuda()
    return v.reshape(length, 1) if per == "row" else v.reshape(1, length)


def _ref64(torch, a, b_nk, sa, sb, bias, act):
    """float64 reference from the exact fp8 values (b_nk: (N, K))."""
    a64 = a.double().cpu().numpy()
    b64 = b_nk.double().cpu().numpy().T
    return f8.matmul_fp8_reference(a64, b64, scale_a=None if sa is None else sa.double().cpu().numpy().reshape(-1),
                                   scale_b=None if sb is None else sb.double().cpu().numpy().reshape(-1),
                                   bias=None if bias is None else bias.double().cpu().numpy(), activation=act)


def _trusted(torch, a, b_nk, sa, sb, bias, act, out_dtype):
    """The same computation by torch: torch._scaled_mm (cuBLAS fp8, fast accumulation off) on operands
    zero-padded to its multiples of 16, with the scales made both per-tensor or both per-row/column
    as it requires, its float32 result finished (bias, activation) in float64 and rounded to
    out_dtype; where _scaled_mm refuses the combination (e5m2 x e5m2, ...), a float32 cuBLAS matmul
    of the exactly converted values.  Returns (values as float64 NumPy, what computed them)."""
    m, k = a.shape
    n = b_nk.shape[0]
    pm, pn = -(-m // 16) * 16, -(-n // 16) * 16
    one = torch.ones((), dtype=torch.float32, device="cuda")
    sa_ = one if sa is None else sa
    sb_ = one if sb is None else sb
    if sa_.numel() > 1 or sb_.numel() > 1:   # _scaled_mm's rowwise scaling wants both per row / column
        sa_ = sa_.reshape(1, 1).expand(m, 1).contiguous() if sa_.numel() == 1 else sa_.reshape(m, 1)
        sb_ = sb_.reshape(1, 1).expand(1, n).contiguous() if sb_.numel() == 1 else sb_.reshape(1, n)
    label = "torch._scaled_mm"
    try:
        ap = torch.zeros((pm, k), dtype=a.dtype, device="cuda")
        ap[:m] = a
        bp = torch.zeros((pn, k), dtype=b_nk.dtype, device="cuda")
        bp[:n] = b_nk
        if sa_.numel() > 1:
            sap = torch.ones((pm, 1), dtype=torch.float32, device="cuda")
            sap[:m] = sa_
            sbp = torch.ones((1, pn), dtype=torch.float32, device="cuda")
            sbp[:, :n] = sb_
        else:
            sap, sbp = sa_.reshape(()), sb_.reshape(())
        c = None
        for odt in (torch.float32, torch.bfloat16):
            try:
                c = torch._scaled_mm(ap, bp.t(), scale_a=sap, scale_b=sbp, out_dtype=odt)
                break
            except Exception:   # (RuntimeError / NotImplementedError / ValueError across torch versions)
                continue
        if c is None:
            raise RuntimeError("no _scaled_mm output dtype")
        c = c[:m, :n].double()
    except Exception:
        label = "float32 cuBLAS matmul"
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            c = (a.float() @ b_nk.float().t()).double()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        c = c * sa_.double().reshape(-1, 1) * sb_.double().reshape(1, -1)
    c = c.cpu().numpy()
    if bias is not None:
        c = c + bias.double().cpu().numpy()
    from rtkernels.ops.matmul import _act_np
    c = _act_np(c, act)
    t = torch.from_numpy(c).to(getattr(torch, out_dtype)).double().numpy()
    return t, label


def _poison(t):
    """NaN bits in every byte of a torch tensor (0xFF is NaN in bf16, fp16 and fp32)."""
    t.view(-1).view(__import__("torch").uint8).fill_(0xFF)
    return t


def _ulp(out_dtype):
    return {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}[out_dtype]


def _check(torch, got, a, b_nk, sa, sb, bias, act, out_dtype, what):
    ref = _ref64(torch, a, b_nk, sa, sb, bias, act)
    g = got.double().cpu().numpy()
    assert np.isfinite(g).all(), f"{what}: non-finite outputs (unwritten poison?) at {np.argwhere(~np.isfinite(g))[:5]}"
    trusted, label = _trusted(torch, a, b_nk, sa, sb, bias, act, out_dtype)
    err = np.abs(g - ref).max()
    err_t = np.abs(trusted - ref).max()
    scale = max(np.abs(ref).max(), 1e-30)
    # half an output ulp: both may round one value differently when the trusted one is exact
    tol = 2 * err_t + 0.5 * _ulp(out_dtype) * scale
    if label != "torch._scaled_mm":
        # the trusted sum is plain f32, the tensor cores keep ~14 bits inside a 128-deep K step
        sa_ = 1.0 if sa is None else float(sa.abs().max())
        sb_ = 1.0 if sb is None else float(sb.abs().max())
        mag = (a.double().abs() @ b_nk.double().abs().t()).max().item() * sa_ * sb_
        tol += 2.0 ** -13 * mag
    assert err <= tol, (f"{what}: max error {err:.3g} vs float64 > {tol:.3g} (2 x {label}'s {err_t:.3g}); "
                        f"max |ref| {scale:.3g}")
    return err, err_t, label


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 129, 1793])
@pytest.mark.parametrize("n", [1, 7, 129, 1793])
def test_odd_shapes(m, n):
    torch = _torch()
    import rtkernels as rtk
    rng = np.random.default_rng(m * 10007 + n)
    for k in (16, 144, 1792):
        a = _fp8(torch, rng, (m, k), "float8_e4m3fn")
        w = _fp8(torch, rng, (n, k), "float8_e4m3fn")
        sa, sb = _scale(torch, rng, "tensor", m, "row"), _scale(torch, rng, "tensor", n, "col")
        out = _poison(torch.empty((m, n), dtype=torch.bfloat16, device="cuda"))
        rtk.matmul(a, w.t(), scale_a=sa, scale_b=sb, out=out)
        cfg = f8.heuristic_config(m, n, k)
        _check(torch, out, a, w, sa, sb, None, None, "bfloat16", f"M={m} N={n} K={k} tile {cfg.block_m}x{cfg.block_n}")


@pytest.mark.gpu
# every scale kind of each operand and every output dtype, each kernel compiled once (not the product)
@pytest.mark.parametrize("sa_kind, sb_kind, out_dtype", [
    ("none", "none", "bfloat16"), ("tensor", "tensor", "bfloat16"), ("row", "col", "bfloat16"),
    ("row", "col", "float16"), ("row", "col", "float32"), ("tensor", "tensor", "float32"),
    ("row", "tensor", "float16"), ("tensor", "col", "float32"), ("none", "col", "bfloat16")])
def test_scales_and_outputs(sa_kind, sb_kind, out_dtype):
    torch = _torch()
    import rtkernels as rtk
    rng = np.random.default_rng(zlib.crc32(f"{sa_kind}{sb_kind}{out_dtype}".encode()))
    m, n, k = 515, 1040, 4096     # a long K: the promotion matters
    a = _fp8(torch, rng, (m, k), "float8_e4m3fn")
    w = _fp8(torch, rng, (n, k), "float8_e4m3fn")
    sa, sb = _scale(torch, rng, sa_kind, m, "row"), _scale(torch, rng, sb_kind, n, "col")
    c = rtk.matmul(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    assert c.dtype == getattr(torch, out_dtype) and tuple(c.shape) == (m, n)
    err, err_t, label = _check(torch, c, a, w, sa, sb, None, None, out_dtype, f"scales {sa_kind}/{sb_kind} {out_dtype}")
    print(f"scales {sa_kind}/{sb_kind} {out_dtype}: err {err:.3g}, {label} {err_t:.3g}")


@pytest.mark.gpu
# every type pair and every activation, each with three bias / output dtype pairs
@pytest.mark.parametrize("ta, tb, act", [("float8_e4m3fn", "float8_e4m3fn", "gelu"),
                                         ("float8_e4m3fn", "float8_e5m2", "relu"),
                                         ("float8_e5m2", "float8_e4m3fn", "silu"),
                                         ("float8_e5m2", "float8_e5m2", None)])
def test_types_bias_activation(ta, tb, act):
    torch = _torch()
    import rtkernels as rtk
    rng = np.random.default_rng(7)
    m, n, k = 300, 520, 1040
    a = _fp8(torch, rng, (m, k), ta)
    w = _fp8(torch, rng, (n, k), tb)
    sa, sb = _scale(torch, rng, "row", m, "row"), _scale(torch, rng, "col", n, "col")
    for bias_dt, out_dtype in (("bfloat16", "bfloat16"), ("float32", "float16"), ("float32", "float32")):
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).cuda().to(getattr(torch, bias_dt))
        out = _poison(torch.empty((m, n), dtype=getattr(torch, out_dtype), device="cuda"))
        rtk.matmul(a, w.t(), scale_a=sa, scale_b=sb, bias=bias, activation=act, out=out)
        _check(torch, out, a, w, sa, sb, bias, act, out_dtype, f"{ta} x {tb} act={act} bias {bias_dt} out {out_dtype}")


@pytest.mark.gpu
def test_layouts_and_views():
    """A row-major (K, N) b and a column-major a (the transpose pass), trans_b, a K-major slice that is
    not 16-byte aligned (an aligned copy), a padded row stride read in place, an output row stride."""
    torch = _torch()
    import rtkernels as rtk
    rng = np.random.default_rng(3)
    m, n, k = 257, 130, 528
    a = _fp8(torch, rng, (m, k), "float8_e4m3fn")
    w = _fp8(torch, rng, (n, k), "float8_e4m3fn")
    sa, sb = _scale(torch, rng, "tensor", m, "row"), _scale(torch, rng, "col", n, "col")
    cases = {
        "b row-major (K, N)": (a, w.t().contiguous(), {}),
        "a column-major": (a.t().contiguous().t(), w.t(), {}),
        "trans_b": (a, w, {"trans_b": True}),
        "trans_a of (K, M)": (a.t().contiguous(), w.t(), {"trans_a": True}),
    }
    big = _fp8(torch, rng, (m, k + 32), "float8_e4m3fn")
    big[:, 16:16 + k] = a
    cases["padded rows (stride K + 32)"] = (big[:, 16:16 + k], w.t(), {})
    big[:, 1:1 + k] = a
    cases["base off 16 bytes"] = (big[:, 1:1 + k], w.t(), {})
    for what, (x, y, kw) in cases.items():
        c = rtk.matmul(x, y, scale_a=sa, scale_b=sb, **kw)
        _check(torch, c, a, w, sa, sb, None, None, "bfloat16", what)
    wide = torch.full((m, n + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    rtk.matmul(a, w.t(), scale_a=sa, scale_b=sb, out=wide[:, :n])
    _check(torch, wide[:, :n], a, w, sa, sb, None, None, "bfloat16", "out row stride N + 8")
    assert torch.isnan(wide[:, n:].float()).all()    # nothing written past the view


@pytest.mark.gpu
def test_cupy_uint8_operands():
    torch = _torch()
    import cupy as cp
    import rtkernels as rtk
    from gpu_util import f32_from_bf16_bits, poison
    rng = np.random.default_rng(5)
    m, n, k = 129, 200, 272
    for dt, spelling in (("float8_e4m3fn", "float8_e4m3"), ("float8_e5m2", "float8_e5m2")):
        a = _fp8(torch, rng, (m, k), dt)
        w = _fp8(torch, rng, (n, k), dt)
        a8 = cp.from_dlpack(a.view(torch.uint8))
        b8 = cp.from_dlpack(w.view(torch.uint8).t().contiguous())     # (K, N) row-major bits
        sb = cp.asarray(rng.uniform(0.5, 2, n).astype(np.float32))
        out = poison(cp.empty((m, n), dtype=cp.uint16))
        rtk.matmul(a8, b8, dtype=spelling, scale_b=sb, out=out, out_dtype="bfloat16")
        got = torch.from_numpy(f32_from_bf16_bits(out.get()).astype(np.float32))
        _check(torch, got, a, w, None, torch.from_dlpack(sb).reshape(1, n), None, None, "bfloat16",
               f"CuPy uint8 {spelling}")
        # the same bits through trans_b and a (K-major) pair of dtypes
        c = rtk.matmul(a8, cp.from_dlpack(w.view(torch.uint8)), trans_b=True, dtype=(spelling, spelling),
                       out_dtype="float32")
        _check(torch, torch.from_dlpack(c), a, w, None, None, None, None, "float32", f"CuPy trans_b {spelling}")


@pytest.mark.gpu
def test_plan_replay_and_graph_capture_read_scales_on_device():
    torch = _torch()
    import rtkernels as rtk
    rng = np.random.default_rng(11)
    m, n, k = 256, 384, 512
    a = _fp8(torch, rng, (m, k), "float8_e4m3fn")
    w = _fp8(torch, rng, (n, k), "float8_e4m3fn")
    sa = torch.tensor(1.0, device="cuda")
    sb = torch.from_numpy(rng.uniform(0.5, 2, n).astype(np.float32)).cuda()
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    rtk.matmul(a, w.t(), scale_a=sa, scale_b=sb, out=out)          # full path, records the plan
    rtk.matmul(a, w.t(), scale_a=sa, scale_b=sb, out=out)          # replay
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            rtk.matmul(a, w.t(), scale_a=sa, scale_b=sb, out=out)
    torch.cuda.current_stream().wait_stream(s)
    sa.fill_(3.0)            # the captured kernel must read the new value on the device
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    _check(torch, out, a, w, sa, sb.reshape(1, n), None, None, "bfloat16", "graph replay with scale_a changed to 3")


@pytest.mark.gpu
def test_errors_on_gpu():
    torch = _torch()
    import rtkernels as rtk
    rng = np.random.default_rng(1)
    for k in (7, 129, 1793):
        a = _fp8(torch, rng, (8, k), "float8_e4m3fn")
        w = _fp8(torch, rng, (8, k), "float8_e4m3fn")
        with pytest.raises(ConfigError, match="multiple of 16") as e:
            rtk.matmul(a, w.t())
        assert e.value.field == "shape"
    a = _fp8(torch, rng, (8, 32), "float8_e4m3fn")
    w = _fp8(torch, rng, (8, 32), "float8_e4m3fn")
    with pytest.raises(ConfigError) as e:
        rtk.matmul(a, w.t(), scale_a=torch.ones(3, device="cuda"))
    assert e.value.field == "scale_a" and "(8,)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        rtk.matmul(a, w.t(), scale_b=torch.ones(8, dtype=torch.float16, device="cuda"))
    assert e.value.field == "scale_b" and "float32" in str(e.value)
    with pytest.raises(ConfigError) as e:
        rtk.matmul(a[None], w.t()[None])
    assert e.value.field == "a" and "2-D" in str(e.value)
    with pytest.raises(ConfigError) as e:
        rtk.matmul(a, w.t(), out_dtype="float64")
    assert e.value.field == "out_dtype"
    with pytest.raises(ConfigError) as e:
        rtk.matmul(a, torch.ones((32, 8), dtype=torch.bfloat16, device="cuda"))
    assert e.value.field == "b"
