"""Join kvdiag's rule scores and the kvpress press scores (same labels, same Trace) into one scores table.

usage: python merge_scores.py RULES.parquet PRESSES.parquet OUT.parquet
"""

from __future__ import annotations

import sys

import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.io import read_table, write_table
from kvdiag.core.schema import KEYS


def merge(rules_path: str, presses_path: str) -> tuple[pl.DataFrame, dict]:
    """The rules' and the presses' score columns side by side on the candidates' keys, and the merged metadata."""
    rules, rules_meta = read_table(rules_path, "RULES")
    presses, presses_meta = read_table(presses_path, "PRESSES")
    if rules_meta["trace"]["fingerprint"] != presses_meta["trace"]["fingerprint"]:
        raise UserError(f"{rules_path} and {presses_path} come from different Traces: score one Trace with both")
    merged = rules.join(presses, on=KEYS, how="inner", maintain_order="left")
    if not merged.height == rules.height == presses.height:
        raise UserError(f"{rules_path} ({rules.height} rows) and {presses_path} ({presses.height} rows) share "
                        f"{merged.height} candidates: score the same labels with both")
    meta = {**rules_meta, "scorers": {**rules_meta["scorers"], **presses_meta["scorers"]},
            "scorer_classes": {**rules_meta.get("scorer_classes", {}), **presses_meta.get("scorer_classes", {})},
            "source": {"merged": [rules_path, presses_path]}}
    return merged, meta


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(__doc__)
    merged, meta = merge(argv[0], argv[1])
    write_table(merged, argv[2], meta)
    print(f"wrote {merged.height} rows x {len(meta['scorers'])} scorers to {argv[2]}")


if __name__ == "__main__":
    main(sys.argv[1:])
