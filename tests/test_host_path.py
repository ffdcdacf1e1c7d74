"""The per-call host path, checked on the CPU: what Kernel.launch hands CuPy's Function (a
recording stand-in here), and how launch plans key a call.  GPU timings: tools/bench_host.py."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels import LaunchError
from rtkernels.ops import _arrays

SRC = ('#include "rtk/sm90.cuh"\n'
       'extern "C" __global__ void host_path(float* a, const float* b, float* c, int n, float alpha,\n'
       '                                     const __grid_constant__ rtk::sm90::TensorMap m) {}\n')


class RecordingFunction:
    """Stands in for cupy.cuda.function.Function: records how it was called."""

    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, shared_mem, stream):
        self.calls.append(("call", grid, block, args, shared_mem, stream))

    def linear_launch(self, size, args, shared_mem, block_max_size, stream):
        self.calls.append(("linear", size, block_max_size, args, shared_mem, stream))


class TorchLike:
    """The attributes Kernel.launch reads from a CUDA torch tensor."""
    is_cuda = True

    def __init__(self, ptr, dev=0):
        self.ptr, self.dev = ptr, dev

    def get_device(self):
        return self.dev

    def data_ptr(self):
        return self.ptr


@pytest.fixture(scope="module")
def kernel():
    k = rtk.compile(rtk.Template(SRC), arch="sm_90")
    if "_fn" not in k.launch.__globals__:
        pytest.skip("a multi-GPU launcher (reads the current device)")
    return k


@pytest.fixture
def fn(kernel):
    f = RecordingFunction()
    kernel.launch.__globals__["_fn"][0] = f
    yield f
    kernel.launch.__globals__["_fn"][0] = None


def _map():
    from rtkernels.tma import TENSOR_MAP_DTYPE
    return np.zeros((), TENSOR_MAP_DTYPE)[()]


def test_one_dimensional_launches_go_through_linear_launch(kernel, fn):
    m = _map()
    kernel.launch((4,), (128,), None, None, None, 5, 1.5, m)
    kernel.launch((4, 1, 1), (128, 1), None, None, None, 5, 1.5, m)
    kernel.launch((4, 2), (128,), None, None, None, 5, 1.5, m)
    kinds = [(c[0], c[1]) for c in fn.calls]
    assert kinds == [("linear", 512), ("linear", 512), ("call", (4, 2))]
    assert fn.calls[0][2] == 128     # block_max_size = the block, so the grid is exactly 4
    args = fn.calls[0][3]
    assert isinstance(args[4], np.float32) and args[4] == np.float32(1.5)
    assert _kernel_params(args)[3] == np.int32(5).tobytes()


def test_int_arguments_pass_in_shared_holders(kernel, fn):
    """An int parameter's value goes to CuPy in a pointer holder kept per value (CuPy would build a
    scalar holder per launch), with the bytes the driver copies for the parameter; wrong types
    and values out of range still fail in the launcher's words."""
    from cupy.cuda.function import CPointer
    m = _map()
    for n in (5, -7, 2 ** 31 - 1, -2 ** 31, 5):
        kernel.launch((1,), (32,), None, None, None, n, 1.5, m)
        arg = fn.calls[-1][3][3]
        assert isinstance(arg, CPointer) and _kernel_params(fn.calls[-1][3])[3] == np.int32(n).tobytes(), n
    assert fn.calls[-1][3][3] is fn.calls[0][3][3]   # the same value: the same holder
    kernel.launch((1,), (32,), None, None, None, np.int32(9), 1.5, m)   # NumPy ints: converted as before
    assert _kernel_params(fn.calls[-1][3])[3] == np.int32(9).tobytes()
    with pytest.raises(TypeError, match="must be an integer"):
        kernel.launch((1,), (32,), None, None, None, True, 1.5, m)
    with pytest.raises(TypeError, match="must be an integer"):
        kernel.launch((1,), (32,), None, None, None, 5.0, 1.5, m)
    with pytest.raises(OverflowError):
        kernel.launch((1,), (32,), None, None, None, 2 ** 31, 1.5, m)


def test_torch_tensors_pass_by_address(kernel, fn):
    from cupy.cuda import function
    kernel.launch((1,), (32,), TorchLike(4096), TorchLike(8192), None, 1, 0.0, _map())
    a, b = fn.calls[-1][3][:2]
    holder = getattr(function, "CIntptr", None)
    if holder is not None:
        assert isinstance(a, holder) and isinstance(b, holder)
    with pytest.raises(LaunchError, match="device 1"):
        kernel.launch((1,), (32,), TorchLike(4096, dev=1), None, None, 1, 0.0, _map())


