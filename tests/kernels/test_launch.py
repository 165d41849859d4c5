"""The attention kernels' launch parameters fit the device they launch on."""

from __future__ import annotations

import pytest
import torch

from kernels.launch import MAX_STAGES, TYPICAL_SHARED_MEMORY_BYTES, choose_launch, shared_memory_bytes, stage_bytes
from kernels.triton_decode import MIN_DOT_ROWS
from kernels.triton_prefill import BLOCK_M
from kernels.triton_tiles import tile_tokens

H100_SHARED_MEMORY_BYTES = 227 * 1024


def requested_bytes(rows: int, head_dim_pad: int, element_bytes: int, shared: int) -> int:
    """Shared memory the chosen stages buffer, with the query tile and the probabilities."""
    tile = tile_tokens(head_dim_pad, element_bytes)
    launch = choose_launch(rows, tile, head_dim_pad, element_bytes, shared)
    fixed = rows * head_dim_pad * element_bytes + rows * tile * 4
    return fixed + launch.num_stages * stage_bytes(tile, head_dim_pad, element_bytes)


@pytest.mark.parametrize("rows", [MIN_DOT_ROWS, BLOCK_M])
@pytest.mark.parametrize("head_dim_pad", [64, 128, 256])
@pytest.mark.parametrize("element_bytes", [2, 4])
def test_stages_fit_a_typical_sm(rows, head_dim_pad, element_bytes):
    assert requested_bytes(rows, head_dim_pad, element_bytes, TYPICAL_SHARED_MEMORY_BYTES) \
        <= TYPICAL_SHARED_MEMORY_BYTES


def test_fp32_at_head_dim_256_gets_fewer_stages_than_the_cap_on_a_typical_sm():
    launch = choose_launch(BLOCK_M, tile_tokens(256, 4), 256, 4)
    assert 1 <= launch.num_stages < MAX_STAGES


def test_a_larger_sm_gets_deeper_pipelines_up_to_the_cap():
    small = choose_launch(MIN_DOT_ROWS, 64, 128, 2, TYPICAL_SHARED_MEMORY_BYTES)
    large = choose_launch(MIN_DOT_ROWS, 64, 128, 2, H100_SHARED_MEMORY_BYTES)
    assert small.num_stages < large.num_stages == MAX_STAGES


def test_bigger_tiles_get_more_warps():
    assert choose_launch(16, 64, 128, 2).num_warps == 4
    assert choose_launch(128, 64, 128, 2).num_warps == 8


def test_a_tile_larger_than_shared_memory_still_launches_one_stage():
    assert choose_launch(16, 64, 128, 4, shared_memory_bytes=1024).num_stages == 1


def test_nonpositive_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="head_dim_pad"):
        choose_launch(16, 64, 0, 2)


def test_off_cuda_the_typical_shared_memory_is_assumed():
    assert shared_memory_bytes(torch.device("cpu")) == TYPICAL_SHARED_MEMORY_BYTES
