// Row reductions for the memory-bound families (softmax, norms, reduce).
// Plain CUDA C++ (no Jinja), included as "rtk/reduce.cuh" after "rtk/common.cuh".
//
// A row is owned by a *team*: a group of 1..32 lanes of one warp (several rows per block), a
// whole block, or (sm_90) a cluster of blocks.  Every kernel loops over rows with a RowTeam and
// reduces a per-thread state once per row with team.reduce(state, op).
//
// Every combine below is exactly commutative (the same bits for op(a, b) and op(b, a)), so the
// xor butterflies leave the identical result in every lane and every block of a cluster: all
// threads of a row normalize with the same statistics, and results do not depend on scheduling.
#pragma once
#include "rtk/common.cuh"
#include "rtk/gemm.cuh"   // cp.async (ring_rows)
#include "rtk/sm90.cuh"   // cluster barriers, mbarriers, bulk copies (sm_90 variants only)

namespace rtk {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000u); }

// exp(x) as FMUL + MUFU.EX2.  __expf without -ftz adds a compare and two multiplies per call to
// keep denormal results; at 5+ elements per clock per SM that alone makes softmax issue-bound.
// Results below 2^-126 flush to 0.  Relative error ~2 ulp plus |x| * 2^-24 from rounding x*log2(e).
__device__ __forceinline__ float exp_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
}

// 1/x as one MUFU.RCP (~1 ulp): IEEE division and __frcp_rn bring a slow-path branch.
__device__ __forceinline__ float rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- cached / streaming vector access of 2..16 bytes -------------------------------------
// kStream: evict-first (ld/st.global.cs) for data touched once, so it does not push out what is
// reused (the weights, or the row a two-pass kernel reads again).
template <typename T, int N, bool kStream>
__device__ __forceinline__ Vec<T, N> load(const T* __restrict__ p) {
    constexpr int kBytes = int(sizeof(T)) * N;
    static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16, "2..16-byte vectors");
    Vec<T, N> r;
    if constexpr (kBytes == 16) {
        const int4* q = reinterpret_cast<const int4*>(p);
        *reinterpret_cast<int4*>(&r) = kStream ? __ldcs(q) : *q;
    } else if constexpr (kBytes == 8) {
        const int2* q = reinterpret_cast<const int2*>(p);
        *reinterpret_cast<int2*>(&r) = kStream ? __ldcs(q) : *q;
    } else if constexpr (kBytes == 4) {
        const unsigned* q = reinterpret_cast<const unsigned*>(p);
        *reinterpret_cast<unsigned*>(&r) = kStream ? __ldcs(q) : *q;
    } else {
        const unsigned short* q = reinterpret_cast<const unsigned short*>(p);
        *reinterpret_cast<unsigned short*>(&r) = kStream ? __ldcs(q) : *q;
    }
    return r;
}

template <typename T, int N>
__device__ __forceinline__ void store_cs(T* __restrict__ p, const Vec<T, N>& v) {
    constexpr int kBytes = int(sizeof(T)) * N;
    static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16, "2..16-byte vectors");
    if constexpr (kBytes == 16) __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
    else if constexpr (kBytes == 8) __stcs(reinterpret_cast<int2*>(p), *reinterpret_cast<const int2*>(&v));
    else if constexpr (kBytes == 4) __stcs(reinterpret_cast<unsigned*>(p), *reinterpret_cast<const unsigned*>(&v));
    else __stcs(reinterpret_cast<unsigned short*>(p), *reinterpret_cast<const unsigned short*>(&v));
}