def test_stream_handles_share_one_holder(kernel, fn):
    m = _map()
    kernel.launch((1,), (32,), None, None, None, 1, 0.0, m, stream=1234)
    kernel.launch((1,), (32,), None, None, None, 1, 0.0, m, stream=1234)
    s1, s2 = fn.calls[-2][-1], fn.calls[-1][-1]
    assert s1 is s2 and s1.ptr == 1234

    class TorchStream:
        cuda_stream = 77
    kernel.launch((1,), (32,), None, None, None, 1, 0.0, m, stream=TorchStream())
    assert fn.calls[-1][-1].ptr == 77
    with pytest.raises(TypeError, match="stream must be"):
        kernel.launch((1,), (32,), None, None, None, 1, 0.0, m, stream="s")


def test_memoized_tensor_maps_pass_as_cpointers(kernel, fn):
    from cupy.cuda.function import CPointer
    from rtkernels import tma
    m = _map()
    copy = np.frombuffer(m.tobytes(), np.uint8).copy()
    held = CPointer(copy.ctypes.data)
    tma.LAUNCH_ARGS[id(m)] = (m, held, copy)
    try:
        kernel.launch((1,), (32,), None, None, None, 1, 0.0, m)
        assert fn.calls[-1][3][5] is held
    finally:
        tma.LAUNCH_ARGS.pop(id(m), None)
    other = _map()   # not memoized: the record itself, checked as before
    kernel.launch((1,), (32,), None, None, None, 1, 0.0, other)
    assert fn.calls[-1][3][5] is other
    with pytest.raises(TypeError, match="tensor map is 128 bytes"):
        kernel.launch((1,), (32,), None, None, None, 1, 0.0, np.zeros(3, np.float32))


def _addr(a):
    """The address a pointer argument carries (a CuPy CIntptr holds it behind .ptr)."""
    if a is None or isinstance(a, (int, np.integer)):
        return a if a is None else int(a)
    import ctypes
    return ctypes.c_uint64.from_address(a.ptr).value


def _param(a, np_type):
    """The value a kernel parameter of ``np_type`` reads from a launch argument: a CuPy holder's
    leading bytes (the driver copies the parameter's size), else the argument as CuPy converts
    it (a Python int as int64, whose low bytes come first on a little-endian host)."""
    from cupy.cuda.function import CPointer
    if isinstance(a, CPointer):
        return np.frombuffer(ctypes.string_at(a.ptr, np.dtype(np_type).itemsize), np_type)[0]
    if type(a) is int:
        a = np.int64(a)
    return np.frombuffer(np.asarray(a).tobytes()[:np.dtype(np_type).itemsize], np_type)[0]


def test_bound_launch_hands_over_what_launch_does(kernel, fn):
    """Kernel.bind converts the trailing arguments once; run(head) passes head + them, as the
    launcher would have passed the same arguments."""
    from cupy.cuda import function
    m = _map()
    kernel.launch((4,), (128,), TorchLike(4096), None, TorchLike(8192), 5, 1.5, m, stream=99)
    want = fn.calls[-1]
    bound = kernel.bind((4,), (128,), TorchLike(1), None, TorchLike(2), 5, 1.5, m, free=3)
    head, keep = bound.convert((TorchLike(4096), None, TorchLike(8192)))
    assert keep == () and not any(isinstance(a, TorchLike) for a in head)   # addresses only
    holder = getattr(function, "CIntptr", None)
    if holder is not None:
        assert all(isinstance(a, holder) for a in (head[0], head[2]))
    bound.run(head, 99)
    got = fn.calls[-1]
    assert got[:3] == want[:3] and got[4:] == want[4:] and got[5].ptr == 99
    assert [_addr(a) for a in got[3][:3]] == [4096, None, 8192]
    # the bound scalars are held as the bytes CuPy would pass: what the kernel reads is the same
    assert _param(got[3][3], np.int32) == _param(want[3][3], np.int32) == 5
    assert _param(got[3][4], np.float32) == _param(want[3][4], np.float32) == np.float32(1.5)
    assert got[3][5] is want[3][5]
    with pytest.raises(LaunchError, match="device 1"):
        bound.convert((TorchLike(1, dev=1), None, None))
    empty = kernel.bind((0,), (128,), None, None, None, 5, 1.5, m, free=3)
    n = len(fn.calls)
    empty.run((None, None, None))
    assert len(fn.calls) == n     # a zero grid launches nothing


def test_bound_launch_keeps_memoized_maps_alive(kernel, fn):
    from cupy.cuda.function import CPointer
    from rtkernels import tma
    m = _map()
    copy = np.frombuffer(m.tobytes(), np.uint8).copy()
    held = CPointer(copy.ctypes.data)
    tma.LAUNCH_ARGS[id(m)] = (m, held, copy)
    try:
        bound = kernel.bind((1,), (32,), None, None, None, 1, 0.0, m, free=0)
        head, _ = bound.convert(())
        bound.run(head)
        assert fn.calls[-1][3][5] is held and bound.keep[0][2] is copy
        tail_map = kernel.bind((1,), (32,), None, None, None, 1, 0.0, _map(), free=6)
        head, keep = tail_map.convert((None, None, None, 1, 0.0, m))
        assert head[5] is held and keep[0][2] is copy   # the bytes the pointer reads travel with it
    finally:
        tma.LAUNCH_ARGS.pop(id(m), None)


