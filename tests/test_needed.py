"""The tokens an answer needs (kvdiag.tasks.needed) and what each compaction kept of them: positions that decode to the
needed text, and kept counts recorded in ``generate`` equal to those recounted from the loop's kept positions."""

import pytest
import torch

from kvdiag.generate import Policy
from kvdiag.generate.live import make_scorer
from kvdiag.model.load import load_model
from kvdiag.replay.decoding import decode_batch
from kvdiag.replay.generating import generate_batch
from kvdiag.tasks.needed import final_line_start, generated_positions, needed_texts, prompt_positions, slot_shares
from kvdiag.tasks.prompts import encode_prompt
from kvdiag.tasks.suites import countdown_prompts, keys_prompts, recall_prompts
from tests.conftest import needs_smollm2

PROMPTS = [*recall_prompts(2, 3, 5), *keys_prompts(2, 4, 6), *countdown_prompts(2, 5, 7)]


def _check_positions(tokenizer, chat: bool) -> None:
    for p in PROMPTS:
        ids = encode_prompt(tokenizer, p, chat=chat)
        at = prompt_positions(tokenizer, p, chat=chat)
        needed = p.text[p.needs[0][0] : p.needs[0][1]]
        assert at == list(range(at[0], at[-1] + 1))  # one contiguous run, in the final user turn
        # in the question's own turn, the last one (the shots before it hold the same kind of text)
        assert at[0] >= len(ids) - len(tokenizer(p.text, add_special_tokens=False).input_ids) - 8
        assert tokenizer.decode([ids[i] for i in at]).strip() == needed
        # the expected generation as if written: its needed text found where the answer first writes it
        answer = tokenizer(p.answer, add_special_tokens=False).input_ids
        got = generated_positions(tokenizer, ids + answer, len(ids), needed_texts(p)[0])
        assert tokenizer.decode([(ids + answer)[i] for i in got]).strip() == needed_texts(p)[0]
        assert got[0] - len(ids) < 12  # the copy in the first line, not the one in the last
        last = final_line_start(tokenizer, ids + answer, len(ids))
        assert tokenizer.decode((ids + answer)[last:]).strip() == p.answer.splitlines()[-1]


def test_positions_decode_to_the_needed_text_tiny(tiny_llama):
    _check_positions(tiny_llama.tokenizer, chat=False)


@needs_smollm2
def test_positions_decode_to_the_needed_text_smollm2():
    _check_positions(load_model("smollm2").tokenizer, chat=True)


def test_not_written_means_no_positions(tiny_llama):
    ids = tiny_llama.tokenizer("Codes: none here\n1. 1", add_special_tokens=False).input_ids
    assert generated_positions(tiny_llama.tokenizer, [5, 6, *ids], 2, "apple 1234") == []


def test_slot_shares():
    kept = [(4, [2, 0, 1, 2]), (6, [2, 0, 0, 1, 2, 2])]
    assert slot_shares(kept, 2, [2, 4]) == [[0.5, 0.0], [None, 1.0]]


def test_recorded_counts_equal_the_loop_kept_positions(tiny_llama):
    """generate's kept counts per compaction == the bincount of the loop's kept positions [L, Hkv, B] (the same
    decisions: tests/test_replay_generate); every slot holds ``budget`` entries; a budget above the sequence never
    compacts and records nothing."""
    prompts = [list(range(5, 45)), list(range(7, 47))]
    pols = [Policy(make_scorer("snapkv", w_obs=4), 24, 8), Policy(make_scorer("streamingllm"), 24, 8)]
    loop = decode_batch(tiny_llama, prompts, pols, 30, ["a", "b"], keep_history=True)
    gen = generate_batch(tiny_llama, prompts, pols, 30, ["a", "b"], record_kept=True)
    for lp, g in zip(loop, gen, strict=True):
        assert g.token_ids == lp.token_ids
        assert [t for t, _ in g.kept_counts] == [t for t, _ in lp.kept] and g.kept_counts
        slots = tiny_llama.attention.num_layers * tiny_llama.attention.num_kv_heads
        assert g.slots == slots
        for (t, counts), (_, positions) in zip(g.kept_counts, lp.kept, strict=True):
            assert torch.equal(counts.long(), torch.bincount(positions.reshape(-1), minlength=t)[:t])
            assert int(counts.sum()) == slots * 24
    roomy = generate_batch(tiny_llama, prompts, [Policy(make_scorer("snapkv", w_obs=4), 200, 8)] * 2, 30, ["a", "b"],
                           record_kept=True)
    assert all(r.kept_counts == [] for r in roomy)


