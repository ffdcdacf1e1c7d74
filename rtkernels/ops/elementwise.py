"""elementwise: fused kernels generated from an expression.

>>> f = rtk.elementwise("y = sin(x)*sin(x) + cos(x)*cos(x)")
>>> y = f(x)                       # CuPy in, CuPy out
>>> g = rtk.elementwise("t = a*x + b; y = gelu(t)")
>>> y = g(x, 2.0, b_array)         # inputs in order of first use: a, x, b; scalars broadcast

Statements are ``name = expression`` separated by ``;`` or newlines.  The outputs are the
names given by ``outputs=`` (default: the last statement's target); other targets are
temporaries; every other name that is not called as a function is an input, in order of
first appearance.  Math runs in float32 (float64 when any input or output is float64), with
CUDA's math library plus ``sigmoid, silu, relu, gelu, gelu_tanh, where``.
"""
from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import device
from ..config import KernelConfig, register_family
from ..errors import ConfigError
from ..kernel import get_kernel
from . import views
from ._arrays import as_device_array, default_stream, dtype_name, new_like

_TOKEN = re.compile(r"\d+\.?\d*(?:[eE][+-]?\d+)?[fF]?|\.\d+(?:[eE][+-]?\d+)?[fF]?|[A-Za-z_]\w*|\s+|.")
_IDENT = re.compile(r"^[A-Za-z_]\w*$")
_RESERVED = {"true", "false", "acc_t", "n", "i", "j", "u", "base", "stride", "tid", "nvec", "iv", "body", "VEC",
             "UNROLL", "BLOCK_SIZE", "M_PI", "INFINITY", "NAN"}
_FLOATS = ("float16", "bfloat16", "float32", "float64")

# Measured on an H200 (2026-11-21, tools/bench_core.py sweep over unroll 1-8, block 128-512, grid
# 1/2/4 resident waves or uncapped, streaming on/off; 2^28 elements): one thread per UNROLL vectors
# with an uncapped grid beat every grid-stride variant.  unroll=2, block 128, uncapped: 98.8% of the
# device copy for fp32 y=2x+1, 96.5% for fp16, 101.9% for z=x+w; the earlier default (unroll 4,
# block 256, one resident wave) reached 88.7 / 87.4 / 95.7%.  Streaming hints changed nothing (±0.3%).
GRID_WAVES = 0
DEFAULT_BLOCK = 128


def _unroll(n_inputs: int) -> int:
    return 2




@register_family
@dataclass(frozen=True)
class ElementwiseConfig(KernelConfig):
    """A fused elementwise kernel: statements, typed inputs/outputs, vector width."""

    family: ClassVar[str] = "elementwise"
    template: ClassVar[str] = "elementwise.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("elementwise",)
    expected_global_width: ClassVar[int | None] = 128
    statements: tuple = ("y = x;",)
    inputs: tuple = (("x", "float32"),)      # (name, dtype | "scalar")
    outputs: tuple = (("y", "float32"),)     # (name, dtype)
    compute: str = "float32"
    vec: int = 4
    unroll: int = 4
    block_size: int = 256
    fast_math: bool = False
    streaming: bool = False

    def __post_init__(self):
        object.__setattr__(self, "statements", tuple(self.statements))
        object.__setattr__(self, "inputs", tuple(tuple(p) for p in self.inputs))
        object.__setattr__(self, "outputs", tuple(tuple(p) for p in self.outputs))
        for field, pairs in (("inputs", self.inputs), ("outputs", self.outputs)):
            for name, dt in pairs:
                if not _IDENT.match(name) or keyword.iskeyword(name) or name in _RESERVED:
                    self._fail(field, f"pairs (identifier, dtype); {name!r} is not a usable name")
                if dt not in _FLOATS and not (field == "inputs" and dt == "scalar"):
                    self._fail(field, f"pairs (name, dtype) with dtype in {', '.join(_FLOATS)}"
                                      + (" or 'scalar'" if field == "inputs" else ""))
        if not self.outputs:
            self._fail("outputs", "at least one (name, dtype) pair")
        self._check_choice("compute", ("float32", "float64"))
        self._check_int("vec", 1, 16, power_of_two=True)
        self._check_int("unroll", 1, 8)
        self._check_int("block_size", 32, 1024, power_of_two=True)
        widest = max([np.dtype("uint16" if d == "bfloat16" else d).itemsize
                      for _, d in self.inputs + self.outputs if d != "scalar"], default=4)
        if self.vec * widest > 16:
            self._fail("vec", f"at most {16 // widest} for {widest}-byte elements (one access moves at most 16 bytes)")

    @property
    def threads_per_block(self) -> int:
        return self.block_size

    def compile_options(self):
        from ..compiler import CompileOptions
        return CompileOptions(fast_math=self.fast_math)


