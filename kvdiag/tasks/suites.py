"""The builtin task suites ``builtin:<suite>[:N[:LENGTH]]``: seeded prompt generators, each suite's components (what
a generation is graded on, one verdict each) and which of them is its headline.

A component grades a generation's text against the prompt's expected answer (the ``answer`` column of
generations.parquet), so a replay is regraded from its generations alone, without a model. Roles: ``task`` (the
suite's headline: the answer the task asks for), ``step`` (a part of the work the task needs on the way) and
``format`` (the shape of the answer, whatever its values), reported beside the task, never folded into it.

Suites (``N`` prompts, ``LENGTH`` the suite's length knob; each prompt after worked examples of the same length, given
as earlier chat turns, that fix the answer's shape):

- ``arith`` -- 3-5 step word problems with an integer answer (math-verify); no length knob, no components.
- ``recall`` -- copy a 4-digit code, count from 1 to ``LENGTH`` (default 20), write the code again. Components:
  ``copied``, ``counted``, ``recalled`` (task), ``format``.
- ``keys`` -- multi-key recall after a long generation: copy ``KEYS`` (3) named codes, count from 1 to ``LENGTH``
  (default 40: 310 generated tokens on SmolLM2, each code read 290 tokens after it was copied), write every code
  again. Components as ``recall``. SmolLM2 at FullKV: 20/20 on every component (reports/suites-fullkv).
- ``countdown`` -- a step-by-step computation: from a start (LENGTH + 10 .. LENGTH + 59) count down by one for
  ``LENGTH`` (default 40) numbered steps, each reading the number the step before wrote, then write the start again.
  Components: ``copied``, ``counted`` (every step right), ``recalled`` (task: the start, read LENGTH steps later),
  ``format``. SmolLM2 at FullKV: recalled 17/20, counted 9/20 (reports/suites-fullkv): below the
  90 % a suite needs before rules are compared on it.

Every prompt of ``recall``, ``keys`` and ``countdown`` records the character spans of what its final answer needs
(``needs``: in its question; ``answer_needs``: in its expected generation), so a rule's kept entries can be checked
against them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvdiag.core.errors import UserError

MAX_BUILTIN = 10_000  # prompts of a builtin suite: more would only hang the command that makes them
MAX_ANSWER_TOKENS = 4096  # the longest generation a builtin suite may need: LENGTH is capped to fit it
SHOTS = 2  # worked examples before the question (same length: the model copies their shape)


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``prompt_id`` is filesystem-safe; ``source_id`` is the id as the source wrote it."""

    prompt_id: str
    text: str
    answer: str | None = None
    source_id: str | None = None
    shots: tuple[tuple[str, str], ...] = ()  # worked (user, assistant) turns before ``text``; they fix the format
    check: str = "math"  # how ``answer`` is graded: ``math`` (math-verify) or ``exact`` (the whole generation)
    needs: tuple[tuple[int, int], ...] = ()  # [start, end) character spans of ``text`` the final answer needs
    answer_needs: tuple[tuple[int, int], ...] = ()  # the same, in ``answer`` (the expected generation)


# --------------------------------------------------------------------------- components


@dataclass(frozen=True)
class Component:
    """One graded part of a suite's answer: ``grade(text, answer)`` is whether the generation ``text`` has it right
    against the expected ``answer``; ``what``: its definition, for the tables' notes."""

    name: str
    role: str  # "task" (the headline), "step" or "format"
    what: str
    grade: Callable[[str, str], bool]


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.strip().splitlines() if ln.strip()]


COUNT_LINE = re.compile(r"\d+\. \d+")


def _counted(text: str, answer: str) -> bool:
    """The generation's counting lines (``i. j``) are exactly the answer's, in order: none missing, none extra."""
    return [ln for ln in _lines(text) if COUNT_LINE.fullmatch(ln)] == _lines(answer)[1:-1]


def _first_line(text: str, answer: str) -> bool:
    got = _lines(text)
    return bool(got) and got[0] == _lines(answer)[0]


def _last_line(text: str, answer: str) -> bool:
    got = _lines(text)
    return bool(got) and got[-1] == _lines(answer)[-1]


