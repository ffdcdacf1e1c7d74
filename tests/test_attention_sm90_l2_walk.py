"""attention_sm90 l2_walk: the persistent causal walk in L2-sized sections of (batch, head) pairs.

CPU: the order's mirror (every tile once, heaviest first within each section, partial last
section), the header's formulas, walk_group (sections within the L2 budget, static balance as even
as heaviest first over all pairs on FlashAttention's grid), validation, one build (d128 causal
64x64, two CTAs per SM: no spills, 128 registers).
GPU (``-m gpu``): the float64 reference with poisoned outputs, sections forced small (1, 2 and 3
pairs: partial sections, many per CTA), and O / lse bit for bit against the heaviest-first walk.
"""
from __future__ import annotations

import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError
from rtkernels.ops import attention_sm90 as A90
from rtkernels.ops.attention_sm90 import AttentionSm90Config

from test_attention_sm90_persistent import PTXAS_NOTES, _need_sm90, _inputs

L2 = dict(block_m=64, num_stages=2, intra_overlap=True, pingpong=False, ctas_per_sm=2, persistent=True,
          causal=True)


def _cfg(dtype, d, l2=True):
    return AttentionSm90Config(dtype=dtype, head_dim=d, block_n=128 if d <= 64 else 64, l2_walk=l2, **L2)


@pytest.mark.parametrize("m_tiles,heads,batch,group", [(1, 1, 1, 1), (5, 3, 2, 4), (8, 4, 3, 5), (3, 2, 2, 4)])
def test_sections_cover_every_tile_once_heaviest_first(m_tiles, heads, batch, group):
    order = A90.linear_tiles(m_tiles, heads, batch, True, group=group)
    want = {(m, h, b) for m in range(m_tiles) for h in range(heads) for b in range(batch)}
    assert len(order) == len(want) and set(order) == want
    pairs = heads * batch
    at = 0
    for s0 in range(0, pairs, group):
        gs = min(group, pairs - s0)
        sec = order[at: at + gs * m_tiles]
        at += gs * m_tiles
        assert {h + heads * b for _, h, b in sec} == set(range(s0, s0 + gs)), (s0, sec)
        tiles = [m for m, _, _ in sec]
        assert tiles == sorted(tiles, reverse=True), sec
    # a group holding every pair is the heaviest-first order over all pairs
    assert A90.linear_tiles(m_tiles, heads, batch, True, group=pairs) == A90.linear_tiles(m_tiles, heads, batch, True)


def test_grouped_mirror_matches_the_header():
    from pathlib import Path
    text = (Path(rtk.__file__).resolve().parent.parent / "templates" / "include" / "rtk" / "attn_mask.cuh").read_text()
    body = text[text.index("linear_tile_grouped(int t"):]
    body = body[: body.index("return c;")]
    for line in ("const int s = t / per_section;", "const int gs = min(group, heads * batch - s * group);",
                 "const int mt = loc / gs;", "const int pair = s * group + (loc - mt * gs);",
                 "c.tile = m_tiles - 1 - mt;", "c.batch = pair / heads;"):
        assert line in body, line


# FlashAttention's grid (16k tokens, hidden 2048): (seqlen, head_dim, block_m, block_n, CTAs per SM)
GRID = [(512, 128, 64, 64, 2), (1024, 64, 64, 128, 2), (2048, 64, 64, 128, 2), (512, 64, 128, 128, 1),
        (1024, 128, 128, 128, 1)]


