"""attention_sm90 options of the long-sequence forward (issue 24, S=4k/16k against FA4): lpt_grid
(the causal tiles of a one-CTA-per-tile grid heaviest first in L2-sized sections), rescale_under_qk
(O rescaled under the S GEMM) and p_smem (P through shared memory, SS P V).

CPU: validation messages, p_smem's shared memory, lpt_group (sections within the budget, the
dispatcher model's balance), the lpt launch (1-D grid of every tile, batch and section as the last
arguments), heuristic_defaults keeping a given tile, two builds at sm_90a: d80 192x128 overlapped with
P in shared memory (no spills where P in registers spills 48 B; the P V wgmma reads A from shared
memory) and d256 128x80 pingpong + rescale_under_qk + lpt_grid (no spills, no ptxas wgmma notes).
GPU (``-m gpu``, sm_90): every option over awkward shapes (GQA, one row, rows that see no key,
seqlen_q != seqlen_k, partial tiles) with poisoned outputs against the float64 reference (2x error
rule), lpt_grid and rescale_under_qk bit for bit against the same config without them, lpt_grid's
sections forced small and its balance computed for 1 and 3 SMs.
"""
from __future__ import annotations

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError
from rtkernels.ops import attention_sm90 as A90
from rtkernels.ops.attention_sm90 import AttentionSm90Config

from test_attention_sm90_persistent import PTXAS_NOTES, _need_sm90, _inputs, case_id


# ---- CPU ----------------------------------------------------------------------------------
def test_validation_messages():
    cases = [
        (dict(head_dim=64, causal=False, lpt_grid=True), "lpt_grid", "causal=True"),
        (dict(head_dim=64, causal=True, persistent=True, lpt_grid=True), "lpt_grid", "persistent=False"),
        (dict(head_dim=64, causal=True, is_varlen=True, lpt_grid=True), "lpt_grid", "cu_seqlens"),
        (dict(head_dim=64, intra_overlap=False, rescale_under_qk=True), "rescale_under_qk", "intra_overlap=True"),
        (dict(head_dim=64, persistent=True, flat_walk=True, rescale_under_qk=True), "rescale_under_qk",
         "flat_walk"),
        (dict(head_dim=64, persistent=True, flat_walk=True, p_smem=True), "p_smem", "flat_walk"),
        (dict(head_dim=64, lpt_grid="yes"), "lpt_grid", "True"),
    ]
    for kw, name, allowed in cases:
        with pytest.raises(ConfigError) as e:
            AttentionSm90Config(block_m=128, block_n=128, **kw)
        assert name in str(e.value) and allowed in str(e.value), (kw, str(e.value))


def test_p_smem_shared_memory():
    base = AttentionSm90Config(head_dim=80, block_m=192, block_n=112, intra_overlap=True)
    ps = base.replace(p_smem=True)
    assert ps.shared_mem_bytes == base.shared_mem_bytes + 192 * 128 * 2   # 112 keys: two 64-key blocks
    # d80 192x128: Q 48 KiB + K/V 128 KiB + P 48 KiB fits the 227 KiB; 192x144 (a third P block) does not
    AttentionSm90Config(head_dim=80, block_m=192, block_n=128, intra_overlap=True, p_smem=True)
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=80, block_m=192, block_n=144, intra_overlap=True, p_smem=True)
    assert "block_n" in str(e.value), str(e.value)


# FlashAttention's grid (16k tokens, hidden 2048), causal: (seqlen, head_dim, block_m, block_n)
LPT_GRID = [(4096, 256, 128, 80), (16384, 256, 128, 80), (4096, 128, 128, 128), (16384, 64, 192, 112),
            (4096, 80, 192, 112), (16384, 80, 192, 112), (1024, 64, 192, 112)]


