"""The engine gives the same greedy tokens with the Triton kernels as with the torch path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # must be set before paged_kernels.triton_ops defines its kernels; the interpreter runs them on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, SamplingParams  # noqa: E402

PROMPTS = ["Hello, my name is", "The capital of France is a city that", "1, 2, 3,"]


def greedy_tokens(folder: Path, backend: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory="4MiB", attention_backend=backend, **kwargs)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_triton_and_torch_backends_agree(tiny_model_dir: Path) -> None:
    # 8-token blocks and 8-token prefill chunks exercise decode, chunked prefill over cached blocks
    expected = greedy_tokens(tiny_model_dir, "torch", block_size=8, max_num_batched_tokens=8, max_num_seqs=4)
    assert greedy_tokens(tiny_model_dir, "triton", block_size=8, max_num_batched_tokens=8, max_num_seqs=4) == expected


def test_unknown_backend_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", attention_backend="cuda-magic")
