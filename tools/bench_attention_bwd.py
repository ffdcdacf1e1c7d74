"""Attention backward benchmark: rtk.attention_backward against PyTorch SDPA (flash, cuDNN) backward and
FlashAttention-4's (``flash_attn.cute.flash_attn_func`` through autograd, when importable:
../shared/anchors/README.md), timed the same way as SDPA's.  ``ratio_vs_best`` = rtk over the faster of FA4
and SDPA cuDNN (the target is >= 1.0).

FlashAttention's grid: 16k tokens per batch (batch = 16384 / seqlen), hidden 2048 (nheads =
2048 / head_dim), head dims 64 and 128 (+256), seqlen 1k..16k, causal and not.
Backward FLOPs = 2.5 x forward FLOPs (5 matmuls vs 2): 10 * b * s * s * h * d, halved for causal.
Columns: rtk backward (default = f32 RED for dQ, and deterministic), each peer's backward alone
(autograd graph kept, ``out.backward(do, retain_graph=True)``), and forward+backward
(FLOPs 3.5 x forward) for rtk and peers.  Every candidate and peer of a cell is built first, then timed
in turn over ``--rounds`` rounds of batched calls (:func:`benchutil.time_interleaved`, the median): one call
between two events, one candidate after another, timed host time and clock drift (2026-11-26, H100).
Run on the GPU host:

    PYTHONPATH=. python tools/bench_attention_bwd.py --out results/ [--quick] [--dtype bfloat16]
    PYTHONPATH=. python tools/bench_attention_bwd.py --grid fa --out results/   # issue 24's grid, compact table
    PYTHONPATH=. python tools/bench_attention_bwd.py --sweep [--quick]   # every tile candidate
    PYTHONPATH=. python tools/bench_attention_bwd.py --quick --head-dims 64,128 --template old.cu.j2
    PYTHONPATH=. python tools/bench_attention_bwd.py --head-dims 192,256 --seqlens 4096,16384 --with-mma

--with-mma adds a column timing the mma.sync kernel (the Hopper kernels switched off) in the same
run: head dims 136..256 ran on it before attention_bwd_sm90_big.  --alt dq_mode=bulk adds a column
timing the dispatched config with those fields replaced (cells whose config has no such field or
rejects the value are left empty), e.g. the big kernel's dQ bulk reductions against its default;
repeat it for more columns (alt2_*, ...), e.g. the big kernel's layout="qk" with 96 keys:
``--alt layout=qk,key_block=96,dq_mode=red,num_stages=2 --alt layout=qk,key_block=96,dq_mode=ring,num_stages=2``,
or FlashAttention-4's d192 rings (two Q stages, one dO stage, one dS buffer):
``--alt layout=qk,key_block=96,num_stages=2,do_stages=1,ds_buffers=1,dq_mode=bulk``.  With --grid the compact
table last carries each alt's TFLOP/s and its ratio to the faster peer.
The Hopper backward's 128 query rows per step at head dim 64 against the default 64:
``--head-dims 64 --alt block_m=128 --alt block_m=128,deterministic=true`` (the second column against
the default non-deterministic rtk_tflops; compare it with rtk_det_tflops).

--template times the Hopper backward compiled from another version of its template (before /
after a change: ``git show BASE:templates/attention_bwd_sm90.cu.j2 > old.cu.j2``), same grid;
run it and the tree's in one session to compare.

--sweep (alias --tune) times every candidate of ``tile_space`` (tiles x dq modes, spilling ones
pruned, deterministic ones too) at head dims 64/128, seqlens 2k/4k/8k, causal and not, beside
SDPA flash and cuDNN in the same run: the data the heuristics table is set from.

Each tensor is 16k x 2048 elements (64 MiB in 16 bits) - beyond L2, no rotation.  Gradients of
each peer are compared with ours once (max abs diff in the JSON) before timing.
"""
from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402
from bench_attention import COMPACT, FA_GRID, HIDDEN, TOKENS, _flops, _inputs  # noqa: E402  (the forward's grid)


def _fwd_flops(b, s, h, d, causal):
    return _flops(b, s, s, h, d, causal)


