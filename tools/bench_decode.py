"""Decode benchmark: rtk.attention_kvcache (contiguous and paged caches) against PyTorch SDPA
(cuDNN and flash backends), FlashAttention-4's forward where importable (../shared/anchors; no
split-KV decode on sm_90) and a device copy, all in one run.

GB/s = bytes of K and V read once (batch x seqlen_k x nheads_kv x head_dim x 2 x itemsize) / time;
%copy = that over the same run's device-to-device copy (bytes read + written, 1 GiB), the roof
issue #15's targets are stated against.  Every sequence holds seqlen_k keys (cache_seqlens =
seqlen_k, the cache exactly that long); paged caches are the same memory viewed as pages of 16
or 64 keys, visited through a shuffled block table.  SDPA gets its preferred contiguous
(batch, nheads_kv, seqlen_k, head_dim) K/V copies and ``enable_gqa=True``.

Timing: every call queued behind a spin kernel, two events around each queue of calls (back to
back, as a pipeline runs them: :func:`benchutil.time_queued`; ``--events each`` times every call
between its own events, the method before 2026-11-27), input sets
rotated so K/V never sit in L2 (>= 256 MiB per rotation), candidates interleaved over rounds,
median per candidate.  Also: host time per call (tiny shapes; launch plans) and the cold compile
time of a new head dim.  Run on the GPU host from the repository root:

    PYTHONPATH=. python tools/bench_decode.py --quick --out $OUT       # ~8 shapes, < 60 s
    PYTHONPATH=. python tools/bench_decode.py --out $OUT               # issue shapes + B x Sk grid + seqlen_q 4/16
    PYTHONPATH=. python tools/bench_decode.py --quick --splits 1,8,33  # forced num_splits as extra columns
    PYTHONPATH=. python tools/bench_decode.py --quick --tiles 16:4:3,16:4:4,32:4:3,16:8:2   # block_n:warps:stages
    PYTHONPATH=. python tools/bench_decode.py --quick --variants "rows8=warp_split:rows;keys0=order:splits"
    PYTHONPATH=. python tools/bench_decode.py --quick --no-host --variant-layouts contig,paged16,paged64 \
        --splits 8,32 --variants "cp=loader:cp.async;s4=num_stages:4;n32=block_n:32;fill2=split_rule:fill2"
        # the TMA default (sm_90) against the cp.async ring, a deeper ring, 32-key tiles, and B1's split count
    PYTHONPATH=. python tools/bench_decode.py --quick --no-host --layouts contig,paged16,paged64 \
        --variant-layouts contig,paged16,paged64 --shapes 8:8192:32:8:128:4,8:8192:32:8:128:16,8:8192:32:8:128:64 \
        --variants "cp=loader:cp.async;s5=num_stages:5"
        # speculative decoding: the rows mode's TMA producer ring (default) against its cp.async ring
    PYTHONPATH=. python tools/bench_decode.py --quick --no-host --no-sdpa --layouts contig,paged16 \
        --variant-layouts contig,paged16 --shapes 8:8192:32:8:128:8,8:8192:32:8:128:16,1:32768:32:8:128:16 \
        --variants "wg=mma:wgmma;wg64=mma:wgmma+block_n:64+num_stages:3;wgs6=mma:wgmma+num_stages:6"
        # seqlen_q 8-16: the rows mode's warpgroup MMAs against the default (mma.sync)

Layouts: ``contig`` (batch, seqlen, nheads_kv, head_dim), ``hnd`` (a (batch, nheads_kv, seqlen,
head_dim) cache passed as its transposed view), ``paged16`` / ``paged64``.  SDPA runs on its
preferred contiguous (batch, nheads_kv, seqlen, head_dim) copy (``sdpa_cudnn``) and, with
``--sdpa-nhd``, on the transposed view of rtk's own layout (``sdpa_cudnn_nhd``: the same bytes in
the same places as ``rtk_contig``).  ``--variants name=field:value+field:value;...`` times kernel
variants (attention_kvcache.set_variant: warp_split, kv_heads, block_n, num_stages, num_warps,
order splits|heads, combine fused|kernel, merge serial|units (the session-10 fused merge; the unit merge
where the rows mode merges from registers), split_rule
decode|old|fill|fill2|contig|paged|two|one (fill: lean memory's keys-mode grids split to one CTA per SM
as before LEAN_GRID_BYTES_IN_FLIGHT; contig: paged caches split as contiguous ones, cp.async pages too;
paged: PAGED_FILL for TMA-read pages too, the rule before 2026-11-26; two: heavy grids at most two CTAs
per SM, the rule before COMPUTE_FILL_DEEP_SMALL_HEAD; one: lean memory's heavy wgmma grids one CTA per
SM above d64 with 4 stages, the rule before COMPUTE_FILL_LEAN_WGMMA_HEAD_DIM), memory lean|deep (the
lean-memory rules of attention_kvcache.LEAN_MEMORY_GBS_PER_SM, or the others, whatever the device),
schedule streamk, loader tma|cp.async (tma: the default in both modes on
sm_90), l2_prefetch 64|128|256, mma wgmma (the rows mode's warpgroup MMAs; implies warp_split rows);
cfg tags: K keys mode with cp.async, KT keys mode with TMA, R<n>h rows mode with n kv heads per CTA
(R<n>hT: its TMA producer ring, R1hTW: with wgmma), pN prefetch) on the
``--variant-layouts``; ``--splits`` adds forced split counts for the default and every variant.
``--host-profile`` times the pieces of a call.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402

# (batch, seqlen_k, nheads, nheads_kv, head_dim, seqlen_q): the issue's table first
ISSUE_SHAPES = [(1, 32768, 32, 8, 128, 1), (1, 131072, 32, 8, 128, 1), (8, 8192, 32, 8, 128, 1),
                (64, 2048, 32, 8, 128, 1), (128, 1024, 64, 8, 128, 1), (16, 4096, 16, 16, 64, 1)]
SPEC_SHAPES = [(8, 8192, 32, 8, 128, 4), (8, 8192, 32, 8, 128, 16), (1, 32768, 32, 8, 128, 4),
               (1, 32768, 32, 8, 128, 16)]
GRID_SHAPES = [(b, sk, 32, 8, 128, 1) for b in (1, 4, 16, 64, 256) for sk in (1024, 8192, 32768, 131072)]
QUICK_SHAPES = ISSUE_SHAPES + SPEC_SHAPES[:2]
ROTATE_BYTES = 256 << 20
LAYOUTS = ("contig", "hnd", "paged16", "paged64")


def _kv_bytes(b, sk, hkv, d, item=2):
    return b * sk * hkv * d * 2 * item


def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _randn(shape, dtype, torch, gen=None):
    import cupy as cp
    if torch is not None:
        return torch.randn(shape, device="cuda", dtype=getattr(torch, dtype), generator=gen)
    x = cp.random.standard_normal(shape, dtype=cp.float32)
    if dtype == "bfloat16":
        return ((x.view(cp.uint32) + 0x8000) >> 16).astype(cp.uint16)
    return x.astype(dtype)


class Set:
    """One rotation's inputs: q, the cache (contiguous; the paged views share its memory),
    cache_seqlens, a shuffled block table per page size, and SDPA's K/V layout."""

    def __init__(self, shape, dtype, torch, sdpa: bool, page_sizes, layouts=()):
        import cupy as cp
        b, sk, h, hkv, d, sq = shape
        self.q = _randn((b, sq, h, d), dtype, torch)
        self.k = _randn((b, sk, hkv, d), dtype, torch)
        self.v = _randn((b, sk, hkv, d), dtype, torch)
        self.out = _randn((b, sq, h, d), dtype, torch)
        if torch is not None:
            self.lens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
        else:
            self.lens = cp.full((b,), sk, dtype=cp.int32)
        self.paged = {}
        for ps in page_sizes:
            if sk % ps:
                continue
            n = b * sk // ps
            if torch is not None:
                table = torch.randperm(n, device="cuda").to(torch.int32).reshape(b, sk // ps)
            else:
                table = cp.random.permutation(n).astype(cp.int32).reshape(b, sk // ps)
            self.paged[ps] = (self.k.reshape(n, ps, hkv, d), self.v.reshape(n, ps, hkv, d), table)
        self.sdpa = self.sdpa_nhd = None
        if sdpa and torch is not None:
            self.sdpa = tuple(x.transpose(1, 2).contiguous() for x in (self.q, self.k, self.v))
            self.sdpa_nhd = tuple(x.transpose(1, 2) for x in (self.q, self.k, self.v))   # views of rtk's arrays
        self.hnd = None
        if "hnd" in layouts:   # rtk on a (B, Hkv, S, D) cache: the transposed view of such an array
            if self.sdpa is not None:
                self.hnd = (self.sdpa[1].transpose(1, 2), self.sdpa[2].transpose(1, 2))
            elif torch is not None:
                self.hnd = tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (self.k, self.v))
            else:
                self.hnd = tuple(cp.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                                 for x in (self.k, self.v))


def _cache_args(s, layout):
    """(k_cache, v_cache, block_table) of a set in a layout."""
    if layout == "contig":
        return s.k, s.v, None
    if layout == "hnd":
        return s.hnd[0], s.hnd[1], None
    return s.paged[int(layout[5:])]


def _rtk_fn(rtk, kv, layout, dtype, torch, variant=None, **kw):
    extra = {} if torch is not None else ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})

    def fn(s):
        kc, vc, table = _cache_args(s, layout)
        kv.set_variant(variant)
        rtk.attention_kvcache(s.q, kc, vc, s.lens, block_table=table, out=s.out, **extra, **kw)
    return fn


