"""The counterfactual oracle: exact, batched single-entry eviction KL labels."""

from kvdiag.contracts import LABEL_SCHEMA, read_labels
from kvdiag.label.engine import GRANULARITIES, OracleEngine, Row, candidate_rows, divergences
from kvdiag.label.run import LabelConfig, label_trace, work_items

__all__ = ["GRANULARITIES", "LABEL_SCHEMA", "LabelConfig", "OracleEngine", "Row", "candidate_rows", "divergences",
           "label_trace", "read_labels", "work_items"]
