"""Options shared by several commands (one definition each)."""

from __future__ import annotations

import typer

from kvdiag.core.errors import UserError
from kvdiag.core.schema import HARM, N_BOOT, NOISE_MULT

Model = typer.Option("smollm2", "--model", help="hub id, local HF dir, file.gguf, smollm2 or gemma3-270m (embedded), "
                                                "tiny:FAMILY (random, for tests) or random:NAME[:layers=N] (random "
                                                "weights at a real model's shape, for benchmarks)")
Dtype = typer.Option("float32", "--dtype", help="float32 | float16 | bfloat16")
Device = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N")
Revision = typer.Option(None, "--revision", help="hub revision (branch, tag or commit)")
TrustRemoteCode = typer.Option(False, "--trust-remote-code", help="allow the model repo's own code (off by default)")
Prompts = typer.Option("builtin:arith", "--prompts", help="file.jsonl (problem/question/prompt, answer, "
                                                          "unique_id/id), file.txt, or builtin:<suite>[:N[:LENGTH]] "
                                                          "(arith, recall)")
Limit = typer.Option(None, "--limit", help="use only the first K prompts")
Seed = typer.Option(0, "--seed", min=0, help="random seed (>= 0)")
Quiet = typer.Option(False, "--quiet", help="no progress bars")
# which labels are analysed and which are harmful (kvdiag.core.harm.HarmSpec)
Harm = typer.Option(HARM, "--harm", help="harmful: kl_mean above quantile:Q of the analysed labels, or above abs:TAU "
                    "nats")
NoiseMult = typer.Option(NOISE_MULT, "--noise-mult", help="unresolved: kl_mean <= noise_mult * noise_floor")
IncludeUnresolved = typer.Option(False, "--include-unresolved", help="analyse labels at or below their noise floor too")
Bootstrap = typer.Option(N_BOOT, "--bootstrap", "--n-boot", help="cluster-bootstrap resamples over prompts (0: no CIs; "
                                                                 "--n-boot is the deprecated name)")
# --rho (fraction evicted), --keep (fraction kept) and --budget (entries kept): one definition, in docs/decisions.md
BUDGET_TERMS = "(--rho: fraction evicted, --keep: fraction kept, --budget: entries kept; docs/decisions.md#budgets)"
# which candidates are evaluated (kvdiag.rankeval.candidates)
MinAge = typer.Option(None, "--min-age", help="only candidates of age (checkpoint - position) >= A")
MaxAge = typer.Option(None, "--max-age", help="only candidates of age <= A")
Eligible = typer.Option(None, "--eligible", help="only the entries this scorer could evict (outside its protected "
                                                 "sinks, windows and delay buffer), e.g. avokv_e")


def quiet_transformers() -> None:
    """transformers' own progress bars and advisory warnings would drown kvdiag's progress display."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def refuse_given(ctx: typer.Context, names: list[str], reason: str) -> None:
    """An option that cannot apply is bad input, not a silent no-op: refuse each of ``names`` (parameter names)
    that the user set on the command line."""
    for param in ctx.command.params:
        if param.name in names and ctx.get_parameter_source(param.name).name != "DEFAULT":
            raise UserError(f"{max(param.opts, key=len)} does not apply {reason}; drop it")


def resolve_command(root, argv: list[str]):
    """(the (sub)command of the click group ``root`` that ``argv`` runs, its names, the index of its first
    argument); typer's click is duck-typed."""
    cmd, names, i = root, [], 0
    while hasattr(cmd, "commands") and i < len(argv) and not argv[i].startswith("-"):
        if argv[i] not in cmd.commands:
            break  # an unknown command: click says so
        cmd, names, i = cmd.commands[argv[i]], names + [argv[i]], i + 1
    return cmd, names, i


def refuse_repeated_options(root, argv: list[str]) -> None:
    """A single-valued option given twice would silently keep the last value: refuse it (list-valued options
    are declared repeatable and accumulate)."""
    cmd, _, i = resolve_command(root, argv)
    options = {opt: p for p in getattr(cmd, "params", []) if getattr(p, "param_type_name", "") == "option"
               for opt in p.opts + p.secondary_opts}
    seen: dict[str, str] = {}
    args = argv[i:]
    j = 0
    while j < len(args):
        flag, has_value = args[j].split("=", 1)[0], "=" in args[j]
        p = options.get(flag) if flag.startswith("-") else None
        if p is not None:
            if not p.is_flag and not has_value:
                j += 1  # skip the option's value
            if not p.multiple:
                if p.name in seen:
                    first = seen[p.name]
                    raise UserError(f"{flag} is given twice: it takes one value; pass it once" if first == flag else
                                    f"{first} and {flag} set the same option: pass only one of them")
                seen[p.name] = flag
        j += 1


def invoke(root, argv: list[str]):
    """Run ``argv`` through the click group ``root`` as the ``kvdiag`` console script does, repeated options refused;
    exceptions propagate (``kvdiag.cli.main.main`` turns them into one line and an exit code). ``kvdiag demo`` runs its
    stages through this, with the root it is given by click."""
    refuse_repeated_options(root, argv)
    return root.main(args=argv, prog_name="kvdiag", standalone_mode=False)
