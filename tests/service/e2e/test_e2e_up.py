"""`pagedserve up` on a fresh data directory: embedded SQLite and Redis, a job submitted with curl; a worker killed
under it is started again."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from core.embedded_redis import redis_reachable
from tests.service.procs import free_port, stop, wait_until


def _curl(*args: str) -> dict:
    result = subprocess.run(["curl", "-sS", "--fail-with-body", *args], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def _kill_worker(up_pid: int) -> None:
    """SIGKILL the worker process `up` started."""
    found = subprocess.run(["pgrep", "-P", str(up_pid), "-f", "cli.main worker"], capture_output=True, text=True)
    (pid,) = found.stdout.split()
    os.kill(int(pid), signal.SIGKILL)


def test_up_starts_everything_and_serves_a_curl_job(tiny_model_dir: Path, tmp_path: Path) -> None:
    port, redis_url = free_port(), f"redis://127.0.0.1:{free_port()}/0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")} | {
        "PAGEDSERVE_DATA_DIR": str(tmp_path / "data"), "PAGEDSERVE_REDIS_URL": redis_url,
        "PAGEDSERVE_PORT": str(port), "PAGEDSERVE_MODEL": str(tiny_model_dir), "PAGEDSERVE_DTYPE": "float32",
        "PAGEDSERVE_KV_CACHE_MEMORY": "32MiB", "PAGEDSERVE_SWAP_SPACE": "32MiB", "PAGEDSERVE_MAX_NUM_SEQS": "8",
    }
    log = tmp_path / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "cli.main", "up"], env=env, stdout=log.open("wb"),
                          stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "development API key: psk_" in log.read_text(), 60, "`up` to print its API key")
        assert redis_reachable(redis_url)
        key = re.search(r"development API key: (\S+)", log.read_text()).group(1)
        base, auth = f"http://127.0.0.1:{port}", f"Authorization: Bearer {key}"
        wait_until(lambda: b"ok" in subprocess.run(["curl", "-s", f"{base}/readyz"], capture_output=True).stdout,
                   60, "the API to be ready")
        job = _curl("-H", auth, "-H", "Content-Type: application/json",
                    "-d", '{"prompt": "Hello from curl", "max_tokens": 8}', f"{base}/v1/jobs")
        wait_until(lambda: _curl("-H", auth, f"{base}/v1/jobs/{job['id']}")["status"] == "succeeded", 120,
                   "the curl job to succeed")
        result = _curl("-H", auth, f"{base}/v1/jobs/{job['id']}")
        assert len(result["choices"][0]["token_ids"]) == 8
        assert (tmp_path / "data" / "pagedserve.db").exists()
        _kill_worker(up.pid)
        wait_until(lambda: "up.worker_restarted" in log.read_text(), 30, "`up` to start the worker again")
        assert _curl(f"{base}/healthz") and up.poll() is None  # the API served on throughout
        again = _curl("-H", auth, "-H", "Content-Type: application/json",
                      "-d", '{"prompt": "After the restart", "max_tokens": 4}', f"{base}/v1/jobs")
        wait_until(lambda: _curl("-H", auth, f"{base}/v1/jobs/{again['id']}")["status"] == "succeeded", 120,
                   "a job after the restart to succeed")
    finally:
        stop(up)
    assert not redis_reachable(redis_url)
