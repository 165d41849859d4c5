"""Iteration-level scheduler: decides which sequences compute which tokens each step."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager, BlockMapping
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:  # the sampler's types: the scheduler only reads them
    import torch

    from engine.beam_search import BeamAdvance
    from engine.sampler import SampleResult
    from engine.step_sampler import SamplerOutput


# why a token just appended to a sequence ends it ("stop", "length"), or None; it also decodes the text
FinishCheck = Callable[[SequenceGroup, Sequence, int], str | None]


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence computing ``num_new_tokens`` tokens this step, into the blocks of ``block_table``."""

    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int
    block_table: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    """Plain data handed from the scheduler to the cache engine and model runner (its only input)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_out: BlockMapping = field(default_factory=list)
    blocks_to_swap_in: BlockMapping = field(default_factory=list)
    blocks_to_copy: BlockMapping = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when no sequence computes anything this step."""
        return not self.scheduled


@dataclass(slots=True)
class SchedulerCounters:
    """Cumulative token, preemption and swap counts."""

    prompt_tokens: int = 0  # prompt tokens computed, recomputation included
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0


class Scheduler:
    """Waiting, running and swapped queues; FCFS (or priority) with preemption by swap/recompute."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, token_budget: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.token_budget = token_budget
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.counters = SchedulerCounters()

    # ---- queues --------------------------------------------------------------------
    def _order(self, group: SequenceGroup) -> tuple[float, float]:
        if self.config.scheduling_policy == "priority":
            return (group.priority, group.arrival_time)
        return (0, group.arrival_time)

    def _insert(self, queue: list[SequenceGroup], group: SequenceGroup) -> None:
        bisect.insort(queue, group, key=self._order)

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request."""
        self._insert(self.waiting, group)

    def has_unfinished(self) -> bool:
        """True while any request waits, runs or is swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, group: SequenceGroup) -> None:
        """Drop a request from its queue and free every block it holds."""
        on_cpu = group in self.swapped
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        for seq in group.seqs:
            self.block_manager.free(seq, on_cpu=on_cpu)

    def requeue_for_recompute(self, group: SequenceGroup) -> None:
        """Free every block of a request and queue it to recompute all its tokens."""
        self.remove(group)
        for seq in group.unfinished_seqs:
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, group)

    @contextmanager
    def restricted_to(self, groups: list[SequenceGroup]) -> Iterator[None]:
        """Inside the block, schedule only ``groups``; the others keep their blocks and places."""
        members = set(map(id, groups))
        queues = (self.waiting, self.running, self.swapped)
        held = [[g for g in queue if id(g) not in members] for queue in queues]
        for queue in queues:
            queue[:] = [g for g in queue if id(g) in members]
        try:
            yield
        finally:
            for queue, others in zip((self.waiting, self.running, self.swapped), held):
                for group in others:
                    self._insert(queue, group)

    def running_seqs(self) -> list[Sequence]:
        """Sequences holding device blocks and decoding."""
        return [seq for group in self.running for seq in group.seqs_with_status(SequenceStatus.RUNNING)]

    def num_queued_seqs(self) -> tuple[int, int]:
        """Unfinished sequences waiting, and swapped out."""
        return sum(len(g.unfinished_seqs) for g in self.waiting), sum(len(g.unfinished_seqs) for g in self.swapped)

    def num_running_seqs(self) -> int:
        """Sequences currently holding device blocks and decoding."""
        return sum(len(group.unfinished_seqs) for group in self.running)

    # ---- scheduling ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running first, then swapped back in, then new admissions."""
        out = SchedulerOutput()
        budget = [self.token_budget]
        if self.config.scheduling_policy == "priority":
            self._preempt_for_priority(out)
        starved = self._schedule_running(out, budget)
        if not starved:
            self._schedule_swapped(out, budget)
        if not starved and (not self.swapped or self._waiting_outranks_swapped()):
            self._schedule_waiting(out, budget)
        return out

    def _waiting_outranks_swapped(self) -> bool:
        return (
            self.config.scheduling_policy == "priority"
            and bool(self.waiting)
            and self.waiting[0].priority < self.swapped[0].priority
        )

    def _fits_now(self, group: SequenceGroup, num_running_seqs: int) -> bool:
        seqs = group.seqs_with_status(SequenceStatus.WAITING)
        if num_running_seqs + self._seats_wanted(group) > self.config.max_num_seqs:
            return False
        return self._can_allocate(seqs, reuse_prefix=not group.wants_prompt_logprobs)

    @staticmethod
    def _seats_wanted(group: SequenceGroup) -> int:
        return max(len(group.seqs_with_status(SequenceStatus.WAITING)), group.num_seqs_wanted)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Make room for the most urgent waiting request by preempting lower-priority running ones."""
        while self.waiting and self.running:
            head = self.waiting[0]
            victim = max(self.running, key=self._order)
            if victim.priority <= head.priority or self._fits_now(head, self.num_running_seqs()):
                return
            self.running.remove(victim)
            self._preempt(victim, out)

    def _chunk(self, seq: Sequence, budget: list[int]) -> int:
        """Tokens ``seq`` may compute within the remaining token budget (0 = not this step)."""
        wanted = seq.num_uncomputed_tokens
        if wanted <= budget[0]:
            return wanted
        return budget[0] if self.config.enable_chunked_prefill else 0

    def _schedule_group(self, out: SchedulerOutput, group: SequenceGroup, budget: list[int]) -> None:
        for seq in group.seqs_with_status(SequenceStatus.RUNNING):
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                continue
            out.blocks_to_copy.extend(self.block_manager.append_slots(seq, num_new))
            out.scheduled.append(ScheduledSeq(group, seq, num_new, self.block_manager.block_table(seq)))
            budget[0] -= num_new

    def _blocks_needed(self, group: SequenceGroup, budget: list[int]) -> int:
        remaining = budget[0]
        needed = 0
        for seq in group.seqs_with_status(SequenceStatus.RUNNING):
            num_new = min(seq.num_uncomputed_tokens, remaining)
            remaining -= num_new
            if num_new:
                needed += self.block_manager.num_blocks_needed(seq, num_new)
        return needed

    def _schedule_running(self, out: SchedulerOutput, budget: list[int]) -> bool:
        """Give every running request its next tokens; True if some had to be preempted for room."""
        queue = sorted(self.running, key=self._order)
        kept: list[SequenceGroup] = []
        starved = False
        while queue:
            group = queue.pop(0)
            while self._blocks_needed(group, budget) > self.block_manager.num_free_gpu_blocks:
                # evict the newest (lowest-priority) running request; ourselves if none is left
                victim = queue.pop() if queue else group
                self._preempt(victim, out)
                starved = True
                if victim is group:
                    break
            else:
                self._schedule_group(out, group, budget)
                kept.append(group)
        self.running = kept
        return starved

    def _schedule_swapped(self, out: SchedulerOutput, budget: list[int]) -> None:
        num_running_seqs = self.num_running_seqs()
        while self.swapped and not self._waiting_outranks_swapped():
            group = self.swapped[0]
            seqs = group.seqs_with_status(SequenceStatus.SWAPPED)
            if num_running_seqs + len(seqs) > self.config.max_num_seqs:
                break
            if budget[0] < len(seqs) or not self.block_manager.can_swap_in(seqs):
                break
            self.swapped.pop(0)
            mapping = self.block_manager.swap_in(seqs)
            out.blocks_to_swap_in.extend(mapping)
            self.counters.num_blocks_swapped_in += len(mapping)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            num_running_seqs += len(seqs)
            self.running.append(group)
            self._schedule_group(out, group, budget)

    def _schedule_waiting(self, out: SchedulerOutput, budget: list[int]) -> None:
        num_running_seqs = self.num_running_seqs()
        while self.waiting and budget[0] > 0:
            group = self.waiting[0]
            seqs = group.seqs_with_status(SequenceStatus.WAITING)
            if not self._fits_now(group, num_running_seqs):
                break
            if not self.config.enable_chunked_prefill and seqs[0].num_tokens > budget[0]:
                break
            self.waiting.pop(0)
            num_running_seqs += self._seats_wanted(group)
            for seq in seqs:
                self.block_manager.allocate(seq, reuse_prefix=not group.wants_prompt_logprobs)
                seq.status = SequenceStatus.RUNNING
            if group.num_cached_tokens is None:
                group.num_cached_tokens = min(seqs[0].num_computed_tokens, len(group.prompt_token_ids))
            self.running.append(group)
            self._schedule_group(out, group, budget)

    def _can_allocate(self, seqs: list[Sequence], reuse_prefix: bool = True) -> bool:
        if len(seqs) == 1:
            return self.block_manager.can_allocate(seqs[0], reuse_prefix)
        blocks = sum(-(-seq.num_tokens // self.block_manager.block_size) for seq in seqs)
        free = self.block_manager.num_free_gpu_blocks - self.block_manager.watermark_blocks
        return blocks <= free

    # ---- preemption ----------------------------------------------------------------
    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        seqs = group.seqs_with_status(SequenceStatus.RUNNING)
        self.counters.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(seqs):
            mapping = self.block_manager.swap_out(seqs)
            out.blocks_to_swap_out.extend(mapping)
            self.counters.num_preemptions_swap += 1
            self.counters.num_blocks_swapped_out += len(mapping)
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self._insert(self.swapped, group)
            return
        self.counters.num_preemptions_recompute += 1
        for seq in seqs:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, group)

    # ---- after the step ------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: SamplerOutput, finish_reason: FinishCheck) -> None:
        """Apply a step that ran ``out`` and sampled ``sampled``: progress, beams, new tokens, finished sequences
        (their blocks freed) and finished requests (off the running queue)."""
        now = time.monotonic()
        for item in out.scheduled:
            seq = item.seq
            self.counters.prompt_tokens += max(
                0, min(seq.prompt_len, seq.num_computed_tokens + item.num_new_tokens) - seq.num_computed_tokens)
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_computed_blocks(seq)
            if item.group.first_scheduled_time is None:
                item.group.first_scheduled_time = now
        for advance in sampled.beams:
            self._apply_beams(advance, now)
        broken: list[SequenceGroup] = []  # requests whose constraint broke down this step (almost always none)
        for item in sampled.samples:
            # an n-way prompt forks before it takes its token: the samples share its blocks
            forks = [self._fork(item.group, item.seq, generator) for generator in item.fork_generators]
            for seq, result in zip([item.seq, *forks], item.results):
                if self._append_token(item.group, seq, result, now, finish_reason):
                    broken.append(item.group)
        for group in {id(group): group for group in broken}.values():  # each ends now, reporting why, not as if done
            self.remove(group)
            group.finish("error", now)

    def _fork(self, group: SequenceGroup, parent: Sequence, generator: torch.Generator | None) -> Sequence:
        child = group.add_sample(parent, generator)
        self.block_manager.fork(parent, child)
        return child

    def _finish_request(self, group: SequenceGroup, now: float) -> None:
        group.finished_time = now
        self.running.remove(group)

    def _append_token(
        self, group: SequenceGroup, seq: Sequence, result: SampleResult, now: float, finish_reason: FinishCheck,
    ) -> bool:
        """Append a sampled token and end the sequence if it finishes; True if the request's constraint broke down
        (its error is then set)."""
        token = result.token_id
        seq.token_ids.append(token)
        reason = None
        if seq.grammar is not None:
            try:
                seq.grammar.advance(token, group.params.structured_outputs or {})
            except ValueError as exc:  # the output cannot follow its constraint: the request fails, as its own fault
                group.error, group.refused, reason = f"{type(exc).__name__}: {exc}", True, "error"
        self.counters.generation_tokens += 1
        if group.first_token_time is None:
            group.first_token_time = now
        if result.logprobs is not None:
            seq.logprobs.append(result.logprobs)
            seq.cumulative_logprob += result.logprobs[token]
        reason = reason or finish_reason(group, seq, token)
        if reason is None:
            return False
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if group.is_finished:
            self._finish_request(group, now)
        return reason == "error"

    def _apply_beams(self, advance: BeamAdvance, now: float) -> None:
        """Fork kept beams (sharing blocks), drop the rest (freeing what they alone held), record hypotheses."""
        group, step = advance.group, advance.step
        group.beam_hypotheses += step.finished
        self.counters.generation_tokens += len(step.choices)
        if group.first_token_time is None:
            group.first_token_time = now
        kept: list[Sequence] = []
        for beam, extensions in zip(advance.beams, step.extensions(len(advance.beams))):
            if not extensions:
                beam.status = SequenceStatus.FINISHED
                self.block_manager.free(beam)
                continue
            forks = [beam.fork() for _ in extensions[1:]]
            for fork in forks:
                self.block_manager.fork(beam, fork)
            for seq, choice in zip([beam, *forks], extensions):
                seq.token_ids.append(choice.token_id)
                seq.cumulative_logprob = choice.cumulative_logprob
                kept.append(seq)
        group.seqs = kept
        if step.done:
            self._finish_request(group, now)
