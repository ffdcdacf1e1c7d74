"""rtkernels.dist on one GPU (``-m gpu``): the merge kernel against its float64 reference, and the
whole ring - forward o / lse and dq / dk / dv - on 2 and 4 simulated ranks (threads, one stream
each, the same schedule code NCCL runs) against the float64 reference and single-GPU
rtk.attention / rtk.attention_backward on the gathered sequence.

Error rule (FlashAttention's, as tests/test_attention.py): err(ring) <= 2 err(reference run in the
input dtype) + floor, and err(ring) <= 2 err(single-GPU rtk) + floor, errors relative in the
Frobenius norm against float64.  Every rank first fills the memory its allocations will reuse with
NaN bytes, so a buffer read before it is written shows up as NaN.
"""
from __future__ import annotations

import numpy as np
import pytest

import rtkernels as rtk
import rtkernels.dist as rd
from rtkernels.ops.attention_merge import add_rows, attention_merge, attention_merge_reference

DTYPE_FLOOR = {"float16": 2 ** -11, "bfloat16": 2 ** -8}          # forward, as test_attention
DTYPE_FLOOR_BWD = {"float16": 2 ** -10, "bfloat16": 2 ** -7}     # backward, as test_attention_bwd


def _seed(seed=None):
    seed = int(np.random.SeedSequence().entropy % 2 ** 32) if seed is None else seed
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def _rel(a, b):
    import cupy as cp
    a, b = cp.asarray(a, cp.float64), cp.asarray(b, cp.float64)
    den = float(cp.linalg.norm(b))
    return float(cp.linalg.norm(a - b)) / (den if den > 0 else 1.0)


# ---- merge kernel ------------------------------------------------------------------------------
def _host(dev, dtype):
    from gpu_util import to_f64
    return to_f64(dev, dtype)


def _device(h, dtype, wide_by=0):
    """A device array of the float64 values ``h`` rounded to ``dtype`` (NaN kept); ``wide_by`` > 0
    makes it a head-dim slice of a wider array (strided rows)."""
    import cupy as cp
    from gpu_util import bf16_bits_from_f32
    if wide_by:
        h = np.concatenate([h, np.zeros(h.shape[:-1] + (wide_by,))], axis=-1)
    if dtype == "bfloat16":
        dev = cp.asarray(bf16_bits_from_f32(h.astype(np.float32)))
    else:
        dev = cp.asarray(h.astype(dtype))
    return dev[..., :dev.shape[-1] - wide_by] if wide_by else dev


@pytest.mark.gpu
@pytest.mark.parametrize("d", [5, 6, 24, 128, 256])
@pytest.mark.parametrize("dts", [("float32", "bfloat16", "float32"), ("bfloat16", "bfloat16", "float32"),
                                 ("float32", "float16", "float16"), ("float32", "bfloat16", "bfloat16")])
