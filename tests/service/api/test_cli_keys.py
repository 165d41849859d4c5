"""`pagedserve keys create|list|revoke|rotate|update`, run as real processes against the module's real database."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from cli import migrate
from core.db import session_factory
from core.lifecycle import transition
from core.models import ApiKey, JobStatus
from core.settings import Settings
from tests.service.receiver import WebhookReceiver
from worker import webhooks

Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def pagedserve(service_settings: Settings) -> Cli:
    """Runs `pagedserve ARGS` in a child process on this module's database; returns the finished process."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        flags = ["--database-url", service_settings.resolved_database_url(),
                 "--data-dir", str(service_settings.data_dir)]
        return subprocess.run([sys.executable, "-m", "cli.main", *args, *flags], capture_output=True, text=True,
                              timeout=120)
    return run


def _create(pagedserve: Cli, name: str) -> tuple[dict[str, str], str]:
    """A new key's Authorization headers and webhook secret, from `keys create`'s two stdout lines."""
    created = pagedserve("keys", "create", "--name", name)
    assert created.returncode == 0, created.stderr
    token, secret = created.stdout.splitlines()
    return {"Authorization": f"Bearer {token}"}, secret


def _key_id(headers: dict[str, str]) -> str:
    lookup = headers["Authorization"].split("_")[1]
    with session_factory()() as session:
        return session.scalars(sa.select(ApiKey.id).where(ApiKey.lookup == lookup)).one()


def _delivered_signature(client: TestClient, headers: dict[str, str], receiver: WebhookReceiver) -> tuple[str, ...]:
    """Finish a new job of this key with a webhook, deliver it; the (timestamp, body, signature) received."""
    response = client.post("/v1/jobs", json={"prompt": "hook", "webhook_url": receiver.url}, headers=headers)
    assert response.status_code == 202, response.text
    with session_factory()() as session:
        transition(session, response.json()["id"], JobStatus.running, {JobStatus.queued})
        job = transition(session, response.json()["id"], JobStatus.succeeded, {JobStatus.running}, output=[])
        assert job is not None
        delivery_id = job.deliveries[0].id
    webhooks.deliver(delivery_id)
    request = receiver.received[-1]
    return request.headers["X-Pagedserve-Timestamp"], request.body.decode(), request.headers["X-Pagedserve-Signature"]


def _verifies(secret: str, delivered: tuple[str, ...]) -> bool:
    timestamp, body, signature = delivered
    return webhooks.verify(secret, timestamp, body.encode(), signature)


def test_create_shows_the_secret_that_signs_the_keys_webhooks_and_rotate_replaces_it(
    pagedserve: Cli, client: TestClient, webhook_receiver: WebhookReceiver
) -> None:
    headers, secret = _create(pagedserve, "tenant-a")
    _, other_secret = _create(pagedserve, "tenant-b")
    first = _delivered_signature(client, headers, webhook_receiver)
    assert _verifies(secret, first) and not _verifies(other_secret, first)
    rotated = pagedserve("keys", "rotate", _key_id(headers))
    assert rotated.returncode == 0, rotated.stderr
    new_secret = rotated.stdout.strip()
    after = _delivered_signature(client, headers, webhook_receiver)
    assert new_secret.startswith("whsec_") and _verifies(new_secret, after) and not _verifies(secret, after)
    assert client.get("/v1/jobs", headers=headers).status_code == 200  # the bearer token is unchanged