class _TorchArray(TorchLike):
    """A TorchLike that OutputPlan.replay reads as a plan's torch array."""


def test_output_plan_replays_by_address(kernel, fn, monkeypatch):
    """A plan binds its launch once; arrays pass as addresses; built arguments (tensor maps) are
    converted once per address set and keep no array alive."""
    launch = _arrays.Launch(kernel, (2,), (64,), 0, (7, 0.5, _map()))
    plan = _arrays.OutputPlan(launch, (4,), "f", True)
    a, c = _TorchArray(4096), _TorchArray(8192)
    plan.replay((a, None, c), 5)
    plan.replay((a, None, _TorchArray(16384)), 5)
    assert len(plan.bound) == 1
    assert [_addr(x) for x in (fn.calls[-2][3][0], fn.calls[-2][3][2], fn.calls[-1][3][2])] == [4096, 8192, 16384]
    assert _param(fn.calls[-1][3][3], np.int32) == 7 and fn.calls[-1][0] == "linear"

    built = []

    def args(extra, arrays):
        built.append(arrays)
        return arrays[0], None, arrays[1]
    launch2 = _arrays.Launch(kernel, (1, 2), (64,), 0, (7, 0.5, _map()))
    plan2 = _arrays.OutputPlan(launch2, (4,), "f", True, extra="x")
    for ptr in (4096, 4096, 8192, 4096):
        plan2.replay((_TorchArray(ptr), _TorchArray(1 << 20)), None, args)
    assert len(built) == 1 + 2      # the bind's sample, then one conversion per address set
    assert _addr(fn.calls[-1][3][0]) == 4096 and fn.calls[-1][0] == "call"
    for head, keep in plan2.recent.values():
        assert not any(isinstance(x, TorchLike) for x in (*head, *keep))


def test_output_plan_allocates_like_the_input_only_with_its_layout():
    torch = pytest.importorskip("torch")
    launch = _arrays.Launch(None, (1,), (1,), 0, ())
    x = torch.randn(3, 4)
    assert _arrays.OutputPlan.of(launch, torch.empty(3, 4), like=x).like_input
    assert not _arrays.OutputPlan.of(launch, torch.empty(3, 4), like=x.t().contiguous().t()).like_input   # strides
    assert not _arrays.OutputPlan.of(launch, torch.empty(3, 4, dtype=torch.float64), like=x).like_input
    assert not _arrays.OutputPlan.of(launch, torch.empty(3, 4)).like_input
    plan = _arrays.OutputPlan.of(launch, torch.empty(3, 4), like=x)
    y = plan.output(x, None)
    assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == x.dtype


class FakeArray:
    """The attributes LaunchPlans.key reads from a CuPy array."""

    class _Mem:
        def __init__(self, ptr):
            self.ptr, self.device_id = ptr, 0

    def __init__(self, shape, ptr, dtype="float16"):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.strides = tuple(int(np.prod(shape[i + 1:])) * self.dtype.itemsize for i in range(len(shape)))
        self.data = self._Mem(ptr)


def test_plan_keys(monkeypatch):
    monkeypatch.setattr(_arrays, "_NDARRAY", FakeArray)
    monkeypatch.setattr(_arrays, "_MULTI_GPU", [False])
    plans = _arrays.LaunchPlans()
    a, b = FakeArray((4, 64), 1 << 20), FakeArray((4, 64), 2 << 20)
    k1 = plans.key((a, None), ("softmax", False))
    assert k1 == plans.key((b, None), ("softmax", False))              # same signature, other address
    assert k1 != plans.key((FakeArray((4, 64), (1 << 20) + 8), None), ("softmax", False))   # alignment
    assert k1 != plans.key((FakeArray((4, 64), 1 << 20, "float32"), None), ("softmax", False))
    assert plans.key((a, object()), ("softmax",)) is None                 # not an array kind
    assert plans.key((None, None), ("softmax",)) is None
    plans.put(k1, "plan")
    assert plans.get(plans.key((b, None), ("softmax", False))) == "plan"
    unhashable = plans.key((a,), ("softmax", [1]))
    assert plans.get(unhashable) is None
    plans.put(unhashable, "x")   # skipped, no error
    assert len(plans) == 1


