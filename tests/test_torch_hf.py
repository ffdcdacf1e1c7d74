"""rtkernels.torch's transformers backend (rtkernels/torch/hf.py).

CPU (skipped without torch): the mask function over stand-in mask functions (causal, sliding
windows, packed sequences, chunks, padding, and what must raise) and the attention function's
layouts.  With transformers installed (not in CI), small models run through the backend on the CPU
with float32 reference kernels registered for the rtk attention ops: packed sequences and padding
against transformers' own SDPA path (the 2x rule), and generate() over left-padded prompts.
GPU (``-m gpu``): the same models on rtk's kernels: loss and gradients against SDPA / eager, and
generate() token agreement.
"""
from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")
rtt = pytest.importorskip("rtkernels.torch")
from rtkernels.torch import hf  # noqa: E402
from rtkernels.torch._library import _filled  # noqa: E402


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch.device("cuda")


# ---- the mask function (CPU, a stand-in masking_utils) ------------------------------------------
@pytest.fixture
def masking_utils(monkeypatch):
    mu = types.ModuleType("transformers.masking_utils")
    mu.causal_mask_function = lambda b, h, q, kv: kv <= q
    mu.bidirectional_mask_function = lambda b, h, q, kv: True
    pkg = sys.modules.get("transformers") or types.ModuleType("transformers")
    monkeypatch.setitem(sys.modules, "transformers", pkg)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", mu)
    monkeypatch.setattr(pkg, "masking_utils", mu, raising=False)
    return mu


def _cu(rows):
    return rows.cu_seqlens_q.tolist(), rows.cu_seqlens_k.tolist(), rows.max_seqlen_q, rows.max_seqlen_k


def test_transformers_mask_function(masking_utils):
    rtk_mask = hf.rtk_mask
    causal = masking_utils.causal_mask_function
    assert rtk_mask(2, 5, 5, mask_function=causal) is None
    assert rtk_mask(2, 1, 9, q_offset=8, mask_function=causal, attention_mask=torch.ones(2, 9, dtype=torch.bool)) is None
    assert rtk_mask(2, 5, 5, mask_function=lambda b, h, q, kv: kv <= q) is None   # causal, whatever its name
    # a sliding window of 3 keys (a new closure per call in transformers): any key range ending at the last query
    sliding = lambda b, h, q, kv: (kv <= q) & (kv > q - 3)   # noqa: E731
    assert rtk_mask(2, 9, 9, mask_function=sliding) is None
    assert rtk_mask(2, 9, 9, mask_function=sliding, config=types.SimpleNamespace(sliding_window=3)) is None
    with pytest.raises(NotImplementedError, match="sliding_window is 4"):   # not the layer's window
        rtk_mask(2, 9, 9, mask_function=sliding, config=types.SimpleNamespace(sliding_window=4))
    assert rtk_mask(2, 1, 3, q_offset=8, kv_offset=6, mask_function=sliding) is None
    assert rtk_mask(2, 4, 6, q_offset=8, kv_offset=6, mask_function=sliding) is None
    ones = torch.ones(2, 12, dtype=torch.bool)   # padding over every position so far
    assert rtk_mask(2, 4, 6, q_offset=8, kv_offset=6, mask_function=sliding, attention_mask=ones) is None
    ones[1, 2] = False   # padding outside the cache's window: not among the keys
    assert rtk_mask(2, 4, 6, q_offset=8, kv_offset=6, mask_function=sliding, attention_mask=ones) is None
    ones[1, 8] = False   # a hole among the keys: no varlen layout expresses it
    with pytest.raises(NotImplementedError, match="one run per row"):
        rtk_mask(2, 4, 6, q_offset=8, kv_offset=6, mask_function=sliding, attention_mask=ones)
    for bad in (lambda b, h, q, kv: kv < q,                               # a diagonal left out
                lambda b, h, q, kv: (kv <= q) & (kv % 2 == 0),            # holes
                lambda b, h, q, kv: (kv <= q) & (kv > q - 3) & (kv != q - 1)):
        with pytest.raises(NotImplementedError, match="mask pattern"):
            rtk_mask(2, 9, 9, mask_function=bad)
    with pytest.raises(NotImplementedError, match="static cache"):
        rtk_mask(2, 1, 64, q_offset=8, mask_function=causal)


