"""CPU model of rtk's per-call host path: the Python an op runs on a launch-plan hit, timed on a
machine without a GPU (``tools/bench_host.py --cpu-model``, or this file directly).

What is real: rtkernels' own code from the op's entry to the launcher's call into CuPy (plan key,
plan lookup, output allocation call, stream lookup, argument packing, ``torch.ops.rtk``'s
dispatcher and autograd kernel), CuPy ndarrays (built over unowned fake addresses; their
attribute reads are CuPy's own), torch tensors (CPU tensors of a subclass that says it is CUDA),
the kernels (compiled by NVRTC here, disk-cached).

What is stubbed (say so when quoting numbers):

* the launch: ``Kernel.function`` returns a Python object whose ``__call__``/``linear_launch``
  return at once, so CuPy's argument conversion and ``cuLaunchKernel`` are not in the times.
  CuPy's per-argument conversion is reported separately (``args`` column: what the launcher hands
  CuPy, by kind; see ``--cupy-args`` for what each kind costs CuPy, measured here through a real
  ``cupy.cuda.function.Function`` whose launch fails after conversion at its missing context);
* ``cupy.empty`` (the ops' CuPy output allocation): a ring of 4 preallocated arrays per (shape,
  dtype), i.e. a caching allocator at zero cost - add CuPy's own ``cupy.empty`` time for the GPU;
* the shared-memory opt-in (``Kernel._raise_smem_limit``: a driver attribute, once per kernel)
  is only recorded;
* tensor-map encoding (``tma._encode``: the driver's ``cuTensorMapEncodeTiled``): zero bytes;
  replays reuse the maps per address set, so this only runs when addresses change;
* torch's current stream: the raw getter returns 0 (on a GPU host it is one C call, timed by
  tools/bench_host.py as ``torch: current stream (raw getter)``);
* the device queries the full paths make while recording plans (``device.sm_count``: an H100's
  132; ``device.current_device``: 0);
* torch tensors are CPU tensors, and in this process ``torch.Tensor.is_cuda`` is patched to True
  and ``get_device`` to a Python function returning 0 (a C method on CUDA tensors); outputs come
  from torch's CPU allocator;
* the attention plan is recorded by the full path's own recording helper
  (``attention._remember_forward``) over CuPy stand-ins of the views, because the full path
  itself needs a device (views of torch tensors, tensor-map encoding); the softmax plans come
  from the real full path on CuPy arrays (the torch one re-keyed for the torch tensor), and so
  does matmul's (64 x 64 x 64 float16, the Hopper kernel's plan);
* ``torch.ops.rtk.*``: the same schemas and :func:`rtkernels.torch.op` registration, defined in
  a model namespace for the CPU dispatch key (CUDA tensors cannot exist here).

Times are per call, the best (and median) of ``--rounds`` rounds of ``--calls`` calls,
candidates interleaved; this machine is shared, so read the min.  They model Python overhead,
not the GPU host's absolute numbers (a faster CPU there).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("RTKERNELS_ARCH", "sm_90")
if "--tree" in sys.argv:   # before rtkernels is imported: time the package under that folder
    sys.path.insert(0, os.path.abspath(sys.argv[sys.argv.index("--tree") + 1]))
else:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402


class FakeFunction:
    """Stands in for cupy.cuda.function.Function: returns at once; remembers the last argument
    tuple's kinds (what CuPy would convert)."""
    ptr = 0
    last_args: tuple = ()

    def linear_launch(self, size, args, shared_mem=0, block_max_size=128, stream=None):
        FakeFunction.last_args = args

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        FakeFunction.last_args = args


FAKE_FN = FakeFunction()


def arg_kinds(args) -> str:
    """The launch's arguments by what CuPy does with them: CPointer subclasses pass as they are;
    ndarrays give their pointer; None, ints, floats, NumPy scalars and records are converted
    into a new holder every launch."""
    from cupy.cuda.function import CPointer
    import cupy
    counts: dict = {}
    for a in args:
        k = ("ptr" if isinstance(a, CPointer) else "ndarray" if isinstance(a, cupy.ndarray) else
             "None" if a is None else type(a).__name__)
        counts[k] = counts.get(k, 0) + 1
    return " ".join(f"{k}:{n}" for k, n in sorted(counts.items()))


