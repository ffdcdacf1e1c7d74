"""Occupancy calculator and wave counts: hand-computed cases on the CPU, the driver on a GPU."""
from __future__ import annotations

import math
import os
import shutil
import subprocess

import pytest

from rtkernels import arch
from rtkernels.errors import ConfigError

KIB = 1024


# ---- limits table ------------------------------------------------------------------------
@pytest.mark.parametrize("name,threads,blocks,warps,smem_sm,smem_block", [
    ("sm_80", 2048, 32, 64, 164 * KIB, 163 * KIB),
    ("sm_86", 1536, 16, 48, 100 * KIB, 99 * KIB),
    ("sm_89", 1536, 24, 48, 100 * KIB, 99 * KIB),
    ("sm_90", 2048, 32, 64, 228 * KIB, 227 * KIB),
])
def test_limits_table(name, threads, blocks, warps, smem_sm, smem_block):
    lim = arch.limits(name)
    assert (lim.max_threads_per_sm, lim.max_blocks_per_sm, lim.max_warps_per_sm) == (threads, blocks, warps)
    assert (lim.max_smem_per_sm, lim.max_smem_per_block_optin) == (smem_sm, smem_block)
    assert lim.registers_per_sm == 65536 and lim.max_registers_per_thread == 255
    assert lim.register_allocation_unit == 256 and lim.smem_allocation_unit == 128
    assert lim.reserved_smem_per_block == 1024
    assert lim.smem_carveouts_kib[-1] * KIB == lim.max_smem_per_sm


def test_arch_names():
    assert arch.limits("sm_90a") is arch.limits("sm_90")
    assert arch.limits("8.6").name == "sm_86"
    with pytest.raises(ConfigError, match="sm_80"):
        arch.limits("sm_75")


# ---- hand-computed occupancy -------------------------------------------------------------
def test_thread_limited_full_occupancy():
    # 256 threads = 8 warps; 64 warp slots -> 8 blocks. 32 regs x 32 lanes = 1024/warp; a
    # sub-partition (16384 regs) holds 16 warps, the SM 64: registers allow 8 blocks too (a tie).
    o = arch.occupancy("sm_90", 256, 32)
    assert (o.blocks_per_sm, o.warps_per_sm, o.occupancy_fraction) == (8, 64, 1.0)
    assert o.limiter == "threads" and set(o.limiters) == {"threads", "registers"}
    assert o.limits["threads"] == 8 and o.limits["registers"] == 8 and o.limits["blocks"] == 32


def test_register_limited():
    # 128 regs -> 4096 per warp -> 4 warps per sub-partition -> 16 warps -> 4 blocks of 4 warps.
    o = arch.occupancy("sm_90", 128, 128)
    assert (o.blocks_per_sm, o.warps_per_sm, o.limiter) == (4, 16, "registers")
    assert o.occupancy_fraction == pytest.approx(0.25)
    assert o.registers_per_block == 4096 * 4


def test_register_allocation_unit_rounds_per_warp():
    # 33 regs x 32 = 1056 -> rounded to 1280 per warp; 16384 // 1280 = 12 warps per sub-partition
    # -> 48 warps -> 6 blocks of 8 warps.  Without the rounding it would be 7.
    o = arch.occupancy("sm_80", 256, 33)
    assert o.blocks_per_sm == 6 and o.limiter == "registers"
    assert o.registers_per_block == 1280 * 8
    assert 65536 // (33 * 256) == 7


def test_register_sub_partitions():
    # 80 regs = 2560 per warp: 16384 // 2560 = 6 per sub-partition -> 24 one-warp blocks,
    # not 65536 // 2560 = 25: registers come from one quarter of the file per warp.
    o = arch.occupancy("sm_90", 32, 80)
    assert o.blocks_per_sm == 24 and o.limiter == "registers"


