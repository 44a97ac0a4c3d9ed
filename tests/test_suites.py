"""The builtin task suites: seeded and deterministic, graded by code, refused in one line when misnamed; the
recall suite is solved by the embedded SmolLM2 at FullKV (the README states the measured accuracy)."""

from __future__ import annotations

import pytest

from kvdiag.errors import UserError
from kvdiag.prompts import Prompt, encode_prompt, load_prompts, recall_prompts
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
        ("builtin:recall:2:5000", "outside builtin:recall"),
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
    from kvdiag.models import load_model
    from kvdiag.replay.decoding import decode

    lm = load_model("smollm2")
    for p in recall_prompts(2, seed=7, length=8):
        run = decode(lm, encode_prompt(lm.tokenizer, p), None, max_new_tokens=80, prompt_id=p.prompt_id)
        text = lm.tokenizer.decode(run.token_ids[run.prompt_len:], skip_special_tokens=True).strip()
        assert run.stop == "eos" and text == p.answer