_BASE = [1 << 32]


def fake_memory(nbytes: int):
    import cupy
    from cupy.cuda import memory
    ptr = _BASE[0]
    _BASE[0] += -(-max(nbytes, 1) // 512) * 512
    return memory.MemoryPointer(memory.UnownedMemory(ptr, max(nbytes, 1), None, 0), 0)


def fake_array(shape, dtype):
    import cupy
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) if len(shape) else 1
    return cupy.ndarray(tuple(shape), dtype, fake_memory(n * dtype.itemsize))


_RINGS: dict = {}


def fake_empty(shape, dtype=float):
    """cupy.empty at zero cost: the next of 4 preallocated arrays of (shape, dtype)."""
    key = (shape, dtype)
    ring = _RINGS.get(key)
    if ring is None:
        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        ring = _RINGS[key] = [[fake_array(shape_t, dtype) for _ in range(4)], 0]
    i = ring[1] = (ring[1] + 1) & 3
    return ring[0][i]


def install_stubs() -> None:
    import cupy  # noqa: F401
    from rtkernels import device, kernel as kmod, tma
    from rtkernels.ops import _arrays, rowwise
    kmod.Kernel.function = lambda self, device_id=None: FAKE_FN
    kmod.Kernel._raise_smem_limit = lambda self, fn, dev, nbytes: self._smem_set.__setitem__(dev, nbytes)
    _arrays._bind_cupy()
    _arrays._CUPY_EMPTY = fake_empty
    _arrays._MULTI_GPU[:] = [False]
    _arrays._RAW_STREAM[:] = [lambda dev: 0]
    rowwise.new_like = lambda x, shape, dtype=None: fake_empty(tuple(shape), np.uint16 if dtype == "bfloat16"
                                                             else np.dtype(dtype or x.dtype))
    tma._encode = lambda *a: np.zeros((), tma.TENSOR_MAP_DTYPE)[()]
    device.sm_count = lambda device=None: 132   # an H100's, for persistent / LPT grids
    device.current_device = lambda: 0            # (the full paths that record the plans ask)


def torch_fakes():
    """A maker of "CUDA" torch tensors, or None without torch: every torch.Tensor in this process
    says ``is_cuda`` and ``get_device() == 0`` (so outputs that torch allocates pass too)."""
    try:
        import torch
    except ImportError:
        return None
    torch.Tensor.is_cuda = True
    torch.Tensor.get_device = lambda self: 0

    def make(*shape, dtype):
        return torch.zeros(*shape, dtype=dtype)
    return make


class Rows:
    def __init__(self, calls: int, rounds: int):
        self.calls, self.rounds, self.fns, self.results = calls, rounds, {}, {}

    def add(self, name, fn):
        self.fns[name] = fn

    def run(self):
        for fn in self.fns.values():
            for _ in range(200):
                fn()
        times = {n: [] for n in self.fns}
        for _ in range(self.rounds):
            for name, fn in self.fns.items():
                FakeFunction.last_args = ()
                t0 = time.perf_counter()
                for _ in range(self.calls):
                    fn()
                times[name].append((time.perf_counter() - t0) / self.calls * 1e6)
                self.results[name] = {"min_us": min(times[name]), "median_us": statistics.median(times[name]),
                                      "args": arg_kinds(FakeFunction.last_args)}
        self.fns = {}


