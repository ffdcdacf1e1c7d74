"""Attention with variable-length batches, sliding windows and softcap: rtk against its peers, same run.

Three modes (``tools/bench_attention.py --varlen | --window | --softcap`` lands here too):

--varlen   packed batches of causal sequences with lengths drawn log-uniformly from 64-8192 until
           --tokens (16k, 32k, 64k) are reached, hidden 2048 (nheads = 2048 / head_dim, no GQA):
           rtk varlen; torch.nn.attention.varlen.varlen_attn; FlashAttention-4's
           flash_attn_varlen_func when importable; and at equal FLOPs the dense layout at the batch's
           mean length (rtk dense and SDPA cuDNN): varlen TFLOP/s against dense TFLOP/s.
--window   one 32k sequence, causal sliding window (4096, 0): rtk, FA4 flash_attn_func(window_size=)
           when importable, torch varlen_attn(window_size=) when it takes one, and rtk dense
           non-causal over 32k / (left + 1) sequences of left + 1 tokens (about the window's FLOPs):
           ``vs_dense_time`` is the window's time over that dense time scaled to equal FLOPs
           (target <= 1.15).
--softcap  FlashAttention's grid at seqlen 4096 (16k tokens, hidden 2048), softcap 50 vs none: rtk,
           FA4 flash_attn_func(softcap=) when importable; ``softcap_ratio`` = TFLOP/s with / without;
           --variants times the Hopper forward's fixed_max x exp2_poly variants against the same plain call.

TFLOP/s count only the unmasked pairs: 4 * head_dim * nheads * (visible (query, key) pairs), the pairs
counted row by row from the same mask spec the kernels get (rtkernels.ops.attention_mask.visible_pairs).
--backward times the backward (dq, dk, dv from do) instead: 2.5x the forward's FLOPs.  Kernels are timed
back to back (benchutil.time_batched: the host's launch cost hides behind the GPU work); each peer's
output is compared with rtk's once (max abs difference) before it is timed.

    PYTHONPATH=. python tools/bench_attention_masks.py --varlen --window --softcap --out $OUT [--quick]

--bwd-alt NAME=VALUE[,...] (--varlen --backward): also time the Hopper backward with these fields of
its dispatched config replaced (e.g. ``block_m=128``), on the varlen batch and on its dense twin,
interleaved with the default config round by round (``benchutil.time_batched`` per round, the
median of the rounds): columns rtk_alt_tflops, alt_ratio (alt / default), rtk_dense_alt_tflops,
dense_alt_ratio, alt_varlen_vs_dense; cells whose config rejects the fields are left empty.
"""
from __future__ import annotations

import inspect
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402

HIDDEN = 2048


# ---- inputs and FLOPs ------------------------------------------------------------------------------
def length_mix(rng, tokens: int, lo: int = 64, hi: int = 8192) -> list[int]:
    """Log-uniform lengths in [lo, hi] until ``tokens`` are reached (the last one trimmed, >= lo)."""
    lens = []
    while sum(lens) < tokens:
        n = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        lens.append(max(lo, min(n, tokens - sum(lens))) if tokens - sum(lens) >= lo else lo)
    return lens


def _flops(mask, lens_q, lens_k, nheads, head_dim, backward):
    from rtkernels.ops.attention_mask import visible_pairs
    pairs = sum(visible_pairs(mask, lq, lk) for lq, lk in zip(lens_q, lens_k))
    return 4.0 * head_dim * nheads * pairs * (2.5 if backward else 1.0)


def _randn(torch, shape, dtype):
    import cupy as cp
    if torch is not None:
        return torch.randn(shape, device="cuda", dtype=getattr(torch, dtype))
    x = cp.random.standard_normal(shape, dtype=cp.float32)
    return ((x.view(cp.uint32) + 0x8000) >> 16).astype(cp.uint16) if dtype == "bfloat16" else x.astype(dtype)


def _maxdiff(a, b, torch):
    import cupy as cp
    if a is None or b is None:
        return None
    if torch is not None:
        return float((a.float() - b.float()).abs().max())
    return float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max())


# ---- launchers: each returns (run, output) or (None, reason) ----------------------------------------
# The backward's output gradient of the last rtk call per q shape: the peers' backward gets the same
# one, so their *_maxdiff compares the same computation (dq) rather than two random gradients.
_SHARED_DO = {}


