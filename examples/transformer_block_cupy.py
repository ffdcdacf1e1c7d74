"""A pre-norm transformer block in pure CuPy on rtkernels, timed against the same block in torch.

    python examples/transformer_block_cupy.py [--batch 4 --seqlen 1024 --dim 2048 --heads 16]

    h   = rmsnorm(x, w_norm)
    qkv = h @ w_qkv                       one matmul into a packed (batch, seqlen, 3, heads, head_dim) buffer
    o   = attention(q, k, v, causal)      q, k, v are strided slices of qkv: no copies
    y   = x + o @ w_out                   the residual add fused as an elementwise expression

float16 throughout (CuPy has no bfloat16 dtype; rtk takes bfloat16 as uint16 bits plus
``dtype="bfloat16"``).  The torch side runs F.rms_norm, two matmuls and SDPA on the same weights
(shared through DLPack), and the outputs are compared.
"""
from __future__ import annotations

import argparse
import math

import rtkernels as rtk


def block_rtk(x, w_norm, w_qkv, w_out, heads: int):
    b, s, d = x.shape
    hd = d // heads
    h = rtk.rmsnorm(x, w_norm)
    qkv = rtk.matmul(h.reshape(b * s, d), w_qkv).reshape(b, s, 3, heads, hd)
    o = rtk.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, return_lse=False)
    proj = rtk.matmul(o.reshape(b * s, d), w_out).reshape(b, s, d)
    return _residual(proj, x)


_residual = rtk.elementwise("y = p + x")


def block_torch(x, w_norm, w_qkv, w_out, heads: int):
    import torch
    import torch.nn.functional as F
    b, s, d = x.shape
    hd = d // heads
    h = F.rms_norm(x, (d,), w_norm, 1e-6)
    qkv = (h @ w_qkv).view(b, s, 3, heads, hd).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
    return x + o.transpose(1, 2).reshape(b, s, d) @ w_out


def time_ms(fn) -> float:
    """Median GPU milliseconds of ``fn``: CUDA events on CuPy's current stream, the legacy default
    stream torch also launches on unless told otherwise."""
    import numpy as np
    from cupyx.profiler import benchmark
    return float(np.median(benchmark(fn, n_repeat=20, n_warmup=3).gpu_times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ns = ap.parse_args()
    import cupy as cp
    b, s, d = ns.batch, ns.seqlen, ns.dim
    rng = cp.random.default_rng(0)
    x = rng.standard_normal((b, s, d), dtype=cp.float32).astype(cp.float16)
    w_norm = (1 + 0.1 * rng.standard_normal(d, dtype=cp.float32)).astype(cp.float16)
    w_qkv = (rng.standard_normal((d, 3 * d), dtype=cp.float32) / math.sqrt(d)).astype(cp.float16)
    w_out = (rng.standard_normal((d, d), dtype=cp.float32) / math.sqrt(d)).astype(cp.float16)
    args = (x, w_norm, w_qkv, w_out, ns.heads)
    y = block_rtk(*args)
    # FLOPs: two matmuls (2 * b*s*d*3d and 2 * b*s*d*d) and causal attention (half of 4 * b*s*s*d)
    flops = 2 * b * s * d * 4 * d + 2 * b * s * s * d
    ms = time_ms(lambda: block_rtk(*args))
    print(f"rtk (CuPy) : {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")
    try:
        import torch
    except ImportError:
        print("torch not installed: no comparison")
        return
    targs = [torch.from_dlpack(a) for a in args[:4]] + [ns.heads]
    with torch.no_grad():
        yt = block_torch(*targs)
        tms = time_ms(lambda: block_torch(*targs))
    print(f"torch      : {tms:7.3f} ms  {flops / tms / 1e9:6.1f} TFLOP/s   (rtk {tms / ms:.2f}x)")
    err = (torch.from_dlpack(y).float() - yt.float()).abs().max().item()
    print(f"max |rtk - torch| = {err:.3e}  (float16 outputs of magnitude ~{yt.float().abs().max().item():.1f})")


if __name__ == "__main__":
    main()