def _ours(q, k, v, do, causal, dtype, deterministic, torch, config=None):
    """(backward-only launcher, forward+backward launcher, grads, config)."""
    A = importlib.import_module("rtkernels.ops.attention")
    B = importlib.import_module("rtkernels.ops.attention_bwd")
    extra = {} if torch is not None else ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})
    o, lse = A.attention(q, k, v, causal=causal, **extra)
    grads = B.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=deterministic, config=config,
                                 **extra)
    dq, dk, dv = grads

    def bwd():
        B.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                             config=config, **extra)

    def fwd_bwd():
        A.attention(q, k, v, causal=causal, out=o, **extra)
        bwd()
    import cupy as cp
    arch = A._device_arch(cp.cuda.runtime.getDevice())
    H = importlib.import_module("rtkernels.ops.attention_bwd_sm90")
    if config is None and H.is_sm90(arch) and H.picks(q.shape[-1], causal):
        config = H.choose_config(dtype, q.shape[-1], causal, deterministic)   # what the op dispatches to
    cfg = config or B.choose_config(dtype, q.shape[-1], causal, deterministic, arch)
    return bwd, fwd_bwd, grads, cfg


def _sdpa(q, k, v, do, causal, backend, torch):
    """((backward, forward+backward), grads, None), or (None, None, why) where SDPA refuses the cell."""
    from torch.nn.attention import sdpa_kernel
    F = torch.nn.functional
    leaves = tuple(x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))

    def fwd(qt, kt, vt):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    try:
        bwd, fwd_bwd, grads = bu.autograd_timers(fwd, leaves, do.transpose(1, 2))
    except RuntimeError as exc:
        return None, None, str(exc).splitlines()[0][:80]
    return (bwd, fwd_bwd), tuple(g.transpose(1, 2) for g in grads), None


def _fa4(q, k, v, do, causal, torch):
    """FlashAttention-4's backward through autograd, timed like SDPA's (backward alone on the kept
    graph; forward+backward): ((backward, forward+backward), grads, None), or (None, None, why).  Its
    forward and backward compile here (2-6 s each per configuration), outside the timing."""
    fn = bu.fa4()[0]
    if fn is None:
        return None, None, "FA4 not importable"
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    try:
        bwd, fwd_bwd, grads = bu.autograd_timers(lambda a, b, c: fn(a, b, c, causal=causal), leaves, do)
    except Exception as exc:   # noqa: BLE001  (a head dim, dtype or GPU it refuses)
        return None, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    return (bwd, fwd_bwd), grads, None


def _max_diff(ours, theirs, torch):
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(ours, theirs))


def _prebuild(cfgs, arch):
    """Compile every kernel of ``cfgs`` in parallel worker processes (into the disk cache)."""
    import dataclasses
    import time
    from rtkernels import inspect as rinspect
    t0 = time.perf_counter()
    jobs = min(16, os.cpu_count() or 1)
    for name, sel in (("attention_bwd", cfgs), ("attention_bwd_dq", [c for c in cfgs if c.dq_mode == "pass"])):
        params = [{f.name: getattr(c, f.name) for f in dataclasses.fields(c)} for c in sel]
        if params:
            rinspect.sweep("attention_backward", params, arch=arch, jobs=jobs, kernel=name)
    print(f"prebuilt {len(cfgs)} configs in {time.perf_counter() - t0:.1f} s", flush=True)


