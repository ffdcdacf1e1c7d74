"""Helpers for GPU tests: random data per dtype (bfloat16 as uint16 bits), float64 views, poison."""
import numpy as np


def bf16_bits_from_f32(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16   # round to nearest even
    return b.astype(np.uint16)


def f32_from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def random_array(rng, shape, dtype, scale=1.0):
    """(device array, float64 host copy of exactly the values stored)."""
    import cupy as cp
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if dtype == "bfloat16":
        bits = bf16_bits_from_f32(x)
        return cp.asarray(bits), f32_from_bf16_bits(bits).astype(np.float64)
    h = x.astype(dtype)
    return cp.asarray(h), h.astype(np.float64)


def to_f64(dev, dtype):
    h = dev.get() if hasattr(dev, "get") else dev.cpu().numpy()
    if dtype == "bfloat16":
        return f32_from_bf16_bits(h.view(np.uint16)).astype(np.float64)
    return h.astype(np.float64)


def poison(a):
    """Fill with NaN bits (0xFF bytes are NaN in every float format we use)."""
    import cupy as cp
    cp.asarray(a).view(cp.uint8).fill(0xFF)
    return a


TOL = {"float16": 2 ** -10, "bfloat16": 2 ** -7, "float32": 1e-6, "float64": 1e-12}
