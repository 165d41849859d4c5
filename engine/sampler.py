"""Logits → next tokens: penalties, min-token suppression, temperature, top-k/p, min-p, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence to pick its next token."""

    params: SamplingParams
    generator: torch.Generator
    token_ids: list[int]  # prompt + output, read only when penalties need them
    prompt_len: int
    suppressed_token_ids: list[int]


@dataclass(slots=True)
class SampleResult:
    """The chosen token and, when asked for, its logprob and the top alternatives."""

    token_id: int
    logprobs: dict[int, float] | None = None


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """Repetition (prompt + output, multiplicative) and presence/frequency (output) penalties."""
    params = row.params
    output_token_ids = row.token_ids[row.prompt_len :]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_token_ids:
        counts = torch.bincount(torch.tensor(output_token_ids, dtype=torch.long), minlength=logits.shape[0])
        counts = counts[: logits.shape[0]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what lies outside each row's top-k and top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _random_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows])
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype)
    if bool((top_k < vocab).any() or (top_p < 1).any()):
        logits = _filter_top_k_top_p(logits, top_k, top_p)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype)
    if bool((min_p > 0).any()):
        logits = _filter_min_p(logits, min_p)
    return _inverse_cdf_sample(logits.softmax(dim=-1), rows).tolist()


def _inverse_cdf_sample(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of ``probs``: the first whose cumulative mass exceeds a uniform draw from
    that row's own generator. One random number per row (``torch.multinomial`` draws one per
    vocabulary entry), and a seeded row's draws do not depend on the rest of the batch."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1]
    uniform = torch.stack([torch.rand((), generator=row.generator) for row in rows])
    # strictly below the total, so the token found always has a positive probability
    targets = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, targets[:, None], right=True)[:, 0]


def _logprobs(raw_logits: torch.Tensor, token_id: int, num_top: int) -> dict[int, float]:
    logprobs = raw_logits.log_softmax(dim=-1)
    result: dict[int, float] = {}
    if num_top:
        values, ids = logprobs.topk(num_top)
        result.update(zip(ids.tolist(), values.tolist()))
    result[token_id] = float(logprobs[token_id])
    return result


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
    """One token per row of ``logits [rows, vocab]`` (fp32); logprobs are of the raw model output."""
    raw = logits
    edited = [i for i, row in enumerate(rows) if row.params.has_penalties or row.suppressed_token_ids]
    if edited:  # keep the raw logits intact for logprobs
        logits = logits.clone()
    for i in edited:
        row = rows[i]
        if row.params.has_penalties:
            apply_penalties(logits[i], row)
        if row.suppressed_token_ids:
            logits[i, row.suppressed_token_ids] = float("-inf")
    tokens = [0] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    if greedy:
        greedy_logits = logits if len(greedy) == len(rows) else logits[greedy]  # no copy in the common case
        for i, token in zip(greedy, greedy_logits.argmax(dim=-1).tolist()):
            tokens[i] = token
    randomized = [i for i, row in enumerate(rows) if not row.params.greedy]
    if randomized:
        picked = _random_sample(logits[randomized], [rows[i] for i in randomized])
        for i, token in zip(randomized, picked):
            tokens[i] = token
    return [
        SampleResult(token, _logprobs(raw[i], token, row.params.logprobs) if row.params.logprobs is not None else None)
        for i, (token, row) in enumerate(zip(tokens, rows))
    ]
