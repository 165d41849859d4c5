"""vLLM's --api-key: tokens the operator chooses, each a key of its own, accepted only while the server has them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_app
from api.auth import hash_key
from core.db import session_factory
from core.models import ApiKey
from core.settings import Settings, configure

ALICE, BOB = "alice-token, with a comma", "bob-token"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def chosen(service_settings: Settings) -> Iterator[TestClient]:
    """A client of an API started with --api-key ALICE BOB; the module's settings come back afterwards."""
    with TestClient(create_app(service_settings.model_copy(update={"api_key": [ALICE, BOB]}))) as client:
        yield client
    configure(service_settings)


def _chosen_row(token: str) -> ApiKey:
    with session_factory()() as session:
        return session.scalars(sa.select(ApiKey).where(ApiKey.key_hash == hash_key(token))).one()


def _keys_cli(service_settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    flags = ["--database-url", service_settings.resolved_database_url(), "--data-dir", str(service_settings.data_dir)]
    return subprocess.run([sys.executable, "-m", "cli.main", "keys", *args, *flags], capture_output=True, text=True,
                          timeout=120)


def test_each_chosen_token_is_a_key_of_its_own(chosen: TestClient, auth_headers: dict[str, str]) -> None:
    mine = chosen.post("/v1/jobs", json={"prompt": "alice's"}, headers=_bearer(ALICE))
    assert mine.status_code == 202, mine.text
    job_id = mine.json()["id"]
    assert chosen.get(f"/v1/jobs/{job_id}", headers=_bearer(ALICE)).status_code == 200
    assert chosen.get(f"/v1/jobs/{job_id}", headers=_bearer(BOB)).status_code == 404
    assert job_id not in {job["id"] for job in chosen.get("/v1/jobs", headers=_bearer(BOB)).json()["data"]}
    assert chosen.get("/v1/jobs", headers=auth_headers).status_code == 200  # stored keys keep working beside them
    assert chosen.get("/v1/jobs", headers=_bearer("carol-token")).status_code == 401
    assert chosen.get("/v1/jobs", headers=_bearer(ALICE[:-1])).status_code == 401
    with session_factory()() as session:  # one row per token however often it is used, storing only its hash
        rows = session.scalars(sa.select(ApiKey).where(ApiKey.key_hash == hash_key(ALICE))).all()
        assert len(rows) == 1 and ALICE not in (rows[0].lookup, rows[0].name)


def test_a_token_no_longer_given_stops_working(service_settings: Settings, chosen: TestClient) -> None:
    assert chosen.get("/v1/models", headers=_bearer(BOB)).status_code == 200
    with TestClient(create_app(service_settings.model_copy(update={"api_key": [ALICE]}))) as restarted:
        assert restarted.get("/v1/models", headers=_bearer(BOB)).status_code == 401
        assert restarted.get("/v1/models", headers=_bearer(ALICE)).status_code == 200


def test_a_revoked_chosen_key_stays_revoked_and_keeps_its_token(
    service_settings: Settings, chosen: TestClient
) -> None:
    assert chosen.get("/v1/jobs", headers=_bearer(BOB)).status_code == 200
    key_id = _chosen_row(BOB).id
    listing = _keys_cli(service_settings, "list")
    assert f"{key_id}\t(--api-key {hash_key(BOB)[:8]})\t" in listing.stdout and BOB not in listing.stdout
    rotated = _keys_cli(service_settings, "rotate", key_id, "--token")
    assert rotated.returncode != 0 and "given with --api-key" in rotated.stderr
    assert _keys_cli(service_settings, "revoke", key_id).returncode == 0
    assert chosen.get("/v1/jobs", headers=_bearer(BOB)).status_code == 401


def test_a_chosen_token_shaped_like_a_stored_one_is_still_its_own_key(
    service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    stored = auth_headers["Authorization"].removeprefix("Bearer ")
    lookalike = stored[:-4] + "XXXX"  # a stored key's lookup, another secret
    update = {"api_key": [lookalike]}
    try:
        with TestClient(create_app(service_settings.model_copy(update=update))) as client:
            assert client.get("/v1/jobs", headers=_bearer(lookalike)).status_code == 200
            assert client.get("/v1/jobs", headers=auth_headers).status_code == 200
    finally:
        configure(service_settings)
    assert _chosen_row(lookalike).lookup.startswith("=")
