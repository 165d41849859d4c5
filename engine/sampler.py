"""Logits → next tokens: penalties, logit bias, allowed tokens, min-token suppression, temperature, then vLLM's
order of filters (min-p, top-k, and top-p over what those two kept, renormalized), logprobs.

Numerically safe: NaN and +inf never reach a softmax, and a row whose distribution is degenerate
(NaN or +inf logits, every token masked) takes the arg-max of its finite logits, so every token
returned lies in ``[0, vocab)``. Every tensor is made on ``logits.device``.

On the CPU the draws after the logit edits are the compiled kernels' (``paged_kernels/csrc/sampler_cpu.cpp``), to the
same tokens: over SmolLM2's 49,152 tokens on a 2-vCPU Zen 3 the torch ops took 0.57 ms at one row, 3.8 ms at 16 and
5.0 ms at 64 with a temperature alone, the kernel 0.13, 0.56 and 1.9 ms; with top-p, whose torch path sorts the
vocabulary, 5.3 ms at one row and 179 ms at 64, the kernel 0.29 and 5.8 ms (``benchmarks.sampler``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarState, allowed_tokens

NEG_INF = float("-inf")
FP32 = torch.finfo(torch.float32)
# Vocabulary entries per block of the two-level scans below. torch's CPU max-with-index, argmax and cumsum over a
# 49,152-token vocabulary take 0.2-1.5 ms per call at 8-32 rows (one thread per row, no vectorizing), amax and
# sum 0.02-0.06 ms: reducing blocks first leaves the slow ops a few hundred entries per row.
SCAN_BLOCK = 256


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence to pick its next token."""

    params: SamplingParams
    generator: torch.Generator
    token_ids: list[int]  # prompt + output, read only when penalties need them
    prompt_len: int
    suppressed_token_ids: list[int]
    grammar: GrammarState | None = None  # structured outputs: only the tokens it allows next may be drawn
    edits: LogitEdits | None = None  # its request's logit_bias / allowed_token_ids as tensors (made here if None)

    def logit_edits(self, device: torch.device) -> LogitEdits | None:
        """The request's logit edits on ``device`` (made and kept on first use), or None when it asks for none."""
        if self.params.logit_bias is None and self.params.allowed_token_ids is None:
            return None
        if self.edits is None or self.edits.device != device:
            self.edits = logit_edits(self.params, device)
        return self.edits


@dataclass(frozen=True, slots=True)
class LogitEdits:
    """A request's logit_bias and allowed_token_ids as tensors on one device, made once per request rather than from
    Python lists at every step (an allowed list may hold thousands of ids)."""

    device: torch.device
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    allowed_ids: torch.Tensor | None


