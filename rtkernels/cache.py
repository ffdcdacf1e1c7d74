"""Two-level kernel cache: a dict in the process, and entries on disk.

Disk layout (``RTKERNELS_CACHE_DIR``, default ``$XDG_CACHE_HOME/rtkernels`` or
``~/.cache/rtkernels``, created mode 0700)::

    <root>/v<SCHEMA>/<key[:2]>/<key>/kernel.cubin   the CUBIN (or kernel.ptx)
                                     meta.json      key parts, resources, NVRTC version, sha256 of the code
                                     source.cu      the rendered source (for inspection)

Whoever can write into the cache chooses the GPU code this process runs, so the disk level
is used only when nobody else can (pip's rule for its cache, OpenSSH's StrictModes for key
files).  Before the first disk read of a process the root is checked, once per root: it and
the versioned folder must belong to the user (or root) and be writable by nobody else, and
no folder above it (up to ``$HOME`` or ``/``) may be world-writable without the sticky bit,
or another user could swap the root for one of theirs.  Each two-hex subfolder is checked
the first time it is met.  ``RTKERNELS_CACHE_SHARED=1`` makes a team cache an explicit
choice: folders may then be group-writable by (and belong to) a group the user is in, and
entries are written group-readable; a world-writable folder is refused in both modes.  A
failed check gives one :class:`CacheWarning` naming the folder, its owner and mode and the
fix, and the process caches in memory only: nothing is read from or written to that root.

An entry is written into a private temporary folder (files 0600, folders 0700 - 0640/0750
in shared mode - whatever the umask), every file fsync'ed, and the folder renamed into
place: rename of a folder onto a missing name is atomic, so readers see a whole entry or
none, and when several processes compile the same key at once the first rename wins and
the others discard their copy.  An entry whose digest does not match its code, or whose
files are writable by others, is discarded with a warning and rebuilt, never loaded.  A
read-only or full cache folder switches the process to memory-only caching with one warning.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Callable

SCHEMA = 1

_lock = threading.Lock()
_memory: dict[str, object] = {}
_stats = {"memory_hits": 0, "disk_hits": 0, "misses": 0, "corrupt": 0, "disk_write_failures": 0}
_disk_off_reason: str | None = None
_clear_hooks: list[Callable[[], None]] = []


class CacheWarning(UserWarning):
    """The disk cache could not be used as intended (untrusted or unwritable folder, corrupt entry)."""


def root() -> Path:
    """The configured cache root (``RTKERNELS_CACHE_DIR``, else the XDG cache folder)."""
    env = os.environ.get("RTKERNELS_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rtkernels"


def shared_mode() -> bool:
    """``RTKERNELS_CACHE_SHARED=1``: a team cache, writable by one group the user belongs to."""
    return os.environ.get("RTKERNELS_CACHE_SHARED", "0") == "1"


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


def on_clear_memory(hook: Callable[[], None]) -> None:
    """Have :func:`clear_memory` also call ``hook`` (layers above keep memos of their own)."""
    if hook not in _clear_hooks:
        _clear_hooks.append(hook)


def clear_memory() -> None:
    """Forget in-process entries, and the memos registered with :func:`on_clear_memory` (the disk is untouched)."""
    with _lock:
        _memory.clear()
    for hook in list(_clear_hooks):
        hook()


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


# ---- who can write the cache ------------------------------------------------------------
# Indirections the tests replace: CI cannot chown a folder to another user.
_lstat = os.lstat
_fstat = os.fstat
_euid = os.geteuid


def _groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def _modes(shared: bool) -> tuple[int, int, int]:
    """(folders on the way to entries, entry folders, entry files) for new things we create.

    Shared mode: the way to entries is group-writable so teammates can add entries, with the
    setgid bit so what they create keeps the cache's group; entries are group-readable only,
    so one teammate's entry cannot be rewritten in place by another."""
    return (0o2770, 0o750, 0o640) if shared else (0o700, 0o700, 0o600)


def file_mode() -> int:
    """Permissions for files written into the cache (0600; 0640 in shared mode)."""
    return _modes(shared_mode())[2]


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        import grp
        return f"gid {gid} ({grp.getgrgid(gid).gr_name})"
    except (ImportError, KeyError):
        return f"gid {gid}"


