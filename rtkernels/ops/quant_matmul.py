"""quantized_matmul: weight-only int8 / uint8 / float8-e4m3 matmul, dequantized in registers.

>>> w_q, scales = rtk.quantize_weight(w, dtype="int8", group_size=128)     # w: (N, K), as nn.Linear
>>> y = rtk.quantized_matmul(x, w_q, scales, group_size=128)               # x (..., K) -> y (..., N)
>>> y = rtk.quantized_matmul(x, w_q, scales, bias=b, activation="silu")    # act(x @ w^T + b), fused
>>> w_d = rtk.dequantize_weight(w_q, scales, group_size=128)               # (N, K) bfloat16

Decode-time GEMMs (a few rows of x against a large weight) are bound by reading the weight: one
byte per element instead of bf16's two halves the time.  For M <= 16 rows of x (the leading dims
flattened) the ``quant_gemv`` kernel (templates/quant_gemv.cu.j2) reads every weight byte once with
16-byte loads, dequantizes in registers and multiplies on tensor cores (mma.sync, fp32
accumulate), every row of x reusing the same weight registers, so M = 16 costs about the bytes of
M = 1.  For M > 16 the weight is dequantized into an (N, K) workspace of x's dtype and
:func:`rtkernels.matmul` runs on its transpose: a correctness path, not tuned (it moves 1 + 2 + 2
bytes per weight element against the GEMV's 1, and rounds the dequantized weight to x's dtype).

Quantization (:func:`quantize_weight`; the kernels take any values of this form):

* ``int8``: symmetric, w = q * scale, q in [-127, 127] (zeros optional: w = (q - zero) * scale,
  zero int8);
* ``uint8``: asymmetric, w = (q - zero) * scale, zero uint8 of scales' shape;
* ``float8_e4m3`` (e4m3fn; torch.float8_e4m3fn tensors, or uint8 arrays with
  ``weight_dtype="float8_e4m3"``): w = q * scale, q's value.  Its NaN encodings (0x7F, 0xFF) are
  not supported (they read as +-480);
* scales per output row (``group_size=None``: shape (N,)) or per group of ``group_size``
  consecutive k of a row (a multiple of 64: shape (N, ceil(K / group_size))), float32, float16 or
  bfloat16.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import device, dtypes
from ..errors import ConfigError
from ..kernel import get_kernel
from . import gemv, views
from ._arrays import LaunchPlans, _is_torch, as_device_array, cupy_stream, default_stream, dtype_name, new_like
# the GEMV family (config, heuristic, launch) lives in ops/gemv.py, shared with rtk.matmul's M <= 16
# route; its names are re-exported here for the quantized op's callers
from .gemv import (GEMV_MAX_ROWS, GROUP_MULTIPLE, SCALE_DTYPES, WEIGHT_DTYPES, QuantGemvConfig,  # noqa: F401
                   _TILE_FIELDS, _vec_width, candidate_configs, heuristic_config, register_estimate)
from .matmul import matmul
from .matmul_common import activation_reference
from .matmul_sm90 import ACTIVATIONS
from .rowwise import _row_layout

OP = "quantized_matmul"
_DTYPES = ("float16", "bfloat16")
_E4M3_MAX = 448.0


# ---- quantization -------------------------------------------------------------------------------
def _e4m3_table() -> np.ndarray:
    """float64 value of each of the 256 e4m3fn encodings (NaN for 0x7F and 0xFF)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, b & 7
    v = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7.0))
    v[(e == 15) & (m == 7)] = np.nan
    return np.where(b & 0x80, -v, v)


E4M3_VALUES = _e4m3_table()


