"""The norm backward's load-ahead variants (NormBwdConfig prefetch / ring_rows / bulk_rows / blocks_per_sm).

CPU: the knobs' validation, the heuristic's choice, a few configs compile without spills (one
module each, shared through a module fixture; every heuristic config with
RTKERNELS_TEST_FULL_SWEEP=1), the ring's copies are cp.async (LDGSTS) and the bulk stages'
cp.async.bulk (UBLKCP).
GPU (-m gpu): every variant against the float64 references with several rows per worker (a ragged
last wave), the saved statistics given and recomputed, poisoned outputs, and the same bits twice.
"""
import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.arch import arch_number
from rtkernels.errors import ConfigError
from rtkernels.inspect import sass_stats
from rtkernels.ops import rowwise_bwd as rb
from rtkernels.ops.rowwise_bwd import NormBwdConfig
from sweep import FULL_SWEEP


# ---- configs (CPU) --------------------------------------------------------------------------------
@pytest.mark.parametrize("params, field", [
    (dict(dtype="bfloat16", vec=4, threads_per_row=256, block_size=256, ring_rows=2), "ring_rows"),   # 8-byte vectors
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, ring_rows=2, prefetch=True), "ring_rows"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, two_pass=True, prefetch=True), "prefetch"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, two_pass=True, ring_rows=2), "ring_rows"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, ring_rows=9), "ring_rows"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=512, block_size=512, vecs_per_thread=32, ring_rows=4),
     "ring_rows"),                                                                      # > 227 KiB of ring
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, blocks_per_sm=9), "blocks_per_sm"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, prefetch=1), "prefetch"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, merge_cluster=2), "merge_cluster"),  # no acc_smem
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, cluster_size=2, acc_smem=True,
          merge_cluster=2), "merge_cluster"),                                          # row clusters
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, acc_smem=True, merge_cluster=3),
     "merge_cluster"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, two_pass=True, acc_smem=True), "acc_smem"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, split_stats=0), "split_stats"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, two_pass=True, hold_weight=True),
     "hold_weight"),                                                                    # many columns per thread
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, hold_weight=1), "hold_weight"),
    (dict(dtype="bfloat16", vec=4, threads_per_row=256, block_size=256, bulk_rows=2), "bulk_rows"),  # 8-byte vectors
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, bulk_rows=2, ring_rows=2), "bulk_rows"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, bulk_rows=2, two_pass=True), "bulk_rows"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=256, block_size=256, bulk_rows=5), "bulk_rows"),
    (dict(dtype="bfloat16", vec=8, threads_per_row=512, block_size=512, vecs_per_thread=16, bulk_rows=4),
     "bulk_rows"),                                                                      # 512 KiB of stages
])
def test_load_ahead_config_errors_name_the_field(params, field):
    with pytest.raises(ConfigError) as e:
        NormBwdConfig(weight_dtype=params["dtype"], **params)
    assert e.value.field == field and field in str(e.value)


def test_ring_shared_memory():
    cfg = NormBwdConfig(dtype="bfloat16", weight_dtype="bfloat16", vec=8, threads_per_row=256, block_size=256,
                        vecs_per_thread=2, ring_rows=3)
    # per stage: dy and x, 16 bytes a slot, 2 slots per thread, and two statistics per thread
    assert cfg.shared_mem_bytes == 3 * 256 * (2 * 2 * 16 + 2 * 4)
    assert cfg.replace(ring_rows=0).shared_mem_bytes == 0
    # acc_smem: after the ring, float32 dweight and dbias sums for the thread's 2 x 8 elements
    assert cfg.replace(acc_smem=True).shared_mem_bytes == cfg.shared_mem_bytes + 256 * 2 * 8 * 4 * 2
    # bulk stages: dy and x, 16 bytes a slot (the statistics come by loads into registers)
    assert cfg.replace(ring_rows=0, bulk_rows=2).shared_mem_bytes == 2 * 256 * 2 * 2 * 16
    assert cfg.replace(ring_rows=0, bulk_rows=2).min_arch == 90


