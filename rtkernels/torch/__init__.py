"""rtkernels for PyTorch: the ops as ``torch.ops.rtk.*`` custom ops, with fake kernels
(torch.compile, FakeTensor), autograd, a drop-in ``scaled_dot_product_attention`` and a
transformers attention backend.

>>> import rtkernels.torch as rtt
>>> o, lse = rtt.attention(q, k, v, causal=True)          # (batch, seqlen, heads, head_dim)
>>> y = rtt.scaled_dot_product_attention(q, k, v, is_causal=True)   # SDPA's (batch, heads, seqlen, head_dim)
>>> c = rtt.matmul(a, b, bias=bias, activation="gelu")    # differentiable
>>> loss = rtt.cross_entropy(logits, target)             # dlogits written in the loss's own pass
>>> rtt.register_transformers(); model.set_attn_implementation("rtk")

This is the only rtkernels module that imports torch; ``pip install rtkernels[torch]`` installs it.
Ops run on torch's current stream, allocate their outputs with torch, work under
``torch.compile(fullgraph=True)`` and ``mode="reduce-overhead"`` (CUDA graphs), and pass
``torch.library.opcheck``.  New ops register with one :func:`op` call (see ``_library``).
"""
from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:   # pragma: no cover - exercised where torch is absent
    raise ImportError("rtkernels.torch needs PyTorch; install it with `pip install rtkernels[torch]` "
                      f"({exc})") from exc

from typing import Sequence

from ._library import LIB, REGISTERED, op
from ._ops import attention_layout, elementwise_function, matmul_operand
from .hf import register_transformers
from .dist import ring_attention
from .sdpa import scaled_dot_product_attention

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_kvcache",
           "matmul", "quantized_matmul", "dequantize_weight", "softmax", "rmsnorm", "layernorm", "reduce", "elementwise",
           "softmax_backward", "rmsnorm_backward", "layernorm_backward", "cross_entropy",
           "scaled_dot_product_attention", "register_transformers", "ring_attention", "op", "LIB", "REGISTERED"]

_rtk_ops = torch.ops.rtk


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None, *, window: tuple[int, int] | None = None,
              softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward as ``torch.ops.rtk.attention``: differentiable in q, k, v.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads, head_dim) float16 / bfloat16 CUDA tensor.
    k, v : (batch, seqlen_k, nheads_kv, head_dim); ``nheads % nheads_kv == 0`` (GQA/MQA).
        Strided views are read in place: last dimension contiguous, other strides whole 16-byte
        units, 16-byte aligned start (see :func:`rtkernels.attention`).
    causal : bottom-right aligned mask (query i sees key j iff j <= i + seqlen_k - seqlen_q).
    softmax_scale : default ``1 / sqrt(head_dim)``.
    window : ``(left, right)``: query i sees keys j with ``i + seqlen_k - seqlen_q - left <= j <=
        i + seqlen_k - seqlen_q + right`` (-1 = unbounded; FlashAttention's convention); with
        causal, ``(left, 0)`` is the usual sliding window (``left + 1`` keys, the query's own
        included).
    softcap : > 0: scores ``s`` become ``softcap * tanh(s / softcap)`` before the softmax (the
        backward differentiates through it).

    Returns
    -------
    ``(o, lse)``: o (batch, seqlen_q, nheads, head_dim) contiguous, lse float32 (batch, nheads,
    seqlen_q), natural log.  lse is not differentiable (a loss through it gets no gradient
    from it).  A query that sees no key gets o = 0, lse = -inf and zero gradients.
    """
    return _rtk_ops.attention.default(q, k, v, causal, softmax_scale, window, softcap)


def attention_backward(do, q, k, v, o, lse, causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False, *, window: tuple[int, int] | None = None,
                       softcap: float | None = None):
    """``(dq, dk, dv)`` of :func:`attention` (``torch.ops.rtk.attention_backward``)."""
    return _rtk_ops.attention_backward.default(do, q, k, v, o, lse, causal, softmax_scale, deterministic, window,
                                               softcap)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     softmax_scale: float | None = None, *, window: tuple[int, int] | None = None,
                     softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences (FlashAttention's ``flash_attn_varlen_func``) as
    ``torch.ops.rtk.attention_varlen``: differentiable in q, k, v.

    q : (total_q, nheads, head_dim); k, v : (total_k, nheads_kv, head_dim); sequence i is rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of q and ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]`` of k and
    v (int32 tensors of length batch + 1, starting at 0).  ``max_seqlen_q`` / ``max_seqlen_k``: the
    longest sequences (ints; given, so nothing is read back from the device - CUDA-graph capture
    works; the kernels clamp every sequence into the packed arrays, so malformed cu_seqlens give
    wrong rows, never an access outside them).  causal, softmax_scale, window, softcap as in
    :func:`attention`, per sequence.  Returns ``(o, lse)``: o like q, lse float32 (nheads, total_q).
    """
    return _rtk_ops.attention_varlen.default(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                             softmax_scale, window, softcap)


def attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                              causal: bool = False, softmax_scale: float | None = None, deterministic: bool = False,
                              *, window: tuple[int, int] | None = None, softcap: float | None = None):
    """``(dq, dk, dv)`` of :func:`attention_varlen` (``torch.ops.rtk.attention_varlen_backward``)."""
    return _rtk_ops.attention_varlen_backward.default(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                      max_seqlen_k, causal, softmax_scale, deterministic, window,
                                                      softcap)


