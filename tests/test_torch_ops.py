"""rtkernels.torch: the ops as torch.ops.rtk custom ops.

CPU (skipped without torch): the import rule, the registration, each op's fake kernel (shapes,
dtypes, strides on FakeTensors), the autograd wiring traced on meta tensors, and the
registration helper itself on a CPU test op (eager, gradients, inference mode, opcheck,
torch.compile fullgraph without graph breaks).  GPU (``-m gpu``): opcheck per op, numerics and
gradients against torch (the 2x error rule), torch.compile fullgraph and reduce-overhead.  The
transformers backend's tests are in test_torch_hf.py.
"""
from __future__ import annotations

import math

import pytest


torch = pytest.importorskip("torch")
rtt = pytest.importorskip("rtkernels.torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from rtkernels.torch._library import op  # noqa: E402

OPS = ("attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "matmul",
       "quantized_matmul", "dequantize_weight", "softmax", "rmsnorm", "layernorm", "reduce", "elementwise",
       "softmax_backward", "rmsnorm_backward", "layernorm_backward", "cross_entropy", "cross_entropy_with_grad")


# ---- registration and fake kernels (CPU) -------------------------------------------------------
def test_every_op_is_registered_with_tags():
    for name in OPS:
        opov = getattr(torch.ops.rtk, name).default
        assert torch.Tag.pt2_compliant_tag in opov.tags, name
        assert not opov._schema.is_mutable, name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(opov.name(), "CUDA"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(opov.name(), "Autograd"), name


def _fake(shape, dtype=torch.bfloat16, device="cuda"):
    return torch.empty(shape, dtype=dtype, device=device)


def test_fake_attention_shapes_and_strides():
    with FakeTensorMode():
        q, k = _fake((2, 17, 8, 72)), _fake((2, 33, 2, 72))
        o, lse = rtt.attention(q, k, k, causal=True)
        assert o.shape == q.shape and o.is_contiguous() and o.dtype == q.dtype
        assert lse.shape == (2, 8, 17) and lse.dtype == torch.float32 and lse.is_contiguous()
        dq, dk, dv = rtt.attention_backward(o, q, k, k, o, lse, True)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape) and dk.is_contiguous()
        y = rtt.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), enable_gqa=True)
        assert y.shape == (2, 8, 17, 72) and y.transpose(1, 2).is_contiguous()
        from rtkernels.errors import ConfigError
        with pytest.raises(ConfigError, match="head_dim=60"):
            rtt.attention(_fake((1, 4, 2, 60)), _fake((1, 4, 2, 60)), _fake((1, 4, 2, 60)))
        with pytest.raises(ConfigError, match="multiple of nheads_kv"):
            rtt.attention(_fake((1, 4, 6, 64)), _fake((1, 4, 4, 64)), _fake((1, 4, 4, 64)))
        with pytest.raises(ConfigError, match="float16 or all bfloat16"):
            f = _fake((1, 4, 2, 64), torch.float32)
            rtt.attention(f, f, f)


def test_fake_masked_and_varlen_attention():
    """Windows, softcap and packed sequences on FakeTensors: shapes, and rtk's own argument errors."""
    from rtkernels.errors import ConfigError
    with FakeTensorMode():
        q, k = _fake((2, 17, 8, 72)), _fake((2, 33, 2, 72))
        o, lse = rtt.attention(q, k, k, causal=True, window=(8, 0), softcap=30.0)
        assert o.shape == q.shape and lse.shape == (2, 8, 17)
        dq, dk, dv = rtt.attention_backward(o, q, k, k, o, lse, True, window=(8, 0), softcap=30.0)
        assert (dq.shape, dk.shape) == (q.shape, k.shape)
        with pytest.raises(ConfigError, match="window"):
            rtt.attention(q, k, k, causal=True, window=(8, 3))      # right of the diagonal under causal
        with pytest.raises(ConfigError, match="softcap"):
            rtt.attention(q, k, k, softcap=-1.0)
        qp, kp = _fake((300, 8, 64)), _fake((410, 2, 64))
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        o, lse = rtt.attention_varlen(qp, kp, kp, cu, cu, 128, 200, causal=True, window=(31, 0))
        assert o.shape == qp.shape and o.is_contiguous() and lse.shape == (8, 300) and lse.dtype == torch.float32
        dq, dk, dv = rtt.attention_varlen_backward(o, qp, kp, kp, o, lse, cu, cu, 128, 200, True)
        assert (dq.shape, dk.shape, dv.shape) == (qp.shape, kp.shape, kp.shape)
        with pytest.raises(ConfigError, match="3-D"):
            rtt.attention_varlen(q, k, k, cu, cu, 17, 33)
        with pytest.raises(ConfigError, match="int32"):
            rtt.attention_varlen(qp, kp, kp, cu.to(torch.int64), cu, 128, 200)
        with pytest.raises(ConfigError, match="same length"):
            rtt.attention_varlen(qp, kp, kp, cu, torch.empty(3, dtype=torch.int32, device="cuda"), 128, 200)


def test_varlen_backward_graph_calls_rtk_ops():
    """Gradients through packed, windowed, capped attention trace to the varlen ops (meta tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q, k, v, cu):
        o, _ = rtt.attention_varlen(q, k, v, cu, cu, 64, 64, causal=True, window=(15, 0), softcap=20.0)
        return torch.autograd.grad(o.float().sum(), (q, k, v))

    args = (_meta((100, 4, 64)), _meta((100, 2, 64)), _meta((100, 2, 64)),
            torch.zeros(3, dtype=torch.int32, device="meta"))
    g = make_fx(f)(*args)
    names = [str(n.target) for n in g.graph.nodes if n.op == "call_function" and "rtk" in str(n.target)]
    assert names == ["rtk.attention_varlen.default", "rtk.attention_varlen_backward.default"], names
    assert [tuple(t.shape) for t in f(*args)] == [tuple(a.shape) for a in args[:3]]


def test_attention_kvcache_op_declares_its_mutation():
    """torch.ops.rtk.attention_kvcache writes k_new / v_new into the caches: the schema says so
    (functionalization, version counters); fakes give (o, lse) and check the layouts."""
    from rtkernels.errors import ConfigError
    opov = torch.ops.rtk.attention_kvcache.default
    mutated = [a.name for a in opov._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["k_cache", "v_cache"] and torch.Tag.pt2_compliant_tag in opov.tags
    with FakeTensorMode():
        q, kc, sl = _fake((3, 4, 8, 64)), _fake((5, 128, 2, 64)), torch.empty(3, dtype=torch.int32, device="cuda")
        o, lse = rtt.attention_kvcache(q, kc, kc, sl, k_new=_fake((3, 4, 2, 64)), v_new=_fake((3, 4, 2, 64)))
        assert o.shape == q.shape and lse.shape == (3, 8, 4) and lse.dtype == torch.float32
        with pytest.raises(ConfigError, match="k_cache"):
            rtt.attention_kvcache(q, _fake((5, 128, 3, 64)), _fake((5, 128, 3, 64)), sl)
        with pytest.raises(ConfigError, match="together"):
            rtt.attention_kvcache(q, kc, kc, sl, k_new=_fake((3, 4, 2, 64)))


def test_quantized_matmul_fakes_and_backward_graph():
    """quantized_matmul's fake shapes and errors, and its x / bias gradients traced on meta tensors:
    the recomputed pre-activation, the dequantized weight, one rtk.matmul; scales get none."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from rtkernels.errors import ConfigError
    w_q = torch.empty(96, 256, dtype=torch.int8, device="meta")
    s = torch.empty(96, 2, dtype=torch.float32, device="meta")
    with FakeTensorMode():
        x = _fake((3, 5, 256))
        assert rtt.quantized_matmul(x, _fake((96, 256), torch.int8), _fake((96, 2), torch.float32),
                                    group_size=128).shape == (3, 5, 96)
        assert rtt.dequantize_weight(_fake((96, 256), torch.uint8), _fake((96,), torch.float32),
                                     dtype=torch.float16).dtype == torch.float16
        with pytest.raises(ConfigError, match="K = 256"):
            rtt.quantized_matmul(_fake((5, 200)), _fake((96, 256), torch.int8), _fake((96,), torch.float32))
        with pytest.raises(ConfigError, match="w_q"):
            rtt.quantized_matmul(_fake((5, 256)), _fake((96, 256)), _fake((96,), torch.float32))

    def f(x, b):
        y = rtt.quantized_matmul(x, w_q, s, group_size=128, bias=b, activation="gelu")
        return torch.autograd.grad(y.float().sum(), (x, b))

    args = (_meta((4, 256)), _meta((96,)))
    g = make_fx(f)(*args)
    names = [str(n.target) for n in g.graph.nodes if n.op == "call_function" and "rtk" in str(n.target)]
    assert names == ["rtk.quantized_matmul.default", "rtk.quantized_matmul.default", "rtk.dequantize_weight.default",
                     "rtk.matmul.default"], names
    assert [tuple(t.shape) for t in f(*args)] == [(4, 256), (96,)]
    with pytest.raises(NotImplementedError, match="frozen"):
        y = rtt.quantized_matmul(_meta((4, 256)), w_q, s.clone().requires_grad_(), group_size=128)
        y.float().sum().backward()


