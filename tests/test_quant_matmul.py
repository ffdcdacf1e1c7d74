"""quantized_matmul / quantize_weight: config validation, the heuristic, compile without spills, a
NumPy model of the kernel's dequantization bit tricks, quantization against brute-force references,
and on a GPU the op against the float64 dequantized product over awkward shapes."""
import re

import numpy as np
import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import gemv
from rtkernels.ops import quant_matmul as qm
from rtkernels.ops.quant_matmul import QuantGemvConfig

LLAMA = ((4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (10240, 8192), (28672, 8192),
         (8192, 28672))


# ---- config and heuristic ------------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    (dict(dtype="float32"), "dtype"),
    (dict(weight_dtype="int4"), "weight_dtype"),
    (dict(scale_dtype="int8"), "scale_dtype"),
    (dict(group_size=32), "group_size"),
    (dict(group_size=96), "group_size"),
    (dict(weight_dtype="float8_e4m3", has_zeros=True), "has_zeros"),
    (dict(activation="tanh"), "activation"),
    (dict(m_tiles=3), "m_tiles"),
    (dict(row_tiles=3), "row_tiles"),
    (dict(row_tiles=4, m_tiles=2, unroll=2), "unroll"),      # registers past the cap of 2 CTAs per SM
    (dict(row_tiles=2, unroll=8), "unroll"),
    (dict(unroll=4, ctas_per_sm=4), "unroll"),               # a cap of 64 registers
    (dict(ctas_per_sm=9), "ctas_per_sm"),
    (dict(max_registers=100), "max_registers"),
    (dict(persistent=1), "persistent"),
    (dict(num_warps=6), "num_warps"),
    (dict(num_warps=8, warps_k=16), "warps_k"),
    (dict(w_vec=3), "w_vec"),
    (dict(x_vec=16), "x_vec"),
    (dict(split_k=0), "split_k"),
])
def test_config_errors(bad, field):
    with pytest.raises(ConfigError) as e:
        QuantGemvConfig(**bad)
    assert e.value.field == field and "quant_gemv" in str(e.value)