def test_transformers_mask_packed_sequences(masking_utils):
    """Position ids restarting inside a row: transformers' packed mask function (and chunked
    attention, the same pattern) becomes sequences over the flattened rows; one sequence per row is
    the dense path (None)."""
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]])

    def packed(extra=None):
        def fn(b, h, q, kv):
            m = (kv <= q) & (seg[b, q] == seg[b, kv])
            return m if extra is None else m & extra(q, kv)
        return fn

    rows = hf.rtk_mask(2, 11, 11, mask_function=packed(), device="cpu")
    assert _cu(rows) == ([0, 3, 5, 11, 19, 22], [0, 3, 5, 11, 19, 22], 8, 8)
    assert rows.q_index is None and rows.k_index is None and (rows.q_length, rows.kv_length) == (11, 11)
    # a sliding window of 4 keys inside the sequences (Mistral packed)
    rows = hf.rtk_mask(2, 11, 11, mask_function=packed(lambda q, kv: kv > q - 4))
    assert _cu(rows)[0] == [0, 3, 5, 11, 19, 22]
    # chunks of 4 (Llama 4's chunked attention, without a cache)
    rows = hf.rtk_mask(1, 10, 10, mask_function=lambda b, h, q, kv: (kv <= q) & (kv // 4 == q // 4))
    assert _cu(rows) == ([0, 4, 8, 10], [0, 4, 8, 10], 4, 4)
    seg[:] = 0   # one sequence per row (what transformers hands under torch.compile): dense
    assert hf.rtk_mask(2, 11, 11, mask_function=packed()) is None
    seg[0, 6:] = 1
    with pytest.raises(NotImplementedError, match="mask pattern"):   # a key of the sequence before left out
        hf.rtk_mask(2, 11, 11, mask_function=packed(lambda q, kv: (kv != 7) | (q < 9)))
    # with a cache (a decode row) a packed mask looks like a sliding window: the model's config says not
    no_window = types.SimpleNamespace(sliding_window=None)
    with pytest.raises(NotImplementedError, match="sliding_window is None"):
        hf.rtk_mask(2, 1, 11, q_offset=10, mask_function=packed(), config=no_window)
    with pytest.raises(NotImplementedError, match="sliding_window is 3"):
        hf.rtk_mask(2, 11, 11, mask_function=packed(lambda q, kv: kv > q - 4),
                    config=types.SimpleNamespace(sliding_window=3))
    assert hf.rtk_mask(2, 11, 11, mask_function=packed(lambda q, kv: kv > q - 4),
                       config=types.SimpleNamespace(sliding_window=4)) is not None


def test_transformers_mask_padding(masking_utils):
    """A 2-D padding mask: the tokens of each row as sequences, the padded rows left out (gather
    indices), for a prompt (queries = keys) and a decode step (the last query column)."""
    causal = masking_utils.causal_mask_function
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[1, :3] = False   # left padding
    mask[2, 5:] = False   # right padding
    mask[3, :] = False    # nothing but padding
    rows = hf.rtk_mask(4, 7, 7, mask_function=causal, attention_mask=mask)
    assert _cu(rows) == ([0, 7, 11, 16, 16], [0, 7, 11, 16, 16], 7, 7)
    qb, qs = rows.q_index
    assert qb.tolist() == [0] * 7 + [1] * 4 + [2] * 5 and qs.tolist() == [*range(7), 3, 4, 5, 6, *range(5)]
    assert [t.tolist() for t in rows.k_index] == [t.tolist() for t in rows.q_index]
    # a decode step over a left-padded cache: 1 query per row, keys the row's tokens
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :4] = False
    rows = hf.rtk_mask(3, 1, 9, q_offset=8, mask_function=causal, attention_mask=mask)
    assert _cu(rows) == ([0, 1, 2, 3], [0, 9, 14, 23], 1, 9)
    assert rows.q_index[1].tolist() == [0, 0, 0] and rows.k_index[1][9:14].tolist() == [4, 5, 6, 7, 8]
    # bidirectional (an encoder) with padding
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3:] = False
    rows = hf.rtk_mask(2, 5, 5, mask_function=masking_utils.bidirectional_mask_function, attention_mask=mask)
    assert _cu(rows) == ([0, 3, 8], [0, 3, 8], 5, 5)


