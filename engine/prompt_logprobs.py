"""The logprobs of a prompt's own tokens (vLLM's ``prompt_logprobs``), computed from the hidden states of the
prefill rows that predict them: row ``q`` of a sequence predicts its token ``q + 1``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.models.llama import LlamaForCausalLM
from engine.sampler import token_logprobs
from engine.scheduler import ScheduledSeq
from engine.sequence import SequenceGroup

# rows whose full-vocabulary log-softmax is held at once (256 x 49,152 fp32 logits: 50 MB)
ROWS_PER_PASS = 256


@dataclass(slots=True)
class PromptLogprob:
    """Token ``position``'s logprob (and the top alternatives) of a request's prompt."""

    group: SequenceGroup
    position: int
    logprobs: dict[int, float]


@dataclass(slots=True)
class PromptRows:
    """A step's flattened rows whose logits give prompt logprobs, with the token each one predicts."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    owners: list[tuple[SequenceGroup, int]] = field(default_factory=list)  # (request, predicted position)

    def add(self, item: ScheduledSeq, start: int, end: int, first_row: int) -> None:
        """The rows of positions ``start:end`` (at ``first_row`` on) that predict a prompt token not yet known."""
        group = item.group
        if not group.wants_prompt_logprobs:
            return
        prompt = group.prompt_token_ids
        for position in range(max(start, len(group.prompt_logprobs) - 1), min(end, len(prompt) - 1)):
            self.rows.append(first_row + position - start)
            self.targets.append(prompt[position + 1])
            self.owners.append((group, position + 1))

    def logprobs(self, model: LlamaForCausalLM, hidden: torch.Tensor) -> list[PromptLogprob]:
        """Each row's predicted token's logprob and its request's top ``prompt_logprobs`` alternatives."""
        results: list[PromptLogprob] = []
        for begin in range(0, len(self.rows), ROWS_PER_PASS):
            rows = torch.tensor(self.rows[begin : begin + ROWS_PER_PASS], device=hidden.device)
            owners = self.owners[begin : begin + ROWS_PER_PASS]
            entries = token_logprobs(model.compute_logits(hidden.index_select(0, rows)),
                                     self.targets[begin : begin + ROWS_PER_PASS],
                                     [group.params.prompt_logprobs or 0 for group, _ in owners])
            results += [PromptLogprob(group, position, entry)
                        for (group, position), entry in zip(owners, entries, strict=True)]
        return results


def record(results: list[PromptLogprob]) -> None:
    """Append each result to its request; results come in prompt order, and one for a position the request already
    holds is dropped, so each position is recorded once."""
    for result in results:
        if len(result.group.prompt_logprobs) == result.position:
            result.group.prompt_logprobs.append(result.logprobs)
