"""Join kvdiag's rule scores and the kvpress press scores (same labels, same Trace) into one scores table.

usage: python merge_scores.py RULES.parquet PRESSES.parquet OUT.parquet
"""

import sys

from kvdiag.scorers.score import KEY_COLUMNS

from kvdiag.io import read_table, write_table

rules, rules_meta = read_table(sys.argv[1])
presses, presses_meta = read_table(sys.argv[2])
if rules_meta["trace"]["fingerprint"] != presses_meta["trace"]["fingerprint"]:
    sys.exit(f"{sys.argv[1]} and {sys.argv[2]} come from different Traces")
merged = rules.join(presses, on=KEY_COLUMNS, how="inner", maintain_order="left")
assert merged.height == rules.height == presses.height, "the two tables must score the same candidates"
meta = {**rules_meta, "scorers": {**rules_meta["scorers"], **presses_meta["scorers"]},
        "scorer_classes": {**rules_meta.get("scorer_classes", {}), **presses_meta.get("scorer_classes", {})},
        "source": {"merged": [sys.argv[1], sys.argv[2]]}}
write_table(merged, sys.argv[3], meta)
print(f"wrote {merged.height} rows x {len(meta['scorers'])} scorers to {sys.argv[3]}")
