"""Options shared by several commands (one definition each)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import typer

from kvdiag.errors import UserError
from kvdiag.schema import CHECKPOINT_INTERVAL, HARM, N_BOOT, NOISE_MULT

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
Seed = typer.Option(0, "--seed")
Quiet = typer.Option(False, "--quiet", help="no progress bars")
# which labels are analysed and which are harmful (kvdiag.harm.HarmSpec)
Harm = typer.Option(HARM, "--harm", help="harmful: kl_mean above quantile:Q of the analysed labels, or above abs:TAU "
                    "nats")
NoiseMult = typer.Option(NOISE_MULT, "--noise-mult", help="unresolved: kl_mean <= noise_mult * noise_floor")
IncludeUnresolved = typer.Option(False, "--include-unresolved", help="analyse labels at or below their noise floor too")
Bootstrap = typer.Option(N_BOOT, "--bootstrap", "--n-boot", help="cluster-bootstrap resamples over prompts (0: no CIs; "
                                                                 "--n-boot is the deprecated name)")
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


def listed(values: str | Iterable[str] | None) -> list[str]:
    """The items of a repeatable comma-separated option: ``--budget 128,256 --budget 512`` -> 128, 256, 512
    (repeats accumulate; nothing is dropped)."""
    values = [values] if isinstance(values, str) else values
    return [item.strip() for value in values or () for item in str(value).split(",") if item.strip()]


def joined(values: list[str] | None) -> str | None:
    """``listed`` as one comma-separated string (None when the option was not given)."""
    items = listed(values)
    return ",".join(items) if items else None


def parse_list(values: str | Iterable[str] | None, flag: str, kind: type = int, *, low: float | None = None,
               high: float | None = None, strict: bool = False, choices: Iterable[str] | None = None,
               unique: bool = True, example: str = "") -> list:
    """The one parser of list options: the items of ``values`` (repeatable, comma-separated; see :func:`listed`)
    converted to ``kind`` (int, float or str), each within ``[low, high]`` (``strict``: ``(low, high)``) or one of
    ``choices``, and each given once (``unique``). Bad input is one ``UserError`` line naming ``flag`` and an
    ``example`` of a good value. Returns [] when nothing was given."""
    items = listed(values)
    text = ",".join(items)
    choices = list(choices) if choices is not None else None
    if kind is int:
        what = "integers"
    elif kind is float:
        what = "numbers"
    else:
        what = "one of " + ", ".join(choices) if choices else "names"
    if low is not None or high is not None:
        lo = "" if low is None else f"{low:g} {'<' if strict else '<='} "
        hi = "" if high is None else f" {'<' if strict else '<='} {high:g}"
        what += f" with {lo}x{hi}"
    fix = f"use comma-separated {what}" + (f", e.g. {flag} {example}" if example else "")
    try:
        out = [kind(item) for item in items]
    except ValueError:
        raise UserError(f"{flag} {text}: {fix}") from None
    for value, item in zip(out, items, strict=True):
        if choices is not None and value not in choices:
            raise UserError(f"{flag} {item}: {fix}")
        if kind in (int, float) and not math.isfinite(value):
            raise UserError(f"{flag} {item}: {fix}")
        below = low is not None and (value <= low if strict else value < low)
        above = high is not None and (value >= high if strict else value > high)
        if below or above:
            raise UserError(f"{flag} {item}: {fix}")
    if unique:
        seen = set()
        for value, item in zip(out, items, strict=True):
            if value in seen:
                raise UserError(f"{flag} {text}: {item} is given twice; give each once")
            seen.add(value)
    return out


CHECKPOINT_GRAMMAR = ("every:K (a checkpoint every K generated tokens), default (every:128) or comma-separated "
                      "positions t1,t2,...")


def parse_checkpoints(spec: str, flag: str = "--checkpoints") -> int | list[int]:
    """The one checkpoint grammar of every command: ``every:K`` -> K (> 0), ``default`` -> ``CHECKPOINT_INTERVAL``,
    ``t1,t2,...`` -> the sorted positions (each >= 1, each once); anything else is a ``UserError``."""
    text = str(spec).strip()
    if text == "default":
        return CHECKPOINT_INTERVAL
    fix = f"use {CHECKPOINT_GRAMMAR}, e.g. every:128 or 256,384"
    if text.startswith("every:"):
        interval = text[len("every:"):]
        if not interval.isdigit() or int(interval) < 1:
            raise UserError(f"{flag} {spec}: the interval K of every:K must be a positive integer; {fix}")
        return int(interval)
    if not text or not all(part.strip().lstrip("-").isdigit() for part in text.split(",")):
        raise UserError(f"{flag} {spec or repr(spec)}: {fix}")
    positions = parse_list(text, flag, int, example="256,384")
    if min(positions) < 1:
        raise UserError(f"{flag} {spec}: checkpoint {min(positions)} caches nothing; use positive positions (a "
                        "checkpoint t caches positions 0..t-1)")
    return sorted(positions)


def parse_ints(values: list[str] | None, flag: str) -> list[int] | None:
    """A repeatable comma-separated option of indices >= 0, each once (None when not given)."""
    return parse_list(values, flag, int, low=0, example="0,5,11") or None


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
