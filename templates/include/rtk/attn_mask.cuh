// What an attention tile sees: the sequence it belongs to (varlen), the key or query tiles it
// visits under causal masks and sliding windows, the element mask of the tiles on a boundary,
// and the softcap of its scores.  Every attention kernel (forward, backward, Hopper and mma.sync)
// takes these decisions here and nowhere else; rtkernels/ops/attention_mask.py mirrors the range
// formulas line for line (the NumPy tile model the CPU tests check against brute-force masks).
//
// Conventions (FlashAttention's): query row i of a sequence (seqlen_q rows, seqlen_k keys) sees
// key j iff  i + diag - left <= j <= i + diag + right,  diag = seqlen_k - seqlen_q (bottom-right);
// CAUSAL fixes right = 0 at compile time, WINDOW brings the runtime bounds (left always, right
// when not CAUSAL; the host clamps unbounded sides to the lengths).  Plain CUDA C++ (no Jinja).
#pragma once

namespace rtk {
namespace attn {

// ---- (a) the sequence of a tile ------------------------------------------------------------------
// Rows [start, start + len) of sequence b in a packed array of `total` rows.  cu_seqlens is not
// checked on the device (the host checks it only when it reads it anyway): clamping into
// [0, total) keeps a malformed one from reading or writing outside the arrays.
struct Rows {
    int start, len;
};

__device__ __forceinline__ Rows packed_rows(const int* __restrict__ cu_seqlens, int b, int total) {
    const int lo = min(max(__ldg(cu_seqlens + b), 0), total);
    const int hi = min(max(__ldg(cu_seqlens + b + 1), lo), total);
    return Rows{lo, hi - lo};
}

// Offsets (rows of the packed arrays; 0 when dense, where the batch stride does the job) and
// lengths of a tile's sequence, read once per tile.  Dense: seqlen_q / seqlen_k are the lengths;
// varlen: the packed totals.
struct SeqInfo {
    int q_offset, k_offset;
    int seqlen_q, seqlen_k;
};

template <bool VARLEN>
__device__ __forceinline__ SeqInfo seq_info(const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                                            int b, int seqlen_q, int seqlen_k) {
    if constexpr (VARLEN) {
        const Rows q = packed_rows(cu_seqlens_q, b, seqlen_q);
        const Rows k = packed_rows(cu_seqlens_k, b, seqlen_k);
        return SeqInfo{q.start, k.start, q.len, k.len};
    } else {
        return SeqInfo{0, 0, seqlen_q, seqlen_k};
    }
}

// Start of sequence b in per-head buffers padded to whole PAD-row tiles (lse*log2e, delta, the
// dQ accumulators of the backward): no two sequences overlap, the buffer needs total + b * PAD
// rows (rtkernels.ops.attention_mask.padded_offset_rows), and nothing needs a prefix sum.
template <int PAD>
__device__ __forceinline__ int padded_start(int start, int b) {
    return (start + b * PAD) / PAD * PAD;
}

// The tile a CTA computes.  Dense: (blockIdx.x, blockIdx.y, blockIdx.z) = (tile, head, batch),
// tiles optionally in reverse (heaviest first for the causal forward).  Varlen: blockIdx.x runs
// over heads x schedule slots as (kv head, slot, head within the GQA group), group fastest, then
// the slots: the CTAs resident together are a few kv heads' consecutive tiles, so the K/V (forward)
// or Q/dO (backward) rows they stream are the same few heads' and are shared in L2, as in the
// dense grid (tile fastest); with heads fastest the ~132 resident CTAs spanned every head of a
// long sequence (16 heads x 4 MB of K/V at 7.8k keys, d128).  Measured against heads fastest
// (H100, 2026-11-25, bench_attention_masks --varlen, 32k tokens, causal, two interleaved rounds):
// forward d128 +1-4%, d64 +-1%; backward d64 +3-7%, d128 +2%.  The slot's (sequence, tile) comes
// from the schedule the pre-kernel wrote (templates/attention_schedule.cu.j2: heaviest first within
// each head's slots).  ``group``:
// query heads per kv head among the ``heads`` of the grid (1 where a CTA owns a kv head's whole
// group, the backward).  False: an unused slot.
struct TileCoord {
    int tile, head, batch;
};

template <bool VARLEN, bool REVERSE>
__device__ __forceinline__ bool tile_coord(const int2* __restrict__ schedule, int heads, TileCoord& c,
                                           int group = 1) {
    if constexpr (VARLEN) {
        const int i = blockIdx.x;
        const int slots = gridDim.x / heads;
        const int g = i % group, r = i / group;   // r = kv head * slots + slot
        const int kvh = r / slots, slot = r - kvh * slots;
        c.head = kvh * group + g;
        const int2 e = __ldg(schedule + slot);
        c.batch = e.x;
        c.tile = e.y;
        return e.x >= 0;
    } else {
        c.tile = REVERSE ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
        c.head = blockIdx.y;
        c.batch = blockIdx.z;
        return true;
    }
}

// Persistent kernels: linear tile index t (0 .. m_tiles * heads * batch - 1; each CTA walks
// blockIdx.x, + gridDim.x, ...) -> (tile, head, batch); rtkernels.ops.attention_sm90.linear_tiles
// mirrors it.  Heads run fastest over the same batch, so CTAs working at once on neighbouring
// heads share a GQA group's K/V in L2.  CAUSAL: the query tile is the slowest index, from the
// last (the tiles that see the most keys start first and the light ones fill the tail); else every
// tile does the same work and the query tile is the fastest index: the CTAs working at once read
// the same head's K/V.
template <bool CAUSAL>
__device__ __forceinline__ TileCoord linear_tile(int t, int m_tiles, int heads, int batch) {
    TileCoord c;
    if constexpr (CAUSAL) {
        const int per_tile = heads * batch;
        const int mt = t / per_tile;
        const int r = t - mt * per_tile;
        c.tile = m_tiles - 1 - mt;
        c.batch = r / heads;
        c.head = r - c.batch * heads;
    } else {
        const int r = t / m_tiles;
        c.tile = t - r * m_tiles;
        c.batch = r / heads;
        c.head = r - c.batch * heads;
    }
    return c;
}

// CAUSAL with an L2 group (attention_sm90 l2_walk): the (batch, head) pairs in sections of `group`
// (the last one shorter), and within a section linear_tile's order - query tile slowest, heaviest
// first, pairs fastest.  The CTAs working at once then stream the K/V of one or two sections, which
// the host sizes to stay in L2 (heaviest first over every pair re-read each pair's K/V from HBM at
// every query tile level: ~4x the once-only traffic at S=512 with 64-row tiles, ~8x at 1k - the
// CPU model in rtkernels.ops.attention_sm90.walk_group); rtkernels.ops.attention_sm90.linear_tiles mirrors it.
__device__ __forceinline__ TileCoord linear_tile_grouped(int t, int m_tiles, int heads, int batch, int group) {
    const int per_section = group * m_tiles;
    const int s = t / per_section;
    const int loc = t - s * per_section;
    const int gs = min(group, heads * batch - s * group);   // pairs in this section
    const int mt = loc / gs;
    const int pair = s * group + (loc - mt * gs);
    TileCoord c;
    c.tile = m_tiles - 1 - mt;
    c.batch = pair / heads;
    c.head = pair - c.batch * heads;
    return c;
}

// The backward's lpt_grid (dense, causal): block index t of a 1-D grid -> (key tile, kv head,
// batch), heaviest first in sections of `group` (batch, kv head) pairs - linear_tile_grouped's
// order with its tile flipped: its heaviest (first) rank is its last tile, the backward's is key
// tile 0 (bottom-right causal: key tile n is seen by the query rows from n * BLOCK_N -
// (seqlen_k - seqlen_q) on).  rtkernels.ops.attention_bwd_sm90.lpt_order mirrors it.
__device__ __forceinline__ TileCoord key_tile_lpt(int t, int n_tiles, int heads, int batch, int group) {
    TileCoord c = linear_tile_grouped(t, n_tiles, heads, batch, group);
    c.tile = n_tiles - 1 - c.tile;
    return c;
}

// ---- (b) tile ranges and (c) the element mask ----------------------------------------------------
// Key tiles [n_min, n_max) a query tile visits; a visited tile n needs the element mask iff
// n < n_mask_lo (left window edge) or n >= n_mask_hi (keys past seqlen_k, the diagonal or the
// right window edge).  Without WINDOW n_min and n_mask_lo are the constant 0.
struct KeyRange {
    int n_min, n_max, n_mask_lo, n_mask_hi;
};

// Query tiles [m_min, m_max) whose rows see a key tile (the backward's loop); tile m needs the
// element mask iff m < m_mask_lo or m >= m_mask_hi.
struct QueryRange {
    int m_min, m_max, m_mask_lo, m_mask_hi;
};

// The backward's walk over a key tile's query tiles [r.m_min, r.m_max) (one per step, producer and
// consumers alike): step i visits tile i, or with STAGGER tile i + start wrapped into the range,
// where walk_start is the key tile's diagonal tile (n0 / BLOCK_M) modulo the walk's length - the
// key tiles of one (batch, kv head), started together and equal in work (non-causal), then load
// Q / dO and add dQ on different query tiles at any moment instead of all on the same one.
template <bool STAGGER, int BLOCK_M>
__device__ __forceinline__ int walk_start(const QueryRange& r, int n0) {
    return STAGGER && r.m_max > r.m_min ? (n0 / BLOCK_M) % (r.m_max - r.m_min) : 0;
}

template <bool STAGGER>
__device__ __forceinline__ int walk_tile(int i, const QueryRange& r, int start) {
    if constexpr (!STAGGER) return i;
    const int j = i + start;
    return j < r.m_max ? j : j - (r.m_max - r.m_min);
}

template <bool CAUSAL, bool WINDOW>
struct Mask {
    int seqlen_q, seqlen_k;
    int left, right;   // runtime window bounds (WINDOW only; right unused when CAUSAL)
    int diag;          // seqlen_k - seqlen_q, formed once where the mask is made

