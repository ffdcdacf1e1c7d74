"""SASS statistics, flags, reports, diffs, sweeps and formats, each checked on a kernel
built to show the figure (CPU only: NVRTC + nvdisasm, no driver)."""
from __future__ import annotations

import csv
import io
import json
from types import SimpleNamespace

import pytest

import rtkernels as rtk
from rtkernels import arch, inspect

# ---- kernels built to have each figure ------------------------------------------------------
LOCAL_ARRAY = r"""
// A per-thread array indexed by run-time values cannot live in registers: it goes to the
// stack (local memory), read and written with LDL/STL.
extern "C" __global__ void local_array(const float* __restrict__ a, const int* __restrict__ idx,
                                       float* __restrict__ out, int n)
{
    float t[256];
    for (int k = 0; k < 256; ++k) t[k] = a[k * n + threadIdx.x];
    for (int k = 0; k < n; ++k) t[idx[k] & 255] += 1.0f;
    out[threadIdx.x] = t[idx[n] & 255];
}
"""

# NUM_ACC independent FMA chains stay live across the loop; capped at 32 registers they spill.
from sample_templates import SPILLY


COPY = r"""
// VEC=4: one float4 (128-bit) load and store per thread; VEC=1: plain floats.
constexpr int VEC = {{ vec }};
static_assert(VEC == 1 || VEC == 4, "VEC must be 1 or 4");
struct alignas(4 * VEC) Pack { float v[VEC]; };
extern "C" __global__ void copy(const float* __restrict__ src, float* __restrict__ dst, int n_packs)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_packs) reinterpret_cast<Pack*>(dst)[i] = reinterpret_cast<const Pack*>(src)[i];
}
"""

MMA = r"""
#include <cuda_fp16.h>
// One warp, one m16n8k16 tensor-core MMA (fp16 inputs, fp32 accumulate), fragments from global.
// Operand lists keep a space after each brace: a brace directly followed by a percent sign
// would open a Jinja tag.
extern "C" __global__ void mma_tile(const unsigned* __restrict__ a, const unsigned* __restrict__ b,
                                    float* __restrict__ c)
{
    const int lane = threadIdx.x % 32;
    unsigned a0 = a[lane * 4 + 0], a1 = a[lane * 4 + 1], a2 = a[lane * 4 + 2], a3 = a[lane * 4 + 3];
    unsigned b0 = b[lane * 2 + 0], b1 = b[lane * 2 + 1];
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{ %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
                 : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    c[lane * 4 + 0] = d0; c[lane * 4 + 1] = d1; c[lane * 4 + 2] = d2; c[lane * 4 + 3] = d3;
}
"""


def build(text, name, arch_="sm_90", options=None, **params):
    return rtk.compile(rtk.Template(text), kernel=name, arch=arch_, options=options, **params)


def family(**kw):
    """A stand-in config carrying only what flags() reads."""
    fields = {"family": "demo", "expects_tensor_cores": False, "expected_global_width": None}
    fields.update(kw)
    return SimpleNamespace(**fields)


# ---- local memory, spills ----------------------------------------------------------------
def test_runtime_indexed_local_array_uses_local_memory():
    k = build(LOCAL_ARRAY, "local_array")
    s = inspect.sass_stats(k)
    assert k.resources.stack_frame >= 1024
    assert s["ldl"] > 0 and s["stl"] > 0
    fl = inspect.flags(k)
    assert any(f.startswith("local memory") for f in fl)
    assert not any(f.startswith("spills") for f in fl)     # an array in memory is not a spill


def test_register_cap_spills():
    k = build(SPILLY, "spilly", options=rtk.CompileOptions(max_registers=32), num_acc=40)
    assert k.resources.registers <= 32
    assert k.resources.spill_stores > 0 and k.resources.spill_loads > 0
    s = inspect.sass_stats(k)
    assert s["stl"] > 0 and s["ldl"] > 0
    fl = inspect.flags(k)
    assert any(f.startswith("spills") for f in fl) and any(f.startswith("local memory") for f in fl)
    # Uncapped, the same kernel stays in registers and raises no flag.
    free = build(SPILLY, "spilly", num_acc=40)
    assert free.resources.spill_stores == 0 and inspect.flags(free) == []


# ---- global access width -----------------------------------------------------------------
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_vectorized_copy_has_128_bit_accesses(target):
    k = build(COPY, "copy", target, vec=4)
    s = inspect.sass_stats(k)
    assert s["ldg_128"] >= 1 and s["stg_128"] >= 1
    assert s["ldg_32"] == 0 and s["global_loads"] == s["ldg_128"]
    assert inspect.flags(s, k.resources, family(expected_global_width=128)) == []


def test_scalar_copy_flagged_when_family_wants_vectors():
    k = build(COPY, "copy", vec=1)
    s = inspect.sass_stats(k)
    assert s["ldg_32"] >= 1 and s["ldg_128"] == 0
    fl = inspect.flags(s, k.resources, family(expected_global_width=128))
    assert any("narrow global loads" in f and "32-bit" in f for f in fl)
    assert any("narrow global stores" in f for f in fl)
    assert inspect.flags(s, k.resources, family()) == []     # no expectation, no flag


