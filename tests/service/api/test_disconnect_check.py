"""A streaming response asks the server whether its client went away at most once per interval, not per chunk."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.types import Message

from api.disconnect_check import DisconnectCheck


class _Receive:
    """An ASGI receive channel that counts the server's answers and says `disconnected` once told to."""

    def __init__(self) -> None:
        self.calls = 0
        self.disconnected = False

    async def __call__(self) -> Message:
        self.calls += 1
        if self.disconnected:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # a connected client sends nothing more; the check polls without waiting
        raise AssertionError("unreachable")


def _request(receive: _Receive) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def test_the_server_is_asked_once_per_interval_and_a_disconnect_is_seen_at_the_next_ask() -> None:
    async def check() -> list[tuple[bool, int]]:
        receive = _Receive()
        disconnect = DisconnectCheck(_request(receive), interval_s=0.2)
        seen = [(await disconnect.gone(), receive.calls)]  # the first call asks
        for _ in range(100):  # chunks within the interval ask nothing
            seen.append((await disconnect.gone(), receive.calls))
        receive.disconnected = True
        seen.append((await disconnect.gone(), receive.calls))  # still within the interval
        await asyncio.sleep(0.25)
        seen.append((await disconnect.gone(), receive.calls))
        return seen

    seen = asyncio.run(check())
    assert seen[0] == (False, 1)
    assert all(answer == (False, 1) for answer in seen[1:-1])
    assert seen[-1] == (True, 2)