    __device__ __forceinline__ Mask(int seqlen_q_, int seqlen_k_, int left_, int right_)
        : seqlen_q(seqlen_q_), seqlen_k(seqlen_k_), left(left_), right(right_), diag(seqlen_k_ - seqlen_q_) {}

    __device__ __forceinline__ bool needs_mask(const KeyRange& r, int n) const {
        return n >= r.n_mask_hi || (WINDOW && n < r.n_mask_lo);
    }
    __device__ __forceinline__ bool needs_mask(const QueryRange& r, int m) const {
        return m < r.m_mask_lo || (WINDOW && m >= r.m_mask_hi);
    }

    // Rows [m0, m0 + rows_q) (rows_q >= 1: the tile's rows that exist).
    template <int BLOCK_N>
    __device__ __forceinline__ KeyRange key_range(int m0, int rows_q) const {
        KeyRange r{0, (seqlen_k + BLOCK_N - 1) / BLOCK_N, 0, seqlen_k / BLOCK_N};
        if constexpr (CAUSAL || WINDOW) {
            const int to_right = CAUSAL ? 0 : right;
            const int keys_last_row = min(seqlen_k, m0 + rows_q + diag + to_right);   // keys the last row sees
            r.n_max = keys_last_row > 0 ? (keys_last_row + BLOCK_N - 1) / BLOCK_N : 0;
            const int keys_first_row = m0 + diag + to_right + 1;                        // ... and the first row
            r.n_mask_hi = min(r.n_mask_hi, keys_first_row > 0 ? keys_first_row / BLOCK_N : 0);
        }
        if constexpr (WINDOW) {
            const int first_key = m0 + diag - left;                       // the first row's first key
            r.n_min = first_key > 0 ? first_key / BLOCK_N : 0;
            const int last_row_first_key = m0 + rows_q - 1 + diag - left;  // the last row's first key
            r.n_mask_lo = last_row_first_key > 0 ? (last_row_first_key + BLOCK_N - 1) / BLOCK_N : 0;
            r.n_max = max(r.n_max, r.n_min);
        }
        return r;
    }

