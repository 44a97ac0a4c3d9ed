"""What ``kvdiag decisions`` grades and how: budgets, selection, references (written into every output)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvdiag.core.errors import UserError, check_choice
from kvdiag.core.harm import HarmSpec
from kvdiag.core.io import file_sha256
from kvdiag.core.parsing import REST, Selection, horizon_steps, parse_horizon
from kvdiag.core.schema import HORIZON, N_BOOT

if TYPE_CHECKING:  # the tables are read once the arguments are checked
    import polars as pl

# the reference decisions every rule is compared with (docs/decisions.md); the default set, and the ones asked for by
# name (future_attention reads the Trace's stored queries; oracle_search costs up to --search-rows set rows)
DEFAULT_REFERENCES = ("oracle_single", "oracle_greedy", "fast", "random")
REFERENCES = (*DEFAULT_REFERENCES, "future_attention", "oracle_search")
RANDOM_REFERENCE = "random_reference"  # the random reference's decision name: the zoo has a rule named random
INFEASIBLE = ("refuse", "skip")
MAX_SEARCH_FROM = 64  # --search-from files: each adds one set row per (checkpoint, budget) it shares with the run


@dataclass(frozen=True)
class Budget:
    """One budget: ``keep:F`` keeps ``max(1, floor(F * t))`` entries per (layer, KV head) of a checkpoint ``t``
    (0 < F < 1), ``budget:B`` keeps ``B`` (B >= 1; at or above ``t`` nothing is evicted)."""

    kind: str  # keep | budget
    value: float

    def __post_init__(self):
        if self.kind not in ("keep", "budget"):
            raise UserError(f"budget {self.kind}:{self.value:g}: use keep:F or budget:B")
        if self.kind == "keep" and not 0 < self.value < 1:
            raise UserError(f"--keep {self.value:g}: a keep fraction lies in (0, 1), e.g. 0.5,0.25,0.125")
        if self.kind == "budget" and not (self.value >= 1 and float(self.value).is_integer()):
            raise UserError(f"--budget {self.value:g}: a budget keeps a whole number of entries (at least 1) per "
                            "layer and KV head")

    @property
    def name(self) -> str:
        return f"keep:{self.value:g}" if self.kind == "keep" else f"budget:{int(self.value)}"

    @classmethod
    def parse(cls, name: str) -> Budget:
        """The budget a :attr:`name` names (``keep:0.5``, ``budget:64``): the one reader of a budget's name."""
        kind, sep, value = str(name).partition(":")
        try:
            return cls(kind, float(value)) if sep else cls(kind, float("nan"))
        except ValueError:
            raise UserError(f"budget {name!r}: use keep:F (0 < F < 1) or budget:B (B >= 1 entries)") from None

    def entries(self, t: int) -> int:
        """Entries kept at checkpoint ``t`` (at most ``t``)."""
        kept = max(1, math.floor(self.value * t)) if self.kind == "keep" else int(self.value)
        return min(kept, t)


def budgets_from(keep: list[float], budget: list[int]) -> tuple[Budget, ...]:
    """``--keep`` fractions (0 < F < 1) or ``--budget`` entry counts (>= 1), not both, at least one."""
    if keep and budget:
        raise UserError("pass --keep fractions or --budget entry counts, not both")
    if not keep and not budget:
        raise UserError("pass --keep F,... (e.g. 0.5,0.25,0.125) or --budget B,... (entries kept per layer and head)")
    return tuple(Budget("keep", float(f)) for f in keep) + tuple(Budget("budget", float(b)) for b in budget)


