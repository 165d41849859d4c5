"""`pagedserve submit --wait` against the real app, store and Redis: it prints the job's text as it streams and says
when the job started over after a worker failure."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from cli import client as cli_client
from core import streams
from core.db import session_factory
from core.lifecycle import transition
from core.models import JobStatus
from core.settings import Settings
from tests.service.procs import wait_until


def _run_the_job_with_a_restart(client: TestClient, headers: dict[str, str]) -> None:
    """What a worker that died mid-job and the worker that ran it again publish, once `submit` has made the job."""
    listed: list[dict] = []
    wait_until(lambda: listed.extend(client.get("/v1/jobs", headers=headers).json()["data"]) or listed, 30,
               "submit to create its job")
    job_id = listed[0]["id"]
    redis = streams.redis_client()
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued})
    streams.publish_tokens(redis, {job_id: [{"index": 0, "text": "lost ", "token_ids": [1]}]})
    streams.publish_restart(redis, job_id, attempt=2)
    streams.publish_tokens(redis, {job_id: [{"index": 0, "text": "kept", "token_ids": [2]}]})
    output = [{"index": 0, "text": "kept", "token_ids": [2], "finish_reason": "length"}]
    with session_factory()() as session:
        transition(session, job_id, JobStatus.succeeded, {JobStatus.running}, output=output, completion_tokens=1)
    streams.publish_final(redis, job_id, "succeeded")


def test_submit_wait_says_when_the_job_started_over(
    service_settings: Settings, new_auth_headers: Callable[[str], dict[str, str]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    headers = new_auth_headers("submit-wait")
    app = create_app(service_settings)
    monkeypatch.setattr(cli_client, "_client", lambda _settings, _args: TestClient(app, headers=headers))
    worker = threading.Thread(target=_run_the_job_with_a_restart, args=(TestClient(app), headers))
    worker.start()
    args = argparse.Namespace(prompt="Hello", max_tokens=4, temperature=0.0, wait=True, api_key=None, api_url=None)
    cli_client.cmd_submit(service_settings, args)
    worker.join(timeout=30)
    out, err = capsys.readouterr()
    # the dead attempt's text if submit was following by then (a terminal cannot take it back); the notice either way,
    # since a follower that comes later reads the restart entry first
    assert out.splitlines()[0] in ("lost kept", "kept")
    assert "started over after a worker failure (attempt 2)" in err and '"text": "kept"' in err
