"""Trains the LoRA adapter ``data/adapters/smollm2-countdown`` (SmolLM2-135M-Instruct + LoRA) on seeded
``builtin:countdown`` prompts, so that the model counts down without a slip (issue #43: the base model gets 9/20).

Usage (from the repository root): ``.venv/bin/python data/adapters/smollm2-countdown/train.py [--minutes 40]``.
Deterministic given the seed and the thread count (``torch.set_num_threads``); the wall-clock limit only decides how
many of the seeded examples are used (the log records how many).

Data: ``countdown_prompts(1, seed)`` for seeds ``SEED_OFFSET + i`` (the reports use seed 0, whose prompts are never
drawn here; starts overlap, since a LENGTH-40 start is one of 50 values: the task is a procedure, not a lookup).
Each example is the prompt exactly as replay formats it (``kvdiag.tasks.prompts.encode_prompt``: the chat template with
the two worked-example shots) followed by its expected answer and the end of turn; the loss is on every assistant
turn's tokens (the shots' answers are correct countdowns too). LENGTH is drawn from 10..40 to make examples cheaper.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from kvdiag.model.load import load_model
from kvdiag.tasks.prompts import chat_turns
from kvdiag.tasks.suites import countdown_prompts

HERE = Path(__file__).parent
SEED = 0
SEED_OFFSET = 1_000_000  # data seeds: disjoint from the reports' seed 0
RANK, ALPHA, DROPOUT = 8, 16, 0.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
LR, ACCUM, WARMUP = 1e-3, 4, 10
LENGTHS = (10, 40)


def example(tokenizer, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids [T], labels [T]: -100 outside the assistant turns) of training example ``i``."""
    rng = random.Random(SEED_OFFSET + i)
    prompt = countdown_prompts(1, SEED_OFFSET + i, rng.randint(*LENGTHS))[0]
    turns = [*chat_turns(prompt), {"role": "assistant", "content": prompt.answer}]
    ids, labels = [], []
    for k in range(len(turns)):  # tokens added by turn k: labelled when it is an assistant turn
        text = tokenizer.apply_chat_template(turns[: k + 1], tokenize=False)
        new = tokenizer(text, add_special_tokens=False).input_ids[len(ids):]
        ids += new
        labels += new if turns[k]["role"] == "assistant" else [-100] * len(new)
    return torch.tensor(ids), torch.tensor(labels)


def shrink(out: Path) -> None:
    """Store the adapter's weights in fp16 (half the size: under the 5 MB the issue allows; loading casts them to
    the model's dtype) and name the base by kvdiag's spec instead of this machine's cache path."""
    weights = out / "adapter_model.safetensors"
    save_file({k: v.half().contiguous() for k, v in load_file(weights).items()}, weights)
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "smollm2"
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)  # peft's model-card template; the provenance is PROVENANCE.md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="wall-clock limit: stops early (the log says so)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-examples", type=int, default=200, help="examples to train on (deterministic)")
    args = ap.parse_args()
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    lm = load_model("smollm2")
    model = get_peft_model(lm.model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=DROPOUT,
                                                target_modules=TARGETS, task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    log, start, step = [], time.time(), 0
    for i in range(args.max_examples):
        if time.time() - start > 60 * args.minutes:
            break
        ids, labels = example(lm.tokenizer, i)
        loss = model(input_ids=ids[None], labels=labels[None]).loss
        (loss / ACCUM).backward()
        log.append({"example": i, "tokens": len(ids), "loss": round(loss.item(), 5),
                    "seconds": round(time.time() - start, 1)})
        if (i + 1) % ACCUM == 0:
            step += 1
            for g in opt.param_groups:  # linear warm-up, then constant
                g["lr"] = LR * min(1.0, step / WARMUP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            print(f"step {step} example {i + 1} loss {sum(r['loss'] for r in log[-ACCUM:]) / ACCUM:.4f} "
                  f"{time.time() - start:.0f}s", flush=True)
    model.save_pretrained(HERE, safe_serialization=True)
    shrink(HERE)
    meta = {"seed": SEED, "seed_offset": SEED_OFFSET, "rank": RANK, "alpha": ALPHA, "targets": TARGETS, "lr": LR,
            "accumulation": ACCUM, "warmup_steps": WARMUP, "lengths": LENGTHS, "threads": args.threads,
            "examples": len(log), "optimizer_steps": step, "minutes": round((time.time() - start) / 60, 1),
            "torch": torch.__version__, "log": log}
    (HERE / "train_log.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