def test_rotate_with_token_replaces_the_bearer_token_and_the_key_keeps_its_jobs(
    pagedserve: Cli, client: TestClient
) -> None:
    old_headers, _ = _create(pagedserve, "leaked")
    job_id = client.post("/v1/jobs", json={"prompt": "mine"}, headers=old_headers).json()["id"]
    rotated = pagedserve("keys", "rotate", _key_id(old_headers), "--token")
    assert rotated.returncode == 0, rotated.stderr
    token, _ = rotated.stdout.splitlines()
    assert client.get("/v1/jobs", headers=old_headers).status_code == 401
    assert client.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_a_revoked_key_gets_401_and_is_listed_as_revoked(pagedserve: Cli, client: TestClient) -> None:
    headers, secret = _create(pagedserve, "to-revoke")
    key_id = _key_id(headers)
    assert client.get("/v1/jobs", headers=headers).status_code == 200
    revoked = pagedserve("keys", "revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    response = client.get("/v1/jobs", headers=headers)
    assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    (line,) = [line for line in pagedserve("keys", "list").stdout.splitlines() if line.startswith(key_id)]
    _, prefix, _, revoked_at, _, name = line.split("\t")
    assert name == "to-revoke" and revoked_at != "-" and prefix == f"psk_{headers['Authorization'].split('_')[1]}_..."
    again = pagedserve("keys", "rotate", key_id)
    assert again.returncode != 0 and f"key_id: API key {key_id} was revoked" in again.stderr


def test_list_shows_no_token_or_secret(pagedserve: Cli) -> None:
    headers, secret = _create(pagedserve, "quiet")
    listing = pagedserve("keys", "list")
    assert listing.returncode == 0 and _key_id(headers) in listing.stdout
    assert headers["Authorization"].split("_", 2)[2] not in listing.stdout and secret not in listing.stdout


def test_unknown_key_ids_are_refused_naming_the_argument(pagedserve: Cli) -> None:
    for command in ("revoke", "rotate"):
        refused = pagedserve("keys", command, "key_nope")
        assert refused.returncode != 0 and "key_id: no API key 'key_nope'" in refused.stderr


@pytest.mark.parametrize("name", ["", "evil\tname", "two\nlines", "x" * 129])
def test_a_key_name_that_would_break_the_listing_is_refused_naming_it(pagedserve: Cli, name: str) -> None:
    refused = pagedserve("keys", "create", "--name", name)
    assert refused.returncode == 2 and "--name" in refused.stderr and "Traceback" not in refused.stderr
    assert all("evil" not in line and "lines" not in line for line in pagedserve("keys", "list").stdout.splitlines())


def test_migrating_gives_keys_made_before_per_key_secrets_a_secret_of_their_own(service_settings: Settings) -> None:
    url = service_settings.resolved_database_url()
    migrate.downgrade(url, "0002")
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        for key_id in ("key_old1", "key_old2"):
            connection.execute(sa.text("INSERT INTO api_keys (id, name, lookup, key_hash, created_at) "
                                       "VALUES (:id, 'old', :id, 'x', CURRENT_TIMESTAMP)"), {"id": key_id})
    migrate.upgrade(url)
    with engine.connect() as connection:
        secrets = connection.execute(sa.text("SELECT webhook_secret FROM api_keys WHERE name = 'old'")).scalars().all()
    engine.dispose()
    assert len(set(secrets)) == 2 and all(secret.startswith("whsec_") for secret in secrets)


def test_an_operator_sets_a_keys_priority_floor_and_its_jobs_follow_it(pagedserve: Cli, client: TestClient) -> None:
    created = pagedserve("keys", "create", "--name", "trusted", "--priority-floor", "-300")
    assert created.returncode == 0, created.stderr
    headers = {"Authorization": f"Bearer {created.stdout.splitlines()[0]}"}
    key_id = _key_id(headers)

    def listed_floor() -> str:
        (line,) = [line for line in pagedserve("keys", "list").stdout.splitlines() if line.startswith(key_id)]
        return line.split("\t")[4]

    assert listed_floor() == "-300"
    assert client.post("/v1/jobs", json={"prompt": "x", "priority": -300}, headers=headers).status_code == 202
    demoted = pagedserve("keys", "update", key_id, "--priority-floor", "100")
    assert demoted.returncode == 0 and "priority floor is now 100" in demoted.stderr
    assert client.post("/v1/jobs", json={"prompt": "x", "priority": -300}, headers=headers).status_code == 403
    assert client.post("/v1/jobs", json={"prompt": "x"}, headers=headers).json()["priority"] == 100
    assert pagedserve("keys", "update", key_id, "--priority-floor", "default").returncode == 0
    assert listed_floor() == "-"
    for bad in ("1001", "urgent"):
        refused = pagedserve("keys", "update", key_id, "--priority-floor", bad)
        assert refused.returncode == 2 and "--priority-floor" in refused.stderr and bad in refused.stderr
    unknown = pagedserve("keys", "update", "key_nope", "--priority-floor", "0")
    assert unknown.returncode != 0 and "key_id: no API key 'key_nope'" in unknown.stderr
