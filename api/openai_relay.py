"""Answering an OpenAI request from its jobs: create them, wait for the result, or relay their tokens as stream
chunks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
from fastapi import Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api import jobs
from api.disconnect_check import DisconnectCheck
from api.errors import ApiError
from api.job_follow import DeletedEvent, FinalEvent, RestartEvent, TokenEvent, follow_final, follow_job
from api.openai_schemas import StreamOptions, openai_named
from api.schemas import JobCreate
from core.db import session_factory
from core.models import ApiKey, Job
from core.openai_responses import (
    CHAT_COMPLETIONS,
    arguments_delta,
    chat_echo,
    choice_index,
    chunk,
    delta_choice,
    delta_logprobs,
    echo_logprobs,
    echo_only,
    echoed_prompt,
    error_object,
    final_choices,
    job_failure,
    streamed_call_name,
    streamed_content_filter,
    token_namer,
    tool_call_deltas,
    total_usage,
    usage,
)

DISCONNECT_CHECK_MS = 500
# What a relay yields after an idle second: sent to no one (vLLM's streams hold only `data:` lines, and parsers
# copied from its older benchmark scripts fail on an SSE comment), only a chance to notice a client that went away.
IDLE = ""


def create_openai_jobs(session: Session, key: ApiKey, bodies: list[JobCreate], sent_as: dict[str, str]) -> list[Job]:
    """The jobs of one OpenAI request, accepted together or not at all; errors name the request's fields (`sent_as`:
    job field -> request field), not the jobs'."""
    try:
        if len(bodies) == 1:
            return [jobs.create_job(session, key, bodies[0], None)[0]]
        return jobs.create_jobs(session, key, bodies)
    except ApiError as exc:
        raise openai_named(exc, sent_as) from exc


def _cancel_quietly(key: ApiKey, job_id: str) -> None:
    with session_factory()() as session:
        try:
            jobs.cancel_job(session, key, job_id)
        except ApiError:  # it finished meanwhile
            pass


async def cancel_unfinished(key: ApiKey, job_id: str) -> None:
    """Cancel a job whose client went away, even while the calling task is being cancelled."""
    with anyio.CancelScope(shield=True):
        await run_in_threadpool(_cancel_quietly, key, job_id)


def failure(job: Job) -> ApiError | None:
    """Why a final job has no answer for its client, as the error to raise; None when it succeeded."""
    problem = job_failure(job)
    return None if problem is None else ApiError(problem.status_code, problem.message, problem.field)


async def wait_for_job(request: Request, key: ApiKey, job_id: str, timeout_s: float) -> Job | None:
    """The job once final; None (and the job cancelled) if the client disconnects first; 504 past the timeout."""
    deadline = time.monotonic() + timeout_s
    # the job's end alone wakes this wait (not each token), and every idle DISCONNECT_CHECK_MS
    async with aclosing(follow_final(job_id, DISCONNECT_CHECK_MS)) as events:
        async for event in events:
            if isinstance(event, FinalEvent):
                return event.job
            if isinstance(event, DeletedEvent):
                raise ApiError(404, f"job {job_id} was deleted before it answered", None)
            if time.monotonic() >= deadline:
                await cancel_unfinished(key, job_id)
                raise ApiError(504, f"job {job_id} did not finish within {timeout_s:g} s and was cancelled", None)
            if await request.is_disconnected():
                await cancel_unfinished(key, job_id)
                return None
    raise AssertionError("following a job ends with its final event")


