"""The pure parsers of command-line values: list options and the checkpoint grammar (the CLI's typer options sit
in ``kvdiag.cli.common``; library code parses through these)."""

from __future__ import annotations

import math
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvdiag.core.errors import UserError, check_choice
from kvdiag.core.schema import CHECKPOINT_INTERVAL, GRANULARITIES  # noqa: F401  (the parsers' choices)


def listed(values: str | Iterable[str] | None) -> list[str]:
    """The items of a repeatable comma-separated option: ``--budget 128,256 --budget 512`` -> 128, 256, 512
    (repeats accumulate; nothing is dropped)."""
    values = [values] if isinstance(values, str) else values
    return [item.strip() for value in values or () for item in str(value).split(",") if item.strip()]


def joined(values: list[str] | None) -> str | None:
    """``listed`` as one comma-separated string (None when the option was not given)."""
    items = listed(values)
    return ",".join(items) if items else None


MAX_INT = 10**9  # the largest integer a list option takes (every number is bounded)


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
    if kind in (int, float) and not all(item.isascii() for item in items):
        raise UserError(f"{flag} {text}: {fix} (ASCII digits)")
    try:
        out = [kind(item) for item in items]
    except ValueError:
        raise UserError(f"{flag} {text}: {fix}") from None
    for value, item in zip(out, items, strict=True):
        if kind is int and abs(value) > MAX_INT:
            raise UserError(f"{flag} {item}: at most {MAX_INT:,}")
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
        if not (interval.isascii() and interval.isdigit()) or int(interval) < 1:
            raise UserError(f"{flag} {spec}: the interval K of every:K must be a positive integer; {fix}")
        return int(interval)
    if not text or not all(re.fullmatch(r"-?[0-9]+", part.strip()) for part in text.split(",")):
        raise UserError(f"{flag} {spec or repr(spec)}: {fix}")
    positions = parse_list(text, flag, int, example="256,384")
    if min(positions) < 1:
        raise UserError(f"{flag} {spec}: checkpoint {min(positions)} caches nothing; use positive positions (a "
                        "checkpoint t caches positions 0..t-1)")
    return sorted(positions)


