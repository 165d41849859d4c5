"""Launch parameters of the attention kernels: ``num_warps`` and ``num_stages`` per device and shape.

A pure function of the tile shape and the device's shared memory, so it is tested without a GPU
(Triton's interpreter ignores both parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

# 99 KiB: the opt-in shared memory per block of the smallest recent parts (sm86/sm89); an A100
# has 163 KiB and an H100/H200 227 KiB.
TYPICAL_SHARED_MEMORY_BYTES = 99 * 1024
MAX_STAGES = 3
# Elements of the two dots in one loop iteration (query rows x tile x head_dim) above which
# eight warps share the work instead of four.
EIGHT_WARPS_WORK = 32 * 64 * 128


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """``num_warps`` and ``num_stages`` of one kernel launch."""

    num_warps: int
    num_stages: int


def stage_bytes(tile_tokens: int, head_dim_pad: int, element_bytes: int) -> int:
    """Shared memory one pipeline stage buffers: a key tile and a value tile."""
    return 2 * tile_tokens * head_dim_pad * element_bytes


def choose_launch(
    query_rows: int, tile_tokens: int, head_dim_pad: int, element_bytes: int,
    shared_memory_bytes: int = TYPICAL_SHARED_MEMORY_BYTES,
) -> LaunchConfig:
    """Warps from the work of one loop iteration; as many stages (1 to ``MAX_STAGES``) as fit in
    ``shared_memory_bytes`` next to the query tile and the probabilities (an estimate: Triton
    also stages operands of the dots, which the margin of the fp32 probabilities covers)."""
    for name, value in (("query_rows", query_rows), ("tile_tokens", tile_tokens),
                        ("head_dim_pad", head_dim_pad), ("element_bytes", element_bytes),
                        ("shared_memory_bytes", shared_memory_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    work = query_rows * tile_tokens * head_dim_pad
    num_warps = 8 if work > EIGHT_WARPS_WORK else 4
    fixed_bytes = query_rows * head_dim_pad * element_bytes + query_rows * tile_tokens * 4
    fitting = (shared_memory_bytes - fixed_bytes) // stage_bytes(tile_tokens, head_dim_pad, element_bytes)
    return LaunchConfig(num_warps, max(1, min(MAX_STAGES, fitting)))


@cache
def shared_memory_bytes(device: torch.device) -> int:
    """Shared memory a block may use on ``device``; the typical amount off CUDA."""
    if device.type != "cuda":
        return TYPICAL_SHARED_MEMORY_BYTES
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block))
