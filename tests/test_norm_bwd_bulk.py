"""The norm backward's bulk_rows stage protocol (templates/norm_bwd.cu.j2, BwdBulk), modelled on the CPU.

Each row team (a lane group, a block, a cluster row's block) keeps kBulk rows in flight through
shared-memory stages: start() arms stages 0..kBulk-1 with the team's first rows, the loop waits on
its current stage (parity flipping per wrap), reads it, and after the row's reduction release()
arms the same stage with the row kBulk further on.  The loop bound is the block's (uniform for all
its teams), so a lane group may iterate past its own last row.  The model runs every team of a
grid with the copies landing in random order and checks what synccheck and racecheck would: a wait
finds its own row in the stage (no parity aliasing, no overwrite before the read), every phase that
completed was waited on and no copy is in flight at exit, and the leader arrives once per phase and
waits on that phase before it arrives on the barrier again.  Two earlier versions fail it, each
reported by synccheck as "Missing wait" on the H200 (2026-11-26): a bare arrival for a row past the
end (docs/data/sanitize_norm_bwd_ln_bulk_trial_synccheck_findings_session10_*.jsonl), and the saved
statistics by cp.async onto the stage's mbarrier - cp.async.mbarrier.arrive is a second arrive of
the leader on the phase of its arrive.expect_tx (only the kernels with saved statistics were
reported, at those arrives; the recompute kernels with the same stages were clean).
No GPU, no compiles.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "norm_bwd.cu.j2"


class _Bar:
    """An mbarrier of arrival count 1: a phase completes once its pending arrival count and its
    transaction bytes are both zero.  ``completed`` counts phases exactly, so a wait that fell a
    phase behind (parity aliasing) is caught.  The per-thread rule synccheck applies (inferred from
    its reports): a thread arrives at most once on a phase and waits on it before arriving on the
    barrier again ("missing wait" otherwise)."""

    def __init__(self):
        self.completed = 0
        self.pending = 1       # arrivals still due in the current phase
        self.tx = 0            # bytes still due in the current phase
        self.unwaited = {}     # thread -> the phase it arrived on and has not waited on yet

    def _note_arrival(self, thread):
        if thread in self.unwaited:
            raise AssertionError(f"thread {thread} arrives again before waiting on phase "
                                 f"{self.unwaited[thread]} (missing wait)")
        self.unwaited[thread] = self.completed

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = 1

    def arrive_expect_tx(self, thread, nbytes: int):
        self._note_arrival(thread)
        self.tx += nbytes
        self.pending -= 1
        self._maybe_complete()

    def arrive_bare(self, thread):
        self.arrive_expect_tx(thread, 0)

    def cp_async_arrive(self, thread):
        """cp.async.mbarrier.arrive (no .noinc): one more pending arrival now (SASS SYNCS.ARRIVE
        .TRANS64.RED.A0T1, an arrive of this thread), made when its cp.async land (async_arrive)."""
        self._note_arrival(thread)
        self.pending += 1

    def async_arrive(self):
        self.pending -= 1
        self._maybe_complete()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        assert self.tx >= 0
        self._maybe_complete()

    def try_wait(self, thread, parity: int, expect_phase: int) -> bool:
        ok = self.completed % 2 != parity
        if ok:
            assert self.completed == expect_phase + 1, "parity aliasing: a wait passed on a later phase"
            if self.unwaited.get(thread) == expect_phase:
                del self.unwaited[thread]
        return ok


def _simulate(rows: int, workers: int, teams: int, stages: int, rng, version: str = "current"):
    """Every team of `workers` blocks of `teams` row teams (team t of block b: rows b * teams + t +
    k * workers * teams, as RowTeam's first_row / row_step / local_row).  version: "current", or
    an earlier one - "bare_arrival" (a bare arrival for a row past the end, waited on only while
    the loop ran), "stats_cp_async" (the statistics by cp.async onto the stage's mbarrier).
    Returns the rows each team read, in order."""
    step = workers * teams
    landing = []                  # (team state, stage, row, what) of copies in flight
    done_rows = {}
    row_bytes = 2 * 16            # dy and x of the team's part of a row (any nonzero size)

    def team(b, t):
        leader = (b, t)
        bars = [_Bar() for _ in range(stages)]
        slot = [None] * stages     # the row a stage holds (None while its copy is in flight)
        waited = [0] * stages
        st = dict(bars=bars, slot=slot)
        first_row = b * teams
        first = first_row + t

        def issue(s, row):
            if row >= rows:
                if version == "bare_arrival":
                    bars[s].arrive_bare(leader)   # the phase completes at once
                return
            slot[s] = None
            if version == "stats_cp_async":
                bars[s].cp_async_arrive(leader)
                landing.append((st, s, row, "stats"))
            bars[s].arrive_expect_tx(leader, row_bytes)
            landing.append((st, s, row, "rows"))

        for s in range(stages):         # start()
            issue(s, first + s * step)
        stage, parity, read = 0, 0, []
        base = first_row
        while base < rows:              # the block's loop: uniform over its teams
            row = base + t
            row_ok = row < rows
            if row_ok or version == "bare_arrival":   # acquire(): the first version waited past the end too
                while not bars[stage].try_wait(leader, parity, waited[stage]):
                    yield
                waited[stage] += 1
                if row_ok:
                    assert slot[stage] == row, f"stage {stage} holds row {slot[stage]}, the team waits for {row}"
                    read.append(row)
            yield                       # the reduction: every lane has its slots in registers
            issue(stage, row + stages * step)   # release()
            stage += 1
            if stage == stages:
                stage, parity = 0, parity ^ 1
            base += step
        done_rows[(b, t)] = read
        # the block exits: nothing of this team in flight, every completed phase waited on
        assert not any(c[0] is st for c in landing), f"team {(b, t)} exits with a copy in flight"
        for s in range(stages):
            assert bars[s].completed == waited[s], \
                f"team {(b, t)} stage {s}: {bars[s].completed} phases completed, {waited[s]} waited (missing wait)"
            assert not bars[s].unwaited, f"team {(b, t)} stage {s}: an arrival never waited on (missing wait)"

    live = [team(b, t) for b in range(workers) for t in range(teams)]
    while live or landing:
        pick = int(rng.integers(len(live) + len(landing)))
        if pick < len(live):
            try:
                next(live[pick])
            except StopIteration:
                live.pop(pick)
        else:
            st, s, row, what = landing.pop(pick - len(live))
            if what == "rows":
                st["slot"][s] = row
                st["bars"][s].complete_tx(row_bytes)
            else:
                st["bars"][s].async_arrive()
    return done_rows


# (rows, workers, teams per block): one row; fewer rows than workers (and than a block's lane
# groups); a ragged last round; rows a multiple of the grid; many rows per team (several wraps)
SHAPES = [(1, 1, 1), (1, 4, 1), (1, 2, 8), (7, 1, 4), (7, 3, 1), (7, 9, 1), (33, 5, 4), (33, 2, 16),
          (64, 4, 4), (300, 264, 1), (4097, 3, 4), (4097, 33, 1)]


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("rows, workers, teams", SHAPES)
def test_bulk_stages_are_all_waited(rows, workers, teams, stages):
    rng = np.random.default_rng(rows * 131 + workers * 7 + teams + stages)
    read = _simulate(rows, workers, teams, stages, rng)
    step = workers * teams
    for (b, t), got in read.items():   # each team reads exactly its rows, in order
        assert got == list(range(b * teams + t, rows, step)), (rows, workers, teams, stages, b, t)
    assert sum(len(v) for v in read.values()) == rows


@pytest.mark.parametrize("version", ["bare_arrival", "stats_cp_async"])
@pytest.mark.parametrize("rows, workers, teams", [(300, 264, 1), (33, 2, 16), (7, 1, 4)])
def test_earlier_versions_fail_the_model(rows, workers, teams, version):
    """The model catches both faults synccheck reported as "Missing wait"."""
    with pytest.raises(AssertionError, match="missing wait"):
        _simulate(rows, workers, teams, 2, np.random.default_rng(0), version=version)


def _bulk_source() -> str:
    s = TEMPLATE.read_text()
    start = s.index("struct BwdBulk {")
    return s[start:s.index("\n};\n", start)]


def test_template_arms_and_waits_only_rows_in_range():
    """The template does what the model assumes: issue() returns before touching the barrier for a
    row past the end (no bare arrival anywhere), the leader's one arrive per armed stage is its
    arrive.expect_tx (no cp.async onto the barrier), acquire() returns before its wait for a row
    past the end."""
    src = _bulk_source()
    assert "mbar_arrive(" not in src, "a bare arrival completes a phase nobody waits on"
    assert "cp.async.mbarrier.arrive" not in src and "cp_async" not in src, \
        "cp.async onto the stage's mbarrier is a second arrive of the leader per phase"
    issue = src[src.index("void issue("):src.index("static __device__ __forceinline__ void copy(")]
    assert re.search(r"if \(row >= rows\) return;", issue), "issue() must arm nothing past the end"
    assert issue.index("row >= rows") < issue.index("mbar_arrive_expect_tx")
    # one arrive.expect_tx on each path (block / lane-group rows, cluster rows), nothing else arrives
    assert issue.count("mbar_arrive_expect_tx(") == 2 and "arrive" not in issue.replace("mbar_arrive_expect_tx", "")
    acquire = src[src.index("void acquire("):src.index("void release(")]
    assert acquire.index("if (!row_ok) return;") < acquire.index("mbar_wait"), "acquire() waits only for rows < rows"


def test_bulk_table_switches_one_class_and_op(monkeypatch):
    """_NORM_BWD_BULK's entry replaces the tables' loads and occupancy knobs for its class and op
    only, on sm_90 with 16-byte vectors (LayerNorm's block class since 2026-11-26, RMSNorm's and
    LayerNorm's 256-thread cluster rows since 2026-11-28)."""
    from rtkernels.ops import rowwise_bwd as rb
    assert rb._NORM_BWD_BULK["block"] == ((2, False, 0), (2, False, 0))   # RMSNorm's too since 2026-11-28
    monkeypatch.setitem(rb._NORM_BWD_BULK, "block", (None, None))
    direct = {k: rb.plan_bwd("norm_bwd", 4096, "bfloat16", 8, "sm_90", layer=k) for k in (False, True)}
    assert all(c.bulk_rows == 0 for c in direct.values())
    monkeypatch.setitem(rb._NORM_BWD_BULK, "block", (None, (2, False, 0)))
    ln = rb.plan_bwd("norm_bwd", 4096, "bfloat16", 8, "sm_90", layer=True)
    assert (ln.bulk_rows, ln.acc_smem, ln.min_blocks, ln.ring_rows) == (2, False, 1, 0)
    assert ln.replace(bulk_rows=0, acc_smem=True, min_blocks=4) == direct[True]   # only those knobs
    assert rb.plan_bwd("norm_bwd", 4096, "bfloat16", 8, "sm_90") == direct[False]
    assert rb.plan_bwd("norm_bwd", 4096, "bfloat16", 8, "sm_80", layer=True).bulk_rows == 0
    assert rb.plan_bwd("norm_bwd", 2048, "bfloat16", 4, "sm_90", layer=True).bulk_rows == 0   # 8-byte vectors
    assert rb.plan_bwd("norm_bwd", 16384, "bfloat16", 8, "sm_90").bulk_rows == 0              # cluster class
    assert rb.plan_bwd("norm_bwd", 16384, "bfloat16", 8, "sm_90", layer=True).bulk_rows == 2  # LayerNorm's (256)
    assert rb.plan_bwd("norm_bwd", 65536, "bfloat16", 8, "sm_90", layer=True).bulk_rows == 0  # 512-thread clusters
