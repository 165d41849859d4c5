"""Decode steps replayed from CUDA graphs, one per padded batch size (as vLLM's CUDAGraphRunner).

A pure-decode step of ``n`` sequences runs the graph of the smallest capture size ``b >= n``: its
inputs are copied into static buffers (rows ``n:b`` are padding: token 0 at position 0, slot -1 so
nothing is written, a context of 1 token in block 0, read and dropped), the graph replays, and the
real rows' hidden states are read. Every size in a graph comes from the host at capture: the decode
plan is sized from the block tables' capacity (``plan_decode_static``), never from the step's lengths.
Mixed or prefill steps, and batches above the largest size, run eagerly.

Only ``CudaGraphCapture`` touches CUDA; tests on the CPU substitute ``EagerCapture``, which re-runs the
captured function over the same static buffers and so checks everything but capture/replay itself.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from engine.attention import AttentionMetadata
from engine.cache_engine import CacheEngine
from engine.models.llama import LlamaForCausalLM
from paged_kernels.backend import KernelBackend, KernelPlan
from paged_kernels.checks import HostTables, check_host_tables

SMALL_CAPTURE_SIZES = (1, 2, 4)
CAPTURE_SIZE_STEP = 8  # past the small sizes, every multiple of 8 (vLLM's choice)
PADDING_SLOT = -1  # reshape_and_cache skips it: a padding row writes no cache slot
PADDING_BLOCK = 0  # a padding row's one context token is read from here and dropped

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, up to the first that holds ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    candidates = [*SMALL_CAPTURE_SIZES, *range(CAPTURE_SIZE_STEP, max_batch + CAPTURE_SIZE_STEP, CAPTURE_SIZE_STEP)]
    return [size for size in candidates if size < max_batch] + [next(s for s in candidates if s >= max_batch)]


def padded_batch_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``num_seqs`` rows; None when none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


class GraphCapture(Protocol):
    """Records a function once and runs the record again: a CUDA graph, or eager calls in CPU tests."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``forward``; returns its output tensor, which every ``replay`` refills."""
        ...

    def replay(self) -> None:
        """Run the recorded work again over the same input tensors."""
        ...


class CudaGraphCapture:
    """A ``torch.cuda.CUDAGraph`` in a memory pool shared by every size's graph."""

    def __init__(self, pool: object) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``forward`` on a side stream (it ran once before, so Triton compiled outside the capture)."""
        # thread_local: another thread's CUDA calls (a service's other threads) cannot invalidate this capture
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            return forward()

    def replay(self) -> None:
        """Launch the recorded kernels."""
        self.graph.replay()


class EagerCapture:
    """Runs ``forward`` again on every replay and copies the result into the first output: the static
    buffer path without CUDA (for tests; nothing here verifies a real capture)."""

    def __init__(self) -> None:
        self.forward: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Keep ``forward`` and its first output."""
        self.forward, self.output = forward, forward()
        return self.output

    def replay(self) -> None:
        """Recompute into the kept output."""
        assert self.forward is not None and self.output is not None, "replay before capture"
        self.output.copy_(self.forward())


class StaticDecodeInputs:
    """The graphs' input buffers on the device, ``max_batch`` rows; a graph of size ``b`` reads rows ``:b``.
    They start as padding rows, so the warm-up and capture runs write no cache slot."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), PADDING_SLOT, dtype=torch.int64, device=device)
        self.block_tables = torch.full(
            (max_batch, max_blocks_per_seq), PADDING_BLOCK, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        # no prefill rows: empty tensors made once, so the captured forward allocates nothing from the host
        self.no_tables = torch.zeros((0, 0), dtype=torch.int32, device=device)
        self.no_lens = torch.zeros(0, dtype=torch.int32, device=device)
        self.no_starts = torch.zeros(1, dtype=torch.int32, device=device)

    def metadata(self, batch: int, plan: KernelPlan | None, num_slots: int) -> AttentionMetadata:
        """Attention metadata over rows ``:batch``, with a plan made at capture (None: the backend plans
        every call from the values). The slot range is the whole cache: any real slot or padding may come."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            slot_range=(PADDING_SLOT, num_slots - 1),
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_context_lens=self.context_lens[:batch],
            decode_host=None,
            prefill_block_tables=self.no_tables,
            prefill_query_start_loc=self.no_starts,
            prefill_context_lens=self.no_lens,
            prefill_host=None,
            decode_plan=plan,
        )

    def load(self, batch: int, fields: list[torch.Tensor]) -> None:
        """Copy a padded step (``DecodeGraphRunner.host_fields``, on the device) into rows ``:batch``; the
        table columns past its widest row keep stale ids, which no context reaches."""
        input_ids, positions, slot_mapping, block_tables, context_lens = fields
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(slot_mapping)
        width = block_tables.numel() // batch
        self.block_tables[:batch, :width].copy_(block_tables.view(batch, width))
        self.context_lens[:batch].copy_(context_lens)


