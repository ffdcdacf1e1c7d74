"""Programmatic dependent launch (PDL, sm_90+) for kernels that wait for their stream themselves.

A kernel launched with the programmatic-stream-serialization attribute may be started by the
driver before the kernel ahead of it in the stream has finished; the kernel then waits with
``griddepcontrol.wait`` (``rtk::grid_dependency_wait()`` in rtk/common.cuh) until that kernel has
completed and its memory is visible.  Even where the kernel ahead never signals early, its
successor starts sooner: on an H200 (2026-11-27, ``tools/launch_gap_probe.py``) the next kernel's
blocks entered 0.64-0.67 us after the previous kernel's last block ended, against 1.66-1.82 us for
a plain launch - about 1 us per kernel boundary, which is 2-5% of a decoding step's attention or
of a 20 us matmul.

Only a kernel whose body *begins* with the wait is launched so (:func:`waits_first`, read from the
rendered source; ``Kernel.pdl``): the wait must come before the kernel's first global load or
store, since the previous kernel may still be running until it returns.  Which templates begin
with it is a choice per family.  In: the decoding kernels (split, merge, append, combine), the
Hopper matmuls (bf16/fp16, fp8), the staging copy and the GEMV - the kernels of a decoding step,
short and GPU-bound, replayed in CUDA graphs - and the training kernels after a forward (norm and
softmax backward, cross-entropy).  Out: the forward row ops, the attention forward / backward and
AdamW.  The launch here costs more host time than CuPy's (Python around the same driver call:
+2.2-2.9 us per launch in the H100 / H200 hosts' microbenchmark, 2026-11-27, where the driver's
own cuLaunchKernelEx with the attribute took 0.5-1.2 us less than cuLaunchKernel), which a small
call issued by a waiting host pays in full, while a kernel that runs for milliseconds gains
nothing measurable from starting 1 us earlier.  One kernel signals its dependents early
(``griddepcontrol.launch_dependents``): the GEMV's x conversion (``quant_gemv_xhalf``), right after
its own wait, so the GEMV behind it is resident, waiting, when it ends.  No other kernel signals, so
every other PDL launch never shares SMs with the kernel before it; the whole gain is the shorter
hand-over.

:class:`PdlFunction` wraps CuPy's loaded ``Function`` with the same launch interface, so every
launch path (``Kernel.launch``, bound launches, cooperative launches, the ops' replays) takes it
unchanged.  A cooperative grid launched so cannot wedge: its blocks that start early sit in the wait
(their first instruction) until the kernel before has left every SM, so the grid barriers they reach
afterwards see the whole grid resident, as in a plain cooperative launch; a driver that refuses the
two attributes together gets CuPy's cooperative launch from then on.  (Measured: the
cooperative launches gained nothing - the norm backward's folded column sums at 4k-16k, H100 and
H200 - while the plain ones gained ~1 us each.)  Inside CUDA graph capture
the attribute becomes a programmatic edge of the graph.  ``RTKERNELS_PDL=0`` (or
:func:`set_enabled`) launches every kernel plainly, as before.
"""
from __future__ import annotations

import ctypes
import os
import re
from array import array

import numpy as np

from .errors import LaunchError

_ENABLED = [os.environ.get("RTKERNELS_PDL", "1") != "0"]

# The opening of a __global__ function's body up to its first statement (comments skipped).
_BODY_WAIT = re.compile(r"\{(?:\s|//[^\n]*\n|/\*.*?\*/)*rtk::grid_dependency_wait\(\)\s*;", re.S)


def enabled() -> bool:
    return _ENABLED[0]


def set_enabled(on: bool) -> bool:
    """Launch PDL-ready kernels with the attribute (True, the default) or plainly; returns the
    previous setting.  Takes effect at the next launch (A/B timing in one process)."""
    prev = _ENABLED[0]
    _ENABLED[0] = bool(on)
    return prev


def waits_first(source: str, signature_end: int) -> bool:
    """Whether the function whose parameter list ends at ``signature_end`` (the index just past
    its closing parenthesis) in ``source`` begins its body with ``rtk::grid_dependency_wait();``."""
    i = signature_end
    while i < len(source) and source[i].isspace():
        i += 1
    return _BODY_WAIT.match(source, i) is not None


def device_supports(cc_major: int) -> bool:
    """PDL needs compute capability 9.0 or newer (the attribute is refused before)."""
    return cc_major >= 9


