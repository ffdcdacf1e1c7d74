// Hopper (sm_90 / sm_90a) building blocks: mbarriers, TMA bulk tensor copies, wgmma, warpgroup
// register handoff, named barriers, cluster helpers.  Plain CUDA C++, reusable by any template:
//     #include "rtk/sm90.cuh"        // namespace rtk::sm90
// wgmma and setmaxnreg exist only in the arch-specific target: rtkernels compiles a config with
// needs_arch_specific=True (or a user template that includes this header) for sm_90a.
//
// Conventions
// - Shared-memory operands are generic pointers into __shared__ memory; the wrappers convert them.
// - TMA coordinates are element indices, innermost dimension first (the tensor map's order, the
//   reverse of NumPy's shape order); boxes that reach past the tensor are zero-filled on load and
//   clipped on store, so ragged edges need no special code on the load side.
// - Every wrapper is a thin `asm volatile` with a "memory" clobber where it orders memory, so the
//   compiler neither drops nor reorders it across other shared-memory accesses.
#pragma once
#include "rtk/common.cuh"
#include "rtk/wgmma.cuh"

namespace rtk {
namespace sm90 {

typedef unsigned int u32;
typedef unsigned long long u64;

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned.  Declared here rather than taken
// from <cuda.h> because NVRTC has no driver headers; rtkernels.tma.tensor_map builds the bytes on
// the host and Kernel.launch passes them by value:  `const __grid_constant__ rtk::sm90::TensorMap m`.
struct alignas(64) TensorMap {
    u64 opaque[16];
};

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ---- mbarrier -------------------------------------------------------------------------------
// A phase completes when `arrive_count` arrivals have happened and every byte announced with
// expect_tx has landed.  Waiters pass the parity of the phase they wait for (0, 1, 0, ...).

__device__ __forceinline__ void mbar_init(u64* bar, u32 arrive_count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(arrive_count) : "memory");
}

// Makes the inits visible to the async proxy (TMA) and to the other CTAs of a cluster; follow
// with __syncthreads() (or a cluster barrier) before any thread or copy uses the barriers.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 tx_bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_u32(bar)), "r"(tx_bytes) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 tx_bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;"
                 :: "r"(smem_u32(bar)), "r"(tx_bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(bar)) : "memory");
}

// Arrive on the barrier at the same offset in CTA `cta_rank` of this cluster (a consumer releasing
// a stage that another CTA's producer multicasts into).
__device__ __forceinline__ void mbar_arrive_cluster(u64* bar, u32 cta_rank) {
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}"
                 :: "r"(smem_u32(bar)), "r"(cta_rank) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(u64* bar, u32 phase) {
    u32 done;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.b32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_u32(bar)), "r"(phase) : "memory");
    return done != 0;
}

// try_wait suspends the thread for a hardware-chosen interval before it reports "not yet", so
// the loop does not hammer shared memory the way a test_wait spin would.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 phase) {
    // Labels inside a { } block are local to it, so the loop can be inlined many times.
    asm volatile("{\n.reg .pred p;\nRTK_MBAR_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra RTK_MBAR_WAIT;\n}" :: "r"(smem_u32(bar)), "r"(phase) : "memory");
}

// ---- TMA: bulk tensor copies ----------------------------------------------------------------

__device__ __forceinline__ void tma_prefetch(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<u64>(map)) : "memory");
}

__device__ __forceinline__ void tma_load_1d(void* dst, const TensorMap* map, u64* bar, int c0) {
    asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2}], [%3];"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(smem_u32(bar))
                 : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, u64* bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
                 : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2),
                    "r"(smem_u32(bar))
                 : "memory");
}

__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2,
                                            int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(smem_u32(bar))
                 : "memory");
}

__device__ __forceinline__ void tma_load_5d(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2,
                                            int c3, int c4) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(c4), "r"(smem_u32(bar))
                 : "memory");
}

// An L2 policy for data read once (a KV cache streamed by decoding): its lines are the first
// evicted, so the small data every call re-reads (lengths, block tables, partials) and what the
// next kernel reuses stay in L2 while the stream passes through.
__device__ __forceinline__ u64 l2_evict_first_policy() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// tma_load_4d with an L2 cache policy (l2_evict_first_policy).
__device__ __forceinline__ void tma_load_4d_hint(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2,
                                                 int c3, u64 policy) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(smem_u32(bar)), "l"(policy)
                 : "memory");
}

