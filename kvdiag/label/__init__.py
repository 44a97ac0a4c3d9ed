"""The counterfactual oracle: exact, batched single-entry eviction KL labels."""

from __future__ import annotations

import importlib

from kvdiag.label.config import LabelConfig

# the submodule that defines each exported name
_HOME = {"GRANULARITIES": "engine", "OracleEngine": "engine", "Row": "engine", "candidate_rows": "engine",
         "divergences": "engine", "LABEL_SCHEMA": "table", "label_trace": "run", "read_labels": "table",
         "work_items": "run"}
__all__ = ["LabelConfig", *_HOME]


def __getattr__(name: str):
    """The config loads at once, the engine on first use: torch and transformers take seconds to import, and the CLI
    checks its arguments (LabelConfig) before."""
    if name in _HOME:
        return getattr(importlib.import_module(f"kvdiag.label.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
