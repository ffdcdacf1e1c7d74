"""The element types kernels are specialized on, and their C++ spellings."""
from __future__ import annotations

import numpy as np

from .errors import ConfigError

# name -> (C++ type, bytes).  bfloat16 has no NumPy dtype; CuPy arrays of it do not
# exist either, so bfloat16 data travels as uint16 views or torch tensors (DLPack).
DTYPES: dict[str, tuple[str, int]] = {
    "float16": ("__half", 2),
    "bfloat16": ("__nv_bfloat16", 2),
    "float32": ("float", 4),
    "float64": ("double", 8),
    "int8": ("signed char", 1),
    "uint8": ("unsigned char", 1),
    "int16": ("short", 2),
    "uint16": ("unsigned short", 2),
    "int32": ("int", 4),
    "uint32": ("unsigned int", 4),
    "int64": ("long long", 8),
    "uint64": ("unsigned long long", 8),
    "bool": ("bool", 1),
}
ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
           "fp32": "float32", "double": "float64", "fp64": "float64"}


# dtype object -> name: NumPy 2's dtype.name / str() cost 1-3 us each, and an op asks several
# times per call (profiled on the H200 host, 2026-11-21).
_OBJECT_NAMES: dict = {}


def canonical(name: object, *, family: str = "rtkernels", field: str = "dtype",
              allowed: tuple[str, ...] | None = None) -> str:
    """Return the canonical dtype name for ``name`` (a string, NumPy dtype or torch dtype)."""
    raw = name
    if not isinstance(name, str):
        try:
            name = _OBJECT_NAMES[raw]
        except (KeyError, TypeError):
            name = str(getattr(raw, "name", None) or raw)   # np.dtype('float16').name, torch.float16
            name = name.replace("torch.", "")
            if name in DTYPES and len(_OBJECT_NAMES) < 64:
                _OBJECT_NAMES[raw] = name
    name = ALIASES.get(name, name)
    choices = allowed or tuple(DTYPES)
    if name not in DTYPES or name not in choices:
        raise ConfigError.bad_value(family, field, raw, "one of " + ", ".join(choices))
    return name


def ctype(name: str) -> str:
    """C++ spelling of a dtype name (the templates' ``ctype`` filter)."""
    return DTYPES[canonical(name)][0]


def itemsize(name: str) -> int:
    return DTYPES[canonical(name)][1]


def numpy_dtype(name: str) -> np.dtype:
    """NumPy dtype with the same bits (bfloat16 maps to uint16 storage)."""
    name = canonical(name)
    return np.dtype("uint16") if name == "bfloat16" else np.dtype(name)
