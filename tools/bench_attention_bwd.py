"""Attention backward benchmark: rtk.attention_backward against PyTorch SDPA (flash, cuDNN) backward.

FlashAttention's grid: 16k tokens per batch (batch = 16384 / seqlen), hidden 2048 (nheads =
2048 / head_dim), head dims 64 and 128 (+256), seqlen 1k..16k, causal and not.
Backward FLOPs = 2.5 x forward FLOPs (5 matmuls vs 2): 10 * b * s * s * h * d, halved for causal.
Columns: rtk backward (default = f32 RED for dQ, and deterministic), each peer's backward alone
(autograd graph kept, ``out.backward(do, retain_graph=True)``), and forward+backward
(FLOPs 3.5 x forward) for rtk and peers.  Run on the GPU host:

    PYTHONPATH=. python tools/bench_attention_bwd.py --out results/ [--quick] [--dtype bfloat16]

Each tensor is 16k x 2048 elements (64 MiB in 16 bits) - beyond L2, no rotation.  Gradients of
each peer are compared with ours once (max abs diff in the JSON) before timing.
"""
from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402

TOKENS = 16384
HIDDEN = 2048


def _fwd_flops(b, s, h, d, causal):
    f = 4.0 * b * s * s * h * d
    return f / 2 if causal else f


def _inputs(b, s, h, d, dtype, torch):
    import cupy as cp
    shape = (b, s, h, d)
    if torch is not None:
        return [torch.randn(shape, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4)]
    xs = [cp.random.standard_normal(shape, dtype=cp.float32) for _ in range(4)]
    if dtype == "bfloat16":
        return [((x.view(cp.uint32) + 0x8000) >> 16).astype(cp.uint16) for x in xs]
    return [x.astype(dtype) for x in xs]


def _ours(q, k, v, do, causal, dtype, deterministic, torch):
    """(backward-only launcher, forward+backward launcher, grads, config)."""
    A = importlib.import_module("rtkernels.ops.attention")
    B = importlib.import_module("rtkernels.ops.attention_bwd")
    extra = {} if torch is not None else ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})
    o, lse = A.attention(q, k, v, causal=causal, **extra)
    grads = B.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=deterministic, **extra)
    dq, dk, dv = grads

    def bwd():
        B.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                             **extra)

    def fwd_bwd():
        A.attention(q, k, v, causal=causal, out=o, **extra)
        bwd()
    import cupy as cp
    arch = A._device_arch(cp.cuda.runtime.getDevice())
    cfg = B.choose_config(dtype, q.shape[-1], causal, deterministic, arch)
    return bwd, fwd_bwd, grads, cfg


def _sdpa(q, k, v, do, causal, backend, torch):
    from torch.nn.attention import sdpa_kernel
    F = torch.nn.functional
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2)
    try:
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        out.backward(dot, retain_graph=True)
    except RuntimeError as exc:
        return None, None, str(exc).splitlines()[0][:80]

    def bwd():
        for t in (qt, kt, vt):
            t.grad = None
        out.backward(dot, retain_graph=True)

    def fwd_bwd():
        for t in (qt, kt, vt):
            t.grad = None
        with sdpa_kernel(backend):
            o2 = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        o2.backward(dot)
    grads = tuple(t.grad.transpose(1, 2) for t in (qt, kt, vt))
    return (bwd, fwd_bwd), grads, None


def _max_diff(ours, theirs, torch):
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(ours, theirs))


