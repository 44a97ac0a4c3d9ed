"""Stored full-cache runs: the ``OracleEngine.golden`` results of a prompt's checkpoints, kept on disk so that a
second run over the same Trace, model and settings (``kvdiag grade`` of another rule on the same benchmark) reads
them instead of recomputing them. The golden run does not depend on the rule graded, and it was 45 % of a repeated
grade (docs/benchmarks.md).

All or nothing per prompt: an engine extends one cache checkpoint by checkpoint, so a checkpoint computed alone would
round differently from the run that stored its neighbours; a prompt is served from the store only when every
checkpoint asked for is there, and is stored only when every one was computed in one run. Files are safetensors
(fp32, exact) with a JSON of their sha256s, written into a temporary folder and moved into place in one step; an
entry that fails its check is not used (and is replaced by the next complete run).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from kvdiag.core.io import file_sha256

GoldenRun = tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]  # prefix[l] = (k, v) [Hkv, t, d]; logp [H, V]


class GoldenStore:
    """The stored golden runs under ``root`` for one ``key`` (a JSON-able dict of everything they depend on)."""

    def __init__(self, root: str | os.PathLike, key: dict):
        self.root, self.key = Path(root), key

    def _folder(self, pid: str) -> Path:
        return self.root / hashlib.sha256(pid.encode()).hexdigest()[:24]  # a prompt id need not be a file name

    def load(self, pid: str, ts: list[int]) -> dict[int, GoldenRun] | None:
        """Checkpoint -> (prefix, logp_full) of every one of ``ts``, or None unless all are stored and verified."""
        from safetensors.torch import load_file

        folder = self._folder(pid)
        try:
            entry = json.loads((folder / "entry.json").read_text())
            if entry["key"] != self.key or entry["prompt_id"] != pid or not set(ts) <= set(map(int, entry["files"])):
                return None
            runs = {}
            for t in ts:
                file = entry["files"][str(t)]
                if file_sha256(folder / file["name"]) != file["sha256"]:
                    return None
                tensors = load_file(folder / file["name"])
                layers = len([k for k in tensors if k.startswith("k.")])
                runs[t] = ([(tensors[f"k.{l}"], tensors[f"v.{l}"]) for l in range(layers)], tensors["logp"])
            return runs
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def writer(self, pid: str) -> GoldenWriter:
        return GoldenWriter(self, pid)


class GoldenWriter:
    """Collects one prompt's golden runs as they are computed (each written at once: a prompt's runs together would
    hold every checkpoint's prefix in memory) and places the entry with :meth:`commit`."""

    def __init__(self, store: GoldenStore, pid: str):
        self.store, self.pid, self.files = store, pid, {}
        store.root.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=store.root, prefix=".golden.", suffix=".tmp"))

    def add(self, t: int, run: GoldenRun) -> None:
        from safetensors.torch import save_file

        prefix, logp = run
        name = f"t{t:07d}.safetensors"
        tensors = {f"{kv}.{l}": x.contiguous() for l, pair in enumerate(prefix) for kv, x in zip("kv", pair,
                                                                                                 strict=True)}
        save_file({**tensors, "logp": logp.contiguous()}, str(self.tmp / name))
        self.files[str(t)] = {"name": name, "sha256": file_sha256(self.tmp / name)}

    def commit(self) -> None:
        """Place the entry (replacing an older one); a failure leaves the store as it was."""
        try:
            (self.tmp / "entry.json").write_text(json.dumps({"key": self.store.key, "prompt_id": self.pid,
                                                             "files": self.files}, sort_keys=True))
            folder = self.store._folder(self.pid)
            if folder.exists():
                gone = folder.with_name(f".{folder.name}.{os.getpid()}.old")
                os.replace(folder, gone)
                shutil.rmtree(gone, ignore_errors=True)
            os.replace(self.tmp, folder)
        except OSError:
            pass  # a concurrent run placed its (equal) entry: ours is dropped, theirs is checked when read
        finally:
            self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
