"""Memory-bound ops at the bandwidth roof: softmax, RMSNorm, LayerNorm, row reductions.

GB/s = (bytes of x read once + bytes of y written once) / time, for rtkernels, CuPy's composed
ops and torch (softmax / layer_norm / rms_norm) side by side, against the device-to-device
copy bandwidth measured in the same run.  Widths 1k .. 256k, rows chosen so x holds >= 64 MiB
(x plus y exceed the 50 MiB L2, and two input sets alternate).  Run on a GPU host:

    PYTHONPATH=. python tools/bench_membound.py [--out DIR] [--quick] [--sweep] [--dtypes float16,bfloat16]

--sweep also times, for 16-bit rows of 4k..64k, the old default ("old": the heuristics before
prefetching), the current default ("new") and the alternatives (block size x vectors per thread x
cluster, prefetch, softmax recompute, two-pass) and prints the best per (op, width) last.
One run for the lead (about 3-4 minutes on an H200):

    PYTHONPATH=. python tools/bench_membound.py --quick --sweep --ops softmax,rmsnorm,layernorm,sum

Timing: every timed call is queued behind a ~ms spin kernel, so the host's per-call cost (Python
argument checks, launch) overlaps the GPU and the events measure the kernels alone: at 64 MiB a
kernel takes ~30 us, the same order as a Python op's host path.  ``host_us`` reports that host
cost per call separately (it bounds a synchronous Python loop, not the bandwidth).
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


def _label(cfg) -> str:
    extra = "".join(tag for flag, tag in ((getattr(cfg, "prefetch", False), " pf"),
                                          (getattr(cfg, "recompute", False), " rc"),
                                          (getattr(cfg, "ring_rows", 0), f" ring{getattr(cfg, 'ring_rows', 0)}"),
                                          (getattr(cfg, "bulk_stages", 0), f" bulk{getattr(cfg, 'bulk_stages', 0)}"),
                                          (cfg.min_blocks > 1, f" mb{cfg.min_blocks}"),
                                          (getattr(cfg, "cluster_push", False), " push"),
                                          (getattr(cfg, "persistent", False), " pers"),
                                          (getattr(cfg, "smem_rows", False), " smem"),
                                          (getattr(cfg, "param_slots", 4) != 4, f" ps{getattr(cfg, 'param_slots', 4)}"))
                    if flag)
    if not getattr(cfg, "streaming", True):
        extra += " nocs"
    return f"{cfg.row_class} b{cfg.block_size} v{cfg.vecs_per_thread} c{cfg.cluster_size}{extra}"


# Candidates of --candidates per width (block, vectors per thread, cluster, threads_per_row or None
# for a block row, extra fields), most informative first.  Round 1 (H200, 2026-11-21) timed the
# shared-memory staging (ring_rows / bulk_stages) at 1k-256k: it never beat the direct loads
# (-1 to -6% with a persistent grid; clusters -25 to -60%) except RMSNorm 16k (+1%).  Round 2 timed
# cache hints, block shapes and two-pass chunking (the winners are in rowwise's tables).  Round 3:
# LayerNorm tiles with fewer registers (more resident blocks): 128x4 at 80 registers won at 4k.
# Session 3, round 1: cluster rows whose block totals travel by st.async + mbarrier (push) instead
# of two cluster barriers per row: 64k softmax 80.0% / RMSNorm 77.7% (two passes 76.9 / 73.2),
# LayerNorm 67% either way; a persistent cluster grid (with or without prefetch) lost 14-35%.
# Round 2: rows landing in shared memory by one bulk copy per block (smem_rows), read back twice
# or three times, so registers no longer cap the blocks (and bytes in flight) per SM: 64k softmax
# 81.7%, RMSNorm 80.7%, LayerNorm 72.1% (4 blocks x 256x8 or 512x4); at 4k-16k the register
# tiles stayed ahead (the new defaults are in rowwise's table).  Round 3 timed the new defaults
# against the ones they replaced at 4k-256k; 256k then switched to 8 x 512x8 slices (+13-17%).
CANDIDATE_WIDTHS = (4096, 16384, 65536, 1024, 262144)   # the targets first
_PUSH = dict(cluster_push=True)
_SPUSH = dict(smem_rows=True, cluster_push=True)
_CANDIDATES = {   # round 3: the new defaults ("new") against the defaults they replaced
    4096: [(128, 4, 1, None, dict(min_blocks=6, param_slots=2))],
    16384: [(512, 4, 1, None, dict(prefetch=True))],
    32768: [(512, 8, 1, None, {}), (512, 4, 1, None, dict(two_pass=True)), (512, 2, 1, None, dict(two_pass=True))],
    # Session 4: shared-memory slice shapes for 64k (LayerNorm trails RMSNorm there by 7 points at 1 GiB).
    65536: [(512, 4, 4, None, dict(_SPUSH, min_blocks=4, param_slots=1)),
            (256, 4, 8, None, dict(_SPUSH, min_blocks=6, param_slots=1)),
            (512, 2, 8, None, dict(_SPUSH, min_blocks=4, param_slots=1)),
            (128, 8, 8, None, dict(_SPUSH, min_blocks=12, param_slots=1)),
            (256, 8, 4, None, dict(_SPUSH, min_blocks=4, param_slots=2))],
    131072: [(512, 4, 1, None, dict(two_pass=True))],
    262144: [(512, 8, 8, None, dict(_SPUSH, min_blocks=3)), (256, 16, 8, None, dict(_SPUSH, min_blocks=3))],
}


def _candidate_configs(op, dtype, n, arch):
    """[(name, config)]: "new" (the current default) then the candidates for width n."""
    from rtkernels.ops import rowwise as rw
    family = "softmax" if op == "softmax" else "norm"
    extra = {"weight_dtype": dtype} if family == "norm" else {}
    cls = rw.SoftmaxConfig if family == "softmax" else rw.NormConfig
    new = rw.plan(family, n, dtype, 8, arch, weight_dtype=extra.get("weight_dtype"), layer=op == "layernorm")
    out = [("new", new)]
    for block, v, cluster, tpr, fields in _CANDIDATES.get(n, []):
        f = dict(dtype=dtype, vec=8, threads_per_row=tpr or block, block_size=block, vecs_per_thread=v,
                 cluster_size=cluster, **fields, **extra)
        if family == "softmax":
            f.pop("param_slots", None)
        if op in rw._PLAIN_HINTS_SM90_16BIT and not f.get("two_pass"):
            f["streaming"] = False   # as plan() does for resident softmax / RMSNorm rows
        cap = 65536 // (block * f.get("min_blocks", 1))
        if family == "norm" and cap <= 96 and "param_slots" not in fields:
            f["param_slots"] = 1 if cap <= 64 else 2   # weight (+ bias) vectors in flight within the cap
        if family == "softmax" and v >= 8 and not f.get("two_pass") and not f.get("smem_rows"):
            f["recompute"] = True
        try:
            c = cls(**f)
        except Exception as exc:   # noqa: BLE001 - an invalid candidate is reported, not fatal
            print(f"candidate {f} rejected: {exc}")
            continue
        if all(c != o for _, o in out):
            out.append(("alt", c))
    return out


def references(cp, rtk, copy_gbs):
    """Rows: the device copy and rtkernels' elementwise kernel (y = 2x + 1, bfloat16) at 64 MiB and
    512 MiB of x, and the default row ops at 512 MiB: how much of the gap to the 1 GiB copy is
    the fixed cost of a 32 us kernel (ramp-up and tail) rather than the row algorithm."""
    import benchutil as bu
    rows = []
    for mib in (64, 512):
        gbs = bu.copy_bandwidth(mib << 20)
        rows.append({"what": "device copy", "MiB": mib, "GBs": gbs, "%copy": 100 * gbs / copy_gbs})
        n = (mib << 20) // 2
        x = cp.ones(n, dtype=cp.uint16)
        y = cp.empty_like(x)
        f = rtk.elementwise("y = 2*x + 1") if hasattr(rtk, "elementwise") else None
        if f is not None:
            try:
                ms, _, _ = benchutil.time_queued(lambda a, b: f(a, out=b, dtype="bfloat16"), [(x, y)], warmup=3,
                                                 repeat=10)
                gbs = 2 * n * 2 / (ms * 1e-3) / 1e9
                rows.append({"what": "elementwise y=2x+1 bf16", "MiB": mib, "GBs": gbs, "%copy": 100 * gbs / copy_gbs})
            except Exception as exc:   # noqa: BLE001
                rows.append({"what": "elementwise", "MiB": mib, "error": f"{type(exc).__name__}: {exc}"[:200]})
        del x, y
        cp.get_default_memory_pool().free_all_blocks()
    for n in (4096, 16384, 65536):
        nrows = (512 << 20) // (n * 2)
        sets = _inputs(cp, nrows, n, "bfloat16", sets=1)
        for op in ("softmax", "rmsnorm", "layernorm"):
            ms, _, _ = benchutil.time_queued(_ours(op, "bfloat16", n, cp, rtk), sets, warmup=2, repeat=6)
            gbs = 2 * nrows * n * 2 / (ms * 1e-3) / 1e9
            rows.append({"what": f"{op} {n} default", "MiB": 512, "GBs": gbs, "%copy": 100 * gbs / copy_gbs})
        del sets
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def candidate_sweep(args, cp, rtk, copy_gbs, arch, t_start, budget_s):
    """Times the candidates per (op, width); returns (rows, best per (op, n) rows)."""
    from rtkernels.kernel import get_kernel
    rows, best_rows = [], []
    dtype = args.sweep_dtype
    t0 = time.time()
    widths = [int(w) for w in args.widths.split(",")] if args.widths else CANDIDATE_WIDTHS
    for n in widths:
        nrows = max(1, (args.mib << 20) // (n * 2))
        sets = _inputs(cp, nrows, n, dtype)
        nbytes = 2 * nrows * n * 2
        for op in [o for o in args.ops.split(",") if o in ("softmax", "rmsnorm", "layernorm")]:
            kernel = {"softmax": "softmax_rows", "rmsnorm": "rmsnorm_rows", "layernorm": "layernorm_rows"}[op]
            res = []
            for name, cfg in _candidate_configs(op, dtype, n, arch):
                if time.time() - t0 > budget_s and name == "alt":
                    continue
                r = {"op": op, "n": n, "which": name, "config": _label(cfg)}
                try:
                    k = get_kernel(cfg, kernel)
                    r["regs"], r["spill"] = k.resources.registers, k.resources.spill_stores
                    if k.resources.spill_stores and name == "alt":
                        r["skipped"] = f"spills {k.resources.spill_stores} B"
                        rows.append(r)
                        continue
                    ms, _, drained = benchutil.time_queued(_ours(op, dtype, n, cp, rtk, cfg), sets, warmup=2, repeat=10)
                    r.update(GBs=nbytes / (ms * 1e-3) / 1e9, drained=drained)
                    r["%copy"] = 100 * r["GBs"] / copy_gbs
                except Exception as exc:   # a candidate that fails must not sink the run
                    r["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(r)
                print(f"cand {op} {n} {name} {r['config']}: regs {r.get('regs')} spill {r.get('spill')} " +
                      (f"{r['GBs']:.0f} GB/s {r['%copy']:.1f}%" if "GBs" in r else
                       str(r.get("skipped") or r.get("error"))[:120]), flush=True)
                if "GBs" in r:
                    res.append(r)
            if res:
                new = res[0]["GBs"] if res[0]["which"] == "new" else float("nan")
                best = max(res, key=lambda r: r["GBs"])
                best_rows.append({"op": op, "n": n, "new_GBs": new, "new_%copy": 100 * new / copy_gbs,
                                  "best_GBs": best["GBs"], "best_%copy": best["%copy"], "best/new": best["GBs"] / new,
                                  "best_config": best["config"], "tried": len(res)})
                print(f"candidates {op} n={n}: new {new:.0f} best {best['GBs']:.0f} GB/s ({best['%copy']:.1f}%, "
                      f"{best['config']}), {time.time() - t_start:.0f} s", flush=True)
        del sets
        cp.get_default_memory_pool().free_all_blocks()
    return rows, best_rows


def _sweep_configs(op, dtype, n, arch):
    """[(name, config)]: "old" (the heuristics before prefetching), "new" (the current default),
    then every block size x vectors per thread (2, 4, 8) x cluster that holds the row, with and
    without prefetch (single blocks) and softmax's recompute (4+ vectors where registers bind),
    and a two-pass config.  Candidates that spill are compiled, reported and skipped."""
    from rtkernels import arch as _arch
    from rtkernels import dtypes
    from rtkernels.ops import rowwise as rw
    size = dtypes.itemsize(dtype)
    vec = 16 // size
    family = "softmax" if op == "softmax" else "norm"
    extra = {"weight_dtype": dtype} if family == "norm" else {}
    cls = rw.SoftmaxConfig if family == "softmax" else rw.NormConfig
    new = rw.plan(family, n, dtype, vec, arch, weight_dtype=extra.get("weight_dtype"), layer=op == "layernorm")
    old = new.replace(prefetch=False) if getattr(new, "prefetch", False) else new
    out = [("old", old), ("new", new)]
    nvec = n // vec
    hopper = _arch.arch_number(arch) >= 90
    for block in (128, 256, 512, 1024):
        for v in (2, 4, 8):
            if nvec % (block * v):
                continue
            cluster = nvec // (block * v)
            if cluster not in (1, 2, 4, 8) or (cluster > 1 and (not hopper or block < 256)):
                continue   # (clusters of 128-thread blocks: 8 barriers' worth of sync per row, skipped)
            for pf in ((False, True) if cluster == 1 else (False,)):
                # recompute only where registers bind: prefetching, or 512+ threads
                for rc in ((False, True) if family == "softmax" and v >= 4 and (pf or block >= 512) else (False,)):
                    f = dict(dtype=dtype, vec=vec, threads_per_row=block, block_size=block, vecs_per_thread=v,
                             cluster_size=cluster, prefetch=pf, **extra)
                    if rc:
                        f["recompute"] = True
                    out.append(("alt", cls(**f)))
    out.append(("alt", cls(dtype=dtype, vec=vec, threads_per_row=512, block_size=512, vecs_per_thread=4,
                           two_pass=True, **extra)))
    seen, uniq = set(), []
    for name, c in out:
        if c not in seen or name != "alt":
            seen.add(c)
            uniq.append((name, c))
    return uniq


SWEEP_WIDTHS = (4096, 8192, 16384, 32768, 65536)
SWEEP_BUDGET_S = 150   # the sweep stops adding candidates after this (one run must stay < 4 minutes)


def sweep(args, cp, rtk, copy_gbs, arch, t_start):
    """Time every candidate of _sweep_configs; returns (all rows, best per (op, n) rows)."""
    from rtkernels.kernel import get_kernel
    rows, best_rows = [], []
    dtype = args.sweep_dtype
    size = 2 if dtype in ("float16", "bfloat16") else 4
    t0 = time.time()
    for op in [o for o in args.ops.split(",") if o in ("softmax", "rmsnorm", "layernorm")]:
        kernel = {"softmax": "softmax_rows", "rmsnorm": "rmsnorm_rows", "layernorm": "layernorm_rows"}[op]
        for n in SWEEP_WIDTHS:
            nrows = max(1, DATA_BYTES // (n * size))
            sets = _inputs(cp, nrows, n, dtype)
            nbytes = 2 * nrows * n * size
            res = {}
            for name, cfg in _sweep_configs(op, dtype, n, arch):
                if time.time() - t0 > SWEEP_BUDGET_S and name == "alt":
                    continue
                r = {"op": op, "dtype": dtype, "n": n, "which": name, "config": _label(cfg), "key": cfg.key()}
                try:
                    k = get_kernel(cfg, kernel)
                    r["registers"] = k.resources.registers
                    if k.resources.spill_stores and name == "alt":
                        r["skipped"] = f"spills {k.resources.spill_stores} B"
                        rows.append(r)
                        continue
                    ms, host_us, drained = benchutil.time_queued(_ours(op, dtype, n, cp, rtk, cfg), sets, warmup=2,
                                                                 repeat=10)
                    r.update(GBs=nbytes / (ms * 1e-3) / 1e9, host_us=host_us, drained=drained)
                    r["%copy"] = 100 * r["GBs"] / copy_gbs
                except Exception as exc:   # a candidate that fails must not sink the run
                    r["error"] = f"{type(exc).__name__}: {exc}"[:200]
                rows.append(r)
                if "GBs" in r:
                    res.setdefault(name, []).append(r)
            del sets
            cp.get_default_memory_pool().free_all_blocks()
            everything = [r for v in res.values() for r in v]
            if not everything:
                continue
            best = max(everything, key=lambda r: r["GBs"])
            old = res.get("old", [{}])[0].get("GBs", float("nan"))
            new = res.get("new", [{}])[0].get("GBs", float("nan"))
            best_rows.append({"op": op, "n": n, "old_GBs": old, "new_GBs": new, "new/old": new / old,
                              "best_GBs": best["GBs"], "best_%copy": best["%copy"], "best/old": best["GBs"] / old,
                              "best_config": best["config"], "new_config": res.get("new", [{}])[0].get("config", ""),
                              "tried": len(everything)})
            print(f"sweep {op} n={n}: old {old:.0f} new {new:.0f} best {best['GBs']:.0f} GB/s ({best['config']}), "
                  f"{time.time() - t_start:.0f} s", flush=True)
    return rows, best_rows


def main():
    p = benchutil.parser(__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="also time alternative configs per width")
    p.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated: float16,bfloat16,float32")
    p.add_argument("--ops", default="softmax,rmsnorm,layernorm,sum,argmax")
    p.add_argument("--sweep-dtype", default="bfloat16", help="dtype of the --sweep candidates")
    p.add_argument("--candidates", type=float, default=0, metavar="SECONDS",
                   help="only time the candidate configs per width (about SECONDS for the alternatives) and the "
                        "references (copy and elementwise at 64 / 512 MiB, row ops at 512 MiB), then print them")
    p.add_argument("--widths", default="", help="comma-separated widths for --candidates (default: all)")
    p.add_argument("--no-references", action="store_true", help="--candidates without the reference rows")
    p.add_argument("--mib", type=int, default=DATA_BYTES >> 20,
                   help="MiB of x per case (default 64: x + y exceed the L2; 1024 matches the copy roof's size)")
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
    print(f"device copy {copy_gbs:.0f} GB/s ({env['gpu']})", flush=True)
    arch = device.current_arch()
    if args.candidates:
        cand_rows, best_rows = candidate_sweep(args, cp, rtk, copy_gbs, arch, t_start, args.candidates)
        try:
            ref_rows = [] if args.no_references else references(cp, rtk, copy_gbs)
        except Exception as exc:   # noqa: BLE001 - the sweep's data must survive
            ref_rows = [{"what": "references", "error": f"{type(exc).__name__}: {exc}"[:300]}]
        path = benchutil.save(args.out, "bench_membound_candidates",
                              {"environment": env, "copy_GBs": copy_gbs, "candidates": cand_rows,
                               "best": best_rows, "references": ref_rows})
        print(f"\n{env['gpu']} ({env['arch']}, {env['date']}): device copy {copy_gbs:.0f} GB/s; JSON {path}; "
              f"{time.time() - t_start:.0f} s")
        print(benchutil.table(cand_rows, ["op", "n", "which", "config", "regs", "spill", "GBs", "%copy",
                                          "skipped", "error"]))
        print("\nreferences (% of the 1 GiB copy):")
        print(benchutil.table(ref_rows, ["what", "MiB", "GBs", "%copy", "error"]))
        print("\nbest per (op, width):")
        print(benchutil.table(best_rows, ["op", "n", "new_GBs", "new_%copy", "best_GBs", "best_%copy", "best/new",
                                          "best_config", "tried"]))
        return
    widths = QUICK_WIDTHS if args.quick else WIDTHS
    repeat = 10 if args.quick else 20
    data_bytes = args.mib << 20
    # The roof is the 1 GiB copy; a copy of the cases' own size says how much of the gap is the fixed
    # ramp-up and tail of a short kernel (a 64 MiB copy runs ~32 us) rather than the row algorithm.
    copy_same = copy_gbs if data_bytes == 1 << 30 else benchutil.copy_bandwidth(data_bytes)
    print(f"device copy of {args.mib} MiB: {copy_same:.0f} GB/s", flush=True)
    rows_out, sweep_out = [], []
    for dtype in args.dtypes.split(","):
        size = dtypes.itemsize(dtype)
        for op in args.ops.split(","):
            reduce_op = op in ("sum", "max", "min", "argmax")
            for n in widths:
                rows = max(1, data_bytes // (n * size))
                sets = _inputs(cp, rows, n, dtype)
                out_bytes = rows * (8 if op == "argmax" else size) if reduce_op else rows * n * size
                nbytes = rows * n * size + out_bytes
                row = {"dtype": dtype, "op": op, "n": n, "rows": rows, "MiB": round(nbytes / 2 ** 20)}
                fns = {"rtk": _ours(op, dtype, n, cp, rtk)}
                fns.update(_peers(op, dtype, n, cp, torch))
                for name, fn in fns.items():
                    try:
                        ms, host_us, drained = benchutil.time_queued(fn, sets, warmup=3, repeat=repeat)
                        row[f"{name}_GBs"] = nbytes / (ms * 1e-3) / 1e9
                        row[f"{name}_host_us"] = host_us
                        if drained:
                            row[f"{name}_drained"] = True
                    except Exception as exc:   # a peer missing a feature must not sink the run
                        row[f"{name}_GBs"] = float("nan")
                        row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
                row["rtk_%copy"] = 100 * row["rtk_GBs"] / copy_gbs
                row["rtk_%copy_same_size"] = 100 * row["rtk_GBs"] / copy_same
                for peer in ("cupy", "torch"):
                    if row.get(f"{peer}_GBs"):
                        row[f"x_{peer}"] = row["rtk_GBs"] / row[f"{peer}_GBs"]
                if not reduce_op:
                    cfg = rw._config_for("softmax" if op == "softmax" else "norm", None, n, dtype,
                                         16 // size, rows, op, weight_dtype=dtype if op != "softmax" else None,
                                         layer=op == "layernorm")
                    row["config"] = _label(cfg)
                rows_out.append(row)
                del sets
                cp.get_default_memory_pool().free_all_blocks()
                print(f"{dtype} {op} n={n}: rtk {row['rtk_GBs']:.0f} GB/s ({row['rtk_%copy']:.0f}% of copy)",
                      flush=True)
    best_rows = []
    if args.sweep:
        sweep_out, best_rows = sweep(args, cp, rtk, copy_gbs, arch, t_start)
    payload = {"environment": env, "copy_GBs": copy_gbs, "mib": args.mib, "copy_GBs_same_size": copy_same,
               "results": rows_out, "sweep": sweep_out,
               "sweep_best": best_rows,
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
    cols = ["dtype", "op", "n", "rows", "rtk_GBs", "rtk_%copy", "rtk_%copy_same_size", "rtk_host_us", "cupy_GBs",
            "x_cupy", "torch_GBs",
            "x_torch", "config"]
    print(f"\n{env['gpu']} ({env['arch']}, {env['date']}): device copy {copy_gbs:.0f} GB/s (1 GiB), "
          f"{copy_same:.0f} GB/s ({args.mib} MiB); {args.mib} MiB of x per case; "
          f"JSON {path}; {time.time() - t_start:.0f} s; GPU time per call (host cost overlapped)")
    print(benchutil.table(rows_out, cols))
    drained = sorted({f"{r['op']} {r['n']}" for r in rows_out for k in r if k.endswith("_drained")})
    if drained:
        print("host slower than the spin (times include host gaps):", ", ".join(drained))
    if best_rows:
        print(f"\nsweep ({args.sweep_dtype}): best config per (op, width); old = heuristics before prefetch, "
              "new = current default")
        print(benchutil.table(best_rows, ["op", "n", "old_GBs", "new_GBs", "new/old", "best_GBs", "best_%copy",
                                          "best/old", "best_config", "new_config", "tried"]))


if __name__ == "__main__":
    main()