// kStream: evict-first (st.global.cs); otherwise a plain store.  kOffset: p is offset from an
// aligned pointer by a runtime element count (ragged rows' head), through which nvcc split the
// plain store's struct copy into 2- or 4-byte stores: one st.global.v4 instead (16-byte vectors).
template <typename T, int N, bool kStream, bool kOffset = false>
__device__ __forceinline__ void store_y(T* __restrict__ p, const Vec<T, N>& v) {
    if constexpr (kStream) {
        store_cs<T, N>(p, v);
    } else if constexpr (kOffset && sizeof(T) * N == 16) {
        const int4 w = *reinterpret_cast<const int4*>(&v);
        asm("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w));
    } else {
        *reinterpret_cast<Vec<T, N>*>(p) = v;
    }
}

// The N elements of a loaded vector as floats; `fill` for a slot past the row end (one select
// per element, cheaper than pre-filling the 16-bit lanes of the load's registers).
template <typename T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& v, float (&f)[N], bool ok = true, float fill = 0.f) {
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = ok ? to_float(v.v[k]) : fill;
}
// bfloat16 is the top half of a float: one shift or mask per element of a packed pair, where the
// generic path extracts (PRMT) and then shifts.
template <int N>
__device__ __forceinline__ void to_floats(const Vec<__nv_bfloat16, N>& v, float (&f)[N], bool ok = true,
                                          float fill = 0.f) {
    if constexpr (N % 2 == 0) {
        const unsigned* w = reinterpret_cast<const unsigned*>(&v);
#pragma unroll
        for (int k = 0; k < N / 2; ++k) {
            f[2 * k] = ok ? __uint_as_float(w[k] << 16) : fill;
            f[2 * k + 1] = ok ? __uint_as_float(w[k] & 0xffff0000u) : fill;
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) f[k] = ok ? to_float(v.v[k]) : fill;
    }
}

// N elements of a read-only array reused by every row (norm weights), raw.  Loaded in pieces of
// at most 16 bytes so a float32 weight beside 8-element 16-bit vectors works too.
template <typename W, int N>
__device__ __forceinline__ Vec<W, N> load_params(const W* __restrict__ p) {
    constexpr int kPiece = (int(sizeof(W)) * N > 16) ? 16 / int(sizeof(W)) : N;
    static_assert(N % kPiece == 0, "vector of parameters splits into 16-byte pieces");
    Vec<W, N> r;
#pragma unroll
    for (int q = 0; q < N / kPiece; ++q) {
        const Vec<W, kPiece> v = load<W, kPiece, false>(p + q * kPiece);
#pragma unroll
        for (int k = 0; k < kPiece; ++k) r.v[q * kPiece + k] = v.v[k];
    }
    return r;
}

// Makes the compiler forget what it knows about v's bits (an empty asm that "rewrites" each
// 32-bit word in place).  Without it, ptxas keeps the float32 conversions of a packed 16-bit row
// from the statistics pass alive until the write pass (common subexpressions), which doubles the
// registers a resident row takes (seen: 80 instead of 64 per thread, and spills at 1024 threads).
template <typename T, int N>
__device__ __forceinline__ void forget(Vec<T, N>& v) {
    static_assert(sizeof(Vec<T, N>) % 4 == 0 || sizeof(Vec<T, N>) == 2, "whole 32-bit words (or one 16-bit value)");
    if constexpr (sizeof(Vec<T, N>) == 2) {
        unsigned short* w = reinterpret_cast<unsigned short*>(&v);
        asm volatile("" : "+h"(*w));
    } else {
        unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
        for (int k = 0; k < int(sizeof(Vec<T, N>) / 4); ++k) asm volatile("" : "+r"(w[k]));
    }
}