def test_cannot_launch():
    assert arch.occupancy("sm_90", 1025, 16).blocks_per_sm == 0
    assert arch.occupancy("sm_90", 1025, 16).limiter == "threads"
    assert arch.occupancy("sm_90", 64, 256).blocks_per_sm == 0
    # 1024 threads x 64 regs is exactly the 64 K register file; 65 regs (2304 per warp) is not.
    assert arch.occupancy("sm_90", 1024, 64).blocks_per_sm == 1
    o = arch.occupancy("sm_90", 1024, 65)
    assert o.blocks_per_sm == 0 and o.limiter == "registers"
    # 96 threads = 3 warps: the hardware check rounds to 4 warps, so 255 regs (8192 per warp)
    # x 4 = 32 K fits, as does the allocation itself.
    assert arch.occupancy("sm_90", 96, 255).blocks_per_sm == 2


@pytest.mark.parametrize("name,expected", [("sm_80", 3), ("sm_86", 2), ("sm_89", 2), ("sm_90", 4)])
def test_shared_memory_limited(name, expected):
    # 48 KiB dynamic + 1 KiB reserved = 50176 B per block; 164 K / 50176 = 3, 100 K -> 2, 228 K -> 4.
    o = arch.occupancy(name, 128, 32, 0, 48 * KIB)
    assert o.smem_per_block == 49 * KIB
    assert o.blocks_per_sm == expected and o.limiter == "shared_memory"


def test_shared_memory_granularity_and_static():
    o = arch.occupancy("sm_90", 128, 16, 1, 0)
    assert o.smem_per_block == 1024 + 128           # 1 B + reserved, rounded to 128 B
    o = arch.occupancy("sm_90", 128, 16, 16 * KIB, 40 * KIB + 5)
    assert o.smem_per_block == math.ceil((56 * KIB + 5 + 1024) / 128) * 128
    assert o.blocks_per_sm == (228 * KIB) // o.smem_per_block == 3


def test_shared_memory_per_block_cap():
    assert arch.occupancy("sm_90", 128, 32, 0, 227 * KIB).blocks_per_sm == 1
    assert arch.occupancy("sm_90", 128, 32, 0, 227 * KIB + 1).blocks_per_sm == 0
    assert arch.occupancy("sm_86", 128, 32, 0, 99 * KIB + 1).blocks_per_sm == 0
    # A kernel that never raised its dynamic limit (driver default 48 KiB - static) cannot use 60 KiB.
    assert arch.occupancy("sm_90", 128, 32, 0, 60 * KIB, max_dynamic_smem=48 * KIB).blocks_per_sm == 0
    assert arch.occupancy("sm_90", 128, 32, 0, 40 * KIB, max_dynamic_smem=48 * KIB).blocks_per_sm == 5


def test_carveout():
    # 10 KiB + 1 KiB = 11264 B.  Default: the largest carveout, 228 K -> 20 blocks.
    assert arch.occupancy("sm_90", 64, 16, 0, 10 * KIB).blocks_per_sm == 20
    # 50 % of 228 K = 114 K, rounded up to the 132 K option -> 12 blocks.
    assert arch.occupancy("sm_90", 64, 16, 0, 10 * KIB, carveout=50).blocks_per_sm == 12
    # 0 % cannot hold one block: the driver takes the smallest option that can, 16 K -> 1 block.
    o = arch.occupancy("sm_90", 64, 16, 0, 10 * KIB, carveout=0)
    assert o.blocks_per_sm == 1 and o.smem_per_sm == 16 * KIB


def test_blocks_limited():
    # One-warp blocks with few registers: the resident-block cap binds (16 on 8.6, 24 on 8.9).
    assert arch.occupancy("sm_86", 32, 16).limiter == "blocks"
    assert arch.occupancy("sm_86", 32, 16).blocks_per_sm == 16
    assert arch.occupancy("sm_89", 32, 16).blocks_per_sm == 24
    assert arch.occupancy("sm_90", 32, 16).blocks_per_sm == 32


