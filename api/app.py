"""The FastAPI application factory."""

from __future__ import annotations

from fastapi import FastAPI

from api.errors import install_error_handlers
from api.limits import UPLOAD_OVERHEAD_BYTES, BodySizeLimit
from api.metrics import HttpLatencyMiddleware
from api.routes import events, health, jobs, openai_batch, openai_inference, openai_responses, tokenize, version
from api.routes import metrics as metrics_route
from core.logging import configure_logging
from core.settings import Settings, configure, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the API; `settings` (if given) become this process's settings."""
    if settings is not None:
        configure(settings)
    app = FastAPI(
        title="pagedserve",
        version=version.pagedserve_version(),
        summary="LLM generation jobs on a PagedAttention engine: submit, stream, poll, get webhooks.",
    )
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(events.router)
    app.include_router(metrics_route.router)
    app.include_router(openai_inference.router)
    app.include_router(openai_responses.router)
    app.include_router(openai_batch.router)
    app.include_router(tokenize.router)
    app.include_router(version.router)
    limits = get_settings()
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes,
                       path_limits={"/v1/files": limits.max_file_bytes + UPLOAD_OVERHEAD_BYTES})
    app.add_middleware(HttpLatencyMiddleware)
    configure_logging(limits.log_format)  # also under `uvicorn --factory`, where no pagedserve command ran first
    return app
