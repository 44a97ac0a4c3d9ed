"""The counterfactual oracle: exact, batched single-entry eviction KL labels."""

from __future__ import annotations

from kvdiag.core.lazy import lazy_exports
from kvdiag.label.config import LabelConfig

# the module that defines each exported name (kvdiag.core.contracts: polars and pyarrow, loaded on use)
_HOME = {"LABEL_SCHEMA": "kvdiag.core.contracts", "read_labels": "kvdiag.core.contracts", "GRANULARITIES": "engine",
         "OracleEngine": "engine", "Row": "engine", "candidate_rows": "engine", "divergences": "engine",
         "label_trace": "run", "work_items": "config"}
__all__ = ["LabelConfig", *_HOME]

# The config loads at once, the rest on first use: torch and transformers take seconds to import (polars and
# pyarrow a fraction of one), and the CLI checks its arguments (LabelConfig) before.
__getattr__ = lazy_exports(__name__, _HOME)