def test_config_derived():
    c = QuantGemvConfig(row_tiles=2, num_warps=8, warps_k=4, m_tiles=2, unroll=2)
    assert c.warps_n == 2 and c.cta_rows == 64 and c.threads_per_block == 256
    assert c.shared_mem_bytes == 2 * 3 * 2 * 2 * 2 * 4 * 32 * 4
    assert c.grid(4097, 132) == (65, 1, 1)
    # persistent: 625 tiles need 3 rounds of 264 CTAs (2 per SM); 209 CTAs give all but two of them 3 tiles
    assert c.replace(split_k=3).grid(40000, 132) == (209, 3, 1)
    assert c.replace(persistent=False).grid(40000, 132) == (625, 1, 1)
    assert QuantGemvConfig(warps_k=1).shared_mem_bytes == 0
    assert c.register_cap == 128 and c.replace(ctas_per_sm=3, unroll=1, m_tiles=1).register_cap == 80
    assert c.replace(max_registers=96).register_cap == 96
    # 2 CTAs x 8 warps x 4 slots x 2 loads x 16 B x 32 lanes
    assert QuantGemvConfig().bytes_in_flight_per_sm == 64 * 1024
    assert QuantGemvConfig(activation=None).activation == "none"


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n, k", LLAMA)
def test_heuristic_llama_shapes(m, n, k):
    """Every target shape fills 132 SMs with one kernel (no split-K), each warp with work."""
    c = qm.heuristic_config("bfloat16", m, n, k, sm_count=132)
    assert c.split_k == 1
    assert c.tiles(n) >= 0.95 * 132, (n, c.key())
    assert -(-k // 64) >= c.warps_k * c.unroll, "every warp fills its slots"
    # Little's law at 3.35 TB/s / 132 SMs and ~1.5 us of loaded latency: ~38 KB per SM
    assert c.bytes_in_flight_per_sm >= 32 * 1024, c.key()
    assert c.m_tiles == (1 if m <= 8 else 2)


@pytest.mark.parametrize("ctas", [1, 2, 4])
def test_persistent_grid_balanced(ctas):
    """The persistent grid keeps the rounds that SMs x ctas_per_sm CTAs would need, gives every CTA
    the same number of tiles within one (fewer than `rounds` CTAs idle in the last round), and never
    exceeds the resident CTAs."""
    c = QuantGemvConfig(ctas_per_sm=ctas, num_warps=4 if ctas == 4 else 8, warps_k=4 if ctas == 4 else 8)
    slots = 132 * ctas
    for n in (16, 1000, 16 * slots, 16 * slots + 16, 14336, 28672, 10240, 6144, 100000, 262144):
        t, g = c.tiles(n), c.grid(n, 132)[0]
        rounds = -(-t // slots)
        assert g <= min(t, slots), (n, g)
        assert -(-t // g) == rounds, (n, g, rounds)          # same rounds as min(tiles, slots) CTAs
        assert t // g >= rounds - 1                            # per-CTA tiles: rounds or rounds - 1
        assert g * rounds - t < rounds, (n, g, rounds)         # the last round is full (min(tiles, slots)
                                                               # left 160 of 264 CTAs idle at 14336 wide)


def test_heuristic_slots_at_two_m_tiles():
    """Two m tiles: 4 slots with group scales and no zero points (measured, gemv.py), else 2; narrow
    loads keep 2."""
    h = qm.heuristic_config
    assert h("bfloat16", 16, 8192, 8192, group_size=128, sm_count=132).unroll == 4
    assert h("float16", 12, 8192, 8192, weight_dtype="float8_e4m3", group_size=64, sm_count=132).unroll == 4
    assert h("bfloat16", 16, 8192, 8192, sm_count=132).unroll == 2
    assert h("bfloat16", 16, 8192, 8192, weight_dtype="uint8", group_size=128, has_zeros=True,
             sm_count=132).unroll == 2
    assert h("bfloat16", 16, 8192, 8200, group_size=128, w_vec=8, sm_count=132).unroll == 2
    assert h("bfloat16", 4, 8192, 8192, group_size=128, sm_count=132).unroll == 4   # one m tile, as before


@pytest.mark.parametrize("n, k, tag", [
    (4096, 4096, "r1u2w8k8s1c2p"), (4096, 14336, "r1u2w8k8s1c2p"),   # 32-row tiles: one CTA per SM
    (6144, 4096, "r2u2w8k8s1c2p"), (8192, 8192, "r2u2w8k8s1c2p"), (8192, 28672, "r2u2w8k8s1c2p"),
    (14336, 4096, "r2u2w8k4s1c2p"), (28672, 8192, "r2u2w8k4s1c2p"),  # 64-row tiles fill the CTA slots
    (10240, 8192, "r2u2w4k4s1c4p")])                                  # 2 x 132 slots: 160 CTAs of 2 tiles
def test_heuristic_two_row_tiles_at_two_m_tiles(n, k, tag):
    """Per-row scales at M = 9..16: two row tiles per warp where the grid keeps 70% of the resident
    warps, the shape whose busiest SM walks the fewest rows (gemv.py, measured on the H200)."""
    for m, wd in ((16, "int8"), (9, "float8_e4m3")):
        c = qm.heuristic_config("bfloat16", m, n, k, weight_dtype=wd, sm_count=132)
        assert c.replace(x_half=False).tag() == tag, (m, wd, c.key())
    # the 64-row tiles only without an activation (bias + SiLU spilled 4 bytes); group scales and zero
    # points keep one row tile (their slots do not fit two); M <= 8 keeps one
    act = qm.heuristic_config("bfloat16", 16, n, k, has_bias=True, activation="silu", sm_count=132)
    assert act.row_tiles == (1 if tag.startswith("r1") else 2)
    assert (act.num_warps, act.warps_k) != (8, 4), act.key()
    assert qm.heuristic_config("bfloat16", 16, n, k, group_size=128, sm_count=132).row_tiles == 1
    assert qm.heuristic_config("bfloat16", 16, n, k, weight_dtype="uint8", has_zeros=True,
                               sm_count=132).row_tiles == 1
    assert qm.heuristic_config("bfloat16", 8, n, k, sm_count=132).row_tiles == 1


def test_busiest_sm_rows():
    from rtkernels.ops import gemv
    c = qm.heuristic_config("bfloat16", 16, 10240, 8192, sm_count=132)
    assert gemv.busiest_sm_rows(c, 10240, 132) == 3 * 32               # 320 CTAs of one 32-row tile
    assert gemv.busiest_sm_rows(c.replace(num_warps=8, warps_k=8, ctas_per_sm=2), 10240, 132) == 2 * 2 * 32
    assert gemv.busiest_sm_rows(c.replace(row_tiles=1, num_warps=8, warps_k=8, ctas_per_sm=2),
                                10240, 132) == 2 * 3 * 16               # 214 CTAs of 3 16-row tiles


# (M, N, K): 32-row tiles where rows are long (K >= 16384) or M >= 6, on a grid whose busiest SM walks
# no more rows (15% more with the grid's copy: 28672 rows) (gemv._group_row_tiles, measured on the
# H200); one row tile at 10240 rows (96 -> 128 busiest rows), 6144 rows (N < 8192), short rows at M < 6,
# and two m tiles
GROUP_ROW_TILES = [((1, 8192, 28672), 2), ((4, 8192, 28672), 2), ((8, 8192, 28672), 2), ((8, 8192, 8192), 2),
                   ((6, 8192, 8192), 2), ((8, 14336, 4096), 2), ((8, 28672, 8192), "grid"),
                   ((6, 28672, 8192), "grid"), ((8, 10240, 8192), 1), ((8, 6144, 4096), 1), ((4, 8192, 8192), 1),
                   ((5, 8192, 8192), 1), ((16, 8192, 28672), 1)]


@pytest.mark.parametrize("kind, zeros, dtype", [("int8", False, "float16"), ("float8_e4m3", False, "bfloat16"),
                                               ("uint8", True, "bfloat16"), ("int8", False, "bfloat16")])
def test_heuristic_group_row_tiles(kind, zeros, dtype):
    def pick(m, n, k, group=128, has_zeros=zeros, **kw):
        return qm.heuristic_config(dtype, m, n, k, weight_dtype=kind, group_size=group, has_zeros=has_zeros,
                                   sm_count=132, sm90=True, **kw)
    for (m, n, k), rows in GROUP_ROW_TILES:
        c = pick(m, n, k)
        want = (2 if c.x_grid else 1) if rows == "grid" else rows
        assert c.row_tiles == want, (m, n, k, c.tag())
        if want == 2 and kind == "int8":   # int8 with zero points through the grid's copy spilled (NVRTC 13.0)
            z = pick(m, n, k, has_zeros=True)
            assert z.row_tiles == (1 if z.x_grid else 2), z.tag()
        assert (c.unroll == 2) == (want == 2) or m == 16, c.tag()
        if want == 2:
            assert pick(m, n, k, group=0).row_tiles == 1          # per-row scales: one row tile
            assert pick(m, n, k, w_vec=8).row_tiles == 1          # narrower loads keep their tiling
            assert pick(m, n, k, group=64).row_tiles == 2
    assert pick(1, 28672, 8192).row_tiles == 1   # (M = 1 at K = 8192: short rows; x_shared where it applies)


def test_heuristic_small_n_splits_k():
    c = qm.heuristic_config("float16", 1, 1024, 4096, sm_count=132)
    assert c.split_k >= 2 and c.grid(1024, 132)[0] * c.split_k >= 0.95 * 132
    tiny = qm.heuristic_config("float16", 3, 7, 72, sm_count=132)
    assert tiny.split_k == 1   # too little K to split


def test_vec_width():
    assert qm._vec_width(4096, 256, None, 1, 16) == 16
    assert qm._vec_width(4104, 256, None, 1, 16) == 8
    assert qm._vec_width(129, 256, None, 1, 16) == 1
    assert qm._vec_width(4096, 258, 4096, 2, 8) == 1        # x base 2 bytes off 16
    assert qm._vec_width(4096, 256, 4100, 2, 8) == 4        # row stride 4100 elements
    assert qm._vec_width(72, 256, 0, 2, 8) == 8             # broadcast rows (stride 0)


def test_x_half_config_and_rule(monkeypatch):
    """x_half: bfloat16 x and quantized weights only (ConfigError naming x_half otherwise); the
    heuristic takes it for integer weights on sm_90 where the H200 measured a gain (gemv.py's
    table), not before sm_90, nor for float16 x, float8 or dense weights."""
    with pytest.raises(ConfigError) as e:
        QuantGemvConfig(dtype="float16", x_half=True)
    assert e.value.field == "x_half" and "bfloat16" in str(e.value)
    with pytest.raises(ConfigError) as e:
        QuantGemvConfig(dtype="bfloat16", weight_dtype="bfloat16", x_half=True)
    assert e.value.field == "x_half"
    monkeypatch.setenv("RTKERNELS_ARCH", "sm_90a")
    h = qm.heuristic_config
    # (x_half, x_shared, x_grid): a CTA's own copy at M = 1 (M <= 4 with zero points from N = 28672),
    # the grid's for zero points and group-scaled weights (large ones, and at M = 9..16 those whose converting
    # CTAs fit beside the tile grid), the conversion kernel's by
    # gemv.X_HALF_MIN_N otherwise (gemv.X_SHARED_RULES, X_GRID_RULES)
    z = dict(weight_dtype="uint8", group_size=128, has_zeros=True)
    g = dict(group_size=128)
    for m, n, k, kw, want in (
            (1, 28672, 8192, {}, (True, True, False)), (1, 6144, 4096, {}, (True, True, False)),
            (1, 8192, 8192, {}, (True, True, False)), (1, 4096, 4096, {}, (False, False, False)),
            (1, 4096, 14336, {}, (False, False, False)), (1, 8192, 28672, {}, (False, False, False)),
            (1, 10240, 14336, {}, (True, False, False)), (4, 10240, 8192, {}, (True, False, False)),
            (4, 8192, 8192, {}, (False, False, False)), (8, 8192, 28672, {}, (False, False, False)),
            (8, 10240, 8192, {}, (True, False, False)), (16, 14336, 4096, {}, (True, False, False)),
            (4, 5120, 4096, z, (True, False, True)), (16, 5120, 4096, z, (True, False, True)),
            (1, 5120, 13824, g, (True, False, True)), (1, 5120, 4096, z, (True, False, True)),
            (1, 10240, 14336, g, (True, False, False)),   # M = 1: the conversion kernel where it runs
            (16, 8192, 28672, {}, (True, False, False)), (9, 6144, 4096, {}, (True, False, False)),
            (16, 4096, 14336, {}, (False, False, False)),
            (1, 8192, 8192, g, (True, True, False)), (4, 8192, 8192, g, (True, False, True)),
            (16, 8192, 8192, g, (False, False, False)), (16, 28672, 8192, g, (True, False, True)),
            (16, 14336, 4096, g, (True, False, True)), (16, 10240, 8192, g, (True, False, True)),
            (9, 5120, 4096, g, (True, False, True)), (12, 14336, 2048, g, (True, False, True)),
            (16, 8192, 4096, g, (False, False, False)),   # 256 tile CTAs: the copy's would not fit beside
            (16, 4096, 4096, g, (False, False, False)), (16, 4096, 14336, g, (False, False, False)),
            (4, 8192, 28672, g, (True, False, True)), (1, 8192, 28672, g, (True, False, False)),
            (4, 10240, 8192, g, (True, False, True)), (4, 14336, 4096, g, (True, False, True)),
            (4, 4096, 14336, g, (False, False, False)),
            (16, 8192, 8192, z, (True, False, True)), (1, 8192, 8192, z, (True, True, False)),
            (4, 8192, 8192, z, (True, False, True)), (4, 28672, 8192, z, (True, True, False)),
            (8, 8192, 8192, z, (True, False, True)), (1, 8192, 28672, z, (True, False, True)),
            (4, 4096, 4096, z, (False, False, False)),
            (16, 129, 4096, z, (False, False, False)),   # split-K: no grid copy, and too small for the kernel's
            (1, 28672, 8192, dict(weight_dtype="float8_e4m3", group_size=128), (False, False, False)),
            (1, 28672, 8192, dict(weight_dtype="bfloat16"), (False, False, False))):
        c = h("bfloat16", m, n, k, sm_count=132, **kw)
        assert (c.x_half, c.x_shared, c.x_grid) == want, (m, n, k, kw, c.tag())
    with pytest.raises(ConfigError) as e:
        QuantGemvConfig(dtype="bfloat16", x_half=True, split_k=2, x_grid=True)
    assert e.value.field == "x_grid"
    with pytest.raises(ConfigError) as e:
        QuantGemvConfig(dtype="bfloat16", x_half=True, x_shared=True, x_grid=True)
    assert e.value.field == "x_grid"
    assert not h("bfloat16", 16, 28672, 8192, sm_count=132, group_size=128, x_grid=False).x_grid
    # the converting CTAs go ahead of the tile grid where the SMs hold M more (none converts then)
    c = h("bfloat16", 4, 28672, 8192, sm_count=132, group_size=128)
    assert c.x_grid and c.grid(28672, 132)[0] == 256
    assert gemv.grid_copy_extra(c, 4, 256, 132) == 4 and gemv.grid_copy_extra(c, 16, 256, 132) == 0
    assert gemv.grid_copy_extra(c.replace(x_grid=False), 4, 256, 132) == 0
    assert gemv.x_shared_fits(h("bfloat16", 1, 8192, 8192, sm_count=132), 1, 50000)
    assert not gemv.x_shared_fits(h("bfloat16", 4, 8192, 8192, sm_count=132), 4, 14336)   # 2 x 115 KiB
    assert not h("float16", 1, 28672, 8192, sm_count=132).x_half
    assert not h("bfloat16", 1, 28672, 8192, sm_count=132, x_half=False).x_shared
    c = h("bfloat16", 1, 8192, 8192, sm_count=132, x_shared=False)
    assert c.x_half and not c.x_shared
    with pytest.raises(ConfigError) as e:
        QuantGemvConfig(dtype="bfloat16", m_tiles=2, unroll=2, x_half=True, x_shared=True)
    assert e.value.field == "x_shared"
    monkeypatch.setenv("RTKERNELS_ARCH", "sm_80")
    assert not h("bfloat16", 1, 28672, 8192, sm_count=132).x_half


def test_x_half_workspace_layout():
    """The conversion's copy (64-element K blocks of 8 interleaved rows per m tile) and its multipliers
    share the stream workspace with split-K's partials, each 256-byte aligned and apart."""
    cfg = qm.heuristic_config("bfloat16", 3, 129, 4100, sm_count=132, x_half=True, x_shared=False)
    assert cfg.split_k > 1 and not cfg.cluster
    ws = gemv.workspace(cfg, 3, 129, 4100)
    part, ctr = gemv.workspace_bytes(cfg, 3, 129)
    assert ws.counter_bytes == ctr and ws.offsets[0] == 0
    assert gemv.half_row_stride(4100) == 4104 and ws.offsets[1] >= part and ws.offsets[1] % 256 == 0
    assert gemv.half_copy_elems(cfg, 4100) == 65 * 64 * 8 * cfg.m_tiles
    assert ws.offsets[2] >= ws.offsets[1] + 2 * gemv.half_copy_elems(cfg, 4100) and ws.offsets[2] % 256 == 0
    assert ws.part_bytes >= ws.offsets[2] + 4 * 3
    assert gemv.workspace(cfg.replace(x_half=False, split_k=1), 3, 129, 4100) is None
    assert gemv.workspace(cfg.replace(x_shared=True, split_k=1), 3, 129, 4100) is None   # a CTA's own copy
    wg = gemv.workspace(cfg.replace(split_k=1, x_grid=True), 3, 129, 4100)   # the grid's copy and its count
    assert wg.counter_bytes == 8 and wg.offsets[1] is not None and wg.offsets[2] is not None


def test_x_half_kernels_compile():
    """The x_half GEMV runs float16 MMAs and waits first (PDL) like the plain one; the conversion
    waits, then signals its dependents."""
    import rtkernels as rtk
    cfg = qm.heuristic_config("bfloat16", 16, 28672, 8192, sm_count=132, x_half=True)
    main = rtk.get_kernel(cfg, "quant_gemv", arch="sm_90")
    conv = rtk.get_kernel(cfg, "quant_gemv_xhalf", arch="sm_90")
    for k in (main, conv):
        r = k.resources
        assert r.spill_stores == 0 and r.spill_loads == 0, (k.name, r)
        assert k.pdl and k.ptx.index("griddepcontrol.wait") < k.ptx.index("ld.global"), k.name
    # 256 threads of at most 128 registers: one of the GEMV's 8-warp CTAs fits beside it on its SM
    assert conv.resources.registers * gemv.X_HALF_THREADS + 128 * 256 <= 65536
    assert "HMMA.16816.F32" in main.sass and "HMMA.16816.F32.BF16" not in main.sass
    assert conv.ptx.index("griddepcontrol.wait") < conv.ptx.index("griddepcontrol.launch_dependents")
    plain = rtk.get_kernel(cfg.replace(x_half=False), "quant_gemv", arch="sm_90")
    assert "HMMA.16816.F32.BF16" in plain.sass
    # x_grid: the GEMV's first CTAs convert, release a count, every CTA acquires it; the copy is read
    # with plain loads (the read-only path may miss writes made during the kernel), the weights not
    grid = rtk.get_kernel(cfg.replace(x_grid=True), "quant_gemv", arch="sm_90")
    r = grid.resources
    assert r.spill_stores == 0 and r.spill_loads == 0, r
    assert "red.release.gpu.global.add" in grid.ptx and "ld.acquire.gpu.global" in grid.ptx
    assert grid.ptx.index("griddepcontrol.wait") < grid.ptx.index("red.release.gpu")
    assert re.search(r"ld\.global\.v4\.u32", grid.ptx) and re.search(r"ld\.global\.nc\.v4\.u32", grid.ptx)
    assert not re.search(r"ld\.global\.v4\.u32", main.ptx)   # the conversion kernel's copy: read-only path
    assert "HMMA.16816.F32" in grid.sass and "HMMA.16816.F32.BF16" not in grid.sass


# ---- compile: the heuristic's configs, no spills, with register headroom --------------------------
def _compiled_configs():
    h = qm.heuristic_config
    return [
        h("bfloat16", 1, 14336, 4096, weight_dtype="int8", sm_count=132),
        h("float16", 16, 4096, 4096, weight_dtype="int8", group_size=128, has_zeros=True, has_bias=True,
          activation="gelu", sm_count=132),                                                  # m_tiles 2
        h("bfloat16", 16, 8192, 8192, weight_dtype="float8_e4m3", group_size=64, scale_dtype="bfloat16",
          sm_count=132),                                                                     # m_tiles 2, 4 slots
        h("bfloat16", 16, 8192, 8192, weight_dtype="int8", sm_count=132),                   # m_tiles 2, per row
        h("bfloat16", 16, 14336, 4096, weight_dtype="int8", has_bias=True, sm_count=132),    # 64-row tiles
        h("bfloat16", 12, 10240, 8192, weight_dtype="int8", has_bias=True, activation="silu",
          sm_count=132),                                                                     # 4 CTAs of 4 warps
        h("bfloat16", 4, 4096, 4096, weight_dtype="uint8", has_zeros=True, has_bias=True, activation="silu",
          sm_count=132),
        h("bfloat16", 8, 10240, 8192, weight_dtype="uint8", group_size=128, has_zeros=True, has_bias=True,
          activation="silu", sm_count=132),                                                  # x_grid
        h("float16", 1, 6144, 4096, weight_dtype="float8_e4m3", scale_dtype="float16", activation="relu",
          sm_count=132),
        # 32-row tiles at one m tile (group scales): the grid's copy with zero points, float16 x with
        # group 64, the conversion kernel's copy
        h("bfloat16", 8, 8192, 8192, weight_dtype="uint8", group_size=128, has_zeros=True, has_bias=True,
          activation="silu", sm_count=132),
        h("float16", 4, 8192, 28672, weight_dtype="int8", group_size=64, has_bias=True, activation="gelu",
          sm_count=132),
        h("bfloat16", 1, 8192, 28672, weight_dtype="int8", group_size=128, sm_count=132),
        h("bfloat16", 3, 129, 4096, weight_dtype="int8", w_vec=1, x_vec=1, group_size=64, has_zeros=True,
          has_bias=True, sm_count=132),                                                      # split-K, scalar loads
    ]


# NVRTC versions allocate registers differently: 13.0 (the GPU host) spilled 12 bytes of a config that
# 13.5 (here) fitted in 128 registers.  So every heuristic config must also compile without spills
# under a cap HEADROOM registers lower than the one it runs with: an NVRTC needing up to 12% more
# registers than this one still fits.
HEADROOM = 16


@pytest.fixture(scope="module")
def compiled():
    import rtkernels as rtk
    out = []
    for cfg in _compiled_configs():
        kernels = {name: rtk.get_kernel(cfg, name, arch="sm_90") for name in QuantGemvConfig.kernels}
        tight = cfg.replace(max_registers=cfg.register_cap - HEADROOM)
        out.append((cfg, kernels, rtk.get_kernel(tight, "quant_gemv", arch="sm_90")))
    return out


def test_heuristic_configs_compile_clean(compiled):
    from rtkernels.inspect import sass_stats
    assert any(c.split_k > 1 for c, _, _ in compiled) and any(c.m_tiles == 2 for c, _, _ in compiled)
    assert sum(c.m_tiles == 1 and c.row_tiles == 2 for c, _, _ in compiled) == 3
    for cfg, kernels, tight in compiled:
        for name, k in kernels.items():
            r = k.resources
            assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, (cfg.key(), name, r)
        # two m tiles with group scales take 4 slots in 128 registers with none to spare (gemv.py:
        # measured without spill under NVRTC 13.0 and 13.5), and so do two row tiles (at one m tile
        # too): checked at their own cap only
        if not (cfg.row_tiles == 2 or cfg.m_tiles == 2 and cfg.group_size and cfg.unroll == 4):
            r = tight.resources
            assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, \
                (f"no headroom: spills under a cap of {cfg.register_cap - HEADROOM}", cfg.key(), r)
        main = kernels["quant_gemv"]
        assert main.resources.registers <= cfg.register_cap == 128, cfg.key()   # two CTAs of 8 warps per SM
        s = sass_stats(main.sass)
        assert s["hmma"] >= 4 * cfg.row_tiles * cfg.m_tiles * cfg.unroll, cfg.key()
        if cfg.w_vec == 16:
            # the slots' 2 * row_tiles weight loads (prologue and refill) and 2 * m_tiles x loads per
            # block (prologue and the next item's), all 16 bytes wide
            want = 2 * (2 * cfg.row_tiles * cfg.unroll) + 2 * cfg.m_tiles * (cfg.unroll + 1)
            if cfg.x_shared:   # x from the CTA's copy: 16-byte shared loads instead
                want = 2 * (2 * cfg.row_tiles * cfg.unroll)
                assert main.sass.count("LDS.128") >= 2 * cfg.m_tiles * (cfg.unroll + 1), cfg.key()
            assert s["ldg_128"] >= want, (cfg.key(), s["ldg_128"], want)
            assert "LDG.E.128.CONSTANT" in main.sass or "L1::no_allocate" in main.ptx


# ---- a NumPy model of the kernel's dequantization (the constants of templates/quant_gemv.cu.j2) ------
def _prmt(a, b, sel):
    by = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(by[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


@pytest.mark.parametrize("half", [True, False])
def test_e4m3_bit_trick_model(half):
    """All 256 e4m3 encodings through prmt + shift/mask + one multiply by 2^8 (half) / 2^120 (bf16)
    equal their values (NaN encodings read as +-480)."""
    shift, mask = (1, 0x3F803F80) if half else (4, 0x07F007F0)
    got = []
    for b in range(0, 256, 4):
        w = b | (b + 1) << 8 | (b + 2) << 16 | (b + 3) << 24
        for sel in (0x1404, 0x3424):
            t = _prmt(w, 0, sel)
            r = ((t >> shift) & mask) | (t & 0x80008000)
            for lane in (r & 0xFFFF, r >> 16):
                if half:
                    got.append(float(np.array([lane], np.uint16).view(np.float16)[0]) * 2.0 ** 8)
                else:
                    got.append(float(np.array([lane << 16], np.uint32).view(np.float32)[0]) * 2.0 ** 120)
    want = qm.E4M3_VALUES.copy()
    want[0x7F], want[0xFF] = 480.0, -480.0
    np.testing.assert_array_equal(np.array(got), want)


@pytest.mark.parametrize("kind", ["int8", "uint8"])
def test_integer_exponent_trick_model(kind):
    """Every byte and zero point: half(0x64XX) - (1024 + offset) and float(0x4B0000XX) - (2^23 +
    offset) give q - zero exactly (offset = zero, plus 128 for int8 after the byte flip)."""
    zs = range(-128, 128, 17) if kind == "int8" else range(0, 256, 17)
    for z in zs:
        off = (128 if kind == "int8" else 0) + z
        for q in (range(-128, 128) if kind == "int8" else range(256)):
            u = ((q & 0xFF) ^ 0x80) if kind == "int8" else q
            h = np.array([_prmt(u, 0x64646464, 0x4140) & 0xFFFF], np.uint16).view(np.float16)[0]
            hoff = np.float16(1024 + off)
            assert float(np.float16(h - hoff)) == q - z
            f = np.array([_prmt(u, 0x4B000000, 0x7440)], np.uint32).view(np.float32)[0]
            d = np.float32(f - np.float32(8388608 + off))
            assert float(d) == q - z
            # bf16: the float's top half (prmt 0x7632 of two floats) is exact, |q - zero| <= 255
            top = int(np.array([d], np.float32).view(np.uint32)[0]) >> 16
            assert float(np.array([top << 16], np.uint32).view(np.float32)[0]) == q - z


# ---- quantization against brute-force references --------------------------------------------------
def test_encode_e4m3_is_nearest_even():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(5000) * 60, rng.standard_normal(2000) * 0.02,
                        [0.0, -0.0, 448, 460, 500, -1e6, 2 ** -10, 1.5 * 2 ** -9, 2.5 * 2 ** -9, 1.0625, 1.1875,
                         -1.0625, 2 ** -6 * 1.0625]])
    bits = qm.encode_e4m3(np, x)
    vals = qm.E4M3_VALUES[bits]
    finite = np.where(np.isnan(qm.E4M3_VALUES), np.inf, qm.E4M3_VALUES)
    xc = np.clip(x, -448, 448)
    dist = np.abs(finite[None, :] - xc[:, None])
    best = dist.min(axis=1)
    assert np.all(np.abs(vals - xc) == best)
    # ties go to the even mantissa: 1.0625 lies between 1.0 (m=0) and 1.125 (m=1)
    assert vals[-4] == 1.0 and vals[-3] == 1.25 and vals[-2] == -1.0
    assert not np.any(np.isnan(vals))


@pytest.mark.parametrize("kind", ["int8", "uint8", "float8_e4m3"])
@pytest.mark.parametrize("group", [None, 64, 128])
def test_quantize_weight_numpy(kind, group):
    rng = np.random.default_rng(2)
    n, k = 37, 200                        # k not a multiple of the group: a short last group
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.1, 3, (n, 1)).astype(np.float32)
    w[3] = 0.0                            # an all-zero row: scale 1
    res = qm.quantize_weight(w, dtype=kind, group_size=group)
    q, s = res[:2]
    z = res[2] if kind == "uint8" else None
    assert len(res) == (3 if kind == "uint8" else 2)
    ng = -(-k // group) if group else None
    assert s.dtype == np.float32 and s.shape == ((n,) if group is None else (n, ng))
    assert q.shape == (n, k) and q.dtype == (np.int8 if kind == "int8" else np.uint8)
    g = group or k
    for r in range(n):
        for j in range(0, k, g):
            blk = w[r, j:j + g].astype(np.float64)
            sc = float(s[r] if group is None else s[r, j // g])
            if not np.any(blk):
                assert sc == 1.0
                continue
            if kind == "int8":
                assert np.isclose(sc, np.abs(blk).max() / 127, rtol=1e-6)
                qi = q[r, j:j + g].astype(np.int64)
                np.testing.assert_array_equal(qi, np.clip(np.rint(blk / sc), -127, 127))
            elif kind == "uint8":
                lo, hi = min(blk.min(), 0.0), max(blk.max(), 0.0)
                assert np.isclose(sc, (hi - lo) / 255, rtol=1e-6)
                zz = int(z[r] if group is None else z[r, j // g])
                assert zz == np.clip(np.rint(-lo / sc), 0, 255)
                deq = (q[r, j:j + g].astype(np.float64) - zz) * sc
                assert np.all(np.abs(deq - blk) <= 0.5 * sc * (1 + 1e-5))
            else:
                assert np.isclose(sc, np.abs(blk).max() / 448, rtol=1e-6)
                deq = qm.E4M3_VALUES[q[r, j:j + g]] * sc
                # round to nearest e4m3 of blk / sc: within half a step (2^-4 relative, 2^-10 absolute)
                y = blk / sc
                assert np.all(np.abs(deq / sc - y) <= np.maximum(np.abs(y) * 2.0 ** -4, 2.0 ** -10) * (1 + 1e-6))
    ref = qm.dequantize_reference(q, s, group_size=group, zeros=z, weight_dtype=kind)
    assert ref.shape == (n, k)


def test_quantize_weight_errors():
    w = np.ones((4, 64), np.float32)
    with pytest.raises(ConfigError) as e:
        qm.quantize_weight(w, dtype="int4")
    assert e.value.field == "dtype"
    with pytest.raises(ConfigError) as e:
        qm.quantize_weight(w, group_size=32)
    assert e.value.field == "group_size" and "multiple of 64" in str(e.value)
    with pytest.raises(ConfigError):
        qm.quantize_weight(np.ones(8, np.float32))


def test_reference_matches_manual():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 130)).astype(np.float32)
    q, s, z = qm.quantize_weight(w, dtype="uint8", group_size=64)
    x = rng.standard_normal((3, 130))
    b = rng.standard_normal(5)
    deq = np.empty((5, 130))
    for r in range(5):
        for j in range(130):
            deq[r, j] = (float(q[r, j]) - float(z[r, j // 64])) * float(s[r, j // 64])
    want = np.maximum(x @ deq.T + b, 0)
    got = qm.quantized_matmul_reference(x, q, s, group_size=64, zeros=z, bias=b, activation="relu")
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.abs(deq - w).max() < 0.05 * np.abs(w).max()


# ---- GPU -------------------------------------------------------------------------------------------
TOL = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def _case(rng, m, n, k, dtype, kind, group, zeros, lead=None):
    """(x device, x float64, w_q, scales, zeros-or-None) with x (m, k) (or lead + (k,))."""
    from gpu_util import random_array
    import cupy as cp
    w = rng.standard_normal((n, k)).astype(np.float32)
    res = qm.quantize_weight(w, dtype=kind, group_size=group)   # uint8: with zeros
    q, s = res[0], res[1]
    z = res[2] if len(res) == 3 else None
    if zeros and kind == "int8":   # int8 with zero points: w = (q - z) * s
        z = rng.integers(-20, 20, s.shape).astype(np.int8)
    x, x64 = random_array(rng, (lead or (m,)) + (k,), dtype)
    return x, x64, cp.asarray(q), cp.asarray(s), None if z is None else cp.asarray(z), q, s, z


def _check(got_dev, x64, q, s, z, group, kind, dtype, bias64=None, act=None, what=""):
    from gpu_util import to_f64
    got = got_dev if isinstance(got_dev, np.ndarray) else to_f64(got_dev, dtype)
    ref = qm.quantized_matmul_reference(x64, q, s, group_size=group, zeros=z, bias=bias64, activation=act,
                                        weight_dtype=kind)
    w = qm.dequantize_reference(q, s, group_size=group, zeros=z, weight_dtype=kind)
    scale = np.sqrt((x64 ** 2) @ (w ** 2).T)      # size of the sum's terms
    err = np.abs(got - ref)
    bound = TOL[dtype] * (np.abs(ref) + 4 * scale) + 1e-30
    assert not np.any(np.isnan(got)), f"{what}: NaN in the output"
    worst = float((err / bound).max()) if err.size else 0.0
    where = np.unravel_index(np.argmax(err / bound), err.shape) if err.size else ()
    assert worst <= 1.0, f"{what}: max error {err.max():.3g} at {where} ({worst:.2f}x the bound; " \
                         f"max |ref| {np.abs(ref).max():.3g})"


SHAPES = [(1, 4096, 4096), (3, 7, 72), (16, 129, 129), (17, 129, 72), (33, 4096, 8), (1, 1, 8), (16, 4096, 129),
          (3, 129, 4096), (4, 7, 4096), (16, 1, 72), (1, 129, 4104)]
KINDS = [("int8", None, False), ("int8", 64, False), ("int8", 128, True), ("uint8", 128, True),
         ("float8_e4m3", None, False), ("float8_e4m3", 128, False)]


# each shape with every other weight kind (alternating by shape): each kind meets about half the
# shapes, and the GPU host compiles ~30 kernels instead of ~60
CASES = [(*shape, *kind) for i, shape in enumerate(SHAPES) for j, kind in enumerate(KINDS) if (i + j) % 2 == 0]


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, kind, group, zeros", CASES)
def test_quantized_matmul_gpu(m, n, k, kind, group, zeros):
    import cupy as cp
    from gpu_util import poison
    import rtkernels as rtk
    dtype = "bfloat16" if (m + n + k) % 2 else "float16"
    rng = np.random.default_rng(m * 1000003 + n * 101 + k)
    x, x64, qd, sd, zd, q, s, z = _case(rng, m, n, k, dtype, kind, group, zeros)
    wdt = "float8_e4m3" if kind == "float8_e4m3" else None
    out = poison(cp.empty((m, n), dtype=x.dtype))
    rtk.quantized_matmul(x, qd, sd, group_size=group, zeros=zd, out=out, weight_dtype=wdt, dtype=dtype)
    cfg = qm.heuristic_config(dtype, min(m, 16), n, k, weight_dtype=kind, group_size=group or 0,
                              has_zeros=zeros, sm_count=132)
    _check(out, x64, q, s, z, group, kind, dtype,
           what=f"M={m} N={n} K={k} {kind} group={group} zeros={zeros} {dtype} ({cfg.key()})")


def _two_runs(x, qd, sd, zd, group, kind, dtype, cfg, what, **kw):
    """rtk.quantized_matmul through ``cfg`` twice, each into a poisoned output; the two must be
    bit-equal (no arrival order in the sums).  Returns the second output."""
    import cupy as cp
    from gpu_util import poison
    import rtkernels as rtk
    m, n = x.shape[0], qd.shape[0]
    outs = []
    for _ in range(2):
        out = poison(cp.empty((m, n), dtype=x.dtype))
        rtk.quantized_matmul(x, qd, sd, group_size=group, zeros=zd, out=out, dtype=dtype, config=cfg,
                             weight_dtype="float8_e4m3" if kind == "float8_e4m3" else None, **kw)
        outs.append(out)
    assert cp.array_equal(outs[0], outs[1]), f"{what}: two runs differ"
    return outs[1]


# tilings through config=: several tiles per CTA (persistent, 1 CTA per SM: 138 tiles of 16 rows
# over 132 SMs, the last tile 8 rows), K slices of 8 or 9 blocks against 3 slots (padded groups),
# warps along N and K, 16 warps, one CTA per tile, row_tiles 2, split-K beside persistence
TILINGS = [dict(), dict(ctas_per_sm=1, unroll=3), dict(num_warps=8, warps_k=4, unroll=3),
           dict(num_warps=16, warps_k=16, ctas_per_sm=1, unroll=2), dict(persistent=False, unroll=6),
           dict(row_tiles=2, unroll=2, ctas_per_sm=1), dict(split_k=3, ctas_per_sm=1, unroll=4),
           # staged slots (shared memory, cp.async), with a cluster split (sm_90), padded groups of 12
           dict(staged=True, unroll=8), dict(staged=True, unroll=4, split_k=3, cluster=True),
           dict(staged=True, unroll=12, ctas_per_sm=1, split_k=2),
           # the 4-CTA shape of two row tiles; x_half (bfloat16 kinds) through a cluster split and a
           # global split
           dict(row_tiles=2, unroll=2, num_warps=4, warps_k=4, ctas_per_sm=4),
           dict(x_half=True, staged=True, unroll=4, split_k=3, cluster=True),
           dict(x_half=True, split_k=3, ctas_per_sm=1, unroll=4)]
TILING_KINDS = [("int8", 128, True, "bfloat16"), ("float8_e4m3", None, False, "float16"),
                ("uint8", 64, True, "bfloat16")]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16])
def test_tilings_gpu(m):
    n, k = 2200, 4160   # 65 blocks of 64 over 8 warps
    rng = np.random.default_rng(40 + m)
    cases = [(kd, _case(rng, m, n, k, kd[3], *kd[:3])) for kd in TILING_KINDS]
    from rtkernels import device
    for i, t in enumerate(TILINGS):
        (kind, group, zeros, dtype), (x, x64, qd, sd, zd, q, s, z) = cases[i % len(cases)]
        base = qm.heuristic_config(dtype, m, n, k, weight_dtype=kind, group_size=group or 0, has_zeros=zeros)
        cfg = base.replace(**t)
        if cfg.cluster and not device.current_arch().startswith("sm_9"):
            continue   # (clusters need sm_90)
        what = f"M={m} N={n} K={k} {kind} group={group} zeros={zeros} {dtype} tiling {cfg.tag()}"
        out = _two_runs(x, qd, sd, zd, group, kind, dtype, cfg, what)
        _check(out, x64, q, s, z, group, kind, dtype, what=what)


# 32-row tiles at one m tile with group scales (gemv._group_row_tiles): x's three bfloat16 paths (the
# grid's copy, the conversion kernel's, the bfloat16 MMAs) and float16 x, group 64 / 128, zero points
GROUP_ROW_TILE_CASES = [("uint8", 128, True, "bfloat16", dict(x_half=True, x_grid=True)),
                        ("int8", 128, False, "bfloat16", dict(x_half=True, x_grid=True)),
                        ("int8", 128, False, "bfloat16", dict(x_half=True, x_grid=False)),
                        ("int8", 64, True, "bfloat16", dict(x_half=False, x_grid=False)),
                        ("float8_e4m3", 128, False, "float16", {}), ("int8", 64, False, "float16", {})]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8])
def test_group_row_tiles_gpu(m):
    """N = 9000 (282 32-row tiles, the last of 8 rows: its second row tile and rows g + 8 do not
    exist), K = 1104 (a last block of 16 elements, a last group of 16 or 80), bias + SiLU, 2 and 1 CTAs
    per SM (1-2 and 2-3 tiles each); two runs bit-equal, against the float64 reference."""
    from gpu_util import random_array
    n, k = 9000, 1104
    rng = np.random.default_rng(500 + m)
    for kind, group, zeros, dtype, xmode in GROUP_ROW_TILE_CASES:
        x, x64, qd, sd, zd, q, s, z = _case(rng, m, n, k, dtype, kind, group, zeros)
        b, b64 = random_array(rng, (n,), dtype)
        base = qm.heuristic_config(dtype, m, n, k, weight_dtype=kind, group_size=group, has_zeros=zeros,
                                   has_bias=True, activation="silu")
        for cfg in (base.replace(row_tiles=2, unroll=2, x_shared=False, **xmode),
                    base.replace(row_tiles=2, unroll=2, x_shared=False, ctas_per_sm=1, **xmode)):
            what = f"M={m} N={n} K={k} {kind} group={group} zeros={zeros} {dtype} tiling {cfg.tag()}"
            out = _two_runs(x, qd, sd, zd, group, kind, dtype, cfg, what, bias=b, activation="silu")
            _check(out, x64, q, s, z, group, kind, dtype, bias64=b64, act="silu", what=what)


@pytest.mark.gpu
@pytest.mark.parametrize("kind, group, zeros, dtype", [("int8", None, False, "bfloat16"), ("uint8", 64, True, "float16")])
def test_many_tiles_per_cta_gpu(kind, group, zeros, dtype):
    """Persistent CTAs walking 4-5 tiles each (563 tiles over 132 or so CTAs), K = 1088: 17 blocks
    over 8 warps (2-3 each) against 4 slots, so every tile's group is padded and the slots run on
    into the next tile's items; against the heuristic's own tiling bit for bit where they agree."""
    import cupy as cp
    from gpu_util import poison
    import rtkernels as rtk
    m, n, k = 3, 9000, 1088
    rng = np.random.default_rng(77)
    x, x64, qd, sd, zd, q, s, z = _case(rng, m, n, k, dtype, kind, group, zeros)
    cfg = qm.heuristic_config(dtype, m, n, k, weight_dtype=kind, group_size=group or 0, has_zeros=zeros)
    outs = {}
    for c in (cfg.replace(ctas_per_sm=1), cfg.replace(persistent=False)):
        out = poison(cp.empty((m, n), dtype=x.dtype))
        rtk.quantized_matmul(x, qd, sd, group_size=group, zeros=zd, out=out, dtype=dtype, config=c)
        _check(out, x64, q, s, z, group, kind, dtype, what=f"M={m} N={n} K={k} {kind} {dtype} tiling {c.tag()}")
        outs[c.tag()] = out
    a, b = outs.values()
    assert cp.array_equal(a, b), "the same K slices summed in the same order must agree bit for bit"


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (16, 129, 4096), (33, 7, 72)])
def test_bias_activation_gpu(m, n, k, act):
    from gpu_util import random_array
    import rtkernels as rtk
    dtype = "bfloat16"
    rng = np.random.default_rng(7 + m + n)
    x, x64, qd, sd, zd, q, s, z = _case(rng, m, n, k, dtype, "int8", 128, False)
    b, b64 = random_array(rng, (n,), dtype)
    y = rtk.quantized_matmul(x, qd, sd, group_size=128, bias=b, activation=act, dtype=dtype)
    _check(y, x64, q, s, z, 128, "int8", dtype, bias64=b64, act=act, what=f"{act} M={m} N={n} K={k}")


@pytest.mark.gpu
def test_strided_views_and_batch_gpu():
    """x as a row slice (read in place), a column-strided view (copied), batched leading dims; out as a
    row slice of a wider poisoned array whose other columns stay untouched."""
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    rng = np.random.default_rng(11)
    n, k = 129, 4096
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, s = qm.quantize_weight(w, dtype="int8", group_size=64)
    qd, sd = cp.asarray(q), cp.asarray(s)
    big, big64 = random_array(rng, (5, k + 24), "float16")
    outbig = poison(cp.empty((5, n + 9), dtype=cp.float16))
    rtk.quantized_matmul(big[:, 8:8 + k], qd, sd, group_size=64, out=outbig[:, :n])
    _check(outbig[:, :n], big64[:, 8:8 + k], q, s, None, 64, "int8", "float16", what="row slice")
    assert np.all(np.isnan(to_f64(outbig[:, n:], "float16"))), "columns past N were written"
    wide, wide64 = random_array(rng, (3, 2 * k), "float16")
    y = rtk.quantized_matmul(wide[:, ::2], qd, sd, group_size=64)
    _check(y, wide64[:, ::2], q, s, None, 64, "int8", "float16", what="column-strided x")
    xb, xb64 = random_array(rng, (2, 3, k), "float16")
    yb = rtk.quantized_matmul(xb, qd, sd, group_size=64)
    assert yb.shape == (2, 3, n)
    _check(yb.reshape(6, n), xb64.reshape(6, k), q, s, None, 64, "int8", "float16", what="batched x")


@pytest.mark.gpu
def test_deterministic_and_replay_gpu():
    """Split-K (N = 129) runs twice bit-identically, through the recorded plan the second time."""
    import cupy as cp
    import rtkernels as rtk
    rng = np.random.default_rng(12)
    x, x64, qd, sd, zd, q, s, z = _case(rng, 4, 129, 8192, "bfloat16", "int8", None, False)
    y1 = rtk.quantized_matmul(x, qd, sd, dtype="bfloat16")
    n_plans = len(qm._PLANS)
    y2 = rtk.quantized_matmul(x, qd, sd, dtype="bfloat16")
    assert len(qm._PLANS) == n_plans
    assert qm.heuristic_config("bfloat16", 4, 129, 8192, sm_count=cp.cuda.Device().attributes[
        "MultiProcessorCount"]).split_k > 1
    assert cp.array_equal(y1, y2)
    _check(y2, x64, q, s, z, None, "int8", "bfloat16", what="split-K replay")


@pytest.mark.gpu
def test_errors_gpu():
    import cupy as cp
    import rtkernels as rtk
    x = cp.zeros((2, 128), cp.float16)
    q = cp.zeros((8, 128), cp.int8)
    s = cp.ones((8,), cp.float32)
    for kwargs, field in ((dict(group_size=48), "group_size"), (dict(activation="tanh"), "activation"),
                          (dict(zeros=cp.zeros((8,), cp.uint8)), "zeros"),
                          (dict(bias=cp.zeros((7,), cp.float16)), "bias"),
                          (dict(out=cp.zeros((2, 9), cp.float16)), "out")):
        with pytest.raises(ConfigError) as e:
            rtk.quantized_matmul(x, q, s, **kwargs)
        assert e.value.field == field, (kwargs, e.value)
    with pytest.raises(ConfigError) as e:
        rtk.quantized_matmul(x, q, cp.ones((8, 2), cp.float32))          # group scales without group_size
    assert e.value.field == "scales"
    with pytest.raises(ConfigError) as e:
        rtk.quantized_matmul(x, q[:, ::2], s)
    assert e.value.field == "w_q"
    with pytest.raises(ConfigError) as e:
        rtk.quantized_matmul(cp.zeros((2, 64), cp.float16), q, s)
    assert e.value.field == "x"
    with pytest.raises(ConfigError) as e:
        rtk.quantized_matmul(x.astype(cp.float32), q, s)
    assert e.value.field == "x"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 40])
