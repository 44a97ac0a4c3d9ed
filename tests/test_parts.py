"""The part store shared by trace, label and replay: atomic parts, resume, the settings stamp, the merge."""

from __future__ import annotations

import polars as pl
import pytest

from kvdiag.core.errors import UserError
from kvdiag.core.io import read_table
from kvdiag.core.parts import PartStore


def test_parts_resume_stamp_and_merge(tmp_path):
    store = PartStore(tmp_path / "out.parts", tmp_path / "out.parquet")
    assert store.stamp("config.json", {"seed": 0}) == {"seed": 0}
    assert store.stamp("config.json", {"seed": 0}) == {"seed": 0}  # the same settings continue
    with pytest.raises(UserError, match="holds parts made with other settings"):
        store.stamp("config.json", {"seed": 1})
    store.write("b.parquet", pl.DataFrame({"x": [2]}), {"fingerprint": "fb"})
    assert store.done("b.parquet") and store.done("b.parquet", "fb") and not store.done("b.parquet", "other")
    assert not store.done("a.parquet")
    with pytest.raises(UserError, match="1 of 2 work items are not finished yet"):
        store.merge(["a.parquet", "b.parquet"], tmp_path / "out.parquet", {})
    assert not (tmp_path / "out.parquet").exists()
    store.write("a.parquet", pl.DataFrame({"x": [1]}), {})
    store.merge(["b.parquet", "a.parquet"], tmp_path / "out.parquet", {"kind": "t"}, sort=["x"])
    df, meta = read_table(tmp_path / "out.parquet")
    assert df["x"].to_list() == [1, 2] and meta == {"kind": "t"}
    assert not [p for p in store.root.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_a_stamp_check_of_its_own(tmp_path):
    store = PartStore(tmp_path / "parts", tmp_path)

    def check(have):
        if have["model"] != "m":
            raise UserError("another model")

    assert store.stamp("_header.json", lambda: {"model": "m", "created": 1}, check) == {"model": "m", "created": 1}
    assert store.stamp("_header.json", lambda: {"model": "m", "created": 2}, check)["created"] == 1  # the first stays
    with pytest.raises(UserError, match="another model"):
        store.stamp("_header.json", {"model": "x"}, lambda have: check({"model": "x"}))


def test_an_unwritable_root_is_bad_input(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot create"):
        PartStore(tmp_path / "file" / "parts", tmp_path / "file")
