"""Split-K and stream-K in the Hopper matmul (ops/matmul_sm90.py split_k / stream_k,
templates/matmul_sm90.cu.j2 reduce_segments): config validation, the heuristic's choice, NumPy
models of the (tile, split) walk and of the stream-K partition, two sm_90a compiles; on a GPU,
float64 references over awkward shapes with the schedule forced (RTKERNELS_MATMUL_SPLIT_K /
RTKERNELS_MATMUL_STREAM_K), the fused epilogue, run-to-run bit equality, per-stream workspaces and
CUDA-graph replay."""
import re

import numpy as np
import pytest

from rtkernels.errors import ConfigError
from rtkernels.ops import matmul as mm
from rtkernels.ops import matmul_sm90 as m90
from rtkernels.ops.matmul_sm90 import MatmulSm90Config


# ---- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(split_k=0), dict(split_k=m90.MAX_SPLIT_K + 1), dict(split_k=2.0),
                                 dict(split_k=True), dict(split_k=2, mma="sync", tma_store=False)])
def test_bad_split_k_names_it(bad):
    with pytest.raises(ConfigError) as e:
        MatmulSm90Config(**bad)
    assert e.value.field == "split_k" and "split_k" in str(e.value) and "matmul_sm90" in str(e.value)


@pytest.mark.parametrize("bad", [dict(stream_k=1), dict(stream_k=True, split_k=2),
                                 dict(stream_k=True, mma="sync", tma_store=False)])
def test_bad_stream_k_names_it(bad):
    with pytest.raises(ConfigError) as e:
        MatmulSm90Config(**bad)
    assert e.value.field == "stream_k" and "stream_k" in str(e.value) and "matmul_sm90" in str(e.value)


def test_forced_stream_k_env_is_checked(monkeypatch):
    for v in ("2", "yes", "true"):
        monkeypatch.setenv(mm.STREAM_K_ENV, v)
        with pytest.raises(ConfigError) as e:
            mm._forced_stream_k()
        assert e.value.field == mm.STREAM_K_ENV and mm.STREAM_K_ENV in str(e.value)
    for v, want in (("1", True), ("0", False), ("", None)):
        monkeypatch.setenv(mm.STREAM_K_ENV, v)
        assert mm._forced_stream_k() is want
    monkeypatch.delenv(mm.STREAM_K_ENV)
    assert mm._forced_stream_k() is None


def test_forced_split_k_env_is_checked(monkeypatch):
    for v in ("0", "x", str(m90.MAX_SPLIT_K + 1)):
        monkeypatch.setenv(mm.SPLIT_K_ENV, v)
        with pytest.raises(ConfigError) as e:
            mm._forced_split_k()
        assert e.value.field == mm.SPLIT_K_ENV and mm.SPLIT_K_ENV in str(e.value)
    monkeypatch.setenv(mm.SPLIT_K_ENV, "3")
    assert mm._forced_split_k() == 3
    monkeypatch.delenv(mm.SPLIT_K_ENV)
    assert mm._forced_split_k() is None


def test_split_k_1_keeps_the_unsplit_signature():
    """split_k = 1 renders the kernel without workspace parameters (its SASS is the unsplit kernel's:
    compared once with the tree before split-K, 784 identical instructions)."""
    from rtkernels.render import render
    one = render(MatmulSm90Config.template, MatmulSm90Config().template_params()).source
    two = render(MatmulSm90Config.template, MatmulSm90Config(split_k=2).template_params()).source
    sig = lambda src: src[src.index("matmul_sm90("):src.index("{", src.index("matmul_sm90("))]  # noqa: E731
    assert "partials" not in sig(one) and "float* __restrict__ partials" in sig(two)