def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, activation: str | None = None,
           trans_a: bool = False, trans_b: bool = False) -> torch.Tensor:
    """``activation(op(a) @ op(b) + bias)`` as ``torch.ops.rtk.matmul``, differentiable in a, b and
    bias (``op`` transposes the last two dims when ``trans_*``).  a: (M, K) or (B, M, K); b: (K, N)
    or (B, K, N), a 2-D operand broadcast over the other's batch; activation None, "relu", "gelu"
    (erf) or "silu".  See :func:`rtkernels.matmul` for layouts and dtypes."""
    return _rtk_ops.matmul.default(a, b, bias, activation, trans_a, trans_b)


def attention_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, *,
                      k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                      block_table: torch.Tensor | None = None, causal: bool = True,
                      softmax_scale: float | None = None,
                      num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode / chunked-prefill attention against a KV cache as ``torch.ops.rtk.attention_kvcache``
    (FlashAttention's ``flash_attn_with_kvcache``; see :func:`rtkernels.attention_kvcache` for the
    layouts: contiguous or paged caches with ``block_table``, ragged ``cache_seqlens``).
    k_new / v_new are written into the caches in place (declared to torch as a mutation of k_cache
    and v_cache); cache_seqlens is not modified.  Returns ``(o, lse)``; not differentiable
    (inference).  Nothing reads device data on the host, so a decode step captures in a CUDA graph."""
    return _rtk_ops.attention_kvcache.default(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                                              softmax_scale, num_splits)


def quantized_matmul(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, *, group_size: int | None = None,
                     zeros: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     activation: str | None = None) -> torch.Tensor:
    """``activation(x @ dequant(w_q)^T + bias)`` as ``torch.ops.rtk.quantized_matmul`` (see
    :func:`rtkernels.quantized_matmul`: w_q (N, K) int8 / uint8 / float8_e4m3fn, scales (N,) or
    (N, ceil(K / group_size)), zeros for integer weights).  Differentiable in x and bias (the
    weight is frozen: dx = dz @ dequant(w_q) through ``torch.ops.rtk.dequantize_weight`` and
    rtk.matmul); a gradient asked of scales or zeros raises NotImplementedError."""
    return _rtk_ops.quantized_matmul.default(x, w_q, scales, group_size, zeros, bias, activation)


def dequantize_weight(w_q: torch.Tensor, scales: torch.Tensor, *, group_size: int | None = None,
                      zeros: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``dequant(w_q)`` as a new (N, K) tensor of ``dtype`` (``torch.ops.rtk.dequantize_weight``;
    see :func:`rtkernels.dequantize_weight`)."""
    return _rtk_ops.dequantize_weight.default(w_q, scales, dtype, group_size, zeros)


