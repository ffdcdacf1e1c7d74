"""attention_backward: config validation, heuristics, compile/ptxas/SASS sweeps, NumPy models (CPU),
and GPU correctness/determinism (``-m gpu``).

CPU models mirror templates/attention_bwd.cu.j2 name for name:
  * ``tile_model``: the key-tile x (query head, query tile) loop of attention_bwd in float64 -
    m_begin, the mask shortcut, lse = -inf rows, GQA summation - against the direct formulas;
  * ``emulate_bwd_cta`` / ``emulate_dq_cta``: one thread block at warp level with the kernel's
    own lane offsets, shared-memory strides, fragment packing, dS^T round trip through shared
    memory and dQ units (ldmatrix / mma emulated from the PTX fragment tables, reused from the
    forward's model).
GPU tests follow FlashAttention's rule per gradient: error against a float64 reference at most
twice the error of the same reference run in the input dtype.
"""
from __future__ import annotations

import importlib
import math
import re
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

import rtkernels as rtk
from sweep import FULL_SWEEP
from rtkernels import inspect as rtk_inspect
from rtkernels.errors import ConfigError
from rtkernels.ops.attention_bwd import (AttentionBwdConfig, HEURISTICS, KERNELS, attention_backward, candidates,
                                         choose_config)
from test_attention_model import LANE, G, TQ, ldmatrix, load_tile, mma, pack2, round_to

bwd_mod = importlib.import_module("rtkernels.ops.attention_bwd")
HEAD_DIMS = list(range(8, 257, 8))
# CI's sample of the no-spill sweep (conftest.FULL_SWEEP compiles all 32): each tile class of the
# heuristics table (8-64, 72-128, 120, 136-256) at its ends, and awkward ones (40, 80, 200, 248)
SWEEP_HEAD_DIMS = HEAD_DIMS if FULL_SWEEP else [8, 40, 64, 72, 80, 96, 120, 128, 136, 160, 192, 200, 248, 256]
ARCHS = ("sm_80", "sm_90")
DTYPES = ("float16", "bfloat16")
NEG_INF = -np.inf
LOG2E = 1.4426950408889634


# ---- config -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(head_dim=7), dict(head_dim=264), dict(dtype="float32"), dict(block_n=48), dict(block_n=128),
    dict(block_m=24), dict(block_m=48), dict(block_m=256), dict(num_warps=1), dict(dq_block_n=8), dict(dq_num_warps=3),
    dict(causal="yes"), dict(deterministic=1.5), dict(dq_mode="atomic"), dict(dq_mode="pass"),
    dict(deterministic=True, dq_mode="red"), dict(kv_regs=1), dict(ds_stages=3), dict(dq_mode="bulk", ds_stages=0),
])
def test_config_rejects(bad):
    with pytest.raises(ConfigError) as e:
        AttentionBwdConfig(**bad)
    assert "attention_backward" in str(e.value)


def test_config_derived_values_and_family():
    c = AttentionBwdConfig(dtype="bf16", head_dim=72, block_m=64, block_n=64, num_warps=4)
    rs = 88   # 80 padded -> 10 chunks -> 11 (odd)
    assert c.dtype == "bfloat16" and c.d_split == 1 and c.threads_per_block == 128
    assert c.shared_mem_bytes == 2 * (2 * 64 * rs + 4 * 64 * rs + 64 * 72) + 16 * 64
    assert c.dq_mode == "red" and AttentionBwdConfig(deterministic=True).dq_mode == "pass"
    assert c.replace(deterministic=True, dq_mode="pass").shared_mem_bytes == 2 * (2 * 64 * rs + 4 * 64 * rs) + 16 * 64
    staged = c.replace(dq_mode="staged")
    assert c.dq_mt == 2 and c.dq_units == 2 * 3   # (64 / 32) row units x ceil(9 / 4) column units
    assert staged.shared_mem_bytes == c.shared_mem_bytes + 4 * 32 * 36 * 4
    assert staged.replace(dq_mode="bulk").shared_mem_bytes == staged.shared_mem_bytes
    assert staged.replace(deterministic=True).shared_mem_bytes == staged.shared_mem_bytes
    assert c.replace(ds_stages=2).shared_mem_bytes == c.shared_mem_bytes + 2 * 64 * 72
    with pytest.raises(ConfigError):
        AttentionBwdConfig(deterministic=True, dq_mode="pass", ds_stages=2)
    assert c.dq_shared_mem_bytes == 2 * (2 * 64 + 4 * 64) * rs + 8 * 64
    assert AttentionBwdConfig(head_dim=256, block_m=32, block_n=64, num_warps=8).d_split == 2
    assert rtk.families()["attention_backward"] is AttentionBwdConfig


def test_heuristics_cover_every_head_dim_and_fit():
    from rtkernels import arch
    for d in HEAD_DIMS:
        assert candidates(d)
        for a in ("sm_80", "sm_86", "sm_89", "sm_90"):
            for det in (False, True):
                cfg = choose_config("float16", d, True, det, a)
                lim = arch.limits(a).max_smem_per_block_optin
                assert cfg.shared_mem_bytes <= lim and cfg.dq_shared_mem_bytes <= lim
    for lo, hi, tiles in HEURISTICS:
        assert lo % 8 == 0 and hi % 8 == 0 and tiles and all(t.why for t in tiles)
    with pytest.raises(ConfigError):
        candidates(264)


def test_from_params_builds_what_the_op_runs():
    for d, causal, det in ((64, False, False), (64, True, True), (128, True, False), (200, False, True)):
        params = dict(dtype="bfloat16", head_dim=d, causal=causal, deterministic=det)
        assert AttentionBwdConfig.from_params(params, "sm_90") == choose_config("bfloat16", d, causal, det, "sm_90")
    # a hand-picked tile keeps the default layout and dq mode (the heuristic's may not fit it)
    c = AttentionBwdConfig.from_params(dict(head_dim=128, block_m=32), "sm_90")
    assert (c.block_m, c.layout, c.dq_mode, c.ds_stages) == (32, "keys16", "red", 1)


def test_template_renders_constexpr_block():
    from rtkernels.render import render
    cfg = AttentionBwdConfig(dtype="bfloat16", head_dim=40, causal=True, deterministic=True)
    src = render(cfg.template, cfg.template_params(), family="attention_backward").source
    for line in ("using T = __nv_bfloat16;", "constexpr int HEAD_DIM = 40;", "constexpr bool IS_CAUSAL = true;",
                 "constexpr bool DETERMINISTIC = true;", f"constexpr int SMEM_BYTES = {cfg.shared_mem_bytes};"):
        assert line in src
    assert all(f'{k}(' in src for k in KERNELS) and "{{" not in src


# ---- compile sweep --------------------------------------------------------------------------
def _build(args):
    cfg, name, arch = args
    return cfg, name, rtk.get_kernel(cfg, name, arch=arch).resources


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_heuristic_configs_compile_without_spills(arch, dtype, causal):
    cfgs = [choose_config(dtype, d, causal, det, arch) for d in SWEEP_HEAD_DIMS for det in (False, True)]
    jobs = [(c, n, arch) for c in cfgs
            for n in ("attention_bwd", "attention_bwd_dq" if c.dq_mode == "pass" else "attention_bwd_dq_convert")]
    jobs += [(choose_config(dtype, d, causal, False, arch), "attention_bwd_dot", arch) for d in SWEEP_HEAD_DIMS]
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(_build, jobs))
    bad = [(c.head_dim, c.deterministic, n, r.registers, r.spill_stores, r.spill_loads, r.stack_frame)
           for c, n, r in results if r.spill_stores or r.spill_loads or r.stack_frame]
    assert not bad, f"spills on {arch} {dtype} causal={causal}: {bad}"


def _ops(sass):
    return re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)


SASS_CASES = [("float16", 64, False, False, "sm_90"), ("bfloat16", 128, True, False, "sm_90"),
              ("float16", 40, True, True, "sm_80"), ("bfloat16", 256, False, True, "sm_90"),
              ("float16", 136, True, False, "sm_80"), ("bfloat16", 128, False, True, "sm_90"),
              ("bfloat16", 64, True, True, "sm_80")]


