"""Benchmark rtk.matmul against cuBLAS and Triton: TFLOP/s over square sizes, and the fused epilogue.

Run on a GPU host:  PYTHONPATH=. python tools/bench_matmul.py [--quick] [--dtype bfloat16] [--out DIR]

* square M = N = K from 256 to 8192, with the awkward 1792 / 1793 / 4095 (wave and tile
  quantization); FLOPs = 2 M N K;
* columns, all timed in the same run: cuBLAS through torch.matmul (bfloat16; CuPy has no bfloat16)
  or cupy.matmul (float16); ``rtk`` = what rtk.matmul runs (on sm_90 the TMA + wgmma kernel of
  ops/matmul_sm90.py, elsewhere the mma.sync kernel); ``mma.sync`` = the sm_80 kernel launched
  directly with its heuristic config; ``triton`` = a plain tiled Triton matmul (128x256x64 tiles,
  grouped order, 3 stages, 8 warps: the kernel a user would otherwise write), where triton imports;
* with --tune (not in --quick), rtk with the autotuner (RTKERNELS_AUTOTUNE=1, tuning file in a
  temporary folder so an old winner cannot leak in);
* fused bias + GELU at 4096^3 vs cuBLAS (bias fused by cuBLAS in addmm) + a separate GELU pass;
* inputs rotate among enough copies to exceed twice the L2; CUDA events, warm-up, median; every
  timed call is queued behind a spin kernel (bench_membound.time_gpu), so the columns are kernel
  time and the host's per-call cost of rtk.matmul (Python checks, tensor maps, launch) is reported
  separately as ``rtk_host_us``;
* the mma.sync column is timed last, after the table is saved; on sm_90 only with --mma-sync
  (MMA_SYNC_NOTE).
Prints a table last; writes matmul.json and matmul.png (TFLOP/s vs size, waves annotated).

--sweep (alone, well under 4 minutes): bfloat16 4096^3 and 8192^3 for each config of SWEEP
(mma.sync tile, k-depth, stages, warps, group order) launched directly, beside cuBLAS, plus the
fused bias + GELU of the best ones vs cuBLAS addmm + GELU; prints one compact table last and
writes matmul_sweep.json.  --sweep-sm90 does the same for the Hopper kernel's SWEEP_SM90.
They are how the heuristics tables are set.
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
QUICK = [1024, 1793, 4096, 8192]


def triton_matmul():
    """A plain tiled Triton matmul (None without triton): ``run(a, b, out)`` for 2-D torch tensors."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BM)
        tiles_n = tl.cdiv(N, BN)
        per_group = GROUP * tiles_n
        first_m = (pid // per_group) * GROUP
        rows = min(tiles_m - first_m, GROUP)
        pid_m = first_m + (pid % per_group) % rows
        pid_n = (pid % per_group) // rows
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_p = a_ptr + (rm % M)[:, None] * s_am + rk[None, :] * s_ak
        b_p = b_ptr + rk[:, None] * s_bk + (rn % N)[None, :] * s_bn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_p, mask=rk[None, :] < K - k0, other=0.0)
            b = tl.load(b_p, mask=rk[:, None] < K - k0, other=0.0)
            acc = tl.dot(a, b, acc)
            a_p += BK * s_ak
            b_p += BK * s_bk
        c_p = c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn
        tl.store(c_p, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    def run(a, b, out):
        M, K = a.shape
        N = b.shape[1]
        grid = (triton.cdiv(M, 128) * triton.cdiv(N, 256),)
        kernel[grid](a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
                     out.stride(1), BM=128, BN=256, BK=64, GROUP=8, num_warps=8, num_stages=3)
    return run


def main() -> None:
    p = benchutil.parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--tune", action="store_true", help="add the autotuned column (slow; not with --quick)")
    p.add_argument("--no-tune", action="store_true", help=argparse_suppress())
    p.add_argument("--sweep", action="store_true", help="only the mma.sync config sweep at 4096^3 / 8192^3")
    p.add_argument("--sweep-sm90", action="store_true", help="only the sm_90 config sweep at 4096^3 / 8192^3")
    p.add_argument("--mma-sync", action="store_true",
                   help="add the mma.sync kernel's column on sm_90 (timed last; see MMA_SYNC_NOTE)")
    args = p.parse_args()
    if args.sweep:
        sweep(args)
        return
    if args.sweep_sm90:
        sweep_sm90(args)
        return
    tune = args.tune and not args.quick
    os.environ.setdefault("RTKERNELS_AUTOTUNE", "0")
    tune_dir = tempfile.mkdtemp(prefix="rtk-bench-tune-")

    import cupy as cp
    import torch
    import rtkernels as rtk
    from rtkernels import arch, autotune, device
    from rtkernels.ops import matmul as mm
    from rtkernels.ops import matmul_sm90 as m90
    from rtkernels.ops._arrays import as_device_array

    tdt = getattr(torch, args.dtype)
    l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice()).get("l2CacheSize", 50 << 20))
    sms = device.sm_count()
    on_sm90 = device.current_arch() == "sm_90"
    repeat = 10 if args.quick else 20
    tri = triton_matmul()

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

    def mma_sync(n, bias=None, act="none"):
        """The mma.sync kernel on an n^3 row-major problem, launched directly: run(a, b, out)."""
        vec = next(v for v in (8, 4, 2, 1) if n % v == 0)   # as rtk.matmul picks for n-element rows
        cfg = mm.heuristic_config(args.dtype, n, n, n, sm_count=sms, a_kmajor=True, b_kmajor=False, vec_a=vec,
                                  vec_b=vec, has_bias=bias is not None, activation=act)
        k_ = rtk.get_kernel(cfg)
        tiles = -(-n // cfg.block_m) * -(-n // cfg.block_n)

        def run(a, b, out, bias=None):
            cv = as_device_array(out, "bench", "out")
            k_.launch((tiles, 1, 1), (cfg.threads_per_block, 1, 1), as_device_array(a, "bench", "a"),
                      as_device_array(b, "bench", "b"), None if bias is None else as_device_array(bias, "bench", "bias"),
                      cv, n, n, n, n, n, n, 0, 0, 0, 8 if vec == 8 else 1, shared_mem=cfg.shared_mem_bytes)
        return run, cfg

    def rel_err(got, ref):
        return float(((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item())

    from bench_membound import time_gpu

    def timed(fn, sets):
        return time_gpu(fn, sets, repeat=repeat)[0]

    rows = []
    for n in (QUICK if args.quick else SIZES):
        sets = sets_for(n, n, n)
        outs = [torch.empty(n, n, device="cuda", dtype=tdt) for _ in range(2)]
        flops = 2.0 * n ** 3
        ms_peer = timed(peer_mm, sets)
        ms_rtk, host_us, drained = time_gpu(lambda a, b: rtk.matmul(a, b, out=outs[0]), sets, repeat=repeat)
        cfg_mma = mma_sync(n)[1]
        if on_sm90 and n % 8 == 0:
            cfg = m90.heuristic_config(args.dtype, n, n, n, sm_count=sms)
            tiles = arch.matmul_tiles(n, n, cfg.block_m, cfg.block_n)
            w = arch.waves(tiles, sms, 1)
        else:
            cfg = cfg_mma
            tile = next(t for t in mm.TC_TILES + mm.NARROW_TILES if (t.block_m, t.block_n, t.num_warps) ==
                        (cfg.block_m, cfg.block_n, cfg.num_warps))
            w = arch.waves(arch.matmul_tiles(n, n, cfg.block_m, cfg.block_n), sms, tile.blocks_per_sm)
        row = {"n": n, "cublas_tflops": flops / ms_peer / 1e9, "rtk_tflops": flops / ms_rtk / 1e9,
               "rtk_host_us": round(host_us) if not drained else f"{host_us:.0f} (drained)",
               "tile": f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/{cfg.num_stages}", "waves": w.waves,
               "tail": round(w.tail_efficiency, 2)}
        ref = peer_mm(*sets[0][:2])
        ref_t = torch.from_dlpack(ref) if not isinstance(ref, torch.Tensor) else ref
        row["max_rel_err"] = rel_err(rtk.matmul(*sets[0][:2], out=outs[1]), ref_t)
        if tri is not None:
            ms_tri = timed(lambda a, b: tri(a, b, outs[0]), sets)
            row["triton_tflops"] = flops / ms_tri / 1e9
            tri(*sets[0][:2], outs[1])
            row["triton_err"] = rel_err(outs[1], ref_t)
        if tune:
            old = os.environ.get("RTKERNELS_CACHE_DIR")
            os.environ["RTKERNELS_AUTOTUNE"] = "1"
            os.environ["RTKERNELS_CACHE_DIR"] = tune_dir   # fresh tuning file; kernels recompile once
            try:
                rtk.matmul(*sets[0][:2], out=outs[0])     # tunes
                ms_tuned = timed(lambda a, b: rtk.matmul(a, b, out=outs[0]), sets)
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
    ms_fused = timed(lambda a, b, bias: rtk.matmul(a, b, bias=bias, activation="gelu", out=out), sets)
    ms_plain = timed(lambda a, b, bias: rtk.matmul(a, b, out=out), sets)
    ms_sep = timed(lambda a, b, bias: torch.nn.functional.gelu(torch.addmm(bias, a, b)), sets)
    a, b, bias = sets[0]
    ref = torch.nn.functional.gelu(torch.addmm(bias, a, b))
    got = rtk.matmul(a, b, bias=bias, activation="gelu")
    fused = {"n": n, "rtk_fused_ms": ms_fused, "rtk_plain_ms": ms_plain, "cublas_plus_gelu_ms": ms_sep,
             "speedup": ms_sep / ms_fused, "fused_tflops": 2.0 * n ** 3 / ms_fused / 1e9,
             "max_rel_err": rel_err(got, ref)}

    env = benchutil.environment()
    env["triton"] = __import__("triton").__version__ if tri is not None else None
    payload = {"environment": env, "dtype": args.dtype, "square": rows, "fused_bias_gelu": fused}
    benchutil.save(args.out, "matmul", payload)
    _plot(args.out, rows, args.dtype, payload["environment"])
    if args.mma_sync or not on_sm90:
        # last: the kernel rtk.matmul ran before the sm_90 path, for the record (after the save, so a
        # failure here loses nothing above)
        for row in rows:
            n = row["n"]
            sets = sets_for(n, n, n)
            outs = [torch.empty(n, n, device="cuda", dtype=tdt) for _ in range(2)]
            run_mma = mma_sync(n)[0]
            row["mma_sync_tflops"] = 2.0 * n ** 3 / timed(lambda a, b: run_mma(a, b, outs[0]), sets) / 1e9
            del sets, outs
        benchutil.save(args.out, "matmul", payload)
    cols = ["n", "cublas_tflops", "rtk_tflops", "vs_cublas", "rtk_host_us"]
    cols += ["triton_tflops"] if tri is not None else []
    cols += ["mma_sync_tflops"] if args.mma_sync or not on_sm90 else []
    cols += ["tuned_tflops", "tuned_tile"] if tune else []
    print(f"{payload['environment']['gpu']}  {args.dtype}  ({sms} SMs)  rtk = {'sm_90 TMA+wgmma' if on_sm90 else 'mma.sync'}"
          "  (kernel time; rtk_host_us = host cost per rtk.matmul call)")
    print(benchutil.table(rows, cols + ["tile", "waves", "tail", "max_rel_err"]))
    print(benchutil.table([fused], ["n", "rtk_fused_ms", "rtk_plain_ms", "cublas_plus_gelu_ms", "speedup",
                                    "fused_tflops", "max_rel_err"]))


# On the H200 (driver 13.0), three back-to-back launches of the mma.sync kernel's 64x64x32 / 4-warp
# config at n = 1024 (bf16, even K) in this script end in cudaErrorMisalignedAddress; one launch,
# or thirteen with a synchronize after each, in a fresh process do not.  Under investigation; the
# sm_90 path does not use that kernel for TMA-addressable inputs.
MMA_SYNC_NOTE = "see the comment above"


def argparse_suppress():
    import argparse
    return argparse.SUPPRESS


# (label, MatmulSm90Config fields): the Hopper variants one --sweep-sm90 run compares.
SWEEP_SM90 = [
    ("128x256/4", dict(block_m=128, block_n=256, num_stages=4)),
    ("128x256/3", dict(block_m=128, block_n=256, num_stages=3)),
    ("128x256/4 g16", dict(block_m=128, block_n=256, num_stages=4, group_m=16)),
    ("128x256/4 direct", dict(block_m=128, block_n=256, num_stages=4, tma_store=False)),
    ("128x256/4 g4", dict(block_m=128, block_n=256, num_stages=4, group_m=4)),
    ("128x256/4 g2", dict(block_m=128, block_n=256, num_stages=4, group_m=2)),
    ("256x128/4", dict(block_m=256, block_n=128, num_stages=4)),
    ("256x128/4 g4", dict(block_m=256, block_n=128, num_stages=4, group_m=4)),
    ("128x192/5", dict(block_m=128, block_n=192, num_stages=5)),
    ("128x128/6", dict(block_m=128, block_n=128, num_stages=6)),
    ("128x64/8", dict(block_m=128, block_n=64, num_stages=8)),
]


def _square_problem(torch, tdt, n: int, count: int):
    """``count`` rotated (a, b, bias) sets for an n^3 problem as torch tensors and CuPy views, an
    output, the FLOP count, cuBLAS's time (ms) and its result as the reference: what each sweep
    times its configs against."""
    from rtkernels.ops._arrays import as_device_array
    sets_t = [(torch.randn(n, n, device="cuda", dtype=tdt), torch.randn(n, n, device="cuda", dtype=tdt),
               torch.randn(n, device="cuda", dtype=tdt)) for _ in range(count)]
    sets = [tuple(as_device_array(x, "bench", "x") for x in s_) for s_ in sets_t]
    out_t = torch.empty(n, n, device="cuda", dtype=tdt)
    out = as_device_array(out_t, "bench", "out")
    ms_cublas = benchutil.time_cuda(lambda a, b, _: torch.matmul(a, b), inputs=sets_t, repeat=10)
    ref = torch.matmul(sets_t[0][0], sets_t[0][1]).float()
    return sets_t, sets, out_t, out, 2.0 * n ** 3, ms_cublas, ref


def sweep_sm90(args) -> None:
    import torch
    import rtkernels as rtk
    from rtkernels import device
    from rtkernels.ops import matmul_sm90 as m90

    tdt = getattr(torch, args.dtype)
    sms = device.sm_count()
    rows = []
    fused = {}
    for n in (4096, 8192):
        sets_t, sets, out_t, out, flops, ms_cublas, ref = _square_problem(torch, tdt, n, 2 if n == 4096 else 1)
        row = {"n": n, "cuBLAS": round(flops / ms_cublas / 1e9)}
        heur = m90.heuristic_config(args.dtype, n, n, n, sm_count=sms)
        row["heuristic"] = f"{heur.block_m}x{heur.block_n}/{heur.num_stages}"
        if n == 4096:
            ms_sep = benchutil.time_cuda(lambda a, b, bias: torch.nn.functional.gelu(torch.addmm(bias, a, b)),
                                         inputs=sets_t, repeat=10)
            fused = {"cuBLAS addmm+gelu": f"{ms_sep:.3f}ms"}
        for label, fields in SWEEP_SM90:
            for act in ("none", "gelu") if n == 4096 else ("none",):
                try:
                    cfg = m90.MatmulSm90Config(dtype=args.dtype, has_bias=act != "none", activation=act, **fields)
                    k_ = rtk.get_kernel(cfg)
                except Exception as e:   # a variant that does not build is reported, not fatal
                    row[label] = f"err {type(e).__name__}: {e}"[:60]
                    continue
                grid = m90.grid_size(n, n, 1, cfg, sms)

                def run(a, b, bias, cfg=cfg, k_=k_, grid=grid):
                    maps = m90.tensor_maps(cfg, (a.data.ptr, (1, n, n), (n * n, n, 1)),
                                           (b.data.ptr, (1, n, n), (n * n, n, 1)),
                                           (out.data.ptr, (1, n, n), (n * n, n, 1)))
                    k_.launch((grid, 1, 1), (384, 1, 1), *maps, bias if cfg.has_bias else None, out, n, n, n, 1, 0,
                              0, n, 0, 1, shared_mem=cfg.shared_mem_bytes)
                ms = benchutil.time_cuda(run, inputs=sets, repeat=10)
                if act == "gelu":
                    fused[label] = f"{ms:.3f}ms ({ms_sep / ms:.2f}x)"
                    continue
                run(*sets[0])
                err = float(((out_t.float() - ref).abs().max() / ref.abs().max()).item())
                row[label] = f"{flops / ms / 1e9:.0f} ({ms_cublas / ms:.2f}x)" + (" BAD" if err > 1e-2 else "")
                print(f"  n={n} {label}: {row[label]}  cuBLAS {row['cuBLAS']}", flush=True)
        rows.append(row)
        del sets, sets_t
        torch.cuda.empty_cache()
    env = benchutil.environment()
    benchutil.save(args.out, "matmul_sweep_sm90", {"environment": env, "square": rows, "fused_bias_gelu": fused})
    print(f"{env['gpu']}  {args.dtype} sm_90 sweep  ({sms} SMs); cell = TFLOP/s (x cuBLAS)")
    print("heuristic picks: " + ", ".join(f"{r['n']}: {r['heuristic']}" for r in rows))
    flat = [{"config": lbl, **{f"n={r['n']}": r.get(lbl, "") for r in rows}, "fused 4096 (x sep)": fused.get(lbl, "")}
            for lbl, _ in SWEEP_SM90]
    flat.append({"config": "cuBLAS", **{f"n={r['n']}": r["cuBLAS"] for r in rows},
                 "fused 4096 (x sep)": fused.get("cuBLAS addmm+gelu", "")})
    print(benchutil.table(flat, ["config"] + [f"n={r['n']}" for r in rows] + ["fused 4096 (x sep)"]))


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

    tdt = torch.bfloat16
    l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice()).get("l2CacheSize", 50 << 20))
    sms = device.sm_count()
    arch = device.current_arch()
    rows, fused_rows = [], []
    for n in (4096, 8192):
        count = max(1, min(4, -(-2 * l2 // (2 * 3 * n * n))))   # enough input sets to overflow L2 twice
        sets_t, sets, out_t, out, flops, ms_cublas, ref = _square_problem(torch, tdt, n, count)
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
    if "mma_sync_tflops" in rows[0]:
        ax.plot(xs, [r["mma_sync_tflops"] for r in rows], marker="v", label="rtk mma.sync kernel")
    if "triton_tflops" in rows[0]:
        ax.plot(xs, [r["triton_tflops"] for r in rows], marker="x", label="Triton (plain tiled)")
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
