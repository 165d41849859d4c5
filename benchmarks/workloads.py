"""Seeded request workloads with the paper's length distributions and real-text prompts."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

PAPER_MAX_SEQ_LEN = 2048


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Log-normal input and output lengths with the given means (in tokens)."""

    mean_input: float
    mean_output: float
    sigma_input: float
    sigma_output: float


# the paper's mean input/output lengths; the sigmas give ShareGPT its long tail
DATASETS: dict[str, LengthDistribution] = {
    "sharegpt": LengthDistribution(161, 338, sigma_input=1.0, sigma_output=0.8),
    "alpaca": LengthDistribution(19, 58, sigma_input=0.6, sigma_output=0.6),
}


@dataclass(slots=True)
class Request:
    """One benchmark request: real prompt tokens and the number of tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def total_len(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + self.output_len


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    """A positive integer drawn from a log-normal with the given mean."""
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)))


def corpus_token_ids(tokenizer: Any) -> list[int]:
    """Token ids of real English prose shipped with Python (the pydoc topic pages)."""
    from pydoc_data.topics import topics

    return tokenizer.encode(" ".join(topics[key] for key in sorted(topics)), add_special_tokens=False)


def max_seq_len(scale: float) -> int:
    """The paper's 2,048-token maximum sequence length, scaled with the workload."""
    return max(16, round(PAPER_MAX_SEQ_LEN * scale))


def make_requests(
    dataset: str, num_requests: int, scale: float, corpus: list[int], seed: int = 0,
) -> list[Request]:
    """``num_requests`` requests with lengths scaled by ``scale``, clipped to ``max_seq_len(scale)``."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {dataset!r}")
    dist = DATASETS[dataset]
    rng = random.Random(seed)
    limit = max_seq_len(scale)
    requests = []
    for _ in range(num_requests):
        input_len = min(_lognormal(rng, dist.mean_input * scale, dist.sigma_input), limit // 2)
        output_len = min(_lognormal(rng, dist.mean_output * scale, dist.sigma_output), limit - input_len)
        start = rng.randrange(len(corpus) - input_len)
        requests.append(Request(corpus[start : start + input_len], output_len))
    return requests


def poisson_arrivals(num_requests: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process at ``rate_per_s``."""
    rng = random.Random(seed)
    now, arrivals = 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate_per_s)
        arrivals.append(now)
    return arrivals
