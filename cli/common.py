"""Options shared by several commands (one definition each)."""

from __future__ import annotations

import typer

Model = typer.Option("smollm2", "--model", help="hub id, local HF dir, file.gguf, smollm2 (embedded) or tiny:llama / tiny:qwen3")
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
