"""Options shared by several commands (one definition each), and how ``--help`` groups every option.

A flag that several commands take is declared once in :data:`FLAGS` (its names, value syntax and parser) and made
by :func:`flag` with the command's default and help; options every command shares whole (``--model``, ``--seed``,
...) are the constants below. :func:`arrange_help` puts each option of every command in a panel (inputs, what to
compute, outputs, performance; replay's two modes in their own) and drops typer's ``<bool>`` placeholder of flags.
"""

from __future__ import annotations

import math
import re
import typing
from functools import partial
from pathlib import Path

import typer

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import parse_horizon
from kvdiag.core.schema import HARM, N_BOOT, NOISE_MULT


def path_arg(text: str, flag: str = "a path option") -> Path:
    """A path option's value, used literally: an empty one is refused (``Path("")`` would be the current directory,
    where a command would then read or write)."""
    if text == "":
        raise UserError(f"{flag} is empty: give a path (an empty one would mean the current directory)")
    return Path(text)


# Every flag several commands declare: its names (the first is the flag) and what its value looks like (metavar,
# parser). A command gives its default and help through flag().
FLAGS: dict[str, dict] = {
    "--out": {"metavar": "PATH", "parser": path_arg},
    "--trace": {"metavar": "TRACE_DIR", "parser": path_arg},
    "--scores": {"metavar": "SCORES.parquet", "parser": path_arg},
    "--labels": {"metavar": "LABELS.parquet", "parser": path_arg},
    "--model": {"metavar": "MODEL"},
    "--prompts": {"metavar": "PROMPTS"},
    "--limit": {"metavar": "K"},
    "--plugin": {"metavar": "MODULE|FILE.py"},
    "--dtype": {"metavar": "DTYPE"},
    # N teacher-forced steps or rest, parsed once here (kvdiag.core.parsing.parse_horizon); HORIZON_STEPS where a
    # command has no prompt end to run to (a bench's synthetic prefix, replay's labels)
    "--horizon": {"metavar": "N|rest", "parser": parse_horizon},
    "--scorers": {"metavar": "NAMES"},
    "--rule": {"metavar": "NAME"},
    "--param": {"metavar": "RULE.KEY=VALUE"},
    "--selection": {"metavar": "per-head|per-token|stochastic[:TAU]"},
    "--checkpoints": {"metavar": "SPEC"},
    "--granularity": {"metavar": "token|layer|head"},
    "--keep": {"metavar": "F,..."},
    "--budget": {"metavar": "B,..."},
    "--interval": {"metavar": "K"},
    "--max-new-tokens": {"metavar": "N"},
    "--temperature": {"metavar": "T"},
    "--top-p": {"metavar": "P"},
    "--samples": {"metavar": "N"},
    "--chat": {"names": ("--chat/--no-chat",)},
    "--instruction": {"metavar": "TEXT"},
    "--no-instruction": {},
    "--store": {"metavar": "all|kv|none|LAYERS"},
    "--candidates": {"metavar": "N|all"},
    "--w-obs": {"metavar": "W"},
    "--method": {"metavar": "exact|fast|fisher|hybrid"},
    "--fisher-samples": {"names": ("--fisher-samples", "--samples"), "metavar": "N"},
    "--exact-top": {"metavar": "M"},
    "--exact-frac": {"metavar": "F"},
    "--audit": {"metavar": "N"},
    "--miss-rate": {"metavar": "R"},
    "--search-rows": {"metavar": "N"},
    "--search-seconds": {"metavar": "S"},
    "--prefix": {"metavar": "P"},
    "--n": {"metavar": "N"},
    "--batch-size": {"metavar": "N"},
    "--backend": {"metavar": "auto|torch|triton"},
    "--chunk": {"metavar": "STEPS"},
    "--shard": {"metavar": "i/n"},
    "--repeats": {"metavar": "N"},
    "--overwrite": {},  # an existing output that is not this command's own: replace it (kvdiag.core.guard)
}
HORIZON_STEPS = {"metavar": "N", "parser": partial(parse_horizon, rest=False)}


