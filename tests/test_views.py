"""The view classification every op reads (rtkernels/ops/views.py), checked against the addresses
the strides actually produce, and the op layouts built on it (matmul's K-/M-major choice,
the row ops' row stride, fp8 matmul's in-place / transpose / copy choice): property tests over
random shapes, strides, item sizes and offsets (no GPU, no compile), plus the views NumPy makes
with expand, transpose, steps, offsets and as_strided.  Issue 26: matmul read an ``expand``-ed
operand as if its stride-0 dim were the contiguous one; the layout properties below fail on that
code."""
import itertools

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")   # in the "test" extra; CI installs it
from hypothesis import given, settings, strategies as st   # noqa: E402

from rtkernels.errors import ConfigError   # noqa: E402
from rtkernels.ops import matmul as mm   # noqa: E402
from rtkernels.ops import rowwise as rw   # noqa: E402
from rtkernels.ops import views   # noqa: E402
from rtkernels.ops.attention import _direct   # noqa: E402
from rtkernels.tma import check_tensor_map   # noqa: E402

FAST = settings(max_examples=200, deadline=None)
BASE = 1 << 20
_DTYPE_OF_SIZE = {1: "uint8", 2: "float16", 4: "float32", 8: "float64"}


def offsets(shape, strides) -> np.ndarray:
    """Byte offset of every index, in C order (what a kernel walking the view would touch)."""
    off = np.zeros(shape, dtype=np.int64)
    for d, (n, s) in enumerate(zip(shape, strides)):
        idx = [1] * len(shape)
        idx[d] = n
        off = off + (np.arange(n, dtype=np.int64) * s).reshape(idx)
    return off.reshape(-1)


@st.composite
def view_args(draw, max_ndim=4, max_extent=5):
    """(shape, byte strides, itemsize, address): contiguous ones, permuted or stepped ones,
    broadcasts, overlapping, negative and misaligned strides, zero extents."""
    itemsize = draw(st.sampled_from((1, 2, 4, 8)))
    ndim = draw(st.integers(0, max_ndim))
    shape = tuple(draw(st.lists(st.integers(0, max_extent), min_size=ndim, max_size=ndim)))
    style = draw(st.sampled_from(("contiguous", "elements", "chunks", "bytes")))
    if style == "contiguous":
        strides, acc = [], itemsize
        for n in reversed(shape):
            strides.append(acc)
            acc *= max(n, 1)
        strides = strides[::-1]
        for d in range(ndim):   # sometimes broadcast a dim, sometimes step it
            tweak = draw(st.sampled_from((1, 1, 1, 0, 2, -1)))
            strides[d] *= tweak
    elif style == "elements":
        strides = [itemsize * draw(st.integers(-8, 40)) for _ in range(ndim)]
    elif style == "chunks":   # 16-byte multiples, what tensor maps want
        strides = [16 * draw(st.integers(-2, 12)) for _ in range(ndim)]
        if ndim and draw(st.booleans()):
            strides[-1] = itemsize
    else:
        strides = [draw(st.integers(-40, 200)) for _ in range(ndim)]
    address = BASE + draw(st.sampled_from((0, 0, 0, 16, 32, 2, 4, 8, 1, 3)))
    return shape, tuple(strides), itemsize, address


