"""Prepacked bf16 linear layers compute exactly what ``F.linear`` does, so the engine's tokens do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM, SamplingParams
from engine.models import cpu_packing, loader

needs_bf16 = pytest.mark.skipif(not cpu_packing.packing_applies(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU's torch has no oneDNN bf16")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_is_bit_identical_to_f_linear(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    hidden = torch.randn(rows, 96, dtype=torch.bfloat16)
    packed = cpu_packing.PackedLinear(linear.weight, linear.bias)
    assert torch.equal(packed(hidden), F.linear(hidden, linear.weight, linear.bias))


@needs_bf16
def test_packing_replaces_every_linear_and_gives_a_tied_head_its_own_copy(tiny_model_dir: Path) -> None:
    model = loader.load_model(tiny_model_dir, torch.bfloat16, torch.device("cpu"), ops=None)  # type: ignore[arg-type]
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    assert isinstance(model.lm_head, cpu_packing.PackedLinear)
    assert model.lm_head.out_features == model.embed_tokens.num_embeddings


@needs_bf16
def test_bf16_engine_generates_the_same_tokens_with_and_without_packing(tiny_model_dir: Path) -> None:
    prompts = ["The quick brown fox", "A different prompt with more words in it"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def generate(packing: str) -> list[list[int]]:
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="8MiB", cpu_weight_packing=packing)
        assert isinstance(llm.engine.model.lm_head, cpu_packing.PackedLinear) == (packing == "auto")
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
