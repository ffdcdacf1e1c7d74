"""Ring attention benchmark: rtkernels.dist.ring_attention (forward, forward + backward) on N GPUs
against single-GPU rtk.attention / rtk.attention_backward over the full sequence, per layout,
causal and not.

    python -m rtkernels.dist.run -n 2 tools/bench_ring.py --out $OUT             # N GPUs over NCCL
    PYTHONPATH=. python tools/bench_ring.py --simulate 2 --out $OUT              # N simulated ranks, one GPU

Columns (times: median of the repeats, the slowest rank's):
  ring_ms           one ring_attention call (fwd) or ring_attention + ring_attention_backward (fwd+bwd)
  single_ms         rtk.attention (+ attention_backward) on one GPU over the whole sequence S = N * S_local
  efficiency        single_ms / (N * ring_ms): 1.0 is perfect scaling (the issue's target: >= 0.90 from S >= 64k)
  compute_ms        the same schedule with no transfers (the shifts only order the streams)
  comm_ms           the same schedule with every kernel skipped (the transfers alone)
  hidden_pct        share of comm_ms hidden behind compute: (compute_ms + comm_ms - ring_ms) / comm_ms
  vs_contiguous     the contiguous layout's ring_ms / this layout's (causal: the striped / zigzag gain)
  tflops_per_gpu    4 B S^2 H d (halved when causal; x3.5 for fwd+bwd) / (N * ring_ms)

--simulate N runs the N ranks as threads on one GPU (rtkernels.dist.SimulatedComm): ring_ms is then
the whole ring's time on that GPU, and single_ms / ring_ms (reported as efficiency) measures what the
schedule's decomposition costs in compute (smaller kernels, merges, accumulation) with no
communication; comm and hidden columns are left out.
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402


def _args():
    p = bu.parser(__doc__.split("\n\n")[0])
    p.add_argument("--simulate", type=int, default=0, help="N simulated ranks on one GPU (no NCCL)")
    p.add_argument("--seqlens", default=None, help="tokens per GPU, comma separated (default 8k..64k; "
                                                   "8k..32k with --simulate)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--heads-kv", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layouts", default="striped,zigzag,contiguous")
    p.add_argument("--causal", default="true,false")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-backward", action="store_true")
    return p.parse_args()


def _flops(b, s, h, d, causal, backward):
    f = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


class _NoTransfer:
    """A communicator of the same rank / size that moves nothing (compute-only timing)."""

    def __init__(self, comm):
        self.rank, self.world_size = comm.rank, comm.world_size

    def shift(self, send, recv, after):
        from rtkernels.dist.comm import Pending
        return Pending(None)


def _skip_compute(kern):
    """The ring's kernels replaced by nothing (transfer-only timing); lse buffers still exist."""
    import cupy as cp
    from rtkernels.dist.ring import CudaKernels

    class Skip(CudaKernels):
        def attention(self, q, k, v, causal, scale, out):
            return cp.empty((q.shape[0], q.shape[2], q.shape[1]), cp.float32)

        def attention_backward(self, *a):
            pass

        def merge(self, *a):
            pass

        def add(self, *a):
            pass
    return Skip(kern.dtype, kern.stream, kern.device)


def _ring_call(comm, arrays, layout, causal, backward, kern=None, transfer=True):
    """A closure running one ring forward (+ backward) on this rank; the public API unless a kernel
    set or no-transfer communicator is asked for (then the same schedule functions it calls)."""
    import rtkernels.dist as rd
    from rtkernels.dist.ring import CudaKernels, backward_steps, forward_steps
    from rtkernels.dist.schedule import plan
    q, k, v, do = arrays
    extra = {"dtype": "bfloat16"}
    if kern is None and transfer:
        def run():
            o, lse = rd.ring_attention(q, k, v, causal=causal, layout=layout, comm=comm, return_lse=True, **extra)
            if backward:
                rd.ring_attention_backward(do, q, k, v, o, lse, causal=causal, layout=layout, comm=comm, **extra)
        return run
    import cupy as cp
    stream = cp.cuda.get_current_stream()
    base = CudaKernels("bfloat16", stream, cp.cuda.runtime.getDevice())
    kern = _skip_compute(base) if kern == "skip" else base
    c = comm if transfer else _NoTransfer(comm)
    steps = plan(layout, causal, comm.rank, comm.world_size, q.shape[1])
    scale = q.shape[3] ** -0.5
    out = cp.empty(q.shape, cp.uint16)
    dq = cp.empty(q.shape, cp.uint16)
    dkv = cp.empty((2,) + k.shape, cp.uint16)

    def run():
        lse = forward_steps(kern, c, q, k, v, steps, scale, out)
        if backward:
            backward_steps(kern, c, do, q, k, v, out, lse, steps, scale, dq, dkv)
    return run


def _time(fn, repeat, sync=None):
    """Median ms of ``fn`` between two events on the current stream (warm-up first)."""
    import cupy as cp
    fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeat):
        if sync:
            sync()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def _slowest(comm, value: float) -> float:
    """The maximum of ``value`` over the ranks (N - 1 shifts of one float around the ring)."""
    import cupy as cp
    if comm.world_size == 1:
        return value
    stream = cp.cuda.get_current_stream()
    cur, best = cp.asarray([value], cp.float64), value
    for _ in range(comm.world_size - 1):
        nxt = cp.empty_like(cur)
        comm.shift([cur], [nxt], after=stream).wait(stream)
        cur = nxt
        best = max(best, float(cur.get()[0]))
    return best


def _inputs(rng_seed, b, s, h, hkv, d):
    import cupy as cp
    rs = cp.random.RandomState(rng_seed)

    def bf16(shape):
        x = rs.standard_normal(shape, dtype=cp.float32)
        return ((x.view(cp.uint32) + 0x8000) >> 16).astype(cp.uint16)
    return bf16((b, s, h, d)), bf16((b, s, hkv, d)), bf16((b, s, hkv, d)), bf16((b, s, h, d))