def _rtk(q, k, v, dtype, torch, backward, bwd_config=None, **kw):
    """rtk.attention (and its backward, with ``bwd_config`` when given) over prepared arrays."""
    from rtkernels.ops.attention import attention
    from rtkernels.ops.attention_bwd import attention_backward
    extra = {"dtype": "bfloat16"} if (torch is None and dtype == "bfloat16") else {}
    o, lse = attention(q, k, v, **kw, **extra)
    if not backward:
        return (lambda: attention(q, k, v, out=o, **kw, **extra)), o
    do = _SHARED_DO.get(tuple(q.shape)) if bwd_config is not None else None   # the alt: the default's dO
    if do is None:
        do = _SHARED_DO[tuple(q.shape)] = _randn(torch, tuple(q.shape), dtype)
    bkw = {n: kw[n] for n in kw if n not in ("return_lse",)}
    if bwd_config is not None:   # (the op checks deterministic against the config's)
        bkw.update(config=bwd_config, deterministic=bwd_config.deterministic)
    grads = attention_backward(do, q, k, v, o, lse, **bkw, **extra)
    return (lambda: attention_backward(do, q, k, v, o, lse, dq=grads[0], dk=grads[1], dv=grads[2], **bkw,
                                       **extra)), grads[0]


def _torch_autograd(fn, q, k, v, torch, backward):
    """(run, output) of a torch attention function, forward or backward (the backward timed alone on
    the kept graph: benchutil.autograd_timers)."""
    try:
        if not backward:
            out = bu.first(fn(q, k, v))
            return (lambda: fn(q, k, v)), out
        do = _SHARED_DO.get(tuple(q.shape))
        out = bu.first(fn(q, k, v))
        do = do.reshape(out.shape) if do is not None and do.numel() == out.numel() else None
        bwd, _, grads = bu.autograd_timers(fn, tuple(x.detach().requires_grad_() for x in (q, k, v)), do)
        return bwd, grads[0]
    except Exception as exc:   # a peer that refuses the shape, dtype, GPU or option
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:90] if str(exc) else ''}"


def _torch_varlen(torch, cu_q, cu_k, max_q, max_k, causal, window=None):
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if "window_size" in params:
        left, right = window if window is not None else (-1, 0 if causal else -1)
        kw["window_size"] = (left, right)
    elif window is not None:
        return None   # this torch has no windows
    elif "is_causal" in params:
        kw["is_causal"] = causal
    return lambda q, k, v: varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def _time(run, row, name, flops, warmup, repeat):
    ms = bu.time_batched(run, warmup=warmup, repeat=repeat)
    row[f"{name}_ms"] = ms
    row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
    return ms


