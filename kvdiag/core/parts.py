"""The part store of every stage that writes parts (trace prompts, label checkpoints, replay runs).

Each finished work item is one file in the store's directory, written atomically (``kvdiag.core.io``), so an
interrupted run (even SIGKILL) keeps every finished item and the same command continues: a rerun skips the
items whose part exists (and, where parts carry one, whose fingerprint matches). A settings stamp, written
before the first part, refuses to mix in parts made with other settings. ``merge`` concatenates the parts
into the stage's output table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.io import read_meta, write_json, write_table
from kvdiag.core.parsing import safe_id


def part_name(*fields: object) -> str:
    """The file name of a work item's part: its fields, each made file-safe, joined by ``__`` (e.g. a label checkpoint
    ``arith000__0000256.parquet``, a replay run ``arith000__rkv__128.parquet``)."""
    return "__".join(safe_id(str(field)) for field in fields) + ".parquet"


def check_stamp(root: str | os.PathLike, name: str, want: dict | Callable[[dict], bool]) -> None:
    """Refuse, as :meth:`PartStore.stamp` would, parts in ``root`` stamped ``name`` with other settings than
    ``want`` (a stamp, or whether the one on disk is the same): before the model loads, and creating nothing."""
    path = Path(root) / name
    if path.is_file():
        have = json.loads(path.read_text())
        if not (want(have) if callable(want) else have == want):
            raise _mixing(root)


def _mixing(root: str | os.PathLike) -> UserError:
    return UserError(f"{root} holds parts made with other settings or another Trace; use another --out or delete "
                     f"{root}")


class PartStore:
    """Parts in the directory ``root`` (created here; ``out`` names the output in error messages)."""

    def __init__(self, root: str | os.PathLike, out: str | os.PathLike):
        self.root, self.out = Path(root), out
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"--out {out}: cannot create {self.root} ({err.strerror}); choose a writable path") from err

    def path(self, name: str) -> Path:
        return self.root / name

    def done(self, name: str, fingerprint: str | None = None) -> bool:
        """Whether the part ``name`` is finished (with ``fingerprint``: made from the same inputs and settings)."""
        path = self.path(name)
        return path.exists() and (fingerprint is None or read_meta(path).get("fingerprint") == fingerprint)

    def write(self, name: str, df: pl.DataFrame, meta: dict) -> Path:
        """Commit one table part (atomically: a reader never sees half of it)."""
        return write_table(df, self.path(name), meta)

    def write_json(self, name: str, obj: dict) -> Path:
        """Commit one JSON part (atomically)."""
        return write_json(self.path(name), obj)

    def stamp(self, name: str, want: dict | Callable[[], dict], check: Callable[[dict], None] | None = None) -> dict:
        """The settings stamp ``name``: the one on disk, after ``check(stamp)`` (default: it must equal ``want``),
        or else ``want`` (a dict, or a function making it), written now. Returns the stamp in force."""
        path = self.path(name)
        if path.exists():
            have = json.loads(path.read_text())
            (check or self._same_as(want))(have)
            return have
        want = want() if callable(want) else want
        write_json(path, want)
        return want

    def refuse_mixing(self) -> None:
        """The ``UserError`` of a stamp check: these parts were made with other settings."""
        raise _mixing(self.root)

    def _same_as(self, want) -> Callable[[dict], None]:
        def check(have: dict) -> None:
            if have != want:
                self.refuse_mixing()
        return check

    def merge(self, names: Sequence[str], out: str | os.PathLike, meta: dict, sort: list[str] | None = None,
              schema: dict | None = None) -> pl.DataFrame:
        """Concatenate the parts ``names`` (in this order, or sorted by ``sort``) into the table ``out``; every part
        must be finished. ``schema``: the columns of an empty merge. Returns the merged table."""
        missing = [name for name in names if not self.path(name).exists()]
        if missing:
            raise UserError(f"{len(missing)} of {len(names)} work items are not finished yet (e.g. {missing[0]}); "
                            "rerun the same command to finish them")
        frames = [pl.read_parquet(self.path(name), glob=False) for name in names]
        df = pl.concat(frames) if frames else pl.DataFrame(schema=schema)
        df = df.sort(sort) if sort else df
        write_table(df, out, meta)
        return df
