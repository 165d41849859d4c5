"""Server-sent events: tokens from the job's Redis stream as they come, then the final job."""

from __future__ import annotations

import json
import threading

from fastapi.testclient import TestClient

from core import streams
from core.db import session_factory
from core.lifecycle import transition
from core.models import JobStatus
from core.settings import Settings


def _parse(body: str) -> list[tuple[str, dict]]:
    events = []
    for block in body.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if "event" in fields:
            events.append((fields["event"], json.loads(fields["data"])))
    return events


def _start(job_id: str) -> None:
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued})


def _publish(job_id: str, pieces: list[tuple[str, list[int]]]) -> None:
    for text, ids in pieces:
        streams.publish_tokens(streams.redis_client(), {job_id: [{"index": 0, "text": text, "token_ids": ids}]})


def _succeed(job_id: str, pieces: list[tuple[str, list[int]]]) -> None:
    output = [{"index": 0, "text": "".join(t for t, _ in pieces), "token_ids": [i for _, ids in pieces for i in ids],
               "finish_reason": "length"}]
    with session_factory()() as session:
        transition(session, job_id, JobStatus.succeeded, {JobStatus.running}, output=output,
                   completion_tokens=len(output[0]["token_ids"]))


def _generate(job_id: str, pieces: list[tuple[str, list[int]]]) -> None:
    _start(job_id)
    _publish(job_id, pieces)
    _succeed(job_id, pieces)


def _submit(client: TestClient, headers: dict[str, str]) -> str:
    return client.post("/v1/jobs", json={"prompt": "stream me"}, headers=headers).json()["id"]


def test_events_stream_tokens_live_then_the_final_job(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    pieces = [("Hel", [1]), ("lo", [2]), ("!", [3])]
    first_token = threading.Event()
    lines: list[str] = []

    def read() -> None:
        with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=auth_headers) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                lines.append(line)
                if line == "event: token":
                    first_token.set()

    reader = threading.Thread(target=read)
    reader.start()
    _start(job_id)
    _publish(job_id, pieces[:1])
    arrived_while_running = first_token.wait(timeout=30)  # the job is still running until we finish it below
    _publish(job_id, pieces[1:])
    _succeed(job_id, pieces)
    reader.join(timeout=30)
    assert arrived_while_running, "no token event reached the client before the job finished"
    assert not reader.is_alive(), "the stream did not end after the job finished"
    events = _parse("\n".join(lines))
    tokens = [data for name, data in events if name == "token"]
    assert "".join(t["text"] for t in tokens) == "Hello!" and [i for t in tokens for i in t["token_ids"]] == [1, 2, 3]
    assert events[-1][0] == "done" and events[-1][1]["status"] == "succeeded" and events[-1][1]["text"] == "Hello!"


