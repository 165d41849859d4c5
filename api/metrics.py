"""The API's /metrics: HTTP latency and the job store's gauges, plus the job counters (core/job_metrics.py).

Counters live in whichever process does the work (the API for submissions and cancels, a worker for results
and webhooks: worker/webhook_metrics.py); each process is scraped and PromQL sums them. Several API processes share one
/metrics through prometheus-client's multiprocess mode when PROMETHEUS_MULTIPROC_DIR is set.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.db import session_factory
from core.models import Job, JobStatus, utcnow

logger = logging.getLogger("pagedserve.metrics")
UNMATCHED_ROUTE = "unmatched"
HTTP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
HTTP_REQUEST_DURATION = Histogram(
    "pagedserve_http_request_duration_seconds", "API request latency by method, route template and status code",
    ["method", "route", "status_code"], buckets=HTTP_BUCKETS_S,
)


class StoreCollector:
    """Gauges read from the job store at scrape time: the same answer from any API process."""

    def describe(self) -> list[Metric]:
        """The gauges' families, without samples: jobs by status, the queue depth and its oldest job's age."""
        return [
            GaugeMetricFamily("pagedserve_jobs", "jobs in the store by status", labels=["status"]),
            GaugeMetricFamily("pagedserve_queue_depth", "jobs accepted and not yet claimed by a worker", labels=[]),
            GaugeMetricFamily("pagedserve_queue_oldest_age_seconds",
                              "how long the oldest queued job has waited since acceptance (0 when none)", labels=[]),
        ]

    def collect(self) -> Iterator[Metric]:
        """The gauges with their current values."""
        try:
            with session_factory()() as session:
                rows = session.execute(select(Job.status, func.count()).group_by(Job.status)).all()
                oldest = session.scalar(select(func.min(Job.created_at)).where(Job.status == JobStatus.queued))
        except Exception as exc:  # a scrape must not fail with the database; the gauges go missing instead
            logger.warning("metrics.store_unavailable error=%r", exc)
            return
        counts = {status: count for status, count in rows}
        jobs, queue_depth, oldest_age = self.describe()
        for status in JobStatus:
            jobs.add_metric([status.value], counts.get(status, 0))
        queue_depth.add_metric([], counts.get(JobStatus.queued, 0))
        oldest_age.add_metric([], (utcnow() - oldest).total_seconds() if oldest is not None else 0.0)
        yield from (jobs, queue_depth, oldest_age)


def render_metrics() -> tuple[bytes, str]:
    """This API's metrics in the Prometheus text format, and its content type."""
    registry = CollectorRegistry()
    # prometheus-client's own variable: set, every API process writes its samples under it
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(registry)
    else:
        registry.register(REGISTRY)  # a registry is a collector of its metrics
    registry.register(StoreCollector())
    return generate_latest(registry), CONTENT_TYPE_LATEST


class HttpLatencyMiddleware:
    """Times every HTTP request and labels it with its route template (never the raw path)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request through, observing its duration once the response is done."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status_code = 500

        async def send_and_note_status(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            route = getattr(scope.get("route"), "path", UNMATCHED_ROUTE)  # the router sets it on a match
            HTTP_REQUEST_DURATION.labels(scope["method"], route, str(status_code)).observe(
                time.perf_counter() - started)
