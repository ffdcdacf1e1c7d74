"""A transformers attention backend: ``register_transformers()`` then
``model.set_attn_implementation("rtk")`` (training and ``generate()``).

transformers (5.x) looks up the attention function of ``config._attn_implementation`` in
``AttentionInterface`` and the function building its mask in ``AttentionMaskInterface``.  The
mask function registered here materializes nothing: it returns None for the causal (or, in
encoders, bidirectional) pattern without padding, and the attention function passes
``causal=module.is_causal`` to the kernel.  Anything rtk's kernels cannot express yet - padding
tokens, packed sequences, sliding windows, static caches, softcapping, sinks - raises
NotImplementedError instead of attending to the wrong keys.
"""
from __future__ import annotations

import torch

_UNSUPPORTED_KWARGS = {
    "sliding_window": "sliding-window attention",
    "softcap": "logit softcapping",
    "s_aux": "attention sinks",
    "cu_seq_lens_q": "packed (varlen) sequences",
    "cu_seq_lens_k": "packed (varlen) sequences",
}


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"rtk attention backend: {what} is not supported yet; use "
                               "attn_implementation='sdpa' for this model or input")


def rtk_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs):
    """transformers' attention-function signature: query (batch, heads, seqlen_q, head_dim), key and
    value (batch, kv_heads, seqlen_k, head_dim) -> (attn_output (batch, seqlen_q, heads, head_dim),
    None).  The kernel reads transposed views (no copies) and writes the output in exactly the
    layout transformers wants."""
    if attention_mask is not None:
        raise _unsupported("an attention mask tensor (padding, or a custom 4-D mask)")
    if dropout:
        raise _unsupported(f"attention dropout ({dropout})")
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise _unsupported(what)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    o, _ = torch.ops.rtk.attention.default(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                           bool(is_causal), scaling)
    return o, None


def rtk_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask function for "rtk": None (the kernel applies the causal mask itself), after
    checking that the pattern is plain causal or bidirectional, that no token is padding, and that
    the keys are exactly the tokens seen so far (a dynamic cache or none)."""
    from transformers import masking_utils as mu
    plain = (getattr(mu, "causal_mask_function", None), getattr(mu, "bidirectional_mask_function", None))
    if mask_function is not None and mask_function not in plain:
        raise _unsupported("this mask pattern (packed sequences, sliding windows, chunks or a custom mask "
                           "function)")
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor) or kv_offset != 0 \
            or kv_length != q_offset + q_length:
        raise _unsupported(f"a key range that is not the tokens seen so far (kv_length={kv_length}, "
                           f"q_offset={q_offset}, q_length={q_length}: a static or sliding cache)")
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[-1] != kv_length:
            raise _unsupported(f"an attention mask of shape {tuple(attention_mask.shape)}")
        if not bool(attention_mask.all()):   # a host sync per forward, as transformers' FlashAttention masks
            raise _unsupported("padding tokens (a 2-D attention mask with zeros; varlen attention is pending)")
    return None


def register_transformers(name: str = "rtk") -> str:
    """Register rtk's attention (and its mask function) with transformers under ``name``; then
    ``model.set_attn_implementation(name)`` (or ``from_pretrained(..., attn_implementation=name)``)
    runs every attention layer through ``torch.ops.rtk.attention`` - forward, backward
    (``rtk.attention_backward``) and ``generate()``.

    Returns ``name``.  Raises ImportError when transformers is not installed.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(f"rtkernels.torch.register_transformers needs transformers (pip install transformers): "
                          f"{exc}") from exc
    AttentionInterface.register(name, rtk_attention_forward)
    AttentionMaskInterface.register(name, rtk_mask)
    return name
