"""Checks that a webhook target is an http(s) URL that does not point into private networks."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


def check_webhook_url(url: str, allow_private: bool) -> None:
    """Raise ValueError unless url is http(s) and its host resolves only to public addresses (or private are allowed)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"webhook_url must be an http or https URL, got scheme {parts.scheme!r}")
    if not parts.hostname:
        raise ValueError("webhook_url has no host")
    if allow_private:
        return
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 443, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"webhook_url host {parts.hostname!r} does not resolve") from exc
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not address.is_global:
            raise ValueError(f"webhook_url host {parts.hostname!r} resolves to non-public address {address}")
