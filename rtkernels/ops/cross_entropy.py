"""Cross-entropy over the vocabulary, fused with its gradient.

>>> loss = rtk.cross_entropy(logits, target)                                  # mean over non-ignored tokens
>>> loss, dlogits = rtk.cross_entropy(logits, target, return_grad=True)       # one pass over the logits
>>> loss, _ = rtk.cross_entropy(logits, target, return_grad=True, grad_out=logits)   # gradient in place

``logits``: (..., vocab) float16 / bfloat16 / float32 (rows over the last axis, as the row ops);
``target``: int64 or int32 of shape ``logits.shape[:-1]``.  torch's ``F.cross_entropy`` semantics for
class indices: ``ignore_index`` rows have loss 0 and gradient 0 and do not count in the mean;
``label_smoothing`` eps mixes ``(1 - eps) * nll + eps * (lse - mean(x))``; ``reduction`` "none"
(float32 per token), "sum" or "mean" (float32 scalars; a mean over no tokens is NaN, as torch).
The gradient is that of the reduced loss ("none": of the sum): ``(softmax - (1 - eps) * onehot -
eps / V) * scale``, scale 1 or 1/N, in the logits' dtype.  A target outside [0, V) that is not
ignore_index gives a NaN loss and a NaN gradient row (torch raises a device assert).

How it runs (templates/cross_entropy.cu.j2): one kernel reads each row once - the row's team keeps it
on chip (registers, or on sm_90 per-block shared-memory slices of a cluster up to 512k 16-bit / 256k
float32 elements) - reduces max and sum of exp in one sweep, writes the loss, then the gradient from
the on-chip copy (so ``grad_out`` may be the logits).  For the mean's 1/N without a host sync, a tiny
kernel first counts the non-ignored targets into per-block partials that the main kernel sums on
the device (the mean of the loss itself is a one-block kernel after it).  Rows that do not start on
16 bytes (an odd vocabulary such as 50257) keep 16-byte vectors: lane 0 of the row takes the few
elements before the first and after the last whole vector.  Extra memory: 4 bytes per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np

from .. import dtypes
from ..arch import arch_number
from ..config import register_family
from ..errors import ConfigError
from ..kernel import get_kernel
from . import rowwise as rw
from ._arrays import (Launch, LaunchPlans, as_device_array, default_stream, device_pointer, dtype_name, empty_as,
                      same_memory)
from .rowwise import _RowConfig

REDUCTIONS = ("none", "sum", "mean")
TARGET_DTYPES = ("int64", "int32")
_SMEM_MAX = rw._SMEM_MAX


@register_family
@dataclass(frozen=True)
class CrossEntropyConfig(_RowConfig):
    """Fused cross-entropy rows (templates/cross_entropy.cu.j2) plus its target count and loss
    reduction kernels."""

    family: ClassVar[str] = "cross_entropy"
    template: ClassVar[str] = "cross_entropy.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("cross_entropy_rows", "cross_entropy_count", "cross_entropy_reduce")
    target_dtype: str = "int64"
    grad: bool = False        # write dlogits
    smoothing: bool = False   # label smoothing > 0: the row's sum of logits too
    two_pass: bool = False    # rows too wide to stay on chip: 1 read (loss) or 2 reads + 1 write (grad)
    ragged: bool = False      # rows not starting on 16 bytes: scalar head / tail, 16-byte body
    streaming: bool = True    # evict-first logits loads and dlogits stores

    def __post_init__(self):
        for name in ("grad", "smoothing", "two_pass", "ragged", "streaming"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "True or False")
        self._check_dtype("target_dtype", TARGET_DTYPES)
        super().__post_init__()
        if self.ragged and self.vec * dtypes.itemsize(self.dtype) != 16:
            self._fail("ragged", f"False unless vec * itemsize == 16 (vec={self.vec}, {self.dtype})")
        if self.persistent:
            self._fail("persistent", "False (one block or cluster per row)")


# ---- heuristics -------------------------------------------------------------------------------
# Reasoned from the forward softmax's measured table (rowwise.py, H200): the row and its state are
# the same (one packed row, an online max/sum), so the same row classes: registers up to 16k 16-bit
# elements (512 x 4 x 8), then shared-memory slices of 256 x 8 vectors (32 KiB) per block in clusters
# of 2..8, then 512 x 8 (64 KiB) and 512 x 16 (128 KiB) slices over 8 blocks.  The register caps
# (min_blocks) keep 4 / 2 / 1 blocks of those slices per SM at 64 registers: the forward's 40 is too
# few for the loss and gradient bookkeeping.  To be measured (tools/bench_training.py).
_CE_ELEMS_PER_THREAD = {2: 32, 4: 16}
_CE_GROUP_BLOCK = 128
_CE_BLOCK_MAX = 512          # registers: 512 x 4 x 8 = 16k 16-bit elements per block
_CE_SLICES = ((256, 8, 4), (512, 8, 2), (512, 16, 1))   # (block, vectors per thread, min_blocks)
_CE_TWO_PASS_BLOCK = 512


# Vocabularies between powers of two (sm_90, 16-byte vectors) refit their config as softmax does
# (rowwise.fit_width; the fewest threads on a tie, as softmax - the same online max and sum).
# Measured (H200, 2026-11-28, 4096 tokens, bf16, loss + grad, % of the 1 GiB copy, `ce_vocab_*`):
# vocabulary 151936 (Qwen2; 8 x 512 x 8 slices, 58% filled) 52.3 against 84.3 at 128256 (98%).
_CE_FIT = True


def plan(n: int, dtype: str, vec: int, arch: str, *, target_dtype: str = "int64", grad: bool = False,
         smoothing: bool = False, ragged: bool = False, fit: bool = _CE_FIT) -> CrossEntropyConfig:
    """The heuristic config for rows of ``n`` logits accessed ``vec`` at a time: per power of two
    >= n / vec, refitted to the row's own vector count on sm_90 (``fit``, see above)."""
    cfg = _plan(n, dtype, vec, arch, target_dtype, grad, smoothing, ragged)
    if fit and arch_number(arch) >= 90:
        cfg = rw.fit_width(cfg, -(-n // vec), fewest=True)
    return cfg


def _plan(n, dtype, vec, arch, target_dtype, grad, smoothing, ragged):
    size = dtypes.itemsize(dtype)
    nvec = rw._pow2_ceil(-(-n // vec))
    vmax = min(8, max(1, _CE_ELEMS_PER_THREAD[size] // vec))
    need = rw._pow2_ceil(-(-nvec // vmax))
    common = dict(dtype=dtype, vec=vec, target_dtype=target_dtype, grad=grad, smoothing=smoothing, ragged=ragged)
    if need <= 32:
        return CrossEntropyConfig(**common, threads_per_row=need, block_size=_CE_GROUP_BLOCK,
                                  vecs_per_thread=rw._pow2_ceil(-(-nvec // need)))
    if need <= _CE_BLOCK_MAX:
        return CrossEntropyConfig(**common, threads_per_row=need, block_size=need,
                                  vecs_per_thread=rw._pow2_ceil(-(-nvec // need)))
    if arch_number(arch) >= 90 and vec * size == 16:
        for block, vecs, min_blocks in _CE_SLICES:
            per_block = block * vecs
            if nvec <= 8 * per_block:
                cluster = max(1, nvec // per_block)
                return CrossEntropyConfig(**common, threads_per_row=block, block_size=block, vecs_per_thread=vecs,
                                          cluster_size=cluster, cluster_push=cluster > 1, smem_rows=True,
                                          min_blocks=min_blocks)
    return CrossEntropyConfig(**common, threads_per_row=_CE_TWO_PASS_BLOCK, block_size=_CE_TWO_PASS_BLOCK,
                              vecs_per_thread=vmax, two_pass=True)


@lru_cache(maxsize=1024)
def _planned(n_padded, dtype, vec, arch, target_dtype, grad, smoothing, ragged):
    return plan(n_padded, dtype, vec, arch, target_dtype=target_dtype, grad=grad, smoothing=smoothing, ragged=ragged)


def _config_for(config, n, dtype, vec, ragged, target_dtype, grad, smoothing):
    op = "cross_entropy"
    if config is None:
        arch, _ = rw._arch_info()
        return _planned(-(-n // vec) * vec, dtype, vec, arch, target_dtype, grad, smoothing, ragged)
    if not isinstance(config, CrossEntropyConfig):
        raise ConfigError(f"{op}: config must be a CrossEntropyConfig, got {type(config).__name__}", family=op,
                          field="config", value=config)
    want = dict(dtype=dtype, target_dtype=target_dtype, grad=grad, smoothing=smoothing)
    for name, v in want.items():
        if getattr(config, name) != v:
            raise ConfigError(f"{op}: config.{name}={getattr(config, name)!r} does not match the call ({v!r})",
                              family=op, field="config", value=config)
    if config.ragged != ragged or vec % config.vec or (ragged and config.vec != vec):
        raise ConfigError(f"{op}: config (vec={config.vec}, ragged={config.ragged}) does not fit these logits "
                          f"(vec <= {vec}, ragged={ragged})", family=op, field="config", value=config)
    if not config.two_pass and config.chunk_elements < n:
        raise ConfigError(f"{op}: config holds {config.chunk_elements} logits per row on chip, the row has {n}; "
                          "raise vecs_per_thread/threads_per_row/cluster_size or set two_pass=True", family=op,
                          field="config")
    return config


# ---- the op -------------------------------------------------------------------------------------
def cross_entropy(logits, target, *, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                  return_grad: bool = False, grad_out=None, dtype: str | None = None, stream=None,
                  config: CrossEntropyConfig | None = None):
    """Cross-entropy of ``logits`` (..., V) against class indices ``target`` (...), with its gradient.

    Parameters
    ----------
    logits : float16 / bfloat16 / float32, any leading shape; V from 1 up (any size, unaligned too).
    target : int64 or int32 of shape ``logits.shape[:-1]``.
    ignore_index : targets equal to it contribute no loss, no gradient and no count (torch's -100).
    label_smoothing : eps in [0, 1].
    reduction : "none" (float32 loss per token, shape ``target.shape``), "sum" or "mean" (float32
        0-d arrays); the mean divides by the non-ignored count (NaN when it is 0, as torch).
    return_grad : also return dlogits (the gradient of the reduced loss; "none": of its sum) in
        the logits' dtype, computed in the same pass over the logits.
    grad_out : where to write dlogits (logits' shape and dtype); may be ``logits`` itself (in place).
    dtype : ``"bfloat16"`` to read uint16 CuPy logits as bfloat16 bits.
    stream : as in :func:`rtkernels.softmax` (torch inputs: torch's current stream).
    config : a :class:`CrossEntropyConfig` overriding the heuristic.

    Returns
    -------
    ``loss``, or ``(loss, dlogits)`` with ``return_grad``.
    """
    op = "cross_entropy"
    options = (ignore_index, label_smoothing, reduction, bool(return_grad), dtype, config)
    key = _PLANS.key((logits, target, grad_out), options) \
        if type(ignore_index) is int and type(label_smoothing) is float else None
    plan = _PLANS.get(key)
    if plan is not None:
        return plan.run(logits, target, grad_out, stream)
    # check
    if reduction not in REDUCTIONS:
        raise ConfigError(f"{op}: reduction={reduction!r} is not allowed; use one of "
                          f"{', '.join(map(repr, REDUCTIONS))}", family=op, field="reduction", value=reduction, allowed=", ".join(REDUCTIONS))
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float, np.floating)) \
            or not 0.0 <= float(label_smoothing) <= 1.0:
        raise ConfigError(f"{op}: label_smoothing={label_smoothing!r} is not allowed; it must be a float in [0, 1]",
                          family=op, field="label_smoothing", value=label_smoothing, allowed="[0, 1]")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise ConfigError(f"{op}: ignore_index={ignore_index!r} must be an int", family=op, field="ignore_index")
    if grad_out is not None and not return_grad:
        raise ConfigError(f"{op}: grad_out is given but return_grad=False", family=op, field="grad_out")
    dt = rw._dtype_of(logits, dtype, op)
    lv, (rows, n, ls) = rw._rows_of(logits, op, "logits")
    rw._check_width(n, op)
    if n == 0:
        raise ConfigError(f"{op}: logits has an empty last axis (no classes)", family=op, field="logits",
                          value=tuple(lv.shape))
    lead = tuple(lv.shape[:-1])
    tv = as_device_array(target, op, "target")
    tdt = dtype_name(target)
    if tdt not in TARGET_DTYPES or tuple(tv.shape) != lead:
        raise ConfigError(f"{op}: target must be int64 or int32 of shape {lead} (logits.shape[:-1]), got {tdt} "
                          f"{tuple(tv.shape)}", family=op, field="target", value=f"{tdt}{tuple(tv.shape)}",
                          allowed=f"int64/int32 {lead}")
    if not tv.flags.c_contiguous:
        import cupy
        tv = cupy.ascontiguousarray(tv)
    gv, gs = None, 0
    grad_given = grad_out is not None
    if return_grad:
        grad_out, gv, (_, _, gs) = rw._out_rows(grad_out, logits, lv.shape, dt, op)
    f32 = rw._float32_of(logits)
    if rows == 0:
        result = empty_as(logits, lead if reduction == "none" else (), f32)
        if reduction != "none":   # torch: a sum over nothing is 0, a mean over nothing NaN
            (result.fill_ if hasattr(result, "fill_") else result.fill)(0.0 if reduction == "sum" else float("nan"))
        return (result, grad_out) if return_grad else result
    # plan
    size = dtypes.itemsize(dt)
    ptrs = (rw._ptr(lv),) + ((rw._ptr(gv),) if return_grad else ())
    strides = (ls,) + ((gs,) if return_grad else ())
    vec, ragged = rw.vector_access(size, n, rows, ptrs, strides)
    smoothing = float(label_smoothing)
    cfg = _config_for(config, n, dt, vec, ragged, tdt, bool(return_grad), smoothing > 0.0)
    # 1/N of the mean (with the gradient) from per-block counts of non-ignored targets: 4096 targets
    # per counting block, at most 32 partials (each thread of the main kernel sums them)
    ncounts = min(32, -(-rows // 4096)) if return_grad and reduction == "mean" else 0
    ig = int(ignore_index)
    plan = _CePlan(
        count=Launch(get_kernel(cfg, "cross_entropy_count"), (ncounts,), (256,), 0, (rows, ig)) if ncounts else None,
        rows=Launch(get_kernel(cfg, "cross_entropy_rows"), (cfg.grid(rows),), (cfg.block_size,), cfg.shared_mem_bytes,
                    (rows, n, ls, gs, ncounts, ig, smoothing)),
        reduce=Launch(get_kernel(cfg, "cross_entropy_reduce"), (1,), (1024,), 0, (rows, ig, int(reduction == "mean")))
        if reduction != "none" else None,
        lead=lead, ncounts=ncounts, grad_shape=tuple(lv.shape) if return_grad else None,
        grad_dtype=grad_out.dtype if return_grad else None, return_grad=bool(return_grad),
        torch=type(logits).__module__.startswith("torch"))
    # launch
    result = plan.launch(logits, lv, tv, gv, grad_out, stream)
    if key is not None and same_memory((lv, tv, gv if grad_given else None), (logits, target, grad_out if grad_given
                                                                                else None)):
        _PLANS.put(key, plan)
    return result


@dataclass(frozen=True)
class _CePlan:
    """What a cross_entropy call launches (count, rows, reduce) and allocates, per signature."""
    count: Launch | None      # arrays: target, counts
    rows: Launch              # arrays: logits, target, grad, loss, counts
    reduce: Launch | None     # arrays: loss, target, out
    lead: tuple
    ncounts: int
    grad_shape: tuple | None
    grad_dtype: object
    return_grad: bool
    torch: bool

    def launch(self, like, lv, tv, gv, grad_out, stream):
        """Allocate the per-call arrays (as like's kind) and launch on (CuPy views or) arrays."""
        f32 = rw._float32_of(like)
        loss_tok = empty_as(like, self.lead, f32)
        result = loss_tok if self.reduce is None else empty_as(like, (), f32)
        counts = empty_as(like, (self.ncounts,), _lib_dtype(like, "int32")) if self.ncounts else None
        s = default_stream(like, stream)
        if self.torch:
            dev = like.get_device()
            ptr = lambda a: device_pointer(a, dev)  # noqa: E731
        else:
            ptr = lambda a: a  # noqa: E731
        if self.count is not None:
            self.count.run((ptr(tv), ptr(counts)), s)
        self.rows.run((ptr(lv), ptr(tv), ptr(gv), ptr(loss_tok), ptr(counts)), s)
        if self.reduce is not None:
            self.reduce.run((ptr(loss_tok), ptr(tv), ptr(result)), s)
        return (result, grad_out) if self.return_grad else result

    def run(self, logits, target, grad_out, stream):
        """A replay on the caller's arrays (the signature's checks passed at its first call)."""
        if self.return_grad and grad_out is None:
            grad_out = empty_as(logits, self.grad_shape, self.grad_dtype)
        return self.launch(logits, logits, target, grad_out if self.return_grad else None, grad_out, stream)


_PLANS = LaunchPlans()


def _lib_dtype(like, name: str):
    """The dtype object named ``name`` of like's array library (workspaces are allocated by the
    caller's library: torch's caching allocator orders them with torch's stream)."""
    if type(like).__module__.startswith("torch"):
        import torch
        return getattr(torch, name)
    return np.dtype(name)


# ---- float64 reference (host, NumPy) ------------------------------------------------------------
def cross_entropy_reference(logits, target, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                            reduction: str = "mean"):
    """float64 (loss, dlogits) with torch's semantics (see :func:`cross_entropy`)."""
    x = np.asarray(logits, np.float64)
    t = np.asarray(target).astype(np.int64)
    v = x.shape[-1]
    x2, t1 = x.reshape(-1, v), t.reshape(-1)
    m = x2.max(axis=-1, keepdims=True)
    lse = m + np.log(np.sum(np.exp(x2 - m), axis=-1, keepdims=True))
    valid = t1 != ignore_index
    tc = np.where(valid, t1, 0)
    x_t = np.take_along_axis(x2, tc[:, None], axis=-1)
    eps = float(label_smoothing)
    per = (1 - eps) * (lse - x_t) + eps * (lse - x2.mean(axis=-1, keepdims=True))
    per = np.where(valid[:, None], per, 0.0)[:, 0]
    count = int(valid.sum())
    p = np.exp(x2 - lse)
    onehot = np.zeros_like(x2)
    onehot[np.arange(len(tc)), tc] = 1.0
    g = p - (1 - eps) * onehot - eps / v
    g = np.where(valid[:, None], g, 0.0)
    if reduction == "none":
        return per.reshape(t.shape), g.reshape(x.shape)
    if reduction == "sum":
        return np.float64(per.sum()), g.reshape(x.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.float64(per.sum()) / count, (g / count if count else g * 0.0).reshape(x.shape)


__all__ = ["cross_entropy", "CrossEntropyConfig", "cross_entropy_reference"]