def setup(rows: Rows) -> None:
    import cupy
    import rtkernels as rtk
    from rtkernels.ops import _arrays, attention as att, rowwise
    from rtkernels.ops import attention_sm90 as sm90
    from rtkernels.ops.attention_mask import mask_spec

    # ---- floors: what any launch costs here with the stubs
    k = rtk.compile(rtk.Template('extern "C" __global__ void axpy3(const float* a, const float* b, float* c, '
                                 'int n) {}'))
    a, b, c = (fake_array((256,), np.float32) for _ in range(3))
    g, blk = (1,), (256,)
    rows.add("floor: fake linear_launch", lambda: FAKE_FN.linear_launch(256, (a, b, c, 256), 0, 256, None))
    rows.add("floor: fake cupy.empty + linear_launch",
             lambda: FAKE_FN.linear_launch(256, (fake_empty((4, 64), np.float16), b, c, 256), 0, 256, None))
    rows.add("launch: rtk Kernel.launch", lambda: k.launch(g, blk, a, b, c, 256))

    # ---- CuPy softmax: the real full path records the plans
    x = fake_array((4, 64), np.float16)
    y = fake_array((4, 64), np.float16)
    rtk.softmax(x)
    rtk.softmax(x, out=y)
    rows.add("cupy: rtk.softmax(x)", lambda: rtk.softmax(x))
    rows.add("cupy: rtk.softmax(x, out=y)", lambda: rtk.softmax(x, out=y))

    decode_rows(rows)

    fakes = torch_fakes()
    if fakes is None:
        print("torch not installed: torch rows skipped")
        return
    import torch
    make = fakes

    # ---- torch softmax: the CuPy plan's launch, keyed for the torch tensor
    tx = make(4, 64, dtype=torch.float16)
    ckey = rowwise._PLANS.key((x, None), ("softmax", False, -1, None, None))
    cplan = rowwise._PLANS.get(ckey)
    tkey = rowwise._PLANS.key((tx, None), ("softmax", False, -1, None, None))
    rowwise._PLANS.put(tkey, _arrays.OutputPlan.of(cplan.launch, torch.empty(4, 64, dtype=torch.float16), like=tx))
    rows.add("torch: rtk.softmax(x)", lambda: rtk.softmax(tx))

    # ---- torch attention: the plan recorded as attention() records it
    B, S, H, D = 1, 16, 2, 64
    q = make(B, S, H, D, dtype=torch.bfloat16)
    spec = mask_spec(True, None, None, False)
    kern, cfg = sm90.kernel_for("bfloat16", D, True, att._device_arch(0), tuple(spec.flags().items())[1:])
    views = [fake_array((B, S, H, D), np.uint16) for _ in range(4)]
    o, lse = torch.empty(B, S, H, D, dtype=torch.bfloat16), torch.empty(B, H, S, dtype=torch.float32)
    key = att._forward_plan_key(q, q, q, None, True, None, True, None)
    att._remember_forward(key, kern, cfg, views, o, lse, 1 / D ** 0.5, spec.kernel_args(S, S), q)
    assert att._FORWARD_PLANS.get(key) is not None
    rows.add("torch: rtk.attention(q, k, v)", lambda: rtk.attention(q, q, q, True))

    # ---- torch matmul: the CuPy full path's plan (Hopper kernel, 64 x 64 x 64), keyed for torch
    from rtkernels.ops import matmul as mm
    am, cm = fake_array((64, 64), np.float16), fake_array((64, 64), np.float16)
    rtk.matmul(am, am, out=cm)
    cplan = mm._LAUNCHES.get(mm._plan_key(am, am, None, cm, None, False, False, None))
    ta = make(64, 64, dtype=torch.float16)
    tkey = mm._plan_key(ta, ta, None, None, None, False, False, None)
    mm._LAUNCHES.put(tkey, _arrays.OutputPlan.of(cplan.launch, torch.empty(64, 64, dtype=torch.float16), cplan.extra,
                                                 like=ta))
    rows.add("torch: rtk.matmul(a, b)", lambda: rtk.matmul(ta, ta))

    # ---- torch.ops: the same registration, for the CPU dispatch key
    from rtkernels.torch import _library, _ops
    mm_schema = str(torch.ops.rtk.matmul.default._schema).split("::", 1)[1]
    lib = _MODEL_LIB.get("lib")
    if lib is None:
        lib = _MODEL_LIB["lib"] = torch.library.Library("rtk_cpu_model", "DEF")   # noqa: TOR901
        _library.op("attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? softmax_scale=None) "
                    "-> (Tensor, Tensor)", rtk.attention, fake=_ops._attention_fake, lib=lib, device="CPU")
        _library.op("softmax(Tensor x, bool log_softmax=False) -> Tensor",
                    lambda x, log_softmax: rtk.softmax(x, log_softmax=log_softmax),
                    fake=_ops._softmax_fake, lib=lib, device="CPU")
        # the same registration around kernels that return at once: the layer's own cost over
        # torch's floor (the floor ops below), without rtk's op behind it
        _library.op("attention_noop(Tensor q, Tensor k, Tensor v, bool causal=False, float? softmax_scale=None) "
                    "-> (Tensor, Tensor)", lambda *a: _MODEL_LIB["att_out"], fake=_ops._attention_fake, lib=lib,
                    device="CPU")
        _library.op("softmax_noop(Tensor x, bool log_softmax=False) -> Tensor", lambda *a: _MODEL_LIB["sm_out"],
                    fake=_ops._softmax_fake, lib=lib, device="CPU")
        # matmul's CUDA kernel as rtkernels.torch registers it (an older --tree: its wrapper of rtk.matmul)
        mm_impl = getattr(_ops, "_matmul_impl", None) or mm.matmul_positional
        _library.op(mm_schema, mm_impl, fake=_ops._matmul_fake, lib=lib, device="CPU")
        _library.op("matmul_noop" + mm_schema[len("matmul"):], lambda *a: _MODEL_LIB["mm_out"],
                    fake=_ops._matmul_fake, lib=lib, device="CPU")
    _MODEL_LIB["att_out"], _MODEL_LIB["sm_out"], _MODEL_LIB["mm_out"] = (o, lse), o, torch.empty_like(ta)
    model = torch.ops.rtk_cpu_model
    att_op, sm_op, mm_op = model.attention.default, model.softmax.default, model.matmul.default
    att_noop, sm_noop, mm_noop = model.attention_noop.default, model.softmax_noop.default, model.matmul_noop.default
    rows.add("torch: op() layer, attention schema, no-op kernel", lambda: att_noop(q, q, q, True))
    rows.add("torch: op() layer, softmax schema, no-op kernel", lambda: sm_noop(tx))
    rows.add("torch: op() layer, matmul schema, no-op kernel", lambda: mm_noop(ta, ta))
    rows.add("torch: torch.ops.rtk.attention", lambda: att_op(q, q, q, True))
    rows.add("torch: torch.ops.rtk.softmax", lambda: sm_op(tx))
    rows.add("torch: torch.ops.rtk.matmul", lambda: mm_op(ta, ta))
    from bench_host import add_floor_rows
    add_floor_rows(rows, _library.floor_op, str(att_op._schema).split("::", 1)[1], str(sm_op._schema).split("::", 1)[1],
                   (o, lse), o, q, tx, mm=(mm_schema, _MODEL_LIB["mm_out"], ta), device="CPU")
    rows.add("torch: empty_like(q) + new_empty(lse)",
             lambda: (torch.empty_like(q), q.new_empty((B, H, S), dtype=torch.float32)))