@pytest.mark.parametrize("n, arch, layer, acc, merge, min_blocks", [   # measured winners (rowwise_bwd.py)
    (1024, "sm_90", False, False, 1, 1), (1024, "sm_90", True, False, 1, 1),
    (4096, "sm_90", False, False, 1, 1), (4096, "sm_90", True, False, 1, 1),   # LayerNorm 4k: bulk stages
    (16384, "sm_90", False, True, 1, 4), (16384, "sm_90", True, True, 1, 4),
    (4096, "sm_80", True, True, 1, 4), (65536, "sm_90", False, True, 1, 2),
])
def test_plan_bwd_occupancy_knobs(n, arch, layer, acc, merge, min_blocks):
    cfg = rb.plan_bwd("norm_bwd", n, "bfloat16", 8, arch, layer=layer)
    assert (cfg.acc_smem, cfg.merge_cluster, cfg.min_blocks, cfg.split_stats) == (acc, merge, min_blocks, True)
    assert cfg.launch_cluster == cfg.cluster_size * merge
    assert cfg.min_arch == (90 if cfg.launch_cluster > 1 or cfg.bulk_rows else 80)


@pytest.mark.parametrize("n, dtype, vec", [
    (1024, "bfloat16", 8), (4096, "bfloat16", 8), (16384, "bfloat16", 8), (65536, "bfloat16", 8),
    (4096, "float32", 4), (1 << 20, "bfloat16", 8), (4096, "bfloat16", 4), (1000, "float16", 1),
])
def test_plan_bwd_loads_directly(n, dtype, vec):
    # measured: loading ahead (ring or prefetch) lost to direct loads at every row class (rowwise_bwd.py),
    # but on sm_90 with 16-byte vectors: lane groups take one bulk stage, block rows two, and so do
    # LayerNorm's 256-thread cluster rows (the 512-thread block and cluster rows load directly)
    for layer in (False, True):
        cfg = rb.plan_bwd("norm_bwd", n, dtype, vec, "sm_90", layer=layer)
        wide = vec * 2 == 16 and dtype == "bfloat16"
        staged = cfg.row_class == "block" and cfg.block_size <= 256 or \
            layer and cfg.row_class == "cluster" and cfg.block_size == 256
        bulk = 0 if not wide else 1 if cfg.row_class == "group" else 2 if staged else 0
        assert (cfg.ring_rows, cfg.prefetch, cfg.blocks_per_sm, cfg.bulk_rows) == (0, False, 0, bulk)


@pytest.mark.parametrize("n", [1024, 4096, 8192, 16384, 65536, 1 << 20])
def test_plan_bwd_holds_the_weight_on_resident_rows(n):
    # measured +2 to +8% at every resident row class (rowwise_bwd.py, _NORM_BWD_HOLD_W); two_pass rows load it
    for layer in (False, True):
        cfg = rb.plan_bwd("norm_bwd", n, "bfloat16", 8, "sm_90", layer=layer)
        assert cfg.hold_weight == (not cfg.two_pass), cfg.key()
        # float32 weights beside 16-bit rows (32 bytes a slot) stay loaded; float32 rows hold theirs
        assert not rb.plan_bwd("norm_bwd", n, "bfloat16", 8, "sm_90", weight_dtype="float32", layer=layer).hold_weight
        f32 = rb.plan_bwd("norm_bwd", n, "float32", 4, "sm_90", layer=layer)
        assert f32.hold_weight == (not f32.two_pass)


def test_held_weight_costs_its_packed_registers_only():
    # 2 x 16 bytes of bfloat16 weight per thread: 8 registers at 4k RMSNorm (3 blocks of 256 per SM stay),
    # not the 16 float32 conversions ptxas would hoist out of the row loop without rtk::forget
    cfg = rb.plan_bwd("norm_bwd", 4096, "bfloat16", 8, "sm_90").replace(bulk_rows=0)   # direct loads
    held = rtk.get_kernel(cfg, "rmsnorm_bwd_rows", arch="sm_90").resources.registers
    loaded = rtk.get_kernel(cfg.replace(hold_weight=False), "rmsnorm_bwd_rows", arch="sm_90").resources.registers
    assert held <= loaded + 8 and held * 256 * 3 <= 65536, (held, loaded)