def parse_statements(expr: str, outputs: tuple[str, ...] | None = None):
    """Split the expression into C++ statements; return (statements, inputs, outputs)."""
    stmts = [s.strip() for s in re.split(r"[;\n]", expr) if s.strip()]
    if not stmts:
        raise ConfigError("elementwise: empty expression; write e.g. 'y = 2*x + 1'", field="expr", value=expr)
    assigned: list[str] = []
    inputs: list[str] = []
    parsed = []
    for s in stmts:
        m = re.match(r"^([A-Za-z_]\w*)\s*=(?!=)\s*(.+)$", s)
        if not m:
            raise ConfigError(f"elementwise: statement {s!r} is not of the form 'name = expression'",
                              field="expr", value=expr)
        target, rhs = m.group(1), m.group(2)
        tokens = [t for t in _TOKEN.findall(rhs)]
        for idx, tok in enumerate(tokens):
            if not _IDENT.match(tok) or tok in ("true", "false") or tok in assigned or tok in inputs:
                continue
            rest = "".join(tokens[idx + 1:]).lstrip()
            if rest.startswith("("):
                continue  # a function call
            if keyword.iskeyword(tok) or tok in _RESERVED:
                raise ConfigError(f"elementwise: {tok!r} cannot be used as a variable name", field="expr", value=expr)
            inputs.append(tok)
        if target in _RESERVED or keyword.iskeyword(target) or target in inputs:
            raise ConfigError(f"elementwise: cannot assign to {target!r} (an input or reserved name)",
                              field="expr", value=expr)
        parsed.append((target, rhs))
        if target not in assigned:
            assigned.append(target)
    outs = tuple(outputs) if outputs else (parsed[-1][0],)
    for o in outs:
        if o not in assigned:
            raise ConfigError(f"elementwise: output {o!r} is never assigned", field="outputs", value=outs)
    declared: set[str] = set(outs)
    cpp = []
    for target, rhs in parsed:
        decl = "" if target in declared else "acc_t "
        declared.add(target)
        cpp.append(f"{decl}{target} = {rhs};")
    return tuple(cpp), tuple(inputs), outs


