"""attention_sm90 persistent=True: one CTA per SM walks the (query tile, head, batch) tiles.

CPU: validation messages, q_buffers / shared memory, the linear tile order's mirror (a
permutation, causal heaviest first), the grid and kernel arguments of a persistent launch, the
RTKERNELS_SM90_PERSISTENT knob, the per-call short schedule (SHORT_SCHEDULE rows: boundaries, memo,
validity over every head dim), four persistent builds (d64 / d128, causal and not) and the short
rows' widest head dims at sm_90a: no spills or local memory, HGMMA + TMA in the SASS, no ptxas
wgmma/setmaxnreg notes.
GPU (``-m gpu``, sm_90): the float64 reference and 2x error rule over awkward shapes with
poisoned outputs and lse, on the device's grid and on a 3-CTA grid (every CTA walks many tiles:
where a wrong barrier phase shows), rtk.attention dispatching the persistent kernel, the short
schedule's rows around their seqlen limits, and CUDA graph replays with new inputs (a captured
persistent launch; a captured rtk.attention plan of a short row).  Cheap first: a wrong phase
hangs, so one tiny shape runs first (run under ``timeout``).
"""
from __future__ import annotations

import importlib
import re

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError
from rtkernels.ops import attention_sm90 as A90
from rtkernels.ops.attention_sm90 import AttentionSm90Config
from rtkernels.ops._arrays import LaunchPlans

PTXAS_NOTES = ("C7508", "C7512", "C7514", "C7515", "C7517")


# ---- config -------------------------------------------------------------------------------
def test_persistent_validation_messages():
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=64, persistent="yes")
    assert "attention_sm90" in str(e.value) and "persistent" in str(e.value)
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=64, is_varlen=True, persistent=True)
    assert "persistent" in str(e.value) and "cu_seqlens" in str(e.value)
    # a tile that does not fit shared memory is reported as before (block_n), persistent or not
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=256, block_n=128, persistent=True)
    assert "block_n" in str(e.value)


def test_persistent_barriers_that_do_not_fit_name_persistent(monkeypatch):
    """A tile that fits only without the persistent walk's q_free barriers (8 B): the message names
    persistent, not the tile.  (No real tile sits within 8 B of the limit: the limit is lowered.)"""
    cfg = AttentionSm90Config(head_dim=256, block_m=128, block_n=80)
    monkeypatch.setattr(A90, "SMEM_LIMIT_SM90", cfg.shared_mem_bytes)
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(head_dim=256, block_m=128, block_n=80, persistent=True)
    assert "persistent" in str(e.value) and "False" in str(e.value), str(e.value)


def test_q_buffers_and_shared_memory():
    plain = AttentionSm90Config(dtype="bfloat16", head_dim=128, causal=True, block_m=128, block_n=128)
    pers = plain.replace(persistent=True)
    q, kv = 128 * 2 * 128, 128 * 2 * 128
    assert plain.q_buffers == 1 and plain.shared_mem_bytes == q + 4 * kv + 8 * 9 + 1024   # unchanged
    # two Q tiles, q_free[2] beside bar_q[2]: 64 + 128 KiB fits 227 KiB
    assert pers.q_buffers == 2 and pers.shared_mem_bytes == 2 * q + 4 * kv + 8 * (4 + 8) + 1024
    # d256 (Q 64 KiB + K/V 160 KiB): one Q buffer, one q_free
    big = AttentionSm90Config(head_dim=256, block_m=128, block_n=80, persistent=True)
    assert big.q_buffers == 1 and big.shared_mem_bytes <= A90.SMEM_LIMIT_SM90
    assert big.template_params()["q_buffers"] == 1 and big.template_params()["persistent"] is True
    assert pers.register_split == (40, 232) and plain.register_split == (24, 240)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("m_tiles,heads,batch", [(1, 1, 1), (5, 3, 2), (8, 4, 3)])
def test_linear_tiles_cover_every_tile_once_heaviest_first(causal, m_tiles, heads, batch):
    order = A90.linear_tiles(m_tiles, heads, batch, causal)
    want = {(m, h, b) for m in range(m_tiles) for h in range(heads) for b in range(batch)}
    assert len(order) == len(want) and set(order) == want
    tiles = [m for m, _, _ in order]
    if causal:   # the query tile never grows along the walk: heavy tiles start first, heads side by side
        assert tiles == sorted(tiles, reverse=True)
        assert order[:heads] == [(m_tiles - 1, h, 0) for h in range(heads)]
    else:        # one head's query tiles side by side (its K/V in L2), then the next head's
        assert order[: m_tiles * heads] == [(m, h, 0) for h in range(heads) for m in range(m_tiles)]


def test_linear_tile_mirror_matches_the_header():
    """The Python mirror states the header's formulas (rtk/attn_mask.cuh linear_tile)."""
    from pathlib import Path
    src = Path(rtk.__file__).resolve().parent.parent / "templates" / "include" / "rtk" / "attn_mask.cuh"
    text = src.read_text()
    body = text[text.index("linear_tile(int t"):]
    body = body[: body.index("return c;")]
    for line in ("c.tile = m_tiles - 1 - mt;", "const int r = t / m_tiles;", "c.tile = t - r * m_tiles;",
                 "c.batch = r / heads;", "c.head = r - c.batch * heads;"):
        assert line in body, line


class _View:
    def __init__(self, shape):
        self.shape = shape


