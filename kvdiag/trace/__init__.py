"""The Trace: recorded post-RoPE q/k/v of whole reasoning traces (writer, reader, hooks).

    from kvdiag.trace import GenerationSettings, Trace, trace_prompts
"""

from __future__ import annotations

from kvdiag.core.lazy import lazy_exports
from kvdiag.trace.config import GenerationSettings

# the submodule that defines each exported name
_HOME = {"LayerQKV": "reader", "Trace": "reader", "trace_prompts": "writer"}
__all__ = ["GenerationSettings", *_HOME]

# Everything but GenerationSettings loads on first use: torch and transformers take seconds to import, and the
# CLI checks its arguments (GenerationSettings) before.
__getattr__ = lazy_exports(__name__, _HOME)