# ---- tensor cores ------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_mma_sync_kernel_has_hmma(target):
    k = build(MMA, "mma_tile", target)
    s = inspect.sass_stats(k)
    assert s["hmma"] >= 1 and s["tensor_core"] >= 1
    assert inspect.flags(s, k.resources, family(expects_tensor_cores=True)) == []


def test_missing_tensor_cores_flagged():
    k = build(COPY, "copy", vec=4)
    fl = inspect.flags(inspect.sass_stats(k), k.resources, family(expects_tensor_cores=True))
    assert any(f.startswith("no tensor cores") for f in fl)


# ---- the parser on real nvdisasm lines ---------------------------------------------------
NVDISASM = """
//--------------------- .text.other               --------------------------
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
//--------------------- .text.k                   --------------------------
        /*0080*/                   LDG.E.128.CONSTANT R8, desc[UR4][R4.64] ;
        /*0090*/                   LDG.E.U8.CONSTANT R2, desc[UR4][R2.64] ;
        /*00a0*/                   LDG.E.64 R6, [R2.64+0x8] ;
        /*00b0*/                   LDG.E.LTC128B R3, desc[UR6][R2.64] ;
        /*00c0*/                   STG.E.U16 desc[UR4][R2.64], R9 ;
        /*00d0*/                   STG.E desc[UR4][R2.64+0x4], R5 ;
        /*00e0*/              @!PT LDS RZ, [RZ] ;
        /*00f0*/               @P0 LDS.128 R8, [R0] ;
        /*0100*/                   STS.U16 [R5+-0x80], R6 ;
        /*0110*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0120*/                   LDGSTS.E.BYPASS.128 [R7], desc[UR6][R2.64] ;
        /*0130*/                   UBLKCP.S.G [UR8], [UR4], UR6 ;
        /*0140*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0150*/                   UTMASTG.2D [UR4], [UR10] ;
        /*0160*/                   HGMMA.64x16x16.F32 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0170*/                   HMMA.16816.F32 R4, R8, R12, RZ ;
        /*0180*/                   IMMA.16832.S8.S8 R8, R8.ROW, R12.COL, R16 ;
        /*0190*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*01a0*/              @!P0 MUFU.EX2 R9, R6 ;
        /*01b0*/                   STL.128 [R1+0x10], R8 ;
        /*01c0*/                   LDL R3, [R1+0x4] ;
        /*01d0*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R5 ;
        /*01e0*/                   EXIT ;
        /*01f0*/                   NOP;
"""


def test_sass_stats_parses_nvdisasm_lines():
    s = inspect.sass_stats(NVDISASM, function="k")
    assert (s["ldg_128"], s["ldg_8"], s["ldg_64"], s["ldg_32"]) == (1, 1, 1, 1)   # LTC128B is a cache hint
    assert (s["stg_16"], s["stg_32"], s["global_loads"], s["global_stores"]) == (1, 1, 4, 2)
    assert s["lds"] == 1                  # the @!PT padding LDS never runs
    assert (s["sts"], s["ldsm"], s["ldgsts"]) == (1, 1, 1)
    assert (s["ublkcp"], s["utmaldg"], s["utmastg"], s["tma"]) == (1, 1, 1, 3)
    assert (s["hgmma"], s["hmma"], s["imma"], s["tensor_core"]) == (1, 1, 1, 3)
    assert (s["bar"], s["mufu"], s["stl"], s["ldl"], s["atomics"]) == (1, 1, 1, 1, 1)
    assert s["instructions"] == 22        # NOP and @!PT excluded
    whole = inspect.sass_stats(NVDISASM)
    assert whole["ldg_128"] == 2


# ---- reports -----------------------------------------------------------------------------
def test_report_of_a_family_kernel(fresh_cache):
    k = rtk.compile("vector_add", dtype="float16", block_size=256, arch="sm_90")
    rep = k.report()
    assert rep["family"] == "vector_add" and rep["params"] == {"dtype": "float16", "block_size": 256}
    assert rep["threads_per_block"] == 256
    expect = arch.occupancy("sm_90", 256, k.resources.registers, k.resources.shared_static, 0)
    assert rep["occupancy"]["blocks_per_sm"] == expect.blocks_per_sm
    assert rep["resources"]["registers"] == k.resources.registers
    assert rep["sass"]["global_loads"] >= 2 and rep["flags"] == []
    assert json.loads(inspect.to_json(rep))["kernel"] == "vector_add"
    # the module's NVRTC seconds (a cold compile, or what the disk entry recorded), a table column too
    assert rep["compile_s"] == round(k.compile_seconds, 3) and inspect.flatten(rep)["compile_s"] == rep["compile_s"]
    # Occupancy for another SM generation from the same build
    assert inspect.report(k, "sm_86")["occupancy"]["max_warps_per_sm"] == 48


