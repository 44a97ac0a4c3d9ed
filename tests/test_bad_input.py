"""Bad input, every command: exit 2, one line that names the input (and says what to do), nothing written.

Each case is (command line, a fragment the one line must contain). The command runs in this process
through the console script's ``main``; inputs are a small tiny:llama run made once for the module, and
broken copies of its files. Each case's --out lies in a fresh directory, which must still be absent after.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest

from kvdiag.cli.main import main

ROOT = Path(__file__).resolve().parents[1]

# placeholders in the cases, filled by the fixture: {trace} {labels} {scores} {run} {out} {file} ...
FITS = ["--checkpoints", "every:16", "--w-obs", "8", "--horizon", "4"]  # label settings that fit the tiny Trace
CASES: list[tuple[str, list[str], str]] = [
    # ---- trace
    ("trace-gguf-missing", ["trace", "--model", "/no/such.gguf", "--out", "{out}"], "/no/such.gguf"),
    ("trace-unknown-tiny", ["trace", "--model", "tiny:gpt9", "--out", "{out}"], "tiny:gpt9"),
    ("trace-adapter-missing", ["trace", "--model", "smollm2+/no/such/adapter", "--out", "{out}"], "adapter directory"),
    ("trace-adapter-no-config", ["trace", "--model", "smollm2+{empty_dir}", "--out", "{out}"], "adapter_config.json"),
    ("trace-adapter-not-lora", ["trace", "--model", "smollm2+{adapter_ia3}", "--out", "{out}"], "not a LoRA adapter"),
    ("replay-adapter-pickle", ["replay", "--scorer", "rkv", "--model", "smollm2+{adapter_bin}", "--out", "{out}"],
     "adapter_model.safetensors"),
    ("trace-adapter-not-safetensors", ["trace", "--model", "smollm2+{adapter_garbage}", "--out", "{out}"],
     "not a readable safetensors"),
    ("trace-adapter-other-base", ["trace", "--model", "smollm2+{adapter_gemma}", "--out", "{out}"],
     "made for gemma3-270m"),
    ("replay-adapter-features", ["replay", "--scorer", "rkv", "--model", "smollm2+{adapter_tiny}", "--out", "{out}"],
     "q_proj has 64 in features"),
    ("trace-adapter-layer", ["trace", "--model", "tiny:llama+{adapter_deep}", "--out", "{out}"], "layer 30"),
    (
        "trace-max-new-0", ["trace", "--model", "tiny:llama", "--max-new-tokens", "0", "--out", "{out}"],
        "--max-new-tokens 0",
    ),
    ("trace-max-new-type", ["trace", "--max-new-tokens", "many", "--out", "{out}"], "--max-new-tokens"),
    (
        "trace-prompts-missing", ["trace", "--model", "tiny:llama", "--prompts", "/no/such.jsonl", "--out", "{out}"],
        "/no/such.jsonl",
    ),
    (
        "trace-prompts-empty", ["trace", "--model", "tiny:llama", "--prompts", "{empty_jsonl}", "--out", "{out}"],
        "empty.jsonl",
    ),
    (
        "trace-prompts-bad-line", ["trace", "--model", "tiny:llama", "--prompts", "{bad_jsonl}", "--out", "{out}"],
        "line 2",
    ),
    ("trace-builtin-unknown", ["trace", "--prompts", "builtin:nope", "--out", "{out}"], "builtin:nope"),
    ("trace-limit-0", ["trace", "--model", "tiny:llama", "--limit", "0", "--out", "{out}"], "--limit 0"),
    (
        "trace-storage-dtype", ["trace", "--model", "tiny:llama", "--storage-dtype", "int8", "--out", "{out}"],
        "--storage-dtype int8",
    ),
    ("trace-dtype", ["trace", "--model", "tiny:llama", "--dtype", "float8", "--out", "{out}"], "--dtype"),
    ("trace-device", ["trace", "--model", "tiny:llama", "--device", "tpu", "--out", "{out}"], "--device"),
    ("trace-shard", ["trace", "--model", "tiny:llama", "--shard", "3/2", "--out", "{out}"], "--shard 3/2"),
    ("trace-out-below-file", ["trace", "--model", "tiny:llama", "--out", "{file}/t"], "--out"),
    (
        "trace-instruction-conflict", ["trace", "--instruction", "x", "--no-instruction", "--out", "{out}"],
        "--instruction",
    ),
    ("trace-repeated-limit", ["trace", "--limit", "1", "--limit", "2", "--out", "{out}"], "--limit"),
    ("trace-sample-and-greedy", ["trace", "--sample", "--greedy", "--out", "{out}"], "--greedy"),
    ("trace-temperature-greedy", ["trace", "--temperature", "0.7", "--out", "{out}"], "--temperature"),
    ("trace-temperature-0", ["trace", "--sample", "--temperature", "0", "--out", "{out}"], "--temperature 0"),
    ("trace-top-p", ["trace", "--sample", "--top-p", "1.5", "--out", "{out}"], "--top-p 1.5"),
    (
        "trace-min-new-tokens", ["trace", "--max-new-tokens", "8", "--min-new-tokens", "9", "--out", "{out}"],
        "--min-new-tokens 9",
    ),
    (
        "trace-beyond-context",
        ["trace", "--model", "tiny:llama", "--max-new-tokens", "5000", "--no-chat", "--out", "{out}"],
        "context of 4096",
    ),
    ("trace-unknown-option", ["trace", "--temprature", "1", "--out", "{out}"], "--temprature"),
    ("trace-store-bad", ["trace", "--model", "tiny:llama", "--store", "some", "--out", "{out}"], "--store some"),
    ("trace-store-negative", ["trace", "--model", "tiny:llama", "--store", "-1", "--out", "{out}"], "--store -1"),
    ("trace-store-twice", ["trace", "--model", "tiny:llama", "--store", "0,0", "--out", "{out}"], "--store 0,0"),
    (
        "trace-store-beyond", ["trace", "--model", "tiny:llama", "--store", "0,9", "--out", "{out}"],
        "layer 9 does not exist",
    ),
    # ---- label
    (
        "label-candidates", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--candidates", "foo"],
        "--candidates foo",
    ),
    (
        "label-include-missing",
        ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--include", "{out}/none.json"],
        "no such file",
    ),
    (
        "label-include-shape",
        ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--include", "{include_shape}"],
        "must map each prompt id to a list of token positions",
    ),
    (
        "label-include-unknown",
        ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--include", "{include_unknown}"],
        "--include: prompt nope is not in the Trace",
    ),
    (
        "label-include-beyond",
        ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--include", "{include_beyond}"],
        "is past its end",
    ),
    (
        "label-batch-size", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--batch-size", "0"],
        "--batch-size 0",
    ),
    ("label-horizon-0", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--horizon", "0"], "--horizon 0"),
    (
        "label-horizon-long", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--horizon", "100000"],
        "--horizon 100000",
    ),
    (
        "label-granularity",
        ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--granularity", "neuron"],
        "--granularity neuron",
    ),
    (
        "label-every-0", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--checkpoints", "every:0"],
        "--checkpoints every:0",
    ),
    (
        "label-checkpoints-text", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--checkpoints", "soon"],
        "--checkpoints soon",
    ),
    (
        "label-checkpoint-outside",
        ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--checkpoints", "100000"], "--checkpoints",
    ),
    (
        "label-layers-range",
        ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--granularity", "layer", "--layers", "7"],
        "--layers 7",
    ),
    (
        "label-layers-token", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--layers", "0"],
        "--layers",
    ),
    (
        "label-layers-type",
        ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--granularity", "layer", "--layers", "a"],
        "--layers",
    ),
    (
        "label-backend", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--backend", "cuda"],
        "--backend cuda",
    ),
    (
        "label-shard", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--shard", "1/1"],
        "--shard 1/1",
    ),
    (
        "label-dtype", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--dtype", "half-ish"],
        "--dtype",
    ),
    ("label-trace-missing", ["label", "--trace", "/no/trace", "--out", "{out}/l.parquet"], "/no/trace"),
    (
        "label-manifest-corrupt", ["label", "--trace", "{trace_bad_manifest}", "--out", "{out}/l.parquet"],
        "manifest.json",
    ),
    (
        "label-manifest-wrong-type", ["label", "--trace", "{trace_list_manifest}", "--out", "{out}/l.parquet"],
        "manifest.json",
    ),
    (
        "label-tokens-truncated", ["label", "--trace", "{trace_bad_tokens}", "--out", "{out}/l.parquet"],
        "tokens.parquet",
    ),
    *[(f"{command}-manifest-{name}", [command, "--trace", f"{{trace_edited_{name}}}", "--checkpoints", "every:16",
                                        "--out", "{out}/x.parquet"], needle)
      for name, needle in [("layers", "(malformed: num_layers '30')"), ("heads", "(malformed: num_kv_heads 0)"),
                           ("length", "its prompt_len and length"),
                           ("tokens", "tokens.parquet holds"), ("dtype", "(malformed: storage_dtype 'float99')"),
                           ("format", "format_version 999 (this kvdiag reads up to 1)"),
                           ("lscale", "(malformed: model.attention.layers[0].scale 'x')"),
                           ("lwindow", "(malformed: model.attention.layers[0].window -5)"),
                           ("lsinks", "(malformed: model.attention.layers[0].sinks (not"),
                           ("store", "(malformed: store (its mode")]
      for command in ("label", "score")],
    *[(f"{command}-tokens-{name}", [command, "--trace", f"{{trace_tokens_{name}}}", "--checkpoints", "every:16",
                                     "--out", "{out}/x.parquet"], needle)
      for name, needle in [("text", "holds token_id (String) where integers belong"),
                           ("negative", "holds token id -7 in prompt"),
                           ("beyond", "holds token id 1000000, beyond the vocabulary of its model"),
                           ("null", "holds empty (null) token_id"), ("stranger", "tokens of prompt 'zzz', which"),
                           ("position", "positions where manifest.json says")]
      for command in ("label", "score")],
    ("label-out-below-file", ["label", "--trace", "{trace}", *FITS, "--out", "{file}/l.parquet"], "--out"),
    (
        "label-other-model",
        ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--model", "tiny:qwen3"],
        "--model tiny:qwen3",
    ),
    (
        "label-force-without-model", ["label", "--trace", "{trace}", *FITS, "--force", "--out", "{out}/l.parquet"],
        "--force",
    ),
    (
        "label-repeated-horizon",
        ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--horizon", "4", "--horizon", "8"], "--horizon",
    ),
    (
        "label-method-unknown", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method", "guess"],
        "--method guess",
    ),
    (
        "label-samples-0",
        ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method", "fast", "--samples", "0"],
        "--fisher-samples 0",
    ),
    (
        "label-samples-exact", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--samples", "4"],
        "--method exact",
    ),
    ("label-miss-rate-range", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method", "hybrid",
                               "--exact-frac", "0.1", "--miss-rate", "1.5"], "--miss-rate 1.5"),
    ("label-miss-rate-0", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method", "hybrid",
                           "--exact-frac", "0.1", "--miss-rate", "0"], "--miss-rate 0"),
    ("label-miss-rate-not-hybrid", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method",
                                    "fast", "--miss-rate", "0.05"],
     "--miss-rate does not apply without --method hybrid"),
    ("label-miss-rate-audit-small", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method",
                                     "hybrid", "--exact-frac", "0.1", "--miss-rate", "0.9", "--audit", "1"],
     "--audit 1: bounding a miss rate of 0.9 needs"),
    ("label-miss-rate-unreachable", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method",
                                     "hybrid", "--exact-frac", "0.1", "--miss-rate", "0.05", "--audit", "8"],
     "more than the"),
    ("label-miss-rate-exact-top", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method",
                                   "hybrid", "--exact-top", "4", "--miss-rate", "0.5"], "--exact-frac"),
    ("label-miss-rate-no-estimate", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method",
                                     "hybrid", "--exact-frac", "0.1", "--miss-rate", "0.5", "--no-miss-rate"],
     "--miss-rate 0.5 with --no-miss-rate"),
    ("label-miss-rate-shard", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method", "hybrid",
                               "--exact-frac", "0.1", "--miss-rate", "0.5", "--shard", "0/2"],
     "--shard with --miss-rate"),
    # ---- bench scale
    ("bench-scale-lengths", ["bench", "scale", "--lengths", "many", "--out", "{out}"], "--lengths many"),
    ("bench-scale-store", ["bench", "scale", "--store", "some", "--out", "{out}"], "--store some"),
    (
        "bench-scale-store-twice", ["bench", "scale", "--store", "all", "--store", "all", "--out", "{out}"],
        "--store all,all",
    ),
    (
        "bench-scale-too-short", ["bench", "scale", "--model", "tiny:llama", "--lengths", "50", "--out", "{out}"],
        "--lengths 50",
    ),
    (
        "bench-scale-beyond-context",
        ["bench", "scale", "--model", "tiny:llama", "--lengths", "9000", "--out", "{out}"], "--lengths 9000",
    ),
    # ---- validate-labels
    (
        "validate-labels-quantile",
        [
            "validate-labels", "--exact", "{labels}", "--approx", "{labels}", "--harmful-quantile", "1.5", "--out",
            "{out}",
        ],
        "--harmful-quantile 1.5",
    ),
    (
        "validate-labels-top-k",
        ["validate-labels", "--exact", "{labels}", "--approx", "{labels}", "--top-k", "0", "--out", "{out}"],
        "--top-k 0",
    ),
    (
        "validate-labels-missing",
        ["validate-labels", "--exact", "/no/l.parquet", "--approx", "{labels}", "--out", "{out}"], "/no/l.parquet",
    ),
    (
        "validate-labels-garbage",
        ["validate-labels", "--exact", "{labels}", "--approx", "{garbage_parquet}", "--out", "{out}"],
        "garbage.parquet",
    ),
    (
        "validate-labels-scores-column",
        [
            "validate-labels", "--exact", "{labels}", "--approx", "{labels}", "--scores", "{scores}", "--payload",
            "nope", "--out", "{out}",
        ],
        "nope",
    ),
    # ---- score
    ("score-no-source", ["score", "--trace", "{trace}", "--out", "{out}/s.parquet"], "--labels"),
    (
        "score-granularity-with-labels",
        ["score", "--trace", "{trace}", "--labels", "{labels}", "--granularity", "neuron", "--out", "{out}/s.parquet"],
        "--granularity",
    ),
    (
        "score-granularity-unknown",
        [
            "score", "--trace", "{trace}", "--checkpoints", "default", "--granularity", "neuron", "--out",
            "{out}/s.parquet",
        ],
        "--granularity",
    ),
    (
        "score-labels-missing",
        ["score", "--trace", "{trace}", "--labels", "/no/l.parquet", "--out", "{out}/s.parquet"], "/no/l.parquet",
    ),
    (
        "score-labels-garbage",
        ["score", "--trace", "{trace}", "--labels", "{garbage_parquet}", "--out", "{out}/s.parquet"], "garbage.parquet",
    ),
    (
        "score-labels-truncated",
        ["score", "--trace", "{trace}", "--labels", "{truncated_labels}", "--out", "{out}/s.parquet"],
        "truncated.parquet",
    ),
    (
        "score-labels-no-keys",
        ["score", "--trace", "{trace}", "--labels", "{keyless_parquet}", "--out", "{out}/s.parquet"], "keyless.parquet",
    ),
    (
        "score-labels-other-trace",
        ["score", "--trace", "{trace}", "--labels", "{foreign_labels}", "--out", "{out}/s.parquet"], "foreign.parquet",
    ),
    (
        "score-scorer-unknown",
        ["score", "--trace", "{trace}", "--labels", "{labels}", "--scorers", "nope", "--out", "{out}/s.parquet"],
        "nope",
    ),
    (
        "score-param-unknown",
        [
            "score", "--trace", "{trace}", "--labels", "{labels}", "--scorers", "rkv", "--param", "rkv.nope=1", "--out",
            "{out}/s.parquet",
        ],
        "nope",
    ),
    (
        "score-param-syntax",
        ["score", "--trace", "{trace}", "--labels", "{labels}", "--param", "rkv", "--out", "{out}/s.parquet"],
        "--param",
    ),
    (
        "score-param-type",
        [
            "score", "--trace", "{trace}", "--labels", "{labels}", "--scorers", "rkv", "--param", "rkv.mix_lambda=lots",
            "--out", "{out}/s.parquet",
        ],
        "mix_lambda",
    ),
    (
        "score-aggregation",
        ["score", "--trace", "{trace}", "--labels", "{labels}", "--aggregation", "median", "--out", "{out}/s.parquet"],
        "--aggregation",
    ),
    (
        "score-checkpoint-0", ["score", "--trace", "{trace}", "--checkpoints", "0", "--out", "{out}/s.parquet"],
        "checkpoint 0",
    ),
    (
        "score-safetensors-truncated",
        ["score", "--trace", "{trace_bad_layer}", "--checkpoints", "20", "--out", "{out}/s.parquet"],
        "layer_000.safetensors",
    ),
    (
        "score-plugin-missing",
        [
            "score", "--trace", "{trace}", "--labels", "{labels}", "--plugin", "/no/plugin.py", "--out",
            "{out}/s.parquet",
        ],
        "/no/plugin.py",
    ),
    (
        "score-fitted-missing",
        [
            "score", "--trace", "{trace}", "--labels", "{labels}", "--scorers", "fitted:/no/model.json", "--out",
            "{out}/s.parquet",
        ],
        "/no/model.json",
    ),
    (
        "score-fitted-no-model",
        ["score", "--trace", "{trace}", "--labels", "{labels}", "--scorers", "fitted", "--out", "{out}/s.parquet"],
        "fitted",
    ),
    (
        "fit-features", ["fit", "--trace", "{trace}", "--labels", "{labels}", "--features", "nope", "--out", "{out}"],
        "--features nope",
    ),
    ("fit-folds", ["fit", "--trace", "{trace}", "--labels", "{labels}", "--folds", "1", "--out", "{out}"], "--folds 1"),
    ("fit-harm", ["fit", "--trace", "{trace}", "--labels", "{labels}", "--harm", "lots", "--out", "{out}"], "--harm"),
    (
        "fit-labels-other-trace", ["fit", "--trace", "{trace}", "--labels", "{foreign_labels}", "--out", "{out}"],
        "foreign.parquet",
    ),
    (
        "rank-eval-eligible-unknown",
        ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--eligible", "nope", "--out", "{out}"],
        "--eligible nope",
    ),
    (
        "rank-eval-min-age",
        ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--min-age", "0", "--out", "{out}"],
        "--min-age 0",
    ),
    (
        "rank-eval-rho-grid",
        ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--rho-grid", "0.5,1.5", "--out", "{out}"],
        "--rho-grid",
    ),
    (
        "score-model-unused",
        [
            "score", "--trace", "{trace}", "--labels", "{labels}", "--scorers", "knorm", "--model", "tiny:llama",
            "--out", "{out}/s.parquet",
        ],
        "--model tiny:llama",
    ),
    (
        "score-out-below-file", ["score", "--trace", "{trace}", "--labels", "{labels}", "--out", "{file}/s.parquet"],
        "--out",
    ),
    # ---- rank-eval
    (
        "rank-eval-labels-missing",
        ["rank-eval", "--labels", "/no/l.parquet", "--scores", "{scores}", "--out", "{out}"], "/no/l.parquet",
    ),
    (
        "rank-eval-scores-garbage",
        ["rank-eval", "--labels", "{labels}", "--scores", "{garbage_parquet}", "--out", "{out}"], "garbage.parquet",
    ),
    (
        "rank-eval-harm",
        ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--harm", "lots", "--out", "{out}"], "--harm",
    ),
    (
        "rank-eval-rho", ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--rho", "2", "--out", "{out}"],
        "--rho",
    ),
    (
        "rank-eval-bootstrap",
        ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--bootstrap", "-1", "--out", "{out}"],
        "--bootstrap",
    ),
    (
        "rank-eval-reference",
        ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--reference", "nope", "--out", "{out}"],
        "--reference nope",
    ),
    (
        "rank-eval-scorers",
        ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--scorers", "nope", "--out", "{out}"], "nope",
    ),
    (
        "rank-eval-scope",
        ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--table-scope", "x", "--out", "{out}"],
        "--table-scope",
    ),
    (
        "rank-eval-mismatch", ["rank-eval", "--labels", "{foreign_labels}", "--scores", "{scores}", "--out", "{out}"],
        "trace",
    ),
    (
        "rank-eval-out-below-file", ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--out", "{file}/r"],
        "--out",
    ),
    # ---- figures
    (
        "figures-trace-missing",
        ["figures", "--trace", "/no/trace", "--labels", "{labels}", "--scores", "{scores}", "--out", "{out}"],
        "/no/trace",
    ),
    (
        "figures-labels-garbage",
        ["figures", "--trace", "{trace}", "--labels", "{garbage_parquet}", "--scores", "{scores}", "--out", "{out}"],
        "garbage.parquet",
    ),
    (
        "figures-payload",
        [
            "figures", "--trace", "{trace}", "--labels", "{labels}", "--scores", "{scores}", "--payload", "l7", "--out",
            "{out}",
        ],
        "payload",
    ),
    (
        "figures-rank-eval-dir",
        [
            "figures", "--trace", "{trace}", "--labels", "{labels}", "--scores", "{scores}", "--rank-eval",
            "{empty_dir}", "--out", "{out}",
        ],
        "--rank-eval",
    ),
    (
        "figures-out-below-file",
        ["figures", "--trace", "{trace}", "--labels", "{labels}", "--scores", "{scores}", "--out", "{file}/f"], "--out",
    ),
    # ---- report
    ("report-empty-run", ["report", "--run", "{empty_dir}", "--out", "{out}"], "--run"),
    ("report-out-below-file", ["report", "--run", "{run}", "--out", "{file}/r"], "--out"),
    # ---- replay
    ("replay-budget-0", ["replay", "--scorer", "rkv", "--budget", "0", "--out", "{out}"], "--budget 0"),
    ("replay-budget-text", ["replay", "--scorer", "rkv", "--budget", "big", "--out", "{out}"], "--budget big"),
    (
        "replay-budget-twice", ["replay", "--scorer", "rkv", "--budget", "24", "--budget", "24", "--out", "{out}"],
        "--budget 24,24",
    ),
    ("replay-scorer-unknown", ["replay", "--scorer", "nope", "--out", "{out}"], "nope"),
    ("replay-scorer-needs-history", ["replay", "--scorer", "h2o", "--out", "{out}"], "h2o"),
    ("replay-interval", ["replay", "--scorer", "rkv", "--interval", "0", "--out", "{out}"], "--interval 0"),
    ("replay-selection", ["replay", "--scorer", "rkv", "--selection", "greedy", "--out", "{out}"], "--selection"),
    (
        "replay-tf-prompts",
        ["replay", "--scorer", "rkv", "--teacher-forced", "{trace}", "--prompts", "builtin:arith", "--out", "{out}"],
        "--prompts",
    ),
    (
        "replay-tf-max-new",
        ["replay", "--scorer", "rkv", "--teacher-forced", "{trace}", "--max-new-tokens", "9", "--out", "{out}"],
        "--max-new-tokens",
    ),
    (
        "replay-tf-missing", ["replay", "--scorer", "rkv", "--teacher-forced", "/no/trace", "--out", "{out}"],
        "/no/trace",
    ),
    ("replay-out-below-file", ["replay", "--scorer", "rkv", "--model", "tiny:llama", "--out", "{file}/r"], "--out"),
    ("replay-suite-unknown", ["replay", "--scorer", "rkv", "--prompts", "builtin:nope", "--out", "{out}"],
     "unknown builtin suite 'nope'"),
    # 2 recall prompts counting to 1000 (~21k tokens) exceed tiny:llama's 4096-token context
    ("replay-suite-length", ["replay", "--scorer", "rkv", "--model", "tiny:llama", "--prompts", "builtin:recall:2:1000",
                             "--max-new-tokens", "3000", "--out", "{out}"], "--prompts builtin:recall:2:1000"),
    # the lower bound (48 tokens) passes 100; the random model's byte tokenizer counts the answer exactly, before torch
    ("replay-random-max-new", ["replay", "--scorer", "rkv", "--model", "random:llama-3.1-8b:layers=1", "--prompts",
                               "builtin:recall:2", "--max-new-tokens", "100", "--out", "{out}"],
     "(its expected text, tokenized)"),
    ("replay-dir-max-new", ["replay", "--scorer", "rkv", "--model", "{model_tokenizer}", "--prompts",
                            "builtin:recall:2", "--max-new-tokens", "100", "--out", "{out}"],
     "(its expected text, tokenized)"),
    ("replay-hub-max-new", ["replay", "--scorer", "rkv", "--model", "someone/bytes", "--prompts", "builtin:recall:2",
                            "--max-new-tokens", "100", "--out", "{out}"], "(its expected text, tokenized)"),
    ("replay-samples-greedy", ["replay", "--scorer", "rkv", "--samples", "4", "--out", "{out}"], "needs --temperature"),
    ("replay-top-p-greedy", ["replay", "--scorer", "rkv", "--top-p", "0.9", "--out", "{out}"], "needs --temperature"),
    ("replay-temperature-0", ["replay", "--scorer", "rkv", "--temperature", "0", "--out", "{out}"], "--temperature"),
    ("replay-tf-samples", ["replay", "--scorer", "rkv", "--teacher-forced", "{trace}", "--samples", "2", "--out",
                           "{out}"], "--samples"),
    ("replay-oracle-free", ["replay", "--scorer", "oracle", "--selection", "per-token", "--out", "{out}"],
     "--teacher-forced"),
    ("replay-oracle-per-head", ["replay", "--scorer", "oracle", "--teacher-forced", "{trace}", "--out", "{out}"],
     "--selection per-token"),
    ("replay-oracle-future-free", ["replay", "--scorer", "oracle_future", "--out", "{out}"], "--teacher-forced"),
    ("replay-oracle-future-window-0", ["replay", "--scorer", "oracle_future", "--teacher-forced", "{trace}",
                                       "--param", "oracle_future.window=0", "--out", "{out}"],
     "oracle_future.window=0: the window must reach past the next compression"),
    ("replay-oracle-future-window-short", ["replay", "--scorer", "oracle_future", "--teacher-forced", "{trace}",
                                           "--interval", "16", "--horizon", "8", "--param", "oracle_future.window=23",
                                           "--out", "{out}"], "(--interval 16 + --horizon 8 = 24 queries)"),
    ("replay-oracle-future-window-text", ["replay", "--scorer", "oracle_future", "--teacher-forced", "{trace}",
                                          "--param", "oracle_future.window=all", "--out", "{out}"],
     "a number of future queries"),
    ("replay-oracle-future-param", ["replay", "--scorer", "oracle_future", "--teacher-forced", "{trace}", "--param",
                                    "oracle_future.horizon=8", "--out", "{out}"], "only setting is its window"),
    ("replay-horizon-free", ["replay", "--scorer", "rkv", "--horizon", "8", "--out", "{out}"], "--horizon"),
    ("replay-joint-free", ["replay", "--scorer", "rkv", "--no-joint", "--out", "{out}"], "--joint"),
    ("replay-outcomes-free", ["replay", "--scorer", "rkv", "--outcomes", "{out}", "--out", "{out}"], "--outcomes"),
    ("replay-outcomes-missing", ["replay", "--scorer", "rkv", "--teacher-forced", "{trace}", "--outcomes", "/no/replay",
                                 "--out", "{out}"], "--outcomes /no/replay"),
    ("replay-auroc-free", ["replay", "--scorer", "rkv", "--auroc", "{file}", "{file}", "--out", "{out}"], "--auroc"),
    ("replay-auroc-missing", ["replay", "--scorer", "rkv", "--teacher-forced", "{trace}", "--auroc", "/no/l.parquet",
                              "/no/s.parquet", "--out", "{out}"], "/no/l.parquet"),
    ("replay-batch-0", ["replay", "--scorer", "rkv", "--batch-size", "0", "--out", "{out}"], "--batch-size 0"),
    ("replay-budget-protected", ["replay", "--scorer", "avokv_e", "--model", "tiny:llama", "--budget", "100", "--out",
                                 "{out}"], "--budget 100"),
    # ---- demo and benches
    ("demo-out-below-file", ["demo", "--model", "tiny:llama", "--out", "{file}/d"], "--out"),
    ("bench-kernels-dtype", ["bench", "kernels", "--dtype", "float8"], "--dtype"),
    ("bench-trace-max-new-0", ["bench", "trace", "--max-new-tokens", "0"], "--max-new-tokens 0"),
    ("bench-score-trace-missing", ["bench", "score", "--trace", "/no/trace"], "/no/trace"),
    ("bench-replay-samples-greedy", ["bench", "replay", "--samples", "2"], "needs --temperature"),
    ("bench-replay-param-stray", ["bench", "replay", "--param", "cake.window=8"], "--param cake"),
    ("bench-replay-arm-unknown", ["bench", "replay", "--arms", "alone,fast"], "unknown arm 'fast'"),
    # ---- bench padded (#58): each option's refusal, before torch
    ("bench-padded-rule-unknown", ["bench", "padded", "--rule", "nope"], "--rule: unknown scorer 'nope'"),
    ("bench-padded-rule-history", ["bench", "padded", "--rule", "h2o"], "--rule h2o needs the attention of every"),
    ("bench-padded-rule-all", ["bench", "padded", "--rule", "all"], "--rule all: bench one rule"),
    ("bench-padded-budget-0", ["bench", "padded", "--budget", "0"], "--budget 0"),
    ("bench-padded-budget-protected", ["bench", "padded", "--rule", "streamingllm", "--budget", "2"],
     "--budget 2 is smaller than the 4 entries streamingllm always keeps"),
    ("bench-padded-interval-0", ["bench", "padded", "--interval", "0"], "--interval 0"),
    ("bench-padded-max-new-0", ["bench", "padded", "--max-new-tokens", "0"], "--max-new-tokens 0"),
    ("bench-padded-max-new-context", ["bench", "padded", "--model", "tiny:llama", "--max-new-tokens", "4001"],
     "exceed the model's context of 4096"),
    ("bench-padded-repeats-0", ["bench", "padded", "--repeats", "0"], "--repeats 0"),
    ("bench-padded-repeats-huge", ["bench", "padded", "--repeats", "1001"], "--repeats 1001: must be at most 1,000"),
    ("bench-padded-model", ["bench", "padded", "--model", "tiny:gpt9"], "tiny:gpt9"),
    ("bench-padded-out-proc", ["bench", "padded", "--out", "/proc/kvdiag.json"], "/proc is not writable"),
    ("bench-padded-out-empty", ["bench", "padded", "--out", ""], "--out is empty"),
    ("bench-label-repeated", ["bench", "label", "--n", "4", "--n", "8"], "--n"),
    ("bench-label-granularity", ["bench", "label", "--granularity", "neuron"], "--granularity neuron"),
    ("bench-label-method", ["bench", "label", "--method", "guess"], "--method guess"),
    ("bench-label-hybrid-m", ["bench", "label", "--method", "hybrid"], "--exact-frac"),
    ("bench-label-exact-frac", ["bench", "label", "--exact-frac", "0.1"], "--method hybrid"),
    ("bench-label-audit", ["bench", "label", "--method", "hybrid", "--exact-frac", "0.5", "--prefix", "64", "--audit",
                           "40"], "--audit 40"),
    ("bench-label-sets-keep", ["bench", "label", "--sets", "--keep", "1.5"], "--keep 1.5"),
    ("bench-label-sets-method", ["bench", "label", "--sets", "--method", "fast"], "--sets"),
    ("bench-label-out", ["bench", "label", "--out", "{out}"], "--out"),
    # ---- #40: nothing a user owns is overwritten (the output guard, before any work)
    ("decisions-out-is-trace", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5", "--out",
                                "{trace}"], "is the input --trace"),
    ("decisions-out-holds-inputs", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                                    "--out", "{run}"], "contains the input --trace"),
    ("decisions-out-proc", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5", "--out",
                            "/proc/kvdiag-out"], "/proc is not writable"),
    ("score-out-is-labels", ["score", "--trace", "{trace}", "--labels", "{labels}", "--out", "{labels}"],
     "is the input --labels"),
    ("score-out-trace-tokens", ["score", "--trace", "{trace}", "--labels", "{labels}", "--out",
                                "{trace}/tokens.parquet"], "lies inside the input --trace"),
    ("score-out-other-trace", ["score", "--trace", "{trace}", "--labels", "{labels}", "--out",
                               "{trace_bad_layer}/s.parquet"], "lies inside the Trace directory"),
    ("label-out-trace-tokens", ["label", "--trace", "{trace}", "--out", "{trace}/tokens.parquet"],
     "lies inside the input --trace"),
    ("rank-eval-out-is-scores", ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--out", "{scores}"],
     "is the input --scores"),
    ("bench-label-out-below-file", ["bench", "label", "--method", "fast", "--out", "{file}/b.json"], "--out"),
    ("bench-replay-out-proc", ["bench", "replay", "--out", "/proc/kvdiag.json"], "/proc is not writable"),
    # ---- #40: every input's contents are checked (the contracts, before any model loads)
    ("decisions-scores-nan", ["decisions", "--trace", "{trace}", "--scores", "{scores_nan}", "--keep", "0.5", "--out",
                              "{out}"], "null, NaN or infinite"),
    ("decisions-scores-inf", ["decisions", "--trace", "{trace}", "--scores", "{scores_inf}", "--keep", "0.5", "--out",
                              "{out}"], "null, NaN or infinite"),
    ("decisions-scores-null", ["decisions", "--trace", "{trace}", "--scores", "{scores_null}", "--keep", "0.5",
                               "--out", "{out}"], "null, NaN or infinite"),
    ("decisions-scores-dup", ["decisions", "--trace", "{trace}", "--scores", "{scores_dup}", "--keep", "0.5", "--out",
                              "{out}"], "2 times"),
    ("decisions-scores-nometa", ["decisions", "--trace", "{trace}", "--scores", "{scores_nometa}", "--keep", "0.5",
                                 "--out", "{out}"], "does not record the Trace"),
    ("decisions-labels-truncated", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--labels",
                                    "{truncated_labels}", "--keep", "0.5", "--out", "{out}"], "truncated.parquet"),
    ("rank-eval-scores-nan", ["rank-eval", "--labels", "{labels}", "--scores", "{scores_nan}", "--out", "{out}"],
     "null, NaN or infinite"),
    *[(f"{command}-labels-{name}", argv, needle)
      for name, needle in [("text", "columns of another type: kl_mean (String, not Float64)"),
                           ("negative", "column 'kl_mean' is negative in"), ("floor", "'noise_floor' is negative in")]
      for command, argv in [
          ("rank-eval", ["rank-eval", "--labels", f"{{labels_{name}}}", "--scores", "{scores}", "--out", "{out}"]),
          ("figures", ["figures", "--trace", "{trace}", "--labels", f"{{labels_{name}}}", "--scores", "{scores}",
                       "--out", "{out}"]),
          ("fit", ["fit", "--trace", "{trace}", "--labels", f"{{labels_{name}}}", "--out", "{out}"]),
          ("validate", ["validate-labels", "--exact", "{labels}", "--approx", f"{{labels_{name}}}", "--out",
                        "{out}"])]],
    ("fit-labels-horizon", ["fit", "--trace", "{trace}", "--labels", "{labels_horizon}", "--out", "{out}"],
     "column 'horizon' is below 1 in"),
    ("rank-eval-labels-empty", ["rank-eval", "--labels", "{labels_empty}", "--scores", "{scores}", "--out", "{out}"],
     "has no rows"),
    ("rank-eval-noise-mult-inf", ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--noise-mult", "inf",
                                  "--out", "{out}"], "--noise-mult inf"),
    # ---- #40: numbers from the command line are finite, in range and bounded
    ("trace-temperature-inf", ["trace", "--model", "tiny:llama", "--sample", "--temperature", "inf", "--out", "{out}"],
     "--temperature inf"),
    ("replay-temperature-inf", ["replay", "--scorer", "knorm", "--model", "tiny:llama", "--temperature", "inf",
                                "--out", "{out}"], "--temperature inf"),
    ("bench-replay-temperature-inf", ["bench", "replay", "--temperature", "inf"], "--temperature inf"),
    ("replay-builtin-huge", ["replay", "--scorer", "knorm", "--model", "tiny:llama", "--prompts",
                             "builtin:recall:100000000", "--out", "{out}"], "N 100000000"),
    ("bench-label-repeats-0", ["bench", "label", "--repeats", "0"], "--repeats 0"),
    ("bench-label-n-above-prefix", ["bench", "label", "--prefix", "64", "--n", "65"], "--n 65"),
    ("bench-label-prefix-context", ["bench", "label", "--model", "tiny:llama", "--prefix", "5000", "--n", "8"],
     "context of 4096"),
    ("bench-peak-seconds-nan", ["bench", "peak", "--seconds", "nan"], "--seconds nan"),
    ("bench-peak-seconds-inf", ["bench", "peak", "--seconds", "inf"], "--seconds inf"),
    # ---- #40: an option that would do nothing
    ("replay-outcomes-other-prompts", ["replay", "--teacher-forced", "{trace}", "--scorer", "knorm", "--budget", "16",
                                       "--outcomes", "{other_replay}", "--out", "{out}"], "holds no generation"),
    ("bench-label-prefix-0", ["bench", "label", "--prefix", "0"], "--prefix 0"),
    # ---- decisions
    ("decisions-trace-missing", ["decisions", "--trace", "/no/trace", "--scores", "{scores}", "--keep", "0.5", "--out",
                                 "{out}"], "/no/trace"),
    ("decisions-scores-garbage", ["decisions", "--trace", "{trace}", "--scores", "{garbage_parquet}", "--keep", "0.5",
                                  "--out", "{out}"], "garbage.parquet"),
    ("decisions-labels-garbage", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--labels",
                                  "{garbage_parquet}", "--keep", "0.5", "--out", "{out}"], "garbage.parquet"),
    ("decisions-seed", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5", "--seed", "-1",
                        "--out", "{out}"], "--seed"),
    ("decisions-keep", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "1.5", "--out", "{out}"],
     "--keep"),
    ("decisions-no-budget", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--out", "{out}"], "--keep"),
    ("decisions-draws-per-head", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5", "--draws",
                                  "2", "--out", "{out}"], "--draws"),
    ("decisions-draws-0", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5", "--selection",
                           "stochastic", "--draws", "0", "--out", "{out}"], "--draws 0"),
    # the deprecated name is still accepted (and refused the same way); both names at once are refused
    ("decisions-samples-deprecated", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                                      "--samples", "2", "--out", "{out}"], "--draws"),
    ("decisions-draws-and-samples", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                                     "--selection", "stochastic", "--draws", "2", "--samples", "2", "--out", "{out}"],
     "--samples"),
    ("decisions-references", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                              "--references", "nope", "--out", "{out}"], "nope"),
    ("decisions-reference-typo", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                                  "--reference", "nope", "--out", "{out}"], "--reference nope"),
    ("decisions-backend", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5", "--backend",
                           "cuda", "--out", "{out}"], "--backend cuda"),
    ("decisions-infeasible", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                              "--infeasible", "maybe", "--out", "{out}"], "--infeasible"),
    ("decisions-out-below-file", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5", "--out",
                                  "{file}/d"], "--out"),
    # ---- seeds are refused up front (not after the work is written)
    ("label-seed-hybrid", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method", "hybrid",
                           "--exact-frac", "0.5", "--seed", "-1"], "--seed"),
    ("rank-eval-seed", ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--seed", "-1", "--out", "{out}"],
     "--seed"),
    # ---- options that would do nothing
    ("label-audit-no-miss-rate", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method",
                                  "hybrid", "--exact-frac", "0.5", "--audit", "4", "--no-miss-rate"], "--audit 4"),
    ("label-fisher-samples-0", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--method", "fast",
                                "--fisher-samples", "0"], "--fisher-samples 0"),
    ("grade-rule-with-name", ["grade", "knorm", "--rule", "tova", "--out", "{out}"], "--rule tova"),
    ("grade-fitted-missing", ["grade", "fitted:/no/model.json", "--out", "{out}"], "/no/model.json"),
    # ---- #56: a fitted rule's file (unknown feature, wrong shape, an older file), its model family and its
    # training prompts against what each command runs it on
    *[(f"score-fitted-{kind}", ["score", "--trace", "{trace}", "--labels", "{labels}", "--scorers",
                                f"fitted:{{fitted_{kind.replace('-', '_')}}}", "--out", "{out}/s.parquet"], needle)
      for kind, needle in (("unknown-feature", "unknown feature nope"),
                           ("coef-shape", "logistic.coef must hold 2 finite numbers, one per feature; it has 1"),
                           ("tree-outside", "boosted tree 0: node 0 points to node 99, outside the tree"),
                           ("not-a-tree", "boosted tree 0: not a tree"), ("old", "written by an older kvdiag fit"),
                           ("other-family", "trained on tiny:qwen3 (family qwen3); --trace"),
                           ("overlap", "trained on 1 of the 2 prompts of --trace"))],
    ("score-fitted-param-overlap", ["score", "--trace", "{trace}", "--labels", "{labels}", "--scorers", "fitted",
                                    "--param", "fitted.path={fitted_overlap}", "--out", "{out}/s.parquet"],
     "trained on 1 of the 2 prompts"),
    ("replay-fitted-overlap", ["replay", "--scorers", "fitted:{fitted_overlap}", "--teacher-forced", "{trace}",
                               "--out", "{out}"], "trained on 1 of the 2 prompts of --teacher-forced"),
    ("replay-fitted-overlap-free", ["replay", "--scorers", "fitted:{fitted_overlap}", "--model", "tiny:llama",
                                    "--prompts", "builtin:arith", "--limit", "3", "--out", "{out}"],
     "trained on 1 of the 3 prompts of --prompts builtin:arith"),
    ("replay-fitted-other-family", ["replay", "--scorers", "fitted:{fitted_good}", "--model", "tiny:qwen3",
                                    "--limit", "2", "--out", "{out}"],
     "runs tiny:qwen3 (family qwen3): fit the rule on labels of that model"),
    ("grade-fitted-overlap", ["grade", "fitted:{fitted_bench_overlap}", "--out", "{out}"],
     "trained on 1 of the 10 prompts of --bench math500-smollm2@1"),
    ("grade-fitted-other-family", ["grade", "fitted:{fitted_other_family}", "--out", "{out}"],
     "--bench math500-smollm2@1 runs smollm2 (family llama)"),
    ("grade-fitted-tree-outside", ["grade", "fitted:{fitted_tree_outside}", "--out", "{out}"], "outside the tree"),
    ("fit-rule-model", ["fit", "--trace", "{trace}", "--labels", "{labels}", "--rule-model", "forest", "--out",
                        "{out}"], "--rule-model forest: use one of logistic, boosted"),
    ("fit-cell-feature-token-rows", ["fit", "--trace", "{trace}", "--labels", "{labels}", "--features",
                                     "key_norm,cell_layer", "--out", "{out}"], "--features cell_layer: constant within "
                                                                                "a cell"),
    ("grade-horizon-0", ["grade", "knorm", "--horizon", "0", "--out", "{out}"], "--horizon 0"),
    ("grade-horizon-past-trace", ["grade", "knorm", "--horizon", "9", "--out", "{out}"], "--horizon <= 8"),
    # ---- messages: user text is printed as given (no rich markup, no emoji codes); fields named
    ("trace-prompts-markup", ["trace", "--prompts", "[red]x[/red].jsonl", "--out", "{out}"], "[red]x[/red].jsonl"),
    ("trace-tiny-emoji", ["trace", "--model", "tiny:LLAMA", "--out", "{out}"], "tiny:LLAMA"),
    ("trace-prompt-not-string", ["trace", "--prompts", "{number_jsonl}", "--out", "{out}"], "'problem' is a int, not"),
    ("replay-auroc-swapped", ["replay", "--scorer", "rkv", "--model", "tiny:llama", "--teacher-forced", "{trace}",
                              "--auroc", "{scores}", "{labels}", "--out", "{out}"], "--auroc LABELS"),
    # ---- plugins: the author's mistake is bad input naming the file (and line) and the fix
    *[(f"{cmd}-plugin-{kind}", [*base, f"{{plugin_{kind.replace('-', '_')}}}", "--out", out], needle)
      for cmd, base, out in (("score", ["score", "--trace", "{trace}", "--labels", "{labels}", "--plugin"],
                              "{out}/s.parquet"), ("grade", ["grade"], "{out}"))
      for kind, needle in (("old-api", "old_api.py:5) overrides scores()"), ("no-score", "no_score.py:5) defines no"),
                           ("collides", "is taken by"), ("syntax", "syntax.py line 3"),
                           ("import", "import_error.py:2"), ("exits", "exits.py:2"),
                           ("top-raise", "raises at import (raise RuntimeError('not ready') at"))],
    ("score-plugin-raises", ["score", "--trace", "{trace}", "--labels", "{labels}", "--plugin", "{plugin_raises}",
                             "--scorers", "boom", "--out", "{out}/s.parquet"], "raises.py:9"),
    ("score-plugin-returns-list", ["score", "--trace", "{trace}", "--labels", "{labels}", "--plugin",
                                   "{plugin_returns_list}", "--scorers", "listy", "--out", "{out}/s.parquet"],
     "returned a list, not a torch.Tensor"),
    # ---- #40: another --model than the Trace's is refused from names and configs, before anything loads
    ("decisions-model-dir-other", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                                   "--model", "{model_other}", "--out", "{out}"], "num_hidden_layers 30"),
    ("decisions-model-dir-no-config", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                                       "--model", "{empty_dir}", "--out", "{out}"], "config.json"),
    ("decisions-model-hub-uncached", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                                      "--model", "kvdiag-test/no-such-model", "--out", "{out}"],
     "not in the local Hugging Face cache"),
    ("score-model-other", ["score", "--trace", "{trace}", "--labels", "{labels}", "--scorers", "knorm", "--model",
                           "tiny:qwen3", "--out", "{out}/s.parquet"], "--model tiny:qwen3 is not the Trace's model"),
    ("decisions-model-random", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5", "--model",
                                "random:llama-3.1-8b", "--out", "{out}"], "--model random:llama-3.1-8b"),
    # ---- #40: --prefix beyond the model's context, from its config alone
    ("bench-label-prefix-context-dir", ["bench", "label", "--model", "{model_other}", "--prefix", "8190", "--n", "8"],
     "context of 8192"),
    # ---- #40: a table whose Trace cannot be established is refused (every command that has a --trace, and
    # validate-labels, whose tables must share one)
    ("score-labels-nometa", ["score", "--trace", "{trace}", "--labels", "{labels_nometa}", "--out", "{out}/s.parquet"],
     "does not record the Trace"),
    ("fit-labels-nometa", ["fit", "--trace", "{trace}", "--labels", "{labels_nometa}", "--out", "{out}"],
     "does not record the Trace"),
    ("fit-scores-nometa", ["fit", "--trace", "{trace}", "--labels", "{labels}", "--scores", "{scores_nometa}", "--out",
                           "{out}"], "does not record the Trace"),
    ("figures-labels-nometa", ["figures", "--trace", "{trace}", "--labels", "{labels_nometa}", "--scores", "{scores}",
                               "--out", "{out}"], "does not record the Trace"),
    ("figures-scores-nometa", ["figures", "--trace", "{trace}", "--labels", "{labels}", "--scores", "{scores_nometa}",
                               "--out", "{out}"], "does not record the Trace"),
    ("figures-labels-other-trace", ["figures", "--trace", "{trace}", "--labels", "{foreign_labels}", "--scores",
                                    "{scores}", "--out", "{out}"], "another Trace"),
    ("validate-labels-nometa", ["validate-labels", "--exact", "{labels}", "--approx", "{labels_nometa}", "--out",
                                "{out}"], "does not record the Trace"),
    ("validate-labels-other-trace", ["validate-labels", "--exact", "{labels}", "--approx", "{foreign_labels}", "--out",
                                     "{out}"], "another Trace"),
    ("decisions-labels-nometa", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--labels",
                                 "{labels_nometa}", "--keep", "0.5", "--out", "{out}"], "does not record the Trace"),
    ("rank-eval-labels-nometa", ["rank-eval", "--labels", "{labels_nometa}", "--scores", "{scores}", "--out", "{out}"],
     "does not record the Trace"),
    ("rank-eval-scores-nometa", ["rank-eval", "--labels", "{labels}", "--scores", "{scores_nometa}", "--out", "{out}"],
     "does not record the Trace"),
    # ---- #40: the generations contract (replay --outcomes)
    *[(f"replay-outcomes-{kind}", ["replay", "--teacher-forced", "{trace}", "--scorer", "knorm", "--budget", "16",
                                   "--outcomes", f"{{replay_{kind}}}", "--out", "{out}"], needle)
      for kind, needle in (("nan", "NaN or infinite"), ("dup", "repeat"), ("nometa", "does not record the replay"),
                           ("tf", "is a teacher_forced replay"))],
    # ---- #42 long horizons (--horizon 0 and a fixed N past the trace: label-horizon-0, label-horizon-long above)
    ("label-horizon-abc", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--horizon", "abc"],
     "--horizon abc"),
    ("label-horizon-negative", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--horizon", "-3"],
     "--horizon -3"),
    ("label-horizon-past-shortest", ["label", "--trace", "{trace}", *FITS[:4], "--out", "{out}/l.parquet",
                                     "--horizon", "{shortest}"], "reaches beyond the end of prompt"),
    ("label-chunk-0", ["label", "--trace", "{trace}", *FITS, "--out", "{out}/l.parquet", "--chunk", "0"],
     "--chunk 0"),
    ("decisions-horizon-abc", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5", "--horizon",
                               "abc", "--out", "{out}"], "--horizon abc"),
    ("decisions-horizon-0", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5", "--horizon",
                             "0", "--out", "{out}"], "--horizon 0"),
    ("bench-label-chunk-0", ["bench", "label", "--horizon", "64", "--chunk", "0"], "--chunk 0"),
    # ---- decisions' searched references (issue #41)
    ("decisions-search-rows-0", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep", "0.5",
                                 "--references", "oracle_search", "--search-rows", "0", "--out", "{out}"],
     "--search-rows 0"),
    ("decisions-search-seconds-negative", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep",
                                           "0.5", "--references", "oracle_search", "--search-seconds", "-1", "--out",
                                           "{out}"], "--search-seconds -1"),
    ("decisions-future-window-0", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep", "0.5",
                                   "--references", "future_attention", "--future-window", "0", "--out", "{out}"],
     "--future-window 0"),
    ("decisions-future-window-past", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep", "0.5",
                                      "--references", "future_attention", "--future-window", "100000", "--out",
                                      "{out}"], "later tokens"),
    # ---- #54 judged and read windows: the read window inside the judged one, the judged one inside the trace
    ("decisions-read-window-longer", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep", "0.5",
                                      "--horizon", "8", "--read-window", "16", "--out", "{out}"],
     "--read-window 16 is longer than the judged window (--horizon 8)"),
    ("decisions-read-window-rest", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep", "0.5",
                                    "--horizon", "8", "--read-window", "rest", "--out", "{out}"],
     "--read-window rest reads to the end of each prompt, past the judged window"),
    ("decisions-read-window-abc", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep", "0.5",
                                   "--read-window", "abc", "--out", "{out}"], "--read-window abc"),
    ("decisions-horizon-past-trace", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep", "0.5",
                                      "--horizon", "100000", "--out", "{out}"],
     "no checkpoint of the scores file leaves room for --horizon 100000"),
    ("decisions-search-no-head-scores", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                                         "--references", "oracle_search", "--out", "{out}"],
     "oracle_search starts from every rule's set"),
    ("decisions-future-no-queries", ["decisions", "--trace", "{trace_kv}", "--scores", "{head_scores}", "--keep",
                                     "0.5", "--references", "future_attention", "--out", "{out}"],
     "future_attention reads the Trace's stored queries"),
    # ---- builtin suites with components (#43)
    ("replay-component-unknown", ["replay", "--scorer", "rkv", "--prompts", "builtin:recall:2", "--components",
                                  "recalled,countd", "--out", "{out}"], "'countd': builtin:recall has no such"),
    ("replay-components-math", ["replay", "--scorer", "rkv", "--prompts", "builtin:arith:2", "--components",
                                "recalled", "--out", "{out}"], "--components applies to the builtin suites"),
    ("replay-suite-length-tokens", ["replay", "--scorer", "rkv", "--prompts", "builtin:keys:2:3000", "--out", "{out}"],
     "LENGTH 3000 puts builtin:keys's needed value"),
    ("replay-suite-distance", ["replay", "--scorer", "rkv", "--prompts", "builtin:keys:2:100", "--max-new-tokens",
                               "200", "--out", "{out}"], "reads its needed value"),
    ("replay-suite-max-new", ["replay", "--scorer", "rkv", "--prompts", "builtin:recall:2", "--max-new-tokens", "45",
                              "--out", "{out}"], "needs 48 generated tokens"),
    ("replay-suite-max-new-tokenized", ["replay", "--scorer", "rkv", "--model", "tiny:llama", "--prompts",
                                        "builtin:recall:2", "--max-new-tokens", "60", "--out", "{out}"],
     "reads its needed value 123 tokens (its expected text, tokenized)"),
    # ---- #44 sliding windows under a bounded cache (replay and kvdiag.generate share Policy.check_model)
    ("replay-sliding-budget-evicts-nothing", ["replay", "--scorer", "streamingllm", "--model", "tiny:mistral_sw",
                                              "--budget", "7", "--out", "{out}"], "evicts nothing"),
    ("replay-sliding-per-token", ["replay", "--scorer", "rkv", "--model", "tiny:gemma3", "--budget", "32",
                                  "--selection", "per-token", "--out", "{out}"], "per-token keeps one set"),
    # ---- #55 numbers: ASCII digits, every numeric option bounded (kvdiag.cli.common.BOUNDS, parse_list's MAX_INT)
    ("label-candidates-unicode", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", *FITS, "--candidates",
                                  "\u00b2"], "--candidates \u00b2"),
    ("label-checkpoints-unicode", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--checkpoints",
                                   "every:\u00b2", "--w-obs", "8", "--horizon", "4"], "every:\u00b2"),
    ("replay-builtin-unicode", ["replay", "--scorer", "rkv", "--prompts", "builtin:recall:\u2460", "--out", "{out}"],
     "builtin:recall:\u2460"),
    ("trace-max-new-arabic-digit", ["trace", "--max-new-tokens", "\u0663", "--out", "{out}"], "ASCII digits"),
    ("replay-budget-arabic-digit", ["replay", "--scorer", "rkv", "--budget", "\u0663\u0662", "--out", "{out}"],
     "ASCII digits"),
    ("trace-seed-2-64", ["trace", "--seed", str(2**64), "--out", "{out}"], "--seed 18446744073709551616"),
    ("rank-eval-bootstrap-huge", ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--bootstrap",
                                  str(10**12), "--out", "{out}"], "--bootstrap 1000000000000: must be at most"),
    ("label-miss-rate-tiny", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", *FITS, "--method", "hybrid",
                              "--exact-frac", "0.1", "--miss-rate", "1e-300"], "--miss-rate 1e-300"),
    ("decisions-search-seconds-inf", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                                      "--search-seconds", "inf", "--out", "{out}"], "--search-seconds inf"),
    ("decisions-search-rows-huge", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                                    "--search-rows", str(10**12), "--out", "{out}"], "--search-rows"),
    ("decisions-draws-huge", ["decisions", "--trace", "{trace}", "--scores", "{scores}", "--keep", "0.5",
                              "--selection", "stochastic", "--draws", str(10**9), "--out", "{out}"], "--draws"),
    ("replay-samples-huge", ["replay", "--scorer", "rkv", "--samples", str(10**9), "--out", "{out}"], "--samples"),
    ("replay-budget-huge", ["replay", "--scorer", "rkv", "--budget", str(2**64), "--out", "{out}"], "--budget"),
    ("replay-interval-huge", ["replay", "--scorer", "rkv", "--interval", str(10**9), "--out", "{out}"],
     "--interval"),
    ("bench-peak-size-huge", ["bench", "peak", "--size", str(10**6)], "--size 1000000"),
    ("label-backend-triton-cpu", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", *FITS, "--backend",
                                  "triton"], "--backend triton needs a CUDA device"),
    ("label-horizon-upper", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--checkpoints", "every:16",
                             "--w-obs", "8", "--horizon", "REST"], "--horizon REST"),
    ("label-horizon-space", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", "--checkpoints", "every:16",
                             "--w-obs", "8", "--horizon", " 3"], "--horizon 3: use a number"),
    ("trace-prompts-latin1", ["trace", "--model", "tiny:llama", "--prompts", "{latin1_jsonl}", "--out", "{out}"],
     "not UTF-8 text (byte 0xe9 at offset 16)"),
    ("replay-prompts-latin1", ["replay", "--scorer", "rkv", "--prompts", "{latin1_txt}", "--out", "{out}"],
     "not UTF-8 text (byte 0xe9 at offset 3)"),
    # found by tests/test_fuzz_cli.py: a FIFO input blocked its read forever
    ("label-include-fifo", ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", *FITS, "--include", "{fifo}"],
     "fifo is not a regular file or directory (a FIFO"),
    ("rank-eval-labels-fifo", ["rank-eval", "--labels", "{fifo}", "--scores", "{scores}", "--out", "{out}"],
     "fifo is not a regular file or directory (a FIFO"),
    ("score-plugin-fifo", ["score", "--trace", "{trace}", "--labels", "{labels}", "--plugin", "{fifo}", "--out",
                           "{out}/s.parquet"], "fifo is not a regular file or directory (a FIFO"),
    ("decisions-search-without-oracle", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep",
                                         "0.5", "--search-rows", "64", "--out", "{out}"],
     "--search-rows does not apply without oracle_search"),
    *[(f"decisions-search-from-{name}", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep",
                                        "0.5", *refs, "--search-from", path, "--out", out], needle)
      for name, refs, path, out, needle in [
          ("without-oracle", [], "{earlier}/decisions.parquet", "{out}",
           "--search-from does not apply without oracle_search"),
          ("missing", ["--references", "oracle_search"], "{out}/no.parquet", "{out}/run", "does not exist"),
          ("directory", ["--references", "oracle_search"], "{earlier}", "{out}", "is a directory"),
          ("labels", ["--references", "oracle_search"], "{labels}", "{out}", "lacks columns"),
          ("other-trace", ["--references", "oracle_search"], "{decisions_other_trace}", "{out}",
           "made from another Trace"),
          ("other-budget", ["--references", "oracle_search"], "{decisions_other_budget}", "{out}",
           "shares no labeled set"),
          ("per-token", ["--references", "oracle_search"], "{decisions_per_token}", "{out}",
           "holds per-token sets where this run selects per-head"),
          ("inside-out", ["--references", "oracle_search"], "{earlier}/decisions.parquet", "{earlier}",
           "contains the input --search-from"),
          ("checkpoint-text", ["--references", "oracle_search"], "{decisions_checkpoint_typed}", "{out}",
           "columns of another type: checkpoint (String, not Int64)"),
          ("mask-text", ["--references", "oracle_search"], "{decisions_mask_typed}", "{out}",
           "columns of another type: evicted_mask (String, not Binary)"),
          ("budget-number", ["--references", "oracle_search"], "{decisions_budget_typed}", "{out}",
           "columns of another type: budget (Int32, not String)")]],
    ("decisions-search-from-65", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep", "0.5",
                                  "--references", "oracle_search",
                                  *[a for _ in range(65) for a in ("--search-from", "{earlier}/decisions.parquet")],
                                  "--out", "{out}"], "at most 64 files"),
    ("decisions-scores-string-column", ["decisions", "--trace", "{trace}", "--scores", "{scores_str}", "--keep", "0.5",
                                        "--out", "{out}"], "neither keys nor numeric scores: note (String)"),
    ("decisions-labels-keyless", ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--labels",
                                  "{keyless_parquet}", "--keep", "0.5", "--out", "{out}"], "keyless.parquet"),
    # ---- #55 paths: empty, existing outputs of another kind (see test_the_output_guard_resolves_paths for links)
    ("trace-out-empty", ["trace", "--model", "tiny:llama", "--out", ""], "--out is empty"),
    ("label-trace-empty", ["label", "--trace", "", "--out", "{out}/l.parquet"], "--trace is empty"),
    ("label-out-other-table", ["label", "--trace", "{trace}", "--out", "{scores}", *FITS],
     "holds a kvdiag scores table, not labels"),
    ("label-out-not-a-table", ["label", "--trace", "{trace}", "--out", "{file}", *FITS],
     "holds no kvdiag table, not labels"),
]

PLUGINS = {  # file name -> source; line numbers matter (the messages name them)
    "old_api": "from dataclasses import dataclass\nfrom kvdiag.scorers import Scorer, register_scorer\n\n\n"
               "@register_scorer('old_api')\n@dataclass\nclass Old(Scorer):\n    def scores(self, ctx):\n"
               "        return ctx.keys.norm(dim=-1)\n",
    "no_score": "from dataclasses import dataclass\nfrom kvdiag.scorers import Scorer, register_scorer\n\n\n"
                "@register_scorer('no_score')\n@dataclass\nclass Nothing(Scorer):\n    window: int = 4\n",
    "collides": "from dataclasses import dataclass\nfrom kvdiag.scorers import Scorer, register_scorer\n\n\n"
                "@register_scorer('knorm')\n@dataclass\nclass Mine(Scorer):\n    def score(self, ctx):\n"
                "        return ctx.keys.norm(dim=-1)\n",
    "syntax": "from kvdiag.scorers import Scorer\n\ndef score(self ctx):\n    pass\n",
    "import": "import os\nimport no_such_module_kvdiag\n",
    "exits": "import sys\nsys.exit(0)\n",
    "top_raise": "import os\nraise RuntimeError('not ready')\n",
    "raises": "from dataclasses import dataclass\nfrom kvdiag.scorers import Scorer, register_scorer\n\n\n"
              "@register_scorer('boom')\n@dataclass\nclass Boom(Scorer):\n    def score(self, ctx):\n"
              "        raise ValueError('the plugin broke')\n",
    "returns_list": "from dataclasses import dataclass\nfrom kvdiag.scorers import Scorer, register_scorer\n\n\n"
                    "@register_scorer('listy')\n@dataclass\nclass Listy(Scorer):\n    def score(self, ctx):\n"
                    "        return [1.0] * ctx.t\n",
}
PLUGIN_FILES = {"import": "import_error"}  # a plugin file named import.py would shadow nothing, but reads oddly

# Rows whose refusal needs what only torch gives, each with why; every other row is refused before torch or
# transformers is imported (test_refused_before_torch). Two remain, both a fault inside a plugin's score(): what the
# plugin's source shows (syntax, the scorer contract, a taken name, a missing import, an exit at import) is refused
# before torch (kvdiag.scorers.plugin_check), but a score() that raises or returns a list shows it only when it runs,
# on a Trace's tensors (torch). These are not argument checks: the plugin's own code must run. Each is still refused
# before any model loads or any output is written (test_plugin_rows_are_refused_before_a_model_or_an_output).
RUNS_SCORE = "the fault is in its score(), which shows only when it runs on a Trace's tensors (torch)"
HEAVY: dict[str, str] = {
    "score-plugin-raises": RUNS_SCORE, "score-plugin-returns-list": RUNS_SCORE,
}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def inputs(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """A tiny run (trace, labels, scores, rank-eval) and broken copies of its files."""
    from kvdiag.core.io import read_table, write_table
    from tests.conftest import hub_cache, make_trace

    root = tmp_path_factory.mktemp("bad-input")
    trace = make_trace(tiny_llama, root / "run" / "trace", n_prompts=2, max_new_tokens=40)
    labels, scores = root / "run" / "labels.parquet", root / "run" / "scores.parquet"
    for argv in (
        [
            "label", "--trace", str(trace.path), "--out", str(labels), "--checkpoints", "every:16", "--w-obs", "8",
            "--candidates", "6", "--horizon", "4", "--quiet",
        ],
        [
            "score", "--trace", str(trace.path), "--labels", str(labels), "--scorers", "attention,knorm", "--out",
            str(scores),
        ],
        ["score", "--trace", str(trace.path), "--checkpoints", "every:16", "--granularity", "head", "--scorers",
         "knorm", "--out", str(root / "run" / "head-scores.parquet")],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
    p = {"trace": str(trace.path), "labels": str(labels), "scores": str(scores), "run": str(root / "run"),
         "head_scores": str(root / "run" / "head-scores.parquet")}
    p["shortest"] = str(min(trace.length(pid) for pid in trace.prompt_ids))  # a horizon past one prompt's end
    # fitted rules (#56): a small valid file (a logistic regression and one tree), broken copies, and files trained
    # on another family, on a prompt of the Trace and on one of the shipped benchmark
    from kvdiag.grade import benchmark
    from kvdiag.scorers.fitted_file import text_digest

    tree = {"feature": [1, 0, 0], "threshold": [1.0, None, None], "missing_left": [True, False, False],
            "left": [1, 0, 0], "right": [2, 0, 0], "leaf": [False, True, True], "value": [0.0, -1.0, 1.0]}
    good = {"kind": "kvdiag_fitted_rule", "rule": "logistic", "features": ["key_norm", "value_norm"],
            "logistic": {"mean": [0.0, 0.0], "scale": [1.0, 1.0], "coef": [1.0, -1.0], "intercept": 0.0},
            "boosted": {"baseline": 0.0, "trees": [tree]},
            "trained_on": {"prompts": [{"id": "elsewhere", "text_sha256": text_digest("another question")}],
                           "model": {"spec": "tiny:llama", "family": "llama"}}}
    bench_text = next(iter(json.loads(benchmark.load("math500-smollm2@1").file("trace/manifest.json").read_text())
                           ["prompts"].values()))["text"]
    (root / "fitted").mkdir()
    for kind, changes in {
        "good": {}, "unknown_feature": {"features": ["key_norm", "nope"]},
        "coef_shape": {"logistic": {**good["logistic"], "coef": [1.0]}},
        "tree_outside": {"rule": "boosted", "boosted": {"baseline": 0.0, "trees": [{**tree, "left": [99, 0, 0]}]}},
        "not_a_tree": {"boosted": {"baseline": 0.0, "trees": [{**tree, "right": [1, 0, 0]}]}},
        "old": {"kind": "kvdiag_fitted_logreg"},
        "other_family": {"trained_on": {**good["trained_on"], "model": {"spec": "tiny:qwen3", "family": "qwen3"}}},
        "overlap": {"trained_on": {**good["trained_on"], "prompts": [
            {"id": "renamed", "text_sha256": text_digest(trace.manifest["prompts"][trace.prompt_ids[0]]["text"])}]}},
        "bench_overlap": {"trained_on": {**good["trained_on"], "prompts": [
            {"id": "renamed", "text_sha256": text_digest(bench_text)}]}},
    }.items():
        (root / "fitted" / f"{kind}.json").write_text(json.dumps({**good, **changes}))
        p[f"fitted_{kind}"] = str(root / "fitted" / f"{kind}.json")
    (root / "file").write_text("a regular file\n")
    p["file"] = str(root / "file")
    (root / "empty").mkdir()
    p["empty_dir"] = str(root / "empty")
    (root / "empty.jsonl").write_text("")
    p["empty_jsonl"] = str(root / "empty.jsonl")
    (root / "bad.jsonl").write_text('{"problem": "1+1?"}\n{oops\n')
    p["bad_jsonl"] = str(root / "bad.jsonl")
    (root / "garbage.parquet").write_bytes(b"PAR1 this is not parquet at all")
    p["garbage_parquet"] = str(root / "garbage.parquet")
    data = labels.read_bytes()
    (root / "truncated.parquet").write_bytes(data[: len(data) // 2])
    p["truncated_labels"] = str(root / "truncated.parquet")
    df, meta = read_table(labels)
    write_table(df.select("kl_mean"), root / "keyless.parquet", meta)
    p["keyless_parquet"] = str(root / "keyless.parquet")
    write_table(df, root / "foreign.parquet", {**meta, "trace": {**meta["trace"], "fingerprint": "0123456789abcdef"}})
    p["foreign_labels"] = str(root / "foreign.parquet")
    write_table(df.head(0), root / "labels-empty.parquet", meta)
    p["labels_empty"] = str(root / "labels-empty.parquet")
    # hand-altered labels (found by feeding altered copies of a run's labels to every command that reads them): the
    # label as text passed the finite check's cast and failed deep in a stage (exit 1); a negative divergence, a
    # negative floor and a horizon of 0 were taken as they were
    for name, broken in [("text", df.with_columns(pl.col("kl_mean").cast(pl.String))),
                         ("negative", df.with_columns(pl.col("kl_mean") * -1)),
                         ("floor", df.with_columns(pl.lit(-1.0).alias("noise_floor"))),
                         ("horizon", df.with_columns(pl.lit(0, pl.Int64).alias("horizon")))]:
        write_table(broken, root / f"labels-{name}.parquet", meta)
        p[f"labels_{name}"] = str(root / f"labels-{name}.parquet")
    sdf, smeta = read_table(scores)
    first = pl.int_range(pl.len()) == 0
    for name, broken, broken_meta in [
        ("nan", sdf.with_columns(pl.when(first).then(float("nan")).otherwise(pl.col("knorm")).alias("knorm")), smeta),
        ("inf", sdf.with_columns(pl.when(first).then(float("inf")).otherwise(pl.col("attention")).alias("attention")),
         smeta),
        ("null", sdf.with_columns(pl.when(first).then(None).otherwise(pl.col("knorm")).alias("knorm")), smeta),
        ("dup", pl.concat([sdf, sdf.head(1)]), smeta),
        ("nometa", sdf, {}),
        ("str", sdf.with_columns(note=pl.lit("x")), smeta),  # a score column of text: no score, refused
    ]:
        write_table(broken, root / f"scores-{name}.parquet", broken_meta)
        p[f"scores_{name}"] = str(root / f"scores-{name}.parquet")
    # --search-from: decisions tables (one oracle_search row at a head-scores checkpoint) of another Trace, of
    # another budget, of another selection; and one inside a directory used as --out
    from kvdiag.decisions import DECISION_SCHEMA

    hdf = read_table(root / "run" / "head-scores.parquet")[0]
    pid, t = hdf["prompt_id"][0], int(hdf["checkpoint"][0])
    row = {"prompt_id": pid, "checkpoint": t, "decision": "oracle_search", "kind": "reference", "budget": "keep:0.5",
           "kept": t // 2, "selection": "per-head", "status": "ok", "kl_mean": 0.1, "evicted_mask": b"\x00"}
    dmeta = {"kind": "decisions", "trace": smeta["trace"]}
    for name, changes, m in [("other_trace", {}, {**dmeta, "trace": {**dmeta["trace"], "fingerprint": "0" * 16}}),
                             ("other_budget", {"budget": "keep:0.9"}, dmeta),
                             ("per_token", {"selection": "per-token"}, dmeta)]:
        write_table(pl.DataFrame([{**row, **changes}], schema=DECISION_SCHEMA), root / f"decisions-{name}.parquet", m)
        p[f"decisions_{name}"] = str(root / f"decisions-{name}.parquet")
    (root / "earlier").mkdir()
    write_table(pl.DataFrame([row], schema=DECISION_SCHEMA), root / "earlier" / "decisions.parquet", dmeta)
    p["earlier"] = str(root / "earlier")
    # an earlier run's table altered by hand: a checkpoint or a set as text, a budget as a number (each passed the
    # contract and failed in a filter or the set's decoding: exit 1)
    earlier = pl.DataFrame([row], schema=DECISION_SCHEMA)
    for name, col in [("checkpoint", pl.col("checkpoint").cast(pl.String)), ("mask", pl.lit("abc")),
                      ("budget", pl.lit(5))]:
        alias = "evicted_mask" if name == "mask" else name
        write_table(earlier.with_columns(col.alias(alias)), root / f"decisions-{name}-typed.parquet", dmeta)
        p[f"decisions_{name}_typed"] = str(root / f"decisions-{name}-typed.parquet")
    # a free-running replay of other prompts than the Trace's, and broken copies of it (the generations contract)
    gen = pl.DataFrame({"prompt_id": ["elsewhere000"] * 2, "scorer": ["full_kv", "knorm"], "budget": [None, 16],
                        "sample": [0, 0], "mode": ["free"] * 2, "generated": [4, 4], "compressions": [0, 1],
                        "peak_kv": [12, 16], "mean_kv": [10.0, 14.0], "kl_mean": [None, 0.5], "seconds": [0.1, 0.1]},
                       schema_overrides={"budget": pl.Int64, "kl_mean": pl.Float64})
    gen_meta = {"kind": "replay", "mode": "free", "settings": {"scorers": ["knorm"]}, "prompt_ids": ["elsewhere000"]}
    prompt_ids = list(json.loads((trace.path / "manifest.json").read_text())["prompts"])
    ours = gen.with_columns(prompt_id=pl.lit(prompt_ids[0]))
    for name, df, gmeta in [
        ("other-replay", gen, gen_meta),
        ("replay-nan", ours.with_columns(kl_mean=pl.lit(float("nan"))), {**gen_meta, "prompt_ids": prompt_ids}),
        ("replay-dup", pl.concat([ours, ours.tail(1)]), {**gen_meta, "prompt_ids": prompt_ids}),
        ("replay-nometa", ours, {"kind": "replay"}),
        ("replay-tf", ours.with_columns(mode=pl.lit("teacher_forced")),
         {**gen_meta, "mode": "teacher_forced", "prompt_ids": prompt_ids, "trace": {"fingerprint": trace.fingerprint}}),
    ]:
        write_table(df, root / name / "generations.parquet", gmeta)
        p[name.replace("-", "_")] = str(root / name)
    # tables that do not record their Trace, and a model directory of another config than the Trace's model
    for name, path in (("labels", labels), ("scores", scores)):
        df_, meta_ = read_table(path)
        write_table(df_, root / f"{name}-nometa.parquet", {k: v for k, v in meta_.items() if k != "trace"})
        p[f"{name}_nometa"] = str(root / f"{name}-nometa.parquet")
    (root / "model-other").mkdir()
    (root / "model-other" / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192}))
    p["model_other"] = str(root / "model-other")
    # a model directory with a tokenizer saved by transformers (the byte tokenizer): counted before torch
    from kvdiag.model.specs import byte_tokenizer

    shutil.copytree(root / "model-other", root / "model-tokenizer")
    byte_tokenizer().save_pretrained(root / "model-tokenizer")
    p["model_tokenizer"] = str(root / "model-tokenizer")

    def broken_trace(name: str, breaker) -> str:
        copy = root / name
        shutil.copytree(trace.path, copy)
        breaker(copy)
        return str(copy)

    p["trace_bad_manifest"] = broken_trace("t-manifest", lambda d: (d / "manifest.json").write_text('{"prompts": {'))
    p["trace_list_manifest"] = broken_trace("t-list", lambda d: (d / "manifest.json").write_text("[1, 2]"))
    p["trace_bad_tokens"] = broken_trace(
        "t-tokens", lambda d: (d / "tokens.parquet").write_bytes((d / "tokens.parquet").read_bytes()[:100]))

    def truncate_layer(d: Path) -> None:
        for f in (d / "tensors").glob("*/layer_000.safetensors"):
            f.write_bytes(f.read_bytes()[:200])

    p["trace_bad_layer"] = broken_trace("t-layer", truncate_layer)

    def keys_only(d: Path) -> None:  # the manifest of a --store kv Trace: no queries on disk
        manifest = json.loads((d / "manifest.json").read_text())
        manifest["store"] = {"mode": "kv", "layers": list(range(manifest["num_layers"]))}
        (d / "manifest.json").write_text(json.dumps(manifest))

    p["trace_kv"] = broken_trace("t-kv", keys_only)

    def edited(**changes) -> Callable[[Path], None]:  # a manifest edited by hand: fields no kvdiag trace writes
        def edit(d: Path) -> None:
            manifest = json.loads((d / "manifest.json").read_text())
            for key, value in changes.items():
                if key == "length":
                    manifest["prompts"][trace.prompt_ids[0]]["length"] = value
                elif key in ("scale_0", "window_0", "sinks_0"):  # layer 0's attention record
                    manifest["model"]["attention"]["layers"][0][key[:-2]] = value
                else:
                    manifest[key] = value
            (d / "manifest.json").write_text(json.dumps(manifest))
        return edit

    # each was read as it was: a layer count as text (exit 1), a prompt of 10**9 tokens (label sized buffers by it
    # until memory ran out), another storage dtype (exit 1), a newer format (read as this one)
    for name, changes in [("layers", {"num_layers": "30"}), ("heads", {"num_kv_heads": 0}),
                          ("length", {"length": 10**9}), ("tokens", {"length": trace.length(trace.prompt_ids[0]) - 1}),
                          ("dtype", {"storage_dtype": "float99"}), ("format", {"format_version": 999}),
                          # a layer's attention record score, label and figures recompute attention with: exit 1,
                          # or a window of -5 taken as read (wrong numbers)
                          ("lscale", {"scale_0": "x"}), ("lwindow", {"window_0": -5}), ("lsinks", {"sinks_0": "yes"}),
                          ("store", {"store": {"mode": "all", "layers": [0, 7]}})]:
        p[f"trace_edited_{name}"] = broken_trace(f"t-edited-{name}", edited(**changes))

    def retokened(change) -> Callable[[Path], None]:  # tokens.parquet edited by hand
        def edit(d: Path) -> None:
            tokens = pl.read_parquet(d / "tokens.parquet")
            change(tokens, pl.int_range(pl.len()) == 3).write_parquet(d / "tokens.parquet")
        return edit

    # a token id as text (exit 1), a negative one (exit 1 in label), one beyond the vocabulary, a position twice
    # and another missing (read on)
    for name, change in [
            ("text", lambda t, at: t.with_columns(pl.col("token_id").cast(pl.String))),
            ("negative", lambda t, at: t.with_columns(pl.when(at).then(-7).otherwise("token_id").alias("token_id"))),
            # beyond the model's vocabulary (score rebuilding q/k/v: IndexError in the embedding, exit 1)
            ("beyond", lambda t, at: t.with_columns(pl.when(at).then(10**6).otherwise("token_id").alias("token_id"))),
            ("null", lambda t, at: t.with_columns(pl.when(at).then(None).otherwise("token_id").alias("token_id"))),
            ("stranger", lambda t, at: pl.concat([t, t.head(3).with_columns(pl.lit("zzz").alias("prompt_id"))])),
            ("position", lambda t, at: t.with_columns(pl.when(at).then(2).otherwise("position").alias("position")))]:
        p[f"trace_tokens_{name}"] = broken_trace(f"t-tokens-{name}", retokened(change))
    for name, positions in (("shape", {"p": "1,2"}), ("unknown", {"nope": [1]}),
                            ("beyond", {trace.prompt_ids[0]: [3, 10**6]})):
        (root / f"include-{name}.json").write_text(json.dumps(positions))
        p[f"include_{name}"] = str(root / f"include-{name}.json")
    (root / "number.jsonl").write_text('{"problem": 42}\n')
    (root / "latin1.jsonl").write_bytes('{"problem": "caf\u00e9 1+1?"}\n'.encode("latin-1"))
    (root / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    p["latin1_jsonl"], p["latin1_txt"] = str(root / "latin1.jsonl"), str(root / "latin1.txt")
    os.mkfifo(root / "fifo")  # an input FIFO: reading it would block forever (found by tests/test_fuzz_cli.py)
    p["fifo"] = str(root / "fifo")
    p["number_jsonl"] = str(root / "number.jsonl")
    for kind, peft_type, weights in (("ia3", "IA3", "adapter_model.safetensors"), ("bin", "LORA", "adapter_model.bin")):
        (root / f"adapter-{kind}").mkdir()
        (root / f"adapter-{kind}" / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type}))
        (root / f"adapter-{kind}" / weights).write_bytes(b"not read")
        p[f"adapter_{kind}"] = str(root / f"adapter-{kind}")

    def lora(kind: str, tensors: dict | None, base: str | None = None) -> None:
        """A LoRA adapter directory whose safetensors file has a header only (``tensors``: name -> shape) or, with
        None, garbage; recording ``base``."""
        d = root / f"adapter-{kind}"
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
        header = json.dumps({k: {"dtype": "F32", "shape": s, "data_offsets": [0, 0]}
                             for k, s in (tensors or {}).items()})
        (d / "adapter_model.safetensors").write_bytes(
            len(header).to_bytes(8, "little") + header.encode() if tensors else b"\xff" * 64)
        p[f"adapter_{kind}"] = str(d)

    at = "base_model.model.model.layers.{}.self_attn.q_proj.lora_A.weight"
    lora("garbage", None)
    lora("gemma", {at.format(0): [8, 640]}, base="gemma3-270m")
    lora("tiny", {at.format(0): [4, 64]})  # tiny:llama's q_proj on smollm2 (576 in features)
    lora("deep", {at.format(30): [4, 64]})  # a 30th layer on tiny:llama (2 layers)
    (root / "plugins").mkdir()
    for kind, source in PLUGINS.items():
        path = root / "plugins" / f"{PLUGIN_FILES.get(kind, kind)}.py"
        path.write_text(source)
        p[f"plugin_{kind}"] = str(path)
    # the tokenizer directory as a hub id's files in a Hugging Face cache (which records that the hub has no
    # chat_template.jinja): this module's cache, in process and in the fresh interpreters (HF_HUB_CACHE)
    cache = hub_cache(root / "hub", "someone/bytes", list((root / "model-tokenizer").iterdir()))
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(cache))
        mp.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
        yield p


def test_there_are_enough_cases():
    assert len(CASES) >= 40
    commands = {argv[0] if argv[0] != "bench" else " ".join(argv[:2]) for _, argv, _ in CASES}
    assert {"trace", "label", "score", "rank-eval", "figures", "report", "replay", "demo"} <= commands


@pytest.mark.parametrize("argv, needle", [(argv, needle) for _, argv, needle in CASES], ids=[c[0] for c in CASES])
def test_bad_input(argv, needle, inputs, tmp_path, capsys, restore_scorers):
    out = tmp_path / "out"
    filled = [a.format(out=out, **inputs) for a in argv]
    before = {f: f.stat().st_mtime_ns for f in Path(inputs["run"]).rglob("*")}
    code, err = _run(filled, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert needle in lines[0], err
    assert not out.exists(), f"{out} was written before the input was refused"
    # the inputs are untouched (no stamp, part or table written into the run)
    assert {f: f.stat().st_mtime_ns for f in Path(inputs["run"]).rglob("*")} == before


# Runs rows in one fresh interpreter, in order, through the console script's main; stops after the first row that
# imported torch or transformers (that module cannot be unloaded), so the next interpreter starts from the row after.
WORKER = """
import json, sys
from kvdiag.cli.main import main
rows = []
for name, argv in json.loads(sys.stdin.read()):
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    rows.append([name, code, [m for m in ("torch", "transformers") if m in sys.modules]])
    if rows[-1][2]:
        break
