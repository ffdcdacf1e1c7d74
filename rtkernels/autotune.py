"""The autotuner every kernel family shares: time candidate configs, remember the winner.

>>> cfg = autotune.pick("matmul", {"dtype": "bfloat16", "m": 4096, ...}, candidates, run, default)

``pick`` returns ``default`` unless tuning is on (``RTKERNELS_AUTOTUNE=1``).  When it is, it
looks the key up (in this process, then in the tuning file), and only on a miss:

1. prunes candidates before anything launches: dynamic shared memory beyond the arch's
   per-block limit, then - after compiling - any register spill or local stack in the ptxas
   report, or a failed compile;
2. times each survivor with CUDA events around batches of back-to-back calls (``warmup``
   untimed calls, then the median of ``repeat`` batches), in ``ROUNDS`` interleaved passes; the
   caller's ``run`` rotates its input sets (``rotated_copies`` helps) so the L2 cache does not
   flatter small problems;
3. keeps the heuristic's default unless a candidate is faster by more than ``MARGIN``, and
   stores the winner in ``<cache root>/autotune-v1.json``, keyed by (device name, driver,
   NVRTC version, family, the caller's key - dtype, shape bucket, layout ...).

The file is shared by concurrent processes the way the kernel cache is: writers hold an
exclusive ``fcntl.flock`` on ``autotune-v1.lock``, re-read the file, merge their entry, write a
temporary file beside it and ``os.replace`` it into place, so readers (who take no lock) see a
whole old or whole new file, and no writer loses another's entry.  An unreadable file is
treated as empty with a warning and rewritten on the next store.

The file is trusted as the kernel cache is (see :mod:`rtkernels.cache`): read and written only
in a root only the user (or, in shared mode, the user's group) can write, written owner-only
(0600; 0640 shared) whatever the umask, and refused when others could write it.  A stored
config that its family's validation rejects is dropped with a warning, never used.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from . import cache
from ._env import getenv


SCHEMA = 1
# Interleaved timing passes per candidate, and how much faster than the heuristic's default a
# candidate must measure to replace it: run-to-run spread of one config is 1-2% on an H200.
ROUNDS = 3
MARGIN = 0.02
_memo: dict[str, Any] = {}
_lock = threading.Lock()


class AutotuneWarning(UserWarning):
    """A candidate failed to compile, or the tuning file could not be read or written."""


def enabled() -> bool:
    """``RTKERNELS_AUTOTUNE=1`` turns tuning on; anything else (default ``0``) leaves it to the heuristics."""
    return getenv("RTKERNELS_AUTOTUNE", "0") == "1"   # read per call: launch-plan keys include it


def path() -> Path:
    """The tuning file, beside the kernel cache's versioned folders."""
    return cache.root() / f"autotune-v{SCHEMA}.json"


def _lock_path() -> Path:
    return cache.root() / f"autotune-v{SCHEMA}.lock"


def device_fields() -> dict[str, Any]:
    """What makes a timing valid only on this machine: GPU name, driver, NVRTC version."""
    from . import device
    from .compiler import nvrtc_version
    fields = {"nvrtc": ".".join(map(str, nvrtc_version()))}
    if device.has_gpu():
        fields.update(device=device.device_name(), driver=device.driver_version())
    else:
        fields.update(device="none", driver=0)
    return fields


def make_key(family: str, key: dict) -> str:
    """The tuning file's entry name: canonical JSON of device fields, family and the caller's key."""
    return json.dumps({**device_fields(), "family": family, **{f"k.{k}": v for k, v in key.items()}},
                      sort_keys=True, separators=(",", ":"), default=str)


# ---- the file ---------------------------------------------------------------------------
def load() -> dict[str, dict]:
    """All stored entries (an empty dict when the file is missing, unreadable or in an untrusted root)."""
    base = cache.trusted_root()
    if base is None:
        return {}   # missing root, or untrusted (the cache warned once)
    p = base / path().name
    try:
        data = json.loads(cache.read_file(p))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"rtkernels autotune: ignoring unreadable tuning file {p}: {exc}", AutotuneWarning,
                      stacklevel=2)
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def store(entries: dict[str, dict]) -> bool:
    """Merge ``entries`` into the file under the lock; returns False (with a warning) if it cannot."""
    import fcntl
    try:
        root = cache.trusted_root(create=True)
        if root is None:
            return False   # untrusted root: the cache warned once, and tuning stays in memory
        # flock needs no write access: a teammate's lock file serves in a shared cache
        lock_fd = os.open(root / _lock_path().name, os.O_RDONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0),
                          cache.file_mode())
        with os.fdopen(lock_fd, "rb") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                merged = load()
                merged.update(entries)
                fd, tmp = tempfile.mkstemp(prefix=".autotune-", suffix=".tmp", dir=root)
                try:
                    with os.fdopen(fd, "w") as f:
                        os.fchmod(f.fileno(), cache.file_mode())   # mkstemp's 0600, or 0640 when shared
                        json.dump({"schema": SCHEMA, "entries": merged}, f, indent=1, sort_keys=True)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, root / path().name)
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        return True
    except OSError as exc:
        warnings.warn(f"rtkernels autotune: could not write {path()}: {exc}", AutotuneWarning, stacklevel=2)
        return False


