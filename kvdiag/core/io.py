"""Parquet tables with provenance: every table says how it was made.

``write_table`` writes atomically (temp file + rename) and stores a JSON dict under the
Parquet key-value metadata key ``kvdiag``; ``read_table`` returns both.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvdiag.core.errors import UserError
from kvdiag.core.guard import check_creatable as check_writable  # one definition; the old name stays

if TYPE_CHECKING:  # polars and pyarrow load on the first read or write: a missing file is refused without them
    import polars as pl

META_KEY = "kvdiag"
_UMASK = os.umask(0)  # read it once (os.umask can only be read by setting it) ...
os.umask(_UMASK)  # ... and put it back


FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk or quota


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def table_sha256(df: pl.DataFrame) -> str:
    """The sha256 of a table's contents: each column's name, type and values in row order (numbers as their bytes,
    the rest as text). A run's stamp takes it where its input is a table in memory and not a file (``kvdiag grade``
    scores in memory): a rerun given other contents is refused, not mixed with parts made from the old ones."""
    import polars as pl

    h = hashlib.sha256()
    for name in df.columns:
        col = df[name]
        h.update(f"{name}\x1f{col.dtype}\x1e".encode())
        if col.dtype.is_numeric() or col.dtype == pl.Boolean:
            h.update(col.to_numpy().tobytes())
        else:
            h.update("\x1f".join(map(str, col.to_list())).encode())
    return h.hexdigest()


def write_atomically(path: str | os.PathLike, write) -> Path:
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
    except OSError as err:
        if err.errno in FULL:  # the machine's, not kvdiag's fault: one line, nothing under the final name
            raise UserError(f"writing {path}: {os.strerror(err.errno)}; free space or choose another output") \
                from err
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def writable_dir(path: str | os.PathLike, what: str = "--out") -> Path:
    """Create the directory ``path`` if needed and prove it writable (a probe file); otherwise a ``UserError``."""
    path = check_writable(path, what, "dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UserError(
            f"{what} {path} is not a writable directory ({err.strerror or err}); choose another {what}"
        ) from err
    return path


def write_table(df: pl.DataFrame, path: str | os.PathLike, meta: dict | None = None) -> Path:
    """Write ``df`` to ``path`` atomically with ``meta`` (JSON-serializable) in the file metadata."""
    return write_atomically(
        path, lambda tmp: df.write_parquet(tmp, metadata={META_KEY: json.dumps(meta or {}, default=str)})
    )


def write_json(path: str | os.PathLike, obj) -> Path:
    """Write ``obj`` to ``path`` as indented JSON (non-JSON values as ``str``), atomically."""
    return write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2, default=str) + "\n"))


def write_csv(df: pl.DataFrame, path: str | os.PathLike) -> Path:
    """Write ``df`` to ``path`` as CSV, atomically."""
    return write_atomically(path, df.write_csv)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path``, atomically."""
    return write_atomically(path, lambda tmp: Path(tmp).write_text(text))


def read_meta(path: str | os.PathLike, what: str = "table") -> dict:
    """The ``kvdiag`` metadata dict of a Parquet file written by ``write_table`` ({} if none); a missing, truncated
    or corrupt file (or metadata) is a ``UserError`` naming ``what``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist: pass the path of a Parquet file written by kvdiag")
    import pyarrow.parquet as pq

    try:
        kv = pq.read_metadata(path).metadata or {}  # polars writes file-level key-value metadata
        raw = kv.get(META_KEY.encode())
        return json.loads(raw) if raw else {}
    except Exception as err:  # pyarrow raises many types for corrupt files
        raise UserError(f"{what} {path} is not a readable Parquet file ({err.__class__.__name__}): regenerate it") \
            from err


def read_table(path: str | os.PathLike, what: str = "table") -> tuple[pl.DataFrame, dict]:
    """Read a Parquet table and its metadata; a missing or unreadable file is a ``UserError``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist: pass the path of a Parquet file written by kvdiag")
    import polars as pl

    try:
        df = pl.read_parquet(path, glob=False)
    except Exception as err:  # pyarrow/polars raise many types for corrupt files
        raise UserError(
            f"{what} {path} is not a readable Parquet file ({err.__class__.__name__}): regenerate it"
        ) from err
    return df, read_meta(path, what)


def check_table(path: str | os.PathLike, what: str = "table") -> dict:
    """The metadata of a Parquet table whose footer reads, without reading its rows (a cheap check before heavy
    work); a missing or unreadable file is a ``UserError`` (the same line as :func:`read_table`'s)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist: pass the path of a Parquet file written by kvdiag")
    return read_meta(path, what)  # its one line for an unreadable file


def read_json(path: str | os.PathLike, what: str = "file"):
    """The JSON value of ``path``; a missing or malformed file is a ``UserError`` naming ``what``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist: pass a file written by kvdiag")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{what} {path} is not valid JSON ({err}): regenerate it") from err


def read_csv(path: str | os.PathLike, columns: dict, what: str, fix: str, keys: tuple[str, ...] = ()) -> pl.DataFrame:
    """A CSV table a kvdiag stage wrote (rank-eval's metrics, the figures' statistics): its ``columns`` (name ->
    polars dtype) read as those dtypes, the rest inferred from every row; ``keys`` unique. An empty, malformed or
    foreign file, a missing column, a value of another type or a duplicated key is one ``UserError`` naming ``what``
    (the file) and ``fix`` (the command that writes it)."""
    import polars as pl

    try:
        df = pl.read_csv(path, schema_overrides=columns, infer_schema_length=None, glob=False)
    except (pl.exceptions.PolarsError, OSError, UnicodeDecodeError) as err:  # empty, unparseable, a value of a type
        reason = " ".join(str(err).split())[:160]
        raise UserError(f"{what} {path} is not the table kvdiag writes ({type(err).__name__}: {reason}); {fix}") \
            from err
    if missing := [c for c in columns if c not in df.columns]:
        raise UserError(f"{what} {path} lacks the column(s) {', '.join(missing)}; {fix}")
    if keys and df.select(keys).is_duplicated().any():
        raise UserError(f"{what} {path} holds a row twice (the same {', '.join(keys)}); {fix}")
    return df


def read_input(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of a user's input file ``path`` (``what``: its flag): a regular file, else one ``UserError`` (a FIFO
    would block the read forever; a directory or device is no input file)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(f"{what} {path}: no such file") from None
    except OSError as err:
        raise UserError(f"{what} {path}: cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{what} {path} is not a regular file (a directory, FIFO, device or socket); pass the file")
    return Path(path).read_bytes()


def read_utf8(path: str | os.PathLike, what: str) -> str:
    """The text of a user's file ``path`` (``what``: its flag), decoded as UTF-8; a file that is not is one
    ``UserError`` naming the file and the offset of its first bad byte."""
    data = read_input(path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{what} {path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); save "
                        "it as UTF-8") from None
