"""What GPU (if any) this process has, without touching the driver at import time."""
from __future__ import annotations

import os
from functools import lru_cache

DEFAULT_ARCH = "sm_90"


@lru_cache(maxsize=None)
def gpu_count() -> int:
    """Number of visible CUDA devices; 0 when there is no driver or no device."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def has_gpu() -> bool:
    return gpu_count() > 0


def current_device() -> int:
    import cupy
    return cupy.cuda.runtime.getDevice()


def bind_context(device: int | None = None, ptr: int | None = None) -> None:
    """Make a device's primary context current on this thread: ``device``, or the device that
    owns ``ptr``, or the thread's runtime device.  For the driver calls rtkernels makes itself
    (a tensor-map encode, ``cuLaunchKernelEx``), which, unlike CuPy's launches, bind no context:
    on CUDA_ERROR_INVALID_CONTEXT their callers call this and retry once.  Seen once: rtk.matmul's
    backward, on torch's autograd thread, failed its tensor-map encode so in an 8-worker GPU test
    run (H100, 2026-11-28); not reproduced alone or from a fresh thread.  (cudaSetDevice
    initializes and binds the primary context since CUDA 12.)"""
    import cupy
    rt = cupy.cuda.runtime
    if device is None:
        device = rt.pointerGetAttributes(ptr).device if ptr is not None else rt.getDevice()
    rt.setDevice(device)


@lru_cache(maxsize=None)
def _props(device: int) -> dict:
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(device)


def device_arch(device: int | None = None) -> str:
    p = _props(current_device() if device is None else device)
    return f"sm_{p['major']}{p['minor']}"


def current_arch() -> str:
    """Target arch: ``RTKERNELS_ARCH`` if set, else the current GPU's exact arch, else sm_90."""
    env = os.environ.get("RTKERNELS_ARCH")
    if env:
        return env
    return device_arch() if has_gpu() else DEFAULT_ARCH


def sm_count(device: int | None = None) -> int:
    return int(_props(current_device() if device is None else device)["multiProcessorCount"])


def device_name(device: int | None = None) -> str:
    name = _props(current_device() if device is None else device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def max_shared_per_block_optin(device: int | None = None) -> int:
    return int(_props(current_device() if device is None else device)["sharedMemPerBlockOptin"])


@lru_cache(maxsize=None)
def dram_gbs(device: int) -> float | None:
    """Peak DRAM bandwidth in GB/s from the driver's memory clock and bus width (double data
    rate: an H100 SXM 3352, an H200 about 4900); None where the driver does not report them."""
    try:
        import cupy
        rt = cupy.cuda.runtime
        khz = int(rt.deviceGetAttribute(rt.cudaDevAttrMemoryClockRate, device))
        bits = int(rt.deviceGetAttribute(rt.cudaDevAttrGlobalMemoryBusWidth, device))
    except Exception:
        return None
    if khz <= 0 or bits <= 0:
        return None
    return 2 * khz * 1e3 * bits / 8 / 1e9


@lru_cache(maxsize=None)
def driver_version() -> int:
    """CUDA version the driver supports, e.g. 13000 for 13.0."""
    import cupy
    return int(cupy.cuda.runtime.driverGetVersion())
