"""``torch.ops.rtk.*``: the rtkernels ops as PyTorch custom ops (definitions, fakes, autograd).

Each op is one :func:`op` call: schema, CUDA kernel (the rtkernels function, which already
accepts torch tensors, allocates its outputs with torch and launches on torch's current
stream), fake kernel (exact output shapes, dtypes and strides: the rtk ops return new
contiguous tensors), and backward.  Backward formulas call ``torch.ops.rtk`` ops again, so
under torch.compile AOTAutograd traces them into the backward graph.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

import rtkernels as _rtk
from ..errors import ConfigError
from ..ops._arrays import dtype_name
from ..ops.attention_mask import mask_spec
from ..ops.attention_bwd import compile_ahead
from ..ops.matmul import matmul_positional
from ._library import empty_like_contiguous as _like
from ._library import TAGS, op

_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _ops():
    return torch.ops.rtk


# ---- attention --------------------------------------------------------------------------------
def _check_attention(q, k, v, where: str = "attention", packed: bool = False) -> None:
    """The shape and dtype rules of rtk.attention, checked on fake tensors too (so torch.compile
    reports them at trace time, in the eager op's words).  ``packed``: the varlen layout, (total,
    nheads, head_dim) tensors without the batch dimension."""
    dims, layout = (3, "(total, nheads, head_dim) with cu_seqlens") if packed else \
        (4, "(batch, seqlen, nheads, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != dims:
            raise ConfigError(f"{where}: {name} has shape {tuple(t.shape)}; expected {dims}-D {layout}", field=name,
                              value=tuple(t.shape))
        if t.dtype not in _HALF or t.dtype != q.dtype:
            raise ConfigError(f"{where}: q, k, v must all be float16 or all bfloat16, got {q.dtype}, {k.dtype}, "
                              f"{v.dtype}", field="dtype", value=str(t.dtype))
    h, d = q.shape[-2:]
    if tuple(k.shape) != tuple(v.shape) or k.shape[-1] != d or (not packed and k.shape[0] != q.shape[0]):
        want = "(total_k, nheads_kv, head_dim" if packed else f"(batch={q.shape[0]}, seqlen_k, nheads_kv, head_dim"
        raise ConfigError(f"{where}: k and v must have shape {want}={d}), got {tuple(k.shape)} and "
                          f"{tuple(v.shape)}", field="k", value=tuple(k.shape))
    if k.shape[-2] == 0 or h % k.shape[-2]:
        raise ConfigError(f"{where}: nheads={h} must be a multiple of nheads_kv={k.shape[-2]} (GQA/MQA)",
                          field="k", value=tuple(k.shape))
    if d % 8 or not 8 <= d <= 256:
        raise ConfigError(f"{where}: head_dim={d} is not allowed; a multiple of 8 in [8, 256]",
                          field="head_dim", value=d)


def _window(window):
    """The schema's ``int[]?`` window (a list) as rtk takes it: a tuple (a launch plan's key part)."""
    return None if window is None else tuple(window)


def _mask(causal, window, softcap, where: str, varlen: bool = False) -> None:
    """rtk's own rule for the mask arguments, on fakes (so torch.compile raises what the eager op
    raises; the eager op checks them itself)."""
    mask_spec(causal, _window(window), softcap, varlen, family=where)


def _plain(window, softcap) -> bool:
    return window is None and not softcap


def _attention_fake(q, k, v, causal, softmax_scale, window=None, softcap=None):
    _check_attention(q, k, v)
    _mask(causal, window, softcap, "attention")
    b, s, h, _ = q.shape
    return _like(q), _like(q, (b, h, s), torch.float32)


def _attention_save(ctx, args, out):
    q, k, v, causal, softmax_scale, window, softcap = args
    o, lse = out
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.softmax_scale, ctx.window, ctx.softcap = causal, softmax_scale, window, softcap


def attention_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` if rtk's attention kernels can read it in place (last dimension contiguous, other
    strides whole 16-byte units, 16-byte aligned start), else a contiguous copy.  For gradients
    arriving from elsewhere (an expanded or sliced ``do``); inputs keep the op's own checks."""
    item = t.element_size()
    if t.stride(-1) == 1 and all(s * item % 16 == 0 for s in t.stride()[:-1]) \
            and t.storage_offset() * item % 16 == 0:
        return t
    return t.contiguous()


def _attention_backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _ops().attention_backward.default(attention_layout(do), q, k, v, o, lse, ctx.causal,
                                                   ctx.softmax_scale, False, ctx.window, ctx.softcap)
    return dq, dk, dv, None, None, None, None


