"""Core benchmark: launch overhead against CuPy RawKernel, elementwise bandwidth against the
device copy, compile and disk-cache load times.  Run on a GPU host:

    PYTHONPATH=. python tools/bench_core.py --out results/
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402


NOOP = 'extern "C" __global__ void noop(float* p, int n) { if (threadIdx.x == 0 && n < 0) p[0] = 1.f; }'


def launch_overhead(calls: int) -> list[dict]:
    import cupy as cp
    import rtkernels as rtk
    p = cp.zeros(1, cp.float32)
    raw = cp.RawKernel(NOOP, "noop")
    k = rtk.compile(rtk.Template(NOOP))
    n32 = cp.int32(1)
    rows = []
    # interleave so clock or queue drift affects both alike; 7 rounds each, min and median reported
    res = {"cupy.RawKernel": [], "rtk Kernel.launch": []}
    for _ in range(7):
        res["cupy.RawKernel"].append(bu.time_host(lambda: raw((1,), (32,), (p, n32)), calls))
        res["rtk Kernel.launch"].append(bu.time_host(lambda: k.launch((1,), (32,), p, 1), calls))
    x = cp.ones(1024, cp.float32)
    f = rtk.elementwise("y = 2*x + 1")
    y = cp.empty_like(x)
    ek = cp.ElementwiseKernel("float32 x", "float32 y", "y = 2*x + 1", "bench_axpb")
    res["cupy.ElementwiseKernel (1k)"] = [bu.time_host(lambda: ek(x, y), calls) for _ in range(3)]
    res["rtk.elementwise (1k)"] = [bu.time_host(lambda: f(x, out=y), calls) for _ in range(3)]
    import statistics
    for name, v in res.items():
        rows.append({"what": name, "us_per_call": min(v), "median_us": statistics.median(v)})
    return rows


def bandwidth(copy_gbs: float, quick: bool) -> list[dict]:
    import cupy as cp
    import rtkernels as rtk
    rows = []
    n = 1 << (26 if quick else 28)
    cases = [
        ("y = 2*x + 1", "float32", lambda x: 2 * x + 1, 2),
        ("y = 2*x + 1", "float16", lambda x: 2 * x + 1, 2),
        ("y = gelu(x)", "bfloat16", None, 2),
        ("y = sin(x)*sin(x) + cos(x)*cos(x)", "float32", lambda x: cp.sin(x) * cp.sin(x) + cp.cos(x) * cp.cos(x), 2),
        ("z = x + w", "float32", None, 3),
    ]
    for expr, dtype, composed, narrays in cases:
        store = "uint16" if dtype == "bfloat16" else dtype
        xs = [cp.random.standard_normal(n, dtype=cp.float32).astype(store) for _ in range(narrays - 1)]
        out = cp.empty(n, dtype=store)
        f = rtk.elementwise(expr)
        nbytes = narrays * n * out.itemsize
        ms = bu.time_cuda(lambda: f(*xs, out=out, dtype=dtype))
        row = {"expr": expr, "dtype": dtype, "n": n, "rtk_GBs": nbytes / ms / 1e6}
        row["pct_of_copy"] = 100 * row["rtk_GBs"] / copy_gbs
        if composed is not None and dtype != "bfloat16":
            cms = bu.time_cuda(lambda: composed(xs[0]))
            row["cupy_composed_GBs"] = nbytes / cms / 1e6
            row["speedup_vs_cupy"] = cms / ms
        rows.append(row)
    a = cp.random.standard_normal(n, dtype=cp.float32)
    b = cp.random.standard_normal(n, dtype=cp.float32)
    c = cp.empty_like(a)
    k = rtk.compile("vector_add", dtype="float32")
    ms = bu.time_cuda(lambda: k.launch(((n + 255) // 256,), (256,), a, b, c, n))
    rows.append({"expr": "vector_add (1 elem/thread)", "dtype": "float32", "n": n, "rtk_GBs": 3 * n * 4 / ms / 1e6,
                 "pct_of_copy": 100 * 3 * n * 4 / ms / 1e6 / copy_gbs})
    return rows


def sweep(copy_gbs: float, quick: bool) -> list[dict]:
    """Tuning sweep of the elementwise knobs on memory-bound expressions (feeds the heuristics)."""
    import itertools
    import cupy as cp
    import rtkernels as rtk
    n = 1 << (26 if quick else 28)
    rows = []
    for expr, dtype, narr in (("y = 2*x + 1", "float32", 2), ("y = 2*x + 1", "float16", 2), ("z = x + w", "float32", 3)):
        xs = [cp.random.standard_normal(n, dtype=cp.float32).astype(dtype) for _ in range(narr - 1)]
        out = cp.empty(n, dtype=dtype)
        nbytes = narr * n * out.itemsize
        for unroll, block, waves, streaming in itertools.product((1, 2, 4, 8), (128, 256, 512), (1, 2, 4, 0),
                                                                 (False, True)):
            f = rtk.elementwise(expr, unroll=unroll, block_size=block, grid_waves=waves, streaming=streaming)
            ms = bu.time_cuda(lambda: f(*xs, out=out), repeat=10)
            rows.append({"expr": expr, "dtype": dtype, "unroll": unroll, "block": block, "waves": waves,
                         "streaming": streaming, "GBs": nbytes / ms / 1e6, "pct_of_copy": 100 * nbytes / ms / 1e6 / copy_gbs})
    return rows


def compile_times() -> dict:
    import rtkernels as rtk
    from rtkernels import cache
    src = NOOP.replace("noop", "noop_" + uuid.uuid4().hex[:8])
    t0 = time.perf_counter()
    rtk.compile(rtk.Template(src))
    cold = time.perf_counter() - t0
    cache.clear_memory()
    t0 = time.perf_counter()
    k = rtk.compile(rtk.Template(src))
    k.function()
    warm = time.perf_counter() - t0
    return {"cold_compile_s": cold, "warm_disk_load_s": warm}


def main():
    ap = bu.parser(__doc__)
    ap.add_argument("--no-sweep", action="store_true", help="skip the elementwise tuning sweep")
    args = ap.parse_args()
    os.environ.setdefault("RTKERNELS_CACHE_DIR", tempfile.mkdtemp(prefix="rtk-bench-cache-"))
    env = bu.environment()
    copy_gbs = bu.copy_bandwidth()
    over = launch_overhead(5000 if args.quick else 20000)
    bw = bandwidth(copy_gbs, args.quick)
    ct = compile_times()
    sw = [] if args.no_sweep else sweep(copy_gbs, args.quick)
    bu.save(args.out, "bench_core", {"env": env, "copy_GBs": copy_gbs, "launch": over, "bandwidth": bw,
                                     "compile": ct, "sweep": sw})
    for key in sorted({(r["expr"], r["dtype"]) for r in sw}):
        best = sorted((r for r in sw if (r["expr"], r["dtype"]) == key), key=lambda r: -r["GBs"])[:4]
        print(bu.table(best, ["expr", "dtype", "unroll", "block", "waves", "streaming", "GBs", "pct_of_copy"]))
    print(f"\n{env['gpu']} ({env['arch']}, {env['sms']} SMs), driver {env['driver']}, NVRTC {env['nvrtc']}, "
          f"{env['date']}; device copy {copy_gbs:.0f} GB/s")
    print(bu.table(over, ["what", "us_per_call", "median_us"]))
    print(bu.table(bw, ["expr", "dtype", "rtk_GBs", "pct_of_copy", "cupy_composed_GBs", "speedup_vs_cupy"]))
    print(f"cold compile {ct['cold_compile_s'] * 1e3:.0f} ms, warm disk load {ct['warm_disk_load_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
