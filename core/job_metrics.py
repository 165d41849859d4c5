"""Job counters and latencies, counted where a job changes state (core/lifecycle.py): in the API or a worker."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from core.models import Job, JobStatus
from core.settings import get_settings

# a job's latency counts its wait in the queue: under a backlog that is minutes, for long jobs up to hours
JOB_LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)

JOBS_SUBMITTED = Counter("pagedserve_jobs_submitted_total", "jobs accepted into the store")
JOBS_FINISHED = Counter("pagedserve_jobs_finished_total", "jobs that reached a final state, by status", ["status"])
JOB_TIME_TO_FIRST_TOKEN = Histogram(
    "pagedserve_job_time_to_first_token_seconds", "a succeeded job's acceptance (queue wait included) to first token",
    ["model_name"], buckets=JOB_LATENCY_BUCKETS_S,
)
JOB_LATENCY = Histogram(
    "pagedserve_job_latency_seconds", "a succeeded job's acceptance (queue wait included) to finish",
    ["model_name"], buckets=JOB_LATENCY_BUCKETS_S,
)
for _status in JobStatus:
    if _status.is_final:
        JOBS_FINISHED.labels(_status.value)


def record_job_latencies(job: Job) -> None:
    """Observe a succeeded job's latencies from its acceptance (created_at) to first token and to finish."""
    if job.status is not JobStatus.succeeded or job.finished_at is None:
        return
    model_name = get_settings().model
    JOB_LATENCY.labels(model_name).observe((job.finished_at - job.created_at).total_seconds())
    if job.first_token_at is not None:
        JOB_TIME_TO_FIRST_TOKEN.labels(model_name).observe((job.first_token_at - job.created_at).total_seconds())