def test_barriers_limit_on_hopper_only():
    # sm_90 has 2 barriers per block slot (64); 16 named barriers -> 4 blocks.  8.x: no such limit.
    o = arch.occupancy("sm_90", 32, 16, barriers=16)
    assert o.blocks_per_sm == 4 and o.limiter == "barriers"
    assert arch.occupancy("sm_80", 32, 16, barriers=16).blocks_per_sm == 32
    assert arch.occupancy("sm_90", 32, 16, barriers=1).blocks_per_sm == 32


def test_zero_registers_and_bad_input():
    assert arch.occupancy("sm_90", 64, 0).limits["registers"] is None
    with pytest.raises(ConfigError):
        arch.occupancy("sm_90", 0, 32)
    with pytest.raises(ConfigError):
        arch.occupancy("sm_90", 32, 32, carveout=101)


def test_occupancy_as_dict_is_json_ready():
    import json
    d = arch.occupancy("sm_90", 128, 40, 1024, 2048).as_dict()
    assert json.loads(json.dumps(d))["blocks_per_sm"] == d["blocks_per_sm"]


# ---- the same model as NVIDIA's reference implementation --------------------------------
HARNESS = r"""
#include <cstdio>
#include "cuda_occupancy.h"
// stdin: smem_sm smem_optin max_threads_sm major minor threads regs static dyn max_dyn barriers carveout
int main() {
    long smem_sm, optin, max_dyn; int threads_sm, major, minor, threads, regs, barriers, carveout;
    long st, dyn;
    while (scanf("%ld %ld %d %d %d %d %d %ld %ld %ld %d %d", &smem_sm, &optin, &threads_sm, &major, &minor,
                 &threads, &regs, &st, &dyn, &max_dyn, &barriers, &carveout) == 12) {
        cudaOccDeviceProp p;
        p.computeMajor = major; p.computeMinor = minor; p.maxThreadsPerBlock = 1024;
        p.maxThreadsPerMultiprocessor = threads_sm; p.regsPerBlock = 65536; p.regsPerMultiprocessor = 65536;
        p.warpSize = 32; p.sharedMemPerBlock = 48 * 1024; p.sharedMemPerMultiprocessor = smem_sm;
        p.numSms = 1; p.sharedMemPerBlockOptin = optin; p.reservedSharedMemPerBlock = 1024;
        cudaOccFuncAttributes a;
        a.maxThreadsPerBlock = 1024; a.numRegs = regs; a.sharedSizeBytes = st;
        a.shmemLimitConfig = FUNC_SHMEM_LIMIT_OPTIN; a.maxDynamicSharedSizeBytes = max_dyn;
        a.numBlockBarriers = barriers;
        cudaOccDeviceState s;
        s.carveoutConfig = carveout;
        cudaOccResult r;
        cudaOccError e = cudaOccMaxActiveBlocksPerMultiprocessor(&r, &p, &a, &s, threads, dyn);
        printf("%d\n", e == CUDA_OCC_SUCCESS ? r.activeBlocksPerMultiprocessor : -1);
    }
    return 0;
}
"""


def _occupancy_header_dir():
    try:
        import cuda.pathfinder as pf
        d = pf.find_nvidia_header_directory("cudart")
    except Exception:
        return None
    return d if d and os.path.exists(os.path.join(d, "cuda_occupancy.h")) else None


