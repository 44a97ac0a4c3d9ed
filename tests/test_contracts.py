"""The input contracts read without torch (#40): the Trace fingerprint from its files, a --model against the Trace's
recorded model from names and configs, a model's context from its config, and the generations contract."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import polars as pl
import pytest

from kvdiag.core.contracts import read_generations, same_trace
from kvdiag.core.errors import UserError
from kvdiag.core.io import write_table
from kvdiag.model.specs import EMBEDDED_CONFIG, check_trace_model, context_of, spec_config

REPORTS = Path(__file__).resolve().parents[1] / "reports"


def test_the_light_fingerprint_is_the_traces(tiny_trace):
    """TraceFiles (manifest + tokens, no torch) gives the fingerprint Trace gives and every table records: sha256 of
    the weights hash, then each prompt's name and int64 token ids, prompts in name order (the definition as written
    before it moved to kvdiag.trace.manifest.TraceFiles)."""
    from kvdiag.trace.manifest import TraceFiles

    h = hashlib.sha256(tiny_trace.manifest["model"]["weights_hash"].encode())
    for pid in sorted(tiny_trace.prompt_ids):
        h.update(pid.encode())
        h.update(tiny_trace.token_ids(pid).numpy().tobytes())
    assert TraceFiles(tiny_trace.path).fingerprint == tiny_trace.fingerprint == h.hexdigest()[:16]


def test_the_shipped_benchmarks_tables_belong_to_its_trace():
    """The fingerprint read light matches what the shipped benchmark's labels and references record."""
    from kvdiag.core.contracts import belongs
    from kvdiag.core.io import check_table
    from kvdiag.trace.manifest import TraceFiles

    bench = Path(__file__).resolve().parents[1] / "data" / "kvdiag-bench" / "math500-smollm2@1"
    tf = TraceFiles(bench / "trace")
    for name in ("labels.parquet", "references.parquet"):
        belongs(tf, check_table(bench / name), name)


def test_same_trace():
    a, b = {"trace": {"fingerprint": "a" * 16}}, {"trace": {"fingerprint": "b" * 16}}
    assert same_trace({"--exact": a, "--approx": dict(a)}) == "a" * 16
    with pytest.raises(UserError, match="--approx was made from another Trace than --exact"):
        same_trace({"--exact": a, "--approx": b})
    with pytest.raises(UserError, match="--approx does not record the Trace"):
        same_trace({"--exact": a, "--approx": {"kind": "labels"}})


def _config_dir(root: Path, name: str, **fields) -> str:
    (root / name).mkdir()
    (root / name / "config.json").write_text(json.dumps(fields))
    return str(root / name)


TINY_LLAMA = dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096)


