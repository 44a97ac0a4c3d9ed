"""Splitting work items over processes: torchrun (torch.distributed) or a Slurm-style ``--shard i/n``.

Under ``torchrun`` every rank does the items ``i`` with ``i % world_size == rank`` on its own device
(``cuda:LOCAL_RANK``, or the CPU), each item written as its own part; after a barrier rank 0 merges.
A rerun redoes only missing items. ``kvdiag label`` splits (prompt, checkpoint) items, ``kvdiag trace``
prompts (``kvdiag.label.run.label_files``, ``kvdiag.trace.writer.trace_files``). With ``--shard i/n`` (no torchrun) a
process does its share without merging; a later run
without ``--shard`` merges (and does whatever is still missing).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import parse_shard  # noqa: F401  (its home until the CLI checked it before torch)

# Ranks only wait for each other at the end (the barrier before rank 0 merges), so the wait is the gap
# between the fastest and the slowest share; torch's default (30 min) would end long unbalanced runs.
# A rank that dies makes torchrun stop the others; this bounds the wait only if a whole host vanishes.
BARRIER_TIMEOUT = timedelta(hours=24)

R = TypeVar("R")


def dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) outside torchrun."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


class Group:
    """A torch.distributed process group for the duration of a run (a no-op for one process), and how
    the work is split: torchrun's ranks, else ``shard`` (i, n), else all of it.

    The group only synchronizes (one barrier) and moves no tensors, so it is gloo on every device:
    no NCCL set-up, and the same code path on CPU (tests) as on GPUs."""

    def __init__(self, device: str, shard: tuple[int, int] | None = None):
        self.rank, self.world, self.local_rank = dist_env()
        if shard is not None and self.world > 1:
            raise UserError("--shard and torchrun split the work two ways; use one of them")
        self.device, self.shard = device, shard
        if self.world > 1 and device.startswith("cuda"):
            self.device = f"cuda:{self.local_rank}"
            torch.cuda.set_device(self.local_rank)

    def __enter__(self):
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
        return self

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def __exit__(self, *exc):
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def split(self, work: Callable[[tuple[int, int], bool, bool], R]) -> R | None:
        """Run ``work(shard, merge, show_progress)`` on this process's share. Under torchrun each rank does
        its share without merging, then rank 0 merges once every rank is done. Returns ``work``'s result
        where this process merged, else None."""
        if self.world == 1:
            result = work(self.shard or (0, 1), self.shard is None, True)
            return result if self.shard is None else None
        work((self.rank, self.world), False, self.rank == 0)
        self.barrier()
        # rank 0 sees every part by now; the merging call finds nothing left to do but the merge
        return work((0, 1), True, False) if self.rank == 0 else None
