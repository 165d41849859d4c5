"""The API's followers of job streams share one blocking XREAD per event loop, each served from its own position."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest

from api.stream_fanin import BLOCK_MS, Subscription, fan_in
from core import streams
from core.settings import Settings

FOLLOWERS = 16
STEPS = 20


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """No store is read here: Redis alone."""
    return sqlite_url


def _run(test: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(test(), timeout=60))


def _publish(entries: dict[str, str]) -> dict[str, str]:
    """One entry on each stream (key: text), in one round trip as the worker publishes a step; their ids."""
    pipe = streams.redis_client().pipeline(transaction=False)
    for stream_key, text in entries.items():
        pipe.xadd(stream_key, {"type": "token", "data": text})
    return dict(zip(entries, pipe.execute(), strict=True))


async def _texts(subscription: Subscription, count: int) -> list[str]:
    texts: list[str] = []
    while len(texts) < count:
        entries = await subscription.next(10_000)
        assert entries, f"{subscription.key}: nothing after {texts}"
        texts += [fields["data"] for _, fields in entries]
    return texts


def _xread_calls() -> int:
    return int(streams.redis_client().info("commandstats").get("cmdstat_xread", {}).get("calls", 0))


def test_every_follower_gets_its_own_entries_from_one_read_a_step(service_settings: Settings) -> None:
    keys = [streams.key("fanin", "many", str(i)) for i in range(FOLLOWERS)]

    async def follow_all() -> tuple[list[list[str]], int]:
        async with AsyncExitStack() as stack:
            subscriptions = [await stack.enter_async_context(fan_in().subscribe(key)) for key in keys]
            await asyncio.sleep(0.2)  # the reader is blocked in Redis
            calls_before = await asyncio.to_thread(_xread_calls)
            received: list[list[str]] = [[] for _ in keys]
            for step in range(STEPS):
                await asyncio.to_thread(_publish, {key: f"{key}/{step}" for key in keys})
                for texts, subscription in zip(received, subscriptions, strict=True):
                    texts += await _texts(subscription, 1)
            return received, await asyncio.to_thread(_xread_calls) - calls_before

    received, reads = _run(follow_all)
    assert received == [[f"{key}/{step}" for step in range(STEPS)] for key in keys]
    # Redis answers a blocked XREAD with the stream that woke it alone, so a step takes two reads (the first stream,
    # then the other 15); a read per follower would be 320
    assert reads <= 2 * STEPS + 2, reads


def test_followers_of_one_stream_each_start_after_their_own_position(service_settings: Settings) -> None:
    key = streams.key("fanin", "shared")
    ids = [_publish({key: f"entry {i}"})[key] for i in range(3)]

    async def follow_twice() -> tuple[list[str], list[str]]:
        async with fan_in().subscribe(key) as whole, fan_in().subscribe(key, ids[1]) as resumed:
            whole_texts, resumed_texts = await _texts(whole, 3), await _texts(resumed, 1)
            await asyncio.to_thread(_publish, {key: "entry 3"})  # new to both
            return whole_texts + await _texts(whole, 1), resumed_texts + await _texts(resumed, 1)

    whole, resumed = _run(follow_twice)
    assert whole == ["entry 0", "entry 1", "entry 2", "entry 3"]
    assert resumed == ["entry 2", "entry 3"]


def test_a_follower_arriving_while_the_reader_is_blocked_is_served_without_waiting_out_the_block(
    service_settings: Settings
) -> None:
    first, second = streams.key("fanin", "first"), streams.key("fanin", "second")

    async def arrive_late() -> list[Any]:
        async with fan_in().subscribe(first):
            await asyncio.sleep(0.3)  # the reader is blocked on the first stream alone, for BLOCK_MS
            async with fan_in().subscribe(second) as late:
                await asyncio.to_thread(_publish, {second: "late"})
                # well within the reader's block: only a wake-up lets it read the second stream this soon
                return await late.next(BLOCK_MS // 2)

    entries = _run(arrive_late)
    assert [fields["data"] for _, fields in entries] == ["late"]


def test_the_reader_stops_after_its_last_follower_and_a_new_follower_starts_another(
    service_settings: Settings
) -> None:
    key = streams.key("fanin", "again")

    def readers() -> list[asyncio.Task[Any]]:
        return [task for task in asyncio.all_tasks() if task.get_coro().__qualname__ == "_Reader._run"]

    async def follow_one_after_another() -> list[str]:
        texts = []
        for round_ in range(2):
            async with fan_in().subscribe(key) as subscription:
                await asyncio.to_thread(_publish, {key: f"round {round_}"})
                texts += await _texts(subscription, round_ + 1)
            for _ in range(50):  # it ends once a read finds nobody following: within BLOCK_MS
                if not readers():
                    break
                await asyncio.sleep(0.1)
            assert not readers(), "a reader outlived its last follower"
        return texts

    assert _run(follow_one_after_another) == ["round 0", "round 0", "round 1"]


def test_a_follower_sees_nothing_for_its_wait_when_nothing_comes(service_settings: Settings) -> None:
    async def wait_idle() -> list[Any]:
        async with fan_in().subscribe(streams.key("fanin", "idle")) as subscription:
            return await subscription.next(200)

    assert _run(wait_idle) == []
