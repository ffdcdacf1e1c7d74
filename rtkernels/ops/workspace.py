"""Scratch buffers kept per (device, stream) for kernels that reduce partial results in the same
launch: split-KV decoding (ops/attention_kvcache.py) and split-K matmul (ops/matmul_sm90.py).

Each stream gets two buffers: partials (any contents; a launch writes them before it reads them)
and counters (int32, zero between launches: the kernel's last arriver at a counter resets it, so
they are zeroed once, when allocated, and never per call).  They are allocated on first use, grown
by doubling and never freed (a CUDA graph that captured a call holds their addresses), and made by
the inputs' library (a torch caller's buffers come from torch's allocator, so a torch graph capture
takes them from the graph's pool).

Rules (the reason for the per-stream key): calls on one stream share its buffers in stream order;
two streams never share a counter buffer, since two launches in flight at once would count each
other's arrivals.  A buffer made while its stream is being captured serves only the call being
captured (its zeroing is captured with it, so every replay starts from zero counters) and is not
reused by eager calls.  A graph replays the buffers it captured: do not replay it concurrently with
eager calls (or another replay) on the stream it was captured on.
"""
from __future__ import annotations

from ._arrays import _is_torch, address

_WORKSPACES: dict = {}   # (device, stream handle, torch?) -> _Workspace
_KEEP: list = []         # every buffer ever made: graphs may hold their addresses, so none is freed


class _Workspace:
    """One stream's buffers: partials (any contents) and counters (zero between launches)."""
    __slots__ = ("parts", "part_bytes", "counters", "counter_bytes")

    def __init__(self):
        self.parts = self.counters = None
        self.part_bytes = self.counter_bytes = 0


def stream_handle(stream) -> int:
    """The raw handle of ``stream`` (None: CuPy's current stream; a CuPy or torch stream or an int)."""
    if stream is None:
        import cupy
        return cupy.cuda.get_current_stream().ptr
    if type(stream) is int:
        return stream
    ptr = getattr(stream, "ptr", None)
    return int(stream.cuda_stream if ptr is None else ptr)


def _capturing(handle: int) -> bool:
    import cupy
    try:
        return cupy.cuda.ExternalStream(handle).is_capturing()
    except Exception:   # noqa: BLE001 - e.g. the legacy stream while another captures: treat as capturing
        return True


def _buffer(like, nbytes: int, handle: int, zero: bool):
    """A new uint8 device buffer of ``nbytes`` of ``like``'s library (kept forever), zeroed on the
    launch stream when asked."""
    import cupy
    if _is_torch(like):
        import torch
        buf = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
    else:
        buf = cupy.empty(nbytes, cupy.uint8)
    if zero:
        cupy.cuda.runtime.memsetAsync(address(buf), 0, nbytes, handle)
    _KEEP.append(buf)
    return buf


def stream_workspace(like, device: int, stream, part_bytes: int, counter_bytes: int):
    """(partials, counters): uint8 buffers of at least ``part_bytes`` / ``counter_bytes`` (None
    where 0 is asked), of ``like``'s kind (torch tensor or CuPy array), for a launch on ``stream``
    of ``device``; counters read zero.  See the module docstring for the sharing rules."""
    handle = stream_handle(stream)
    key = (device, handle, _is_torch(like))
    ws = _WORKSPACES.get(key)
    if ws is not None and ws.part_bytes >= part_bytes and ws.counter_bytes >= counter_bytes:
        return ws.parts, ws.counters
    if _capturing(handle):
        parts = _buffer(like, part_bytes, handle, zero=False) if part_bytes else None
        counters = _buffer(like, counter_bytes, handle, zero=True) if counter_bytes else None
        return parts, counters
    ws = ws or _Workspace()
    if ws.part_bytes < part_bytes:
        ws.part_bytes = max(part_bytes, 2 * ws.part_bytes)
        ws.parts = _buffer(like, ws.part_bytes, handle, zero=False)
    if ws.counter_bytes < counter_bytes:
        ws.counter_bytes = max(counter_bytes, 2 * ws.counter_bytes, 4096)
        ws.counters = _buffer(like, ws.counter_bytes, handle, zero=True)
    _WORKSPACES[key] = ws
    return ws.parts, ws.counters


def captured_buffer(like, nbytes: int, stream):
    """A uint8 buffer of ``nbytes`` of ``like``'s library for a temporary of a call on ``stream``
    while that stream is being captured, else None.  A graph replays the addresses it captured, so
    such a temporary is never freed (a pool would hand its block to other arrays, which every
    replay would then overwrite); torch's comes from the graph's private pool.  (Staged matmul
    operands: CuPy's pool allocating inside torch's capture failed with
    cudaErrorStreamCaptureUnsupported, H200, 2026-11-26.)"""
    handle = stream_handle(stream)
    if not _capturing(handle):
        return None
    return _buffer(like, nbytes, handle, zero=False)


def carve(sizes, align: int = 256) -> tuple[tuple, int]:
    """(offsets, total): byte offsets of parts of ``sizes`` bytes laid out back to back in one
    buffer, each starting on an ``align``-byte boundary (None for a size of 0), and the bytes the
    buffer needs - for a call whose temporaries, alive together, share one :func:`stream_workspace`
    buffer without overlapping."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at if n else None)
        at += -(-n // align) * align
    return tuple(offsets), at