print("ROWS " + json.dumps(rows))
"""


def refusals_in_fresh_processes(rows: list[tuple[str, list[str]]], cwd: Path) -> dict[str, tuple[int, list[str]]]:
    """name -> (exit code, the heavy modules imported by the time it exited), each row run as ``kvdiag ARGV``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVDIAG_CACHE": str(cwd / "cache")}
    results: dict[str, tuple[int, list[str]]] = {}
    while rows:
        proc = subprocess.run([sys.executable, "-c", WORKER], input=json.dumps(rows), capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=900)
        done = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("ROWS ")]
        assert done and done[0], f"the worker failed: {proc.stderr[-3000:]}"
        for name, code, heavy in done[0]:
            results[name] = (code, heavy)
        rows = rows[len(done[0]):]
    return results


def test_heavy_rows_are_named_cases():
    assert set(HEAVY) <= {name for name, _, _ in CASES}, set(HEAVY) - {name for name, _, _ in CASES}


def test_refused_before_torch(inputs, tmp_path):
    """Every bad input but the rows of HEAVY is refused (exit 2) before torch or transformers is imported: in a fresh
    interpreter, neither is in sys.modules when the one line is printed."""
    rows = [(name, [a.format(out=tmp_path / name / "out", **inputs) for a in argv])
            for name, argv, _ in CASES if name not in HEAVY]
    results = refusals_in_fresh_processes(rows, tmp_path)
    late = {name: r for name, r in results.items() if r[1]}
    wrong = {name: r for name, r in results.items() if r[0] != 2}
    assert not late, f"refused only after importing torch/transformers: {sorted(late)}"
    assert not wrong, f"not exit 2: {wrong}"
    assert len(results) == len(rows)


