// Primitives of the attention backward that mma.cuh does not have: float32 reductions into
// global memory (the non-deterministic dQ accumulation) and the log2-domain lse guard.
// Plain CUDA C++ (no Jinja), included by templates/attention_bwd.cu.j2.
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

// lse (natural log) -> lse * log2(e), the offset subtracted inside exp2.  A row that saw no key
// in the forward (lse = -inf) and a padding row both become +inf: exp2(s - inf) = 0 for every
// finite or -inf score, so P, dS and every gradient of that row are exactly 0, never NaN.
__device__ __forceinline__ float lse_log2_or_inf(float lse, bool valid) {
    return (valid && lse != __int_as_float(0xff800000)) ? lse * 1.4426950408889634f : __int_as_float(0x7f800000);
}

}  // namespace rtk
