"""FullKV greedy accuracy of a builtin suite on SmolLM2 through kvdiag's own decode path (``decode_batch`` without a
policy: FullKV), graded by the suite's components, each with its Wilson 95 % CI.

Usage: ``python reports/suites-fullkv/measure.py builtin:keys:20 400 [MODEL]`` (source, --max-new-tokens, the model
spec: default smollm2; ``smollm2+data/adapters/smollm2-countdown`` for the adapted model).
"""

import sys
import time
from collections import defaultdict

import torch

from kvdiag.core.stats import wilson
from kvdiag.model.load import load_model
from kvdiag.replay.decoding import decode_batch
from kvdiag.tasks.prompts import encode_prompt, load_prompts
from kvdiag.tasks.suites import check_generation_room, grade, suite_of


def main(argv: list[str] | None = None) -> None:
    """Decode ``builtin:<suite>:N`` at FullKV and print each prompt's verdicts and the per-component rates."""
    args = argv or sys.argv[1:]
    source, max_new, model = args[0], int(args[1]), args[2] if len(args) > 2 else "smollm2"
    torch.set_num_threads(2)
    suite, prompts = suite_of(source), load_prompts(source)
    check_generation_room(prompts, max_new, source)
    lm = load_model(model)
    groups = defaultdict(list)  # decode_batch takes prompts of one length
    for p in prompts:
        ids = encode_prompt(lm.tokenizer, p)
        groups[len(ids)].append((p, ids))
    verdicts, start = [], time.time()
    for _, rows in sorted(groups.items()):
        runs = decode_batch(lm, [ids for _, ids in rows], [None] * len(rows), max_new, [p.prompt_id for p, _ in rows])
        for (p, ids), run in zip(rows, runs, strict=True):
            text = lm.tokenizer.decode(run.token_ids[run.prompt_len :], skip_special_tokens=True)
            v = grade(suite, text, p.answer)
            verdicts.append(v)
            print(p.prompt_id, len(ids), run.generated, run.stop, v, flush=True)
            if not v[suite.task.name]:
                print("   got last:", text.strip().splitlines()[-1:], "want:", p.answer.splitlines()[-1])
    print(f"{source} on {model}: {len(prompts)} prompts, {time.time() - start:.0f}s")
    for c in suite.components:
        k, n = sum(v[c.name] for v in verdicts), len(verdicts)
        lo, hi = wilson(k, n)
        print(f"  {c.name} ({c.role}): {k}/{n} = {100 * k / n:.0f} % [{100 * lo:.0f}, {100 * hi:.0f}]")


if __name__ == "__main__":
    main()
