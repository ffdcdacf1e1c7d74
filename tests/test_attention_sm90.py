"""attention_sm90: the Hopper forward (TMA + wgmma + warp specialization) behind rtk.attention on sm_90.

CPU: config validation, heuristics, every chosen config compiles for sm_90a without spills or
local memory and its SASS holds HGMMA / UTMALDG / UTMASTG; NumPy models of the consumer loop's
GEMM/softmax order (the delayed O rescale of the overlapped pipeline) and of the shared-memory
layouts the tensor maps write and the wgmma descriptors read.
GPU (``-m gpu``, sm_90 only): the forward's reference and 2x error rule (tests/test_attention.py)
over every head dim, ragged and causal seqlens, GQA/MQA, strided views, poisoned outputs, and
the fall-backs to the mma.sync kernel.
"""
from __future__ import annotations

import importlib
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels import inspect as rtk_inspect
from rtkernels.errors import ConfigError
from rtkernels.ops import attention_sm90 as A90
from rtkernels.ops.attention_sm90 import AttentionSm90Config
from rtkernels.ops._arrays import LaunchPlans

import test_attention as fwd_tests   # the forward's shape grids (tests/ is on sys.path)

attn_mod = importlib.import_module("rtkernels.ops.attention")
HEAD_DIMS = list(range(8, 257, 8))
DTYPES = ("float16", "bfloat16")


# ---- config -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(head_dim=7), dict(head_dim=264), dict(dtype="float32"), dict(block_m=96), dict(block_m=256),
    dict(block_n=24), dict(block_n=272), dict(num_stages=1), dict(num_stages=4), dict(intra_overlap="yes"),
    dict(pingpong="on"), dict(block_m=64, pingpong=True),
    dict(head_dim=256, block_n=128),                      # 64 KiB Q + 256 KiB K/V: no fit
    dict(head_dim=192, block_m=192, block_n=128),
])
def test_config_rejects(bad):
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(**bad)
    field = "block_n" if "head_dim" in bad and len(bad) > 1 else ("pingpong" if "pingpong" in bad else next(iter(bad)))
    assert "attention_sm90" in str(e.value) and field in str(e.value)


def test_config_derived_values():
    c = AttentionSm90Config(dtype="bf16", head_dim=80, block_m=128, block_n=128)
    assert c.dtype == "bfloat16" and c.d_blocks == 2 and c.consumers == 2 and c.threads_per_block == 384
    # Q 128 x 2 blocks x 128 B + 2 stages x (K + V) 128 x 2 x 128 B + 9 barriers + 1 KiB slack
    assert c.shared_mem_bytes == 128 * 2 * 128 + 2 * 2 * 128 * 2 * 128 + 8 * 9 + 1024
    assert c.template_params()["consumer_regs"] == 240 and c.template_params()["producer_regs"] == 24
    p, q = AttentionSm90Config(head_dim=64, block_m=192).register_split
    assert 128 * p + 384 * q <= 65536
    assert rtk.families()["attention_sm90"] is AttentionSm90Config and AttentionSm90Config.needs_arch_specific


def test_heuristics_cover_every_head_dim_and_fit():
    for d in HEAD_DIMS:
        for causal in (False, True):
            cfg = A90.choose_config("float16", d, causal)
            assert cfg.shared_mem_bytes <= A90.SMEM_LIMIT_SM90 and cfg.head_dim == d
    assert all(t.why for _lo, _hi, _c, t in A90.HEURISTICS)
    for causal in (False, True):
        spans = sorted((lo, hi) for lo, hi, c, _ in A90.HEURISTICS if c in (None, causal))
        assert spans[0][0] == 8 and spans[-1][1] == 256 and all(a[1] + 8 == b[0] for a, b in zip(spans, spans[1:]))
    with pytest.raises(ConfigError):
        A90.candidate(264, False)
    space = A90.tile_space("bfloat16", 96, True)
    assert space[0] == A90.choose_config("bfloat16", 96, True) and len(set(space)) == len(space) > 4


def test_template_renders_constexpr_block():
    from rtkernels.render import render
    cfg = AttentionSm90Config(dtype="bfloat16", head_dim=40, causal=True, block_m=64, block_n=64)
    src = render(cfg.template, cfg.template_params(), family="attention_sm90").source
    for line in ("using T = __nv_bfloat16;", "constexpr int HEAD_DIM = 40;", "constexpr bool IS_CAUSAL = true;",
                 "constexpr int BLOCK_M = 64;", f"constexpr int SMEM_BYTES = {cfg.shared_mem_bytes};",
                 "constexpr int CONSUMER_REGS = 256;"):
        assert line in src
    assert 'extern "C" __global__' in src and "{{" not in src


def test_tma_coordinates_follow_the_tensor_map_order():
    """Tensor maps are built from (batch, seq, heads, dim) shapes, so the driver's (innermost-first)
    dimensions are (dim, heads, seq, batch): every TMA call passes (column, head, row, batch)."""
    from rtkernels.render import render
    cfg = A90.choose_config("bfloat16", 128, True)
    src = render(cfg.template, cfg.template_params(), family="attention_sm90").source
    calls = re.findall(r"tma_(?:load|store)_4d\(([^;]*)\);", src)
    assert len(calls) == 4   # Q load (one tile, or the persistent walk's Q thread), K/V load, O store
    for c in calls:
        args = [a.strip() for a in c.split(",")][-4:]
        # tma_b: b, or 0 for varlen maps spanning (1, total, H, D)
        assert args[0] == "blk * 64" and args[1] in ("h", "hk") and args[3] in ("b", "tma_b"), args