    // Keys [n0, n0 + BLOCK_N) (n0 < seqlen_k).  A tile running past seqlen_k is masked for every
    // query tile; rows past seqlen_q need no mask (the backward gives them lse = +inf: P = 0).
    template <int BLOCK_M, int BLOCK_N>
    __device__ __forceinline__ QueryRange query_range(int n0) const {
        const int m_tiles = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
        QueryRange r{0, m_tiles, 0, m_tiles};
        if constexpr (CAUSAL || WINDOW) {
            const int to_right = CAUSAL ? 0 : right;
            const int first_row = n0 - diag - to_right;                    // the first row that sees key n0
            r.m_min = first_row > 0 ? first_row / BLOCK_M : 0;
            const int full_row = n0 + BLOCK_N - 1 - diag - to_right;       // rows from here see the last key
            r.m_mask_lo = full_row > 0 ? (full_row + BLOCK_M - 1) / BLOCK_M : 0;
        }
        if constexpr (WINDOW) {
            const int keys_end = min(n0 + BLOCK_N, seqlen_k);
            const int last_row = keys_end - 1 - diag + left;               // the last row that sees key keys_end - 1
            r.m_max = last_row >= 0 ? min(m_tiles, last_row / BLOCK_M + 1) : 0;
            const int nomask_end = n0 - diag + left + 1;                   // rows below this see key n0
            r.m_mask_hi = nomask_end > 0 ? nomask_end / BLOCK_M : 0;
            r.m_max = max(r.m_max, r.m_min);
        }
        if (n0 + BLOCK_N > seqlen_k) r.m_mask_lo = m_tiles;                  // the last key tile: always masked
        return r;
    }