def _shape(first: re.Pattern, last: re.Pattern) -> Callable[[str, str], bool]:
    """A header line matching ``first``, counting lines, and a last line matching ``last`` (values not checked)."""

    def grade(text: str, answer: str) -> bool:
        got = _lines(text)
        return (len(got) >= 2 and bool(first.fullmatch(got[0])) and bool(last.fullmatch(got[-1]))
                and all(COUNT_LINE.fullmatch(ln) for ln in got[1:-1]))

    return grade


def _count_components(header: str, last: str, first_re: str, last_re: str) -> tuple[Component, ...]:
    return (
        Component("copied", "step", f"the first line is the prompt's {header}, copied exactly", _first_line),
        Component("counted", "step", "the counting lines are exactly 1. 1 .. LENGTH. LENGTH, in order, none missing "
                  "or extra", _counted),
        Component("recalled", "task", f"the last line is {last} with the right value", _last_line),
        Component("format", "format", f"the shape kept, values aside: a header line ({first_re}), only counting "
                  f"lines (i. j), a last line ({last_re})", _shape(re.compile(first_re), re.compile(last_re))),
    )


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


# --------------------------------------------------------------------------- builtin:recall and builtin:keys

RECALL_LENGTH = 20  # count length when builtin:recall is given no LENGTH
KEYS_LENGTH = 40  # count length when builtin:keys is given no LENGTH
KEYS = 3  # named codes per builtin:keys prompt
KEY_NAMES = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "forest", "rocket", "silver",
             "garden"]


def _counting(length: int) -> str:
    return "\n".join(f"{i}. {i}" for i in range(1, length + 1))


def _span(text: str, part: str, start: int = 0) -> tuple[int, int]:
    at = text.index(part, start)
    return at, at + len(part)


def _seeded(name: str, n: int, example) -> list[Prompt]:
    """``n`` prompts ``{name}000``...: ``SHOTS`` worked examples, then the question, each drawn by ``example()`` ->
    (question, answer, the text the answer needs); exact check, the needed text's spans recorded."""
    out = []
    for i in range(n):
        shots = tuple(example()[:2] for _ in range(SHOTS))
        question, answer, needed = example()
        out.append(Prompt(f"{name}{i:03d}", question, answer, f"{name}{i:03d}", shots=shots, check="exact",
                          needs=(_span(question, needed),), answer_needs=(_span(answer, needed),)))
    return out


def recall_prompts(n: int, seed: int = 0, length: int = RECALL_LENGTH) -> list[Prompt]:
    """``n`` seeded recall prompts: copy a 4-digit code, count 1..``length``, write the code again (exact check)."""
    rng = random.Random(seed)

    def example() -> tuple[str, str, str]:
        code = rng.randint(1000, 9999)
        return (f"Remember the code {code}. Count from 1 to {length}, then write the code.",
                f"Code: {code}\n{_counting(length)}\nThe code is {code}.", str(code))

    return _seeded("recall", n, example)


def keys_prompts(n: int, seed: int = 0, length: int = KEYS_LENGTH) -> list[Prompt]:
    """``n`` seeded multi-key recall prompts: copy ``KEYS`` named 4-digit codes, count 1..``length``, write every code
    again (exact check). Each code is needed about ``7 * length`` tokens after it was copied (SmolLM2: 290 at the
    default length 40, whole answers of 310 tokens)."""
    rng = random.Random(seed)

    def example() -> tuple[str, str, str]:
        pairs = ", ".join(f"{k} {rng.randint(1000, 9999)}" for k in rng.sample(KEY_NAMES, KEYS))
        return (f"Remember the codes {pairs}. Count from 1 to {length}, then write the codes again.",
                f"Codes: {pairs}\n{_counting(length)}\nThe codes are {pairs}.", pairs)

    return _seeded("keys", n, example)


# --------------------------------------------------------------------------- builtin:countdown

COUNTDOWN_LENGTH = 40  # steps when builtin:countdown is given no LENGTH


