"""Any view in, the right answer out (issue 26): a seeded view fuzzer for every public op.

Each case builds the op's inputs by a random chain of view operations - ``expand`` /
``broadcast_to``, transpose / permute, slicing with steps, narrowing at offsets, ``as_strided``
with overlapping strides and (CuPy only: torch has no negative strides) ``flip`` - in torch and in
CuPy, runs the op on those views and on contiguous copies of them, and requires either the same
answer (bit-exact where the same kernel runs, within a few low-precision ulps where another path
does) or a ConfigError naming the argument with its shape and strides and no internal name.
Outputs (``out=``, dq / dk / dv) are views too: distinct-element ones must work, broadcast or
overlapping ones must be rejected.  Fixed cases first: the issue's own operands, gradient-shaped
operands (``torch.ones(()).expand(M, N)``) and a fully broadcast dO.

Seeds and sizes: RTKERNELS_VIEWS_SEED (default 26), RTKERNELS_VIEWS_CASES (cases per op and array
library, default 150).  Every op prints a summary line (cases, passed, rejected with a clear
error, failed); with $OUT set they also go to $OUT/views_fuzz.txt (the table) and
$OUT/views_fuzz.json (with the failing cases).  Head dim, dtypes and shapes are held to a small
set and the kernels they need are compiled up front in parallel (``prebuilt``), so the file runs
in about a minute on an H100.
"""
import itertools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError

SEED = int(os.environ.get("RTKERNELS_VIEWS_SEED", "26"))
CASES = int(os.environ.get("RTKERNELS_VIEWS_CASES", "150"))
TOL = {"bfloat16": 2 ** -6, "float16": 2 ** -9, "float32": 1e-5}   # relative to the output's largest |value|
INTERNAL = ("tensor_map", "strides[", "shape[", "box[", "a_kmajor", "ldb", "lda")
RESULTS: dict = {}
LIBS = ("torch", "cupy")
# shapes held fixed so that few kernels compile (see prebuilt)
MM_SMALL = ((40, 72), (48, 64), 64)          # M, N choices and K
MM_BIG = (256, 256, 256)                     # M*N*K = 2^24: unaligned operands are staged by pad_rows
ATT = dict(batch=(1, 2), seqlen_q=(33, 80), seqlen_k=(40, 96), nheads=4, nheads_kv=(4, 2, 1), head_dim=64)
ROW_SHAPES = ((150, 96), (3, 50, 96), (2, 3, 25, 96))   # >= 132 rows: one reduce config per width
EW_SHAPES = ((7, 33), (5, 4, 9), (130,))


