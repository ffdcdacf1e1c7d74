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


# ---- operand layouts and the tensor maps they become (no GPU: the driver's encode is intercepted) --
_BASE = 1 << 24   # a 512-byte aligned stand-in for a device allocation


def _operand(view, offset=0):
    """views.classify of a NumPy uint8 view as if its buffer started at _BASE + offset: (info, the
    byte address of every element, (rows, K) in C order)."""
    from rtkernels.ops import views
    base = view.base if view.base is not None else view
    while getattr(base, "base", None) is not None:
        base = base.base
    start = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    addr = _BASE + offset + start
    rows, k = view.shape
    every = addr + np.arange(rows)[:, None] * view.strides[0] + np.arange(k)[None, :] * view.strides[1]
    return views.classify(view.shape, view.strides, 1, addr), every


@pytest.fixture
def encoded(monkeypatch):
    """Records the arguments of every cuTensorMapEncodeTiled call (fresh tensor-map memo)."""
    from collections import OrderedDict
    from cuda.bindings import driver as drv
    from rtkernels import tma
    calls = []

    class _Map:
        opaque = [0] * 16

    def fake(dtype, rank, ptr, dims, strides, box, elem, *rest):
        calls.append(dict(ptr=int(ptr), dims=[int(d) for d in dims], strides=[int(s) for s in strides],
                          box=[int(b) for b in box]))
        return drv.CUresult.CUDA_SUCCESS, _Map()
    monkeypatch.setattr(drv, "cuTensorMapEncodeTiled", fake)
    monkeypatch.setattr(tma, "_memo", OrderedDict())
    monkeypatch.setattr(tma, "LAUNCH_ARGS", {})
    return calls


def _addressed(call, rows, k):
    """The byte address a tensor map names for each (row, k) in bounds (the driver's order is
    innermost first: dims [K, rows], strides [row stride])."""
    assert call["dims"] == [k, rows]
    return call["ptr"] + np.arange(rows)[:, None] * call["strides"][0] + np.arange(k)[None, :]


def _kernel_reads(a_view, a_off, b_nk_view, b_off, encoded):
    """What matmul_fp8's plan makes of a (M, K) and b's (N, K) transpose: the layouts, and for
    in-place operands the tensor maps it encodes, checked against every element's address."""
    m, k = a_view.shape
    n = b_nk_view.shape[0]
    (ia, every_a), (ib, every_b) = _operand(a_view, a_off), _operand(b_nk_view, b_off)
    (how_a, lda), (how_b, ldb) = f8.operand_layout(ia), f8.operand_layout(ib)
    cfg = f8.heuristic_config(m, n, k, tma_store=False)
    maps = f8.operand_maps(cfg, m, n, k, lda, ldb, ldc=n)
    # in place: the view's own address; a copy: a fresh (here: _BASE) dense buffer of row stride ld
    pa = ia.address if how_a == f8.IN_PLACE else _BASE
    pb = ib.address if how_b == f8.IN_PLACE else _BASE
    from rtkernels import tma
    tma._memo.clear()   # (the fixture's own memo) every map encoded anew
    encoded.clear()
    f8.tensor_maps(cfg, (pa, *maps[1]), (pb, *maps[2]), None)
    assert len(encoded) == 2   # a's, b's (no TMA store: c reuses a's)
    ca, cb = encoded
    for how, every, call, rows in ((how_a, every_a, ca, m), (how_b, every_b, cb, n)):
        got = _addressed(call, rows, k)
        if how == f8.IN_PLACE:
            assert (got == every).all(), (how, call)
        else:   # the copy is dense, K-major, rows of K bytes
            assert (got == _BASE + np.arange(rows)[:, None] * k + np.arange(k)[None, :]).all(), (how, call)
    assert ca["box"] == [cfg.block_k, cfg.block_m] and cb["box"] == [cfg.block_k, cfg.block_n]
    return how_a, how_b


