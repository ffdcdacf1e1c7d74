// Shared device helpers: type conversion and 16-byte vector access.
// Plain CUDA C++ (no Jinja), included by templates as "rtk/common.cuh".
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace rtk {

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

// A barrier over `count` blocks that share the counter pair `counters` ([0] in, [1] out), for
// cooperative launches only: every block resident at once (a block waiting for one that is not
// yet scheduled would wait forever, which is why the host launches through
// cuLaunchCooperativeKernel and the driver refuses grids that do not fit).  The last block out
// zeroes both counters (every block has seen counters[0] complete by then), so they read zero
// between launches - CUDA-graph replays included, as the stream workspace's users expect
// (ops/workspace.py).  Each thread fences its own global stores before its block counts in;
// thread 0 waits and the block waits on thread 0.  Every thread of the block calls it.
__device__ __forceinline__ void group_barrier(int* counters, int count) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(counters) : "memory");
        int in;
        while (true) {
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(in) : "l"(counters) : "memory");
            if (in >= count) break;
            __nanosleep(64);
        }
        if (atomicAdd(counters + 1, 1) == count - 1) {   // the last block out
            atomicExch(counters, 0);
            atomicExch(counters + 1, 0);
        }
        __threadfence();
    }
    __syncthreads();
}

}  // namespace rtk
