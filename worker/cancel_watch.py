"""One thread per worker process stops running jobs: it reads every job's cancel flag in one Redis round trip
every CHECK_INTERVAL_S, and once the drain's grace period is over (`drain.overdue()`) it stops them all.

A job thread that polled its own flag woke five times a second for its own Redis call: at 32 jobs in flight on
2 CPUs, 160 round trips and thread wake-ups a second, each taking the GIL from the engine thread. Now a job
thread blocks on its handle's queue; the watcher aborts a stopped job's engine request and puts a `Stop` there.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from core import streams
from core.logging import log_event
from worker import drain
from worker.engine_service import RequestHandle

logger = logging.getLogger("pagedserve.worker")
CHECK_INTERVAL_S = 0.2
_lock = threading.Lock()
_watcher: CancelWatcher | None = None


class Stop(enum.Enum):
    """Put on a job's output queue by the watcher, after it aborted the job's request: why the job ends now."""

    CANCELLED = "cancelled"
    DRAIN_OVERDUE = "drain_overdue"


@dataclass(slots=True, frozen=True)
class _Watched:
    job_id: str
    handle: RequestHandle
    abort: Callable[[str], None]  # the engine service's abort, given the request id


class CancelWatcher:
    """Watches the jobs registered through `watching`; `check` is one pass, its thread runs one per interval."""

    def __init__(self, redis_client: Callable[[], redis.Redis] = streams.redis_client,
                 interval_s: float = CHECK_INTERVAL_S) -> None:
        self._redis_client = redis_client
        self._interval_s = interval_s
        self._watched: dict[str, _Watched] = {}  # by request id: unique per attempt of a job
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cancel-watch", daemon=True)

    def start(self) -> CancelWatcher:
        """Start checking once per interval."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the checking thread."""
        self._stopping.set()
        self._thread.join(timeout_s)

    @contextmanager
    def watching(self, job_id: str, handle: RequestHandle, abort: Callable[[str], None]) -> Iterator[None]:
        """Watch a job's request while the block runs; a `Stop` may arrive on `handle.outputs` meanwhile."""
        entry = _Watched(job_id, handle, abort)
        with self._lock:
            self._watched[handle.request_id] = entry
        try:
            yield
        finally:
            self._forget(entry)

    def check(self) -> None:
        """Stop every watched job whose cancel flag is set, or all of them once the drain is overdue."""
        with self._lock:
            watched = list(self._watched.values())
        if not watched:
            return
        cancelled = self._cancelled({entry.job_id for entry in watched})
        overdue = drain.overdue()  # checked even when Redis is down: a drain must end
        for entry in watched:
            if entry.job_id in cancelled:
                self._stop(entry, Stop.CANCELLED)
            elif overdue:
                self._stop(entry, Stop.DRAIN_OVERDUE)

    def _cancelled(self, job_ids: set[str]) -> set[str]:
        ordered = list(job_ids)
        try:
            flags = self._redis_client().mget([streams.cancel_key(job_id) for job_id in ordered])
        except redis.RedisError as exc:  # the next pass reads the flags again
            log_event(logger, "cancel_watch.check_failed", jobs=len(ordered), error=repr(exc))
            return set()
        return {job_id for job_id, flag in zip(ordered, flags, strict=True) if flag is not None}

    def _stop(self, entry: _Watched, reason: Stop) -> None:
        if not self._forget(entry):  # the job ended since this pass read the registry
            return
        entry.handle.outputs.put(reason)  # before the abort: the request's last output (abort) comes after it
        entry.abort(entry.handle.request_id)

    def _forget(self, entry: _Watched) -> bool:
        with self._lock:
            if self._watched.get(entry.handle.request_id) is not entry:
                return False
            del self._watched[entry.handle.request_id]
            return True

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            try:
                self.check()
            except Exception:  # a pass that broke must not end cancellation for the process
                logger.exception("cancel_watch.pass_failed")


def cancel_watcher() -> CancelWatcher:
    """This process's watcher, started on first use."""
    global _watcher
    with _lock:
        if _watcher is None:
            _watcher = CancelWatcher().start()
        return _watcher
