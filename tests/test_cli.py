"""The `rtk` command, driven through rtkernels.cli.main (CPU only)."""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rtkernels import cli

from sample_templates import SPILLY



def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- argument parsing --------------------------------------------------------------------
def test_param_values():
    assert cli.parse_params(["a=3", "b=2.5", "c=true", "d=False", "e=bfloat16", "f=1e-3"]) == \
        {"a": 3, "b": 2.5, "c": True, "d": False, "e": "bfloat16", "f": 1e-3}
    with pytest.raises(cli.UsageError):
        cli.parse_params(["novalue"])


def test_sweep_specs():
    name, values = cli.parse_sweep("head_dim=8:256:8")
    assert name == "head_dim" and values[0] == 8 and values[-1] == 256 and len(values) == 32
    assert cli.parse_sweep("n=1:3") == ("n", [1, 2, 3])
    assert cli.parse_sweep("dtype=float16,bfloat16") == ("dtype", ["float16", "bfloat16"])
    assert cli.parse_sweep("block=64") == ("block", [64])
    for bad in ("x=1:b", "x=1:5:0", "x=", "x"):
        with pytest.raises(cli.UsageError):
            cli.parse_sweep(bad)


def test_usage_errors_exit_64(capsys):
    assert run(capsys, "inspect", "vector_add", "--param", "oops")[0] == cli.EXIT_USAGE
    assert run(capsys, "inspect", "vector_add", "--diff")[0] == cli.EXIT_USAGE
    code, _, err = run(capsys, "inspect", "vector_add", "--param", "block_size=100", "--arch", "sm_90")
    assert code == cli.EXIT_ERROR and "block_size" in err


# ---- inspect -----------------------------------------------------------------------------
def test_inspect_writes_files_and_summary(capsys, tmp_path):
    out = tmp_path / "dump"
    code, text, _ = run(capsys, "inspect", "vector_add", "--param", "dtype=float16", "--arch", "sm_90",
                        "--out", str(out))
    assert code == 0
    for ext in (".cu", ".ptx", ".cubin", ".sass", ".report.json"):
        assert (out / f"vector_add{ext}").stat().st_size > 0, ext
    assert "registers" in text and "occupancy" in text and "limited by threads" in text
    assert "__global__" in (out / "vector_add.cu").read_text()
    assert ".entry vector_add" in (out / "vector_add.ptx").read_text()
    assert (out / "vector_add.cubin").read_bytes()[:4] == b"\x7fELF"
    rep = json.loads((out / "vector_add.report.json").read_text())
    assert rep["threads_per_block"] == 256 and rep["arch"] == "sm_90"


def test_inspect_json(capsys):
    code, text, _ = run(capsys, "inspect", "vector_add", "-p", "dtype=float32", "--arch", "sm_80", "--json")
    rep = json.loads(text)
    assert code == 0 and rep["arch"] == "sm_80" and rep["sass"]["ldg_32"] >= 2
    assert rep["occupancy"]["limiter"] in ("threads", "registers", "shared_memory", "blocks", "barriers")


def test_inspect_diff(capsys, tmp_path):
    code, text, _ = run(capsys, "inspect", "vector_add", "--param", "dtype=float16", "--arch", "sm_90",
                        "--diff", "--param", "block_size=1024", "--param", "dtype=float32")
    assert code == 0
    assert "block_size: 256 -> 1024" in text and "| blocks_per_sm | 8 | 2 | -6 |" in text
    code, text, _ = run(capsys, "inspect", "vector_add", "--arch", "sm_90", "--diff", "-p", "block_size=128",
                        "--json")
    d = json.loads(text)
    assert d["diff"]["params"] == {"block_size": [256, 128]}


def test_inspect_user_template(capsys, tmp_path):
    path = tmp_path / "spilly.cu.j2"
    path.write_text(SPILLY)
    code, text, _ = run(capsys, "inspect", str(path), "--kernel", "spilly", "-p", "num_acc=8", "--threads", "256",
                        "--arch", "sm_90")
    assert code == 0 and "threads/block 256" in text and "flags          none" in text


# ---- report / prebuild -------------------------------------------------------------------
def test_report_csv_json_markdown(capsys):
    args = ["report", "vector_add", "--sweep", "dtype=float16,float32", "--sweep", "block_size=128,256",
            "--arch", "sm_90", "--jobs", "1"]
    code, text, err = run(capsys, *args, "--csv")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert code == 0 and len(rows) == 4
    assert [(r["dtype"], r["block_size"]) for r in rows] == [("float16", "128"), ("float16", "256"),
                                                             ("float32", "128"), ("float32", "256")]
    assert "4 configs: 4 compiled" in err
    code, text, _ = run(capsys, *args, "--json")
    assert len(json.loads(text)) == 4
    code, text, _ = run(capsys, *args)
    lines = text.splitlines()
    assert lines[0].startswith("| mark |") and "dtype" in lines[0] and set(lines[1]) <= set("|-")
    assert len(lines) == 6


def test_report_fail_on_spill(capsys, tmp_path):
    path = tmp_path / "spilly.cu.j2"
    path.write_text(SPILLY)
    # 300 live accumulators cannot fit in 255 registers: that config spills.
    args = ["report", str(path), "--kernel", "spilly", "--sweep", "num_acc=8,300", "--threads", "128",
            "--arch", "sm_90", "--jobs", "1"]
    code, text, _ = run(capsys, *args)
    assert code == 0 and "SPILL" in text
    code, _, _ = run(capsys, *args, "--fail-on-spill")
    assert code == cli.EXIT_SPILL


