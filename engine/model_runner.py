"""Turns a step's scheduled sequences into tensors, runs the model, returns logits to sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata
from engine.cache_engine import CacheEngine
from engine.cuda_graphs import DecodeGraphRunner
from engine.models.llama import LlamaForCausalLM
from engine.prompt_logprobs import PromptLogprob, PromptRows
from engine.scheduler import ScheduledSeq, SchedulerOutput
from paged_kernels.checks import HostTables


def _padded(rows: list[list[int]]) -> tuple[list[int], int]:
    """Rows padded with -1 to the longest, flattened; and that width."""
    width = max((len(r) for r in rows), default=0)
    return [value for row in rows for value in row + [-1] * (width - len(row))], width


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of positions ``start:end``: one ``range`` per block, not per token."""
    slots: list[int] = []
    for index in range(start // block_size, (end - 1) // block_size + 1):
        base = table[index] * block_size
        first, last = max(start, index * block_size), min(end, (index + 1) * block_size)
        slots.extend(range(base + first % block_size, base + (last - 1) % block_size + 1))
    return slots


class StagingBuffer:
    """Carries a step's integer metadata to the device in one copy: from a reused pinned buffer
    on CUDA (non-blocking), as a fresh tensor on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = torch.empty(0, dtype=torch.int64, pin_memory=device.type == "cuda")
        # recorded after each copy out of ``pinned``; the next upload waits for it before overwriting
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def upload(self, values: list[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the device."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.copied is None:
            return host
        if self.pinned.numel() < len(values):
            self.pinned = torch.empty(2 * len(values), dtype=torch.int64, pin_memory=True)
        # A step that samples nothing (a prefill chunk) reads nothing back, so its copy may still be
        # queued behind earlier kernels: wait for it (it has almost always run) before overwriting.
        self.copied.synchronize()
        staged = self.pinned[: len(values)].copy_(host)
        uploaded = staged.to(self.device, non_blocking=True)
        self.copied.record()
        return uploaded


@dataclass(slots=True)
class HostStep:
    """One step's flattened batch built on the host (decodes first), and the kernels' host copies."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    sampled_rows: list[int] = field(default_factory=list)
    sampled: list[ScheduledSeq] = field(default_factory=list)
    decode: HostTables = field(default_factory=lambda: HostTables([], []))
    prefill: HostTables = field(default_factory=lambda: HostTables([], [], [0]))
    prompt_rows: PromptRows = field(default_factory=PromptRows)

    def add_tokens(self, item: ScheduledSeq, start: int, end: int, slots: list[int]) -> None:
        """Positions ``start:end`` of the item's sequence; its last row is sampled once it covers every token."""
        self.input_ids += item.seq.token_ids[start:end]
        self.positions += range(start, end)
        self.slots += slots
        if end == item.seq.num_tokens:
            self.sampled_rows.append(len(self.input_ids) - 1)
            self.sampled.append(item)


class ModelRunner:
    """Builds ``input_ids``, ``positions``, ``slot_mapping`` and block tables once per step, on the
    host, from the ``SchedulerOutput`` alone, and sends them to the device in one transfer. With
    ``graphs``, a pure-decode step that fits a captured size replays a CUDA graph instead."""

    def __init__(
        self, model: LlamaForCausalLM, cache: CacheEngine, block_size: int, device: torch.device,
        graphs: DecodeGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.device = device
        self.staging = StagingBuffer(device)
        self.graphs = graphs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq], list[PromptLogprob]]:
        """Run one forward pass; returns the logits of every sequence that reached its last
        token, those sequences in the same order, and the prompt logprobs the step's prefills computed."""
        step = self._prepare(out)
        graphs = self.graphs
        size = graphs.size_for(step.decode, len(step.prefill.context_lens)) if graphs is not None else None
        if graphs is not None and size is not None:
            hidden, sampled_rows = self._replay(graphs, step, size)
        else:
            input_ids, positions, meta, sampled_rows = self._upload(step)
            hidden = self.model(input_ids, positions, self.cache.gpu_cache, meta)
        prompt_logprobs = step.prompt_rows.logprobs(self.model, hidden) if step.prompt_rows.rows else []
        return self.model.compute_logits(hidden.index_select(0, sampled_rows)), step.sampled, prompt_logprobs

    def _replay(self, graphs: DecodeGraphRunner, step: HostStep, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded decode batch and the sampled rows in one transfer, then the graph of ``size``:
        its hidden states (real rows first) and the sampled rows on the device."""
        parts = [*graphs.host_fields(step.input_ids, step.positions, step.slots, step.decode, size),
                 step.sampled_rows]
        *fields, sampled_rows = self.staging.upload([value for part in parts for value in part]).split(
            [len(part) for part in parts])
        return graphs.replay(size, fields), sampled_rows

    def _prepare(self, out: SchedulerOutput) -> HostStep:
        """The flattened batch on the host: decodes first, then prefills (chunks of more than one token)."""
        step = HostStep()
        self._prepare_decodes([s for s in out.scheduled if s.num_new_tokens == 1], step)
        self._prepare_prefills([s for s in out.scheduled if s.num_new_tokens > 1], step)
        return step

    def _prepare_decodes(self, decodes: list[ScheduledSeq], step: HostStep) -> None:
        """One token each, at the sequence's next position."""
        block_size = self.block_size
        for item in decodes:
            position = item.seq.num_computed_tokens
            slot = item.block_table[position // block_size] * block_size + position % block_size
            step.add_tokens(item, position, position + 1, [slot])
        step.decode = HostTables([s.block_table for s in decodes], [s.seq.num_computed_tokens + 1 for s in decodes])

    def _prepare_prefills(self, prefills: list[ScheduledSeq], step: HostStep) -> None:
        """A chunk of tokens each, after those already in the cache."""
        query_start_loc = [0]
        for item in prefills:
            start, end = item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_new_tokens
            step.prompt_rows.add(item, start, end, len(step.input_ids))
            step.add_tokens(item, start, end, _slots(item.block_table, start, end, self.block_size))
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
        step.prefill = HostTables(
            [s.block_table for s in prefills], [s.seq.num_computed_tokens + s.num_new_tokens for s in prefills],
            query_start_loc,
        )

    def _upload(self, step: HostStep) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``input_ids``, ``positions``, the attention metadata and the sampled rows on the device,
        from one transfer."""
        num_decodes, num_prefills = len(step.decode.context_lens), len(step.prefill.context_lens)
        decode_tables, decode_width = _padded(step.decode.block_tables)
        prefill_tables, prefill_width = _padded(step.prefill.block_tables)
        fields = [step.input_ids, step.positions, step.slots, decode_tables, step.decode.context_lens,
                  prefill_tables, step.prefill.query_start_loc, step.prefill.context_lens, step.sampled_rows]
        uploaded = self.staging.upload([value for part in fields for value in part])
        (input_ids, positions, slot_mapping, decode_tables_dev, decode_lens, prefill_tables_dev, prefill_starts,
         prefill_lens, sampled_rows) = uploaded.split([len(part) for part in fields])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            slot_range=(min(step.slots, default=0), max(step.slots, default=0)),
            num_decode_tokens=num_decodes,
            decode_block_tables=decode_tables_dev.to(torch.int32).view(num_decodes, decode_width),
            decode_context_lens=decode_lens.to(torch.int32),
            decode_host=step.decode,
            prefill_block_tables=prefill_tables_dev.to(torch.int32).view(num_prefills, prefill_width),
            prefill_query_start_loc=prefill_starts.to(torch.int32),
            prefill_context_lens=prefill_lens.to(torch.int32),
            prefill_host=step.prefill,
        )
        return input_ids, positions, meta, sampled_rows
