"""A job as an OpenAI Responses API `response` object, and the output items a stream opens and closes."""

from __future__ import annotations

from typing import Any

from core.models import Job, JobStatus
from core.openai_responses import chat_body, job_failure, parallel_tool_calls
from core.tool_calls import NAMED_PREFIX, REQUIRED

# a job's state -> the response's status (a finished job is "completed", or "incomplete" when cut by the token limit)
STATUSES = {JobStatus.queued: "queued", JobStatus.running: "in_progress", JobStatus.failed: "failed",
            JobStatus.cancelled: "cancelled"}


def message_id(job: Job) -> str:
    """The id of the message item of a job's answer."""
    return f"msg_{job.id}"


def message_item(job: Job, text: str, logprobs: list[dict[str, Any]] | None, status: str = "completed",
                 ) -> dict[str, Any]:  # status: in_progress (opened by a stream, no content yet), completed, incomplete
    """The assistant message item holding `text` (one output_text part; none while a stream opens it)."""
    content = [] if status == "in_progress" else [text_part(text, logprobs)]
    return {"type": "message", "id": message_id(job), "status": status, "role": "assistant", "content": content}


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """An output_text content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    """The function_call item of a chat tool call."""
    function = call["function"]
    return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"], "status": "completed"}


def output_items(job: Job) -> list[dict[str, Any]]:
    """A job's answer as output items: its message (unless it only called functions), then its calls; what a
    cancelled job had made as an incomplete message; none before it finished."""
    if not job.output:
        return []
    choice = chat_body(job, "")["choices"][0]  # a response has one
    message = choice["message"]
    calls = message.get("tool_calls") or []
    status = "completed" if _status(job) == "completed" else "incomplete"  # cut by the token limit, or cancelled
    items = []
    if message["content"] or not calls:
        logprobs = (choice["logprobs"] or {}).get("content")
        items.append(message_item(job, message["content"] or "", logprobs, status))
    return items + [call_item(call) for call in calls]


def input_items(job: Job) -> list[dict[str, Any]]:
    """The input items of a response's request, rebuilt from the chat messages its job runs (after the earlier
    response's conversation and the instructions): messages (their text parts joined into one, as the chat routes
    join them), function calls and their outputs, each with an id of its place in the input."""
    meta = job.metadata_ or {}
    messages = list(job.messages or [])
    start = int(meta.get("openai_history") or 0) + (1 if meta.get("openai_instructions") else 0)
    joined = int(meta.get("openai_joined_calls") or 0)
    items: list[dict[str, Any]] = []
    if joined:  # the leading calls were merged into the earlier answer's assistant turn
        items += [_input_call(call) for call in messages[start - 1]["tool_calls"][-joined:]]
    for message in messages[start:]:
        if message["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"],
                          "output": message["content"], "status": "completed"})
            continue
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:  # a turn of calls alone is stored with empty text
            kind = "output_text" if message["role"] == "assistant" else "input_text"
            items.append({"type": "message", "role": message["role"], "status": "completed",
                          "content": [{"type": kind, "text": message.get("content") or ""}]})
        items += [_input_call(call) for call in calls]
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
    return [{"id": f"{prefixes[item['type']]}_{job.id}_{place}", **item} for place, item in enumerate(items)]


def _input_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {"type": "function_call", "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"], "status": "completed"}


def _status(job: Job) -> str:
    if job.status is not JobStatus.succeeded:
        return STATUSES[job.status]
    return "incomplete" if (job.output or [{}])[0].get("finish_reason") == "length" else "completed"


def _usage(job: Job) -> dict[str, Any]:
    prompt, completion = job.prompt_tokens or 0, job.completion_tokens or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": job.cached_prompt_tokens or 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def _instructions(job: Job) -> str | None:
    meta = job.metadata_ or {}
    messages, history = job.messages or [], meta.get("openai_history")
    if not meta.get("openai_instructions") or not isinstance(history, int) or not 0 <= history < len(messages):
        return None
    return str(messages[history]["content"])


def _tool_choice(mode: Any) -> str | dict[str, str]:
    """A job's tool mode (core.tool_calls') as the request's tool_choice."""
    if mode == REQUIRED:
        return "required"
    if isinstance(mode, str) and mode.startswith(NAMED_PREFIX):
        return {"type": "function", "name": mode.removeprefix(NAMED_PREFIX)}
    return "auto"


def _text_format(constraint: dict[str, Any] | None) -> dict[str, Any]:
    """A job's structured outputs as the request's text.format."""
    if not constraint or "json" not in constraint and "json_object" not in constraint:
        return {"type": "text"}
    if "json_object" in constraint:
        return {"type": "json_object"}
    return {"type": "json_schema", "schema": constraint["json"]}


def response_object(job: Job, model: str, tools: list[dict[str, Any]] | None = None,
                    in_progress: bool = False) -> dict[str, Any]:
    """The response object of a job in its present state (`in_progress`: as a stream opens it, without output);
    `tools` as the request gave them (a stored job keeps them only inside its prompt)."""
    meta = job.metadata_ or {}
    params = job.params or {}
    status = "in_progress" if in_progress else _status(job)
    mode = meta.get("openai_tool_choice")
    forced = isinstance(mode, str) and (mode == REQUIRED or mode.startswith(NAMED_PREFIX))  # the tools' schema
    problem = job_failure(job) if status == "failed" else None
    return {
        "id": job.id, "object": "response", "created_at": int(job.created_at.timestamp()), "status": status,
        "model": model, "output": [] if in_progress else output_items(job),
        "usage": _usage(job) if status in ("completed", "incomplete", "cancelled") and job.output else None,
        "error": None if problem is None else {"code": "server_error" if problem.status_code >= 500
                                               else "invalid_prompt", "message": problem.message},
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": _instructions(job), "max_output_tokens": params.get("max_tokens"),
        "temperature": params.get("temperature"), "top_p": params.get("top_p"),
        "top_logprobs": params.get("logprobs"),
        "tools": tools or [], "tool_choice": "none" if meta.get("openai_tool_choice_none") else _tool_choice(mode),
        "parallel_tool_calls": parallel_tool_calls(job),
        "previous_response_id": meta.get("openai_previous_response_id"),
        "metadata": {k: v for k, v in meta.items() if not k.startswith("openai_") and k != "user"},
        "user": meta.get("user"),
        "text": {"format": {"type": "text"} if forced else _text_format(params.get("structured_outputs"))},
        "truncation": "disabled",
        "store": True, "background": bool(meta.get("openai_background")),
    }
