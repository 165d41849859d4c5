"""A sequence's tokens and progress, and the request (group of sequences) it belongs to."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.sampler import LogitEdits
    from engine.structured_output import GrammarState

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # identity: queues look sequences up with `in` / `remove`
class Sequence:
    """One generated continuation: prompt + output tokens and how many have KV in the cache."""

    token_ids: list[int]
    prompt_len: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop_token_ids token or stop string that ended it (vLLM's)
    text: str = ""
    # incremental detokenisation window (see engine.detokenizer)
    prefix_offset: int = 0
    read_offset: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    generator: torch.Generator | None = None  # a seeded request's 2nd..nth sample draws from its own
    grammar: GrammarState | None = None  # with structured outputs: where its output stands in the grammar

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens only."""
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not in the cache yet (the whole prompt before prefill)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once a stop condition (or an abort) ended this sequence."""
        return self.status is SequenceStatus.FINISHED

    def fork(self) -> Sequence:
        """A new sequence with the same tokens and progress (its blocks are forked separately)."""
        return Sequence(
            token_ids=list(self.token_ids),
            prompt_len=self.prompt_len,
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            text=self.text,
            prefix_offset=self.prefix_offset,
            read_offset=self.read_offset,
            logprobs=list(self.logprobs),
            cumulative_logprob=self.cumulative_logprob,
            grammar=None if self.grammar is None else self.grammar.copy(),
        )


@dataclass(slots=True)
class BeamHypothesis:
    """A finished beam: its generated tokens and length-normalised score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request: its prompt, sampling parameters and its 1..n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # prompt tokens whose K/V its first scheduling found in the prefix cache (vLLM's num_cached_tokens); None until
    # then, and a recompute after a preemption leaves it as it was
    num_cached_tokens: int | None = None
    generator: torch.Generator | None = None
    beam_hypotheses: list[BeamHypothesis] = field(default_factory=list)
    # next-token logits of beams that finished recomputing before their siblings did
    pending_beam_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    refused: bool = False  # the failure is the request's own: its constraint could not be followed
    logit_edits: LogitEdits | None = None  # its logit_bias / allowed_token_ids as tensors, made by the sampler once
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized (bad_words.py)
    # with params.prompt_logprobs: position i's entry holds token i's logprob given the tokens before it (the first
    # token has none); filled in prompt order as prefill chunks compute them, never twice (recompute skips them)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether this request still needs logits at some prompt position."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @classmethod
    def create(
        cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        params: SamplingParams, priority: int = 0, grammar: GrammarState | None = None,
    ) -> SequenceGroup:
        """A new request with a single sequence (in ``grammar``'s start state, if given); ``n > 1`` forks after the
        prompt is computed."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        seq = Sequence(token_ids=list(prompt_token_ids), prompt_len=len(prompt_token_ids), grammar=grammar)
        return cls(request_id, prompt, list(prompt_token_ids), params, [seq], priority, generator=generator)

    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        """This request's sequences that are in ``status``."""
        return [seq for seq in self.seqs if seq.status is status]

    @property
    def unfinished_seqs(self) -> list[Sequence]:
        """Sequences still generating."""
        return [seq for seq in self.seqs if not seq.is_finished]

    @property
    def is_finished(self) -> bool:
        """True when every sequence is finished."""
        return all(seq.is_finished for seq in self.seqs)

    def sample_generator(self, index: int) -> torch.Generator | None:
        """The generator of this ``n > 1`` request's sample ``index`` (1..n-1), None unless seeded. A seeded
        sample draws from its own, so its draws never depend on when its siblings are scheduled (after a
        recompute, they may catch up in different steps)."""
        if self.params.seed is None:
            return None
        return torch.Generator().manual_seed(hash((self.params.seed, index)) % 2**63)

    def add_sample(self, parent: Sequence, generator: torch.Generator | None) -> Sequence:
        """Fork ``parent`` into this ``n > 1`` request's next sample, drawing from ``generator``."""
        child = parent.fork()
        child.generator = generator
        self.seqs.append(child)
        return child

    def finish(self, reason: str, now: float) -> None:
        """End every unfinished sequence with ``reason`` (an abort or an error)."""
        for seq in self.unfinished_seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
        self.finished_time = now

    @property
    def num_seqs_wanted(self) -> int:
        """How many sequences this request runs at once once it forks (n samples or beams)."""
        return max(self.params.n, self.params.beam_width)

    @property
    def awaits_fork(self) -> bool:
        """True while an ``n > 1`` sampling request still runs on its single prompt sequence."""
        return self.params.n > 1 and len(self.seqs) == 1 and not self.params.is_beam_search
