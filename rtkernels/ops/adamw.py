"""Fused multi-tensor AdamW: one launch per (dtype, device) group for a whole parameter list.

>>> rtk.adamw_step(params, grads, exp_avgs, exp_avg_sqs, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
...                weight_decay=0.01, step=t)                        # t = 1 for the first step
>>> rtk.adamw_step(bf16_params, grads, m, v, ..., master_params=fp32_copies)   # fp32 master weights
>>> rtk.adamw_step(params, grads, m, v, lr=lr_tensor, step=step_tensor, ...)   # device scalars: graph-capturable

torch.optim.AdamW semantics (decoupled weight decay, bias correction; its single-tensor algorithm,
operation for operation in float32).  Tensors of any shapes (contiguous), CuPy arrays or torch
tensors; params float32 / float16 / bfloat16, grads of the param's dtype or float32, exp_avg /
exp_avg_sq float32 or the param's dtype (both the same), master_params float32 (the update reads
and writes them, and params get their rounded copy).  Everything is updated in place.

The device table.  Each group's kernel reads its tensors' pointers and sizes from a device table
(8 int64 per tensor) and walks fixed-size chunks of all of them (templates/adamw.cu.j2).  The table
is built on the first call and cached under the *identity* of the list objects (params, grads,
exp_avgs, exp_avg_sqs, master_params): a later call with the same five list objects of the same
lengths launches at once - no per-tensor host work.  It is rebuilt when any list is a different
object (e.g. ``[p.grad for p in params]`` made anew each step) or changed length, or when
``rebuild=True``.  Replacing an element of a list in place (``grads[i] = t``) or a tensor's storage
(``p.data = ...``, ``resize_``) is *not* seen: pass ``rebuild=True`` after doing so.  One entry is
kept per params list object (the cache holds the five lists, so their ids stay unique), at most
``MAX_CACHED`` of them (least recently used dropped).

Scalars.  ``lr`` and ``step`` may be Python numbers (the bias corrections are computed on the host
in double, as torch does) or float32 device scalars of one element (each thread computes them in
double): then the call is CUDA-graph capturable, replaying with whatever the scalars hold.  A device
``step`` is read, not incremented; add 1 to it before each step, as torch's optimizer does.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import dtypes
from ..config import KernelConfig, register_family
from ..errors import ConfigError
from ..kernel import get_kernel
from ._arrays import _is_torch, as_device_array, cupy_stream, device_pointer, dtype_name, torch_stream_ptr

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
MAX_CACHED = 16


@register_family
@dataclass(frozen=True)
class AdamWConfig(KernelConfig):
    """One (dtype) group of the multi-tensor AdamW step (templates/adamw.cu.j2)."""

    family: ClassVar[str] = "adamw"
    template: ClassVar[str] = "adamw.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("adamw_multi",)
    expected_global_width: ClassVar[int] = 128
    param_dtype: str = "float32"
    grad_dtype: str = "float32"
    state_dtype: str = "float32"
    master: bool = False
    vec: int = 4
    block_size: int = 512
    unroll: int = 2
    min_blocks: int = 1

    def __post_init__(self):
        self._check_dtype("param_dtype", FLOAT_DTYPES)
        self._check_dtype("grad_dtype", tuple(dict.fromkeys((self.param_dtype, "float32"))))
        self._check_dtype("state_dtype", tuple(dict.fromkeys((self.param_dtype, "float32"))))
        if not isinstance(self.master, bool):
            self._fail("master", "True or False")
        self._check_choice("vec", (1, 2, 4, 8))
        self._check_int("block_size", 64, 1024, power_of_two=True)
        self._check_int("unroll", 1, 8)
        self._check_int("min_blocks", 1, 32)
        if self.min_blocks * self.block_size > 2048:
            self._fail("min_blocks", f"at most {2048 // self.block_size} with block_size={self.block_size}")

    @property
    def chunk(self) -> int:
        """Elements per work item (one block-iteration)."""
        return self.block_size * self.unroll * self.vec

    @property
    def threads_per_block(self) -> int:
        return self.block_size

    def compile_options(self):
        from ..compiler import CompileOptions
        return CompileOptions(max_registers=min(255, 65536 // (self.block_size * self.min_blocks) // 8 * 8))


# Reasoned, to be measured (tools/bench_training.py): 16-byte accesses of the narrowest array (8
# elements of 16-bit params; float32 states then take two 16-byte loads each), all of a thread's
# loads in flight before the math: float32 4 arrays x 2 vectors x 16 B = 128 B per thread; 16-bit
# params one vector of 8 (16 + 3 x 32 B with masters = 112 B: two would need > 128 registers,
# ptxas spilled at the 512-thread cap).  One 512-thread block per SM keeps 56-64 KiB in flight,
# above the ~25 KiB bandwidth-latency product.  Chunks of 4096 (float32) / 4096 (16-bit) elements.
def plan(param_dtype: str, grad_dtype: str, state_dtype: str, master: bool) -> AdamWConfig:
    wide = dtypes.itemsize(param_dtype) == 2
    return AdamWConfig(param_dtype=param_dtype, grad_dtype=grad_dtype, state_dtype=state_dtype, master=master,
                       vec=8 if wide else 4, block_size=512, unroll=1 if wide else 2)


# ---- the cached plan ----------------------------------------------------------------------------
@dataclass
class _Group:
    kernel: object
    grid: tuple
    block: tuple
    table: object          # device int64 (ntensors, 8) (torch: a MemoryPointer that keeps it alive)
    ntensors: int
    nchunks: int
    device: int
    torch: bool


@dataclass
class _Plan:
    lists: tuple           # the five list objects (keeps their ids unique while cached)
    lengths: tuple
    groups: list


_CACHE: "OrderedDict[int, _Plan]" = OrderedDict()


def clear_cache() -> None:
    """Forget every cached table (the next call of each list set rebuilds)."""
    _CACHE.clear()


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1: float = 0.9, beta2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-2, step, maximize: bool = False, master_params=None,
               stream=None, rebuild: bool = False, config: AdamWConfig | None = None) -> None:
    """One AdamW step over lists of tensors, in place, one launch per (dtype, device) group.

    Parameters
    ----------
    params, grads, exp_avgs, exp_avg_sqs : lists (or tuples) of equal length; element i of each has
        the same number of elements; all contiguous.  params float32 / float16 / bfloat16; grads of
        the param's dtype or float32; exp_avgs / exp_avg_sqs float32 or the param's dtype.
    lr : float, or a float32 device scalar (one element).
    beta1, beta2, eps, weight_decay, maximize : as torch.optim.AdamW.
    step : the step number after this update's increment (1 for the first step), as torch's
        ``state["step"]``: an int / float, or a float32 device scalar (read, not incremented).
    master_params : optional list of float32 tensors, one per param: the update runs on them and
        params receive their rounded values (bfloat16 / float16 params with float32 masters).
    stream : CuPy / torch stream or raw handle (default: CuPy's current stream, torch's current
        stream for torch tensors).
    rebuild : rebuild the cached device table (see the module docstring for when it is needed).
    config : an :class:`AdamWConfig` for every group (its dtypes must match the group's).
    """
    op = "adamw_step"
    lists = (params, grads, exp_avgs, exp_avg_sqs, master_params)
    lengths = tuple(len(x) if x is not None else -1 for x in lists)
    plan = _CACHE.get(id(params))
    if plan is None or rebuild or config is not None or plan.lengths != lengths or \
            any(a is not b for a, b in zip(plan.lists, lists)):
        plan = _build(op, lists, config)
        if plan.groups and config is None:
            _CACHE[id(params)] = plan
            _CACHE.move_to_end(id(params))
            while len(_CACHE) > MAX_CACHED:
                _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(id(params))
    if not plan.groups:
        return
    hyper = _hyper(op, lr, step, beta1, beta2, eps, weight_decay, maximize)
    for g in plan.groups:
        lr_dev = _device_scalar(op, "lr", lr, g) if not _is_number(lr) else None
        step_dev = _device_scalar(op, "step", step, g) if not _is_number(step) else None
        s = stream
        if s is None and g.torch:
            import sys
            s = torch_stream_ptr(sys.modules["torch"], g.device)
        if g.device != _current_device():
            import cupy
            with cupy.cuda.Device(g.device):
                g.kernel.launch(g.grid, g.block, g.table, lr_dev, step_dev, g.ntensors, g.nchunks, *hyper, stream=s)
        else:
            g.kernel.launch(g.grid, g.block, g.table, lr_dev, step_dev, g.ntensors, g.nchunks, *hyper, stream=s)


def _current_device() -> int:
    import cupy
    return cupy.cuda.runtime.getDevice()


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _hyper(op, lr, step, beta1, beta2, eps, weight_decay, maximize) -> tuple:
    """The kernel's scalar arguments after ntensors, nchunks (see adamw_multi)."""
    for name, v in (("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", weight_decay)):
        if not _is_number(v) or not math.isfinite(float(v)):
            raise ConfigError(f"{op}: {name}={v!r} must be a finite number", family=op, field=name, value=v)
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ConfigError(f"{op}: betas ({beta1}, {beta2}) must be in [0, 1)", family=op, field="beta1",
                          value=(beta1, beta2), allowed="[0, 1)")
    b1, b2, wd = float(beta1), float(beta2), float(weight_decay)
    lr_h = float(lr) if _is_number(lr) else 0.0
    step_h = float(step) if _is_number(step) else 1.0
    if _is_number(step) and step_h < 1:
        raise ConfigError(f"{op}: step={step!r}; the first step is 1 (torch's state['step'] after its increment)",
                          family=op, field="step", value=step, allowed=">= 1")
    # as torch's single-tensor AdamW, in Python floats (double)
    decay = 1.0 - lr_h * wd
    step_size = lr_h / (1.0 - b1 ** step_h)
    bc2_sqrt = (1.0 - b2 ** step_h) ** 0.5
    inv_bc2 = float(np.float32(1.0) / np.float32(bc2_sqrt))   # torch: tensor / scalar = tensor * (1 / float(scalar))
    return (lr_h, step_h, b1, b2, wd, 1.0 - b1, b2, 1.0 - b2, float(eps), decay, step_size, inv_bc2,
            int(bool(maximize)))


def _device_scalar(op, name, v, g: _Group):
    """The launch argument of a float32 device scalar.  No DLPack exchange and no CUDA call: a
    torch tensor goes by its address (this runs inside CUDA-graph captures)."""
    try:
        dt = dtype_name(v)
    except (TypeError, ConfigError):
        dt = type(v).__name__
    if _is_torch(v):
        size, dev = v.numel(), (v.get_device() if v.is_cuda else None)
    elif hasattr(v, "data") and hasattr(getattr(v, "data"), "device_id"):   # CuPy
        size, dev = v.size, v.data.device_id
    else:
        raise ConfigError(f"{op}: {name} must be a number or a float32 device scalar (CuPy array or torch "
                          f"tensor of one element), got {type(v).__name__}", family=op, field=name)
    if dt != "float32" or size != 1:
        raise ConfigError(f"{op}: {name} as a device scalar must be one float32 element, got {dt} of "
                          f"{size} elements", family=op, field=name, value=dt, allowed="float32, one element")
    if dev != g.device:
        raise ConfigError(f"{op}: {name} is on device {dev}, its tensors on device {g.device}", family=op,
                          field=name)
    return device_pointer(v, dev) if _is_torch(v) else v


def _build(op, lists, config) -> _Plan:
    params, grads, exp_avgs, exp_avg_sqs, masters = lists
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "master_params")
    n = len(params)
    for name, lst in zip(names[1:], lists[1:]):
        if lst is not None and len(lst) != n:
            raise ConfigError(f"{op}: {name} has {len(lst)} tensors, params has {n}", family=op, field=name,
                              value=len(lst), allowed=str(n))
    groups: dict = {}
    for i in range(n):
        row, key = _tensor_row(op, i, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                               masters[i] if masters is not None else None)
        if row is not None:
            groups.setdefault(key, []).append((row, params[i]))
    out = []
    for (dev, pdt, gdt, sdt, master), rows in groups.items():
        cfg = config or plan(pdt, gdt, sdt, master)
        if (cfg.param_dtype, cfg.grad_dtype, cfg.state_dtype, cfg.master) != (pdt, gdt, sdt, master):
            raise ConfigError(f"{op}: config ({cfg.param_dtype}, {cfg.grad_dtype}, {cfg.state_dtype}, master="
                              f"{cfg.master}) does not match a group of tensors ({pdt}, {gdt}, {sdt}, master={master})",
                              family=op, field="config", value=cfg)
        table = np.zeros((len(rows), 8), dtype=np.int64)
        first = 0
        for j, (r, _) in enumerate(rows):
            ptrs, numel, aligned = r
            table[j, :5] = ptrs
            table[j, 5], table[j, 6], table[j, 7] = numel, first, aligned
            first += -(-numel // cfg.chunk)
        like = rows[0][1]
        import cupy
        with cupy.cuda.Device(dev):
            k = get_kernel(cfg, "adamw_multi")
            dtab = _upload(like, table, dev)
            grid = (max(1, min(first, _resident_blocks(k, cfg))),)
        # the launch argument: a MemoryPointer for torch (no per-call pointer query), kept alive here
        arg = device_pointer(dtab, dev) if _is_torch(like) else dtab
        out.append(_Group(k, grid, (cfg.block_size,), arg, len(rows), first, dev, _is_torch(like)))
    return _Plan(lists, tuple(len(x) if x is not None else -1 for x in lists), out)


@dataclass(frozen=True)
class _Info:
    ptr: int
    numel: int
    dtype: str
    device: int


def _info(op: str, name: str, a) -> _Info:
    """Address, size, dtype and device of a contiguous CUDA array.  torch tensors are read
    directly (no CuPy view: parameters that require grad cannot go through DLPack)."""
    if _is_torch(a):
        if not a.is_cuda:
            raise ConfigError(f"{op}: {name} is on {a.device}; it must be on a CUDA device", family=op, field=name)
        if not a.is_contiguous():
            raise ConfigError(f"{op}: {name} is not contiguous (strides {tuple(a.stride())}); the step needs "
                              "contiguous tensors", family=op, field=name)
        return _Info(a.data_ptr(), a.numel(), dtype_name(a), a.get_device())
    av = as_device_array(a, op, name)
    if not av.flags.c_contiguous:
        raise ConfigError(f"{op}: {name} is not contiguous (strides {av.strides}); the step needs contiguous "
                          "tensors", family=op, field=name)
    return _Info(int(av.data.ptr), int(av.size), dtype_name(a), av.data.device_id)


def _tensor_row(op, i, p, g, m, v, master):
    """((5 pointers, numel, aligned), group key) of tensor i, checked; (None, None) when empty."""
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "master_params")
    infos = [None if a is None else _info(op, f"{name}[{i}]", a) for name, a in zip(names, (p, g, m, v, master))]
    pi, gi, mi, vi, mai = infos
    pdt = "bfloat16" if pi.dtype == "uint16" else pi.dtype   # CuPy holds bfloat16 as uint16 bits
    if pdt not in FLOAT_DTYPES:
        raise ConfigError(f"{op}: params[{i}] has dtype {pdt}; allowed: {', '.join(FLOAT_DTYPES)}", family=op,
                          field="params", value=pdt)
    fix = (lambda d: pdt if d == "uint16" and pdt == "bfloat16" else d)
    gdt, mdt, vdt = fix(gi.dtype), fix(mi.dtype), fix(vi.dtype)
    if gdt not in (pdt, "float32"):
        raise ConfigError(f"{op}: grads[{i}] is {gdt}; with {pdt} params it must be {pdt} or float32", family=op,
                          field="grads", value=gdt)
    if mdt != vdt or mdt not in (pdt, "float32"):
        raise ConfigError(f"{op}: exp_avgs[{i}] / exp_avg_sqs[{i}] are {mdt} / {vdt}; both must be float32 or "
                          f"{pdt}", family=op, field="exp_avgs", value=(mdt, vdt))
    if mai is not None and mai.dtype != "float32":
        raise ConfigError(f"{op}: master_params[{i}] is {mai.dtype}; master weights are float32", family=op,
                          field="master_params", value=mai.dtype)
    numel = pi.numel
    for name, info in zip(names[1:], infos[1:]):
        if info is not None and info.numel != numel:
            raise ConfigError(f"{op}: {name}[{i}] has {info.numel} elements, params[{i}] has {numel}", family=op,
                              field=name, value=info.numel, allowed=str(numel))
    devs = {info.device for info in infos if info is not None}
    if len(devs) != 1:
        raise ConfigError(f"{op}: the tensors of params[{i}] are on devices {sorted(devs)}; one device each",
                          family=op, field="params")
    if numel == 0:
        return None, None
    ptrs = [info.ptr if info is not None else 0 for info in infos]
    aligned = int(all(q % 16 == 0 for q in ptrs))
    return (ptrs, numel, aligned), (devs.pop(), pdt, gdt, mdt, mai is not None)


def _upload(like, table: np.ndarray, dev: int):
    """The table on device ``dev``, allocated by like's library (torch: its caching allocator on
    the current stream, which the launches use)."""
    if _is_torch(like):
        import torch
        return torch.from_numpy(table).to(device=torch.device("cuda", dev))
    import cupy
    d = cupy.empty(table.shape, dtype=cupy.int64)
    d.set(table, stream=cupy_stream(None))
    return d


def _resident_blocks(k, cfg) -> int:
    from . import rowwise as rw
    return rw.resident_on_device(k, cfg.block_size)


# ---- float64 reference (host, NumPy) ------------------------------------------------------------
def adamw_reference(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                    maximize=False):
    """One AdamW step in float64 on NumPy arrays; returns (param, exp_avg, exp_avg_sq)."""
    p, g, m, v = (np.asarray(a, np.float64) for a in (param, grad, exp_avg, exp_avg_sq))
    g = -g if maximize else g
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    denom = np.sqrt(v) / math.sqrt(1 - beta2 ** step) + eps
    return p - lr / (1 - beta1 ** step) * m / denom, m, v


__all__ = ["adamw_step", "AdamWConfig", "adamw_reference"]
