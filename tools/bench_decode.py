"""Decode benchmark: rtk.attention_kvcache (contiguous and paged caches) against PyTorch SDPA
(cuDNN and flash backends) and a device copy, all in one run.

GB/s = bytes of K and V read once (batch x seqlen_k x nheads_kv x head_dim x 2 x itemsize) / time;
%copy = that over the same run's device-to-device copy (bytes read + written, 1 GiB), the roof
issue #15's targets are stated against.  Every sequence holds seqlen_k keys (cache_seqlens =
seqlen_k, the cache exactly that long); paged caches are the same memory viewed as pages of 16
or 64 keys, visited through a shuffled block table.  SDPA gets its preferred contiguous
(batch, nheads_kv, seqlen_k, head_dim) K/V copies and ``enable_gqa=True``.

Timing: every call queued behind a spin kernel, events between consecutive calls
(:func:`benchutil.time_queued`: the kernels' own time even where the host is slower), input sets
rotated so K/V never sit in L2 (>= 256 MiB per rotation), candidates interleaved over rounds,
median per candidate.  Also: host time per call (tiny shapes; launch plans) and the cold compile
time of a new head dim.  Run on the GPU host from the repository root:

    PYTHONPATH=. python tools/bench_decode.py --quick --out $OUT       # ~8 shapes, < 60 s
    PYTHONPATH=. python tools/bench_decode.py --out $OUT               # issue shapes + B x Sk grid + seqlen_q 4/16
    PYTHONPATH=. python tools/bench_decode.py --quick --splits 1,8,33  # forced num_splits as extra columns
    PYTHONPATH=. python tools/bench_decode.py --quick --tiles 16:4:3,16:4:4,32:4:3,16:8:2   # block_n:warps:stages
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
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
LAYOUTS = ("contig", "paged16", "paged64")


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

    def __init__(self, shape, dtype, torch, sdpa: bool, page_sizes):
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
        self.sdpa = None
        if sdpa and torch is not None:
            self.sdpa = tuple(x.transpose(1, 2).contiguous() for x in (self.q, self.k, self.v))


def _rtk_fn(rtk, layout, dtype, torch, **kw):
    extra = {} if torch is not None else ({"dtype": "bfloat16"} if dtype == "bfloat16" else {})

    def fn(s):
        if layout == "contig":
            rtk.attention_kvcache(s.q, s.k, s.v, s.lens, out=s.out, **extra, **kw)
        else:
            kc, vc, table = s.paged[int(layout[5:])]
            rtk.attention_kvcache(s.q, kc, vc, s.lens, block_table=table, out=s.out, **extra, **kw)
    return fn


def _sdpa_fn(torch, backend):
    """SDPA without a mask: its is_causal aligns top-left (query i sees keys <= i), which for
    seqlen_q < seqlen_k would skip nearly the whole cache; the bottom-right triangle rtk masks
    (seqlen_q <= 16 here) changes no byte read."""
    from torch.nn.attention import sdpa_kernel
    F = torch.nn.functional

    def fn(s):
        q, k, v = s.sdpa
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return fn


def _plan_of(kv, s, layout, dtype, torch, kw):
    """(config, num_splits) the op runs for this set and layout."""
    if layout == "contig":
        arrays = (s.q, s.k, s.v, s.lens, None, None, None, s.out)
    else:
        kc, vc, table = s.paged[int(layout[5:])]
        arrays = (s.q, kc, vc, s.lens, table, None, None, s.out)
    plan, _ = kv._plan(arrays, True, None, False, kw.get("num_splits"), None if torch is not None else
                       ("bfloat16" if dtype == "bfloat16" else None))
    return plan.config, plan.num_splits


def _short(cfg, splits):
    return f"r{cfg.rows} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} x{splits}"


def bench_shape(shape, dtype, torch, rtk, kv, args, copy_gbs):
    b, sk, h, hkv, d, sq = shape
    nbytes = _kv_bytes(b, sk, hkv, d)
    nsets = max(1, min(8, -(-ROTATE_BYTES // nbytes)))
    pages = [int(x[5:]) for x in args.layouts if x.startswith("paged")]
    sets = [Set(shape, dtype, torch, not args.no_sdpa, pages) for _ in range(nsets)]
    inputs = [(s,) for s in sets]
    cands = {}
    for layout in args.layouts:
        if layout != "contig" and int(layout[5:]) not in sets[0].paged:
            continue
        cands[f"rtk_{layout}"] = (_rtk_fn(rtk, layout, dtype, torch), layout, {})
        for n in args.splits:
            cands[f"rtk_{layout}_x{n}"] = (_rtk_fn(rtk, layout, dtype, torch, num_splits=n), layout,
                                           {"num_splits": n})
    if torch is not None and not args.no_sdpa:
        from torch.nn.attention import SDPBackend
        for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            cands[name] = (_sdpa_fn(torch, be), None, None)
    row = {"batch": b, "seqlen_k": sk, "heads": f"{h}/{hkv}", "head_dim": d, "seqlen_q": sq, "MB": nbytes / 1e6,
           "sets": nsets}
    live = {}
    for name, (fn, layout, kw) in cands.items():
        try:
            fn(sets[0])   # compile, plan, warm
            if layout is not None:
                cfg, splits = _plan_of(kv, sets[0], layout, dtype, torch, kw)
                row[f"{name}_cfg"] = _short(cfg, splits)
            live[name] = fn
        except Exception as exc:   # noqa: BLE001 - a peer without support for this shape
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    times = {n: [] for n in live}
    for _ in range(args.rounds):   # interleaved: every candidate once per round
        for name, fn in live.items():
            ms, host_us, drained = bu.time_queued(fn, inputs, warmup=2, repeat=args.repeat)
            times[name].append(ms)
            row[f"{name}_host_us"] = host_us
    for name, ts in times.items():
        ms = statistics.median(ts)
        row[f"{name}_us"] = ms * 1e3
        row[f"{name}_GBs"] = nbytes / (ms * 1e-3) / 1e9
        row[f"{name}_%copy"] = 100 * row[f"{name}_GBs"] / copy_gbs
    if "rtk_contig_GBs" in row and "sdpa_cudnn_GBs" in row:
        row["rtk/cudnn"] = row["rtk_contig_GBs"] / row["sdpa_cudnn_GBs"]
    for ps in pages:
        if f"rtk_paged{ps}_GBs" in row and "rtk_contig_GBs" in row:
            row[f"paged{ps}/contig"] = row[f"rtk_paged{ps}_GBs"] / row["rtk_contig_GBs"]
    del sets, inputs
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


def compile_time(dtype: str) -> dict:
    """Cold compile (empty disk cache) and warm load of a decode config for a head dim."""
    import rtkernels as rtk
    from rtkernels import cache, device, kernel
    from rtkernels.ops.attention_kvcache import choose_config
    cfg = choose_config(dtype, 96, 8, True, False, device.current_arch())
    with tempfile.TemporaryDirectory(prefix="rtk-decode-cold-") as d:
        old = os.environ.get("RTKERNELS_CACHE_DIR")
        os.environ["RTKERNELS_CACHE_DIR"] = d
        try:
            cache.clear_memory()
            kernel._clear_memo()
            t0 = time.perf_counter()
            k = rtk.get_kernel(cfg)
            cold = time.perf_counter() - t0
            cache.clear_memory()
            kernel._clear_memo()
            t0 = time.perf_counter()
            k = rtk.get_kernel(cfg)
            k.function()
            warm = time.perf_counter() - t0
        finally:
            if old is None:
                del os.environ["RTKERNELS_CACHE_DIR"]
            else:
                os.environ["RTKERNELS_CACHE_DIR"] = old
            cache.clear_memory()
            kernel._clear_memo()
    return {"config": cfg.key(), "cold_compile_s": cold, "warm_disk_load_s": warm}


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
    p.add_argument("--no-host", action="store_true", help="skip host time per call and the compile time")
    args = p.parse_args()
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.splits = [int(x) for x in args.splits.split(",") if x]
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
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
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
        extra["compile"] = compile_time(args.dtype)
    name = "bench_decode_quick" if args.quick else "bench_decode"
    path = bu.save(args.out, name, {"environment": env, "copy_GBs": copy_gbs, "rows": rows, **extra})
    series = {}
    for cand in ("rtk_contig", "rtk_paged16", "rtk_paged64", "sdpa_cudnn", "sdpa_flash"):
        pts = sorted((r["batch"] * r["seqlen_k"], r[f"{cand}_%copy"]) for r in rows
                     if f"{cand}_%copy" in r and r.get("seqlen_q") == 1 and r.get("head_dim") == 128)
        if pts:
            series[cand] = ([x for x, _ in pts], [y for _, y in pts])
    png = bu.plot(args.out, name, series, "batch x seqlen_k (seqlen_q 1, d128)", "% of device copy",
                  f"decode, {args.dtype}, {env['gpu']}") if series else None
    print(f"\n{env['gpu']} ({env['arch']}, {env['date']}), {args.dtype}: device copy {copy_gbs:.0f} GB/s; JSON {path}"
          + (f"; plot {png}" if png else "") + f"; {time.time() - t_start:.0f} s")
    if extra:
        print("host us/call:", {k: round(v, 1) for k, v in extra["host"].items()})
        c = extra["compile"]
        print(f"cold compile {c['cold_compile_s'] * 1e3:.0f} ms, warm load {c['warm_disk_load_s'] * 1e3:.0f} ms "
              f"({c['config']})")
    cols = ["batch", "seqlen_k", "heads", "head_dim", "seqlen_q"]
    cols += [f"rtk_{lay}_%copy" for lay in args.layouts] + ["sdpa_cudnn_%copy", "sdpa_flash_%copy", "rtk/cudnn"]
    cols += [f"{lay}/contig" for lay in args.layouts if lay != "contig"] + ["rtk_contig_GBs", "rtk_contig_cfg"]
    cols += [f"rtk_{lay}_x{n}_%copy" for lay in args.layouts[:1] for n in args.splits]
    if args.tiles:
        cols.append("tiles")
    print(bu.table(rows, cols))


if __name__ == "__main__":
    main()