def test_torch_inputs_gpu(m):
    torch = pytest.importorskip("torch")
    import rtkernels as rtk
    n, k = 4096, 4096
    g = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
    for kind, group in (("float8_e4m3", 128), ("int8", None)):
        q, s = qm.quantize_weight(w, dtype=kind, group_size=group)
        assert q.is_cuda and (q.dtype == torch.float8_e4m3fn if kind == "float8_e4m3" else q.dtype == torch.int8)
        for _ in range(2):   # the second call replays the plan
            y = rtk.quantized_matmul(x, q, s, group_size=group, bias=b, activation="silu")
        assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.shape == (m, n)
        x64 = x.double().cpu().numpy()
        qh = q.view(torch.uint8).cpu().numpy() if kind == "float8_e4m3" else q.cpu().numpy()
        _check(y.float().cpu().numpy().astype(np.float64), x64, qh, s.cpu().numpy(), None, group, kind, "bfloat16",
               bias64=b.double().cpu().numpy(), act="silu", what=f"torch {kind} M={m}")
        # the same quantization on the host
        qn = qm.quantize_weight(w.float().cpu().numpy(), dtype=kind, group_size=group)
        np.testing.assert_array_equal(qh, qn[0])
        np.testing.assert_array_equal(s.cpu().numpy(), qn[1])


