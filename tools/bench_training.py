"""Training-step kernels against a same-run device copy and their peers.

GB/s = the bytes each op must move / time, and that as % of the device-to-device copy measured in
the same run (1 GiB; the row ops also against a copy of their own size):
  norm backward   read dy, x, weight (and the saved statistics), write dx, dweight (+ dbias)
  softmax bwd     read dy, y, write dx
  cross-entropy   read the logits (+ targets), write dlogits and the per-token loss
  AdamW           read p (or the fp32 master), g, m, v; write p, m, v (+ master)
Peers in the same run: torch eager (autograd of F.rms_norm / F.layer_norm / softmax; F.cross_entropy
forward + backward; torch.optim.AdamW(fused=True) and foreach=True), Liger / QuACK when importable.
Calls are queued behind a spin kernel and timed back to back between two events (benchutil.time_queued;
before 2026-11-27 an event after every call, ~1.5 us more per call) and the candidates of a case
alternate over several rounds (median of rounds).

    PYTHONPATH=. python tools/bench_training.py [--quick] [--out DIR] [--ops norm,softmax,ce,adamw]
        [--variants [NAME,...]] [--widths N,...]

--variants [NAMES|default|fold|bulk|all]: the norm backward's variants (NORM_VARIANTS: the first version
"old", then the column sums in shared memory, the register cap, clusters merging partial rows, the
load-ahead schemes, the two-kernel column sum "unfolded" against the fold) timed beside the
heuristic config in the same rounds, each as % of the same copy, with its tile, registers, resident
workers and partial rows.  "fold": the fold's A/B (FOLD_VARIANTS: the two kernels, the fold forced
where the heuristic does not fold, the fold keeping its summed lines in L2, and 16k worker shapes).
"bulk": the bulk-copy stages' A/B (BULK_VARIANTS: direct loads, 1-3 rows in flight per row team,
with the heuristic's or register column sums).

Targets (issue 21): norm / softmax backward >= 0.85x copy at widths 1k-16k and >= 1.5x torch
eager; cross-entropy (loss + grad) >= 0.85x copy and >= 2x torch; AdamW >= 0.85x copy and >= 1.0x
torch fused (1B parameters in 300 tensors).  --quick: fewer widths, 256M parameters, < 60 s.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchutil  # noqa: E402

NORM_WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_NORM_WIDTHS = (1024, 4096, 16384)
ROW_BYTES = 64 << 20          # bytes of x per row-op case: dy + x + dx exceed the 50 MiB L2
CE_CASES = ((8192, 32000), (8192, 50257), (8192, 128256), (2048, 256000))
QUICK_CE_CASES = ((4096, 50257), (4096, 128256))


# Overrides of the heuristic NormBwdConfig timed by --variants (invalid ones are skipped; "only"
# limits one to the widths listed).  The heuristic ("rtk") is now (2026-11-26) split_stats with
# the sums in registers at 1k and 4k RMSNorm, acc_smem + the 64-register cap at 4k LayerNorm and
# 16k, no merged clusters.  prev_default = round 1's heuristic (acc_smem everywhere, merge_cluster 4
# on lane-group / block rows, the cap on block / cluster rows); old = the first version's kernel
# (2026-11-25: one kernel for saved and recomputed statistics, sums in registers, ptxas's count).
_OLD = dict(split_stats=False, acc_smem=False, merge_cluster=1, min_blocks=1, ring_rows=0, prefetch=False)
NORM_VARIANTS = {
    "prev_default": "prev_default",
    "old": _OLD,
    "split": dict(_OLD, split_stats=True),                     # + the saved-statistics kernel alone
    "acc": dict(_OLD, split_stats=True, acc_smem=True),        # + sums in shared memory
    "acc_64reg": dict(_OLD, split_stats=True, acc_smem=True, min_blocks=-1,   # + 64-register cap (lane groups spill)
                      only=(2048, 4096, 8192, 16384, 32768, 65536)),
    "acc_merge4": dict(_OLD, split_stats=True, acc_smem=True, merge_cluster=4, only=(1024, 2048, 4096)),
    "merge2": dict(acc_smem=True, merge_cluster=2, only=(1024, 2048, 4096)),
    # the next rows in flight per row team through cp.async.bulk stages (sm_90), on the heuristic
    "bulk2": dict(bulk_rows=2),
    "bulk3": dict(bulk_rows=3),
    # bulk stages with the sums in registers and no cap, where the heuristic keeps them in shared
    # memory (4k LayerNorm, 16k): the stages' shared memory instead of the sums'
    "bulk2_accreg": dict(bulk_rows=2, acc_smem=False, min_blocks=1, only=(2048, 4096, 8192, 16384, 32768, 65536)),
    # round 3 (after the stage protocol's fix, 2026-11-26): the heuristic's tile loading directly
    # with the direct-load tables' sums and cap (the reference once a class defaults to bulk
    # stages), one row in flight (the prefetch's overlap without its registers), three, and the
    # 4k winner capped to 3 blocks of 256 per SM (85 registers: ptxas 78-79, no spills; 396
    # workers, each two rows ahead)
    "direct": "direct",
    "bulk1": dict(bulk_rows=1),
    "bulk1_accreg": dict(bulk_rows=1, acc_smem=False, min_blocks=1, only=(2048, 4096, 8192, 16384, 32768, 65536)),
    "bulk3_accreg": dict(bulk_rows=3, acc_smem=False, min_blocks=1, only=(2048, 4096, 8192, 16384, 32768, 65536)),
    "bulk2_accreg_3blk": dict(bulk_rows=2, acc_smem=False, min_blocks=3, only=(2048, 4096, 8192)),
    # the weight loaded from L1 at both uses of every row (hold_weight=False, the default before 2026-11-28)
    "nohold": dict(hold_weight=False),
    # 256-thread block rows with the sums in shared memory under a 64-register cap: 4 blocks per SM
    # instead of 3 (RMSNorm 4k with the weight held: 80 registers).  H200, 2026-11-28: RMSNorm 2560 / 4096
    # 3300 / 3230 GB/s against bulk stages' 3370 / 3390 - not taken (rowwise_bwd._NORM_BWD_BULK)
    "acc4blk": dict(acc_smem=True, min_blocks=4, bulk_rows=0, only=(2048, 2560, 3072, 4096)),
    # earlier load-ahead variants (rejected 2026-11-25), now on the new kernel
    "prefetch": dict(ring_rows=0, prefetch=True, min_blocks=1),   # a second register set: no 64-register cap
    "ring2": dict(ring_rows=2, prefetch=False),
    # the column sums: the two-kernel path (norm_bwd_colsum) against the heuristic's fold into a
    # cooperative rows kernel; the fold without dropping the summed lines from L2; the fold with
    # clusters of 4 workers merging their sums on chip first (4x fewer partial rows; the merge's
    # cluster barrier now waits where the grid barrier would anyway)
    "unfolded": dict(fold_colsum=False),
    "fold_keep": dict(fold_colsum=True, discard_partials=False),
    "fold_merge4": dict(fold_colsum=True, acc_smem=True, merge_cluster=4, only=(1024, 2048, 4096)),
    # the fold forced on where the heuristic runs the two kernels (lane-group rows, 1k: 2026-11-26)
    "folded": dict(fold_colsum=True),
    # 16k cluster rows (2048 rows of 192 MiB: ~15 rows per SM, so a worker's prologue / epilogue and
    # the grid barrier weigh): the heuristic's 4-block clusters of 256 threads place only 124 of the
    # 132 clusters that 4 blocks per SM would give (a cluster lives in one GPC; 6% of the block slots
    # idle, in the rows and in the fold's tail).  2-block clusters of 512 threads (64 registers, 2
    # per SM, 64 KiB of shared sums each) fill every SM with the same 1024 threads; 8-block clusters
    # of 128 threads: more, smaller blocks (8 per SM); 2-block clusters of 256 threads holding 32
    # elements of each input per thread (3 per SM, 85 registers): half the workers, twice the loads
    # in flight per thread.  (REASONED, for the lead's A/B.)
    "c2x512": dict(block_size=512, threads_per_row=512, cluster_size=2, vecs_per_thread=2, min_blocks=2,
                   only=(16384,)),
    "c8x128": dict(block_size=128, threads_per_row=128, cluster_size=8, vecs_per_thread=2, min_blocks=8,
                   only=(16384,)),
    "c2x256v4": dict(block_size=256, threads_per_row=256, cluster_size=2, vecs_per_thread=4, min_blocks=3,
                     only=(16384,)),
    # 8k rows (LayerNorm 77% of copy, 2026-11-26, H100): a block per row instead of the heuristic's
    # 2-block clusters - no cluster to place within a GPC - 512 threads x 16 elements, or 256 x 32
    "c2x256": dict(block_size=256, threads_per_row=256, cluster_size=2, cluster_push=True, vecs_per_thread=2,
                   min_blocks=4, only=(8192,)),   # 8k's heuristic before 2026-11-26 (cluster rows)
    "b512": dict(block_size=512, threads_per_row=512, cluster_size=1, cluster_push=False, vecs_per_thread=2,
                 min_blocks=2, only=(8192,)),
    "b256v4": dict(block_size=256, threads_per_row=256, cluster_size=1, cluster_push=False, vecs_per_thread=4,
                   min_blocks=3, only=(8192,)),
}
DEFAULT_VARIANTS = "prev_default,old,bulk2,bulk3,bulk2_accreg"
FOLD_VARIANTS = "unfolded,folded,fold_keep,c2x512,c8x128,c2x256v4"   # --variants fold: the fold's A/B
# --variants bulk: the bulk stages' A/B (_NORM_BWD_BULK in rowwise_bwd.py)
BULK_VARIANTS = "direct,bulk1,bulk2,bulk1_accreg,bulk2_accreg,bulk3_accreg,bulk2_accreg_3blk"


def _prev_default(base):
    """Round 1's heuristic on `base`'s tile (rowwise_bwd.py before 2026-11-26)."""
    cls_ = base.row_class
    return base.replace(acc_smem=True, merge_cluster=4 if cls_ in ("group", "block") else 1,
                        min_blocks=1 if cls_ == "group" else max(1, 1024 // base.block_size))


def _direct(base, layer):
    """`base`'s tile loading directly, with the direct-load tables' occupancy knobs (what the
    heuristic picks where _NORM_BWD_BULK has no entry)."""
    from rtkernels.ops import rowwise_bwd as rb
    cls_ = base.row_class
    return base.replace(bulk_rows=0, acc_smem=rb._NORM_BWD_ACC_SMEM[cls_][int(layer)],
                        min_blocks=max(1, rb._NORM_BWD_THREADS_PER_SM[cls_][int(layer)] // base.block_size))


def _norm_variants(args, n, layer):
    """name -> NormBwdConfig for --variants at width n (bf16 rows and weights, 16-byte vectors)."""
    if not args.variants:
        return {}
    from rtkernels.errors import ConfigError
    from rtkernels.ops import rowwise as rw
    from rtkernels.ops import rowwise_bwd as rb
    arch, _ = rw._arch_info()
    base = rb.plan_bwd("norm_bwd", n, "bfloat16", 8, arch, weight_dtype="bfloat16", layer=layer)
    names = list(NORM_VARIANTS) if args.variants == "all" else \
        {"default": DEFAULT_VARIANTS, "fold": FOLD_VARIANTS, "bulk": BULK_VARIANTS}.get(args.variants,
                                                                                       args.variants).split(",")
    out = {}
    for name in names:
        if NORM_VARIANTS[name] == "prev_default":
            out[name] = _prev_default(base)
            continue
        if NORM_VARIANTS[name] == "direct":
            cfg = _direct(base, layer)
            if cfg != base:
                out[name] = cfg
            continue
        fields = dict(NORM_VARIANTS[name])
        only = fields.pop("only", None)
        if only and n not in only:
            continue
        if fields.get("min_blocks") == -1:   # the heuristic's cap: 1024 threads per SM (64 registers)
            fields["min_blocks"] = max(1, 1024 // base.block_size)
        if fields.get("merge_cluster", 1) > 1 and base.cluster_size > 1:
            continue
        try:
            cfg = base.replace(**fields)
        except ConfigError as exc:
            print(f"  variant {name} at n={n}: {exc}", flush=True)
            continue
        if cfg != base and cfg not in out.values():   # the heuristic is timed as "rtk" already
            out[name] = cfg
    return out


def _describe(rtk, cfg, layer) -> str:
    """A config's tile, load-ahead and worker count (what the kernel runs), for the JSON."""
    from rtkernels.ops import rowwise_bwd as rb
    k = rtk.get_kernel(cfg, "layernorm_bwd_rows" if layer else "rmsnorm_bwd_rows")
    r = k.resources
    return (f"{cfg.threads_per_row}x{cfg.vecs_per_thread}v{cfg.vec} blk{cfg.block_size} cl{cfg.cluster_size} "
            f"ring{cfg.ring_rows} pf{int(cfg.prefetch)} bps{cfg.blocks_per_sm} bal{int(cfg.balance)} "
            f"acc_smem{int(cfg.acc_smem)} split{int(cfg.split_stats)} min_blocks{cfg.min_blocks} "
            f"merge{cfg.merge_cluster} bulk{cfg.bulk_rows} regs{r.registers} smem{cfg.shared_mem_bytes} "
            f"resident_workers{rb._resident_workers(k, cfg)} "
            f"partial_rows{rb._resident_workers(k, cfg) // cfg.merge_cluster * (2 if layer else 1)} "
            + (f"fold(discard{int(cfg.discard_partials)} cooperative_workers{rb._cooperative_workers(k, cfg)}"
               + (" REFUSED: ran the two kernels)" if cfg in rb._FOLD_REFUSED else ")") if cfg.fold_colsum else
               "two kernels"))


