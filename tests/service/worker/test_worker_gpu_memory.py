"""--gpu-memory-utilization as vLLM means it: a share of the GPU's total memory, the worker's weights included."""

from __future__ import annotations

import pytest
import torch

from engine.cache_engine import default_kv_cache_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_the_kv_budget_is_the_share_of_total_memory_left_after_the_weights() -> None:
    device = torch.device("cuda")
    weights = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # stands in for loaded weights
    _, total = torch.cuda.mem_get_info(device)
    budget = default_kv_cache_bytes(device, 0.5)
    assert budget + torch.cuda.memory_reserved(device) == int(total * 0.5)
    assert budget <= total * 0.5 - weights.numel()


def test_a_share_smaller_than_the_weights_fails_naming_the_flag() -> None:
    device = torch.device("cuda")
    weights = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    share = weights.numel() / torch.cuda.mem_get_info(device)[1] / 2
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        default_kv_cache_bytes(device, share)