def countdown_prompts(n: int, seed: int = 0, length: int = COUNTDOWN_LENGTH) -> list[Prompt]:
    """``n`` seeded countdown prompts: from a start in ``[length + 10, length + 59]`` write ``length`` numbered steps,
    each the previous step's number minus one, then the start again (exact check). Each step reads the result the one
    before wrote; the last line reads the start, written ``length`` steps earlier."""
    rng = random.Random(seed)

    def example() -> tuple[str, str, str]:
        start = rng.randint(length + 10, length + 59)
        steps = "\n".join(f"{i}. {start - i + 1}" for i in range(1, length + 1))
        return (f"Count down by one from {start}, {length} numbers, then write the start again.",
                f"Start: {start}\n{steps}\nThe start was {start}.", str(start))

    return _seeded("countdown", n, example)


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Suite:
    """A builtin suite: ``make(n, seed[, length])`` its prompts, ``lengths`` the LENGTHs it accepts (None: no length
    knob), ``components`` what each generation is graded on, ``default_length``."""

    name: str
    make: Callable[..., list[Prompt]]
    lengths: range | None = None
    components: tuple[Component, ...] = ()
    default_length: int | None = None

    @property
    def task(self) -> Component | None:
        """The headline component (None: the suite has none)."""
        return next((c for c in self.components if c.role == "task"), None)

    def component(self, name: str) -> Component:
        """The component ``name`` (bad input: UserError naming the suite's components)."""
        found = next((c for c in self.components if c.name == name), None)
        if found is None:
            have = ", ".join(c.name for c in self.components) or "none"
            raise UserError(f"component {name!r}: builtin:{self.name} has no such component; use one of {have}")
        return found


SUITES = {
    "arith": Suite("arith", arith_prompts),
    "recall": Suite("recall", recall_prompts, range(1, 10_001),
                    _count_components("code", "The code is CODE.", r"Code: \d+", r"The code is \d+\."), RECALL_LENGTH),
    "keys": Suite("keys", keys_prompts, range(1, 10_001),
                  _count_components("codes", "The codes are KEY CODE, ... (every key, its code, in order)",
                                    r"Codes: (\w+ \d+, )*\w+ \d+", r"The codes are (\w+ \d+, )*\w+ \d+\."),
                  KEYS_LENGTH),
    "countdown": Suite("countdown", countdown_prompts, range(1, 10_001), (
        Component("copied", "step", "the first line is Start: and the prompt's start, copied exactly", _first_line),
        Component("counted", "step", "the step lines are exactly 1. start .. LENGTH. start - LENGTH + 1: each the "
                  "previous one minus one, none missing or extra", _counted),
        Component("recalled", "task", "the last line is The start was START. with the right start", _last_line),
        Component("format", "format", "the shape kept, values aside: Start: N, only step lines (i. j), The start "
                  "was N.", _shape(re.compile(r"Start: \d+"), re.compile(r"The start was \d+\."))),
    ), COUNTDOWN_LENGTH),
}


def suite_of(source: str | None) -> Suite | None:
    """The builtin suite of a prompt source (``builtin:<suite>[:...]``), None for a file or an unknown name."""
    if not source or not source.startswith("builtin:"):
        return None
    return SUITES.get(source.removeprefix("builtin:").split(":")[0])


def select_components(source: str, names: list[str]) -> list[str]:
    """``--components``: ``names`` checked against the components of ``source``'s builtin suite, the task component
    added first when missing (the headline is always reported); bad input: UserError."""
    suite = suite_of(source)
    if suite is None or not suite.components:
        with_ = [n for n, s in SUITES.items() if s.components]
        raise UserError(f"--components applies to the builtin suites with components ({', '.join(with_)}), not "
                        f"--prompts {source}; drop --components")
    for name in names:
        try:
            suite.component(name)
        except UserError as err:
            raise UserError(f"--components {','.join(names)}: {err}") from None
    return list(dict.fromkeys([suite.task.name, *names]))


def grade(suite: Suite, text: str, answer: str) -> dict[str, bool]:
    """One verdict per component of ``suite`` for the generation ``text`` against the expected ``answer``."""
    return {c.name: c.grade(text, answer) for c in suite.components}


