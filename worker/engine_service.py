"""The per-process engine service: one long-lived engine stepped by its own thread, fed by many job threads."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from core.logging import log_event

logger = logging.getLogger("pagedserve.engine_service")
IDLE_WAIT_S = 0.5


class RequestFailed(RuntimeError):
    """The engine failed this request alone: a step raised because of it (the others went on)."""

    def __init__(self, error: str) -> None:
        super().__init__(f"engine step failed for this request: {error}")


@dataclass(slots=True)
class RequestHandle:
    """What a job thread holds for its request: the engine's outputs (or an error) arrive on `outputs`."""

    request_id: str
    outputs: queue.Queue[Any] = field(default_factory=queue.Queue)


@dataclass(slots=True)
class _Add:
    handle: RequestHandle
    prompt: str | list[int]
    params: Any
    priority: int


@dataclass(slots=True)
class _Abort:
    request_id: str


class EngineService:
    """Owns an LLMEngine; only its thread touches the engine, so requests and aborts go through a command queue."""

    def __init__(
        self,
        engine: Any,
        on_stats: Callable[[dict[str, Any]], None] | None = None,
        on_step: Callable[[float, list[Any]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_stats = on_stats
        self.on_step = on_step  # (step duration in seconds, the step's RequestOutputs), on the engine thread
        self.peak_num_running = 0
        self._commands: queue.Queue[_Add | _Abort] = queue.Queue()
        self._handles: dict[str, RequestHandle] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-service", daemon=True)
        self._last_stats_s = 0.0

    def start(self) -> EngineService:
        """Start the stepping thread."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the stepping thread."""
        self._stopping.set()
        self._commands.put(_Abort(""))
        self._thread.join(timeout_s)

    def submit(self, request_id: str, prompt: str | list[int], params: Any, priority: int = 0) -> RequestHandle:
        """Queue a request for the engine; its outputs (or a ValueError) arrive on the handle."""
        handle = RequestHandle(request_id)
        self._commands.put(_Add(handle, prompt, params, priority))
        return handle

    def abort(self, request_id: str) -> None:
        """Abort a request; the engine frees its blocks on its next turn."""
        self._commands.put(_Abort(request_id))

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            if self._handles.pop(command.request_id, None) is not None:
                self.engine.abort_request(command.request_id)
            return
        try:
            self.engine.add_request(command.handle.request_id, command.prompt, command.params, command.priority)
        except Exception as exc:  # a ValueError names bad input; anything else must not end this thread
            if not isinstance(exc, ValueError):
                logger.exception("engine.add_request_failed")
            command.handle.outputs.put(exc)
            return
        self._handles[command.handle.request_id] = command.handle

    def _drain_commands(self, wait_s: float) -> None:
        try:
            self._apply(self._commands.get(timeout=wait_s) if wait_s else self._commands.get_nowait())
            while True:
                self._apply(self._commands.get_nowait())
        except queue.Empty:
            pass

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished_requests()
            self._drain_commands(0.0 if busy else IDLE_WAIT_S)
            if self.engine.has_unfinished_requests():
                self._step()
            self._report_stats()

    def _step(self) -> None:
        started_s = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # The engine fails a request that breaks a step on its own (RequestOutput.error); reaching
            # here means the engine itself is broken (scheduling, block moves): fail what it holds.
            logger.exception("engine.step_failed")
            for request_id, handle in list(self._handles.items()):
                handle.outputs.put(RuntimeError(f"engine step failed: {exc}"))
                self.engine.abort_request(request_id)
            self._handles.clear()
            return
        self._report_step(time.perf_counter() - started_s, outputs)
        self.peak_num_running = max(self.peak_num_running, self.engine.stats().num_running)
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is None:
                continue
            if output.finished:
                del self._handles[output.request_id]
            handle.outputs.put(RequestFailed(output.error) if output.error is not None else output)

    def _report_step(self, duration_s: float, outputs: list[Any]) -> None:
        if self.on_step is None:
            return
        try:
            self.on_step(duration_s, outputs)
        except Exception as exc:  # metrics are best effort, like stats
            log_event(logger, "engine.step_report_failed", error=repr(exc))

    def _report_stats(self) -> None:
        now = time.monotonic()
        if self.on_stats is None or now - self._last_stats_s < 1.0:
            return
        self._last_stats_s = now
        try:
            self.on_stats(self.snapshot())
        except Exception as exc:  # stats are best effort; the engine keeps stepping
            log_event(logger, "engine.stats_report_failed", error=repr(exc))

    def snapshot(self) -> dict[str, Any]:
        """Engine stats plus the largest batch seen since start."""
        return {**asdict(self.engine.stats()), "peak_num_running": self.peak_num_running}
