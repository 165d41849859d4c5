"""docker-compose.yml's worker: its healthcheck is the engine-liveness check, and its drain fits Docker's grace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def worker() -> dict[str, Any]:
    """The GPU worker service, anchors resolved."""
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["worker"]


def test_worker_healthcheck_runs_the_liveness_check(worker: dict[str, Any]) -> None:
    assert worker["healthcheck"]["test"] == ["CMD", "python3", "-m", "worker.heartbeat"]


def test_worker_drain_ends_before_docker_kills_the_worker(worker: dict[str, Any]) -> None:
    grace_s = float(worker["environment"]["PAGEDSERVE_SHUTDOWN_GRACE_S"].removeprefix("${PAGEDSERVE_SHUTDOWN_GRACE_S:-")
                    .removesuffix("}"))
    stop_grace_s = float(worker["stop_grace_period"].removesuffix("s"))
    assert grace_s + 10 <= stop_grace_s  # room to requeue what is still running and exit