@pytest.mark.parametrize("a_shape,b_shape,ta,tb,out", [
    ((5, 7), (7, 9), False, False, (5, 9)),
    ((3, 5, 7), (7, 9), False, False, (3, 5, 9)),
    ((7, 5), (3, 9, 7), True, True, (3, 5, 9)),
    ((1, 5, 7), (4, 7, 9), False, False, (4, 5, 9)),
])
def test_fake_matmul_shapes(a_shape, b_shape, ta, tb, out):
    with FakeTensorMode():
        c = rtt.matmul(_fake(a_shape), _fake(b_shape), trans_a=ta, trans_b=tb, bias=_fake((out[-1],)),
                       activation="gelu")
        assert tuple(c.shape) == out and c.is_contiguous() and c.dtype == torch.bfloat16


def test_fake_row_ops_and_elementwise():
    with FakeTensorMode():
        x = _fake((3, 5, 64), torch.float16)
        w = _fake((64,), torch.float32)
        for y in (rtt.softmax(x), rtt.softmax(x, log_softmax=True), rtt.rmsnorm(x, w), rtt.layernorm(x, w, w)):
            assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
        assert rtt.reduce(x, "sum").shape == (3, 5) and rtt.reduce(x, "argmax").dtype == torch.int64
        assert rtt.elementwise("y = a*x + 1", 2.0, x).dtype == torch.float16
        assert rtt.elementwise("y = a + x", _fake((3, 5, 64), torch.float32), x).dtype == torch.float32
        s, c = rtt.elementwise("s = sin(x); c = cos(x)", x, outputs=("s", "c"))
        assert s.shape == c.shape == x.shape
        with pytest.raises(TypeError, match="takes 2 inputs"):
            rtt.elementwise("y = a*x", x)


def _meta(shape, dtype=torch.bfloat16):
    return torch.randn(shape, dtype=dtype, device="meta", requires_grad=True)


def test_backward_graph_calls_rtk_ops():
    """Gradients through attention and a gelu matmul trace to rtk ops only (meta tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q, k, v, w, b, x):
        o, _ = rtt.attention(q, k, v, causal=True)
        y = rtt.matmul(x, w, bias=b, activation="gelu")
        return torch.autograd.grad(o.float().sum() + y.float().sum(), (q, k, v, w, b, x))

    args = (_meta((2, 16, 4, 64)), _meta((2, 16, 2, 64)), _meta((2, 16, 2, 64)), _meta((64, 32)), _meta((32,)),
            _meta((3, 5, 64)))
    g = make_fx(f)(*args)
    names = [str(n.target) for n in g.graph.nodes if n.op == "call_function" and "rtk" in str(n.target)]
    # forward attention and matmul, the recomputed pre-activation, dX and dW, attention backward
    assert names.count("rtk.attention.default") == 1 and names.count("rtk.attention_backward.default") == 1
    assert names.count("rtk.matmul.default") == 4, names
    grads = f(*args)
    assert [tuple(t.shape) for t in grads] == [tuple(a.shape) for a in args]


@pytest.mark.parametrize("ta,tb,a_shape,b_shape", [(False, False, (5, 7), (7, 9)), (True, False, (7, 5), (7, 9)),
                                                   (False, True, (5, 7), (9, 7)), (True, True, (3, 7, 5), (9, 7)),
                                                   (False, False, (3, 5, 7), (7, 9)), (False, True, (1, 5, 7), (4, 9, 7))])
def test_matmul_gradient_shapes(ta, tb, a_shape, b_shape):
    a, b = _meta(a_shape), _meta(b_shape)
    c = rtt.matmul(a, b, trans_a=ta, trans_b=tb, activation="relu")
    c.float().sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


def test_row_op_and_cross_entropy_gradients_on_meta():
    """softmax / rmsnorm / layernorm / cross_entropy differentiate through their rtk backward ops
    (shapes and dtypes on meta tensors); elementwise and reduce(max) still refuse."""
    x, w, b = _meta((4, 3, 64), torch.float16), _meta((64,), torch.float32), _meta((64,), torch.float32)
    for log in (False, True):
        rtt.softmax(x, log).float().sum().backward()
    rtt.rmsnorm(x, w).float().sum().backward()
    rtt.layernorm(x, w, b).float().sum().backward()
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype
    assert w.grad.shape == w.shape and w.grad.dtype == torch.float32 and b.grad.shape == b.shape
    logits = _meta((3, 5, 1000))
    for reduction in ("none", "sum", "mean"):
        loss = rtt.cross_entropy(logits, torch.zeros(3, 5, dtype=torch.int64, device="meta"), reduction=reduction)
        assert loss.dtype == torch.float32 and loss.shape == ((3, 5) if reduction == "none" else ())
        loss.sum().backward()
    assert logits.grad.shape == logits.shape and logits.grad.dtype == torch.bfloat16
    with pytest.raises(NotImplementedError, match="no backward"):
        rtt.elementwise("y = 2*x", x).float().sum().backward()
    with pytest.raises(NotImplementedError, match="op='sum'"):
        rtt.reduce(x, "max").float().sum().backward()
    x2 = _meta((4, 64))
    rtt.reduce(x2, "sum").float().sum().backward()
    assert x2.grad.shape == x2.shape


def test_training_backward_graph_calls_rtk_ops():
    """The backward of the row ops is their rtk backward op; cross_entropy's gradient comes from
    the one fused forward kernel (cross_entropy_with_grad), not a second pass."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, b, logits, target):
        h = rtt.rmsnorm(x, w).float().sum() + rtt.layernorm(x, w, b).float().sum() + rtt.softmax(x).float().sum()
        return torch.autograd.grad(h + rtt.cross_entropy(logits, target, label_smoothing=0.1), (x, w, b, logits))

    args = (_meta((6, 128)), _meta((128,)), _meta((128,)), _meta((6, 777)),
            torch.zeros(6, dtype=torch.int64, device="meta"))
    names = [str(n.target) for n in make_fx(f)(*args).graph.nodes if n.op == "call_function" and "rtk" in str(n.target)]
    for name in ("rmsnorm", "layernorm", "softmax", "rmsnorm_backward", "layernorm_backward", "softmax_backward",
                 "cross_entropy_with_grad"):
        assert names.count(f"rtk.{name}.default") == 1, (name, names)
    assert "rtk.cross_entropy.default" not in names


