"""Benchmark rtk.matmul against cuBLAS: TFLOP/s over square sizes, and the fused epilogue.

Run on a GPU host:  PYTHONPATH=. python tools/bench_matmul.py [--quick] [--dtype bfloat16] [--out DIR]

* square M = N = K from 256 to 8192, with the awkward 1792 / 1793 / 4095 (wave and tile
  quantization); FLOPs = 2 M N K;
* peers in the same run: cuBLAS through torch.matmul (bfloat16; CuPy has no bfloat16) or
  cupy.matmul (float16);
* rtk with the heuristic config, and (unless --no-tune) with the autotuner (RTKERNELS_AUTOTUNE=1,
  tuning file in a temporary folder so an old winner cannot leak in);
* fused bias + GELU at 4096^3 vs cuBLAS (bias fused by cuBLAS in addmm) + a separate GELU pass;
* inputs rotate among enough copies to exceed twice the L2; CUDA events, warm-up, median.
Prints a table last; writes matmul.json and matmul.png (TFLOP/s vs size, waves annotated).

--sweep (alone, well under 4 minutes): bfloat16 4096^3 and 8192^3 for each config of SWEEP
(tile, k-depth, stages, warps, group order) launched directly, beside cuBLAS, plus the fused
bias + GELU of the best ones vs cuBLAS addmm + GELU; prints one compact table last and writes
matmul_sweep.json.  It is how the heuristics table is set.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchutil  # noqa: E402

SIZES = [256, 512, 1024, 1536, 1792, 1793, 2048, 3072, 4095, 4096, 6144, 8192]
QUICK = [256, 1024, 1792, 1793, 4095, 4096, 8192]


def main() -> None:
    p = benchutil.parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--no-tune", action="store_true", help="skip the autotuned column")
    p.add_argument("--sweep", action="store_true", help="only the config sweep at 4096^3 / 8192^3 (bfloat16)")
    args = p.parse_args()
    if args.sweep:
        sweep(args)
        return
    os.environ.setdefault("RTKERNELS_AUTOTUNE", "0")
    tune_dir = tempfile.mkdtemp(prefix="rtk-bench-tune-")

    import cupy as cp
    import numpy as np
    import torch
    import rtkernels as rtk
    from rtkernels import arch, autotune, cache, device
    from rtkernels.ops import matmul as mm

    tdt = getattr(torch, args.dtype)
    l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice()).get("l2CacheSize", 50 << 20))
    sms = device.sm_count()
    repeat = 10 if args.quick else 20

    def sets_for(n, k, m, extra=()):
        per = 2 * (n * k + k * m + n * m)
        count = max(1, min(8, -(-2 * l2 // per)))
        out = []
        for _ in range(count):
            a = torch.randn(n, k, device="cuda", dtype=tdt)
            b = torch.randn(k, m, device="cuda", dtype=tdt)
            out.append((a, b) + tuple(e() for e in extra))
        return out

    def peer_mm(a, b):
        if args.dtype == "float16":
            return cp.matmul(cp.from_dlpack(a), cp.from_dlpack(b))
        return torch.matmul(a, b)

    rows = []
    for n in (QUICK if args.quick else SIZES):
        sets = sets_for(n, n, n)
        outs = [torch.empty(n, n, device="cuda", dtype=tdt) for _ in range(2)]
        flops = 2.0 * n ** 3
        ms_peer = benchutil.time_cuda(peer_mm, inputs=sets, repeat=repeat)
        ms_rtk = benchutil.time_cuda(lambda a, b: rtk.matmul(a, b, out=outs[0]), inputs=sets, repeat=repeat)
        cfg = mm.heuristic_config(args.dtype, n, n, n, sm_count=sms)
        tile = next(t for t in mm.TC_TILES if (t.block_m, t.block_n) == (cfg.block_m, cfg.block_n))
        w = arch.waves(arch.matmul_tiles(n, n, cfg.block_m, cfg.block_n), sms, tile.blocks_per_sm)
        row = {"n": n, "cublas_tflops": flops / ms_peer / 1e9, "rtk_tflops": flops / ms_rtk / 1e9,
               "tile": f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/{cfg.num_stages}", "waves": w.waves,
               "tail": round(w.tail_efficiency, 2)}
        ref = peer_mm(*sets[0][:2])
        got = rtk.matmul(*sets[0][:2], out=outs[1])
        ref_t = torch.from_dlpack(ref) if not isinstance(ref, torch.Tensor) else ref
        row["max_rel_err"] = float(((got.float() - ref_t.float()).abs().max() / ref_t.float().abs().max()).item())
        if not args.no_tune:
            old = os.environ.get("RTKERNELS_CACHE_DIR")
            os.environ["RTKERNELS_AUTOTUNE"] = "1"
            os.environ["RTKERNELS_CACHE_DIR"] = tune_dir   # fresh tuning file; kernels recompile once
            try:
                rtk.matmul(*sets[0][:2], out=outs[0])     # tunes
                ms_tuned = benchutil.time_cuda(lambda a, b: rtk.matmul(a, b, out=outs[0]), inputs=sets,
                                               repeat=repeat)
                row["tuned_tflops"] = flops / ms_tuned / 1e9
                hits = [e for k_, e in autotune.load().items() if f'"k.m":{mm._bucket(n)},' in k_]
                c_ = hits[0]["config"] if hits else None
                row["tuned_tile"] = (f"{c_['block_m']}x{c_['block_n']}x{c_['block_k']}/{c_['num_stages']}"
                                     if c_ else "")
            finally:
                os.environ["RTKERNELS_AUTOTUNE"] = "0"
                if old is None:
                    os.environ.pop("RTKERNELS_CACHE_DIR", None)
                else:
                    os.environ["RTKERNELS_CACHE_DIR"] = old
        row["vs_cublas"] = row["rtk_tflops"] / row["cublas_tflops"]
        rows.append(row)
        del sets
        torch.cuda.empty_cache()

    # fused bias + GELU vs cuBLAS (bias in its epilogue) + one GELU pass
    n = 4096
    sets = sets_for(n, n, n, extra=(lambda: torch.randn(n, device="cuda", dtype=tdt),))
    out = torch.empty(n, n, device="cuda", dtype=tdt)
    ms_fused = benchutil.time_cuda(lambda a, b, bias: rtk.matmul(a, b, bias=bias, activation="gelu", out=out),
                                   inputs=sets, repeat=repeat)
    ms_sep = benchutil.time_cuda(lambda a, b, bias: torch.nn.functional.gelu(torch.addmm(bias, a, b)),
                                 inputs=sets, repeat=repeat)
    a, b, bias = sets[0]
    ref = torch.nn.functional.gelu(torch.addmm(bias, a, b))
    got = rtk.matmul(a, b, bias=bias, activation="gelu")
    fused = {"n": n, "rtk_fused_ms": ms_fused, "cublas_plus_gelu_ms": ms_sep, "speedup": ms_sep / ms_fused,
             "max_rel_err": float(((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item())}

    payload = {"environment": benchutil.environment(), "dtype": args.dtype, "square": rows, "fused_bias_gelu": fused}
    benchutil.save(args.out, "matmul", payload)
    _plot(args.out, rows, args.dtype, payload["environment"])
    cols = ["n", "cublas_tflops", "rtk_tflops", "vs_cublas"] + ([] if args.no_tune else ["tuned_tflops", "tuned_tile"])
    print(f"{payload['environment']['gpu']}  {args.dtype}  ({sms} SMs)")
    print(benchutil.table(rows, cols + ["tile", "waves", "tail", "max_rel_err"]))
    print(benchutil.table([fused], ["n", "rtk_fused_ms", "cublas_plus_gelu_ms", "speedup", "max_rel_err"]))


# (label, MatmulConfig fields): every variant the lead compares in one --sweep run.
SWEEP = [
    ("128x256x32/4 g8", dict(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=4, warps_m=2)),
    ("128x256x32/3 g8", dict(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=3, warps_m=2)),
    ("128x256x32/4 g16", dict(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=4, warps_m=2,
                              group_m=16)),
    ("128x256x64/3 g8", dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, warps_m=2)),
    ("256x128x32/4 g8", dict(block_m=256, block_n=128, block_k=32, num_warps=8, num_stages=4, warps_m=4)),
    ("256x128x64/3 g8", dict(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3, warps_m=4)),
    ("256x128x32/4 g16", dict(block_m=256, block_n=128, block_k=32, num_warps=8, num_stages=4, warps_m=4,
                              group_m=16)),
    ("128x128x32/4 w4", dict(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=4, warps_m=2)),
    ("128x128x64/3 w4", dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3, warps_m=2)),
]


def sweep(args) -> None:
    import cupy as cp
    import torch
    import rtkernels as rtk
    from rtkernels import device
    from rtkernels.ops import matmul as mm
    from rtkernels.ops._arrays import as_device_array

    tdt = torch.bfloat16
    l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice()).get("l2CacheSize", 50 << 20))
    sms = device.sm_count()
    arch = device.current_arch()
    rows, fused_rows = [], []
    for n in (4096, 8192):
        per = 2 * 3 * n * n
        sets_t = [(torch.randn(n, n, device="cuda", dtype=tdt), torch.randn(n, n, device="cuda", dtype=tdt),
                   torch.randn(n, device="cuda", dtype=tdt)) for _ in range(max(1, min(4, -(-2 * l2 // per))))]
        sets = [tuple(as_device_array(x, "bench", "x") for x in s_) for s_ in sets_t]
        out_t = torch.empty(n, n, device="cuda", dtype=tdt)
        out = as_device_array(out_t, "bench", "out")
        flops = 2.0 * n ** 3
        ms_cublas = benchutil.time_cuda(lambda a, b, _: torch.matmul(a, b), inputs=sets_t, repeat=10)
        ref = torch.matmul(sets_t[0][0], sets_t[0][1]).float()
        row = {"n": n, "cuBLAS": round(flops / ms_cublas / 1e9)}
        heur = mm.heuristic_config("bfloat16", n, n, n, sm_count=sms, a_kmajor=True, b_kmajor=False)
        row["heuristic"] = f"{heur.block_m}x{heur.block_n}x{heur.block_k}/{heur.num_stages}"
        for label, fields in SWEEP:
            try:
                cfg = mm.MatmulConfig(dtype="bfloat16", a_kmajor=True, b_kmajor=False, even_k=n % fields["block_k"] == 0,
                                      **fields)
                k_ = rtk.get_kernel(cfg, arch=arch)
            except Exception as e:   # a variant that does not build is reported, not fatal
                row[label] = f"err {type(e).__name__}"
                continue
            tiles = -(-n // cfg.block_m) * -(-n // cfg.block_n)

            def run(a, b, bias, cfg=cfg, k_=k_, tiles=tiles):
                k_.launch((tiles, 1, 1), (cfg.threads_per_block, 1, 1), a, b, None, out, n, n, n, n, n, n, 0, 0, 0,
                          8, shared_mem=cfg.shared_mem_bytes)
            ms = benchutil.time_cuda(run, inputs=sets, repeat=10)
            run(*sets[0])
            err = float(((out_t.float() - ref).abs().max() / ref.abs().max()).item())
            tf = flops / ms / 1e9
            spill = k_.resources.spill_stores
            row[label] = f"{tf:.0f} ({ms_cublas / ms:.2f}x)" + (" BAD" if err > 1e-2 else "") + \
                (f" spill{spill}" if spill else "")
            row[label + " regs"] = k_.resources.registers
            if n == 4096:
                fused_rows.append((label, cfg, sets, sets_t, tiles))
        rows.append(row)
        if n == 4096:
            ms_sep = benchutil.time_cuda(lambda a, b, bias: torch.nn.functional.gelu(torch.addmm(bias, a, b)),
                                         inputs=sets_t, repeat=10)
            f = {"n": n, "cuBLAS addmm+gelu ms": round(ms_sep, 4)}
            for label, cfg, sets_, _, tiles in fused_rows:
                fc = cfg.replace(has_bias=True, activation="gelu")
                kf = rtk.get_kernel(fc, arch=arch)

                def runf(a, b, bias, fc=fc, kf=kf, tiles=tiles):
                    kf.launch((tiles, 1, 1), (fc.threads_per_block, 1, 1), a, b, bias, out, n, n, n, n, n, n, 0, 0, 0,
                              8, shared_mem=fc.shared_mem_bytes)
                ms = benchutil.time_cuda(runf, inputs=sets_, repeat=10)
                f[label] = f"{ms:.3f}ms ({ms_sep / ms:.2f}x)"
            fused_rows = [f]
        del sets, sets_t
        torch.cuda.empty_cache()

    benchutil.save(args.out, "matmul_sweep", {"environment": benchutil.environment(), "square": rows,
                                              "fused_bias_gelu": fused_rows})
    print(f"{benchutil.environment()['gpu']}  bfloat16 sweep  ({sms} SMs); cell = TFLOP/s (x cuBLAS)")
    labels = [lbl for lbl, _ in SWEEP]
    flat = []
    for lbl in labels:
        flat.append({"config": lbl, **{f"n={r['n']}": r.get(lbl, "") for r in rows},
                     "regs": rows[0].get(lbl + " regs", ""), "fused 4096 (x sep)": fused_rows[0].get(lbl, "")})
    flat.append({"config": "cuBLAS", **{f"n={r['n']}": r["cuBLAS"] for r in rows}, "regs": "",
                 "fused 4096 (x sep)": f"{fused_rows[0]['cuBLAS addmm+gelu ms']}ms"})
    print("heuristic picks: " + ", ".join(f"{r['n']}: {r['heuristic']}" for r in rows))
    print(benchutil.table(flat, ["config"] + [f"n={r['n']}" for r in rows] + ["regs", "fused 4096 (x sep)"]))


def _plot(out, rows, dtype, env):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.8))
    xs = [r["n"] for r in rows]
    ax.plot(xs, [r["cublas_tflops"] for r in rows], marker="o", label="cuBLAS")
    ax.plot(xs, [r["rtk_tflops"] for r in rows], marker="s", label="rtk (heuristic)")
    if "tuned_tflops" in rows[0]:
        ax.plot(xs, [r["tuned_tflops"] for r in rows], marker="^", label="rtk (autotuned)")
    for r in rows:
        ax.annotate(f"{r['waves']}w {r['tail']:.0%}", (r["n"], r["rtk_tflops"]), textcoords="offset points",
                    xytext=(0, -14), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M = N = K")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"matmul {dtype} on {env['gpu']} (labels: waves, last-wave fill)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    Path(out).mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(Path(out) / "matmul.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
