"""Private Redis and PostgreSQL servers that a fault test starts, kills and restarts (never the shared ones)."""

from __future__ import annotations

import glob
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.service.procs import free_port, wait_until


@dataclass
class PrivateRedis:
    """A redis-server on its own port without persistence: every restart comes back empty."""

    workdir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Its URL, database 0."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        """Start it and wait until it answers PING."""
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", str(self.workdir)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers, 10, "the private Redis to answer")
        return self

    def _answers(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url).ping())
        except redis.ConnectionError:
            return False

    def kill(self) -> None:
        """SIGKILL it: everything it held is gone."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


def postgres_bin_dir() -> Path | None:
    """The newest installed PostgreSQL's bin directory, if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


@dataclass
class PrivatePostgres:
    """A PostgreSQL cluster in a temporary directory on its own port, run as the postgres user."""

    bin_dir: Path
    port: int = field(default_factory=free_port)
    datadir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pagedserve-pg-")))

    @property
    def url(self) -> str:
        """SQLAlchemy URL of its postgres database."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *args], check=True, capture_output=True, timeout=60)

    def init(self) -> PrivatePostgres:
        """Create the cluster (trust auth on loopback)."""
        shutil.chown(self.datadir, "postgres", "postgres")
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.datadir / "data"), "-A", "trust", "-U", "postgres")
        return self

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-p {self.port} -k {self.datadir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.datadir / "data"), "-o", options,
                  "-l", str(self.datadir / "server.log"), "-w", "start")

    def stop(self) -> None:
        """Stop the server (fast shutdown: open connections are cut)."""
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.datadir / "data"), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        """Stop it if running and delete its directory."""
        subprocess.run(["runuser", "-u", "postgres", "--", str(self.bin_dir / "pg_ctl"), "-D",
                        str(self.datadir / "data"), "-m", "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.datadir, ignore_errors=True)
