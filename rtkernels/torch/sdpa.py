"""``scaled_dot_product_attention`` in SDPA's layout, on rtk's attention kernels."""
from __future__ import annotations

import torch


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on (batch, heads, seqlen,
    head_dim) tensors, through ``torch.ops.rtk.attention`` (differentiable, compilable).

    The (batch, seqlen, heads, head_dim) tensors the kernel reads are transposed views of the
    arguments, so nothing is copied (a contiguous (B, H, S, D) tensor's transpose has head-dim
    stride 1 and 16-byte row strides); the result is the transpose of the kernel's contiguous
    (B, S, H, D) output, which is what a following ``.transpose(1, 2).reshape(B, S, H * D)``
    wants.

    Supported: float16 / bfloat16, head_dim a multiple of 8 up to 256 (value's the same as
    query's), ``is_causal``, ``scale``, ``enable_gqa`` (key/value heads dividing query heads).
    Raises NotImplementedError for ``attn_mask``, ``dropout_p > 0`` and for ``is_causal`` with
    seqlen_q != seqlen_k: SDPA aligns that mask to the top-left corner, rtk's kernels to the
    bottom-right (``rtkernels.torch.attention(..., causal=True)`` gives the bottom-right one,
    which is what decoding with a KV cache needs).
    """
    if attn_mask is not None:
        raise NotImplementedError("rtkernels.torch.scaled_dot_product_attention: attn_mask is not supported "
                                  "(rtk's kernels take no mask tensor); use is_causal=True for a causal mask")
    if dropout_p:
        raise NotImplementedError(f"rtkernels.torch.scaled_dot_product_attention: dropout_p={dropout_p} is not "
                                  "supported (no attention dropout in rtk's kernels); pass dropout_p=0.0")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"rtkernels.torch.scaled_dot_product_attention: query, key, value must be 4-D (batch, "
                         f"heads, seqlen, head_dim), got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(f"rtkernels.torch.scaled_dot_product_attention: value's head_dim "
                                  f"{value.shape[-1]} differs from query's {query.shape[-1]}; rtk's kernels need "
                                  "them equal")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"rtkernels.torch.scaled_dot_product_attention: query has {query.shape[1]} heads and key "
                         f"{key.shape[1]}; pass enable_gqa=True for grouped-query attention")
    if is_causal and query.shape[2] != key.shape[2]:
        raise NotImplementedError(f"rtkernels.torch.scaled_dot_product_attention: is_causal with seqlen_q="
                                  f"{query.shape[2]} != seqlen_k={key.shape[2]}: SDPA's mask is top-left aligned, "
                                  "rtk's bottom-right; call rtkernels.torch.attention(..., causal=True) for "
                                  "the bottom-right mask")
    o, _ = torch.ops.rtk.attention.default(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                           bool(is_causal), scale)
    return o.transpose(1, 2)
