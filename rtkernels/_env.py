"""Environment reads on the per-call path."""
from __future__ import annotations

import os

_DATA = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)`` at a dict lookup's cost.  ``os.environ.get`` encodes the key
    and decodes the value on every call (~0.5 us; the ops' launch-plan keys read two variables per
    call); CPython's ``os.environ`` keeps the encoded mapping in ``_data``, which every write to
    ``os.environ`` (``monkeypatch.setenv`` included) updates, so it is read directly, with the
    key's encoding memoized.  Elsewhere: ``os.environ.get``."""
    if _DATA is None:
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENCODE(name)
    value = _DATA.get(key)
    return default if value is None else _DECODE(value)


_KEYS: dict = {}


def getenv_raw(name: str):
    """The variable's value as the environment stores it (bytes on POSIX), or None: for keys that
    only compare values (no decode per call)."""
    if _DATA is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENCODE(name)
    return _DATA.get(key)
