"""kvdiag: counterfactual oracle labels and diagnostics for KV-cache eviction in long chain-of-thought."""

__version__ = "0.1.0"
