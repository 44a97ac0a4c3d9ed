"""``kvdiag trace``: generate reasoning traces and record post-RoPE q/k/v per layer and head."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console


def trace(
    ctx: typer.Context,
    out: Path = common.flag("--out", ..., "Trace directory (created; a rerun continues it)"),
    model: str = common.Model,
    prompts: str = common.Prompts,
    max_new_tokens: int = common.flag("--max-new-tokens", 512),
    limit: int | None = common.Limit,
    seed: int = common.Seed,
    sample: bool = typer.Option(False, "--sample/--greedy", help="sampling (--temperature, --top-p) or greedy "
                                                                 "decoding"),
    temperature: float = common.flag("--temperature", 0.6, "sampling temperature (with --sample)"),
    top_p: float = common.flag("--top-p", 0.95, "nucleus sampling mass (with --sample)"),
    min_new_tokens: int = typer.Option(0, "--min-new-tokens", help="no end-of-sequence before this many generated "
                                                                   "tokens"),
    chat: bool = common.flag("--chat", True, "apply the tokenizer's chat template"),
    instruction: str = common.flag("--instruction", None, "text appended to each prompt (default: step-by-step "
                                                                "+ \\boxed{})"),
    no_instruction: bool = common.flag("--no-instruction", False, "append nothing to the prompts"),
    storage_dtype: str = typer.Option("float16", "--storage-dtype", help="dtype of the stored q/k/v"),
    store: str = common.flag("--store", "all", "tensors written: all (q/k/v), kv (k/v), none (tokens only), or "
                                                     "layers "
        "e.g. 0,15,29 (their q/k/v); the rest are rebuilt on demand by one prefill per prompt"),
    dtype: str = common.Dtype,
    device: str = common.Device,
    revision: str | None = common.Revision,
    trust_remote_code: bool = common.TrustRemoteCode,
    shard: str | None = common.flag("--shard", None, "i/n: trace only prompts i, i+n, ... (Slurm arrays); merge "
                                                           "with a final run without --shard"),
    quiet: bool = common.Quiet,
) -> None:
    """Generate each prompt's trace and write the Trace directory (manifest, tokens, per-layer q/k/v)."""
    check_outputs({"--out": (out, "dir")}, {"--prompts": prompts}, writes_trace=True)
    from kvdiag.core import parsing
    from kvdiag.core.errors import UserError
    from kvdiag.model.specs import check_model_spec, known_shape
    from kvdiag.tasks.prompts import DEFAULT_INSTRUCTION, load_prompts
    from kvdiag.trace import GenerationSettings  # light: the settings, not the writer

    if no_instruction:
        common.refuse_given(ctx, ["instruction"], "with --no-instruction")
    if not sample:
        common.refuse_given(ctx, ["temperature", "top_p"], "to greedy decoding (add --sample)")
    settings = GenerationSettings(
        max_new_tokens=max_new_tokens, sample=sample, temperature=temperature, top_p=top_p,
        min_new_tokens=min_new_tokens, seed=seed, chat=chat, storage_dtype=storage_dtype, store=store,
        instruction=None if no_instruction else (instruction or DEFAULT_INSTRUCTION),
    )
    items = load_prompts(prompts, limit=limit, seed=seed)
    check_model_spec(model)
    if shape := known_shape(model, revision):  # a tiny family or a local config.json: layers and context, before torch
        if shape["num_hidden_layers"]:
            parsing.store_spec(store, shape["num_hidden_layers"])
        context = shape["max_position_embeddings"]
        if context and max_new_tokens >= context:  # a prompt has a token at least (trace_files counts each prompt's)
            raise UserError(f"--max-new-tokens {max_new_tokens}: a trace holds its prompt too, so it would exceed the "
                            f"model's context of {context}; use --max-new-tokens {context - 1} or less (less for "
                            "long prompts)")
    parsing.check_dtype(dtype)
    parsing.check_device_name(device)
    parsing.parse_shard(shard)
    from kvdiag.trace.manifest import check_continuation

    check_continuation(out, model, settings)
    from kvdiag.trace.writer import trace_files  # the stage: torch and the model, once the arguments are checked

    common.quiet_transformers()
    root = trace_files(items, out, settings, model=model, dtype=dtype, device=device, revision=revision,
                     trust_remote_code=trust_remote_code, prompts_source=prompts, shard=shard, quiet=quiet)
    if root is not None:
        plain_console().print(f"Trace written to {root} ({len(items)} prompts)")
    elif shard is not None:
        plain_console().print(f"shard {shard} traced into {out}/parts; run once more without --shard to merge")
