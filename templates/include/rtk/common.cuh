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

}  // namespace rtk
