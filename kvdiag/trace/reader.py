"""``Trace``: a lazy reader of a Trace directory (format: docs/trace.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch
from safetensors import safe_open

from kvdiag.core.errors import UserError
from kvdiag.model.adapters import LayerAttention, ModelAttention
from kvdiag.model.attention import attention_rows
from kvdiag.trace.manifest import MANIFEST_KEYS, TraceFiles, read_trace_files  # noqa: F401  (the reader's API)
from kvdiag.trace.writer import MAX_VALUE, STORAGE_DTYPES, layer_file, out_of_range, stored_names

REBUILD_CHUNK = 8192  # prefill positions per forward when rebuilding: bounds activations ([chunk, T] scores)


@dataclass
class LayerQKV:
    """One layer of one prompt: q [H, T, d], k [Hkv, T, d], v [Hkv, T, d] in the storage dtype."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class Trace(TraceFiles):
    """Opens a Trace directory; tensors are read per (prompt, layer) on demand. What a ``--store`` mode did not
    write is rebuilt by one teacher-forced prefill per prompt through ``model`` (a LoadedModel), or through the
    manifest's model, loaded on first need and checked against its weights hash. The manifest, lengths and
    fingerprint: :class:`~kvdiag.trace.manifest.TraceFiles`."""

    def __init__(self, path: str | Path, model=None):
        super().__init__(path)
        m = self.manifest
        # per-layer semantics (window, softcap, sinks) recorded from kvdiag.model.adapters; older Traces: plain causal
        self.attention_layers: list[LayerAttention] = ModelAttention.layers_from_info(
            m["model"].get("attention"), self.num_layers, self.scale)
        # a Trace from before --store holds every layer's q/k/v
        self.store: dict = m.get("store") or {"mode": "all", "layers": list(range(self.num_layers))}
        self.storage_dtype = STORAGE_DTYPES[m.get("storage_dtype", "float16")]
        self.rebuild_chunk = REBUILD_CHUNK
        self._model = model
        if model is not None:
            self._check_model(model)
        self._rebuilt: tuple[str, list[dict[str, torch.Tensor]]] | None = None  # (pid, per-layer q/k/v): one prompt

    def layer_attention(self, layer: int) -> LayerAttention:
        """The attention semantics of ``layer`` (scale, sliding window, softcap, sinks), as recorded."""
        return self.attention_layers[layer]

    def token_ids(self, pid: str) -> torch.Tensor:
        """LongTensor [T]."""
        self._prompt(pid)
        ids = self.tokens.filter(pl.col("prompt_id") == pid).sort("position")["token_id"]
        return torch.tensor(ids.to_list(), dtype=torch.long)

    def layer(self, pid: str, layer: int) -> LayerQKV:
        """q [H, T, d], k [Hkv, T, d], v [Hkv, T, d] of ``layer`` (storage dtype; cast as needed). Stored tensors
        are read from disk; the others (``--store kv|none|LAYERS``) come from a rebuild of the prompt."""
        T = self.length(pid)
        if not 0 <= layer < self.num_layers:
            raise UserError(f"--trace {self.path}: layer {layer} does not exist; the model has layers "
                            f"0..{self.num_layers - 1}")
        names = stored_names(self.store, layer)
        found = self._read(pid, layer, names) if names else {}
        if len(found) < 3:
            rebuilt = self._rebuild(pid, layer, [n for n in "qkv" if n not in found])
            found = {**rebuilt, **found}  # stored tensors win: exact, and the rebuild only fills the gaps
        qkv = LayerQKV(found["q"], found["k"], found["v"])
        if (got := tuple(tuple(x.shape) for x in (qkv.q, qkv.k, qkv.v))) != (want := self._shapes(T)):
            if all(len(shape) == 3 for shape in got) and got[1][1] != T:  # another prompt's file, or a cut one
                raise UserError(f"--trace {self.path}: layer {layer} of {pid} holds {got[1][1]} positions, manifest "
                                f"says {T}; the Trace is corrupt")
            raise UserError(f"--trace {self.path}: layer {layer} of {pid} holds q, k, v of shapes {got}, manifest says "
                            f"{want}; the Trace is corrupt")
        dtype = str(self.storage_dtype).removeprefix("torch.")
        if other := [f"{n} ({found[n].dtype})" for n in "qkv" if found[n].dtype != self.storage_dtype]:
            raise UserError(f"--trace {self.path}: layer {layer} of {pid} holds {', '.join(other)} where the manifest "
                            f"says {dtype}; the Trace is corrupt")
        for name in "qkv":  # a flipped byte or a value past the storage dtype's range: every stage would read it
            bad = out_of_range(found[name])
            if bool(bad.any()):
                where = int(bad.nonzero()[0, 1])
                raise UserError(f"--trace {self.path}: layer {layer} of {pid} holds a {name} value that is not "
                                f"finite or past {MAX_VALUE:.0e} at position {where} "
                                f"({'stored' if name in names else 'rebuilt'} in {dtype}); the Trace is corrupt or "
                                "its values overflow its storage dtype: re-run `kvdiag trace` into a new directory "
                                "(--storage-dtype float32 for values past float16's range)")
        return qkv

    def _shapes(self, T: int) -> tuple[tuple[int, ...], ...]:
        """The shapes of q, k, v of a layer of ``T`` positions the manifest says: heads, positions and (where the
        model's attention record has them) the q/k and v head dims, else head_dim."""
        attention = self.manifest["model"].get("attention") or {}
        qk, vd = attention.get("qk_head_dim", self.head_dim), attention.get("v_head_dim", self.head_dim)
        return (self.num_heads, T, qk), (self.num_kv_heads, T, qk), (self.num_kv_heads, T, vd)

    def _read(self, pid: str, layer: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The stored tensors ``names`` of one layer file (a missing or unreadable file is a truncated Trace)."""
        path = layer_file(self.path, pid, layer)
        if not path.is_file():
            raise UserError(f"--trace {self.path}: {path.relative_to(self.path)} is missing (truncated Trace); re-run "
                            "`kvdiag trace` into a new directory")
        try:
            with safe_open(str(path), framework="pt") as f:
                return {name: f.get_tensor(name) for name in names}
        except Exception as err:  # safetensors raises its own error types for truncated files
            raise UserError(
                f"--trace {self.path}: {path.name} of {pid} is unreadable ({err}); re-run `kvdiag trace`"
            ) from err

    def _rebuild(self, pid: str, layer: int, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` of ``layer`` from the prompt's rebuild; all layers of the prompt are rebuilt at
        once (one prefill) and kept until another prompt is rebuilt."""
        if self._rebuilt is None or self._rebuilt[0] != pid:
            self._rebuilt = None  # free the previous prompt's tensors before the next prefill
            lm = self.model(f"{', '.join(names)} of layer {layer} of {pid}")
            self._rebuilt = (pid, rebuild_layers(lm, self.token_ids(pid), self.storage_dtype, self.rebuild_chunk))
        return {name: self._rebuilt[1][layer][name] for name in names}

    def model(self, needed: str = "the tensors it does not store"):
        """The LoadedModel that rebuilds what this Trace does not store: the one given, else the manifest's
        (spec, dtype, revision), loaded once and checked against the recorded weights hash."""
        if self._model is None:
            from kvdiag.model.load import check_device, load_model

            had = self.manifest["model"]
            device = had.get("device", "cpu")
            try:
                check_device(device)
            except UserError:
                device = "cpu"  # traced on a GPU this machine lacks: the rebuild runs on the CPU
            try:
                lm = load_model(
                    had["spec"], dtype=had.get("dtype", "float32"), device=device, revision=had.get("revision")
                )
            except Exception as err:  # a spec that is not loadable here (path, hub id, plugin)
                reason = " ".join(str(err).split()) or type(err).__name__
                raise UserError(
                    f"--trace {self.path} stores no {needed} (--store {self.store['mode']}) and its model "
                    f"{had['spec']} cannot be loaded here to rebuild them ({reason}); use a Trace traced "
                    "with --store all"
                ) from err
            self._check_model(lm)
            self.check_vocabulary(lm)  # a .gguf or random: model's vocabulary is known only now
            self._model = lm
        return self._model

    def use_model(self, lm) -> None:
        """Rebuild what this Trace does not store with ``lm`` (a model already loaded, checked against the recorded
        one) rather than loading another copy."""
        if self._model is not lm:
            self._check_model(lm)
            self.check_vocabulary(lm)
            self._model = lm

    def check_vocabulary(self, lm) -> None:
        """Refuse a Trace holding a token id beyond ``lm``'s vocabulary (an edited tokens.parquet; with the Trace's
        own model nothing else writes one): the embedding lookup would fail mid-run."""
        size = lm.model.get_input_embeddings().num_embeddings
        top = int(self.tokens["token_id"].max())
        if top >= size:
            raise UserError(f"--trace {self.path}: tokens.parquet holds token id {top}, beyond the vocabulary of "
                            f"{lm.spec} ({size}); the Trace is corrupt or of another model: re-run `kvdiag trace`")

    def _check_model(self, lm) -> None:
        had = self.manifest["model"]
        lm.check_model_of(had, f"--trace {self.path}: model", "cannot rebuild its tensors with it")
        if lm.dtype != had.get("dtype", lm.dtype):  # another compute dtype would rebuild other numbers than were traced
            raise UserError(f"--trace {self.path}: model {lm.spec} runs in {lm.dtype}, the Trace was made in "
                            f"{had['dtype']}; load it with dtype={had['dtype']!r} to rebuild its tensors")

    def attention(self, pid: str, layer: int, query_positions, key_limit: int | None = None) -> torch.Tensor:
        """Exact fp32 attention [H, W, T | key_limit] of the queries at ``query_positions``, recomputed from q, k
        with the layer's window, softcap and sinks (rows of a layer with sinks sum to less than 1)."""
        pos = torch.as_tensor(query_positions, dtype=torch.long)
        qkv = self.layer(pid, layer)
        return attention_rows(qkv.q[:, pos], qkv.k, pos, self.layer_attention(layer), key_limit=key_limit)


@torch.no_grad()
def rebuild_layers(
    lm, ids: torch.Tensor, dtype: torch.dtype, chunk: int = REBUILD_CHUNK
) -> list[dict[str, torch.Tensor]]:
    """Teacher-forced prefill of ``ids`` [T] through the recording attention function: per layer q [H, T, d],
    k [Hkv, T, d], v [Hkv, T, d] in ``dtype``. Forwards of ``chunk`` positions over a growing cache (one forward
    when T <= chunk); the recorder keeps each forward's newest rows, so the result is the whole prompt."""
    from kvdiag.cache import PositionedCache
    from kvdiag.trace.hooks import Recorder, recording

    model = lm.model
    n_layers = model.config.num_hidden_layers
    rec = Recorder(n_layers, dtype, capacity=len(ids))
    ids = ids.to(model.device).view(1, -1)
    cache = PositionedCache.for_model(model, capacity=ids.shape[1])
    with recording(model, rec):
        for start in range(0, ids.shape[1], chunk):
            part = ids[:, start : start + chunk]
            pos = torch.arange(start, start + part.shape[1], device=model.device).view(1, -1)
            model(part, cache=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
    return [rec.layer(l) for l in range(n_layers)]
