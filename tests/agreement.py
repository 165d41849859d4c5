"""Comparing the generations of two runs that must agree: token for token, up to rounding flips."""

from __future__ import annotations

import pytest

Sample = tuple[list[int], list[float]]  # the sampled tokens and each one's log-probability


def assert_agree_up_to_rounding(actual: list[Sample], expected: list[Sample]) -> None:
    """Each pair gives the same tokens with the same log-probabilities until the pair first differs, and at
    most a quarter of the pairs differ at all.

    Runs with different batches round differently in the matmuls, which can flip a seeded draw that lands
    on the boundary between two tokens; the sequences rightly go apart from there. A wrong KV block (a bad
    swap, copy or recompute) shows as a log-probability far off at the first token that reads it."""
    assert len(actual) == len(expected)
    num_differing = 0
    for index, ((tokens, logprobs), (expected_tokens, expected_logprobs)) in enumerate(zip(actual, expected)):
        assert len(tokens) == len(expected_tokens), f"sample {index} has another length"
        same = next((i for i, pair in enumerate(zip(tokens, expected_tokens)) if pair[0] != pair[1]), len(tokens))
        num_differing += same < len(tokens)
        assert logprobs[:same] == pytest.approx(expected_logprobs[:same], abs=1e-3), f"sample {index}"
    assert num_differing <= len(actual) // 4, f"{num_differing} of {len(actual)} samples differ"
