"""Errors the service raises for the client's mistakes and how the API renders every 4xx."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

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
    messages = [f"{_field_name(e['loc'])}: {e['msg']}" for e in errors]
    first_field = _field_name(errors[0]["loc"]) if errors else None
    detail = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in errors]
    return _error_response(422, "; ".join(messages), first_field, detail)


def install_error_handlers(app: FastAPI) -> None:
    """Render ApiError and validation errors as {error: {message, field, status}, detail}."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(OperationalError, _store_unavailable)