def test_fake_training_ops_check_their_arguments():
    from rtkernels.errors import ConfigError
    with FakeTensorMode():
        x, w = _fake((2, 7, 96), torch.float16), _fake((96,), torch.float32)
        dx, dw = rtt.rmsnorm_backward(x, x, w)
        assert dx.shape == x.shape and dx.dtype == x.dtype and dw.shape == (96,) and dw.dtype == torch.float32
        dx, dw, db = rtt.layernorm_backward(x, x, w, w, eps=1e-5)
        assert dx.is_contiguous() and dw.dtype == db.dtype == torch.float32
        assert rtt.softmax_backward(x, x, log=True).shape == x.shape
        with pytest.raises(ConfigError, match="dy must be a torch.float16 tensor of shape"):
            rtt.rmsnorm_backward(_fake((2, 7, 96)), x, w)
        logits = _fake((2, 7, 50257))
        loss, g = torch.ops.rtk.cross_entropy_with_grad.default(logits, _fake((2, 7), torch.int32), -100, 0.0, "none")
        assert loss.shape == (2, 7) and loss.dtype == torch.float32 and g.shape == logits.shape
        assert g.dtype == torch.bfloat16 and g.is_contiguous()
        assert rtt.cross_entropy(logits, _fake((2, 7), torch.int64)).shape == ()
        with pytest.raises(ConfigError, match="target must be int64 or int32 of shape"):
            rtt.cross_entropy(logits, _fake((14,), torch.int64))
        with pytest.raises(ConfigError, match="reduction='avg'"):
            rtt.cross_entropy(logits, _fake((2, 7), torch.int64), reduction="avg")


# The autograd wiring of the training ops on the CPU: CPU kernels for the rtk ops from the float64
# references (rtkernels' own, the ones the GPU kernels are tested against), registered for this
# module only; gradients through torch.ops.rtk.* must then equal torch's autograd of the same
# functions written in torch.
@pytest.fixture(scope="module")
def rtk_cpu_kernels():
    import numpy as np

    from rtkernels.ops import cross_entropy as ce
    from rtkernels.ops import rowwise as rw
    from rtkernels.ops import rowwise_bwd as rb
    from rtkernels.torch._library import _filled

    def n64(t):
        return None if t is None else t.detach().double().numpy()

    def back(a, like):
        return torch.from_numpy(np.ascontiguousarray(a)).to(like.dtype)

    def ce_impl(grad):
        def impl(logits, target, ignore_index, label_smoothing, reduction):
            loss, g = ce.cross_entropy_reference(n64(logits), target.numpy(), ignore_index=ignore_index,
                                                 label_smoothing=label_smoothing, reduction=reduction)
            loss = torch.tensor(np.asarray(loss), dtype=torch.float32)
            return (loss, back(g, logits)) if grad else loss
        return impl

    kernels = {
        "softmax": lambda x, log: back(rw.softmax_reference(n64(x), log_softmax=log), x),
        "rmsnorm": lambda x, w, eps: back(rw.rmsnorm_reference(n64(x), n64(w), eps), x),
        "layernorm": lambda x, w, b, eps: back(rw.layernorm_reference(n64(x), n64(w), n64(b), eps), x),
        "softmax_backward": lambda dy, y, log: back(rb.softmax_backward_reference(n64(dy), n64(y), log=log), y),
        "rmsnorm_backward": lambda dy, x, w, rstd, eps: tuple(
            back(a, t) for a, t in zip(rb.rmsnorm_backward_reference(n64(dy), n64(x), n64(w), eps), (x, w))),
        "layernorm_backward": lambda dy, x, w, b, mean, rstd, eps: tuple(
            back(a, t) for a, t in zip(rb.layernorm_backward_reference(n64(dy), n64(x), n64(w), eps), (x, w, w))),
        "cross_entropy": ce_impl(False),
        "cross_entropy_with_grad": ce_impl(True),
    }
    lib = torch.library.Library("rtk", "IMPL")   # noqa: TOR901 - CPU kernels for this module's tests
    for name, fn in kernels.items():
        lib.impl(name, _filled(fn, getattr(torch.ops.rtk, name).default), "CPU")
    yield
    lib._destroy()


def _leaf(t):
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_op_gradients_wired_cpu(rtk_cpu_kernels, dtype):
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 33, dtype=dtype) * 2, torch.randn(33, dtype=dtype), torch.randn(33, dtype=dtype)
    dy = torch.randn(3, 5, 33, dtype=dtype)
    F = torch.nn.functional
    cases = [
        ("softmax", lambda x_, w_, b_: rtt.softmax(x_), lambda x_, w_, b_: torch.softmax(x_, -1)),
        ("log_softmax", lambda x_, w_, b_: rtt.softmax(x_, log_softmax=True),
         lambda x_, w_, b_: torch.log_softmax(x_, -1)),
        ("rmsnorm", lambda x_, w_, b_: rtt.rmsnorm(x_, w_, 1e-5),
         lambda x_, w_, b_: x_ * torch.rsqrt(x_.pow(2).mean(-1, keepdim=True) + 1e-5) * w_),
        ("layernorm", lambda x_, w_, b_: rtt.layernorm(x_, w_, b_, 1e-4),
         lambda x_, w_, b_: F.layer_norm(x_, (33,), w_, b_, 1e-4)),
    ]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    for name, ours, ref in cases:
        got_in, ref_in = [_leaf(t) for t in (x, w, b)], [_leaf(t) for t in (x, w, b)]
        ours(*got_in).backward(dy.transpose(0, 1).contiguous().transpose(0, 1))   # a non-contiguous dy
        ref(*ref_in).backward(dy)
        for arg, g, r in zip("xwb", got_in, ref_in):
            if r.grad is None:
                assert g.grad is None, (name, arg)
                continue
            torch.testing.assert_close(g.grad, r.grad, **tol, msg=lambda m: f"{name} d{arg}: {m}")


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_gradients_wired_cpu(rtk_cpu_kernels, reduction, smoothing):
    torch.manual_seed(1)
    logits = torch.randn(4, 6, 37, dtype=torch.float64) * 3
    target = torch.randint(0, 37, (4, 6))
    target[::3, 1] = -1
    F = torch.nn.functional
    ref_in = _leaf(logits)
    ref = F.cross_entropy(ref_in.transpose(1, 2).transpose(0, 1).reshape(37, -1).t(), target.reshape(-1),
                          ignore_index=-1, label_smoothing=smoothing, reduction=reduction)
    ref = ref.reshape(4, 6) if reduction == "none" else ref
    dloss = torch.rand(ref.shape, dtype=torch.float64) + 0.5   # a non-unit incoming gradient
    ref.backward(dloss)
    for fused in (True, False):
        got_in = _leaf(logits)
        if fused:   # what rtt.cross_entropy calls when the logits require grad
            loss = rtt.cross_entropy(got_in, target, ignore_index=-1, label_smoothing=smoothing, reduction=reduction)
        else:       # the loss-only op: its backward runs the fused kernel again
            loss = torch.ops.rtk.cross_entropy.default(got_in, target, -1, smoothing, reduction)
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
        loss.backward(dloss.float())
        torch.testing.assert_close(got_in.grad, ref_in.grad, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"fused={fused}: {m}")
    with torch.no_grad():   # no gradient to record: the loss-only op
        assert rtt.cross_entropy(_leaf(logits), target, ignore_index=-1).grad_fn is None


