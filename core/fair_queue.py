"""Fair share between API keys inside a broker level: which queued job a worker runs next.

A run-job message in the broker is a ticket for one run at its level, not a promise of its own job: the
worker that takes it pops the next job here. Each level keeps one line per API key (ordered by priority,
then arrival) and serves the key served least recently, so a key with a backlog of thousands takes one
turn in each round while another key's single job waits for at most one turn of every key with work
waiting, not for the whole backlog. Levels still run strictly in order, as the broker delivers them.

Redis holds it (sorted sets, popped by a Lua script so two workers never take the same entry). The store
stays the source of truth: an entry for a job that is no longer queued is skipped by the claim, and the
reconciler puts back a queued job that has no entry (worker/reaper.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from core import streams

_ARRIVALS_PER_PRIORITY = 2**32  # a key's line orders by priority, then by arrival (a score below 2**53 stays exact)

# KEYS: the level's keys-waiting set, the key's line, the level's last-served stamps, the arrival counter
# ARGV: the API key, the job id, its score before the arrival number is added
_ADD = """
local arrival = redis.call('INCR', KEYS[4])
local added = redis.call('ZADD', KEYS[2], 'NX', string.format('%.0f', tonumber(ARGV[3]) + arrival), ARGV[2])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], redis.call('HGET', KEYS[3], ARGV[1]) or 0, ARGV[1])
end
return added
"""

# KEYS: the level's keys-waiting set, the level's last-served stamps, the serve counter
# ARGV: the prefix of the level's lines (the API key completes a line's name)
_POP = """
while true do
  local head = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #head == 0 then return false end
  local api_key, line = head[1], ARGV[1] .. head[1]
  local popped = redis.call('ZPOPMIN', line)
  if #popped > 0 then
    local stamp = redis.call('INCR', KEYS[3])
    redis.call('HSET', KEYS[2], api_key, stamp)
    if redis.call('ZCARD', line) == 0 then
      redis.call('ZREM', KEYS[1], api_key)
    else
      redis.call('ZADD', KEYS[1], stamp, api_key)
    end
    return popped[1]
  end
  redis.call('ZREM', KEYS[1], api_key)  -- a key listed with an empty line (its line was deleted): drop it
end
"""

# KEYS: the level's keys-waiting set, the key's line; ARGV: the API key, the job id
_REMOVE = """
local removed = redis.call('ZREM', KEYS[2], ARGV[2])
if removed == 1 and redis.call('ZCARD', KEYS[2]) == 0 then
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return removed
"""

# KEYS: the level's keys-waiting set; ARGV: the prefix of the level's lines
_COUNT = """
local total = 0
for _, api_key in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  total = total + redis.call('ZCARD', ARGV[1] .. api_key)
end
return total
"""


def _level_key(level: int, *parts: str) -> str:
    return streams.key("fair", str(level), *parts)


def _line_prefix(level: int) -> str:
    return _level_key(level, "line", "")


def _run(script: str, keys: list[str], args: list[Any]) -> Any:
    """Run one of the Lua scripts above (by its digest once Redis has it)."""
    return streams.redis_client().register_script(script)(keys=keys, args=args)


def add(level: int, api_key_id: str, job_id: str, priority_rank: int) -> bool:
    """Put a job at the end of its key's line at a level (after the key's jobs of lower or equal rank);
    False if it was already waiting there, where it keeps its place. `priority_rank` is 0 or more."""
    if priority_rank < 0:
        raise ValueError(f"priority_rank must be 0 or more, got {priority_rank}")
    keys = [_level_key(level, "keys"), _line_prefix(level) + api_key_id, _level_key(level, "served"),
            streams.key("fair", "arrivals")]
    return bool(_run(_ADD, keys, [api_key_id, job_id, priority_rank * _ARRIVALS_PER_PRIORITY]))


def pop(level: int) -> str | None:
    """Take the next job at a level: the first of the line of the key served least recently; None if none waits."""
    keys = [_level_key(level, "keys"), _level_key(level, "served"), streams.key("fair", "serves")]
    job_id = _run(_POP, keys, [_line_prefix(level)])
    return str(job_id) if job_id else None


def remove(level: int, api_key_id: str, job_id: str) -> bool:
    """Take a job out of its key's line at a level (a cancelled job: no message spends its key's turn on it);
    False if it was not waiting there. A key whose line empties leaves the level, keeping its last-served stamp."""
    return bool(_run(_REMOVE, [_level_key(level, "keys"), _line_prefix(level) + api_key_id], [api_key_id, job_id]))


def waiting_count(level: int) -> int:
    """How many entries wait at a level, over every key's line."""
    return int(_run(_COUNT, [_level_key(level, "keys")], [_line_prefix(level)]))


def waiting(entries: Iterable[tuple[int, str, str]]) -> set[str]:
    """The job ids among (level, API key id, job id) entries that wait in their key's line at that level, with the
    key listed among the level's keys (else no pop reaches the line)."""
    entries = list(entries)
    pipe = streams.redis_client().pipeline(transaction=False)
    for level, api_key_id, job_id in entries:
        pipe.zscore(_line_prefix(level) + api_key_id, job_id)
        pipe.zscore(_level_key(level, "keys"), api_key_id)
    scores = pipe.execute()
    return {job_id for (_, _, job_id), in_line, listed in zip(entries, scores[::2], scores[1::2])
            if in_line is not None and listed is not None}