@pytest.mark.parametrize("s,d,bm,bn,c", GRID)
def test_walk_group_fits_l2_and_stays_even(s, d, bm, bn, c):
    cfg = AttentionSm90Config(head_dim=d, block_m=bm, block_n=bn, causal=True, persistent=True, l2_walk=True,
                              ctas_per_sm=c, num_stages=2, intra_overlap=True, pingpong=False)
    heads, batch, grid = 2048 // d, 16384 // s, 132 * c
    g = A90.walk_group(cfg, batch, s, s, heads, 1, grid)
    assert 1 <= g and g * 2 * s * d * 2 <= A90.L2_SECTION_BYTES, g
    m_tiles = -(-s // bm)
    key_tiles = [-(-min(s, (m + 1) * bm) // bn) for m in range(m_tiles)]
    base = A90.walk_cost(m_tiles, heads * batch, grid, heads * batch, key_tiles)   # heaviest first, all pairs
    assert A90.walk_cost(m_tiles, heads * batch, grid, g, key_tiles) <= base + 1e-9, (g, base)


def test_l2_walk_validation():
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=64, block_m=128, block_n=128, causal=True, l2_walk=True)
    assert "l2_walk" in str(e.value) and "persistent=True" in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=64, block_m=128, block_n=128, causal=False, persistent=True, l2_walk=True)
    assert "l2_walk" in str(e.value) and "causal=True" in str(e.value), str(e.value)


def test_l2_walk_build_two_per_sm_without_spills():
    cfg = _cfg("bfloat16", 128)
    k = rtk.get_kernel(cfg, arch="sm_90a")
    r = k.resources
    assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (cfg, r)
    assert r.registers == 128, (cfg, r)
    assert not any(c in k.module.log for c in PTXAS_NOTES), k.module.log


# ---- GPU ------------------------------------------------------------------------------------
# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype): cheap first
CASES = [
    (1, 1, 1, 1, 1, 64, True, "bfloat16"),
    (3, 7, 7, 5, 5, 64, True, "bfloat16"),
    (2, 512, 512, 4, 2, 64, True, "bfloat16"),
    (3, 513, 513, 5, 5, 128, True, "float16"),
    (3, 1000, 1000, 5, 1, 128, True, "bfloat16"),
    (3, 1000, 1, 5, 1, 128, True, "bfloat16"),     # rows that see no key
    (3, 300, 77, 3, 1, 64, True, "float16"),
    (3, 1, 1000, 5, 5, 64, True, "float16"),
    (4, 1024, 1024, 16, 16, 64, True, "bfloat16"),
]
_IDS = lambda c: "b{}_q{}_k{}_h{}/{}_d{}_{}".format(*c[:6], c[7])   # noqa: E731
_KERNELS: dict = {}


def _kernel(cfg):
    if cfg not in _KERNELS:
        _KERNELS[cfg] = rtk.get_kernel(cfg, arch="sm_90a")
    return _KERNELS[cfg]


@pytest.mark.gpu
@pytest.mark.parametrize("pairs", [None, 1, 2, 3], ids=lambda p: f"pairs{p}")
@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_gpu_l2_walk(case, pairs, monkeypatch):
    """Against the float64 reference, then bit for bit against the heaviest-first walk; ``pairs``:
    the L2 budget forced to that many pairs' K/V (sections end mid-batch, the last one shorter)."""
    _need_sm90()
    import cupy as cp
    import numpy as np
    from gpu_util import poison
    from test_attention import _check
    batch, sq, sk, h, hkv, d, causal, dtype = case
    if pairs is not None:
        monkeypatch.setattr(A90, "L2_SECTION_BYTES", pairs * 2 * sk * d * 2 // (h // hkv))
    seed = int(np.random.SeedSequence().entropy % 2**32)
    cfg = _cfg(dtype, d)
    q, k, v, o, lse = _inputs(case, seed)
    for sm_count in (None, 1):
        A90.launch(_kernel(cfg), cfg, q, k, v, o, lse, d ** -0.5, sm_count=sm_count)
        cp.cuda.get_current_stream().synchronize()
        try:
            _check(q, k, v, causal, dtype, o, lse)
        except AssertionError as e:
            raise AssertionError(f"{e}\ncase={case} seed={seed} pairs={pairs} sm_count={sm_count}") from None
    ref = cfg.replace(l2_walk=False)
    o2, lse2 = poison(cp.empty_like(o)), poison(cp.empty_like(lse))
    A90.launch(_kernel(ref), ref, q, k, v, o2, lse2, d ** -0.5)
    cp.cuda.get_current_stream().synchronize()
    assert bool((o.view(cp.uint16) == o2.view(cp.uint16)).all()), f"O differs from the heaviest-first walk: {case}"
    assert bool(cp.array_equal(lse, lse2)), f"lse differs from the heaviest-first walk: {case}"