def test_plan_key_proves_layout_and_device(monkeypatch):
    """A plan hit needs the same dtype, shape, strides, 16-byte alignment class and device (and
    array kind) as the call that recorded it: any change is a different key (a miss: the full
    path's checks run again)."""
    import cupy
    monkeypatch.setattr(_arrays, "_NDARRAY", FakeArray)
    monkeypatch.setattr(_arrays, "_MULTI_GPU", [False])
    plans = _arrays.LaunchPlans()
    a = FakeArray((4, 64), 1 << 20)
    plans.put(plans.key((a, None), ("op",)), "plan")
    same = FakeArray((4, 64), 3 << 20)
    assert plans.get(plans.key((same, None), ("op",))) == "plan"
    t = FakeArray((64, 4), 1 << 20)
    t.shape, t.strides = (4, 64), (2, 8)     # the transpose's layout: same shape, other strides
    changed = [FakeArray((4, 64), 1 << 20, "float32"), FakeArray((8, 32), 1 << 20), FakeArray((4, 64, 1), 1 << 20),
               t, FakeArray((4, 64), (1 << 20) + 2)]
    for c in changed:
        assert plans.get(plans.key((c, None), ("op",))) is None, (c.dtype, c.shape, c.strides, c.data.ptr)
    assert plans.get(plans.key((a, a), ("op",))) is None          # out given: another signature
    assert plans.get(plans.key((a, None), ("op", 1))) is None     # another option
    assert plans.key((a, TorchLike(4096)), ("op",)) is None         # mixed kinds: no plan
    # several GPUs: the device is part of the key, and a call off the current device has none
    monkeypatch.setattr(_arrays, "_MULTI_GPU", [True])
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    on1 = FakeArray((4, 64), 1 << 20)
    on1.data.device_id = 1
    k0 = plans.key((a, None), ("op",))
    assert k0[1] == 0 and plans.key((on1, None), ("op",)) is None
    assert plans.key((a, on1), ("op",)) is None
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 1)
    k1 = plans.key((on1, None), ("op",))
    assert k1 is not None and k1[1] == 1 and k1 != k0


def test_bound_scalars_are_held_once(kernel, fn):
    """Kernel.bind converts the bound scalars into CuPy holders once (CuPy converts anything
    else on every launch): ints as int64, floats as float64, NumPy scalars as themselves, None
    as a null pointer; the holders' arrays stay referenced by the bound launch."""
    from cupy.cuda.function import CPointer
    from rtkernels.kernel import _held
    held, owners = _held((None, 7, -3, 2.5, np.float32(1.5), np.int32(-9), np.bool_(True), "x", 1 << 70))
    assert all(isinstance(h, CPointer) for h in held[:7]) and held[7] == "x" and held[8] == 1 << 70
    # None as CuPy passes it: a holder pointing at the value 0 (a NULL holder would hand the
    # driver a NULL kernelParams entry: CUDA_ERROR_INVALID_VALUE, H100 2026-11-25)
    assert held[0].ptr != 0 and ctypes.string_at(held[0].ptr, 8) == bytes(8) and len(owners) == 6
    got = [np.frombuffer(ctypes.string_at(h.ptr, o.itemsize), o.dtype)[0] for h, o in zip(held[1:7], owners)]
    assert got == [7, -3, 2.5, np.float32(1.5), -9, True]
    assert [o.dtype for o in owners] == [np.int64, np.int64, np.float64, np.float32, np.int32, np.bool_]
    bound = kernel.bind((1,), (32,), None, None, None, 5, 1.5, _map(), free=3)
    assert all(isinstance(a, CPointer) for a in bound.tail[:2])


# The parameter sizes of SRC's host_path(a, b, c, n, alpha, m), as the driver copies them.
_SIZES = (8, 8, 8, 4, 4, 128)


def _kernel_params(args) -> list:
    """The bytes the driver reads for each argument of a launch handed to CuPy's Function: CuPy's
    own conversion (cupy/cuda/function.pyx ``_pointer``) modelled - None as a holder of 0, a
    ``CPointer`` as the bytes at its ``ptr`` (which must not be NULL: a NULL kernelParams entry
    is CUDA_ERROR_INVALID_VALUE), a Python int as int64, a float as float64, NumPy scalars and
    records as their own bytes."""
    from cupy.cuda.function import CPointer
    out = []
    for a, size in zip(args, _SIZES, strict=True):
        if a is None:
            out.append(bytes(size))
        elif isinstance(a, CPointer):
            assert a.ptr != 0, f"a NULL holder at argument {len(out)}: the driver refuses the launch"
            out.append(ctypes.string_at(a.ptr, size))
        elif type(a) is int:
            out.append(np.int64(a).tobytes()[:size])
        elif type(a) is float:
            out.append(np.float64(a).tobytes()[:size])
        else:
            assert isinstance(a, (np.generic, np.void)), type(a)
            out.append(a.tobytes()[:size])
    return out


