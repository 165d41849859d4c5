"""One blocking XREAD for every job event stream an event loop follows, instead of one XREAD per follower.

The worker publishes every running job's tokens once per engine step. With one XREAD per follower, 16 streams in
flight cost 16 replies and 16 new commands a step, each through redis-py's asyncio client: about a third of the
API process's CPU while streaming (py-spy, 16 streams on 2 CPUs), and the API's CPU and wake-ups are taken from the
engine's threads wherever both share a host. One reader per event loop asks Redis for all the streams at once and
hands each follower the entries after its own position.

A follower that arrives while the reader is blocked in Redis wakes it through a stream of the reader's own, whose
last id the reader tracks, so that a wake-up sent before the blocked read reached Redis is seen too.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis

from core import streams

# the reader's wait when no stream has anything new (a new follower ends it early); a reader left without followers
# ends after it. redis-py does not always end a blocked read when its task is cancelled (seen with 8.2: the
# cancellation waited for the reply), so the reader is never cancelled, only left to see that nobody follows
BLOCK_MS = 1000
COUNT = 512  # entries per stream and read
RETRY_S = 0.5  # after Redis failed to answer: followers meanwhile see nothing and check the store
WAKE_TTL_S = 60

Entry = tuple[str, dict[str, Any]]


def _order(entry_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = entry_id.partition("-")
    return int(milliseconds), int(sequence or 0)


class Subscription:
    """One follower's place in one stream: the entries after ``last_id``, in order, as the reader hands them on."""

    def __init__(self, key: str, last_id: str) -> None:
        self.key = key
        self.last_id = last_id  # the last entry handed on: the follower's next read starts after it
        self._batches: asyncio.Queue[list[Entry]] = asyncio.Queue()

    def deliver(self, entries: list[Entry]) -> None:
        """Queue those of ``entries`` after this follower's position (another follower of the stream may be
        behind it, and the reader reads from the earliest position)."""
        after = _order(self.last_id)
        new = [entry for entry in entries if _order(entry[0]) > after]
        if new:
            self.last_id = new[-1][0]
            self._batches.put_nowait(new)

    async def next(self, block_ms: int) -> list[Entry]:
        """Every entry handed on since the last call, waiting up to ``block_ms`` for one; [] if none came."""
        if self._batches.empty():
            try:
                async with asyncio.timeout(block_ms / 1000):
                    entries = await self._batches.get()
            except TimeoutError:
                return []
        else:
            entries = self._batches.get_nowait()
        while not self._batches.empty():
            entries += self._batches.get_nowait()
        return entries


class _Reader:
    """A running read loop: its task, its Redis client and the stream that wakes it."""

    def __init__(self, followers: dict[str, set[Subscription]]) -> None:
        self.client = streams.async_redis_client()
        self.wake_key, self.wake_id = streams.key("api", "wake", uuid.uuid4().hex), "0-0"
        self.blocked = False  # in a read that does not know the newest followers
        self.stopped = False  # no follower was left after its last read: a new follower needs a new reader
        self.task = asyncio.create_task(self._run(followers))

    async def wake(self) -> None:
        """End the blocked read early, so that the next one takes in the followers that came meanwhile."""
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.wake_key, {"wake": "1"}, maxlen=1, approximate=False)
        pipe.expire(self.wake_key, WAKE_TTL_S)
        try:
            await pipe.execute()
        except redis.exceptions.RedisError:
            pass  # the blocked read fails on the same Redis, or ends within BLOCK_MS

    async def _run(self, followers: dict[str, set[Subscription]]) -> None:
        try:
            while followers:
                positions = {key: min((s.last_id for s in subscriptions), key=_order)
                             for key, subscriptions in followers.items()}
                positions[self.wake_key] = self.wake_id
                self.blocked = True
                try:
                    reply = await self.client.xread(positions, block=BLOCK_MS, count=COUNT)
                except redis.exceptions.TimeoutError:  # the event loop or Redis held up past the socket's timeout
                    continue
                except redis.exceptions.RedisError:  # Redis down or the connection lost: connect again shortly
                    await asyncio.sleep(RETRY_S)
                    continue
                finally:
                    self.blocked = False
                for key, entries in reply:
                    if key == self.wake_key:
                        self.wake_id = entries[-1][0]
                        continue
                    for subscription in list(followers.get(key, ())):
                        subscription.deliver(entries)
        finally:
            self.stopped = True
            await self.client.aclose()


class StreamFanIn:
    """The followers of one event loop, and the reader that runs while there are any (and up to BLOCK_MS more)."""

    def __init__(self) -> None:
        self._followers: dict[str, set[Subscription]] = {}
        self._reader: _Reader | None = None

    @asynccontextmanager
    async def subscribe(self, key: str, last_id: str = "0-0") -> AsyncIterator[Subscription]:
        """Follow the stream ``key`` after ``last_id`` for the duration of the block."""
        subscription = Subscription(key, last_id)
        self._followers.setdefault(key, set()).add(subscription)
        try:  # a follower cancelled while it wakes the reader is taken out too
            if self._reader is None or self._reader.stopped:
                self._reader = _Reader(self._followers)
            elif self._reader.blocked:
                await self._reader.wake()
            yield subscription
        finally:
            followers = self._followers[key]
            followers.discard(subscription)
            if not followers:
                del self._followers[key]


_fan_ins: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StreamFanIn] = weakref.WeakKeyDictionary()


def fan_in() -> StreamFanIn:
    """The running event loop's reader."""
    loop = asyncio.get_running_loop()
    if (reader := _fan_ins.get(loop)) is None:
        reader = _fan_ins[loop] = StreamFanIn()
    return reader
