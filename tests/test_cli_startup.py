"""The CLI starts fast: building it (what ``kvdiag --help`` and every argument check do) imports no model, table or
plotting library (issue #39: a refusal in under 1/4 of the torch + transformers import; ``kvdiag bench cli`` times it,
this test checks the import graph)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "safetensors", "polars", "numpy", "pyarrow", "scipy", "matplotlib", "pandas")


def test_cli_imports_no_heavy_library():
    """In a fresh interpreter, importing the console script and building every command (their options' defaults
    included) imports none of HEAVY; a stage loads them when its command runs."""
    code = ("import json, sys, typer\nfrom kvdiag.cli.main import app\ntyper.main.get_command(app)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = set(json.loads(proc.stdout))
    assert {"typer", "rich", "kvdiag"} <= loaded  # the check sees the interpreter's modules
    heavy = sorted(loaded & set(HEAVY))
    assert not heavy, f"kvdiag.cli.main imports {heavy} at start-up: import them inside the command that needs them"


def test_trace_files_fingerprint_is_the_traces():
    """TraceFiles (no torch) tells a Trace by the fingerprint kvdiag.trace.Trace records: the one the shipped
    benchmark recorded, and the sha256 of the weights hash, each prompt id and its torch token ids (the old formula)."""
    import hashlib

    from kvdiag.trace import Trace
    from kvdiag.trace.manifest import TraceFiles

    bench = ROOT / "data" / "kvdiag-bench" / "math500-smollm2@1"
    light, tr = TraceFiles(bench / "trace"), Trace(bench / "trace")
    h = hashlib.sha256(tr.manifest["model"]["weights_hash"].encode())
    for pid in sorted(tr.prompt_ids):
        h.update(pid.encode())
        h.update(tr.token_ids(pid).numpy().tobytes())
    assert len(tr.prompt_ids) > 1
    assert light.fingerprint == tr.fingerprint == h.hexdigest()[:16]
    assert light.fingerprint == json.loads((bench / "MANIFEST.json").read_text())["trace"]["fingerprint"]


def test_known_shape_is_the_loaded_config(tmp_path):
    """model_specs.known_shape (read before torch) gives the layer count and context of the config the model loads
    with: every tiny family's, and a local directory's config.json (its text_config when nested)."""
    from kvdiag.model.load import _tiny_config, byte_tokenizer
    from kvdiag.model.specs import TINY, known_shape

    tok = byte_tokenizer()
    for family in TINY:
        config = _tiny_config(family, tok)
        config = getattr(config, "text_config", None) or config
        assert known_shape(f"tiny:{family}") == {"num_hidden_layers": config.num_hidden_layers,
                                                 "max_position_embeddings": config.max_position_embeddings}, family
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 3,
                                                                            "max_position_embeddings": 512}}))
    assert known_shape(str(tmp_path / "m")) == {"num_hidden_layers": 3, "max_position_embeddings": 512}
    # a hub id is known from the local Hugging Face cache alone (spec_config), which holds no such repository
    assert known_shape("kvdiag-test/not-cached") is None and known_shape("tiny:nope") is None


def test_each_commands_refusal_imports_no_heavy_library(tmp_path):
    """The bad input ``kvdiag bench cli`` times for every command is refused (exit 2) in a fresh interpreter that
    has imported none of HEAVY by then: each refusal costs the CLI's start-up, not a library's import."""
    from kvdiag.cli.bench_cli import REFUSALS

    code = ("import json, sys\nfrom kvdiag.cli.main import main\ntry:\n    main(json.loads(sys.argv[1]))\n"
            "except SystemExit as exc:\n    print(json.dumps([exc.code, sorted({m.split('.')[0] for m in sys.modules})"
            "]))")
    results = {}
    for name, argv in REFUSALS.items():
        proc = subprocess.run([sys.executable, "-c", code, json.dumps([a.format(tmp=tmp_path) for a in argv])],
                              capture_output=True, text=True, cwd=tmp_path, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "KVDIAG_CACHE": str(tmp_path / "cache")})
        exit_code, loaded = json.loads(proc.stdout.strip().splitlines()[-1])
        results[name] = (exit_code, sorted(set(loaded) & set(HEAVY)))
    assert len(results) >= 20 and {"trace", "label", "score", "decisions", "bench cli"} <= set(results)
    assert {name: r for name, r in results.items() if r != (2, [])} == {}


def test_version_prints_the_package_version():
    import kvdiag

    proc = subprocess.run([sys.executable, "-m", "kvdiag", "--version"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"kvdiag {kvdiag.__version__}\n", "")
