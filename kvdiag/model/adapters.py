"""Model-family adapters: the one place that knows a family's attention semantics.

Every part of kvdiag that computes or recomputes attention (recording, the oracle and its kernels,
``Trace.attention``, the scorers' features, figures, replay) takes it from a :class:`ModelAttention`:
per layer the softmax scale, the sliding window (``None`` = full causal), the tanh logit softcap and the
per-query-head sink logits; per model the head counts, the q/k and v head dims, what the cache holds,
and the attention implementation that reproduces the model (``eager`` where SDPA cannot express it).

Families are a table (:data:`FAMILIES`), keyed by ``config.model_type``. A family not in the table, or a
model whose attention the adapter cannot honour (MLA latents, chunked attention, ...), is refused at load
with one line (:class:`kvdiag.core.errors.UserError`): a refusal, never a silently wrong number.

Window rule (transformers 5.x ``masking_utils.sliding_window_overlay``): a query at absolute position
``q`` sees key ``k`` iff ``q - window < k <= q``.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvdiag.core.errors import UserError
from kvdiag.model.families import FAMILIES, MLA, Family, layer_windows  # noqa: F401  (the adapter's API)


@dataclass(frozen=True)
class LayerAttention:
    """Attention semantics of one layer.

    scale : multiplies q·k.
    window : ``None`` (full causal) or W: query ``q`` sees keys ``q - W < k <= q``.
    softcap : ``None`` or c: logits become ``c * tanh(logits / c)`` (after scaling, before masking; Gemma2).
    sinks : ``None`` or fp32 [H]: one extra logit per query head in the softmax denominator (GPT-OSS);
        its probability is dropped, so the returned rows over the keys sum to less than 1.
    """

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)

    @property
    def plain(self) -> bool:
        """Plain causal softmax attention (no window, softcap or sinks)."""
        return self.window is None and self.softcap is None and self.sinks is None

    def logits(self, raw: torch.Tensor) -> torch.Tensor:
        """Scaled (and soft-capped) logits from raw q·k products (fp32, in place when possible)."""
        x = raw * self.scale
        if self.softcap is not None:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x

    def hidden(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """bool [W, T]: True where the query at ``query_pos [W]`` does not see the key at ``key_pos [T]``."""
        hide = key_pos[None, :] > query_pos[:, None]
        if self.window is not None:
            hide |= key_pos[None, :] <= query_pos[:, None] - self.window
        return hide

    def first_visible(self, query_pos: int) -> int:
        """The smallest key position the query at ``query_pos`` sees."""
        return 0 if self.window is None else max(0, query_pos - self.window + 1)

    def softmax(self, logits: torch.Tensor, heads_dim: int = 0) -> torch.Tensor:
        """Probabilities over the last axis of masked logits [..., T] (-inf = hidden), with the sink logit of
        each query head (indexed along ``heads_dim``) in the denominator. A row with nothing visible is 0."""
        if self.sinks is None:
            return torch.softmax(logits, dim=-1).nan_to_num_(0.0)
        else:
            shape = [1] * logits.dim()
            shape[heads_dim] = -1
            sink = self.sinks.to(logits.device, torch.float32).view(shape).expand(*logits.shape[:-1], 1)
            m = torch.maximum(logits.amax(-1, keepdim=True), sink)
        m = torch.where(torch.isfinite(m), m, 0.0)
        p = (logits - m).exp()
        z = p.sum(-1, keepdim=True)
        if self.sinks is not None:
            z = z + (sink - m).exp()
        return p / z.clamp_min(torch.finfo(torch.float32).tiny)

    def query_heads(self, start: int, stop: int) -> LayerAttention:
        """The semantics seen by query heads ``[start, stop)`` alone (their sink logits)."""
        if self.sinks is None:
            return self
        return LayerAttention(self.scale, self.window, self.softcap, self.sinks[start:stop])

    def to_info(self) -> dict:
        return {"scale": self.scale, "window": self.window, "softcap": self.softcap,
                "sinks": None if self.sinks is None else [float(x) for x in self.sinks.float().tolist()]}

    @classmethod
    def from_info(cls, d: dict) -> LayerAttention:
        sinks = d.get("sinks")
        return cls(float(d["scale"]), d.get("window"), d.get("softcap"),
                   None if sinks is None else torch.tensor(sinks, dtype=torch.float32))


def as_layer_attention(attn: LayerAttention | float) -> LayerAttention:
    """A bare float is a plain causal softmax with that scale (the pre-adapter API)."""
    return attn if isinstance(attn, LayerAttention) else LayerAttention(float(attn))


# keyword arguments transformers passes to attention functions that do not change attention semantics;
# the semantic ones (sliding_window, softcap, s_aux) are checked against the adapter, anything else refused
BENIGN_KWARGS = frozenset(
    {
        "position_ids", "use_cache", "output_attentions", "is_causal", "cache_position", "output_router_logits",
        "return_dict", "output_hidden_states",
    }
)


def text_config(config):
    """The decoder's config (a multimodal config nests it as ``text_config``)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def family_of(config, what: str = "--model") -> tuple[str, Family]:
    """(model_type, Family) of ``config``, or a one-line refusal."""
    cfg = text_config(config)
    mt = getattr(cfg, "model_type", None)
    fam = FAMILIES.get(mt)
    if fam is None:
        raise UserError(f"{what}: architecture {mt!r} "
                        f"({', '.join(getattr(config, 'architectures', None) or []) or type(cfg).__name__}) "
                        "is not known to kvdiag's model adapter; supported: "
                        f"{', '.join(k for k, f in FAMILIES.items() if not f.refuse)}")
    if fam.refuse:
        raise UserError(f"{what}: architecture {mt!r} is refused: {fam.refuse}")
    windows = layer_windows(cfg, fam)
    if any(w is not None and w < 1 for w in windows):
        raise UserError(f"{what}: sliding window {windows} is not a positive number of tokens")
    return mt, fam


