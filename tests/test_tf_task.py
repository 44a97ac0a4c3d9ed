"""Teacher-forced replay of a builtin suite: the top-1 agreement with the full cache, the needed columns from the
policy's kept positions, and the teacher-forced task success (``tf_task``) with its table."""

import polars as pl
import pytest
import torch

from kvdiag.replay.decoding import Decoded, full_logprobs, teacher_force
from kvdiag.replay.run import ReplaySettings, build_policies, replay
from kvdiag.replay.teacher_forced import suite_columns
from kvdiag.replay.tf_task import tf_task_table
from kvdiag.replay.units import Item
from kvdiag.tasks.needed import final_line_positions, needed_texts
from kvdiag.tasks.prompts import encode_prompt, load_prompts
from kvdiag.tasks.suites import keys_prompts

SOURCE = "builtin:keys:2:3"


def _expected(tokenizer, p):
    """The prompt and its expected generation as if the model wrote it: ids, prompt length, Item."""
    ids = encode_prompt(tokenizer, p, chat=False, instruction=None)
    answer = tokenizer(p.answer, add_special_tokens=False).input_ids
    return ids + answer, len(ids), Item(p.prompt_id, ids + answer, len(ids), p.answer, needed=tuple(needed_texts(p)))


def test_final_line_positions_are_the_last_copy(tiny_llama):
    tok = tiny_llama.tokenizer
    for p in keys_prompts(2, 3, 5):
        ids, P, _ = _expected(tok, p)
        at = final_line_positions(tok, ids, P, needed_texts(p))
        assert tok.decode([ids[i] for i in at]).strip() == needed_texts(p)[0]
        assert at[0] > P + len(ids[P:]) // 2  # the final line's copy, not the first line's
        assert final_line_positions(tok, ids[:-12], P, needed_texts(p)) is None  # the final line cut short