    // Element mask of one query row against the tile of keys from key0: the visible columns
    // (tile-relative) are [begin, end); begin is 0 without WINDOW.
    struct Cols {
        int begin, end;
    };
    __device__ __forceinline__ Cols cols(int row, int key0) const {
        Cols c;
        c.end = seqlen_k - key0;
        if constexpr (CAUSAL) c.end = min(c.end, row + diag + 1 - key0);
        else if constexpr (WINDOW) c.end = min(c.end, row + diag + right + 1 - key0);
        c.begin = WINDOW ? row + diag - left - key0 : 0;
        return c;
    }
    __device__ __forceinline__ static bool hidden(int col, const Cols& c) {
        if constexpr (WINDOW) return col >= c.end || col < c.begin;
        else return col >= c.end;
    }

    // The backward's transposed view: the query columns (tile-relative to m0) that key `key` is
    // visible to are [begin, end), BLOCK_M past every column for a key past seqlen_k.
    template <int BLOCK_M>
    __device__ __forceinline__ Cols query_cols(int key, int m0) const {
        Cols c;
        c.begin = key >= seqlen_k ? BLOCK_M : 0;
        if constexpr (CAUSAL) c.begin = max(c.begin, key - diag - m0);
        else if constexpr (WINDOW) c.begin = max(c.begin, key - diag - right - m0);
        c.end = WINDOW ? key - diag + left + 1 - m0 : BLOCK_M;
        return c;
    }
    __device__ __forceinline__ static bool hidden_query(int col, const Cols& c) {
        if constexpr (WINDOW) return col < c.begin || col >= c.end;
        else return col < c.begin;
    }

