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
_UMASK = os.umask(0)  # read it once (os.umask can only be read by setting it) ...
os.umask(_UMASK)  # ... and put it back


def _write_atomically(path: str | os.PathLike, write) -> Path:
    """Call ``write(tmp)`` on a hidden file beside ``path``, then rename it over ``path``: readers and
    interrupted runs never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_UMASK)  # the mode a plain open() would give, not mkstemp's private 0600
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_table(df: pl.DataFrame, path: str | os.PathLike, meta: dict | None = None) -> Path:
    """Write ``df`` to ``path`` atomically with ``meta`` (JSON-serializable) in the file metadata."""
    return _write_atomically(path, lambda tmp: df.write_parquet(tmp, metadata={META_KEY: json.dumps(meta or {}, default=str)}))


def write_json(path: str | os.PathLike, obj) -> Path:
    """Write ``obj`` to ``path`` as indented JSON (non-JSON values as ``str``), atomically."""
    return _write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2, default=str) + "\n"))


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
