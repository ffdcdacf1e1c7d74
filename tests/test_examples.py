"""examples/: every script imports without a GPU (and defines main), and the template example
renders and compiles its candidates on the CPU.  Their GPU runs are recorded in docs/."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(p for p in EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_example_imports_without_a_gpu(path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert callable(getattr(mod, "main", None)) and mod.__doc__


def test_template_example_compiles_its_candidates_on_the_cpu():
    res = subprocess.run([sys.executable, str(EXAMPLES / "custom_template_autotune.py"), "--cpu"],
                         capture_output=True, text=True, cwd=EXAMPLES.parent,
                         env={**__import__("os").environ, "PYTHONPATH": str(EXAMPLES.parent)})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 9 and all("0 B spilled" in ln for ln in lines), res.stdout
    assert "128-bit" in lines[-1]   # vec=8 of float16: one 16-byte load per thread and array
