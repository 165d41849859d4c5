"""The OpenAI-compatible API through the official `openai` openai_client, against live API and worker processes."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from core.settings import Settings, configure
from tests.engine.hf_reference import hf_logprobs
from tests.service.procs import wait_until

MAX_TOKENS = 8
SERVED_NAMES = ["tiny", "tiny-alias"]


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """SQLite only: the batch module runs on PostgreSQL, so each store is covered with one service start-up."""
    return sqlite_url


@pytest.fixture(scope="module")
def service_settings(service_settings: Settings) -> Iterator[Settings]:
    """Served as with `--enable-auto-tool-choice --tool-call-parser hermes --served-model-name tiny tiny-alias`."""
    settings = service_settings.model_copy(update={"enable_auto_tool_choice": True, "tool_call_parser": "hermes",
                                                   "served_model_name": SERVED_NAMES})
    configure(settings)
    yield settings
    configure(service_settings)


@pytest.fixture(scope="module")
def model(openai_client: openai.OpenAI) -> str:
    """The id of the served model, as /v1/models lists it."""
    return openai_client.models.list().data[0].id


def test_models_lists_the_served_names(openai_client: openai.OpenAI) -> None:
    assert [m.id for m in openai_client.models.list().data] == SERVED_NAMES


def test_an_answer_carries_the_served_name_it_was_asked_for(openai_client: openai.OpenAI) -> None:
    params = {"model": "tiny-alias", "prompt": "Hi", "max_tokens": 2}
    assert openai_client.completions.create(**params).model == "tiny-alias"
    assert {chunk.model for chunk in openai_client.completions.create(**params, stream=True)} == {"tiny-alias"}
    assert openai_client.completions.create(**{**params, "model": None}).model == "tiny"


def test_completion_has_text_usage_and_is_a_job(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    completion = openai_client.completions.create(model=model, prompt="The quick brown fox", max_tokens=MAX_TOKENS,
                                           temperature=0.0, user="alice")
    (choice,) = completion.choices
    assert completion.object == "text_completion" and choice.finish_reason in {"stop", "length"}
    assert completion.usage is not None and completion.usage.completion_tokens <= MAX_TOKENS
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    job = httpx.get(f"{live_api}/v1/jobs/{completion.id}", headers=auth_headers).json()
    assert job["status"] == "succeeded" and job["text"] == choice.text
    assert job["metadata"]["user"] == "alice" and job["params"]["temperature"] == 0.0


def test_a_repeated_prompt_reports_the_prompt_tokens_the_prefix_cache_served(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    prompt = f"{uuid.uuid4().hex}: " + "A long preamble about foxes, dogs and their quarrels. " * 6  # new to the cache
    params = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    first = openai_client.completions.create(**params)
    streamed = list(openai_client.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    usage = streamed[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < usage.prompt_tokens == first.usage.prompt_tokens  # whole blocks, never the last token
    job = httpx.get(f"{live_api}/v1/jobs/{streamed[-1].id}", headers=auth_headers).json()
    assert job["cached_prompt_tokens"] == cached


def test_completion_with_n_and_logprobs_gives_the_models_logprobs(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str], service_model_dir: Path
) -> None:
    prompt = "Count: one two"
    completion = openai_client.completions.create(model=model, prompt=prompt, max_tokens=4, n=2, seed=3,
                                                  logprobs=2, temperature=1.0)
    assert [c.index for c in completion.choices] == [0, 1]
    prompt_ids = httpx.post(f"{live_api}/tokenize", json={"prompt": prompt}, headers=auth_headers).json()["tokens"]
    job = httpx.get(f"{live_api}/v1/jobs/{completion.id}", headers=auth_headers).json()
    for choice, job_choice in zip(completion.choices, job["choices"]):
        logprobs, token_ids = choice.logprobs, job_choice["token_ids"]
        assert logprobs is not None and "".join(logprobs.tokens) == choice.text
        # the oracle: transformers' log-softmax over the same weights at each generated position
        reference = hf_logprobs(service_model_dir, prompt_ids, token_ids)
        assert logprobs.token_logprobs == pytest.approx(reference[range(len(token_ids)), token_ids].tolist(), abs=1e-3)
        steps = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, reference.topk(2).values.tolist(),
                    strict=True)
        for token, logprob, top, expected in steps:  # the two likeliest, and the chosen token whatever its rank
            assert top[token] == logprob and len(top) <= 3
            assert sorted(top.values(), reverse=True)[:2] == pytest.approx(expected, abs=1e-3)


def test_chat_completion_answers_with_an_assistant_message(openai_client: openai.OpenAI, model: str) -> None:
    chat = openai_client.chat.completions.create(
        model=model, max_completion_tokens=MAX_TOKENS, temperature=0.0, logprobs=True, top_logprobs=1,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
    )
    (choice,) = chat.choices
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    assert chat.usage is not None and chat.usage.completion_tokens == len(choice.logprobs.content)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_text_and_usage_equal_the_non_streamed_ones_for_the_same_seed(
    openai_client: openai.OpenAI, model: str, endpoint: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    params = {"model": model, "max_tokens": 24, "temperature": 0.9, "seed": 1234}
    usage = {"include_usage": True}
    if endpoint == "chat":
        params["messages"] = [{"role": "user", "content": "Tell me a story"}]
        create = openai_client.chat.completions.create
        non_streamed = create(**params)
        whole = non_streamed.choices[0].message.content
        chunks = list(create(**params, stream=True, stream_options=usage))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in {"stop", "length"}
    else:
        params["prompt"] = "Once upon a time"
        create = openai_client.completions.create
        non_streamed = create(**params)
        whole = non_streamed.choices[0].text
        chunks = list(create(**params, stream=True, stream_options=usage))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    whole_usage = non_streamed.usage
    assert len(chunks) > 3 and streamed == whole
    # usage comes once, last, and counts what was streamed: the job's tokens, as the non-streamed usage does
    assert chunks[-1].usage is not None and all(c.usage is None for c in chunks[:-1])
    job = httpx.get(f"{live_api}/v1/jobs/{chunks[0].id}", headers=auth_headers).json()
    assert chunks[-1].usage.completion_tokens == len(job["choices"][0]["token_ids"]) == whole_usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole_usage.prompt_tokens == job["prompt_tokens"]
    plain = list(create(**params, stream=True))
    assert all(c.usage is None for c in plain)


def test_stop_reason_names_the_stop_string_or_token_as_vllm_in_responses_and_streams(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    params = {"model": model, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.0,
              "extra_body": {"ignore_eos": True}}
    full = openai_client.completions.create(**params)
    assert full.choices[0].finish_reason == "length" and full.choices[0].model_extra["stop_reason"] is None
    stop = full.choices[0].text[6:9]
    by_string = openai_client.completions.create(**params, stop=[stop])
    assert by_string.choices[0].finish_reason == "stop" and by_string.choices[0].model_extra["stop_reason"] == stop
    chunks = list(openai_client.completions.create(**params, stop=[stop], stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] == stop
    stop_token = httpx.get(f"{live_api}/v1/jobs/{full.id}", headers=auth_headers).json()["choices"][0]["token_ids"][2]
    by_token = openai_client.completions.create(**{**params, "extra_body": {"ignore_eos": True,
                                                                             "stop_token_ids": [stop_token]}})
    assert by_token.choices[0].finish_reason == "stop" and by_token.choices[0].model_extra["stop_reason"] == stop_token
    chat = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0.0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_token]})
    assert chat.choices[0].model_extra["stop_reason"] in (None, stop_token)  # the chat may not reach that token
    assert (chat.choices[0].model_extra["stop_reason"] == stop_token) == (chat.choices[0].finish_reason == "stop")


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id_as_vllm(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    ids = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    params = {"model": model, "prompt": "Hi", "max_tokens": 4, "logprobs": 2, "temperature": 0.0, "extra_body": ids}
    completion = openai_client.completions.create(**params)
    token_ids = httpx.get(f"{live_api}/v1/jobs/{completion.id}", headers=auth_headers).json()["choices"][0]["token_ids"]
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == [f"token_id:{i}" for i in token_ids]
    assert all(key.startswith("token_id:") for top in logprobs.top_logprobs or [] for key in top)
    streamed = [token for chunk in openai_client.completions.create(**params, stream=True)
                for token in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else [])]
    assert streamed == logprobs.tokens
    chat = openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, logprobs=True, top_logprobs=1, extra_body=ids)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content and all(entry.token.startswith("token_id:") for entry in content)
    plain = openai_client.completions.create(model=model, prompt="Hi", max_tokens=2, logprobs=1)
    assert plain.choices[0].logprobs is not None and not plain.choices[0].logprobs.tokens[0].startswith("token_id:")


def test_a_refused_jobs_error_names_the_field_it_blames_answered_or_streamed(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str], service_model_dir: Path
) -> None:
    # the regex compiles when the job is made, and breaks down only while generating: the worker refuses it
    body = {"model": model, "prompt": "Hi", "max_tokens": 4, "guided_regex": "(a{1000}){1000}"}
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.completions.create(model=model, prompt="Hi", max_tokens=4,
                                         extra_body={"guided_regex": "(a{1000}){1000}"})
    assert refused.value.param == "guided_regex" and "structured_outputs" not in refused.value.message
    with httpx.stream("POST", f"{live_api}/v1/completions", json={**body, "stream": True}, headers=auth_headers,
                      timeout=60) as stream:
        errors = [json.loads(line[6:])["error"] for line in stream.iter_lines()
                  if line.startswith("data: {") and '"error"' in line]
    assert [error["param"] for error in errors] == ["guided_regex"]
    # what the API knows to refuse never becomes a job: no token could be sampled here
    eos = json.loads((service_model_dir / "config.json").read_text())["eos_token_id"]
    early = httpx.post(f"{live_api}/v1/completions", headers=auth_headers, timeout=60, json={
        "model": model, "prompt": "Hi", "max_tokens": 4, "min_tokens": 2, "allowed_token_ids": [eos], "stream": True})
    assert early.status_code == 400 and early.json()["error"]["param"] == "allowed_token_ids"


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str], service_model_dir: Path
) -> None:
    # lm-eval-harness's loglikelihood request: the context and continuation as the prompt, echo, logprobs, 1 token
    prompt = "The quick brown fox jumps over the lazy dog"
    prompt_ids = httpx.post(f"{live_api}/tokenize", json={"prompt": prompt}, headers=auth_headers).json()["tokens"]
    for _ in range(2):  # the second time the prompt's blocks are in the prefix cache: it is still scored whole
        completion = openai_client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0,
                                                      echo=True, logprobs=1)
        choice = completion.choices[0]
        logprobs = choice.logprobs
        assert logprobs is not None and len(logprobs.tokens) == len(prompt_ids) + 1
        assert "".join(logprobs.tokens) == choice.text and choice.text.startswith(prompt)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        scored = prompt_ids[1:]
        reference = hf_logprobs(service_model_dir, prompt_ids[:1], scored)  # row i: the logits before token i + 1
        assert logprobs.token_logprobs[1:len(prompt_ids)] == pytest.approx(
            reference[range(len(scored)), scored].tolist(), abs=1e-3)
        assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
        assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
        job = httpx.get(f"{live_api}/v1/jobs/{completion.id}", headers=auth_headers).json()
        stored = job["choices"][0]["prompt_logprobs"]  # the job API shows them too
        assert job["params"]["prompt_logprobs"] == 1 and len(stored) == len(prompt_ids) and stored[0] is None
        stored_logprobs = [entry[str(token)] for entry, token in zip(stored[1:], scored, strict=True)]
        assert stored_logprobs == logprobs.token_logprobs[1 : len(prompt_ids)]


def test_echo_with_max_tokens_0_answers_with_the_scored_prompt_alone(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    # OpenAI's legacy scoring request (older lm-eval-harness): the prompt's logprobs and no generated token, as vLLM
    prompt = "The quick brown fox jumps over the lazy dog"
    scored = openai_client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0, echo=True,
                                              logprobs=1).choices[0].logprobs
    num_prompt = len(scored.tokens) - 1
    body = {"model": model, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0.0}
    whole = httpx.post(f"{live_api}/v1/completions", json=body, headers=auth_headers, timeout=60).json()
    (choice,) = whole["choices"]
    assert choice["text"] == prompt and whole["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["tokens"] == scored.tokens[:num_prompt]
    assert choice["logprobs"]["token_logprobs"] == scored.token_logprobs[:num_prompt]
    chunks = _sse_chunks(live_api, auth_headers, {**body, "stream_options": {"include_usage": True}})
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == prompt
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    streamed = [c["logprobs"] for chunk in chunks for c in chunk["choices"] if c["logprobs"]]
    assert [t for part in streamed for t in part["tokens"]] == scored.tokens[:num_prompt]
    refused = httpx.post(f"{live_api}/v1/completions", json={**body, "echo": False}, headers=auth_headers, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_a_chat_echo_starts_the_answer_with_the_final_assistant_message_as_vllm(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    messages = [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": "Hello"}]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    plain = openai_client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0.0,
                                                  extra_body=options)
    echoed = openai_client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0.0,
                                                   extra_body={**options, "echo": True})
    assert echoed.choices[0].message.content == "Hello" + plain.choices[0].message.content
    stream = openai_client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0.0,
                                                   stream=True, extra_body={**options, "echo": True})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == echoed.choices[0].message.content


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_echo_scores_the_prompt_as_the_unstreamed_one_does(
    live_api: str, auth_headers: dict[str, str], model: str, n: int
) -> None:
    body = {"model": model, "prompt": "The quick brown fox jumps", "max_tokens": 3, "n": n, "seed": 8,
            "temperature": 1.0, "echo": True, "logprobs": 2}
    whole = httpx.post(f"{live_api}/v1/completions", json=body, headers=auth_headers, timeout=60).json()
    chunks = _sse_chunks(live_api, auth_headers, body)
    for choice in whole["choices"]:
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        streamed = [c["logprobs"] for c in mine if c["logprobs"]]
        assert streamed[0]["token_logprobs"][0] is None  # the echo chunk comes first, scored
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for part in streamed for v in part[key]] == choice["logprobs"][key], key


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_logprobs_equal_the_non_streamed_ones(openai_client: openai.OpenAI, model: str, endpoint: str) -> None:
    # vLLM streams logprobs too: each chunk carries those of its tokens (a completion's text_offset counting on)
    if endpoint == "chat":
        create = openai_client.chat.completions.create
        params = {"model": model, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12,
                  "temperature": 0.0, "logprobs": True, "top_logprobs": 2}
        whole = create(**params).choices[0].logprobs.content
        chunks = [c for c in create(**params, stream=True) if c.choices and c.choices[0].logprobs]
        streamed = [entry for c in chunks for entry in c.choices[0].logprobs.content]
        assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
            [(e.token, [t.token for t in e.top_logprobs]) for e in whole]
        # the two runs batch differently, so the sums may round differently
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    else:
        create = openai_client.completions.create
        params = {"model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.0, "logprobs": 2}
        whole = create(**params).choices[0].logprobs
        chunks = [c.choices[0].logprobs for c in create(**params, stream=True) if c.choices and c.choices[0].logprobs]
        for name in ("tokens", "text_offset"):
            assert [v for chunk in chunks for v in getattr(chunk, name)] == getattr(whole, name), name
        assert [v for chunk in chunks for v in chunk.token_logprobs] == pytest.approx(whole.token_logprobs, abs=1e-4)
        top_tokens = [list(top) for chunk in chunks for top in chunk.top_logprobs]
        assert top_tokens == [list(top) for top in whole.top_logprobs]
    assert len(chunks) > 1 and len(whole if endpoint == "chat" else whole.tokens) == 12


def test_stream_ends_with_done(live_api: str, auth_headers: dict[str, str], model: str) -> None:
    body = {"model": model, "prompt": "Hi", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{live_api}/v1/completions", json=body, headers=auth_headers, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_an_invalid_parameter_raises_bad_request_naming_it(openai_client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.completions.create(model=model, prompt="Hi", max_tokens=4, temperature=-1)
    assert raised.value.param == "temperature" and "temperature" in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}])
    assert raised.value.param == "messages.0.role"


def test_a_prompt_too_long_for_the_context_is_a_bad_request(openai_client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.completions.create(model=model, prompt="word " * 600, max_tokens=4)
    assert raised.value.param == "prompt" and "context" in raised.value.message


def test_an_unknown_model_raises_not_found(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.completions.create(model="gpt-nonexistent", prompt="Hi", max_tokens=4)
    assert raised.value.code == "model_not_found" and raised.value.param == "model"


def test_a_bad_api_key_raises_authentication_error(live_api: str) -> None:
    with openai.OpenAI(base_url=f"{live_api}/v1", api_key="psk_nope_nope", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_gets_its_job_cancelled(
    live_api: str, auth_headers: dict[str, str], model: str, stream: bool
) -> None:
    prompt = f"Go on and on (stream={stream})"
    body = {"model": model, "prompt": prompt, "max_tokens": 480, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{live_api}/v1/completions", json=body, headers=auth_headers, timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
    else:
        # 480 tokens of the tiny model take about a second here; the client gives up well before
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live_api}/v1/completions", json=body, headers=auth_headers, timeout=0.2)
    with httpx.Client(base_url=live_api, headers=auth_headers) as api:
        def cancelled() -> bool:
            jobs = [j for j in api.get("/v1/jobs").json()["data"] if j["prompt"] == prompt]
            return bool(jobs) and jobs[0]["status"] == "cancelled"

        wait_until(cancelled, 30, "the abandoned job to be cancelled")


def _sse_chunks(live_api: str, auth_headers: dict[str, str], body: dict) -> list[dict]:
    with httpx.stream("POST", f"{live_api}/v1/completions", json={**body, "stream": True}, headers=auth_headers,
                      timeout=60) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_unknown_and_vllm_fields_are_ignored_with_one_warning(
    openai_client: openai.OpenAI, model: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    completion = openai_client.completions.create(
        model=model, prompt="Hi", max_tokens=2,
        extra_body={"use_beam_search": False, "spaces_between_special_tokens": True, "made_up_field_7f3a": 1},
    )
    assert completion.choices[0].finish_reason in {"stop", "length"}
    logs = [p.read_text() for p in tmp_path_factory.getbasetemp().glob("logs[0-9]*/api.log")]
    (warning,) = [line for log in logs for line in log.splitlines() if "made_up_field_7f3a" in line]
    assert "openai.ignored_fields" in warning and "spaces_between_special_tokens" in warning and "WARNING" in warning
    assert "use_beam_search" not in warning  # false is what it does


def test_continuous_usage_stats_puts_usage_in_every_chunk(
    live_api: str, auth_headers: dict[str, str], model: str
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": model, "prompt": "Once", "max_tokens": 6, "ignore_eos": True, "stream_options": options}
    chunks = _sse_chunks(live_api, auth_headers, body)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1]["choices"] == []
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)


def test_without_include_usage_no_chunk_has_usage(live_api: str, auth_headers: dict[str, str], model: str) -> None:
    body = {"model": model, "prompt": "Once", "max_tokens": 3, "stream_options": {"continuous_usage_stats": True}}
    assert not any("usage" in c for c in _sse_chunks(live_api, auth_headers, body))


def test_a_list_of_prompts_gets_a_choice_set_per_prompt(openai_client: openai.OpenAI, model: str) -> None:
    prompts = ["The quick brown fox", "Once upon a time"]
    both = openai_client.completions.create(model=model, prompt=prompts, n=2, max_tokens=4, temperature=0.0)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    alone = [openai_client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0.0) for p in prompts]
    assert [c.text for c in both.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


def test_a_list_of_prompts_streams_every_choice(live_api: str, auth_headers: dict[str, str], model: str) -> None:
    body = {"model": model, "prompt": ["Hi", "Hello"], "n": 2, "max_tokens": 3, "ignore_eos": True}
    chunks = _sse_chunks(live_api, auth_headers, body)
    choices = [choice for c in chunks for choice in c["choices"]]
    assert sorted(c["index"] for c in choices if c["finish_reason"]) == [0, 1, 2, 3]
    assert {c["index"] for c in choices if c["text"]} == {0, 1, 2, 3}
    assert len({(c["id"], c["created"]) for c in chunks}) == 1  # one response, one id, as OpenAI's


def test_token_id_prompts_complete_like_their_text(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    text = "The quick brown fox"
    ids = httpx.post(f"{live_api}/tokenize", json={"prompt": text}, headers=auth_headers).json()["tokens"]
    by_text = openai_client.completions.create(model=model, prompt=text, max_tokens=4, temperature=0.0)
    by_ids = openai_client.completions.create(model=model, prompt=[ids, ids], max_tokens=4, temperature=0.0)
    assert [c.text for c in by_ids.choices] == [by_text.choices[0].text] * 2
    assert by_ids.usage.prompt_tokens == 2 * len(ids)


def test_token_id_prompts_reach_the_engine_as_given_not_retokenized(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    def tokenize(text: str) -> list[int]:
        return httpx.post(f"{live_api}/tokenize", json={"prompt": text}, headers=auth_headers).json()["tokens"]

    split = tokenize("The quick brown") + tokenize(" f") + tokenize("ox")  # " fox" in two pieces
    assert len(split) > len(tokenize("The quick brown fox"))  # the same text, which encodes shorter
    completion = openai_client.completions.create(model=model, prompt=split, max_tokens=2, temperature=0.0)
    assert completion.usage.prompt_tokens == len(split)
    job = httpx.get(f"{live_api}/v1/jobs/{completion.id.removeprefix('cmpl-')}", headers=auth_headers).json()
    assert job["prompt_tokens"] == len(split) and job["prompt"] == "The quick brown fox"


def test_echo_starts_the_text_with_the_prompt(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    plain = openai_client.completions.create(model=model, prompt="Echo this", max_tokens=3, temperature=0.0)
    echoed = openai_client.completions.create(model=model, prompt="Echo this", max_tokens=3, temperature=0.0,
                                              echo=True)
    assert echoed.choices[0].text == "Echo this" + plain.choices[0].text
    chunks = _sse_chunks(live_api, auth_headers, {"model": model, "prompt": "Echo this", "max_tokens": 3,
                                                  "temperature": 0.0, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed.choices[0].text


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_chat_json_follows_the_schema_asked_for_in_vllms_structured_outputs(
    openai_client: openai.OpenAI, model: str, live_api: str, auth_headers: dict[str, str]
) -> None:
    # compact JSON: the random model would otherwise spend its tokens on the whitespace JSON allows
    completion = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe someone"}], max_tokens=48, n=2, seed=1,
        temperature=1.0, extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    job = httpx.get(f"{live_api}/v1/jobs/{completion.id.removeprefix('chatcmpl-')}", headers=auth_headers).json()
    assert job["params"]["structured_outputs"] == {"json": PERSON, "disable_any_whitespace": True}


def test_response_format_json_schema_and_guided_choice_constrain_completions(
    openai_client: openai.OpenAI, model: str
) -> None:
    schema = {"type": "integer", "minimum": 100, "maximum": 999}
    numbers = openai_client.completions.create(
        model=model, prompt="A number:", max_tokens=8, n=3, seed=2, temperature=1.0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    for choice in numbers.choices:
        assert choice.finish_reason == "stop" and 100 <= json.loads(choice.text) <= 999
    colours = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A colour?"}], max_tokens=8, temperature=0.0,
        extra_body={"guided_choice": ["red", "dark green"]})
    assert colours.choices[0].message.content in ("red", "dark green")


def test_a_streamed_constrained_completion_streams_what_the_job_stored(
    live_api: str, auth_headers: dict[str, str], model: str
) -> None:
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    chunks = _sse_chunks(live_api, auth_headers, {"model": model, "prompt": "Today is", "max_tokens": 32, "seed": 3,
                                                  "guided_regex": date})
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert re.fullmatch(date, streamed) and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    job = httpx.get(f"{live_api}/v1/jobs/{chunks[0]['id'].removeprefix('cmpl-')}", headers=auth_headers).json()
    assert job["text"] == streamed


# compact JSON (llguidance's x-guidance option, read from the schema): the random model would otherwise spend its
# tokens on the whitespace JSON allows
CITY_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def test_a_named_tool_choice_answers_with_a_call_whose_arguments_follow_its_schema(
    openai_client: openai.OpenAI, model: str
) -> None:
    completion = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather?"}], max_tokens=32, n=2, seed=4, temperature=1.0,
        tools=[CITY_TOOL, CLOCK_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in completion.choices:  # a call the request named ends as "stop", as OpenAI and vLLM answer it
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), CITY_TOOL["function"]["parameters"])


def test_tool_choice_required_calls_one_of_the_tools(openai_client: openai.OpenAI, model: str) -> None:
    completion = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather or time?"}], max_tokens=40, n=3, seed=5,
        temperature=1.0, tools=[CITY_TOOL, CLOCK_TOOL], tool_choice="required", parallel_tool_calls=False)
    tools = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (CITY_TOOL, CLOCK_TOOL)}
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


def test_a_named_calls_arguments_stream_as_they_come(openai_client: openai.OpenAI, model: str) -> None:
    request = dict(model=model, messages=[{"role": "user", "content": "Weather?"}], max_tokens=32, seed=6,
                   temperature=1.0, tools=[CITY_TOOL],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = openai_client.chat.completions.create(**request)
    chunks = list(openai_client.chat.completions.create(**request, stream=True))
    calls = [call for c in chunks for choice in c.choices for call in choice.delta.tool_calls or []]
    assert not any(choice.delta.content for c in chunks for choice in c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    (expected,) = whole.choices[0].message.tool_calls or []
    # as vLLM: the first piece opens the call (id, type, name), the others add to its arguments
    opening, *more = calls
    assert opening.id and (opening.type, opening.function.name) == ("function", "get_weather")
    assert len(more) > 2 and all((c.index, c.id, c.type, c.function.name) == (0, None, None, None) for c in more)
    assert "".join(c.function.arguments or "" for c in calls) == expected.function.arguments
    # the openai client's own stream helper puts the pieces together into the same call
    with openai_client.chat.completions.stream(**request) as stream:
        (assembled,) = stream.get_final_completion().choices[0].message.tool_calls or []
    assert (assembled.function.name, assembled.function.arguments) == (expected.function.name,
                                                                       expected.function.arguments)


# the choice makes the random model write a hermes tool call (and a plain answer) as a tool-using model would
HERMES_CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.mark.parametrize(("text", "content", "calls"), [
    (HERMES_CALL, "Checking.\n", [("get_weather", {"city": "Paris", "days": 2})]),
    ("No tool is needed.", "No tool is needed.", []),
])
def test_auto_tool_choice_reads_tool_calls_out_of_the_text_streamed_or_not(
    openai_client: openai.OpenAI, model: str, text: str, content: str, calls: list[tuple[str, dict[str, object]]]
) -> None:
    request = dict(model=model, messages=[{"role": "user", "content": "Weather?"}], max_tokens=64, seed=8, n=2,
                   tools=[CITY_TOOL, CLOCK_TOOL], extra_body={"structured_outputs": {"choice": [text]}})
    finish = "tool_calls" if calls else "stop"
    whole = openai_client.chat.completions.create(**request).choices
    assert [(c.index, c.finish_reason, c.message.content) for c in whole] == [(i, finish, content) for i in (0, 1)]
    for choice in whole:
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == calls
    chunks = [choice for c in openai_client.chat.completions.create(**request, stream=True) for choice in c.choices]
    for index in (0, 1):  # each completion's text is held and released on its own
        mine = [choice for choice in chunks if choice.index == index]
        # the content streams as it comes, the call arrives whole once the output is
        assert "".join(choice.delta.content or "" for choice in mine) == content
        assert len([choice for choice in mine if choice.delta.content]) > (1 if calls else 2)
        streamed = [call for choice in mine for call in choice.delta.tool_calls or []]
        assert [(c.function.name, c.function.arguments) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in whole[index].message.tool_calls or []]
        assert [choice.finish_reason for choice in mine if choice.finish_reason] == [finish]
