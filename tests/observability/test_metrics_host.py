"""A worker's metrics listen only on the configured host (loopback unless configured otherwise)."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from core.settings import Settings
from worker.metrics import serve_metrics


def test_metrics_host_defaults_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_METRICS_HOST", raising=False)
    assert Settings().metrics_host == "127.0.0.1"


def test_metrics_are_served_on_the_given_host_and_no_other_address() -> None:
    registry = CollectorRegistry()
    Counter("pagedserve_probe", "a series to find", registry=registry).inc()
    with socket.socket() as probe:  # a port free on every address, so only the bind address decides below
        probe.bind(("0.0.0.0", 0))
        port = probe.getsockname()[1]
    served = serve_metrics(port, "127.0.0.1", registry=registry)
    assert "pagedserve_probe_total 1.0" in urllib.request.urlopen(f"http://127.0.0.1:{served}/metrics").read().decode()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", served), timeout=5).close()  # still loopback, but not the bound host