def test_training_ops_pass_opcheck_cpu(rtk_cpu_kernels):
    """The schemas, fakes and autograd registrations, checked by opcheck against the CPU kernels."""
    torch.manual_seed(2)
    x = torch.randn(3, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    y = torch.softmax(x.detach(), -1)
    logits, target = torch.randn(5, 50, requires_grad=True), torch.tensor([1, -100, 49, 0, 7])
    cases = [
        (torch.ops.rtk.softmax.default, (x, True)),
        (torch.ops.rtk.rmsnorm.default, (x, w, 1e-6)),
        (torch.ops.rtk.layernorm.default, (x, w, w, 1e-5)),
        (torch.ops.rtk.softmax_backward.default, (torch.randn(3, 40), y, False)),
        (torch.ops.rtk.rmsnorm_backward.default, (torch.randn(3, 40), x.detach(), w.detach(), None, 1e-6)),
        (torch.ops.rtk.layernorm_backward.default, (torch.randn(3, 40), x.detach(), w.detach(), w.detach(), None,
                                                    None, 1e-5)),
        (torch.ops.rtk.cross_entropy.default, (logits, target, -100, 0.1, "mean")),
        (torch.ops.rtk.cross_entropy_with_grad.default, (logits, target, -100, 0.0, "none")),
    ]
    _opcheck_all(torch, cases)


def test_sdpa_helper_refuses_what_it_cannot_do():
    q = torch.empty(1, 2, 8, 64, device="meta", dtype=torch.float16)
    k = torch.empty(1, 2, 4, 64, device="meta", dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        rtt.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool, device="meta"))
    with pytest.raises(NotImplementedError, match="dropout"):
        rtt.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="top-left"):
        rtt.scaled_dot_product_attention(q, k, k, is_causal=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        rtt.scaled_dot_product_attention(q, torch.empty(1, 1, 8, 64, device="meta", dtype=torch.float16),
                                         torch.empty(1, 1, 8, 64, device="meta", dtype=torch.float16))
    assert rtt.scaled_dot_product_attention(q, k, k).shape == q.shape


def test_training_step_compiles_fullgraph_cpu(rtk_cpu_kernels):
    """rmsnorm + cross_entropy with gradients under torch.compile(fullgraph=True) (AOTAutograd
    traces the rtk backward ops): no graph breaks, the same gradients as eager."""
    def step(x, w, target):
        return rtt.cross_entropy(rtt.rmsnorm(x, w), target, label_smoothing=0.1)

    torch.manual_seed(3)
    x, w = torch.randn(6, 40, requires_grad=True), torch.randn(40, requires_grad=True)
    target = torch.tensor([0, 3, -100, 39, 7, 7])
    explain = torch._dynamo.explain(step)(x, w, target)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch.compile(step, fullgraph=True, backend="aot_eager")(x, w, target).backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    step(x, w, target).backward()
    for g, r in zip(got, (x.grad, w.grad)):
        torch.testing.assert_close(g, r)


# ---- the registration helper on a CPU test op --------------------------------------------------
_TEST_LIB = torch.library.Library("rtk_cpu_test", "DEF")


def _scale_impl(x, s, bias):
    y = x * s
    return y if bias is None else y + bias


def _scale_save(ctx, args, out):
    ctx.s, ctx.has_bias = args[1], args[2] is not None


SCALE = op("scale(Tensor x, float s=2.0, Tensor? bias=None) -> Tensor", _scale_impl,
           fake=lambda x, s, bias: torch.empty_like(x),
           backward=lambda ctx, g: (g * ctx.s, None, g if ctx.has_bias else None),
           setup_context=_scale_save, lib=_TEST_LIB, device="CPU")
NOBACK = op("noback(Tensor[] xs, float a) -> Tensor[]", lambda xs, a: [t * a for t in xs],
            fake=lambda xs, a: [torch.empty_like(t) for t in xs], lib=_TEST_LIB, device="CPU")


def test_helper_eager_paths():
    x = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    y = SCALE(x)   # trailing defaults dropped by the dispatcher come back
    assert torch.equal(y, x * 2) and y.grad_fn is not None
    SCALE(x, 3.0, b).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 3.0)) and torch.equal(b.grad, torch.ones(4))
    with torch.no_grad():
        assert not SCALE(x).requires_grad
    with torch.inference_mode():
        assert torch.equal(SCALE(x, 0.5), x.detach() * 0.5)
    ys = NOBACK([x, b], 2.0)
    assert isinstance(ys, list) and len(ys) == 2
    with pytest.raises(NotImplementedError, match="rtk.noback has no backward"):
        ys[1].sum().backward()


def test_helper_sees_a_gradient_through_any_tensor_argument():
    """The generated autograd kernel tests each tensor argument (plain, optional, in a list) for
    requires_grad: a gradient wanted through only an optional or a listed tensor is recorded."""
    x, b = torch.randn(4), torch.randn(4, requires_grad=True)
    y = SCALE(x, 3.0, b)   # only the optional bias requires grad
    assert y.grad_fn is not None
    y.sum().backward()
    assert torch.equal(b.grad, torch.ones(4))
    assert SCALE(x, 3.0, None).grad_fn is None and SCALE(x).grad_fn is None
    ys = NOBACK([x, b], 2.0)   # a list with one tensor that requires grad
    assert ys[0].grad_fn is not None
    assert NOBACK([x, x], 2.0)[0].grad_fn is None


def test_helper_passes_opcheck():
    for opov, args in ((SCALE, (torch.randn(3, requires_grad=True), 1.5, torch.randn(3, requires_grad=True))),
                       (NOBACK, ([torch.randn(3), torch.randn(2)], 2.0))):
        res = torch.library.opcheck(opov, args)
        assert all(v == "SUCCESS" for v in res.values()), res


def test_helper_compiles_fullgraph_without_breaks():
    def f(x, b):
        return torch.sin(SCALE(torch.cos(x), 1.5, b)).sum()

    x, b = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    explain = torch._dynamo.explain(f)(x, b)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled(x, b).backward()
    gx, gb = x.grad.clone(), b.grad.clone()
    x.grad = b.grad = None
    f(x, b).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gb, b.grad)