@pytest.mark.gpu
@pytest.mark.parametrize("m, grid", [(16, False), (8, False), (16, True)])
def test_x_half_extreme_rows_gpu(m, grid):
    """x_half's per-row power of two: rows near bfloat16's largest and smallest normal values, a zero
    row, a row spanning 2^40, rows with inf and NaN, through the float16 copy (the conversion
    kernel's at M = 16, a CTA's own at M = 8, the grid's own at M = 16 with grid) and without it
    (config=): finite rows agree with the float64 reference; inf / NaN land where the bfloat16 MMAs
    put them."""
    import cupy as cp
    from gpu_util import bf16_bits_from_f32, f32_from_bf16_bits, poison, to_f64
    import rtkernels as rtk
    rng = np.random.default_rng(77)
    n, k = 520, 1096
    xf = rng.standard_normal((m, k)).astype(np.float32)
    xf[0] *= 2.0 ** 100   # (2^120 overflows the bfloat16 MMAs' float32 sums: the baseline's limit)
    xf[1] *= 2.0 ** -120
    xf[2] = 0
    xf[3, ::2] *= 2.0 ** 20
    xf[3, 1::2] *= 2.0 ** -20
    xf[4, 5] = np.inf
    xf[5, 7] = np.nan
    xf[6, 9] = -np.inf
    xf[7] *= 60000.0
    bits = bf16_bits_from_f32(xf)
    x64 = f32_from_bf16_bits(bits).astype(np.float64)
    x = cp.asarray(bits)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, sc = qm.quantize_weight(w, dtype="int8")
    qd, sd = cp.asarray(q), cp.asarray(sc)
    base = qm.heuristic_config("bfloat16", m, n, k, sm_count=132, x_half=True, x_shared=m <= 8)
    assert base.x_shared == (m <= 8)   # m = 8: each CTA's own copy
    if grid:
        base = base.replace(x_grid=True)
    outs = {}
    for xh in (True, False):
        out = poison(cp.empty((m, n), cp.uint16))
        rtk.quantized_matmul(x, qd, sd, out=out, dtype="bfloat16",
                             config=base if xh else base.replace(x_half=False, x_shared=False, x_grid=False))
        outs[xh] = to_f64(out, "bfloat16")
    finite = [r for r in range(m) if np.isfinite(x64[r]).all()]
    for xh, got in outs.items():
        big = [r for r in finite if np.abs(x64[r]).max() > 2.0 ** 90]
        _check(got[finite], x64[finite], q, sc, None, None, "int8", "bfloat16", what=f"x_half={xh} finite rows")
        assert np.isfinite(got[big]).all()
    a, b = outs[True], outs[False]
    for r in range(m):
        np.testing.assert_array_equal(np.isnan(a[r]), np.isnan(b[r]), err_msg=f"row {r}: NaN positions")
        np.testing.assert_array_equal(np.isinf(a[r]), np.isinf(b[r]), err_msg=f"row {r}: inf positions")
    assert np.isnan(a[5]).all() and np.isinf(a[4]).sum() + np.isnan(a[4]).sum() == n
    assert (a[2] == 0).all() and np.abs(a[1]).max() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("lib, grid", [("cupy", False), ("torch", False), ("cupy", True), ("torch", True)])
