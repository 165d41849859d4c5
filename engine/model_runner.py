"""Turns a step's scheduled sequences into tensors, runs the model, returns logits to sample."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.block_manager import BlockManager
from engine.cache_engine import CacheEngine
from engine.models.llama import LlamaForCausalLM
from engine.scheduler import ScheduledSeq


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32, device=device).view(len(rows), width)


class ModelRunner:
    """Builds ``input_ids``, ``positions``, ``slot_mapping`` and block tables once per step."""

    def __init__(self, model: LlamaForCausalLM, cache: CacheEngine, block_manager: BlockManager, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.device = device

    def _slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table.gather(-1, positions // self.block_size).long() * self.block_size + positions % self.block_size

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run one forward pass; returns the logits of every sequence that reached its last
        token, and those sequences in the same order."""
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        tables = self.block_manager.tables
        dev = self.device

        decode_tables = _padded([tables[s.seq.seq_id] for s in decodes], dev)
        decode_pos = torch.tensor([s.seq.num_computed_tokens for s in decodes], dtype=torch.long, device=dev)
        decode_ids = [s.seq.token_ids[s.seq.num_computed_tokens] for s in decodes]
        slots = [self._slots(decode_tables, decode_pos[:, None])[:, 0]] if decodes else []
        positions = [decode_pos]
        input_ids = decode_ids
        prefill_tables = _padded([tables[s.seq.seq_id] for s in prefills], dev)
        query_start = [0]
        for i, s in enumerate(prefills):
            start = s.seq.num_computed_tokens
            pos = torch.arange(start, start + s.num_new_tokens, device=dev)
            positions.append(pos)
            slots.append(self._slots(prefill_tables[i], pos))
            input_ids = input_ids + s.seq.token_ids[start : start + s.num_new_tokens]
            query_start.append(query_start[-1] + s.num_new_tokens)

        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots) if slots else torch.empty(0, dtype=torch.long, device=dev),
            num_decode_tokens=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_pos.to(torch.int32) + 1,
            prefill_block_tables=prefill_tables,
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(
                [s.seq.num_computed_tokens + s.num_new_tokens for s in prefills], dtype=torch.int32, device=dev
            ),
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev), torch.cat(positions), self.cache.gpu_cache, meta
        )
        # the last token of each sequence that now covers all its tokens yields the next token
        ends = torch.tensor(query_start[1:], dtype=torch.long) - 1 + len(decodes)
        last_rows = list(range(len(decodes))) + ends.tolist()
        sampled_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        for row, s in zip(last_rows, ordered):
            if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens:
                sampled_rows.append(row)
                sampled.append(s)
        logits = self.model.compute_logits(hidden[sampled_rows])
        return logits, sampled
