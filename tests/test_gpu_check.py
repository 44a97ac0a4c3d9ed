"""``make gpu-check DRY_RUN=1`` in small: the bundle builds (offline: kvdiag's wheel only), installs into a clean
directory, and every step of ``kvdiag.bench.gpu_check`` runs on the CPU from that install and writes the results
file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_end_to_end(tmp_path):
    pytest.importorskip("setuptools")  # the wheel is built with this environment's setuptools
    bundle, out = tmp_path / "bundle", tmp_path / "out"
    subprocess.run([sys.executable, "-m", "kvdiag.bench.gpu_check", "bundle", "--out", str(bundle), "--offline"],
                   cwd=ROOT, check=True, capture_output=True)
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert [w["distribution"] for w in manifest["wheels"]] == ["kvdiag"] and manifest["bytes"] < gpu_check.BUNDLE_LIMIT
    assert (bundle / "gpu_check.py").exists() and (bundle / "tests" / "pytest.ini").exists()
    # the bundle's own copy of the script, from outside the checkout, as on a GPU machine
    proc = subprocess.run([sys.executable, str(bundle / "gpu_check.py"), "run", "--bundle", str(bundle), "--out",
                           str(out), "--dry-run", "--quick"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    results = json.loads((out / "results.json").read_text())
    report = (out / "results.md").read_text()
    assert proc.returncode == 0, report
    assert [s["name"] for s in results["steps"]] == list(gpu_check.STEPS)
    assert all(s["status"] == "pass" for s in results["steps"]), report
    assert results["dry_run"] and results["install"]["ok"]
    # the kvdiag under test is the installed wheel, not this checkout
    assert Path(results["environment"]["kvdiag_file"]).is_relative_to(out / "site")
    steps = {s["name"]: s["details"] for s in results["steps"]}
    assert {r["op"] for r in steps["kernels"]["rows"]} == {"shared_prefix_attention", "compact_kv"}
    assert steps["bench_label"]["token"][0]["mfu"] > 0 and steps["peak"]["bfloat16"]["gflops"] > 0
    assert "7 of 7 steps passed" in report and "| bench_label | pass |" in report


def test_steps_not_reached_are_reported(tmp_path):
    """An install that failed still leaves one results file, every step marked not run, and a non-zero exit."""
    install = {"ok": False, "log": "pip: no such wheel", "wheels": [], "site": str(tmp_path / "site"), "seconds": 0.1}
    results = gpu_check.finalize(tmp_path, install, dry_run=True, budget=10)
    assert [s["status"] for s in results["steps"]] == ["not run"] * len(gpu_check.STEPS)
    assert results["summary"]["passed"] == 0 and results["install"]["log"] == "pip: no such wheel"
    assert "the install failed" in (tmp_path / "results.md").read_text()


def test_run_without_a_bundle_exits_2(tmp_path, capsys):
    assert gpu_check.main(["run", "--bundle", str(tmp_path), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    assert "make gpu-bundle" in capsys.readouterr().err


def _wheel(tmp_path: Path, requires: list[str]) -> Path:
    import zipfile

    path = tmp_path / "demo-1.0-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", meta)
    return path


def test_bundle_refuses_a_wheel_the_image_cannot_import(tmp_path):
    """transformers 5.25 needs huggingface-hub >= 2.4; the GPU image has 1.33: the first real GPU run failed at
    import on exactly this, so the bundle now refuses such a wheel where it is built."""
    bad = _wheel(tmp_path, ["huggingface-hub<3.0,>=2.4.0", "numpy>=1.17"])
    with pytest.raises(SystemExit, match="huggingface-hub.*1.33.0"):
        gpu_check._check_image(bad)
    ok = tmp_path / "ok"
    ok.mkdir()
    # met requirements, packages the image list does not name, and extras pass
    gpu_check._check_image(_wheel(ok, ["huggingface-hub<3.0,>=1.31.0", "kernels<0.20",
                                       'huggingface-hub>=9; extra == "hub"']))
