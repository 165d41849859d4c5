"""Runs one job: claim it in the store, feed it to the engine service, record its first token and its result
(its tokens reach the event stream through the service's token sink, worker/token_stream.py; cancels and the
drain's deadline reach it through the process's cancel watcher, worker/cancel_watch.py)."""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from sqlalchemy import update

from core import streams
from core.db import session_factory
from core.job_payload import REFUSED
from core.lifecycle import transition
from core.logging import log_event
from core.models import Job, JobStatus, utcnow
from worker import drain, heartbeat
from worker.cancel_watch import Stop, cancel_watcher
from worker.engine_service import EngineService, RequestHandle
from worker.token_stream import prompt_scores, request_id_for, stored_logprobs

logger = logging.getLogger("pagedserve.worker")
ABORTED_OUTPUT_WAIT_S = 5.0  # the engine reports an aborted request's last output with its next step (milliseconds)


def _claimable_from(job: Job) -> set[JobStatus]:
    # A running job is claimed again only when the worker that held it is gone (it died mid-job and a message fell
    # to the job: redelivered, or its own message's fallback); a live holder keeps it, so a job never runs twice.
    if job.status is JobStatus.running and job.worker_id and not heartbeat.is_alive(job.worker_id):
        return {JobStatus.running}
    return {JobStatus.queued}


def _claim(job_id: str) -> Job | None:
    with session_factory()() as session:
        job = session.get(Job, job_id)
        if job is None:
            log_event(logger, "job.missing", job_id=job_id)
            return None
        # Fenced by the worker and attempt read here: from running, if the reaper requeued the job and another
        # worker claimed it since, that worker's claim stands (same status, other worker and attempt).
        return transition(
            session, job_id, JobStatus.running, _claimable_from(job),
            {"worker_id": job.worker_id, "attempts": job.attempts},
            started_at=utcnow(), first_token_at=None, attempts=job.attempts + 1,
            worker_id=heartbeat.worker_id(), output=None, error=None,
        )


def _choices(output: Any) -> list[dict[str, Any]]:
    prompt = prompt_scores(output)  # a request that asked for its prompt's logprobs keeps them with each choice
    return [
        {
            "index": c.index,
            "text": c.text,
            "token_ids": list(c.token_ids),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "logprobs": stored_logprobs(c.logprobs) if c.logprobs else None,
            **prompt,
        }
        for c in output.outputs
    ]


def _finish(job: Job, to: JobStatus, **fields: Any) -> bool:
    """Record the run's end; False if the job is no longer this run's (cancelled, or taken away by the reaper)."""
    # Fenced by worker and attempt: a result from a run the reaper took away is dropped, not recorded.
    expected = {"worker_id": job.worker_id, "attempts": job.attempts}
    with session_factory()() as session:
        if transition(session, job.id, to, {JobStatus.running}, expected, **fields) is None:
            log_event(logger, "job.result_dropped", job_id=job.id, attempt=job.attempts,
                      reason="no longer this run's (cancelled or requeued)")
            return False
    return True


def _result_fields(output: Any) -> dict[str, Any]:
    choices = _choices(output)
    return {"output": choices, "completion_tokens": sum(len(c["token_ids"]) for c in choices),
            "prompt_tokens": len(output.prompt_token_ids), "cached_prompt_tokens": output.num_cached_tokens}


def _keep_cancelled_output(job: Job, output: Any | None) -> None:
    """A job cancelled while this run held it keeps what the run generated (finish_reason ``abort`` where the
    request was stopped), as vLLM reports an aborted request's text; its state stays cancelled."""
    if output is None:
        return
    this_run = (Job.id == job.id) & (Job.status == JobStatus.cancelled) & (Job.worker_id == job.worker_id) & (
        Job.attempts == job.attempts)
    with session_factory()() as session:
        session.execute(update(Job).where(this_run).values(**_result_fields(output)))
        session.commit()


def _aborted_output(handle: RequestHandle) -> Any | None:
    """The engine's last output of the request the watcher aborted, which it reports on its next turn."""
    deadline = time.monotonic() + ABORTED_OUTPUT_WAIT_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            item = handle.outputs.get(timeout=left)
        except queue.Empty:
            break
        if isinstance(item, Exception):
            break
        if not isinstance(item, Stop) and item.finished:
            return item
    log_event(logger, "job.aborted_output_missing", request_id=handle.request_id)
    return None


def _mark_first_token(job_id: str) -> None:
    with session_factory()() as session:
        still_running = (Job.id == job_id) & (Job.status == JobStatus.running)
        session.execute(update(Job).where(still_running).values(first_token_at=utcnow()))
        session.commit()


def run_job(job_id: str, service: EngineService, sampling_params_cls: Any) -> bool:
    """Run a job to a final state; False if it was not claimable (done, cancelled, held by a live worker)."""
    job = _claim(job_id)
    if job is None:
        return False
    try:
        params = sampling_params_cls(**job.params)
    except (TypeError, ValueError) as exc:
        _finish(job, JobStatus.failed, error=f"{REFUSED}invalid sampling parameters: {exc}")
        return True
    request_id = request_id_for(job_id, job.attempts)
    if job.attempts > 1:  # a redelivered job starts over: its stream must not mix two attempts
        streams.publish_restart(streams.redis_client(), job_id, job.attempts)
    handle = service.submit(request_id, job.prompt_token_ids or job.prompt, params, job.priority)
    with cancel_watcher().watching(job_id, handle, service.abort):
        _follow(job, handle)
    return True


def _follow(job: Job, handle: RequestHandle) -> None:
    """Wait on the handle for the job's first token and its end, or for the cancel watcher's `Stop`."""
    first_token_seen = False
    while True:
        item = handle.outputs.get()
        if item is Stop.CANCELLED:  # the watcher is aborting the request; the API has set the job's state
            log_event(logger, "job.aborted", job_id=job.id, request_id=handle.request_id)
            _keep_cancelled_output(job, _aborted_output(handle))
            return
        if item is Stop.DRAIN_OVERDUE:  # shutting down and out of grace: another worker runs it from the start
            drain.requeue(job)
            return
        if isinstance(item, Exception):  # the engine service hands back a ValueError for a request it refused
            _finish(job, JobStatus.failed, error=f"{REFUSED}{item}" if isinstance(item, ValueError) else str(item))
            return
        # the engine service's token sink has published the tokens; this thread records milestones
        if not first_token_seen and any(c.token_ids for c in item.outputs):
            first_token_seen = True
            _mark_first_token(job.id)
        if item.finished:
            if not _finish(job, JobStatus.succeeded, **_result_fields(item)):
                _keep_cancelled_output(job, item)  # it finished as the cancel came
            return