def test_gpu_merge_matches_reference(d, dts):
    import cupy as cp
    from gpu_util import poison
    rng = _seed()
    dt_a, dt_b, dt_o = dts
    B, S, H = 2, 37, 3
    lo, hi = 3, S - 4
    a_h = rng.standard_normal((B, S, H, d))
    b_h = rng.standard_normal((B, hi - lo, H, d))
    lse_a_h = rng.standard_normal((B, H, S)) * 3
    lse_b_h = rng.standard_normal((B, H, hi - lo)) * 3
    # empty rows (lse -inf) hold NaN: one empty in a, one in b, one in both, one outside the block
    for row in (5, 9, 1):
        lse_a_h[:, :, row], a_h[:, row] = -np.inf, np.nan
    for row in (7, 9):
        lse_b_h[:, :, row - lo], b_h[:, row - lo] = -np.inf, np.nan
    wide = 8 if d % 8 == 0 else 0   # strided views for the head dims the attention kernels take
    a, b = _device(a_h, dt_a, wide), _device(b_h, dt_b, wide)
    lse_a, lse_b = cp.asarray(lse_a_h, cp.float32), cp.asarray(lse_b_h, cp.float32)
    ref_o, ref_lse = attention_merge_reference(_host(a, dt_a), cp.asnumpy(lse_a), _host(b, dt_b), cp.asnumpy(lse_b),
                                               rows=(lo, hi))
    extra = {"dtype": "bfloat16"} if "bfloat16" in dts else {}
    in_place = dt_a == dt_o
    if in_place:   # rows outside the block are left as they are
        out, lse_out = a, lse_a
        before = _host(a, dt_a).copy()
    else:
        out = poison(cp.empty((B, S, H, d), cp.uint16 if dt_o == "bfloat16" else dt_o))
        lse_out = poison(cp.empty((B, H, S), cp.float32))
    r = attention_merge(a, lse_a, b, lse_b, rows=(lo, hi), out=out, lse_out=lse_out, **extra)
    assert r[0] is out and r[1] is lse_out
    cp.cuda.get_current_stream().synchronize()
    got = _host(out, dt_o)
    got_lse = cp.asnumpy(lse_out).astype(np.float64)
    rows = slice(lo, hi) if in_place else slice(None)
    assert not np.isnan(got[:, rows]).any(), "NaN in the merged o"
    tol = {"float32": 2e-6, "float16": 2 ** -10, "bfloat16": 2 ** -7}[dt_o]
    err = np.abs(got[:, rows] - ref_o[:, rows]).max() / max(np.abs(ref_o[:, rows]).max(), 1.0)
    print(f"d={d} {dts} in_place={in_place}: max rel err {err:.2e}")
    assert err <= tol, f"merge o err {err:.3e} > {tol:.1e} (d={d}, {dts})"
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(got_lse[fin], ref_lse[fin], rtol=2e-6, atol=2e-6)
    if in_place:
        np.testing.assert_array_equal(got[:, hi:], before[:, hi:])
        np.testing.assert_array_equal(np.isnan(got[:, 1]), True)    # untouched (it was NaN)
    else:
        np.testing.assert_array_equal(got[:, 1], 0.0)               # empty row copied out as 0


@pytest.mark.gpu
@pytest.mark.parametrize("d", [8, 128, 200])
def test_gpu_add_rows_and_conversion(d):
    import cupy as cp
    from gpu_util import poison
    rng = _seed()
    B, S, H = 3, 29, 2
    a = _device(rng.standard_normal((B, S, H, d)), "float32")
    b = _device(rng.standard_normal((B, 11, H, d)), "bfloat16", 8)
    a64, b64 = _host(a, "float32"), _host(b, "bfloat16")
    want = a64.copy()
    want[:, 4:15] += b64
    add_rows(a, b, rows=(4, 15), dtype="bfloat16")                      # in place, float32 += bfloat16
    np.testing.assert_allclose(_host(a, "float32"), want, rtol=1e-6, atol=1e-6)
    out = poison(cp.empty((B, S, H, d), cp.uint16))
    add_rows(a, b, rows=(4, 15), out=out, dtype="bfloat16")          # a + b, every row, as bfloat16
    want[:, 4:15] += b64
    np.testing.assert_allclose(_host(out, "bfloat16"), want, rtol=2 ** -8, atol=2 ** -8)
    conv = poison(cp.empty((B, 11, H, d), cp.float32))
    add_rows(None, b, out=conv, dtype="bfloat16")                        # no a: a conversion
    np.testing.assert_array_equal(_host(conv, "float32"), b64)


# ---- the ring on simulated ranks ---------------------------------------------------------------
def _poison_pool(nbytes: int = 64 << 20) -> None:
    """Fill memory the current stream's pool hands out next with NaN bytes."""
    import cupy as cp
    junk = cp.empty(nbytes, cp.uint8)
    junk.fill(0xFF)
    del junk