def test_another_model_than_the_traces_is_refused_before_it_loads(tmp_path, monkeypatch):
    """--model against the Trace's recorded model: the same name passes; another built-in name, random weights for
    trained ones, a config of another family or shape, a hub id not in the local cache are refused; a directory or a
    cached hub id whose config matches passes (its weights hash is checked once it loads)."""
    import huggingface_hub.constants

    recorded = {"spec": "tiny:llama", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "weights_hash": "0" * 16,
                "attention": {"family": "llama"}}
    check_trace_model("tiny:llama", recorded)
    same = _config_dir(tmp_path, "same", **TINY_LLAMA)
    check_trace_model(same, recorded)
    nested = _config_dir(tmp_path, "nested", model_type="gemma3", text_config=TINY_LLAMA)  # a multimodal config
    check_trace_model(nested, recorded)
    # a composite config whose decoder is nested under another key: not compared (the load tells), never refused
    check_trace_model(_config_dir(tmp_path, "composite", model_type="llava", llm_config=TINY_LLAMA,
                                  vision_config={"hidden_size": 8}), recorded)
    assert spec_config(_config_dir(tmp_path, "quantized", **TINY_LLAMA, quantization_config={"bits": 4})) == {
        **TINY_LLAMA, "quantization_config": {"bits": 4}}
    refused = [
        ("tiny:qwen3", r"is not the Trace's model \(tiny:llama\)"),
        ("smollm2", r"is not the Trace's model \(tiny:llama\)"),
        ("random:llama-3.1-8b", r"is not the Trace's model \(tiny:llama\)"),
        (_config_dir(tmp_path, "layers", **{**TINY_LLAMA, "num_hidden_layers": 30}), "num_hidden_layers 30"),
        (_config_dir(tmp_path, "family", **{**TINY_LLAMA, "model_type": "qwen3"}), "model_type qwen3"),
        (_config_dir(tmp_path, "kv", **{**TINY_LLAMA, "num_key_value_heads": 4}), "num_key_value_heads 4"),
        (str(tmp_path / "absent"), "no such directory"),
        ("kvdiag-test/not-cached", "not in the local Hugging Face cache"),
    ]
    for spec, needle in refused:
        with pytest.raises(UserError, match=needle):
            check_trace_model(spec, recorded)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json is missing or unreadable"):
        check_trace_model(str(tmp_path / "empty"), recorded)
    # a hub id: its config.json from the local cache (a snapshot of the main revision), never the network
    cache = tmp_path / "hub"
    snap = cache / "models--kvdiag-test--cached" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (cache / "models--kvdiag-test--cached" / "refs").mkdir()
    (cache / "models--kvdiag-test--cached" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    (snap / "config.json").write_text(json.dumps(TINY_LLAMA))
    check_trace_model("kvdiag-test/cached", recorded)
    (snap / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_attention_heads": 8}))
    with pytest.raises(UserError, match="num_attention_heads 8"):
        check_trace_model("kvdiag-test/cached", recorded)
    # a trained model's Trace and a hub id that names it: passes by name (the load checks the weights)
    check_trace_model("org/model", {**recorded, "spec": "org/model"})


def test_the_light_configs_are_the_loaded_ones(tiny_llama, tiny_qwen3):
    """spec_config's layer and head counts for tiny models are what the loaded model records; an embedded model's
    fields are its converted config.json's (where this machine has converted it)."""
    from kvdiag.model.embedded import EMBEDDED, converted_dir

    for lm in (tiny_llama, tiny_qwen3):
        cfg, info = spec_config(lm.spec), lm.info
        assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
            info["num_layers"], info["num_heads"], info["num_kv_heads"])
        check_trace_model(lm.spec, info)
    assert context_of("tiny:llama") == tiny_llama.model.config.max_position_embeddings == 4096
    assert set(EMBEDDED_CONFIG) == set(EMBEDDED)
    checked = 0
    for name, fields in EMBEDDED_CONFIG.items():
        d = converted_dir(name)
        if d is None:
            continue
        config = json.loads((d / "config.json").read_text())
        config = config.get("text_config", config)
        assert {k: config[k] for k in fields} == fields, name
        checked += 1
    if not checked:
        pytest.skip("no embedded model is converted on this machine: EMBEDDED_CONFIG not compared")


def test_context_of(tmp_path):
    assert context_of(_config_dir(tmp_path, "d", **{**TINY_LLAMA, "max_position_embeddings": 1024})) == 1024
    assert context_of("random:llama-3.1-8b") is None and context_of("kvdiag-test/not-cached") is None
    assert context_of("smollm2") == 8192


GENERATIONS = pl.DataFrame(
    {"prompt_id": ["p0", "p0", "p1", "p1"], "scorer": ["full_kv", "knorm"] * 2, "budget": [None, 16] * 2,
     "sample": [0] * 4, "mode": ["free"] * 4, "generated": [4] * 4, "compressions": [0, 1] * 2,
     "peak_kv": [12, 16] * 2, "mean_kv": [10.0, 14.0] * 2, "kl_mean": [None, 0.5] * 2, "seconds": [0.1] * 4},
    schema_overrides={"budget": pl.Int64, "kl_mean": pl.Float64})
META = {"kind": "replay", "mode": "free", "settings": {"scorers": ["knorm"]}, "prompt_ids": ["p0", "p1"]}


def test_the_generations_contract(tmp_path):
    """read_generations accepts a replay's table (and every committed one), and refuses each broken copy."""
    assert read_generations(write_table(GENERATIONS, tmp_path / "ok.parquet", META))[0].height == 4
    committed = sorted(REPORTS.glob("*/generations.parquet"))
    assert len(committed) >= 4
    for path in committed:
        assert read_generations(path)[0].height > 0
    first = pl.int_range(pl.len()) == 1
    tf = {**META, "mode": "teacher_forced"}
    cases = [
        ("empty", GENERATIONS.head(0), META, "has no rows"),
        ("columns", GENERATIONS.drop("seconds"), META, "lacks columns"),
        ("type", GENERATIONS.with_columns(pl.col("generated").cast(pl.String)), META,
         r"generated \(String, not Int64\)"),
        ("dup", pl.concat([GENERATIONS, GENERATIONS.tail(1)]), META, "repeat"),
        ("nan", GENERATIONS.with_columns(pl.when(first).then(float("nan")).otherwise("kl_mean").alias("kl_mean")),
         META, "'kl_mean' is NaN or infinite in 1 of 4"),
        ("inf", GENERATIONS.with_columns(seconds=pl.lit(float("inf"))), META, "'seconds' is NaN or infinite"),
        ("null", GENERATIONS.with_columns(pl.when(first).then(None).otherwise("peak_kv").alias("peak_kv")), META,
         "'peak_kv' is missing in 1 of 4"),
        ("budget", GENERATIONS.with_columns(budget=pl.lit(None, pl.Int64)), META, "without a budget"),
        ("nometa", GENERATIONS, {"kind": "replay"}, "does not record the replay"),
        ("prompts", GENERATIONS, {**META, "prompt_ids": ["p0"]}, "prompt 'p1', which its replay did not replay"),
        ("mode", GENERATIONS, tf | {"trace": {"fingerprint": "f" * 16}}, "holds free rows in a teacher_forced"),
        ("tf-trace", GENERATIONS.with_columns(mode=pl.lit("teacher_forced")), tf, "does not record the Trace"),
    ]
    for name, df, meta, needle in cases:
        with pytest.raises(UserError, match=needle):
            read_generations(write_table(df, tmp_path / f"{name}.parquet", meta))


@pytest.mark.parametrize("reader, what", [("read_scores", "--scores"), ("read_labels", "--labels"),
                                          ("read_decisions", "--search-from"), ("read_generations", "--outcomes")])
def test_a_missing_or_unreadable_table_is_named_once(reader, what, tmp_path):
    """The one line names the flag and the path once (it said '--scores PATH PATH does not exist')."""
    import kvdiag.core.contracts as contracts

    (tmp_path / "cut.parquet").write_bytes(b"PAR1 not a table")
    for name, needle in [("missing.parquet", "does not exist"), ("cut.parquet", "is not a readable Parquet file")]:
        path = tmp_path / name
        with pytest.raises(UserError) as err:
            getattr(contracts, reader)(path, what)
        assert str(err.value).startswith(f"{what} {path} {needle}"), str(err.value)
        assert str(err.value).count(str(path)) == 1, str(err.value)