def logit_edits(params: SamplingParams, device: torch.device) -> LogitEdits:
    """``params``' logit_bias and allowed_token_ids as tensors on ``device``."""
    bias = params.logit_bias or {}
    return LogitEdits(
        device,
        torch.tensor(list(bias), dtype=torch.long, device=device) if bias else None,
        torch.tensor(list(bias.values()), dtype=torch.float32, device=device) if bias else None,
        None if params.allowed_token_ids is None else torch.tensor(params.allowed_token_ids, dtype=torch.long,
                                                                   device=device),
    )


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
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_token_ids:
        output = torch.tensor(output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(output, minlength=logits.shape[0])[: logits.shape[0]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def apply_bias_and_allowed(logits: torch.Tensor, edits: LogitEdits) -> None:
    """vLLM's logit_bias (added to the tokens' logits) and allowed_token_ids (every other token masked)."""
    if edits.bias_ids is not None and edits.bias_values is not None:
        logits.index_add_(0, edits.bias_ids, edits.bias_values.to(logits.dtype))
    if edits.allowed_ids is not None:
        kept = logits[edits.allowed_ids]
        logits.fill_(NEG_INF).index_copy_(0, edits.allowed_ids, kept)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what lies outside each row's top-k, then outside the top-p nucleus of the tokens top-k kept (their
    probabilities renormalized, as vLLM and transformers compute it)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    sorted_logits = sorted_logits.masked_fill((probs.cumsum(dim=-1) - probs) >= top_p[:, None], NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, NEG_INF)


def _row_values(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _random_sample(
    finite: torch.Tensor, row_max: torch.Tensor, rows: list[SamplingRow]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``finite`` (no NaN or +inf; ``row_max`` is each row's max); also which rows had
    nothing to draw from."""
    vocab = finite.shape[-1]
    empty = torch.isneginf(row_max)[:, None]  # every token masked: its weights are all 0, and it is replaced
    # shifted by the row's max, the logits are <= 0 with a 0, so scaling by any temperature stays in [-inf, 0]
    # (never NaN or +inf: huge logits are shifted before they are scaled) and the weights have mass; an empty
    # row is shifted by 0 and stays -inf; temperature inf would give -inf/inf, so it is clamped
    inverse_t = _row_values([r.params.temperature for r in rows], finite).clamp_(max=FP32.max).reciprocal_()[:, None]
    logits = (finite - torch.where(empty, 0.0, row_max[:, None])).mul_(inverse_t)
    # vLLM's order: min-p, then top-k, then top-p over what those two kept, renormalized
    min_p = [r.params.min_p for r in rows]
    if any(p > 0 for p in min_p):
        logits = _filter_min_p(logits, _row_values(min_p, finite))
    top_k = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1 for p in top_p):
        top_k_tensor = torch.tensor(top_k, dtype=torch.long, device=finite.device)
        logits = _filter_top_k_top_p(logits, top_k_tensor, _row_values(top_p, finite))
    tokens, total = _inverse_cdf_sample(logits.exp_(), rows)  # logits is this function's own tensor
    return tokens, empty[:, 0] | ~torch.isfinite(total) | (total <= 0)


def _reduce_blocks(values: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``reduce`` (torch.amax or torch.sum) of each SCAN_BLOCK entries of each row of ``values [rows, vocab]``:
    ``[rows, ceil(vocab / SCAN_BLOCK)]``, the last block holding what is left over."""
    rows, vocab = values.shape
    whole = vocab // SCAN_BLOCK
    parts = [reduce(values[:, : whole * SCAN_BLOCK].reshape(rows, whole, SCAN_BLOCK), dim=-1)] if whole else []
    if vocab % SCAN_BLOCK:
        parts.append(reduce(values[:, whole * SCAN_BLOCK :], dim=-1, keepdim=True))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _block_of(values: torch.Tensor, block: torch.Tensor, fill: float) -> torch.Tensor:
    """Each row's entries in its block ``block[row]`` (``[rows, SCAN_BLOCK]``); ``fill`` past the vocabulary."""
    columns = block[:, None] * SCAN_BLOCK + torch.arange(SCAN_BLOCK, device=values.device)
    inside = values.gather(-1, columns.clamp(max=values.shape[-1] - 1))
    return inside.masked_fill_(columns >= values.shape[-1], fill)


def _max_and_first_argmax(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values.max(dim=-1)`` (each row's max and the index of its first maximum) through block maxima: the first
    block holding the row's max, then the first maximum inside it. ``values`` holds no NaN."""
    row_max, block = _reduce_blocks(values, torch.amax).max(dim=-1)
    return row_max, block * SCAN_BLOCK + _block_of(values, block, NEG_INF).argmax(dim=-1)


def _strictly_below(limit: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` capped to the largest float below ``limit`` (0 where ``limit`` is 0)."""
    return torch.minimum(value, torch.nextafter(limit, torch.zeros_like(limit)))


def _inverse_cdf_sample(weights: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``weights`` (unnormalized probabilities: normalizing them would cost a pass over the
    vocabulary): the first whose cumulative weight exceeds a uniform draw, scaled by the row's total, from
    that row's own generator. One random number per row (``torch.multinomial`` draws one per
    vocabulary entry), and a seeded row's draws do not depend on the rest of the batch. The search runs on
    block sums, then inside the block found. Returns the tokens and each row's total weight."""
    block_cumulative = _reduce_blocks(weights, torch.sum).cumsum(dim=-1)
    total = block_cumulative[:, -1]
    # drawn on the generators' device (the engine's are CPU generators, so seeded draws are the
    # same on every device), then moved to the logits' device in one copy
    uniform = torch.stack([torch.rand((), generator=row.generator, device=row.generator.device) for row in rows])
    uniform = uniform.to(device=weights.device, dtype=weights.dtype)
    # strictly below the total, so the block found has a positive weight (its cumulative weight rises past the
    # target), and inside it strictly below its own total, so the token found has a positive weight too; this
    # takes cumulative sums that never fall as they add weights >= 0 (the CPU's sequential cumsum; a device's
    # parallel scan may round otherwise, and the clamps still keep every token inside the vocabulary)
    targets = _strictly_below(total, uniform * total)
    block = torch.searchsorted(block_cumulative, targets[:, None], right=True)[:, 0]
    block.clamp_(max=block_cumulative.shape[-1] - 1)
    before = F.pad(block_cumulative, (1, 0)).gather(-1, block[:, None])[:, 0]  # the weight of the blocks before
    inside = _block_of(weights, block, 0.0).cumsum(dim=-1)
    local = _strictly_below(inside[:, -1], (targets - before).clamp_(min=0.0))
    offset = torch.searchsorted(inside, local[:, None], right=True)[:, 0].clamp_(max=SCAN_BLOCK - 1)
    return (block * SCAN_BLOCK + offset).clamp_(0, weights.shape[-1] - 1), total


def token_logprobs(raw: torch.Tensor, tokens: list[int], num_top: list[int]) -> list[dict[int, float]]:
    """Per row of raw model output: the logprob of ``tokens[i]`` and of the row's ``num_top[i]`` likeliest tokens.
    Non-finite values are clamped to fp32's range so results are always finite numbers."""
    finite = torch.nan_to_num(raw.float(), nan=NEG_INF, posinf=FP32.max, neginf=NEG_INF)
    logprobs = torch.nan_to_num(finite.log_softmax(dim=-1), nan=FP32.min, neginf=FP32.min)
    chosen_ids = torch.tensor(tokens, dtype=torch.long, device=raw.device)
    chosen = logprobs.gather(-1, chosen_ids[:, None])[:, 0].tolist()
    top_values, top_ids = logprobs.topk(min(max(num_top), raw.shape[-1]), dim=-1)
    entries = []
    for token, value, num, values, ids in zip(tokens, chosen, num_top, top_values.tolist(), top_ids.tolist(),
                                              strict=True):
        entry = dict(zip(ids[:num], values[:num], strict=True))
        entry[token] = value
        entries.append(entry)
    return entries


def _logprobs(raw: torch.Tensor, tokens: list[int], rows: list[SamplingRow]) -> list[dict[int, float] | None]:
    """Logprobs of the raw model output for the rows that asked: the chosen token and the top ones."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    results: list[dict[int, float] | None] = [None] * len(rows)
    if not wanted:
        return results
    index = torch.tensor(wanted, dtype=torch.long, device=raw.device)
    entries = token_logprobs(raw.index_select(0, index), [tokens[i] for i in wanted],
                             [rows[i].params.logprobs or 0 for i in wanted])
    for i, entry in zip(wanted, entries, strict=True):
        results[i] = entry
    return results


def _apply_grammars(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Mask to -inf the tokens each constrained row's grammar does not allow next."""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained:
        return
    allowed = allowed_tokens([rows[i].grammar for i in constrained], work.shape[-1])  # type: ignore[misc]
    index = torch.tensor(constrained, dtype=torch.long)
    if work.device.type != "cpu":
        allowed, index = allowed.to(work.device, non_blocking=True), index.to(work.device, non_blocking=True)
    work.index_copy_(0, index, work.index_select(0, index).masked_fill_(~allowed, NEG_INF))


def _fallback_inside_allowed(logits: torch.Tensor, tokens: torch.Tensor, broken: torch.Tensor,
                             rows: list[SamplingRow], edited: list[int]) -> torch.Tensor:
    """A row that limits its tokens (allowed_token_ids) but had every one masked (by min_tokens, a grammar) takes the
    likeliest allowed token of the raw logits, not the arg-max of nothing (token 0). On the device: no read-back.
    Only ``edited`` rows can limit their tokens."""
    for i in edited:
        edits = rows[i].logit_edits(logits.device)
        if edits is not None and edits.allowed_ids is not None:
            ids = edits.allowed_ids
            raw = torch.nan_to_num(logits[i, ids].float(), nan=NEG_INF, posinf=FP32.max)
            tokens[i] = torch.where(broken[i], ids[raw.argmax()], tokens[i])
    return tokens


def _compiled_draws(work: torch.Tensor, rows: list[SamplingRow], compiled: ModuleType) -> torch.Tensor:
    """One token per row of ``work`` (the logits after their edits) by the CPU's compiled sampler: what the torch ops
    below choose, from the same one draw per random row of its generator."""
    vocab = work.shape[-1]
    uniforms = [-1.0 if row.params.greedy else  # the kernel's mark of a greedy row
                torch.rand((), generator=row.generator, device=row.generator.device).item() for row in rows]
    inverse_t = _row_values([r.params.temperature for r in rows], work).clamp_(max=FP32.max).reciprocal_()
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
    return compiled.sample_tokens(
        work.contiguous(), inverse_t, torch.tensor(uniforms, dtype=torch.float32, device=work.device),
        torch.tensor(top_k, dtype=torch.long, device=work.device), _row_values([r.params.top_p for r in rows], work),
        _row_values([r.params.min_p for r in rows], work))


def sample(logits: torch.Tensor, rows: list[SamplingRow], compiled: ModuleType | None = None) -> list[SampleResult]:
    """One token per row of ``logits [rows, vocab]`` (fp32); logprobs are of the raw model output. ``compiled``: the
    CPU's compiled kernels, whose sampler then draws every row of CPU logits after their edits (a few passes over
    each row where the torch ops below take about twenty, and a sort of the vocabulary for top-k or top-p)."""
    edited = [i for i, row in enumerate(rows)
              if row.params.edits_logits or row.suppressed_token_ids or row.grammar is not None]
    work = logits.clone() if edited else logits  # keep the raw logits intact for logprobs
    for i in edited:
        row = rows[i]
        if row.params.has_penalties:
            apply_penalties(work[i], row)
        edits = row.logit_edits(work.device)
        if edits is not None:
            apply_bias_and_allowed(work[i], edits)
        if row.suppressed_token_ids:
            work[i, row.suppressed_token_ids] = NEG_INF
    _apply_grammars(work, rows)
    if compiled is not None and work.device.type == "cpu":
        tokens = _compiled_draws(work, rows, compiled)
        if edited:
            tokens = _fallback_inside_allowed(logits, tokens, ~torch.isfinite(work.amax(dim=-1)), rows, edited)
    else:
        tokens = _torch_draws(work, rows, edited, logits)
    token_ids = tokens.tolist()  # the step's one read-back of sampled tokens
    return [SampleResult(token, entry) for token, entry in zip(token_ids, _logprobs(logits, token_ids, rows))]


def _torch_draws(work: torch.Tensor, rows: list[SamplingRow], edited: list[int], logits: torch.Tensor) -> torch.Tensor:
    """One token per row of ``work`` (the logits after their edits) by torch ops, on any device; ``logits``: the raw
    ones, for rows that limit their tokens but had every one masked."""
    broken = ~torch.isfinite(work.amax(dim=-1))  # a NaN or +inf logit, or every token masked
    finite = torch.nan_to_num(work, nan=NEG_INF, posinf=NEG_INF, neginf=NEG_INF)
    # greedy rows, and the fallback of degenerate random rows (max's indices are argmax's: the first maximum)
    row_max, tokens = _max_and_first_argmax(finite)
    randomized = [i for i, row in enumerate(rows) if not row.params.greedy]
    if randomized:
        index = torch.tensor(randomized, dtype=torch.long, device=work.device)
        every_row = len(randomized) == len(rows)
        drawn, degenerate = _random_sample(finite if every_row else finite[index],
                                           row_max if every_row else row_max[index], [rows[i] for i in randomized])
        fallback = tokens.index_select(0, index)
        tokens = tokens.index_copy(0, index, torch.where(degenerate | broken[index], fallback, drawn))
    return _fallback_inside_allowed(logits, tokens, broken, rows, edited)
