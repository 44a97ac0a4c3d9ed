"""The one lazy-export helper of the stage packages: a package's ``__init__`` names what it exports and where each
name lives, and the module holding it is imported on first use. torch, transformers, polars and matplotlib take
seconds to import, and the CLI checks its arguments before any of them loads."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, home: dict[str, str], first: str | None = None) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: ``home`` maps each exported name to the module that defines it
    (a bare name is a submodule of ``package``); ``first``, when given, is a module imported before any of them
    (``kvdiag.scorers.zoo``: the registry is full before a name is handed out)."""

    def __getattr__(name: str):
        if name in home:
            if first is not None:
                importlib.import_module(first)
            where = home[name]
            return getattr(importlib.import_module(where if "." in where else f"{package}.{where}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