def test_report_of_a_template_needs_block_size():
    k = build(COPY, "copy", vec=4)
    rep = inspect.report(k)
    assert rep["occupancy"] is None and "block size" in rep["occupancy_note"]
    rep = inspect.report(k, threads_per_block=128, smem_dynamic=4096)
    assert rep["occupancy"]["threads_per_block"] == 128 and rep["smem_dynamic"] == 4096


def test_threads_per_block_convention():
    tpb = inspect.threads_per_block_of
    assert tpb(SimpleNamespace(threads_per_block=96, block_size=256)) == 96
    assert tpb(SimpleNamespace(num_threads=64)) == 64
    assert tpb(SimpleNamespace(block_size=512)) == 512
    assert tpb(SimpleNamespace(num_warps=4)) == 128
    assert tpb(SimpleNamespace(head_dim=64)) is None and tpb(None) is None
    assert inspect.dynamic_smem_of(SimpleNamespace(shared_mem_bytes=65536)) == 65536


def test_zero_occupancy_is_flagged():
    k = build(COPY, "copy", vec=4)
    rep = inspect.report(k, threads_per_block=128, smem_dynamic=300 * 1024)
    assert rep["occupancy"]["blocks_per_sm"] == 0
    assert any(f.startswith("cannot launch") for f in rep["flags"])


def test_diff_shows_what_changed():
    a = inspect.report(build(SPILLY, "spilly", num_acc=8), threads_per_block=128)
    b = inspect.report(build(SPILLY, "spilly", options=rtk.CompileOptions(max_registers=32), num_acc=40),
                       threads_per_block=128)
    d = inspect.diff(a, b)
    assert d["params"] == {"num_acc": (8, 40)}
    assert d["changes"]["spill_stores"]["a"] == 0 and d["changes"]["spill_stores"]["delta"] > 0
    assert "stl" in d["changes"]
    assert any(f.startswith("spills") for f in d["flags"]["added"])
    text = inspect.format_diff(d)
    assert "| spill_stores |" in text and "+ flag: spills" in text
    assert inspect.diff(a, a)["changes"] == {}


# ---- sweeps and formats ------------------------------------------------------------------
def test_grid_order():
    g = inspect.grid({"a": [1, 2], "b": ["x", "y"]}, {"c": 0})
    assert g == [{"c": 0, "a": 1, "b": "x"}, {"c": 0, "a": 1, "b": "y"},
                 {"c": 0, "a": 2, "b": "x"}, {"c": 0, "a": 2, "b": "y"}]


def test_sweep_in_worker_processes(tmp_path):
    path = tmp_path / "copy.cu.j2"
    path.write_text(COPY)
    reports = inspect.sweep(str(path), {"vec": [1, 4, 3]}, arch="sm_90", jobs=2, kernel="copy",
                            threads_per_block=256)
    assert [r["params"]["vec"] for r in reports] == [1, 4, 3]
    assert [r["status"] for r in reports] == ["ok", "ok", "compile_error"]
    assert reports[1]["sass"]["ldg_128"] >= 1 and reports[0]["sass"]["ldg_128"] == 0
    assert reports[1]["occupancy"]["threads_per_block"] == 256
    assert "VEC must be 1 or 4" in reports[2]["error"]
    # the workers' compiles are in the disk cache this process reads
    from rtkernels import cache
    before = cache.stats()["misses"]
    rtk.compile(str(path), kernel="copy", arch="sm_90", vec=4)
    assert cache.stats()["misses"] == before


def test_sweep_marks_invalid_configs():
    reports = inspect.sweep("vector_add", {"block_size": [128, 100]}, arch="sm_90", jobs=1,
                            fixed={"dtype": "float32"})
    assert [r["status"] for r in reports] == ["ok", "invalid"]
    assert "block_size" in reports[1]["error"]


def _reports():
    ok = inspect.report(build(COPY, "copy", vec=4), threads_per_block=128)
    spill = inspect.report(build(SPILLY, "spilly", options=rtk.CompileOptions(max_registers=32), num_acc=40),
                           threads_per_block=128)
    bad = {"family": "copy", "params": {"vec": 3}, "status": "compile_error", "error": "static assertion failed"}
    return [ok, spill, bad]


def test_formats_parse():
    reports = _reports()
    rows = inspect.rows_of(reports)
    assert [r["mark"] for r in rows] == ["", "SPILL", "ERROR"]
    assert json.loads(inspect.to_json(reports))[1]["resources"]["spill_stores"] > 0
    parsed = list(csv.DictReader(io.StringIO(inspect.to_csv(rows))))
    assert len(parsed) == 3 and parsed[1]["mark"] == "SPILL" and int(parsed[1]["spill_stores"]) > 0
    md = inspect.to_markdown(rows).splitlines()
    header = [c.strip() for c in md[0].strip("|").split("|")]
    assert header[0] == "mark" and "registers" in header and "occupancy" in header
    assert set(md[1].replace("|", "")) == {"-"}
    assert len(md) == 2 + 3 and all(line.startswith("|") and line.endswith("|") for line in md)
    assert "SPILL" in md[3]
