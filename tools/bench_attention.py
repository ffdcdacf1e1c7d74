"""Attention forward benchmark: rtk.attention against PyTorch SDPA (flash and cuDNN backends).

FlashAttention's grid: 16k tokens per batch (batch = 16384 / seqlen), hidden 2048 (nheads =
2048 / head_dim), seqlen 512 ... 16k, head dims 64, 128, 256 (+ 80, 96), causal and not.
TFLOP/s = 4 * batch * seqlen_q * seqlen_k * nheads * head_dim / time, halved for causal.
Also: cold compile time of one config and its warm (disk-cache) load time.  Run on the GPU:

    PYTHONPATH=. python tools/bench_attention.py --out results/ [--quick] [--dtype bfloat16]

Every (seqlen, head_dim) set holds 16k x 2048 elements per tensor (64 MiB in 16 bits), more
than L2 holds, so inputs are not rotated.  Each kernel is checked against the others' output
once before it is timed.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402

TOKENS = 16384
HIDDEN = 2048


def _flops(batch, sq, sk, h, d, causal):
    f = 4.0 * batch * sq * sk * h * d
    return f / 2 if causal else f


def _inputs(batch, s, h, d, dtype, torch):
    """q, k, v as (batch, seqlen, nheads, head_dim): torch tensors when torch is present
    (the same memory serves every peer), else CuPy (bfloat16 as uint16 bits)."""
    import cupy as cp
    shape = (batch, s, h, d)
    if torch is not None:
        tdt = getattr(torch, dtype)
        return [torch.randn(shape, device="cuda", dtype=tdt) for _ in range(3)]
    xs = [cp.random.standard_normal(shape, dtype=cp.float32) for _ in range(3)]
    if dtype == "bfloat16":
        return [((x.view(cp.uint32) + 0x8000) >> 16).astype(cp.uint16) for x in xs]
    return [x.astype(dtype) for x in xs]


def _ours(q, k, v, causal, dtype, torch):
    """A launcher bound to prepared arguments: the timed loop measures the kernel, not Python."""
    import cupy as cp
    import importlib
    A = importlib.import_module("rtkernels.ops.attention")   # the module, not the re-exported function
    extra = {} if torch is not None else ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})
    o, _ = A.attention(q, k, v, causal=causal, **extra)        # compiles, checks, allocates once
    as_cp = (lambda t: cp.from_dlpack(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)) if torch else (
        lambda t: t)
    qc, kc, vc, oc = (as_cp(t) for t in (q, k, v, o))
    b, s, h, d = qc.shape
    kern, cfg = A._kernel_for(dtype, d, causal, A._device_arch(cp.cuda.runtime.getDevice()))
    lse = cp.empty((b, h, s), cp.float32)
    st = [x.strides[i] // x.itemsize for x in (qc, kc, vc, oc) for i in range(3)]
    grid = (-(-s // cfg.block_m), h, b)
    stream = torch.cuda.current_stream().cuda_stream if torch else None
    args = (qc, kc, vc, oc, lse, s, kc.shape[1], h // kc.shape[2], *st, 1.0 / d ** 0.5)

    def run():
        kern.launch(grid, (cfg.threads_per_block,), *args, shared_mem=cfg.shared_mem_bytes, stream=stream)
    return run, o, cfg


def _sdpa(q, k, v, causal, backend, torch):
    from torch.nn.attention import sdpa_kernel
    F = torch.nn.functional
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))   # (b, h, s, d) views of the same memory

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    try:
        out = run()
    except RuntimeError as exc:   # backend refuses this shape/dtype/GPU
        return None, str(exc).splitlines()[0][:80]
    return run, out.transpose(1, 2)


def _max_diff(a, b, torch):
    import cupy as cp
    if torch is not None:
        return float((a.float() - b.float()).abs().max())
    return float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max())


def compile_times(dtype: str) -> dict:
    import rtkernels as rtk
    from rtkernels import cache, kernel
    from rtkernels.ops.attention import AttentionConfig
    cfg = AttentionConfig(dtype=dtype, head_dim=128, causal=False, block_m=128, block_n=64, num_warps=4,
                          num_stages=1)
    with tempfile.TemporaryDirectory(prefix="rtk-attn-cold-") as d:
        old = os.environ.get("RTKERNELS_CACHE_DIR")
        os.environ["RTKERNELS_CACHE_DIR"] = d
        try:
            cache.clear_memory()
            kernel._clear_memo()
            t0 = time.perf_counter()
            rtk.get_kernel(cfg)
            cold = time.perf_counter() - t0
            cache.clear_memory()
            kernel._clear_memo()
            t0 = time.perf_counter()
            k = rtk.get_kernel(cfg)
            k.function()   # module load into the context counts as part of a warm start
            warm = time.perf_counter() - t0
        finally:
            if old is None:
                del os.environ["RTKERNELS_CACHE_DIR"]
            else:
                os.environ["RTKERNELS_CACHE_DIR"] = old
            cache.clear_memory()
            kernel._clear_memo()
    return {"config": cfg.key(), "cold_compile_s": cold, "warm_disk_load_s": warm}


def tune(head_dims, dtype: str, torch, seqlen: int = 4096) -> list[dict]:
    """Autotune each (head_dim, causal) at one seqlen and report heuristic vs best tile: the data the
    heuristics table is set from."""
    import importlib
    from rtkernels import autotune
    A = importlib.import_module("rtkernels.ops.attention")
    import dataclasses
    import cupy as cp
    from rtkernels import inspect as rinspect
    arch = A._device_arch(cp.cuda.runtime.getDevice())
    # prebuild every candidate in parallel worker processes (they land in the disk cache the tuner reads)
    params = [{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
              for d in head_dims for causal in (False, True) for c in A.tile_space(dtype, d, causal, arch)]
    t0 = __import__("time").perf_counter()
    rinspect.sweep("attention", params, arch=arch, jobs=min(16, os.cpu_count() or 1))
    print(f"prebuilt {len(params)} candidates in {__import__('time').perf_counter() - t0:.1f} s", flush=True)
    os.environ["RTKERNELS_AUTOTUNE"] = "1"
    rows = []
    try:
        for d in head_dims:
            h = HIDDEN // d
            b = max(1, TOKENS // seqlen)
            for causal in (False, True):
                q, k, v = _inputs(b, seqlen, h, d, dtype, torch)
                extra = {} if torch is not None else ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})
                A.attention(q, k, v, causal=causal, **extra)           # runs the tuner for this key
                flops = _flops(b, seqlen, seqlen, h, d, causal)
                heur = A.choose_config(dtype, d, causal, arch)
                key = autotune.make_key("attention", {"dtype": dtype, "head_dim": d, "causal": causal, "arch": arch,
                                                      "seqlen_q": A._seqlen_bucket(seqlen),
                                                      "seqlen_k": A._seqlen_bucket(seqlen)})
                timings = autotune.load().get(key, {}).get("timings", {})
                ranked = sorted(timings.items(), key=lambda kv: kv[1])
                row = {"head_dim": d, "causal": causal, "seqlen": seqlen,
                       "heuristic": _short(heur), "heuristic_tflops": flops / (timings.get(heur.key(), float("nan")) * 1e-3) / 1e12}
                for i, (ck, ms) in enumerate(ranked[:3]):
                    row[f"best{i + 1}"] = _short_key(ck)
                    row[f"best{i + 1}_tflops"] = flops / (ms * 1e-3) / 1e12
                row["all"] = {_short_key(ck): flops / (ms * 1e-3) / 1e12 for ck, ms in ranked}
                rows.append(row)
                print(row, flush=True)
                del q, k, v
    finally:
        os.environ.pop("RTKERNELS_AUTOTUNE", None)
    return rows


def _short(cfg) -> str:
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + (" qreg" if cfg.q_in_regs else "")


def _short_key(key: str) -> str:
    import re
    f = dict(re.findall(r"(\w+)=([^,)]+)", key))
    return f"{f['block_m']}x{f['block_n']} w{f['num_warps']} s{f['num_stages']}" + (
        " qreg" if f.get("q_in_regs") == "True" else "")


def main():
    p = bu.parser(__doc__)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--head-dims", default="64,128,256,80,96")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--tune", action="store_true", help="autotune each head dim (seqlen 4096) and report "
                                                       "heuristic vs best tiles instead of the peer comparison")
    args = p.parse_args()
    env = bu.environment()
    torch, peers = bu.attention_peers(env)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    if args.quick:
        head_dims, seqlens = head_dims[:2], [s for s in seqlens if s in (1024, 4096)] or seqlens[:2]
    warmup, repeat = (2, 5) if args.quick else (3, 10)

    import cupy as cp
    cp.cuda.Device().synchronize()   # create the CUDA context first: it is not part of a warm start
    if args.tune:
        os.environ.setdefault("RTKERNELS_CACHE_DIR", tempfile.mkdtemp(prefix="rtk-attn-tune-"))
        rows = tune(head_dims, args.dtype, torch)
        bu.save(args.out, "bench_attention_tune", {"env": env, "dtype": args.dtype, "rows": rows})
        print(bu.table(rows, ["head_dim", "causal", "heuristic", "heuristic_tflops", "best1", "best1_tflops",
                              "best2", "best2_tflops", "best3", "best3_tflops"]))
        return
    ct = compile_times(args.dtype)
    rows = []
    for d in head_dims:
        h = HIDDEN // d
        for causal in (False, True):
            for s in seqlens:
                b = max(1, TOKENS // s)
                q, k, v = _inputs(b, s, h, d, args.dtype, torch)
                row = {"head_dim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h}
                run, o_ours, cfg = _ours(q, k, v, causal, args.dtype, torch)
                row["config"] = f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                ms = bu.time_cuda(run, warmup=warmup, repeat=repeat)
                flops = _flops(b, s, s, h, d, causal)
                row["rtk_ms"] = ms
                row["rtk_tflops"] = flops / (ms * 1e-3) / 1e12
                for name, backend in peers.items():
                    prun, out = _sdpa(q, k, v, causal, backend, torch)
                    if prun is None:
                        row[f"{name}_tflops"] = None
                        row[f"{name}_note"] = out
                        continue
                    row[f"{name}_maxdiff"] = _max_diff(o_ours, out, torch)
                    pms = bu.time_cuda(prun, warmup=warmup, repeat=repeat)
                    row[f"{name}_tflops"] = flops / (pms * 1e-3) / 1e12
                    row[f"ratio_vs_{name}"] = row["rtk_tflops"] / row[f"{name}_tflops"]
                rows.append(row)
                print(row, flush=True)
                del q, k, v, o_ours
    bu.save(args.out, "bench_attention", {"env": env, "dtype": args.dtype, "compile": ct, "rows": rows})
    for d in head_dims:
        series = {}
        for causal in (False, True):
            sel = [r for r in rows if r["head_dim"] == d and r["causal"] == causal]
            tag = "causal" if causal else "non-causal"
            series[f"rtk {tag}"] = ([r["seqlen"] for r in sel], [r["rtk_tflops"] for r in sel])
            for name in peers:
                pts = [(r["seqlen"], r[f"{name}_tflops"]) for r in sel if r.get(f"{name}_tflops")]
                if pts:
                    series[f"{name} {tag}"] = tuple(map(list, zip(*pts)))
        bu.plot(args.out, f"bench_attention_d{d}", series, "seqlen", "TFLOP/s",
                f"attention fwd {args.dtype} head_dim={d} ({env['gpu']})")

    cols = ["head_dim", "causal", "seqlen", "batch", "config", "rtk_tflops"]
    for name in peers:
        cols += [f"{name}_tflops", f"ratio_vs_{name}"]
    print(f"\n{env['gpu']} ({env['arch']}, {env['sms']} SMs), driver {env['driver']}, NVRTC {env['nvrtc']}, "
          f"{args.dtype}, {env['date']}" + (f", torch {env['torch']}" if torch else " (torch absent: no peers)"))
    print(f"cold compile ({ct['config']}): {ct['cold_compile_s'] * 1e3:.0f} ms; "
          f"warm disk load: {ct['warm_disk_load_s'] * 1e3:.1f} ms")
    print(bu.table(rows, cols))


if __name__ == "__main__":
    main()