def _ring_case(world, layout, causal, d, *, L, B=2, H=4, Hkv=2, dtype="bfloat16", packed=False, seed=None,
               torch_inputs=False):
    import cupy as cp
    from gpu_util import random_array
    rng = _seed(seed)
    S = world * L
    if packed:   # q, k, v slices of one (b, s, 3, h, d) array per rank: strided views, no copies
        assert H == Hkv
        qkv, _ = random_array(rng, (B, S, 3, H, d), dtype)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        q, k, v = (random_array(rng, (B, S, h, d), dtype)[0] for h in (H, Hkv, Hkv))
    do = random_array(rng, (B, S, H, d), dtype)[0]
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    scale = 0.9 / np.sqrt(d)

    def rank_fn(comm):
        if packed:
            qkv_r = rd.shard(qkv, comm.rank, world, layout)
            qs, ks, vs = qkv_r[:, :, 0], qkv_r[:, :, 1], qkv_r[:, :, 2]
        else:
            qs, ks, vs = (rd.shard(x, comm.rank, world, layout) for x in (q, k, v))
        dos = rd.shard(do, comm.rank, world, layout)
        if torch_inputs:
            import torch
            qs, ks, vs, dos = (torch.from_dlpack(x).view(torch.bfloat16) for x in (qs, ks, vs, dos))
            kw = {}
        else:
            _poison_pool()
            kw = extra
        o, lse = rd.ring_attention(qs, ks, vs, causal=causal, softmax_scale=scale, layout=layout, comm=comm,
                                   return_lse=True, **kw)
        grads = rd.ring_attention_backward(dos, qs, ks, vs, o, lse, causal=causal, softmax_scale=scale,
                                           layout=layout, comm=comm, **kw)
        out = (o, lse) + tuple(grads)
        if torch_inputs:
            import torch
            out = tuple(cp.from_dlpack(x.view(torch.int16) if x.dtype == torch.bfloat16 else x) for x in out)
            out = tuple(x.view(cp.uint16) if x.dtype == cp.int16 else x for x in out)
        return out

    res = rd.SimulatedComm(world).run(rank_fn)
    cp.cuda.get_current_stream().synchronize()
    got = {n: rd.unshard([r[i] for r in res], layout, dim=2 if n == "lse" else 1)
           for i, n in enumerate(("o", "lse", "dq", "dk", "dv"))}
    tag = f"world={world} {layout} causal={causal} d={d} L={L} B={B} H={H}/{Hkv} {dtype}"
    check_ring(tag, got, q, k, v, do, causal, scale, dtype)


def check_ring(tag, got: dict, q, k, v, do, causal, scale, dtype, part=lambda x, dim: x):
    """Assert the rule on o, dq, dk, dv (and lse within 1e-3) against the float64 reference, the
    reference run in ``dtype`` and single-GPU rtk on the full sequence; ``part(x, dim)`` cuts a
    full-sequence result to what ``got`` holds (a rank's shard); prints every error."""
    import cupy as cp
    from gpu_util import to_f64
    from rtkernels.ops.attention import attention_reference
    from rtkernels.ops.attention_bwd import attention_backward_reference
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    bf = "bfloat16" if dtype == "bfloat16" else None
    ref_o, ref_lse = attention_reference(q, k, v, causal, scale, dtype=bf, compute="float64")
    low_o, _ = attention_reference(q, k, v, causal, scale, dtype=bf, compute="float32", round_to=dtype)
    one_o, one_lse = rtk.attention(q, k, v, causal=causal, softmax_scale=scale, **extra)
    refs = attention_backward_reference(do, q, k, v, causal, scale, dtype=bf, compute="float64")
    lows = attention_backward_reference(do, q, k, v, causal, scale, dtype=bf, compute="float32", round_to=dtype)
    ones = rtk.attention_backward(do, q, k, v, one_o, one_lse, causal=causal, softmax_scale=scale, **extra)
    cp.cuda.get_current_stream().synchronize()
    lines, failed = [], []
    for name, ref, low, one, floor in (
            ("o", ref_o, low_o, one_o, DTYPE_FLOOR[dtype]),
            ("dq", refs[0], lows[0], ones[0], DTYPE_FLOOR_BWD[dtype]),
            ("dk", refs[1], lows[1], ones[1], DTYPE_FLOOR_BWD[dtype]),
            ("dv", refs[2], lows[2], ones[2], DTYPE_FLOOR_BWD[dtype])):
        g64 = cp.asarray(to_f64(got[name], dtype))
        ref, low = part(ref, 1), part(low, 1)
        one = part(cp.asarray(to_f64(one, dtype)), 1)
        if bool(cp.isnan(g64).any()):
            failed.append(f"NaN in {name}")
            continue
        err, err_low, err_one = _rel(g64, ref), _rel(low, ref), _rel(one, ref)
        lines.append(f"{name}: ring {err:.2e}  single-GPU rtk {err_one:.2e}  reference-in-{dtype} {err_low:.2e}")
        if not (err <= 2 * err_low + floor and err <= 2 * err_one + floor):
            failed.append(lines[-1])
    lse = cp.asarray(got["lse"], cp.float64)
    ref_lse = part(ref_lse, 2)
    if bool(cp.isnan(lse).any()) or bool(cp.isneginf(lse).any()):
        failed.append("lse has NaN or -inf")
    else:
        d_lse = float((cp.abs(lse - ref_lse) / cp.maximum(cp.abs(ref_lse), 1.0)).max())
        lines.append(f"lse: max rel err {d_lse:.2e}")
        if d_lse > 1e-3:
            failed.append(lines[-1])
    print(tag + "\n  " + "\n  ".join(lines), flush=True)
    assert not failed, f"{tag}: " + "; ".join(failed)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", rd.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_ring_d128(world, layout, causal):
    # local lengths that are no multiple of any tile; GQA group of 2
    _ring_case(world, layout, causal, 128, L=74 if world == 2 else 38)


