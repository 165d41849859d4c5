"""`pagedserve submit-file` against live API and worker processes: rate-limited, interrupted, resumed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.client import retry_delay_s
from core.settings import Settings
from tests.service.procs import wait_until

NUM_LINES = 250


@pytest.fixture(scope="module")
def database_url(postgresql_url: str) -> str:
    """PostgreSQL only: one service start-up for the module."""
    return postgresql_url


@pytest.fixture(scope="module")
def service_settings(service_settings: Settings) -> Settings:
    """The module's settings with one request per second per key, so the client meets 429s all along."""
    return service_settings.model_copy(update={"rate_limit_per_s": 1})


Headers = Callable[[str], dict[str, str]]


def _submit_file(
    live_api: str, headers: dict[str, str], tmp_path: Path, lines: list[dict[str, Any]]
) -> subprocess.CompletedProcess[str]:
    """Run `pagedserve submit-file` on these lines with a state file in tmp_path."""
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "cli.main", "submit-file", str(path), "--api-url", live_api,
               "--api-key", headers["Authorization"].removeprefix("Bearer "),
               "--state", str(tmp_path / "state.json"), "--output", str(tmp_path / "results.jsonl")]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_an_interrupted_submission_resumes_without_resubmitting_and_rides_out_429s(
    live_api: str, new_auth_headers: Headers, tmp_path: Path
) -> None:
    headers = new_auth_headers("submit-file")
    lines = [{"prompt": f"line {i}", "max_tokens": 1} for i in range(NUM_LINES)]
    lines[149]["max_tokens"] = 0  # the second chunk is refused whole: the first stays accepted
    first = _submit_file(live_api, headers, tmp_path, lines)
    assert first.returncode != 0 and "Traceback" not in first.stderr
    assert "line 150 was refused (max_tokens)" in first.stderr and "lines 101 on were not submitted" in first.stderr
    accepted = json.loads((tmp_path / "state.json").read_text())["job_ids"]
    assert len(accepted) == 100
    lines[149]["max_tokens"] = 1
    second = _submit_file(live_api, headers, tmp_path, lines)
    assert second.returncode == 0, second.stderr
    assert f"resuming: 100 of {NUM_LINES} lines" in second.stderr
    assert "HTTP 429; retrying in 1 s" in first.stderr + second.stderr
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in results] == [line["prompt"] for line in lines]
    assert [r["id"] for r in results[:100]] == accepted and {r["status"] for r in results} == {"succeeded"}
    listing: list[httpx.Response] = []  # the key is limited to 1 request/s: wait out a 429 of our own
    wait_until(lambda: listing.append(httpx.get(f"{live_api}/v1/jobs", params={"limit": 500}, headers=headers))
               or listing[-1].status_code == 200, 30, "the key's job list past the rate limit")
    assert len(listing[-1].json()["data"]) == NUM_LINES  # nothing was submitted twice


def test_a_state_file_of_another_input_is_refused(live_api: str, new_auth_headers: Headers, tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text(json.dumps({"prefix_sha256": "0" * 64, "job_ids": ["job_x"]}))
    run = _submit_file(live_api, new_auth_headers("other-state"), tmp_path, [{"prompt": "hi", "max_tokens": 1}])
    assert run.returncode != 0 and "are not the first lines of this file" in run.stderr


@pytest.mark.parametrize(("header", "expected_s"), [("3", 3.0), ("0.5", 0.5), (None, 2.0), ("soon", 2.0)])
def test_retry_after_seconds_are_honoured_else_backoff_doubles(header: str | None, expected_s: float) -> None:
    response = httpx.Response(429, headers={"Retry-After": header} if header else {})
    assert retry_delay_s(response, attempt=2) == expected_s


def test_retry_after_as_an_http_date_waits_until_then() -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25 < retry_delay_s(httpx.Response(503, headers={"Retry-After": when}), attempt=0) <= 30


def test_unreadable_input_or_output_fails_in_one_line_before_anything_is_submitted(
    live_api: str, new_auth_headers: Headers, tmp_path: Path
) -> None:
    headers = new_auth_headers("bad-paths")
    token = headers["Authorization"].removeprefix("Bearer ")
    jobs_file = tmp_path / "jobs.jsonl"
    jobs_file.write_text(json.dumps({"prompt": "hi", "max_tokens": 1}) + "\n")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    for path, output, blamed in ((jobs_file, tmp_path / "missing" / "out.jsonl", "--output"),
                                 (jobs_file, jobs_file, "is the input file"),
                                 (tmp_path / "absent.jsonl", tmp_path / "out.jsonl", "absent.jsonl"),
                                 (tmp_path, tmp_path / "out.jsonl", str(tmp_path)),
                                 (tmp_path / "latin1.jsonl", tmp_path / "out.jsonl", "UTF-8")):
        run = subprocess.run([sys.executable, "-m", "cli.main", "submit-file", str(path), "--api-url", live_api,
                              "--api-key", token, "--output", str(output)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 1 and blamed in run.stderr and "Traceback" not in run.stderr, run.stderr
    listing = httpx.get(f"{live_api}/v1/jobs", headers=headers)
    assert listing.status_code == 200 and listing.json()["data"] == []
    assert json.loads(jobs_file.read_text()) == {"prompt": "hi", "max_tokens": 1}  # the input is left whole
