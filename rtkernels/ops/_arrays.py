"""Array plumbing shared by the ops: accept CuPy arrays, torch tensors, CAI/DLPack objects.

bfloat16 has no CuPy dtype, so a bfloat16 tensor is viewed as uint16 by CuPy (zero copy) and
its dtype is read from the original object.  Outputs are created as the same kind of array
as the first input (CuPy for CuPy, torch for torch).
"""
from __future__ import annotations

from .. import dtypes
from ..errors import ConfigError


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def dtype_name(x) -> str:
    """Canonical dtype name of an array-like ("float16", "bfloat16", ...)."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        raise TypeError(f"expected an array, got {type(x).__name__}")
    return dtypes.canonical(dt, family="rtkernels", field="dtype")


def as_device_array(x, op: str, name: str):
    """A zero-copy CuPy view of ``x`` (for shapes, strides, device); bfloat16 shows as uint16."""
    import cupy
    if isinstance(x, cupy.ndarray):
        return x
    if _is_torch(x):
        import torch
        if not x.is_cuda:
            raise ConfigError(f"{op}: {name} is on {x.device}; it must be on a CUDA device")
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
            return cupy.from_dlpack(x).view(cupy.uint16)
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    if hasattr(x, "__dlpack_device__"):
        kind, _ = x.__dlpack_device__()
        if int(kind) not in (2, 13):
            raise ConfigError(f"{op}: {name} is a host array; pass a CUDA device array (CuPy, torch, or any "
                              "__cuda_array_interface__/DLPack object)")
        return cupy.from_dlpack(x)
    raise TypeError(f"{op}: {name} must be a CUDA device array (CuPy, torch, CAI or DLPack), got {type(x).__name__}")


def new_like(x, shape, dtype: str | None = None):
    """An uninitialized array of the same kind and device as ``x``."""
    dtype = dtype or dtype_name(x)
    if _is_torch(x):
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=x.device)
    import cupy
    if dtype == "bfloat16":
        return cupy.empty(shape, dtype=cupy.uint16)   # bfloat16 bits; see the module docstring
    with cupy.cuda.Device(x.device.id if hasattr(x, "device") and hasattr(x.device, "id") else None):
        return cupy.empty(shape, dtype=dtype)
