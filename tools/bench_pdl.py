"""Programmatic dependent launch, on and off, in the same rounds: decode, matmul and the row ops'
backward queued back to back (benchutil.time_queued, two events around each queue), rounds
alternating PDL off / on so both meet the same GPU state; the same-run peer (SDPA cuDNN, cuBLAS
through torch) beside them where torch is importable.

    PYTHONPATH=. python3 tools/bench_pdl.py --out results/ [--rounds 3] [--quick]

Columns: us per call with PDL off / on (median of the rounds), on/off, the peer's us, and peer /
rtk (> 1: rtk faster) for both settings; decode and row ops also as % of the same run's copy.
The decode peer reads the same K/V bytes with SDPA's (B, H, S, D) views and no mask (rtk's call is
causal, bottom-right: the same keys for one query row, a triangle's worth fewer for seqlen_q 16).
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np

import benchutil


def _sdpa(torch, gqa):
    """SDPA cuDNN on rtk's (B, S, H, D) arrays (transposed views), the decode peer; None without torch."""
    if torch is None:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def peer(q, k, v, lens, out):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=False, enable_gqa=gqa)
    return peer


def main():
    p = benchutil.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=50)
    args = p.parse_args()
    import cupy as cp
    import rtkernels as rtk
    from rtkernels import pdl
    try:
        import torch
    except ImportError:   # peers optional
        torch = None
    env = benchutil.environment()
    copy_gbs = benchutil.copy_bandwidth()
    rng = np.random.default_rng(0)
    l2 = 64 << 20

    def bf16(shape, scale=1.0):   # torch bfloat16 tensors; without torch, CuPy float16 arrays
        if torch is not None:
            return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(torch.bfloat16)
        return cp.asarray((rng.standard_normal(shape) * scale).astype(np.float16))

    def sets(make, per_bytes):
        return [make() for _ in range(max(1, min(6, -(-2 * l2 // per_bytes))))]

    cases = []   # (group, label, rtk fn, peer fn or None, inputs, bytes for % of copy or 0)

    # decode: (B, Sk, H, Hkv, D, Sq)
    dec = [(1, 32768, 32, 8, 128, 1), (8, 8192, 32, 8, 128, 1), (64, 2048, 32, 8, 128, 1),
           (128, 1024, 64, 8, 128, 1), (16, 4096, 16, 16, 64, 1), (8, 8192, 32, 8, 128, 16)]
    if args.quick:
        dec = dec[:2]
    for b, sk, h, hkv, d, sq in dec:
        kv_bytes = 2 * b * sk * hkv * d * 2

        def make(b=b, sk=sk, h=h, hkv=hkv, d=d, sq=sq):
            q = bf16((b, sq, h, d))
            k, v = bf16((b, sk, hkv, d)), bf16((b, sk, hkv, d))
            lens = (torch.full((b,), sk, device="cuda", dtype=torch.int32) if torch is not None
                    else cp.full(b, sk, cp.int32))
            out = torch.empty_like(q) if torch is not None else cp.empty_like(q)
            return q, k, v, lens, out
        inputs = sets(make, kv_bytes)

        def run(q, k, v, lens, out):
            rtk.attention_kvcache(q, k, v, lens, out=out)
        cases.append(("decode", f"B{b} S{sk} {h}/{hkv} d{d} Sq{sq}", run, _sdpa(torch, h != hkv), inputs, kv_bytes))

    # matmul x @ W.T, bf16
    mms = [(128, 4096, 4096), (128, 6144, 4096), (128, 4096, 128), (3000, 5000, 2000), (4096, 4096, 4096)]
    if args.quick:
        mms = mms[:2]
    for m, n, k in mms:
        def make(m=m, n=n, k=k):
            return bf16((m, k)), bf16((n, k)), (torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                                                 if torch is not None else cp.empty((m, n), cp.float16))
        inputs = sets(make, 2 * (m * k + n * k + m * n))

        def run(a, w, out):
            rtk.matmul(a, w, trans_b=True, out=out)
        peer = (lambda a, w, out: torch.matmul(a, w.t(), out=out)) if torch is not None else None
        cases.append(("matmul", f"{m}x{n}x{k}", run, peer, inputs, 0))

    # row ops' backward at 192 MiB of traffic (3 x 64 MiB: read dy, x, write dx)
    for width in ((4096,) if args.quick else (1024, 4096, 16384)):
        rows = (64 << 20) // (2 * width)

        def make(rows=rows, width=width):
            dy, x, w = bf16((rows, width)), bf16((rows, width)), bf16((width,))
            xx = x.float() if torch is not None else None
            rstd = (torch.rsqrt(xx.pow(2).mean(-1) + 1e-6) if torch is not None
                    else cp.ones(rows, cp.float32))
            return dy, x, w, rstd
        inputs = sets(make, 3 * rows * width * 2)

        def run(dy, x, w, rstd):
            rtk.rmsnorm_backward(dy, x, w, rstd)
        cases.append(("rmsnorm_bwd", f"{rows}x{width}", run, None, inputs, 3 * rows * width * 2))
        if width == 4096:   # the cooperative fold of the column sums
            def run_ln(dy, x, w, rstd):
                rtk.layernorm_backward(dy, x, w, w)
            cases.append(("layernorm_bwd", f"{rows}x{width}", run_ln, None, inputs, 3 * rows * width * 2))

    rows_out = []
    for group, label, run, peer, inputs, nbytes in cases:
        run(*inputs[0])
        cp.cuda.Device().synchronize()
        off, on, peer_us = [], [], []
        for _ in range(args.rounds):
            for setting, sink in ((False, off), (True, on)):
                pdl.set_enabled(setting)
                sink.append(benchutil.time_queued(run, inputs, repeat=args.repeat)[0] * 1e3)
            if peer is not None:
                peer_us.append(benchutil.time_queued(peer, inputs, repeat=args.repeat)[0] * 1e3)
        pdl.set_enabled(True)
        row = {"group": group, "case": label, "off_us": statistics.median(off), "on_us": statistics.median(on),
               "off_all": off, "on_all": on}
        row["on/off"] = row["on_us"] / row["off_us"]
        if peer_us:
            row["peer_us"] = statistics.median(peer_us)
            row["peer/off"] = row["peer_us"] / row["off_us"]
            row["peer/on"] = row["peer_us"] / row["on_us"]
        if nbytes:
            row["%copy_off"] = 100 * nbytes / (row["off_us"] * 1e-6) / 1e9 / copy_gbs
            row["%copy_on"] = 100 * nbytes / (row["on_us"] * 1e-6) / 1e9 / copy_gbs
        rows_out.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
               if not k.endswith("_all")}, flush=True)
    cols = ["group", "case", "off_us", "on_us", "on/off", "peer_us", "peer/off", "peer/on", "%copy_off", "%copy_on"]
    print(f"copy {copy_gbs:.0f} GB/s, {env.get('gpu', '')}")
    print(benchutil.table(rows_out, cols))
    benchutil.save(args.out, "pdl_ab", {"environment": env, "copy_gbs": copy_gbs, "rows": rows_out})


if __name__ == "__main__":
    main()