_MODEL_LIB: dict = {}


def decode_rows(rows: Rows) -> None:
    """rtk.attention_kvcache on CuPy arrays, a tiny decode step (tools/bench_decode.py's host
    cases): the full path records each plan (device queries stubbed: an H100's 132 SMs, its DRAM;
    the split workspace made once over fake memory), then the rows time the replays."""
    import cupy
    import rtkernels as rtk
    from rtkernels import device
    from rtkernels.ops import workspace

    class NoDevice:   # the full path's `with cupy.cuda.Device(...)` (a driver call)
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False
    real_device, cupy.cuda.Device = cupy.cuda.Device, NoDevice
    device.dram_gbs = lambda dev=0: 3350.0
    workspace._capturing = lambda handle: False
    workspace._buffer = lambda like, nbytes, handle, zero: fake_array((max(nbytes, 1),), np.uint8)
    b, sk, h, hkv, d = 1, 256, 32, 8, 128
    q = fake_array((b, 1, h, d), np.uint16)
    kc, vc = fake_array((b, sk, hkv, d), np.uint16), fake_array((b, sk, hkv, d), np.uint16)
    lens = fake_array((b,), np.int32)
    out = fake_array((b, 1, h, d), np.uint16)
    pages = fake_array((sk // 16, 16, hkv, d), np.uint16)
    table = fake_array((b, sk // 16), np.int32)
    calls = {
        "cupy: rtk.attention_kvcache(out=)": lambda: rtk.attention_kvcache(q, kc, vc, lens, out=out, dtype="bfloat16"),
        "cupy: rtk.attention_kvcache (new output)": lambda: rtk.attention_kvcache(q, kc, vc, lens, dtype="bfloat16"),
        "cupy: rtk.attention_kvcache paged (out=)": lambda: rtk.attention_kvcache(q, pages, pages, lens, block_table=table,
                                                                               out=out, dtype="bfloat16"),
        "cupy: rtk.attention_kvcache 4 splits + lse": lambda: rtk.attention_kvcache(q, kc, vc, lens, num_splits=4,
                                                                                 return_lse=True, dtype="bfloat16"),
    }
    # rtk.attention on few query rows over >= 16 MiB of K/V: the decode route (attention.DecodeRoute)
    sk_r = 8192
    qr, kr, vr = (fake_array((b, 1, h, d), np.uint16), fake_array((b, sk_r, hkv, d), np.uint16),
                  fake_array((b, sk_r, hkv, d), np.uint16))
    calls["cupy: rtk.attention routed to decode (B1 S8k)"] = lambda: rtk.attention(qr, kr, vr, True, dtype="bfloat16")
    try:
        for name, fn in calls.items():
            fn()   # the full path: records the plan
            rows.add(name, fn)
    finally:
        cupy.cuda.Device = real_device


def cupy_arg_costs(n: int = 3000, rounds: int = 7) -> dict:
    """What CuPy's launch costs per argument of each kind, through a real Function object (made
    without a module: its launch converts every argument, then fails for want of a context);
    differences against CPointer arguments, so the failure's cost cancels."""
    import cupy
    from cupy.cuda import function as f
    from rtkernels.tma import TENSOR_MAP_DTYPE
    fn = f.Function.__new__(f.Function)

    class S:
        ptr = 0
    s = S()

    def t(args):
        best = 1e9
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                try:
                    fn.linear_launch(256, args, 0, 256, s)
                except Exception:   # noqa: BLE001 - no context: after the conversions
                    pass
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best
    kinds = {"ptr (CPointer)": f.CIntptr(5), "None": None, "int": 5, "float": 5.0, "np.int32": np.int32(5),
             "np.float32": np.float32(5), "ndarray": fake_array((4,), np.float32),
             "np.void (tensor map)": np.zeros((), TENSOR_MAP_DTYPE)[()]}
    base = t((f.CIntptr(5),) * 16)
    return {k: (t((v,) * 16) - base) / 16 for k, v in kinds.items()}


_COST_KIND = {"ptr": "ptr (CPointer)", "int32": "np.int32", "float32": "np.float32", "void": "np.void (tensor map)"}


def _conversion_us(args: str, costs: dict) -> float:
    """CuPy's conversion time for a launch's arguments (``arg_kinds``' text) at ``costs``."""
    total = 0.0
    for kv in args.split():
        kind, n = kv.split(":")
        total += int(n) * max(costs.get(_COST_KIND.get(kind, kind), 0.0), 0.0)
    return total


def compare(ns) -> dict:
    """Each row's best over ``--repeat`` alternating runs of the base tree and this one (the
    development machine is shared: its speed drifts by 2x within minutes, so only runs close
    in time compare)."""
    import json
    import subprocess
    import tempfile
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    best: dict = {"base": {}, "this": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ns.repeat):
            for name, tree in (("base", ns.compare), ("this", here)):
                out = os.path.join(tmp, f"{name}{i}.json")
                subprocess.run([sys.executable, os.path.abspath(__file__), "--tree", tree, "--calls", str(ns.calls),
                                "--rounds", str(ns.rounds), "--json", out], check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    for row, r in json.load(f).items():
                        b = best[name].get(row)
                        if b is None or r["min_us"] < b["min_us"]:
                            best[name][row] = r
    costs = cupy_arg_costs(4000, 7)   # one estimate for both trees (it is noisy run to run)
    for tree in best.values():
        for r in tree.values():
            r["cupy_us"] = _conversion_us(r["args"], costs)
    rows = list(best["this"])
    width = max(len(r) for r in rows)
    print(f"best of {ns.repeat} alternating runs per tree, us per call: Python (stubbed launch) + CuPy's argument "
          f"conversion (estimated) = total\n  {'':<{width}}  {'base':>21}  {'this tree':>21}")
    for row in rows:
        b, t = best["base"].get(row), best["this"][row]
        fmt = lambda r: f"{r['min_us']:6.2f} +{r['cupy_us']:5.2f} = {r['min_us'] + r['cupy_us']:6.2f}"  # noqa: E731
        print(f"  {row:<{width}}  {fmt(b) if b else '':>21}  {fmt(t):>21}")
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--cupy-args", action="store_true", help="also print CuPy's conversion cost per argument kind")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--compare", metavar="BASE_TREE", help="run this model on BASE_TREE and on this tree "
                   "alternately (--repeat times each, separate processes) and print each row's best per tree")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--profile", help="cProfile this row (a name from the table) instead")
    p.add_argument("--tree", help="time the rtkernels package under this folder (e.g. an older tree: git archive "
                                  "<commit> rtkernels templates | tar -x -C base); compare trees run back to back")
    ns = p.parse_args(argv)
    if ns.compare:
        return compare(ns)
    install_stubs()
    rows = Rows(ns.calls, ns.rounds)
    setup(rows)
    if ns.profile:
        import cProfile
        import pstats
        fn = rows.fns[ns.profile]
        for _ in range(200):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(ns.calls * 5):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return {}
    rows.run()
    res = rows.results
    costs = cupy_arg_costs(1500, 5)
    for r in res.values():   # what CuPy's launch would add converting these arguments
        r["cupy_us"] = _conversion_us(r["args"], costs)
    if ns.json:
        import json
        with open(ns.json, "w") as f:
            json.dump(res, f)
    width = max(len(k) for k in res)
    import rtkernels
    print(f"\nrtkernels from {os.path.dirname(rtkernels.__file__)}")
    print(f"CPU model of host time per call, us (stubs: see tools/host_model.py; min / median of {ns.rounds} "
          f"rounds of {ns.calls}; then CuPy's conversion of the launch's arguments, estimated from --cupy-args' "
          "per-kind costs, which the stubbed launch does not run)")
    for name, r in res.items():
        print(f"  {name:<{width}}  {r['min_us']:6.2f}  {r['median_us']:6.2f}  +{r['cupy_us']:5.2f}   {r['args']}")

    def d(a, b):
        return res[a]["min_us"] - res[b]["min_us"] if a in res and b in res else float("nan")
    print("\nrtk's own Python per call (min), stubs subtracted:")
    print(f"  cupy softmax, new output:   {d('cupy: rtk.softmax(x)', 'floor: fake cupy.empty + linear_launch'):6.2f}")
    print(f"  cupy softmax, out given:    {d('cupy: rtk.softmax(x, out=y)', 'floor: fake linear_launch'):6.2f}")
    print(f"  Kernel.launch:              {d('launch: rtk Kernel.launch', 'floor: fake linear_launch'):6.2f}")
    if "torch: torch.ops.rtk.attention" in res:
        for name, direct, schema in (("attention", "torch: rtk.attention(q, k, v)", "attention schema"),
                                     ("softmax", "torch: rtk.softmax(x)", "softmax schema"),
                                     ("matmul", "torch: rtk.matmul(a, b)", "matmul schema")):
            extra = d(f"torch: torch.ops.rtk.{name}", direct)
            floor = d(f"torch: floor op, {schema}", f"torch: floor fn, {schema}")
            ffloor = d(f"torch: floor op (new outputs), {schema}", f"torch: floor fn (new outputs), {schema}")
            print(f"  torch.ops.rtk.{name:<10} adds {extra:6.2f}; torch's floor {floor:6.2f} (returning new "
                  f"tensors {ffloor:6.2f}); rtk's share {extra - floor:6.2f} ({extra - ffloor:6.2f})")
        print(f"  torch attention replay minus its allocations: "
              f"{d('torch: rtk.attention(q, k, v)', 'torch: empty_like(q) + new_empty(lse)'):6.2f}")
    if ns.cupy_args:
        print("\nCuPy's conversion per launch argument, us (beyond a CPointer's):")
        for k, v in costs.items():
            print(f"  {k:<22} {v:6.3f}")
    return res


if __name__ == "__main__":
    main()
