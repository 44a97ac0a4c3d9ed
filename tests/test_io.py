"""Atomic writers: whole files only, with the mode a plain open() gives (not mkstemp's private 0600)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl

from kvdiag.core.io import read_meta, write_json, write_table


def test_writers_leave_whole_files_with_the_usual_mode(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    js = write_json(tmp_path / "sub" / "a.json", {"n": 1, "path": tmp_path})
    pq = write_table(pl.DataFrame({"a": [1, 2]}), tmp_path / "t.parquet", {"k": "v"})
    assert json.loads(js.read_text()) == {"n": 1, "path": str(tmp_path)}
    assert pl.read_parquet(pq)["a"].to_list() == [1, 2] and read_meta(pq) == {"k": "v"}
    for path in (js, pq):
        assert os.stat(path).st_mode & 0o777 == os.stat(plain).st_mode & 0o777
    assert not [p for p in tmp_path.rglob("*.tmp")]  # no temporary file left behind


def test_safetensors_fault_agrees_with_safetensors(tmp_path):
    """kvdiag.core.safetensors_header.safetensors_fault (the header read without torch) says a file is unreadable
    exactly when safetensors refuses it: whole, cut at each of several points, and with a byte appended."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvdiag.core.safetensors_header import safetensors_fault

    path = tmp_path / "layer_000.safetensors"
    save_file({"k": torch.randn(3, 4), "v": torch.randn(2)}, str(path), metadata={"layer": "0"})
    whole = path.read_bytes()

    def readable() -> bool:
        try:
            with safe_open(str(path), framework="pt") as f:
                [f.get_tensor(name) for name in f.keys()]
        except Exception:
            return False
        return True

    variants = [whole, whole + b"x", *(whole[:cut] for cut in (0, 5, 8, 20, 100, len(whole) - 1))]
    verdicts = []
    for data in variants:
        path.write_bytes(data)
        verdicts.append((safetensors_fault(path) is None, readable()))
    assert verdicts == [(True, True)] + [(False, False)] * (len(variants) - 1)


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """#55: a write that fails for want of space (ENOSPC) is a UserError naming the file (exit 2 through the CLI,
    not 'a bug in kvdiag'), and neither the final name nor the temporary file is left behind."""
    import errno

    import pytest

    from kvdiag.core.errors import UserError
    from kvdiag.core.io import write_atomically

    def full(tmp):
        Path(tmp).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError, match="out.parquet: No space left on device"):
        write_atomically(tmp_path / "out.parquet", full)
    assert list(tmp_path.iterdir()) == []
    # through the CLI, a write outside kvdiag.core.io (a stage's own) on a full disk is exit 2 as well
    import kvdiag.trace.writer
    from kvdiag.cli.main import main

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kvdiag.trace.writer, "trace_files", no_space)
    with pytest.raises(SystemExit) as exc:
        main(["trace", "--model", "tiny:llama", "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("error: No space left on device"), err