def test_inlined_replay_passes_the_launchers_parameter_bytes(kernel, fn):
    """Every replay path (the first, through BoundLaunch.run; the inlined one after it) hands the
    driver the bytes Kernel.launch does for every parameter, null pointers among the bound
    arguments included (the attention forward binds optional pointers as None)."""
    m = _map()
    kernel.launch((2,), (64,), TorchLike(4096), None, None, 7, 0.5, m)
    want = _kernel_params(fn.calls[-1][3])
    for torch in (True, False):
        launch = _arrays.Launch(kernel, (2,), (64,), 0, (None, None, 7, 0.5, m))
        plan = _arrays.OutputPlan(launch, (4,), "f", torch)
        a = _TorchArray(4096) if torch else None
        for _ in range(3):
            plan.replay((a,), 5)
            got = _kernel_params(fn.calls[-1][3])
            if torch:
                assert got == want
            else:   # no array: the first pointer is null too
                assert got == [bytes(8)] + want[1:]
        assert plan.fast, "the later replays take the inlined launch"


def test_replays_opt_in_to_large_shared_memory_once(kernel, fn, monkeypatch):
    """Dynamic shared memory over 48 KiB needs the function's MAX_DYNAMIC_SHARED_SIZE raised
    before its first launch: the plan's bind does it (as Kernel.launch does) on the very Function
    every replay, inlined or not, then launches."""
    from cupy_backends.cuda.api import driver as cdrv
    from rtkernels import device
    events = []
    fn.ptr = 0xF00
    monkeypatch.setattr(device, "max_shared_per_block_optin", lambda dev=None: 227 * 1024)
    monkeypatch.setattr(cdrv, "funcSetAttribute", lambda f, attr, n: events.append(("optin", f, attr, n)))
    monkeypatch.setattr(kernel, "_smem_set", {})
    record = fn.__call__

    class Logged(RecordingFunction):
        ptr = 0xF00

        def __call__(self, grid, block, args, shared_mem, stream):
            events.append(("launch", shared_mem))
            record(grid, block, args, shared_mem, stream)
    kernel.launch.__globals__["_fn"][0] = logged = Logged()
    smem = 83016
    plan = _arrays.OutputPlan(_arrays.Launch(kernel, (1, 4, 2), (512,), smem, (None, None, 7, 0.5, _map())),
                              (4,), "f", True)
    for _ in range(3):
        plan.replay((_TorchArray(4096),), 5)
    assert plan.fast and plan.fast[0][0] is logged   # the inlined launch uses the opted-in Function
    assert events == [("optin", 0xF00, cdrv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)] + \
        [("launch", smem)] * 3
    events.clear()
    monkeypatch.setattr(kernel, "_smem_set", {})   # the launcher path: the same opt-in
    kernel.launch((1, 4, 2), (512,), None, None, None, 7, 0.5, _map(), shared_mem=smem)
    assert events == [("optin", 0xF00, cdrv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                      ("launch", smem)]


def test_every_call_of_a_module_function_matches_its_signature():
    """Each call in rtkernels/ of a module-level function - by its bare name in its own module,
    or as ``alias.name`` of an rtkernels module imported under an alias - binds to that
    function's signature (a changed signature with a stale caller failed only on the GPU:
    rowwise._replay from softmax_backward, 2026-11-25)."""
    import ast
    import pathlib
    root = pathlib.Path(rtk.__file__).parent
    defs, trees = {}, {}
    for path in sorted(root.rglob("*.py")):
        mod = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = trees[mod] = (path, ast.parse(path.read_text()))
        defs[mod] = {n.name: n for n in tree[1].body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    checked, bad = 0, []
    for mod, (path, tree) in trees.items():
        aliases = {}   # local name -> rtkernels module
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                base = f"{base}.{node.module}" if node.module else base
                for al in node.names:
                    if f"{base}.{al.name}" in defs:
                        aliases[al.asname or al.name] = f"{base}.{al.name}"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args) \
                    or any(k.arg is None for k in node.keywords):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id in defs[mod]:
                target = defs[mod][f.id]
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in aliases \
                    and f.attr in defs[aliases[f.value.id]]:
                target = defs[aliases[f.value.id]][f.attr]
            else:
                continue
            a = target.args
            if any(isinstance(d, (ast.Name, ast.Attribute)) and getattr(d, "id", "") == "property"
                   for d in target.decorator_list):
                continue
            params = [p.arg for p in (*a.posonlyargs, *a.args)]
            required = len(params) - len(a.defaults)
            given = len(node.args)
            kw = {k.arg for k in node.keywords}
            kwonly = {p.arg for p in a.kwonlyargs}
            needed_kwonly = {p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None}
            ok = ((a.vararg is not None or given <= len(params))
                  and all(p in kw for p in params[given:required])
                  and (a.kwarg is not None or kw <= set(params[given:]) | kwonly)
                  and needed_kwonly <= kw)
            checked += 1
            if not ok:
                bad.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)[:100]} "
                           f"-> {target.name}({', '.join(params)})")
    assert checked > 100 and not bad, "\n".join(bad)


