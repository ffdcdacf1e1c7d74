"""Decode-time GEMMs (M <= 16) at the memory roof: rtk.quantized_matmul and rtk.matmul's GEMV route vs cuBLAS.

For each (N, K) of the Llama-3 8B / 70B projections and M in {1, 4, 16}: the time of
rtk.quantized_matmul (int8 per-channel, int8 group 128, float8 e4m3 group 128), its GB/s over the
quantized weight bytes (N * K, one byte each: the scales add 1/32 .. 1/128 more and are not
counted), that rate as % of the device copy measured in the same run (bytes read + written per
second, benchutil.copy_bandwidth), cuBLAS bf16 on the same shape (torch.matmul(x, w.T), bf16
weights) and rtk's speedup over it.  Calls are queued behind a spin kernel (benchutil.time_queued:
kernel time back to back, host cost hidden), rtk and cuBLAS interleaved in two rounds (the better
median of each kept), and each candidate rotates among weight copies totalling >= 256 MiB so no
call finds its weight in L2 (50 MiB).  Targets (issue 20): >= 85% of copy and >= 1.0x cuBLAS at
M in {1, 4, 16}.

Unquantized kinds (rtk.matmul's M <= 16 route, the GEMV kernel on bfloat16 weights): ``bf16`` is
rtk.matmul(x, w.T) with w (N, K) as nn.Linear stores it (K-major), ``bf16_n`` rtk.matmul(x, b) with
b a row-major (K, N) (N-major); cuBLAS is torch.matmul on the very same operands.  Their GB/s
count the weight's 2 * N * K bytes; ``lat_us`` columns are the per-call latency (a host loop of
calls on rotating weights ending with a synchronize: host time and kernel time, whichever is
longer, as a decode loop sees it) of rtk and of torch.matmul.

    PYTHONPATH=. python tools/bench_quant_matmul.py [--out DIR] [--kinds int8,int8_g128,fp8_g128,bf16,bf16_n]
        [--ms 1,4,16] [--sweep] [--sweep-dense] [--tiles]
    # --sweep: quantized tile candidates at 4 shapes (M = 1, 16), ~1 min more; --sweep-dense: the
    # dense GEMV tilings at 4 shapes, both layouts; --tiles: also time rtk.matmul's tile kernels
    # (RTKERNELS_MATMUL_GEMV=0's path) on the bf16 rows

Each case also checks rtk against torch's float32 product of the dequantized weight (max error
relative to max |y|).  A plain read of the same N * K bytes (a streaming kernel with 64 bytes in
flight per thread, 2048 threads per SM, timed the same way) gives what any kernel can reach at that
size ("read %copy": launch and DRAM ramp-up cost several us, a large share at 16 MB).  The run ends
with a compact table: %copy per shape for each kind and M, beside the read's.  About 1.5-2 minutes
on an H100 with --sweep.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchutil  # noqa: E402

SHAPES = ((4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (10240, 8192), (28672, 8192),
          (8192, 28672))
KINDS = {"int8": ("int8", None), "int8_g128": ("int8", 128), "fp8_g128": ("float8_e4m3", 128),
         "fp8": ("float8_e4m3", None), "uint8_g128": ("uint8", 128), "bf16": ("bfloat16", None),
         "bf16_n": ("bfloat16", None)}
DENSE = {"bf16": False, "bf16_n": True}   # unquantized kinds: n_major
SWEEP_SHAPES = ((4096, 4096), (14336, 4096), (28672, 8192), (8192, 28672))
SET_BYTES = 256 << 20


def device_sms() -> int:
    from rtkernels import device
    return device.sm_count()


def _weights(cp, n, k, kind, group, count):
    """``count`` (w_q, scales, zeros) sets of random codes (no e4m3 NaN encodings)."""
    sets = []
    ng = -(-k // group) if group else None
    for _ in range(count):
        if kind == "int8":
            q = cp.random.randint(-127, 128, (n, k), dtype=cp.int8)
        else:
            q = cp.random.randint(0, 256, (n, k), dtype=cp.uint8)
            if kind == "float8_e4m3":
                q[(q & 0x7F) == 0x7F] ^= 1
        shape = (n,) if group is None else (n, ng)
        s = (cp.random.random_sample(shape, dtype=cp.float32) * 0.01 + 0.001).astype(cp.float32)
        z = cp.random.randint(100, 156, shape, dtype=cp.uint8) if kind == "uint8" else None
        sets.append((q, s, z))
    return sets


def _as_torch(torch, sets, kind):
    """The CuPy sets as torch tensors (zero copy; float8 weights as torch.float8_e4m3fn)."""
    out = []
    for q, s, z in sets:
        tq = torch.from_dlpack(q)
        if kind == "float8_e4m3":
            tq = tq.view(torch.float8_e4m3fn)
        out.append((tq, torch.from_dlpack(s), None if z is None else torch.from_dlpack(z)))
    return out


def _dequant_t(torch, qm, q, s, z, group, kind):
    """float32 torch (N, K) of a set's weight: the reference's formula (dequantize_reference),
    evaluated on the GPU with CuPy."""
    import cupy as cp
    if kind == "float8_e4m3":
        table = cp.asarray(qm.E4M3_VALUES, dtype=cp.float32)
        v = table[q]
    else:
        v = q.astype(cp.float32)
        if z is not None:
            v -= (z[:, None] if group is None else cp.repeat(z, group, axis=1)[:, :q.shape[1]]).astype(cp.float32)
    sc = s[:, None] if group is None else cp.repeat(s, group, axis=1)[:, :q.shape[1]]
    return torch.from_dlpack(v * sc)


_READ = None


def _read_kernel(cp):
    """A streaming read of n16 16-byte words: grid-stride, four loads issued before use, XOR-folded
    so the loads stay live (the fold never equals the sentinel for our inputs' sizes)."""
    global _READ
    if _READ is None:
        _READ = cp.RawKernel(r'''
extern "C" __global__ void __launch_bounds__(256) read_bytes(const uint4* __restrict__ p, long long n16,
                                                             unsigned* out) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = __ldg(p + i + j * stride);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < n16; i += stride) { const uint4 v = __ldg(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x9E3779B9u) out[0] = acc;
}''', "read_bytes")
    return _READ


def read_case(args, n, k):
    """us to read N * K bytes (rotating copies, like the rtk cases) with the streaming read kernel."""
    import cupy as cp
    from benchutil import time_queued
    from rtkernels import device
    count = max(2, -(-SET_BYTES // (n * k)))
    bufs = [cp.zeros(n * k // 16 * 16, dtype=cp.uint8) for _ in range(count)]
    sink = cp.zeros(1, dtype=cp.uint32)
    kern = _read_kernel(cp)
    grid = device.sm_count() * 8

    def call(b):
        kern((grid,), (256,), (b, cp.int64(b.size // 16), sink))

    ms = time_queued(call, [(b,) for b in bufs], repeat=args.repeat)[0]
    del bufs
    return ms * 1e3


def run_case(args, torch, rtk, qm, n, k, m, kind_name, copy_gbs, tsets_cache):
    import cupy as cp
    from benchutil import time_queued
    kind, group = KINDS[kind_name]
    count = max(2, -(-SET_BYTES // (n * k)))
    sets = _weights(cp, n, k, kind, group, count)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    inputs = _as_torch(torch, sets, kind)   # all-torch calls replay their launch plan

    def call(q, s, z):
        rtk.quantized_matmul(x, q, s, group_size=group, zeros=z, out=out)

    # correctness: the first set against torch's float32 product of its dequantized weight
    call(*inputs[0])
    ref = x.float() @ _dequant_t(torch, qm, *sets[0], group, kind).T
    err = float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

    key = (n, k)
    if key not in tsets_cache:
        tsets_cache.clear()
        torch.cuda.empty_cache()
        tcount = max(2, -(-SET_BYTES // (2 * n * k)))
        tsets_cache[key] = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16),) for _ in range(tcount)]
    tsets = tsets_cache[key]
    tout = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def cublas(w):
        torch.matmul(x, w.T, out=tout)

    rtk_ms, cublas_ms = [], []
    for _ in range(2):
        rtk_ms.append(time_queued(call, inputs, repeat=args.repeat)[0])
        cublas_ms.append(time_queued(cublas, tsets, repeat=args.repeat)[0])
    ms, ms_c = min(rtk_ms), min(cublas_ms)
    gbs = n * k / (ms * 1e-3) / 1e9
    cfg = qm.heuristic_config("bfloat16", m, n, k, weight_dtype=kind, group_size=group or 0,
                              has_zeros=kind == "uint8", sm_count=device_sms())
    del sets, inputs
    return {"N": n, "K": k, "M": m, "kind": kind_name, "rtk_us": ms * 1e3, "GBs": gbs,
            "%copy": 100 * gbs / copy_gbs, "cublas_bf16_us": ms_c * 1e3, "vs_cublas": ms_c / ms,
            "cublas_GBs": 2 * n * k / (ms_c * 1e-3) / 1e9, "rel_err": err,
            "tiles": cfg.tag()}


def _rotating(fn, sets):
    """fn() over the weight sets in turn (the latency loop)."""
    state = [0]

    def call():
        fn(*sets[state[0] % len(sets)])
        state[0] += 1
    return call


def run_dense_case(args, torch, rtk, n, k, m, kind, copy_gbs, dsets_cache):
    """rtk.matmul's GEMV route on bf16 weights (K-major: b = w.T; N-major: b (K, N)) vs torch.matmul on
    the same operands: kernel times queued back to back, per-call latency, and the error of each
    against torch's float32 product."""
    from benchutil import time_host, time_queued
    from rtkernels.ops import gemv, matmul as mm
    n_major = DENSE[kind]
    key = (n, k, n_major)
    if key not in dsets_cache:
        dsets_cache.clear()
        torch.cuda.empty_cache()
        count = max(2, -(-SET_BYTES // (2 * n * k)))
        shape = (k, n) if n_major else (n, k)
        dsets_cache[key] = [(torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02,) for _ in range(count)]
    sets = [(w if n_major else w.T,) for (w,) in dsets_cache[key]]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    tout = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def call(b):
        rtk.matmul(x, b, out=out)

    def cublas(b):
        torch.matmul(x, b, out=tout)

    call(*sets[0])
    cublas(*sets[0])
    ref = x.float() @ sets[0][0].float()
    err = float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    err_c = float((tout.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    rtk_ms, cublas_ms = [], []
    for _ in range(2):
        rtk_ms.append(time_queued(call, sets, repeat=args.repeat)[0])
        cublas_ms.append(time_queued(cublas, sets, repeat=args.repeat)[0])
    ms, ms_c = min(rtk_ms), min(cublas_ms)
    lat = time_host(_rotating(call, sets), 200)
    lat_c = time_host(_rotating(cublas, sets), 200)
    gbs = 2 * n * k / (ms * 1e-3) / 1e9
    cfg = gemv.heuristic_config("bfloat16", m, n, k, weight_dtype="bfloat16", n_major=n_major,
                                sm_count=device_sms())
    row = {"N": n, "K": k, "M": m, "kind": kind, "rtk_us": ms * 1e3, "GBs": gbs, "%copy": 100 * gbs / copy_gbs,
           "cublas_bf16_us": ms_c * 1e3, "vs_cublas": ms_c / ms, "cublas_GBs": 2 * n * k / (ms_c * 1e-3) / 1e9,
           "cublas_%copy": 100 * 2 * n * k / (ms_c * 1e-3) / 1e9 / copy_gbs, "rtk_lat_us": lat,
           "cublas_lat_us": lat_c, "rel_err": err, "cublas_rel_err": err_c, "tiles": cfg.tag()}
    if args.tiles:   # the tile kernels rtk.matmul ran before the GEMV route (plans keyed by USE_GEMV)
        mm.USE_GEMV = False
        try:
            row["rtk_tiles_us"] = min(time_queued(call, sets, repeat=args.repeat)[0] for _ in range(2)) * 1e3
        finally:
            mm.USE_GEMV = True
    return row


DENSE_SWEEP_SHAPES = ((4096, 4096), (14336, 4096), (10240, 8192), (28672, 8192))


def _variants(named):
    """[(label, config)] of the (label, thunk) pairs whose config is valid, first of each config kept."""
    from rtkernels.errors import ConfigError
    out, seen = [], set()
    for label, make in named:
        try:
            c = make()
        except ConfigError:
            continue
        if c.key() not in seen:
            seen.add(c.key())
            out.append((label, c))
    return out


def _ab_rounds(args, cands, sets, rounds=3):
    """min over ``rounds`` interleaved rounds of each candidate's queued median (ms)."""
    from benchutil import time_queued
    best = [float("inf")] * len(cands)
    for _ in range(rounds):
        for i, call in enumerate(cands):
            best[i] = min(best[i], time_queued(call, sets, repeat=args.repeat)[0])
    return best


def nmajor_candidates(old, new, n, sms):
    """[(label, thunk)] of the N-major A/B: ``old`` the session-8 tiling (register slots, global
    split), ``new`` the route's sm_90 config (gemv._nmajor_sm90, the round-2 rule: w16, fit or
    s8 by shape class), and the candidates for the small-N gap, built from ``old`` (every SM's
    bytes in flight, the split):
    * s8+cluster: the session-8 split as a cluster (DSMEM sums) instead of the global one;
    * u4: twice the register slots (M <= 8 unroll 4, M = 9..16 unroll 2) under an explicit cap of
      128, the split a cluster where it is 2..8 (round 2: within 1.5 points of the best at 8192
      wide, M <= 4; not a rule of its own);
    * fit: the largest split (cluster, <= 8) whose tiles x split fit one wave of 2 CTAs per SM
      (6144: 2 instead of 3, whose 288 CTAs overflow 264 slots; 8192: 2 instead of 1, whose 128
      CTAs leave the second CTA slot of every SM empty); u4 fit: both;
    * w16: one CTA of 16 warps along K per SM (the split halves: its 15 partial sums meet in shared
      memory, a smaller cluster), u4's slots, 128 registers;
    * staged: shared-memory slots with the row-contiguous piece layout (was the 64-byte-apart
      layout's bank conflict the staged slots' cap? the previous run: 43% of copy at 14336 x 4096).
    ``new`` comes first: at the round-2 shapes it equals one of w16 / fit / s8, whose column then
    shows "-" (a repeated config is timed once, under its first label)."""
    from rtkernels.ops.gemv import CLUSTER_MAX
    u = 4 if old.m_tiles == 1 else 2
    tiles = old.tiles(n)
    split = 2 <= old.split_k <= CLUSTER_MAX
    fit = min(CLUSTER_MAX, max(1, 2 * sms // tiles)) if tiles < 2 * sms else 1
    fit1 = min(CLUSTER_MAX, max(1, sms // tiles)) if tiles < sms else 1
    return [("new", lambda: new), ("s8", lambda: old),
            ("s8+cluster", lambda: old.replace(cluster=True)),
            ("u4", lambda: old.replace(unroll=u, max_registers=128, cluster=split)),
            ("fit", lambda: old.replace(split_k=fit, cluster=fit > 1)),
            ("u4 fit", lambda: old.replace(split_k=fit, cluster=fit > 1, unroll=u, max_registers=128)),
            ("w16", lambda: old.replace(num_warps=16, warps_k=16, ctas_per_sm=1, unroll=u, max_registers=128,
                                        split_k=fit1, cluster=fit1 > 1)),
            ("staged", lambda: old.replace(staged=True, unroll=4 if old.m_tiles == 1 else 3,
                                           cluster=old.split_k > 1))]


def nmajor_ab(args, torch, copy_gbs):
    """N-major bf16 (x @ b, b (K, N) row-major), the --shapes (default SHAPES) and M in --ms: the
    session-8 tiling, the route's sm_90 config and the candidates of :func:`nmajor_candidates`, and
    cuBLAS, interleaved in rounds (min of the rounds' medians), each checked against float32."""
    import cupy as cp
    from rtkernels import device
    from rtkernels.ops import gemv, matmul as mm
    rows = []
    sms = device.sm_count()
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in t.split("x")) for t in args.shapes.split(",")]
    for (n, k) in shapes:
        count = max(2, -(-SET_BYTES // (2 * n * k)))
        tw = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        ws = [cp.asarray(w.view(torch.int16)).view(cp.uint16) for w in tw]
        for m in [int(v) for v in args.ms.split(",")]:
            tx = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x = cp.asarray(tx.view(torch.int16)).view(cp.uint16)
            out = cp.empty((m, n), dtype=cp.uint16)
            tout = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            _, ints = mm._plan_gemv("bfloat16", m, n, k, 1, x.data.ptr, ws[0].data.ptr, True, False,
                                    k if m > 1 else 0, n, n if m > 1 else 0, 0, 0, 0, False, "none", sms)
            h = dict(weight_dtype="bfloat16", n_major=True, x_vec=4, sm_count=sms)
            old = gemv.heuristic_config("bfloat16", m, n, k, sm90=False, **h)
            new = gemv.heuristic_config("bfloat16", m, n, k, sm90=True, **h)
            named = nmajor_candidates(old, new, n, sms)
            if args.variants:   # (a repeat keeps its first label: "new" before the rest)
                keep = args.variants.split(",")
                named = [nv for nv in named if nv[0] in keep]
            cands = _variants(named)
            _precompile([c for _, c in cands])
            tref = tx.float() @ tw[0].float()
            calls, errs = [], []
            for label, cfg in cands:
                def call(w, cfg=cfg):
                    gemv.launch(cfg, ints, (w, x, None, None, None, out), (w, x, None, None, None, out), None)
                call(ws[0])
                got = torch.from_dlpack(out).view(torch.bfloat16).float()
                errs.append(float((got - tref).abs().max() / tref.abs().max()))
                calls.append(call)

            def cublas(w):
                torch.matmul(tx, w, out=tout)
            # cuBLAS on the same memory (the CuPy arrays are views of these tensors)
            tsets = [(w,) for w in tw]
            wsets = [(w,) for w in ws]
            best = [float("inf")] * (len(calls) + 1)
            from benchutil import time_queued
            for _ in range(3):   # rounds: every rtk variant, then cuBLAS
                for i, call in enumerate(calls):
                    best[i] = min(best[i], time_queued(call, wsets, repeat=args.repeat)[0])
                best[-1] = min(best[-1], time_queued(cublas, tsets, repeat=args.repeat)[0])
            pct = lambda ms: 100 * 2 * n * k / (ms * 1e-3) / 1e9 / copy_gbs   # noqa: E731
            for (label, cfg), ms, err in zip(cands, best, errs):
                rows.append({"N": n, "K": k, "M": m, "variant": label, "tiles": cfg.tag(), "us": ms * 1e3,
                             "%copy": pct(ms), "vs_cublas": best[-1] / ms, "rel_err": err})
            rows.append({"N": n, "K": k, "M": m, "variant": "cuBLAS", "tiles": "-", "us": best[-1] * 1e3,
                         "%copy": pct(best[-1]), "vs_cublas": 1.0, "rel_err": float("nan")})
            line = ", ".join(f"{lb} {pct(ms):.0f}" for (lb, _), ms in zip(cands, best))
            print(f"N-major A/B N={n} K={k} M={m}: {line}, cuBLAS {pct(best[-1]):.0f} (% copy)", flush=True)
        del tw, ws
        torch.cuda.empty_cache()
    return rows


def quant_ab(args, torch, copy_gbs):
    """int8 per-channel and group-128 at the large shapes, M in {1, 16}: the route's config against
    staged slots (6, 8, 12 in flight) through config=, interleaved, %copy of the 8-bit weight."""
    import cupy as cp
    import rtkernels as rtk
    from rtkernels.ops import quant_matmul as qm
    rows = []
    for (n, k) in ((14336, 4096), (8192, 8192), (28672, 8192), (8192, 28672)):
        for kind, group in (("int8", None), ("int8", 128)):
            count = max(2, -(-SET_BYTES // (n * k)))
            sets = _as_torch(torch, _weights(cp, n, k, kind, group, count), kind)
            for m in (1, 16):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                base = qm.heuristic_config("bfloat16", m, n, k, weight_dtype=kind, group_size=group or 0,
                                           sm_count=device_sms())
                named = [("route", lambda: base)] + [
                    (f"staged u{u} c{c}", lambda u=u, c=c: base.replace(staged=True, unroll=u, ctas_per_sm=c))
                    for u, c in ((6, 2), (8, 2), (12, 1), (16, 1))]
                cands = _variants(named)
                _precompile([c for _, c in cands])
                calls = []
                for _, cfg in cands:
                    def call(q, s_, z, cfg=cfg):
                        rtk.quantized_matmul(x, q, s_, group_size=group, out=out, config=cfg)
                    calls.append(call)
                best = _ab_rounds(args, calls, sets)
                for (label, cfg), ms in zip(cands, best):
                    rows.append({"N": n, "K": k, "M": m, "kind": kind + (f"_g{group}" if group else ""),
                                 "variant": label, "tiles": cfg.tag(), "us": ms * 1e3,
                                 "%copy": 100 * n * k / (ms * 1e-3) / 1e9 / copy_gbs})
                print(f"quant A/B N={n} K={k} M={m} {kind} g{group}: " +
                      ", ".join(f"{lb} {100 * n * k / (ms * 1e-3) / 1e9 / copy_gbs:.1f}" for (lb, _), ms in
                                zip(cands, best)), flush=True)
            del sets
    return rows


def ab_table(rows, col) -> str:
    """%copy per (shape, M) row for each variant (columns), the best rtk variant and cuBLAS."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    keys = list(dict.fromkeys((r["N"], r["K"], r["M"]) + ((r[col],) if col else ()) for r in rows))
    by = {((r["N"], r["K"], r["M"]) + ((r[col],) if col else ()), r["variant"]): r for r in rows}
    tiles = "new" in variants   # the route's tiling, beside its number
    head = ["N x K", "M"] + ([col] if col else []) + variants + (["new tiles"] if tiles else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        cells = [f"{key[0]}x{key[1]}", str(key[2])] + ([key[3]] if col else [])
        for v in variants:
            r = by.get((key, v))
            cells.append("-" if r is None else f"{r['%copy']:.1f}")
        if tiles:
            cells.append(by[(key, "new")]["tiles"] if (key, "new") in by else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _precompile(cfgs) -> None:
    """Compile the sweep's kernels in parallel up front (NVRTC releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    from rtkernels.kernel import get_kernel
    jobs = [(c, "quant_gemv") for c in cfgs]
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda j: get_kernel(*j).cubin, jobs))


def sweep_dense(args, torch, copy_gbs):
    """The dense GEMV tilings (candidate_configs around the route's own config) at a few shapes, both
    layouts, M = 1 and 16: launched through gemv.launch with the route's scalars."""
    import cupy as cp
    from benchutil import time_queued
    from rtkernels import device
    from rtkernels.ops import gemv, matmul as mm
    rows = []
    for (n, k) in DENSE_SWEEP_SHAPES:
        for n_major in (False, True):
            count = max(2, -(-SET_BYTES // (2 * n * k)))
            shape = (k, n) if n_major else (n, k)
            ws = [cp.asarray(torch.randn(shape, device="cuda", dtype=torch.bfloat16).view(torch.int16)).view(cp.uint16)
                  for _ in range(count)]
            for m in (1, 16):
                x = cp.asarray(torch.randn(m, k, device="cuda", dtype=torch.bfloat16).view(torch.int16)).view(cp.uint16)
                out = cp.empty((m, n), dtype=cp.uint16)
                base, ints = mm._plan_gemv("bfloat16", m, n, k, 1, x.data.ptr, ws[0].data.ptr, True, not n_major,
                                           k if m > 1 else 0, n if n_major else k, n if m > 1 else 0, 0, 0, 0,
                                           False, "none", device.sm_count())
                res = []
                cands = gemv.candidate_configs(base)
                _precompile(cands)
                for cfg in cands:
                    def call(w, cfg=cfg):
                        gemv.launch(cfg, ints, (w, x, None, None, None, out), (w, x, None, None, None, out), None)
                    try:
                        ms = time_queued(call, [(w,) for w in ws], repeat=args.repeat)[0]
                    except Exception as e:   # noqa: BLE001
                        print(f"  skip {cfg.tag()}: {type(e).__name__}: {e}"[:160])
                        continue
                    gbs = 2 * n * k / (ms * 1e-3) / 1e9
                    res.append({"N": n, "K": k, "M": m, "layout": "N" if n_major else "K", "tiles": cfg.tag(),
                                "us": ms * 1e3, "%copy": 100 * gbs / copy_gbs,
                                "default": all(getattr(cfg, f) == getattr(base, f) for f in gemv._TILE_FIELDS)})
                res.sort(key=lambda r: r["us"])
                rows += res
                dflt = next((r for r in res if r["default"]), None)
                print(f"dense sweep N={n} K={k} M={m} {'N' if n_major else 'K'}-major: best {res[0]['tiles']} "
                      f"{res[0]['%copy']:.1f}% copy; default {dflt['tiles'] if dflt else '?'} "
                      f"{dflt['%copy'] if dflt else float('nan'):.1f}%", flush=True)
            del ws
    return rows


def sweep(args, torch, rtk, qm, copy_gbs):
    """Tile candidates (QuantGemvConfig's tiling through config=) at a few shapes, int8 per-channel."""
    import cupy as cp
    from benchutil import time_queued
    rows = []
    for (n, k) in SWEEP_SHAPES:
        count = max(2, -(-SET_BYTES // (n * k)))
        sets = _as_torch(torch, _weights(cp, n, k, "int8", None, count), "int8")
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            base = qm.heuristic_config("bfloat16", m, n, k, sm_count=device_sms())
            cands = qm.candidate_configs(base)
            _precompile(cands)
            res = []
            for cfg in cands:
                def call(q, s, z, cfg=cfg):
                    rtk.quantized_matmul(x, q, s, out=out, config=cfg)
                try:
                    ms = time_queued(call, sets, repeat=args.repeat)[0]
                except Exception as e:   # noqa: BLE001  (a candidate that does not fit is skipped)
                    print(f"  skip {cfg.key()}: {type(e).__name__}: {e}"[:160])
                    continue
                gbs = n * k / (ms * 1e-3) / 1e9
                tag = cfg.tag()
                res.append({"N": n, "K": k, "M": m, "tiles": tag, "us": ms * 1e3, "GBs": gbs,
                            "%copy": 100 * gbs / copy_gbs,
                            "default": all(getattr(cfg, f) == getattr(base, f) for f in qm._TILE_FIELDS)})
            res.sort(key=lambda r: r["us"])
            rows += res
            best, dflt = res[0], next((r for r in res if r["default"]), None)
            print(f"sweep N={n} K={k} M={m}: best {best['tiles']} {best['%copy']:.1f}% copy; default "
                  f"{dflt['tiles'] if dflt else '?'} {dflt['%copy'] if dflt else float('nan'):.1f}%", flush=True)
        del sets
    return rows


def main():
    p = benchutil.parser(__doc__.splitlines()[0])
    p.add_argument("--kinds", default="int8,int8_g128,fp8_g128,bf16,bf16_n")
    p.add_argument("--ms", default="1,4,16")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="also time tile candidates at 4 shapes")
    p.add_argument("--sweep-dense", action="store_true", help="also time the dense GEMV tilings at 4 shapes")
    p.add_argument("--tiles", action="store_true", help="also time rtk.matmul's tile kernels on the bf16 rows")
    p.add_argument("--nmajor-ab", action="store_true",
                   help="only the N-major A/B (session-8 tiling, the sm_90 route, candidates, cuBLAS)")
    p.add_argument("--quant-ab", action="store_true", help="with --nmajor-ab: also int8 staged slots at 4 shapes")
    p.add_argument("--shapes", default="", help="with --nmajor-ab: NxK,NxK,... (default: every bench shape)")
    p.add_argument("--variants", default="", help="with --nmajor-ab: only these labels (e.g. new,s8; cuBLAS always)")
    args = p.parse_args()
    import cupy as cp  # noqa: F401
    import torch
    import rtkernels as rtk
    from rtkernels.ops import quant_matmul as qm
    t0 = time.time()
    env = benchutil.environment()
    env["torch"] = torch.__version__
    copy_gbs = benchutil.copy_bandwidth(1 << 30)
    print(f"device copy {copy_gbs:.0f} GB/s ({env['gpu']})", flush=True)
    if args.nmajor_ab:
        ab = nmajor_ab(args, torch, copy_gbs)
        qab = quant_ab(args, torch, copy_gbs) if args.quant_ab else []
        path = benchutil.save(args.out, "gemv_ab", {"environment": env, "copy_GBs": copy_gbs, "nmajor_ab": ab,
                                                    "quant_ab": qab, "seconds": time.time() - t0})
        print(f"\n{env['gpu']} ({env['date']}): device copy {copy_gbs:.0f} GB/s; JSON {path}; {time.time() - t0:.0f} s")
        print(benchutil.table(ab, ["N", "K", "M", "variant", "tiles", "us", "%copy", "vs_cublas", "rel_err"]))
        if qab:
            print("\nint8 weights, % of device copy over the 8-bit bytes (route vs staged slots):")
            print(ab_table(qab, "kind"))
        print("\nN-major bf16 (x @ b), % of device copy (s8: session-8 tiling; new: the sm_90 route's config; "
              "a variant equal to an earlier column: -):")
        print(ab_table(ab, None))
        return
    rows, cache, dcache, failed = [], {}, {}, []
    ms_list = [int(v) for v in args.ms.split(",")]
    reads = {}
    for n, k in SHAPES:
        try:
            reads[(n, k)] = read_case(args, n, k)
            print(f"N={n} K={k} read of the same bytes: {reads[(n, k)]:.1f} us "
                  f"{100 * n * k / (reads[(n, k)] * 1e-6) / 1e9 / copy_gbs:.1f}% copy", flush=True)
        except Exception as e:   # noqa: BLE001
            print(f"N={n} K={k} read: FAILED {type(e).__name__}: {e}"[:300], flush=True)
        for kind in args.kinds.split(","):
            for m in ms_list:
                try:
                    if kind in DENSE:
                        r = run_dense_case(args, torch, rtk, n, k, m, kind, copy_gbs, dcache)
                    else:
                        r = run_case(args, torch, rtk, qm, n, k, m, kind, copy_gbs, cache)
                except Exception as e:   # noqa: BLE001  (report it, keep the other cases' numbers)
                    print(f"N={n} K={k} M={m} {kind}: FAILED {type(e).__name__}: {e}"[:300], flush=True)
                    failed.append({"N": n, "K": k, "M": m, "kind": kind, "error": f"{type(e).__name__}: {e}"})
                    continue
                if (n, k) in reads and kind not in DENSE:   # (the read is of N * K bytes: the 8-bit weight's)
                    r["read_us"] = reads[(n, k)]
                    r["%read"] = 100 * reads[(n, k)] / r["rtk_us"]
                rows.append(r)
                lat = f", latency {r['rtk_lat_us']:.1f} / {r['cublas_lat_us']:.1f} us" if kind in DENSE else ""
                print(f"N={n} K={k} M={m} {kind}: {r['rtk_us']:.1f} us {r['%copy']:.1f}% copy, cuBLAS bf16 "
                      f"{r['cublas_bf16_us']:.1f} us ({r['vs_cublas']:.2f}x), err {r['rel_err']:.1e}{lat}", flush=True)
    cache.clear()
    dcache.clear()
    sweep_rows = []
    if args.sweep:
        try:
            sweep_rows = sweep(args, torch, rtk, qm, copy_gbs)
        except Exception as e:   # noqa: BLE001  (keep the main table)
            print(f"sweep FAILED: {type(e).__name__}: {e}"[:300])
    dense_sweep_rows = []
    if args.sweep_dense:
        try:
            dense_sweep_rows = sweep_dense(args, torch, copy_gbs)
        except Exception as e:   # noqa: BLE001  (keep the main table)
            print(f"dense sweep FAILED: {type(e).__name__}: {e}"[:300])
    path = benchutil.save(args.out, "quant_matmul", {"environment": env, "copy_GBs": copy_gbs, "rows": rows,
                                                     "read_us": {f"{n}x{k}": v for (n, k), v in reads.items()},
                                                     "failed": failed, "sweep": sweep_rows,
                                                     "dense_sweep": dense_sweep_rows, "seconds": time.time() - t0})
    if failed:
        print(f"\n{len(failed)} cases FAILED (first: {failed[0]})")
    if not rows:
        return
    worst = min(rows, key=lambda r: r["%copy"])
    print(f"\n{env['gpu']} ({env['date']}): device copy {copy_gbs:.0f} GB/s; JSON {path}; {time.time() - t0:.0f} s; "
          f"lowest %copy {worst['%copy']:.1f} (N={worst['N']} K={worst['K']} M={worst['M']} {worst['kind']}), "
          f"lowest vs cuBLAS {min(r['vs_cublas'] for r in rows):.2f}x")
    quant = [r for r in rows if r["kind"] not in DENSE]
    dense = [r for r in rows if r["kind"] in DENSE]
    if quant:
        print(benchutil.table(quant, ["N", "K", "M", "kind", "tiles", "rtk_us", "GBs", "%copy", "%read",
                                      "cublas_bf16_us", "vs_cublas", "rel_err"]))
    if dense:
        print("\nbf16 weights: rtk.matmul (GEMV route) vs torch.matmul on the same operands (bf16: b = w.T, "
              "K-major; bf16_n: b (K, N) row-major)")
        print(benchutil.table(dense, ["N", "K", "M", "kind", "tiles", "rtk_us", "%copy", "cublas_bf16_us",
                                      "cublas_%copy", "vs_cublas", "rtk_lat_us", "cublas_lat_us", "rel_err",
                                      "cublas_rel_err"] + (["rtk_tiles_us"] if args.tiles else [])))
    if sweep_rows:
        print(sweep_table(sweep_rows))
    if dense_sweep_rows:
        print("\ndense sweep (% of device copy; * the route's choice):")
        print(benchutil.table([dict(r, tiles=r["tiles"] + ("*" if r["default"] else "")) for r in dense_sweep_rows],
                              ["N", "K", "M", "layout", "tiles", "us", "%copy"]))
    print(compact_table([r for r in rows if r["kind"] not in DENSE], reads, copy_gbs))
    if dense:
        print(compact_dense(dense))


def compact_dense(rows) -> str:
    """bf16 weights: % of device copy of rtk / cuBLAS, and per-call latency rtk / cuBLAS (us), per
    shape (rows) for each layout and M (columns)."""
    cols = sorted({(r["kind"], r["M"]) for r in rows}, key=lambda c: (list(KINDS).index(c[0]), c[1]))
    by = {(r["N"], r["K"], r["kind"], r["M"]): r for r in rows}
    head = ["N x K"] + [f"{kd} M={m}" for kd, m in cols]
    lines = ["\nbf16 weights, rtk / cuBLAS: % of device copy; per-call latency us (bf16 = x @ w.T, bf16_n = x @ b):",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, k in SHAPES:
        cells = [f"{n}x{k}"]
        for kd, m in cols:
            r = by.get((n, k, kd, m))
            cells.append("-" if r is None else f"{r['%copy']:.0f}/{r['cublas_%copy']:.0f}%; "
                                               f"{r['rtk_lat_us']:.0f}/{r['cublas_lat_us']:.0f}")
        if len(cells) > 1 and any(c != "-" for c in cells[1:]):
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(rows) -> str:
    """%copy of each tile candidate (rows, the tag; * marks the heuristic's) at each sweep shape and M."""
    cols = sorted({(r["N"], r["K"], r["M"]) for r in rows}, key=lambda c: (SWEEP_SHAPES.index(c[:2]), c[2]))
    tags = sorted({r["tiles"] for r in rows})
    by = {(r["tiles"], r["N"], r["K"], r["M"]): r for r in rows}
    head = ["tiles"] + [f"{n}x{k} M={m}" for n, k, m in cols]
    lines = ["\nsweep, % of device copy (int8 per-channel; * the heuristic's choice; "
             "tag r row_tiles u unroll w warps k warps_k s split_k c ctas_per_sm p persistent):",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in tags:
        cells = [t]
        for n, k, m in cols:
            r = by.get((t, n, k, m))
            cells.append("-" if r is None else f"{r['%copy']:.1f}{'*' if r['default'] else ''}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compact_table(rows, reads, copy_gbs) -> str:
    """%copy per shape (rows) for each kind and M (columns), and the same-bytes read's %copy."""
    cols = sorted({(r["kind"], r["M"]) for r in rows}, key=lambda c: (list(KINDS).index(c[0]), c[1]))
    head = ["N x K", "read"] + [f"{kd} M={m}" for kd, m in cols]
    lines = ["\n% of device copy (target 85):", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["N"], r["K"], r["kind"], r["M"]): r["%copy"] for r in rows}
    for n, k in SHAPES:
        rd = reads.get((n, k))
        cells = [f"{n}x{k}", f"{100 * n * k / (rd * 1e-6) / 1e9 / copy_gbs:.0f}" if rd else "-"]
        cells += [f"{by[(n, k, kd, m)]:.0f}" if (n, k, kd, m) in by else "-" for kd, m in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
