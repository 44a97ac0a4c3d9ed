"""``kvdiag decisions``: grade the decision, not only the ranking. A deployed rule evicts a *set* under a budget;
its damage is not the sum of single labels. For every (prompt, checkpoint, rule, budget) this labels the rule's
evicted set exactly (one set row of the oracle engine) and compares it with reference decisions (the exact single
labels' set, a greedy joint oracle, the Fisher labels' set, random).

Flat API::

    from kvdiag.decisions import DecisionsConfig, Budget, budgets_from, decide, decisions_files, summarize

Modules: ``config`` (settings, budgets), ``sets`` (every decision's evicted set), ``search`` (``oracle_search``),
``imported`` (``--search-from``: earlier runs' sets as its candidates), ``run`` (the work items and their parts),
``interactions`` (superadditive pairs), ``summary`` (means, CIs, paired tests, Spearman, figure).
"""

from __future__ import annotations

from kvdiag.core.lazy import lazy_exports
from kvdiag.decisions.config import REFERENCES, Budget, DecisionsConfig, budgets_from

# the submodule that defines each exported name
_HOME = {"DECISION_SCHEMA": "run", "decide": "run", "decisions_files": "run",
         "load_summary": "summary", "summarize": "summary", "summarize_files": "summary"}
__all__ = ["REFERENCES", "Budget", "DecisionsConfig", "budgets_from", *_HOME]

# The config loads at once, the rest on first use: torch takes seconds to import, and the CLI checks its
# arguments (DecisionsConfig) before.
__getattr__ = lazy_exports(__name__, _HOME)