def _problem(st, shared: bool, want_dir: bool = True) -> str | None:
    """Why others could write what ``st`` describes, or None when only trusted users can."""
    mode = st.st_mode
    if want_dir and not stat.S_ISDIR(mode):
        return "is a symbolic link, not a folder" if stat.S_ISLNK(mode) else "is not a folder"
    if not want_dir and not stat.S_ISREG(mode):
        return "is not a regular file"
    if mode & stat.S_IWOTH:
        return "is writable by every user"
    mine = st.st_uid in (_euid(), 0)
    if mine and not mode & stat.S_IWGRP:
        return None   # the common case, decided without asking for the group list
    ours = shared and st.st_gid in _groups()
    if not mine and not ours:
        return "belongs to another user"
    if mode & stat.S_IWGRP and not ours:
        return (f"is writable by its group {_group(st.st_gid)}, which you are not in" if shared
                else "is writable by its group")
    return None


def _fix(path: Path, st, problem: str, is_parent: bool = False) -> str:
    """How to make ``path`` acceptable, for the warning."""
    private = "or point RTKERNELS_CACHE_DIR at a folder of your own (mkdir -m 700)"
    mine = st.st_uid == _euid()
    if is_parent:
        return f"chmod o-w {path} (or chmod +t {path}), {private}"
    if "symbolic link" in problem or "not a folder" in problem:
        return f"remove {path}, {private}"
    if "every user" in problem:
        return (f"{'chmod 700 ' + str(path) + ', ' if mine else ''}{private}; a shared cache "
                "(RTKERNELS_CACHE_SHARED=1) may be group-writable but never world-writable")
    if "another user" in problem:
        return (f"{private}; for a team cache set RTKERNELS_CACHE_SHARED=1 and give the folder a group "
                "you share (chgrp)")
    return (f"chmod 700 {path}, {private}; or, if the group is meant to share it, set "
            "RTKERNELS_CACHE_SHARED=1")


def _describe(path: Path, st) -> str:
    return f"{path} (owner {_owner(st.st_uid)}, group {_group(st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o})"


@dataclasses.dataclass(frozen=True)
class RootCheck:
    """The verdict on a cache root (see :func:`check_root`).

    Attributes
    ----------
    root : the configured root.
    real : the root with symbolic links resolved: the path this process reads and writes.
    exists : whether the root exists yet (a missing root under trusted parents is created 0700).
    trusted : whether entries may be read from and written to it.
    why : whom the user trusts by using it, or what is wrong and how to fix it.
    owner, mode : of the root (None while it does not exist).
    shared : ``RTKERNELS_CACHE_SHARED=1`` was on for this check.
    """

    root: str
    real: str
    exists: bool
    trusted: bool
    why: str
    owner: str | None = None
    mode: str | None = None
    shared: bool = False


def check_root(create: bool = False) -> RootCheck:
    """Check the cache root and the folders above it now (no memo, no warning).

    ``create`` makes a missing root (and missing folders above it) owner-only first.
    Raises OSError only when ``create`` fails.
    """
    given, shared = root(), shared_mode()
    # Resolve symbolic links once: the process then uses this path, so a link swapped after
    # the check cannot redirect it.
    real = Path(os.path.realpath(given))
    home = os.path.realpath(os.path.expanduser("~"))
    for p in real.parents:
        try:
            st = _lstat(p)
        except OSError:
            continue   # missing (created below, owner-only) or not ours to look at
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            why = (f"the folder above it, {_describe(p, st)}, is writable by every user without the sticky "
                   "bit, so anyone could replace the cache folder")
            return RootCheck(str(given), str(real), os.path.lexists(real), False,
                             f"{why}. Fix: {_fix(p, st, why, is_parent=True)}", shared=shared)
        if str(p) == home:
            break
    try:
        st = _lstat(real)
    except OSError as exc:
        if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            return RootCheck(str(given), str(real), True, False, f"{real} cannot be examined: {exc.strerror or exc}. "
                             "Fix: set RTKERNELS_CACHE_DIR to a folder of your own", shared=shared)
        if not create:
            return RootCheck(str(given), str(real), False, True,
                             f"does not exist yet; it will be created mode "
                             f"{0o2770 if shared else 0o700:04o} on the first write", shared=shared)
        _make_root(real, shared)
        st = _lstat(real)
    owner, mode = _owner(st.st_uid), f"{stat.S_IMODE(st.st_mode):04o}"
    problem = _problem(st, shared)
    if problem:
        return RootCheck(str(given), str(real), True, False,
                         f"{_describe(real, st)} {problem}, so others could plant code this process would run. "
                         f"Fix: {_fix(real, st, problem)}", owner, mode, shared)
    if shared:
        why = (f"shared mode: you trust its owner {owner} and every member of its group {_group(st.st_gid)} "
               f"(and root) to write the code you run")
    else:
        why = f"only its owner {owner}{'' if st.st_uid == 0 else ' (and root)'} can write it"
    return RootCheck(str(given), str(real), True, True, why, owner, mode, shared)


