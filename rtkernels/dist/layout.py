"""How a sequence is split over the ranks of a ring: which global token each local row holds.

Three layouts of a sequence of ``S`` tokens over ``world`` ranks, ``L = S / world`` tokens each:

* ``"contiguous"`` - rank r holds tokens ``r*L .. r*L + L - 1``.  With a causal mask, rank
  ``world - 1`` attends to every earlier block and rank 0 to its own only: the ring runs at the
  speed of the busiest rank (the reference layout).
* ``"striped"`` - rank r holds tokens ``r, r + world, r + 2*world, ...`` (Striped Attention,
  Brandon et al. 2023): every (rank, step) block is a causal triangle, so the ranks stay balanced.
* ``"zigzag"`` - the sequence in ``2*world`` chunks of ``L/2``; rank r holds chunks ``r`` and
  ``2*world - 1 - r`` (the load balance Megatron and ring-flash-attention use): every block off the
  diagonal is exactly half of a full one.

Sequence lengths must divide evenly: ``S % world == 0`` (``S % (2*world) == 0`` for zigzag);
anything else is a :class:`~rtkernels.errors.ConfigError` naming the length and what would fit.
The caller pads (and masks its loss) if it needs other lengths: padding inside the ring would make
padded keys visible to real queries under a causal mask in the striped layout.

:func:`shard` and :func:`unshard` take NumPy arrays, CuPy arrays or torch tensors.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError

LAYOUTS = ("striped", "zigzag", "contiguous")


def check_layout(layout: str, family: str = "ring_attention") -> str:
    if layout not in LAYOUTS:
        raise ConfigError.bad_value(family, "layout", layout, "one of " + ", ".join(map(repr, LAYOUTS)))
    return layout


def chunks(layout: str, world: int) -> int:
    """How many equal pieces the sequence is cut into: the sequence length must be a multiple."""
    return 2 * world if check_layout(layout) == "zigzag" else world


def check_seqlen(layout: str, world: int, seqlen: int, name: str = "seqlen", family: str = "ring_attention") -> int:
    """The local length ``seqlen / world``; ConfigError when ``seqlen`` does not split evenly."""
    n = chunks(layout, world)
    if seqlen % n:
        lower, upper = seqlen - seqlen % n, seqlen - seqlen % n + n
        raise ConfigError(f"{family}: {name}={seqlen} does not split into {n} equal parts for layout={layout!r} "
                          f"over {world} ranks; use a multiple of {n} (e.g. {lower or upper} or {upper}), padding "
                          "the sequence yourself", family=family, field=name, value=seqlen,
                          allowed=f"a multiple of {n}")
    return seqlen // world


def check_local_len(layout: str, local_len: int, name: str = "q.shape[1]", family: str = "ring_attention") -> None:
    """A rank's own length: zigzag needs two equal halves."""
    if layout == "zigzag" and local_len % 2:
        raise ConfigError(f"{family}: {name}={local_len} is odd; layout='zigzag' holds two chunks of equal length per "
                          "rank, so the local sequence length must be even", family=family, field=name,
                          value=local_len, allowed="an even length")


def positions(layout: str, rank: int, world: int, local_len: int) -> np.ndarray:
    """Global token index of each of rank ``rank``'s ``local_len`` rows (int64)."""
    check_layout(layout)
    i = np.arange(local_len, dtype=np.int64)
    if layout == "contiguous":
        return rank * local_len + i
    if layout == "striped":
        return i * world + rank
    check_local_len(layout, local_len, "local_len")
    half = local_len // 2
    return np.where(i < half, rank * half + i, (2 * world - 1 - rank) * half + (i - half))


def _lib(x):
    """(concatenate, contiguous copy) for x's array library."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        return (lambda xs, dim: torch.cat(xs, dim)), (lambda a: a.contiguous())
    if mod.startswith("cupy"):
        import cupy
        return (lambda xs, dim: cupy.concatenate(xs, dim)), cupy.ascontiguousarray
    return (lambda xs, dim: np.concatenate(xs, dim)), np.ascontiguousarray


def _take(x, dim: int, sl: slice):
    idx = [slice(None)] * x.ndim
    idx[dim] = sl
    return x[tuple(idx)]


def shard(x_full, rank: int, world: int, layout: str = "striped", dim: int = 1):
    """Rank ``rank``'s part of a full sequence ``x_full`` along ``dim`` (1 for (batch, seqlen,
    heads, head_dim) arrays, 2 for (batch, heads, seqlen) lse), as a new contiguous array.

    Raises ConfigError when the sequence length does not split evenly for the layout."""
    if not 0 <= rank < world:
        raise ConfigError.bad_value("shard", "rank", rank, f"in [0, {world})")
    dim = dim % x_full.ndim
    local = check_seqlen(layout, world, x_full.shape[dim], name=f"x_full.shape[{dim}]", family="shard")
    cat, contiguous = _lib(x_full)
    if layout == "contiguous":
        return contiguous(_take(x_full, dim, slice(rank * local, (rank + 1) * local)))
    if layout == "striped":
        return contiguous(_take(x_full, dim, slice(rank, None, world)))
    half = local // 2
    first = _take(x_full, dim, slice(rank * half, (rank + 1) * half))
    second = _take(x_full, dim, slice((2 * world - 1 - rank) * half, (2 * world - rank) * half))
    return contiguous(cat([first, second], dim))


def unshard(shards, layout: str = "striped", dim: int = 1):
    """The full sequence from every rank's shard (a list in rank order), inverse of :func:`shard`."""
    shards = list(shards)
    world = len(shards)
    if world == 0:
        raise ConfigError.bad_value("unshard", "shards", shards, "a non-empty list, one array per rank")
    check_layout(layout, "unshard")
    dim = dim % shards[0].ndim
    local = shards[0].shape[dim]
    if any(s.shape != shards[0].shape for s in shards):
        raise ConfigError("unshard: every shard must have the same shape, got "
                          + ", ".join(str(tuple(s.shape)) for s in shards), family="unshard", field="shards")
    cat, contiguous = _lib(shards[0])
    if layout == "contiguous":
        return contiguous(cat(shards, dim))
    if layout == "zigzag":
        check_local_len(layout, local, f"shards[0].shape[{dim}]", "unshard")
        half = local // 2
        firsts = [_take(s, dim, slice(0, half)) for s in shards]
        seconds = [_take(s, dim, slice(half, local)) for s in shards]
        return contiguous(cat(firsts + seconds[::-1], dim))
    # striped: token t = i * world + r sits at row i of rank r, so interleave row by row
    order = np.argsort(np.concatenate([positions(layout, r, world, local) for r in range(world)]), kind="stable")
    full = cat(shards, dim)
    return contiguous(_gather(full, dim, order))


def _gather(x, dim: int, order: np.ndarray):
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        return x.index_select(dim, torch.as_tensor(order, device=x.device))
    if mod.startswith("cupy"):
        import cupy
        return cupy.take(x, cupy.asarray(order), axis=dim)
    return np.take(x, order, axis=dim)
