"""Where a split decode call's time goes: the whole call against its split kernel alone (the plan
without its combine launch) and against a device copy of the same bytes.

    PYTHONPATH=. python3 tools/decode_split_probe.py [--splits 4,16] [--out DIR]
    PYTHONPATH=. python3 tools/decode_split_probe.py --shapes 1:32768:32:8:128:1 --variants "units=merge:units"

Per shape (batch, seqlen_k, nheads, nheads_kv, head_dim, seqlen_q; contiguous bf16 cache): us and
% of the copy rate (1 GiB of traffic) for the default plan ("full"), its split kernel alone
("split", where the plan has a combine launch; "nomerge", where its split kernel merges: the
same grid storing partials only), each forced split count, the whole call under each
tools/bench_decode.py variant ("full@name"), and a copy of the K/V bytes ("copy_same": the ramp a
call of this size pays anyway).  The session-19 figures that motivated the group merge
(docs/data/decode_split_only_probe_session19_*): seqlen_q 16 B1 S32k 61.0 us whole, 55.3 us split
kernel alone, 48.6 us copy (H100); session 20's (decode_split_probe_nomerge_session20_*): seqlen_q 1
B1 S32k 54.9 us whole, 51.0 without its merge.  Timing as tools/bench_decode.py (queued calls,
interleaved rounds, rotating inputs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchutil as bu  # noqa: E402
import bench_decode as bd  # noqa: E402

SHAPES = [(1, 32768, 32, 8, 128, 16), (4, 8192, 32, 8, 128, 16), (2, 16384, 32, 8, 128, 16),
          (16, 4096, 32, 8, 128, 16), (8, 8192, 32, 8, 128, 16), (1, 32768, 32, 8, 128, 1),
          (4, 8192, 32, 8, 128, 8), (1, 32768, 32, 8, 128, 8)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", default="", help="forced split counts to time too, e.g. 4,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="folder for probe.json")
    ap.add_argument("--variants", default="", help="whole calls under bench_decode variants too, "
                                                   "e.g. 'units=merge:units' (the candidate full@units)")
    ap.add_argument("--shapes", default="", help="b:sk:h:hkv:d:sq,... instead of SHAPES")
    args = ap.parse_args()
    variants = bd.parse_variants(args.variants)
    shapes = bd.parse_shapes(args.shapes) or SHAPES
    import cupy as cp
    import rtkernels as rtk
    from rtkernels.ops import attention_kvcache as kv
    splits = [int(x) for x in args.splits.split(",") if x]
    copy_gbs = bu.copy_bandwidth(512 << 20)   # 1 GiB of traffic
    print(f"copy (1 GiB of traffic): {copy_gbs:.0f} GB/s")
    rows = []
    for shape in shapes:
        b, sk, h, hkv, d, sq = shape
        nbytes = bd._kv_bytes(b, sk, hkv, d)
        sets = [bd.Set(shape, "bfloat16", None, False, []) for _ in range(2)]
        halves = (cp.empty(nbytes // 2, cp.uint8), cp.empty(nbytes // 2, cp.uint8))
        cands = {}
        for n in [None] + splits:
            kw = {} if n is None else {"num_splits": n}
            tag = "" if n is None else str(n)
            plan = bd._plan_of(kv, sets[0], "contig", "bfloat16", None, kw)
            cands[f"full{tag}"] = (bd._rtk_fn(rtk, kv, "contig", "bfloat16", None, **kw), bd._short(plan, kv))
            if plan.combine is not None:   # its split kernel alone
                bare, name, note = dataclasses.replace(plan, combine=None), f"split{tag}", " (no combine)"
            elif plan.fused and plan.split is not None:
                # the same grid storing its partials without merging them (DecodeArgs.fused 0): what
                # the in-kernel merge (the last CTA's, or the group's) costs
                a = plan.split.tail[0].copy()
                a["fused"] = 0
                bare = dataclasses.replace(plan, fused=False, counter_bytes=0,
                                           split=dataclasses.replace(plan.split, tail=(a,), cooperative=False))
                name, note = f"nomerge{tag}", " (no merge)"
            else:
                continue

            def plan_only(s, bare=bare):
                kv._execute(bare, s.q, s.k, s.v, s.lens, None, None, None, s.out, None)
            cands[name] = (plan_only, bd._short(plan, kv) + note)
        for vname, v in variants.items():   # (each call sets its variant, the others none)
            vplan = bd._plan_of(kv, sets[0], "contig", "bfloat16", None, {}, v)
            cands[f"full@{vname}"] = (bd._rtk_fn(rtk, kv, "contig", "bfloat16", None, v), bd._short(vplan, kv))
        cands["copy_same"] = (lambda s, h=halves: h[1].data.copy_from_device(h[0].data, h[0].nbytes), "")
        timed = bd.time_rounds({k: fn for k, (fn, _) in cands.items()}, sets, args.rounds)
        row = {"shape": shape, "MB": nbytes / 1e6}
        for k, (ms, _) in timed.items():
            row[k] = (round(ms * 1e3, 2), round(bd.copy_percent(nbytes, ms, copy_gbs), 1), cands[k][1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        bu.save(args.out, "probe", {"copy_gbs": copy_gbs, "rows": rows})


if __name__ == "__main__":
    main()