@dataclass
class ModelAttention:
    """A model's attention semantics, per layer (see the module docstring)."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    layers: list[LayerAttention]
    implementation: str  # "sdpa" or "eager": what reproduces the model's attention
    cache: str = "per-head K/V"

    @property
    def scale(self) -> float:
        """The softmax scale when every layer shares one (the manifest's legacy ``scale``)."""
        return self.layers[0].scale

    def info(self) -> dict:
        """For the Trace manifest's model info."""
        return {
            "family": self.family, "implementation": self.implementation, "cache": self.cache,
            "qk_head_dim": self.qk_head_dim, "v_head_dim": self.v_head_dim,
            "layer_types": ["full" if l.window is None else "sliding" for l in self.layers],
            "windows": [l.window for l in self.layers], "softcap": any(l.softcap is not None for l in self.layers),
            "sinks": any(l.sinks is not None for l in self.layers), "layers": [l.to_info() for l in self.layers],
        }

    @staticmethod
    def layers_from_info(info: dict | None, num_layers: int, scale: float) -> list[LayerAttention]:
        """Per-layer semantics from a manifest's model info; a manifest written before the adapter
        (no ``attention``) describes plain causal attention with one scale."""
        if not info or "layers" not in info:
            return [LayerAttention(float(scale))] * num_layers
        return [LayerAttention.from_info(d) for d in info["layers"]]


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """layer index -> the attention module (the modules that carry ``layer_idx`` and ``scaling``)."""
    out = {}
    for module in model.modules():
        if hasattr(module, "scaling") and hasattr(module, "layer_idx"):
            out.setdefault(int(module.layer_idx), module)
    return out


class LayerTypeRotary(torch.nn.Module):
    """A rotary embedding with one table per layer type (Gemma3: ``rotary_emb(x, position_ids, layer_type)``) bound to
    one layer's type: ``(x, position_ids) -> (cos, sin)``, the tables that layer's attention receives."""

    def __init__(self, rotary: torch.nn.Module, layer_type: str):
        super().__init__()
        self.rotary, self.layer_type = rotary, layer_type

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary(x, position_ids, self.layer_type)


def rotary_embedding(model, layer: int) -> torch.nn.Module:
    """Layer ``layer``'s rotary embedding as ``(x, position_ids) -> (cos, sin)``: the decoder's ``rotary_emb`` (the
    module every layer's ``position_embeddings`` come from), bound to the layer's type where the model keeps one table
    per layer type; a model without exactly one ``rotary_emb`` is refused in one line."""
    found = {id(m): m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "rotary_emb"}
    if len(found) != 1:
        raise UserError(f"--model: {type(model).__name__} has {len(found)} rotary embedding modules (rotary_emb); "
                        "kvdiag needs exactly one")
    rotary = next(iter(found.values()))
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return LayerTypeRotary(rotary, text_config(model.config).layer_types[layer])
    return rotary


def output_projection(module) -> torch.nn.Linear:
    """The attention module's output projection W_O [hidden, H*d] (``o_proj``; GPT-NeoX: ``dense``)."""
    for name in ("o_proj", "dense"):
        if isinstance(getattr(module, name, None), torch.nn.Linear):
            return getattr(module, name)
    raise UserError(f"--model: {type(module).__name__} has no output projection kvdiag knows (o_proj, dense)")


def model_attention(model) -> ModelAttention:
    """The :class:`ModelAttention` of a loaded (adapted) model, built once and kept on the model."""
    cached = getattr(model, "_kvdiag_attention", None)
    if cached is None:
        cached = model._kvdiag_attention = _build(model)
    return cached


def _build(model) -> ModelAttention:
    cfg = text_config(model.config)
    mt, fam = family_of(cfg)
    windows = layer_windows(cfg, fam)
    mods = attention_modules(model)
    L = cfg.num_hidden_layers
    if sorted(mods) != list(range(L)):
        raise UserError(f"--model: {type(model).__name__} does not expose one attention module per layer "
                        f"(found layers {sorted(mods)} of {L}); kvdiag cannot hook it")
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    layers = []
    for i in range(L):
        m = mods[i]
        sinks = None
        if fam.sinks:
            sinks = m.sinks.detach().float().cpu().clone()
        softcap = getattr(cfg, fam.softcap) if fam.softcap else None
        layers.append(LayerAttention(float(m.scaling), windows[i], float(softcap) if softcap else None, sinks))
    m0 = mods[0]
    d = getattr(m0, "head_dim", None) or getattr(m0, "head_size", None) or cfg.hidden_size // H
    impl = "eager" if fam.needs_eager else "sdpa"
    return ModelAttention(mt, L, H, Hkv, int(d), int(d), layers, impl)


def check_kwargs(module, spec: LayerAttention | None, kwargs: dict, where: str) -> None:
    """Pop the attention-semantics kwargs transformers passes, check them against the adapter's ``spec``
    and refuse any unknown keyword (it could change attention in a way we do not honour)."""
    window = kwargs.pop("sliding_window", None)
    softcap = kwargs.pop("softcap", None)
    s_aux = kwargs.pop("s_aux", None)
    for k in [k for k in kwargs if k in BENIGN_KWARGS or k.startswith("kvdiag")]:
        kwargs.pop(k)
    if kwargs:
        raise UserError(f"{where}: layer {module.layer_idx} passes attention arguments {sorted(kwargs)} that kvdiag "
                        "does not honour; this model is not supported")
    if spec is None:
        return
    if window is not None and window != spec.window:
        raise UserError(f"{where}: layer {module.layer_idx} attends with sliding_window={window}, the adapter says "
                        f"{spec.window}; this model is not supported")
    if softcap is not None and softcap != spec.softcap:
        raise UserError(f"{where}: layer {module.layer_idx} soft-caps attention at {softcap}, the adapter says "
                        f"{spec.softcap}")
    if (s_aux is not None) != (spec.sinks is not None):
        raise UserError(f"{where}: layer {module.layer_idx} attention sinks do not match the adapter")


# --------------------------------------------------------------------------- load-time adaptation


def adapt(model):
    """Check a freshly loaded model against the adapter and normalize it; returns the model to use.

    - refuses unknown / unsupported architectures (one line);
    - a multimodal wrapper with a nested text config (Gemma3ForConditionalGeneration) becomes its text-only
      causal LM (same modules, no copy);
    - a config without ``num_key_value_heads`` (GPT-NeoX: MHA) gets it, so every consumer reads one attribute;
    - models whose attention SDPA cannot express (softcap, sinks) run with eager attention.
    """
    family_of(model.config)
    model = _text_only(model)
    cfg = model.config
    if getattr(cfg, "num_key_value_heads", None) is None:
        cfg.num_key_value_heads = cfg.num_attention_heads
    ma = _build(model)
    if model.config._attn_implementation != ma.implementation:
        model.set_attn_implementation(ma.implementation)
    return model


def _text_only(model):
    cfg = model.config
    text = text_config(cfg)
    if text is cfg:
        return model
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(text), None)
    inner = getattr(getattr(model, "model", None), "language_model", None)
    if cls is None or inner is None or not hasattr(model, "lm_head"):
        raise UserError(f"--model: {type(model).__name__} nests its text model in a way kvdiag cannot unwrap; load "
                        "its text-only checkpoint")
    with torch.device("meta"):
        lm = cls(text)
    lm.model = inner
    lm.lm_head = model.lm_head
    lm.generation_config = model.generation_config
    lm.config._attn_implementation_internal = (
        getattr(text, "_attn_implementation_internal", None) or cfg._attn_implementation
    )
    return lm.eval()


