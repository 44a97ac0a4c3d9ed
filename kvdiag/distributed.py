"""Splitting work items over processes: torchrun (torch.distributed) or a Slurm-style ``--shard i/n``.

Under ``torchrun`` every rank labels the items ``i`` with ``i % world_size == rank`` on its own device
(``cuda:LOCAL_RANK``, or the CPU with the gloo backend), each item written as its own Parquet part;
after a barrier rank 0 merges. A rerun redoes only missing items.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from kvdiag.errors import UserError


def dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) outside torchrun."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    if spec is None:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", spec)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise UserError(f"--shard {spec}: use i/n with 0 <= i < n (e.g. $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)")
    return int(m.group(1)), int(m.group(2))


class Group:
    """A torch.distributed process group for the duration of a run (a no-op for one process)."""

    def __init__(self, device: str):
        self.rank, self.world, self.local_rank = dist_env()
        self.device = device
        if self.world > 1 and device.startswith("cuda"):
            self.device = f"cuda:{self.local_rank}"
            torch.cuda.set_device(self.local_rank)

    def __enter__(self):
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if self.device.startswith("cuda") else "gloo")
        return self

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def __exit__(self, *exc):
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_label(trace_dir: Path, out: Path, cfg, *, model: str | None, force: bool, dtype: str | None, device: str,
              shard: str | None, quiet: bool) -> Path | None:
    """Label a Trace in this process's share of the work; returns the merged output where this process merged."""
    from kvdiag.label.runner import label_trace
    from kvdiag.models import load_model
    from kvdiag.trace import Trace

    tr = Trace(trace_dir)
    sh = parse_shard(shard)
    with Group(device) as group:
        if sh is not None and group.world > 1:
            raise UserError("--shard and torchrun split the work two ways; use one of them")
        spec = model or tr.manifest["model"]["spec"]
        lm = load_model(spec, dtype=dtype or tr.manifest["model"]["dtype"], device=group.device)
        if group.world > 1:
            label_trace(tr, lm, out, cfg, shard=(group.rank, group.world), merge=False, force_model=force,
                        show_progress=not quiet and group.rank == 0)
            group.barrier()
            return label_trace(tr, lm, out, cfg, shard=(0, 1), merge=True, force_model=force, show_progress=False) if group.rank == 0 else None
        return label_trace(tr, lm, out, cfg, shard=sh or (0, 1), merge=sh is None, force_model=force, show_progress=not quiet)
