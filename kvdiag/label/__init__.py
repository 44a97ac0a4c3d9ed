"""The counterfactual oracle: exact, batched single-entry eviction KL labels."""

from __future__ import annotations

import importlib

from kvdiag.contracts import LABEL_SCHEMA, read_labels
from kvdiag.label.config import LabelConfig

# the submodule that defines each exported name
_HOME = {"GRANULARITIES": "engine", "OracleEngine": "engine", "Row": "engine", "candidate_rows": "engine",
         "divergences": "engine", "label_trace": "run", "work_items": "config"}
__all__ = ["LABEL_SCHEMA", "LabelConfig", "read_labels", *_HOME]


def __getattr__(name: str):
    """The config loads at once, the engine on first use: torch and transformers take seconds to import, and the CLI
    checks its arguments (LabelConfig) before."""
    if name in _HOME:
        return getattr(importlib.import_module(f"kvdiag.label.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
