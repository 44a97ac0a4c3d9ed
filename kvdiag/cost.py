"""Cost model: bytes and FLOPs per token of a Trace and of its labels, from a model's config alone.

Arithmetic, not measurement: ``kvdiag bench scale`` measures the embedded model and prints this model
beside it; docs/scale.md extrapolates it to an 8B Llama at 32k tokens. The stored tensor bytes are exact
(a test checks them against the files of a tiny Trace); everything else counts matmul FLOPs and the bytes
a decoding step must read, and names every assumption (``GPU``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.trace.writer import STORAGE_DTYPES, store_spec, stored_names

# Upper bound of the token table per position: tokens.parquet plus the per-prompt part it is merged from
# (ids, text, flags, logprob, entropy; zstd). Measured: 30-45 B/position on SmolLM2 and tiny Traces.
TOKEN_TABLE_BYTES = 128


@dataclass(frozen=True)
class ModelShape:
    """What the cost depends on: layers L, query heads H, KV heads Hkv, head dim d, hidden size D, MLP width
    I (gated: 3 matrices), vocabulary V."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config, name: str = "") -> ModelShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            name or getattr(config, "model_type", "model"), config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, head_dim, config.hidden_size, config.intermediate_size, config.vocab_size,
        )

    @property
    def matmul_params(self) -> int:
        """Weights a token multiplies by: q/k/v/o projections, gated MLP, LM head (the embedding is a lookup)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.intermediate) + self.hidden * self.vocab

    def kv_cache_bytes(self, dtype_bytes: int) -> int:
        """KV cache per token: k and v of every layer and KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def stored_bytes(self, store: str = "all", storage_dtype: str = "float16") -> int:
        """Tensor bytes a Trace writes per token under ``--store`` (q [H, d], k and v [Hkv, d] per stored layer)."""
        spec, size = store_spec(store, self.layers), STORAGE_DTYPES[storage_dtype].itemsize
        rows = {"q": self.heads, "k": self.kv_heads, "v": self.kv_heads}
        return sum(rows[n] for layer in range(self.layers) for n in stored_names(spec, layer)) * self.head_dim * size

    def forward_flops(self, context: float) -> float:
        """Matmul FLOPs of one token attending to ``context`` keys: 2 per weight, plus QK and PV (2·2·H·d per key)."""
        return 2 * self.matmul_params + 4 * self.layers * self.heads * self.head_dim * context

    def layer_flops(self, context: float) -> float:
        """One decoder layer's matmul FLOPs for one token over ``context`` keys (``forward_flops`` without the LM
        head)."""
        return (self.forward_flops(context) - 2 * self.hidden * self.vocab) / self.layers

    def layer_start_ceiling(self, context: float) -> float:
        """FLOP ratio full depth / layer start for layer-granularity label rows over ``context`` cached keys, the
        evicted layer uniform over ``0..L-1``: a row that starts at layer ``l`` runs ``L - l`` layers (``(L + 1) / 2``
        on average) and always the LM head (the full-vocabulary KL needs every logit). Speed-ups above it would
        come from elsewhere than skipping layers."""
        layer, head = self.layer_flops(context), 2 * self.hidden * self.vocab
        return (self.layers * layer + head) / ((self.layers + 1) / 2 * layer + head)


# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): 32 layers, 32/8 heads of 128, hidden 4096, MLP 14336, vocab 128256
LLAMA_8B = ModelShape("Llama-3.1-8B", 32, 32, 8, 128, 4096, 14336, 128256)


@dataclass(frozen=True)
class GPU:
    """Named assumptions of the extrapolation (defaults: an H200's datasheet peaks, dense bf16, and a
    fraction of them that a batch-1 decoder and a batched teacher-forced forward reach)."""

    name: str = "H200"
    tflops: float = 989.0  # dense bf16 peak
    bandwidth: float = 4.8e12  # HBM bytes/s
    compute_efficiency: float = 0.4  # achieved / peak FLOP/s of the batched label forwards and the prefill
    bandwidth_efficiency: float = 0.6  # achieved / peak bytes/s of batch-1 decoding (reads weights + cache each step)


