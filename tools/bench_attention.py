"""Attention forward benchmark: rtk.attention against a Triton FA2-style forward (written here,
the kernel a user would write), PyTorch SDPA (flash and cuDNN backends) and FlashAttention-4
(``flash_attn.cute.flash_attn_func``, when importable: ../shared/anchors/README.md), all in one run.
``ratio_vs_best`` = rtk over the faster of FA4 and SDPA cuDNN (the target is >= 1.0).

On sm_90, rtk.attention runs the Hopper kernel (TMA + wgmma, rtkernels.ops.attention_sm90); the
mma.sync kernel it replaces there is timed beside it as ``fa2``.

FlashAttention's grid: 16k tokens per batch (batch = 16384 / seqlen), hidden 2048 (nheads =
2048 / head_dim), seqlen 512 ... 16k, head dims 64, 128, 256 (+ 80, 96), causal and not.
TFLOP/s = 4 * batch * seqlen_q * seqlen_k * nheads * head_dim / time, halved for causal.
Also: cold compile time of one config and its warm (disk-cache) load time.  Run on the GPU:

    PYTHONPATH=. python tools/bench_attention.py --out results/ [--quick] [--dtype bfloat16]
    PYTHONPATH=. python tools/bench_attention.py --grid fa [--backward] --out results/
        # the issue's grid, rtk / FA4 / SDPA only (forward: head dims 64, 80, 128, 256 x seqlens
        # 512, 1k, 4k, 16k; backward: 64, 128, 192, 256 x 2k, 4k, 16k; causal and not), compact table last
    PYTHONPATH=. python tools/bench_attention.py --fwd-ab --out results/
        # S=4k/16k x head dims 64, 80, 128, 256 x causal/not: the current pick twice, FA4-inspired
        # candidates (FWD_AB_TILES: p_smem, rescale_under_qk, lpt_grid, other tiles), FA4 and SDPA
        # cuDNN interleaved over 5 rounds; a summary per cell last
    PYTHONPATH=. python tools/bench_attention.py --backward [...]    # = tools/bench_attention_bwd.py [...]
    PYTHONPATH=. python tools/bench_attention.py --varlen|--window|--softcap [--backward] [...]
                                                  # = tools/bench_attention_masks.py [...]

The peer table in chunks of well under 60 s (one dtype, one or two head dims, no SDPA, no
fa2 column, the best of the Triton tiles):

    PYTHONPATH=. python tools/bench_attention.py --dtype float16 --head-dims 128 --seqlens 2048,4096,8192,16384 \
        --no-sdpa --no-fa2 --no-compile-time

Kernels are timed back to back (median over batches of launches, :func:`benchutil.time_batched`), so host
launch costs - Triton's Python launcher's most of all - hide behind the GPU work; every candidate of a cell
is timed in turn over rounds (:func:`benchutil.time_interleaved`, ``--rounds``), so clock drift hits all alike.

Every (seqlen, head_dim) set holds 16k x 2048 elements per tensor (64 MiB in 16 bits), more
than L2 holds, so inputs are not rotated.  Each kernel is checked against the others' output
once before it is timed.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402

TOKENS = 16384
HIDDEN = 2048


def _flops(batch, sq, sk, h, d, causal):
    f = 4.0 * batch * sq * sk * h * d
    return f / 2 if causal else f


def _inputs(batch, s, h, d, dtype, torch, count=3):
    """``count`` arrays (q, k, v[, do]) of (batch, seqlen, nheads, head_dim): torch tensors when
    torch is present (the same memory serves every peer), else CuPy (bfloat16 as uint16 bits)."""
    import cupy as cp
    shape = (batch, s, h, d)
    if torch is not None:
        tdt = getattr(torch, dtype)
        return [torch.randn(shape, device="cuda", dtype=tdt) for _ in range(count)]
    xs = [cp.random.standard_normal(shape, dtype=cp.float32) for _ in range(count)]
    if dtype == "bfloat16":
        return [((x.view(cp.uint32) + 0x8000) >> 16).astype(cp.uint16) for x in xs]
    return [x.astype(dtype) for x in xs]


def _ours(q, k, v, causal, dtype, torch, hopper=True):
    """A launcher bound to prepared arguments: the timed loop measures the kernel, not Python.
    ``hopper``: the kernel rtk.attention dispatches to (the sm_90 one where eligible); False:
    the mma.sync kernel."""
    import cupy as cp
    import importlib
    A = importlib.import_module("rtkernels.ops.attention")   # the module, not the re-exported function
    H = importlib.import_module("rtkernels.ops.attention_sm90")
    extra = {} if torch is not None else ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})
    enabled, H.ENABLED = H.ENABLED, hopper
    try:
        o, _ = A.attention(q, k, v, causal=causal, **extra)     # compiles, checks, allocates once
    finally:
        H.ENABLED = enabled
    as_cp = _as_cupy(torch)
    qc, kc, vc, oc = (as_cp(t) for t in (q, k, v, o))
    b, s, h, d = qc.shape
    arch = A._device_arch(cp.cuda.runtime.getDevice())
    lse = cp.empty((b, h, s), cp.float32)
    stream = torch.cuda.current_stream().cuda_stream if torch else None
    if hopper and H.eligible(arch, (qc, kc, vc, oc), kc.shape[1]):
        kern, cfg = H.kernel_for(dtype, d, causal, arch, seqlen_k=kc.shape[1])   # as rtk.attention chooses
        launch = H.recorded_launch(kern, cfg, qc, kc, 1.0 / d ** 0.5)
        arrays = (*H.tensor_maps(cfg, qc, kc, vc, oc), lse)
        tag = "sm90 " + _short90(cfg)

        def run():
            launch.run(arrays, stream)
        return run, o, tag
    kern, cfg = A._kernel_for(dtype, d, causal, arch)
    st = [x.strides[i] // x.itemsize for x in (qc, kc, vc, oc) for i in range(3)]
    grid = (-(-s // cfg.block_m), h, b)
    # then the options' arguments, off: cu_seqlens, schedule, heads, window, softcap
    args = (qc, kc, vc, oc, lse, s, kc.shape[1], h // kc.shape[2], *st, 1.0 / d ** 0.5, None, None, None, h, 0, 0,
            0.0)
    tag = f"fa2 {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"

    def run():
        kern.launch(grid, (cfg.threads_per_block,), *args, shared_mem=cfg.shared_mem_bytes, stream=stream)
    return run, o, tag


# ---- Triton peer: a FlashAttention-2 forward as a user would write it --------------------
_TRITON = None


def _triton_kernel():
    """Built on first use (triton imported only here); None when triton is absent."""
    global _TRITON
    if _TRITON is not None:
        return _TRITON or None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _TRITON = False
        return None

    @triton.jit
    def fa_fwd(Q, K, V, O, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, seqlen_q, seqlen_k,
               kv_group, scale_log2, CAUSAL: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, EVEN: tl.constexpr):
        pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = tl.arange(0, BN)
        rd = tl.arange(0, BD)
        dm = rd < D
        q = tl.load(Q + b * sqb + h * sqh + rm[:, None] * sqs + rd[None, :],
                    mask=(rm[:, None] < seqlen_q) & dm[None, :], other=0.0)
        kp = K + b * skb + (h // kv_group) * skh + rd[:, None]
        vp = V + b * svb + (h // kv_group) * svh + rd[None, :]
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BD], tl.float32)
        diag = seqlen_k - seqlen_q
        hi = tl.minimum(seqlen_k, (pid_m + 1) * BM + diag) if CAUSAL else seqlen_k
        full = tl.minimum(hi, pid_m * BM + diag + 1) // BN * BN if CAUSAL else seqlen_k // BN * BN
        for start in range(0, hi, BN):       # tiles before `full` need no mask
            cols = start + rn
            if EVEN:   # seqlen_k a multiple of BN and D a power of two: no load masks
                k = tl.load(kp + cols[None, :] * sks)
                v = tl.load(vp + cols[:, None] * svs)
            else:
                k = tl.load(kp + cols[None, :] * sks, mask=(cols[None, :] < seqlen_k) & dm[:, None], other=0.0)
                v = tl.load(vp + cols[:, None] * svs, mask=(cols[:, None] < seqlen_k) & dm[None, :], other=0.0)
            s = tl.dot(q, k) * scale_log2
            if start >= full:
                ok = cols[None, :] < seqlen_k
                if CAUSAL:
                    ok = ok & (cols[None, :] <= rm[:, None] + diag)
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + b * sob + h * soh + rm[:, None] * sos + rd[None, :], acc.to(O.dtype.element_ty),
                 mask=(rm[:, None] < seqlen_q) & dm[None, :])

    _TRITON = (triton, fa_fwd)
    return _TRITON


# Per head dim: (BM, BN, num_warps, num_stages) candidates; the first is used in --quick, all are
# timed otherwise and the best kept (the triton tutorial's autotuning, done by hand so it is timed
# outside the measured loop).
_TRITON_TILES = {64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4)],
                 128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3)],
                 256: [(64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)]}


def _triton(q, k, v, causal, torch, quick, max_tiles=None):
    tk = _triton_kernel()
    if tk is None or torch is None:
        return None, "triton not importable"
    triton, kern = tk
    b, s, h, d = q.shape
    o = torch.empty_like(q)
    bd = triton.next_power_of_2(d)
    key = 64 if d <= 64 else (128 if d <= 128 else 256)
    tiles = _TRITON_TILES[key][:max_tiles or (1 if quick else None)]
    st = [x.stride(i) for x in (q, k, v, o) for i in range(3)]

    def bind(bm, bn, w, stages):
        def run():
            kern[(triton.cdiv(s, bm), h, b)](q, k, v, o, *st, s, k.shape[1], h // k.shape[2],
                                             (1.0 / d ** 0.5) * 1.4426950408889634, CAUSAL=causal, D=d, BD=bd,
                                             BM=bm, BN=bn, EVEN=(k.shape[1] % bn == 0 and bd == d),
                                             num_warps=w, num_stages=stages)
        return run
    best = None
    for t in tiles:
        run = bind(*t)
        try:
            run()
        except Exception:   # noqa: BLE001  (out of shared memory for this tile, ...)
            continue
        ms = bu.time_batched(run, warmup=2, repeat=5) if len(tiles) > 1 else 0.0
        if best is None or ms < best[0]:
            best = (ms, run, t)
    if best is None:
        return None, "no triton tile compiled"
    return best[1], (o, "triton {}x{} w{} s{}".format(*best[2]))


def _sdpa(q, k, v, causal, backend, torch):
    from torch.nn.attention import sdpa_kernel
    F = torch.nn.functional
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))   # (b, h, s, d) views of the same memory

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    try:
        out = run()
    except RuntimeError as exc:   # backend refuses this shape/dtype/GPU
        return None, str(exc).splitlines()[0][:80]
    return run, out.transpose(1, 2)


def _fa4(q, k, v, causal, torch):
    """FlashAttention-4's forward as (run, out), or (None, why) when absent or refusing the cell.
    The call here compiles its kernel for this configuration (2-6 s), outside the timing."""
    fn = bu.fa4()[0]
    if fn is None or torch is None:
        return None, "FA4 not importable"

    def run():
        return fn(q, k, v, causal=causal)
    try:
        out = bu.first(run())
    except Exception as exc:   # noqa: BLE001  (a head dim, dtype or GPU it refuses)
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    return run, out


# FlashAttention's benchmark grid as issue 24 sets its targets (16k tokens, hidden 2048), per direction
FA_GRID = {"forward": {"head_dims": "64,80,128,256", "seqlens": "512,1024,4096,16384"},
           "backward": {"head_dims": "64,128,192,256", "seqlens": "2048,4096,16384"}}
# the compact table printed last with --grid fa
COMPACT = ["head_dim", "causal", "seqlen", "rtk_tflops", "fa4_tflops", "sdpa_cudnn_tflops", "best_peer",
           "ratio_vs_best"]


def _max_diff(a, b, torch):
    import cupy as cp
    if torch is not None:
        return float((a.float() - b.float()).abs().max())
    return float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max())


def compile_times(dtype: str) -> dict:
    from rtkernels import device
    from rtkernels.ops import attention_sm90
    from rtkernels.ops.attention import AttentionConfig
    if attention_sm90.is_sm90(device.current_arch()):   # what rtk.attention runs at d128 there
        cfg = attention_sm90.choose_config(dtype, 128, False)
    else:
        cfg = AttentionConfig(dtype=dtype, head_dim=128, causal=False, block_m=128, block_n=64, num_warps=4,
                              num_stages=1)
    return bu.compile_times(cfg)


def tune(head_dims, dtype: str, torch, seqlen: int = 4096) -> list[dict]:
    """Autotune each (head_dim, causal) at one seqlen and report heuristic vs best tile: the data the
    heuristics table is set from."""
    import importlib
    from rtkernels import autotune
    A = importlib.import_module("rtkernels.ops.attention")
    import dataclasses
    import cupy as cp
    from rtkernels import inspect as rinspect
    arch = A._device_arch(cp.cuda.runtime.getDevice())
    # prebuild every candidate in parallel worker processes (they land in the disk cache the tuner reads)
    params = [{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
              for d in head_dims for causal in (False, True) for c in A.tile_space(dtype, d, causal, arch)]
    t0 = __import__("time").perf_counter()
    rinspect.sweep("attention", params, arch=arch, jobs=min(16, os.cpu_count() or 1))
    print(f"prebuilt {len(params)} candidates in {__import__('time').perf_counter() - t0:.1f} s", flush=True)
    os.environ["RTKERNELS_AUTOTUNE"] = "1"
    rows = []
    try:
        for d in head_dims:
            h = HIDDEN // d
            b = max(1, TOKENS // seqlen)
            for causal in (False, True):
                q, k, v = _inputs(b, seqlen, h, d, dtype, torch)
                extra = {} if torch is not None else ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})
                A.attention(q, k, v, causal=causal, **extra)           # runs the tuner for this key
                flops = _flops(b, seqlen, seqlen, h, d, causal)
                heur = A.choose_config(dtype, d, causal, arch)
                key = autotune.make_key("attention", {"dtype": dtype, "head_dim": d, "causal": causal, "arch": arch,
                                                      "seqlen_q": A._seqlen_bucket(seqlen),
                                                      "seqlen_k": A._seqlen_bucket(seqlen)})
                timings = autotune.load().get(key, {}).get("timings", {})
                ranked = sorted(timings.items(), key=lambda kv: kv[1])
                row = {"head_dim": d, "causal": causal, "seqlen": seqlen,
                       "heuristic": _short(heur), "heuristic_tflops": flops / (timings.get(heur.key(), float("nan")) * 1e-3) / 1e12}
                for i, (ck, ms) in enumerate(ranked[:3]):
                    row[f"best{i + 1}"] = _short_key(ck)
                    row[f"best{i + 1}_tflops"] = flops / (ms * 1e-3) / 1e12
                row["all"] = {_short_key(ck): flops / (ms * 1e-3) / 1e12 for ck, ms in ranked}
                rows.append(row)
                print(row, flush=True)
                del q, k, v
    finally:
        os.environ.pop("RTKERNELS_AUTOTUNE", None)
    return rows


def parse_tiles(spec: str) -> list[dict]:
    """``"192x112ov,128x128ovpp,128x64s3,128x128ovpppst"`` -> attention_sm90 tile fields (``ov``:
    intra_overlap, ``pp``: pingpong, ``sN``: num_stages, ``early``: softmax_under_pv=False, ``pst``:
    persistent, ``flat``: flat_walk, e.g. 128x128ovpstflat; ``l2``: l2_walk (causal cells only), e.g.
    64x64ovpstl2c2; ``cN``: ctas_per_sm, e.g. 64x128ovpstc2; ``rq``: rescale_under_qk, e.g. 128x80ovrq;
    ``ps``: p_smem, e.g. 192x128ovps;
    ``lpt``: lpt_grid (causal cells only), e.g. 128x80ovpplpt)."""
    import re
    out = []
    for tok in filter(None, (t.strip() for t in spec.split(","))):
        m = re.fullmatch(r"(\d+)x(\d+)(?:s(\d))?(ov)?(pp)?(early)?(rq)?(ps)?(pst)?(flat)?(l2)?(?:c(\d))?(lpt)?", tok)
        if not m:
            raise SystemExit(f"--tiles: {tok!r} is not BMxBN[sS][ov][pp][early][rq][ps][pst][flat][l2][cN][lpt], "
                             "e.g. 192x112ov, 128x128ovpppst, 64x128ovpstc2, 192x128ovps or 128x80ovrqlpt")
        out.append(dict(block_m=int(m[1]), block_n=int(m[2]), num_stages=int(m[3] or 2), intra_overlap=bool(m[4]),
                        pingpong=bool(m[5]), softmax_under_pv=not m[6], rescale_under_qk=bool(m[7]),
                        p_smem=bool(m[8]), persistent=bool(m[9]), flat_walk=bool(m[10]), l2_walk=bool(m[11]),
                        ctas_per_sm=int(m[12] or 1), lpt_grid=bool(m[13])))
    return out


def tune_sm90(head_dims, dtype: str, torch, seqlen: int = 4096, save=None, tiles=None,
              causals=(False, True)) -> list[dict]:
    """Time every tile of attention_sm90.tile_space (or the heuristic's plus ``tiles``) at one seqlen
    (the data its heuristics table is set from); spilling candidates are dropped after compiling,
    all compiled in parallel first."""
    import cupy as cp
    from concurrent.futures import ThreadPoolExecutor
    import rtkernels as rtk
    from rtkernels.ops import attention_sm90 as H
    cands = [c for d in head_dims for causal in causals for c in H.tile_space(dtype, d, causal, tiles)]

    def build(c):
        try:
            k = rtk.get_kernel(c, arch="sm_90a")
        except Exception as exc:   # noqa: BLE001
            return c, None, str(exc).splitlines()[0]
        r = k.resources
        return c, (None if r.spill_stores or r.spill_loads or r.stack_frame else k), f"{r.spill_stores} B spilled"
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as ex:
        built = list(ex.map(build, cands))
    print(f"built {len(built)} sm90 candidates in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for d in head_dims:
        h, b = HIDDEN // d, max(1, TOKENS // seqlen)
        q, k, v = _inputs(b, seqlen, h, d, dtype, torch)
        as_cp = _as_cupy(torch)
        qc, kc, vc = (as_cp(t) for t in (q, k, v))
        oc = cp.empty_like(qc)
        lse = cp.empty((b, h, seqlen), cp.float32)
        for causal in causals:
            heur = H.choose_config(dtype, d, causal)
            flops = _flops(b, seqlen, seqlen, h, d, causal)
            for c, kern, note in built:
                if c.head_dim != d or c.causal != causal:
                    continue
                row = {"head_dim": d, "causal": causal, "tile": _short90(c), "heuristic": c == heur}
                if kern is None:
                    row["note"] = note
                else:
                    ms = bu.time_batched(sm90_runner(kern, c, qc, kc, vc, oc, lse), warmup=2, repeat=7)
                    row["tflops"] = flops / (ms * 1e-3) / 1e12
                rows.append(row)
                print(row, flush=True)
        del q, k, v, qc, kc, vc, oc
        if save:
            save(rows)   # after each head dim: a run cut short still leaves its data
    return rows


def sm90_runner(kern, cfg, qc, kc, vc, oc, lse):
    """A launcher of one attention_sm90 config with its tensor maps encoded and launch recorded once
    (a persistent config's grid from the device's SM count)."""
    from rtkernels.ops import attention_sm90 as H
    maps, scale = H.tensor_maps(cfg, qc, kc, vc, oc), 1.0 / qc.shape[3] ** 0.5
    la, arrays = H.recorded_launch(kern, cfg, qc, kc, scale), (*maps, lse)
    return lambda: la.run(arrays, None)


def persistent_ab(head_dims, seqlens, dtype: str, torch, tiles=None, causals=(False, True), rounds: int = 3,
                  save=None) -> list[dict]:
    """The same tile with persistent off and on (attention_sm90.persistent), per (head_dim, causal,
    seqlen) on FlashAttention's grid (batch = 16k / seqlen, heads = 2048 / head_dim): the heuristic's
    tile plus ``tiles``; the two interleaved over ``rounds`` (median of each), outputs compared."""
    import statistics
    import cupy as cp
    from concurrent.futures import ThreadPoolExecutor
    import rtkernels as rtk
    from rtkernels.ops import attention_sm90 as H
    from rtkernels.errors import ConfigError
    pairs = []
    for d in head_dims:
        for causal in causals:
            for c in H.tile_space(dtype, d, causal, [dict(t, persistent=False) for t in (tiles or [])]):
                if c.persistent:
                    continue
                try:
                    pairs.append((c, c.replace(persistent=True)))
                except ConfigError as exc:
                    pairs.append((c, str(exc).splitlines()[0]))

    def build(c):
        if isinstance(c, str):
            return None, c
        try:
            k = rtk.get_kernel(c, arch="sm_90a")
        except Exception as exc:   # noqa: BLE001
            return None, str(exc).splitlines()[0]
        r = k.resources
        return (None, f"{r.spill_stores} B spilled") if (r.spill_stores or r.spill_loads or r.stack_frame) else (k, "")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as ex:
        built = list(ex.map(lambda pc: (build(pc[0]), build(pc[1])), pairs))
    print(f"built {2 * len(pairs)} sm90 candidates in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    as_cp = _as_cupy(torch)
    for d in head_dims:
        for s in seqlens:
            h, b = HIDDEN // d, max(1, TOKENS // s)
            q, k, v = _inputs(b, s, h, d, dtype, torch)
            qc, kc, vc = (as_cp(t) for t in (q, k, v))
            outs = [cp.empty_like(qc), cp.empty_like(qc)]
            lse = cp.empty((b, h, s), cp.float32)
            for causal in causals:
                flops = _flops(b, s, s, h, d, causal)
                heur = H.choose_config(dtype, d, causal)
                for (plain, pst), ((kp, notep), (kq, noteq)) in zip(pairs, built):
                    if plain.head_dim != d or plain.causal != causal:
                        continue
                    row = {"head_dim": d, "causal": causal, "seqlen": s, "batch": b, "tile": _short90(plain),
                           "heuristic": plain == heur}
                    if kp is None or kq is None:
                        row["note"] = f"plain: {notep}" if kp is None else f"persistent: {noteq}"
                        rows.append(row)
                        print(row, flush=True)
                        continue
                    row["q_buffers"] = pst.q_buffers
                    runs = [sm90_runner(kp, plain, qc, kc, vc, outs[0], lse),
                            sm90_runner(kq, pst, qc, kc, vc, outs[1], lse)]
                    for r in runs:
                        r()
                    cp.cuda.get_current_stream().synchronize()
                    a, bb = (o.view(cp.uint16).astype(cp.uint32) << 16 if dtype == "bfloat16" else o for o in outs)
                    if dtype == "bfloat16":
                        a, bb = a.view(cp.float32), bb.view(cp.float32)
                    row["max_diff"] = float(cp.abs(a.astype(cp.float32) - bb.astype(cp.float32)).max())
                    ms = [[], []]
                    for _ in range(rounds):   # interleaved: clocks and neighbours drift alike for both
                        for i, r in enumerate(runs):
                            ms[i].append(bu.time_batched(r, warmup=1, repeat=3))
                    row["plain_tflops"] = flops / (statistics.median(ms[0]) * 1e-3) / 1e12
                    row["pst_tflops"] = flops / (statistics.median(ms[1]) * 1e-3) / 1e12
                    row["pst_vs_plain"] = row["pst_tflops"] / row["plain_tflops"]
                    rows.append(row)
                    print(row, flush=True)
            del q, k, v, qc, kc, vc, outs
            if save:
                save(rows)
    return rows


# --short-ab: schedules for short problems, per cell (tiles chosen for the causal diagonal's waste and
# the per-query-tile fixed cost; see attention_sm90.SHORT_SCHEDULE)
SHORT_TILES = "128x128ov,128x128ovpst,128x64ov,128x64ovpst,128x64s3ovpst,64x128ov,64x128ovpst,192x64ov,192x64ovpst"


def _as_cupy(torch):
    """torch tensor -> CuPy array (bfloat16 as int16, CuPy having no bfloat16); identity without torch."""
    import cupy as cp
    if torch is None:
        return lambda t: t
    return lambda t: cp.from_dlpack(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)


def _as_f32(x, dtype: str):
    """A float16 array, or bfloat16 bits held as 16-bit integers, as float32 (for max-diff checks)."""
    import cupy as cp
    if dtype == "bfloat16":
        return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return x.astype(cp.float32)


def _build_sm90(configs) -> dict:
    """config -> (kernel or None, note): each candidate compiled for sm_90a in parallel; a build that
    fails or spills is kept with its note (the A/B tables show why a cell is empty)."""
    from concurrent.futures import ThreadPoolExecutor
    import rtkernels as rtk

    def build(c):
        try:
            k = rtk.get_kernel(c, arch="sm_90a")
        except Exception as exc:   # noqa: BLE001
            return c, None, str(exc).splitlines()[0][:80]
        r = k.resources
        spilled = r.spill_stores or r.spill_loads or r.stack_frame
        return c, (None if spilled else k), (f"{r.spill_stores} B spilled" if spilled else "")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as ex:
        built = {c: (k, note) for c, k, note in ex.map(build, configs)}
    print(f"built {len(configs)} sm90 candidates in {time.perf_counter() - t0:.1f} s", flush=True)
    return built

def short_ab(head_dims, seqlens, dtype: str, torch, peers, causals=(False, True), rounds: int = 3,
             tiles: str = SHORT_TILES, changed_only: bool = False) -> list[dict]:
    """Per (head_dim, causal, seqlen) on FlashAttention's grid: the per-head-dim config (old), the
    per-call choice (new: attention_sm90.kernel_for with the call's seqlen_k), the heuristic's tile
    persistent, ``tiles`` plain and persistent, and SDPA cuDNN - interleaved over ``rounds`` (median),
    every output compared with the old config's.  A row per candidate.  ``changed_only``: only the
    cells where new differs from old, timing old, new, old again (the run's noise) and cuDNN."""
    import cupy as cp
    from rtkernels.ops import attention_sm90 as H
    from rtkernels.errors import ConfigError
    extra = parse_tiles(tiles)
    cells = {}
    for d in head_dims:
        for causal in causals:
            for s in seqlens:
                old = H.choose_config(dtype, d, causal)
                new = H.choose_config(dtype, d, causal, seqlen_k=s)
                if changed_only:
                    if new != old:
                        cells[(d, causal, s)] = [("old", old), ("new", new), ("old again", old)]
                    continue
                cands = [("old", old), ("new", new)]
                try:
                    cands.append(("heur pst", old.replace(persistent=True, pingpong=False)))
                except ConfigError:
                    pass
                for t in extra:
                    try:
                        c = H.AttentionSm90Config(dtype=dtype, head_dim=d, causal=causal, **t)
                    except ConfigError:
                        continue
                    cands.append((_short90(c), c))
                seen, uniq = set(), []
                for name, c in cands:
                    if c not in seen or name in ("old", "new"):
                        seen.add(c)
                        uniq.append((name, c))
                cells[(d, causal, s)] = uniq
    configs = list(dict.fromkeys(c for v in cells.values() for _, c in v))
    if not configs:
        print("no cell to time (changed_only: the per-call choice is the per-head-dim config everywhere)")
        return []
    built = _build_sm90(configs)
    as_cp = _as_cupy(torch)
    rows = []
    for d in head_dims:
        for s in seqlens:
            if not any((d, causal, s) in cells for causal in causals):
                continue
            h, b = HIDDEN // d, max(1, TOKENS // s)
            q, k, v = _inputs(b, s, h, d, dtype, torch)
            qc, kc, vc = (as_cp(t) for t in (q, k, v))
            lse = cp.empty((b, h, s), cp.float32)
            for causal in causals:
                if (d, causal, s) not in cells:
                    continue
                flops = _flops(b, s, s, h, d, causal)
                runs, names, crow = [], [], []
                ref = None
                for name, c in cells[(d, causal, s)]:
                    kern, note = built[c]
                    row = {"head_dim": d, "causal": causal, "seqlen": s, "batch": b, "cand": name,
                           "tile": _short90(c)}
                    if kern is None:
                        row["note"] = note
                        rows.append(row)
                        continue
                    oc = cp.empty_like(qc)
                    r = sm90_runner(kern, c, qc, kc, vc, oc, lse)
                    r()
                    cp.cuda.get_current_stream().synchronize()
                    if ref is None:
                        ref = oc
                    else:
                        row["max_diff_vs_old"] = float(cp.abs(_as_f32(ref, dtype) - _as_f32(oc, dtype)).max())
                    runs.append(r)
                    names.append(row)
                    crow.append(row)
                if "sdpa_cudnn" in peers and torch is not None:
                    run, _ = _sdpa(q, k, v, causal, peers["sdpa_cudnn"], torch)
                    if run is not None:
                        runs.append(run)
                        names.append({"head_dim": d, "causal": causal, "seqlen": s, "batch": b, "cand": "cudnn",
                                      "tile": "SDPA cuDNN"})
                for row, ms in zip(names, bu.time_interleaved(runs, rounds)):
                    row["tflops"] = flops / (ms * 1e-3) / 1e12
                old_t = names[0]["tflops"]
                cud = next((r["tflops"] for r in names if r["cand"] == "cudnn"), None)
                for row in names:
                    row["vs_old"] = row["tflops"] / old_t
                    if cud:
                        row["vs_cudnn"] = row["tflops"] / cud
                    rows.append(row)
                    print(row, flush=True)
            del q, k, v, qc, kc, vc
    return rows


# --fwd-ab: the long cells against FA4.  Candidates beside the current pick: FA4's sm90 choices
# (flash_attn/cute/interface.py _tile_size_fwd_sm90 + flash_fwd_sm90.py: d64 192x128 P in registers,
# intra-warpgroup overlap and the warp-scheduler barrier between warpgroups (our pingpong); d80 192x144
# (causal 192x128), P through shared memory (our ps; 192x144 does not fit beside our 128-column d80
# tiles), overlap, barrier; d128 128x128 registers, overlap, barrier;
# d256 128x80, overlap, no barrier, O rescaled under the QK GEMM (our rq); 2 stages everywhere; causal in
# the LPT order (our lpt)) and the neighbours they suggest.  Causal cells also time every non-persistent
# candidate with lpt_grid.  Keyed by (largest head dim of the class, causal).
FWD_AB_TILES = {
    (64, False): "192x128ovpp,192x128ovrq,192x112ov,192x144ovps,192x144ovppps",
    (64, True): "192x128ov,192x128ovpp,192x112ovpp",
    (96, False): "192x128ovps,192x128ovppps,192x112ov,192x112ovpp,192x112ovps,128x128ovpp",
    (96, True): "192x128ovps,192x128ovppps,192x112ovps",
    (128, False): "128x128ovpp,128x176ovpp,128x144ovpp,128x128ovpprq,192x128ovps,192x112ovps",
    (128, True): "128x128ovpp,128x128ovpprq,128x128ov",
    (256, False): "128x80ov,128x80ovrq,128x80ovpprq,128x64ovpp",
    (256, True): "128x80ov,128x80ovrq,128x80ovpprq",
}


def _fwd_ab_specs(head_dim: int, causal: bool) -> str:
    cls = next(c for c in (64, 96, 128, 256) if head_dim <= c)
    return FWD_AB_TILES[(cls, causal)]


def _fits(H, dtype: str, head_dim: int, causal: bool, fields: dict):
    """The config of tile ``fields`` (lpt_grid dropped: added per cell), or None where it does not
    fit shared memory at this head dim."""
    from rtkernels.errors import ConfigError
    try:
        return H.AttentionSm90Config(dtype=dtype, head_dim=head_dim, causal=causal,
                                     **{k: v for k, v in fields.items() if k != "lpt_grid"})
    except ConfigError:
        return None


def fwd_ab(head_dims, seqlens, dtype: str, torch, peers, causals=(False, True), rounds: int = 5,
           tiles: str | None = None) -> list[dict]:
    """Per (head_dim, causal, seqlen) on FlashAttention's grid: the current pick ("cur":
    attention_sm90.choose_config with the call's seqlen_k, what rtk.attention runs), the same config
    again ("cur again": the run's noise), the candidates of :data:`FWD_AB_TILES` (or ``tiles``), each
    causal one-CTA-per-tile one also with lpt_grid, FA4 and SDPA cuDNN - interleaved over ``rounds``
    (median), every rtk output (NaN-poisoned first) compared with cur's and FA4's.  A row per
    candidate; spilling builds get a note instead of a time."""
    import cupy as cp
    from rtkernels.ops import attention_sm90 as H
    cells = {}
    for d in head_dims:
        for causal in causals:
            specs = [c for c in (_fits(H, dtype, d, causal, t) for t in parse_tiles(tiles or _fwd_ab_specs(d, causal)))
                     if c is not None]
            for s in seqlens:
                cur = H.choose_config(dtype, d, causal, seqlen_k=s)
                extra = list(specs)
                if causal:   # each one-CTA-per-tile candidate in the LPT order too
                    extra += [c.replace(lpt_grid=True) for c in [cur] + specs if not c.persistent]
                cands, seen = [("cur", cur), ("cur again", cur)], {cur}
                for c in extra:
                    if c not in seen:
                        seen.add(c)
                        cands.append((_short90(c), c))
                cells[(d, causal, s)] = cands
    configs = list(dict.fromkeys(c for v in cells.values() for _, c in v))
    built = _build_sm90(configs)
    as_cp = _as_cupy(torch)
    as_f32 = lambda x: _as_f32(x, dtype)   # noqa: E731
    rows = []
    for d in head_dims:
        for s in seqlens:
            h, b = HIDDEN // d, max(1, TOKENS // s)
            q, k, v = _inputs(b, s, h, d, dtype, torch)
            qc, kc, vc = (as_cp(t) for t in (q, k, v))
            lse = cp.empty((b, h, s), cp.float32)
            for causal in causals:
                flops = _flops(b, s, s, h, d, causal)
                head = {"head_dim": d, "causal": causal, "seqlen": s, "batch": b}
                peer_runs = []   # (cand, label, run, output or None)
                if torch is not None:
                    frun, fout = _fa4(q, k, v, causal, torch)
                    if frun is not None:
                        peer_runs.append(("fa4", "FA4", frun, as_cp(fout.contiguous())))
                    if "sdpa_cudnn" in peers:
                        crun, _ = _sdpa(q, k, v, causal, peers["sdpa_cudnn"], torch)
                        if crun is not None:
                            peer_runs.append(("cudnn", "SDPA cuDNN", crun, None))
                fa4_out = next((o for n, _, _, o in peer_runs if n == "fa4"), None)
                runs, named, ref = [], [], None
                for name, c in cells[(d, causal, s)]:
                    kern, note = built[c]
                    row = dict(head, cand=name, tile=_short90(c))
                    if kern is None:
                        row["note"] = note
                        rows.append(row)
                        print(row, flush=True)
                        continue
                    oc = cp.empty_like(qc)
                    oc.view(cp.uint16).fill(0x7FFF)   # NaN bytes: a row never stored shows in the diffs
                    r = sm90_runner(kern, c, qc, kc, vc, oc, lse)
                    r()
                    cp.cuda.get_current_stream().synchronize()
                    if ref is None:
                        ref = oc
                    else:
                        row["max_diff_vs_cur"] = float(cp.abs(as_f32(ref) - as_f32(oc)).max())
                    if fa4_out is not None:
                        row["max_diff_vs_fa4"] = float(cp.abs(as_f32(fa4_out) - as_f32(oc)).max())
                    runs.append(r)
                    named.append(row)
                for name, label, run, _ in peer_runs:
                    runs.append(run)
                    named.append(dict(head, cand=name, tile=label))
                for row, ms in zip(named, bu.time_interleaved(runs, rounds)):
                    row["tflops"] = flops / (ms * 1e-3) / 1e12
                get = lambda n: next((r["tflops"] for r in named if r["cand"] == n), None)   # noqa: E731
                cur_t, fa4_t, cud_t = get("cur"), get("fa4"), get("cudnn")
                for row in named:
                    if cur_t:
                        row["vs_cur"] = row["tflops"] / cur_t
                    if fa4_t:
                        row["vs_fa4"] = row["tflops"] / fa4_t
                    if cud_t:
                        row["vs_cudnn"] = row["tflops"] / cud_t
                    rows.append(row)
                    print(row, flush=True)
                del ref
            del q, k, v, qc, kc, vc
    return rows


def _ab_cells(rows, peers):
    """Per (head_dim, causal, seqlen) cell of an A/B run with an rtk candidate timed: (key, the cell's
    timed rows, a candidate -> TFLOP/s lookup, the fastest rtk row); ``peers``: the peer candidates."""
    for key in dict.fromkeys((r["head_dim"], r["causal"], r["seqlen"]) for r in rows):
        cell = [r for r in rows if (r["head_dim"], r["causal"], r["seqlen"]) == key and "tflops" in r]
        rtk_rows = [r for r in cell if r["cand"] not in peers]
        if rtk_rows:
            yield (key, cell, lambda n, cell=cell: next((r["tflops"] for r in cell if r["cand"] == n), None),
                   max(rtk_rows, key=lambda r: r["tflops"]))


def fwd_ab_summary(rows) -> list[dict]:
    """One line per cell: cur, cur again (the noise), the best rtk candidate, FA4, cuDNN, ratios."""
    out = []
    for key, cell, get, best in _ab_cells(rows, ("fa4", "cudnn")):
        cur, fa4, cud = get("cur"), get("fa4"), get("cudnn")
        peer = max((x for x in (fa4, cud) if x), default=None)
        out.append({"head_dim": key[0], "causal": key[1], "seqlen": key[2],
                    "cur_tile": next((r["tile"] for r in cell if r["cand"] == "cur"), None), "cur": cur,
                    "cur_again": get("cur again"), "best_tile": best["tile"], "best": best["tflops"],
                    "fa4": fa4, "cudnn": cud,
                    "cur_vs_peer": cur / peer if cur and peer else None,
                    "best_vs_peer": best["tflops"] / peer if peer else None,
                    "best_vs_cur": best["tflops"] / cur if cur else None})
    return out


def short_summary(rows) -> list[dict]:
    """One line per cell: old, new, the best rtk candidate, cuDNN, and the ratios the issue asks."""
    out = []
    for key, cell, get, best in _ab_cells(rows, ("cudnn",)):
        old, new, cud = get("old"), get("new"), get("cudnn")
        out.append({"head_dim": key[0], "causal": key[1], "seqlen": key[2], "old": old, "new": new,
                    "old_again": get("old again"),
                    "old_tile": next(r["tile"] for r in cell if r["cand"] == "old"),
                    "new_tile": next(r["tile"] for r in cell if r["cand"] == "new"),
                    "best": best["tflops"], "best_tile": best["tile"], "cudnn": cud,
                    "new_vs_old": new / old if old and new else None,
                    "new_vs_cudnn": new / cud if cud and new else None,
                    "best_vs_cudnn": best["tflops"] / cud if cud else None})
    return out


def _short90(c) -> str:
    return (f"{c.block_m}x{c.block_n} s{c.num_stages}" + (" ov" if c.intra_overlap else "")
            + (" pp" if c.pingpong else "") + ("" if c.softmax_under_pv or not c.intra_overlap else " early")
            + (" rq" if c.rescale_under_qk else "") + (" ps" if c.p_smem else "")
            + (" pst" if c.persistent else "") + (" flat" if c.flat_walk else "") + (" l2" if c.l2_walk else "")
            + (f" c{c.ctas_per_sm}" if c.ctas_per_sm > 1 else "") + (" lpt" if c.lpt_grid else ""))


def _short(cfg) -> str:
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + (" qreg" if cfg.q_in_regs else "")


def _short_key(key: str) -> str:
    import re
    f = dict(re.findall(r"(\w+)=([^,)]+)", key))
    return f"{f['block_m']}x{f['block_n']} w{f['num_warps']} s{f['num_stages']}" + (
        " qreg" if f.get("q_in_regs") == "True" else "")


def main():
    if any(a in sys.argv[1:] for a in ("--varlen", "--window", "--softcap")):
        # variable-length batches, sliding windows, softcap (forward, or --backward) against their
        # peers: tools/bench_attention_masks.py
        import bench_attention_masks
        return bench_attention_masks.main()
    if "--backward" in sys.argv[1:]:
        # the backward's table (rtk vs SDPA flash/cuDNN backward, deterministic, forward+backward)
        # lives in its own script; this flag is the entry point the issue names
        sys.argv.remove("--backward")
        import bench_attention_bwd
        return bench_attention_bwd.main()
    p = bu.parser(__doc__)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--head-dims", default="64,128,256,80,96")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton peer")
    p.add_argument("--no-fa2", action="store_true", help="skip timing the mma.sync kernel beside the sm_90 one")
    p.add_argument("--no-sdpa", action="store_true", help="skip the PyTorch SDPA peers (flash, cuDNN)")
    p.add_argument("--no-compile-time", action="store_true", help="skip the cold-compile / warm-load timing")
    p.add_argument("--causal", default="both", choices=["both", "false", "true"], help="which masks to time")
    p.add_argument("--triton-tiles", type=int, default=None,
                   help="Triton tile candidates timed per shape, best kept (default: all; 1 with --quick)")
    p.add_argument("--tag", default="", help="suffix of the JSON/PNG names (several chunks into one --out)")
    p.add_argument("--tiles", default=None, help="--tune-sm90: the heuristic's tile plus these (e.g. "
                                                 "192x112ov,128x176ovpp) instead of attention_sm90.tile_space")
    p.add_argument("--tune-sm90", action="store_true", help="time every sm_90 tile candidate (seqlen 4096 or the "
                                                            "last --seqlens) instead of the peer comparison")
    p.add_argument("--persistent-ab", action="store_true",
                   help="--tune-sm90: time each tile (the heuristic's plus --tiles) with persistent off and on, "
                        "interleaved, at every --seqlens (default 512,1024,2048,4096)")
    p.add_argument("--short-ab", action="store_true",
                   help="short problems (default S 512,1024; head dims 64,80,128,256): the per-head-dim config, "
                        "the per-call choice, persistent and smaller tiles, SDPA cuDNN, interleaved; a summary "
                        "per cell last")
    p.add_argument("--changed-only", action="store_true",
                   help="--short-ab: only the cells where the per-call choice differs from the per-head-dim "
                        "config: old, new, old again (the noise) and cuDNN, --rounds interleaved rounds")
    p.add_argument("--fwd-ab", action="store_true",
                   help="long cells (default S 4096,16384; head dims 64,80,128,256): the current pick twice, "
                        "FA4-inspired candidates (FWD_AB_TILES, or --tiles), causal ones also with lpt_grid, FA4 "
                        "and SDPA cuDNN, interleaved --rounds (default 5); a summary per cell last")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds (median): --short-ab / --fwd-ab default 3 / 5, the peer table 3")
    p.add_argument("--tune", action="store_true", help="autotune each head dim (seqlen 4096) and report "
                                                       "heuristic vs best tiles instead of the peer comparison")
    p.add_argument("--grid", choices=["fa"], default=None,
                   help="fa: FlashAttention's grid of issue 24 (head dims 64,80,128,256 x seqlens 512,1k,4k,16k), "
                        "rtk / FA4 / SDPA only (no Triton, fa2 or compile time), compact table last")
    args = p.parse_args()
    if args.grid:
        args.head_dims = FA_GRID["forward"]["head_dims"] if "--head-dims" not in sys.argv else args.head_dims
        args.seqlens = FA_GRID["forward"]["seqlens"] if "--seqlens" not in sys.argv else args.seqlens
        args.no_triton = args.no_fa2 = args.no_compile_time = True
        args.tag = args.tag or args.grid
    t_start = time.perf_counter()
    env = bu.environment()
    torch, peers = bu.attention_peers(env)
    if args.no_sdpa:
        peers = {}
    causals = {"both": (False, True), "false": (False,), "true": (True,)}[args.causal]
    sfx = f"_{args.tag}" if args.tag else ""
    head_dims = [int(x) for x in args.head_dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    if args.quick:   # the head dims asked for (default 64, 128, 256) at seqlen 4096: well under 90 s
        head_dims = head_dims if "--head-dims" in sys.argv else [64, 128, 256]
        seqlens = seqlens if "--seqlens" in sys.argv else [4096]
    # the peer table: rounds of every candidate in turn, batches of calls per round (time_interleaved)
    rounds, repeat = (2, 2) if args.quick else (args.rounds or 3, 3)

    import cupy as cp
    cp.cuda.Device().synchronize()   # create the CUDA context first: it is not part of a warm start
    if args.short_ab:
        sa_seqlens = seqlens if "--seqlens" in sys.argv else [512, 1024]
        sa_dims = head_dims if "--head-dims" in sys.argv else [64, 80, 128, 256]
        rows = short_ab(sa_dims, sa_seqlens, args.dtype, torch, peers, causals, rounds=args.rounds or 3,
                        tiles=args.tiles if args.tiles else SHORT_TILES, changed_only=args.changed_only)
        summary = short_summary(rows)
        bu.save(args.out, "bench_attention_short" + sfx, {"env": env, "dtype": args.dtype, "rows": rows,
                                                           "summary": summary})
        print(f"\n{env['gpu']} ({env['sms']} SMs), {args.dtype}, {env['date']}: every candidate, TFLOP/s")
        print(bu.table(rows, ["head_dim", "causal", "seqlen", "cand", "tile", "tflops", "vs_old", "vs_cudnn",
                              "max_diff_vs_old", "note"]))
        print("\nper cell: old = per-head-dim config, new = per-call choice, best = fastest rtk candidate")
        cols = (["head_dim", "causal", "seqlen", "old_tile", "old", "old_again", "new_tile", "new", "new_vs_old",
                 "cudnn", "new_vs_cudnn"] if args.changed_only else
                ["head_dim", "causal", "seqlen", "old", "new", "new_tile", "new_vs_old", "cudnn", "new_vs_cudnn", "best",
                 "best_tile", "best_vs_cudnn"])
        print(bu.table(summary, cols))
        return
    if args.fwd_ab:
        fa_seqlens = seqlens if "--seqlens" in sys.argv else [4096, 16384]
        fa_dims = head_dims if "--head-dims" in sys.argv else [64, 80, 128, 256]
        rows = fwd_ab(fa_dims, fa_seqlens, args.dtype, torch, peers, causals, rounds=args.rounds or 5,
                      tiles=args.tiles)
        summary = fwd_ab_summary(rows)
        bu.save(args.out, "bench_attention_fwd_ab" + sfx, {"env": env, "dtype": args.dtype, "rows": rows,
                                                            "summary": summary})
        print(f"\n{env['gpu']} ({env['sms']} SMs), {args.dtype}, {env['date']}: every candidate, TFLOP/s")
        print(bu.table(rows, ["head_dim", "causal", "seqlen", "cand", "tile", "tflops", "vs_cur", "vs_fa4",
                              "vs_cudnn", "max_diff_vs_cur", "max_diff_vs_fa4", "note"]))
        print("\nper cell: cur = what rtk.attention runs now (timed twice), best = fastest rtk candidate, "
              "peer = the faster of FA4 and cuDNN")
        print(bu.table(summary, ["head_dim", "causal", "seqlen", "cur_tile", "cur", "cur_again", "best_tile",
                                 "best", "fa4", "cudnn", "cur_vs_peer", "best_vs_peer", "best_vs_cur"]))
        return
    if args.tune_sm90 and args.persistent_ab:
        def save_ab(rows):
            bu.save(args.out, "bench_attention_persistent" + sfx, {"env": env, "dtype": args.dtype, "rows": rows})
        ab_seqlens = seqlens if "--seqlens" in sys.argv else [512, 1024, 2048, 4096]
        ab_dims = head_dims if "--head-dims" in sys.argv else [64, 128]
        rows = persistent_ab(ab_dims, ab_seqlens, args.dtype, torch, parse_tiles(args.tiles) if args.tiles else None,
                             causals, save=save_ab)
        print(f"\n{env['gpu']} ({env['sms']} SMs), {args.dtype}, {env['date']}: persistent vs one CTA per tile, "
              "same tile, interleaved")
        print(bu.table(rows, ["head_dim", "causal", "seqlen", "tile", "heuristic", "q_buffers", "plain_tflops",
                              "pst_tflops", "pst_vs_plain", "max_diff", "note"]))
        return
    if args.tune_sm90:
        def save(rows):
            bu.save(args.out, "bench_attention_tune_sm90" + sfx, {"env": env, "dtype": args.dtype, "rows": rows})
        rows = tune_sm90(head_dims, args.dtype, torch, seqlens[-1] if "--seqlens" in sys.argv else 4096, save,
                         parse_tiles(args.tiles) if args.tiles else None, causals)
        print(bu.table(rows, ["head_dim", "causal", "tile", "heuristic", "tflops", "note"]))
        return
    if args.tune:
        os.environ.setdefault("RTKERNELS_CACHE_DIR", tempfile.mkdtemp(prefix="rtk-attn-tune-"))
        rows = tune(head_dims, args.dtype, torch)
        bu.save(args.out, "bench_attention_tune", {"env": env, "dtype": args.dtype, "rows": rows})
        print(bu.table(rows, ["head_dim", "causal", "heuristic", "heuristic_tflops", "best1", "best1_tflops",
                              "best2", "best2_tflops", "best3", "best3_tflops"]))
        return
    ct = None if args.no_compile_time else compile_times(args.dtype)
    rows = []

    def save_rows():   # after each head dim: a run cut short still leaves its rows
        bu.save(args.out, "bench_attention" + sfx, {"env": env, "dtype": args.dtype, "compile": ct, "rows": rows})
    for d in head_dims:
        h = HIDDEN // d
        for causal in causals:
            for s in seqlens:
                b = max(1, TOKENS // s)
                q, k, v = _inputs(b, s, h, d, args.dtype, torch)
                row = {"head_dim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h}
                # every candidate built and checked first, then timed interleaved over rounds
                runs = {}   # "<name>_tflops" -> launcher
                run, o_ours, tag = _ours(q, k, v, causal, args.dtype, torch)
                row["config"] = tag
                runs["rtk_tflops"] = run
                flops = _flops(b, s, s, h, d, causal)
                if "sm90" in tag and not args.no_fa2:
                    frun, o_fa2, ftag = _ours(q, k, v, causal, args.dtype, torch, hopper=False)
                    row["fa2_config"] = ftag
                    row["fa2_maxdiff"] = _max_diff(o_ours, o_fa2, torch)
                    runs["fa2_tflops"] = frun
                    del o_fa2
                if not args.no_triton:
                    trun, tout = _triton(q, k, v, causal, torch, args.quick, args.triton_tiles)
                    if trun is None:
                        row["triton_tflops"], row["triton_note"] = None, tout
                    else:
                        row["triton_config"] = tout[1]
                        row["triton_maxdiff"] = _max_diff(o_ours, tout[0], torch)
                        runs["triton_tflops"] = trun
                for name, backend in peers.items():
                    prun, out = _sdpa(q, k, v, causal, backend, torch)
                    if prun is None:
                        row[f"{name}_tflops"] = None
                        row[f"{name}_note"] = out
                        continue
                    row[f"{name}_maxdiff"] = _max_diff(o_ours, out, torch)
                    runs[f"{name}_tflops"] = prun
                if torch is not None and not args.no_sdpa:   # FA4 beside SDPA; "—" where absent
                    frun, fout = _fa4(q, k, v, causal, torch)
                    if frun is None:
                        row["fa4_tflops"], row["fa4_note"] = None, fout
                    else:
                        row["fa4_maxdiff"] = _max_diff(o_ours, fout, torch)
                        runs["fa4_tflops"] = frun
                        del fout
                for key, ms in zip(runs, bu.time_interleaved(list(runs.values()), rounds, repeat)):
                    row[key] = flops / (ms * 1e-3) / 1e12
                    if key == "rtk_tflops":
                        row["rtk_ms"] = ms
                    else:
                        row[f"ratio_vs_{key[:-7]}"] = row["rtk_tflops"] / row[key]
                if torch is not None and not args.no_sdpa:
                    bu.ratio_vs_best(row)
                del runs
                rows.append(row)
                print(row, flush=True)
                del q, k, v, o_ours
        save_rows()
    for d in head_dims:
        series = {}
        for causal in causals:
            sel = [r for r in rows if r["head_dim"] == d and r["causal"] == causal]
            tag = "causal" if causal else "non-causal"
            series[f"rtk {tag}"] = ([r["seqlen"] for r in sel], [r["rtk_tflops"] for r in sel])
            for name in ["fa2", "triton", *peers, "fa4"]:
                pts = [(r["seqlen"], r[f"{name}_tflops"]) for r in sel if r.get(f"{name}_tflops")]
                if pts:
                    series[f"{name} {tag}"] = tuple(map(list, zip(*pts)))
        bu.plot(args.out, f"bench_attention{sfx}_d{d}", series, "seqlen", "TFLOP/s",
                f"attention fwd {args.dtype} head_dim={d} ({env['gpu']})")

    cols = ["head_dim", "causal", "seqlen", "batch", "config", "rtk_tflops"]
    for name in ["fa2", "triton", *peers, "fa4"]:
        if any(f"{name}_tflops" in r for r in rows):
            cols += [f"{name}_tflops", f"ratio_vs_{name}"]
    if any("ratio_vs_best" in r for r in rows):
        cols += ["best_peer", "ratio_vs_best"]
    print(f"\n{env['gpu']} ({env['arch']}, {env['sms']} SMs), driver {env['driver']}, NVRTC {env['nvrtc']}, "
          f"{args.dtype}, {env['date']}" + (f", torch {env['torch']}" if torch else " (torch absent: no peers)")
          + (", FA4" if bu.fa4()[0] is not None else ", no FA4"))
    if ct:
        print(f"cold compile ({ct['config']}): {ct['cold_compile_s'] * 1e3:.0f} ms; "
              f"warm disk load: {ct['warm_disk_load_s'] * 1e3:.1f} ms")
    print(bu.table(rows, cols))
    if args.grid:
        print("\nforward TFLOP/s; ratio_vs_best = rtk / max(FA4, SDPA cuDNN) (target >= 1.0, >= 0.95 at S=512)")
        print(bu.table(rows, COMPACT))
    print(f"({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
