"""Run ``kvdiag ARGS`` with a SIGKILL injected at a chosen point (used by tests/test_faults.py).

    python tests/faults.py SPEC -- ARGS...

SPEC is ``none`` or ``KIND:N:WHEN``:
- ``write:N:mid``   the N-th file write (every atomic write and every safetensors file) writes half of its bytes
                    to its temporary name, then the process SIGKILLs itself (nothing is renamed);
- ``write:N:after`` the N-th file write completes, then SIGKILL;
- ``call:N:MODULE.FUNC`` SIGKILL when MODULE.FUNC is called for the N-th time (mid-computation).

Every run also guards the reads: opening (for reading) any file whose name marks it temporary raises,
so a test fails if a temporary file is ever read.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _is_temporary(path) -> bool:
    name = Path(str(path)).name
    return name.endswith(".tmp") or ".tmp" in Path(str(path)).parent.name


def _kill() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _guard_reads() -> None:
    import polars as pl
    import pyarrow.parquet as pq
    import safetensors

    def audit(event, args):
        if event == "open" and args and isinstance(args[0], (str, os.PathLike)):
            path, mode, flags = (*args, None, None)[:3]
            if mode is None:  # os.open: read-only unless a write flag is set
                reading = not (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            else:
                reading = "r" in mode and "+" not in mode
            if reading and _is_temporary(path) and not os.path.isdir(path):
                raise AssertionError(f"a temporary file was read: {path}")

    sys.addaudithook(audit)

    def guarded(fn):
        def wrapper(source, *args, **kwargs):
            if _is_temporary(source):
                raise AssertionError(f"a temporary file was read: {source}")
            return fn(source, *args, **kwargs)
        return wrapper

    pl.read_parquet = guarded(pl.read_parquet)
    pq.read_metadata = guarded(pq.read_metadata)
    safetensors.safe_open = guarded(safetensors.safe_open)
    import kvdiag.trace.reader  # kvdiag.core.io reads through the patched modules (imported on use)

    kvdiag.trace.reader.safe_open = safetensors.safe_open


def _inject(spec: str) -> None:
    kind, n, rest = spec.split(":", 2)
    target = int(n)
    count = 0

    def tick() -> bool:
        nonlocal count
        count += 1
        return count == target

    if kind == "call":
        module, func = rest.rsplit(".", 1)
        mod = importlib.import_module(module)
        original = getattr(mod, func)

        def killing(*args, **kwargs):
            if tick():
                _kill()
            return original(*args, **kwargs)

        setattr(mod, func, killing)
        return

    import kvdiag.core.io
    import kvdiag.trace.writer

    original_atomic, original_save = kvdiag.core.io.write_atomically, kvdiag.trace.writer.save_file

    def half(path) -> None:  # a write cut off half-way
        os.truncate(path, os.path.getsize(path) // 2)

    def atomic(path, write):
        if not tick():
            return original_atomic(path, write)
        if rest == "after":
            original_atomic(path, write)
            _kill()
        tmp = Path(path).parent / f".{Path(path).name}.killed.tmp"  # named like the real temporaries
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write(str(tmp))
        half(tmp)
        _kill()

    def save(tensors, filename, *args, **kwargs):
        original_save(tensors, filename, *args, **kwargs)
        if tick():
            if rest == "mid":
                half(filename)
            _kill()

    kvdiag.core.io.write_atomically = atomic
    kvdiag.trace.writer.save_file = save


def main() -> None:
    spec, sep, *args = sys.argv[1:]
    assert sep == "--", "usage: faults.py SPEC -- ARGS..."
    _guard_reads()
    if spec != "none":
        _inject(spec)
    from kvdiag.cli.main import main as kvdiag_main

    kvdiag_main(args)


if __name__ == "__main__":
    main()
