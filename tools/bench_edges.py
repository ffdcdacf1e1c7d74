"""Rows that end inside a 16-byte word: the cost of reading only their bytes (issue 22).

The sanitizer gate's first run (H100, 2026-11-25) found two kernels reading whole 16-byte words
past the end of a row that ends its allocation: the staging copy pad_rows (aligned words around
each row) and the mma.sync matmul (a cp.async with a partial source size, which memcheck counts
as a read of its whole chunk).  Both now load such edge chunks element by element.  This times,
interleaved in one run on the same inputs:

* pad_rows: the kernel ("edges", the product) against its measurement build without the edge
  path ("whole words", -DRTK_PAD_ROWS_NO_EDGE=1: the kernel before the fix) and
  cudaMemcpy2DAsync where the copy has one batch.  TB/s = (bytes read + bytes written) / time.
* matmul (mma.sync kernel, float16): the config the op now picks (edge_a / edge_b set) against
  the same config without them (the kernel before the fix: partial cp.async) and cuBLAS
  (cupy.matmul on the same views).  Results of both are checked against cuBLAS in float32.

    PYTHONPATH=. python tools/bench_edges.py [--out DIR] [--quick]

Timing: every call queued behind a spin kernel (benchutil.time_queued), candidates interleaved
over --passes passes, the median of each candidate's pass medians reported.
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import benchutil  # noqa: E402

# (label, batches, rows, cols, row stride ld): 8191^2 and 4095^2 are the copy's recorded 70 / 26 us (H200,
# 2026-11-22); short unaligned rows put an edge chunk in every few.
PAD_SHAPES = [
    ("8191x8191 ld 8191", 1, 8191, 8191, 8191),
    ("4095x4095 ld 4095", 1, 4095, 4095, 4095),
    ("3x1024x1000 ld 1001", 3, 1024, 1000, 1001),
    ("65536x72 ld 73", 1, 65536, 72, 73),
    ("131072x37 ld 37", 1, 131072, 37, 37),
]
# (label, M, N, K, A row stride, B row stride): views of padded parents, and one row.
MM_SHAPES = [
    ("4096x4096x4095, A rows of 4096 (K tail)", 4096, 4096, 4095, 4096, 4096),
    ("4096x4095x4096, B rows of 4096 (N edge)", 4096, 4095, 4096, 4096, 4096),
    ("1x4096x4095, one row of A", 1, 4096, 4095, 4095, 4096),
    ("1000x1000x999, A rows of 1000", 1000, 1000, 999, 1000, 1000),
]


def _median_of_passes(cands: dict, passes: int, repeat: int) -> dict:
    samples = {name: [] for name in cands}
    for _ in range(passes):
        for name, (fn, inputs) in cands.items():
            samples[name].append(benchutil.time_queued(fn, inputs, repeat=repeat)[0])
    return {name: statistics.median(v) for name, v in samples.items()}


def bench_pad_rows(args, rows_out: list) -> None:
    import cupy as cp
    import rtkernels as rtk
    from rtkernels.compiler import CompileOptions
    from rtkernels.ops import matmul as mm
    cfg = mm.PadRowsConfig()
    kern = {"edges": rtk.get_kernel(cfg),
            "whole words": rtk.get_kernel(cfg, options=CompileOptions(defines=(("RTK_PAD_ROWS_NO_EDGE", "1"),)))}
    shapes = PAD_SHAPES[:3] if args.quick else PAD_SHAPES
    for label, nb, rows, cols, ld in shapes:
        bs = rows * ld + 5 if nb > 1 else 0
        n = 1 + (nb - 1) * bs + (rows - 1) * ld + cols
        flat = cp.asarray(np.random.default_rng(cols).integers(0, 2 ** 16, n, dtype=np.uint16))
        src = cp.lib.stride_tricks.as_strided(flat[1:], (nb, rows, cols), (2 * bs, 2 * ld, 2))   # odd base
        ldp = -(-cols // 64) * 64
        per_row = -(-cols // (8 * cfg.block_size * cfg.chunks_per_thread))
        bufs = {name: cp.empty((nb, rows, ldp), cp.uint16) for name in kern}
        cands = {}
        for name, k in kern.items():
            def run(k=k, buf=bufs[name]):
                k.launch((nb * rows * per_row,), (cfg.block_size,), src, buf, rows, cols, ld, bs, ldp // 8, per_row)
            cands[name] = (run, [()])
        if nb == 1:
            peer = cp.empty((rows, ldp), cp.uint16)

            def memcpy2d():
                cp.cuda.runtime.memcpy2DAsync(peer.data.ptr, 2 * ldp, src.data.ptr, 2 * ld, 2 * cols, rows,
                                              cp.cuda.runtime.memcpyDeviceToDevice,
                                              cp.cuda.get_current_stream().ptr)
            cands["cudaMemcpy2DAsync"] = (memcpy2d, [()])
        ms = _median_of_passes(cands, args.passes, args.repeat)
        want = src.get()
        ok = {name: bool((bufs[name][:, :, :cols].get() == want).all()) for name in kern}
        nbytes = 2 * 2 * nb * rows * cols
        for name, t in ms.items():
            rows_out.append({"kernel": "pad_rows", "shape": label, "candidate": name, "us": round(t * 1e3, 1),
                             "TB/s": round(nbytes / (t * 1e-3) / 1e12, 2), "exact": ok.get(name, "")})


def bench_matmul(args, rows_out: list) -> None:
    import dataclasses
    import cupy as cp
    import rtkernels as rtk
    from rtkernels import device
    from rtkernels.ops import matmul as mm
    sms = device.sm_count()
    shapes = MM_SHAPES[:2] + MM_SHAPES[3:] if args.quick else MM_SHAPES
    rng = np.random.default_rng(0)
    for label, m, n, k, lda_, ldb_ in shapes:
        pa = cp.asarray(rng.standard_normal((m, lda_)).astype(np.float16))
        pb = cp.asarray(rng.standard_normal((k, ldb_)).astype(np.float16))
        a, b = pa[:, :k], pb[:, :n]
        # the op's layout analysis (rtkernels/ops/matmul.py: _layout, _vec, the edge rule)
        sa = [s // 2 for s in a.strides]
        sb = [s // 2 for s in b.strides]
        a_kmajor, lda = mm._layout("a", "M", (m, k), sa)
        b_kmajor, ldb = mm._layout("b", "N", (n, k), (sb[1], sb[0]))
        vec_a, vec_b = mm._vec(a.data.ptr, lda, 0), mm._vec(b.data.ptr, ldb, 0)
        edges = {e: bool(extent % vec) for e, vec, extent in (("edge_a", vec_a, k if a_kmajor else m),
                                                              ("edge_b", vec_b, k if b_kmajor else n))}
        cfg = mm.heuristic_config("float16", m, n, k, 1, sm_count=sms, a_kmajor=a_kmajor, b_kmajor=b_kmajor,
                                  vec_a=vec_a, vec_b=vec_b, **edges)
        configs = {"edges": cfg, "partial cp.async": dataclasses.replace(cfg, edge_a=False, edge_b=False)}
        outs = {name: cp.empty((m, n), cp.float16) for name in configs}
        cands = {}
        for name, c in configs.items():
            kern = rtk.get_kernel(c)
            tiles = -(-m // c.block_m) * -(-n // c.block_n)

            def run(kern=kern, c=c, tiles=tiles, out=outs[name]):
                kern.launch((tiles, 1, 1), (c.threads_per_block, 1, 1), a, b, None, out, m, n, k, lda, ldb, n,
                            0, 0, 0, 8 if n % 8 == 0 else 1, shared_mem=c.shared_mem_bytes)
            cands[name] = (run, [()])
        cands["cuBLAS"] = (lambda: cp.matmul(a, b), [()])
        ms = _median_of_passes(cands, args.passes, args.repeat)
        ref = cp.matmul(a.astype(cp.float32), b.astype(cp.float32))
        scale = float(cp.abs(ref).max())
        err = {name: float(cp.abs(outs[name].astype(cp.float32) - ref).max()) / scale for name in configs}
        err["cuBLAS"] = float(cp.abs(cp.matmul(a, b).astype(cp.float32) - ref).max()) / scale
        tag = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/{cfg.num_stages} vec {vec_a}/{vec_b}" + \
            "".join(f" {e}" for e, on in edges.items() if on)
        for name, t in ms.items():
            rows_out.append({"kernel": "matmul mma.sync f16", "shape": f"{label} [{tag}]", "candidate": name,
                             "us": round(t * 1e3, 1), "TFLOP/s": round(2 * m * n * k / (t * 1e-3) / 1e12, 1),
                             "max rel err": f"{err[name]:.2e}"})


def main() -> None:
    p = benchutil.parser(__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=3, help="interleaved passes over the candidates")
    p.add_argument("--repeat", type=int, default=20, help="timed calls per candidate and pass")
    args = p.parse_args()
    rows: list = []
    bench_pad_rows(args, rows)
    bench_matmul(args, rows)
    benchutil.save(args.out, "bench_edges", {"environment": benchutil.environment(), "rows": rows})
    print(benchutil.table([r for r in rows if r["kernel"] == "pad_rows"],
                          ["shape", "candidate", "us", "TB/s", "exact"]))
    print()
    print(benchutil.table([r for r in rows if r["kernel"] != "pad_rows"],
                          ["shape", "candidate", "us", "TFLOP/s", "max rel err"]))


if __name__ == "__main__":
    main()
