"""Liveness and readiness probes."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from api import streams
from api.db import session_factory

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


def _check(probe: Callable[[], object]) -> str:
    try:
        probe()
    except Exception as exc:
        return f"error: {exc.__class__.__name__}: {exc}"
    return "ok"


def _ping_database() -> None:
    with session_factory()() as session:
        session.execute(text("SELECT 1"))


@router.get("/readyz")
def readyz() -> JSONResponse:
    """Ready when the job store and Redis both answer (503 naming the one that does not)."""
    checks = {"database": _check(_ping_database), "redis": _check(lambda: streams.redis_client().ping())}
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ok" if ready else "unavailable", **checks}, status_code=200 if ready else 503)