class DecodeGraphRunner:
    """The model's decode forward recorded once per capture size and replayed for padded batches."""

    def __init__(
        self, model: LlamaForCausalLM, cache: CacheEngine, ops: KernelBackend, max_blocks_per_seq: int,
        sizes: list[int],
    ) -> None:
        self.model = model
        self.cache = cache
        self.ops = ops
        self.sizes = sorted(sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        key_cache = cache.gpu_cache[0][0]
        self.inputs = StaticDecodeInputs(self.sizes[-1], max_blocks_per_seq, key_cache.device)
        self.graphs: dict[int, tuple[GraphCapture, torch.Tensor]] = {}
        self.num_replays = 0

    @torch.inference_mode()
    def capture(self, make_capture: Callable[[], GraphCapture]) -> None:
        """Record every size, largest first (the smaller graphs reuse the pool memory it took, as vLLM)."""
        for size in reversed(self.sizes):
            forward = self._forward(size)
            forward()  # warm-up outside the capture: Triton compiles, the BLAS libraries pick their kernels
            graph = make_capture()
            self.graphs[size] = (graph, graph.capture(forward))

    def plans_statically(self) -> bool:
        """Whether the backend plans decode from shapes alone, as a graph needs (the reference backend
        plans from the lengths it reads back, which a capture forbids)."""
        return self._plan(self.sizes[0]) is not None

    def _plan(self, size: int) -> KernelPlan | None:
        """The backend's decode plan over the static rows ``:size``, made from their shapes alone."""
        key_cache, value_cache = self.cache.gpu_cache[0]
        attention = self.model.layers[0].self_attn
        query = torch.empty((size, attention.num_heads, attention.head_dim), dtype=key_cache.dtype,
                            device=key_cache.device)
        return self.ops.plan_decode_static(query, key_cache, value_cache, self.inputs.block_tables[:size],
                                           self.inputs.context_lens[:size])

    def _forward(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward pass over the static rows ``:size``, with a decode plan made now from sizes alone."""
        inputs = self.inputs
        plan = self._plan(size)
        key_cache = self.cache.gpu_cache[0][0]
        num_slots = key_cache.shape[0] * key_cache.shape[1]

        def forward() -> torch.Tensor:
            meta = inputs.metadata(size, plan, num_slots)
            return self.model(inputs.input_ids[:size], inputs.positions[:size], self.cache.gpu_cache, meta)

        return forward

    def size_for(self, decode: HostTables, num_prefills: int) -> int | None:
        """The capture size a step of these decodes runs in; None (eager) when it holds prefills, more rows
        than the largest size or a table wider than the static one."""
        if num_prefills or not decode.context_lens:
            return None
        if max(len(table) for table in decode.block_tables) > self.max_blocks_per_seq:
            return None
        return padded_batch_size(self.sizes, len(decode.context_lens))

    def host_fields(
        self, input_ids: list[int], positions: list[int], slots: list[int], decode: HostTables, size: int,
    ) -> list[list[int]]:
        """A step's decode rows padded to ``size``, as ``StaticDecodeInputs.load`` takes them, checked
        on the host against the cache and the static tables (the captured kernels check nothing)."""
        padding = size - len(input_ids)
        width = max(len(table) for table in decode.block_tables)
        tables = [table + [PADDING_BLOCK] * (width - len(table)) for table in decode.block_tables]
        tables += [[PADDING_BLOCK] * width] * padding
        context_lens = decode.context_lens + [1] * padding
        key_cache = self.cache.gpu_cache[0][0]
        check_host_tables(key_cache, self.inputs.block_tables[:size], HostTables(tables, context_lens))
        return [input_ids + [0] * padding, positions + [0] * padding, slots + [PADDING_SLOT] * padding,
                [block for table in tables for block in table], context_lens]

    def replay(self, size: int, fields: list[torch.Tensor]) -> torch.Tensor:
        """Load the padded step and replay the graph of ``size``; returns its hidden states ``[size, hidden]``
        (the static output: read the real rows before the next replay)."""
        self.inputs.load(size, fields)
        graph, hidden = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return hidden


def uses_cuda_graphs(device: torch.device, enforce_eager: bool) -> bool:
    """Decode runs from CUDA graphs on CUDA unless ``enforce_eager``; never on the CPU."""
    return device.type == "cuda" and not enforce_eager


def capture_decode_graphs(
    model: LlamaForCausalLM, cache: CacheEngine, ops: KernelBackend, max_blocks_per_seq: int, max_batch: int,
) -> DecodeGraphRunner | None:
    """Capture the decode graphs of batches up to ``max_batch`` in one shared memory pool (CUDA only);
    None, every step eager, where the backend cannot plan decode for a graph."""
    graphs = DecodeGraphRunner(model, cache, ops, max_blocks_per_seq, capture_sizes(max_batch))
    if not graphs.plans_statically():
        logger.warning("attention backend %s plans decode from the lengths it reads back, which a CUDA graph "
                       "cannot replay: decode runs eagerly (attention_backend='triton' captures)",
                       getattr(ops, "__name__", ops))
        return None
    pool = torch.cuda.graph_pool_handle()
    with garbage_collection_paused():
        graphs.capture(lambda: CudaGraphCapture(pool))
    return graphs


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """Collect now, then no collection until the block ends. A cycle collected during a capture can hold CUDA
    objects of an earlier engine (graphs, events, pinned memory), and releasing them is a call that invalidates the
    capture in progress ("operation failed due to a previous error during capture", seen on an H200 when a test
    built a second engine). torch no longer collects on entering a capture (unless ``force_cudagraph_gc``)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