// The same box delivered to every CTA of the cluster whose bit is set in `cta_mask`, at the same
// shared offset, each completing on its own barrier at `bar`'s offset (operand reuse across a
// cluster: each CTA issues a slice, all receive the whole tile).
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const TensorMap* map, u64* bar, int c0, int c1,
                                                      unsigned short cta_mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar)),
                    "h"(cta_mask)
                 : "memory");
}

__device__ __forceinline__ void tma_load_3d_multicast(void* dst, const TensorMap* map, u64* bar, int c0, int c1,
                                                      int c2, unsigned short cta_mask) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3, %4}], [%5], %6;"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2),
                    "r"(smem_u32(bar)), "h"(cta_mask)
                 : "memory");
}

// Stores read shared memory asynchronously: write the tile with ordinary stores, then
// fence_proxy_async() in every writing thread, a barrier, and one thread issues the store.
__device__ __forceinline__ void tma_store_2d(const TensorMap* map, const void* src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 :: "l"(reinterpret_cast<u64>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1) : "memory");
}

__device__ __forceinline__ void tma_store_3d(const TensorMap* map, const void* src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
                 :: "l"(reinterpret_cast<u64>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}

__device__ __forceinline__ void tma_store_4d(const TensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 :: "l"(reinterpret_cast<u64>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}

__device__ __forceinline__ void tma_store_5d(const TensorMap* map, const void* src, int c0, int c1, int c2, int c3,
                                             int c4) {
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];"
                 :: "l"(reinterpret_cast<u64>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(c4)
                 : "memory");
}

// gdst[0 .. bytes/4) += ssrc[...] (f32) by the copy engine: one instruction per row instead of
// bytes/8 lane reductions.  bytes a multiple of 16, both addresses 16-byte aligned; a bulk-group
// operation like the stores (commit, then bulk_wait_read before the source is rewritten).
__device__ __forceinline__ void bulk_reduce_add_f32(float* gdst, const float* ssrc, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(gdst), "r"(smem_u32(ssrc)), "r"(bytes) : "memory");
}

// Bulk groups (TMA stores and bulk reductions issued by this thread): close the open group...
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// ...wait until at most N committed groups are still reading their shared memory...
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}

// ...or until at most N committed groups are incomplete (their global writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}

// Plain 1-D bulk copy global -> shared (no tensor map): `bytes` a multiple of 16, both addresses
// 16-byte aligned; completes on `bar` like a TMA load.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

// Ordinary shared-memory writes (st.shared, stmatrix) are in the generic proxy; TMA stores and
// wgmma read through the async proxy.  Each writing thread fences before the barrier that hands
// the data over.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- warpgroups -----------------------------------------------------------------------------
// setmaxnreg moves registers between warpgroups of one CTA; it takes effect only when the kernel
// has a register cap at entry (__launch_bounds__(threads, 1)) and every warp of a warpgroup
// executes the same call (ptxas warning C7508 says when it was ignored).

template <int R>
__device__ __forceinline__ void reg_alloc() {
    static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(R));
}

template <int R>
__device__ __forceinline__ void reg_dealloc() {
    static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(R));
}

// Named barriers 1..15 (0 is __syncthreads); nthreads is a multiple of 32.
__device__ __forceinline__ void named_bar_sync(int id, int nthreads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(nthreads) : "memory");
}

__device__ __forceinline__ void named_bar_arrive(int id, int nthreads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(nthreads) : "memory");
}

__device__ __forceinline__ int warpgroup_index() {
    return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);   // uniform, so branches stay convergent
}

// ---- clusters -------------------------------------------------------------------------------

__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ u32 cluster_nctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

// The same arrive without .aligned: for a thread whose warp's lanes may reach it apart (matmul_sm90's
// producer warp, whose thread 0 may still be issuing loads).
__device__ __forceinline__ void cluster_arrive_unaligned() {
    asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}

// An arrival that orders none of this thread's memory operations: for a barrier that only says "done
// reading the other CTAs' shared memory" (those loads have returned: their values were used before it),
// without the release's wait for this thread's outstanding global stores.
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}

// Read a float / write a float at the same shared offset in CTA `cta_rank` of the cluster
// (distributed shared memory).  Order with cluster_sync() around the exchange.
__device__ __forceinline__ float ld_shared_cluster(const float* p, u32 cta_rank) {
    float v;
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %1, %2;\n"
                 "ld.shared::cluster.f32 %0, [remote];\n}" : "=f"(v) : "r"(smem_u32(p)), "r"(cta_rank) : "memory");
    return v;
}

