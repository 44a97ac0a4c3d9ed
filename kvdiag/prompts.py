"""Prompt sources: JSONL (MATH-500 / AIME fields), plain text, and the builtin suites ``builtin:<suite>[:N[:LENGTH]]``.

``load_prompts(source)`` returns ``Prompt`` records; ``encode_prompt`` turns one into token ids,
applying the tokenizer's chat template when the model has one (``chat=True``).

Builtin suites (seeded, checked by code; ``N`` prompts, ``LENGTH`` the suite's length knob):

- ``arith`` -- 3-5 step word problems with an integer answer (math-verify); no length knob.
- ``recall`` -- the model copies a 4-digit code, counts from 1 to ``LENGTH`` (default 20) and writes the code again
  at the end, after two worked examples of the same length given as earlier chat turns. Graded exactly: the whole
  generation must equal the expected text. The stop depends on the model's own count (the examples fix its
  length) and the final line on recalling a value ``LENGTH`` lines back, so an eviction that drops the code or
  loses the count shows up as a wrong answer. FullKV accuracy: README, "Eviction in the loop".
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from kvdiag.errors import UserError

# Appended to math prompts, as in the R1 / R-KV MATH-500 setups. A named default, overridable.
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TEXT_FIELDS = ("problem", "question", "prompt")
ID_FIELDS = ("unique_id", "id")


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``prompt_id`` is filesystem-safe; ``source_id`` is the id as the source wrote it."""

    prompt_id: str
    text: str
    answer: str | None = None
    source_id: str | None = None
    shots: tuple[tuple[str, str], ...] = ()  # worked (user, assistant) turns before ``text``; they fix the format
    check: str = "math"  # how ``answer`` is graded: ``math`` (math-verify) or ``exact`` (the whole generation)


def safe_id(raw: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw).strip("._") or "prompt"


def load_prompts(source: str, limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """Prompts from ``source``: ``builtin:arith[:N]``, a ``.jsonl`` file, or a text file (one prompt a line)."""
    if limit is not None and limit <= 0:
        raise UserError(f"--limit {limit}: must be a positive number of prompts")
    if source.startswith("builtin:"):
        prompts = _builtin(source, limit, seed)
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


def _builtin(source: str, limit: int | None, seed: int) -> list[Prompt]:
    """``builtin:<suite>[:N[:LENGTH]]``: N prompts of the suite (default: ``limit`` or 20) at its length knob."""
    name, *rest = source.removeprefix("builtin:").split(":")
    usage = "builtin:<suite>[:N[:LENGTH]], e.g. builtin:recall:50:20"
    if name not in SUITES:
        raise UserError(f"--prompts {source}: unknown builtin suite {name!r}; use one of {', '.join(SUITES)} ({usage})")
    if len(rest) > 2 or not all(r.isdigit() and int(r) > 0 for r in rest):
        raise UserError(f"--prompts {source}: N and LENGTH must be positive integers ({usage})")
    count = int(rest[0]) if rest else (limit or 20)
    if count > MAX_BUILTIN:
        raise UserError(f"--prompts {source}: N {count} is more than the {MAX_BUILTIN:,} prompts a builtin suite "
                        f"makes; use N <= {MAX_BUILTIN}")
    make, lengths = SUITES[name]
    if len(rest) < 2:
        return make(count, seed)
    if lengths is None:
        raise UserError(f"--prompts {source}: builtin:{name} has no length knob; drop :{rest[1]}")
    length = int(rest[1])
    if length not in lengths:
        raise UserError(f"--prompts {source}: LENGTH {length} is outside builtin:{name}'s {lengths.start}.."
                        f"{lengths.stop - 1}; pick a length in that range")
    return make(count, seed, length)


def _jsonl(path: Path) -> list[Prompt]:
    prompts = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
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
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    return [Prompt(f"p{i:04d}", ln, None, None) for i, ln in enumerate(l for l in lines if l)]


# --------------------------------------------------------------------------- builtin:arith

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "coins", "books", "cards", "shells"]


def arith_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """``n`` seeded multi-step arithmetic word problems (3–5 steps) with their integer answers."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        total = rng.randint(5, 40)
        sentences = [f"{name} has {total} {item}."]
        for _ in range(rng.randint(2, 4)):
            op = rng.choice(["buy", "give", "double", "boxes"])
            if op == "buy":
                k = rng.randint(2, 25)
                total += k
                sentences.append(f"Then {name} buys {k} more {item}.")
            elif op == "give" and total > 2:
                k = rng.randint(1, total - 1)
                total -= k
                sentences.append(f"Then {name} gives {k} {item} to a friend.")
            elif op == "double" and total < 200:
                total *= 2
                sentences.append(f"Then the number of {item} {name} has doubles.")
            else:
                boxes, per = rng.randint(2, 6), rng.randint(2, 9)
                total += boxes * per
                sentences.append(f"Then {name} receives {boxes} boxes with {per} {item} in each box.")
        sentences.append(f"How many {item} does {name} have now?")
        out.append(Prompt(f"arith{i:03d}", " ".join(sentences), str(total), f"arith{i:03d}"))
    return out


# --------------------------------------------------------------------------- builtin:recall

MAX_BUILTIN = 10_000  # prompts of a builtin suite: more would only hang the command that makes them
RECALL_LENGTH = 20  # count length when builtin:recall is given no LENGTH
RECALL_SHOTS = 2  # worked examples before the question (same length: the model copies their shape)


def recall_prompts(n: int, seed: int = 0, length: int = RECALL_LENGTH) -> list[Prompt]:
    """``n`` seeded recall prompts: copy a 4-digit code, count 1..``length``, write the code again (exact check)."""
    rng = random.Random(seed)

    def example() -> tuple[str, str]:
        code = rng.randint(1000, 9999)
        counting = "\n".join(f"{i}. {i}" for i in range(1, length + 1))
        return (f"Remember the code {code}. Count from 1 to {length}, then write the code.",
                f"Code: {code}\n{counting}\nThe code is {code}.")

    out = []
    for i in range(n):
        shots = tuple(example() for _ in range(RECALL_SHOTS))
        question, answer = example()
        out.append(Prompt(f"recall{i:03d}", question, answer, f"recall{i:03d}", shots=shots, check="exact"))
    return out


# name -> (make(n, seed[, length]), the lengths it accepts or None: no length knob)
SUITES = {"arith": (arith_prompts, None), "recall": (recall_prompts, range(1, 1001))}


def encode_prompt(
    tokenizer, prompt: Prompt, chat: bool = True, instruction: str | None = DEFAULT_INSTRUCTION
) -> list[int]:
    """Token ids of ``prompt``; with ``chat`` and a chat template, its shots as earlier turns and its text as the
    last user turn plus the generation prompt (without, the turns joined by blank lines). ``instruction`` is
    appended to the text unless the prompt has shots (they fix the answer's format)."""
    text = f"{prompt.text}\n{instruction}" if instruction and not prompt.shots else prompt.text
    if chat and getattr(tokenizer, "chat_template", None):
        turns = [{"role": role, "content": c} for user, answer in prompt.shots
                 for role, c in (("user", user), ("assistant", answer))]
        rendered = tokenizer.apply_chat_template(
            [*turns, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(rendered, add_special_tokens=False).input_ids
    return tokenizer("\n\n".join([*(f"{q}\n{a}" for q, a in prompt.shots), text])).input_ids