def test_transformers_attention_function_layout():
    mod = torch.nn.Module()
    mod.is_causal = True
    q = torch.empty(2, 8, 5, 64, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(2, 2, 5, 64, device="meta", dtype=torch.bfloat16)
    o, weights = hf.rtk_attention_forward(mod, q, kv, kv, None, scaling=0.125)
    assert o.shape == (2, 5, 8, 64) and o.is_contiguous() and weights is None
    o, _ = hf.rtk_attention_forward(mod, q, kv, kv, None, scaling=0.125, sliding_window=4, softcap=50.0)
    assert o.shape == (2, 5, 8, 64)
    # packed rows of one batch row: views of q, k, v, the output a view of the kernel's
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device="meta")
    o, _ = hf.rtk_attention_forward(mod, q[:1], kv[:1], kv[:1], hf.VarlenRows(cu, cu, 3, 3, 5, 5))
    assert o.shape == (1, 5, 8, 64) and o.is_contiguous()
    with pytest.raises(NotImplementedError, match="describes 4 over 4"):
        hf.rtk_attention_forward(mod, q[:1], kv[:1], kv[:1], hf.VarlenRows(cu, cu, 3, 3, 4, 4))
    with pytest.raises(NotImplementedError, match="all four"):
        hf.rtk_attention_forward(mod, q, kv, kv, None, cu_seq_lens_q=cu)
    with pytest.raises(NotImplementedError, match="sinks"):
        hf.rtk_attention_forward(mod, q, kv, kv, None, s_aux=torch.empty(8, device="meta"))
    mod.is_causal = False
    with pytest.raises(NotImplementedError, match="bidirectional"):
        hf.rtk_attention_forward(mod, q, kv, kv, None, sliding_window=4)
    with pytest.raises(NotImplementedError, match="mask tensor"):
        hf.rtk_attention_forward(mod, q, kv, kv, torch.empty(2, 1, 5, 5, device="meta"))


