"""The attention kernels' launch choices fit the device they launch on, judged on made-up devices."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from paged_kernels.launch import (
    DEEP_PARTITION_TOKENS,
    DEEP_PROGRAMS_PER_SM,
    INTERPRETER_LIMITS,
    MAX_PARTITION_TOKENS,
    MAX_STAGES,
    MIN_DOT_ROWS,
    MIN_PARTITION_TOKENS,
    SPREAD_PROGRAMS_PER_SM,
    TYPICAL_SHARED_MEMORY_BYTES,
    DecodeSplit,
    DeviceLimits,
    choose_decode_split,
    choose_launch,
    choose_prefill_tiles,
    device_limits,
    fixed_bytes,
    limits_from_properties,
    stage_bytes,
    tile_tokens,
)

KIB = 1024
# Made-up devices with the SM counts and shared memory of an H100/H200, an A100 and a small part.
H100 = DeviceLimits(sm_count=132, shared_memory_bytes=227 * KIB, compiled=True)
A100 = DeviceLimits(sm_count=108, shared_memory_bytes=163 * KIB, compiled=True)
SMALL = DeviceLimits(sm_count=8, shared_memory_bytes=TYPICAL_SHARED_MEMORY_BYTES, compiled=True)
DEVICES = [H100, A100, SMALL]


def requested_bytes(rows: int, tile: int, head_dim_pad: int, element_bytes: int, stages: int) -> int:
    """Shared memory ``stages`` stages buffer, with the query tile and the probabilities."""
    stage = stage_bytes(tile, head_dim_pad, element_bytes)
    return fixed_bytes(rows, tile, head_dim_pad, element_bytes) + stages * stage


# ---------------------------------------------------------------- device limits

def test_limits_are_read_from_the_device_properties():
    props = SimpleNamespace(multi_processor_count=132, shared_memory_per_block=48 * KIB,
                            shared_memory_per_block_optin=227 * KIB)
    assert limits_from_properties(props) == H100


def test_off_cuda_the_interpreter_limits_are_assumed():
    assert device_limits(torch.device("cpu")) == INTERPRETER_LIMITS
    assert not INTERPRETER_LIMITS.compiled


# ---------------------------------------------------------------- warps and stages

@pytest.mark.parametrize("rows", [MIN_DOT_ROWS, 32])
@pytest.mark.parametrize("head_dim_pad", [64, 128, 256])
@pytest.mark.parametrize("element_bytes", [2, 4])
def test_stages_fit_a_typical_sm(rows, head_dim_pad, element_bytes):
    tile = tile_tokens(head_dim_pad, element_bytes)
    launch = choose_launch(rows, tile, head_dim_pad, element_bytes, TYPICAL_SHARED_MEMORY_BYTES)
    assert requested_bytes(rows, tile, head_dim_pad, element_bytes, launch.num_stages) <= TYPICAL_SHARED_MEMORY_BYTES


def test_a_larger_sm_gets_deeper_pipelines_up_to_the_cap():
    small = choose_launch(MIN_DOT_ROWS, 64, 128, 2, TYPICAL_SHARED_MEMORY_BYTES)
    large = choose_launch(MIN_DOT_ROWS, 64, 128, 2, H100.shared_memory_bytes)
    assert small.num_stages < large.num_stages == MAX_STAGES


def test_bigger_tiles_get_more_warps():
    assert choose_launch(16, 64, 128, 2).num_warps == 4
    assert choose_launch(128, 64, 128, 2).num_warps == 8


def test_a_tile_larger_than_shared_memory_still_launches_one_stage():
    assert choose_launch(16, 64, 128, 4, shared_memory_bytes=1024).num_stages == 1


def test_nonpositive_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="head_dim_pad"):
        choose_launch(16, 64, 0, 2)


# ---------------------------------------------------------------- prefill tiles

@pytest.mark.parametrize("limits", DEVICES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim_pad", [64, 128, 256])
@pytest.mark.parametrize("element_bytes", [2, 4])
def test_prefill_tiles_hold_whole_groups_and_fit_shared_memory(limits, group, head_dim_pad, element_bytes):
    tiles = choose_prefill_tiles(group, head_dim_pad, element_bytes, 4096, limits)
    assert tiles.rows >= MIN_DOT_ROWS and tiles.rows & (tiles.rows - 1) == 0
    assert tiles.tokens == tiles.rows // group >= 1
    used = requested_bytes(tiles.rows, tiles.tile_tokens, head_dim_pad, element_bytes, tiles.launch.num_stages)
    assert used <= limits.shared_memory_bytes


def test_long_16_bit_prefills_get_tensor_core_tiles_on_cuda():
    assert choose_prefill_tiles(4, 128, 2, 4096, H100).rows == 128
    assert choose_prefill_tiles(4, 128, 2, 4096, SMALL).rows == 64  # two stages of 128 rows do not fit


def test_fp32_at_head_dim_256_fits_a_typical_sm_with_a_pipeline():
    tiles = choose_prefill_tiles(1, 256, 4, 4096, SMALL)
    assert tiles.launch.num_stages >= 2
    assert requested_bytes(tiles.rows, tiles.tile_tokens, 256, 4, tiles.launch.num_stages) <= SMALL.shared_memory_bytes


def test_the_interpreter_keeps_small_prefill_tiles():
    assert choose_prefill_tiles(4, 128, 2, 4096, INTERPRETER_LIMITS).rows == 32


def test_short_prefills_get_no_more_rows_than_they_fill():
    assert choose_prefill_tiles(4, 128, 2, 3, H100).rows == MIN_DOT_ROWS  # 3 tokens x 4 heads


def test_a_group_wider_than_every_tile_gets_one_token_per_program():
    tiles = choose_prefill_tiles(256, 64, 2, 4096, H100)
    assert (tiles.rows, tiles.tokens) == (256, 1)


# ---------------------------------------------------------------- decode partitions

def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("limits", DEVICES)
@pytest.mark.parametrize(("num_seqs", "num_kv_heads"), [(1, 1), (1, 8), (8, 8), (32, 8), (64, 8), (256, 2)])
@pytest.mark.parametrize("context_len", [1, 300, 1024, 16384, 131072])
def test_partitions_fill_the_sms_unless_already_at_the_shortest(limits, num_seqs, num_kv_heads, context_len):
    split = choose_decode_split(num_seqs, num_kv_heads, context_len, limits)
    groups, sms = num_seqs * num_kv_heads, limits.sm_count
    assert 1 <= split.fill <= split.partitions and 1 <= split.deep <= split.partitions
    # a program per SM at least, unless the longest context's partitions are at the minimum already
    at_shortest = split.fill >= cdiv(context_len, MIN_PARTITION_TOKENS)
    assert groups * split.fill >= SPREAD_PROGRAMS_PER_SM * sms or at_shortest
    # neither way splits below its minimum length, nor past the programs it asks for
    assert split.fill == 1 or (split.fill <= cdiv(context_len, MIN_PARTITION_TOKENS)
                               and groups * (split.fill - 1) < SPREAD_PROGRAMS_PER_SM * sms)
    assert split.deep == 1 or (context_len // split.deep >= DEEP_PARTITION_TOKENS
                               and groups * split.deep <= DEEP_PROGRAMS_PER_SM * sms)
    # the grid holds the longest context in partitions of at most the maximum, and no more partitions than that needs
    assert split.partitions == max(split.fill, split.deep, cdiv(context_len, MAX_PARTITION_TOKENS))


@pytest.mark.parametrize(("num_seqs", "context_len", "fastest"), [
    (1, 1024, 16), (1, 8192, 32), (8, 2048, 8), (32, 1024, 2), (32, 8192, 2),
])
def test_the_split_is_the_one_the_h200_sweep_found_fastest(num_seqs, context_len, fastest):
    # BENCHMARKS.md, seventeenth session: Llama-8B heads (8 KV heads), bf16, partitions 1-128 x warps x stages
    assert choose_decode_split(num_seqs, 8, context_len, H100).partitions == fastest


@pytest.mark.parametrize(("num_seqs", "context_len"), [(1, 16384), (4, 4096), (16, 2048)])
def test_more_sms_get_more_partitions(num_seqs, context_len):
    counts = [choose_decode_split(num_seqs, 8, context_len, limits).partitions for limits in (SMALL, A100, H100)]
    assert counts == sorted(counts) and counts[0] < counts[-1]


def test_one_long_sequence_on_an_h100_is_split_across_the_sms():
    # 8 KV heads x 64 partitions of 256 tokens = 512 programs, four per SM (528 would be 66 partitions of 248)
    assert choose_decode_split(1, 8, 16384, H100) == DecodeSplit(partitions=64, fill=17, deep=64)


def test_a_short_context_is_split_no_finer_than_the_shortest_partition():
    assert choose_decode_split(1, 8, 1024, H100).partitions == 1024 // MIN_PARTITION_TOKENS


def test_a_batch_that_fills_the_sms_alone_runs_one_partition():
    assert choose_decode_split(64, 8, 4096, H100) == DecodeSplit(partitions=1, fill=1, deep=1)


def test_a_long_context_in_a_full_batch_is_still_split_while_short_ones_are_not():
    # the grid has room for 4 partitions of the longest context; a context of the maximum or less fills one
    assert choose_decode_split(64, 8, 4 * MAX_PARTITION_TOKENS, H100) == DecodeSplit(partitions=4, fill=1, deep=1)


def test_decode_launch_sizes_are_runtime_arguments_not_compile_time_constants():
    # A constexpr partition count would recompile the kernels as contexts grow.
    from paged_kernels import triton_decode

    for kernel in (triton_decode._decode_partition_kernel, triton_decode._decode_reduce_kernel):
        params = inspect.signature(kernel.fn).parameters
        for name in ("num_partitions", "fill_partitions", "deep_partitions", "max_partition_tokens"):
            assert "constexpr" not in str(params[name].annotation), (kernel.fn.__name__, name)


def test_per_step_launch_values_are_not_specialised_on():
    # Triton compiles a variant per integer argument that is 1 or a multiple of 16 unless told not to: the
    # partition counts and the tables' width change from step to step, so serving would recompile.
    from paged_kernels import triton_decode, triton_prefill

    per_step = {
        triton_decode._decode_partition_kernel: {"stride_table_seq", "num_partitions", "fill_partitions",
                                                 "deep_partitions", "max_partition_tokens"},
        triton_decode._decode_reduce_kernel: {"num_partitions", "fill_partitions", "deep_partitions",
                                              "max_partition_tokens"},
        triton_prefill._prefill_kernel: {"stride_table_seq"},
    }
    for kernel, names in per_step.items():
        # what @triton.jit was given: a JITFunction keeps it, the interpreter's function keeps the keywords
        declared = getattr(kernel, "do_not_specialize", None) or kernel.kwargs.get("do_not_specialize", [])
        assert names <= set(declared), (kernel.fn.__name__, names - set(declared))
