"""matmul family: config validation, compile/SASS checks, a NumPy model of the kernel's
index math, the wave-aware heuristic, the autotuner's persistence, and GPU correctness."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import matmul as mm
from rtkernels.ops._arrays import LaunchPlans
from rtkernels.ops.matmul import MatmulConfig

ARCHS = ("sm_80", "sm_90")


# ---- config validation ---------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    (dict(dtype="float64"), "dtype"),
    (dict(block_m=100), "block_m"),
    (dict(block_k=24), "block_k"),
    (dict(num_warps=3), "num_warps"),
    (dict(warps_m=16), "warps_m"),
    (dict(activation="tanh"), "activation"),
    (dict(vec_a=3), "vec_a"),
    (dict(num_stages=1), "num_stages"),
    (dict(block_m=256, block_n=256, warps_m=2), "block_n"),            # 128x64 warp tile would spill
    (dict(block_m=256, block_n=128, block_k=128, num_stages=4, warps_m=4), "num_stages"),  # smem
    (dict(dtype="float32", num_warps=4), "num_warps"),
])
def test_config_errors(bad, field):
    with pytest.raises(ConfigError) as e:
        MatmulConfig(**bad)
    assert e.value.field == field and "matmul" in str(e.value)


def test_config_derived():
    c = MatmulConfig()
    assert c.threads_per_block == 256 and c.shared_mem_bytes == 4 * (128 + 256) * 32 * 2
    # a shallow ring is topped up to the C tile the epilogue stages through it
    assert MatmulConfig(num_stages=2).shared_mem_bytes == 128 * 256 * 2
    assert mm.heuristic_config("bfloat16", 4096, 4096, 4096, sm_count=132).even_k
    assert not mm.heuristic_config("bfloat16", 4095, 4095, 4095, sm_count=132).even_k
    assert c.expects_tensor_cores and not MatmulConfig(dtype="float32", block_m=64, block_n=64, block_k=16,
                                                       num_stages=1, vec_a=1, vec_b=1).expects_tensor_cores
    assert MatmulConfig(activation=None).activation == "none"


# ---- compile, ptxas and SASS ------------------------------------------------------------
def _heuristic_configs():
    out = []
    for t in mm.TC_TILES:
        for ak, bk in ((True, False), (False, True)):
            for even_k in (False, True):
                out.append(mm._config(t, "bfloat16", a_kmajor=ak, b_kmajor=bk, even_k=even_k))
        out.append(mm._config(t, "float16", has_bias=True, activation="gelu", even_k=True))
    for t in mm.NARROW_TILES:
        for va, vb in ((1, 1), (2, 2), (4, 4), (1, 8), (8, 2)):
            out.append(mm._config(t, "bfloat16", vec_a=va, vec_b=vb, has_bias=True, activation="silu"))
    for t in mm.F32_TILES:
        out.append(mm._config(t, "float32", vec_a=1, vec_b=1, has_bias=True, activation="relu"))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_heuristic_configs_compile_clean(arch):
    import rtkernels as rtk
    from rtkernels import arch as arch_mod
    from rtkernels.inspect import sass_stats
    for cfg in _heuristic_configs():
        if cfg.shared_mem_bytes > arch_mod.limits(arch).max_smem_per_block_optin:
            continue   # a ring larger than the arch allows is never chosen there
        k = rtk.get_kernel(cfg, arch=arch)
        r = k.resources
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, (cfg.key(), r)
        assert r.registers <= 255
        s = sass_stats(k.sass)
        assert s["ldl"] == 0 and s["stl"] == 0, cfg.key()
        if cfg.use_mma:
            assert s["hmma"] > 0 and s["ldsm"] > 0, cfg.key()
            if min(cfg.vec_a, cfg.vec_b) > 1:
                assert s["ldgsts"] > 0, cfg.key()
        else:
            assert s["hmma"] == 0


def _main_loop(sass):
    """Opcodes of the k-tile loop: from the label the last HMMA's loop branches back to, to that
    branch (the first branch after the last HMMA whose target lies before it)."""
    import re
    ops, labels = [], {}
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ops)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([^;]*);", line)
        if m and "RZ, [RZ]" not in m.group(2) and "URZ, URZ, URZ, URZ" not in m.group(2):
            ops.append((m.group(1), m.group(2)))
    last = max(i for i, (o, _) in enumerate(ops) if o == "HMMA")

    def target(i):
        return labels[re.search(r"\.L_x_\d+", ops[i][1]).group(0)]
    br = next(i for i in range(last, len(ops)) if ops[i][0] == "BRA" and target(i) <= last)
    return [o for o, _ in ops[target(br): br + 1]]


def test_ldmatrix_ahead_of_refill_copies():
    """ldsm_first: the k-tile's first ldmatrix comes before its refill copies in the SASS of the
    main loop (copies first, ptxas keeps them ahead of every later shared-memory access and the
    next step's ldmatrix drift to the end of the step's HMMAs: 461 vs 510 TFLOP/s on an H200)."""
    import rtkernels as rtk
    cfg = mm._config(mm.TC_TILES[0], "bfloat16", a_kmajor=True, b_kmajor=False, even_k=True)
    assert cfg.ldsm_first
    for first, arch in ((True, "sm_90"), (False, "sm_90"), (True, "sm_80")):
        c = dataclasses.replace(cfg, ldsm_first=first, copy_steps=cfg.copy_steps if first else 1)
        body = _main_loop(rtk.get_kernel(c, arch=arch).sass)
        assert (body.index("LDSM") < body.index("LDGSTS")) == first, (first, arch)


def test_one_tile_for_every_k():
    """The 32-deep 4-stage tile serves long K too (fourth session: 504 vs 452 TFLOP/s for the
    64-deep tile at 8192^3), with the plain main loop; its ring fits every sm_80+ part."""
    for arch in ("sm_90", "sm_80", "sm_86"):
        for k in (4096, 8192, 65536):
            c = mm.heuristic_config("bfloat16", 8192, 8192, k, sm_count=132, arch=arch)
            assert c == mm._config(mm.TC_TILES[0], "bfloat16", k, a_kmajor=True, b_kmajor=False), (arch, k)
            assert (c.block_k, c.num_stages, c.copy_steps, c.l2_prefetch) == (32, 4, 1, 0)
            assert c.shared_mem_bytes <= mm.arch_mod.limits(arch).max_smem_per_block_optin
    odd = mm.heuristic_config("bfloat16", 8192, 8192, 8200, sm_count=132)
    assert not odd.even_k and odd.ldsm_first


def test_tune_only_configs_compile_clean():
    import rtkernels as rtk
    for t in mm.TUNE_ONLY:
        for even_k in (False, True):
            r = rtk.get_kernel(mm._config(t, "bfloat16", even_k=even_k), arch="sm_90").resources
            assert r.spill_stores == 0 and r.stack_frame == 0


def test_main_loop_instruction_budget():
    """The 128x256x32 main loop: per k-tile 64 HMMA, 16 LDSM, 6 LDGSTS, one barrier, and
    (on its whole-tile path) at most ~1.5x as many other instructions as HMMAs; the rewrite
    that precomputed addresses took it from ~238 to ~85."""
    import rtkernels as rtk
    cfg = mm._config(mm.TC_TILES[0], "bfloat16", a_kmajor=True, b_kmajor=False, even_k=True)
    body = _main_loop(rtk.get_kernel(cfg, arch="sm_90").sass)
    assert body.count("HMMA") == 64 and body.count("LDSM") == 16
    assert body.count("BAR") == 1 and body.count("LDGSTS") == 6
    assert len(body) - 64 <= 2 * 64   # was ~238 non-HMMA before the rewrite; ~80 after


# Main-loop options on both tile depths, both layouts, even and tail K, plain and fused epilogue:
# what _config makes of them must stay in registers, and keep ldmatrix ahead of the copies.
_OPTION_TILES = [
    mm._Tile(128, 256, 32, 8, 4, 2, 1, 1.0, "", copy_steps=2),
    mm._Tile(128, 256, 32, 8, 6, 2, 1, 1.0, "", copy_steps=2, l2_prefetch=256),
    mm._Tile(128, 256, 32, 8, 4, 2, 1, 1.0, "", l2_prefetch=64),
    mm._Tile(128, 256, 64, 8, 4, 2, 1, 1.0, "", copy_steps=3),
    mm._Tile(128, 256, 64, 8, 3, 2, 1, 1.0, "", copy_steps=3, l2_prefetch=256),
    mm._Tile(256, 128, 64, 8, 3, 4, 1, 1.0, "", copy_steps=4, l2_prefetch=128),
]


def _tile_id(t):
    return f"{t.block_m}x{t.block_n}x{t.block_k}/{t.num_stages}-cs{t.copy_steps}" + \
        (f"-l2pf{t.l2_prefetch}" if t.l2_prefetch else "")


@pytest.mark.parametrize("tile", _OPTION_TILES, ids=_tile_id)
def test_main_loop_options_compile_clean(tile):
    import rtkernels as rtk
    from rtkernels.inspect import sass_stats
    for ak, bk, even_k, epi in ((True, False, True, {}), (False, True, True, {}), (True, False, False, {}),
                                (False, True, False, dict(has_bias=True, activation="gelu"))):
        cfg = mm._config(tile, "bfloat16", a_kmajor=ak, b_kmajor=bk, even_k=even_k, **epi)
        assert cfg.copy_steps == (tile.copy_steps if even_k else 1)
        if cfg.shared_mem_bytes > mm._SMEM_LIMIT:
            continue
        k = rtk.get_kernel(cfg, arch="sm_90")
        r, st = k.resources, sass_stats(k.sass)
        assert r.spill_stores == 0 and r.stack_frame == 0 and st["ldl"] == 0, (cfg.key(), r)
        assert st["hmma"] > 0 and st["ldsm"] > 0 and st["ldgsts"] > 0
        ldgsts = [ln for ln in k.sass.splitlines() if "LDGSTS" in ln]
        assert all((f"LTC{cfg.l2_prefetch}B" in ln) == bool(cfg.l2_prefetch) for ln in ldgsts), cfg.key()
        if even_k:   # (a K tail splits the loop; the remainder copies nothing)
            body = _main_loop(k.sass)
            assert body.index("LDSM") < body.index("LDGSTS"), cfg.key()
            assert body.count("LDGSTS") == (cfg.block_m + cfg.block_n) * cfg.block_k // 8 // 256, cfg.key()
            assert body.count("BAR") == 1 and body.count("HMMA") == 32 * cfg.block_k // 16, cfg.key()


def test_main_loop_options_rules():
    t = mm._Tile(128, 256, 64, 8, 3, 2, 1, 1.0, "", copy_steps=3, l2_prefetch=256)
    for k in (8200, 8208):   # a K tail: no spread copies (registers)
        tail = mm._config(t, "bfloat16", k)
        assert (tail.even_k, tail.copy_steps, tail.l2_prefetch) == (False, 1, 256)
    assert mm._config(t, "bfloat16", 8192).copy_steps == 3
    assert mm._config(t, "bfloat16", 8192, vec_a=4).copy_steps == 1
    f32 = dataclasses.replace(mm.F32_TILES[0], copy_steps=2, l2_prefetch=256)
    assert mm._config(f32, "float32", 8192, vec_a=1, vec_b=1).key() == \
        mm._config(mm.F32_TILES[0], "float32", 8192, vec_a=1, vec_b=1).key()
    for bad in (dict(copy_steps=5), dict(copy_steps=2, ldsm_first=False), dict(copy_steps=2, vec_a=4),
                dict(l2_prefetch=32), dict(block_k=64, num_stages=2, copy_steps=4),
                dict(dtype="float32", block_k=16, num_stages=1, vec_a=1, vec_b=1, block_n=128, l2_prefetch=256)):
        with pytest.raises(ConfigError):
            MatmulConfig(**bad)


# ---- a NumPy model of one CTA: load_tile, swizzle, ldmatrix, mma fragments, epilogue -------
def _swizzle(cols, row, col):
    ch = cols // 8
    chunk = col >> 3
    chunk ^= (row & 7) if ch >= 8 else (row // (8 // ch)) & (ch - 1)
    return row * cols + (chunk << 3) + (col & 7)


def _load_tile(g, kmajor, outer, bk, vec, outer0, outer_n, k0, K, threads, ld):
    rows, cols = (outer, bk) if kmajor else (bk, outer)
    s = np.full(rows * cols, np.nan)
    per_row = cols // vec
    row0, col0 = (outer0, k0) if kmajor else (k0, outer0)
    row_n, col_n = (outer_n, K) if kmajor else (K, outer_n)
    for c in range(rows * per_row):
        r, col = divmod(c, per_row)
        col *= vec
        gr, gc = row0 + r, col0 + col
        valid = max(0, min(vec, col_n - gc)) if gr < row_n else 0
        dst = _swizzle(cols, r, col)
        assert dst % vec == 0   # a chunk stays contiguous and aligned after the swizzle
        for e in range(vec):
            s[dst + e] = g[gr * ld + gc + e] if e < valid else 0.0
    return s, cols


def _frag_row(cols, kmajor, o, kb, l8):
    return _swizzle(cols, o + l8, kb) if kmajor else _swizzle(cols, kb + l8, o)


def _ldmatrix_x4(s, addrs, trans):
    """addrs[lane] = element offset of the row lane supplies; returns regs[lane][j] = (lo, hi)."""
    mats = [np.array([s[addrs[8 * j + r]: addrs[8 * j + r] + 8] for r in range(8)]) for j in range(4)]
    for j in range(4):   # the bank-conflict check: 8 rows of one phase hit 8 different 16-byte groups
        groups = {(2 * addrs[8 * j + r] // 16) % 8 for r in range(8)}
        assert len(groups) == 8, "ldmatrix phase has a bank conflict"
    out = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        regs = []
        for j in range(4):
            m = mats[j]
            regs.append((m[2 * t][g], m[2 * t + 1][g]) if trans else (m[g][2 * t], m[g][2 * t + 1]))
        out.append(regs)
    return out


def _cta(A, B, cfg, m0, n0, lda_layout, ldb_layout):
    """Emulate one CTA; A, B logical (M, K), (K, N); returns the dict (row, col) -> value."""
    M, K = A.shape
    N = B.shape[1]
    ga = (A if cfg.a_kmajor else A.T).ravel()       # contiguous along the stored inner dim
    gb = (B.T if cfg.b_kmajor else B).ravel()
    lda = K if cfg.a_kmajor else M
    ldb = K if cfg.b_kmajor else N
    threads = cfg.num_warps * 32
    warps_n = cfg.num_warps // cfg.warps_m
    wm_, wn_ = cfg.block_m // cfg.warps_m, cfg.block_n // warps_n
    mi, ni = wm_ // 16, wn_ // 8
    acc = np.zeros((cfg.num_warps, mi, ni, 32, 4))
    for kt in range(-(-K // cfg.block_k)):
        sa, ca = _load_tile(ga, cfg.a_kmajor, cfg.block_m, cfg.block_k, cfg.vec_a, m0, M, kt * cfg.block_k, K,
                            threads, lda)
        sb, cb = _load_tile(gb, cfg.b_kmajor, cfg.block_n, cfg.block_k, cfg.vec_b, n0, N, kt * cfg.block_k, K,
                            threads, ldb)
        for w in range(cfg.num_warps):
            wm0, wn0 = (w // warps_n) * wm_, (w % warps_n) * wn_
            for kk in range(0, cfg.block_k, 16):
                af = [_ldmatrix_x4(sa, [_frag_row(ca, cfg.a_kmajor, wm0 + i * 16 + ((l >> 3) & 1) * 8,
                                                  kk + (l >> 4) * 8, l & 7) for l in range(32)],
                                   not cfg.a_kmajor) for i in range(mi)]
                bf = {}
                for j in range(0, ni, 2):
                    r = _ldmatrix_x4(sb, [_frag_row(cb, cfg.b_kmajor, wn0 + j * 8 + (l >> 4) * 8,
                                                    kk + ((l >> 3) & 1) * 8, l & 7) for l in range(32)],
                                     not cfg.b_kmajor)
                    bf[j] = [(x[0], x[1]) for x in r]
                    bf[j + 1] = [(x[2], x[3]) for x in r]
                for i in range(mi):
                    a16 = np.zeros((16, 16))
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        for reg, (ro, co) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                            a16[g + ro, co + 2 * t: co + 2 * t + 2] = af[i][lane][reg]
                    for j in range(ni):
                        b16 = np.zeros((16, 8))
                        for lane in range(32):
                            g, t = lane // 4, lane % 4
                            b16[2 * t: 2 * t + 2, g] = bf[j][lane][0]
                            b16[2 * t + 8: 2 * t + 10, g] = bf[j][lane][1]
                        d = a16 @ b16
                        for lane in range(32):
                            g, t = lane // 4, lane % 4
                            acc[w, i, j, lane] += [d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]]
    out = {}
    for w in range(cfg.num_warps):
        wm0, wn0 = (w // warps_n) * wm_, (w % warps_n) * wn_
        for i in range(mi):
            for j in range(ni):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for e in range(4):
                        row = m0 + wm0 + i * 16 + g + (e // 2) * 8
                        col = n0 + wn0 + j * 8 + 2 * t + e % 2
                        if row < M and col < N:
                            assert (row, col) not in out
                            out[(row, col)] = acc[w, i, j, lane, e]
    return out


@pytest.mark.parametrize("ak, bk, va, vb, shape", [
    (True, False, 8, 8, (40, 50, 70)),
    (False, True, 8, 8, (33, 17, 45)),
    (True, True, 4, 2, (64, 64, 37)),
    (False, False, 1, 8, (20, 64, 9)),
])
def test_numpy_model_of_cta(ak, bk, va, vb, shape):
    M, N, K = shape
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    cfg = MatmulConfig(dtype="float16", block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2, warps_m=2,
                       a_kmajor=ak, b_kmajor=bk, vec_a=va, vec_b=vb)
    got = _cta(A, B, cfg, 0, 0, None, None)
    ref = A @ B
    assert len(got) == min(M, 64) * min(N, 64)
    for (r, c), v in got.items():
        assert abs(v - ref[r, c]) < 1e-9


@pytest.mark.parametrize("kmajor, outer, bk", [(True, 128, 32), (True, 256, 64), (False, 256, 32),
                                               (False, 128, 64), (True, 64, 32), (False, 64, 32)])
def test_fragment_offsets_decompose(kmajor, outer, bk):
    """FragOffsets: the swizzled ldmatrix row of fragment f (16 outer apart) at k step s (16 k
    apart) = a per-lane register (one per s if K-major, per f otherwise) + a constant add."""
    cols = bk if kmajor else outer
    for o0 in range(0, outer - 16, 8):
        for kb in (0, 8):
            for l8 in range(8):
                for f in range((outer - o0) // 16):
                    for s_ in range(bk // 16):
                        o, k = o0 + 16 * f, kb + 16 * s_
                        direct = _swizzle(cols, o + l8, k) if kmajor else _swizzle(cols, k + l8, o)
                        if kmajor:
                            reg, const = _swizzle(cols, o0 + l8, kb + 16 * s_), 16 * f * cols
                        else:
                            reg, const = _swizzle(cols, kb + l8, o0 + 16 * f), 16 * s_ * cols
                        assert direct == reg + const


@pytest.mark.parametrize("kmajor, outer, bk, threads", [(True, 128, 32, 256), (False, 256, 32, 256),
                                                        (True, 256, 64, 256), (False, 128, 64, 256),
                                                        (False, 64, 32, 128), (True, 64, 32, 128)])
def test_tile_loader_chunk_addresses(kmajor, outer, bk, threads):
    """TileLoader: chunk i of a thread = chunk 0 moved ROW_STEP rows: same column, source + i *
    ROW_STEP * ld, destination + a constant; together the chunks cover the tile once."""
    rows, cols = (outer, bk) if kmajor else (bk, outer)
    per_row = cols // 8
    row_step = threads // per_row
    assert threads % per_row == 0 and row_step % 8 == 0
    seen = set()
    for tid in range(threads):
        r, col = tid // per_row, (tid % per_row) * 8
        d0 = _swizzle(cols, r, col)
        for i in range(rows * per_row // threads):
            c = tid + i * threads   # the checked path's numbering of the same chunk
            assert (c // per_row, (c % per_row) * 8) == (r + i * row_step, col)
            d = _swizzle(cols, r + i * row_step, col)
            assert d == d0 + i * row_step * cols
            seen.add(d)
    assert seen == {x * 8 for x in range(rows * cols // 8)}


def test_c_staging_swizzle_is_conflict_free():
    """Epilogue: the 8 rows g of one 4-byte fragment store, and 8 consecutive 16-byte chunk
    reads of a row, fall in 8 different 16-byte bank groups."""
    for bn in (16, 32, 64, 128, 256):
        for c0 in range(0, bn, 8):
            for t in range(4):
                groups = {(2 * _swizzle(bn, g, c0 + 2 * t) // 16) % 8 for g in range(8)}
                assert len(groups) == 8
        per = bn // 8
        for first in range(0, 64 * per, 8):
            groups = {(2 * _swizzle(bn, ch // per, (ch % per) * 8) // 16) % 8 for ch in range(first, first + 8)}
            assert len(groups) == 8


def test_swizzle_is_a_permutation_of_chunks():
    for cols in (16, 32, 64, 128, 256):
        for rows in (16, 64):
            offs = sorted(_swizzle(cols, r, c) for r in range(rows) for c in range(cols))
            assert offs == list(range(rows * cols))


def test_grouped_order_covers_every_tile_once():
    def origin(pid, M, N, bm, bn, gm):
        tm, tn = -(-M // bm), -(-N // bn)
        per = gm * tn
        first = (pid // per) * gm
        rows = min(tm - first, gm)
        ig = pid % per
        return (first + ig % rows) * bm, (ig // rows) * bn
    for M, N, gm in ((1000, 300, 8), (4096, 4096, 8), (129, 4000, 3), (16, 16, 8)):
        tm, tn = -(-M // 128), -(-N // 256)
        seen = {origin(p, M, N, 128, 256, gm) for p in range(tm * tn)}
        assert seen == {(i * 128, j * 256) for i in range(tm) for j in range(tn)}


# ---- heuristics ---------------------------------------------------------------------------
def test_wave_aware_choice():
    big = mm.heuristic_config("bfloat16", 4096, 4096, 4096, sm_count=132)
    assert (big.block_m * big.block_n) == 128 * 256
    for n in (1792, 1793, 4095, 8192):   # no nearly empty last wave on 132 SMs
        c = mm.heuristic_config("bfloat16", n, n, n, sm_count=132)
        tile = next(t for t in mm.TC_TILES if (t.block_m, t.block_n) == (c.block_m, c.block_n))
        from rtkernels import arch
        w = arch.waves(arch.matmul_tiles(n, n, c.block_m, c.block_n), 132, tile.blocks_per_sm)
        assert w.waves == 1 or w.tail_efficiency > 0.5, (n, c.block_m, c.block_n, w)
    skinny = mm.heuristic_config("bfloat16", 65536, 64, 64, sm_count=132)
    assert skinny.block_n <= 64
    narrow = mm.heuristic_config("float16", 1000, 1000, 999, sm_count=132, vec_a=1, vec_b=8)
    assert (narrow.block_m, narrow.block_n) in {(t.block_m, t.block_n) for t in mm.NARROW_TILES}
    assert mm.heuristic_config("float32", 512, 512, 512, sm_count=132).num_stages == 1


def test_layout_rules():
    assert mm._layout("a", "M", (5, 7), (7, 1)) == (True, 7)
    assert mm._layout("a", "M", (5, 7), (1, 5)) == (False, 5)
    assert mm._layout("a", "M", (1, 7), (123, 1)) == (True, 0)
    assert mm._layout("a", "M", (5, 1), (1, 99)) == (False, 0)
    # broadcasts (issue 26): a stride 0 over an extent > 1 is never the unit stride
    assert mm._layout("a", "M", (5, 7), (0, 1)) == (True, 0)      # one row for every m
    assert mm._layout("a", "M", (5, 7), (1, 0)) == (False, 0)     # one column for every k
    for strides in ((0, 0), (7, 0), (0, 7), (14, 2)):             # no unit stride: the op stages these
        with pytest.raises(ConfigError, match="unit stride"):
            mm._layout("a", "M", (5, 7), strides)
    assert mm._vec(256, 64, 0) == 8 and mm._vec(256, 36) == 4 and mm._vec(258, 64) == 1 and mm._vec(0, 9) == 1
    assert mm._bucket(1792) == 1792 and mm._bucket(1793) == 2048 and mm._bucket(4095) == 4096
    assert mm._bucket(17) == 32 and mm._bucket(1) == 1


def test_reference():
    rng = np.random.default_rng(1)
    a, b, bias = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 6, 5)), rng.standard_normal(6)
    r = mm.matmul_reference(a, b, bias=bias, activation="relu", trans_b=True)
    assert np.allclose(r, np.maximum(a @ b.transpose(0, 2, 1) + bias, 0))


# ---- autotuner (CPU: fake timings) ----------------------------------------------------------
@pytest.fixture
def tune_env(fresh_cache, monkeypatch):
    from rtkernels import autotune
    monkeypatch.setenv("RTKERNELS_AUTOTUNE", "1")
    autotune.clear_memory()
    yield autotune
    autotune.clear_memory()


def _cands():
    return [mm._config(t, "bfloat16") for t in mm.TC_TILES[:3]]


def test_autotune_off_returns_default(fresh_cache, monkeypatch):
    from rtkernels import autotune
    monkeypatch.setenv("RTKERNELS_AUTOTUNE", "0")
    c = _cands()
    assert autotune.pick("matmul", {"m": 1}, c, run=None, default=c[0]) is c[0]
    assert not autotune.path().exists()


def test_autotune_persists_and_reuses(tune_env):
    autotune = tune_env
    c = _cands()
    calls = []

    def measure(run, cfg):
        calls.append(cfg)
        return {0: 3.0, 1: 1.0, 2: 2.0}[c.index(cfg)]
    best = autotune.pick("matmul", {"m": 256}, c, None, c[0], arch="sm_90", measure=measure)
    assert best == c[1] and len(calls) == 3 * autotune.ROUNDS
    assert calls[:3] == calls[3:6]   # interleaved passes over the candidates
    data = json.loads(autotune.path().read_text())
    assert data["schema"] == 1 and len(data["entries"]) == 1
    entry = next(iter(data["entries"].values()))
    assert entry["config"]["block_m"] == c[1].block_m and entry["family"] == "matmul"
    key = next(iter(data["entries"]))
    for part in ('"device"', '"driver"', '"nvrtc"', '"family":"matmul"', '"k.m":256'):
        assert part in key
    autotune.clear_memory()   # a later process: the file answers, nothing is timed
    assert autotune.pick("matmul", {"m": 256}, c, None, c[0], measure=lambda r, x: pytest.fail("timed")) == c[1]


def test_autotune_keeps_the_default_within_the_margin(tune_env):
    """A candidate must beat the heuristic's default by more than MARGIN to replace it; each
    candidate's median over the passes decides (one slow outlier does not)."""
    autotune = tune_env
    c = _cands()
    times = {0: [1.00, 1.00, 1.00], 1: [0.99, 0.99, 0.99], 2: [0.90, 3.00, 0.90]}
    seen = {0: 0, 1: 0, 2: 0}

    def measure(run, cfg):
        i = c.index(cfg)
        seen[i] += 1
        return times[i][seen[i] - 1]
    assert autotune.pick("matmul", {"m": 3}, c[:2], None, c[0], arch="sm_90", measure=measure) == c[0]
    seen.update({0: 0, 1: 0, 2: 0})
    assert autotune.pick("matmul", {"m": 4}, c, None, c[0], arch="sm_90", measure=measure) == c[2]


