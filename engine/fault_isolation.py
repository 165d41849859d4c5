"""Contain a failing engine step: find the request(s) whose step raises and fail only those.

A step that raises is rolled back: what it changed in its requests (tokens, texts, forks,
beams, random generators) is restored to the step's start and each request is queued to
recompute its tokens (its blocks freed). The suspects are then run in halves, each half alone,
until the requests that raise on their own are found; those fail with the error, the others
have simply run their next steps in smaller batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.block_manager import BlockManager
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _SeqState:
    """What a step may change in one sequence (its tokens only grow)."""

    seq: Sequence
    num_tokens: int
    num_logprobs: int
    status: SequenceStatus
    finish_reason: str | None
    stop_reason: int | str | None
    text: str
    prefix_offset: int
    read_offset: int
    cumulative_logprob: float

    @classmethod
    def capture(cls, seq: Sequence) -> _SeqState:
        """The sequence as it is now."""
        return cls(seq, seq.num_tokens, len(seq.logprobs), seq.status, seq.finish_reason, seq.stop_reason, seq.text,
                   seq.prefix_offset, seq.read_offset, seq.cumulative_logprob)

    def restore(self) -> None:
        """Put the sequence back as it was captured."""
        seq = self.seq
        del seq.token_ids[self.num_tokens :]
        del seq.logprobs[self.num_logprobs :]
        seq.status, seq.finish_reason, seq.stop_reason, seq.text = (self.status, self.finish_reason, self.stop_reason,
                                                                    self.text)
        seq.prefix_offset, seq.read_offset = self.prefix_offset, self.read_offset
        seq.cumulative_logprob = self.cumulative_logprob
        if seq.grammar is not None:
            seq.grammar.replay(seq.output_token_ids)


@dataclass(slots=True)
class _GroupState:
    """What a step may change in one request: its sequences (forks, dropped beams) and beam state."""

    group: SequenceGroup
    seqs: list[_SeqState]
    num_hypotheses: int
    pending_beam_logits: dict[int, torch.Tensor]
    first_token_time: float | None
    finished_time: float | None
    num_prompt_logprobs: int

    @classmethod
    def capture(cls, group: SequenceGroup) -> _GroupState:
        """The request as it is now."""
        return cls(group, [_SeqState.capture(seq) for seq in group.seqs], len(group.beam_hypotheses),
                   dict(group.pending_beam_logits), group.first_token_time, group.finished_time,
                   len(group.prompt_logprobs))

    def restore(self, block_manager: BlockManager) -> None:
        """Put the request back as it was captured; sequences forked since then are freed."""
        group = self.group
        kept = {id(state.seq) for state in self.seqs}
        for seq in group.seqs:
            if id(seq) not in kept:
                block_manager.free(seq)
        for state in self.seqs:
            state.restore()
        group.seqs = [state.seq for state in self.seqs]
        del group.beam_hypotheses[self.num_hypotheses :]
        group.pending_beam_logits = self.pending_beam_logits
        group.first_token_time, group.finished_time = self.first_token_time, self.finished_time
        del group.prompt_logprobs[self.num_prompt_logprobs :]


@dataclass(slots=True)
class StepCheckpoint:
    """The requests of one step and their random generators' states, taken before it runs."""

    groups: list[_GroupState]
    generator_states: list[tuple[torch.Generator, torch.Tensor]]

    @classmethod
    def capture(cls, groups: list[SequenceGroup]) -> StepCheckpoint:
        """Checkpoint ``groups`` (a generator shared by several is captured once)."""
        sources = [g.generator for g in groups] + [seq.generator for g in groups for seq in g.seqs]
        generators = {id(gen): gen for gen in sources if gen is not None}
        return cls([_GroupState.capture(g) for g in groups], [(g, g.get_state()) for g in generators.values()])

    def roll_back(self, scheduler: Scheduler) -> None:
        """Undo the step and queue its requests to recompute their tokens."""
        for state in self.groups:
            state.restore(scheduler.block_manager)
            scheduler.requeue_for_recompute(state.group)
        for generator, generator_state in self.generator_states:
            generator.set_state(generator_state)


def _groups_of(scheduled: list[ScheduledSeq]) -> list[SequenceGroup]:
    return list({id(item.group): item.group for item in scheduled}.values())


def _caught_up(group: SequenceGroup) -> bool:
    """True once a requeued request has recomputed its tokens and sampled again (or finished)."""
    return all(seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens <= 1 for seq in group.unfinished_seqs)


class StepFunctions(NamedTuple):
    """The two halves of an engine step, which the isolator may call more than once while isolating."""

    schedule: Callable[[], SchedulerOutput]  # picks the step's work and moves its blocks
    execute: Callable[[SchedulerOutput], None]  # runs the model, samples and updates the scheduler and requests


class FaultIsolator:
    """Runs engine steps so that a request whose step raises fails alone, with the error on it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.num_failed_requests = 0

    def step(self, steps: StepFunctions) -> list[SequenceGroup]:
        """One engine step (more while isolating a fault); the requests it touched.

        The step functions come with each call rather than at construction: the engine holds this
        isolator, and a reference back would keep the engine, and its KV cache, alive until a cyclic
        garbage collection.
        """
        touched: dict[int, SequenceGroup] = {}
        error = self._try(steps, steps.schedule(), touched)
        if error is not None:
            suspects = list(touched.values())
            logger.warning("engine step failed with %d requests in it (%r); isolating", len(suspects), error)
            self._isolate(steps, suspects, error, touched)
        return list(touched.values())

    def _try(self, steps: StepFunctions, out: SchedulerOutput, touched: dict[int, SequenceGroup]) -> Exception | None:
        """Run one step; on an exception, roll its requests back and return it."""
        groups = _groups_of(out.scheduled)
        touched.update((id(g), g) for g in groups)
        if out.is_empty:
            return None
        checkpoint = StepCheckpoint.capture(groups)
        try:
            steps.execute(out)
        except Exception as exc:  # whatever a request makes the model or sampler raise
            checkpoint.roll_back(self.scheduler)
            return exc
        return None

    def _isolate(
        self, steps: StepFunctions, suspects: list[SequenceGroup], error: Exception,
        touched: dict[int, SequenceGroup],
    ) -> None:
        """``suspects`` raised ``error`` together: fail them if alone, else probe each half."""
        if len(suspects) == 1:
            self._fail(suspects[0], error)
            return
        half = len(suspects) // 2
        for part in (suspects[:half], suspects[half:]):
            part_error = self._probe(steps, part, touched)
            if part_error is not None:
                self._isolate(steps, part, part_error, touched)

    def _probe(
        self, steps: StepFunctions, groups: list[SequenceGroup], touched: dict[int, SequenceGroup],
    ) -> Exception | None:
        """Step ``groups`` alone until each has caught up; the error if a step of theirs raised."""
        with self.scheduler.restricted_to(groups):
            while not all(_caught_up(group) for group in groups):
                out = steps.schedule()
                if out.is_empty:  # no room to run them alone: no evidence, they run as usual later
                    return None
                error = self._try(steps, out, touched)
                if error is not None:
                    return error
        return None

    def _fail(self, group: SequenceGroup, error: Exception) -> None:
        self.scheduler.remove(group)
        group.error = f"{type(error).__name__}: {error}"
        group.finish("error", time.monotonic())
        self.num_failed_requests += 1
        logger.warning("request %s failed alone in an engine step: %s", group.request_id, group.error)