def _make_root(real: Path, shared: bool) -> None:
    """Create the root and any missing folder above it, with exact modes whatever the umask."""
    missing = []
    p = real
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        # folders above a shared root must let the group through; the root itself is the team's
        mode = (0o2770 if p == real else 0o750) if shared else 0o700
        try:
            os.mkdir(p, mode)
        except FileExistsError:
            continue   # another process made it first; its mode is checked like any other
        os.chmod(p, mode)


_verdicts: dict[tuple[str, bool], RootCheck] = {}
_checked: set[tuple[str, bool]] = set()


def trusted_root(create: bool = False) -> Path | None:
    """The resolved root when this process may read and write it, else None.

    The check runs once per process, root and mode; an untrusted root gives one
    :class:`CacheWarning` and turns the disk level off for the process.  ``create`` makes a
    missing root first (an OSError from that reaches the caller).  Independent of
    ``RTKERNELS_CACHE=0``, which the autotuner's file does not follow.
    """
    base = _trusted_base(create)
    return None if base is None else Path(base)


def _trusted_base(create: bool = False) -> str | None:
    """:func:`trusted_root` as a string: after the first call per root, two dict lookups."""
    env = os.environ.get("RTKERNELS_CACHE_DIR")
    memo = (env if env else str(root()), os.environ.get("RTKERNELS_CACHE_SHARED", "0") == "1")
    v = _verdicts.get(memo)
    if v is None:
        v = check_root(create)
        if not v.exists and v.trusted:
            return None   # nothing to read yet; checked again once something creates it
        with _lock:
            _verdicts[memo] = v
        if not v.trusted:
            _disable_disk(v.why)
    return v.real if v.trusted else None


def _folder_ok(p, shared: bool) -> bool | None:
    """True if a folder between the root and the entries is trusted (memoized), None if it is
    missing, False (with the one warning, disk off) if others could write it."""
    memo = (os.fspath(p), shared)
    if memo in _checked:
        return True
    try:
        st = _lstat(p)
    except FileNotFoundError:
        return None
    problem = _problem(st, shared)
    if problem:
        _disable_disk(f"{_describe(p, st)} {problem}, so others could plant code this process would run. "
                      f"Fix: {_fix(p, st, problem)}")
        return False
    with _lock:
        _checked.add(memo)
    return True


def _entry_dir(key: str, base: Path | None = None) -> Path:
    return (base or root()) / f"v{SCHEMA}" / key[:2] / key


class UntrustedFileError(OSError):
    """A cache file (or entry folder) that others could have written."""


def read_file(path: str | Path, shared: bool | None = None) -> bytes:
    """Read a file of the cache without following a symbolic link, refusing one others could write."""
    shared = shared_mode() if shared is None else shared
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = _fstat(f.fileno())
        problem = _problem(st, shared, want_dir=False)
        if problem:
            raise UntrustedFileError(f"{_describe(path, st)} {problem}")
        return f.read()


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
    base = _trusted_base()
    if base is None:
        return None
    shared = shared_mode()
    # plain strings: Path objects cost more than the reads on this path
    folders = (f"{base}/v{SCHEMA}", f"{base}/v{SCHEMA}/{key[:2]}")
    d = f"{folders[1]}/{key}"
    for folder in folders:
        if not _folder_ok(folder, shared):
            return None   # missing: nothing cached; untrusted: warned, disk off
    try:
        st = _lstat(d)
    except (FileNotFoundError, NotADirectoryError):
        return None
    problem = _problem(st, shared)
    if problem:
        discard(key, f"the entry folder {problem}", base)
        return None
    try:
        meta = json.loads(read_file(f"{d}/meta.json", shared))
        code_file = meta["code_file"]
        if code_file not in ("kernel.cubin", "kernel.ptx"):
            raise ValueError(f"code_file {code_file!r}")
        code = read_file(f"{d}/{code_file}", shared)
        try:
            source = read_file(f"{d}/source.cu", shared).decode()
        except FileNotFoundError:
            source = ""
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    except UntrustedFileError as exc:
        discard(key, str(exc), base)
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        discard(key, f"unreadable ({exc})", base)
        return None
    if not isinstance(meta, dict) or hashlib.sha256(code).hexdigest() != meta.get("code_sha256") \
            or meta.get("key") != key:
        discard(key, "digest mismatch", base)
        return None
    _count("disk_hits")
    return code, meta, source


