"""Greedy outputs match Hugging Face transformers' ``generate`` token for token (fp32, exact numerics)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of "
    "worms and an oozy smell, nor yet a dry, bare, sandy hole",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time",
    "Q: What is the boiling point of water?\nA:",
    "a",
]


def engine_greedy(
    folder: Path, prompts: list[str], max_tokens: int, **engine_kwargs: object
) -> tuple[list[list[int]], LLM]:
    # "exact" keeps fp32 weights on F.linear, the kernel transformers runs; the default packing rounds differently
    llm = LLM(model=str(folder), dtype="float32", cpu_weight_packing="exact", **engine_kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir: Path) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, PROMPTS, 48)


def test_tiny_llama_batch_matches_transformers(tiny_model_dir: Path, tiny_reference: list[list[int]]) -> None:
    tokens, llm = engine_greedy(tiny_model_dir, PROMPTS, 48, kv_cache_memory="8MiB")
    assert tokens == tiny_reference
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tiny_llama_matches_under_preemption(tiny_model_dir: Path, tiny_reference: list[list[int]], mode: str) -> None:
    # 12 blocks of 16 tokens cannot hold 8 sequences of up to ~90 tokens at once
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    tokens, llm = engine_greedy(
        tiny_model_dir, PROMPTS, 48, kv_cache_memory=12 * block_bytes, preemption_mode=mode, watermark=0.0,
    )
    assert tokens == tiny_reference
    stats = llm.stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_blocks_swapped_out > 0 and stats.num_blocks_swapped_in == stats.num_blocks_swapped_out
    else:
        assert stats.num_preemptions_recompute > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_chunked_prefill_gives_same_tokens(tiny_model_dir: Path, tiny_reference: list[list[int]]) -> None:
    tokens, _ = engine_greedy(
        tiny_model_dir, PROMPTS, 48, kv_cache_memory="8MiB", max_num_batched_tokens=8, max_num_seqs=8)
    assert tokens == tiny_reference


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_dir: Path) -> None:
    prompts = PROMPTS[:4]
    expected = hf_greedy(smollm2_dir, prompts, 24)
    tokens, _ = engine_greedy(smollm2_dir, prompts, 24, kv_cache_memory="64MiB")
    assert tokens == expected
