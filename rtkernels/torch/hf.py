"""A transformers attention backend: ``register_transformers()`` then
``model.set_attn_implementation("rtk")`` (training and ``generate()``).

transformers (5.x) looks up the attention function of ``config._attn_implementation`` in
``AttentionInterface`` and the function building its mask in ``AttentionMaskInterface``.  The
mask function registered here materializes no mask:

- the causal (or, in encoders, bidirectional) pattern and causal sliding windows, after checking
  that the mask really is such a band: None.  The attention function passes
  ``causal=module.is_causal``, the layer's ``sliding_window`` (W keys, the query's own included:
  ``window=(W - 1, 0)``, as transformers' FlashAttention path does) and ``softcap`` (Gemma 2's
  logit capping) to the dense kernel.
- padding (a 2-D attention mask with zeros; each row's tokens one run, as left or right padding
  leaves them) and packed sequences (position ids restarting inside a row, which transformers
  turns into a block-diagonal mask function; or the ``cu_seq_lens_q`` / ``max_length_q`` kwargs of
  ``DataCollatorWithFlattening``): a :class:`VarlenRows`, the sequences as cu_seqlens, built once
  per forward and reused by every layer.  The attention function runs
  ``torch.ops.rtk.attention_varlen`` over them (gathering the tokens only where there is padding)
  and writes zeros at padded query rows, as transformers' FlashAttention path does.  Reading the
  mask's contents costs a host sync per forward (transformers' FlashAttention path syncs per layer).

Anything rtk's kernels cannot express here - padding with holes, static caches, sinks, custom 4-D
masks - raises NotImplementedError instead of attending to the wrong keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_UNSUPPORTED_KWARGS = {"s_aux": "attention sinks"}
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True, eq=False)
class VarlenRows:
    """The sequences of a (batch, seqlen) layout, as :func:`rtk_mask` hands them to every layer in
    place of a mask tensor (or the attention function builds them from FlashAttention kwargs).

    ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 on the model's device, the sequences' bounds in the
    flattened rows attended (batch-major; a row with no token is a sequence of length 0).
    ``max_seqlen_q`` / ``max_seqlen_k``: host ints.  ``q_index`` / ``k_index``: (batch, position)
    index tensors of the rows attended when some are padding; None when every row of the
    ``batch * q_length`` (``kv_length``) layout is attended, in order."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q_length: int
    kv_length: int
    q_index: tuple[torch.Tensor, torch.Tensor] | None = None
    k_index: tuple[torch.Tensor, torch.Tensor] | None = None


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"rtk attention backend: {what} is not supported yet; use "
                               "attn_implementation='sdpa' for this model or input")


