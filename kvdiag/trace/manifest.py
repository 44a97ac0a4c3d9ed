"""A Trace directory's manifest and token table, read and checked without torch: :class:`TraceFiles` (its shapes,
lengths and fingerprint) is what the CLI checks ``--trace`` and the tables made from it with before any heavy import;
``kvdiag.trace.Trace`` adds the tensors on top of it."""

from __future__ import annotations

import hashlib
import json
import math
import os
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import STORAGE_DTYPE_NAMES, STORE_WORDS

if TYPE_CHECKING:  # polars loads once the manifest is read: a missing or corrupt one is refused without it
    import polars as pl

MANIFEST_KEYS = ("prompts", "model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "scale")


def read_trace_files(path: str | Path) -> tuple[dict, pl.DataFrame]:
    """(manifest, tokens) of the Trace directory ``path``; a missing, corrupt or truncated one is one ``UserError``
    line naming ``--trace``."""
    path = Path(path)
    manifest_file = path / "manifest.json"
    if not manifest_file.is_file():
        raise UserError(f"--trace {path}: not a Trace directory (no manifest.json); run `kvdiag trace` first")
    try:
        manifest: dict = json.loads(manifest_file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(
            f"--trace {path}: manifest.json is corrupt ({err.msg}); re-run `kvdiag trace`"
        ) from err
    tokens = path / "tokens.parquet"
    if not tokens.is_file():
        raise UserError(f"--trace {path}: tokens.parquet is missing (truncated Trace); re-run `kvdiag trace` "
                        "with the same --out to repair it")
    m = manifest
    missing = [k for k in MANIFEST_KEYS if not isinstance(m, dict) or k not in m]
    if missing or not isinstance(m["prompts"], dict) or not isinstance(m["model"], dict):
        raise UserError(f"--trace {path}: manifest.json is not a kvdiag Trace manifest (missing or malformed: "
                        f"{', '.join(missing) or 'prompts/model'}); re-run `kvdiag trace` into a new directory")
    if bad := _malformed(m):
        raise UserError(f"--trace {path}: manifest.json is not a kvdiag Trace manifest (malformed: {bad}); re-run "
                        "`kvdiag trace` into a new directory")
    import polars as pl

    try:
        tokens_df: pl.DataFrame = pl.read_parquet(tokens, glob=False)
    except Exception as err:  # polars raises many types for corrupt files
        raise UserError(f"--trace {path}: tokens.parquet is unreadable ({type(err).__name__}); re-run "
                        "`kvdiag trace` with the same --out to rebuild it") from err
    if missing := {"prompt_id", "position", "token_id"} - set(tokens_df.columns):
        raise UserError(f"--trace {path}: tokens.parquet lacks the column(s) {', '.join(sorted(missing))}; "
                        "the Trace is corrupt")
    corrupt = "the Trace is corrupt: re-run `kvdiag trace` into a new directory"
    if wrong := [f"{c} ({tokens_df.schema[c]})" for c in ("position", "token_id")
                 if not tokens_df.schema[c].is_integer()]:
        raise UserError(f"--trace {path}: tokens.parquet holds {', '.join(wrong)} where integers belong; {corrupt}")
    if nulls := [c for c in ("prompt_id", "position", "token_id") if tokens_df[c].null_count()]:
        raise UserError(f"--trace {path}: tokens.parquet holds empty (null) {', '.join(nulls)}; {corrupt}")
    # every prompt's tokens at positions 0 .. length - 1, once each (a length edited to 10**9 sized buffers by it)
    got = {r[0]: r[1:] for r in tokens_df.group_by("prompt_id").agg(
        pl.len(), pl.col("position").n_unique().alias("unique"), pl.col("position").min().alias("low"),
        pl.col("position").max().alias("high"), pl.col("token_id").min().alias("token"),
        pl.col("token_id").max().alias("top")).iter_rows()}
    for pid, prompt in m["prompts"].items():
        n, unique, low, high, token, _ = got.get(pid, (0, 0, None, None, None, None))
        if not n == unique == prompt["length"] or low != 0 or high != n - 1:
            raise UserError(f"--trace {path}: tokens.parquet holds {n} tokens of prompt {pid!r} at {unique} "
                            f"positions where manifest.json says {prompt['length']} (0 to {prompt['length'] - 1}); "
                            f"{corrupt}")
        if token < 0:
            raise UserError(f"--trace {path}: tokens.parquet holds token id {token} in prompt {pid!r}; {corrupt}")
    if extra := sorted(set(got) - set(m["prompts"]), key=str):
        raise UserError(f"--trace {path}: tokens.parquet holds tokens of prompt {extra[0]!r}, which manifest.json "
                        f"does not list; {corrupt}")
    from kvdiag.model.specs import spec_vocabulary  # None where only a load can tell: Trace.check_vocabulary then

    top = max((r[-1] for r in got.values()), default=-1)
    if (size := spec_vocabulary(m["model"]["spec"], m["model"].get("revision"))) is not None and top >= size:
        raise UserError(f"--trace {path}: tokens.parquet holds token id {top}, beyond the vocabulary of its model "
                        f"{m['model']['spec']} ({size}); {corrupt}")
    return manifest, tokens_df


MAX_SHAPE, MAX_TOKENS = 1 << 16, 1 << 24  # layers, heads, head dim; tokens of one prompt
FORMAT_VERSION = 1  # the manifest's format_version kvdiag trace writes (kvdiag.trace.writer)


def _malformed(m: dict) -> str:
    """The first field of a manifest that no ``kvdiag trace`` writes ('' when none): the model's shape as counts
    equal to the recorded model's (num_heads a multiple of num_kv_heads, one attention record per layer), the model's
    spec, weights hash and dtype as text, a storage dtype kvdiag knows, a format version up to this kvdiag's, a
    positive finite scale (or none), each prompt's lengths as ``1 <= prompt_len <= length``."""
    def count(v, top: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= top

    model = m["model"]
    for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
        if not count(m[key], MAX_SHAPE):
            return f"{key} {m[key]!r}"
        if key in model and model[key] != m[key]:  # the shape is the recorded model's
            return f"{key} {m[key]} where model.{key} is {model[key]!r}"
    if m["num_heads"] % m["num_kv_heads"]:
        return f"num_heads {m['num_heads']} is not a multiple of num_kv_heads {m['num_kv_heads']}"
    for key in ("spec", "weights_hash", "dtype"):  # what names and loads the Trace's model, and its fingerprint
        if not isinstance(model.get(key), str) or not model[key]:
            return f"model.{key} {model.get(key)!r}"
    attention = model["attention"] if isinstance(model.get("attention"), dict) else {}
    layers = attention.get("layers")
    if layers is not None and (not isinstance(layers, list) or len(layers) != m["num_layers"]):
        return f"model.attention.layers (not one per layer of {m['num_layers']})"
    for i, layer in enumerate(layers or []):  # what every attention recomputed from the Trace honours
        if bad := _bad_layer(layer, m["num_heads"]):
            return f"model.attention.layers[{i}].{bad}"
    windows = attention.get("windows")
    if windows is not None and not (isinstance(windows, list) and len(windows) == m["num_layers"]
                                    and all(w is None or count(w, MAX_TOKENS) for w in windows)):
        return "model.attention.windows (not one window, none or a positive count, per layer)"
    store = m.get("store")
    if store is not None and not (
            isinstance(store, dict) and store.get("mode") in (*STORE_WORDS, "layers")
            and isinstance(store.get("layers"), list)
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < m["num_layers"]
                    for x in store["layers"]) and len(set(store["layers"])) == len(store["layers"])):
        return "store (its mode is not all, kv, none or layers, or its layers are not distinct layers of the model)"
    if m.get("storage_dtype", "float16") not in STORAGE_DTYPE_NAMES:
        return f"storage_dtype {m['storage_dtype']!r}"
    if not count(m.get("format_version", 1), FORMAT_VERSION):  # a newer kvdiag's Trace may store other things
        return f"format_version {m['format_version']!r} (this kvdiag reads up to {FORMAT_VERSION})"
    scale = m["scale"]
    if scale is not None and not (isinstance(scale, int | float) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale > 0):
        return f"scale {scale!r}"
    for pid, p in m["prompts"].items():
        if not (isinstance(p, dict) and count(p.get("prompt_len"), MAX_TOKENS)
                and count(p.get("length"), MAX_TOKENS) and p["prompt_len"] <= p["length"]):
            return f"prompt {pid!r}: its prompt_len and length"
    return ""


def _bad_layer(layer, num_heads: int) -> str:
    """The first field of one layer's attention record (``LayerAttention.to_info``) that no trace writes ('' when
    none): scale a positive finite number, window none or a positive count, softcap none or positive finite, sinks
    none or one finite number per query head."""
    def number(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    if not isinstance(layer, dict):
        return f"{layer!r}"
    scale, window, softcap, sinks = (layer.get(k) for k in ("scale", "window", "softcap", "sinks"))
    if not (number(scale) and scale > 0):
        return f"scale {scale!r}"
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool)
                                   and 1 <= window <= MAX_TOKENS):
        return f"window {window!r}"
    if softcap is not None and not (number(softcap) and softcap > 0):
        return f"softcap {softcap!r}"
    if sinks is not None and not (isinstance(sinks, list) and len(sinks) == num_heads and all(map(number, sinks))):
        return f"sinks (not {num_heads} finite numbers, one per query head)"
    return ""


class TraceFiles:
    """A Trace directory's manifest and tokens (no tensors, no torch): its prompts, their lengths, the model's
    shape and the fingerprint that tables made from it record."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest, self.tokens = read_trace_files(self.path)
        m = self.manifest
        self.prompt_ids: list[str] = list(m["prompts"])
        self.num_layers, self.num_heads = m["num_layers"], m["num_heads"]
        self.num_kv_heads, self.head_dim, self.scale = m["num_kv_heads"], m["head_dim"], m["scale"]

    def check_vocabulary_of(self, spec: str, revision: str | None = None) -> None:
        """Before ``--model spec`` loads (another model than the Trace's, ``--force``): refuse it when its config's
        vocabulary lacks a token id of the Trace, where feeding the tokens to it would fail mid-run."""
        from kvdiag.model.specs import spec_vocabulary

        size, top = spec_vocabulary(spec, revision), int(self.tokens["token_id"].max())
        if size is not None and top >= size:
            raise UserError(f"--model {spec} has a vocabulary of {size} tokens and the Trace {self.path} holds token "
                            f"id {top}; use the Trace's model ({self.manifest['model']['spec']})")

    def _prompt(self, pid: str) -> dict:
        if pid not in self.manifest["prompts"]:
            raise UserError(f"prompt {pid!r} is not in the Trace {self.path}; it has "
                            f"{', '.join(self.prompt_ids[:5])}...")
        return self.manifest["prompts"][pid]

    def length(self, pid: str) -> int:
        """T: prompt plus generated tokens."""
        return self._prompt(pid)["length"]

    def prompt_len(self, pid: str) -> int:
        return self._prompt(pid)["prompt_len"]

    @cached_property
    def fingerprint(self) -> str:
        """Identifies the traced content: the model's weights hash, then each prompt id (sorted) and its token ids in
        position order as little-endian int64 bytes."""
        import polars as pl

        h = hashlib.sha256(self.manifest["model"]["weights_hash"].encode())
        for pid in sorted(self.prompt_ids):
            self._prompt(pid)
            ids = self.tokens.filter(pl.col("prompt_id") == pid).sort("position")["token_id"]
            h.update(pid.encode())
            h.update(ids.cast(pl.Int64).to_numpy().astype("<i8").tobytes())
        return h.hexdigest()[:16]

    @property
    def provenance(self) -> dict:
        """What outputs derived from this Trace record about it."""
        return {"path": str(self.path), "fingerprint": self.fingerprint, "model": self.manifest["model"]["spec"]}

    def check_layer_files(self) -> None:
        """Refuse a stored layer file (``tensors/<prompt>/layer_<LLL>.safetensors``) whose header is cut or does not
        fit its size (``kvdiag.core.safetensors_header.safetensors_fault``), without reading its tensors;
        ``kvdiag.trace.Trace`` reads them and refuses any other fault."""
        from kvdiag.core.safetensors_header import safetensors_fault

        for pid in self.prompt_ids:
            for path in sorted((self.path / "tensors" / pid).glob("layer_*.safetensors")):
                if fault := safetensors_fault(path):
                    raise UserError(f"--trace {self.path}: {path.name} of {pid} is unreadable ({fault}); re-run "
                                    "`kvdiag trace`")


def check_continuation(out: str | os.PathLike, model: str, settings) -> None:
    """Before the model loads: refuse to continue the (possibly partial) Trace in ``out`` with another ``--model``
    (``kvdiag.model.specs.check_trace_model``: names and configs) or other generation ``settings`` (a
    ``GenerationSettings``); the writer checks the loaded model's weights against it again."""
    from dataclasses import asdict

    from kvdiag.model.specs import check_trace_model

    out = Path(out)
    header = next((p for p in (out / "manifest.json", out / "parts" / "_header.json") if p.is_file()), None)
    if header is None:
        return
    try:
        existing = json.loads(header.read_text())
        recorded, generation = existing["model"], existing["generation"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a Trace's header: the output guard and the writer say so
    try:
        check_trace_model(model, recorded, fix="choose a new output directory, or the Trace's model")
    except UserError as err:
        raise UserError(f"--out {out} holds a Trace of another model: {err}") from None
    if {"store": "all", **generation} != asdict(settings):  # a Trace from before --store has every tensor
        raise UserError(f"--out {out} holds a Trace made with other generation settings; choose a new output "
                        "directory or the same settings")
