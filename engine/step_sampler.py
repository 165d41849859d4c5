"""A step's logits → what it sampled: next tokens (n per prompt of an ``n > 1`` request) and beam steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from engine.bad_words import banned_next_tokens
from engine.beam_search import BeamAdvance, advance_beams
from engine.sampler import SampleResult, SamplingRow, sample
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class SampledSeq:
    """Tokens sampled for one sequence: one, or for a prompt that forks into ``n`` samples one per sample
    (the 1st for ``seq``, the others for forks that draw from ``fork_generators``)."""

    group: SequenceGroup
    seq: Sequence
    fork_generators: list[torch.Generator | None]
    results: list[SampleResult] = field(default_factory=list)


@dataclass(slots=True)
class SamplerOutput:
    """What one step sampled, for the scheduler to apply: sequences' next tokens and requests' beam steps."""

    samples: list[SampledSeq] = field(default_factory=list)
    beams: list[BeamAdvance] = field(default_factory=list)


class StepSampler:
    """Samples every sequence that reached its last token; beam-search requests advance their beams."""

    def __init__(self, eos_token_ids: set[int], compiled: ModuleType | None = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.compiled = compiled  # the CPU's compiled kernels, for their sampler (engine.sampler.sample)

    def _row(self, group: SequenceGroup, seq: Sequence, generator: torch.Generator | None,
             device: torch.device) -> SamplingRow:
        params = group.params
        suppressed: list[int] = []
        if seq.num_output_tokens < params.min_tokens:
            suppressed = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        if group.bad_words_token_ids:
            suppressed += banned_next_tokens(group.bad_words_token_ids, seq.token_ids, seq.prompt_len)
        row = SamplingRow(params, generator or group.generator, seq.token_ids, seq.prompt_len, suppressed, seq.grammar,
                          group.logit_edits)
        group.logit_edits = row.logit_edits(device)  # made at the request's first step, then kept
        return row

    def sample(self, logits: torch.Tensor, sampled: list[ScheduledSeq]) -> SamplerOutput:
        """``logits`` holds one row per ``sampled`` sequence, in order."""
        out = SamplerOutput()
        rows: list[SamplingRow] = []
        row_of_logits: list[int] = []
        beam_rows: dict[SequenceGroup, list[tuple[Sequence, torch.Tensor]]] = {}
        for i, item in enumerate(sampled):
            group, seq = item.group, item.seq
            if group.params.is_beam_search:
                beam_rows.setdefault(group, []).append((seq, logits[i]))
                continue
            # the prompt is computed once; its logits row is sampled for each of the n samples
            forks = [group.sample_generator(k) for k in range(1, group.params.n)] if group.awaits_fork else []
            out.samples.append(SampledSeq(group, seq, forks))
            for generator in [seq.generator, *forks]:
                rows.append(self._row(group, seq, generator, logits.device))
                row_of_logits.append(i)
        for group, group_rows in beam_rows.items():
            advance = advance_beams(group, group_rows, self.eos_token_ids)
            if advance is not None:
                out.beams.append(advance)
        if rows:
            forked = row_of_logits != list(range(len(sampled)))
            results = iter(sample(logits[row_of_logits] if forked else logits, rows, self.compiled))
            for item in out.samples:
                item.results = [next(results) for _ in range(1 + len(item.fork_generators))]
        return out
