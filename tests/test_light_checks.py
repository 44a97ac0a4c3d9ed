"""The checks the CLI runs before torch loads give the answers of the stage's own (torch, transformers) checks:
which layers slide (config.json read as JSON against transformers' config classes), the entries a rule protects
(the one ``Protected`` definition against ``protected()`` measured on tensors) and token counts
(``kvdiag.model.token_count``
against transformers' tokenizer and chat template)."""

from __future__ import annotations

import pytest

from kvdiag.model.specs import EMBEDDED_CONFIG, TINY, spec_windows

# the tiny families whose windows the CLI must tell before the load (the rows of tests/test_bad_input.py need them)
KNOWN_SLIDING = {"mistral_sw", "gemma2", "gemma3", "gemma3_cg", "gpt_oss"}


@pytest.mark.parametrize("arch", list(TINY))
def test_tiny_windows_are_the_config_class(arch):
    """spec_windows of every tiny family is what transformers' config class makes of the same fields (or None: the
    load tells), and its model_type is the class's."""
    from kvdiag.core.errors import UserError
    from kvdiag.model.adapters import family_of, layer_windows, text_config
    from kvdiag.model.load import _tiny_config, byte_tokenizer
    from kvdiag.model.specs import TINY_MODEL_TYPES, context_of

    config = _tiny_config(arch, byte_tokenizer())
    assert text_config(config).model_type == TINY_MODEL_TYPES[TINY[arch][0]]
    # the context the CLI checks prompts against is the one FreeRunning.items reads from the loaded config
    assert context_of(f"tiny:{arch}") == text_config(config).max_position_embeddings
    light = spec_windows(f"tiny:{arch}")
    try:
        heavy = layer_windows(text_config(config), family_of(config)[1])
    except UserError:  # a refused family (MLA): refused at load, not told here
        assert light is None
        return
    assert light is None or light == heavy, (light, heavy)
    if arch in KNOWN_SLIDING or arch not in ("mistral", "phi3"):
        assert light == heavy  # only mistral's and phi3's defaults (None stripped) are left to the load


@pytest.mark.parametrize("name", list(EMBEDDED_CONFIG))
def test_embedded_windows_are_the_config_class(name):
    """The embedded models' windows from EMBEDDED_CONFIG are their config class's (its fields in transformers' class,
    and the converted config.json where one is on this machine)."""
    import transformers

    from kvdiag.model.adapters import family_of, layer_windows
    from kvdiag.model.embedded import converted_dir

    fields = EMBEDDED_CONFIG[name]
    cls = transformers.CONFIG_MAPPING[fields["model_type"]]
    config = cls(**{k: v for k, v in fields.items() if k in ("num_hidden_layers", "sliding_window", "layer_types")})
    light = spec_windows(name)
    assert light is not None and light == layer_windows(config, family_of(config)[1])
    d = converted_dir(name)
    if d is not None:
        loaded = transformers.AutoConfig.from_pretrained(d)
        assert light == layer_windows(loaded, family_of(loaded)[1])
    if name == "gemma3-270m":
        assert light.count(None) == 3 and set(light) == {512, None}