def test_events_after_the_job_finished_replay_everything(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    _generate(job_id, [("a", [5]), ("b", [6])])
    events = _parse(client.get(f"/v1/jobs/{job_id}/events", headers=auth_headers).text)
    assert [name for name, _ in events] == ["token", "token", "done"]


def test_events_fall_back_to_the_stored_output_when_the_stream_is_gone(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    job_id = _submit(client, auth_headers)
    _generate(job_id, [("xy", [7, 8])])
    streams.redis_client().delete(streams.events_key(job_id))
    events = _parse(client.get(f"/v1/jobs/{job_id}/events", headers=auth_headers).text)
    assert events[0] == ("token", {"index": 0, "text": "xy", "token_ids": [7, 8], "text_offset": 0, "token_offset": 0})
    assert events[-1][0] == "done"


def test_the_stored_output_stands_in_with_its_logprobs(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    _start(job_id)
    logprobs = [{"7": -0.5, "3": -1.5}, {"8": -0.25}]
    output = [{"index": 0, "text": "xy", "token_ids": [7, 8], "finish_reason": "length", "logprobs": logprobs}]
    with session_factory()() as session:
        transition(session, job_id, JobStatus.succeeded, {JobStatus.running}, output=output, completion_tokens=2)
    streams.redis_client().delete(streams.events_key(job_id))
    events = _parse(client.get(f"/v1/jobs/{job_id}/events", headers=auth_headers).text)
    assert events[0] == ("token", {"index": 0, "text": "xy", "token_ids": [7, 8], "logprobs": logprobs,
                                   "text_offset": 0, "token_offset": 0})


def test_events_of_a_cancelled_queued_job_end_at_once(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    client.post(f"/v1/jobs/{job_id}/cancel", headers=auth_headers)
    events = _parse(client.get(f"/v1/jobs/{job_id}/events", headers=auth_headers).text)
    assert [(name, data["status"]) for name, data in events] == [("done", "cancelled")]


def test_a_restarted_job_streams_only_its_new_attempt_and_says_so(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    job_id = _submit(client, auth_headers)
    redis = streams.redis_client()
    streams.publish_tokens(redis, {job_id: [{"index": 0, "text": "lost", "token_ids": [9]}]})  # the dead attempt
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=auth_headers) as live:
        lines = live.iter_lines()
        assert next(lines) == "id: " + redis.xrange(streams.events_key(job_id))[0][0]
        streams.publish_restart(redis, job_id, attempt=2)
        _generate(job_id, [("new", [7])])
        live_events = _parse("\n".join(["id: x", *lines]))
    replay = _parse(client.get(f"/v1/jobs/{job_id}/events", headers=auth_headers).text)
    assert [name for name, _ in live_events] == ["token", "restart", "token", "done"]
    assert live_events[1][1] == {"attempt": 2}
    assert [name for name, _ in replay] == ["restart", "token", "done"]
    assert replay[1][1]["text"] == "new" and replay[-1][1]["text"] == "new"


def _publish_at(job_id: str, text: str, ids: list[int], text_offset: int, token_offset: int) -> None:
    delta = {"index": 0, "text": text, "token_ids": ids, "text_offset": text_offset, "token_offset": token_offset}
    streams.publish_tokens(streams.redis_client(), {job_id: [delta]})


def _tokens(events: list[tuple[str, dict]]) -> list[tuple[str, list[int]]]:
    return [(data["text"], data["token_ids"]) for name, data in events if name == "token"]


def test_a_delta_published_again_streams_only_its_new_part(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    _start(job_id)
    _publish_at(job_id, "Hel", [1], 0, 0)
    _publish_at(job_id, "Hello", [1, 2], 0, 0)  # a worker's retry: Redis kept the first try but did not answer
    _publish_at(job_id, "lo!", [2, 3], 3, 1)
    _succeed(job_id, [("Hello!", [1, 2, 3])])
    events = _parse(client.get(f"/v1/jobs/{job_id}/events", headers=auth_headers).text)
    assert _tokens(events) == [("Hel", [1]), ("lo", [2]), ("!", [3])]


def test_what_redis_never_got_streams_from_the_stored_output_before_the_end(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    job_id = _submit(client, auth_headers)
    _start(job_id)
    _publish_at(job_id, "Hel", [1], 0, 0)  # the rest was lost with the worker's last publish
    _succeed(job_id, [("Hello!", [1, 2, 3])])
    streams.publish_final(streams.redis_client(), job_id, "succeeded")
    events = _parse(client.get(f"/v1/jobs/{job_id}/events", headers=auth_headers).text)
    assert _tokens(events) == [("Hel", [1]), ("lo!", [2, 3])] and events[-1][0] == "done"
    # a client resuming after the first token gets the rest; one resuming after the end gets nothing again
    first, *_, final = streams.redis_client().xrange(streams.events_key(job_id))
    for last_event_id, expected in ((first[0], [("lo!", [2, 3])]), (final[0], [])):
        resumed = client.get(f"/v1/jobs/{job_id}/events", headers={**auth_headers, "Last-Event-ID": last_event_id})
        assert _tokens(_parse(resumed.text)) == expected


def test_an_event_id_redis_cannot_hold_is_422(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    for last in (f"{1 << 64}-0", f"1-{1 << 64}"):
        response = client.get(f"/v1/jobs/{job_id}/events", headers={**auth_headers, "Last-Event-ID": last})
        assert response.status_code == 422 and response.json()["error"]["field"] == "Last-Event-ID"


def test_a_restart_entry_is_numbered_past_every_entry_a_follower_read(service_settings: Settings) -> None:
    redis = streams.redis_client()
    key = streams.events_key("job-restart-ids")
    redis.delete(key)
    for _ in range(50):  # within one millisecond a stream made afresh would number its entry 0 again
        streams.publish_tokens(redis, {"job-restart-ids": [{"index": 0, "text": "x", "token_ids": [1]}]})
        (last_read, _), = redis.xrevrange(key, count=1)
        streams.publish_restart(redis, "job-restart-ids", attempt=2)
        (restart_id, fields), = redis.xrange(key)
        assert fields["type"] == "restart"
        assert tuple(map(int, restart_id.split("-"))) > tuple(map(int, last_read.split("-")))
    redis.delete(key)
