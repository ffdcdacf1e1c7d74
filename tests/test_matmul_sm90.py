"""Hopper matmul (ops/matmul_sm90.py, templates/matmul_sm90.cu.j2): config validation, sm_90a
compile and SASS checks, NumPy models of the persistent tile walk, of the TMA-swizzle ->
wgmma-descriptor round trip and of the stmatrix -> TMA-store epilogue; GPU correctness against
a float64 reference (including the fallback to the mma.sync kernel for what TMA cannot take), each
GPU test of the op path once with wgmma consumers and once with mma.sync ones (mma="sync")."""
import re

import numpy as np
import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import matmul as mm
from rtkernels.ops import matmul_sm90 as m90
from rtkernels.ops.matmul_sm90 import MatmulSm90Config


# ---- config validation ---------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    (dict(dtype="float32"), "dtype"),
    (dict(block_m=64), "block_m"),
    (dict(block_n=96), "block_n"),
    (dict(block_n=320), "block_n"),
    (dict(block_k=32), "block_k"),
    (dict(num_stages=1), "num_stages"),
    (dict(num_stages=9), "num_stages"),
    (dict(block_m=256, block_n=256), "block_n"),      # 256 accumulators per thread
    (dict(num_stages=5), "num_stages"),               # 5 x 48 KiB ring + staging > 227 KiB
    (dict(epilogue_n=96), "epilogue_n"),
    (dict(block_n=192, num_stages=3, epilogue_n=256), "epilogue_n"),
    (dict(activation="tanh"), "activation"),
    (dict(tma_store=1), "tma_store"),
    (dict(group_m=0), "group_m"),
    (dict(mma="hmma", tma_store=False), "mma"),
    (dict(mma="sync"), "tma_store"),                  # mma.sync warps store C directly
    (dict(block_n=232), "block_n"),                   # off the 64-column grid: B must be K-major
    (dict(block_n=100, b_kmajor=True), "block_n"),    # wgmma N is a multiple of 8
    (dict(block_n=232, b_kmajor=True, mma="sync", tma_store=False), "block_n"),
    (dict(block_n=232, b_kmajor=True, num_stages=4, epilogue_n=256), "epilogue_n"),   # TMA stores 192 columns
])
def test_config_errors(bad, field):
    with pytest.raises(ConfigError) as e:
        MatmulSm90Config(**bad)
    assert e.value.field == field and "matmul_sm90" in str(e.value)


def test_config_derived():
    c = MatmulSm90Config()
    assert c.threads_per_block == 384 and c.needs_arch_specific
    # 4 x 48 KiB ring leaves room for a 128 x 128 staging buffer (two epilogue passes)
    assert c.epi_n == 128 and c.shared_mem_bytes == 1024 + 4 * 48 * 1024 + 128 * 128 * 2 + 64
    assert MatmulSm90Config(num_stages=3).epi_n == 256
    assert MatmulSm90Config(tma_store=False).shared_mem_bytes == 1024 + 4 * 48 * 1024 + 64
    for t in m90.TILES + m90.TUNE_ONLY:
        assert m90._config(t, "bfloat16").shared_mem_bytes <= 227 * 1024
    # a width off the 64-column grid: TMA stores its whole 64-column boxes, direct stores the rest
    flex = MatmulSm90Config(block_n=232, b_kmajor=True, num_stages=4)
    assert flex.tma_n == 192 and flex.epi_n == 128            # passes of 128 + 64 (ragged_epilogue)
    assert MatmulSm90Config(block_n=232, b_kmajor=True, num_stages=3).epi_n == 192
    assert MatmulSm90Config(block_n=232, b_kmajor=True, tma_store=False).tma_n == 0
    for bn in m90.FLEX_NS:   # every width's deepest ring fits
        assert 4 <= m90.flex_stages(bn) <= 6 and m90.flex_tile(4096, bn * 10, 1, 132).block_n in m90.FLEX_NS


# ---- compile, ptxas and SASS ------------------------------------------------------------
def _configs():
    out = []
    for t in m90.TILES:
        for ak, bk in ((True, False), (False, True), (True, True), (False, False)):
            out.append(m90._config(t, "bfloat16", a_kmajor=ak, b_kmajor=bk))
        out.append(m90._config(t, "float16", has_bias=True, activation="gelu"))
        out.append(m90._config(t, "bfloat16", has_bias=True, activation="silu", tma_store=False))
    for t in m90.TUNE_ONLY:
        out.append(m90._config(t, "bfloat16", has_bias=True, activation="relu"))
    out.append(MatmulSm90Config(block_n=232, num_stages=4, b_kmajor=True, has_bias=True, activation="silu"))
    out.append(MatmulSm90Config(dtype="float16", block_n=152, num_stages=5, b_kmajor=True, a_kmajor=False,
                                tma_store=False))
    return out