def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _interleaved(fns: dict, inputs, rounds: int, repeat: int) -> dict:
    """name -> (median ms over rounds, None) or (None, error text), the candidates alternating round
    by round (a candidate that fails is dropped from later rounds)."""
    times = {k: [] for k in fns}
    errors = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            if name in errors:
                continue
            try:
                times[name].append(benchutil.time_queued(fn, inputs, warmup=2, repeat=repeat)[0])
            except Exception as exc:   # noqa: BLE001 - a peer missing a feature must not sink the run
                errors[name] = f"{type(exc).__name__}: {exc}"[:160]
    return {k: (None, errors[k]) if k in errors else (statistics.median(v), None) for k, v in times.items()}


def _row(case: dict, res: dict, nbytes: int, copy_gbs: float, copy_same: float | None = None) -> dict:
    row = dict(case)
    for name, (ms, extra) in res.items():
        if ms is None:
            row[f"{name}_error"] = extra
            continue
        row[f"{name}_GBs"] = nbytes / (ms * 1e-3) / 1e9
        row[f"{name}_us"] = ms * 1e3
    for name in res:
        if name.startswith("v_") and row.get(f"{name}_GBs"):
            row[f"{name}_%copy"] = 100 * row[f"{name}_GBs"] / copy_gbs
    if row.get("rtk_GBs"):
        row["rtk_%copy"] = 100 * row["rtk_GBs"] / copy_gbs
        if copy_same:
            row["rtk_%copy_same_size"] = 100 * row["rtk_GBs"] / copy_same
        for name in res:
            if name != "rtk" and not name.startswith("v_") and row.get(f"{name}_GBs"):
                row[f"x_{name}"] = row["rtk_GBs"] / row[f"{name}_GBs"]
    return row


