"""Atomic writers: whole files only, with the mode a plain open() gives (not mkstemp's private 0600)."""

from __future__ import annotations

import json
import os

import polars as pl

from kvdiag.io import read_meta, write_json, write_table


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