def safe_id(raw: str) -> str:
    """``raw`` as a file name: runs of anything but letters, digits, ``_ . -`` become ``_`` (a prompt's id, a part's
    key field); never empty, never leading ``_`` (the parts' header files start with ``_``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw).strip("._") or "prompt"


REST = "rest"  # a horizon that runs to the end of each prompt's trace
MAX_STEPS = 1_000_000  # the longest horizon or window: past any trace kvdiag can hold


def parse_horizon(spec: str | int, flag: str = "--horizon", rest: bool = True, what: str = "teacher-forced steps",
                  least: int = 1, short: str = "") -> int | str:
    """The one parser of a horizon or window of steps: ``N`` (a positive integer, ASCII digits) or, where ``rest``
    applies, ``rest`` (to the end of each prompt's trace: a label at checkpoint t of a prompt of length T gets
    T - t steps). Returns the int or ``REST``; an int or ``REST`` passes through (a parsed value is a value).
    Every ``--horizon``, ``--future-window`` and ``oracle_future.window`` goes through here (tests/test_layout.py
    greps for a second parser). ``least``: the smallest N the caller allows, ``short`` the reason it names when N
    falls below it (``--param oracle_future.window=N``: past the next compression plus the label horizon)."""
    text = str(spec)
    either = f"a number of {what} (a positive integer, e.g. 16)" + (" or rest (to the end of each prompt)" if rest
                                                                   else "")
    if text == REST:
        if rest:
            return REST
        raise UserError(f"{flag} {spec}: rest does not apply here; give {either}")
    if not re.fullmatch(r"-?[0-9]+", text):
        raise UserError(f"{flag} {spec}: use {either}")
    if int(text) < least and short:
        raise UserError(f"{flag}={spec}: {short}")
    if not max(1, least) <= int(text) <= MAX_STEPS:
        raise UserError(f"{flag} {spec}: must be {either}, at least {max(1, least)} and at most {MAX_STEPS:,}")
    return int(text)


def horizon_steps(horizon: int | str, t: int, length: int) -> int:
    """The steps a label at checkpoint ``t`` of a prompt of ``length`` tokens gets: N, or ``length - t`` (rest)."""
    return length - t if horizon == REST else int(horizon)


def parse_ints(values: list[str] | None, flag: str) -> list[int] | None:
    """A repeatable comma-separated option of indices >= 0, each once (None when not given)."""
    return parse_list(values, flag, int, low=0, example="0,5,11") or None


def read_positions(path, flag: str = "--include") -> dict[str, list[int]]:
    """A JSON file ``{prompt_id: [position, ...]}`` -> that mapping (positions sorted, deduplicated); a missing file,
    bad JSON or another shape is refused in one line."""
    import json
    from pathlib import Path

    from kvdiag.core.io import read_utf8

    if not Path(path).exists():
        raise UserError(f"{flag} {path}: no such file; give a JSON file {{prompt_id: [position, ...]}}")
    try:
        data = json.loads(read_utf8(path, flag))
    except json.JSONDecodeError as e:
        raise UserError(f"{flag} {path}: not a readable JSON file ({e}); give {{prompt_id: [position, ...]}}") from None
    if not isinstance(data, dict) or not all(
            isinstance(v, list) and all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in v)
            for v in data.values()):
        raise UserError(f"{flag} {path}: must map each prompt id to a list of token positions >= 0, e.g. "
                        '{"keys000": [747, 748]}')
    return {str(k): sorted(set(v)) for k, v in data.items()}


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """``--shard i/n`` -> (i, n) with 0 <= i < n; None -> None."""
    if spec is None:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", spec)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise UserError(f"--shard {spec}: use i/n with 0 <= i < n (e.g. $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)")
    return int(m.group(1)), int(m.group(2))


SELECTIONS = ("per-head", "per-token", "stochastic")
STOCHASTIC_TAU = 0.1  # default temperature of stochastic selection, over percentile ranks in [0, 1] (ours)


def parse_selection(spec: str, flag: str = "--selection") -> tuple[str, float | None]:
    """``per-head`` | ``per-token`` | ``stochastic`` | ``stochastic:TAU`` (TAU > 0) -> (mode, tau)."""
    mode, _, raw = str(spec).partition(":")
    check_choice(mode, SELECTIONS, flag)
    if mode != "stochastic":
        if raw:
            raise UserError(f"{flag} {spec}: only stochastic takes a temperature (stochastic:TAU)")
        return mode, None
    try:
        tau = float(raw) if raw else STOCHASTIC_TAU
    except ValueError:
        tau = float("nan")
    if not tau > 0 or tau == float("inf"):
        raise UserError(f"{flag} {spec}: the temperature TAU of stochastic:TAU must be a positive number, e.g. "
                        f"stochastic:{STOCHASTIC_TAU}")
    return mode, tau


# a selection parsed once and passed around as this object (the rules in kvdiag.core.selection, which needs torch)
@dataclass(frozen=True)
class Selection:
    """A selection, parsed once from its spec (:meth:`parse`) and passed around as this object.

    mode : ``per-head``, ``per-token`` or ``stochastic``; tau : the stochastic temperature (None otherwise);
    spec : the string it was parsed from, its name in configs and part fingerprints (``stochastic`` and
    ``stochastic:0.1`` select alike but stay distinct settings, as they always were).
    """

    mode: str
    tau: float | None = None
    spec: str = ""

    @classmethod
    def parse(cls, spec: Selection | str, flag: str = "--selection") -> Selection:
        """``per-head`` | ``per-token`` | ``stochastic`` | ``stochastic:TAU`` (TAU > 0); a Selection passes as is."""
        if isinstance(spec, Selection):
            return spec
        mode, tau = parse_selection(spec, flag)
        return cls(mode, tau, str(spec))

    def __str__(self) -> str:
        return self.spec

    @property
    def stochastic(self) -> bool:
        return self.mode == "stochastic"

    @property
    def per_token(self) -> bool:
        """One keep set for every layer and KV head (scored by one context per layer in replay)."""
        return self.mode == "per-token"

    @property
    def deterministic(self) -> Selection:
        """The deterministic selection beside this one: ``per-head`` for a stochastic one (decisions' references and
        comparison set), else itself."""
        return PER_HEAD if self.stochastic else self

    def check_rule(self, rule) -> None:
        """Stochastic selection draws from a rule's score: refuse a rule whose score is no graded preference (it
        declares ``continuous = False``, e.g. StreamingLLM's recency order)."""
        if self.stochastic and not getattr(rule, "continuous", True):
            raise UserError(f"--selection stochastic: {rule.name} has no continuous score to draw from (a fixed "
                            "order); use per-head or per-token for it")


PER_HEAD = Selection("per-head", None, "per-head")


STORE_WORDS = ("all", "kv", "none")


def parse_store(value: str) -> tuple[str, list[int] | None]:
    """``--store`` -> (mode, layers): ``all``/``kv``/``none`` with None, or ``("layers", sorted indices)``
    for ``0,15,29``. Only the syntax is checked here (before a model loads); :func:`store_spec`
    checks the indices against the model's layer count."""
    text = str(value).strip()
    if text in STORE_WORDS:
        return text, None
    if not text or not all(re.fullmatch(r"\d+", p.strip()) for p in text.split(",")):
        raise UserError(f"--store {value}: use all, kv, none, or layer indices comma-separated (e.g. 0,15,29)")
    return "layers", sorted(parse_list(text, "--store", int, low=0, example="0,15,29"))


def store_spec(value: str, num_layers: int) -> dict:
    """The manifest's ``store``: ``{"mode", "layers"}``; ``layers`` lists the layers whose files exist
    (all of them for ``all`` and ``kv``, none for ``none``)."""
    mode, layers = parse_store(value)
    if layers is not None and (bad := [l for l in layers if l >= num_layers]):
        raise UserError(f"--store {value}: layer {bad[0]} does not exist; the model has layers 0..{num_layers - 1}")
    if layers is None:
        layers = [] if mode == "none" else list(range(num_layers))
    return {"mode": mode, "layers": layers}