def test_map_strides_give_size_one_dims_a_valid_stride():
    class V:   # what _map_strides reads of a CuPy view
        def __init__(self, shape, strides, itemsize=2):
            self.shape, self.strides, self.itemsize = shape, tuple(s * itemsize for s in strides), itemsize
    assert A90._map_strides(V((2, 100, 4, 72), (28800, 288, 72, 1))) == (28800, 288, 72, 1)
    # batch 1 and one KV head: the driver still wants positive 16-byte multiples there
    assert A90._map_strides(V((1, 100, 1, 72), (0, 72, 0, 1))) == (7200, 72, 72, 1)


def test_eligibility():
    class V:
        def __init__(self, strides, shape=(2, 100, 4, 72)):
            self.strides, self.shape = strides, shape
    ok = [V((57600, 576, 144, 2))] * 4
    assert A90.eligible("sm_90", ok, 10) and A90.eligible("sm_90a", ok, 10)
    assert not A90.eligible("sm_80", ok, 10) and not A90.eligible("sm_89", ok, 10)
    assert not A90.eligible("sm_90", ok, 0)                                # no key: a tensor map needs extent >= 1
    assert not A90.eligible("sm_90", ok[:3] + [V((57600, -576, 144, 2))], 10)   # reversed view: TMA strides are >= 0
    assert not A90.eligible("sm_90", [V((0, 576, 144, 2))] + ok[1:], 10)         # batch broadcast: no stride 0 either
    assert A90.eligible("sm_90", [V((0, 576, 144, 2), (1, 100, 4, 72))] + ok[1:], 10)   # ... unless never stepped


# ---- compile sweep: every config the heuristics choose ------------------------------------
def _build(args):
    dtype, d, causal = args
    cfg = A90.choose_config(dtype, d, causal)
    k = rtk.get_kernel(cfg, arch="sm_90a")
    return cfg, k


def _ops(sass):
    return re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)


# ptxas notes that cost the design its point: setmaxnreg ignored (C7508), wgmma serialized or a
# wait_group injected because an accumulator is touched while in flight (C7512/C7514/C7515/C7517).
PTXAS_NOTES = ("C7508", "C7512", "C7514", "C7515", "C7517")


def _pipeline(sass):
    """The kernel's wgmma/softmax order as a string: G = an HGMMA closing a group (gsb0), W<n> =
    wait until at most n groups are pending, e<k> = k MUFU.EX2 in a row."""
    ev = []
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR" in line:
            ev.append("W" + re.search(r"0x(\d+)", line.split("gsb0")[1]).group(1))
        elif "MUFU.EX2" in line:
            ev.append("e")
        elif "HGMMA" in line and "gsb0" in line:
            ev.append("G")
    return re.sub(r"e+", lambda m: f"e{len(m.group())}", "".join(ev))


@pytest.mark.parametrize("dtype,d,causal,tile", [("bfloat16", 96, True, {}), ("float16", 128, True, {}),
                                                 ("bfloat16", 64, False, {}), ("bfloat16", 256, True, {}),
                                                 ("float16", 112, False, dict(block_m=192, block_n=96, pingpong=True)),
                                                 ("bfloat16", 96, True, dict(softmax_under_pv=False))])
def test_sass_softmax_runs_under_the_pv_gemm(dtype, d, causal, tile):
    """Intra-warpgroup overlap as compiled: in the main loop S_n and P_{n-1} V_{n-1} close their
    groups (GG), the warp waits for S_n only (W1), every exponential of tile n is issued (e..), and
    only then waits for P V (W0) - or, softmax_under_pv=False, waits for both first; no wgmma
    is serialized."""
    cfg = A90.choose_config(dtype, d, causal)
    if tile:
        cfg = cfg.replace(**tile) if "block_m" not in tile else AttentionSm90Config(
            dtype=dtype, head_dim=d, causal=causal, **tile)
    assert cfg.intra_overlap
    k = rtk.get_kernel(cfg, arch="sm_90a")
    pipe = _pipeline(k.sass)
    exps = cfg.block_n // 2 + 2   # + 2: the two rows' corrections
    assert re.search(rf"GGW1e{exps}W0" if cfg.softmax_under_pv else rf"GGW1W0e{exps}G", pipe), pipe
    assert pipe.count("G") == 4 and pipe.count("W1") == 1, pipe       # S_0; S_n + P V; last P V
    assert not any(c in k.module.log for c in PTXAS_NOTES), k.module.log


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_heuristic_configs_compile_without_spills(dtype, causal):
    jobs = [(dtype, d, causal) for d in HEAD_DIMS]
    with ThreadPoolExecutor(2) as ex:   # NVRTC releases the GIL while compiling
        results = list(ex.map(_build, jobs))
    bad, missing = [], []
    for cfg, k in results:
        r = k.resources
        if r.spill_stores or r.spill_loads or r.stack_frame:
            bad.append((cfg.head_dim, r.registers, r.spill_stores, r.spill_loads, r.stack_frame))
        ops = set(_ops(k.sass))
        if any(o.startswith(("LDL", "STL")) for o in ops) or any(c in k.module.log for c in PTXAS_NOTES):
            bad.append((cfg.head_dim, "local memory or a ptxas setmaxnreg/wgmma warning"))
        pipe = _pipeline(k.sass)
        if cfg.intra_overlap and not re.search(r"GGW1e\d+W0", pipe):
            bad.append((cfg.head_dim, "exponentials not between wait_group 1 and 0", pipe))
        if not {"UTMALDG", "UTMASTG"} <= {o.split(".")[0] for o in ops} or "HGMMA.64x" not in k.sass:
            missing.append(cfg.head_dim)
    assert not bad, f"sm_90a {dtype} causal={causal}: {bad}"
    assert not missing, f"no HGMMA/UTMALDG/UTMASTG at head_dim {missing}"


