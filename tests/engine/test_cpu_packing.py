"""Prepacked linear layers: bf16 computes exactly what ``F.linear`` does, fp32 (packed by default) within
rounding of it, and the ``exact`` mode keeps fp32 on ``F.linear``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import numerics
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
        assert is_packed == (packing == "exact" and BF16_PACKS)
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    assert generate("exact") == generate("off")


def test_fp32_is_packed_by_default_and_not_in_exact_mode() -> None:
    cpu = torch.device("cpu")
    assert cpu_packing.packing_applies(torch.float32, cpu) == torch.backends.mkldnn.is_available()
    assert not cpu_packing.packing_applies(torch.float32, cpu, "exact")
    assert not cpu_packing.packing_applies(torch.float32, cpu, "off")


def test_packed_fp32_linear_stays_within_rounding_of_f_linear() -> None:
    linear = nn.Linear(96, 160, bias=False)
    hidden = torch.randn(5, 96)
    packed = cpu_packing.PackedLinear(linear.weight, None)
    torch.testing.assert_close(packed(hidden), F.linear(hidden, linear.weight), atol=1e-5, rtol=1e-5)


def test_default_fp32_engine_keeps_the_exact_modes_log_probs_and_greedy_tokens(tiny_model_dir: Path) -> None:
    mean, mean_abs = numerics.logprob_change(tiny_model_dir, "fp32-packed")
    assert abs(mean) < 1e-5 and mean_abs < 1e-4

    def generate(packing: str) -> list[list[int]]:
        llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", cpu_weight_packing=packing)
        assert isinstance(llm.engine.model.lm_head, cpu_packing.PackedLinear) == (packing == "auto")
        return numerics.greedy_tokens(llm, numerics.PROMPTS, 24)

    assert numerics.agreement(generate("auto"), generate("exact")) == 1.0


def test_an_unknown_packing_mode_names_the_argument(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cpu_weight_packing must be one of"):
        LLM(model=str(tiny_model_dir), cpu_weight_packing="sometimes")
