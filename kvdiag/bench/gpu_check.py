"""``make gpu-check``: kvdiag on a CUDA machine end to end, in one script, writing one results file.

Three subcommands (``python -m kvdiag.bench.gpu_check SUBCOMMAND``, or ``python build/gpu-bundle/gpu_check.py
SUBCOMMAND`` on a machine where kvdiag is not installed)::

    bundle --out build/gpu-bundle [--offline]   (make gpu-bundle) wheels for what a CUDA machine lacks, <= 64 MiB
    run --bundle build/gpu-bundle --out build/gpu-check [--dry-run]   (make gpu-check [DRY_RUN=1])
    steps ...                                   the checks themselves (``run`` starts them in a child process)

``bundle`` builds kvdiag's wheel and downloads (``pip download --no-deps``, for CPython 3.12 on x86-64 Linux) the
wheels the target image lacks (``WHEELS``: the image this project's GPU machine runs has torch, triton, pytest,
scipy, pyarrow, ... but transformers 5.17 and no polars), copies the tests and this file beside them and writes
``bundle.json`` (what went in, why, sizes). Every wheel is recompressed losslessly with LZMA (the same files, so
the same RECORD hashes; pip's installer reads any zip method the Python has): polars 37.9 -> 23.8 MiB, so that the
bundle and a checkout fit in the 64 MiB a device call carries. ``run`` installs every wheel of the bundle with
``pip install --no-deps --target OUT/site`` beside the machine's own torch, then runs ``steps`` with
``PYTHONPATH=OUT/site`` from ``OUT`` (so the installed kvdiag is the one tested, not a checkout), within
``BUDGET_S`` seconds:

1. environment: versions, the GPU, where kvdiag was imported from;
2. peak: an fp32 and a bf16 matmul (``kvdiag.kernels.peak``), the denominators of every MFU below;
3. pytest -m gpu: the ``gpu``-marked tests of the bundle's copy of tests/;
4. kernels: ``kvdiag bench kernels`` (``run_kernel_bench``) at Llama-3.1-8B's attention shapes (32/8 heads of
   128, N = 64 rows, W = 16) and P = 4,096 and 16,384, fp32 and bf16: Triton against the torch reference
   (tolerances of tests/test_kernels.py), TFLOP/s and MFU of the attention, GB/s of the compaction;
5. labels: every exact family's tiny model (``kvdiag.model.load.TINY``, as tests/test_conformance.py) labeled on CUDA
   (Triton) and on the CPU (torch reference), token/layer/head rows, and the fast (fisher, K = 4) label of every
   entry: |kl_cuda - kl_cpu| <= 1e-3 |kl_cpu| + 1e-5;
6. bench label: ``random:llama-3.1-8b`` in bf16 at P = 4,096 and 16,384: the token engine against the naive loop
   and the plain forward (skipped where the prefix expanded to N rows would not fit), layer start against full
   depth; seconds, TFLOP/s and MFU against the bf16 peak of step 2;
7. replay: bounded-cache decoding with the compaction through ``kvdiag.kernels.compact_kv`` on CUDA (Triton)
   equals the torch backend and the CPU, and compact_kv at an 8B cache's shape is exact.

Each step's result goes into ``OUT/results.json`` as soon as it ends (a step still running when the budget is
spent is reported as not run), and ``OUT/results.md`` renders it. ``--dry-run`` runs the same steps on the CPU
with the torch backend at small shapes (the model: ``random:llama-3.1-8b:layers=1,vocab=512`` in fp32), so the
bundle, the install and every step are exercised where there is no GPU (``tests/test_gpu_check.py``).

Only the standard library is imported at module level: ``run`` and ``bundle`` work before kvdiag's
dependencies are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

BUDGET_S = 480  # the whole check on the GPU, install included: 8 minutes
BUNDLE_LIMIT = 64 * 2**20
RESULTS, REPORT, INSTALL = "results.json", "results.md", "install.json"
# the target: the GPU image's python3 (CPython 3.12, x86-64, glibc >= 2.28)
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--platform",
          "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
# distribution -> (version, why it travels); None: this environment's version
WHEELS: dict[str, tuple[str | None, str]] = {
    "transformers": ("5.24.0", "the GPU image has transformers 5.17, whose models still take past_key_values "
                               "(kvdiag passes cache=, transformers >= 5.20); 5.24.0, not 5.25: 5.25 needs "
                               "huggingface-hub >= 2.4 (and its httpx2), the image has 1.33; pure Python"),
    "polars": ("1.33.1", "not on the GPU image; 1.33.1 is the last polars in one wheel, 39.7 MB (23.8 MiB "
                         "recompressed); polars 2.x adds its engine as polars-runtime-32, 54 MB, too much of the "
                         "64 MiB a device call carries beside a checkout"),
}
# what the image beside the bundle holds (docs/benchmarks.md; the device tool's KINDS.md, 2026-11): a bundled wheel
# whose requirements these do not meet fails on the GPU machine at import, so the bundle refuses it here
IMAGE = {"torch": "2.11.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0",
         "numpy": "2.5.2", "triton": "3.6.0"}
STEPS = ("environment", "peak", "pytest_gpu", "kernels", "labels_cuda_vs_cpu", "bench_label", "replay")
LABEL_RTOL, LABEL_ATOL = 1e-3, 1e-5  # labels on CUDA vs CPU (nats): different kernels, fp32 rounding


# --------------------------------------------------------------------------- bundle


def build_bundle(out: Path, offline: bool = False, python: str = sys.executable) -> dict:
    """Wheels + tests + this script in ``out`` (emptied first: two versions of a wheel would stop the install);
    ``offline``: kvdiag's wheel only (no download; the test of the dry run uses this environment's packages)."""
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").exists():
        raise SystemExit(f"bundle: run it from a kvdiag checkout ({root} has no pyproject.toml)")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    _kvdiag_wheel(root, out, python)
    wheels = [{"distribution": "kvdiag", "why": "kvdiag itself (this checkout)"}]
    if not offline:
        for dist, (ver, why) in WHEELS.items():
            pin = f"{dist}=={ver or version(dist)}"
            _pip(python, ["download", "--no-deps", "-q", "-d", str(out), *TARGET, pin])
            wheels.append({"distribution": dist, "version": pin.split("==")[1], "why": why})
    files = sorted(out.glob("*.whl"))
    for f in files:
        if not f.name.startswith("kvdiag-"):  # kvdiag runs on the image's torch by design; the others check at import
            _check_image(f)
    for w in wheels:
        w["file"] = next(f.name for f in files if f.name.lower().startswith(w["distribution"].replace("-", "_") + "-"))
        w["downloaded_bytes"] = (out / w["file"]).stat().st_size
        _recompress(out / w["file"])
        w["bytes"] = (out / w["file"]).stat().st_size
    tests = out / "tests"
    tests.mkdir()
    for f in (root / "tests").glob("*.py"):
        shutil.copy2(f, tests / f.name)
    (tests / "pytest.ini").write_text(_pytest_ini(root / "pyproject.toml"))
    shutil.copy2(Path(__file__), out / "gpu_check.py")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    manifest = {"kind": "kvdiag_gpu_bundle", "offline": offline, "target": " ".join(TARGET), "wheels": wheels,
                "bytes": total, "limit_bytes": BUNDLE_LIMIT}
    (out / "bundle.json").write_text(json.dumps(manifest, indent=1))
    if total > BUNDLE_LIMIT:
        raise SystemExit(f"bundle: {total / 2**20:.1f} MiB is over the {BUNDLE_LIMIT / 2**20:.0f} MiB limit")
    return manifest


def _check_image(wheel: Path) -> None:
    """Refuse ``wheel`` when one of its unconditional requirements names an ``IMAGE`` package at a version the
    requirement excludes (transformers 5.25 needs huggingface-hub >= 2.4; the image has 1.33)."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        have = IMAGE.get(req.name.lower().replace("_", "-"))
        if have and not (req.marker and "extra" in str(req.marker)) and not req.specifier.contains(have, True):
            raise SystemExit(f"bundle: {wheel.name} requires {req}, the GPU image has {req.name} {have}: pin an "
                             f"older version in kvdiag.bench.gpu_check.WHEELS or bundle {req.name} too")


