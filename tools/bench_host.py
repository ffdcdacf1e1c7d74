"""Host time per call (tiny inputs, so the host is all there is) of rtk's launch path, ops and
torch custom ops, against their peers in the same process.  Run on a GPU host:

    PYTHONPATH=. python tools/bench_host.py --out $OUT

Each row: microseconds per call of a loop of ``--calls`` calls, synchronizing only at the end;
every candidate runs once per round, rounds interleaved (``--rounds``), median and min of the
rounds reported.  A loop is short enough that the launch queue never fills (the GPU finishes a
tiny kernel faster than the host issues the next), so this is host time, not kernel time.
Sections: the launch floor (Kernel.launch vs CuPy RawKernel, same signature), the CuPy ops, the
torch ops against torch's own, the torch custom-op layer (``torch.ops.rtk``) against the direct
call, and a breakdown of rtk.attention's torch path.  JSON to ``$OUT/bench_host.json``; the
summary table with the issue's targets is printed last.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402

KERNEL = r'''extern "C" __global__ void axpy3(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}'''


class Rows:
    """Candidates timed in interleaved rounds."""

    def __init__(self, calls: int, rounds: int):
        self.calls, self.rounds = calls, rounds
        self.fns: dict = {}
        self.results: dict = {}
        self.sync = None

    def add(self, name: str, fn) -> None:
        self.fns[name] = fn

    def run(self) -> None:
        for fn in self.fns.values():      # warm: compile, load, record the launch plans
            for _ in range(50):
                fn()
        self.sync()
        times: dict = {n: [] for n in self.fns}
        for _ in range(self.rounds):
            for name, fn in self.fns.items():
                self.sync()
                t0 = time.perf_counter()
                for _ in range(self.calls):
                    fn()
                self.sync()
                times[name].append((time.perf_counter() - t0) / self.calls * 1e6)
        for name, ts in times.items():
            self.results[name] = {"median_us": statistics.median(ts), "min_us": min(ts)}
        self.fns.clear()


def launch_floor(rows: Rows):
    import cupy as cp
    import numpy as np
    import rtkernels as rtk
    import rtkernels.kernel as kmod
    n = 256
    a, b, c = (cp.ones(n, cp.float32) for _ in range(3))
    raw = cp.RawKernel(KERNEL, "axpy3")
    k = rtk.compile(rtk.Template(KERNEL))
    fn = k.function()
    n32 = np.int32(n)
    g, blk = (1,), (256,)
    rows.add("launch: cupy RawKernel (int)", lambda: raw(g, blk, (a, b, c, n)))
    rows.add("launch: cupy RawKernel (np.int32)", lambda: raw(g, blk, (a, b, c, n32)))
    rows.add("launch: cupy Function.__call__", lambda: fn(g, blk, (a, b, c, n)))
    rows.add("launch: cupy Function.linear_launch", lambda: fn.linear_launch(256, (a, b, c, n), 0, 256))
    rows.add("launch: rtk Kernel.launch", lambda: k.launch(g, blk, a, b, c, n))
    kmod.LINEAR_LAUNCH = False
    k2 = kmod.Kernel(k.module, k.name)   # same code, a launcher without the linear path
    k2.launch(g, blk, a, b, c, n)
    kmod.LINEAR_LAUNCH = True
    rows.add("launch: rtk Kernel.launch (Function.__call__)", lambda: k2.launch(g, blk, a, b, c, n))
    rows.add("launch: rtk Kernel.launch (3-D grid)", lambda: k.launch((1, 1, 1), (256, 1, 1), a, b, c, n))
    rows.add("cupy.empty(256)", lambda: cp.empty(n, cp.float32))
    try:
        import torch
        ta, tb, tc = (torch.ones(n, device="cuda") for _ in range(3))
        rows.add("launch: rtk Kernel.launch (torch tensors)", lambda: k.launch(g, blk, ta, tb, tc, n))
    except ImportError:
        pass


def cupy_ops(rows: Rows):
    import cupy as cp
    import rtkernels as rtk
    x = cp.random.standard_normal((4, 64), dtype=cp.float32).astype(cp.float16)
    y = cp.empty_like(x)
    w = cp.ones(64, cp.float16)
    a = cp.random.standard_normal((64, 64), dtype=cp.float32).astype(cp.float16)
    cm = cp.empty((64, 64), cp.float16)
    rows.add("cupy: rtk.softmax(x)", lambda: rtk.softmax(x))
    rows.add("cupy: rtk.softmax(x, out=y)", lambda: rtk.softmax(x, out=y))
    rows.add("cupy: rtk.rmsnorm(x, w, out=y)", lambda: rtk.rmsnorm(x, w, out=y))
    rows.add("cupy: rtk.layernorm(x, w, w, out=y)", lambda: rtk.layernorm(x, w, w, out=y))
    rows.add("cupy: rtk.reduce(x)", lambda: rtk.reduce(x))
    rows.add("cupy: rtk.matmul(a, a, out=c)", lambda: rtk.matmul(a, a, out=cm))
    rows.add("cupy: cupy.matmul(a, a)", lambda: cp.matmul(a, a))


def torch_ops(rows: Rows):
    import torch
    import torch.nn.functional as F
    import rtkernels as rtk
    try:
        import rtkernels.torch as rtt
    except ImportError:   # an older tree (--tree): rtk ops on torch tensors only
        rtt = None
    dev = "cuda"
    x = torch.randn(4, 64, device=dev, dtype=torch.float16)
    w = torch.ones(64, device=dev, dtype=torch.float16)
    a = torch.randn(64, 64, device=dev, dtype=torch.float16)
    q = torch.randn(1, 16, 2, 64, device=dev, dtype=torch.bfloat16)
    qh = q.transpose(1, 2)
    do = torch.randn_like(q)
    o, lse = rtk.attention(q, q, q, True)
    rows.add("torch: rtk.attention(q, k, v)", lambda: rtk.attention(q, q, q, True))
    rows.add("torch: F.scaled_dot_product_attention", lambda: F.scaled_dot_product_attention(qh, qh, qh, is_causal=True))
    rows.add("torch: rtk.attention_backward", lambda: rtk.attention_backward(do, q, q, q, o, lse, True))
    rows.add("torch: rtk.matmul(a, b)", lambda: rtk.matmul(a, a))
    rows.add("torch: torch.matmul(a, b)", lambda: torch.matmul(a, a))
    rows.add("torch: rtk.softmax(x)", lambda: rtk.softmax(x))
    rows.add("torch: torch.softmax(x)", lambda: torch.softmax(x, -1))
    rows.add("torch: rtk.rmsnorm(x, w)", lambda: rtk.rmsnorm(x, w))
    if hasattr(F, "rms_norm"):
        rows.add("torch: F.rms_norm(x)", lambda: F.rms_norm(x, (64,), w, 1e-6))
    rows.add("torch: torch.empty(4, 64)", lambda: torch.empty((4, 64), dtype=torch.float16, device=dev))
    rows.add("torch: x.new_empty(4, 64)", lambda: x.new_empty((4, 64)))
    if rtt is None:
        return
    rows.add("torch: torch.ops.rtk.attention", lambda: torch.ops.rtk.attention.default(q, q, q, True))
    rows.add("torch: rtt.scaled_dot_product_attention", lambda: rtt.scaled_dot_product_attention(qh, qh, qh, is_causal=True))
    rows.add("torch: torch.ops.rtk.attention_backward",
             lambda: torch.ops.rtk.attention_backward.default(do, q, q, q, o, lse, True))
    rows.add("torch: torch.ops.rtk.matmul", lambda: torch.ops.rtk.matmul.default(a, a))
    rows.add("torch: torch.ops.rtk.softmax", lambda: torch.ops.rtk.softmax.default(x))
    rows.add("torch: torch.ops.rtk.rmsnorm", lambda: torch.ops.rtk.rmsnorm.default(x, w, 1e-6))

    # torch's own custom_op path around the same call, to show what the lean registration saves
    # (schema given: this module's annotations are strings, which infer_schema cannot read)
    lib_name = "rtk_bench_ref"
    if not hasattr(torch.ops, lib_name) or not hasattr(getattr(torch.ops, lib_name), "softmax"):
        ref_def = torch.library.custom_op(f"{lib_name}::softmax", lambda t: rtk.softmax(t), mutates_args=(),
                                          schema="(Tensor t) -> Tensor")
        ref_def.register_fake(lambda t: torch.empty_like(t))
    ref = getattr(torch.ops, lib_name).softmax.default
    rows.add("torch: torch.library.custom_op(rtk.softmax)", lambda: ref(x))

    # torch's dispatcher floor: the same schemas with one Python kernel that returns at once,
    # against that kernel called directly (what any Python-registered op costs)
    from rtkernels.torch._library import floor_op
    add_floor_rows(rows, floor_op, str(torch.ops.rtk.attention.default._schema).split("::", 1)[1],
                   str(torch.ops.rtk.softmax.default._schema).split("::", 1)[1], (o, lse), x, q, x,
                   mm=(str(torch.ops.rtk.matmul.default._schema).split("::", 1)[1], torch.empty_like(a), a))

    from rtkernels.ops._arrays import torch_stream_ptr
    rows.add("torch: current stream (raw getter)", lambda: torch_stream_ptr(torch, 0))
    rows.add("torch: current stream (public)", lambda: torch.cuda.current_stream().cuda_stream)


def attention_breakdown(rows: Rows):
    """The pieces of rtk.attention's torch replay, timed alone."""
    import torch
    import rtkernels as rtk
    from rtkernels.ops import attention as att
    from rtkernels.ops import attention_sm90 as sm90
    from rtkernels.ops._arrays import address, default_stream
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    rtk.attention(q, q, q, True)
    key = att._forward_plan_key(q, q, q, None, True, None, True, None)
    plan = att._FORWARD_PLANS.get(key)
    if plan is None:
        return
    cfg, specs, lse_spec = plan.extra[:3]
    o = plan.output(q, None)
    lse = q.new_empty(lse_spec[0], dtype=lse_spec[1])
    maps = sm90.tensor_maps(cfg, *(address(t) for t in (q, q, q, o)), specs=specs)
    rows.add("attention part: plan key", lambda: att._forward_plan_key(q, q, q, None, True, None, True, None))
    rows.add("attention part: plan lookup", lambda: att._FORWARD_PLANS.get(key))
    rows.add("attention part: o and lse allocations",
             lambda: (plan.output(q, None), q.new_empty(lse_spec[0], dtype=lse_spec[1])))
    rows.add("attention part: 4 tensor maps (memo hits)",
             lambda: sm90.tensor_maps(cfg, *(address(t) for t in (q, q, q, o)), specs=specs))
    rows.add("attention part: launch (Kernel.launch)", lambda: plan.launch.run((*maps, lse), default_stream(q, None)))
    if hasattr(plan, "replay"):   # this tree: the bound launch, maps converted per address set
        rows.add("attention part: replay (bound launch)",
                 lambda: plan.replay((q, q, q, o, lse), default_stream(q, None), att._forward_args))