def _single(arrays, causal, backward, repeat):
    import rtkernels as rtk
    q, k, v, do = arrays

    def run():
        o, lse = rtk.attention(q, k, v, causal=causal, dtype="bfloat16")
        if backward:
            rtk.attention_backward(do, q, k, v, o, lse, causal=causal, dtype="bfloat16")
    return _time(run, repeat)


def main() -> int:
    import cupy as cp
    import rtkernels.dist as rd
    a = _args()
    sim = a.simulate
    if sim:
        world, rank = sim, 0
    else:
        comm = rd.default_comm()
        world, rank = comm.world_size, comm.rank
    lead = rank == 0
    seqlens = [int(x) for x in (a.seqlens or ("8192,16384,32768" if sim else "8192,16384,32768,65536")).split(",")]
    if a.quick:
        seqlens = seqlens[:2]
    layouts = a.layouts.split(",")
    causals = [c.strip().lower() == "true" for c in a.causal.split(",")]
    passes = [False] if a.no_backward else [False, True]
    B, H, HKV, D = a.batch, a.heads, a.heads_kv, a.head_dim
    env = bu.environment() if lead else {}
    if lead:
        env.update(mode=f"simulated {sim} ranks on one GPU" if sim else f"{world} GPUs over "
                   f"{type(comm).__name__}", batch=B, heads=H, heads_kv=HKV, head_dim=D, dtype="bfloat16")
        print(env, flush=True)
    rows = []
    for L in seqlens:
        S = world * L
        full = _inputs(1, B, S, H, HKV, D) if (lead or sim) else None
        for causal in causals:
            for backward in passes:
                single = _single(full, causal, backward, max(2, a.repeat // 2)) if lead else 0.0
                base = {}
                for layout in layouts:
                    r = _bench_one(a, sim, None if sim else comm, world, rank, L, layout, causal, backward, full)
                    if not lead:
                        continue
                    r.update(S_local=L, S=S, layout=layout, causal=causal, pass_="fwd+bwd" if backward else "fwd",
                             single_ms=single)
                    r["efficiency"] = single / (world * r["ring_ms"])
                    r["tflops_per_gpu"] = _flops(B, S, H, D, causal, backward) / (world * r["ring_ms"] * 1e-3) / 1e12
                    base[layout] = r["ring_ms"]
                    rows.append(r)
                    print(bu.table([r], _COLUMNS), flush=True)
                if lead and "contiguous" in base:
                    for r in rows[-len(layouts):]:
                        r["vs_contiguous"] = base["contiguous"] / r["ring_ms"]
        del full
        cp.get_default_memory_pool().free_all_blocks()
    if lead:
        path = bu.save(a.out, "bench_ring" + (f"_sim{sim}" if sim else f"_{world}gpu"), {"env": env, "rows": rows})
        for backward in passes:
            tag = "fwd+bwd" if backward else "fwd"
            series = {f"{lay} {'causal' if c else 'full'}": ([r["S"] for r in rows if r["layout"] == lay
                                                              and r["causal"] == c and r["pass_"] == tag],
                                                             [r["efficiency"] for r in rows if r["layout"] == lay
                                                              and r["causal"] == c and r["pass_"] == tag])
                      for lay in layouts for c in causals}
            bu.plot(a.out, f"bench_ring_{tag.replace('+', '_')}" + (f"_sim{sim}" if sim else f"_{world}gpu"), series,
                    "total sequence length S", "scaling efficiency", f"ring attention {tag}, {env['mode']}")
        print(f"\n{env['date']} {env['gpu']} - {env['mode']}; B={B} H={H}/{HKV} d={D} bf16; JSON: {path}")
        print(bu.table(rows, _COLUMNS))
    return 0


_COLUMNS = ["S_local", "S", "pass_", "causal", "layout", "ring_ms", "single_ms", "efficiency", "compute_ms", "comm_ms",
            "hidden_pct", "vs_contiguous", "tflops_per_gpu"]


def _bench_one(a, sim, comm, world, rank, L, layout, causal, backward, full):
    """Times for one (S_local, layout, causal, pass) on this rank (rank 0 gets the slowest rank's)."""
    import cupy as cp
    import rtkernels.dist as rd
    if sim:
        shards = [[rd.shard(x, r, world, layout) for x in full] for r in range(world)]
        s = rd.SimulatedComm(world)
        calls = {}

        def run():
            def rank_fn(c):
                if c.rank not in calls:
                    calls[c.rank] = _ring_call(c, shards[c.rank], layout, causal, backward)
                calls[c.rank]()
            s.run(rank_fn)
        return {"ring_ms": _time(run, a.repeat)}
    arrays = _inputs(100 + rank, a.batch, L, a.heads, a.heads_kv, a.head_dim)   # each rank its own shard
    sync = lambda: _slowest(comm, 0.0)   # noqa: E731 - lines the ranks up before each timed call
    out = {}
    for name, kern, transfer in (("ring_ms", None, True), ("compute_ms", "plain", False), ("comm_ms", "skip", True)):
        ms = _time(_ring_call(comm, arrays, layout, causal, backward, kern=kern, transfer=transfer), a.repeat, sync)
        out[name] = _slowest(comm, ms)
    out["hidden_pct"] = max(0.0, min(100.0, 100.0 * (out["compute_ms"] + out["comm_ms"] - out["ring_ms"])
                                     / max(out["comm_ms"], 1e-9)))
    del arrays
    cp.get_default_memory_pool().free_all_blocks()
    return out


if __name__ == "__main__":
    sys.exit(main())