class ElementwiseFunction:
    """A callable fused kernel; specialized (and cached) per input dtypes and alignment.

    Views: contiguous inputs are read in place; any other view (broadcast by ``expand`` /
    ``broadcast_to``, strided, transposed, reversed, overlapping) is first copied to a contiguous
    array on the launch stream.  Outputs must be contiguous; a broadcast or overlapping ``out`` is
    rejected (its writes would race).  Elements not aligned to their size are rejected.
    """

    def __init__(self, expr: str, outputs=None, out_dtype=None, fast_math: bool = False, block_size: int = DEFAULT_BLOCK,
                 unroll: int | None = None, grid_waves: int | None = None, streaming: bool = False):
        self.expr = expr
        self.unroll, self.grid_waves, self.streaming = unroll, grid_waves, streaming
        self._fast: dict = {}
        self.statements, self.input_names, self.output_names = parse_statements(
            expr, tuple(outputs) if outputs else None)
        self.out_dtype = None if out_dtype is None else dtype_name(np.empty(0, dtype=out_dtype)) \
            if out_dtype != "bfloat16" else "bfloat16"
        self.fast_math = fast_math
        self.block_size = block_size
        self._plans: dict = {}

    def __repr__(self) -> str:
        return f"<rtkernels.elementwise {self.expr!r}: ({', '.join(self.input_names)}) -> " \
               f"({', '.join(self.output_names)})>"

    def __call__(self, *args, out=None, stream=None, dtype=None):
        """Apply to arrays/scalars in the order of ``self.input_names``.

        ``dtype="bfloat16"`` reads uint16 CuPy arrays as bfloat16 bits.  ``out`` is an array
        (one output) or a tuple of arrays.
        """
        if dtype is None and (out is None or type(out) is _cupy_ndarray()):
            res = self._fast_call(args, out, stream)
            if res is not _SLOW:
                return res
        if len(args) != len(self.input_names):
            raise TypeError(f"elementwise {self.expr!r} takes {len(self.input_names)} inputs "
                            f"({', '.join(self.input_names)}), got {len(args)}")
        arrays, kinds, shape, first = [], [], None, None
        for name, a in zip(self.input_names, args):
            if isinstance(a, (bool, int, float, np.number)):
                kinds.append("scalar")
                arrays.append(float(a))
                continue
            view = as_device_array(a, "elementwise", name)
            dt = dtype or dtype_name(a)
            if dt not in _FLOATS:
                raise ConfigError(f"elementwise: input {name} has dtype {dt}; allowed: {', '.join(_FLOATS)}",
                                  field=name, value=dt, allowed=", ".join(_FLOATS))
            if shape is None:
                shape, first = view.shape, a
            elif view.shape != shape:
                raise ConfigError(f"elementwise: input {name} has shape {view.shape}, expected {shape} "
                                  "(arrays must have equal shapes; only scalars broadcast)")
            if not view.flags.c_contiguous or view.data.ptr % view.itemsize:
                # the kernel walks n consecutive elements: other views (broadcast, strided,
                # transposed, reversed, overlapping) are copied on the launch stream, one extra pass
                view, copied = views.read_view("elementwise", name, view, default_stream(first, stream),
                                               lambda i: i.kind == views.CONTIGUOUS)
                if copied:
                    a = view
            kinds.append(dt)
            arrays.append(a)
        if shape is None:
            raise ConfigError("elementwise: at least one input must be an array")
        in_dts = [k for k in kinds if k != "scalar"]
        out_dt = self.out_dtype or (in_dts[0] if len(set(in_dts)) == 1 else "float32"
                                    if "float64" not in in_dts else "float64")
        outs = self._outputs(out, first, shape, out_dt)
        n = int(np.prod(shape))
        if n == 0:
            return outs[0] if len(outs) == 1 else tuple(outs)
        ptrs = [_ptr(a) for a in arrays if not isinstance(a, float)] + [_ptr(o) for o in outs]
        sizes = [np.dtype("uint16" if d == "bfloat16" else d).itemsize for d in in_dts + [out_dt] * len(outs)]
        widest = max(sizes)
        vec = 16 // widest
        while vec > 1 and any(p % (vec * s) for p, s in zip(ptrs, sizes)):
            vec //= 2   # misaligned views (e.g. offset by one element) take narrower accesses
        compute = "float64" if "float64" in in_dts + [out_dt] else "float32"
        plan_key = (tuple(kinds), out_dt, vec, compute, device.current_device())
        plan = self._plans.get(plan_key)
        if plan is None:
            cfg = ElementwiseConfig(statements=self.statements,
                                    inputs=tuple(zip(self.input_names, kinds)),
                                    outputs=tuple((o, out_dt) for o in self.output_names),
                                    compute=compute, vec=vec, unroll=self.unroll or _unroll(len(in_dts)),
                                    block_size=self.block_size, fast_math=self.fast_math, streaming=self.streaming)
            k = get_kernel(cfg)
            waves = self.grid_waves if self.grid_waves is not None else GRID_WAVES
            max_grid = device.sm_count() * (2048 // cfg.block_size) * waves if waves else 2 ** 31 - 1
            plan = self._plans[plan_key] = (k, cfg.block_size * cfg.unroll * cfg.vec, max_grid,
                                            _np_dtype(out_dt), cfg.block_size)
            if vec == 16 // widest and len(outs) == 1 and out_dt != "bfloat16" and "bfloat16" not in in_dts:
                fast_key = (tuple(None if k_ == "scalar" else np.dtype(k_) for k_ in kinds), plan_key[-1])
                self._fast[fast_key] = plan
        k, per_block, max_grid, _, bs = plan
        grid = max(1, min((n + per_block - 1) // per_block, max_grid))
        k.launch((grid, 1, 1), (bs, 1, 1), *arrays, *outs, n, stream=default_stream(first, stream))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _fast_call(self, args, out, stream):
        """CuPy arrays of equal shape, contiguous and 16-byte aligned, seen before: no re-planning."""
        nd = _cupy_ndarray()
        if len(args) != len(self.input_names) or len(self.output_names) != 1:
            return _SLOW
        first = None
        sig = []
        align = 0
        for a in args:
            t = type(a)
            if t is nd:
                if first is None:
                    first = a
                elif a.shape != first.shape:
                    return _SLOW
                if not a.flags.c_contiguous:
                    return _SLOW
                sig.append(a.dtype)
                align |= a.data.ptr
            elif t is float or t is int:
                sig.append(None)
            else:
                return _SLOW
        if first is None:
            return _SLOW
        dev = first.data.device_id
        plan = self._fast.get((tuple(sig), dev))
        if plan is None:
            return _SLOW
        k, per_block, max_grid, out_dtype, bs = plan
        if out is None:
            out = _cupy_empty(first.shape, out_dtype)
        elif out.shape != first.shape or out.dtype != out_dtype or not out.flags.c_contiguous:
            return _SLOW
        if (align | out.data.ptr) & 15:
            return _SLOW
        n = first.size
        if n == 0:
            return out
        grid = (n + per_block - 1) // per_block
        k.launch((grid if grid < max_grid else max_grid, 1, 1), (bs, 1, 1), *args, out, n, stream=stream)
        return out

    def _outputs(self, out, first, shape, out_dt):
        if out is None:
            return [new_like(first, shape, out_dt) for _ in self.output_names]
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != len(self.output_names):
            raise ConfigError(f"elementwise: {len(self.output_names)} output(s) expected, got {len(outs)}")
        for name, o in zip(self.output_names, outs):
            v = as_device_array(o, "elementwise", f"out ({name})")
            odt = dtype_name(o) if not (out_dt == "bfloat16" and str(v.dtype) == "uint16") else "bfloat16"
            if v.shape != shape or odt != out_dt:
                raise ConfigError(f"elementwise: out ({name}) must be a contiguous {out_dt} array of shape {shape}, "
                                  f"got {odt} {v.shape}", field="out", value=(odt, v.shape))
            if not v.flags.c_contiguous or v.data.ptr % v.itemsize:   # (else distinct, aligned elements)
                info = views.of(v)
                accepted = f"pass a contiguous {out_dt} array of shape {shape}"
                views.check_output("elementwise", f"out ({name})", info, accepted)
                if info.kind not in (views.CONTIGUOUS, views.EMPTY):
                    raise views.reject("elementwise", f"out ({name})", info, "is not contiguous", accepted)
        return outs


_SLOW = object()


_CUPY = None


def _cupy():
    """CuPy, imported once on first use (the module must import without a GPU stack)."""
    global _CUPY
    if _CUPY is None:
        import cupy
        _CUPY = cupy
    return _CUPY


def _cupy_ndarray():
    return (_CUPY or _cupy()).ndarray


def _cupy_empty(shape, dtype):
    return (_CUPY or _cupy()).empty(shape, dtype)


def _np_dtype(name: str):
    return np.dtype("uint16" if name == "bfloat16" else name)


def _ptr(a) -> int:
    data = getattr(a, "data", None)
    if hasattr(data, "ptr"):
        return int(data.ptr)
    if hasattr(a, "data_ptr"):
        return int(a.data_ptr())
    return int(a.__cuda_array_interface__["data"][0])


def elementwise(expr: str, *, outputs=None, out_dtype=None, fast_math: bool = False, block_size: int = DEFAULT_BLOCK,
                unroll: int | None = None, grid_waves: int | None = None,
                streaming: bool = False) -> ElementwiseFunction:
    """Build a fused elementwise kernel from an expression (compiled on first call per dtype).

    ``unroll`` (vectors in flight per thread), ``grid_waves`` (resident-grid multiples; 0 = one
    thread per vector group) and ``streaming`` (evict-first loads/stores) are tuning knobs; the
    defaults are the measured best (tools/bench_core.py).
    """
    return ElementwiseFunction(expr, outputs=outputs, out_dtype=out_dtype, fast_math=fast_math,
                               block_size=block_size, unroll=unroll, grid_waves=grid_waves, streaming=streaming)
