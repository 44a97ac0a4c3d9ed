"""Options shared by several commands (one definition each)."""

from __future__ import annotations

import typer

from kvdiag.errors import UserError

Model = typer.Option("smollm2", "--model", help="hub id, local HF dir, file.gguf, smollm2 or gemma3-270m (embedded), or tiny:FAMILY (random, for tests)")
Dtype = typer.Option("float32", "--dtype", help="float32 | float16 | bfloat16")
Device = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N")
Revision = typer.Option(None, "--revision", help="hub revision (branch, tag or commit)")
TrustRemoteCode = typer.Option(False, "--trust-remote-code", help="allow the model repo's own code (off by default)")
Prompts = typer.Option("builtin:arith", "--prompts", help="file.jsonl (problem/question/prompt, answer, unique_id/id), file.txt, or builtin:arith")
Limit = typer.Option(None, "--limit", help="use only the first K prompts")
Seed = typer.Option(0, "--seed")
Quiet = typer.Option(False, "--quiet", help="no progress bars")


def quiet_transformers() -> None:
    """transformers' own progress bars and advisory warnings would drown kvdiag's progress display."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def listed(values: list[str] | None) -> list[str]:
    """The items of a repeatable comma-separated option: ``--budget 128,256 --budget 512`` -> 128, 256, 512
    (repeats accumulate; nothing is dropped)."""
    return [item.strip() for value in values or () for item in value.split(",") if item.strip()]


def joined(values: list[str] | None) -> str | None:
    """``listed`` as one comma-separated string (None when the option was not given)."""
    items = listed(values)
    return ",".join(items) if items else None


def parse_ints(values: list[str] | None, flag: str) -> list[int] | None:
    """A repeatable comma-separated option of integers (None when not given)."""
    items = listed(values)
    if not items:
        return None
    try:
        return [int(x) for x in items]
    except ValueError:
        raise UserError(f"{flag} {','.join(items)}: use comma-separated integers, e.g. {flag} 0,5,11") from None


def refuse_given(ctx: typer.Context, names: list[str], reason: str) -> None:
    """An option that cannot apply is bad input, not a silent no-op: refuse each of ``names`` (parameter names)
    that the user set on the command line."""
    for param in ctx.command.params:
        if param.name in names and ctx.get_parameter_source(param.name).name != "DEFAULT":
            raise UserError(f"{max(param.opts, key=len)} does not apply {reason}; drop it")
