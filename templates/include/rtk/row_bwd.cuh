// Reduction states of the row backward kernels (norm_bwd, softmax_bwd) and the small helpers they
// share.  Plain CUDA C++, included as "rtk/row_bwd.cuh" after "rtk/reduce.cuh".
//
// As in reduce.cuh every combine is exactly commutative (the same bits for op(a, b) and op(b, a)),
// so the xor butterflies leave one result in every lane and every block of a cluster.
#pragma once
#include "rtk/common.cuh"
#include "rtk/reduce.cuh"

namespace rtk {

// Two sums reduced together (RMSNorm: sum x^2 and sum g*x; LayerNorm with saved statistics:
// sum g and sum g*(x - mean)).
struct Sum2 {
    float a, b;
};
__device__ __forceinline__ Sum2 shfl_xor(Sum2 v, int mask) { return {shfl_xor(v.a, mask), shfl_xor(v.b, mask)}; }
struct Sum2Op {
    __device__ Sum2 operator()(Sum2 x, Sum2 y) const { return {x.a + y.a, x.b + y.b}; }
};
// One sum (RMSNorm with the forward's rstd: sum g*x alone - sum x^2 would only recompute rstd),
// named b as Sum2's second so that both read it the same way.
struct Sum1 {
    float b;
};
__device__ __forceinline__ Sum1 shfl_xor(Sum1 v, int mask) { return {shfl_xor(v.b, mask)}; }
struct Sum1Op {
    __device__ Sum1 operator()(Sum1 x, Sum1 y) const { return {x.b + y.b}; }
};

// LayerNorm backward without saved statistics, in one reduction: count n, mean and M2 of x (Chan's
// pairwise update, as MeanM2), and for g = dy * w the sums G = sum g and T = sum g * (x - mean)
// about the *same* mean.  Merging two parts moves T to the merged mean:
//   T = Ta + Tb + (mean_a - mean) * Ga + (mean_b - mean) * Gb,
// exact in real arithmetic and free of the cancellation of sum(g*x) - mean * sum(g) (x with a
// large mean and a small spread).  Written pairwise, (Ta + Tb) + (Xa + Xb), so it commutes.
struct LnBwd {
    float n, mean, m2, g, t;
};
__device__ __forceinline__ LnBwd shfl_xor(LnBwd v, int mask) {
    return {shfl_xor(v.n, mask), shfl_xor(v.mean, mask), shfl_xor(v.m2, mask), shfl_xor(v.g, mask),
            shfl_xor(v.t, mask)};
}
struct LnBwdOp {
    __device__ LnBwd operator()(LnBwd a, LnBwd b) const {
        const float n = a.n + b.n;
        const float inv_n = n > 0.f ? rcp_approx(n) : 0.f;   // two empty states give zeros
        const float mean = (a.n * a.mean + b.n * b.mean) * inv_n;
        const float d = b.mean - a.mean;
        return {n, mean, a.m2 + b.m2 + d * d * (a.n * b.n * inv_n), a.g + b.g,
                (a.t + b.t) + ((a.mean - mean) * a.g + (b.mean - mean) * b.g)};
    }
};

// kN floats to global memory with the widest aligned stores (p aligned to min(kN, 4) floats).
template <int kN>
__device__ __forceinline__ void store_floats(float* p, const float (&f)[kN]) {
    if constexpr (kN % 4 == 0) {
#pragma unroll
        for (int k = 0; k < kN; k += 4)
            *reinterpret_cast<float4*>(p + k) = make_float4(f[k], f[k + 1], f[k + 2], f[k + 3]);
    } else if constexpr (kN % 2 == 0) {
#pragma unroll
        for (int k = 0; k < kN; k += 2) *reinterpret_cast<float2*>(p + k) = make_float2(f[k], f[k + 1]);
    } else {
#pragma unroll
        for (int k = 0; k < kN; ++k) p[k] = f[k];
    }
}

// A barrier across the whole grid, for cooperative launches only (see group_barrier in common.cuh).
__device__ __forceinline__ void grid_barrier(int* counters) {
    group_barrier(counters, int(gridDim.x * gridDim.y * gridDim.z));
}

}  // namespace rtk