# ---- norm and softmax backward -------------------------------------------------------------------
def bench_rows(args, cp, rtk, torch, copy_gbs, widths):
    rows_out = []
    F = torch.nn.functional if torch else None
    for n in widths:
        rows = max(1, (args.x_mib << 20 if args.x_mib else ROW_BYTES) // (n * 2))
        copy_same = benchutil.copy_bandwidth(3 * rows * n)   # the traffic of dy + x read, dx written
        for op in args.ops.split(","):
            if op not in ("rmsnorm", "layernorm", "softmax"):
                continue
            if torch is not None:
                x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
                dy = torch.randn_like(x)
                w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            else:
                x = (cp.random.standard_normal((rows, n), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
                dy = (cp.random.standard_normal((rows, n), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
                w = cp.full(n, 0x3F80, cp.uint16)
                b = cp.zeros(n, cp.uint16)
            kw = {} if torch is not None else {"dtype": "bfloat16"}
            dx = x.clone() if torch is not None else x.copy()
            fns = {}
            described = {}   # variant -> its config (then its tile and workers)
            if op == "rmsnorm":
                y, rstd = rtk.rmsnorm(x, w, eps=1e-6, return_stats=True, **kw)
                fns["rtk"] = lambda: rtk.rmsnorm_backward(dy, x, w, rstd, out=dx, **kw)
                fns["rtk_recompute"] = lambda: rtk.rmsnorm_backward(dy, x, w, eps=1e-6, out=dx, **kw)
                for name, cfg in _norm_variants(args, n, False).items():
                    fns[f"v_{name}"] = lambda cfg=cfg: rtk.rmsnorm_backward(dy, x, w, rstd, out=dx, config=cfg, **kw)
                    described[f"v_{name}"] = cfg   # described after the timing (a refused fold shows)
                nbytes = 3 * rows * n * 2 + 2 * n * 2 + rows * 4       # + weight read, dweight written, rstd
                if torch is not None and hasattr(F, "rms_norm"):
                    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
                    yt = F.rms_norm(xr, (n,), wr, 1e-6)
                    fns["torch"] = lambda: torch.autograd.grad(yt, (xr, wr), dy, retain_graph=True)
                    fns.update(_liger_rms(torch, x, w, dy))
                    fns.update(_quack_rms(x, w, dy))
            elif op == "layernorm":
                y, mean, rstd = rtk.layernorm(x, w, b, eps=1e-5, return_stats=True, **kw)
                fns["rtk"] = lambda: rtk.layernorm_backward(dy, x, w, b, mean, rstd, out=dx, **kw)
                fns["rtk_recompute"] = lambda: rtk.layernorm_backward(dy, x, w, b, eps=1e-5, out=dx, **kw)
                for name, cfg in _norm_variants(args, n, True).items():
                    fns[f"v_{name}"] = lambda cfg=cfg: rtk.layernorm_backward(dy, x, w, b, mean, rstd, out=dx,
                                                                              config=cfg, **kw)
                    described[f"v_{name}"] = cfg
                nbytes = 3 * rows * n * 2 + 3 * n * 2 + 2 * rows * 4   # + weight read, dweight + dbias written
                if torch is not None:
                    xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
                    yt = F.layer_norm(xr, (n,), wr, br, 1e-5)
                    fns["torch"] = lambda: torch.autograd.grad(yt, (xr, wr, br), dy, retain_graph=True)
            else:
                y = rtk.softmax(x, **kw)
                fns["rtk"] = lambda: rtk.softmax_backward(dy, y, out=dx, **kw)
                nbytes = 3 * rows * n * 2
                if torch is not None:
                    xr = x.detach().requires_grad_()
                    yt = torch.softmax(xr, -1)
                    fns["torch"] = lambda: torch.autograd.grad(yt, xr, dy, retain_graph=True)
            res = _interleaved(fns, [()], rounds=3 if args.quick else 5, repeat=10 if args.quick else 20)
            r = _row({"op": op + "_bwd", "n": n, "rows": rows, "MiB": round(nbytes / 2 ** 20)}, res, nbytes, copy_gbs,
                     copy_same)
            if op != "softmax":
                from rtkernels.ops import rowwise_bwd as rb
                from rtkernels.ops import rowwise as rw
                cfg = rb.plan_bwd("norm_bwd", n, "bfloat16", 8, rw._arch_info()[0], weight_dtype="bfloat16",
                                  layer=op == "layernorm")
                r["rtk_cfg"] = _describe(rtk, cfg, op == "layernorm")
                r.update({f"{k}_cfg": _describe(rtk, v, op == "layernorm") for k, v in described.items()})
            rows_out.append(r)
            print(_line(r), flush=True)
            del fns
    return rows_out


def _liger_rms(torch, x, w, dy):
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:   # noqa: BLE001 - optional peer
        return {}
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = LigerRMSNormFunction.apply(xr, wr, 1e-6)
    return {"liger": lambda: torch.autograd.grad(y, (xr, wr), dy, retain_graph=True)}


def _quack_rms(x, w, dy):
    """QuACK's RMSNorm backward from saved statistics (as rtk's "rtk" column), when importable
    (an optional peer: ../shared/anchors/README.md)."""
    try:
        from quack.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
        rstd = rmsnorm_fwd(x, w, eps=1e-6, store_rstd=True)[2]   # (out, residual_out, rstd)
    except Exception:   # noqa: BLE001 - optional peer
        return {}
    return {"quack": lambda: rmsnorm_bwd(x, w, dy, rstd)}


# ---- cross-entropy --------------------------------------------------------------------------------
def bench_ce(args, cp, rtk, torch, copy_gbs, cases):
    out = []
    for tokens, vocab in cases:
        if torch is not None:
            logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16)
            target = torch.randint(0, vocab, (tokens,), device="cuda")
            target[::17] = -100
            grad = torch.empty_like(logits)
            kw = {}
        else:
            logits = (cp.random.standard_normal((tokens, vocab), dtype=cp.float32).view(cp.uint32) >> 16).astype(
                cp.uint16)
            target = cp.random.randint(0, vocab, tokens).astype(cp.int64)
            grad = cp.empty_like(logits)
            kw = {"dtype": "bfloat16"}
        fns = {"rtk": lambda: rtk.cross_entropy(logits, target, return_grad=True, grad_out=grad, **kw),
               "rtk_loss_only": lambda: rtk.cross_entropy(logits, target, **kw)}
        if torch is not None:
            F = torch.nn.functional
            lr = logits.detach().requires_grad_()

            def torch_fwd_bwd():
                lr.grad = None
                F.cross_entropy(lr, target).backward()
            fns["torch"] = torch_fwd_bwd
            fns.update(_liger_ce(torch, logits, target))
        nbytes = 2 * tokens * vocab * 2 + tokens * 12
        res = _interleaved(fns, [()], rounds=3, repeat=5 if args.quick else 10)
        r = _row({"op": "cross_entropy", "n": vocab, "rows": tokens, "MiB": round(nbytes / 2 ** 20)}, res, nbytes,
                 copy_gbs)
        lo = res.get("rtk_loss_only", (None,))[0]
        if lo:   # the loss alone moves the logits once
            r["rtk_loss_only_GBs"] = (tokens * vocab * 2 + tokens * 12) / (lo * 1e-3) / 1e9
        out.append(r)
        print(_line(r), flush=True)
        del logits, grad, fns
        if torch is not None:
            torch.cuda.empty_cache()
    return out


def _liger_ce(torch, logits, target):
    try:
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
    except Exception:   # noqa: BLE001 - optional peer
        return {}
    loss_fn = LigerCrossEntropyLoss()
    lr = logits.detach().requires_grad_()

    def liger():
        lr.grad = None
        loss_fn(lr, target).backward()
    return {"liger": liger}


# ---- AdamW ----------------------------------------------------------------------------------------
def bench_adamw(args, cp, rtk, torch, copy_gbs):
    out = []
    total = (256 << 20) if args.quick else (1 << 30)
    count = 300
    if torch is None:
        print("adamw: torch not importable, skipped", flush=True)
        return out
    free = torch.cuda.mem_get_info()[0]
    while total * 16 * 2.8 > free and total > (16 << 20):   # p, g, m, v in float32, and torch's copies
        total //= 2
    # 300 tensors: a few embedding-sized ones and many square-ish matrices / vectors (odd sizes)
    import numpy as np
    rng = np.random.default_rng(0)
    weights = rng.pareto(1.5, count) + 0.05
    sizes = np.maximum(1, (weights / weights.sum() * total).astype(np.int64))
    for label, pdt, master in (("fp32", torch.float32, False), ("bf16+fp32 master", torch.bfloat16, True)):
        params = [torch.randn(int(s), device="cuda", dtype=pdt) * 0.02 for s in sizes]
        grads = [torch.randn_like(p) * 1e-3 for p in params]
        m = [torch.zeros(p.shape, device="cuda", dtype=torch.float32) for p in params]
        v = [torch.zeros_like(x) for x in m]
        masters = [p.float() for p in params] if master else None
        numel = int(sizes.sum())
        step = [0]

        def ours():
            step[0] += 1
            rtk.adamw_step(params, grads, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                           step=step[0], master_params=masters)
        fns = {"rtk": ours}
        # fp32: read p g m v, write p m v; bf16 + master: read g m v master, write p m v master
        per = 28 if not master else 2 + 4 + 4 + 4 + 2 + 4 + 4 + 4
        if not master:
            for name, kw in (("torch_fused", {"fused": True}), ("torch_foreach", {"foreach": True})):
                tp = [p.detach().clone().requires_grad_() for p in params]
                for a, g in zip(tp, grads):
                    a.grad = g
                opt = torch.optim.AdamW(tp, lr=1e-3, **kw)
                fns[name] = opt.step
        else:
            tp = [p.detach().clone().requires_grad_() for p in params]   # torch: bf16 params and bf16 states
            for a, g in zip(tp, grads):
                a.grad = g
            opt = torch.optim.AdamW(tp, lr=1e-3, fused=True)
            fns["torch_fused_bf16_states"] = opt.step
        ours()   # builds the table and compiles outside the timing
        times = {k: [] for k in fns}
        for _ in range(3):
            for name, fn in fns.items():
                times[name].append(benchutil.time_cuda(fn, warmup=1, repeat=5 if args.quick else 10))
        res = {k: (statistics.median(v), None) for k, v in times.items()}
        nbytes = numel * per
        r = _row({"op": f"adamw {label}", "n": count, "rows": numel, "MiB": round(nbytes / 2 ** 20)}, res, nbytes,
                 copy_gbs)
        out.append(r)
        print(_line(r), flush=True)
        del params, grads, m, v, masters, fns, opt, tp
        torch.cuda.empty_cache()
    out.append(_adamw_host_cost(rtk, torch, count))
    print(out[-1], flush=True)
    return out


def _adamw_host_cost(rtk, torch, count):
    """Host microseconds per step on 300 tiny tensors (the GPU work is negligible): the cached table
    leaves one launch per step; torch's fused step builds its kernel arguments every step."""
    params = [torch.randn(16, device="cuda") for _ in range(count)]
    grads = [torch.randn(16, device="cuda") for _ in range(count)]
    m = [torch.zeros(16, device="cuda") for _ in range(count)]
    v = [torch.zeros(16, device="cuda") for _ in range(count)]
    step = [0]

    def ours():
        step[0] += 1
        rtk.adamw_step(params, grads, m, v, lr=1e-3, step=step[0])
    tp = [p.clone().requires_grad_() for p in params]
    for a, g in zip(tp, grads):
        a.grad = g
    opt = torch.optim.AdamW(tp, lr=1e-3, fused=True)
    return {"op": "adamw host cost", "n": count, "rows": 16 * count, "rtk_host_us": benchutil.time_host(ours, 200),
            "torch_fused_host_us": benchutil.time_host(opt.step, 200)}


def _line(r: dict) -> str:
    parts = [f"{r['op']} n={r['n']} rows={r['rows']}"]
    for k, v in r.items():
        if k.endswith("_GBs") or k.startswith("x_") or k.startswith("rtk_%"):
            parts.append(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
        if k.endswith("_error"):
            parts.append(f"{k}={v}")
    return " ".join(parts)


def main():
    p = benchutil.parser(__doc__.splitlines()[0])
    p.add_argument("--ops", default="rmsnorm,layernorm,softmax,ce,adamw")
    p.add_argument("--variants", nargs="?", const="all", default="",
                   help="time the norm backward's variants (NORM_VARIANTS names, comma-separated; no value: all)")
    p.add_argument("--widths", default="",
                   help="row widths of the norm / softmax cases, comma-separated (default: NORM_WIDTHS, "
                        "with --quick QUICK_NORM_WIDTHS)")
    p.add_argument("--x-mib", type=int, default=0,
                   help="MiB of x per norm / softmax case (default ROW_BYTES, 64; 342 makes dy + x + dx the 1 GiB "
                        "of the copy they are measured against, so no ramp or tail of a shorter run is in the gap)")
    args = p.parse_args()
    import cupy as cp
    import rtkernels as rtk
    torch = _torch()
    t0 = time.time()
    env = benchutil.environment()
    if torch is not None:
        env["torch"] = torch.__version__
    copy_gbs = benchutil.copy_bandwidth(1 << 30)
    print(f"device copy {copy_gbs:.0f} GB/s ({env['gpu']})", flush=True)
    widths = tuple(int(w) for w in args.widths.split(",")) if args.widths else \
        QUICK_NORM_WIDTHS if args.quick else NORM_WIDTHS
    rows = bench_rows(args, cp, rtk, torch, copy_gbs, widths)
    if "ce" in args.ops.split(","):
        rows += bench_ce(args, cp, rtk, torch, copy_gbs, QUICK_CE_CASES if args.quick else CE_CASES)
    if "adamw" in args.ops.split(","):
        rows += bench_adamw(args, cp, rtk, torch, copy_gbs)
    path = benchutil.save(args.out, "bench_training", {"environment": env, "copy_GBs": copy_gbs, "rows": rows})
    print(f"\n{env['gpu']} ({env['arch']}, {env['date']}): device copy {copy_gbs:.0f} GB/s; JSON {path}; "
          f"{time.time() - t0:.0f} s")
    cols = ["op", "n", "rows", "MiB", "rtk_GBs", "rtk_%copy", "rtk_%copy_same_size", "rtk_recompute_GBs",
            "rtk_loss_only_GBs", "torch_GBs", "x_torch", "torch_fused_GBs", "x_torch_fused", "torch_foreach_GBs",
            "torch_fused_bf16_states_GBs", "liger_GBs", "x_liger", "quack_GBs", "x_quack", "rtk_host_us",
            "torch_fused_host_us"]
    present = [c for c in cols if any(c in r for r in rows)]
    norm_rows = [r for r in rows if r["op"] in ("rmsnorm_bwd", "layernorm_bwd")]
    if args.variants:   # what each variant ran, then (last) its % of copy
        for r in norm_rows:
            for k in ["rtk"] + [f"v_{v}" for v in NORM_VARIANTS]:
                if f"{k}_cfg" in r:
                    print(f"  {r['op']} n={r['n']} {k}: {r[f'{k}_cfg']}")
    print(benchutil.table(rows, present))
    if args.variants:
        vcols = ["op", "n", "rtk_%copy"] + [f"v_{k}_%copy" for k in NORM_VARIANTS]
        print("\n% of the 1 GiB copy per variant (rtk = the heuristic config):")
        print(benchutil.table(norm_rows, [c for c in vcols if any(c in r for r in norm_rows)]))


if __name__ == "__main__":
    main()
