"""OpenAI-compatible inference: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (with stream)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentKey, DbSession
from api.openai_errors import OpenAIRoute
from api.openai_relay import create_openai_jobs, failure, stream_jobs, wait_for_jobs
from api.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    check_served_model,
    ignored_fields,
    openai_named,
)
from api.prompts import prompt_model
from core.models import utcnow
from core.openai_responses import CHAT_COMPLETIONS, COMPLETIONS, merged_body, served_model_id, served_model_names
from core.settings import get_settings

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)
logger = logging.getLogger("pagedserve.api")
STARTED_AT = int(utcnow().timestamp())


def _model_card(name: str) -> dict[str, Any]:
    model = prompt_model()
    return {"id": name, "object": "model", "created": STARTED_AT, "owned_by": "pagedserve", "root": model.name,
            "parent": None, "max_model_len": model.max_model_len}


@router.get("/models")
def list_models(key: CurrentKey) -> dict[str, Any]:
    """Each served model name, as OpenAI's model list with vLLM's max_model_len and root."""
    return {"object": "list", "data": [_model_card(name) for name in served_model_names()]}


@router.get("/models/{model_id:path}")
def get_model(model_id: str, key: CurrentKey) -> dict[str, Any]:
    """One served model name's card (OpenAI's models.retrieve); 404 naming the model for any other name."""
    check_served_model(model_id)
    return _model_card(model_id)


async def _answer(
    request: Request, key: CurrentKey, session: DbSession, body: CompletionRequest | ChatCompletionRequest,
    endpoint: str,
) -> Response:
    if ignored := ignored_fields(body):  # vLLM's behaviour: accept, and say once what was not used
        logger.warning("openai.ignored_fields endpoint=%s fields=%s", endpoint, ",".join(ignored))
    bodies = body.to_jobs() if isinstance(body, CompletionRequest) else [body.to_job()]
    jobs = await run_in_threadpool(create_openai_jobs, session, key, bodies, body.sent_as())
    # Waiting or streaming can last minutes: release the pooled connection (the relay reads in short sessions).
    await run_in_threadpool(session.close)
    model = body.model or served_model_id()  # the served name asked for, as vLLM answers
    if body.stream:
        return StreamingResponse(
            stream_jobs(request, key, jobs, model, endpoint, body.stream_options, body.sent_as()),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    finals = await wait_for_jobs(request, key, [job.id for job in jobs], get_settings().openai_timeout_s)
    if finals is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    for final in finals:
        if (problem := failure(final)) is not None:
            raise openai_named(problem, body.sent_as())  # a refusal names the field as the client sent it
    return JSONResponse(merged_body(finals, model, endpoint))


@router.post("/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, request: Request, key: CurrentKey, session: DbSession
) -> Response:
    """Complete one prompt or several (text or token ids; OpenAI's legacy completions); `stream: true` streams."""
    return await _answer(request, key, session, body, COMPLETIONS)


@router.post("/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, key: CurrentKey, session: DbSession
) -> Response:
    """Answer chat messages; `stream: true` answers with server-sent chunks."""
    return await _answer(request, key, session, body, CHAT_COMPLETIONS)
