"""attention: config validation, heuristics, compile/ptxas/SASS sweeps (CPU) and GPU correctness.

CPU tests compile with NVRTC only (no driver).  GPU tests (``-m gpu``) follow FlashAttention's
rule: the kernel's error against a float64 reference is at most twice the error of the same
reference run in the input dtype, over awkward shapes; outputs are poisoned (NaN) first.
"""
from __future__ import annotations

import importlib
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels import inspect as rtk_inspect
from rtkernels.errors import ConfigError
from rtkernels.ops.attention import AttentionConfig, HEURISTICS, attention, candidates, choose_config

# the module itself: rtkernels.ops re-exports the function under the same name
attn_mod = importlib.import_module("rtkernels.ops.attention")
HEAD_DIMS = list(range(8, 257, 8))
ARCHS = ("sm_80", "sm_90")
DTYPES = ("float16", "bfloat16")


# ---- config -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(head_dim=7), dict(head_dim=264), dict(head_dim=0), dict(dtype="float32"),
    dict(block_m=64, num_warps=8), dict(block_m=256, num_warps=4), dict(block_n=24), dict(block_n=512),
    dict(num_stages=3), dict(num_warps=3), dict(causal="yes"),
])
def test_config_rejects(bad):
    with pytest.raises(ConfigError) as e:
        AttentionConfig(**bad)
    field = next(iter(bad))
    assert "attention" in str(e.value) and field in str(e.value)


def test_config_derived_values():
    c = AttentionConfig(dtype="bf16", head_dim=72, block_m=128, block_n=64, num_warps=4, num_stages=1)
    assert c.dtype == "bfloat16" and c.head_dim_padded == 80 and c.threads_per_block == 128
    # Q/K rows: 80 padded + 8 (odd chunk count 11) ; V rows: 72 (9 chunks, already odd)
    assert c.shared_mem_bytes == 2 * (128 * 88 + 64 * (88 + 72))
    assert rtk.families()["attention"] is AttentionConfig


