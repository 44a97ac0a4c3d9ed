"""#58: EvictingCache on a left-padded batch of 8 against the same 8 rows unpadded (every prompt at the longest one's
length, 96 tokens): tokens/s of model.generate (SmolLM2, rkv, budget 48, interval 16, prefill once, 48 new tokens
each), best of 3 alternating runs in one process. Output: reports/bench/evicting-padded.txt.

    .venv/bin/python reports/bench/evicting_padded.py
"""

import time

import torch

from kvdiag.generate import EvictingCache
from kvdiag.model.load import load_model


def main() -> None:
    torch.manual_seed(0)
    lm = load_model("smollm2")
    m = lm.model
    L, N, NEW = 96, 8, 48
    lengths = [96, 90, 84, 78, 72, 66, 60, 54]
    base = torch.randint(100, 20000, (N, L))
    pad_id = 0
    padded, mask = base.clone(), torch.ones_like(base)
    for i, n in enumerate(lengths):  # row i: L - n padding tokens on the left, masked out
        padded[i, : L - n] = pad_id
        mask[i, : L - n] = 0

    def run(ids, attn):
        cache = EvictingCache(m, "rkv", budget=48, interval=16, prefill="once")
        t0 = time.perf_counter()
        out = m.generate(ids, attention_mask=attn, cache=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         pad_token_id=pad_id)
        return time.perf_counter() - t0, out.shape[1] - ids.shape[1]

    best = {"padded": 1e9, "unpadded": 1e9}
    for _ in range(3):
        for name, (ids, attn) in {"padded": (padded, mask), "unpadded": (base, torch.ones_like(base))}.items():
            s, _ = run(ids, attn)
            best[name] = min(best[name], s)
    tps = {k: N * NEW / v for k, v in best.items()}
    print({k: f"{v:.1f} tok/s" for k, v in tps.items()}, f"ratio padded/unpadded {tps['padded'] / tps['unpadded']:.3f}")


if __name__ == "__main__":
    main()