@pytest.mark.parametrize("make", [recall_prompts, keys_prompts, countdown_prompts])
def test_every_suite_prompt_has_needs(make):
    p = make(1, 0)[0]
    assert p.needs and needed_texts(p) and needed_texts(p)[0] in p.answer


def test_needed_rows_read_the_compaction_before_the_final_line():
    """The shares at the last compaction at or before the final line; a token written after it counts as held; kept
    when one copy is held whole (>= KEPT_SHARE in every token); success against kept in the summary."""
    import polars as pl

    from kvdiag.replay.kept_needed import needed_rows, needed_summary
    from kvdiag.tasks.suites import SUITES

    p = recall_prompts(1, 0)[0]
    base = {"prompt_id": p.prompt_id, "sample": 0, "budget": 64, "compressions": 3, "answer": p.answer,
            "needed_where": ["prompt", "prompt", "answer"], "needed_positions": [10, 11, 50],
            "kept_steps": [40, 60, 100], "final_line_at": 90}
    rows = pl.DataFrame([
        # at t=60: prompt copy half lost, own copy held (0.5 >= 0.5): kept; the right answer
        {**base, "scorer": "a", "text": p.answer, "needed_kept": [[1.0, 1.0, 0.0], [1.0, 0.25, 0.0],
                                                                      [None, 0.5, 0.0]]},
        # at t=60 nothing kept; written after? no: own copy at 50 < 60 lost; a wrong answer
        {**base, "scorer": "b", "text": "nope", "needed_kept": [[1.0, 0.0, 1.0], [1.0, 0.0, 1.0], [None, 0.0, 1.0]]},
        {**base, "scorer": "c", "text": p.answer, "kept_steps": [40, 95, 100], "final_line_at": 45,
         "needed_kept": [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [None, 0.0, 0.0]]},  # own copy written after t=40: held
    ])
    got = needed_rows(rows, SUITES["recall"]).sort("scorer")
    assert got["kept_prompt"].to_list() == [0.625, 0.0, 1.0]
    assert got["kept_answer"].to_list() == [0.5, 0.0, 1.0]
    assert got["kept"].to_list() == [True, False, True] and got["success"].to_list() == [True, False, True]
    assert needed_rows(rows, SUITES["recall"], share=0.6).sort("scorer")["kept"].to_list() == [False, False, True]
    pooled = needed_summary(got, n_boot=50).filter(pl.col("scorer") == "all rules").row(0, named=True)
    assert (pooled["kept_success"], pooled["kept_n"], pooled["lost_success"], pooled["lost_n"]) == (2, 2, 0, 1)
    # no pooled test (one prompt's rules are not independent); each rule's one generation cannot vary: no family
    assert pooled["fisher_p"] is None and pooled["holm_p"] is None and pooled["rules_tested"] == 0


