"""Beam search over the paged cache: pick the next beams; finished beams become hypotheses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import BeamHypothesis, Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class BeamChoice:
    """A continuation kept for the next step: which beam it extends, with which token."""

    parent: int
    token_id: int
    cumulative_logprob: float


@dataclass(slots=True)
class BeamStep:
    """The outcome of one beam-search step for one request."""

    choices: list[BeamChoice]
    finished: list[BeamHypothesis]
    done: bool

    def extensions(self, num_beams: int) -> list[list[BeamChoice]]:
        """For each beam, the continuations that extend it (none: the beam is dropped; all are once done)."""
        per_beam: list[list[BeamChoice]] = [[] for _ in range(num_beams)]
        if not self.done:
            for choice in self.choices:
                per_beam[choice.parent].append(choice)
        return per_beam


@dataclass(slots=True)
class BeamAdvance:
    """One request's beam-search step, for the scheduler to apply: its beams and what becomes of them."""

    group: SequenceGroup
    beams: list[Sequence]
    step: BeamStep


def _normalised(cumulative_logprob: float, num_generated: int, length_penalty: float) -> float:
    return cumulative_logprob / (num_generated**length_penalty)


def _continuation_logprobs(beams: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """Cumulative logprob of every (beam, token), always finite: NaN and +inf logits are masked,
    and what would be -inf (or NaN, for a row with no finite logit) is fp32's lowest value."""
    lowest = torch.finfo(torch.float32).min
    finite = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=float("-inf"), neginf=float("-inf"))
    logprobs = torch.nan_to_num(finite.log_softmax(dim=-1), nan=lowest, neginf=lowest)
    running = torch.tensor([beam.cumulative_logprob for beam in beams], dtype=torch.float32, device=logits.device)
    return (logprobs + running[:, None]).clamp_(min=lowest)


def beam_step(
    beams: list[Sequence], logits: torch.Tensor, beam_width: int, max_tokens: int,
    length_penalty: float, eos_token_ids: set[int], hypotheses: list[BeamHypothesis],
) -> BeamStep:
    """Rank every (beam, token) continuation by cumulative logprob (fp32, as transformers does)
    and keep the ``beam_width`` best that do not end in EOS; EOS endings among the top
    ``beam_width`` become hypotheses."""
    totals = _continuation_logprobs(beams, logits).view(-1)
    values, indices = totals.topk(min(2 * beam_width, totals.numel()))
    vocab = logits.shape[-1]
    num_generated = beams[0].num_output_tokens + 1
    choices: list[BeamChoice] = []
    finished: list[BeamHypothesis] = []
    for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist())):
        parent, token = divmod(index, vocab)
        if token in eos_token_ids:
            if rank < beam_width:
                tokens = beams[parent].output_token_ids + [token]
                score = _normalised(value, num_generated, length_penalty)
                finished.append(BeamHypothesis(tokens, value, score, "stop"))
            continue
        choices.append(BeamChoice(parent, token, value))
        if len(choices) == beam_width:
            break
    if num_generated >= max_tokens:
        finished += [
            BeamHypothesis(beams[c.parent].output_token_ids + [c.token_id], c.cumulative_logprob,
                           _normalised(c.cumulative_logprob, num_generated, length_penalty), "length")
            for c in choices
        ]
        return BeamStep([], finished, True)
    ranked = sorted(hypotheses + finished, key=lambda h: h.score, reverse=True)[:beam_width]
    best_running = _normalised(choices[0].cumulative_logprob, num_generated, length_penalty) if choices else None
    # no running beam can still beat the worst of beam_width finished ones (transformers' heuristic)
    done = best_running is None or (len(ranked) >= beam_width and best_running <= ranked[-1].score)
    return BeamStep(choices, finished, done)


def _ready_beams(
    group: SequenceGroup, rows: list[tuple[Sequence, torch.Tensor]],
) -> tuple[list[Sequence], torch.Tensor] | None:
    """Keep this step's next-token logits of ``group``'s beams; once every running beam has its row (after
    a recompute, beams may catch up in different steps), the beams and their rows stacked in that order."""
    pending = group.pending_beam_logits
    pending.update((seq.seq_id, row) for seq, row in rows)
    beams = group.seqs_with_status(SequenceStatus.RUNNING)
    if len(pending) < len(beams):
        return None
    return beams, torch.stack([pending.pop(beam.seq_id) for beam in beams])


def advance_beams(
    group: SequenceGroup, rows: list[tuple[Sequence, torch.Tensor]], eos_token_ids: set[int],
) -> BeamAdvance | None:
    """The request's next beam-search step from its beams' logits rows; None while some beam still lacks one."""
    ready = _ready_beams(group, rows)
    if ready is None:
        return None
    beams, logits = ready
    params = group.params
    eos = set() if params.ignore_eos else eos_token_ids
    step = beam_step(beams, logits, params.beam_width, params.max_tokens, params.length_penalty, eos,
                     group.beam_hypotheses)
    return BeamAdvance(group, beams, step)


def best_hypotheses(group: SequenceGroup) -> list[BeamHypothesis]:
    """A finished beam-search request's ``beam_width`` best hypotheses, best first."""
    return sorted(group.beam_hypotheses, key=lambda h: h.score, reverse=True)[: group.params.beam_width]