def test_matches_cuda_occupancy_header(tmp_path):
    """Compile the toolkit's own calculator (cuda_occupancy.h, what the driver implements) on
    the host and compare over a grid that crosses every limit."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    inc = _occupancy_header_dir()
    if not cxx or not inc:
        pytest.skip("needs a host C++ compiler and cuda_occupancy.h (nvidia-cuda-runtime wheel)")
    src, exe = tmp_path / "occ.cpp", tmp_path / "occ"
    src.write_text(HARNESS)
    subprocess.run([cxx, "-O1", "-std=c++11", f"-I{inc}", str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    cases, lines = [], []
    smem = [(0, 0), (16, 0), (0, 1), (4096, 20000), (0, 48 * KIB), (1000, 60000), (0, 99 * KIB),
            (0, 100 * KIB), (0, 163 * KIB), (48 * KIB, 179 * KIB), (0, 227 * KIB)]
    for name, lim in arch.ARCHS.items():
        major, minor = lim.compute_capability
        for threads in (32, 64, 96, 128, 160, 256, 384, 512, 640, 768, 1024):
            for regs in (0, 16, 24, 32, 33, 40, 48, 56, 64, 72, 80, 96, 128, 168, 200, 255):
                for st, dyn in smem:
                    for barriers in (0, 1, 16):
                        for carveout in (None, 0, 50):
                            for max_dyn in (None, 48 * KIB - st):
                                cases.append((name, threads, regs, st, dyn, barriers, carveout, max_dyn))
                                lines.append(f"{lim.max_smem_per_sm} {lim.max_smem_per_block_optin} "
                                             f"{lim.max_threads_per_sm} {major} {minor} {threads} {regs} {st} "
                                             f"{dyn} {dyn if max_dyn is None else max_dyn} {barriers} "
                                             f"{-1 if carveout is None else carveout}")
    out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True,
                         check=True).stdout.split()
    assert len(out) == len(cases)
    bad = []
    for case, want in zip(cases, map(int, out)):
        name, threads, regs, st, dyn, barriers, carveout, max_dyn = case
        got = arch.occupancy(name, threads, regs, st, dyn, barriers=barriers, carveout=carveout,
                             max_dynamic_smem=max_dyn).blocks_per_sm
        if want != got and not (want == -1 and got == 0):
            bad.append(f"{case}: header {want}, ours {got}")
    assert not bad, f"{len(bad)}/{len(cases)} differ:\n" + "\n".join(bad[:20])


# ---- waves --------------------------------------------------------------------------------
def test_waves_course_puzzle():
    # 1792^2 vs 1793^2 matmul, 256x128 tiles, 108-SM A100: 98 vs 120 tiles, one wave vs two,
    # the second 12/108 = 11 % full.
    t1 = arch.matmul_tiles(1792, 1792, 256, 128)
    t2 = arch.matmul_tiles(1793, 1793, 256, 128)
    assert (t1, t2) == (98, 120)
    w1, w2 = arch.waves(t1, 108), arch.waves(t2, 108)
    assert w1.waves == 1 and w1.tail_efficiency == pytest.approx(98 / 108)
    assert w2.waves == 2 and w2.tail_efficiency == pytest.approx(12 / 108)
    assert round(w2.tail_efficiency, 2) == 0.11
    s = arch.wave_summary(t2, 108)
    assert s["tail_tiles"] == 12 and s["efficiency"] == pytest.approx(120 / 216)


def test_waves_more_blocks_per_sm_and_edges():
    waves, tail = arch.waves(120, 108, blocks_per_sm=2)
    assert waves == 1 and tail == pytest.approx(120 / 216)
    assert arch.waves(216, 108) == (2, 1.0)
    assert arch.waves(0, 108) == (0, 1.0)
    with pytest.raises(ConfigError):
        arch.waves(10, 0)


def test_attention_tiles():
    # FlashAttention forward grid: batch x heads x ceil(seqlen_q / block_m)
    assert arch.attention_tiles(2, 16, 1000, 128) == 2 * 16 * 8
    assert arch.matmul_tiles(100, 100, 64, 64, batch=3, split_k=2) == 2 * 2 * 3 * 2


# ---- GPU: the driver agrees ---------------------------------------------------------------
PROBE = r"""
// Occupancy probe: register use grows with NUM_ACC (independent FMA chains kept live),
// static shared memory is STATIC_FLOATS floats, dynamic shared memory comes at launch.
constexpr int NUM_ACC = {{ num_acc }};
constexpr int STATIC_FLOATS = {{ static_floats }};