def test_x_half_graph_replay_gpu(lib, grid):
    """Captured in a CUDA graph (the conversion and the GEMV; with grid, the GEMV whose own CTAs
    convert, whose count must read zero again for every replay), replayed with new x contents: the
    replay equals the eager call bit for bit and the reference."""
    import cupy as cp
    from gpu_util import capture_cupy, refill
    import rtkernels as rtk
    rng = np.random.default_rng(5)
    m, n, k = 9, 10240, 4160
    x, x64, qd, sd, zd, q, s, z = _case(rng, m, n, k, "bfloat16", "int8", None, False)
    cfg = qm.heuristic_config("bfloat16", m, n, k)
    assert cfg.x_half
    kw = dict(config=cfg.replace(x_grid=grid))
    if lib == "torch":
        torch = pytest.importorskip("torch")
        xt = torch.from_dlpack(x).view(torch.bfloat16)
        qt, st = torch.from_dlpack(qd), torch.from_dlpack(sd)
        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        rtk.quantized_matmul(xt, qt, st, out=out, **kw)   # plan, workspace
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            rtk.quantized_matmul(xt, qt, st, out=out, **kw)
        for step in range(2):
            (xh2,) = refill(rng, (x,), "bfloat16")
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
            got = out.float().cpu().numpy().astype(np.float64)
            _check(got, xh2, q, s, z, None, "int8", "bfloat16", what=f"torch replay {step}")
            eager = rtk.quantized_matmul(xt, qt, st, **kw)
            torch.cuda.synchronize()
            assert torch.equal(eager, out), f"torch replay {step} != eager"
        return
    out = cp.empty((m, n), cp.uint16)
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        rtk.quantized_matmul(x, qd, sd, out=out, dtype="bfloat16", **kw)
        graph = capture_cupy(st, lambda: rtk.quantized_matmul(x, qd, sd, out=out, dtype="bfloat16", **kw))
        for step in range(2):
            (xh2,) = refill(rng, (x,), "bfloat16")
            st.synchronize()
            graph.launch(st)
            st.synchronize()
            _check(out, xh2, q, s, z, None, "int8", "bfloat16", what=f"cupy replay {step}")
            eager = rtk.quantized_matmul(x, qd, sd, dtype="bfloat16", **kw)
            st.synchronize()
            assert cp.array_equal(eager, out), f"cupy replay {step} != eager"