def test_autotune_prunes_before_launch(tune_env):
    autotune = tune_env
    big = mm._config(mm.TUNE_ONLY[0], "bfloat16")         # 144 KiB ring: more than sm_86 allows
    small = mm._config(mm.TC_TILES[-1], "bfloat16")
    assert autotune.prune([big, small], arch="sm_86") == [small]
    seen = []
    autotune.pick("matmul", {"m": 1}, [big, small], None, small, arch="sm_86",
                  measure=lambda r, cfg: seen.append(cfg) or 1.0)
    assert seen == [small] * autotune.ROUNDS


def test_autotune_corrupt_file_is_ignored(tune_env):
    autotune = tune_env
    autotune.path().parent.mkdir(parents=True, exist_ok=True)
    autotune.path().write_text("{not json")
    c = _cands()
    with pytest.warns(autotune.AutotuneWarning):
        best = autotune.pick("matmul", {"m": 2}, c, None, c[0], measure=lambda r, cfg: float(cfg.block_n))
    assert best.block_n == min(x.block_n for x in c)
    assert len(autotune.load()) == 1


def test_autotune_concurrent_writers_merge(fresh_cache):
    """Eight processes store different keys at once; none is lost and the file stays valid JSON."""
    code = textwrap.dedent("""
        import sys
        from rtkernels import autotune
        i = int(sys.argv[1])
        for j in range(5):
            assert autotune.store({f"p{i}-{j}": {"config": {"i": i, "j": j}, "ms": 1.0}})
    """)
    env = dict(os.environ, RTKERNELS_CACHE_DIR=str(fresh_cache), PYTHONPATH=os.getcwd())
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], env=env) for i in range(8)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    from rtkernels import autotune
    entries = autotune.load()
    assert set(entries) == {f"p{i}-{j}" for i in range(8) for j in range(5)}


