"""The Trace: recorded post-RoPE q/k/v of whole reasoning traces (writer, reader, hooks).

    from kvdiag.trace import GenerationSettings, Trace, trace_prompts
"""

from __future__ import annotations

import importlib

from kvdiag.trace.settings import GenerationSettings

# the submodule that defines each exported name
_HOME = {"LayerQKV": "reader", "Trace": "reader", "trace_prompts": "writer"}
__all__ = ["GenerationSettings", *_HOME]


def __getattr__(name: str):
    """Everything but GenerationSettings loads on first use: torch and transformers take seconds to import, and the
    CLI checks its arguments (GenerationSettings) before."""
    if name in _HOME:
        return getattr(importlib.import_module(f"kvdiag.trace.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
