"""quantized_matmul: weight-only int8 / uint8 / float8-e4m3 matmul, dequantized in registers.

>>> w_q, scales = rtk.quantize_weight(w, dtype="int8", group_size=128)     # w: (N, K), as nn.Linear
>>> y = rtk.quantized_matmul(x, w_q, scales, group_size=128)               # x (..., K) -> y (..., N)
>>> y = rtk.quantized_matmul(x, w_q, scales, bias=b, activation="silu")    # act(x @ w^T + b), fused

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

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import device, dtypes
from ..config import KernelConfig, register_family
from ..errors import ConfigError
from ..kernel import get_kernel
from . import views
from ._arrays import (Launch, LaunchPlans, OutputPlan, _is_torch, as_device_array, cupy_stream, default_stream,
                      dtype_name, new_like, same_memory)
from .matmul import matmul
from .matmul_common import activation_reference
from .matmul_sm90 import ACTIVATIONS
from .rowwise import _row_layout

OP = "quantized_matmul"
WEIGHT_DTYPES = ("int8", "uint8", "float8_e4m3")
SCALE_DTYPES = ("float32", "float16", "bfloat16")
_DTYPES = ("float16", "bfloat16")
GEMV_MAX_ROWS = 16          # rows of x the GEMV kernel takes (two m16n8k16 column tiles)
GROUP_MULTIPLE = 64         # group scales apply per 64-element block of K (4 lanes x 16 bytes)
_E4M3_MAX = 448.0


def register_estimate(row_tiles: int, unroll: int, m_tiles: int, group: bool, zeros: bool) -> int:
    """Registers the quant_gemv kernel needs per thread at least, from its arrays: the slots'
    weights (8 per row tile and slot), their group scales / zero points (2 per row tile and slot
    each), x of the current and the next item (2 x 8 per m tile), the accumulators (4 per row tile
    and m tile; twice with group scales: the block's own sum), plus about 40 for addresses, loop
    state and the dequantization temporaries.  A floor that rejects configs bound to spill: ptxas
    (NVRTC 13.5, sm_90) gave the heuristic's configs 100-128 registers under a cap of 128 (this
    estimate: 88-112), and none of them spills under 112 (tests/test_quant_matmul.py, HEADROOM)."""
    slot = 8 * row_tiles + (2 * row_tiles if group else 0) + (2 * row_tiles if zeros else 0)
    acc = 4 * row_tiles * m_tiles * (2 if group else 1)
    return unroll * slot + 16 * m_tiles + acc + 40


@register_family
@dataclass(frozen=True)
class QuantGemvConfig(KernelConfig):
    """One quantized-GEMV specialization (templates/quant_gemv.cu.j2; its header explains the layout).

    ``dtype``: x, bias and out; ``weight_dtype``: int8, uint8 or float8_e4m3; ``scale_dtype``;
    ``group_size``: 0 for one scale per row, else a multiple of 64; ``has_zeros``: integer weights
    with zero points.  Tiling: a warp owns ``row_tiles`` * 16 weight rows of a tile and a slice of
    K, and keeps ``unroll`` 64-element blocks (2 * row_tiles 16-byte loads per lane each) in flight,
    refilling a block's registers as soon as it is consumed; a CTA has ``num_warps`` warps,
    ``warps_k`` of them along K (partials summed in shared memory once per tile) and the rest along
    N; ``split_k`` CTAs along K (float32 partials, a second kernel adds them in order).
    ``ctas_per_sm``: CTAs sharing an SM (the register cap 65536 / (threads * ctas_per_sm), or
    ``max_registers`` when given); ``persistent``: launch at most SMs * ctas_per_sm CTAs that walk
    the N tiles (so loads run on across tile ends) instead of one CTA per tile.  ``m_tiles``: 1 for
    up to 8 rows of x, 2 for up to 16.  ``w_vec`` bytes per weight load and ``x_vec`` elements per
    x load, lowered by the host when K, a stride or a base is not aligned for 16 bytes.
    """

    family: ClassVar[str] = "quant_gemv"
    template: ClassVar[str] = "quant_gemv.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("quant_gemv", "quant_gemv_reduce", "quant_dequantize")
    dtype: str = "bfloat16"
    weight_dtype: str = "int8"
    scale_dtype: str = "float32"
    group_size: int = 0
    has_zeros: bool = False
    has_bias: bool = False
    activation: str = "none"
    m_tiles: int = 1
    row_tiles: int = 1
    unroll: int = 4
    num_warps: int = 8
    warps_k: int = 8
    split_k: int = 1
    ctas_per_sm: int = 2
    persistent: bool = True
    max_registers: int = 0
    w_vec: int = 16
    x_vec: int = 8

    expects_tensor_cores: ClassVar[bool] = True
    # (no expected_global_width: inspect holds loads and stores to it, and the outputs are M x N
    # scalar stores; tests/test_quant_matmul.py checks the 128-bit weight and x loads instead)

    def __post_init__(self):
        if self.activation is None:
            object.__setattr__(self, "activation", "none")
        self._check_dtype("dtype", _DTYPES)
        self._check_choice("weight_dtype", WEIGHT_DTYPES)
        self._check_dtype("scale_dtype", SCALE_DTYPES)
        self._check_choice("activation", ACTIVATIONS)
        for f in ("has_zeros", "has_bias", "persistent"):
            if not isinstance(getattr(self, f), bool):
                self._fail(f, "True or False")
        if self.group_size != 0:
            self._check_int("group_size", GROUP_MULTIPLE, 1 << 30, multiple_of=GROUP_MULTIPLE)
        if self.has_zeros and self.weight_dtype == "float8_e4m3":
            self._fail("has_zeros", "False for float8_e4m3 weights (zero points are for integer weights)")
        self._check_choice("m_tiles", (1, 2))
        self._check_choice("row_tiles", (1, 2, 4))
        self._check_int("unroll", 1, 8)
        self._check_int("num_warps", 1, 16, power_of_two=True)
        self._check_int("warps_k", 1, self.num_warps, power_of_two=True)
        self._check_int("split_k", 1, 64)
        self._check_int("ctas_per_sm", 1, 64 // self.num_warps)
        if self.max_registers != 0:
            self._check_int("max_registers", 32, 255, multiple_of=8)
        self._check_choice("w_vec", (1, 2, 4, 8, 16))
        self._check_choice("x_vec", (1, 2, 4, 8))
        # the slots, x and accumulators must fit the register cap or they spill (every slot's loads
        # are in flight at once); register_estimate is checked against ptxas by the CPU tests
        need = self.registers_needed
        if self.max_registers == 0 and need > self.register_cap:   # an explicit cap is left to ptxas
            self._fail("unroll", f"such that about {need} registers (row_tiles={self.row_tiles}, "
                                 f"unroll={self.unroll}, m_tiles={self.m_tiles}) fit the cap of "
                                 f"{self.register_cap} (ctas_per_sm={self.ctas_per_sm}, "
                                 f"num_warps={self.num_warps}); lower unroll, row_tiles or ctas_per_sm")
        if self.shared_mem_bytes > 48 * 1024:
            self._fail("warps_k", f"such that the cross-warp sums fit 48 KiB of shared memory "
                                  f"(needs {self.shared_mem_bytes} bytes)")

    @property
    def threads_per_block(self) -> int:
        return self.num_warps * 32

    @property
    def warps_n(self) -> int:
        return self.num_warps // self.warps_k

    @property
    def cta_rows(self) -> int:
        """Weight rows (outputs along N) per CTA tile."""
        return 16 * self.row_tiles * self.warps_n

    @property
    def register_cap(self) -> int:
        """Registers per thread the kernel is compiled for (__maxnreg__): ``max_registers``, or the
        most that let ``ctas_per_sm`` CTAs share an SM's 65536 (a multiple of 8, at most 255)."""
        if self.max_registers:
            return self.max_registers
        return min(255, 65536 // (self.threads_per_block * self.ctas_per_sm)) // 8 * 8

    @property
    def registers_needed(self) -> int:
        return register_estimate(self.row_tiles, self.unroll, self.m_tiles, self.group_size > 0, self.has_zeros)

    @property
    def bytes_in_flight_per_sm(self) -> int:
        """Weight bytes each SM keeps requested: CTAs x warps x slots x 2 row_tiles loads x 16 B x 32."""
        return self.ctas_per_sm * self.num_warps * self.unroll * 2 * self.row_tiles * 16 * 32

    @property
    def shared_mem_bytes(self) -> int:
        """Two buffers (by tile parity) of the partial sums of warps 1.. along K, float32 accumulator
        fragments of 32 lanes."""
        return 2 * (self.warps_k - 1) * self.warps_n * self.row_tiles * self.m_tiles * 4 * 32 * 4

    def template_params(self):
        p = super().template_params()
        p.update(weight_kind_id=WEIGHT_DTYPES.index(self.weight_dtype),
                 zero_ctype="signed char" if self.weight_dtype == "int8" else "unsigned char",
                 activation_id=ACTIVATIONS.index(self.activation), register_cap=self.register_cap)
        return p

    def tiles(self, n: int) -> int:
        return -(-n // self.cta_rows)

    def grid(self, n: int, sm_count: int) -> tuple[int, int, int]:
        t = self.tiles(n)
        return (min(t, sm_count * self.ctas_per_sm) if self.persistent else t, self.split_k, 1)

    def tag(self) -> str:
        """Short name of the tiling (benchmark tables)."""
        return (f"r{self.row_tiles}u{self.unroll}w{self.num_warps}k{self.warps_k}s{self.split_k}"
                f"c{self.ctas_per_sm}{'p' if self.persistent else ''}")


# ---- heuristics ---------------------------------------------------------------------------------
# Reasoned from the bytes each SM must keep in flight and from the 2026-11-25 sweep (H100, the
# earlier kernel that issued an iteration's loads and waited for them: row_tiles 1 beat 2 and 4 at
# every shape, 4096 x 4096 37.9 -> 44.6% of copy, 14336 x 4096 58.1 -> 74.4%):
# * Little's law: an H100 SM's share of 3 TB/s is ~22.6 B/ns; at ~1-1.5 us of loaded DRAM latency an
#   SM must keep 23-34 KB of weight requests outstanding, all the time.  With the slots refilled
#   as soon as they are consumed, in flight per SM = ctas_per_sm x num_warps x unroll x 2 row_tiles
#   x 16 B x 32 lanes: 2 x 8 x 4 x 2 x 16 x 32 = 64 KiB (2x margin for the moments a warp waits at
#   the per-tile barrier or on x);
# * row_tiles 1: the N tiles are 16 rows, so the tiles split evenly over the SMs (N = 14336: 896
#   tiles, at most 7 per SM against 6.8 on average) and the register cap of 2 CTAs of 8 warps
#   (128) holds unroll 4 of one row tile with room (see register_estimate);
# * 8 warps all along K: a tile's 16 rows x K bytes are read by 8 warps at once (K / 8 per warp,
#   64 * unroll consecutive bytes of each row per round), summed once per tile in shared memory;
# * persistent: 2 x SMs CTAs walk the tiles, a warp's next tile loading while it finishes this one
#   (no per-CTA ramp-up; the last round of tiles is the only tail);
# * split_k only when the tiles leave SMs without a CTA (N < ~2100 on 132 SMs), and only as far as
#   every warp keeps two 64-element blocks: the partials cost a second launch and
#   4 * split_k * M * N bytes.
_TILE_FIELDS = ("row_tiles", "unroll", "num_warps", "warps_k", "split_k", "ctas_per_sm", "persistent",
                "max_registers")   # what config= overrides
_WARPS = 8
_WARPS_K = 8
_CTAS_PER_SM = 2
_UNROLL = 4
_FILL = 0.95             # CTAs >= 95% of the SMs count as filling them (N = 4096: 128 of 132)
_X_L1_BYTES = 128 * 1024  # x that stays in L1 (256 KiB less shared memory and the weight stream)


def heuristic_config(dtype: str, m: int, n: int, k: int, *, weight_dtype: str = "int8",
                     scale_dtype: str = "float32", group_size: int = 0, has_zeros: bool = False,
                     has_bias: bool = False, activation: str = "none", w_vec: int = 16, x_vec: int = 8,
                     sm_count: int | None = None) -> QuantGemvConfig:
    """The config the op runs for (M <= 16, N, K) and the given layout."""
    if sm_count is None:
        sm_count = device.sm_count() if device.has_gpu() else 132
    need = math.ceil(_FILL * sm_count)
    m_tiles = 1 if m <= 8 else 2
    row_tiles = 1
    # ptxas (NVRTC 13.5, sm_90) under a cap of 112, 16 below the 128 the kernel gets (margin for
    # other NVRTC versions, tests/test_quant_matmul.py): unroll 4 fits every one-m-tile variant and
    # two m tiles with per-row scales without spilling; two m tiles with group scales (the block's
    # own accumulators and per-slot scales) spill at unroll 3 (4-116 bytes), so they keep 2.
    # Narrower loads (K, a stride or a base not 16-byte aligned: a byte-by-byte weight load builds
    # each register from 4 loads and shifts) spilled 8 bytes at unroll 4 under 112: unroll 2 there.
    unroll = _UNROLL if (m_tiles == 1 or not group_size) and w_vec == 16 else 2
    # M > 8 (two m tiles): a warp of 16 weight rows reads 2 bytes of x per weight byte (16 x rows x
    # 2 B against 16 rows x 1 B).  While x (M x K x 2 bytes) stays in L1 beside the weight stream
    # (<= 128 KiB: K <= 4096 at M = 16) a tile's re-reads hit L1; past that every tile reads x from
    # L2, twice the weight traffic.  Two warps along N (warps_k 4) read each x slice together, the
    # second from L1: x at 1x the weight bytes, which the earlier kernel ran at (its row_tiles 2;
    # M = 16 was at or above M = 1 at every large shape).  Only where the 32-row tiles still give
    # every SM two CTAs.  (Reasoned; the sweep times w8k4 beside w8k8 at M = 16.)
    warps_k = _WARPS_K
    if m_tiles == 2 and m * k * 2 > _X_L1_BYTES and -(-n // 32) >= 2 * need:
        warps_k = _WARPS_K // 2
    tiles = -(-n // (16 * row_tiles * (_WARPS // warps_k)))
    nblk = -(-k // 64)
    split = 1
    if tiles < need:
        split = max(1, min(-(-need // tiles), nblk // (2 * warps_k), 16))
    return QuantGemvConfig(dtype=dtype, weight_dtype=weight_dtype, scale_dtype=scale_dtype, group_size=group_size,
                           has_zeros=has_zeros, has_bias=has_bias, activation=activation or "none",
                           m_tiles=m_tiles, row_tiles=row_tiles, unroll=unroll, num_warps=_WARPS,
                           warps_k=warps_k, split_k=split, ctas_per_sm=_CTAS_PER_SM, persistent=True,
                           w_vec=w_vec, x_vec=x_vec)


def candidate_configs(base: QuantGemvConfig) -> list[QuantGemvConfig]:
    """Tile variants of ``base`` for the benchmark's sweep (same dtypes, widths and epilogue): the
    slots in flight (unroll) for three CTA shapes of 16 warps per SM, then one knob at a time
    around ``base``: 8 warps as 2 x 4 (N x K), 3 CTAs per SM (24 warps, 80 registers), not
    persistent, row_tiles 2."""
    variants = [dict(row_tiles=1, unroll=u, num_warps=nw, warps_k=nw, ctas_per_sm=16 // nw)
                for nw in (8, 4, 16) for u in (2, 4, 6, 8)]
    variants += [dict(num_warps=8, warps_k=4), dict(ctas_per_sm=3, unroll=2), dict(persistent=False),
                 dict(row_tiles=2, unroll=2)]
    out, seen = [], set()
    for v in variants:
        try:
            c = base.replace(**v)
        except ConfigError:
            continue
        if c.key() not in seen:
            seen.add(c.key())
            out.append(c)
    return out


def _vec_width(k: int, ptr: int, stride: int | None, itemsize: int, widest: int) -> int:
    """Widest load (elements) dividing K, the row stride (when rows > 1) and the base address."""
    v = widest
    while v > 1 and (k % v or ptr % (v * itemsize) or (stride is not None and stride % v)):
        v //= 2
    return v


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


@dataclass(frozen=True)
class _SplitPlan:
    """A split-K launch pair: the GEMV writes float32 partials, the reduce adds them in order."""
    main: Launch
    reduce: Launch
    ws_shape: tuple
    out: OutputPlan    # for allocating the output (its launch is ``reduce``)


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
    float32 partials and a second small kernel when N is too small to fill the GPU).  M > 16
    dequantizes w_q into an (N, K) workspace of x's dtype and runs :func:`rtkernels.matmul` on its
    transpose: a correctness path, not tuned (and the dequantized weight is rounded to x's dtype).
    """
    key = _PLANS.key((x, w_q, scales, zeros, bias, out), (group_size, activation, weight_dtype, dtype, config))
    plan = _PLANS.get(key)
    if plan is not None:
        return _replay(plan, (w_q, x, scales, zeros, bias), out, stream)
    if activation not in (None, *ACTIVATIONS):
        raise ConfigError.bad_value(OP, "activation", activation, "None, 'relu', 'gelu' or 'silu'")
    act = activation or "none"
    group = _group(group_size, OP)
    stream = default_stream(x, stream)

    # checks: w_q (N, K) bytes, x (..., K), scales / zeros / bias, out (..., N)
    wv, wdt = _weight_kind(w_q, weight_dtype)
    if wv.ndim != 2:
        raise ConfigError(f"{OP}: w_q has shape {wv.shape}; expected (N, K) as nn.Linear stores a weight",
                          field="w_q", value=wv.shape)
    n, k = (int(d) for d in wv.shape)
    winfo = views.of(wv)
    if winfo.kind not in (views.CONTIGUOUS, views.EMPTY):
        raise views.reject(OP, "w_q", winfo, "is not C-contiguous", "pass the (N, K) weight as stored "
                           "(w_q.contiguous() once, outside the hot path)")
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
    ss = _dense("scales", scales, stream)
    ds = dtype_name(ss)
    ds = "bfloat16" if ds == "uint16" else ds
    if _is_torch(scales):
        ds = dtype_name(scales)
    want_s = (n,) if not group else (n, -(-k // group))
    if ds not in SCALE_DTYPES or tuple(ss.shape) != want_s:
        raise ConfigError(f"{OP}: scales is {ds} {tuple(ss.shape)}; expected float32/float16/bfloat16 of shape "
                          f"{want_s} (group_size={group_size})", field="scales", value=(ds, tuple(ss.shape)))
    zv = None
    if zeros is not None:
        if wdt == "float8_e4m3":
            raise ConfigError(f"{OP}: zeros apply to integer weights, not float8_e4m3", field="zeros")
        zv = _dense("zeros", zeros, stream)
        if dtype_name(zv) != wdt or tuple(zv.shape) != want_s:
            raise ConfigError(f"{OP}: zeros is {dtype_name(zv)} {tuple(zv.shape)}; expected {wdt} of shape {want_s}",
                              field="zeros", value=(dtype_name(zv), tuple(zv.shape)))
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
    common = dict(weight_dtype=wdt, scale_dtype=ds, group_size=group, has_zeros=zv is not None)

    if m > GEMV_MAX_ROWS:
        _dequantized_matmul(xv, wv, ss, zv, bv, ov, m, n, k, ldx, ldo, ngroups, QuantGemvConfig(
            dtype=dx, w_vec=w_vec, **common), act, stream)
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
    _launch(key, cfg, m, n, k, ldx, ldo, ngroups, (wv, xv, ss, zv, bv, ov), (w_q, x, scales, zeros, bias, out),
            stream)
    return out


def _launch(key, cfg, m, n, k, ldx, ldo, ngroups, views_, arrays, stream) -> None:
    """Launch cfg on the views (w, x, scales, zeros, bias, out) and keep the plan when no view is a copy."""
    kern = get_kernel(cfg, "quant_gemv")
    grid, block = cfg.grid(n, device.sm_count()), (cfg.threads_per_block, 1, 1)
    ints = (m, n, k, ldx, ldo, ngroups)
    keep = key is not None and same_memory(views_, arrays)
    if cfg.split_k == 1:
        launch = Launch(kern, grid, block, cfg.shared_mem_bytes, (None, *ints))
        launch.run(views_, stream)
        if keep:
            _PLANS.put(key, OutputPlan.of(launch, arrays[5], like=arrays[1]))
        return
    ws_shape = (cfg.split_k, m, n)
    ws = _workspace(arrays[1], ws_shape, "float32", stream)
    main = Launch(kern, grid, block, cfg.shared_mem_bytes, ints)
    main.run((*views_, ws), stream)
    red = Launch(get_kernel(cfg, "quant_gemv_reduce"), (-(-m * n // 256), 1, 1), (256, 1, 1), 0, (m, n, ldo))
    red.run((ws, views_[4], views_[5]), stream)
    if keep:
        _PLANS.put(key, _SplitPlan(main, red, ws_shape, OutputPlan.of(red, arrays[5], like=arrays[1])))


def _workspace(like, shape, dtype: str, stream):
    """Scratch memory ordered with the call's stream: a torch tensor for torch inputs (torch's
    allocator), else CuPy's pool under ``stream`` (a block is handed back only on that stream)."""
    if _is_torch(like):
        return new_like(like, shape, dtype)
    import cupy
    with cupy_stream(stream):
        return cupy.empty(shape, dtype=np.uint16 if dtype == "bfloat16" else dtype)


def _replay(plan, inputs, out, stream):
    """Replay a recorded plan on ``inputs`` (w_q, x, scales, zeros, bias) and ``out``."""
    x = inputs[1]
    if isinstance(plan, OutputPlan):
        out = plan.output(x, out)
        plan.replay((*inputs, out), default_stream(x, stream) if plan.torch else stream)
        return out
    out = plan.out.output(x, out)
    stream = default_stream(x, stream)
    ws = _workspace(x, plan.ws_shape, "float32", stream)
    plan.main.run((*inputs, out, ws), stream)
    plan.reduce.run((ws, inputs[4], out), stream)
    return out


def _dequantized_matmul(xv, wv, ss, zv, bv, ov, m, n, k, ldx, ldo, ngroups, cfg, act, stream) -> None:
    """M > 16: dequantize w into an (N, K) workspace of x's dtype (``cfg``'s dequantize kernel), then
    rtk.matmul(x, wd, trans_b=True) (a correctness path: 5 bytes of traffic per weight element, not
    tuned)."""
    import cupy
    with cupy_stream(stream):
        wd = cupy.empty((n, k), dtype=np.uint16 if cfg.dtype == "bfloat16" else np.float16)
    if k:
        chunks = n * (-(-k // 16))
        get_kernel(cfg, "quant_dequantize").launch((-(-chunks // 256),), (256,), wv, ss, zv, wd, n, k, ngroups,
                                                   stream=stream)
    item = xv.itemsize
    x2 = cupy.lib.stride_tricks.as_strided(xv, (m, k), (ldx * item, item))
    o2 = cupy.lib.stride_tricks.as_strided(ov, (m, n), (ldo * item, item))
    matmul(x2, wd, bias=bv, activation=None if act == "none" else act, out=o2, trans_b=True,
           dtype=cfg.dtype, stream=stream)