def test_helper_direct_call_is_decided_per_keyset():
    """The autograd kernel memoizes, per dispatch keyset, whether it may call the kernel itself:
    an eager call first must not send later FakeTensor / no-grad calls around their keys."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.randn(4)
    assert torch.equal(SCALE(x, 3.0), x * 3)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        y = SCALE(fx, 3.0)
        assert type(y).__name__ == "FakeTensor" and y.shape == (4,)
    assert torch.equal(SCALE(x, 0.5), x * 0.5)


def test_floor_op_is_a_bare_registered_op():
    from rtkernels.torch._library import floor_op
    t = torch.ones(2)
    opov, fn = floor_op("flr(Tensor x, bool f=False) -> Tensor", t, device="CPU")
    assert opov(torch.zeros(3)) is t and fn(None) is t
    assert floor_op("flr(Tensor x, bool f=False) -> Tensor", t, device="CPU")[0] is opov   # defined once


def test_helper_refuses_kwarg_only_and_mutating_schemas():
    with pytest.raises(ValueError, match="keyword-only"):
        op("kwonly(Tensor x, *, float s) -> Tensor", _scale_impl, fake=_scale_impl, lib=_TEST_LIB, device="CPU")
    with pytest.raises(ValueError, match="custom_op"):
        op("mut(Tensor(a!) x) -> ()", _scale_impl, fake=_scale_impl, lib=_TEST_LIB, device="CPU")


# ---- GPU -----------------------------------------------------------------------------------------
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch.device("cuda")


def _rand(shape, dtype=torch.bfloat16, scale=1.0, requires_grad=False):
    t = (torch.randn(shape, device="cuda", dtype=torch.float32) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def _err(a, ref):
    return (a.double() - ref.double()).abs().max().item()


def _two_x(name, got, low, ref, atol):
    """FlashAttention's rule: rtk's error against the float64 reference is at most twice the
    error of the same computation in the low-precision dtype by torch (plus an absolute floor)."""
    e, e_low = _err(got, ref), _err(low, ref)
    assert e <= 2 * e_low + atol, f"{name}: rtk error {e:.3e} > 2 x torch's {e_low:.3e} + {atol:g} (shape {tuple(ref.shape)})"


def _sdpa_ref(q, k, v, causal, scale, dtype=None):
    """softmax(scale q k^T [bottom-right causal]) v in (B, S, H, D), GQA by repetition."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    rep = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    if dtype is not None:
        qh, kh, vh = qh.to(dtype), kh.to(dtype), vh.to(dtype)
    mask = None
    if causal:
        sq, sk = qh.shape[2], kh.shape[2]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j <= i + sk - sq
    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("b,sq,sk,h,hkv,d,causal", [(2, 113, 203, 4, 2, 64, True), (1, 128, 128, 6, 6, 128, False),
                                                    (2, 1, 77, 8, 1, 80, True)])
def test_gpu_attention_forward_backward(b, sq, sk, h, hkv, d, causal):
    _cuda()
    torch.manual_seed(sq + sk)
    q, k, v = _rand((b, sq, h, d), requires_grad=True), _rand((b, sk, hkv, d), requires_grad=True), \
        _rand((b, sk, hkv, d), requires_grad=True)
    scale = 1 / math.sqrt(d)
    o, lse = rtt.attention(q, k, v, causal=causal)
    do = _rand(o.shape)
    o.backward(do)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _sdpa_ref(*ref_in, causal, scale)
    ref.backward(do.double())
    low_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low = _sdpa_ref(*low_in, causal, scale)
    low.backward(do)
    _two_x("o", o, low, ref, 1e-3)
    for name, t, r, lw in zip("qkv", (q, k, v), ref_in, low_in):
        _two_x(f"d{name}", t.grad, lw.grad, r.grad, 2e-3)
    assert lse.dtype == torch.float32 and not lse.requires_grad


def _masked_ref(q, k, v, causal, scale, window=None, softcap=None, dtype=None):
    """softmax(cap(scale q k^T) [bottom-right causal / window]) v in (B, S, H, D), GQA by repetition,
    computed in ``dtype`` (default: the inputs'); a row that sees no key gives 0 (and no NaN in the
    gradients)."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if dtype is not None:
        qh, kh, vh = qh.to(dtype), kh.to(dtype), vh.to(dtype)
    rep = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = qh.shape[2], kh.shape[2]
    i = torch.arange(sq, device=q.device)[:, None] + sk - sq
    j = torch.arange(sk, device=q.device)[None, :]
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right
    ok = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    seen = ok.any(-1, keepdim=True)
    s = s.masked_fill(~ok, float("-inf")).masked_fill(~seen, 0.0)
    o = (torch.softmax(s, -1) * seen) @ vh
    return o.transpose(1, 2)


def _three_ways(inputs, do, fn_rtk, fn_ref):
    """(rtk outputs and grads, float64 reference, the same reference in the inputs' dtype)."""
    got = fn_rtk(*inputs)
    got.backward(do)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = fn_ref(*ref_in)
    ref.backward(do.double())
    low_in = [t.detach().clone().requires_grad_() for t in inputs]
    low = fn_ref(*low_in)
    low.backward(do)
    return got, ref, low, ref_in, low_in


@pytest.mark.gpu
@pytest.mark.parametrize("b,sq,sk,h,hkv,d,causal,window,softcap", [
    (2, 97, 150, 4, 2, 64, True, (31, 0), None), (1, 128, 128, 4, 4, 128, False, (20, 40), 30.0),
    (2, 64, 64, 8, 2, 96, True, None, 25.0), (1, 40, 200, 2, 1, 64, False, (-1, 5), None)])
def test_gpu_masked_attention_forward_backward(b, sq, sk, h, hkv, d, causal, window, softcap):
    _cuda()
    torch.manual_seed(sq + sk + d)
    q, k, v = _rand((b, sq, h, d), requires_grad=True), _rand((b, sk, hkv, d), requires_grad=True), \
        _rand((b, sk, hkv, d), requires_grad=True)
    scale = 1 / math.sqrt(d)
    do = _rand((b, sq, h, d))
    got, ref, low, ref_in, low_in = _three_ways(
        (q, k, v), do, lambda *t: rtt.attention(*t, causal=causal, window=window, softcap=softcap)[0],
        lambda *t: _masked_ref(*t, causal, scale, window, softcap))
    _two_x("o", got, low, ref, 1e-3)
    for name, t, r, lw in zip("qkv", (q, k, v), ref_in, low_in):
        _two_x(f"d{name}", t.grad, lw.grad, r.grad, 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("lens_q,lens_k,h,hkv,d,causal,window,softcap", [
    ((37, 0, 130, 1, 64), None, 4, 2, 64, True, (15, 0), 20.0),
    ((50, 9, 77), (60, 40, 3), 2, 2, 128, False, None, None),
    ((100, 33), None, 8, 1, 80, True, None, None)])
def test_gpu_varlen_attention_forward_backward(lens_q, lens_k, h, hkv, d, causal, window, softcap):
    """torch.ops.rtk.attention_varlen against per-sequence dense references (2x rule), gradients
    through the packed op, empty and one-token sequences."""
    _cuda()
    lens_k = lens_k or lens_q
    torch.manual_seed(sum(lens_q) + d)
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = _rand((tq, h, d), requires_grad=True), _rand((tk, hkv, d), requires_grad=True), \
        _rand((tk, hkv, d), requires_grad=True)
    cu = [torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
          for ls in (lens_q, lens_k)]
    scale = 1 / math.sqrt(d)
    do = _rand((tq, h, d))
    bq, bk = cu[0].tolist(), cu[1].tolist()

    def ref_fn(q_, k_, v_):
        parts = [_masked_ref(q_[None, bq[i]:bq[i + 1]], k_[None, bk[i]:bk[i + 1]], v_[None, bk[i]:bk[i + 1]], causal,
                             scale, window, softcap)[0] for i in range(len(lens_q))]
        return torch.cat(parts)

    def rtk_fn(q_, k_, v_):
        o, lse = rtt.attention_varlen(q_, k_, v_, cu[0], cu[1], max(lens_q), max(lens_k), causal, window=window,
                                      softcap=softcap)
        assert lse.shape == (h, tq) and lse.dtype == torch.float32
        return o

    got, ref, low, ref_in, low_in = _three_ways((q, k, v), do, rtk_fn, ref_fn)
    _two_x("o", got, low, ref, 1e-3)
    for name, t, r, lw in zip("qkv", (q, k, v), ref_in, low_in):
        _two_x(f"d{name}", t.grad, lw.grad, r.grad, 2e-3)


@pytest.mark.gpu
def test_gpu_varlen_and_window_compile_fullgraph():
    """A packed, windowed forward + backward under torch.compile(fullgraph=True): no graph break,
    the compiled gradients equal eager's."""
    _cuda()
    torch.manual_seed(5)
    cu = torch.tensor([0, 40, 41, 160], dtype=torch.int32, device="cuda")

    def f(q, k, v):
        o, _ = rtt.attention_varlen(q, k, v, cu, cu, 119, 119, True, window=(31, 0))
        o2, _ = rtt.attention(q[None], k[None], v[None], True, softcap=30.0)
        return o.float().square().sum() + o2.float().sum()

    def run(fn):
        ts = [t.detach().clone().requires_grad_() for t in base]
        fn(*ts).backward()
        return [t.grad for t in ts]

    base = [_rand((160, 4, 64)), _rand((160, 2, 64)), _rand((160, 2, 64))]
    explain = torch._dynamo.explain(f)(*[t.detach().clone().requires_grad_() for t in base])
    assert explain.graph_break_count == 0, explain.break_reasons
    for got, want in zip(run(torch.compile(f, fullgraph=True)), run(f)):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,group,act,lead", [("int8", 128, "gelu", (3, 5)), ("uint8", 64, None, (7,)),
                                                 ("float8_e4m3", None, "relu", (40,))])
