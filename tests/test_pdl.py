"""Programmatic dependent launch (rtkernels/pdl.py): which kernels take it, that each of them
waits for its stream before touching global memory (SASS), and on the GPU that a PDL kernel
behind a producer that lets its dependents start early still reads the producer's results,
directly and inside a CUDA graph."""
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import rtkernels as rtk
from rtkernels import pdl

# SASS of global memory access (loads, stores, atomics, reductions, cp.async, TMA and bulk
# copies, generic loads/stores that may reach global memory).  ACQBULK is griddepcontrol.wait.
_GLOBAL_ACCESS = re.compile(r"\b(LDG|STG|LDGSTS|ATOMG|ATOM|RED|REDG|UTMALDG|UTMASTG|UTMAREDG|UBLKCP|UBLKRED|"
                            r"UBLKPF|UTMAPF|LD|ST|CCTL)(\.|\s)")
_WAIT = re.compile(r"\bACQBULK\b")


def _first(pattern, sass):
    for i, line in enumerate(sass.splitlines()):
        if re.search(r"/\*[0-9a-f]{4,}\*/", line) and pattern.search(line):
            return i
    return None


def test_waits_first_reads_the_first_statement():
    src = ('extern "C" __global__ void __launch_bounds__(128) k(const float* x, int n) {\n'
           '    // why\n    /* more */ rtk::grid_dependency_wait();\n    x[0];\n}\n'
           'extern "C" __global__ void late(int n) {\n    int i = n;\n    rtk::grid_dependency_wait();\n}\n'
           'extern "C" __global__ void none(int n) { }\n')
    from rtkernels.kernel import _parameter_list
    assert pdl.waits_first(src, _parameter_list(src, "k")[1])
    assert not pdl.waits_first(src, _parameter_list(src, "late")[1])
    assert not pdl.waits_first(src, _parameter_list(src, "none")[1])


def _opted_in_sm90():
    """(config, kernel name) of the families that begin their kernels with the wait, on sm_90:
    the decode heuristic's configs at d128 (each mode, loader and merge) and the merge, matmul
    tiles (plain, split-K, stream-K, cluster-K), fp8 matmul, the staging copy and the GEMV, the
    row ops' backward for widths that reach each row class (lane groups, a block, a cluster, two
    passes) and cross-entropy - mostly configs other tests compile as well."""
    from rtkernels.ops import attention_kvcache as kv
    from rtkernels.ops import cross_entropy, gemv, matmul_fp8
    from rtkernels.ops import rowwise_bwd as rb
    from rtkernels.ops.attention_merge import AttentionMergeConfig
    from rtkernels.ops.matmul import PadRowsConfig
    from rtkernels.ops.matmul_sm90 import MatmulSm90Config
    out = []
    for cfg in kv.heuristic_configs("sm_90", dtypes=("bfloat16",), head_dims=(128,)):
        out += [(cfg, name) for name in cfg.kernels]
    out.append((AttentionMergeConfig(), "attention_merge"))
    out += [(MatmulSm90Config(), "matmul_sm90"), (MatmulSm90Config(split_k=4), "matmul_sm90"),
            (MatmulSm90Config(stream_k=True), "matmul_sm90"),
            (MatmulSm90Config(block_n=64, cluster_k=2, b_kmajor=True), "matmul_sm90"),
            (matmul_fp8.MatmulFp8Config(), "matmul_fp8_sm90"), (PadRowsConfig(), "pad_rows"),
            (gemv.QuantGemvConfig(), "quant_gemv"), (gemv.QuantGemvConfig(), "quant_dequantize"),
            (gemv.QuantGemvConfig(x_half=True), "quant_gemv"), (gemv.QuantGemvConfig(x_half=True), "quant_gemv_xhalf"),
            (gemv.QuantGemvConfig(x_half=True, x_shared=True, group_size=128, has_zeros=True, weight_dtype="uint8"),
             "quant_gemv")]
    for n in (1024, 4096, 16384, 262144):
        out += [(rb.plan_bwd("softmax_bwd", n, "bfloat16", 8, "sm_90"), name)
                for name in ("softmax_bwd_rows", "log_softmax_bwd_rows")]
        for layer in (False, True):
            cfg = rb.plan_bwd("norm_bwd", n, "bfloat16", 8, "sm_90", layer=layer)
            op = "layernorm" if layer else "rmsnorm"
            out += [(cfg, name) for name in (f"{op}_bwd_rows", f"{op}_bwd_rows_recompute", "norm_bwd_colsum")]
    out += [(cross_entropy.plan(50257, "bfloat16", 8, "sm_90", grad=True), name)
            for name in ("cross_entropy_rows", "cross_entropy_count", "cross_entropy_reduce")]
    return out


