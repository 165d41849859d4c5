"""Every running job's new tokens go to its Redis event stream once per engine step, all jobs in one round trip.

Publishing from the engine thread, rather than from each job's thread, keeps 32 job threads from waking (and
taking the GIL from the engine) at every step: measured on 2 CPUs at 32 jobs in flight, per-job publishing held
the service to 0.65 of the offline engine. Tokens are published before any job thread sees the output that
finishes its request, so a job's final event always follows its last tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import redis

from core import streams
from core.logging import log_event

logger = logging.getLogger("pagedserve.worker")
ATTEMPT_SEPARATOR = "#"


def request_id_for(job_id: str, attempt: int) -> str:
    """The engine request id of a job's attempt (a redelivered job runs again under a new id)."""
    return f"{job_id}{ATTEMPT_SEPARATOR}{attempt}"


def job_id_of(request_id: str) -> str:
    """The job an engine request id belongs to."""
    return request_id.rsplit(ATTEMPT_SEPARATOR, 1)[0]


def stored_logprobs(steps: list[dict[int, float]]) -> list[dict[str, float]]:
    """Each token's logprobs ({token id: logprob}, the sampled token among them) as JSON keeps them: ids as text."""
    return [{str(token_id): logprob for token_id, logprob in step.items()} for step in steps]


def prompt_scores(output: Any) -> dict[str, Any]:
    """A request's prompt logprobs as a job keeps them (with the ids they score; the first token has none), or {}
    when it did not ask for them."""
    if output.prompt_logprobs is None:
        return {}
    return {"prompt_token_ids": list(output.prompt_token_ids),
            "prompt_logprobs": [None, *stored_logprobs(output.prompt_logprobs[1:])]}


@dataclass(slots=True)
class StreamProgress:
    """What a request has streamed so far, per completion index (and whether its prompt's logprobs went out)."""

    texts: dict[int, str] = field(default_factory=dict)
    token_counts: dict[int, int] = field(default_factory=dict)
    prompt_scored: bool = False

    def deltas(self, output: Any) -> list[dict[str, Any]]:
        """New text and token ids (and their logprobs, when the request asked for them) since what was streamed,
        one entry per completion that grew; `advance` marks them streamed."""
        deltas = []
        for completion in output.outputs:
            text_seen = len(self.texts.get(completion.index, ""))
            tokens_seen = self.token_counts.get(completion.index, 0)
            if len(completion.token_ids) > tokens_seen or len(completion.text) > text_seen:
                delta = {
                    "index": completion.index,
                    "text": completion.text[text_seen:],
                    "token_ids": list(completion.token_ids[tokens_seen:]),
                    "text_offset": text_seen,  # where they begin in the completion: followers drop what they have
                    "token_offset": tokens_seen,
                }
                if completion.logprobs is not None:
                    delta["logprobs"] = stored_logprobs(completion.logprobs[tokens_seen:])
                deltas.append(delta)
        if deltas and not self.prompt_scored:  # a stream that echoes its prompt scores it before any token
            deltas[0].update(prompt_scores(output))
        return deltas

    def advance(self, output: Any) -> None:
        """Mark everything in `output` streamed."""
        for completion in output.outputs:
            self.texts[completion.index] = completion.text
            self.token_counts[completion.index] = len(completion.token_ids)
        self.prompt_scored = self.prompt_scored or bool(output.outputs)


class TokenPublisher:
    """The engine service's token sink: called on the engine thread with each step's outputs."""

    def __init__(self) -> None:
        self._progress: dict[str, StreamProgress] = {}

    def __call__(self, outputs: list[Any]) -> None:
        """Publish the step's new tokens of every request (none of a request that failed: its job fails)."""
        deltas_by_job: dict[str, list[dict[str, Any]]] = {}
        streamed: list[tuple[StreamProgress, Any]] = []
        for output in outputs:
            progress = self._progress.setdefault(output.request_id, StreamProgress())
            if output.finished:
                del self._progress[output.request_id]
            if output.error is None and (deltas := progress.deltas(output)):
                deltas_by_job[job_id_of(output.request_id)] = deltas
                streamed.append((progress, output))
        if not deltas_by_job:
            return
        try:
            streams.publish_tokens(streams.redis_client(), deltas_by_job)
        except redis.RedisError as exc:
            # a running request's tokens go with its next step's; a finished one's reach followers with its result
            log_event(logger, "tokens.publish_failed", jobs=len(deltas_by_job), error=repr(exc))
            return
        for progress, output in streamed:
            progress.advance(output)