// ---- reduction states and their combines ---------------------------------------------
__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ int shfl_xor(int v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

struct SumOp {
    __device__ float operator()(float a, float b) const { return a + b; }
};
// max/min propagate NaN like NumPy: a row holding a NaN reduces to NaN.
struct MaxOp {
    __device__ float operator()(float a, float b) const { return (a != a || a > b) ? a : b; }
};
struct MinOp {
    __device__ float operator()(float a, float b) const { return (a != a || a < b) ? a : b; }
};

// Online softmax: running maximum m and sum s of exp(x - m) over the elements seen so far.
// m == -inf means "no finite element yet" and then s == 0.
struct MaxSum {
    float m, s;
};
__device__ __forceinline__ MaxSum shfl_xor(MaxSum v, int mask) {
    return {shfl_xor(v.m, mask), shfl_xor(v.s, mask)};
}
struct MaxSumOp {
    __device__ MaxSum operator()(MaxSum a, MaxSum b) const {
        const float m = fmaxf(a.m, b.m);
        if (m == neg_inf()) return {m, 0.f};  // exp(-inf - -inf) would be NaN
        return {m, a.s * exp_ftz(a.m - m) + b.s * exp_ftz(b.m - m)};
    }
};

// Mean and sum of squared deviations of n elements (Chan et al. pairwise update), written in the
// symmetric form (na*ma + nb*mb)/n so that combine(a, b) == combine(b, a) bit for bit.
struct MeanM2 {
    float n, mean, m2;
};
__device__ __forceinline__ MeanM2 shfl_xor(MeanM2 v, int mask) {
    return {shfl_xor(v.n, mask), shfl_xor(v.mean, mask), shfl_xor(v.m2, mask)};
}
struct MeanM2Op {
    __device__ MeanM2 operator()(MeanM2 a, MeanM2 b) const {
        const float n = a.n + b.n;
        const float inv_n = n > 0.f ? rcp_approx(n) : 0.f;  // two empty states give {0, 0, 0}
        const float d = b.mean - a.mean;
        return {n, (a.n * a.mean + b.n * b.mean) * inv_n, a.m2 + b.m2 + d * d * (a.n * b.n * inv_n)};
    }
};

// argmax: larger value wins, NaN beats everything (like NumPy), ties go to the smaller index.
// That is a total order, so the result is the first occurrence whatever the reduction order.
struct ValIdx {
    float v;
    int i;
};
__device__ __forceinline__ ValIdx shfl_xor(ValIdx v, int mask) {
    return {shfl_xor(v.v, mask), shfl_xor(v.i, mask)};
}
struct ArgMaxOp {
    __device__ ValIdx operator()(ValIdx a, ValIdx b) const {
        const bool an = a.v != a.v, bn = b.v != b.v;
        bool take_a;
        if (an || bn) take_a = an && (!bn || a.i < b.i);
        else take_a = a.v > b.v || (a.v == b.v && a.i < b.i);
        return take_a ? a : b;
    }
};

// ---- team reductions ------------------------------------------------------------------
// Butterfly over aligned groups of kWidth lanes; every lane of the warp must take part.
template <int kWidth, typename S, typename Op>
__device__ __forceinline__ S group_reduce(S v, Op op) {
    static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "power of two <= 32");
#pragma unroll
    for (int mask = kWidth / 2; mask >= 1; mask /= 2) v = op(v, shfl_xor(v, mask));
    return v;
}

// Warp butterflies, one __syncthreads, then every warp reduces the kWarps partials itself (each
// group of kWarps lanes holds all of them), so no second barrier is needed to broadcast.
template <int kWarps, typename S, typename Op>
__device__ __forceinline__ S block_reduce(S v, Op op, S* smem) {
    v = group_reduce<32>(v, op);
    if constexpr (kWarps == 1) {
        return v;
    } else {
        const int lane = threadIdx.x & 31;
        if (lane == 0) smem[threadIdx.x >> 5] = v;
        __syncthreads();
        return group_reduce<kWarps>(smem[lane & (kWarps - 1)], op);
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// A 4-byte-word copy of S from the shared memory of block `rank` of this cluster (DSMEM).
template <typename S>
__device__ __forceinline__ S load_peer(const S* local, unsigned rank) {
    static_assert(sizeof(S) % 4 == 0, "states are made of 4-byte fields");
    unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(local)), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    S r;
    unsigned* w = reinterpret_cast<unsigned*>(&r);
#pragma unroll
    for (int k = 0; k < int(sizeof(S) / 4); ++k)
        asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(w[k]) : "r"(remote + 4u * k) : "memory");
    return r;
}
#endif