def test_persistent_launch_grid_and_arguments():
    cfg = AttentionSm90Config(dtype="bfloat16", head_dim=64, causal=True, block_m=192, block_n=112, persistent=True)
    q, k = _View((3, 1000, 5, 64)), _View((3, 700, 1, 64))
    tiles = -(-1000 // 192) * 5 * 3   # 90
    la = A90.recorded_launch("kernel", cfg, q, k, 0.125, sm_count=132)
    assert la.grid == (tiles,) and la.block == (cfg.threads_per_block,) and la.shared_mem == cfg.shared_mem_bytes
    assert la.tail[-1] == 3 and la.tail[-2:-1] == (0.0,) and la.tail[:3] == (1000, 700, 5)
    assert A90.recorded_launch("kernel", cfg, q, k, 0.125, sm_count=7).grid == (7,)
    assert A90.persistent_grid(cfg, 1, 1, 1, 132) == 1
    plain = A90.recorded_launch("kernel", cfg.replace(persistent=False), q, k, 0.125, sm_count=7)
    assert plain.grid == (6, 5, 3) and plain.tail[-1] == 0.0   # unchanged: no batch argument


def test_env_knob(monkeypatch, built):
    monkeypatch.setenv("RTKERNELS_SM90_PERSISTENT", "0")
    assert not A90.choose_config("bfloat16", 64, True).persistent
    monkeypatch.setenv("RTKERNELS_SM90_PERSISTENT", "1")
    cfg = A90.choose_config("bfloat16", 64, True)   # built (and cached) by the fixture
    assert cfg.persistent and cfg == built[(64, True)][0]
    # varlen stays one CTA per tile (asked directly: choose_config with mask flags compiles)
    assert not A90.persistent_choice(A90.candidate(64, True), "bfloat16", 64, True, {"is_varlen": True})
    assert A90.persistent_choice(A90.candidate(64, True), "bfloat16", 64, True, {"has_window": True})
    # a pingpong tile (causal d128) walks without turns
    assert A90.candidate(128, True).pingpong and A90.persistent_choice(A90.candidate(128, True), "bfloat16", 128,
                                                                       True, {})
    monkeypatch.setenv("RTKERNELS_SM90_PERSISTENT", "2")
    with pytest.raises(ConfigError) as e:
        A90.choose_config("bfloat16", 64, True)
    assert "RTKERNELS_SM90_PERSISTENT" in str(e.value)
    monkeypatch.delenv("RTKERNELS_SM90_PERSISTENT")
    assert not A90.choose_config("bfloat16", 64, True).persistent   # default: off


def _tile_of(cfg) -> tuple:
    return tuple(getattr(cfg, f) for f in A90._TILE_FIELDS)


def test_short_schedule_picks_its_tile_per_call(monkeypatch):
    """Unset knob: a call whose seqlen_k makes at most the row's key tiles (of the row's own
    block_n) runs the row's tile, one more key and the per-head-dim config; at both ends of every
    row's head-dim range; dense inputs only; RTKERNELS_SM90_PERSISTENT=0 or 1 turn the rows off.
    (No compile: a row's config is taken as written.)"""
    monkeypatch.delenv("RTKERNELS_SM90_PERSISTENT", raising=False)
    reach = {}   # (head dim, causal) -> keys the earlier rows already cover (rows in increasing reach)
    for i, (lo, hi, causal, most, tile) in enumerate(A90.SHORT_SCHEDULE):
        edge = most * tile.block_n
        for d in (lo, hi):
            first = reach.get((d, causal), 0) + 1
            assert A90.short_entry(d, causal, first) == i and A90.short_entry(d, causal, edge) == i, (d, causal)
            later = [j for j, r in enumerate(A90.SHORT_SCHEDULE) if j > i and r[0] <= d <= r[1] and r[2] == causal]
            if later:   # one key more: the next row of this head dim
                assert A90.short_entry(d, causal, edge + 1) == later[0], (d, causal, edge)
                continue
            assert A90.short_entry(d, causal, edge + 1) is None, (d, causal, edge)
            cfg = A90.choose_config("float16", d, causal, seqlen_k=edge)
            assert _tile_of(cfg) == tuple(getattr(tile, f) for f in A90._TILE_FIELDS), (d, causal, cfg)
            assert cfg.exp2_poly == A90._EXP2_POLY_DENSE and not cfg.has_window and not cfg.has_softcap
            assert A90.choose_config("float16", d, causal, seqlen_k=edge + 1) == A90.choose_config("float16", d, causal)
            for flag in ("has_window", "has_softcap", "is_varlen"):
                assert A90.short_entry(d, causal, first, {flag: True}) is None
            assert A90.short_entry(d, causal, first, {"has_window": False}) == i
        for d in range(lo, hi + 1, 8):
            reach[(d, causal)] = edge
    assert A90.short_entry(64, False, None) is None
    short = A90.choose_config("bfloat16", 64, True, seqlen_k=512)
    assert short.persistent and (short.block_m, short.pingpong) == (128, False)
    monkeypatch.setenv("RTKERNELS_SM90_PERSISTENT", "0")   # the per-head-dim configs, no walk
    assert A90.short_entry(64, True, 512) is None
    assert A90.choose_config("bfloat16", 64, True, seqlen_k=512) == A90.choose_config("bfloat16", 64, True)
    assert not A90.choose_config("bfloat16", 64, True, seqlen_k=512).persistent
    monkeypatch.setenv("RTKERNELS_SM90_PERSISTENT", "1")   # the per-head-dim tile walks (no row)
    assert A90.short_entry(64, True, 512) is None
    monkeypatch.setenv("RTKERNELS_SM90_PERSISTENT", "yes")
    with pytest.raises(ConfigError, match="RTKERNELS_SM90_PERSISTENT"):
        A90.choose_config("bfloat16", 64, True, seqlen_k=512)


def test_short_schedule_kernel_memo(monkeypatch):
    """kernel_for: one memo entry per (row, knob); masked calls never take a row (stub kernels: no
    compile)."""
    monkeypatch.delenv("RTKERNELS_SM90_PERSISTENT", raising=False)
    monkeypatch.setattr(A90, "_KERNELS", {})
    from types import SimpleNamespace
    stub = SimpleNamespace(resources=SimpleNamespace(spill_stores=0, spill_loads=0, stack_frame=0))
    monkeypatch.setattr("rtkernels.kernel.get_kernel", lambda cfg, *a, **kw: stub)
    _, a = A90.kernel_for("bfloat16", 64, False, "sm_90a", (), seqlen_k=512)
    _, b = A90.kernel_for("bfloat16", 64, False, "sm_90a", (), seqlen_k=1024)
    _, c = A90.kernel_for("bfloat16", 64, False, "sm_90a", ())
    assert a.persistent and not b.persistent and b == c and len(A90._KERNELS) == 2
    _, d = A90.kernel_for("bfloat16", 256, True, "sm_90a", (), seqlen_k=500)
    assert (d.block_n, d.pingpong, d.persistent) == (64, False, False)
    _, w = A90.kernel_for("bfloat16", 64, False, "sm_90a", (("has_window", True),), seqlen_k=512)
    assert not w.persistent and w.has_window
    monkeypatch.setenv("RTKERNELS_SM90_PERSISTENT", "0")
    _, e = A90.kernel_for("bfloat16", 64, False, "sm_90a", (), seqlen_k=512)
    assert e == c and len(A90._KERNELS) == 5   # its own entry: the knob is part of the key


def test_short_schedule_rows_are_well_formed_and_fit():
    """Rows: head-dim ranges on the multiples of 8; the rows of one (head dim, causal) in strictly
    increasing reach (keys), so each is reachable; a reason each; every row's tile is a valid config
    (shared memory, no pingpong with the walk) at every head dim it covers, in both dtypes."""
    reach = {}
    for lo, hi, causal, most, tile in A90.SHORT_SCHEDULE:
        assert 8 <= lo <= hi <= 256 and lo % 8 == 0 and hi % 8 == 0 and isinstance(causal, bool)
        assert most >= 1 and len(tile.why) > 40 and "->" in tile.why
        for d in range(lo, hi + 1, 8):
            assert reach.get((d, causal), 0) < most * tile.block_n, (d, causal)
            first = reach.get((d, causal), 0) + 1
            reach[(d, causal)] = most * tile.block_n
            for dt in ("float16", "bfloat16"):
                cfg = A90.choose_config(dt, d, causal, seqlen_k=first)
                assert cfg.shared_mem_bytes <= A90.smem_limit(cfg.ctas_per_sm) and not (cfg.persistent and cfg.pingpong)


def _short_build_cases():
    """(head_dim, causal) per row: the widest head dim (most registers, most shared memory) and, for
    persistent rows whose range crosses it, the last head dim with two Q buffers; every head dim
    with RTKERNELS_TEST_FULL_SWEEP=1."""
    from sweep import FULL_SWEEP
    out = []
    for lo, hi, causal, most, tile in A90.SHORT_SCHEDULE:
        keys = most * tile.block_n   # the row's reach: this row's tile, whichever rows come before
        dims = range(lo, hi + 1, 8) if FULL_SWEEP else [hi] + [
            d for d in range(lo, hi, 8) if tile.persistent
            and A90.choose_config("bfloat16", d, causal, seqlen_k=keys).q_buffers
            != A90.choose_config("bfloat16", d + 8, causal, seqlen_k=keys).q_buffers]
        out += [(d, causal, keys) for d in dims]
    return out


@pytest.fixture(scope="module")
def built_short(built):
    """The short rows' configs at :func:`_short_build_cases` (bf16), compiled once - those the
    persistent fixture already built are shared (d64 non-causal, d128 both)."""
    from concurrent.futures import ThreadPoolExecutor
    have = {c: k for c, k in built.values()}
    cfgs = {(d, c, keys): A90.choose_config("bfloat16", d, c, seqlen_k=keys) for d, c, keys in _short_build_cases()}
    todo = [c for c in dict.fromkeys(cfgs.values()) if c not in have]
    with ThreadPoolExecutor(2) as ex:
        have.update(zip(todo, ex.map(lambda c: rtk.get_kernel(c, arch="sm_90a"), todo)))
    return {case: (c, have[c]) for case, c in cfgs.items()}


def test_short_schedule_builds_without_spills(built_short):
    """NVRTC 13.5, sm_90a: no spills or local memory, HGMMA + TMA, no ptxas wgmma/setmaxnreg notes."""
    bad = []
    for (d, causal, _), (cfg, k) in built_short.items():
        r = k.resources
        ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", k.sass, re.M)
        names = {o.split(".")[0] for o in ops}
        if r.spill_stores or r.spill_loads or r.stack_frame or any(o.startswith(("LDL", "STL")) for o in ops):
            bad.append((d, causal, cfg.key(), "spills", r))
        if not {"UTMALDG", "UTMASTG"} <= names or f"HGMMA.64x{cfg.block_n}x16.F32" not in k.sass:
            bad.append((d, causal, cfg.key(), "no HGMMA / TMA"))
        if any(c in k.module.log for c in PTXAS_NOTES):
            bad.append((d, causal, cfg.key(), k.module.log))
    assert not bad, bad


def test_compile_by_name_takes_persistent_with_the_heuristic_tile():
    cfg = AttentionSm90Config.from_params(dict(dtype="bfloat16", head_dim=64, causal=True, persistent=True))
    heur = A90.choose_config("bfloat16", 64, True)
    assert cfg == heur.replace(persistent=True, lpt_grid=False)   # the walk has its own order


# ---- model of the persistent walk's barrier protocol -------------------------------------------
# the mbarrier model of the one-tile protocol's test (phases counted exactly: parity aliasing is caught)
from test_attention_sm90 import _Bar  # noqa: E402


def _simulate_walk(tiles, stages, consumers, q_bufs, overlap, under_pv, rng, regs=None):
    """One persistent CTA as the template runs it: a Q thread, a K and a V thread and 4 warps per
    consumer warpgroup as generators in random order; TMA loads land and O stores finish reading
    shared memory at random later times.  ``tiles``: per tile of the walk, (ring tiles the CTA
    streams, [key tiles each warpgroup computes]).  Ring positions count across tiles; Q tile k
    goes to buffer k % q_bufs once q_free says the tile q_bufs before it is done (staged O read by
    its store); with 2 buffers the store-read wait and release come after the next tile's first
    S GEMM (or at its epilogue when it has no keys).  ``regs``: (launch, producer, consumer)
    registers per thread - the setmaxnreg split, per warp: a producer warp's dec returns
    32 x (launch - producer) to the CTA's pool, a consumer warp's inc waits until the pool holds
    32 x (consumer - launch) (PTX: setmaxnreg.inc blocks until enough registers are free).  Checks:
    no deadlock, no stale or overwritten K/V/Q, every warp reads its tiles in the template's order."""
    pool = [0]
    full_k, full_v = [_Bar(1) for _ in range(stages)], [_Bar(1) for _ in range(stages)]
    empty_k, empty_v = [_Bar(4 * consumers) for _ in range(stages)], [_Bar(4 * consumers) for _ in range(stages)]
    bar_q, q_free = [_Bar(1) for _ in range(q_bufs)], [_Bar(consumers) for _ in range(q_bufs)]
    slot_k, slot_v, slot_q = [None] * stages, [None] * stages, [None] * q_bufs
    landing, reading = [], []          # loads in flight; O stores still reading their staged rows
    store_done = {}                    # (warpgroup, tile) -> its store has read the staging
    at_epilogue = {}                   # (warpgroup, tile) -> warps past their last GEMM
    bases = np.concatenate([[0], np.cumsum([n for n, _ in tiles])]).astype(int)

    def wait(bar, phase):
        while not bar.try_wait(phase & 1, phase):
            yield

    def producer_warp():   # setmaxnreg.dec (the Q / K / V threads' warps and the idle fourth)
        if regs is not None and regs[1] < regs[0]:   # a split (one consumer alone on the SM: none)
            pool[0] += 32 * (regs[0] - regs[1])
        yield

    def q_thread():
        for k in range(len(tiles)):
            buf = k % q_bufs
            if k >= q_bufs:
                yield from wait(q_free[buf], k // q_bufs - 1)
            assert all(v for (w, t), v in store_done.items() if t == k - q_bufs), "Q reloaded under a store"
            slot_q[buf] = None
            landing.append((slot_q, buf, k, bar_q[buf]))
            yield

    def ring_thread(is_v):
        slots, full, empty = (slot_v, full_v, empty_v) if is_v else (slot_k, full_k, empty_k)
        for g in range(bases[-1]):
            st = g % stages
            if g >= stages:
                yield from wait(empty[st], g // stages - 1)
            slots[st] = None
            landing.append((slots, st, g, full[st]))
            yield

    seen = [[] for _ in range(4 * consumers)]

    def warp(w):
        cw, lead = w // 4, w % 4 == 0
        if regs is not None and regs[1] < regs[0]:   # setmaxnreg.inc
            need = 32 * (regs[2] - regs[0])
            while pool[0] < need:
                yield
            pool[0] -= need

        def use(g, is_v):
            st = g % stages
            yield from wait((full_v if is_v else full_k)[st], g // stages)
            assert (slot_v if is_v else slot_k)[st] == g
            seen[w].append(("PV" if is_v else "S", g))

        def release(g, is_v, read=True):
            st = g % stages
            if read:
                assert (slot_v if is_v else slot_k)[st] == g, "slot overwritten while being read"
            (empty_v if is_v else empty_k)[st].arrive()

        def release_q(k):   # 2 buffers: tile k-1's store has read its rows -> its buffer is free
            if q_bufs == 2 and k > 0 and lead:
                while not store_done[(cw, k - 1)]:
                    yield
                q_free[(k - 1) % 2].arrive()

        for k, (ring, own) in enumerate(tiles):
            base, mine, buf = bases[k], own[cw], k % q_bufs
            yield from wait(bar_q[buf], k // q_bufs)
            assert slot_q[buf] == k
            if overlap:
                if mine:
                    yield from use(base, False)
                    yield from release_q(k)
                    yield
                    release(base, False)
                for n in range(1, mine):
                    if under_pv and n >= 2:
                        release(base + n - 2, True)
                    yield from use(base + n, False)
                    yield from use(base + n - 1, True)
                    yield
                    release(base + n, False)
                    if not under_pv:
                        yield
                        release(base + n - 1, True)
                    yield
                if mine:
                    if under_pv and mine >= 2:
                        release(base + mine - 2, True)
                    yield from use(base + mine - 1, True)
                    yield
                    release(base + mine - 1, True)   # persistent: the last V, tiles follow
            else:
                if mine:
                    yield from release_q(k)
                for n in range(mine):
                    yield from use(base + n, False)
                    yield
                    release(base + n, False)
                    yield from use(base + n, True)
                    yield
                    release(base + n, True)
            for n in range(mine, ring):   # past this warpgroup's rows: released unread, after landing
                yield from wait(full_k[(base + n) % stages], (base + n) // stages)
                release(base + n, False, read=False)
                yield from wait(full_v[(base + n) % stages], (base + n) // stages)
                release(base + n, True, read=False)
            # epilogue: the warpgroup's named barrier, O staged in its Q rows, one thread stores
            if not mine:
                yield from release_q(k)
            at_epilogue[(cw, k)] = at_epilogue.get((cw, k), 0) + 1
            while at_epilogue[(cw, k)] < 4:   # named barrier: every warp past its last GEMM
                yield
            assert slot_q[buf] == k, "staging into a Q buffer the next tile's load owns"
            yield
            at_epilogue[(cw, k)] += 1
            while at_epilogue[(cw, k)] < 8:   # named barrier: every warp's rows staged
                yield
            if lead:
                store_done[(cw, k)] = False
                reading.append((cw, k, buf))
                if q_bufs == 1:
                    while not store_done[(cw, k)]:
                        yield
                    q_free[0].arrive()
            yield

    actors = [q_thread(), ring_thread(False), ring_thread(True)] + [warp(w) for w in range(4 * consumers)]
    actors += [producer_warp() for _ in range(4)]
    steps = 0
    while actors or reading:
        steps += 1
        assert steps < 400000, "deadlock"
        if landing and rng.random() < 0.3:
            slots, st, tag, bar = landing.pop(int(rng.integers(len(landing))))
            slots[st] = tag
            bar.arrive()
        if reading and rng.random() < 0.3:
            cw, k, buf = reading.pop(int(rng.integers(len(reading))))
            assert slot_q[buf] == k, "Q buffer reloaded while its store still reads it"
            store_done[(cw, k)] = True
        if actors:
            i = int(rng.integers(len(actors)))
            try:
                next(actors[i])
            except StopIteration:
                actors.pop(i)
    return seen, bases


def _random_walk(rng, consumers):
    """Per tile (ring tiles, [key tiles of each warpgroup]): full, empty (rows that see no key),
    warpgroups stopping early (causal, own ranges)."""
    tiles = []
    for _ in range(int(rng.integers(3, 9))):
        ring = int(rng.integers(0, 6))
        own = [ring] * consumers if rng.random() < 0.5 else sorted(
            int(rng.integers(0, ring + 1)) for _ in range(consumers))
        own[-1] = ring if consumers > 1 or rng.random() < 0.8 else own[-1]
        tiles.append((ring, own))
    return tiles


def _regs(consumers):
    """(launch, producer, consumer) registers of the persistent config with this many consumer
    warpgroups (the template's numbers: launch cap and setmaxnreg split)."""
    cfg = AttentionSm90Config(head_dim=64, block_m=64 * consumers, block_n=64, persistent=True)
    return (cfg.launch_registers, *cfg.register_split)


@pytest.mark.parametrize("q_bufs", [1, 2])
@pytest.mark.parametrize("overlap,under_pv", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("stages,consumers", [(2, 2), (3, 2), (2, 3), (2, 1)])
def test_model_persistent_walk_has_no_deadlock_or_stale_tile(q_bufs, overlap, under_pv, stages, consumers):
    """Tiles of every kind in a row - ring positions and Q phases wrap many times within one CTA;
    the consumers first take their registers from the producer's (the config's split)."""
    rng = np.random.default_rng(100 * stages + 10 * consumers + q_bufs)
    for _ in range(6):
        tiles = _random_walk(rng, consumers)
        seen, bases = _simulate_walk(tiles, stages, consumers, q_bufs, overlap, under_pv, rng, _regs(consumers))
        for w, order in enumerate(seen):
            want = []
            for k, (_, own) in enumerate(tiles):
                n, b = own[w // 4], bases[k]
                if overlap:
                    want += ([("S", b)] if n else []) + [x for i in range(1, n) for x in
                                                         (("S", b + i), ("PV", b + i - 1))] + (
                        [("PV", b + n - 1)] if n else [])
                else:
                    want += [x for i in range(n) for x in (("S", b + i), ("PV", b + i))]
            assert order == want, (w, tiles)


def test_model_catches_a_register_split_past_the_launch_pool():
    """The GPU hang of 2026-11-25 (H100): every 128-row (two-consumer) persistent tile hung, with
    and without pingpong, while the 192-row tiles ran.  The persistent split was 32 / 240: 128 x 32
    + 256 x 240 = 65536, but a 384-thread CTA holds 384 x 168 = 64512 - the eighth consumer warp's
    setmaxnreg.inc waits forever.  The model deadlocks on that split, in a causal walk whose
    warpgroups stop at their own rows, and runs with the config's."""
    rng = np.random.default_rng(7)
    tiles = [(4, [3, 4]), (3, [2, 3]), (2, [1, 2]), (1, [0, 1])]   # causal 128-row tiles, heaviest first
    launch = AttentionSm90Config(head_dim=128, block_m=128, persistent=True).launch_registers
    assert launch == 168
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate_walk(tiles, 2, 2, 2, True, True, rng, (launch, 32, 240))
    _simulate_walk(tiles, 2, 2, 2, True, True, rng, _regs(2))


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("persistent", [False, True])
def test_register_split_fits_the_launch_pool(consumers, persistent):
    """setmaxnreg moves registers within what the CTA got at launch (threads x the launch-bounds
    cap), not the 64 Ki file; the 3-consumer split is the whole 512 x 128."""
    cfg = AttentionSm90Config(head_dim=128, block_m=64 * consumers, block_n=64, persistent=persistent)
    p, c = cfg.register_split
    assert 128 * p + 128 * consumers * c <= cfg.threads_per_block * cfg.launch_registers, (cfg, p, c)
    assert cfg.launch_registers == {2: 168, 3: 128}[consumers]
    if consumers == 3:
        assert (p, c) == (32, 160)   # unchanged


# ---- builds: 4 compiles, shared ---------------------------------------------------------------
def _persistent_config(dtype, d, causal):
    """The persistent tile the tests use: the heuristic's, except where it has pingpong (which the
    walk rejects: it hung on the GPU) and d128 non-causal, whose 192x128 tile spills 4 B with the
    walk's state (NVRTC 13.5): the 128x128 overlap tile without pingpong, which
    RTKERNELS_SM90_PERSISTENT=1's fallback picks too."""
    cfg = A90.choose_config(dtype, d, causal)
    if d > 120 and not causal and d <= 128:
        return AttentionSm90Config(dtype=dtype, head_dim=d, causal=causal, block_m=128, block_n=128,
                                   intra_overlap=True, pingpong=False, persistent=True)
    # the heuristic's tile, without pingpong and lpt_grid (the walk has its own order)
    return cfg.replace(pingpong=False, persistent=True, lpt_grid=False)


@pytest.fixture(scope="module")
def built():
    from concurrent.futures import ThreadPoolExecutor
    cases = [(64, False), (64, True), (128, False), (128, True)]
    cfgs = [_persistent_config("bfloat16", d, c) for d, c in cases]
    with ThreadPoolExecutor(2) as ex:   # NVRTC releases the GIL
        kerns = list(ex.map(lambda c: rtk.get_kernel(c, arch="sm_90a"), cfgs))
    return {case: (c, k) for case, c, k in zip(cases, cfgs, kerns)}


@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_persistent_builds_without_spills_with_hgmma_and_tma(built, d, causal):
    cfg, k = built[(d, causal)]
    r = k.resources
    assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (cfg, r)
    # the pool setmaxnreg shares out is threads x this count (the split fits it: the template asserts)
    assert r.registers == cfg.launch_registers, (cfg, r)
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", k.sass, re.M)
    names = {o.split(".")[0] for o in ops}
    assert {"UTMALDG", "UTMASTG", "SYNCS", "USETMAXREG"} <= names, names
    assert f"HGMMA.64x{cfg.block_n}x16.F32" in k.sass and f"HGMMA.64x{d}x16.F32" in k.sass
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "no local memory"
    assert not any(c in k.module.log for c in PTXAS_NOTES), k.module.log
    # the persistent walk's Q thread: one more Q load site than the K/V thread's
    assert cfg.persistent and k.module.arch == "sm_90a"


# ---- GPU ------------------------------------------------------------------------------------
def _need_sm90():
    from rtkernels import device
    if not device.has_gpu() or not device.device_arch().startswith("sm_90"):
        pytest.skip("needs an sm_90 device")


# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype): cheap first
TINY = (1, 1, 1, 1, 1, 64, True, "bfloat16")


def case_id(c) -> str:
    """A GPU case's test id (shared by the flat-walk and two-CTA test files)."""
    return "b{}_q{}_k{}_h{}/{}_d{}_{}_{}".format(c[0], c[1], c[2], c[3], c[4], c[5], "causal" if c[6] else "full",
                                                 c[7])


CASES = [
    TINY,
    (3, 7, 7, 5, 5, 64, True, "bfloat16"),
    (3, 129, 129, 5, 1, 64, False, "float16"),
    (3, 513, 513, 5, 5, 80, True, "bfloat16"),
    (3, 513, 1000, 5, 1, 80, False, "bfloat16"),
    (3, 1000, 1000, 5, 1, 128, True, "bfloat16"),
    (3, 1000, 513, 5, 5, 128, False, "float16"),
    (3, 1000, 1, 5, 1, 128, True, "bfloat16"),    # causal, seqlen_q > seqlen_k: rows that see no key
    (3, 1, 1000, 5, 5, 64, True, "float16"),
    (3, 129, 2049, 5, 1, 128, True, "bfloat16"),
    (3, 2049, 2049, 5, 5, 256, True, "bfloat16"),
    (2, 2049, 1000, 5, 1, 256, False, "float16"),
    (3, 2049, 2049, 5, 1, 64, False, "bfloat16"),
]
_KERNELS: dict = {}


def _kernel(dtype, d, causal):
    cfg = _persistent_config(dtype, d, causal)
    if cfg not in _KERNELS:
        _KERNELS[cfg] = rtk.get_kernel(cfg, arch="sm_90a")
    return cfg, _KERNELS[cfg]


def _inputs(case, seed):
    import cupy as cp
    from gpu_util import poison
    from test_attention import _data
    batch, sq, sk, h, hkv, d, causal, dtype = case
    rng = np.random.default_rng(seed)
    q = _data(rng, (batch, sq, h, d), dtype)
    k = _data(rng, (batch, sk, hkv, d), dtype)
    v = _data(rng, (batch, sk, hkv, d), dtype)
    o = poison(cp.empty(q.shape, q.dtype))
    lse = poison(cp.empty((batch, h, sq), cp.float32))
    return q, k, v, o, lse


def run_and_check(cfg, kern, case, sm_count, seed=None):
    """Launch ``kern`` (built from ``cfg``) on fresh inputs of ``case`` with poisoned outputs, check
    against the float64 reference; a failure names the case, seed, grid and config.  Returns
    (q, k, v, o, lse).  Shared by the flat-walk and two-CTA tests."""
    import cupy as cp
    from rtkernels import device
    from test_attention import _check
    seed = int(np.random.SeedSequence().entropy % 2**32) if seed is None else seed
    batch, sq, sk, h, hkv, d, causal, dtype = case
    q, k, v, o, lse = _inputs(case, seed)
    A90.launch(kern, cfg, q, k, v, o, lse, d ** -0.5, sm_count=sm_count)
    cp.cuda.get_current_stream().synchronize()
    grid = A90.persistent_grid(cfg, batch, sq, h, sm_count or device.sm_count()) if cfg.persistent else None
    try:
        _check(q, k, v, causal, dtype, o, lse)
    except AssertionError as e:
        raise AssertionError(f"{e}\ncase={case} seed={seed} sm_count={sm_count} grid={grid} "
                             f"cfg={cfg.key()}") from None
    return q, k, v, o, lse


def _check_case(case, sm_count, seed=None):
    cfg, kern = _kernel(case[7], case[5], case[6])
    run_and_check(cfg, kern, case, sm_count, seed)


@pytest.mark.gpu
def test_gpu_tiny_first():
    _need_sm90()
    _check_case(TINY, None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_device_grid(case):
    _need_sm90()
    _check_case(case, None)


@pytest.mark.gpu
@pytest.mark.parametrize("sm_count", [1, 3])
@pytest.mark.parametrize("case", CASES[1:], ids=case_id)
def test_gpu_small_grid_walks_many_tiles(case, sm_count):
    """1 or 3 CTAs for up to 165 tiles: every barrier goes through many phases per CTA, and the Q
    buffers and K/V ring wrap at every tile boundary."""
    _need_sm90()
    _check_case(case, sm_count)


def _persistent_knob_on(monkeypatch, value: str | None = "1") -> list:
    """RTKERNELS_SM90_PERSISTENT=value (None: unset) with fresh kernel and plan memos; returns the
    list the configs of A90.launch's calls are appended to."""
    if value is None:
        monkeypatch.delenv("RTKERNELS_SM90_PERSISTENT", raising=False)
    else:
        monkeypatch.setenv("RTKERNELS_SM90_PERSISTENT", value)
    monkeypatch.setattr(A90, "_KERNELS", {})
    monkeypatch.setattr(importlib.import_module("rtkernels.ops.attention"), "_FORWARD_PLANS", LaunchPlans())
    monkeypatch.setenv("RTKERNELS_ATTENTION_DECODE", "0")   # few query rows stay on the Hopper kernel
    calls = []
    real = A90.launch
    monkeypatch.setattr(A90, "launch", lambda kern, cfg, *a, **kw: (calls.append(cfg), real(kern, cfg, *a, **kw)))
    return calls


@pytest.mark.gpu
def test_gpu_op_dispatches_persistent_with_env(monkeypatch):
    _need_sm90()
    import cupy as cp
    from test_attention import _check
    calls = _persistent_knob_on(monkeypatch)
    case = (3, 1000, 1000, 5, 1, 64, True, "bfloat16")
    q, k, v, o, _ = _inputs(case, 1)
    o2, lse = rtk.attention(q, k, v, causal=True, out=o, dtype="bfloat16")
    cp.cuda.get_current_stream().synchronize()
    assert calls and calls[-1].persistent, calls
    _check(q, k, v, True, "bfloat16", o2, lse)
    # a second call with the same signature replays the recorded (persistent) launch
    from gpu_util import poison
    o3, lse3 = rtk.attention(q, k, v, causal=True, out=poison(cp.empty_like(o)), dtype="bfloat16")
    cp.cuda.get_current_stream().synchronize()
    assert cp.array_equal(o3, o2) and cp.array_equal(lse3, lse)


# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype, short?): every SHORT_SCHEDULE
# row at its last seqlen_k (512 or 1024), one below and one above, at the ends of its head-dim range
# (causal rows walk in L2-sized sections: d64 to 2048 keys, d128 to 4096, d256 a second row to 1024);
# GQA, seqlen_q != seqlen_k (causal: bottom-right; seqlen_q > seqlen_k leaves rows that see no key)
SHORT_CASES = [
    (2, 500, 500, 4, 2, 64, False, "bfloat16", True), (2, 512, 512, 4, 1, 64, False, "float16", True),
    (2, 513, 513, 4, 2, 64, False, "bfloat16", False), (2, 300, 512, 6, 2, 40, False, "bfloat16", True),
    (2, 1000, 1000, 4, 2, 64, True, "bfloat16", True), (2, 1024, 1024, 4, 1, 64, True, "float16", True),
    (2, 1025, 1025, 4, 2, 64, True, "bfloat16", True), (2, 513, 513, 4, 4, 24, True, "bfloat16", True),
    (2, 2048, 2048, 2, 1, 64, True, "float16", True), (2, 2049, 2049, 2, 2, 64, True, "bfloat16", False),
    (2, 512, 512, 4, 2, 64, True, "bfloat16", True), (2, 300, 700, 4, 1, 56, True, "float16", True),
    (2, 1024, 1024, 4, 2, 80, False, "bfloat16", True), (2, 1025, 1025, 4, 2, 80, False, "bfloat16", False),
    (2, 513, 1000, 4, 1, 96, False, "float16", True),
    (2, 1000, 1024, 4, 2, 96, True, "bfloat16", True), (2, 512, 512, 4, 2, 72, True, "float16", True),
    (2, 1025, 1025, 4, 2, 80, True, "bfloat16", False),
    (2, 1000, 1000, 4, 2, 128, False, "bfloat16", True), (2, 1024, 1024, 4, 1, 112, False, "float16", True),
    (2, 1025, 1025, 4, 2, 128, False, "bfloat16", False),
    (2, 512, 512, 4, 2, 128, True, "bfloat16", True), (2, 500, 500, 4, 1, 120, True, "float16", True),
    (2, 513, 513, 4, 2, 128, True, "bfloat16", True), (2, 1000, 300, 4, 2, 104, True, "bfloat16", True),
    (1, 4096, 4096, 2, 1, 128, True, "bfloat16", True), (1, 4097, 4097, 2, 1, 120, True, "float16", False),
    (2, 512, 512, 4, 2, 256, False, "bfloat16", True), (2, 500, 500, 4, 1, 136, False, "float16", True),
    (2, 513, 513, 4, 2, 256, False, "bfloat16", False), (2, 1000, 512, 4, 2, 192, False, "bfloat16", True),
    (2, 512, 512, 4, 2, 256, True, "bfloat16", True), (2, 500, 500, 4, 2, 248, True, "float16", True),
    (2, 513, 513, 4, 1, 200, True, "bfloat16", True), (2, 333, 512, 4, 2, 192, True, "bfloat16", True),
    (2, 1024, 1024, 2, 1, 256, True, "bfloat16", True), (2, 1025, 1025, 2, 1, 144, True, "float16", False),
]


@pytest.fixture(scope="module")
def short_prebuilt():
    """The configs SHORT_CASES run, compiled in parallel once (NVRTC releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    from rtkernels import device
    if not device.has_gpu() or not device.device_arch().startswith("sm_90"):
        return
    cfgs = {A90.choose_config(c[7], c[5], c[6], seqlen_k=c[2]) for c in SHORT_CASES}
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda c: rtk.get_kernel(c, arch="sm_90a"), cfgs))


def _op_spy(monkeypatch) -> list:
    """Knob unset, fresh kernel and plan memos; returns the list A90.launch's configs go to."""
    return _persistent_knob_on(monkeypatch, None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SHORT_CASES, ids=lambda c: "b{}_q{}_k{}_h{}/{}_d{}_{}_{}_{}".format(
    c[0], c[1], c[2], c[3], c[4], c[5], "causal" if c[6] else "full", c[7], "short" if c[8] else "long"))
def test_gpu_short_schedule(monkeypatch, short_prebuilt, case):
    """Knob unset: rtk.attention runs the SHORT_SCHEDULE row's config up to the row's seqlen_k and the
    per-head-dim config one key past it; float64 reference and the 2x rule with poisoned outputs;
    the replayed plan gives the same bits."""
    _need_sm90()
    import cupy as cp
    from gpu_util import poison
    from test_attention import _check
    calls = _op_spy(monkeypatch)
    *shape, want_short = case
    batch, sq, sk, h, hkv, d, causal, dtype = shape
    seed = int(np.random.SeedSequence().entropy % 2**32)
    q, k, v, o, _ = _inputs(tuple(shape), seed)
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    o2, lse = rtk.attention(q, k, v, causal=causal, out=o, **extra)
    cp.cuda.get_current_stream().synchronize()
    plain = A90.choose_config(dtype, d, causal)
    assert calls, case
    cfg = calls[-1]
    assert (cfg != plain) == want_short and cfg == A90.choose_config(dtype, d, causal, seqlen_k=sk), (case, cfg)
    where = f"case={case} seed={seed} cfg={cfg.key()}"
    try:
        _check(q, k, v, causal, dtype, o2, lse)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{where}") from None
    o3, lse3 = rtk.attention(q, k, v, causal=causal, out=poison(cp.empty_like(o)), **extra)
    cp.cuda.get_current_stream().synchronize()
    assert len(calls) == 1, where   # replayed: no second A90.launch
    assert cp.array_equal(o3, o2) and cp.array_equal(lse3, lse), where


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,sk", [(64, True, 1000), (256, False, 512), (256, True, 480)])
def test_gpu_short_plan_replays_in_a_cuda_graph(monkeypatch, d, causal, sk):
    """rtk.attention's recorded launch of a short row (the walk; d256 causal: the plain 128x64
    tile) captured in a CUDA graph on a side stream, replayed with new inputs in the same buffers
    three times (the walk's grid comes from shapes: nothing read back)."""
    _need_sm90()
    import cupy as cp
    from test_attention import _check
    calls = _op_spy(monkeypatch)
    case = (2, sk - 37, sk, 4, 2, d, causal, "bfloat16")
    q, k, v, o, _ = _inputs(case, 5)
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        rtk.attention(q, k, v, causal=causal, out=o, dtype="bfloat16")   # plans the launch, loads the module
        s.synchronize()
        s.begin_capture()
        _, lse = rtk.attention(q, k, v, causal=causal, out=o, dtype="bfloat16")
        graph = s.end_capture()
    cfg = calls[-1]
    assert len(calls) == 1 and cfg == A90.choose_config("bfloat16", d, causal, seqlen_k=sk) != A90.choose_config(
        "bfloat16", d, causal), calls
    for step in range(3):
        seed = 200 + step
        q2, k2, v2, _, _ = _inputs(case, seed)
        for dst, src in ((q, q2), (k, k2), (v, v2)):
            dst[...] = src
        o.view(cp.uint8).fill(0xFF)
        lse.view(cp.uint8).fill(0xFF)
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        try:
            _check(q, k, v, causal, "bfloat16", o, lse)
        except AssertionError as e:
            raise AssertionError(f"{e}\ngraph replay {step} case={case} seed={seed} cfg={cfg.key()}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(64, True), (128, False)])
def test_gpu_cuda_graph_replays_with_new_inputs(d, causal):
    """The persistent launch captured once (grid from shapes, no device reads) replays correctly
    with new data in the same buffers, three times."""
    _need_sm90()
    import cupy as cp
    from test_attention import _check
    case = (2, 777, 901, 5, 1, d, causal, "bfloat16")
    cfg, kern = _kernel("bfloat16", d, causal)
    q, k, v, o, lse = _inputs(case, 2)
    maps = A90.tensor_maps(cfg, q, k, v, o)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        A90.launch(kern, cfg, q, k, v, o, lse, d ** -0.5, stream=s, maps=maps)   # warm (module loaded)
        s.synchronize()
        s.begin_capture()
        A90.launch(kern, cfg, q, k, v, o, lse, d ** -0.5, stream=s, maps=maps)
        graph = s.end_capture()
    for step in range(3):
        q2, k2, v2, _, _ = _inputs(case, 100 + step)
        for dst, src in ((q, q2), (k, k2), (v, v2)):
            dst[...] = src
        o.view(cp.uint8).fill(0xFF)
        lse.view(cp.uint8).fill(0xFF)
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        _check(q, k, v, causal, "bfloat16", o, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,window,softcap,d", [(True, (100, 0), None, 64), (False, (64, 32), 30.0, 128),
                                                     (True, None, 50.0, 128), (False, (200, 7), None, 80)])
def test_gpu_window_and_softcap(monkeypatch, causal, window, softcap, d):
    """Windows and softcap come through rtk/attn_mask.cuh per tile: rtk.attention with the knob on
    (the masked tile choice), then the same config on a 3-CTA grid."""
    _need_sm90()
    import cupy as cp
    from gpu_util import poison
    from test_attention_varlen import _forward_check
    from rtkernels.ops.attention_mask import mask_spec
    real = A90.launch   # before the spy
    calls = _persistent_knob_on(monkeypatch)
    dtype = "bfloat16" if d != 80 else "float16"
    case = (3, 777, 901, 5, 1, d, causal, dtype)
    q, k, v, o, _ = _inputs(case, 3)
    extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    o, lse = rtk.attention(q, k, v, causal=causal, window=window, softcap=softcap, out=o, **extra)
    cp.cuda.get_current_stream().synchronize()
    assert calls and calls[-1].persistent, calls
    where = f"case={case} window={window} softcap={softcap} cfg={calls[-1].key()}"
    _forward_check(q, k, v, dtype, o, lse, where, causal=causal, window=window, softcap=softcap)
    cfg = calls[-1]
    o3, lse3 = poison(cp.empty_like(o)), poison(cp.empty_like(lse))
    args = mask_spec(causal, window, softcap).kernel_args(777, 901)
    real(rtk.get_kernel(cfg, arch="sm_90a"), cfg, q, k, v, o3, lse3, d ** -0.5, mask_args=args, sm_count=3)
    cp.cuda.get_current_stream().synchronize()
    _forward_check(q, k, v, dtype, o3, lse3, where + " grid=3", causal=causal, window=window, softcap=softcap)
