"""The builtin task suites: seeded and deterministic, graded by code, component by component, refused in one line
when misnamed or too long for the generation; the recall suite is solved by the embedded SmolLM2 at FullKV (the
README states the measured accuracy)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from scipy.stats import binomtest

from kvdiag.core.errors import UserError
from kvdiag.tasks.prompts import Prompt, encode_prompt, load_prompts, recall_prompts
from kvdiag.tasks.suites import SUITES, answer_tokens, check_generation_room, grade, keys_prompts, min_tokens
from tests.conftest import needs_smollm2


def test_recall_is_seeded_and_follows_its_length():
    a, b = load_prompts("builtin:recall:5:12", seed=3), load_prompts("builtin:recall:5:12", seed=3)
    assert a == b and len(a) == 5
    assert load_prompts("builtin:recall:5:12", seed=4) != a
    p = a[0]
    assert p.check == "exact" and len(p.shots) == 2
    lines = p.answer.splitlines()
    code = lines[0].removeprefix("Code: ")
    assert len(lines) == 12 + 2 and lines[1:-1] == [f"{i}. {i}" for i in range(1, 13)]
    assert lines[-1] == f"The code is {code}." and code in p.text
    for _, shot in p.shots:  # the worked examples have the question's length, so the model copies its shape
        assert len(shot.splitlines()) == 12 + 2
    assert len(load_prompts("builtin:recall:3")[0].answer.splitlines()) == 20 + 2  # the default length


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("builtin:nope", "unknown builtin suite 'nope'"),
        ("builtin:recall:x", "positive integers"),
        ("builtin:recall:0", "positive integers"),
        ("builtin:recall:2:3:4", "positive integers"),
        ("builtin:arith:2:10", "no length knob"),
        ("builtin:recall:2:20000", "outside builtin:recall"),
        ("builtin:recall:2:5000", "more than the 4096 a builtin suite generates; use LENGTH <= "),
        ("builtin:keys:2:3000", "more than the 4096 a builtin suite generates; use LENGTH <= "),
    ],
)
def test_bad_suite_names_the_source(source, fragment):
    with pytest.raises(UserError) as err:
        load_prompts(source)
    assert source in str(err.value) and fragment in str(err.value)


class _ChatTokenizer:
    """A tokenizer stand-in with a chat template: renders turns as ``<role>content`` and tokenizes by character."""

    chat_template = "stand-in"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                          else "")

    def __call__(self, text, add_special_tokens=True):
        class Encoded:
            input_ids = [ord(c) for c in text]

        return Encoded()


def test_shots_become_earlier_turns_and_suppress_the_instruction():
    tok = _ChatTokenizer()
    p = Prompt("p", "Q?", "A", shots=(("q1", "a1"), ("q2", "a2")), check="exact")
    text = "".join(map(chr, encode_prompt(tok, p, instruction="Think.")))
    assert text == "<user>q1<assistant>a1<user>q2<assistant>a2<user>Q?<assistant>"
    plain = "".join(map(chr, encode_prompt(tok, Prompt("p", "Q?"), instruction="Think.")))
    assert plain == "<user>Q?\nThink.<assistant>"


@pytest.mark.slow
@needs_smollm2
def test_smollm2_solves_recall_at_full_kv():
    from kvdiag.model.load import load_model
    from kvdiag.replay.decoding import decode

    lm = load_model("smollm2")
    for p in recall_prompts(2, seed=7, length=8):
        run = decode(lm, encode_prompt(lm.tokenizer, p), None, max_new_tokens=80, prompt_id=p.prompt_id)
        text = lm.tokenizer.decode(run.token_ids[run.prompt_len:], skip_special_tokens=True).strip()
        assert run.stop == "eos" and text == p.answer


@pytest.mark.slow
@needs_smollm2
def test_smollm2_solves_keys_at_full_kv():
    """Two keys prompts at length 12 (about 110 generated tokens): every component passed."""
    from kvdiag.model.load import load_model
    from kvdiag.replay.decoding import decode

    lm = load_model("smollm2")
    for p in keys_prompts(2, seed=7, length=12):
        run = decode(lm, encode_prompt(lm.tokenizer, p), None, max_new_tokens=160, prompt_id=p.prompt_id)
        text = lm.tokenizer.decode(run.token_ids[run.prompt_len:], skip_special_tokens=True)
        assert run.stop == "eos" and all(grade(SUITES["keys"], text, p.answer).values()), text


# --------------------------------------------------------------------------- components


def test_recall_components_grade_each_part():
    p = recall_prompts(1, seed=1, length=5)[0]
    code = p.answer.splitlines()[0].removeprefix("Code: ")
    wrong = "1000" if code != "1000" else "1001"
    suite = SUITES["recall"]
    assert suite.task.name == "recalled" and suite.component("format").role == "format"
    cases = {  # generation -> (copied, counted, recalled, format)
        p.answer: (True, True, True, True),
        f"The code is {code}.": (False, False, True, False),  # recalled, counting skipped (CAKE / SnapKV at 128)
        p.answer.replace(f"The code is {code}.", f"The code is {wrong}."): (True, True, False, True),
        p.answer.replace("3. 3\n", ""): (True, False, True, True),  # a line missing: not counted, shape kept
        p.answer.replace("3. 3", "3. 4"): (True, False, True, True),
        p.answer + "\n6. 6": (True, False, False, False),  # counting past LENGTH, the code not written last
        "```python\nprint(1)\n```": (False, False, False, False),
        "": (False, False, False, False),
    }
    for text, want in cases.items():
        assert tuple(grade(suite, text, p.answer).values()) == want, text


def test_keys_is_seeded_and_records_what_its_answer_needs():
    a = load_prompts("builtin:keys:4:30", seed=2)
    assert a == load_prompts("builtin:keys:4:30", seed=2) and a != load_prompts("builtin:keys:4:30", seed=3)
    for p in a:
        lines = p.answer.splitlines()
        pairs = p.text[slice(*p.needs[0])]
        assert p.answer[slice(*p.answer_needs[0])] == pairs and p.answer_needs[0][1] == len(lines[0])  # line 1
        assert len(pairs.split(", ")) == 3 and all(len(kv.split()) == 2 for kv in pairs.split(", "))
        assert lines[0] == f"Codes: {pairs}" and lines[-1] == f"The codes are {pairs}."
        assert lines[1:-1] == [f"{i}. {i}" for i in range(1, 31)] and len(p.shots) == 2
        assert all(grade(SUITES["keys"], p.answer, p.answer).values())
    p = a[0]
    key, code = p.text[slice(*p.needs[0])].split(", ")[1].split()
    swapped = p.answer.replace(f"{key} {code}.", f"{key} {int(code) % 9000 + 1000}.").replace(
        f"{key} {code},", f"{key} {int(code) % 9000 + 1000},")
    last_changed = "\n".join([*p.answer.splitlines()[:-1], swapped.splitlines()[-1]])
    assert grade(SUITES["keys"], last_changed, p.answer) == {"copied": True, "counted": True, "recalled": False,
                                                             "format": True}
    assert answer_tokens(load_prompts("builtin:keys:1")[0])[1] >= 80  # the default: each code read 80+ tokens on


def test_countdown_steps_read_the_previous_result():
    a = load_prompts("builtin:countdown:3:25", seed=5)
    assert a == load_prompts("builtin:countdown:3:25", seed=5) and a != load_prompts("builtin:countdown:3:25", seed=6)
    for p in a:
        lines = p.answer.splitlines()
        start = int(p.text[slice(*p.needs[0])])
        assert 35 <= start <= 84 and p.answer[slice(*p.answer_needs[0])] == str(start) and lines[0] == f"Start: {start}"
        assert [int(ln.split(". ")[1]) for ln in lines[1:-1]] == list(range(start, start - 25, -1))
        assert lines[-1] == f"The start was {start}." and all(grade(SUITES["countdown"], p.answer, p.answer).values())
    p = a[0]
    start = int(p.text[slice(*p.needs[0])])
    skipped = p.answer.replace(f"\n3. {start - 2}\n", f"\n3. {start - 3}\n")  # one step wrong: not counted
    assert grade(SUITES["countdown"], skipped, p.answer) == {"copied": True, "counted": False, "recalled": True,
                                                              "format": True}
    assert SUITES["countdown"].task.name == "recalled"


def test_unknown_component_is_refused():
    with pytest.raises(UserError, match="builtin:recall has no such component; use one of copied, counted"):
        SUITES["recall"].component("nope")


def test_token_lower_bound_and_generation_room():
    assert min_tokens("Code: 1663\n1. 1\nThe code is 1663.") == 10  # Code, 166, 3, 1, 1, The, code, is, 166, 3
    p = recall_prompts(1, length=20)[0]
    need, distance = answer_tokens(p)
    assert (need, distance) == (48, 40)  # SmolLM2 writes it in 140 tokens: a lower bound
    check_generation_room([p], need, "builtin:recall:1:20")
    with pytest.raises(UserError, match=r"^--max-new-tokens 47: prompt recall000 of builtin:recall:1:20 needs 48 "
                                        r"generated tokens \(at least"):
        check_generation_room([p], need - 1, "builtin:recall:1:20")
    with pytest.raises(UserError, match=r"^--max-new-tokens 40: prompt recall000 of builtin:recall:1:20 reads its "
                                        r"needed value 40 tokens \(at least.*beyond the generation limit"):
        check_generation_room([p], distance, "builtin:recall:1:20")
    with pytest.raises(UserError, match=r"needs 150 generated tokens \(characters\)"):
        check_generation_room([p], 149, "builtin:recall:1:20", count=len, how="characters")
    check_generation_room(load_prompts("builtin:arith:3"), 1, "builtin:arith:3")  # math answers: no length known


def _outcomes() -> pl.DataFrame:
    """Outcome rows of 12 prompts: FullKV passes all; rule r1 fails prompts 0-5 (compressed everywhere), r2 fails
    prompts 0-1 and is uncompressed on prompt 11 (left out)."""
    rows = []
    for i in range(12):
        for scorer, budget, ok, comp in [("full_kv", None, True, None), ("r1", 8, i >= 6, True),
                                         ("r2", 8, i >= 2, i != 11)]:
            rows.append({"prompt_id": f"p{i:02d}", "sample": 0, "scorer": scorer, "budget": budget,
                         "compressed": comp, "recalled": ok, "copied": True, "counted": ok, "format": True})
    return pl.DataFrame(rows)


def test_component_summary_and_paired_tests():
    from kvdiag.core.stats import wilson
    from kvdiag.replay.outcomes import component_summary, component_tests

    suite = SUITES["recall"]
    s = component_summary(_outcomes(), suite, n_boot=200)
    cell = s.filter((pl.col("scorer") == "r2") & (pl.col("component") == "recalled")).row(0, named=True)
    assert (cell["passed"], cell["n"], cell["uncompressed"]) == (9, 11, 1)  # prompt 11 left out
    assert (cell["rate_lo"], cell["rate_hi"]) == pytest.approx(wilson(9, 11), abs=1e-12)
    t = component_tests(_outcomes(), suite, n_boot=200)
    rec = t.filter(pl.col("component") == "recalled")
    r1 = rec.filter((pl.col("a") == "full_kv") & (pl.col("b") == "r1")).row(0, named=True)
    assert (r1["units"], r1["a_only"], r1["b_only"]) == (12, 6, 0)
    assert r1["p_value"] == pytest.approx(binomtest(6, 6).pvalue, rel=1e-12)  # McNemar exact: 6 discordant pairs
    pair = rec.filter((pl.col("a") == "r1") & (pl.col("b") == "r2")).row(0, named=True)
    assert (pair["units"], pair["a_only"], pair["b_only"]) == (12, 0, 4)  # either compressed: all 12 units
    assert pair["diff"] == pytest.approx(-4 / 12)
    p = np.sort(rec["p_value"].to_numpy())
    assert np.sort(rec["p_holm"].to_numpy()) == pytest.approx(np.minimum(1, np.maximum.accumulate(p * [3, 2, 1])))
    same = t.filter(pl.col("component") == "copied")
    assert (same["p_value"] == 1.0).all() and (same["a_only"] + same["b_only"] == 0).all()


def test_components_selection_reaches_the_summary():
    from kvdiag.replay.run import _suite
    from kvdiag.tasks.suites import select_components

    assert select_components("builtin:recall:5", ["format"]) == ["recalled", "format"]  # the task always reported
    picked = _suite({"mode": "free", "prompts_source": "builtin:recall:50", "components": ["format", "recalled"]})
    assert [c.name for c in picked.components] == ["recalled", "format"] and picked.task.name == "recalled"
    assert _suite({"mode": "free", "prompts_source": "builtin:keys:20"}) is SUITES["keys"]
    assert _suite({"mode": "free", "prompts_source": "data/math500-first20.jsonl"}) is None
    assert _suite({"mode": "teacher_forced", "prompts_source": "builtin:recall"}) is None
