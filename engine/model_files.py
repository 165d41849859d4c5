"""Prepare model folders: convert a GGUF once into the cache (torch); finding folders is core.model_files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.model_files import (
    ModelNotPreparedError,
    cache_dir,  # noqa: F401  (benchmarks/baselines/llama_cpp.py imports it from here)
    converted_dir,
    gguf_source,
    is_prepared,
    prepared_folder,
)


def resolve_model(model: str, cache_root: Path | None = None) -> Path:
    """A local folder with ``config.json``, tokenizer files and safetensors for ``model``.

    ``model`` is a built-in name, a Hugging Face model folder, or a ``.gguf`` file; GGUF
    weights are converted once into the cache directory. Nothing is downloaded.
    """
    try:
        return prepared_folder(model, cache_root)
    except ModelNotPreparedError as missing:
        from engine.gguf_convert import convert_gguf  # needs torch; only on first use

        convert_gguf(gguf_source(model), missing.folder)
        return missing.folder


def load_tokenizer(model: str) -> Any:
    """The tokenizer of ``model`` without loading weights (reads the GGUF directly if unconverted)."""
    from transformers import AutoTokenizer

    target = converted_dir(model)
    if target is not None and not is_prepared(target):
        gguf = gguf_source(model)
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(resolve_model(model))
