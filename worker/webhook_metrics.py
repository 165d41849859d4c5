"""The webhook delivery counter: a worker makes every attempt, so only workers count them."""

from __future__ import annotations

from prometheus_client import Counter

from core.models import DeliveryStatus

WEBHOOK_DELIVERIES = Counter(
    "pagedserve_webhook_deliveries_total", "webhook delivery attempts by outcome (delivered, retrying, failed)",
    ["outcome"],
)
_OUTCOMES = {DeliveryStatus.delivered: "delivered", DeliveryStatus.pending: "retrying", DeliveryStatus.failed: "failed"}
for _outcome in _OUTCOMES.values():
    WEBHOOK_DELIVERIES.labels(_outcome)


def record_webhook_attempt(status_after: DeliveryStatus) -> None:
    """Count one delivery attempt by what it left the delivery as."""
    WEBHOOK_DELIVERIES.labels(_OUTCOMES[status_after]).inc()
