"""Deprecated module paths: the loose modules that moved into packages (the layout of 0.2) still import under
their old names, with a ``DeprecationWarning`` naming the new one, so that plugins written against the old layout
keep working. ``kvdiag/__init__.py`` installs the finder; new code imports the new paths."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> where it lives now
MOVED = {
    "kvdiag.errors": "kvdiag.core.errors",
    "kvdiag.io": "kvdiag.core.io",
    "kvdiag.parsing": "kvdiag.core.parsing",
    "kvdiag.schema": "kvdiag.core.schema",
    "kvdiag.stats": "kvdiag.core.stats",
    "kvdiag.tables": "kvdiag.core.tables",
    "kvdiag.registry": "kvdiag.core.registry",
    "kvdiag.progress": "kvdiag.core.progress",
    "kvdiag.provenance": "kvdiag.core.provenance",
    "kvdiag.guard": "kvdiag.core.guard",
    "kvdiag.contracts": "kvdiag.core.contracts",
    "kvdiag.parts": "kvdiag.core.parts",
    "kvdiag.plotting": "kvdiag.core.plotting",
    "kvdiag.allocator": "kvdiag.core.allocator",
    "kvdiag.run_layout": "kvdiag.core.run_layout",
    "kvdiag.distributed": "kvdiag.core.distributed",
    "kvdiag.harm": "kvdiag.core.harm",
    "kvdiag.selection": "kvdiag.core.selection",
    "kvdiag.models": "kvdiag.model.load",
    "kvdiag.model_specs": "kvdiag.model.specs",
    "kvdiag.adapters": "kvdiag.model.adapters",
    "kvdiag.families": "kvdiag.model.families",
    "kvdiag.attention": "kvdiag.model.attention",
    "kvdiag.embedded": "kvdiag.model.embedded",
    "kvdiag.token_count": "kvdiag.model.token_count",
    "kvdiag.peak": "kvdiag.kernels.peak",
    "kvdiag.prompts": "kvdiag.tasks.prompts",
    "kvdiag.suites": "kvdiag.tasks.suites",
    "kvdiag.needed": "kvdiag.tasks.needed",
    "kvdiag.scorer_names": "kvdiag.scorers.names",
    "kvdiag.scorer_fields": "kvdiag.scorers.fields",
    "kvdiag.plugin_check": "kvdiag.scorers.plugin_check",
    "kvdiag.features": "kvdiag.scorers.features",
    "kvdiag.token_features": "kvdiag.scorers.token_features",
    "kvdiag.grade": "kvdiag.grade.run",
    "kvdiag.benchmark": "kvdiag.grade.benchmark",
    "kvdiag.report": "kvdiag.report.run",
    "kvdiag.viewer": "kvdiag.report.viewer",
    "kvdiag.gpu_check": "kvdiag.bench.gpu_check",
    "kvdiag.scale": "kvdiag.bench.scale",
    "kvdiag.kvpress_export": "kvdiag.generate.kvpress_export",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of :data:`MOVED` and hands out the new module itself (one module object, two names)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import it from there", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        """Nothing to run: the new module is already imported."""


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