def softmax(x: torch.Tensor, log_softmax: bool = False) -> torch.Tensor:
    """Softmax (or log-softmax) over the last axis (``torch.ops.rtk.softmax``)."""
    return _rtk_ops.softmax.default(x, log_softmax)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last axis (``torch.ops.rtk.rmsnorm``)."""
    return _rtk_ops.rmsnorm.default(x, weight, float(eps))


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last axis (``torch.ops.rtk.layernorm``)."""
    return _rtk_ops.layernorm.default(x, weight, bias, float(eps))


def softmax_backward(dy: torch.Tensor, y: torch.Tensor, log: bool = False) -> torch.Tensor:
    """dx of :func:`softmax` from its output ``y`` (``log=True``: y is log_softmax's output);
    ``torch.ops.rtk.softmax_backward``, what softmax's autograd calls."""
    return _rtk_ops.softmax_backward.default(dy, y, log)


def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor | None = None,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of :func:`rmsnorm` (``torch.ops.rtk.rmsnorm_backward``); rstd: the float32
    per-row statistic of ``rtkernels.rmsnorm(..., return_stats=True)``, or None to recompute it."""
    return _rtk_ops.rmsnorm_backward.default(dy, x, weight, rstd, float(eps))


def layernorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       mean: torch.Tensor | None = None, rstd: torch.Tensor | None = None,
                       eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)`` of :func:`layernorm` (``torch.ops.rtk.layernorm_backward``); mean,
    rstd: the forward's float32 statistics (both or neither; None recomputes them)."""
    return _rtk_ops.layernorm_backward.default(dy, x, weight, bias, mean, rstd, float(eps))


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the last axis of ``logits`` (..., V) against class indices ``target`` (...),
    with ``F.cross_entropy``'s semantics (ignore_index, label_smoothing, reduction "none" / "sum" /
    "mean"); the loss is float32.  Differentiable in logits: when they require grad,
    ``torch.ops.rtk.cross_entropy_with_grad`` writes dlogits in the same pass over the logits as the
    loss and the backward only scales them by the incoming gradient (in the logits' dtype).  The
    class axis is the last one (``F.cross_entropy`` takes it at dim 1).  See
    :func:`rtkernels.cross_entropy`."""
    args = (logits, target, int(ignore_index), float(label_smoothing), reduction)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _rtk_ops.cross_entropy_with_grad.default(*args)[0]
    return _rtk_ops.cross_entropy.default(*args)


def reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce the last axis: "sum", "max", "min" or "argmax" (``torch.ops.rtk.reduce``); sum is
    differentiable."""
    return _rtk_ops.reduce.default(x, op)


def elementwise(expr: str, *args, outputs: Sequence[str] | None = None, out_dtype: str | None = None):
    """Apply a fused elementwise expression (:func:`rtkernels.elementwise`) through
    ``torch.ops.rtk.elementwise``: the expression is a static string argument, so torch.compile
    keeps each expression as one op in the graph.

    ``args`` are the expression's inputs in order of first use: tensors of one shape, or Python
    numbers (broadcast).  Returns a tensor, or a tuple for several ``outputs``.  Not differentiable.
    """
    tensors, scalars, positions = [], [], []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            tensors.append(a)
        elif isinstance(a, (bool, int, float)):
            scalars.append(float(a))
            positions.append(i)
        else:
            raise TypeError(f"elementwise {expr!r}: input {i} must be a tensor or a Python number, "
                            f"got {type(a).__name__}")
    res = _rtk_ops.elementwise.default(expr, tensors, scalars, positions, list(outputs) if outputs else None, out_dtype)
    return res[0] if len(res) == 1 else tuple(res)
