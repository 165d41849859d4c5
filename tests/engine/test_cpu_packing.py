"""Prepacked bf16 linear layers compute exactly what ``F.linear`` does, so the engine's tokens do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM, SamplingParams
from engine.models import cpu_packing, loader

BF16_PACKS = cpu_packing.packing_applies(torch.bfloat16, torch.device("cpu"))


@pytest.mark.onednn_bf16
@pytest.mark.skipif(not BF16_PACKS, reason="oneDNN's bf16 weight reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_is_bit_identical_to_f_linear(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    hidden = torch.randn(rows, 96, dtype=torch.bfloat16)
    packed = cpu_packing.PackedLinear(linear.weight, linear.bias)
    assert torch.equal(packed(hidden), F.linear(hidden, linear.weight, linear.bias))


def test_bf16_packing_applies_exactly_where_onednn_supports_bf16() -> None:
    assert BF16_PACKS == (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# bf16 arithmetic is emulated on any CPU: the tests below run everywhere and expect packing only where
# oneDNN's weight reorder (the one step that needs the instructions) is available.
def test_bf16_loading_packs_every_linear_where_it_applies(tiny_model_dir: Path) -> None:
    model = loader.load_model(tiny_model_dir, torch.bfloat16, torch.device("cpu"), ops=None)  # type: ignore[arg-type]
    packed = [isinstance(module, cpu_packing.PackedLinear) for module in model.modules()]
    unpacked = [isinstance(module, nn.Linear) for module in model.modules()]
    assert (any(packed), any(unpacked)) == (BF16_PACKS, not BF16_PACKS)
    if BF16_PACKS:  # a tied head gets its own packed copy
        assert model.lm_head.out_features == model.embed_tokens.num_embeddings


def test_bf16_engine_generates_the_same_tokens_with_and_without_packing(tiny_model_dir: Path) -> None:
    prompts = ["The quick brown fox", "A different prompt with more words in it"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def generate(packing: str) -> list[list[int]]:
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="8MiB", cpu_weight_packing=packing)
        is_packed = isinstance(llm.engine.model.lm_head, cpu_packing.PackedLinear)
        assert is_packed == (packing == "auto" and BF16_PACKS)
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    assert generate("auto") == generate("off")


def test_fp32_is_packed_only_when_asked_and_then_stays_within_rounding() -> None:
    cpu = torch.device("cpu")
    assert not cpu_packing.packing_applies(torch.float32, cpu, "auto")
    assert cpu_packing.packing_applies(torch.float32, cpu, "all")
    linear = nn.Linear(96, 160, bias=False)
    hidden = torch.randn(5, 96)
    packed = cpu_packing.PackedLinear(linear.weight, None)
    torch.testing.assert_close(packed(hidden), F.linear(hidden, linear.weight), atol=1e-5, rtol=1e-5)


def test_an_unknown_packing_mode_names_the_argument(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cpu_weight_packing must be one of"):
        LLM(model=str(tiny_model_dir), cpu_weight_packing="sometimes")
