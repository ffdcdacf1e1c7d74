"""The attention mask spec (causal, windows, softcap, varlen): normalization, the NumPy tile model
against brute-force masks, cu_seqlens checks, the schedule model, and compiles of masked configs.

CPU only (NumPy + NVRTC); the kernels' results are checked on the GPU by test_attention_varlen.py.
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError
from rtkernels.ops.attention_mask import (AttentionMask, check_cu_seqlens, key_range, mask_spec, padded_offset_rows,
                                          query_range, schedule_reference, varlen_slots)


# ---- normalization -------------------------------------------------------------------------------
def test_causal_is_the_window_minus_one_zero():
    assert mask_spec(True) == mask_spec(False, (-1, 0)) == mask_spec(True, (-1, 0)) == mask_spec(True, (-1, -1))
    m = mask_spec(True)
    assert m.causal and not m.has_window and m.window_right == 0
    assert m.flags() == {"causal": True, "has_window": False, "has_softcap": False, "is_varlen": False}


def test_window_flags():
    assert mask_spec(False, (-1, -1)).dense and mask_spec(False, None).dense
    m = mask_spec(False, (127, 0))           # sliding window: causal + a left bound
    assert m.causal and m.has_window and (m.window_left, m.window_right) == (127, 0)
    m = mask_spec(False, (256, 256))
    assert not m.causal and m.has_window
    m = mask_spec(False, (-1, 64))           # right bound only
    assert not m.causal and m.has_window and m.window_left == -1
    m = mask_spec(True, (0, 0))
    assert m.causal and m.has_window
    assert mask_spec(False, softcap=30).flags()["has_softcap"]
    assert not mask_spec(False, softcap=0).has_softcap and not mask_spec(False, softcap=None).has_softcap
    assert mask_spec(False, is_varlen=True).flags()["is_varlen"]


@pytest.mark.parametrize("kw,field", [
    (dict(window=(1,)), "window"), (dict(window=(1, 2, 3)), "window"), (dict(window=(-2, 0)), "window"),
    (dict(window=(1.5, 0)), "window"), (dict(window=(True, 0)), "window"), (dict(window=5), "window"),
    (dict(causal=True, window=(4, 3)), "window"), (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("nan")), "softcap"), (dict(softcap=float("inf")), "softcap"), (dict(softcap=True), "softcap"),
    (dict(softcap="30"), "softcap"), (dict(causal="yes"), "causal"),
])
def test_bad_mask_arguments_name_the_argument(kw, field):
    with pytest.raises(ConfigError) as e:
        mask_spec(**kw)
    assert e.value.field == field and field in str(e.value)


# ---- the tile model against brute force --------------------------------------------------------------
def _windows():
    # (causal, window) pairs: the windows plus edges (empty rows, windows past the ends)
    return [(False, None), (True, None), (False, (0, 0)), (False, (1, 0)), (False, (127, 0)), (False, (256, 256)),
            (False, (-1, 64)), (False, (64, -1)), (True, (3, 0)), (False, (0, 5)), (False, (40, 1)),
            (False, (2000, 2000)), (False, (5, -1))]


SEQLENS = [(1, 1), (17, 17), (1, 300), (300, 1), (100, 100), (255, 257), (129, 384), (384, 129), (1000, 1000)]
TILES = [(64, 64), (128, 112), (128, 80), (192, 128), (64, 32), (128, 128)]   # (128, 128): the sm90 bwd's block_m 128


def _cases():
    for (sq, sk), (bm, bn), (causal, window) in itertools.product(SEQLENS, TILES, _windows()):
        yield sq, sk, bm, bn, causal, window


def test_key_range_matches_brute_force():
    """Every query tile visits exactly the key tiles where some row sees some key, and a visited
    tile is left unmasked exactly when every (existing row, key) of it is visible."""
    checked = 0
    for sq, sk, bm, bn, causal, window in _cases():
        m = mask_spec(causal, window)
        vis = m.visible(sq, sk)
        left, right = m.bounds(sq, sk)
        n_tiles = -(-sk // bn)
        for m0 in range(0, sq, bm):
            rows = min(bm, sq - m0)
            r = key_range(m, m0, rows, sq, sk, bn, left, right)
            block = vis[m0:m0 + rows]
            seen = [n for n in range(n_tiles) if block[:, n * bn:(n + 1) * bn].any()]
            where = f"sq={sq} sk={sk} tile={bm}x{bn} causal={causal} window={window} m0={m0}: {r}"
            if seen:
                assert (r.n_min, r.n_max) == (seen[0], seen[-1] + 1), where
                assert seen == list(range(seen[0], seen[-1] + 1)), where   # windows are contiguous
            else:
                assert r.n_max <= r.n_min, where
            for n in range(r.n_min, r.n_max):
                full = (n + 1) * bn <= sk and block[:, n * bn:(n + 1) * bn].all()
                assert r.masked(n) == (not full), f"{where} tile {n}"
            checked += 1
    assert checked > 1000


def test_query_range_matches_brute_force():
    """The backward's view: every key tile visits exactly the query tiles with a row that sees one of
    its keys; a query tile is unmasked only if all its existing rows see all the tile's keys."""
    for sq, sk, bm, bn, causal, window in _cases():
        m = mask_spec(causal, window)
        vis = m.visible(sq, sk)
        left, right = m.bounds(sq, sk)
        m_tiles = -(-sq // bm)
        for n0 in range(0, sk, bn):
            r = query_range(m, n0, sq, sk, bm, bn, left, right)
            cols = vis[:, n0:n0 + bn]
            seen = [t for t in range(m_tiles) if cols[t * bm:(t + 1) * bm].any()]
            where = f"sq={sq} sk={sk} tile={bm}x{bn} causal={causal} window={window} n0={n0}: {r}"
            if seen:
                assert (r.m_min, r.m_max) == (seen[0], seen[-1] + 1), where
            else:
                assert r.m_max <= r.m_min, where
            for t in range(r.m_min, r.m_max):
                if not r.masked(t):
                    assert n0 + bn <= sk and cols[t * bm:(t + 1) * bm].all(), f"{where} tile {t}"


def test_key_tiles_of_a_query_tile_are_those_whose_query_range_holds_it():
    """The backward's ordered dQ additions count, for query tile m, the key tiles whose query_range
    holds m: exactly key_range over the tile's full block_m rows (Mask::add_rank relies on it)."""
    for sq, sk, bm, bn, causal, window in _cases():
        m = mask_spec(causal, window)
        left, right = m.bounds(sq, sk)
        m_tiles, n_tiles = -(-sq // bm), -(-sk // bn)
        ranges = [query_range(m, n * bn, sq, sk, bm, bn, left, right) for n in range(n_tiles)]
        for t in range(m_tiles):
            r = key_range(m, t * bm, bm, sq, sk, bn, left, right)
            adding = [n for n in range(n_tiles) if ranges[n].m_min <= t < ranges[n].m_max]
            want = list(range(r.n_min, r.n_max)) if r.n_max > r.n_min else []
            assert adding == want, (sq, sk, bm, bn, causal, window, t, adding, r)


def test_clamped_bounds_mean_the_same_mask():
    for (sq, sk), (causal, window) in itertools.product(SEQLENS, _windows()):
        m = mask_spec(causal, window)
        left, right = m.bounds(sq, sk)
        clamped = AttentionMask(m.causal, left, 0 if m.causal else right)
        assert (m.visible(sq, sk) == clamped.visible(sq, sk)).all(), (sq, sk, causal, window, left, right)


def test_visible_pairs_counts_the_brute_force_mask():
    from rtkernels.ops.attention_mask import visible_pairs
    for (sq, sk), (causal, window) in itertools.product(SEQLENS, _windows()):
        m = mask_spec(causal, window)
        assert visible_pairs(m, sq, sk) == int(m.visible(sq, sk).sum()), (sq, sk, causal, window)


def test_softcap_score():
    m = mask_spec(False, softcap=30.0)
    s = np.array([-1e4, -30.0, 0.0, 1.0, 30.0, 1e4])
    np.testing.assert_allclose(m.score(s), 30 * np.tanh(s / 30))
    assert np.all(np.abs(m.score(s)) <= 30)
    assert mask_spec(False).score(s) is s


# ---- cu_seqlens checks (host stand-ins for device arrays) ------------------------------------------
class _Cu:
    """What check_cu_seqlens reads of a CuPy view: dtype, ndim, shape, strides, device.id, get()."""

    class _Dev:
        def __init__(self, i):
            self.id = i

    def __init__(self, values, dtype=np.int32, device=0, step=1):
        self._a = np.asarray(values, dtype=dtype)[::step]
        self.dtype, self.ndim, self.shape = self._a.dtype, self._a.ndim, self._a.shape
        self.strides = (self._a.dtype.itemsize * step,) if self._a.ndim == 1 else self._a.strides
        self.device = self._Dev(device)
        self.reads = 0

    def get(self):
        self.reads += 1
        return self._a


@pytest.mark.parametrize("cu_q,cu_k,totals,field,words", [
    (_Cu([0, 3, 5], dtype=np.int64), _Cu([0, 3, 5]), (5, 5), "cu_seqlens_q", "int32"),
    (_Cu([[0, 3, 5]]), _Cu([0, 3, 5]), (5, 5), "cu_seqlens_q", "1-D"),
    (_Cu([0]), _Cu([0]), (0, 0), "cu_seqlens_q", "batch + 1"),
    (_Cu([0, 3, 5]), _Cu([0, 5]), (5, 5), "cu_seqlens_k", "same length"),
    (_Cu([0, 3, 2, 5]), _Cu([0, 1, 2, 5]), (5, 5), "cu_seqlens_q", "non-decreasing"),
    (_Cu([0, 3, 5]), _Cu([0, 2, 4]), (5, 5), "cu_seqlens_k", "end at"),
    (_Cu([1, 3, 5]), _Cu([0, 2, 5]), (5, 5), "cu_seqlens_q", "start at 0"),
    (_Cu([0, 3, 5], device=1), _Cu([0, 3, 5]), (5, 5), "cu_seqlens_q", "device"),
    (_Cu([0, 9, 3, 9, 5, 9], step=2), _Cu([0, 3, 5]), (5, 5), "cu_seqlens_q", "contiguous"),
])
def test_bad_cu_seqlens_raise_before_anything_runs(cu_q, cu_k, totals, field, words):
    with pytest.raises(ConfigError) as e:
        check_cu_seqlens(cu_q, cu_k, None, None, *totals, device=0)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_cu_seqlens_are_read_only_without_hints():
    cu_q, cu_k = _Cu([0, 3, 3, 10]), _Cu([0, 4, 9, 9])
    v = check_cu_seqlens(cu_q, cu_k, None, None, 10, 9, device=0)
    assert (v.batch, v.max_seqlen_q, v.max_seqlen_k) == (3, 7, 5) and cu_q.reads == 1
    cu_q, cu_k = _Cu([0, 3, 2, 10]), _Cu([0, 4, 9, 9])   # malformed, but trusted: nothing is read
    v = check_cu_seqlens(cu_q, cu_k, 7, 5, 10, 9, device=0)
    assert (v.max_seqlen_q, v.max_seqlen_k) == (7, 5) and cu_q.reads == cu_k.reads == 0
    with pytest.raises(ConfigError) as e:
        check_cu_seqlens(cu_q, cu_k, -1, 5, 10, 9, device=0)
    assert e.value.field == "max_seqlen_q"


# ---- the schedule model ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sort", [True, False])
def test_schedule_covers_every_tile_once(seed, sort):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 40))
    lens_q = rng.choice([0, 1, 2, 17, 64, 128, 129, 1000, 4097], size=batch)
    lens_k = rng.choice([0, 1, 5, 300, 2048], size=batch)
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    for block in (64, 128, 192):
        slots = varlen_slots(int(cu_q[-1]), batch, block, int(lens_q.max()), compact=sort)
        table = schedule_reference(cu_q, cu_k, block, slots, True, int(cu_q[-1]), int(cu_k[-1]), sort=sort)
        want = {(b, t) for b in range(batch) for t in range(-(-int(lens_q[b]) // block))}
        got = [tuple(e) for e in table.tolist() if e[0] >= 0]
        assert len(got) == len(set(got)) and set(got) == want, (seed, block)
        if sort:   # longest key length first, and each sequence's last tile first
            firsts = [b for i, (b, t) in enumerate(got) if i == 0 or got[i - 1][0] != b]
            assert list(lens_k[firsts]) == sorted(lens_k[firsts], reverse=True)
            assert all(t == -(-int(lens_q[b]) // block) - 1 for b, t in (got[i] for i in range(len(got))
                                                                         if i == 0 or got[i - 1][0] != got[i][0]))


def test_padded_offsets_never_overlap():
    rng = np.random.default_rng(1)
    for _ in range(50):
        lens = rng.integers(0, 300, size=int(rng.integers(1, 30)))
        cu = np.concatenate([[0], np.cumsum(lens)])
        rows = padded_offset_rows(int(cu[-1]), len(lens), 128)
        starts = (cu[:-1] + np.arange(len(lens)) * 128) // 128 * 128
        ends = starts + -(-lens // 128) * 128
        assert (starts[1:] >= ends[:-1]).all() and ends.max() <= rows and (starts % 128 == 0).all()


# ---- compiles: masked configs build without spills -------------------------------------------------------
MASKED = [
    # (family, arch, dtype, head_dim, causal, window, softcap, varlen)
    ("attention", "sm_90", "bfloat16", 128, True, True, True, True),
    ("attention", "sm_80", "float16", 64, True, True, False, False),
    ("attention", "sm_90", "float16", 256, False, True, True, True),
    ("attention_sm90", "sm_90a", "bfloat16", 64, False, True, True, True),
    ("attention_sm90", "sm_90a", "float16", 128, True, True, True, True),
    ("attention_sm90", "sm_90a", "bfloat16", 256, True, False, True, True),
]


@pytest.fixture(scope="module")
def masked_kernels():
    from rtkernels.ops import attention as A, attention_sm90 as S
    out = []
    for fam, arch, dt, d, causal, window, cap, varlen in MASKED:
        flags = dict(has_window=window, has_softcap=cap, is_varlen=varlen)
        cfg = (A.choose_config(dt, d, causal, arch, **flags) if fam == "attention"
               else S.choose_config(dt, d, causal, **flags))
        out.append((cfg, rtk.get_kernel(cfg, arch=arch)))
    return out


def test_masked_configs_compile_without_spills(masked_kernels):
    for cfg, k in masked_kernels:
        r = k.resources
        assert not (r.spill_stores or r.spill_loads or r.stack_frame), (cfg.key(), r)


def test_softcap_runs_through_mufu_tanh(masked_kernels):
    for cfg, k in masked_kernels:
        ops = re.findall(r"MUFU\.(\w+)", k.sass)
        assert ("TANH" in ops) == cfg.has_softcap, cfg.key()


BWD_MASKED = [
    # (dtype, head_dim, causal, deterministic, window, softcap, varlen): the mma.sync kernels' choice
    ("bfloat16", 128, False, True, True, True, True),   # its pair tile spills: the fallback tile
    ("float16", 64, True, False, True, True, True),
    ("bfloat16", 256, True, True, False, True, True),
]


@pytest.mark.parametrize("case", BWD_MASKED)
def test_masked_backward_configs_compile_without_spills(case):
    from rtkernels.ops.attention_bwd import choose_config, used_kernels
    dt, d, causal, det, window, cap, varlen = case
    cfg = choose_config(dt, d, causal, det, "sm_90", has_window=window, has_softcap=cap, is_varlen=varlen)
    for name in used_kernels(cfg):
        r = rtk.get_kernel(cfg, name, arch="sm_90").resources
        assert not (r.spill_stores or r.spill_loads or r.stack_frame), (cfg.key(), name, r)
    if cap:
        assert "MUFU.TANH" in rtk.get_kernel(cfg, "attention_bwd", arch="sm_90").sass


def test_masked_hopper_backward_builds_what_it_picks():
    """picks() sends a masked variant to the Hopper backward only when it builds without spills,
    and the ones that do have the tanh (softcap) and no local memory."""
    from rtkernels.ops import attention_bwd_sm90 as B90
    flags = (("has_window", True), ("has_softcap", False), ("is_varlen", True))
    assert B90.picks(64, True, flags, "bfloat16", True)
    cfg = B90.choose_config("bfloat16", 64, True, True, **dict(flags))
    for name in cfg.kernels:
        r = rtk.get_kernel(cfg, name, arch="sm_90a").resources
        assert not (r.spill_stores or r.spill_loads or r.stack_frame), (name, r)
    assert cfg.register_split == (48, 224)
    soft = (("has_window", False), ("has_softcap", True), ("is_varlen", False))
    if B90.picks(96, False, soft):
        k = rtk.get_kernel(B90.choose_config("bfloat16", 96, False, False, **dict(soft)), arch="sm_90a")
        assert "MUFU.TANH" in k.sass and not k.resources.spill_stores
    # softcap at d128 causal: at most the bookkeeping spill picks() tolerates, and picked
    assert B90.picks(128, True, soft)
    r = rtk.get_kernel(B90.choose_config("bfloat16", 128, True, False, **dict(soft)), arch="sm_90a").resources
    assert r.spill_stores <= B90.BOOKKEEPING_SPILL_BYTES, r


def test_schedule_kernels_compile():
    from rtkernels.ops.attention_mask import AttentionScheduleConfig
    cfg = AttentionScheduleConfig()
    for name in cfg.kernels:
        r = rtk.get_kernel(cfg, name, arch="sm_80").resources
        assert not (r.spill_stores or r.stack_frame), (name, r)
    assert cfg.sort_smem_bytes(8192) <= 99 * 1024   # the sm_86/89 budget, the smallest we target