def profile(out: str, calls: int = 20000) -> None:
    """cProfile of the hot paths over ``calls`` calls each (the table of where host time goes):
    CuPy rtk.softmax with a new output, rtk.attention and torch.ops.rtk.attention on torch
    tensors.  Top entries by own time to ``$OUT/profile_<name>.txt``."""
    import cProfile
    import io
    import pstats
    import cupy as cp
    import rtkernels as rtk
    x = cp.random.standard_normal((4, 64), dtype=cp.float32).astype(cp.float16)
    cases = {"cupy_softmax": lambda: rtk.softmax(x)}
    try:
        import torch
        import rtkernels.torch  # noqa: F401
        q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
        cases["torch_attention"] = lambda: rtk.attention(q, q, q, True)
        cases["torch_ops_attention"] = lambda: torch.ops.rtk.attention.default(q, q, q, True)
    except ImportError:
        pass
    os.makedirs(out, exist_ok=True)
    for name, fn in cases.items():
        for _ in range(100):
            fn()
        cp.cuda.Device().synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        per = (time.perf_counter() - t0) / calls * 1e6
        cp.cuda.Device().synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        with open(os.path.join(out, f"profile_{name}.txt"), "w") as f:
            f.write(f"{calls} calls, {per:.2f} us per call under the profiler\n{buf.getvalue()}")
        print(f"profile {name}: {per:.2f} us/call under cProfile -> {out}/profile_{name}.txt")


