"""tools/sanitize.py, the sanitizer gate, without a GPU: it imports, lists its cases, parses its
arguments and compute-sanitizer's logs, compares like its checks should, and every public op and
every registered kernel family has a case (or a documented exclusion) - so a new op cannot be
left out of the gate unnoticed."""
from __future__ import annotations

import importlib.util
import inspect
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels import ops


def _load():
    path = Path(__file__).resolve().parent.parent / "tools" / "sanitize.py"
    spec = importlib.util.spec_from_file_location("rtk_tools_sanitize", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # (dataclasses look their module up while building)
    spec.loader.exec_module(mod)
    return mod


S = _load()


def test_lists_its_cases_without_a_gpu(capsys):
    assert S.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert len(S.CASES) >= 15
    for name in S.CASES:
        assert f"| {name} " in out


def test_arguments():
    a = S.parse_args(["--tools", "memcheck,racecheck", "--only", "vector_add,matmul_sm90", "--out", "x"])
    assert (a.tools, a.only, a.out, a.worker) == (["memcheck", "racecheck"], ["vector_add", "matmul_sm90"], "x", False)
    d = S.parse_args([])
    assert d.tools == list(S.TOOLS) and d.only == [] and not d.full
    assert S.parse_args(["--tools", ""]).tools == []           # the plain run only
    with pytest.raises(SystemExit):
        S.parse_args(["--tools", "leakcheck"])
    # --only takes case names, or families (every case that launches the family)
    assert [c.name for c in S.select(["vector_add"])] == ["vector_add"]
    assert {c.name for c in S.select(["pad_rows"])} == {"pad_rows"}
    assert {"attention_fwd_sm90", "attention_bwd_sm90"} <= {c.name for c in S.select(["attention_sm90"])}
    with pytest.raises(SystemExit, match="neither a case nor a family"):
        S.select(["no_such_case"])


def test_every_public_op_has_a_case():
    public = [n for names in ops.PUBLIC.values() for n in names
              if callable(getattr(rtk, n)) and not inspect.isclass(getattr(rtk, n))]
    covered = {op for c in S.CASES.values() for op in c.ops}
    missing = sorted(set(public) - covered - set(S.EXCLUDED_OPS))
    assert not missing, f"public ops without a sanitizer case in tools/sanitize.py (add one, or an EXCLUDED_OPS " \
                        f"entry saying why it launches nothing): {missing}"
    assert not covered & set(S.EXCLUDED_OPS), "an op is both covered and excluded"
    assert set(S.EXCLUDED_OPS) <= set(public), "stale EXCLUDED_OPS entries"
    assert covered <= set(public) | {r for c in S.CASES.values() for r in c.requires}


def test_every_kernel_family_has_a_case():
    families = set(rtk.families())
    covered = {f for c in S.CASES.values() for f in c.families}
    assert covered <= families, f"cases name unknown families: {covered - families}"
    missing = sorted(families - covered - set(S.EXCLUDED_FAMILIES))
    assert not missing, f"kernel families without a sanitizer case in tools/sanitize.py: {missing}"
    # every entry point maps back to its family (how reports are attributed)
    names = S.kernel_families()
    assert names["attention_bwd_sm90"] == "attention_bwd_sm90" and names["layernorm_rows"] == "norm"


def test_cases_are_well_formed():
    for c in S.CASES.values():
        assert callable(c.fn) and c.families, c.name
        assert all(k.startswith("RTKERNELS_") for k, _ in c.env), c.name
        assert not S.missing_requirements(c), f"{c.name} requires what rtkernels lacks: run it or keep it out"
    later = S.Case("later", lambda ctx: None, ("attention",), (), requires=("attention_kvcache_not_yet",))
    assert S.missing_requirements(later) == ["attention_kvcache_not_yet"]


def test_compare():
    r = np.array([1.0, -2.0, np.inf, -np.inf, np.nan])
    assert S.compare(r.copy(), r, 1e-3, "max")[0]
    ok, err, msg = S.compare(np.array([1.0, np.nan, np.inf, -np.inf, np.nan]), r, 1e-3, "max")
    assert not ok and "NaN" in msg                                # poison left in place
    assert not S.compare(np.array([1.0, -2.0, 1.0, -np.inf, np.nan]), r, 1e-3, "max")[0]   # inf differs
    assert not S.compare(np.array([1.0, -2.0, np.inf, -np.inf]), r, 1e-3, "max")[0]        # shape
    ok, err, _ = S.compare(np.array([1.01, -2.0]), np.array([1.0, -2.0]), 1e-3, "max")
    assert not ok and math.isclose(err, 0.005)                    # 0.01 / max(1, 2)
    ok, err, _ = S.compare(np.array([3.0, 4.1]), np.array([3.0, 4.0]), 0.03, "norm")
    assert ok and math.isclose(err, 0.02)
    assert S.compare(np.array([1, 2]), np.array([1, 2]), 0, "exact")[0]
    assert not S.compare(np.array([1, 3]), np.array([1, 2]), 0, "max")[0]   # integers compare exactly


LOG = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at attention_bwd_sm90+0x6f00
=========     and Read access at attention_bwd_sm90+0x1600 [4096 hazards]
=========
========= Invalid __global__ read of size 4 bytes
=========     at matmul+0x70
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f0000000400 is out of bounds
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at cupy_copy__float32_float32+0x30
=========     by thread (1,0,0) in block (0,0,0)
=========
========= Barrier error detected. Divergent thread(s) in warp
=========     at somewhere_else+0x10
=========
========= Warning: Race reported between Read access at softmax_rows+0x10
=========     and Write access at softmax_rows+0x20 [2 hazards]
=========
========= Target application returned an error
========= RACECHECK SUMMARY: 2 hazards displayed (4099 errors, 2 warnings)
========= ERROR SUMMARY: 4099 errors
"""


def test_parse_log_attributes_reports_to_families():
    got = S.parse_log(LOG, S.kernel_families())
    assert got["by_family"] == {"attention_bwd_sm90": 4096, "matmul": 1, "cupy": 1, "unattributed": 1}
    assert (got["warnings"], got["summary"], got["reports"], got["unusable"]) == (1, 4099, 4, None)
    clean = S.parse_log("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n", {})
    assert clean["by_family"] == {} and clean["summary"] == 0
    bad = S.parse_log("========= COMPUTE-SANITIZER\n========= Error: Device not supported\n", {})
    assert bad["unusable"] and bad["summary"] is None


def test_table_is_aligned():
    t = S.table([["a", "1"], ["longer", "22"]], ["family", "memcheck"]).splitlines()
    assert len({len(line) for line in t}) == 1 and t[0].startswith("| family ")


INITCHECK_LOG = """\
========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 16 bytes
=========     at attention_bwd_dot+0x1d0
=========     by thread (3,0,0) in block (0,1,0)
=========     Address 0x7f0000001010
=========
========= Uninitialized __global__ memory read of size 16 bytes
=========     at attention_bwd_dot+0x1d0
=========     by thread (4,0,0) in block (0,1,0)
=========     Address 0x7f0000001020
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at 0x88 in softmax_rows
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f0000003004
=========
========= Host API memory access error at host access to 0x7f0000002000 of size 64 bytes
=========     Uninitialized access at 0x7f0000002010 on access by cudaMemcpy source
=========
========= ERROR SUMMARY: 4 errors
"""


def test_findings_group_reports_and_name_the_allocation():
    allocs = [[0x7f0000001000, 64, "attention_bwd_mma", "bf16 b1", "rtkernels/ops/attention.py:500 attention"],
              [0x7f0000002000, 128, "attention_bwd_mma", "bf16 b1", "rtkernels/ops/attention_bwd.py:476 x"],
              [0x7f0000003000, 4, "softmax", "f16 5x1", "tools/sanitize.py:10 _rows"]]
    fams = S.kernel_families()
    got = S.findings(INITCHECK_LOG, fams, allocs)
    assert [f["n"] for f in got] == [2, 1, 1]
    top = got[0]
    assert (top["kernel"], top["pc"], top["family"], top["bytes"], top["offsets"], top["outside"]) == \
        ("attention_bwd_dot", "0x1d0", "attention_backward", 64, [16, 32], False)
    assert top["site"].startswith("rtkernels/ops/attention.py:500")
    assert top["variants"] == ["attention_bwd_mma: bf16 b1"]
    assert "thread (3,0,0) block (0,1,0)" in top["example"]
    host = next(f for f in got if f["kernel"] is None)
    assert host["offsets"] == [16, 16] and "0x.." in host["what"]          # the copy's first uninitialized byte
    past = next(f for f in got if f["kernel"] == "softmax_rows")
    assert past["pc"] == "0x88" and past["outside"] and past["offsets"] == [4, 4]   # one byte past a 4-byte array
    line = S.finding_line("initcheck", top)
    assert "attention_bwd_dot+0x1d0" in line and "bytes 16..32 of 64" in line and "attention.py:500" in line
    # without an allocation log, and racecheck's hazards
    assert S.findings(INITCHECK_LOG, fams)[0]["example"].endswith("at 0x7f0000001010")
    race = S.findings(LOG, fams)
    assert race[0]["n"] == 4096 and race[0]["kernel"] == "attention_bwd_sm90" and race[0]["pc"] == "0x6f00"
    assert S.locate(0x10, allocs) is None


def test_logs_are_packed_into_one_tarball(tmp_path):
    import tarfile
    out = tmp_path / "san"
    (out / "refs").mkdir(parents=True)
    (out / "refs" / "x.npz").write_bytes(b"0" * 10)
    (out / "initcheck-default.0.log").write_text(INITCHECK_LOG)
    (out / "sanitize.json").write_text("{}")
    msg = S.pack_logs(out, tmp_path / "sanitize_logs.tgz")
    assert "sanitize_logs.tgz" in msg
    with tarfile.open(tmp_path / "sanitize_logs.tgz") as tar:
        assert sorted(tar.getnames()) == ["san/initcheck-default.0.log", "san/sanitize.json"]


def test_allocation_site_names_the_calling_lines():
    assert S._allocation_site() == "?"                 # frames outside rtkernels and the gate are skipped
    ns = dict(vars(S))
    exec(compile("\n\ndef gate_case():\n    return _allocation_site()\n", S.__file__, "exec"), ns)
    assert ns["gate_case"]() == "tools/sanitize.py:4 gate_case"


def _fake_sanitizer(tmp_path, body: str) -> str:
    """A stand-in compute-sanitizer: a Python script with ``body`` over its argv."""
    path = tmp_path / "compute-sanitizer"
    path.write_text(f"#!{sys.executable}\nimport sys\nargs = sys.argv[1:]\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_preflight_runs_a_cuda_target_and_says_why_it_failed(tmp_path):
    """compute-sanitizer fails a target that ends before its first CUDA call (exit 255), so the
    preflight's target allocates; a refused flag drops to the run without it, and a failure says
    the exit code and the tool's last line."""
    ok_with_cuda = _fake_sanitizer(tmp_path, (
        "if 'cupy' not in args[-1]:\n"
        "    print('========= Error: Target application terminated before first instrumented API call')\n"
        "    sys.exit(255)\n"
        "sys.exit(0)"))
    assert "cupy.zeros" in S.PREFLIGHT_TARGET
    assert S.preflight(ok_with_cuda, "memcheck", ["--show-backtrace", "no"]) == (["--show-backtrace", "no"], None)
    no_flags = _fake_sanitizer(tmp_path, "sys.exit(1 if '--show-backtrace' in args else 0)")
    flags, note = S.preflight(no_flags, "racecheck", ["--show-backtrace", "no"])
    assert flags == [] and "refused, run without" in note
    broken = _fake_sanitizer(tmp_path, "print('boom: no driver')\nsys.exit(7)")
    flags, note = S.preflight(broken, "synccheck", ["--show-backtrace", "no"])
    assert flags == ["--show-backtrace", "no"] and "exit code 7: boom: no driver" in note
