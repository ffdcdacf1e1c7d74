"""Ring attention: each rank attends its queries to the K/V block it holds while the next block
travels around the ring; partial results merge by their log-sum-exp.

Forward, per rank (``world`` steps; :mod:`rtkernels.dist.schedule` says which block each step
computes):

* step t: shift the held K/V to rank + 1 and receive the next from rank - 1 on the communication
  stream, while ``rtk.attention`` runs this step's block on the compute stream; the compute stream
  waits for the shift (an event) before the next step.
* step 0 (the rank's own K/V, every query row) writes o straight into the output and its lse is
  the running lse.  The first later block merges (``rtk.attention_merge``) out with the block into
  a float32 accumulator, the ones after merge in place into it, and the last merges into the
  output again (the same kernel converting): no separate init or conversion pass, and with two
  ranks no float32 buffer at all.

Backward (``rtk.attention_backward`` per block, given the global o and lse, so each block's
gradients are exact parts of the full ones):

* dQ stays home and accumulates like o (float32 between the first and last contributions, kernel
  ``add_rows``).
* dK/dV of a K/V block travel with it, one hop behind: at step t a rank adds its contribution to the
  block it holds into the float32 accumulator that arrived from rank - 1 and sends it on to rank + 1;
  after ``world`` hops each accumulator is back at the rank that owns the block.  The K/V shift of
  step t and the accumulator shift of step t - 1 both overlap step t's kernels.

Communication: :mod:`rtkernels.dist.comm` (NCCL through CuPy, a torch process group, or simulated
ranks).  The same functions run with NumPy arrays on float64 reference kernels (the CPU tests
check the schedule that way, with every buffer poisoned with NaN until written).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError
from . import comm as _comm
from .layout import check_layout, check_local_len
from .schedule import Block, plan

FAMILY = "ring_attention"


# ---- kernels: the operations the schedule is written in -------------------------------------
def _pair(x):
    """A (2, batch, n, heads, d) array whose first two strides nest, viewed as (2 * batch, n, heads, d):
    dK and dV (or their accumulators) handled by one launch."""
    two, b, n, h, d = x.shape
    s = x.strides
    if s[0] != b * s[1]:
        raise AssertionError(f"pair view of strides {s}")
    if isinstance(x, np.ndarray):
        return np.lib.stride_tricks.as_strided(x, (two * b, n, h, d), s[1:])
    import cupy
    return cupy.lib.stride_tricks.as_strided(x, (two * b, n, h, d), s[1:])


class CudaKernels:
    """The rtkernels ops on CuPy views, all on one compute stream."""

    def __init__(self, dtype: str, stream, device: int):
        self.dtype = dtype          # "float16" | "bfloat16" (bfloat16 travels as uint16 CuPy arrays)
        self.stream = stream        # a cupy.cuda.Stream
        self.device = device

    def empty(self, shape, accum: bool = False):
        import cupy
        if accum:
            return cupy.empty(shape, cupy.float32)
        return cupy.empty(shape, cupy.uint16 if self.dtype == "bfloat16" else self.dtype)

    def contiguous(self, x):
        import cupy
        return x if x.flags.c_contiguous else cupy.ascontiguousarray(x)

    def attention(self, q, k, v, causal, scale, out):
        from ..ops.attention import attention
        return attention(q, k, v, causal=causal, softmax_scale=scale, out=out, dtype=self.dtype, stream=self.stream)[1]

    def attention_backward(self, do, q, k, v, o, lse, causal, scale, dq, dk, dv):
        from ..ops.attention_bwd import attention_backward
        attention_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale, dq=dq, dk=dk, dv=dv,
                           dtype=self.dtype, stream=self.stream)

    def merge(self, a, lse_a, b, lse_b, rows, out, lse_out):
        from ..ops.attention_merge import attention_merge
        attention_merge(a, lse_a, b, lse_b, rows=rows, out=out, lse_out=lse_out, dtype=self.dtype, stream=self.stream)

    def add(self, a, b, rows, out):
        from ..ops.attention_merge import add_rows
        add_rows(a, b, rows=rows, out=out, dtype=self.dtype, stream=self.stream)


class NumpyKernels:
    """float64 NumPy stand-ins with the same contracts (the CPU tests' kernels)."""

    dtype = "float64"
    stream = None
    device = None

    def empty(self, shape, accum: bool = False):
        return np.full(shape, np.nan)   # NaN until written: a read of an unwritten row shows

    def contiguous(self, x):
        return np.ascontiguousarray(x)

    @staticmethod
    def _scores(q, k, causal, scale):
        group = q.shape[2] // k.shape[2]
        kr = np.repeat(k, group, axis=2)
        s = scale * np.einsum("bihd,bjhd->bhij", q, kr)
        if causal:
            nq, nk = q.shape[1], k.shape[1]
            visible = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
            s = np.where(visible, s, -np.inf)
        return s, group

    def attention(self, q, k, v, causal, scale, out):
        s, group = self._scores(q, k, causal, scale)
        m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
        seen = np.isfinite(m)
        m = np.where(seen, m, 0.0)
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        lse = np.where(seen, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
        p = np.where(seen, p / np.where(l > 0, l, 1.0), 0.0)
        out[...] = np.einsum("bhij,bjhd->bihd", p, np.repeat(v, group, axis=2))
        return lse

    def attention_backward(self, do, q, k, v, o, lse, causal, scale, dq, dk, dv):
        s, group = self._scores(q, k, causal, scale)
        fin = np.isfinite(lse)[..., None]
        p = np.where(fin, np.exp(s - np.where(fin, lse[..., None], 0.0)), 0.0)
        vr = np.repeat(v, group, axis=2)
        dv_r = np.einsum("bhij,bihd->bjhd", p, do)
        dp = np.einsum("bihd,bjhd->bhij", do, vr)
        delta = np.transpose((do * o).sum(-1), (0, 2, 1))[..., None]
        ds = p * (dp - delta)
        dq[...] = scale * np.einsum("bhij,bjhd->bihd", ds, np.repeat(k, group, axis=2))
        dk_r = scale * np.einsum("bhij,bihd->bjhd", ds, q)
        b, nk, hkv, d = k.shape
        dk[...] = dk_r.reshape(b, nk, hkv, group, d).sum(3)
        dv[...] = dv_r.reshape(b, nk, hkv, group, d).sum(3)

    def merge(self, a, lse_a, b, lse_b, rows, out, lse_out):
        from ..ops.attention_merge import attention_merge_reference
        o, lse = attention_merge_reference(a, lse_a, b, lse_b, rows)
        lo, hi = rows
        full = a is not None and out is not a
        sl = slice(None) if full else slice(lo, hi)
        out[:, sl] = o[:, sl]
        lse_out[:, :, sl] = lse[:, :, sl]

    def add(self, a, b, rows, out):
        lo, hi = rows
        out = a if out is None else out
        if a is None:
            out[:, lo:hi] = b
            return
        res = np.array(a)
        res[:, lo:hi] += b
        sl = slice(None) if out is not a else slice(lo, hi)
        out[:, sl] = res[:, sl]


# ---- the schedules ---------------------------------------------------------------------------
def _check_first(steps: tuple, local_len: int) -> Block:
    first = steps[0]
    assert first is not None and first.q_rows == (0, local_len) and first.k_rows == (0, local_len), first
    return first


def forward_steps(kern, comm: _comm.Comm, q, k, v, steps: tuple, scale: float, out):
    """One rank's ring forward: o into ``out``; returns lse (batch, heads, seqlen) float32 (float64
    for NumPy)."""
    world, L = comm.world_size, q.shape[1]
    stream = kern.stream
    first = _check_first(steps, L)
    merges = [t for t in range(1, world) if steps[t] is not None]
    o_acc = kern.empty(q.shape, accum=True) if len(merges) > 1 else None
    o_blk = kern.empty(q.shape) if merges else None
    held = (kern.contiguous(k), kern.contiguous(v)) if world > 1 else (k, v)
    spare = [(kern.empty(k.shape), kern.empty(k.shape)) for _ in range(min(2, world - 1))]
    lse = None
    for t in range(world):
        if t + 1 < world:
            incoming = spare[t % 2]
            pending = comm.shift(held, incoming, after=stream)
        blk = steps[t]
        if t == 0:
            lse = kern.attention(q, k, v, first.causal, scale, out)
        elif blk is not None:
            (q0, q1), (k0, k1) = blk.q_rows, blk.k_rows
            o_b = o_blk[:, :q1 - q0]
            lse_b = kern.attention(q[:, q0:q1], held[0][:, k0:k1], held[1][:, k0:k1], blk.causal, scale, o_b)
            src = out if t == merges[0] else o_acc
            dst = out if t == merges[-1] else o_acc
            kern.merge(src, lse, o_b, lse_b, blk.q_rows, dst, lse)
        if t + 1 < world:
            pending.wait(stream)
            held = incoming
    return lse


def backward_steps(kern, comm: _comm.Comm, do, q, k, v, o, lse, steps: tuple, scale: float, dq, dkv):
    """One rank's ring backward: dQ into ``dq``, dK and dV into ``dkv`` (2, batch, seqlen, heads_kv, d)."""
    world, L = comm.world_size, q.shape[1]
    stream = kern.stream
    first = _check_first(steps, L)
    if world == 1:
        kern.attention_backward(do, q, k, v, o, lse, first.causal, scale, dq, dkv[0], dkv[1])
        return
    adds = [t for t in range(1, world) if steps[t] is not None]
    dq_acc = kern.empty(q.shape, accum=True) if len(adds) > 1 else None
    dq_blk = kern.empty(q.shape) if adds else None
    dkv_blk = kern.empty((2,) + tuple(k.shape))
    travel = [kern.empty((2,) + tuple(k.shape), accum=True) for _ in range(2)]
    held = (kern.contiguous(k), kern.contiguous(v))
    spare = [(kern.empty(k.shape), kern.empty(k.shape)) for _ in range(min(2, world - 1))]
    acc = arriving = landing = None
    for t in range(world):
        if t + 1 < world:
            incoming = spare[t % 2]
            pending = comm.shift(held, incoming, after=stream)
        blk = steps[t]
        if t == 0:
            kern.attention_backward(do, q, k, v, o, lse, first.causal, scale, dq, dkv_blk[0], dkv_blk[1])
            acc = travel[0]
            kern.add(None, _pair(dkv_blk), (0, L), _pair(acc))
        else:
            if blk is not None:
                (q0, q1), (k0, k1) = blk.q_rows, blk.k_rows
                dq_b = dq_blk[:, :q1 - q0]
                kern.attention_backward(do[:, q0:q1], q[:, q0:q1], held[0][:, k0:k1], held[1][:, k0:k1],
                                        o[:, q0:q1], lse[:, :, q0:q1], blk.causal, scale, dq_b,
                                        dkv_blk[0][:, :k1 - k0], dkv_blk[1][:, :k1 - k0])
                kern.add(dq if t == adds[0] else dq_acc, dq_b, blk.q_rows, dq if t == adds[-1] else dq_acc)
            arriving.wait(stream)   # the accumulator of the held block, from rank - 1
            acc = landing
            if blk is not None:
                kern.add(_pair(acc), _pair(dkv_blk[:, :, :k1 - k0]), blk.k_rows, None)
        landing = travel[1] if acc is travel[0] else travel[0]
        arriving = comm.shift([acc], [landing], after=stream)
        if t + 1 < world:
            pending.wait(stream)
            held = incoming
    arriving.wait(stream)   # this rank's own dK/dV, home after world hops
    kern.add(None, _pair(landing), (0, L), _pair(dkv))


# ---- public API ------------------------------------------------------------------------------
class _Call:
    """Checked inputs of one call: kernels, views, sizes."""

    def __init__(self, kern, views: dict, scale: float, array_kind):
        self.kern, self.views, self.scale, self.like = kern, views, scale, array_kind


def _check(arrays: dict, dtype, softmax_scale, family: str, layout: str) -> _Call:
    check_layout(layout, family)
    q = arrays["q"]
    if isinstance(q, np.ndarray):
        return _check_numpy(arrays, softmax_scale, family, layout)
    from ..ops.attention import check_inputs
    from ..ops._arrays import cupy_stream, default_stream
    p = check_inputs(arrays, dtype, softmax_scale, family)
    qv, kv = p.views["q"], p.views["k"]
    if qv.shape[1] != kv.shape[1]:
        raise ConfigError(f"{family}: q has {qv.shape[1]} local rows and k has {kv.shape[1]}; a rank holds the same "
                          "tokens of q, k and v (its shard of one sequence)", family=family, field="k",
                          value=tuple(kv.shape), allowed=f"k.shape[1] == q.shape[1] == {qv.shape[1]}")
    check_local_len(layout, qv.shape[1], "q.shape[1]", family)
    import cupy
    with cupy.cuda.Device(p.device):
        stream = cupy_stream(default_stream(q, None))
    return _Call(CudaKernels(p.dtype, stream, p.device), p.views, p.softmax_scale, q)


def _check_numpy(arrays, softmax_scale, family, layout) -> _Call:
    views = {n: np.asarray(a, np.float64) for n, a in arrays.items()}
    q, k = views["q"], views["k"]
    for n, a in views.items():
        if a.ndim != 4:
            raise ConfigError(f"{family}: {n} must be 4-D (batch, seqlen, nheads, head_dim), got {a.shape}",
                              family=family, field=n, value=a.shape)
    if views["v"].shape != k.shape or k.shape[1] != q.shape[1] or k.shape[0] != q.shape[0] \
            or k.shape[3] != q.shape[3] or q.shape[2] % max(k.shape[2], 1):
        raise ConfigError(f"{family}: q {q.shape}, k {k.shape}, v {views['v'].shape} do not fit (batch, seqlen, "
                          "nheads, head_dim) with nheads a multiple of k's", family=family, field="k", value=k.shape)
    check_local_len(layout, q.shape[1], "q.shape[1]", family)
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    return _Call(NumpyKernels(), views, scale, arrays["q"])


def _new(call: _Call, shape, accum: bool = False):
    """An output array of the caller's kind (torch in, torch out) and its CuPy / NumPy view."""
    if isinstance(call.like, np.ndarray):
        arr = call.kern.empty(shape, accum)
        return arr, arr
    from ..ops._arrays import as_device_array, new_like
    arr = new_like(call.like, tuple(shape), "float32" if accum else call.kern.dtype)
    return arr, as_device_array(arr, FAMILY, "out")


def _like_caller(call: _Call, x):
    """A CuPy array handed back as the caller's kind (torch tensors share the memory)."""
    if type(call.like).__module__.startswith("torch"):
        import torch
        return torch.from_dlpack(x)
    return x


def ring_attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, layout: str = "striped",
                   comm=None, return_lse: bool = False, dtype: str | None = None):
    """Attention over a sequence split across the ranks of a ring (this rank's shard in and out).

    Parameters
    ----------
    q : (batch, seqlen_local, nheads, head_dim), this rank's queries in ``layout`` order
        (:func:`rtkernels.dist.shard` makes them from a full sequence).
    k, v : (batch, seqlen_local, nheads_kv, head_dim), the same tokens' keys and values;
        ``nheads % nheads_kv == 0`` (GQA / MQA).  Every rank holds the same seqlen_local.
        float16 or bfloat16 CuPy arrays or torch CUDA tensors (bfloat16 in CuPy: uint16 bits with
        ``dtype="bfloat16"``), head_dim a multiple of 8 up to 256 - what ``rtk.attention`` takes,
        strided views included.  NumPy arrays run the float64 reference kernels (tests).
    causal : causal mask over the global sequence (token order, not local order).
    softmax_scale : default ``1 / sqrt(head_dim)``.
    layout : "striped" (token t on rank t % world), "zigzag" (chunks r and 2*world-1-r of
        2*world) or "contiguous"; see :mod:`rtkernels.dist.layout`.  zigzag needs an even
        seqlen_local.
    comm : None (the process's communicator: torch's default group when torch.distributed is
        initialized, else NCCL from RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT,
        or a single rank without them), an :class:`rtkernels.dist.Comm`, or a
        ``torch.distributed`` ProcessGroup.
    return_lse : also return the log-sum-exp (what :func:`ring_attention_backward` needs).
    dtype : "bfloat16" to read uint16 CuPy arrays as bfloat16 bits.

    Returns
    -------
    o (q's shape, dtype and kind), and with ``return_lse`` the float32 lse
    (batch, nheads, seqlen_local) over the full sequence.

    Raises
    ------
    ConfigError : inputs ``rtk.attention`` would refuse, q and k of different local lengths, an
        unknown layout or an odd local length for zigzag.

    Notes
    -----
    Launches on the current stream (torch's for torch tensors) and returns without waiting for
    the GPU; the ring's transfers run on the communicator's stream, ordered by events.
    """
    call = _check({"q": q, "k": k, "v": v}, dtype, softmax_scale, FAMILY, layout)
    c = _comm.resolve(comm)
    qv, kv, vv = (call.views[n] for n in ("q", "k", "v"))
    steps = plan(layout, bool(causal), c.rank, c.world_size, qv.shape[1])
    with _active(call):
        out, out_v = _new(call, qv.shape)
        if qv.shape[1] == 0 or qv.size == 0:
            lse = _empty_lse(call, qv)
        else:
            lse = forward_steps(call.kern, c, qv, kv, vv, steps, call.scale, out_v)
    if return_lse:
        return out, _like_caller(call, lse)
    return out


def ring_attention_backward(do, q, k, v, o, lse, *, causal: bool = False, softmax_scale: float | None = None,
                            layout: str = "striped", comm=None, dtype: str | None = None):
    """Gradients of :func:`ring_attention`: this rank's (dq, dk, dv) shards.

    Parameters
    ----------
    do : gradient of this rank's o (q's shape).
    q, k, v, o, lse : this rank's inputs and the forward's outputs (``return_lse=True``).
    causal, softmax_scale, layout, comm, dtype : as given to the forward.

    Returns
    -------
    ``(dq, dk, dv)`` of q's, k's and v's shapes, in the inputs' dtype and kind (dk and dv are views
    of one allocation).  dQ, dK and dV accumulate in float32 across the ring's steps.
    """
    call = _check({"do": do, "q": q, "k": k, "v": v, "o": o}, dtype, softmax_scale, "ring_attention_backward", layout)
    c = _comm.resolve(comm)
    dov, qv, kv, vv, ov = (call.views[n] for n in ("do", "q", "k", "v", "o"))
    batch, seqlen, heads, _ = qv.shape
    lse_v = _lse_view(call, lse, (batch, heads, seqlen))
    steps = plan(layout, bool(causal), c.rank, c.world_size, seqlen)
    with _active(call):
        dq, dq_v = _new(call, qv.shape)
        dkv, dkv_v = _new(call, (2,) + tuple(kv.shape))
        if qv.size and seqlen:
            backward_steps(call.kern, c, dov, qv, kv, vv, ov, lse_v, steps, call.scale, dq_v, dkv_v)
    return dq, dkv[0], dkv[1]


def _lse_view(call: _Call, lse, shape):
    if isinstance(call.like, np.ndarray):
        view = np.asarray(lse, np.float64)
        ok = view.shape == shape
    else:
        from ..ops._arrays import as_device_array
        view = as_device_array(lse, "ring_attention_backward", "lse")
        ok = tuple(view.shape) == shape and str(view.dtype) == "float32"
    if not ok:
        raise ConfigError(f"ring_attention_backward: lse must be float32 of shape {shape} (the forward's, "
                          f"return_lse=True), got {getattr(view, 'dtype', '?')} {tuple(view.shape)}",
                          family="ring_attention_backward", field="lse", value=tuple(view.shape))
    return view


def _empty_lse(call: _Call, qv):
    b, s, h, _ = qv.shape
    if isinstance(call.like, np.ndarray):
        return np.full((b, h, s), -np.inf)
    import cupy
    return cupy.full((b, h, s), -cupy.inf, cupy.float32)


class _active:
    """The call's device and compute stream made current (CuPy allocations and rtk ops follow it)."""

    def __init__(self, call: _Call):
        self.stream, self.device = call.kern.stream, call.kern.device
        self._ctx: list[Any] = []

    def __enter__(self):
        if self.stream is not None:
            import cupy
            self._ctx = [cupy.cuda.Device(self.device), self.stream]
            for c in self._ctx:
                c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self._ctx):
            c.__exit__(*exc)
        return False
