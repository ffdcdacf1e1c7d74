"""Programmatic dependent launch, on and off, in the same rounds: decode, matmul and the row ops'
backward queued back to back (benchutil.time_queued, two events around each queue), rounds
alternating PDL off / on so both meet the same GPU state; the same-run peer (SDPA cuDNN, cuBLAS
through torch) beside them where torch is importable.

    PYTHONPATH=. python3 tools/bench_pdl.py --out results/ [--rounds 3] [--quick]

Columns: us per call with PDL off / on (median of the rounds), on/off, the peer's us, and peer /
rtk (> 1: rtk faster) for both settings; decode and row ops also as % of the same run's copy.
The decode inputs, rtk call and peer are tools/bench_decode.py's: SDPA cuDNN on (B, H, S, D) views of
rtk's own arrays without a mask (rtk's call is causal, bottom-right: the same keys for one query row,
a triangle's worth fewer for seqlen_q 16).
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np

import benchutil


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

    # decode, (B, Sk, H, Hkv, D, Sq): bench_decode's inputs, rtk call and SDPA cuDNN peer (on views
    # of rtk's own arrays, no mask)
    import bench_decode as bd
    from rtkernels.ops import attention_kvcache as kv
    dec = [(1, 32768, 32, 8, 128, 1), (8, 8192, 32, 8, 128, 1), (64, 2048, 32, 8, 128, 1),
           (128, 1024, 64, 8, 128, 1), (16, 4096, 16, 16, 64, 1), (8, 8192, 32, 8, 128, 16)]
    if args.quick:
        dec = dec[:2]
    peer = None
    if torch is not None:
        from torch.nn.attention import SDPBackend
        peer = bd._sdpa_fn(torch, SDPBackend.CUDNN_ATTENTION, nhd=True)
    for shape in dec:
        b, sk, h, hkv, d, sq = shape
        kv_bytes = bd._kv_bytes(b, sk, hkv, d)
        inputs = sets(lambda shape=shape: (bd.Set(shape, "bfloat16", torch, torch is not None, ()),), kv_bytes)
        cases.append(("decode", f"B{b} S{sk} {h}/{hkv} d{d} Sq{sq}", bd._rtk_fn(rtk, kv, "contig", "bfloat16", torch),
                      peer, inputs, kv_bytes))

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
            row["%copy_off"] = bd.copy_percent(nbytes, row["off_us"] * 1e-3, copy_gbs)
            row["%copy_on"] = bd.copy_percent(nbytes, row["on_us"] * 1e-3, copy_gbs)
        rows_out.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
               if not k.endswith("_all")}, flush=True)
    cols = ["group", "case", "off_us", "on_us", "on/off", "peer_us", "peer/off", "peer/on", "%copy_off", "%copy_on"]
    print(f"copy {copy_gbs:.0f} GB/s, {env.get('gpu', '')}")
    print(benchutil.table(rows_out, cols))
    benchutil.save(args.out, "pdl_ab", {"environment": env, "copy_gbs": copy_gbs, "rows": rows_out})


if __name__ == "__main__":
    main()