# ---- heuristic ------------------------------------------------------------------------------
# The heuristic's pick (rtk.matmul's: stream_k weighed) at every shape of `tools/bench_matmul.py
# --grid llm` (M x (N, K), W (N, K)), with the measurement behind it: H200, "ab" = `--streamk-ab`
# of 2026-11-26 (whole tiles / split-K / stream-K launched directly), "grid" = `--grid llm --quick`
# of 2026-11-25 with the whole-tile heuristic of then (docs/data/bench_matmul_grid_llm_final_
# session8_2026-11-25_h200.json); x = cuBLAS's time over ours.
GRID_PICKS = {
    # M = 128: fewer tiles than SMs; the weight's read from DRAM bounds every schedule
    (128, 6144, 4096): "128x64 s1",     # ab: 96 tiles 20.5 us 0.92x; 128x128 s2 23.6, s3 34.5
    (128, 4096, 4096): "128x64 c2",     # rule 2b (reasoned): 64 tiles of 128 x 64 on 128 SMs; ab: whole
    #                                     17.6 us 0.94x, 128x128 s2-s4 19.6-19.8 (64-192 KiB of partials)
    (128, 14336, 4096): "128x128 s1",   # grid: 112 tiles 0.97x
    (128, 28672, 4096): "128x256 s1",   # grid: 112 tiles 1.07x
    (128, 4096, 14336): "128x64 c2",    # rule 2b: s2 0.978x / 0.994x (sessions 10, 11) vs 128x128 s3 0.953x / 0.970x;
    #                                     as cluster-K 1.15x vs s2 1.09x (H100, session 12)
    (128, 10240, 8192): "128x128 s1",   # grid: 80 tiles 0.97x (more than half the SMs: no split)
    (128, 8192, 8192): "128x64 s1",     # ab: 43.1 us 0.92x; 128x128 s2 44.9, whole 45.5
    (128, 28672, 8192): "128x256 s1",   # grid: 1.08x
    (128, 8192, 28672): "128x64 s1",    # grid: 128 tiles 0.97x
    (128, 4096, 128): "128x64 s1",      # grid: 0.94x (2 k-blocks: nothing to split)
    (128, 4096, 256): "128x64 s1",      # grid: 1.00x
    (128, 16384, 128): "128x128 s1",    # grid: 1.02x
    # M = 512: one to seven waves; the tile shape that fills the last one
    (512, 6144, 4096): "128x192 s1",    # ab: 128 tiles 37.2 us 1.02x; 128x256 44.9, 128x128 46.1, sk >= 45.7
    (512, 4096, 4096): "128x128 s1",    # grid: 128 tiles 1.00x
    (512, 14336, 4096): "128x256 s1",   # ab: 85.8 us 1.01x; 128x128 90.7, sk 89.8 (fill 85%, but the model
    #                                     puts stream-K at 89.9 us against 89.7 whole: not 5% faster)
    (512, 28672, 4096): "128x128 s1",   # ab: 162 us 0.97x; 128x192 165, 128x256 173, sk 169
    (512, 4096, 14336): "128x128 s1",   # grid: 128 tiles 0.98x
    (512, 10240, 8192): "128x256 sk",   # ab: 120 us 0.93x; whole 128x192 125, 128x128 131, 128x256 168
    (512, 8192, 8192): "128x256 s1",    # grid: 128 tiles 1.01x
    (512, 28672, 8192): "128x128 s1",   # grid: 896 tiles (97% fill) 0.96x, as 512x28672x4096 in ab
    (512, 8192, 28672): "128x256 s1",   # grid: 1.01x
    (512, 4096, 128): "128x128 s1",     # grid: 0.98x
    (512, 4096, 256): "128x128 s1",     # grid: 0.98x
    (512, 16384, 128): "128x256 s1",    # grid: 1.04x
    # odd sizes
    (1793, 1793, 1793): "128x256 s1",   # grid: 2.32x (cuBLAS off its fast path)
    (4095, 4095, 4095): "128x256 s1",   # grid: 3.80x
    (3000, 5000, 2000): "128x256 s1",   # ab: 93.0 us 0.92x; 128x192 94.6, 128x128 118, sk 102
}
# K-major B (x @ W.T) only: rule 4's widths off the 64-column grid (matmul_sm90.FLEX_NS; H100,
# 2026-11-26, `--lastcells-ab`), with GELU at most FLEX_MAX_N_GELU wide.  (shape, gelu) -> pick.
FLEX_PICKS = {
    (128, 28672, 4096): "128x224 s1",   # ab: 1.02x, as 128x256 (bound by reading W)
    (128, 28672, 8192): "128x224 s1",   # as 128x28672x4096 (reasoned)
    (512, 14336, 4096): "128x224 s1",   # ab: 1.07x; 128x256 1.02x
    (512, 28672, 4096): "128x224 s1",   # ab: 0.986x; 128x128 0.969x
    (512, 28672, 8192): "128x224 s1",   # as 512x28672x4096 (reasoned)
    (512, 10240, 8192): "128x160 s1",   # ab: 0.975x; stream-K 128x256 0.926x
    (1793, 1793, 1793): "128x232 s1",   # one round either way, 9% less area (reasoned)
    (3000, 5000, 2000): "128x232 s1",   # ab: 0.863x; 128x256 0.848x
    # with GELU no width <= 224 fills these rounds better than 128 x 256
    ((1793, 1793, 1793), "gelu"): "128x256 s1",
    ((3000, 5000, 2000), "gelu"): "128x256 s1",
}
# M >= 2048: >= 2 waves of 128 x 256 tiles filling >= 97% of their last one (132 = 4 x 33 SMs); the
# grid ran 0.94-1.10x with 128x256 at every M = 2048 shape (M = 8192 / 16384 reasoned from that and
# the 4096^3 / 8192^3 sweep, where 128x256 is the fastest tile)
BIG_M_PICK = "128x256 s1"


def _pick(cfg):
    return f"{cfg.block_m}x{cfg.block_n} {'sk' if cfg.stream_k else 'c2' if cfg.cluster_k == 2 else f's{cfg.split_k}'}"


