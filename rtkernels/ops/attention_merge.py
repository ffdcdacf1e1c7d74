"""attention_merge: combine partial attention results (o, lse) over disjoint key sets, in one pass.

>>> o, lse = rtk.attention_merge(o_acc, lse_acc, o_blk, lse_blk)               # in place into o_acc, lse_acc
>>> o, lse = rtk.attention_merge(o_acc, lse_acc, o_blk, lse_blk, rows=(1, s))  # o_blk holds rows 1..s-1
>>> out, lse = rtk.attention_merge(o_acc, lse_acc, o_blk, lse_blk, out=o_bf16) # merged, written as bfloat16

Two attention results over key sets K_a and K_b of the same queries give attention over
K_a + K_b by their log-sum-exps: ``lse = log(e^lse_a + e^lse_b)``, ``o = e^(lse_a - lse) o_a +
e^(lse_b - lse) o_b``.  Ring attention (:mod:`rtkernels.dist`) merges one block per ring step;
split-KV decoding does the same over splits.  o arrays are (batch, seqlen, nheads, head_dim) in
float16, bfloat16 or float32, each its own type (a float32 accumulator, a bfloat16 block and a
bfloat16 result in one call); lse arrays are float32 (batch, nheads, seqlen), the layout
``rtk.attention`` returns.  ``rows=(lo, hi)``: the block covers rows lo..hi-1 of the result (a
query block); rows outside it keep a's values.  A row whose lse is -inf saw no key: it weighs 0
and its o is never read, so empty rows may hold anything.  Strided views are taken as they are
(last dimension contiguous).

:func:`add_rows` is the same kernel adding instead of merging (``out = a + b`` over b's rows):
gradient accumulation across ring steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..config import KernelConfig, register_family
from ..errors import ConfigError
from ._arrays import as_device_array, default_stream, dtype_name

FAMILY = "attention_merge"
_FLOATS = ("float16", "bfloat16", "float32")
_INT_MAX = 2 ** 31 - 1
# 8 warps per block: a memory-bound pass with one row vector per lane group and no shared
# memory; 256 threads keep the block count low and occupancy full (reasoned, as for the
# elementwise family's copies; the merge is timed inside tools/bench_ring.py).
BLOCK_SIZE = 256


@register_family
@dataclass(frozen=True)
class AttentionMergeConfig(KernelConfig):
    """One specialization of the merge kernel (templates/attention_merge.cu.j2).

    Parameters
    ----------
    dtype_a, dtype_b, dtype_out : float16, bfloat16 or float32: storage of the running result a,
        the block b and the output (float32 arithmetic throughout).
    combine : "lse" (merge by log-sum-exp weights) or "sum" (out = a + b).
    has_a : False when there is no a (out = b; dtype_a is then taken equal to dtype_b).
    vec : elements per access, 1, 2 or 4 (head_dim, the strides and the base addresses must be
        multiples of it).
    threads_per_row : lanes sharing one (batch, row, head) vector: a power of two <= 32.
    block_size : threads per block, a multiple of 32 in [32, 1024].
    """

    family: ClassVar[str] = FAMILY
    template: ClassVar[str] = "attention_merge.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("attention_merge",)

    dtype_a: str = "float32"
    dtype_b: str = "bfloat16"
    dtype_out: str = "float32"
    combine: str = "lse"
    has_a: bool = True
    vec: int = 4
    threads_per_row: int = 32
    block_size: int = BLOCK_SIZE

    def __post_init__(self):
        for field in ("dtype_a", "dtype_b", "dtype_out"):
            self._check_dtype(field, _FLOATS)
        self._check_choice("combine", ("lse", "sum"))
        self._check_choice("has_a", (False, True))
        self._check_choice("vec", (1, 2, 4))
        self._check_int("threads_per_row", 1, 32, power_of_two=True)
        self._check_int("block_size", 32, 1024, multiple_of=32)
        if not self.has_a:
            object.__setattr__(self, "dtype_a", self.dtype_b)   # unused: one key per kernel

    @property
    def threads_per_block(self) -> int:
        return self.block_size

    def grid(self, vectors: int) -> tuple[int]:
        """Blocks for ``vectors`` (batch, row, head) vectors."""
        per_block = self.block_size // self.threads_per_row
        return (-(-vectors // per_block),)


def threads_per_row(head_dim: int, vec: int) -> int:
    """Lanes per row vector: enough to cover head_dim in one sweep, up to a warp (head_dim 256 in
    float32 vec 4: two sweeps of 32 lanes)."""
    chunks = -(-head_dim // vec)
    return min(32, 1 << max(0, (chunks - 1).bit_length()))


# ---- the op -------------------------------------------------------------------------------
def _bad(field: str, value: Any, message: str) -> ConfigError:
    return ConfigError(f"{FAMILY}: {message}", family=FAMILY, field=field, value=value, allowed=message)


def _float_dtype(x, name: str, dtype: str | None) -> str:
    actual = dtype_name(x)
    if actual == "uint16":
        if dtype == "bfloat16":
            return "bfloat16"
        raise _bad(name, actual, f"{name} has dtype uint16; to pass bfloat16 bits in a uint16 CuPy array, call "
                                 "with dtype='bfloat16'")
    if actual not in _FLOATS:
        raise _bad(name, actual, f"{name} has dtype {actual}; allowed: {', '.join(_FLOATS)}")
    return actual


def _elem_strides(view, name: str) -> tuple[int, ...]:
    item = view.itemsize
    if any(s % item for s in view.strides):
        raise _bad(name, view.strides, f"{name} has strides {view.strides} bytes, not whole elements")
    out = tuple(0 if n == 1 else s // item for n, s in zip(view.shape, view.strides))
    if view.shape[-1] > 1 and out[-1] != 1:
        raise _bad(name, out, f"{name} must have a contiguous last dimension (stride 1), got element strides {out}")
    return out


def _same_view(x, y) -> bool:
    return (x is not None and y is not None and x.data.ptr == y.data.ptr and x.shape == y.shape
            and x.strides == y.strides and x.dtype == y.dtype)


def _pick_vec(head_dim: int, arrays) -> int:
    """Widest access (elements) that head_dim, every row stride and every base address allow."""
    for vec in (4, 2, 1):
        if head_dim % vec:
            continue
        if all(ptr % (vec * item) == 0 and all(s % vec == 0 for s in strides[:3]) for ptr, item, strides in arrays):
            return vec
    return 1


def attention_merge(o_a, lse_a, o_b, lse_b, *, rows: tuple[int, int] | None = None, out=None, lse_out=None,
                    dtype: str | None = None, stream=None):
    """Merge the partial attention result (o_b, lse_b) into (o_a, lse_a).

    Parameters
    ----------
    o_a : (batch, seqlen, nheads, head_dim) float16 / bfloat16 / float32, or None (no a: the
        result is b's rows).  lse_a : float32 (batch, nheads, seqlen), None with o_a.
    o_b : (batch, hi - lo, nheads, head_dim), the block; lse_b : float32 (batch, nheads, hi - lo).
    rows : (lo, hi): the result rows the block covers; default all (o_b has seqlen rows).
    out, lse_out : where the result goes; default o_a and lse_a (in place: only rows lo..hi-1
        are touched).  Otherwise every row is written (rows outside the block copy a), in out's
        dtype, which may differ from o_a's.  out must not overlap o_b.
    dtype : "bfloat16" to read uint16 CuPy arrays as bfloat16 bits.
    stream : CuPy stream, torch stream or raw handle (default: CuPy's current stream, or torch's
        current stream for torch inputs).

    Returns
    -------
    ``(out, lse_out)``.  A row that sees no key in either part has o = 0 and lse = -inf.

    Raises
    ------
    ConfigError : shapes, dtypes, devices, rows or strides that do not fit; nothing launched.
    """
    return _combine("lse", o_a, lse_a, o_b, lse_b, rows, out, lse_out, dtype, stream)


def add_rows(a, b, *, rows: tuple[int, int] | None = None, out=None, dtype: str | None = None, stream=None):
    """``out[:, lo:hi] = a[:, lo:hi] + b`` for 4-D (batch, seqlen, nheads, head_dim) arrays (float16,
    bfloat16 or float32, each its own type); a may be None (out = b, a conversion).  out defaults
    to a (in place, rows lo..hi-1 only); another out gets a's values outside the block.
    Same arguments otherwise as :func:`attention_merge`.  Returns out."""
    return _combine("sum", a, None, b, None, rows, out, None, dtype, stream)[0]


def _combine(combine, o_a, lse_a, o_b, lse_b, rows, out, lse_out, dtype, stream):
    import cupy
    lse = combine == "lse"
    names = ("o_a", "o_b", "out") if lse else ("a", "b", "out")
    if out is None:
        if o_a is None:
            raise _bad("out", None, f"out is required when {names[0]} is None")
        out = o_a
    if lse and lse_out is None:
        lse_out = lse_a
    views = {n: (None if x is None else as_device_array(x, FAMILY, n)) for n, x in zip(names, (o_a, o_b, out))}
    av, bv, ov = views[names[0]], views[names[1]], views["out"]
    dts = {n: _float_dtype(x, n, dtype) for n, x in zip(names, (o_a, o_b, out)) if x is not None}
    for name, v in views.items():
        if v is not None and v.ndim != 4:
            raise _bad(name, v.shape, f"{name} must be 4-D (batch, seqlen, nheads, head_dim), got shape "
                                      f"{tuple(v.shape)}")
    batch, seqlen, heads, head_dim = ov.shape
    if av is not None and av.shape != ov.shape:
        raise _bad(names[0], av.shape, f"{names[0]} must have out's shape {tuple(ov.shape)}, got {tuple(av.shape)}")
    lo, hi = (0, seqlen) if rows is None else rows
    if not (isinstance(lo, (int, np.integer)) and isinstance(hi, (int, np.integer)) and 0 <= lo <= hi <= seqlen):
        raise _bad("rows", rows, f"rows must be (lo, hi) with 0 <= lo <= hi <= seqlen={seqlen}, got {rows!r}")
    lo, hi = int(lo), int(hi)
    want_b = (batch, hi - lo, heads, head_dim)
    if tuple(bv.shape) != want_b:
        raise _bad(names[1], bv.shape, f"{names[1]} must have shape {want_b} (rows {lo}..{hi - 1} of "
                                       f"{tuple(ov.shape)}), got {tuple(bv.shape)}")
    if max(batch * seqlen * heads, seqlen, head_dim) > _INT_MAX // 2:
        raise _bad("out", ov.shape, f"batch * seqlen * nheads must stay below {_INT_MAX // 2}, got {tuple(ov.shape)}")
    lviews = {}
    if lse:
        if (o_a is None) != (lse_a is None):
            raise _bad("lse_a", None if lse_a is None else "given", "o_a and lse_a come together (both or neither)")
        for name, x, n in (("lse_a", lse_a, seqlen), ("lse_b", lse_b, hi - lo), ("lse_out", lse_out, seqlen)):
            if x is None:
                lviews[name] = None
                continue
            v = as_device_array(x, FAMILY, name)
            if tuple(v.shape) != (batch, heads, n) or str(v.dtype) != "float32":
                raise _bad(name, v.shape, f"{name} must be a float32 array of shape {(batch, heads, n)}, got "
                                          f"{v.dtype} {tuple(v.shape)}")
            lviews[name] = v
        if lviews["lse_out"] is None:
            raise _bad("lse_out", None, "lse_out is required when lse_a is None")
    devs = {int(v.device.id) for v in (*views.values(), *lviews.values()) if v is not None}
    if len(devs) != 1:
        raise _bad("device", sorted(devs), "every array must be on the same device")
    if batch * seqlen * heads == 0 or head_dim == 0:
        return out, lse_out
    strides = {n: _elem_strides(v, n) for n, v in views.items() if v is not None}
    lstrides = {n: (v.strides[0] // 4, v.strides[1] // 4, v.strides[2] // 4) if v is not None else (0, 0, 0)
                for n, v in lviews.items()}
    in_place = _same_view(av, ov) and (not lse or _same_view(lviews["lse_a"], lviews["lse_out"]))
    if in_place or av is None:
        row_begin, nrows = lo, hi - lo   # rows outside the block are left alone
    else:
        row_begin, nrows = 0, seqlen
    arrays = [(int(v.data.ptr), v.itemsize, strides[n]) for n, v in views.items() if v is not None]
    vec = _pick_vec(head_dim, arrays)
    cfg = AttentionMergeConfig(dtype_a=dts.get(names[0], dts[names[1]]), dtype_b=dts[names[1]],
                               dtype_out=dts["out"], combine=combine, has_a=av is not None, vec=vec,
                               threads_per_row=threads_per_row(head_dim, vec))
    from ..kernel import get_kernel
    sa = strides.get(names[0], (0, 0, 0, 0))
    sb, so = strides[names[1]], strides["out"]
    la, lb, lo_ = (lstrides.get(n, (0, 0, 0)) for n in ("lse_a", "lse_b", "lse_out"))
    with cupy.cuda.Device(devs.pop()):
        k = get_kernel(cfg)
        k.launch(cfg.grid(batch * nrows * heads), (cfg.block_size,),
                 av, lviews.get("lse_a"), bv, lviews.get("lse_b"), ov, lviews.get("lse_out"),
                 batch, nrows, heads, head_dim, row_begin, lo, hi,
                 sa[0], sa[1], sa[2], sb[0], sb[1], sb[2], so[0], so[1], so[2],
                 la[0], la[1], la[2], lb[0], lb[1], lb[2], lo_[0], lo_[1], lo_[2],
                 stream=default_stream(o_b, stream))
    return out, lse_out


# ---- reference ----------------------------------------------------------------------------
def attention_merge_reference(o_a, lse_a, o_b, lse_b, rows: tuple[int, int] | None = None):
    """float64 NumPy merge: ``(o, lse)`` over all rows (rows outside ``rows`` are a's).  o_a /
    lse_a may be None (empty a).  Rows with lse = -inf weigh 0 whatever their o holds."""
    o_b = np.asarray(o_b, np.float64)
    lse_b = np.asarray(lse_b, np.float64)
    if o_a is None:
        seqlen = o_b.shape[1] if rows is None else rows[1]
        o_a = np.zeros((o_b.shape[0], seqlen) + o_b.shape[2:])
        lse_a = np.full((o_b.shape[0], o_b.shape[2], seqlen), -np.inf)
    o = np.array(o_a, np.float64)
    lse = np.array(lse_a, np.float64)
    lo, hi = (0, o.shape[1]) if rows is None else rows
    la = lse[:, :, lo:hi]
    m = np.maximum(la, lse_b)
    empty = m == -np.inf
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        new = np.where(empty, -np.inf, m + np.log(np.exp(la - np.where(empty, 0, m))
                                                  + np.exp(lse_b - np.where(empty, 0, m))))
        wa = np.where(la == -np.inf, 0.0, np.exp(la - np.where(empty, 0, new)))
        wb = np.where(lse_b == -np.inf, 0.0, np.exp(lse_b - np.where(empty, 0, new)))
    # (batch, heads, rows) weights onto (batch, rows, heads, 1)
    wa_, wb_ = (np.transpose(w, (0, 2, 1))[..., None] for w in (wa, wb))
    blk_a = np.where(wa_ > 0, o[:, lo:hi], 0.0)
    blk_b = np.where(wb_ > 0, o_b, 0.0)
    o[:, lo:hi] = wa_ * blk_a + wb_ * blk_b
    rest = np.ones(o.shape[1], bool)
    rest[lo:hi] = False
    o[:, rest] = np.where(np.transpose(lse[:, :, rest], (0, 2, 1))[..., None] == -np.inf, 0.0, o[:, rest])
    lse[:, :, lo:hi] = new
    return o, lse
