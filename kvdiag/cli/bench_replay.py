"""``kvdiag bench replay``: batched free-running replay vs one generation at a time, and vs ``model.generate``
under an EvictingCache (``--arms``), as ratios in one run."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from kvdiag.cli import common
from kvdiag.core import parsing
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console


def bench_replay(
    model: str = common.Model,
    prompts: str = common.flag("--prompts", "builtin:recall:4", "Prompts of one token length (a builtin suite "
                                "has one length)."),
    scorers: list[str] = common.flag("--scorers", ["rkv,snapkv,tova,streamingllm"], "Scorers, comma-separated "
                                      "and repeatable; full_kv decodes with the full cache."),
    budget: int = common.flag("--budget", 128, "KV budget of every row."),
    interval: int = common.flag("--interval", 32, "Generated tokens between compressions."),
    selection: str = common.flag("--selection", "per-head", "per-head | per-token | stochastic[:TAU]."),
    max_new_tokens: int = common.flag("--max-new-tokens", 64),
    batch_size: int = common.flag("--batch-size", 16, "Rows decoded together."),
    samples: int = common.flag("--samples", 1, "Sampled generations per (prompt, scorer): the sweep's rows "
                                "with --samples (needs --temperature)."),
    temperature: float | None = common.flag("--temperature", None, "Sample at this temperature (default: "
                                             "greedy)."),
    top_p: float = common.flag("--top-p", 1.0, "Nucleus of the sampling (needs --temperature)."),
    limit: int | None = common.Limit,
    param: list[str] | None = common.flag("--param", None, "scorer.key=value, repeatable (as replay's)."),
    repeats: int = common.flag("--repeats", 1, "Alternating runs per method (best reported)."),
    arms: str = typer.Option("alone,batched", "--arms", help="Arms, comma-separated, compared with the batched loop "
                             "(always run): alone (one row at a time), generate (model.generate + EvictingCache, the "
                             "same batches)."),
    out: Path | None = common.flag("--out", None, "Also write the numbers as JSON here."),
    dtype: str = common.Dtype, device: str = common.Device,
) -> None:
    """Decode every prompt under every scorer alone, in batches and through model.generate; report seconds,
    tokens/s, the ratios, peak memory, how many rows wrote the same tokens, and generate's compaction share."""
    check_outputs({"--out": out}, {"--prompts": prompts})
    from kvdiag.core.errors import UserError
    from kvdiag.core.parsing import Selection
    from kvdiag.replay.config import check_params, check_samples
    from kvdiag.replay.sampling import Sampling

    # the arguments, before torch is imported
    names = parsing.parse_list(scorers, "--scorers", str)
    chosen_arms = parsing.parse_list([arms], "--arms", str)
    if unknown := [a for a in chosen_arms if a not in ("alone", "batched", "generate")]:
        raise UserError(f"--arms {arms}: unknown arm {unknown[0]!r}; use alone, batched and/or generate")
    if batch_size < 1 or repeats < 1 or max_new_tokens < 1 or samples < 1:
        raise UserError(f"--batch-size {batch_size} / --repeats {repeats} / --max-new-tokens {max_new_tokens} / "
                        f"--samples {samples}: use positive numbers")
    sampling = Sampling(temperature, top_p)  # checks temperature and top-p
    check_samples(samples, sampling)
    chosen = Selection.parse(selection)
    params = parsing.parse_params(param)
    check_params(params, names)
    import torch

    from kvdiag.core.io import write_json
    from kvdiag.generate.live import check_live_scorer, make_scorer
    from kvdiag.generate.policy import Policy
    from kvdiag.model.load import load_model
    from kvdiag.replay.bench import run_replay_bench
    from kvdiag.replay.run import FULL_KV
    from kvdiag.tasks.prompts import encode_prompt, load_prompts

    common.quiet_transformers()
    full = [n for n in names if n == FULL_KV]
    if full and len(full) != len(names):
        raise UserError(f"--scorers {','.join(names)}: full_kv rows have no budget; bench them on their own")
    policies = [None] * len(full) or [Policy(make_scorer(n, params.get(n)), budget, interval, chosen) for n in names]
    items = load_prompts(prompts, limit=limit)
    lm = load_model(model, dtype=dtype, device=device)
    for pol in policies:
        if pol is not None:
            check_live_scorer(pol.scorer, budget, interval, lm.attention.num_heads // lm.attention.num_kv_heads,
                              lm.attention.qk_head_dim)
    ids = [encode_prompt(lm.tokenizer, p) for p in items]
    if len({len(i) for i in ids}) != 1:
        raise UserError(f"--prompts {prompts}: the prompts have {len({len(i) for i in ids})} token lengths; bench "
                        "prompts of one length (a builtin suite)")
    r = run_replay_bench(lm, ids, [p.prompt_id for p in items], policies, max_new_tokens, batch_size, repeats,
                         sampling, samples, tuple(chosen_arms))

    def mb(x):
        return "n/a" if x is None else f"{x:,.0f} MB"

    label = {"alone": "alone (one decode per row)", "batched": f"batched loop ({batch_size} rows)",
             "generate": f"generate ({batch_size} rows)"}
    lines = [f"  {label[a]:<28} {s:.1f} s ({r.cpu_s[a]:.1f} s CPU), {r.tokens / s:.1f} tokens/s, peak "
             f"{mb(r.peak_mb[a])}, same tokens as the batched loop: {r.same_tokens[a]}/{r.rows}"
             for a, s in r.seconds.items()]
    if r.speedup is not None:
        lines.append(f"  speed-up alone / batched: {r.speedup:.2f}x")
    if r.generate_ratio is not None:
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in r.compaction_s.items())
        lines.append(f"  generate throughput / batched loop's: {r.generate_ratio:.2f}x; its checkpoints: "
                     f"{r.compaction_share:.1%} of its time ({parts}; the compaction itself {r.compact_share:.1%})")
    plain_console(width=max(120, Console().width)).print(
        f"bench replay: {model} {dtype} on {device} ({torch.get_num_threads()} threads), {len(items)} prompts x "
        f"{', '.join(names)}"
        + (f" x {samples} samples (temperature {temperature}, top-p {top_p})" if samples > 1 else "")
        + f" = {r.rows} rows, "
        f"B={budget if policies[0] else 'full'}, interval {interval}, {selection}, prompt {len(ids[0])} tokens\n"
        + "\n".join(lines)
    )
    if out is not None:
        write_json(out, {"kind": "bench_replay", "model": model, "prompts": prompts, "limit": limit, "scorers": names,
                         "params": params, "samples": samples, "temperature": temperature, "top_p": top_p,
                         "budget": budget, "interval": interval, "selection": selection,
                         "max_new_tokens": max_new_tokens, "arms": list(r.seconds), "threads": torch.get_num_threads(),
                         **r.to_json()})