def discard(key: str, why: str, base: str | Path | None = None) -> None:
    """Drop a disk entry that must not be loaded (corrupt, or figures its code contradicts), with a warning."""
    _count("corrupt")
    base = base or _trusted_base()
    d = _entry_dir(key, Path(base) if base else root())
    _warn(f"rtkernels: discarding corrupt cache entry {d} ({why}); recompiling")
    if base is None:
        return   # the root is no longer one this process writes to
    trash = d.with_name(f".trash-{d.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(d, trash)
        shutil.rmtree(trash, ignore_errors=True)
    except OSError:
        pass  # another process removed or replaced it first


_PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn(message: str) -> None:
    """A CacheWarning attributed to the first caller outside rtkernels (the user's line)."""
    import sys
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PKG):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, CacheWarning, stacklevel=level)


def _disable_disk(reason: str) -> None:
    global _disk_off_reason
    if _disk_off_reason is None:
        _disk_off_reason = reason
        _warn(f"rtkernels: disk cache disabled for this process: {reason}. Kernels are cached in memory only.")


def _make_folder(p: Path, mode: int) -> None:
    """Create one folder with exactly ``mode`` (an existing one is left as it is, and checked)."""
    try:
        os.mkdir(p, mode)
    except FileExistsError:
        return
    os.chmod(p, mode)


def _write_file(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)   # the umask may have removed bits (or the caller's may be 000)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def disk_put(key: str, code: bytes, code_file: str, meta: dict, source: str) -> None:
    """Write an entry atomically; a failure to write is a warning, never an error."""
    if not disk_enabled():
        return
    meta = dict(meta, key=key, code_file=code_file, code_sha256=hashlib.sha256(code).hexdigest(),
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    shared = shared_mode()
    way_mode, entry_mode, f_mode = _modes(shared)
    tmp = None
    try:
        base = trusted_root(create=True)
        if base is None:
            return
        final = _entry_dir(key, base)
        if os.path.lexists(final):
            return
        for folder in (final.parent.parent, final.parent):
            _make_folder(folder, way_mode)
            if not _folder_ok(folder, shared):
                return
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=final.parent))
        os.chmod(tmp, entry_mode)
        for name, data in ((code_file, code), ("source.cu", source.encode()),
                           ("meta.json", json.dumps(meta, indent=1, sort_keys=True).encode())):
            _write_file(tmp / name, data, f_mode)
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
        _disable_disk(f"cannot write to {root()}: {exc.strerror or exc}. Set RTKERNELS_CACHE_DIR to a "
                      "writable folder")
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
    """Keep the rendered source of a failed compile where the user can open it.

    In the cache's ``failed/`` folder when the cache is usable, else in a per-user folder of
    the temporary directory that must be the user's own (a shared, predictable name there
    would let another user redirect the write through a symbolic link)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    bases = []
    try:
        base = trusted_root(create=True) if disk_enabled() else None
    except OSError:
        base = None
    if base is not None:
        bases.append((base / "failed", _modes(shared_mode())[0], shared_mode()))
    bases.append((Path(tempfile.gettempdir()) / f"rtkernels-failed-{_euid()}", 0o700, False))
    for folder, mode, shared in bases:
        try:
            _make_folder(folder, mode)
            st = _lstat(folder)
            if _problem(st, shared):
                continue
            path = folder / f"{name}-{digest}.cu"
            tmp = folder / f".{name}-{digest}-{uuid.uuid4().hex[:8]}.tmp"
            _write_file(tmp, source.encode(), _modes(shared)[2])
            os.replace(tmp, path)
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
    """Root, its owner and mode, whether it is trusted and why, entries and this process's counters."""
    entries = list_entries()
    chk = check_root()
    return {"root": str(root()), "resolved": chk.real, "owner": chk.owner, "mode": chk.mode,
            "shared": chk.shared, "trusted": chk.trusted, "why": chk.why, "schema": SCHEMA,
            "disk_enabled": disk_enabled() and chk.trusted,
            "disabled_reason": _disk_off_reason or ("RTKERNELS_CACHE=0" if os.environ.get("RTKERNELS_CACHE") == "0"
                                                    else None if chk.trusted else "untrusted root"),
            "entries": len(entries), "bytes": sum(e["bytes"] for e in entries), "process_stats": stats()}


def clear() -> int:
    """Delete every disk entry (and leftovers); returns the number of entries removed."""
    n = len(list_entries())
    base = root()
    for sub in list(base.glob("v*")) + [base / "failed"]:
        shutil.rmtree(sub, ignore_errors=True)
    clear_memory()
    return n