def _key_tiles(s, bm, bn):
    return [-(-min(s, (m + 1) * bm) // bn) for m in range(-(-s // bm))]


@pytest.mark.parametrize("s,d,bm,bn", LPT_GRID)
def test_lpt_group_fits_and_balances(s, d, bm, bn):
    cfg = AttentionSm90Config(head_dim=d, block_m=bm, block_n=bn, causal=True, intra_overlap=True, lpt_grid=True)
    heads, batch = 2048 // d, 16384 // s
    g = A90.lpt_group(cfg, batch, s, s, heads, 1, 132)
    assert 1 <= g <= heads * batch and (g == 1 or g * 2 * s * d * 2 <= A90.LPT_SECTION_BYTES), g
    kt = _key_tiles(s, bm, bn)
    cost = A90.dispatch_cost(len(kt), heads * batch, 132, g, kt)
    # heaviest first over every pair is the model's best case (it ignores L2); the sections come close
    assert cost <= A90.dispatch_cost(len(kt), heads * batch, 132, heads * batch, kt) + 0.015, (g, cost)
    assert cost < 1.02, (g, cost)


def test_dispatch_model_shows_the_pair_major_tail():
    """The reason for lpt_grid, in the model: d256 128x80 S=4k, the 3-D grid's order (each pair's tiles
    heaviest first, pair after pair) against the sectioned heaviest-first order."""
    import heapq
    kt = _key_tiles(4096, 128, 80)
    m, pairs = len(kt), 32
    free = [0.0] * 132
    for _ in range(pairs):
        for t in range(m - 1, -1, -1):
            heapq.heapreplace(free, free[0] + kt[t] + 1.5)
    pair_major = max(free) / (pairs * sum(k + 1.5 for k in kt) / 132)
    assert pair_major > 1.1, pair_major
    assert A90.dispatch_cost(m, pairs, 132, 8, kt) < 1.01


def test_lpt_launch_is_one_dimensional():
    cfg = AttentionSm90Config(head_dim=128, block_m=128, block_n=128, causal=True, intra_overlap=True,
                              pingpong=True, lpt_grid=True)

    class V:   # shapes are all recorded_launch reads
        def __init__(self, shape):
            self.shape = shape
    q, k = V((4, 1000, 6, 128)), V((4, 1000, 2, 128))
    la = A90.recorded_launch("kernel", cfg, q, k, 0.125, sm_count=132)
    assert la.grid == (8 * 6 * 4,), la.grid
    assert la.tail[-2] == 4 and la.tail[-1] == A90.lpt_group(cfg, 4, 1000, 1000, 6, 3, 132), la.tail[-3:]
    plain = A90.recorded_launch("kernel", cfg.replace(lpt_grid=False), q, k, 0.125, sm_count=132)
    assert plain.grid == (8, 6, 4) and plain.tail == la.tail[:-2]


def test_heuristic_defaults_keep_a_given_tile():
    got = AttentionSm90Config.heuristic_defaults(dict(head_dim=128, causal=True, lpt_grid=True), "sm_90a")
    assert got and got["block_m"] == A90.choose_config("float16", 128, True).block_m
    assert AttentionSm90Config.heuristic_defaults(dict(head_dim=128, p_smem=True), "sm_90a") == {}


@pytest.fixture(scope="module")
def builds():
    """The two CPU builds, shared by the checks below."""
    cfgs = {"ps": AttentionSm90Config(dtype="bfloat16", head_dim=80, block_m=192, block_n=128, intra_overlap=True,
                                      p_smem=True),
            "rq_lpt": AttentionSm90Config(dtype="bfloat16", head_dim=256, causal=True, block_m=128, block_n=80,
                                          intra_overlap=True, pingpong=True, rescale_under_qk=True, lpt_grid=True)}
    return {n: (c, rtk.get_kernel(c, arch="sm_90a")) for n, c in cfgs.items()}


@pytest.mark.parametrize("name", ["ps", "rq_lpt"])
def test_builds_without_spills_or_wgmma_notes(builds, name):
    cfg, k = builds[name]
    r = k.resources
    assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (cfg, r)
    assert not any(c in k.module.log for c in PTXAS_NOTES), k.module.log


def test_p_smem_reads_p_from_shared_memory(builds):
    import re
    cfg, k = builds["ps"]
    sass = k.sass
    pv = re.findall(r"HGMMA\.64x80x16\.F32\.BF16 R\d+, (\S+), R", sass)   # O += P V: N = head_dim
    assert pv and all(a.startswith("gdesc") for a in pv), pv[:4]        # A (P) from shared memory
    assert "STS" in sass


# ---- GPU ------------------------------------------------------------------------------------
# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype): cheap first
CASES = [
    (1, 1, 1, 1, 1, 64, True, "bfloat16"),
    (3, 7, 7, 5, 5, 64, True, "bfloat16"),
    (3, 129, 129, 5, 1, 64, False, "float16"),
    (3, 513, 513, 5, 5, 80, True, "bfloat16"),
    (3, 513, 1000, 5, 1, 80, False, "bfloat16"),
    (3, 1000, 1000, 5, 1, 128, True, "bfloat16"),
    (3, 1000, 1, 5, 1, 128, True, "bfloat16"),     # causal, seqlen_q > seqlen_k: rows that see no key
    (3, 1, 1000, 5, 5, 64, True, "float16"),
    (3, 129, 2049, 5, 1, 128, True, "bfloat16"),
    (2, 1000, 1000, 4, 2, 128, False, "bfloat16"),
    (2, 2049, 1000, 5, 1, 256, False, "float16"),
    (3, 2049, 2049, 5, 5, 256, True, "bfloat16"),
]

# option -> head dim class -> tile fields (the A/B's candidates of tools/bench_attention.py --fwd-ab)
OPTION_TILES = {
    "lpt": {64: dict(block_m=192, block_n=112, intra_overlap=True), 96: dict(block_m=192, block_n=112,
                                                                             intra_overlap=True),
            128: dict(block_m=128, block_n=128, intra_overlap=True, pingpong=True),
            256: dict(block_m=128, block_n=80, intra_overlap=True, pingpong=True)},
    "rq": {64: dict(block_m=192, block_n=128, intra_overlap=True), 96: dict(block_m=192, block_n=112,
                                                                            intra_overlap=True),
           128: dict(block_m=128, block_n=128, intra_overlap=True, pingpong=True),
           256: dict(block_m=128, block_n=80, intra_overlap=True)},
    "ps": {64: dict(block_m=192, block_n=144, intra_overlap=True, pingpong=True),
           96: dict(block_m=192, block_n=128, intra_overlap=True),
           128: dict(block_m=192, block_n=128, intra_overlap=True),
           256: dict(block_m=128, block_n=64, intra_overlap=True, pingpong=True)},
    "ps_plain": {64: dict(block_m=192, block_n=128, intra_overlap=False),
                 96: dict(block_m=192, block_n=128, intra_overlap=False),
                 128: dict(block_m=192, block_n=128, intra_overlap=False),
                 256: dict(block_m=128, block_n=64, intra_overlap=False, pingpong=True)},
}
OPTION_FIELD = {"lpt": "lpt_grid", "rq": "rescale_under_qk", "ps": "p_smem", "ps_plain": "p_smem"}
_KERNELS: dict = {}


def _config(option, dtype, d, causal, on=True):
    cls = next(c for c in (64, 96, 128, 256) if d <= c)
    return AttentionSm90Config(dtype=dtype, head_dim=d, causal=causal, **OPTION_TILES[option][cls],
                               **{OPTION_FIELD[option]: on})


def _kernel(cfg):
    if cfg not in _KERNELS:
        _KERNELS[cfg] = rtk.get_kernel(cfg, arch="sm_90a")
    return _KERNELS[cfg]


@pytest.fixture(scope="module")
def prebuilt():
    """Every config the GPU tests launch, compiled in parallel once (about 40: one at a time they
    would take most of the run); nothing without an sm_90 device."""
    from concurrent.futures import ThreadPoolExecutor
    from rtkernels import device
    if not device.has_gpu() or not device.device_arch().startswith("sm_90"):
        return
    cfgs = {_config(opt, c[7], c[5], c[6], on) for c in CASES for opt in OPTION_TILES for on in (True, False)
            if (opt != "lpt" or c[6]) and (on or opt in ("lpt", "rq"))}
    with ThreadPoolExecutor(16) as ex:
        for cfg, k in zip(cfgs, ex.map(lambda c: rtk.get_kernel(c, arch="sm_90a"), cfgs)):
            _KERNELS[cfg] = k


def _run(cfg, case, seed, sm_count=None):
    import cupy as cp
    from test_attention import _check
    q, k, v, o, lse = _inputs(case, seed)
    A90.launch(_kernel(cfg), cfg, q, k, v, o, lse, case[5] ** -0.5, sm_count=sm_count)
    cp.cuda.get_current_stream().synchronize()
    try:
        _check(q, k, v, case[6], case[7], o, lse)
    except AssertionError as e:
        raise AssertionError(f"{e}\ncase={case} seed={seed} sm_count={sm_count} cfg={cfg.key()}") from None
    return o, lse


def _same(a, b, what, case, cfg):
    import cupy as cp
    assert bool(cp.array_equal(a.view(cp.uint8), b.view(cp.uint8))), f"{what} differs without the option: {case} {cfg}"


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["lpt", "rq", "ps", "ps_plain"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_option(case, option, prebuilt):
    """Against the float64 reference with poisoned outputs; lpt_grid and rescale_under_qk also bit for
    bit against the same config without them (the same arithmetic in another order of tiles / of
    independent instructions)."""
    _need_sm90()
    batch, sq, sk, h, hkv, d, causal, dtype = case
    if option == "lpt" and not causal:
        pytest.skip("lpt_grid orders causal tiles")
    seed = int(np.random.SeedSequence().entropy % 2**32)
    cfg = _config(option, dtype, d, causal)
    o, lse = _run(cfg, case, seed)
    if option in ("lpt", "rq"):
        base = _config(option, dtype, d, causal, on=False)
        o2, lse2 = _run(base, case, seed)
        _same(o, o2, "O", case, cfg.key())
        _same(lse, lse2, "lse", case, cfg.key())


@pytest.mark.gpu
@pytest.mark.parametrize("pairs", [1, 2, 3], ids=lambda p: f"pairs{p}")
@pytest.mark.parametrize("sm_count", [1, 3])
def test_gpu_lpt_small_sections(pairs, sm_count, monkeypatch):
    """lpt_grid with its section budget forced to a few pairs' K/V (sections end mid-batch, the last one
    shorter) and the balance computed for 1 and 3 SMs (other section sizes): same O and lse as the 3-D
    grid, bit for bit."""
    _need_sm90()
    case = (3, 1000, 1000, 5, 1, 128, True, "bfloat16")
    monkeypatch.setattr(A90, "LPT_SECTION_BYTES", pairs * 2 * 1000 * 128 * 2 // 5)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    cfg = _config("lpt", "bfloat16", 128, True)
    o, lse = _run(cfg, case, seed, sm_count=sm_count)
    o2, lse2 = _run(cfg.replace(lpt_grid=False), case, seed)
    _same(o, o2, "O", case, cfg.key())
    _same(lse, lse2, "lse", case, cfg.key())


@pytest.mark.gpu
def test_gpu_rtk_attention_plans_an_lpt_config(monkeypatch):
    """rtk.attention with an lpt_grid config chosen (as a HEURISTICS row would give it): the first call
    records the 1-D launch with its section argument, the second (new inputs, same signature) replays it."""
    _need_sm90()
    import importlib
    import cupy as cp
    from gpu_util import poison
    from rtkernels.ops._arrays import LaunchPlans
    from test_attention import _check
    cfg = _config("lpt", "bfloat16", 128, True)
    monkeypatch.setattr(A90, "choose_config", lambda *a, **kw: cfg)
    monkeypatch.setattr(A90, "_KERNELS", {})
    monkeypatch.setattr(importlib.import_module("rtkernels.ops.attention"), "_FORWARD_PLANS", LaunchPlans())
    case = (2, 777, 777, 6, 2, 128, True, "bfloat16")
    for seed in (1, 2):
        q, k, v, o, _ = _inputs(case, seed)
        o2, lse = rtk.attention(q, k, v, causal=True, out=poison(o), dtype="bfloat16")
        cp.cuda.get_current_stream().synchronize()
        try:
            _check(q, k, v, True, "bfloat16", o2, lse)
        except AssertionError as e:
            raise AssertionError(f"{e}\ncase={case} seed={seed} call={seed} cfg={cfg.key()}") from None