def test_pdl_kernels_wait_before_any_global_access():
    """Every kernel of the opted-in families is PDL-ready, and in its SASS the wait (ACQBULK)
    comes before its first global memory instruction: a PDL launch may start it while the kernel
    before it still runs."""
    seen, bad = set(), []
    for cfg, name in _opted_in_sm90():
        if (cfg, name) in seen:
            continue
        seen.add((cfg, name))
        k = rtk.get_kernel(cfg, name, arch="sm_90")
        if not k.pdl:
            bad.append((cfg.key(), name, "not PDL-ready"))
            continue
        wait, access = _first(_WAIT, k.sass), _first(_GLOBAL_ACCESS, k.sass)
        if wait is None or (access is not None and access < wait):
            bad.append((cfg.key(), name, f"wait at SASS line {wait}, first global access at {access}"))
    assert len(seen) > 60 and bad == []


def test_other_kernels_launch_plainly():
    """Families left out on purpose launch as before: the forward row ops, the attention forward
    and backward and AdamW, where host time per call is what small calls pay (tools/bench_host.py)
    and a long kernel gains nothing from a 1 us earlier start; and user templates."""
    from rtkernels.ops import rowwise as rw
    from rtkernels.ops import attention_sm90 as s90
    plain = rtk.compile("vector_add", dtype="float32", block_size=256)
    assert not plain.pdl and plain.report()["pdl"] is False
    assert not rtk.get_kernel(rw.plan("softmax", 4096, "bfloat16", 8, "sm_90"), "softmax_rows", arch="sm_90").pdl
    assert not rtk.get_kernel(s90.choose_config("bfloat16", 128, True), arch="sm_90").pdl


def test_user_template_that_waits_first_is_pdl_ready():
    src = ('#include "rtk/common.cuh"\n'
           'extern "C" __global__ void scale(float* x, int n) {\n'
           '    rtk::grid_dependency_wait();\n'
           '    int i = blockIdx.x * blockDim.x + threadIdx.x;\n'
           '    if (i < n) x[i] *= {{ factor }};\n}\n')
    k = rtk.compile(rtk.Template(src), kernel="scale", factor=2.0, arch="sm_90")
    assert k.pdl and "ACQBULK" in k.sass and k.report()["pdl"] is True
    late = rtk.compile(rtk.Template(src.replace("    rtk::grid_dependency_wait();\n", "").replace(
        "x[i] *= {{ factor }};", "{ rtk::grid_dependency_wait(); x[i] *= {{ factor }}; }")), kernel="scale",
        factor=2.0, arch="sm_90")
    assert not late.pdl   # a wait that is not the body's first statement does not count


def test_set_enabled_round_trip():
    prev = pdl.set_enabled(False)
    try:
        assert not pdl.enabled()
    finally:
        pdl.set_enabled(prev)
    assert pdl.enabled() == prev


# ---- the launch itself, against a stand-in for the driver call (no GPU) ------------------

