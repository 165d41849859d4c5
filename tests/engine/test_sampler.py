"""The sampler's random path draws tokens with the softmax's probabilities, never a masked one."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.sampler import SamplingRow, sample


def rows(count: int, seed: int, **params: object) -> list[SamplingRow]:
    generator = torch.Generator().manual_seed(seed)
    return [SamplingRow(SamplingParams(**params), generator, [], 0, []) for _ in range(count)]


def test_random_sampling_follows_the_softmax_and_skips_zero_probability_tokens() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    logits = probs.log().expand(4000, -1).contiguous()  # -inf where the probability is 0
    tokens = torch.tensor([r.token_id for r in sample(logits, rows(4000, seed=3, temperature=1.0))])
    counts = torch.bincount(tokens, minlength=6).float()
    assert counts[[0, 2, 5]].sum() == 0
    # binomial standard deviation at n=4000 is at most 32 counts: 4 sigma
    assert torch.all((counts - 4000 * probs).abs() < 130), counts


def test_top_k_and_top_p_sampling_stays_inside_the_kept_set() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(500, -1).contiguous()
    top_k = {r.token_id for r in sample(logits, rows(500, seed=5, temperature=1.0, top_k=2))}
    assert top_k == {0, 1}
    # probabilities ≈ .64 .24 .09 .03 .01: the nucleus for 0.8 is the first two tokens
    top_p = {r.token_id for r in sample(logits, rows(500, seed=5, temperature=1.0, top_p=0.8))}
    assert top_p == {0, 1}


def test_a_seeded_row_draws_the_same_tokens_alone_or_in_a_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    alone = sample(logits[1:2].clone(), rows(1, seed=11, temperature=1.0))[0].token_id
    batch = rows(3, seed=99, temperature=1.0)
    batch[1] = rows(1, seed=11, temperature=1.0)[0]
    assert sample(logits.clone(), batch)[1].token_id == alone
