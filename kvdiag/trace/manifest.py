"""A Trace directory's manifest and token table, read and checked without torch (``kvdiag.trace.Trace`` opens
them through this, and the CLI checks ``--trace`` with it before any heavy import)."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import polars as pl

from kvdiag.contracts import fingerprint
from kvdiag.errors import UserError

MANIFEST_KEYS = ("prompts", "model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "scale")


def read_trace_files(path: str | Path) -> tuple[dict, pl.DataFrame]:
    """(manifest, tokens) of the Trace directory ``path``; a missing, corrupt or truncated one is one ``UserError``
    line naming ``--trace``."""
    path = Path(path)
    manifest_file = path / "manifest.json"
    if not manifest_file.is_file():
        raise UserError(f"--trace {path}: not a Trace directory (no manifest.json); run `kvdiag trace` first")
    try:
        manifest: dict = json.loads(manifest_file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(
            f"--trace {path}: manifest.json is corrupt ({err.msg}); re-run `kvdiag trace`"
        ) from err
    tokens = path / "tokens.parquet"
    if not tokens.is_file():
        raise UserError(f"--trace {path}: tokens.parquet is missing (truncated Trace); re-run `kvdiag trace` "
                        "with the same --out to repair it")
    m = manifest
    missing = [k for k in MANIFEST_KEYS if not isinstance(m, dict) or k not in m]
    if missing or not isinstance(m["prompts"], dict) or not isinstance(m["model"], dict):
        raise UserError(f"--trace {path}: manifest.json is not a kvdiag Trace manifest (missing or malformed: "
                        f"{', '.join(missing) or 'prompts/model'}); re-run `kvdiag trace` into a new directory")
    try:
        tokens_df: pl.DataFrame = pl.read_parquet(tokens)
    except Exception as err:  # polars raises many types for corrupt files
        raise UserError(f"--trace {path}: tokens.parquet is unreadable ({type(err).__name__}); re-run "
                        "`kvdiag trace` with the same --out to rebuild it") from err
    if missing := {"prompt_id", "position", "token_id"} - set(tokens_df.columns):
        raise UserError(f"--trace {path}: tokens.parquet lacks the column(s) {', '.join(sorted(missing))}; "
                        "the Trace is corrupt")
    return manifest, tokens_df


class TraceFiles:
    """A Trace directory's manifest and token table, read without torch: enough to tell which Trace a table was made
    from (``kvdiag.contracts.belongs`` takes this or a ``kvdiag.trace.Trace``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest, self.tokens = read_trace_files(self.path)

    @cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.manifest, self.tokens)
