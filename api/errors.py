"""Errors the service raises for the client's mistakes and how the API renders every 4xx."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.openai_responses import error_object

STORE_RETRY_AFTER_S = 5


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


_WHERE = ("body", "query", "path", "header")
# what pydantic adds to a location for the member of a union it tried (prompt.str, metadata.a.function-after[...])
_UNION_MEMBER_TAGS = ("str", "int", "float", "bool", "none", "list[str]", "list[int]")
_VALIDATOR_TAG = re.compile(r"[a-z-]+\[.*\]$")  # function-after[_storable(), str]; not a dict key's [key]


def field_name(error: dict[str, Any]) -> str:
    """The request field a pydantic error is about, dotted (`messages.0.content`); `body` for the body as a whole,
    such as JSON that does not parse (whose location is the character where parsing failed)."""
    if error.get("type") == "json_invalid":
        return "body"
    parts = [str(p) for p in error["loc"] if p not in _WHERE]
    return ".".join(p for p in parts if p not in _UNION_MEMBER_TAGS and not _VALIDATOR_TAG.match(p)) or "body"


def _error_response(
    status_code: int, message: str, field: str | None, detail: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    # OpenAI's keys too (type, param, code), so that an OpenAI client reads any error of this server
    error = {**error_object(status_code, message, field), "field": field, "status": status_code}
    body: dict[str, Any] = {"error": error}
    body["detail"] = detail if detail is not None else message
    return JSONResponse(body, status_code=status_code, headers=headers)


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    # A 422's detail keeps the shape FastAPI documents for every 422 (a list of {loc, msg, type}).
    detail = [{"loc": [exc.field or "body"], "msg": exc.message, "type": "value_error"}] \
        if exc.status_code == 422 else None
    return _error_response(exc.status_code, exc.message, exc.field, detail, headers=exc.headers)


def store_unavailable(exc: Exception) -> ApiError:
    """The 503 (with Retry-After) for a request the job store could not serve, logged."""
    logging.getLogger("pagedserve.api").warning("store.unavailable error=%s", exc.__class__.__name__)
    message = "the job store (database) is unavailable right now; retry in a few seconds"
    return ApiError(503, message, headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


async def _store_unavailable(request: Request, exc: Exception) -> JSONResponse:
    return await _api_error(request, store_unavailable(exc))


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    messages = [f"{field_name(e)}: {e['msg']}" for e in errors]
    first_field = field_name(errors[0]) if errors else None
    detail = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in errors]
    return _error_response(422, "; ".join(messages), first_field, detail)


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    # FastAPI's own errors (401 of a missing key, 404 of an unknown path, 405) in the same shape as every other
    assert isinstance(exc, StarletteHTTPException)
    return _error_response(exc.status_code, str(exc.detail), None, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Render ApiError, validation errors and FastAPI's HTTP errors as {error: {message, field, status, and OpenAI's
    type, param, code}, detail}."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OperationalError, _store_unavailable)