def test_config_windows_leave_derived_layouts_to_the_load():
    """A layout transformers derives (a pattern, max_window_layers, a class default) is not guessed from JSON."""
    from kvdiag.model.families import config_windows

    assert config_windows({"num_hidden_layers": 4, "sliding_window": 8}, "gemma3_text") is None  # pattern
    assert config_windows({"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 8}, "qwen2") is None
    assert config_windows({"num_hidden_layers": 4}, "mistral") is None  # the class's default window
    assert config_windows({"num_hidden_layers": 4}, "no_such_family") is None
    assert config_windows({"num_hidden_layers": 2, "sliding_window": 8}, "mistral") == [8, 8]
    assert config_windows({"num_hidden_layers": 2}, "llama") == [None, None]


# --------------------------------------------------------------------------- protected entries


def test_protects_are_the_classes():
    """scorer_fields' PROTECTS and WINDOW_FIELD (read before torch) are the classes' ``protects``/``window_field``."""
    from kvdiag.scorers import SCORERS
    from kvdiag.scorers import fields as scorer_fields

    builtins = {n: c for n, c in SCORERS.items() if c.__module__.startswith("kvdiag.") and ":" not in n}
    assert {n: c.protects for n, c in builtins.items()} == {
        n: scorer_fields.PROTECTS.get(n, (None, None)) for n in builtins}
    assert {n: c.window_field for n, c in builtins.items() if c.window_field} == scorer_fields.WINDOW_FIELD


@pytest.mark.parametrize("w_obs", [None, 4])
@pytest.mark.parametrize("params", [{}, "small"])
def test_live_protected_is_what_protected_marks(w_obs, params):
    """For every live built-in, the count the CLI checks the budget against (live_protected) is the count
    protected_count measures on the class's protected() over tensors, at cache sizes below, at and above its span."""
    from kvdiag.generate.live import make_scorer, protected_count
    from kvdiag.scorers.fields import FIELDS, LIVE, PROTECTS, live_protected

    checked = 0
    for name in LIVE:
        given = {}
        if params == "small":  # every protecting field set to a small value of its own
            given = {f: str(3 + i) for i, f in enumerate(f for f in PROTECTS.get(name, ()) if f)}
            if "w_delay" in given:  # avokv_e's delay buffer is at least its observation window
                given["w_obs"] = "3"
        scorer = make_scorer(name, given or None, w_obs)
        for n in (1, 5, 9, 40, 300):
            light = live_protected(name, given or None, w_obs, n)
            if light is None:  # only where a field is not a number before the class fills it in
                assert name == "avokv_e_no_delay" and "w_delay" not in given
                continue
            assert light == protected_count(scorer, n), (name, given, w_obs, n)
            checked += 1
    assert checked >= 5 * (len(LIVE) - 1)
    assert set(FIELDS) >= set(LIVE)


def test_protected_mask_is_the_rules_declaration():
    """Scorer.protected is Protected.mask of the declared fields: vase's window and sinks, avokv_e's delay buffer."""
    import torch

    from kvdiag.generate.live import make_scorer

    t = 100
    age, pos = t - torch.arange(t), torch.arange(t)
    vase = make_scorer("vase", {"window": "10", "n_sink": "3"})
    assert vase.protected(age, pos).nonzero().flatten().tolist() == [0, 1, 2, *range(90, 100)]
    avokv = make_scorer("avokv_e", {"w_delay": "40"})
    assert avokv.protected(age, pos).nonzero().flatten().tolist() == list(range(60, 100))
    assert not make_scorer("knorm").protected(age, pos).any()


# --------------------------------------------------------------------------- token counts


def _transformers_tokenizer(spec: str):
    """The tokenizer the stage loads for ``spec`` (kvdiag.model.load: tiny -> the byte tokenizer, embedded -> its
    converted directory through AutoTokenizer), or a skip when the embedded model is not converted here."""
    from kvdiag.model.specs import byte_tokenizer

    if spec.startswith("tiny:"):
        return byte_tokenizer()
    from transformers import AutoTokenizer

    from kvdiag.core.errors import UserError
    from kvdiag.model.embedded import converted_dir

    try:
        path = converted_dir(spec)
    except UserError:
        pytest.skip(f"{spec}: its packages are not installed")
    if path is None:
        pytest.skip(f"{spec} is not converted on this machine (a load converts it)")
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("spec", ["tiny:llama", "smollm2", "gemma3-270m"])
def test_light_counts_are_transformers(spec):
    """For every prompt of every builtin suite (20 each, default lengths, and recall/keys/countdown at a longer
    length), with and without the chat template: the TokenCounter's prompt ids are encode_prompt's through
    transformers' tokenizer, and its counts of each expected answer and of the part between the needed value and the
    last line are the tokenizer's (what check_generation_room compares with --max-new-tokens)."""
    from kvdiag.model.token_count import light_counter

    counter = light_counter(spec)
    assert counter is not None and counter.bounded
    _assert_counts_are(counter, _transformers_tokenizer(spec))


def _assert_counts_are(counter, tok) -> None:
    """The counter's prompt ids (with and without the chat template) and text counts are the transformers tokenizer
    ``tok``'s on every builtin suite prompt and answer, and its bound (when ``bounded``) is at least the count."""
    from kvdiag.tasks.prompts import DEFAULT_INSTRUCTION, encode_prompt
    from kvdiag.tasks.suites import SUITES, load_builtin

    assert (counter.chat_template is None) == (not getattr(tok, "chat_template", None))
    sources = [f"builtin:{name}" for name in SUITES] + [f"builtin:{n}:3:120" for n, s in SUITES.items() if s.lengths]
    checked = 0
    for source in sources:
        for p in load_builtin(source):
            for chat in (True, False):
                assert counter.prompt_ids(p, chat, DEFAULT_INSTRUCTION) == encode_prompt(tok, p, chat), (source, p)
            texts = [p.text]
            if p.answer is not None:
                last = p.answer.rstrip().rfind("\n") + 1
                texts += [p.answer] + ([p.answer[p.answer_needs[0][1]:last]] if p.answer_needs else [])
            for text in texts:
                assert counter.count(text) == len(tok(text, add_special_tokens=False).input_ids), (source, text)
                if counter.bounded:  # the bound the CLI tries first
                    assert counter.bound(text) >= counter.count(text), (source, text)
            for chat in (True, False):
                if counter.bounded:
                    assert counter.prompt_bound(p, chat) >= len(counter.prompt_ids(p, chat)), (source, p)
            checked += 1
    assert checked == 20 * len(SUITES) + 3 * sum(1 for s in SUITES.values() if s.lengths)


TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _saved_model_dir(path, kind: str):
    """A model directory's tokenizer files as transformers saves them: the byte tokenizer with a chat template, or
    the converted smollm2's (a skip when it is not converted here)."""
    import shutil

    from kvdiag.model.specs import BYTE_SPECIALS, byte_tokenizer

    path.mkdir(parents=True)
    if kind == "bytes":
        tok = byte_tokenizer()
        tok.chat_template = TEMPLATE
        tok.save_pretrained(path)
        (path / "config.json").write_text('{"model_type": "llama"}')  # AutoTokenizer reads a hub model's config
        assert BYTE_SPECIALS["eos_token"] in (path / "tokenizer_config.json").read_text()
        return path
    from kvdiag.model.embedded import converted_dir

    source = converted_dir("smollm2")
    if source is None:
        pytest.skip("smollm2 is not converted on this machine (a load converts it)")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy2(source / name, path / name)
    return path


@pytest.mark.parametrize("kind", ["bytes", "smollm2"])
def test_a_cached_hub_id_or_a_directory_counts_as_transformers_loads_it(kind, tmp_path, monkeypatch):
    """A hub id whose tokenizer files are in the local Hugging Face cache, and a local model directory, count as
    AutoTokenizer (what kvdiag.model.load loads, offline) counts, on every builtin suite prompt and answer; no bound."""
    import huggingface_hub.constants
    from transformers import AutoTokenizer

    from kvdiag.model.token_count import light_counter
    from tests.conftest import hub_cache

    local = _saved_model_dir(tmp_path / "model", kind)
    counter = light_counter(str(local))
    assert counter is not None and not counter.bounded
    _assert_counts_are(counter, AutoTokenizer.from_pretrained(local))

    files = list(local.iterdir())
    untemplated = [f for f in files if f.name != "chat_template.jinja"]
    assert len(untemplated) < len(files)
    for name, cached, missing in (("unknown", untemplated, ()), ("templated", files, ()),
                                  ("untemplated", untemplated, ("chat_template.jinja",))):
        cache = hub_cache(tmp_path / name, "someone/model", cached, missing)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
        counter = light_counter("someone/model")
        if name == "unknown":  # its template is neither cached nor known to be missing: the hub may have one
            assert counter is None
            continue
        assert counter is not None and not counter.bounded and (counter.chat_template is None) == (name != "templated")
        assert light_counter("someone/model", revision="v2") is None  # only the main revision is known
        _assert_counts_are(counter, AutoTokenizer.from_pretrained("someone/model", cache_dir=cache,
                                                                  local_files_only=True))


def test_a_tokenizer_class_that_rebuilds_or_remote_code_gets_no_counter(tmp_path):
    """A tokenizer_config naming a model-specific class (transformers may rebuild the pipeline) or remote code."""
    import json

    from kvdiag.model.token_count import light_counter

    local = _saved_model_dir(tmp_path / "model", "bytes")
    config = json.loads((local / "tokenizer_config.json").read_text())
    for change in ({"tokenizer_class": "LlamaTokenizer"}, {"auto_map": {"AutoTokenizer": ["x.T", None]}}):
        (local / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert light_counter(str(local)) is None, change


def test_no_light_counter_where_it_is_not_known():
    """Models whose tokenizer the light path cannot vouch for get none: the stage counts after the load."""
    from kvdiag.model.token_count import light_counter

    for spec in ("tiny:gpt9", "/no/such/dir", "some/hub-id", "model.gguf"):
        assert light_counter(spec) is None, spec


def test_random_models_count_as_their_padded_byte_tokenizer():
    """A random: model's tokenizer is the byte tokenizer padded to its vocabulary (kvdiag.model.load._random): the light
    counter's counts and prompt ids are that tokenizer's, on every builtin suite's prompts and answers."""
    from kvdiag.model.specs import byte_tokenizer
    from kvdiag.model.token_count import light_counter
    from kvdiag.tasks.prompts import encode_prompt
    from kvdiag.tasks.suites import SUITES, load_builtin

    tok, counter = byte_tokenizer(151_936), light_counter("random:qwen3-8b")
    for name in SUITES:
        for p in load_builtin(f"builtin:{name}:3"):
            assert counter.prompt_ids(p) == encode_prompt(tok, p)
            for text in (p.text, p.answer or ""):
                assert counter.count(text) == len(tok(text, add_special_tokens=False).input_ids)


def test_a_generation_tagged_template_is_left_to_transformers(tmp_path):
    """A saved tokenizer whose template has {% generation %} (or a list of templates) gets no light counter."""
    import shutil

    from kvdiag.model.specs import byte_core
    from kvdiag.model.token_count import saved_counter

    byte_core().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    assert saved_counter(tmp_path) is not None and saved_counter(tmp_path).chat_template is None
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{% generation %}{{ m.content }}"
                                                  "{% endgeneration %}{% endfor %}")
    assert saved_counter(tmp_path) is None
    shutil.rmtree(tmp_path)
    assert saved_counter(tmp_path) is None  # nothing there


@pytest.mark.parametrize("source, max_new, needle", [
    ("builtin:recall:2:1000", 3000, "has 17832 tokens"),  # past tiny:llama's context of 4096
    ("builtin:recall:2", 60, "reads its needed value 123 tokens (its expected text, tokenized)"),
])
def test_the_stage_refuses_what_the_cli_refused(tiny_llama, source, max_new, needle, capsys):
    """The refusal the CLI gives before torch (the light counter) is, word for word, the one the stage gives from the
    loaded model's tokenizer and config (FreeRunning.items): one check_room, two counters that agree."""
    from kvdiag.cli.main import main
    from kvdiag.core.errors import UserError
    from kvdiag.replay.config import ReplaySettings
    from kvdiag.replay.free_running import FreeRunning
    from kvdiag.tasks.prompts import load_prompts

    with pytest.raises(SystemExit):
        main(["replay", "--scorers", "rkv", "--model", "tiny:llama", "--prompts", source, "--max-new-tokens",
              str(max_new), "--out", "/nonexistent/never"])
    light = capsys.readouterr().err.strip().removeprefix("error: ")
    with pytest.raises(UserError) as heavy:
        FreeRunning(load_prompts(source), source).items(tiny_llama,
                                                        ReplaySettings(["rkv"], [64], max_new_tokens=max_new))
    assert needle in light and str(heavy.value) == light


def test_bounds_decide_without_loading_the_tokenizer():
    """A generation limit with room to spare passes on the bounds (the tokenizer never loads); a tight one that the
    bounds cannot clear is decided by the exact count: refused when the count says so, with the exact figure."""
    from kvdiag.core.errors import UserError
    from kvdiag.model.specs import byte_core
    from kvdiag.model.token_count import TokenCounter
    from kvdiag.tasks.suites import load_builtin

    loads = []

    def load():
        loads.append(1)
        return byte_core()

    prompts = load_builtin("builtin:recall:2:5")
    TokenCounter(load, bounded=True).check_room(prompts, 4000, 100_000, "builtin:recall:2:5")
    assert loads == []
    need = TokenCounter(byte_core()).count(prompts[0].answer)
    # the bounds refuse, the counts pass
    TokenCounter(load, bounded=True).check_room(prompts, need + 1, 100_000, "builtin:recall:2:5")
    assert loads == [1]
    with pytest.raises(UserError, match=f"needs {need} generated tokens"):
        TokenCounter(load, bounded=True).check_room(prompts, need - 1, 100_000, "builtin:recall:2:5")


def test_a_cached_config_speaks_for_the_main_revision_only(tmp_path, monkeypatch):
    """The local cache's config.json is main's: with --revision another revision's context, layers and windows are
    left to the load (None), as the token counts are (light_counter)."""
    import json

    import huggingface_hub.constants

    from kvdiag.model.specs import context_of, known_shape, spec_config, spec_windows
    from tests.conftest import hub_cache

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                                       "max_position_embeddings": 100}))
    cache = hub_cache(tmp_path / "hub", "someone/model", [tmp_path / "config.json"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert context_of("someone/model") == 100 and known_shape("someone/model")["num_hidden_layers"] == 2
    assert spec_windows("someone/model") == [None, None]
    for revision in ("v2", "main"):  # a branch named main may have moved since it was cached: the load tells
        assert spec_config("someone/model", revision) is None and context_of("someone/model", revision) is None
        assert known_shape("someone/model", revision) is None and spec_windows("someone/model", revision) is None