_ATTR: list = []   # [programmatic stream serialization, cooperative] launch attributes, made once
_HOLDERS: set = set()   # CuPy's argument holder types (CPointer and its subclasses): .ptr is the address
_CHARS: dict = {}   # nbytes -> ctypes char array type (NumPy scalars' and records' bytes)
# What a launch looks up, bound once by _lookups() (module globals: the cheapest lookups per launch)
_drv = _CPointer = _CIntptr = _ndarray = _MemoryPointer = _current_stream = _NULL = None


def _lookups() -> None:
    """Bind cuda.bindings' driver, CuPy's holder and array types, its current stream and a null
    pointer holder, and make the launch attributes (once)."""
    global _drv, _CPointer, _CIntptr, _ndarray, _MemoryPointer, _current_stream, _NULL
    if _drv is not None:
        return
    import cupy
    from cupy.cuda.function import CIntptr, CNumpyArray, CPointer
    from cuda.bindings import driver as drv
    a = drv.CUlaunchAttribute()
    a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    a.value.programmaticStreamSerializationAllowed = 1
    c = drv.CUlaunchAttribute()
    c.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
    c.value.cooperative = 1
    _ATTR[:] = [a, c]
    _HOLDERS.update((CPointer, CIntptr, CNumpyArray))
    _CPointer, _CIntptr, _ndarray, _MemoryPointer = CPointer, CIntptr, cupy.ndarray, cupy.cuda.MemoryPointer
    _current_stream, _NULL = cupy.cuda.get_current_stream, CIntptr(0)
    _drv = drv


class _Bytes:
    """A holder of argument bytes for the driver (``ptr``: their address), as CuPy's CPointer."""
    __slots__ = ("buf", "ptr")

    def __init__(self, buf):
        self.buf, self.ptr = buf, ctypes.addressof(buf)


def _holder(a):
    """A holder (``.ptr``: the host address of the bytes the driver reads) of argument ``a``, which
    is neither one of CuPy's holders nor a CuPy array, with CuPy's conventions (Function.__call__):
    Python ints as int64, floats as float64, NumPy scalars and records as their bytes, None as a
    null pointer."""
    if isinstance(a, np.generic):   # NumPy scalars and records (a by-value struct): their bytes
        n = a.nbytes
        return _Bytes((_CHARS.get(n) or _CHARS.setdefault(n, ctypes.c_char * n)).from_buffer_copy(a))
    if a is None:
        return _NULL
    if isinstance(a, _CPointer):   # (a holder subclass not seen before)
        _HOLDERS.add(type(a))
        return a
    if isinstance(a, _ndarray):   # (a subclass)
        return _CIntptr(a.data.ptr)
    if type(a) is bool:
        return _Bytes(ctypes.c_bool(a))
    if isinstance(a, int):
        if not -(1 << 63) <= a < (1 << 63):   # as CuPy's numpy.int64(a)
            raise OverflowError(f"a kernel argument {a} does not fit in int64")
        return _CIntptr(a)
    if isinstance(a, float):
        return _Bytes(ctypes.c_double(a))
    if isinstance(a, _MemoryPointer):   # its device address
        return _CIntptr(a.ptr)
    raise TypeError(f"a kernel argument of type {type(a).__name__} cannot be passed by value")


def _dim3(d) -> tuple:
    """A grid or block as CuPy takes it (an int, or a 1- to 3-tuple or list), as three ints."""
    d = tuple(int(x) for x in d) if isinstance(d, (tuple, list)) else (int(d),)
    return d + (1,) * (3 - len(d))


