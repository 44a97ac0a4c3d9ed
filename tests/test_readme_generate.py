"""The README's ``model.generate`` example (``cache=EvictingCache(...)`` on the embedded SmolLM2), executed
as printed and compared token for token with ``kvdiag replay``'s free-running decode of the same prompt and rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import needs_smollm2

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    """The README's python block that calls ``model.generate`` with an EvictingCache, dedented."""
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", README.read_text(), re.DOTALL | re.MULTILINE)
    found = [re.sub(rf"^{indent}", "", code, flags=re.MULTILINE) for indent, code in blocks
             if "cache=cache" in code]
    assert len(found) == 1, "the README shows one model.generate example with an EvictingCache"
    return found[0]


def test_the_readme_example_uses_cache_and_the_embedded_model():
    """``cache=``: the name transformers 5.2x's generate takes without a warning (``past_key_values=`` warns)."""
    code = readme_example()
    assert 'load_model("smollm2")' in code and "EvictingCache(lm.model" in code
    assert re.search(r"\.generate\(.*\bcache=cache", code) and "past_key_values" not in code


@pytest.mark.slow
@needs_smollm2
def test_the_readme_example_equals_replay_token_for_token(capsys):
    """Executed as printed: its tokens and compaction steps are replay's (``decode`` under the same rule, budget and
    interval), it compacts at least twice, and it prints its continuation and the compaction steps."""
    from kvdiag.generate import Policy, make_scorer
    from kvdiag.replay.decoding import decode

    scope: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), scope)
    lm, ids, out, cache = scope["lm"], scope["ids"], scope["out"], scope["cache"]
    policy = Policy(make_scorer(cache.policy.scorer.name), cache.policy.budget, cache.policy.interval)
    want = decode(lm, ids[0].tolist(), policy, max_new_tokens=out.shape[1] - ids.shape[1])
    assert out[0].tolist() == want.token_ids
    assert cache.compressions == want.compressions and len(want.compressions) >= 2
    assert str(cache.compressions) in capsys.readouterr().out
