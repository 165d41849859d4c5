"""Webhook delivery: signed POSTs of {event, job}, retried with exponential backoff, every attempt recorded.

Each attempt is claimed in the database first (compare-and-set on `next_attempt_at`), so a duplicated
broker message cannot post twice; it connects only to the addresses that were checked, reads a bounded
response and finishes within one total deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from datetime import timedelta

import httpx
from sqlalchemy import or_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from core import queue
from core.db import session_factory
from core.job_payload import JobOut
from core.logging import log_event
from core.models import ApiKey, DeliveryStatus, WebhookAttempt, WebhookDelivery, utcnow
from core.settings import get_settings
from core.webhook_urls import WebhookTarget, resolve_webhook_url
from worker.webhook_metrics import record_webhook_attempt

logger = logging.getLogger("pagedserve.webhooks")
SIGNATURE_HEADER = "X-Pagedserve-Signature"
TIMESTAMP_HEADER = "X-Pagedserve-Timestamp"
DELIVERY_HEADER = "X-Pagedserve-Delivery"
EVENT_HEADER = "X-Pagedserve-Event"
MAX_RESPONSE_BYTES = 16 * 1024  # the status decides; the body is read only this far, then dropped
LEASE_MARGIN_S = 30.0  # an attempt's claim outlives its deadline by this much, for the store round trips


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header value: v1=<hex HMAC-SHA256 of "<timestamp>." + body>."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"v1={digest}"


def verify(secret: str, timestamp: str, body: bytes, signature: str, max_age_s: float = 300.0) -> bool:
    """Receiver side: whether a delivery's signature is valid and its timestamp recent."""
    fresh = abs(time.time() - float(timestamp)) <= max_age_s
    return fresh and hmac.compare_digest(sign(secret, timestamp, body), signature)


def backoff_s(num_attempts: int) -> float:
    """Delay before the next attempt after num_attempts failures: base × 2^(n-1)."""
    return get_settings().webhook_backoff_s * 2 ** (num_attempts - 1)


async def _read_bounded(response: httpx.Response) -> None:
    received = 0
    async for chunk in response.aiter_raw():
        received += len(chunk)
        if received >= MAX_RESPONSE_BYTES:
            return


async def _post_to_target(target: WebhookTarget, body: bytes, headers: dict[str, str]) -> int:
    # The URL's host is swapped for a checked address, so nothing resolves the name again (no DNS
    # rebinding); Host and TLS SNI (and so certificate checks) still name the original host. No proxy
    # from the environment either: a proxy would resolve the name itself.
    url = httpx.URL(target.url)
    headers = {**headers, "Host": url.netloc.decode("ascii")}
    refused = httpx.ConnectError(f"no address of {target.host!r} accepted the connection")
    async with httpx.AsyncClient(trust_env=False, timeout=get_settings().webhook_timeout_s) as client:
        for address in target.addresses:
            request = client.build_request("POST", url.copy_with(host=str(address)), content=body, headers=headers,
                                           extensions={"sni_hostname": target.host})
            try:
                response = await client.send(request, stream=True)
            except httpx.ConnectError as exc:
                refused = exc
                continue
            try:
                await _read_bounded(response)
            finally:
                await response.aclose()
            return response.status_code
    raise refused


async def _attempt(url: str, body: bytes, headers: dict[str, str]) -> int:
    settings = get_settings()
    async with asyncio.timeout(settings.webhook_timeout_s):  # the lookup, connect, send and response together
        target = await asyncio.to_thread(resolve_webhook_url, url, settings.webhook_allow_private)
        return await _post_to_target(target, body, headers)


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int | None, str | None]:
    """One attempt: (status code, None) on a 2xx, else (status code or None, what went wrong)."""
    try:
        status_code = asyncio.run(_attempt(url, body, headers))
    except TimeoutError:
        return None, f"no response within the {get_settings().webhook_timeout_s} s deadline"
    except (ValueError, httpx.HTTPError) as exc:
        return None, f"{exc.__class__.__name__}: {exc}"
    return status_code, None if 200 <= status_code < 300 else f"HTTP {status_code}"


def _claim(session: Session, delivery_id: str) -> bool:
    """Take the next attempt of a pending, due delivery: one compare-and-set, so exactly one claimer wins."""
    now = utcnow()
    lease = timedelta(seconds=get_settings().webhook_timeout_s + LEASE_MARGIN_S)
    result = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == DeliveryStatus.pending,
               or_(WebhookDelivery.next_attempt_at.is_(None), WebhookDelivery.next_attempt_at <= now))
        .values(next_attempt_at=now + lease)
    )
    session.commit()
    return result.rowcount == 1


def _signed_request(session: Session, delivery: WebhookDelivery) -> tuple[bytes, dict[str, str]]:
    """The body and headers of an attempt, signed with the secret of the API key that owns the job."""
    job = JobOut.model_validate(delivery.job).model_dump(mode="json")
    body = json.dumps({"event": delivery.event, "delivery_id": delivery.id, "job": job}).encode()
    owner = session.get(ApiKey, delivery.job.api_key_id)
    assert owner is not None  # jobs.api_key_id is a non-null foreign key
    timestamp = str(int(time.time()))
    return body, {
        "Content-Type": "application/json",
        "User-Agent": "pagedserve-webhooks/1",
        DELIVERY_HEADER: delivery.id,
        EVENT_HEADER: delivery.event,
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: sign(owner.webhook_secret, timestamp, body),
    }


def deliver(delivery_id: str) -> None:
    """Make one attempt of a pending delivery if it is due; schedule the next one or settle the delivery."""
    with session_factory()() as session:
        if not _claim(session, delivery_id):
            return  # settled, not due yet, or another copy of this message holds the attempt
        delivery = session.get(WebhookDelivery, delivery_id)
        if delivery is None or delivery.job is None:  # its job was deleted since the claim
            return
        body, headers = _signed_request(session, delivery)
        session.commit()  # hold no connection while waiting on the receiver
        started = time.monotonic()
        status_code, error = post(delivery.url, body, headers)
        delivery.num_attempts += 1
        session.add(WebhookAttempt(
            delivery_id=delivery.id, attempt_number=delivery.num_attempts, status_code=status_code,
            error=error, duration_ms=int((time.monotonic() - started) * 1000),
        ))
        if error is None:
            delivery.status, delivery.finished_at = DeliveryStatus.delivered, utcnow()
        elif delivery.num_attempts >= get_settings().webhook_max_attempts:
            delivery.status, delivery.finished_at = DeliveryStatus.failed, utcnow()
        else:
            delivery.next_attempt_at = utcnow() + timedelta(seconds=backoff_s(delivery.num_attempts))
        try:
            session.commit()
        except (StaleDataError, IntegrityError):  # its job was deleted (DELETE /v1/jobs/{id}) while this attempt ran
            session.rollback()
            log_event(logger, "webhook.delivery_deleted", delivery_id=delivery_id)
            return
        log_event(logger, "webhook.attempt", delivery_id=delivery.id, job_id=delivery.job_id,
                  attempt=delivery.num_attempts, status_code=status_code, outcome=delivery.status.value)
        record_webhook_attempt(delivery.status)
        if delivery.status is DeliveryStatus.pending:
            queue.enqueue_webhook(delivery.id, countdown_s=backoff_s(delivery.num_attempts))
