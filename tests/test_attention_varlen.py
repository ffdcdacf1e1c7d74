"""GPU tests of variable-length batches, sliding windows and softcap in rtk.attention (and the backward).

FlashAttention's rule throughout: the kernel's error against a float64 reference is at most twice the
error of the same computation emulated in the input dtype (scores, capped scores, probabilities and
products rounded to it) plus a floor of a few ulps; outputs are poisoned (NaN bytes) first; lse is
-inf exactly where the reference has it; no NaN anywhere.  Varlen references are per-sequence dense
references under the same normalized mask spec the kernels get.  Both kernels run every case on sm_90:
the Hopper (TMA + wgmma) one and the mma.sync one (``kernel="mma"`` switches the Hopper path off).
Failures print the config, shapes and errors.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from rtkernels.errors import ConfigError

attn_mod = importlib.import_module("rtkernels.ops.attention")
sm90_mod = importlib.import_module("rtkernels.ops.attention_sm90")
bwd_mod = importlib.import_module("rtkernels.ops.attention_bwd")
bwd90_mod = importlib.import_module("rtkernels.ops.attention_bwd_sm90")

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["sm90", "mma"])
def kernel(request, monkeypatch):
    """Which kernels run: the Hopper ones where the GPU is sm_90 (else the case is the mma.sync
    one twice; the Hopper backward takes head dims <= 128 and builds without spills), or the
    mma.sync ones."""
    if request.param == "mma":
        monkeypatch.setattr(sm90_mod, "ENABLED", False)
        monkeypatch.setattr(bwd90_mod, "ENABLED", False)
    return request.param


# Every (dtype, head_dim, causal, mask flags) the tests below build, compiled up front on all cores
# (NVRTC releases the GIL): one by one they would take most of the time budget.
_FLAGS = dict(has_window=True, has_softcap=True, is_varlen=True)
WARM = ([("bfloat16", 128, c, dict(has_window=w, is_varlen=True)) for c in (False, True) for w in (False, True)]
        + [("float16", 64, c, dict(has_window=w, has_softcap=True, is_varlen=True)) for c, w in
           ((True, False), (True, True), (False, False))]
        + [(dt, d, True, _FLAGS) for dt, d in (("bfloat16", 64), ("float16", 80), ("bfloat16", 128),
                                                 ("float16", 192), ("bfloat16", 256))]
        + [("bfloat16", 96, c, dict(has_window=True, has_softcap=cap)) for c in (False, True) for cap in (False, True)]
        + [("float16", 64, True, dict(has_window=True, is_varlen=True)), ("bfloat16", 64, True, dict(is_varlen=True)),
           ("float16", 64, False, dict(is_varlen=True)), ("float16", 72, True, dict(has_window=True, is_varlen=True)),
           ("bfloat16", 128, True, dict(has_softcap=True, is_varlen=True))])


@pytest.fixture(scope="module", autouse=True)
def _warm_kernels():
    from concurrent.futures import ThreadPoolExecutor
    from rtkernels import device
    arch = device.current_arch()
    jobs = []
    for dt, d, causal, flags in WARM:
        mf = tuple((f, flags.get(f, False)) for f in ("has_window", "has_softcap", "is_varlen"))
        jobs.append(lambda dt=dt, d=d, c=causal, mf=mf: attn_mod._kernel_for(dt, d, c, arch, mf))
        for det in (False, True):
            jobs.append(lambda dt=dt, d=d, c=causal, mf=mf, det=det: bwd_mod._kernels_for(dt, d, c, det, arch, None, mf))
        if sm90_mod.is_sm90(arch):
            jobs.append(lambda dt=dt, d=d, c=causal, mf=mf: sm90_mod.kernel_for(dt, d, c, arch, mf))
            for det in (False, True):
                def hopper_bwd(dt=dt, d=d, c=causal, mf=mf, det=det):
                    if bwd90_mod.picks(d, c, mf, dt, det):
                        bwd90_mod.kernels_for(bwd90_mod.choose_config(dt, d, c, det, **dict(mf)), arch)
                jobs.append(hopper_bwd)
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda f: f(), jobs))


# ---- helpers ---------------------------------------------------------------------------------------
def _seed():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def _packed(rng, lens_q, lens_k, h, hkv, d, dtype):
    """(cu_q, cu_k, q, k, v): fresh random packed arrays (bfloat16 as uint16 bits)."""
    import cupy as cp
    from gpu_util import random_array
    cu_q = cp.asarray(np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32))
    cu_k = cp.asarray(np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32))
    tq, tk = int(sum(lens_q)), int(sum(lens_k))
    q = random_array(rng, (tq, h, d), dtype)[0]
    k = random_array(rng, (tk, hkv, d), dtype)[0]
    v = random_array(rng, (tk, hkv, d), dtype)[0]
    return cu_q, cu_k, q, k, v


def _rel_err(a, b):
    import cupy as cp
    a = cp.asarray(a, dtype=cp.float64)
    b = cp.asarray(b, dtype=cp.float64)
    den = float(cp.linalg.norm(b))
    return float(cp.linalg.norm(a - b)) / (den if den > 0 else 1.0)


def _two_x(name, got, ref, low, dtype, where, floor=None):
    """err(got) <= 2 err(low) + floor (default: one rounding of dtype), every value finite."""
    import cupy as cp
    got = cp.asarray(got, dtype=cp.float64)
    assert not bool(cp.isnan(got).any()), f"NaN in {name} ({where})"
    err, err_low = _rel_err(got, ref), _rel_err(low, ref)
    if floor is None:
        floor = 2 ** -11 if dtype == "float16" else 2 ** -8
    worst = float(cp.abs(got - ref).max()) if got.size else 0.0
    assert err <= 2 * err_low + floor, (f"{name}: rel err {err:.3e} vs reference-in-{dtype} {err_low:.3e} "
                                        f"(max abs {worst:.3e}; {where})")


def _check_lse(lse, lse_ref, where):
    import cupy as cp
    lse = cp.asarray(lse, dtype=cp.float64)
    assert lse.shape == lse_ref.shape, (lse.shape, lse_ref.shape, where)
    assert not bool(cp.isnan(lse).any()), f"NaN in lse ({where})"
    ninf = cp.isneginf(lse_ref)
    assert bool((cp.isneginf(lse) == ninf).all()), f"-inf rows of lse differ ({where})"
    fin = ~ninf
    if bool(fin.any()):
        d = cp.abs(lse[fin] - lse_ref[fin]) / cp.maximum(cp.abs(lse_ref[fin]), 1.0)
        assert float(d.max()) <= 1e-3, f"lse rel err {float(d.max()):.2e} ({where})"


def _forward_check(q, k, v, dtype, o, lse, where, floor=None, **mask):
    """o and lse against the float64 reference with the 2x rule (mask: causal, window, softcap,
    cu_seqlens_q/k, softmax_scale; floor: see _two_x)."""
    from gpu_util import to_f64
    from rtkernels.ops.attention import attention_reference
    bf = "bfloat16" if dtype == "bfloat16" else None
    ref, lse_ref = attention_reference(q, k, v, dtype=bf, compute="float64", **mask)
    low, _ = attention_reference(q, k, v, dtype=bf, compute="float32", round_to=dtype, **mask)
    _two_x("o", to_f64(o, dtype), ref, low, dtype, where, floor)
    if lse is not None:
        _check_lse(lse, lse_ref, where)


def _varlen_forward(rng, lens_q, lens_k, h, hkv, d, dtype, causal=False, window=None, softcap=None, hints=True):
    import cupy as cp
    from gpu_util import poison
    from rtkernels.ops.attention import attention
    cu_q, cu_k, q, k, v = _packed(rng, lens_q, lens_k, h, hkv, d, dtype)
    o = poison(cp.empty(q.shape, q.dtype))
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    if hints:
        extra.update(max_seqlen_q=int(max(lens_q)), max_seqlen_k=int(max(lens_k)))
    o2, lse = attention(q, k, v, causal=causal, out=o, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window=window,
                        softcap=softcap, **extra)
    assert o2 is o and lse.shape == (h, q.shape[0])
    cp.cuda.get_current_stream().synchronize()
    where = (f"lens_q={list(lens_q)} lens_k={list(lens_k)} h={h} hkv={hkv} d={d} {dtype} causal={causal} "
             f"window={window} softcap={softcap}")
    _forward_check(q, k, v, dtype, o, lse, where, causal=causal, window=window, softcap=softcap,
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return cu_q, cu_k, q, k, v, o, lse


# The mix: 1, 2, 17, 128, 1000, 4097 in one batch, empty sequences, keys != queries.
MIX_Q = [1, 2, 17, 0, 128, 1000, 4097, 0, 300]
MIX_K = [1, 5, 17, 3, 128, 1000, 4097, 0, 257]
SHORT_Q = [1, 2, 17, 0, 128, 200, 65]
SHORT_K = [3, 2, 17, 9, 100, 333, 0]

WINDOWS = [(False, None), (True, None), (False, (0, 0)), (False, (1, 0)), (False, (127, 0)),
           (False, (256, 256)), (False, (-1, 64))]


# ---- forward: varlen x windows x softcap ---------------------------------------------------------------
@pytest.mark.parametrize("causal,window", WINDOWS)
def test_varlen_mix_windows(kernel, causal, window):
    _varlen_forward(_seed(), MIX_Q, MIX_K, 4, 2, 128, "bfloat16", causal, window)


@pytest.mark.parametrize("softcap", [30.0, 50.0])
@pytest.mark.parametrize("causal,window", [(True, None), (False, (127, 0)), (False, None)])
def test_varlen_softcap(kernel, causal, window, softcap):
    _varlen_forward(_seed(), SHORT_Q, SHORT_K, 4, 1, 64, "float16", causal, window, softcap)


HEAD_DIMS = [("bfloat16", 64), ("float16", 80), ("bfloat16", 128), ("float16", 192), ("bfloat16", 256)]


@pytest.mark.parametrize("dtype,d", HEAD_DIMS)
def test_varlen_head_dims(kernel, dtype, d):
    # GQA 3:1, a causal sliding window and a softcap together
    _varlen_forward(_seed(), SHORT_Q, SHORT_K, 6, 2, d, dtype, True, (100, 0), 30.0)


def test_varlen_without_hints_reads_cu_seqlens(kernel):
    _varlen_forward(_seed(), MIX_Q, MIX_K, 2, 2, 64, "bfloat16", True, None, hints=False)


def test_varlen_many_short_sequences(kernel):
    rng = _seed()
    lens_q = rng.integers(0, 40, size=300)
    lens_k = rng.integers(0, 40, size=300)
    _varlen_forward(rng, lens_q, lens_k, 2, 1, 64, "float16", True, (8, 0))


def test_varlen_no_keys_at_all(kernel):
    """total_k == 0 (every sequence empty on the key side): o = 0, lse = -inf."""
    import cupy as cp
    rng = _seed()
    _, _, _, _, _, o, lse = _varlen_forward(rng, [3, 0, 70], [0, 0, 0], 2, 2, 64, "float16")
    assert float(cp.abs(o.astype(cp.float32)).max()) == 0 and bool(cp.isneginf(lse).all())


@pytest.mark.parametrize("causal,window", [(False, (0, 0)), (False, (3, 2)), (False, (-1, 64)), (True, (16, 0))])
@pytest.mark.parametrize("softcap", [None, 50.0])
def test_dense_windows_and_softcap(kernel, causal, window, softcap):
    """The dense layout (batch, seqlen, heads, dim) with windows and softcap, seqlen_q != seqlen_k
    both ways (rows that see no key included)."""
    import cupy as cp
    from gpu_util import poison, random_array
    from rtkernels.ops.attention import attention
    rng = _seed()
    for sq, sk in ((300, 517), (517, 300)):
        q = random_array(rng, (2, sq, 4, 96), "bfloat16")[0]
        k = random_array(rng, (2, sk, 2, 96), "bfloat16")[0]
        v = random_array(rng, (2, sk, 2, 96), "bfloat16")[0]
        o = poison(cp.empty(q.shape, q.dtype))
        _, lse = attention(q, k, v, causal=causal, window=window, softcap=softcap, out=o, dtype="bfloat16")
        cp.cuda.get_current_stream().synchronize()
        _forward_check(q, k, v, "bfloat16", o, lse, f"sq={sq} sk={sk} causal={causal} window={window} "
                       f"softcap={softcap}", causal=causal, window=window, softcap=softcap)


def test_varlen_strided_qkv_and_scale(kernel):
    """q, k, v as slices of one packed (total, 3, heads, dim) array; a custom scale."""
    import cupy as cp
    from gpu_util import random_array
    from rtkernels.ops.attention import attention
    rng = _seed()
    lens = [5, 0, 130, 77]
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    qkv = random_array(rng, (sum(lens), 3, 4, 72), "float16")[0]
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    o, lse = attention(q, k, v, causal=True, softmax_scale=0.3, cu_seqlens_q=cu, cu_seqlens_k=cu, window=(33, 0))
    cp.cuda.get_current_stream().synchronize()
    _forward_check(q, k, v, "float16", o, lse, "strided qkv", causal=True, window=(33, 0), softmax_scale=0.3,
                   cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_varlen_plans_replay_new_contents_and_graphs(kernel):
    """A call with both max_seqlen hints records a launch plan (sm_90); later calls with the same
    signatures replay it - with new cu_seqlens contents (same batch and totals) and new data - and
    a CUDA graph captured from a replay runs again with new lengths written into cu_seqlens."""
    import cupy as cp
    from gpu_util import poison, random_array
    from rtkernels.ops.attention import attention, _VARLEN_PLANS
    rng = _seed()
    layouts = ([5, 0, 130, 77, 300], [300, 77, 0, 130, 5], [100, 100, 112, 100, 100], [512, 0, 0, 0, 0])
    total, h, hkv, d, dt = 512, 4, 2, 64, "float16"
    cu = cp.zeros(len(layouts[0]) + 1, cp.int32)
    q, k, v = (random_array(rng, (total, n, d), dt)[0] for n in (h, hkv, hkv))
    o = cp.empty(q.shape, q.dtype)

    def call():
        return attention(q, k, v, causal=True, out=o, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=total,
                         max_seqlen_k=total, window=(63, 0))

    def refill(lens):
        cu[...] = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        for a in (q, k, v):
            a[...] = random_array(rng, a.shape, dt)[0]
        poison(o)
        cp.cuda.Device().synchronize()   # (the graph runs on a non-blocking stream)

    _VARLEN_PLANS.clear()
    for i, lens in enumerate(layouts[:2]):
        refill(lens)
        _, lse = call()
        cp.cuda.get_current_stream().synchronize()
        _forward_check(q, k, v, dt, o, lse, f"call {i} lens={lens}", causal=True, window=(63, 0),
                       cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert len(_VARLEN_PLANS) == (1 if kernel == "sm90" and sm90_mod.ENABLED else 0)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        call()                      # the plan's workspace on this stream exists before capture
        stream.synchronize()
        stream.begin_capture()
        _, lse = call()
        graph = stream.end_capture()
    for lens in layouts[2:]:
        refill(lens)
        graph.launch(stream)
        stream.synchronize()
        _forward_check(q, k, v, dt, o, lse, f"graph replay lens={lens}", causal=True, window=(63, 0),
                       cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_varlen_torch_in_torch_out(kernel):
    torch = pytest.importorskip("torch")
    import cupy as cp
    from rtkernels.ops.attention import attention
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [7, 300, 1, 64]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(lens), 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(lens), 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    o, lse = attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, softcap=50.0)
    assert isinstance(o, torch.Tensor) and o.shape == q.shape and o.dtype == torch.bfloat16
    assert isinstance(lse, torch.Tensor) and lse.shape == (4, sum(lens))
    torch.cuda.synchronize()
    bits = lambda t: cp.from_dlpack(t.view(torch.int16)).view(cp.uint16)   # noqa: E731
    _forward_check(bits(q), bits(k), bits(v), "bfloat16", bits(o), cp.from_dlpack(lse), "torch", causal=True,
                   softcap=50.0, cu_seqlens_q=cp.from_dlpack(cu), cu_seqlens_k=cp.from_dlpack(cu))
    # with both hints: the first call records a plan, the next ones replay it on torch's stream
    for _ in range(3):
        o3, lse3 = attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, softcap=50.0,
                             max_seqlen_q=300, max_seqlen_k=300)
    assert isinstance(o3, torch.Tensor) and o3.dtype == torch.bfloat16 and lse3.shape == (4, sum(lens))
    torch.cuda.synchronize()
    assert torch.equal(o3, o) and torch.equal(lse3, lse), "replayed varlen plan differs from the full path"


def test_bad_cu_seqlens_raise_and_launch_nothing():
    import cupy as cp
    from gpu_util import poison
    from rtkernels.ops.attention import attention
    q = cp.ones((10, 2, 64), cp.float16)
    out = poison(cp.empty_like(q))
    good = cp.asarray([0, 4, 10], cp.int32)
    cases = [
        (dict(cu_seqlens_q=cp.asarray([0, 4, 10], cp.int64)), "int32"),
        (dict(cu_seqlens_q=cp.asarray([0, 6, 4, 10], cp.int32), cu_seqlens_k=cp.asarray([0, 1, 4, 10], cp.int32)),
         "non-decreasing"),
        (dict(cu_seqlens_k=cp.asarray([0, 4, 9], cp.int32)), "end at"),
        (dict(cu_seqlens_q=cp.asarray([0, 10], cp.int32)), "same length"),
        (dict(cu_seqlens_q=cp.asarray([2, 4, 10], cp.int32)), "start at 0"),
        (dict(cu_seqlens_k=None), "both cu_seqlens_q and cu_seqlens_k"),
        (dict(cu_seqlens_q=cp.asarray([[0, 4, 10]], cp.int32)), "1-D"),
        (dict(max_seqlen_q=-3), "max_seqlen_q"),
        (dict(window=(3, 2), causal=True), "window"),
        (dict(softcap=-2.0), "softcap"),
    ]
    for change, words in cases:
        args = dict(cu_seqlens_q=good, cu_seqlens_k=good, out=out)
        args.update(change)
        with pytest.raises(ConfigError, match=words):
            attention(q, q, q, **args)
    with pytest.raises(ConfigError, match="4-D"):   # 3-D arrays without cu_seqlens
        attention(q, q, q)
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.isnan(out.astype(cp.float32)).all()), "an error case launched the kernel"


def test_schedule_matches_its_model():
    """The device schedule (sorted, and batch order past the sort's limit) equals the NumPy model."""
    import cupy as cp
    from rtkernels import device
    from rtkernels.ops import attention_mask as M
    rng = _seed()
    arch = device.current_arch()
    for batch in (1, 7, 300, 5000):
        lens_q = rng.choice([0, 1, 2, 17, 64, 128, 129, 1000], size=batch)
        lens_k = rng.choice([0, 1, 5, 300, 2048], size=batch)
        cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
        for block, desc in ((128, True), (64, False)):
            slots = M.varlen_slots(int(cu_q[-1]), batch, block, int(lens_q.max()))
            got = M.schedule(cp.asarray(cu_q), cp.asarray(cu_k), batch, int(cu_q[-1]), int(cu_k[-1]), block, slots,
                             desc, arch).get()
            want = M.schedule_reference(cu_q, cu_k, block, slots, desc, int(cu_q[-1]), int(cu_k[-1]))
            assert (got == want).all(), (batch, block, desc)
            _, kerns = M._schedule_kernels(arch)   # the batch-order kernel, whatever the batch
            slots = M.varlen_slots(int(cu_q[-1]), batch, block, 0, compact=False)
            table = cp.empty((slots, 2), cp.int32)
            kerns["attention_schedule_batch_order"].launch((-(-slots // 256),), (256,), cp.asarray(cu_q), batch,
                                                           int(cu_q[-1]), block, int(desc), table, slots)
            want = M.schedule_reference(cu_q, cu_k, block, slots, desc, int(cu_q[-1]), int(cu_k[-1]), sort=False)
            assert (table.get() == want).all(), (batch, block, desc, "batch order")


def test_dense_calls_with_options_off_match_plain_calls(kernel):
    """window=None / (-1, -1), softcap=None / 0 and causal=(-1, 0) are the plain kernels, bit for bit."""
    import cupy as cp
    from gpu_util import random_array
    from rtkernels.ops.attention import attention
    rng = _seed()
    q = random_array(rng, (2, 200, 4, 64), "float16")[0]
    k = random_array(rng, (2, 250, 2, 64), "float16")[0]
    o1, l1 = attention(q, k, k, causal=True)
    o2, l2 = attention(q, k, k, window=(-1, 0), softcap=0)
    o3, l3 = attention(q, k, k, window=(-1, -1), softcap=None)
    o4, l4 = attention(q, k, k)
    cp.cuda.get_current_stream().synchronize()
    assert bool((o1 == o2).all()) and bool((l1 == l2).all())
    assert bool((o3 == o4).all()) and bool((l3 == l4).all())


# ---- backward ----------------------------------------------------------------------------------------
def _backward_check(do, q, k, v, dtype, grads, where, **mask):
    from gpu_util import to_f64
    from rtkernels.ops.attention_bwd import attention_backward_reference
    bf = "bfloat16" if dtype == "bfloat16" else None
    ref = attention_backward_reference(do, q, k, v, dtype=bf, compute="float64", **mask)
    low = attention_backward_reference(do, q, k, v, dtype=bf, compute="float32", round_to=dtype, **mask)
    for name, got, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
        _two_x(name, to_f64(got, dtype), r, lo, dtype, where)


def _varlen_backward(rng, lens_q, lens_k, h, hkv, d, dtype, causal=False, window=None, softcap=None,
                     deterministic=False):
    import cupy as cp
    from gpu_util import poison, random_array
    from rtkernels.ops.attention_bwd import attention_backward
    cu_q, cu_k, q, k, v, o, lse = _varlen_forward(rng, lens_q, lens_k, h, hkv, d, dtype, causal, window, softcap)
    do = random_array(rng, q.shape, dtype)[0]
    grads = [poison(cp.empty(a.shape, a.dtype)) for a in (q, k, v)]
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    mask = dict(causal=causal, window=window, softcap=softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out = attention_backward(do, q, k, v, o, lse, deterministic=deterministic, dq=grads[0], dk=grads[1],
                             dv=grads[2], max_seqlen_q=int(max(lens_q)), max_seqlen_k=int(max(lens_k)), **mask,
                             **extra)
    assert all(a is b for a, b in zip(out, grads))
    cp.cuda.get_current_stream().synchronize()
    where = (f"backward lens_q={list(lens_q)} lens_k={list(lens_k)} h={h} hkv={hkv} d={d} {dtype} causal={causal} "
             f"window={window} softcap={softcap} deterministic={deterministic}")
    _backward_check(do, q, k, v, dtype, grads, where, **mask)
    return (do, q, k, v, o, lse), mask, grads


@pytest.mark.parametrize("causal,window", [(True, None), (False, (127, 0)), (False, (256, 256)), (False, (-1, 64)),
                                           (False, (0, 0)), (False, None)])
def test_backward_varlen_mix_windows(kernel, causal, window):
    _varlen_backward(_seed(), MIX_Q, MIX_K, 4, 2, 128, "bfloat16", causal, window)


@pytest.mark.parametrize("softcap", [30.0, 50.0])
@pytest.mark.parametrize("causal,window", [(True, None), (False, (127, 0)), (False, None)])
def test_backward_varlen_softcap(kernel, causal, window, softcap):
    _varlen_backward(_seed(), SHORT_Q, SHORT_K, 4, 1, 64, "float16", causal, window, softcap)


@pytest.mark.parametrize("dtype,d", HEAD_DIMS)
def test_backward_head_dims(kernel, dtype, d):
    _varlen_backward(_seed(), SHORT_Q, SHORT_K, 6, 2, d, dtype, True, (100, 0), 30.0)


@pytest.mark.parametrize("d", [64, 128])
def test_backward_deterministic_is_bit_identical(kernel, d):
    """deterministic=True: the same bits on every run (varlen, a window and a softcap, GQA)."""
    import cupy as cp
    from rtkernels.ops.attention_bwd import attention_backward
    dtype = "bfloat16" if d == 128 else "float16"
    cap = 30.0 if d == 64 else None
    window = (127, 0) if d == 128 else (33, 0)
    arrays, mask, first = _varlen_backward(_seed(), MIX_Q, MIX_K, 4, 2, d, dtype, True, window, cap,
                                           deterministic=True)
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    for _ in range(3):
        again = attention_backward(*arrays, deterministic=True, **mask, **extra)
        cp.cuda.get_current_stream().synchronize()
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all()), f"{name} differs between runs"


@pytest.mark.parametrize("causal,window,softcap", [(False, (0, 0), None), (False, (3, 2), 50.0), (True, (16, 0), None),
                                                   (False, (-1, 64), 30.0)])
def test_backward_dense_windows_and_softcap(kernel, causal, window, softcap):
    """Dense layout, seqlen_q != seqlen_k both ways: rows that see no key get zero gradients."""
    import cupy as cp
    from gpu_util import poison, random_array
    from rtkernels.ops.attention import attention
    from rtkernels.ops.attention_bwd import attention_backward
    rng = _seed()
    for sq, sk in ((300, 517), (517, 300)):
        q = random_array(rng, (2, sq, 4, 96), "bfloat16")[0]
        k = random_array(rng, (2, sk, 2, 96), "bfloat16")[0]
        v = random_array(rng, (2, sk, 2, 96), "bfloat16")[0]
        do = random_array(rng, q.shape, "bfloat16")[0]
        o, lse = attention(q, k, v, causal=causal, window=window, softcap=softcap, dtype="bfloat16")
        grads = [poison(cp.empty(a.shape, a.dtype)) for a in (q, k, v)]
        attention_backward(do, q, k, v, o, lse, causal=causal, window=window, softcap=softcap, dq=grads[0],
                           dk=grads[1], dv=grads[2], dtype="bfloat16")
        cp.cuda.get_current_stream().synchronize()
        _backward_check(do, q, k, v, "bfloat16", grads, f"sq={sq} sk={sk} causal={causal} window={window} "
                        f"softcap={softcap}", causal=causal, window=window, softcap=softcap)


def _cu_of(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _bits_equal(a, b):
    import cupy as cp
    return bool((cp.asarray(a).view(cp.uint16) == cp.asarray(b).view(cp.uint16)).all())


def test_backward_varlen_plans_replay_bit_identical_new_contents_and_graphs(kernel):
    """A backward call with both max_seqlen hints records a launch plan (Hopper kernels); later calls
    with the same signatures replay it.  deterministic=True: the replay's gradients are the full
    path's bit for bit (with the hints, and without them: the full path that reads cu_seqlens);
    replays with new cu_seqlens contents (same batch and totals) and new data meet the 2x rule; a
    CUDA graph captured from a replay (its temporaries in the stream's workspace) runs again with
    new lengths written into cu_seqlens and equals an eager replay bit for bit.  The mma.sync path
    keeps no plan: its full path is what the graph captures (temporaries in the workspace too)."""
    import cupy as cp
    from gpu_util import poison, random_array
    from rtkernels import device
    from rtkernels.ops.attention import attention
    from rtkernels.ops.attention_bwd import attention_backward, _VARLEN_BACKWARD_PLANS
    rng = _seed()
    layouts = ([5, 0, 130, 77, 300], [300, 77, 0, 130, 5], [100, 100, 112, 100, 100], [512, 0, 0, 0, 0])
    total, h, hkv, d, dt = 512, 4, 2, 128, "bfloat16"
    mask = dict(causal=True, window=(63, 0))
    cu = cp.zeros(len(layouts[0]) + 1, cp.int32)
    q, do = (random_array(rng, (total, h, d), dt)[0] for _ in range(2))
    k, v = (random_array(rng, (total, hkv, d), dt)[0] for _ in range(2))
    o = cp.empty(q.shape, q.dtype)
    lse = cp.empty((h, total), cp.float32)
    grads = [cp.empty(a.shape, a.dtype) for a in (q, k, v)]
    flags = (("has_window", True), ("has_softcap", False), ("is_varlen", True))
    on90 = kernel == "sm90" and sm90_mod.is_sm90(device.current_arch())
    hopper, hopper_atomic = (on90 and bwd90_mod.picks(d, True, flags, dt, det) for det in (True, False))

    def call(deterministic=True, hints=True, stream=None):
        extra = dict(max_seqlen_q=total, max_seqlen_k=total) if hints else {}
        return attention_backward(do, q, k, v, o, lse, deterministic=deterministic, dq=grads[0], dk=grads[1],
                                  dv=grads[2], cu_seqlens_q=cu, cu_seqlens_k=cu, dtype=dt, stream=stream, **mask,
                                  **extra)

    def refill(lens):
        cu[...] = cp.asarray(_cu_of(lens))
        for a in (q, k, v, do):
            a[...] = random_array(rng, a.shape, dt)[0]
        _, lse_new = attention(q, k, v, out=o, cu_seqlens_q=cu, cu_seqlens_k=cu, dtype=dt, **mask)
        lse[...] = lse_new
        for g in grads:
            poison(g)
        cp.cuda.Device().synchronize()   # (the graph runs on a non-blocking stream)

    def check(where):
        cp.cuda.Device().synchronize()
        _backward_check(do, q, k, v, dt, grads, where, cu_seqlens_q=cu, cu_seqlens_k=cu, **mask)
        return [g.copy() for g in grads]

    _VARLEN_BACKWARD_PLANS.clear()
    refill(layouts[0])
    call()                                           # the full path (records the plan)
    full = check(f"full path lens={layouts[0]}")
    for g in grads:
        poison(g)
    call()                                           # the replay
    replay = check(f"replay lens={layouts[0]}")
    assert len(_VARLEN_BACKWARD_PLANS) == (1 if hopper else 0)
    for name, a, b in zip(("dq", "dk", "dv"), full, replay):
        assert _bits_equal(a, b), f"{name}: replay differs from the full path (deterministic)"
    call(hints=False)                                # the full path that reads cu_seqlens (no plan)
    for name, a, b in zip(("dq", "dk", "dv"), check("no hints"), replay):
        assert _bits_equal(a, b), f"{name}: the replay differs from the full path without hints (deterministic)"
    refill(layouts[1])
    call()
    check(f"replay with new contents lens={layouts[1]}")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        call()                                       # the workspace on this stream exists before capture
        stream.synchronize()
        stream.begin_capture()
        call()
        graph = stream.end_capture()
    for lens in layouts[2:]:
        refill(lens)
        graph.launch(stream)
        stream.synchronize()
        captured = check(f"graph replay lens={lens}")
        for g in grads:
            poison(g)
        call()
        for name, a, b in zip(("dq", "dk", "dv"), captured, check(f"eager call lens={lens}")):
            assert _bits_equal(a, b), f"{name}: the graph's gradients differ from an eager call (lens={lens})"
    refill(layouts[0])
    for i in range(2):                               # the default (atomic dQ) mode: full path, then replay
        call(deterministic=False)
        check(f"deterministic=False call {i}")
    assert len(_VARLEN_BACKWARD_PLANS) == int(hopper) + int(hopper_atomic)


def test_backward_varlen_torch_replay(kernel):
    """torch tensors: the recorded plan replays on torch's current stream with new outputs (torch
    bfloat16), bit-identical to the full path (deterministic), with new cu_seqlens contents, and
    inside a torch CUDA graph (temporaries from the stream workspace, made by torch's allocator; on
    the mma.sync kernels the graph captures the full path)."""
    torch = pytest.importorskip("torch")
    import cupy as cp
    from rtkernels import device
    from rtkernels.ops.attention import attention
    from rtkernels.ops.attention_bwd import attention_backward, _VARLEN_BACKWARD_PLANS
    g = torch.Generator(device="cuda").manual_seed(int(_seed().integers(2**31)))
    layouts = ([7, 300, 1, 64], [64, 1, 300, 7], [93, 93, 93, 93])
    total, h, d = sum(layouts[0]), 4, 128
    cu = torch.tensor(_cu_of(layouts[0]), dtype=torch.int32, device="cuda")
    mk = lambda n: torch.randn(total, n, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, do = mk(h), mk(1), mk(1), mk(h)
    mask = dict(causal=True, softcap=50.0, cu_seqlens_q=cu, cu_seqlens_k=cu)
    hints = dict(max_seqlen_q=total, max_seqlen_k=total)
    o, lse = attention(q, k, v, **mask, **hints)
    bits = lambda t: cp.from_dlpack(t.view(torch.int16)).view(cp.uint16)   # noqa: E731
    hopper = kernel == "sm90" and sm90_mod.is_sm90(device.current_arch()) and bwd90_mod.picks(
        d, True, (("has_window", False), ("has_softcap", True), ("is_varlen", True)), "bfloat16", True)

    def check(grads, where):
        torch.cuda.synchronize()
        _backward_check(bits(do), bits(q), bits(k), bits(v), "bfloat16", [bits(t) for t in grads], where,
                        causal=True, softcap=50.0, cu_seqlens_q=cp.from_dlpack(cu), cu_seqlens_k=cp.from_dlpack(cu))

    _VARLEN_BACKWARD_PLANS.clear()
    first = attention_backward(do, q, k, v, o, lse, deterministic=True, **mask, **hints)
    check(first, "torch full path")
    for _ in range(2):
        again = attention_backward(do, q, k, v, o, lse, deterministic=True, **mask, **hints)
        assert all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in again)
        assert [t.shape for t in again] == [q.shape, k.shape, v.shape]
        torch.cuda.synchronize()
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name}: the torch replay differs from the full path"
    assert len(_VARLEN_BACKWARD_PLANS) == (1 if hopper else 0)

    def refill(lens):
        cu.copy_(torch.tensor(_cu_of(lens), device="cuda"))
        for t in (q, k, v, do):
            t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=g))
        o_new, lse_new = attention(q, k, v, **mask, **hints)
        o.copy_(o_new)
        lse.copy_(lse_new)

    refill(layouts[1])
    check(attention_backward(do, q, k, v, o, lse, deterministic=True, **mask, **hints),
          f"torch replay with new contents lens={layouts[1]}")
    # a torch CUDA graph of the call (its workspace made during capture, from torch's graph pool).
    # Only the recorded plan: the full path (the mma.sync kernels here) views torch tensors through
    # DLPack, whose stream handshake makes the legacy stream wait on the capturing one - an error
    # under capture (cudaErrorStreamCaptureImplicit, H200 2026-11-26).
    if not hopper:
        return
    outs = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention_backward(do, q, k, v, o, lse, deterministic=True, dq=outs[0], dk=outs[1], dv=outs[2], **mask,
                           **hints)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention_backward(do, q, k, v, o, lse, deterministic=True, dq=outs[0], dk=outs[1], dv=outs[2], **mask,
                           **hints)
    refill(layouts[2])
    for t in outs:
        t.fill_(float("nan"))
    graph.replay()
    check(outs, f"torch graph replay lens={layouts[2]}")
    eager = attention_backward(do, q, k, v, o, lse, deterministic=True, **mask, **hints)
    torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dk", "dv"), outs, eager):
        assert torch.equal(a, b), f"{name}: the torch graph's gradients differ from an eager call"