def _bench_grid():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "tools" / "bench_matmul.py"
    spec = importlib.util.spec_from_file_location("bench_matmul_grid", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [(m, n, k) for m in mod.LLM_MS for n, k in mod.LLM_NK] + mod.LLM_ODD


def test_heuristic_picks_over_the_llm_grid():
    """Every shape of the benchmark's grid gets the schedule that measured fastest (GRID_PICKS)."""
    wrong = []
    for m, n, k in _bench_grid():
        want = GRID_PICKS.get((m, n, k), BIG_M_PICK if m >= 2048 else None)
        assert want is not None, f"{m}x{n}x{k}: grid shape without an expectation in GRID_PICKS"
        for layout in (dict(b_kmajor=True), dict(b_kmajor=False), dict(b_kmajor=True, has_bias=True, activation="gelu")):
            got = _pick(m90.heuristic_config("bfloat16", m, n, k, sm_count=132, stream_k=True, **layout))
            expect = want
            if layout["b_kmajor"]:
                expect = FLEX_PICKS.get(((m, n, k), layout.get("activation")), FLEX_PICKS.get((m, n, k), want))
            if got != expect:
                wrong.append(f"{m}x{n}x{k} {layout}: {got}, expected {expect}")
    assert not wrong, "\n".join(wrong)


def test_heuristic_rules():
    """The three rules of ops/matmul_sm90.py's heuristic, away from the grid's own shapes."""
    def h(*shape, **kw):
        return m90.heuristic_config("bfloat16", *shape, sm_count=132, **{"b_kmajor": True, **kw})
    # RTKERNELS_MATMUL_STREAM_K=0 (stream_k False): whole tiles where stream-K would run
    assert _pick(h(512, 10240, 8192, b_kmajor=False)) == "128x128 s1"
    assert _pick(h(512, 10240, 8192, b_kmajor=False, stream_k=True)) == "128x256 sk"
    assert _pick(h(512, 10240, 8192, stream_k=True)) == "128x160 s1"   # rule 4 before stream-K (K-major B)
    # mma.sync consumers never split nor stream
    sync = h(512, 10240, 8192, stream_k=True, mma="sync", tma_store=False)
    assert not sync.stream_k and sync.split_k == 1
    assert h(128, 4096, 14336, mma="sync", tma_store=False).split_k == 1
    # split-K: one round of units, SPLIT_MIN_KBLOCKS each, only where whole tiles fill <= half the SMs
    for m, n, k in ((128, 4096, 14336), (128, 512, 65536), (64, 2048, 8192), (300, 4100, 129), (256, 4096, 32768)):
        c = h(m, n, k)
        if c.split_k > 1:
            tiles = -(-m // c.block_m) * -(-n // c.block_n)
            thin = (c.block_m, c.block_n) == m90.THIN_SPLIT_TILE   # rule 2b, tried first
            assert (thin or (c.block_m, c.block_n) == m90.SPLIT_TILE) and tiles * c.split_k <= 132, (m, n, k, c)
            least = m90.THIN_SPLIT_MIN_KBLOCKS if thin else m90.SPLIT_MIN_KBLOCKS
            assert m90.k_blocks(k) // c.split_k >= least, (m, n, k, c)
    assert h(128, 512, 65536).split_k == 8          # 4 tiles, 1024 k-blocks: the most SPLITS has
    assert _pick(h(64, 2048, 8192)) == "128x64 s4"  # 2b first: 32 thin tiles, 128 k-blocks: 32 per split
    assert h(300, 4100, 129).split_k == 1           # 3 k-blocks
    # 2b: thin tiles split in place where rule 2 splits nothing, units in one round, 32 k-blocks each
    assert _pick(h(128, 4096, 4096)) == "128x64 c2"     # 64 tiles, 64 k-blocks
    assert _pick(h(127, 4100, 4100)) == "128x64 c2"     # 65 tiles, 65 k-blocks: ragged in M, N, K
    assert _pick(h(128, 2048, 4096)) == "128x64 c2"     # 32 tiles: s4 would leave 16 k-blocks per split
    assert _pick(h(128, 4096, 2048)) == "128x64 s1"     # 32 k-blocks: nothing to split
    assert _pick(h(128, 4096, 256)) == "128x64 s1"
    assert _pick(h(128, 6144, 4096)) == "128x64 s1"     # 96 tiles: more than half the SMs
    assert _pick(h(128, 4096, 8192)) == "128x64 c2"     # 2b before rule 2 (its 128 x 128 s2)
    assert _pick(h(128, 4096, 4096, mma="sync", tma_store=False)) == "128x64 s1"
    # stream-K needs a full wave of 128 x 256 tiles: never at M = 128
    for n, k in ((10240, 8192), (4096, 14336), (6144, 65536)):
        assert not h(128, n, k, stream_k=True).stream_k, (n, k)
    # the wave model: 128x192 where it fills the last wave that 128x256 and 128x128 leave ragged
    assert m90.whole_tile_fill(m90._tile((128, 192)), 512, 6144, 1, 132) == pytest.approx(128 / 132)
    assert _pick(h(4096, 4096, 4096)) == "128x256 s1" and _pick(h(8192, 8192, 8192)) == "128x256 s1"
    # batched problems count every batch's tiles
    assert _pick(h(512, 6144, 4096, 2, stream_k=True)) == _pick(h(1024, 6144, 4096, stream_k=True))


def test_autotuner_candidates_keep_both_schedules():
    """The autotuner still weighs split-K and stream-K where the heuristic does not pick them."""
    assert any(c.stream_k for c in m90.split_candidates("bfloat16", 512, 10240, 8192, 1, 132))
    assert any(c.stream_k for c in m90.split_candidates("bfloat16", 512, 6144, 4096, 1, 132))
    # many tiles: no split weighed (stream-K may be, where the last wave is partial)
    assert all(c.stream_k for c in m90.split_candidates("bfloat16", 8192, 8192, 8192, 1, 132))


def test_schedule_model_reduces_to_the_unsplit_model():
    """Without the floor and for split_k = 1 the schedule model is the rounds model times (k-blocks +
    fill): the same data-parallel ranking."""
    for t in m90.TILES:
        for m, n, k in ((1793, 1793, 1793), (8192, 1024, 512), (300, 4100, 129)):
            ratio = m90.schedule_us(t, m, n, k, 1, 132, floor=False) / m90.estimated_cost(t, m, n, 1, 132)
            assert ratio == pytest.approx((m90.k_blocks(k) + m90.SPLIT_FILL_KBLOCKS) * m90.KBLOCK_US / (128 * 256))


def _units(tiles, k_tiles, split_k):
    """NumPy model of walk_of / unit_at: (tile, split, kb0, kb1) of every work unit."""
    splits = max(1, min(split_k, k_tiles))
    out = []
    for u in range(tiles * splits):
        t, s = divmod(u, splits)
        out.append((t, s, s * k_tiles // splits, (s + 1) * k_tiles // splits))
    return out, splits


@pytest.mark.parametrize("tiles, k_tiles, split_k", [(16, 64, 4), (7, 3, 8), (5, 65, 6), (1, 1, 16), (33, 10, 3)])
def test_split_ranges_are_balanced_and_cover_k(tiles, k_tiles, split_k):
    units, splits = _units(tiles, k_tiles, split_k)
    assert splits == min(split_k, k_tiles)
    for t in range(tiles):
        mine = [u for u in units if u[0] == t]
        assert [u[1] for u in mine] == list(range(splits))
        assert mine[0][2] == 0 and mine[-1][3] == k_tiles
        assert all(a[3] == b[2] for a, b in zip(mine, mine[1:]))      # contiguous, in split order
        sizes = [u[3] - u[2] for u in mine]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    cfg = MatmulSm90Config(block_m=128, block_n=128, num_stages=6, split_k=split_k)
    m, n, k = 128 * tiles, 128, 64 * k_tiles
    assert m90.grid_size(m, n, 1, cfg, 132, k) == min(len(units), 132)
    assert m90.workspace_bytes(cfg, m, n, k, 1) == (len(units) * 128 * 128 * 4 if splits > 1 else 0)
    assert m90.counter_bytes(cfg, m, n, 1) == tiles * 2 * 4


def _owners(tiles, k_tiles, grid, lanes=1):
    """An independent model of the stream-K partition: every (tile, k-block)'s owner CTA from
    explicit ranges (sk_tiles from the DP + SK rule: all but floor(tiles / grid) - 1 waves); with
    lanes R, group g's range of the sets' k-blocks goes to CTAs gR .. gR + R - 1, lane r taking
    tile jR + r of set j."""
    full, rem = divmod(tiles, grid)
    sk = 0 if rem == 0 else (rem + grid if full else rem)
    S = sk // lanes * k_tiles
    P = min(grid // lanes, S)
    group = np.empty(S, np.int64)
    for g in range(P):
        group[g * S // P:(g + 1) * S // P] = g
    owner = np.empty((sk, k_tiles), np.int64)
    for t in range(sk):
        j, r = divmod(t, lanes)
        owner[t] = group[j * k_tiles:(j + 1) * k_tiles] * lanes + r
    return sk, owner.reshape(-1)


@pytest.mark.parametrize("tiles, k_tiles, grid, lanes", [
    (96, 64, 132, 1), (160, 128, 132, 1), (480, 32, 132, 1), (32, 64, 132, 1), (2, 2, 4, 1), (289, 3, 132, 1),
    (7, 1, 132, 1), (264, 5, 132, 1), (133, 7, 132, 1), (1, 300, 132, 1), (5, 65, 16, 1),
    # lanes: 512 x 6144 / 10240 in 128 x 256 tiles (4 tile rows), 3000 x 5000 (24 rows, groups of 8)
    (96, 64, 132, 4), (160, 128, 132, 4), (480, 32, 132, 4), (8, 3, 132, 4), (6, 5, 12, 2), (264, 5, 132, 2),
    (136, 7, 132, 4), (12, 300, 132, 3)])
def test_stream_k_partition_covers_each_k_block_once(tiles, k_tiles, grid, lanes):
    sk, owner = _owners(tiles, k_tiles, grid, lanes)
    sk_tiles, ctas = m90.stream_k_partition(tiles, k_tiles, grid, lanes)
    assert sk_tiles == sk and (tiles - sk) % grid == 0
    assert sk <= tiles and (sk == 0 or sk >= grid or sk == tiles)
    seen = np.zeros((tiles, k_tiles), np.int64)
    stored = {}        # slot -> (tile, kb0, kb1) of the piece stored there
    pieces = {}        # tile -> [(kb0, kb1, cta, segs, seg, slots)]
    for c, units in enumerate(ctas):
        assert [u[0] for u in units] == sorted(u[0] for u in units), "a CTA walks its tiles in order"
        its = sum(u[2] - u[1] for u in units if u[0] < sk)
        if sk:   # stream-K iterations per CTA: S / P, rounded either way
            S, P = sk * k_tiles, min(grid, sk * k_tiles)
            assert its in ((S // P, -(-S // P)) if c < P else (0,))
        my_slots = []
        for t, kb0, kb1, segs, seg, slot, slots in units:
            assert 0 <= kb0 < kb1 <= k_tiles
            seen[t, kb0:kb1] += 1
            if t >= sk:
                assert (kb0, kb1, segs) == (0, k_tiles, 1), "data-parallel tiles run whole"
                continue
            # the device's segment count: the distinct owners of the tile's k-blocks
            assert segs == len(set(owner[t * k_tiles:(t + 1) * k_tiles])), (t, segs)
            assert set(owner[t * k_tiles + kb0:t * k_tiles + kb1]) == {c}
            if segs > 1:
                assert slot not in stored, f"slot {slot} written twice"
                stored[slot] = (t, kb0, kb1)
                my_slots.append(slot)
                pieces.setdefault(t, []).append((kb0, kb1, c, segs, seg, slots))
        assert len(my_slots) <= 2 and all(s // 2 == c for s in my_slots), "two slots per CTA, its own"
    assert (seen == 1).all(), "some k-block computed twice or never"
    for t, ps in pieces.items():
        ps.sort()
        segs = ps[0][3]
        assert len(ps) == segs and [p[4] for p in ps] == list(range(segs)), "segments in k order, one per CTA"
        assert [p[2] for p in ps] == list(range(ps[0][2], ps[0][2] + segs * lanes, lanes)), "consecutive groups"
        assert all(p[2] % lanes == t % lanes for p in ps), "a tile's pieces run on its lane"
        assert all(p[5] == ps[0][5] for p in ps), "every piece computes the same slot list"
        # the reducer reads the pieces in k order from where they were stored
        assert [stored[s] for s in ps[0][5]] == [(t, p[0], p[1]) for p in ps]
        assert ps[0][0] == 0 and ps[-1][1] == k_tiles
    # the R CTAs of a group run the same k-blocks (of their own tiles) side by side
    for g in range(grid // lanes):
        ks = [[(u[0] // lanes, u[1], u[2]) for u in ctas[g * lanes + r]] for r in range(lanes)]
        assert all(k == ks[0] for k in ks), f"group {g}'s lanes walk different k-blocks"
    # workspace: two float32 tiles per CTA; counters for the stream-K tiles
    cfg = MatmulSm90Config(block_m=128, block_n=128, num_stages=6, stream_k=True)
    assert m90.workspace_bytes(cfg, 128 * tiles, 128, 64 * k_tiles, 1, grid) == 2 * grid * 128 * 128 * 4
    assert m90.counter_bytes(cfg, 128 * tiles, 128, 1, grid) >= sk * 2 * 4
    if lanes == 1:   # tiles in one column: one lane
        assert m90.grid_size(128 * tiles, 128, 1, cfg, grid, 64 * k_tiles) == min(grid, tiles * k_tiles)


@pytest.mark.parametrize("m, n, block_n, sms, lanes", [(512, 6144, 256, 132, 4), (3000, 5000, 256, 132, 4),
                                                       (128, 4096, 128, 132, 1), (384, 4096, 256, 132, 3),
                                                       (1024, 4096, 256, 132, 4), (1152, 4096, 256, 132, 1),
                                                       (512, 6144, 256, 130, 2), (512, 2048, 256, 7, 1)])
def test_stream_k_lanes_divide_rows_and_sms(m, n, block_n, sms, lanes):
    """R divides the tile rows of every group_m group (8) and the SM count; the grid is one CTA per
    SM, a multiple of R."""
    cfg = MatmulSm90Config(block_m=128, block_n=block_n, num_stages=4 if block_n == 256 else 6, stream_k=True)
    assert m90.stream_k_lanes(cfg, m, sms) == lanes
    grid = m90.grid_size(m, n, 1, cfg, sms, 4096)
    assert grid % lanes == 0 and grid == min(sms, -(-m // 128) * -(-n // block_n) * 64)


# ---- compile ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(block_m=128, block_n=128, num_stages=6, split_k=2),
                                dict(block_m=128, block_n=256, num_stages=4, stream_k=True),
                                dict(block_m=128, block_n=64, num_stages=8, split_k=2)],
                         ids=["split2-128x128", "streamk-128x256", "split2-128x64"])
def test_reducing_configs_compile_clean_for_sm90a(kw):
    """Split-K (128 x 128 s2, rule 2's tile; 128 x 64 s2, rule 2b's) and stream-K on the largest tile, with
    the fused bias + GELU epilogue: no spills under the consumers' 232 registers, 16-byte L2-only
    partial stores/loads, one counter atomic per unit."""
    import rtkernels as rtk
    from rtkernels.inspect import sass_stats
    cfg = MatmulSm90Config(dtype="bfloat16", b_kmajor=True, has_bias=True, activation="gelu", **kw)
    k = rtk.get_kernel(cfg, arch="sm_90")
    r = k.resources
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0 and r.registers == 168, r
    assert "C7508" not in k.module.log and "serializ" not in k.module.log.lower(), k.module.log
    assert "warning" not in k.module.log, k.module.log
    s = sass_stats(k.sass)
    assert s["ldl"] == 0 and s["stl"] == 0 and s["hgmma"] > 0 and s["utmastg"] > 0
    groups = cfg.block_m // 2 * cfg.block_n // 128 // 4    # float4 groups per consumer thread
    assert len(re.findall(r"STG\.E\.128\.STRONG\.GPU", k.sass)) == groups, "partial stores not 16-byte .cg"
    assert len(re.findall(r"LDG\.E\.128\.STRONG\.GPU", k.sass)) >= groups
    assert "ATOMG.E.ADD" in k.sass and "BAR.RED.OR" in k.sass


# ---- GPU -------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _tile_kernels_only(monkeypatch):
    """These tests exercise the Hopper tile kernel's split-K: C of <= 16 rows would otherwise take
    rtk.matmul's GEMV route (tests/test_gemv.py covers that one)."""
    import rtkernels.ops.matmul as mm
    monkeypatch.setattr(mm, "USE_GEMV", False)


def _sm90_gpu():
    from rtkernels import device
    if device.current_arch() != "sm_90":
        pytest.skip("needs an sm_90 GPU")


def _plan_of(m, n, k, batch=1, forced=None, stream_k=None):
    """(config, grid) of the Hopper plan made for (m, n, k, batch) under RTKERNELS_MATMUL_SPLIT_K=forced
    and RTKERNELS_MATMUL_STREAM_K=stream_k (None if there is none)."""
    hits = [(plan[1], plan[2]) for key, plan in mm._plans90.items() if key[1:5] == (m, n, k, batch) and
            key[13] == forced and key[14] == stream_k]
    return hits[-1] if hits else (None, None)


def _split_of(m, n, k, batch=1, forced=None):
    """split_k of the Hopper plan made for (m, n, k, batch) under RTKERNELS_MATMUL_SPLIT_K=forced
    (None if there is none)."""
    cfg, _ = _plan_of(m, n, k, batch, forced)
    return None if cfg is None else cfg.split_k


from test_matmul_sm90 import _check, _empty  # noqa: E402  (the 2x-cuBLAS error rule, bf16 as uint16)


def _cublas(a, b, dtype, trans_b=False):
    from test_matmul import _cublas as peer
    return peer(a, b, dtype, False, trans_b)


def _dt(dtype):
    return dtype if dtype == "bfloat16" else None


def _aligned(rng, rows, cols, dtype):
    """Random (rows, cols) values as a column slice of rows padded to 16 bytes (so that TMA takes
    any cols, K = 65 included, and the Hopper kernel runs it): (device view, float64 host copy)."""
    from gpu_util import random_array
    dev, host = random_array(rng, (rows, -(-cols // 8) * 8), dtype)
    return dev[:, :cols], host[:, :cols]


SPLIT_SHAPES = [(1, 72, 4104), (7, 4100, 129), (129, 72, 65), (300, 4100, 1000), (129, 256, 64), (300, 520, 4104),
                (128, 4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, split_k", [("bfloat16", 2), ("bfloat16", 8), ("float16", 3)])
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_forced_split(dtype, shape, split_k, monkeypatch):
    """Forced splits (clamped to the k-blocks: K = 64 runs unsplit, K = 65 in 2) against float64."""
    from gpu_util import poison, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    monkeypatch.setenv(mm.SPLIT_K_ENV, str(split_k))
    M, N, K = shape
    rng = np.random.default_rng(M * 7 + N + K + split_k)
    a, ah = _aligned(rng, M, K, dtype)
    b, bh = _aligned(rng, K, N, dtype)
    out = poison(_empty((M, N), dtype))
    rtk.matmul(a, b, out=out, dtype=_dt(dtype))
    assert _split_of(M, N, K, forced=split_k) == min(split_k, -(-K // 64))
    _check(to_f64(out, dtype), ah @ bh, _cublas(a, b, dtype), f"{dtype} {shape} split_k={split_k}")


# (M, N, K): few tiles (each over several CTAs), under a wave, and (2049 x 4100: 289 tiles of 128 x 256)
# data-parallel waves before the stream-K tiles; K of 1-65 k-blocks, ranges crossing tile boundaries;
# lanes (on 132 SMs) 1, 2 (129 rows), 3 (300), 4 (512, 1000: 4 and 8 tile rows)
STREAM_SHAPES = [(129, 72, 65), (7, 4100, 129), (300, 4100, 129), (513, 6144, 4104), (2049, 4100, 129),
                 (129, 6144, 1000), (300, 72, 4104), (512, 6144, 4104), (1000, 4100, 700)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", STREAM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_forced_stream_k(dtype, shape, monkeypatch):
    """RTKERNELS_MATMUL_STREAM_K=1 on the heuristic's tile against float64 (and cuBLAS's error)."""
    from gpu_util import poison, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    monkeypatch.setenv(mm.STREAM_K_ENV, "1")
    M, N, K = shape
    rng = np.random.default_rng(M * 5 + N + K)
    a, ah = _aligned(rng, M, K, dtype)
    b, bh = _aligned(rng, K, N, dtype)
    out = poison(_empty((M, N), dtype))
    rtk.matmul(a, b, out=out, dtype=_dt(dtype))
    cfg, grid = _plan_of(M, N, K, stream_k=True)
    assert cfg is not None and cfg.stream_k, cfg
    tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    lanes = m90.stream_k_lanes(cfg, M, grid)
    what = f"{dtype} {shape} stream-K {cfg.block_m}x{cfg.block_n}, {tiles} tiles on {grid} CTAs, {lanes} lanes"
    _check(to_f64(out, dtype), ah @ bh, _cublas(a, b, dtype), what)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["split4", "stream"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape, trans_b, pad", [((129, 4096, 4104), False, 0), ((300, 264, 1000), True, 1),
                                                 ((7, 129, 520), True, 0)])
def test_gpu_split_bias_gelu_and_direct_stores(dtype, shape, trans_b, pad, schedule, monkeypatch):
    """The fused bias + GELU epilogue after the reduction (split-K 4 or stream-K), through the TMA
    store (N = 4096) and (odd C row stride or odd N) the direct stores."""
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    stream = schedule == "stream"
    monkeypatch.setenv(mm.STREAM_K_ENV if stream else mm.SPLIT_K_ENV, "1" if stream else "4")
    M, N, K = shape
    rng = np.random.default_rng(M + N)
    a, ah = _aligned(rng, M, K, dtype)
    b, bh = _aligned(rng, *((N, K) if trans_b else (K, N)), dtype)
    bias, biash = random_array(rng, (N,), dtype)
    full = poison(_empty((M, N + pad), dtype))
    out = full[:, :N]
    rtk.matmul(a, b, bias=bias, activation="gelu", out=out, trans_b=trans_b, dtype=_dt(dtype))
    cfg, _ = _plan_of(M, N, K, forced=None if stream else 4, stream_k=True if stream else None)
    assert cfg.stream_k if stream else cfg.split_k == 4, cfg
    ref = mm.matmul_reference(ah, bh, bias=biash, activation="gelu", trans_b=trans_b)
    peer = mm._act_np(_cublas(a, b, dtype, trans_b) + biash, "gelu")
    got = to_f64(full, dtype)
    _check(got[:, :N], ref, peer, f"{dtype} {shape} bias+gelu {schedule} (tma_store={cfg.tma_store})")
    if pad:
        assert np.isnan(got[:, N:]).all(), "wrote past the output's columns"


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["split3", "stream"])
def test_gpu_split_batched(schedule, monkeypatch):
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    stream = schedule == "stream"
    monkeypatch.setenv(mm.STREAM_K_ENV if stream else mm.SPLIT_K_ENV, "1" if stream else "3")
    B, M, N, K = 3, 130, 200, 700
    rng = np.random.default_rng(11)
    a, ah = random_array(rng, (B, M, K), "bfloat16")
    b, bh = random_array(rng, (K, N), "bfloat16")
    out = poison(_empty((B, M, N), "bfloat16"))
    rtk.matmul(a, b, out=out, dtype="bfloat16")
    cfg, _ = _plan_of(M, N, K, B, forced=None if stream else 3, stream_k=True if stream else None)
    assert cfg.stream_k if stream else cfg.split_k == 3, cfg
    _check(to_f64(out, "bfloat16"), ah @ bh, _cublas(a, b[None].repeat(B, 0), "bfloat16"), f"batched {schedule}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, M, N, K, stream", [("bfloat16", 128, 4096, 14336, False),
                                                    ("bfloat16", 128, 4096, 4096, False),
                                                    ("float16", 127, 4100, 4100, False),
                                                    ("float16", 128, 4096, 14336, False),
                                                    ("bfloat16", 511, 10200, 8000, False),
                                                    ("bfloat16", 512, 6144, 4096, True),
                                                    ("float16", 513, 10240, 8192, True)])
def test_gpu_heuristic_split_is_deterministic(dtype, M, N, K, stream, monkeypatch):
    """Shapes the heuristic splits or streams itself (128x4096x14336, 128x4096x4096 and the ragged
    127x4100x4100: 128 x 64 tiles split in two by cluster-K (rule 2b); 511x10200x8000: a
    ragged 512x10240x8192, stream-K), and partial-wave shapes streamed under
    RTKERNELS_MATMUL_STREAM_K=1: three calls (the later ones plan replays) give the same bits, and
    the counters are back at zero after them."""
    if stream:
        monkeypatch.setenv("RTKERNELS_MATMUL_STREAM_K", "1")
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    import rtkernels as rtk
    from rtkernels.ops import workspace
    _sm90_gpu()
    rng = np.random.default_rng(1)
    a, ah = random_array(rng, (M, K), dtype)
    b, bh = random_array(rng, (K, N), dtype)
    outs = []
    for _ in range(3):
        out = poison(_empty((M, N), dtype))
        rtk.matmul(a, b, out=out, dtype=_dt(dtype))
        outs.append(out.get())
    last = out
    cfg, grid = _plan_of(M, N, K, stream_k=True if stream else None)
    assert cfg.split_k > 1 or cfg.stream_k or cfg.cluster_k > 1, cfg
    sched = "stream-K" if cfg.stream_k else f"cluster-K {cfg.cluster_k}" if cfg.cluster_k > 1 else f"split {cfg.split_k}"
    what = f"{dtype} {M}x{N}x{K} heuristic {sched} {cfg.block_m}x{cfg.block_n} on {grid} CTAs"
    assert all(np.array_equal(o.view(np.uint16), outs[0].view(np.uint16)) for o in outs[1:]), f"{what}: bits differ"
    _check(to_f64(last, dtype), ah @ bh, _cublas(a, b, dtype), what)
    cp.cuda.Device().synchronize()
    if cfg.cluster_k == 1:   # cluster-K sums on chip: no workspace, no counters
        ws = workspace._WORKSPACES[(cp.cuda.Device().id, cp.cuda.get_current_stream().ptr, False)]
        assert not ws.counters.view(cp.int32).any(), "a counter was left non-zero"


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, trans_b", [(509, 6144, 4095, True), (500, 6100, 4000, False)])
def test_gpu_heuristic_128x192_tiles(M, N, K, trans_b):
    """Shapes whose last wave the heuristic fills with 128 x 192 tiles (512x6144x4096-like), ragged
    in M, N and K (rows padded to 16 bytes, so TMA takes them), weight as (N, K) (a linear layer's)
    and as (K, N): against float64 and cuBLAS."""
    from gpu_util import poison, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    rng = np.random.default_rng(7)
    a, ah = _aligned(rng, M, K, "bfloat16")
    b, bh = _aligned(rng, *((N, K) if trans_b else (K, N)), "bfloat16")
    out = poison(_empty((M, N), "bfloat16"))
    rtk.matmul(a, b, out=out, dtype="bfloat16", trans_b=trans_b)
    cfg, grid = _plan_of(M, N, K)
    assert cfg is not None and (cfg.block_m, cfg.block_n, cfg.split_k, cfg.stream_k) == (128, 192, 1, False), cfg
    ref = mm.matmul_reference(ah, bh, trans_b=trans_b)
    _check(to_f64(out, "bfloat16"), ref, _cublas(a, b, "bfloat16", trans_b),
           f"{M}x{N}x{K} 128x192 on {grid} CTAs, trans_b={trans_b}")


@pytest.mark.gpu
def test_gpu_streams_get_their_own_workspace(monkeypatch):
    """Two streams, each with its own split calls in flight: separate counter buffers, right results."""
    import cupy as cp
    from gpu_util import random_array, to_f64
    import rtkernels as rtk
    from rtkernels.ops import workspace
    _sm90_gpu()
    monkeypatch.setenv(mm.SPLIT_K_ENV, "6")
    M, N, K = 256, 1024, 2048
    rng = np.random.default_rng(2)
    data = [(random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16")) for _ in range(2)]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = [_empty((M, N), "bfloat16") for _ in range(2)]
    cp.cuda.Device().synchronize()
    for _ in range(5):
        for s, ((a, _), (b, _)), o in zip(streams, data, outs):
            rtk.matmul(a, b, out=o, dtype="bfloat16", stream=s)
    cp.cuda.Device().synchronize()
    dev = cp.cuda.Device().id
    c0 = workspace._WORKSPACES[(dev, streams[0].ptr, False)].counters
    c1 = workspace._WORKSPACES[(dev, streams[1].ptr, False)].counters
    assert c0.data.ptr != c1.data.ptr
    for ((a, ah), (b, bh)), o in zip(data, outs):
        _check(to_f64(o, "bfloat16"), ah @ bh, _cublas(a, b, "bfloat16"), "two streams")


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["split4", "stream"])
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_gpu_split_cuda_graph_replay(warm, schedule, monkeypatch):
    """CuPy stream capture of a split call, replayed twice on new inputs in the captured buffers:
    each replay matches the reference and an eager call bit for bit (counters back at zero after
    every launch).  'cold': the capture stream never ran a split call, so its workspace is made
    (and its counters zeroed) inside the capture."""
    import cupy as cp
    from gpu_util import capture_cupy, random_array, refill, to_f64
    import rtkernels as rtk
    _sm90_gpu()
    stream = schedule == "stream"
    monkeypatch.setenv(mm.STREAM_K_ENV if stream else mm.SPLIT_K_ENV, "1" if stream else "4")
    M, N, K = 128 + 64 * warm + 1024 * stream, 2048, 1024
    rng = np.random.default_rng(3)
    a, _ = random_array(rng, (M, K), "bfloat16")
    b, _ = random_array(rng, (K, N), "bfloat16")
    out = _empty((M, N), "bfloat16")
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        if warm:
            rtk.matmul(a, b, out=out, dtype="bfloat16")
        else:
            with cp.cuda.Stream(non_blocking=True) as other:   # plan and module made on another stream
                rtk.matmul(a, b, out=out, dtype="bfloat16")
                other.synchronize()
        graph = capture_cupy(s, lambda: rtk.matmul(a, b, out=out, dtype="bfloat16"))
    for step in range(2):
        ah2, bh2 = refill(rng, (a, b), "bfloat16")
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        _check(to_f64(out, "bfloat16"), ah2 @ bh2, _cublas(a, b, "bfloat16"), f"graph replay {step}")
        eager = rtk.matmul(a, b, dtype="bfloat16")
        cp.cuda.Device().synchronize()
        assert np.array_equal(eager.get(), out.get()), f"replay {step} != eager"


@pytest.mark.gpu
def test_gpu_split_torch_replay(monkeypatch):
    """torch tensors: the first call plans, the next ones replay the plan with the stream's
    workspace (a torch tensor); results equal the first call's bits."""
    torch = pytest.importorskip("torch")
    import rtkernels as rtk
    _sm90_gpu()
    monkeypatch.setenv(mm.SPLIT_K_ENV, "3")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(100, 3000, device="cuda", generator=g).bfloat16()
    b = torch.randn(3000, 640, device="cuda", generator=g).bfloat16()
    bias = torch.randn(640, device="cuda", generator=g).bfloat16()
    first = rtk.matmul(a, b, bias=bias, activation="gelu")
    again = [rtk.matmul(a, b, bias=bias, activation="gelu") for _ in range(3)]
    torch.cuda.synchronize()
    assert _split_of(100, 640, 3000, forced=3) == 3
    ref = torch.nn.functional.gelu(a.double() @ b.double() + bias.double())
    peer = torch.nn.functional.gelu((a @ b + bias).double())
    err, peer_err = (first.double() - ref).abs().max().item(), (peer - ref).abs().max().item()
    assert err <= 2 * peer_err + 1e-6, f"torch split 3: max error {err:.3g} vs cuBLAS {peer_err:.3g}"
    assert all(torch.equal(x, first) for x in again), "replays differ from the first call"
