"""The Trace: recorded post-RoPE q/k/v of whole reasoning traces (writer, reader, hooks)."""

from kvdiag.trace.reader import LayerQKV, Trace
from kvdiag.trace.writer import GenerationSettings, trace_prompts

__all__ = ["GenerationSettings", "LayerQKV", "Trace", "trace_prompts"]
