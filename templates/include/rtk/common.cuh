// Shared device helpers: type conversion and 16-byte vector access.
// Plain CUDA C++ (no Jinja), included by templates as "rtk/common.cuh".
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace rtk {

// Programmatic dependent launch (sm_90+): rtkernels launches a kernel whose body begins with this
// call with the programmatic-stream-serialization attribute (rtkernels/pdl.py, PdlFunction),
// which lets the driver start its blocks without the full gap after the kernel before it in the
// stream (H200, 2026-11-27: the next kernel's blocks entered 0.64-0.67 us after the previous one's
// last block ended, against 1.66-1.82 us without; tools/launch_gap_probe.py).  The wait returns
// once every kernel the stream ran before has completed and its memory is visible, so it must come
// before the kernel's first global load or store: the launcher applies the attribute only to
// kernels whose body starts with it (Kernel.pdl).  Without the attribute, and before sm_90, it is
// a no-op.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the driver start the kernel after this one in the stream (PDL) before this one ends: its
// blocks become resident and sit in their own grid_dependency_wait(), which still returns only
// once this kernel has completed.  rtkernels calls it only in the GEMV's x conversion
// (templates/quant_gemv.cu.j2), right after that kernel's own wait.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <typename T> __device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x) { return static_cast<T>(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// N elements of T moved as one access of sizeof(T)*N bytes (N*sizeof(T) in {2,4,8,16}).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* __restrict__ p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const Vec<T, N>& v) {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// Streaming variants: data touched once should not evict what the next kernel reuses.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec_stream(const T* __restrict__ p) {
    static_assert(sizeof(Vec<T, N>) == 16, "streaming loads are 16-byte");
    int4 r = __ldcs(reinterpret_cast<const int4*>(p));
    return *reinterpret_cast<Vec<T, N>*>(&r);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec_stream(T* __restrict__ p, const Vec<T, N>& v) {
    static_assert(sizeof(Vec<T, N>) == 16, "streaming stores are 16-byte");
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
}

__device__ __forceinline__ unsigned ceil_div(unsigned a, unsigned b) { return (a + b - 1) / b; }

// ---- signalling between blocks at GPU scope (split merges, group barriers) ----
// The PTX memory model's release and acquire patterns: a block's global stores, ordered before its
// thread 0 by a __syncthreads (bar.sync), are visible to every thread that acquires a value thread 0
// released after it - thread 0's release is cumulative - and a block whose thread 0 acquired sees
// them after its own __syncthreads (the pattern of CUTLASS's split-K semaphores).  __threadfence()
// in every thread instead is fence.sc.gpu: MEMBAR.SC.GPU and an L1 invalidate (CCTL.IVALL) per
// warp in SASS, on the critical path of every merge.  Measured (H100, 2026-11-27, the decode
// merges, whole calls): B1 S32k seqlen_q 1 (the last CTA of 16) 54.9 -> 54.5 us; seqlen_q 8 / 16
// (the group barrier, with its count out below) 58.1 -> 56.0-56.6 / 59.0 -> 57.5-58.3 us.
__device__ __forceinline__ int atom_add_acq_rel_gpu(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Release increment: every write this thread (and, through a preceding barrier, its warp or
// block) made before is visible to a thread that acquires the new value.
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}

// Whether this block is the last of `count` to arrive on `counter` (true or false in every thread of
// the block; every thread calls it, after its last global store the others must see).  The last
// block sees every other block's stores and zeroes the counter, so it reads zero between launches
// (CUDA-graph replays included, as the stream workspace's users expect: ops/workspace.py).  `flag`:
// one int of shared memory the block may overwrite.
__device__ __forceinline__ bool last_block_to_arrive(int* counter, int count, int* flag) {
    __syncthreads();   // the block's stores before thread 0's release; and `flag` is free
    if (threadIdx.x == 0) {
        const bool last = atom_add_acq_rel_gpu(counter, 1) == count - 1;
        if (last) atomicExch(counter, 0);   // every block has arrived: ready for the next launch
        *flag = last;
    }
    __syncthreads();
    return *flag != 0;
}

// A barrier over `count` blocks that share the counter pair `counters` ([0] in, [1] out), for
// cooperative launches only: every block resident at once (a block waiting for one that is not
// yet scheduled would wait forever, which is why the host launches through
// cuLaunchCooperativeKernel and the driver refuses grids that do not fit).  After it every thread
// of the block sees the global stores every block made before it (release / acquire above).  The
// pair reads zero between launches: counters[1] wraps to zero at the last block out, which zeroes
// counters[0] (every block has seen it complete by then).  Thread 0 leaves counting out without
// waiting for the answer: the block goes on, and group_barrier_done (every thread calls it once the
// block no longer needs the barrier, e.g. at its end) reads it - one L2 round trip off the
// critical path.  group_barrier: both at once.
// flag_wait is the pair one way: the `producers` blocks that pass producer = true release their
// global stores, and each of the `count` blocks (producers among them) waits for all of them; the
// pair reads zero between launches as above (group_barrier_done with `count`).  It needs no
// cooperative launch where every producer can become resident while the others wait (e.g. the
// producers have the lowest block indices, which the block scheduler dispatches first).
__device__ __forceinline__ int flag_wait(int* counters, int producers, int count, bool producer) {
    __syncthreads();   // the block's stores before thread 0's release
    int ticket = 0;
    if (threadIdx.x == 0) {
        if (producer) red_release_gpu_add(counters, 1);
        while (ld_acquire_gpu(counters) < producers) __nanosleep(32);
        // atom.inc wraps to 0 past count - 1: the last block out zeroes counters[1] itself.  Its
        // answer is read in group_barrier_done (an atomicAdd of 1 is warp-aggregated by ptxas,
        // which shuffles the answer out - waiting for it - before the barrier)
        asm volatile("atom.relaxed.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(ticket) : "l"(counters + 1), "r"(count - 1)
                     : "memory");
    }
    __syncthreads();
    return ticket;
}

__device__ __forceinline__ int group_barrier_wait(int* counters, int count) {
    return flag_wait(counters, count, count, true);
}

__device__ __forceinline__ void group_barrier_done(int* counters, int count, int ticket) {
    if (threadIdx.x == 0 && ticket == count - 1) atomicExch(counters, 0);   // the last block out
}

__device__ __forceinline__ void group_barrier(int* counters, int count) {
    group_barrier_done(counters, count, group_barrier_wait(counters, count));
}

}  // namespace rtk