SASS_CASES = [("bfloat16", 128, False), ("float16", 64, True), ("bfloat16", 80, True), ("float16", 256, False),
              ("bfloat16", 8, False), ("float16", 200, True)]


@pytest.mark.parametrize("dtype,d,causal", SASS_CASES)
def test_sass_uses_wgmma_tma_and_register_handoff(dtype, d, causal):
    cfg = A90.choose_config(dtype, d, causal)
    k = rtk.get_kernel(cfg, arch="sm_90a")
    ops = _ops(k.sass)
    names = {o.split(".")[0] for o in ops}
    assert f"HGMMA.64x{cfg.block_n}x16.F32" in k.sass, "S = Q K^T: one 64 x block_n wgmma per k16"
    assert f"HGMMA.64x{d}x16.F32" in k.sass, "O += P V with N = head_dim"
    assert "tnspB" in k.sass, "V is read N-major (transposed B)"
    assert {"UTMALDG", "UTMASTG", "SYNCS", "MUFU"} <= names
    assert "USETMAXREG" in names, "producer hands registers to the consumers"
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "no local memory"
    assert not any(o.startswith("LDG") for o in ops), "all tiles arrive by TMA"
    r = k.resources
    assert r.spill_stores == r.spill_loads == r.stack_frame == 0
    assert not any(c in k.module.log for c in PTXAS_NOTES), k.module.log
    assert not rtk_inspect.flags(k), rtk_inspect.flags(k)


def test_compile_by_name_fills_tiles_from_the_heuristics_or_takes_them():
    k = rtk.compile("attention_sm90", head_dim=96, dtype="bfloat16", causal=True, block_m=128, block_n=128,
                    num_stages=2, intra_overlap=False, arch="sm_90")
    assert k.config.intra_overlap is False and k.module.arch == "sm_90a"


# ---- NumPy models -------------------------------------------------------------------------
def _consumer_loop(q, k, v, causal, scale, m0, block_m, block_n, overlap):
    """The consumer warpgroups' loop for one CTA in float64, in the template's order: with overlap,
    P_{n-1} V_{n-1} lands in O before O is rescaled by tile n's correction."""
    from test_attention_model import tile_ranges, LOG2E
    sq, sk = q.shape[0], k.shape[0]
    rows_q = min(block_m, sq - m0)
    n_blocks, n_mask_from = tile_ranges(m0, rows_q, sq, sk, block_n, causal)
    rows = np.arange(m0, m0 + block_m)
    qt = np.zeros((block_m, q.shape[1]))
    qt[:rows_q] = q[m0:m0 + rows_q]
    sl2 = scale * LOG2E
    o = np.zeros((block_m, v.shape[1]))
    mx = np.full(block_m, -np.inf)
    l = np.zeros(block_m)

    def tile(n):
        kt = np.zeros((block_n, k.shape[1]))
        vt = np.zeros((block_n, v.shape[1]))
        keys = slice(n * block_n, min(sk, (n + 1) * block_n))
        kt[:keys.stop - keys.start] = k[keys]
        vt[:keys.stop - keys.start] = v[keys]
        return kt, vt

    def softmax(s, n):
        nonlocal mx, l
        if n >= n_mask_from:
            cols = n * block_n + np.arange(block_n)
            limit = np.full(block_m, sk)
            if causal:
                limit = np.minimum(limit, rows + sk - sq + 1)
            s = np.where(cols[None, :] >= limit[:, None], -np.inf, s)
        else:
            assert np.all(np.isfinite(s))
        new = np.maximum(mx, s.max(axis=1))
        ms = np.where(new == -np.inf, 0.0, new * sl2)
        corr = np.exp2(mx * sl2 - ms)
        p = np.exp2(s * sl2 - ms[:, None])
        l = l * corr + p.sum(axis=1)
        mx = new
        return p, corr

    if overlap:
        p = None
        for n in range(n_blocks):
            kt, vt = tile(n)
            s = qt @ kt.T                                # S_n issued ...
            if n > 0:
                o = o + p @ tile(n - 1)[1]               # ... with P_{n-1} V_{n-1}
            p_new, corr = softmax(s, n)                  # runs under the P V GEMM
            o = o * corr[:, None]                        # after that GEMM retired
            p = p_new
        if n_blocks:
            o = o + p @ tile(n_blocks - 1)[1]
    else:
        for n in range(n_blocks):
            kt, vt = tile(n)
            p, corr = softmax(qt @ kt.T, n)
            o = o * corr[:, None] + p @ vt
    inv = np.where(l > 0, 1.0 / np.where(l > 0, l, 1), 0.0)
    lse = np.where(l > 0, mx * scale + np.log(np.where(l > 0, l, 1)), -np.inf)
    return (o * inv[:, None])[:rows_q], lse[:rows_q]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("sq,sk,causal", [(300, 300, True), (113, 203, True), (203, 113, True), (1, 257, False),
                                          (257, 1, True), (128, 128, False), (70, 500, True), (500, 70, False)])
def test_model_consumer_loop_matches_softmax(sq, sk, causal, overlap):
    from test_attention_model import reference
    rng = np.random.default_rng(sq * 1000 + sk)
    d = 24
    q, k, v = (rng.standard_normal((n, d)) for n in (sq, sk, sk))
    scale = d ** -0.5
    o_ref, lse_ref = reference(q, k, v, causal, scale)
    for block_m, block_n in ((128, 128), (128, 80), (64, 112)):
        for m0 in range(0, sq, block_m):
            o, lse = _consumer_loop(q, k, v, causal, scale, m0, block_m, block_n, overlap)
            rows = slice(m0, m0 + o.shape[0])
            np.testing.assert_allclose(o, o_ref[rows], atol=1e-12)
            np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref[rows]))
            fin = np.isfinite(lse)
            np.testing.assert_allclose(lse[fin], lse_ref[rows][fin], atol=1e-12)