def load_builtin(source: str, limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """``builtin:<suite>[:N[:LENGTH]]``: N prompts of the suite (default: ``limit`` or 20) at its length knob (bad
    input: UserError, also for a LENGTH whose answers would need more than ``MAX_ANSWER_TOKENS``)."""
    name, *rest = source.removeprefix("builtin:").split(":")
    usage = "builtin:<suite>[:N[:LENGTH]], e.g. builtin:recall:50:20"
    if name not in SUITES:
        raise UserError(f"--prompts {source}: unknown builtin suite {name!r}; use one of {', '.join(SUITES)} ({usage})")
    if len(rest) > 2 or not all(r.isascii() and r.isdigit() and int(r) > 0 for r in rest):
        raise UserError(f"--prompts {source}: N and LENGTH must be positive integers ({usage})")
    count = int(rest[0]) if rest else (limit or 20)
    if count > MAX_BUILTIN:
        raise UserError(f"--prompts {source}: N {count} is more than the {MAX_BUILTIN:,} prompts a builtin suite "
                        f"makes; use N <= {MAX_BUILTIN}")
    suite = SUITES[name]
    if len(rest) < 2:
        return suite.make(count, seed)
    if suite.lengths is None:
        raise UserError(f"--prompts {source}: builtin:{name} has no length knob; drop :{rest[1]}")
    length = int(rest[1])
    if length not in suite.lengths:
        raise UserError(f"--prompts {source}: LENGTH {length} is outside builtin:{name}'s {suite.lengths.start}.."
                        f"{suite.lengths.stop - 1}; pick a length in that range")
    prompts = suite.make(count, seed, length)
    need, distance = answer_tokens(prompts[0])
    if need > MAX_ANSWER_TOKENS:
        raise UserError(f"--prompts {source}: LENGTH {length} puts builtin:{name}'s needed value at least {distance} "
                        f"tokens after it was written, in answers of at least {need} tokens: more than the "
                        f"{MAX_ANSWER_TOKENS} a builtin suite generates; use LENGTH <= {longest(suite)}")
    return prompts


# --------------------------------------------------------------------------- token counts without a tokenizer

_PIECE = re.compile(r"[^\W\d_]+|\d{1,3}")


def min_tokens(text: str) -> int:
    """A lower bound on the tokens of ``text``, no tokenizer needed: one per run of letters and per three digits
    (kvdiag's models' tokenizers, SmolLM2's and gemma3's, split digits one by one and never join two words or a word
    and a number). SmolLM2 writes the recall answer at length 20 in 140 tokens; this bound says 48."""
    return len(_PIECE.findall(text))


LOWER_BOUND = "at least: one per word and per 3 digits"


def answer_tokens(prompt: Prompt) -> tuple[int, int | None]:
    """(at least how many tokens the expected answer has, at least how many of them lie between the end of the
    first span its final line needs and that final line; None without ``answer_needs``): :func:`min_tokens`."""
    answer = prompt.answer or ""
    if not prompt.answer_needs:
        return min_tokens(answer), None
    last = answer.rstrip().rfind("\n") + 1
    return min_tokens(answer), min_tokens(answer[prompt.answer_needs[0][1] : last])


def longest(suite: Suite) -> int:
    """The largest LENGTH of ``suite`` whose answer needs at most ``MAX_ANSWER_TOKENS`` (by :func:`min_tokens`)."""
    lo, hi = suite.lengths.start, suite.lengths.stop - 1
    while lo < hi:  # answers grow with LENGTH
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if answer_tokens(suite.make(1, 0, mid)[0])[0] <= MAX_ANSWER_TOKENS else (lo, mid - 1)
    return lo


def check_generation_room(prompts: list[Prompt], max_new_tokens: int, source: str,
                          count: Callable[[str], int] = min_tokens, how: str = LOWER_BOUND) -> None:
    """Refuse (UserError) a ``max_new_tokens`` that ends the generation before a prompt's final line reads the value
    its ``answer_needs`` wrote, or that cannot hold its whole expected answer. ``count``: the tokens of a text (default
    the tokenizer-free lower bound :func:`min_tokens`; FreeRunning counts with the model's tokenizer), ``how``: what
    that count is, for the message."""
    for p in prompts:
        if p.check != "exact" or p.answer is None:
            continue
        need = count(p.answer)
        if p.answer_needs:
            last = p.answer.rstrip().rfind("\n") + 1
            distance = count(p.answer[p.answer_needs[0][1] : last])
            if distance >= max_new_tokens:
                raise UserError(f"--max-new-tokens {max_new_tokens}: prompt {p.prompt_id} of {source} reads its needed "
                                f"value {distance} tokens ({how}) after writing it, beyond the generation limit; use "
                                f"--max-new-tokens {need} or more, or a shorter LENGTH")
        if need > max_new_tokens:
            raise UserError(f"--max-new-tokens {max_new_tokens}: prompt {p.prompt_id} of {source} needs {need} "
                            f"generated tokens ({how}) for its answer; use --max-new-tokens {need} or more")
