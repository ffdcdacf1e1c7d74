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


def capture_cupy(stream, fn):
    """A CuPy CUDA graph of ``fn()`` captured on ``stream`` (synchronized first: nothing earlier is
    in flight on it)."""
    stream.synchronize()
    stream.begin_capture()
    fn()
    return stream.end_capture()


def refill(rng, arrays, dtype):
    """New random contents (``random_array``) written into each device array of ``arrays`` in place;
    their float64 host copies."""
    hosts = []
    for a in arrays:
        new, host = random_array(rng, a.shape, dtype)
        a[...] = new
        hosts.append(host)
    return hosts


def exact_allocation(flat: np.ndarray):
    """A device copy of the 1-D host array ``flat`` in a cudaMalloc of exactly ``flat.nbytes``
    bytes of its own (CuPy's pool rounds blocks up to 512 bytes): any read past its last element
    is outside every allocation, which compute-sanitizer's memcheck reports.  (The GPU itself does
    not fault on it: allocations are mapped in whole pages.)"""
    import cupy as cp
    flat = np.ascontiguousarray(flat)
    assert flat.ndim == 1 and flat.nbytes > 0
    mem = cp.cuda.memory.Memory(flat.nbytes)
    dev = cp.ndarray(flat.shape, flat.dtype, cp.cuda.MemoryPointer(mem, 0))
    dev.set(flat)
    return dev


def view_at_allocation_end(rng, shape, strides, dtype):
    """A strided view (element ``strides``, all >= 0) of random values that ends exactly where its
    exact-size allocation does (:func:`exact_allocation`): (device view, float64 host view of the
    same values)."""
    import cupy as cp
    n = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
    flat, flat64 = random_array(rng, (n,), dtype)
    dev = exact_allocation(flat.get())
    item = dev.itemsize
    view = cp.lib.stride_tricks.as_strided(dev, shape, tuple(s * item for s in strides))
    host = np.lib.stride_tricks.as_strided(flat64, shape, tuple(s * 8 for s in strides))
    return view, host


def prebuild_sm90(family: str, configs) -> None:
    """Compile ``configs`` (of ``family``) for sm_90a in parallel worker processes into the disk
    cache, so a module's GPU cases load instead of compiling one by one; nothing without an sm_90 GPU."""
    import dataclasses
    from rtkernels import device
    from rtkernels import inspect as rinspect
    if not device.has_gpu() or not device.device_arch().startswith("sm_90"):
        return
    params = [{f.name: getattr(c, f.name) for f in dataclasses.fields(c)} for c in configs]
    rinspect.sweep(family, params, arch="sm_90a", jobs=16)
