"""Benchmark rtk.matmul against cuBLAS and Triton: TFLOP/s over square sizes, and the fused epilogue.

Run on a GPU host:  PYTHONPATH=. python tools/bench_matmul.py [--quick] [--dtype bfloat16] [--out DIR]

* square M = N = K from 256 to 8192, with the awkward 1792 / 1793 / 4095 (wave and tile
  quantization); FLOPs = 2 M N K;
* columns, all timed in the same run: cuBLAS through torch.matmul (bfloat16; CuPy has no bfloat16)
  or cupy.matmul (float16); ``rtk`` = what rtk.matmul runs (on sm_90 the TMA + wgmma kernel of
  ops/matmul_sm90.py, elsewhere the mma.sync kernel); on sm_90 also ``mma_sync`` = rtk.matmul with
  the Hopper path turned off (ops.matmul.USE_SM90), i.e. the mma.sync kernel with its heuristic
  config, as sm_80-89 run it, and ``mma_sync_tma`` = the Hopper kernel with mma.sync consumers
  (ops.matmul.SM90_MMA = "sync": the same TMA producer feeding ldmatrix + HMMA); ``triton`` = a
  plain tiled Triton matmul (128x256x64 tiles, grouped order, 3 stages, 8 warps: the kernel a user
  would otherwise write), where triton imports, and on
  sm_90 ``triton_mma_sync`` = the same kernel compiled with DISABLE_MMA_V3=1 (Triton's mma.sync
  code generation: the peer of the mma.sync kernel);
* with --tune (not in --quick), rtk with the autotuner (RTKERNELS_AUTOTUNE=1, tuning file in a
  temporary folder so an old winner cannot leak in);
* fused bias + GELU at 4096^3 vs cuBLAS (bias fused by cuBLAS in addmm) + a separate GELU pass
  (on sm_90 for both kernels), and vs eager torch's ``gelu(a @ b + bias)`` (GEMM, then bias add and
  GELU as two passes) and vs cuBLAS + bias and GELU in one pass that torch.compile generates;
* inputs rotate among enough copies to exceed twice the L2; CUDA events, warm-up, median; every
  timed call is queued behind a spin kernel (benchutil.time_queued), so the columns are kernel
  time and the host's per-call cost of rtk.matmul (Python checks, tensor maps, launch) is reported
  separately as ``rtk_host_us``.
Prints a table last; writes matmul.json and matmul.png (TFLOP/s vs size, waves annotated).

--sweep (alone, well under a minute): bfloat16 4096^3 and 8192^3 for each config of SWEEP (tile,
k-depth, stages, warps, main-loop options, and measurement builds without copies or barriers)
launched directly, beside cuBLAS (timed at the start and the end), ``--passes`` times
interleaved; with --sweep-k the K scan of KSCAN (per-tile fixed cost vs main loop), with --fused
the fused bias + GELU of each config; prints one compact table last and writes
matmul_sweep.json.  --sweep-sm90 does the same for the Hopper kernel's SWEEP_SM90.
They are how the heuristics tables are set.  --ceiling: the mma.sync ceilings of the device
(HMMA from registers, and fed by the kernel's ldmatrix pattern), one 8-warp CTA per SM.

--grid llm (issue 20's grid): M in --ms (default 128, 512, 2048, 8192, 16384; --quick 128, 512, 2048)
x the (N, K) of Llama-3 8B / 70B projections (LLM_NK: qkv, o, gate+up, down; K 128 / 256 rows too)
plus 1793^3, 4095^3 and 3000x5000x2000; activations x (M, K) times weights W (N, K) as a linear
layer does (x @ W.T; --layout nn: B (K, N) row-major).  Columns, every candidate interleaved in
--passes passes (median): rtk and cuBLAS (torch.matmul) TFLOP/s and their ratio (kernel time,
calls queued behind a spin: benchutil.time_queued), per-call latency of each (the stream
synchronized after every call, host time included: benchutil.time_synced), fused bias + GELU
(rtk) vs torch.addmm + gelu, and the config rtk.matmul chose (tile/stages, sS split-K or sk
stream-K).  Writes matmul_grid_llm.json.  --splitk-sweep: few-tile and partial-wave shapes
(SPLITK_SHAPES) with the Hopper kernel launched directly at split_k in SPLITK_SPLITS and with
stream-K for its 128x256 and 128x128 tiles (128x64: unsplit and stream-K), beside cuBLAS, the
heuristic's choice and the schedule model's estimate (to refit the model's constants in
ops/matmul_sm90.py); writes matmul_splitk_sweep.json.  --streamk-ab: AB_SHAPES (partial waves,
few tiles) with stream-K with lanes against lanes = 1 (the schedule before them), whole tiles of
128x256 / 128x192 / 128x128 / 256x128 / 128x256 with 3 stages, split-K (M = 128), rtk.matmul's own
pick and cuBLAS, interleaved (--ab-shapes MxNxK,...: other shapes; --ab-only: those candidates);
writes matmul_streamk_ab.json.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchutil  # noqa: E402

SIZES = [256, 512, 1024, 1536, 1792, 1793, 2048, 3072, 4095, 4096, 6144, 8192]
QUICK = [1024, 1793, 4096, 8192]


def triton_matmul(mma_sync: bool = False):
    """A plain tiled Triton matmul (None without triton): ``run(a, b, out)`` for 2-D torch tensors.

    ``mma_sync``: compiled with DISABLE_MMA_V3=1, which makes Triton lower ``tl.dot`` to mma.sync
    instead of wgmma on Hopper (the flag is read when the kernel compiles, on its first call, and
    is part of Triton's cache key; each call of this function makes a new kernel object).
    """
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

    def launch(a, b, out):
        M, K = a.shape
        N = b.shape[1]
        grid = (triton.cdiv(M, 128) * triton.cdiv(N, 256),)
        kernel[grid](a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
                     out.stride(1), BM=128, BN=256, BK=64, GROUP=8, num_warps=8, num_stages=3)

    def run(a, b, out):
        if not mma_sync:
            return launch(a, b, out)
        old = os.environ.get("DISABLE_MMA_V3")
        os.environ["DISABLE_MMA_V3"] = "1"
        try:
            launch(a, b, out)
        finally:
            if old is None:
                os.environ.pop("DISABLE_MMA_V3", None)
            else:
                os.environ["DISABLE_MMA_V3"] = old
    return run


def main() -> None:
    p = benchutil.parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--tune", action="store_true", help="add the autotuned column (slow; not with --quick)")
    p.add_argument("--no-tune", action="store_true", help=argparse_suppress())
    p.add_argument("--sweep", action="store_true", help="only the mma.sync config sweep at 4096^3 / 8192^3")
    p.add_argument("--sweep-sm90", action="store_true", help="only the sm_90 config sweep at 4096^3 / 8192^3")
    p.add_argument("--no-mma-sync", action="store_true",
                   help="on sm_90, skip the mma.sync kernel's and Triton's mma.sync columns")
    p.add_argument("--mma-sync", action="store_true", help=argparse_suppress())   # the default now
    p.add_argument("--ceiling", action="store_true",
                   help="only the mma.sync ceilings of this device (HMMA from registers; fed by ldmatrix)")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated square sizes instead of the default list")
    p.add_argument("--fused-n", type=int, default=4096, help="size of the fused bias + GELU comparison")
    p.add_argument("--sweep-only", default="", help="--sweep: comma-separated labels of SWEEP to run")
    p.add_argument("--sweep-k", action="store_true", help="--sweep: also the K scan of KSCAN at M = N = 4096")
    p.add_argument("--fused", action="store_true", help="--sweep: also the fused bias + GELU of each config")
    p.add_argument("--repeat", type=int, default=20, help="--sweep: timed calls per config")
    p.add_argument("--passes", type=int, default=3, help="--sweep: passes over all configs (median shown)")
    p.add_argument("--grid", choices=("llm",), default=None, help="the LLM projection grid of issue 20")
    p.add_argument("--ms", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="--grid: comma-separated M values")
    p.add_argument("--layout", choices=("nt", "nn"), default="nt",
                   help="--grid: B as a linear layer's weight (N, K) (nt) or row-major (K, N) (nn)")
    p.add_argument("--splitk-sweep", action="store_true", help="only the split-K sweep of SPLITK_SHAPES")
    p.add_argument("--streamk-ab", action="store_true",
                   help="only stream-K with lanes vs without, whole tiles, splits, rtk.matmul and cuBLAS at AB_SHAPES")
    p.add_argument("--ab-shapes", type=lambda s: [tuple(int(x) for x in t.split("x")) for t in s.split(",")],
                   default=None, help="--streamk-ab: comma-separated MxNxK shapes instead of AB_SHAPES")
    p.add_argument("--ab-only", default="",
                   help="--streamk-ab / --lastcells-ab: comma-separated candidate labels (cuBLAS and rtk.matmul "
                        "always run)")
    p.add_argument("--lastcells-ab", action="store_true",
                   help="only issue 20's last cells (LASTCELL_SHAPES or --ab-shapes): cluster-K, split-K and whole "
                        "tiles against rtk.matmul's pick and cuBLAS, with each candidate's tiles / waves / k-blocks")
    p.add_argument("--plan-only", action="store_true",
                   help="--lastcells-ab: print the candidates' plan arithmetic and stop (no GPU needed)")
    args = p.parse_args()
    if args.lastcells_ab:
        lastcells_ab(args)
        return
    if args.grid == "llm":
        grid_llm(args)
        return
    if args.splitk_sweep:
        splitk_sweep(args)
        return
    if args.streamk_ab:
        streamk_ab(args)
        return
    if args.sweep:
        sweep(args)
        return
    if args.sweep_sm90:
        sweep_sm90(args)
        return
    if args.ceiling:
        ceiling(args)
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

    tdt = getattr(torch, args.dtype)
    l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice()).get("l2CacheSize", 50 << 20))
    sms = device.sm_count()
    on_sm90 = device.current_arch() == "sm_90"
    repeat = 10 if args.quick else 20
    tri = triton_matmul()
    with_mma = on_sm90 and not args.no_mma_sync
    tri_mma = triton_matmul(mma_sync=True) if with_mma else None

    def patched(fn, **attrs):
        """``fn`` with ops.matmul's module switches set to ``attrs`` for the call."""
        def run(*a, **kw):
            old = {k_: getattr(mm, k_) for k_ in attrs}
            for k_, v in attrs.items():
                setattr(mm, k_, v)
            try:
                return fn(*a, **kw)
            finally:
                for k_, v in old.items():
                    setattr(mm, k_, v)
        return run

    def mma_sync(fn):
        """``fn`` through rtk.matmul with the Hopper path off: the mma.sync kernel, as sm_80-89 run it."""
        return patched(fn, USE_SM90=False)

    def mma_sync_tma(fn):
        """``fn`` through rtk.matmul's Hopper kernel with mma.sync consumers (TMA-fed mma.sync)."""
        return patched(fn, SM90_MMA="sync")

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

    def rel_err(got, ref):
        return float(((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item())

    from benchutil import time_queued as time_gpu

    def timed(fn, sets):
        return time_gpu(fn, sets, repeat=repeat)[0]

    rows = []
    for n in args.sizes or (QUICK if args.quick else SIZES):
        sets = sets_for(n, n, n)
        outs = [torch.empty(n, n, device="cuda", dtype=tdt) for _ in range(2)]
        flops = 2.0 * n ** 3
        ms_peer = timed(peer_mm, sets)
        ms_rtk, host_us, drained = time_gpu(lambda a, b: rtk.matmul(a, b, out=outs[0]), sets, repeat=repeat)
        vec = next(v for v in (8, 4, 2, 1) if n % v == 0)   # as rtk.matmul picks for n-element rows
        cfg_mma = mm.heuristic_config(args.dtype, n, n, n, sm_count=sms, a_kmajor=True, b_kmajor=False, vec_a=vec,
                                      vec_b=vec)
        if on_sm90 and (n % 8 == 0 or n ** 3 >= mm.STAGE_MIN_WORK):   # TMA rows, or staged copies
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
        if with_mma:
            run_mma = mma_sync(lambda a, b: rtk.matmul(a, b, out=outs[0]))
            row["mma_sync_tflops"] = flops / timed(run_mma, sets) / 1e9
            row["mma_sync_tile"] = f"{cfg_mma.block_m}x{cfg_mma.block_n}x{cfg_mma.block_k}/{cfg_mma.num_stages}"
            row["mma_sync_err"] = rel_err(mma_sync(rtk.matmul)(*sets[0][:2], out=outs[1]), ref_t)
            if n % 8 == 0:   # TMA-addressable rows
                run_tma = mma_sync_tma(lambda a, b: rtk.matmul(a, b, out=outs[0]))
                row["mma_sync_tma_tflops"] = flops / timed(run_tma, sets) / 1e9
                row["mma_sync_tma_vs_cublas"] = row["mma_sync_tma_tflops"] / row["cublas_tflops"]
                row["mma_sync_tma_err"] = rel_err(mma_sync_tma(rtk.matmul)(*sets[0][:2], out=outs[1]), ref_t)
        if tri is not None:
            ms_tri = timed(lambda a, b: tri(a, b, outs[0]), sets)
            row["triton_tflops"] = flops / ms_tri / 1e9
            tri(*sets[0][:2], outs[1])
            row["triton_err"] = rel_err(outs[1], ref_t)
        if tri_mma is not None:
            row["triton_mma_sync_tflops"] = flops / timed(lambda a, b: tri_mma(a, b, outs[0]), sets) / 1e9
        if tune:
            old = os.environ.get("RTKERNELS_CACHE_DIR")
            os.environ["RTKERNELS_AUTOTUNE"] = "1"
            os.environ["RTKERNELS_CACHE_DIR"] = tune_dir   # fresh tuning file; kernels recompile once
            try:
                rtk.matmul(*sets[0][:2], out=outs[0])     # tunes
                ms_tuned = timed(lambda a, b: rtk.matmul(a, b, out=outs[0]), sets)
                row["tuned_tflops"] = flops / ms_tuned / 1e9
                # the entry of the kernel rtk.matmul ran (the Hopper one where it ran; the
                # mma.sync kernel's entry exists only when the Hopper kernel declined)
                hits = sorted((e for k_, e in autotune.load().items() if f'"k.m":{mm._bucket(n)},' in k_),
                              key=lambda e: e.get("family") != "matmul_sm90")
                c_ = hits[0]["config"] if hits else None
                row["tuned_tile"] = (f"{c_['block_m']}x{c_['block_n']}x{c_['block_k']}/{c_['num_stages']}"
                                     if c_ else "")
            finally:
                os.environ["RTKERNELS_AUTOTUNE"] = "0"
                if old is None:
                    os.environ.pop("RTKERNELS_CACHE_DIR", None)
                else:
                    os.environ["RTKERNELS_CACHE_DIR"] = old
            # the heuristic again right after: under sustained load one config's time drifts by
            # several % over a run, so the target (tuned >= heuristic) compares adjacent timings
            ms_heur = timed(lambda a, b: rtk.matmul(a, b, out=outs[0]), sets)
            row["tuned_vs_heuristic"] = ms_heur / ms_tuned
        row["vs_cublas"] = row["rtk_tflops"] / row["cublas_tflops"]
        rows.append(row)
        del sets
        torch.cuda.empty_cache()

    # fused bias + GELU vs cuBLAS (bias in its epilogue) + one GELU pass
    n = args.fused_n
    sets = sets_for(n, n, n, extra=(lambda: torch.randn(n, device="cuda", dtype=tdt),))
    out = torch.empty(n, n, device="cuda", dtype=tdt)
    ms_fused = timed(lambda a, b, bias: rtk.matmul(a, b, bias=bias, activation="gelu", out=out), sets)
    ms_plain = timed(lambda a, b, bias: rtk.matmul(a, b, out=out), sets)
    ms_sep = timed(lambda a, b, bias: torch.nn.functional.gelu(torch.addmm(bias, a, b)), sets)
    # the same in eager torch as written without addmm: GEMM, then bias add and GELU as two passes
    ms_eager = timed(lambda a, b, bias: torch.nn.functional.gelu(torch.matmul(a, b) + bias), sets)
    # and with bias + GELU fused into one pass by torch.compile (Inductor writes it as one Triton kernel)
    try:
        bias_gelu = torch.compile(lambda c, bias: torch.nn.functional.gelu(c + bias))
        bias_gelu(torch.matmul(*sets[0][:2]), sets[0][2])   # compiles
        ms_one = timed(lambda a, b, bias: bias_gelu(torch.matmul(a, b), bias), sets)
    except Exception as e:   # no compiler on this host: the column stays empty
        print(f"torch.compile bias + GELU unavailable: {type(e).__name__}: {e}"[:200])
        ms_one = None
    a, b, bias = sets[0]
    ref = torch.nn.functional.gelu(torch.addmm(bias, a, b))
    got = rtk.matmul(a, b, bias=bias, activation="gelu")
    fused = {"n": n, "rtk_fused_ms": ms_fused, "rtk_plain_ms": ms_plain, "cublas_plus_gelu_ms": ms_sep,
             "speedup": ms_sep / ms_fused, "cublas_add_gelu_ms": ms_eager, "speedup_vs_add_gelu": ms_eager / ms_fused,
             "cublas_one_pass_ms": ms_one, "speedup_vs_one_pass": ms_one / ms_fused if ms_one else None,
             "fused_tflops": 2.0 * n ** 3 / ms_fused / 1e9, "max_rel_err": rel_err(got, ref)}
    if with_mma:
        for name, via in (("mma_sync", mma_sync), ("mma_sync_tma", mma_sync_tma)):
            ms_ = timed(via(lambda a, b, bias: rtk.matmul(a, b, bias=bias, activation="gelu", out=out)), sets)
            fused.update({f"{name}_fused_ms": ms_, f"{name}_speedup": ms_sep / ms_,
                          f"{name}_err": rel_err(via(rtk.matmul)(a, b, bias=bias, activation="gelu"), ref)})
        fused["mma_sync_plain_ms"] = timed(mma_sync(lambda a, b, bias: rtk.matmul(a, b, out=out)), sets)

    env = benchutil.environment()
    env["triton"] = __import__("triton").__version__ if tri is not None else None
    payload = {"environment": env, "dtype": args.dtype, "square": rows, "fused_bias_gelu": fused}
    benchutil.save(args.out, "matmul", payload)
    _plot(args.out, rows, args.dtype, payload["environment"])
    cols = ["n", "cublas_tflops", "rtk_tflops", "vs_cublas", "rtk_host_us"]
    cols += (["mma_sync_tflops", "mma_sync_tile", "mma_sync_tma_tflops", "mma_sync_tma_vs_cublas"]
             if with_mma else [])
    cols += ["triton_tflops"] if tri is not None else []
    cols += ["triton_mma_sync_tflops"] if tri_mma is not None else []
    cols += ["tuned_tflops", "tuned_tile", "tuned_vs_heuristic"] if tune else []
    print(f"{payload['environment']['gpu']}  {args.dtype}  ({sms} SMs)  rtk = {'sm_90 TMA+wgmma' if on_sm90 else 'mma.sync'}"
          "  (kernel time; rtk_host_us = host cost per rtk.matmul call)")
    print(benchutil.table(rows, cols + ["tile", "waves", "tail", "max_rel_err"]))
    print(benchutil.table([fused], ["n", "rtk_fused_ms", "rtk_plain_ms", "cublas_plus_gelu_ms", "speedup",
                                    "cublas_add_gelu_ms", "speedup_vs_add_gelu", "cublas_one_pass_ms",
                                    "speedup_vs_one_pass",
                                    "fused_tflops", "max_rel_err"] +
                          (["mma_sync_fused_ms", "mma_sync_plain_ms", "mma_sync_speedup", "mma_sync_tma_fused_ms",
                            "mma_sync_tma_speedup"] if with_mma else [])))


# (N, K) of the Llama-3 8B / 70B projections: qkv (q + 2 GQA kv heads of 8), o, gate + up (fused)
# and gate or up alone, down; then short K (rank-128/256 factors, attention heads' width).
LLM_NK = [(6144, 4096), (4096, 4096), (14336, 4096), (28672, 4096), (4096, 14336),
          (10240, 8192), (8192, 8192), (28672, 8192), (8192, 28672),
          (4096, 128), (4096, 256), (16384, 128)]
LLM_MS = [128, 512, 2048, 8192, 16384]
LLM_MS_QUICK = [128, 512, 2048]
LLM_ODD = [(1793, 1793, 1793), (4095, 4095, 4095), (3000, 5000, 2000)]   # M, N, K


def _chosen(mm, m, n, k, has_bias):
    """'tile/stages sS' of the Hopper plan rtk.matmul made for this shape (or 'mma.sync')."""
    for key, plan in reversed(list(mm._plans90.items())):
        if key[1:5] == (m, n, k, 1) and key[7] == has_bias:
            c = plan[1]
            return f"{c.block_m}x{c.block_n}/{c.num_stages} {'sk' if c.stream_k else f's{c.split_k}'}"
    return "mma.sync"


def grid_llm(args) -> None:
    import torch
    import rtkernels as rtk
    from rtkernels import device
    from rtkernels.ops import matmul as mm

    tdt = getattr(torch, args.dtype)
    sms = device.sm_count()
    repeat = 10 if args.quick else 20
    passes = 2 if args.quick else max(2, args.passes)
    ms_list = args.ms or (LLM_MS_QUICK if args.quick else LLM_MS)
    shapes = [(m, n, k) for m in ms_list for n, k in LLM_NK] + LLM_ODD
    nt = args.layout == "nt"
    l2 = 50 << 20
    sync = torch.cuda.current_stream().synchronize
    rows = []
    for m, n, k in shapes:
        per = 2 * (m * k + n * k + m * n)
        count = max(1, min(4, -(-2 * l2 // per)))
        sets = [(torch.randn(m, k, device="cuda", dtype=tdt),
                 torch.randn(*((n, k) if nt else (k, n)), device="cuda", dtype=tdt) / k ** 0.5,
                 torch.randn(n, device="cuda", dtype=tdt)) for _ in range(count)]
        out = torch.empty(m, n, device="cuda", dtype=tdt)
        if nt:
            rtk_mm = lambda a, w, bias: rtk.matmul(a, w, trans_b=True, out=out)  # noqa: E731
            rtk_fused = lambda a, w, bias: rtk.matmul(a, w, bias=bias, activation="gelu",  # noqa: E731
                                                      trans_b=True, out=out)
            t_mm = lambda a, w, bias: torch.matmul(a, w.T)  # noqa: E731
            t_fused = lambda a, w, bias: torch.nn.functional.gelu(torch.addmm(bias, a, w.T))  # noqa: E731
        else:
            rtk_mm = lambda a, w, bias: rtk.matmul(a, w, out=out)  # noqa: E731
            rtk_fused = lambda a, w, bias: rtk.matmul(a, w, bias=bias, activation="gelu", out=out)  # noqa: E731
            t_mm = lambda a, w, bias: torch.matmul(a, w)  # noqa: E731
            t_fused = lambda a, w, bias: torch.nn.functional.gelu(torch.addmm(bias, a, w))  # noqa: E731
        cands = {"rtk": rtk_mm, "torch": t_mm, "rtk_fused": rtk_fused, "torch_fused": t_fused}
        kern = {c: [] for c in cands}
        lat = {c: [] for c in ("rtk", "torch")}
        for _ in range(passes):
            for c, fn in cands.items():
                kern[c].append(benchutil.time_queued(fn, sets, repeat=repeat)[0])
            for c in lat:
                lat[c].append(benchutil.time_synced(cands[c], sets, repeat=repeat, sync=sync))
        med = {c: statistics.median(v) for c, v in kern.items()}
        lmed = {c: statistics.median(v) for c, v in lat.items()}
        a, w, bias = sets[0]
        ref = t_mm(a, w, bias).float()
        err = float(((rtk_mm(a, w, bias).float() - ref).abs().max() / ref.abs().max()).item())
        flops = 2.0 * m * n * k
        row = {"M": m, "N": n, "K": k, "rtk_tflops": flops / med["rtk"] / 1e9,
               "cublas_tflops": flops / med["torch"] / 1e9, "vs_cublas": med["torch"] / med["rtk"],
               "rtk_lat_us": lmed["rtk"], "torch_lat_us": lmed["torch"], "lat_ratio": lmed["rtk"] / lmed["torch"],
               "fused_ms": med["rtk_fused"], "addmm_gelu_ms": med["torch_fused"],
               "fused_vs_torch": med["torch_fused"] / med["rtk_fused"],
               "config": _chosen(mm, m, n, k, False), "max_rel_err": err}
        rows.append(row)
        print(f"  {m}x{n}x{k}: {row['rtk_tflops']:.0f} vs {row['cublas_tflops']:.0f} TFLOP/s "
              f"({row['vs_cublas']:.2f}x), latency {row['rtk_lat_us']:.0f}/{row['torch_lat_us']:.0f} us, "
              f"fused {row['fused_vs_torch']:.2f}x, {row['config']}", flush=True)
        del sets
        torch.cuda.empty_cache()
    ratios = [r["vs_cublas"] for r in rows]
    summary = {"geomean_vs_cublas": float(statistics.geometric_mean(ratios)), "min_vs_cublas": min(ratios),
               "below_0.95": sum(r < 0.95 for r in ratios), "shapes": len(rows),
               "max_lat_ratio": max(r["lat_ratio"] for r in rows),
               "min_fused_vs_torch": min(r["fused_vs_torch"] for r in rows)}
    env = benchutil.environment()
    env["torch"] = torch.__version__
    benchutil.save(args.out, "matmul_grid_llm", {"environment": env, "dtype": args.dtype, "layout": args.layout,
                                                 "passes": passes, "repeat": repeat, "rows": rows,
                                                 "summary": summary})
    print(f"{env['gpu']}  {args.dtype}  ({sms} SMs)  --grid llm, layout {args.layout}: kernel time (queued), "
          "latency = one synchronized call incl. host")
    print(benchutil.table(rows, ["M", "N", "K", "rtk_tflops", "cublas_tflops", "vs_cublas", "rtk_lat_us",
                                 "torch_lat_us", "lat_ratio", "fused_vs_torch", "config", "max_rel_err"]))
    print(" ".join(f"{k_}={v:.3g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in summary.items()))


# --splitk-sweep: few-tile and partial-wave shapes (M, N, K) with W (N, K) as a linear layer's weight.
SPLITK_SHAPES = [(128, 4096, 4096), (128, 6144, 4096), (128, 4096, 14336), (512, 4096, 4096), (128, 14336, 4096),
                 (512, 8192, 8192), (128, 8192, 28672), (2048, 4096, 4096),
                 # partial last waves on 132 SMs (stream-K's case): 96 / 160 / 480 tiles of 128 x 256
                 (512, 6144, 4096), (512, 10240, 8192), (3000, 5000, 2000), (512, 4096, 14336), (128, 10240, 8192),
                 (512, 14336, 4096)]
SPLITK_SPLITS = (1, 2, 3, 4, 6, 8)
SPLITK_SPLITS_QUICK = (1, 2, 3, 4)
# (block_m, block_n, stages, splits): 128 x 64 (the data-parallel model's pick for some M = 128
# shapes, unmeasured there) unsplit and stream-K only
SPLITK_TILES = ((128, 256, 4, None), (128, 128, 6, None), (128, 64, 8, (1,)))


def _median_interleaved(cands: dict, sets, passes: int, repeat: int) -> dict:
    """Median queued milliseconds per call of each candidate, the candidates interleaved within
    each of ``passes`` passes (every one timed from the same GPU state)."""
    times = {c: [] for c in cands}
    for _ in range(passes):
        for c, fn in cands.items():
            times[c].append(benchutil.time_queued(fn, sets, repeat=repeat)[0])
    return {c: statistics.median(v) for c, v in times.items()}


def _direct_runner(m90, cfg, kern, grid, sizes, extra, m, n, k, out, dev):
    """A launch of the Hopper matmul kernel ``kern`` (config ``cfg``) on torch (M, K) x (N, K)^T
    operands into ``out``, bypassing rtk.matmul's heuristic: ``grid`` CTAs, the stream workspace of
    ``sizes`` (partial bytes, counter bytes) when the schedule reduces (None: it does not), ``extra``
    trailing kernel arguments (stream-K's lanes)."""
    from rtkernels.ops.workspace import stream_workspace

    def run(a, w):
        maps = m90.tensor_maps(cfg, (a.data_ptr(), (1, m, k), (m * k, k, 1)), (w.data_ptr(), (1, n, k), (n * k, k, 1)),
                               (out.data_ptr(), (1, m, n), (m * n, n, 1)))
        ws = stream_workspace(a, dev, None, *sizes) if sizes is not None else ()
        kern.launch((grid, 1, 1), (384, 1, 1), *maps, None, out, *ws, m, n, k, 1, 0, 0, n, 0, 1, *extra,
                    shared_mem=cfg.shared_mem_bytes)
    return run


def _schedule_label(bm, bn, s, sk, ck=1):
    return f"{bm}x{bn} {'sk' if sk else f'c{ck}' if ck > 1 else f's{s}'}"


def splitk_sweep(args) -> None:
    import torch
    import rtkernels as rtk
    from rtkernels import device
    from rtkernels.ops import matmul as mm
    from rtkernels.ops import matmul_sm90 as m90

    tdt = getattr(torch, args.dtype)
    sms = device.sm_count()
    dev = torch.cuda.current_device()
    repeat = 10 if args.quick else 20
    passes = 2 if args.quick else max(2, args.passes)
    rows = []
    for m, n, k in SPLITK_SHAPES:
        count = max(1, min(4, -(-100 * 2 ** 20 // (2 * (m * k + n * k + m * n)))))
        sets = [(torch.randn(m, k, device="cuda", dtype=tdt), torch.randn(n, k, device="cuda", dtype=tdt) / k ** 0.5)
                for _ in range(count)]
        out = torch.empty(m, n, device="cuda", dtype=tdt)
        ref = torch.matmul(sets[0][0], sets[0][1].T).float()
        aligned = all(mm.rows_on_128b_grid(t.data_ptr(), k) for t in sets[0])   # as rtk.matmul reads them
        heur = m90.heuristic_config(args.dtype, m, n, k, sm_count=sms, b_kmajor=True, rows_128b=aligned)
        heur_label = _schedule_label(heur.block_m, heur.block_n, heur.split_k, heur.stream_k)
        cands = {"cuBLAS": lambda a, w: torch.matmul(a, w.T)}
        labels = {}
        for bm, bn, st, splits in SPLITK_TILES:
            tile = next(t for t in m90.TILES if (t.block_m, t.block_n, t.num_stages) == (bm, bn, st))
            scheds = [(s, False) for s in (splits or (SPLITK_SPLITS_QUICK if args.quick else SPLITK_SPLITS))
                      if s <= m90.k_blocks(k)] + [(1, True)]
            for s, sk in scheds:
                cfg = m90.MatmulSm90Config(dtype=args.dtype, block_m=bm, block_n=bn, num_stages=st, b_kmajor=True,
                                           split_k=s, stream_k=sk)
                kern = rtk.get_kernel(cfg)
                grid = m90.grid_size(m, n, 1, cfg, sms, k)
                sizes = (m90.workspace_bytes(cfg, m, n, k, 1, grid), m90.counter_bytes(cfg, m, n, 1, grid))
                reduces = cfg.split_k > 1 or cfg.stream_k
                extra = m90.tail_args(cfg, m, sms)

                run = _direct_runner(m90, cfg, kern, grid, sizes if reduces else None, extra, m, n, k, out, dev)
                label = _schedule_label(bm, bn, s, sk)
                cands[label] = run
                labels[label] = (tile, s, sk, grid)
        med = _median_interleaved(cands, sets, passes, repeat)
        flops = 2.0 * m * n * k
        best = min((c for c in med if c != "cuBLAS"), key=med.get)
        for c, ms in med.items():
            row = {"shape": f"{m}x{n}x{k}", "config": c, "us": ms * 1e3, "tflops": flops / ms / 1e9,
                   "vs_cublas": med["cuBLAS"] / ms, "best": c == best}
            if c in labels:
                tile, s, sk, grid = labels[c]
                row["grid"] = grid
                row["model_us"] = m90.schedule_us(tile, m, n, k, 1, sms, s, sk)
                cands[c](*sets[0])
                row["err"] = float(((out.float() - ref).abs().max() / ref.abs().max()).item())
                row["heuristic"] = c == heur_label
            rows.append(row)
        print(f"  {m}x{n}x{k}: cuBLAS {med['cuBLAS'] * 1e3:.1f} us, best {best} {med[best] * 1e3:.1f} us, heuristic "
              f"{heur_label} {med.get(heur_label, float('nan')) * 1e3:.1f} us", flush=True)
        del sets
        torch.cuda.empty_cache()
    env = benchutil.environment()
    benchutil.save(args.out, "matmul_splitk_sweep", {"environment": env, "dtype": args.dtype, "rows": rows,
                                                     "model": {k_: getattr(m90, k_) for k_ in (
                                                         "KBLOCK_US", "DRAM_BYTES_PER_US", "DRAM_RAMP_US",
                                                         "FIXUP_US_PER_KIB", "SPLIT_FILL_KBLOCKS",
                                                         "SPLIT_MAX_TILES_DIV", "SCHEDULE_MARGIN",
                                                         "MIN_KBLOCKS_PER_SPLIT")}})
    print(f"{env['gpu']}  {args.dtype}  ({sms} SMs)  split-K / stream-K (sk) sweep (kernel launched directly, "
          "W (N, K)); model_us = the schedule model's estimate")
    print(benchutil.table(rows, ["shape", "config", "grid", "us", "model_us", "tflops", "vs_cublas", "best",
                                 "heuristic", "err"]))


# --streamk-ab: the partial-wave and few-tile shapes of issue 20 (W (N, K), a linear layer's weight).
AB_SHAPES = [(512, 6144, 4096), (512, 10240, 8192), (512, 14336, 4096), (512, 28672, 4096), (3000, 5000, 2000),
             (128, 4096, 14336), (128, 8192, 8192), (128, 4096, 4096), (128, 6144, 4096)]
# (label, block_m, block_n, stages, split_k, stream_k, lanes: None = the host's, 1 = stream-K before lanes)
AB_CANDS = [("dp 128x256", 128, 256, 4, 1, False, None), ("dp 128x192", 128, 192, 5, 1, False, None),
            ("dp 128x128", 128, 128, 6, 1, False, None),
            ("sk-old 128x256", 128, 256, 4, 1, True, 1), ("sk 128x256", 128, 256, 4, 1, True, None),
            ("sk 128x192", 128, 192, 5, 1, True, None), ("sk 128x128", 128, 128, 6, 1, True, None)]
AB_SPLITS_M128 = [("s2 128x128", 128, 128, 6, 2, False, None), ("s3 128x128", 128, 128, 6, 3, False, None),
                  ("s4 128x128", 128, 128, 6, 4, False, None), ("s4 128x256", 128, 256, 4, 4, False, None),
                  ("dp 128x64", 128, 64, 8, 1, False, None), ("sk 128x64", 128, 64, 8, 1, True, None),
                  # rule 2b: the thin tile split in place, every SM streaming W once
                  ("s2 128x64", 128, 64, 8, 2, False, None), ("s4 128x64", 128, 64, 8, 4, False, None)]
# the same tile count as 128x256 with two m64n128 chains per warpgroup; 128x256 with a 3-stage ring and
# one 256-column epilogue pass (no wait for the first pass's store: short K, where the epilogue is a
# large share of each tile)
AB_EXTRA = [("dp 256x128", 256, 128, 4, 1, False, None), ("dp 128x256/3", 128, 256, 3, 1, False, None)]


def _ab_inputs(torch, rtk, tdt, m, n, k):
    """The A/B modes' inputs for x (m, k) @ W.T (W (n, k), a linear layer's): input sets rotated
    through >= 100 MiB (at most 4) so W is not read from L2, the output, cuBLAS's float32 result
    for the first set, and the two reference candidates (cuBLAS, rtk.matmul's own pick)."""
    count = max(1, min(4, -(-100 * 2 ** 20 // (2 * (m * k + n * k + m * n)))))
    sets = [(torch.randn(m, k, device="cuda", dtype=tdt), torch.randn(n, k, device="cuda", dtype=tdt) / k ** 0.5)
            for _ in range(count)]
    out = torch.empty(m, n, device="cuda", dtype=tdt)
    ref = torch.matmul(sets[0][0], sets[0][1].T).float()
    cands = {"cuBLAS": lambda a, w: torch.matmul(a, w.T),
             "rtk.matmul": lambda a, w: rtk.matmul(a, w, trans_b=True, out=out)}
    return sets, out, ref, cands


def streamk_ab(args) -> None:
    """Stream-K with lanes against stream-K without them (lanes = 1: the schedule before 2026-11-26),
    whole tiles, split-K, rtk.matmul's own pick and cuBLAS, interleaved in each pass; every kernel
    launched directly (its config, grid and lanes shown) and checked against cuBLAS."""
    import torch
    import rtkernels as rtk
    from rtkernels import device
    from rtkernels.ops import matmul as mm
    from rtkernels.ops import matmul_sm90 as m90

    tdt = getattr(torch, args.dtype)
    sms = device.sm_count()
    dev = torch.cuda.current_device()
    repeat = 10 if args.quick else 20
    passes = 3 if args.quick else max(3, args.passes)
    rows, summary = [], []
    only = set(filter(None, args.ab_only.split(",")))
    for m, n, k in args.ab_shapes or AB_SHAPES:
        sets, out, ref, cands = _ab_inputs(torch, rtk, tdt, m, n, k)
        info = {}
        for label, bm, bn, st, s, sk, lanes in AB_CANDS + AB_EXTRA + (AB_SPLITS_M128 if m <= 128 else []):
            if only and label not in only:
                continue
            cfg = m90.MatmulSm90Config(dtype=args.dtype, block_m=bm, block_n=bn, num_stages=st, b_kmajor=True,
                                       split_k=s, stream_k=sk)
            if s > m90.k_blocks(k):
                continue
            kern = rtk.get_kernel(cfg)
            grid = m90.grid_size(m, n, 1, cfg, sms, k)
            lanes = (m90.stream_k_lanes(cfg, m, sms) if lanes is None else lanes) if sk else None
            if sk and lanes == 1:   # the grid of the schedule before lanes: one CTA per SM
                grid = max(1, min(sms, -(-m // bm) * -(-n // bn) * m90.k_blocks(k)))
            sizes = (m90.workspace_bytes(cfg, m, n, k, 1, grid), m90.counter_bytes(cfg, m, n, 1, grid))
            reduces = s > 1 or sk
            extra = (lanes,) if sk else ()

            run = _direct_runner(m90, cfg, kern, grid, sizes if reduces else None, extra, m, n, k, out, dev)
            cands[label] = run
            info[label] = (grid, lanes)
        med = _median_interleaved(cands, sets, passes, repeat)
        flops = 2.0 * m * n * k
        picked = mm._plans90[next(key for key in reversed(list(mm._plans90)) if key[1:5] == (m, n, k, 1))][1]
        pick = f"{'sk' if picked.stream_k else f's{picked.split_k}'} {picked.block_m}x{picked.block_n}"
        best = min((c for c in med if c not in ("cuBLAS", "rtk.matmul")), key=med.get, default="rtk.matmul")
        for c, ms in med.items():
            cands[c](*sets[0])
            err = float(((out.float() - ref).abs().max() / ref.abs().max()).item()) if c != "cuBLAS" else 0.0
            grid, lanes = info.get(c, (None, None))
            rows.append({"shape": f"{m}x{n}x{k}", "config": c, "grid": grid, "lanes": lanes, "us": ms * 1e3,
                         "tflops": flops / ms / 1e9, "vs_cublas": med["cuBLAS"] / ms, "err": err,
                         "best": c == best, "note": pick if c == "rtk.matmul" else ""})
        summary.append({"shape": f"{m}x{n}x{k}", "cublas_us": med["cuBLAS"] * 1e3, "rtk_pick": pick,
                        "rtk_vs_cublas": med["cuBLAS"] / med["rtk.matmul"],
                        "dp_best_vs_cublas": med["cuBLAS"] / min((v for c, v in med.items() if c.startswith("dp")),
                                                                 default=float("nan")),
                        "sk_old_vs_cublas": med["cuBLAS"] / med.get("sk-old 128x256", float("nan")),
                        "sk_new_vs_cublas": med["cuBLAS"] / med.get("sk 128x256", float("nan")),
                        "best": best, "best_vs_cublas": med["cuBLAS"] / med[best]})
        print(f"  {m}x{n}x{k}: cuBLAS {med['cuBLAS'] * 1e3:.1f} us, rtk.matmul ({pick}) "
              f"{med['rtk.matmul'] * 1e3:.1f} us, best {best} {med[best] * 1e3:.1f} us", flush=True)
        del sets
        torch.cuda.empty_cache()
    env = benchutil.environment()
    benchutil.save(args.out, "matmul_streamk_ab", {"environment": env, "dtype": args.dtype, "rows": rows,
                                                   "summary": summary})
    print(f"{env['gpu']}  {args.dtype}  ({sms} SMs)  stream-K A/B (W (N, K); kernels launched directly; "
          "sk-old = lanes 1, the schedule before lanes)")
    print(benchutil.table(rows, ["shape", "config", "grid", "lanes", "us", "tflops", "vs_cublas", "err", "best",
                                 "note"]))
    print(benchutil.table(summary, ["shape", "cublas_us", "rtk_pick", "rtk_vs_cublas", "dp_best_vs_cublas",
                                    "sk_old_vs_cublas", "sk_new_vs_cublas", "best", "best_vs_cublas"]))


# --lastcells-ab: issue 20's cells below 0.95x cuBLAS (H200, 2026-11-26) and strong cells as a
# regression check (W (N, K), a linear layer's weight).
LASTCELL_SHAPES = [(128, 6144, 4096), (128, 8192, 8192), (3000, 5000, 2000), (128, 4096, 14336), (128, 4096, 4096),
                   (128, 14336, 4096), (128, 28672, 4096), (512, 8192, 8192)]
# (label, block_m, block_n, stages (None: cluster_stages), split_k, stream_k, cluster_k).  "c2" =
# cluster-K: two CTAs per tile, each over half of K, the partials summed through distributed shared
# memory (MatmulSm90Config.cluster_k); "s2" = split-K 2 through the global workspace (rule 2b's).
LASTCELL_M128 = [("dp 128x64", 128, 64, 8, 1, False, 1), ("s2 128x64", 128, 64, 8, 2, False, 1),
                 ("c2 128x64", 128, 64, None, 1, False, 2),
                 ("dp 128x128", 128, 128, 6, 1, False, 1), ("s2 128x128", 128, 128, 6, 2, False, 1),
                 ("c2 128x128", 128, 128, None, 1, False, 2),
                 ("dp 128x192", 128, 192, 5, 1, False, 1), ("c2 128x192", 128, 192, None, 1, False, 2)]
LASTCELL_BIG = [("dp 128x256", 128, 256, 4, 1, False, 1), ("dp 128x256/3", 128, 256, 3, 1, False, 1),
                ("dp 128x192", 128, 192, 5, 1, False, 1),
                ("dp 256x128", 256, 128, 4, 1, False, 1), ("dp 128x128", 128, 128, 6, 1, False, 1),
                ("sk 128x256", 128, 256, 4, 1, True, 1), ("c2 128x192", 128, 192, None, 1, False, 2),
                ("c2 128x128", 128, 128, None, 1, False, 2)]


def plan_math(m90, cfg, m: int, n: int, k: int, sms: int) -> dict:
    """The arithmetic that ranks a schedule before any timing: output tiles, work units (tile x
    split, x 2 for cluster-K), the grid, rounds of units over it and the SM slots they fill, k-blocks
    per unit, and the bytes each CTA moves per k-block (A + B tiles; at M = 128 every CTA reads the
    same A tile from L2, B from DRAM)."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    kb = m90.k_blocks(k)
    grid = m90.grid_size(m, n, 1, cfg, sms, k)
    if cfg.stream_k:   # every CTA the same share of all k-blocks: one "round" of that many k-blocks
        share = tiles * kb / grid
        units, per, rounds, fill = grid, f"{share:.1f} (stream)", 1, share / -(-tiles * kb // grid)
    else:
        s = cfg.cluster_k if cfg.cluster_k > 1 else min(cfg.split_k, kb)
        units, per = tiles * s, f"{-(-kb // s)}"
        rounds = -(-units // grid)
        fill = units / (rounds * grid)
    return {"tiles": tiles, "units": units, "grid": grid, "rounds": rounds, "fill": fill,
            "kb_per_unit": per, "kib_per_kb": cfg.stage_bytes // 1024,
            "b_share": cfg.block_n / (cfg.block_m + cfg.block_n)}


def _lastcell_specs(m90, dtype, m, n, k, sms):
    """(label, config) of the --lastcells-ab candidates of one shape: the heuristic's pick as cluster-K
    too, and the M = 128 or large-M table."""
    import dataclasses
    from rtkernels.ops import matmul as mm
    # contiguous torch operands: 256-byte aligned bases, rows of K elements
    heur = m90.heuristic_config(dtype, m, n, k, sm_count=sms, stream_k=True, b_kmajor=True,
                                rows_128b=mm.rows_on_128b_grid(0, k))
    specs = [("pick", heur)]
    if not heur.stream_k and heur.block_m * heur.block_n <= 128 * 192:
        specs.append(("pick c2", m90.with_cluster_k(dataclasses.replace(heur, split_k=1), 2)))
    for label, bm, bn, st, s, sk, ck in (LASTCELL_M128 if m <= 128 else LASTCELL_BIG):
        st = st or m90.cluster_stages(bm, bn, ck)
        specs.append((label, m90.MatmulSm90Config(dtype=dtype, block_m=bm, block_n=bn, num_stages=st, b_kmajor=True,
                                                  split_k=s, stream_k=sk, cluster_k=ck)))
    # whole tiles off the 64-column grid (matmul_sm90.flex_tile): the model's best three widths
    for t in m90.flex_tiles(m, n, 1, sms)[:3]:
        cfg = m90.MatmulSm90Config(dtype=dtype, block_m=128, block_n=t.block_n, num_stages=t.num_stages, b_kmajor=True)
        specs.append((f"flex 128x{t.block_n}", cfg))
        if cfg.epi_n < cfg.tma_n:   # the same with a ring one stage shorter and one epilogue pass
            specs.append((f"flex 128x{t.block_n}/{t.num_stages - 1}",
                          dataclasses.replace(cfg, num_stages=t.num_stages - 1)))
    # fixed tiles for K scans (--ab-only "fix ...": a per-tile cost against a per-k-block rate)
    for bn, st in ((232, 3), (232, 4), (256, 4), (256, 3), (192, 4), (192, 5)):
        specs.append((f"fix 128x{bn}/{st}", m90.MatmulSm90Config(dtype=dtype, block_m=128, block_n=bn, num_stages=st,
                                                                b_kmajor=True)))
    # the epilogue's direct stores instead of the TMA staging buffer: its shared memory goes to the ring
    for label, cfg in [s for s in specs if s[0] == "pick" or s[0].startswith("flex")]:
        if cfg.tma_store and not cfg.stream_k and cfg.split_k == 1 and cfg.cluster_k == 1 and "/" not in label:
            fields = {**dataclasses.asdict(cfg), "tma_store": False}
            st = m90.deepest_ring(cfg.num_stages + 2, cfg.num_stages + 1, **fields)
            if st is not None:
                specs.append((f"direct {cfg.block_m}x{cfg.block_n}/{st}", m90.MatmulSm90Config(**{**fields, "num_stages": st})))
    return specs


def _wanted(label: str, only: set) -> bool:
    """Whether --ab-only keeps candidate ``label`` (every one when empty; "flex", "fix" and "direct" name
    all candidates of that kind: the flexible widths, the fixed tiles for K scans, the direct-store
    epilogues)."""
    return not only or label in only or any(label.startswith(p) and p in only for p in ("flex", "direct", "fix"))


def lastcells_ab(args) -> None:
    """Issue 20's last cells: cluster-K (two CTAs per tile reducing through distributed shared memory),
    split-K through the workspace, whole tiles and stream-K against rtk.matmul's pick and cuBLAS,
    interleaved in each pass; every kernel launched directly (config and grid shown) and checked
    against cuBLAS.  Each candidate's plan arithmetic (plan_math) is printed first; --plan-only stops
    there (runs without a GPU, 132 SMs assumed)."""
    from rtkernels.ops import matmul_sm90 as m90

    shapes = args.ab_shapes or LASTCELL_SHAPES
    only = set(filter(None, args.ab_only.split(",")))
    if args.plan_only:
        rows = []
        for m, n, k in shapes:
            for label, cfg in _lastcell_specs(m90, args.dtype, m, n, k, 132):
                if _wanted(label, only):
                    rows.append({"shape": f"{m}x{n}x{k}", "config": label,
                                 "tile": f"{cfg.block_m}x{cfg.block_n}/{cfg.num_stages}",
                                 **plan_math(m90, cfg, m, n, k, 132)})
        print(benchutil.table(rows, ["shape", "config", "tile", "tiles", "units", "grid", "rounds", "fill",
                                     "kb_per_unit", "kib_per_kb", "b_share"]))
        return
    import torch
    import rtkernels as rtk
    from rtkernels import device
    from rtkernels.ops import matmul as mm

    tdt = getattr(torch, args.dtype)
    sms = device.sm_count()
    dev = torch.cuda.current_device()
    repeat = 10 if args.quick else 20
    passes = 3 if args.quick else max(3, args.passes)
    rows, summary = [], []
    for m, n, k in shapes:
        sets, out, ref, cands = _ab_inputs(torch, rtk, tdt, m, n, k)
        info, seen = {}, set()
        for label, cfg in _lastcell_specs(m90, args.dtype, m, n, k, sms):
            if not _wanted(label, only) or cfg.split_k > m90.k_blocks(k) or cfg in seen:
                continue
            seen.add(cfg)
            kern = rtk.get_kernel(cfg)
            grid = m90.grid_size(m, n, 1, cfg, sms, k)
            sizes = (m90.workspace_bytes(cfg, m, n, k, 1, grid), m90.counter_bytes(cfg, m, n, 1, grid))
            reduces = cfg.split_k > 1 or cfg.stream_k
            extra = m90.tail_args(cfg, m, sms)
            cands[label] = _direct_runner(m90, cfg, kern, grid, sizes if reduces else None, extra, m, n, k, out, dev)
            info[label] = (cfg, plan_math(m90, cfg, m, n, k, sms))
        med = _median_interleaved(cands, sets, passes, repeat)
        flops = 2.0 * m * n * k
        picked = mm._plans90[next(key for key in reversed(list(mm._plans90)) if key[1:5] == (m, n, k, 1))][1]
        pick = (f"{_schedule_label(picked.block_m, picked.block_n, picked.split_k, picked.stream_k, picked.cluster_k)}"
                f"/{picked.num_stages}")
        best = min((c for c in med if c not in ("cuBLAS", "rtk.matmul")), key=med.get, default="rtk.matmul")
        for c, ms in med.items():
            out.fill_(float("nan"))   # poisoned: a candidate that skips a tile shows as NaN error
            cands[c](*sets[0])
            got = (out if c != "cuBLAS" else torch.matmul(sets[0][0], sets[0][1].T)).float()
            err = float(((got - ref).abs().max() / ref.abs().max()).item())
            cfg, pm = info.get(c, (None, {}))
            rows.append({"shape": f"{m}x{n}x{k}", "config": c,
                         "tile": f"{cfg.block_m}x{cfg.block_n}/{cfg.num_stages}" if cfg else pick if c == "rtk.matmul"
                         else "", **{f: pm.get(f) for f in ("tiles", "grid", "rounds", "fill", "kb_per_unit")},
                         "us": ms * 1e3, "tflops": flops / ms / 1e9, "vs_cublas": med["cuBLAS"] / ms, "err": err,
                         "best": c == best})
        c2 = [c for c in med if c.startswith("c2") or c == "pick c2"]
        c2_best = min(c2, key=med.get, default=None)
        summary.append({"shape": f"{m}x{n}x{k}", "cublas_us": med["cuBLAS"] * 1e3, "rtk_pick": pick,
                        "rtk_vs_cublas": med["cuBLAS"] / med["rtk.matmul"], "best": best,
                        "best_vs_cublas": med["cuBLAS"] / med[best], "best_c2": c2_best,
                        "best_c2_vs_cublas": med["cuBLAS"] / med[c2_best] if c2_best else float("nan")})
        print(f"  {m}x{n}x{k}: cuBLAS {med['cuBLAS'] * 1e3:.1f} us, rtk.matmul ({pick}) "
              f"{med['rtk.matmul'] * 1e3:.1f} us, best {best} {med[best] * 1e3:.1f} us", flush=True)
        del sets
        torch.cuda.empty_cache()
    env = benchutil.environment()
    env["torch"] = torch.__version__
    benchutil.save(args.out, "matmul_lastcells_ab", {"environment": env, "dtype": args.dtype, "passes": passes,
                                                     "repeat": repeat, "rows": rows, "summary": summary})
    print(f"{env['gpu']}  {args.dtype}  ({sms} SMs)  last-cells A/B (W (N, K); kernels launched directly; "
          "c2 = cluster-K, s2 = split-K 2, sk = stream-K; rounds x grid units, fill = units / slots)")
    print(benchutil.table(rows, ["shape", "config", "tile", "tiles", "grid", "rounds", "fill", "kb_per_unit", "us",
                                 "tflops", "vs_cublas", "err", "best"]))
    print(benchutil.table(summary, ["shape", "cublas_us", "rtk_pick", "rtk_vs_cublas", "best", "best_vs_cublas",
                                    "best_c2", "best_c2_vs_cublas"]))


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
    # mma.sync consumers (ldmatrix + HMMA m16n8k16 from the same TMA ring), direct C stores
    ("sync 128x256/4", dict(block_m=128, block_n=256, num_stages=4, tma_store=False, mma="sync")),
    ("sync 128x256/3", dict(block_m=128, block_n=256, num_stages=3, tma_store=False, mma="sync")),
    ("sync 128x256/4 g16", dict(block_m=128, block_n=256, num_stages=4, group_m=16, tma_store=False, mma="sync")),
    ("sync 128x256/4 g4", dict(block_m=128, block_n=256, num_stages=4, group_m=4, tma_store=False, mma="sync")),
    ("sync 128x192/4", dict(block_m=128, block_n=192, num_stages=4, tma_store=False, mma="sync")),
    ("sync 128x128/6", dict(block_m=128, block_n=128, num_stages=6, tma_store=False, mma="sync")),
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
    only = set(args.sweep_only.split(",")) if args.sweep_only else None
    configs = [(lbl, f) for lbl, f in SWEEP_SM90 if not only or lbl in only]
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
        for label, fields in configs:
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
            for lbl, _ in configs]
    flat.append({"config": "cuBLAS", **{f"n={r['n']}": r["cuBLAS"] for r in rows},
                 "fused 4096 (x sep)": fused.get("cuBLAS addmm+gelu", "")})
    print(benchutil.table(flat, ["config"] + [f"n={r['n']}" for r in rows] + ["fused 4096 (x sep)"]))


# (label, MatmulConfig fields): every variant one --sweep run compares (bf16, A row-major, B
# row-major, K a multiple of block_k).  "csN": refill copies spread over N k steps; "pfN": L2
# fetch-size hint of N bytes; "w4": 4 warps (2 CTAs per SM); "gN": group_m.
_T32 = dict(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=4, warps_m=2)
_T64 = dict(_T32, block_k=64)
_P = dict(copy_steps=2, l2_prefetch=256)
SWEEP = [
    ("128x256x32/4", _T32),                                      # the heuristic's tile at every K
    ("128x256x64/4", _T64),                                      # the third session's K >= 8192 tile
    ("128x256x32/4 cs2 pf256", dict(_T32, **_P)),
    ("128x256x32/6 cs2 pf256", dict(_T32, **_P, num_stages=6)),
    ("128x256x64/4 cs3", dict(_T64, copy_steps=3)),
    ("256x128x32/4 cs2 pf256", dict(_T32, **_P, block_m=256, block_n=128, warps_m=4)),
    ("128x128x32/4 w4", dict(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=4, warps_m=2)),
    # measurement builds (wrong results, -DRTK_MATMUL_DIAG): no refill copies / no barriers / neither
    ("128x256x32/4 DIAG no copies", dict(_T32, diag=1)),
    ("128x256x32/4 DIAG no barriers", dict(_T32, diag=2)),
    ("128x256x32/4 DIAG neither", dict(_T32, diag=3)),
]
# --sweep-k: M = N = 4096 at these K for the first configs of KSCAN; time(K) = fixed + per_k * K
# separates the per-tile fixed cost (pipeline fill, epilogue, wave tail) from the main loop's.
KSCAN = ["128x256x32/4", "128x256x32/4 cs2 pf256", "128x256x32/4 DIAG neither"]
KSCAN_K = (1024, 2048, 4096, 8192)


def _sweep_kernel(fields: dict, k: int, arch: str):
    """(config, kernel, diag) of a SWEEP entry for bf16 A row-major, B row-major and this K; a
    ``diag`` entry builds the measurement variant (-DRTK_MATMUL_DIAG, wrong results)."""
    import rtkernels as rtk
    from rtkernels.compiler import CompileOptions
    from rtkernels.ops import matmul as mm
    fields = dict(fields)
    diag = fields.pop("diag", 0)
    cfg = mm.MatmulConfig(dtype="bfloat16", a_kmajor=True, b_kmajor=False, even_k=k % fields["block_k"] == 0,
                          **fields)
    opts = CompileOptions(defines=(("RTK_MATMUL_DIAG", str(diag)),)) if diag else None
    kern = rtk.get_kernel(cfg, arch=arch, options=opts)
    kern.resources   # compile now: a variant that does not build is reported by the caller
    return cfg, kern, diag


def sweep(args) -> None:
    import cupy as cp
    import numpy as np
    import torch
    import rtkernels as rtk
    from rtkernels import device
    from rtkernels.ops import matmul as mm
    from benchutil import time_queued as time_gpu

    tdt = torch.bfloat16
    l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice()).get("l2CacheSize", 50 << 20))
    sms = device.sm_count()
    arch = device.current_arch()
    only = set(args.sweep_only.split(",")) if args.sweep_only else None
    configs = [(lbl, f) for lbl, f in SWEEP if only is None or lbl in only]
    rows, fused_rows = [], []
    for n in args.sizes or (4096, 8192):
        count = max(1, min(4, -(-2 * l2 // (2 * 3 * n * n))))   # enough input sets to overflow L2 twice
        sets_t, sets, out_t, out, flops, ms_cublas, ref = _square_problem(torch, tdt, n, count)
        ms_cublas = time_gpu(lambda a, b, _: torch.matmul(a, b), sets_t, repeat=args.repeat)[0]
        row = {"n": n, "cuBLAS": round(flops / ms_cublas / 1e9)}
        heur = mm.heuristic_config("bfloat16", n, n, n, sm_count=sms, a_kmajor=True, b_kmajor=False)
        row["heuristic"] = (f"{heur.block_m}x{heur.block_n}x{heur.block_k}/{heur.num_stages} cs{heur.copy_steps}"
                            f" pf{heur.l2_prefetch}")
        built = {}
        for label, fields in configs:
            try:
                cfg, k_, diag = _sweep_kernel(fields, n, arch)
            except Exception as e:   # a variant that does not build is reported, not fatal
                row[label] = f"err {type(e).__name__}"
                print(f"  n={n} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            tiles = -(-n // cfg.block_m) * -(-n // cfg.block_n)

            def run(a, b, bias, cfg=cfg, k_=k_, tiles=tiles):
                k_.launch((tiles, 1, 1), (cfg.threads_per_block, 1, 1), a, b, None, out, n, n, n, n, n, n, 0, 0, 0,
                          8, shared_mem=cfg.shared_mem_bytes)
            out_t.fill_(float("nan"))
            run(*sets[0])
            err = float(((out_t.float() - ref).abs().max() / ref.abs().max()).item())
            built[label] = (run, err, diag, k_)
            if n == 4096 and args.fused and not diag:
                fused_rows.append((label, cfg, tiles))
        # --passes: every config once per pass, so that clock and thermal drift over the run
        # spreads over all of them; the cell is the median pass
        tfs = {label: [] for label in built}
        for _ in range(args.passes):
            for label, (run, err, diag, k_) in built.items():
                tfs[label].append(flops / time_gpu(run, sets, repeat=args.repeat)[0] / 1e9)
        ms_cublas_end = time_gpu(lambda a, b, _: torch.matmul(a, b), sets_t, repeat=args.repeat)[0]
        row["cuBLAS end"] = round(flops / ms_cublas_end / 1e9)
        for label, (run, err, diag, k_) in built.items():
            tf = float(np.median(tfs[label]))
            spill = k_.resources.spill_stores
            spread = f" [{min(tfs[label]):.0f}-{max(tfs[label]):.0f}]" if args.passes > 1 else ""
            row[label] = f"{tf:.0f} ({tf / row['cuBLAS']:.2f}x){spread}" + ("" if err <= 1e-2 or diag else " BAD") + \
                (f" spill{spill}" if spill else "")
            row[label + " regs"] = k_.resources.registers
            row[label + " tflops"] = [round(x, 1) for x in tfs[label]]
            print(f"  n={n} {label}: {row[label]} regs {k_.resources.registers}  cuBLAS {row['cuBLAS']}", flush=True)
        rows.append(row)
        if n == 4096 and args.fused:
            ms_sep = time_gpu(lambda a, b, bias: torch.nn.functional.gelu(torch.addmm(bias, a, b)), sets_t,
                              repeat=args.repeat)[0]
            f = {"n": n, "cuBLAS addmm+gelu ms": round(ms_sep, 4)}
            for label, cfg, tiles in fused_rows:
                fc = cfg.replace(has_bias=True, activation="gelu")
                kf = rtk.get_kernel(fc, arch=arch)

                def runf(a, b, bias, fc=fc, kf=kf, tiles=tiles):
                    kf.launch((tiles, 1, 1), (fc.threads_per_block, 1, 1), a, b, bias, out, n, n, n, n, n, n, 0, 0, 0,
                              8, shared_mem=fc.shared_mem_bytes)
                ms = time_gpu(runf, sets, repeat=args.repeat)[0]
                f[label] = f"{ms:.3f}ms ({ms_sep / ms:.2f}x)"
            fused_rows = [f]
        del sets, sets_t
        torch.cuda.empty_cache()

    kscan = []
    if args.sweep_k:
        n = 4096
        for label in KSCAN:
            cfg, k_, _ = _sweep_kernel(dict(SWEEP)[label], n, arch)
            tiles = -(-n // cfg.block_m) * -(-n // cfg.block_n)
            pts = []
            for kk in KSCAN_K:
                count = max(1, min(4, -(-2 * l2 // (2 * (2 * n * kk + n * n)))))
                def bf16(shape):   # bfloat16 bits of normal values
                    return (cp.random.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
                sets = [(bf16((n, kk)), bf16((kk, n))) for _ in range(count)]
                c = cp.empty((n, n), cp.uint16)

                def run(a, b, k_=k_, cfg=cfg, kk=kk, c=c, tiles=tiles):
                    k_.launch((tiles, 1, 1), (cfg.threads_per_block, 1, 1), a, b, None, c, n, n, kk, kk, n, n, 0, 0,
                              0, 8, shared_mem=cfg.shared_mem_bytes)
                pts.append((kk, time_gpu(run, sets, repeat=args.repeat)[0]))
                del sets
            ks = np.array([p[0] for p in pts], float)
            ts = np.array([p[1] for p in pts], float)
            slope, icpt = np.polyfit(ks, ts, 1)
            waves = -(-tiles // sms)
            main_tf = 2.0 * n * n / slope / 1e9
            kscan.append({"config": label, "ms": {int(k): round(t, 4) for k, t in pts},
                          "fixed_us": round(icpt * 1e3, 1), "fixed_us_per_wave": round(icpt * 1e3 / waves, 2),
                          "main_loop_tflops": round(main_tf), "waves": waves})
            print(f"  kscan {label}: {kscan[-1]}", flush=True)

    benchutil.save(args.out, "matmul_sweep", {"environment": benchutil.environment(), "square": rows,
                                              "fused_bias_gelu": fused_rows, "kscan": kscan})
    print(f"{benchutil.environment()['gpu']}  bfloat16 sweep  ({sms} SMs); cell = TFLOP/s (x cuBLAS)")
    flat = []
    for lbl, _ in configs:
        flat.append({"config": lbl, **{f"n={r['n']}": r.get(lbl, "") for r in rows},
                     "regs": rows[0].get(lbl + " regs", ""),
                     **({"fused 4096 (x sep)": fused_rows[0].get(lbl, "")} if fused_rows else {})})
    flat.append({"config": "cuBLAS (start / end)", **{f"n={r['n']}": f"{r['cuBLAS']} / {r['cuBLAS end']}" for r in rows},
                 "regs": "",
                 **({"fused 4096 (x sep)": f"{fused_rows[0]['cuBLAS addmm+gelu ms']}ms"} if fused_rows else {})})
    print("heuristic picks: " + " | ".join(f"{r['n']}: {r['heuristic']}" for r in rows))
    for k in kscan:
        print(f"kscan {k['config']}: fixed {k['fixed_us']} us ({k['fixed_us_per_wave']} us/wave, {k['waves']} waves), "
              f"main loop {k['main_loop_tflops']} TFLOP/s; ms {k['ms']}")
    print(benchutil.table(flat, ["config"] + [f"n={r['n']}" for r in rows] + ["regs"] +
                          (["fused 4096 (x sep)"] if fused_rows else [])))


CEILING_SRC = r"""
// mma.sync ceilings of this device for the matmul kernel's 64 x 64 warp tile (bf16, f32 accumulate):
// hmma_regs issues only HMMAs on register fragments; hmma_ldsm feeds each k16 step with the
// kernel's 8 ldmatrix.x4 (4 for A, 4 .trans for B) from a swizzled shared tile, double-buffered,
// without global loads or barriers.  8 warps per CTA, one CTA per SM (as the 128 x 256 tile).
#include "rtk/gemm.cuh"

extern "C" __global__ void __launch_bounds__(256, 1) hmma_regs(float* out, int iters) {
    unsigned a[4][4], b[8][2];
    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[i][e] = (threadIdx.x * 2654435761u + i * 97 + e) & 0x3f803f80u;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) b[j][e] = (threadIdx.x * 40503u + j * 31 + e) & 0x3f803f80u;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) rtk::mma_m16n8k16<__nv_bfloat16>(acc[i][j], a[i], b[j][0], b[j][1]);
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s += acc[i][j][e];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(256, 1) hmma_ldsm(float* out, int iters) {
    // A: 128 x 32 K-major (64-byte rows), B: 32 x 256 N-major, one stage of the real kernel
    __shared__ __align__(128) unsigned short sa[128 * 32], sb[32 * 256];
    for (int i = threadIdx.x; i < 128 * 32; i += 256) sa[i] = (unsigned short)(0x3f80 ^ (i & 0x7f));
    for (int i = threadIdx.x; i < 32 * 256; i += 256) sb[i] = (unsigned short)(0x3f80 ^ (i & 0x3f));
    __syncthreads();
    const unsigned base_a = rtk::smem_addr(sa), base_b = rtk::smem_addr(sb);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm0 = (warp / 4) * 64, wn0 = (warp % 4) * 64;
    const int j8 = lane >> 3, l8 = lane & 7;
    unsigned offa[2], offb[4];
#pragma unroll
    for (int s = 0; s < 2; ++s) offa[s] = base_a + 2 * rtk::swizzle<32>(wm0 + (j8 & 1) * 8 + l8, (j8 >> 1) * 8 + 16 * s);
#pragma unroll
    for (int f = 0; f < 4; ++f) offb[f] = base_b + 2 * rtk::swizzle<256>((j8 & 1) * 8 + l8, wn0 + (j8 >> 1) * 8 + 16 * f);
    unsigned af[2][4][4], bf[2][8][2];
    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    auto load = [&](int buf, int s) {
#pragma unroll
        for (int i = 0; i < 4; ++i) rtk::ldsm_x4_s<false>(af[buf][i], offa[s] + i * 16 * 64);
#pragma unroll
        for (int f = 0; f < 4; ++f) {
            unsigned r[4];
            rtk::ldsm_x4_s<true>(r, offb[f] + s * 16 * 512);
            bf[buf][2 * f][0] = r[0]; bf[buf][2 * f][1] = r[1]; bf[buf][2 * f + 1][0] = r[2]; bf[buf][2 * f + 1][1] = r[3];
        }
    };
    load(0, 0);
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            load((s + 1) & 1, (s + 1) & 1);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    rtk::mma_m16n8k16<__nv_bfloat16>(acc[i][j], af[s][i], bf[s][j][0], bf[s][j][1]);
        }
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s += acc[i][j][e];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def ceiling(args) -> dict:
    """TFLOP/s of bf16 mma.sync m16n8k16 on this device with the kernel's 64 x 64 warp tile, one
    8-warp CTA per SM: HMMAs alone, and HMMAs fed by the kernel's ldmatrix pattern from shared
    memory.  What the matmul kernel can reach at most, before global loads and barriers."""
    import cupy as cp
    import rtkernels as rtk
    from rtkernels import device
    sms = device.sm_count()
    t = rtk.Template(CEILING_SRC, name="matmul_ceiling")
    out = cp.empty(sms * 4 * 256, cp.float32)
    res = {}
    for name, hmma_per_iter in (("hmma_regs", 32), ("hmma_ldsm", 64)):
        k = rtk.compile(t, kernel=name)
        for grid in (sms, 4 * sms):
            iters = 4096 if name == "hmma_regs" else 2048
            ms = benchutil.time_cuda(lambda: k.launch((grid, 1, 1), (256, 1, 1), out, iters), repeat=5)
            res[f"{name} grid={grid // sms}xSMs"] = round(grid * 8 * iters * hmma_per_iter * 4096 / ms / 1e9)
    env = benchutil.environment()
    benchutil.save(args.out, "matmul_ceiling", {"environment": env, "tflops": res})
    print(f"{env['gpu']}  bf16 mma.sync m16n8k16 ceilings (TFLOP/s), 8 warps x 64x64 warp tiles per CTA")
    print(benchutil.table([res], list(res)))
    return res


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
    if "triton_mma_sync_tflops" in rows[0]:
        ax.plot(xs, [r["triton_mma_sync_tflops"] for r in rows], marker="+", label="Triton mma.sync")
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
