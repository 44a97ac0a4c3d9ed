"""Benchmarks kvdiag ships: a fixed, versioned set of inputs every rule is graded on (``kvdiag grade``).

A benchmark ``NAME@VERSION`` is a directory ``data/kvdiag-bench/NAME@VERSION/``:

- ``trace/``: a Trace of the embedded model that stores tokens only (``--store none``): q/k/v are rebuilt from the
  model on demand, whose weights hash the manifest records;
- ``labels.parquet``: exact single labels of every cached entry at every checkpoint (token granularity);
- ``references.parquet``: per (prompt, checkpoint, budget) the joint damage of the reference decisions
  (``oracle_single``, ``oracle_greedy``, ``fast``, ``random``), from ``kvdiag decisions``;
- ``builtins.parquet`` (written by ``kvdiag grade --all``): the built-in rules' joint damage per (checkpoint,
  budget) and their leaderboard rows, for paired tests against the best;
- ``MANIFEST.json``: name, version, the model, the decisions settings, the sha256 of every file, provenance, licence.

Every file is checked against its sha256 before anything runs; a changed file is refused in one line. The manifest
does not vouch for itself: kvdiag holds the sha256 of each shipped version's ``MANIFEST.json`` (:data:`SHIPPED`) and
the files every benchmark must list (:data:`FILES`), so a copy whose manifest drops a file or whose hashes were
recomputed is refused. A benchmark that is not a shipped version is *user-built* and says so in its name.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvdiag.core.errors import UserError
from kvdiag.core.io import read_json, write_json


def _bench_root() -> Path:
    """Where the shipped benchmarks are: ``kvdiag/grade/kvdiag-bench``, package data in an installed wheel and, in a
    checkout, a symlink to ``data/kvdiag-bench`` (resolved, so a checkout names the same directory as always); the
    checkout's directory itself where the link did not survive (a copy without symlinks)."""
    packaged = Path(__file__).resolve().parent / "kvdiag-bench"
    if packaged.is_dir():
        return packaged.resolve()
    return Path(__file__).resolve().parents[2] / "data" / "kvdiag-bench"


BENCH_ROOT = _bench_root()
FILES = ("trace/manifest.json", "trace/tokens.parquet", "labels.parquet", "references.parquet")  # every benchmark's
BUILTINS = "builtins.parquet"
# NAME@VERSION -> the sha256 of its MANIFEST.json as shipped (which holds the sha256 of each of its files)
SHIPPED = {"math500-smollm2@1": "42aadc13769a62de106a114f3c461b064cb73e7c56e191ab88722badb147a5ed"}
USER_BUILT = " (user-built)"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def available(root: Path = BENCH_ROOT) -> list[str]:
    """The benchmarks shipped under ``root`` (``NAME@VERSION``)."""
    return sorted(p.name for p in root.glob("*@*") if (p / "MANIFEST.json").is_file()) if root.is_dir() else []


@dataclass(frozen=True)
class Benchmark:
    """A checked benchmark directory and its manifest."""

    path: Path
    manifest: dict

    @property
    def name(self) -> str:
        """``NAME@VERSION``, with `` (user-built)`` unless it is a shipped version (its manifest hash checked)."""
        return f"{self.manifest['name']}@{self.manifest['version']}" + ("" if self.shipped else USER_BUILT)

    @property
    def shipped(self) -> bool:
        return f"{self.manifest['name']}@{self.manifest['version']}" in SHIPPED

    @property
    def settings(self) -> dict:
        return self.manifest["settings"]

    def file(self, rel: str) -> Path:
        return self.path / rel

    @property
    def has_builtins(self) -> bool:
        return BUILTINS in self.manifest["files"]


def resolve(spec: str, root: Path = BENCH_ROOT) -> Path:
    """``NAME@VERSION`` (or ``NAME``: its newest version, or a directory) -> the benchmark's directory."""
    if os.sep in spec or Path(spec).is_dir():
        path = Path(spec)
        if not (path / "MANIFEST.json").is_file():
            raise UserError(f"--bench {spec}: not a benchmark directory (no MANIFEST.json)")
        return path
    known = available(root)
    if "@" not in spec:
        versions = sorted((k for k in known if k.split("@")[0] == spec), key=lambda k: int(k.split("@")[1]))
        if not versions:
            raise UserError(f"--bench {spec}: unknown benchmark; kvdiag ships {', '.join(known) or 'none'}")
        return root / versions[-1]
    if not re.fullmatch(r"[\w.-]+@\d+", spec) or spec not in known:
        raise UserError(f"--bench {spec}: unknown benchmark or version; kvdiag ships {', '.join(known) or 'none'}")
    return root / spec


