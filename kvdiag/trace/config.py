"""``GenerationSettings``: how ``kvdiag trace`` generates, checked without torch (bad input is refused before any
heavy import)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import STORAGE_DTYPE_NAMES, parse_store
from kvdiag.tasks.prompts import DEFAULT_INSTRUCTION


@dataclass
class GenerationSettings:
    """How the traces are generated. logprob/entropy in tokens.parquet are always of the raw (T=1) distribution."""

    max_new_tokens: int = 512
    sample: bool = False
    temperature: float = 0.6  # R1-distill recommended sampling settings, used only with sample=True
    top_p: float = 0.95
    seed: int = 0
    chat: bool = True
    instruction: str | None = DEFAULT_INSTRUCTION
    storage_dtype: str = "float16"
    min_new_tokens: int = 0  # end-of-sequence is not sampled before this many tokens (a long trace from a small model)
    store: str = "all"  # which tensors are written (all | kv | none | LAYERS); the rest are rebuilt on demand

    def __post_init__(self):  # bad input is refused before a model loads
        if self.max_new_tokens <= 0:
            raise UserError(f"--max-new-tokens {self.max_new_tokens}: must be a positive number of tokens")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise UserError(f"--min-new-tokens {self.min_new_tokens}: must lie in [0, --max-new-tokens "
                            f"{self.max_new_tokens}]")
        if not 0 < self.temperature < float("inf"):
            raise UserError(f"--temperature {self.temperature}: must be > 0 and finite (greedy decoding is --greedy)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p}: must lie in (0, 1]")
        if self.storage_dtype not in STORAGE_DTYPE_NAMES:
            raise UserError(f"--storage-dtype {self.storage_dtype}: use one of {', '.join(STORAGE_DTYPE_NAMES)}")
        parse_store(self.store)
