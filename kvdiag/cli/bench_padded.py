"""``kvdiag bench padded`` (#58): ``EvictingCache`` in ``model.generate`` on a left-padded batch against the same rows
unpadded, as tokens/s ratios of paired runs in one run (``kvdiag.generate.bench``)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvdiag.cli import common
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console

LENGTHS = (96, 90, 84, 78, 72, 66, 60, 54)  # kvdiag.generate.bench.LENGTHS (that module imports torch)


def bench_padded(
    model: str = common.Model,
    rule: str = common.flag("--rule", "rkv", "The rule the EvictingCache keeps entries by (one that runs on a "
                            "live cache: rkv, snapkv, tova, ...)."),
    budget: int = common.flag("--budget", 48, "Entries kept per (layer, KV head)."),
    interval: int = common.flag("--interval", 16, "Generated tokens between compressions."),
    max_new_tokens: int = common.flag("--max-new-tokens", 48, "New tokens per row: every row writes exactly this "
                                      "many (greedy, EOS suppressed)."),
    repeats: int = common.flag("--repeats", 7, "Timed pairs (padded and unpadded), in ABBA order: the side timed "
                               "first alternates."),
    out: Path | None = common.flag("--out", None, "Also write the numbers as JSON here."),
) -> None:
    """A left-padded batch of 8 prompts (96 down to 54 tokens) against the same 8 rows unpadded (96 tokens each):
    per-pair ratio of tokens/s, its median and range, peak memory, and whether each padded row writes the tokens
    its prompt writes alone."""
    check_outputs({"--out": out})
    from kvdiag.core.errors import UserError
    from kvdiag.model.specs import check_model_spec, known_shape
    from kvdiag.scorers.fields import HISTORY, LIVE, check_budget_fits, live_protected
    from kvdiag.scorers.names import check_scorer_names

    # the arguments, before torch is imported
    for flag, value in (("--budget", budget), ("--interval", interval), ("--max-new-tokens", max_new_tokens),
                        ("--repeats", repeats)):
        if value < 1:
            raise UserError(f"{flag} {value}: use a positive number")
    if rule == "all":
        raise UserError("--rule all: bench one rule, e.g. --rule rkv")
    check_scorer_names([rule], "--rule")
    if rule in HISTORY:
        raise UserError(f"--rule {rule} needs the attention of every past query (it declares needs_history), which "
                        f"a live cache does not keep; use one of {', '.join(LIVE)}")
    if (protected := live_protected(rule, None, None, budget + interval)) is not None:
        check_budget_fits(rule, protected, budget, budget + interval)
    check_model_spec(model)
    context = (known_shape(model) or {}).get("max_position_embeddings")
    if context and max(LENGTHS) + max_new_tokens > context:
        raise UserError(f"--max-new-tokens {max_new_tokens}: the {max(LENGTHS)}-token prompts would exceed the "
                        f"model's context of {context}; use --max-new-tokens {context - max(LENGTHS)} or less")
    import torch

    from kvdiag.core.io import write_json
    from kvdiag.generate.bench import SIDES, TARGET, run_padded_bench
    from kvdiag.generate.live import check_live_scorer, make_scorer
    from kvdiag.model.load import load_model

    common.quiet_transformers()
    lm = load_model(model)
    scorer = make_scorer(rule)
    check_live_scorer(scorer, budget, interval, lm.attention.num_heads // lm.attention.num_kv_heads,
                      lm.attention.qk_head_dim)
    r = run_padded_bench(lm, scorer, budget, interval, repeats, max_new_tokens)
    s = r.summary()
    table = Table(title=f"bench padded: {model} on {lm.model.device} ({torch.get_num_threads()} threads), {rule}, "
                        f"B={budget}, interval {interval}, prefill once, {r.rows} rows x {max_new_tokens} new tokens; "
                        f"padded prompts {max(r.lengths)}..{min(r.lengths)} tokens, unpadded {max(r.lengths)}")
    for col in ("pair", "first", "padded s", "unpadded s", "padded tok/s", "unpadded tok/s", "ratio", "CPU ratio"):
        table.add_column(col, justify="right")
    for i, (pair, first, ratio, cpu) in enumerate(zip(r.pairs, r.firsts, r.ratios, r.cpu_ratios, strict=True)):
        table.add_row(str(i + 1), first, *(f"{pair[side].seconds:.2f}" for side in SIDES),
                      *(f"{r.tokens / pair[side].seconds:.1f}" for side in SIDES), f"{ratio:.3f}", f"{cpu:.3f}")
    console = plain_console(width=max(120, Console().width))
    console.print(table)

    def mb(x):
        return "n/a" if x is None else f"{x:,.0f} MB"

    met = "met" if s["median_meets_target"] else "NOT met"
    console.print(
        f"median tokens/s: padded {s['padded_tokens_per_s_median']:.1f}, unpadded "
        f"{s['unpadded_tokens_per_s_median']:.1f}; checkpoints (score, choose, compact) per run: padded "
        f"{s['padded_checkpoint_s_median']:.2f} s, unpadded {s['unpadded_checkpoint_s_median']:.2f} s\n"
        f"peak RSS: process {mb(r.peak_rss_mb)} (after the model load {mb(r.load_rss_mb)}); one run over the RSS "
        f"before it: padded {mb(r.peak_mb['padded'])}, unpadded {mb(r.peak_mb['unpadded'])} (VmHWM)\n"
        f"same tokens as each prompt alone: {r.same_tokens}/{r.rows} padded rows\n"
        f"ratio padded/unpadded tokens/s: median {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}; CPU "
        f"time {s['cpu_median']:.3f}) over {s['pairs']} ABBA pairs; target >= {TARGET}: {met} by the median, "
        f"{s['at_target']}/{s['pairs']} pairs at or above it"
    )
    if out is not None:
        write_json(out, {"kind": "bench_padded", "model": model, "rule": rule, "budget": budget, "interval": interval,
                         "max_new_tokens": max_new_tokens, "repeats": repeats, "prefill": "once",
                         "threads": torch.get_num_threads(), **r.to_json()})
