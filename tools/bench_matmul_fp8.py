"""fp8 matmul: rtk.matmul on float8_e4m3fn operands against torch._scaled_mm (cuBLAS fp8) in one run.

    PYTHONPATH=. python tools/bench_matmul_fp8.py [--out DIR] [--quick] [--no-sweep]

Shapes: 4096^3 and 8192^3, and M in {512, 2048, 8192} x (N, K) of Llama-3 8B / 70B projections
((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192)).  A is (M, K) row-major,
B the transpose of a row-major (N, K) weight (``w.t()``: both K-major, the layout cuBLAS fp8 and
8-bit wgmma take), per-tensor float32 scales on the device, bf16 output.

Candidates per shape, timed interleaved (``--passes`` rounds over all of them, median shown), each a
queue of back-to-back calls between events behind a spin kernel (benchutil.time_queued), rotating
over enough input sets to exceed L2 twice:
  scaled_mm       torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=bf16): use_fast_accum=False, the
                  default (cuBLAS promotes the fp8 partial sums into f32, as rtk does)
  rtk             rtk.matmul(a, b, scale_a=, scale_b=, out=): the heuristic's promoted config
  scaled_mm_fast  use_fast_accum=True (no promotion)
  rtk_fast        rtk's promote_interval=0 tile (FAST_ACCUM_TILES: 128x256, one accumulator)
``rel_diff``: max |rtk - scaled_mm| / max |scaled_mm| on the first input set.
With the sweep (default; ``--no-sweep`` skips it) every tile of TILES, TUNE_ONLY and FAST_ACCUM_TILES
also runs at 4096^3 and 8192^3 (for the heuristic's efficiencies, which are reasoned until measured).
The summary table is printed last; everything goes to DIR/matmul_fp8.json.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402

SQUARES = (4096, 8192)
LLM_NK = ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192))
LLM_M = (512, 2048, 8192)


@contextlib.contextmanager
def tiles(f8, chosen):
    """rtk.matmul's fp8 heuristic restricted to ``chosen`` tiles (plans cleared before and after)."""
    old = f8.TILES
    f8.TILES = tuple(chosen)
    f8._plans.clear()
    f8._LAUNCHES.clear()
    try:
        yield
    finally:
        f8.TILES = old
        f8._plans.clear()
        f8._LAUNCHES.clear()