async def wait_for_jobs(request: Request, key: ApiKey, job_ids: list[str], timeout_s: float) -> list[Job] | None:
    """Each job once final, in order; None if the client disconnects first; the rest are cancelled on any exit."""
    finals: list[Job] = []
    try:
        for job_id in job_ids:
            final = await wait_for_job(request, key, job_id, timeout_s)
            if final is None:
                return None
            finals.append(final)
        return finals
    finally:
        for job_id in job_ids[len(finals) + 1:]:  # wait_for_job cancelled the one it gave up on
            await cancel_unfinished(key, job_id)


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _JobRelay:
    """The stream chunks of one job (the job answering prompt `prompt_index` of the request); every chunk carries the
    id and creation time of `response` (the request's first job), as one OpenAI response has one id."""

    def __init__(self, job: Job, prompt_index: int, response: Job, model: str, endpoint: str,
                 continuous_usage: bool, sent_as: dict[str, str]) -> None:
        self.job, self.prompt_index, self.response = job, prompt_index, response
        self.model, self.endpoint = model, endpoint
        self.sent_as = sent_as  # job field -> the request's, to name a refusal's field as the client sent it
        self.continuous_usage = continuous_usage
        self.num_top_logprobs: int | None = job.params.get("logprobs")
        self.text_offsets: dict[int, int] = {}  # per choice: the text length its streamed tokens' logprobs cover
        self.completion_tokens = 0
        self.ok = True  # False once the job's stream ended with an error chunk
        # a chat output that may become tool calls streams only what is surely content; the rest comes at the end
        self.content_filter = streamed_content_filter(job) if endpoint == CHAT_COMPLETIONS else None
        self.named_call = self.content_filter is not None and streamed_call_name(job) is not None
        self.texts: dict[int, str] = {}  # per choice, with a content filter: its text so far
        self.sent: dict[int, int] = {}  # and how much of it was sent

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        payload = chunk(self.response, self.model, self.endpoint, choices)
        if self.continuous_usage:  # vLLM's continuous_usage_stats: counts so far in every chunk
            payload["usage"] = usage(self.job, self.completion_tokens)
        return _data(payload)

    def _error(self, status_code: int, message: str, field: str | None = None) -> str:
        self.ok = False
        return _data({"error": error_object(status_code, message, field)})

    def _token_choice(self, delta: dict[str, Any], first: bool) -> dict[str, Any]:
        """The chunk choice of a token delta (the `first` text of its choice to be sent), with its tokens' logprobs
        where the request asked for them."""
        choice = delta_choice(self.endpoint, choice_index(self.job, self.prompt_index, delta["index"]), delta["text"])
        if self.named_call and delta["text"]:  # the output is the arguments of the call the request named
            choice["delta"] = arguments_delta(self.job, delta["index"], delta["text"], first)
        if self.num_top_logprobs is not None and delta.get("logprobs"):
            offset = self.text_offsets.get(delta["index"], 0)
            logprobs = delta_logprobs(self.endpoint, delta, self.num_top_logprobs, offset, token_namer(self.job))
            choice["logprobs"] = logprobs
            if "tokens" in logprobs:  # a completion's: the next chunk's text_offset starts past these tokens
                self.text_offsets[delta["index"]] = offset + sum(len(token) for token in logprobs["tokens"])
        return choice

    def _content_delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        """The token delta with only the text the content filter lets through now (all of it without one)."""
        if self.content_filter is None:
            return delta
        index = delta["index"]
        text = self.texts[index] = self.texts.get(index, "") + delta["text"]
        sent = self.sent.get(index, 0)
        self.sent[index] = max(sent, self.content_filter(text))
        return {**delta, "text": text[sent:self.sent[index]]}

    def _echo_chunk(self, prompt: str, scores: dict[str, Any] | None) -> str:
        """The chunk that echoes the prompt into every choice, with its tokens' logprobs when `scores` holds them
        (the tokens streamed after it then count their text_offset on from the prompt's end)."""
        choices = [delta_choice(self.endpoint, choice_index(self.job, self.prompt_index, i), prompt)
                   for i in range(self.job.params["n"])]
        if scores is not None and self.num_top_logprobs is not None:
            logprobs = echo_logprobs(scores, self.num_top_logprobs, token_namer(self.job))
            self.text_offsets = dict.fromkeys(range(self.job.params["n"]), sum(map(len, logprobs["tokens"])))
            choices = [{**choice, "logprobs": logprobs} for choice in choices]
        return self._chunk(choices)

    async def lines(self) -> AsyncIterator[str]:
        """Opening chunks (chat role, echoed prompt), one chunk per token delta, then the closing chunk, with `IDLE`
        after each idle second. An echo that scores its prompt waits for the scores, which come with the first
        tokens."""
        indexes = [choice_index(self.job, self.prompt_index, i) for i in range(self.job.params["n"])]
        if self.endpoint == CHAT_COMPLETIONS:
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                               for i in indexes])
            if echo := chat_echo(self.job):
                yield self._chunk([delta_choice(self.endpoint, i, echo) for i in indexes])
        prompt = echoed_prompt(self.job)
        scored_echo = bool(prompt) and self.job.params.get("prompt_logprobs") is not None
        if prompt and not scored_echo:
            yield self._echo_chunk(prompt, None)
        async with aclosing(follow_job(self.job.id)) as events:
            async for event in events:
                if event is None:
                    yield IDLE  # nothing to send: a chance to notice a client that went away
                elif isinstance(event, TokenEvent):
                    if scored_echo and "prompt_logprobs" in event.delta:
                        yield self._echo_chunk(prompt, event.delta)
                        scored_echo = False
                    self.completion_tokens += len(event.delta["token_ids"])
                    if echo_only(self.job):
                        continue  # the prompt alone was asked for: the token the job made is not shown
                    first = not self.sent.get(event.delta["index"])
                    delta = self._content_delta(event.delta)
                    if not delta["text"] and not delta.get("logprobs"):
                        continue  # held for tool calls, or a token that ends mid-character adds no text yet
                    yield self._chunk([self._token_choice(delta, first)])
                elif isinstance(event, RestartEvent):
                    # streamed text cannot be taken back: end this stream, the job itself runs on
                    yield self._error(503, f"job {self.job.id} restarted after a worker failure; "
                                           "fetch its result when it finishes")
                    return
                elif isinstance(event, DeletedEvent):
                    yield self._error(404, f"job {self.job.id} was deleted while it streamed")
                    return
                else:
                    self.job = event.job
                    problem = failure(event.job)
                    if problem is not None:
                        named = openai_named(problem, self.sent_as)
                        yield self._error(named.status_code, named.message, named.field)
                        return
                    self.completion_tokens = event.job.completion_tokens or 0
                    if scored_echo:  # no token event carried the scores (Redis lost them): the job keeps them
                        first = (event.job.output or [{}])[0]
                        yield self._echo_chunk(prompt, first if "prompt_logprobs" in first else None)
                    if self.content_filter is not None and (held := tool_call_deltas(event.job, self.prompt_index,
                                                                                      self.sent)):
                        yield self._chunk(held)
                    yield self._chunk(final_choices(event.job, self.endpoint, self.prompt_index))