def flag(name: str, default, help: str | None = None, **override):
    """The option ``name`` of :data:`FLAGS` with this command's ``default`` and ``help`` (``override``: e.g.
    ``**HORIZON_STEPS``)."""
    declared = {**FLAGS[name], **override}
    names = declared.pop("names", (name,))
    if "parser" in declared:  # its refusals name the flag
        declared["parser"] = partial(declared["parser"], flag=name)
    return typer.Option(default, *names, help=help, **declared)


# The panels of --help, in order: an option's panel is the first that names its flag, else WHAT; replay's options
# whose help starts with "Free-running:" / "Teacher-forced:" go to that mode's panel.
INPUTS, WHAT, OUTPUTS, PERFORMANCE = "Inputs", "What to compute", "Outputs", "Performance"
PANELS = {
    INPUTS: {"--trace", "--scores", "--labels", "--model", "--revision", "--trust-remote-code", "--dtype", "--prompts",
             "--limit", "--plugin", "--chat", "--instruction", "--no-instruction", "--include", "--adapter",
             "--bench", "--benchmark", "--run", "--teacher-forced", "--force"},
    OUTPUTS: {"--out", "--quiet", "--overwrite", "--list", "--viewer", "--no-viewer", "--rewrite"},
    PERFORMANCE: {"--batch-size", "--backend", "--chunk", "--shard", "--device", "--repeats", "--workers", "--threads",
                  "--search-rows", "--search-seconds"},
}
MODES = ("Free-running", "Teacher-forced")


