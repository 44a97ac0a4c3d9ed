"""How labels are made (:class:`LabelConfig`, the methods' settings), checked without torch: the CLI builds the
config, refusing bad input in one line, before it imports the labeling engine."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import REST, check_backend, parse_checkpoints, parse_horizon
from kvdiag.core.schema import CHECKPOINTS, CHUNK, GRANULARITIES, HORIZON, N_BOOT, W_OBS, default_checkpoints

HYBRID = "hybrid"


@dataclass(frozen=True)
class FisherParams:
    """Settings of ``fisher``; recorded in the labels metadata."""

    # K: sampled continuations y ~ P_full per horizon step (one batched backward pass each). 8 is the recommended
    # cost/agreement point on SmolLM2 MATH-500 (docs/labels.md): 24.6x cheaper per entry than exact, Spearman 0.906;
    # 16: 15.4x, Spearman 0.938
    samples: int = 8

    def validate(self) -> None:
        if self.samples < 1:
            raise UserError(f"--fisher-samples {self.samples}: must be a positive number of Fisher samples, e.g. 8")


# the approximate methods' settings (``kvdiag.label.fast.APPROXIMATE`` pairs each with its labeler)
APPROXIMATE_PARAMS = {"fisher": FisherParams}
FAST = "fisher"  # what --method fast picks (docs/labels.md: validated against exact on MATH-500)
METHODS = ("exact", "fast", *APPROXIMATE_PARAMS)


def resolve_method(name: str) -> str:
    """``fast`` -> the recommended approximate method; an unknown name -> ``UserError``."""
    if name not in METHODS:
        raise UserError(f"--method {name}: use one of {', '.join(METHODS)}")
    return FAST if name == "fast" else name


def method_params(name: str, **given) -> dict:
    """The settings of method ``name`` (defaults filled in), validated; exact has none."""
    if name == "exact":
        return {}
    params = APPROXIMATE_PARAMS[name](**given)
    params.validate()
    return asdict(params)


@dataclass(frozen=True)
class HybridParams:
    """Settings of ``hybrid``; recorded in the labels metadata.

    exact_top : M, the candidates per checkpoint with the largest Fisher labels that are labeled exactly; or
    exact_frac : that number as a share of the checkpoint's candidates (``ceil(f * C)``); one of the two.
    audit : N, the seeded uniform sample of the other candidates labeled exactly (0: no miss-rate estimate); with
        ``miss_target``, N per checkpoint on average: N x checkpoints in all, allotted in proportion to their other
        candidates (``kvdiag.label.adaptive``).
    samples : K of the Fisher label.
    miss_target : R (``--miss-rate R``): label exactly down the fast ranking in rounds (from ``exact_frac``) until
        the audit's upper confidence bound on the top-decile miss rate is below R (``kvdiag.label.adaptive``).
    """

    exact_top: int | None = None
    exact_frac: float | None = None
    audit: int = 32
    samples: int = 8
    miss_target: float | None = None

    def validate(self) -> None:
        if (self.exact_top is None) == (self.exact_frac is None):
            raise UserError("--method hybrid needs one of --exact-top M (entries per checkpoint) or --exact-frac F "
                            "(a share of them), e.g. --exact-frac 0.1")
        if self.exact_top is not None and self.exact_top < 0:
            raise UserError(f"--exact-top {self.exact_top}: must be >= 0 entries per checkpoint")
        if self.exact_frac is not None and not 0 <= self.exact_frac <= 1:
            raise UserError(f"--exact-frac {self.exact_frac}: a share of the candidates in [0, 1], e.g. 0.1")
        if self.audit < 0:
            raise UserError(f"--audit {self.audit}: must be >= 0 entries per checkpoint (0: no miss-rate estimate)")
        FisherParams(self.samples).validate()
        if self.miss_target is not None:
            if not 0 < self.miss_target < 1:
                raise UserError(f"--miss-rate {self.miss_target}: the top-decile miss rate to bound, a share in "
                                "(0, 1), e.g. 0.05")
            if self.exact_frac is None:
                raise UserError("--miss-rate grows each checkpoint's exact top by shares of its candidates: give the "
                                "first round as --exact-frac F (e.g. 0.1), not --exact-top")
            if self.audit < 1:
                raise UserError(f"--audit {self.audit}: --miss-rate bounds the miss rate from an audit; pass --audit "
                                "N > 0 (per checkpoint on average)")

    def check_audit(self, candidates: list[int]) -> list[int]:
        """With ``miss_target``: the audit of each checkpoint of ``candidates`` rows (``adaptive.allot``); refuses an
        audit too small to bound the miss rate below the target (``adaptive.min_audit``)."""
        from kvdiag.label.adaptive import allot, min_audit

        rests = [n - self.top_count(n) for n in candidates]
        need = min_audit(self.miss_target, sum(rests), sum(candidates), self.exact_frac)
        if need > sum(rests):
            raise UserError(f"--miss-rate {self.miss_target}: bounding it needs an audit of {need} entries, more than "
                            f"the {sum(rests)} candidates outside the exact top of the {len(candidates)} checkpoints; "
                            "label more checkpoints (or --candidates all) or ask a larger --miss-rate")
        if self.audit * len(candidates) < need:
            raise UserError(f"--audit {self.audit}: bounding a miss rate of {self.miss_target} needs {need} audited "
                            f"entries in all (95%, Clopper-Pearson over the rounds' looks), --audit "
                            f">= {math.ceil(need / len(candidates))} per checkpoint over these {len(candidates)}")
        return allot(self.audit * len(candidates), rests)

    def top_count(self, candidates: int) -> int:
        """M at a checkpoint of ``candidates`` rows (refusing more than there are)."""
        m = self.exact_top if self.exact_top is not None else math.ceil(self.exact_frac * candidates)
        if m > candidates:
            raise UserError(f"--exact-top {m} exceeds the {candidates} candidates of a checkpoint: use at most that, "
                            "or --exact-frac")
        return m


    def check_fits(self, candidates: int, where: str = "at the smallest checkpoint") -> None:
        """Refuse settings whose exact top set and audit do not fit ``candidates`` rows."""
        top = self.top_count(candidates)
        if self.audit > candidates - top:
            raise UserError(f"--audit {self.audit} exceeds the {candidates - top} candidates left outside the exact "
                            f"top {top} {where}: use --audit <= {candidates - top}")


def check_horizon_fits(horizon: int | str, lengths: dict[str, int]) -> None:
    """Refuse a fixed horizon that reaches past the end of a prompt (``lengths``: prompt id -> T; a label needs a
    checkpoint t >= 1 with t + N <= T); ``rest`` runs each label to its prompt's end and always fits."""
    for pid, T in lengths.items():
        if horizon != REST and horizon >= T:
            raise UserError(f"--horizon {horizon} reaches beyond the end of prompt {pid} (length {T}); use a shorter "
                            "horizon, or --horizon rest (each label to the end of its prompt)")