@dataclass(frozen=True)
class TraceCost:
    """One trace of T tokens (arithmetic): decoding, the oracle labels, and the disk per ``--store`` mode."""

    shape: ModelShape
    tokens: int
    dtype_bytes: int = 2  # the model's compute dtype (bf16 on a GPU)
    label_every: int = 512
    candidates: int = 64
    horizon: int = 16

    @property
    def decode_bytes(self) -> float:
        """Bytes read while generating: the weights every step plus the cache so far (sum over steps)."""
        T, b = self.tokens, self.dtype_bytes
        return T * self.shape.matmul_params * b + self.shape.kv_cache_bytes(b) * T * (T - 1) / 2

    @property
    def decode_flops(self) -> float:
        return self.tokens * self.shape.forward_flops((self.tokens - 1) / 2)  # the mean context of T steps

    @property
    def checkpoints(self) -> list[int]:
        return list(range(self.label_every, self.tokens - self.horizon + 1, self.label_every))

    @property
    def prefill_flops(self) -> float:
        """One teacher-forced forward over the whole trace: the labels' golden run, or a ``--store none`` rebuild."""
        return self.tokens * self.shape.forward_flops(self.tokens / 2)

    @property
    def label_flops(self) -> float:
        """Per checkpoint t: the golden prefill is shared; (N + 1 null) rows of H tokens over t cached keys."""
        rows = (self.candidates + 1) * self.horizon
        return self.prefill_flops + sum(rows * self.shape.forward_flops(t) for t in self.checkpoints)

    def disk_bytes(self, store: str) -> float:
        return self.tokens * (self.shape.stored_bytes(store) + TOKEN_TABLE_BYTES)

    def seconds(self, gpu: GPU) -> dict[str, float]:
        """Decode (bandwidth-bound) and label (compute-bound) seconds of this trace on one ``gpu``."""
        return {"trace": self.decode_bytes / (gpu.bandwidth * gpu.bandwidth_efficiency),
                "label": self.label_flops / (gpu.tflops * 1e12 * gpu.compute_efficiency)}


def extrapolation(
    cost: TraceCost, gpu: GPU = GPU(), problems: int = 500, gpus: tuple[int, ...] = (1, 8)
) -> list[tuple[str, str]]:
    """(quantity, value) rows of the arithmetic for one trace and for ``problems`` of them split over ``gpus``
    GPUs (torchrun ranks take whole prompts, so time divides and nothing else changes)."""
    shape, T, sec = cost.shape, cost.tokens, cost.seconds(gpu)
    rebuild = cost.prefill_flops / (gpu.tflops * 1e12 * gpu.compute_efficiency)
    rows = [
        ("matmul weights per token", f"{shape.matmul_params / 1e9:.2f} G ({2 * shape.matmul_params / 1e9:.1f} GFLOP)"),
        ("attention FLOPs per token per cached key", f"{4 * shape.layers * shape.heads * shape.head_dim:,}"),
        ("KV cache per token (bf16)", f"{shape.kv_cache_bytes(2):,} B ({shape.kv_cache_bytes(2) * T / 1e9:.1f} GB at "
                                      f"T = {T:,})"),
    ]
    rows += [(f"Trace on disk per token, --store {m}", f"{shape.stored_bytes(m):,} B + token table <= "
                                                       f"{TOKEN_TABLE_BYTES} B "
        f"({cost.disk_bytes(m) / 1e9:,.3g} GB per trace, {problems * cost.disk_bytes(m) / 1e12:,.3g} TB for "
        f"{problems})")
             for m in ("all", "kv", "none")]
    rows += [
        ("host RAM of the recorded rows while tracing (--store all)", f"{shape.stored_bytes('all') * T / 1e9:.1f} GB"),
        ("decode: bytes read (weights every step + cache so far)", f"{cost.decode_bytes / 1e12:,.0f} TB, "
                                                                   f"{cost.decode_flops / 1e12:,.0f} TFLOP"),
        (f"labels: {len(cost.checkpoints)} checkpoints (every {cost.label_every}) x ({cost.candidates} + 1) rows x "
         f"{cost.horizon} tokens",
         f"{cost.label_flops / 1e12:,.0f} TFLOP (golden prefill included)"),
        ("rebuild of a --store none Trace (one prefill)", f"{cost.prefill_flops / 1e12:,.0f} TFLOP, {rebuild:.1f} s"),
        (f"one trace on one {gpu.name}", f"trace {sec['trace']:,.0f} s (batch 1, bandwidth-bound), labels "
                                         f"{sec['label']:,.1f} s"),
    ]
    for n in gpus:
        rows.append((f"{problems} traces on {n} {gpu.name}" + ("s (torchrun)" if n > 1 else ""),
                     f"trace {problems * sec['trace'] / n / 3600:,.1f} h, labels "
                     f"{problems * sec['label'] / n / 60:,.1f} min"))
    return rows
