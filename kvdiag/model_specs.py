"""What ``--model`` may name, checked without torch or transformers (the CLI refuses a bad spec before any heavy
import; ``kvdiag.models`` loads it): the tiny random families' configs (``tiny:<family>``) and the spec's syntax."""

from __future__ import annotations

import json
from pathlib import Path

from kvdiag.errors import UserError

# --------------------------------------------------------------------------- tiny random models

TINY_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    # a large init range makes attention and next-token distributions peaked, so eviction effects are visible
    initializer_range=0.2,
)


BYTE_VOCAB = 259  # 256 byte tokens + bos/eos/pad


def byte_tokenizer(vocab_size: int = BYTE_VOCAB):
    """A byte-level tokenizer (256 byte tokens + bos/eos/pad), built in memory. A larger ``vocab_size`` adds
    filler tokens ``<rI>`` (never produced by encoding) so that every id a model of that vocabulary generates
    decodes to some text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    vocab.update({f"<r{i}>": i for i in range(len(vocab), vocab_size)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


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


def check_model_spec(spec: str) -> str:
    """Refuse what is wrong with ``--model spec`` before it loads: an unknown ``tiny:`` family, a missing ``.gguf``
    file (a hub id or directory is checked when it loads)."""
    if spec.startswith("tiny:") and spec.split(":", 1)[1] not in TINY:
        raise UserError(f"--model {spec}: unknown tiny architecture; use one of {', '.join('tiny:' + a for a in TINY)}")
    if spec.endswith(".gguf") and not Path(spec).is_file():
        raise UserError(f"--model {spec}: GGUF file not found; check the path")
    return spec


def known_shape(spec: str) -> dict | None:
    """``{"num_hidden_layers", "max_position_embeddings"}`` of ``--model spec`` where they are known without loading
    it (a ``tiny:`` family; a local directory's config.json, its ``text_config`` when nested); None otherwise (a hub
    id, a GGUF file, an embedded model: the stage checks them once the model loads). A key the config lacks is None."""
    if spec.startswith("tiny:") and spec.split(":", 1)[1] in TINY:
        config = {**TINY_COMMON, **TINY[spec.split(":", 1)[1]][1]}
    elif (Path(spec) / "config.json").is_file():
        try:
            config = json.loads((Path(spec) / "config.json").read_text())
        except (OSError, ValueError):
            return None  # the loader says what is wrong with it
        config = config.get("text_config") or config if isinstance(config, dict) else {}
    else:
        return None
    return {k: config.get(k) for k in ("num_hidden_layers", "max_position_embeddings")}