@pytest.mark.gpu
@pytest.mark.parametrize("world,layout,causal,d,L,dtype", [
    (2, "zigzag", True, 64, 300, "bfloat16"),     # several query tiles per block, half-blocks of 150 rows
    (4, "striped", True, 64, 130, "bfloat16"),
    (2, "striped", True, 192, 96, "float16"),     # d > 128: the mma.sync backward
    (4, "zigzag", False, 192, 42, "float16"),
    (2, "contiguous", True, 192, 58, "float16"),
])
def test_gpu_ring_head_dims(world, layout, causal, d, L, dtype):
    _ring_case(world, layout, causal, d, L=L, dtype=dtype)


@pytest.mark.gpu
def test_gpu_ring_strided_inputs_and_mqa():
    _ring_case(2, "striped", True, 64, L=50, H=3, Hkv=3, packed=True)   # k, v strided: copied once to send
    _ring_case(4, "zigzag", True, 128, L=34, H=4, Hkv=1)                # MQA


@pytest.mark.gpu
def test_gpu_ring_torch_tensors():
    pytest.importorskip("torch")
    _ring_case(2, "zigzag", True, 128, L=64, torch_inputs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_ring_torch_autograd_one_rank(causal):
    """rtkernels.torch.ring_attention's gradients through loss.backward(), on a one-rank ring,
    against rtk.attention's autograd on the same tensors (the multi-GPU test checks the ring's
    ranks bit for bit against the direct calls)."""
    torch = pytest.importorskip("torch")
    import rtkernels.torch as rtt
    g = torch.Generator(device="cuda").manual_seed(int(np.random.SeedSequence().entropy % 2 ** 31))
    q, k, v, do = (torch.randn(2, 77, h, 64, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 2, 2, 4))
    grads = []
    for fn in (lambda a, b, c: rtt.ring_attention(a, b, c, causal=causal, layout="striped", comm=rd.SingleComm())[0],
               lambda a, b, c: rtt.attention(a, b, c, causal=causal)[0]):
        a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
        o = fn(a, b, c)
        o.backward(do)
        grads.append((o.detach(), a.grad, b.grad, c.grad))
    for name, x, y in zip(("o", "dq", "dk", "dv"), *grads):
        err = float((x.float() - y.float()).abs().max())
        assert err <= 2e-2 * max(1.0, float(y.float().abs().max())), f"{name}: ring vs rtk.attention max diff {err}"


@pytest.mark.gpu
def test_gpu_nccl_comm_shift_to_self():
    """NcclComm.shift through a one-rank NCCL communicator (send to itself): the transfer path of
    the multi-GPU ring, on one GPU."""
    import cupy as cp
    from cupy.cuda import nccl
    if not nccl.available:
        pytest.skip("CuPy's NCCL binding is not available")
    comm = rd.NcclComm(nccl.NcclCommunicator(1, nccl.get_unique_id(), 0), 0, 1)
    x = cp.arange(1000, dtype=cp.uint16)
    y = cp.zeros(1000, cp.uint16)
    z, w = cp.arange(17, dtype=cp.float32), cp.zeros(17, cp.float32)
    stream = cp.cuda.get_current_stream()
    comm.shift([x, z], [y, w], after=stream).wait(stream)
    stream.synchronize()
    assert bool((y == x).all()) and bool((w == z).all())
