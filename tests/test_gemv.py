"""rtk.matmul's M <= 16 route: the GEMV kernel (templates/quant_gemv.cu.j2) on unquantized float16 /
bfloat16 weights, K-major (b = w.T of an nn.Linear weight) and N-major (a row-major (K, N) b).

CPU: the dense config's validation and derived values, the route decision (which calls go to the
GEMV, with which strides and load widths), the heuristic at the Llama shapes, and a compile of
the dense modes for sm_90a and sm_80 without spills (with register headroom).  GPU: every M in
{1, 2, 4, 7, 16} against float64 over awkward N / K in both layouts with every epilogue, within
twice the error of the same product accumulated in float32 (NumPy) and rounded to the dtype;
poisoned outputs; views read in place (row slices, offsets, broadcast rows, padded weight rows, a
batch folded into M); operands ending at their allocation's end; launch-plan replay and CUDA
graph replay (torch)."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import gemv
from rtkernels.ops import matmul as mm
from rtkernels.ops.gemv import QuantGemvConfig

DENSE = dict(dtype="bfloat16", weight_dtype="bfloat16")


# ---- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    (dict(dtype="float16", weight_dtype="bfloat16"), "weight_dtype"),     # a dense weight has x's dtype
    (dict(DENSE, group_size=64), "group_size"),
    (dict(DENSE, has_zeros=True), "has_zeros"),
    (dict(DENSE, w_vec=1), "w_vec"),
    (dict(weight_dtype="int8", n_major=True, row_tiles=4, unroll=1), "n_major"),
    (dict(DENSE, n_major=True, row_tiles=1), "row_tiles"),
    (dict(DENSE, n_major=True, row_tiles=4, unroll=2, x_vec=8), "x_vec"),
    (dict(DENSE, n_major=True, row_tiles=4, unroll=4, m_tiles=2, x_vec=4), "unroll"),   # ~132 registers > 128
    (dict(DENSE, n_major=True, row_tiles=4, unroll=4, x_vec=4, ctas_per_sm=3), "unroll"),  # ~112 > 80
    (dict(DENSE, n_major=True, row_tiles=4, unroll=2, m_tiles=2, num_warps=16, warps_k=16, ctas_per_sm=1,
          x_vec=4), "warps_k"),   # 15 x 2 sets of two m tiles' partial sums: 120 KiB > 64 without a cluster
    (dict(DENSE, n_major=1), "n_major"),
    (dict(DENSE, staged=True, w_vec=2), "w_vec"),                      # cp.async moves 4, 8 or 16 bytes
    (dict(DENSE, cluster=True), "cluster"),                             # split_k 1: no cluster to form
    (dict(DENSE, cluster=True, split_k=9), "cluster"),                  # portable clusters: at most 8
    (dict(DENSE, staged=True, unroll=16, ctas_per_sm=2), "unroll"),     # slots past the shared memory
    (dict(DENSE, staged=1), "staged"),
])
def test_dense_config_errors(bad, field):
    with pytest.raises(ConfigError) as e:
        QuantGemvConfig(**bad)
    assert e.value.field == field and "quant_gemv" in str(e.value), str(e.value)


def test_dense_config_derived():
    k = QuantGemvConfig(**DENSE)
    assert k.dense and (k.block_k, k.x_elems, k.loads_per_slot) == (32, 8, 2)
    q = QuantGemvConfig()
    assert not q.dense and (q.block_k, q.x_elems, q.loads_per_slot) == (64, 16, 2)
    n = QuantGemvConfig(**DENSE, n_major=True, row_tiles=4, unroll=2, x_vec=4)
    assert (n.block_k, n.x_elems, n.loads_per_slot, n.cta_rows) == (16, 4, 4, 64 * n.warps_n)
    # 2 CTAs x 8 warps x 2 slots x 4 loads x 16 B x 32 lanes
    assert n.bytes_in_flight_per_sm == 64 * 1024 and n.tag().startswith("nr4u2")
    assert n.template_params()["weight_kind_id"] == 3 and n.template_params()["n_major"] is True


LLAMA = ((4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (8192, 8192), (28672, 8192), (8192, 28672))


@pytest.mark.parametrize("n_major", [False, True])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n, k", LLAMA)
def test_dense_heuristic_llama_shapes(n, k, m, n_major):
    """Every bench shape fills 132 SMs (split-K where 64-row N-major tiles do not), keeps >= 32 KiB
    of weight requests in flight per SM and every warp's slots full, within the register cap."""
    c = gemv.heuristic_config("bfloat16", m, n, k, weight_dtype="bfloat16", n_major=n_major, sm_count=132)
    assert c.n_major == n_major and c.m_tiles == (1 if m <= 8 else 2)
    assert c.grid(n, 132)[0] * c.split_k >= 0.95 * 132, c.key()
    assert c.bytes_in_flight_per_sm >= 32 * 1024, c.key()
    assert -(-k // c.block_k) >= c.split_k * c.warps_k * c.unroll, c.key()
    assert c.registers_needed <= c.register_cap


def test_heuristic_refit():
    """The session-8 refit (H100, 2026-11-25; gemv.py's comment): quantized M <= 8 back to 8 warps
    along K at every N, M > 8 unroll 2; dense K-major M > 8 unroll 4 (4 x 4 CTAs where 16-row tiles
    fill 4 slots per SM); dense N-major 2 CTAs per SM, split-K to fill both slots."""
    h = gemv.heuristic_config
    for n, k in ((14336, 4096), (28672, 8192), (8192, 28672)):
        c1 = h("bfloat16", 1, n, k, sm_count=132)
        assert (c1.unroll, c1.num_warps, c1.warps_k, c1.ctas_per_sm) == (4, 8, 8, 2), c1.tag()
    c16 = h("bfloat16", 16, 8192, 28672, sm_count=132)
    assert (c16.unroll, c16.warps_k, c16.m_tiles) == (2, 8, 2)
    d = dict(weight_dtype="bfloat16", sm_count=132)
    assert h("bfloat16", 16, 14336, 4096, **d).tag() == "r1u4w4k4s1c4p"
    assert h("bfloat16", 16, 4096, 4096, **d).tag() == "r1u4w8k8s1c2p"
    assert h("bfloat16", 1, 14336, 4096, **d).tag() == "r1u4w8k4s1c2p"
    d8 = dict(d, sm90=False)   # the session-8 register tiling (RTKERNELS_GEMV_SM90=0, sm_80)
    assert h("bfloat16", 1, 14336, 4096, n_major=True, **d8).tag() == "nr4u2w8k8s1c2p"
    assert h("bfloat16", 16, 14336, 4096, n_major=True, **d8).tag() == "nr4u1w8k8s1c2p"
    assert h("bfloat16", 1, 4096, 4096, n_major=True, **d8).tag() == "nr4u2w8k8s4c2p"
    assert h("bfloat16", 16, 4096, 4096, n_major=True, **d8).tag() == "nr4u1w8k8s4c2p"


# sm_90 N-major, the round-2 rule (gemv._nmajor_sm90; H200 A/B of 2026-11-26), per (M = 1, 4, 16):
# w16 = one CTA of 16 warps along K per SM, fit = the session-8 CTAs with a one-wave split, s8 = as is
# (two m tiles: unroll 2, session 18)
RULE_CASES = [
    ((4096, 4096), ("nr4u4w16k16s2c1px", "nr4u4w16k16s2c1px", "nr4u2w16k16s2c1px")),     # w16 46.8 / 46.0 / 44.9
    ((4096, 14336), ("nr4u4w16k16s2c1px", "nr4u4w16k16s2c1px", "nr4u2w16k16s2c1px")),    # w16 72.8 / 72.9 / 70.3
    ((6144, 4096), ("nr4u2w8k8s2c2px", "nr4u2w8k8s2c2px", "nr4u1w8k8s2c2px")),           # fit 61.7 / 61.0 / 52.3
    ((8192, 8192), ("nr4u4w16k16s1c1p", "nr4u4w16k16s1c1p", "nr4u1w8k8s2c2px")),         # w16 79.3 / 80.1, fit 76.8
    ((8192, 28672), ("nr4u4w16k16s1c1p", "nr4u4w16k16s1c1p", "nr4u1w8k8s2c2px")),        # w16 94.2 / 95.0, fit 87.9
    ((14336, 4096), ("nr4u2w8k8s1c2p", "nr4u2w8k8s1c2p", "nr4u2w8k8s1c2p")),             # s8 81.1 / 80.9; M16 u2 84.9
    ((28672, 8192), ("nr4u2w8k8s1c2p", "nr4u2w8k8s1c2p", "nr4u2w8k8s1c2p")),             # s8 91.5 / 91.6; M16 u2 88.6
    ((1000, 4096), ("nr4u4w16k16s8c1px", "nr4u4w16k16s8c1px", "nr4u2w16k16s8c1px")),     # 16 tiles x 8: 128 CTAs
    ((4096, 512), ("nr4u2w8k8s2c2px", "nr4u2w8k8s2c2px", "nr4u1w8k8s2c2px")),            # K too short for w16's split
    ((5000, 3000), ("nr4u2w8k8s3c2px", "nr4u2w8k8s3c2px", "nr4u1w8k8s3c2px")),           # 79 tiles: w16 fills 60%
    ((7, 9), ("nr4u4w16k16s1c1p", "nr4u4w16k16s1c1p", "nr4u1w8k8s1c2p")),                # one tile, one block
]


@pytest.mark.parametrize("nk, tags", RULE_CASES, ids=[f"{c[0][0]}x{c[0][1]}" for c in RULE_CASES])
def test_nmajor_sm90_rule(nk, tags):
    """The rule picks the measured winner of each class (w16 where one CTA per SM fills the SMs, fit
    where it does not or two m tiles would not split, s8 where the tiles outnumber the SMs), within
    the register estimate and the shared memory; a cluster needs no workspace; no staged slots."""
    n, k = nk
    d = dict(weight_dtype="bfloat16", n_major=True, x_vec=4, sm_count=132)
    for m, tag in zip((1, 4, 16), tags):
        c = gemv.heuristic_config("bfloat16", m, n, k, sm90=True, **d)
        s8 = gemv.heuristic_config("bfloat16", m, n, k, sm90=False, **d)
        assert c.tag() == tag, (n, k, m, c.tag(), tag)
        assert not c.staged and c.registers_needed <= c.register_cap, c.tag()
        assert c.ctas_per_sm * (c.shared_mem_bytes + 1024) <= 228 * 1024, c.tag()
        if c.cluster:
            assert gemv.workspace_bytes(c, m, n) == (0, 0), c.tag()
        if c.tiles(n) > 132:   # s8 (with unroll 2 at two m tiles)
            assert c == (s8.replace(unroll=2) if m > 8 else s8), (c.tag(), s8.tag())
        else:   # one wave: every CTA resident at once
            assert c.tiles(n) * c.split_k <= 132 * c.ctas_per_sm, c.tag()
    # the same rule over other SM counts: H100 PCIe (114 SMs) at 8192 wide: 128 tiles outnumber them
    c = gemv.heuristic_config("bfloat16", 1, 8192, 8192, sm90=True, **dict(d, sm_count=114))
    assert c.tag() == "nr4u2w8k8s1c2p", c.tag()


# ---- the route ---------------------------------------------------------------------------------------
def _route(m, n, k, *, batch=1, a_kmajor=True, b_kmajor=True, lda=None, ldb=None, ldc=None, batch_a=0,
           batch_b=0, batch_c=0, a_ptr=256, b_ptr=256, dtype="bfloat16"):
    lda = k if lda is None else lda
    ldb = (k if b_kmajor else n) if ldb is None else ldb
    ldc = n if ldc is None else ldc
    return mm._plan_gemv(dtype, m, n, k, batch, a_ptr, b_ptr, a_kmajor, b_kmajor, lda, ldb, ldc, batch_a, batch_b,
                         batch_c, False, "none", 132)


def test_route_decision():
    cfg, ints = _route(1, 4096, 4096)                              # x @ w.T
    assert not cfg.n_major and cfg.dense and (cfg.w_vec, cfg.x_vec) == (16, 8)
    assert ints == (1, 4096, 4096, 4096, 0, 0, 0)            # (one row: no row strides)
    cfg, ints = _route(16, 4096, 4096, b_kmajor=False)             # x @ b, b (K, N) row-major
    assert cfg.n_major and cfg.row_tiles == 4 and cfg.x_vec == 4 and ints[3] == 4096
    # the batch folds into M: (2, 8, K) @ (K, N) -> 16 rows one stride apart
    cfg, ints = _route(8, 4096, 4096, batch=2, batch_a=8 * 4096, batch_c=8 * 4096)
    assert ints[0] == 16 and ints[4] == 4096 and ints[5] == 4096
    cfg, ints = _route(1, 4096, 4096, batch=3, batch_a=5000, batch_c=4096)   # one row per batch: its stride
    assert ints[0] == 3 and ints[4] == 5000
    # widths follow K, strides and bases
    assert _route(1, 4100, 4097)[0].w_vec == 2
    assert _route(4, 4096, 4096, b_ptr=258)[0].w_vec == 2
    assert _route(4, 4096, 4096, a_ptr=264)[0].x_vec == 4
    assert _route(4, 4100, 4096, b_kmajor=False)[0].w_vec == 8      # N-major rows of 8200 bytes
    assert _route(4, 64, 4096, lda=0)[1][4] == 0                     # broadcast rows of x
    assert _route(16, 7, 9, b_kmajor=False, ldb=0)[1][3] == 0       # one k row for every k
    # left to the tile kernels
    assert _route(17, 4096, 4096) is None
    assert _route(9, 4096, 4096, batch=2, batch_a=9 * 4096, batch_c=9 * 4096) is None
    assert _route(8, 4096, 4096, batch=2, batch_a=9000, batch_c=8 * 4096) is None   # batches not one stride
    assert _route(1, 4096, 4096, batch=2, batch_b=4096 * 4096, batch_a=4096, batch_c=4096) is None   # batched b
    assert _route(4, 4096, 4096, a_kmajor=False, lda=4) is None     # A column-major
    assert _route(4, 4096, 0) is None
    assert _route(4, 64, 64, dtype="float32") is None


def test_route_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(mm, "USE_GEMV", False)
    assert _route(1, 4096, 4096) is None


# ---- a NumPy model of the dense fragment layouts (templates/quant_gemv.cu.j2) ----------------------------
def _mma(a_regs, b_regs):
    """mma.sync m16n8k16 of one warp on (lane -> 4 A registers, lane -> 2 B registers), each register
    a pair (lo, hi) of values, as the PTX ISA lays the fragments out; returns D (16 x 8)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for r, (row, col) in enumerate(((g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8))):
            A[row, col:col + 2] = a_regs[lane][r]
        for r, krow in enumerate((2 * q, 2 * q + 8)):
            B[krow:krow + 2, g] = b_regs[lane][r]
    return A @ B


def _pair_words(v):
    """Consecutive values as packed pairs (a 16-byte load of 8 elements: 4 words)."""
    return [tuple(v[i:i + 2]) for i in range(0, len(v), 2)]


def _prmt_pairs(lo_word, hi_word, high):
    """prmt 0x5410 (low halves of two words) / 0x7632 (high halves) on pairs."""
    return (lo_word[1], hi_word[1]) if high else (lo_word[0], hi_word[0])


@pytest.mark.parametrize("n_major", [False, True])
def test_dense_fragment_layout_model(n_major):
    """One item of one warp, as the kernel loads and feeds it (8 x rows, all lanes): the
    accumulators, read back through the epilogue's row map (out_row), equal w @ x^T."""
    rng = np.random.default_rng(3)
    rows, kk = (64, 16) if n_major else (16, 32)        # a warp's rows and an item's K
    w = rng.standard_normal((rows, kk))                  # w[n, k]
    x = rng.standard_normal((8, kk))
    want = w @ x.T                                       # (rows, 8)
    got = np.full((rows, 8), np.nan)
    if n_major:
        # lane (g, q): 4 loads of 8 n (8g .. 8g + 7) at k rows 4q + i; x elements 4q .. 4q + 3 of row g
        loads = {lane: [_pair_words(w[8 * (lane // 4):8 * (lane // 4) + 8, 4 * (lane % 4) + i]) for i in range(4)]
                 for lane in range(32)}
        xf = {lane: _pair_words(x[lane // 4, 4 * (lane % 4):4 * (lane % 4) + 4]) for lane in range(32)}
        for r in range(4):
            a = {ln: [_prmt_pairs(loads[ln][0][r], loads[ln][1][r], False),
                      _prmt_pairs(loads[ln][0][r], loads[ln][1][r], True),
                      _prmt_pairs(loads[ln][2][r], loads[ln][3][r], False),
                      _prmt_pairs(loads[ln][2][r], loads[ln][3][r], True)] for ln in range(32)}
            d = _mma(a, {ln: [xf[ln][0], xf[ln][1]] for ln in range(32)})
            for g in range(8):
                for h in range(2):
                    got[8 * g + 2 * r + h] = d[g + 8 * h]       # out_row: r0 + 8g + 2r + h
    else:
        # lane (g, q): rows g and g + 8, elements 8q .. 8q + 7 (one 16-byte load each); x the same 8 of row g
        acc = np.zeros((16, 8))
        wl = {lane: [_pair_words(w[lane // 4 + 8 * h, 8 * (lane % 4):8 * (lane % 4) + 8]) for h in range(2)]
              for lane in range(32)}
        xl = {lane: _pair_words(x[lane // 4, 8 * (lane % 4):8 * (lane % 4) + 8]) for lane in range(32)}
        for st in range(2):
            a = {ln: [wl[ln][0][2 * st], wl[ln][1][2 * st], wl[ln][0][2 * st + 1], wl[ln][1][2 * st + 1]]
                 for ln in range(32)}
            acc += _mma(a, {ln: [xl[ln][2 * st], xl[ln][2 * st + 1]] for ln in range(32)})
        got = acc                                         # out_row: r0 + 16r + g + 8h
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# ---- compile: the dense modes, no spills, register headroom, sm_90a and sm_80 ----------------------------
HEADROOM = 16   # as tests/test_quant_matmul.py: an NVRTC needing up to ~12% more registers still fits


@pytest.fixture(scope="module")
def dense_kernels():
    import rtkernels as rtk
    h = gemv.heuristic_config
    cfgs = [h("bfloat16", 1, 4096, 4096, weight_dtype="bfloat16", sm_count=132),
            h("float16", 16, 14336, 4096, weight_dtype="float16", n_major=True, has_bias=True, activation="silu",
              sm_count=132, sm90=False),
            # two m tiles at unroll 4 (4 x 4 CTAs); N-major split-K (the last arriver's epilogue)
            h("bfloat16", 16, 14336, 4096, weight_dtype="bfloat16", has_bias=True, activation="gelu", sm_count=132),
            h("bfloat16", 1, 4096, 4096, weight_dtype="bfloat16", n_major=True, has_bias=True, sm_count=132,
              sm90=False)]
    assert cfgs[2].unroll == 4 and cfgs[2].m_tiles == 2 and cfgs[3].split_k > 1
    # N-major split-K with two m tiles: 124 registers of 128 (NVRTC 13.5), 20 bytes of spill under
    # the headroom cap of 112, so it is checked at its own cap only (the GPU host's NVRTC runs this too)
    tight = h("bfloat16", 16, 4096, 4096, weight_dtype="bfloat16", n_major=True, has_bias=True, activation="silu",
              sm_count=132, sm90=False)
    assert tight.split_k > 1 and tight.m_tiles == 2
    # sm_90, the N-major rule's picks: w16 (16 warps along K, one CTA per SM) with a cluster split at
    # both m tile counts, without a split (fp16, gelu), with 2-byte weight and x loads (N, K odd);
    # fit (the session-8 CTAs, a cluster split) at both m tile counts.  w16 has 128 registers of
    # 128 and spills under 112 (gemv.py's notes): checked at its own cap only, as `tight`
    sm90 = [h("bfloat16", m, 4096, 4096, weight_dtype="bfloat16", n_major=True, has_bias=True, activation="gelu",
              sm_count=132, sm90=True) for m in (1, 16)]
    sm90 += [h("float16", 4, 8192, 8192, weight_dtype="float16", n_major=True, has_bias=True, activation="gelu",
               sm_count=132, sm90=True),
             h("float16", 4, 4099, 4097, weight_dtype="float16", n_major=True, has_bias=True, activation="silu",
               w_vec=2, x_vec=1, sm_count=132, sm90=True)]
    sm90 += [h("bfloat16", m, 6144, 4096, weight_dtype="bfloat16", n_major=True, has_bias=True, activation="silu",
               sm_count=132, sm90=True) for m in (1, 16)]
    assert [c.num_warps for c in sm90] == [16, 16, 16, 16, 8, 8] and not any(c.staged for c in sm90)
    assert [c.cluster for c in sm90] == [True, True, False, True, True, True]
    jobs = [(c, "sm_90a") for c in cfgs + [tight] + sm90] + [(c, "sm_80") for c in cfgs]
    jobs.append((sm90[1].replace(cluster=False, split_k=1, staged=True, unroll=3), "sm_80"))
    jobs += [(c.replace(max_registers=c.register_cap - HEADROOM), "sm_90a") for c in cfgs]
    with ThreadPoolExecutor(2) as ex:
        kerns = list(ex.map(lambda j: rtk.get_kernel(j[0], "quant_gemv", arch=j[1]), jobs))
    return list(zip(jobs, kerns))


def test_dense_modes_compile_clean(dense_kernels):
    from rtkernels.inspect import sass_stats
    for (cfg, arch), kern in dense_kernels:
        r = kern.resources
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, (arch, cfg.key(), r)
        assert r.registers <= cfg.register_cap, (arch, cfg.key(), r)
        s = sass_stats(kern.sass)
        # every slot's MMAs (k16 steps x row tiles x m tiles) are there, unrolled
        steps = cfg.block_k // 16
        assert s["hmma"] >= steps * cfg.row_tiles * cfg.m_tiles * cfg.unroll, (arch, cfg.key(), s["hmma"])
        # the slots' weight loads (prologue and refill) and the x loads, 16 bytes wide (x: 8 bytes N-major);
        # staged: 16-byte cp.async copies (LDGSTS) and the slot's 16-byte reads back
        if cfg.staged:
            assert s["ldgsts"] >= 2 * cfg.loads_per_slot * cfg.unroll, (arch, cfg.key(), s["ldgsts"])
            assert s["lds"] >= cfg.loads_per_slot * cfg.unroll, (arch, cfg.key(), s["lds"])
        elif cfg.w_vec == 16:   # (narrower loads: the unaligned fallback, its spills checked above)
            assert s["ldg_128"] >= 2 * cfg.loads_per_slot * cfg.unroll, (arch, cfg.key(), s["ldg_128"])


# ---- GPU ---------------------------------------------------------------------------------------------
def _weights(rng, n, k, dtype, n_major):
    """(b for rtk.matmul, float64 (K, N) values): w.T of an (N, K) array, or a row-major (K, N)."""
    from gpu_util import random_array
    if n_major:
        b, b64 = random_array(rng, (k, n), dtype)
        return b, b64
    w, w64 = random_array(rng, (n, k), dtype)
    return w.T, w64.T


def _peer(a64, b64, bias64, act, dtype):
    """The same product accumulated in float32 (NumPy) and rounded to the dtype."""
    from gpu_util import bf16_bits_from_f32, f32_from_bf16_bits
    lin = np.matmul(a64.astype(np.float32), b64.astype(np.float32), dtype=np.float32)
    if bias64 is not None:
        lin = lin + bias64.astype(np.float32)
    p = mm._act_np(lin.astype(np.float64), act).astype(np.float32)
    return (f32_from_bf16_bits(bf16_bits_from_f32(p)) if dtype == "bfloat16" else p.astype(dtype)).astype(np.float64)


def _check(got_dev, a64, b64, bias64, act, dtype, what):
    from gpu_util import to_f64
    got = got_dev if isinstance(got_dev, np.ndarray) else to_f64(got_dev, dtype)
    ref = mm.matmul_reference(a64, b64, bias=bias64, activation=act)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{what}: output not fully written (NaN poison left)"
    peer = _peer(a64, b64, bias64, act, dtype)
    err, peer_err = np.abs(got - ref).max(), np.abs(peer - ref).max()
    scale = max(np.abs(ref).max(), 1.0)
    assert err <= 2 * peer_err + 1e-6 * scale, \
        f"{what}: max error {err:.3g} at {np.unravel_index(np.argmax(np.abs(got - ref)), got.shape)} vs " \
        f"{peer_err:.3g} (float32 product rounded to {dtype}); max |ref| {np.abs(ref).max():.3g}"


@pytest.fixture
def launches(monkeypatch):
    """The GEMV configs rtk.matmul launches during a test (gemv.launch recorded); a fresh plan store."""
    from rtkernels.ops._arrays import LaunchPlans
    seen = []
    real = gemv.launch

    def spy(cfg, *args, **kwargs):
        seen.append(cfg)
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(gemv, "launch", spy)
    monkeypatch.setattr(mm, "_LAUNCHES", LaunchPlans())
    return seen


MS = (1, 2, 4, 7, 16)
# (sm_90 N-major: w16 at 4096^2 and 4100 x 4097, and at M <= 8 of (7, 9) / (129, 72) (M = 16 there:
# the session-8 CTAs); fit at (6000, 1000), 94 tiles; the session-8 tiling at (9000, 264), 141 tiles)
NK = ((4096, 4096), (4100, 4097), (7, 9), (1, 129), (129, 72), (6000, 1000), (9000, 264))
EPILOGUES = ((False, None), (True, None), (True, "gelu"), (False, "relu"), (True, "silu"))
CASES = [(m, n, k, i, j) for i, m in enumerate(MS) for j, (n, k) in enumerate(NK)]


def _case_params(m, n, k, i, j):
    dtype = "bfloat16" if (i + j) % 2 else "float16"
    has_bias, act = EPILOGUES[(i + 2 * j) % len(EPILOGUES)]
    return dtype, has_bias, act


@pytest.fixture(scope="module")
def prebuilt():
    """The cases' kernels compiled up front in parallel (NVRTC releases the GIL): the route's own
    configs for contiguous operands at 256-byte aligned bases, as the GPU cases allocate them."""
    from rtkernels import device
    from rtkernels.kernel import get_kernel
    if not device.has_gpu():
        pytest.skip("needs a GPU")
    sms = device.sm_count()
    jobs = set()
    for m, n, k, i, j in CASES:
        dtype, has_bias, act = _case_params(m, n, k, i, j)
        for n_major in (False, True):
            nm = n_major and n > 1   # a row-major (K, 1) b is K-major too
            cfg, _ = mm._plan_gemv(dtype, m, n, k, 1, 256, 256, True, not nm, k, n if nm else k, n, 0, 0, 0,
                                   has_bias, act or "none", sms)
            jobs.add((cfg, "quant_gemv"))
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda jb: get_kernel(*jb).cubin, jobs))
    return len(jobs)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, i, j", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}" for c in CASES])
def test_gemv_gpu(prebuilt, launches, m, n, k, i, j):
    """Both weight layouts at this M, N, K (dtype and epilogue vary with the case), against float64."""
    import cupy as cp
    from gpu_util import poison, random_array
    import rtkernels as rtk
    dtype, has_bias, act = _case_params(m, n, k, i, j)
    rng = np.random.default_rng(1000 * m + 7 * n + k)
    a, a64 = random_array(rng, (m, k), dtype)
    bias, bias64 = random_array(rng, (n,), dtype) if has_bias else (None, None)
    for n_major in (False, True):
        b, b64 = _weights(rng, n, k, dtype, n_major)
        out = poison(cp.empty((m, n), dtype=a.dtype))
        rtk.matmul(a, b, bias=bias, activation=act, out=out, dtype="bfloat16" if dtype == "bfloat16" else None)
        cfg = launches[-1] if launches else None
        what = f"M={m} N={n} K={k} {dtype} {'N' if n_major else 'K'}-major bias={has_bias} act={act} " \
               f"({cfg.tag() if cfg else 'no GEMV'} w_vec={cfg and cfg.w_vec} x_vec={cfg and cfg.x_vec})"
        assert cfg is not None, f"{what}: the GEMV route did not run"
        assert cfg.n_major == (n_major and n > 1), f"{what}: the other layout ran"   # (K, 1) row-major is K-major
        _check(out, a64, b64, bias64, act, dtype, what)
        launches.clear()


# the sm_90 options against the session-8 path of the same tiling: (M, N, K, n_major, split)
# (N = 7 N-major: rows of 14 bytes, 2-byte loads, no cp.async: the cluster split alone)
VARIANT_CASES = [(1, 4100, 4097, True, 4), (7, 132, 1032, True, 8), (16, 1000, 4096, True, 3),
                 (16, 7, 9, True, 2), (1, 129, 4096, False, 5), (16, 1000, 1032, False, 2), (4, 4096, 4096, True, 4),
                 (9, 4104, 72, False, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, n_major, split", VARIANT_CASES,
                         ids=[f"{c[0]}x{c[1]}x{c[2]}{'N' if c[3] else 'K'}s{c[4]}" for c in VARIANT_CASES])
def test_staged_and_cluster_variants_gpu(m, n, k, n_major, split):
    """Staged slots (cp.async into shared memory) and the cluster split-K (DSMEM sums) give the
    bits of the register slots and the global-memory split of the same tiling (same MMAs, the
    same split-order sums), within twice the float32 product's error of float64; poisoned outputs,
    padded groups (K slices shorter than the slots), rows past N and K tails; graph-free (no
    workspace) so two runs must match too."""
    import cupy as cp
    from gpu_util import poison, random_array
    from rtkernels import device
    if not device.current_arch().startswith("sm_9"):
        pytest.skip("clusters need sm_90")
    dtype = "bfloat16" if (m + n) % 2 else "float16"
    rng = np.random.default_rng(77 * m + n + k)
    a, a64 = random_array(rng, (m, k), dtype)
    bias, bias64 = random_array(rng, (n,), dtype)
    b, b64 = _weights(rng, n, k, dtype, n_major)
    wt = b if n_major else b.T          # the stored weight: (K, N) or (N, K), contiguous
    route, ints = mm._plan_gemv(dtype, m, n, k, 1, a.data.ptr, wt.data.ptr, True, not n_major, k,
                                n if n_major else k, n, 0, 0, 0, True, "silu", device.sm_count())
    # the session-8 tiling of the same load widths (the sm_90 N-major rule may pick 16 warps)
    base = gemv.heuristic_config(dtype, m, n, k, weight_dtype=dtype, has_bias=True, activation="silu",
                                 n_major=n_major, w_vec=route.w_vec, x_vec=route.x_vec, sm_count=device.sm_count(),
                                 sm90=False)
    ref_cfg = base.replace(staged=False, cluster=False, split_k=split,
                           unroll=min(base.unroll, 2 if base.m_tiles == 1 or not n_major else 1))
    variants = [ref_cfg, ref_cfg.replace(cluster=True)]
    assert (base.w_vec >= 4) == (n >= 8), base.tag()
    if base.w_vec >= 4:
        variants += [base.replace(staged=True, cluster=False, split_k=split),
                     base.replace(staged=True, cluster=True, split_k=split),
                     base.replace(staged=True, cluster=False, split_k=1, unroll=2)]
    # the A/B's candidates: twice the register slots under an explicit cap of 128 (bench --nmajor-ab "u4"),
    # and the sm_90 rule's 16 warps along K (w16) at this split as a cluster
    if n_major:
        variants.append(ref_cfg.replace(cluster=True, unroll=4 if base.m_tiles == 1 else 2, max_registers=128))
        variants.append(ref_cfg.replace(cluster=True, num_warps=16, warps_k=16, ctas_per_sm=1,
                                        unroll=4 if base.m_tiles == 1 else 2))
    variants.append(route)   # the route's own config (its split may differ: checked against float64 only)
    outs = []
    for cfg in variants:
        for _ in range(2):
            out = poison(cp.empty((m, n), dtype=a.dtype))
            gemv.launch(cfg, ints, (wt, a, None, None, bias, out), (wt, a, None, None, bias, out), None)
            outs.append((cfg, out))
        what = f"M={m} N={n} K={k} {dtype} {'N' if n_major else 'K'}-major {cfg.tag()} w_vec={cfg.w_vec}"
        assert cp.array_equal(outs[-2][1], outs[-1][1]), f"{what}: two runs differ"
        _check(out, a64, b64, bias64, "silu", dtype, what)
    for cfg, out in outs[2:]:   # the same split and warps along K, the same order of sums: the same bits
        if cfg.split_k != split or cfg.warps_k != ref_cfg.warps_k:
            continue
        diff = int(cp.count_nonzero(out.view(cp.uint16) != outs[0][1].view(cp.uint16)))
        assert diff == 0, f"M={m} N={n} K={k}: {cfg.tag()} differs from {ref_cfg.tag()} in {diff} outputs"


@pytest.mark.gpu
def test_gemv_views_gpu(launches):
    """Views read in place, as rtk.matmul takes them: x row slices at an offset, broadcast x rows,
    weight rows padded (a slice of a wider weight), an N-major b that is a column slice at an odd
    offset, weights broadcast along N or K, a batch folded into M, out a column slice of a wider
    poisoned array (its other columns untouched); and an A in column-major storage, which goes to
    the tile kernels."""
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    rng = np.random.default_rng(26)
    dt = "float16"
    n, k = 1000, 1032
    xb, xb64 = random_array(rng, (12, k + 24), dt)
    wb, wb64 = random_array(rng, (n, k + 8), dt)            # K-major rows padded to K + 8
    bb, bb64 = random_array(rng, (k, n + 12), dt)           # N-major rows of N + 12
    bias, bias64 = random_array(rng, (n,), dt)
    cases = [
        ("x row slice at +8, padded weight rows", xb[:, 8:8 + k], xb64[:, 8:8 + k], wb[:, :k].T, wb64[:, :k].T, True),
        ("x[:1] broadcast to 12 rows, N-major column slice at +3", cp.broadcast_to(xb[:1, :k], (12, k)),
         np.broadcast_to(xb64[:1, :k], (12, k)), bb[:, 3:3 + n], bb64[:, 3:3 + n], True),
        ("weight broadcast along N (one row of K)", xb[:5, :k], xb64[:5, :k],
         cp.broadcast_to(wb[:1, :k].T, (k, n)), np.broadcast_to(wb64[:1, :k].T, (k, n)), True),
        ("weight broadcast along K (one row of N)", xb[:5, :k], xb64[:5, :k],
         cp.broadcast_to(bb[:1, :n], (k, n)), np.broadcast_to(bb64[:1, :n], (k, n)), True),
        ("A stored column-major (a.T of (K, M))", xb[:, :k].T.copy().T, xb64[:, :k], wb[:, :k].T, wb64[:, :k].T, False),
    ]
    for what, a, a64, b, b64, via_gemv in cases:
        m = a.shape[0]
        full = poison(cp.empty((m, n + 9), dtype=cp.float16))
        launches.clear()
        rtk.matmul(a, b, bias=bias, activation="gelu", out=full[:, 5:5 + n])
        assert bool(launches) == via_gemv, f"{what}: GEMV route {'not ' if via_gemv else ''}taken"
        _check(full[:, 5:5 + n], a64, b64, bias64, "gelu", dt, what)
        rest = to_f64(full, dt)
        assert np.isnan(rest[:, :5]).all() and np.isnan(rest[:, 5 + n:]).all(), f"{what}: columns past out written"
    # a batch of 2 x 8 rows folded into 16, out batched; 3 batches of one row (their batch stride)
    for shape in ((2, 8, k), (3, 1, k)):
        x3, x364 = random_array(rng, shape, dt)
        launches.clear()
        y = rtk.matmul(x3, bb[:, :n])
        assert launches and launches[-1].m_tiles == (2 if shape[0] * shape[1] > 8 else 1), shape
        assert y.shape == (shape[0], shape[1], n)
        _check(y.reshape(-1, n), x364.reshape(-1, k), bb64[:, :n], None, None, dt, f"batched {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # (label, dtype, M, N, K, a row stride, b stored row stride, trans_b)
    ("bf16 1x1x1", "bfloat16", 1, 1, 1, 1, 1, False),
    ("f16 1x70x13 B^T rows of 16", "float16", 1, 70, 13, 13, 16, True),
    ("bf16 7x9x7 N-major rows of 9", "bfloat16", 7, 9, 7, 7, 9, False),
    ("f16 16x33x130 K-major rows of 131, A rows of 133", "float16", 16, 33, 130, 133, 131, True),
], ids=lambda c: c[0])
def test_gemv_rows_end_at_allocation_end_gpu(launches, case):
    """Operands ending exactly where their exact-size allocations end (compute-sanitizer memcheck
    reports any read past them): narrow loads on the last chunk of every row, nothing past it."""
    import cupy as cp
    from gpu_util import poison, view_at_allocation_end
    import rtkernels as rtk
    label, dt, m, n, k, lda, ldb, tb = case
    rng = np.random.default_rng(m * n + k)
    a, a64 = view_at_allocation_end(rng, (m, k), (lda if m > 1 else 0, 1), dt)
    rows, cols = (n, k) if tb else (k, n)
    b, b64 = view_at_allocation_end(rng, (rows, cols), (ldb if rows > 1 else 0, 1), dt)
    bias, bias64 = view_at_allocation_end(rng, (n,), (1,), dt)
    out = poison(cp.empty((m, n), dtype=cp.uint16 if dt == "bfloat16" else dt))
    rtk.matmul(a, b, bias=bias, activation="relu", out=out, trans_b=tb, dtype="bfloat16" if dt == "bfloat16" else None)
    cp.cuda.Device().synchronize()
    assert launches, f"{label}: the GEMV route did not run"
    assert min(n, k) == 1 or launches[-1].n_major == (not tb), label
    _check(out, a64, b64.T if tb else b64, bias64, "relu", dt, f"{label} ({launches[-1].tag()})")


@pytest.mark.gpu
@pytest.mark.parametrize("n_major", [False, True])
def test_gemv_plan_replay_and_cuda_graph_gpu(n_major):
    """torch: the second call replays the recorded plan (bit-identical); a CUDA graph captured around
    the call replays on new x values (N = 129: split-K, its workspace from torch's allocator)."""
    torch = pytest.importorskip("torch")
    import rtkernels as rtk
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(5)
    for m, n, k in ((4, 4096, 4096), (16, 129, 4096)):
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, generator=g, dtype=torch.bfloat16) if n_major else w.T
        bias = torch.randn(n, device=dev, generator=g, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
        y1 = rtk.matmul(x, b, bias=bias, activation="silu")
        plans = len(mm._LAUNCHES)
        y2 = rtk.matmul(x, b, bias=bias, activation="silu")
        assert len(mm._LAUNCHES) == plans and torch.equal(y1, y2), (m, n, k, n_major)
        cfg = gemv.heuristic_config("bfloat16", m, n, k, weight_dtype="bfloat16", n_major=n_major)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                rtk.matmul(x, b, bias=bias, activation="silu")
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg = rtk.matmul(x, b, bias=bias, activation="silu")
        x.copy_(torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        first = yg.clone()
        for _ in range(3):   # split-K: the counters the last arrivers reset serve every replay
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(first, yg), f"graph replays differ M={m} N={n} K={k} n_major={n_major}"
        a64, b64 = x.double().cpu().numpy(), b.double().cpu().numpy()
        _check(yg.double().cpu().numpy(), a64, b64, bias.double().cpu().numpy(), "silu", "bfloat16",
               f"graph replay M={m} N={n} K={k} {'N' if n_major else 'K'}-major ({cfg.tag()})")


FUZZ_CASES = 40


@pytest.mark.gpu
@pytest.mark.parametrize("libname", ["torch", "cupy"])
def test_gemv_views_fuzz_gpu(libname):
    """The view fuzzer of tests/test_views_gpu.py (random chains of expand / permute / step /
    narrow / overlap / flip, its checks and its summary line) on rtk.matmul calls with 1, 3 or 16
    rows of C: views the GEMV route reads in place, those it leaves to the tile kernels and those
    staged first must all give the answer of the contiguous copies, aliased outputs a clear error."""
    import test_views_gpu as vf
    import rtkernels as rtk
    lib = vf._need_gpu_libs(libname)
    rng = vf._rng("matmul_gemv", libname)
    tally = vf.Tally("matmul (M <= 16)", libname)
    dt = "bfloat16"
    for _ in range(FUZZ_CASES):
        m, n, k = int(rng.choice((1, 3, 16))), int(rng.choice((40, 72))), 64
        tb = bool(rng.random() < 0.5)
        a, da = vf.make(lib, rng, (m, k), dt, scale=0.5)
        b, db = vf.make(lib, rng, (n, k) if tb else (k, n), dt, scale=0.5)
        kw = dict(trans_b=tb)
        desc = f"M={m}: a {da} strides {lib.strides(a)}; b {db} strides {lib.strides(b)}; trans_b={tb}"
        if rng.random() < 0.3:
            bias, dbias = vf.make(lib, rng, (n,), dt)
            kw.update(bias=bias, activation="silu")
            desc += f"; bias {dbias}"
        expect, out = "ok", None
        if rng.random() < 0.25:
            modes = ("contiguous", "slice", "expand") + (("overlap",) if m > 1 else ())   # (one row cannot overlap)
            out, mode, expect = vf.out_view(lib, rng, (m, n), dt, modes)
            desc += f"; out {mode} strides {lib.strides(out)}"
        extra = lib.kw(dt)
        ref_kw = {key: (lib.contiguous(v) if key == "bias" else v) for key, v in kw.items()}
        tally.run(desc, expect, ("a", "b", "bias", "out"),
                  lambda: rtk.matmul(a, b, out=out, **kw, **extra),
                  lambda: rtk.matmul(lib.contiguous(a), lib.contiguous(b), **ref_kw, **extra),
                  vf.close(lib, dt, "c"))
    tally.report()
