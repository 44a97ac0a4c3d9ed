"""NVIDIA kvpress presses as kvdiag scorers: ``kvpress:<PressClass>`` (e.g. ``kvpress:ExpectedAttentionPress``).

A press is graded by calling its own ``score()`` with what its forward hook would receive if it compressed
the cache ``[0, t)`` of one layer at checkpoint ``t``:

- ``module``: the Trace model's real attention module of that layer (its ``rotary_emb`` attached, as
  ``BasePress.__call__`` does), fp32;
- ``hidden_states`` [1, n, hidden]: the attention input (after the layer's input norm) at positions
  ``[t - n, t)``, from one forward pass of the Trace's model over the prompt's recorded tokens (causal, so the
  states at positions ``< t`` are those of a run over ``[0, t)``); ``n = t`` by default (the prefill hook's
  view; prefill-only presses such as LeverageScore, NonCausalAttn and Compactor need it), or
  ``hidden_window`` (DecodingPress's buffer of recent steps);
- ``keys``, ``values`` [1, Hkv, t, d]: the Trace's post-RoPE cache, kvdiag's ``[Hkv, t, d]`` with a batch axis
  (query head ``h`` reads KV head ``h // g``, HF's ``repeat_kv`` layout, as in kvdiag);
- ``attentions`` [1, H, t, t]: the eager attention weights of every query, recomputed exactly from the Trace's
  q and k with the layer's semantics, only for presses that require them (ObservedAttention); None otherwise,
  as under SDPA;
- ``kwargs``: ``position_embeddings`` (cos, sin) [1, n, d] of those positions, ``cache_position``,
  ``position_ids``.

The press returns [1, Hkv, t] (higher = keep); kvdiag aggregates it like any scorer. Scores are fp32 (kvpress
runs in the model dtype). Presses that draw random numbers (LeverageScore, Random without a seed) are seeded
per (prompt, checkpoint, layer) without touching the caller's RNG. Presses without per-entry scores
(wrappers, merging, head/layer/channel-level decisions, trained hub weights) are refused in one line.

kvpress pins transformers < 5.3; kvdiag installs it with ``--no-deps`` next to its own transformers (docs/kvpress.md).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import typing
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvdiag.core.errors import UserError
from kvdiag.model.adapters import FAMILIES, attention_modules, decoder_layers, rotary_embedding
from kvdiag.model.attention import attention_rows
from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.registry import SCORERS, register_scorer

PREFIX = "kvpress:"
KVPRESS_VERSION = "0.5.5"
INSTALL = f"pip install 'kvdiag[kvpress]' && pip install --no-deps kvpress=={KVPRESS_VERSION}"
ALL = PREFIX + "all"

# presses with no per-entry score() to grade, and why (checked before the generic rules)
REFUSED: dict[str, str] = {
    "BasePress": "abstract base class", "ScorerPress": "abstract base class (its subclasses are the graded presses)",
    "AdaKVPress": "wrapper: reallocates another press's budget across heads; grade the inner press",
    "CriticalAdaKVPress": "wrapper: AdaKV head budgets over CriticalKV scores; grade kvpress:CriticalKVPress",
    "BlockPress": "wrapper: block-wise iterative pruning with another press",
    "ChunkPress": "wrapper: applies another press chunk by chunk",
    "ChunkKVPress": "wrapper: keeps whole chunks ranked by another press's summed scores",
    "EntropyGatedChunkKVPress": "wrapper: chunk selection gated by entropy over another press",
    "ComposedPress": "wrapper: chains several presses",
    "PerLayerCompressionPress": "wrapper: per-layer compression ratios for another press",
    "KeyRerotationPress": "wrapper: re-rotates keys after another press prunes",
    "DecodingPress": "wrapper: decides when to compress (kvdiag's checkpoints fix that); grade its base press",
    "PrefillDecodingPress": "wrapper: combines a prefill and a decoding press; grade them",
    "CompressionRatioDecodingPress": "wrapper: decides when and how much to compress; grade its base press",
    "DMSPress": "wrapper: thresholds another press's scores (no trained evictor); grade the inner press",
    "LUKVPress": "wrapper: head budgets from a budget curve downloaded per model; grade the inner press",
    "CAMPress": "merging press: folds evicted values into kept entries, no per-entry keep score",
    "MergingPress": "merging press: merges similar entries, no per-entry keep score",
    "KVComposePress": "structured composite tokens chosen across heads inside compress(), no per-entry score()",
    "ThinKPress": "prunes key channels, not cache entries",
    "SimLayerKVPress": "decides per layer (lazy layers keep sinks + recent), no per-entry scores",
    "DuoAttentionPress": "decides per head (streaming vs retrieval) from patterns downloaded from the hub",
    "FinchPress": "needs a delimiter token splitting the prompt into context and question (its window)",
    "QFilterPress": "needs trained Q-Filters for the model from the Hugging Face hub",
    "KVzapPress": "needs a trained KVzap surrogate model from the Hugging Face hub",
    "ExpectedAttentionStatsPress": "needs query statistics from the hub (or a calibration dataset run)",
    "FastKVzipPress": "needs trained gates from the Hugging Face hub",
    "RestoreKVPress": "needs a trained restore adapter (LoRA) from the Hugging Face hub",
    "KVzipPress": "scores by re-running the model on a context-reconstruction prompt, not from the hook's tensors",
    "KVgradPress": "scores by gradients of a context-reconstruction pass, not from the hook's tensors",
}
# presses whose scores depend on the budget (compression_ratio): graded, with a caveat in the listing
BUDGET_NOTES: dict[str, str] = {
    "StreamingLLMPress": "budget-dependent: a keep/evict mask at compression_ratio (0 gives constant scores)",
    "CriticalKVPress": "budget-dependent: its stage-1 top (1 - compression_ratio) * first_stage_ratio entries tie at "
                       "the top",
}
# presses that assert ``attentions is not None`` (kvpress: attn_implementation="eager")
NEEDS_ATTENTIONS = frozenset({"ObservedAttentionPress"})
# CriticalKVPress wraps a ScorerPress: by default SnapKV (kvpress's evaluation registry, "critical_snapkv")
INNER_DEFAULT = "SnapKVPress"


# --------------------------------------------------------------------------- kvpress, its presses, why not


def kvpress_module(what: str = "kvpress presses"):
    """``import kvpress``, undoing its global attention patch; a missing install is one UserError line.

    kvpress wraps every function in transformers' ``ALL_ATTENTION_FUNCTIONS`` for head-wise masking (AdaKV),
    passing ``dropout`` positionally, which breaks kvdiag's own attention hooks; kvdiag never lets a press
    compress a cache, so the previous functions are put back.
    """
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as funcs
    except ImportError:  # pragma: no cover - transformers is a dependency
        funcs = None
    before = {key: funcs[key] for key in funcs} if funcs is not None else {}
    try:
        import kvpress
    except ImportError as err:
        raise UserError(f"{what} need kvpress ({err.name or err} is missing): {INSTALL}") from None
    for key, func in before.items():
        if funcs[key] is not func:
            funcs[key] = func
    return kvpress


def press_classes() -> dict[str, type]:
    """Every press class kvpress exports, by class name."""
    kvpress = kvpress_module()
    base = kvpress.BasePress
    return {
        name: obj
        for name in sorted(dir(kvpress))
        if isinstance(obj := getattr(kvpress, name), type) and issubclass(obj, base)
    }


def why_not(name: str, cls: type) -> str | None:
    """Why press ``name`` cannot be graded here, or None if it can."""
    import kvpress

    if name in REFUSED:
        return REFUSED[name]
    if not issubclass(cls, kvpress.ScorerPress):
        return "not a ScorerPress: it prunes inside compress() without per-entry scores"
    if inspect.isabstract(cls) or cls.score is kvpress.ScorerPress.score:
        return "no score() of its own"
    return None


def gradable_presses() -> list[str]:
    """Names of the presses that give per-entry scores here."""
    return [name for name, cls in press_classes().items() if why_not(name, cls) is None]


def listing() -> list[tuple[str, str, str]]:
    """(scorer name, status, note) for every kvpress press: ``gradable`` with its parameters, or ``refused``
    with why; a single row with the install command when kvpress is missing."""
    try:
        classes = press_classes()
    except UserError as err:
        return [(PREFIX + "*", "not installed", str(err))]
    rows = []
    for name, cls in classes.items():
        reason = why_not(name, cls)
        if reason is None:
            params = ", ".join(f"{key}={_show(default)}" for key, (_, default) in press_params(cls).items())
            note = "; ".join(filter(None, [params or "no parameters", BUDGET_NOTES.get(name)]))
            rows.append((PREFIX + name, "gradable", note))
        else:
            rows.append((PREFIX + name, "refused", reason))
    return rows


def _show(value: Any) -> str:
    return "None" if value is None else str(value)


# --------------------------------------------------------------------------- parameters


def press_params(cls: type) -> dict[str, tuple[Any, Any]]:
    """``name -> (type, default)`` of a press's settable parameters (its ``__init__`` arguments plus
    ``compression_ratio``); a ``press`` argument (CriticalKV) is the name of a gradable press."""
    import kvpress

    hints = {**typing.get_type_hints(cls), **typing.get_type_hints(cls.__init__)}
    out: dict[str, tuple[Any, Any]] = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name.startswith("_"):
            continue
        hint = hints.get(p.name, str)
        if isinstance(hint, type) and issubclass(hint, kvpress.BasePress):
            out[p.name] = (str, INNER_DEFAULT)
            continue
        if typing.get_origin(hint) is typing.Literal:
            hint = str
        out[p.name] = (hint, None if p.default is inspect.Parameter.empty else p.default)
    if "compression_ratio" not in out and hasattr(cls, "compression_ratio"):
        out["compression_ratio"] = (float, 0.0)
    return out


def _build_press(cls: type, params: dict, scorer: str):
    """The press instance (kvpress's own checks turned into one UserError line)."""
    classes = press_classes()
    kwargs, ratio = dict(params), None
    if "press" in kwargs:  # CriticalKVPress(press=...): a gradable press with kvpress's registry defaults
        inner = kwargs["press"]
        if inner not in classes or why_not(inner, classes[inner]) is not None or inner == cls.__name__:
            raise UserError(f"--param {scorer}.press={inner}: use a gradable press, one of "
                            f"{', '.join(gradable_presses())}")
        inner_kwargs = {"use_vnorm": False} if inner == "ExpectedAttentionPress" else {}  # as kvpress's registry
        kwargs["press"] = classes[inner](**inner_kwargs)
    if "compression_ratio" in kwargs and "compression_ratio" not in inspect.signature(cls.__init__).parameters:
        ratio = kwargs.pop("compression_ratio")
    try:
        press = cls(**kwargs)
        if ratio is not None:
            press.compression_ratio = ratio
    except (AssertionError, ValueError, TypeError) as err:
        raise UserError(f"scorer {scorer}: kvpress refuses these parameters ({err or type(err).__name__})") from None
    return press


# --------------------------------------------------------------------------- the scorer


@dataclass
class KvpressScorer(Scorer):
    """Base of the ``kvpress:<Press>`` scorers (one dataclass per press, made by :func:`register_press`).

    Parameters
    ----------
    hidden_window : 0 (default): the press sees the hidden states of every position ``[0, t)``, as its
        prefill hook would; N > 0: only the last N, as DecodingPress's buffer (prefill-only presses refuse it).
    The other fields are the press's own parameters, with kvpress's defaults.
    """

    press_class: ClassVar[str] = ""
    in_all: ClassVar[bool] = False  # never part of `--scorers all` (named, or kvpress:all)
    needs_model: ClassVar[bool] = True  # the press reads the hidden states and attention module of the Trace's model
    hidden_window: int = 0

    def __post_init__(self):
        if self.hidden_window < 0:
            raise UserError(f"{self.name}.hidden_window={self.hidden_window} must be 0 (every position) or positive")
        params = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "hidden_window"}
        self._press = _build_press(press_classes()[self.press_class], params, self.name)

    def check_trace(self, trace) -> None:
        family = ((trace.manifest.get("model") or {}).get("attention") or {}).get("family")
        reason = FAMILIES[family].kvpress if family in FAMILIES else None
        if reason:
            raise UserError(f"{self.name} cannot be graded on {family} models: {reason}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.live or ctx.trace is None:
            raise UserError(f"scorer {self.name} reads the Trace's model (hidden states, attention module): score it "
                            "with `kvdiag score`; replay and live caches do not carry them")
        view = hook_view(ctx, self.hidden_window, self.press_class in NEEDS_ATTENTIONS)
        key = f"{ctx.prompt_id}:{ctx.checkpoint}:{ctx.layer}".encode()
        try:
            with torch.no_grad(), torch.random.fork_rng():
                torch.manual_seed(zlib.crc32(key))
                out = self._press.score(view["module"], view["hidden_states"].clone(), view["keys"].clone(),
                                        view["values"].clone(), view["attentions"], dict(view["kwargs"]))
        except Exception as err:  # a third-party press failing on this input: name it, one line
            raise UserError(f"scorer {self.name} failed at layer {ctx.layer}, checkpoint {ctx.t} of {ctx.prompt_id} "
                            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from err
        return out.reshape(ctx.num_kv_heads, ctx.t).float()


def hook_view(ctx: ScoreContext, hidden_window: int, attentions: bool) -> dict:
    """What a press's hook receives at ``ctx`` (module docstring), shared by the presses of one context."""
    t = ctx.t
    n = t if hidden_window == 0 else min(hidden_window, t)

    def build() -> dict:
        run = ctx.shared.get(("kvpress_run", ctx.trace.fingerprint))
        if run is None:  # one model load per scoring run; the previous Trace's model is freed first
            ctx.shared.clear()
            run = ctx.shared[("kvpress_run", ctx.trace.fingerprint)] = ModelRun(ctx.trace)
        hidden, (cos, sin) = run.inputs(ctx.prompt_id, ctx.layer)
        pos = torch.arange(t - n, t)
        return {
            "module": run.modules[ctx.layer],
            "hidden_states": hidden[:, t - n : t],
            "keys": ctx.k[None], "values": ctx.v[None],  # [1, Hkv, t, d]
            "attentions": None,
            "kwargs": {"position_embeddings": (cos[:, t - n : t], sin[:, t - n : t]), "cache_position": pos,
                       "position_ids": pos[None]},
        }

    view = ctx.cached(("kvpress", n), build)
    if attentions:
        full = ctx.cached(
            ("kvpress_attentions",), lambda: attention_rows(ctx.q, ctx.k, torch.arange(t), ctx.attn)[None]
        )
        view = {**view, "attentions": full}  # [1, H, t, t]
    return view


# --------------------------------------------------------------------------- the Trace's model


class ModelRun:
    """The Trace's model (checked against the manifest's weights hash) and the attention inputs of one prompt.

    ``modules[l]``: layer ``l``'s attention module in fp32 with the model's rotary embedding attached, as kvpress's
    ``BasePress`` attaches it; every module path comes from ``kvdiag.model.adapters``. ``inputs(pid, layer)`` -> hidden
    [1, T, hidden] fp32, (cos, sin) [1, T, d] fp32: what the layer's attention module received over the prompt's
    recorded tokens, from one forward pass of the whole model per prompt (the last prompt is kept: score_trace visits
    prompt by prompt).
    """

    def __init__(self, trace):
        from kvdiag.model.load import load_model

        had = trace.manifest["model"]
        self.trace = trace
        self.lm = load_model(had["spec"], dtype=had.get("dtype", "float32"))
        self.lm.check_model_of(had, "kvpress scorers: the model", "restore that model to grade presses")
        self.model = model = self.lm.model
        self._hooked = [attention_modules(model)[i] for i in range(len(decoder_layers(model)))]
        fp32 = next(model.parameters()).dtype == torch.float32
        self.modules = []  # what the presses see: fp32 (kvpress runs in the model dtype; scores here are fp32)
        for layer, module in enumerate(self._hooked):
            rotary = rotary_embedding(model, layer)
            module = module if fp32 else copy.deepcopy(module).float()
            module.rotary_emb = rotary if fp32 else copy.deepcopy(rotary).float()
            self.modules.append(module)
        self._pid: str | None = None
        self._inputs: list = []

    def inputs(self, pid: str, layer: int):
        if pid != self._pid:
            self._inputs, self._pid = self._capture(pid), pid
        return self._inputs[layer]

    @torch.no_grad()
    def _capture(self, pid: str) -> list:
        captured: dict[int, tuple] = {}

        def grab(index):
            def hook(module, args, kwargs):
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                cos, sin = kwargs["position_embeddings"]
                captured[index] = (hidden.detach().float(), (cos.detach().float(), sin.detach().float()))

            return hook

        handles = [module.register_forward_pre_hook(grab(i), with_kwargs=True) for i, module in enumerate(self._hooked)]
        try:
            ids = self.trace.token_ids(pid)[None].to(self.lm.device)
            self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        finally:
            for handle in handles:
                handle.remove()
        return [captured[i] for i in range(len(self.modules))]


# --------------------------------------------------------------------------- registration


def register_press(name: str) -> type[Scorer]:
    """Register ``kvpress:<Press>`` (a dataclass whose fields are the press's parameters) and return it.

    Bad names are one UserError line: kvpress missing (the install command), an unknown press (the gradable
    ones), a press without per-entry scores (why).
    """
    if name in SCORERS:
        return SCORERS[name]
    press = name[len(PREFIX):]
    classes = press_classes()
    if press not in classes:
        raise UserError(f"unknown kvpress press {press!r}: use kvpress:all or one of {', '.join(gradable_presses())} "
                        "(`kvdiag score --list` says why the others cannot be graded)")
    reason = why_not(press, classes[press])
    if reason is not None:
        raise UserError(f"{name} cannot be graded: {reason}")
    fields = [
        (key, hint, dataclasses.field(default=default)) for key, (hint, default) in press_params(classes[press]).items()
    ]
    cls = dataclasses.make_dataclass(f"Kvpress{press}", fields, bases=(KvpressScorer,), namespace={
        "press_class": press, "__module__": __name__,
        "__doc__": f"kvpress {press}: its own score() at each checkpoint (see kvdiag.scorers.kvpress_press)."})
    return register_scorer(cls, name)


def expand(name: str) -> list[str] | None:
    """``kvpress:all`` -> every gradable press; None for any other name."""
    return [PREFIX + p for p in gradable_presses()] if name == ALL else None


SCORERS.add_resolver(PREFIX, register_press, expand)
