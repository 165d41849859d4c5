"""Migrations step down and back up one revision at a time with data in the tables, and `pagedserve migrate
--revision` stops at the revision it names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from alembic.script import ScriptDirectory
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, inspect, text

from api.app import create_app
from cli import migrate
from core.db import session_factory
from core.lifecycle import transition
from core.models import JobStatus
from core.settings import Settings


def _revisions_oldest_first(url: str) -> list[str]:
    script = ScriptDirectory.from_config(migrate.alembic_config(url))
    return [revision.revision for revision in reversed(list(script.walk_revisions()))]


def _current(url: str) -> tuple[str | None, set[str], int]:
    """The store's revision, its tables, and how many jobs it holds."""
    engine = create_engine(url)
    try:
        tables = set(inspect(engine).get_table_names())
        with engine.connect() as connection:
            revision = connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
            jobs = connection.execute(text("SELECT count(*) FROM jobs")).scalar_one() if "jobs" in tables else 0
        return revision, tables - {"alembic_version"}, jobs
    finally:
        engine.dispose()


def test_each_revision_steps_down_and_up_with_jobs_keys_and_deliveries_in_the_store(
    service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    url = service_settings.resolved_database_url()
    client = TestClient(create_app(service_settings))
    body = {"prompt": "keep me", "webhook_url": "http://127.0.0.1:9/hook"}
    job_ids = [client.post("/v1/jobs", json=body, headers=auth_headers).json()["id"] for _ in range(3)]
    with session_factory()() as session:  # a finished job has a webhook delivery row too
        transition(session, job_ids[0], JobStatus.running, {JobStatus.queued})
        transition(session, job_ids[0], JobStatus.succeeded, {JobStatus.running}, output=[], completion_tokens=0)
    session_factory().kw["bind"].dispose()  # no pooled connection may hold a lock the DDL waits for
    revisions = _revisions_oldest_first(url)
    for expected in reversed(revisions[:-1]):  # head-1 down to the first revision, one step at a time
        migrate.downgrade(url, "-1")
        revision, tables, jobs = _current(url)
        assert (revision, jobs) == (expected, 3)
        assert {"api_keys", "jobs", "webhook_deliveries"} <= tables
    for expected in revisions[1:]:
        migrate.upgrade(url, "+1")
        assert _current(url)[0::2] == (expected, 3)
    job = client.get(f"/v1/jobs/{job_ids[0]}", headers=auth_headers).json()
    assert job["status"] == "succeeded"


def test_cli_migrate_stops_at_the_named_revision_and_names_an_unknown_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    first = _revisions_oldest_first(url)[0]

    def pagedserve_migrate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli.main", "migrate", *args, "--database-url", url],
                              capture_output=True, text=True, timeout=120)

    stepped = pagedserve_migrate("--revision", first)
    assert stepped.returncode == 0, stepped.stderr
    assert stepped.stdout.strip() == f"job store at revision {first}"
    assert _current(url)[:2] == (first, {"api_keys", "jobs", "webhook_deliveries", "webhook_attempts"})
    unknown = pagedserve_migrate("--revision", "9999")
    assert unknown.returncode != 0 and "Traceback" not in unknown.stderr
    expected = "pagedserve migrate: --revision 9999: Can't locate revision identified by '9999'"
    assert unknown.stderr.splitlines()[-1] == expected
    assert pagedserve_migrate().returncode == 0
    assert _current(url)[0] == _revisions_oldest_first(url)[-1]
