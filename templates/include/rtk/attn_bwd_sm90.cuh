// What the Hopper backward kernels share (templates/attention_bwd_sm90.cu.j2 for head dims <= 128,
// templates/attention_bwd_sm90_big.cu.j2 for 136..256): the f32 dQ accumulator's tile layout, the
// padded per-head rows of the varlen buffers, and the bodies of the pre-pass (delta, lse*log2e)
// and of the dQ conversion, so both families run the same host-side plan (rtkernels/ops/
// attention_bwd_sm90.py: launch).  Plain CUDA C++; include after rtk/attn_bwd.cuh and
// rtk/attn_mask.cuh.
#pragma once

namespace rtk {
namespace bwd90 {

// varlen: rows per head of the padded buffers (rtkernels.ops.attention_mask.padded_offset_rows)
template <int PAD>
__device__ __forceinline__ int padded_total(int total_q, int batch) {
    return (total_q + batch * PAD + PAD - 1) / PAD * PAD;
}

// Position of element (row 16 w + g + 8 h, column 8 j + 2 t + c) of a 64-row dQ tile, where
// thread tid = 32 w + 4 g + t of a warpgroup holds it as accumulator register i = 4 j + 2 h + c:
// 16-byte chunks of 4 registers, the 128 threads' chunks side by side (conflict-free stores,
// coalesced reads; a warp's 16-byte reductions cover 512 contiguous bytes).  Column block j of
// the tile is the contiguous range [512 j, 512 j + 512).
__device__ __forceinline__ int dq_tile_index(int tid, int i) {
    return (i / 4) * 512 + tid * 4 + i % 4;
}

// The pre-pass: delta = rowsum(dO * O) and lse * log2(e) into rows padded to LSE_PAD.
template <typename T, int HEAD_DIM, int LSE_PAD, bool IS_VARLEN, int DOT_THREADS>
__device__ __forceinline__ void dot_pass(const T* __restrict__ o, const T* __restrict__ dout,
                                         const float* __restrict__ lse, float* __restrict__ lse_log2,
                                         float* __restrict__ delta, int seqlen_q, long long o_batch_stride,
                                         long long o_seq_stride, long long o_head_stride, long long do_batch_stride,
                                         long long do_seq_stride, long long do_head_stride,
                                         const int* __restrict__ cu_seqlens_q, int batch) {
    constexpr int DOT_LANES = bwd_dot_lanes<HEAD_DIM>();
    const int c = threadIdx.x % DOT_LANES;
    if constexpr (IS_VARLEN) {   // padded row -> (sequence, row)
        const int prow = blockIdx.x * (DOT_THREADS / DOT_LANES) + threadIdx.x / DOT_LANES;
        const int h = blockIdx.y;
        int b = 0, row = 0;
        const bool writes = prow < padded_total<LSE_PAD>(seqlen_q, batch) &&
                            attn::padded_row<LSE_PAD>(cu_seqlens_q, batch, seqlen_q, prow, b, row);
        const attn::Rows seq = attn::packed_rows(cu_seqlens_q, b, seqlen_q);
        const long long packed = seq.start + row;
        bwd_dot_packed_row<T, HEAD_DIM, DOT_LANES>(o, dout, lse, lse_log2, delta, writes, row, seq.len,
                                                   (long long)h * seqlen_q + packed,
                                                   (long long)h * padded_total<LSE_PAD>(seqlen_q, batch) + prow, c,
                                                   packed * o_seq_stride + h * o_head_stride,
                                                   packed * do_seq_stride + h * do_head_stride);
        return;
    }
    const int row = blockIdx.x * (DOT_THREADS / DOT_LANES) + threadIdx.x / DOT_LANES;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    bwd_dot_row<T, HEAD_DIM, DOT_LANES>(o, dout, lse, lse_log2, delta, seqlen_q, LSE_PAD,
                                        (long long)b * gridDim.y + h, row, c,
                                        b * o_batch_stride + row * o_seq_stride + h * o_head_stride,
                                        b * do_batch_stride + row * do_seq_stride + h * do_head_stride);
}

// dq = scale * dq_accum in the input dtype: one CTA of 128 threads per 64-row tile reads the
// tile in fragment order (16-byte loads), regroups it by rows in shared memory (`tile`, 64 rows
// of HEAD_DIM + 8 elements: odd 16-byte chunks, no conflicts) and stores 16-byte row chunks
// (rows past seqlen_q are dropped).
template <typename T, int HEAD_DIM, int LSE_PAD, bool IS_VARLEN>
__device__ __forceinline__ void dq_convert(T* tile, const float* __restrict__ dq_accum, T* __restrict__ dq,
                                           int seqlen_q, long long dq_batch_stride, long long dq_seq_stride,
                                           long long dq_head_stride, float softmax_scale,
                                           const int* __restrict__ cu_seqlens_q, int batch) {
    constexpr int BLOCK_M = 64;
    constexpr int CV_ROW = HEAD_DIM + 8;
    int m = blockIdx.x;
    const int h = blockIdx.y;
    int b = blockIdx.z;
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const float* src = dq_accum + (((long long)b * gridDim.y + h) * gridDim.x + m) * (BLOCK_M * HEAD_DIM);
    long long row0 = 0;   // varlen: the tile's first packed row (m counts the sequence's tiles then)
    if constexpr (IS_VARLEN) {   // blockIdx.x: a BLOCK_M-row tile of the padded rows
        int row = 0;
        if (!attn::padded_row<LSE_PAD>(cu_seqlens_q, batch, seqlen_q, blockIdx.x * BLOCK_M, b, row)) return;
        const attn::Rows seq = attn::packed_rows(cu_seqlens_q, b, seqlen_q);
        if (row >= seq.len) return;
        src = dq_accum + ((long long)h * gridDim.x + blockIdx.x) * (BLOCK_M * HEAD_DIM);
        row0 = seq.start;
        seqlen_q = seq.len;
        m = row / BLOCK_M;
        b = 0;
    }
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
        const float4 x = *reinterpret_cast<const float4*>(src + dq_tile_index(tid, 4 * j));
        const int r = warp * 16 + lane / 4, c = 8 * j + 2 * (lane % 4);
        *reinterpret_cast<unsigned*>(&tile[r * CV_ROW + c]) = pack2<T>(x.x * softmax_scale, x.y * softmax_scale);
        *reinterpret_cast<unsigned*>(&tile[(r + 8) * CV_ROW + c]) = pack2<T>(x.z * softmax_scale, x.w * softmax_scale);
    }
    __syncthreads();
    constexpr int CHUNKS = HEAD_DIM / 8;   // 16-byte chunks per row
    for (int i = tid; i < BLOCK_M * CHUNKS; i += 128) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        const int row = m * BLOCK_M + r;
        if (row < seqlen_q)
            *reinterpret_cast<uint4*>(dq + b * dq_batch_stride + (row0 + row) * dq_seq_stride + h * dq_head_stride + 8 * c) =
                *reinterpret_cast<const uint4*>(&tile[r * CV_ROW + 8 * c]);
    }
}

}  // namespace bwd90
}  // namespace rtk