# --------------------------------------------------------------------------- running from a decoder layer


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers in order: the ``ModuleList`` whose element ``i`` holds attention module ``i``."""
    cached = getattr(model, "_kvdiag_decoder_layers", None)
    if cached is not None:
        return cached
    attn = attention_modules(model)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == len(attn) and all(
                any(m is attn[i] for m in layer.modules()) for i, layer in enumerate(module)):
            model._kvdiag_decoder_layers = module
            return module
    raise UserError(f"--model: {type(model).__name__} has no list of decoder layers kvdiag can find")


def _set_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": hidden}
    return (hidden, *args[1:]), kwargs


def _get_hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _passthrough(hidden_states, *args, **kwargs):
    return hidden_states


@contextmanager
def capturing_layer_inputs(model):
    """Record the hidden states entering every decoder layer during a forward: yields a list filled with
    ``inputs[l] [B, W, D]`` (detached) in layer order."""
    inputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, kw: inputs.append(_get_hidden(a, kw).detach()), with_kwargs=True)
        for layer in decoder_layers(model)
    ]
    try:
        yield inputs
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def starting_at_layer(model, layer: int, hidden: torch.Tensor | None):
    """Run the model's own forward from decoder layer ``layer`` on: the layers below return their input
    unchanged and layer ``layer`` takes ``hidden [B, W, D]`` instead. Everything the model does around its
    layers (embedding scale, rotary tables per layer type, masks, final norm, logit scaling and softcap) stays
    its own, so one mechanism serves every family. ``layer`` 0 or ``hidden`` None: an ordinary forward."""
    if layer == 0 or hidden is None:
        yield
        return
    layers = decoder_layers(model)
    for below in layers[:layer]:
        below.forward = _passthrough  # instance attribute: shadows the class's forward
    hook = layers[layer].register_forward_pre_hook(lambda m, a, kw: _set_hidden(a, kw, hidden), with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()
        for below in layers[:layer]:
            del below.forward
