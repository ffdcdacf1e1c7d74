"""CPU models of the attention forward kernel (no GPU, no compiler).

Two levels, both mirroring templates/attention_fwd.cu.j2 name for name:

1. ``tile_model``: the tiled online-softmax loop in float64 - the same tile ranges
   (``n_blocks``, ``n_mask_from``), bottom-right causal alignment, the -inf guards and the
   final o / l, lse - against a direct softmax.  It also proves the two shortcuts safe: tiles
   before ``n_mask_from`` hold no masked score, tiles from ``n_blocks`` on hold no visible one.

2. ``emulate_cta``: one thread block at warp level.  Shared memory is a flat array with the
   kernel's strides; ``ldmatrix`` and ``mma.m16n8k16`` are emulated from the PTX ISA's
   fragment tables (which lane holds which element), and every per-lane address is the
   kernel's own formula.  A wrong lane offset, fragment order or P-as-A mapping shows up here
   as a wrong result long before a GPU run.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

NEG_INF = -np.inf
LOG2E = 1.4426950408889634


# ---- shared helpers ------------------------------------------------------------------------
def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 values to float16 / bfloat16 (round to nearest even), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def reference(q, k, v, causal, scale):
    """Direct softmax(scale q k^T) v in float64 for (Sq, D) x (Sk, D); fully masked rows -> 0, -inf."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    sq, sk = q.shape[0], k.shape[0]
    s = scale * q @ k.T
    if causal:
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        s = np.where(j <= i + sk - sq, s, NEG_INF)
    m = s.max(axis=1, keepdims=True)
    seen = np.isfinite(m[:, 0])
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=1, keepdims=True)
    o = np.where(seen[:, None], p @ v / np.where(l > 0, l, 1.0), 0.0)
    lse = np.where(seen, m[:, 0] + np.log(np.where(l[:, 0] > 0, l[:, 0], 1.0)), NEG_INF)
    return o, lse


