"""How an output was made: the fields every stage writes into its metadata or config (one definition)."""

from __future__ import annotations

import shlex
import sys
import time

from kvdiag import __version__


def timestamp() -> str:
    """Local time with its UTC offset, e.g. ``2026-12-01T15:04:05+0000``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def command_line() -> str:
    """This process's command line as ``kvdiag ARGS`` (shell-quoted)."""
    return shlex.join(["kvdiag", *sys.argv[1:]])


def provenance(created: bool = False) -> dict:
    """``{"kvdiag_version"}`` and, with ``created``, the time: spread it into an output's metadata where that
    output has always written them (the key order of existing files is kept)."""
    return {"kvdiag_version": __version__, **({"created": timestamp()} if created else {})}