def _interleaved(runs: dict, row, flops, warmup, repeat, rounds: int = 3) -> None:
    """Time the candidates ``runs`` (name -> run) round by round, each round every candidate in
    turn (a clock or thermal drift hits them alike): {name}_ms = the median of its rounds."""
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name, run in runs.items():
            times[name].append(bu.time_batched(run, warmup=warmup if r == 0 else 1, repeat=max(3, repeat // rounds)))
    for name, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12


def _bwd_alt(args, d, causal, flags):
    """The varlen (or dense) Hopper backward config the op dispatches, with --bwd-alt's fields; None
    without --bwd-alt, off sm_90 or where the config rejects them."""
    if not (args.bwd_alt and args.backward):
        return None
    import cupy as cp
    from rtkernels.errors import ConfigError
    from rtkernels.ops import attention_bwd_sm90 as B90
    from rtkernels.ops.attention import _device_arch
    if not B90.is_sm90(_device_arch(cp.cuda.runtime.getDevice())):
        return None
    changes = {}
    for item in args.bwd_alt.split(","):
        name, _, value = item.partition("=")
        changes[name] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    try:
        return B90.choose_config(args.dtype, d, causal, bool(changes.get("deterministic", False)),
                                 **flags).replace(**changes)
    except (ConfigError, TypeError):
        return None


def _peer(row, name, made, ref_out, torch, flops, warmup, repeat):
    run, out = made
    if run is None:
        row[f"{name}_note"] = out
        return None
    row[f"{name}_maxdiff"] = _maxdiff(out, ref_out, torch)
    ms = _time(run, row, name, flops, warmup, repeat)
    row[f"ratio_vs_{name}"] = row["rtk_tflops"] / row[f"{name}_tflops"]
    return ms


# ---- modes -----------------------------------------------------------------------------------------
def bench_varlen(args, torch, warmup, repeat):
    import numpy as np
    from rtkernels.ops.attention_mask import mask_spec
    _, fa4_varlen = bu.fa4()
    rows = []
    for d in args.head_dims:
        h = HIDDEN // d
        for tokens in args.tokens:
            rng = np.random.default_rng(tokens + d)
            lens = length_mix(rng, tokens)
            cu_np = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            total, longest = int(cu_np[-1]), max(lens)
            if torch is not None:
                cu = torch.tensor(cu_np, device="cuda")
            else:
                import cupy as cp
                cu = cp.asarray(cu_np)
            q, k, v = (_randn(torch, (total, h, d), args.dtype) for _ in range(3))
            mask = mask_spec(True)
            flops = _flops(mask, lens, lens, h, d, args.backward)
            row = {"mode": "varlen", "head_dim": d, "tokens": total, "seqs": len(lens),
                   "mean_len": round(total / len(lens)), "max_len": longest}
            kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
            run, out = _rtk(q, k, v, args.dtype, torch, args.backward, **kw)
            alt = _bwd_alt(args, d, True, dict(is_varlen=True))
            if alt is None:
                _time(run, row, "rtk", flops, warmup, repeat)
            else:
                arun, aout = _rtk(q, k, v, args.dtype, torch, args.backward, bwd_config=alt, **kw)
                row["alt_config"] = f"block_m={alt.block_m}" + (" det" if alt.deterministic else "")
                row["alt_maxdiff"] = _maxdiff(aout, out, torch)
                _interleaved({"rtk": run, "rtk_alt": arun}, row, flops, warmup, repeat)
                row["alt_ratio"] = row["rtk_alt_tflops"] / row["rtk_tflops"]
            if torch is not None:
                fn = _torch_varlen(torch, cu, cu, longest, longest, True)
                _peer(row, "torch_varlen", _torch_autograd(fn, q, k, v, torch, args.backward) if fn else
                      (None, "no torch.nn.attention.varlen"), out, torch, flops, warmup, repeat)
                if fa4_varlen is not None:
                    fn = lambda a, b, c: fa4_varlen(a, b, c, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,  # noqa: E731
                                                    max_seqlen_k=longest, causal=True)
                    _peer(row, "fa4", _torch_autograd(fn, q, k, v, torch, args.backward), out, torch, flops, warmup,
                          repeat)
                    if row.get("fa4_tflops") and "rtk_alt_tflops" in row:
                        row["alt_vs_fa4"] = row["rtk_alt_tflops"] / row["fa4_tflops"]
            # the dense layout at the batch's mean length: the same kind of work without varlen
            s = max(64, round(total / len(lens) / 64) * 64)
            b = max(1, total // s)
            dq_, dk_, dv_ = (_randn(torch, (b, s, h, d), args.dtype) for _ in range(3))
            dflops = _flops(mask, [s] * b, [s] * b, h, d, args.backward)
            drow = {}
            drun, dout = _rtk(dq_, dk_, dv_, args.dtype, torch, args.backward, causal=True)
            dalt = _bwd_alt(args, d, True, {})
            if dalt is None:
                _time(drun, drow, "dense", dflops, warmup, repeat)
            else:
                darun, _ = _rtk(dq_, dk_, dv_, args.dtype, torch, args.backward, bwd_config=dalt, causal=True)
                _interleaved({"dense": drun, "dense_alt": darun}, drow, dflops, warmup, repeat)
                row["rtk_dense_alt_tflops"] = drow["dense_alt_tflops"]
                row["dense_alt_ratio"] = drow["dense_alt_tflops"] / drow["dense_tflops"]
                if "rtk_alt_tflops" in row:
                    row["alt_varlen_vs_dense"] = row["rtk_alt_tflops"] / drow["dense_alt_tflops"]
            row["dense_shape"] = f"{b}x{s}"
            row["rtk_dense_tflops"] = drow["dense_tflops"]
            row["varlen_vs_dense"] = row["rtk_tflops"] / drow["dense_tflops"]
            if torch is not None:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                F = torch.nn.functional

                def cudnn(a, b_, c):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(a.transpose(1, 2), b_.transpose(1, 2), c.transpose(1, 2),
                                                              is_causal=True).transpose(1, 2)
                made = _torch_autograd(cudnn, dq_, dk_, dv_, torch, args.backward)
                if made[0] is not None:
                    crow = {}
                    _time(made[0], crow, "c", dflops, warmup, repeat)
                    row["sdpa_cudnn_dense_tflops"] = crow["c_tflops"]
                else:
                    row["sdpa_cudnn_note"] = made[1]
            rows.append(row)
            print(row, flush=True)
            del q, k, v, dq_, dk_, dv_
    return rows, ["head_dim", "tokens", "seqs", "mean_len", "rtk_tflops", "rtk_alt_tflops", "alt_ratio",
                  "torch_varlen_tflops", "fa4_tflops", "ratio_vs_torch_varlen", "ratio_vs_fa4", "alt_vs_fa4",
                  "dense_shape", "rtk_dense_tflops", "rtk_dense_alt_tflops", "dense_alt_ratio", "varlen_vs_dense",
                  "alt_varlen_vs_dense", "sdpa_cudnn_dense_tflops"]


def bench_window(args, torch, warmup, repeat):
    from rtkernels.ops.attention_mask import mask_spec
    fa4_dense, _ = bu.fa4()
    rows = []
    s, (left, right) = args.window_seqlen, args.window
    for d in args.head_dims:
        h = HIDDEN // d
        q, k, v = (_randn(torch, (1, s, h, d), args.dtype) for _ in range(3))
        mask = mask_spec(True, (left, right))
        flops = _flops(mask, [s], [s], h, d, args.backward)
        row = {"mode": "window", "head_dim": d, "seqlen": s, "window": f"({left}, {right})"}
        run, out = _rtk(q, k, v, args.dtype, torch, args.backward, causal=True, window=(left, right))
        ms = _time(run, row, "rtk", flops, warmup, repeat)
        if torch is not None:
            if fa4_dense is not None:
                fn = lambda a, b, c: fa4_dense(a, b, c, causal=True, window_size=(left, right))  # noqa: E731
                _peer(row, "fa4", _torch_autograd(fn, q, k, v, torch, args.backward), out, torch, flops, warmup,
                      repeat)
            cu = torch.tensor([0, s], dtype=torch.int32, device="cuda")
            fn = _torch_varlen(torch, cu, cu, s, s, True, (left, right))
            if fn is not None:   # one packed sequence: (s, h, d) views of the (1, s, h, d) arrays
                _peer(row, "torch_varlen", _torch_autograd(lambda a, b, c: fn(a[0], b[0], c[0]), q, k, v, torch,
                                                           args.backward), out, torch, flops, warmup, repeat)
        # the window's FLOPs as a dense non-causal problem: (s / w) sequences of w = left + 1 keys
        w = left + 1
        b = max(1, s // w)
        dq_, dk_, dv_ = (_randn(torch, (b, w, h, d), args.dtype) for _ in range(3))
        dflops = _flops(mask_spec(False), [w] * b, [w] * b, h, d, args.backward)
        drow = {}
        drun, _ = _rtk(dq_, dk_, dv_, args.dtype, torch, args.backward)
        dms = _time(drun, drow, "dense", dflops, warmup, repeat)
        row["dense_equal_flops_tflops"] = drow["dense_tflops"]
        row["vs_dense_time"] = ms / (dms * flops / dflops)
        rows.append(row)
        print(row, flush=True)
        del q, k, v, dq_, dk_, dv_
    return rows, ["head_dim", "seqlen", "window", "rtk_tflops", "fa4_tflops", "ratio_vs_fa4", "torch_varlen_tflops",
                  "dense_equal_flops_tflops", "vs_dense_time"]


class _exp2_poly:
    """RTKERNELS_SM90_EXP2_POLY set to ``poly`` (None: unset) and RTKERNELS_SM90_SOFTCAP_FIXED_MAX to
    ``fixed`` (None: unset) while inside (the Hopper forward's exp2_poly and fixed_max knobs), with the
    memoized kernels and launch plans dropped on the way in and out."""

    def __init__(self, poly, fixed=None):
        self.poly, self.fixed, self.old = poly, fixed, None
        self.names = {"RTKERNELS_SM90_EXP2_POLY": poly, "RTKERNELS_SM90_SOFTCAP_FIXED_MAX": fixed}

    def _drop(self):
        from rtkernels.ops import attention as att
        from rtkernels.ops import attention_sm90 as sm90
        att._KERNELS.clear()
        sm90._KERNELS.clear()
        att._FORWARD_PLANS.clear()

    def __enter__(self):
        self.old = {n: os.environ.get(n) for n in self.names}
        for n, val in self.names.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = str(val)
        self._drop()

    def __exit__(self, *exc):
        for n, old in self.old.items():
            if old is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = old
        self._drop()


def _sm90_tile(dtype, d, causal, softcap):
    """The Hopper forward's config for this call, short: 'BMxBN ov pp pN fixed' (what a variant ran)."""
    from rtkernels.ops import attention_sm90 as sm90
    flags = {"has_softcap": True} if softcap else {}
    if softcap and sm90.softcap_fixed_max(dtype, softcap, d, causal):
        flags["fixed_max"] = True
    c = sm90.choose_config(dtype, d, causal, **flags)
    return (f"{c.block_m}x{c.block_n}" + (" ov" if c.intra_overlap else "") + (" pp" if c.pingpong else "")
            + f" p{c.exp2_poly}" + (" fixed" if c.fixed_max else ""))


def bench_softcap(args, torch, warmup, repeat):
    from rtkernels.ops.attention_mask import mask_spec
    fa4_dense, _ = bu.fa4()
    rows = []
    s = args.softcap_seqlen
    b = max(1, 16384 // s)
    for d in args.head_dims:
        h = HIDDEN // d
        for causal in (False, True):
            q, k, v = (_randn(torch, (b, s, h, d), args.dtype) for _ in range(3))
            flops = _flops(mask_spec(causal), [s] * b, [s] * b, h, d, args.backward)
            row = {"mode": "softcap", "head_dim": d, "causal": causal, "seqlen": s, "softcap": args.softcap}
            run, out = _rtk(q, k, v, args.dtype, torch, args.backward, causal=causal, softcap=args.softcap)
            _time(run, row, "rtk", flops, warmup, repeat)
            plain, _ = _rtk(q, k, v, args.dtype, torch, args.backward, causal=causal)
            prow = {}
            _time(plain, prow, "p", flops, warmup, repeat)
            row["rtk_nocap_tflops"] = prow["p_tflops"]
            row["softcap_ratio"] = row["rtk_tflops"] / prow["p_tflops"]
            row["rtk_tile"] = _sm90_tile(args.dtype, d, causal, args.softcap)
            for poly in args.exp2_poly:   # the sm_90 forward's exp2_poly knob, softcap and plain
                with _exp2_poly(poly):
                    for name, kw in (("cap", {"softcap": args.softcap}), ("nocap", {})):
                        r = {}
                        made, _ = _rtk(q, k, v, args.dtype, torch, args.backward, causal=causal, **kw)
                        _time(made, r, "x", flops, warmup, repeat)
                        row[f"{name}_poly{poly}_tflops"] = r["x_tflops"]
            # the fixed_max knob (0: the running max) x exp2_poly ("d": the heuristic's share), softcap only;
            # each variant's ratio to the plain call timed above, and the config it ran
            for fixed, poly in args.variants:
                with _exp2_poly(None if poly == "d" else int(poly), fixed):
                    r = {}
                    made, o_var = _rtk(q, k, v, args.dtype, torch, args.backward, causal=causal,
                                       softcap=args.softcap)
                    tag = f"fm{fixed}_p{poly}"
                    row[f"{tag}_maxdiff"] = _maxdiff(o_var, out, torch)
                    _time(made, r, "x", flops, warmup, repeat)
                    row[f"{tag}_ratio"] = r["x_tflops"] / prow["p_tflops"]
                    row[f"{tag}_tile"] = _sm90_tile(args.dtype, d, causal, args.softcap)
            if torch is not None and fa4_dense is not None:
                cap = args.softcap
                fn = lambda a, b_, c: fa4_dense(a, b_, c, causal=causal, softcap=cap)  # noqa: E731
                _peer(row, "fa4", _torch_autograd(fn, q, k, v, torch, args.backward), out, torch, flops, warmup,
                      repeat)
                made = _torch_autograd(lambda a, b_, c: fa4_dense(a, b_, c, causal=causal), q, k, v, torch,
                                       args.backward)
                if made[0] is not None:
                    frow = {}
                    _time(made[0], frow, "f", flops, warmup, repeat)
                    row["fa4_softcap_ratio"] = row.get("fa4_tflops", 0) / frow["f_tflops"]
            rows.append(row)
            print(row, flush=True)
            del q, k, v
    return rows, ["head_dim", "causal", "seqlen", "rtk_tile", "rtk_tflops", "rtk_nocap_tflops", "softcap_ratio",
                  "fa4_tflops", "ratio_vs_fa4", "fa4_softcap_ratio"] + [f"{n}_poly{p}_tflops" for p in args.exp2_poly
                                                                        for n in ("cap", "nocap")] \
        + [f"fm{f}_p{p}_{c}" for f, p in args.variants for c in ("ratio", "tile")]


def main():
    p = bu.parser(__doc__)
    p.add_argument("--varlen", action="store_true")
    p.add_argument("--window", nargs="?", const="4096,0", default=None,
                   help="sliding-window mode; optional left,right (default 4096,0)")
    p.add_argument("--softcap", nargs="?", type=float, const=50.0, default=None,
                   help="softcap mode; optional cap (default 50)")
    p.add_argument("--backward", action="store_true", help="time the backward instead of the forward")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--tokens", default="16384,32768,65536", help="--varlen: packed tokens per batch")
    p.add_argument("--window-seqlen", type=int, default=32768)
    p.add_argument("--softcap-seqlen", type=int, default=4096)
    p.add_argument("--exp2-poly", default="", help="--softcap: also time these exp2_poly values (0-8) of the "
                   "Hopper forward, with and without softcap (columns cap_polyN / nocap_polyN)")
    p.add_argument("--bwd-alt", default="", help="--varlen --backward: also time the Hopper backward's config with "
                   "these fields (NAME=VALUE[,...], e.g. block_m=128), interleaved with the default")
    p.add_argument("--variants", default="", help="--softcap: also time these softcap variants of the Hopper "
                   "forward, as fixed_max:exp2_poly pairs (fixed_max 0 = running max, 1 = fixed reference; exp2_poly "
                   "0-8 or d = the heuristic's), e.g. 0:d,1:0,1:2,1:4 (columns fmF_pP_ratio / _tile)")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    if not (args.varlen or args.window or args.softcap):
        args.varlen, args.window, args.softcap = True, "4096,0", 50.0
    args.head_dims = [int(x) for x in args.head_dims.split(",")]
    args.exp2_poly = [int(x) for x in args.exp2_poly.split(",") if x]
    args.variants = [tuple(x.split(":")) for x in args.variants.split(",") if x]
    args.tokens = [int(x) for x in args.tokens.split(",")]
    if args.window:
        args.window = tuple(int(x) for x in args.window.split(","))
    if args.quick:
        args.tokens = args.tokens if "--tokens" in sys.argv else [32768]
    warmup, repeat = (2, 5) if args.quick else (3, 10)
    t0 = time.perf_counter()
    env = bu.environment()
    torch, _ = bu.attention_peers(env)
    fa4 = bu.fa4()[0] is not None
    env["fa4"] = fa4
    import cupy as cp
    cp.cuda.Device().synchronize()
    direction = "backward" if args.backward else "forward"
    sfx = ("_bwd" if args.backward else "") + (f"_{args.tag}" if args.tag else "")
    tables = []
    for on, fn, name in ((args.varlen, bench_varlen, "varlen"), (args.window, bench_window, "window"),
                         (args.softcap, bench_softcap, "softcap")):
        if not on:
            continue
        rows, cols = fn(args, torch, warmup, repeat)
        bu.save(args.out, f"bench_attention_{name}{sfx}", {"env": env, "dtype": args.dtype, "direction": direction,
                                                           "rows": rows})
        tables.append((name, rows, [c for c in cols if any(c in r for r in rows)]))
    print(f"\n{env['gpu']} ({env['arch']}, {env['sms']} SMs), driver {env['driver']}, NVRTC {env['nvrtc']}, "
          f"{args.dtype}, {direction}, {env['date']}" + (f", torch {env['torch']}" if torch else " (no torch)")
          + (", FA4" if fa4 else ", no FA4"))
    for name, rows, cols in tables:
        print(f"\n{name}:")
        print(bu.table(rows, cols))
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