def clear_memory() -> None:
    """Forget winners memoized in this process (the file is untouched)."""
    with _lock:
        _memo.clear()


# ---- config (de)serialization -------------------------------------------------------------
def _as_dict(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _from_stored(family: str, stored: Any, candidates: Sequence) -> Any | None:
    """The candidate equal to a stored config, or None: the candidate list changed since, or
    (with a warning) the stored config is one its family's validation rejects."""
    if not isinstance(stored, dict):
        warnings.warn(f"rtkernels autotune: dropping a tuned {family} config from {path()}: not a mapping "
                      f"({stored!r})", AutotuneWarning, stacklevel=3)
        return None
    for c in candidates:
        if _as_dict(c) == stored:
            return c
    # Not one of today's candidates: tuned by another version, or written by hand.  Validate it
    # as its config class would, so a config that could never be built is reported, not ignored.
    from .errors import ConfigError
    for cls in dict.fromkeys(type(c) for c in candidates):
        if not dataclasses.is_dataclass(cls) or set(stored) != {f.name for f in dataclasses.fields(cls) if f.init}:
            continue
        try:
            cls(**stored)
        except (ConfigError, TypeError) as exc:
            warnings.warn(f"rtkernels autotune: dropping the tuned {family} config {stored} from {path()}: {exc}",
                          AutotuneWarning, stacklevel=3)
        return None
    return None


# ---- pruning and timing -----------------------------------------------------------------
def prune(candidates: Sequence, *, arch: str | None = None, kernel: str | None = None) -> list:
    """Candidates that fit the arch's shared memory and compile without spills or a stack.

    The shared-memory check needs no compile (``shared_mem_bytes`` of the config); the
    spill check reads the ptxas report of the compiled kernel (cached, so the winner's
    later launch costs nothing extra).
    """
    from . import arch as arch_mod
    from .errors import CompileError, ConfigError
    from .kernel import get_kernel, resolve_arch
    target = resolve_arch(arch, any(getattr(c, "needs_arch_specific", False) for c in candidates))
    limit = arch_mod.limits(target).max_smem_per_block_optin
    kept = []
    for c in candidates:
        dyn = int(getattr(c, "shared_mem_bytes", 0) or 0)
        if dyn > limit:
            continue
        try:
            k = get_kernel(c, kernel, arch=target)
            r = k.resources
        except (CompileError, ConfigError) as exc:
            warnings.warn(f"rtkernels autotune: dropping {c.key()}: {exc}", AutotuneWarning, stacklevel=2)
            continue
        if r.spill_stores or r.spill_loads or r.stack_frame or r.shared_static + dyn > limit:
            continue
        kept.append(c)
    return kept


def time_run(run: Callable[[Any], None], cfg, *, warmup: int = 3, repeat: int = 10) -> float:
    """Median milliseconds per call of ``run(cfg)``: ``repeat`` batches of back-to-back calls
    between two CUDA events, each batch lasting about a millisecond.

    Events around a single call would also time the host's work between them (argument checks,
    tensor maps, the launch: 10-40 us), which is as long as a small problem's kernel and as
    noisy: measured on an H200 (2026-11-21), the tuner then picked tiles 5-20% slower than the
    heuristic's at 256^3-8192^3.  Back to back, the host enqueues ahead of the GPU."""
    import cupy as cp
    for _ in range(warmup):
        run(cfg)
    stream = cp.cuda.get_current_stream()
    stream.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    run(cfg)
    end.record(stream)
    end.synchronize()
    batch = max(1, min(64, int(1.0 / max(cp.cuda.get_elapsed_time(start, end), 1e-3))))
    times = []
    for _ in range(repeat):
        start.record(stream)
        for _ in range(batch):
            run(cfg)
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / batch)
    return statistics.median(times)


