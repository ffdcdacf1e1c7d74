"""Ring attention with autograd: :func:`ring_attention` is :func:`rtkernels.dist.ring_attention`
whose backward is :func:`rtkernels.dist.ring_attention_backward`, so a sequence-parallel model
trains through it with ``loss.backward()``.

A ``torch.autograd.Function`` rather than a ``torch.ops.rtk`` op: the communicator (a process
group, an NCCL communicator) is no tensor or scalar a custom op's schema can carry.  Eager mode
only; under ``torch.compile`` it is a graph break.
"""
from __future__ import annotations

import torch

from ..dist import ring_attention as _ring_forward
from ..dist import ring_attention_backward as _ring_backward


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, layout, comm):
        o, lse = _ring_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, comm=comm,
                               return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = (causal, softmax_scale, layout, comm)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, softmax_scale, layout, comm = ctx.options
        dq, dk, dv = _ring_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale, layout=layout,
                                    comm=comm)
        return dq, dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   softmax_scale: float | None = None, layout: str = "striped",
                   comm=None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of attention over a sequence split across a ring of GPUs, differentiable
    in q, k and v.

    Parameters
    ----------
    q, k, v : this rank's (batch, seqlen_local, heads, head_dim) shards in ``layout`` order
        (:func:`rtkernels.dist.shard`), float16 / bfloat16 CUDA tensors.
    causal, softmax_scale, layout, comm : as :func:`rtkernels.dist.ring_attention` (``comm=None``:
        torch's default process group when torch.distributed is initialized).

    Returns
    -------
    ``(o, lse)``: o of q's shape; lse float32 (batch, heads, seqlen_local) over the full sequence,
    not differentiable.  The backward passes dK/dV accumulators around the same ring, so every
    rank must call ``backward`` (as with any collective).
    """
    return _RingAttention.apply(q, k, v, bool(causal), softmax_scale, layout, comm)
