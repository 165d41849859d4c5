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
    saw_tokens: bool = False  # with a token sink: the first output that carried tokens was delivered


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
        token_sink: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_stats = on_stats
        self.on_step = on_step  # (step duration in seconds, the step's RequestOutputs), on the engine thread
        # Given each step's outputs on the engine thread before any handle sees them; with a sink, a handle
        # gets only its request's first output that carries tokens and its last (or an error): no wake-up per token.
        self.token_sink = token_sink
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

    @classmethod
    def start_building(cls, build_engine: Callable[[], Any], **callbacks: Any) -> EngineService:
        """Build the engine on the stepping thread itself and start stepping it there; return once it is built
        (re-raising what the build raised). torch's CPU kernels run slower on a thread other than the one that
        loaded and packed the model: 180-218 ms against 111-117 ms per decode step of 32 sequences of
        SmolLM2-135M on 2 CPUs (bf16, oneDNN-packed weights). The cause is libgomp's: it keeps a team of threads
        for each thread that ran a parallel region, and once it manages more threads than there are CPUs it stops
        spinning between regions, so every region waits for its team to wake (a tiny bf16_linear call: 28 us
        against 1.9). Any large torch op on another thread of the worker would bring that back."""
        service = cls(None, **callbacks)
        built = threading.Event()
        failure: list[BaseException] = []

        def build_then_run() -> None:
            try:
                service.engine = build_engine()
            except BaseException as exc:  # handed to the caller, which raises it
                failure.append(exc)
                return
            finally:
                built.set()
            service._run()

        service._thread = threading.Thread(target=build_then_run, name="engine-service", daemon=True)
        service._thread.start()
        built.wait()
        if failure:
            raise failure[0]
        return service

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the stepping thread."""
        self._stopping.set()
        self._commands.put(_Abort(""))
        self._thread.join(timeout_s)

    def submit(self, request_id: str, prompt: str | list[int], params: Any, priority: int = 0) -> RequestHandle:
        """Queue a request for the engine; its outputs (or a ValueError) arrive on the handle. A structured-output
        constraint is compiled here, on the caller's thread, so that one tenant's large schema does not stall the
        engine's steps for everyone (the engine then finds it compiled)."""
        handle = RequestHandle(request_id)
        if getattr(params, "structured_outputs", None) is not None:
            try:
                self.engine.grammars.compile(params.structured_outputs)
            except ValueError as exc:  # refused as add_request would refuse it
                handle.outputs.put(exc)
                return handle
        self._commands.put(_Add(handle, prompt, params, priority))
        return handle

    def abort(self, request_id: str) -> None:
        """Abort a request; the engine frees its blocks on its next turn."""
        self._commands.put(_Abort(request_id))

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            if command.request_id in self._handles:  # its last output (abort) reaches the handle with the next step
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
        # not stats(): its cache usage walks every free block, on every step
        self.peak_num_running = max(self.peak_num_running, self.engine.num_running())
        self._sink_tokens(outputs)
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is None:
                continue
            if output.finished:
                del self._handles[output.request_id]
            elif self.token_sink is not None:
                if handle.saw_tokens or not any(c.token_ids for c in output.outputs):
                    continue
                handle.saw_tokens = True
            handle.outputs.put(output if output.error is None else
                               ValueError(output.error) if output.refused else RequestFailed(output.error))

    def _sink_tokens(self, outputs: list[Any]) -> None:
        if self.token_sink is None:
            return
        try:
            self.token_sink(outputs)
        except Exception as exc:  # streaming is best effort; results are recorded from the last output
            log_event(logger, "engine.token_sink_failed", error=repr(exc))

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