def varlen_host(out: str, calls: int = 30, batch: int = 16, seqlen: int = 512, heads: int = 16,
                head_dim: int = 128) -> dict:
    """Host time of one varlen attention call (``batch`` x ``seqlen`` packed tokens, bf16, causal,
    both max_seqlen hints): the GPU is idle at each call (synchronized before it, not timed) and
    the timer stops when the call returns, so each number is the Python and launch work of one
    call, whatever the kernels' length.  Rows: the forward and the backward replaying their
    launch plans, the backward's full path (its plans emptied before each call), a dense forward
    and backward of the same tokens for reference; CuPy arrays, then torch tensors when torch is
    importable.  cProfile of the CuPy backward replay and full path to ``$OUT/profile_varlen_bwd_*.txt``."""
    import cProfile
    import io
    import pstats
    import cupy as cp
    import numpy as np
    from rtkernels.ops import attention_bwd as bwd
    from rtkernels.ops.attention import attention
    total = batch * seqlen
    libs = {"cupy": None}
    try:
        import torch
        libs["torch"] = torch
    except ImportError:
        pass
    results: dict = {}
    os.makedirs(out, exist_ok=True)
    for name, tlib in libs.items():
        if tlib is None:
            x = cp.random.standard_normal((total, heads, head_dim), dtype=cp.float32)
            q = (x.view(cp.uint32) >> 16).astype(cp.uint16)   # bfloat16 bits (truncated)
            cu = cp.asarray(np.arange(batch + 1, dtype=np.int32) * seqlen)
            sync = cp.cuda.Device().synchronize
            bf = {"dtype": "bfloat16"}
        else:
            q = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16)
            cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * seqlen
            bf = {}

            def sync():
                torch.cuda.synchronize()
                cp.cuda.Device().synchronize()
        k, v, do = (q.clone() if tlib else q.copy() for _ in range(3))
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqlen, max_seqlen_k=seqlen, **bf)
        o, lse = attention(q, k, v, True, **kw)
        g = bwd.attention_backward(do, q, k, v, o, lse, True, **kw)
        dense = q.reshape(batch, seqlen, heads, head_dim)
        od, lsed = attention(dense, dense, dense, True, **bf)
        gd = bwd.attention_backward(dense, dense, dense, dense, od, lsed, True, **bf)

        def full_bwd():
            bwd._VARLEN_BACKWARD_PLANS.clear()

        cases = {
            "dense forward (plan)": (None, lambda: attention(dense, dense, dense, True, out=od, **bf)),
            "dense backward (plan)": (None, lambda: bwd.attention_backward(dense, dense, dense, dense, od, lsed, True,
                                                                           dq=gd[0], dk=gd[1], dv=gd[2], **bf)),
            "varlen forward (plan)": (None, lambda: attention(q, k, v, True, out=o, **kw)),
            "varlen backward (plan)": (None, lambda: bwd.attention_backward(do, q, k, v, o, lse, True, dq=g[0],
                                                                            dk=g[1], dv=g[2], **kw)),
            "varlen backward (full path)": (full_bwd, lambda: bwd.attention_backward(do, q, k, v, o, lse, True,
                                                                                     dq=g[0], dk=g[1], dv=g[2], **kw)),
        }
        for case, (before, fn) in cases.items():
            for _ in range(5):
                fn()
            ts = []
            for _ in range(calls):
                if before:
                    before()
                sync()
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            sync()
            results[f"{name}: {case}"] = {"median_us": statistics.median(ts), "min_us": min(ts)}
        if tlib is None:
            for case in ("varlen backward (plan)", "varlen backward (full path)"):
                before, fn = cases[case]
                prof = cProfile.Profile()
                for _ in range(calls):
                    if before:
                        before()
                    prof.enable()
                    fn()
                    prof.disable()
                sync()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
                tag = "replay" if "plan" in case else "full"
                with open(os.path.join(out, f"profile_varlen_bwd_{tag}.txt"), "w") as f:
                    f.write(f"{calls} calls of {case}\n{buf.getvalue()}")
    return results