def _kvdiag_wheel(root: Path, out: Path, python: str) -> None:
    """kvdiag's wheel, built from a clean copy of the checkout's sources (setuptools' in-tree build/lib would keep
    modules deleted since an earlier build); --no-build-isolation: this environment's setuptools, nothing
    fetched."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvdiag-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(root / name, src / name)
        shutil.copytree(root / "kvdiag", src / "kvdiag", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        _pip(python, ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)])


def _recompress(wheel: Path) -> None:
    """Rewrite ``wheel`` with every member LZMA-compressed (lossless; names, contents and order unchanged)."""
    import zipfile

    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as dst:
        for info in src.infolist():
            member = zipfile.ZipInfo(info.filename, info.date_time)
            member.external_attr, member.compress_type = info.external_attr, zipfile.ZIP_LZMA
            dst.writestr(member, src.read(info))
    tmp.replace(wheel)


def _pip(python: str, args: list[str]) -> None:
    proc = subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"pip {' '.join(args[:3])} ... failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def _pytest_ini(pyproject: Path) -> str:
    """pyproject's pytest markers as a pytest.ini (the bundle has no pyproject.toml)."""
    import re

    text = pyproject.read_text()
    block = re.search(r"markers = \[(.*?)\]", text, re.S)
    markers = re.findall(r'"([^"]+)"', block.group(1)) if block else ["gpu: needs CUDA (skipped without it)"]
    return "[pytest]\nmarkers =\n" + "".join(f"    {m}\n" for m in markers)


