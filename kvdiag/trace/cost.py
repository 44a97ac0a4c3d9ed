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
    I (gated: 3 matrices), vocabulary V; for mixtures of experts the experts a token runs (``active_experts``,
    each of width I) and the router's outputs (``router``); per-layer sliding windows (``windows``: one per layer,
    None = full; empty = every layer full), which bound the keys a query reads."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    active_experts: int = 1
    router: int = 0
    windows: tuple[int | None, ...] = ()

    @classmethod
    def from_config(cls, config, name: str = "") -> ModelShape:
        from kvdiag.model.adapters import family_of, layer_windows, text_config

        config = text_config(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
        active, width = 1, config.intermediate_size
        if experts:  # MoE: each token runs top-k experts (Qwen3-MoE's are moe_intermediate_size wide)
            active, width = config.num_experts_per_tok, getattr(config, "moe_intermediate_size", None) or width
        try:
            windows = tuple(layer_windows(config, family_of(config)[1]))
        except Exception:  # a family the adapter does not know: count full attention
            windows = ()
        return cls(
            name or getattr(config, "model_type", "model"), config.num_hidden_layers, config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim, config.hidden_size,
            width, config.vocab_size, active, experts, windows if any(w is not None for w in windows) else (),
        )

    @property
    def layer_params(self) -> int:
        """Weights one decoder layer multiplies a token by: q/k/v/o projections, the gated MLP of each active expert,
        the router."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + self.active_experts * 3 * self.hidden * self.intermediate + self.hidden * self.router

    @property
    def head_flops(self) -> int:
        """The LM head's matmul FLOPs for one token (2 per weight: D x V)."""
        return 2 * self.hidden * self.vocab

    @property
    def matmul_params(self) -> int:
        """Weights a token multiplies by: every layer's (``layer_params``) and the LM head (the embedding is a
        lookup)."""
        return self.layers * self.layer_params + self.hidden * self.vocab

    def kv_cache_bytes(self, dtype_bytes: int) -> int:
        """KV cache per token: k and v of every layer and KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def stored_bytes(self, store: str = "all", storage_dtype: str = "float16") -> int:
        """Tensor bytes a Trace writes per token under ``--store`` (q [H, d], k and v [Hkv, d] per stored layer)."""
        spec, size = store_spec(store, self.layers), STORAGE_DTYPES[storage_dtype].itemsize
        rows = {"q": self.heads, "k": self.kv_heads, "v": self.kv_heads}
        return sum(rows[n] for layer in range(self.layers) for n in stored_names(spec, layer)) * self.head_dim * size

    def _keys(self, context: float, start: int = 0) -> float:
        """Keys read by one query over ``context`` keys, summed over layers ``start..L-1`` (a sliding layer reads at
        most its window)."""
        if not self.windows:
            return (self.layers - start) * context
        return sum(context if w is None else min(context, w) for w in self.windows[start:])

    def forward_flops(self, context: float) -> float:
        """Matmul FLOPs of one token attending to ``context`` keys: 2 per weight, plus QK and PV (2·2·H·d per key
        and layer)."""
        return 2 * self.matmul_params + 4 * self.heads * self.head_dim * self._keys(context)

    def layer_flops(self, context: float) -> float:
        """One decoder layer's matmul FLOPs for one token over ``context`` keys (``forward_flops`` without the LM
        head, averaged over the layers)."""
        return (self.forward_flops(context) - self.head_flops) / self.layers

    def layer_start_ceiling(self, context: float) -> float:
        """FLOP ratio full depth / layer start for layer-granularity label rows over ``context`` cached keys, the
        evicted layer uniform over ``0..L-1``: a row that starts at layer ``l`` runs ``L - l`` layers (``(L + 1) / 2``
        on average) and always the LM head (the full-vocabulary KL needs every logit). Speed-ups above it would
        come from elsewhere than skipping layers."""
        layer, head = self.layer_flops(context), self.head_flops
        return (self.layers * layer + head) / ((self.layers + 1) / 2 * layer + head)

    def row_flops(self, checkpoint: int, horizon: int, start: int = 0) -> float:
        """Matmul FLOPs of one label row: ``horizon`` teacher-forced tokens at positions ``checkpoint ..
        checkpoint + horizon - 1`` (query ``tau`` reads the prefix and its own suffix: ``tau + 1`` keys, one fewer
        where an entry is evicted: not counted), through layers ``start..L-1`` and the LM head."""
        per_layer = 2 * self.layer_params * (self.layers - start)
        return sum(per_layer + 4 * self.heads * self.head_dim * self._keys(tau + 1, start) + self.head_flops
                   for tau in range(checkpoint, checkpoint + horizon))

    def generation_flops(self, prompt_len: int, new_tokens: int) -> float:
        """Matmul FLOPs of greedy generation of ``new_tokens`` after a ``prompt_len``-token prompt, as ``generate``
        runs it: one prefill (position ``i`` reads ``i + 1`` keys, the LM head at the last position only), then one
        forward per further token (``new_tokens - 1`` of them) over the cache so far."""
        attn = 4 * self.heads * self.head_dim
        layers = 2 * self.layer_params * self.layers
        prefill = sum(layers + attn * self._keys(i + 1) for i in range(prompt_len)) + self.head_flops
        decode = sum(self.forward_flops(prompt_len + g + 1) for g in range(new_tokens - 1))
        return prefill + decode


# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): 32 layers, 32/8 heads of 128, hidden 4096, MLP 14336, vocab 128256
LLAMA_8B = ModelShape("Llama-3.1-8B", 32, 32, 8, 128, 4096, 14336, 128256)


# Measured MFU (achieved matmul FLOP/s / the matmul peak measured in the same run, ``kvdiag bench label``) of the
# exact label engine, token rows and layer rows; reports/bench/cpu-mfu.md has the commands and the profiles.
# ``make gpu-check`` measures the same on a GPU: ``GPU.from_gpu_check`` reads its results file.
# (layer: layer-start rows, batches of N = 16 / 8 rows; measured 2026-12-02 with other jobs on the machine, load ~4)
MEASURED_MFU: dict[str, dict[str, float]] = {
    "cpu: 2-core AMD EPYC (this project's machine), fp32, SmolLM2-135M, P = 512, N = 64, H = 16": {
        "token": 0.35, "layer": 0.17},
    "cpu: 2-core AMD EPYC, fp32, random:llama-3.1-8b:layers=2, P = 2,048, N = 8, H = 16": {
        "token": 0.45, "layer": 0.57},
}
# An H200's label forwards: no GPU measurement exists yet (no GPU was available to this project), so the
# extrapolation assumes this fraction of the datasheet peak; replace it with gpu-check's measured MFU.
ASSUMED_GPU_MFU = 0.4


@dataclass(frozen=True)
class GPU:
    """Named assumptions of the extrapolation (defaults: an H200's datasheet peaks, dense bf16, and a
    fraction of them that a batch-1 decoder and a batched teacher-forced forward reach).

    ``compute_efficiency``: achieved / peak FLOP/s of the batched label forwards and the prefill. The default is
    ``ASSUMED_GPU_MFU`` (assumed, not measured); ``GPU.from_gpu_check`` takes the MFU and the bf16 peak that
    ``make gpu-check`` measured instead. ``MEASURED_MFU`` holds the CPU figures."""

    name: str = "H200"
    tflops: float = 989.0  # dense bf16 peak
    bandwidth: float = 4.8e12  # HBM bytes/s
    compute_efficiency: float = ASSUMED_GPU_MFU
    bandwidth_efficiency: float = 0.6  # achieved / peak bytes/s of batch-1 decoding (reads weights + cache each step)

    @classmethod
    def from_gpu_check(cls, path) -> GPU:
        """The GPU that ``make gpu-check`` measured: its name, its measured bf16 matmul peak as ``tflops`` and the
        token engine's measured MFU at the largest prefix as ``compute_efficiency`` (``results.json``, written by
        ``kvdiag.bench.gpu_check``)."""
        import json
        from pathlib import Path

        res = json.loads(Path(path).read_text())
        peak = res["summary"]["bf16_peak_tflops"]
        mfu = res["summary"]["label_engine_mfu"]
        if not (peak and mfu):
            from kvdiag.core.errors import UserError

            raise UserError(f"{path}: the gpu check measured no bf16 peak or label MFU (a dry run, or the steps "
                            "failed); run make gpu-check on a CUDA machine")
        return cls(name=res["summary"]["gpu"], tflops=peak, compute_efficiency=mfu)


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