def test_plugin_rows_are_refused_before_a_model_or_an_output(inputs, tmp_path, capsys, monkeypatch,
                                                             restore_scorers):
    """The rows left in HEAVY (a plugin's code runs to show its fault) exit 2 with one line naming the plugin's file
    and the fix, with no model loaded (kvdiag.model.load.load_model never called) and nothing written at --out."""
    import kvdiag.model.load

    loads = []
    monkeypatch.setattr(kvdiag.model.load, "load_model", lambda *a, **k: loads.append(a))
    files = {"score-plugin-raises": "raises.py:9", "score-plugin-returns-list": "returns_list.py:"}
    fixes = {"raises": "fix its score()", "returns-list": "fix its score()"}
    assert set(files) == set(HEAVY)
    for name, argv, _ in CASES:
        if name not in HEAVY:
            continue
        out = tmp_path / name / "out"
        code, err = _run([a.format(out=out, **inputs) for a in argv], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (name, err)
        assert files[name] in lines[0] and fixes[name.split("-plugin-")[1]] in lines[0], (name, err)
        assert not out.exists() and not (tmp_path / name).exists(), f"{name}: {out} was written"
    assert not loads, f"a model was loaded before the plugin was refused: {loads}"


def test_light_name_lists_are_the_registries():
    """The names the CLI checks before torch loads are the names the registries (which need torch) hold."""
    from kvdiag.core import parsing
    from kvdiag.label.config import APPROXIMATE_PARAMS
    from kvdiag.label.fast import APPROXIMATE
    from kvdiag.model.load import DTYPES
    from kvdiag.scorers import AGGREGATIONS, SCORERS
    from kvdiag.scorers import names as scorer_names

    assert scorer_names.BUILTIN_SCORERS == tuple(n for n, c in SCORERS.items() if c.__module__.startswith("kvdiag."))
    assert set(scorer_names.PREFIXES) == set(SCORERS._resolvers)
    assert scorer_names.AGGREGATIONS == tuple(AGGREGATIONS)
    from kvdiag.scorers.entry_features import FEATURES

    assert scorer_names.ENTRY_FEATURES == tuple(FEATURES)
    assert parsing.DTYPE_NAMES == tuple(DTYPES)
    assert {k: v[1] for k, v in APPROXIMATE.items()} == APPROXIMATE_PARAMS


def test_scorer_fields_are_the_registrys():
    """kvdiag.scorers.fields (read before torch) is the registry's: every built-in's fields (annotation as written,
    default, order) and their evaluated types, which rules need every past query's attention (in the class or by
    instance), which default instances run on a live cache, and which join `--scorers all`."""
    import dataclasses
    import typing

    from kvdiag.generate.live import live_scorer_names
    from kvdiag.scorers import SCORERS
    from kvdiag.scorers import fields as scorer_fields

    builtins = {n: c for n, c in SCORERS.items() if c.__module__.startswith("kvdiag.") and ":" not in n}
    assert {n: {f.name: (f.type, f.default) for f in dataclasses.fields(c)} for n, c in builtins.items()} \
        == scorer_fields.FIELDS
    assert all(list(scorer_fields.FIELDS[n]) == [f.name for f in dataclasses.fields(c)] for n, c in builtins.items())
    for name, cls in builtins.items():
        hints = typing.get_type_hints(cls)
        assert all(scorer_fields.annotation(name, f) == hints[f] for f in scorer_fields.FIELDS[name]), name
    by_instance = {n for n, c in builtins.items() if isinstance(inspect_attr(c, "needs_history"), property)}
    assert by_instance == set(scorer_fields.HISTORY_BY_INSTANCE)
    assert {n for n, c in builtins.items() if n not in by_instance and c.needs_history} == set(scorer_fields.HISTORY)
    assert tuple(n for n in live_scorer_names() if n in builtins) == scorer_fields.LIVE
    assert tuple(n for n, c in builtins.items() if c.in_all) == scorer_fields.IN_ALL


def inspect_attr(cls, name: str):
    """``name`` as the class defines it (a property object, not its value)."""
    import inspect

    return inspect.getattr_static(cls, name)


def test_light_params_are_the_registrys():
    """The --param checks before torch refuse what get_scorer refuses, with its line, and convert what it converts
    (every field of every built-in, a valid and an invalid value of each type)."""
    from kvdiag.core.errors import UserError
    from kvdiag.scorers import get_scorer
    from kvdiag.scorers.base import needs_o_proj
    from kvdiag.scorers.fields import FIELDS, builtin_params, wo_l2_unused

    samples = {"int": ["3", "x"], "float": ["0.5", "lots"], "bool": ["false", "maybe"], "str": ["wo_l2"],
               "int | None": ["none", "4", "y"], "tuple[float, ...]": ["0.2,0.4", "a,b"],
               "tuple[float, ...] | None": ["null", "0.1,0.9", "z"], "dict": ["{}"]}
    checked = 0
    for name, fields in FIELDS.items():
        for field, (kind, _) in [*fields.items(), ("nope", ("str", None))]:
            for value in samples[kind]:
                params = {field: value} if name != "fitted" or field == "_model" else None
                if params is None:
                    continue
                try:
                    light = builtin_params(name, params)
                except UserError as err:
                    with pytest.raises(UserError) as stage:
                        get_scorer(name, **params)
                    assert str(stage.value) == str(err)
                    checked += 1
                    continue
                try:
                    scorer = get_scorer(name, **params)
                except UserError:  # a range check of __post_init__: the stage's, not a field's type
                    continue
                # the given parameter converted as the stage converts it (None may mean "follow another field" in
                # __post_init__: avokv_e_no_delay's w_delay; then the stage's value is the default instance's)
                given, made = light[field], scorer.params[field]
                assert made == (list(given) if isinstance(given, tuple) else given) or (
                    given is None and made == get_scorer(name).params[field]), (name, params)
                assert wo_l2_unused([name], {name: params}, ()) is not needs_o_proj(scorer)
                checked += 1
    assert checked >= 140  # 146 when written: the loop ran over every field


def test_grade_tells_names_from_plugins():
    """``grade fitted:dir/model.json`` grades a registered (prefixed) name, as ``score --scorers fitted:PATH`` does;
    a path without a prefix is a plugin."""
    from kvdiag.grade.run import is_plugin_spec

    assert not is_plugin_spec("fitted:runs/fit/model.json") and not is_plugin_spec("kvpress:SnapKVPress")
    assert not is_plugin_spec("knorm") and not is_plugin_spec("my_package.rules")
    assert is_plugin_spec("rules/mine.py") and is_plugin_spec("mine.py") and is_plugin_spec("plugins/mine")


def test_help_imports_no_torch(tmp_path):
    """``kvdiag --help`` and every command's --help build without torch or transformers."""
    import typer

    from kvdiag.cli.main import app, resolve_command

    root = typer.main.get_command(app)
    rows = [("help", ["--help"])] + [(f"{name}-help", [name, "--help"]) for name in root.commands if name != "bench"]
    rows += [(f"bench-{name}-help", ["bench", name, "--help"]) for name in resolve_command(["bench"])[0].commands]
    results = refusals_in_fresh_processes(rows, tmp_path)
    assert {name: r for name, r in results.items() if r != (0, [])} == {}


def test_warnings_are_one_line_each(monkeypatch, capsys):
    """A Python warning raised during a command is one ``warning:`` line through the CLI's printer (no source path,
    no code line), printed before the error's one line."""
    import warnings

    import kvdiag.tasks.prompts

    def warn_then_refuse(*args, **kwargs):
        warnings.warn("first line\nsecond [bold]line[/bold]", UserWarning, stacklevel=1)
        raise kvdiag.tasks.prompts.UserError("--prompts x: refused")

    monkeypatch.setattr(kvdiag.tasks.prompts, "load_prompts", warn_then_refuse)
    code, err = _run(["trace", "--model", "tiny:llama", "--out", "/nonexistent/t"], capsys)
    assert code == 2
    assert err.strip().splitlines() == ["warning: first line second [bold]line[/bold] (UserWarning)",
                                        "error: --prompts x: refused"]


def test_unexpected_error_is_one_line_with_a_log(monkeypatch, tmp_path, capsys):
    """A bug (not bad input): one line naming the log file with the traceback, exit 1; --debug raises."""
    import kvdiag.tasks.prompts

    def boom(*args, **kwargs):
        raise RuntimeError("simulated bug\nsecond line")

    monkeypatch.setenv("KVDIAG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kvdiag.tasks.prompts, "load_prompts", boom)
    argv = ["trace", "--model", "tiny:llama", "--out", str(tmp_path / "t")]
    code, err = _run(argv, capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "internal error" in lines[0] and "RuntimeError: simulated bug second line" in lines[0]
    log = Path(lines[0].split("the traceback is in ")[1].split(";")[0])
    assert log.parent == tmp_path / "cache" / "logs"
    text = log.read_text()
    assert "Traceback" in text and "simulated bug" in text and "kvdiag trace --model tiny:llama" in text
    with pytest.raises(RuntimeError, match="simulated bug"):
        main([*argv, "--debug"])


def test_list_options_accumulate(inputs, tmp_path, capsys):
    """A repeated list option adds its values (none is dropped)."""
    out = tmp_path / "s.parquet"
    code, _ = _run(["score", "--trace", inputs["trace"], "--labels", inputs["labels"], "--scorers", "knorm",
                    "--scorers", "value_norm,attention", "--out", str(out)], capsys)
    assert code == 0
    from kvdiag.core.io import read_table

    df, meta = read_table(out)
    assert list(meta["scorers"]) == ["knorm", "value_norm", "attention"]
    assert {"knorm", "value_norm", "attention"} <= set(df.columns)


def test_rank_eval_default_reference(inputs, tmp_path, capsys):
    """Scores without avokv_e: the defaults work and say that there is no paired comparison."""
    out = tmp_path / "re"
    code, _ = _run(["rank-eval", "--labels", inputs["labels"], "--scores", inputs["scores"], "--bootstrap", "20",
                    "--out", str(out)], capsys)
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["summary"]["reference_note"].startswith("no paired comparisons: the scores have no avokv_e column")
    assert config["config"]["reference"] is None


SHIPPED = Path(__file__).resolve().parents[1] / "data" / "kvdiag-bench" / "math500-smollm2@1"


def _drop_labels_from_the_manifest(d: Path) -> None:
    """The labels file is altered and no longer listed: the manifest's own hashes all still match."""
    from kvdiag.core.io import read_table, write_table

    df, meta = read_table(d / "labels.parquet")
    write_table(df.with_columns(pl.col("kl_mean") * 0.5), d / "labels.parquet", meta)
    manifest = json.loads((d / "MANIFEST.json").read_text())
    del manifest["files"]["labels.parquet"]
    (d / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _recompute_the_hashes(d: Path) -> None:
    """The labels file is altered and the manifest resealed: the manifest vouches for itself."""
    from kvdiag.core.io import read_table, write_table
    from kvdiag.grade import benchmark

    df, meta = read_table(d / "labels.parquet")
    write_table(df.with_columns(pl.col("kl_mean") * 0.5), d / "labels.parquet", meta)
    benchmark.seal(d, json.loads((d / "MANIFEST.json").read_text()))


def _drop_the_files_key(d: Path) -> None:
    manifest = json.loads((d / "MANIFEST.json").read_text())
    del manifest["files"]
    (d / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")


@pytest.mark.parametrize("tamper, needle", [
    (_drop_labels_from_the_manifest, "not the one kvdiag shipped"),
    (_recompute_the_hashes, "not the one kvdiag shipped"),
    (_drop_the_files_key, "no `files` table"),
], ids=["unlisted-labels", "recomputed-hashes", "no-files-key"])
def test_grade_refuses_a_tampered_copy_of_the_shipped_benchmark(tamper, needle, tmp_path, capsys):
    """The seal (#40): kvdiag holds the sha256 of the shipped MANIFEST.json, so a copy tampered with in any of the three
    ways is refused with exit 2 and one line, before the model loads or --out is written."""
    from kvdiag.grade import benchmark

    assert benchmark.sha256(SHIPPED / "MANIFEST.json") == benchmark.SHIPPED["math500-smollm2@1"]
    assert benchmark.load("math500-smollm2@1").name == "math500-smollm2@1"  # the shipped one passes, not user-built
    copy = tmp_path / "math500-smollm2@1"
    shutil.copytree(SHIPPED, copy)
    tamper(copy)
    code, err = _run(["grade", "knorm", "--bench", str(copy), "--out", str(tmp_path / "o")], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "o").exists()


def test_a_benchmark_missing_a_required_file_from_its_manifest_is_refused(tmp_path):
    """A user-built benchmark (not a shipped version) must still list and seal every file a benchmark has."""
    from kvdiag.core.errors import UserError
    from kvdiag.grade import benchmark

    copy = tmp_path / "mine@1"
    shutil.copytree(SHIPPED, copy)
    manifest = {**json.loads((copy / "MANIFEST.json").read_text()), "name": "mine"}
    benchmark.seal(copy, manifest)
    assert benchmark.load(str(copy)).name == "mine@1 (user-built)"
    manifest = json.loads((copy / "MANIFEST.json").read_text())
    del manifest["files"]["references.parquet"]
    (copy / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="does not list references.parquet"):
        benchmark.load(str(copy))


def test_the_decisions_contract(tmp_path):
    """read_decisions refuses an empty table, a repeated decision row and a labeled row without a finite kl_mean."""
    from kvdiag.core.contracts import read_decisions
    from kvdiag.core.errors import UserError
    from kvdiag.core.io import write_table

    rows = pl.DataFrame({"prompt_id": ["p", "p"], "checkpoint": [8, 8], "decision": ["knorm", "random"],
                         "kind": ["rule", "reference"], "budget": ["keep:0.5"] * 2, "sample": [None, None],
                         "status": ["ok", "over_budget"], "kl_mean": [0.25, None]},
                        schema_overrides={"sample": pl.Int64})
    assert read_decisions(write_table(rows, tmp_path / "ok.parquet"))[0].height == 2
    for name, bad, needle in [("empty", rows.head(0), "has no rows"),
                              ("dup", pl.concat([rows, rows.head(1)]), "repeat"),
                              ("inf", rows.with_columns(kl_mean=pl.lit(float("inf"))), "null, NaN or infinite"),
                              ("keyless", rows.drop("budget"), "lacks columns")]:
        with pytest.raises(UserError, match=needle):
            read_decisions(write_table(bad, tmp_path / f"{name}.parquet"))


def test_the_output_guard(inputs, tmp_path):
    """kvdiag.core.guard.check_outputs: an output that is (also through a symlink), holds or lies inside an input, or
    lies
    inside any Trace, is refused naming both flags; `kvdiag trace` may continue its own Trace; a fine output passes
    and the writability probe leaves nothing behind."""
    from kvdiag.core.errors import UserError
    from kvdiag.core.guard import check_outputs, is_trace_dir

    trace, labels = Path(inputs["trace"]), Path(inputs["labels"])
    link = tmp_path / "link.parquet"
    link.symlink_to(labels)
    refused = [
        ({"--out": link}, {"--labels": labels}, "is the input --labels"),
        ({"--out": (labels.parent, "dir")}, {"--labels": labels}, "contains the input --labels"),
        ({"--out": trace / "x" / "s.parquet"}, {"--trace": trace}, "lies inside the input --trace"),
        ({"--out": trace / "x.parquet"}, {}, "lies inside the Trace directory"),
        ({"--out": (trace, "dir")}, {}, "is a Trace directory"),
    ]
    for outputs, ins, needle in refused:
        with pytest.raises(UserError, match=needle):
            check_outputs(outputs, ins)
    assert is_trace_dir(trace) and not is_trace_dir(trace.parent)
    check_outputs({"--out": (trace, "dir")}, {}, writes_trace=True)  # a rerun of kvdiag trace continues it
    before = sorted(tmp_path.iterdir())
    check_outputs({"--out": tmp_path / "new" / "s.parquet"}, {"--labels": labels, "--trace": trace})
    assert sorted(tmp_path.iterdir()) == before


def test_the_output_guard_resolves_paths(inputs, tmp_path, capsys):
    """#55: an --out that reaches an input through a symlinked directory and ``..``, a hard link of an input, or a
    FIFO is refused (exit 2, one line) and the inputs stay byte for byte; paths with glob and markup characters are
    used and printed literally; an existing scores table is this command's own output (replaced, no --overwrite)."""
    run = Path(inputs["run"])
    before = {f: f.read_bytes() for f in run.rglob("*") if f.is_file()}
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "sub").symlink_to(Path(inputs["trace"]))  # sub/.. is the run directory, not d
    os.link(inputs["labels"], tmp_path / "hard.parquet")
    os.mkfifo(tmp_path / "fifo")
    score = ["score", "--trace", inputs["trace"], "--labels", inputs["labels"], "--scorers", "knorm", "--out"]
    for out, needle in [(tmp_path / "d" / "sub" / ".." / "labels.parquet", "is the input --labels"),
                        (tmp_path / "hard.parquet", "is the input --labels"),
                        (tmp_path / "fifo", "not a regular file or directory")]:
        code, err = _run([*score, str(out)], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
        assert str(out) in err  # printed verbatim
    assert {f: f.read_bytes() for f in run.rglob("*") if f.is_file()} == before
    # glob and markup characters: the file of that very name, and the line names it as given
    literal = tmp_path / "x[1]" / "[red]s.parquet"
    literal.parent.mkdir()
    (tmp_path / "x1").mkdir()  # what the pattern x[1] would match
    for _ in range(2):  # the second run replaces its own scores table
        code, err = _run([*score, str(literal)], capsys)
        assert code == 0, err
        assert f"to {literal}" in err
    assert literal.is_file() and not any((tmp_path / "x1").iterdir())
    code, err = _run(["rank-eval", "--labels", inputs["labels"], "--scores", str(literal), "--bootstrap", "0",
                      "--out", str(tmp_path / "re[1]")], capsys)
    assert code == 0, err


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, tmp_path, capsys):
    """#55: Ctrl-C inside a stage (typer turns KeyboardInterrupt into Exit(130) before kvdiag's handler sees it) says
    so in one line and exits 130; the finished parts are kept (tests/test_faults.py kills real runs)."""
    import kvdiag.trace.writer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvdiag.trace.writer, "trace_files", interrupted)
    code, err = _run(["trace", "--model", "tiny:llama", "--out", str(tmp_path / "t")], capsys)
    assert code == 130 and err.strip().splitlines() == [
        "interrupted: finished parts are kept; rerun the same command to continue"]


def test_continuing_a_trace_with_another_model_is_refused_before_it_loads(inputs, tmp_path, capsys, monkeypatch):
    """#55: another --model, or other generation settings, than the Trace in --out was made with: one line before
    any model loads (it was refused only after the load)."""
    import kvdiag.model.load

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(kvdiag.model.load, "load_model", no_load)
    out = tmp_path / "trace"
    shutil.copytree(inputs["trace"], out)
    code, err = _run(["trace", "--model", "tiny:qwen3", "--prompts", "builtin:arith:2", "--max-new-tokens", "40",
                      "--out", str(out)], capsys)
    assert code == 2 and "is not the Trace's model (tiny:llama)" in err, err
    code, err = _run(["trace", "--model", "tiny:llama", "--prompts", "builtin:arith:2", "--max-new-tokens", "41",
                      "--out", str(out)], capsys)
    assert code == 2 and "other generation settings" in err, err


def test_a_plugin_that_exits_through_another_name_is_one_line(inputs, tmp_path):
    """#55: ``from os import _exit as bye; bye(0)`` at import (no static check sees it) ended the process with exit 0
    and nothing written; while a plugin imports, os._exit raises SystemExit, which the import's guard words."""
    plugin = tmp_path / "bye.py"
    plugin.write_text("from os import _exit as bye\n\nbye(0)\n")
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "score", "--trace", inputs["trace"], "--labels",
                           inputs["labels"], "--plugin", str(plugin), "--out", str(tmp_path / "s.parquet")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --plugin {plugin}: it exits at import (SystemExit(0) at {plugin}:3); a plugin must only define and "
        "register scorers"], proc.stderr
    assert not (tmp_path / "s.parquet").exists()


@pytest.mark.parametrize("entry, value", [("model", "smollm2"), ("settings", "default"), ("name", 7)])
def test_a_user_built_benchmark_with_an_entry_of_another_type_is_refused(tmp_path, entry, value):
    """#55: a user-built benchmark whose model or settings entry is a string failed deep in grading (exit 1); its
    manifest's entries are read through their types: one UserError naming the entry."""
    from kvdiag.core.errors import UserError
    from kvdiag.grade import benchmark

    copy = tmp_path / "mine@1"
    shutil.copytree(SHIPPED, copy)
    benchmark.seal(copy, {**json.loads((copy / "MANIFEST.json").read_text()), "name": "mine", entry: value})
    with pytest.raises(UserError, match=f"MANIFEST.json's {entry} is not what a benchmark holds"):
        benchmark.load(str(copy))