@dataclass
class LabelConfig:
    """How labels are made; written into every labels file."""

    checkpoints: str = CHECKPOINTS  # "every:K" (generated tokens, R-KV's schedule) or "t1,t2,..." absolute positions
    horizon: int | str = HORIZON  # N teacher-forced steps, or "rest": to the end of each prompt (rows record theirs)
    candidates: str = "64"  # "N" (seeded sample) or "all"
    # positions labeled besides the sample, per prompt, at every checkpoint they precede (e.g. the tokens a suite's
    # answer needs, kvdiag.tasks.needed); None: the sample only
    include: dict[str, list[int]] | None = None
    granularity: str = "token"
    layers: list[int] | None = None  # layer/head granularity: which layers (None = all)
    w_obs: int = W_OBS  # checkpoints start once W_obs tokens have been generated (docs/oracle.md)
    batch_size: int = 64
    seed: int = 0
    backend: str = "auto"
    chunk: int = CHUNK  # horizon steps per forward (kvdiag.label.engine): bounds memory at long horizons
    # exact (the oracle engine), an approximate method (kvdiag.label.fast; fast = the recommended one) or hybrid
    # (kvdiag.label.hybrid: fast for every candidate, exact for the top M and an audit sample)
    method: str = "exact"
    params: dict = field(default_factory=dict)  # the method's settings (defaults filled in)
    miss_rate: bool = True  # hybrid: estimate the miss rate from the audit (written into the metadata)
    sampling: str = field(default="", init=False)

    def __post_init__(self):
        self.horizon = parse_horizon(self.horizon)
        self.validate()
        if self.method == HYBRID:
            hybrid = HybridParams(**self.params)
            hybrid.validate()
            if hybrid.audit == 0 and self.miss_rate:
                raise UserError("--audit 0 leaves no sample to estimate the miss rate from: pass --audit N > 0, or "
                                "--no-miss-rate")
            if hybrid.miss_target is not None and self.granularity != "token":
                raise UserError(f"--miss-rate with --granularity {self.granularity}: the bound is over token entries; "
                                "use --granularity token")
            self.params = asdict(hybrid)
        else:
            self.method = resolve_method(self.method)
            self.params = method_params(self.method, **self.params)
        self.sampling = ("every cached entry [0, t)" if self.candidates == "all"
                         else f"uniform without replacement over [0, t), seed {self.seed} + checkpoint")
        if self.include:
            self.sampling += "; and the include positions before t (config include)"

    @property
    def rest(self) -> bool:
        """Whether each label runs to the end of its prompt (``--horizon rest``)."""
        return self.horizon == REST

    def validate(self) -> None:
        """Every setting on its own (bad input: ``UserError``), before a model or a file is touched; how the
        settings fit a Trace is checked by ``work_items``."""
        parse_checkpoints(self.checkpoints)
        parse_horizon(self.horizon)
        if self.chunk < 1:
            raise UserError(f"--chunk {self.chunk}: must be a positive number of horizon steps per forward, e.g. 16")
        count = self.candidates.isascii() and self.candidates.isdigit() and int(self.candidates) > 0
        if self.candidates != "all" and not count:
            raise UserError(f"--candidates {self.candidates}: use a positive number (a seeded sample per checkpoint) "
                            "or all")
        if self.granularity not in GRANULARITIES:
            raise UserError(f"--granularity {self.granularity}: use one of {', '.join(GRANULARITIES)}")
        if self.layers is not None:
            if self.granularity == "token":
                raise UserError("--layers applies to --granularity layer or head only; drop it or choose one of those")
            if not self.layers or min(self.layers) < 0:
                raise UserError(f"--layers {self.layers}: give layer indices >= 0, e.g. 0,5,11")
        if self.w_obs < 0:
            raise UserError(f"--w-obs {self.w_obs}: must be >= 0 generated tokens")
        if self.batch_size < 1:
            raise UserError(f"--batch-size {self.batch_size}: must be a positive number of candidate rows, e.g. 64")
        check_backend(self.backend)
        if self.method != HYBRID and resolve_method(self.method) == "exact" and self.params:
            raise UserError(f"--method exact has no settings ({', '.join(self.params)}); drop them or choose an "
                            "approximate --method")


