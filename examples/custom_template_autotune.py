"""Your own Jinja2 template, with tuned parameters: y = gelu(x + bias) over rows.

    python examples/custom_template_autotune.py            # GPU: time the candidates, keep the fastest, check it
    python examples/custom_template_autotune.py --cpu      # no GPU: render and compile them, show what ptxas made

`templates/bias_gelu.cu.j2` is an ordinary CUDA kernel whose element type, vector width and
block size are Jinja2 parameters.  rtk.compile renders it per parameter set, compiles it with
NVRTC for the exact GPU and caches it; each candidate is then timed with CUDA events on your
data, and the fastest is kept.  The same loop works for any template of yours.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

import rtkernels as rtk

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates", "bias_gelu.cu.j2")
CANDIDATES = [dict(vec=v, block_size=b) for v in (2, 4, 8) for b in (128, 256, 512)]


def build(dtype: str, arch: str | None = None):
    """(params, kernel) for every candidate (compiled on first use, then from the cache)."""
    return [(p, rtk.compile(TEMPLATE, kernel="bias_gelu", arch=arch, dtype=dtype, **p)) for p in CANDIDATES]


def time_ms(fn) -> float:
    """Median GPU milliseconds of ``fn`` (CUDA events around each call, after a warmup)."""
    from cupyx.profiler import benchmark
    return float(np.median(benchmark(fn, n_repeat=20, n_warmup=3).gpu_times)) * 1e3


def launcher(kernel, params, x, bias, y):
    rows, n = x.shape
    if n % params["vec"]:
        return None   # a thread's vector would straddle two rows
    total = rows * n
    threads = -(-total // params["vec"])
    grid = (-(-threads // params["block_size"]),)
    block = (params["block_size"],)
    return lambda: kernel.launch(grid, block, x, bias, y, total, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="render and compile only (no GPU needed)")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--n", type=int, default=4096)
    ns = ap.parse_args()
    dtype = "float16"
    if ns.cpu:
        for p, k in build(dtype, arch="sm_90"):
            r, sass = k.resources, k.report()["sass"]
            loads = ", ".join(f"{sass[f'ldg_{w}']}x{w}-bit" for w in (16, 32, 64, 128) if sass.get(f"ldg_{w}"))
            print(f"vec={p['vec']} block_size={p['block_size']:>3}: {r.registers} registers, "
                  f"{r.spill_stores} B spilled, global loads {loads}")
        return
    import cupy as cp
    x = cp.random.standard_normal((ns.rows, ns.n), dtype=cp.float32).astype(dtype)
    bias = cp.random.standard_normal(ns.n, dtype=cp.float32).astype(dtype)
    y = cp.empty_like(x)
    results = []
    for p, k in build(dtype):
        run = launcher(k, p, x, bias, y)
        if run is not None:
            results.append((time_ms(run), p))
    results.sort(key=lambda r: r[0])
    gbs = lambda ms: 2 * x.nbytes / ms / 1e6   # noqa: E731  (x read, y written; the bias stays in cache)
    for ms, p in results:
        print(f"vec={p['vec']} block_size={p['block_size']:>3}: {ms * 1e3:8.1f} us  {gbs(ms):7.0f} GB/s")
    best_ms, best = results[0]
    launcher(rtk.compile(TEMPLATE, kernel="bias_gelu", dtype=dtype, **best), best, x, bias, y)()
    xf, bf = x.get().astype(np.float64), bias.get().astype(np.float64)
    t = xf[:64] + bf
    ref = 0.5 * t * (1 + np.vectorize(math.erf)(t / math.sqrt(2)))
    err = np.abs(y[:64].get().astype(np.float64) - ref).max()
    print(f"best: vec={best['vec']} block_size={best['block_size']} ({best_ms * 1e3:.1f} us); "
          f"max error {err:.2e} on the first 64 rows (float16 rounding: ~1e-3)")
    sys.exit(0 if err < 1e-2 else 1)


if __name__ == "__main__":
    main()
