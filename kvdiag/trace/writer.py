"""``trace_prompts``: generate each reasoning trace and write the Trace directory (format: docs/trace.md).

Layout: ``manifest.json``, ``tokens.parquet``, ``tensors/<prompt_id>/layer_<LLL>.safetensors`` with
``q [H, T, d]``, ``k [Hkv, T, d]``, ``v [Hkv, T, d]`` (post-RoPE, storage dtype); ``settings.store`` (``--store``)
may write only k/v, some layers or none (the reader rebuilds the rest). Each finished prompt
is committed atomically (tensors, then its token part ``parts/<prompt_id>.parquet``, then its manifest
entry ``parts/<prompt_id>.json``); an interrupted run keeps finished prompts and a rerun continues with
the rest. Prompts can be split over processes (``shard=(i, n)``, torchrun ranks): each writes only its
own parts, and one process (``merge=True``) rebuilds ``manifest.json`` and ``tokens.parquet`` from them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from functools import partial
from pathlib import Path

import polars as pl
import torch
from rich.progress import Progress
from safetensors.torch import save_file
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from kvdiag.cache import PositionedCache
from kvdiag.core.distributed import Group, parse_shard
from kvdiag.core.errors import UserError
from kvdiag.core.io import check_writable, write_json
from kvdiag.core.parsing import STORAGE_DTYPE_NAMES, STORE_WORDS, parse_store, store_spec  # noqa: F401  (the writer's API)
from kvdiag.core.parts import PartStore
from kvdiag.core.progress import progress_bar
from kvdiag.core.provenance import provenance
from kvdiag.model.load import LoadedModel, check_device, load_model, parse_dtype
from kvdiag.tasks.prompts import Prompt, encode_prompt
from kvdiag.trace.config import GenerationSettings  # noqa: F401  (the writer's API)
from kvdiag.trace.hooks import TRACE_ATTN, Recorder, attention_scale, recording
from kvdiag.trace.manifest import FORMAT_VERSION

STORAGE_DTYPES = {name: getattr(torch, name) for name in STORAGE_DTYPE_NAMES}


# the largest |q|, |k|, |v| a Trace holds: q.k over a head dim up to 2^16 and a squared norm stay below float32's
# 3.4e38 (2^48 * 2^48 * 2^16 = 2^112), so no stage's fp32 arithmetic overflows; no model's attention inputs come near
MAX_VALUE = float(2**48)


def out_of_range(x: torch.Tensor) -> torch.Tensor:
    """bool, x's shape: where a q/k/v value is not finite or past ``MAX_VALUE`` (which is inf in float16, whose own
    overflow is inf: caught as not finite)."""
    return ~(torch.isfinite(x) & (x.abs() <= MAX_VALUE))


def stored_names(store: dict, layer: int) -> tuple[str, ...]:
    """The tensors of ``layer`` written to disk under ``store`` (a manifest without one: every q/k/v)."""
    if layer not in store["layers"]:
        return ()
    return ("k", "v") if store["mode"] == "kv" else ("q", "k", "v")


class StoreRecorder(Recorder):
    """A :class:`Recorder` that keeps only what ``store`` writes, so a ``kv``/``none``/``LAYERS`` run also
    holds less in memory while generating."""

    def __init__(self, num_layers: int, dtype: torch.dtype, store: dict, capacity: int = 64):
        super().__init__(num_layers, dtype, capacity)
        self.names = [stored_names(store, l) for l in range(num_layers)]

    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.names[layer]:
            return
        if "q" not in self.names[layer]:
            q = q[..., :0]  # [H, n, 0]: an empty block, so the queries cost no memory
        super().add(layer, q, k, v)

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        return {name: t for name, t in super().layer(layer).items() if name in self.names[layer]}


class TokenStats(LogitsProcessor):
    """Log-probability and entropy of the raw (temperature-1) next-token distribution of each generated token,
    computed as it is produced: one [V] row is kept at a time, never the [T, V] logits of the generation.

    A logits processor sees the raw scores before the sampling warpers (temperature, top-p); the chosen token of
    a step is known at the next call (or, for the last one, to :meth:`finish`). It also keeps end-of-sequence
    out until ``min_new_tokens`` tokens are generated (after the statistics are taken, so they stay raw)."""

    def __init__(self, prompt_len: int, min_new_tokens: int, eos_ids: list[int]):
        self.prompt_len, self.min_new_tokens, self.eos_ids = prompt_len, min_new_tokens, eos_ids
        self.logprob: list[float] = []
        self.entropy: list[float] = []
        self._last: torch.Tensor | None = None  # log-probs [V] of the step whose token is not known yet

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._last is not None:
            self.logprob.append(float(self._last[input_ids[0, -1]]))
        logp = torch.log_softmax(scores[0].float(), dim=-1)
        self.entropy.append(float(-(logp.exp() * logp).sum()))
        self._last = logp
        if input_ids.shape[1] - self.prompt_len < self.min_new_tokens:
            scores = scores.clone()
            scores[:, self.eos_ids] = float("-inf")
        return scores

    def finish(self, last_token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob [G], entropy [G]) once generation ended on ``last_token``."""
        if self._last is not None:
            self.logprob.append(float(self._last[last_token]))
            self._last = None
        return torch.tensor(self.logprob, dtype=torch.float64), torch.tensor(self.entropy, dtype=torch.float64)