def _attention_prepare(args):
    # a forward that records for autograd will be differentiated: its backward's kernels compile
    # on a background thread while the forward's do (a cold first training step); the plain mask's
    # (a window or softcap compiles its own configs when its backward runs)
    q, causal = args[0], args[3]
    # (a symbolic head dim under torch.compile's dynamic shapes, or a dtype the op refuses: the call tells)
    # (meta tensors - make_fx over meta inputs - have no device to compile for)
    if not isinstance(q.shape[-1], int) or q.dtype not in _HALF or not _plain(args[5], args[6]) \
            or q.device.type != "cuda":
        return
    dev = q.device.index
    compile_ahead(dtype_name(q), q.shape[-1], bool(causal), torch.cuda.current_device() if dev is None else dev)


def _attention_impl(q, k, v, causal, softmax_scale, window, softcap):
    if window is None and softcap is None:
        return _rtk.attention(q, k, v, causal, softmax_scale)
    return _rtk.attention(q, k, v, causal, softmax_scale, window=_window(window), softcap=softcap)


attention_op = op("attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? softmax_scale=None, "
                  "int[]? window=None, float? softcap=None) -> (Tensor, Tensor)",
                  _attention_impl, fake=_attention_fake, backward=_attention_backward,
                  setup_context=_attention_save, prepare=_attention_prepare)


def _attention_backward_fake(do, q, k, v, o, lse, causal, softmax_scale, deterministic, window=None,
                             softcap=None):
    _check_attention(q, k, v, "attention_backward")
    _mask(causal, window, softcap, "attention_backward")
    return _like(q), _like(k), _like(v)


@functools.lru_cache(maxsize=None)
def _torch_scratch():
    """A CuPy allocator drawing from torch's caching allocator on torch's current stream.  The
    attention backward's float32 workspaces are CuPy arrays; from CuPy's own pool they would be
    ordered on CuPy's stream while the kernels run on torch's (a race once torch works on a side
    stream), and inside a torch CUDA-graph capture they would be memory the graph does not own."""
    from cupy.cuda import memory

    def malloc(size, device_id):
        return torch.cuda.caching_allocator_alloc(size, device_id)

    def free(ptr, device_id):
        torch.cuda.caching_allocator_delete(ptr)

    return memory.PythonFunctionAllocator(malloc, free).malloc


def _attention_backward_impl(do, q, k, v, o, lse, causal, softmax_scale, deterministic, window=None, softcap=None,
                             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    import cupy
    with cupy.cuda.using_allocator(_torch_scratch()):
        return _rtk.attention_backward(do, q, k, v, o, lse, causal, softmax_scale, deterministic,
                                       window=_window(window), softcap=softcap, cu_seqlens_q=cu_seqlens_q,
                                       cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                       max_seqlen_k=max_seqlen_k)


_NO_DOUBLE = "{} has no backward (double backward through attention is not supported)"
attention_backward_op = op(
    "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal=False, "
    "float? softmax_scale=None, bool deterministic=False, int[]? window=None, float? softcap=None) "
    "-> (Tensor, Tensor, Tensor)",
    _attention_backward_impl, fake=_attention_backward_fake, backward=_NO_DOUBLE.format("rtk.attention_backward"))


# ---- varlen attention: packed sequences (FlashAttention's flash_attn_varlen_func) -----------------
def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, where: str) -> None:
    """The packed layout's rules (checked on fakes too): q (total_q, nheads, head_dim), k and v
    (total_k, nheads_kv, head_dim), cu_seqlens int32 (batch + 1,) each; contents are the eager op's
    (rtk.attention: read only where a max_seqlen hint is missing, which this op never lets happen)."""
    _check_attention(q, k, v, where, packed=True)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 2:
            raise ConfigError(f"{where}: {name} must be a 1-D int32 tensor of length batch + 1 >= 2, got {t.dtype} "
                              f"{tuple(t.shape)}", field=name, value=tuple(t.shape))
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ConfigError(f"{where}: cu_seqlens_q and cu_seqlens_k must have the same length, got "
                          f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}", field="cu_seqlens_k",
                          value=tuple(cu_seqlens_k.shape))


def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           window=None, softcap=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, "attention_varlen")
    _mask(causal, window, softcap, "attention_varlen", True)
    return _like(q), _like(q, (q.shape[1], q.shape[0]), torch.float32)


def _attention_varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           window, softcap):
    return _rtk.attention(q, k, v, causal, softmax_scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window=_window(window),
                          softcap=softcap)


def _attention_varlen_save(ctx, args, out):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window, softcap = args
    o, lse = out
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.rtk_mask = (max_q, max_k, causal, softmax_scale, window, softcap)


def _attention_varlen_backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    max_q, max_k, causal, softmax_scale, window, softcap = ctx.rtk_mask
    dq, dk, dv = _ops().attention_varlen_backward.default(attention_layout(do), q, k, v, o, lse, cu_q, cu_k, max_q,
                                                          max_k, causal, softmax_scale, False, window, softcap)
    return (dq, dk, dv) + (None,) * 8


