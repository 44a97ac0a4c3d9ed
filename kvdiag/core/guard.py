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
    """The absolute path with every symlink of its existing part resolved (``..`` folded)."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(path))))


def _inside(a: Path, b: Path) -> bool:
    return a != b and b in a.parents


def _flatten(inputs: Mapping[str, PathLike | Iterable[PathLike] | None]) -> list[tuple[str, Path]]:
    """(flag, path) of every input given; a list value (repeatable options) gives several."""
    out = []
    for flag, value in inputs.items():
        if value is None:
            continue
        values = [value] if isinstance(value, (str, os.PathLike)) else list(value)
        out += [(flag, Path(v)) for v in values if v is not None and str(v) != ""]
    return out


def check_outputs(outputs: Mapping[str, PathLike | tuple[PathLike, str] | None],
                  inputs: Mapping[str, PathLike | Iterable[PathLike] | None] | None = None,
                  writes_trace: bool = False) -> None:
    """Refuse (``UserError``, one line naming both flags) an output that would overwrite or write into what the user
    owns. ``outputs``: flag -> path or (path, kind) with kind ``file`` (default) or ``dir``; None entries are not
    written. ``inputs``: flag -> path (or paths) read by the command; plugin modules that are not paths are skipped.
    ``writes_trace``: the command's output kind is a Trace directory (``kvdiag trace``), which it may continue.
    Then each output must be creatable: see :func:`check_creatable`."""
    given = {flag: (v if isinstance(v, tuple) else (v, "file")) for flag, v in outputs.items() if v is not None}
    ins = [(flag, p, _real(p)) for flag, p in _flatten(inputs or {}) if p.exists()]
    for flag, (path, _kind) in given.items():
        out = _real(path)
        for in_flag, given_in, inp in ins:
            if out == inp:
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
                raise UserError(f"{flag} {path} {'is' if trace == out else 'lies inside'} the Trace directory "
                                f"{trace}: writing there would corrupt the Trace; choose another {flag}")
    for flag, (path, kind) in given.items():
        check_creatable(path, flag, kind)


def check_creatable(path: PathLike, what: str = "--out", kind: str = "file") -> Path:
    """Refuse an output ``path`` (``kind`` file or dir) that cannot be written: of the other kind, below a regular
    file, or in a directory where no file can be created, found by creating (and removing at once) a probe file in
    the nearest existing directory, since ``os.access`` says yes to everything for root. Leaves nothing behind."""
    import tempfile

    path = Path(path)
    absolute = Path(os.path.abspath(path))
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
