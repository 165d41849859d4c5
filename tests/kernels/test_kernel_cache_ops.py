"""The Triton cache-writing and block-copying kernels match the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

from paged_kernels import reference

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize(
    ("key_dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_reshape_and_cache_writes_the_same_slots_and_skips_padding(
    triton_ops, make_case, device, head_dim, key_dtype, cache_dtype
):
    case = make_case([40], head_dim=head_dim, dtype=cache_dtype, num_kv_heads=3, device=device)
    caches = [(case.key_cache.clone(), case.value_cache.clone()) for _ in range(2)]
    # K and V as strided views into one fused projection.
    fused = torch.randn(5, 2, 3, head_dim).to(device=device, dtype=key_dtype)
    slots = torch.tensor([0, -1, 37, 15, -1], device=device)
    for backend, (key_cache, value_cache) in zip((triton_ops, reference), caches):
        backend.reshape_and_cache(fused[:, 0], fused[:, 1], key_cache, value_cache, slots)
    # The interpreter truncates fp32 -> bf16 where a GPU rounds to nearest: one ulp apart.
    ulp = 2.0**-7 if INTERPRETED and key_dtype != cache_dtype else 0.0
    for ours, theirs in zip(caches[0], caches[1]):
        torch.testing.assert_close(ours, theirs, rtol=ulp, atol=0.0)


def test_reshape_and_cache_leaves_skipped_slots_untouched(triton_ops, make_case, device):
    case = make_case([16], device=device)
    before = case.key_cache.clone()
    key = torch.randn(2, 2, 64, device=device)
    slots = torch.tensor([-1, -1], device=device)
    triton_ops.reshape_and_cache(key, key, case.key_cache, case.value_cache, slots)
    assert torch.equal(case.key_cache, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_copies_every_layer(triton_ops, make_case, device, dtype):
    layers = [
        make_case([64], dtype=dtype, head_dim=80, spare_blocks=4, device=device) for _ in range(2)
    ]
    mapping = torch.tensor([[0, 4], [2, 6], [2, 7]], device=device)
    copies = {}
    for backend in (triton_ops, reference):
        keys = [layer.key_cache.clone() for layer in layers]
        values = [layer.value_cache.clone() for layer in layers]
        backend.copy_blocks(keys, values, mapping)
        copies[backend] = keys + values
    for ours, theirs in zip(copies[triton_ops], copies[reference]):
        assert torch.equal(ours, theirs)
    assert not torch.equal(copies[reference][0], layers[0].key_cache)


def test_copy_blocks_with_an_empty_mapping_changes_nothing(triton_ops, make_case, device):
    case = make_case([16], device=device)
    before = case.key_cache.clone()
    empty = torch.zeros(0, 2, dtype=torch.int64, device=device)
    triton_ops.copy_blocks([case.key_cache], [case.value_cache], empty)
    assert torch.equal(case.key_cache, before)


def test_swap_blocks_copies_blocks_between_pools(triton_ops, make_case, device):
    device_pool = make_case([32], device=device).key_cache
    cpu_pool = torch.zeros_like(device_pool, device="cpu")
    triton_ops.swap_blocks(device_pool, cpu_pool, torch.tensor([[1, 0], [0, 2]]))
    assert torch.equal(cpu_pool[0], device_pool[1].cpu())
    assert torch.equal(cpu_pool[2], device_pool[0].cpu())
    assert not cpu_pool[1].any()