class PdlFunction:
    """CuPy's loaded ``Function`` ``fn`` launched through ``cuLaunchKernelEx`` with the
    programmatic-stream-serialization attribute; ``__call__`` and ``linear_launch`` take what
    CuPy's take (every launch while :func:`set_enabled` is off goes to ``fn`` itself).  Other
    attributes (``ptr``, ``name`` ...) are ``fn``'s.

    Host time per launch (H100 / H200 hosts, 2026-11-27, ``tools/pdl_launch_cost.py``): the
    driver's cuLaunchKernelEx with the attribute took 0.5-1.2 us less than cuLaunchKernel
    (arguments prepared beforehand; cuda.bindings' wrapper and a ctypes call measured the same);
    what this class adds in Python is the rest.  The per-launch work is one dictionary lookup of
    the launch's dimensions and stream, one list of parameter addresses (CuPy's holders give
    theirs directly) and the binding's call."""
    __slots__ = ("fn", "ptr", "_cufn", "_configs", "_coop_refused", "_device")

    def __init__(self, fn, device: int | None = None):
        _lookups()
        self.fn, self.ptr, self._device = fn, fn.ptr, device   # (device: where fn is loaded)
        self._cufn = _drv.CUfunction(fn.ptr)
        self._configs: dict = {}   # launch key -> (CUlaunchConfig, grid, block, shared_mem)
        self._coop_refused = False

    def __getattr__(self, name):   # (only for names not in __slots__)
        return getattr(self.fn, name)

    def __call__(self, grid, block, args, shared_mem=0, stream=None, enable_cooperative_groups=False):
        if not _ENABLED[0] or (enable_cooperative_groups and self._coop_refused):
            return self.fn(grid, block, args, shared_mem, stream, enable_cooperative_groups=enable_cooperative_groups)
        if type(grid) is not tuple or type(block) is not tuple:   # (a key must hash: ints and lists as tuples)
            grid, block = _dim3(grid), _dim3(block)
        key = (grid, block, shared_mem, stream.ptr if stream is not None else _current_stream().ptr,
               bool(enable_cooperative_groups))
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = self._config(key, _dim3(grid), _dim3(block))
        self._send(cfg, key, args, stream)

    def linear_launch(self, size, args, shared_mem=0, block_max_size=128, stream=None,
                      enable_cooperative_groups=False):
        if not _ENABLED[0] or (enable_cooperative_groups and self._coop_refused):
            return self.fn.linear_launch(size, args, shared_mem, block_max_size, stream,
                                         enable_cooperative_groups=enable_cooperative_groups)
        key = (size, block_max_size, shared_mem, stream.ptr if stream is not None else _current_stream().ptr,
               bool(enable_cooperative_groups))
        cfg = self._configs.get(key)
        if cfg is None:   # CuPy's linear_launch: min(2^31 - 1, ceil(size / block)) blocks of min(block, size)
            cfg = self._config(key, (min(0x7FFFFFFF, (size + block_max_size - 1) // block_max_size), 1, 1),
                               (min(block_max_size, size), 1, 1))
        self._send(cfg, key, args, stream)

    def _send(self, cfg: tuple, key: tuple, args, stream, retried: bool = False) -> None:
        # kernelParams: the address of each argument's bytes - CuPy's holders (bound launches'
        # arguments, the launchers' ints) have theirs, CuPy arrays get one of their data address,
        # the rest _holder's; ``held`` keeps them alive through the call
        held = [a if type(a) in _HOLDERS else _CIntptr(a.data.ptr) if type(a) is _ndarray else _holder(a)
                for a in args]
        ptrs = array("q", [h.ptr for h in held])
        err, = _drv.cuLaunchKernelEx(cfg[0], self._cufn, ptrs.buffer_info()[0] if args else 0, 0)
        if err:
            self._failed(err, cfg, key, args, stream, retried)

    def _failed(self, err, cfg: tuple, key: tuple, args, stream, retried: bool) -> None:
        _, grid, block, shared_mem = cfg
        coop = key[4]
        if err == _drv.CUresult.CUDA_ERROR_INVALID_CONTEXT and not retried:
            # no usable context on this thread (device.bind_context): once more with the primary one bound
            from .device import bind_context
            bind_context(self._device)
            return self._send(cfg, key, args, stream, True)
        if coop and err in (_drv.CUresult.CUDA_ERROR_INVALID_VALUE, _drv.CUresult.CUDA_ERROR_NOT_SUPPORTED):
            # a driver that does not take both attributes: CuPy's cooperative launch from now on
            self._coop_refused = True
            return self.fn(grid, block, args, shared_mem, stream, enable_cooperative_groups=True)
        _, name = _drv.cuGetErrorName(err)
        raise LaunchError(f"{getattr(self.fn, 'name', 'kernel')}: cuLaunchKernelEx (programmatic dependent launch) "
                          f"failed with grid={grid}, block={block}, shared_mem={shared_mem}: "
                          f"{name.decode() if isinstance(name, bytes) else name}")

    def _config(self, key: tuple, grid: tuple, block: tuple) -> tuple:
        """The launch configuration of ``key`` (dimensions, shared memory, stream, cooperative):
        (the CUlaunchConfig, grid, block, shared memory)."""
        smem, handle, coop = key[2], key[3], key[4]
        cfg = _drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = smem
        cfg.hStream = _drv.CUstream(handle)
        cfg.attrs = list(_ATTR[:2 if coop else 1])
        cfg.numAttrs = 2 if coop else 1
        if len(self._configs) >= 64:   # a kernel launched on many grids / streams: start over
            self._configs.clear()
        entry = self._configs[key] = (cfg, grid, block, smem)
        return entry