class _TokenProgress(BaseStreamer):
    def __init__(self, progress: Progress, task):
        self.progress, self.task, self.first = progress, task, True

    def put(self, value):
        if self.first:  # generate() first puts the prompt
            self.first = False
            return
        self.progress.advance(self.task)

    def end(self):
        pass


def layer_file(root: Path, prompt_id: str, layer: int) -> Path:
    return root / "tensors" / prompt_id / f"layer_{layer:03d}.safetensors"


def _manifest_path(root: Path) -> Path:
    return root / "manifest.json"


HEADER = "_header.json"  # the parts' settings stamp; no prompt id starts with "_" (prompts.safe_id)


def _check_compatible(existing: dict, lm: LoadedModel, settings: GenerationSettings, root: Path) -> None:
    had = existing["model"]
    if not lm.is_model_of(had, config=True):
        raise UserError(
            f"--out {root} holds a Trace of another model ({had['spec']}, weights {had['weights_hash']}); "
            "choose a new output directory"
        )
    # a Trace from before --store has every tensor: its settings read as store="all"
    if {"store": "all", **existing["generation"]} != asdict(settings):
        raise UserError(f"--out {root} holds a Trace made with other generation settings; choose a new output "
                        "directory or the same settings")


def trace_prompts(
    lm: LoadedModel, prompts: list[Prompt], out: str | os.PathLike, settings: GenerationSettings | None = None,
    prompts_source: str | None = None, show_progress: bool = True, shard: tuple[int, int] = (0, 1), merge: bool = True,
) -> Path:
    """Generate a trace for each prompt of ``shard`` (prompts i with i % n == shard index) into the Trace
    directory ``out``; returns its path. With ``merge`` this process is the only writer: it merges the
    parts of other processes and keeps ``manifest.json`` and ``tokens.parquet`` up to date after every
    prompt. Without it, only parts are written (several processes at once)."""
    settings = settings or GenerationSettings()
    store = store_spec(settings.store, lm.model.config.num_hidden_layers)
    _check_context(lm, prompts, settings)
    root = Path(out)
    parts = PartStore(root / "parts", root)
    header = _header(root, parts, lm, settings, prompts_source, store)
    done = _finished(root, parts, prompts)
    manifest = {**header, "prompts": done}
    if merge and done:
        _write_manifest(root, parts, manifest)  # parts of other processes, or a run interrupted before its merge
    mine = [p for i, p in enumerate(prompts) if i % shard[1] == shard[0]]
    todo = [p for p in mine if p.prompt_id not in done]
    storage, tok = STORAGE_DTYPES[settings.storage_dtype], lm.tokenizer
    gen_cfg = GenerationConfig(
        max_new_tokens=settings.max_new_tokens, do_sample=settings.sample,
        temperature=settings.temperature if settings.sample else None,
        top_p=settings.top_p if settings.sample else None, top_k=None, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        return_dict_in_generate=True,
    )
    with progress_bar(show_progress) as progress:
        prompt_task = progress.add_task("trace: prompts", total=len(mine), completed=len(mine) - len(todo))
        for prompt in todo:
            token_task = progress.add_task(f"  {prompt.prompt_id}", total=settings.max_new_tokens)
            record = _trace_one(lm, prompt, settings, gen_cfg, storage, _TokenProgress(progress, token_task), store)
            manifest["prompts"][prompt.prompt_id] = _commit_prompt(root, parts, prompt, record)
            if merge:
                _write_manifest(root, parts, manifest)
            progress.remove_task(token_task)
            progress.advance(prompt_task)
    return root


