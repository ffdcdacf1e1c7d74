// Warp-level tensor-core primitives for sm_80+: ldmatrix, mma.sync m16n8k16, cp.async,
// fast exp2, register packing, quad reductions.  Plain CUDA C++ (no Jinja), included by
// templates as "rtk/mma.cuh".
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"),
// with g = lane / 4 and t = lane % 4:
//   A (16x16, row-major, 4 x b32 = 8 halves):  a0 (g, 2t..2t+1)  a1 (g+8, 2t..2t+1)
//                                              a2 (g, 2t+8..)    a3 (g+8, 2t+8..)
//   B (16x8, "col", 2 x b32 = 4 halves):      b0 (k=2t..2t+1, n=g)  b1 (k=2t+8..2t+9, n=g)
//   C/D (16x8 f32, 4 floats):                 c0,c1 (g, 2t..2t+1)   c2,c3 (g+8, 2t..2t+1)
// ldmatrix: lanes 8i..8i+7 give the 8 row addresses (16 bytes each) of matrix i; every lane
// receives, for each matrix i, the pair (row lane/4, cols 2*(lane%4)..+1) in register i, or
// with .trans the pair (rows 2*(lane%4)..+1, col lane/4).  That is exactly one A/B/C 8x8
// sub-block, which is why ldmatrix feeds mma without any shuffles.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace rtk {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ---- ldmatrix ---------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x1(unsigned (&r)[1], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x1_trans(unsigned (&r)[1], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}

// ---- mma.sync m16n8k16, f32 accumulate in place ------------------------------------------
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                     unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                            unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- cp.async (16 bytes, L2 only) ----------------------------------------------------------
// With valid == false nothing is read (src-size 0) and the 16 destination bytes become zero:
// out-of-range rows of a tile arrive as zeros without a branch around the copy.  `src` must
// still be a mapped address, so callers pass the tensor base for invalid rows.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    const int src_size = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_size) : "memory");
}
// The same with an L2 prefetch size qualifier: a miss fetches PREFETCH bytes (64, 128 or 256) around
// the 16 requested into L2, so a streaming read's later requests to that line hit (0: none, as
// cp_async_16).
template <int PREFETCH>
__device__ __forceinline__ void cp_async_16_prefetch(void* smem, const void* gmem, bool valid) {
    const int src_size = valid ? 16 : 0;
    if constexpr (PREFETCH == 64) {
        asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;\n"
                     :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_size) : "memory");
    } else if constexpr (PREFETCH == 128) {
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n"
                     :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_size) : "memory");
    } else if constexpr (PREFETCH == 256) {
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n"
                     :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_size) : "memory");
    } else {
        static_assert(PREFETCH == 0, "cp_async_16_prefetch: 0, 64, 128 or 256 bytes");
        cp_async_16(smem, gmem, valid);
    }
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// ---- math -------------------------------------------------------------------------------
// 2^x with one MUFU.EX2; flushes denormal results to zero, exp2(-inf) = +0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// 2^x on the FMA and integer pipes instead of the MUFU unit (which does 16 results per SM clock
// against 128 FMAs): x = j + f with j = round(x) (the 1.5 * 2^23 trick: adding it leaves j in the
// low mantissa bits), 2^f for f in [-0.5, 0.5] by a degree-3 polynomial (relative error 7.5e-5,
// coefficients fitted for minimax relative error; below the 2^-11 rounding of an fp16 P), and j
// added to the exponent field.  7 FMA-pipe and 1-2 integer instructions.  Kernels compute a share
// of their exponentials here when the MUFU unit is their bottleneck (softcap's tanh takes a second
// MUFU op per score).  x < -126 (masked scores: -inf) gives exactly 0 as fast_exp2 does; results
// in (0, 2^-126] differ from fast_exp2's flush only below float's normal range.
__device__ __forceinline__ float poly_exp2(float x) {
    const float xc = fmaxf(x, -126.f);
    const float t = xc + 12582912.f;            // 1.5 * 2^23: t's mantissa low bits hold round(xc)
    const float f = xc - (t - 12582912.f);      // in [-0.5, 0.5]
    float p = fmaf(0.0551727f, f, 0.242614f);
    p = fmaf(p, f, 0.693261f);
    p = fmaf(p, f, 0.9999278f);
    const int bits = __float_as_int(p) + (__float_as_int(t) << 23);   // p * 2^j
    return x < -126.f ? 0.f : __int_as_float(bits);
}

// Max/sum over the 4 lanes of a quad (the 4 threads that share fragment rows g and g+8).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- packing ----------------------------------------------------------------------------
// Two floats -> one b32 of two 16-bit values, `lo` in the low half (the lower column index
// of a fragment pair), round-to-nearest-even.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

}  // namespace rtk
