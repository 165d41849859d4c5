"""`pagedserve submit` and `pagedserve submit-file` as real processes against a live API and worker."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """The commands only talk HTTP: SQLite is enough."""
    return sqlite_url


@pytest.fixture(scope="module")
def pagedserve(live_api: str, auth_headers: dict[str, str]) -> Cli:
    """Runs `pagedserve ARGS --api-url LIVE --api-key KEY` and returns the finished process."""
    token = auth_headers["Authorization"].removeprefix("Bearer ")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli.main", *args, "--api-url", live_api, "--api-key", token],
                              capture_output=True, text=True, timeout=300)

    return run


def test_submit_prints_the_queued_job(pagedserve: Cli) -> None:
    submitted = pagedserve("submit", "The quick brown fox", "--max-tokens", "3")
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(submitted.stdout)
    assert job["id"].startswith("job_") and job["prompt"] == "The quick brown fox"
    assert job["params"]["max_tokens"] == 3 and job["status"] in {"queued", "running", "succeeded"}


def test_submit_wait_streams_the_text_then_reports_the_final_job(pagedserve: Cli) -> None:
    submitted = pagedserve("submit", "Once upon a time", "--wait", "--max-tokens", "6")
    assert submitted.returncode == 0, submitted.stderr
    final = json.loads(submitted.stderr[submitted.stderr.index("{"):])
    assert final["status"] == "succeeded" and final["completion_tokens"] == len(final["choices"][0]["token_ids"])
    assert submitted.stdout == final["text"] + "\n"


def test_submit_file_writes_every_final_job_in_order(pagedserve: Cli, tmp_path: Path) -> None:
    prompts = ["First prompt", "Second prompt", "Third prompt"]
    jobs_file, results_file = tmp_path / "jobs.jsonl", tmp_path / "results.jsonl"
    jobs_file.write_text("".join(json.dumps({"prompt": p, "max_tokens": 2}) + "\n" for p in prompts) + "\n")
    submitted = pagedserve("submit-file", str(jobs_file), "--output", str(results_file))
    assert submitted.returncode == 0, submitted.stderr
    results = [json.loads(line) for line in results_file.read_text().splitlines()]
    assert [job["prompt"] for job in results] == prompts
    assert {job["status"] for job in results} == {"succeeded"}


def test_submit_file_with_a_bad_job_exits_with_the_apis_error(pagedserve: Cli, tmp_path: Path) -> None:
    jobs_file = tmp_path / "bad.jsonl"
    jobs_file.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + json.dumps({"prompt": "x", "max_tokens": 0}) + "\n")
    submitted = pagedserve("submit-file", str(jobs_file))
    assert submitted.returncode != 0 and "Traceback" not in submitted.stderr
    assert "line 3 was refused (max_tokens)" in submitted.stderr  # the file's line, a blank one counted
    assert "must be at least 1" in submitted.stderr or "greater than or equal to 1" in submitted.stderr
