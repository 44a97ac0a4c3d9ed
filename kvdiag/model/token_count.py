"""Token counts without torch or transformers: a model's ``tokenizer.json`` through the tokenizers library and its chat
template through jinja2, rendered as transformers renders it, so that ``kvdiag replay`` refuses a prompt that cannot
fit the model's context, or a generation limit that cannot hold a builtin suite's answer, before anything heavy loads.

Only where the count is known to be transformers' (tests/test_light_checks.py compares every builtin suite prompt and
answer): the ``tiny:`` and ``random:`` models' byte tokenizer, the embedded models once converted (their saved
``tokenizer.json`` and template), and a local model directory or a hub id whose tokenizer files are in the local
Hugging Face cache, when its ``tokenizer_class`` loads ``tokenizer.json`` as it is (:data:`AS_SAVED`). Any other
model returns no counter (:func:`light_counter`), and the stage checks it once loaded, with the same
:func:`check_room`. GGUF files get none: transformers rebuilds their tokenizer from the GGUF metadata per architecture
(``integrations/ggml.py``), a second conversion kvdiag would have to keep equal to it, and reading a 262k-entry
vocabulary with the ``gguf`` package is not cheaper than the tokenizer.json it would replace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from kvdiag.core.errors import UserError
from kvdiag.tasks.prompts import DEFAULT_INSTRUCTION, Prompt, chat_turns, plain_text
from kvdiag.tasks.suites import check_generation_room

GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' test for assistant masks
# the special tokens a chat template sees by name (transformers passes its special_tokens_map to the template)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZED = "its expected text, tokenized"  # what the exact count is, for check_generation_room's message


BOUND_SLACK = 2  # tokens a text may hold beyond its UTF-8 bytes: a BOS, and SentencePiece's dummy-prefix piece
# tokenizer classes that transformers (5.x) builds from tokenizer.json unchanged; a model-specific class
# (LlamaTokenizer, GemmaTokenizer, ...) may rebuild its normalizer, pre-tokenizer or post-processor
AS_SAVED = ("TokenizersBackend", "PreTrainedTokenizerFast")


class TokenCounter:
    """A model's tokenizer (``tokenizer``: a ``tokenizers.Tokenizer``, or a function that loads it when a count first
    needs it) and chat template (None: it has none) with the special tokens the template may read, applied as
    :func:`kvdiag.tasks.prompts.encode_prompt` applies transformers'.

    ``bound`` / ``prompt_bound``: an upper bound on the count that needs no tokenizer (UTF-8 bytes + BOUND_SLACK:
    every token of a byte-level BPE or byte-fallback SentencePiece vocabulary, kvdiag's light models', covers at least
    one byte; tests/test_light_checks.py checks it against the counts). A check that passes on the bounds passes on
    the counts, so a large tokenizer.json (gemma3's 262k entries: ~2 s) loads only when the bounds cannot decide.
    ``bounded=False`` (a tokenizer the bound is not known to hold for, e.g. one whose normalizer expands text): the
    counts decide every check."""

    def __init__(self, tokenizer, chat_template: str | None = None, special_tokens: dict[str, str] | None = None,
                 bounded: bool = False):
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}
        self.bounded = bounded
        self._template = None if chat_template is None else compile_template(chat_template)

    @property
    def tokenizer(self):
        if not hasattr(self._tokenizer, "encode"):
            self._tokenizer = self._tokenizer()
        return self._tokenizer

    def count(self, text: str) -> int:
        """Tokens of ``text`` without special tokens (a transformers tokenizer's ``add_special_tokens=False``)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    @staticmethod
    def bound(text: str) -> int:
        """At least :meth:`count` of ``text``, without the tokenizer."""
        return len(text.encode()) + BOUND_SLACK

    def _rendered(self, prompt: Prompt, chat: bool, instruction: str | None) -> tuple[str, bool]:
        """The text :func:`kvdiag.tasks.prompts.encode_prompt` tokenizes, and whether it adds special tokens."""
        if chat and self._template is not None:
            return self._template.render(messages=chat_turns(prompt, instruction), tools=None, documents=None,
                                         add_generation_prompt=True, **self.special_tokens), False
        return plain_text(prompt, instruction), True

    def prompt_ids(self, prompt: Prompt, chat: bool = True, instruction: str | None = DEFAULT_INSTRUCTION) -> list[int]:
        """The token ids :func:`kvdiag.tasks.prompts.encode_prompt` gives ``prompt`` on the same model."""
        text, special = self._rendered(prompt, chat, instruction)
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def prompt_bound(self, prompt: Prompt, chat: bool = True, instruction: str | None = DEFAULT_INSTRUCTION) -> int:
        """At least ``len(prompt_ids(...))``, without the tokenizer."""
        return self.bound(self._rendered(prompt, chat, instruction)[0])

    def check_room(self, prompts: list[Prompt], max_new_tokens: int, context: int | None, source: str,
                   chat: bool = True, instruction: str | None = DEFAULT_INSTRUCTION) -> None:
        """:func:`check_room` on the bounds (when ``bounded``), and on the exact counts where the bounds refuse."""
        if self.bounded:
            try:
                check_room(prompts, [self.prompt_bound(p, chat, instruction) for p in prompts], max_new_tokens,
                           context, source, self.bound)
                return  # the bounds clear it: so do the counts
            except UserError:
                pass  # the bounds cannot clear it: the counts decide
        check_room(prompts, [len(self.prompt_ids(p, chat, instruction)) for p in prompts], max_new_tokens, context,
                   source, self.count)


def compile_template(source: str):
    """A chat template compiled as transformers compiles it (``utils/chat_template_utils.py``): a sandboxed
    environment with trim_blocks, lstrip_blocks and loop controls, and its ``raise_exception``, ``strftime_now`` and
    ``tojson`` (not HTML-escaping). Its ``{% generation %}`` tag (assistant masks) is not supported: callers check."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def light_counter(spec: str, revision: str | None = None) -> TokenCounter | None:
    """The :class:`TokenCounter` of ``--model spec`` (at ``revision``) where it is known to count as transformers
    does: a ``tiny:`` or ``random:`` model (the byte tokenizer, no template), an embedded model already converted (its
    saved tokenizer), a local model directory (:func:`as_saved_counter`) or a hub id at its main revision whose
    tokenizer files are in the local Hugging Face cache (:func:`hub_counter`); None otherwise (the stage counts once
    the model loads). An adapter (``BASE+ADAPTER``) counts as its base."""
    from kvdiag.model.specs import TINY, byte_core, is_path_spec, split_adapter

    spec = split_adapter(spec)[0]

    if spec.startswith("tiny:"):
        return TokenCounter(byte_core(), bounded=True) if spec.split(":", 1)[1] in TINY else None
    if spec.startswith("random:"):  # the byte tokenizer padded to the model's vocabulary: the same counts
        return TokenCounter(byte_core(), bounded=True)
    from kvdiag.model.embedded import EMBEDDED, converted_dir

    if spec not in EMBEDDED:
        if spec.endswith(".gguf") or revision is not None:
            return None
        if is_path_spec(spec):
            path = Path(spec).expanduser()
            return as_saved_counter(path) if path.is_dir() else None
        return hub_counter(spec)
    try:
        path = converted_dir(spec)
    except UserError:  # its packages are missing: the load says so
        return None
    return None if path is None else saved_counter(path, bounded=True)


def hub_counter(repo_id: str) -> TokenCounter | None:
    """The counter of hub id ``repo_id`` (main revision) from the local Hugging Face cache, read as files (nothing is
    downloaded): its ``tokenizer.json`` and ``tokenizer_config.json`` (a ``tokenizer_class`` in :data:`AS_SAVED`), and
    its ``chat_template.jinja`` when the cache holds it or has recorded that the hub has none; None when any of this
    is unknown (the load counts). The counts decide (no byte bound: its normalizer is not known to keep it)."""
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

    from kvdiag.model.specs import cached_hub_file

    config, tokenizer = cached_hub_file(repo_id, "tokenizer_config.json"), cached_hub_file(repo_id, "tokenizer.json")
    if config is None or tokenizer is None or config.parent != tokenizer.parent:
        return None
    if (not (config.parent / "chat_template.jinja").is_file()
            and try_to_load_from_cache(repo_id, "chat_template.jinja") is not _CACHED_NO_EXIST):
        return None  # not downloaded, and not known to be missing: the hub may have a template the cache lacks
    return as_saved_counter(config.parent)


def as_saved_counter(path: Path) -> TokenCounter | None:
    """:func:`saved_counter` of a model directory (a local one, or a hub snapshot) whose ``tokenizer_config.json``
    names a class in :data:`AS_SAVED` and no remote code (``auto_map``); None otherwise."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in AS_SAVED or "auto_map" in config:
        return None
    return saved_counter(path)


def saved_counter(path: Path, bounded: bool = False) -> TokenCounter | None:
    """The counter of a tokenizer saved by transformers in ``path`` (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja`` or the config's ``chat_template``); None when a part it needs is missing or is not a
    single plain template. ``bounded``: its vocabulary is known to keep :meth:`TokenCounter.bound` (a byte-level or
    byte-fallback one; tests/test_light_checks.py checks the embedded models')."""
    from tokenizers import Tokenizer

    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict) or not (path / "tokenizer.json").is_file():
        return None
    jinja = path / "chat_template.jinja"
    template = jinja.read_text() if jinja.is_file() else config.get("chat_template")
    if template is not None and (not isinstance(template, str) or GENERATION_TAG.search(template)):
        return None  # a list of named templates, or one with {% generation %}: transformers' own handling
    specials = {k: v if isinstance(v, str) else v.get("content") for k, v in config.items()
                if k in SPECIAL_TOKENS and isinstance(v, str | dict)}
    return TokenCounter(lambda: Tokenizer.from_file(str(path / "tokenizer.json")), template,
                        {k: v for k, v in specials.items() if isinstance(v, str)}, bounded)


def check_room(prompts: list[Prompt], lengths: list[int], max_new_tokens: int, context: int | None, source: str,
               count: Callable[[str], int]) -> None:
    """Refuse (UserError) a prompt whose ``lengths`` tokens and whole generation could pass the model's ``context``
    (None: unknown), then a ``max_new_tokens`` that cannot hold a builtin suite's answer counted exactly by ``count``
    (``kvdiag.tasks.suites.check_generation_room``). The one check of the free-running stage (transformers' tokenizer)
    and
    of the CLI before torch (a :class:`TokenCounter`)."""
    for p, n in zip(prompts, lengths, strict=True):
        if context and n + max_new_tokens > context:
            raise UserError(f"--prompts {source}: prompt {p.prompt_id} has {n} tokens, so its generation could reach "
                            f"{n + max_new_tokens} > the model's context of {context}; use a shorter suite length or "
                            f"--max-new-tokens {max(1, context - n)} or less")
    check_generation_room(prompts, max_new_tokens, source, count, TOKENIZED)
