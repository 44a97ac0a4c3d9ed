"""The output guard every writing command calls first: nothing a user owns is overwritten.

An output path may not be, contain or lie inside any input path (a Trace directory, labels, scores, a benchmark, a
plugin); it may not be written into an existing Trace directory (unless the command writes Traces), below a file, or
where no file can be created (probed for real: as root ``os.access`` says yes to ``/proc``). Pure stdlib (no torch,
no polars): it runs before any heavy import, model load or file write. Outputs are then written to a temporary name
and renamed (``kvdiag.core.io.write_atomically``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvdiag.core.errors import UserError

PathLike = str | os.PathLike


def is_trace_dir(path: PathLike) -> bool:
    """A directory holding a Trace (or the start of one): its ``tokens.parquet``, its parts' settings stamp, or a
    ``manifest.json`` with the Trace header's ``num_layers``."""
    import json

    path = Path(path)
    if not path.is_dir():
        return False
    if (path / "tokens.parquet").is_file() or (path / "parts" / "_header.json").is_file():
        return True
    manifest = path / "manifest.json"
    try:
        return manifest.is_file() and "num_layers" in json.loads(manifest.read_text())
    except (OSError, ValueError, TypeError):
        return False


def _real(path: PathLike) -> Path:
    """The path the operating system opens: every symlink of its existing part resolved before the ``..`` after it
    (``DIR/link/../x`` is ``x`` beside the link's target, not ``DIR/x``), absolute."""
    return Path(os.path.realpath(os.fspath(path)))


def _inside(a: Path, b: Path) -> bool:
    return a != b and b in a.parents