@pytest.mark.gpu
@pytest.mark.parametrize("k, shift, mode, m", [(4104, 1, "kernel", 5), (40000, 0, "kernel", 5), (1000, 3, "kernel", 5),
                                               (4104, 1, "shared", 5), (1000, 3, "shared", 2), (8192, 0, "shared", 8),
                                               (4104, 1, "grid", 5), (40000, 0, "grid", 3), (8200, 0, "grid", 16),
                                               (1001, 0, "kernel", 16), (1001, 0, "grid", 12), (4104, 1, "kernel", 16)])
def test_x_half_row_lengths_gpu(k, shift, mode, m):
    """The conversion's two ways through a row: held in registers (up to 8 vectors per thread in the
    kernel, 4 in the grid's CTAs), or read twice (longer rows: 4104 scalar elements of a misaligned
    slice, 5000 16-byte vectors, 1025 of them over 256 threads); and a CTA's own copy (x_shared) of
    such rows (M = 2, 5, 8).  M = 12 / 16 at one row tile: the interleaved copy, K = 1001 ending inside
    an 8-element piece (zero-filled to its end)."""
    shared = mode == "shared"
    import cupy as cp
    from gpu_util import poison
    import rtkernels as rtk
    rng = np.random.default_rng(k + shift + m)
    n = 300
    x, x64, qd, sd, zd, q, s, z = _case(rng, m, n, k + shift, "bfloat16", "int8", None, False)
    w = qm.dequantize_reference(q, s)
    q, s = qm.quantize_weight(w[:, shift:].astype(np.float32), dtype="int8")
    qd, sd = cp.asarray(q), cp.asarray(s)
    xs, xs64 = x[:, shift:], x64[:, shift:]
    out = poison(cp.empty((m, n), cp.uint16))
    cfg = qm.heuristic_config("bfloat16", m, n, k, x_vec=qm._vec_width(k, xs.data.ptr, xs.strides[0] // 2, 2, 8),
                              x_half=True, x_shared=shared, x_grid=False)
    if mode == "grid":
        cfg = cfg.replace(split_k=1, cluster=False, x_grid=True)
    assert cfg.x_shared == shared
    rtk.quantized_matmul(xs, qd, sd, out=out, dtype="bfloat16", config=cfg)
    assert cfg.x_vec == (8 if shift == 0 and k % 8 == 0 else 1), cfg.x_vec
    _check(out, xs64, q, s, None, None, "int8", "bfloat16", what=f"K={k} shift={shift} x_vec={cfg.x_vec}")


@pytest.mark.gpu
def test_x_grid_oversubscribed_gpu():
    """The grid's copy with more CTAs than the SMs hold at once (one CTA per 16-row tile, not
    persistent: 1792 CTAs for 264 slots), twice in a row on one stream and once on a second stream
    at the same time: the waiting CTAs never hold the slots the converting ones (the lowest
    indices) need, every call finishes, and each stream's count reads zero for the next."""
    import cupy as cp
    from gpu_util import poison
    import rtkernels as rtk
    rng = np.random.default_rng(11)
    m, n, k = 16, 28672, 1024
    x, x64, qd, sd, zd, q, s, z = _case(rng, m, n, k, "bfloat16", "uint8", 128, True)
    cfg = qm.heuristic_config("bfloat16", m, n, k, weight_dtype="uint8", group_size=128, has_zeros=True,
                              x_grid=True).replace(persistent=False)
    assert cfg.x_grid and cfg.grid(n, 132)[0] == cfg.tiles(n) > 2 * 132
    outs = [poison(cp.empty((m, n), dtype=x.dtype)) for _ in range(3)]
    other = cp.cuda.Stream(non_blocking=True)
    rtk.quantized_matmul(x, qd, sd, group_size=128, zeros=zd, out=outs[0], dtype="bfloat16", config=cfg)
    with other:
        rtk.quantized_matmul(x, qd, sd, group_size=128, zeros=zd, out=outs[2], dtype="bfloat16", config=cfg)
    rtk.quantized_matmul(x, qd, sd, group_size=128, zeros=zd, out=outs[1], dtype="bfloat16", config=cfg)
    other.synchronize()
    cp.cuda.Device().synchronize()
    for i, out in enumerate(outs):
        _check(out, x64, q, s, z, 128, "uint8", "bfloat16", what=f"oversubscribed grid copy, call {i}")
    assert cp.array_equal(outs[0], outs[1]) and cp.array_equal(outs[0], outs[2])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["kernel", "shared", "grid"])