@dataclass(frozen=True)
class DecisionsConfig:
    """Every setting of one decisions run.

    budgets : the budgets graded (:class:`Budget`).
    selection : ``per-head`` (each layer and KV head keeps its own top B, as replay's default), ``per-token`` (one keep
        set for every layer and head) or ``stochastic[:TAU]`` (each layer and KV head draws its evictions; every rule
        then also gets its deterministic per-head set, to compare); ``kvdiag.core.selection.select_keep`` decides for
        replay and here.
    samples : stochastic selection: draws per (rule, budget, checkpoint).
    horizon : teacher-forced steps of each joint label, N or ``rest`` (to the end of each prompt; the labels file's,
        when one is given).
    rules : score columns graded (None: every column of the scores file).
    references : reference decisions computed (:data:`REFERENCES`; oracle_single needs labels of every entry).
    greedy_chunk : ``oracle_greedy`` evicts ``ceil(greedy_chunk * t)`` entries per step (the survivors with the
        smallest joint damage given what is already evicted), relabelling every survivor at each step.
    pairs : per checkpoint, the most damaging token sets searched for superadditive pairs (0: none).
    pair_candidates : members of such a set paired (the harmless ones with the largest single labels).
    infeasible : a rule whose protected entries exceed a budget at a checkpoint: ``refuse`` (bad input) or ``skip``
        (its row says so and carries no label).
    seed : seed of ``random`` and of the bootstrap. n_boot, ci_level : cluster bootstrap over prompts.
    reference : rule of the paired comparisons: ``best`` (the rule with the least mean damage at each budget), a
        rule or reference name, or ``none``.
    batch_size : set rows per forward.
    harm : which single labels are harmless (a superadditive pair's members) and harmful (``kvdiag.core.harm``).
    read_window : the judged window's first steps the references that read the future choose their sets on
        (``oracle_greedy``, ``oracle_search`` and ``fast``; ``future_attention`` by default; ``oracle_single``'s labels
        must have this horizon): N (at most the judged window) or ``"rest"`` (only with ``horizon="rest"``); None: the
        whole judged window. Every set is judged on the whole window (``horizon``), so the steps after its read window
        are held out: the summary reports each reference's damage there beside the damage on what it read.
    future_window : ``future_attention`` sums the attention of the queries ``t .. t + W - 1``: W (None: the read
        window's steps) or ``"rest"`` (to the end of the prompt).
    search_rows, search_seconds : ``oracle_search``'s effort per (checkpoint, budget): at most this many sets labeled
        beyond its candidates' (one per descent step, one for the result's exact row), and it takes no new step
        after this many seconds (0: no time bound).
    search_from : ``decisions.parquet`` files of earlier runs on the same Trace (at most :data:`MAX_SEARCH_FROM`):
        at each (checkpoint, budget) they share with this run, each file's lowest set (its own ``kl_mean``) is
        labeled here and joins ``oracle_search``'s candidates (``kvdiag.decisions.imported``), so the search starts
        from the best of them too (and continues an earlier search).
    """

    budgets: tuple[Budget, ...]
    selection: Selection | str = "per-head"  # a spec string is parsed once, here
    samples: int = 4
    horizon: int | str = HORIZON
    rules: tuple[str, ...] | None = None
    references: tuple[str, ...] = DEFAULT_REFERENCES
    greedy_chunk: float = 0.125
    pairs: int = 1
    pair_candidates: int = 16
    infeasible: str = "refuse"
    seed: int = 0
    n_boot: int = N_BOOT
    ci_level: float = 0.95
    reference: str = "best"
    batch_size: int = 16
    backend: str = "auto"
    harm: HarmSpec = field(default_factory=HarmSpec)
    read_window: int | str | None = None
    future_window: int | str | None = None
    search_rows: int = 512
    search_seconds: float = 120.0
    search_from: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "selection", Selection.parse(self.selection))
        if self.samples < 1:
            raise UserError(f"--draws {self.samples}: must be a positive number of stochastic draws, e.g. 4")
        check_choice(self.infeasible, INFEASIBLE, "--infeasible")
        if self.seed < 0:
            raise UserError(f"--seed {self.seed}: must be >= 0")
        for ref in self.references:
            check_choice(ref, REFERENCES, "--references")
        if not self.budgets:
            raise UserError("no budget to grade: pass --keep or --budget")
        object.__setattr__(self, "horizon", parse_horizon(self.horizon))
        if not 0 < self.greedy_chunk <= 1:
            raise UserError(f"--greedy-chunk {self.greedy_chunk}: a fraction of the checkpoint in (0, 1], e.g. 0.125")
        if self.pairs < 0 or self.pair_candidates < 2:
            raise UserError("--pairs must be >= 0 and --pair-candidates >= 2")
        if self.n_boot < 0 or not 0 < self.ci_level < 1:
            raise UserError(f"--bootstrap {self.n_boot}: must be >= 0 (0: no CIs)")
        if self.batch_size < 1:
            raise UserError(f"--batch-size {self.batch_size}: must be a positive number of rows, e.g. 16")
        if self.read_window is not None:
            read = parse_horizon(self.read_window, "--read-window", what="steps the references read")
            object.__setattr__(self, "read_window", read)
            if read == REST and self.horizon != REST:
                raise UserError(f"--read-window rest reads to the end of each prompt, past the judged window "
                                f"(--horizon {self.horizon}): give at most {self.horizon} steps, or --horizon rest")
            if read != REST and self.horizon != REST and read > self.horizon:
                raise UserError(f"--read-window {read} is longer than the judged window (--horizon {self.horizon}): a "
                                f"reference is judged on every step it reads; give at most {self.horizon}")
        if self.future_window is not None:
            object.__setattr__(self, "future_window", parse_horizon(self.future_window, "--future-window",
                                                                    what="future queries"))
        if self.search_rows < 1:
            raise UserError(f"--search-rows {self.search_rows}: oracle_search needs at least 1 set row per "
                            "(checkpoint, budget), e.g. 512")
        if not self.search_seconds >= 0:
            raise UserError(f"--search-seconds {self.search_seconds:g}: must be >= 0 (0: no time bound), e.g. 120")
        object.__setattr__(self, "search_from", tuple(str(p) for p in self.search_from))
        if self.search_from and "oracle_search" not in self.references:
            raise UserError("--search-from gives oracle_search sets to start from: add oracle_search to --references, "
                            "or drop --search-from")
        if len(self.search_from) > MAX_SEARCH_FROM:
            raise UserError(f"--search-from is given {len(self.search_from)} times: at most {MAX_SEARCH_FROM} files "
                            "(each adds a set row per (checkpoint, budget))")

    @property
    def read_horizon(self) -> int | str:
        """The window the references that read the future read (N or rest): ``read_window``, else the judged one."""
        return self.horizon if self.read_window is None else self.read_window

    def read_steps(self, t: int, length: int) -> int:
        """Steps read at checkpoint ``t`` of a prompt of ``length`` tokens (at most the judged window's)."""
        return min(horizon_steps(self.read_horizon, t, length), horizon_steps(self.horizon, t, length))

    def window(self, t: int, length: int) -> int:
        """``future_attention``'s number of future queries at checkpoint ``t`` of a prompt of ``length`` tokens."""
        if self.future_window == REST:
            return length - t
        return self.read_steps(t, length) if self.future_window is None else int(self.future_window)

    def check_future(self, manifest: dict, checkpoints: dict[str, list[int]]) -> None:
        """``future_attention`` needs the Trace's stored queries of every layer (``manifest``: the Trace's) and a
        window inside every prompt at each of its ``checkpoints``."""
        if "future_attention" not in self.references:
            return
        store = manifest.get("store") or {"mode": "all", "layers": list(range(manifest["num_layers"]))}
        missing = [l for l in range(manifest["num_layers"]) if store["mode"] == "kv" or l not in store["layers"]]
        if missing:
            raise UserError(f"future_attention reads the Trace's stored queries; this Trace (--store {store['mode']}) "
                            f"stored none of layer {missing[0]}'s: retrace with --store all, or drop future_attention "
                            "from --references")
        for pid, ts in checkpoints.items():
            length = manifest["prompts"][pid]["length"]
            for t in ts:
                if t + self.window(t, length) > length:
                    raise UserError(f"--future-window {self.future_window}: checkpoint {t} of {pid!r} has only "
                                    f"{length - t} later tokens; use a smaller window or rest")

    def settings(self) -> dict:
        """What changes a part's content (the parts' stamp)."""
        return {"budgets": [b.name for b in self.budgets], "selection": str(self.selection), "samples": self.samples,
                "horizon": self.horizon,
                "references": list(self.references), "greedy_chunk": self.greedy_chunk, "pairs": self.pairs,
                "pair_candidates": self.pair_candidates, "infeasible": self.infeasible, "seed": self.seed,
                "harm": self.harm.to_config(), "future_window": self.future_window, "search_rows": self.search_rows,
                "search_seconds": self.search_seconds,
                # only when set: a run without them keeps the stamp its parts were written with
                **({"read_window": self.read_window} if self.read_window is not None else {}),
                # a --search-from file's sets are candidates: a part made from another version of it is another
                **({"search_from": [{"path": p, "sha256": file_sha256(p)} for p in self.search_from]}
                   if self.search_from else {})}


