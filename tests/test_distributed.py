"""torchrun splits labeling and tracing over ranks (2 CPU processes, gloo): the merged output equals a
single process's, row for row and bit for bit; after a lost rank a rerun redoes only the missing items.
``--shard i/n`` (Slurm arrays, no torchrun) gives the same result after its merge run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import torch
from polars.testing import assert_frame_equal
from safetensors.torch import load_file

from kvdiag.cli.main import main
from kvdiag.label import LabelConfig
from kvdiag.label.run import label_trace, part_path, work_items
from kvdiag.trace import GenerationSettings, trace_prompts

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]

ROOT = Path(__file__).resolve().parents[1]
# candidates "all" makes an item ~0.1 s: slow enough to kill a rank mid-run, fast enough for CI
CFG = LabelConfig(checkpoints="every:2", w_obs=8, horizon=4, candidates="all")
LABEL_ARGS = ["--checkpoints", "every:2", "--w-obs", "8", "--horizon", "4", "--candidates", "all", "--quiet"]
GEN = GenerationSettings(max_new_tokens=40, chat=False, instruction=None, storage_dtype="float32")
TRACE_ARGS = ["--model", "tiny:llama", "--max-new-tokens", "40", "--limit", "3", "--no-chat", "--no-instruction",
              "--storage-dtype", "float32", "--quiet"]
KEYS = ["prompt_id", "checkpoint", "position", "granularity", "layer", "kv_head"]


def torchrun(*args: str) -> subprocess.Popen:
    """``torchrun --nproc-per-node 2 -m kvdiag ARGS`` in its own session (so it can be killed as a whole)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per rank, like the in-process reference (conftest)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m", "kvdiag", *args,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def run_ok(*args: str) -> None:
    code, out = finish(torchrun(*args))
    assert code == 0, out


@pytest.fixture(scope="module")
def reference(tiny_llama, tiny_trace, tmp_path_factory) -> pl.DataFrame:
    """Labels of the whole Trace by one process."""
    out = tmp_path_factory.mktemp("one") / "labels.parquet"
    return pl.read_parquet(label_trace(tiny_trace, tiny_llama, out, CFG, show_progress=False))


def test_torchrun_labels_equal_one_process(tiny_trace, reference, tmp_path):
    out = tmp_path / "labels.parquet"
    run_ok("label", "--trace", str(tiny_trace.path), "--out", str(out), *LABEL_ARGS)
    got = pl.read_parquet(out)
    assert got.height > 1000 and got.select("prompt_id", "checkpoint").n_unique() == len(work_items(tiny_trace, CFG))
    assert_frame_equal(got, reference, check_exact=True)


