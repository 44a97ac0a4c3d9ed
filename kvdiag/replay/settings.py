"""What decides a replay's results (:class:`ReplaySettings`) and the checks that need no model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvdiag.errors import UserError
from kvdiag.generate.live import check_live_scorer, make_scorer
from kvdiag.parsing import Selection
from kvdiag.prompts import DEFAULT_INSTRUCTION
from kvdiag.replay.oracle import ORACLE
from kvdiag.replay.sampling import Sampling
from kvdiag.schema import CHECKPOINT_INTERVAL, HORIZON


@dataclass
class ReplaySettings:
    """Everything that decides a replay's results (written into config.json and every part).

    scorers, budgets : the sweep (scorer names; entries kept per layer and KV head).
    interval : generated tokens between compressions (R-KV 128).
    w_obs : observation window given to every scorer's ``window``/``w_obs`` field (None: each scorer's own).
    selection : ``per-head``, ``per-token`` or ``stochastic[:TAU]`` (a ``kvdiag.selection.Selection``; a spec string
        is parsed here, once).
    max_new_tokens : free-running generation cap (a stop there is a max-length hit).
    full_kv : also decode with the full cache (the FullKV reference row; free-running only).
    kl : free-running: also measure KL against a full-cache forward of each generation.
    chat, instruction : how prompts are encoded (``kvdiag.prompts.encode_prompt``).
    params : scorer -> {field: value} overrides.
    backend : compaction kernel backend.
    samples, temperature, top_p : free-running: generations per prompt and their sampling (temperature None:
        greedy, one sample); every policy's sample ``s`` shares FullKV's draws (``kvdiag.replay.sampling``).
    batch_size : free-running generations decoded together (rows of one prompt length and budget).
    horizon : teacher-forced: steps of the exact labels (each compression's joint damage; the oracle policy).
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


def check_settings(settings: ReplaySettings, mode) -> None:
    """The checks that need no model (bad input: UserError): sizes, sampling, scorers that run on a live cache, and
    the replay mode's own (``mode.check``: a :class:`~kvdiag.replay.free_running.FreeRunning` or
    :class:`~kvdiag.replay.teacher_forced.TeacherForced`, the class or an instance)."""
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
    mode.check(settings)
    if settings.horizon < 1:
        raise UserError(f"--horizon {settings.horizon}: must be a positive number of steps")
    check_params(settings.params, settings.scorers)
    if ORACLE in settings.scorers and ORACLE in settings.params:
        raise UserError(f"--param {ORACLE}.…: the oracle's only setting is its label horizon; use --horizon")
    for name in settings.scorers:
        if name == ORACLE:
            continue
        scorer = make_scorer(name, settings.params.get(name), settings.w_obs)
        check_live_scorer(scorer)
        settings.selection.check_rule(scorer)
