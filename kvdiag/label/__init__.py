"""The counterfactual oracle: exact, batched single-entry eviction KL labels."""

from __future__ import annotations

import importlib

from kvdiag.label.config import LabelConfig

# the module that defines each exported name (kvdiag.contracts: polars and pyarrow, loaded on use)
_HOME = {"LABEL_SCHEMA": "kvdiag.contracts", "read_labels": "kvdiag.contracts", "GRANULARITIES": "engine",
         "OracleEngine": "engine", "Row": "engine", "candidate_rows": "engine", "divergences": "engine",
         "label_trace": "run", "work_items": "config"}
__all__ = ["LabelConfig", *_HOME]


def __getattr__(name: str):
    """The config loads at once, the rest on first use: torch and transformers take seconds to import (polars and
    pyarrow a fraction of one), and the CLI checks its arguments (LabelConfig) before."""
    if name in _HOME:
        home = _HOME[name]
        return getattr(importlib.import_module(home if "." in home else f"kvdiag.label.{home}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
