"""OpenAI's Responses API, as vLLM serves it: POST /v1/responses (streamed, waited for, or in the background),
GET /v1/responses/{id}, POST /v1/responses/{id}/cancel (idempotent), and OpenAI's GET /v1/responses/{id}/input_items
and DELETE /v1/responses/{id}.
A response is a job: its id is the job's."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentKey, DbSession
from api.errors import ApiError
from api.jobs import cancel_job, delete_job, get_job
from api.openai_errors import OpenAIRoute
from api.openai_relay import create_openai_jobs, failure, wait_for_jobs
from api.openai_schemas import ignored_fields, openai_named
from api.responses_body import input_items, output_items, response_object
from api.responses_schemas import FunctionCallItem, InputMessage, ResponsesRequest, chat_messages, responses_named
from api.responses_stream import stream_response
from api.schemas import ResponseDeleted
from core.models import ApiKey, Job, JobStatus
from core.openai_responses import RESPONSES, answer_model, served_model_id
from core.settings import get_settings

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)
logger = logging.getLogger("pagedserve.api")


def _response_job(session: Session, key: ApiKey, response_id: str, field: str) -> Job:
    """The caller's job answering a response; 404 naming `field` for any other id."""
    try:
        job = get_job(session, key, response_id)
    except ApiError as exc:
        raise ApiError(404, f"response {response_id} not found", field) from exc
    if (job.metadata_ or {}).get("openai_endpoint") != RESPONSES:
        raise ApiError(404, f"response {response_id} not found (it is a job of another endpoint)", field)
    return job


def _earlier_conversation(session: Session, key: ApiKey, response_id: str) -> list[dict[str, Any]]:
    """The chat messages a response continuing `response_id` starts with: that response's conversation (without its
    instructions, which are not inherited) and its answer."""
    job = _response_job(session, key, response_id, "previous_response_id")
    if job.status is not JobStatus.succeeded:
        raise ApiError(400, f"previous_response_id: response {response_id} is {job.status.value}; only a finished "
                       "response can be continued", "previous_response_id")
    meta = job.metadata_ or {}
    history, messages = meta.get("openai_history"), list(job.messages or [])
    if meta.get("openai_instructions") and isinstance(history, int) and 0 <= history < len(messages):
        del messages[history]
    answer = [InputMessage(role="assistant", content=item["content"][0]["text"]) if item["type"] == "message"
              else FunctionCallItem.model_validate(item) for item in output_items(job)]
    return chat_messages(answer, messages)


def _tools(body: ResponsesRequest) -> list[dict[str, Any]]:
    return [tool.model_dump(exclude_none=True) for tool in body.tools or []]


@router.post("/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, key: CurrentKey, session: DbSession) -> Response:
    """Answer a conversation (`input`, `instructions`, an earlier response by `previous_response_id`); `stream: true`
    answers with typed events, `background: true` at once with the queued response."""
    if ignored := ignored_fields(body):  # vLLM's behaviour: accept, and say once what was not used
        logger.warning("openai.ignored_fields endpoint=%s fields=%s", RESPONSES, ",".join(ignored))
    earlier = []
    if body.previous_response_id is not None:
        earlier = await run_in_threadpool(_earlier_conversation, session, key, body.previous_response_id)
    try:
        (job,) = await run_in_threadpool(create_openai_jobs, session, key, [body.to_job(earlier)], body.sent_as())
    except ApiError as exc:  # the job's checks speak of the chat request it runs as
        raise responses_named(exc) from exc
    await run_in_threadpool(session.close)  # waiting or streaming can last minutes
    model = body.model or served_model_id()
    if body.background:
        return JSONResponse(response_object(job, model, _tools(body)))
    if body.stream:
        return StreamingResponse(stream_response(request, key, job, model, _tools(body), body.sent_as()),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    finals = await wait_for_jobs(request, key, [job.id], get_settings().openai_timeout_s)
    if finals is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    (final,) = finals
    if (problem := failure(final)) is not None:
        raise openai_named(problem, body.sent_as())
    return JSONResponse(response_object(final, model, _tools(body)))


@router.get("/responses/{response_id}")
def get_response(response_id: str, key: CurrentKey, session: DbSession, stream: bool = False) -> dict[str, Any]:
    """A response in its present state: queued, in_progress, or finished with its output (not streamed: a 400 for
    `stream=true`)."""
    if stream:
        raise ApiError(400, "stream: a stored response is fetched whole; stream it by POST /v1/responses with "
                       "stream: true", "stream")
    job = _response_job(session, key, response_id, "response_id")
    return response_object(job, answer_model(job))


@router.get("/responses/{response_id}/input_items")
def list_input_items(
    response_id: str, key: CurrentKey, session: DbSession, after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "desc",
    include: Annotated[list[str] | None, Query()] = None,  # accepted: nothing it may ask for is made here
) -> dict[str, Any]:
    """A page of the items the response's request gave (last first; `order=asc`: first first), `limit` of them
    after the item `after`."""
    items = input_items(_response_job(session, key, response_id, "response_id"))
    if order == "desc":
        items.reverse()
    if after is not None:
        try:
            items = items[[item["id"] for item in items].index(after) + 1:]
        except ValueError as exc:
            raise ApiError(404, f"after: response {response_id} has no input item {after}", "after") from exc
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.post("/responses/{response_id}/cancel")
def cancel_response(response_id: str, key: CurrentKey, session: DbSession) -> dict[str, Any]:
    """Cancel a queued or running response. Cancelling again answers the cancelled response, as OpenAI's does (its
    background guide: cancelling twice is idempotent); a response that finished otherwise is a 400."""
    job = _response_job(session, key, response_id, "response_id")
    if not job.status.is_final:
        try:
            job = cancel_job(session, key, response_id)
        except ApiError:  # it finished meanwhile, or another cancel came first
            session.refresh(job)
    if job.status is not JobStatus.cancelled:
        raise ApiError(400, f"response {response_id} is already {response_object(job, '')['status']}; only a queued "
                       "or in-progress response can be cancelled", "response_id")
    return response_object(job, answer_model(job))


@router.delete("/responses/{response_id}", response_model=ResponseDeleted)
def delete_response(response_id: str, key: CurrentKey, session: DbSession) -> ResponseDeleted:
    """Delete a finished response (409 while it is queued or in progress), as OpenAI's DELETE does."""
    job = _response_job(session, key, response_id, "response_id")
    delete_job(session, job, f"response {response_id}", "response_id", f"/v1/responses/{response_id}/cancel")
    return ResponseDeleted(id=response_id)