def test_gpu_quantized_matmul_gradients(kind, group, act, lead):
    """torch.ops.rtk.quantized_matmul's output and x / bias gradients against torch on the
    dequantized weight (float64 reference, the 2x rule against bfloat16 torch); opcheck of it and
    of dequantize_weight."""
    _cuda()
    import numpy as np
    import rtkernels as rtk
    torch.manual_seed(len(lead) + (group or 0))
    n, k = 96, 320
    res = rtk.quantize_weight(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), dtype=kind,
                              group_size=group)
    w_q = torch.as_tensor(res[0], device="cuda")
    if kind == "float8_e4m3":
        w_q = w_q.view(torch.float8_e4m3fn)
    s = torch.as_tensor(res[1], device="cuda")
    z = torch.as_tensor(res[2], device="cuda") if len(res) == 3 else None
    w64 = torch.as_tensor(rtk.ops.quant_matmul.dequantize_reference(res[0], res[1], group_size=group,
                                                                    zeros=res[2] if z is not None else None,
                                                                    weight_dtype=kind), device="cuda")
    x, b = _rand((*lead, k), requires_grad=True), _rand((n,), requires_grad=True)
    actf = {None: lambda t: t, "relu": torch.relu, "gelu": torch.nn.functional.gelu}[act]
    do = _rand((*lead, n))
    got, ref, low, ref_in, low_in = _three_ways(
        (x, b), do, lambda x_, b_: rtt.quantized_matmul(x_, w_q, s, group_size=group, zeros=z, bias=b_, activation=act),
        lambda x_, b_: actf(x_ @ w64.to(x_.dtype).t() + b_))
    _two_x("y", got, low, ref, 1e-3)
    _two_x("dx", x.grad, low_in[0].grad, ref_in[0].grad, 2e-3)
    _two_x("dbias", b.grad, low_in[1].grad, ref_in[1].grad, 2e-2)
    torch.testing.assert_close(rtt.dequantize_weight(w_q, s, group_size=group, zeros=z).double(), w64,
                               atol=0, rtol=2 ** -8)
    if kind != "float8_e4m3":   # (opcheck's schema test multiplies the inputs: torch has no float8 mul)
        _opcheck_all(torch, [(torch.ops.rtk.quantized_matmul.default, (x, w_q, s, group, z, b, act)),
                             (torch.ops.rtk.dequantize_weight.default, (w_q, s, torch.float16, group, z))])


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_attention_kvcache_op(paged):
    """A decode step through torch.ops.rtk.attention_kvcache: the same o, lse and written caches
    as rtk.attention_kvcache on copies of the caches, eagerly and under torch.compile(fullgraph=True)
    (no graph break; the in-place cache write kept); opcheck."""
    _cuda()
    import rtkernels as rtk
    torch.manual_seed(7)
    b, h, hkv, d, page = 3, 8, 2, 128, 64
    lens = torch.tensor([0, 70, 129], dtype=torch.int32, device="cuda")
    if paged:
        kc, vc = _rand((12, page, hkv, d)), _rand((12, page, hkv, d))
        table = torch.randperm(12, device="cuda").to(torch.int32).reshape(b, 4)
    else:
        kc, vc = _rand((b, 256, hkv, d)), _rand((b, 256, hkv, d))
        table = None
    q, kn, vn = _rand((b, 2, h, d)), _rand((b, 2, hkv, d)), _rand((b, 2, hkv, d))

    def step(q_, kc_, vc_):
        return rtt.attention_kvcache(q_, kc_, vc_, lens, k_new=kn, v_new=vn, block_table=table)

    k_ref, v_ref = kc.clone(), vc.clone()
    o_ref, lse_ref = rtk.attention_kvcache(q, k_ref, v_ref, lens, k_new=kn, v_new=vn, block_table=table,
                                           return_lse=True)
    for name, fn in (("eager", step), ("compiled", torch.compile(step, fullgraph=True))):
        k2, v2 = kc.clone(), vc.clone()
        o, lse = fn(q, k2, v2)
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref), name
        assert torch.equal(k2, k_ref) and torch.equal(v2, v_ref), f"{name}: the cache write"
    explain = torch._dynamo.explain(step)(q, kc.clone(), vc.clone())
    assert explain.graph_break_count == 0, explain.break_reasons
    _opcheck_all(torch, [(torch.ops.rtk.attention_kvcache.default,
                          (q, kc.clone(), vc.clone(), lens, kn, vn, table, True, None, None))])


