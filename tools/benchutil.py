"""Shared timing and reporting for the benchmark scripts (run on a GPU host with PYTHONPATH=.).

Timing follows METHOD.md: warm up first, time with CUDA events, take the median of
repeats, and rotate among several input sets when one set would fit in L2.  Three ways, by how
much host time a call costs against its kernel: :func:`time_cuda` (events around each call;
kernels well above the host cost), :func:`time_batched` (events around batches of back-to-back
calls: the host's launch cost hides behind the kernels), :func:`time_queued` (every call queued
behind a spin kernel and timed back to back between two events, as a pipeline runs them, even when
the host is slower than the GPU).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for JSON/PNG results")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    return p


def time_cuda(fn, *, warmup: int = 3, repeat: int = 20, inputs=None) -> float:
    """Median milliseconds of ``fn(*inputs[i % len(inputs)])`` (or ``fn()``) over ``repeat`` timed calls."""
    import cupy as cp
    sets = inputs or [()]
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    cp.cuda.get_current_stream().synchronize()
    times = []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for i in range(repeat):
        start.record()
        fn(*sets[i % len(sets)])
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def time_batched(fn, warmup: int = 3, repeat: int = 10) -> float:
    """Median milliseconds per call of ``fn`` over ``repeat`` batches of back-to-back calls (a batch
    lasts >= ~2 ms), so the host's launch cost - larger for Triton's Python launcher - hides
    behind the kernels instead of being timed as idle GPU between events.

    Each batch is queued behind a spin kernel that lasts longer than the host needs to enqueue
    the batch (up to 400 us per call), so the first call's host time is hidden too: without it a
    call of >= 2 ms ran as a batch of one and its host time was timed as GPU time (0.35 ms of a
    varlen attention call's 2.2 ms on an H200, 2026-11-26)."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    batch = max(1, min(50, int(2.0 / max(cp.cuda.get_elapsed_time(start, end), 1e-3))))
    times = []
    for _ in range(repeat):
        _spin(cp, 1_000_000 + batch * 400_000)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / batch)
    return statistics.median(times)


def time_interleaved(runs, rounds: int = 3, repeat: int = 3) -> list[float]:
    """Each run's median ms per call (:func:`time_batched`) over ``rounds`` passes that time every run
    in turn, so clocks and neighbours drift alike for all candidates: on an H100 a short kernel reads
    20-40% faster after idle than after heavy work, and one-after-another timing (one call between
    events) read rtk's d128 causal 2k backward at 249 TFLOP/s while its fwd+bwd timing implied about
    380 for the same backward (2026-11-26)."""
    ms = [[] for _ in runs]
    for _ in range(rounds):
        for i, r in enumerate(runs):
            ms[i].append(time_batched(r, warmup=1, repeat=repeat))
    return [statistics.median(m) for m in ms]


_SPIN = None


def _spin(cp, ns: int) -> None:
    """Occupy the stream for ``ns`` nanoseconds (one block), so that the calls queued behind it
    are enqueued by the host before the GPU reaches them."""
    global _SPIN
    if _SPIN is None:
        _SPIN = cp.RawKernel(r'''
extern "C" __global__ void spin(long long ns) {
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}''', "spin")
    _SPIN((1,), (1,), (cp.int64(ns),))


def time_queued(fn, inputs, *, warmup: int = 3, repeat: int = 20, events: str = "ends"):
    """(GPU ms per call, host us per call, queue drained?) of ``fn(*inputs[i % len])``.

    Every call queued behind a spin kernel long enough for the host to enqueue them all (rotating
    inputs keep L2 honest).  ``events``: "ends" (the default since 2026-11-27) records two events
    around the whole queue and returns their interval / ``repeat`` - the calls back to back as a
    pipeline runs them, the brief's method; "each" records an event after every call and returns the
    median interval (the method of the benches' figures before).  An event between
    two kernels holds the second back: the gap from one kernel's last block to the next one's
    first grew from 1.6-1.8 us to 2.9-3.3 us with an event recorded between them (H200,
    2026-11-27, globaltimer stamps), so "each" charges every call ~1.5 us a pipeline does not pay.
    If the host needed longer than the spin, ``drained`` is True and the times include host gaps."""
    import cupy as cp
    if events not in ("each", "ends"):
        raise ValueError(f"time_queued: events={events!r}; 'each' or 'ends'")
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    cp.cuda.get_current_stream().synchronize()
    spin_ns = 2_000_000 + repeat * 150_000
    marks = [cp.cuda.Event() for _ in range(repeat + 1 if events == "each" else 2)]
    _spin(cp, spin_ns)
    t0 = time.perf_counter()
    marks[0].record()
    for i in range(repeat):
        fn(*inputs[i % len(inputs)])
        if events == "each":
            marks[i + 1].record()
    if events == "ends":
        marks[1].record()
    host_s = time.perf_counter() - t0
    marks[-1].synchronize()
    if events == "ends":
        ms = cp.cuda.get_elapsed_time(marks[0], marks[1]) / repeat
    else:
        ms = statistics.median(cp.cuda.get_elapsed_time(a, b) for a, b in zip(marks, marks[1:]))
    return ms, host_s / repeat * 1e6, host_s * 1e9 > spin_ns