def rotated_copies(arrays: Sequence, l2_bytes: int | None = None, max_sets: int = 8) -> list[tuple]:
    """Input sets for timing: ``arrays`` plus enough same-layout copies to exceed twice the L2.

    Each copy keeps the original's shape, strides and alignment modulo 256 bytes, so every
    candidate sees the same memory layout as the real call.
    """
    import cupy as cp
    if l2_bytes is None:
        l2_bytes = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice()).get("l2CacheSize", 50 << 20))
    spans = [_span(a) for a in arrays]
    per_set = max(1, sum(spans))
    n = max(1, min(max_sets, -(-2 * l2_bytes // per_set)))
    sets = [tuple(arrays)]
    for _ in range(n - 1):
        sets.append(tuple(_clone(a, s) for a, s in zip(arrays, spans)))
    return sets


def _span(a) -> int:
    if a is None:
        return 0
    return a.itemsize + sum((d - 1) * s for d, s in zip(a.shape, a.strides)) if a.size else 0


def _clone(a, span: int):
    import cupy as cp
    if a is None or span == 0:
        return a
    shift = a.data.ptr % 256
    buf = cp.empty(span + 256, dtype=cp.uint8)
    dst = buf.data + shift
    dst.copy_from_device(a.data, span)
    return cp.ndarray(a.shape, dtype=a.dtype, memptr=dst, strides=a.strides)   # dst keeps buf alive


# ---- the entry point ----------------------------------------------------------------------
def pick(family: str, key: dict, candidates: Sequence, run: Callable[[Any], None], default, *,
         arch: str | None = None, kernel: str | None = None, warmup: int = 3, repeat: int = 10,
         measure: Callable[[Callable, Any], float] | None = None, force: bool | None = None):
    """The best of ``candidates`` for ``key``, or ``default`` when tuning is off.

    Parameters
    ----------
    family : the kernel family name (part of the stored key).
    key : JSON-able description of the problem class (dtype, shape bucket, layout, ...).
    candidates : configs to consider; ``default`` is added if missing.
    run : ``run(config)`` launches one call of the op with that config (asynchronously).
    default : the heuristic's choice; returned when tuning is off or nothing survives pruning.
    arch, kernel : compile target and entry point used for pruning.
    warmup, repeat : untimed calls, then timed calls whose median decides.
    measure : ``measure(run, config) -> ms``; default CUDA-event timing (:func:`time_run`).
    force : override ``RTKERNELS_AUTOTUNE``.

    Returns
    -------
    A config from ``candidates`` (or ``default``).
    """
    if not (enabled() if force is None else force):
        return default
    cands = list(dict.fromkeys([default, *candidates]))
    name = make_key(family, key)
    with _lock:
        hit = _memo.get(name)
    if hit is not None and hit in cands:
        return hit
    stored = load().get(name)
    if stored is not None:
        cfg = _from_stored(family, stored.get("config") if isinstance(stored, dict) else stored, cands)
        if cfg is not None:
            with _lock:
                _memo[name] = cfg
            return cfg
    survivors = prune(cands, arch=arch, kernel=kernel)
    if not survivors:
        return default
    measure = measure or (lambda r, c: time_run(r, c, warmup=warmup, repeat=repeat))
    # ROUNDS interleaved passes over the candidates, each candidate's median across them: a clock
    # or thermal drift during the sweep then shifts every candidate alike instead of the ones
    # timed last.
    samples: dict = {c: [] for c in survivors}
    for _ in range(ROUNDS):
        for c in list(samples):
            try:
                samples[c].append(measure(run, c))
            except Exception as exc:  # noqa: BLE001  (a candidate that fails to launch is not a winner)
                warnings.warn(f"rtkernels autotune: {c.key()} failed to run: {exc}", AutotuneWarning, stacklevel=2)
                del samples[c]
    timings = [(statistics.median(v), c) for c, v in samples.items()]
    if not timings:
        return default
    best_ms, best = min(timings, key=lambda t: t[0])
    default_ms = next((ms for ms, c in timings if c == default), None)
    if default_ms is not None and best_ms > default_ms * (1 - MARGIN):
        best_ms, best = default_ms, default   # within the noise of the heuristic's own choice
    store({name: {"config": _as_dict(best), "ms": best_ms, "family": family, "when": time.strftime("%Y-%m-%d"),
                  "timings": {c.key(): ms for ms, c in timings}}})
    with _lock:
        _memo[name] = best
    return best