def _dense_fn(rtk, dtype, torch, nhd=False):
    """rtk.attention on the whole cache as dense k / v (no cache_seqlens): the call a model's own
    attention makes (transformers' backend, SDPA's drop-in); attention.decode_route sends few query
    rows to the decode kernel.  ``nhd``: on (B, Hkv, S, D) storage (transformers' layout)."""
    extra = {} if torch is not None else ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})

    def fn(s):
        k, v = (s.sdpa[1].transpose(1, 2), s.sdpa[2].transpose(1, 2)) if nhd else (s.k, s.v)
        rtk.attention(s.q, k, v, causal=True, out=s.out, **extra)
    return fn


def _sdpa_fn(torch, backend, nhd=False):
    """SDPA without a mask: its is_causal aligns top-left (query i sees keys <= i), which for
    seqlen_q < seqlen_k would skip nearly the whole cache; the bottom-right triangle rtk masks
    (seqlen_q <= 16 here) changes no byte read.  ``nhd``: on views of rtk's own arrays."""
    from torch.nn.attention import sdpa_kernel
    F = torch.nn.functional

    def fn(s):
        q, k, v = s.sdpa_nhd if nhd else s.sdpa
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return fn


def _fa4_fn():
    """FlashAttention-4's forward (CuTe DSL, ../shared/anchors) on rtk's own (B, S, H, D) arrays, causal
    bottom-right as rtk's, or None where it is not importable.  FA4 has no split-KV decode on sm_90
    (num_splits=1: one CTA per (query tile, kv head, sequence))."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None

    def fn(s):
        flash_attn_func(s.q, s.k, s.v, causal=True, num_splits=1)
    return fn


def _plan_of(kv, s, layout, dtype, torch, kw, variant=None):
    """The plan the op runs for this set, layout and variant."""
    kc, vc, table = _cache_args(s, layout)
    kv.set_variant(variant)
    try:
        plan, _ = kv._plan((s.q, kc, vc, s.lens, table, None, None, s.out), True, None, False, kw.get("num_splits"),
                           None if torch is not None else ("bfloat16" if dtype == "bfloat16" else None))
    finally:
        kv.set_variant(None)
    return plan


def _short(plan, kv=None):
    """The plan's config tag; with ``kv`` (the op's module) also " o<n>": CTAs resident per SM
    (the kernel's occupancy: registers, shared memory, threads) - what the many-CTA shapes' wave
    count (grid / (n x SMs)) and each SM's share of the streams follow from."""
    cfg = plan.config
    tma = "T" if cfg.loader == "tma" else ""
    wg = "W" if getattr(cfg, "mma", "sync") == "wgmma" else ""
    mode = f"K{tma}" if cfg.warp_split == "keys" else f"R{cfg.kv_heads}h{tma}{wg}"
    comb = "" if plan.num_splits == 1 else ("f" if plan.fused else "c")
    l2 = f" p{cfg.l2_prefetch}" if cfg.l2_prefetch else ""
    occ = ""
    if kv is not None and plan.split is not None:
        from rtkernels import device
        occ = f" o{kv._ctas_per_sm(cfg, plan.split.kernel, device.current_arch())}"
    if cfg.schedule == "streamk":   # a grid of a few CTAs per SM sharing the key tiles
        return f"SK{'T' if cfg.loader == 'tma' else ''} r{cfg.rows} n{cfg.block_n} w{cfg.num_warps} " \
               f"s{cfg.num_stages} g{plan.split.grid[0]}{l2}{occ}"
    return f"{mode} r{cfg.rows} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} x{plan.num_splits}{comb}{l2}{occ}"


def parse_shapes(text: str) -> list[tuple]:
    """"b:sk:h:hkv:d:sq,..." -> [(b, sk, h, hkv, d, sq), ...]."""
    return [tuple(int(v) for v in t.split(":")) for t in text.split(",") if t]


def time_rounds(fns: dict, sets, rounds: int, repeat: int = 20, events: str = "ends") -> dict:
    """{name: (median ms, host us per call of the last round)} of each ``fn(set)``: ``rounds``
    interleaved rounds (every candidate once per round), each a queued run of ``repeat`` calls over
    the rotating ``sets`` (benchutil.time_queued; ``events`` "ends": two events around the queue,
    the calls back to back; "each": an event after every call, the median interval - this bench's
    method before 2026-11-27, ~1.5 us a call slower on an H200).  This bench's and the decode
    probes' timing."""
    inputs = [(s,) for s in sets]
    times, host = {k: [] for k in fns}, {}
    for _ in range(rounds):
        for k, fn in fns.items():
            ms, host[k], _ = bu.time_queued(fn, inputs, warmup=2, repeat=repeat, events=events)
            times[k].append(ms)
    return {k: (statistics.median(ts), host[k]) for k, ts in times.items()}


def copy_percent(nbytes: int, ms: float, copy_gbs: float) -> float:
    """``nbytes`` read in ``ms`` as % of the copy rate (GB/s)."""
    return 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs


def parse_variants(text: str) -> dict:
    """"name=field:value+field:value;name2=..." -> {name: {field: value}} (ints where they parse)."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, _, spec = item.partition("=")
        fields = {}
        for kv_ in filter(None, spec.split("+")):
            k, _, v = kv_.partition(":")
            fields[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
        out[name.strip()] = fields
    return out


def bench_shape(shape, dtype, torch, rtk, kv, args, copy_gbs):
    b, sk, h, hkv, d, sq = shape
    nbytes = _kv_bytes(b, sk, hkv, d)
    nsets = max(1, min(8, -(-ROTATE_BYTES // nbytes)))
    pages = [int(x[5:]) for x in args.layouts if x.startswith("paged")]
    sets = [Set(shape, dtype, torch, not args.no_sdpa, pages, args.layouts) for _ in range(nsets)]
    cands = {}   # name -> (fn, layout, kw, variant)
    for layout in args.layouts:
        if layout.startswith("paged") and int(layout[5:]) not in sets[0].paged:
            continue
        if layout == "hnd" and sets[0].hnd is None:
            continue
        cands[f"rtk_{layout}"] = (_rtk_fn(rtk, kv, layout, dtype, torch), layout, {}, None)
        for vname, v in args.variants.items():
            if layout in args.variant_layouts:
                cands[f"rtk_{layout}@{vname}"] = (_rtk_fn(rtk, kv, layout, dtype, torch, v), layout, {}, v)
        if layout == args.layouts[0]:
            for n in args.splits:
                cands[f"rtk_{layout}_x{n}"] = (_rtk_fn(rtk, kv, layout, dtype, torch, num_splits=n), layout,
                                               {"num_splits": n}, None)
                for vname, v in args.variants.items():
                    cands[f"rtk_{layout}@{vname}_x{n}"] = (_rtk_fn(rtk, kv, layout, dtype, torch, v, num_splits=n),
                                                           layout, {"num_splits": n}, v)
    if args.dense:
        cands["rtk_attention"] = (_dense_fn(rtk, dtype, torch), None, None, None)
        if sets[0].sdpa is not None:
            cands["rtk_attention_bhsd"] = (_dense_fn(rtk, dtype, torch, nhd=True), None, None, None)
    if torch is not None and not args.no_sdpa:
        from torch.nn.attention import SDPBackend
        for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            cands[name] = (_sdpa_fn(torch, be), None, None, None)
        if args.sdpa_nhd:
            cands["sdpa_cudnn_nhd"] = (_sdpa_fn(torch, SDPBackend.CUDNN_ATTENTION, nhd=True), None, None, None)
        fa4 = _fa4_fn()
        if fa4 is not None:
            cands["fa4"] = (fa4, None, None, None)
    row = {"batch": b, "seqlen_k": sk, "heads": f"{h}/{hkv}", "head_dim": d, "seqlen_q": sq, "MB": nbytes / 1e6,
           "sets": nsets}
    live = {}
    for name, (fn, layout, kw, variant) in cands.items():
        try:
            fn(sets[0])   # compile, plan, warm
            if layout is not None:
                row[f"{name}_cfg"] = _short(_plan_of(kv, sets[0], layout, dtype, torch, kw, variant), kv)
            live[name] = fn
        except Exception as exc:   # noqa: BLE001 - a peer without support for this shape
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            kv.set_variant(None)
    for name, (ms, host_us) in time_rounds(live, sets, args.rounds, args.repeat, args.events).items():
        row[f"{name}_host_us"] = host_us
        row[f"{name}_us"] = ms * 1e3
        row[f"{name}_GBs"] = nbytes / (ms * 1e-3) / 1e9
        row[f"{name}_%copy"] = copy_percent(nbytes, ms, copy_gbs)
    kv.set_variant(None)
    if "rtk_contig_GBs" in row and "sdpa_cudnn_GBs" in row:
        row["rtk/cudnn"] = row["rtk_contig_GBs"] / row["sdpa_cudnn_GBs"]
    if "rtk_attention_GBs" in row and "sdpa_cudnn_GBs" in row:
        row["attention/cudnn"] = row["rtk_attention_GBs"] / row["sdpa_cudnn_GBs"]
    peers = [row[f"{n}_GBs"] for n in ("sdpa_cudnn", "sdpa_flash", "fa4") if f"{n}_GBs" in row]
    if "rtk_contig_GBs" in row and peers:
        row["rtk/best_peer"] = row["rtk_contig_GBs"] / max(peers)
    rtk_best = max(((n, row[f"{n}_GBs"]) for n in live if n.startswith("rtk_contig") and f"{n}_GBs" in row),
                   key=lambda x: x[1], default=None)
    if rtk_best is not None:
        row["best"], row["best_%copy"] = rtk_best[0][len("rtk_contig"):] or "default", 100 * rtk_best[1] / copy_gbs
    for ps in pages:
        if f"rtk_paged{ps}_GBs" in row and "rtk_contig_GBs" in row:
            row[f"paged{ps}/contig"] = row[f"rtk_paged{ps}_GBs"] / row["rtk_contig_GBs"]
    del sets
    return row


def host_times(rtk, dtype, torch) -> dict:
    """Microseconds of host time per call on a tiny decode step (the GPU is idle most of it):
    CuPy arrays with out=, torch tensors with and without out=, paged."""
    import cupy as cp
    out = {}
    shape = (1, 256, 32, 8, 128, 1)
    for lib, t in (("cupy", None), ("torch", torch)):
        if lib == "torch" and torch is None:
            continue
        s = Set(shape, dtype, t, False, (16,))
        extra = {} if t is not None else ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})
        kc, vc, table = s.paged[16]
        calls = {
            "out": lambda: rtk.attention_kvcache(s.q, s.k, s.v, s.lens, out=s.out, **extra),
            "alloc": lambda: rtk.attention_kvcache(s.q, s.k, s.v, s.lens, **extra),
            "paged_out": lambda: rtk.attention_kvcache(s.q, kc, vc, s.lens, block_table=table, out=s.out, **extra),
            "splits4_lse": lambda: rtk.attention_kvcache(s.q, s.k, s.v, s.lens, num_splits=4, return_lse=True,
                                                         **extra),
        }
        for name, fn in calls.items():
            out[f"{lib}_{name}_us"] = min(bu.time_host(fn, 1000) for _ in range(2))
        cp.cuda.Device().synchronize()
    return out


def host_profile(rtk, kv, dtype, torch) -> dict:
    """Microseconds of host time of each piece of a replayed call (tiny decode step, out= given):
    the signature key, the plan lookup, the replay (_execute: outputs, stream, addresses, launch),
    and inside it the launch alone, the address struct, the stream lookup, an output allocation."""
    import cupy as cp
    import numpy as np
    from rtkernels._env import getenv_raw
    from rtkernels.ops._arrays import default_stream, empty_as
    out = {}
    shape = (1, 256, 32, 8, 128, 1)
    for lib, t in (("cupy", None), ("torch", torch)):
        if lib == "torch" and torch is None:
            continue
        s = Set(shape, dtype, t, False, ())
        dt = None if t is not None else ("bfloat16" if dtype == "bfloat16" else None)
        extra = {"dtype": dt} if dt else {}
        arrays = (s.q, s.k, s.v, s.lens, None, None, None, s.out)
        opts = (True, None, False, None, dt, getenv_raw("RTKERNELS_ARCH"), None)   # the op's plan options
        rtk.attention_kvcache(s.q, s.k, s.v, s.lens, out=s.out, **extra)
        key = kv._PLANS.key(arrays, opts)
        plan = kv._PLANS.get(key)
        if plan is None:   # the key above must be the op's own
            out[f"{lib}_error"] = "plan key mismatch"
            continue
        st = default_stream(s.q, None)
        # the call's own addresses, packed as _execute packs them (the partials of the stream's
        # workspace when the plan splits), so the "launch" piece reads and writes only its arrays
        ptr = (lambda x: x.data_ptr()) if t is not None else (lambda x: x.data.ptr)
        parts = counters = 0
        if plan.part_bytes:
            parts, counters = kv._workspace(plan, s.q, st)
        addr = [ptr(s.q), ptr(s.k), ptr(s.v), ptr(s.out), 0, parts, parts + plan.lse_part_offset if parts else 0,
                counters, ptr(s.lens), 0, 0, 0]
        assert len(addr) == len(kv.DECODE_PTRS), kv.DECODE_PTRS
        ptrs = np.frombuffer(kv._PACK_PTRS(*addr), kv.PTRS_DTYPE)[0]
        pieces = {
            "call": lambda: rtk.attention_kvcache(s.q, s.k, s.v, s.lens, out=s.out, **extra),
            "key": lambda: kv._PLANS.key(arrays, opts),
            "lookup": lambda: kv._PLANS.get(key),
            "execute": lambda: kv._execute(plan, *arrays, None),
            # (a plan with TMA loads also takes the K and V tensor maps, as _execute passes them)
            "launch": lambda: plan.split.run((ptrs, *(kv._plan_maps(plan, addr[1], addr[2])
                                                      if plan.tma is not None else ())), st),
            "pack_ptrs": lambda: np.frombuffer(kv._PACK_PTRS(*addr), kv.PTRS_DTYPE)[0],
            "stream": lambda: default_stream(s.q, None),
            "empty_out": lambda: empty_as(s.q, plan.out_shape, plan.out_dtype),
            "environ": lambda: getenv_raw("RTKERNELS_ARCH"),
        }
        for name, fn in pieces.items():
            out[f"{lib}_{name}_us"] = min(bu.time_host(fn, 2000) for _ in range(2))
        cp.cuda.Device().synchronize()
    return out


def compile_time(dtype: str, rtk, kv) -> dict:
    """Cold start of a new head dim (96, which nothing else here runs): the first call of a decode
    step with an empty disk cache and nothing in memory - its plan and every kernel it compiles
    (since 2026-11-28 only the merge the plan launches, and the combine / append kernels only
    where it launches them), the launch waited for - and the same call again from the disk cache
    (the plan rebuilt, the modules loaded).  keys: B1 S32k seqlen_q 1; rows: B4 S8k seqlen_q 16;
    32/8 heads, contiguous."""
    import cupy as cp
    from rtkernels import cache
    res = {}
    for name, shape in (("keys", (1, 32768, 32, 8, 96, 1)), ("rows", (4, 8192, 32, 8, 96, 16))):
        s = Set(shape, dtype, None, False, ())
        extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        with bu.empty_disk_cache():
            times = []
            for _ in range(2):
                cache.clear_memory()
                kv._PLANS.clear()
                cp.cuda.Device().synchronize()
                t0 = time.perf_counter()
                rtk.attention_kvcache(s.q, s.k, s.v, s.lens, out=s.out, **extra)
                cp.cuda.Device().synchronize()
                times.append(time.perf_counter() - t0)
            plan = next(iter(kv._PLANS._plans.values()))   # (the one plan of this call)
            kv._PLANS.clear()
        res[name] = {"config": plan.config.key(), "num_splits": plan.num_splits,
                     "cold_compile_s": times[0], "warm_disk_load_s": times[1]}
    return res


def _fits(shape, free_bytes, sdpa) -> bool:
    b, sk, h, hkv, d, sq = shape
    return _kv_bytes(b, sk, hkv, d) * (2 if sdpa else 1) * 1.2 < free_bytes


def main():
    p = bu.parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=0, help="calls per timing (default 10 quick, 20 full)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: contig,paged16,paged64")
    p.add_argument("--splits", default="", help="forced num_splits to time as extra columns, e.g. 1,8,33")
    p.add_argument("--tiles", default="", help="replace the d<=128 heuristic tiles: block_n:num_warps:num_stages,... "
                                               "(each timed as its own pass; tuning aid)")
    p.add_argument("--shapes", default="", help="b:sk:h:hkv:d:sq,... instead of the built-in lists")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--dense", action="store_true", help="also rtk.attention on the whole cache as dense k / v "
                                                       "(rtk_attention; _bhsd: on transformers' storage)")
    p.add_argument("--events", choices=("ends", "each"), default="ends",
                   help="ends: two events around each queue of calls (back to back, as a pipeline runs them); "
                        "each: an event after every call, the median interval (the method before 2026-11-27)")
    p.add_argument("--no-host", action="store_true", help="skip host time per call and the compile time")
    p.add_argument("--variants", default="", help="kernel variants: name=field:value+field:value;... "
                                                  "(attention_kvcache.set_variant fields)")
    p.add_argument("--variant-layouts", default="contig", help="layouts the variants run on")
    p.add_argument("--sdpa-nhd", action="store_true", help="also SDPA cuDNN on views of rtk's (B, S, Hkv, D) arrays")
    p.add_argument("--host-profile", action="store_true", help="time the pieces of a replayed call")
    args = p.parse_args()
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.splits = [int(x) for x in args.splits.split(",") if x]
    args.variants = parse_variants(args.variants)
    args.variant_layouts = [x for x in args.variant_layouts.split(",") if x]
    args.repeat = args.repeat or (10 if args.quick else 20)
    import cupy as cp
    import importlib
    import rtkernels as rtk
    kv = importlib.import_module("rtkernels.ops.attention_kvcache")
    torch = _torch()
    t_start = time.time()
    env = bu.environment()
    if torch is not None:
        env["torch"] = torch.__version__
    copy_gbs = bu.copy_bandwidth(1 << 30)
    print(f"device copy {copy_gbs:.0f} GB/s ({env['gpu']}); torch {env.get('torch', 'absent')}", flush=True)
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    else:
        shapes = QUICK_SHAPES if args.quick else list(dict.fromkeys(ISSUE_SHAPES + SPEC_SHAPES + GRID_SHAPES))
    tile_sets = [None]
    if args.tiles:
        tile_sets = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",")]
    rows = []
    original = list(kv.HEURISTICS)
    for tiles in tile_sets:
        if tiles is not None:   # one tile for every head dim <= 128 (others keep theirs)
            kv.HEURISTICS[:] = [(8, 128, (kv.Tile(*tiles, "bench --tiles"),))] + [e for e in original if e[0] > 128]
            kv._PLANS.clear()
        for shape in shapes:
            free = cp.cuda.runtime.memGetInfo()[0]
            if not _fits(shape, free, torch is not None and not args.no_sdpa):
                rows.append({"batch": shape[0], "seqlen_k": shape[1], "skipped": "over GPU memory"})
                continue
            try:
                row = bench_shape(shape, args.dtype, torch, rtk, kv, args, copy_gbs)
            except Exception as exc:   # noqa: BLE001 - keep the other shapes' data
                row = {"batch": shape[0], "seqlen_k": shape[1], "error": f"{type(exc).__name__}: {exc}"[:300]}
            if tiles is not None:
                row["tiles"] = ":".join(map(str, tiles))
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            cp.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()
    kv.HEURISTICS[:] = original
    kv._PLANS.clear()
    extra = {}
    if not args.no_host:
        extra["host"] = host_times(rtk, args.dtype, torch)
        if args.host_profile:
            extra["host_profile"] = host_profile(rtk, kv, args.dtype, torch)
        extra["compile"] = compile_time(args.dtype, rtk, kv)
    name = "bench_decode_quick" if args.quick else "bench_decode"
    path = bu.save(args.out, name, {"environment": env, "copy_GBs": copy_gbs, "events": args.events, "rows": rows,
                                    **extra})
    series = {}
    for cand in ("rtk_contig", "rtk_paged16", "rtk_paged64", "sdpa_cudnn", "sdpa_flash"):
        pts = sorted((r["batch"] * r["seqlen_k"], r[f"{cand}_%copy"]) for r in rows
                     if f"{cand}_%copy" in r and r.get("seqlen_q") == 1 and r.get("head_dim") == 128)
        if pts:
            series[cand] = ([x for x, _ in pts], [y for _, y in pts])
    png = bu.plot(args.out, name, series, "batch x seqlen_k (seqlen_q 1, d128)", "% of device copy",
                  f"decode, {args.dtype}, {env['gpu']}") if series else None
    print(f"\n{env['gpu']} ({env['arch']}, {env['date']}), {args.dtype}, events {args.events}: device copy "
          f"{copy_gbs:.0f} GB/s; JSON {path}"
          + (f"; plot {png}" if png else "") + f"; {time.time() - t_start:.0f} s")
    if extra:
        print("host us/call:", {k: round(v, 1) for k, v in extra["host"].items()})
        if "host_profile" in extra:
            print("host profile us:", {k: round(v, 2) if isinstance(v, float) else v
                                       for k, v in extra["host_profile"].items()})
        for name, c in extra["compile"].items():
            print(f"cold compile {name} {c['cold_compile_s'] * 1e3:.0f} ms, warm load {c['warm_disk_load_s'] * 1e3:.0f} "
                  f"ms ({c['config']})")
    shape_cols = ["batch", "seqlen_k", "heads", "head_dim", "seqlen_q"]
    if args.splits or args.variants:   # the sweeps first: the default table is the last thing printed
        names = ["rtk_contig"] + [f"rtk_contig@{v}" for v in args.variants]
        other_layouts = [lay for lay in args.variant_layouts if lay != "contig"]
        sweep = []
        for r in rows:
            for n in names:
                e = {c: r.get(c) for c in shape_cols}
                e["candidate"] = n[len("rtk_contig"):] or "default"
                e["cfg"] = r.get(f"{n}_cfg", r.get(f"{n}_error", "")[:40])
                e["%copy"] = r.get(f"{n}_%copy", "")
                for lay in other_layouts:   # the same candidate on the other variant layouts
                    e[lay] = r.get(f"rtk_{lay}{n[len('rtk_contig'):]}_%copy", "")
                for k in args.splits:
                    e[f"x{k}"] = r.get(f"{n}_x{k}_%copy", "")
                sweep.append(e)
        print("\nvariants x forced splits (contig, % of copy):")
        print(bu.table(sweep, shape_cols + ["candidate", "cfg", "%copy"] + other_layouts
                       + [f"x{k}" for k in args.splits]))
    cols = shape_cols + [f"rtk_{lay}_%copy" for lay in args.layouts]
    cols += [c for c in ("rtk_attention_%copy", "rtk_attention_bhsd_%copy", "sdpa_cudnn_%copy", "sdpa_cudnn_nhd_%copy",
                         "sdpa_flash_%copy", "fa4_%copy") if any(c in r for r in rows)]
    cols += ["rtk/cudnn"] + (["attention/cudnn"] if args.dense else []) + ["rtk/best_peer"] + [f"{lay}/contig" for lay in args.layouts if lay.startswith("paged")]
    cols += ["best", "best_%copy", "rtk_contig_cfg"]
    if args.tiles:
        cols.append("tiles")
    print("\ndefault config (% of copy; best = fastest rtk_contig candidate):")
    print(bu.table(rows, cols))


if __name__ == "__main__":
    main()