// ---- rows staged through shared memory -----------------------------------------------
// A resident row is computed from registers, but its loads need not be: each variant below keeps
// the next rows' bytes in flight in shared memory, so the SM keeps requesting while its threads
// sit in the reduction barrier or write (the register-only path has nothing in flight then).
// Both use the register layout of the direct loads: slot i of a thread is vector i * kThreads +
// rank of the row.  In shared memory slot q of thread t is the 16 bytes at (q * kBlock + t) * 16:
// a warp touches 512 consecutive bytes (no bank conflicts).
__device__ __forceinline__ int4 lds16(unsigned addr) {
    int4 r;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr) : "memory");
    return r;
}

// The staged sources keep only their ring position: the rows they load are passed in (`RowSpan`
// built from kernel parameters, which ptxas re-reads from the constant bank instead of holding
// them in registers for the whole loop - 64 registers per thread leave no room for copies).
template <typename T>
struct RowSpan {
    const T* x;             // the array
    long long rows, step, stride;
    int rank, nvec;         // this thread's first vector in a row; vectors per row
};

// Per-thread ring (ring_rows = kRingRows): the thread copies its own slots of its next rows with
// cp.async (16 bytes each, one commit group per row) and reads back only what it copied itself,
// so no barrier guards the ring.  kRingRows rows stay in flight: once this row's vectors are in
// registers, their slots are refilled with the row kRingRows further along the thread's rows.
template <typename T, int kVec, int kVecs, int kThreads, int kBlock, int kRingRows>
struct RingRows {
    static_assert(kRingRows == 0 || int(sizeof(T)) * kVec == 16, "the ring moves 16-byte vectors");
    using V = Vec<T, kVec>;
    static constexpr unsigned kSlotStride = 16u * kBlock;   // bytes between a thread's slots
    unsigned base;          // this thread's slot 0
    int stage = 0;

    __device__ __forceinline__ explicit RingRows(void* smem) : base(sm90::smem_u32(smem) + 16u * threadIdx.x) {}

    __device__ __forceinline__ void issue(int s, const RowSpan<T>& span, long long r) {
        const T* p = span.x + r * span.stride + (long long)span.rank * kVec;
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
            const bool ok = r < span.rows && i * kThreads < span.nvec - span.rank;
            // a copy with ok == false reads nothing and writes zeros
            cp_async_16_s(base + unsigned(s * kVecs + i) * kSlotStride, ok ? p + i * kThreads * kVec : span.x, ok ? 16 : 0);
        }
        cp_async_commit();
    }
    __device__ __forceinline__ void start(const RowSpan<T>& span, long long first_row) {
#pragma unroll
        for (int s = 0; s < kRingRows; ++s) issue(s, span, first_row + s * span.step);
    }
    // Row `row`'s vectors into raw; their slots refilled at once with row + kRingRows * step.
    __device__ __forceinline__ void acquire(V (&raw)[kVecs], const RowSpan<T>& span, long long row) {
        cp_async_wait<kRingRows - 1>();
        const unsigned at = base + unsigned(stage * kVecs) * kSlotStride;
#pragma unroll
        for (int i = 0; i < kVecs; ++i) *reinterpret_cast<int4*>(&raw[i]) = lds16(at + unsigned(i) * kSlotStride);
        // The refill overwrites the slots just read: wait until the reads have returned (an asm
        // that consumes the registers), since cp.async is not ordered after this thread's loads.
#pragma unroll
        for (int i = 0; i < kVecs; ++i) forget(raw[i]);
        issue(stage, span, row + kRingRows * span.step);
        stage = stage + 1 < kRingRows ? stage + 1 : 0;
    }
    __device__ __forceinline__ void release(const RowSpan<T>&, long long) {}
    // The zero-filled copies past the last row are still in flight: land them before the block
    // exits and its shared memory goes to the next block.
    __device__ __forceinline__ void finish() { cp_async_wait<0>(); }
};

