"""Launch choices of the attention kernels per device and shape: tile sizes, ``num_warps``,
``num_stages`` and the number of decode partitions.

Pure functions of the shape and of ``DeviceLimits``, so they are tested without a GPU, with
made-up devices (Triton's interpreter ignores warps and stages). Every choice is made on the
host from host-known sizes, once per step, and lands in the kernels' plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

# 99 KiB: the opt-in shared memory per block of the smallest recent parts (sm86/sm89); an A100
# has 163 KiB and an H100/H200 227 KiB.
TYPICAL_SHARED_MEMORY_BYTES = 99 * 1024
MAX_STAGES = 3
# Elements of the two dots in one loop iteration (query rows x tile x head_dim) above which
# eight warps share the work instead of four.
EIGHT_WARPS_WORK = 32 * 64 * 128
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows
# Query rows per prefill program, largest first. Compiled, 64 and 128 rows keep the tensor cores
# busy (several 16-row MMA tiles per warp); the interpreter runs programs one at a time in numpy,
# where small tiles keep the tests quick.
PREFILL_ROWS_COMPILED = (128, 64, 32, MIN_DOT_ROWS)
PREFILL_ROWS_INTERPRETED = (32, MIN_DOT_ROWS)
# The fp32 accumulator of a prefill program ([rows, head_dim]) lives in registers: 128 x 128
# is what FlashAttention-2 holds in 8 warps; wider heads get fewer rows.
MAX_ACCUMULATOR_BYTES = 128 * 128 * 4
PIPELINED_STAGES = 2  # stages that let the next K/V tile load while the current one is used
# Decode splits each context into equal partitions of whole tiles, no shorter than the minimum (one
# tile of a 128-wide head: shorter ones would cost the merge more than they save), and enough of them
# that none is longer than the maximum (one long context in a full batch would otherwise run alone
# while the rest of the GPU idles). Both are multiples of every tile size.
MIN_PARTITION_TOKENS = 64
MAX_PARTITION_TOKENS = 8192
# Decode fills the GPU whichever of two ways splits more: SPREAD_PROGRAMS_PER_SM programs per SM in partitions of
# MIN_PARTITION_TOKENS or more (a batch too small to use the SMs otherwise: 1 x 1k tokens runs 16 x 64), or
# DEEP_PROGRAMS_PER_SM programs per SM in partitions of DEEP_PARTITION_TOKENS or more (enough programs in flight to
# hide one another's memory latency, in partitions long enough to outweigh their merge). The sweep of the H200
# (BENCHMARKS.md, seventeenth session) put the best split of 1 x 8k at 32 x 256 tokens, of 8 x 2k at 8 x 256 and of
# 32 x 1k at 2 x 512: what this rule chooses.
SPREAD_PROGRAMS_PER_SM = 1
DEEP_PROGRAMS_PER_SM = 4
DEEP_PARTITION_TOKENS = 256


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    """What the launch choices read of a device."""

    sm_count: int
    shared_memory_bytes: int  # per block, opt-in
    compiled: bool  # False for Triton's interpreter, which runs the programs one at a time


# Off CUDA the kernels run in the interpreter: one "SM", so decode splits contexts only where the batch makes
# fewer than DEEP_PROGRAMS_PER_SM programs.
INTERPRETER_LIMITS = DeviceLimits(sm_count=1, shared_memory_bytes=TYPICAL_SHARED_MEMORY_BYTES, compiled=False)


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """``num_warps`` and ``num_stages`` of one kernel launch."""

    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    """Tile shape and launch of the prefill kernel: ``rows`` = ``tokens`` x the GQA group, padded."""

    rows: int
    tokens: int
    tile_tokens: int
    launch: LaunchConfig


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (Triton block shapes must be powers of two)."""
    return 1 << max(0, n - 1).bit_length()


def limits_from_properties(props: Any) -> DeviceLimits:
    """``DeviceLimits`` of a CUDA device from its ``torch.cuda.get_device_properties``."""
    shared = getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)
    return DeviceLimits(int(props.multi_processor_count), int(shared), compiled=True)


@cache
def device_limits(device: torch.device) -> DeviceLimits:
    """The limits of ``device``; the interpreter's off CUDA."""
    if device.type != "cuda":
        return INTERPRETER_LIMITS
    return limits_from_properties(torch.cuda.get_device_properties(device))


def tile_tokens(head_dim_pad: int, element_bytes: int) -> int:
    """Context positions per loop iteration: smaller for wide heads to bound register use, and
    for wide fp32 heads so that a K and a V tile (32 KiB) leave room for a second stage."""
    if head_dim_pad <= 128:
        return 64
    return 32 if element_bytes <= 2 else 16


def stage_bytes(tile: int, head_dim_pad: int, element_bytes: int) -> int:
    """Shared memory one pipeline stage buffers: a key tile and a value tile."""
    return 2 * tile * head_dim_pad * element_bytes


def fixed_bytes(query_rows: int, tile: int, head_dim_pad: int, element_bytes: int) -> int:
    """Shared memory besides the stages: the query tile and the fp32 probabilities (an estimate:
    Triton also stages operands of the dots, which the margin of the fp32 probabilities covers)."""
    return query_rows * head_dim_pad * element_bytes + query_rows * tile * 4