@pytest.mark.parametrize("cfg", _configs(), ids=lambda c: re.sub(r"\W+", "-", c.key()[12:])[:90])
def test_compiles_clean_for_sm90a(cfg):
    import rtkernels as rtk
    from rtkernels.inspect import sass_stats
    k = rtk.get_kernel(cfg, arch="sm_90")
    assert k.module.arch == "sm_90a"
    r = k.resources
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, r
    # (384, 1) launch bounds cap the kernel at 168; setmaxnreg moves them to the consumers
    assert r.registers == 168, r
    log = k.module.log
    assert "C7508" not in log and "setmaxnreg" not in log.lower(), log    # setmaxnreg ignored
    assert "serializ" not in log.lower(), log                           # wgmma serialized by ptxas
    s = sass_stats(k.sass)
    assert s["ldl"] == 0 and s["stl"] == 0
    assert s["hgmma"] >= 4 * (cfg.block_m // 128) and s["utmaldg"] > 0 and "SYNCS" in k.sass
    assert "SETMAXNREG" in k.sass or "USETMAXREG" in k.sass
    if cfg.tma_store:
        assert s["utmastg"] > 0 and "STSM" in k.sass
    else:
        assert s["utmastg"] == 0


def test_flexible_widths_compile_without_spills():
    """Every width rule 4 may pick, with the heaviest epilogue it may get (bias + GELU up to
    FLEX_MAX_N_GELU, bias + SiLU beyond), compiles without spills."""
    import rtkernels as rtk
    for bn in m90.FLEX_NS:
        act = "gelu" if bn <= m90.FLEX_MAX_N_GELU else "silu"
        cfg = MatmulSm90Config(block_n=bn, num_stages=m90.flex_stages(bn), b_kmajor=True, has_bias=True,
                               activation=act)
        r = rtk.get_kernel(cfg, arch="sm_90").resources
        assert r.spill_stores == 0 and r.spill_loads == 0, (bn, act, r)
    assert m90.flex_tile(3000, 5000, 1, 132, "gelu").block_n <= m90.FLEX_MAX_N_GELU


def _main_loop(sass, mnemonic):
    """The SASS opcodes from the first to the last instruction starting with ``mnemonic``."""
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", sass)
    first = next(i for i, o in enumerate(ops) if o.startswith(mnemonic))
    last = max(i for i, o in enumerate(ops) if o.startswith(mnemonic))
    return ops[first:last + 1]


def _sync_configs():
    out = []
    for t in m90.TILES:
        if t.block_m != 128:
            continue
        for ak, bk in ((True, False), (False, True), (True, True), (False, False)):
            out.append(m90._config(t, "bfloat16", a_kmajor=ak, b_kmajor=bk, tma_store=False, mma="sync"))
        out.append(m90._config(t, "float16", has_bias=True, activation="gelu", tma_store=False, mma="sync"))
    return out


@pytest.mark.parametrize("cfg", _sync_configs(), ids=lambda c: re.sub(r"\W+", "-", c.key()[12:])[:90])
def test_sync_consumers_compile_clean(cfg):
    """mma="sync": HMMA from ldmatrix fragments, TMA loads, no wgmma, no cp.async, no local memory,
    one k-tile's 4 k16 steps unrolled once (KSTEPS x m16 x n8 HMMAs) within the setmaxnreg budget."""
    import rtkernels as rtk
    from rtkernels.inspect import sass_stats
    k = rtk.get_kernel(cfg, arch="sm_90")
    r = k.resources
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, r
    s = sass_stats(k.sass)
    mi, ni = cfg.block_m // 2 // 16, cfg.block_n // 4 // 8
    assert s["hmma"] == 4 * mi * ni and s["hgmma"] == 0 and s["ldgsts"] == 0, s
    assert s["utmaldg"] > 0 and s["ldsm"] >= 4 * (mi + ni // 2) and s["ldl"] == 0 and s["stl"] == 0, s
    used = max(int(x) for x in re.findall(r"\bR(\d+)\b", k.sass))
    assert used < m90._CONSUMER_REGS, "consumers stay within the registers setmaxnreg gives them"
    if cfg.block_n == 256:   # 128 accumulators + two fragment buffers: beyond the launch's 168
        assert used >= 168


def test_sync_main_loop_is_hmma_and_ldmatrix():
    """Between its first and last HMMA the 128x256 sync consumer issues the 128 HMMAs of a k-tile, the
    32 ldmatrix of the next steps and the stage bookkeeping, nothing per copy (the cp.async kernel
    spends ~11% of its main loop there)."""
    import rtkernels as rtk
    body = _main_loop(rtk.get_kernel(MatmulSm90Config(mma="sync", tma_store=False), arch="sm_90").sass, "HMMA")
    assert sum(o.startswith("HMMA") for o in body) == 128 and sum(o.startswith("LDSM") for o in body) == 32
    other = [o for o in body if not o.startswith(("HMMA", "LDSM", "U"))]
    assert len(other) <= 12, other


@pytest.mark.parametrize("bad, field", [(dict(block_size=96), "block_size"), (dict(chunks_per_thread=0),
                                                                               "chunks_per_thread")])
def test_pad_rows_config_errors(bad, field):
    with pytest.raises(ConfigError) as e:
        mm.PadRowsConfig(**bad)
    assert e.value.field == field


def test_pad_rows_compiles_to_16_byte_loads_and_stores():
    """The staging copy reads aligned 16-byte words (LDG.128, two per chunk) and writes 16-byte
    chunks (STG.128), with no local memory (the word select is not a runtime-indexed array); only
    the chunks at a row's edges read element by element (8 LDG.U16 per chunk), and ptxas keeps
    every thread to 32 registers (16 blocks of 128 threads per SM: full occupancy)."""
    import rtkernels as rtk
    from rtkernels.inspect import sass_stats
    cfg = mm.PadRowsConfig()
    k = rtk.get_kernel(cfg, arch="sm_90")
    s = sass_stats(k.sass)
    assert s["ldg_128"] == 2 * cfg.chunks_per_thread and s["stg_128"] == cfg.chunks_per_thread, s
    assert s["ldl"] == 0 and s["stl"] == 0, s
    assert s["ldg_16"] == 8 * cfg.chunks_per_thread and s["ldg_32"] == s["ldg_64"] == 0, s
    assert k.resources.registers <= 32, k.resources


def test_main_loop_is_wgmma_only():
    """Between the full-barrier wait and the release of the previous stage, the 128x256 consumer
    issues its 4 HGMMA 64x256x16 and little else (uniform-datapath descriptor arithmetic)."""
    import rtkernels as rtk
    body = _main_loop(rtk.get_kernel(MatmulSm90Config(), arch="sm_90").sass, "HGMMA")
    assert sum(o.startswith("HGMMA.64x256x16") for o in body) == 4
    assert sum(not o.startswith("U") and not o.startswith("HGMMA") for o in body) <= 8, body


# ---- NumPy model: the persistent tile walk --------------------------------------------------
def _tile_at(t, tiles_m, tiles_n, bm, bn, gm):
    per_batch = tiles_m * tiles_n
    z, r = divmod(t, per_batch)
    per_group = gm * tiles_n
    first_m = (r // per_group) * gm
    rows = min(tiles_m - first_m, gm)
    ig = r % per_group
    return (first_m + ig % rows) * bm, (ig // rows) * bn, z


@pytest.mark.parametrize("m, n, batch, bm, bn, gm, sms", [
    (4096, 4096, 1, 128, 256, 8, 132), (1000, 1000, 1, 128, 128, 8, 132), (129, 4000, 3, 256, 128, 3, 132),
    (1, 1, 1, 128, 256, 8, 132), (65536, 64, 1, 128, 64, 8, 132), (300, 700, 7, 128, 192, 5, 16),
    (8192, 8192, 2, 128, 256, 8, 114), (17, 5000, 1, 128, 64, 64, 132),
])
def test_tile_walk_covers_every_tile_once(m, n, batch, bm, bn, gm, sms):
    cfg = MatmulSm90Config(block_m=bm, block_n=bn, num_stages=3, group_m=gm)
    grid = m90.grid_size(m, n, batch, cfg, sms)
    tiles_m, tiles_n = -(-m // bm), -(-n // bn)
    total = tiles_m * tiles_n * batch
    assert grid == min(total, sms)
    seen = []
    for cta in range(grid):
        # what the producer and both consumers of this CTA walk, in order
        seen += [_tile_at(t, tiles_m, tiles_n, bm, bn, gm) for t in range(cta, total, grid)]
    assert len(seen) == len(set(seen)) == total
    assert set(seen) == {(i * bm, j * bn, z) for i in range(tiles_m) for j in range(tiles_n) for z in range(batch)}
    # one round of the walk touches few tile rows/columns: L2 reuse of the grouped order
    if tiles_m >= gm and tiles_n * gm >= grid and batch == 1:
        first_round = seen[:0] + [_tile_at(t, tiles_m, tiles_n, bm, bn, gm) for t in range(grid)]
        assert len({r for r, _, _ in first_round}) <= 2 * gm


# ---- NumPy model: TMA 128-byte swizzle -> wgmma descriptors -> accumulators -----------------
def _sw128(addr):
    """TMA's SWIZZLE_128B and wgmma's SW_128B both XOR address bits [4, 7) with bits [7, 10)."""
    return addr ^ (((addr >> 7) & 7) << 4)


class _Smem:
    def __init__(self, nbytes):
        self.v = np.full(nbytes // 2, np.nan)

    def tma_load(self, dst, g, r0, c0, rows):
        """A (rows x 64) box of the 2-D tensor g at (r0, c0); out-of-bounds elements are 0."""
        assert dst % 1024 == 0
        for r in range(rows):
            for c in range(64):
                gr, gc = r0 + r, c0 + c
                val = g[gr, gc] if gr < g.shape[0] and gc < g.shape[1] else 0.0
                self.v[_sw128(dst + r * 128 + 2 * c) // 2] = val

    def read_kmajor(self, desc_start, sbo, mn):
        """The mn x 16 operand a K-major SW128 descriptor describes (canonical ((8,m),(8,2)))."""
        out = np.empty((mn, 16))
        for i in range(mn):
            for k in range(16):
                out[i, k] = self.v[_sw128(desc_start + (i % 8) * 128 + (i // 8) * sbo + (k // 8) * 16 + (k % 8) * 2) // 2]
        return out

    def read_mnmajor(self, desc_start, lbo, sbo, mn):
        """The mn x 16 operand an MN-major SW128 descriptor describes (canonical ((8,8,m),(8,2)))."""
        out = np.empty((mn, 16))
        for i in range(mn):
            for k in range(16):
                out[i, k] = self.v[_sw128(desc_start + (i % 64) * 2 + (i // 64) * lbo + (k % 8) * 128
                                          + (k // 8) * sbo) // 2]
        return out


def _model_tile(A, B, cfg, m0, n0, stages=2):
    """Accumulators of one CTA tile, computed the way the kernel moves data (all consumers)."""
    K = A.shape[1]
    bm, bn = cfg.block_m, cfg.block_n
    wg_m, mi_n = bm // 2, bm // 128
    a_stage, b_stage = bm * 128, bn * 128
    ga = A if cfg.a_kmajor else A.T           # the stored 2-D tensor, contiguous dim last
    gb = B.T if cfg.b_kmajor else B
    smem = _Smem(stages * (a_stage + b_stage))
    s_a, s_b = 0, stages * a_stage
    acc = np.zeros((bm, bn))
    for kt in range(-(-K // 64)):
        s = kt % stages
        a_dst, b_dst, k0 = s_a + s * a_stage, s_b + s * b_stage, kt * 64
        if cfg.a_kmajor:
            smem.tma_load(a_dst, ga, m0, k0, bm)
        else:
            for i in range(bm // 64):
                smem.tma_load(a_dst + i * 8192, ga, k0, m0 + 64 * i, 64)
        if cfg.b_kmajor:
            smem.tma_load(b_dst, gb, n0, k0, bn)
        else:
            for j in range(bn // 64):
                smem.tma_load(b_dst + j * 8192, gb, k0, n0 + 64 * j, 64)
        for cw in range(2):
            a0 = s_a + (cw * wg_m * 128 if cfg.a_kmajor else cw * mi_n * 8192)
            a_mi, a_k = (64 * 128, 32) if cfg.a_kmajor else (8192, 2048)
            b_k = 32 if cfg.b_kmajor else 2048
            for kk in range(4):
                bs = s_b + s * b_stage + kk * b_k
                bop = smem.read_kmajor(bs, 1024, bn) if cfg.b_kmajor else smem.read_mnmajor(bs, 8192, 1024, bn)
                for i in range(mi_n):
                    st = a0 + s * a_stage + i * a_mi + kk * a_k
                    aop = smem.read_kmajor(st, 1024, 64) if cfg.a_kmajor else smem.read_mnmajor(st, 8192, 1024, 64)
                    r = cw * wg_m + 64 * i
                    acc[r:r + 64] += aop @ bop.T
    return acc


@pytest.mark.parametrize("ak, bk, bm, bn, shape, origin", [
    (True, False, 128, 256, (128, 256, 128), (0, 0)),
    (True, True, 128, 128, (200, 300, 100), (128, 128)),       # ragged M, N and K tails
    (False, False, 256, 128, (256, 128, 64), (0, 0)),
    (False, True, 128, 64, (130, 70, 150), (128, 64)),
])
def test_numpy_model_of_descriptors(ak, bk, bm, bn, shape, origin):
    M, N, K = shape
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    cfg = MatmulSm90Config(block_m=bm, block_n=bn, num_stages=2, a_kmajor=ak, b_kmajor=bk)
    m0, n0 = origin
    acc = _model_tile(A, B, cfg, m0, n0)
    ref = np.zeros((bm, bn))
    blk = (A @ B)[m0:m0 + bm, n0:n0 + bn]
    ref[:blk.shape[0], :blk.shape[1]] = blk
    assert np.isfinite(acc).all()   # every operand element was written by a box before it was read
    np.testing.assert_allclose(acc, ref, atol=1e-9)


def _sw128_offset(box_rows, row, col):
    """templates/matmul_sm90.cu.j2 sw128: physical byte offset of (row, col) in 64-column boxes."""
    return (col >> 6) * (box_rows * 128) + row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2


@pytest.mark.parametrize("ak, bk, bm, bn", [(True, False, 128, 256), (False, True, 128, 128), (True, True, 128, 64),
                                            (False, False, 128, 256)])
def test_numpy_model_of_sync_fragments(ak, bk, bm, bn):
    """TMA boxes -> the ldmatrix row addresses of SyncConsumer (SwFrag): every lane of every warp
    points at the 8 elements its matrix row needs, for each fragment and k16 step of a stage."""
    rng = np.random.default_rng(bm + bn)
    A, B = rng.standard_normal((bm, 64)), rng.standard_normal((64, bn))   # one stage's tiles
    a_stage, b_stage = bm * 128, bn * 128
    smem = _Smem(2 * (a_stage + b_stage))
    st = 1   # stage 1: non-zero stage offsets
    a_dst, b_dst = st * a_stage, 2 * a_stage + st * b_stage
    if ak:
        smem.tma_load(a_dst, A, 0, 0, bm)
    else:
        for i in range(bm // 64):
            smem.tma_load(a_dst + i * 8192, A.T, 0, 64 * i, 64)
    if bk:
        smem.tma_load(b_dst, B.T, 0, 0, bn)
    else:
        for j in range(bn // 64):
            smem.tma_load(b_dst + j * 8192, B, 0, 64 * j, 64)

    def row8(addr):   # the 16 bytes ldmatrix reads for one matrix row
        assert addr % 16 == 0
        return np.array([smem.v[(addr + 2 * e) // 2] for e in range(8)])

    def frag_addr(kmajor, outer, o, kb, f, s):   # SwFrag<KMAJOR, OUTER, .>::init(o, kb) then at(stage, f, s)
        if kmajor:
            return _sw128_offset(outer, o, kb + 16 * s) + f * 16 * 128
        return _sw128_offset(64, kb, o + 16 * f) + s * 16 * 128

    wm, wn = bm // 2, bn // 4
    for cw in range(2):
        for warp in range(4):
            wm0, wn0 = cw * wm, warp * wn
            for lane in range(32):
                j8, l8 = lane >> 3, lane & 7
                for s in range(4):
                    for i in range(wm // 16):          # A matrix j8: (m +8 (j8 & 1), k +8 (j8 >> 1))
                        m, k = wm0 + 16 * i + (j8 & 1) * 8, 16 * s + (j8 >> 1) * 8
                        if ak:
                            got = row8(a_dst + frag_addr(True, bm, wm0 + (j8 & 1) * 8 + l8, (j8 >> 1) * 8, i, s))
                            want = A[m + l8, k:k + 8]
                        else:   # .trans: the address row is a k row holding 8 m
                            got = row8(a_dst + frag_addr(False, bm, wm0 + (j8 & 1) * 8, (j8 >> 1) * 8 + l8, i, s))
                            want = A[m:m + 8, k + l8]
                        np.testing.assert_array_equal(got, want)
                    for f in range(wn // 16):          # B matrix j8: (n +8 (j8 >> 1), k +8 (j8 & 1))
                        n, k = wn0 + 16 * f + (j8 >> 1) * 8, 16 * s + (j8 & 1) * 8
                        if bk:
                            got = row8(b_dst + frag_addr(True, bn, wn0 + (j8 >> 1) * 8 + l8, (j8 & 1) * 8, f, s))
                            want = B[k:k + 8, n + l8]
                        else:
                            got = row8(b_dst + frag_addr(False, bn, wn0 + (j8 >> 1) * 8, (j8 & 1) * 8 + l8, f, s))
                            want = B[k + l8, n:n + 8]
                        np.testing.assert_array_equal(got, want)


def test_numpy_model_of_epilogue():
    """Accumulator fragments -> stmatrix at the kernel's swizzled addresses -> the boxes a TMA
    store reads back: every C element of a 64 x EPI_N pass lands where the store expects it."""
    for wg_m, epi_n in ((64, 128), (64, 256), (128, 64)):
        rng = np.random.default_rng(wg_m + epi_n)
        C = rng.standard_normal((wg_m, epi_n))
        buf = np.full(wg_m * epi_n, np.nan)
        for i in range(wg_m // 64):
            for warp in range(4):
                for jj in range(epi_n // 16):
                    # fragments: frag[lane][q] = pair (row lane/4 (+8 if q odd), cols 8(2jj + q//2) + 2(lane%4))
                    for lane in range(32):
                        q, r8 = lane >> 3, lane & 7
                        row = i * 64 + warp * 16 + (q & 1) * 8 + r8
                        cg = 2 * jj + (q >> 1)
                        addr = (cg >> 3) * (wg_m * 128) + row * 128 + (((cg & 7) ^ r8) << 4)
                        # stmatrix: the 8 values of row r8 of matrix q come from lanes 4 r8 .. 4 r8 + 3
                        for t in range(4):
                            for e in range(2):
                                src_row = i * 64 + warp * 16 + (q & 1) * 8 + (4 * r8 + t) // 4
                                src_col = 8 * cg + 2 * t + e
                                buf[(addr + 4 * t + 2 * e) // 2] = C[src_row, src_col]
        assert np.isfinite(buf).all()
        for b in range(epi_n // 64):
            for r in range(wg_m):
                for c in range(64):
                    assert buf[_sw128(b * wg_m * 128 + r * 128 + 2 * c) // 2] == C[r, 64 * b + c]


# ---- heuristics and eligibility --------------------------------------------------------------
def test_heuristic_choice():
    big = m90.heuristic_config("bfloat16", 4096, 4096, 4096, sm_count=132)
    assert (big.block_m, big.block_n) == (128, 256)
    # rule 4: widths off the 64-column grid that fill the last round (K-major B only), and not where
    # the model puts them level with 128 x 256 (FLEX_NS's measurements)
    def pick(m, n, k, **kw):
        return m90.heuristic_config("bfloat16", m, n, k, sm_count=132, stream_k=True, **kw)
    assert (pick(3000, 5000, 2000, b_kmajor=True).block_n, pick(3000, 5000, 2000).block_n) == (232, 256)
    c = pick(512, 10240, 8192, b_kmajor=True)
    assert (c.block_n, c.num_stages, c.stream_k) == (160, 5, False)
    assert pick(512, 10240, 8192).stream_k                     # B N-major: stream-K as before
    for shape in ((8192, 8192, 8192), (2048, 14336, 4096), (4096, 4096, 4096)):
        assert pick(*shape, b_kmajor=True).block_n == 256, shape
    assert pick(128, 4096, 4096, b_kmajor=True).cluster_k == 2   # the thin split comes first
    # rule 5: short K takes one ring stage less where that makes the epilogue one pass
    c = pick(3000, 5000, 2000, b_kmajor=True)
    assert (c.num_stages, c.epi_n, c.tma_n) == (3, 192, 192)
    assert (pick(2048, 4096, 128).num_stages, pick(4096, 4096, 4096).num_stages) == (3, 4)
    assert pick(512, 14336, 4096, b_kmajor=True).num_stages == 4
    # a forced cluster-K schedule on a width off the 64-column grid (its ring sized with B K-major)
    assert m90.with_cluster_k(pick(512, 10240, 8192, b_kmajor=True), 2).cluster_k == 2
    assert m90.heuristic_config("bfloat16", 65536, 64, 64, sm_count=132).block_n == 64
    for n in (1024, 1793, 3000, 8192):
        c = m90.heuristic_config("float16", n, n, n, sm_count=132)
        assert c.shared_mem_bytes <= 227 * 1024


def test_operand_maps_eligibility():
    # K = 9 bfloat16 rows are 18 bytes apart: no tensor map
    assert m90.operand_maps(1 << 20, 17, 9, 9, 1, 0) is None
    assert m90.operand_maps((1 << 20) + 2, 64, 64, 64, 1, 0) is None         # base not 16-byte aligned
    assert m90.operand_maps(1 << 20, 64, 64, 64, 3, 100) is None             # batch stride 200 bytes
    shape, strides = m90.operand_maps(1 << 20, 1000, 1000, 1000, 1, 0)
    assert shape == (1, 1000, 1000) and strides[1:] == (1000, 1) and strides[0] % 8 == 0
    shape, strides = m90.operand_maps(1 << 20, 1, 1, 0, 1, 0)                 # 1 x 1: strides of extent-1 dims
    assert shape == (1, 1, 1) and all(s > 0 and s % 8 == 0 for s in strides[:2])
    from rtkernels.tma import check_tensor_map
    check_tensor_map(1 << 20, "bfloat16", shape, strides, (1, 128, 64))


# ---- GPU -------------------------------------------------------------------------------------
def _sm90_gpu():
    from rtkernels import device
    if device.current_arch() != "sm_90":
        pytest.skip("needs an sm_90 GPU")


def _ran_sm90(m, n, k, batch=1):
    """The Hopper kernel ran (m, n, k, batch), with the consumers mm.SM90_MMA selects."""
    return any(key[1:5] == (m, n, k, batch) and key[10] == mm.SM90_MMA for key in mm._plans90)


@pytest.fixture(params=m90.MMA_KINDS)
def mma(request, monkeypatch):
    """Runs a test with wgmma consumers and again with mma.sync ones (matmul.SM90_MMA); C of at most
    16 rows stays on the Hopper kernel too (these tests are about it, not the GEMV route)."""
    monkeypatch.setattr(mm, "SM90_MMA", request.param)
    monkeypatch.setattr(mm, "USE_GEMV", False)
    return request.param


def _empty(shape, dtype):
    import cupy as cp
    return cp.empty(shape, dtype=cp.uint16 if dtype == "bfloat16" else dtype)


def _check(got, ref, peer, what):
    err = np.abs(got - ref).max()
    peer_err = np.abs(peer - ref).max()
    scale = max(np.abs(ref).max(), 1.0)
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten or NaN)"
    assert err <= 2 * peer_err + 1e-6 * scale, f"{what}: max error {err:.3g} vs cuBLAS {peer_err:.3g}"


def _cublas(a, b, dtype, trans_a=False, trans_b=False):
    from test_matmul import _cublas as peer   # the same cuBLAS product the mma.sync tests compare with
    return peer(a, b, dtype, trans_a, trans_b)


def _launch(cfg, a, b, out, M, N, K, bias=None):
    """The kernel of ``cfg`` on contiguous row-major (M, K) a, (K, N) b (or (N, K) if b_kmajor), (M, N) out."""
    import rtkernels as rtk
    b_shape = (1, N, K) if cfg.b_kmajor else (1, K, N)
    maps = m90.tensor_maps(cfg, (a.data.ptr, (1, M, K), (M * K, K, 1)),
                           (b.data.ptr, b_shape, (N * K, b_shape[2], 1)), (out.data.ptr, (1, M, N), (M * N, N, 1)))
    rtk.get_kernel(cfg).launch((m90.grid_size(M, N, 1, cfg, 132), 1, 1), (384, 1, 1), *maps, bias, out, M, N, K, 1,
                               0, 0, N, 0, 1, shared_mem=cfg.shared_mem_bytes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("b_kmajor", [False, True])
def test_gpu_single_tile(dtype, b_kmajor):
    """One 128 x 256 x 64 tile of the default config: the smallest TMA -> wgmma -> TMA-store round trip."""
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    _sm90_gpu()
    rng = np.random.default_rng(1)
    a, ah = random_array(rng, (128, 64), dtype)
    b, bh = random_array(rng, (256, 64) if b_kmajor else (64, 256), dtype)
    out = poison(_empty((128, 256), dtype))
    _launch(MatmulSm90Config(dtype=dtype, b_kmajor=b_kmajor), a, b, out, 128, 256, 64)
    cp.cuda.get_current_stream().synchronize()
    got = to_f64(out, dtype)
    ref = ah @ (bh.T if b_kmajor else bh)
    bad = np.argwhere(~np.isclose(got, ref, atol=0.05, rtol=0.02))
    assert bad.size == 0, f"{len(bad)} wrong, first at {bad[:8].tolist()}: got {got[tuple(bad[0])]}, " \
                          f"want {ref[tuple(bad[0])]}"


@pytest.mark.gpu
@pytest.mark.parametrize("bn, stages, layout, shape", [
    (232, 4, dict(has_bias=True, activation="gelu"), (300, 1000, 200)),
    (160, 5, dict(), (129, 488, 72)),
    (152, 5, dict(tma_store=False, has_bias=True, activation="relu"), (257, 463, 136)),
    (136, 6, dict(a_kmajor=False), (520, 1096, 64)),
    (232, 3, dict(has_bias=True, activation="silu"), (391, 704, 2000)),   # rule 5's one-pass epilogue
])
def test_gpu_flexible_block_n(bn, stages, layout, shape):
    """Tiles off the 64-column grid (K-major B): TMA-stored 64-column boxes plus direct stores of the
    rest (or all direct), ragged M / N / K, bias and activation; poisoned output."""
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    _sm90_gpu()
    dtype = "bfloat16"
    M, N, K = shape
    cfg = MatmulSm90Config(dtype=dtype, block_n=bn, num_stages=stages, b_kmajor=True, **layout)
    rng = np.random.default_rng(bn + M)
    a, ah = random_array(rng, (K, M) if not cfg.a_kmajor else (M, K), dtype)
    b, bh = random_array(rng, (N, K), dtype)
    bias, biash = random_array(rng, (N,), dtype) if cfg.has_bias else (None, None)
    out = poison(_empty((M, N), dtype))
    maps = m90.tensor_maps(cfg, (a.data.ptr, (1,) + a.shape, (a.size,) + (a.shape[1], 1)),
                           (b.data.ptr, (1, N, K), (N * K, K, 1)), (out.data.ptr, (1, M, N), (M * N, N, 1)))
    import rtkernels as rtk
    rtk.get_kernel(cfg).launch((m90.grid_size(M, N, 1, cfg, 132), 1, 1), (384, 1, 1), *maps, bias, out, M, N, K, 1,
                               0, 0, N, 0, int(N % 2 == 0), shared_mem=cfg.shared_mem_bytes)
    cp.cuda.get_current_stream().synchronize()
    act = cfg.activation if cfg.activation != "none" else None
    ref = mm.matmul_reference(ah, bh, bias=biash, activation=act, trans_a=not cfg.a_kmajor, trans_b=True)
    peer = mm._act_np(_cublas(a, b, dtype, not cfg.a_kmajor, True) + (biash if biash is not None else 0), act)
    _check(to_f64(out, dtype), ref, peer, f"128x{bn} {layout} {shape}")


@pytest.mark.gpu
def test_gpu_flexible_block_n_through_matmul():
    """rtk.matmul takes a flexible width where it fills the last round (512 x 5000: 128 x 152)."""
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    M, N, K = 512, 5000, 64
    rng = np.random.default_rng(5)
    a, ah = random_array(rng, (M, K), "bfloat16")
    b, bh = random_array(rng, (N, K), "bfloat16")
    out = poison(_empty((M, N), "bfloat16"))
    rtk.matmul(a, b, out=out, trans_b=True, dtype="bfloat16")
    picked = [plan[1] for key, plan in mm._plans90.items() if key[1:5] == (M, N, K, 1)]
    assert picked and picked[-1].block_n == 152, picked
    _check(to_f64(out, "bfloat16"), ah @ bh.T, _cublas(a, b, "bfloat16", False, True), "512x5000x64")


SHAPES = [(1, 1, 1), (17, 33, 9), (127, 129, 65), (1000, 1000, 1000), (4096, 4096, 4096), (65536, 64, 64),
          (64, 64, 65536), (129, 200, 72), (300, 136, 1000), (1, 4096, 64), (4096, 8, 64)]
# what TMA cannot address falls back to the mma.sync kernel
FALLBACK = {(17, 33, 9), (127, 129, 65)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_shapes(dtype, shape, mma):
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    M, N, K = shape
    rng = np.random.default_rng(M + N + K)
    a, ah = random_array(rng, (M, K), dtype)
    b, bh = random_array(rng, (K, N), dtype)
    out = poison(_empty((M, N), dtype))
    rtk.matmul(a, b, out=out, dtype=dtype if dtype == "bfloat16" else None)
    assert _ran_sm90(M, N, K) == (shape not in FALLBACK)
    _check(to_f64(out, dtype), ah @ bh, _cublas(a, b, dtype), f"{dtype} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_gpu_epilogue_and_layouts(dtype, activation, trans_a, trans_b, mma):
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    M, N, K = 200, 264, 136
    rng = np.random.default_rng(7)
    a, ah = random_array(rng, (K, M) if trans_a else (M, K), dtype)
    b, bh = random_array(rng, (N, K) if trans_b else (K, N), dtype)
    bias, biash = random_array(rng, (N,), dtype)
    out = poison(_empty((M, N), dtype))
    rtk.matmul(a, b, bias=bias, activation=activation, out=out, trans_a=trans_a, trans_b=trans_b,
               dtype=dtype if dtype == "bfloat16" else None)
    assert _ran_sm90(M, N, K)
    ref = mm.matmul_reference(ah, bh, bias=biash, activation=activation, trans_a=trans_a, trans_b=trans_b)
    peer = mm._act_np(_cublas(a, b, dtype, trans_a, trans_b) + biash, activation)
    _check(to_f64(out, dtype), ref, peer, f"{dtype} {activation} {trans_a}{trans_b}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("N, pad", [(264, 1), (129, 0)])
def test_gpu_direct_store_epilogue(dtype, N, pad, mma):
    """C rows TMA cannot address (odd row stride: a column slice, or odd N) take the direct stores."""
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    M, K = 150, 64
    rng = np.random.default_rng(N)
    a, ah = random_array(rng, (M, K), dtype)
    b, bh = random_array(rng, (N, K), dtype)          # trans_b: K-major B, any N
    bias, biash = random_array(rng, (N,), dtype)
    full = poison(_empty((M, N + pad), dtype))
    out = full[:, :N]
    rtk.matmul(a, b, bias=bias, activation="relu", out=out, trans_b=True,
               dtype=dtype if dtype == "bfloat16" else None)
    assert _ran_sm90(M, N, K)
    assert not any(key[9] for key in mm._plans90 if key[1:5] == (M, N, K, 1))   # tma_store False
    ref = mm.matmul_reference(ah, bh, bias=biash, activation="relu", trans_b=True)
    peer = mm._act_np(_cublas(a, b, dtype, False, True) + biash, "relu")
    got = to_f64(full, dtype)
    _check(got[:, :N], ref, peer, f"direct {dtype} {N}")
    if pad:
        assert np.isnan(got[:, N:]).all(), "wrote past the output's columns"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_k_tail_zero_fill(dtype, mma):
    """K = 65 with 16-byte aligned rows (a column slice): the last K box is mostly out of bounds and
    must arrive as zeros, not as the neighbouring columns."""
    from gpu_util import random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    M, N, K = 256, 256, 65
    rng = np.random.default_rng(65)
    abuf, abh = random_array(rng, (M, 72), dtype)
    bbuf, bbh = random_array(rng, (N, 72), dtype)
    a, ah = abuf[:, :K], abh[:, :K]
    b, bh = bbuf[:, :K], bbh[:, :K]
    out = rtk.matmul(a, b, trans_b=True, dtype=dtype if dtype == "bfloat16" else None)
    assert _ran_sm90(M, N, K)
    _check(to_f64(out, dtype), ah @ bh.T, _cublas(a, b, dtype, False, True), f"k-tail {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 130, 192, 72), (5, 128, 256, 64), (2, 9, 64, 16), (4, 1000, 304, 520)])
def test_gpu_batched_and_views(dtype, shape, mma):
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    B, M, N, K = shape
    rng = np.random.default_rng(B * M)
    a, ah = random_array(rng, (B, M, K + 16), dtype)     # a column-sliced view: row stride K + 16
    a, ah = a[:, :, 8:K + 8], ah[:, :, 8:K + 8]          # base 16 bytes in
    b, bh = random_array(rng, (B, K, N), dtype)
    out = poison(_empty((B, M, N), dtype))
    rtk.matmul(a, b, out=out, dtype=dtype if dtype == "bfloat16" else None)
    assert _ran_sm90(M, N, K, B)
    _check(to_f64(out, dtype), ah @ bh, _cublas(a, b, dtype), f"batched {dtype} {shape}")
    b2, b2h = random_array(rng, (K, N), dtype)          # 2-D b broadcast over the batch
    out2 = poison(_empty((B, M, N), dtype))
    rtk.matmul(a, b2, out=out2, dtype=dtype if dtype == "bfloat16" else None)
    ref = ah @ b2h
    _check(to_f64(out2, dtype), ref, _cublas(a, b2[None].repeat(B, 0), dtype), f"broadcast b {dtype} {shape}")
    a2, a2h = random_array(rng, (M, K), dtype)          # 2-D a broadcast, transposed batched b
    bt, bth = random_array(rng, (B, N, K), dtype)
    out3 = rtk.matmul(a2, bt, trans_b=True, dtype=dtype if dtype == "bfloat16" else None)
    _check(to_f64(out3, dtype), a2h @ bth.transpose(0, 2, 1),
           _cublas(a2[None].repeat(B, 0), bt, dtype, False, True), f"broadcast a {dtype} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape, trans_a, trans_b", [
    ((1793, 1793, 1793), False, False),     # every row stride odd: A and B staged, C direct
    ((1000, 1001, 1003), True, False),      # A^T rows (M = 1000) aligned, B rows (N odd) staged
    ((515, 777, 999), False, True),         # A rows (K odd) and B^T rows (K odd) staged
])
def test_gpu_staged_operands(dtype, shape, trans_a, trans_b, mma):
    """Big problems whose rows TMA cannot address run the Hopper kernel on 16-byte aligned copies
    (the pad is never written: TMA zero-fills past the true extent); the first call keeps a staged
    plan, and the second call (new data, new addresses) replays it: copies of the new operands."""
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    M, N, K = shape
    assert M * N * K >= mm.STAGE_MIN_WORK
    rng = np.random.default_rng(M + K)
    mm._LAUNCHES._plans.clear()
    for call in range(2):
        if call:
            staged = [p for p in mm._LAUNCHES._plans.values() if type(p) is mm._StagedPlan]
            assert len(staged) == 1 and any(st is not None for st in staged[0].stages)
        a, ah = random_array(rng, (K, M) if trans_a else (M, K), dtype)
        b, bh = random_array(rng, (N, K) if trans_b else (K, N), dtype)
        bias, biash = random_array(rng, (N,), dtype)
        out = poison(_empty((M, N), dtype))
        rtk.matmul(a, b, bias=bias, activation="gelu", out=out, trans_a=trans_a, trans_b=trans_b,
                   dtype=dtype if dtype == "bfloat16" else None)
        assert _ran_sm90(M, N, K)
        ref = mm.matmul_reference(ah, bh, bias=biash, activation="gelu", trans_a=trans_a, trans_b=trans_b)
        peer = mm._act_np(_cublas(a, b, dtype, trans_a, trans_b) + biash, "gelu")
        _check(to_f64(out, dtype), ref, peer, f"staged {dtype} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows, cols, ld, offset, nb", [
    (5, 1, 3, 1, 1), (7, 7, 7, 3, 1), (9, 8, 11, 5, 2), (3, 9, 9, 0, 1), (33, 1793, 1795, 7, 3),
    (2, 3000, 3000, 0, 1), (4, 1027, 1031, 2, 2),
])
def test_gpu_pad_rows_copies_exactly(rows, cols, ld, offset, nb):
    """Every element lands at its place in the 128-byte rows, for every source alignment (base
    offset, odd row and batch strides), the source ending where its array does."""
    import cupy as cp
    _sm90_gpu()
    bs = rows * ld + 5 if nb > 1 else 0
    n = offset + (nb - 1) * bs + (rows - 1) * ld + cols
    flat = cp.asarray(np.random.default_rng(cols).integers(0, 2 ** 16, n, dtype=np.uint16))
    src = cp.lib.stride_tricks.as_strided(flat[offset:], (nb, rows, cols), (2 * bs, 2 * ld, 2))
    st = mm._Stage(rows, cols, nb, ld, bs, src.dtype)
    buf, ldp = mm._pad_rows(src, st, None), st.ldp
    assert ldp % 64 == 0 and ldp >= cols and buf.data.ptr % 256 == 0
    np.testing.assert_array_equal(buf[:, :, :cols].get(), src.get())


# The sanitizer gate's pad_rows shapes (H100, 2026-11-25: 16-byte reads past allocations of 28 and
# 3,700 bytes) and the staged matmul's (37, 50) B: each source in a cudaMalloc of exactly its
# size, ending at its last element.  Run under compute-sanitizer --tool memcheck, nothing past
# a row may be read.
@pytest.mark.gpu
@pytest.mark.parametrize("rows, cols, ld, offset, nb", [
    (5, 1, 3, 1, 1), (7, 7, 7, 3, 1), (9, 8, 11, 5, 2), (3, 9, 9, 0, 1), (6, 300, 301, 7, 3),
    (4, 1027, 1031, 2, 2), (37, 50, 50, 0, 1), (2, 15, 17, 1, 1), (1, 8, 8, 0, 1),
])
def test_gpu_pad_rows_source_at_allocation_end(rows, cols, ld, offset, nb):
    from gpu_util import exact_allocation
    import cupy as cp
    bs = rows * ld + 5 if nb > 1 else 0
    n = offset + (nb - 1) * bs + (rows - 1) * ld + cols
    flat_h = np.random.default_rng(n).integers(0, 2 ** 16, n, dtype=np.uint16)
    flat = exact_allocation(flat_h)
    src = cp.lib.stride_tricks.as_strided(flat[offset:], (nb, rows, cols), (2 * bs, 2 * ld, 2))
    st = mm._Stage(rows, cols, nb, ld, bs, src.dtype)
    buf = mm._pad_rows(src, st, None)
    want = np.lib.stride_tricks.as_strided(flat_h[offset:], (nb, rows, cols), (2 * bs, 2 * ld, 2))
    got = buf[:, :, :cols].get()
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{nb}x{rows}x{cols} ld={ld} offset={offset}: {len(bad)} wrong, first at {bad[0]}"


@pytest.mark.gpu
def test_gpu_staged_torch_on_a_default_stream_object():
    """Staged torch operands with ``stream=`` torch's default-stream object, whose handle is 0."""
    import rtkernels as rtk
    torch = pytest.importorskip("torch")
    _sm90_gpu()
    M, N, K = 300, 264, 333
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    assert M * N * K >= mm.STAGE_MIN_WORK
    for call in range(3):   # the full path, then the staged plan's replays (new outputs, new data)
        out = rtk.matmul(a, b, stream=torch.cuda.default_stream())
        torch.cuda.synchronize()
        assert _ran_sm90(M, N, K)
        ref = a.double() @ b.double()
        peer = (a @ b).double()
        assert ((out.double() - ref).abs().max() <= 2 * (peer - ref).abs().max() + 1e-6).item(), call
        a.normal_()
    assert any(type(p) is mm._StagedPlan and p.main.torch for p in mm._LAUNCHES._plans.values())


@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_gpu_staged_graph_capture(lib):
    """A staged call (odd row strides: A and B copied) captured in a CUDA graph (CuPy stream capture
    or torch.cuda.graph) replays on new operands in the captured arrays, also after the memory pool
    handed the freed copies' blocks to other arrays that the test fills with garbage."""
    import cupy as cp
    import rtkernels as rtk
    _sm90_gpu()
    M, N, K = 1000, 1001, 1003
    assert M * N * K >= mm.STAGE_MIN_WORK
    if lib == "torch":
        torch = pytest.importorskip("torch")
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            rtk.matmul(a, b, out=out)   # plans (and warms the side stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            rtk.matmul(a, b, out=out)
        for step in range(2):
            a.copy_(torch.randn_like(a))
            b.copy_(torch.randn_like(b))
            junk = [torch.full((M, 1024 + 64 * i), float("nan"), device="cuda", dtype=torch.bfloat16)
                    for i in range(4)]
            g.replay()
            torch.cuda.synchronize()
            ref = a.double() @ b.double()
            err = (out.double() - ref).abs().max().item()
            peer = ((a @ b).double() - ref).abs().max().item()
            assert err <= 2 * peer + 1e-6, (step, err, peer)
            assert all(bool(j.isnan().all()) for j in junk), "a replay wrote into memory it does not own"
            del junk
        return
    from gpu_util import capture_cupy, random_array, refill, to_f64
    rng = np.random.default_rng(11)
    a, _ = random_array(rng, (M, K), "bfloat16")
    b, _ = random_array(rng, (K, N), "bfloat16")
    out = _empty((M, N), "bfloat16")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        rtk.matmul(a, b, out=out, dtype="bfloat16")
        graph = capture_cupy(s, lambda: rtk.matmul(a, b, out=out, dtype="bfloat16"))
    for step in range(2):
        ah2, bh2 = refill(rng, (a, b), "bfloat16")
        junk = [cp.full((M, 1024 + 64 * i), 0xFFFF, cp.uint16) for i in range(4)]   # bf16 NaN bits
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        _check(to_f64(out, "bfloat16"), ah2 @ bh2, _cublas(a, b, "bfloat16"), f"staged graph replay {step}")
        # the replay wrote only into its own (kept) copies, not into blocks the pool handed out since
        assert all(bool((j == 0xFFFF).all()) for j in junk), "a replay wrote into memory it does not own"
        del junk


def test_realign_pays_by_shape():
    """Rows off the 32-byte grid are copied where M N / (M + N) >= REALIGN_MIN_MN and the work is
    large enough for two copy launches: not at 2040^3 (the copies cost more, H200), for few rows of
    x (the weight would be copied) or at 2048x4096x200 (0.87x -> 0.63x cuBLAS with copies, H100); yes
    at 3000^3, 1500x6000x1496 (0.54x -> 0.64x) and 16384x4096x200."""
    assert not mm.realign_pays(2040, 2040, 2040) and not mm.realign_pays(128, 1 << 20, 4096)
    assert not mm.realign_pays(2048, 4096, 200)
    assert mm.realign_pays(3000, 3000, 3000) and mm.realign_pays(1500, 6000, 1496)
    assert mm.realign_pays(16384, 4096, 200) and mm.realign_pays(2048, 4096, 200, batch=8)


@pytest.mark.gpu
def test_gpu_realigned_rows(mma):
    """TMA-addressable rows that are not 32-byte aligned (K = 2600: 5200-byte rows) of a problem where
    realigning pays (matmul.realign_pays) run on 128-byte aligned copies, with the right result."""
    from gpu_util import random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    M = N = K = 2600
    assert mm.realign_pays(M, N, K) and (K * 2) % 32
    rng = np.random.default_rng(26)
    a, ah = random_array(rng, (M, K), "bfloat16")
    b, bh = random_array(rng, (K, N), "bfloat16")
    mm._LAUNCHES.clear()
    out = rtk.matmul(a, b, dtype="bfloat16")
    assert _ran_sm90(M, N, K)
    assert any(type(p) is mm._StagedPlan for p in mm._LAUNCHES._plans.values()), "the operands were not realigned"
    _check(to_f64(out, "bfloat16"), ah @ bh, _cublas(a, b, "bfloat16"), "realigned")


@pytest.mark.gpu
def test_gpu_staged_batched_views_on_a_stream(mma):
    """Batched operands that start one element into aligned rows (base not 16-byte aligned), with a
    2-D B broadcast over the batch, staged and multiplied on a non-default stream."""
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    B, M, N, K = 3, 300, 264, 336
    rng = np.random.default_rng(11)
    abuf, abh = random_array(rng, (B, M, K + 8), "bfloat16")
    a, ah = abuf[:, :, 1:K + 1], abh[:, :, 1:K + 1]
    bbuf, bbh = random_array(rng, (K, N + 8), "bfloat16")
    b, bh = bbuf[:, 1:N + 1], bbh[:, 1:N + 1]
    assert B * M * N * K >= mm.STAGE_MIN_WORK
    stream = cp.cuda.Stream(non_blocking=True)
    out = poison(_empty((B, M, N), "bfloat16"))
    rtk.matmul(a, b, out=out, dtype="bfloat16", stream=stream)
    stream.synchronize()
    assert _ran_sm90(M, N, K, B)
    _check(to_f64(out, "bfloat16"), ah @ bh, _cublas(a, b[None].repeat(B, 0), "bfloat16"), "staged batched")


@pytest.mark.gpu
def test_gpu_every_tile_config():
    """Each heuristic/tuning tile (wgmma and mma.sync consumers) on one ragged problem, launched
    directly (not via the heuristic)."""
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    _sm90_gpu()
    M, N, K = 700, 520, 200
    rng = np.random.default_rng(3)
    a, ah = random_array(rng, (M, K), "bfloat16")
    b, bh = random_array(rng, (K, N), "bfloat16")
    ref = ah @ bh
    peer = _cublas(a, b, "bfloat16")
    cfgs = [m90._config(t, "bfloat16", tma_store=ts) for t in m90.TILES + m90.TUNE_ONLY for ts in (True, False)]
    cfgs += [m90._config(t, "bfloat16", tma_store=False, mma="sync") for t in m90.TILES + m90.TUNE_ONLY]
    for cfg in cfgs:
        out = poison(cp.empty((M, N), cp.uint16))
        _launch(cfg, a, b, out, M, N, K)
        _check(to_f64(out, "bfloat16"), ref, peer, cfg.key())


@pytest.mark.gpu
def test_gpu_autotuned(fresh_cache, monkeypatch):
    """RTKERNELS_AUTOTUNE=1 times the sm_90 candidates once, stores the winner, and the result is right."""
    from gpu_util import random_array, to_f64
    import rtkernels as rtk
    from rtkernels import autotune
    _sm90_gpu()
    monkeypatch.setenv("RTKERNELS_AUTOTUNE", "1")
    autotune.clear_memory()
    M, N, K = 520, 640, 256
    rng = np.random.default_rng(5)
    a, ah = random_array(rng, (M, K), "bfloat16")
    b, bh = random_array(rng, (K, N), "bfloat16")
    out = rtk.matmul(a, b, dtype="bfloat16")
    assert _ran_sm90(M, N, K)
    assert any(e.get("family") == "matmul_sm90" for e in autotune.load().values())
    _check(to_f64(out, "bfloat16"), ah @ bh, _cublas(a, b, "bfloat16"), "autotuned")
    autotune.clear_memory()


def test_short_k_ring_only_for_rows_off_the_128_byte_grid():
    """Rule 5 (one ring stage less for a one-pass epilogue at short K) applies where A's and B's rows
    are off the 128-byte grid (K = 2000: 0.88x against 0.84x cuBLAS with the deeper ring, H100); with
    aligned rows the deeper ring won (3000x5000x2048 0.95x against 0.93x, 8192x4096x256 1.10x against
    1.03x)."""
    def pick(m, n, k, aligned):
        return m90.heuristic_config("bfloat16", m, n, k, sm_count=132, stream_k=True, b_kmajor=True,
                                    rows_128b=aligned)
    off, on = pick(3000, 5000, 2000, False), pick(3000, 5000, 2048, True)
    assert (off.block_n, off.num_stages, off.epi_n) == (232, 3, 192)
    assert (on.block_n, on.num_stages) == (232, 4) and on.epi_n < on.tma_n
    assert pick(8192, 4096, 256, True).num_stages == 4 and pick(8192, 4096, 256, False).num_stages == 3