// Per-block bulk stages (bulk_stages = kStages, sm_90, block or cluster rows): stage s holds the
// block's part of one row as kVecs segments of kBlock vectors, each one cp.async.bulk completing
// on the stage's mbarrier.  Thread 0 refills a stage with the row kStages further on once every
// thread has its vectors in registers - after the row's reduction barrier (release()).
template <typename T, int kVec, int kVecs, int kThreads, int kBlock, int kStages>
struct BulkRows {
    static_assert(kStages == 0 || int(sizeof(T)) * kVec == 16, "bulk stages hold 16-byte vectors");
    static_assert(kStages == 0 || kBlock >= 64, "release() relies on the reduction's block barrier");
    using V = Vec<T, kVec>;
    static constexpr unsigned kSegment = 16u * kBlock;   // bytes of one slot across the block
    unsigned char* smem;    // stage 0
    unsigned base;          // its shared-window address, for the 16-byte loads
    unsigned long long* bars;   // kStages mbarriers
    int stage = 0;
    unsigned parity = 0;

    __device__ __forceinline__ BulkRows(void* smem_, unsigned long long* bars_)
        : smem(static_cast<unsigned char*>(smem_)), base(sm90::smem_u32(smem_)), bars(bars_) {}

    __device__ __forceinline__ void issue(int s, const RowSpan<T>& span, long long r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (r >= span.rows) return;
        const int first = span.rank - int(threadIdx.x);   // the block's first vector in a row
        const int block_vecs = span.nvec - first;
        const T* p = span.x + r * span.stride + (long long)first * kVec;
        unsigned total = 0;
#pragma unroll
        for (int i = 0; i < kVecs; ++i) total += 16u * unsigned(min(kBlock, max(0, block_vecs - i * kThreads)));
        sm90::mbar_arrive_expect_tx(&bars[s], total);
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
            const int v = min(kBlock, max(0, block_vecs - i * kThreads));
            if (v > 0) sm90::bulk_load(smem + unsigned(s * kVecs + i) * kSegment, p + i * kThreads * kVec, 16u * v, &bars[s]);
        }
#endif
    }
    __device__ __forceinline__ void start(const RowSpan<T>& span, long long first_row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (threadIdx.x == 0) {
#pragma unroll
            for (int s = 0; s < kStages; ++s) sm90::mbar_init(&bars[s], 1);
            sm90::mbar_init_fence();
            sm90::fence_proxy_async();
        }
        __syncthreads();
        if (threadIdx.x == 0) {
#pragma unroll
            for (int s = 0; s < kStages; ++s) issue(s, span, first_row + s * span.step);
        }
#endif
    }
    __device__ __forceinline__ void acquire(V (&raw)[kVecs], const RowSpan<T>&, long long) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        sm90::mbar_wait(&bars[stage], parity);
        const unsigned at = base + unsigned(stage * kVecs) * kSegment + 16u * threadIdx.x;
#pragma unroll
        for (int i = 0; i < kVecs; ++i) *reinterpret_cast<int4*>(&raw[i]) = lds16(at + unsigned(i) * kSegment);
#endif
    }
    // Call after a barrier that every thread reaches once its acquire()d registers are in use.
    __device__ __forceinline__ void release(const RowSpan<T>& span, long long row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (threadIdx.x == 0) {
            // The stage was read through the generic proxy; the refill writes through the async one.
            sm90::fence_proxy_async();
            issue(stage, span, row + kStages * span.step);
        }
        if (++stage == kStages) {
            stage = 0;
            parity ^= 1u;
        }
#endif
    }
    __device__ __forceinline__ void finish() {}   // only rows this block consumes were copied
};