@pytest.mark.parametrize("dtype,d,causal,det,arch", SASS_CASES)
def test_sass_uses_tensor_cores_ldmatrix_cp_async(dtype, d, causal, det, arch):
    cfg = choose_config(dtype, d, causal, det, arch)
    names = ("attention_bwd", "attention_bwd_dq") if cfg.dq_mode == "pass" else ("attention_bwd",)
    for name in names:
        k = rtk.get_kernel(cfg, name, arch=arch)
        ops = _ops(k.sass)
        assert any(o.startswith("HMMA.16816.F32") for o in ops), name
        assert any(o == "LDSM.16.M88.4" for o in ops), name
        assert any(o.startswith("LDSM.16.MT88") for o in ops), f"{name}: ldmatrix.trans"
        assert any(o.startswith("LDGSTS.E.BYPASS.128") for o in ops), f"{name}: 16-byte cp.async"
        assert any(o.startswith("MUFU.EX2") for o in ops)
        assert any(o == "STG.E.128" for o in ops), f"{name}: 16-byte stores"
        assert not any(o.startswith(("LDL", "STL")) for o in ops), f"{name}: local memory"
        assert not rtk_inspect.flags(k), rtk_inspect.flags(k)
    _check_dq_path(cfg, arch)


def _check_dq_path(cfg, arch):
    ops = _ops(rtk.get_kernel(cfg, "attention_bwd", arch=arch).sass)
    red = [o for o in ops if o.startswith("RED")]
    bulk = [o for o in ops if o.startswith("UBLKRED")]
    assert not any(o.startswith("ATOM") for o in ops), "dQ by fire-and-forget reductions, never ATOM"
    f32_red = [o for o in red if ".F32" in o]
    if cfg.dq_mode == "pass":
        assert not red and not bulk, "dQ pass: no reductions in attention_bwd"
    elif cfg.dq_mode == "bulk" and arch == "sm_90":
        assert bulk, "bulk dQ: bulk reductions by the TMA engine"
        assert not f32_red, f"bulk dQ on sm_90: no lane reductions of f32 ({f32_red})"
    else:
        assert f32_red and not bulk, "dQ by lane reductions"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dq_mode,det,ds", [("red", False, 1), ("red", False, 2), ("staged", False, 2),
                                            ("staged", True, 2), ("bulk", False, 1), ("bulk", True, 2),
                                            ("pass", True, 1)])
def test_dq_modes_compile_to_their_paths(arch, dq_mode, det, ds):
    cfg = AttentionBwdConfig(dtype="bfloat16", head_dim=64, causal=True, deterministic=det, block_m=64, block_n=128,
                             num_warps=8, dq_mode=dq_mode, kv_regs=True, ds_stages=ds)
    k = rtk.get_kernel(cfg, "attention_bwd", arch=arch)
    assert k.resources.spill_stores == 0 and k.resources.spill_loads == 0
    _check_dq_path(cfg, arch)
    if det and dq_mode != "pass":   # the ordered flush: acquire spin + release count
        assert "ld_acquire_gpu_x4" in k.source and "red_release_gpu_add" in k.source
        assert any(o.startswith("LDG.E.128.STRONG.GPU") or o.startswith("LDG.E.STRONG.GPU.128")
                   or (o.startswith("LDG.E.128") and "STRONG" in o) for o in _ops(k.sass)), "acquire load"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d", [64, 128])
def test_sweep_candidates_compile(arch, d):
    """Every config the --sweep benchmark times compiles; pruning keeps the heuristic's choice and
    drops exactly the ones ptxas spills."""
    for det in (False, True):
        for causal in (False, True):
            cfgs = bwd_mod.tile_space("bfloat16", d, causal, det, arch)
            with ThreadPoolExecutor(4) as ex:
                results = list(ex.map(_build, [(c, "attention_bwd", arch) for c in cfgs]))
            clean = [c for c, _, r in results if not (r.spill_stores or r.spill_loads)]
            assert clean and clean[0] == choose_config("bfloat16", d, causal, det, arch)
            assert bwd_mod.tile_space("bfloat16", d, causal, det, arch, prune_spills=True) == clean


