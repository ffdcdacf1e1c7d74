"""torch stays optional: rtkernels never imports it, and rtkernels.torch names the extra to install."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return res.stdout + res.stderr


def test_rtkernels_does_not_import_torch():
    out = _run("import sys, rtkernels; print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    assert "NO-TORCH" in out, out


def test_rtkernels_torch_without_torch_names_the_extra():
    out = _run("import sys; sys.modules['torch'] = None\n"
               "try:\n    import rtkernels.torch\nexcept ImportError as e:\n    print('IMPORTERROR', e)\n")
    assert "IMPORTERROR" in out and "pip install rtkernels[torch]" in out, out
