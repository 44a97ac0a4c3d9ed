"""Which candidates rank-eval evaluates: all of them, an age range, and/or those one rule could evict.

A rule's score is defined on the entries it may evict: its protected sinks, recent windows or delay buffer
all get one shared "kept" score (``kvdiag.scorers.protect``). ``--eligible SCORER`` evaluates every rule on
the entries that SCORER could evict at each checkpoint (``Scorer.protected`` on a full cache), as the
AvoKV-E paper's Table 3 ranks ``S_i(t)`` on its eligible set. Age = checkpoint − position.
"""

from __future__ import annotations

import polars as pl

from kvdiag.core.errors import UserError


def eligible_scorer(name: str, scores_meta: dict | None):
    """The scorer ``name`` with the parameters it was scored with (from the scores file's metadata), or its
    defaults when the metadata does not record it."""
    from kvdiag.scorers import SCORERS, get_scorer
    from kvdiag.scorers.names import check_eligible

    check_eligible(name, SCORERS)
    params = ((scores_meta or {}).get("scorers") or {}).get(name) or {}
    return get_scorer(name, **params)


def filter_candidates(labels: pl.DataFrame, min_age: int | None, max_age: int | None, eligible: str | None,
                      scores_meta: dict | None) -> tuple[pl.DataFrame, str]:
    """The rows of ``labels`` (key columns) inside the candidate set, and the set's description."""
    if min_age is not None and max_age is not None and min_age > max_age:
        raise UserError(f"--min-age {min_age} > --max-age {max_age}: no candidate is left; widen the range")
    age = pl.col("checkpoint") - pl.col("position")
    parts = []
    if min_age is not None:
        labels, parts = labels.filter(age >= min_age), parts + [f"age >= {min_age}"]
    if max_age is not None:
        labels, parts = labels.filter(age <= max_age), parts + [f"age <= {max_age}"]
    if eligible is not None:
        import torch  # not at module level: the CLI imports rank-eval at start-up

        scorer = eligible_scorer(eligible, scores_meta)
        ages = torch.tensor((labels["checkpoint"] - labels["position"]).to_numpy())
        protected = scorer.protected(ages, torch.tensor(labels["position"].to_numpy()))
        labels = labels.filter(pl.Series(~protected.numpy()))
        params = ", ".join(f"{k}={v}" for k, v in scorer.params.items())
        parts.append(f"eligible under {eligible} ({params}): not in its protected sinks, windows or delay buffer")
    if labels.height == 0:
        raise UserError(f"no candidate is left after the filters ({'; '.join(parts)}): loosen "
                        "--min-age/--max-age/--eligible")
    return labels, "; ".join(parts) if parts else "all candidates"