def check_context(length: int, context: int | None, flag: str, fix: str) -> None:
    """Refuse ``length`` tokens beyond the model's context (None: unknown, not checked)."""
    if context and length > context:
        raise UserError(f"{flag} {length}: beyond the model's context of {context}; {fix}")


def parse_lengths(values: list[str]) -> list[int]:
    """``bench scale --lengths``: positive token counts, each once, ascending."""
    return sorted(parse_list(values, "--lengths", int, low=1, example="1024,2048,4096,8192"))


LABEL_BACK = 64  # bench scale's label checkpoint sits this many positions before the end of each trace


def check_length_room(T: int, prompt_len: int, at_least: bool = False) -> None:
    """``bench scale --lengths T`` holds the prompt (``prompt_len`` tokens; ``at_least``: a lower bound, before the
    tokenizer counts them) and the label checkpoint ``LABEL_BACK`` positions before the end."""
    if T < prompt_len + LABEL_BACK + 1:
        raise UserError(f"--lengths {T}: the prompt has {'at least ' if at_least else ''}{prompt_len} token(s) and the "
                        f"label checkpoint sits {LABEL_BACK} positions before the end; give lengths >= "
                        f"{prompt_len + LABEL_BACK + 1}")


def parse_stores(values: list[str]) -> list[str]:
    """``bench scale --store`` modes, each once; ``all`` first (labels and figures read the first, fastest Trace)."""
    for v in values:  # whole values: a mode may itself be a comma-separated layer list (0,15,29)
        parse_store(v)
    if len(set(values)) < len(values):
        raise UserError(f"--store {','.join(values)}: a mode is given twice; give each once")
    if values and values[0] != "all" and "all" in values:
        values = ["all"] + [v for v in values if v != "all"]
    return values


DTYPE_NAMES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")  # kvdiag.model.load.DTYPES maps them
STORAGE_DTYPE_NAMES = ("float16", "bfloat16", "float32")  # kvdiag.trace.writer.STORAGE_DTYPES maps them


BACKENDS = ("auto", "torch", "triton")  # attention kernels (kvdiag.kernels)


def check_backend(backend: str, device: str | None = None) -> str:
    """``backend`` is one of BACKENDS, and ``triton`` runs on ``device`` (when given): a CUDA device, or the CPU
    under Triton's interpreter (``TRITON_INTERPRET=1``); ``kvdiag.kernels.resolve_backend`` checks it again on the
    loaded tensors."""
    import os

    if backend not in BACKENDS:
        raise UserError(f"--backend {backend}: use one of {', '.join(BACKENDS)}")
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError("--backend triton needs a CUDA device (--device cpu); use --backend torch or auto, or "
                        "--device cuda")
    return backend


def check_dtype(name: str, flag: str = "--dtype") -> str:
    if name not in DTYPE_NAMES:
        raise UserError(f"{flag} {name!r} is not supported: use one of float32, float16, bfloat16")
    return name


def check_device_name(device: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (whether CUDA is there is ``kvdiag.model.load.check_device``'s, after torch)."""
    if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise UserError(f"--device {device!r} is not supported: use cpu, cuda or cuda:N")
    return device


def parse_params(items: list[str] | None) -> dict[str, dict[str, str]]:
    """``["rkv.mix_lambda=0.2", ...]`` -> ``{"rkv": {"mix_lambda": "0.2"}}`` (values converted by get_scorer).
    A parameter given twice is refused (the second would silently win)."""
    out: dict[str, dict[str, str]] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        scorer, dot, param = key.partition(".")
        if not sep or not dot or not scorer or not param:
            raise UserError(f"--param {item!r}: write it as scorer.key=value, e.g. rkv.mix_lambda=0.1")
        params = out.setdefault(scorer.strip(), {})
        if param.strip() in params:
            raise UserError(f"--param {scorer.strip()}.{param.strip()} is given twice: pass it once")
        params[param.strip()] = value.strip()
    return out


def coerce(value: Any, hint: Any, what: str) -> Any:
    """Convert a ``--param`` string to the type ``hint`` (int, float, bool, str, tuples, ``X | None``)."""
    if not isinstance(value, str):
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value.lower() in ("none", "null") and type(None) in args:
            return None
        return coerce(value, next(a for a in args if a is not type(None)), what)
    try:
        if origin is tuple:
            return tuple(coerce(part.strip(), args[0], what) for part in value.split(","))
        if hint is bool:
            if value.lower() in ("true", "1", "yes", "on"):
                return True
            if value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(value)
        if hint in (int, float, str):
            return hint(value)
    except ValueError:
        raise UserError(f"--param {what}={value}: not a valid {getattr(hint, '__name__', hint)}") from None
    raise UserError(f"--param {what}: parameters of type {hint} cannot be set from the command line")
