"""Fault-test fixtures: a private Redis, the service's processes under the test's control, a fresh PostgreSQL store."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from cli.main import settings_env
from core.settings import Settings, configure
from tests.service.faults.servers import PrivateRedis
from tests.service.procs import free_port, stop, wait_until

# Production defaults for liveness (a dead worker's jobs are requeued within 15 s + 3 passes of 3 s < 30 s);
# short reconcile grace and webhook backoff so the tests wait seconds, not minutes.
FAULT_SETTINGS = {"heartbeat_ttl_s": 15.0, "reaper_interval_s": 3.0, "reconcile_grace_s": 3.0,
                  "webhook_backoff_s": 0.2, "webhook_max_attempts": 5}


@pytest.fixture(scope="module")
def database_url(postgresql_url: str) -> str:
    """Fault tests run on PostgreSQL, the production store."""
    return postgresql_url


@pytest.fixture(scope="module")
def service_model_dir(tiny_model_dir: Path) -> Path:
    """The tiny random Llama with SmolLM2's tokenizer."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    """A redis-server of this module's own, which its tests may kill and restart empty."""
    server = PrivateRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def service_settings(service_settings: Settings, private_redis: PrivateRedis) -> Iterator[Settings]:
    """The module's settings on the private Redis, with the fault-test timings."""
    settings = service_settings.model_copy(update={"redis_url": private_redis.url, **FAULT_SETTINGS})
    configure(settings)
    yield settings
    configure(service_settings)


@dataclass
class ServiceProcesses:
    """The API and worker processes of a module, started, killed and stopped by its tests."""

    settings: Settings
    logs: Path
    api_url: str = ""
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def _spawn(self, role: str, settings: Settings, log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.logs / log_name, "ab")
        return subprocess.Popen([sys.executable, "-m", "cli.main", role], env=settings_env(settings),
                                stdout=log, stderr=subprocess.STDOUT)

    def start_api(self) -> str:
        """Start the API and wait until it is ready; returns its base URL."""
        settings = self.settings.model_copy(update={"port": free_port()})
        self.others.append(self._spawn("api", settings, "api.log"))
        self.api_url = f"http://127.0.0.1:{settings.port}"
        wait_until(lambda: httpx.get(f"{self.api_url}/healthz").status_code == 200, 60, "the API to start")
        return self.api_url

    def start_worker(self) -> subprocess.Popen[bytes]:
        """Start one more worker (its metrics on a free port)."""
        settings = self.settings.model_copy(update={"metrics_port": free_port()})
        worker = self._spawn("worker", settings, f"worker-{len(self.workers)}.log")
        self.workers.append(worker)
        return worker

    def ensure_worker(self) -> None:
        """Start a worker unless one is running."""
        if not any(worker.poll() is None for worker in self.workers):
            self.start_worker()

    def stop_all_workers(self) -> None:
        """Stop the running workers gracefully."""
        for worker in self.workers:
            if worker.poll() is None:
                stop(worker)

    def restart_api(self) -> str:
        """SIGKILL the API (no graceful shutdown) and start a fresh one; returns its base URL."""
        api = self.others.pop()
        api.send_signal(signal.SIGKILL)
        api.wait()
        return self.start_api()

    def kill_worker(self, worker: subprocess.Popen[bytes]) -> None:
        """SIGKILL a worker: no shutdown, no acks, its heartbeat simply stops."""
        worker.send_signal(signal.SIGKILL)
        worker.wait()

    def logs_text(self) -> str:
        """Everything the processes logged so far."""
        return "".join(path.read_text(errors="replace") for path in sorted(self.logs.iterdir()))

    def stop_all(self) -> None:
        """Stop every process this module started that is still running."""
        for process in [*self.workers, *self.others]:
            if process.poll() is None:
                stop(process)


@pytest.fixture(scope="module")
def service_procs(service_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcesses]:
    """The module's API (started) and workers (started by the tests that need them)."""
    procs = ServiceProcesses(service_settings, tmp_path_factory.mktemp("logs"))
    try:
        procs.start_api()
        yield procs
    finally:
        procs.stop_all()
