"""What an array view is, decided in one place for every op: read it in place, stage it, or reject it.

An op's full path (never a launch plan's replay: a plan exists only for a signature whose views
were read in place) classifies each array by :func:`classify` - shape, byte strides, item size and
base address - and then, per argument, either reads the view as it is, *stages* it (a compact
copy made on the call's stream, :func:`compact`) or raises a :class:`ConfigError` that names the
argument, its shape and strides and what is accepted (:func:`reject`).  Kinds, the first that
applies:

``EMPTY``       a dimension of extent 0: nothing is read or written.
``MISALIGNED``  the base or a stride is not a multiple of the item size: elements straddle their
                natural alignment and no kernel (a copy included) may load them.  Rejected.
``CONTIGUOUS``  row-major and dense.  Dimensions of extent 1 have no stride: theirs is ignored.
``NEGATIVE``    a stride below 0 (CuPy's ``x[::-1]``, ``cupy.flip``).
``UNIT``        every stride >= 0 and at least one dimension of extent > 1 steps by one element
                (``unit_dims``): rows a kernel reads with unit-stride loads.
``STRIDED``     every stride >= 0 and none is one element (``x[:, ::2]``, a broadcast last dim).

Facts beside the kind: ``broadcast`` - the dimensions of extent > 1 and stride 0 (``expand``,
``broadcast_to``), whose indices all read one element; ``overlapping`` - whether the *other*
dimensions may map two indices to one element (``as_strided``), False only when proven distinct
(so a rare non-overlapping interleaving counts as overlapping); ``tma`` - whether a Hopper tensor
map addresses the view as it is (16-byte aligned base, unit-stride last dimension, every other
stride positive, a multiple of 16 bytes and below 2^40 bytes, nothing broadcast or overlapping).

What each kind means for an op is the op's choice (its docstring lists it); outputs are held to
one rule, :func:`check_output`: an output view whose elements may alias (broadcast or overlapping)
is rejected, because threads writing one element from two indices race.
"""
from __future__ import annotations

from typing import NamedTuple

from ..errors import ConfigError

EMPTY, MISALIGNED, CONTIGUOUS, NEGATIVE, UNIT, STRIDED = "empty", "misaligned", "contiguous", "negative", "unit", \
    "strided"
KINDS = (EMPTY, MISALIGNED, CONTIGUOUS, NEGATIVE, UNIT, STRIDED)
TMA_STRIDE_LIMIT = 2 ** 40   # bytes; the driver's bound on a tensor map's strides
_TMA_MAX_RANK = 5
_TMA_MAX_EXTENT = 2 ** 32