def work_items(trace, cfg: LabelConfig, prompt_ids: list[str] | None = None) -> list[tuple[str, int]]:
    """Every (prompt_id, checkpoint) to label, validated against ``trace`` (a ``kvdiag.trace.Trace``, or before torch
    its ``TraceFiles``: the manifest is all this reads)."""
    if cfg.layers is not None and max(cfg.layers) >= trace.num_layers:
        raise UserError(f"--layers {max(cfg.layers)}: the Trace's model has layers 0..{trace.num_layers - 1}")
    items, spec = [], parse_checkpoints(cfg.checkpoints)  # every:K, or positions taken as given (checked here)
    least = 1 if cfg.rest else cfg.horizon  # rest: each checkpoint's label runs to the end, at least one step
    unknown = sorted(set(cfg.include or {}) - set(trace.prompt_ids))
    if unknown:
        raise UserError(f"--include: prompt {unknown[0]} is not in the Trace (it has {', '.join(trace.prompt_ids[:3])}"
                        f"{', ...' if len(trace.prompt_ids) > 3 else ''}); list only its prompts")
    for pid in prompt_ids or trace.prompt_ids:
        P, T = trace.prompt_len(pid), trace.length(pid)
        beyond = [p for p in (cfg.include or {}).get(pid, []) if p >= T]
        if beyond:
            raise UserError(f"--include: position {beyond[0]} of prompt {pid} is past its end (length {T}); list "
                            "positions in [0, length)")
        check_horizon_fits(cfg.horizon, {pid: T})
        for t in spec if isinstance(spec, list) else default_checkpoints(P, T, spec, least, cfg.w_obs):
            if not 1 <= t <= T - least:
                raise UserError(f"--checkpoints: {t} is outside [1, {T - least}] for prompt {pid} (length {T}, "
                                f"horizon {cfg.horizon})")
            items.append((pid, t))
    if cfg.method == HYBRID and items:  # the exact set and the audit must fit every checkpoint's candidates
        hybrid = HybridParams(**cfg.params)
        # the sample's size (the include positions only add rows): light, before torch
        sizes = [t if cfg.candidates == "all" else min(t, int(cfg.candidates)) for _, t in items]
        if hybrid.miss_target is None:
            hybrid.check_fits(min(sizes))
        else:
            hybrid.check_audit(sizes)
    if not items:
        raise UserError(f"--checkpoints {cfg.checkpoints}: no checkpoint fits the Trace (needs t - prompt_len >= "
                        f"W_obs={cfg.w_obs} "
                        "and t + horizon <= length); use a smaller interval, --w-obs, --horizon (or rest), or explicit "
                        "positions")
    return items


