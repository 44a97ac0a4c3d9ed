"""The CLI starts fast: building it (what ``kvdiag --help`` and every argument check do) imports no model, table or
plotting library (issue #39: a refusal in under 1/4 of the torch + transformers import; ``kvdiag bench cli`` times it,
this test checks the import graph)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "safetensors", "polars", "numpy", "pyarrow", "scipy", "matplotlib", "pandas")


def test_cli_imports_no_heavy_library():
    """In a fresh interpreter, importing the console script and building every command (their options' defaults
    included) imports none of HEAVY; a stage loads them when its command runs."""
    code = ("import json, sys, typer\nfrom kvdiag.cli.main import app\ntyper.main.get_command(app)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = set(json.loads(proc.stdout))
    assert {"typer", "rich", "kvdiag"} <= loaded  # the check sees the interpreter's modules
    heavy = sorted(loaded & set(HEAVY))
    assert not heavy, f"kvdiag.cli.main imports {heavy} at start-up: import them inside the command that needs them"
