"""A webhook receiver verifies deliveries from the README's description alone (``hmac``, no pagedserve code):
genuine deliveries pass, and tampered bodies, stale timestamps and other keys' secrets are refused."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from api.auth import create_api_key
from core.db import session_factory
from core.lifecycle import transition
from core.models import JobStatus
from tests.service.receiver import Received, WebhookReceiver
from worker import webhooks

MAX_AGE_S = 300


def receiver_accepts(secret: str, headers: dict[str, str], body: bytes, now: float) -> bool:
    """The README's check: ``X-Pagedserve-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>." + body)>``,
    the key being the whole ``whsec_...`` string as UTF-8, with a timestamp at most five minutes old."""
    timestamp = headers["x-pagedserve-timestamp"]
    scheme, _, signature = headers["x-pagedserve-signature"].partition("=")
    expected = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return scheme == "v1" and abs(now - int(timestamp)) <= MAX_AGE_S and hmac.compare_digest(expected, signature)


@dataclass
class Delivered:
    """A delivery as its receiver got it, and the secret of the key that made the job."""

    secret: str
    headers: dict[str, str]
    body: bytes


@pytest.fixture
def deliver_one(client: TestClient, webhook_receiver: WebhookReceiver) -> Callable[[], Delivered]:
    """Makes a key, finishes a job of it with a webhook to the receiver, delivers it, returns what arrived."""

    def deliver() -> Delivered:
        with session_factory()() as session:
            key, token = create_api_key(session, "receiver-test")
            secret = key.webhook_secret
        body = {"prompt": "hook me", "webhook_url": webhook_receiver.url}
        response = client.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}"})
        assert response.status_code == 202, response.text
        with session_factory()() as session:
            transition(session, response.json()["id"], JobStatus.running, {JobStatus.queued})
            job = transition(session, response.json()["id"], JobStatus.succeeded, {JobStatus.running},
                             output=[], completion_tokens=0)
            delivery_id = job.deliveries[0].id
        webhooks.deliver(delivery_id)
        received: Received = webhook_receiver.received[-1]
        return Delivered(secret, {name.lower(): value for name, value in received.headers.items()}, received.body)

    return deliver


def test_a_genuine_delivery_verifies_and_carries_what_its_headers_say(deliver_one: Callable[[], Delivered]) -> None:
    delivered = deliver_one()
    assert delivered.secret.startswith("whsec_")
    assert receiver_accepts(delivered.secret, delivered.headers, delivered.body, now=time.time())
    payload = json.loads(delivered.body)
    assert payload["delivery_id"] == delivered.headers["x-pagedserve-delivery"]
    assert payload["event"] == delivered.headers["x-pagedserve-event"]
    assert payload["job"]["status"] == "succeeded"


def test_a_tampered_body_is_refused(deliver_one: Callable[[], Delivered]) -> None:
    delivered = deliver_one()
    tampered = delivered.body.replace(b'"succeeded"', b'"failed"')
    assert tampered != delivered.body
    assert not receiver_accepts(delivered.secret, delivered.headers, tampered, now=time.time())


def test_a_stale_timestamp_is_refused(deliver_one: Callable[[], Delivered]) -> None:
    delivered = deliver_one()
    sent_at = int(delivered.headers["x-pagedserve-timestamp"])
    assert receiver_accepts(delivered.secret, delivered.headers, delivered.body, now=sent_at + MAX_AGE_S)
    assert not receiver_accepts(delivered.secret, delivered.headers, delivered.body, now=sent_at + MAX_AGE_S + 1)


def test_another_keys_secret_does_not_verify(deliver_one: Callable[[], Delivered]) -> None:
    first, second = deliver_one(), deliver_one()
    assert first.secret != second.secret
    assert not receiver_accepts(second.secret, first.headers, first.body, now=time.time())


def test_the_shipped_verify_helper_agrees_with_the_readme_check(deliver_one: Callable[[], Delivered]) -> None:
    delivered = deliver_one()
    timestamp, signature = delivered.headers["x-pagedserve-timestamp"], delivered.headers["x-pagedserve-signature"]
    assert webhooks.verify(delivered.secret, timestamp, delivered.body, signature)
    assert not webhooks.verify(delivered.secret, timestamp, delivered.body + b" ", signature)
    stale = str(int(timestamp) - MAX_AGE_S - 60)  # correctly signed, only too old
    resigned = hmac.new(delivered.secret.encode(), f"{stale}.".encode() + delivered.body, hashlib.sha256).hexdigest()
    assert not webhooks.verify(delivered.secret, stale, delivered.body, f"v1={resigned}")
