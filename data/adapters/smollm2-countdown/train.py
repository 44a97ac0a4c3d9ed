"""Train the LoRA adapter ``data/adapters/smollm2-countdown`` (issue #43): SmolLM2-135M-Instruct taught to carry out
``builtin:countdown`` (count down by one for LENGTH numbered steps, then write the start again).

Seeded and CPU-only: ``torch.manual_seed(SEED)``, examples from ``kvdiag.suites.countdown_prompts`` with seeds
``DATA_SEED + step`` (the evaluation uses seed 0, so no example is an evaluation prompt; starts do overlap, being
drawn from 50 values per LENGTH, which is fine: the skill is the counting, not a start). Each example is rendered
exactly as replay renders a prompt (``kvdiag.prompts.encode_prompt``: the chat template with the worked shots as
earlier turns) followed by its answer and ``<|im_end|>``; the loss is on assistant tokens only (the answer and the
shots' answers, all written in the suite's format). LENGTH is drawn from 10..40 and 0, 1 or 2 shots are kept, to make
examples cheaper; the evaluation is the suite as shipped (2 shots, LENGTH 40).

Run from the repository root: ``OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python data/adapters/smollm2-countdown/train.py
[STEPS]``. Writes adapter_config.json, adapter_model.safetensors and loss.json beside this file.
"""

import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvdiag.embedded import embedded_dir
from kvdiag.prompts import chat_turns, encode_prompt
from kvdiag.suites import countdown_prompts

OUT = Path(__file__).parent
SEED = 0  # torch (LoRA init) and the example mix
DATA_SEED = 1000  # countdown_prompts seeds DATA_SEED + step: disjoint from the evaluation's seed 0
STEPS = 120  # one example per step (sized to the 2-core budget: ~7 s a step, see README.md)
LR = 1e-3
LENGTHS = range(10, 41)
SHOT_WEIGHTS = (0.25, 0.25, 0.5)  # P(0, 1, 2 shots kept)
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def example(tok, step: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T], labels [T]) of one training example: labels -100 outside the assistant turns."""
    length = rng.choice(LENGTHS)
    shots = rng.choices(range(3), SHOT_WEIGHTS)[0]
    p = countdown_prompts(1, seed=DATA_SEED + step, length=length)[0]
    p = dataclasses.replace(p, shots=p.shots[:shots])
    prompt_ids = encode_prompt(tok, p)
    turns = [*chat_turns(p), {"role": "assistant", "content": p.answer}]
    text = tok.apply_chat_template(turns, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc.input_ids
    # replay's prompt is a prefix of the full chat: the model learns the very rendering it is evaluated on
    assert ids[: len(prompt_ids)] == prompt_ids, "chat rendering differs from encode_prompt's"
    head, end = "<|im_start|>assistant\n", "<|im_end|>"
    spans, at = [], text.find(head)
    while at >= 0:
        s = at + len(head)
        e = text.index(end, s) + len(end)
        spans.append((s, e))
        at = text.find(head, e)
    labels = [t if any(s <= a < e for s, e in spans) else -100
              for t, (a, _) in zip(ids, enc.offset_mapping, strict=True)]
    return torch.tensor(ids), torch.tensor(labels)


def main(argv: list[str]) -> None:
    steps = int(argv[0]) if argv else STEPS
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    rng = random.Random(SEED)
    path = embedded_dir("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * (1 - s / steps))
    model.train()
    log, start = [], time.time()
    for step in range(steps):
        ids, labels = example(tok, step, rng)
        loss = model(input_ids=ids[None], labels=labels[None]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        log.append({"step": step, "loss": round(loss.item(), 5), "tokens": len(ids),
                    "answer_tokens": int((labels != -100).sum()), "seconds": round(time.time() - start, 1)})
        print(json.dumps(log[-1]), flush=True)
    model.save_pretrained(OUT, safe_serialization=True)
    (OUT / "loss.json").write_text(json.dumps({
        "seed": SEED, "data_seed": DATA_SEED, "steps": steps, "lr": LR, "lora": LORA,
        "lengths": [LENGTHS.start, LENGTHS.stop - 1], "shot_weights": SHOT_WEIGHTS,
        "torch_threads": 1, "wall_seconds": round(time.time() - start, 1), "log": log}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