// The threads that own one row, and the loop over rows.
//   kThreadsPerRow <= 32: a group of lanes; kBlock / kThreadsPerRow rows per block (kCluster == 1).
//   kThreadsPerRow == kBlock: the block owns the row, or with kCluster > 1 (sm_90, kernel declared
//   __cluster_dims__(kCluster,1,1)) a cluster of kCluster blocks owns it, reduced through DSMEM.
// Protocol: per row iteration call reduce() exactly once, then end_row().  Loops run over
// `row_base` uniformly for the whole block, so every lane reaches every shuffle and barrier.
template <int kThreadsPerRow, int kBlock, int kCluster>
struct RowTeam {
    static_assert(kBlock >= 32 && kBlock <= 1024 && (kBlock & (kBlock - 1)) == 0, "block of 32..1024 threads");
    static_assert(kThreadsPerRow <= 32 || kThreadsPerRow == kBlock, "a row is a lane group or a whole block");
    static_assert(kCluster == 1 || (kThreadsPerRow == kBlock && kCluster <= 8), "clusters of 2..8 whole blocks");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(kCluster == 1, "cluster_size > 1 needs sm_90 or newer");
#endif
    static constexpr int kRowsPerBlock = kBlock / kThreadsPerRow;
    static constexpr int kThreads = kThreadsPerRow * kCluster;  // threads sharing one row
    static constexpr int kWarps = kBlock / 32;

    int rank;       // this thread's index among the kThreads threads of its row
    int local_row;  // which of the block's kRowsPerBlock rows
    int parity = 0;

    __device__ __forceinline__ RowTeam() {
        unsigned block_rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if constexpr (kCluster > 1) block_rank = sm90::cluster_ctarank();
#endif
        rank = int(block_rank) * kBlock + int(threadIdx.x % kThreadsPerRow);
        local_row = int(threadIdx.x / kThreadsPerRow);
    }
    // First row of this block (or cluster) and the distance to its next one.
    __device__ __forceinline__ long long first_row() const {
        return (long long)(blockIdx.x / kCluster) * kRowsPerBlock;
    }
    __device__ __forceinline__ long long row_step() const {
        return (long long)(gridDim.x / kCluster) * kRowsPerBlock;
    }

    template <typename S, typename Op>
    __device__ __forceinline__ S reduce(S v, Op op) {
        if constexpr (kThreadsPerRow <= 32) {
            return group_reduce<kThreadsPerRow>(v, op);
        } else {
            // Two buffers: a warp that races ahead into the next row's reduce writes the other one.
            __shared__ S partials[2][kWarps];
            v = block_reduce<kWarps>(v, op, partials[parity]);
            parity ^= 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            if constexpr (kCluster > 1) {
                __shared__ S block_total;
                if (threadIdx.x == 0) block_total = v;
                sm90::cluster_arrive();
                sm90::cluster_wait();
                v = group_reduce<kCluster>(load_peer(&block_total, unsigned(threadIdx.x & (kCluster - 1))), op);
                // Done reading the peers; the matching wait in end_row() keeps every block's
                // block_total alive (and unchanged) until the whole cluster has read it.
                sm90::cluster_arrive();
            }
#endif
            return v;
        }
    }

    __device__ __forceinline__ void end_row() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if constexpr (kCluster > 1) sm90::cluster_wait();
#endif
    }
};

// ---- cluster rows without cluster barriers (cluster_push) -------------------------------------
// RowTeam's cluster exchange takes two barrier.cluster rounds per row; a barrier's .release
// arrive also waits until this thread's earlier global stores (the previous row's y) are
// performed.  PushRowTeam instead sends each block's total to every block of the cluster with
// st.async, which completes bytes on the receiver's mbarrier: a block waits only for the
// kCluster totals of the row it is on, and nothing orders its stores.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

// The 4-byte word v to the shared address `dst` (this CTA's offset) of CTA `rank`, completing 4
// bytes on the mbarrier at offset `bar` of that CTA.
__device__ __forceinline__ void push_word(unsigned dst, unsigned bar, unsigned rank, unsigned v) {
    asm volatile("{\n.reg .b32 rd, rb;\n"
                 "mapa.shared::cluster.u32 rd, %0, %2;\n"
                 "mapa.shared::cluster.u32 rb, %1, %2;\n"
                 "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [rd], %3, [rb];\n}"
                 :: "r"(dst), "r"(bar), "r"(rank), "r"(v) : "memory");
}