TARGETS = [
    ("launch: rtk Kernel.launch", "launch: cupy RawKernel (int)", 1.0, "Kernel.launch <= RawKernel"),
    ("torch: rtk.attention(q, k, v)", "torch: F.scaled_dot_product_attention", 1.0, "rtk attention <= SDPA"),
    ("torch: rtk.matmul(a, b)", "torch: torch.matmul(a, b)", 2.0, "rtk matmul <= 2x torch"),
    ("torch: rtk.softmax(x)", "torch: torch.softmax(x)", 2.0, "rtk softmax <= 2x torch"),
]



def add_floor_rows(rows, floor_op, att_schema: str, sm_schema: str, att_outs, sm_out, q, x, mm=None, **kw) -> None:
    """torch's dispatcher floor rows (also tools/host_model.py's): the attention, softmax and
    (``mm``: (schema, output, a)) matmul schemas with one Python kernel that returns at once, as an
    op and called directly; also the floor of ops returning new tensors, as rtk's do, where
    ``floor_op`` has ``fresh`` (an older --tree lacks it)."""
    cases = [("attention", att_schema, att_outs, (q, q, q, True)), ("softmax", sm_schema, sm_out, (x,))]
    if mm is not None:
        cases.append(("matmul", mm[0], mm[1], (mm[2], mm[2])))
    for name, schema, outs, args in cases:
        floor, fn = floor_op(schema, outs, **kw)
        try:
            ffloor, ffn = floor_op(schema, outs, fresh=True, **kw)
            rows.add(f"torch: floor op (new outputs), {name} schema", lambda f=ffloor, a=args: f(*a))
            rows.add(f"torch: floor fn (new outputs), {name} schema", lambda f=ffn, a=args: f(*a))
        except TypeError:
            pass
        rows.add(f"torch: floor op, {name} schema", lambda f=floor, a=args: f(*a))
        rows.add(f"torch: floor fn, {name} schema", lambda f=fn, a=args: f(*a))

