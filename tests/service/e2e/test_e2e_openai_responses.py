"""OpenAI's Responses API through the official `openai` client, against live API and worker processes. The oracle is
the chat completions route (checked against transformers elsewhere): a response is the chat completion of the same
conversation."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.service.procs import wait_until

MAX_TOKENS = 6
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """SQLite: the routes read and write jobs as the chat routes do."""
    return sqlite_url


@pytest.fixture(scope="module")
def model(openai_client: openai.OpenAI) -> str:
    return openai_client.models.list().data[0].id


def _chat(openai_client: openai.OpenAI, model: str, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return openai_client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0.0, **extra)


def test_a_response_is_the_chat_completion_of_its_instructions_and_input(
    openai_client: openai.OpenAI, model: str
) -> None:
    response = openai_client.responses.create(model=model, instructions="Answer briefly.", input="Name a colour.",
                                              max_output_tokens=MAX_TOKENS, temperature=0.0, metadata={"run": "e2e"})
    chat = _chat(openai_client, model, [{"role": "system", "content": "Answer briefly."},
                                        {"role": "user", "content": "Name a colour."}])
    assert response.object == "response" and response.output_text == chat.choices[0].message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.usage is not None and response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == item.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details is not None) == cut
    assert response.instructions == "Answer briefly." and response.metadata == {"run": "e2e"}
    assert response.tool_choice == "auto"
    assert openai_client.responses.retrieve(response.id).output_text == response.output_text


def test_a_streamed_response_sends_typed_events_whose_deltas_make_its_text(
    openai_client: openai.OpenAI, model: str
) -> None:
    messages = [{"role": "user", "content": "Tell me about foxes."}]
    events = list(openai_client.responses.create(model=model, input=messages, max_output_tokens=MAX_TOKENS,
                                                 temperature=0.0, stream=True, top_logprobs=2))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == _chat(openai_client, model, messages).choices[0].message.content
    streamed = [lp for event in events if event.type == "response.output_text.delta" for lp in event.logprobs]
    final = events[-1].response.output[0].content[0].logprobs
    assert len(streamed) == events[-1].response.usage.output_tokens and "".join(lp.token for lp in streamed) == text
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in final]
    assert all(len(lp.top_logprobs) == 2 for lp in final)


def test_a_repeated_input_reports_the_input_tokens_the_prefix_cache_served(
    openai_client: openai.OpenAI, model: str
) -> None:
    text = f"{uuid.uuid4().hex}: " + "Tell me about foxes, dogs and their quarrels. " * 6  # new to the cache
    first, again = (openai_client.responses.create(model=model, input=text, max_output_tokens=2, temperature=0.0)
                    for _ in range(2))
    assert first.usage is not None and again.usage is not None
    # the chat template's opening, which earlier requests shared, may be cached already: the user's text is not
    cached_first, cached_again = (r.usage.input_tokens_details.cached_tokens for r in (first, again))
    assert cached_first + len(text) // 8 <= cached_again < again.usage.input_tokens


def test_previous_response_id_continues_the_conversation_without_its_instructions(
    openai_client: openai.OpenAI, model: str
) -> None:
    first = openai_client.responses.create(model=model, instructions="Be terse.", input="Hello there.",
                                           max_output_tokens=MAX_TOKENS, temperature=0.0)
    second = openai_client.responses.create(model=model, previous_response_id=first.id, input="And then?",
                                            max_output_tokens=MAX_TOKENS, temperature=0.0)
    chat = _chat(openai_client, model, [{"role": "user", "content": "Hello there."},
                                        {"role": "assistant", "content": first.output_text},
                                        {"role": "user", "content": "And then?"}])
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    assert second.instructions is None


def test_a_background_response_is_fetched_once_done_and_can_be_cancelled(
    openai_client: openai.OpenAI, model: str
) -> None:
    queued = openai_client.responses.create(model=model, input="Count to three.", max_output_tokens=MAX_TOKENS,
                                            temperature=0.0, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background and not queued.output

    def done() -> bool:
        return openai_client.responses.retrieve(queued.id).status in ("completed", "incomplete")

    wait_until(done, 60, "the background response to finish")
    fetched = openai_client.responses.retrieve(queued.id)
    chat = _chat(openai_client, model, [{"role": "user", "content": "Count to three."}])
    assert fetched.output_text == chat.choices[0].message.content and fetched.background
    long = openai_client.responses.create(model=model, input="Go on.", max_output_tokens=400, temperature=0.0,
                                          background=True)
    assert openai_client.responses.cancel(long.id).status == "cancelled"
    again = openai_client.responses.cancel(long.id)  # idempotent, as OpenAI's: the cancelled response as it is
    assert again.id == long.id and again.status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="only a queued or in-progress response"):
        openai_client.responses.cancel(fetched.id)
    with pytest.raises(openai.BadRequestError, match="stream"):  # a stored response is not streamed
        list(openai_client.responses.retrieve(fetched.id, stream=True))


def test_a_finished_response_is_deleted_through_the_client(openai_client: openai.OpenAI, model: str) -> None:
    response = openai_client.responses.create(model=model, input="Name a colour.", max_output_tokens=MAX_TOKENS)
    openai_client.responses.delete(response.id)  # the client takes no body back; the route answers OpenAI's
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.delete(response.id)
    queued = openai_client.responses.create(model=model, input="Go on.", max_output_tokens=400,
                                            background=True)
    with pytest.raises(openai.ConflictError, match="cancel it first"):
        openai_client.responses.delete(queued.id)
    openai_client.responses.cancel(queued.id)
    openai_client.responses.delete(queued.id)


def test_a_forced_function_call_is_an_item_and_its_output_continues_the_response(
    openai_client: openai.OpenAI, model: str
) -> None:
    called = openai_client.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER],
                                            tool_choice={"type": "function", "name": "get_weather"},
                                            max_output_tokens=32, temperature=0.0, parallel_tool_calls=False)
    (call,) = called.output
    assert called.parallel_tool_calls is False  # as the request gave it
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answered = openai_client.responses.create(
        model=model, previous_response_id=called.id, max_output_tokens=MAX_TOKENS, temperature=0.0, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}])
    chat = _chat(openai_client, model, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "clear"}'}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none")
    assert answered.output_text == chat.choices[0].message.content and answered.parallel_tool_calls
    # the SDK pages through the request's own items (one a page here): the output it answered, not the earlier turn
    (item,) = list(openai_client.responses.input_items.list(answered.id, limit=1))
    assert item.type == "function_call_output" and item.call_id == call.call_id and item.output == '{"sky": "clear"}'
    listed = list(openai_client.responses.input_items.list(called.id, order="asc", limit=1))
    assert [(item.type, item.role, item.content[0].text) for item in listed] == [
        ("message", "user", "Weather in Paris?")]
    streamed = list(openai_client.responses.create(
        model=model, input="Weather in Rome?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=32, temperature=0.0, stream=True))
    (arguments,) = [event.arguments for event in streamed if event.type == "response.function_call_arguments.done"]
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    # the call comes whole as its own item: no text of it streams as a message, each output index is opened once
    assert not [event for event in streamed if event.type.startswith("response.output_text")]
    added = [event.output_index for event in streamed if event.type == "response.output_item.added"]
    assert added == [0] and streamed[-1].response.output[0].type == "function_call"
    assert streamed[-1].response.text.format.type == "text"  # the tool's schema is no text format
    with openai_client.responses.stream(model=model, input="Weather in Rome?", tools=[WEATHER],
                                        tool_choice={"type": "function", "name": "get_weather"},
                                        max_output_tokens=32, temperature=0.0) as helper:
        assert helper.get_final_response().output[0].type == "function_call"  # the SDK's helper accepts the stream
    plain = openai_client.responses.create(model=model, input="Hi", tools=[WEATHER], tool_choice="none",
                                           max_output_tokens=2, temperature=0.0)
    assert plain.tool_choice == "none" and plain.output[0].type == "message"


def test_a_response_cancelled_while_streaming_ends_its_stream_with_response_failed(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    body = {"model": model, "input": "Go on and on.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{live_api}/v1/responses", json=body, headers=auth_headers, timeout=60) as stream:
        kinds, lines = [], []
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            event = json.loads(line.removeprefix("data: "))
            kinds.append(event["type"])
            # cancelled once, at the third delta (the events after it may be others: the cancel can land at once)
            if event["type"] == "response.output_text.delta" and kinds.count(event["type"]) == 3:
                assert openai_client.responses.cancel(event["item_id"].removeprefix("msg_")).status == "cancelled"
    assert kinds[-1] == "response.failed" and event["response"]["status"] == "cancelled"
    assert event["response"]["error"]["code"] == "cancelled"
    streamed = "".join(json.loads(line.removeprefix("data: "))["delta"] for line in lines
                       if '"response.output_text.delta"' in line)
    kept = event["response"]["output"]  # what the client was sent stays the response's (incomplete) output
    assert not streamed or kept[0]["status"] == "incomplete" and kept[0]["content"][0]["text"].startswith(streamed)

    def recorded() -> bool:  # the worker records the cancelled job's text a moment after the cancel
        return bool(openai_client.responses.retrieve(event["response"]["id"]).output) or not streamed

    wait_until(recorded, 30, "the cancelled response's text to be recorded")


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.message.role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tools": [{**WEATHER, "name": "a b"}]}, "tools.0.name"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}},
     "text.format.schema"),
    ({"input": "fox " * 600}, "input"),
    ({"input": "x", "previous_response_id": "job_missing"}, "previous_response_id"),
    ({"input": "x", "metadata": {"openai_endpoint": "x"}}, "metadata"),
    ({"input": "x", "stream": True, "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "max_tool_calls": 1}, "max_tool_calls"),
    ({"input": [{"type": "function_call_output", "call_id": "call_zz", "output": "42"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]},
     "input.0.arguments"),
])
def test_bad_requests_are_400_naming_the_field_as_sent(
    live_api: str, auth_headers: dict[str, str], model: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(f"{live_api}/v1/responses", json={"model": model, **body}, headers=auth_headers, timeout=30)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param, response.text
    # the message speaks the request's names, not those of the chat completion it runs as
    assert not re.search(r"max_tokens|max_completion_tokens|messages|tool_choice\.function", response.text)


def test_another_keys_response_is_not_found(
    openai_client: openai.OpenAI, model: str, live_api: str, new_auth_headers: Callable[..., dict[str, str]]
) -> None:
    mine = openai_client.responses.create(model=model, input="Hi", max_output_tokens=2)
    other = new_auth_headers("other")
    for method, path in (("GET", f"/v1/responses/{mine.id}"), ("POST", f"/v1/responses/{mine.id}/cancel")):
        assert httpx.request(method, f"{live_api}{path}", headers=other, timeout=30).status_code == 404
    continued = httpx.post(f"{live_api}/v1/responses", headers=other, timeout=30,
                           json={"model": model, "input": "x", "previous_response_id": mine.id})
    assert continued.status_code == 404 and continued.json()["error"]["param"] == "previous_response_id"
    chat = openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=1)
    with pytest.raises(openai.NotFoundError):  # a chat completion's job is no response
        openai_client.responses.retrieve(chat.id)


def test_a_function_call_joins_the_assistant_turn_before_it_as_a_chat_completion_answers() -> None:
    from api.responses_schemas import ResponsesRequest, chat_messages

    items = ResponsesRequest.model_validate({"input": [
        {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}]}).input
    before = [{"role": "user", "content": "Hi"}]
    messages = chat_messages(items, before)
    assert before == [{"role": "user", "content": "Hi"}]  # left as it was
    assert messages[1] == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
    assert messages[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"} and len(messages) == 3
