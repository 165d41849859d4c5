"""A completions stream of several prompts relays each prompt's chunks as its job makes them (interleaved, as vLLM),
not one prompt after another; an error in one ends the response and cancels the rest. No worker: the test plays
the jobs' tokens and ends through the real store and Redis."""

from __future__ import annotations

import json
import threading
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from core import streams
from core.db import session_factory
from core.lifecycle import transition
from core.models import Job, JobStatus
from tests.service.procs import wait_until

PROMPTS = ["the first prompt", "the second prompt"]


def _start(job_id: str) -> None:
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued})


def _token(job_id: str, text: str) -> None:
    streams.publish_tokens(streams.redis_client(), {job_id: [{"index": 0, "text": text, "token_ids": [7]}]})


def _end(job_id: str, to: JobStatus, text: str = "", error: str | None = None) -> None:
    output = [{"index": 0, "text": text, "token_ids": [7] * len(text), "finish_reason": "length"}]
    with session_factory()() as session:
        transition(session, job_id, to, {JobStatus.running}, output=output if to is JobStatus.succeeded else None,
                   completion_tokens=len(text), error=error)


class _Reader:
    """Streams one completions request on a thread, keeping every `data:` payload as it arrives."""

    def __init__(self, client: TestClient, headers: dict[str, str], body: dict[str, Any]) -> None:
        self.payloads: list[Any] = []
        self.thread = threading.Thread(target=self._read, args=(client, headers, body))
        self.thread.start()

    def _read(self, client: TestClient, headers: dict[str, str], body: dict[str, Any]) -> None:
        with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    self.payloads.append(data if data == "[DONE]" else json.loads(data))

    def finished(self, index: int) -> bool:
        return any(c["index"] == index and c["finish_reason"] for p in self.chunks() for c in p["choices"])

    def chunks(self) -> list[dict[str, Any]]:
        return [p for p in list(self.payloads) if isinstance(p, dict) and "choices" in p]


def _request_jobs(prompts: list[str]) -> list[str]:
    """The ids of the jobs the streaming request made for `prompts`, in prompt order (once both exist)."""
    found: list[str] = []

    def made() -> bool:
        nonlocal found
        with session_factory()() as session:
            rows = session.execute(select(Job.id, Job.prompt).where(Job.prompt.in_(prompts))).all()
        by_prompt = {prompt: job_id for job_id, prompt in rows}
        found = [by_prompt[p] for p in prompts if p in by_prompt]
        return len(found) == len(prompts)

    wait_until(made, 30, "the request's jobs")
    return found


def test_the_second_prompt_streams_to_its_end_while_the_first_is_still_running(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    model = client.get("/v1/models", headers=auth_headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPTS, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    reader = _Reader(client, auth_headers, body)
    first, second = _request_jobs(PROMPTS)
    _start(first)
    _start(second)
    _token(first, "A")
    _token(second, "B")
    _end(second, JobStatus.succeeded, "B")
    # relayed one prompt after another, the second's chunks would wait for the first's end
    wait_until(lambda: reader.finished(1), 30, "the second prompt's last chunk while the first runs")
    assert not reader.finished(0)
    _token(first, "C")
    _end(first, JobStatus.succeeded, "AC")
    reader.thread.join(timeout=30)
    assert not reader.thread.is_alive()
    texts = {0: "", 1: ""}
    for payload in reader.chunks():
        for choice in payload["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {0: "AC", 1: "B"}
    assert reader.payloads[-1] == "[DONE]" and reader.payloads[-2]["usage"]["completion_tokens"] == 3
    assert {p["id"] for p in reader.chunks()} == {first}  # one response id: the first job's


def test_a_failed_prompt_ends_the_stream_with_its_error_and_cancels_the_others(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    model = client.get("/v1/models", headers=auth_headers).json()["data"][0]["id"]
    prompts = [f"{p}, failing" for p in PROMPTS]
    reader = _Reader(client, auth_headers, {"model": model, "prompt": prompts, "max_tokens": 4, "stream": True})
    first, second = _request_jobs(prompts)
    _start(first)
    _start(second)
    _token(first, "A")
    _end(second, JobStatus.failed, error="the engine stopped")
    reader.thread.join(timeout=30)
    assert not reader.thread.is_alive()
    errors = [p["error"] for p in reader.payloads if isinstance(p, dict) and "error" in p]
    assert len(errors) == 1 and "the engine stopped" in errors[0]["message"]
    assert reader.payloads[-1] == "[DONE]"
    with session_factory()() as session:
        job = session.get(Job, first)
        assert job is not None and job.status is JobStatus.cancelled