# ---- GPU correctness --------------------------------------------------------------------------
def _inputs(rng, shape, dtype):
    from gpu_util import random_array
    return random_array(rng, shape, dtype)


def _cublas(a, b, dtype, trans_a=False, trans_b=False):
    """The same product by cuBLAS (cupy.matmul) in the input dtype, as float64 on the host."""
    import cupy as cp
    if dtype == "bfloat16":
        import torch
        ta = torch.from_dlpack(a).view(torch.bfloat16)
        tb = torch.from_dlpack(b).view(torch.bfloat16)
        ta = ta.transpose(-1, -2) if trans_a else ta
        tb = tb.transpose(-1, -2) if trans_b else tb
        return (ta @ tb).double().cpu().numpy()
    a_ = a.swapaxes(-1, -2) if trans_a else a
    b_ = b.swapaxes(-1, -2) if trans_b else b
    return cp.matmul(a_, b_).get().astype(np.float64)


def _check(got, ref, peer, what):
    err = np.abs(got - ref).max()
    peer_err = np.abs(peer - ref).max()
    scale = max(np.abs(ref).max(), 1.0)
    assert np.isfinite(got).all(), what
    assert err <= 2 * peer_err + 1e-6 * scale, f"{what}: max error {err:.3g} vs cuBLAS {peer_err:.3g}"