# --------------------------------------------------------------------------- run (parent)


def run(bundle: Path, out: Path, dry_run: bool, budget: float, quick: bool) -> int:
    """Install the bundle into ``out/site`` and run the steps in a child process; returns 0 when every step
    passed."""
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    for name in (RESULTS, REPORT, INSTALL):
        (out / name).unlink(missing_ok=True)
    site = out / "site"
    if site.exists():
        shutil.rmtree(site)
    manifest = json.loads((bundle / "bundle.json").read_text())
    wheels = [str(bundle / w["file"]) for w in manifest["wheels"]]
    try:
        import lzma  # noqa: F401  (the wheels are LZMA zips)
    except ImportError:
        print(f"gpu check: {sys.executable} has no lzma module, which the bundle's wheels need; use a Python with it",
              file=sys.stderr)
        return 2
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--target", str(site), *wheels], capture_output=True, text=True)
    install = {"python": sys.executable, "site": str(site), "wheels": manifest["wheels"],
               "seconds": time.time() - start, "bundle_bytes": manifest["bytes"], "ok": proc.returncode == 0,
               "log": (proc.stdout + proc.stderr)[-3000:]}
    (out / INSTALL).write_text(json.dumps(install, indent=1))
    if proc.returncode == 0:
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
        cmd = [sys.executable, "-m", "kvdiag.bench.gpu_check", "steps", "--bundle", str(bundle), "--out", str(out),
               "--deadline", str(start + budget), *(["--dry-run"] if dry_run else []), *(["--quick"] if quick else [])]
        try:  # from out/, so that a checkout in the working directory does not shadow the installed kvdiag
            subprocess.run(cmd, cwd=out, env=env, timeout=max(60.0, start + budget + 60 - time.time()))
        except subprocess.TimeoutExpired:
            pass  # the steps that finished are in results.json
    results = finalize(out, install, dry_run, budget)
    print(f"gpu check: {results['summary']['passed']} of {len(STEPS)} steps passed"
          f"{' (dry run on the CPU)' if dry_run else ''}; {out / RESULTS}, {out / REPORT}")
    return 0 if results["summary"]["passed"] == len(STEPS) else 1


def finalize(out: Path, install: dict, dry_run: bool, budget: float) -> dict:
    """results.json completed (an install failure, steps never reached) and rendered to results.md."""
    path = out / RESULTS
    results = json.loads(path.read_text()) if path.exists() else new_results(dry_run, budget)
    results["install"] = {k: v for k, v in install.items() if k != "log" or not install["ok"]}
    done = {s["name"] for s in results["steps"]}
    why = "the install failed" if not install["ok"] else "the time budget ran out (or the steps process died)"
    results["steps"] += [{"name": n, "status": "not run", "seconds": 0.0, "summary": why, "details": {}}
                         for n in STEPS if n not in done]
    summarize(results)
    _write(path, json.dumps(results, indent=1))
    _write(out / REPORT, render_markdown(results))
    return results