# ---- level 1: direct formulas and the tile loop -----------------------------------------------
def direct(do, q, k, v, causal, scale):
    """Per-head float64 forward + backward from the definitions; q (Hq, Sq, D), k/v (Hkv, Sk, D).
    Returns o, lse, dq, dk, dv (dk/dv summed over each GQA group)."""
    hq, sq, d = q.shape
    hkv, sk, _ = k.shape
    grp = hq // hkv
    o, lse, dq = np.zeros_like(q), np.full((hq, sq), NEG_INF), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for h in range(hq):
        kh, vh = k[h // grp], v[h // grp]
        s = scale * q[h] @ kh.T
        if causal:
            s = np.where(np.arange(sk)[None] <= np.arange(sq)[:, None] + sk - sq, s, NEG_INF)
        m = s.max(axis=1, keepdims=True) if sk else np.full((sq, 1), NEG_INF)
        seen = np.isfinite(m[:, 0])
        m = np.where(np.isfinite(m), m, 0)
        p = np.exp(s - m)
        l = p.sum(axis=1, keepdims=True)
        p = p / np.where(l > 0, l, 1)
        o[h] = p @ vh
        lse[h] = np.where(seen, m[:, 0] + np.log(np.where(l[:, 0] > 0, l[:, 0], 1)), NEG_INF)
        dv[h // grp] += p.T @ do[h]
        dp = do[h] @ vh.T
        ds = p * (dp - (do[h] * o[h]).sum(axis=1, keepdims=True))
        dq[h] = scale * ds @ kh
        dk[h // grp] += scale * ds.T @ q[h]
    return o, lse, dq, dk, dv


def _lse_log2(lse):
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(lse), np.inf, lse * LOG2E)


def tile_model(do, q, k, v, o, lse, causal, scale, block_m, block_n):
    """attention_bwd's loops in float64: per key tile, per (query head of the group, query tile)."""
    hq, sq, d = q.shape
    hkv, sk, _ = k.shape
    grp = hq // hkv
    diag = sk - sq
    delta = (do * o).sum(axis=2)
    dq = np.zeros_like(q)
    dk, dv = np.full_like(k, np.nan), np.full_like(v, np.nan)
    m_blocks = -(-sq // block_m)
    for hk in range(hkv):
        for n_block in range(-(-sk // block_n)):
            n0 = n_block * block_n
            keys = n0 + np.arange(block_n)
            kt, vt = np.zeros((block_n, d)), np.zeros((block_n, d))
            kt[keys < sk], vt[keys < sk] = k[hk, keys[keys < sk]], v[hk, keys[keys < sk]]
            m_begin = max(0, n0 - diag) // block_m if causal else 0
            # query tiles before m_begin see no key of this tile
            rows = np.arange(m_begin * block_m)
            vis = (keys[:, None] < sk) & (~causal | (keys[:, None] <= rows[None, :] + diag))
            assert not vis.any()
            n_m = max(0, m_blocks - m_begin)
            acc_dk, acc_dv = np.zeros((block_n, d)), np.zeros((block_n, d))
            for step in range(grp * n_m):
                h = hk * grp + step // n_m
                m0 = (m_begin + step % n_m) * block_m
                rows = m0 + np.arange(block_m)
                valid = rows < sq
                qt, dot_ = np.zeros((block_m, d)), np.zeros((block_m, d))
                qt[valid], dot_[valid] = q[h, rows[valid]], do[h, rows[valid]]
                lse2 = np.full(block_m, np.inf)
                lse2[valid] = _lse_log2(lse[h, rows[valid]])
                dl = np.zeros(block_m)
                dl[valid] = delta[h, rows[valid]]
                st = kt @ qt.T                        # S^T: keys x queries
                masked = (keys[:, None] >= sk) | (causal & (keys[:, None] > rows[None, :] + diag))
                if n0 + block_n > sk or (causal and n0 + block_n - 1 > m0 + diag):
                    first = np.where(keys >= sk, block_m, 0)
                    if causal:
                        first = np.maximum(first, keys - diag - m0)
                    kmask = np.arange(block_m)[None, :] < first[:, None]
                    assert (kmask == masked).all()
                    st = np.where(kmask, NEG_INF, st)
                else:
                    assert not masked.any(), "a tile the kernel does not mask has a masked score"
                with np.errstate(invalid="raise"):
                    pt = np.exp2(st * scale * LOG2E - lse2[None, :])
                dpt = vt @ dot_.T
                dst = pt * (dpt - dl[None, :])
                assert np.isfinite(pt).all() and np.isfinite(dst).all()
                acc_dv += pt @ dot_
                acc_dk += dst @ qt
                dq_part = dst.T @ kt
                dq[h, rows[valid]] += dq_part[valid]
            kv = keys < sk
            dk[hk, keys[kv]] = scale * acc_dk[kv]
            dv[hk, keys[kv]] = acc_dv[kv]
    return scale * dq, dk, dv


def _rand_problem(rng, sq, sk, hq, hkv, d):
    q, do = rng.standard_normal((hq, sq, d)), rng.standard_normal((hq, sq, d))
    k, v = rng.standard_normal((hkv, sk, d)), rng.standard_normal((hkv, sk, d))
    return do, q, k, v


SHAPES = [(1, 1), (1, 17), (17, 1), (17, 17), (113, 70), (70, 113), (64, 64), (65, 64), (3, 100), (100, 3)]


@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_m,block_n", [(64, 64), (32, 64), (16, 32), (64, 16)])
@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 2), (3, 1)])
def test_tile_model_matches_direct_formulas(sq, sk, causal, block_m, block_n, hq, hkv):
    rng = np.random.default_rng(sq * 1000 + sk)
    d = 8
    do, q, k, v = _rand_problem(rng, sq, sk, hq, hkv, d)
    scale = 0.7 / math.sqrt(d)
    o, lse, dq_ref, dk_ref, dv_ref = direct(do, q, k, v, causal, scale)
    dq, dk, dv = tile_model(do, q, k, v, o, lse, causal, scale, block_m, block_n)
    for got, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-10)


def test_rows_without_keys_have_zero_gradients():
    # causal with sq > sk: the first sq - sk query rows see no key (lse = -inf)
    rng = np.random.default_rng(1)
    do, q, k, v = _rand_problem(rng, 40, 10, 2, 1, 8)
    o, lse, *_ = direct(do, q, k, v, True, 0.3)
    assert np.isneginf(lse[:, :30]).all()
    dq, dk, dv = tile_model(do, q, k, v, o, lse, True, 0.3, 16, 16)
    assert (dq[:, :30] == 0).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


# ---- level 2: warp-level emulation --------------------------------------------------------
def odd(elems):
    return ((elems // 8) | 1) * 8


class BwdLayout:
    """The template's constexpr block."""

    def __init__(self, cfg: AttentionBwdConfig):
        self.HEAD_DIM, self.BLOCK_M, self.BLOCK_N = cfg.head_dim, cfg.block_m, cfg.block_n
        self.NUM_WARPS, self.DETERMINISTIC = cfg.num_warps, cfg.deterministic
        self.DQ_PASS, self.DQ_STAGED = cfg.dq_mode == "pass", cfg.dq_mode in ("staged", "bulk")
        self.DS_STAGES = cfg.ds_stages
        self.THREADS = 32 * cfg.num_warps
        self.PAIR = cfg.layout == "pair"
        self.WM = 2 if self.PAIR else 1
        self.KEY_GROUPS = cfg.block_n // (16 * self.WM)
        self.KEY_WARPS = cfg.num_warps if self.PAIR else cfg.block_n // 16
        self.D_SPLIT = 2 if self.PAIR else self.NUM_WARPS // self.KEY_GROUPS
        self.QSPLIT = 2 if self.PAIR else 1
        assert self.KEY_GROUPS * self.D_SPLIT == self.NUM_WARPS
        self.HEAD_DIM_PAD = (cfg.head_dim + 15) // 16 * 16
        self.CHUNKS = cfg.head_dim // 8
        self.K_STEPS_D = self.HEAD_DIM_PAD // 16
        self.NT_D = cfg.head_dim // 8
        self.NT_W = -(-self.NT_D // self.D_SPLIT)
        self.NT_M = cfg.block_m // 8
        self.K_STEPS_M = cfg.block_m // 16
        self.NT_MW = self.NT_M // self.QSPLIT
        self.K_OWN = self.K_STEPS_M // self.QSPLIT
        self.DQ_COL_UNITS = -(-self.NT_D // 4)
        self.DQ_MT = 2 if (cfg.block_m % 32 == 0 and (cfg.block_m // 32) * self.DQ_COL_UNITS >= cfg.num_warps) else 1
        self.DQ_ROW_UNITS = cfg.block_m // (16 * self.DQ_MT)
        self.DQ_UNITS = self.DQ_ROW_UNITS * self.DQ_COL_UNITS
        self.RS = odd(self.HEAD_DIM_PAD)
        self.DS_STRIDE = odd(cfg.block_m)
        self.KV_TILE = cfg.block_n * self.RS
        self.QO_TILE = cfg.block_m * self.RS
        self.DS_TILE1 = cfg.block_n * self.DS_STRIDE
        self.DS_TILE = 0 if (self.DQ_PASS and not self.PAIR) else cfg.ds_stages * self.DS_TILE1
        self.P_TILE = self.DS_TILE1 if self.PAIR else 0
        self.HALF_ELEMS = 2 * self.KV_TILE + 4 * self.QO_TILE + self.DS_TILE + self.P_TILE
        self.DQ_NUM_WARPS, self.DQ_BLOCK_N = cfg.dq_num_warps, cfg.dq_block_n
        self.DQ_BLOCK_M = 16 * cfg.dq_num_warps
        assert self.DQ_MT == cfg.dq_mt and self.DQ_UNITS == cfg.dq_units
        staged = cfg.num_warps * self.DQ_MT * 16 * 36 * 4 if self.DQ_STAGED else 0
        assert cfg.shared_mem_bytes == 2 * self.HALF_ELEMS + 16 * cfg.block_m + staged
        assert cfg.dq_shared_mem_bytes == 2 * (2 * self.DQ_BLOCK_M + 4 * self.DQ_BLOCK_N) * self.RS + 8 * self.DQ_BLOCK_M


def _rows(a, start, count):
    out = np.zeros((count, a.shape[1]), np.float32)
    hi = min(a.shape[0], start + count)
    if hi > start:
        out[:hi - start] = a[start:hi]
    return out


def _frag(acc, kk, dtype):
    """Accumulator n-tiles 2kk, 2kk+1 -> A registers a0..a3, (32, 4, 2)."""
    return np.stack([pack2(acc[2 * kk, :, 0], acc[2 * kk, :, 1], dtype),
                     pack2(acc[2 * kk, :, 2], acc[2 * kk, :, 3], dtype),
                     pack2(acc[2 * kk + 1, :, 0], acc[2 * kk + 1, :, 1], dtype),
                     pack2(acc[2 * kk + 1, :, 2], acc[2 * kk + 1, :, 3], dtype)], axis=1)


def emulate_bwd_cta(do, q, k, v, lse, delta, *, n_block, cfg, scale, dq_accum):
    """attention_bwd for one (key tile, kv head): q/do (G, Sq, D) of the group's query heads,
    k/v (Sk, D), lse/delta (G, Sq) - all already in the input dtype's values.  Adds the unscaled
    dQ into dq_accum (G, Sq, D) and returns the dk, dv rows of the tile (as the kernel stores)."""
    L = BwdLayout(cfg)
    dtype = cfg.dtype
    grp, sq, d = q.shape
    sk = k.shape[0]
    diag = sk - sq
    n0 = n_block * L.BLOCK_N
    rows_k = min(L.BLOCK_N, sk - n0)
    m_begin = max(0, n0 - diag) // L.BLOCK_M if cfg.causal else 0
    n_m = max(0, -(-sq // L.BLOCK_M) - m_begin)
    steps = grp * n_m
    smem = np.full(L.HALF_ELEMS, np.nan, np.float32)
    sK, sV = 0, L.KV_TILE
    sQ, sdO = 2 * L.KV_TILE, 2 * L.KV_TILE + 2 * L.QO_TILE
    sdS = sdO + 2 * L.QO_TILE
    sP = sdS + L.DS_TILE
    sLse, sDelta = np.full(2 * L.BLOCK_M, np.nan, np.float32), np.full(2 * L.BLOCK_M, np.nan, np.float32)
    if L.HEAD_DIM_PAD != L.HEAD_DIM:
        for r in range(2 * L.BLOCK_N + 4 * L.BLOCK_M):
            smem[r * L.RS + L.HEAD_DIM: r * L.RS + L.HEAD_DIM + 8] = 0
    ld = SimpleNamespace(THREADS=L.THREADS, CHUNKS=L.CHUNKS)

    def load_step(step, stage):
        h = step // n_m
        m0 = (m_begin + step % n_m) * L.BLOCK_M
        load_tile(ld, smem, sQ + stage * L.QO_TILE, L.BLOCK_M, L.RS, _rows(q[h], m0, L.BLOCK_M), sq - m0)
        load_tile(ld, smem, sdO + stage * L.QO_TILE, L.BLOCK_M, L.RS, _rows(do[h], m0, L.BLOCK_M), sq - m0)
        for tid in range(L.BLOCK_M):
            valid = m0 + tid < sq
            sLse[stage * L.BLOCK_M + tid] = _lse_log2(lse[h, m0 + tid]) if valid else np.inf
            sDelta[stage * L.BLOCK_M + tid] = delta[h, m0 + tid] if valid else 0

    load_tile(ld, smem, sK, L.BLOCK_N, L.RS, _rows(k, n0, L.BLOCK_N), rows_k)
    load_tile(ld, smem, sV, L.BLOCK_N, L.RS, _rows(v, n0, L.BLOCK_N), rows_k)
    if steps > 0:
        load_step(0, 0)

    lane, g, t = LANE, G, TQ
    b_lane = ((lane & 7) + ((lane >> 4) << 3)) * L.RS + ((lane >> 3) & 1) * 8
    t_lane = (lane & 15) * L.RS + (lane >> 4) * 8
    t_lane_x2 = (lane & 15) * L.RS
    ds_lane = ((lane & 7) + ((lane >> 4) << 3)) * L.DS_STRIDE + ((lane >> 3) & 1) * 8
    scale_log2 = np.float32(scale * LOG2E)
    warps = []
    for warp in range(L.NUM_WARPS):
        kg = warp // 2 if L.PAIR else warp % L.KEY_GROUPS
        ch = warp % 2 if L.PAIR else warp // L.KEY_GROUPS
        qh = warp % 2 if L.PAIR else 0
        key0 = kg * 16 * L.WM
        nt_begin = ch * L.NT_W
        warps.append(dict(key0=key0, qh=qh, q_off=qh * (L.BLOCK_M // L.QSPLIT), nt_begin=nt_begin,
                          nt_end=min(L.NT_D, nt_begin + L.NT_W),
                          a_lane=(key0 + (lane & 15)) * L.RS + (lane >> 4) * 8,
                          p_lane=(key0 + (lane & 15)) * L.DS_STRIDE + (lane >> 4) * 8,
                          dk=np.zeros((L.WM, L.NT_W, 32, 4), np.float32), dv=np.zeros((L.WM, L.NT_W, 32, 4), np.float32)))

    def dvdk_step(W, pf, df, kq, sQs, sdOs):
        for jp in range((L.NT_W + 1) // 2):
            j0 = W["nt_begin"] + 2 * jp
            if j0 + 1 < W["nt_end"]:
                bo = ldmatrix(smem, sdOs + t_lane + kq * 16 * L.RS + j0 * 8, 4, trans=True)
                bq = ldmatrix(smem, sQs + t_lane + kq * 16 * L.RS + j0 * 8, 4, trans=True)
                for i in range(L.WM):
                    mma(W["dv"][i, 2 * jp], pf[i], bo[:, 0], bo[:, 1])
                    mma(W["dv"][i, 2 * jp + 1], pf[i], bo[:, 2], bo[:, 3])
                    mma(W["dk"][i, 2 * jp], df[i], bq[:, 0], bq[:, 1])
                    mma(W["dk"][i, 2 * jp + 1], df[i], bq[:, 2], bq[:, 3])
            elif j0 < W["nt_end"]:
                bo = ldmatrix(smem, sdOs + t_lane_x2 + kq * 16 * L.RS + j0 * 8, 2, trans=True)
                bq = ldmatrix(smem, sQs + t_lane_x2 + kq * 16 * L.RS + j0 * 8, 2, trans=True)
                for i in range(L.WM):
                    mma(W["dv"][i, 2 * jp], pf[i], bo[:, 0], bo[:, 1])
                    mma(W["dk"][i, 2 * jp], df[i], bq[:, 0], bq[:, 1])

    def dq_step(s_, sdS_s):
        """dQ of step s_ from the dS^T buffer at sdS_s: DQ_MT x 16 rows x 4 column tiles per unit; a
        staged unit goes through the warp's own 36-float rows, only rows below seqlen_q leave."""
        h_ = s_ // n_m
        m0_ = (m_begin + s_ % n_m) * L.BLOCK_M
        for warp in range(L.NUM_WARPS):
            for u in range(warp, L.DQ_UNITS, L.NUM_WARPS):
                mt0 = (u % L.DQ_ROW_UNITS) * L.DQ_MT
                j0 = (u // L.DQ_ROW_UNITS) * 4
                acc = np.zeros((L.DQ_MT, 4, 32, 4), np.float32)
                for kk in range(L.BLOCK_N // 16):
                    a = [ldmatrix(smem, sdS_s + ds_lane + kk * 16 * L.DS_STRIDE + (mt0 + i) * 16, 4, trans=True)
                         for i in range(L.DQ_MT)]
                    for p in range(2):
                        if j0 + 2 * p < L.NT_D:
                            bk = ldmatrix(smem, sK + t_lane + kk * 16 * L.RS + (j0 + 2 * p) * 8, 4, trans=True)
                            for i in range(L.DQ_MT):
                                mma(acc[i, 2 * p], a[i], bk[:, 0], bk[:, 1])
                                mma(acc[i, 2 * p + 1], a[i], bk[:, 2], bk[:, 3])
                row0 = mt0 * 16
                staged = np.full((L.DQ_MT * 16, 36), np.nan, np.float32)   # the warp's sdQw
                for i in range(L.DQ_MT):
                    for half in range(2):
                        for j in range(4):
                            for ln in range(32):
                                r = i * 16 + g[ln] + 8 * half
                                vals = acc[i, j, ln, 2 * half: 2 * half + 2]
                                if L.DQ_STAGED:
                                    staged[r, j * 8 + 2 * t[ln]: j * 8 + 2 * t[ln] + 2] = vals
                                elif j0 + j < L.NT_D and m0_ + row0 + r < sq:
                                    c = (j0 + j) * 8 + 2 * t[ln]
                                    dq_accum[h_, m0_ + row0 + r, c:c + 2] += vals
                if L.DQ_STAGED:
                    rows = min(L.DQ_MT * 16, sq - m0_ - row0)
                    width = min(32, d - j0 * 8)
                    if rows > 0:
                        assert not np.isnan(staged[:rows, :width]).any(), "a staged dQ element was never written"
                        dq_accum[h_, m0_ + row0: m0_ + row0 + rows, j0 * 8: j0 * 8 + width] += staged[:rows, :width]

    for step in range(steps):
        stage = step & 1
        sQs, sdOs = sQ + stage * L.QO_TILE, sdO + stage * L.QO_TILE
        m0 = (m_begin + step % n_m) * L.BLOCK_M
        if step + 1 < steps:
            load_step(step + 1, stage ^ 1)   # sequential emulation: the other stage cannot race
        sdS_w = sdS + (stage if L.DS_STAGES == 2 else 0) * L.DS_TILE1
        if not L.DQ_PASS and L.DS_STAGES == 2 and step > 0:
            dq_step(step - 1, sdS + (stage ^ 1) * L.DS_TILE1)
            old = sdS + (stage ^ 1) * L.DS_TILE1
            smem[old:old + L.DS_TILE1] = np.nan   # consumed: the next write to it must be complete
        frags = []
        for warp, W in enumerate(warps):   # S^T/dP^T, P^T/dS^T; stores (before the pair barrier)
            acc_s = np.zeros((L.WM, L.NT_MW, 32, 4), np.float32)
            acc_dp = np.zeros((L.WM, L.NT_MW, 32, 4), np.float32)
            q_off = W["q_off"]
            for kk in range(L.K_STEPS_D):
                ak = [ldmatrix(smem, sK + W["a_lane"] + i * 16 * L.RS + kk * 16, 4) for i in range(L.WM)]
                av = [ldmatrix(smem, sV + W["a_lane"] + i * 16 * L.RS + kk * 16, 4) for i in range(L.WM)]
                for np_ in range(L.NT_MW // 2):
                    bq = ldmatrix(smem, sQs + b_lane + (q_off + np_ * 16) * L.RS + kk * 16, 4)
                    bo = ldmatrix(smem, sdOs + b_lane + (q_off + np_ * 16) * L.RS + kk * 16, 4)
                    for i in range(L.WM):
                        mma(acc_s[i, 2 * np_], ak[i], bq[:, 0], bq[:, 1])
                        mma(acc_s[i, 2 * np_ + 1], ak[i], bq[:, 2], bq[:, 3])
                        mma(acc_dp[i, 2 * np_], av[i], bo[:, 0], bo[:, 1])
                        mma(acc_dp[i, 2 * np_ + 1], av[i], bo[:, 2], bo[:, 3])
            if n0 + L.BLOCK_N > sk or (cfg.causal and n0 + L.BLOCK_N - 1 > m0 + diag):
                for i in range(L.WM):
                    for half in range(2):
                        key = n0 + W["key0"] + 16 * i + g + 8 * half
                        first = np.where(key >= sk, L.BLOCK_M, 0)
                        if cfg.causal:
                            first = np.maximum(first, key - diag - m0)
                        for j in range(L.NT_MW):
                            for e in range(2):
                                acc_s[i, j, :, 2 * half + e] = np.where(q_off + j * 8 + 2 * t + e < first, NEG_INF,
                                                                        acc_s[i, j, :, 2 * half + e])
            for j in range(L.NT_MW):
                for e in range(2):
                    l2 = sLse[stage * L.BLOCK_M + q_off + j * 8 + 2 * t + e]
                    dl = sDelta[stage * L.BLOCK_M + q_off + j * 8 + 2 * t + e]
                    assert not np.isnan(l2).any() and not np.isnan(dl).any(), "lse/delta read before written"
                    for i in range(L.WM):
                        for half in range(2):
                            with np.errstate(invalid="raise"):
                                p = np.exp2(acc_s[i, j, :, 2 * half + e] * scale_log2 - l2).astype(np.float32)
                            acc_dp[i, j, :, 2 * half + e] = p * (acc_dp[i, j, :, 2 * half + e] - dl)
                            acc_s[i, j, :, 2 * half + e] = p
            p_frag = [[_frag(acc_s[i], kk, dtype) for i in range(L.WM)] for kk in range(L.K_OWN)]
            ds_frag = [[_frag(acc_dp[i], kk, dtype) for i in range(L.WM)] for kk in range(L.K_OWN)]
            frags.append((p_frag, ds_frag))
            if (not L.DQ_PASS or L.PAIR) and warp < L.KEY_WARPS:
                for kk in range(L.K_OWN):
                    for i in range(L.WM):
                        for r in range(4):
                            row = W["key0"] + 16 * i + g + 8 * (r & 1)
                            col = q_off + kk * 16 + 8 * (r >> 1) + 2 * t
                            for ln in range(32):
                                a = row[ln] * L.DS_STRIDE + col[ln]
                                smem[sdS_w + a:sdS_w + a + 2] = ds_frag[kk][i][ln, r]
                                if L.PAIR:
                                    smem[sP + a:sP + a + 2] = p_frag[kk][i][ln, r]
        for warp, W in enumerate(warps):   # dV/dK: own query steps, then (pair) the partner's from smem
            p_frag, ds_frag = frags[warp]
            for kk in range(L.K_OWN):
                dvdk_step(W, p_frag[kk], ds_frag[kk], W["qh"] * L.K_OWN + kk, sQs, sdOs)
            if L.PAIR:
                for kk in range(L.K_OWN):
                    kq = (1 - W["qh"]) * L.K_OWN + kk
                    pa = [ldmatrix(smem, sP + W["p_lane"] + i * 16 * L.DS_STRIDE + kq * 16, 4) for i in range(L.WM)]
                    da = [ldmatrix(smem, sdS_w + W["p_lane"] + i * 16 * L.DS_STRIDE + kq * 16, 4) for i in range(L.WM)]
                    dvdk_step(W, pa, da, kq, sQs, sdOs)
        if L.PAIR:
            smem[sP:sP + L.P_TILE] = np.nan   # the next step rewrites every element it reads
        if not L.DQ_PASS and L.DS_STAGES == 1:   # after the barrier: every warp's dS^T is in smem
            dq_step(step, sdS)
            smem[sdS:sdS + L.DS_TILE1] = np.nan   # the next step must rewrite every element it reads
    if not L.DQ_PASS and L.DS_STAGES == 2 and steps > 0:
        dq_step(steps - 1, sdS + ((steps - 1) & 1) * L.DS_TILE1)

    # epilogue: stage dK * scale, dV in the warp's K/V rows, then 16-byte chunks
    for W in warps:
        for i, half in ((i, half) for i in range(L.WM) for half in range(2)):
            r = W["key0"] + 16 * i + g + 8 * half
            for j in range(L.NT_W):
                if W["nt_begin"] + j < W["nt_end"]:
                    col = (W["nt_begin"] + j) * 8 + 2 * t
                    kv = pack2(W["dk"][i, j, :, 2 * half] * np.float32(scale),
                               W["dk"][i, j, :, 2 * half + 1] * np.float32(scale), dtype)
                    vv = pack2(W["dv"][i, j, :, 2 * half], W["dv"][i, j, :, 2 * half + 1], dtype)
                    for ln in range(32):
                        smem[sK + r[ln] * L.RS + col[ln]: sK + r[ln] * L.RS + col[ln] + 2] = kv[ln]
                        smem[sV + r[ln] * L.RS + col[ln]: sV + r[ln] * L.RS + col[ln] + 2] = vv[ln]
    dk_out = np.array([smem[sK + r * L.RS: sK + r * L.RS + d] for r in range(rows_k)]).reshape(rows_k, d)
    dv_out = np.array([smem[sV + r * L.RS: sV + r * L.RS + d] for r in range(rows_k)]).reshape(rows_k, d)
    return dk_out, dv_out


def emulate_dq_cta(do, q, k, v, lse, delta, *, m_block, cfg, scale):
    """attention_bwd_dq for one (query tile, head): q/do (Sq, D), k/v (Sk, D), lse/delta (Sq)."""
    L = BwdLayout(cfg)
    dtype = cfg.dtype
    sq, d = q.shape
    sk = k.shape[0]
    diag = sk - sq
    M, N = L.DQ_BLOCK_M, L.DQ_BLOCK_N
    m0 = m_block * M
    rows_q = min(M, sq - m0)
    n_blocks = -(-sk // N)
    if cfg.causal:
        last = min(sk, m0 + rows_q + diag)
        n_blocks = -(-last // N) if last > 0 else 0
    q_tile, k_tile = M * L.RS, N * L.RS
    sQ, sdO, sK = 0, q_tile, 2 * q_tile
    sV = sK + 2 * k_tile
    smem = np.full(2 * q_tile + 4 * k_tile, np.nan, np.float32)
    if L.HEAD_DIM_PAD != L.HEAD_DIM:
        for r in range(2 * M + 4 * N):
            smem[r * L.RS + L.HEAD_DIM: r * L.RS + L.HEAD_DIM + 8] = 0
    ld = SimpleNamespace(THREADS=32 * L.DQ_NUM_WARPS, CHUNKS=L.CHUNKS)
    load_tile(ld, smem, sQ, M, L.RS, _rows(q, m0, M), rows_q)
    load_tile(ld, smem, sdO, M, L.RS, _rows(do, m0, M), rows_q)
    lane, g, t = LANE, G, TQ
    b_lane = ((lane & 7) + ((lane >> 4) << 3)) * L.RS + ((lane >> 3) & 1) * 8
    t_lane = (lane & 15) * L.RS + (lane >> 4) * 8
    t_lane_x2 = (lane & 15) * L.RS
    scale_log2 = np.float32(scale * LOG2E)
    out = np.full((rows_q, d), np.nan, np.float32)
    accs = [np.zeros((L.NT_D, 32, 4), np.float32) for _ in range(L.DQ_NUM_WARPS)]
    for n in range(n_blocks):
        stage = n & 1
        key0 = n * N
        load_tile(ld, smem, sK + stage * k_tile, N, L.RS, _rows(k, key0, N), sk - key0)
        load_tile(ld, smem, sV + stage * k_tile, N, L.RS, _rows(v, key0, N), sk - key0)
        sKn, sVn = sK + stage * k_tile, sV + stage * k_tile
        for warp in range(L.DQ_NUM_WARPS):
            a_lane = (warp * 16 + (lane & 15)) * L.RS + (lane >> 4) * 8
            acc_s = np.zeros((N // 8, 32, 4), np.float32)
            acc_dp = np.zeros((N // 8, 32, 4), np.float32)
            for kk in range(L.K_STEPS_D):
                aq = ldmatrix(smem, sQ + a_lane + kk * 16, 4)
                ao = ldmatrix(smem, sdO + a_lane + kk * 16, 4)
                for np_ in range(N // 16):
                    bk = ldmatrix(smem, sKn + b_lane + np_ * 16 * L.RS + kk * 16, 4)
                    bv = ldmatrix(smem, sVn + b_lane + np_ * 16 * L.RS + kk * 16, 4)
                    mma(acc_s[2 * np_], aq, bk[:, 0], bk[:, 1])
                    mma(acc_s[2 * np_ + 1], aq, bk[:, 2], bk[:, 3])
                    mma(acc_dp[2 * np_], ao, bv[:, 0], bv[:, 1])
                    mma(acc_dp[2 * np_ + 1], ao, bv[:, 2], bv[:, 3])
            lse2, dl = [], []
            for half in range(2):
                row = m0 + warp * 16 + g + 8 * half
                valid = row < sq
                rr = np.minimum(row, sq - 1)
                lse2.append(np.where(valid, _lse_log2(lse[rr]), np.inf).astype(np.float32))
                dl.append(np.where(valid, delta[rr], 0).astype(np.float32))
            if key0 + N > sk or (cfg.causal and key0 + N - 1 > m0 + diag):
                for half in range(2):
                    limit = np.full(32, sk - key0)
                    if cfg.causal:
                        limit = np.minimum(limit, m0 + warp * 16 + g + 8 * half + diag + 1 - key0)
                    for j in range(N // 8):
                        for e in range(2):
                            acc_s[j, :, 2 * half + e] = np.where(j * 8 + 2 * t + e >= limit, NEG_INF,
                                                                 acc_s[j, :, 2 * half + e])
            for j in range(N // 8):
                for half in range(2):
                    for e in range(2):
                        with np.errstate(invalid="raise"):
                            p = np.exp2(acc_s[j, :, 2 * half + e] * scale_log2 - lse2[half]).astype(np.float32)
                        acc_dp[j, :, 2 * half + e] = p * (acc_dp[j, :, 2 * half + e] - dl[half])
            for kk in range(N // 16):
                a = _frag(acc_dp, kk, dtype)
                for dp in range(L.NT_D // 2):
                    bk = ldmatrix(smem, sKn + t_lane + kk * 16 * L.RS + dp * 16, 4, trans=True)
                    mma(accs[warp][2 * dp], a, bk[:, 0], bk[:, 1])
                    mma(accs[warp][2 * dp + 1], a, bk[:, 2], bk[:, 3])
                if L.NT_D % 2:
                    bk = ldmatrix(smem, sKn + t_lane_x2 + kk * 16 * L.RS + (L.NT_D - 1) * 8, 2, trans=True)
                    mma(accs[warp][L.NT_D - 1], a, bk[:, 0], bk[:, 1])
    for warp in range(L.DQ_NUM_WARPS):
        for half in range(2):
            row = warp * 16 + g + 8 * half
            for j in range(L.NT_D):
                vals = pack2(accs[warp][j, :, 2 * half] * np.float32(scale),
                             accs[warp][j, :, 2 * half + 1] * np.float32(scale), dtype)
                for ln in range(32):
                    if row[ln] < rows_q:
                        out[row[ln], j * 8 + 2 * t[ln]: j * 8 + 2 * t[ln] + 2] = vals[ln]
    return out


def _emulate_all(do, q, k, v, causal, scale, cfg):
    """Every CTA of the three launches for one kv head (q/do: its G query heads)."""
    dtype = cfg.dtype
    do, q, k, v = (round_to(a, dtype) for a in (do, q, k, v))
    grp, sq, d = q.shape
    sk = k.shape[1]
    o, lse, *_ = direct(do.astype(np.float64), q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                        causal, scale)
    o = round_to(o, dtype)
    delta = (do.astype(np.float32) * o).sum(axis=2)
    lse = lse.astype(np.float32)
    dq_accum = np.zeros((grp, sq, d), np.float32)
    dk = np.full((sk, d), np.nan, np.float32)
    dv = np.full((sk, d), np.nan, np.float32)
    for n_block in range(-(-sk // cfg.block_n)):
        n0 = n_block * cfg.block_n
        dk_t, dv_t = emulate_bwd_cta(do, q, k[0], v[0], lse, delta, n_block=n_block, cfg=cfg, scale=scale,
                                     dq_accum=dq_accum)
        dk[n0:n0 + len(dk_t)], dv[n0:n0 + len(dv_t)] = dk_t, dv_t
    if cfg.dq_mode == "pass":
        dq = np.full((grp, sq, d), np.nan, np.float32)
        for h in range(grp):
            for m_block in range(-(-sq // cfg.dq_block_m)):
                m0 = m_block * cfg.dq_block_m
                t_ = emulate_dq_cta(do[h], q[h], k[0], v[0], lse[h], delta[h], m_block=m_block, cfg=cfg, scale=scale)
                dq[h, m0:m0 + len(t_)] = t_
    else:
        dq = round_to(dq_accum * np.float32(scale), dtype)
    return dq, dk, dv, (do, q, k, v)


def _rel(a, b):
    den = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (den if den > 0 else 1.0)


EMU_CASES = [
    # sq, sk, grp, d, causal, block_m, block_n, warps, dq_n, dq_w, deterministic
    (40, 40, 1, 16, False, 32, 32, 2, 32, 2, False),
    (37, 50, 2, 24, True, 32, 32, 2, 16, 2, False),     # head dim pad (24 -> 32), GQA 2, sq < sk
    (50, 21, 1, 40, True, 16, 32, 2, 32, 2, False),     # sq > sk: rows with no key; 5 col tiles
    (33, 45, 2, 40, False, 32, 32, 4, 32, 2, True),     # d_split 2 with an odd tile count
    (20, 20, 1, 8, True, 32, 16, 2, 16, 2, True),       # d 8, d_split 2 (1 tile + 0 tiles)
    (30, 17, 1, 56, False, 16, 32, 2, 32, 4, True),
    (17, 70, 1, 48, True, 32, 32, 4, 32, 2, False),     # d_split 2, 3 tiles each; 6 tiles = 1.5 dq units
]
# staged dQ (a flush per step into the accumulator), two m-tiles per dQ unit (DQ_MT = 2), and the
# key-tile shapes of the heuristics (64 x 128 with 8 warps)
EMU_STAGED = [
    # sq, sk, grp, d, causal, block_m, block_n, warps, deterministic, ds_stages
    (70, 45, 2, 40, True, 64, 32, 2, False, 1),    # DQ_MT 2 (2 row units x 2 col units >= 2 warps), GQA
    (70, 45, 2, 40, True, 64, 32, 2, False, 2),    # ... dQ of step i in step i + 1
    (37, 50, 1, 24, False, 32, 32, 2, True, 2),    # head dim pad, ordered flush (same numbers)
    (65, 130, 1, 16, True, 64, 128, 8, False, 2),  # 8 warps, 128 keys; DQ_MT 1 (2 units < 8 warps)
    (50, 21, 3, 56, True, 32, 32, 2, False, 1),    # sq > sk (rows without keys), width-24 last column unit
]
# layout "pair": two warps share 32 keys (sq, sk, grp, d, causal, block_m, block_n, warps, dq_mode, ds_stages)
EMU_PAIR = [
    (70, 45, 2, 40, True, 64, 32, 2, "red", 1),      # one pair, odd column-tile count split 3 + 2
    (37, 70, 1, 24, False, 32, 64, 4, "staged", 2),  # two pairs, block_m 32 (one own query step), head dim pad
    (65, 130, 1, 16, True, 64, 128, 8, "bulk", 2),   # four pairs; d16: each warp one column tile
    (33, 40, 2, 32, True, 64, 32, 2, "pass", 1),     # P^T and dS^T exchanged even without dQ here
]


@pytest.mark.parametrize("sq,sk,grp,d,causal,bm,bn,w,dqn,dqw,det", EMU_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_kernels_match_direct_formulas(sq, sk, grp, d, causal, bm, bn, w, dqn, dqw, det, dtype):
    cfg = AttentionBwdConfig(dtype=dtype, head_dim=d, causal=causal, deterministic=det, block_m=bm, block_n=bn,
                             num_warps=w, dq_block_n=dqn, dq_num_warps=dqw)
    rng = np.random.default_rng(sq * 7 + sk + d)
    do, q, k, v = (x.astype(np.float32) for x in _rand_problem(rng, sq, sk, grp, 1, d))
    scale = 1 / math.sqrt(d)
    dq, dk, dv, (do, q, k, v) = _emulate_all(do, q, k, v, causal, scale, cfg)
    _, _, dq_ref, dk_ref, dv_ref = direct(*(x.astype(np.float64) for x in (do, q, k, v)), causal, scale)
    tol = 2e-3 if dtype == "float16" else 1.5e-2   # measured 3e-4 (f16); index errors give O(1)
    for name, got, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref[0]), ("dv", dv, dv_ref[0])):
        assert not np.isnan(got).any(), f"{name}: NaN (an element never written or 0 * inf)"
        assert _rel(got, ref) < tol, f"{name}: rel err {_rel(got, ref):.3e}"
    if causal and sq > sk:
        assert (dq[:, :sq - sk] == 0).all(), "rows that see no key get dq = 0"


@pytest.mark.parametrize("sq,sk,grp,d,causal,bm,bn,w,det,ds", EMU_STAGED)
@pytest.mark.parametrize("dq_mode", ["red", "staged"])
def test_emulated_staged_dq_matches_direct_formulas(sq, sk, grp, d, causal, bm, bn, w, det, ds, dq_mode):
    if det and dq_mode == "red":
        pytest.skip("red is not deterministic")
    cfg = AttentionBwdConfig(dtype="bfloat16", head_dim=d, causal=causal, deterministic=det, block_m=bm, block_n=bn,
                             num_warps=w, dq_block_n=32, dq_num_warps=2, dq_mode=dq_mode, ds_stages=ds)
    rng = np.random.default_rng(sq * 5 + sk + d)
    do, q, k, v = (x.astype(np.float32) for x in _rand_problem(rng, sq, sk, grp, 1, d))
    scale = 1 / math.sqrt(d)
    dq, dk, dv, (do, q, k, v) = _emulate_all(do, q, k, v, causal, scale, cfg)
    _, _, dq_ref, dk_ref, dv_ref = direct(*(x.astype(np.float64) for x in (do, q, k, v)), causal, scale)
    for name, got, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref[0]), ("dv", dv, dv_ref[0])):
        assert not np.isnan(got).any(), f"{name}: NaN"
        assert _rel(got, ref) < 1.5e-2, f"{name}: rel err {_rel(got, ref):.3e}"


@pytest.mark.parametrize("sq,sk,grp,d,causal,bm,bn,w,mode,ds", EMU_PAIR)
def test_emulated_pair_layout_matches_direct_formulas(sq, sk, grp, d, causal, bm, bn, w, mode, ds):
    cfg = AttentionBwdConfig(dtype="float16", head_dim=d, causal=causal, deterministic=(mode == "pass"), block_m=bm,
                             block_n=bn, num_warps=w, dq_block_n=32, dq_num_warps=2, dq_mode=mode, ds_stages=ds,
                             layout="pair")
    rng = np.random.default_rng(sq * 3 + sk + d)
    do, q, k, v = (x.astype(np.float32) for x in _rand_problem(rng, sq, sk, grp, 1, d))
    scale = 1 / math.sqrt(d)
    dq, dk, dv, (do, q, k, v) = _emulate_all(do, q, k, v, causal, scale, cfg)
    _, _, dq_ref, dk_ref, dv_ref = direct(*(x.astype(np.float64) for x in (do, q, k, v)), causal, scale)
    for name, got, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref[0]), ("dv", dv, dv_ref[0])):
        assert not np.isnan(got).any(), f"{name}: NaN"
        assert _rel(got, ref) < 2e-3, f"{name}: rel err {_rel(got, ref):.3e}"


def test_ordered_flush_ranks_follow_launch_order():
    """The ordered (deterministic) flush: for each query tile the ranks of the key tiles that see
    it are 0..count-1, and a CTA only waits for CTAs launched before it (blockIdx.x order)."""
    for sq, sk, bm, bn in ((1000, 1000, 64, 128), (300, 700, 64, 128), (700, 300, 32, 64), (129, 65, 64, 128)):
        diag = sk - sq
        n_blocks, m_blocks = -(-sk // bn), -(-sq // bm)
        for causal in (False, True):
            for m in range(m_blocks):
                seen = [n for n in range(n_blocks) if (max(0, n * bn - diag) // bm if causal else 0) <= m]
                ranks = {}
                for n in seen:
                    if causal:
                        last = min(n_blocks - 1, ((m + 1) * bm + diag - 1) // bn)
                        ranks[n] = last - n
                    else:
                        ranks[n] = n
                assert sorted(ranks.values()) == list(range(len(seen))), (sq, sk, causal, m, ranks)
                launch = {n: (n_blocks - 1 - n if causal else n) for n in seen}   # blockIdx.x
                for n in seen:
                    before = [x for x in seen if ranks[x] < ranks[n]]
                    assert all(launch[x] < launch[n] for x in before), "waits on a later-launched CTA"


def test_dq_pass_and_reductions_agree_in_emulation():
    """The deterministic dQ pass and the RED path compute the same dQ (up to 16-bit rounding)."""
    rng = np.random.default_rng(5)
    do, q, k, v = (x.astype(np.float32) for x in _rand_problem(rng, 45, 38, 2, 1, 24))
    base = dict(dtype="float16", head_dim=24, causal=True, block_m=32, block_n=32, num_warps=2, dq_block_n=16,
                dq_num_warps=2)
    a = _emulate_all(do, q, k, v, True, 0.2, AttentionBwdConfig(**base, deterministic=False))
    b = _emulate_all(do, q, k, v, True, 0.2, AttentionBwdConfig(**base, deterministic=True))
    assert _rel(a[0], b[0]) < 5e-3
    np.testing.assert_array_equal(a[1], b[1])   # dK, dV: the same code path
    np.testing.assert_array_equal(a[2], b[2])


def test_ds_stride_stores_are_bank_conflict_free():
    """The 32-bit dS^T stores of one warp (rows g, g+8; columns 2t) and the ldmatrix phases over
    dS^T rows hit 32 distinct banks / 8 distinct 16-byte bank groups for every block_m."""
    for bm in (16, 32, 48, 64, 128):
        s = odd(bm)
        for half in range(2):
            words = ((G + 8 * half) * s + 2 * TQ) // 2
            assert len(set(words % 32)) == 32
        groups = [(r * s // 8) % 8 for r in range(8)]
        assert len(set(groups)) == 8


# ---- GPU: correctness --------------------------------------------------------------------
def _gpu_case(batch, sq, sk, h, hkv, d, causal, dtype, *, seed=None, deterministic=False, softmax_scale=None,
              strided=False, tile=None, hopper=None):
    """Forward with rtk.attention, backward into NaN-poisoned outputs, checked per gradient.
    tile: an AttentionBwdConfig's tile fields; hopper: an AttentionBwdSm90Config to run."""
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    from rtkernels.ops.attention import attention
    from rtkernels.ops.attention_bwd import attention_backward_reference
    seed = int(np.random.SeedSequence().entropy % 2**32) if seed is None else seed
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    if strided:   # q, k, v slices of a packed (b, s, 3, h, d) array; do a head-slice of a wider array
        assert sq == sk and h == hkv
        qkv, _ = random_array(rng, (batch, sq, 3, h, d), dtype)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        wide, _ = random_array(rng, (batch, sq, h + 2, d), dtype)
        do = wide[:, :, 1:h + 1]
    else:
        q, k, v, do = (random_array(rng, s, dtype)[0] for s in ((batch, sq, h, d), (batch, sk, hkv, d),
                                                                 (batch, sk, hkv, d), (batch, sq, h, d)))
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    o, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, **extra)
    dq, dk, dv = (poison(cp.empty(x.shape, x.dtype)) for x in (q, k, v))
    config = hopper if tile is None else AttentionBwdConfig(dtype=dtype, head_dim=d, causal=causal,
                                                            deterministic=deterministic, **tile)
    r = attention_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                           deterministic=deterministic, dq=dq, dk=dk, dv=dv, config=config, **extra)
    assert r[0] is dq and r[1] is dk and r[2] is dv
    cp.cuda.get_current_stream().synchronize()
    bf = "bfloat16" if dtype == "bfloat16" else None
    ref = attention_backward_reference(do, q, k, v, causal, softmax_scale, dtype=bf, compute="float64")
    low = attention_backward_reference(do, q, k, v, causal, softmax_scale, dtype=bf, compute="float32",
                                       round_to=dtype)
    floor = 2 ** -10 if dtype == "float16" else 2 ** -7
    for name, got, rf, lw in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, low):
        g64 = cp.asarray(to_f64(got, dtype))
        assert not bool(cp.isnan(g64).any()), f"{name}: NaN"
        err = _rel_gpu(g64, rf)
        err_low = _rel_gpu(lw, rf)
        assert err <= 2 * err_low + floor, f"{name}: rel err {err:.3e} vs reference-in-{dtype} {err_low:.3e}"
    return dq, dk, dv


def _rel_gpu(a, b):
    import cupy as cp
    a, b = cp.asarray(a, cp.float64), cp.asarray(b, cp.float64)
    den = float(cp.linalg.norm(b))
    return float(cp.linalg.norm(a - b)) / (den if den > 0 else 1.0)


GPU_HEAD_DIMS = [8, 40, 64, 72, 80, 96, 128, 136, 160, 192, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("d", GPU_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dims(d, causal):
    dtype = DTYPES[(d // 8 + causal) % 2]     # both dtypes across the sweep
    _gpu_case(2, 113, 203, 4, 2, d, causal, dtype, deterministic=(d % 3 == 0))


from test_attention import SEQLENS   # noqa: E402  (the forward's seqlen grid)


def seqlen_args(sq, sk, causal):
    """(batch, sq, sk, h, hkv, d, causal, dtype) of the seqlen grid's case (shared with the Hopper tests)."""
    return 1, sq, sk, 2, 1, 128 if sq * sk > 100_000 else 64, causal, "float16" if (sq + sk) % 2 else "bfloat16"


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_seqlens(sq, sk, causal):
    _gpu_case(*seqlen_args(sq, sk, causal))


COMBINED_CASES = [   # batch, sq, sk, h, hkv, d, causal, dtype, deterministic
    (3, 255, 255, 16, 2, 64, True, "bfloat16", False),     # GQA 8:1
    (2, 113, 1000, 8, 1, 128, False, "float16", True),     # MQA, deterministic
    (1, 1000, 255, 8, 1, 80, True, "float16", False),      # MQA, causal rows that see no key
    (1, 2048, 2048, 2, 2, 96, True, "bfloat16", True),
    (2, 17, 4097, 4, 1, 256, True, "float16", False),
    (1, 300, 300, 3, 3, 136, False, "bfloat16", True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype,det", COMBINED_CASES)
def test_gpu_combined(batch, sq, sk, h, hkv, d, causal, dtype, det):
    _gpu_case(batch, sq, sk, h, hkv, d, causal, dtype, deterministic=det)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_strided_inputs_and_custom_scale(dtype):
    _gpu_case(2, 333, 333, 4, 4, 72, True, dtype, softmax_scale=0.3, strided=True)


GPU_VARIANTS = [
    # d, causal, deterministic, block_m, block_n, num_warps, dq_mode, kv_regs, ds_stages
    (64, False, False, 64, 128, 8, "staged", True, 2),
    (64, True, True, 64, 128, 8, "staged", True, 2),
    (64, True, False, 128, 128, 8, "bulk", False, 2),
    (64, False, False, 64, 128, 8, "red", True, 2),
    (64, True, True, 64, 128, 8, "bulk", True, 1),
    (128, True, False, 64, 128, 8, "staged", False, 2),
    (128, False, True, 64, 128, 8, "staged", False, 2),
    (128, False, False, 64, 128, 8, "bulk", False, 1),
    (128, True, True, 64, 128, 8, "bulk", False, 2),
    (128, False, False, 32, 128, 8, "red", False, 2),
    (128, True, True, 64, 64, 4, "pass", False, 1),
    (80, True, False, 64, 64, 4, "staged", False, 1),
    (40, False, True, 32, 64, 4, "staged", True, 2),
    (128, True, False, 64, 128, 8, "red", False, 2, "pair"),
    (128, False, True, 64, 128, 8, "bulk", False, 2, "pair"),
    (64, True, False, 64, 128, 8, "bulk", False, 2, "pair"),
    (80, False, False, 32, 64, 4, "staged", False, 1, "pair"),
]
GPU_VARIANTS = [v if len(v) == 10 else (*v, "keys16") for v in GPU_VARIANTS]


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", [(300, 333), (333, 129)])
@pytest.mark.parametrize("d,causal,det,bm,bn,w,mode,kv,ds,layout", GPU_VARIANTS)
def test_gpu_tile_variants(sq, sk, d, causal, det, bm, bn, w, mode, kv, ds, layout):
    dtype = DTYPES[(d // 8 + causal) % 2]
    _gpu_case(2, sq, sk, 4, 2, d, causal, dtype, deterministic=det,
              tile=dict(block_m=bm, block_n=bn, num_warps=w, dq_mode=mode, kv_regs=kv, ds_stages=ds,
                        layout=layout))


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,hkv", [(64, False, 4), (128, True, 2), (40, True, 1), (192, False, 2)])
def test_gpu_deterministic_is_bit_identical(d, causal, hkv):
    import cupy as cp
    dq1, dk1, dv1 = _gpu_case(2, 700, 900, 4, hkv, d, causal, "bfloat16", deterministic=True, seed=11)
    dq2, dk2, dv2 = _gpu_case(2, 700, 900, 4, hkv, d, causal, "bfloat16", deterministic=True, seed=11)
    for a, b in ((dq1, dq2), (dk1, dk2), (dv1, dv2)):
        assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


@pytest.mark.gpu
def test_gpu_torch_bfloat16_against_autograd():
    torch = pytest.importorskip("torch")
    from rtkernels.ops.attention import attention
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 129, 4, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 150, 2, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 150, 2, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(2, 129, 4, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    o, lse = attention(q, k, v, causal=True)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, causal=True)
    assert all(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 for x in (dq, dk, dv))
    qf, kf, vf = (x.float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    mask = torch.ones(129, 150, dtype=torch.bool, device="cuda").tril(150 - 129)
    ref = torch.nn.functional.scaled_dot_product_attention(
        qf, kf.repeat_interleave(2, 1), vf.repeat_interleave(2, 1), attn_mask=mask)
    ref.backward(do.float().transpose(1, 2))
    for got, r in ((dq, qf.grad), (dk, kf.grad), (dv, vf.grad)):
        r = r.transpose(1, 2)
        assert ((got.float() - r).norm() / r.norm()).item() < 2e-2


@pytest.mark.gpu
def test_gpu_bad_inputs_raise():
    import cupy as cp
    q = cp.ones((1, 16, 2, 64), cp.float16)
    lse = cp.zeros((1, 2, 16), cp.float32)
    cases = [
        (dict(q=q.astype(cp.float32)), "float32"),
        (dict(do=cp.ones((1, 15, 2, 64), cp.float16)), "do must have"),
        (dict(o=cp.ones((1, 16, 2, 64), cp.float16)[..., ::2].copy()), "o must have"),
        (dict(lse=cp.zeros((1, 2, 15), cp.float32)), "lse must be"),
        (dict(lse=cp.zeros((1, 2, 16), cp.float16)), "lse must be"),
        (dict(q=cp.ones((1, 16, 3, 64), cp.float16), do=cp.ones((1, 16, 3, 64), cp.float16),
              o=cp.ones((1, 16, 3, 64), cp.float16), lse=cp.zeros((1, 3, 16), cp.float32)), "multiple of nheads_kv"),
        (dict(dk=cp.empty((1, 16, 1, 64), cp.float16)), "dk must be"),
        (dict(softmax_scale=0.0), "softmax_scale"),
    ]
    for change, words in cases:
        args = dict(do=q, q=q, k=q, v=q, o=q, lse=lse)
        args.update(change)
        with pytest.raises(ConfigError, match=words):
            attention_backward(args.pop("do"), args.pop("q"), args.pop("k"), args.pop("v"), args.pop("o"),
                               args.pop("lse"), **args)