def test_python_smem_size_matches_the_model_layout():
    from test_attention_model import Layout
    for d in HEAD_DIMS:
        for bm, bn, w, st in ((128, 64, 4, 2), (128, 64, 8, 1), (64, 32, 4, 1)):
            cfg = AttentionConfig(head_dim=d, block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            assert cfg.shared_mem_bytes == 2 * Layout(d, bm, bn, w, st).SMEM_ELEMS


def test_heuristics_cover_every_head_dim_and_fit():
    from rtkernels import arch
    for d in HEAD_DIMS:
        for causal in (False, True):
            assert candidates(d, causal)
            for a in ("sm_80", "sm_86", "sm_89", "sm_90"):
                cfg = choose_config("float16", d, causal, a)
                assert cfg.shared_mem_bytes <= arch.limits(a).max_smem_per_block_optin
    for lo, hi, _c, tiles in HEURISTICS:
        assert lo % 8 == 0 and hi % 8 == 0 and tiles and all(t.why for t in tiles)
    with pytest.raises(ConfigError):
        candidates(264, False)


def test_template_renders_constexpr_block():
    from rtkernels.render import render
    cfg = AttentionConfig(dtype="bfloat16", head_dim=40, causal=True, block_m=64, block_n=32, num_warps=4)
    src = render(cfg.template, cfg.template_params(), family="attention").source
    for line in ("using T = __nv_bfloat16;", "constexpr int HEAD_DIM = 40;", "constexpr bool IS_CAUSAL = true;",
                 "constexpr int BLOCK_M = 64;", f"constexpr int SMEM_BYTES = {cfg.shared_mem_bytes};"):
        assert line in src
    assert 'extern "C" __global__' in src and "{{" not in src


# ---- compile sweep: every head dim x dtype x causal, as the heuristics choose -------------
def _build(args):
    dtype, d, causal, arch = args
    cfg = choose_config(dtype, d, causal, arch)
    k = rtk.get_kernel(cfg, arch=arch)
    return cfg, k.resources


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_heuristic_configs_compile_without_spills(arch, dtype, causal):
    jobs = [(dtype, d, causal, arch) for d in HEAD_DIMS]
    with ThreadPoolExecutor(2) as ex:   # NVRTC releases the GIL while compiling
        results = list(ex.map(_build, jobs))
    bad = [(cfg.head_dim, r.registers, r.spill_stores, r.spill_loads, r.stack_frame) for cfg, r in results
           if r.spill_stores or r.spill_loads or r.stack_frame]
    assert not bad, f"spills on {arch} {dtype} causal={causal}: (head_dim, regs, st, ld, stack) {bad}"


SASS_CASES = [("float16", 64, False, "sm_90"), ("bfloat16", 40, True, "sm_90"), ("float16", 128, True, "sm_80"),
              ("bfloat16", 136, False, "sm_80"), ("float16", 256, False, "sm_90"), ("float16", 8, True, "sm_90")]


@pytest.mark.parametrize("dtype,d,causal,arch", SASS_CASES)
def test_sass_uses_tensor_cores_ldmatrix_cp_async(dtype, d, causal, arch):
    k = rtk.get_kernel(choose_config(dtype, d, causal, arch), arch=arch)
    sass = k.sass
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    assert any(o.startswith("HMMA.16816.F32") for o in ops), "mma.sync m16n8k16 -> HMMA.16816.F32"
    assert any(o == "LDSM.16.M88.4" for o in ops), "ldmatrix.x4 for Q and K"
    assert any(o.startswith("LDSM.16.MT88") for o in ops), "ldmatrix.trans for V"
    assert any(o.startswith("LDGSTS.E.BYPASS.128") for o in ops), "16-byte cp.async.cg"
    assert any(o.startswith("MUFU.EX2") for o in ops)
    assert any(o == "STG.E.128" for o in ops), "16-byte output stores"
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "no local memory"
    assert not rtk_inspect.flags(k), rtk_inspect.flags(k)


# ---- GPU: correctness -------------------------------------------------------------------
def _data(rng, shape, dtype):
    from gpu_util import random_array
    dev, _ = random_array(rng, shape, dtype)
    return dev


def _rel_err(a, b):
    import cupy as cp
    a = cp.asarray(a, dtype=cp.float64)
    b = cp.asarray(b, dtype=cp.float64)
    den = float(cp.linalg.norm(b))
    return float(cp.linalg.norm(a - b)) / (den if den > 0 else 1.0)


def _check(q, k, v, causal, dtype, o, lse, softmax_scale=None):
    """FlashAttention's rule: err(kernel) <= 2 err(reference in dtype) (+ a floor of a few ulps);
    lse within 1e-3 relative; -inf exactly where the reference has it; no NaN anywhere."""
    import cupy as cp
    from gpu_util import to_f64
    from rtkernels.ops.attention import attention_reference
    bf = "bfloat16" if dtype == "bfloat16" else None
    ref, lse_ref = attention_reference(q, k, v, causal, softmax_scale, dtype=bf, compute="float64")
    low, _ = attention_reference(q, k, v, causal, softmax_scale, dtype=bf, compute="float32", round_to=dtype)
    out = cp.asarray(to_f64(o, dtype))
    assert not bool(cp.isnan(out).any()), "NaN in o"
    err, err_low = _rel_err(out, ref), _rel_err(low, ref)
    floor = 2 ** -11 if dtype == "float16" else 2 ** -8
    assert err <= 2 * err_low + floor, f"rel err {err:.3e} vs reference-in-{dtype} {err_low:.3e}"
    if lse is not None:
        lse = cp.asarray(lse, dtype=cp.float64)
        assert lse.shape == lse_ref.shape
        assert not bool(cp.isnan(lse).any()), "NaN in lse"
        ninf = cp.isneginf(lse_ref)
        assert bool((cp.isneginf(lse) == ninf).all()), "-inf rows differ"
        fin = ~ninf
        if bool(fin.any()):
            d = cp.abs(lse[fin] - lse_ref[fin]) / cp.maximum(cp.abs(lse_ref[fin]), 1.0)
            assert float(d.max()) <= 1e-3, f"lse rel err {float(d.max()):.2e}"


def _run(batch, sq, sk, h, hkv, d, causal, dtype, seed=None, **kw):
    import cupy as cp
    from gpu_util import poison
    # fresh inputs every run; the seed is printed so a failure can be replayed
    seed = int(np.random.SeedSequence().entropy % 2**32) if seed is None else seed
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    q = _data(rng, (batch, sq, h, d), dtype)
    k = _data(rng, (batch, sk, hkv, d), dtype)
    v = _data(rng, (batch, sk, hkv, d), dtype)
    o = poison(cp.empty(q.shape, q.dtype))
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    o2, lse = attention(q, k, v, causal=causal, out=o, **extra, **kw)
    assert o2 is o
    cp.cuda.get_current_stream().synchronize()
    _check(q, k, v, causal, dtype, o, lse, kw.get("softmax_scale"))


GPU_HEAD_DIMS = [8, 40, 64, 72, 80, 96, 128, 136, 160, 192, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("d", GPU_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dims(d, dtype, causal):
    # seqlens that are no multiple of any tile, seqlen_q != seqlen_k, a GQA group of 2
    _run(2, 113, 203, 4, 2, d, causal, dtype)


SEQLENS = [(1, 1), (17, 17), (113, 113), (255, 255), (1000, 1000), (4097, 4097),
           (1, 1000), (17, 255), (113, 4097), (1000, 17), (255, 1), (4097, 113)]


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_seqlens(sq, sk, causal):
    dtype = "float16" if (sq + sk) % 2 else "bfloat16"
    d = 128 if sq * sk > 100_000 else 64
    _run(1, sq, sk, 2, 1, d, causal, dtype)


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal, dtype); the Hopper kernel's
# tests run these too.
COMBINED = [
    (7, 255, 255, 16, 2, 64, True, "bfloat16"),      # GQA 8:1, batch 7
    (7, 113, 1000, 8, 1, 128, False, "float16"),     # MQA
    (1, 1000, 255, 8, 1, 80, True, "float16"),       # MQA, causal with rows that see no key
    (3, 4097, 4097, 2, 2, 96, True, "bfloat16"),
    (2, 17, 4097, 4, 1, 256, True, "float16"),       # decode-like: few queries, long keys
    (1, 300, 300, 3, 3, 136, False, "bfloat16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype", COMBINED)
def test_gpu_combined(batch, sq, sk, h, hkv, d, causal, dtype):
    _run(batch, sq, sk, h, hkv, d, causal, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_strided_q_from_packed_qkv_and_custom_scale(dtype):
    import cupy as cp
    rng = np.random.default_rng()
    b, s, h, d = 2, 333, 4, 72
    qkv = _data(rng, (b, s, 3, h, d), dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    o, lse = attention(q, k, v, causal=True, softmax_scale=0.3, **extra)
    cp.cuda.get_current_stream().synchronize()
    _check(q, k, v, True, dtype, o, lse, 0.3)


@pytest.mark.gpu
def test_gpu_non_default_stream_and_no_lse():
    import cupy as cp
    from gpu_util import poison
    rng = np.random.default_rng()
    q = _data(rng, (2, 500, 4, 64), "float16")
    k = _data(rng, (2, 700, 4, 64), "float16")
    v = _data(rng, (2, 700, 4, 64), "float16")
    cp.cuda.Device().synchronize()   # inputs were made on the legacy stream; s does not wait for it
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        o = poison(cp.empty(q.shape, q.dtype))
        s.synchronize()
        r = attention(q, k, v, causal=True, return_lse=False, out=o, stream=s)
        assert r is o
    s.synchronize()
    _check(q, k, v, True, "float16", o, None)


@pytest.mark.gpu
def test_gpu_strided_out():
    import cupy as cp
    from gpu_util import poison
    rng = np.random.default_rng()
    q = _data(rng, (2, 65, 4, 40), "float16")
    k = _data(rng, (2, 80, 4, 40), "float16")
    v = _data(rng, (2, 80, 4, 40), "float16")
    big = poison(cp.empty((2, 65, 8, 40), cp.float16))
    o = big[:, :, 2:6]     # head stride 40, seq stride 320: a view into a wider buffer
    attention(q, k, v, out=o)
    cp.cuda.get_current_stream().synchronize()
    _check(q, k, v, False, "float16", o, None)
    assert bool(cp.isnan(big[:, :, :2].astype(cp.float32)).all()), "wrote outside the out view"


@pytest.mark.gpu
def test_gpu_torch_bfloat16_in_torch_out():
    torch = pytest.importorskip("torch")
    import cupy as cp
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 129, 4, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 150, 2, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 150, 2, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    o, lse = attention(q, k, v, causal=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and o.shape == q.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == (2, 4, 129)
    torch.cuda.synchronize()
    as_bits = lambda t: cp.from_dlpack(t.view(torch.int16)).view(cp.uint16)
    _check(as_bits(q), as_bits(k), as_bits(v), True, "bfloat16", as_bits(o), cp.from_dlpack(lse))
    # and against PyTorch itself (bottom-right causal needs an explicit mask there)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(2, dim=1), vt.repeat_interleave(2, dim=1)
    mask = torch.ones(129, 150, dtype=torch.bool, device="cuda").tril(150 - 129)
    ref = torch.nn.functional.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), attn_mask=mask)
    assert (o.float() - ref.transpose(1, 2)).abs().max().item() < 3e-2


@pytest.mark.gpu
def test_gpu_torch_side_stream_orders_forward_and_backward():
    """Inputs written on a torch side stream and the ops called under it: the launches go to
    that stream (torch's current one), so no explicit synchronize is needed before or between."""
    torch = pytest.importorskip("torch")
    from rtkernels.ops.attention_bwd import attention_backward
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v, do = (torch.randn(1, 300, 2, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
        q.mul_(1.5)   # more work queued on s right before the launch
        o, lse = attention(q, k, v, causal=True)
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, causal=True)
        # references on the same stream from the same tensors
        qt, kt, vt = (x.float().transpose(1, 2).requires_grad_() for x in (q, k, v))
        mask = torch.ones(300, 300, dtype=torch.bool, device="cuda").tril()
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
        ref.backward(do.float().transpose(1, 2))
    s.synchronize()
    assert (o.float() - ref.transpose(1, 2)).abs().max().item() < 2e-2
    for got, r in ((dq, qt.grad), (dk, kt.grad), (dv, vt.grad)):
        r = r.transpose(1, 2)
        assert ((got.float() - r).norm() / r.norm()).item() < 2e-2


@pytest.mark.gpu
def test_gpu_empty_inputs_launch_nothing():
    import cupy as cp
    q = cp.zeros((0, 5, 2, 64), cp.float16)
    k = cp.zeros((0, 7, 2, 64), cp.float16)
    o, lse = attention(q, k, k)
    assert o.shape == (0, 5, 2, 64) and lse.shape == (0, 2, 5)
    q = cp.zeros((2, 0, 2, 64), cp.float16)
    k = cp.zeros((2, 7, 2, 64), cp.float16)
    o, lse = attention(q, k, k)
    assert o.shape == (2, 0, 2, 64) and lse.shape == (2, 2, 0)


@pytest.mark.gpu
def test_gpu_bad_inputs_raise_and_launch_nothing():
    import cupy as cp
    from gpu_util import poison
    q = cp.ones((1, 16, 2, 64), cp.float16)
    k = cp.ones((1, 16, 2, 64), cp.float16)
    out = poison(cp.empty_like(q))
    cases = [
        (dict(q=q.astype(cp.float32)), "float32"),
        (dict(k=k.astype(cp.float32)), "float32"),
        (dict(q=cp.ones((1, 16, 2, 7), cp.float16), k=cp.ones((1, 16, 2, 7), cp.float16),
              v=cp.ones((1, 16, 2, 7), cp.float16)), "head_dim"),
        (dict(q=cp.ones((1, 16, 2, 264), cp.float16), k=cp.ones((1, 16, 2, 264), cp.float16),
              v=cp.ones((1, 16, 2, 264), cp.float16)), "head_dim"),
        (dict(k=cp.ones((1, 16, 2, 32), cp.float16), v=cp.ones((1, 16, 2, 32), cp.float16)), "k must be"),
        (dict(v=cp.ones((1, 15, 2, 64), cp.float16)), "v must have"),
        (dict(q=cp.ones((1, 16, 3, 64), cp.float16)), "multiple of nheads_kv"),
        # (a strided last dimension is copied and runs: tests/test_views_gpu.py)
        (dict(out=cp.broadcast_to(cp.empty((1, 16, 1, 64), cp.float16), (1, 16, 2, 64))), "out .* broadcast"),
        (dict(q=cp.ones((16, 2, 64), cp.float16)), "4-D"),
        (dict(q=cp.ones((1, 16, 2, 64), cp.uint16)), "uint16"),
        (dict(softmax_scale=-1.0), "softmax_scale"),
        (dict(softmax_scale=float("nan")), "softmax_scale"),
        (dict(out=cp.empty((1, 16, 2, 64), cp.float32)), "out must be"),
        (dict(out=cp.empty((1, 16, 1, 64), cp.float16)), "out must be"),
    ]
    for change, words in cases:
        args = dict(q=q, k=k, v=k, out=out)
        args.update(change)
        with pytest.raises(ConfigError, match=words):
            attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.isnan(out.astype(cp.float32)).all()), "an error case launched the kernel"
    if cp.cuda.runtime.getDeviceCount() > 1:
        with cp.cuda.Device(1):
            k1 = cp.ones((1, 16, 2, 64), cp.float16)
        with pytest.raises(ConfigError, match="same device"):
            attention(q, k1, k1)


@pytest.mark.gpu
def test_gpu_repeat_calls_reuse_the_kernel():
    import cupy as cp
    rng = np.random.default_rng()
    q = _data(rng, (1, 64, 2, 88), "float16")
    attention(q, q, q)
    n = len(attn_mod._KERNELS)
    attention(q, q, q)
    assert len(attn_mod._KERNELS) == n
    cp.cuda.get_current_stream().synchronize()


def test_tile_space_is_valid_and_fits():
    for d in (8, 72, 128, 200, 256):
        for arch in ("sm_80", "sm_86", "sm_90"):
            space = attn_mod.tile_space("bfloat16", d, True, arch)
            assert space[0] == attn_mod.choose_config("bfloat16", d, True, arch)   # the default comes first
            limit = attn_mod._smem_limit(arch)
            assert all(c.shared_mem_bytes <= limit for c in space) and len(set(space)) == len(space)
    assert [attn_mod._seqlen_bucket(n) for n in (1, 128, 129, 4096, 4097)] == [128, 128, 256, 4096, 8192]


@pytest.mark.gpu
def test_gpu_autotune_mode_picks_a_correct_config(tmp_path, monkeypatch):
    from rtkernels import autotune
    monkeypatch.setenv("RTKERNELS_AUTOTUNE", "1")
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(tmp_path))
    autotune.clear_memory()
    _run(2, 300, 300, 4, 2, 96, True, "bfloat16")   # tunes, then checks the result
    entries = autotune.load()
    assert len(entries) == 1
    (entry,) = entries.values()
    assert entry["family"] == "attention" and len(entry["timings"]) >= 2
    _run(2, 300, 300, 4, 2, 96, True, "bfloat16")   # reuses the stored winner
    assert len(autotune.load()) == 1


def test_compile_by_name_fills_tiles_from_the_heuristics():
    import rtkernels as rtk
    k = rtk.compile("attention", head_dim=256, dtype="bfloat16", causal=True, arch="sm_90")
    assert k.config == attn_mod.choose_config("bfloat16", 256, True, "sm_90")
    k = rtk.compile("attention", head_dim=160, arch="sm_80")   # 128x128 tiles do not fit sm_80
    assert k.config == attn_mod.choose_config("float16", 160, False, "sm_80") and k.config.block_n == 64
    k = rtk.compile("attention", head_dim=64, block_m=64, num_warps=4, block_n=32, num_stages=1, q_in_regs=False,
                    arch="sm_90")
    assert (k.config.block_m, k.config.block_n) == (64, 32)   # explicit tiles win


def test_dense_calls_with_few_query_rows_route_to_the_decode_kernel(monkeypatch):
    """attention.decode_route: seqlen_q <= 16 with <= 64 rows per kv head, GQA with up to 512 rows
    at seqlen_q <= 32 over >= 2k keys or a dense grid of >= 512 CTAs, or a small dense grid over
    long keys, runs on the KV-cache kernel when K/V hold >= 16 MiB (multi-head attention on a full
    grid: >= 128 MiB) - measured reasons beside the rule."""
    from rtkernels.ops.attention import DECODE_ENV, decode_route
    monkeypatch.delenv(DECODE_ENV, raising=False)
    assert decode_route(1, 1, 4096, 32, 8, 128) and decode_route(16, 1, 1024, 32, 4, 64)   # 16 MiB of K/V
    assert not decode_route(16, 1, 1023, 32, 4, 64)                                      # just under
    assert decode_route(8, 16, 1024, 32, 8, 128)          # 16 rows x group 4 = 64
    assert not decode_route(8, 16, 1024, 32, 4, 128)      # 128 rows per kv head, 1k keys, 256 dense CTAs
    assert decode_route(8, 16, 1024, 64, 8, 128)          # ... on 512 dense CTAs
    assert decode_route(8, 16, 2048, 32, 4, 128)          # ... over 2k keys
    assert decode_route(1, 32, 32768, 32, 2, 128)         # 512 rows (seqlen_q 32 x group 16)
    assert not decode_route(1, 32, 32768, 64, 2, 128)     # 1024 rows
    assert not decode_route(2, 33, 8192, 32, 4, 128)      # seqlen_q 33
    assert not decode_route(8, 32, 4096, 16, 16, 128)     # multi-head at seqlen_q 32 stays dense
    assert decode_route(1, 16, 4096, 16, 16, 128)         # multi-head: 16 dense CTAs
    assert not decode_route(8, 1, 2048, 16, 16, 64)       # multi-head on 128 CTAs, 64 MiB: left dense
    assert decode_route(8, 1, 4096, 16, 16, 64)           # ... 128 MiB: routed
    assert not decode_route(8, 64, 8192, 16, 16, 128)     # seqlen_q 64, a full dense grid
    assert decode_route(1, 128, 32768, 32, 8, 128)        # 32 dense CTAs over 32k keys
    assert not decode_route(2, 128, 32768, 32, 8, 128) and not decode_route(1, 129, 32768, 16, 16, 128)
    assert not decode_route(1, 64, 8192, 16, 16, 128)     # keys too short for that
    assert not decode_route(64, 1, 255, 8, 8, 128)        # too few keys to split
    monkeypatch.setenv(DECODE_ENV, "0")
    assert not decode_route(1, 1, 4096, 32, 8, 128)
