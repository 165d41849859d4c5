"""The Prometheus scrape endpoint."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api.metrics import render_metrics

router = APIRouter(tags=["health"])


@router.get("/metrics", include_in_schema=False)
def metrics() -> Response:
    """Service metrics in the Prometheus text format."""
    body, content_type = render_metrics()
    return Response(body, media_type=content_type)