def arrange_help(command) -> None:
    """Put every option of ``command`` and its subcommands in its --help panel, and show flags without typer's
    ``<bool>`` placeholder (a flag takes no value)."""
    for sub in getattr(command, "commands", {}).values():
        arrange_help(sub)
    make_help = command.get_help_option

    def help_option(ctx, make=make_help):  # click makes --help when help is asked for: a flag too
        option = make(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = help_option
    for param in getattr(command, "params", []):
        if getattr(param, "param_type_name", "") != "option":
            continue
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
        if getattr(param, "rich_help_panel", None):
            continue
        mode = next((m for m in MODES if (param.help or "").startswith(m + ":")), None)
        if mode is not None:
            param.help = param.help[len(mode) + 1:].strip()
            param.help = param.help[:1].upper() + param.help[1:]
        opts = set(param.opts) | set(param.secondary_opts)
        param.rich_help_panel = mode or next((panel for panel, flags in PANELS.items() if opts & flags), WHAT)
    order = [INPUTS, WHAT, *MODES, OUTPUTS, PERFORMANCE]
    if hasattr(command, "params"):  # panels print in the order of their first option: arguments stay first
        command.params.sort(key=lambda p: order.index(p.rich_help_panel) + 1
                            if getattr(p, "param_type_name", "") == "option" and p.rich_help_panel in order else 0)

Model = flag("--model", "smollm2", "hub id, local HF dir, file.gguf, smollm2 or gemma3-270m (embedded), "
                                                "tiny:FAMILY (random, for tests) or random:NAME[:layers=N] (random "
                                                "weights at a real model's shape, for benchmarks)")
Dtype = flag("--dtype", "float32", "float32 | float16 | bfloat16")
Device = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N")
Revision = typer.Option(None, "--revision", help="hub revision (branch, tag or commit)")
TrustRemoteCode = typer.Option(False, "--trust-remote-code", help="allow the model repo's own code (off by default)")
Prompts = flag("--prompts", "builtin:arith", "file.jsonl (problem/question/prompt, answer, "
                                                          "unique_id/id), file.txt, or builtin:<suite>[:N[:LENGTH]] "
                                                          "(arith, recall)")
Limit = flag("--limit", None, "use only the first K prompts")
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


# The largest value of every numeric option (inclusive; floats are finite too), so that no number a user types
# makes memory or time grow without bound; a stage checks its own lower bounds and relations with one line each.
# (low, high): low None where the stage's own check names the fix. tests/test_cli_help.py: every numeric option
# of every command is here.
MAX_ENTRIES = 10**7  # budgets, prefixes, ages, positions: beyond any context kvdiag can hold
BOUNDS: dict[str, tuple[float | None, float]] = {
    "--audit": (None, 10**6), "--batch-size": (None, 65536), "--bins": (None, 10**4), "--bootstrap": (None, 10**6),
    "--budget": (None, MAX_ENTRIES), "--candidates": (None, MAX_ENTRIES), "--checkpoints": (None, 10**4),
    "--chunk": (None, 65536), "--draws": (None, 1000), "--exact-frac": (None, 1.0), "--exact-top": (None, MAX_ENTRIES),
    "--exclude": (None, MAX_ENTRIES), "--fisher-samples": (None, 4096), "--folds": (None, 1000),
    "--greedy-chunk": (None, 1.0), "--harmful-quantile": (None, 1.0), "--head-dim": (None, 65536),
    "--heads": (None, 4096), "--interval": (None, MAX_ENTRIES), "--keep": (None, 1.0), "--keep-fraction": (None, 1.0),
    "--kv-heads": (None, 4096), "--large-payload-quantile": (None, 1.0), "--level": (None, 1.0),
    "--limit": (None, MAX_ENTRIES), "--low-attention-quantile": (None, 1.0), "--max-age": (None, MAX_ENTRIES),
    "--max-new-tokens": (None, 10**6), "--min-age": (None, MAX_ENTRIES), "--min-group": (None, MAX_ENTRIES),
    "--min-new-tokens": (None, 10**6), "--miss-rate": (1e-3, 1.0), "--n": (None, 10**6), "--noise-mult": (None, 1e6),
    "--pair-candidates": (None, 10**5), "--pairs": (None, 10**6), "--prefix": (None, MAX_ENTRIES),
    "--repeats": (None, 1000), "--rho": (None, 1.0), "--samples": (None, 1000), "--scale": (None, 1000),
    "--search-rows": (None, 10**5), "--search-seconds": (None, 10**6), "--seconds": (None, 3600),
    "--seed": (None, 2**32 - 1), "--size": (None, 16384), "--strong-read-mult": (None, 1e6),
    "--temperature": (None, 100.0), "--top-k": (None, MAX_ENTRIES), "--top-p": (None, 1.0),
    "--trace-len": (None, MAX_ENTRIES), "--w-delay": (None, MAX_ENTRIES), "--w-obs": (None, MAX_ENTRIES),
    "--window": (None, MAX_ENTRIES),
}
NUMBER = {int: re.compile(r"[-+]?[0-9]+"), float: re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")}


def numeric(param) -> type | None:
    """``int`` or ``float`` when the typer option ``param`` takes one number (optional or not), else None."""
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None or getattr(descriptor.parameter_info, "parser", None) is not None:
        return None  # a parser of its own (parse_horizon) reads it
    kinds = [a for a in (typing.get_args(descriptor.annotation) or (descriptor.annotation,)) if a is not type(None)]
    return kinds[0] if len(kinds) == 1 and kinds[0] in (int, float) else None


def check_number(flag: str, text: str, kind: type) -> None:
    """``text`` is a number of ``kind`` in ASCII digits within :data:`BOUNDS` of ``flag`` (one line otherwise)."""
    if not NUMBER[kind].fullmatch(text):
        raise UserError(f"{flag} {text}: use {'an integer' if kind is int else 'a number'} in ASCII digits, e.g. "
                        f"{flag} 8")
    low, high = BOUNDS[flag]
    value = kind(text)
    if not math.isfinite(value) or value > high or (low is not None and value < low):
        span = f"at most {_n(high)}" if low is None else f"in [{_n(low)}, {_n(high)}]"
        raise UserError(f"{flag} {text}: must be {span}")


def _n(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def check_argv(root, argv: list[str]) -> None:
    """What the command line alone says is wrong, before click converts it: a single-valued option given twice (it
    would silently keep the last value; list-valued options are declared repeatable and accumulate), and a number
    that is not ASCII digits or lies outside its option's :data:`BOUNDS`."""
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
            value = args[j].split("=", 1)[1] if has_value else (args[j + 1] if j + 1 < len(args) else None)
            if value is not None and (kind := numeric(p)) is not None:
                check_number(flag, value, kind)
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
    check_argv(root, argv)
    return root.main(args=argv, prog_name="kvdiag", standalone_mode=False)
