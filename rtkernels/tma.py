"""Tensor maps for Hopper's bulk tensor copies (TMA), built on the host.

A kernel that loads tiles with ``rtk::sm90::tma_load_*`` takes each tensor map by value::

    extern "C" __global__ void k(const __grid_constant__ rtk::sm90::TensorMap tmap_a, ...)

and the host passes what :func:`tensor_map` returns::

    m = tensor_map(a, "bfloat16", shape=a.shape, strides=strides_in_elements, box=(128, 64))
    kernel.launch(grid, block, m, ...)

Shapes, strides (in elements) and boxes are given outermost-first, as NumPy writes them; the
driver wants them innermost-first, and the device-side coordinates follow the driver's order
(``tma_load_2d(dst, &map, bar, col, row)``).  The encoding is pure host work (no device memory);
results are memoized by their arguments, because a kernel launched in a loop sees the same
pointers and shapes each time and an encode costs several microseconds through the bindings.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

from .errors import ConfigError, DeviceError

# 128 opaque bytes; the driver requires 64-byte alignment of its own copy, which the launch
# makes (kernel parameters are copied into the parameter space at their declared alignment).
TENSOR_MAP_DTYPE = np.dtype([("opaque", "<u8", (16,))])

_ELEMENT_TYPES = {"float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
                  "float32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32", "float64": "CU_TENSOR_MAP_DATA_TYPE_FLOAT64",
                  "uint8": "CU_TENSOR_MAP_DATA_TYPE_UINT8", "int8": "CU_TENSOR_MAP_DATA_TYPE_UINT8",
                  "uint16": "CU_TENSOR_MAP_DATA_TYPE_UINT16", "int32": "CU_TENSOR_MAP_DATA_TYPE_INT32",
                  "uint32": "CU_TENSOR_MAP_DATA_TYPE_UINT32", "int64": "CU_TENSOR_MAP_DATA_TYPE_INT64",
                  "uint64": "CU_TENSOR_MAP_DATA_TYPE_UINT64"}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1, "uint16": 2,
             "int32": 4, "uint32": 4, "int64": 8, "uint64": 8}
_SWIZZLES = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
             128: "CU_TENSOR_MAP_SWIZZLE_128B"}
_L2 = {0: "CU_TENSOR_MAP_L2_PROMOTION_NONE", 64: "CU_TENSOR_MAP_L2_PROMOTION_L2_64B",
       128: "CU_TENSOR_MAP_L2_PROMOTION_L2_128B", 256: "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"}

_MEMO_SIZE = 512
_memo: OrderedDict = OrderedDict()
_memo_lock = threading.Lock()
# Launch arguments of the memoized maps, by id(): (the map, a CuPy CPointer to a private copy of
# its 128 bytes, that copy).  CuPy hands a CPointer to the driver as it is, where a NumPy record
# is converted on every launch; Kernel.launch looks maps up here (the map itself is kept, so its
# id cannot be reused while the entry exists).  Maps leave with their memo entry.
LAUNCH_ARGS: dict = {}


def _bad(field: str, value, allowed: str) -> ConfigError:
    return ConfigError.bad_value("tensor_map", field, value, allowed)


def check_tensor_map(ptr: int, dtype: str, shape: Sequence[int], strides: Sequence[int], box: Sequence[int],
                     swizzle: int = 128) -> None:
    """Raise ConfigError if the driver would refuse this tensor map (checked here so the message
    names the argument; the driver answers only CUDA_ERROR_INVALID_VALUE)."""
    if dtype not in _ELEMENT_TYPES:
        raise _bad("dtype", dtype, "one of " + ", ".join(_ELEMENT_TYPES))
    rank = len(shape)
    if not 1 <= rank <= 5:
        raise _bad("shape", tuple(shape), "1 to 5 dimensions")
    if len(strides) != rank or len(box) != rank:
        raise _bad("strides/box", (tuple(strides), tuple(box)), f"one entry per dimension ({rank})")
    item = _ITEMSIZE[dtype]
    if ptr % 16:
        raise _bad("address", hex(ptr), "16-byte aligned (TMA reads whole 16-byte sectors)")
    for i, n in enumerate(shape):
        if not 1 <= int(n) <= 2 ** 32:
            raise _bad(f"shape[{i}]", n, "in [1, 2**32]")
    if strides[-1] != 1:
        raise _bad(f"strides[{rank - 1}]", strides[-1], "1 (the innermost dimension must be contiguous)")
    for i, s in enumerate(strides[:-1]):
        nbytes = int(s) * item
        if nbytes <= 0 or nbytes % 16 or nbytes >= 2 ** 40:
            raise _bad(f"strides[{i}]", s, f"positive, a multiple of {16 // item if item < 16 else 1} elements "
                                           f"(16 bytes) and below 2**40 bytes")
    for i, b in enumerate(box):
        if not 1 <= int(b) <= 256:
            raise _bad(f"box[{i}]", b, "in [1, 256]")
    if (int(box[-1]) * item) % 16:
        raise _bad(f"box[{rank - 1}]", box[-1], f"a multiple of {max(1, 16 // item)} elements (16 bytes)")
    if swizzle not in _SWIZZLES:
        raise _bad("swizzle", swizzle, "0, 32, 64 or 128 (bytes)")
    if swizzle and int(box[-1]) * item > swizzle:
        raise _bad(f"box[{rank - 1}]", box[-1], f"at most {swizzle // item} elements ({swizzle} bytes): a "
                                                f"{swizzle}-byte swizzle spans one inner box row")


def tensor_map(array_or_ptr, dtype: str, shape: Sequence[int], strides: Sequence[int], box: Sequence[int], *,
               swizzle: int = 128, l2_promotion: int = 256, oob_nan: bool = False) -> np.void:
    """Encode a tiled tensor map; returns the 128-byte by-value kernel argument.

    Parameters
    ----------
    array_or_ptr : CuPy array (or anything with ``.data.ptr``) or an integer device address.
    dtype : element type name ("bfloat16", "float16", "float32", ...).
    shape, strides : the tensor's extent and strides in elements, outermost first; the last
        stride must be 1 and the others multiples of 16 bytes.
    box : the tile one copy moves, outermost first (each <= 256; the inner extent times the
        element size a multiple of 16 bytes and at most ``swizzle`` bytes when swizzled).
    swizzle : shared-memory swizzle in bytes (0, 32, 64, 128); 128 is what wgmma's SW_128B reads.
    l2_promotion : L2 sector promotion in bytes (0, 64, 128, 256).
    oob_nan : fill out-of-bounds elements with NaN instead of zero (floating types).
    """
    ptr = array_or_ptr if isinstance(array_or_ptr, (int, np.integer)) else array_or_ptr.data.ptr
    ptr = int(ptr)
    try:   # launch plans pass tuples of ints: look them up as given before normalizing (~1 us a map)
        hit = _memo.get((ptr, dtype, shape, strides, box, swizzle, l2_promotion, oob_nan))
    except TypeError:   # lists
        hit = None
    if hit is not None:
        return hit
    shape = tuple(int(x) for x in shape)
    strides = tuple(int(x) for x in strides)
    box = tuple(int(x) for x in box)
    key = (ptr, dtype, shape, strides, box, swizzle, l2_promotion, oob_nan)
    hit = _memo.get(key)
    if hit is not None:
        return hit
    check_tensor_map(ptr, dtype, shape, strides, box, swizzle)
    if l2_promotion not in _L2:
        raise _bad("l2_promotion", l2_promotion, "0, 64, 128 or 256 (bytes)")
    out = _encode(ptr, dtype, shape, strides, box, swizzle, l2_promotion, oob_nan)
    arg = _launch_arg(out)
    with _memo_lock:
        _memo[key] = out
        if arg is not None:
            LAUNCH_ARGS[id(out)] = arg
        while len(_memo) > _MEMO_SIZE:
            LAUNCH_ARGS.pop(id(_memo.popitem(last=False)[1]), None)
    return out


def _launch_arg(tmap):
    try:
        from cupy.cuda.function import CPointer
    except ImportError:   # pragma: no cover - CuPy is a dependency; without it maps pass by value
        return None
    copy = np.frombuffer(tmap.tobytes(), dtype=np.uint8).copy()
    return tmap, CPointer(copy.ctypes.data), copy


def _encode(ptr, dtype, shape, strides, box, swizzle, l2_promotion, oob_nan) -> np.void:
    from cuda.bindings import driver as drv
    item = _ITEMSIZE[dtype]
    rank = len(shape)

    def encode():
        return drv.cuTensorMapEncodeTiled(
            getattr(drv.CUtensorMapDataType, _ELEMENT_TYPES[dtype]), rank, ptr,
            [drv.cuuint64_t(n) for n in reversed(shape)],
            [drv.cuuint64_t(s * item) for s in reversed(strides[:-1])],
            [drv.cuuint32_t(b) for b in reversed(box)],
            [drv.cuuint32_t(1)] * rank,
            drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            getattr(drv.CUtensorMapSwizzle, _SWIZZLES[swizzle]),
            getattr(drv.CUtensorMapL2promotion, _L2[l2_promotion]),
            drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA if oob_nan
            else drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    err, tmap = encode()
    if err == drv.CUresult.CUDA_ERROR_INVALID_CONTEXT:   # no usable context on this thread (bind_context)
        from .device import bind_context
        bind_context(ptr=ptr)
        err, tmap = encode()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise DeviceError(f"tensor_map: cuTensorMapEncodeTiled failed with "
                          f"{name.decode() if isinstance(name, bytes) else err} for dtype={dtype}, shape={shape}, "
                          f"strides={strides}, box={box}, swizzle={swizzle}")
    out = np.zeros((), TENSOR_MAP_DTYPE)
    out["opaque"] = [int(x) for x in tmap.opaque]
    return out[()]


def tensor_map_for(array, box: Sequence[int], *, dtype: str | None = None, swizzle: int = 128, **kw) -> np.void:
    """:func:`tensor_map` over a whole CuPy array (its shape and strides); bfloat16 data stored
    as uint16 needs ``dtype="bfloat16"``."""
    item = array.dtype.itemsize
    strides = tuple(s // item for s in array.strides)
    if any(s * item != b for s, b in zip(strides, array.strides)):
        raise _bad("strides", array.strides, f"whole multiples of the element size ({item} bytes)")
    return tensor_map(array, dtype or array.dtype.name, array.shape, strides, box, swizzle=swizzle, **kw)
