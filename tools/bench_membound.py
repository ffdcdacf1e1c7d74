"""Memory-bound ops at the bandwidth roof: softmax, RMSNorm, LayerNorm, row reductions.

GB/s = (bytes of x read once + bytes of y written once) / time, for rtkernels, CuPy's composed
ops and torch (softmax / layer_norm / rms_norm) side by side, against the device-to-device
copy bandwidth measured in the same run.  Widths 1k .. 256k, rows chosen so x holds >= 64 MiB
(x plus y exceed the 50 MiB L2, and two input sets alternate).  Run on a GPU host:

    PYTHONPATH=. python tools/bench_membound.py [--out DIR] [--quick] [--sweep] [--dtypes float16,bfloat16]

--sweep also times the alternative block / cluster / two-pass configs per width and prints which
one wins (what the heuristics table in rtkernels/ops/rowwise.py should say).
Targets (issue 7): >= 85% of copy bandwidth at 4k-64k for softmax, rmsnorm, layernorm;
>= 1.5x CuPy's composed softmax.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import benchutil  # noqa: E402

WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
QUICK_WIDTHS = (1024, 4096, 16384, 65536, 262144)
DATA_BYTES = 64 << 20


def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _inputs(cp, rows, n, dtype, sets=2):
    """`sets` (x, y) pairs; bfloat16 as uint16 bits of normal values."""
    out = []
    for s in range(sets):
        x = cp.random.standard_normal((rows, n), dtype=cp.float32)
        if dtype == "bfloat16":
            x = (x.view(cp.uint32) >> 16).astype(cp.uint16)
        else:
            x = x.astype(dtype)
        out.append((x, cp.empty_like(x)))
    return out


def _as_torch(torch, a, dtype):
    t = torch.from_dlpack(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def _peers(op, dtype, n, cp, torch):
    """name -> fn(x, y) for the peers that exist for this op and dtype."""
    peers = {}
    eps = 1e-6 if op == "rmsnorm" else 1e-5
    w = cp.ones(n, dtype=np.float32 if dtype == "bfloat16" else dtype)
    b = cp.zeros_like(w)
    if dtype != "bfloat16":   # CuPy has no bfloat16
        if op == "softmax":
            def cupy_softmax(x, y):
                e = cp.exp(x - x.max(axis=-1, keepdims=True))
                cp.divide(e, e.sum(axis=-1, keepdims=True), out=y)
            peers["cupy"] = cupy_softmax
        elif op == "rmsnorm":
            def cupy_rms(x, y):
                ms = cp.mean(cp.square(x, dtype=np.float32), axis=-1, keepdims=True)
                cp.multiply(x * cp.reciprocal(cp.sqrt(ms + eps)).astype(x.dtype), w, out=y)
            peers["cupy"] = cupy_rms
        elif op == "layernorm":
            def cupy_ln(x, y):
                xf = x.astype(np.float32)
                mu = xf.mean(axis=-1, keepdims=True)
                var = cp.square(xf - mu).mean(axis=-1, keepdims=True)
                cp.add((xf - mu) * cp.reciprocal(cp.sqrt(var + eps)) * w, b, out=y, casting="unsafe")
            peers["cupy"] = cupy_ln
        elif op in ("sum", "max", "argmax"):
            peers["cupy"] = lambda x, y, _op=op: getattr(x, _op)(axis=-1)
    if torch is not None:
        F = torch.nn.functional
        tw = torch.ones(n, device="cuda", dtype=getattr(torch, dtype))
        tb = torch.zeros_like(tw)
        cache = {}

        def tt(a):   # memoized DLPack views (no per-call conversion cost in the timing)
            k = a.data.ptr
            if k not in cache:
                cache[k] = _as_torch(torch, a, dtype)
            return cache[k]
        if op == "softmax":
            peers["torch"] = lambda x, y: torch.softmax(tt(x), -1)
        elif op == "rmsnorm" and hasattr(F, "rms_norm"):
            peers["torch"] = lambda x, y: F.rms_norm(tt(x), (n,), tw, eps)
        elif op == "layernorm":
            peers["torch"] = lambda x, y: F.layer_norm(tt(x), (n,), tw, tb, eps)
        elif op in ("sum", "max", "argmax"):
            peers["torch"] = lambda x, y, _op=op: (tt(x).float().sum(-1) if _op == "sum" else
                                                   tt(x).amax(-1) if _op == "max" else tt(x).argmax(-1))
    return peers


def _ours(op, dtype, n, cp, rtk, config=None):
    w = cp.ones(n, dtype=np.uint16 if dtype == "bfloat16" else dtype)
    if dtype == "bfloat16":
        w.fill(0x3F80)   # 1.0 in bfloat16 bits
    b = cp.zeros_like(w)
    kw = dict(dtype=dtype)
    if config is not None:
        kw["config"] = config
    if op == "softmax":
        return lambda x, y: rtk.softmax(x, out=y, **kw)
    if op == "rmsnorm":
        return lambda x, y: rtk.rmsnorm(x, w, out=y, **kw)
    if op == "layernorm":
        return lambda x, y: rtk.layernorm(x, w, b, out=y, **kw)
    outs = {}

    def red(x, y, _op=op):
        o = outs.get(x.data.ptr)
        if o is None:
            o = outs[x.data.ptr] = cp.empty(x.shape[0], dtype=np.int64 if _op == "argmax" else x.dtype)
        return rtk.reduce(x, op=_op, out=o, **kw)
    return red


def _sweep_configs(op, dtype, n, arch):
    """Alternatives to the heuristic: every block size with the cluster it needs, and two-pass."""
    from rtkernels import dtypes
    from rtkernels.ops import rowwise as rw
    size = dtypes.itemsize(dtype)
    vec = 16 // size
    family = "softmax" if op == "softmax" else "norm"
    elems = rw._ELEMS_PER_THREAD[family][size]
    vmax = max(1, elems // vec)
    nvec = n // vec
    extra = {"weight_dtype": dtype} if family == "norm" else {}
    cls = rw.SoftmaxConfig if family == "softmax" else rw.NormConfig
    out = []
    for block in (128, 256, 512, 1024):
        if op == "layernorm" and block > 512:
            continue
        for v in sorted({vmax, max(1, vmax // 2), vmax * 2}):
            threads = -(-nvec // v)
            cluster = max(1, rw._pow2_ceil(-(-threads // block)))
            if cluster > 8 or (cluster > 1 and rw._arch_number(arch) < 90) or v * vec > 64:
                continue
            out.append(cls(dtype=dtype, vec=vec, threads_per_row=block, block_size=block, vecs_per_thread=v,
                           cluster_size=cluster, **extra))
        out.append(cls(dtype=dtype, vec=vec, threads_per_row=block, block_size=block, vecs_per_thread=vmax,
                       two_pass=True, **extra))
    return out


def main():
    p = benchutil.parser(__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="also time alternative configs per width")
    p.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated: float16,bfloat16,float32")
    p.add_argument("--ops", default="softmax,rmsnorm,layernorm,sum,argmax")
    args = p.parse_args()
    import cupy as cp
    import rtkernels as rtk
    from rtkernels import device, dtypes
    from rtkernels.ops import rowwise as rw
    if not all(hasattr(rtk, f) for f in ("softmax", "rmsnorm", "layernorm", "reduce")):
        rtk = rw   # before rtkernels/ops/__init__.py imports rowwise
    torch = _torch()
    t_start = time.time()
    env = benchutil.environment()
    copy_gbs = benchutil.copy_bandwidth(1 << 30)
    arch = device.current_arch()
    widths = QUICK_WIDTHS if args.quick else WIDTHS
    repeat = 10 if args.quick else 20
    rows_out, sweep_out = [], []
    for dtype in args.dtypes.split(","):
        size = dtypes.itemsize(dtype)
        for op in args.ops.split(","):
            reduce_op = op in ("sum", "max", "min", "argmax")
            for n in widths:
                rows = max(1, DATA_BYTES // (n * size))
                sets = _inputs(cp, rows, n, dtype)
                out_bytes = rows * (8 if op == "argmax" else size) if reduce_op else rows * n * size
                nbytes = rows * n * size + out_bytes
                row = {"dtype": dtype, "op": op, "n": n, "rows": rows, "MiB": round(nbytes / 2 ** 20)}
                fns = {"rtk": _ours(op, dtype, n, cp, rtk)}
                fns.update(_peers(op, dtype, n, cp, torch))
                for name, fn in fns.items():
                    try:
                        ms = benchutil.time_cuda(fn, warmup=3, repeat=repeat, inputs=sets)
                        row[f"{name}_GBs"] = nbytes / (ms * 1e-3) / 1e9
                    except Exception as exc:   # a peer missing a feature must not sink the run
                        row[f"{name}_GBs"] = float("nan")
                        row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
                row["rtk_%copy"] = 100 * row["rtk_GBs"] / copy_gbs
                for peer in ("cupy", "torch"):
                    if row.get(f"{peer}_GBs"):
                        row[f"x_{peer}"] = row["rtk_GBs"] / row[f"{peer}_GBs"]
                if not reduce_op:
                    cfg = rw._config_for("softmax" if op == "softmax" else "norm", None, n, dtype,
                                         16 // size, rows, op, weight_dtype=dtype if op != "softmax" else None,
                                         layer=op == "layernorm")
                    row["config"] = f"{cfg.row_class} b{cfg.block_size} v{cfg.vecs_per_thread} c{cfg.cluster_size}"
                    if args.sweep and 4096 <= n <= 65536:
                        best = None
                        for alt in _sweep_configs(op, dtype, n, arch):
                            try:
                                ms = benchutil.time_cuda(_ours(op, dtype, n, cp, rtk, alt), warmup=2,
                                                         repeat=10, inputs=sets)
                            except Exception as exc:
                                sweep_out.append({"op": op, "dtype": dtype, "n": n, "config": alt.key(),
                                                  "error": str(exc)[:200]})
                                continue
                            gbs = nbytes / (ms * 1e-3) / 1e9
                            sweep_out.append({"op": op, "dtype": dtype, "n": n, "config": alt.key(), "GBs": gbs})
                            if best is None or gbs > best[0]:
                                best = (gbs, f"{alt.row_class} b{alt.block_size} v{alt.vecs_per_thread} "
                                             f"c{alt.cluster_size}")
                        if best:
                            row["best_GBs"], row["best_config"] = best
                rows_out.append(row)
                del sets
                cp.get_default_memory_pool().free_all_blocks()
                print(f"{dtype} {op} n={n}: rtk {row['rtk_GBs']:.0f} GB/s ({row['rtk_%copy']:.0f}% of copy)",
                      flush=True)
    payload = {"environment": env, "copy_GBs": copy_gbs, "results": rows_out, "sweep": sweep_out,
               "seconds": time.time() - t_start}
    path = benchutil.save(args.out, "bench_membound", payload)
    for dtype in args.dtypes.split(","):
        series = {}
        for op in args.ops.split(","):
            rs = [r for r in rows_out if r["dtype"] == dtype and r["op"] == op]
            series[f"rtk {op}"] = ([r["n"] for r in rs], [r["rtk_GBs"] for r in rs])
            for peer in ("cupy", "torch"):
                if any(r.get(f"{peer}_GBs") == r.get(f"{peer}_GBs") and r.get(f"{peer}_GBs") for r in rs):
                    series[f"{peer} {op}"] = ([r["n"] for r in rs], [r.get(f"{peer}_GBs", float("nan")) for r in rs])
        xs = list(widths)
        series["device copy"] = (xs, [copy_gbs] * len(xs))
        benchutil.plot(args.out, f"bench_membound_{dtype}", series, "row width (elements)", "GB/s",
                       f"{env['gpu']} {dtype}: memory-bound row ops")
    cols = ["dtype", "op", "n", "rows", "rtk_GBs", "rtk_%copy", "cupy_GBs", "x_cupy", "torch_GBs", "x_torch",
            "config"] + (["best_GBs", "best_config"] if args.sweep else [])
    print(f"\n{env['gpu']} ({env['arch']}, {env['date']}): device copy {copy_gbs:.0f} GB/s; "
          f"JSON {path}; {time.time() - t_start:.0f} s")
    print(benchutil.table(rows_out, cols))


if __name__ == "__main__":
    main()