# ---- a few configs compile without spills (CPU) ------------------------------------------------------
COMPILED = [   # (label, config, arch): the ring knob at each row class, prefetch, a heuristic config, sm_80
    ("1k group ring, float32 weights",
     rb.plan_bwd("norm_bwd", 1024, "bfloat16", 8, "sm_90", weight_dtype="float32").replace(ring_rows=2, bulk_rows=0),
     "sm_90"),
    ("16k cluster ring", rb.plan_bwd("norm_bwd", 16384, "bfloat16", 8, "sm_90").replace(ring_rows=2), "sm_90"),
    ("64k 512-thread cluster ring (128-register cap), float32 weights",
     rb.plan_bwd("norm_bwd", 65536, "bfloat16", 8, "sm_90", weight_dtype="float32").replace(ring_rows=2), "sm_90"),
    ("4k block prefetch", rb.plan_bwd("norm_bwd", 4096, "bfloat16", 8, "sm_90").replace(
        prefetch=True, min_blocks=1, bulk_rows=0), "sm_90"),
    ("16k cluster, the heuristic's direct loads", rb.plan_bwd("norm_bwd", 16384, "bfloat16", 8, "sm_90"), "sm_90"),
    ("sm_80 8k 512-thread block ring", rb.plan_bwd("norm_bwd", 8192, "bfloat16", 8, "sm_80").replace(ring_rows=2),
     "sm_80"),
    ("4k block, merged clusters", rb.plan_bwd("norm_bwd", 4096, "bfloat16", 8, "sm_90").replace(
        acc_smem=True, merge_cluster=4, min_blocks=4, bulk_rows=0), "sm_90"),
    ("1k group bulk stages", rb.plan_bwd("norm_bwd", 1024, "bfloat16", 8, "sm_90").replace(bulk_rows=2), "sm_90"),
    ("16k cluster bulk stages, sums in shared memory",
     rb.plan_bwd("norm_bwd", 16384, "bfloat16", 8, "sm_90", layer=True).replace(bulk_rows=2), "sm_90"),
    ("16k cluster, the first version", rb.plan_bwd("norm_bwd", 16384, "bfloat16", 8, "sm_90").replace(
        split_stats=False, acc_smem=False, min_blocks=1), "sm_90"),
]
ROWS_KERNELS = ("rmsnorm_bwd_rows", "layernorm_bwd_rows")


@pytest.fixture(scope="module")
def compiled():
    return {label: (cfg, {name: rtk.get_kernel(cfg, name, arch=arch) for name in ROWS_KERNELS})
            for label, cfg, arch in COMPILED}


def test_load_ahead_kernels_compile_without_spills(compiled):
    bad = [(label, name, k.resources) for label, (_, ks) in compiled.items() for name, k in ks.items()
           if k.resources.spill_stores or k.resources.spill_loads or sass_stats(k.sass)["ldl"]]
    assert bad == []


def test_occupancy_knobs_cut_registers(compiled):
    """What the heuristic's acc_smem / split_stats / min_blocks are for: 4 blocks of 256 threads per
    SM (<= 64 registers) where the first version's 16k kernels took 2 (> 85)."""
    for name in ROWS_KERNELS:
        new = compiled["16k cluster, the heuristic's direct loads"][1][name].resources.registers
        old = compiled["16k cluster, the first version"][1][name].resources.registers
        assert new <= 64 < 85 < old, (name, new, old)


def test_merged_clusters_read_peers_once(compiled):
    cfg, ks = compiled["4k block, merged clusters"]
    assert cfg.merge_cluster == 4
    for name, k in ks.items():
        # the merge: one barrier.cluster pair, and peers' 16-byte chunks through DSMEM
        assert "mapa.shared::cluster" in k.ptx and "ld.shared::cluster.v4.f32" in k.ptx, name


def test_ring_copies_by_cp_async(compiled):
    for label, (cfg, ks) in compiled.items():
        for name, k in ks.items():
            assert ("LDGSTS" in k.sass) == (cfg.ring_rows > 0), (label, name)
            assert ("UBLKCP" in k.sass) == (cfg.bulk_rows > 0), (label, name)
            # the bulk stages' barrier: the leader's arrive.expect_tx only (a cp.async arrive on it,
            # the statistics' first way, was synccheck's "Missing wait"); the statistics by LDG
            assert "ARRIVES.LDGSTSBAR" not in k.sass and ".A0T1" not in k.sass, (label, name)
            if cfg.ring_rows == 0 and cfg.bulk_rows == 0:
                assert sass_stats(k.sass)["ldg_128"] >= 1, (label, name)
            if cfg.bulk_rows:   # dy and x come only through the stages (the weight: 16-byte loads)
                assert "SYNCS" in k.sass, (label, name)