def main():
    p = bu.parser(__doc__)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    args = p.parse_args()
    env = bu.environment()
    torch, peers = bu.attention_peers(env)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    if args.quick:
        head_dims, seqlens = [d for d in head_dims if d in (64, 128)] or head_dims[:2], [2048, 4096]
    warmup, repeat = (2, 5) if args.quick else (3, 10)
    import cupy as cp
    cp.cuda.Device().synchronize()

    rows = []
    for d in head_dims:
        h = HIDDEN // d
        for causal in (False, True):
            for s in seqlens:
                b = max(1, TOKENS // s)
                q, k, v, do = _inputs(b, s, h, d, args.dtype, torch)
                fl = _fwd_flops(b, s, h, d, causal)
                row = {"head_dim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h}
                bwd, fwd_bwd, grads, cfg = _ours(q, k, v, do, causal, args.dtype, False, torch)
                row["config"] = f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps}"
                row["rtk_tflops"] = 2.5 * fl / (bu.time_cuda(bwd, warmup=warmup, repeat=repeat) * 1e-3) / 1e12
                row["rtk_fwdbwd_tflops"] = 3.5 * fl / (bu.time_cuda(fwd_bwd, warmup=warmup, repeat=repeat) * 1e-3) / 1e12
                dbwd, _, _, _ = _ours(q, k, v, do, causal, args.dtype, True, torch)
                row["rtk_det_tflops"] = 2.5 * fl / (bu.time_cuda(dbwd, warmup=warmup, repeat=repeat) * 1e-3) / 1e12
                row["det_ratio"] = row["rtk_det_tflops"] / row["rtk_tflops"]
                for name, backend in peers.items():
                    fns, pgrads, note = _sdpa(q, k, v, do, causal, backend, torch)
                    if fns is None:
                        row[f"{name}_tflops"] = None
                        row[f"{name}_note"] = note
                        continue
                    row[f"{name}_maxdiff"] = _max_diff(grads, pgrads, torch)
                    row[f"{name}_tflops"] = 2.5 * fl / (bu.time_cuda(fns[0], warmup=warmup, repeat=repeat) * 1e-3) / 1e12
                    row[f"{name}_fwdbwd_tflops"] = 3.5 * fl / (
                        bu.time_cuda(fns[1], warmup=warmup, repeat=repeat) * 1e-3) / 1e12
                    row[f"ratio_vs_{name}"] = row["rtk_tflops"] / row[f"{name}_tflops"]
                    del fns, pgrads
                rows.append(row)
                print(row, flush=True)
                del q, k, v, do, grads, bwd, fwd_bwd, dbwd
                if torch is not None:
                    torch.cuda.empty_cache()
                cp.get_default_memory_pool().free_all_blocks()

    bu.save(args.out, "bench_attention_bwd", {"env": env, "dtype": args.dtype, "rows": rows})
    for d in head_dims:
        series = {}
        for causal in (False, True):
            sel = [r for r in rows if r["head_dim"] == d and r["causal"] == causal]
            tag = "causal" if causal else "non-causal"
            series[f"rtk {tag}"] = ([r["seqlen"] for r in sel], [r["rtk_tflops"] for r in sel])
            series[f"rtk det {tag}"] = ([r["seqlen"] for r in sel], [r["rtk_det_tflops"] for r in sel])
            for name in peers:
                pts = [(r["seqlen"], r[f"{name}_tflops"]) for r in sel if r.get(f"{name}_tflops")]
                if pts:
                    series[f"{name} {tag}"] = tuple(map(list, zip(*pts)))
        bu.plot(args.out, f"bench_attention_bwd_d{d}", series, "seqlen", "TFLOP/s (backward)",
                f"attention backward {args.dtype} head_dim={d} ({env['gpu']})")
    cols = ["head_dim", "causal", "seqlen", "config", "rtk_tflops", "rtk_det_tflops", "det_ratio"]
    for name in peers:
        cols += [f"{name}_tflops", f"ratio_vs_{name}"]
    cols += ["rtk_fwdbwd_tflops"] + [f"{n}_fwdbwd_tflops" for n in peers]
    print(f"\n{env['gpu']} ({env['arch']}, {env['sms']} SMs), driver {env['driver']}, NVRTC {env['nvrtc']}, "
          f"{args.dtype}, {env['date']}" + (f", torch {env['torch']}" if torch else " (torch absent: no peers)"))
    print("backward TFLOP/s = 2.5 x forward FLOPs / time; fwd+bwd = 3.5 x forward FLOPs / time")
    print(bu.table(rows, cols))


if __name__ == "__main__":
    main()
