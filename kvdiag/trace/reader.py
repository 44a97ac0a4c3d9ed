"""``Trace``: a lazy reader of a Trace directory (format: README, "Trace format")."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import polars as pl
import torch
from safetensors import safe_open

from kvdiag.adapters import LayerAttention, ModelAttention
from kvdiag.attention import attention_rows
from kvdiag.errors import UserError
from kvdiag.trace.writer import layer_file


@dataclass
class LayerQKV:
    """One layer of one prompt: q [H, T, d], k [Hkv, T, d], v [Hkv, T, d] in the storage dtype."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


MANIFEST_KEYS = ("prompts", "model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "scale")


class Trace:
    """Opens a Trace directory; tensors are read per (prompt, layer) on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest = self.path / "manifest.json"
        if not manifest.is_file():
            raise UserError(f"--trace {self.path}: not a Trace directory (no manifest.json); run `kvdiag trace` first")
        try:
            self.manifest: dict = json.loads(manifest.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"--trace {self.path}: manifest.json is corrupt ({err.msg}); re-run `kvdiag trace`") from err
        tokens = self.path / "tokens.parquet"
        if not tokens.is_file():
            raise UserError(f"--trace {self.path}: tokens.parquet is missing (truncated Trace); re-run `kvdiag trace` with the same --out to repair it")
        m = self.manifest
        missing = [k for k in MANIFEST_KEYS if not isinstance(m, dict) or k not in m]
        if missing or not isinstance(m["prompts"], dict) or not isinstance(m["model"], dict):
            raise UserError(f"--trace {self.path}: manifest.json is not a kvdiag Trace manifest (missing or malformed: "
                            f"{', '.join(missing) or 'prompts/model'}); re-run `kvdiag trace` into a new directory")
        try:
            self.tokens: pl.DataFrame = pl.read_parquet(tokens)
        except Exception as err:  # polars raises many types for corrupt files
            raise UserError(f"--trace {self.path}: tokens.parquet is unreadable ({type(err).__name__}); re-run `kvdiag trace` "
                            "with the same --out to rebuild it") from err
        if missing := {"prompt_id", "position", "token_id"} - set(self.tokens.columns):
            raise UserError(f"--trace {self.path}: tokens.parquet lacks the column(s) {', '.join(sorted(missing))}; the Trace is corrupt")
        self.prompt_ids: list[str] = list(m["prompts"])
        self.num_layers, self.num_heads = m["num_layers"], m["num_heads"]
        self.num_kv_heads, self.head_dim, self.scale = m["num_kv_heads"], m["head_dim"], m["scale"]
        # per-layer semantics (window, softcap, sinks) recorded from kvdiag.adapters; older Traces: plain causal
        self.attention_layers: list[LayerAttention] = ModelAttention.layers_from_info(
            m["model"].get("attention"), self.num_layers, self.scale)

    def layer_attention(self, layer: int) -> LayerAttention:
        """The attention semantics of ``layer`` (scale, sliding window, softcap, sinks), as recorded."""
        return self.attention_layers[layer]

    def _prompt(self, pid: str) -> dict:
        if pid not in self.manifest["prompts"]:
            raise UserError(f"prompt {pid!r} is not in the Trace {self.path}; it has {', '.join(self.prompt_ids[:5])}...")
        return self.manifest["prompts"][pid]

    def length(self, pid: str) -> int:
        """T: prompt plus generated tokens."""
        return self._prompt(pid)["length"]

    def prompt_len(self, pid: str) -> int:
        return self._prompt(pid)["prompt_len"]

    def token_ids(self, pid: str) -> torch.Tensor:
        """LongTensor [T]."""
        self._prompt(pid)
        ids = self.tokens.filter(pl.col("prompt_id") == pid).sort("position")["token_id"]
        return torch.tensor(ids.to_list(), dtype=torch.long)

    def layer(self, pid: str, layer: int) -> LayerQKV:
        """q [H, T, d], k [Hkv, T, d], v [Hkv, T, d] of ``layer`` (storage dtype; cast as needed)."""
        T = self.length(pid)
        path = layer_file(self.path, pid, layer)
        if not path.is_file():
            raise UserError(f"--trace {self.path}: {path.relative_to(self.path)} is missing (truncated Trace); re-run `kvdiag trace` into a new directory")
        try:
            with safe_open(str(path), framework="pt") as f:
                qkv = LayerQKV(f.get_tensor("q"), f.get_tensor("k"), f.get_tensor("v"))
        except Exception as err:  # safetensors raises its own error types for truncated files
            raise UserError(f"--trace {self.path}: {path.name} of {pid} is unreadable ({err}); re-run `kvdiag trace`") from err
        if qkv.q.shape[1] != T or qkv.k.shape[1] != T:
            raise UserError(f"--trace {self.path}: {path.name} of {pid} holds {qkv.k.shape[1]} positions, manifest says {T}; the Trace is corrupt")
        return qkv

    def attention(self, pid: str, layer: int, query_positions, key_limit: int | None = None) -> torch.Tensor:
        """Exact fp32 attention [H, W, T | key_limit] of the queries at ``query_positions``, recomputed from q, k
        with the layer's window, softcap and sinks (rows of a layer with sinks sum to less than 1)."""
        pos = torch.as_tensor(query_positions, dtype=torch.long)
        qkv = self.layer(pid, layer)
        return attention_rows(qkv.q[:, pos], qkv.k, pos, self.layer_attention(layer), key_limit=key_limit)

    @cached_property
    def fingerprint(self) -> str:
        """Identifies the traced content: model weights and every prompt's token ids."""
        h = hashlib.sha256(self.manifest["model"]["weights_hash"].encode())
        for pid in sorted(self.prompt_ids):
            h.update(pid.encode())
            h.update(self.token_ids(pid).numpy().tobytes())
        return h.hexdigest()[:16]

    @property
    def provenance(self) -> dict:
        """What outputs derived from this Trace record about it."""
        return {"path": str(self.path), "fingerprint": self.fingerprint, "model": self.manifest["model"]["spec"]}

    def check_belongs(self, meta: dict, what: str) -> None:
        """Refuse a table whose metadata names another Trace."""
        other = (meta.get("trace") or {}).get("fingerprint")
        if other is not None and other != self.fingerprint:
            raise UserError(f"{what} was made from another Trace (fingerprint {other}, this one {self.fingerprint}); pass the matching --trace")
