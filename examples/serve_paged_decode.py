"""A serving loop on rtk.attention_kvcache: a paged KV cache, a ragged batch, chunked prefill, and
the decode step captured once in a CUDA graph and replayed with new queries and lengths.

    python examples/serve_paged_decode.py [--batch 8 --heads 32 --kv-heads 8 --head-dim 128
                                           --page 64 --prompt 100,3000 --steps 64 --chunk 256]

What a serving stack does around the attention (one layer shown, random tensors in place of a model):

  pool      (num_blocks, page, kv_heads, head_dim) K and V pages; each sequence owns pages listed
            in its row of block_table - taken from a shuffled free list, as after hours of churn
  prefill   each prompt in chunks of --chunk tokens: attention_kvcache(q_chunk, ..., k_new=chunk
            keys, v_new=chunk values) appends the chunk into the sequence's pages and attends to
            everything before it (causal, bottom-right aligned)
  decode    per step, per sequence: one query row and one new key/value; the call reads
            cache_seqlens and block_table only on the device, so the step - attention plus the
            `cache_seqlens += 1` that follows - is captured once and replayed for every step
            after copying the step's q / k_new / v_new into the graph's static buffers

The last step's output is checked against a float64 reference computed on the host from a dense
mirror of everything appended; the eager and replayed step times are printed.  float16 (CuPy has
no bfloat16 dtype; rtk takes bfloat16 as uint16 bits plus ``dtype="bfloat16"``).
"""
from __future__ import annotations

import argparse
import math


def build_pool(rng, batch: int, capacity_pages: int, spare: int):
    """Block tables from a shuffled free list: (num_blocks, block_table int32 (batch, capacity_pages))."""
    import numpy as np
    num_blocks = batch * capacity_pages + spare
    free = rng.permutation(num_blocks).astype(np.int32)
    return num_blocks, free[: batch * capacity_pages].reshape(batch, capacity_pages)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=64, help="keys per page (a multiple of 16)")
    p.add_argument("--prompt", default="100,3000", help="prompt lengths drawn uniformly from this range")
    p.add_argument("--steps", type=int, default=64, help="decode steps")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (query rows per call)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import cupy as cp
    import numpy as np

    import rtkernels as rtk
    from rtkernels.ops.attention_kvcache import attention_kvcache_reference

    rng = np.random.default_rng(args.seed)
    B, H, Hkv, D, page = args.batch, args.heads, args.kv_heads, args.head_dim, args.page
    lo, hi = (int(x) for x in args.prompt.split(","))
    prompts = rng.integers(lo, hi + 1, size=B)
    capacity = int(prompts.max()) + args.steps
    pages_per_seq = -(-capacity // page)
    num_blocks, table_np = build_pool(rng, B, pages_per_seq, spare=3)
    block_table = cp.asarray(table_np)
    k_cache = cp.full((num_blocks, page, Hkv, D), np.nan, cp.float16)   # unused slots stay NaN: never read
    v_cache = cp.full_like(k_cache, np.nan)
    # dense host mirror of every appended key/value, for the reference
    k_mirror = np.zeros((B, capacity, Hkv, D), np.float16)
    v_mirror = np.zeros_like(k_mirror)

    def randn(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float16)

    # ---- prefill: chunks of each prompt appended and attended in one call -----------------------------
    for b in range(B):
        done = 0
        while done < prompts[b]:
            n = int(min(args.chunk, prompts[b] - done))
            q, kn, vn = randn(1, n, H, D), randn(1, n, Hkv, D), randn(1, n, Hkv, D)
            k_mirror[b, done:done + n], v_mirror[b, done:done + n] = kn[0], vn[0]
            rtk.attention_kvcache(cp.asarray(q), k_cache, v_cache, cp.asarray([done], cp.int32),
                                  k_new=cp.asarray(kn), v_new=cp.asarray(vn), block_table=block_table[b:b + 1])
            done += n
    lens = cp.asarray(prompts.astype(np.int32))
    cp.cuda.Device().synchronize()   # the decode stream below does not wait for the legacy default stream

    # ---- the decode step: static buffers, captured once --------------------------------------------
    q_buf = cp.empty((B, 1, H, D), cp.float16)
    kn_buf = cp.empty((B, 1, Hkv, D), cp.float16)
    vn_buf = cp.empty_like(kn_buf)
    o_buf = cp.empty_like(q_buf)

    def step():
        rtk.attention_kvcache(q_buf, k_cache, v_cache, lens, k_new=kn_buf, v_new=vn_buf,
                              block_table=block_table, out=o_buf)
        lens[...] += 1   # the next step's lengths, on the device: nothing read back

    def feed(t):
        q, kn, vn = randn(B, 1, H, D), randn(B, 1, Hkv, D), randn(B, 1, Hkv, D)
        for b in range(B):
            pos = int(prompts[b]) + t
            k_mirror[b, pos], v_mirror[b, pos] = kn[b, 0], vn[b, 0]
        q_buf.set(q)
        kn_buf.set(kn)
        vn_buf.set(vn)
        return q

    stream = cp.cuda.Stream(non_blocking=True)
    eager_steps = min(4, args.steps)
    with stream:
        start, end = cp.cuda.Event(), cp.cuda.Event()
        t_eager = []
        for t in range(eager_steps):   # eager steps: compile, load, plan - and the eager per-step time
            feed(t)
            start.record()
            step()
            end.record()
            end.synchronize()
            t_eager.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        t_graph = []
        q_last = None
        for t in range(eager_steps, args.steps):
            q_last = feed(t)
            start.record()
            graph.launch()
            end.record()
            end.synchronize()
            t_graph.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        stream.synchronize()

    # ---- check the last step against float64 over the dense mirror ------------------------------
    if q_last is None:
        print(f"{args.steps} steps ran eagerly (no replay to check); use --steps > 4")
        return
    t = args.steps - 1
    before = prompts + t                                  # keys in each cache before the last append
    k_new = np.stack([k_mirror[b, before[b]] for b in range(B)])[:, None]
    v_new = np.stack([v_mirror[b, before[b]] for b in range(B)])[:, None]
    want, _ = attention_kvcache_reference(q_last, k_mirror, v_mirror, before, k_new=k_new, v_new=v_new,
                                          causal=True)
    got = cp.asnumpy(o_buf).astype(np.float64)
    err = float(np.abs(got - want).max())
    kv_bytes = 2 * int((before + 1).sum()) * Hkv * D * 2
    print(f"batch {B}, heads {H}/{Hkv}, d{D}, page {page}, prompts {lo}-{hi}, {args.steps} decode steps")
    print(f"  eager step    {np.median(t_eager):8.1f} us (first {t_eager[0]:.0f} us: compile/load)")
    print(f"  graph replay  {np.median(t_graph):8.1f} us  ({kv_bytes / np.median(t_graph) / 1e3:.0f} GB/s of K/V "
          f"read at the last step's lengths)")
    print(f"  last step vs float64: max |error| {err:.2e}" + ("  OK" if err < 2e-2 else "  MISMATCH"))
    if not math.isfinite(err) or err >= 2e-2:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
