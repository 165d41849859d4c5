"""Batched swaps and copy-on-write leave the caches exactly as per-layer block copies do."""

from __future__ import annotations

import pytest
import torch

from engine.cache_engine import CacheEngine
from paged_kernels import reference

NUM_LAYERS = 3
CUDA = torch.cuda.is_available()
# on CUDA the host copies run on a side stream with a pinned pool: compare after they finished
GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])


@pytest.fixture(params=["cpu", GPU])
def cache(request: pytest.FixtureRequest) -> CacheEngine:
    """A cache engine of 3 layers, 10 device and 6 host blocks, filled with random values."""
    engine = CacheEngine(NUM_LAYERS, 10, 6, 4, 2, 8, torch.float32, torch.device(request.param))
    engine.gpu_kv.normal_()
    engine.cpu_kv.normal_()
    return engine


def per_layer(cache: CacheEngine) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of the device and host pools as one tensor per layer and K/V, the per-layer layout."""
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)  # the host pool is written asynchronously
    device = [part.clone() for layer in cache.gpu_kv for part in layer]
    host = [cache.cpu_kv[:, layer, part].clone() for layer in range(NUM_LAYERS) for part in (0, 1)]
    return device, host


def assert_same(cache: CacheEngine, device: list[torch.Tensor], host: list[torch.Tensor]) -> None:
    """The cache holds exactly the per-layer tensors ``device`` and ``host``."""
    actual_device, actual_host = per_layer(cache)
    for ours, theirs in zip(actual_device + actual_host, device + host, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("direction", "mapping"), [("out", [(7, 0), (2, 5), (9, 3)]), ("in", [(5, 1), (0, 8)])])
def test_swaps_match_per_layer_copies(cache: CacheEngine, direction: str, mapping: list[tuple[int, int]]) -> None:
    device, host = per_layer(cache)
    sources, destinations = (device, host) if direction == "out" else (host, device)
    for src, dst in zip(sources, destinations):
        reference.swap_blocks(src, dst, torch.tensor(mapping))
    getattr(cache, f"swap_{direction}")(mapping)
    assert_same(cache, device, host)


def test_copy_on_write_matches_per_layer_copies(cache: CacheEngine) -> None:
    mapping = [(3, 6), (4, 1), (3, 0)]
    device, host = per_layer(cache)
    reference.copy_blocks(device[0::2], device[1::2], torch.tensor(mapping))
    cache.copy(mapping)
    assert_same(cache, device, host)


def test_a_swap_out_then_in_round_trips_every_layer(cache: CacheEngine) -> None:
    before = cache.gpu_kv[:, :, [2, 4]].clone()
    cache.swap_out([(2, 1), (4, 3)])
    cache.gpu_kv[:, :, [2, 4]] = 0.0
    cache.swap_in([(1, 7), (3, 8)])
    assert torch.equal(cache.gpu_kv[:, :, [7, 8]], before)


def test_a_mapping_past_the_pool_is_refused_by_side(cache: CacheEngine) -> None:
    with pytest.raises(ValueError, match=r"destination ids must be in \[0, 6\)"):
        cache.swap_out([(0, 6)])
