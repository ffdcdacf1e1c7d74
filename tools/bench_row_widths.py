"""Row ops at the widths models use: each op's config refitted to the row against the power-of-two
table's config, torch eager in the same rounds.

The row families pick a config per power of two of 16-byte vectors per row and then refit its
threads and vectors per thread to the row's own count (``rowwise.fit_width``, softmax backward:
``rowwise_bwd.plan_bwd``); ``table`` times the config before that refit (``fit=False``) on the same
arrays - and at widths that are not a multiple of 8, for softmax and its backward, the
narrow-vector config those rows took before they were read ragged (16-byte body, scalar edges).
Ops: rms / ln / sm (RMSNorm, LayerNorm, softmax forward: x read, y written) and rmsB / lnB / smB
(their backward from saved statistics or y: dy and x or y read, dx written; the norms' dweight /
dbias too, as torch's autograd peer computes them); ``--ops ce --widths 50257,151936``: cross-entropy
loss + gradient over rows of n logits (read once, dlogits written), torch F.cross_entropy forward +
backward beside it.  64 MiB of x per case (x and y exceed the 50
MiB L2), bf16 (``--dtype``), candidates interleaved over rounds (median), calls queued back to back between two
events (``benchutil.time_queued``); GB/s as % of the same run's 1 GiB device copy.  Widths default
to hidden and FFN sizes of common models (GPT-2 768 / 1280 / 1600, Llama-2 5120 / 11008 / 13824,
Llama-3 14336, Qwen2.5 3584 / 18944, Gemma-2 2304 / 3584 / 4608, DeepSeek-V3 7168) and the powers of
two beside them.

    PYTHONPATH=. python tools/bench_row_widths.py [--widths 768,5120,...] [--ops rms,ln,sm,rmsB,lnB,smB]
        [--out DIR] [--rounds 3]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchutil  # noqa: E402

WIDTHS = (768, 1024, 1280, 1600, 2048, 2304, 2560, 3072, 3584, 4096, 4608, 5120, 6144, 7168, 8192, 11008,
          13824, 14336, 16384, 18944)
OPS = ("rms", "ln", "sm", "rmsB", "lnB", "smB", "ce")
DEFAULT_OPS = OPS[:-1]
X_BYTES = 64 << 20


def _configs(op: str, n: int, arch: str, dtype: str = "bfloat16"):
    """(the op's default config, the one before, what "before" was) for contiguous bf16 rows of n:
    before = the power-of-two table's config (``fit=False``); for softmax and its backward at
    widths that are not a multiple of 8 (rows read ragged since 2026-11-28) the narrow-vector
    config those rows took before (vectors of the largest power of two dividing n)."""
    from rtkernels.ops import rowwise as rw
    from rtkernels.ops import rowwise_bwd as rb
    from rtkernels import dtypes
    full = 16 // dtypes.itemsize(dtype)
    narrow = next(v for v in (8, 4, 2, 1) if v <= full and n % v == 0)
    if op == "ce":   # cross-entropy has read odd vocabularies ragged all along
        from rtkernels.ops import cross_entropy as ce
        return tuple(ce.plan(n, dtype, full, arch, grad=True, ragged=narrow < full, fit=f) for f in (True, False)) \
            + ("table",)
    ragged = narrow < full and n >= 4 * full and op in ("sm", "smB")
    if op in ("rms", "ln", "sm"):
        fam, layer = ("softmax", False) if op == "sm" else ("norm", op == "ln")
        plan = lambda nn, v, f: rw.plan(fam, nn, dtype, v, arch, weight_dtype=dtype,  # noqa: E731
                                        layer=layer, fit=f)
    else:
        fam = "softmax_bwd" if op == "smB" else "norm_bwd"
        plan = lambda nn, v, f: rb.plan_bwd(fam, nn, dtype, v, arch, weight_dtype=dtype,  # noqa: E731
                                            layer=op == "lnB", fit=f)
    if ragged and rw.as_ragged(plan(-(-n // full) * full, full, True)) is not None:
        return rw.as_ragged(plan(-(-n // full) * full, full, True)), plan(n, narrow, True), "narrow"
    return plan(n, narrow, True), plan(n, narrow, False), "table"


def _shape(cfg) -> str:
    s = f"{cfg.cluster_size}x{cfg.threads_per_row}x{cfg.vecs_per_thread}" if cfg.cluster_size > 1 else \
        f"{cfg.threads_per_row}x{cfg.vecs_per_thread}"
    return s + (f" (vec {cfg.vec})" if cfg.vec * (4 if cfg.dtype == "float32" else 2) != 16 else "") + (" 2-pass" if getattr(cfg, "two_pass", False) else "") \
        + (" ragged" if getattr(cfg, "ragged", False) else "")


def bench(args, torch, rtk):
    from rtkernels.ops import rowwise as rw
    F = torch.nn.functional
    arch = rw._arch_info()[0]
    copy_gbs = benchutil.copy_bandwidth()
    rows_out = []
    for n in args.widths:
        tdt = getattr(torch, args.dtype)
        size = torch.tensor([], dtype=tdt).element_size()
        rows = X_BYTES // (size * n)
        x = torch.randn(rows, n, device="cuda", dtype=tdt)
        dy, y, dx = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
        w = torch.randn(n, device="cuda", dtype=tdt)
        b = torch.randn(n, device="cuda", dtype=tdt)
        _, rstd = rtk.rmsnorm(x, w, 1e-6, return_stats=True)
        _, mean, lrstd = rtk.layernorm(x, w, b, 1e-5, return_stats=True)
        ys = rtk.softmax(x)
        target = torch.randint(0, n, (rows,), device="cuda")
        target[::17] = -100
        for op in args.ops:
            call = {"rms": lambda c: rtk.rmsnorm(x, w, 1e-6, out=y, config=c),
                    "ln": lambda c: rtk.layernorm(x, w, b, 1e-5, out=y, config=c),
                    "sm": lambda c: rtk.softmax(x, out=y, config=c),
                    "rmsB": lambda c: rtk.rmsnorm_backward(dy, x, w, rstd, out=dx, config=c),
                    "lnB": lambda c: rtk.layernorm_backward(dy, x, w, b, mean, lrstd, out=dx, config=c),
                    "smB": lambda c: rtk.softmax_backward(dy, ys, out=dx, config=c),
                    "ce": lambda c: rtk.cross_entropy(x, target, return_grad=True, grad_out=dx, config=c)}[op]
            fitted, table, before = _configs(op, n, arch, args.dtype)
            fns = {"rtk": lambda: call(None)}
            if table != fitted:
                fns["table"] = lambda: call(table)
            if op == "ce":   # loss + gradient: the logits read, dlogits written
                xr = x.detach().requires_grad_()

                def torch_ce(xr=xr):
                    xr.grad = None
                    F.cross_entropy(xr, target).backward()
                fns["torch"] = torch_ce
                nbytes = 2 * rows * n * size
            elif op in ("rms", "ln", "sm"):
                fns["torch"] = {"rms": lambda: F.rms_norm(x, (n,), w, 1e-6),
                                "ln": lambda: F.layer_norm(x, (n,), w, b, 1e-5),
                                "sm": lambda: torch.softmax(x, -1)}[op]
                nbytes = 2 * rows * n * size
            else:   # torch's autograd computes what rtk's backward returns (dx, and dweight / dbias)
                xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
                yt, leaves = {"rmsB": lambda: (F.rms_norm(xr, (n,), wr, 1e-6), (xr, wr)),
                              "lnB": lambda: (F.layer_norm(xr, (n,), wr, br, 1e-5), (xr, wr, br)),
                              "smB": lambda: (torch.softmax(xr, -1), (xr,))}[op]()
                fns["torch"] = lambda yt=yt, leaves=leaves: torch.autograd.grad(yt, leaves, dy, retain_graph=True)
                nbytes = 3 * rows * n * size
            t0 = time.perf_counter()
            for fn in fns.values():   # compile / warm outside the timing
                fn()
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            times = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    times[k].append(benchutil.time_queued(fn, [()], warmup=2, repeat=20)[0])
            row = {"op": op, "n": n, "rows": rows, "config": _shape(fitted), "table_config": _shape(table),
                   "before": before, "warm_s": round(warm_s, 2)}
            for k, ts in times.items():
                ms = statistics.median(ts)
                row[f"{k}_us"] = round(ms * 1e3, 2)
                row[f"{k}_%copy"] = round(100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs, 1)
            if "table_%copy" in row:
                row["rtk/table"] = round(row["rtk_%copy"] / row["table_%copy"], 3)
            row["rtk/torch"] = round(row["rtk_%copy"] / row["torch_%copy"], 2)
            rows_out.append(row)
            print(row, flush=True)
    return rows_out, copy_gbs


def main():
    p = benchutil.parser(__doc__)
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    p.add_argument("--ops", default=",".join(DEFAULT_OPS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args()
    args.widths = [int(v) for v in args.widths.split(",")]
    args.ops = args.ops.split(",")
    for op in args.ops:
        if op not in OPS:
            p.error(f"--ops: {op!r} is not one of {', '.join(OPS)}")
    import torch

    import rtkernels as rtk
    env = benchutil.environment()
    rows, copy_gbs = bench(args, torch, rtk)
    cols = ["op", "n", "config", "rtk_%copy", "table_config", "table_%copy", "rtk/table", "torch_%copy", "rtk/torch"]
    text = benchutil.table(rows, cols)
    print(f"\n{env.get('gpu')} ({env.get('date')}): 1 GiB copy {copy_gbs:.0f} GB/s, {args.dtype}, "
          f"{X_BYTES >> 20} MiB of x")
    print(text)
    if args.out:
        benchutil.save(args.out, "bench_row_widths", {"env": env, "copy_gbs": copy_gbs, "rows": rows})
        with open(os.path.join(args.out, "bench_row_widths.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
