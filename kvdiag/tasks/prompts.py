"""Prompt sources: JSONL (MATH-500 / AIME fields), plain text, and the builtin suites ``builtin:<suite>[:N[:LENGTH]]``
(``kvdiag.tasks.suites``: their generators and the components each generation is graded on).

``load_prompts(source)`` returns ``Prompt`` records; ``encode_prompt`` turns one into token ids,
applying the tokenizer's chat template when the model has one (``chat=True``).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvdiag.core.errors import UserError
from kvdiag.core.io import read_utf8
from kvdiag.core.parsing import safe_id
from kvdiag.tasks.suites import SUITES, Prompt, arith_prompts, load_builtin, recall_prompts

__all__ = ["DEFAULT_INSTRUCTION", "Prompt", "arith_prompts", "encode_prompt", "load_prompts", "recall_prompts",
           "rendered_prompt", "safe_id"]

# Appended to math prompts, as in the R1 / R-KV MATH-500 setups. A named default, overridable.
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TEXT_FIELDS = ("problem", "question", "prompt")
ID_FIELDS = ("unique_id", "id")


def load_prompts(source: str, limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """Prompts from ``source``: ``builtin:arith[:N]``, a ``.jsonl`` file, or a text file (one prompt a line)."""
    if limit is not None and limit <= 0:
        raise UserError(f"--limit {limit}: must be a positive number of prompts")
    if source.startswith("builtin:"):
        prompts = load_builtin(source, limit, seed)
    else:
        path = Path(source)
        if not path.is_file():
            raise UserError(f"--prompts {source}: file not found; pass a .jsonl or .txt file, or builtin:<suite> "
                            f"({', '.join(SUITES)})")
        prompts = _jsonl(path) if path.suffix == ".jsonl" else _text(path)
    if not prompts:
        raise UserError(f"--prompts {source}: no prompts found; the file is empty")
    ids = [p.prompt_id for p in prompts]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise UserError(f"--prompts {source}: prompt id {dup!r} occurs twice; make the ids unique")
    return prompts[:limit] if limit else prompts


def _jsonl(path: Path) -> list[Prompt]:
    prompts = []
    for lineno, line in enumerate(read_utf8(path, "--prompts").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(
                f"--prompts {path}: line {lineno} is not valid JSON ({err.msg}); fix or remove that line"
            ) from err
        if not isinstance(rec, dict):
            raise UserError(f"--prompts {path}: line {lineno} is not a JSON object; each line must be an object")
        text = next((rec[f] for f in TEXT_FIELDS if isinstance(rec.get(f), str)), None)
        if text is None:
            given = next((f for f in TEXT_FIELDS if f in rec), None)
            if given is not None:
                raise UserError(f"--prompts {path}: line {lineno}: field {given!r} is a {type(rec[given]).__name__}, "
                                "not a string; write the prompt's text as a JSON string")
            raise UserError(f"--prompts {path}: line {lineno} has none of the fields {', '.join(TEXT_FIELDS)}")
        raw_id = next((str(rec[f]) for f in ID_FIELDS if rec.get(f) is not None), f"p{len(prompts):04d}")
        answer = rec.get("answer")
        prompts.append(Prompt(safe_id(raw_id), text, None if answer is None else str(answer), raw_id))
    return prompts


def _text(path: Path) -> list[Prompt]:
    lines = [ln.strip() for ln in read_utf8(path, "--prompts").splitlines()]
    return [Prompt(f"p{i:04d}", ln, None, None) for i, ln in enumerate(l for l in lines if l)]


def chat_turns(prompt: Prompt, instruction: str | None = DEFAULT_INSTRUCTION) -> list[dict]:
    """The chat of ``prompt``: its shots as earlier (user, assistant) turns, its text as the last user turn, with
    ``instruction`` appended unless the prompt has shots (they fix the answer's format)."""
    turns = [{"role": role, "content": c} for user, answer in prompt.shots
             for role, c in (("user", user), ("assistant", answer))]
    return [*turns, {"role": "user", "content": _with_instruction(prompt, instruction)}]


def plain_text(prompt: Prompt, instruction: str | None = DEFAULT_INSTRUCTION) -> str:
    """``prompt`` without a chat template: its shots and its text (with ``instruction``, as in :func:`chat_turns`)
    joined by blank lines."""
    return "\n\n".join([*(f"{q}\n{a}" for q, a in prompt.shots), _with_instruction(prompt, instruction)])


def _with_instruction(prompt: Prompt, instruction: str | None) -> str:
    return f"{prompt.text}\n{instruction}" if instruction and not prompt.shots else prompt.text


def rendered_prompt(
    tokenizer, prompt: Prompt, chat: bool = True, instruction: str | None = DEFAULT_INSTRUCTION
) -> tuple[str, bool]:
    """The text :func:`encode_prompt` tokenizes and whether the tokenizer adds its special tokens to it: with ``chat``
    and a chat template, its :func:`chat_turns` rendered with the generation prompt (the template writes them); without,
    its :func:`plain_text`."""
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(chat_turns(prompt, instruction), add_generation_prompt=True,
                                             tokenize=False), False
    return plain_text(prompt, instruction), True


def encode_prompt(
    tokenizer, prompt: Prompt, chat: bool = True, instruction: str | None = DEFAULT_INSTRUCTION
) -> list[int]:
    """Token ids of ``prompt`` through a transformers ``tokenizer``: its :func:`rendered_prompt`, tokenized
    (``kvdiag.model.token_count.TokenCounter.prompt_ids`` does the same without transformers)."""
    text, special = rendered_prompt(tokenizer, prompt, chat, instruction)
    return tokenizer(text, add_special_tokens=special).input_ids
