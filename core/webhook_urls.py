"""Webhook targets: an http(s) URL whose host is resolved once, every address checked, and only those used."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: the last 32 bits are the IPv4 address
LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215: a local translator, never a public host
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d


@dataclass(frozen=True, slots=True)
class WebhookTarget:
    """A checked webhook URL and the addresses its host resolved to: delivery connects only to these."""

    url: str
    host: str
    addresses: tuple[IPAddress, ...]


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries: IPv4-mapped, IPv4-compatible, NAT64, 6to4 and Teredo forms."""
    found = [address.ipv4_mapped, address.sixtofour, *(address.teredo or ())]
    if address in NAT64 or address in IPV4_COMPATIBLE:
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF))
    return [ipv4 for ipv4 in found if ipv4 is not None]


def is_public(address: IPAddress) -> bool:
    """Whether an address, and every IPv4 address embedded in it, is globally reachable."""
    if isinstance(address, ipaddress.IPv4Address):
        return address.is_global
    if address in LOCAL_NAT64:
        return False
    return address.is_global and all(ipv4.is_global for ipv4 in embedded_ipv4(address))


def resolve_webhook_url(url: str, allow_private: bool) -> WebhookTarget:
    """Resolve url's host once; raise ValueError unless it is http(s) and every address is public (or allowed)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"webhook_url must be an http or https URL, got scheme {parts.scheme!r}")
    if not parts.hostname:
        raise ValueError("webhook_url has no host")
    try:
        port = parts.port
    except ValueError:  # urllib's "Port out of range 0-65535", or not a number
        port = 0
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    elif port == 0:  # (0 is no port to deliver to)
        raise ValueError(f"webhook_url port must be a number in 1-65535, got {parts.netloc.rpartition(':')[2]!r}")
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        raise ValueError(f"webhook_url host {parts.hostname!r} does not resolve") from exc
    addresses = tuple(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos))
    for address in addresses:
        if not allow_private and not is_public(address):
            raise ValueError(f"webhook_url host {parts.hostname!r} resolves to non-public address {address}")
    return WebhookTarget(url=url, host=parts.hostname, addresses=addresses)


def check_webhook_url(url: str, allow_private: bool) -> None:
    """Raise ValueError unless url is http(s) and its host resolves only to public addresses (or private ones are
    allowed)."""
    resolve_webhook_url(url, allow_private)