def time_synced(fn, inputs, *, warmup: int = 3, repeat: int = 20, sync=None) -> float:
    """Median microseconds of one call of ``fn(*inputs[i % len])`` as a caller waiting for its result
    sees it: host time (checks, launch) plus kernel time, the stream synchronized after each call
    (``sync``: how, default CuPy's current stream)."""
    import cupy as cp
    sync = sync or cp.cuda.get_current_stream().synchronize
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    sync()
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(*inputs[i % len(inputs)])
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def time_host(fn, calls: int) -> float:
    """Microseconds per call of a host loop of ``calls`` calls, ending with a device synchronize."""
    import cupy as cp
    for _ in range(100):
        fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, GB/s counting bytes read plus bytes written (the memory-bound ceiling),
    timed as the kernels are (:func:`time_queued`: copies back to back between two events; before
    2026-11-27 events around each synchronized copy, which charged each copy an event's delay)."""
    import cupy as cp
    x = cp.empty(nbytes // 4, dtype=cp.float32)
    x.fill(1.0)
    y = cp.empty_like(x)
    ms, _, _ = time_queued(lambda: y.data.copy_from_device(x.data, nbytes), [()], warmup=3, repeat=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def environment() -> dict:
    import cupy as cp
    from rtkernels import device
    from rtkernels.compiler import nvrtc_version
    return {"date": time.strftime("%Y-%m-%d"), "gpu": device.device_name(), "arch": device.device_arch(),
            "sms": device.sm_count(), "driver": device.driver_version(), "nvrtc": ".".join(map(str, nvrtc_version())),
            "cupy": cp.__version__, "python": platform.python_version()}


def table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of ``rows`` restricted to ``columns`` (floats to 3 significant figures)."""
    def fmt(v):
        if v is None:   # a peer that is absent or refused the cell
            return "—"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def save(out: str, name: str, payload: dict) -> Path:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def plot(out: str, name: str, series: dict, xlabel: str, ylabel: str, title: str, logx: bool = True) -> Path | None:
    """series: label -> (xs, ys).  Skipped quietly when matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = Path(out) / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def attention_peers(env: dict):
    """(torch, {name: SDPA backend}) for the attention benchmarks; (None, {}) without torch.
    Records torch's version in ``env``."""
    try:
        import torch
        from torch.nn.attention import SDPBackend
    except ImportError:
        return None, {}
    env["torch"] = torch.__version__
    return torch, {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


@functools.lru_cache(maxsize=None)   # a failed import of the CuTe DSL runtime is not retried per cell
def fa4():
    """FlashAttention-4's ``(flash_attn_func, flash_attn_varlen_func)`` (CuTe DSL, an optional peer
    brought to the GPU machine as in ../shared/anchors/README.md), or ``(None, None)`` when it or its
    CuTe DSL runtime is absent.  Its first call per configuration compiles for 2-6 s: call it once
    before timing."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception:   # absent, or its CuTe DSL runtime is
        return None, None
    return flash_attn_func, flash_attn_varlen_func


def first(out):
    """The output of an attention call that returns it alone or as ``(out, lse, ...)`` (FA4's
    return differs between versions)."""
    return out[0] if isinstance(out, tuple) else out


def autograd_timers(fn, leaves, do=None):
    """``(backward, forward_backward, grads)`` of a torch attention function ``fn(*leaves)``.

    ``leaves``: tensors with requires_grad; ``do``: the output's gradient (random when None).  One
    forward and backward run here (a peer's compile, and the gradients to compare, stay outside the
    timing); ``backward`` replays the backward alone on the kept graph (``retain_graph``),
    ``forward_backward`` runs both.  Both clear the leaves' grads first, so no accumulation kernel is
    timed.  Raises whatever ``fn`` raises for a shape it refuses."""
    import torch
    out = first(fn(*leaves))
    if do is None:
        do = torch.randn_like(out)
    out.backward(do, retain_graph=True)
    grads = tuple(t.grad for t in leaves)

    def backward():
        for t in leaves:
            t.grad = None
        out.backward(do, retain_graph=True)

    def forward_backward():
        for t in leaves:
            t.grad = None
        first(fn(*leaves)).backward(do)
    return backward, forward_backward, grads


def ratio_vs_best(row: dict, peers=("fa4", "sdpa_cudnn")) -> None:
    """``row["ratio_vs_best"]`` = rtk over the fastest of ``peers`` that ran (the attention issue's
    target: >= 1.0x the faster of FA4 and cuDNN), ``row["best_peer"]`` its name; None without one."""
    ran = {n: row[f"{n}_tflops"] for n in peers if row.get(f"{n}_tflops")}
    best = max(ran, key=ran.get) if ran else None
    row["best_peer"] = best
    row["ratio_vs_best"] = row["rtk_tflops"] / ran[best] if best else None


@contextlib.contextmanager
def empty_disk_cache():
    """For the block: RTKERNELS_CACHE_DIR an empty temporary folder and nothing compiled in memory;
    both restored after it."""
    from rtkernels import cache
    with tempfile.TemporaryDirectory(prefix="rtk-cold-") as d:
        old = os.environ.get("RTKERNELS_CACHE_DIR")
        os.environ["RTKERNELS_CACHE_DIR"] = d
        try:
            cache.clear_memory()
            yield d
        finally:
            if old is None:
                del os.environ["RTKERNELS_CACHE_DIR"]
            else:
                os.environ["RTKERNELS_CACHE_DIR"] = old
            cache.clear_memory()


def compile_times(cfg) -> dict:
    """Cold compile (an empty disk cache, nothing in memory) and warm start (the disk entry
    read back and the module loaded into the context) of one config, in seconds."""
    import rtkernels as rtk
    from rtkernels import cache
    with empty_disk_cache():
        t0 = time.perf_counter()
        rtk.get_kernel(cfg)
        cold = time.perf_counter() - t0
        cache.clear_memory()
        t0 = time.perf_counter()
        rtk.get_kernel(cfg).function()   # module load into the context counts as part of a warm start
        warm = time.perf_counter() - t0
    return {"config": cfg.key(), "cold_compile_s": cold, "warm_disk_load_s": warm}
