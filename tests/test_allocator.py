"""reuse_freed_memory keeps freed large blocks for reuse instead of page-faulting fresh ones."""

from __future__ import annotations

import subprocess
import sys

import pytest

# a forward-like loop of large activations (18-54 MiB each); the fewest page faults of a round once the
# heap has settled (rounds 3-6)
_CHILD = """
import resource, sys
import torch
from kvdiag.core.allocator import reuse_freed_memory
applied = reuse_freed_memory() if sys.argv[1] == "on" else None
w = torch.randn(576, 1536)
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.randn(8192, 576)
    for _ in range(2):
        h = x @ w
        x = x + (torch.nn.functional.silu(h) * h) @ w.T
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, min(faults[2:]))
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_steady_state_reuses_freed_blocks():
    applied, faults = _faults("on")
    if applied != "True":
        pytest.skip("not glibc: reuse_freed_memory is a no-op here")
    _, faults_default = _faults("off")  # glibc's default unmaps or trims these blocks and faults them back in
    assert faults < 2000 and faults * 20 < faults_default, (faults, faults_default)