// Wait for phase `phase` of a barrier whose bytes other CTAs of the cluster deliver.
__device__ __forceinline__ void mbar_wait_cluster(unsigned long long* bar, unsigned phase) {
    asm volatile("{\n.reg .pred p;\nRTK_MBAR_WAIT_CL:\n"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra RTK_MBAR_WAIT_CL;\n}" :: "r"(sm90::smem_u32(bar)), "r"(phase) : "memory");
}
#endif

// The interface of RowTeam (a cluster of kCluster >= 2 whole blocks per row).  Per row: warp
// shuffles and one __syncthreads give the block total; threads 0..kCluster-1 push it into slot
// [own rank] of every block (itself included); each block waits on its own mbarrier for the
// kCluster totals and reduces them in the same order as every other block (identical bits).
// Two slot sets and barriers alternate by row: a block reaches row i + 2's push only after
// every block pushed row i + 1, which each did after reading its row-i slots.
template <int kThreadsPerRow, int kBlock, int kCluster>
struct PushRowTeam {
    static_assert(kThreadsPerRow == kBlock && kCluster >= 2 && kCluster <= 8, "clusters of 2..8 whole blocks");
    static_assert(kBlock >= 64, "the block barrier orders slot reads before the next push");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(kCluster == 1, "cluster_push needs sm_90 or newer");
#endif
    static constexpr int kRowsPerBlock = 1;
    static constexpr int kThreads = kThreadsPerRow * kCluster;
    static constexpr int kWarps = kBlock / 32;

    int rank;
    int local_row = 0;
    unsigned iter = 0;
    unsigned block_rank = 0;
    bool started = false;

    __device__ __forceinline__ static unsigned long long* bars() {
        __shared__ unsigned long long b[2];
        return b;
    }

    __device__ __forceinline__ PushRowTeam() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        block_rank = sm90::cluster_ctarank();
        if (threadIdx.x == 0) {
            sm90::mbar_init(&bars()[0], 1);
            sm90::mbar_init(&bars()[1], 1);
            sm90::mbar_init_fence();
        }
        // Peers push only after the matching wait (first reduce()): the barriers exist by then.
        cluster_arrive_relaxed();
#endif
        rank = int(block_rank) * kBlock + int(threadIdx.x);
    }
    __device__ __forceinline__ long long first_row() const { return (long long)(blockIdx.x / kCluster); }
    __device__ __forceinline__ long long row_step() const { return (long long)(gridDim.x / kCluster); }

    template <typename S, typename Op>
    __device__ __forceinline__ S reduce(S v, Op op) {
        static_assert(sizeof(S) % 4 == 0, "states are made of 4-byte fields");
        __shared__ S partials[2][kWarps];
        __shared__ S slots[2][kCluster];
        const unsigned p = iter & 1u;
        v = block_reduce<kWarps>(v, op, partials[p]);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (!started) {
            sm90::cluster_wait();
            started = true;
        }
        unsigned long long* bar = &bars()[p];
        if (threadIdx.x == 0) sm90::mbar_arrive_expect_tx(bar, unsigned(kCluster * sizeof(S)));
        if (threadIdx.x < kCluster) {
            const unsigned* w = reinterpret_cast<const unsigned*>(&v);
            const unsigned dst = sm90::smem_u32(&slots[p][block_rank]);
#pragma unroll
            for (int k = 0; k < int(sizeof(S) / 4); ++k) push_word(dst + 4u * k, sm90::smem_u32(bar), threadIdx.x, w[k]);
        }
        mbar_wait_cluster(bar, (iter >> 1) & 1u);
        v = group_reduce<kCluster>(slots[p][threadIdx.x & (kCluster - 1)], op);
#endif
        ++iter;
        return v;
    }
    __device__ __forceinline__ void end_row() {}
};

