// GEMM helpers on top of rtk/mma.cuh: cp.async with partial source sizes (narrow chunks and
// K tails), the XOR swizzle of a shared-memory tile, and epilogue activations.
// Plain CUDA C++ (no Jinja), included by templates as "rtk/gemm.cuh".
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "rtk/mma.cuh"

namespace rtk {

// cp.async of BYTES (16 / 8 / 4) into shared memory; only the first `src_bytes` are read
// from global memory and the rest of the destination is zero-filled, so a chunk that
// straddles the end of a row (K % 8 != 0) or lies wholly outside (src_bytes == 0) needs no
// separate path.  16-byte copies bypass L1 (.cg); 8/4-byte copies only exist as .ca.
template <int BYTES>
__device__ __forceinline__ void cp_async_zfill(void* smem, const void* gmem, int src_bytes) {
    static_assert(BYTES == 16 || BYTES == 8 || BYTES == 4, "cp.async moves 4, 8 or 16 bytes");
    if constexpr (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                     :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                     :: "r"(smem_addr(smem)), "l"(gmem), "n"(BYTES), "r"(src_bytes) : "memory");
    }
}

// The same copy addressed by a 32-bit shared-window offset: the main loop keeps its stage
// bases as such offsets, so a copy costs no generic-to-shared conversion.
__device__ __forceinline__ void cp_async_16_s(unsigned smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem), "l"(gmem), "r"(src_bytes) : "memory");
}
// L2_PREFETCH (16-byte copies only): 0 = no hint (ptxas then emits a 128-byte L2 fetch), or the
// L2 fetch size in bytes (64 / 128 / 256): a K-contiguous row of a 32-deep tile is 64 bytes, so a
// 256-byte fetch brings the next 3 tiles' row segments into L2 with this one.
template <int BYTES, int L2_PREFETCH = 0>
__device__ __forceinline__ void cp_async_s(unsigned smem, const void* gmem, int src_bytes) {
    static_assert(BYTES == 16 || BYTES == 8 || BYTES == 4, "cp.async moves 4, 8 or 16 bytes");
    static_assert(L2_PREFETCH == 0 || L2_PREFETCH == 64 || L2_PREFETCH == 128 || L2_PREFETCH == 256,
                  "L2 prefetch sizes are 64, 128 or 256 bytes");
    if constexpr (BYTES == 16 && L2_PREFETCH == 64) {
        asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;\n"
                     :: "r"(smem), "l"(gmem), "r"(src_bytes) : "memory");
    } else if constexpr (BYTES == 16 && L2_PREFETCH == 128) {
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n"
                     :: "r"(smem), "l"(gmem), "r"(src_bytes) : "memory");
    } else if constexpr (BYTES == 16 && L2_PREFETCH == 256) {
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n"
                     :: "r"(smem), "l"(gmem), "r"(src_bytes) : "memory");
    } else if constexpr (BYTES == 16) {
        cp_async_16_s(smem, gmem, src_bytes);
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                     :: "r"(smem), "l"(gmem), "n"(BYTES), "r"(src_bytes) : "memory");
    }
}

// ldmatrix x4 from a 32-bit shared-window offset (rtk/mma.cuh's take generic pointers).
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4_s(unsigned (&r)[4], unsigned smem) {
    if constexpr (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem));
    }
}

// One k16 step of a warp's fragments, for the mma.sync main loops of both matmul kernels.
// ldmatrix x4 per A fragment i from a_addr(i): matrices (m +0, k +0), (m +8, k +0), (m +0, k +8),
// (m +8, k +8); per B fragment pair f from b_addr(f): b0, b1 of n-fragment 2f, then of 2f + 1.
// TRANS_A / TRANS_B: the operand is stored M / N-contiguous (ldmatrix .trans).
template <bool TRANS_A, bool TRANS_B, int MI, int NI, typename AddrA, typename AddrB>
__device__ __forceinline__ void ldsm_k16(unsigned (&af)[MI][4], unsigned (&bf)[NI][2], AddrA a_addr, AddrB b_addr) {
#pragma unroll
    for (int i = 0; i < MI; ++i) ldsm_x4_s<TRANS_A>(af[i], a_addr(i));
#pragma unroll
    for (int j = 0; j < NI; j += 2) {
        unsigned r[4];
        ldsm_x4_s<TRANS_B>(r, b_addr(j / 2));
        bf[j][0] = r[0]; bf[j][1] = r[1]; bf[j + 1][0] = r[2]; bf[j + 1][1] = r[3];
    }
}

// acc[i][j] += A fragment i x B fragment j (m16n8k16, float32 accumulators) over the warp's tile.
template <typename U, int MI, int NI>
__device__ __forceinline__ void mma_k16(float (&acc)[MI][NI][4], const unsigned (&af)[MI][4],
                                        const unsigned (&bf)[NI][2]) {
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) mma_m16n8k16<U>(acc[i][j], af[i], bf[j][0], bf[j][1]);
}

__device__ __forceinline__ void st_shared_b32(unsigned smem, unsigned v) {
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(smem), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(unsigned smem) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(smem) : "memory");
    return v;
}

// Swizzled element offset inside a ROWS x COLS tile of 16-bit values, COLS contiguous.
// A row holds CH = COLS / 8 chunks of 16 bytes.  ldmatrix reads one chunk column of 8
// consecutive rows per phase; those 8 chunks must sit in 8 different 16-byte bank groups
// (128 bytes = all 32 banks).  With CH >= 8 every row spans the banks once, so XOR-ing the
// chunk index with (row % 8) spreads the 8 rows; with CH < 8 a 128-byte line holds 8 / CH
// rows, which already differ in the line offset, and the XOR with (row / (8 / CH)) % CH
// separates rows that share it.  The XOR only permutes chunks within a row, so a row stays
// contiguous for cp.async and no padding is needed.
template <int COLS>
__device__ __forceinline__ int swizzle(int row, int col) {
    constexpr int CH = COLS / 8;
    static_assert(COLS % 8 == 0 && (CH & (CH - 1)) == 0 && CH >= 2, "COLS must be 16 * 2^k");
    int chunk = col >> 3;
    if constexpr (CH >= 8) {
        chunk ^= row & 7;
    } else {
        chunk ^= (row / (8 / CH)) & (CH - 1);
    }
    return row * COLS + (chunk << 3) + (col & 7);
}

// ---- epilogue activations (float in, float out) ----------------------------------------
enum Activation { kActNone = 0, kActRelu = 1, kActGelu = 2, kActSilu = 3 };

template <int ACT>
__device__ __forceinline__ float activate(float x) {
    if constexpr (ACT == kActRelu) {
        return fmaxf(x, 0.0f);
    } else if constexpr (ACT == kActGelu) {
        // exact (erf) GELU, as torch.nn.functional.gelu's default
        return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    } else if constexpr (ACT == kActSilu) {
        return x / (1.0f + __expf(-x));
    } else {
        return x;
    }
}

}  // namespace rtk
