"""Two-level kernel cache: a dict in the process, and entries on disk.

Disk layout (``RTKERNELS_CACHE_DIR``, default ``$XDG_CACHE_HOME/rtkernels`` or
``~/.cache/rtkernels``, created mode 0700)::

    <root>/v<SCHEMA>/<key[:2]>/<key>/kernel.cubin   the CUBIN (or kernel.ptx)
                                     meta.json      key parts, resources, NVRTC version, sha256 of the code
                                     source.cu      the rendered source (for inspection)

An entry is written into a private temporary folder, every file fsync'ed, and the
folder renamed into place: rename of a folder onto a missing name is atomic, so readers
see a whole entry or none, and when several processes compile the same key at once the
first rename wins and the others discard their copy.  An entry whose digest does not
match its code is discarded with a warning and rebuilt, never loaded.  A read-only or
full cache folder switches the process to memory-only caching with one warning.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path

SCHEMA = 1

_lock = threading.Lock()
_memory: dict[str, object] = {}
_stats = {"memory_hits": 0, "disk_hits": 0, "misses": 0, "corrupt": 0, "disk_write_failures": 0}
_disk_off_reason: str | None = None


class CacheWarning(UserWarning):
    """The disk cache could not be used as intended (corrupt entry, unwritable folder)."""


def root() -> Path:
    env = os.environ.get("RTKERNELS_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rtkernels"


def disk_enabled() -> bool:
    return os.environ.get("RTKERNELS_CACHE", "1") != "0" and _disk_off_reason is None


def stats() -> dict:
    """Hit/miss counters of this process: memory_hits, disk_hits, misses, corrupt, disk_write_failures."""
    with _lock:
        return dict(_stats)


def reset_stats() -> None:
    with _lock:
        for k in _stats:
            _stats[k] = 0


def clear_memory() -> None:
    """Forget in-process entries (the disk level is untouched)."""
    with _lock:
        _memory.clear()
    from . import kernel
    kernel._clear_memo()


def _count(name: str) -> None:
    with _lock:
        _stats[name] += 1


def make_key(parts: dict) -> str:
    """sha256 over the canonical JSON of every part that can change the compiled code."""
    blob = json.dumps({"schema": SCHEMA, **parts}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


_headers_digest: str | None = None


def headers_digest() -> str:
    """Digest of every project device header (templates/include): a change there changes every key."""
    global _headers_digest
    if _headers_digest is None:
        from .render import include_dir
        h = hashlib.sha256()
        for p in sorted(include_dir().rglob("*.cuh")):
            h.update(p.relative_to(include_dir()).as_posix().encode())
            h.update(p.read_bytes())
        _headers_digest = h.hexdigest()
    return _headers_digest


def _entry_dir(key: str) -> Path:
    return root() / f"v{SCHEMA}" / key[:2] / key


def memory_get(key: str):
    with _lock:
        hit = _memory.get(key)
        if hit is not None:
            _stats["memory_hits"] += 1
        return hit


def memory_put(key: str, value) -> None:
    with _lock:
        _memory[key] = value


def disk_get(key: str):
    """Return (code, meta, source) of a valid entry, or None.  Corrupt entries are dropped."""
    if not disk_enabled():
        return None
    d = _entry_dir(key)
    try:
        meta = json.loads((d / "meta.json").read_text())
        code = (d / meta["code_file"]).read_bytes()
        source = (d / "source.cu").read_text() if (d / "source.cu").exists() else ""
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    except (OSError, ValueError, KeyError) as exc:
        _discard(d, f"unreadable ({exc})")
        return None
    if hashlib.sha256(code).hexdigest() != meta.get("code_sha256") or meta.get("key") != key:
        _discard(d, "digest mismatch")
        return None
    _count("disk_hits")
    return code, meta, source


def _discard(d: Path, why: str) -> None:
    _count("corrupt")
    warnings.warn(f"rtkernels: discarding corrupt cache entry {d} ({why}); recompiling", CacheWarning,
                  stacklevel=4)
    trash = d.with_name(f".trash-{d.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(d, trash)
        shutil.rmtree(trash, ignore_errors=True)
    except OSError:
        pass  # another process removed or replaced it first


def _disable_disk(reason: str) -> None:
    global _disk_off_reason
    if _disk_off_reason is None:
        _disk_off_reason = reason
        warnings.warn(f"rtkernels: disk cache disabled for this process ({reason}); "
                      "kernels are cached in memory only. Set RTKERNELS_CACHE_DIR to a writable folder.",
                      CacheWarning, stacklevel=4)


def _ensure_dir(p: Path) -> None:
    p.mkdir(parents=True, exist_ok=True, mode=0o700)


def disk_put(key: str, code: bytes, code_file: str, meta: dict, source: str) -> None:
    """Write an entry atomically; a failure to write is a warning, never an error."""
    if not disk_enabled():
        return
    final = _entry_dir(key)
    if final.exists():
        return
    meta = dict(meta, key=key, code_file=code_file, code_sha256=hashlib.sha256(code).hexdigest(),
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    tmp = None
    try:
        r = root()
        if not r.exists():
            _ensure_dir(r)
            os.chmod(r, 0o700)
        _ensure_dir(final.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=final.parent))
        for name, data in ((code_file, code), ("source.cu", source.encode()),
                           ("meta.json", json.dumps(meta, indent=1, sort_keys=True).encode())):
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        try:
            os.rename(tmp, final)
            tmp = None
        except OSError:
            if not final.exists():
                raise
            # another process renamed its identical entry first: keep theirs
        _fsync_dir(final.parent)
    except OSError as exc:
        _count("disk_write_failures")
        _disable_disk(f"cannot write to {root()}: {exc.strerror or exc}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_failed_source(name: str, source: str) -> str | None:
    """Keep the rendered source of a failed compile where the user can open it."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    for base in ((root() / "failed") if disk_enabled() else None, Path(tempfile.gettempdir()) / "rtkernels-failed"):
        if base is None:
            continue
        try:
            _ensure_dir(base)
            path = base / f"{name}-{digest}.cu"
            path.write_text(source)
            return str(path)
        except OSError:
            continue
    return None


