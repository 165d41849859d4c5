"""A KV budget below two blocks is refused from the model's config alone, exactly where the engine refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, check_kv_cache_budget

# K and V x 2 layers x 16 tokens per block x 2 KV heads x head_dim 16 (hidden 64 / 4 heads): the tiny Llama's block
BLOCK_ELEMENTS = 2 * 2 * 16 * 2 * 16


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [
    ("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "float16"),
    ("float32", "auto"),  # fp16 where the CPU holds the weights in fp16 (AVX2 and F16C), else fp32
])
def test_the_startup_check_and_the_engine_agree_at_two_blocks(
    tiny_model_dir: Path, dtype: str, kv_cache_dtype: str
) -> None:
    def config(budget: int) -> EngineConfig:
        return EngineConfig(model=str(tiny_model_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                            kv_cache_memory=budget, device="cpu")

    two_blocks = 2 * BLOCK_ELEMENTS * config(1 << 20).kv_cache_torch_dtype().itemsize
    check_kv_cache_budget(config(two_blocks), tiny_model_dir)
    assert LLMEngine(config(two_blocks)).num_gpu_blocks == 2
    refusal = f"kv_cache_memory of {two_blocks - 1} bytes holds 1 blocks of {two_blocks // 2} bytes"
    with pytest.raises(ValueError, match=refusal):
        check_kv_cache_budget(config(two_blocks - 1), tiny_model_dir)
    with pytest.raises(ValueError, match=refusal):
        LLMEngine(config(two_blocks - 1))
