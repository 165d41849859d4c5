"""`pagedserve worker`: load the engine, then consume jobs with a threads pool (one thread per engine slot) and
webhook deliveries, which the delivery pool's own threads attempt."""

from __future__ import annotations

from celery import signals

from core.queue import JOBS_QUEUE, WEBHOOKS_QUEUE, celery_app
from core.settings import Settings, configure
from worker import drain, heartbeat
from worker.delivery_pool import shutdown_delivery_pool
from worker.metrics import serve_metrics
from worker.reaper import Reaper
from worker.service import engine_service


def run_worker(settings: Settings) -> None:
    """Run a worker until SIGTERM drains it: one engine, max_num_seqs concurrent jobs, one prefetch per slot."""
    configure(settings)
    service = engine_service()  # load the model before taking work
    serve_metrics(settings.metrics_port, settings.metrics_host)
    reaper = Reaper().start()
    import worker.tasks  # noqa: F401  (registers the tasks)
    # SIGTERM is Celery's warm shutdown: no new messages, running jobs finish or are requeued after the grace
    signals.worker_shutting_down.connect(drain.begin, weak=False)
    try:
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
    finally:  # every job has finished or been requeued: this worker holds nothing any more
        shutdown_delivery_pool()  # attempts in progress end within their deadline; queued ones stay pending
        reaper.stop()  # the reaper and the engine thread both beat; neither may bring the heartbeat back
        service.stop()
        heartbeat.forget()