def load(spec: str, root: Path = BENCH_ROOT) -> Benchmark:
    """The benchmark ``spec``, sealed: a shipped version's ``MANIFEST.json`` has the sha256 kvdiag holds, every
    benchmark's manifest lists each of :data:`FILES`, and every listed file matches its sha256 (else one
    ``UserError`` line)."""
    path = resolve(spec, root)
    manifest = read_json(path / "MANIFEST.json", f"benchmark {spec} MANIFEST.json")
    restore = f"restore it (git checkout -- {path})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise UserError(f"benchmark {spec}: MANIFEST.json has no `files` table of sha256s, so nothing in it can be "
                        f"checked; {restore}")
    missing = [k for k in ("name", "version", "model", "settings") if k not in manifest]
    if missing:
        raise UserError(f"benchmark {spec}: MANIFEST.json lacks {', '.join(missing)}; {restore}")
    # the entries' types: a user-built benchmark whose model or settings is a string failed deep in grading (exit 1)
    model = manifest["model"]
    kinds = {"name": isinstance(manifest["name"], str), "version": isinstance(manifest["version"], (str, int)),
             "model": isinstance(model, dict) and all(isinstance(model.get(k), str) for k in ("spec", "weights_hash")),
             "settings": isinstance(manifest["settings"], dict),
             "files": all(isinstance(k, str) and isinstance(v, str) for k, v in manifest["files"].items())}
    if bad := [k for k, ok in kinds.items() if not ok]:
        raise UserError(f"benchmark {spec}: MANIFEST.json's {bad[0]} is not what a benchmark holds (name: a string, "
                        "model: {spec, weights_hash, ...}, settings: an object, files: path -> sha256); rebuild it "
                        "with kvdiag.grade.benchmark.make")
    name = f"{manifest['name']}@{manifest['version']}"
    if name in SHIPPED and sha256(path / "MANIFEST.json") != SHIPPED[name]:
        raise UserError(f"benchmark {spec}: its MANIFEST.json is not the one kvdiag shipped as {name} (sha256 "
                        f"differs); {restore}, or build a new benchmark under another name or version")
    unlisted = [rel for rel in FILES if rel not in manifest["files"]]
    if unlisted:
        raise UserError(f"benchmark {spec}: MANIFEST.json does not list {unlisted[0]}, which every benchmark must "
                        f"have and seal; {restore}")
    for rel, digest in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise UserError(f"benchmark {spec}: {rel} is missing; restore it (git checkout -- {f})")
        if sha256(f) != digest:
            raise UserError(f"benchmark {spec}: {rel} does not match its sha256 in MANIFEST.json (the file changed); "
                            f"restore it (git checkout -- {f})")
    return Benchmark(path, manifest)


def check_model(bench: Benchmark, lm) -> None:
    """The embedded model must be the one the benchmark was made with (same weights hash)."""
    want = bench.manifest["model"]["weights_hash"]
    if lm.info["weights_hash"] != want:
        raise UserError(f"benchmark {bench.name} was made with weights {want}, the embedded {lm.spec} has "
                        f"{lm.info['weights_hash']}: install the model version it names ({bench.manifest['model']})")


def seal(path: Path, manifest: dict) -> Path:
    """Write ``MANIFEST.json`` with the sha256 of every file of ``manifest['files']`` (and of builtins.parquet when
    present)."""
    files = [*FILES, *([BUILTINS] if (path / BUILTINS).is_file() else [])]
    manifest = {**manifest, "files": {rel: sha256(path / rel) for rel in files}}
    return write_json(path / "MANIFEST.json", manifest)


def make(name: str, version: int, trace_dir: str | os.PathLike, labels: str | os.PathLike,
         decisions_dir: str | os.PathLike, root: Path = BENCH_ROOT, licence: str = "", command: str = "") -> Path:
    """Build ``root/NAME@VERSION`` from a Trace, its labels of every entry and a ``kvdiag decisions`` run: the Trace
    as tokens only, the labels at the decisions' checkpoints, the references' joint damage; then seal it. An
    existing version is never overwritten (make a new version)."""
    import polars as pl

    from kvdiag.core.contracts import belongs, read_decisions, read_labels
    from kvdiag.core.io import write_table
    from kvdiag.core.provenance import provenance
    from kvdiag.trace import Trace

    out = root / f"{name}@{version}"
    if out.exists():
        raise UserError(f"{out} exists: a benchmark version is never rewritten; make version {version + 1}")
    tr = Trace(trace_dir)
    dec, dec_meta = read_decisions(Path(decisions_dir) / "decisions.parquet")
    belongs(tr, dec_meta, "decisions")
    lab, lab_meta = read_labels(labels, "labels")
    belongs(tr, lab_meta, "labels")
    cps = dec.select("prompt_id", "checkpoint").unique()
    lab = lab.filter(pl.col("granularity") == "token").join(cps, on=["prompt_id", "checkpoint"], how="semi")
    (out / "trace").mkdir(parents=True)
    manifest = {**tr.manifest, "store": {"mode": "none", "layers": []}}
    write_json(out / "trace" / "manifest.json", manifest)
    tr.tokens.write_parquet(out / "trace" / "tokens.parquet")
    write_table(lab.sort("prompt_id", "checkpoint", "position"), out / "labels.parquet",
                {**lab_meta, "trace": {**lab_meta["trace"], "path": "trace"}})
    refs = dec.filter(pl.col("kind") == "reference").select(
        "prompt_id", "checkpoint", "decision", "budget", "kept", "evicted", "selection", "status", "kl_mean",
        "noise_floor", "sum_single")
    write_table(refs.sort("prompt_id", "checkpoint", "decision", "budget"), out / "references.parquet",
                {"kind": "references", "trace": {**dec_meta["trace"], "path": "trace"}})
    cfg = dec_meta["config"]
    return seal(out, {
        "name": name, "version": version, "model": {k: tr.manifest["model"][k] for k in ("spec", "weights_hash",
                                                                                          "config_hash", "dtype")},
        "trace": {"fingerprint": tr.fingerprint, "prompts": len(tr.prompt_ids),
                  "positions": sum(tr.length(p) for p in tr.prompt_ids)},
        "checkpoints": cps.height, "labels": lab.height,
        "settings": {k: cfg[k] for k in ("budgets", "selection", "horizon", "infeasible", "seed", "harm")}
                    | {"n_boot": cfg.get("n_boot", 1000)},
        "labels_method": (lab_meta.get("config") or {}).get("method", "exact"),
        "provenance": {**provenance(), "command": command}, "licence": licence,
    })