def encode_e4m3(xp, v):
    """float8 e4m3fn bits (uint8) of ``v`` (NumPy or CuPy, any float): round to nearest even,
    saturating at +-448.  NaN input is not supported."""
    a = xp.minimum(xp.abs(v.astype(xp.float64)), _E4M3_MAX)
    _, ex = xp.frexp(a)                                   # a = f * 2^ex, f in [0.5, 1)
    e = xp.maximum(ex - 1, -6)                            # exponent of a's binade (subnormals: -6)
    r = xp.rint(a / xp.ldexp(1.0, e - 3)) * xp.ldexp(1.0, e - 3)   # 3 mantissa bits, ties to even
    _, er = xp.frexp(r)
    er = er - 1
    normal = r >= 2.0 ** -6
    mant = xp.where(normal, (r / xp.ldexp(1.0, xp.where(normal, er, 0)) - 1.0) * 8.0, r * 2.0 ** 9)
    bits = xp.where(normal, ((er + 7) << 3) + xp.rint(mant).astype(xp.int64), xp.rint(mant).astype(xp.int64))
    bits = bits | xp.where(v < 0, 0x80, 0)
    return bits.astype(xp.uint8)


def _quantize(xp, w, kind: str, group: int):
    """(q, scales float32, zeros or None) of a float32 (N, K) array in module ``xp``."""
    n, k = w.shape
    if k == 0:
        raise ConfigError(f"quantize_weight: w has shape {w.shape}; K must be at least 1", field="w", value=w.shape)
    g = group or k
    ng = -(-k // g)
    wp = xp.zeros((n, ng * g), dtype=xp.float32)
    wp[:, :k] = w
    wp = wp.reshape(n, ng, g)
    zeros = None
    if kind == "uint8":
        lo = xp.minimum(wp.min(axis=-1), 0.0)
        hi = xp.maximum(wp.max(axis=-1), 0.0)
        scale = ((hi - lo) / 255.0).astype(xp.float32)
        scale = xp.where(scale > 0, scale, xp.float32(1.0))
        zero = xp.clip(xp.rint(-lo / scale), 0, 255)
        q = xp.clip(xp.rint(wp / scale[..., None]) + zero[..., None], 0, 255).astype(xp.uint8)
        zeros = zero.astype(xp.uint8)
    else:
        amax = xp.abs(wp).max(axis=-1)
        top = 127.0 if kind == "int8" else _E4M3_MAX
        scale = (amax / top).astype(xp.float32)
        scale = xp.where(scale > 0, scale, xp.float32(1.0))
        y = wp / scale[..., None]
        q = xp.clip(xp.rint(y), -127, 127).astype(xp.int8) if kind == "int8" else encode_e4m3(xp, y)
    q = q.reshape(n, ng * g)[:, :k]
    q = xp.ascontiguousarray(q)
    if not group:
        scale = scale[:, 0]
        zeros = None if zeros is None else zeros[:, 0]
    return q, xp.ascontiguousarray(scale), None if zeros is None else xp.ascontiguousarray(zeros)


def quantize_weight(w, *, dtype: str = "int8", group_size: int | None = None):
    """Quantize a weight matrix w (N, K) (as nn.Linear stores it) for :func:`quantized_matmul`.

    Parameters
    ----------
    w : (N, K) float array: NumPy (quantized on the host), CuPy float16/float32 or torch (any
        float dtype, CPU or CUDA); the result is of the same kind.
    dtype : ``"int8"`` (symmetric: scale = max|w| / 127, q = round(w / scale) in [-127, 127]),
        ``"uint8"`` (asymmetric: scale = (max - min) / 255 over a range that includes 0, zero =
        round(-min / scale), q = round(w / scale) + zero in [0, 255]) or ``"float8_e4m3"`` (scale =
        max|w| / 448, q = e4m3(w / scale), round to nearest even).  Rounding is half to even.
    group_size : None for one scale per row, else a multiple of 64: one per group of that many
        consecutive k of a row (the last group of a row may be shorter).

    Returns
    -------
    (w_q, scales) or, for ``"uint8"``, (w_q, scales, zeros): w_q (N, K) int8 / uint8 (float8 as
    uint8 bits for NumPy and CuPy, torch.float8_e4m3fn for torch); scales float32 (N,) or
    (N, ceil(K / group_size)); zeros uint8 of the scales' shape.  A row (group) of zeros gets
    scale 1.
    """
    if dtype not in WEIGHT_DTYPES:
        raise ConfigError.bad_value("quantize_weight", "dtype", dtype, "one of " + ", ".join(WEIGHT_DTYPES))
    group = _group(group_size, "quantize_weight")
    if _is_torch(w):
        import torch
        if w.dim() != 2:
            raise ConfigError(f"quantize_weight: w has shape {tuple(w.shape)}; expected (N, K)", field="w")
        w32 = w.detach().to(torch.float32).contiguous()
        if w32.is_cuda:
            import cupy
            with cupy.cuda.Device(w32.get_device()):
                res = _quantize(cupy, cupy.from_dlpack(w32), dtype, group)
            res = tuple(None if a is None else torch.from_dlpack(a) for a in res)
        else:
            res = tuple(None if a is None else torch.from_numpy(a) for a in _quantize(np, w32.numpy(), dtype, group))
        q, s, z = res
        if dtype == "float8_e4m3":
            q = q.view(torch.float8_e4m3fn)
        return (q, s) if z is None else (q, s, z)
    if isinstance(w, np.ndarray) or not hasattr(w, "__cuda_array_interface__"):
        xp, w32 = np, np.asarray(w, dtype=np.float32)
    else:
        import cupy
        xp = cupy
        if dtype_name(w) not in ("float16", "float32", "float64"):
            raise ConfigError(f"quantize_weight: w is a CuPy {dtype_name(w)} array; pass float16/float32/float64 "
                              "(bfloat16 bits: convert to float32 first)", field="w", value=dtype_name(w))
        w32 = cupy.asarray(w).astype(cupy.float32)
    if w32.ndim != 2:
        raise ConfigError(f"quantize_weight: w has shape {w32.shape}; expected (N, K)", field="w", value=w32.shape)
    q, s, z = _quantize(xp, w32, dtype, group)
    return (q, s) if z is None else (q, s, z)


# ---- references ---------------------------------------------------------------------------------
def _host(a):
    if a is None:
        return None
    if _is_torch(a):
        import torch
        if a.dtype == torch.float8_e4m3fn:
            a = a.view(torch.uint8)
        if a.dtype == torch.bfloat16:
            return a.detach().float().cpu().numpy()
        return a.detach().cpu().numpy()
    return a.get() if hasattr(a, "get") else np.asarray(a)


def dequantize_reference(w_q, scales, *, group_size: int | None = None, zeros=None,
                         weight_dtype: str | None = None) -> np.ndarray:
    """float64 (N, K): (q - zero) * scale, or e4m3(q) * scale (host or device arrays, torch too;
    ``weight_dtype="float8_e4m3"`` for uint8 bits, implied by torch float8 tensors)."""
    if _is_torch(w_q) and "float8" in str(w_q.dtype):
        weight_dtype = "float8_e4m3"
    q = _host(w_q)
    s = np.asarray(_host(scales), dtype=np.float64)
    n, k = q.shape
    if weight_dtype == "float8_e4m3":
        v = E4M3_VALUES[q.view(np.uint8)]
    else:
        v = q.astype(np.float64)
        if zeros is not None:
            z = np.asarray(_host(zeros), dtype=np.float64)
            v = v - (z[:, None] if not group_size else np.repeat(z, group_size, axis=1)[:, :k])
    s = s[:, None] if not group_size else np.repeat(s, group_size, axis=1)[:, :k]
    return v * s


def quantized_matmul_reference(x, w_q, scales, *, group_size: int | None = None, zeros=None, bias=None,
                               activation: str | None = None, weight_dtype: str | None = None) -> np.ndarray:
    """float64 NumPy reference of :func:`quantized_matmul`: act(x @ dequant(w)^T + bias), x (..., K)
    as float64 values (bfloat16 bits already converted by the caller)."""
    w = dequantize_reference(w_q, scales, group_size=group_size, zeros=zeros, weight_dtype=weight_dtype)
    y = np.asarray(_host(x), dtype=np.float64) @ w.T
    if bias is not None:
        y = y + np.asarray(_host(bias), dtype=np.float64)
    return activation_reference(y, activation)


# ---- the op -------------------------------------------------------------------------------------
def _group(group_size, op: str) -> int:
    if group_size is None or group_size == 0:
        return 0
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size <= 0 \
            or group_size % GROUP_MULTIPLE:
        raise ConfigError.bad_value(op, "group_size", group_size,
                                    f"None (one scale per row) or a positive multiple of {GROUP_MULTIPLE}")
    return int(group_size)


def _weight_kind(w_q, weight_dtype):
    """(CuPy view of w_q's bytes, weight dtype name)."""
    if _is_torch(w_q) and "float8_e4m3fn" in str(w_q.dtype):
        import torch
        if weight_dtype not in (None, "float8_e4m3"):
            raise ConfigError(f"{OP}: w_q is a torch.float8_e4m3fn tensor but weight_dtype={weight_dtype!r}",
                              field="weight_dtype", value=weight_dtype, allowed="None, 'float8_e4m3'")
        return as_device_array(w_q.view(torch.uint8), OP, "w_q"), "float8_e4m3"
    if _is_torch(w_q) and "float8" in str(w_q.dtype):
        raise ConfigError(f"{OP}: w_q has dtype {w_q.dtype}; float8 weights must be float8_e4m3fn",
                          field="w_q", value=str(w_q.dtype), allowed="int8, uint8, float8_e4m3fn")
    wv = as_device_array(w_q, OP, "w_q")
    have = dtype_name(wv)
    if weight_dtype is None:
        weight_dtype = have
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError.bad_value(OP, "weight_dtype", weight_dtype, "one of " + ", ".join(WEIGHT_DTYPES))
    if have not in ("int8", "uint8") or (weight_dtype != "float8_e4m3" and have != weight_dtype):
        raise ConfigError(f"{OP}: w_q has dtype {have} (weight_dtype={weight_dtype!r}); allowed: int8, uint8, or "
                          "uint8 bits with weight_dtype='float8_e4m3' (torch: float8_e4m3fn)",
                          field="w_q", value=have, allowed="int8, uint8, float8_e4m3")
    return wv, weight_dtype


def _x_dtype(x, xv, dtype) -> str:
    have = dtype_name(xv) if not _is_torch(x) else dtype_name(x)
    if dtype is not None:
        want = dtypes.canonical(dtype, family=OP, field="dtype", allowed=_DTYPES)
        if not (have == want or (have == "uint16" and want == "bfloat16")):
            raise ConfigError(f"{OP}: x has dtype {have}, but dtype={dtype!r} was given", field="dtype", value=have)
        return want
    if have not in _DTYPES:
        raise ConfigError(f"{OP}: x has dtype {have}; allowed: float16, bfloat16 (uint16 bfloat16 bits need "
                          "dtype='bfloat16')", field="x", value=have, allowed="float16, bfloat16")
    return have


def _dense(name: str, arr, stream):
    """A C-contiguous CuPy view of a small operand (scales, zeros, bias): itself, or a copy."""
    v = as_device_array(arr, OP, name)
    v, _ = views.read_view(OP, name, v, stream, lambda i: i.kind in (views.CONTIGUOUS, views.EMPTY))
    return v


_PLANS = LaunchPlans()
DEQUANT_OP = "dequantize_weight"


class _Weight(NamedTuple):
    """A checked quantized weight: byte view and dtype name, (N, K), scales (view, dtype name), zeros."""
    wv: Any
    wdt: str
    n: int
    k: int
    ss: Any
    ds: str
    zv: Any


def _check_weight(op: str, w_q, scales, zeros, group: int, weight_dtype, stream) -> _Weight:
    """w_q (N, K) C-contiguous, scales (N,) or (N, ceil(K / group)) and zeros alike, as the kernels
    read them (scales and zeros copied first if not contiguous)."""
    wv, wdt = _weight_kind(w_q, weight_dtype)
    if wv.ndim != 2:
        raise ConfigError(f"{op}: w_q has shape {wv.shape}; expected (N, K) as nn.Linear stores a weight",
                          field="w_q", value=wv.shape)
    n, k = (int(d) for d in wv.shape)
    winfo = views.of(wv)
    if winfo.kind not in (views.CONTIGUOUS, views.EMPTY):
        raise views.reject(op, "w_q", winfo, "is not C-contiguous", "pass the (N, K) weight as stored "
                           "(w_q.contiguous() once, outside the hot path)")
    ss = _dense("scales", scales, stream)
    ds = dtype_name(ss)
    ds = "bfloat16" if ds == "uint16" else ds
    if _is_torch(scales):
        ds = dtype_name(scales)
    want_s = (n,) if not group else (n, -(-k // group))
    if ds not in SCALE_DTYPES or tuple(ss.shape) != want_s:
        raise ConfigError(f"{op}: scales is {ds} {tuple(ss.shape)}; expected float32/float16/bfloat16 of shape "
                          f"{want_s} (group_size={group or None})", field="scales", value=(ds, tuple(ss.shape)))
    zv = None
    if zeros is not None:
        if wdt == "float8_e4m3":
            raise ConfigError(f"{op}: zeros apply to integer weights, not float8_e4m3", field="zeros")
        zv = _dense("zeros", zeros, stream)
        if dtype_name(zv) != wdt or tuple(zv.shape) != want_s:
            raise ConfigError(f"{op}: zeros is {dtype_name(zv)} {tuple(zv.shape)}; expected {wdt} of shape {want_s}",
                              field="zeros", value=(dtype_name(zv), tuple(zv.shape)))
    return _Weight(wv, wdt, n, k, ss, ds, zv)


def dequantize_weight(w_q, scales, *, group_size: int | None = None, zeros=None, weight_dtype: str | None = None,
                      dtype: str = "bfloat16", out=None, stream=None):
    """``dequant(w_q)`` as an (N, K) array of ``dtype`` (float16 or bfloat16): ``(q - zero) * scale``
    (``q * scale`` without zeros), each value rounded once to ``dtype`` - the weight
    :func:`quantized_matmul` multiplies by (its M > 16 path multiplies by exactly this array).

    w_q, scales, group_size, zeros, weight_dtype as for :func:`quantized_matmul`; the result is the
    same kind of array as w_q (torch in, torch out; CuPy bfloat16 as uint16 bits), or ``out`` (N, K)
    C-contiguous of ``dtype``.  One pass: N x K bytes read, 2 x N x K written.
    """
    if dtype not in ("float16", "bfloat16"):
        raise ConfigError.bad_value(DEQUANT_OP, "dtype", dtype, "'float16' or 'bfloat16'")
    group = _group(group_size, DEQUANT_OP)
    stream = default_stream(w_q, stream)
    w = _check_weight(DEQUANT_OP, w_q, scales, zeros, group, weight_dtype, stream)
    if out is None:
        out = new_like(w_q, (w.n, w.k), dtype)
    ov = as_device_array(out, DEQUANT_OP, "out")
    have = dtype_name(out) if _is_torch(out) else dtype_name(ov)
    if tuple(ov.shape) != (w.n, w.k) or not (have == dtype or (have == "uint16" and dtype == "bfloat16")):
        raise ConfigError(f"{DEQUANT_OP}: out is {have} {tuple(ov.shape)}; expected {dtype} ({w.n}, {w.k})",
                          field="out", value=(have, tuple(ov.shape)))
    oinfo = views.of(ov)
    if oinfo.kind not in (views.CONTIGUOUS, views.EMPTY):
        raise views.reject(DEQUANT_OP, "out", oinfo, "is not C-contiguous", "pass a C-contiguous (N, K) array")
    cfg = QuantGemvConfig(dtype=dtype, weight_dtype=w.wdt, scale_dtype=w.ds, group_size=group,
                          has_zeros=w.zv is not None, w_vec=_vec_width(w.k, w.wv.data.ptr, None, 1, 16))
    _dequantize(cfg, w, ov, stream)
    return out


def _dequantize(cfg: QuantGemvConfig, w: _Weight, wd, stream) -> None:
    """``cfg``'s dequantize kernel: w into wd ((N, K) of cfg.dtype, C-contiguous)."""
    if w.n and w.k:
        chunks = w.n * (-(-w.k // 16))
        ngroups = -(-w.k // cfg.group_size) if cfg.group_size else 0
        get_kernel(cfg, "quant_dequantize").launch((-(-chunks // 256),), (256,), w.wv, w.ss, w.zv, wd, w.n, w.k,
                                                   ngroups, stream=stream)


def quantized_matmul(x, w_q, scales, *, group_size: int | None = None, zeros=None, bias=None,
                     activation: str | None = None, out=None, weight_dtype: str | None = None,
                     dtype: str | None = None, stream=None, config: QuantGemvConfig | None = None):
    """``activation(x @ dequant(w_q)^T + bias)`` with w_q (N, K) quantized (int8 / uint8 / float8 e4m3).

    Parameters
    ----------
    x : (..., K) float16 or bfloat16 (CuPy, torch, CAI / DLPack); the leading dims flatten to M rows.
        Rows one stride apart with unit stride along K are read in place (row slices, broadcast
        rows); any other view is copied first on the call's stream.
    w_q : (N, K) C-contiguous int8, uint8, torch.float8_e4m3fn, or uint8 bits with
        ``weight_dtype="float8_e4m3"``.  Any N and K (16-byte loads when K is a multiple of 16 and
        w_q 16-byte aligned; narrower loads otherwise).
    scales : (N,) (``group_size=None``) or (N, ceil(K / group_size)); float32, float16 or bfloat16
        (CuPy uint16: bfloat16 bits).  Copied first if not contiguous (so are zeros and bias).
    group_size : None, or the group length along K (a multiple of 64) of ``scales``.
    zeros : optional zero points of ``scales``' shape, w_q's integer dtype: w = (q - zero) * scale.
    bias : optional (N,) in x's dtype, added before the activation.
    activation : None, "relu", "gelu" (erf) or "silu" (:func:`rtkernels.matmul`'s epilogue set).
    out : optional (..., N) output in x's dtype (rows one stride apart, unit stride along N).
    weight_dtype : "float8_e4m3" to read uint8 w_q as e4m3 bits; else w_q's own dtype.
    dtype : "bfloat16" to read uint16 CuPy x as bfloat16 bits.
    stream : CuPy stream, torch stream or raw handle (default: CuPy's current stream, or torch's
        current one for torch x).
    config : a :class:`QuantGemvConfig` whose tiling (row_tiles, unroll, num_warps, warps_k,
        split_k, ctas_per_sm, persistent, max_registers) replaces the heuristic's (benchmarks,
        tuning); the rest follows the inputs.

    M <= 16 runs the quant_gemv kernel (fp32 accumulation on tensor cores, the weight read once;
    float32 partials and a second small kernel when N is too small to fill the GPU).  With a
    bfloat16 x and integer weights on sm_90 it may multiply a float16 copy of x instead (each row
    scaled by a power of two that puts its largest finite |x| in [2^14, 2^15), undone in float32 on
    the sums): float16's dequantization is cheaper than bfloat16's.  The copy holds every value of
    x exactly except those below 2^-28 of their row's largest (which lose bits, and flush to zero
    below 2^-38 of it); inf and NaN stay inf and NaN.  ``QuantGemvConfig.x_half`` /
    ``x_shared`` / ``x_grid`` (or RTKERNELS_GEMV_XHALF=0, RTKERNELS_GEMV_XGRID=0) choose where the
    copy is made.  M > 16
    dequantizes w_q into an (N, K) workspace of x's dtype and runs :func:`rtkernels.matmul` on its
    transpose: a correctness path, not tuned (and the dequantized weight is rounded to x's dtype).
    """
    key = _PLANS.key((x, w_q, scales, zeros, bias, out), (group_size, activation, weight_dtype, dtype, config))
    plan = _PLANS.get(key)
    if plan is not None:
        return gemv.replay(plan, (w_q, x, scales, zeros, bias), out, stream)
    if activation not in (None, *ACTIVATIONS):
        raise ConfigError.bad_value(OP, "activation", activation, "None, 'relu', 'gelu' or 'silu'")
    act = activation or "none"
    group = _group(group_size, OP)
    stream = default_stream(x, stream)

    # checks: w_q (N, K) bytes, x (..., K), scales / zeros / bias, out (..., N)
    w = _check_weight(OP, w_q, scales, zeros, group, weight_dtype, stream)
    wv, wdt, n, k, ss, zv = w.wv, w.wdt, w.n, w.k, w.ss, w.zv
    xv = as_device_array(x, OP, "x")
    dx = _x_dtype(x, xv, dtype)
    if xv.ndim < 1 or xv.shape[-1] != k:
        raise ConfigError(f"{OP}: x has shape {xv.shape}; expected (..., K) with K = {k} (w_q is {n} x {k})",
                          field="x", value=xv.shape)
    views.check_readable(OP, "x", views.of(xv))
    lay = _row_layout(xv)
    if lay is None:
        xv = views.compact(xv, stream)
        lay = _row_layout(xv)
    m, _, ldx = lay
    bv = None
    if bias is not None:
        bv = _dense("bias", bias, stream)
        db = dtype_name(bias) if _is_torch(bias) else dtype_name(bv)
        if not (db == dx or (db == "uint16" and dx == "bfloat16")) or tuple(bv.shape) != (n,):
            raise ConfigError(f"{OP}: bias is {db} {tuple(bv.shape)}; expected {dx} of shape ({n},)",
                              field="bias", value=(db, tuple(bv.shape)))
    out_shape = (*xv.shape[:-1], n)
    if out is None:
        out = new_like(x, out_shape, dx)
    ov = as_device_array(out, OP, "out")
    do = dtype_name(out) if _is_torch(out) else dtype_name(ov)
    if tuple(ov.shape) != out_shape or not (do == dx or (do == "uint16" and dx == "bfloat16")):
        raise ConfigError(f"{OP}: out is {do} {tuple(ov.shape)}; expected {dx} {out_shape}", field="out",
                          value=(do, tuple(ov.shape)))
    oinfo = views.of(ov)
    accepted = "pass rows one stride apart with unit stride along N"
    views.check_output(OP, "out", oinfo, accepted)
    olay = _row_layout(ov)
    if olay is None:
        raise views.reject(OP, "out", oinfo, "cannot be written by rows", accepted)
    ldo = olay[2]
    if m == 0 or n == 0:
        return out
    if max(m, n, k) >= 2 ** 31:
        raise ConfigError(f"{OP}: M, N, K = {m}, {n}, {k}; each must be < 2^31", field="shape", value=(m, n, k))
    ngroups = -(-k // group) if group else 0
    w_vec = _vec_width(k, wv.data.ptr, None, 1, 16)
    common = dict(weight_dtype=wdt, scale_dtype=w.ds, group_size=group, has_zeros=zv is not None)

    if m > GEMV_MAX_ROWS:
        _dequantized_matmul(xv, w, bv, ov, m, ldx, ldo, QuantGemvConfig(dtype=dx, w_vec=w_vec, **common), act,
                            stream)
        return out

    # plan: the heuristic's config for this shape and the load widths the alignments allow
    x_vec = _vec_width(k, xv.data.ptr, ldx if m > 1 else None, 2, 8)
    cfg = heuristic_config(dx, m, n, k, has_bias=bv is not None, activation=act, w_vec=w_vec, x_vec=x_vec,
                           sm_count=device.sm_count(), **common)
    if config is not None:
        if not isinstance(config, QuantGemvConfig):
            raise ConfigError(f"{OP}: config must be a QuantGemvConfig, got {type(config).__name__}", field="config",
                              value=config)
        cfg = cfg.replace(**{f: getattr(config, f) for f in _TILE_FIELDS})
    plan = gemv.launch(cfg, (m, n, k, k, ldx, ldo, ngroups), (wv, xv, ss, zv, bv, ov),
                       (w_q, x, scales, zeros, bias, out), stream)
    if plan is not None:
        _PLANS.put(key, plan)
    return out


def _dequantized_matmul(xv, w: _Weight, bv, ov, m, ldx, ldo, cfg, act, stream) -> None:
    """M > 16: dequantize w into an (N, K) workspace of x's dtype (``cfg``'s dequantize kernel), then
    rtk.matmul(x, wd, trans_b=True) (a correctness path: 5 bytes of traffic per weight element, not
    tuned)."""
    import cupy
    n, k = w.n, w.k
    with cupy_stream(stream):
        wd = cupy.empty((n, k), dtype=np.uint16 if cfg.dtype == "bfloat16" else np.float16)
    _dequantize(cfg, w, wd, stream)
    item = xv.itemsize
    x2 = cupy.lib.stride_tricks.as_strided(xv, (m, k), (ldx * item, item))
    o2 = cupy.lib.stride_tricks.as_strided(ov, (m, n), (ldo * item, item))
    matmul(x2, wd, bias=bv, activation=None if act == "none" else act, out=o2, trans_b=True,
           dtype=cfg.dtype, stream=stream)
