"""The CLI starts fast: building it (what ``kvdiag --help`` does) imports no model or plotting library."""

from __future__ import annotations

import subprocess
import sys


def test_cli_imports_no_heavy_library():
    heavy = "('torch', 'transformers', 'matplotlib', 'scipy')"
    code = f"import sys, kvdiag.cli.main; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", (
        f"kvdiag.cli.main imports {out} at start-up (seconds on every kvdiag command): import them inside the command"
    )