def test_tf_task_needs_agreement_at_every_final_needed_token(tiny_llama):
    """True when the policy's top-1 is the full cache's at every token of the final line's needed text; one miss
    there makes it False; misses elsewhere (the first line's copy, the count) do not; None without the answer."""
    tok = tiny_llama.tokenizer
    p = keys_prompts(1, 3, 5)[0]
    ids, P, item = _expected(tok, p)
    at = final_line_positions(tok, ids, P, list(item.needed))
    kept = [(P + 10, torch.arange(P + 10).expand(2, 2, -1))]  # [L=2, Hkv=2, n]: every position held

    def verdict(top1):
        run = Decoded(ids, P, "teacher_forced", kept=kept)
        suite_columns(tok, item, run, top1)
        return run.needed["tf_task"], run

    top1 = torch.ones(len(ids) - P, dtype=torch.bool)
    ok, run = verdict(top1)
    assert ok is True and run.slots == 4 and run.needed["kept_steps"] == [P + 10]
    assert run.needed["tf_needed_agree"] == 1.0
    assert all(s == [1.0] for s, w in zip(run.needed["needed_kept"], run.needed["needed_where"], strict=True)
               if w == "prompt")
    early = top1.clone()
    early[: at[0] - P - 5] = False  # the first line's copy and most of the count
    assert verdict(early)[0] is True
    miss = top1.clone()
    miss[at[len(at) // 2] - P] = False
    ok, run = verdict(miss)
    assert ok is False and run.needed["tf_needed_agree"] == pytest.approx((len(at) - 1) / len(at))
    cut = Item(item.prompt_id, ids[:-12], P, p.answer, needed=item.needed)
    run = Decoded(ids[:-12], P, "teacher_forced", kept=kept)
    suite_columns(tok, cut, run, top1[:-12])
    assert run.needed["tf_task"] is None and run.needed["tf_needed_agree"] is None


def test_teacher_forced_suite_rows(tiny_llama, tmp_path):
    """A Trace of a builtin suite replayed teacher-forced: ``top1_agree`` equals the argmax comparison of the
    policy's and the full cache's log-probs from the same functions (same shapes, same path: compared exactly), the
    prompt's needed positions are found, and ``needed_kept`` is the bincount of the policy's kept positions."""
    from kvdiag.tasks.needed import prompt_positions
    from kvdiag.trace import GenerationSettings, Trace, trace_prompts

    prompts = load_prompts(SOURCE)
    trace_prompts(tiny_llama, prompts, tmp_path / "t", GenerationSettings(max_new_tokens=90, chat=False,
                  instruction=None), prompts_source=SOURCE, show_progress=False)
    trace = Trace(tmp_path / "t")
    settings = ReplaySettings(scorers=["snapkv"], budgets=[64], interval=32, horizon=4, joint=False)
    out = replay(tiny_llama, tmp_path / "r", settings, trace=trace, show_progress=False)
    df = pl.read_parquet(out / "generations.parquet")
    policy = build_policies(tiny_llama, settings)[("snapkv", 64)]
    slots = tiny_llama.attention.num_layers * tiny_llama.attention.num_kv_heads
    for p in prompts:
        r = df.filter(pl.col("prompt_id") == p.prompt_id).row(0, named=True)
        ids, P = trace.token_ids(p.prompt_id).tolist(), trace.prompt_len(p.prompt_id)
        run = teacher_force(tiny_llama, ids, P, policy, p.prompt_id, keep_history=True, joint=False)
        want = (run.logprobs.argmax(-1) == full_logprobs(tiny_llama.model, ids, P).argmax(-1)).tolist()
        assert r["top1_agree"] == want and len(want) == len(ids) - P and not all(want)
        needs = prompt_positions(tiny_llama.tokenizer, p, chat=False, instruction=None)
        assert needs and r["needed_positions"][: len(needs)] == needs
        assert r["kept_steps"] == [t for t, _ in run.kept]
        assert r["needed_kept"][0] == [sum(needs[0] in pos[i, h].tolist() for i in range(pos.shape[0])
                                           for h in range(pos.shape[1])) / slots if needs[0] < t else None
                                      for t, pos in run.kept]
        assert any(s is not None for s in r["needed_kept"][0])
        assert r["tf_task"] is None  # a random model does not write the codes


def test_tf_task_table_counts_and_tests():
    """Per (policy, budget): successes of the compressed sequences with a verdict (the rest apart), Wilson CI, the
    budget's best and McNemar's exact p on the shared sequences (a: 6/6, b: 0/6 -> p = 2 * 0.5^6)."""
    rows = []
    for i in range(6):
        rows += [{"prompt_id": f"p{i}", "scorer": "a", "budget": 64, "compressions": 2, "tf_task": True,
                  "top1_agree": [True, True], "tf_needed_agree": 1.0},
                 {"prompt_id": f"p{i}", "scorer": "b", "budget": 64, "compressions": 2, "tf_task": False,
                  "top1_agree": [True, False], "tf_needed_agree": 0.25}]
    rows += [{"prompt_id": "p6", "scorer": "a", "budget": 64, "compressions": 0, "tf_task": True,
              "top1_agree": [True], "tf_needed_agree": 1.0},
             {"prompt_id": "p7", "scorer": "b", "budget": 64, "compressions": 2, "tf_task": None,
              "top1_agree": [True], "tf_needed_agree": None}]
    t = tf_task_table(pl.DataFrame(rows)).sort("scorer")
    assert t["success"].to_list() == [6, 0] and t["n"].to_list() == [6, 6] and t["apart"].to_list() == [1, 1]
    assert t["best"].to_list() == ["a", "a"] and t["top1_agree"].to_list() == [1.0, 0.5]
    assert t["needed_agree"].to_list() == [1.0, 0.25]
    assert t["p_vs_best"][1] == pytest.approx(2 * 0.5**6) and t["p_vs_best"][0] is None
    assert t["lo"][0] > 0.5 and t["hi"][1] < 0.5