def trace_files(
    prompts: list[Prompt], out: Path, settings: GenerationSettings, *, model: str, dtype: str, device: str,
    revision: str | None, trust_remote_code: bool, prompts_source: str, shard: str | None, quiet: bool,
) -> Path | None:
    """``kvdiag trace``: load the model and trace this process's share of ``prompts`` (``shard``, or torchrun's
    rank); returns the Trace directory where this process merged. Bad input is refused before the model loads."""
    part = parse_shard(shard)
    check_writable(out, "--out", "dir")
    parse_dtype(dtype)
    check_device(device)
    with Group(device, part) as group:
        lm = load_model(model, dtype=dtype, device=group.device, revision=revision, trust_remote_code=trust_remote_code)
        return group.split(lambda part, merge, show: trace_prompts(
            lm, prompts, out, settings, prompts_source=prompts_source, shard=part, merge=merge,
            show_progress=show and not quiet))


@torch.no_grad()
def _trace_one(
    lm: LoadedModel, prompt: Prompt, settings: GenerationSettings, gen_cfg, storage, streamer, store: dict
) -> dict:
    model, tok = lm.model, lm.tokenizer
    ids = encode_prompt(tok, prompt, chat=settings.chat, instruction=settings.instruction)
    input_ids = torch.tensor([ids], device=model.device)
    capacity = (
        len(ids) + settings.max_new_tokens
    )  # the longest this trace can get: rows and KV cache are allocated once
    rec = StoreRecorder(model.config.num_hidden_layers, storage, store, capacity=capacity)
    stats = TokenStats(len(ids), settings.min_new_tokens, [tok.eos_token_id])
    torch.manual_seed(settings.seed)
    with recording(model, rec):
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_cfg, streamer=streamer,
            logits_processor=LogitsProcessorList([stats]),
            cache=PositionedCache.for_model(model, capacity=capacity),
        )
        seq = out.sequences[0]
        # generate() never feeds its last token; one more step records that token's q/k/v
        last = seq[-1:].view(1, 1)
        model(last, cache=out.past_key_values, position_ids=torch.tensor([[len(seq) - 1]], device=model.device),
              logits_to_keep=1)
    gen = seq[len(ids):].cpu()
    logprob, entropy = stats.finish(int(seq[-1]))
    return {
        "ids": seq.cpu(), "prompt_len": len(ids), "logprob": logprob, "entropy": entropy,
        "layers": [rec.layer(l) for l in range(model.config.num_hidden_layers)],
        "token_text": [tok.decode([i]) for i in seq.tolist()],
        "stop": "eos" if gen.numel() and gen[-1].item() == tok.eos_token_id else "max_new_tokens",
    }


def _check_context(lm: LoadedModel, prompts: list[Prompt], settings: GenerationSettings) -> None:
    """Refuse, before generating anything, a prompt whose trace could outgrow the model's context."""
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    if not limit:
        return
    for prompt in prompts:
        n = len(encode_prompt(lm.tokenizer, prompt, chat=settings.chat, instruction=settings.instruction))
        if n + settings.max_new_tokens > limit:
            raise UserError(f"--max-new-tokens {settings.max_new_tokens}: prompt {prompt.prompt_id} has {n} tokens, "
                            f"so its trace could reach {n + settings.max_new_tokens} > the model's context of {limit}; "
                            f"use --max-new-tokens {max(1, limit - n)} or less")


def _header(root: Path, parts: PartStore, lm: LoadedModel, settings: GenerationSettings, prompts_source: str | None,
            store: dict) -> dict:
    """The manifest without its prompts: that of the existing Trace (checked against this run), else a new one.

    A new header is stamped into ``parts/_header.json`` before any part is written, so that the parts of
    several processes are checked against one model and one set of settings before a manifest exists."""
    check = partial(_check_compatible, lm=lm, settings=settings, root=root)
    if _manifest_path(root).exists():
        header = json.loads(_manifest_path(root).read_text())
        check(header)
        header.pop("prompts", None)
        return header
    # processes starting together may each write the stamp: same model and settings, so any copy is right
    return parts.stamp(HEADER, lambda: _new_header(lm, settings, prompts_source, store), check)