extern "C" __global__ void occ_probe(const float* __restrict__ in, float* __restrict__ out, int n)
{
    __shared__ float tile[STATIC_FLOATS];
    extern __shared__ float dyn[];
    float acc[NUM_ACC];
#pragma unroll
    for (int j = 0; j < NUM_ACC; ++j) acc[j] = in[(threadIdx.x * 7 + j) % n];
    for (int it = 0; it < n; ++it) {
#pragma unroll
        for (int j = 0; j < NUM_ACC; ++j) acc[j] = fmaf(acc[j], acc[(j + 1) % NUM_ACC], 0.5f);
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < NUM_ACC; ++j) s += acc[j];
    tile[threadIdx.x % STATIC_FLOATS] = s;
    dyn[threadIdx.x] = s;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = tile[(threadIdx.x + 1) % STATIC_FLOATS] + dyn[threadIdx.x ^ 1];
}
"""


@pytest.mark.gpu
def test_occupancy_matches_driver():
    import rtkernels as rtk
    if not rtk.device.has_gpu():
        pytest.skip("needs a CUDA GPU")
    import cupy
    from cuda.bindings import driver as cu

    def ok(res):
        err, *vals = res if isinstance(res, tuple) else (res,)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        return vals[0] if vals else None

    cupy.zeros(1)                      # a current context for the driver API calls below
    target = rtk.device.device_arch()  # exact arch of this GPU, e.g. sm_90
    lim = arch.limits(target)
    attr = cu.CUfunction_attribute
    mismatches, checked = [], 0
    for num_acc in (4, 40, 120):
        for max_regs in (None, 32, 64, 168):
            for static_floats in (1, 4096):
                opts = rtk.CompileOptions(max_registers=max_regs)
                k = rtk.compile(rtk.Template(PROBE), kernel="occ_probe", arch=target, options=opts,
                                num_acc=num_acc, static_floats=static_floats)
                fn = k.function()
                handle = cu.CUfunction(int(getattr(fn, "ptr", fn)))
                regs = ok(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, handle))
                static = ok(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, handle))
                assert regs == k.resources.registers, (regs, k.resources)
                assert static == k.resources.shared_static, (static, k.resources)
                max_dyn = lim.max_smem_per_block_optin - static
                ok(cu.cuFuncSetAttribute(handle, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max_dyn))
                for block in (32, 96, 128, 256, 640, 1024):
                    for dyn in (0, 1, 20000, 48 * KIB, 100 * KIB, max_dyn):
                        if dyn > max_dyn:
                            continue   # (never launched: only the sizes matter to the occupancy query)
                        err, want = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(handle, block, dyn)
                        if err != cu.CUresult.CUDA_SUCCESS:
                            want = 0   # a block the function can never run (too many registers for it)
                        got = arch.occupancy(target, block, k.resources.registers, k.resources.shared_static,
                                             dyn, barriers=k.resources.barriers, max_dynamic_smem=max_dyn)
                        checked += 1
                        if got.blocks_per_sm != want:
                            mismatches.append(f"acc={num_acc} maxreg={max_regs} regs={regs} static={static} "
                                              f"block={block} dyn={dyn}: driver {want}, ours {got.blocks_per_sm} "
                                              f"(limits {got.limits})")
    assert checked > 100
    assert not mismatches, f"{len(mismatches)}/{checked} disagree:\n" + "\n".join(mismatches[:20])


@pytest.mark.gpu
def test_limits_table_matches_device():
    import rtkernels as rtk
    if not rtk.device.has_gpu():
        pytest.skip("needs a CUDA GPU")
    import cupy
    p = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    lim = arch.limits(f"sm_{p['major']}{p['minor']}")
    assert p["maxThreadsPerMultiProcessor"] == lim.max_threads_per_sm
    assert p["maxBlocksPerMultiProcessor"] == lim.max_blocks_per_sm
    assert p["regsPerMultiprocessor"] == lim.registers_per_sm and p["regsPerBlock"] == lim.registers_per_block
    assert p["sharedMemPerMultiprocessor"] == lim.max_smem_per_sm
    assert p["sharedMemPerBlockOptin"] == lim.max_smem_per_block_optin
    assert p["sharedMemPerBlock"] == lim.smem_per_block_default
    assert p["reservedSharedMemPerBlock"] == lim.reserved_smem_per_block