def new_results(dry_run: bool, budget: float) -> dict:
    return {"kind": "kvdiag_gpu_check", "dry_run": dry_run, "budget_s": budget,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": {}, "steps": [], "summary": {}}


def summarize(results: dict) -> None:
    steps = {s["name"]: s for s in results["steps"]}
    peaks = steps.get("peak", {}).get("details", {})
    bench = steps.get("bench_label", {}).get("details", {}).get("token", [])
    engine = [r for r in bench if r["method"].startswith("engine")]
    results["summary"] = {
        "gpu": results["environment"].get("gpu") or "cpu (dry run)",
        "passed": sum(s["status"] == "pass" for s in results["steps"]),
        "failed": [s["name"] for s in results["steps"] if s["status"] != "pass"],
        "bf16_peak_tflops": peaks.get("bfloat16", {}).get("tflops"),
        "fp32_peak_tflops": peaks.get("float32", {}).get("tflops"),
        "label_engine_mfu": engine[-1]["mfu"] if engine and not results["dry_run"] else None,
    }


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# --------------------------------------------------------------------------- steps (child)


class Shapes:
    """Sizes of the checks: real ones on the GPU, small ones in the dry run (CPU, torch backend)."""

    def __init__(self, dry_run: bool, quick: bool):
        gpu = not dry_run
        self.device = "cuda" if gpu else "cpu"
        self.peak_size = 8192 if gpu else 512
        self.kernel_prefixes = (4096, 16384) if gpu else (48,)
        self.kernel = (dict(n=64, window=16, heads=32, kv_heads=8, head_dim=128, exclude=1, trace_len=16384) if gpu
                       else dict(n=4, window=4, heads=4, kv_heads=2, head_dim=16, exclude=2, trace_len=256))
        self.kernel_repeats = 5 if gpu else 1
        self.model = "random:llama-3.1-8b" if gpu else "random:llama-3.1-8b:layers=1,vocab=512"
        self.model_dtype = "bfloat16" if gpu else "float32"
        self.label_prefixes = (4096, 16384) if gpu else (24,)
        self.label = dict(n=64, horizon=16, repeats=3) if gpu else dict(n=2, horizon=2, repeats=1)
        self.layer_n, self.layer_repeats = (8, 2) if gpu else (2, 1)
        self.families = None if not quick else ("llama", "gemma2", "gpt_oss", "mistral_sw")  # None: every exact one


class Checker:
    """Runs the steps in order within the deadline, writing results.json after each."""

    def __init__(self, out: Path, bundle: Path, dry_run: bool, deadline: float, quick: bool):
        self.out, self.bundle, self.dry_run, self.deadline = out, bundle, dry_run, deadline
        self.shapes = Shapes(dry_run, quick)
        self.results = new_results(dry_run, BUDGET_S)
        self.peaks: dict = {}

    def step(self, name: str, fn, needs_s: float) -> None:
        left = self.deadline - time.time()
        if left < needs_s:
            self._record(name, "not run", 0.0, f"{left:.0f} s of the budget left, the step needs about {needs_s:.0f}",
                         {})
            return
        t0 = time.time()
        try:
            status, summary, details = fn()
        except Exception as err:  # a failed step is a result, not the end of the check
            status, summary = "error", f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"
            details = {"traceback": traceback.format_exc()[-4000:]}
        self._record(name, status, time.time() - t0, summary, details)

    def _record(self, name, status, seconds, summary, details) -> None:
        self.results["steps"].append({"name": name, "status": status, "seconds": round(seconds, 2),
                                      "summary": summary, "details": details})
        _write(self.out / RESULTS, json.dumps(self.results, indent=1))
        print(f"[gpu check] {name}: {status} ({seconds:.1f} s) {summary}", flush=True)

    # -- 1
    def environment(self):
        import torch
        import transformers

        import kvdiag
        from kvdiag.kernels import triton_available

        site = (self.out / "site").resolve()
        env = {
            "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda_available": torch.cuda.is_available(), "triton": triton_available(),
            "kvdiag_file": kvdiag.__file__, "transformers_file": transformers.__file__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "device": self.shapes.device, "threads": torch.get_num_threads(),
        }
        try:
            import polars

            env["polars"] = polars.__version__
        except ImportError as err:
            env["polars"] = f"missing ({err})"
        if torch.cuda.is_available():
            env["cuda"] = torch.version.cuda
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        self.results["environment"] = env
        problems = []
        if not Path(kvdiag.__file__).resolve().is_relative_to(site):
            problems.append(f"kvdiag was imported from {kvdiag.__file__}, not from the bundle's install in {site}")
        if not self.dry_run and not (env["cuda_available"] and env["triton"]):
            problems.append("CUDA and triton are needed (run with --dry-run on a machine without a GPU)")
        if problems:
            return "fail", "; ".join(problems), env
        return "pass", f"torch {env['torch']}, transformers {env['transformers']}, {env['gpu'] or 'cpu'}", env

    # -- 2
    def peak(self):
        import torch

        from kvdiag.kernels.peak import matmul_peak

        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            p = matmul_peak(self.shapes.device, dtype, self.shapes.peak_size, seconds=1.0)
            self.peaks[p.dtype] = p
            out[p.dtype] = {**p.to_dict(), "tflops": p.flops_per_s / 1e12}
        summary = ", ".join(f"{d} {v['tflops']:.3g} TFLOP/s" for d, v in out.items())
        return "pass", f"F.linear {self.shapes.peak_size}^3: {summary}", out

    # -- 3
    def pytest_gpu(self):
        tests = self.bundle / "tests"
        files = sorted(str(f) for f in tests.glob("test_*.py") if "mark.gpu" in f.read_text())
        if not files:
            return "fail", f"no gpu-marked tests in {tests}", {}
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-c",
               str(tests / "pytest.ini"), "--rootdir", str(tests), *files]
        left = max(30.0, self.deadline - time.time() - 200)  # leave time for the steps after it
        try:
            proc = subprocess.run(cmd, cwd=self.out, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            return "fail", f"pytest -m gpu ran past {left:.0f} s", {"files": files}
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        last = tail[-1] if tail else ""
        details = {"files": [Path(f).name for f in files], "returncode": proc.returncode, "output": tail[-40:]}
        if proc.returncode != 0:
            return "fail", last, details
        if not self.dry_run and ("skipped" in last or "passed" not in last):
            return "fail", f"{last} (on a GPU every gpu test must run)", details
        return "pass", last + (" (no CUDA: the gpu tests skip in a dry run)" if self.dry_run else ""), details

    # -- 4
    def kernels(self):
        import torch

        from kvdiag.kernels.bench import run_kernel_bench

        tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # tests/test_kernels.py: Triton vs the torch reference
        rows, bad = [], []
        for dtype in (torch.float32, torch.bfloat16):
            peak = self.peaks.get(str(dtype).removeprefix("torch."))
            for prefix in self.shapes.kernel_prefixes:
                for r in run_kernel_bench(self.shapes.device, prefix=prefix, dtype=dtype, keep_fraction=0.5,
                                          repeats=self.shapes.kernel_repeats, **self.shapes.kernel):
                    s = r.ms / 1e3
                    row = {"dtype": str(dtype)[6:], "P": prefix, "op": r.op, "impl": r.impl, "ms": r.ms,
                           "max_err": r.max_err, "peak_mb": r.peak_mb,
                           "tflops": None if r.flops is None else r.flops / s / 1e12,
                           "mfu": None if r.flops is None or peak is None else peak.mfu(r.flops, s),
                           "gb_per_s": None if r.bytes is None else r.bytes / s / 1e9}
                    rows.append(row)
                    limit = 0.0 if r.op == "compact_kv" else tol[dtype]
                    checked = r.impl == ("triton" if not self.dry_run else "obvious")
                    if checked and not r.max_err <= limit:
                        bad.append(f"{r.op} {r.impl} {row['dtype']} P={prefix}: max |err| {r.max_err:.2e} > {limit}")
        impls = {r["impl"] for r in rows}
        if not self.dry_run and "triton" not in impls:
            bad.append("no Triton rows (triton missing?)")
        best = max((r for r in rows if r["op"] == "shared_prefix_attention" and r["mfu"] is not None
                    and r["impl"] != "obvious"), key=lambda r: r["mfu"], default=None)
        summary = (f"{len(rows)} rows; shared_prefix_attention {best['impl']} {best['dtype']} P={best['P']}: "
                   f"{best['tflops']:.3g} TFLOP/s, MFU {best['mfu']:.0%}") if best else f"{len(rows)} rows"
        return ("fail" if bad else "pass"), "; ".join(bad) or summary, {"rows": rows, "shapes": self.shapes.kernel}

    # -- 5
    def labels_cuda_vs_cpu(self):
        import torch

        from kvdiag.core.errors import UserError
        from kvdiag.label import OracleEngine, candidate_rows
        from kvdiag.label.fast import FisherLabeler, FisherParams
        from kvdiag.model.load import TINY, load_model

        T, H, LENGTH, candidates = 30, 4, 40, [0, 5, 21, 22, 23, 29]  # tests/test_conformance.py's case
        ids = torch.randint(0, 250, (LENGTH,), generator=torch.Generator().manual_seed(0))
        # the dry run compares a CPU run in batches of 3 rows with one in batches of 8 (both torch)
        batch, be = (8, "triton") if not self.dry_run else (3, "torch")
        families, rows_out, bad = [], [], []

        def compare(name: str, granularity: str, want, got, **extra) -> None:
            """One row of the table: |got - want| against LABEL_ATOL + LABEL_RTOL |want| (nats)."""
            a, b = want.double(), got.double()
            diff = (a - b).abs()
            row = {"family": name, "granularity": granularity, "rows": len(a), "max_abs": float(diff.max()),
                   "max_rel": float((diff / a.abs().clamp_min(1e-12)).max()), "kl_mean": float(a.mean()), **extra}
            rows_out.append(row)
            if float((diff - (LABEL_ATOL + LABEL_RTOL * a.abs())).max()) > 0:
                bad.append(f"{name} {granularity}: max |diff| {row['max_abs']:.2e} nats")

        for name in self.shapes.families or TINY:
            try:
                cpu = load_model(f"tiny:{name}")
            except UserError:
                continue  # refused families (MLA)
            dev = load_model(f"tiny:{name}", device=self.shapes.device)
            families.append(name)
            for granularity in ("token", "layer", "head"):
                rows = candidate_rows(candidates, granularity, cpu.attention.num_layers, cpu.attention.num_kv_heads)
                want, floor_cpu = OracleEngine(cpu, ids, H, batch_size=8).label(T, rows)
                # Triton by name: auto keeps fp32 attention on torch (kvdiag.kernels.attention_backend)
                got, floor_dev = OracleEngine(dev, ids, H, batch_size=batch, backend=be).label(T, rows)
                compare(name, granularity, want["kl"], got["kl"], noise_floor_cpu=floor_cpu,
                        noise_floor_device=floor_dev, flip_mismatches=int((want["flips"] != got["flips"]).sum()))
            # the fast (fisher) label of every entry: its backward passes on the device against the CPU's
            rows = candidate_rows(list(range(T)), "token", cpu.attention.num_layers, cpu.attention.num_kv_heads)
            compare(name, "token (fisher)", *(FisherLabeler(m, ids, H, FisherParams(samples=4), 0).label(T, rows)["kl"]
                                              for m in (cpu, dev)))
        worst = max(rows_out, key=lambda r: r["max_abs"])
        summary = (f"{len(families)} families x 3 granularities and fisher within {LABEL_RTOL:g} relative + "
                   f"{LABEL_ATOL:g} nats; largest |diff| {worst['max_abs']:.2e} nats ({worst['family']} "
                   f"{worst['granularity']})")
        return ("fail" if bad else "pass"), "; ".join(bad) or summary, {
            "tolerance": {"rtol": LABEL_RTOL, "atol_nats": LABEL_ATOL}, "families": families, "rows": rows_out}

    # -- 6
    def bench_label(self):
        import torch

        from kvdiag.label.bench import LABEL_METHODS, run_label_bench, run_layer_start_bench
        from kvdiag.model.load import load_model

        sh = self.shapes
        lm = load_model(sh.model, dtype=sh.model_dtype, device=sh.device)
        peak = self.peaks.get(sh.model_dtype)
        if peak is None:
            from kvdiag.kernels.peak import model_peak

            peak = self.peaks[sh.model_dtype] = model_peak(lm)
        cfg, token, layer, notes = lm.model.config, [], [], []

        def row(r, P, kind):
            return {"P": P, "kind": kind, "method": r.method, "seconds": r.seconds, "tokens_per_s": r.tokens_per_s,
                    "tflops": r.flops / r.seconds / 1e12, "mfu": peak.mfu(r.flops, r.seconds), "peak_mb": r.peak_mb}

        for P in sh.label_prefixes:
            methods = LABEL_METHODS
            if sh.device == "cuda":  # the plain forward holds the prefix expanded to N rows in every layer
                need = (2 * cfg.num_hidden_layers * sh.label["n"] * cfg.num_key_value_heads * (P + sh.label["horizon"])
                        * lm.attention.qk_head_dim * torch.finfo(getattr(torch, sh.model_dtype)).bits // 8)
                free = torch.cuda.mem_get_info()[0]
                if need > 0.6 * free:
                    methods = ("engine", "naive")
                    notes.append(f"P={P}: plain forward skipped (its expanded cache needs {need / 2**30:.0f} GiB, "
                                 f"{free / 2**30:.0f} GiB free)")
            token += [row(r, P, "token") for r in run_label_bench(lm, P, methods=methods, **sh.label)]
            res = run_layer_start_bench(lm, "layer", P, sh.layer_n, sh.label["horizon"], sh.layer_repeats)
            layer += [row(r, P, "layer") for r in res.rows]
            notes.append(f"P={P}: layer start {res.rows[1].seconds / res.rows[0].seconds:.2f}x over full depth, labels "
                         f"within {res.max_abs_diff:.1e} nats")
        del lm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        eng = [r for r in token if r["method"].startswith("engine")]
        summary = ", ".join(f"P={r['P']}: engine {r['tflops']:.3g} TFLOP/s, MFU {r['mfu']:.0%}" for r in eng)
        return "pass", f"{sh.model} {sh.model_dtype}: {summary}", {
            "model": sh.model, "dtype": sh.model_dtype, "peak_tflops": peak.flops_per_s / 1e12, "token": token,
            "layer": layer, "notes": notes, "settings": {**sh.label, "layer_n": sh.layer_n}}

    # -- 7
    def replay(self):
        import torch

        from kvdiag import kernels
        from kvdiag.kernels import torch_ref
        from kvdiag.model.load import load_model
        from kvdiag.replay import Policy, decode, make_scorer

        prompt = list(range(40, 70))
        dev = load_model("tiny:llama", device=self.shapes.device)
        cpu = load_model("tiny:llama")
        backend = "triton" if not self.dry_run else "torch"

        def run(lm, be):
            return decode(lm, prompt, Policy(make_scorer("knorm"), 12, 6, backend=be), max_new_tokens=30)

        on_dev, on_dev_torch, on_cpu = run(dev, backend), run(dev, "torch"), run(cpu, "torch")
        details = {"backend": backend, "budget": 12, "interval": 6, "compressions": len(on_dev.compressions),
                   "peak_kv": on_dev.peak_kv, "same_as_torch_backend": on_dev.token_ids == on_dev_torch.token_ids,
                   "same_as_cpu": on_dev.token_ids == on_cpu.token_ids}
        # compact_kv at the cache shape of Llama-3.1-8B (8 KV heads of 128, 16,384 entries, half kept), bf16
        T = 16384 if not self.dry_run else 512
        gen = torch.Generator().manual_seed(0)
        keys, values = (torch.randn(8, T, 128, generator=gen).to(self.shapes.device, torch.bfloat16) for _ in "kv")
        keep = torch.stack([torch.randperm(T, generator=gen)[: T // 2].sort().values for _ in range(8)])
        keep = keep.to(self.shapes.device)
        got = kernels.compact_kv(keys, values, keep, backend=backend)
        want = torch_ref.compact_kv(keys, values, keep)
        details["compact_kv_exact"] = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        ok = (details["same_as_torch_backend"] and details["compact_kv_exact"] and details["compressions"] > 0
              and on_dev.peak_kv <= 12 + 6)
        summary = (f"{details['compressions']} compactions through compact_kv ({backend}): tokens "
                   f"{'equal' if details['same_as_torch_backend'] else 'DIFFER'} to the torch backend, "
                   f"{'equal' if details['same_as_cpu'] else 'differ'} to the CPU; compact_kv [8, {T}, 128] bf16 "
                   f"{'exact' if details['compact_kv_exact'] else 'NOT exact'}")
        return ("pass" if ok else "fail"), summary, details


def steps(bundle: Path, out: Path, dry_run: bool, deadline: float, quick: bool) -> None:
    import torch

    torch.manual_seed(0)
    c = Checker(out, bundle, dry_run, deadline, quick)
    c.step("environment", c.environment, 5)
    c.step("peak", c.peak, 10)
    c.step("pytest_gpu", c.pytest_gpu, 30)
    c.step("kernels", c.kernels, 20)
    c.step("labels_cuda_vs_cpu", c.labels_cuda_vs_cpu, 20)
    c.step("bench_label", c.bench_label, 40)
    c.step("replay", c.replay, 5)
    c.results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _write(out / RESULTS, json.dumps(c.results, indent=1))


# --------------------------------------------------------------------------- results.md


def render_markdown(res: dict) -> str:
    """results.json as Markdown: the summary, the steps, then the tables of the kernels, labels and benches."""
    s, env = res["summary"], res["environment"]
    lines = [f"# kvdiag gpu check{' (dry run: CPU, torch backend, small shapes)' if res['dry_run'] else ''}", "",
             f"{s['passed']} of {len(STEPS)} steps passed" + (f"; not passed: {', '.join(s['failed'])}"
                                                              if s["failed"] else "") + ".", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in env.items()]
    inst = res.get("install", {})
    if inst:
        wheels = ", ".join(f"{w['file']} ({w['bytes'] / 2**20:.1f} MiB)" for w in inst.get("wheels", []))
        lines += [f"| installed into | {inst.get('site')} ({'ok' if inst.get('ok') else 'FAILED'}, "
                  f"{inst.get('seconds', 0):.0f} s) |", f"| wheels | {wheels} |"]
    if s.get("bf16_peak_tflops"):
        lines += [f"| bf16 / fp32 matmul peak | {s['bf16_peak_tflops']:.3g} / {s['fp32_peak_tflops']:.3g} TFLOP/s |"]
    lines += ["", "| step | status | s | result |", "|---|---|---:|---|"]
    lines += [f"| {st['name']} | {st['status']} | {st['seconds']:.1f} | {st['summary']} |" for st in res["steps"]]
    steps = {st["name"]: st["details"] for st in res["steps"]}

    def table(title, rows, cols):
        if not rows:
            return []
        out = ["", f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            out.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
        return out

    lines += table("kernels (run_kernel_bench)", steps.get("kernels", {}).get("rows", []),
                   ["dtype", "P", "op", "impl", "ms", "tflops", "mfu", "gb_per_s", "peak_mb", "max_err"])
    labels = steps.get("labels_cuda_vs_cpu", {})
    lines += table(f"labels on {res['environment'].get('device', '?')} vs CPU (tolerance {labels.get('tolerance')})",
                   labels.get("rows", []), ["family", "granularity", "rows", "kl_mean", "max_abs", "max_rel",
                                            "noise_floor_cpu", "noise_floor_device", "flip_mismatches"])
    bench = steps.get("bench_label", {})
    lines += table(f"bench label: {bench.get('model')} {bench.get('dtype')} (MFU vs the measured peak)",
                   bench.get("token", []) + bench.get("layer", []),
                   ["P", "kind", "method", "seconds", "tokens_per_s", "tflops", "mfu", "peak_mb"])
    lines += [f"- {n}" for n in bench.get("notes", [])]
    for st in res["steps"]:
        if st["status"] == "error" and st["details"].get("traceback"):
            lines += ["", f"## {st['name']}: traceback", "", "```", st["details"]["traceback"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if 0 < abs(v) < 1e-2 or abs(v) >= 1e5:
            return f"{v:.2e}"
        return f"{v:.3g}"
    return str(v)


# --------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdiag.bench.gpu_check", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bundle", help="build the wheel bundle (needs PyPI unless --offline)")
    b.add_argument("--out", default="build/gpu-bundle")
    b.add_argument("--offline", action="store_true", help="kvdiag's wheel only, nothing downloaded")
    for name in ("run", "steps"):
        p = sub.add_parser(name, help="install the bundle and run the checks" if name == "run" else argparse.SUPPRESS)
        p.add_argument("--bundle", default="build/gpu-bundle")
        p.add_argument("--out", default="build/gpu-check")
        p.add_argument("--dry-run", action="store_true", help="CPU, torch backend, small shapes")
        p.add_argument("--quick", action="store_true", help="four tiny families instead of every one")
        if name == "run":
            p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check")
        else:
            p.add_argument("--deadline", type=float, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "bundle":
        m = build_bundle(Path(args.out).resolve(), args.offline)
        for w in m["wheels"]:
            print(f"{w['file']:<70} {w['bytes'] / 2**20:6.1f} MiB  {w['why']}")
        print(f"bundle {args.out}: {m['bytes'] / 2**20:.1f} MiB in all (limit {BUNDLE_LIMIT / 2**20:.0f} MiB)")
        return 0
    bundle, out = Path(args.bundle).resolve(), Path(args.out).resolve()
    if not (bundle / "bundle.json").exists():
        print(f"gpu check: {bundle} holds no bundle.json: run make gpu-bundle first", file=sys.stderr)
        return 2
    if args.cmd == "run":
        return run(bundle, out, args.dry_run, args.budget, args.quick)
    steps(bundle, out, args.dry_run, args.deadline, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