@FAST
@given(view_args())
def test_every_view_is_classified_and_claims_only_what_its_addresses_show(args):
    shape, strides, item, address = args
    info = views.classify(shape, strides, item, address)
    assert info.kind in views.KINDS
    assert info.shape == shape and info.strides == strides and info.itemsize == item
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    assert (info.kind == views.EMPTY) == (size == 0)
    if size == 0:
        assert not info.aliased and not info.tma
        return
    live = [(d, n, s) for d, (n, s) in enumerate(zip(shape, strides)) if n > 1]
    off = offsets(shape, strides)
    # misaligned exactly when some element does not start on a multiple of its size
    assert (info.kind == views.MISALIGNED) == bool(((address + off) % item).any())
    if info.kind == views.CONTIGUOUS:
        assert (off == np.arange(size) * item).all()
    if info.kind == views.NEGATIVE:
        assert any(s < 0 for _, _, s in live)
    if info.kind in (views.UNIT, views.STRIDED, views.CONTIGUOUS):
        assert all(s >= 0 for _, _, s in live)
    assert (info.kind == views.UNIT) <= bool(info.unit_dims)
    assert info.kind != views.STRIDED or not info.unit_dims
    # unit dims step by one element; broadcast dims are exactly the stepped dims of stride 0
    for d in info.unit_dims:
        assert shape[d] > 1 and strides[d] == item
    assert set(info.broadcast) == {d for d, _, s in live if s == 0}
    for d in range(len(shape)):
        assert info.unit(d) == (shape[d] == 1 or strides[d] == item)
    # not aliased: every index owns its bytes (element ranges pairwise disjoint)
    if not info.aliased:
        srt = np.sort(off)
        assert (np.diff(srt) >= item).all()
    # no broadcast, not overlapping, with broadcast dims pinned to index 0: the rest is disjoint
    if not info.overlapping:
        sub = tuple(1 if d in info.broadcast else n for d, n in enumerate(shape))
        srt = np.sort(offsets(sub, strides))
        assert (np.diff(srt) >= item).all()
    if info.tma:
        assert address % 16 == 0 and not info.aliased and info.kind in (views.CONTIGUOUS, views.UNIT)
        elems = [1 if d == len(shape) - 1 else (s // item if n > 1 else 16 // item if item < 16 else 1)
                 for d, (n, s) in enumerate(zip(shape, strides))]
        box = [1] * (len(shape) - 1) + [max(1, 16 // item)]
        check_tensor_map(address, _DTYPE_OF_SIZE[item], shape, elems, box, swizzle=0)   # raises if illegal


@FAST
@given(view_args())
def test_outputs_that_alias_are_rejected_naming_the_argument(args):
    info = views.classify(*args)
    try:
        views.check_output("op", "out", info)
    except ConfigError as e:
        msg = str(e)
        assert msg.startswith("op: out (shape ") and "strides" in msg and e.field == "out"
        assert "tensor_map" not in msg and "strides[" not in msg
        assert info.aliased or info.kind == views.MISALIGNED
        return
    assert not info.aliased and info.kind != views.MISALIGNED


def _numpy_views():
    """Views NumPy makes of one buffer by the view ops the GPU fuzzer chains (tests/test_views_gpu.py)."""
    base = np.zeros(4 * 6 * 8, np.float16)
    a = base.reshape(4, 6, 8)
    yield "contiguous", a, False
    yield "transpose", a.transpose(2, 0, 1), False
    yield "steps", a[::2, 1::2, ::3], False
    yield "reversed", a[::-1, :, ::-2], False
    yield "narrow offset", a[1:3, 2:5, 3:7], False
    yield "expand row", np.broadcast_to(a[:, :1], (4, 6, 8)), True
    yield "expand scalar", np.broadcast_to(a[0, 0, 0], (3, 5, 7)), True
    yield "expand then transpose", np.broadcast_to(a[:1], (4, 6, 8)).transpose(1, 0, 2), True
    yield "as_strided overlap", np.lib.stride_tricks.as_strided(base, (5, 8), (4, 2)), True
    yield "as_strided rows", np.lib.stride_tricks.as_strided(base, (5, 8), (32, 2)), False


@pytest.mark.parametrize("name,v,aliased", list(_numpy_views()), ids=[n for n, _, _ in _numpy_views()])
def test_views_numpy_makes(name, v, aliased):
    info = views.classify(v.shape, v.strides, v.itemsize, BASE + v.__array_interface__["data"][0] % 64)
    assert info.aliased == aliased, info
    assert (info.kind == views.CONTIGUOUS) == v.flags.c_contiguous
    assert (info.kind == views.NEGATIVE) == any(s < 0 for n, s in zip(v.shape, v.strides) if n > 1)


def test_describe_and_reject_messages():
    info = views.classify((256, 192), (0, 0), 2, BASE)
    assert info.kind == views.STRIDED and info.broadcast == (0, 1) and not info.overlapping
    e = views.reject("matmul", "b", info, "is broadcast", "pass a contiguous array")
    assert str(e) == "matmul: b (shape (256, 192), strides (0, 0)) is broadcast; pass a contiguous array"
    bad = views.classify((4, 4), (8, 3), 2, BASE)
    assert bad.kind == views.MISALIGNED and "strides (8, 3) bytes" in bad.describe("x")
    with pytest.raises(ConfigError, match="x .* not aligned"):
        views.check_readable("softmax", "x", bad)
    with pytest.raises(ConfigError, match="out .* broadcast"):
        views.check_output("softmax", "out", info)
    with pytest.raises(ConfigError, match="out .* overlap"):
        views.check_output("softmax", "out", views.classify((5, 8), (4, 2), 2, BASE))


# ---- the ops' layouts built on the classification --------------------------------------------------
def _matmul_claim_holds(shape, estrides, item=2):
    """If matmul reads this (M, K) operand in place, the (k_major, ld) it derives must name every
    element's address: A(m, k) at (m * ld + k) if K-major else (k * ld + m), in elements."""
    info = views.classify(shape, tuple(s * item for s in estrides), item, BASE)
    if not mm._reads_in_place(info):
        return None
    kmajor, ld = mm._layout("a", "M", shape, estrides)
    for m_, k_ in itertools.product(range(shape[0]), range(shape[1])):
        real = m_ * estrides[0] + k_ * estrides[1]
        claim = m_ * ld + k_ if kmajor else k_ * ld + m_
        assert real == claim, (shape, estrides, kmajor, ld, (m_, k_))
    return kmajor, ld


@FAST
@given(st.tuples(st.integers(0, 6), st.integers(0, 6)), st.tuples(st.integers(-3, 9), st.integers(-3, 9)))
def test_matmul_layout_never_claims_a_unit_stride_the_operand_lacks(shape, estrides):
    _matmul_claim_holds(shape, estrides)


def test_matmul_layout_of_issue_26_operands():
    # the issue's cases: a scalar expanded over (M, K), a column expanded over N, a row over M
    assert _matmul_claim_holds((64, 256), (0, 0)) is None          # no unit stride: staged
    assert _matmul_claim_holds((192, 256), (0, 192)) is None       # b[:, :1].expand seen as (N, K)
    assert _matmul_claim_holds((64, 256), (0, 1)) == (True, 0)     # a[:1].expand: one row for every m
    assert _matmul_claim_holds((64, 256), (1, 0)) == (False, 0)    # a[:, :1].expand: one column for every k
    assert _matmul_claim_holds((64, 256), (256, 1)) == (True, 256)


@FAST
@given(st.integers(1, 5), st.sampled_from((16, 32, 48)), st.tuples(st.integers(-64, 96), st.integers(-2, 70)),
       st.sampled_from((0, 0, 16, 32, 1, 8)), st.booleans())
def test_fp8_matmul_layout_in_place_only_what_its_tensor_map_addresses(rows, k, estrides, offset, padded):
    """matmul_fp8 reads a (rows, K) 8-bit operand in place only when the tensor map it encodes -
    (base, shape (rows, K), strides (ld, 1)) - names every element's address and the driver accepts
    it; it transposes only views whose rows dim is contiguous; everything else is copied."""
    from rtkernels.ops import matmul_fp8 as f8
    s0, s1 = estrides
    if padded:   # the common in-place candidates: K contiguous, rows K + 16 * j bytes apart
        s0, s1 = k + 16 * (abs(s0) % 4), 1
    info = views.classify((rows, k), (s0, s1), 1, BASE + offset)
    how, ld = f8.operand_layout(info)
    if how == f8.IN_PLACE:
        real = BASE + offset + np.arange(rows)[:, None] * s0 + np.arange(k)[None, :] * s1
        claim = BASE + offset + np.arange(rows)[:, None] * ld + np.arange(k)[None, :]
        assert (real == claim).all(), (rows, k, (s0, s1), offset, ld)
        assert len(np.unique(real)) == real.size          # no two indices on one byte
        check_tensor_map(BASE + offset, "uint8", (rows, k), (ld, 1), (128, 128), swizzle=128)   # raises if illegal
    elif how == f8.TRANSPOSE:
        assert rows > 1 and s0 == 1 and s1 >= 0 and ld == k
    else:
        assert how == f8.COPY and ld == k and ld % 16 == 0
        assert not info.tma


@FAST
@given(view_args(max_ndim=3, max_extent=4))
def test_row_layout_names_every_row(args):
    shape, strides, item, address = args
    if not shape:
        return
    info = views.classify(shape, strides, item, address)
    if info.kind in (views.MISALIGNED, views.EMPTY):
        return   # rejected before _row_layout / nothing to read

    class V:
        pass
    v = V()
    v.shape, v.strides, v.itemsize, v.ndim = shape, strides, item, len(shape)
    lay = rw._row_layout(v)
    if lay is None:
        return   # staged as a compact copy
    rows, n, stride = lay
    off = offsets(shape, strides).reshape(rows, n) // item
    assert (off == np.arange(rows)[:, None] * stride + np.arange(n)[None, :]).all(), (shape, strides, lay)
    # and an output the row ops accept is written without two indices on one element
    try:
        views.check_output("softmax", "out", info)
    except ConfigError:
        return
    assert rows == 1 or abs(stride) >= n


@FAST
@given(view_args(max_ndim=4, max_extent=3))
def test_attention_reads_in_place_only_what_its_kernels_address(args):
    shape, strides, item, address = args
    if item != 2 or len(shape) != 4:
        return
    info = views.classify(shape, strides, item, address)
    if _direct(info):
        assert address % 16 == 0 and info.unit(-1)
        assert all(n == 1 or s % 16 == 0 for n, s in zip(shape[:-1], strides[:-1]))
    if _direct(info) and info.tma:
        assert not info.broadcast and all(n == 1 or s > 0 for n, s in zip(shape, strides))
