"""kvdiag as a wheel: built from the checkout (``kvdiag.bench.gpu_check._kvdiag_wheel``: ``pip wheel --no-deps
--no-build-isolation`` on a clean copy of the sources), installed with ``--no-deps`` into an empty venv that sees this
venv's third-party packages through a ``.pth`` file but not the checkout, and run from outside the checkout: the
shipped benchmark travels as package data, and the metadata asks for a torch range."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kvdiag.bench.gpu_check import _kvdiag_wheel

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "data" / "kvdiag-bench"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _kvdiag_wheel(ROOT, out, sys.executable)
    (found,) = out.glob("kvdiag-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The python of a fresh venv holding only the wheel (``--no-deps``); this venv's site-packages is on its path
    (a ``.pth`` line: its ``.pth`` files, the checkout's editable install among them, are not run)."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "kvdiag-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--quiet", str(wheel)], check=True)
    return python


def outside(python: Path, *args: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """``python args`` from ``cwd`` (outside the checkout), without PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_carries_the_benchmark_and_asks_for_a_torch_range(wheel):
    """Every file under data/kvdiag-bench is in the wheel, byte for byte, under kvdiag/grade/kvdiag-bench, with the
    viewer's static files; the metadata requires torch >= 2.6, < 3 (the Makefile installs the CPU build 2.13.0)."""
    shipped = {p.relative_to(BENCH).as_posix(): p.read_bytes() for p in BENCH.rglob("*") if p.is_file()}
    assert "math500-smollm2@1/MANIFEST.json" in shipped and len(shipped) >= 7
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for rel, data in shipped.items():
            assert z.read(f"kvdiag/grade/kvdiag-bench/{rel}") == data, rel
        assert {f"kvdiag/report/viewer_static/viewer.{x}" for x in ("html", "css", "js")} <= names
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    torch = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch == ["Requires-Dist: torch<3,>=2.6"]


def test_the_installed_wheel_finds_and_verifies_its_benchmark(installed, tmp_path):
    """Imported from the venv (not the checkout), kvdiag finds the shipped benchmark in its own package and
    ``load`` verifies every file's sha256 and the manifest kvdiag holds for it."""
    code = ("import json, kvdiag; from kvdiag.grade.benchmark import BENCH_ROOT, available, load; "
            "b = load('math500-smollm2@1'); "
            "print(json.dumps([kvdiag.__file__, str(BENCH_ROOT), available(), b.name, sorted(b.manifest['files'])]))")
    done = outside(installed, "-c", code, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    where, root, names, name, files = json.loads(done.stdout.strip().splitlines()[-1])
    venv = installed.parent.parent
    assert Path(where).resolve().is_relative_to(venv) and Path(root).is_relative_to(venv)
    assert not Path(root).resolve().is_relative_to(ROOT)
    assert names == ["math500-smollm2@1"] and name == "math500-smollm2@1"  # shipped, not "(user-built)"
    assert "labels.parquet" in files


@pytest.mark.slow
def test_kvdiag_grade_runs_from_the_installed_wheel(installed, tmp_path):
    """``python -m kvdiag grade knorm --out DIR`` from outside the checkout, on the installed wheel alone: exit 0 and
    a leaderboard row of knorm on the shipped benchmark (about 35 s on an idle 2-core CPU, 3.5 minutes on a busy one:
    the benchmark's q/k/v are rebuilt from the embedded SmolLM2)."""
    out = tmp_path / "out"
    done = outside(installed, "-m", "kvdiag", "grade", "knorm", "--out", str(out), "--quiet", cwd=tmp_path,
                   timeout=1200)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    rows = json.loads((out / "rows.json").read_text())
    assert rows["bench"] == "math500-smollm2@1"
    (row,) = [r for r in rows["rows"] if r["rule"] == "knorm"]
    assert 0 <= row["auroc"] <= 1 and row["auroc_ci"][0] <= row["auroc"] <= row["auroc_ci"][1]
