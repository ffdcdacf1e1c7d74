"""fp8 matmul on Hopper: ``rtk.matmul`` on float8 e4m3 / e5m2 operands (templates/matmul_fp8_sm90.cu.j2).

>>> c = rtk.matmul(a, w.t(), scale_a=sa, scale_b=sw)            # torch float8_e4m3fn, bf16 out
>>> c = rtk.matmul(a, w.t(), scale_a=sa_rows, scale_b=sw_cols, bias=b, activation="gelu",
...                out_dtype="float32")
>>> c = rtk.matmul(a_u8, w_u8, trans_b=True, dtype="float8_e4m3")   # CuPy uint8 bits

:func:`rtkernels.matmul` hands fp8 calls here (:func:`matmul_fp8`): check -> plan -> launch.

Layouts.  8-bit wgmma reads both operands K-major from shared memory, so the kernel wants A as
(M, K) with K contiguous and B as the transpose of an (N, K) array with K contiguous -- what
``torch._scaled_mm`` requires of its mat2 (``w.t()`` of a row-major weight ``w``); such operands
go straight into the TMA descriptors.  An operand in the other layout (a row-major (K, N) B, a
column-major A) is transposed once into a K-major copy by a small kernel
(:class:`Fp8TransposeConfig`, ``templates/transpose8.cu.j2``) on the call's stream: a read and a
write of its bytes (about 5% of an 8192^3 matmul for B), and such calls keep no launch plan.  We
transpose rather than refuse because the result is correct for every layout the bf16 path takes;
store weights as (N, K) to skip the copy.

TMA addresses rows by 16-byte strides, so K must be a positive multiple of 16 (the row stride of
a contiguous fp8 operand is K bytes; a ConfigError otherwise, ``torch._scaled_mm`` has the same
rule).  A K-major view is read in place when a tensor map can address it: 16-byte aligned base,
a row stride that is a positive multiple of 16 bytes (padded rows, a column slice starting on a
16-byte boundary), no broadcast or overlapping rows.  Other views are copied to a dense K-major
buffer first (:func:`operand_layout`: an unaligned slice, ``expand``-ed rows, ``as_strided``
overlaps, CuPy's negative strides, no unit-stride dim).  Operands are 2-D: batched (3-D) ones are
a ConfigError (fold the batch into M).
M and N are free: boxes past the edges are zero-filled on load and clipped on store.

Scales are float32 device arrays: per tensor (shape () or (1,)), per row of A (``scale_a``: (M,)
or (M, 1)) and per column of B (``scale_b``: (N,) or (1, N)), read by the kernel's epilogue (never
on the host: a call can be captured in a CUDA graph).  Output bfloat16 (default), float16 or
float32; ``bias`` (N,) in any of those three, added after the scales; the activations are
:mod:`matmul`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import arch as arch_mod
from .. import autotune, device
from .._env import getenv
from ..config import KernelConfig, register_family
from ..errors import ConfigError
from ..kernel import get_kernel
from . import matmul_sm90 as m90
from . import views
from .matmul_common import activation_reference, tune_bucket
from ._arrays import Launch, LaunchPlans, OutputPlan, address, as_device_array, cupy_stream, default_stream

# Canonical names (torch's) and the spellings the ``dtype=`` argument accepts for uint8 arrays.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
_FP8_ALIASES = {"float8_e4m3fn": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}
OUT_DTYPES = ("bfloat16", "float16", "float32")
SCALE_A_KINDS = ("none", "tensor", "row")
SCALE_B_KINDS = ("none", "tensor", "col")
_PRODUCER_REGS, _CONSUMER_REGS = m90._PRODUCER_REGS, m90._CONSUMER_REGS   # 40 + 2 * 232 = 3 * 168
_ACC_LIMIT = 192   # f32 accumulators (plus promoted sums) per consumer thread that fit in 232 registers


@register_family
@dataclass(frozen=True)
class MatmulFp8Config(m90.HopperMatmulTile, KernelConfig):
    """One Hopper fp8 matmul specialization (both operands K-major; see the module docstring).

    ``a_dtype`` / ``b_dtype``: "float8_e4m3fn" or "float8_e5m2" (all four pairs are wgmma types).
    ``out_dtype``: "bfloat16", "float16" or "float32"; ``bias_dtype`` likewise (with ``has_bias``).
    ``block_m`` x ``block_n``: the output tile; two consumer warpgroups own block_m / 2 rows each.
    ``block_k`` is 128 (one 128-byte swizzle row of 8-bit values: 4 wgmma k32 per K step).
    ``promote_interval``: K steps (of 128) the tensor cores accumulate before their partial sum is
    added into a separate f32 accumulator with ordinary FADDs; 0 keeps one accumulator ("fast
    accumulation").  Hopper adds fp8 products into the accumulator with about 14 mantissa bits
    kept (DeepSeek-V3, section 3.3.2: up to ~2% relative error at K = 4096), so a long K needs the
    promotion to stay near torch._scaled_mm's error, whose default (use_fast_accum=False) promotes
    the same way.  1 = every 128 K (CUTLASS's default interval of 4 k32 instructions, DeepGEMM's
    choice); it costs one wgmma.wait_group 0 per K step and the second accumulator's registers,
    which bound the tile at 64 x 192 per consumer warpgroup.
    ``scale_a``: "none", "tensor" or "row"; ``scale_b``: "none", "tensor" or "col".
    ``tma_store``: stage C through shared memory and store it by TMA (16-bit outputs whose base
    and row stride are 16-byte aligned); False: direct stores with bounds checks.
    ``epilogue_n``: columns per epilogue pass (0: the widest that fits beside the ring).
    """

    family: ClassVar[str] = "matmul_fp8_sm90"
    template: ClassVar[str] = "matmul_fp8_sm90.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("matmul_fp8_sm90",)
    needs_arch_specific: ClassVar[bool] = True
    expects_tensor_cores: ClassVar[bool] = True
    expected_global_width: ClassVar[int | None] = None
    a_dtype: str = "float8_e4m3fn"
    b_dtype: str = "float8_e4m3fn"
    out_dtype: str = "bfloat16"
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_stages: int = 6
    group_m: int = 8
    promote_interval: int = 1
    has_bias: bool = False
    bias_dtype: str = "bfloat16"
    activation: str = "none"
    scale_a: str = "none"
    scale_b: str = "none"
    tma_store: bool = True
    epilogue_n: int = 0

    def __post_init__(self):
        if self.activation is None:
            object.__setattr__(self, "activation", "none")
        for f in ("a_dtype", "b_dtype"):
            v = _FP8_ALIASES.get(getattr(self, f)) if isinstance(getattr(self, f), str) else None
            if v is None:
                self._fail(f, "one of " + ", ".join(map(repr, (*FP8_DTYPES, "float8_e4m3"))))
            object.__setattr__(self, f, v)
        self._check_dtype("out_dtype", OUT_DTYPES)
        self._check_dtype("bias_dtype", OUT_DTYPES)
        self._check_choice("activation", m90.ACTIVATIONS)
        self._check_choice("scale_a", SCALE_A_KINDS)
        self._check_choice("scale_b", SCALE_B_KINDS)
        for f in ("has_bias", "tma_store"):
            if not isinstance(getattr(self, f), bool):
                self._fail(f, "True or False")
        self._check_choice("block_m", (128, 256))
        self._check_int("block_n", 64, 256, multiple_of=64)
        self._check_int("block_k", 128, 128)
        self._check_int("num_stages", 2, 10)
        self._check_int("group_m", 1, 64)
        self._check_int("promote_interval", 0, 64)
        acc = (self.block_m // 2) * self.block_n // 128 * (2 if self.promote_interval else 1)
        if acc > _ACC_LIMIT:
            what = "accumulators and promoted sums" if self.promote_interval else "accumulators"
            self._fail("block_n", f"such that a consumer thread holds at most {_ACC_LIMIT} {what} (block_m="
                                  f"{self.block_m}, promote_interval={self.promote_interval}: {acc}; more would spill)")
        if self.tma_store and self.out_dtype == "float32":
            self._fail("tma_store", "False with out_dtype='float32' (the TMA-store epilogue writes 16-bit outputs)")
        self._check_epilogue_and_smem()

    @property
    def stage_bytes(self) -> int:
        return (self.block_m + self.block_n) * self.block_k

    def template_params(self):
        p = super().template_params()
        p.update(type_a=FP8_DTYPES.index(self.a_dtype), type_b=FP8_DTYPES.index(self.b_dtype),
                 activation_id=m90.ACTIVATIONS.index(self.activation),
                 scale_a_id=SCALE_A_KINDS.index(self.scale_a), scale_b_id=SCALE_B_KINDS.index(self.scale_b),
                 epilogue_n=self.epi_n, shared_mem_bytes=self.shared_mem_bytes, producer_regs=_PRODUCER_REGS,
                 consumer_regs=_CONSUMER_REGS)
        return p


# ---- heuristics ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tile:
    block_m: int
    block_n: int
    num_stages: int
    efficiency: float   # relative tensor-core throughput when the SMs are busy
    why: str
    promote_interval: int = 1


# REASONED, NOT YET MEASURED (no GPU in this session; `tools/bench_matmul_fp8.py --sweep` times
# every tile below and TUNE_ONLY at 4096^3 / 8192^3 for the next revision of these numbers).
# With promotion a consumer thread holds two accumulators, so m64n256 (128 + 128 registers) is out
# and m64n192 (96 + 96) is the widest wgmma.  Shared-memory reads per tensor-core cycle decide the
# order, as in the bf16 kernel (whose 128x128 tile runs at 0.91x its 128x256): an m64nNk32 fp8
# wgmma reads 2 KiB of A and N * 32 bytes of B in 2 * 64 * N * 32 / 8192 cycles (dense fp8 rate
# of an SM): 85 bytes/cycle at N = 192, 96 at N = 128, 128 at N = 64 (the SM reads 128).
# Ring depth: as many 128-deep stages as fit beside the epilogue's staging buffer.
TILES = (
    _Tile(128, 192, 5, 0.96, "two m64n192 chains with promoted sums, 5 x 40 KiB ring (reasoned)"),
    _Tile(128, 128, 6, 0.91, "m64n128: half the promoted registers, 6 x 32 KiB ring; divides 4096-wide N (reasoned)"),
    _Tile(128, 64, 8, 0.60, "thin N or small problems only (reasoned)"),
)
# Tried by the autotuner (RTKERNELS_AUTOTUNE=1), never picked without a measurement.
TUNE_ONLY = (
    _Tile(128, 192, 5, 0.96, "promote every 256 K: half the wgmma.wait 0 stalls, more error", promote_interval=2),
    _Tile(128, 128, 6, 0.91, "promote every 256 K", promote_interval=2),
    _Tile(128, 192, 4, 0.96, "one 192-column epilogue pass, shallower ring"),
)
# Fast accumulation (promote_interval=0): the bf16 kernel's 128x256 tile fits again.  Never the
# default (error up to ~2% at K = 4096, see MatmulFp8Config); the autotuner does not try it
# either, because a winner must keep the default's accuracy.  Benchmarks report it beside.
FAST_ACCUM_TILES = (
    _Tile(128, 256, 4, 1.00, "two m64n256 chains, one accumulator: the bf16 kernel's workhorse", promote_interval=0),
)


def estimated_cost(tile: _Tile, m: int, n: int, sm_count: int) -> float:
    tiles = arch_mod.matmul_tiles(m, n, tile.block_m, tile.block_n)
    rounds = -(-tiles // sm_count)
    return rounds * tile.block_m * tile.block_n / tile.efficiency


def _config(tile: _Tile, **layout) -> MatmulFp8Config:
    return MatmulFp8Config(block_m=tile.block_m, block_n=tile.block_n, num_stages=tile.num_stages,
                           promote_interval=tile.promote_interval, **layout)


def heuristic_config(m: int, n: int, k: int, *, sm_count: int = 132, **layout) -> MatmulFp8Config:
    """The heuristic's config; ``layout``: a_dtype, b_dtype, out_dtype, has_bias, bias_dtype,
    activation, scale_a, scale_b, tma_store.  ``k`` does not change the tile (every K streams
    through the same ring)."""
    tile = min(TILES, key=lambda t: (estimated_cost(t, m, n, sm_count), t.block_m * t.block_n))
    return _config(tile, **layout)


def candidate_configs(**layout) -> list[MatmulFp8Config]:
    out = []
    for t in TILES + TUNE_ONLY:
        try:
            out.append(_config(t, **layout))
        except ConfigError:
            pass
    return out


def grid_size(m: int, n: int, cfg: MatmulFp8Config, sm_count: int) -> int:
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    return max(1, min(tiles, sm_count))


def tensor_maps(cfg: MatmulFp8Config, a_desc, b_desc, c_desc):
    """The three tensor-map arguments; each ``*_desc`` is (ptr, shape, strides), outermost first."""
    from ..tma import tensor_map
    ma = tensor_map(a_desc[0], "uint8", a_desc[1], a_desc[2], (cfg.block_m, cfg.block_k))
    mb = tensor_map(b_desc[0], "uint8", b_desc[1], b_desc[2], (cfg.block_n, cfg.block_k))
    mc = (tensor_map(c_desc[0], cfg.out_dtype, c_desc[1], c_desc[2], (cfg.block_m // 2, 64))
          if cfg.tma_store else ma)
    return ma, mb, mc


# ---- the transpose pass for operands that are not K-major ------------------------------------
@register_family
@dataclass(frozen=True)
class Fp8TransposeConfig(KernelConfig):
    """Transpose of an 8-bit (rows, cols) matrix (any row stride) into a (cols, rows) buffer whose
    row stride ``ldo`` is a multiple of 16 (templates/transpose8.cu.j2): 64 x 64 byte tiles through
    shared memory, ``block_size`` threads, 4-byte loads where the source allows them (``vec_in``)."""

    family: ClassVar[str] = "transpose8"
    template: ClassVar[str] = "transpose8.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("transpose8",)
    expected_global_width: ClassVar[int | None] = None
    block_size: int = 256
    vec_in: bool = True

    def __post_init__(self):
        self._check_choice("block_size", (256,))
        if not isinstance(self.vec_in, bool):
            self._fail("vec_in", "True or False")

    @property
    def threads_per_block(self) -> int:
        return self.block_size


def _transpose(src, stream):
    """The transpose of the uint8 (R, C) CuPy view ``src`` (unit column stride, any row stride) into a
    new (C, ldo) buffer with ``ldo`` the multiple of 16 >= R: (view (C, R) of it, ldo)."""
    import cupy
    r, c = src.shape
    ld = src.strides[0] if r > 1 else c
    ldo = -(-r // 16) * 16
    cs = cupy_stream(stream)
    with cs:   # CuPy's pool reuses a block only on the stream it was allocated on: after our reads
        buf = cupy.empty((c, ldo), dtype=cupy.uint8)
    cfg = Fp8TransposeConfig(vec_in=bool(int(src.data.ptr) % 4 == 0 and ld % 4 == 0))
    get_kernel(cfg).launch((-(-c // 64), -(-r // 64), 1), (cfg.block_size, 1, 1), src, buf, r, c, ld, ldo, stream=cs)
    return buf[:, :r], ldo


def _aligned_copy(v, stream):
    """A copy of the uint8 (rows, cols) view ``v`` (unit column stride) with 16-byte aligned rows."""
    import cupy
    rows, cols = v.shape
    ldo = -(-cols // 16) * 16
    with cupy_stream(stream):
        buf = cupy.empty((rows, ldo), dtype=cupy.uint8)
        buf[:, :cols] = v
    return buf[:, :cols], ldo


# ---- the op -----------------------------------------------------------------------------------
def fp8_dtype_of(x) -> str | None:
    """The canonical fp8 name of a torch float8 tensor (or anything whose dtype prints as one), else None."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        return None
    name = str(dt).rpartition(".")[2]
    return name if name in FP8_DTYPES else None


def wants_fp8(a, b, dtype, scale_a, scale_b, out_dtype) -> bool:
    """Whether a :func:`rtkernels.matmul` call is an fp8 call (fp8 operands, a float8 ``dtype=``,
    or an fp8-only argument given)."""
    if scale_a is not None or scale_b is not None or out_dtype is not None:
        return True
    if fp8_dtype_of(a) or fp8_dtype_of(b):
        return True
    names = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
    return any(isinstance(d, str) and d.startswith("float8") for d in names)


def _operand_dtypes(a, b, dtype) -> tuple[str, str]:
    allowed = "'float8_e4m3fn' (or 'float8_e4m3'), 'float8_e5m2', or a pair of them (a's, b's)"
    if dtype is None:
        da, db = fp8_dtype_of(a), fp8_dtype_of(b)
        for name, x, d in (("a", a, da), ("b", b, db)):
            if d is None:
                raise ConfigError(f"matmul: {name} has dtype {getattr(x, 'dtype', None)}; fp8 matmul (scale_a, "
                                  f"scale_b or out_dtype given, or the other operand fp8) takes torch float8_e4m3fn"
                                  f" / float8_e5m2 tensors, or uint8 arrays with dtype={allowed}",
                                  field=name, value=str(getattr(x, "dtype", None)))
        return da, db
    pair = tuple(dtype) if isinstance(dtype, (tuple, list)) else (dtype, dtype)
    # torch dtype objects (torch.float8_e4m3fn) by their names
    pair = tuple(d if isinstance(d, str) or d is None else str(d).rpartition(".")[2] for d in pair)
    if len(pair) != 2 or not all(isinstance(d, str) and d in _FP8_ALIASES for d in pair):
        raise ConfigError.bad_value("matmul", "dtype", dtype, allowed)
    out = []
    for name, x, d in (("a", a, pair[0]), ("b", b, pair[1])):
        have = fp8_dtype_of(x) or str(getattr(x, "dtype", None)).rpartition(".")[2]
        want = _FP8_ALIASES[d]
        if have not in ("uint8", "int8", want):
            raise ConfigError(f"matmul: {name} has dtype {have}, but dtype={dtype!r} says {want}; pass uint8 "
                              f"bits (CuPy) or a torch {want} tensor", field=name, value=have)
        out.append(want)
    return out[0], out[1]


def _bytes_view(x, name: str):
    """A zero-copy uint8 CuPy view of an fp8 operand (torch float8 tensors through a uint8 view)."""
    if fp8_dtype_of(x) is not None and hasattr(x, "view") and hasattr(x, "is_cuda"):
        import torch
        x = x.view(torch.uint8)
    v = as_device_array(x, "matmul", name)
    if v.dtype.itemsize != 1:
        raise ConfigError(f"matmul: {name} has {v.dtype.itemsize}-byte elements; fp8 operands are 1 byte",
                          field=name, value=str(v.dtype))
    return v.view("uint8") if v.dtype.name != "uint8" else v


def _float_view(x, name: str, allowed: tuple[str, ...]):
    """(CuPy view, dtype name) of a float argument; a uint16 CuPy array counts as bfloat16 bits."""
    from ._arrays import dtype_name
    try:
        v = as_device_array(x, "matmul", name)
    except TypeError:
        raise ConfigError(f"matmul: {name} must be a device array ({' or '.join(allowed)}), got "
                          f"{type(x).__name__}", field=name, value=type(x).__name__) from None
    d = dtype_name(x)
    if d == "uint16" and "bfloat16" in allowed:
        d = "bfloat16"
    if d not in allowed:
        raise ConfigError(f"matmul: {name} has dtype {d}; it must be " + " or ".join(allowed), field=name, value=d)
    return v, d


def _scale_kind(x, name: str, per: str, length: int):
    """(kind, view) of a scale argument: "tensor" (one element), or one per row of A ("row": (M,)
    or (M, 1)) / column of B ("col": (N,) or (1, N)) with unit stride; ("none", None) without one."""
    if x is None:
        return "none", None
    v, _ = _float_view(x, name, ("float32",))
    shape = tuple(v.shape)
    if v.size == 1 and len(shape) <= 2:
        return "tensor", v
    want = ((length,), (length, 1)) if per == "row" else ((length,), (1, length))
    if shape not in want:
        what = " or ".join(map(str, want))
        raise ConfigError(f"matmul: {name} has shape {shape}; expected a per-tensor scale (shape () or (1,)) or "
                          f"one per {'row of a' if per == 'row' else 'column of b'}: {what}", field=name, value=shape)
    step = v.strides[shape.index(length)]
    if step != 4:
        raise ConfigError(f"matmul: {name} must have unit stride (its {length} values are {step} bytes apart)",
                          field=name, value=v.strides)
    return per, v.reshape(-1)


# What the op does with a (rows, K) uint8 operand view (rows: M for a, N for b's transpose).
IN_PLACE, TRANSPOSE, COPY = "in place", "transpose", "copy"


def operand_layout(info: views.ViewInfo) -> tuple[str, int]:
    """(how, row stride in bytes of what the kernel's tensor map then reads) for the
    :func:`views.classify` of a (rows, K) 8-bit operand (K >= 16, so K is never a unit extent).

    * ``IN_PLACE``: the view as it is, when a tensor map addresses it (``info.tma``: 16-byte
      aligned base, K contiguous, a positive row stride that is a multiple of 16 bytes, nothing
      broadcast or overlapping); the stride is its row stride (one row: any multiple of 16 --
      the map never steps it -- we pass K).
    * ``TRANSPOSE``: its rows dim is the contiguous one (a column-major a, a row-major (K, N) b),
      non-negative strides: transposed into a K-major buffer with rows of K bytes (K % 16 == 0).
    * ``COPY``: anything else -- K contiguous but a base or row stride off 16 bytes, rows
      broadcast by ``expand`` (stride 0) or overlapping (``as_strided``), negative strides, no
      unit-stride dim -- is copied element by element into a dense (rows, K) buffer.
    Pure (no device): the CPU tests check every in-place claim against the view's addresses."""
    rows, k = info.shape
    if info.tma:
        return IN_PLACE, (info.strides[0] if rows > 1 else k)
    if rows > 1 and info.unit(0) and info.kind != views.NEGATIVE:
        return TRANSPOSE, k
    return COPY, k


def _kmajor(v, stream):
    """(view, row stride in bytes, copied) of operand ``v`` ((rows, K), uint8) as the kernel reads
    it (see :func:`operand_layout`)."""
    how, ld = operand_layout(views.of(v))
    if how == IN_PLACE:
        return v, ld, False
    if how == TRANSPOSE:
        buf, ld = _transpose(v.T, stream)
    else:
        buf, ld = _aligned_copy(v, stream)
    return buf, ld, True


def operand_maps(cfg: MatmulFp8Config, m: int, n: int, k: int, lda: int, ldb: int, ldc: int):
    """The tensor-map descriptions (cfg, a's, b's, c's or None) a launch encodes with each call's
    addresses (:func:`_args`): (shape, strides in elements), outermost first."""
    return (cfg, ((m, k), (lda, 1)), ((n, k), (ldb, 1)), ((m, n), (ldc, 1)) if cfg.tma_store else None)


_LAUNCHES = LaunchPlans()
_plans: dict = {}


def _args(maps, arrays):
    """Kernel array arguments for (A, B, bias, C, scale_a, scale_b): the three encoded maps, then
    bias, C and the scales."""
    cfg, a_map, b_map, c_map = maps
    a, b, bias, c, sa, sb = arrays
    return [*tensor_maps(cfg, (address(a), *a_map), (address(b), *b_map),
                         None if c_map is None else (address(c), *c_map)), bias, c, sa, sb]


def matmul_fp8(a, b, *, bias=None, activation=None, out=None, trans_a: bool = False, trans_b: bool = False,
               dtype=None, scale_a=None, scale_b=None, out_dtype=None, stream=None):
    """fp8 ``activation(scale_a * scale_b * (a @ b) + bias)``; called by :func:`rtkernels.matmul`,
    whose docstring lists the arguments.  Checks, plan, launch; a call whose signature (dtypes,
    shapes, strides, alignment, options) was seen before replays its plan."""
    key = _LAUNCHES.key((a, b, bias, out, scale_a, scale_b),
                        (activation, bool(trans_a), bool(trans_b), dtype if not isinstance(dtype, list) else
                         tuple(dtype), out_dtype, autotune.enabled(), getenv("RTKERNELS_ARCH")))
    plan = _LAUNCHES.get(key)
    if plan is not None:
        o = plan.output(a, out)
        plan.replay((a, b, bias, o, scale_a, scale_b), default_stream(a, stream) if plan.torch else stream, _args)
        return o

    # ---- checks
    if activation not in (None, *m90.ACTIVATIONS):
        raise ConfigError.bad_value("matmul", "activation", activation, "None, 'relu', 'gelu' or 'silu'")
    act = activation or "none"
    stream = default_stream(a, stream)
    ta, tb = _operand_dtypes(a, b, dtype)
    av, bv = _bytes_view(a, "a"), _bytes_view(b, "b")
    for name, v in (("a", av), ("b", bv)):
        if v.ndim != 2:
            raise ConfigError(f"matmul: {name} has shape {v.shape}; fp8 matmul takes 2-D operands (batch them "
                              "into M)", field=name, value=v.shape)
    if trans_a:
        av = av.T
    if trans_b:
        bv = bv.T
    m, k = av.shape
    k2, n = bv.shape
    if k != k2:
        raise ConfigError(f"matmul: a is {m} x {k} and b is {k2} x {n} (after trans_a / trans_b); a.shape[-1] must "
                          "equal b.shape[-2]", field="shape", value=(av.shape, bv.shape))
    if k <= 0 or k % 16:
        raise ConfigError(f"matmul: K={k}; fp8 matmul needs K a positive multiple of 16 (TMA reads rows whose "
                          "stride is a multiple of 16 bytes; torch._scaled_mm has the same rule)", field="shape",
                          value=(av.shape, bv.shape), allowed="K % 16 == 0")
    if max(m, n, k) >= 2 ** 31:
        raise ConfigError(f"matmul: M, N, K = {m}, {n}, {k}; each must be < 2^31", field="shape")
    if out_dtype is None:
        od = "bfloat16" if out is None else _float_view(out, "out", OUT_DTYPES)[1]
    else:
        from .. import dtypes
        od = dtypes.canonical(out_dtype, family="matmul", field="out_dtype", allowed=OUT_DTYPES)
    if od not in OUT_DTYPES:
        raise ConfigError.bad_value("matmul", "out_dtype", od, "one of " + ", ".join(OUT_DTYPES))
    sa_kind, sav = _scale_kind(scale_a, "scale_a", "row", m)
    sb_kind, sbv = _scale_kind(scale_b, "scale_b", "col", n)
    if bias is not None:
        biv, bias_dt = _float_view(bias, "bias", OUT_DTYPES)
        if biv.shape != (n,):
            raise ConfigError(f"matmul: bias has shape {biv.shape}; expected ({n},)", field="bias", value=biv.shape)
        if biv.strides[0] != biv.itemsize and n > 1:
            raise ConfigError(f"matmul: bias must have unit stride (got {biv.strides[0]} bytes)", field="bias",
                              value=biv.strides)
    else:
        biv, bias_dt = None, "bfloat16"

    if not device.current_arch().startswith("sm_90"):
        raise ConfigError(f"matmul: fp8 operands need an sm_90 GPU (Hopper wgmma); this is {device.current_arch()}",
                          field="dtype", value=(ta, tb))

    from .. import dtypes
    from ._arrays import new_like
    if out is None:
        out = new_like(a, (m, n), od)
    cv, dc = _float_view(out, "out", OUT_DTYPES)
    if dc != od or cv.shape != (m, n):
        raise ConfigError(f"matmul: out is {dc} {cv.shape}; expected {od} {(m, n)}", field="out", value=(dc, cv.shape))
    if m == 0 or n == 0:   # nothing to write (and an empty array's strides are arbitrary)
        return out
    item = dtypes.itemsize(od)
    if n > 1 and cv.strides[1] != item or (m > 1 and (cv.strides[0] < n * item or cv.strides[0] % item)):
        raise ConfigError(f"matmul: out has byte strides {cv.strides}; it needs unit stride along N and rows that "
                          "do not overlap", field="out", value=cv.strides)

    # ---- plan: K-major operands (a transposed or compact copy where needed), tensor maps, config
    ak, lda, copied_a = _kmajor(av, stream)
    bk, ldb, copied_b = _kmajor(bv.T, stream)
    # (one row: no real stride; the tensor map still wants a multiple of 16 bytes)
    ldc = cv.strides[0] // item if m > 1 else -(-n * item // 16) * 16 // item
    tma_store = (od != "float32" and int(cv.data.ptr) % 16 == 0 and (ldc * item) % 16 == 0)
    c_aligned = int(int(cv.data.ptr) % (2 * item) == 0 and ldc % 2 == 0)
    layout = dict(a_dtype=ta, b_dtype=tb, out_dtype=od, has_bias=biv is not None, bias_dtype=bias_dt,
                  activation=act, scale_a=sa_kind, scale_b=sb_kind, tma_store=tma_store)
    dev = device.current_device()
    memo = (m, n, k, tuple(layout.items()), dev, autotune.enabled())
    hit = _plans.get(memo)
    if hit is None:
        sms = device.sm_count()
        cfg = heuristic_config(m, n, k, sm_count=sms, **layout)
        if autotune.enabled():
            cfg = _tuned(cfg, m, n, k, layout, ak, lda, bk, ldb, biv, cv, ldc, sav, sbv, stream)
        hit = _plans[memo] = (get_kernel(cfg), cfg, grid_size(m, n, cfg, sms))
    kern, cfg, grid = hit
    maps = operand_maps(cfg, m, n, k, lda, ldb, ldc)
    launch = Launch(kern, (grid, 1, 1), (cfg.threads_per_block, 1, 1), cfg.shared_mem_bytes, (m, n, k, ldc, c_aligned))
    operands = (ak, bk, biv, cv, sav, sbv)
    launch.run(_args(maps, operands), stream)
    arrays = (a, b, bias, out, scale_a, scale_b)
    if not (copied_a or copied_b) and all(x is None or int(v.data.ptr) == address(x) for v, x in zip(operands, arrays)):
        _LAUNCHES.put(key, OutputPlan.of(launch, out, maps, like=a))
    return out


def _tuned(default, m, n, k, layout, ak, lda, bk, ldb, biv, cv, ldc, sav, sbv, stream):
    key = {"m": tune_bucket(m), "n": tune_bucket(n), "k": tune_bucket(k), **layout}
    scratch = autotune._clone(cv, autotune._span(cv))
    sms = device.sm_count()
    item = cv.itemsize
    c_aligned = int(int(scratch.data.ptr) % (2 * item) == 0 and ldc % 2 == 0)

    def run(cfg):
        maps = operand_maps(cfg, m, n, k, lda, ldb, ldc)
        get_kernel(cfg).launch((grid_size(m, n, cfg, sms), 1, 1), (cfg.threads_per_block, 1, 1),
                               *_args(maps, (ak, bk, biv, scratch, sav, sbv)), m, n, k, ldc, c_aligned,
                               shared_mem=cfg.shared_mem_bytes, stream=stream)

    return autotune.pick("matmul_fp8_sm90", key, candidate_configs(**layout), run, default)


# ---- reference ----------------------------------------------------------------------------
def fp8_to_float(bits, dtype: str):
    """float64 NumPy values of fp8 bit patterns (uint8 array) in ``dtype`` ("float8_e4m3fn" /
    "float8_e5m2"); NaN for the NaN encodings."""
    import numpy as np
    u = np.asarray(bits, dtype=np.uint8).astype(np.int64)
    sign = np.where(u & 0x80, -1.0, 1.0)
    if _FP8_ALIASES[dtype] == "float8_e4m3fn":
        e, f, bias, mbits = (u >> 3) & 0xF, u & 0x7, 7, 3
        nan = (u & 0x7F) == 0x7F
        inf = np.zeros_like(nan)
    else:
        e, f, bias, mbits = (u >> 2) & 0x1F, u & 0x3, 15, 2
        nan = (e == 0x1F) & (f != 0)
        inf = (e == 0x1F) & (f == 0)
    mag = np.where(e == 0, f / (1 << mbits) * 2.0 ** (1 - bias), (1 + f / (1 << mbits)) * 2.0 ** (e - bias))
    out = sign * mag
    out = np.where(inf, sign * np.inf, out)
    return np.where(nan, np.nan, out)


def matmul_fp8_reference(a, b, *, a_dtype: str = "float8_e4m3fn", b_dtype: str | None = None, scale_a=None,
                         scale_b=None, bias=None, activation: str | None = None):
    """float64 NumPy reference of the fp8 matmul: ``a`` (M, K) and ``b`` (K, N) as uint8 bits (or
    float values), scales as float arrays (scalar, (M,) / (N,)), bias (N,)."""
    import numpy as np
    a = np.asarray(a)
    b = np.asarray(b)
    a64 = fp8_to_float(a, a_dtype) if a.dtype == np.uint8 else a.astype(np.float64)
    b64 = fp8_to_float(b, b_dtype or a_dtype) if b.dtype == np.uint8 else b.astype(np.float64)
    c = a64 @ b64
    if scale_a is not None:
        c = c * np.asarray(scale_a, dtype=np.float64).reshape(-1, 1)
    if scale_b is not None:
        c = c * np.asarray(scale_b, dtype=np.float64).reshape(1, -1)
    if bias is not None:
        c = c + np.asarray(bias, dtype=np.float64)
    return activation_reference(c, activation)
