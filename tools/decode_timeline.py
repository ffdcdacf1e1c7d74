"""Per-CTA timeline of a split decode call: when each CTA starts, ends its main loop, has stored its
partial (global workspace, or its shared memory for the cluster merge) and exits, from %globaltimer
stamps (the keys mode also: each warp's loop end, when the last CTA of a group learns it is last, and its
merge's end).

    PYTHONPATH=. python3 tools/decode_timeline.py 4:8192:32:8:128:16 [--variants "off=cluster:off"] [--out DIR]

Shapes are b:sk:h:hkv:d:sq[:paged16] (contiguous bf16 cache, full lengths).  The stamps go into a
patched copy of templates/ in a temporary folder (rtkernels.render.template_dir points there, and
the kernels compile into a temporary cache): the tree and the user's cache are not touched.  The
patch anchors on lines of templates/attention_decode.cu.j2 and fails with the anchor's text if one
moves.  It is how the twenty-third session split the rows mode's fixed cost on the H200 (a B4 S8k
seqlen_q 16 call: main loops 32.4-35.6 us, partial stores ~1.6 us, the group merge ~3-4 us; see
docs/RESULTS.md).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# per CTA: start, loop end, stored, merged / exit, smid, split; keys mode also: 6-9 each warp's loop
# end, 10 the last CTA's merge end (0 in the other CTAs); both: 11 the kernel's first instruction, 12
# its sequence length read
STAMPS = 16

# (anchor, text inserted before it, text inserted after it)
PATCHES = [
    ('#include "rtk/sm90.cuh"', "",
     "\n__device__ unsigned long long rtk_stamps[65536 * STAMPS];\n"
     "__device__ __forceinline__ unsigned long long rtk_now() {\n"
     "    unsigned long long t; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)); return t; }\n"),
    ("    T* smem = reinterpret_cast<T*>(smem_raw);\n\n    const int tid = threadIdx.x;\n", "",
     "    const unsigned long long rtk_t0 = rtk_now();\n    unsigned long long rtk_t1 = 0, rtk_t2 = 0;\n"
     "    auto rtk_record = [&](int split_) {\n"
     "        if (threadIdx.x != 32) return;\n"
     "        unsigned smid; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     "        unsigned long long* s = rtk_stamps + STAMPSull * blockIdx.x;\n"
     "        s[0] = rtk_t0; s[1] = rtk_t1; s[2] = rtk_t2; s[3] = rtk_now(); s[4] = smid; s[5] = split_;\n"
     "    };\n"),
    ("        rtk::cp_async_wait<0>();\n        const bool bad = __syncthreads_or(bad_page) || seq.bad;\n",
     "        rtk_t1 = rtk_now();\n", ""),
    ("        // ---- the cluster merge (every split of the group merges a share; see cluster_merge) ----\n",
     "        rtk_t2 = rtk_now();\n", ""),
    ("                cluster_merge(p, a, smem_raw, split, b, hkv0, r0, rows_valid, tid);\n",
     "", "                rtk_record(split);\n"),
    ("        rtk::group_barrier_done(counters, a.num_splits, ticket);\n", "", "        rtk_record(split);\n"),
    # the kernel's first instruction (11) and its sequence length read (12), both modes
    ("    const Sequence seq = sequence(p.cache_seqlens, a, b);\n    const int seqlen_k = seq.seqlen_k;\n"
     "    const int diag = seqlen_k - a.seqlen_q;\n", "",
     "    if (threadIdx.x == 0) { rtk_stamps[STAMPSull * blockIdx.x + 11] = rtk_t0;\n"
     "        rtk_stamps[STAMPSull * blockIdx.x + 12] = seqlen_k > -1 ? rtk_now() : 0; }\n"),
    # keys mode (keys_cta: one call per CTA of a split grid)
    ("                                         float* sk_lse, const KVMaps& maps) {\n", "",
     "    unsigned long long* rtk_s = rtk_stamps + STAMPSull * blockIdx.x;\n"
     "    if (threadIdx.x == 0) { unsigned smid; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     "        rtk_s[0] = rtk_now(); rtk_s[4] = smid; rtk_s[5] = split; rtk_s[10] = 0; }\n"),
    ("    // ---- merge the warps: O = sum_w O_w 2^((m_w - m) scale), l likewise; then store ----\n",
     "    if (lane == 0) rtk_s[6 + (warp & 3)] = rtk_now();\n", ""),
    ("    float* red = reinterpret_cast<float*>(smem_raw);          // [NUM_WARPS][ROWS][RED_STRIDE]\n",
     "    if (threadIdx.x == 0) rtk_s[1] = rtk_now();\n", ""),
    ("            lse_out[lrow] = bad ? quiet_nan() : (l > 0.f ? fin_m[r] * a.softmax_scale + logf(l) : neg_inf());\n"
     "        }\n    }\n", "", "    __syncthreads();\n    if (threadIdx.x == 0) { rtk_s[2] = rtk_now(); rtk_s[3] = rtk_s[2]; }\n"),
    # (the keys mode's cluster call, 12 spaces in: its rows' store is stamped at keys_cta's end above)
    ("\n            cluster_merge(p, a, smem_raw, split, b, hkv0, r0, rows_valid, tid);\n", "", "            __syncthreads();\n"
     "            if (threadIdx.x == 0) { rtk_stamps[STAMPSull * blockIdx.x + 10] = rtk_now();"
     " rtk_stamps[STAMPSull * blockIdx.x + 3] = rtk_now(); }\n"),
    # the last CTA of a group knows it is last (the counter's answer is back: slot 13)
    ("    if (!rtk::last_block_to_arrive(p.counters + merge_group(), a.num_splits, reinterpret_cast<int*>(smem_raw))) "
     "return;\n", "", "    if (threadIdx.x == 0) rtk_stamps[STAMPSull * blockIdx.x + 13] = rtk_now();\n"),
    ("        group_merge<GM_LOADS / GM_SB, GM_SB, true>(p, a, 0, 1, b, hkv0, r0, rows_valid, rows_all, tid);\n", "",
     "        __syncthreads();\n        if (threadIdx.x == 0) { rtk_stamps[STAMPSull * blockIdx.x + 10] = rtk_now();"
     " rtk_stamps[STAMPSull * blockIdx.x + 3] = rtk_now(); }\n"),
]


def patched_templates(src: str, dst: str) -> None:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "attention_decode.cu.j2")
    text = open(path).read()
    for anchor, before, after in PATCHES:
        if text.count(anchor) != 1:
            raise SystemExit(f"decode_timeline: the anchor {anchor.strip()[:80]!r} is not in the template once "
                             f"({text.count(anchor)} times): update PATCHES")
        text = text.replace(anchor, (before + anchor + after).replace("STAMPS", str(STAMPS)))
    open(path, "w").write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", help="b:sk:h:hkv:d:sq[:paged16]")
    ap.add_argument("--variants", default="", help="name=field:value+...;... (tools/bench_decode.py variants)")
    ap.add_argument("--calls", type=int, default=20, help="calls before the one read back")
    ap.add_argument("--out", default=None, help="folder for the raw stamps (.npy per shape and variant)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="rtk_timeline_")
    os.environ["RTKERNELS_CACHE_DIR"] = os.path.join(tmp, "cache")
    import numpy as np
    import cupy as cp
    import rtkernels as rtk
    import rtkernels.render as render
    import rtkernels.ops.attention_kvcache as kv
    import bench_decode as bd
    patched_templates(str(render.template_dir()), os.path.join(tmp, "templates"))
    render.template_dir = lambda: __import__("pathlib").Path(tmp, "templates")
    variants = {"default": None, **bd.parse_variants(args.variants)} if args.variants else {"default": None}
    for spec in args.shapes:
        parts = spec.split(":")
        shape = tuple(map(int, parts[:6]))
        layout = parts[6] if len(parts) > 6 else "contig"
        sets = [bd.Set(shape, "bfloat16", None, False, (16, 64)) for _ in range(3)]
        for name, variant in variants.items():
            fn = bd._rtk_fn(rtk, kv, layout, "bfloat16", None, variant)
            plan = bd._plan_of(kv, sets[0], layout, "bfloat16", None, {}, variant)
            if plan.split is None or plan.num_splits < 2 or plan.config.schedule != "split":
                print(f"{spec} {name}: not a split plan ({plan.config}, {plan.num_splits} splits)")
                continue
            mod = plan.split.kernel.module.load(cp.cuda.Device().id)
            ptr = mod.get_global_var("rtk_stamps")
            grid = plan.split.grid[0]
            cp.cuda.runtime.memset(ptr, 0, grid * STAMPS * 8)
            for i in range(args.calls):
                fn(sets[i % 3])
            cp.cuda.Device().synchronize()
            kv.set_variant(None)
            ms, _, _ = bd.bu.time_queued(fn, [(x,) for x in sets], repeat=20)   # as tools/bench_decode.py times
            kv.set_variant(None)
            st = np.empty((grid, STAMPS), dtype=np.uint64)
            cp.cuda.runtime.memcpy(st.ctypes.data, ptr, st.nbytes, 2)   # device to host
            st = st.astype(np.int64)
            if (st[:, 0] == 0).any():
                print(f"{spec} {name}: {(st[:, 0] == 0).sum()} CTAs left no stamp (a merge path the patch misses)")
                continue
            base = st[:, [0, 11]].min()   # the first CTA's first instruction
            rel = (st[:, :4] - base) / 1000.0
            c = plan.config
            print(f"\n{spec} {name}: {ms * 1000:.2f} us per call back to back (events between calls)")
            print(f"{spec} {name}: grid {grid}, {plan.num_splits} splits, merge "
                  f"{'cluster' if c.cluster_merge else 'group' if c.group_merge else 'other'}; "
                  f"first start -> last exit {rel[:, 3].max():.2f} us")
            for j, what in enumerate(("start", "loop end", "stored", "exit")):
                col = rel[:, j]
                print(f"  {what:9s} min {col.min():7.2f}  p10 {np.percentile(col, 10):7.2f}  med {np.median(col):7.2f}  "
                      f"p90 {np.percentile(col, 90):7.2f}  max {col.max():7.2f}")
            entry = (st[:, 11] - base) / 1000.0
            lens = (st[:, 12] - st[:, 11]) / 1000.0
            print(f"  kernel entry min {entry.min():7.2f} med {np.median(entry):7.2f} max {entry.max():7.2f} us; "
                  f"entry -> length read med {np.median(lens):.2f} max {lens.max():.2f} us")
            if c.warp_split == "keys":
                warps = (st[:, 6:6 + min(4, c.num_warps)] - base) / 1000.0
                spread = warps.max(axis=1) - warps.min(axis=1)
                print(f"  warp loop ends within a CTA: spread med {np.median(spread):.2f} max {spread.max():.2f} us; "
                      f"all warps min {warps.min():.2f} max {warps.max():.2f}")
                merged = st[:, 10] > 0
                if merged.any():
                    me = (st[merged, 10] - base) / 1000.0
                    print(f"  merges: {merged.sum()}, end min {me.min():.2f} max {me.max():.2f} us")
                last = st[:, 13] > 0   # the last CTA of each group: its partial stored, its arrival answered
                if last.any():
                    known = (st[last, 13] - st[last, 2]) / 1000.0
                    print(f"  last CTAs ({last.sum()}): stored -> arrival answered med {np.median(known):.2f} max "
                          f"{known.max():.2f} us", end="")
                    done = last & merged
                    if done.any():
                        work = (st[done, 10] - st[done, 13]) / 1000.0
                        print(f"; answered -> merge end med {np.median(work):.2f} max {work.max():.2f} us", end="")
                    print()
            store, merge = rel[:, 2] - rel[:, 1], rel[:, 3] - rel[:, 2]
            print(f"  store med {np.median(store):.2f} max {store.max():.2f} us; merge (with its waits) med "
                  f"{np.median(merge):.2f} max {merge.max():.2f} us; last loop end -> last exit "
                  f"{rel[:, 3].max() - rel[:, 1].max():.2f} us")
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                np.save(os.path.join(args.out, f"stamps_{spec.replace(':', '_')}_{name}.npy"), st)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
