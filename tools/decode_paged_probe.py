"""Paged against contiguous decode at forced split counts, through a shuffled block table and an
identity one (pages in order: the contiguous cache's bytes in its order, read through the same
per-tile page lookups), to tell the lookups' cost from the pages' scatter.

    PYTHONPATH=. python3 tools/decode_paged_probe.py [--out DIR]

Per shape: % of the copy rate (1 GiB of traffic) of contig / p16 / p16id / p64 / p64id at each
split count (``--shapes``: other shapes at the plan's own count).  Session 21 (H100, 2026-11-27,
docs/data/decode_paged_identity_table_session21_*):
B8 S8k 32/8 d128 at one split, paged16 80.7 / identity 80.4 / contiguous 101.9 - the lookups,
not the scatter; with the keys mode's page ids read a batch ahead (decode_page_batch_ab_*) 92.2.
Timing as tools/bench_decode.py (queued calls, interleaved rounds, two rotating input sets).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchutil as bu  # noqa: E402
import bench_decode as bd  # noqa: E402

# (batch, seqlen_k, nheads, nheads_kv, head_dim, seqlen_q), forced split counts
SHAPES = [((8, 8192, 32, 8, 128, 1), (1, 2, 4)), ((1, 32768, 32, 8, 128, 1), (8, 16)),
          ((16, 4096, 16, 16, 64, 1), (1, 2))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for paged_probe.json")
    ap.add_argument("--shapes", default=None, help="b:sk:h:hkv:d:sq,... at the plan's own split count instead")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [(tuple(int(x) for x in t.split(":")), (None,))
                                             for t in args.shapes.split(",")]
    import cupy as cp
    import rtkernels as rtk
    copy = bu.copy_bandwidth(512 << 20)
    print(f"copy (1 GiB of traffic): {copy:.0f} GB/s")
    rows = []
    for shape, splits in shapes:
        b, sk, h, hkv, d, sq = shape
        nbytes = bd._kv_bytes(b, sk, hkv, d)
        sets = [bd.Set(shape, "bfloat16", None, False, [16, 64]) for _ in range(2)]
        for s in sets:   # identity tables beside the shuffled ones
            for ps in (16, 64):
                k, v, t = s.paged[ps]
                s.paged[-ps] = (k, v, cp.arange(t.size, dtype=cp.int32).reshape(t.shape))
        cands = {}
        for ns in splits:
            for name, key in (("contig", None), ("p16", 16), ("p16id", -16), ("p64", 64), ("p64id", -64)):
                def fn(s, key=key, ns=ns):
                    kc, vc, table = (s.k, s.v, None) if key is None else s.paged[key]
                    rtk.attention_kvcache(s.q, kc, vc, s.lens, block_table=table, out=s.out, num_splits=ns,
                                          dtype="bfloat16")
                cands[f"{name}_x{ns or 'plan'}"] = fn
        row = {"shape": shape}
        for k, (ms, _) in bd.time_rounds(cands, sets, args.rounds).items():
            row[k] = (round(ms * 1e3, 2), round(bd.copy_percent(nbytes, ms, copy), 1))
        rows.append(row)
        print(shape, {k: v[1] for k, v in row.items() if k != "shape"}, flush=True)
    if args.out:
        bu.save(args.out, "paged_probe", {"copy_gbs": copy, "rows": rows})


if __name__ == "__main__":
    main()
