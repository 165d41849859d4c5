"""OpenAI-compatible inference: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (with stream)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentKey, DbSession
from api.jobs import create_job
from api.models import utcnow
from api.openai_errors import OpenAIRoute
from api.openai_relay import failure, stream_job, wait_for_job
from api.openai_responses import response_body
from api.openai_schemas import CHAT_COMPLETIONS, COMPLETIONS, ChatCompletionRequest, CompletionRequest, served_model_id
from api.settings import get_settings

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)
STARTED_AT = int(utcnow().timestamp())


@router.get("/models")
def list_models(key: CurrentKey) -> dict[str, Any]:
    """The model this server serves, as OpenAI's model list."""
    model = {"id": served_model_id(), "object": "model", "created": STARTED_AT, "owned_by": "pagedserve"}
    return {"object": "list", "data": [model]}


async def _answer(
    request: Request, key: CurrentKey, session: DbSession, body: CompletionRequest | ChatCompletionRequest,
    endpoint: str,
) -> Response:
    job, _ = await run_in_threadpool(create_job, session, key, body.to_job(), None)
    # Waiting or streaming can last minutes: release the pooled connection (the relay reads in short sessions).
    await run_in_threadpool(session.close)
    model = served_model_id()
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            stream_job(request, key, job, model, endpoint, include_usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    final = await wait_for_job(request, key, job.id, get_settings().openai_timeout_s)
    if final is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    problem = failure(final)
    if problem is not None:
        raise problem
    return JSONResponse(response_body(final, model, endpoint))


@router.post("/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, request: Request, key: CurrentKey, session: DbSession
) -> Response:
    """Complete a prompt (OpenAI's legacy completions); `stream: true` answers with server-sent chunks."""
    return await _answer(request, key, session, body, COMPLETIONS)


@router.post("/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, key: CurrentKey, session: DbSession
) -> Response:
    """Answer chat messages; `stream: true` answers with server-sent chunks."""
    return await _answer(request, key, session, body, CHAT_COMPLETIONS)