def stages_that_fit(query_rows: int, tile: int, head_dim_pad: int, element_bytes: int, shared_memory_bytes: int) -> int:
    """How many pipeline stages fit in ``shared_memory_bytes``; 0 when not even one does."""
    free = shared_memory_bytes - fixed_bytes(query_rows, tile, head_dim_pad, element_bytes)
    return max(0, free // stage_bytes(tile, head_dim_pad, element_bytes))


def choose_launch(
    query_rows: int, tile: int, head_dim_pad: int, element_bytes: int,
    shared_memory_bytes: int = TYPICAL_SHARED_MEMORY_BYTES,
) -> LaunchConfig:
    """Warps from the work of one loop iteration; as many stages (1 to ``MAX_STAGES``) as fit in
    ``shared_memory_bytes`` next to the query tile and the probabilities."""
    for name, value in (("query_rows", query_rows), ("tile", tile),
                        ("head_dim_pad", head_dim_pad), ("element_bytes", element_bytes),
                        ("shared_memory_bytes", shared_memory_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    num_warps = 8 if query_rows * tile * head_dim_pad > EIGHT_WARPS_WORK else 4
    fitting = stages_that_fit(query_rows, tile, head_dim_pad, element_bytes, shared_memory_bytes)
    return LaunchConfig(num_warps, max(1, min(MAX_STAGES, fitting)))


def choose_prefill_tiles(
    group: int, head_dim_pad: int, element_bytes: int, max_queries: int, limits: DeviceLimits,
) -> PrefillTiles:
    """The largest row tile whose accumulator fits the register budget and whose K/V tiles still
    pipeline (two stages) in shared memory, else the largest that fits one stage, else the
    smallest; never more rows than the longest run of new tokens needs."""
    tile = tile_tokens(head_dim_pad, element_bytes)
    candidates = PREFILL_ROWS_COMPILED if limits.compiled else PREFILL_ROWS_INTERPRETED
    needed = max(MIN_DOT_ROWS, next_power_of_2(max_queries * group))
    # A group wider than a tile widens the tile (one token per program).
    sizes = sorted({max(next_power_of_2(group), min(rows, needed)) for rows in candidates}, reverse=True)
    in_registers = [rows for rows in sizes if rows * head_dim_pad * 4 <= MAX_ACCUMULATOR_BYTES] or sizes[-1:]

    def stages(rows: int) -> int:
        return stages_that_fit(rows, tile, head_dim_pad, element_bytes, limits.shared_memory_bytes)

    pipelined = [rows for rows in in_registers if stages(rows) >= PIPELINED_STAGES]
    fitting = [rows for rows in in_registers if stages(rows) >= 1]
    rows = (pipelined or fitting or in_registers[-1:])[0]
    launch = choose_launch(rows, tile, head_dim_pad, element_bytes, limits.shared_memory_bytes)
    return PrefillTiles(rows, rows // group, tile, launch)


@dataclass(frozen=True, slots=True)
class DecodeSplit:
    """How decode splits each sequence's context: into ``fill`` partitions of ``MIN_PARTITION_TOKENS`` or more, or
    ``deep`` partitions of ``DEEP_PARTITION_TOKENS`` or more, whichever is more; a context longer than that many
    partitions of ``MAX_PARTITION_TOKENS`` takes more, up to ``partitions``, the grid's third axis, which covers
    the longest context the plan is made for."""

    partitions: int
    fill: int
    deep: int


def choose_decode_split(num_seqs: int, num_kv_heads: int, max_context_len: int, limits: DeviceLimits) -> DecodeSplit:
    """``fill``: enough partitions for ``SPREAD_PROGRAMS_PER_SM`` programs per SM (rounded up) over the batch x KV
    heads, as long as the longest context keeps ``MIN_PARTITION_TOKENS`` per partition; ``deep``: as many for
    ``DEEP_PROGRAMS_PER_SM`` programs per SM (rounded down: a batch that nearly gets there alone stays whole), as
    long as it keeps ``DEEP_PARTITION_TOKENS``; both at least 1. ``partitions``: the more of the two, or as many as
    keep every partition of the longest context within ``MAX_PARTITION_TOKENS``, if more.

    Each sequence splits its own context on the device (``partition_length`` in ``triton_decode``) by the same
    rule, with its own length in place of the longest: so a plan made for the tables' capacity (a CUDA graph's)
    splits every context as a plan made for that context would, instead of into partitions sized for the
    capacity, of which it would fill one or two, and a long context in a full batch still splits. Each part is
    an equal share in whole tiles; rounding can leave the last partitions empty (34 tiles split 33 ways run 17
    programs of 2 tiles): the longest program is what a step waits for."""
    groups = max(1, num_seqs * num_kv_heads)
    spread = -(-SPREAD_PROGRAMS_PER_SM * limits.sm_count // groups)
    fill = max(1, min(spread, -(-max_context_len // MIN_PARTITION_TOKENS)))
    deep = max(1, min(DEEP_PROGRAMS_PER_SM * limits.sm_count // groups, max_context_len // DEEP_PARTITION_TOKENS))
    return DecodeSplit(max(fill, deep, -(-max_context_len // MAX_PARTITION_TOKENS)), fill, deep)