def test_prebuild_warms_the_cache(capsys, fresh_cache):
    from rtkernels import cache
    code, text, _ = run(capsys, "prebuild", "vector_add", "--sweep", "block_size=64,128", "--arch", "sm_80,sm_90",
                        "--jobs", "2")
    assert code == 0 and "4 configs: 4 compiled" in text
    entries = cache.list_entries()
    assert len(entries) == 4 and {e["arch"] for e in entries} == {"sm_80", "sm_90"}


def test_report_to_file(capsys, tmp_path):
    out = tmp_path / "r.md"
    code, text, _ = run(capsys, "report", "vector_add", "-s", "block_size=64:128:64", "--arch", "sm_90",
                        "-j", "1", "--out", str(out))
    assert code == 0 and text == "" and out.read_text().startswith("| mark")


# ---- op names report the family the op runs --------------------------------------------------
def test_dispatch_by_op_and_arch():
    assert cli.dispatch("attention", {"head_dim": 64, "dtype": "bfloat16"}, "sm_90")[0] == "attention_sm90"
    assert cli.dispatch("attention", {"head_dim": 64}, "sm_80") == ("attention", None)
    family, note = cli.dispatch("attention", {"head_dim": 64, "block_m": 64}, "sm_90")
    assert family == "attention" and "block_m" in note          # a tile of the mma.sync kernel, as named
    assert cli.dispatch("attention_backward", {"head_dim": 128}, "sm_90")[0] == "attention_bwd_sm90"
    assert cli.dispatch("attention_backward", {"head_dim": 256}, "sm_90")[0] == "attention_bwd_sm90_big"
    assert cli.dispatch("matmul", {"dtype": "bfloat16"}, "sm_90")[0] == "matmul_sm90"
    assert cli.dispatch("matmul", {"dtype": "float32"}, "sm_90")[0] == "matmul"
    assert cli.dispatch("vector_add", {}, "sm_90") == ("vector_add", None)


def test_report_op_name_runs_the_dispatched_family(capsys):
    args = ["report", "attention", "--sweep", "head_dim=64", "--param", "dtype=bfloat16", "--arch", "sm_90",
            "--jobs", "1", "--json"]
    code, text, err = run(capsys, *args)
    assert code == 0 and [r["family"] for r in json.loads(text)] == ["attention_sm90"]
    assert "reporting attention_sm90" in err
    code, text, err = run(capsys, *args, "--family", "attention")
    assert code == 0 and [r["family"] for r in json.loads(text)] == ["attention"] and "note" not in err
    code, _, err = run(capsys, "report", "attention", "--family", "matmul", "--arch", "sm_90")
    assert code == cli.EXIT_USAGE and "two families" in err


# ---- waves -------------------------------------------------------------------------------
def test_waves_course_puzzle(capsys):
    code, text, _ = run(capsys, "waves", "matmul", "--shape", "1792,1792,1792", "--shape", "1793x1793x1793",
                        "--param", "block_m=256", "--param", "block_n=128", "--sms", "108", "--json")
    rows = json.loads(text)["rows"]
    assert code == 0
    assert [(r["tiles"], r["waves"]) for r in rows] == [(98, 1), (120, 2)]
    assert rows[1]["tail_tiles"] == 12 and round(rows[1]["tail_efficiency"], 2) == 0.11
    code, text, _ = run(capsys, "waves", "matmul", "--shape", "1793,1793,1793", "-p", "block_m=256",
                        "-p", "block_n=128", "--sms", "108")
    assert "120 tiles on 108 SMs" in text and "2 wave(s)" in text and "11%" in text


def test_waves_default_sm_count_without_gpu(capsys, monkeypatch):
    from rtkernels import device
    monkeypatch.setattr(device, "has_gpu", lambda: False)
    code, text, _ = run(capsys, "waves", "attention", "--shape", "2,16,4096", "-p", "block_m=128")
    assert code == 0 and "1024 tiles on 132 SMs" in text and "note: no GPU" in text


def test_waves_needs_tile_sizes(capsys):
    code, _, err = run(capsys, "waves", "matmul", "--shape", "64,64", "--param", "block_m=64", "--sms", "10",
                       "--param", "not_a_field=1")
    assert code == cli.EXIT_USAGE and "block_n" in err


# ---- cache -------------------------------------------------------------------------------
def test_cache_commands(capsys, fresh_cache):
    import rtkernels as rtk
    rtk.compile("vector_add", dtype="float32", arch="sm_90")
    code, text, _ = run(capsys, "cache", "info", "--json")
    assert code == 0 and json.loads(text)["entries"] == 1
    code, text, _ = run(capsys, "cache", "list")
    assert "vector_add" in text and text.startswith("| family")
    code, text, _ = run(capsys, "cache", "clear")
    assert "removed 1 cache entry" in text
    assert json.loads(run(capsys, "cache", "info", "--json")[1])["entries"] == 0


# ---- the tools/ entry point --------------------------------------------------------------
def test_tools_script_runs():
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, str(root / "tools" / "rtk_inspect.py"), "waves", "matmul",
                          "--shape", "1792,1792,1792", "-p", "block_m=256", "-p", "block_n=128", "--sms", "108"],
                         capture_output=True, text=True, cwd=root)
    assert res.returncode == 0, res.stderr
    assert "98 tiles" in res.stdout and "1 wave(s)" in res.stdout