def sweep(args, env, torch, peers):
    """Time every tile candidate against the peers; returns (rows, summary)."""
    import cupy as cp
    B = importlib.import_module("rtkernels.ops.attention_bwd")
    A = importlib.import_module("rtkernels.ops.attention")
    arch = A._device_arch(cp.cuda.runtime.getDevice())
    head_dims = [64, 128]
    seqlens = [4096] if args.quick else [2048, 4096, 8192]
    space = {}
    for d in head_dims:
        for causal in (False, True):
            space[(d, causal)] = (B.tile_space(args.dtype, d, causal, False, arch)
                                  + B.tile_space(args.dtype, d, causal, True, arch)[:6])
    _prebuild([c for v in space.values() for c in v], arch)
    pruned = {}
    for key, cfgs in space.items():
        keep = []
        for c in cfgs:
            r = importlib.import_module("rtkernels.kernel").get_kernel(c, "attention_bwd", arch=arch).resources
            if r.spill_stores or r.spill_loads:
                pruned.setdefault(B.describe(c), r.spill_stores)
            else:
                keep.append((c, r.registers))
        space[key] = keep
    if pruned:
        print(f"pruned (spills, bytes): {pruned}", flush=True)
    warmup, repeat = 1, 4
    rows, summary = [], []
    for (d, causal), cfgs in space.items():
        h = HIDDEN // d
        for s in seqlens:
            b = max(1, TOKENS // s)
            q, k, v, do = _inputs(b, s, h, d, args.dtype, torch, count=4)
            fl = 2.5 * _fwd_flops(b, s, h, d, causal)
            case = {"head_dim": d, "causal": causal, "seqlen": s}
            ref = None
            res = {}
            for i, (cfg, regs) in enumerate(cfgs):
                bwd, _, grads, _ = _ours(q, k, v, do, causal, args.dtype, cfg.deterministic, torch, config=cfg)
                if ref is None:
                    ref = grads
                    maxdiff = 0.0
                else:
                    maxdiff = _max_diff(grads, ref, torch) if torch is not None else None
                tf = fl / (bu.time_cuda(bwd, warmup=warmup, repeat=repeat) * 1e-3) / 1e12
                tag = ("det " if cfg.deterministic else "") + B.describe(cfg)
                res[tag] = tf
                rows.append({**case, "tile": tag, "heuristic": i == 0 or (cfg.deterministic and cfg == cfgs[0][0]),
                             "registers": regs, "tflops": tf, "maxdiff_vs_heuristic": maxdiff})
                del bwd, grads
            peer_tf = {}
            for name, backend in peers.items():
                fns, pgrads, note = _sdpa(q, k, v, do, causal, backend, torch)
                if fns is None:
                    peer_tf[name] = None
                    continue
                peer_tf[name] = fl / (bu.time_cuda(fns[0], warmup=warmup, repeat=repeat) * 1e-3) / 1e12
                del fns, pgrads
            nondet = {t: x for t, x in res.items() if not t.startswith("det ")}
            det = {t: x for t, x in res.items() if t.startswith("det ")}
            heur = B.describe(cfgs[0][0])
            heur_det = next((t for t in det if t[4:] == B.describe(
                B.choose_config(args.dtype, d, causal, True, arch))), None)
            best = max(nondet, key=nondet.get)
            best_det = max(det, key=det.get) if det else None
            row = {**case, "heuristic": heur, "heur_tflops": nondet.get(heur), "best": best,
                   "best_tflops": nondet[best], "best_det": best_det, "best_det_tflops": det.get(best_det),
                   "det_ratio": (det[best_det] / nondet[best]) if best_det else None,
                   "heur_det_ratio": (det[heur_det] / nondet[heur]) if heur_det and heur in nondet else None}
            for name, tf in peer_tf.items():
                row[f"{name}_tflops"] = tf
                row[f"best_vs_{name}"] = nondet[best] / tf if tf else None
            summary.append(row)
            print({k_: (round(v_, 1) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
            del q, k, v, do, ref
            if torch is not None:
                torch.cuda.empty_cache()
            cp.get_default_memory_pool().free_all_blocks()
    return rows, summary, arch


def _print_sweep(rows, summary, env, args):
    print(f"\n{env['gpu']} ({env['arch']}), NVRTC {env['nvrtc']}, {args.dtype}: backward TFLOP/s per candidate")
    cases = sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in rows})
    for d in sorted({c[0] for c in cases}):
        cols = [c for c in cases if c[0] == d]
        tiles = list(dict.fromkeys(r["tile"] for r in rows if r["head_dim"] == d))
        mat = []
        for t in tiles:
            line = {"tile": t}
            for (dd, causal, s) in cols:
                hit = [r for r in rows if (r["head_dim"], r["causal"], r["seqlen"], r["tile"]) == (dd, causal, s, t)]
                line[f"{'c' if causal else 'n'}{s // 1024}k"] = hit[0]["tflops"] if hit else None
            line["regs"] = next(r["registers"] for r in rows if r["tile"] == t and r["head_dim"] == d)
            mat.append(line)
        print(f"\nd={d}")
        print(bu.table(mat, ["tile"] + [f"{'c' if c else 'n'}{s // 1024}k" for (_, c, s) in cols] + ["regs"]))
    print("\nsummary (best = fastest non-deterministic candidate; det_ratio = best det / best)")
    cols = ["head_dim", "causal", "seqlen", "heuristic", "heur_tflops", "best", "best_tflops",
            "sdpa_flash_tflops", "best_vs_sdpa_flash", "sdpa_cudnn_tflops", "best_vs_sdpa_cudnn", "best_det",
            "best_det_tflops", "det_ratio", "heur_det_ratio"]
    print(bu.table(summary, cols))


def _alt_config(cfg, spec: str):
    """``cfg`` with the fields of ``spec`` ("name=value,...") replaced (with one ring stage where
    two no longer fit, unless num_stages is given); None where it has no such field or rejects
    the value."""
    import dataclasses
    from rtkernels.errors import ConfigError
    names = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in names:
            return None
        changes[name] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    for extra in ({}, {"num_stages": 1}):
        if extra and ("num_stages" in changes or "num_stages" not in names):
            break
        try:
            return cfg.replace(**changes, **extra)
        except ConfigError:
            continue
    return None


def _use_template(path: str, big: bool = False) -> None:
    """The Hopper backward's kernels compiled from the template file ``path`` (same config
    parameters and options) wherever the op would use the tree's templates/attention_bwd_sm90.cu.j2
    (``big``: templates/attention_bwd_sm90_big.cu.j2, head dims 136..256); the other family's
    configs keep the tree's template."""
    from rtkernels.kernel import Kernel, build_module, resolve_arch
    from rtkernels.render import Template
    H = importlib.import_module("rtkernels.ops.attention_bwd_sm90")
    BIG = importlib.import_module("rtkernels.ops.attention_bwd_sm90_big")
    tpl = Template.from_file(path)
    tree_kernels_for = H.kernels_for

    def kernels_for(cfg, arch="sm_90a"):
        if isinstance(cfg, BIG.AttentionBwdSm90BigConfig) != big:
            return tree_kernels_for(cfg, arch)
        key = ("template", str(path), cfg, arch)
        hit = H._KERNELS.get(key)
        if hit is None:
            module = build_module(tpl, cfg.template_params(), label=cfg.family, config_repr=cfg.key(),
                                  arch=resolve_arch(arch, True), options=cfg.compile_options())
            hit = H._KERNELS[key] = tuple(Kernel(module, name, cfg) for name in cfg.kernels)
        return hit
    H.kernels_for = kernels_for


def main():
    p = bu.parser(__doc__)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    p.add_argument("--no-sm90", action="store_true",
                   help="time the mma.sync kernel on sm_90 too (rtk.attention_backward's Hopper kernel off)")
    p.add_argument("--sweep", "--tune", action="store_true",
                   help="time every tile candidate (d 64/128, seqlens 2k/4k/8k) beside the peers")
    p.add_argument("--with-mma", action="store_true",
                   help="also time the mma.sync kernel (Hopper kernels off) in each cell: column rtk_mma_tflops")
    p.add_argument("--alt", action="append", default=None,
                   help="NAME=VALUE[,NAME=VALUE]: also time the dispatched config with these fields (rtk_alt_tflops; "
                        "repeat the option for more columns: rtk_alt2_tflops, ...)")
    p.add_argument("--template", default=None,
                   help="compile the Hopper backward from this template file (before/after timings)")
    p.add_argument("--template-big", default=None,
                   help="the same for head dims 136..256 (a version of templates/attention_bwd_sm90_big.cu.j2)")
    p.add_argument("--grid", choices=["fa"], default=None,
                   help="fa: FlashAttention's grid of issue 24 (head dims 64,128,192,256 x seqlens 2k,4k,16k), "
                        "compact table (rtk, FA4, cuDNN, rtk / best) last")
    p.add_argument("--tag", default="", help="suffix of the JSON/PNG names")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved timing rounds per cell (every candidate and peer timed in turn; median; "
                        "default 3, 2 with --quick)")
    args = p.parse_args()
    if args.grid:
        args.head_dims = FA_GRID["backward"]["head_dims"] if "--head-dims" not in sys.argv else args.head_dims
        args.seqlens = FA_GRID["backward"]["seqlens"] if "--seqlens" not in sys.argv else args.seqlens
        args.tag = args.tag or args.grid
    sfx = f"_{args.tag}" if args.tag else ""
    if args.template:
        _use_template(args.template)
    if args.template_big:
        _use_template(args.template_big, big=True)
    env = bu.environment()
    torch, peers = bu.attention_peers(env)
    if args.no_sm90:
        importlib.import_module("rtkernels.ops.attention_bwd_sm90").ENABLED = False
    if args.sweep:
        import cupy as cp
        cp.cuda.Device().synchronize()
        rows, summary, arch = sweep(args, env, torch, peers)
        bu.save(args.out, "bench_attention_bwd_sweep", {"env": env, "dtype": args.dtype, "arch": arch, "rows": rows,
                                                         "summary": summary})
        _print_sweep(rows, summary, env, args)
        return
    head_dims = [int(x) for x in args.head_dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    if args.quick:
        head_dims, seqlens = [d for d in head_dims if d in (64, 128)] or head_dims[:2], [2048, 4096]
    rounds = args.rounds or (2 if args.quick else 3)
    import cupy as cp
    cp.cuda.Device().synchronize()

    rows = []
    for d in head_dims:
        h = HIDDEN // d
        for causal in (False, True):
            for s in seqlens:
                b = max(1, TOKENS // s)
                q, k, v, do = _inputs(b, s, h, d, args.dtype, torch, count=4)
                fl = _fwd_flops(b, s, h, d, causal)
                row = {"head_dim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h}
                # every candidate built first, then timed interleaved over rounds (benchutil.time_interleaved)
                runs = {}   # row key -> (fn, FLOP factor)
                bwd, fwd_bwd, grads, cfg = _ours(q, k, v, do, causal, args.dtype, False, torch)
                row["config"] = importlib.import_module("rtkernels.ops.attention_bwd").describe(cfg)
                runs["rtk_tflops"], runs["rtk_fwdbwd_tflops"] = (bwd, 2.5), (fwd_bwd, 3.5)
                dbwd, _, _, _ = _ours(q, k, v, do, causal, args.dtype, True, torch)
                runs["rtk_det_tflops"] = (dbwd, 2.5)
                for i, spec in enumerate(args.alt or ()):
                    alt = _alt_config(cfg, spec)
                    n = "" if i == 0 else str(i + 1)   # columns alt_*, alt2_*, ...
                    if alt is not None:
                        adet = bool(getattr(alt, "deterministic", False))   # the op checks config against it
                        abwd, _, agrads, _ = _ours(q, k, v, do, causal, args.dtype, adet, torch, config=alt)
                        row[f"alt{n}_config"] = importlib.import_module("rtkernels.ops.attention_bwd").describe(alt)
                        row[f"alt{n}_maxdiff"] = _max_diff(grads, agrads, torch)
                        runs[f"rtk_alt{n}_tflops"] = (abwd, 2.5)
                        del agrads
                if args.with_mma:
                    H = importlib.import_module("rtkernels.ops.attention_bwd_sm90")
                    H.ENABLED = False
                    try:   # the mma.sync config the op picks with the Hopper kernels off ...
                        mcfg = _ours(q, k, v, do, causal, args.dtype, False, torch)[3]
                    finally:
                        H.ENABLED = True
                    # ... given explicitly, so the timed calls run it with the switch back on
                    runs["rtk_mma_tflops"] = (_ours(q, k, v, do, causal, args.dtype, False, torch, config=mcfg)[0], 2.5)
                for name, backend in peers.items():
                    fns, pgrads, note = _sdpa(q, k, v, do, causal, backend, torch)
                    if fns is None:
                        row[f"{name}_tflops"] = None
                        row[f"{name}_note"] = note
                        continue
                    row[f"{name}_maxdiff"] = _max_diff(grads, pgrads, torch)
                    runs[f"{name}_tflops"], runs[f"{name}_fwdbwd_tflops"] = (fns[0], 2.5), (fns[1], 3.5)
                    del pgrads
                if torch is not None:   # FA4 beside SDPA, same timing; "—" where absent
                    fns, pgrads, note = _fa4(q, k, v, do, causal, torch)
                    if fns is None:
                        row["fa4_tflops"], row["fa4_note"] = None, note
                    else:
                        row["fa4_maxdiff"] = _max_diff(grads, pgrads, torch)
                        runs["fa4_tflops"], runs["fa4_fwdbwd_tflops"] = (fns[0], 2.5), (fns[1], 3.5)
                        del pgrads
                for key, ms in zip(runs, bu.time_interleaved([f for f, _ in runs.values()], rounds)):
                    row[key] = runs[key][1] * fl / (ms * 1e-3) / 1e12
                row["det_ratio"] = row["rtk_det_tflops"] / row["rtk_tflops"]
                for key in [k_ for k_ in row if k_.startswith("rtk_alt") and k_.endswith("_tflops")]:
                    row[key.replace("rtk_", "").replace("_tflops", "_ratio")] = row[key] / row["rtk_tflops"]
                if "rtk_mma_tflops" in row:
                    row["speedup_vs_mma"] = row["rtk_tflops"] / row["rtk_mma_tflops"]
                for name in [*peers, "fa4"]:
                    if row.get(f"{name}_tflops"):
                        row[f"ratio_vs_{name}"] = row["rtk_tflops"] / row[f"{name}_tflops"]
                if torch is not None:
                    bu.ratio_vs_best(row)
                del runs
                rows.append(row)
                print(row, flush=True)
                del q, k, v, do, grads, bwd, fwd_bwd, dbwd
                if torch is not None:
                    torch.cuda.empty_cache()
                cp.get_default_memory_pool().free_all_blocks()

    bu.save(args.out, "bench_attention_bwd" + sfx, {"env": env, "dtype": args.dtype, "rows": rows})
    for d in head_dims:
        series = {}
        for causal in (False, True):
            sel = [r for r in rows if r["head_dim"] == d and r["causal"] == causal]
            tag = "causal" if causal else "non-causal"
            series[f"rtk {tag}"] = ([r["seqlen"] for r in sel], [r["rtk_tflops"] for r in sel])
            series[f"rtk det {tag}"] = ([r["seqlen"] for r in sel], [r["rtk_det_tflops"] for r in sel])
            for name in [*peers, "fa4"]:
                pts = [(r["seqlen"], r[f"{name}_tflops"]) for r in sel if r.get(f"{name}_tflops")]
                if pts:
                    series[f"{name} {tag}"] = tuple(map(list, zip(*pts)))
        bu.plot(args.out, f"bench_attention_bwd{sfx}_d{d}", series, "seqlen", "TFLOP/s (backward)",
                f"attention backward {args.dtype} head_dim={d} ({env['gpu']})")
    cols = ["head_dim", "causal", "seqlen", "config", "rtk_tflops", "rtk_det_tflops", "det_ratio"]
    for i in range(len(args.alt or ())):
        n = "" if i == 0 else str(i + 1)
        cols += [f"alt{n}_config", f"rtk_alt{n}_tflops", f"alt{n}_ratio"]
    if args.with_mma:
        cols += ["rtk_mma_tflops", "speedup_vs_mma"]
    fa4 = ["fa4"] if any("fa4_tflops" in r for r in rows) else []
    for name in [*peers, *fa4]:
        cols += [f"{name}_tflops", f"ratio_vs_{name}"]
    if fa4 or peers:
        cols += ["best_peer", "ratio_vs_best"]
    cols += ["rtk_fwdbwd_tflops"] + [f"{n}_fwdbwd_tflops" for n in [*peers, *fa4]]
    print(f"\n{env['gpu']} ({env['arch']}, {env['sms']} SMs), driver {env['driver']}, NVRTC {env['nvrtc']}, "
          f"{args.dtype}, {env['date']}" + (f", torch {env['torch']}" if torch else " (torch absent: no peers)")
          + (", FA4" if bu.fa4()[0] is not None else ", no FA4"))
    print("backward TFLOP/s = 2.5 x forward FLOPs / time; fwd+bwd = 3.5 x forward FLOPs / time")
    print(bu.table(rows, cols))
    if args.grid:
        # the --alt columns beside the default, each with its ratio to the faster peer
        alts = [("" if i == 0 else str(i + 1), spec) for i, spec in enumerate(args.alt or ())]
        for n, _ in alts:
            for r in rows:
                if r.get(f"rtk_alt{n}_tflops") and r.get("best_peer"):
                    r[f"alt{n}_vs_best"] = r[f"rtk_alt{n}_tflops"] / r[f"{r['best_peer']}_tflops"]
        print("\nbackward TFLOP/s; ratio_vs_best = rtk / max(FA4, SDPA cuDNN) (target >= 1.0); altN_ratio = altN / rtk"
              + "".join(f"; alt{n} = {spec}" for n, spec in alts))
        print(bu.table(rows, COMPACT[:4] + [c for n, _ in alts for c in (f"rtk_alt{n}_tflops", f"alt{n}_ratio",
                                                                         f"alt{n}_vs_best")] + COMPACT[4:]))


if __name__ == "__main__":
    main()