@pytest.mark.gpu
def test_gpu_opcheck_every_op():
    _cuda()
    torch.manual_seed(0)
    q, k = _rand((1, 40, 4, 64), requires_grad=True), _rand((1, 56, 2, 64), requires_grad=True)
    v = _rand((1, 56, 2, 64), requires_grad=True)
    o, lse = rtt.attention(q, k, v, causal=True)
    om, lm = rtt.attention(q, k, v, causal=True, window=(7, 0), softcap=20.0)
    qp, kp, vp = (t.detach()[0].clone().requires_grad_() for t in (q, k, v))
    cq = torch.tensor([0, 15, 40], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 30, 56], dtype=torch.int32, device="cuda")
    op_, lp = rtt.attention_varlen(qp, kp, vp, cq, ck, 25, 30, False, window=(9, 9))
    a, bm = _rand((3, 40, 64), requires_grad=True), _rand((64, 48), requires_grad=True)
    bias = _rand((48,), requires_grad=True)
    x = _rand((6, 96), torch.float16)
    w = _rand((96,), torch.float32)
    cases = [
        (torch.ops.rtk.attention.default, (q, k, v, True, None)),
        (torch.ops.rtk.attention_backward.default, (_rand(o.shape), q.detach(), k.detach(), v.detach(), o.detach(),
                                                     lse, True, None, False)),
        # windows, softcap, packed sequences
        (torch.ops.rtk.attention.default, (q, k, v, True, None, [7, 0], 20.0)),
        (torch.ops.rtk.attention_backward.default, (_rand(om.shape), q.detach(), k.detach(), v.detach(), om.detach(),
                                                     lm, True, None, False, [7, 0], 20.0)),
        (torch.ops.rtk.attention_varlen.default, (qp, kp, vp, cq, ck, 25, 30, False, None, [9, 9], None)),
        (torch.ops.rtk.attention_varlen_backward.default, (_rand(op_.shape), qp.detach(), kp.detach(), vp.detach(),
                                                            op_.detach(), lp, cq, ck, 25, 30, False, None, False,
                                                            [9, 9], None)),
        (torch.ops.rtk.matmul.default, (a, bm, bias, "gelu", False, False)),
        (torch.ops.rtk.matmul.default, (a, bm.detach().t().contiguous().requires_grad_(), None, "relu", False, True)),
        (torch.ops.rtk.softmax.default, (x, False)),
        (torch.ops.rtk.rmsnorm.default, (x, w, 1e-6)),
        (torch.ops.rtk.layernorm.default, (x, w, w, 1e-5)),
        (torch.ops.rtk.reduce.default, (x, "sum")),
        (torch.ops.rtk.reduce.default, (x, "argmax")),
        (torch.ops.rtk.elementwise.default, ("y = a*x + 1", [x], [2.0], [0], None, None)),
    ]
    _opcheck_all(torch, cases)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("ta,tb,a_shape,b_shape", [(False, False, (3, 77, 96), (96, 40)),
                                                   (True, True, (96, 77), (2, 40, 96)),
                                                   (False, True, (77, 96), (40, 96))])
def test_gpu_matmul_gradients(activation, ta, tb, a_shape, b_shape):
    _cuda()
    torch.manual_seed(len(a_shape) * 10 + len(b_shape))
    a, b = _rand(a_shape, requires_grad=True), _rand(b_shape, scale=0.1, requires_grad=True)
    n = b_shape[-2] if tb else b_shape[-1]
    bias = _rand((n,), requires_grad=True)
    act = {None: lambda z: z, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
           "silu": torch.nn.functional.silu}[activation]

    def torch_mm(a_, b_, bias_):
        a2 = a_.transpose(-1, -2) if ta else a_
        b2 = b_.transpose(-1, -2) if tb else b_
        return act(a2 @ b2 + bias_)

    c = rtt.matmul(a, b, bias=bias, activation=activation, trans_a=ta, trans_b=tb)
    dc = _rand(c.shape)
    c.backward(dc)
    ref_in = [t.detach().double().requires_grad_() for t in (a, b, bias)]
    ref = torch_mm(*ref_in)
    ref.backward(dc.double())
    low_in = [t.detach().clone().requires_grad_() for t in (a, b, bias)]
    low = torch_mm(*low_in)
    low.backward(dc)
    _two_x("c", c, low, ref, 1e-2)
    for name, t, r, lw in zip(("da", "db", "dbias"), (a, b, bias), ref_in, low_in):
        _two_x(f"{name} ({activation}, trans {ta}/{tb})", t.grad, lw.grad, r.grad, 5e-2)


