"""The registration helper behind ``torch.ops.rtk.*``: one call per op.

    op("softmax(Tensor x, bool log_softmax=False) -> Tensor",
       lambda x, log_softmax: _ops.softmax(x, log_softmax=log_softmax),
       fake=lambda x, log_softmax: _like(x),
       backward=_softmax_backward, setup_context=_save_softmax_output)

defines ``rtk::softmax`` in the dispatcher (``torch.ops.rtk.softmax``) with a CUDA kernel, a fake
(meta) kernel for torch.compile / FakeTensor tracing, and an autograd kernel.  Everything the
dispatcher needs comes from ``torch.library`` (``Library.define`` / ``impl``, ``register_fake``);
what :func:`op` adds is a lean autograd kernel, for host cost:

* ``torch.library.custom_op`` and ``torch.library.register_autograd`` put three Python layers
  between the caller and the kernel even when no gradient is needed (an autograd kernel that
  redispatches under ``_AutoDispatchBelowAutograd``, a backend wrapper that checks aliasing, and
  a ``torch._disable_dynamo`` wrapper): about 20 us per call on this project's development CPU,
  against 4 us for a plain ``Library.impl`` kernel (measured with a no-op CPU kernel).
* Here the autograd kernel is the only Python layer: without a gradient to record it calls the
  CUDA implementation directly when the dispatcher's next stop would be the CUDA kernel anyway
  (``keyset`` after ADInplaceOrView is plain CUDA: no FakeTensor, functionalization, Python mode or
  subclass in between; decided once per keyset); otherwise it redispatches exactly as torch's own
  helpers do.  What remains is the dispatcher's own floor, which any op with one Python kernel
  pays (:func:`floor_op` measures it; 2.2 us for attention's schema on the H100 host, 3.2 us
  returning new tensors, 2026-11-26), plus this kernel: generated per schema (see
  :func:`_parameters`), it costs ~5.5k instructions a call over the floor for attention's schema
  (tools/host_model.py under callgrind, 2026-11-26; 8.5k for the ``*args`` kernel before it):
  the keyset object the dispatcher builds for it (~1.9k), its memo lookup (~1.6k), three
  ``requires_grad`` reads (~1.2k).  With a
  gradient to record, it runs a ``torch.autograd.Function`` whose forward redispatches below
  autograd and whose backward is the op's ``backward`` (which calls other ``torch.ops.rtk`` ops,
  so AOTAutograd traces it into the backward graph under torch.compile).

An op without a backward still gets the autograd kernel: a backward through it raises
NotImplementedError naming the op (PyTorch's fallback would only warn and return no gradient).
Mutating ops (``Tensor(a!)`` in the schema) are left to ``torch.library.custom_op``, which bumps
version counters; see :func:`op`.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch

LIB = torch.library.Library("rtk", "DEF")   # noqa: TOR901 - the namespace's one definition

_AFTER_INPLACE_OR_VIEW = torch._C._after_ADInplaceOrView_keyset
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_grad_enabled = torch._C.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
_below_autograd = torch._C._AutoDispatchBelowAutograd
# A keyset's bits as an int (a dict key); None where this torch lacks raw_repr (no memo then)
_raw_repr = getattr(torch._C.DispatchKeySet, "raw_repr", None) or (lambda keyset: None)

# Layout tags: the kernels read each array through its own strides, so Inductor must hand them
# the strides eager mode would have (rtk's stride rules: last dimension contiguous, 16-byte
# aligned rows).  The newest torch names this needs_exact_strides; older ones needs_fixed_stride_order.
_LAYOUT_TAG = getattr(torch.Tag, "needs_exact_strides", None) or torch.Tag.needs_fixed_stride_order
TAGS = (torch.Tag.pt2_compliant_tag, _LAYOUT_TAG)

REGISTERED: dict[str, "torch._ops.OpOverload"] = {}


def op(schema: str, impl: Callable, *, fake: Callable, backward: Callable | str | None = None,
       setup_context: Callable | None = None, prepare: Callable | None = None,
       lib: torch.library.Library | None = None, device: str = "CUDA"):
    """Define ``<lib namespace>::<name>`` from ``schema`` and register its kernels; returns the
    ``OpOverload`` (``torch.ops.rtk.<name>.default``).

    Parameters
    ----------
    schema : ``"name(Tensor x, float eps=1e-6) -> Tensor"`` without the namespace (the dispatcher's
        schema language: ``Tensor?``, ``Tensor[]``, ``float?``, ``str``, ``int[]``, ``ScalarType?``
        ...).  Keyword-only arguments are not supported.
    impl : the CUDA kernel, called with the schema's arguments positionally; returns what the
        schema returns (a tuple for several outputs, a list for ``Tensor[]``).
    fake : the same signature over FakeTensors: new empty outputs with the exact shapes, dtypes and
        strides ``impl`` produces (torch.compile, FakeTensor, meta tensors, opcheck).
    backward : ``backward(ctx, *grads) -> one gradient (or None) per schema argument``; a string
        instead makes every backward through the op raise NotImplementedError with that text;
        None: the generic "has no backward" message.
    setup_context : ``setup_context(ctx, args, output)`` saves what ``backward`` needs
        (``ctx.save_for_backward``, ``ctx.mark_non_differentiable`` for outputs such as lse).
    prepare : ``prepare(args)``, called before ``impl`` when the call records for autograd (its
        backward will run): attention starts compiling its backward's kernels there.
    lib : the ``torch.library.Library`` to define in (default ``rtk``; tests use their own).
    device : the dispatch key of ``impl`` ("CUDA"; "CPU" for tests).
    """
    lib = lib or LIB
    name = schema.split("(", 1)[0].strip()
    if re.search(r"\(\s*\*|,\s*\*\s*,", schema):
        raise ValueError(f"{name}: keyword-only arguments are not supported by rtkernels.torch.op")
    if "!" in schema:
        raise ValueError(f"{name}: mutating schemas go through torch.library.custom_op (version counters)")
    lib.define(schema, tags=TAGS)
    opov = getattr(getattr(torch.ops, lib.ns), name).default
    lib.impl(name, _filled(impl, opov), device)
    torch.library.register_fake(f"{lib.ns}::{name}", _filled(fake, opov), lib=lib)
    lib.impl(name, _autograd_kernel(opov, name, impl, getattr(torch._C.DispatchKey, device), backward,
                                    setup_context, prepare), "Autograd", with_keyset=True)
    REGISTERED[name] = opov
    return opov


# ---- kernels generated per schema ----------------------------------------------------------------
# The dispatcher calls a Python kernel with the schema's arguments positionally, minus trailing ones
# equal to their defaults.  A kernel written for the schema (a0, a1, ..., defaults as Python
# defaults) takes them as they come: no ``*args`` tuple, no padding (``args + pad[len(args):]``),
# no ``len`` test, and the requires-grad test reads each tensor argument's flag directly instead of
# passing every argument through ``torch._C._any_requires_grad`` (0.5 us for attention's five
# arguments, 0.8 us for matmul's six, against 0.1 us per tensor read inline; development CPU,
# 2026-11-26).  Generated code is built from the schema only (argument count, types, defaults).
def _parameters(opov) -> tuple[list[str], str, dict]:
    """The schema's arguments as Python parameters: names ``a0, a1, ...``, the parameter list with
    the trailing defaults (``"a0, a1, a2=_d2"``) and the namespace holding those defaults."""
    args = opov._schema.arguments
    first_default = len(args)
    while first_default and args[first_default - 1].has_default_value():
        first_default -= 1
    names = [f"a{i}" for i in range(len(args))]
    env = {f"_d{i}": args[i].default_value for i in range(first_default, len(args))}
    params = ", ".join(n if i < first_default else f"{n}=_d{i}" for i, n in enumerate(names))
    return names, params, env


def _requires_grad_test(opov, names: list[str]) -> str:
    """A Python expression over ``names``: whether a tensor argument requires grad (what
    ``torch._C._any_requires_grad(*args)`` answers: tensors, and tensors in a list); "False" for a
    schema without tensor arguments."""
    terms = []
    for n, a in zip(names, opov._schema.arguments):
        t = a.type
        if isinstance(t, torch._C.TensorType):
            terms.append(f"{n}.requires_grad")
        elif isinstance(t, torch._C.OptionalType) and isinstance(t.getElementType(), torch._C.TensorType):
            terms.append(f"({n} is not None and {n}.requires_grad)")
        elif "Tensor" in str(t):   # Tensor[] / Tensor?[]: the list's tensors
            terms.append(f"_any_requires_grad({n})")
    return " or ".join(terms) or "False"


def _generated(source: str, env: dict, name: str) -> Callable:
    exec(source, env)   # noqa: S102 - built from the schema only (see _parameters)
    fn = env["kernel"]
    fn.__name__ = fn.__qualname__ = name
    return fn


def _filled(fn: Callable, opov) -> Callable:
    """``fn`` as a kernel of ``opov``: called with every schema argument, the trailing defaults the
    dispatcher dropped put back (one frame, no padding per call)."""
    names, params, env = _parameters(opov)
    env["_fn"] = fn
    return _generated(f"def kernel({params}):\n    return _fn({', '.join(names)})\n", env,
                      getattr(fn, "__name__", "kernel"))


def _autograd_kernel(opov, name: str, impl: Callable, dense_key, backward, setup_context, prepare=None):
    fn = _function_class(opov, name, backward, setup_context, prepare)
    returns_list = str(opov._schema.returns[0].type) == "List[Tensor]" if opov._schema.returns else False

    def with_grad(keyset, args):
        flat, spec = _flatten(args)
        out = fn.apply(keyset, spec, *flat)
        return list(out) if returns_list else out

    straight: dict = {}   # keyset (raw bits) -> whether the next kernel below autograd is impl itself

    def decide(keyset, raw) -> bool:
        # three pybind calls (~1.4 us on the development CPU, 2026-11-25): once per keyset
        direct = (keyset & _AFTER_INPLACE_OR_VIEW).highestPriorityTypeId() == dense_key
        if raw is not None:
            if len(straight) > 64:
                straight.clear()
            straight[raw] = direct
        return direct

    names, params, env = _parameters(opov)
    args = ", ".join(names)
    packed = f"({args},)" if names else "()"
    env.update(_grad_enabled=_grad_enabled, _any_requires_grad=_any_requires_grad, _with_grad=with_grad,
               _straight=straight, _raw_repr=_raw_repr, _decide=decide, _impl=impl, _below_autograd=_below_autograd,
               _redispatch=opov.redispatch, _AFTER_AUTOGRAD=_AFTER_AUTOGRAD)
    # Without a gradient to record: the CUDA kernel itself when the dispatcher's next stop below
    # autograd would be it (decided once per keyset), else the redispatch torch's own helpers do.
    source = (f"def kernel(keyset, {params}):\n"
              f"    if _grad_enabled() and ({_requires_grad_test(opov, names)}):\n"
              f"        return _with_grad(keyset, {packed})\n"
              f"    raw = _raw_repr(keyset)\n"
              f"    direct = _straight.get(raw)\n"
              f"    if direct is None:\n"
              f"        direct = _decide(keyset, raw)\n"
              f"    if direct:\n"
              f"        return _impl({args})   # what the redispatch below would reach, one Python layer sooner\n"
              f"    with _below_autograd():\n"
              f"        return _redispatch(keyset & _AFTER_AUTOGRAD, {args})\n")
    return _generated(source, env, f"rtk_{name}_autograd")


def _flatten(args) -> tuple[list, tuple]:
    """Tensors of ``args`` as one flat list (autograd.Function tracks only direct tensor
    arguments) and how to rebuild ``args``: per argument ("t", index), ("l", start, count) for a
    tensor list, or ("v", value)."""
    flat: list = []
    spec = []
    for a in args:
        if isinstance(a, torch.Tensor):
            spec.append(("t", len(flat)))
            flat.append(a)
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            spec.append(("l", len(flat), len(a)))
            flat.extend(a)
        else:
            spec.append(("v", a))
    return flat, tuple(spec)


def _unflatten(flat, spec) -> list:
    out = []
    for s in spec:
        out.append(flat[s[1]] if s[0] == "t" else list(flat[s[1]:s[1] + s[2]]) if s[0] == "l" else s[1])
    return out


def _function_class(opov, name: str, backward, setup_context, prepare=None):
    def forward(ctx, keyset, spec, *flat):
        args = _unflatten(flat, spec)
        if prepare is not None:
            prepare(args)
        with _below_autograd():
            out = opov.redispatch(keyset & _AFTER_AUTOGRAD, *args)
        ctx.rtk_spec = spec
        if setup_context is not None:
            setup_context(ctx, tuple(args), out)
        return tuple(out) if isinstance(out, list) else out

    def backward_(ctx, *grads):
        spec = ctx.rtk_spec
        if not callable(backward):
            raise NotImplementedError(backward or f"rtk.{name} has no backward: its inputs cannot receive "
                                                  "gradients (compute it under torch.no_grad(), or detach them)")
        flat_needs = ctx.needs_input_grad[2:]
        per_arg = tuple(flat_needs[s[1]] if s[0] == "t" else any(flat_needs[s[1]:s[1] + s[2]]) if s[0] == "l"
                        else False for s in spec)
        saved = ctx.needs_input_grad
        try:
            ctx.needs_input_grad = per_arg
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = saved
        result = result if isinstance(result, tuple) else (result,)
        if len(result) != len(spec):
            raise RuntimeError(f"rtk.{name}: backward returned {len(result)} gradients for {len(spec)} arguments")
        flat_grads: list[Any] = [None] * len(flat_needs)
        for s, g in zip(spec, result):
            if g is None or s[0] == "v":
                continue
            if s[0] == "t":
                flat_grads[s[1]] = g
            else:
                flat_grads[s[1]:s[1] + s[2]] = list(g)
        return (None, None, *flat_grads)

    return type(f"rtk_{name}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward_)})


_FLOOR: dict = {}


def floor_op(schema: str, outputs, device: str = "CUDA", fresh: bool = False):
    """``(op, fn)``: an op ``rtk_floor::<name>`` of ``schema`` whose one kernel ``fn`` returns
    ``outputs`` at once, and ``fn`` itself.  ``op(...)`` minus ``fn(...)`` is what torch's
    dispatcher costs any op with a Python kernel (argument parsing, the boxed call into Python
    and back, the C++ autograd fallback): the floor under the ``torch.ops.rtk`` path, for
    tools/bench_host.py and the host-overhead test to measure rtk's own share against.

    ``fresh``: ``fn`` returns new tensors (``torch.empty_like`` of each output) as every rtk op
    does; torch charges more for handing back tensors made inside the kernel than for tensors
    that already existed (~2 us for attention's two outputs on the development CPU beyond the
    two allocations themselves, tools/host_model.py, 2026-11-26), and that part of the floor
    is torch's too."""
    name = schema.split("(", 1)[0].strip()
    hit = _FLOOR.get((name, device, fresh))
    if hit is None:
        if "lib" not in _FLOOR:
            _FLOOR["lib"] = torch.library.Library("rtk_floor", "DEF")   # noqa: TOR901
        lib = _FLOOR["lib"]
        op_name = f"{name}_{device.lower()}{'_fresh' if fresh else ''}"
        lib.define(op_name + schema[len(name):])
        if fresh:
            many = isinstance(outputs, (tuple, list))
            templates = tuple(outputs) if many else (outputs,)
            empty_like = torch.empty_like

            def fn(*args):
                new = tuple(empty_like(t) for t in templates)
                return new if many else new[0]
        else:
            def fn(*args):
                return outputs
        lib.impl(op_name, fn, device)
        hit = _FLOOR[(name, device, fresh)] = (getattr(torch.ops.rtk_floor, op_name).default, fn)
    return hit


def empty_like_contiguous(x: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """A new contiguous tensor on x's device (what the rtk ops allocate for their outputs)."""
    return x.new_empty(tuple(x.shape) if shape is None else tuple(shape), dtype=dtype or x.dtype)