@pytest.mark.parametrize("n, shape", [
    (4608, (1, 256, 3)), (5120, (1, 256, 3)), (6144, (1, 256, 3)), (12288, (2, 256, 3)), (20480, (4, 256, 3)),
    (14336, (2, 256, 4)), (16384, (2, 256, 4)), (3072, (1, 128, 4)), (1280, (1, 64, 4)),   # kept: full, or < 256
])
def test_plan_bwd_refits_softmax_rows(n, shape):
    cfg = rb.plan_bwd("softmax_bwd", n, "bfloat16", 8, "sm_90")
    assert (cfg.cluster_size, cfg.threads_per_row, cfg.vecs_per_thread) == shape
    assert cfg.chunk_elements >= n
    assert rb.plan_bwd("softmax_bwd", n, "bfloat16", 8, "sm_80") == \
        rb.plan_bwd("softmax_bwd", n, "bfloat16", 8, "sm_80", fit=False)       # measured on sm_90 only
    assert rb.plan_bwd("norm_bwd", n, "bfloat16", 8, "sm_90") == \
        rb.plan_bwd("norm_bwd", n, "bfloat16", 8, "sm_90", fit=False)          # norm_bwd keeps its table


def test_bwd_heuristic_configs_list_every_softmax_refit():
    listed = {cfg for _, cfg in rb.heuristic_configs("sm_90")}
    for dtype, vec in (("bfloat16", 8), ("float16", 8), ("float32", 4)):
        for n in list(range(vec, 300000, 56 * vec)) + [4608, 5120, 12288, 151936]:
            assert rb.plan_bwd("softmax_bwd", n, dtype, vec, "sm_90") in listed, (dtype, n)


@pytest.mark.slow
@pytest.mark.skipif(not FULL_SWEEP, reason="~300 configs; RTKERNELS_TEST_FULL_SWEEP=1 compiles every one")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_norm_bwd_heuristic_config_compiles_without_spills(arch):
    bad = []
    for family, cfg in rb.heuristic_configs(arch):
        if family != "norm_bwd":
            continue
        for name in ROWS_KERNELS:
            r = rtk.get_kernel(cfg, name, arch=arch).resources
            if r.spill_stores or r.spill_loads:
                bad.append((cfg.key(), name, r))
    assert bad == []


# ==== GPU =============================================================================================
# Each width's heuristic tile with every way of loading ahead; rows chosen so that workers walk
# several rows each and the last wave is ragged (blocks_per_sm=1: ~4x the rows per worker).
LOAD_AHEAD = {
    "direct": dict(ring_rows=0, prefetch=False, bulk_rows=0),
    "prefetch": dict(ring_rows=0, prefetch=True, min_blocks=1, bulk_rows=0),   # a second register set: no cap
    "ring2": dict(ring_rows=2, bulk_rows=0),
    "ring3_1blk": dict(ring_rows=3, blocks_per_sm=1, bulk_rows=0),
    # the first version's kernel (both statistics paths in one, sums in registers, no cap)
    "old": dict(split_stats=False, acc_smem=False, merge_cluster=1, min_blocks=1),
    "acc_regs": dict(acc_smem=False, merge_cluster=1),
    "acc_smem_unmerged": dict(merge_cluster=1),
    # round 2: the next rows through cp.async.bulk stages per row team (sm_90)
    "bulk2": dict(bulk_rows=2),
    "bulk3_accreg": dict(bulk_rows=3, acc_smem=False, min_blocks=1),
}
LOAD_AHEAD_CASES = [(1024, 3001), (4096, 1111), (16384, 301)]
# the ring on row classes the heuristic does not pick: narrow lane groups with rows past the end of
# a block's last group, a barrier cluster (RowTeam), an unaligned width (a ragged last vector slot)
RING_CLASSES = [
    (200, 1001, dict(threads_per_row=8, block_size=64, vecs_per_thread=4, ring_rows=3)),
    (5000, 333, dict(threads_per_row=128, block_size=128, vecs_per_thread=8, cluster_size=2, ring_rows=2)),
    (3000, 517, dict(threads_per_row=128, block_size=128, vecs_per_thread=4, ring_rows=4, blocks_per_sm=2)),
]


# bulk stages on row classes the heuristic does not pick: lane groups of 8 (8 teams per block, a
# ragged row), a barrier cluster (RowTeam) with a partial last slot per block, an unaligned block
# row, merged clusters with fewer rows than workers (teams whose rows are all past the end)
BULK_CLASSES = [
    (200, 1001, dict(threads_per_row=8, block_size=64, vecs_per_thread=4, bulk_rows=3)),
    (5000, 333, dict(threads_per_row=128, block_size=128, vecs_per_thread=8, cluster_size=2, bulk_rows=2)),
    (3000, 517, dict(threads_per_row=128, block_size=128, vecs_per_thread=4, bulk_rows=4, blocks_per_sm=2)),
    (4096, 5, dict(threads_per_row=256, block_size=256, vecs_per_thread=2, acc_smem=True, merge_cluster=4,
                   bulk_rows=2)),
]