# --------------------------------------------------------------------------- the inputs, read without torch
# (the CLI checks them before the stage's import; the stage checks them again with the same functions)


def rule_columns(scores: pl.DataFrame, wanted: tuple[str, ...] | None) -> list[str]:
    """The rules graded: the scores file's score columns (``kvdiag.core.contracts.score_columns``; all, or
    ``wanted``)."""
    from kvdiag.core.contracts import score_columns

    columns = score_columns(scores)
    if wanted is not None:
        unknown = [c for c in wanted if c not in columns]
        if unknown:
            raise UserError(f"--scorers {unknown[0]} is not a column of the scores file: choose from "
                            f"{', '.join(columns)}")
        columns = list(wanted)
    if not columns:
        raise UserError("the scores file has no score column: run kvdiag score first")
    return columns


def check_reference(cfg: DecisionsConfig, names: list[str]) -> None:
    """``--reference`` names best, none, a graded rule (``names``) or a computed reference: a typo would leave
    paired.csv empty."""
    known = ("best", "none", *cfg.references, *(f"{r}_reference" for r in cfg.references), *names)
    if cfg.reference not in known:
        raise UserError(f"--reference {cfg.reference}: use best, none, a graded rule ({', '.join(names)}) or a "
                        f"reference ({', '.join(cfg.references) or 'none computed'})")


