"""attention_sm90 flat_walk=True: the persistent walk's consumers as one loop over (tile, key tile) steps.

CPU: validation messages and shared memory (the O staging tile), a model of the flattened loop's
barrier protocol (the Q, K and V threads and every consumer warp as generators in random order:
no deadlock, no stale or overwritten K/V/Q, every warp's GEMM order), and builds of the 128x128
configs at d64 / d128, causal and not: no spills or local memory, no ptxas wgmma notes (every
wgmma of the kernel kept asynchronous: the C75xx notes are what serialized the carry_qk attempt),
the compiled GEMM / wait order of the flat loop, the epilogue's TMA store between the two GEMMs
of an iteration.
GPU (``-m gpu``, sm_90): the float64 reference and 2x error rule with poisoned outputs over awkward
shapes (S not a multiple of the tile, S = 1, batch 1, GQA, rows that see no key, fp16 / bf16), on
the device's grid and on 1- and 3-CTA grids where every CTA walks many tiles; the flat kernel's
output against the per-tile persistent kernel's.  Cheap first: a wrong phase hangs, so one tiny
shape runs first (run under ``timeout``).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError
from rtkernels.ops import attention_sm90 as A90
from rtkernels.ops.attention_sm90 import AttentionSm90Config

from test_attention_sm90 import _Bar
from test_attention_sm90_persistent import (PTXAS_NOTES, TINY, _need_sm90, case_id, run_and_check,
                                              _random_walk, _regs)

FLAT_128 = dict(block_m=128, block_n=128, num_stages=2, intra_overlap=True, pingpong=False, persistent=True,
                flat_walk=True)


# ---- config -------------------------------------------------------------------------------
def test_flat_walk_validation_messages():
    for kw, words in ((dict(persistent=False), ("flat_walk", "persistent=True")),
                      (dict(intra_overlap=False), ("flat_walk", "intra_overlap")),
                      (dict(has_window=True), ("flat_walk", "window"))):
        with pytest.raises(ConfigError) as e:
            AttentionSm90Config(dtype="bfloat16", head_dim=64, **{**FLAT_128, **kw})
        assert all(w in str(e.value) for w in words), str(e.value)
    # d192: one Q tile fills what the K/V ring leaves - no second Q buffer, no O tile
    with pytest.raises(ConfigError) as e:
        AttentionSm90Config(dtype="bfloat16", head_dim=192, **{**FLAT_128, "block_n": 112})
    assert "flat_walk" in str(e.value) and "shared memory" in str(e.value), str(e.value)


def test_flat_walk_shared_memory_holds_an_o_tile():
    pers = AttentionSm90Config(dtype="bfloat16", head_dim=128, causal=True, **{**FLAT_128, "flat_walk": False})
    flat = pers.replace(flat_walk=True)
    q = 128 * 2 * 128
    assert flat.q_buffers == pers.q_buffers == 2
    assert flat.shared_mem_bytes == pers.shared_mem_bytes + q <= A90.SMEM_LIMIT_SM90
    assert flat.template_params()["flat_walk"] is True and flat.register_split == pers.register_split
    # the by-name path keeps the heuristic's tile for flat_walk=True as for persistent=True
    cfg = AttentionSm90Config.from_params(dict(dtype="bfloat16", head_dim=64, causal=True, persistent=True,
                                               flat_walk=True))
    assert cfg.flat_walk and cfg.persistent and not cfg.pingpong


# ---- model of the flattened loop's barrier protocol --------------------------------------------
def _simulate_flat(tiles, stages, consumers, rng, regs=None, skip_own=False):
    """One persistent flat_walk CTA as the template runs it.  ``tiles``: per tile of the walk (key
    tiles of the CTA's range, [key tiles of each warpgroup's rows]); the producer streams
    max(ring, 1) per tile and every warpgroup runs that many steps (the mask hides keys past its
    own rows: ``skip_own`` models the alternative - each warpgroup stops at its own range and
    releases the CTA's other tiles unread, K when its S side leaves the tile, V once its last P V
    has retired - which deadlocks).  Per warp: S_0; then per step u + 1: retire P_{u-1} V_{u-1}
    (release its V), S_{u+1} (its tile's Q first, at j = 0), the epilogue of the tile whose last
    P V just retired (the O staging rows reused once the warpgroup's previous store has read them),
    P_u V_u, S_{u+1} retired (release its K; leaving a tile: q_free); the drain.  Checks: no
    deadlock, no stale or overwritten K/V/Q, every warp reads its tiles in the template's order."""
    pool = [0]
    full_k, full_v = [_Bar(1) for _ in range(stages)], [_Bar(1) for _ in range(stages)]
    empty_k, empty_v = [_Bar(4 * consumers) for _ in range(stages)], [_Bar(4 * consumers) for _ in range(stages)]
    bar_q, q_free = [_Bar(1) for _ in range(2)], [_Bar(4 * consumers) for _ in range(2)]
    slot_k, slot_v, slot_q = [None] * stages, [None] * stages, [None] * 2
    landing, reading = [], []
    store_done = {}                              # (warpgroup, tile) -> its store has read the O rows
    named = {}                                   # (warpgroup, tile, which) -> warps arrived
    rings = [max(r, 1) for r, _ in tiles]
    bases = np.concatenate([[0], np.cumsum(rings)]).astype(int)

    def wait(bar, phase):
        while not bar.try_wait(phase & 1, phase):
            yield

    def producer_warp():
        if regs is not None and consumers > 1:
            pool[0] += 32 * (regs[0] - regs[1])
        yield

    def q_thread():
        for k in range(len(tiles)):
            buf = k % 2
            if k >= 2:
                yield from wait(q_free[buf], k // 2 - 1)
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
        if regs is not None and consumers > 1:
            need = 32 * (regs[2] - regs[0])
            while pool[0] < need:
                yield
            pool[0] -= need
        mine = [max(own[cw], 1) if skip_own else rings[k] for k, (_, own) in enumerate(tiles)]
        steps = [(k, j, bases[k] + j) for k in range(len(tiles)) for j in range(mine[k])]
        last_of = {k: mine[k] - 1 for k in range(len(tiles))}

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

        def skip(g, is_v):
            yield from wait((full_v if is_v else full_k)[g % stages], g // stages)
            release(g, is_v, read=False)

        def issue_s(k, j, g):
            if j == 0:
                yield from wait(bar_q[k % 2], k // 2)
            assert slot_q[k % 2] == k, "S reads a Q buffer another tile owns"
            yield from use(g, False)

        def retire_s(k, j, g):   # wait_group: S done -> K released; leaving the tile: Q, unread K tiles
            yield
            assert slot_q[k % 2] == k, "Q buffer reloaded under an S GEMM"
            release(g, False)
            if j == last_of[k]:
                q_free[k % 2].arrive()
                for n in range(bases[k] + j + 1, bases[k + 1]):
                    yield from skip(n, False)

        def barrier(k, which):   # a named barrier of the warpgroup's 4 warps
            key = (cw, k, which)
            named[key] = named.get(key, 0) + 1
            while named[key] < 4:
                yield

        def finish(k):
            for n in range(bases[k] + last_of[k] + 1, bases[k + 1]):
                yield from skip(n, True)
            if lead and k > 0:
                while not store_done[(cw, k - 1)]:
                    yield
            yield from barrier(k, 0)
            yield
            yield from barrier(k, 1)
            if lead:
                store_done[(cw, k)] = False
                reading.append((cw, k))

        k, j, g = steps[0]
        yield from issue_s(k, j, g)
        yield from retire_s(k, j, g)
        closed = [j == last_of[k]]          # per step so far: it closed its tile
        pv_prev = None
        for u in range(1, len(steps)):
            pk, pj, pg = steps[u - 1]
            if pv_prev is not None:
                release(pv_prev, True)
            k, j, g = steps[u]
            yield from issue_s(k, j, g)
            if u >= 2 and closed[u - 2]:
                yield from finish(steps[u - 2][0])
            yield from use(pg, True)
            yield from retire_s(k, j, g)
            closed.append(j == last_of[k])
            pv_prev = pg
        if pv_prev is not None:
            release(pv_prev, True)
        n = len(steps)
        if n >= 2 and closed[n - 2]:
            yield from finish(steps[n - 2][0])
        yield from use(steps[-1][2], True)
        yield
        release(steps[-1][2], True)
        yield from finish(steps[-1][0])

    actors = [q_thread(), ring_thread(False), ring_thread(True)] + [warp(w) for w in range(4 * consumers)]
    actors += [producer_warp() for _ in range(4)]
    count = 0
    while actors or reading:
        count += 1
        assert count < 400000, "deadlock: " + "; ".join(_where(a) for a in actors)
        if landing and rng.random() < 0.3:
            slots, st, tag, bar = landing.pop(int(rng.integers(len(landing))))
            slots[st] = tag
            bar.arrive()
        if reading and rng.random() < 0.3:
            store_done[reading.pop(int(rng.integers(len(reading))))] = True
        if actors:
            i = int(rng.integers(len(actors)))
            try:
                next(actors[i])
            except StopIteration:
                actors.pop(i)
    return seen, bases


def _where(gen) -> str:
    """Where a generator of the model waits: its chain of `yield from` calls, innermost last."""
    out = []
    while gen is not None and gen.gi_frame is not None:
        f = gen.gi_frame
        out.append(f"{gen.gi_code.co_name}:{f.f_lineno}" + "".join(
            f" {n}={f.f_locals[n]}" for n in ("w", "g", "k", "u", "phase") if n in f.f_locals))
        gen = gen.gi_yieldfrom
    return " > ".join(out)


@pytest.mark.parametrize("stages,consumers", [(2, 2), (3, 2), (2, 3), (2, 1)])
def test_model_flat_walk_has_no_deadlock_or_stale_tile(stages, consumers):
    """Tiles of every kind in a row (empty ranges, warpgroups stopping early, one-step tiles: the
    Q buffers turn over every step), the consumers first taking their registers from the producer's."""
    rng = np.random.default_rng(1000 + 10 * stages + consumers)
    for _ in range(8):
        tiles = _random_walk(rng, consumers)
        seen, bases = _simulate_flat(tiles, stages, consumers, rng, _regs(consumers))
        for w, order in enumerate(seen):
            steps = [bases[k] + j for k, (ring, _) in enumerate(tiles) for j in range(max(ring, 1))]
            want = [("S", steps[0])] + [x for u in range(1, len(steps)) for x in
                                        (("S", steps[u]), ("PV", steps[u - 1]))] + [("PV", steps[-1])]
            assert order == want, (w, tiles)


def test_model_flat_walk_stopping_at_own_rows_deadlocks():
    """Why every warpgroup visits the CTA's key tiles: the first design stopped each warpgroup at its
    own rows' range (as the per-tile walk does) and released the CTA's other tiles unread; a
    warpgroup whose rows see none of a long tile then waits for K tiles the other warpgroup
    releases only after a V slot this one still holds under its in-flight P V (2-stage ring)."""
    tiles = [(0, [0, 0]), (0, [0, 0]), (5, [0, 5]), (4, [0, 4]), (2, [0, 2]), (1, [1, 1]), (3, [3, 3])]
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate_flat(tiles, 2, 2, np.random.default_rng(5), _regs(2), skip_own=True)
    _simulate_flat(tiles, 2, 2, np.random.default_rng(5), _regs(2))


def test_model_flat_walk_causal_short_walk():
    """FlashAttention's causal S=512 at 128x128 (4 query tiles, heaviest first: 4, 3, 2, 1 key tiles,
    the first 64 rows one fewer) and S=1 rows (empty ranges), many tiles per CTA."""
    rng = np.random.default_rng(3)
    tiles = [(4, [3, 4]), (3, [2, 3]), (2, [1, 2]), (1, [0, 1])] * 3 + [(0, [0, 0]), (1, [1, 0])]
    for _ in range(4):
        _simulate_flat(tiles, 2, 2, rng, _regs(2))


# ---- builds: 4 compiles, shared ---------------------------------------------------------------
def _flat_config(dtype, d, causal):
    return AttentionSm90Config(dtype=dtype, head_dim=d, causal=causal, **FLAT_128)


@pytest.fixture(scope="module")
def built_flat():
    from concurrent.futures import ThreadPoolExecutor
    cases = [(64, False), (64, True), (128, False), (128, True)]
    cfgs = [_flat_config("bfloat16", d, c) for d, c in cases]
    with ThreadPoolExecutor(2) as ex:   # NVRTC releases the GIL
        kerns = list(ex.map(lambda c: rtk.get_kernel(c, arch="sm_90a"), cfgs))
    return {case: (c, k) for case, c, k in zip(cases, cfgs, kerns)}


def _events(sass: str) -> str:
    """The kernel's GEMM / wait / store order: A = wgmma fence (WARPGROUP.ARRIVE), G = an HGMMA
    closing a group, W<n> = wait until at most n groups are pending, T = a TMA store, e<k> = k
    MUFU.EX2 in a row."""
    ev = []
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR" in line:
            ev.append("W" + re.search(r"gsb0, 0x(\d+)", line).group(1))
        elif "WARPGROUP.ARRIVE" in line:
            ev.append("A")
        elif "MUFU.EX2" in line:
            ev.append("e")
        elif "HGMMA" in line and "gsb0" in line:
            ev.append("G")
        elif "UTMASTG" in line:
            ev.append("T")
    return re.sub(r"T+", "T", re.sub(r"e+", lambda m: f"e{len(m.group())}", "".join(ev)))


@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_flat_builds_asynchronous_without_spills(built_flat, d, causal):
    """No spills or local memory; HGMMA + TMA; no ptxas wgmma note (serialized or an injected wait);
    compiled order: S_0 / wait / softmax, then the loop - wait for P V, S issued, the predicated
    epilogue's store, P V issued, wait for S only, the softmax - then the drain's P V, its store."""
    cfg, k = built_flat[(d, causal)]
    r = k.resources
    assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (cfg, r)
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", k.sass, re.M)
    names = {o.split(".")[0] for o in ops}
    assert {"UTMALDG", "UTMASTG", "SYNCS", "USETMAXREG"} <= names, names
    assert f"HGMMA.64x{cfg.block_n}x16.F32" in k.sass and f"HGMMA.64x{d}x16.F32" in k.sass
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "no local memory"
    assert not any(c in k.module.log for c in PTXAS_NOTES + ("C7518", "C7519")), k.module.log
    ev = _events(k.sass)
    exps = cfg.block_n // 2 + 2
    assert re.fullmatch(rf"AGW0e{exps}W0AGTAGW1e{exps}W0TAGW0T", ev), ev


# ---- GPU ------------------------------------------------------------------------------------
# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype): cheap first
CASES = [
    TINY,
    (1, 1, 1, 1, 1, 128, False, "float16"),
    (3, 7, 7, 5, 5, 64, True, "bfloat16"),
    (3, 129, 129, 5, 1, 64, False, "float16"),
    (2, 512, 512, 4, 2, 64, True, "bfloat16"),     # one-step tiles every fourth tile: Q turns over fast
    (3, 513, 513, 5, 5, 128, True, "float16"),
    (3, 1000, 1000, 5, 1, 128, True, "bfloat16"),
    (3, 1000, 513, 5, 5, 128, False, "float16"),
    (3, 1000, 1, 5, 1, 128, True, "bfloat16"),     # causal, seqlen_q > seqlen_k: rows that see no key
    (3, 300, 77, 3, 1, 64, True, "float16"),       # ... and tiles whose every row sees none
    (3, 1, 1000, 5, 5, 64, True, "float16"),
    (1, 129, 2049, 5, 1, 128, True, "bfloat16"),
    (2, 1024, 1024, 16, 16, 64, False, "bfloat16"),
    (2, 2049, 2049, 3, 1, 64, False, "bfloat16"),
]
_KERNELS: dict = {}


def _kernel(cfg):
    if cfg not in _KERNELS:
        _KERNELS[cfg] = rtk.get_kernel(cfg, arch="sm_90a")
    return _KERNELS[cfg]


def _check_case(case, sm_count, seed=None):
    d, causal, dtype = case[5:]
    cfg = _flat_config(dtype, d, causal)
    return cfg, run_and_check(cfg, _kernel(cfg), case, sm_count, seed)


@pytest.mark.gpu
def test_gpu_flat_tiny_first():
    _need_sm90()
    _check_case(TINY, None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_flat_device_grid(case):
    _need_sm90()
    _check_case(case, None)


@pytest.mark.gpu
@pytest.mark.parametrize("sm_count", [1, 3])
@pytest.mark.parametrize("case", CASES[2:], ids=case_id)
def test_gpu_flat_small_grid_walks_many_tiles(case, sm_count):
    """1 or 3 CTAs for up to ~200 tiles: every barrier (Q buffers, K/V ring, the O staging rows)
    goes through many phases per CTA."""
    _need_sm90()
    _check_case(case, sm_count)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(2, 1000, 1000, 5, 1, 128, True, "bfloat16"), (2, 777, 901, 4, 2, 64, False,
                                                                                  "float16")], ids=case_id)
def test_gpu_flat_matches_the_per_tile_walk(case):
    """The same sums in the same order per tile: the flat loop's O and lse equal the per-tile
    persistent kernel's bit for bit."""
    _need_sm90()
    import cupy as cp
    from gpu_util import poison
    cfg, (q, k, v, o, lse) = _check_case(case, None)
    ref_cfg = cfg.replace(flat_walk=False)
    o2, lse2 = poison(cp.empty_like(o)), poison(cp.empty_like(lse))
    A90.launch(_kernel(ref_cfg), ref_cfg, q, k, v, o2, lse2, case[5] ** -0.5)
    cp.cuda.get_current_stream().synchronize()
    differ = int((o2.view(cp.uint16) != o.view(cp.uint16)).sum())
    assert differ == 0, f"{case}: {differ} of {o.size} outputs differ from the per-tile walk's"
    assert cp.array_equal(lse2, lse), f"{case}: lse differs from the per-tile walk's"