attention_varlen_op = op(
    "attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
    "int max_seqlen_k, bool causal=False, float? softmax_scale=None, int[]? window=None, float? softcap=None) "
    "-> (Tensor, Tensor)",
    _attention_varlen_impl, fake=_attention_varlen_fake, backward=_attention_varlen_backward,
    setup_context=_attention_varlen_save)


def _attention_varlen_backward_fake(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal, softmax_scale, deterministic, window=None, softcap=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, "attention_varlen_backward")
    _mask(causal, window, softcap, "attention_varlen_backward", True)
    return _like(q), _like(k), _like(v)


def _attention_varlen_backward_impl(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal, softmax_scale, deterministic, window, softcap):
    return _attention_backward_impl(do, q, k, v, o, lse, causal, softmax_scale, deterministic, window, softcap,
                                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


attention_varlen_backward_op = op(
    "attention_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal=False, "
    "float? softmax_scale=None, bool deterministic=False, int[]? window=None, float? softcap=None) "
    "-> (Tensor, Tensor, Tensor)",
    _attention_varlen_backward_impl, fake=_attention_varlen_backward_fake,
    backward=_NO_DOUBLE.format("rtk.attention_varlen_backward"))


# ---- matmul -----------------------------------------------------------------------------------
def _matmul_shape(a, b, trans_a, trans_b, where="matmul"):
    for name, t in (("a", a), ("b", b)):
        if t.dim() not in (2, 3):
            raise ConfigError(f"{where}: {name} has shape {tuple(t.shape)}; expected 2-D (rows, cols) or 3-D "
                              "(batch, rows, cols)", field=name, value=tuple(t.shape))
    if a.dtype != b.dtype or a.dtype not in _FLOAT:
        raise ConfigError(f"{where}: a is {a.dtype} and b is {b.dtype}; both must be float16, bfloat16 or float32",
                          field="dtype", value=(str(a.dtype), str(b.dtype)))
    m, k = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
    k2, n = (b.shape[-1], b.shape[-2]) if trans_b else (b.shape[-2], b.shape[-1])
    if k != k2:
        raise ConfigError(f"{where}: a is {m} x {k} and b is {k2} x {n} (after transposes); the inner sizes "
                          "must match", field="shape", value=(tuple(a.shape), tuple(b.shape)))
    ba = a.shape[0] if a.dim() == 3 else None
    bb = b.shape[0] if b.dim() == 3 else None
    if ba is None and bb is None:
        return (m, n)
    if ba is not None and bb is not None and ba != bb and ba != 1 and bb != 1:
        raise ConfigError(f"{where}: batch sizes differ (a: {ba}, b: {bb}); they must be equal or one must be 1",
                          field="shape", value=(tuple(a.shape), tuple(b.shape)))
    return (max(ba or 1, bb or 1), m, n)


def _matmul_fake(a, b, bias, activation, trans_a, trans_b):
    return _like(a, _matmul_shape(a, b, trans_a, trans_b))


def _matmul_save(ctx, args, out):
    a, b, bias, activation, trans_a, trans_b = args
    # relu' comes from the output (c > 0 exactly where z > 0); gelu' and silu' need the
    # pre-activation z = a @ b + bias, recomputed in backward (see _matmul_backward)
    ctx.save_for_backward(a, b, bias, out if activation == "relu" else None)
    ctx.activation, ctx.trans_a, ctx.trans_b = activation, trans_a, trans_b


def _mm(x, y, trans_x=False, trans_y=False):
    return _ops().matmul.default(x, y, None, None, trans_x, trans_y)


def matmul_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` if rtk.matmul reads it in place (one of the last two dims of unit stride), else a
    contiguous copy (an expanded or broadcast gradient)."""
    return t if (t.stride(-1) == 1 or t.stride(-2) == 1) else t.contiguous()


def _activation_grad(dc, z, activation):
    """dL/dz = dL/dc * act'(z), in float32, rounded to dc's dtype (what the GEMMs read)."""
    zf = z.float()
    if activation == "gelu":   # erf form, as the kernels' epilogue
        d = 0.5 * (1.0 + torch.erf(zf * (1.0 / math.sqrt(2.0)))) + zf * torch.exp(-0.5 * zf * zf) / math.sqrt(2 * math.pi)
    elif activation == "silu":
        s = torch.sigmoid(zf)
        d = s * (1.0 + zf * (1.0 - s))
    else:
        raise NotImplementedError(f"rtk.matmul backward: activation={activation!r}")
    return (dc.float() * d).to(dc.dtype)


def _reduce_batch(g, like):
    """Sum a gradient computed over the broadcast batch back to its operand's shape."""
    if g.dim() == like.dim() and g.shape[0] == like.shape[0]:
        return g
    return g.sum(0) if like.dim() == 2 else g.sum(0, keepdim=True)


def _matmul_backward(ctx, dc):
    """c = act(z), z = A' B' + bias with A' = a or a^T (trans_a), B' = b or b^T (trans_b):
    dz = dc * act'(z); dA' = dz B'^T; dB' = A'^T dz; dbias = dz summed over rows (and batch).
    Every product is an rtk.matmul with transpose flags, no transposed copies.

    For gelu and silu the pre-activation z is recomputed here by one more rtk.matmul (with the
    bias, no activation) rather than stored by the forward: storing it would cost an (M, N)
    tensor per layer for the whole backward and a second output the fused kernel does not
    write (the forward would have to drop the fused epilogue); recomputing costs one GEMM in
    the backward, 1.5x its FLOPs instead of 1x, the usual trade of fused-epilogue layers."""
    a, b, bias, out = ctx.saved_tensors
    act, ta, tb = ctx.activation, ctx.trans_a, ctx.trans_b
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    dz = matmul_operand(dc)
    if act == "relu":
        dz = dz * (out > 0).to(dz.dtype)
    elif act not in (None, "none"):
        z = _ops().matmul.default(a, b, bias, None, ta, tb)
        dz = _activation_grad(dz, z, act)
    da = db = dbias = None
    if need_a:
        # not trans_a: da = dz B'^T;  trans_a: da = (dz B'^T)^T = B' dz^T
        da = _mm(b, dz, tb, True) if ta else _mm(dz, b, False, not tb)
        da = _reduce_batch(da, a)
    if need_b:
        if not ta and a.dim() == 3 and b.dim() == 2 and dz.dim() == 3:
            # the linear-layer case: one (K, B*M) x (B*M, N) product instead of B products and a sum
            a2, dz2 = a.reshape(-1, a.shape[-1]), dz.reshape(-1, dz.shape[-1])
            db = _mm(dz2, a2, True, False) if tb else _mm(a2, dz2, True, False)
        else:
            # not trans_b: db = A'^T dz;  trans_b: db = dz^T A'
            db = _mm(dz, a, True, ta) if tb else _mm(a, dz, not ta, False)
            db = _reduce_batch(db, b)
    if need_bias and bias is not None:
        dbias = dz.sum(dim=tuple(range(dz.dim() - 1))).to(bias.dtype)
    return da, db, dbias, None, None, None


matmul_op = op("matmul(Tensor a, Tensor b, Tensor? bias=None, str? activation=None, bool trans_a=False, "
               "bool trans_b=False) -> Tensor",
               matmul_positional, fake=_matmul_fake, backward=_matmul_backward, setup_context=_matmul_save)


# ---- KV-cache attention (serving): the cache is written in place --------------------------------
# A mutating schema goes through torch.library.custom_op (version counters of k_cache / v_cache
# bumped, functionalization under torch.compile); it pays custom_op's Python layers on the host
# (the _library header) - eager decode loops that want the lean path call rtk.attention_kvcache on
# the same tensors, and a captured decode step pays none of it.
@torch.library.custom_op("rtk::attention_kvcache", mutates_args=("k_cache", "v_cache"), device_types="cuda",
                         tags=TAGS)
def attention_kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                         k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                         block_table: torch.Tensor | None = None, causal: bool = True,
                         softmax_scale: float | None = None,
                         num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _rtk.attention_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new,
                                  block_table=block_table, causal=causal, softmax_scale=softmax_scale,
                                  return_lse=True, num_splits=num_splits)


@attention_kvcache_op.register_fake
def _attention_kvcache_fake(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, block_table=None,
                            causal=True, softmax_scale=None, num_splits=None):
    where = "attention_kvcache"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.dtype not in _HALF or t.dtype != q.dtype:
            raise ConfigError(f"{where}: {name} is {t.dtype} {tuple(t.shape)}; q, k_cache, v_cache must be 4-D, all "
                              "float16 or all bfloat16", field=name, value=tuple(t.shape))
    h, d = q.shape[-2:]
    if tuple(k_cache.shape) != tuple(v_cache.shape) or k_cache.shape[-1] != d or h % max(1, k_cache.shape[-2]):
        raise ConfigError(f"{where}: k_cache / v_cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q "
                          f"{tuple(q.shape)} (same shape, head_dim {d}, nheads a multiple of nheads_kv)",
                          field="k_cache", value=tuple(k_cache.shape))
    if (k_new is None) != (v_new is None):
        raise ConfigError(f"{where}: k_new and v_new come together", field="v_new" if v_new is None else "k_new")
    b, s, h, _ = q.shape
    return _like(q), _like(q, (b, h, s), torch.float32)


# ---- weight-only quantized matmul --------------------------------------------------------------
_WEIGHT_TORCH = (torch.int8, torch.uint8, getattr(torch, "float8_e4m3fn", torch.uint8))
_FROZEN = ("rtk.quantized_matmul: the quantized weight is frozen - scales and zeros get no gradient (detach them, "
           "or train a separate adapter); x and bias do")


def _check_quant_weight(w_q, where: str) -> None:
    if w_q.dim() != 2 or w_q.dtype not in _WEIGHT_TORCH:
        raise ConfigError(f"{where}: w_q is {w_q.dtype} {tuple(w_q.shape)}; expected (N, K) int8, uint8 or "
                          "float8_e4m3fn", field="w_q", value=tuple(w_q.shape))


def _check_quant(x, w_q, where: str) -> None:
    """The layout rules of rtk.quantized_matmul (fakes too): x (..., K) float16 / bfloat16, w_q
    (N, K) 8-bit; scales, zeros, group_size and contents are the eager op's checks."""
    if x.dtype not in _HALF:
        raise ConfigError(f"{where}: x has dtype {x.dtype}; allowed: float16, bfloat16", field="dtype",
                          value=str(x.dtype))
    _check_quant_weight(w_q, where)
    if x.dim() < 1 or x.shape[-1] != w_q.shape[1]:
        raise ConfigError(f"{where}: x has shape {tuple(x.shape)}; expected (..., K) with K = {w_q.shape[1]} (w_q is "
                          f"{tuple(w_q.shape)})", field="x", value=tuple(x.shape))


def _quantized_matmul_fake(x, w_q, scales, group_size, zeros, bias, activation):
    _check_quant(x, w_q, "quantized_matmul")
    return _like(x, (*x.shape[:-1], w_q.shape[0]))


def _quantized_matmul_impl(x, w_q, scales, group_size, zeros, bias, activation):
    return _rtk.quantized_matmul(x, w_q, scales, group_size=group_size, zeros=zeros, bias=bias, activation=activation)


def _quantized_matmul_save(ctx, args, out):
    x, w_q, scales, group_size, zeros, bias, activation = args
    ctx.save_for_backward(x, w_q, scales, zeros, bias, out if activation == "relu" else None)
    ctx.group_size, ctx.activation = group_size, activation


def _quantized_matmul_backward(ctx, dy):
    """y = act(z), z = x W^T + bias with W = dequant(w_q): dz = dy * act'(z); dx = dz W (the weight
    dequantized to x's dtype by torch.ops.rtk.dequantize_weight, then rtk.matmul); dbias = dz summed
    over rows.  gelu / silu recompute z with one more quantized_matmul (as rtk.matmul's backward)."""
    x, w_q, scales, zeros, bias, out = ctx.saved_tensors
    need = ctx.needs_input_grad
    if need[2] or need[4]:
        raise NotImplementedError(_FROZEN)
    act = ctx.activation
    dz = dy if dy.is_contiguous() else dy.contiguous()
    if act == "relu":
        dz = dz * (out > 0).to(dz.dtype)
    elif act not in (None, "none"):
        dz = _activation_grad(dz, _ops().quantized_matmul.default(x, w_q, scales, ctx.group_size, zeros, bias, None),
                              act)
    n = w_q.shape[0]
    dx = dbias = None
    if need[0]:
        w = _ops().dequantize_weight.default(w_q, scales, x.dtype, ctx.group_size, zeros)
        dx = _mm(dz.reshape(-1, n), w).reshape(x.shape)
    if need[5] and bias is not None:
        dbias = dz.reshape(-1, n).float().sum(0).to(bias.dtype)
    return dx, None, None, None, None, dbias, None


quantized_matmul_op = op(
    "quantized_matmul(Tensor x, Tensor w_q, Tensor scales, int? group_size=None, Tensor? zeros=None, "
    "Tensor? bias=None, str? activation=None) -> Tensor",
    _quantized_matmul_impl, fake=_quantized_matmul_fake, backward=_quantized_matmul_backward,
    setup_context=_quantized_matmul_save)


def _dequantize_weight_fake(w_q, scales, dtype, group_size, zeros):
    _check_quant_weight(w_q, "dequantize_weight")
    if dtype not in _HALF:
        raise ConfigError(f"dequantize_weight: dtype={dtype}; allowed: float16, bfloat16", field="dtype",
                          value=str(dtype))
    return _like(w_q, None, dtype)


dequantize_weight_op = op(
    "dequantize_weight(Tensor w_q, Tensor scales, ScalarType dtype, int? group_size=None, Tensor? zeros=None) "
    "-> Tensor",
    lambda w_q, scales, dtype, group_size, zeros: _rtk.dequantize_weight(
        w_q, scales, group_size=group_size, zeros=zeros, dtype=str(dtype).removeprefix("torch.")),
    fake=_dequantize_weight_fake,
    backward="rtk.dequantize_weight has no backward (the quantized weight is frozen)")


# ---- row ops: softmax, rmsnorm, layernorm, reduce ---------------------------------------------
# Backward kernels: rtk.softmax_backward / rmsnorm_backward / layernorm_backward, each also a torch op
# (torch.ops.rtk.*_backward) that the forward's backward calls, so AOTAutograd traces it.
def _check_rows(x, where):
    if x.dim() == 0:
        raise ConfigError(f"{where}: x must have at least one dimension, got a scalar", field="x")
    if x.dtype not in _FLOAT:
        raise ConfigError(f"{where}: x has dtype {x.dtype}; allowed: float16, bfloat16, float32", field="dtype",
                          value=str(x.dtype))


def _check_dy(dy, like, where, like_name="x"):
    """The backward ops' rule (checked on fakes too): dy has the forward input's shape and dtype."""
    _check_rows(like, where)
    if tuple(dy.shape) != tuple(like.shape) or dy.dtype != like.dtype:
        raise ConfigError(f"{where}: dy must be a {like.dtype} tensor of shape {tuple(like.shape)} ({like_name}'s), "
                          f"got {dy.dtype} {tuple(dy.shape)}", field="dy", value=tuple(dy.shape))


def _grad_rows(dy: torch.Tensor) -> torch.Tensor:
    """An incoming gradient as the backward kernels read it: dy itself when contiguous, else a torch
    copy (the gradient of a sum arrives expanded from a scalar; rtk would compact such a view with
    CuPy, outside torch's allocator and a CUDA-graph capture's memory pool)."""
    return dy if dy.is_contiguous() else dy.contiguous()


def _softmax_fake(x, log_softmax):
    _check_rows(x, "softmax")
    return _like(x)


def _softmax_save(ctx, args, out):
    ctx.save_for_backward(out)
    ctx.log_softmax = args[1]


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return _ops().softmax_backward.default(_grad_rows(dy), y, ctx.log_softmax), None


softmax_op = op("softmax(Tensor x, bool log_softmax=False) -> Tensor",
                lambda x, log_softmax: _rtk.softmax(x, log_softmax=log_softmax),
                fake=_softmax_fake, backward=_softmax_backward, setup_context=_softmax_save)


def _norm_fake(x, weight, *rest):
    _check_rows(x, "rmsnorm" if len(rest) == 1 else "layernorm")
    return _like(x)


def _norm_save(ctx, args, out):
    # The backward recomputes the row statistics instead of saving the forward's (return_stats):
    # it reads all of x anyway and the statistics ride its one row reduction, so that costs no
    # bandwidth (H100, tools/bench_training.py: recomputing 0.99-1.01x the time of given stats
    # at n = 1k-16k; layernorm at n = 16k 1.13x), and the forward ops keep one output.
    ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])
    ctx.eps = args[-1]


def _rmsnorm_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = _ops().rmsnorm_backward.default(_grad_rows(dy), x, w, None, ctx.eps)
    return dx, dw if ctx.needs_input_grad[1] else None, None


def _layernorm_backward(ctx, dy):
    x, w, b = ctx.saved_tensors
    dx, dw, db = _ops().layernorm_backward.default(_grad_rows(dy), x, w, b, None, None, ctx.eps)
    need = ctx.needs_input_grad
    return dx, dw if need[1] else None, db if need[2] else None, None


rmsnorm_op = op("rmsnorm(Tensor x, Tensor weight, float eps=1e-06) -> Tensor",
                lambda x, weight, eps: _rtk.rmsnorm(x, weight, eps),
                fake=_norm_fake, backward=_rmsnorm_backward, setup_context=_norm_save)
layernorm_op = op("layernorm(Tensor x, Tensor weight, Tensor bias, float eps=1e-05) -> Tensor",
                  lambda x, weight, bias, eps: _rtk.layernorm(x, weight, bias, eps),
                  fake=_norm_fake, backward=_layernorm_backward, setup_context=_norm_save)


def _softmax_backward_fake(dy, y, log):
    _check_dy(dy, y, "softmax_backward", "y")
    return _like(y)


def _rmsnorm_backward_fake(dy, x, weight, rstd, eps):
    _check_dy(dy, x, "rmsnorm_backward")
    return _like(x), _like(weight)


def _layernorm_backward_fake(dy, x, weight, bias, mean, rstd, eps):
    _check_dy(dy, x, "layernorm_backward")
    return _like(x), _like(weight), _like(weight)   # dbias in weight's dtype (bias must share it)


_NO_DOUBLE = "rtk.{} has no backward (double backward through it is not supported)"
softmax_backward_op = op("softmax_backward(Tensor dy, Tensor y, bool log=False) -> Tensor",
                         lambda dy, y, log: _rtk.softmax_backward(dy, y, log=log),
                         fake=_softmax_backward_fake, backward=_NO_DOUBLE.format("softmax_backward"))
rmsnorm_backward_op = op(
    "rmsnorm_backward(Tensor dy, Tensor x, Tensor weight, Tensor? rstd=None, float eps=1e-06) -> (Tensor, Tensor)",
    lambda dy, x, weight, rstd, eps: _rtk.rmsnorm_backward(dy, x, weight, rstd, eps=eps),
    fake=_rmsnorm_backward_fake, backward=_NO_DOUBLE.format("rmsnorm_backward"))
layernorm_backward_op = op(
    "layernorm_backward(Tensor dy, Tensor x, Tensor weight, Tensor bias, Tensor? mean=None, Tensor? rstd=None, "
    "float eps=1e-05) -> (Tensor, Tensor, Tensor)",
    lambda dy, x, weight, bias, mean, rstd, eps: _rtk.layernorm_backward(dy, x, weight, bias, mean, rstd, eps=eps),
    fake=_layernorm_backward_fake, backward=_NO_DOUBLE.format("layernorm_backward"))


def _reduce_fake(x, op_name):
    _check_rows(x, f"reduce({op_name})")
    return _like(x, tuple(x.shape[:-1]), torch.int64 if op_name == "argmax" else x.dtype)


def _reduce_save(ctx, args, out):
    ctx.op_name = args[1]
    ctx.x_shape = tuple(args[0].shape)


def _reduce_backward(ctx, dy):
    if ctx.op_name != "sum":
        raise NotImplementedError(f"rtk.reduce(op={ctx.op_name!r}) has no backward; only op='sum' does")
    return dy.unsqueeze(-1).expand(ctx.x_shape), None


reduce_op = op('reduce(Tensor x, str op="sum") -> Tensor',
               lambda x, op_name: _rtk.reduce(x, op=op_name),
               fake=_reduce_fake, backward=_reduce_backward, setup_context=_reduce_save)


# ---- cross-entropy ------------------------------------------------------------------------------
# Two ops over one kernel: cross_entropy (the loss) and cross_entropy_with_grad ((loss, dlogits):
# the gradient of the reduced loss written in the same pass over the logits, saved for the
# backward, which only scales it by the incoming gradient).  rtkernels.torch.cross_entropy picks
# the second when the logits require grad; the first's own backward (a direct torch.ops call with
# grad) reruns the fused kernel: one more read of the logits.
_REDUCTIONS = ("none", "sum", "mean")


def _cross_entropy_fake(logits, target, ignore_index, label_smoothing, reduction):
    where = "cross_entropy"
    if logits.dim() == 0 or logits.dtype not in _FLOAT:
        raise ConfigError(f"{where}: logits must be float16, bfloat16 or float32 with at least one dimension, got "
                          f"{logits.dtype} {tuple(logits.shape)}", field="logits", value=tuple(logits.shape))
    lead = tuple(logits.shape[:-1])
    if target.dtype not in (torch.int64, torch.int32) or tuple(target.shape) != lead:
        raise ConfigError(f"{where}: target must be int64 or int32 of shape {lead} (logits.shape[:-1]), got "
                          f"{target.dtype} {tuple(target.shape)}", field="target", value=tuple(target.shape))
    if reduction not in _REDUCTIONS:
        raise ConfigError(f"{where}: reduction={reduction!r} is not allowed; use one of "
                          f"{', '.join(map(repr, _REDUCTIONS))}", field="reduction", value=reduction)
    return _like(logits, lead if reduction == "none" else (), torch.float32)


def _cross_entropy_with_grad_fake(logits, target, ignore_index, label_smoothing, reduction):
    return _cross_entropy_fake(logits, target, ignore_index, label_smoothing, reduction), _like(logits)


def _scaled_ce_grad(g, dloss, reduction):
    """dlogits = g * dloss: g is d(reduced loss)/dlogits ("none": d loss[i] / d logits[i] per row),
    dloss the incoming gradient (0-d, or one per token for "none"), applied in g's dtype."""
    return g * (dloss.unsqueeze(-1) if reduction == "none" else dloss).to(g.dtype)


def _cross_entropy_save(ctx, args, out):
    logits, target, ignore_index, label_smoothing, reduction = args
    ctx.save_for_backward(logits, target)
    ctx.options = (ignore_index, label_smoothing, reduction)


def _cross_entropy_backward(ctx, dloss):
    logits, target = ctx.saved_tensors
    _, g = _ops().cross_entropy_with_grad.default(logits, target, *ctx.options)
    return _scaled_ce_grad(g, dloss, ctx.options[2]), None, None, None, None


def _cross_entropy_with_grad_save(ctx, args, out):
    _, g = out
    ctx.mark_non_differentiable(g)
    ctx.save_for_backward(g)
    ctx.reduction = args[4]


def _cross_entropy_with_grad_backward(ctx, dloss, _dg):
    (g,) = ctx.saved_tensors
    return _scaled_ce_grad(g, dloss, ctx.reduction), None, None, None, None


_CE_ARGS = "Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0, str reduction=\"mean\""
cross_entropy_op = op(
    f"cross_entropy({_CE_ARGS}) -> Tensor",
    lambda logits, target, ignore_index, label_smoothing, reduction: _rtk.cross_entropy(
        logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction),
    fake=_cross_entropy_fake, backward=_cross_entropy_backward, setup_context=_cross_entropy_save)
cross_entropy_with_grad_op = op(
    f"cross_entropy_with_grad({_CE_ARGS}) -> (Tensor, Tensor)",
    lambda logits, target, ignore_index, label_smoothing, reduction: _rtk.cross_entropy(
        logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
        return_grad=True),
    fake=_cross_entropy_with_grad_fake, backward=_cross_entropy_with_grad_backward,
    setup_context=_cross_entropy_with_grad_save)


# ---- elementwise --------------------------------------------------------------------------------
# An expression is a static argument (a string in the graph); the inputs travel as one tensor list
# plus the scalars and their positions in the expression's input order.
@functools.lru_cache(maxsize=256)
def elementwise_function(expr: str, outputs: tuple, out_dtype: str | None):
    """The rtk.elementwise kernel family of one expression (parsed once per process)."""
    return _rtk.elementwise(expr, outputs=outputs or None, out_dtype=out_dtype)


def _merge(tensors, scalars, positions):
    args = list(tensors)
    for pos, s in sorted(zip(positions, scalars)):
        args.insert(pos, s)
    return args


_EXTERNAL_STREAMS: dict = {}


def _cupy_stream_of_torch(t: torch.Tensor):
    """A context making torch's current stream CuPy's current one (a no-op when they already are).
    rtk.elementwise views torch tensors as CuPy arrays; when the two libraries' current streams
    differ (a torch side stream, a CUDA-graph capture) it would fall back to DLPack, whose
    exchange makes CuPy's stream wait on torch's - an illegal cross-stream dependency during a
    capture.  With one stream there is nothing to order."""
    import cupy
    from ..ops._arrays import torch_stream_ptr
    dev = t.get_device()
    ptr = torch_stream_ptr(torch, dev)
    if ptr == cupy.cuda.get_current_stream().ptr:
        return contextlib.nullcontext()
    s = _EXTERNAL_STREAMS.get((dev, ptr))
    if s is None:
        if len(_EXTERNAL_STREAMS) > 64:
            _EXTERNAL_STREAMS.clear()
        s = _EXTERNAL_STREAMS[(dev, ptr)] = cupy.cuda.ExternalStream(ptr, dev)
    return s


def _elementwise_impl(expr, tensors, scalars, positions, outputs, out_dtype):
    f = elementwise_function(expr, tuple(outputs or ()), out_dtype)
    with _cupy_stream_of_torch(tensors[0]) if tensors else contextlib.nullcontext():
        res = f(*_merge(tensors, scalars, positions))
    return [res] if isinstance(res, torch.Tensor) else list(res)


_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64}


def _elementwise_fake(expr, tensors, scalars, positions, outputs, out_dtype):
    f = elementwise_function(expr, tuple(outputs or ()), out_dtype)
    if len(tensors) + len(scalars) != len(f.input_names):
        raise TypeError(f"elementwise {expr!r} takes {len(f.input_names)} inputs ({', '.join(f.input_names)}), got "
                        f"{len(tensors) + len(scalars)}")
    if not tensors:
        raise ConfigError("elementwise: at least one input must be an array")
    first = tensors[0]
    for name, t in zip(f.input_names, tensors):
        if tuple(t.shape) != tuple(first.shape):
            raise ConfigError(f"elementwise: input {name} has shape {tuple(t.shape)}, expected {tuple(first.shape)} "
                              "(arrays must have equal shapes; only scalars broadcast)")
    if f.out_dtype is not None:
        dt = _TORCH_DTYPES[f.out_dtype]
    else:
        dts = {t.dtype for t in tensors}
        dt = first.dtype if len(dts) == 1 else torch.float64 if torch.float64 in dts else torch.float32
    return [_like(first, dtype=dt) for _ in f.output_names]


elementwise_op = op("elementwise(str expr, Tensor[] tensors, float[] scalars, int[] scalar_positions, "
                    "str[]? outputs=None, str? out_dtype=None) -> Tensor[]",
                    _elementwise_impl, fake=_elementwise_fake,
                    backward="rtk.elementwise has no backward: an expression's derivative is not derived "
                             "automatically (compute it under torch.no_grad(), or write the backward as another "
                             "expression in a torch.autograd.Function)")