def rtk_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature: query (batch, heads, seqlen_q, head_dim), key and
    value (batch, kv_heads, seqlen_k, head_dim) -> (attn_output (batch, seqlen_q, heads, head_dim),
    None).  ``attention_mask``: None or :func:`rtk_mask`'s :class:`VarlenRows`.  The kernel reads
    transposed views (no copies: the dense path, and packed rows of one batch row) and writes the
    output in exactly the layout transformers wants."""
    rows = attention_mask if isinstance(attention_mask, VarlenRows) else None
    if attention_mask is not None and rows is None:
        raise _unsupported("an attention mask tensor (a custom 4-D mask, or a mask built by another backend)")
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
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)   # (batch, seqlen, heads, dim)
    if rows is None and any(kwargs.get(n) is not None for n in _VARLEN_KWARGS):
        rows = _rows_from_kwargs(kwargs, q, k)
    if rows is None:
        o, _ = torch.ops.rtk.attention.default(q, k, v, bool(is_causal), scaling, window, softcap)
        return o, None
    batch, seqlen_q, heads, dim = q.shape
    if (seqlen_q, k.shape[1]) != (rows.q_length, rows.kv_length):
        raise _unsupported(f"{seqlen_q} queries over {k.shape[1]} keys where the mask describes {rows.q_length} over "
                           f"{rows.kv_length}")
    o, _ = torch.ops.rtk.attention_varlen.default(
        _flat_rows(q, rows.q_index), _flat_rows(k, rows.k_index), _flat_rows(v, rows.k_index), rows.cu_seqlens_q,
        rows.cu_seqlens_k, rows.max_seqlen_q, rows.max_seqlen_k, bool(is_causal), scaling, window, softcap)
    if rows.q_index is None:
        return o.view(batch, seqlen_q, heads, dim), None
    # padded query rows get zeros (transformers' FlashAttention path pads the same way)
    return o.new_zeros(batch, seqlen_q, heads, dim).index_put(rows.q_index, o), None


def _flat_rows(t: torch.Tensor, index) -> torch.Tensor:
    """(batch, seqlen, heads, dim) -> the (rows, heads, dim) attended: a view for one batch row,
    the rows gathered where ``index`` picks some."""
    if index is not None:
        return t[index]
    return t[0] if t.shape[0] == 1 else t.reshape(-1, *t.shape[2:])


def _rows_from_kwargs(kwargs, q: torch.Tensor, k: torch.Tensor) -> VarlenRows:
    """FlashAttention's packed-sequence kwargs (``DataCollatorWithFlattening(return_flash_attn_kwargs=
    True)``): sequences over the flattened ``batch * seqlen`` rows, as transformers' FlashAttention
    path reads them."""
    missing = [n for n in _VARLEN_KWARGS if kwargs.get(n) is None]
    if missing:
        raise _unsupported(f"packed-sequence kwargs without {', '.join(missing)} (all four are needed)")
    cu_q, cu_k = (torch.as_tensor(kwargs[n], device=q.device).to(torch.int32) for n in _VARLEN_KWARGS[:2])
    return VarlenRows(cu_q, cu_k, int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), q.shape[1], k.shape[1])


def _causal_band(mask_function, q_rows, kv_offset: int, kv_length: int, starts: torch.Tensor | None = None,
                 q_offset: int = 0) -> tuple[bool, int | None]:
    """Whether ``mask_function`` (transformers' ``(batch_idx, head_idx, q_idx, kv_idx) -> bool``)
    is, on the rows ``q_rows`` (absolute positions) over keys ``kv_offset ..``, a causal band: each
    row sees the keys from ``q - L`` (or its sequence's first) to ``q`` itself, for one L or none -
    plain causal, or a causal sliding window (whose width the attention function takes from the
    layer's ``sliding_window``, as transformers' FlashAttention path does).  ``starts``: (batch,
    q_length) first key of each query's sequence (packed sequences; every batch row probed), else
    ``kv_offset`` (batch row 0 probed).  Returns (whether it is, L where a row showed one).
    Evaluated, not recognized by identity: transformers builds a new closure for each sliding-window
    mask."""
    rows = torch.tensor(sorted(q_rows, reverse=True))
    kv = torch.arange(kv_offset, kv_offset + kv_length)
    nb = 1 if starts is None else starts.shape[0]
    batch = torch.zeros((), dtype=torch.long) if starts is None else torch.arange(nb)[:, None, None]
    try:   # every probed row in one evaluation: one transfer where the mask's tensors live on the GPU
        seen = torch.as_tensor(mask_function(batch, torch.zeros((), dtype=torch.long), rows[None, :, None],
                                             kv[None, None, :]))
        seen = seen.to(device="cpu", dtype=torch.bool).expand(nb, len(rows), kv_length)
    except Exception:   # noqa: BLE001 - a mask we cannot evaluate this way is not one we can trust
        return False, None
    floor = torch.full((nb, len(rows)), kv_offset) if starts is None else starts[:, rows - q_offset]
    # a row whose keys start after its sequence's first fixes the window's reach L
    first = torch.where(seen.any(2), seen.to(torch.int8).argmax(2) + kv_offset, floor)
    cut = (first > floor).nonzero()
    left = int(rows[cut[0, 1]] - first[cut[0, 0], cut[0, 1]]) if len(cut) else None
    lo = floor if left is None else torch.maximum(floor, rows[None, :] - left)
    want = (kv[None, None, :] <= rows[None, :, None]) & (kv[None, None, :] >= lo[:, :, None])
    return (True, left) if torch.equal(seen, want) else (False, None)


def _check_window(left: int | None, config) -> None:
    """A band narrower than the keys must be the model's sliding window: the attention function
    applies the layer's ``sliding_window``, not what the mask showed (a decode row of a packed or
    chunked mask looks like a window too)."""
    if left is None or config is None:
        return
    want = getattr(config, "sliding_window", None)
    if not isinstance(want, int) or left != want - 1:
        raise _unsupported(f"this mask pattern (its rows see {left + 1} keys back where the model's "
                           f"sliding_window is {want!r})")


def _segment_starts(mask_function, batch_size: int, q_length: int) -> torch.Tensor | None:
    """Packed sequences (no cache: queries and keys are the same ``q_length`` positions): each
    position's sequence start, (batch, q_length), where a position not seeing the one before it
    starts a sequence.  None where the mask cannot be evaluated so."""
    q = torch.arange(1, q_length)
    try:
        prev = torch.as_tensor(mask_function(torch.arange(batch_size)[:, None], torch.zeros((), dtype=torch.long),
                                             q[None, :], q[None, :] - 1))
        prev = prev.to(device="cpu", dtype=torch.bool).expand(batch_size, q_length - 1)
    except Exception:   # noqa: BLE001 - as in _causal_band
        return None
    pos = torch.arange(q_length).expand(batch_size, q_length)
    first = torch.cat([torch.ones(batch_size, 1, dtype=torch.bool), ~prev], 1)
    return torch.where(first, pos, 0).cummax(1).values


def _packed_rows(starts: torch.Tensor, q_length: int, device) -> VarlenRows:
    """:class:`VarlenRows` of the sequences ``starts`` describes (every row attended)."""
    first = starts == torch.arange(q_length)
    bounds = torch.cat([first.flatten().nonzero()[:, 0], torch.tensor([first.numel()])])
    lengths = bounds.diff()
    cu = bounds.to(device=device, dtype=torch.int32)
    longest = int(lengths.max())
    return VarlenRows(cu, cu, longest, longest, q_length, q_length)


def _padded_rows(keys: torch.Tensor, q_length: int) -> VarlenRows:
    """:class:`VarlenRows` of a (batch, kv_length) padding mask whose queries are its last
    ``q_length`` columns; each row's tokens must be one run (left or right padding)."""
    if q_length > keys.shape[1]:
        raise _unsupported(f"padding with {q_length} queries over {keys.shape[1]} keys")
    runs = (keys[:, 1:] & ~keys[:, :-1]).sum(1) + keys[:, 0]
    queries = keys[:, keys.shape[1] - q_length:]
    n_k, n_q = keys.sum(1), queries.sum(1)
    most_runs, max_k, max_q = torch.stack([runs.max(), n_k.max(), n_q.max()]).tolist()   # the one host sync
    if most_runs > 1:
        raise _unsupported("a padding mask whose tokens are not one run per row (padding between tokens)")

    def cu(n):
        return torch.nn.functional.pad(n.cumsum(0), (1, 0)).to(torch.int32)

    return VarlenRows(cu(n_q), cu(n_k), max_q, max_k, q_length, keys.shape[1], queries.nonzero(as_tuple=True),
                      keys.nonzero(as_tuple=True))


def rtk_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask function for "rtk": None (the kernel applies the causal mask and the layer's window
    itself) or a :class:`VarlenRows` (padding, packed sequences), after checking that the pattern is
    bidirectional or a causal band (plain, or a sliding window) within each sequence, and that the
    keys end at the last query (a dynamic cache, a sliding-window cache, or none)."""
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
    band, left = (True, None) if mask_function is None or mask_function is bidirectional else \
        _causal_band(mask_function, rows, kv_offset, kv_length)
    if not band:
        # packed sequences (or chunks): causal bands within runs of positions; transformers builds
        # them only without a cache and without padding
        starts = None
        if q_offset == kv_offset == 0 and q_length == kv_length and attention_mask is None:
            starts = _segment_starts(mask_function, batch_size, q_length)
        band, left = (False, None) if starts is None else _causal_band(mask_function, rows, 0, kv_length, starts)
        if not band:
            raise _unsupported("this mask pattern (rtk takes causal masks and sliding windows within packed "
                               "sequences, and bidirectional attention)")
        _check_window(left, kwargs.get("config"))
        packed = _packed_rows(starts, q_length, kwargs.get("device") or "cpu")
        # every row one sequence (transformers under torch.compile always hands the packed function)
        return packed if packed.cu_seqlens_q.numel() > batch_size + 1 else None
    _check_window(left, kwargs.get("config"))
    if attention_mask is not None:
        # 2-D padding over the keys, or over every position so far (a sliding-window cache's keys are
        # its last kv_length columns)
        n = attention_mask.shape[-1] if attention_mask.dim() == 2 else -1
        if n not in (kv_length, kv_offset + kv_length):
            raise _unsupported(f"an attention mask of shape {tuple(attention_mask.shape)}")
        keys = attention_mask[:, n - kv_length:].to(torch.bool)
        if not bool(keys.all()):   # a host sync per forward, as transformers' FlashAttention masks
            return _padded_rows(keys, q_length)
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
