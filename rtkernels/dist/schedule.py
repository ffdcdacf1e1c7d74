"""The ring's schedule: at step t rank r holds the K/V of rank ``(r - t) % world``; which of its
queries see which of those keys is one :class:`Block` (or None: nothing to compute).

A Block is a pair of row ranges and a flag: local queries ``q[lo:hi]`` against the held keys
``k[lo:hi]``, with no mask (``causal=False``) or the bottom-right aligned causal mask of
``rtk.attention`` over that sub-block (query i sees key j iff ``j <= i + nk - nq``).  Every case
of the three layouts fits this shape, so each step is one call of the single-GPU kernel on views,
never a copy or a custom mask:

=============  =====================  ======================================================
layout         held K/V from rank s   block of rank r's queries (causal attention)
=============  =====================  ======================================================
contiguous     s == r                 all x all, causal (the diagonal)
               s <  r                 all x all, no mask
               s >  r                 None (every key is later than every query)
striped        s <= r                 all x all, causal: query i (token i*N + r) sees key j
                                      (token j*N + s) iff j <= i
               s >  r                 q[1:] x k[:-1], causal: iff j <= i - 1; query 0 sees
                                      nothing here
zigzag         s == r                 all x all, causal
               s <  r                 all x k[:L/2], no mask (key chunk s precedes both query
                                      chunks; key chunk 2N-1-s follows both)
               s >  r                 q[L/2:] x all, no mask (query chunk r precedes both key
                                      chunks; query chunk 2N-1-r follows both)
=============  =====================  ======================================================

Without a causal mask every step is all x all.  Step 0 is always the rank's own K/V over all
its queries and keys, so every query row has a result after step 0 (the forward starts from it).
``tests/test_ring.py`` checks every (rank, step) block against the causal mask of the global
sequence projected onto that rank pair, for each layout at 2, 4 and 8 ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import check_layout, check_local_len


@dataclass(frozen=True)
class Block:
    """Local queries ``q_rows`` against held keys ``k_rows`` (half-open row ranges), masked
    bottom-right causally when ``causal``."""

    q_rows: tuple[int, int]
    k_rows: tuple[int, int]
    causal: bool

    @property
    def nq(self) -> int:
        return self.q_rows[1] - self.q_rows[0]

    @property
    def nk(self) -> int:
        return self.k_rows[1] - self.k_rows[0]

    def pairs(self) -> int:
        """Visible (query, key) pairs: the work of the block."""
        if not self.causal:
            return self.nq * self.nk
        off = self.nk - self.nq
        return int(sum(max(0, min(self.nk, i + off + 1)) for i in range(self.nq)))


def source_rank(rank: int, step: int, world: int) -> int:
    """Whose K/V rank ``rank`` holds at ``step`` (K/V travel to rank + 1 each step)."""
    return (rank - step) % world


def block(layout: str, causal: bool, rank: int, step: int, world: int, local_len: int) -> Block | None:
    """The block rank ``rank`` computes at ``step`` (None: nothing)."""
    L = local_len
    full = Block((0, L), (0, L), False)
    s = source_rank(rank, step, world)
    if L == 0:
        return None
    if not causal:
        return full
    if s == rank:
        return Block((0, L), (0, L), True)
    if layout == "contiguous":
        return full if s < rank else None
    if layout == "striped":
        if s < rank:
            return Block((0, L), (0, L), True)
        return Block((1, L), (0, L - 1), True) if L > 1 else None
    half = L // 2
    if s < rank:
        return Block((0, L), (0, half), False)
    return Block((half, L), (0, L), False)


def plan(layout: str, causal: bool, rank: int, world: int, local_len: int) -> tuple[Block | None, ...]:
    """Rank ``rank``'s blocks for steps 0 .. world-1."""
    check_layout(layout)
    check_local_len(layout, local_len)
    return tuple(block(layout, causal, rank, t, world, local_len) for t in range(world))


def block_mask(b: Block | None, local_len: int) -> np.ndarray:
    """(local_len, local_len) bool: which (query row, held key row) pairs the block computes."""
    m = np.zeros((local_len, local_len), bool)
    if b is None:
        return m
    (q0, q1), (k0, k1) = b.q_rows, b.k_rows
    i = np.arange(b.nq)[:, None]
    j = np.arange(b.nk)[None, :]
    m[q0:q1, k0:k1] = (j <= i + b.nk - b.nq) if b.causal else True
    return m


def critical_path(layout: str, causal: bool, world: int, local_len: int) -> int:
    """Pairs on the slowest rank summed over steps: the ring advances in lock step, so each
    step takes as long as its busiest rank (a model of the schedule's time, in pairs)."""
    plans = [plan(layout, causal, r, world, local_len) for r in range(world)]
    return sum(max(p[t].pairs() if p[t] is not None else 0 for p in plans) for t in range(world))
