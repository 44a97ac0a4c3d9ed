"""Fault injection: SIGKILL `kvdiag trace`, `label`, `score` and `replay` at several points (mid-computation,
half-way through a part write, right after a write), rerun the same command each time, and check that the
final outputs equal an uninterrupted run's: nothing lost, duplicated or half-written, and no temporary file
ever read (tests/faults.py guards every read in every run).

Every run is a fresh process with one thread (OMP_NUM_THREADS=1) on the same inputs, so the interrupted and
the uninterrupted run compute the same shapes through the same code path; floats are still compared with a
stated tolerance (rtol 1e-6, atol 1e-9), integers and strings exactly.

On Linux each run is forked from a server (``tests/faults.py --serve``) that has imported torch, transformers and the
other third-party modules a run imports, but not kvdiag: the child installs the read guard and the injection before
it imports kvdiag, as ``python tests/faults.py SPEC -- ARGS`` does, and starts in ~0.5 s instead of ~5 s (the
imports). Consecutive runs alternate between two servers, each with its own random hash seed (unless PYTHONHASHSEED
fixes one for every process), so a killed run and the run that resumes it do not share one, as two fresh interpreters
would not.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import polars as pl
import pytest
import torch
from polars.testing import assert_frame_equal

ROOT = Path(__file__).resolve().parents[1]
FAULTS = str(ROOT / "tests" / "faults.py")
TOL = dict(rel_tol=1e-6, abs_tol=1e-9)


TIMEOUT = 600


class Server:
    """``python tests/faults.py --serve``: runs ``tests/faults.py SPEC -- ARGS`` in children forked from one process
    that has already imported the third-party modules (tests/faults.py ``PRELOAD``)."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="kvdiag-faults-"))
        self.log = (self.dir / "server.log").open("w")
        self.proc = subprocess.Popen([sys.executable, FAULTS, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, text=True,
                                     start_new_session=True)
        self.runs = 0

    def run(self, argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
        self.runs += 1
        out, err = self.dir / f"{self.runs}.out", self.dir / f"{self.runs}.err"
        request = {"spec": argv[2], "args": argv[4:], "cwd": str(cwd), "env": env, "stdout": str(out),
                   "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], TIMEOUT)[0]:
            self.close()
            raise subprocess.TimeoutExpired(argv, TIMEOUT)
        line = self.proc.stdout.readline()
        answer = json.loads(line) if line else {"error": (self.dir / "server.log").read_text()[-3000:]}
        assert "error" not in answer, f"tests/faults.py --serve: {answer['error']}"
        return subprocess.CompletedProcess(argv, answer["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


SERVERS: list[Server] = []  # two, used in turn (started on first use; closed after this module's tests)
_calls = 0


@pytest.fixture(scope="module", autouse=True)
def servers():
    yield
    while SERVERS:
        SERVERS.pop().close()


def kvdiag(spec: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    global _calls
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVDIAG_CACHE": str(cwd / "cache")}
    argv = [sys.executable, FAULTS, spec, "--", *args]
    if not sys.platform.startswith("linux"):  # the server counts its threads in /proc before each fork
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if len(SERVERS) < 2 or any(server.proc.poll() is not None for server in SERVERS):  # first use, or one timed out
        while SERVERS:
            SERVERS.pop().close()
        SERVERS.extend(Server() for _ in range(2))
    _calls += 1
    return SERVERS[_calls % 2].run(argv, cwd, env)


def killed(spec: str, args: list[str], cwd: Path) -> None:
    proc = kvdiag(spec, args, cwd)
    assert proc.returncode == -signal.SIGKILL, (
        f"{spec}: expected a SIGKILL, got {proc.returncode}\n{proc.stderr[-2000:]}"
    )


def finished(args: list[str], cwd: Path) -> None:
    proc = kvdiag("none", args, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]


def interrupted_then_finished(specs: list[str], args_for, tmp_path: Path) -> Path:
    """Run ``args_for(out)`` killed at each of ``specs`` in turn, then to the end; returns its output."""
    out = tmp_path / "interrupted"
    for spec in specs:
        killed(spec, args_for(out), tmp_path)
    finished(args_for(out), tmp_path)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted runs of every command (each the input of the next)."""
    root = tmp_path_factory.mktemp("faults-reference")
    finished(trace_args(root / "trace"), root)
    finished(label_args(root / "trace", root / "labels.parquet"), root)
    finished(score_args(root / "trace", root / "labels.parquet", root / "scores.parquet"), root)
    finished(replay_args(root / "replay"), root)
    return {"root": root, "trace": root / "trace", "labels": root / "labels.parquet", "scores": root / "scores.parquet",
            "replay": root / "replay"}


def trace_args(out: Path) -> list[str]:
    return ["trace", "--model", "tiny:llama", "--limit", "3", "--max-new-tokens", "24", "--no-chat", "--no-instruction",
            "--quiet", "--out", str(out)]


def label_args(trace: Path, out: Path) -> list[str]:
    return ["label", "--trace", str(trace), "--out", str(out), "--checkpoints", "every:8", "--w-obs", "8",
            "--candidates", "6", "--horizon", "4", "--quiet"]


def score_args(trace: Path, labels: Path, out: Path) -> list[str]:
    return ["score", "--trace", str(trace), "--labels", str(labels), "--scorers", "all", "--out", str(out)]


def replay_args(out: Path) -> list[str]:
    return ["replay", "--model", "tiny:llama", "--scorer", "attention,knorm", "--budget", "16", "--interval", "8",
            "--max-new-tokens", "24", "--limit", "2", "--no-chat", "--no-instruction", "--quiet", "--out", str(out)]


def test_trace_survives_sigkill(reference, tmp_path):
    # writes of one prompt: layer 0, layer 1 (safetensors), token part, manifest entry, manifest, tokens.parquet;
    # the first run also writes the header first
    specs = ["write:3:mid",  # half-way through prompt 1's second layer file
             "write:3:mid",  # half-way through prompt 1's token part
             "write:6:after",  # prompt 1 committed and merged
             "call:1:kvdiag.trace.writer._trace_one"]  # mid-generation of prompt 2
    got = interrupted_then_finished(specs, trace_args, tmp_path)
    ref = reference["trace"]
    strip = lambda m: {k: v for k, v in m.items() if k != "created"}
    assert strip(json.loads((got / "manifest.json").read_text())) == strip(
        json.loads((ref / "manifest.json").read_text())
    )
    assert_frame_equal(pl.read_parquet(got / "tokens.parquet"), pl.read_parquet(ref / "tokens.parquet"), **TOL)
    ref_files = sorted(p.relative_to(ref) for p in (ref / "tensors").rglob("*.safetensors"))
    assert sorted(p.relative_to(got) for p in (got / "tensors").rglob("*.safetensors")) == ref_files
    from safetensors.torch import load_file

    for rel in ref_files:
        a, b = load_file(got / rel), load_file(ref / rel)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-9)


def test_label_survives_sigkill(reference, tmp_path):
    items = pl.read_parquet(reference["labels"]).select("prompt_id", "checkpoint").n_unique()
    assert items >= 5
    out = tmp_path / "interrupted" / "labels.parquet"
    args = label_args(reference["trace"], out)
    killed("write:3:mid", args, tmp_path)  # stamp, part 1, then half of part 2
    killed("call:2:kvdiag.label.run.label_item", args, tmp_path)  # mid-computation of the next item
    killed("write:1:after", args, tmp_path)  # one more part, then killed
    done = len(list(out.with_name(out.name + ".parts").glob("*.parquet")))
    killed(f"write:{items - done + 1}:mid", args, tmp_path)  # the remaining parts, then half-way through the merge
    assert not out.exists()
    finished(args, tmp_path)
    assert_frame_equal(pl.read_parquet(out), pl.read_parquet(reference["labels"]), **TOL)


def hybrid_args(trace: Path, out: Path) -> list[str]:
    return ["label", "--trace", str(trace), "--out", str(out), "--checkpoints", "every:8", "--w-obs", "8",
            "--candidates", "all", "--horizon", "4", "--method", "hybrid", "--exact-frac", "0.25", "--audit", "2",
            "--samples", "2", "--quiet"]


HYBRID_REPEATS = int(os.environ.get("KVDIAG_HYBRID_REPEATS", "1"))  # #40: run it 20 times in a row under load


@pytest.mark.parametrize("attempt", range(HYBRID_REPEATS))
def test_hybrid_label_survives_sigkill(reference, tmp_path, attempt):
    """A resumed hybrid run extends its caches in the same steps as an uninterrupted one (one thread, same shapes,
    same path), so its Fisher estimates, hence the top M it labels exactly, are the same: the same rows are exact
    and fast, every value within TOL (docs/labels.md: the bound when the thread count differs)."""
    want_path = tmp_path / "uninterrupted" / "labels.parquet"
    finished(hybrid_args(reference["trace"], want_path), tmp_path)
    want = pl.read_parquet(want_path)
    items = want.select("prompt_id", "checkpoint").n_unique()
    assert items >= 5 and (want["method"] == "exact-top").sum() >= items
    out = tmp_path / "interrupted" / "labels.parquet"
    args = hybrid_args(reference["trace"], out)
    killed("write:3:mid", args, tmp_path)  # stamp, part 1, then half of part 2
    killed("call:2:kvdiag.label.run.label_item", args, tmp_path)  # mid-computation of a later item
    finished(args, tmp_path)
    got = pl.read_parquet(out)
    keys = ["prompt_id", "checkpoint", "position", "granularity", "layer", "kv_head", "method"]
    assert_frame_equal(got.select(keys), want.select(keys))  # the same rows exact, the same rows fast
    assert_frame_equal(got, want, **TOL)


def test_score_survives_sigkill(reference, tmp_path):
    out = tmp_path / "interrupted" / "scores.parquet"
    args = score_args(reference["trace"], reference["labels"], out)
    killed("call:2:kvdiag.scorers.run._score_prompt", args, tmp_path)  # mid-computation
    killed("write:1:mid", args, tmp_path)  # half-way through the output
    assert not out.exists()
    finished(args, tmp_path)
    assert_frame_equal(pl.read_parquet(out), pl.read_parquet(reference["scores"]), **TOL)


def test_replay_survives_sigkill(reference, tmp_path):
    specs = ["write:3:mid",  # config, part 1, then half of part 2
             "call:2:kvdiag.replay.generating.generate_batch",  # mid-generation
             "write:2:after"]  # config, one more part
    got = interrupted_then_finished(specs, replay_args, tmp_path)
    ref = reference["replay"]
    timing = pl.exclude("seconds")  # wall time differs between runs
    assert_frame_equal(pl.read_parquet(got / "generations.parquet").select(timing),
                       pl.read_parquet(ref / "generations.parquet").select(timing), **TOL)
    assert_frame_equal(pl.read_csv(got / "summary.csv"), pl.read_csv(ref / "summary.csv"), **TOL)
    assert sorted(p.name for p in (got / "parts").glob("*.parquet")) == sorted(
        p.name for p in (ref / "parts").glob("*.parquet")
    )


def test_the_read_guard_catches_a_temporary_file(reference, tmp_path):
    """The guard the tests above rely on: reading a file named like a temporary one fails the run."""
    tmp_labels = tmp_path / ".labels.parquet.x1y2.tmp"
    tmp_labels.write_bytes(reference["labels"].read_bytes())
    proc = kvdiag("none", score_args(reference["trace"], tmp_labels, tmp_path / "s.parquet"), tmp_path)
    # read_table turns any read failure into bad input (exit 2); the run fails either way
    assert proc.returncode != 0 and "AssertionError" in proc.stderr, proc.stderr[-2000:]