def test_plan_key_of_torch_tensors_proves_layout(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.Tensor, "is_cuda", True, raising=False)   # CPU tensors standing in for CUDA ones
    monkeypatch.setattr(_arrays, "_MULTI_GPU", [False])
    plans = _arrays.LaunchPlans()
    base = torch.zeros(64, 64, dtype=torch.float16)
    x = base[:4]
    plans.put(plans.key((x, None), ("op",)), "plan")
    assert plans.get(plans.key((base[8:12], None), ("op",))) == "plan"     # same layout, other (aligned) address
    for c in (x.float(), base[:8], base[:4, :32], base[:64].t()[:4], base.view(-1)[1:257].view(4, 64)):
        assert plans.get(plans.key((c, None), ("op",))) is None, (c.dtype, tuple(c.shape), c.stride())
    assert plans.key((x, FakeArray((4, 64), 1 << 20)), ("op",)) is None   # torch and CuPy mixed


def test_plan_keys_of_torch_tensors():
    torch = pytest.importorskip("torch")
    plans = _arrays.LaunchPlans()
    assert plans.key((torch.ones(3),), ()) is None   # CPU tensors take the full path (which refuses them)


def test_fast_getenv_follows_os_environ(monkeypatch):
    from rtkernels._env import getenv
    monkeypatch.delenv("RTKERNELS_TEST_KNOB", raising=False)
    assert getenv("RTKERNELS_TEST_KNOB") is None and getenv("RTKERNELS_TEST_KNOB", "d") == "d"
    monkeypatch.setenv("RTKERNELS_TEST_KNOB", "x1")
    assert getenv("RTKERNELS_TEST_KNOB") == "x1"
    monkeypatch.setenv("RTKERNELS_TEST_KNOB", "")
    assert getenv("RTKERNELS_TEST_KNOB", "d") == ""


ADD = ('extern "C" __global__ void add3(const float* a, const float* b, float* c, int n) {\n'
       '    int i = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x * blockDim.x + blockIdx.x * blockDim.x\n'
       '            + threadIdx.x;\n'
       '    if (i < n) c[i] = a[i] + b[i];\n}\n')