@pytest.mark.gpu
def test_gpu_row_ops_and_elementwise_values():
    _cuda()
    torch.manual_seed(1)
    x = _rand((5, 33, 200), torch.float16)
    w, b = _rand((200,), torch.float32), _rand((200,), torch.float32)
    xf = x.float()
    torch.testing.assert_close(rtt.softmax(x).float(), torch.softmax(xf, -1), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(rtt.softmax(x, log_softmax=True).float(), torch.log_softmax(xf, -1), atol=5e-3,
                               rtol=2e-3)
    rms = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rtt.rmsnorm(x, w).float(), rms, atol=1e-2, rtol=1e-2)
    ln = torch.nn.functional.layer_norm(xf, (200,), w, b, 1e-5)
    torch.testing.assert_close(rtt.layernorm(x, w, b).float(), ln, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(rtt.reduce(x, "sum").float(), xf.sum(-1), atol=0.1, rtol=1e-2)
    assert torch.equal(rtt.reduce(x, "argmax"), xf.argmax(-1))
    y = rtt.elementwise("t = a*x + b; y = gelu(t)", 0.5, x, 1.0)
    torch.testing.assert_close(y.float(), torch.nn.functional.gelu(0.5 * xf + 1), atol=2e-3, rtol=2e-3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):   # a side stream: the op follows torch's current stream
        y2 = rtt.elementwise("y = 2*x", x)
        y3 = rtt.softmax(x)
    s.synchronize()
    torch.testing.assert_close(y3.float(), torch.softmax(xf, -1), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(y2, 2 * x)


def _mixed(q, k, v, x, w, ln_w):
    """rtk ops and torch ops interleaved, as a model would."""
    h = rtt.rmsnorm(x, ln_w)
    h = rtt.matmul(h, w, activation="silu")
    h = rtt.elementwise("y = 0.5*a + b", h, h)
    o, _ = rtt.attention(q, k, v, causal=True)
    return torch.relu(h).sum(-1) + o.float().mean(dim=(2, 3)).sum(-1, keepdim=True), rtt.softmax(h)


def _mixed_inputs():
    q, k, v = _rand((2, 64, 4, 64)), _rand((2, 64, 2, 64)), _rand((2, 64, 2, 64))
    return q, k, v, _rand((2, 64, 128)), _rand((128, 96), scale=0.1), _rand((128,))


@pytest.mark.gpu
def test_gpu_compile_fullgraph_no_graph_breaks():
    _cuda()
    torch.manual_seed(2)
    args = _mixed_inputs()
    explain = torch._dynamo.explain(_mixed)(*args)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(_mixed, fullgraph=True)
    for got, want in zip(compiled(*args), _mixed(*args)):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_reduce_overhead_replays_equal_eager():
    _cuda()
    torch.manual_seed(3)
    compiled = torch.compile(_mixed, mode="reduce-overhead", fullgraph=True)
    for step in range(4):   # warmup, capture, then replays with fresh inputs
        args = _mixed_inputs()
        got = [t.clone() for t in compiled(*args)]
        want = _mixed(*args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2,
                                       msg=lambda m: f"step {step}: {m}")


@pytest.mark.gpu
def test_gpu_reduce_overhead_training_step():
    """Forward and backward (rtk.attention_backward with its workspaces) under CUDA graphs."""
    _cuda()
    torch.manual_seed(4)

    def loss_fn(q, k, v, w, x):
        o, _ = rtt.attention(q, k, v, causal=True)
        y = rtt.matmul(x, w, activation="gelu")
        return o.float().square().mean() + y.float().square().mean()

    compiled = torch.compile(loss_fn, mode="reduce-overhead", fullgraph=True)
    for i in range(4):   # warmup, capture, replays
        args = [_rand((2, 96, 4, 64), requires_grad=True), _rand((2, 96, 2, 64), requires_grad=True),
                _rand((2, 96, 2, 64), requires_grad=True), _rand((64, 80), scale=0.1, requires_grad=True),
                _rand((2, 96, 64))]
        compiled(*args).backward()
        got = [t.grad.clone() for t in args[:4]]
        for t in args[:4]:
            t.grad = None
        loss_fn(*args).backward()
        for name, g, t in zip(("dq", "dk", "dv", "dw"), got, args[:4]):
            torch.testing.assert_close(g.float(), t.grad.float(), atol=1e-2, rtol=1e-2,
                                       msg=lambda m: f"iter {i} {name}: {m}")


# ---- training ops: gradients through torch.ops.rtk against torch eager ------------------------------
# Shapes and dtypes as tests/test_training_ops.py's (n = 1000; vocabularies 1000 / 32000 / 50257): the
# same kernel configs, compiled once per process.
def _floor(ref, dtype, rel32=1e-5, rel_low=1e-2):
    return (rel32 if dtype == torch.float32 else rel_low) * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_row_op_gradients_match_torch(dtype):
    """dx (and dweight, dbias) of softmax / log_softmax / rmsnorm / layernorm through the rtk backward
    ops against float64 autograd, within twice the error of torch eager in the same dtype."""
    _cuda()
    torch.manual_seed(4)
    n = 1000
    x = _rand((3, 37, n), dtype, scale=2.0)
    w, b, dy = _rand((n,), dtype), _rand((n,), dtype), _rand(x.shape, dtype)
    F = torch.nn.functional
    cases = {
        "softmax": (lambda x_, w_, b_: rtt.softmax(x_), lambda x_, w_, b_: torch.softmax(x_, -1)),
        "log_softmax": (lambda x_, w_, b_: rtt.softmax(x_, log_softmax=True),
                        lambda x_, w_, b_: torch.log_softmax(x_, -1)),
        "rmsnorm": (lambda x_, w_, b_: rtt.rmsnorm(x_, w_, 1e-6),
                    lambda x_, w_, b_: x_ * torch.rsqrt(x_.pow(2).mean(-1, keepdim=True) + 1e-6) * w_),
        "layernorm": (lambda x_, w_, b_: rtt.layernorm(x_, w_, b_, 1e-5),
                      lambda x_, w_, b_: F.layer_norm(x_, (n,), w_, b_, 1e-5)),
    }
    for name, (ours, torch_fn) in cases.items():
        got_in = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        ref_in = [t.detach().double().requires_grad_() for t in (x, w, b)]
        low_in = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        y = ours(*got_in)
        y.backward(dy)
        torch_fn(*ref_in).backward(dy.double())
        torch_fn(*low_in).backward(dy)
        for arg, g, r, lw in zip("xwb", got_in, ref_in, low_in):
            if r.grad is None:
                assert g.grad is None, f"{name}: d{arg} should be None"
                continue
            assert g.grad.dtype == dtype and g.grad.shape == r.grad.shape, (name, arg, g.grad.dtype, g.grad.shape)
            # float32 floor 1e-4: log_softmax's dx carries the forward's y rounding times sum(dy)
            _two_x(f"{name} d{arg} ({dtype}, shape {tuple(r.grad.shape)})", g.grad, lw.grad, r.grad,
                   _floor(r.grad, dtype, rel32=1e-4))


@pytest.mark.gpu
@pytest.mark.parametrize("v, dtype", [(1000, torch.float32), (32000, torch.bfloat16), (50257, torch.float16)])
def test_gpu_cross_entropy_gradients_match_torch(v, dtype):
    """rtt.cross_entropy's loss and dlogits (from the fused forward, scaled by a non-unit incoming
    gradient) against F.cross_entropy in float64, within twice torch's error in the same dtype."""
    _cuda()
    torch.manual_seed(v)
    x = _rand((2, 37, v), dtype, scale=2.0)
    t = torch.randint(0, v, (2, 37), device="cuda")
    t[:, ::5] = -100
    F = torch.nn.functional

    def torch_fn(x_, reduction, smoothing):
        out = F.cross_entropy(x_.reshape(-1, v), t.reshape(-1), label_smoothing=smoothing, reduction=reduction)
        return out.reshape(t.shape) if reduction == "none" else out

    for reduction, smoothing in (("mean", 0.0), ("sum", 0.1), ("none", 0.0)):
        what = f"cross_entropy v={v} {dtype} reduction={reduction} smoothing={smoothing}"
        dloss = torch.rand(t.shape if reduction == "none" else (), device="cuda") + 0.5
        got_in, ref_in, low_in = _leaf(x), x.detach().double().requires_grad_(), _leaf(x)
        loss = rtt.cross_entropy(got_in, t, label_smoothing=smoothing, reduction=reduction)
        assert loss.dtype == torch.float32 and loss.shape == dloss.shape, what
        loss.backward(dloss)
        ref = torch_fn(ref_in, reduction, smoothing)
        ref.backward(dloss.double())
        low = torch_fn(low_in, reduction, smoothing)
        low.backward(dloss.to(low.dtype))
        assert got_in.grad.dtype == dtype, what
        _two_x(what + " loss", loss, low, ref, _floor(ref, torch.float32, rel32=2e-5))
        _two_x(what + " dlogits", got_in.grad, low_in.grad, ref_in.grad, _floor(ref_in.grad, dtype))


@pytest.mark.gpu
def test_gpu_opcheck_training_ops():
    _cuda()
    torch.manual_seed(5)
    x, w = _rand((6, 96), torch.float16, requires_grad=True), _rand((96,), torch.float32, requires_grad=True)
    dy = _rand((6, 96), torch.float16)
    y = torch.softmax(x.detach().float(), -1).half()
    logits = _rand((5, 1000), torch.float32, requires_grad=True)
    target = torch.tensor([1, -100, 999, 0, 7], device="cuda")
    cases = [
        (torch.ops.rtk.softmax_backward.default, (dy, y, False)),
        (torch.ops.rtk.rmsnorm_backward.default, (dy, x.detach(), w.detach(), None, 1e-6)),
        (torch.ops.rtk.layernorm_backward.default, (dy, x.detach(), w.detach(), w.detach(), None, None, 1e-5)),
        (torch.ops.rtk.cross_entropy.default, (logits, target, -100, 0.1, "mean")),
        (torch.ops.rtk.cross_entropy_with_grad.default, (logits, target, -100, 0.0, "none")),
    ]
    _opcheck_all(torch, cases)


def _opcheck_all(torch, cases):
    """torch.library.opcheck of each (op overload, args); every failing check reported at once."""
    failures = []
    for opov, args in cases:
        res = torch.library.opcheck(opov, args, raise_exception=False)
        bad = {k_: str(v_) for k_, v_ in res.items() if v_ != "SUCCESS"}
        if bad:
            failures.append(f"{opov}: {bad}")
    assert not failures, "\n".join(failures)
