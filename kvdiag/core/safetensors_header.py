"""A safetensors file told from its header alone, without torch: the tensors' shapes, and whether the file is whole.
The CLI checks a Trace's layer files and a LoRA adapter's weights with these before any heavy import."""

from __future__ import annotations

import json
import os
from pathlib import Path


def safetensors_shapes(file: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header (8-byte little-endian length, then JSON): no torch."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size)) if 0 < size <= 100_000_000 else None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors header")
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def safetensors_fault(path: str | os.PathLike) -> str | None:
    """What makes the safetensors file ``path`` unreadable, told from its header alone (8 bytes of little-endian
    header length, the JSON header, then the data, whose size must equal the largest ``data_offsets`` end, as
    safetensors itself requires); None when the header is whole and fits the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes: shorter than the 8-byte header length"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"its header claims {n} bytes, the file holds {size - 8} after the length"
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"its header is not JSON ({err})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    try:
        end = max([int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"] + [0])
    except (TypeError, KeyError, IndexError, ValueError):
        return "its header lacks data_offsets"
    if end != size - 8 - n:
        return f"its header places data up to byte {end}, the file holds {size - 8 - n}"
    return None