// ---- a block's slice of the row in shared memory (smem_rows, sm_90) ------------------------------
// The block owns kBlock * kVecs consecutive vectors of the row (a cluster: kCluster such slices);
// thread 0 brings them in with one bulk copy completing on an mbarrier, and the threads read them
// back as often as the op needs (slot i of thread t: vector i * kBlock + t of the slice, so a warp
// reads 512 consecutive bytes and stores y coalesced).  While the copy is in flight no register
// holds the row: the block count per SM is set by the slice's shared memory, not by registers.
template <typename T, int kVec, int kVecs, int kBlock>
struct SmemRow {
    using V = Vec<T, kVec>;
    static constexpr int kSlice = kBlock * kVecs;   // vectors per block
    unsigned char* smem;
    unsigned base;              // this thread's slot 0
    unsigned long long* bar;
    unsigned parity = 0;

    __device__ __forceinline__ SmemRow(void* smem_, unsigned long long* bar_)
        : smem(static_cast<unsigned char*>(smem_)), base(sm90::smem_u32(smem_) + 16u * threadIdx.x), bar(bar_) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (threadIdx.x == 0) {
            sm90::mbar_init(bar, 1);
            sm90::mbar_init_fence();
        }
        __syncthreads();
#endif
    }
    // Vectors [first, first + count) of the row at `row` (count may be <= 0: nothing to copy).
    // Every thread calls it; the barrier first keeps the previous row's slots until all have read them.
    __device__ __forceinline__ void load(const T* row, int first, int count) {
        // (here, not on the class: templates name the type whether or not they use it)
        static_assert(int(sizeof(T)) * kVec == 16, "the slice holds 16-byte vectors");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        __syncthreads();
        if (threadIdx.x == 0) {
            const int c = min(max(count, 0), kSlice);
            if (c > 0) {
                sm90::fence_proxy_async();   // earlier generic reads of the slots before the async write
                sm90::mbar_arrive_expect_tx(bar, 16u * unsigned(c));
                sm90::bulk_load(smem, row + (long long)first * kVec, 16u * unsigned(c), bar);
            } else {
                sm90::mbar_arrive(bar);
            }
        }
        sm90::mbar_wait(bar, parity);
        parity ^= 1u;
#endif
    }
    __device__ __forceinline__ V get(int i) const {
        V v;
        *reinterpret_cast<int4*>(&v) = lds16(base + 16u * unsigned(i * kBlock));
        return v;
    }
};

// ---- rows whose start is not 16-byte aligned (ragged rows: an odd width, a vocabulary) -----------
// Per row: the head up to the first 16-byte boundary, whole 16-byte vectors, and the tail after
// them (head + tail <= 2 * (kVec - 1) elements).  The body keeps 16-byte vectors (and bulk copies);
// the edge elements are spread over the row's kThreads threads, edge j = rank + q * kThreads in
// the thread's q-th register, loaded with the body (one lane walking them would serialize a dozen
// load latencies in front of the row's reduction).  Every array of a row must share its address
// mod 16 (the host's check), so one split serves them all.
template <typename T, int kVec, int kThreads>
struct RaggedRow {
    static constexpr int kEdges = (2 * (kVec - 1) + kThreads - 1) / kThreads;   // per thread
    int head = 0, nvec = 0, tail = 0;
    RaggedRow() = default;
    __device__ __forceinline__ RaggedRow(const T* row, int n) {
        const unsigned mis = unsigned(reinterpret_cast<unsigned long long>(row)) & 15u;
        head = min(n, int(((16u - mis) & 15u) / unsigned(sizeof(T))));
        nvec = (n - head) / kVec;
        tail = n - head - nvec * kVec;
    }
    // The row's element index of this thread's q-th edge, or -1 when it has none.
    __device__ __forceinline__ int edge(int rank, int q) const {
        const int j = rank + q * kThreads;
        return j >= head + tail ? -1 : j < head ? j : head + nvec * kVec + (j - head);
    }
};

}  // namespace rtk