def candidate_positions(pid: str, t: int, cfg: LabelConfig) -> list[int]:
    """Candidate positions of prompt ``pid`` at checkpoint ``t`` (sorted): all of [0, t) or a seeded sample of N,
    with ``cfg.include``'s positions before ``t``. Torch's generator draws the sample, so this imports torch."""
    import torch

    if cfg.candidates == "all" or int(cfg.candidates) >= t:
        sample = range(t)
    else:
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + t)
        sample = torch.randperm(t, generator=gen)[: int(cfg.candidates)].tolist()
    return sorted({*sample, *(p for p in (cfg.include or {}).get(pid, []) if p < t)})


@dataclass
class ValidateConfig:
    """Settings of ``validate-labels``; written into its outputs."""

    harmful_quantile: float = 0.9  # exact-harmful: exact kl_mean >= this quantile of its checkpoint's entries
    top_k: int = 8
    bins: int = 4  # quantile bins per disagreement feature
    n_boot: int = N_BOOT
    level: float = 0.95
    seed: int = 0
    attention: str = "attention"  # scores column binned as attention
    payload: str = "value_norm"  # scores column binned as payload

    def validate(self) -> None:
        if not 0 < self.harmful_quantile < 1:
            raise UserError(f"--harmful-quantile {self.harmful_quantile}: must lie in (0, 1), e.g. 0.9 (the top "
                            "decile is harmful)")
        if self.top_k < 1:
            raise UserError(f"--top-k {self.top_k}: must be a positive number of entries, e.g. 8")
        if self.bins < 1:
            raise UserError(f"--bins {self.bins}: must be a positive number of quantile bins, e.g. 4")
        if self.n_boot < 1:
            raise UserError(f"--bootstrap {self.n_boot}: must be a positive number of resamples, e.g. {N_BOOT}")
        if not 0 < self.level < 1:
            raise UserError(f"--level {self.level}: must lie in (0, 1), e.g. 0.95")
