"""Errors the service raises for the client's mistakes, how the API renders every 4xx, and how processes log."""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pythonjsonlogger.json import JsonFormatter
from sqlalchemy.exc import OperationalError

STORE_RETRY_AFTER_S = 5
TEXT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
JSON_LOG_FIELDS = ["levelname", "name", "message"]  # plus "timestamp" (ISO 8601, UTC)
NOISY_LOGGERS = ("alembic.runtime.plugins", "httpx")
# uvicorn gives these their own handlers; they pass their records to the root handler instead, in its format
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
_RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_installed_handler: logging.Handler | None = None


class ApiError(Exception):
    """A client error with its HTTP status and, where one field is to blame, that field's name."""

    def __init__(
        self, status_code: int, message: str, field: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.field = field
        self.headers = headers


def log_event(logger: logging.Logger, event: str, **fields: Any) -> None:
    """One structured log line: the event name then key=value pairs (in JSON logs, `event` and one key per field)."""
    # a field named like a LogRecord attribute (name, module, ...) would make logging raise; it gets a _ suffix
    extra = {"event": event} | {f"{key}_" if key in _RECORD_ATTRIBUTES else key: value for key, value in fields.items()}
    logger.info("%s %s", event, " ".join(f"{key}={value}" for key, value in fields.items()), extra=extra)


def configure_logging(log_format: Literal["text", "json"]) -> None:
    """Log INFO and up to stderr, as text lines or as one JSON object per line (PAGEDSERVE_LOG_FORMAT)."""
    global _installed_handler
    if log_format not in ("text", "json"):
        raise ValueError(f"log_format must be 'text' or 'json', got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(JSON_LOG_FIELDS, timestamp=True) if log_format == "json"
                         else logging.Formatter(TEXT_LOG_FORMAT))
    root = logging.getLogger()
    if _installed_handler is not None:  # configured before in this process: replace only what we installed
        root.removeHandler(_installed_handler)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    _installed_handler = handler
    for name in UVICORN_LOGGERS:
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def _error_response(
    status_code: int, message: str, field: str | None, detail: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body: dict[str, Any] = {"error": {"message": message, "field": field, "status": status_code}}
    body["detail"] = detail if detail is not None else message
    return JSONResponse(body, status_code=status_code, headers=headers)


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    # A 422's detail keeps the shape FastAPI documents for every 422 (a list of {loc, msg, type}).
    detail = [{"loc": [exc.field or "body"], "msg": exc.message, "type": "value_error"}] \
        if exc.status_code == 422 else None
    return _error_response(exc.status_code, exc.message, exc.field, detail, headers=exc.headers)


async def _store_unavailable(_request: Request, exc: Exception) -> JSONResponse:
    logging.getLogger("pagedserve.api").warning("store.unavailable error=%s", exc.__class__.__name__)
    message = "the job store (database) is unavailable right now; retry in a few seconds"
    return _error_response(503, message, None, headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    messages = [f"{_field_name(e['loc'])}: {e['msg']}" for e in errors]
    first_field = _field_name(errors[0]["loc"]) if errors else None
    detail = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in errors]
    return _error_response(422, "; ".join(messages), first_field, detail)


def install_error_handlers(app: FastAPI) -> None:
    """Render ApiError and validation errors as {error: {message, field, status}, detail}."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(OperationalError, _store_unavailable)