# ---- float32 reference kernels for the rtk attention ops on the CPU --------------------------------
def _scores(q, k, causal, scale, window, softcap):
    """float32 (batch, heads, sq, sk) scores with rtk's conventions (bottom-right causal,
    FlashAttention's (left, right) window, softcap), masked to -inf; and tanh of the capped ones."""
    sq, h, d = q.shape[1:]
    sk, hk = k.shape[1:3]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(h // hk, 1)
    s = qf @ kf.transpose(-1, -2) * (d ** -0.5 if scale is None else scale)
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if window is not None:
        if window[0] >= 0:
            seen &= j >= i - window[0]
        if window[1] >= 0:
            seen &= j <= i + window[1]
    return s.masked_fill(~seen, float("-inf")), t


def _reference(q, k, v, causal, scale, window, softcap):
    """(o, lse, p) of dense (batch, seqlen, heads, dim) attention in float32; o = 0 and lse = -inf
    for a row that sees no key."""
    h, hk = q.shape[2], k.shape[2]
    s, _ = _scores(q, k, causal, scale, window, softcap)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(lse.isfinite(), lse, 0)[..., None])
    vf = v.float().transpose(1, 2).repeat_interleave(h // hk, 1)
    return (p @ vf).transpose(1, 2).to(q.dtype), lse, p


def _reference_backward(do, q, k, v, causal, scale, window, softcap):
    """(dq, dk, dv) by the direct formulas (dK, dV summed over each GQA group)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1:3]
    scale = d ** -0.5 if scale is None else scale
    _, t = _scores(q, k, causal, scale, window, softcap)
    _, _, p = _reference(q, k, v, causal, scale, window, softcap)
    dof, qf = do.float().transpose(1, 2), q.float().transpose(1, 2)
    kf, vf = (x.float().transpose(1, 2).repeat_interleave(h // hk, 1) for x in (k, v))
    dp = dof @ vf.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    if t is not None:
        ds = ds * (1 - t * t)
    dq = (ds @ kf) * scale
    dk, dv = (ds.transpose(-1, -2) @ qf) * scale, p.transpose(-1, -2) @ dof

    def kv_layout(x):
        return x.view(b, hk, h // hk, sk, d).sum(2).transpose(1, 2).to(k.dtype)

    return dq.transpose(1, 2).to(q.dtype), kv_layout(dk), kv_layout(dv)


def _per_sequence(cu_q, cu_k, fn):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        if cq[i + 1] > cq[i]:
            fn(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1]))


@pytest.fixture(scope="module")
def rtk_cpu_attention():
    """CPU kernels for torch.ops.rtk.attention{,_varlen}{,_backward}: the transformers backend's
    plumbing (masks, gathers, layouts, autograd) checked without a GPU."""
    def fwd(q, k, v, causal, scale, window, softcap):
        return _reference(q, k, v, causal, scale, window, softcap)[:2]

    def bwd(do, q, k, v, o, lse, causal, scale, deterministic, window, softcap):
        return _reference_backward(do, q, k, v, causal, scale, window, softcap)

    def vfwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap):
        o, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("-inf"))

        def one(rq, rk):
            ob, lb, _ = _reference(q[None, rq], k[None, rk], v[None, rk], causal, scale, window, softcap)
            o[rq], lse[:, rq] = ob[0], lb[0]

        _per_sequence(cu_q, cu_k, one)
        return o, lse

    def vbwd(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, deterministic, window, softcap):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        def one(rq, rk):
            g = _reference_backward(do[None, rq], q[None, rq], k[None, rk], v[None, rk], causal, scale, window,
                                    softcap)
            dq[rq], dk[rk], dv[rk] = g[0][0], g[1][0], g[2][0]

        _per_sequence(cu_q, cu_k, one)
        return dq, dk, dv

    lib = torch.library.Library("rtk", "IMPL")   # noqa: TOR901 - CPU kernels for this module's tests
    for name, fn in (("attention", fwd), ("attention_backward", bwd), ("attention_varlen", vfwd),
                     ("attention_varlen_backward", vbwd)):
        lib.impl(name, _filled(fn, getattr(torch.ops.rtk, name).default), "CPU")
    yield
    lib._destroy()


def test_transformers_rows_from_kwargs_match_the_mask(rtk_cpu_attention, masking_utils):
    """DataCollatorWithFlattening's kwargs (cu_seq_lens_q, max_length_q, ...) and the mask
    function's packed rows give the same attention."""
    mod = torch.nn.Module()
    mod.is_causal = True
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 12, 64).bfloat16(), torch.randn(1, 2, 12, 64).bfloat16()
    seg = torch.tensor([[0] * 5 + [1] * 7])
    rows = hf.rtk_mask(1, 12, 12, mask_function=lambda b, h, i, j: (j <= i) & (seg[b, i] == seg[b, j]))
    o_mask, _ = hf.rtk_attention_forward(mod, q, k, k, rows)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    o_kw, _ = hf.rtk_attention_forward(mod, q, k, k, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7,
                                       max_length_k=7)
    assert torch.equal(o_mask, o_kw)
    o_dense, _ = hf.rtk_attention_forward(mod, q[:, :, 5:], k[:, :, 5:], k[:, :, 5:], None)
    assert torch.equal(o_mask[:, 5:], o_dense)