def test_padded_and_offset_views_encode_their_own_strides(encoded):
    """The layouts of test_layouts_and_views (GPU) through the plan to the driver's arguments: a
    padded row slice big[:, 16:16 + K] is read in place with its K + 32 byte row stride and its base
    16 bytes in; so is b = w.t() of a padded w; an unaligned slice, expand-ed rows, a column-major
    operand and a view with no unit stride are copied (their maps then read the dense copy)."""
    m, n, k = 257, 130, 528
    big = np.zeros((m, k + 32), np.uint8)
    bigw = np.zeros((n, k + 32), np.uint8)
    w = np.zeros((n, k), np.uint8)
    a = np.zeros((m, k), np.uint8)
    # b = w.t(): the op reads b.T, i.e. w itself
    assert _kernel_reads(big[:, 16:16 + k], 0, w, 0, encoded) == (f8.IN_PLACE, f8.IN_PLACE)
    assert encoded[0]["ptr"] == _BASE + 16 and encoded[0]["strides"] == [k + 32]
    assert encoded[1]["ptr"] == _BASE and encoded[1]["strides"] == [k]
    assert _kernel_reads(a, 0, bigw[:, 32:32 + k], 0, encoded) == (f8.IN_PLACE, f8.IN_PLACE)
    assert encoded[1]["ptr"] == _BASE + 32 and encoded[1]["strides"] == [k + 32]
    assert _kernel_reads(big[:, 1:1 + k], 0, w, 0, encoded)[0] == f8.COPY                  # base off 16
    assert _kernel_reads(big[:, 16:16 + k], 8, w, 0, encoded)[0] == f8.COPY                # allocation off 16
    assert _kernel_reads(np.zeros((m, k + 8), np.uint8)[:, :k], 0, w, 0, encoded)[0] == f8.COPY   # K + 8
    assert _kernel_reads(np.broadcast_to(a[:1], (m, k)), 0, w, 0, encoded)[0] == f8.COPY  # expand(M, K)
    assert _kernel_reads(a, 0, np.broadcast_to(w[:1], (n, k)), 0, encoded)[1] == f8.COPY
    assert _kernel_reads(np.zeros((k, m), np.uint8).T, 0, w, 0, encoded)[0] == f8.TRANSPOSE   # column-major
    assert _kernel_reads(np.zeros((m, 2 * k), np.uint8)[:, ::2], 0, w, 0, encoded)[0] == f8.COPY
    assert _kernel_reads(a[::-1], 0, w, 0, encoded)[0] == f8.COPY                           # CuPy flip
    assert _kernel_reads(a[:1], 16, w[:1], 32, encoded) == (f8.IN_PLACE, f8.IN_PLACE)       # one row


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
    """Every way operand_layout reads a view: in place (padded rows of a, b = w.t() of a padded w,
    bases 16 / 32 bytes into their buffers, trans_b), the transpose pass (a row-major (K, N) b, a
    column-major a, one with an odd row stride, trans_a), a copy (a base off 16 bytes, rows K + 8
    bytes apart, rows broadcast by expand, no unit stride); an output row stride; empty M / N.
    Each case has its own buffer, checked to hold the intended values just before the call (an
    earlier version built two cases in one buffer, so the second overwrote the first's bytes)."""
    torch = _torch()
    import rtkernels as rtk
    rng = np.random.default_rng(3)
    m, n, k = 257, 130, 528
    a = _fp8(torch, rng, (m, k), "float8_e4m3fn")
    w = _fp8(torch, rng, (n, k), "float8_e4m3fn")
    sa, sb = _scale(torch, rng, "tensor", m, "row"), _scale(torch, rng, "col", n, "col")

    def padded(x, lead, pad):
        """x's values in a view whose rows are x.shape[1] + pad bytes apart, starting lead bytes in."""
        big = _fp8(torch, rng, (x.shape[0], x.shape[1] + pad), "float8_e4m3fn")
        big[:, lead:lead + x.shape[1]] = x
        return big[:, lead:lead + x.shape[1]]

    a_col_odd = padded(a.t(), 0, 2).t()                     # column-major, row stride M + 2 = 259 (odd)
    a_step = _fp8(torch, rng, (m, 2 * k), "float8_e4m3fn")
    a_step[:, ::2] = a
    a_row = a[:1].expand(m, k)
    # name: (a operand, b operand, kwargs, a's values, b's values as (N, K), how a and b are read)
    cases = {
        "contiguous": (a, w.t(), {}, a, w, "in place"),
        "b row-major (K, N)": (a, w.t().contiguous(), {}, a, w, "b transposed"),
        "a column-major": (a.t().contiguous().t(), w.t(), {}, a, w, "a transposed"),
        "a column-major, row stride M + 2": (a_col_odd, w.t(), {}, a, w, "a transposed (byte loads)"),
        "trans_b": (a, w, {"trans_b": True}, a, w, "in place"),
        "trans_a of (K, M)": (a.t().contiguous(), w.t(), {"trans_a": True}, a, w, "a transposed"),
        "a padded rows (stride K + 32, base + 16)": (padded(a, 16, 32), w.t(), {}, a, w, "in place"),
        "b = w.t(), w padded (stride K + 32, base + 32)": (a, padded(w, 32, 32).t(), {}, a, w, "in place"),
        "a base off 16 bytes (base + 1)": (padded(a, 1, 32), w.t(), {}, a, w, "a copied"),
        "a rows K + 8 bytes apart": (padded(a, 0, 8), w.t(), {}, a, w, "a copied"),
        "a rows expand-ed (stride 0)": (a_row, w.t(), {}, a_row, w, "a copied"),
        "b columns expand-ed": (a, w[:1].expand(n, k).t(), {}, a, w[:1].expand(n, k), "b copied"),
        "a[:, ::2] (no unit stride)": (a_step[:, ::2], w.t(), {}, a, w, "a copied"),
    }
    u8 = torch.uint8
    for what, (x, y, kw, a_ref, w_ref, how) in cases.items():
        # the fixture itself: the operands hold the values the reference is computed from
        xa = x.t() if kw.get("trans_a") else x
        yb = y if kw.get("trans_b") else y.t()
        assert torch.equal(xa.view(u8), a_ref.view(u8)) and torch.equal(yb.view(u8), w_ref.view(u8)), what
        c = rtk.matmul(x, y, scale_a=sa, scale_b=sb, **kw)
        err, err_t, label = _check(torch, c, a_ref.contiguous(), w_ref.contiguous(), sa, sb, None, None, "bfloat16",
                                   f"{what} ({how}; a strides {tuple(x.stride())}, b strides {tuple(y.stride())})")
        print(f"{what:48s} {how:26s} err {err:.3g}, {label} {err_t:.3g}")
    wide = torch.full((m, n + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    rtk.matmul(a, w.t(), scale_a=sa, scale_b=sb, out=wide[:, :n])
    _check(torch, wide[:, :n], a, w, sa, sb, None, None, "bfloat16", "out row stride N + 8")
    assert torch.isnan(wide[:, n:].float()).all()    # nothing written past the view
    assert tuple(rtk.matmul(a[:0], w.t(), scale_a=sa, scale_b=sb).shape) == (0, n)
    assert tuple(rtk.matmul(a, w[:0].t(), scale_a=sa).shape) == (m, 0)


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
        if dt == "float8_e4m3fn":   # CuPy's negative strides (rows reversed): a compact copy
            c = rtk.matmul(a8[::-1], b8, dtype=spelling, out_dtype="float32")
            a_flip = a.view(torch.uint8).flip(0).view(a.dtype)
            _check(torch, torch.from_dlpack(c), a_flip, w, None, None, None, None, "float32",
                   "CuPy a[::-1] (negative row stride)")
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