def test_needed_summary_tests_each_rule_and_holm_adjusts_the_budget():
    """Per rule (one generation per prompt) Fisher's exact test of success against kept, Holm over the rules of a
    budget; a rule whose table cannot vary (no success) or with two generations of a prompt is not tested and not
    counted in the family; the pooled row has counts, no Fisher p, and the family's smallest Holm p."""
    import polars as pl
    from scipy.stats import fisher_exact

    from kvdiag.core.stats import holm
    from kvdiag.replay.kept_needed import ALL_RULES, needed_summary

    def rule(name, kept, success, prompts=None, budget=64):
        prompts = prompts or [f"p{i}" for i in range(len(kept))]
        return [{"prompt_id": p, "sample": 0, "scorer": name, "budget": budget, "success": s, "kept_prompt": 0.5,
                 "kept_answer": None, "wrote_needed": False, "kept": k}
                for p, k, s in zip(prompts, kept, success, strict=True)]

    kept = [True] * 6 + [False] * 6
    rows = pl.DataFrame(rule("a", kept, [True] * 5 + [False] * 7) + rule("b", kept, [True, False] * 3 + [False] * 6)
                        + rule("none", kept, [False] * 12)  # no success: cannot vary
                        + rule("twice", kept, [True] * 6 + [False] * 6, ["p0"] * 12)  # one prompt twelve times
                        + rule("a", kept, [True] * 5 + [False] * 7, budget=128))
    got = {(r["scorer"], r["budget"]): r for r in needed_summary(rows, n_boot=20).iter_rows(named=True)}
    want = [fisher_exact([[5, 1], [0, 6]]).pvalue, fisher_exact([[3, 3], [0, 6]]).pvalue]
    assert [got["a", 64]["fisher_p"], got["b", 64]["fisher_p"]] == pytest.approx(want)
    assert [got["a", 64]["holm_p"], got["b", 64]["holm_p"]] == pytest.approx(list(holm(want)))
    for name in ("none", "twice"):
        assert got[name, 64]["fisher_p"] is None and got[name, 64]["holm_p"] is None
    pooled = got[ALL_RULES, 64]
    assert pooled["n"] == 48 and pooled["prompts"] == 12 and pooled["fisher_p"] is None
    assert pooled["holm_p"] == pytest.approx(min(holm(want))) and pooled["rules_tested"] == 2
    assert got["a", 128]["holm_p"] == pytest.approx(want[0]) and got[ALL_RULES, 128]["rules_tested"] == 1


def test_replay_records_the_shares_the_loop_kept(tiny_llama, tmp_path):
    """Free-running ``kvdiag replay`` of a suite with needs: its generations.parquet ``needed_kept`` equal the shares
    recounted, slowly, from the loop's kept positions [L, Hkv, B] (``decode_batch(keep_history=True)``, the same rows
    batched as replay batches them): per compaction, per needed prompt token, the (layer, KV head) slots whose kept
    positions contain it over all slots; the prompt positions are :func:`prompt_positions`'; FullKV records none."""
    import polars as pl

    from kvdiag.core.contracts import FULL_KV
    from kvdiag.replay.run import ReplaySettings, build_policies, replay
    from kvdiag.tasks.prompts import load_prompts

    settings = ReplaySettings(scorers=["snapkv", "streamingllm"], budgets=[64], interval=32, max_new_tokens=120,
                              chat=False, instruction=None)
    prompts = load_prompts("builtin:keys:2:3")
    out = replay(tiny_llama, tmp_path / "r", settings, prompts=prompts, source="builtin:keys:2:3", command="test",
                 show_progress=False)
    df = pl.read_parquet(out / "generations.parquet")
    policies = build_policies(tiny_llama, settings)
    slots = tiny_llama.attention.num_layers * tiny_llama.attention.num_kv_heads
    checked = 0
    for p in prompts:
        needs = prompt_positions(tiny_llama.tokenizer, p, chat=False, instruction=None)
        rows = {r["scorer"]: r for r in df.filter(pl.col("prompt_id") == p.prompt_id).iter_rows(named=True)}
        assert rows[FULL_KV]["kept_steps"] == [] and rows[FULL_KV]["needed_positions"][: len(needs)] == needs
        ids = encode_prompt(tiny_llama.tokenizer, p, chat=False, instruction=None)
        loop = decode_batch(tiny_llama, [ids, ids], [policies[(s, 64)] for s in settings.scorers],
                            settings.max_new_tokens, [p.prompt_id] * 2, keep_history=True)
        for scorer, lp in zip(settings.scorers, loop, strict=True):
            r = rows[scorer]
            assert r["token_ids"] == lp.token_ids and r["kept_steps"] == [t for t, _ in lp.kept] and lp.kept
            where = r["needed_where"]
            assert [q for q, w in zip(r["needed_positions"], where, strict=True) if w == "prompt"] == needs
            want = [[sum(q in pos[layer, head].tolist() for layer in range(pos.shape[0])
                         for head in range(pos.shape[1])) / slots if q < t else None for t, pos in lp.kept]
                    for q in r["needed_positions"]]
            assert r["needed_kept"] == want  # k / slots on both sides: the same float
            assert any(0 < s < 1 for shares in want for s in shares if s is not None) or scorer == "streamingllm"
            checked += 1
    assert checked == 4
