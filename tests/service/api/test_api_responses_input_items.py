"""GET /v1/responses/{id}/input_items: the items a response's request gave, paged as OpenAI pages them (no worker:
the items are the stored job's, queued or finished)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from core.db import session_factory
from core.lifecycle import transition
from core.models import JobStatus, utcnow

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'}


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    return sqlite_url


def _create(client: TestClient, headers: dict[str, str], **body: Any) -> str:
    model = client.get("/v1/models", headers=headers).json()["data"][0]["id"]
    response = client.post("/v1/responses", json={"model": model, "background": True, **body}, headers=headers)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def _items(client: TestClient, headers: dict[str, str], response_id: str, **params: Any) -> dict[str, Any]:
    response = client.get(f"/v1/responses/{response_id}/input_items", params=params, headers=headers)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _shape(item: dict[str, Any]) -> tuple[Any, ...]:
    if item["type"] == "message":
        return (item["role"], [(part["type"], part["text"]) for part in item["content"]])
    if item["type"] == "function_call":
        return ("call", item["call_id"], item["name"], item["arguments"])
    return ("output", item["call_id"], item["output"])


def test_the_input_items_are_the_requests_own_last_first_and_not_its_instructions(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    response_id = _create(client, auth_headers, instructions="Be terse.", tools=[TOOL], input=[
        {"role": "user", "content": "Hello."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "?"}]},
        CALL, OUTPUT])
    listed = _items(client, auth_headers, response_id)
    expected = [("user", [("input_text", "Hello.")]), ("assistant", [("output_text", "Hi.")]),
                ("user", [("input_text", "Weather\n?")]),  # text parts come back joined, as the chat routes join them
                ("call", "call_1", "get_weather", "{}"), ("output", "call_1", '{"sky": "clear"}')]
    assert [_shape(item) for item in listed["data"]] == expected[::-1]
    assert listed["object"] == "list" and not listed["has_more"]
    ids = [item["id"] for item in listed["data"]]
    assert len(set(ids)) == 5 and (listed["first_id"], listed["last_id"]) == (ids[0], ids[-1])
    assert all(item["status"] == "completed" for item in listed["data"])


def test_pages_follow_after_and_order(client: TestClient, auth_headers: dict[str, str]) -> None:
    response_id = _create(client, auth_headers, input=[{"role": "user", "content": f"m{i}"} for i in range(5)])
    first = _items(client, auth_headers, response_id, order="asc", limit=2)
    assert [item["content"][0]["text"] for item in first["data"]] == ["m0", "m1"] and first["has_more"]
    rest = _items(client, auth_headers, response_id, order="asc", after=first["last_id"], limit=3)
    assert [item["content"][0]["text"] for item in rest["data"]] == ["m2", "m3", "m4"] and not rest["has_more"]
    newest = _items(client, auth_headers, response_id, limit=1)
    assert newest["data"][0]["content"][0]["text"] == "m4" and newest["has_more"]
    assert _items(client, auth_headers, response_id, order="asc", after=rest["last_id"])["data"] == []
    older = _items(client, auth_headers, response_id, after=newest["last_id"])  # last first: after m4 come m3 .. m0
    assert [item["content"][0]["text"] for item in older["data"]] == ["m3", "m2", "m1", "m0"]


def test_calls_that_join_the_earlier_answer_are_still_this_requests_items(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    # the earlier answer is an assistant turn; a function call sent first joins it as one of its tool calls
    earlier = _create(client, auth_headers, input="Weather?")
    with session_factory()() as session:
        transition(session, earlier, JobStatus.running, {JobStatus.queued}, worker_id="test:1", attempts=1,
                   started_at=utcnow())
        transition(session, earlier, JobStatus.succeeded, {JobStatus.running}, prompt_tokens=2, completion_tokens=2,
                   output=[{"index": 0, "text": "Let me look.", "token_ids": [7, 8], "finish_reason": "stop",
                            "logprobs": None}])
    response_id = _create(client, auth_headers, previous_response_id=earlier, tools=[TOOL], input=[CALL, OUTPUT])
    listed = _items(client, auth_headers, response_id, order="asc")
    assert [_shape(item) for item in listed["data"]] == [("call", "call_1", "get_weather", "{}"),
                                                         ("output", "call_1", '{"sky": "clear"}')]
    assert [_shape(item) for item in _items(client, auth_headers, earlier)["data"]] == [
        ("user", [("input_text", "Weather?")])]


@pytest.mark.parametrize(("params", "field"), [({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                                               ({"order": "up"}, "order")])
def test_a_bad_page_parameter_is_a_400_naming_it(
    client: TestClient, auth_headers: dict[str, str], params: dict[str, Any], field: str
) -> None:
    response_id = _create(client, auth_headers, input="Hi")
    response = client.get(f"/v1/responses/{response_id}/input_items", params=params, headers=auth_headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_an_unknown_cursor_or_response_is_a_404_naming_it(client: TestClient, auth_headers: dict[str, str]) -> None:
    response_id = _create(client, auth_headers, input="Hi")
    unknown_item = client.get(f"/v1/responses/{response_id}/input_items", params={"after": "msg_nope"},
                              headers=auth_headers)
    assert unknown_item.status_code == 404 and unknown_item.json()["error"]["param"] == "after"
    unknown = client.get("/v1/responses/nope/input_items", headers=auth_headers)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "response_id"
