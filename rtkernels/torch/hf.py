"""A transformers attention backend: ``register_transformers()`` then
``model.set_attn_implementation("rtk")`` (training and ``generate()``).

transformers (5.x) looks up the attention function of ``config._attn_implementation`` in
``AttentionInterface`` and the function building its mask in ``AttentionMaskInterface``.  The
mask function registered here materializes nothing: it returns None for the causal (or, in
encoders, bidirectional) pattern without padding, and for causal sliding windows, after checking
that the mask really is such a band; the attention function then passes ``causal=module.is_causal``
and the layer's ``sliding_window`` (W keys, the query's own included: ``window=(W - 1, 0)``, as
transformers' FlashAttention path does) and ``softcap`` (Gemma 2's logit capping) to the kernel.
Anything rtk's kernels cannot express here - padding tokens, packed sequences, static caches,
sinks, chunked or custom masks - raises NotImplementedError instead of attending to the wrong keys.
"""
from __future__ import annotations

import torch

_UNSUPPORTED_KWARGS = {
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
    window = None
    sliding = kwargs.get("sliding_window")
    if sliding is not None:
        if not is_causal or isinstance(sliding, bool) or not isinstance(sliding, int) or sliding < 1:
            raise _unsupported(f"sliding_window={sliding!r} on a {'causal' if is_causal else 'bidirectional'} layer "
                               "(a causal layer's window of >= 1 keys is)")
        window = [sliding - 1, 0]
    softcap = kwargs.get("softcap") or None
    o, _ = torch.ops.rtk.attention.default(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                           bool(is_causal), scaling, window, softcap)
    return o, None


def _causal_band(mask_function, q_rows, kv_offset: int, kv_length: int) -> bool:
    """Whether ``mask_function`` (transformers' ``(batch_idx, head_idx, q_idx, kv_idx) -> bool``)
    is, on the rows ``q_rows`` (absolute positions) over keys ``kv_offset ..``, a causal band: each
    row sees the keys from ``q - L`` (or the first) to ``q`` itself, for one L or none - plain
    causal, or a causal sliding window (whose width the attention function takes from the layer's
    ``sliding_window``, as transformers' FlashAttention path does).  Evaluated, not recognized by
    identity: transformers builds a new closure for each sliding-window mask."""
    kv = torch.arange(kv_offset, kv_offset + kv_length)
    zero = torch.zeros((), dtype=torch.long)
    left = None   # keys left of the diagonal each row sees (None: all of them so far)
    for q in sorted(q_rows, reverse=True):
        try:
            seen = torch.as_tensor(mask_function(zero, zero, torch.tensor(q), kv)).expand(kv_length)
        except Exception:   # noqa: BLE001 - a mask we cannot evaluate this way is not one we can trust
            return False
        lo = q - left if left is not None else kv_offset
        want = (kv <= q) & (kv >= lo)
        if left is None and bool(seen[0] == 0) and bool(seen.any()):
            first = int(seen.nonzero()[0])
            left = q - (kv_offset + first)
            want = (kv <= q) & (kv >= kv_offset + first)
        if not torch.equal(seen.to(torch.bool), want):
            return False
    return True


def rtk_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask function for "rtk": None (the kernel applies the causal mask and the layer's window
    itself), after checking that the pattern is bidirectional or a causal band (plain, or a sliding
    window), that no token is padding, and that the keys end at the last query (a dynamic cache,
    a sliding-window cache, or none)."""
    from transformers import masking_utils as mu
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor) \
            or kv_offset + kv_length != q_offset + q_length:
        raise _unsupported(f"a key range that does not end at the last query (kv_offset={kv_offset}, "
                           f"kv_length={kv_length}, q_offset={q_offset}, q_length={q_length}: a static cache)")
    bidirectional = getattr(mu, "bidirectional_mask_function", None)
    # rows probed: the last ones (a chunk or document boundary shows between two of them), the first
    # ones and a few between, ~1 ms a forward (not a layer) on the development CPU
    last = q_offset + q_length - 1
    rows = {r for r in (*range(last - 3, last + 1), q_offset, q_offset + 1,
                        *(q_offset + i * q_length // 8 for i in range(1, 8))) if q_offset <= r <= last}
    if mask_function is not None and mask_function is not bidirectional and not _causal_band(
            mask_function, rows, kv_offset, kv_length):
        raise _unsupported("this mask pattern (packed sequences, chunks or a custom mask function: rtk takes "
                           "causal masks, sliding windows and bidirectional attention)")
    if attention_mask is not None:
        # 2-D padding over the keys, or over every position so far (a sliding-window cache's keys are
        # its last kv_length columns)
        n = attention_mask.shape[-1] if attention_mask.dim() == 2 else -1
        if n not in (kv_length, kv_offset + kv_length):
            raise _unsupported(f"an attention mask of shape {tuple(attention_mask.shape)}")
        if not bool(attention_mask[:, n - kv_length:].all()):   # a host sync per forward, as transformers'
            raise _unsupported("padding tokens (a 2-D attention mask with zeros)")   # FlashAttention masks
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
