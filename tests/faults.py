"""Run ``kvdiag ARGS`` with a SIGKILL injected at a chosen point (used by tests/test_faults.py).

    python tests/faults.py SPEC -- ARGS...

SPEC is ``none`` or ``KIND:N:WHEN``:
- ``write:N:mid``   the N-th file write (every atomic write and every safetensors file) writes half of its bytes
                    to its temporary name, then the process SIGKILLs itself (nothing is renamed);
- ``write:N:after`` the N-th file write completes, then SIGKILL;
- ``call:N:MODULE.FUNC`` SIGKILL when MODULE.FUNC is called for the N-th time (mid-computation).

Every run also guards the reads: opening (for reading) any file whose name marks it temporary raises,
so a test fails if a temporary file is ever read.

    python tests/faults.py --serve

serves such runs (tests/test_faults.py starts it): it imports the third-party modules every run imports (``PRELOAD``:
torch, transformers, ...; never kvdiag), then reads one JSON request a line on stdin (``spec``, ``args``, ``cwd``,
``env``, ``stdout``, ``stderr``: files) and runs each in a child forked for it, which does what ``python
tests/faults.py SPEC -- ARGS`` does in that directory and environment (the guard and the injection installed before
kvdiag is imported); it answers one line ``{"returncode": ...}`` (``-9`` for a SIGKILL). A run then starts in ~0.5 s
instead of the ~5 s those imports take.
"""

from __future__ import annotations

import atexit
import importlib
import json
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

    swap = {}  # id(original) -> (original, guarded)
    for owner, attr in ((pl, "read_parquet"), (pq, "read_metadata"), (safetensors, "safe_open")):
        original = getattr(owner, attr)
        setattr(owner, attr, guarded(original))
        swap[id(original)] = (original, getattr(owner, attr))
    # a plain run imports safetensors.torch, transformers, ... after this point, so they bind the guarded functions;
    # under --serve they were imported before it (PRELOAD): where one of them holds an original, it gets the guarded one
    for name in _PRELOADED:
        namespace = getattr(sys.modules.get(name), "__dict__", None)
        for key, value in list(namespace.items()) if isinstance(namespace, dict) else ():
            if id(value) in swap and value is swap[id(value)][0]:
                namespace[key] = swap[id(value)][1]
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


_PRELOADED: list[str] = []  # the modules --serve imported before its first run (none in a plain run)
# what every run imports before it reaches kvdiag's own work (python -X importtime): ~5 s of a run's ~6 s. Not
# polars or pyarrow: they start threads on import, and a fork keeps only the forking one
PRELOAD = (
    "torch", "transformers", "transformers.cache_utils", "transformers.generation", "transformers.masking_utils",
    "transformers.integrations.sdpa_attention", "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama", "scipy.stats", "numpy", "safetensors.torch", "pydantic", "rich.console",
    "rich.progress", "typer", "matplotlib.pyplot",
)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _run_forked(request: dict) -> None:
    """In the forked child: ``python tests/faults.py SPEC -- ARGS`` in the request's directory and environment, its
    output to the request's files; exits as that process would (a SIGKILL stays a SIGKILL)."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], write),
                                (2, request["stderr"], write)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = [__file__, request["spec"], "--", *request["args"]]
        try:
            main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
            if not isinstance(exit_.code, (int, type(None))):
                print(exit_.code, file=sys.stderr)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    before = set(sys.modules)
    for name in PRELOAD:
        importlib.import_module(name)
    _PRELOADED.extend(name for name in list(sys.modules)  # not __mp_main__: multiprocessing's alias of this script
                      if name not in before and not name.startswith("__") and sys.modules[name] is not None)
    assert not any(name.split(".")[0] in ("kvdiag", "tests") for name in _PRELOADED), "kvdiag must load in the run"
    for line in sys.stdin:
        request = json.loads(line)
        if _threads() != 1:  # never fork a process that runs other threads (their locks would stay held)
            print(json.dumps({"error": f"{_threads()} threads: cannot fork safely"}), flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            _run_forked(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["--serve"] else main()