# bulk stages forced on at each width's heuristic tile (_check_config runs both ops, saved and
# recomputed statistics): one stage (the parity flips every row) with the tables' sums and cap, two
# with register sums (the LayerNorm 4k candidate).  Rows: 1, 7, 33 leave lane groups of a block
# without a row (1k: 4 teams per block; the host launches no more block / cluster workers than rows,
# so merged clusters in BULK_CLASSES cover whole workers without a row), 4097 a ragged last round
# over many stage wraps (16k: 301, to bound the float64 references).
BULK_EDGE_VARIANTS = {
    "bulk1": dict(bulk_rows=1),
    "bulk2_accreg": dict(bulk_rows=2, acc_smem=False, min_blocks=1),
}
BULK_EDGE_CASES = [(n, r) for n in (1024, 4096) for r in (1, 7, 33, 4097)] + [(16384, r) for r in (1, 7, 33, 301)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(BULK_EDGE_VARIANTS))
@pytest.mark.parametrize("n, rows", BULK_EDGE_CASES)
def test_norm_backward_bulk_edges_gpu(n, rows, variant):
    from rtkernels import device
    arch = device.current_arch()
    if arch_number(arch) < 90:
        pytest.skip("bulk copies need sm_90")
    cfgs = dict.fromkeys(rb.plan_bwd("norm_bwd", n, "bfloat16", 8, arch, weight_dtype="bfloat16", layer=layer)
                         .replace(**BULK_EDGE_VARIANTS[variant]) for layer in (False, True))
    for cfg in cfgs:
        _check_config(cfg, n, rows, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(LOAD_AHEAD))
