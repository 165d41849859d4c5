"""OpenAI-style error objects ({error: {message, type, param, code}}) for the OpenAI-compatible routes."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from sqlalchemy.exc import OperationalError

from api.errors import ApiError, field_name, store_unavailable
from core.openai_responses import error_object


def error_response(status_code: int, message: str, param: str | None, code: str | None = None) -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse({"error": error_object(status_code, message, param, code)}, status_code=status_code)


def validation_errors(errors: list[Any]) -> tuple[str, str | None]:
    """One message naming each invalid parameter, and the first such parameter."""
    messages = [f"{field_name(e)}: {e['msg']}" for e in errors]
    return "; ".join(messages), field_name(errors[0]) if errors else None


def openai_status(exc: ApiError) -> int:
    """The status an OpenAI client gets for an ApiError: the job API's 422 for invalid input is OpenAI's 400."""
    return 400 if exc.status_code == 422 else exc.status_code


def openai_error(exc: ApiError) -> dict[str, Any]:
    """The OpenAI error object of an ApiError; an unknown model has OpenAI's code."""
    code = "model_not_found" if exc.field == "model" and exc.status_code == 404 else None
    return error_object(openai_status(exc), exc.message, exc.field, code)


def _api_error(exc: ApiError) -> JSONResponse:
    response = JSONResponse({"error": openai_error(exc)}, status_code=openai_status(exc))
    response.headers.update(exc.headers or {})  # Retry-After of a 429 or 503
    return response


class OpenAIRoute(APIRoute):
    """A route that renders every client error as an OpenAI error object (400 for invalid parameters)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """Wrap the handler so that validation, ApiError and HTTP errors come back in OpenAI's shape."""
        handler = super().get_route_handler()

        async def openai_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except (RequestValidationError, ValidationError) as exc:
                message, param = validation_errors(list(exc.errors()))
                return error_response(400, message, param)
            except ApiError as exc:
                return _api_error(exc)
            except OperationalError as exc:
                return _api_error(store_unavailable(exc))
            except HTTPException as exc:
                code = "invalid_api_key" if exc.status_code == 401 else None
                response = error_response(exc.status_code, str(exc.detail), None, code)
                response.headers.update(exc.headers or {})  # WWW-Authenticate of a 401
                return response

        return openai_handler
