"""The tokens an answer needs, as token positions: where a builtin suite's prompt holds them (``Prompt.needs``, char
spans of its question) and where a generation wrote them (``Prompt.answer_needs``: the needed text, found in the
generated text), and the share of cache slots that kept each of them at each compaction.

Positions come from the tokenizer's offsets of the very text that was encoded (the chat template rendered as
``kvdiag.tasks.prompts.encode_prompt`` renders it), so the tokens at the positions decode to the needed text
(tests/test_needed.py). A token counts as needed when it overlaps a needed span.
"""

from __future__ import annotations

from kvdiag.tasks.prompts import DEFAULT_INSTRUCTION, Prompt, rendered_prompt

KEPT_SHARE = 0.5  # a needed token counts as kept when at least this share of its (layer, KV head) slots hold it


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Indices of the tokens whose char range [a, b) overlaps one of ``spans``."""
    return [i for i, (a, b) in enumerate(offsets) if b > a and any(a < e and s < b for s, e in spans)]


def prompt_positions(tokenizer, prompt: Prompt, chat: bool = True,
                     instruction: str | None = DEFAULT_INSTRUCTION) -> list[int]:
    """Positions in the encoded prompt (:func:`kvdiag.tasks.prompts.encode_prompt` with the same
    ``chat``/``instruction``)
    of the tokens that overlap ``prompt.needs``: in its final user turn (the shots before it hold similar text)."""
    if not prompt.needs:
        return []
    text, special = rendered_prompt(tokenizer, prompt, chat, instruction)
    at = text.rfind(prompt.text)  # the question's own turn: the last place its text occurs
    if at < 0:
        raise ValueError(f"prompt {prompt.prompt_id}: its text is not in its rendered prompt")
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    return _overlapping(enc["offset_mapping"], [(at + s, at + e) for s, e in prompt.needs])


def _token_spans(ends: list[int]) -> list[tuple[int, int]]:
    """The char range [a, b) of each generated token in the decoded text, from :func:`decoded_ends`."""
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _final_cut(text: str) -> int:
    """Char offset where ``text``'s last non-empty line starts (0 for one line)."""
    return text.rstrip().rfind("\n") + 1


def needed_texts(prompt: Prompt) -> list[str]:
    """The texts the answer needs, as its expected generation writes them (``answer_needs`` spans of ``answer``)."""
    return [prompt.answer[s:e] for s, e in prompt.answer_needs] if prompt.answer else []


def decoded_ends(tokenizer, generated: list[int]) -> list[int]:
    """The char length of the decoded text after each generated token (decoding growing prefixes: the same text as
    replay's ``text`` column, special tokens skipped). Pass it to :func:`generated_positions` and
    :func:`final_line_start` to decode a generation's prefixes once."""
    return [len(tokenizer.decode(generated[: i + 1], skip_special_tokens=True)) for i in range(len(generated))]


def generated_positions(tokenizer, token_ids: list[int], prompt_len: int, needed: str,
                        ends: list[int] | None = None) -> list[int]:
    """Absolute positions of the generated tokens (``token_ids[prompt_len:]``) that overlap the first place the
    generation wrote ``needed``; [] when it never wrote it. ``ends``: :func:`decoded_ends` of the generation."""
    generated = token_ids[prompt_len:]
    at = tokenizer.decode(generated, skip_special_tokens=True).find(needed)
    if at < 0:
        return []
    ends = decoded_ends(tokenizer, generated) if ends is None else ends
    return [prompt_len + i for i in _overlapping(_token_spans(ends), [(at, at + len(needed))])]


def final_line_start(tokenizer, token_ids: list[int], prompt_len: int, ends: list[int] | None = None) -> int:
    """Absolute position of the generated token that holds the first character of the generation's last non-empty
    line (where a suite's answer reads what it needs); the end of the sequence for a generation of one line.
    ``ends``: :func:`decoded_ends` of the generation."""
    generated = token_ids[prompt_len:]
    cut = _final_cut(tokenizer.decode(generated, skip_special_tokens=True))
    if cut == 0:
        return len(token_ids)
    ends = decoded_ends(tokenizer, generated) if ends is None else ends
    return prompt_len + next(i for i, end in enumerate(ends) if end > cut)


def final_line_positions(tokenizer, token_ids: list[int], prompt_len: int, needed: list[str],
                         ends: list[int] | None = None) -> list[int] | None:
    """Absolute positions of the generated tokens that overlap the last place the final line (from
    :func:`final_line_start`) wrote each of ``needed``: the tokens where the answer reads what it needs. None when
    the final line lacks one of them (the generation did not give the answer). ``ends``: :func:`decoded_ends`."""
    generated = token_ids[prompt_len:]
    text = tokenizer.decode(generated, skip_special_tokens=True)
    cut = _final_cut(text)
    spans = []
    for want in needed:
        at = text.rfind(want, cut)
        if at < 0:
            return None
        spans.append((at, at + len(want)))
    ends = decoded_ends(tokenizer, generated) if ends is None else ends
    return [prompt_len + i for i in _overlapping(_token_spans(ends), spans)]


def slot_shares(kept: list[tuple[int, list[int]]], slots: int, positions: list[int]) -> list[list[float | None]]:
    """Per position of ``positions``, per compaction of ``kept`` ((checkpoint t, kept count per position of
    [0, t))): the share of the ``slots`` (layer, KV head) slots that held it after that compaction; None where the
    position was not yet written (t <= position)."""
    return [[counts[p] / slots if p < t else None for t, counts in kept] for p in positions]