@pytest.mark.parametrize("m, n, k, kind, group, zeros", [c for c in CASES if c[3] != "float8_e4m3" and c[0] <= 16])
def test_x_half_shapes_gpu(m, n, k, kind, group, zeros, mode):
    """The awkward shapes of test_quantized_matmul_gpu through x_half (config=): the conversion
    kernel's copy, a CTA's own (M <= 8) and the grid's own (split-K 1; grids smaller than M
    included, whose CTAs convert several rows): bfloat16 x, integer weights, split-K included."""
    shared = mode == "shared"
    if shared and m > 8:
        pytest.skip("x_shared: M <= 8")
    import cupy as cp
    from gpu_util import poison
    import rtkernels as rtk
    rng = np.random.default_rng(m * 7 + n * 13 + k)
    x, x64, qd, sd, zd, q, s, z = _case(rng, m, n, k, "bfloat16", kind, group, zeros)
    cfg = qm.heuristic_config("bfloat16", m, n, k, weight_dtype=kind, group_size=group or 0, has_zeros=zd is not None,
                              x_half=True, x_shared=shared, x_grid=False)
    assert cfg.x_shared == shared
    if mode == "grid":
        cfg = cfg.replace(split_k=1, cluster=False, x_grid=True)
    out = poison(cp.empty((m, n), dtype=x.dtype))
    rtk.quantized_matmul(x, qd, sd, group_size=group, zeros=zd, out=out, dtype="bfloat16", config=cfg)
    _check(out, x64, q, s, z, group, kind, "bfloat16", what=f"x_half M={m} N={n} K={k} {kind} group={group} ({cfg.tag()})")


