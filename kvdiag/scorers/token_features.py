"""Token-level read pressure and value payload of scored entries: computed once by ``kvdiag score`` (written
beside the scores as ``<scores>.features.parquet``) and read by the figures, which recompute them from the
Trace only when that file is missing or was made with other settings.

Per (prompt, checkpoint ``t``, entry ``i``), means over layers of each layer's KV-head mean:

- read pressure ``p_i``: ``features.read_pressure`` of the window queries ``[t - w_obs, t)``, normalized over
  the entries of age ``t - i > w_delay`` (AvoKV-E's candidate set; NaN when there is none);
- value payload ``b_i``: ``features.value_payload(v, payload)``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import numpy as np
import polars as pl
import torch

from kvdiag.core.io import read_table
from kvdiag.core.run_layout import features_path  # noqa: F401  (the module's API: where the features lie)
from kvdiag.core.schema import W_DELAY, W_OBS
from kvdiag.model.adapters import LayerAttention
from kvdiag.scorers import features

NO_FILE = "computed from the Trace (no features file beside the scores)"  # where the figures' p and b then come from
SCHEMA = {"prompt_id": pl.String, "checkpoint": pl.Int64, "position": pl.Int64,
          "read_pressure": pl.Float64, "value_payload": pl.Float64}


@dataclass(frozen=True)
class TokenFeatureParams:
    """How ``p`` and ``b`` are defined (the figures' ``w_obs``, ``w_delay``, ``payload``)."""

    w_obs: int = W_OBS
    w_delay: int = W_DELAY
    payload: str = "l2"  # a kind of features.value_payload computable from the Trace alone (not wo_l2)


def layer_pressure_payload(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: LayerAttention | float,
    positions: dict[int, torch.Tensor], params: TokenFeatureParams,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Read pressure and value payload of one layer, KV-head means.

    q [H, T, d], k/v [Hkv, T, d] (fp32, T >= every checkpoint); ``positions[t]`` LongTensor [n_t] of entries at
    checkpoint ``t``. Returns ``{t: (p [n_t], b [n_t])}``.
    """
    b_all = features.value_payload(v, params.payload).mean(dim=0)  # [T]: a payload does not depend on t
    out = {}
    for t, pos in positions.items():
        eligible = torch.arange(t) < t - params.w_delay  # age t - i > w_delay
        if not bool(eligible.any()):
            p = torch.full((len(pos),), float("nan"))
        else:
            attn = features.window_attention(q[:, :t], k[:, :t], scale, params.w_obs)
            p = features.read_pressure(attn, eligible, k.shape[0]).mean(dim=0)[pos]
        out[t] = (p, b_all[pos])
    return out


@dataclass
class PromptSums:
    """:func:`layer_pressure_payload` of one prompt summed over its layers (float64, in layer order); ``finish``
    gives its rows ``(prompt_id, checkpoint, position, read_pressure, value_payload)``, the means over layers."""

    params: TokenFeatureParams
    pid: str
    positions: dict[int, torch.Tensor]
    num_layers: int

    def __post_init__(self):
        self.p = {t: torch.zeros(len(pos), dtype=torch.float64) for t, pos in self.positions.items()}
        self.b = {t: torch.zeros(len(pos), dtype=torch.float64) for t, pos in self.positions.items()}

    def add_layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: LayerAttention | float) -> None:
        for t, (p, b) in layer_pressure_payload(q, k, v, scale, self.positions, self.params).items():
            self.p[t] += p.double()
            self.b[t] += b.double()

    def finish(self) -> pl.DataFrame:
        ts = list(self.positions)
        return pl.DataFrame({
            "prompt_id": self.pid, "checkpoint": np.concatenate([np.full(len(self.positions[t]), t) for t in ts]),
            "position": np.concatenate([self.positions[t].numpy() for t in ts]),
            "read_pressure": np.concatenate([(self.p[t] / self.num_layers).numpy() for t in ts]),
            "value_payload": np.concatenate([(self.b[t] / self.num_layers).numpy() for t in ts]),
        }, schema=SCHEMA)


@dataclass
class TokenFeatures:
    """The rows of every prompt scored (:class:`PromptSums`, kept with ``add``) and their metadata."""

    params: TokenFeatureParams = field(default_factory=TokenFeatureParams)
    frames: list[pl.DataFrame] = field(default_factory=list)

    def add(self, sums: PromptSums) -> None:
        self.frames.append(sums.finish())

    def table(self) -> pl.DataFrame:
        return pl.concat(self.frames) if self.frames else pl.DataFrame(schema=SCHEMA)

    def meta(self, trace_provenance: dict) -> dict:
        return {"kind": "token_features", "trace": trace_provenance, "params": asdict(self.params),
                "definition": __doc__.split("\n\n", 1)[1].strip()}


def read_token_features(scores: str | os.PathLike) -> tuple[pl.DataFrame, dict] | None:
    """The features table written beside ``scores`` and its metadata (with the file's name under ``file``), or
    None when there is none."""
    path = features_path(scores)
    if not path.is_file():
        return None
    df, meta = read_table(path, "the features table")
    return df, {**meta, "file": path.name}


def usable_features(
    features: tuple[pl.DataFrame, dict] | None, params: TokenFeatureParams, trace
) -> tuple[pl.DataFrame | None, str]:
    """``features`` (a table and its metadata, :func:`read_token_features`) when made with ``params`` from
    ``trace``, else None; and a sentence saying which (the figures record it). Another Trace's table is refused."""
    if features is None:
        return None, NO_FILE
    df, meta = features
    name = meta.get("file", "the features table")
    if meta.get("kind") != "token_features" or meta.get("params") != asdict(params):
        return (
            None,
            f"computed from the Trace ({name} was made with {meta.get('params')}, the figures use {asdict(params)})",
        )
    if trace is not None:
        from kvdiag.core.contracts import belongs

        belongs(trace, meta, name)
    return df, f"read from {name} (written by kvdiag score)"
