"""``kvdiag decisions``: grade the decision, not only the ranking. A deployed rule evicts a *set* under a budget;
its damage is not the sum of single labels. For every (prompt, checkpoint, rule, budget) this labels the rule's
evicted set exactly (one set row of the oracle engine) and compares it with reference decisions (the exact single
labels' set, a greedy joint oracle, the Fisher labels' set, random).

Flat API::

    from kvdiag.decisions import DecisionsConfig, Budget, budgets_from, decide, decisions_files, summarize

Modules: ``config`` (settings, budgets), ``sets`` (every decision's evicted set), ``run`` (the work items and their
parts), ``interactions`` (superadditive pairs), ``summary`` (means, CIs, paired tests, Spearman, figure).
"""

from kvdiag.decisions.config import REFERENCES, Budget, DecisionsConfig, budgets_from
from kvdiag.decisions.run import DECISION_SCHEMA, decide, decisions_files
from kvdiag.decisions.summary import load_summary, summarize, summarize_files

__all__ = ["DECISION_SCHEMA", "REFERENCES", "Budget", "DecisionsConfig", "budgets_from", "decide", "decisions_files",
           "load_summary", "summarize", "summarize_files"]