# ---- the `rtk cache` command --------------------------------------------------------------
def list_entries() -> list[dict]:
    """Metadata of every valid-looking disk entry (newest first)."""
    base = root() / f"v{SCHEMA}"
    out = []
    if not base.is_dir():
        return out
    for meta_path in base.glob("??/*/meta.json"):
        if meta_path.parent.name.startswith("."):
            continue
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        size = sum(p.stat().st_size for p in meta_path.parent.iterdir() if p.is_file())
        out.append({"key": meta.get("key", meta_path.parent.name), "family": meta.get("family"),
                    "config": meta.get("config"), "arch": meta.get("arch"), "output": meta.get("output"),
                    "nvrtc": meta.get("nvrtc_version"), "created": meta.get("created"), "bytes": size,
                    "path": str(meta_path.parent)})
    out.sort(key=lambda e: e.get("created") or "", reverse=True)
    return out


def info() -> dict:
    entries = list_entries()
    return {"root": str(root()), "schema": SCHEMA, "disk_enabled": disk_enabled(),
            "disabled_reason": _disk_off_reason or ("RTKERNELS_CACHE=0" if os.environ.get("RTKERNELS_CACHE") == "0"
                                                    else None),
            "entries": len(entries), "bytes": sum(e["bytes"] for e in entries), "process_stats": stats()}


def clear() -> int:
    """Delete every disk entry (and leftovers); returns the number of entries removed."""
    n = len(list_entries())
    base = root()
    for sub in list(base.glob("v*")) + [base / "failed"]:
        shutil.rmtree(sub, ignore_errors=True)
    clear_memory()
    return n