@pytest.mark.gpu
def test_gpu_launch_paths_agree():
    """1-D (linear_launch) and 3-D (Function.__call__) launches, CuPy arrays and torch tensors,
    raw stream handles: the same sums, with outputs poisoned first."""
    import cupy as cp
    k = rtk.compile(rtk.Template(ADD))
    n = 1000
    a, b = cp.arange(n, dtype=cp.float32), cp.full(n, 0.5, cp.float32)
    for grid in ((4,), (2, 2, 1)):
        c = cp.full(n, cp.nan, cp.float32)
        k.launch(grid, (256,), a, b, c, n)
        cp.testing.assert_array_equal(c, a + b)
    s = cp.cuda.Stream(non_blocking=True)
    c = cp.full(n, cp.nan, cp.float32)
    cp.cuda.get_current_stream().synchronize()
    k.launch((4,), (256,), a, b, c, n, stream=s.ptr)
    s.synchronize()
    cp.testing.assert_array_equal(c, a + b)
    torch = pytest.importorskip("torch")
    ta, tb = torch.arange(n, dtype=torch.float32, device="cuda"), torch.full((n,), 0.5, device="cuda")
    tc = torch.full((n,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    k.launch((4,), (256,), ta, tb, tc, n)
    cp.cuda.Device().synchronize()
    assert torch.equal(tc, ta + tb)
    with pytest.raises(LaunchError, match="cpu"):
        k.launch((4,), (256,), ta.cpu(), tb, tc, n)


def test_varlen_plan_key_needs_both_hints_and_fixes_cu_seqlens(monkeypatch):
    """A varlen forward has a launch plan only with both max_seqlen hints as ints (without them the
    full path reads cu_seqlens); cu_seqlens' signature and the hints are part of the key (they fix
    the schedule's slots and the grid), cu_seqlens' address and contents are not."""
    from rtkernels.ops import attention as att
    monkeypatch.setattr(_arrays, "_NDARRAY", FakeArray)
    monkeypatch.setattr(_arrays, "_MULTI_GPU", [False])
    q, k = FakeArray((512, 4, 64), 1 << 20), FakeArray((512, 2, 64), 2 << 20)
    cu = FakeArray((6,), 3 << 20, "int32")

    def key(cu_=cu, mq=512, mk=512, **kw):
        return att._varlen_plan_key(q, k, k, None, cu_, cu_, mq, mk, True, None, True, None, kw.get("window"),
                                    None)

    base = key()
    assert base is not None
    assert key(mq=None) is None and key(mk=None) is None and key(mq=True) is None and key(mq=512.0) is None
    assert key(cu_=FakeArray((6,), 5 << 20, "int32")) == base                        # another address
    assert key(cu_=FakeArray((7,), 3 << 20, "int32")) != base                        # another batch
    assert key(cu_=FakeArray((6,), 3 << 20, "int64")) != base
    assert key(mq=300) != base and key(window=(63, 0)) != base


def test_varlen_backward_plan_key_needs_both_hints_and_fixes_cu_seqlens(monkeypatch):
    """A varlen backward has a launch plan only with both max_seqlen hints as ints; cu_seqlens'
    signature, the hints, the outputs' signatures and the options are part of the key, cu_seqlens'
    address and contents are not (the plan rewrites the schedule on the device each call)."""
    from rtkernels.ops import attention_bwd as bwd
    monkeypatch.setattr(_arrays, "_NDARRAY", FakeArray)
    monkeypatch.setattr(_arrays, "_MULTI_GPU", [False])
    q, k = FakeArray((512, 4, 64), 1 << 20), FakeArray((512, 2, 64), 2 << 20)
    lse = FakeArray((4, 512), 4 << 20, "float32")
    cu = FakeArray((6,), 3 << 20, "int32")

    def key(cu_=cu, mq=512, mk=512, outs=(None, None, None), det=False, **kw):
        return bwd._varlen_backward_plan_key((q, q, k, k, q, lse), outs, cu_, cu_, mq, mk, True, None, det, None, None,
                                             kw.get("window"), kw.get("softcap"))

    base = key()
    assert base is not None and base == key()
    assert key(mq=None) is None and key(mk=None) is None and key(mq=True) is None and key(mk=512.0) is None
    assert key(cu_=FakeArray((6,), 5 << 20, "int32")) == base                        # another address
    assert key(cu_=FakeArray((7,), 3 << 20, "int32")) != base                        # another batch
    assert key(cu_=FakeArray((6,), 3 << 20, "int64")) != base
    assert key(mq=300) != base and key(mk=300) != base and key(det=True) != base
    assert key(window=(63, 0)) != base and key(softcap=30.0) != base
    assert key(outs=(FakeArray((512, 4, 64), 6 << 20), None, None)) != base          # dq given
    monkeypatch.setattr(bwd._sm90, "ENABLED", False)                                 # the Hopper kernels off
    assert key() is None


def test_varlen_backward_plan_layout_and_launch_order(monkeypatch):
    """VarlenBackwardPlan: every temporary is a 256-byte aligned slice of one stream-workspace
    buffer, no two overlap (they are alive together in a call), one memset zeroes exactly the dQ
    accumulator and the deterministic counters; run() launches pre-pass, memset, schedule, main
    kernel, dQ conversion on the workspace's addresses.  Stand-ins for the kernels, the workspace
    and the tensor maps: nothing compiles."""
    import cupy
    from rtkernels.ops import attention_bwd_sm90 as B90, attention_mask as M
    from rtkernels.ops.attention_bwd import LSE_PAD

    class View:
        def __init__(self, shape, itemsize=2):
            self.shape, self.itemsize = shape, itemsize
            self.strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))

    log = []

    class K:
        def __init__(self, name):
            self.name = name

        def launch(self, grid, block, *args, shared_mem=0, stream=None):
            log.append((self.name, grid, args))

    monkeypatch.setattr(B90, "kernels_for", lambda cfg, arch: (K("main"), K("dot"), K("convert")))
    monkeypatch.setattr(M, "_schedule_kernels", lambda arch: (M.AttentionScheduleConfig(),
                                                             {n: K(n) for n in M.AttentionScheduleConfig.kernels}))
    base = 1 << 30
    monkeypatch.setattr(B90, "stream_workspace", lambda like, dev, stream, nbytes, _: (log.append(("ws", nbytes)) or
                                                                                        (Addr(base), None)))
    monkeypatch.setattr(B90, "address", lambda a: a)   # the stand-in arrays are their own addresses
    monkeypatch.setattr(B90, "tensor_map", lambda ptr, *a, **kw: ("map", ptr))
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync", lambda ptr, v, n, s: log.append(("memset", int(ptr), n)))
    monkeypatch.setattr(B90, "stream_handle", lambda s: 7)

    class Addr(int):
        pass

    batch, total_q, total_k, h, hkv, d = 5, 700, 900, 8, 2, 128
    rows = M.padded_offset_rows(total_q, batch, LSE_PAD)
    vl = M.Varlen("cu_q", "cu_k", batch, total_q, total_k, 300, 400)
    for det in (False, True):
        log.clear()
        cfg = B90.AttentionBwdSm90Config(dtype="bfloat16", head_dim=d, causal=True, deterministic=det, is_varlen=True)
        qv, kv = View((1, total_q, h, d)), View((1, total_k, hkv, d))
        outs = (FakeArray((total_q, h, d), 0), FakeArray((total_k, hkv, d), 0), FakeArray((total_k, hkv, d), 0))
        strides = tuple((0, h * d, d, 1) for _ in range(5))
        plan = B90.VarlenBackwardPlan.record(cfg, "sm_90a", (qv, qv, kv, kv, qv), outs, strides, 0.1, (9, h, 1),
                                             (0, 0, 0.0), vl, rows)
        lse2, delta, accum, count, table = plan.offsets
        slots = plan.grid[0] // hkv
        count_bytes = 16 * h * (rows // 64)
        parts = [(lse2, 4 * h * rows), (delta, 4 * h * rows), (accum, 4 * h * rows * d), (table, 8 * slots)]
        if det:
            parts.append((count, count_bytes))
        else:
            assert count is None
        spans = sorted((off, off + n) for off, n in parts)
        assert all(off % 256 == 0 for off, _ in spans)
        assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:])), spans       # disjoint
        assert spans[-1][1] <= plan.nbytes
        assert accum + plan.zero_bytes >= (count + count_bytes if det else accum + 4 * h * rows * d)
        assert accum + plan.zero_bytes <= table                                           # never the table
        plan.run(("do", "q", "k", "v", "o", "lse"), ("dq", "dk", "dv"), "cu_q", "cu_k", "q", 0, None)
        names = [e[0] for e in log]
        assert names == ["ws", "dot", "memset", "attention_schedule_sorted", "main", "convert"], names
        assert log[0][1] == plan.nbytes and log[2][1:] == (base + accum, plan.zero_bytes)
        main = log[4][2]
        assert main[:4] == (("map", "q"), ("map", "k"), ("map", "v"), ("map", "do"))
        assert main[4:10] == (base + lse2, base + delta, base + accum, None if count is None else base + count,
                              "dk", "dv")
        assert log[4][1] == (hkv * slots,) and base + table in main
        assert log[1][2][:5] == ("o", "do", "lse", base + lse2, base + delta)
        assert log[5][1] == (rows // 64, h, 1) and log[5][2][:2] == (base + accum, "dq")


def test_varlen_mma_backward_temporaries_share_one_workspace_buffer(monkeypatch):
    """The mma.sync varlen backward: lse2, delta, the dQ accumulator, the counters and BOTH
    schedule tables (attention_bwd's key tiles, the dQ pass's query tiles: alive in the same call)
    at disjoint 256-byte aligned offsets of one stream-workspace buffer; one memset zeroes the
    accumulator and counters.  Stand-ins for the schedule kernels and the workspace."""
    import cupy
    from rtkernels.ops import attention_bwd as bwd, attention_mask as M, workspace as W

    log = []

    class K:
        def __init__(self, name):
            self.name = name

        def launch(self, grid, block, *args, shared_mem=0, stream=None):
            log.append((self.name, args))

    class Addr(int):
        pass

    base = 1 << 30
    monkeypatch.setattr(M, "_schedule_kernels", lambda arch: (M.AttentionScheduleConfig(),
                                                             {n: K(n) for n in M.AttentionScheduleConfig.kernels}))
    monkeypatch.setattr(W, "stream_workspace", lambda like, dev, stream, nbytes, _: (log.append(("ws", nbytes)) or
                                                                                      (Addr(base), None)))
    monkeypatch.setattr(_arrays, "address", lambda a: a)
    monkeypatch.setattr(W, "stream_handle", lambda s: 7)
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync", lambda ptr, v, n, s: log.append(("memset", int(ptr), n)))
    vl = M.Varlen("cu_q", "cu_k", 5, 700, 900, 300, 400)
    rows, h, d = M.padded_offset_rows(700, 5, bwd.LSE_PAD), 4, 64
    for det, mode in ((True, "pass"), (True, "staged"), (False, "red")):
        log.clear()
        cfg = bwd.AttentionBwdConfig(dtype="float16", head_dim=d, causal=True, deterministic=det, dq_mode=mode,
                                     is_varlen=True)
        parts, (slots_k, slots_q) = bwd._varlen_mma_temporaries(cfg, "sm_90", vl, h, d, rows, "q", 0, None)
        lse2, delta, accum, count, table_k, table_q = (None if p is None else p - base for p in parts)
        sizes = [(lse2, 4 * h * rows), (delta, 4 * h * rows), (table_k, 8 * slots_k)]
        if mode == "pass":
            assert accum is None and count is None and slots_q > 0
            sizes.append((table_q, 8 * slots_q))
        else:
            assert table_q is None
            sizes.append((accum, 4 * h * rows * d))
            if det:
                sizes.append((count, 16 * h * (rows // cfg.block_m) * cfg.dq_units))
            memset = [e for e in log if e[0] == "memset"]
            assert memset == [("memset", base + accum, table_k - accum)]
            assert table_k >= max(off + n for off, n in sizes if off in (accum, count))
        spans = sorted((off, off + n) for off, n in sizes)
        assert all(off % 256 == 0 for off, _ in spans)
        assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:])), (mode, spans)
        assert log[0] == ("ws", -(-spans[-1][1] // 256) * 256)
        tables = [e[1][7] for e in log if e[0] == "attention_schedule_sorted"]   # its table argument
        assert tables == [base + t for t in ((table_k, table_q) if mode == "pass" else (table_k,))]