__device__ __forceinline__ float4 ld_shared_cluster4(const float* p, u32 cta_rank) {   // p: 16-byte aligned
    float4 v;
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %4, %5;\n"
                 "ld.shared::cluster.v4.f32 { %0, %1, %2, %3 }, [remote];\n}"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(smem_u32(p)), "r"(cta_rank) : "memory");
    return v;
}

__device__ __forceinline__ void st_shared_cluster(float* p, u32 cta_rank, float v) {
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "st.shared::cluster.f32 [remote], %2;\n}" :: "r"(smem_u32(p)), "r"(cta_rank), "f"(v) : "memory");
}

// ---- wgmma ----------------------------------------------------------------------------------

enum Swizzle : int { SW_NONE = 0, SW_128B = 1, SW_64B = 2, SW_32B = 3 };

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading-
// and stride-dimension byte offsets (all in 16-byte units, 14 bits each), layout type in bits
// 62-63.  For the K-major, 128-byte-swizzled tiles TMA writes with CU_TENSOR_MAP_SWIZZLE_128B
// (rows of 64 16-bit elements, tile base 1024-byte aligned): lbo is unused (pass 16), sbo = 1024
// (the distance between 8-row core-matrix groups), and the k-th 16-wide K slice starts 32*k bytes
// into the row: desc_add(desc, 32 * k).
__device__ __forceinline__ u64 make_desc(const void* smem, Swizzle sw, u32 lbo_bytes, u32 sbo_bytes) {
    u64 d = 0;
    d |= static_cast<u64>((smem_u32(smem) & 0x3FFFF) >> 4);
    d |= static_cast<u64>((lbo_bytes >> 4) & 0x3FFF) << 16;
    d |= static_cast<u64>((sbo_bytes >> 4) & 0x3FFF) << 32;
    d |= static_cast<u64>(sw) << 62;
    return d;
}

// Advance the start-address field by byte_offset (a multiple of 16), e.g. to the next K slice.
__device__ __forceinline__ u64 desc_add(u64 desc, u32 byte_offset) {
    return desc + static_cast<u64>(byte_offset >> 4);
}

// Order register accesses to wgmma operands against in-flight wgmmas: wgmma_fence() before the
// first wgmma that reads/writes registers last touched by ordinary instructions.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Wait until at most N committed wgmma groups are pending; accumulators of finished groups are
// then safe to read.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Keeps the compiler from moving reads/writes of an accumulator array across a wgmma issue or
// wait (the asm statements above cannot name every register they touch asynchronously).
template <int M>
__device__ __forceinline__ void fence_operand(float (&d)[M]) {
#pragma unroll
    for (int i = 0; i < M; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

template <int M>
__device__ __forceinline__ void fence_operand(unsigned (&r)[M]) {
#pragma unroll
    for (int i = 0; i < M; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}

template <typename T> struct WgmmaType;
template <> struct WgmmaType<__nv_bfloat16> { static constexpr bool bf16 = true; };
template <> struct WgmmaType<__half> { static constexpr bool bf16 = false; };

// D (64 x N, f32, held by the warpgroup) = A (64 x 16) * B (16 x N) [+ D when accumulate].
// Both operands in shared memory.  TransA / TransB: 0 = K-major (K contiguous), 1 = M/N-major.
// Fragment of D per thread (warp w of the warpgroup, lane l): d[4j + {0, 1}] is row 16w + l/4,
// columns 8j + 2(l%4) + {0, 1}; d[4j + {2, 3}] is the same 8 rows further down.
template <int N, typename T, int TransA = 0, int TransB = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], u64 desc_a, u64 desc_b, bool accumulate) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma N is a multiple of 8 in [8, 256]");
    detail::Wgmma<N>::template ss<WgmmaType<T>::bf16, TransA, TransB>(d, desc_a, desc_b, accumulate ? 1 : 0);
}

// As wgmma_ss with A from registers: a[0..3] hold bf16x2/f16x2 pairs in the mma.sync m16n8k16 A
// layout for the warp's 16 rows (a[0]: row l/4, k 2(l%4)+{0,1}; a[1]: row +8; a[2]: k +8;
// a[3]: both) -- which is exactly how two adjacent 8-column blocks of a D fragment pack.
template <int N, typename T, int TransB = 0>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const u32 (&a)[4], u64 desc_b, bool accumulate) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma N is a multiple of 8 in [8, 256]");
    detail::Wgmma<N>::template rs<WgmmaType<T>::bf16, TransB>(d, a, desc_b, accumulate ? 1 : 0);
}

}  // namespace sm90
}  // namespace rtk