# ---- small models through the backend (CPU with the reference kernels; GPU) ---------------------------
def _llama(attn, dtype, seed=0, kind="llama", device="cuda"):
    """A small causal LM: Llama; Mistral with a 16-key sliding window; Gemma 2 (sliding and full
    layers alternating, logits capped at 30 in attention)."""
    transformers = pytest.importorskip("transformers")
    rtt.register_transformers()
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif kind == "mistral":
        cfg, cls = transformers.MistralConfig(sliding_window=16, **common), transformers.MistralForCausalLM
    else:
        cfg = transformers.Gemma2Config(head_dim=64, sliding_window=16, attn_logit_softcapping=30.0,
                                        final_logit_softcapping=None, query_pre_attn_scalar=64, **common)
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(device, dtype)
    model.set_attn_implementation(attn)
    return model


def _grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters()}


def _model_matches(kind, ref_attn, inputs, device="cuda"):
    """The "rtk" backend's loss and gradients against ``ref_attn``'s in float32, by the 2x rule
    against ``ref_attn`` in bfloat16.  ``inputs``: the model's keyword arguments (labels included)."""
    loss_ref, g_ref = _grads(_llama(ref_attn, torch.float32, kind=kind, device=device), inputs)
    loss_low, g_low = _grads(_llama(ref_attn, torch.bfloat16, kind=kind, device=device), inputs)
    loss_rtk, g_rtk = _grads(_llama("rtk", torch.bfloat16, kind=kind, device=device), inputs)
    assert abs(loss_rtk - loss_ref) <= 2 * abs(loss_low - loss_ref) + 1e-2, (loss_rtk, loss_low, loss_ref)
    bad = []
    for name, ref in g_ref.items():
        e = (g_rtk[name] - ref).norm().item()
        e_low = (g_low[name] - ref).norm().item()
        if e > 2 * e_low + 1e-3 * ref.norm().item():
            bad.append(f"{name}: |rtk - fp32| {e:.3e} vs |{ref_attn} bf16 - fp32| {e_low:.3e}")
    assert not bad, "\n".join(bad)


def _batch(layout: str, device, seed: int = 0) -> dict:
    """Model inputs: "plain" (2 x 96 tokens); "packed" (sequences of 5, 37, 1 and 53 tokens in one
    row, position ids restarting: transformers' packed mask function); "flattened" (the same with
    DataCollatorWithFlattening's FlashAttention kwargs too); "padded" (4 rows of 40: none, left
    padding 7, right padding 12, and a row of 3 tokens)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "plain":
        ids = torch.randint(0, 512, (2, 96), generator=g)
        return {"input_ids": ids.to(device), "labels": ids.to(device)}
    if layout in ("packed", "flattened"):
        lengths = [5, 37, 1, 53]
        ids = torch.randint(0, 512, (1, sum(lengths)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.clone()
        labels[0, torch.tensor([0, 5, 42, 43])] = -100   # no label across a sequence boundary
        # use_cache=False: transformers looks for packed position ids only without a cache
        inputs = {"input_ids": ids, "position_ids": pos, "labels": labels, "use_cache": False}
        if layout == "flattened":
            cu = torch.tensor([0, 5, 42, 43, 96], dtype=torch.int32)
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=53, max_length_k=53)
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    ids = torch.randint(1, 512, (4, 40), generator=g)
    mask = torch.ones(4, 40, dtype=torch.long)
    mask[1, :7] = 0
    mask[2, 28:] = 0
    mask[3, :37] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:].masked_fill_(mask[:, :-1] == 0, -100)   # no loss on what a padded row predicts
    return {"input_ids": ids.masked_fill(mask == 0, 0).to(device), "attention_mask": mask.to(device),
            "labels": labels.to(device)}


@pytest.mark.parametrize("layout", ["packed", "flattened", "padded"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_cpu_models_packed_and_padded_match(rtk_cpu_attention, kind, layout):
    """Packed sequences and padding through the backend's plumbing on the CPU (reference kernels):
    loss and gradients against transformers' SDPA path (eager for Gemma 2) by the 2x rule."""
    _model_matches(kind, "eager" if kind == "gemma2" else "sdpa", _batch(layout, "cpu"), device="cpu")