async def _interleaved(relays: list[_JobRelay]) -> AsyncIterator[tuple[_JobRelay, str | None]]:
    """Every relay's lines as they come, as (relay, line), and (relay, None) once that relay has ended; an error in
    a relay is raised here. One relay is read in place; several through plain asyncio tasks and a queue. Either way
    no cancel scope is held open across this generator's yields, so it may be closed from any task (Starlette's, or
    the event loop's finalizer)."""
    if len(relays) == 1:  # nothing to interleave: no task and queue hop per line
        async with aclosing(relays[0].lines()) as relayed:
            async for line in relayed:
                yield relays[0], line
        yield relays[0], None
        return
    lines: asyncio.Queue[tuple[_JobRelay, str | None | Exception]] = asyncio.Queue(maxsize=len(relays))

    async def pump(relay: _JobRelay) -> None:
        try:
            async with aclosing(relay.lines()) as relayed:
                async for line in relayed:
                    await lines.put((relay, line))
        except Exception as exc:  # handed to the reader, which raises it as the sequential relay did
            await lines.put((relay, exc))
            return
        await lines.put((relay, None))

    pumps = [asyncio.create_task(pump(relay)) for relay in relays]
    try:
        ended = 0
        while ended < len(relays):
            relay, line = await lines.get()
            if isinstance(line, Exception):
                raise line
            ended += line is None
            yield relay, line
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def stream_jobs(
    request: Request, key: ApiKey, jobs: list[Job], model: str, endpoint: str, options: StreamOptions | None,
    sent_as: dict[str, str],
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, every job's chunks as its tokens come (a list of prompts streams
    its choices interleaved, as vLLM does), ending with `data: [DONE]`.

    A job whose stream ends with an error chunk ends the response there; a disconnect, or that error, cancels the
    jobs not yet finished. `include_usage` adds a closing usage chunk, and with `continuous_usage_stats` every chunk
    carries usage too (as vLLM, which needs both).
    """
    include_usage = options is not None and options.include_usage
    continuous_usage = include_usage and options is not None and options.continuous_usage_stats
    relays = [_JobRelay(job, prompt_index, jobs[0], model, endpoint, continuous_usage, sent_as)
              for prompt_index, job in enumerate(jobs)]
    relayed: set[str] = set()
    usages = []
    disconnect = DisconnectCheck(request)
    try:
        async with aclosing(_interleaved(relays)) as lines:
            async for relay, line in lines:
                if await disconnect.gone():
                    return
                if line is not None:
                    if line != IDLE:
                        yield line
                    continue
                relayed.add(relay.job.id)  # final, or restarted and running on: not to be cancelled
                if not relay.ok:
                    break
                usages.append(usage(relay.job))
        if include_usage and len(usages) == len(relays):
            yield _data({**chunk(jobs[0], model, endpoint, []), "usage": total_usage(usages)})
        yield "data: [DONE]\n\n"
    finally:
        for job in jobs:
            if job.id not in relayed:
                await cancel_unfinished(key, job.id)
