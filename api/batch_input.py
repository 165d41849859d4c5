"""Reading a batch's input file: each line's custom_id and job, or what is wrong with the line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from api.errors import ApiError
from api.jobs import build_job
from api.openai_errors import openai_error, validation_errors
from api.openai_files import jsonl_lines
from api.openai_schemas import REQUEST_SCHEMAS, openai_named
from api.schemas import is_storable
from core.models import ApiKey, Job
from core.openai_responses import error_object
from core.settings import get_settings

MAX_CUSTOM_ID_CHARS = 512


@dataclass(slots=True)
class BatchLine:
    """One request line: the job it becomes, or the OpenAI error object that kept it from running."""

    line_number: int
    custom_id: str
    job: Job | None
    error: dict[str, Any] | None


def _format_error(number: int, line: dict[str, Any], endpoint: str, seen: set[str]) -> str | None:
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS or \
            not is_storable(custom_id):
        return (f"line {number}: custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters, without NUL "
                "or lone surrogates")
    if custom_id in seen:
        return f"line {number}: custom_id '{custom_id}' is used by an earlier line; each must be unique"
    if line.get("method") != "POST":
        return f"line {number}: method must be 'POST', got {line.get('method')!r}"
    if line.get("url") != endpoint:
        return f"line {number}: url must be the batch's endpoint '{endpoint}', got {line.get('url')!r}"
    if not isinstance(line.get("body"), dict):
        return f"line {number}: body must be a JSON object with the request"
    extra = set(line) - {"custom_id", "method", "url", "body"}
    return f"line {number}: unknown fields {sorted(extra)}" if extra else None


def format_errors(content: bytes, endpoint: str) -> tuple[list[tuple[int, dict[str, Any]]], list[dict[str, Any]]]:
    """The lines of an input file, and OpenAI batch errors ({code, message, line}) for malformed ones."""
    try:
        lines = jsonl_lines(content)
    except ApiError as exc:
        return [], [{"code": "invalid_json_line", "message": exc.message, "param": None, "line": None}]
    errors, seen = [], set()
    for number, line in lines:
        message = _format_error(number, line, endpoint, seen)
        seen.add(str(line.get("custom_id")))
        if message is not None:
            errors.append({"code": "invalid_request", "message": message, "param": None, "line": number})
    return lines, errors


def build_line(key: ApiKey, number: int, line: dict[str, Any], endpoint: str, batch_id: str) -> BatchLine:
    """The job of a well-formed line, or the 400 error its body would have got from the endpoint."""
    custom_id = line["custom_id"]
    request = None
    try:
        request = REQUEST_SCHEMAS[endpoint].model_validate(line["body"])
        if request.stream:
            raise ApiError(400, "stream is not supported in a batch", "stream")
        job_create = request.to_job()
        job_create.metadata = {**(job_create.metadata or {}), "batch_id": batch_id, "custom_id": custom_id}
        # below interactive traffic, in the broker and the engine (a line may ask to run later still)
        job = build_job(key, job_create, batch_priority=get_settings().batch_priority)
    except ValidationError as exc:
        message, param = validation_errors(list(exc.errors()))
        return BatchLine(number, custom_id, None, error_object(400, message, param))
    except ApiError as exc:
        named = openai_named(exc, request.sent_as() if request is not None else None)  # as the endpoint names it
        return BatchLine(number, custom_id, None, openai_error(named))
    return BatchLine(number, custom_id, job, None)