class ViewInfo(NamedTuple):
    """One view's classification (see the module docstring).  A NamedTuple: the ops classify on
    their full path, where a frozen dataclass's construction alone cost several microseconds."""

    shape: tuple
    strides: tuple        # bytes, as given
    itemsize: int
    address: int
    kind: str
    unit_dims: tuple      # dims of extent > 1 whose stride is one element
    broadcast: tuple      # dims of extent > 1 whose stride is 0
    overlapping: bool     # the non-broadcast dims may reach one element from two indices
    tma: bool

    @property
    def aliased(self) -> bool:
        """Two indices may name one element: broadcast or overlapping."""
        return bool(self.broadcast) or self.overlapping

    @property
    def elem_strides(self) -> tuple:
        """Strides in elements (for a MISALIGNED view, the floor; use :attr:`strides` there)."""
        return tuple(s // self.itemsize for s in self.strides)

    def unit(self, dim: int) -> bool:
        """Whether dimension ``dim`` can be read with unit stride: its stride is one element, or
        its extent is 1 (a stride that is never stepped)."""
        return self.shape[dim] == 1 or self.strides[dim] == self.itemsize

    def describe(self, name: str) -> str:
        """``name`` with its shape and strides, as a user wrote them (elements; bytes if
        misaligned)."""
        if self.kind == MISALIGNED:
            return f"{name} (shape {self.shape}, strides {self.strides} bytes, base {self.address:#x})"
        return f"{name} (shape {self.shape}, strides {self.elem_strides})"


def classify(shape, strides, itemsize: int, address: int) -> ViewInfo:
    """The :class:`ViewInfo` of a view: ``strides`` in bytes, ``address`` of element 0.  One pass
    of plain loops: it runs on every op's full path (a few microseconds)."""
    shape, strides = tuple(map(int, shape)), tuple(map(int, strides))
    itemsize, address = int(itemsize), int(address)
    if len(shape) != len(strides):
        raise ValueError(f"shape {shape} and strides {strides} differ in length")
    if 0 in shape:   # no element: nothing is read, nothing can alias (empty arrays carry any strides)
        return ViewInfo(shape, strides, itemsize, address, EMPTY, (), (), False, False)
    broadcast, unit_dims, stepped = [], [], []      # stepped: (|stride|, extent) of dims of stride != 0
    misaligned, negative, dense, expect = address % itemsize != 0, False, True, itemsize
    tma_strides = True                              # every stepped outer stride a TMA stride
    last = len(shape) - 1
    for d in range(last, -1, -1):
        n, s = shape[d], strides[d]
        if n == 1:
            continue
        if s != expect:
            dense = False
        expect *= n
        if s == 0:
            broadcast.append(d)
            continue
        if s == itemsize:
            unit_dims.append(d)
        elif s % itemsize:
            misaligned = True
        if s < 0:
            negative = True
            s = -s
        stepped.append((s, n))
        if d != last and (s % 16 or s >= TMA_STRIDE_LIMIT):
            tma_strides = False
    overlapping = _may_overlap(stepped, itemsize)
    if misaligned:
        kind = MISALIGNED
    elif dense:
        kind = CONTIGUOUS
    elif negative:
        kind = NEGATIVE
    else:
        kind = UNIT if unit_dims else STRIDED
    tma = (kind in (CONTIGUOUS, UNIT) and tma_strides and not broadcast and not overlapping and address % 16 == 0
           and 1 <= len(shape) <= _TMA_MAX_RANK and (shape[last] == 1 or strides[last] == itemsize)
           and max(shape) <= _TMA_MAX_EXTENT)
    return ViewInfo(shape, strides, itemsize, address, kind, tuple(unit_dims[::-1]), tuple(broadcast[::-1]),
                    overlapping, tma)


def of(view) -> ViewInfo:
    """:func:`classify` of a CuPy array (or anything with shape, strides, itemsize, data.ptr)."""
    return classify(view.shape, view.strides, view.itemsize, view.data.ptr)


def _may_overlap(stepped, itemsize: int) -> bool:
    """Whether dims of (|byte stride|, extent) may reach one byte from two indices.  Sorted by
    stride, each stride clearing the span of the smaller ones (plus an element) proves every index
    its own element (a mixed-radix number); anything else counts as overlapping."""
    span = 0
    for s, n in sorted(stepped):
        if s < span + itemsize:
            return True
        span += (n - 1) * s
    return False


# ---- what an op does with a view ------------------------------------------------------------------
def reject(op: str, name: str, info: ViewInfo, why: str, accepted: str) -> ConfigError:
    """The error for an argument the op cannot take: names it, its shape and strides, why, and
    what is accepted."""
    return ConfigError(f"{op}: {info.describe(name)} {why}; {accepted}", family=op, field=name,
                       value=(info.shape, info.elem_strides if info.kind != MISALIGNED else info.strides),
                       allowed=accepted)


def check_readable(op: str, name: str, info: ViewInfo) -> None:
    """Reject what nothing can read (MISALIGNED); every other kind can at least be staged."""
    if info.kind == MISALIGNED:
        raise reject(op, name, info, f"has elements not aligned to their {info.itemsize}-byte size",
                     f"pass an array whose base address and strides are multiples of {info.itemsize} bytes")


def check_output(op: str, name: str, info: ViewInfo, accepted: str = "pass a contiguous array") -> None:
    """Reject an output view that cannot be written element by element without races or faults:
    misaligned, broadcast (a stride 0 over an extent > 1) or overlapping."""
    check_readable(op, name, info)
    if info.broadcast:
        raise reject(op, name, info, f"is broadcast (stride 0 in dim {', '.join(map(str, info.broadcast))}): "
                     "writing it would race, many indices naming one element", accepted)
    if info.overlapping:
        raise reject(op, name, info, "may overlap itself (its strides let two indices reach one element): "
                     "writing it would race", accepted)


def compact(view, stream=None):
    """A C-contiguous copy of CuPy array ``view`` made on ``stream`` (a CuPy or torch stream,
    a raw handle, or None: CuPy's current stream), the stream the op then launches on.  CuPy's
    pool hands the block back only on that stream, so it is not reused before the op has read it."""
    import cupy
    from ._arrays import cupy_stream
    with cupy_stream(stream):
        return cupy.ascontiguousarray(view)


def read_view(op: str, name: str, view, stream, in_place):
    """``(view, staged)``: ``view`` itself when ``in_place(info)`` says the op reads it as it is,
    else its compact copy on ``stream`` (for an EMPTY view a free one, with contiguous strides);
    MISALIGNED views are rejected."""
    info = of(view)
    check_readable(op, name, info)
    if in_place(info):
        return view, False
    return compact(view, stream), True
