"""What ``--model`` may name, checked without torch or transformers (the CLI refuses a bad spec before any heavy
import; ``kvdiag.model.load`` loads it): the tiny random families' configs (``tiny:<family>``), the spec's syntax, and a
model's config read as JSON (a directory's, a cached hub id's, an embedded model's): whether it can be a Trace's model
and how long its context is."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvdiag.core.errors import UserError
from kvdiag.core.safetensors_header import safetensors_fault, safetensors_shapes

DEFAULT_MODEL = "smollm2"  # the model a command loads when --model is not given

# --------------------------------------------------------------------------- tiny random models

TINY_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    # a large init range makes attention and next-token distributions peaked, so eviction effects are visible
    initializer_range=0.2,
)


BYTE_VOCAB = 259  # 256 byte tokens + bos/eos/pad


def byte_core(vocab_size: int = BYTE_VOCAB):
    """The byte-level ``tokenizers.Tokenizer`` of the tiny and random models (256 byte tokens + bos/eos/pad; a larger
    ``vocab_size`` adds filler tokens ``<rI>``, never produced by encoding, so that every id a model of that
    vocabulary generates decodes to some text). The tokenizers library only: no torch, no transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in BYTE_SPECIALS.values():
        vocab[special] = len(vocab)
    vocab.update({f"<r{i}>": i for i in range(len(vocab), vocab_size)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return core


BYTE_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def byte_tokenizer(vocab_size: int = BYTE_VOCAB):
    """:func:`byte_core` as a transformers tokenizer (no chat template)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_core(vocab_size), **BYTE_SPECIALS)


# Tiny random models: one line per family. Windows of 8 make traces of ~40 tokens cross them; hybrid families
# alternate sliding and full layers. (config class, extra config fields)
TINY_SW = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
TINY: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=False)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, use_sliding_window=False,
            sliding_window=None,
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral_sw": ("MistralConfig", dict(sliding_window=8)),
    "phi3": (
        "Phi3Config",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    ),
    "olmo2": ("Olmo2Config", {}),
    "granite": (
        "GraniteConfig",
        dict(attention_multiplier=0.09, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
    ),
    "cohere": ("CohereConfig", dict(use_qk_norm=False, logit_scale=0.5)),
    "smollm3": ("SmolLM3Config", dict(use_sliding_window=False, no_rope_layer_interval=2)),
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(
            num_key_value_heads=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
    ),
    # softcap 5: the random logits are large enough that the cap matters
    "gemma2": ("Gemma2Config", dict(**TINY_SW, attn_logit_softcapping=5.0, query_pre_attn_scalar=16)),
    "gemma3": ("Gemma3TextConfig", dict(**TINY_SW, query_pre_attn_scalar=16)),
    "gemma3_cg": ("Gemma3Config", dict(**TINY_SW, query_pre_attn_scalar=16)),  # text config nested in a multimodal one
    "gpt_oss": ("GptOssConfig", dict(**TINY_SW, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
        ),
    ),
}


# the decoder model_type of each tiny family's config class (tests/test_bad_input.py: transformers' family_of says so)
TINY_MODEL_TYPES = {
    "LlamaConfig": "llama", "Qwen2Config": "qwen2", "Qwen3Config": "qwen3", "Qwen3MoeConfig": "qwen3_moe",
    "MistralConfig": "mistral", "Phi3Config": "phi3", "Olmo2Config": "olmo2", "GraniteConfig": "granite",
    "CohereConfig": "cohere", "SmolLM3Config": "smollm3", "GPTNeoXConfig": "gpt_neox", "Gemma2Config": "gemma2",
    "Gemma3TextConfig": "gemma3_text", "Gemma3Config": "gemma3_text", "GptOssConfig": "gpt_oss",
    "DeepseekV2Config": "deepseek_v2", "DeepseekV3Config": "deepseek_v3",
}


ADAPTER_SEP = "+"  # --model BASE+ADAPTER: a LoRA adapter directory merged into BASE's weights at load


def split_adapter(spec: str) -> tuple[str, str | None]:
    """(base spec, adapter directory or None) of ``--model spec``: ``smollm2+data/adapters/smollm2-countdown``."""
    base, sep, adapter = spec.rpartition(ADAPTER_SEP)
    return (base, adapter) if sep and base and adapter else (spec, None)


def check_adapter(spec: str, adapter: str) -> Path:
    """Refuse an adapter directory kvdiag cannot merge safely: missing, without a LoRA ``adapter_config.json``, whose
    weights are not ``adapter_model.safetensors`` (pickled ``.bin`` weights are never loaded), or made for another base
    (:func:`check_adapter_base`). Any rank loads: the issue's rank <= 16 bounds the adapter kvdiag ships (its test
    checks it), not what a user may merge, which changes no kvdiag path."""
    path = Path(adapter).expanduser()
    if not path.is_dir():
        raise UserError(f"--model {spec}: adapter directory {adapter} not found; pass BASE+DIR with DIR holding "
                        "adapter_config.json and adapter_model.safetensors")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"--model {spec}: {adapter}/adapter_config.json is missing or unreadable "
                        f"({type(err).__name__}); save the adapter with peft's save_pretrained") from err
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        got = config.get("peft_type") if isinstance(config, dict) else None
        raise UserError(f"--model {spec}: {adapter} is not a LoRA adapter (peft_type {got!r}); pass a LoRA adapter")
    if not (path / "adapter_model.safetensors").is_file():
        raise UserError(f"--model {spec}: {adapter} has no adapter_model.safetensors (kvdiag loads no pickled "
                        "weights); save the adapter with safe_serialization=True")
    check_adapter_base(spec, path, config)
    return path


# LoRA target (the last module name) -> its (in, out) features in a Llama-style decoder, from config fields
_HEADS = {"q": "num_attention_heads", "kv": "num_key_value_heads"}
LORA_DIMS = {"q_proj": ("hidden", "q"), "k_proj": ("hidden", "kv"), "v_proj": ("hidden", "kv"),
             "o_proj": ("q", "hidden"), "gate_proj": ("hidden", "inter"), "up_proj": ("hidden", "inter"),
             "down_proj": ("inter", "hidden")}


def check_adapter_base(spec: str, path: Path, config: dict) -> None:
    """Refuse, before torch, an adapter made for another base than ``--model spec``'s: its recorded base
    (``base_model_name_or_path``) another built-in model, a layer the base does not have, or a LoRA factor whose
    features are not the base module's (q/k/v/o and gate/up/down projections, where the base's config is known
    without a load). Anything else that does not fit is refused when peft loads it."""
    base = split_adapter(spec)[0]
    recorded = config.get("base_model_name_or_path")
    if isinstance(recorded, str) and is_builtin(recorded) and is_builtin(base) and recorded != base:
        raise UserError(f"--model {spec}: the adapter was made for {recorded}, not {base}; pass "
                        f"{recorded}{ADAPTER_SEP}{path}")
    weights = path / "adapter_model.safetensors"
    try:
        shapes, fault = safetensors_shapes(weights), safetensors_fault(weights)
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise UserError(f"--model {spec}: {weights} is not a readable safetensors file ({type(err).__name__}); save "
                        "the adapter with safe_serialization=True") from err
    if fault:
        raise UserError(f"--model {spec}: {weights} is truncated or corrupt ({fault}); save the adapter again")
    try:
        base_config = spec_config(base)
    except UserError:
        return  # a wrong base is refused by its own check
    if base_config is None or "hidden_size" not in base_config:
        return
    head = base_config.get("head_dim") or base_config["hidden_size"] // base_config["num_attention_heads"]
    dims = {"hidden": base_config["hidden_size"], "inter": base_config.get("intermediate_size"),
            **{k: base_config.get(f, base_config["num_attention_heads"]) * head for k, f in _HEADS.items()}}
    for name, shape in shapes.items():
        m = re.search(r"layers\.(\d+)\.(?:.*\.)?(\w+)\.lora_([AB])\.weight$", name)
        if m is None:
            continue
        layer, module, factor = int(m[1]), m[2], m[3]
        if layer >= base_config["num_hidden_layers"]:
            raise UserError(f"--model {spec}: the adapter has layer {layer}, {base} has "
                            f"{base_config['num_hidden_layers']}; pass the base model the adapter was trained on")
        if module not in LORA_DIMS or len(shape) != 2:
            continue
        want = dims[LORA_DIMS[module][0 if factor == "A" else 1]]
        got = shape[1] if factor == "A" else shape[0]
        if want is not None and got != want:
            raise UserError(f"--model {spec}: the adapter's {module} has {got} {'in' if factor == 'A' else 'out'} "
                            f"features, {base}'s {want}; pass the base model the adapter was trained on")


def check_model_spec(spec: str) -> str:
    """Refuse what is wrong with ``--model spec`` before it loads: an unknown ``tiny:`` family, a missing ``.gguf``
    file, an adapter directory that is not a LoRA adapter in safetensors (a hub id or directory is checked when it
    loads)."""
    whole, (spec, adapter) = spec, split_adapter(spec)
    if adapter is not None:
        check_adapter(whole, adapter)
    if spec.startswith("tiny:") and spec.split(":", 1)[1] not in TINY:
        raise UserError(f"--model {spec}: unknown tiny architecture; use one of {', '.join('tiny:' + a for a in TINY)}")
    if spec.endswith(".gguf") and not Path(spec).is_file():
        raise UserError(f"--model {spec}: GGUF file not found; check the path")
    return whole


# --------------------------------------------------------------------------- a model's config, read as JSON

# The decoder config fields kvdiag reads before a load, of each embedded model (kvdiag.model.embedded), as its converted
# config.json has them (tests/test_contracts.py compares them with that file where it has been converted).
EMBEDDED_CONFIG: dict[str, dict] = {
    "smollm2": dict(model_type="llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, hidden_size=576, intermediate_size=1536, head_dim=64,
                    vocab_size=49152),
    "gemma3-270m": dict(model_type="gemma3_text", num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                        max_position_embeddings=32768, hidden_size=640, intermediate_size=2048, head_dim=256,
                        vocab_size=262144,
                        sliding_window=512,  # every sixth layer full
                        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]),
}
# config.json field -> the Trace manifest's model entry field (kvdiag.model.load.LoadedModel.info) it must equal
RECORDED = {"model_type": ("attention", "family"), "num_hidden_layers": ("num_layers",),
            "num_attention_heads": ("num_heads",), "num_key_value_heads": ("num_kv_heads",)}


def is_path_spec(spec: str) -> bool:
    """Whether ``--model spec`` names a file or directory (else a built-in name or a hub id; an adapter's base)."""
    spec = split_adapter(spec)[0]
    return spec.startswith((".", "/", "~")) or Path(spec).expanduser().exists()


def is_builtin(spec: str) -> bool:
    """An embedded, ``tiny:`` or ``random:`` model (an adapter's base too): its weights are known from its name."""
    spec = split_adapter(spec)[0]
    return spec in EMBEDDED_CONFIG or spec.startswith(("tiny:", "random:"))


def spec_config(spec: str, revision: str | None = None) -> dict | None:
    """The decoder config of the model ``--model spec`` names, read without torch, transformers or the network: a
    tiny family's, an embedded model's, a directory's ``config.json`` (a multimodal one's ``text_config``), a hub id's
    ``config.json`` from the local Hugging Face cache. None where only a load can tell: a ``.gguf``, a ``random:``
    spec, a hub id whose config is not cached, a composite config that nests its decoder under another key than
    ``text_config``; a hub id at another ``revision`` than main (the cache's main config may not be that revision's).
    A directory without a readable config.json is refused. An adapter keeps its base's config."""
    spec = split_adapter(spec)[0]
    if spec.startswith("tiny:"):
        # the byte tokenizer sets a tiny model's vocabulary (kvdiag.model.load._tiny_config)
        config = {**TINY_COMMON, "vocab_size": BYTE_VOCAB, **TINY[check_model_spec(spec).split(":", 1)[1]][1]}
        return {k: v for k, v in config.items() if v is not None}  # gpt_neox: no num_key_value_heads
    if spec in EMBEDDED_CONFIG:
        return dict(EMBEDDED_CONFIG[spec])
    if spec.startswith("random:") or spec.endswith(".gguf"):
        return None
    if is_path_spec(spec):
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise UserError(f"--model {spec}: no such directory; pass a local HF model directory, a .gguf file, a "
                            "hub id, smollm2, gemma3-270m or tiny:llama")
        file = path / "config.json"
    else:
        file = None if revision is not None else cached_hub_file(spec, "config.json")
        if file is None:
            return None
    try:
        config = json.loads(Path(file).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"--model {spec}: its config.json is missing or unreadable ({type(err).__name__}); pass a "
                        "Hugging Face model directory") from err
    if not isinstance(config, dict):
        raise UserError(f"--model {spec}: its config.json is not a JSON object; pass a Hugging Face model directory")
    text = config.get("text_config")
    if isinstance(text, dict):
        return text
    if any(isinstance(v, dict) and k.endswith("_config") and k != "quantization_config" for k, v in config.items()):
        return None  # a composite config whose decoder is nested under another name: the load finds it
    return config


def cached_hub_file(repo_id: str, filename: str) -> Path | None:
    """``filename`` of the hub repository ``repo_id`` (its main revision) from the local Hugging Face cache, or None
    when it is not there or ``repo_id`` is not a valid id: nothing is downloaded."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, filename)
    except ValueError:  # HFValidationError: not a repo id
        return None
    return Path(found) if isinstance(found, str) else None


def check_trace_model(spec: str, recorded: dict, fix: str = "drop --model") -> None:
    """Refuse ``--model spec`` before anything loads when it is not the model a Trace was made with (``recorded``:
    its manifest's ``model`` entry): another built-in name, random weights for trained ones (or the reverse), a config
    whose family, layer or head counts differ from the recorded ones, or a hub id other than the recorded one whose
    config is not in the local cache (kvdiag asks no network to tell). A model that passes is still checked against
    the recorded weights hash once it has loaded."""
    had = str(recorded["spec"])
    if spec == had or (is_path_spec(spec) and is_path_spec(had)
                       and Path(spec).expanduser().resolve() == Path(had).expanduser().resolve()):
        return
    if is_builtin(spec) and is_builtin(had):
        raise UserError(f"--model {spec} is not the Trace's model ({had}); {fix}")
    if spec.startswith("random:") != (had.startswith("random:") or bool(recorded.get("random"))):
        raise UserError(f"--model {spec} is not the Trace's model ({had}): one has random weights, the other not; "
                        f"{fix}")
    config = spec_config(spec)
    if config is None:
        if not (is_path_spec(spec) or spec.endswith(".gguf") or is_builtin(spec)):
            raise UserError(f"--model {spec} is not the Trace's model by name ({had}) and its config.json is not in "
                            "the local Hugging Face cache (kvdiag does not ask the network); " + fix)
        return  # a .gguf or random: model: told by the weights hash once it loads
    for field, where in RECORDED.items():
        theirs = recorded
        for key in where:
            theirs = theirs.get(key) if isinstance(theirs, dict) else None
        ours = config.get(field)
        if ours is not None and theirs is not None and ours != theirs:
            raise UserError(f"--model {spec} is not the Trace's model ({had}): its config has {field} {ours}, the "
                            f"Trace's model {theirs}; {fix}")


def context_of(spec: str, revision: str | None = None) -> int | None:
    """``max_position_embeddings`` of the model ``spec`` names (at ``revision``), from its config alone
    (:func:`spec_config`), or None when that cannot be told before it loads."""
    config = spec_config(spec, revision)
    value = (config or {}).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def known_shape(spec: str, revision: str | None = None) -> dict | None:
    """``{"num_hidden_layers", "max_position_embeddings"}`` of ``--model spec`` where they are known without loading
    it (:func:`spec_config`: a ``tiny:`` family, an embedded model, a local directory's config.json or a cached hub
    id's, their ``text_config`` when nested); None otherwise (an uncached hub id, a GGUF file, ``random:``, a spec or
    config that is wrong: the stage checks them once the model loads, and the loader says what is wrong). A key the
    config lacks is None."""
    try:
        config = spec_config(spec, revision)
    except UserError:
        return None  # an unknown tiny family, a missing directory, an unreadable config.json: told where it loads
    if config is None:
        return None
    return {k: config.get(k) for k in ("num_hidden_layers", "max_position_embeddings")}


def spec_vocabulary(spec: str, revision: str | None = None) -> int | None:
    """``vocab_size`` of the model ``--model spec`` names (at ``revision``), from its config alone
    (:func:`spec_config`), or None when only its load can tell (a ``.gguf``, ``random:``, an uncached hub id, a
    missing directory or unreadable config: refused where it loads)."""
    try:
        config = spec_config(spec, revision)
    except UserError:
        return None
    value = (config or {}).get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def spec_windows(spec: str, revision: str | None = None) -> list[int | None] | None:
    """Per-layer sliding window (None: full) of the model ``--model spec`` names (at ``revision``), from its config
    alone (:func:`spec_config`, :func:`kvdiag.model.families.config_windows`), or None when only its load can tell."""
    from kvdiag.model.families import config_windows

    spec = split_adapter(spec)[0]
    try:
        config = spec_config(spec, revision)
    except UserError:
        return None  # a missing directory or unreadable config.json: refused where it loads
    if config is None:
        return None
    return config_windows(config, config_model_type(spec, config))


def config_model_type(spec: str, config: dict) -> str | None:
    """The ``model_type`` (kvdiag's family, as a Trace records it) of ``spec`` whose :func:`spec_config` is
    ``config``: a tiny family's from its config class (its config dict does not carry it)."""
    return TINY_MODEL_TYPES[TINY[spec.split(":", 1)[1]][0]] if spec.startswith("tiny:") else config.get("model_type")


def spec_model_type(spec: str, revision: str | None = None) -> str | None:
    """The ``model_type`` of the model ``--model spec`` names, from its config alone (:func:`spec_config`), or None
    when only its load can tell."""
    spec = split_adapter(spec)[0]
    try:
        config = spec_config(spec, revision)
    except UserError:
        return None  # a missing directory or unreadable config.json: refused where it loads
    return None if config is None else config_model_type(spec, config)
