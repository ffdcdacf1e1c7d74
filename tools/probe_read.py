"""How fast a plain read of N bytes runs on this GPU, by access pattern: the ceiling a memory-bound
kernel that only reads (decode's K/V stream, a reduction) can expect at that size, beside the
device copy.  Run on a GPU host from the repository root:

    PYTHONPATH=. python tools/probe_read.py --out $OUT [--sizes-mb 134,537]

One trivial kernel that loads 16 bytes per thread per step (8 steps unrolled) and folds them into
one register, as ``<ctas>x<threads> s<streams>``: the CTAs in ``streams`` groups, each sweeping its
own contiguous part grid-stride (s1: one grid-stride sweep over the whole buffer; a decode split
reads its own range of keys: 16 streams at B1 S32k).

GB/s = bytes read / time (the copy: read + written), timed with benchutil.time_queued (calls
back to back between events, buffers rotated past L2), best of 3.  JSON to $OUT/probe_read.json;
the table (% of the largest copy of the run) is printed last.

Measured (H100, 2026-11-26, docs/data/read_probe*_session14_*): what sets the rate is the bytes in
flight per SM, not the number of streams - at 134 MB, 128 CTAs x 512 threads (64 KB in flight per
SM) read 63-68% of the 1 GB copy rate with 1 to 128 streams, 256 x 512 82-88%, 1056 x 256 93-95%.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402

SOURCE = r'''
extern "C" __global__ void read_streams(const int4* __restrict__ x, long long n4, int streams, float* out) {
    const int per = gridDim.x / streams;               // CTAs per stream
    const int g = blockIdx.x / per, r = blockIdx.x % per;
    const long long len = n4 / streams;
    const int4* base = x + g * len;
    const long long stride = (long long)per * blockDim.x;
    float acc = 0.f;
#pragma unroll 8
    for (long long i = r * (long long)blockDim.x + threadIdx.x; i < len; i += stride) {
        const int4 v = __ldcs(base + i);
        acc += __int_as_float(v.x ^ v.y ^ v.z ^ v.w);
    }
    if (acc == 12345.f) out[blockIdx.x] = acc;   // keeps the loads; never true for these inputs
}
'''
# (CTAs, threads per CTA); streams 1 (a grid-stride sweep) to 128
SHAPES = ((128, 512), (256, 512), (1056, 256))
STREAMS = (1, 8, 16, 32, 64, 128)


def _best(fn, inputs) -> float:
    """Best of 3 median times (ms) of ``fn`` queued back to back over ``inputs``."""
    return min(bu.time_queued(fn, inputs, repeat=10)[0] for _ in range(3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--sizes-mb", default="134,537,1074", help="buffer sizes in MB (1e6 bytes)")
    args = p.parse_args()
    import cupy as cp
    kernel = cp.RawModule(code=SOURCE).get_function("read_streams")
    sink = cp.zeros(1 << 17, cp.float32)
    results: dict = {}
    for mb in (int(x) for x in args.sizes_mb.split(",") if x):
        n = mb * 1000 * 1000 // 4096 * 4096
        sets = [cp.ones(n // 4, cp.float32) for _ in range(max(1, min(4, 4000 // mb)))]
        dsts = [cp.empty_like(s) for s in sets]
        inputs = list(zip(sets, dsts))
        row = {"copy": 2 * n / _best(lambda s, d: d.__setitem__(Ellipsis, s), inputs) / 1e6}
        for ctas, threads in SHAPES:
            for streams in STREAMS:
                if ctas % streams:
                    continue
                ms = _best(lambda s, d, c=ctas, t=threads, k=streams: kernel((c,), (t,), (s, cp.int64(n // 16),
                                                                                         cp.int32(k), sink)), inputs)
                row[f"{ctas}x{threads} s{streams}"] = n / ms / 1e6
        results[mb] = row
        del sets, dsts, inputs
    env = bu.environment()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_read.json"), "w") as f:
        json.dump({"env": env, "gbs": results}, f, indent=1)
    ref = max(r["copy"] for r in results.values())
    print(f"{env.get('gpu', '')}: GB/s read (copy: read + written), % of the run's best copy ({ref:.0f} GB/s)")
    for mb, row in results.items():
        print(f"{mb} MB: " + ", ".join(f"{k} {v:.0f} ({100 * v / ref:.1f}%)" for k, v in row.items()))


if __name__ == "__main__":
    main()
