"""One-time conversion of a GGUF checkpoint into a safetensors Hugging Face folder."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger(__name__)


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` with transformers and save config, tokenizer and weights in ``target``.

    Written to a temporary folder and renamed, so concurrent processes never see half a model.
    """
    logger.info("converting %s into %s (once)", gguf, target)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are dequantized now; save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