def _same_file(a: Path, b: Path) -> bool:
    """The same file by device and inode (a hard link, a bind mount), for two existing paths."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _table_meta(path: Path) -> dict | None:
    """The kvdiag metadata of a Parquet table (its ``kind``, its Trace), or None when ``path`` is no kvdiag table."""
    import json

    try:
        import pyarrow.parquet as pq  # only for an output that already exists

        raw = (pq.read_metadata(path).metadata or {}).get(b"kvdiag")  # kvdiag.core.io.write_table's key
        return json.loads(raw) if raw else None
    except Exception:  # not Parquet, truncated, unreadable: not a kvdiag table
        return None


def _flatten(inputs: Mapping[str, PathLike | Iterable[PathLike] | None]) -> list[tuple[str, Path]]:
    """(flag, path) of every input given; a list value (repeatable options) gives several."""
    out = []
    for flag, value in inputs.items():
        if value is None:
            continue
        values = [value] if isinstance(value, (str, os.PathLike)) else list(value)
        out += [(flag, Path(v)) for v in values if v is not None and str(v) != ""]
    return out


def check_outputs(outputs: Mapping[str, PathLike | tuple | None],
                  inputs: Mapping[str, PathLike | Iterable[PathLike] | None] | None = None,
                  writes_trace: bool = False, overwrite: bool = False, trace_fingerprint: str | None = None) -> None:
    """Refuse (``UserError``, one line naming both flags) an output that would overwrite or write into what the user
    owns. ``outputs``: flag -> path or (path, kind) or (path, kind, table) with kind ``file`` (default) or ``dir``
    and ``table`` the kvdiag table kind the command writes there (``labels``, ``scores``, ...); None entries are not
    written. ``inputs``: flag -> path (or paths) read by the command; plugin modules that are not paths are skipped.
    ``writes_trace``: the command's output kind is a Trace directory (``kvdiag trace``), which it may continue.

    An input that is a FIFO, device or socket is refused (reading a FIFO would wait forever). Paths are compared as
    the operating system opens them (symlinks resolved before ``..``) and existing files by
    device and inode (hard links). An output may not be empty, nor an existing FIFO, device or socket; an existing
    output file of a ``table`` kind must be such a table (of ``trace_fingerprint``'s Trace, when given): this
    command's own output, which it replaces or continues; anything else is refused unless ``overwrite``. Then each
    output must be creatable: see :func:`check_creatable`."""
    given = {}
    for flag, value in outputs.items():
        if value is None:
            continue
        path, kind, table = (*value, None, None)[:3] if isinstance(value, tuple) else (value, "file", None)
        if os.fspath(path) == "":
            raise UserError(f"{flag} is empty: give a path")
        given[flag] = (path, kind, table)
    ins = [(flag, p, _real(p)) for flag, p in _flatten(inputs or {}) if p.exists()]
    for flag, given_in, inp in ins:  # a FIFO would block the first read forever; a device is no input file
        if not (inp.is_file() or inp.is_dir()):
            raise UserError(f"{flag} {given_in} is not a regular file or directory (a FIFO, device or socket); pass "
                            "the file itself")
    for flag, (path, _kind, table) in given.items():
        out = _real(path)
        for in_flag, given_in, inp in ins:
            if out == inp or _same_file(out, inp):
                raise UserError(f"{flag} {path} is the input {in_flag} {given_in}: it would be overwritten; choose "
                                f"another {flag}")
            if _inside(out, inp):
                raise UserError(f"{flag} {path} lies inside the input {in_flag} {given_in}: writing there would "
                                f"change it; choose a {flag} outside it")
            if _inside(inp, out):
                raise UserError(f"{flag} {path} contains the input {in_flag} {given_in}: writing there could "
                                f"overwrite it; choose a {flag} that does not hold the inputs")
        if not writes_trace:
            trace = next((p for p in [out, *out.parents] if is_trace_dir(p)), None)
            if trace is not None:
                where = "is a Trace directory" if trace == out else f"lies inside the Trace directory {trace}"
                raise UserError(f"{flag} {path} {where}: writing there would corrupt the Trace; choose another {flag}")
        if os.path.lexists(out) and not (out.is_file() or out.is_dir()):
            raise UserError(f"{flag} {path} exists and is not a regular file or directory (a FIFO, device or "
                            f"socket); choose a path to a file")
        if table is not None and out.is_file() and not overwrite:
            meta = _table_meta(out)
            found = "no kvdiag table" if meta is None else f"a kvdiag {meta.get('kind')} table"
            if meta is None or meta.get("kind") != table:
                raise UserError(f"{flag} {path} exists and holds {found}, not {table}: choose another {flag}, or "
                                "pass --overwrite to replace it")
            theirs = (meta.get("trace") or {}).get("fingerprint")
            if trace_fingerprint is not None and theirs != trace_fingerprint:
                raise UserError(f"{flag} {path} holds the {table} of another Trace (fingerprint {theirs}, this one's "
                                f"{trace_fingerprint}): choose another {flag}, or pass --overwrite to replace it")
    for flag, (path, kind, _table) in given.items():
        check_creatable(path, flag, kind)


def check_creatable(path: PathLike, what: str = "--out", kind: str = "file") -> Path:
    """Refuse an output ``path`` (``kind`` file or dir) that cannot be written: of the other kind, below a regular
    file, or in a directory where no file can be created, found by creating (and removing at once) a probe file in
    the nearest existing directory, since ``os.access`` says yes to everything for root. Leaves nothing behind."""
    import tempfile

    path = Path(path)
    absolute = _real(path)
    existing = next(p for p in [absolute, *absolute.parents] if p.exists())
    if existing == absolute:
        if kind == "dir" and not existing.is_dir():
            raise UserError(f"{what} {path} is not a writable directory: it is a file; choose a directory path")
        if kind == "file" and existing.is_dir():
            raise UserError(f"{what} {path} is a directory; pass a file path")
        folder = existing if kind == "dir" else existing.parent
    elif not existing.is_dir():
        target = "a writable directory" if kind == "dir" else "a writable file path"
        raise UserError(f"{what} {path} is not {target}: it lies below the file {existing}; choose a path in a "
                        "directory")
    else:
        folder = existing
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".kvdiag-write-probe.")
    except OSError as err:
        raise UserError(f"{what} {path}: {folder} is not writable ({err.strerror or err}); choose a writable "
                        "path") from err
    os.close(fd)
    os.unlink(probe)
    return path


__all__ = ["check_creatable", "check_outputs", "is_trace_dir"]
