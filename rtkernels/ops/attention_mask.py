"""attention_mask: causal, sliding windows, softcap and variable-length batches in one place.

Every attention kernel (forward and backward, Hopper and mma.sync) reads the same four
compile-time flags from its config - ``causal``, ``has_window``, ``has_softcap``, ``is_varlen`` -
and the same runtime numbers (window bounds, softcap, cu_seqlens).  They are decided here, once
per call, by :func:`mask_spec`:

* ``window=(left, right)`` (FlashAttention's convention, -1 = unbounded): query i of a sequence
  sees key j iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; ``causal`` is the window
  (-1, 0), so ``causal=True`` fixes ``right = 0`` and ``window=(-1, 0)`` *is* causal.  After
  normalization ``causal`` means "the right bound is the diagonal" (compiled in) and
  ``has_window`` "a runtime bound on the left, or on the right when not causal".
* ``softcap=c > 0``: scores ``s = softmax_scale * q.k`` become ``c * tanh(s / c)`` before the
  softmax (the scale first, then the cap), and the backward differentiates through it.
* varlen: ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32, batch + 1, starting at 0); sequence b is
  rows ``cu[b]:cu[b+1]`` of the packed q (total_q, H, D) and k, v (total_k, Hkv, D); causal and
  windows are bottom-right within each sequence; lse is (H, total_q).

The device side of the same decisions is ``templates/include/rtk/attn_mask.cuh``; the NumPy tile
model here (:func:`key_range`, :func:`query_range`, :meth:`AttentionMask.visible`) mirrors its
formulas line for line, and the CPU tests check it against brute-force masks.  The float64
references (``attention_reference``, ``attention_backward_reference``) build their masks from
:meth:`AttentionMask.visible` too.

Varlen tiles are handed out by a schedule (``templates/attention_schedule.cu.j2``): a one-block
pre-kernel sorts the sequences by the work of their tiles (longest first, FlashAttention-3's
``varlen_sort_batches`` idea; FlashAttention-4 instead finds a CTA's sequence with a warp prefix
sum over the per-sequence tile counts in batch order) and writes one (sequence, tile) entry per
slot, so the grid is ``ceil(total / block) + batch`` slots - no host sync for a maximum length -
and the heaviest tiles start first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from ..config import KernelConfig, register_family
from ..errors import ConfigError

_INT_LIMIT = 2 ** 29   # packed rows per array: the kernels' sums of lengths and window bounds stay inside int32


def _bad(family: str, field: str, value: Any, message: str) -> ConfigError:
    return ConfigError(f"{family}: {message}", family=family, field=field, value=value, allowed=message)


@dataclass(frozen=True)
class AttentionMask:
    """Which (query, key) pairs an attention call scores, and how (normalized by :func:`mask_spec`).

    Parameters
    ----------
    causal : the right bound is the (bottom-right) diagonal: window right = 0, compiled in.
    window_left, window_right : FlashAttention's window; -1 = unbounded.  ``window_right`` is 0
        when ``causal``.
    softcap : > 0 caps the scores at ``softcap * tanh(s / softcap)``; 0 = off.
    is_varlen : packed sequences described by cu_seqlens.
    """

    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    is_varlen: bool = False

    @property
    def has_window(self) -> bool:
        """A runtime bound the kernels must test: on the left, or on the right when not causal."""
        return self.window_left >= 0 or (not self.causal and self.window_right >= 0)

    @property
    def has_softcap(self) -> bool:
        return self.softcap > 0

    @property
    def dense(self) -> bool:
        """None of the options: the kernels compile exactly as they did before them."""
        return not (self.has_window or self.has_softcap or self.is_varlen)

    def flags(self) -> dict[str, bool]:
        """The compile-time part: the config fields of every attention family."""
        return {"causal": self.causal, "has_window": self.has_window, "has_softcap": self.has_softcap,
                "is_varlen": self.is_varlen}

    def bounds(self, rows_q: int, rows_k: int) -> tuple[int, int]:
        """(left, right) as the kernels take them, for sequences of at most ``rows_q`` queries and
        ``rows_k`` keys (dense: the lengths; varlen: the packed totals, which bound every sequence
        whatever cu_seqlens holds).  Unbounded sides, and wider ones, are clamped there: nothing
        changes (a row never reaches further than seqlen_k keys to the left or seqlen_q to the
        right) and every sum the kernels form stays inside int32."""
        left = rows_k if self.window_left < 0 else min(self.window_left, rows_k)
        right = 0 if self.causal else (rows_q if self.window_right < 0 else min(self.window_right, rows_q))
        return int(left), int(right)

    def kernel_args(self, rows_q: int, rows_k: int) -> tuple[int, int, float]:
        """(window_left, window_right, softcap): the runtime mask arguments every kernel takes."""
        return (*self.bounds(rows_q, rows_k), float(self.softcap))

    def visible(self, seqlen_q: int, seqlen_k: int, xp=None):
        """Brute-force (seqlen_q, seqlen_k) boolean matrix of the pairs one sequence scores (xp:
        numpy or cupy); the references and the tile-model tests use it."""
        if xp is None:
            import numpy as xp
        i = xp.arange(seqlen_q)[:, None]
        j = xp.arange(seqlen_k)[None, :]
        diag = seqlen_k - seqlen_q
        ok = xp.ones((seqlen_q, seqlen_k), dtype=bool)
        if self.causal or self.window_right >= 0:
            ok &= j <= i + diag + (0 if self.causal else self.window_right)
        if self.window_left >= 0:
            ok &= j >= i + diag - self.window_left
        return ok

    def score(self, s, xp=None):
        """Scaled scores -> what the softmax sees (the softcap, when on)."""
        if not self.has_softcap:
            return s
        if xp is None:
            import numpy as xp
        return self.softcap * xp.tanh(s / self.softcap)


def mask_spec(causal: bool = False, window=None, softcap=None, is_varlen: bool = False, *,
              family: str = "attention") -> AttentionMask:
    """Normalize the user's ``causal``, ``window`` and ``softcap`` into an :class:`AttentionMask`.

    Raises ConfigError naming the argument: window not a pair of ints >= -1, a causal call with a
    window reaching right of the diagonal, softcap not a positive finite number.
    """
    if isinstance(causal, bool) or causal in (0, 1):
        causal = bool(causal)
    else:
        raise _bad(family, "causal", causal, f"causal must be True or False, got {causal!r}")
    left = right = -1
    if window is not None:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise _bad(family, "window", window, f"window must be a pair (left, right) of ints >= -1 (-1 = "
                                                 f"unbounded), got {window!r}") from None
        for side in (left, right):
            if isinstance(side, bool) or not isinstance(side, int) or side < -1:
                raise _bad(family, "window", window, f"window must be a pair (left, right) of ints >= -1 (-1 = "
                                                     f"unbounded), got {window!r}")
        left, right = int(left), int(right)
    if causal and right not in (-1, 0):
        raise _bad(family, "window", window, f"causal=True already bounds the right side at the diagonal; "
                                             f"window={window!r} reaches {right} keys right of it (pass "
                                             f"causal=False with window=(left, {right}), or right = 0 or -1)")
    if causal or right == 0:   # (left, 0) is a causal mask, narrowed on the left when left >= 0
        causal, right = True, 0
    cap = 0.0
    if softcap is not None and softcap != 0:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) \
                or softcap < 0:
            raise _bad(family, "softcap", softcap, f"softcap must be a positive finite number (or None / 0 for "
                                                   f"none), got {softcap!r}")
        cap = float(softcap)
    return AttentionMask(causal, left, right, cap, bool(is_varlen))


def first_without_spills(configs, arch: str, kernels=None):
    """The first of ``configs`` whose build has no spills in ptxas's report (compiling them in order,
    through the kernel cache), else the last: the masked variants' tile choice.  ``kernels(cfg)``:
    the entry points that must be clean (default: the family's first)."""
    from ..kernel import get_kernel
    for cfg in configs:
        names = kernels(cfg) if kernels else (None,)
        rs = [get_kernel(cfg, n, arch=arch).resources for n in names]
        if not any(r.spill_stores or r.spill_loads or r.stack_frame for r in rs):
            return cfg
    return configs[-1]


def visible_pairs(mask: AttentionMask, seqlen_q: int, seqlen_k: int) -> int:
    """How many (query, key) pairs of one sequence the mask lets through (row by row, O(seqlen_q)):
    the FLOPs a benchmark counts are 4 * head_dim * heads times this."""
    import numpy as np
    i = np.arange(seqlen_q, dtype=np.int64)
    diag = seqlen_k - seqlen_q
    hi = np.full(seqlen_q, seqlen_k - 1, dtype=np.int64)
    if mask.causal or mask.window_right >= 0:
        hi = np.minimum(hi, i + diag + (0 if mask.causal else mask.window_right))
    lo = np.zeros(seqlen_q, dtype=np.int64)
    if mask.window_left >= 0:
        lo = np.maximum(lo, i + diag - mask.window_left)
    return int(np.maximum(hi - lo + 1, 0).sum())


# ---- the NumPy tile model (the formulas of rtk/attn_mask.cuh) -----------------------------------
class KeyRange(NamedTuple):
    """Key tiles ``[n_min, n_max)`` a query tile visits; tile n needs the element mask iff
    ``n < n_mask_lo or n >= n_mask_hi`` (every other visited tile is fully visible to every row)."""
    n_min: int
    n_max: int
    n_mask_lo: int
    n_mask_hi: int

    def masked(self, n: int) -> bool:
        return n < self.n_mask_lo or n >= self.n_mask_hi


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def key_range(mask: AttentionMask, m0: int, rows_q: int, seqlen_q: int, seqlen_k: int, block_n: int,
              left: int, right: int) -> KeyRange:
    """The device's ``key_range``: rows ``[m0, m0 + rows_q)`` (rows_q >= 1, the tile's rows that
    exist) of a sequence; ``left``/``right`` as :meth:`AttentionMask.bounds` gives them."""
    diag = seqlen_k - seqlen_q
    n_min, n_max, lo, hi = 0, _cdiv(seqlen_k, block_n), 0, seqlen_k // block_n
    if mask.causal or mask.has_window:
        r = 0 if mask.causal else right
        keys_last_row = min(seqlen_k, m0 + rows_q + diag + r)
        n_max = _cdiv(keys_last_row, block_n) if keys_last_row > 0 else 0
        keys_first_row = m0 + diag + r + 1
        hi = min(hi, keys_first_row // block_n if keys_first_row > 0 else 0)
    if mask.has_window:
        first_key = m0 + diag - left
        n_min = first_key // block_n if first_key > 0 else 0
        last_row_first_key = m0 + rows_q - 1 + diag - left
        lo = _cdiv(last_row_first_key, block_n) if last_row_first_key > 0 else 0
        n_max = max(n_max, n_min)
    return KeyRange(n_min, n_max, lo, hi)


class QueryRange(NamedTuple):
    """Query tiles ``[m_min, m_max)`` that see a key tile; tile m needs the element mask iff
    ``m < m_mask_lo or m >= m_mask_hi`` (the backward's view of the same mask)."""
    m_min: int
    m_max: int
    m_mask_lo: int
    m_mask_hi: int

    def masked(self, m: int) -> bool:
        return m < self.m_mask_lo or m >= self.m_mask_hi


def query_range(mask: AttentionMask, n0: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                left: int, right: int) -> QueryRange:
    """The device's ``query_range``: the query tiles of a sequence whose rows see keys
    ``[n0, n0 + block_n)`` (n0 < seqlen_k).  A key tile running past seqlen_k is masked for every
    query tile; rows past seqlen_q need no mask (the backward gives them lse = +inf: P = 0)."""
    diag = seqlen_k - seqlen_q
    m_tiles = _cdiv(seqlen_q, block_m)
    keys_end = min(n0 + block_n, seqlen_k)          # exclusive; > n0 for a tile that exists
    m_min, m_max, lo, hi = 0, m_tiles, 0, m_tiles
    if mask.causal or mask.has_window:
        r = 0 if mask.causal else right
        first_row = n0 - diag - r                     # the first row that sees key n0
        m_min = first_row // block_m if first_row > 0 else 0
        full_row = n0 + block_n - 1 - diag - r        # rows from here see the tile's last key
        lo = _cdiv(full_row, block_m) if full_row > 0 else 0
    if mask.has_window:
        last_row = keys_end - 1 - diag + left         # the last row that sees the tile's last key
        m_max = min(m_tiles, last_row // block_m + 1) if last_row >= 0 else 0
        nomask_end = n0 - diag + left + 1             # rows below this see the tile's first key
        hi = nomask_end // block_m if nomask_end > 0 else 0
        m_max = max(m_max, m_min)
    if n0 + block_n > seqlen_k:
        lo = m_tiles                                  # the last key tile: every query tile is masked
    return QueryRange(m_min, m_max, lo, hi)


# ---- varlen inputs -------------------------------------------------------------------------------
class Varlen(NamedTuple):
    """Checked cu_seqlens: CuPy views, the batch, the packed totals and the longest sequences
    (the caller's hints or computed)."""
    cu_q: Any
    cu_k: Any
    batch: int
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int


def check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q: int, total_k: int,
                 device: int, family: str = "attention") -> Varlen:
    """Check cu_seqlens_q / cu_seqlens_k (host-side: int32, 1-D, the same length batch + 1 >= 2,
    contiguous, on q's device) and the max_seqlen hints (ints >= 0).

    Contents (starting at 0, non-decreasing, ending at total) need the values on the host: they
    are read - one device-to-host copy, a stream synchronization - and checked only when a
    ``max_seqlen_*`` hint is missing, which needs them anyway.  With both hints given nothing is
    read (no sync: CUDA-graph capture works); the kernels then clamp every sequence into
    ``[0, total)``, so malformed cu_seqlens give wrong results for the malformed sequences but
    never read or write outside the arrays.
    """
    from ._arrays import as_device_array
    if cu_seqlens_q is None or cu_seqlens_k is None:
        missing = "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k"
        raise _bad(family, missing, None, "varlen attention takes both cu_seqlens_q and cu_seqlens_k (pass the "
                                          "same array twice for self-attention)")
    views = [as_device_array(cu, family, name) for name, cu in (("cu_seqlens_q", cu_seqlens_q),
                                                                 ("cu_seqlens_k", cu_seqlens_k))]
    return check_cu_seqlens(*views, max_seqlen_q, max_seqlen_k, total_q, total_k, device, family)


def check_cu_seqlens(cu_q, cu_k, max_seqlen_q, max_seqlen_k, total_q: int, total_k: int, device: int,
                     family: str = "attention") -> Varlen:
    """:func:`check_varlen` on array views (anything with dtype, ndim, shape, strides, device.id
    and ``get()``, so the CPU tests can pass host stand-ins)."""
    for name, v in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if str(v.dtype) != "int32":
            raise _bad(family, name, str(v.dtype), f"{name} must be int32 (FlashAttention's convention), got "
                                                   f"{v.dtype}")
        if v.ndim != 1 or v.shape[0] < 2:
            raise _bad(family, name, tuple(v.shape), f"{name} must be 1-D of length batch + 1 >= 2, got shape "
                                                     f"{tuple(v.shape)}")
        if v.strides[0] != 4:
            raise _bad(family, name, v.strides, f"{name} must be contiguous, got a stride of {v.strides[0]} bytes")
        if int(v.device.id) != device:
            raise _bad(family, name, int(v.device.id), f"{name} must be on q's device {device}, got device "
                                                       f"{int(v.device.id)}")
    if cu_q.shape != cu_k.shape:
        raise _bad(family, "cu_seqlens_k", tuple(cu_k.shape), f"cu_seqlens_q and cu_seqlens_k must have the same "
                                                              f"length (batch + 1), got {cu_q.shape[0]} and "
                                                              f"{cu_k.shape[0]}")
    batch = cu_q.shape[0] - 1
    for name, total in (("q", total_q), ("k", total_k)):
        if total >= _INT_LIMIT:
            raise _bad(family, name, total, f"{name} has {total} packed rows; varlen attention takes fewer than "
                                            f"2**29")
    hints = []
    for name, hint in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if hint is not None and (isinstance(hint, bool) or not isinstance(hint, int) or hint < 0):
            raise _bad(family, name, hint, f"{name} must be an int >= 0 (the longest sequence) or None, got "
                                           f"{hint!r}")
        hints.append(hint)
    if None in hints:
        hq, hk = _read_and_check(cu_q, cu_k, total_q, total_k, family)
        hints = [hq if hints[0] is None else hints[0], hk if hints[1] is None else hints[1]]
    return Varlen(cu_q, cu_k, batch, total_q, total_k, min(int(hints[0]), total_q), min(int(hints[1]), total_k))


def _read_and_check(cu_q, cu_k, total_q: int, total_k: int, family: str) -> tuple[int, int]:
    """The longest sequences, read from the device (a synchronizing copy), and the content checks."""
    import numpy as np
    out = []
    for name, v, total, rows in (("cu_seqlens_q", cu_q, total_q, "q"), ("cu_seqlens_k", cu_k, total_k, "k")):
        h = np.asarray(v.get(), dtype=np.int64)
        if h[0] != 0:
            raise _bad(family, name, int(h[0]), f"{name} must start at 0, got {int(h[0])}")
        steps = np.diff(h)
        if (steps < 0).any():
            at = int(np.argmax(steps < 0))
            raise _bad(family, name, int(h[at + 1]), f"{name} must be non-decreasing, got {int(h[at])} then "
                                                     f"{int(h[at + 1])} at index {at + 1}")
        if h[-1] != total:
            raise _bad(family, name, int(h[-1]), f"{name} must end at {rows}.shape[0] = {total} (the packed rows), "
                                                 f"got {int(h[-1])}")
        out.append(int(steps.max()) if steps.size else 0)
    return out[0], out[1]


def varlen_slots(total: int, batch: int, block: int, max_seqlen: int, compact: bool = True) -> int:
    """Schedule slots for ``block``-row tiles: ``ceil(total / block) + batch`` bounds the tile count
    sum_b ceil(len_b / block) without a device read (each sequence wastes less than one tile) and
    is what the batch-order layout needs; the compact (sorted) layout is tightened by the hint
    (``batch * ceil(max_seqlen / block)``), which must therefore not be below the true longest
    sequence - as for FlashAttention's max_seqlen."""
    slots = _cdiv(total, block) + batch
    if compact:
        slots = min(slots, batch * _cdiv(max_seqlen, block))
    return max(1, slots)


def schedule_slots(vl: "Varlen", block: int, keys: bool = False) -> int:
    """:func:`varlen_slots` of ``block``-row tiles of vl's query sequences (``keys``: its key
    sequences - the backward's key tiles), compact while the sorting kernel takes the batch."""
    total, longest = (vl.total_k, vl.max_seqlen_k) if keys else (vl.total_q, vl.max_seqlen_q)
    return varlen_slots(total, vl.batch, block, longest, compact=vl.batch <= SORT_MAX_BATCH)


def padded_offset_rows(total: int, batch: int, pad: int) -> int:
    """Rows of a per-head buffer where sequence b starts at ``floor((cu[b] + b * pad) / pad) * pad``
    (the device's ``padded_start``): every sequence gets whole ``pad``-row tiles, no two overlap
    (FlashAttention-3's layout of its varlen softmax statistics)."""
    return _cdiv(total + batch * pad, pad) * pad


# ---- the varlen schedule -------------------------------------------------------------------------
SORT_MAX_BATCH = 8192    # sequences the one-block sort takes (8 B key + 4 B prefix each in shared memory)


@register_family
@dataclass(frozen=True)
class AttentionScheduleConfig(KernelConfig):
    """The varlen schedule pre-kernels (templates/attention_schedule.cu.j2); no tile parameters:
    the tile height is a runtime argument, so one build serves every attention kernel.

    Parameters
    ----------
    threads : threads of the one-block sorting kernel (a power of two, 256..1024).
    """

    family: ClassVar[str] = "attention_schedule"
    template: ClassVar[str] = "attention_schedule.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("attention_schedule_sorted", "attention_schedule_batch_order")

    threads: int = 1024

    def __post_init__(self):
        self._check_int("threads", 256, 1024, power_of_two=True)

    def sort_smem_bytes(self, batch: int) -> int:
        """Dynamic shared memory of the sorting kernel for ``batch`` sequences."""
        n = 1 << max(0, (batch - 1).bit_length())
        return 8 * max(n, self.threads) + 4 * (batch + 1)


_SCHEDULE: dict = {}


def _schedule_kernels(arch: str):
    hit = _SCHEDULE.get(arch)
    if hit is None:
        from ..kernel import get_kernel
        cfg = AttentionScheduleConfig()
        hit = _SCHEDULE[arch] = (cfg, {n: get_kernel(cfg, n, arch=arch) for n in cfg.kernels})
    return hit


class ScheduleLaunch(NamedTuple):
    """The schedule pre-kernel's launch for a fixed (batch, totals, block, slots, order) - what a
    launch plan keeps to rewrite the table for new cu_seqlens contents (:meth:`run`)."""
    kernel: Any
    grid: tuple
    threads: tuple
    shared_mem: int
    sort: bool            # the one-block sorting kernel (batch <= SORT_MAX_BATCH), else batch order
    batch: int
    total: int
    total_other: int
    block: int
    descending: int
    slots: int

    def run(self, cu_tiles, cu_other, table, stream=None) -> None:
        """Write the (slots,) int32x2 table of ``cu_tiles`` / ``cu_other`` into ``table`` (an array
        or a :class:`rtkernels.kernel.DevicePtr` of >= 8 * slots bytes)."""
        if self.sort:
            self.kernel.launch(self.grid, self.threads, cu_tiles, cu_other, self.batch, self.total, self.total_other,
                               self.block, self.descending, table, self.slots, shared_mem=self.shared_mem,
                               stream=stream)
        else:
            self.kernel.launch(self.grid, self.threads, cu_tiles, self.batch, self.total, self.block,
                               self.descending, table, self.slots, stream=stream)


def schedule_launch(batch: int, total: int, total_other: int, block: int, slots: int, descending: bool,
                    arch: str) -> ScheduleLaunch:
    """The :class:`ScheduleLaunch` of :func:`schedule` for these numbers (no cu_seqlens needed)."""
    cfg, kerns = _schedule_kernels(arch)
    if batch <= SORT_MAX_BATCH:
        return ScheduleLaunch(kerns["attention_schedule_sorted"], (1,), (cfg.threads,), cfg.sort_smem_bytes(batch),
                              True, batch, total, total_other, block, int(descending), slots)
    threads = 256
    return ScheduleLaunch(kerns["attention_schedule_batch_order"], (min(_cdiv(slots, threads), 65535),), (threads,),
                          0, False, batch, total, total_other, block, int(descending), slots)


def schedule(cu_tiles, cu_other, batch: int, total: int, total_other: int, block: int, slots: int,
             descending: bool, arch: str, stream=None, table=None):
    """A (slots,) int32x2 table of (sequence, tile) per slot; (-1, 0) for unused slots.

    Tiles are ``block`` rows of the sequences in ``cu_tiles``; ``cu_other`` gives the length that
    sets each tile's work (keys for a query tile).  Up to :data:`SORT_MAX_BATCH` sequences: one
    block sorts them by that length (then by tile count, then index), longest first, and lays out
    each sequence's tiles back to back - ``descending`` puts its last tile first (the causal
    forward's heaviest).  More sequences: batch order, each sequence at its padded offset
    (:func:`padded_offset_rows`), written by a grid-stride kernel.  ``table``: where to write it (an
    array or address of >= 8 * slots bytes; default a new array from CuPy's pool).
    """
    import cupy
    from ._arrays import cupy_stream
    if table is None:
        with cupy_stream(stream):   # the pool hands the table's memory out again only after this stream's work
            table = cupy.empty((slots, 2), cupy.int32)
    schedule_launch(batch, total, total_other, block, slots, descending, arch).run(cu_tiles, cu_other, table, stream)
    return table


def schedule_reference(cu_tiles, cu_other, block: int, slots: int, descending: bool, total: int,
                       total_other: int, sort: bool = True):
    """NumPy model of the schedule pre-kernels: the (slots, 2) table they write for host arrays
    ``cu_tiles`` / ``cu_other`` (clamped as the device clamps them)."""
    import numpy as np
    cu_t = np.asarray(cu_tiles, dtype=np.int64)
    cu_o = np.asarray(cu_other, dtype=np.int64)
    batch = len(cu_t) - 1

    def rows(cu, b, tot):
        lo = min(max(int(cu[b]), 0), tot)
        hi = min(max(int(cu[b + 1]), lo), tot)
        return lo, hi - lo

    table = np.tile(np.array([-1, 0], dtype=np.int32), (slots, 1))
    if sort:
        order = sorted(range(batch), key=lambda b: (-rows(cu_o, b, total_other)[1], b))
        s = 0
        for b in order:
            tiles = _cdiv(rows(cu_t, b, total)[1], block)
            for j in range(tiles):
                if s < slots:
                    table[s] = (b, tiles - 1 - j if descending else j)
                s += 1
    else:
        for b in range(batch):
            start, n = rows(cu_t, b, total)
            first = (start + b * block) // block
            tiles = _cdiv(n, block)
            for j in range(tiles):
                if first + j < slots:
                    table[first + j] = (b, tiles - 1 - j if descending else j)
    return table
