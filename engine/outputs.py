"""What the engine hands back: one ``RequestOutput`` per request, one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence so far (cumulative text and tokens)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop_token_ids token or stop string that ended it; None for EOS
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.monotonic``) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step (or at the end of ``generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache at its first scheduling
    new_token_ids: list[list[int]] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: per prompt token, its logprob and alternatives (None for the first)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # set when the engine failed this request (its outputs end with "error")
    refused: bool = False  # the error is the request's own: a client's to change (its constraint could not be followed)
