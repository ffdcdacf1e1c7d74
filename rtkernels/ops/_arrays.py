"""Array plumbing shared by the ops: accept CuPy arrays, torch tensors, CAI/DLPack objects.

bfloat16 has no CuPy dtype, so a bfloat16 tensor is viewed as uint16 by CuPy (zero copy) and
its dtype is read from the original object.  Outputs are created as the same kind of array
as the first input (CuPy for CuPy, torch for torch).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .. import dtypes
from ..errors import ConfigError


def _is_torch(x) -> bool:
    """Whether ``x`` is a torch tensor (a set lookup once its type has been seen)."""
    t = type(x)
    return t in _TORCH_TYPES or _torch_type(t)


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
        view = _torch_view(x, cupy, torch)
        if view is not None:
            return view
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


_TORCH_TO_CUPY = {"float16": "float16", "bfloat16": "uint16", "float32": "float32", "float64": "float64",
                  "int8": "int8", "uint8": "uint8", "int16": "int16", "int32": "int32", "int64": "int64",
                  "bool": "bool"}
_TORCH_CUPY_DTYPE: dict = {}   # torch dtype -> CuPy dtype name (False: none); str(dtype) per call adds up


def _torch_view(x, cupy, torch):
    """CuPy view of a CUDA torch tensor built from its pointer, shape and strides; None when
    DLPack must do it.

    DLPack's exchange (``__dlpack__(stream=...)``) makes the consumer's stream wait on torch's
    current stream through an event, and costs tens of microseconds per array through the
    bindings (measured on an H200: 215 us of host time per ``rtk.matmul`` call with torch
    inputs against 85 us with CuPy inputs).  When torch's current stream on the tensor's device
    is the stream CuPy will launch on, there is nothing to order, so the view is made directly
    (the view keeps ``x`` alive).
    """
    dt = _TORCH_CUPY_DTYPE.get(x.dtype)
    if dt is None:
        dt = _TORCH_CUPY_DTYPE[x.dtype] = _TORCH_TO_CUPY.get(str(x.dtype).rpartition(".")[2], False)
    if dt is False:
        return None
    if x.numel() == 0:
        return None
    dev = x.get_device()
    if dev != cupy.cuda.runtime.getDevice():
        return None
    if torch_stream_ptr(torch, dev) != cupy.cuda.get_current_stream().ptr:
        return None
    return torch_view_as(x, dt, dev)


def torch_view_as(x, dtype, dev: int):
    """A CuPy view (CuPy dtype ``dtype`` of x's item size) of a non-empty CUDA torch tensor,
    built from its address, shape and strides; the view keeps ``x`` alive."""
    import cupy
    item = x.element_size()
    shape, strides = tuple(x.shape), tuple(s * item for s in x.stride())
    return cupy.ndarray(shape, dtype, _torch_memory(x, dev, strides), strides=strides)


def _torch_memory(x, dev: int, strides=None):
    """A CuPy MemoryPointer over the bytes a non-empty torch tensor spans (keeps it alive)."""
    import cupy
    item = x.element_size()
    strides = strides or tuple(s * item for s in x.stride())
    span = item + sum((n - 1) * s for n, s in zip(x.shape, strides))
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(x.data_ptr(), span, x, dev), 0)


_RAW_STREAM: list = []   # torch's raw current-stream getter, looked up once


def torch_stream_ptr(torch, dev: int) -> int:
    """Raw handle of torch's current stream on device ``dev``.  torch's private
    ``_cuda_getCurrentRawStream`` (what Triton's launcher calls) costs well under a microsecond;
    ``torch.cuda.current_stream(dev).cuda_stream`` builds a Stream object each time (~7 us of host
    time, and the ops asked up to ten times per call: 13-20% of rtk.attention's host time on an
    H200 host, 2026-11-21).  Falls back to the public call where the private one is missing."""
    if not _RAW_STREAM:
        _RAW_STREAM.append(_raw_stream_getter(torch))
    return _RAW_STREAM[0](dev)


def _raw_stream_getter(torch):
    # (apart from torch_stream_ptr: a lambda there would close over ``torch``, and a function with a
    # closed-over variable builds a cell for it at every call)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)


def _torch_stream_arg(dev: int):
    """torch's current stream on ``dev`` as CuPy's Function takes it: the raw handle (one C call)
    through kernel._stream_arg's cache of holders, so a torch replay builds no stream object."""
    if not _RAW_STREAM:
        torch_stream_ptr(sys.modules["torch"], dev)
    return _STREAM_ARG[0](_RAW_STREAM[0](dev))   # bound by OutputPlan._first_replay, which runs first


class _RawStream:
    """A raw stream handle in the CUDA stream protocol, for cupy.cuda.Stream.from_external."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def cupy_stream(stream):
    """``stream`` as a CuPy stream, for CuPy work (allocations from its pool, copies) that must be
    ordered with an op's launches: None is CuPy's current stream; a torch stream or raw handle is
    read the way Kernel.launch reads it."""
    import cupy
    from ..kernel import _StreamPtr
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream):
        return stream
    ptr = stream.ptr if hasattr(stream, "ptr") else _StreamPtr(stream).ptr
    return cupy.cuda.Stream.from_external(_RawStream(int(ptr)))


def default_stream(x, stream):
    """``stream``, or for a torch tensor ``x`` with none given, torch's current stream: where
    the tensor's producers and consumers are queued, so the launch is ordered with them."""
    if stream is None and _is_torch(x):
        return torch_stream_ptr(sys.modules["torch"], x.get_device())
    return stream


def address(a) -> int:
    """Base device address of a CuPy array or torch tensor."""
    if type(a) is _NDARRAY:
        return a.data.ptr
    return a.data_ptr() if _is_torch(a) else int(a.data.ptr)


def same_memory(views, arrays) -> bool:
    """Whether each CuPy view starts where its caller's array does (None entries skipped): no
    view is a copy, so a launch made on the views can be replayed on the arrays."""
    return all(a is None or int(v.data.ptr) == address(a) for v, a in zip(views, arrays))


def empty_as(like, shape, dtype):
    """An uninitialized array of ``like``'s kind (torch or CuPy; ``dtype`` that library's dtype
    object) on ``like``'s device - which for CuPy must be the current one, as launch plans check."""
    if type(like) is _NDARRAY:
        return _CUPY_EMPTY(shape, dtype)
    if _is_torch(like):
        return like.new_empty(shape, dtype=dtype)
    import cupy
    return cupy.empty(shape, dtype)


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


class _NotAnArray:
    pass


_NDARRAY: type = _NotAnArray      # cupy.ndarray once CuPy is imported (plans need it first)
_CUPY_EMPTY = None
_TORCH_TYPES: set = set()          # torch.Tensor and the subclasses seen (nn.Parameter ...)
_MULTI_GPU: list = []


def _bind_cupy() -> None:
    global _NDARRAY, _CUPY_EMPTY
    import cupy
    # cupy.empty(shape, dtype) is cupy.ndarray(shape, dtype, order="C") behind a Python frame;
    # the constructor itself (order "C" by default) saves that frame per allocated output
    _NDARRAY, _CUPY_EMPTY = cupy.ndarray, cupy.ndarray


_OTHER_TYPES: set = set()          # types seen that are not torch tensors (CuPy arrays, ...)


def _torch_type(t: type) -> bool:
    if t in _TORCH_TYPES:
        return True
    if t in _OTHER_TYPES:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(t, torch.Tensor):
        _TORCH_TYPES.add(t)
        return True
    if torch is not None or t is _NDARRAY:   # (before torch is imported no type is a tensor's)
        _OTHER_TYPES.add(t)
    return False


def array_signature(a):
    """What a launch plan depends on in an array: (kind, dtype, shape, strides, base address mod
    16, device) for a CuPy array (kind 0) or a CUDA torch tensor (kind 1); None for anything
    else (those take an op's full path every call)."""
    if _NDARRAY is _NotAnArray:
        _bind_cupy()
    if type(a) is _NDARRAY:
        mem = a.data
        return 0, a.dtype, a.shape, a.strides, mem.ptr & 15, mem.device_id
    if _torch_type(type(a)) and a.is_cuda:
        return 1, a.dtype, a.shape, a.stride(), a.data_ptr() & 15, a.get_device()
    return None


def device_pointer(a, dev: int):
    """A kernel argument for an array of a launch plan: CUDA torch tensors pass as they are
    (Kernel.launch takes their address, checking the device), as do CuPy arrays, None and
    scalars."""
    return a


class LaunchPlans:
    """Launch plans by call signature.  An op's checks, views and dispatch cost tens of
    microseconds of Python per call, and what they decide depends only on each array's dtype,
    shape, strides, 16-byte alignment and device plus the op's options: the first call with a
    signature stores what it launched (the op's own record) and later calls with the signature
    replay it.  Bounded: emptied when full (a program sees few signatures)."""

    def __init__(self, maxsize: int = 4096):
        self._plans: dict = {}
        self.maxsize = maxsize

    def key(self, arrays, options: tuple):
        """The call's key, or None when it cannot have a plan: every array given (None entries
        count as absent) must be a CuPy array, or every one a CUDA torch tensor, all on the
        current device.  (An unhashable option makes :meth:`get` miss and :meth:`put` skip, and
        the op's full path reports it.)

        Per array: dtype, shape, strides and base address mod 16 - four attribute reads, no
        helper calls (this runs on every call of every op: 3-6 us of host time went here
        before, on an H200 host).  The device is checked once per key, and only on a machine
        with several GPUs: with one, every array and the current device are device 0."""
        if _NDARRAY is _NotAnArray:
            _bind_cupy()
        if not _MULTI_GPU:
            from .. import device
            _MULTI_GPU.append(device.gpu_count() > 1)
        if _MULTI_GPU[0]:
            return _key_multi_gpu(arrays, options)
        # one GPU: every array and the current device are device 0 (no device reads, no
        # per-array device bookkeeping); written out here, not in a helper, to save the frame
        sigs = []
        kind = -1
        for a in arrays:
            if a is None:
                sigs.append(None)
                continue
            t = type(a)
            if t is _NDARRAY:
                if kind == 1:
                    return None
                kind = 0
                sigs.append((a.dtype, a.shape, a.strides, a.data.ptr & 15))
            elif (t in _TORCH_TYPES or _torch_type(t)) and a.is_cuda:
                if kind == 0:
                    return None
                kind = 1
                sigs.append((a.dtype, a.shape, a.stride(), a.data_ptr() & 15))
            else:
                return None
        if kind < 0:
            return None
        return (kind, 0, tuple(sigs), options)

    def get(self, key):
        if key is None:
            return None
        try:
            return self._plans.get(key)
        except TypeError:   # an unhashable option
            return None

    def put(self, key, plan) -> None:
        if key is None:
            return
        if len(self._plans) >= self.maxsize:
            self._plans.clear()
        try:
            self._plans[key] = plan
        except TypeError:
            pass

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


def _key_multi_gpu(arrays, options):
    """LaunchPlans.key on a machine with several GPUs: each array's device is read, all must be
    the current device, and the key carries it."""
    sigs = []
    kind = dev = None
    for a in arrays:
        if a is None:
            sigs.append(None)
            continue
        t = type(a)
        if t is _NDARRAY:
            mem = a.data
            sigs.append((a.dtype, a.shape, a.strides, mem.ptr & 15))
            k, d = 0, mem.device_id
        elif (t in _TORCH_TYPES or _torch_type(t)) and a.is_cuda:
            sigs.append((a.dtype, a.shape, a.stride(), a.data_ptr() & 15))
            k, d = 1, a.get_device()
        else:
            return None
        if kind is None:
            kind, dev = k, d
        elif k != kind or d != dev:
            return None
    if kind is None:
        return None
    import cupy
    if dev != cupy.cuda.runtime.getDevice():
        return None
    return (kind, dev, tuple(sigs), options)


@dataclass(frozen=True)
class Launch:
    """A recorded kernel launch: the kernel, grid, block, dynamic shared memory and the
    arguments after the arrays; ``cooperative``: every block resident at once
    (:meth:`rtkernels.Kernel.launch_cooperative`; a LaunchError where the device refuses the grid).
    Cooperative launches run through :meth:`run` only (not :meth:`bind` / OutputPlan replays)."""
    kernel: object
    grid: tuple
    block: tuple
    shared_mem: int
    tail: tuple
    cooperative: bool = False

    def run(self, arrays, stream) -> None:
        if self.cooperative:
            self.kernel.launch_cooperative(self.grid, self.block, *arrays, *self.tail, shared_mem=self.shared_mem,
                                           stream=stream)
            return
        self.kernel.launch(self.grid, self.block, *arrays, *self.tail, shared_mem=self.shared_mem, stream=stream)

    def bind(self, arrays):
        """This launch with everything but its ``arrays`` (the sample given) converted once:
        :meth:`rtkernels.Kernel.bind`."""
        if self.cooperative:
            raise TypeError("a cooperative Launch runs through Launch.run (bound launches are not cooperative)")
        return self.kernel.bind(self.grid, self.block, *arrays, *self.tail, shared_mem=self.shared_mem,
                                free=len(arrays))


_RECENT_PER_PLAN = 8   # address sets a plan keeps converted tensor-map arguments for


def remember(memo: dict, key, value, limit: int = _RECENT_PER_PLAN):
    """``memo[key] = value`` in a plan's memo of recent address sets (what a replay derives from
    its arrays' addresses: converted tensor-map arguments, tensor maps), which starts over once it
    holds ``limit`` sets (a program moving its arrays every call); returns ``value``."""
    if len(memo) >= limit:
        memo.clear()
    memo[key] = value
    return value


_HOLDER: list = []     # CuPy's pointer-argument holder (CIntptr), looked up once
_STREAM_TYPE: list = []   # cupy.cuda.Stream, looked up once
_STREAM_ARG: list = []    # rtkernels.kernel._stream_arg (a stream as CuPy's Function takes it)


@dataclass(frozen=True)
class OutputPlan:
    """The plan of an op with one output: its launch, the output's shape, dtype and kind (to
    allocate it when the caller gives none) and what else the op keeps (``extra``)."""
    launch: Launch
    out_shape: tuple
    out_dtype: object    # CuPy or torch dtype, as the op hands the output back
    torch: bool
    extra: object = None
    like_input: bool = False   # a torch output laid out as the op's first input: torch.empty_like(x)
    bound: list = field(default_factory=list, compare=False, repr=False)    # [BoundLaunch], made at first replay
    fast: list = field(default_factory=list, compare=False, repr=False)     # [what replay launches with]
    recent: dict = field(default_factory=dict, compare=False, repr=False)   # addresses -> converted arguments

    @classmethod
    def of(cls, launch: Launch, out, extra=None, like=None) -> "OutputPlan":
        """The plan of ``launch`` writing ``out``; ``like``: the op's first input, whose layout the
        plan's key fixes (so when ``out`` has its shape, dtype and strides, every replay's output
        can be ``torch.empty_like`` of it: ~1 us less than ``new_empty(shape, dtype=)``'s argument
        parsing on the development CPU, 2026-11-25)."""
        torch = _is_torch(out)
        same = (torch and like is not None and _is_torch(like) and like.dtype == out.dtype
                and tuple(like.shape) == tuple(out.shape) and tuple(like.stride()) == tuple(out.stride()))
        return cls(launch, tuple(out.shape), out.dtype, torch, extra, same)

    def output(self, like, out):
        """``out``, or a new output on ``like``'s device (``like``: the first input of the call)."""
        if out is not None:
            return out
        if self.torch:
            if self.like_input:   # empty_like keeps exact strides of a dense input: those recorded
                return sys.modules["torch"].empty_like(like)
            return like.new_empty(self.out_shape, dtype=self.out_dtype)
        return _CUPY_EMPTY(self.out_shape, self.out_dtype)   # a CuPy plan: the key proved like a cupy.ndarray

    def replay(self, arrays, stream, args=None, dev=None) -> None:
        """Launch on ``arrays`` (this plan's kind of array, or None where the plan has none).

        The launch is bound once (:meth:`Launch.bind`: grid, block and scalar arguments converted
        and checked, the scalars into the holders CuPy launches without converting), so a replay
        hands CuPy the arrays' addresses and converts nothing else (the launcher's per-argument
        conversions were ~40% of a torch replay's host time in a CPU profile, 2026-11-25).
        ``args(extra, arrays)`` builds the kernel's array arguments when they are not the arrays
        themselves (tensor maps): converted once per address set, the last few sets kept (a
        caching allocator hands a loop the same addresses call after call; a miss costs about
        what a launch through Kernel.launch costs).  ``stream`` as Kernel.launch takes it; for a
        torch plan with ``dev`` given (the plan key's device), None is torch's current stream on
        that device, as :func:`default_stream` gives it."""
        fast = self.fast
        if not fast:
            return self._first_replay(arrays, stream, args, dev)
        fn, linear, grid, block, tail, smem, block0, bound = fast[0]
        if self.torch:
            if stream is None:
                if dev is not None:
                    stream = _torch_stream_arg(dev)
            elif type(stream) is not _STREAM_TYPE[0]:
                stream = _STREAM_ARG[0](stream)
            # plain loops: a comprehension builds a function object per run in Python 3.11 (and a
            # closure cell for what it reads): ~1.2k instructions a replay
            if args is None:
                # each address in a new pointer holder (holders kept per address set would miss for
                # a model's many activations of one signature)
                holder = _HOLDER[0]
                head = []
                for a in arrays:
                    head.append(None if a is None else holder(a.data_ptr()))
                head = tuple(head)
            else:
                addrs = []
                for a in arrays:
                    addrs.append(None if a is None else a.data_ptr())
                addrs = tuple(addrs)
                hit = self.recent.get(addrs)
                head = hit[0] if hit is not None else self._convert(addrs, arrays, args, bound)
        else:
            if stream is not None and type(stream) is not _STREAM_TYPE[0]:
                stream = _STREAM_ARG[0](stream)
            if args is None:   # CuPy takes its arrays as they are
                head = tuple(arrays)
            else:
                addrs = []
                for a in arrays:
                    addrs.append(None if a is None else a.data.ptr)
                addrs = tuple(addrs)
                hit = self.recent.get(addrs)
                head = hit[0] if hit is not None else self._convert(addrs, arrays, args, bound)
        try:   # BoundLaunch.run's launch, inlined (one Python frame less per call)
            if linear:
                fn.linear_launch(linear, head + tail, smem, block0, stream)
            else:
                fn(grid, block, head + tail, smem, stream)
        except Exception as exc:
            bound.kernel._launch_failed(exc, grid, block, smem)

    def _converted(self, addrs, arrays, args, bound):
        hit = self.recent.get(addrs)
        return hit[0] if hit is not None else self._convert(addrs, arrays, args, bound)

    def _convert(self, addrs, arrays, args, bound):
        """The converted arguments of an address set not in ``recent`` (the replay looked), kept there."""
        # (arguments, the tensor maps they point into)
        return remember(self.recent, addrs, bound.convert(args(self.extra, arrays)))[0]

    def _first_replay(self, arrays, stream, args, dev) -> None:
        """Bind, then replay; the inlined launch serves later replays where the bound launch is
        a plain one (a parsed signature, a non-empty grid, no RTKERNELS_SYNC_LAUNCH check)."""
        from ..kernel import _SYNC_CHECK, _stream_arg
        import cupy
        bound = self.bound[0] if self.bound else self._bind(arrays, args)
        if not _STREAM_TYPE:
            _STREAM_TYPE.append(cupy.cuda.Stream)
            _STREAM_ARG.append(_stream_arg)
        if bound.parsed and bound.fn is not None and not _SYNC_CHECK:
            self.fast.append((bound.fn, bound.linear, bound.grid, bound.block, bound.tail, bound.shared_mem,
                              bound.block[0], bound))
            return self.replay(arrays, stream, args, dev)
        if self.torch and stream is None and dev is not None:
            stream = torch_stream_ptr(sys.modules["torch"], dev)
        if args is None:
            if self.torch and bound.parsed:
                holder = _HOLDER[0]
                head = tuple([None if a is None else holder(a.data_ptr()) for a in arrays])
            else:   # CuPy takes its arrays as they are (and an unparsed kernel's launch() anything)
                head = tuple(arrays)
        else:
            addrs = tuple([None if a is None else (a.data_ptr() if self.torch else a.data.ptr) for a in arrays])
            head = self._converted(addrs, arrays, args, bound)
        bound.run(head, stream)

    def _bind(self, arrays, args):
        if not _HOLDER:
            from ..kernel import _pointer_arg
            _HOLDER.append(_pointer_arg())
        self.bound.append(self.launch.bind(arrays if args is None else args(self.extra, arrays)))
        return self.bound[0]
