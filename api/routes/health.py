"""Liveness and readiness probes."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from sqlalchemy import text

from api.prompts import ModelUnavailableError, prompt_model
from core import heartbeats, streams
from core.db import session_factory
from core.settings import get_settings

router = APIRouter(tags=["health"])
logger = logging.getLogger("pagedserve.api")


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


_EMPTY_200 = {200: {"description": "the process is up (empty body)"}}


@router.get("/health", response_class=Response, responses=_EMPTY_200)
def health() -> Response:
    """vLLM's liveness probe: 200 with an empty body while the process is up."""
    return Response(status_code=200)


@router.get("/ping", response_class=Response, responses=_EMPTY_200)
@router.post("/ping", response_class=Response, responses=_EMPTY_200)
def ping() -> Response:
    """vLLM's `/ping` (as SageMaker asks it, GET or POST): the liveness probe of `/health`."""
    return health()


def _check(name: str, probe: Callable[[], object]) -> str:
    try:
        probe()
    except ModelUnavailableError:  # a GGUF model until a worker or `pagedserve prepare` converted it
        return "error: model not prepared"
    except Exception:
        # the exception text can name hosts and users; callers here are not authenticated, the log is private
        logger.warning("readyz.%s_unavailable", name, exc_info=True)
        return "error: unavailable"
    return "ok"


def _ping_database() -> None:
    with session_factory()() as session:
        session.execute(text("SELECT 1"))


def _require_live_worker() -> None:
    model = get_settings().model
    if not heartbeats.live_workers(model):
        raise LookupError(f"no worker for {model} has a fresh heartbeat")


@router.get("/readyz")
def readyz() -> JSONResponse:
    """Ready when the model is prepared, the job store and Redis answer, and a live worker serves the model if so
    configured (else 503)."""
    checks = {"model": _check("model", prompt_model),
              "database": _check("database", _ping_database),
              "redis": _check("redis", lambda: streams.redis_client().ping())}
    if get_settings().readyz_require_worker:
        checks["worker"] = _check("worker", _require_live_worker)
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ok" if ready else "unavailable", **checks}, status_code=200 if ready else 503)