def test_lost_rank_rerun_redoes_only_missing_items(tiny_trace, reference, tmp_path):
    psutil = pytest.importorskip("psutil")  # installed with accelerate
    out = tmp_path / "labels.parquet"
    parts = out.with_name(out.name + ".parts")
    items = work_items(tiny_trace, CFG)
    rank1 = {part_path(parts, *it) for i, it in enumerate(items) if i % 2 == 1}  # rank 1's share
    proc = torchrun("label", "--trace", str(tiny_trace.path), "--out", str(out), *LABEL_ARGS)
    try:
        deadline = time.monotonic() + 90
        while len(rank1 & set(parts.glob("*.parquet"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "rank 1 wrote no parts"
            time.sleep(0.01)
        workers = psutil.Process(proc.pid).children(recursive=True)
        next(w for w in workers if w.environ().get("RANK") == "1").kill()  # the agent then stops rank 0
    finally:
        code, log = finish(proc)
    assert code != 0, log
    done = {p: p.stat().st_mtime_ns for p in parts.glob("*.parquet")}
    assert len(rank1 & done.keys()) >= 2 and len(done) < len(items) and not out.exists()

    run_ok("label", "--trace", str(tiny_trace.path), "--out", str(out), *LABEL_ARGS)
    assert {p: p.stat().st_mtime_ns for p in done} == done  # finished items were not redone
    got = pl.read_parquet(out)
    assert not got.select(KEYS).is_duplicated().any()
    assert_frame_equal(got, reference, check_exact=True)


def _same_trace(a: Path, b: Path) -> None:
    """Manifest (but its creation time), tokens and every tensor file equal."""
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert list(ma["prompts"]) == list(mb["prompts"])  # the order is the prompts' order
    assert {**ma, "created": None} == {**mb, "created": None}
    assert_frame_equal(pl.read_parquet(a / "tokens.parquet"), pl.read_parquet(b / "tokens.parquet"), check_exact=True)
    files = sorted(f.relative_to(a) for f in (a / "tensors").rglob("*.safetensors"))
    assert len(files) == len(ma["prompts"]) * ma["num_layers"]
    assert files == sorted(f.relative_to(b) for f in (b / "tensors").rglob("*.safetensors"))
    for f in files:  # not byte for byte: safetensors writes its metadata keys in any order
        ta, tb = load_file(a / f), load_file(b / f)
        assert ta.keys() == tb.keys() == {"q", "k", "v"} and all(torch.equal(ta[k], tb[k]) for k in ta), f


@pytest.fixture(scope="module")
def one_trace(tiny_llama, tmp_path_factory) -> Path:
    """The Trace of TRACE_ARGS made by one process."""
    from kvdiag.tasks.prompts import load_prompts

    out = tmp_path_factory.mktemp("one") / "trace"
    return trace_prompts(tiny_llama, load_prompts("builtin:arith", limit=3), out, GEN, prompts_source="builtin:arith",
                         show_progress=False)


def test_torchrun_trace_equals_one_process(one_trace, tmp_path):
    out = tmp_path / "trace"
    run_ok("trace", "--out", str(out), *TRACE_ARGS)
    _same_trace(one_trace, out)


def test_slurm_shards_then_merge_equal_one_process(one_trace, tiny_trace, reference, tmp_path):
    """Each --shard run writes only parts (no manifest, no merged table); the run without --shard merges
    and does nothing else when every shard finished."""
    out = tmp_path / "trace"
    for i, have in ((0, ["arith000", "arith002"]), (1, ["arith000", "arith001", "arith002"])):
        with pytest.raises(SystemExit) as exc:
            main(["trace", "--out", str(out), "--shard", f"{i}/2", *TRACE_ARGS])
        assert exc.value.code == 0 and not (out / "manifest.json").exists()
        assert sorted(p.stem for p in (out / "parts").glob("arith*.json")) == have
    tensors = {f: f.stat().st_mtime_ns for f in (out / "tensors").rglob("*.safetensors")}
    with pytest.raises(SystemExit):
        main(["trace", "--out", str(out), *TRACE_ARGS])
    assert {f: f.stat().st_mtime_ns for f in tensors} == tensors
    _same_trace(one_trace, out)

    labels = tmp_path / "labels.parquet"
    items = [part_path(labels.with_name(labels.name + ".parts"), *it) for it in work_items(tiny_trace, CFG)]
    for shard, have in ((["--shard", "0/2"], items[::2]), (["--shard", "1/2"], items), ([], items)):
        with pytest.raises(SystemExit) as exc:
            main(["label", "--trace", str(tiny_trace.path), "--out", str(labels), *LABEL_ARGS, *shard])
        assert exc.value.code == 0 and labels.exists() == (not shard)
        assert sorted(labels.with_name(labels.name + ".parts").glob("*.parquet")) == sorted(have)
    assert_frame_equal(pl.read_parquet(labels), reference, check_exact=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_group_split_roles(monkeypatch, rank):
    """Under torchrun every rank does its own share without merging; only rank 0 then merges."""
    from kvdiag.core.distributed import Group

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    group, calls = Group("cpu"), []
    monkeypatch.setattr(group, "barrier", lambda: calls.append("barrier"))
    got = group.split(lambda shard, merge, show: calls.append((shard, merge, show)) or "merged")
    mine = [((rank, 2), False, rank == 0), "barrier"]
    assert calls == (mine + [((0, 1), True, False)] if rank == 0 else mine)
    assert got == ("merged" if rank == 0 else None)


def test_shard_under_torchrun_is_refused(monkeypatch):
    from kvdiag.core.distributed import Group, parse_shard
    from kvdiag.core.errors import UserError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="use one of them"):
        Group("cpu", parse_shard("0/2"))
    for bad in ("2/2", "1", "a/b"):
        with pytest.raises(UserError, match="--shard"):
            parse_shard(bad)