class _Driver:
    """cuda.bindings' driver with cuLaunchKernelEx replaced: each call records its configuration and
    reads back the bytes its kernelParams point at (while the launch's holders are alive)."""

    def __init__(self, real, sizes, result=0):
        self.real, self.sizes, self.result, self.calls = real, sizes, result, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def cuLaunchKernelEx(self, cfg, f, params, extra):
        import ctypes
        addrs = (ctypes.c_int64 * len(self.sizes)).from_address(params) if self.sizes else []
        self.calls.append({"grid": (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ),
                           "block": (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ), "smem": cfg.sharedMemBytes,
                           "stream": int(cfg.hStream), "attrs": [int(a.id) for a in cfg.attrs][:cfg.numAttrs],
                           "f": int(f), "bytes": [ctypes.string_at(a, n) for a, n in zip(addrs, self.sizes)]})
        return (self.real.CUresult(self.result),)

    def cuGetErrorName(self, err):
        return self.real.CUresult.CUDA_SUCCESS, err.name.encode()


class _CupyFunction:
    """What CuPy's Function would have been called with (the plain and the fallback launches)."""
    ptr = 0xF00D
    name = "stand_in"

    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, shared_mem, stream, enable_cooperative_groups=False):
        self.calls.append(("call", grid, block, args, shared_mem, stream, enable_cooperative_groups))

    def linear_launch(self, size, args, shared_mem, block_max_size, stream, enable_cooperative_groups=False):
        self.calls.append(("linear", size, args, shared_mem, block_max_size, stream, enable_cooperative_groups))


class _StreamArg:
    ptr = 0x5EED


@pytest.fixture
def stand_in(monkeypatch):
    """(PdlFunction over a stand-in CuPy function, the stand-in driver factory)."""
    pdl._lookups()
    real = pdl._drv

    def driver(sizes, result=0):
        d = _Driver(real, sizes, result)
        monkeypatch.setattr(pdl, "_drv", d)
        return d
    fn = _CupyFunction()
    monkeypatch.setattr(pdl, "_ENABLED", [True])
    return pdl.PdlFunction(fn), fn, driver


