"""`pagedserve worker`: load the engine, then consume jobs and webhook deliveries with a threads pool."""

from __future__ import annotations

from api.queue import JOBS_QUEUE, WEBHOOKS_QUEUE, celery_app
from api.settings import Settings, configure
from worker import heartbeat
from worker.metrics import serve_metrics
from worker.reaper import Reaper
from worker.service import engine_service


def run_worker(settings: Settings) -> None:
    """Run a worker until stopped: one engine, max_num_seqs concurrent jobs, one prefetched message per slot."""
    configure(settings)
    engine_service()  # load the model before taking work
    serve_metrics(settings.metrics_port, settings.metrics_host)
    Reaper().start()
    import worker.tasks  # noqa: F401  (registers the tasks)

    celery_app().worker_main([
        "worker",
        "--pool=threads",
        f"--concurrency={settings.max_num_seqs}",
        f"--queues={JOBS_QUEUE},{WEBHOOKS_QUEUE}",
        f"--hostname=pagedserve@{heartbeat.worker_id()}",
        "--without-gossip",
        "--without-mingle",
        "--loglevel=INFO",
    ])