@pytest.mark.gpu
@pytest.mark.parametrize("kind, group, zeros, dtype, n, k", [("int8", None, False, "bfloat16", 300, 1000),
                                                          ("uint8", 64, True, "float16", 129, 200),
                                                          ("float8_e4m3", 128, False, "bfloat16", 77, 136),
                                                          ("int8", 128, True, "float16", 1, 7)])
def test_dequantize_weight_gpu(kind, group, zeros, dtype, n, k):
    """dequantize_weight against the float64 dequantization rounded as the kernel rounds it (the
    product to float32, then to dtype: exact), into a fresh array and into a poisoned ``out``."""
    import cupy as cp
    from gpu_util import poison, to_f64
    import rtkernels as rtk
    rng = np.random.default_rng(n + k)
    _, _, qd, sd, zd, q, s, z = _case(rng, 1, n, k, dtype, kind, group, zeros)
    kw = dict(group_size=group, zeros=zd, weight_dtype=kind if kind == "float8_e4m3" else None, dtype=dtype)
    ref = qm.dequantize_reference(q, s, group_size=group, zeros=z, weight_dtype=kind)
    got = rtk.dequantize_weight(qd, sd, **kw)
    rounded = to_f64(cp.asarray(ref, dtype=cp.float32).astype(cp.float16) if dtype == "float16" else
                     _bf16_bits(ref), dtype)
    assert np.array_equal(to_f64(got, dtype), rounded), (kind, group, zeros, dtype)
    out = poison(cp.empty((n, k), dtype=cp.float16 if dtype == "float16" else cp.uint16))
    assert rtk.dequantize_weight(qd, sd, out=out, **kw) is out and np.array_equal(to_f64(out, dtype), rounded)
    with pytest.raises(ConfigError, match="out"):
        rtk.dequantize_weight(qd, sd, out=cp.empty((n, k + 1), dtype=out.dtype), **kw)
    # an out starting 2 bytes past a 16-byte boundary (C-contiguous all the same)
    flat = poison(cp.empty(n * k + 8, dtype=out.dtype))
    shifted = flat[1:1 + n * k].reshape(n, k)
    assert rtk.dequantize_weight(qd, sd, out=shifted, **kw) is shifted
    edges = cp.concatenate([flat[:1], flat[1 + n * k:]]).view(cp.uint16)
    assert np.array_equal(to_f64(shifted, dtype), rounded) and bool(cp.all(edges == 0xFFFF))


def _bf16_bits(x64):
    """float64 values rounded to bfloat16 (round to nearest even) as uint16 bits on the device."""
    import cupy as cp
    b = np.asarray(x64, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return cp.asarray(b)


def test_dequantize_weight_checks():
    import rtkernels as rtk
    q = np.zeros((4, 64), np.int8)
    with pytest.raises(ConfigError, match="dtype"):
        rtk.dequantize_weight(q, np.ones(4, np.float32), dtype="float32")
    with pytest.raises(ConfigError, match="group_size"):
        rtk.dequantize_weight(q, np.ones(4, np.float32), group_size=48)