    // Whether query row qi sees key kj (both within the sequence's numbering).
    __device__ __forceinline__ bool sees(int qi, int kj) const {
        bool ok = kj < seqlen_k;
        if constexpr (CAUSAL) ok = ok && kj <= qi + diag;
        else if constexpr (WINDOW) ok = ok && kj <= qi + diag + right;
        if constexpr (WINDOW) ok = ok && kj >= qi + diag - left;
        return ok;
    }

    // The backward's deterministic order: where key tile n stands among the key tiles that add
    // to query tile m (all BLOCK_M rows, as the key tiles' query_range counts them), counted in
    // launch order - ascending tiles, or DESCENDING from the last.
    template <int BLOCK_M, int BLOCK_N, bool DESCENDING>
    __device__ __forceinline__ int add_rank(int m, int n) const {
        const KeyRange r = key_range<BLOCK_N>(m * BLOCK_M, BLOCK_M);
        return DESCENDING ? r.n_max - 1 - n : n - r.n_min;
    }
};

// The sequence and row of padded row `prow` of a per-head buffer laid out by padded_start<PAD>
// (binary search over the padded starts; O(log batch) cached loads).  False for rows in the gaps
// between sequences; `row` may be past the sequence's length (its padding rows).
template <int PAD>
__device__ __forceinline__ bool padded_row(const int* __restrict__ cu_seqlens, int batch, int total, int prow,
                                           int& b, int& row) {
    int lo = 0, hi = batch - 1;   // the last sequence whose padded start is <= prow
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (padded_start<PAD>(packed_rows(cu_seqlens, mid, total).start, mid) <= prow) lo = mid; else hi = mid - 1;
    }
    const Rows r = packed_rows(cu_seqlens, lo, total);
    b = lo;
    row = prow - padded_start<PAD>(r.start, lo);
    return row >= 0 && row < (r.len + PAD - 1) / PAD * PAD;
}

// ---- (d) softcap ---------------------------------------------------------------------------------
// One MUFU.TANH per score (relative error ~2^-11, below the bf16/fp16 rounding of the capped score
// that the same computation in the input dtype makes).  Why not an exact tanh: per score the
// forward at d128 spends ~512 tensor-core FLOPs = ~0.125 SM clock, the exp2 0.0625 clock of the
// 16/clk MUFU unit; a second MUFU op keeps the two units even, the two (ex2 + rcp) of
// 1 - 2 / (e^2x + 1) would make the MUFU the bottleneck (~0.19 clock per score).
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Scores s = q.k (unscaled, as the GEMM leaves them).  Without SOFTCAP the softmax sees
// s * softmax_scale; with it, softcap * tanh(s * softmax_scale / softcap): the kernels replace s
// by t = tanh(s * pre) and scale t by `scale` = softcap where they would scale s by softmax_scale
// (the exp2 FFMA, the lse), so the softmax code is the same either way.
template <bool SOFTCAP>
struct Softcap {
    float pre;     // softmax_scale / softcap
    float scale;   // the factor of the softmax's argument: softcap, or softmax_scale without a cap

    __device__ __forceinline__ Softcap(float softmax_scale, float softcap)
        : pre(SOFTCAP ? softmax_scale / softcap : 1.f), scale(SOFTCAP ? softcap : softmax_scale) {}

    __device__ __forceinline__ float operator()(float s) const { return SOFTCAP ? tanh_approx(s * pre) : s; }

    // Backward: d(capped score) / d(s * softmax_scale) = 1 - t^2, t = the forward's tanh; masked
    // scores (t = -inf, P = 0) get 0, not 1 - inf (P * -inf would be NaN).
    __device__ __forceinline__ static float grad(float t) { return SOFTCAP ? 1.f - fminf(t * t, 1.f) : 1.f; }
};

}  // namespace attn
}  // namespace rtk