SHAPES = [(1, 1, 1), (17, 33, 9), (127, 129, 65), (1000, 1000, 1000), (4096, 4096, 4096), (65536, 64, 64),
          (64, 64, 65536)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_shapes(dtype, shape):
    from gpu_util import poison, to_f64
    import rtkernels as rtk
    M, N, K = shape
    if dtype == "float32" and M * N * K > 2 ** 33:
        pytest.skip("SIMT float32 at this size is slow and adds nothing")
    rng = np.random.default_rng(M + N + K)
    a, ah = _inputs(rng, (M, K), dtype)
    b, bh = _inputs(rng, (K, N), dtype)
    out = poison(_empty((M, N), dtype))
    rtk.matmul(a, b, out=out, dtype=dtype if dtype == "bfloat16" else None)
    _check(to_f64(out, dtype), ah @ bh, _cublas(a, b, dtype), f"{dtype} {shape}")


def _empty(shape, dtype):
    import cupy as cp
    return cp.empty(shape, dtype=cp.uint16 if dtype == "bfloat16" else dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_gpu_epilogue_and_layouts(dtype, activation, trans_a, trans_b):
    from gpu_util import poison, to_f64
    import rtkernels as rtk
    M, N, K = 127, 200, 72
    rng = np.random.default_rng(7)
    a, ah = _inputs(rng, (K, M) if trans_a else (M, K), dtype)
    b, bh = _inputs(rng, (N, K) if trans_b else (K, N), dtype)
    bias, biash = _inputs(rng, (N,), dtype)
    out = poison(_empty((M, N), dtype))
    rtk.matmul(a, b, bias=bias, activation=activation, out=out, trans_a=trans_a, trans_b=trans_b,
               dtype=dtype if dtype == "bfloat16" else None)
    ref = mm.matmul_reference(ah, bh, bias=biash, activation=activation, trans_a=trans_a, trans_b=trans_b)
    peer_lin = _cublas(a, b, dtype, trans_a, trans_b) + biash
    _check(to_f64(out, dtype), ref, mm._act_np(peer_lin, activation), f"{dtype} {activation} {trans_a}{trans_b}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(3, 65, 70, 33), (5, 128, 256, 64), (2, 9, 7, 13)])
def test_gpu_batched_and_views(dtype, shape):
    from gpu_util import poison, to_f64
    import rtkernels as rtk
    B, M, N, K = shape
    rng = np.random.default_rng(B * M)
    a, ah = _inputs(rng, (B, M, K + 3), dtype)     # a column-sliced view: row stride K + 3
    b, bh = _inputs(rng, (B, K, N), dtype)
    a, ah = a[:, :, 1:K + 1], ah[:, :, 1:K + 1]     # and an unaligned base
    out = poison(_empty((B, M, N), dtype))
    rtk.matmul(a, b, out=out, dtype=dtype if dtype == "bfloat16" else None)
    _check(to_f64(out, dtype), ah @ bh, _cublas(a, b, dtype), f"batched {dtype} {shape}")
    b2, b2h = _inputs(rng, (K, N), dtype)           # broadcast 2-D b over the batch
    out2 = rtk.matmul(a, b2, dtype=dtype if dtype == "bfloat16" else None)
    assert out2.shape == (B, M, N)
    ref = ah @ b2h
    got = to_f64(out2, dtype)
    assert np.abs(got - ref).max() <= 2 * np.abs(_cublas(a, b2[None].repeat(B, 0), dtype) - ref).max() + 1e-6


@pytest.mark.gpu
def test_gpu_errors():
    import cupy as cp
    import rtkernels as rtk
    a = cp.ones((4, 5), cp.float16)
    with pytest.raises(ConfigError, match="a.shape\\[-1\\] must equal b.shape\\[-2\\]"):
        rtk.matmul(a, cp.ones((4, 3), cp.float16))
    with pytest.raises(ConfigError, match="same dtype"):
        rtk.matmul(a, cp.ones((5, 3), cp.float32))
    with pytest.raises(ConfigError, match="out .* broadcast"):      # (a[::2, ::2] is copied and runs)
        rtk.matmul(a, cp.ones((5, 3), cp.float16), out=cp.broadcast_to(cp.empty((1, 3), cp.float16), (4, 3)))
    with pytest.raises(ConfigError, match="activation"):
        rtk.matmul(a, cp.ones((5, 3), cp.float16), activation="tanh")
    with pytest.raises(ConfigError, match="bias"):
        rtk.matmul(a, cp.ones((5, 3), cp.float16), bias=cp.ones(4, cp.float16))
    with pytest.raises(ConfigError, match="float64"):
        rtk.matmul(cp.ones((4, 5)), cp.ones((5, 3)))


@pytest.mark.gpu
def test_gpu_autotune_matches_heuristic_result(fresh_cache, monkeypatch):
    import cupy as cp
    import rtkernels as rtk
    from rtkernels import autotune
    rng = np.random.default_rng(3)
    a = cp.asarray(rng.standard_normal((513, 300)).astype(np.float16))
    b = cp.asarray(rng.standard_normal((300, 257)).astype(np.float16))
    ref = rtk.matmul(a, b)
    monkeypatch.setenv("RTKERNELS_AUTOTUNE", "1")
    autotune.clear_memory()
    tuned = rtk.matmul(a, b)
    assert autotune.path().exists() and len(autotune.load()) == 1
    assert float(cp.abs(tuned.astype(cp.float32) - ref.astype(cp.float32)).max()) == 0.0


# On sm_90 rtk.matmul sends TMA-addressable inputs to the Hopper kernel, so the tests above reach
# the mma.sync kernel only through unaligned operands (narrow loads).  Its aligned paths, which
# sm_80-89 run for everything, are forced here for every tile the heuristic and the autotuner can
# pick: 16-byte copies from precomputed addresses, 16-byte C stores, even and tail K, both B
# layouts, with several calls queued back to back and no synchronization in between (as a
# benchmark's warm-up runs them).
@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, {"ldsm_first": False, "copy_steps": 1}],
                         ids=["default", "copies-first"])
@pytest.mark.parametrize("tile", mm.TC_TILES + mm.TUNE_ONLY, ids=lambda t: f"{_tile_id(t)}w{t.num_warps}")
@pytest.mark.parametrize("shape, trans_b", [((1024, 1024, 1024), False), ((1000, 520, 1000), True)],
                         ids=["1024-even-k", "1000x520x1000-tn"])
def test_gpu_mma_sync_aligned_back_to_back(monkeypatch, tile, shape, trans_b, variant):
    import cupy as cp
    import rtkernels as rtk
    from gpu_util import f32_from_bf16_bits, poison
    monkeypatch.setattr(mm, "USE_SM90", False)
    monkeypatch.setattr(mm, "_choose_tile", lambda *a, **k: tile)
    monkeypatch.setattr(mm, "_plans", {})
    monkeypatch.setattr(mm, "_LAUNCHES", LaunchPlans())   # no replay of another case's tile
    base_config = mm._config
    monkeypatch.setattr(mm, "_config", lambda *a, **k: dataclasses.replace(base_config(*a, **k), **variant))
    M, N, K = shape
    rng = np.random.default_rng(M + K)
    sets = [(_inputs(rng, (M, K), "bfloat16")[0], _inputs(rng, (N, K) if trans_b else (K, N), "bfloat16")[0])
            for _ in range(4)]
    outs = [poison(_empty((M, N), "bfloat16")) for _ in sets]
    for (a, b), out in zip(sets, outs):
        rtk.matmul(a, b, out=out, trans_b=trans_b, dtype="bfloat16")
    cp.cuda.Device().synchronize()
    f32 = lambda x: cp.asarray(f32_from_bf16_bits(x.get()))   # noqa: E731
    for i, ((a, b), out) in enumerate(zip(sets, outs)):
        ref = cp.matmul(f32(a), f32(b).T if trans_b else f32(b))
        got = f32(out)
        assert bool(cp.isfinite(got).all()), f"call {i}: C not fully written"
        err = float(cp.abs(got - ref).max())
        bound = float((cp.abs(ref) * 2 ** -8).max()) + 1e-3   # bf16 rounding of C, float32 accumulation
        assert err <= bound, f"call {i}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_gpu_launch_plans_replay_per_signature(monkeypatch, kind):
    """Second calls with a signature replay the first call's launch (fresh data, new addresses);
    bias/activation/transposes/out given are other plans; torch tensors run on torch's current
    stream (inputs written on a side stream right before each call)."""
    import cupy as cp
    import rtkernels as rtk
    monkeypatch.setattr(mm, "_LAUNCHES", LaunchPlans())
    rng = np.random.default_rng(9)
    M, N, K = 300, 264, 200
    if kind == "torch":
        torch = pytest.importorskip("torch")
        s = torch.cuda.Stream()
        ctx = torch.cuda.stream(s)

        def make(shape):
            return torch.from_numpy(rng.standard_normal(shape).astype(np.float16)).cuda()

        def f64(x):
            return x.double().cpu().numpy()
    else:
        import contextlib
        ctx = contextlib.nullcontext()

        def make(shape):
            return cp.asarray(rng.standard_normal(shape).astype(np.float16))

        def f64(x):
            return cp.asnumpy(x).astype(np.float64)
    results = []
    with ctx:
        for trial in range(3):
            a, b, bt, bias = make((M, K)), make((K, N)), make((N, K)), make((N,))
            if kind == "torch":
                a.mul_(1.0)   # queued on the side stream right before the op
            results.append((a, b, bt, bias, rtk.matmul(a, b), rtk.matmul(a, bt, trans_b=True, bias=bias,
                                                                         activation="relu")))
    if kind == "torch":
        s.synchronize()
    for a, b, bt, bias, c1, c2 in results:
        ref1 = f64(a) @ f64(b)
        ref2 = np.maximum(f64(a) @ f64(bt).T + f64(bias), 0)
        for got, ref in ((c1, ref1), (c2, ref2)):
            err = np.abs(f64(got) - ref).max()
            assert err <= 2 ** -9 * np.abs(ref).max() + 1e-2, f"max error {err:.3g}"
    assert len(mm._LAUNCHES) == 2


# ---- rows that end inside a load chunk (edge_a / edge_b) ------------------------------------------
# The sanitizer gate's first run (H100, 2026-11-25) found the mma.sync kernel reading 16 bytes of
# 1x1x1's 2-byte A: a cp.async with a partial source size is one LDGSTS.ZFILL, which memcheck
# counts as a read of its whole chunk.  Operands whose contiguous extent is not a multiple of their
# load width now load that last chunk element by element.
def test_edge_flags_follow_vec():
    with pytest.raises(ConfigError) as e:
        MatmulConfig(vec_a=1, edge_a=True, block_m=128, block_n=128, num_warps=8, warps_m=2)
    assert e.value.field == "edge_a" and "vec_a=1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        MatmulConfig(edge_b=1)
    assert e.value.field == "edge_b"


# (name, config): the 1x1x1 case (both operands K-major, K tail), the TC tile with a K-major A
# tail and an N-contiguous B edge in the double-buffered loop, and a narrow tile (checked copies)
_EDGE_CONFIGS = [
    ("1x1x1", dict(tile=mm.TC_TILES[4], k=1, a_kmajor=True, b_kmajor=True, has_bias=True, edge_a=True,
                   edge_b=True)),
    ("tc-tail", dict(tile=mm.TC_TILES[0], k=37, a_kmajor=True, b_kmajor=False, edge_a=True, edge_b=True)),
    ("narrow", dict(tile=mm.NARROW_TILES[0], k=37, a_kmajor=False, b_kmajor=True, vec_a=4, vec_b=8,
                    edge_a=True, edge_b=True)),
]


@pytest.fixture(scope="module")
def edge_kernels():
    import rtkernels as rtk
    out = {}
    for name, p in _EDGE_CONFIGS:
        p = dict(p)
        cfg = mm._config(p.pop("tile"), "bfloat16", p.pop("k"), **p)
        out[name] = (cfg, rtk.get_kernel(cfg, arch="sm_90"))
    return out


@pytest.mark.parametrize("name", [n for n, _ in _EDGE_CONFIGS])
def test_edge_configs_keep_16_byte_copies(edge_kernels, name):
    """With edge_a / edge_b the interior chunks still move as 16-byte cp.async (LDGSTS.128) and only
    the partial chunks take 16-bit loads (8 per 16-byte chunk site, 4 per 8-byte one); no spills."""
    import rtkernels as rtk
    from rtkernels.inspect import sass_stats
    cfg, k = edge_kernels[name]
    r, s = k.resources, sass_stats(k.sass)
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, (name, r)
    ldgsts = [ln for ln in k.sass.splitlines() if "LDGSTS" in ln]
    assert ldgsts and any(".128" in ln for ln in ldgsts), name
    plain = rtk.get_kernel(dataclasses.replace(cfg, edge_a=False, edge_b=False), arch="sm_90")
    edge_loads = s["ldg_16"] - sass_stats(plain.sass)["ldg_16"]   # (the bias loads are 16-bit too)
    assert edge_loads > 0 and edge_loads % 4 == 0, (name, s)


# (label, dtype, M, N, K, batch, A stored (rows, cols) row stride (0: one row), trans_a, B row
# stride, trans_b, bias, activation, expected (edge_a, edge_b)).  Every operand is a view whose
# last element is the last element of its own exact-size allocation.
EDGE_CASES = [
    ("bf16 1x1x1 bias (the gate's failing case)", "bfloat16", 1, 1, 1, 0, 1, False, 1, False, True, None,
     (True, True)),
    ("bf16 65x40x37 A rows padded to 40", "bfloat16", 65, 40, 37, 0, 40, False, 40, False, True, "gelu",
     (True, False)),
    ("f16 batch 2 33x45x64 B rows padded to 48", "float16", 33, 45, 64, 2, 64, False, 48, False, False, None,
     (False, True)),
    ("bf16 50x50x37 4-element loads, both padded", "bfloat16", 50, 50, 37, 0, 44, False, 52, False, True, None,
     (True, True)),
    ("f16 1x70x13 one row, B^T rows of 16", "float16", 1, 70, 13, 0, 13, False, 16, True, False, "relu",
     (True, True)),
    ("bf16 27x64x29 A^T rows padded to 32", "bfloat16", 27, 64, 29, 0, 32, True, 64, False, False, None,
     (True, False)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: c[0])
def test_gpu_rows_ending_inside_a_chunk(monkeypatch, case):
    """The mma.sync kernel on operands whose rows end inside a load chunk, each a view ending where
    its exact-size allocation ends (run it under compute-sanitizer --tool memcheck to see that
    nothing past them is read): results against the float64 reference, within twice the error of
    the same float32 product (NumPy) rounded to the dtype; the poisoned C fully written."""
    import cupy as cp
    import rtkernels as rtk
    from gpu_util import bf16_bits_from_f32, f32_from_bf16_bits, poison, to_f64, view_at_allocation_end
    label, dt, M, N, K, batch, lda, ta, ldb, tb, has_bias, act, edges = case
    monkeypatch.setattr(mm, "USE_SM90", False)
    monkeypatch.setattr(mm, "USE_GEMV", False)   # the one-row cases test the mma.sync kernel too
    monkeypatch.setattr(mm, "_plans", {})
    monkeypatch.setattr(mm, "_LAUNCHES", LaunchPlans())
    rng = np.random.default_rng(M * N + K)
    a_rows, a_cols = (K, M) if ta else (M, K)
    b_rows, b_cols = (N, K) if tb else (K, N)
    lead = (batch,) if batch else ()
    a, ah = view_at_allocation_end(rng, lead + (a_rows, a_cols),
                                   (a_rows * lda,) * bool(batch) + (lda if a_rows > 1 else 0, 1), dt)
    b, bh = view_at_allocation_end(rng, lead + (b_rows, b_cols),
                                   (b_rows * ldb,) * bool(batch) + (ldb if b_rows > 1 else 0, 1), dt)
    bias, biash = view_at_allocation_end(rng, (N,), (1,), dt) if has_bias else (None, None)
    out = poison(_empty(lead + (M, N), dt))
    rtk.matmul(a, b, bias=bias, activation=act, out=out, trans_a=ta, trans_b=tb,
               dtype="bfloat16" if dt == "bfloat16" else None)
    cp.cuda.Device().synchronize()
    (key,) = mm._plans
    layout = dict(key[5])
    assert (layout.get("edge_a", False), layout.get("edge_b", False)) == edges, (label, layout)
    ref = mm.matmul_reference(ah, bh, bias=biash, activation=act, trans_a=ta, trans_b=tb)
    lin = np.matmul(np.swapaxes(ah, -1, -2) if ta else ah, np.swapaxes(bh, -1, -2) if tb else bh,
                    dtype=np.float32)
    if has_bias:
        lin = lin + biash.astype(np.float32)
    peer = mm._act_np(lin.astype(np.float64), act).astype(np.float32)
    peer = (f32_from_bf16_bits(bf16_bits_from_f32(peer)) if dt == "bfloat16" else peer.astype(dt)).astype(np.float64)
    got = to_f64(out, dt)
    assert np.isfinite(got).all(), f"{label}: C not fully written (NaN poison left)"
    err, peer_err = np.abs(got - ref).max(), np.abs(peer - ref).max()
    scale = max(np.abs(ref).max(), 1.0)
    assert err <= 2 * peer_err + 1e-6 * scale, f"{label}: max error {err:.3g} vs {peer_err:.3g} (float32, rounded)"
