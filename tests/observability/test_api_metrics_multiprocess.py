"""Several API processes: with PROMETHEUS_MULTIPROC_DIR, any one of them reports the sum of all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.observability.promtext import value

COUNT = "from api.metrics import HTTP_REQUEST_DURATION; from core.job_metrics import JOBS_SUBMITTED; " \
        "JOBS_SUBMITTED.inc({n}); HTTP_REQUEST_DURATION.labels('POST', '/v1/jobs', '202').observe(0.01)"
RENDER = "import sys; from api.metrics import render_metrics; sys.stdout.write(render_metrics()[0].decode())"


def _python(code: str, env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                          timeout=120).stdout


def test_one_process_reports_counters_of_all_api_processes(tmp_path: Path) -> None:
    multiproc_dir = tmp_path / "prometheus"
    multiproc_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir), "PAGEDSERVE_DATA_DIR": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).parents[2])}
    _python(COUNT.format(n=2), env)
    _python(COUNT.format(n=3), env)
    text = _python(RENDER, env)
    assert value(text, "pagedserve_jobs_submitted_total") == 5
    labels = {"method": "POST", "route": "/v1/jobs", "status_code": "202"}
    assert value(text, "pagedserve_http_request_duration_seconds_count", **labels) == 2
