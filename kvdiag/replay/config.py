"""What decides a replay's results (:class:`ReplaySettings`) and the checks that need no model. Importable without
torch: the CLI runs :func:`check_options` and :func:`check_outcomes` before the stage loads (:func:`check_settings`
adds the scorer classes' checks, which need torch)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import Selection, parse_horizon
from kvdiag.core.schema import CHECKPOINT_INTERVAL, HORIZON
from kvdiag.replay.sampling import Sampling
from kvdiag.scorers.names import ORACLE, ORACLE_FUTURE, REPLAY_ONLY
from kvdiag.tasks.prompts import DEFAULT_INSTRUCTION

if TYPE_CHECKING:
    import polars as pl


@dataclass
class ReplaySettings:
    """Everything that decides a replay's results (written into config.json and every part).

    scorers, budgets : the sweep (scorer names; entries kept per layer and KV head).
    interval : generated tokens between compressions (R-KV 128).
    w_obs : observation window given to every scorer's ``window``/``w_obs`` field (None: each scorer's own).
    selection : ``per-head``, ``per-token`` or ``stochastic[:TAU]`` (a ``kvdiag.core.selection.Selection``; a spec
    string
        is parsed here, once).
    max_new_tokens : free-running generation cap (a stop there is a max-length hit).
    full_kv : also decode with the full cache (the FullKV reference row; free-running only).
    kl : free-running: also measure KL against a full-cache forward of each generation.
    chat, instruction : how prompts are encoded (``kvdiag.tasks.prompts.encode_prompt``).
    params : scorer -> {field: value} overrides.
    backend : compaction kernel backend.
    samples, temperature, top_p : free-running: generations per prompt and their sampling (temperature None:
        greedy, one sample); every policy's sample ``s`` shares FullKV's draws (``kvdiag.replay.sampling``).
    batch_size : free-running generations decoded together (rows of one prompt length and budget).
    horizon : teacher-forced: steps of the exact labels (each compression's joint damage; the oracle policy); with
        ``interval``, the least window of ``oracle_future`` (:func:`future_window`).
    joint : teacher-forced: label each compression's whole evicted set (``joint_kl``).
    seed : of stochastic selection and of sampling.
    """

    scorers: list[str]
    budgets: list[int]
    interval: int = CHECKPOINT_INTERVAL
    w_obs: int | None = None
    selection: Selection | str = "per-head"
    max_new_tokens: int = 512
    full_kv: bool = True
    kl: bool = True
    chat: bool = True
    instruction: str | None = DEFAULT_INSTRUCTION
    params: dict[str, dict] = field(default_factory=dict)
    backend: str = "auto"
    seed: int = 0
    samples: int = 1
    temperature: float | None = None
    top_p: float = 1.0
    batch_size: int = 16
    horizon: int = HORIZON
    joint: bool = True

    def __post_init__(self):
        self.selection = Selection.parse(self.selection)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.seed)

    def to_json(self) -> dict:
        """The settings as written into config.json and the parts' fingerprints (the selection by its spec)."""
        return {**asdict(self), "selection": str(self.selection)}


def check_samples(samples: int, sampling: Sampling) -> None:
    """Several generations per prompt need sampling (bad input: UserError)."""
    if samples > 1 and sampling.greedy:
        raise UserError(f"--samples {samples} needs --temperature (greedy decoding writes one generation per "
                        "prompt), e.g. --temperature 0.6")


def check_params(params: dict[str, dict], scorers: list[str]) -> None:
    """Every ``--param`` names a scorer of the sweep (bad input: UserError)."""
    stray = [name for name in params if name not in scorers]
    if stray:
        raise UserError(f"--param {stray[0]}.…: scorer {stray[0]} is not in --scorers; add it or drop the parameter")


def check_free_running(settings: ReplaySettings) -> None:
    """The oracle policies read a Trace's future tokens: refused without one."""
    for name in REPLAY_ONLY:
        if name in settings.scorers:
            raise UserError(f"--scorers {name} reads the Trace's future tokens: it runs with --teacher-forced only")


def check_teacher_forced(settings: ReplaySettings) -> None:
    """The Trace fixes the tokens (no sampling); the oracle evicts token sets (``--selection per-token``)."""
    if settings.samples > 1 or not settings.sampling.greedy:
        raise UserError("--samples/--temperature/--top-p apply to free-running replay; drop them with "
                        "--teacher-forced (the Trace's tokens are replayed)")
    if ORACLE in settings.scorers and not settings.selection.per_token:
        raise UserError(f"--scorers {ORACLE} evicts token sets (one label per position): add --selection per-token")


# each replay mode's own checks, by the mode's name (FreeRunning.name, TeacherForced.name)
MODE_CHECKS = {"free": check_free_running, "teacher_forced": check_teacher_forced}


def check_options(settings: ReplaySettings, mode: str) -> None:
    """The checks that need no model and no scorer class (bad input: UserError, before torch is imported): sizes,
    sampling, parameters and the replay mode's own (``mode``: ``free`` or ``teacher_forced``)."""
    if not settings.scorers:
        raise UserError("--scorers is empty: name at least one scorer, e.g. rkv")
    if not settings.budgets or min(settings.budgets) < 1:
        raise UserError(f"--budget {settings.budgets}: give positive budgets (cache entries), e.g. 128,256")
    if settings.interval < 1:
        raise UserError(f"--interval {settings.interval}: must be a positive number of tokens between compressions")
    if settings.w_obs is not None and settings.w_obs < 1:
        raise UserError(f"--w-obs {settings.w_obs}: must be a positive number of queries")
    if settings.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {settings.max_new_tokens}: must be a positive number of tokens")
    if settings.batch_size < 1:
        raise UserError(f"--batch-size {settings.batch_size}: must be a positive number of generations")
    if settings.samples < 1:
        raise UserError(f"--samples {settings.samples}: must be a positive number of generations per prompt")
    check_samples(settings.samples, settings.sampling)  # the sampling checks its temperature and top-p
    MODE_CHECKS[mode](settings)
    parse_horizon(settings.horizon, rest=False)  # a ReplaySettings built in Python: the CLI's option parsed it
    check_params(settings.params, settings.scorers)
    if ORACLE in settings.scorers and ORACLE in settings.params:
        raise UserError(f"--param {ORACLE}.…: the oracle's only setting is its label horizon; use --horizon")
    if ORACLE_FUTURE in settings.scorers:
        future_window(settings)


def future_window(settings: ReplaySettings) -> int | str:
    """``oracle_future``'s window of future queries at each compression: ``--param oracle_future.window=N|rest``
    (default: ``interval + horizon``, the next compression plus the label horizon); at least that many, so that what
    the policy keeps at ``t`` is judged by every query up to the next compression and the label of that one
    (bad input: UserError). ``rest``: every query to the end of the Trace (Belady)."""
    given = dict(settings.params.get(ORACLE_FUTURE) or {})
    window = given.pop("window", settings.interval + settings.horizon)
    if given:
        raise UserError(f"--param {ORACLE_FUTURE}.{next(iter(given))}: {ORACLE_FUTURE}'s only setting is its window "
                        f"(--param {ORACLE_FUTURE}.window=N|rest)")
    least = settings.interval + settings.horizon
    return parse_horizon(window, f"--param {ORACLE_FUTURE}.window", what="future queries", least=least,
                         short=f"the window must reach past the next compression plus the label horizon (--interval "
                               f"{settings.interval} + --horizon {settings.horizon} = {least} queries); use {least} or "
                               "more, or rest")


def check_budgets(settings: ReplaySettings, windows: list[int | None] | None) -> None:
    """Each budget, before torch, against the model's sliding ``windows`` (None: told when it loads;
    :func:`kvdiag.model.families.check_windows`) and against the entries each built-in rule protects in a live cache of
    ``budget + interval`` entries (:func:`kvdiag.scorers.fields.live_protected`): the checks ``build_policies`` runs
    again on the loaded model and the scorer classes, with the same definitions (bad input: UserError)."""
    from kvdiag.model.families import check_windows
    from kvdiag.scorers.fields import check_budget_fits, live_protected

    for budget in settings.budgets:
        if windows is not None:
            check_windows(windows, settings.selection, budget)
        n = budget + settings.interval
        for name in settings.scorers:
            protected = None if name in REPLAY_ONLY else live_protected(name, settings.params.get(name),
                                                                        settings.w_obs, n)
            if protected is not None:
                check_budget_fits(name, protected, budget, n)


def check_settings(settings: ReplaySettings, mode) -> None:
    """Every check that needs no model (bad input: UserError): :func:`check_options`, then the scorers that run on a
    live cache (their classes: torch). ``mode``: a :class:`~kvdiag.replay.free_running.FreeRunning` or
    :class:`~kvdiag.replay.teacher_forced.TeacherForced`, the class or an instance."""
    from kvdiag.generate.live import check_live_scorer, make_scorer

    check_options(settings, mode.name)
    for name in settings.scorers:
        if name in REPLAY_ONLY:
            continue
        scorer = make_scorer(name, settings.params.get(name), settings.w_obs)
        check_live_scorer(scorer)
        settings.selection.check_rule(scorer)


def replayed_prompts(trace, limit: int | None) -> list[str]:
    """The prompt ids a teacher-forced replay of ``trace`` (a Trace or its TraceFiles) replays: the first ``limit``."""
    return trace.prompt_ids[:limit] if limit else trace.prompt_ids


def read_outcomes(outcomes: str | os.PathLike) -> pl.DataFrame:
    """The generations of the free-running replay directory ``outcomes`` (``--outcomes``), through their contract
    (``kvdiag.core.contracts.read_generations``); a teacher-forced replay is refused (it has no outcomes of its own)."""
    from kvdiag.core.contracts import read_generations  # polars: only now

    free, meta = read_generations(Path(outcomes) / "generations.parquet", "--outcomes")
    if meta["mode"] != "free":
        raise UserError(f"--outcomes {outcomes} is a {meta['mode']} replay: pass a free-running replay directory "
                        "(kvdiag replay without --teacher-forced) of the same prompts")
    return free


def check_outcomes(outcomes: str | os.PathLike, prompt_ids: list[str] | None) -> None:
    """``--outcomes``: with --teacher-forced (``prompt_ids``: the prompts it replays; None without it), a free-running
    replay directory (:func:`read_outcomes`) holding a generation of every replayed prompt (else its fidelity rows
    would be empty)."""
    if prompt_ids is None or not (Path(outcomes) / "generations.parquet").is_file():
        raise UserError(f"--outcomes {outcomes}: give, with --teacher-forced, a free-running replay directory (its "
                        "generations.parquet) of the same prompts")
    free = read_outcomes(outcomes)
    missing = sorted(set(prompt_ids) - set(free["prompt_id"].unique().to_list()))
    if missing:
        raise UserError(f"--outcomes {outcomes} holds no generation of prompt {missing[0]!r} ({len(missing)} of the "
                        f"{len(prompt_ids)} replayed prompts are missing): pass a replay of the Trace's prompts")