def test_pdl_launch_passes_each_argument_as_cupy_would(stand_in):
    import cupy
    from cupy.cuda.function import CIntptr
    pf, fn, driver = stand_in
    mem = cupy.cuda.UnownedMemory(0x7F0000001000, 4096, None, device_id=0)
    x = cupy.ndarray((256,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    record = np.frombuffer(bytes(range(24)), dtype=np.dtype([("a", "<u8", 3)]))[0]
    args = (x, CIntptr(7), None, np.float32(2.5), 3, -1.5, True, record, np.int32(-9))
    sizes = [8, 8, 8, 4, 8, 8, 1, 24, 4]
    d = driver(sizes)
    pf.linear_launch(1000, args, 64, 256, _StreamArg())
    (call,) = d.calls
    assert call["grid"] == (4, 1, 1) and call["block"] == (256, 1, 1) and call["smem"] == 64
    assert call["stream"] == 0x5EED and call["f"] == 0xF00D and call["attrs"] == [6]
    want = [np.int64(0x7F0000001000).tobytes(), np.int64(7).tobytes(), bytes(8), np.float32(2.5).tobytes(),
            np.int64(3).tobytes(), np.float64(-1.5).tobytes(), b"\x01", bytes(range(24)), np.int32(-9).tobytes()]
    assert call["bytes"] == want
    assert fn.calls == []


def test_pdl_launch_grids_cooperation_and_refusals(stand_in):
    from rtkernels.errors import LaunchError
    pf, fn, driver = stand_in
    d = driver([])
    pf((3, 2), (128,), (), 0, _StreamArg())
    pf([5], 64, (), 0, _StreamArg(), enable_cooperative_groups=True)
    assert [(c["grid"], c["block"], c["attrs"]) for c in d.calls] == [
        ((3, 2, 1), (128, 1, 1), [6]), ((5, 1, 1), (64, 1, 1), [6, 2])]
    # a driver that refuses both attributes together: CuPy's cooperative launch, then and from then on
    d = driver([], result=int(d.real.CUresult.CUDA_ERROR_NOT_SUPPORTED))
    s = _StreamArg()
    pf((8,), (32,), (), 16, s, enable_cooperative_groups=True)
    pf((8,), (32,), (), 16, s, enable_cooperative_groups=True)
    assert len(d.calls) == 1 and [c[-1] for c in fn.calls] == [True, True] and fn.calls[0][5] is s
    # any other error names the kernel, the launch and the driver's error
    d = driver([], result=int(d.real.CUresult.CUDA_ERROR_INVALID_VALUE))
    with pytest.raises(LaunchError, match=r"stand_in: .*grid=\(2, 1, 1\).*CUDA_ERROR_INVALID_VALUE"):
        pf((2,), (32,), (), 0, s)
    # switched off: every launch is CuPy's own
    prev = pdl.set_enabled(False)
    try:
        pf.linear_launch(64, (), 0, 64, s)
    finally:
        pdl.set_enabled(prev)
    assert fn.calls[-1][0] == "linear" and len(d.calls) == 1


# ---- GPU --------------------------------------------------------------------------------

_PRODUCER = r'''
extern "C" __global__ void produce(float* x, long long n, long long spin_ns, const float* seed_at) {
    // let dependents start now: only their own griddepcontrol.wait orders them after this kernel
    asm volatile("griddepcontrol.launch_dependents;");
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1)); } while (t1 - t0 < (unsigned long long)spin_ns);
    const float seed = *seed_at;
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = sinf(seed * (float)(i % 9973)) * 4.f;
}
'''


def _producer():
    import cupy as cp
    return cp.RawModule(code=_PRODUCER, options=("-arch=sm_90",)).get_function("produce")


def _dx64(dy, y, cols):
    """float64 softmax backward of what the producer wrote (checked first: no NaN left)."""
    from rtkernels.ops.rowwise_bwd import softmax_backward_reference
    y = y.get().astype(np.float64).reshape(-1, cols)
    assert not np.isnan(y).any()
    return softmax_backward_reference(dy.get().astype(np.float64).reshape(-1, cols), y)


def _close(got, ref):
    """float32 sums over a row: dx = y * (dy - sum(dy * y)) cancels against sums of ~|y| * sqrt(n)
    (y is the producer's +-4 pattern, not a softmax), so the error scales with the row's largest dx."""
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def _check_produced(x, seed):
    i = np.arange(x.size, dtype=np.int64)
    want = np.sin(np.float32(seed) * (i % 9973).astype(np.float32)).astype(np.float64) * 4
    np.testing.assert_allclose(x.get().astype(np.float64), want, atol=1e-4)


def _needs_sm90():
    import cupy as cp
    if cp.cuda.Device().compute_capability < "90":
        pytest.skip("programmatic dependent launch needs sm_90+")


@pytest.mark.gpu
def test_gpu_pdl_function_on_sm90():
    import cupy as cp
    from rtkernels.device import current_arch
    from rtkernels.ops import rowwise_bwd as rb
    _needs_sm90()
    y = cp.zeros((4, 1000), cp.float32)
    rtk.softmax_backward(y, y)
    k = rtk.get_kernel(rb.plan_bwd("softmax_bwd", 1000, "float32", 4, current_arch()), "softmax_bwd_rows")
    assert k.pdl and isinstance(k.function(), pdl.PdlFunction)
    assert not isinstance(rtk.compile("vector_add", dtype="float32", block_size=256).function(), pdl.PdlFunction)


@pytest.mark.gpu
@pytest.mark.parametrize("on", [True, False])
def test_gpu_pdl_kernel_waits_for_an_early_triggering_producer(on):
    """softmax_backward (PDL-ready) right behind a producer that triggers its dependents at once and
    writes its output only after 200 us: without the kernel's wait it would read the NaN input."""
    import cupy as cp
    _needs_sm90()
    produce = _producer()
    rng = np.random.default_rng()
    prev = pdl.set_enabled(on)
    try:
        for seed, (rows, cols) in ((0.37, (300, 1000)), (1.91, (4096, 257)), (2.53, (7, 65536))):
            n = rows * cols
            y = cp.full(n, np.nan, cp.float32)
            dy = cp.asarray(rng.standard_normal((rows, cols)).astype(np.float32))
            dx = cp.full((rows, cols), np.nan, cp.float32)
            produce((8,), (256,), (y, np.int64(n), np.int64(200_000), cp.full(1, seed, cp.float32)))
            rtk.softmax_backward(dy, y.reshape(rows, cols), out=dx)
            got = dx.get().astype(np.float64)
            assert not np.isnan(got).any()
            _check_produced(y, seed)
            _close(got, _dx64(dy, y, cols))
    finally:
        pdl.set_enabled(prev)


@pytest.mark.gpu
def test_gpu_pdl_in_a_cuda_graph():
    """The producer and two PDL kernels captured in a CuPy graph (programmatic edges), replayed
    with new producer seeds written into the graph's input: every replay reads the new values."""
    import cupy as cp
    from gpu_util import capture_cupy
    _needs_sm90()
    produce = _producer()
    rows, cols = 512, 3000
    n = rows * cols
    y = cp.empty(n, cp.float32)
    dy = cp.asarray(np.random.default_rng().standard_normal((rows, cols)).astype(np.float32))
    dx = cp.empty((rows, cols), cp.float32)
    dx2 = cp.empty((rows, cols), cp.float32)
    seed = cp.full(1, 0.61, cp.float32)
    y2 = y.reshape(rows, cols)
    rtk.softmax_backward(dy, y2, out=dx)   # plans made before the capture
    rtk.softmax_backward(dx, y2, out=dx2)
    s = cp.cuda.Stream(non_blocking=True)

    def step():
        produce((8,), (256,), (y, np.int64(n), np.int64(100_000), seed), stream=s)
        rtk.softmax_backward(dy, y2, out=dx, stream=s)
        rtk.softmax_backward(dx, y2, out=dx2, stream=s)

    with s:
        g = capture_cupy(s, step)
    for value in (1.37, 0.23, 2.9):
        seed.fill(value)
        dx.fill(np.nan)
        dx2.fill(np.nan)
        cp.cuda.Device().synchronize()
        g.launch(s)
        s.synchronize()
        _check_produced(y, value)
        ref = _dx64(dy, y, cols)
        _close(dx.get(), ref)
        _close(dx2.get(), _dx64(dx, y, cols))


@pytest.mark.gpu
def test_gpu_cooperative_pdl_launch_is_taken():
    """The norm backward's folded column sums (a cooperative grid with a grid barrier) launch with
    both attributes - the driver took them (no fallback recorded) - and give the reference."""
    import cupy as cp
    from gpu_util import random_array, to_f64
    from rtkernels.device import current_arch
    from rtkernels.ops import rowwise_bwd as rb
    _needs_sm90()
    rng = np.random.default_rng()
    rows, n = 3000, 4096
    cfg = rb.plan_bwd("norm_bwd", n, "bfloat16", 8, current_arch(), layer=True)
    assert cfg.fold_colsum
    dy, dyh = random_array(rng, (rows, n), "bfloat16")
    x, xh = random_array(rng, (rows, n), "bfloat16")
    w, wh = random_array(rng, (n,), "bfloat16")
    produce = _producer()
    scratch = cp.empty(1 << 20, cp.float32)
    produce((8,), (256,), (scratch, np.int64(scratch.size), np.int64(100_000), cp.full(1, 0.5, cp.float32)))
    dx, dw, db = rtk.layernorm_backward(dy, x, w, w, dtype="bfloat16")
    dev = cp.cuda.runtime.getDevice()
    fns = [rtk.get_kernel(cfg, name)._functions.get(dev)
           for name in ("layernorm_bwd_rows", "layernorm_bwd_rows_recompute")]
    fns = [f for f in fns if f is not None]
    assert fns and all(isinstance(f, pdl.PdlFunction) and not f._coop_refused for f in fns)
    rdx, rdw, rdb = rb.layernorm_backward_reference(dyh, xh, wh)
    np.testing.assert_allclose(to_f64(dx, "bfloat16"), rdx, rtol=2e-2, atol=2e-2 * np.abs(rdx).max())
    np.testing.assert_allclose(to_f64(dw, "bfloat16"), rdw, rtol=2e-2, atol=2e-2 * np.abs(rdw).max())
    np.testing.assert_allclose(to_f64(db, "bfloat16"), rdb, rtol=2e-2, atol=2e-2 * np.abs(rdb).max())
