"""core/tool_parsers.py: the tool calls each format's parser reads out of a finished output, the outputs it leaves as
content, and what a stream may send as content before the output is whole."""

from __future__ import annotations

import json

import pytest

from core.tool_parsers import TOOL_CALL_PARSERS, ParsedCall, ParsedOutput

WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
CLOCK = ParsedCall("get_time", "{}")

PARSED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     ParsedOutput(None, [WEATHER])),
    ("hermes", 'Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', ParsedOutput("Sure.\n", [WEATHER, CLOCK])),
    # SmolLM2 writes a list in one block; arguments as JSON text, or under "parameters"
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}, '
     '{"name": "get_time", "parameters": {}}]</tool_call>', ParsedOutput(None, [WEATHER, CLOCK])),
    # the model stopped on its end-of-turn token before closing the block
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', ParsedOutput(None, [WEATHER])),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
     '"arguments": {}}]', ParsedOutput(None, [WEATHER, CLOCK])),
    # tokenizer v11: name[ARGS]{arguments} after each marker
    ("mistral", 'On it. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     ParsedOutput("On it. ", [WEATHER, CLOCK])),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     ParsedOutput(None, [WEATHER])),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', ParsedOutput(None, [WEATHER])),
    ("llama3_json", ' <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "arguments": {}}', ParsedOutput(None, [WEATHER, CLOCK])),
    ("pythonic", '[get_weather(city="Paris"), get_time()]', ParsedOutput(None, [WEATHER, CLOCK])),
    ("pythonic", "<|python_start|>[get_weather(city='Paris')]<|python_end|>", ParsedOutput(None, [WEATHER])),
    ("pythonic", "[tools.search(q={'a': [1, 2.5, None, True]})]",
     ParsedOutput(None, [ParsedCall("tools.search", '{"q": {"a": [1, 2.5, null, true]}}')])),
]

CONTENT = [  # no tool calls in them: answered as content, whole
    ("hermes", "The weather in Paris is mild."),
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),  # not JSON's
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"oops"</tool_call>'),
    ("mistral", "[TOOL_CALLS]"),
    ("mistral", "[TOOL_CALLS]get_weather{}"),  # no [ARGS]
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}] and then'),
    ("mistral", "See [1] and [TOOL"),
    ("granite", '<|tool_call|>{"name": "f", "arguments": "not an object"}'),
    ("llama3_json", 'I would call {"name": "f", "parameters": {}}'),
    ("llama3_json", '{"name": "f", "parameters": {}} and more words'),
    ("llama3_json", "{}"),
    ("pythonic", "[1] is the reference."),
    ("pythonic", "[f(1)]"),  # positional arguments
    ("pythonic", "[f(x=y)]"),  # not a literal
    ("pythonic", "[f(x={1, 2})]"),  # JSON has no sets
    ("pythonic", "[]"),
    ("pythonic", "Call get_weather(city='Paris')."),
    # hostile output: a call's parts the response could not carry, parsers' own limits
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>'),  # a lone surrogate
    ("hermes", '<tool_call>{"name": "a b <x>", "arguments": {}}</tool_call>'),  # no function is named so
    ("hermes", "<tool_call>" + "[" * 5000),
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 995 + "]" * 995 + "}</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": ' + "[" * 5000),
    ("pythonic", "[f(a=" + "-" * 6000 + "1)]"),
    ("pythonic", "[f(a=" + "not " * 6000 + "1)]"),
    ("pythonic", "[1.5(a=2)]"),
    ("pythonic", "[f(a=10**100000)]"),
]


@pytest.mark.parametrize(("parser", "text", "expected"), PARSED)
def test_each_format_reads_its_tool_calls(parser: str, text: str, expected: ParsedOutput) -> None:
    parsed = TOOL_CALL_PARSERS[parser].parse(text)
    assert parsed == expected
    assert all(isinstance(json.loads(call.arguments), dict) for call in parsed.calls)


@pytest.mark.parametrize(("parser", "text"), CONTENT)
def test_an_output_that_is_not_the_format_is_content(parser: str, text: str) -> None:
    assert TOOL_CALL_PARSERS[parser].parse(text) is None


def _streamed(parser: str, text: str, step: int) -> int:
    """How much content a stream fed `step` characters at a time sent, checking on the way that it never takes back
    what it let through."""
    sent = 0
    for end in [*range(step, len(text), step), len(text)]:
        allowed = TOOL_CALL_PARSERS[parser].content_end(text[:end])
        assert 0 <= allowed <= end
        sent = max(sent, allowed)
    return sent


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize(("parser", "text"), [(p, t) for p, t, _ in PARSED] + CONTENT)
def test_a_stream_sends_only_content_and_all_the_content_before_a_call(parser: str, text: str, step: int) -> None:
    sent = _streamed(parser, text, step)
    parsed = TOOL_CALL_PARSERS[parser].parse(text)
    content = text if parsed is None else parsed.content or ""
    assert content.startswith(text[:sent])  # nothing sent is taken back as a call
    if parser in ("hermes", "mistral", "granite") and parsed is not None:
        assert sent == len(content)  # the content before the calls' marker streams as it comes


@pytest.mark.parametrize(("parser", "prefix"), [
    ("hermes", "Hello <tool_"), ("mistral", "Hello [TOOL_C"), ("granite", "Hello <|tool"), ("llama3_json", "  "),
    ("llama3_json", "<|python"), ("pythonic", "<|python_st"),
    ("pythonic", " [get_weather(")])
def test_what_may_begin_a_tool_call_is_held(parser: str, prefix: str) -> None:
    expected = len("Hello ") if prefix.startswith("Hello") else 0
    assert TOOL_CALL_PARSERS[parser].content_end(prefix) == expected
