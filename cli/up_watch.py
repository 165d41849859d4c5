"""`pagedserve up`'s watch over the processes it started: a worker that dies is started again (the jobs it held go
back to the queue through the reaper, as any dead worker's); the API or the embedded Redis exiting stops `up`."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable

from core.logging import log_event

logger = logging.getLogger("pagedserve.cli")
POLL_S = 0.5
FIRST_RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0  # reached only if MAX_QUICK_DEATHS is raised
STABLE_RUN_S = 60.0  # a worker that ran this long died of something else than its start-up
MAX_QUICK_DEATHS = 5  # in a row: the worker cannot start (its log says why), so `up` stops


class RestartPolicy:
    """How long to wait before starting a dead worker again: a doubling delay after quick deaths, the first delay
    again after a long run; None once MAX_QUICK_DEATHS quick deaths came in a row."""

    def __init__(self) -> None:
        self.quick_deaths = 0

    def delay_after(self, ran_s: float) -> float | None:
        """The wait before the next start of a worker that died after running `ran_s` seconds."""
        if ran_s >= STABLE_RUN_S:
            self.quick_deaths = 0
            return FIRST_RESTART_DELAY_S
        self.quick_deaths += 1
        if self.quick_deaths >= MAX_QUICK_DEATHS:
            return None
        return min(MAX_RESTART_DELAY_S, FIRST_RESTART_DELAY_S * 2 ** (self.quick_deaths - 1))


def watch(processes: list[subprocess.Popen[bytes]], worker_index: int,
          start_worker: Callable[[], subprocess.Popen[bytes]]) -> str:
    """Keep `processes[worker_index]` (the worker) running, replacing it in the list when it dies; return why `up`
    must stop once another process exits or the worker cannot be kept up."""
    policy, started = RestartPolicy(), time.monotonic()
    restart_at: float | None = None
    while True:
        if any(p.poll() is not None for i, p in enumerate(processes) if i != worker_index):
            return "a pagedserve process exited; stopping the others"
        worker = processes[worker_index]
        if restart_at is None and worker.poll() is not None:
            ran_s = time.monotonic() - started
            delay = policy.delay_after(ran_s)
            log_event(logger, "up.worker_exited", pid=worker.pid, returncode=worker.returncode, ran_s=round(ran_s, 1),
                      restart_in_s=delay)
            if delay is None:
                return f"the worker exited {MAX_QUICK_DEATHS} times in a row within {STABLE_RUN_S:.0f} s of starting"
            restart_at = time.monotonic() + delay
        if restart_at is not None and time.monotonic() >= restart_at:
            processes[worker_index], started, restart_at = start_worker(), time.monotonic(), None
            log_event(logger, "up.worker_restarted", pid=processes[worker_index].pid)
        time.sleep(POLL_S)