def tile_ranges(m0, rows_q, seqlen_q, seqlen_k, block_n, causal):
    """(n_blocks, n_mask_from) exactly as the kernel computes them (C integer division)."""
    diag = seqlen_k - seqlen_q
    n_blocks = (seqlen_k + block_n - 1) // block_n
    n_mask_from = seqlen_k // block_n
    if causal:
        keys_last_row = min(seqlen_k, m0 + rows_q + diag)
        n_blocks = (keys_last_row + block_n - 1) // block_n if keys_last_row > 0 else 0
        keys_first_row = m0 + diag + 1
        n_mask_from = min(n_mask_from, keys_first_row // block_n if keys_first_row > 0 else 0)
    return n_blocks, n_mask_from


# ---- level 1: the tile loop ---------------------------------------------------------------
def tile_model(q, k, v, causal, scale, block_m, block_n):
    """The kernel's loop over (query tile, key tile) in float64; returns o, lse and checks its shortcuts."""
    sq, d = q.shape
    sk = k.shape[0]
    diag = sk - sq
    scale_log2 = scale * LOG2E
    o = np.full((sq, d), np.nan)
    lse = np.full(sq, np.nan)
    for m_block in range(-(-sq // block_m)):
        m0 = m_block * block_m
        rows_q = min(block_m, sq - m0)
        rows = m0 + np.arange(rows_q)
        n_blocks, n_mask_from = tile_ranges(m0, rows_q, sq, sk, block_n, causal)

        # the skipped tiles really are invisible to every row of this query tile
        for n in range(n_blocks, -(-sk // block_n)):
            cols = n * block_n + np.arange(block_n)
            assert not ((cols[None, :] < sk) & (cols[None, :] <= rows[:, None] + diag)).any()

        row_max = np.full(rows_q, NEG_INF)
        row_sum = np.zeros(rows_q)
        acc = np.zeros((rows_q, d))
        for n in range(n_blocks):
            key0 = n * block_n
            cols = key0 + np.arange(block_n)
            kt = np.zeros((block_n, d))
            vt = np.zeros((block_n, d))
            valid = cols < sk
            kt[valid] = k[cols[valid]]
            vt[valid] = v[cols[valid]]
            s = q[rows] @ kt.T
            limit = np.full(rows_q, sk - key0)
            if causal:
                limit = np.minimum(limit, rows + diag + 1 - key0)
            masked = np.arange(block_n)[None, :] >= limit[:, None]
            if n < n_mask_from:
                assert not masked.any(), "a tile the kernel treats as interior has a masked score"
            else:
                s = np.where(masked, NEG_INF, s)
            mx = np.maximum(row_max, s.max(axis=1))
            max_scaled = np.where(mx == NEG_INF, 0.0, mx * scale_log2)
            with np.errstate(invalid="ignore"):
                correction = np.exp2(row_max * scale_log2 - max_scaled)
            assert np.isfinite(correction).all()
            row_max = mx
            p = np.exp2(s * scale_log2 - max_scaled[:, None])
            row_sum = row_sum * correction + p.sum(axis=1)
            acc = acc * correction[:, None] + p @ vt
        inv_l = np.where(row_sum > 0, 1.0 / np.where(row_sum > 0, row_sum, 1.0), 0.0)
        o[rows] = acc * inv_l[:, None]
        with np.errstate(divide="ignore"):
            lse[rows] = np.where(row_sum > 0, row_max * scale + np.log(np.where(row_sum > 0, row_sum, 1.0)),
                                 NEG_INF)
    return o, lse


SHAPES = [(1, 1), (1, 17), (17, 1), (17, 17), (113, 255), (255, 113), (64, 64), (128, 128), (129, 64),
          (200, 3), (3, 200), (300, 301), (1, 300)]


@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_m,block_n", [(128, 64), (64, 128), (128, 128), (64, 32), (16, 16)])
def test_tile_model_matches_softmax(sq, sk, causal, block_m, block_n):
    rng = np.random.default_rng(sq * 1000 + sk)
    d = 16
    q, k, v = (rng.standard_normal((n, d)) for n in (sq, sk, sk))
    scale = 1 / math.sqrt(d)
    o, lse = tile_model(q, k, v, causal, scale, block_m, block_n)
    o_ref, lse_ref = reference(q, k, v, causal, scale)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-10)


def test_fully_masked_rows_give_zero_and_neg_inf():
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key at all
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((40, 8)), rng.standard_normal((10, 8)), rng.standard_normal((10, 8))
    o, lse = tile_model(q, k, v, True, 0.3, 16, 16)
    assert (o[:30] == 0).all() and np.isneginf(lse[:30]).all()
    assert np.isfinite(lse[30:]).all()
    # whole query tiles with no visible key are skipped by n_blocks == 0
    assert tile_ranges(0, 16, 40, 10, 16, True)[0] == 0


def test_tile_ranges_exhaustive_small():
    """n_blocks and n_mask_from are tight: the last kept tile has a visible key and the tile
    just before n_mask_from has no masked one (so no needless masking, no needless tile)."""
    for sq in range(1, 40):
        for sk in range(1, 40):
            for bm, bn in ((16, 16), (32, 16), (16, 32)):
                for m0 in range(0, sq, bm):
                    rows_q = min(bm, sq - m0)
                    rows = m0 + np.arange(rows_q)
                    for causal in (False, True):
                        nb, nm = tile_ranges(m0, rows_q, sq, sk, bn, causal)
                        lim = np.full(rows_q, sk)
                        if causal:
                            lim = np.minimum(lim, rows + sk - sq + 1)
                        if nb:
                            assert lim.max() > (nb - 1) * bn          # last tile is needed
                        assert lim.max() <= nb * bn                    # nothing visible beyond
                        if 0 < nm <= nb:
                            assert lim.min() >= nm * bn                # tiles < nm: unmasked
                            assert lim.min() < (nm + 1) * bn or nm == nb  # tile nm: needs the mask


# ---- level 2: warp-level emulation of one thread block ----------------------------------
LANE = np.arange(32)
G = LANE >> 2
TQ = LANE & 3


def ldmatrix(smem, addr, num, trans=False):
    """ldmatrix.m8n8.x{num}[.trans].b16: lanes 8i..8i+7 give the row addresses (element offsets)
    of matrix i; each lane gets, per matrix, (row lane/4, cols 2(lane%4)+{0,1}) - of the
    transposed matrix with .trans.  Returns (32, num, 2): register i, low half first."""
    out = np.empty((32, num, 2), dtype=np.float32)
    for i in range(num):
        rows = []
        for r in range(8):
            a = int(addr[8 * i + r])
            assert a % 8 == 0, "ldmatrix rows are 16-byte aligned"
            rows.append(smem[a:a + 8])
        m = np.stack(rows)
        if trans:
            m = m.T
        out[:, i, 0] = m[G, 2 * TQ]
        out[:, i, 1] = m[G, 2 * TQ + 1]
    return out


def mma(d, a, b0, b1):
    """mma.sync.m16n8k16.row.col f32 += A B from the PTX fragment tables.
    d: (32, 4); a: (32, 4, 2) registers a0..a3; b0, b1: (32, 2)."""
    A = np.full((16, 16), np.nan, dtype=np.float32)
    B = np.full((16, 8), np.nan, dtype=np.float32)
    for e in range(2):
        A[G, 2 * TQ + e] = a[:, 0, e]
        A[G + 8, 2 * TQ + e] = a[:, 1, e]
        A[G, 2 * TQ + 8 + e] = a[:, 2, e]
        A[G + 8, 2 * TQ + 8 + e] = a[:, 3, e]
        B[2 * TQ + e, G] = b0[:, e]
        B[2 * TQ + 8 + e, G] = b1[:, e]
    assert not np.isnan(A).any() and not np.isnan(B).any(), "fragment tables cover every element"
    C = A.astype(np.float64) @ B.astype(np.float64)
    d[:, 0] += C[G, 2 * TQ]
    d[:, 1] += C[G, 2 * TQ + 1]
    d[:, 2] += C[G + 8, 2 * TQ]
    d[:, 3] += C[G + 8, 2 * TQ + 1]


def pack2(lo, hi, dtype):
    return np.stack([round_to(lo, dtype), round_to(hi, dtype)], axis=-1)


def quad_reduce(x, op):
    x = x.copy()
    for sh in (1, 2):
        x = op(x, x[LANE ^ sh])
    return x


class Layout:
    """The template's constexpr block."""

    def __init__(self, head_dim, block_m, block_n, num_warps, num_stages):
        self.HEAD_DIM, self.BLOCK_M, self.BLOCK_N = head_dim, block_m, block_n
        self.NUM_WARPS, self.NUM_STAGES = num_warps, num_stages
        self.THREADS = 32 * num_warps
        self.M_TILES = block_m // (16 * num_warps)
        self.WARP_ROWS = 16 * self.M_TILES
        self.HEAD_DIM_PAD = (head_dim + 15) // 16 * 16
        self.CHUNKS = head_dim // 8
        self.K_STEPS_QK = self.HEAD_DIM_PAD // 16
        self.N_TILES_S = block_n // 8
        self.K_STEPS_PV = block_n // 16
        self.N_TILES_O = head_dim // 8
        self.QK_STRIDE = ((self.HEAD_DIM_PAD // 8) | 1) * 8
        self.V_STRIDE = ((head_dim // 8) | 1) * 8
        self.Q_TILE = block_m * self.QK_STRIDE
        self.K_TILE = block_n * self.QK_STRIDE
        self.V_TILE = block_n * self.V_STRIDE
        self.SMEM_ELEMS = self.Q_TILE + num_stages * (self.K_TILE + self.V_TILE)


def load_tile(L, smem, base, rows, smem_stride, gmem_rows, rows_valid):
    """cp.async loop of load_tile(): thread -> (r0, c), rows r0 + it * ROWS_PER_IT; invalid rows
    are zero-filled.  Also checks every chunk of the tile is written exactly once."""
    rows_per_it = L.THREADS // L.CHUNKS
    written = np.zeros((rows, L.CHUNKS), int)
    for tid in range(L.THREADS):
        r0, c = tid // L.CHUNKS, tid % L.CHUNKS
        if rows_per_it * L.CHUNKS == L.THREADS or r0 < rows_per_it:
            for it in range((rows + rows_per_it - 1) // rows_per_it):
                r = r0 + it * rows_per_it
                if rows % rows_per_it == 0 or r < rows:
                    dst = base + r * smem_stride + c * 8
                    smem[dst:dst + 8] = gmem_rows[r, c * 8:c * 8 + 8] if r < rows_valid else 0.0
                    written[r, c] += 1
    assert (written == 1).all()


def emulate_cta(q, k, v, *, m_block, causal, scale, dtype, head_dim, block_m, block_n, num_warps,
                num_stages=2, q_in_regs=False):
    """One thread block of attention_fwd for one (batch, head): q (Sq, D), k/v (Sk, D) already
    rounded to ``dtype``.  Returns (o rows of the tile or None, lse rows) like the kernel's stores."""
    L = Layout(head_dim, block_m, block_n, num_warps, num_stages)
    sq, sk = q.shape[0], k.shape[0]
    m0 = m_block * L.BLOCK_M
    rows_q = min(L.BLOCK_M, sq - m0)
    diag = sk - sq
    n_blocks, n_mask_from = tile_ranges(m0, rows_q, sq, sk, L.BLOCK_N, causal)
    if n_blocks == 0:
        return np.zeros((rows_q, head_dim), np.float32), np.full(rows_q, NEG_INF, np.float32)

    smem = np.full(L.SMEM_ELEMS, np.nan, dtype=np.float32)   # uninitialized smem is poison
    sQ, sK = 0, L.Q_TILE
    sV = sK + L.NUM_STAGES * L.K_TILE
    if L.HEAD_DIM_PAD != L.HEAD_DIM:
        for r in range(L.BLOCK_M + L.NUM_STAGES * L.BLOCK_N):
            smem[sQ + r * L.QK_STRIDE + L.HEAD_DIM: sQ + r * L.QK_STRIDE + L.HEAD_DIM + 8] = 0.0

    def rows_of(a, start, count):
        out = np.zeros((count, a.shape[1]), np.float32)
        hi = min(a.shape[0], start + count)
        if hi > start:
            out[:hi - start] = a[start:hi]
        return out

    load_tile(L, smem, sQ, L.BLOCK_M, L.QK_STRIDE, rows_of(q, m0, L.BLOCK_M), rows_q)
    load_tile(L, smem, sK, L.BLOCK_N, L.QK_STRIDE, rows_of(k, 0, L.BLOCK_N), sk)
    if L.NUM_STAGES == 2:
        load_tile(L, smem, sV, L.BLOCK_N, L.V_STRIDE, rows_of(v, 0, L.BLOCK_N), sk)

    scale_log2 = np.float32(scale * LOG2E)
    o_out = np.full((rows_q, head_dim), np.nan, np.float32)
    lse_out = np.full(rows_q, np.nan, np.float32)
    lane = LANE
    g, t = G, TQ
    # each warp's registers live across tiles, so emulate warp by warp per tile
    warps = []
    for warp in range(L.NUM_WARPS):
        st = dict(
            q_lane=(warp * L.WARP_ROWS + (lane & 15)) * L.QK_STRIDE + (lane >> 4) * 8,
            acc_o=np.zeros((L.M_TILES, L.N_TILES_O, 32, 4), np.float32),
            row_max=np.full((L.M_TILES, 2, 32), NEG_INF, np.float32),
            row_sum=np.zeros((L.M_TILES, 2, 32), np.float32))
        warps.append(st)
    k_lane = ((lane & 7) + ((lane >> 4) << 3)) * L.QK_STRIDE + ((lane >> 3) & 1) * 8
    v_lane = (lane & 15) * L.V_STRIDE + (lane >> 4) * 8
    v_lane_x2 = (lane & 15) * L.V_STRIDE
    if q_in_regs:
        for st in warps:
            st["q_frag"] = [[ldmatrix(smem, sQ + st["q_lane"] + mi * 16 * L.QK_STRIDE + kk * 16, 4)
                             for kk in range(L.K_STEPS_QK)] for mi in range(L.M_TILES)]

    for n in range(n_blocks):
        stage = (n & 1) if L.NUM_STAGES == 2 else 0
        sKn = sK + stage * L.K_TILE
        sVn = sV + stage * L.V_TILE
        key0 = n * L.BLOCK_N
        if L.NUM_STAGES == 2:
            if n + 1 < n_blocks:
                # into the other stage; the emulation is sequential, so this cannot race
                load_tile(L, smem, sK + (stage ^ 1) * L.K_TILE, L.BLOCK_N, L.QK_STRIDE,
                          rows_of(k, key0 + L.BLOCK_N, L.BLOCK_N), sk - key0 - L.BLOCK_N)
                load_tile(L, smem, sV + (stage ^ 1) * L.V_TILE, L.BLOCK_N, L.V_STRIDE,
                          rows_of(v, key0 + L.BLOCK_N, L.BLOCK_N), sk - key0 - L.BLOCK_N)
        else:
            load_tile(L, smem, sV, L.BLOCK_N, L.V_STRIDE, rows_of(v, key0, L.BLOCK_N), sk - key0)
        pas = []
        for warp, st in enumerate(warps):
            acc_s = np.zeros((L.M_TILES, L.N_TILES_S, 32, 4), np.float32)
            for kk in range(L.K_STEPS_QK):
                a = [st["q_frag"][mi][kk] if q_in_regs else
                     ldmatrix(smem, sQ + st["q_lane"] + mi * 16 * L.QK_STRIDE + kk * 16, 4)
                     for mi in range(L.M_TILES)]
                for np_ in range(L.N_TILES_S // 2):
                    bk = ldmatrix(smem, sKn + k_lane + np_ * 16 * L.QK_STRIDE + kk * 16, 4)
                    for mi in range(L.M_TILES):
                        mma(acc_s[mi, 2 * np_], a[mi], bk[:, 0], bk[:, 1])
                        mma(acc_s[mi, 2 * np_ + 1], a[mi], bk[:, 2], bk[:, 3])
            if n >= n_mask_from:
                for mi in range(L.M_TILES):
                    for half in range(2):
                        limit = np.full(32, sk - key0)
                        if causal:
                            row = m0 + warp * L.WARP_ROWS + mi * 16 + g + 8 * half
                            limit = np.minimum(limit, row + diag + 1 - key0)
                        for j in range(L.N_TILES_S):
                            for e in range(2):
                                col = j * 8 + 2 * t + e
                                acc_s[mi, j, :, 2 * half + e] = np.where(col >= limit, NEG_INF,
                                                                         acc_s[mi, j, :, 2 * half + e])
            else:
                assert np.isfinite(acc_s).all()
            for mi in range(L.M_TILES):
                for half in range(2):
                    mx = st["row_max"][mi, half].copy()
                    for j in range(L.N_TILES_S):
                        mx = np.maximum(mx, np.maximum(acc_s[mi, j, :, 2 * half], acc_s[mi, j, :, 2 * half + 1]))
                    mx = quad_reduce(mx, np.maximum)
                    max_scaled = np.where(mx == NEG_INF, np.float32(0), mx * scale_log2).astype(np.float32)
                    with np.errstate(invalid="raise"):
                        correction = np.exp2(st["row_max"][mi, half] * scale_log2 - max_scaled)
                    st["row_max"][mi, half] = mx
                    s_sum = np.zeros(32, np.float32)
                    for j in range(L.N_TILES_S):
                        for e in range(2):
                            with np.errstate(invalid="raise"):
                                p = np.exp2(acc_s[mi, j, :, 2 * half + e] * scale_log2 - max_scaled)
                            acc_s[mi, j, :, 2 * half + e] = p
                            s_sum += p
                    st["row_sum"][mi, half] = st["row_sum"][mi, half] * correction + s_sum
                    for j in range(L.N_TILES_O):
                        st["acc_o"][mi, j, :, 2 * half] *= correction
                        st["acc_o"][mi, j, :, 2 * half + 1] *= correction
            pas.append(acc_s)
        if L.NUM_STAGES == 1 and n + 1 < n_blocks:
            load_tile(L, smem, sK, L.BLOCK_N, L.QK_STRIDE, rows_of(k, key0 + L.BLOCK_N, L.BLOCK_N),
                      sk - key0 - L.BLOCK_N)
        for warp, st in enumerate(warps):
            acc_s = pas[warp]
            for kk in range(L.K_STEPS_PV):
                pa = []
                for mi in range(L.M_TILES):
                    pa.append(np.stack([
                        pack2(acc_s[mi, 2 * kk, :, 0], acc_s[mi, 2 * kk, :, 1], dtype),
                        pack2(acc_s[mi, 2 * kk, :, 2], acc_s[mi, 2 * kk, :, 3], dtype),
                        pack2(acc_s[mi, 2 * kk + 1, :, 0], acc_s[mi, 2 * kk + 1, :, 1], dtype),
                        pack2(acc_s[mi, 2 * kk + 1, :, 2], acc_s[mi, 2 * kk + 1, :, 3], dtype)], axis=1))
                for dp in range(L.N_TILES_O // 2):
                    bv = ldmatrix(smem, sVn + v_lane + kk * 16 * L.V_STRIDE + dp * 16, 4, trans=True)
                    for mi in range(L.M_TILES):
                        mma(st["acc_o"][mi, 2 * dp], pa[mi], bv[:, 0], bv[:, 1])
                        mma(st["acc_o"][mi, 2 * dp + 1], pa[mi], bv[:, 2], bv[:, 3])
                if L.N_TILES_O % 2 == 1:
                    bv = ldmatrix(smem, sVn + v_lane_x2 + kk * 16 * L.V_STRIDE + (L.N_TILES_O - 1) * 8, 2,
                                  trans=True)
                    for mi in range(L.M_TILES):
                        mma(st["acc_o"][mi, L.N_TILES_O - 1], pa[mi], bv[:, 0], bv[:, 1])

    # epilogue: stage through the warp's Q rows, then 16-byte chunks
    for warp, st in enumerate(warps):
        sO = sQ + warp * L.WARP_ROWS * L.QK_STRIDE
        for mi in range(L.M_TILES):
            for half in range(2):
                l = quad_reduce(st["row_sum"][mi, half], np.add)
                inv_l = np.where(l > 0, 1 / np.where(l > 0, l, 1), 0).astype(np.float32)
                r = mi * 16 + g + 8 * half
                for j in range(L.N_TILES_O):
                    vals = pack2(st["acc_o"][mi, j, :, 2 * half] * inv_l, st["acc_o"][mi, j, :, 2 * half + 1] * inv_l,
                                 dtype)
                    for ln in range(32):
                        a = sO + r[ln] * L.QK_STRIDE + j * 8 + 2 * t[ln]
                        smem[a:a + 2] = vals[ln]
                row = warp * L.WARP_ROWS + r
                for ln in range(32):
                    if t[ln] == 0 and row[ln] < rows_q:
                        lse_out[row[ln]] = (st["row_max"][mi, half][ln] * scale + np.log(l[ln])
                                            if l[ln] > 0 else NEG_INF)
        warp_chunks = L.WARP_ROWS * L.CHUNKS
        for it in range((warp_chunks + 31) // 32):
            for ln in range(32):
                i = ln + it * 32
                if warp_chunks % 32 == 0 or i < warp_chunks:
                    r, c = i // L.CHUNKS, i % L.CHUNKS
                    row = warp * L.WARP_ROWS + r
                    if row < rows_q:
                        a = sO + r * L.QK_STRIDE + c * 8
                        o_out[row, c * 8:c * 8 + 8] = smem[a:a + 8]
    return o_out, lse_out


def test_mma_fragments_compose_to_matmul():
    """Q (A via the q_lane formula) times K^T (B via k_lane) equals the matrix product."""
    rng = np.random.default_rng(1)
    L = Layout(32, 16, 16, 1, 1)
    smem = np.full(L.SMEM_ELEMS, np.nan, np.float32)
    qm = rng.standard_normal((16, 32)).astype(np.float32)
    km = rng.standard_normal((16, 32)).astype(np.float32)
    for r in range(16):
        smem[r * L.QK_STRIDE: r * L.QK_STRIDE + 32] = qm[r]
        smem[L.Q_TILE + r * L.QK_STRIDE: L.Q_TILE + r * L.QK_STRIDE + 32] = km[r]
    q_lane = (LANE & 15) * L.QK_STRIDE + (LANE >> 4) * 8
    k_lane = ((LANE & 7) + ((LANE >> 4) << 3)) * L.QK_STRIDE + ((LANE >> 3) & 1) * 8
    acc = np.zeros((2, 32, 4), np.float32)
    for kk in range(2):
        a = ldmatrix(smem, q_lane + kk * 16, 4)
        bk = ldmatrix(smem, L.Q_TILE + k_lane + kk * 16, 4)
        mma(acc[0], a, bk[:, 0], bk[:, 1])
        mma(acc[1], a, bk[:, 2], bk[:, 3])
    s = np.zeros((16, 16))
    for j in range(2):
        s[G, 8 * j + 2 * TQ] = acc[j, :, 0]
        s[G, 8 * j + 2 * TQ + 1] = acc[j, :, 1]
        s[G + 8, 8 * j + 2 * TQ] = acc[j, :, 2]
        s[G + 8, 8 * j + 2 * TQ + 1] = acc[j, :, 3]
    np.testing.assert_allclose(s, qm.astype(np.float64) @ km.T, rtol=1e-5, atol=1e-5)


def test_p_registers_times_v_trans_compose_to_matmul():
    """S accumulators repacked as A fragments, V via ldmatrix.trans (x4 and the x2 tail)."""
    rng = np.random.default_rng(2)
    D = 24   # 3 output n-tiles: one x4.trans pair + the x2.trans tail
    V_STRIDE = ((D // 8) | 1) * 8
    p = rng.standard_normal((16, 16)).astype(np.float32)
    vm = rng.standard_normal((16, D)).astype(np.float32)
    smem = np.full(16 * V_STRIDE, np.nan, np.float32)
    for r in range(16):
        smem[r * V_STRIDE: r * V_STRIDE + D] = vm[r]
    acc_s = np.zeros((2, 32, 4), np.float32)   # p in the C layout of two n-tiles
    for j in range(2):
        acc_s[j, :, 0] = p[G, 8 * j + 2 * TQ]
        acc_s[j, :, 1] = p[G, 8 * j + 2 * TQ + 1]
        acc_s[j, :, 2] = p[G + 8, 8 * j + 2 * TQ]
        acc_s[j, :, 3] = p[G + 8, 8 * j + 2 * TQ + 1]
    pa = np.stack([pack2(acc_s[0, :, 0], acc_s[0, :, 1], "float16"), pack2(acc_s[0, :, 2], acc_s[0, :, 3], "float16"),
                   pack2(acc_s[1, :, 0], acc_s[1, :, 1], "float16"), pack2(acc_s[1, :, 2], acc_s[1, :, 3], "float16")],
                  axis=1)
    acc_o = np.zeros((3, 32, 4), np.float32)
    bv = ldmatrix(smem, (LANE & 15) * V_STRIDE + (LANE >> 4) * 8, 4, trans=True)
    mma(acc_o[0], pa, bv[:, 0], bv[:, 1])
    mma(acc_o[1], pa, bv[:, 2], bv[:, 3])
    bv = ldmatrix(smem, (LANE & 15) * V_STRIDE + 16, 2, trans=True)
    mma(acc_o[2], pa, bv[:, 0], bv[:, 1])
    o = np.zeros((16, D))
    for j in range(3):
        o[G, 8 * j + 2 * TQ] = acc_o[j, :, 0]
        o[G, 8 * j + 2 * TQ + 1] = acc_o[j, :, 1]
        o[G + 8, 8 * j + 2 * TQ] = acc_o[j, :, 2]
        o[G + 8, 8 * j + 2 * TQ + 1] = acc_o[j, :, 3]
    np.testing.assert_allclose(o, round_to(p, "float16").astype(np.float64) @ vm, rtol=1e-5, atol=1e-5)


def test_odd_chunk_strides_are_bank_conflict_free():
    """8 rows read by one ldmatrix phase land in 8 distinct 16-byte bank groups, every head dim."""
    for d in range(8, 257, 8):
        L = Layout(d, 64, 64, 4, 2)
        for stride in (L.QK_STRIDE, L.V_STRIDE):
            for c in range(0, d, 8):
                groups = {((r * stride + c) * 2 // 16) % 8 for r in range(8)}
                assert len(groups) == 8, (d, stride, c)


EMU_CASES = [
    # (sq, sk, d, causal, block_m, block_n, num_warps, num_stages, q_in_regs, dtype)
    (37, 50, 24, False, 32, 16, 2, 2, False, "float16"),     # D % 16 == 8: padded k-step, x2 tail
    (37, 50, 24, True, 32, 16, 2, 2, True, "bfloat16"),
    (50, 20, 16, True, 32, 16, 1, 1, False, "float16"),      # 32 rows per warp, Sq > Sk: empty rows
    (20, 45, 40, True, 16, 32, 1, 1, True, "bfloat16"),      # Sq < Sk, 5 chunks per row
    (33, 33, 8, False, 32, 32, 2, 2, False, "float16"),      # smallest head dim
    (64, 70, 32, True, 64, 16, 2, 2, False, "float16"),
    (70, 90, 72, True, 128, 32, 2, 1, False, "float16"),     # the d72-136 shape: 32 rows/warp, 1 stage
    (48, 64, 16, False, 32, 32, 1, 2, False, "bfloat16"),    # seqlen_k a multiple of block_n: no mask
    (40, 40, 56, True, 64, 32, 2, 1, True, "bfloat16"),      # square causal: diagonal tiles only
]


@pytest.mark.parametrize("sq,sk,d,causal,block_m,block_n,num_warps,num_stages,q_in_regs,dtype", EMU_CASES)
def test_emulated_kernel_matches_reference(sq, sk, d, causal, block_m, block_n, num_warps, num_stages, q_in_regs,
                                           dtype):
    rng = np.random.default_rng(sq + 7 * sk + d)
    q, k, v = (round_to(rng.standard_normal((n, d)), dtype) for n in (sq, sk, sk))
    scale = 1 / math.sqrt(d)
    o = np.empty((sq, d), np.float32)
    lse = np.empty(sq, np.float32)
    for m_block in range(-(-sq // block_m)):
        m0 = m_block * block_m
        ob, lb = emulate_cta(q, k, v, m_block=m_block, causal=causal, scale=scale, dtype=dtype, head_dim=d,
                             block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                             q_in_regs=q_in_regs)
        o[m0:m0 + len(lb)] = ob
        lse[m0:m0 + len(lb)] = lb
    o_ref, lse_ref = reference(q, k, v, causal, scale)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    tol = 2e-2 if dtype == "bfloat16" else 4e-3   # P and O rounded to 16 bits, as on the GPU
    np.testing.assert_allclose(o, o_ref, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-4, atol=1e-5)