def main() -> None:
    p = benchutil.parser(__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=3, help="interleaved rounds over the candidates (median shown)")
    p.add_argument("--repeat", type=int, default=10, help="timed calls per candidate per round")
    p.add_argument("--no-sweep", action="store_true", help="skip the per-tile sweep at 4096^3 / 8192^3")
    args = p.parse_args()

    import cupy as cp
    import torch
    import rtkernels as rtk
    from rtkernels import device
    from rtkernels.ops import matmul_fp8 as f8
    from benchutil import time_queued

    if device.current_arch() != "sm_90":
        raise SystemExit(f"fp8 matmul needs sm_90; this is {device.current_arch()}")
    l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice()).get("l2CacheSize", 50 << 20))
    sms = device.sm_count()
    passes, repeat = (1, 5) if args.quick else (args.passes, args.repeat)
    fp8 = torch.float8_e4m3fn

    def sets_for(m, n, k):
        per = m * k + n * k + 2 * m * n
        out = []
        for _ in range(max(1, min(4, -(-2 * l2 // per)))):
            a = (torch.randn(m, k, device="cuda") * 0.5).to(fp8)
            w = (torch.randn(n, k, device="cuda") * 0.5).to(fp8)
            sa = torch.tensor(0.7, device="cuda")
            sb = torch.tensor(1.3, device="cuda")
            out.append((a, w.t(), sa, sb))
        return out

    def measure(m, n, k, candidates):
        """{name: median ms over passes} with the candidates interleaved pass by pass."""
        sets = sets_for(m, n, k)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        times = {name: [] for name in candidates}
        for _ in range(passes):
            for name, (fn, ctx) in candidates.items():
                with ctx():
                    times[name].append(time_queued(lambda a, b, sa, sb: fn(a, b, sa, sb, out), sets, repeat=repeat)[0])
        a, b, sa, sb = sets[0]
        ref = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
        got = rtk.matmul(a, b, scale_a=sa, scale_b=sb).float()
        diff = float((got - ref).abs().max() / ref.abs().max())
        del sets
        torch.cuda.empty_cache()
        return {name: statistics.median(v) for name, v in times.items()}, diff

    def scaled(fast):
        return lambda a, b, sa, sb, out: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                          use_fast_accum=fast)

    def rtk_mm(a, b, sa, sb, out):
        return rtk.matmul(a, b, scale_a=sa, scale_b=sb, out=out)

    default = contextlib.nullcontext
    candidates = {"scaled_mm": (scaled(False), default), "rtk": (rtk_mm, default),
                  "scaled_mm_fast": (scaled(True), default),
                  "rtk_fast": (rtk_mm, lambda: tiles(f8, f8.FAST_ACCUM_TILES))}
    shapes = [(s, s, s, "square") for s in SQUARES]
    shapes += [(m, n, k, "llm") for m in LLM_M for n, k in LLM_NK]
    if args.quick:
        shapes = shapes[:2] + [(2048, n, k, "llm") for n, k in LLM_NK[:3]]
    rows = []
    for m, n, k, kind in shapes:
        ms, diff = measure(m, n, k, candidates)
        fl = 2.0 * m * n * k
        cfg = f8.heuristic_config(m, n, k, sm_count=sms)
        row = {"shape": f"{m}x{n}x{k}", "kind": kind, "tile": f"{cfg.block_m}x{cfg.block_n}/{cfg.num_stages}",
               **{f"{c}_tflops": fl / t / 1e9 for c, t in ms.items()},
               "vs_scaled_mm": ms["scaled_mm"] / ms["rtk"], "fast_vs_fast": ms["scaled_mm_fast"] / ms["rtk_fast"],
               "rel_diff": diff}
        rows.append(row)
        print(benchutil.table([row], list(row)), flush=True)

    sweep = []
    if not args.no_sweep and not args.quick:
        for s in SQUARES:
            cands = {"scaled_mm": (scaled(False), default)}
            for t in f8.TILES + f8.TUNE_ONLY + f8.FAST_ACCUM_TILES:
                name = f"{t.block_m}x{t.block_n}/{t.num_stages}/p{t.promote_interval}"
                cands[name] = (rtk_mm, (lambda t=t: tiles(f8, (t,))))
            ms, _ = measure(s, s, s, cands)
            for name, t in ms.items():
                sweep.append({"n": s, "config": name, "tflops": 2.0 * s ** 3 / t / 1e9,
                              "vs_scaled_mm": ms["scaled_mm"] / t})

    env = benchutil.environment()
    env["torch"] = torch.__version__
    payload = {"environment": env, "rows": rows, "sweep": sweep}
    path = benchutil.save(args.out, "matmul_fp8", payload)
    sq = [r["vs_scaled_mm"] for r in rows if r["kind"] == "square"]
    llm = [r["vs_scaled_mm"] for r in rows if r["kind"] == "llm"]
    if sweep:
        print(benchutil.table(sweep, ["n", "config", "tflops", "vs_scaled_mm"]))
    print(f"\n{env['gpu']} ({sms} SMs), torch {torch.__version__}, fp8 e4m3 x e4m3 -> bf16, per-tensor scales; "
          f"kernel time, calls queued back to back; JSON: {path}")
    print(benchutil.table(rows, ["shape", "tile", "scaled_mm_tflops", "rtk_tflops", "vs_scaled_mm",
                                 "scaled_mm_fast_tflops", "rtk_fast_tflops", "fast_vs_fast", "rel_diff"]))
    gm = math.exp(sum(map(math.log, llm)) / len(llm)) if llm else float("nan")
    print(f"targets: squares >= 0.95x: min {min(sq):.3f} {'PASS' if min(sq) >= 0.95 else 'FAIL'}; "
          f"llm M >= 512 >= 0.9x: min {min(llm) if llm else float('nan'):.3f} (geomean {gm:.3f}) "
          f"{'PASS' if llm and min(llm) >= 0.9 else 'FAIL'}")


if __name__ == "__main__":
    main()