def main() -> None:
    p = bu.parser(__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400, help="calls per timed loop")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per section")
    p.add_argument("--tree", help="time the rtkernels package under this folder instead (e.g. an older tree: "
                                  "git archive <commit> rtkernels templates | tar -x -C base)")
    p.add_argument("--name", default="bench_host", help="JSON file name under --out")
    p.add_argument("--profile", action="store_true", help="only cProfile the hot paths (profile())")
    p.add_argument("--varlen", action="store_true",
                   help="only the host time of one varlen attention call, forward and backward, plan replay vs "
                        "full path (varlen_host())")
    p.add_argument("--cpu-model", action="store_true",
                   help="no GPU: run tools/host_model.py instead (rtk's Python per call with the launch, cupy.empty, "
                        "tensor-map encoding and torch's stream query stubbed; its docstring lists every stub); "
                        "arguments after -- go to it")
    if "--cpu-model" in sys.argv:
        import host_model
        rest = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
        host_model.main(rest)
        return
    ns = p.parse_args()
    if ns.profile:
        profile(ns.out)
        return
    if ns.varlen:
        import rtkernels
        print(f"rtkernels from {os.path.dirname(rtkernels.__file__)}")
        results = varlen_host(ns.out)
        env = bu.environment()
        bu.save(ns.out, ns.name + "_varlen", {"env": env, "results": results})
        width = max(len(k) for k in results)
        print(f"\nhost time of one call, us ({env.get('gpu', '')}; 16 x 512 tokens, 16 heads, d128, bf16, causal; "
              f"median / min of 30 calls)")
        for name, r in results.items():
            print(f"  {name:<{width}}  {r['median_us']:7.1f}  {r['min_us']:7.1f}")
        return
    if ns.tree:
        sys.path.insert(0, os.path.abspath(ns.tree))
    import cupy as cp
    import rtkernels
    print(f"rtkernels from {os.path.dirname(rtkernels.__file__)}")
    results: dict = {}
    sections = [launch_floor, cupy_ops]
    try:
        import torch  # noqa: F401
        sections += [torch_ops, attention_breakdown]
        sync = lambda: (torch.cuda.synchronize(), cp.cuda.Device().synchronize())   # noqa: E731
    except ImportError:
        print("torch not installed: torch sections skipped")
        sync = lambda: cp.cuda.Device().synchronize()   # noqa: E731
    for section in sections:
        rows = Rows(ns.calls, ns.rounds)
        rows.sync = sync
        section(rows)
        rows.run()
        results.update(rows.results)
    env = bu.environment()
    bu.save(ns.out, ns.name, {"env": env, "tree": os.path.dirname(rtkernels.__file__), "calls": ns.calls,
                              "rounds": ns.rounds, "results": results})
    width = max(len(k) for k in results)
    print(f"\nhost time per call, us ({env.get('gpu', '')}; median / min of {ns.rounds} rounds of {ns.calls} calls)")
    for name, r in results.items():
        print(f"  {name:<{width}}  {r['median_us']:7.2f}  {r['min_us']:7.2f}")
    checks = [("torch: torch.ops.rtk.attention", "torch: rtk.attention(q, k, v)"),
              ("torch: torch.ops.rtk.matmul", "torch: rtk.matmul(a, b)"),
              ("torch: torch.ops.rtk.softmax", "torch: rtk.softmax(x)"),
              ("torch: torch.ops.rtk.rmsnorm", "torch: rtk.rmsnorm(x, w)")]
    print("\ntargets (median us)")
    for mine, peer, factor, what in TARGETS:
        if mine in results and peer in results:
            m, pr = results[mine]["median_us"], results[peer]["median_us"]
            print(f"  {what:<28} {m:7.2f} vs {factor:g} x {pr:.2f} -> {'ok' if m <= factor * pr else 'MISSED'}")
    if "cupy: rtk.softmax(x)" in results:
        m = results["cupy: rtk.softmax(x)"]["median_us"]
        line = f"  {'CuPy softmax <= 8 us':<28} {m:7.2f} -> {'ok' if m <= 8 else 'MISSED'}"
        parts = ("cupy.empty(256)", "launch: cupy Function.linear_launch")
        if all(p_ in results for p_ in parts):   # what any call that allocates its output and launches costs
            line += f" (cupy.empty + linear_launch alone: {sum(results[p_]['median_us'] for p_ in parts):.2f})"
        print(line)
    floors = {"attention": "attention schema", "softmax": "softmax schema", "matmul": "matmul schema"}
    for op_row, direct in checks:
        if op_row in results and direct in results:
            name = op_row.split(".")[-1]
            extra = results[op_row]["median_us"] - results[direct]["median_us"]
            line = f"  {'custom op adds <= 5 us':<28} {name}: +{extra:.2f} -> {'ok' if extra <= 5 else 'MISSED'}"
            fo, ff = (f"torch: floor {w}, {floors.get(name)}" for w in ("op", "fn"))
            if fo in results and ff in results:   # torch's own floor for a Python-registered op of the schema
                floor = results[fo]["median_us"] - results[ff]["median_us"]
                line += f"; torch's floor +{floor:.2f}, rtk's share +{extra - floor:.2f} -> " \
                        f"{'ok' if extra - floor <= 5 else 'MISSED'}"
            fo, ff = (f"torch: floor {w} (new outputs), {floors.get(name)}" for w in ("op", "fn"))
            if fo in results and ff in results:   # the floor of an op that returns new tensors, as rtk's do
                floor = results[fo]["median_us"] - results[ff]["median_us"]
                line += f"; against a floor returning new tensors +{floor:.2f}: +{extra - floor:.2f}"
            print(line)


if __name__ == "__main__":
    main()
