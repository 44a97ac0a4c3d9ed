"""``FigureParams``: every threshold and definition of the Appendix D figures (ours unless noted; docs/figures.md)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.core.errors import UserError
from kvdiag.core.harm import HarmSpec
from kvdiag.core.schema import CHECKPOINT_INTERVAL, HARM, N_BOOT, NOISE_MULT, RHO, W_DELAY, W_OBS

PAYLOAD_KINDS = ("l2", "l1", "range", "var")  # features.value_payload kinds computable from the Trace alone
READ_REDUCES = ("mean", "max")
SCOPES = ("pooled", "macro")


@dataclass(frozen=True)
class FigureParams:
    """Settings of ``make_figures`` (written to figures.json). Defaults are ours; see docs/figures.md.

    Token-level features (per prompt, checkpoint ``t``, labeled candidate ``i``), averaged over layers and KV
    heads (the mean over layers of each layer's KV-head mean):

    - read pressure ``p_i``: the candidate-normalized window attention mass (docs/figures.md, "Token-level features")
      (``features.read_pressure`` over the window queries ``[t - w_obs, t)``), the candidate set being the
      entries of age ``t - i > w_delay`` as in the ``avokv_e`` scorer (``w_delay = 0``: the whole cache);
    - value payload ``b_i``: ``features.value_payload(v, payload)`` (``l2``: ``‖v_i‖₂``).
    """

    # --- features
    # observation window W_obs: p's window queries [t - w_obs, t); (b)'s first window [i+1, i+1+w_obs)
    w_obs: int = W_OBS
    w_delay: int = W_DELAY  # p is normalized over the entries of age > w_delay (AvoKV-E's C_t); 0: the whole cache
    payload: str = "l2"  # value payload kind: l2 (‖v‖₂), l1, range (VaSE), var
    # --- which labels are analysed (as rank-eval)
    harm: str = HARM  # high damage: kl_mean > threshold; quantile:Q of the analysed labels, or abs:TAU nats
    include_unresolved: bool = False  # keep labels with kl_mean <= noise_mult * noise_floor
    noise_mult: float = NOISE_MULT
    # --- (a) attention-only blind spot
    low_attention_quantile: float = 0.5
    large_payload_quantile: float = 0.75  # large payload: b > this quantile of b over the checkpoint's candidates
    # --- (b) delayed reads
    read_reduce: str = "mean"
    strong_read_mult: float = 4.0
    # a window-only rule compresses at t = prompt_len + k * interval (k >= 1), R-KV's schedule
    interval: int = CHECKPOINT_INTERVAL
    # --- statistics
    min_group: int = 5  # a test needs at least this many candidates in each group compared (else NaN + note)
    ci_level: float = 0.95  # odds-ratio CI level; component CIs come from rank-eval's bootstrap at this level
    # --- component figure (rank-eval settings, used when the metrics are computed here)
    rho: float = RHO  # eviction fraction of the false-safe rate
    n_boot: int = N_BOOT  # cluster-bootstrap resamples over prompts
    seed: int = 0  # bootstrap seed; also seeds the jitter of (b)'s strip plot
    scope: str = "pooled"  # pooled or macro (mean over checkpoints) metrics
    min_age: int | None = None  # evaluate only candidates of age >= min_age (rank-eval's --min-age)
    max_age: int | None = None  # ... and <= max_age
    eligible: str | None = None  # ... and only those this scorer could evict, e.g. avokv_e (rank-eval's --eligible)
    # --- plotting and memory
    log_floor: float = 1e-12  # values are drawn at max(x, log_floor) on log axes (the CSVs hold the raw values)
    chunk_elements: int = 2**24  # attention probabilities [H, queries, keys] per chunk (64 MiB in fp32)
    strength_elements: int = 2**26  # read-strength accumulator [T, candidates] per column block (256 MiB in fp32)

    @property
    def harm_spec(self) -> HarmSpec:
        """Which labels are analysed and which are high-damage (``kvdiag.core.harm``, as rank-eval)."""
        return HarmSpec(self.harm, self.noise_mult, self.include_unresolved)

    @property
    def token_features(self) -> TokenFeatureParams:  # noqa: F821
        """The definition of ``p`` and ``b`` (what a scores' features file must have been made with)."""
        from kvdiag.scorers.token_features import TokenFeatureParams  # torch: not at import (the CLI starts fast)

        return TokenFeatureParams(self.w_obs, self.w_delay, self.payload)

    def __post_init__(self):
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise UserError(f"figure parameter {what}")

        need(self.w_obs >= 1, f"w_obs={self.w_obs} must be >= 1 (e.g. 32)")
        need(self.w_delay >= 0, f"w_delay={self.w_delay} must be >= 0 (0: normalize over the whole cache)")
        need(self.payload in PAYLOAD_KINDS, f"payload={self.payload!r} must be one of {', '.join(PAYLOAD_KINDS)}")
        self.harm_spec  # noqa: B018  (checks harm and noise_mult)
        for name in ("low_attention_quantile", "large_payload_quantile"):
            need(0 < getattr(self, name) < 1, f"{name}={getattr(self, name)} must lie in (0, 1)")
        need(self.read_reduce in READ_REDUCES, f"read_reduce={self.read_reduce!r} must be mean or max")
        need(self.strong_read_mult > 0, f"strong_read_mult={self.strong_read_mult} must be > 0 (e.g. 4)")
        need(self.interval >= 1, f"interval={self.interval} must be >= 1 (e.g. 128)")
        need(self.min_group >= 1, f"min_group={self.min_group} must be >= 1")
        need(0 < self.ci_level < 1, f"ci_level={self.ci_level} must lie in (0, 1)")
        need(0 < self.rho < 1, f"rho={self.rho} must lie in (0, 1)")
        need(self.n_boot >= 0, f"n_boot={self.n_boot} must be >= 0")
        need(self.scope in SCOPES, f"scope={self.scope!r} must be pooled or macro")
        for name in ("min_age", "max_age"):
            need(getattr(self, name) is None or getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        need(self.log_floor > 0, f"log_floor={self.log_floor} must be > 0")
        need(self.chunk_elements >= 1 and self.strength_elements >= 1, "chunk_elements and strength_elements must be "
                                                                       ">= 1")
