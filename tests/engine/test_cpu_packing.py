"""Prepacked bf16 linear layers compute exactly what ``F.linear`` does, so the engine's tokens do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM, SamplingParams
from engine.models import cpu_packing, loader

pytestmark = pytest.mark.skipif(not cpu_packing.packing_applies(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU's torch has no oneDNN bf16")


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_is_bit_identical_to_f_linear(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    hidden = torch.randn(rows, 96, dtype=torch.bfloat16)
    packed = cpu_packing.PackedLinear(linear.weight, linear.bias)
    assert torch.equal(packed(hidden), F.linear(hidden, linear.weight, linear.bias))


def test_packing_replaces_every_linear_and_gives_a_tied_head_its_own_copy(tiny_model_dir: Path) -> None:
    model = loader.load_model(tiny_model_dir, torch.bfloat16, torch.device("cpu"), ops=None)  # type: ignore[arg-type]
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    assert isinstance(model.lm_head, cpu_packing.PackedLinear)
    assert model.lm_head.out_features == model.embed_tokens.num_embeddings


def test_bf16_engine_generates_the_same_tokens_with_and_without_packing(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = ["The quick brown fox", "A different prompt with more words in it"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def generate() -> list[list[int]]:
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="8MiB")
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    packed = generate()
    monkeypatch.setattr(loader, "packing_applies", lambda dtype, device: False)
    assert generate() == packed