# ---- array libraries ----------------------------------------------------------------------------
class Lib:
    """torch or CuPy: random arrays, the view operations, copies and host values.  bfloat16 in
    CuPy is uint16 bits passed with dtype="bfloat16" (``kw``)."""

    def __init__(self, name):
        self.name = name
        if name == "torch":
            self.torch = pytest.importorskip("torch")
        import cupy
        self.cp = cupy

    def kw(self, dtype):
        return {"dtype": "bfloat16"} if self.name == "cupy" and dtype == "bfloat16" else {}

    def from_host(self, x, dtype):
        x = np.array(x, np.float32)   # (keeps a 0-d shape, which ascontiguousarray would not)
        if self.name == "torch":
            t = self.torch
            return t.from_numpy(x).to(device="cuda", dtype=getattr(t, dtype))
        from gpu_util import bf16_bits_from_f32
        if dtype == "bfloat16":
            return self.cp.asarray(bf16_bits_from_f32(x).reshape(x.shape))
        return self.cp.asarray(x.astype(dtype))

    def rand(self, rng, shape, dtype, scale=1.0):
        return self.from_host(rng.standard_normal(shape) * scale, dtype)

    def ones_scalar(self, dtype):
        return self.from_host(np.ones((), np.float32), dtype)

    def empty(self, shape, dtype):
        if self.name == "torch":
            return self.torch.empty(shape, dtype=getattr(self.torch, dtype), device="cuda")
        return self.cp.empty(shape, self.cp.uint16 if dtype == "bfloat16" else dtype)

    def poison(self, x):
        from gpu_util import poison
        poison(x if self.name == "cupy" else self.cp.from_dlpack(x.view(self.torch.uint8)))
        return x

    def expand(self, x, shape):
        return x.expand(*shape) if self.name == "torch" else self.cp.broadcast_to(x, shape)

    def permute(self, x, perm):
        return x.permute(*perm) if self.name == "torch" else x.transpose(perm)

    def flip(self, x, dim):
        return self.cp.flip(x, dim)

    def as_strided(self, buf, shape, strides, offset):
        if self.name == "torch":
            return self.torch.as_strided(buf, shape, strides, offset)
        from cupy.lib.stride_tricks import as_strided
        return as_strided(buf[offset:], shape, tuple(s * buf.itemsize for s in strides))

    def contiguous(self, x):
        return x.contiguous() if self.name == "torch" else self.cp.ascontiguousarray(x)

    def strides(self, x):
        return tuple(x.stride()) if self.name == "torch" else tuple(s // x.itemsize for s in x.strides)

    def host(self, x, dtype):
        """float64 (int64 for integer arrays) host copy of the values."""
        if self.name == "torch":
            if not x.is_floating_point():
                return x.cpu().numpy()
            return x.detach().float().cpu().numpy().astype(np.float64)
        h = x.get()
        if h.dtype.kind in "iu" and dtype != "bfloat16":
            return h
        if dtype == "bfloat16" and h.dtype == np.uint16:
            from gpu_util import f32_from_bf16_bits
            return f32_from_bf16_bits(h).astype(np.float64)
        return h.astype(np.float64)


def make(lib, rng, shape, dtype, depth=3, scale=1.0):
    """(view, description): an array of logical ``shape`` reached by a random chain of view ops
    from a freshly filled buffer; every op changes strides, offsets or aliasing, never values."""
    shape = tuple(int(n) for n in shape)
    ops = ["expand", "permute", "step", "narrow", "overlap"] + (["flip"] if lib.name == "cupy" else [])
    if depth == 0 or rng.random() < 0.25 or not shape:
        return lib.rand(rng, shape, dtype, scale), "base"
    op = ops[rng.integers(len(ops))]
    nd = len(shape)
    if op == "expand":
        dims = [d for d in range(nd) if shape[d] > 1]
        if not dims:
            return lib.rand(rng, shape, dtype, scale), "base"
        chosen = sorted(rng.choice(dims, size=rng.integers(1, len(dims) + 1), replace=False).tolist())
        inner = tuple(1 if d in chosen else n for d, n in enumerate(shape))
        x, desc = make(lib, rng, inner, dtype, depth - 1, scale)
        return lib.expand(x, shape), f"{desc}.expand(dims {chosen})"
    if op == "permute":
        perm = rng.permutation(nd).tolist()          # y = x.permute(perm): y.shape[i] = x.shape[perm[i]]
        inner = [0] * nd
        for i, p in enumerate(perm):
            inner[p] = shape[i]
        x, desc = make(lib, rng, tuple(inner), dtype, depth - 1, scale)
        return lib.permute(x, perm), f"{desc}.permute{tuple(perm)}"
    if op == "step":
        d, s = int(rng.integers(nd)), int(rng.choice((2, 3)))
        start = int(rng.integers(s))
        inner = tuple(n * s if i == d else n for i, n in enumerate(shape))
        x, desc = make(lib, rng, inner, dtype, depth - 1, scale)
        idx = tuple(slice(start, None, s) if i == d else slice(None) for i in range(nd))
        return x[idx], f"{desc}[dim {d}: {start}::{s}]"
    if op == "narrow":
        d, off, extra = int(rng.integers(nd)), int(rng.choice((1, 2, 3, 8))), int(rng.choice((0, 1, 5)))
        inner = tuple(n + off + extra if i == d else n for i, n in enumerate(shape))
        x, desc = make(lib, rng, inner, dtype, depth - 1, scale)
        idx = tuple(slice(off, off + shape[d]) if i == d else slice(None) for i in range(nd))
        return x[idx], f"{desc}[dim {d}: {off}:{off + shape[d]}]"
    if op == "flip":
        d = int(rng.integers(nd))
        x, desc = make(lib, rng, shape, dtype, depth - 1, scale)
        return lib.flip(x, d), f"{desc}.flip({d})"
    # as_strided with overlapping (or broadcast) strides over a flat buffer
    strides, span = [0] * nd, 1
    for d in range(nd - 1, -1, -1):
        strides[d] = int(rng.choice((1, 1, 2, 0))) if d == nd - 1 else int(rng.integers(0, max(2, span)))
        span = max(span, 1 + (shape[d] - 1) * strides[d])
    offset = int(rng.integers(0, 4))
    size = offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    buf = lib.rand(rng, (size,), dtype, scale)
    return lib.as_strided(buf, shape, tuple(strides), offset), f"as_strided({shape}, {tuple(strides)}, +{offset})"


def out_view(lib, rng, shape, dtype, modes):
    """(out, description, expect): an output view of ``shape`` in one of ``modes``: "contiguous",
    "slice" (a slice of a wider buffer: distinct elements), "expand" and "overlap" (aliased: must be
    rejected), "transpose" (storage transposed: ops that need rows reject it)."""
    mode = modes[rng.integers(len(modes))]
    nd = len(shape)
    if mode == "contiguous":
        return lib.poison(lib.empty(shape, dtype)), mode, "ok"
    if mode == "slice":
        wide = shape[:-1] + (shape[-1] + 8,)
        buf = lib.poison(lib.empty(wide, dtype))
        return buf[..., 8:], mode, "ok"
    if mode == "expand":
        d = max(range(nd), key=lambda i: shape[i])
        inner = tuple(1 if i == d else n for i, n in enumerate(shape))
        return lib.expand(lib.poison(lib.empty(inner, dtype)), shape), mode, "reject"
    if mode == "overlap":   # rows half a row apart (1-D: every index on one element)
        strides = [1] * nd if nd > 1 else [0]
        for d in range(nd - 2, -1, -1):
            strides[d] = max(1, shape[-1] // 2)
        buf = lib.poison(lib.empty((1 + sum((n - 1) * s for n, s in zip(shape, strides)),), dtype))
        return lib.as_strided(buf, shape, tuple(strides), 0), mode, "reject"
    perm = list(range(nd))[::-1]
    buf = lib.poison(lib.empty(tuple(shape[p] for p in perm), dtype))
    return lib.permute(buf, perm), mode, "transpose"


# ---- outcome bookkeeping -------------------------------------------------------------------------
class Tally:
    def __init__(self, op, lib):
        self.op, self.lib = op, lib
        self.cases = self.passed = self.rejected = 0
        self.failures: list = []
        self.t0 = time.perf_counter()

    def fail(self, desc, why):
        self.failures.append(f"{desc}: {why}")

    def run(self, desc, expect, names, call, reference, compare):
        """One case: ``call()`` on the views, ``reference()`` on contiguous copies, ``compare(got,
        ref)`` -> None or a message.  ``expect``: "ok" or "reject"; ``names``: the arguments a
        rejection may name."""
        self.cases += 1
        import cupy
        try:
            got = call()
            cupy.cuda.Device().synchronize()   # torch and CuPy launch on streams of this device
        except ConfigError as e:
            msg = str(e)
            if not any(f" {n} (shape " in msg or msg.startswith(f"{n} (shape ") for n in names) or \
                    any(w in msg for w in INTERNAL):
                self.fail(desc, f"unclear error: {msg}")
            elif expect != "reject":
                self.fail(desc, f"rejected a view it should take: {msg}")
            else:
                self.rejected += 1
            return
        except Exception as e:   # noqa: BLE001 - every other failure is reported with its case
            self.fail(desc, f"{type(e).__name__}: {e}")
            return
        if expect == "reject":
            self.fail(desc, "wrote an aliased output without an error")
            return
        why = compare(got, reference())
        if why:
            self.fail(desc, why)
        else:
            self.passed += 1

    def report(self):
        line = (f"{self.op:<20} {self.lib:<5} seed={SEED} cases={self.cases} passed={self.passed} "
                f"rejected={self.rejected} failed={len(self.failures)} ({time.perf_counter() - self.t0:.1f} s)")
        print("views fuzz", line)
        RESULTS[(self.op, self.lib)] = dict(line=line, failures=self.failures[:50])
        _save()
        assert not self.failures, f"{len(self.failures)} of {self.cases} {self.op} cases failed, e.g.:\n" + \
            "\n".join(self.failures[:8])


def _save():
    out = os.environ.get("OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "views_fuzz.txt"), "w") as f:
        f.write("\n".join(r["line"] for r in RESULTS.values()) + "\n")
    with open(os.path.join(out, "views_fuzz.json"), "w") as f:
        json.dump({f"{k[0]}/{k[1]}": v for k, v in RESULTS.items()}, f, indent=1)


def close(lib, dtype, what="", tol=None):
    """compare(got, ref) for arrays or tuples of arrays: NaN/inf where the reference has them,
    else max |got - ref| <= tol (default TOL[dtype]) * max |ref| (exact for integers)."""
    tol = TOL[dtype] if tol is None else tol

    def cmp(got, ref):
        gs, rs = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
        for i, (g, r) in enumerate(zip(gs, rs)):
            g, r = lib.host(g, dtype), lib.host(r, dtype)
            if g.shape != r.shape:
                return f"{what}[{i}] shape {g.shape} != {r.shape}"
            if g.dtype.kind in "iu":
                if (g != r).any():
                    return f"{what}[{i}] {int((g != r).sum())} of {g.size} integers differ"
                continue
            fin = np.isfinite(r)
            if (np.isfinite(g) != fin).any() or (g[~fin] != r[~fin]).any():
                return f"{what}[{i}] NaN/inf at {int((np.isfinite(g) != fin).sum())} places the reference has none"
            if fin.any():
                scale = max(float(np.abs(r[fin]).max()), 1e-3)
                err = float(np.abs(g[fin] - r[fin]).max()) / scale
                if err > tol:
                    return f"{what}[{i}] max error {err:.3g} x max|ref| {scale:.3g} > {tol:.3g}"
        return None
    return cmp


def _need_gpu_libs(name):
    from rtkernels import device
    if not device.has_gpu():
        pytest.skip("needs a GPU")
    return Lib(name)


def _rng(op, lib):
    return np.random.default_rng([SEED, sum(map(ord, op)), LIBS.index(lib)])


# ---- kernels the cases need, compiled up front in parallel (NVRTC releases the GIL) ----------------
@pytest.fixture(scope="module")
def prebuilt():
    from rtkernels import device
    from rtkernels.kernel import get_kernel
    from rtkernels.ops import attention_bwd_sm90 as B90, attention_sm90 as A90, matmul as mm, matmul_sm90 as m90
    from rtkernels.ops import rowwise as rw
    from rtkernels.ops.attention import _device_arch
    if not device.has_gpu():
        return None
    t0 = time.perf_counter()
    arch, sms = device.current_arch(), device.sm_count()
    jobs = []
    shapes = [(m, n, MM_SMALL[2], b) for m in MM_SMALL[0] for n in MM_SMALL[1] for b in (1, 3)]
    epis = ((False, "none"), (True, "gelu"))
    for (m, n, k, b), ak, bk, va, vb, (hb, act) in itertools.product(shapes, (True, False), (True, False),
                                                                      (1, 2, 4, 8), (1, 2, 4, 8), epis):
        jobs.append((mm.heuristic_config("bfloat16", m, n, k, b, sm_count=sms, a_kmajor=ak, b_kmajor=bk, vec_a=va,
                                         vec_b=vb, has_bias=hb, activation=act), None, None))
    if arch == "sm_90":
        for (m, n, k, b), ak, bk, (hb, act), ts in itertools.product(shapes + [MM_BIG + (1,), MM_BIG + (3,)],
                                                                      (True, False), (True, False), epis,
                                                                      (True, False)):
            jobs.append((m90.heuristic_config("bfloat16", m, n, k, b, sm_count=sms, a_kmajor=ak, b_kmajor=bk,
                                              has_bias=hb, activation=act, tma_store=ts, mma=mm.SM90_MMA),
                         None, None))
        jobs.append((mm._PAD, None, None))
        aarch = _device_arch(device.current_device())
        for causal in (False, True):
            jobs.append((A90.choose_config("bfloat16", ATT["head_dim"], causal), None, aarch))
            cfg = B90.choose_config("bfloat16", ATT["head_dim"], causal, False)
            jobs += [(cfg, name, aarch) for name in cfg.kernels]
    for dt, vecs in (("bfloat16", (8, 4, 2, 1)), ("float32", (4, 2, 1))):
        for vec in vecs:
            for fam, layer, names in (("softmax", False, ("softmax_rows", "log_softmax_rows")),
                                      ("norm", False, ("rmsnorm_rows",)), ("norm", True, ("layernorm_rows",)),
                                      ("reduce", False, ("reduce_sum_rows",))):
                cfg = rw._config_for(fam, None, 96, dt, vec, 150, fam, weight_dtype=dt if fam == "norm" else None,
                                     layer=layer)
                jobs += [(cfg, name, None) for name in names]
    jobs = list(dict.fromkeys(jobs))
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda j: get_kernel(j[0], j[1], arch=j[2]).cubin, jobs))
    RESULTS[("prebuild", "-")] = dict(line=f"{'prebuild':<20} -     {len(jobs)} kernels compiled in "
                                           f"{time.perf_counter() - t0:.1f} s", failures=[])
    print("views fuzz", RESULTS[("prebuild", "-")]["line"])
    return jobs


# ---- matmul --------------------------------------------------------------------------------------
def _matmul_fixed(lib, rng):
    """The issue's operands and gradient-shaped ones: (description, a, b, kwargs)."""
    dt = "bfloat16"
    s = lib.rand(rng, (), dt)
    a = lib.rand(rng, (64, 256), dt)
    b = lib.rand(rng, (256, 192), dt)
    ones = lib.ones_scalar(dt)
    g = lib.expand(ones, (64, 192))
    yield "s.expand(64, 256) @ b", lib.expand(s, (64, 256)), b, {}
    yield "a @ s.expand(256, 192)", a, lib.expand(s, (256, 192)), {}
    yield "a @ b[:, :1].expand(256, 192)", a, lib.expand(b[:, :1], (256, 192)), {}
    yield "a[:1].expand(64, 256) @ b", lib.expand(a[:1], (64, 256)), b, {}
    yield "a[:, :1].expand(64, 256) @ b", lib.expand(a[:, :1], (64, 256)), b, {}
    yield "grad_out (ones.expand) @ w.T", g, b, dict(trans_b=True)              # dX = dY W^T
    yield "x.T @ grad_out (ones.expand)", a, g, dict(trans_a=True)              # dW = X^T dY
    yield "grad_out @ w, batched ones.expand(3, M, N)", lib.expand(ones, (3, 64, 192)), b, dict(trans_b=True)
    yield "a @ b, bias expanded from a scalar", a, b, dict(bias=lib.expand(s.reshape(1), (192,)), activation="gelu")


def _matmul_case(lib, rng):
    dt = "bfloat16"
    big = rng.random() < 0.08
    if big:
        m, n, k = MM_BIG
    else:
        m, n, k = int(rng.choice(MM_SMALL[0])), int(rng.choice(MM_SMALL[1])), MM_SMALL[2]
    batched = rng.random() < 0.25
    ta, tb = bool(rng.random() < 0.3), bool(rng.random() < 0.3)
    a_shape = (k, m) if ta else (m, k)
    b_shape = (n, k) if tb else (k, n)
    if batched:
        ndims = [(3, 3), (2, 3), (3, 2)][rng.integers(3)]
        a_shape = (3,) * (ndims[0] - 2) + a_shape
        b_shape = (3,) * (ndims[1] - 2) + b_shape
    a, da = make(lib, rng, a_shape, dt, scale=0.5)
    b, db = make(lib, rng, b_shape, dt, scale=0.5)
    kw = dict(trans_a=ta, trans_b=tb)
    desc = f"a {a_shape} {da} strides {lib.strides(a)}; b {b_shape} {db} strides {lib.strides(b)}; {kw}"
    if rng.random() < 0.25:
        bias, dbias = make(lib, rng, (n,), dt)
        kw.update(bias=bias, activation="gelu")
        desc += f"; bias {dbias} strides {lib.strides(bias)}"
    expect, out = "ok", None
    if rng.random() < 0.2:
        out_shape = ((3,) if batched else ()) + (m, n)
        out, mode, expect = out_view(lib, rng, out_shape, dt, ("contiguous", "slice", "expand", "overlap",
                                                                "transpose"))
        expect = "reject" if expect == "transpose" else expect   # C is written by rows (unit stride along N)
        desc += f"; out {mode} strides {lib.strides(out)}"
    return desc, a, b, kw, out, expect


@pytest.mark.gpu
@pytest.mark.parametrize("libname", LIBS)
def test_gpu_views_matmul(prebuilt, libname):
    lib = _need_gpu_libs(libname)
    rng = _rng("matmul", libname)
    tally = Tally("matmul", libname)
    cases = [(d, a, b, kw, None, "ok") for d, a, b, kw in _matmul_fixed(lib, rng)]
    cases += [_matmul_case(lib, rng) for _ in range(CASES)]
    for desc, a, b, kw, out, expect in cases:
        extra = lib.kw("bfloat16")
        ref_kw = {k: (lib.contiguous(v) if k == "bias" else v) for k, v in kw.items()}
        tally.run(desc, expect, ("a", "b", "bias", "out"),
                  lambda: rtk.matmul(a, b, out=out, **kw, **extra),
                  lambda: rtk.matmul(lib.contiguous(a), lib.contiguous(b), **ref_kw, **extra),
                  close(lib, "bfloat16", "c"))
    tally.report()


# ---- attention forward and backward ----------------------------------------------------------------
def _kv(lib, rng, shape, dt):
    """K and V views: random chains, or the broadcasts of issue 26 (over heads: GQA in disguise;
    over batch; over the sequence)."""
    b, s, h, d = shape
    mode = rng.choice(("random", "random", "heads", "batch", "seq"))
    if mode == "heads":
        k0, v0 = lib.rand(rng, (b, s, 1, d), dt), lib.rand(rng, (b, s, 1, d), dt)
        return lib.expand(k0, shape), lib.expand(v0, shape), "k, v expanded over heads"
    if mode == "batch":
        k0, v0 = lib.rand(rng, (1, s, h, d), dt), lib.rand(rng, (1, s, h, d), dt)
        return lib.expand(k0, shape), lib.expand(v0, shape), "k, v expanded over batch"
    if mode == "seq":
        k0 = lib.rand(rng, (b, 1, h, d), dt)
        return lib.expand(k0, shape), make(lib, rng, shape, dt)[0], "k expanded over the sequence"
    (k, dk), (v, dv) = make(lib, rng, shape, dt), make(lib, rng, shape, dt)
    return k, v, f"k {dk} strides {lib.strides(k)}; v {dv} strides {lib.strides(v)}"


def _att_shapes(rng):
    b, sq, sk = (int(rng.choice(ATT[n])) for n in ("batch", "seqlen_q", "seqlen_k"))
    h, d = ATT["nheads"], ATT["head_dim"]
    hkv = int(rng.choice(ATT["nheads_kv"]))
    return (b, sq, h, d), (b, sk, hkv, d), bool(rng.random() < 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("libname", LIBS)
def test_gpu_views_attention(prebuilt, libname):
    lib = _need_gpu_libs(libname)
    rng = _rng("attention", libname)
    tally = Tally("attention", libname)
    dt, extra = "bfloat16", lib.kw("bfloat16")
    for _ in range(CASES):
        qs, ks, causal = _att_shapes(rng)
        if rng.random() < 0.3:   # K/V broadcasts are over nheads query heads
            ks = ks[:2] + (qs[2],) + ks[3:]
        q, dq_ = make(lib, rng, qs, dt)
        k, v, dkv = _kv(lib, rng, ks, dt)
        desc = f"q {qs} {dq_} strides {lib.strides(q)}; {dkv} {ks}; causal={causal}"
        expect, out = "ok", None
        if rng.random() < 0.2:
            out, mode, expect = out_view(lib, rng, qs, dt, ("contiguous", "slice", "expand", "overlap"))
            desc += f"; out {mode} strides {lib.strides(out)}"
        tally.run(desc, expect, ("q", "k", "v", "out"),
                  lambda: rtk.attention(q, k, v, causal=causal, out=out, **extra),
                  lambda: rtk.attention(lib.contiguous(q), lib.contiguous(k), lib.contiguous(v), causal=causal,
                                        **extra),
                  _att_close(lib))
    tally.report()


def _att_close(lib):
    cmp_o = close(lib, "bfloat16", "o")
    cmp_l = close(lib, "float32", "lse", tol=1e-4)   # the same kernel on the same values: exact, but allow ulps

    def cmp(got, ref):
        return cmp_o(got[0], ref[0]) or cmp_l(got[1], ref[1])
    return cmp


def _same_values_view(lib, rng, x, dt):
    """A view holding x's values in another layout: a slice of a wider buffer, transposed storage,
    or (CuPy) reversed storage; x itself half the time."""
    mode = rng.choice(("same", "same", "slice", "transpose") + (("flip",) if lib.name == "cupy" else ()))
    if mode == "same":
        return x, "as given"
    if mode == "slice":
        wide = lib.empty(tuple(x.shape[:-1]) + (x.shape[-1] + 8,), dt)
        y = wide[..., 8:]
    elif mode == "transpose":
        perm = list(range(x.ndim))[::-1]
        y = lib.permute(lib.empty(tuple(x.shape[p] for p in perm), dt), perm)
    else:
        y = lib.flip(lib.empty(x.shape, dt), 1)
    y[...] = x
    return y, mode


@pytest.mark.gpu
@pytest.mark.parametrize("libname", LIBS)
def test_gpu_views_attention_backward(prebuilt, libname):
    lib = _need_gpu_libs(libname)
    rng = _rng("attention_backward", libname)
    tally = Tally("attention_backward", libname)
    dt, extra = "bfloat16", lib.kw("bfloat16")
    n = max(20, CASES // 2)
    for i in range(n):
        qs, ks, causal = _att_shapes(rng)
        if rng.random() < 0.3:
            ks = ks[:2] + (qs[2],) + ks[3:]
        q, dq_ = make(lib, rng, qs, dt)
        k, v, dkv = _kv(lib, rng, ks, dt)
        qc, kc, vc = lib.contiguous(q), lib.contiguous(k), lib.contiguous(v)
        o, lse = rtk.attention(qc, kc, vc, causal=causal, **extra)
        if i < 4 or rng.random() < 0.25:     # o.sum().backward(): every stride of dO is 0
            do, ddo = lib.expand(lib.ones_scalar(dt), qs), "dO = ones(()).expand (o.sum().backward())"
        else:
            do, ddo = make(lib, rng, qs, dt)
            ddo = f"dO {ddo} strides {lib.strides(do)}"
        o_v, d_o = _same_values_view(lib, rng, o, dt)
        lse_v, d_lse = _same_values_view(lib, rng, lse, "float32")
        desc = f"q {qs} {dq_}; {dkv} {ks}; {ddo}; o {d_o}; lse {d_lse}; causal={causal}"
        outs, expect = {}, "ok"
        if rng.random() < 0.2:
            name = ("dq", "dk", "dv")[rng.integers(3)]
            outs[name], mode, expect = out_view(lib, rng, qs if name == "dq" else ks, dt,
                                                ("contiguous", "slice", "expand", "overlap"))
            desc += f"; {name} {mode}"
        tally.run(desc, expect, ("do", "q", "k", "v", "o", "lse", "dq", "dk", "dv"),
                  lambda: rtk.attention_backward(do, q, k, v, o_v, lse_v, causal=causal, **outs, **extra),
                  lambda: rtk.attention_backward(lib.contiguous(do), qc, kc, vc, o, lse, causal=causal, **extra),
                  close(lib, "bfloat16", "dq, dk, dv"))
    tally.report()


# ---- row ops -----------------------------------------------------------------------------------------
ROW_OPS = ("softmax", "log_softmax", "rmsnorm", "layernorm", "reduce")


def _row_dtype(lib):
    return "bfloat16" if lib.name == "torch" else "float32"


@pytest.mark.gpu
@pytest.mark.parametrize("libname", LIBS)
@pytest.mark.parametrize("op", ROW_OPS)
def test_gpu_views_rowwise(prebuilt, libname, op):
    lib = _need_gpu_libs(libname)
    rng = _rng(op, libname)
    tally = Tally(op, libname)
    dt = _row_dtype(lib)
    extra = lib.kw(dt)
    for _ in range(CASES):
        shape = ROW_SHAPES[rng.integers(len(ROW_SHAPES))]
        x, dx = make(lib, rng, shape, dt)
        desc = f"x {shape} {dx} strides {lib.strides(x)}"
        params = []
        if op in ("rmsnorm", "layernorm"):
            for name in ("weight", "bias")[:1 if op == "rmsnorm" else 2]:
                p, dp = make(lib, rng, (shape[-1],), dt)
                params.append(p)
                desc += f"; {name} {dp} strides {lib.strides(p)}"
        red = str(rng.choice(("sum", "max", "min", "argmax"))) if op == "reduce" else None
        out, expect = None, "ok"
        if rng.random() < 0.2:
            if op == "reduce":
                oshape, odt = shape[:-1], ("int64" if red == "argmax" else dt)
                modes = ("contiguous", "expand", "transpose") if len(oshape) > 1 else ("contiguous", "expand")
                out, mode, expect = out_view(lib, rng, oshape, odt, modes)
            else:
                out, mode, expect = out_view(lib, rng, shape, dt, ("contiguous", "slice", "expand", "overlap",
                                                                    "transpose"))
            # transposed storage reaches no rows with one stride (and reduce writes out contiguously)
            expect = "reject" if expect == "transpose" else expect
            desc += f"; out {mode} strides {lib.strides(out)}"

        def call(x=x, params=params, out=out, red=red):
            if op in ("softmax", "log_softmax"):
                return rtk.softmax(x, out=out, log_softmax=op == "log_softmax", **extra)
            if op == "rmsnorm":
                return rtk.rmsnorm(x, *params, out=out, **extra)
            if op == "layernorm":
                return rtk.layernorm(x, *params, out=out, **extra)
            return rtk.reduce(x, red, out=out, **extra)

        def ref(x=x, params=params, red=red):
            xc, pc = lib.contiguous(x), [lib.contiguous(p) for p in params]
            if op in ("softmax", "log_softmax"):
                return rtk.softmax(xc, log_softmax=op == "log_softmax", **extra)
            if op == "rmsnorm":
                return rtk.rmsnorm(xc, *pc, **extra)
            if op == "layernorm":
                return rtk.layernorm(xc, *pc, **extra)
            return rtk.reduce(xc, red, **extra)
        tally.run(desc + (f"; op={red}" if red else ""), expect, ("x", "weight", "bias", "out"), call, ref,
                  close(lib, dt, op))
    tally.report()


# ---- elementwise -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("libname", LIBS)
def test_gpu_views_elementwise(prebuilt, libname):
    lib = _need_gpu_libs(libname)
    rng = _rng("elementwise", libname)
    tally = Tally("elementwise", libname)
    dt = _row_dtype(lib)
    extra = lib.kw(dt)
    f = rtk.elementwise("y = x * w + 0.5 * x")
    for _ in range(CASES):
        shape = EW_SHAPES[rng.integers(len(EW_SHAPES))]
        (x, dx), (w, dw) = make(lib, rng, shape, dt), make(lib, rng, shape, dt)
        desc = f"x {shape} {dx} strides {lib.strides(x)}; w {dw} strides {lib.strides(w)}"
        out, expect = None, "ok"
        if rng.random() < 0.2:
            modes = ("contiguous", "expand", "overlap") + (("transpose",) if len(shape) > 1 else ())
            out, mode, expect = out_view(lib, rng, shape, dt, modes)
            expect = "reject" if expect == "transpose" else expect   # outputs must be contiguous
            desc += f"; out {mode} strides {lib.strides(out)}"
        tally.run(desc, expect, ("x", "w", "out (y)"),
                  lambda: f(x, w, out=out, **extra),
                  lambda: f(lib.contiguous(x), lib.contiguous(w), **extra),
                  close(lib, dt, "y"))
    tally.report()


# ---- launch plans replay without the classification ----------------------------------------------------
@pytest.mark.gpu
def test_gpu_plan_path_never_classifies(monkeypatch):
    """The classification runs on an op's full path only: once a signature has a launch plan, its
    calls replay it without looking at views (host time on contiguous inputs is unchanged).  Each
    op is called once (plan recorded), then again with the classifier made to fail."""
    _need_gpu_libs("cupy")
    import cupy as cp
    from rtkernels.ops import views
    rng = np.random.default_rng(SEED)
    lib = Lib("cupy")
    a, b, c = lib.rand(rng, (64, 64), "float16"), lib.rand(rng, (64, 64), "float16"), cp.empty((64, 64), cp.float16)
    x, w = lib.rand(rng, (256, 96), "float16"), lib.rand(rng, (96,), "float16")
    q = lib.rand(rng, (1, 64, 2, 64), "float16")
    calls = {
        "matmul(cupy, out)": lambda: rtk.matmul(a, b, out=c),
        "softmax(cupy)": lambda: rtk.softmax(x),
        "rmsnorm(cupy)": lambda: rtk.rmsnorm(x, w),
        "layernorm(cupy)": lambda: rtk.layernorm(x, w, w),
        "reduce(cupy)": lambda: rtk.reduce(x, "sum"),
    }
    from rtkernels import device
    if device.current_arch() == "sm_90":   # attention keeps plans for the Hopper kernels
        o, lse = rtk.attention(q, q, q)
        calls["attention(cupy)"] = lambda: rtk.attention(q, q, q)
        calls["attention_backward(cupy)"] = lambda: rtk.attention_backward(q, q, q, q, o, lse)
    for fn in calls.values():
        fn()

    def refuse(*a, **k):
        raise AssertionError("the plan path classified a view")
    monkeypatch.setattr(views, "classify", refuse)
    lines = []
    for name, fn in calls.items():
        fn()   # a replay: must not classify
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        cp.cuda.Device().synchronize()
        lines.append(f"{'host ' + name:<32} {(time.perf_counter() - t0) / 200 * 1e6:7.1f} us/call (plan replay)")
    for line in lines:
        print("views fuzz", line)
        RESULTS[("host", line)] = dict(line=line, failures=[])
    _save()
