"""The grade cache of rule-independent inputs (the rebuilt q/k/v of a ``--store none`` benchmark Trace): a cached grade
gives the uncached row exactly, a corrupt entry is rebuilt, the key follows the benchmark's manifest; and the
Markdown row ``kvdiag grade`` writes beside rows.json has the leaderboard's columns."""

from __future__ import annotations

import json
import shutil

import pytest

import kvdiag.cli.main
from kvdiag.grade import benchmark
from kvdiag.grade import run as grade_run
from kvdiag.scorers import SCORERS
from kvdiag.trace import Trace
from tests.test_grade import bench  # noqa: F401  (the fixture: a tiny benchmark built as the shipped ones are)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDIAG_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _grade(b, lm, out, cache_on):
    rules = grade_run.resolve_rules("knorm", None, {})
    return grade_run.grade(b, rules, lm, out, show_progress=False, cache=cache_on)


def test_a_cached_grade_gives_the_uncached_row_exactly(bench, tiny_llama, cache, tmp_path, monkeypatch):  # noqa: F811  (the imported fixture)
    """Same code path after the q/k/v (the cache holds the prefill's tensors bitwise) and the stored full-cache runs
    (kvdiag.label.golden_store: fp32, the first cached run's own), so the rows are equal exactly, not within a
    tolerance: compared as JSON text (NaN included). The second cached run reads every prompt's golden runs."""
    from kvdiag.label.golden_store import GoldenStore

    served = []
    load = GoldenStore.load
    monkeypatch.setattr(GoldenStore, "load", lambda self, pid, ts: served.append(load(self, pid, ts)) or served[-1])
    b = benchmark.load(str(bench["dir"]))
    plain = _grade(b, tiny_llama, tmp_path / "plain", False)
    first = _grade(b, tiny_llama, tmp_path / "first", True)
    assert served and all(s is None for s in served)  # nothing stored yet: computed and kept
    served.clear()
    second = _grade(b, tiny_llama, tmp_path / "second", True)
    assert served and all(s is not None for s in served)  # every prompt's golden runs read back
    assert (plain["cache"], first["cache"], second["cache"]) == ("off", "built", "hit")
    want = json.dumps(plain["rows"], sort_keys=True)
    assert json.dumps(first["rows"], sort_keys=True) == want
    assert json.dumps(second["rows"], sort_keys=True) == want
    assert second["decisions"].equals(plain["decisions"])
    tr = Trace(b.file("trace"), model=tiny_llama)
    files, _ = grade_run.qkv_cache(b, tr, tiny_llama, False)
    assert files.keys() == set(tr.prompt_ids) and all(f.is_relative_to(cache) for f in files.values())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_entry_is_detected_and_rebuilt(bench, tiny_llama, cache, damage):  # noqa: F811  (the imported fixture)
    b = benchmark.load(str(bench["dir"]))
    tr = Trace(b.file("trace"), model=tiny_llama)
    files, how = grade_run.qkv_cache(b, tr, tiny_llama, False)
    assert how == "built"
    victim = next(iter(files.values()))
    good = victim.read_bytes()
    if damage == "flip":
        bad = bytearray(good)
        bad[len(bad) - 5] ^= 0x01  # a byte of tensor data: the file still parses, only its sha256 tells
        victim.write_bytes(bytes(bad))
    else:
        victim.write_bytes(good[: len(good) // 2])
    files, how = grade_run.qkv_cache(b, tr, tiny_llama, False)
    assert how.startswith("rebuilt")
    assert files[next(iter(files))].read_bytes() == good  # the same prefill, the same bytes
    assert grade_run.qkv_cache(b, tr, tiny_llama, False)[1] == "hit"


def test_the_cache_key_follows_the_manifest_sha256(bench, tiny_llama, tmp_path):  # noqa: F811  (the imported fixture)
    b = benchmark.load(str(bench["dir"]))
    copy = tmp_path / "tiny@1"
    shutil.copytree(bench["dir"], copy)
    manifest = json.loads((copy / "MANIFEST.json").read_text())
    manifest["licence"] = "another licence"  # the sealed files unchanged: only MANIFEST.json's sha256 moves
    (copy / "MANIFEST.json").write_text(json.dumps(manifest))
    other = benchmark.load(str(copy))
    tr = Trace(b.file("trace"), model=tiny_llama)
    key, key2 = grade_run.qkv_cache_key(b, tr, tiny_llama), grade_run.qkv_cache_key(other, tr, tiny_llama)
    assert key["manifest_sha256"] != key2["manifest_sha256"]
    assert {k for k in key if key[k] != key2[k]} == {"manifest_sha256"}
    assert grade_run.qkv_cache_dir(b, key) != grade_run.qkv_cache_dir(other, key2)


def test_grade_writes_the_leaderboard_row_and_prints_full_width(bench, cache, tmp_path, capsys):  # noqa: F811  (the imported fixture)
    before = dict(SCORERS)
    try:
        with pytest.raises(SystemExit) as exit_:
            kvdiag.cli.main.main(["grade", "knorm", "--bench", str(bench["dir"]), "--out", str(tmp_path / "g"),
                                  "--quiet"])
    finally:
        SCORERS.clear()
        SCORERS.update(before)
    assert exit_.value.code == 0
    out = capsys.readouterr().out  # captured: not a terminal, so the table must not be cut at 80 columns
    assert "joint @ keep:0.25" in out and max(len(line) for line in out.splitlines()) > 80
    b = benchmark.load(str(bench["dir"]))
    rows = json.loads((tmp_path / "g" / "rows.json").read_text())["rows"]
    text = (tmp_path / "g" / grade_run.ROW_MD).read_text()
    lines = text.splitlines()
    board = grade_run.leaderboard_markdown(b, rows).splitlines()
    header = next(i for i, line in enumerate(board) if line.startswith("| rule"))
    assert lines[:2] == board[header:header + 2]  # the leaderboard's header and alignment row
    assert len(lines) == 3 and lines[2].startswith("| knorm |") and lines[2] == board[header + 2]


def test_a_golden_store_serves_whole_prompts_only_and_refuses_a_changed_file(tmp_path):
    """kvdiag.label.golden_store: runs come back bit for bit; a prompt missing one of the asked checkpoints, another
    key, or a file with a flipped byte is not served (None: the engine computes its own)."""
    import torch

    from kvdiag.label.golden_store import GoldenStore

    runs = {t: ([(torch.randn(2, t, 4), torch.randn(2, t, 4)) for _ in range(3)], torch.randn(5, 11))
            for t in (6, 9)}
    store = GoldenStore(tmp_path, {"k": 1})
    writer = store.writer("p/0")  # a prompt id with a slash: stored under a hash
    for t, run in runs.items():
        writer.add(t, run)
    writer.commit()
    got = store.load("p/0", [6, 9])
    for t, (prefix, logp) in runs.items():
        assert torch.equal(got[t][1], logp)
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got[t][0], prefix, strict=True))
    assert store.load("p/0", [6, 9, 12]) is None and GoldenStore(tmp_path, {"k": 2}).load("p/0", [6]) is None
    file = next(tmp_path.rglob("t0000009.safetensors"))
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))
    assert store.load("p/0", [6, 9]) is None and store.load("p/0", [6]) is not None