def checkpoints_of(scores: pl.DataFrame, trace, cfg: DecisionsConfig
                   ) -> tuple[dict[str, list[int]], list[tuple[str, int]]]:
    """(prompt -> the checkpoints whose head rows cover every (layer, KV head, position < t), the checkpoints left
    out because the horizon does not fit before the end of the prompt). ``trace``: a ``kvdiag.trace.Trace`` or its
    ``TraceFiles``. No head rows, or a checkpoint whose head rows do not cover the cache, is a ``UserError``."""
    import polars as pl

    head = scores.filter(pl.col("granularity") == "head")
    if head.height == 0:
        why = ("oracle_search starts from every rule's set, so it needs" if "oracle_search" in cfg.references
               else "decisions need")
        raise UserError(f"the scores file has no head rows: {why} every rule's score of every cached entry at each "
                        "(layer, KV head); run kvdiag score --checkpoints every:128 --granularity head")
    L, Hkv = trace.num_layers, trace.num_kv_heads
    counts = head.group_by("prompt_id", "checkpoint").len()
    out: dict[str, list[int]] = {}
    short: list[tuple[str, int]] = []
    for pid, t, n in counts.sort("prompt_id", "checkpoint").iter_rows():
        if n != L * Hkv * t:
            raise UserError(f"the scores file holds {n} head rows at checkpoint {t} of {pid!r}, not every entry of "
                            f"every layer and KV head ({L} x {Hkv} x {t}); score every entry: kvdiag score "
                            "--checkpoints ... --granularity head")
        need = [1 if w == REST else w for w in (cfg.horizon, cfg.read_horizon)]  # rest: at least one step
        if t + max(need) > trace.length(pid):
            short.append((pid, int(t)))
            continue
        out.setdefault(pid, []).append(int(t))
    if not out:
        read = "" if cfg.read_window is None else f" and --read-window {cfg.read_window}"
        raise UserError(f"no checkpoint of the scores file leaves room for --horizon {cfg.horizon}{read} before the "
                        "end of its prompt: use a shorter --horizon or earlier checkpoints")
    return out, short
