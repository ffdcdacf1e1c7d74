// Primitives of the attention backward that mma.cuh does not have: float32 reductions into
// global memory (the dQ accumulation; the sm_90 bulk reduction of a staged dQ row is in
// rtk/sm90.cuh), the acquire/release pair of the ordered (deterministic) dQ flush, and the log2-domain
// lse guard.  Plain CUDA C++ (no Jinja), included by templates/attention_bwd.cu.j2 after mma.cuh.
#pragma once

namespace rtk {

// dst[0] += a, dst[1] += b without a return value (RED, not ATOM).  sm_90 has an 8-byte vector
// form: half the reduction requests to L2 for the same data.  dst must be 8-byte aligned.
__device__ __forceinline__ void red_add_f32x2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(dst), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

// dst[0..3] += v: one 16-byte reduction on sm_90, four scalar ones before.  dst 16-byte aligned.
__device__ __forceinline__ void red_add_f32x4(float* dst, float4 v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
                 :: "l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(dst), "f"(v.x) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(dst + 1), "f"(v.y) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(dst + 2), "f"(v.z) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(dst + 3), "f"(v.w) : "memory");
#endif
}

// Acquire load of a flush counter: 16 bytes, the count in the first int and zeros in the other
// three (one 128-bit load, like every other global load of the family; OR-ing the zeros in keeps
// ptxas from narrowing it).
__device__ __forceinline__ int ld_acquire_gpu_x4(const int* p) {
    int v, pad0, pad1, pad2;
    asm volatile("ld.global.acquire.gpu.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v), "=r"(pad0), "=r"(pad1), "=r"(pad2) : "l"(p) : "memory");
    return v | pad0 | pad1 | pad2;
}
// (red_release_gpu_add, the release half of the flush: rtk/common.cuh)

// Barrier `id` (1..15; 0 is __syncthreads) among `threads` threads (a multiple of 32), e.g. a
// pair of warps exchanging halves of a tile.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// lse (natural log) -> lse * log2(e), the offset subtracted inside exp2.  A row that saw no key
// in the forward (lse = -inf) and a padding row both become +inf: exp2(s - inf) = 0 for every
// finite or -inf score, so P, dS and every gradient of that row are exactly 0, never NaN.
__device__ __forceinline__ float lse_log2_or_inf(float lse, bool valid) {
    return (valid && lse != __int_as_float(0xff800000)) ? lse * 1.4426950408889634f : __int_as_float(0x7f800000);
}

// The backward's pre-pass, one row per LANES lanes (a power of two >= HEAD_DIM / 8, one 16-byte
// chunk of o and do each): delta = rowsum(dO * O) in f32 and lse * log2(e) (+inf for rows that
// saw no key), both into rows padded to a multiple of lse_pad (padding rows: +inf and 0).
// Shared by the mma.sync and the Hopper kernels' pre-pass entry points (which add their own
// buffer zeroing); needs rtk/common.cuh.
// rowsum(o * dout) of one row, over LANES lanes (every lane of the warp calls it: a shuffle).
template <typename T, int HEAD_DIM, int LANES>
__device__ __forceinline__ float bwd_dot_sum(const T* __restrict__ o, const T* __restrict__ dout, bool exists, int c,
                                             long long o_row, long long do_row) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    float acc = 0.f;
    if (exists && c < CHUNKS) {
        const Vec<T, 8> x = *reinterpret_cast<const Vec<T, 8>*>(o + o_row + c * 8);
        const Vec<T, 8> y = *reinterpret_cast<const Vec<T, 8>*>(dout + do_row + c * 8);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(to_float(x.v[e]), to_float(y.v[e]), acc);
    }
#pragma unroll
    for (int w = LANES / 2; w >= 1; w /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, w);
    return acc;
}

template <typename T, int HEAD_DIM, int LANES>
__device__ __forceinline__ void bwd_dot_row(const T* __restrict__ o, const T* __restrict__ dout,
                                            const float* __restrict__ lse, float* __restrict__ lse_log2,
                                            float* __restrict__ delta, int seqlen_q, int lse_pad, long long hb,
                                            int row, int c, long long o_row, long long do_row) {
    const float acc = bwd_dot_sum<T, HEAD_DIM, LANES>(o, dout, row < seqlen_q, c, o_row, do_row);
    const int padded = (seqlen_q + lse_pad - 1) / lse_pad * lse_pad;
    if (c == 0 && row < padded) {
        const bool valid = row < seqlen_q;
        lse_log2[hb * padded + row] = lse_log2_or_inf(valid ? lse[hb * seqlen_q + row] : 0.f, valid);
        delta[hb * padded + row] = acc;   // 0 for padding rows
    }
}

// The same for packed (varlen) rows: `row` of a sequence of `len` rows (padding rows past it get
// +inf and 0), read from the packed lse at `lse_at`, written at padded row `out_at` - when `writes`
// (a padded row that belongs to a sequence; every lane still joins the shuffle).
template <typename T, int HEAD_DIM, int LANES>
__device__ __forceinline__ void bwd_dot_packed_row(const T* __restrict__ o, const T* __restrict__ dout,
                                                   const float* __restrict__ lse, float* __restrict__ lse_log2,
                                                   float* __restrict__ delta, bool writes, int row, int len,
                                                   long long lse_at, long long out_at, int c, long long o_row,
                                                   long long do_row) {
    const bool exists = writes && row < len;
    const float acc = bwd_dot_sum<T, HEAD_DIM, LANES>(o, dout, exists, c, o_row, do_row);
    if (c == 0 && writes) {
        lse_log2[out_at] = lse_log2_or_inf(exists ? lse[lse_at] : 0.f, exists);
        delta[out_at] = acc;   // 0 for padding rows
    }
}

// LANES of bwd_dot_row for a head dim: the smallest power of two >= HEAD_DIM / 8.
template <int HEAD_DIM>
constexpr int bwd_dot_lanes() {
    return HEAD_DIM / 8 <= 1 ? 1 : HEAD_DIM / 8 <= 2 ? 2 : HEAD_DIM / 8 <= 4 ? 4 : HEAD_DIM / 8 <= 8 ? 8
         : HEAD_DIM / 8 <= 16 ? 16 : 32;
}

}  // namespace rtk
