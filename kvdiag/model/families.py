"""Model families' attention declarations, importable without torch or transformers: the :data:`FAMILIES` table
(keyed by ``config.model_type``; ``kvdiag.model.adapters`` builds each model's
:class:`~kvdiag.model.adapters.ModelAttention` from
it), which layers slide and how far (:func:`layer_windows` of a config class, :func:`config_windows` of a config.json
read as JSON, where that is exact), and what a bounded cache may do under sliding windows (:func:`check_windows`:
the one check of ``kvdiag replay``'s CLI and of ``Policy.check_model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import Selection


@dataclass(frozen=True)
class Family:
    """How one ``model_type`` attends.

    windows : ``none`` (every layer full), ``config`` (every layer ``config.sliding_window``, full when None),
        ``layer_types`` (``config.layer_types[i]``: sliding_attention -> ``config.sliding_window``).
    softcap : the config attribute holding the attention logit softcap the model passes to attention, or None.
    sinks : learned per-head sink logits (``module.sinks``, passed as ``s_aux``).
    refuse : why the family is refused (None = supported).
    kvpress : why NVIDIA kvpress presses cannot be graded on this family (None = they can): kvpress recomputes queries
        with ``q_proj``/``head_dim`` and full-width RoPE tables, which some families do not have.
    """

    windows: str = "none"
    softcap: str | None = None
    sinks: bool = False
    refuse: str | None = None
    kvpress: str | None = None

    @property
    def needs_eager(self) -> bool:
        """SDPA cannot express a softcap or sinks: such models run (and are recorded) with eager attention."""
        return self.softcap is not None or self.sinks


MLA = ("multi-head latent attention (MLA): the cache holds a compressed latent and q/k (nope + rope) and v "
       "head dims differ; kvdiag records and evicts per-head K/V only")

FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(windows="layer_types"),
    "qwen3": Family(windows="layer_types"),
    "qwen3_moe": Family(windows="config"),
    "mistral": Family(windows="config"),
    "phi3": Family(windows="config", kvpress="partial rotary: kvpress rotates the whole head dim with RoPE tables of "
                   "the rotary dims only"),
    "olmo2": Family(),
    "granite": Family(),
    "cohere": Family(),
    "smollm3": Family(windows="layer_types"),
    "gpt_neox": Family(kvpress="a fused query_key_value projection and no head_dim: kvpress cannot recompute its "
                       "queries"),
    "gemma2": Family(windows="layer_types", softcap="attn_logit_softcapping"),
    "gemma3_text": Family(windows="layer_types"),  # Gemma3 never passes its softcap to attention
    "gpt_oss": Family(windows="layer_types", sinks=True, kvpress="half-width RoPE tables (cos/sin of d/2): kvpress's "
                      "RoPE math needs full-width ones"),
    "deepseek_v2": Family(refuse=MLA),
    "deepseek_v3": Family(refuse=MLA),
}


def layer_windows(cfg, fam: Family) -> list[int | None]:
    """Per-layer sliding window (None = full causal), as the family's masks define it."""
    L = cfg.num_hidden_layers
    if fam.windows == "none":
        return [None] * L
    window = getattr(cfg, "sliding_window", None)
    if fam.windows == "config":
        return [window] * L
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * L
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UserError(f"--model: layer types {unknown} ({cfg.model_type}) are not supported by kvdiag "
                        "(only full and sliding-window attention are honoured exactly)")
    return [window if t == "sliding_attention" else None for t in types]


# Families whose config class turns the window off unless ``use_sliding_window`` (default False): without it, Qwen2,
# Qwen3 and SmolLM3 derive every layer type full and Qwen3-MoE sets sliding_window to None.
SWITCHED = ("qwen2", "qwen3", "qwen3_moe", "smollm3")


def config_windows(config: dict, model_type: str | None) -> list[int | None] | None:
    """Per-layer sliding window of a decoder config read as JSON (``config.json``, a ``tiny:`` family's fields), as
    transformers' config class of ``model_type`` makes it (:func:`layer_windows`), where the JSON alone decides it: a
    family without windows, a switched family (:data:`SWITCHED`) with the switch off and no explicit layer types, or
    every field the family reads written out (``sliding_window``, and ``layer_types`` where it reads them). None where
    the class would fill in a default or derive the layout (a pattern, ``max_window_layers``): the model's load tells.
    tests/test_bad_input.py compares it with the config classes of every tiny family and embedded model."""
    fam = FAMILIES.get(model_type)
    layers = config.get("num_hidden_layers")
    if fam is None or fam.refuse or not isinstance(layers, int):
        return None
    if fam.windows == "none":
        return [None] * layers
    if model_type in SWITCHED:
        on = config.get("use_sliding_window", False)
        return [None] * layers if on is False and "layer_types" not in config else None
    if "sliding_window" not in config or (fam.windows == "layer_types" and "layer_types" not in config):
        return None
    types = config.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != layers):
        return None  # the class refuses it: the load says how
    return layer_windows(SimpleNamespace(**{"layer_types": None, **config, "model_type": model_type}), fam)


def check_windows(windows: list[int | None], selection: Selection, budget: int) -> None:
    """Refuse what a bounded cache of ``budget`` entries under ``selection`` cannot mean on a model whose layers
    attend the sliding ``windows`` (None: full; bad input: UserError): one keep set across sliding and full layers
    (per-token), or a budget that evicts nothing because every layer slides."""
    sliding = sorted({w for w in windows if w is not None})
    if not sliding:
        return
    if selection.per_token:
        raise UserError(f"--selection per-token keeps one set of entries in every layer, but this model's sliding "
                        f"layers (window {sliding[0]}) hold only their recent entries; use per-head")
    if all(w is not None for w in windows) and budget >= sliding[0] - 1:
        raise UserError(f"--budget {budget}: every layer of this model attends a sliding window of {sliding[0]}, so it "
                        f"never holds more than {sliding[0] - 1} visible entries and this budget evicts nothing; use "
                        f"--budget {sliding[0] - 2} or less")
