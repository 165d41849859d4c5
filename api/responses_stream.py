"""A response streamed as the Responses API's typed server-sent events, from its job's token deltas.

The events: response.created and response.in_progress; for the answer's message, output_item.added,
content_part.added, output_text.delta per token delta, output_text.done, content_part.done and output_item.done; for
each function call, output_item.added, function_call_arguments.delta and .done, output_item.done; then
response.completed (or response.incomplete when the token limit cut it, response.failed when the job failed).
A job that may call functions streams only the text that is surely content (as the chat stream does); the rest comes
when the job is done.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request

from api.disconnect_check import DisconnectCheck
from api.job_follow import DeletedEvent, FinalEvent, RestartEvent, TokenEvent, follow_job
from api.openai_relay import cancel_unfinished, failure
from api.openai_schemas import openai_named
from api.responses_body import message_id, message_item, response_object, text_part
from core.models import ApiKey, Job, JobStatus
from core.openai_responses import (
    CHAT_COMPLETIONS,
    delta_logprobs,
    streamed_call_name,
    streamed_content_filter,
    token_namer,
)


class _ResponseEvents:
    """The events of one streamed response, numbered in order."""

    def __init__(self, job: Job, model: str, tools: list[dict[str, Any]] | None, sent_as: dict[str, str]) -> None:
        self.job, self.model, self.tools, self.sent_as = job, model, tools, sent_as
        self.sequence = 0
        self.num_top: int | None = job.params.get("logprobs")
        # a job that may call functions: how much of its text so far is surely content (None: all of it); a named
        # function's call is all arguments, which come whole with the call's item at the end
        self.content_filter = (lambda _text: 0) if streamed_call_name(job) else streamed_content_filter(job)
        self.text = ""  # the answer's text so far
        self.sent = 0  # how much of it was streamed
        self.logprobs: list[dict[str, Any]] = []  # of the streamed tokens
        self.message_open = False

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _part_fields(self) -> dict[str, Any]:
        return {"item_id": message_id(self.job), "output_index": 0, "content_index": 0}

    def opening(self) -> list[str]:
        response = response_object(self.job, self.model, self.tools, in_progress=True)
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _open_message(self) -> list[str]:
        self.message_open = True
        return [self.event("response.output_item.added", output_index=0,
                           item=message_item(self.job, "", None, status="in_progress")),
                self.event("response.content_part.added", **self._part_fields(), part=text_part("", None))]

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> list[str]:
        lines = [] if self.message_open else self._open_message()
        self.logprobs += logprobs
        return [*lines, self.event("response.output_text.delta", **self._part_fields(), delta=text, logprobs=logprobs)]

    def tokens(self, delta: dict[str, Any]) -> list[str]:
        """The events of a token delta: the text it adds that may be sent now."""
        self.text += delta["text"]
        upto = len(self.text) if self.content_filter is None else max(self.sent, self.content_filter(self.text))
        text, self.sent = self.text[self.sent:upto], upto
        logprobs = []
        if self.num_top is not None and delta.get("logprobs") and self.content_filter is None:
            logprobs = delta_logprobs(CHAT_COMPLETIONS, delta, self.num_top, 0, token_namer(self.job))["content"]
        return self._text_delta(text, logprobs) if text or logprobs else []

    def closing(self, job: Job) -> list[str]:
        """The events once the job is final: the rest of its answer, its items closed, and the response's end."""
        self.job = job
        problem = failure(job)
        if problem is not None:  # failed, or cancelled: the response ends with what it had streamed
            named = openai_named(problem, self.sent_as)
            response = response_object(job, self.model, self.tools)
            if not response["output"] and self.sent:  # the worker records a cancelled job's text a moment later
                response["output"] = [message_item(job, self.text[:self.sent], self.logprobs, "incomplete")]
            code = "cancelled" if job.status is JobStatus.cancelled else \
                "server_error" if named.status_code >= 500 else "invalid_prompt"
            response["error"] = {"code": code, "message": named.message, "param": named.field}
            return [self.event("response.failed", response=response)]
        response = response_object(job, self.model, self.tools)
        lines: list[str] = []
        for index, item in enumerate(response["output"]):
            if item["type"] == "message":
                lines += self._close_message(item)
            else:
                lines += self._call_events(index, item)
        if self.message_open and not any(item["type"] == "message" for item in response["output"]):
            lines += self._close_message(message_item(job, self.text[:self.sent], self.logprobs))
        end = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*lines, self.event(end, response=response)]

    def _close_message(self, item: dict[str, Any]) -> list[str]:
        part = item["content"][0]
        rest = part["text"][self.sent:] if part["text"].startswith(self.text[:self.sent]) else ""
        lines = self._text_delta(rest, []) if rest or not self.message_open else []
        return [*lines,
                self.event("response.output_text.done", **self._part_fields(), text=part["text"],
                           logprobs=part["logprobs"]),
                self.event("response.content_part.done", **self._part_fields(), part=part),
                self.event("response.output_item.done", output_index=0, item=item)]

    def _call_events(self, index: int, item: dict[str, Any]) -> list[str]:
        ids = {"item_id": item["id"], "output_index": index}
        return [self.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                   "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
                self.event("response.function_call_arguments.done", **ids, arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]


async def stream_response(request: Request, key: ApiKey, job: Job, model: str, tools: list[dict[str, Any]] | None,
                          sent_as: dict[str, str]) -> AsyncIterator[str]:
    """The response's events as its job runs; a client that goes away cancels the job."""
    events = _ResponseEvents(job, model, tools, sent_as)
    finished = False
    disconnect = DisconnectCheck(request)
    try:
        for line in events.opening():
            yield line
        async with aclosing(follow_job(job.id)) as followed:
            async for event in followed:
                if await disconnect.gone():
                    return
                if isinstance(event, TokenEvent):
                    for line in events.tokens(event.delta):
                        yield line
                elif isinstance(event, RestartEvent):
                    # streamed text cannot be taken back: end this stream, the job itself runs on
                    finished = True
                    yield events.event("error", code="server_error", param=None, message=(
                        f"response {job.id} restarted after a worker failure; fetch it when it finishes"))
                    return
                elif isinstance(event, FinalEvent):
                    finished = True
                    for line in events.closing(event.job):
                        yield line
                elif isinstance(event, DeletedEvent):
                    finished = True
                    yield events.event("error", code="not_found", param="response_id",
                                       message=f"response {job.id} was deleted while it streamed")
                    return
    finally:
        if not finished:
            await cancel_unfinished(key, job.id)

