"""Kernel templates built to show a figure (spills, local memory), shared by CPU tests."""

# A register array indexed past what ptxas can keep in registers under a low cap: spills and
# local memory (STL/LDL) appear with max_registers=32 and NUM_ACC=40.
SPILLY = r"""
constexpr int NUM_ACC = {{ num_acc }};
extern "C" __global__ void spilly(const float* __restrict__ in, float* __restrict__ out, int n)
{
    float acc[NUM_ACC];
#pragma unroll
    for (int j = 0; j < NUM_ACC; ++j) acc[j] = in[threadIdx.x + j * n];
    for (int it = 0; it < n; ++it) {
#pragma unroll
        for (int j = 0; j < NUM_ACC; ++j) acc[j] = fmaf(acc[j], acc[(j + 1) % NUM_ACC], 0.5f);
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < NUM_ACC; ++j) s += acc[j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""