def _new_header(lm: LoadedModel, settings: GenerationSettings, prompts_source: str | None, store: dict) -> dict:
    cfg = lm.model.config
    return {
        "format_version": FORMAT_VERSION,
        **provenance(created=True),
        "model": lm.info,
        "attn_implementation": f"{lm.info['attention']['implementation']} (recorded through the registered "
                               f"attention function {TRACE_ATTN!r})",
        "scale": attention_scale(lm.model),  # layer 0's; every layer's semantics: model.attention
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": lm.info["head_dim"],
        "tensors": "q [H, T, d], k [Hkv, T, d], v [Hkv, T, d]: post-RoPE (and post q/k-norm)",
        "storage_dtype": settings.storage_dtype,
        "store": store,  # which tensors have files; Trace.layer rebuilds the others by one prefill per prompt
        "generation": asdict(settings),
        "prompts_source": prompts_source,
    }


def _finished(root: Path, parts: PartStore, prompts: list[Prompt]) -> dict[str, dict]:
    """Manifest entries of the finished prompts: those in manifest.json (in its order), then those with a
    ``parts/<prompt_id>.json`` (in the order of ``prompts``, then by id), so a merge orders them as one
    process would have."""
    manifest = _manifest_path(root)
    done = dict(json.loads(manifest.read_text())["prompts"]) if manifest.exists() else {}
    order = {p.prompt_id: i for i, p in enumerate(prompts)}
    entries = sorted(parts.root.glob("*.json"), key=lambda f: (order.get(f.stem, len(order)), f.stem))
    for f in entries:
        if f.name != HEADER and f.stem not in done:
            done[f.stem] = json.loads(f.read_text())
    return done


def _commit_prompt(root: Path, parts: PartStore, prompt: Prompt, record: dict) -> dict:
    """Tensors, then the token part, then the manifest entry ``parts/<pid>.json``: a prompt counts as
    finished once its entry exists. Returns the entry."""
    pid, ids = prompt.prompt_id, record["ids"]
    T, P = len(ids), record["prompt_len"]
    tensors = root / "tensors" / pid
    for stale in (root / "tensors").glob(f".{pid}.tmp*"):  # left by a killed attempt at this prompt (never read)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / "tensors" / f".{pid}.tmp{os.getpid()}"
    tmp.mkdir(parents=True)
    for layer, qkv in enumerate(record["layers"]):
        if not qkv:  # not stored (--store): rebuilt on demand by the reader
            continue
        for name, x in qkv.items():  # the reader refuses such a value: never write one
            if bool(out_of_range(x).any()):
                shutil.rmtree(tmp, ignore_errors=True)
                raise UserError(f"prompt {pid}: layer {layer}'s {name} holds a value that is not finite in {x.dtype} "
                                f"or past {MAX_VALUE:.0e} (past the dtype's range, or the model's own overflow); "
                                "trace with --storage-dtype float32")
        save_file(qkv, str(tmp / f"layer_{layer:03d}.safetensors"), metadata={"prompt_id": pid, "layer": str(layer)})
    shutil.rmtree(tensors, ignore_errors=True)  # leftovers of an interrupted attempt
    os.replace(tmp, tensors)
    G = T - P
    null = [None] * P
    part = pl.DataFrame({
        "prompt_id": [pid] * T, "position": list(range(T)), "token_id": ids.tolist(),
        "token_text": record["token_text"], "is_prompt": [True] * P + [False] * G,
        "logprob": null + record["logprob"].tolist(), "entropy": null + record["entropy"].tolist(),
    }, schema_overrides={"logprob": pl.Float64, "entropy": pl.Float64})
    parts.write(f"{pid}.parquet", part, {"kind": "trace_tokens", "prompt_id": pid})
    entry = {
        "prompt_len": P, "length": T, "generated": G, "stop": record["stop"],
        "source_id": prompt.source_id, "answer": prompt.answer, "text": prompt.text,
    }
    parts.write_json(f"{pid}.json", entry)
    return entry


def _write_manifest(root: Path, parts: PartStore, manifest: dict) -> None:
    """The manifest, then ``tokens.parquet`` rebuilt from the token parts of its prompts (a run interrupted
    in between leaves it stale; the next merging run repairs it)."""
    write_json(_manifest_path(root), manifest)
    parts.merge([f"{pid}.parquet" for pid in manifest["prompts"]], root / "tokens.parquet", {"kind": "trace_tokens"})
