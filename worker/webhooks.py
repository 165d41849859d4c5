"""Webhook delivery: signed POSTs of {event, job}, retried with exponential backoff, every attempt recorded."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time

import httpx

from api import queue
from api.db import session_factory
from api.errors import log_event
from api.metrics import record_webhook_attempt
from api.models import DeliveryStatus, WebhookAttempt, WebhookDelivery, utcnow
from api.schemas import JobOut
from api.settings import get_settings
from api.webhook_urls import check_webhook_url

logger = logging.getLogger("pagedserve.webhooks")
SIGNATURE_HEADER = "X-Pagedserve-Signature"
TIMESTAMP_HEADER = "X-Pagedserve-Timestamp"
DELIVERY_HEADER = "X-Pagedserve-Delivery"
EVENT_HEADER = "X-Pagedserve-Event"


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


def _post(delivery: WebhookDelivery, body: bytes) -> tuple[int | None, str | None]:
    settings = get_settings()
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "pagedserve-webhooks/1",
        DELIVERY_HEADER: delivery.id,
        EVENT_HEADER: delivery.event,
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: sign(settings.resolved_webhook_secret(), timestamp, body),
    }
    try:
        check_webhook_url(delivery.url, settings.webhook_allow_private)
        response = httpx.post(delivery.url, content=body, headers=headers, timeout=settings.webhook_timeout_s)
    except (ValueError, httpx.HTTPError) as exc:
        return None, f"{exc.__class__.__name__}: {exc}"
    return response.status_code, None if response.is_success else f"HTTP {response.status_code}"


def deliver(delivery_id: str) -> None:
    """Make one attempt of a pending delivery; schedule the next one or settle the delivery."""
    with session_factory()() as session:
        delivery = session.get(WebhookDelivery, delivery_id)
        if delivery is None or delivery.status is not DeliveryStatus.pending:
            return
        job = JobOut.model_validate(delivery.job).model_dump(mode="json")
        body = json.dumps({"event": delivery.event, "delivery_id": delivery.id, "job": job}).encode()
        started = time.monotonic()
        status_code, error = _post(delivery, body)
        delivery.num_attempts += 1
        session.add(WebhookAttempt(
            delivery_id=delivery.id, attempt_number=delivery.num_attempts, status_code=status_code,
            error=error, duration_ms=int((time.monotonic() - started) * 1000),
        ))
        if error is None:
            delivery.status, delivery.finished_at = DeliveryStatus.delivered, utcnow()
        elif delivery.num_attempts >= get_settings().webhook_max_attempts:
            delivery.status, delivery.finished_at = DeliveryStatus.failed, utcnow()
        session.commit()
        log_event(logger, "webhook.attempt", delivery_id=delivery.id, job_id=delivery.job_id,
                  attempt=delivery.num_attempts, status_code=status_code, outcome=delivery.status.value)
        record_webhook_attempt(delivery.status)
        if delivery.status is DeliveryStatus.pending:
            queue.enqueue_webhook(delivery.id, countdown_s=backoff_s(delivery.num_attempts))