def _tile_range(m0, rows, sq, sk, block_n, causal):
    """The template's tile_range(m0, rows, ...): (tiles to visit, first tile that needs a mask)."""
    rows_q = min(rows, sq - m0)
    if rows_q <= 0:
        return 0, 0
    n_blocks, n_mask_from = -(-sk // block_n), sk // block_n
    if causal:
        last = min(sk, m0 + rows_q + sk - sq)
        n_blocks = -(-last // block_n) if last > 0 else 0
        first = m0 + sk - sq + 1
        n_mask_from = min(n_mask_from, first // block_n if first > 0 else 0)
    return n_blocks, n_mask_from


@pytest.mark.parametrize("causal", [False, True])
def test_model_warpgroup_ranges_cover_every_visible_key(causal):
    """A consumer warpgroup's own range (64 rows) holds every key its stored rows see, lies within
    the CTA's range, and its unmasked tiles are fully visible to all its rows."""
    for sq in (1, 17, 64, 65, 191, 192, 193, 300, 577):
        for sk in (1, 63, 112, 113, 300, 577):
            for block_m, block_n in ((192, 112), (192, 128), (128, 128), (192, 64)):
                for m0 in range(0, sq, block_m):
                    cta, _ = _tile_range(m0, block_m, sq, sk, block_n, causal)
                    for cw in range(block_m // 64):
                        n, mask_from = _tile_range(m0 + 64 * cw, 64, sq, sk, block_n, causal)
                        assert n <= cta
                        for r in range(m0 + 64 * cw, min(sq, m0 + 64 * cw + 64)):
                            hi = min(sk, r + sk - sq + 1) if causal else sk   # keys < hi are visible
                            assert hi <= n * block_n, (sq, sk, block_m, block_n, m0, cw, r)
                            assert min(mask_from, n) * block_n <= max(hi, 0)


def _tma_sw128_offset(row, col, elem=2):
    """Byte offset at which TMA (CU_TENSOR_MAP_SWIZZLE_128B) puts box element (row, col) of a box
    with 128-byte rows: 16-byte chunk c of row r lands at chunk c ^ (r % 8)."""
    byte = col * elem
    return row * 128 + (((byte // 16) ^ (row % 8)) * 16) + byte % 16


def _wgmma_sw128_offset(mn, kk, *, k_major, lbo, sbo, elem=2):
    """Byte offset the wgmma canonical SW128 layouts (PTX ISA, matrix descriptor) give element
    (m or n, k): K-major ((8, m), (64, k)) : ((128 B, SBO), (elem, -)); MN-major
    ((64, n), (8, k)) : ((elem, LBO), (128 B, SBO)) - both before the 128-byte XOR swizzle."""
    if k_major:
        assert kk < 64
        lin = (mn // 8) * sbo + (mn % 8) * 128 + kk * elem
    else:
        lin = (mn // 64) * lbo + (kk // 8) * sbo + (kk % 8) * 128 + (mn % 64) * elem
    r = (lin // 128) % 8
    return (lin // 128) * 128 + (((lin % 128) // 16) ^ r) * 16 + lin % 16


@pytest.mark.parametrize("head_dim,block_m,block_n", [(64, 128, 128), (80, 128, 128), (192, 128, 112),
                                                      (256, 128, 80), (8, 64, 64)])
def test_model_smem_layouts_tma_writes_are_what_wgmma_reads(head_dim, block_m, block_n):
    """The template's descriptor parameters (SBO 1024 for Q/K, LBO = one 64-column block of a K/V
    tile for V) and its per-block/k-step offsets address exactly where TMA put each element; the
    epilogue's staging formula is the TMA store's swizzle."""
    cfg = AttentionSm90Config(head_dim=head_dim, block_m=block_m, block_n=block_n)
    q_block, kv_block = block_m * 128, block_n * 128
    # Q (A operand, K-major): consumer warpgroup cw's rows start cw * 64 * 128 bytes in (a 1 KiB
    # multiple, so the swizzle phase is unchanged); k-step kk is block kk // 4, 32 * (kk % 4) bytes in
    for cw in range(cfg.consumers):
        for kk in range(-(-head_dim // 16)):
            for m in (0, 5, 17, 63):
                for k16 in (0, 7, 8, 15):
                    col = kk * 16 + k16
                    tma = (col // 64) * q_block + _tma_sw128_offset(cw * 64 + m, col % 64)
                    wg = cw * 64 * 128 + (kk // 4) * q_block + _wgmma_sw128_offset(
                        m, (kk % 4) * 16 + k16, k_major=True, lbo=16, sbo=1024)
                    assert wg == tma
    # V (B operand, N-major): element (key k, column n) for k-step kk
    for kk in range(block_n // 16):
        for n in (0, 9, 63, 64, 70, head_dim - 1):
            if n >= head_dim:
                continue
            for k16 in (0, 3, 8, 15):
                key = kk * 16 + k16
                tma = (n // 64) * kv_block + _tma_sw128_offset(key, n % 64)
                wg = kk * 2048 + _wgmma_sw128_offset(n, k16, k_major=False, lbo=kv_block, sbo=1024)
                assert wg == tma
    # epilogue staging: (row r of the warpgroup, column c) -> the kernel's address
    for r in (0, 7, 8, 33, 63):
        for c in (0, 2, 8, 62, 64, 130):
            if c >= head_dim:
                continue
            j, t = c // 8, (c % 8) // 2
            kernel = (j // 8) * q_block + r * 128 + (((j % 8) ^ (r % 8)) * 16) + t * 4 + (c % 2) * 2
            assert kernel == (c // 64) * q_block + _tma_sw128_offset(r, c % 64)


# ---- GPU ------------------------------------------------------------------------------------
def _need_sm90():
    from rtkernels import device
    if not device.device_arch().startswith("sm_90"):
        pytest.skip("needs an sm_90 device")


@pytest.fixture
def launches(monkeypatch):
    """Count launches of the Hopper kernel (to prove the dispatch took it)."""
    _need_sm90()
    calls = []
    real = A90.launch

    def spy(kern, cfg, *a, **kw):
        calls.append(cfg)
        return real(kern, cfg, *a, **kw)
    monkeypatch.setattr(A90, "launch", spy)
    # launch plans replay a signature without A90.launch: start each test with none
    monkeypatch.setattr(importlib.import_module("rtkernels.ops.attention"), "_FORWARD_PLANS", LaunchPlans())
    # and few query rows stay on this kernel (rtk.attention would send them to the decode kernel)
    monkeypatch.setenv("RTKERNELS_ATTENTION_DECODE", "0")
    return calls


@pytest.fixture(scope="module")
def prebuilt(request):
    """Compile the heuristic configs of the selected test_gpu_every_head_dim cases in parallel once
    (NVRTC releases the GIL)."""
    from rtkernels import device
    if not device.has_gpu() or not device.device_arch().startswith("sm_90"):
        return
    wanted = {A90.choose_config(it.callspec.params["dtype"], it.callspec.params["d"], it.callspec.params["causal"],
                                seqlen_k=it.callspec.params["sk"])
              for it in request.session.items if getattr(it, "originalname", "") == "test_gpu_every_head_dim"}
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda c: rtk.get_kernel(c, arch="sm_90a"), wanted))


def _run(batch, sq, sk, h, hkv, d, causal, dtype, seed=None, **kw):
    from test_attention import _run as run_fwd
    run_fwd(batch, sq, sk, h, hkv, d, causal, dtype, seed=seed, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("sk", [203, 1100])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_every_head_dim(prebuilt, launches, d, dtype, causal, sk):
    # seqlens that are no multiple of any tile, seqlen_q != seqlen_k, a GQA group of 2; 203 keys run
    # the SHORT_SCHEDULE row of the head dim, 1100 (past every row) the per-head-dim config
    _run(2, 113, sk, 4, 2, d, causal, dtype)
    want = A90.choose_config(dtype, d, causal, seqlen_k=sk)
    assert launches and launches[-1] == want, (d, dtype, causal, sk, launches[-1:], want)
    assert (want == A90.choose_config(dtype, d, causal)) == (A90.short_entry(d, causal, sk) is None)
    assert launches and launches[-1].head_dim == d


@pytest.mark.gpu
@pytest.mark.parametrize("poly", [3, 8])
@pytest.mark.parametrize("sq,sk,d,causal,dtype", [(300, 200, 64, True, "bfloat16"), (113, 203, 128, False, "float16"),
                                                  (77, 77, 256, True, "bfloat16")])
def test_gpu_exp2_on_the_fma_pipe(launches, monkeypatch, poly, sq, sk, d, causal, dtype):
    """exp2_poly: a share (3 of 8) or every exponential from rtk::poly_exp2; causal with
    seqlen_q > seqlen_k leaves rows that see no key (output 0, lse -inf: exactly zero weights)."""
    monkeypatch.setenv("RTKERNELS_SM90_EXP2_POLY", str(poly))
    monkeypatch.setattr(A90, "_KERNELS", {})   # the memoized (kernel, config) per shape
    _run(2, sq, sk, 4, 2, d, causal, dtype)
    assert launches and launches[-1].exp2_poly == poly


def test_exp2_poly_config_and_heuristic(monkeypatch):
    with pytest.raises(ConfigError, match="exp2_poly"):
        A90.AttentionSm90Config(dtype="bfloat16", head_dim=64, exp2_poly=9)
    monkeypatch.delenv("RTKERNELS_SM90_EXP2_POLY", raising=False)
    assert A90.choose_config("bfloat16", 128, False).exp2_poly == A90._EXP2_POLY_DENSE
    for causal in (False, True):
        assert A90.choose_config("bfloat16", 128, causal, has_softcap=True).exp2_poly == A90._EXP2_POLY_SOFTCAP[causal]
    monkeypatch.setenv("RTKERNELS_SM90_EXP2_POLY", "5")
    assert A90.choose_config("bfloat16", 64, True).exp2_poly == 5


SEQLENS = fwd_tests.SEQLENS + [(128, 128), (257, 384)]   # plus exact and ragged 128-row tiles


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_seqlens(launches, sq, sk, causal):
    dtype = "float16" if (sq + sk) % 2 else "bfloat16"
    d = 128 if sq * sk > 100_000 else 64
    _run(1, sq, sk, 2, 1, d, causal, dtype)
    assert launches


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype", fwd_tests.COMBINED + [
    (2, 2048, 2048, 4, 4, 192, True, "bfloat16"),
    (1, 1111, 2222, 6, 2, 160, False, "float16"),
    (2, 640, 640, 4, 2, 112, True, "float16"),
])
def test_gpu_combined(launches, batch, sq, sk, h, hkv, d, causal, dtype):
    _run(batch, sq, sk, h, hkv, d, causal, dtype)
    assert launches


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [72, 128])
def test_gpu_strided_q_from_packed_qkv_and_custom_scale(launches, dtype, d):
    import cupy as cp
    from test_attention import _check, _data
    rng = np.random.default_rng()
    b, s, h = 2, 333, 4
    qkv = _data(rng, (b, s, 3, h, d), dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    o, lse = rtk.attention(q, k, v, causal=True, softmax_scale=0.3, **extra)
    cp.cuda.get_current_stream().synchronize()
    _check(q, k, v, True, dtype, o, lse, 0.3)
    assert launches


@pytest.mark.gpu
def test_gpu_strided_out_and_batch_one_single_kv_head(launches):
    import cupy as cp
    from gpu_util import poison
    from test_attention import _check, _data
    rng = np.random.default_rng()
    q = _data(rng, (1, 65, 4, 40), "float16")
    k = _data(rng, (1, 80, 1, 40), "float16")
    v = _data(rng, (1, 80, 1, 40), "float16")
    big = poison(cp.empty((1, 65, 8, 40), cp.float16))
    o = big[:, :, 2:6]     # head stride 40, seq stride 320: a view into a wider buffer
    rtk.attention(q, k, v, out=o)
    cp.cuda.get_current_stream().synchronize()
    _check(q, k, v, False, "float16", o, None)
    assert bool(cp.isnan(big[:, :, :2].astype(cp.float32)).all()), "wrote outside the out view"
    assert bool(cp.isnan(big[:, :, 6:].astype(cp.float32)).all()), "wrote outside the out view"
    assert launches


@pytest.mark.gpu
def test_gpu_non_default_stream_and_no_lse(launches):
    import cupy as cp
    from gpu_util import poison
    from test_attention import _check, _data
    rng = np.random.default_rng()
    q = _data(rng, (2, 500, 4, 64), "float16")
    k = _data(rng, (2, 700, 4, 64), "float16")
    v = _data(rng, (2, 700, 4, 64), "float16")
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        o = poison(cp.empty(q.shape, q.dtype))
        s.synchronize()
        r = rtk.attention(q, k, v, causal=True, return_lse=False, out=o, stream=s)
        assert r is o
    s.synchronize()
    _check(q, k, v, True, "float16", o, None)
    assert launches


@pytest.mark.gpu
def test_gpu_torch_bfloat16(launches):
    torch = pytest.importorskip("torch")
    import cupy as cp
    from test_attention import _check
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 129, 4, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 150, 2, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 150, 2, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    o, lse = rtk.attention(q, k, v, causal=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and lse.shape == (2, 4, 129)
    torch.cuda.synchronize()
    as_bits = lambda t: cp.from_dlpack(t.view(torch.int16)).view(cp.uint16)   # noqa: E731
    _check(as_bits(q), as_bits(k), as_bits(v), True, "bfloat16", as_bits(o), cp.from_dlpack(lse))
    assert launches


@pytest.mark.gpu
def test_gpu_fallbacks_to_mma_sync(launches, monkeypatch):
    """Arrays TMA cannot address (a reversed view) are copied, and the Hopper kernel answers; no
    keys at all, or the switch off: the mma.sync kernel answers, correctly."""
    import cupy as cp
    from test_attention import _check, _data
    rng = np.random.default_rng()
    q = _data(rng, (1, 70, 2, 64), "float16")
    kk = _data(rng, (1, 90, 2, 64), "float16")
    v = _data(rng, (1, 90, 2, 64), "float16")
    k_rev = kk[:, ::-1]
    o, lse = rtk.attention(q, k_rev, v, causal=True)
    cp.cuda.get_current_stream().synchronize()
    _check(q, cp.ascontiguousarray(k_rev), v, True, "float16", o, lse)
    assert len(launches) == 1   # on a compact copy of k_rev (tensor maps have no negative strides)
    launches.clear()
    o, lse = rtk.attention(q, kk[:, :0], v[:, :0])
    cp.cuda.get_current_stream().synchronize()
    assert float(cp.abs(o.astype(cp.float32)).max()) == 0 and bool(cp.isneginf(lse).all())
    assert not launches
    monkeypatch.setattr(A90, "ENABLED", False)
    o, lse = rtk.attention(q, kk, v)
    cp.cuda.get_current_stream().synchronize()
    _check(q, kk, v, False, "float16", o, lse)
    assert not launches


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [dict(block_m=64, block_n=64, intra_overlap=False),
                                  dict(block_m=192, block_n=128, intra_overlap=True),
                                  dict(block_m=192, block_n=96, intra_overlap=True, pingpong=True),
                                  dict(block_m=128, block_n=128, intra_overlap=True, pingpong=False),
                                  dict(block_m=128, block_n=128, intra_overlap=True, pingpong=True),
                                  dict(block_m=128, block_n=128, intra_overlap=True, pingpong=True,
                                       softmax_under_pv=False),
                                  dict(block_m=128, block_n=128, intra_overlap=False, pingpong=True),
                                  dict(block_m=128, block_n=80, intra_overlap=False, pingpong=True),
                                  dict(block_m=128, block_n=176, intra_overlap=False, pingpong=True),
                                  dict(block_m=128, block_n=64, num_stages=3, intra_overlap=False)])
def test_gpu_other_tiles(tile):
    """Tiles the autotuner may pick, launched directly (the op uses the heuristic's)."""
    _need_sm90()
    import cupy as cp
    from gpu_util import poison
    from test_attention import _check, _data
    rng = np.random.default_rng()
    for d, causal, dtype in ((64, True, "bfloat16"), (96, False, "float16"), (200, True, "float16")):
        try:
            cfg = AttentionSm90Config(dtype=dtype, head_dim=d, causal=causal, **tile)
        except ConfigError:
            continue
        q = _data(rng, (2, 333, 4, d), dtype)
        k = _data(rng, (2, 517, 2, d), dtype)
        v = _data(rng, (2, 517, 2, d), dtype)
        o = poison(cp.empty(q.shape, q.dtype))
        lse = cp.empty((2, 4, 333), cp.float32)
        A90.launch(rtk.get_kernel(cfg, arch="sm_90a"), cfg, q, k, v, o, lse, d ** -0.5)
        cp.cuda.get_current_stream().synchronize()
        _check(q, k, v, causal, dtype, o, lse)


# ---- model of the mbarrier protocol ---------------------------------------------------------
class _Bar:
    """An mbarrier as PTX defines it: a phase completes after `count` arrivals (TMA bytes are
    modelled as the one arrival of the producer's arrive.expect_tx landing later); try_wait.parity(P)
    succeeds while the current phase's parity differs from P.  `completed` counts phases exactly,
    so a waiter that fell two phases behind (parity aliasing) is caught."""

    def __init__(self, count):
        self.count, self.arrived, self.completed = count, 0, 0

    def arrive(self):
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.completed = 0, self.completed + 1

    def try_wait(self, parity, expect_phase):
        ok = (self.completed % 2) != parity
        if ok:
            assert self.completed == expect_phase + 1, "parity aliasing: waiter is a phase behind"
        return ok


def _simulate(n_blocks, stages, consumers, overlap, rng, under_pv=True, own=None):
    """Producer and consumer warps of one CTA as generators, scheduled in random order; each wait
    is a yield until its barrier passes.  ``own[cw]``: the tiles consumer warpgroup cw computes
    (<= n_blocks, the template's per-warpgroup range); it releases the rest unread.  A tile read
    must still be in its slot when the warp releases it (no early overwrite).  Returns the tile
    order each consumer warp read."""
    own = [n_blocks] * consumers if own is None else own
    full_k = [_Bar(1) for _ in range(stages)]
    full_v = [_Bar(1) for _ in range(stages)]
    empty_k = [_Bar(4 * consumers) for _ in range(stages)]
    empty_v = [_Bar(4 * consumers) for _ in range(stages)]
    slot_k = [None] * stages     # which tile a slot holds (None while a load is in flight)
    slot_v = [None] * stages
    landing = []                 # (slots, slot index, tile, barrier) of TMA loads in flight

    def wait(bar, parity, phase):
        while not bar.try_wait(parity, phase):
            yield

    def producer(is_v):   # one thread per ring
        for n in range(n_blocks):
            st = n % stages
            if n >= stages:
                yield from wait((empty_v if is_v else empty_k)[st], (n // stages - 1) & 1, n // stages - 1)
            slots = slot_v if is_v else slot_k
            slots[st] = None
            landing.append((slots, st, n, (full_v if is_v else full_k)[st]))
            yield

    seen = [[] for _ in range(4 * consumers)]

    def consumer_warp(w):
        order = seen[w]
        mine = own[w // 4]

        def use(n, is_v):
            st = n % stages
            yield from wait((full_v if is_v else full_k)[st], (n // stages) & 1, n // stages)
            assert (slot_v if is_v else slot_k)[st] == n
            order.append(("PV" if is_v else "S", n))

        def release(n, is_v, read=True):
            st = n % stages
            if read:
                assert (slot_v if is_v else slot_k)[st] == n, "slot overwritten while being read"
            (empty_v if is_v else empty_k)[st].arrive()
        if overlap:   # under_pv: V_{n-1} is released when P_{n-1} V_{n-1} retires, after tile n's softmax
            if mine:
                yield from use(0, False)
                yield
                release(0, False)
            for n in range(1, mine):
                if under_pv and n >= 2:
                    release(n - 2, True)
                yield from use(n, False)
                yield from use(n - 1, True)
                yield
                release(n, False)
                if not under_pv:
                    yield
                    release(n - 1, True)
                yield
            if mine:
                if under_pv and mine >= 2:
                    release(mine - 2, True)
                yield from use(mine - 1, True)
                yield
            if mine < n_blocks and mine:
                release(mine - 1, True)
        else:
            for n in range(mine):
                yield from use(n, False)
                yield
                release(n, False)
                yield from use(n, True)
                yield
                release(n, True)
        for n in range(mine, n_blocks):   # past this warpgroup's rows: released unread, after landing
            st, ph = n % stages, n // stages
            yield from wait(full_k[st], ph & 1, ph)
            release(n, False, read=False)
            yield from wait(full_v[st], ph & 1, ph)
            release(n, True, read=False)

    actors = [producer(False), producer(True)] + [consumer_warp(w) for w in range(4 * consumers)]
    steps = 0
    while actors:
        steps += 1
        assert steps < 200000, "deadlock"
        if landing and rng.random() < 0.3:   # a TMA load lands
            slots, st, n, bar = landing.pop(int(rng.integers(len(landing))))
            slots[st] = n
            bar.arrive()
        i = int(rng.integers(len(actors)))
        try:
            next(actors[i])
        except StopIteration:
            actors.pop(i)
    return seen


def _want(n, overlap):
    if overlap:
        return ([("S", 0)] if n else []) + [x for i in range(1, n) for x in (("S", i), ("PV", i - 1))] \
            + ([("PV", n - 1)] if n else [])
    return [x for i in range(n) for x in (("S", i), ("PV", i))]


@pytest.mark.parametrize("overlap,under_pv", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("stages,consumers", [(2, 2), (3, 2), (2, 1), (2, 3)])
def test_model_barrier_protocol_has_no_deadlock_or_stale_tile(overlap, under_pv, stages, consumers):
    rng = np.random.default_rng(stages * 10 + consumers)
    for n_blocks in (0, 1, 2, 3, 5, 9):
        for _ in range(5):
            seen = _simulate(n_blocks, stages, consumers, overlap, rng, under_pv)
            assert all(order == _want(n_blocks, overlap) for order in seen)


@pytest.mark.parametrize("overlap,under_pv", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("stages", [2, 3])
def test_model_warpgroups_stopping_early_release_what_they_skip(overlap, under_pv, stages):
    """Causal 192-row CTAs: warpgroup cw computes only the tiles its own rows see (fewer for the
    first rows, none when they see no key) and releases the CTA's others unread."""
    rng = np.random.default_rng(stages)
    for n_blocks in (1, 2, 3, 5, 9):
        for own in ([n_blocks - 2, n_blocks - 1, n_blocks], [0, n_blocks - 1, n_blocks], [0, 0, n_blocks],
                    [n_blocks - 1, n_blocks, n_blocks]):
            own = [max(0, x) for x in own]
            for _ in range(4):
                seen = _simulate(n_blocks, stages, 3, overlap, rng, under_pv, own)
                assert all(order == _want(own[w // 4], overlap) for w, order in enumerate(seen))


def _simulate_turns(consumers, issue_points, rng):
    """The pingpong hand-over (Turns in the template) with PTX named-barrier semantics: a barrier
    of 256 threads completes once two warpgroups reached it, each by bar.sync (waits) or bar.arrive
    (does not).  Returns the order in which warpgroups issued their GEMMs."""
    arrived = {b: [] for b in range(consumers)}   # per barrier: "sync"/"arrive" of the current phase
    done = {b: 0 for b in range(consumers)}       # completed phases
    order = []

    def reach(b, kind):
        arrived[b].append(kind)
        if len(arrived[b]) == 2:
            assert arrived[b].count("sync") == 1, f"barrier {b} completed without its owner: {arrived[b]}"
            arrived[b], done[b] = [], done[b] + 1

    def wg(cw):
        left = issue_points
        if cw == consumers - 1 and issue_points:
            reach(0, "arrive")
        for _ in range(issue_points):
            target = done[cw] + 1
            reach(cw, "sync")
            while done[cw] < target:
                yield
            order.append(cw)
            yield
            left -= 1
            if left > 0 or cw != consumers - 1:
                reach((cw + 1) % consumers, "arrive")
            yield
    actors = [wg(cw) for cw in range(consumers)]
    steps = 0
    while actors:
        steps += 1
        assert steps < 100000, "deadlock"
        i = int(rng.integers(len(actors)))
        try:
            next(actors[i])
        except StopIteration:
            actors.pop(i)
    assert all(not a for a in arrived.values()), f"unbalanced barriers: {arrived}"
    return order


@pytest.mark.parametrize("consumers", [2, 3])
def test_model_pingpong_turns_are_round_robin_and_balanced(consumers):
    rng = np.random.default_rng(consumers)
    for points in (0, 1, 2, 5, 9):
        for _ in range(5):
            assert _simulate_turns(consumers, points, rng) == list(range(consumers)) * points


def test_from_params_builds_what_the_op_runs():
    """`rtk.compile("attention_sm90", head_dim=...)` / `rtk report --sweep head_dim=...` get the
    heuristic's tile; a hand-picked tile field is taken as written."""
    for d in (64, 112, 256):
        for causal in (False, True):
            got = AttentionSm90Config.from_params(dict(dtype="bfloat16", head_dim=d, causal=causal), "sm_90")
            assert got == A90.choose_config("bfloat16", d, causal)
    c = AttentionSm90Config.from_params(dict(head_dim=64, block_n=64), "sm_90")
    assert (c.block_m, c.block_n) == (128, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_launch_plans_replay_per_signature_cupy(launches, dtype):
    """A second call with a signature replays the first call's launch (new addresses, new data);
    out given, return_lse=False, another alignment or causal are other plans."""
    import cupy as cp
    from gpu_util import poison
    from test_attention import _check, _data
    plans = importlib.import_module("rtkernels.ops.attention")._FORWARD_PLANS
    rng = np.random.default_rng()
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    for trial in range(3):
        q = _data(rng, (2, 200, 4, 72), dtype)
        k = _data(rng, (2, 301, 2, 72), dtype)
        v = _data(rng, (2, 301, 2, 72), dtype)
        o, lse = rtk.attention(q, k, v, causal=True, **extra)
        _check(q, k, v, True, dtype, o, lse)
        out = poison(cp.empty(q.shape, q.dtype))
        assert rtk.attention(q, k, v, return_lse=False, out=out, softmax_scale=0.2, **extra) is out
        _check(q, k, v, False, dtype, out, None, 0.2)
    assert len(launches) == 2 and len(plans) == 2    # the first trial planned, the others replayed
    packed = _data(rng, (2, 200, 3, 4, 72), dtype)    # q, k, v as strided slices of one buffer
    q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    for _ in range(2):
        o, lse = rtk.attention(q, k, v, **extra)
        _check(q, k, v, False, dtype, o, lse)
    assert len(plans) == 3


@pytest.mark.gpu
def test_gpu_launch_plans_replay_per_signature_torch(launches):
    """torch tensors replay on torch's current stream: inputs written on a side stream right
    before each call need no synchronize, and a second call under the default stream still
    orders after the side stream's work once the user waits for it."""
    torch = pytest.importorskip("torch")
    plans = importlib.import_module("rtkernels.ops.attention")._FORWARD_PLANS

    def ref(q, k, v):
        qt, kt, vt = (x.float().transpose(1, 2) for x in (q, k, v))
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device="cuda").tril(k.shape[1] - q.shape[1])
        r = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
        return r.transpose(1, 2)

    s = torch.cuda.Stream()
    g = torch.Generator(device="cuda").manual_seed(3)
    results = []
    for trial in range(4):
        with torch.cuda.stream(s):
            q = torch.randn(1, 257, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            q.mul_(1.5)   # work queued on s right before the launch
            o, lse = rtk.attention(q, k, v, causal=True)
            results.append((o, lse, ref(q, k, v)))
    s.synchronize()
    for o, lse, r in results:
        assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (1, 4, 257)
        assert (o.float() - r).abs().max().item() < 3e-2
    assert len(launches) == 1 and len(plans) == 1