def _generate_agrees(kind, ids, mask, device, new_tokens=24):
    """Greedy tokens agree with SDPA's (eager's for Gemma 2's capped logits): the logits of every
    step up to a row's first divergence within a tenth of their spread, and a divergence allowed
    only where the reference's own top-2 logits are closer than twice the two backends' logit
    difference (a numerical tie)."""
    outs = {}
    ref_attn = "eager" if kind == "gemma2" else "sdpa"
    for attn in (ref_attn, "rtk"):
        model = _llama(attn, torch.bfloat16, kind=kind, device=device).eval()
        with torch.no_grad():
            outs[attn] = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                        min_new_tokens=new_tokens, do_sample=False, output_scores=True,
                                        return_dict_in_generate=True, pad_token_id=0)
    t_s, t_r = outs[ref_attn].sequences, outs["rtk"].sequences
    for row in range(t_s.shape[0]):
        diff = (t_s[row, ids.shape[1]:] != t_r[row, ids.shape[1]:]).nonzero()
        last = int(diff[0]) if len(diff) else new_tokens - 1   # the steps where both saw the same tokens
        for step in range(last + 1):
            s_ref = outs[ref_attn].scores[step][row].float()
            s_rtk = outs["rtk"].scores[step][row].float()
            both = s_ref.isfinite() & s_rtk.isfinite()   # min_new_tokens sets the end token to -inf in both
            err, spread = (s_ref - s_rtk)[both].abs().max().item(), s_ref[both].std().item()
            # bfloat16 logits: ~0.06-0.2 apart against a spread of ~3 (attending to one wrong key: 4-18)
            assert err <= 0.1 * spread, (f"row {row}, step {step}: logits {err:.3e} apart (spread {spread:.3e})")
        if len(diff):
            top2 = outs[ref_attn].scores[last][row].float().topk(2).values
            margin = (top2[0] - top2[1]).item()
            assert margin <= 2 * err, (f"row {row}: tokens diverge at step {last} with {ref_attn}'s top-2 margin "
                                       f"{margin:.3e} > 2 x the logit difference {err:.3e}\n{ref_attn} "
                                       f"{t_s[row].tolist()}\nrtk  {t_r[row].tolist()}")


def _left_padded(device, rows=3, length=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    for r in range(1, rows):
        mask[r, :5 * r + 1] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def test_cpu_generate_left_padded_agrees_with_sdpa(rtk_cpu_attention):
    """generate() over left-padded prompts: the prompt as padded varlen rows, each decode step one
    query per row over its own keys."""
    _generate_agrees("llama", *_left_padded("cpu"), "cpu", new_tokens=8)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_gpu_sliding_window_and_softcap_models_match_eager(kind):
    """A sliding window (Mistral) and capped logits with alternating windows (Gemma 2) through
    the "rtk" backend: loss and gradients against transformers' eager attention in float32 (the 2x
    rule against eager in bfloat16), 48 tokens > the 16-key window."""
    _cuda()
    ids = torch.randint(0, 512, (2, 48), device="cuda")
    _model_matches(kind, "eager", {"input_ids": ids, "labels": ids})


@pytest.mark.gpu
def test_gpu_llama_gradients_match_sdpa():
    _cuda()
    _model_matches("llama", "sdpa", _batch("plain", "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["packed", "flattened", "padded"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_gpu_packed_and_padded_match(kind, layout):
    """Packed sequences and padding on rtk's varlen kernels: loss and gradients against SDPA
    (eager for Gemma 2's capped logits) by the 2x rule."""
    _cuda()
    _model_matches(kind, "eager" if kind == "gemma2" else "sdpa", _batch(layout, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_gpu_llama_generate_agrees_with_sdpa(kind, padded):
    """Greedy generation against SDPA's (eager's for Gemma 2); Mistral and Gemma 2 generate past
    their 16-key window (the sliding-window cache's key range); ``padded``: left-padded prompts."""
    _cuda()
    if padded:
        ids, mask = _left_padded("cuda")
    else:
        ids = torch.randint(0, 512, (2, 24), device="cuda")
        mask = torch.ones_like(ids)
    _generate_agrees(kind, ids, mask, "cuda")