@pytest.mark.parametrize("n, rows", LOAD_AHEAD_CASES)
def test_norm_backward_load_ahead_gpu(n, rows, variant):
    from rtkernels import device
    arch = device.current_arch()
    if LOAD_AHEAD[variant].get("bulk_rows") and arch_number(arch) < 90:
        pytest.skip("bulk copies need sm_90")
    # the heuristic's tile per op (its occupancy knobs differ at 4k): each distinct config once
    cfgs = dict.fromkeys(rb.plan_bwd("norm_bwd", n, "bfloat16", 8, arch, weight_dtype="bfloat16", layer=layer)
                         .replace(**LOAD_AHEAD[variant]) for layer in (False, True))
    for cfg in cfgs:
        _check_config(cfg, n, rows, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("n, rows, fields", BULK_CLASSES)
def test_norm_backward_bulk_row_classes_gpu(n, rows, fields):
    from rtkernels import device
    if arch_number(device.current_arch()) < 90:
        pytest.skip("bulk copies need sm_90")
    _check_config(NormBwdConfig(dtype="bfloat16", weight_dtype="bfloat16", vec=8, **fields), n, rows, str(fields))


# shared-memory sums merged by clusters on shapes the heuristic does not pick: narrow lane groups,
# 2- and 1-element vectors (2- and 1-float shared chunks), clusters of 8, rows fewer than workers
ACC_CLASSES = [
    (200, 1001, dict(threads_per_row=8, block_size=64, vecs_per_thread=4, acc_smem=True, merge_cluster=2)),
    (3000, 517, dict(threads_per_row=128, block_size=128, vecs_per_thread=4, acc_smem=True, merge_cluster=8)),
    (1002, 333, dict(vec=2, threads_per_row=128, block_size=128, vecs_per_thread=4, acc_smem=True,
                     merge_cluster=4, min_blocks=8)),
    (999, 77, dict(vec=1, threads_per_row=256, block_size=256, vecs_per_thread=4, acc_smem=True, merge_cluster=2)),
    (4096, 5, dict(threads_per_row=256, block_size=256, vecs_per_thread=2, acc_smem=True, merge_cluster=4)),
    (5000, 333, dict(threads_per_row=128, block_size=128, vecs_per_thread=8, cluster_size=2, acc_smem=True,
                     ring_rows=2)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n, rows, fields", ACC_CLASSES)
def test_norm_backward_acc_smem_merge_gpu(n, rows, fields):
    fields = dict(fields)
    _check_config(NormBwdConfig(dtype="bfloat16", weight_dtype="bfloat16", **{"vec": 8, **fields}), n, rows,
                  str(fields))


@pytest.mark.gpu
@pytest.mark.parametrize("n, rows, fields", RING_CLASSES)
def test_norm_backward_ring_row_classes_gpu(n, rows, fields):
    _check_config(NormBwdConfig(dtype="bfloat16", weight_dtype="bfloat16", vec=8, **fields), n, rows, str(fields))


def _check_config(cfg, n, rows, variant):
    from test_training_ops import _close, _gpu, _rmsnorm_dx_scale, _row_rms
    from rtkernels import device
    cp, random_array, to_f64, poison = _gpu()
    dtype = "bfloat16"
    if cfg.launch_cluster > 1 and arch_number(device.current_arch()) < 90:
        pytest.skip("clusters need sm_90")
    rng = np.random.default_rng(n + rows)
    x, x64 = random_array(rng, (rows, n), dtype, scale=2.0)
    dy, dy64 = random_array(rng, (rows, n), dtype)
    w, w64 = random_array(rng, (n,), dtype)
    b, _ = random_array(rng, (n,), dtype)
    what = f"{variant} {cfg.key()} rows={rows}"
    rstd = cp.asarray((1 / np.sqrt(np.mean(x64 ** 2, -1) + 1e-6)).astype(np.float32))
    ref_dx, ref_dw = rb.rmsnorm_backward_reference(dy64, x64, w64, 1e-6)
    for stats in (None, rstd):
        dx = poison(cp.empty_like(x))
        _, got_dw = rtk.rmsnorm_backward(dy, x, w, stats, eps=1e-6, out=dx, dtype=dtype, config=cfg)
        _close(to_f64(dx, dtype), ref_dx, dtype, f"rmsnorm dx {what}",
               row_scale=_rmsnorm_dx_scale(dy64, x64, w64, ref_dx), atol=1e-6)
        _close(to_f64(got_dw, dtype), ref_dw, dtype, f"rmsnorm dweight {what}",
               atol=1e-5 * np.abs(dy64 * x64).sum(0) * 2)
    ref_dx, ref_dw, ref_db = rb.layernorm_backward_reference(dy64, x64, w64, 1e-5)
    mean = cp.asarray(x64.mean(-1).astype(np.float32))
    lrstd = cp.asarray((1 / np.sqrt(x64.var(-1) + 1e-5)).astype(np.float32))
    for stats in ((None, None), (mean, lrstd)):
        dx = poison(cp.empty_like(x))
        _, got_dw, got_db = rtk.layernorm_backward(dy, x, w, b, *stats, eps=1e-5, out=dx, dtype=dtype, config=cfg)
        tag = f"layernorm (stats {'given' if stats[0] is not None else 'recomputed'}) {what}"
        _close(to_f64(dx, dtype), ref_dx, dtype, tag + " dx", row_scale=_row_rms(ref_dx), atol=1e-6)
        _close(to_f64(got_dw, dtype), ref_dw, dtype, tag + " dweight", atol=2e-5 * np.abs(dy64).sum(0) * 4)
        _close(to_f64(got_db, dtype), ref_db, dtype, tag + " dbias", atol=1e-5 * np.abs(dy64).sum(0))
    a = rtk.layernorm_backward(dy, x, w, b, mean, lrstd, dtype=dtype, config=cfg)
    c = rtk.layernorm_backward(dy, x, w, b, mean, lrstd, dtype=dtype, config=cfg)
    for u, v in zip(a, c):
        assert cp.array_equal(u, v), f"{what}: two runs differ"


@pytest.mark.gpu
def test_cluster_workers_fit_the_device_gpu():
    """The 16k cluster grid is one wave: no more clusters than the driver says fit at once."""
    from rtkernels import device
    from rtkernels.ops import rowwise as rw
    arch = device.current_arch()
    if arch_number(arch) < 90:
        pytest.skip("clusters need sm_90")
    for n in (16384, 65536):   # (8k rows run one 512-thread block per row on sm_90: _NORM_BWD_BIG_BLOCK)
        cfg = rb.plan_bwd("norm_bwd", n, "bfloat16", 8, arch, weight_dtype="bfloat16", layer=True)
        k = rtk.get_kernel(cfg, "layernorm_bwd_rows")
        cap = rb._cluster_capacity(k, cfg)
        workers = rb._resident_workers(k, cfg)
        print(f"n={n} cluster={cfg.cluster_size} block={cfg.block_size} regs={k.resources.registers} "
              f"smem={cfg.shared_mem_bytes}: driver clusters {cap}, workers {workers}, "
              f"SMs x blocks/SM {rw.resident_on_device(k, cfg.block_size, cfg.shared_mem_bytes, cfg.cluster_size)}")
        assert cap is not None and 1 <= workers <= cap
