"""A generated fuzz suite of the command line (#55): for every command and every option, hostile values drawn by
Hypothesis (Unicode digits, huge, negative, NaN, infinite, empty, markup, glob characters, long text; symlinked,
hard-linked, special and truncated files) must give exit 0 with the inputs unchanged, or exit 2 with one line,
within a time bound; never exit 1 ("a bug in kvdiag"), never a changed input.

What runs: the console script's ``main`` in this process, on a valid command line of a tiny run (trace, labels,
scores) with one option replaced by the drawn value. Every check a command makes of its arguments and input files
runs for real; the stage itself (what loads a model and computes) is replaced by a stub that ends the run as
"accepted", so that a thousand draws fit in CI's minutes. What an accepted value then does inside a stage is bounded
by the same checks (every number's range: ``kvdiag.cli.common.BOUNDS``) and is the business of the stage's own
tests. Draws are derandomized (the same examples on every run); a failing one is kept as an explicit row of
tests/test_bad_input.py (``KEPT`` below lists them).

Hostile contents as well: the tiny run's labels and scores altered one way per draw (a value NaN, infinite, null,
negative, huge; a column as text, as integers, dropped; a row doubled; no rows) must be refused by their contract
with one line, or be a table every stage can read, and rank-eval (the stage that reads both, no model) then ends
with exit 0 or 2, never 1.

Not drawn: a NUL byte (no shell passes one to a process) and absolute paths from free text (the scratch directory
is the current directory; drawn paths are built there).
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiag.cli.main import main, root_command
from tests.test_bad_input import inputs  # noqa: F401  (the fixture: a tiny run and broken copies of its files)

# a valid command line per command; {trace} {labels} {scores} {run} {out} are filled from the fixture
FITS = ["--checkpoints", "every:16", "--w-obs", "8", "--horizon", "4"]
BASE: dict[str, list[str]] = {
    "trace": ["trace", "--model", "tiny:llama", "--prompts", "builtin:arith:1", "--max-new-tokens", "8", "--out",
              "{out}"],
    "label": ["label", "--trace", "{trace}", "--out", "{out}/l.parquet", *FITS, "--candidates", "4"],
    "score": ["score", "--trace", "{trace}", "--labels", "{labels}", "--scorers", "knorm", "--out", "{out}/s.parquet"],
    "rank-eval": ["rank-eval", "--labels", "{labels}", "--scores", "{scores}", "--bootstrap", "0", "--out", "{out}"],
    "figures": ["figures", "--trace", "{trace}", "--labels", "{labels}", "--scores", "{scores}", "--out", "{out}"],
    "report": ["report", "--run", "{run}", "--out", "{out}"],
    "replay": ["replay", "--model", "tiny:llama", "--prompts", "builtin:arith:1", "--scorers", "knorm", "--budget",
               "16", "--interval", "8", "--max-new-tokens", "8", "--out", "{out}"],
    # oracle_search in the base line, so that the search's options (--search-from's files) reach their own checks
    "decisions": ["decisions", "--trace", "{trace}", "--scores", "{head_scores}", "--keep", "0.5", "--references",
                  "oracle_single,oracle_search", "--out", "{out}"],
    "grade": ["grade", "knorm", "--out", "{out}"],
    "fit": ["fit", "--trace", "{trace}", "--labels", "{labels}", "--out", "{out}"],
    "demo": ["demo", "--model", "tiny:llama", "--limit", "1", "--out", "{out}"],
    "validate-labels": ["validate-labels", "--exact", "{labels}", "--approx", "{labels}", "--out", "{out}"],
    "bench trace": ["bench", "trace", "--model", "tiny:llama"],
    "bench label": ["bench", "label", "--model", "tiny:llama"],
    "bench score": ["bench", "score", "--trace", "{trace}"],
    "bench kernels": ["bench", "kernels"],
    "bench scale": ["bench", "scale", "--out", "{out}"],
    "bench peak": ["bench", "peak"],
    "bench replay": ["bench", "replay", "--model", "tiny:llama"],
    "bench cli": ["bench", "cli", "--repeats", "1"],
    "bench decisions": ["bench", "decisions", "--model", "tiny:llama"],
    "bench padded": ["bench", "padded", "--model", "tiny:llama"],
}
# where each command's work starts (after every argument check): replaced by a stub that ends the run as accepted
STAGES = [
    ("kvdiag.trace.writer", "trace_files"), ("kvdiag.label.run", "label_files"),
    ("kvdiag.scorers.run", "score_files"), ("kvdiag.rankeval.run", "rank_eval_files"),
    ("kvdiag.figures.run", "figures_files"), ("kvdiag.report.run", "report_files"),
    ("kvdiag.replay.run", "replay_files"), ("kvdiag.decisions.run", "decisions_files"),
    ("kvdiag.grade.run", "grade_files"), ("kvdiag.fit.run", "fit_files"),
    ("kvdiag.label.validate", "run_validation"), ("kvdiag.model.load", "load_model"),
    ("kvdiag.scorers.bench", "run_score_bench"), ("kvdiag.kernels.bench", "run_kernel_bench"),
    ("kvdiag.kernels.peak", "matmul_peak"), ("kvdiag.bench.scale", "bench_scale"), ("kvdiag.cli.bench_cli", "_best"),
]
EXAMPLES = int(os.environ.get("KVDIAG_FUZZ_EXAMPLES", 3))  # draws per option in CI; more for a longer hunt
SECONDS = 60  # the time bound of one run: its checks read small files, nothing heavier
# what the fuzz found, kept as explicit rows of tests/test_bad_input.py (CASES): a FIFO given as an input file blocked
# its first read forever (the output guard now refuses a FIFO, device or socket among the inputs)
KEPT = ["label-include-fifo", "rank-eval-labels-fifo", "score-plugin-fifo"]


class StageReached(BaseException):
    """Raised by the stubbed stages: every argument check passed (main lets a BaseException through)."""


class Hung(BaseException):
    """Raised by the alarm of a run that took over SECONDS (a read of a FIFO blocks forever, for one)."""


def alarm(signum, frame):
    raise Hung


def options() -> list[tuple[str, str, bool]]:
    """(command, option, is a flag) for every option of every command (--help aside)."""
    found = []

    def walk(command, names=()):
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, (*names, name))
        if not hasattr(command, "commands"):
            found.extend((" ".join(names), p.opts[0], bool(p.is_flag)) for p in command.params
                         if p.param_type_name == "option")

    walk(root_command())
    return sorted(found)


OPTIONS = options()


def path_options() -> list[tuple[str, str]]:
    """(command, option) for every option that takes one path (``Path`` or a repeatable ``list[Path]``)."""
    found = []

    def walk(command, names=()):
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, (*names, name))
        if not hasattr(command, "commands"):
            found.extend((" ".join(names), p.opts[0]) for p in command.params
                         if p.param_type_name == "option" and str(p.bare_type()) in ("Path", "list[Path]"))

    walk(root_command())
    return sorted(found)


PATH_OPTIONS = path_options()
DIGITS = "\u00b2\u2460\u0663\u0966\uff13\u00bd"  # superscript two, circled one, Arabic-Indic 3, Devanagari 0, ...
HOSTILE = ["", " ", "-1", "0", "1e9", "1e999", "nan", "-nan", "inf", "-inf", "2.5", str(2**64), str(-2**63),
           "9" * 40, "REST", "rest ", "all", "[red]x[/red]", "x[1]*?", "*", "..", ".", "-", "--", "a,b,,c",
           "every:", "every:0", "every:-3", "keep:x", "tiny:", "builtin:", "builtin:recall:0", "\u00e9\u00e8", "\n",
           "x" * 300, *DIGITS, f"every:{DIGITS[0]}", f"{DIGITS[2]}{DIGITS[2]}"]
FILES = ["@labels", "@trace", "@link_labels", "@hard_labels", "@dotdot_labels", "@fifo", "@dir", "@missing",
         "@truncated", "@devnull", "@empty_file"]

text = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12).filter(
    lambda s: not s.startswith(("/", "~")))
values = st.one_of(st.sampled_from(HOSTILE), st.sampled_from(FILES), text,
                   st.integers(-2**70, 2**70).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(str))


def digest(root: Path) -> dict[str, str]:
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(root.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def run(inputs, tmp_path_factory):  # noqa: F811  (the imported fixture, requested)
    """The tiny run every command line points at (tests/test_bad_input.py's), and the special files the path
    strategies draw."""
    paths = inputs
    root = Path(tmp_path_factory.mktemp("fuzz-files"))
    (root / "link").symlink_to(paths["labels"])
    os.link(paths["labels"], root / "hard.parquet")
    (root / "sub").symlink_to(paths["trace"])
    os.mkfifo(root / "fifo")
    (root / "dir").mkdir()
    (root / "empty").write_bytes(b"")
    data = Path(paths["labels"]).read_bytes()
    (root / "cut.parquet").write_bytes(data[: len(data) // 3])
    files = {"@labels": paths["labels"], "@trace": paths["trace"], "@link_labels": str(root / "link"),
             "@hard_labels": str(root / "hard.parquet"),
             "@dotdot_labels": str(root / "sub" / ".." / Path(paths["labels"]).name), "@fifo": str(root / "fifo"),
             "@dir": str(root / "dir"), "@missing": str(root / "missing.parquet"),
             "@truncated": str(root / "cut.parquet"), "@devnull": "/dev/null", "@empty_file": str(root / "empty")}
    return paths, files


@pytest.fixture
def stubbed(monkeypatch):
    import importlib

    def stage(*args, **kwargs):
        raise StageReached

    for module, name in STAGES:
        monkeypatch.setattr(importlib.import_module(module), name, stage)


def command_line(command: str, option: str, flag: bool, value: str, paths: dict, files: dict, out: Path) -> list[str]:
    argv = [a.format(out=out, **paths) for a in BASE[command]]
    if flag:
        return argv + [option]
    value = files.get(value, value)
    if option in argv:  # replace the base's value
        i = argv.index(option)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [option, value]


def test_the_kept_examples_are_rows():
    from tests.test_bad_input import CASES

    assert set(KEPT) <= {name for name, _, _ in CASES}


def test_every_command_has_a_base_line_that_is_accepted(run, stubbed, tmp_path, capsys, monkeypatch):
    """The base lines pass every check (so a refusal in the fuzz is the drawn value's doing)."""
    assert sorted({c for c, _, _ in OPTIONS}) == sorted(BASE)
    assert len(OPTIONS) > 250
    paths, _ = run
    monkeypatch.chdir(tmp_path)
    for command, line in BASE.items():
        with pytest.raises(StageReached):
            main([a.format(out=tmp_path / command.replace(" ", "-"), **paths) for a in line])
        assert capsys.readouterr().err.count("error:") == 0, command


@pytest.mark.parametrize("command, option, flag", OPTIONS, ids=[f"{c}:{o}" for c, o, _ in OPTIONS])
def test_hostile_values(command, option, flag, run, stubbed, tmp_path_factory, capsys, monkeypatch):
    paths, files = run
    scratch = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(scratch)
    watched = Path(paths["run"])
    before = digest(watched)
    count = [0]

    @settings(max_examples=1 if flag else EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(value=values)
    def check(value):
        count[0] += 1
        argv = command_line(command, option, flag, value, paths, files, scratch / f"out{count[0]}")
        judge(argv, files.get(value), watched, before, capsys)

    check()


@pytest.mark.parametrize("command, option", PATH_OPTIONS, ids=[f"{c}:{o}" for c, o in PATH_OPTIONS])
def test_every_special_file_on_every_path_option(command, option, run, stubbed, tmp_path_factory, capsys,
                                                 monkeypatch):
    """Each special file (a link, a hard link, '..', a FIFO, a directory, a missing, truncated or empty file,
    /dev/null, another kind of table) on each option that takes a path: the draws above reach few of them."""
    assert len(PATH_OPTIONS) > 30
    paths, files = run
    scratch = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(scratch)
    watched = Path(paths["run"])
    before = digest(watched)
    for i, value in enumerate(FILES):
        argv = command_line(command, option, False, value, paths, files, scratch / f"out{i}")
        judge(argv, files[value], watched, before, capsys)


def judge(argv: list[str], path: str | None, watched: Path, before: dict[str, str], capsys) -> None:
    """Run ``argv``: exit 0 (or the stubbed stage reached) or exit 2 with one line that prints ``path`` (the drawn
    file, if any) at most once per option given it, within SECONDS; never exit 1, never a changed input under
    ``watched``."""
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, alarm)
    # aimed at this thread: a process-wide alarm may land on one of polars' threads and leave a blocked read here
    timer = threading.Timer(SECONDS, signal.pthread_kill, (threading.main_thread().ident, signal.SIGALRM))
    timer.start()
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    except StageReached:
        code = 0
    except Hung:
        code = "hung"
    finally:
        timer.cancel()
        signal.signal(signal.SIGALRM, previous)
    seconds = time.monotonic() - start
    err = capsys.readouterr().err.strip().splitlines()
    assert seconds < SECONDS, (argv, seconds)
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        assert len(err) == 1 and err[0].startswith("error:"), (argv, err)
        if path is not None:  # printed verbatim, once per option that holds it (not 'PATH PATH does not exist')
            assert err[0].count(path) <= max(1, argv.count(path)), (argv, err)
    assert digest(watched) == before, (argv, "an input changed")


# --------------------------------------------------------------------------- hostile contents
# The tiny run's labels, scores and a decisions table altered one way each (a value of a column made NaN, infinite,
# null, negative, huge, text or an integer; the column dropped; a row doubled; every row dropped). A contract either
# refuses the file (one UserError) or returns a table every stage can read: the label and score columns numeric, the
# label a finite divergence (>= 0), the scores finite, the keys unique; a decisions table typed as kvdiag writes it.
# rank-eval, which reads labels and scores and nothing heavier, then runs to the end on what the contracts accepted.
OPS = ["nan", "inf", "null", "negative", "huge", "text", "integer", "drop", "double", "empty"]


def _alter(df, column: str, op: str, row: int):
    import polars as pl

    at = pl.int_range(pl.len()) == row % max(df.height, 1)
    value = {"nan": float("nan"), "inf": float("inf"), "null": None, "huge": 1e308}.get(op)
    if op in ("nan", "inf", "null", "huge"):
        if not df.schema[column].is_numeric():
            return df.with_columns(pl.when(at).then(None).otherwise(pl.col(column)).alias(column))
        return df.with_columns(pl.when(at).then(value).otherwise(pl.col(column).cast(pl.Float64)).alias(column))
    if op == "negative" and df.schema[column].is_numeric():
        return df.with_columns(pl.when(at).then(-pl.col(column) - 1).otherwise(pl.col(column)).alias(column))
    if op == "text":
        return df.with_columns(pl.col(column).cast(pl.String))
    if op == "integer" and df.schema[column].is_numeric():
        return df.with_columns(pl.col(column).cast(pl.Int64))
    if op == "drop":
        return df.drop(column)
    if op == "double":
        return pl.concat([df, df.filter(at)])
    if op == "empty":
        return df.head(0)
    return df


@pytest.mark.parametrize("kind", ["labels", "scores", "decisions"])
def test_hostile_contents_are_refused_or_readable(kind, run, tmp_path_factory, capsys, monkeypatch):
    import polars as pl

    from kvdiag.core.contracts import (
        DECISION_SCHEMA,
        KEYS,
        LABEL_SCHEMA,
        check_types,
        read_decisions,
        read_labels,
        read_scores,
        score_columns,
    )
    from kvdiag.core.errors import UserError
    from kvdiag.core.io import read_table, write_table

    paths, _ = run
    df, meta = read_table(paths[kind] if kind != "decisions" else Path(paths["earlier"]) / "decisions.parquet")
    scratch = tmp_path_factory.mktemp("contents")
    monkeypatch.chdir(scratch)
    count = [0]

    @settings(max_examples=8 * EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(column=st.sampled_from(df.columns), op=st.sampled_from(OPS), row=st.integers(0, 10**6))
    def check(column, op, row):
        count[0] += 1
        path = write_table(_alter(df, column, op, row), scratch / f"{kind}{count[0]}.parquet", meta)
        if kind == "decisions":  # read by --search-from: the contract gives it typed as kvdiag decisions writes it
            try:
                got, _ = read_decisions(path)
            except UserError:
                return
            check_types(got, DECISION_SCHEMA, "accepted", "")
            assert got["kl_mean"].filter(got["status"] == "ok").cast(pl.Float64).is_finite().all(), (column, op)
            return
        try:
            got, _ = read_labels(path) if kind == "labels" else read_scores(path)
        except UserError:
            accepted = False
        else:
            accepted = True
            assert not got.select(KEYS).is_duplicated().any(), (column, op)
            values = ["kl_mean", "noise_floor"] if kind == "labels" else score_columns(got)
            assert all(got.schema[c].is_numeric() or got.schema[c] == pl.Null for c in values), (column, op)
            if kind == "labels":
                assert all(got.schema[c].is_numeric() or got.schema[c] == pl.Null
                           for c in LABEL_SCHEMA if c in got.columns and c not in KEYS and c != "kl_steps")
                kl = got["kl_mean"].cast(pl.Float64)
                assert bool(kl.is_finite().all()) and float(kl.min()) >= 0, (column, op)
            else:
                assert all(bool(got[c].cast(pl.Float64).is_finite().all()) for c in values), (column, op)
        if not accepted and count[0] % 3:  # the stage below runs on every accepted file, on a third of the rest
            return
        files = {"labels": paths["labels"], "scores": paths["scores"], kind: str(path)}
        argv = ["rank-eval", "--labels", files["labels"], "--scores", files["scores"], "--bootstrap", "0",
                "--out", str(scratch / f"out{count[0]}")]
        judge(argv, None, Path(paths["run"]), digest(Path(paths["run"])), capsys)

    check()


MANIFEST_VALUES = ["x", "", -1, 0, 1, 2.5, 1e308, float("nan"), None, True, [], {}, 10**9, "float99", 999]


def test_hostile_manifests_are_refused_or_readable(run, tmp_path_factory, capsys, monkeypatch):
    """A Trace manifest edited by hand (one field of the model's shape, the format, the storage dtype or a prompt's
    lengths set to a hostile JSON value): TraceFiles refuses it with one UserError, or what it accepts holds
    counts where counts belong and every prompt's tokens; score (tiny model, one rule) then ends with exit 0 or 2."""
    import json
    import math
    import shutil

    from kvdiag.core.errors import UserError
    from kvdiag.trace.manifest import TraceFiles

    paths, _ = run
    source = Path(paths["trace"])
    manifest = json.loads((source / "manifest.json").read_text())
    first = next(iter(manifest["prompts"]))
    fields = ["num_layers", "num_heads", "num_kv_heads", "head_dim", "scale", "storage_dtype", "format_version",
              "prompts", "model", "prompt_len", "length"]
    scratch = tmp_path_factory.mktemp("manifests")
    monkeypatch.chdir(scratch)
    count = [0]

    @settings(max_examples=8 * EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(field=st.sampled_from(fields), value=st.sampled_from(MANIFEST_VALUES))
    def check(field, value):
        count[0] += 1
        copy = scratch / f"trace{count[0]}"
        shutil.copytree(source, copy)
        edited = json.loads(json.dumps(manifest))
        (edited["prompts"][first] if field in ("prompt_len", "length") else edited)[field] = value
        (copy / "manifest.json").write_text(json.dumps(edited))
        try:
            tf = TraceFiles(copy)
        except UserError:
            return
        for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            assert type(getattr(tf, key)) is int and getattr(tf, key) >= 1, (field, value)
        assert tf.scale is None or (math.isfinite(tf.scale) and tf.scale > 0), (field, value)
        for pid in tf.prompt_ids:
            assert 1 <= tf.prompt_len(pid) <= tf.length(pid) == tf.tokens.filter(
                tf.tokens["prompt_id"] == pid).height, (field, value)
        judge(["score", "--trace", str(copy), "--checkpoints", "every:16", "--scorers", "knorm", "--out",
               str(scratch / f"s{count[0]}.parquet")], None, source, digest(source), capsys)

    check()
