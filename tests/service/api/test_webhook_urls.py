"""Webhook targets: private addresses are refused in every IPv6 form that embeds them; public ones pass."""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Any

import pytest

from core.webhook_urls import resolve_webhook_url

EMBEDDED_PRIVATE = {
    "NAT64 of loopback": "64:ff9b::7f00:1",
    "NAT64 of 10/8": "64:ff9b::a00:1",
    "local-use NAT64": "64:ff9b:1::808:808",
    "6to4 of loopback": "2002:7f00:1::1",
    "6to4 of 192.168/16": "2002:c0a8:101::1",
    "IPv4-compatible loopback": "::7f00:1",
    "IPv4-compatible link-local": "::a9fe:a9fe",
    "IPv4-mapped loopback": "::ffff:127.0.0.1",
    "IPv4-mapped 172.16/12": "::ffff:172.16.0.1",
    "Teredo": "2001:0:4136:e378:8000:63bf:3fff:fdd2",
}
EMBEDDED_PUBLIC = {"NAT64 of 8.8.8.8": "64:ff9b::808:808", "6to4 of 8.8.8.8": "2002:808:808::1"}


@pytest.mark.parametrize("address", EMBEDDED_PRIVATE.values(), ids=EMBEDDED_PRIVATE.keys())
def test_ipv6_forms_of_private_addresses_are_refused(address: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"non-public address {ipaddress.ip_address(address)}")):
        resolve_webhook_url(f"http://[{address}]:8080/hook", allow_private=False)


@pytest.mark.parametrize("address", EMBEDDED_PUBLIC.values(), ids=EMBEDDED_PUBLIC.keys())
def test_ipv6_forms_of_public_addresses_pass(address: str) -> None:
    target = resolve_webhook_url(f"https://[{address}]/hook", allow_private=False)
    assert [str(a) for a in target.addresses] == [address]


def test_a_name_is_refused_when_any_of_its_addresses_is_private(monkeypatch: pytest.MonkeyPatch) -> None:
    def resolves_to_two(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in ("8.8.8.8", "10.0.0.7")]

    monkeypatch.setattr(socket, "getaddrinfo", resolves_to_two)
    with pytest.raises(ValueError, match="'hooks.example' resolves to non-public address 10.0.0.7"):
        resolve_webhook_url("https://hooks.example/hook", allow_private=False)
