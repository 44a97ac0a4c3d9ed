"""Which labels are analysed and which are harmful: one :class:`HarmSpec` for rank-eval, fit, figures, viewer,
report and decisions.

A label is *unresolved* when ``kl_mean <= noise_mult * noise_floor`` (its damage is not above the checkpoint's
numerical noise). The *analysed* labels are the resolved ones (every one with ``include_unresolved``); a label with
no ``kl_mean`` is refused, and so is one with no noise floor unless ``include_unresolved`` makes the floor
irrelevant. *Harmful* = ``kl_mean`` strictly above the threshold: the Q-quantile of the analysed labels
(``quantile:Q``) or a fixed TAU nats (``abs:TAU``). Defaults: :mod:`kvdiag.core.schema`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvdiag.core.errors import UserError
from kvdiag.core.schema import HARM, NOISE_MULT

if TYPE_CHECKING:  # numpy and polars load where labels are read: the CLI checks --harm at start-up (HarmSpec)
    import numpy as np
    import polars as pl


def parse_harm(spec: str) -> tuple[str, float]:
    """``quantile:Q`` (0 < Q < 1) or ``abs:TAU`` (nats) -> (kind, value)."""
    kind, _, raw = str(spec).partition(":")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if (kind == "quantile" and 0 < value < 1) or (kind == "abs" and math.isfinite(value) and value >= 0):
        return kind, value
    raise UserError(f"--harm {spec!r} is not quantile:Q with 0 < Q < 1 or abs:TAU with TAU >= 0 nats: e.g. {HARM}")


def unresolved(noise_mult: float, kl: str = "kl_mean", floor: str = "noise_floor") -> pl.Expr:
    """A label at or below its checkpoint's noise floor: ``kl <= noise_mult * floor`` (null where either is)."""
    import polars as pl

    return pl.col(kl) <= noise_mult * pl.col(floor)


def harm_threshold(kl: np.ndarray, spec: str) -> float:
    """The KL above which a label is harmful: the Q-quantile (linear interpolation) of ``kl [N]``, or TAU."""
    import numpy as np

    kind, value = parse_harm(spec)
    return float(np.quantile(kl, value)) if kind == "quantile" else value


@dataclass(frozen=True)
class HarmSpec:
    """The harm settings of one analysis.

    harm : ``quantile:Q`` of the analysed labels, or ``abs:TAU`` nats.
    noise_mult : a label is unresolved when ``kl_mean <= noise_mult * noise_floor``.
    include_unresolved : analyse unresolved labels too (their noise floor then need not exist).
    """

    harm: str = HARM
    noise_mult: float = NOISE_MULT
    include_unresolved: bool = False

    def __post_init__(self):
        parse_harm(self.harm)
        if not 0 <= self.noise_mult < float("inf"):
            raise UserError(f"--noise-mult {self.noise_mult}: must be >= 0 and finite (a multiple of the noise floor)")

    @classmethod
    def from_config(cls, config: Mapping | None) -> HarmSpec:
        """The spec a stage's settings record (``harm``, ``noise_mult``, ``include_unresolved``; defaults for the
        missing ones)."""
        config = config or {}
        return cls(str(config.get("harm", HARM)), float(config.get("noise_mult", NOISE_MULT)),
                   bool(config.get("include_unresolved", False)))

    @classmethod
    def from_configs(cls, *configs: tuple[str, Mapping | None]) -> tuple[HarmSpec, str]:
        """The spec of the first non-empty ``(source, settings)`` pair, and its source; the defaults otherwise (the
        report and the viewer take rank-eval's settings, else the figures')."""
        for source, config in configs:
            if config:
                return cls.from_config(config), source
        return cls(), "the default settings"

    def to_config(self) -> dict:
        return {"harm": self.harm, "noise_mult": self.noise_mult, "include_unresolved": self.include_unresolved}

    def unresolved(self, kl: str = "kl_mean", floor: str = "noise_floor") -> pl.Expr:
        """Per row: at or below the noise floor (false where the floor is missing: only with include_unresolved)."""
        return unresolved(self.noise_mult, kl, floor).fill_null(False)

    def check(self, labels: pl.DataFrame, kl: str = "kl_mean", floor: str = "noise_floor",
              what: str = "labels") -> None:
        """Refuse labels this spec cannot analyse: a missing or NaN ``kl``, or a missing noise floor (unless
        ``include_unresolved``)."""
        import polars as pl

        bad = labels.select((pl.col(kl).is_null() | pl.col(kl).is_nan()).sum()).item()
        if bad:
            raise UserError(f"{what} kl_mean is missing or NaN in {bad} of {labels.height} rows: relabel them")
        if not self.include_unresolved:
            no_floor = labels.select((pl.col(floor).is_null() | pl.col(floor).is_nan()).sum()).item()
            if no_floor:
                raise UserError(f"{what} noise_floor is missing in {no_floor} rows: relabel, or pass "
                                "--include-unresolved")

    def analysed(self, labels: pl.DataFrame, kl: str = "kl_mean", floor: str = "noise_floor", what: str = "labels",
                 require: bool = True) -> pl.DataFrame:
        """The analysed rows of ``labels`` (checked by :meth:`check`): the resolved ones, or all with
        ``include_unresolved``. With ``require``, none left is a ``UserError``."""
        self.check(labels, kl, floor, what)
        out = labels if self.include_unresolved else labels.filter(~self.unresolved(kl, floor))
        if require and out.height == 0:
            raise UserError(f"all {labels.height} {what} are at or below their checkpoint's noise floor: pass "
                            "--include-unresolved")
        return out

    def threshold(self, kl: np.ndarray) -> float:
        """The harm threshold over the analysed labels' ``kl [N]`` (NaN when there are none)."""
        import numpy as np

        kl = np.asarray(kl, dtype=float)
        return harm_threshold(kl, self.harm) if len(kl) else float("nan")
