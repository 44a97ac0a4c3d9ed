"""Parquet tables with provenance: every table says how it was made.

``write_table`` writes atomically (temp file + rename) and stores a JSON dict under the
Parquet key-value metadata key ``kvdiag``; ``read_table`` returns both.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from kvdiag.errors import UserError

META_KEY = "kvdiag"


def write_table(df: pl.DataFrame, path: str | os.PathLike, meta: dict | None = None) -> Path:
    """Write ``df`` to ``path`` atomically with ``meta`` (JSON-serializable) in the file metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        df.write_parquet(tmp, metadata={META_KEY: json.dumps(meta or {}, default=str)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read_meta(path: str | os.PathLike) -> dict:
    """The ``kvdiag`` metadata dict of a Parquet file written by ``write_table`` ({} if none)."""
    kv = pq.read_metadata(path).metadata or {}  # polars writes file-level key-value metadata
    raw = kv.get(META_KEY.encode())
    return json.loads(raw) if raw else {}


def read_table(path: str | os.PathLike, what: str = "table") -> tuple[pl.DataFrame, dict]:
    """Read a Parquet table and its metadata; a missing or unreadable file is a ``UserError``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist: pass the path of a Parquet file written by kvdiag")
    try:
        return pl.read_parquet(path), read_meta(path)
    except Exception as err:  # pyarrow/polars raise many types for corrupt files
        raise UserError(f"{what} {path} is not a readable Parquet file ({err.__class__.__name__}): regenerate it") from err
