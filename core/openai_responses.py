"""OpenAI response bodies (completion, chat completion, stream chunks, errors) built from jobs and token deltas.

Torch-free and HTTP-free: the API answers with them, and a worker writes a finished batch's output file with them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

from core.job_payload import REFUSED
from core.model_files import model_names
from core.models import Job, JobStatus
from core.prompts import configured_prompt_model
from core.sampling_fields import SAMPLING_FIELDS
from core.settings import get_settings
from core.tool_calls import NAMED_PREFIX, streamable_content, tool_calls

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
RESPONSES = "/v1/responses"
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                409: "conflict_error", 413: "invalid_request_error"}


class JobFailure(NamedTuple):
    """Why a final job has no answer for its client: the HTTP status to answer with, the message, and the job field
    a refusal blames (None otherwise)."""

    status_code: int
    message: str
    field: str | None = None


# a refusal's message begins with the job field it blames ("allowed_token_ids holds only stop tokens...",
# "structured_outputs.choice could not be followed..."), after the runner's prefix when the params were invalid, or
# the engine's exception name when a constraint broke down while generating
_BLAMED_FIELD = re.compile(r"(?:invalid sampling parameters: |[A-Z][A-Za-z]*Error: )?([a-z_]+)(\.[a-z_]+)?\b")
_PROMPT_FIELDS = frozenset({"prompt", "prompt_token_ids", "messages"})


def _refusal_field(refusal: str) -> str | None:
    """The job field a refusal's message names first, if it names one."""
    match = _BLAMED_FIELD.match(refusal)
    if match is None or not (match.group(1) in SAMPLING_FIELDS or match.group(1) in _PROMPT_FIELDS):
        return None
    return match.group(1) + (match.group(2) or "")


def served_model_names() -> list[str]:
    """The model names this server answers to: --served-model-name, else the configured model (a built-in one by
    its name and its Hugging Face id, the one given first)."""
    settings = get_settings()
    return settings.served_model_name or model_names(settings.model)


def served_model_id() -> str:
    """The name responses carry when a request named none: the first served name."""
    return served_model_names()[0]


def answer_model(job: Job) -> str:
    """The served name a job's OpenAI answer carries: the one its request asked for, else the first."""
    return str((job.metadata_ or {}).get("openai_model") or served_model_id())


def error_object(status_code: int, message: str, param: str | None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for a status, message and the parameter to blame."""
    error_type = "server_error" if status_code >= 500 else _ERROR_TYPES.get(status_code, "invalid_request_error")
    return {"message": message, "type": error_type, "param": param, "code": code}


def error_status(error: dict[str, Any]) -> int:
    """The HTTP status an error object from ``error_object`` stands for (400 for every invalid request)."""
    if error["type"] == "server_error":
        return 500
    return next((status for status, kind in _ERROR_TYPES.items() if kind == error["type"] and status != 413), 400)


def job_failure(job: Job) -> JobFailure | None:
    """Why a final job has no answer for its client, or None when it succeeded."""
    if job.status is JobStatus.succeeded:
        return None
    if job.status is JobStatus.cancelled:
        return JobFailure(409, f"job {job.id} was cancelled before it finished")
    error = job.error or ""
    if error.startswith(REFUSED):
        return JobFailure(400, f"job {job.id} failed: {error}", _refusal_field(error.removeprefix(REFUSED)))
    return JobFailure(500, f"job {job.id} failed: {error}")


def _created(job: Job) -> int:
    return int(job.created_at.timestamp())


def _finish_reason(choice: dict[str, Any]) -> str:
    return "length" if choice.get("finish_reason") == "length" else "stop"


def echo_only(job: Job) -> bool:
    """Whether the job answers a completion that asked for its prompt alone (echo, max_tokens 0): the token it made
    is left out of the answer and of its usage."""
    return bool((job.metadata_ or {}).get("openai_echo_only"))


def usage(job: Job, completion_tokens: int | None = None) -> dict[str, Any]:
    """Token counts of a finished job, or of a running one that has generated `completion_tokens` so far; the prompt
    tokens the prefix cache served as OpenAI's `prompt_tokens_details.cached_tokens` (recorded with the result, so 0
    while the job runs)."""
    prompt_tokens = job.prompt_tokens or 0
    completion_tokens = job.completion_tokens or 0 if completion_tokens is None else completion_tokens
    if echo_only(job):
        completion_tokens = 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": job.cached_prompt_tokens or 0}}


def total_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The token counts of several jobs added up."""
    totals = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {**totals, "prompt_tokens_details": {
        "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)}}


def chat_echo(job: Job) -> str:
    """The text a chat answer starts with where the request asked for echo: its final message's, when that message
    has the answer's role (''; see ChatCompletionRequest's echo)."""
    return str((job.metadata_ or {}).get("openai_chat_echo") or "")


def echoed_prompt(job: Job) -> str:
    """The prompt text a completion with `echo: true` starts with ('' without echo)."""
    return job.prompt if (job.metadata_ or {}).get("openai_echo") else ""


def _token_text(token_id: int) -> str:
    return configured_prompt_model().tokenizer.decode([token_id], skip_special_tokens=False)


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


TokenNamer = Callable[[int], str]


def token_namer(job: Job) -> TokenNamer:
    """How a job's logprobs name tokens: by their text, or as `token_id:<id>` where the request asked for
    vLLM's `return_tokens_as_token_ids` (so a client recovers the exact ids)."""
    return _token_id_text if (job.metadata_ or {}).get("openai_token_ids") else _token_text


class Named(NamedTuple):
    """A token of a logprobs answer: its id and the name the answer gives it."""

    token_id: int
    name: str


# (token, its logprob, the top alternatives); no logprob nor alternatives for a prompt's first token
Step = tuple[Named, float | None, list[tuple[Named, float]] | None]


def _steps(token_ids: list[int], logprobs: list[dict[str, float] | None], num_top: int, name: TokenNamer) -> list[Step]:
    """One step per token; the engine adds each token to its own top-k, so it is always there."""
    steps: list[Step] = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        if step is None:  # nothing predicts a prompt's first token
            steps.append((Named(token_id, name(token_id)), None, None))
            continue
        top = sorted(((int(k), v) for k, v in step.items()), key=lambda kv: -kv[1])[:num_top]
        steps.append((Named(token_id, name(token_id)), step[str(token_id)], [(Named(i, name(i)), lp) for i, lp in top]))
    return steps


def _completion_logprobs(steps: list[Step], offset: int = 0) -> dict[str, Any]:
    offsets = []
    for token, _, _ in steps:
        offsets.append(offset)
        offset += len(token.name)
    return {
        "tokens": [token.name for token, _, _ in steps],
        "token_logprobs": [logprob for _, logprob, _ in steps],
        # the chosen token is always among a completion's (up to logprobs + 1 entries), as OpenAI and vLLM do
        "top_logprobs": [None if top is None else {**{t.name: v for t, v in top}, token.name: lp}
                         for token, lp, top in steps],
        "text_offset": offsets,
    }


def _chat_logprobs(steps: list[Step]) -> dict[str, Any]:
    token_bytes = configured_prompt_model().token_bytes

    def entry(token: Named, logprob: float | None) -> dict[str, Any]:
        # the token's own bytes: a piece of a character (an emoji's) names itself U+FFFD, its bytes are exact
        return {"token": token.name, "logprob": logprob, "bytes": list(token_bytes(token.token_id))}

    content = [{**entry(token, lp), "top_logprobs": [entry(t, v) for t, v in top or []]} for token, lp, top in steps]
    return {"content": content, "refusal": None}


def delta_logprobs(endpoint: str, delta: dict[str, Any], num_top: int, text_offset: int,
                   name: TokenNamer) -> dict[str, Any]:
    """The logprobs of a stream chunk's new tokens (`delta`: token_ids and their logprobs); a completion's
    text_offset counts on from `text_offset`, the length of the tokens streamed before."""
    steps = _steps(delta["token_ids"], delta["logprobs"], num_top, name)
    return _chat_logprobs(steps) if endpoint == CHAT_COMPLETIONS else _completion_logprobs(steps, text_offset)


def echo_logprobs(scores: dict[str, Any], num_top: int, name: TokenNamer) -> dict[str, Any]:
    """The logprobs of a completion's echoed prompt (`scores`: its prompt_token_ids and prompt_logprobs), the first
    token's null: what a stream's echo chunk carries."""
    return _completion_logprobs(_steps(scores["prompt_token_ids"], scores["prompt_logprobs"], num_top, name))


def _choice_steps(job: Job, choice: dict[str, Any], num_top: int, with_prompt: bool) -> list[Step]:
    """A choice's generated tokens' steps, after its prompt's when asked for and kept (echo with logprobs)."""
    name = token_namer(job)
    generated = choice.get("logprobs") and not echo_only(job)
    steps = _steps(choice["token_ids"], choice["logprobs"], num_top, name) if generated else []
    if with_prompt and choice.get("prompt_logprobs"):
        steps = _steps(choice["prompt_token_ids"], choice["prompt_logprobs"], num_top, name) + steps
    return steps


def completion_body(job: Job, model: str) -> dict[str, Any]:
    """The text_completion object of a succeeded job (with echo and logprobs, the prompt's tokens are scored too)."""
    num_top = job.params.get("logprobs")
    echo = echoed_prompt(job)

    def logprobs(choice: dict[str, Any]) -> dict[str, Any] | None:
        steps = _choice_steps(job, choice, num_top, bool(echo)) if num_top is not None else []
        return _completion_logprobs(steps) if steps else None

    choices = [{"index": c["index"], "text": echo + ("" if echo_only(job) else c["text"]),
                "finish_reason": _finish_reason(c),
                "stop_reason": c.get("stop_reason"), "logprobs": logprobs(c)} for c in job.output or []]
    return {"id": job.id, "object": "text_completion", "created": _created(job), "model": model,
            "choices": choices, "usage": usage(job)}


def _tool_mode(job: Job) -> str | None:
    """How the job's chat output becomes tool calls (core.tool_calls' modes), or None."""
    mode = (job.metadata_ or {}).get("openai_tool_choice")
    return str(mode) if mode else None


def _call_id_prefix(job: Job, index: int) -> str:
    """What the ids of the tool calls of a job's choice `index` begin with (then the call's position)."""
    return f"call_{job.id}_{index}_"


def _tool_calls(job: Job, choice: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(content, tool calls) of a chat choice whose request asked for tool calls (forced, or "auto" read by a
    parser); None without them, or when max_tokens cut the output off (the text is then answered as content). With
    parallel_tool_calls false a parser's first call alone is answered, as vLLM does."""
    mode = _tool_mode(job)
    if mode is None or choice.get("finish_reason") == "length":
        return None
    names = (job.metadata_ or {}).get("openai_tool_names")
    offered = None if names is None else str(names).split(",")
    parsed = tool_calls(mode, choice["text"], _call_id_prefix(job, choice["index"]), offered)
    if parsed is None or parallel_tool_calls(job):
        return parsed
    return parsed[0], parsed[1][:1]


def parallel_tool_calls(job: Job) -> bool:
    """Whether the job's request allowed several tool calls in one answer (OpenAI's parallel_tool_calls)."""
    return bool((job.metadata_ or {}).get("openai_parallel_tool_calls", True))


def streamed_call_name(job: Job) -> str | None:
    """The function a chat job's output is the arguments of, when its tool_choice names one: a stream sends that
    output as the call's arguments as it comes, as vLLM does; None for other jobs."""
    mode = _tool_mode(job)
    return mode.removeprefix(NAMED_PREFIX) if mode is not None and mode.startswith(NAMED_PREFIX) else None


def arguments_delta(job: Job, index: int, text: str, first: bool) -> dict[str, Any]:
    """The chat delta carrying `text` as more arguments of a named call (see `streamed_call_name`) of the job's
    choice `index`: the first one opens the call with its id, type and name."""
    call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
    if first:
        call = {"index": 0, "id": f"{_call_id_prefix(job, index)}0", "type": "function",
                "function": {"name": streamed_call_name(job), "arguments": text}}
    return {"tool_calls": [call]}


def _chat_finish_reason(job: Job, choice: dict[str, Any]) -> str:
    # a call the request named is its answer, not the model's choice to call: "stop", as OpenAI and vLLM say
    called = _tool_calls(job, choice) is not None and streamed_call_name(job) is None
    return "tool_calls" if called else _finish_reason(choice)


def chat_body(job: Job, model: str) -> dict[str, Any]:
    """The chat.completion object of a succeeded job; tool calls come as the message's tool_calls."""
    num_top = job.params.get("logprobs")

    echo = chat_echo(job)

    def message(choice: dict[str, Any]) -> dict[str, Any]:
        parsed = _tool_calls(job, choice)
        if parsed is None:
            return {"role": "assistant", "content": echo + choice["text"]}
        content, calls = parsed
        return {"role": "assistant", "content": echo + (content or "") if echo else content, "tool_calls": calls}

    choices = [{
        "index": c["index"], "message": message(c), "finish_reason": _chat_finish_reason(job, c),
        "stop_reason": c.get("stop_reason"),
        "logprobs": _chat_logprobs(steps) if num_top is not None and (steps := _choice_steps(job, c, num_top, False))
        else None,
    } for c in job.output or []]
    return {"id": job.id, "object": "chat.completion", "created": _created(job), "model": model,
            "choices": choices, "usage": usage(job)}


def streamed_content_filter(job: Job) -> Callable[[str], int] | None:
    """For a chat job whose output may become tool calls: how much of a choice's text so far a stream may send (the
    rest is held, and sent by `tool_call_deltas` once the job is done): content up to where a call may begin, or all
    of a named call's arguments; None for other jobs."""
    mode = _tool_mode(job)
    if mode is None:
        return None
    return len if streamed_call_name(job) is not None else lambda text: streamable_content(mode, text)


def tool_call_deltas(job: Job, prompt_index: int, streamed: dict[int, int]) -> list[dict[str, Any]]:
    """The chunk choices that close a finished tool-call job's stream: the content not yet sent (all the text held,
    where the output holds no calls) and the calls; `streamed` tells how many characters of each choice's text were
    sent, as content or as a named call's arguments (fewer than all when token events were lost)."""
    deltas = []
    named = streamed_call_name(job) is not None
    for c in job.output or []:
        if named and streamed.get(c["index"]):  # the call was opened: only the arguments not yet sent are left
            if rest := c["text"][streamed[c["index"]]:]:
                deltas.append({"index": choice_index(job, prompt_index, c["index"]),
                               "delta": arguments_delta(job, c["index"], rest, first=False), "finish_reason": None})
            continue
        parsed = _tool_calls(job, c)
        rest = (c["text"] if parsed is None else parsed[0] or "")[streamed.get(c["index"], 0):]
        delta: dict[str, Any] = {"content": rest} if rest else {}
        if parsed is not None:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(parsed[1])]
        if delta:
            deltas.append({"index": choice_index(job, prompt_index, c["index"]), "delta": delta,
                           "finish_reason": None})
    return deltas


def response_body(job: Job, model: str, endpoint: str) -> dict[str, Any]:
    """The response object of a succeeded job for its endpoint."""
    return chat_body(job, model) if endpoint == CHAT_COMPLETIONS else completion_body(job, model)


def merged_body(jobs: list[Job], model: str, endpoint: str) -> dict[str, Any]:
    """One response for the jobs of a multi-prompt request: prompt i's choices are numbered i * n + j, as OpenAI."""
    bodies = [response_body(job, model, endpoint) for job in jobs]
    choices = [{**c, "index": choice_index(job, i, c["index"])}
               for i, (job, body) in enumerate(zip(jobs, bodies, strict=True)) for c in body["choices"]]
    return {**bodies[0], "choices": choices, "usage": total_usage([b["usage"] for b in bodies])}


def choice_index(job: Job, prompt_index: int, index: int) -> int:
    """The response-wide index of a job's choice `index` when the job answers prompt `prompt_index`."""
    return prompt_index * job.params["n"] + index


def chunk(job: Job, model: str, endpoint: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """One stream chunk; each choice has index plus text (completions) or delta (chat), and finish_reason."""
    obj = "chat.completion.chunk" if endpoint == CHAT_COMPLETIONS else "text_completion"
    return {"id": job.id, "object": obj, "created": _created(job), "model": model,
            "choices": [{"logprobs": None, **c} for c in choices]}


def delta_choice(endpoint: str, index: int, text: str, finish_reason: str | None = None) -> dict[str, Any]:
    """One choice of a stream chunk carrying new text."""
    if endpoint == CHAT_COMPLETIONS:
        return {"index": index, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}
    return {"index": index, "text": text, "finish_reason": finish_reason}


def final_choices(job: Job, endpoint: str, prompt_index: int = 0) -> list[dict[str, Any]]:
    """The closing choice of each completion: no new text, its finish reason and (vLLM's) stop reason."""
    finish = _chat_finish_reason if endpoint == CHAT_COMPLETIONS else lambda _job, c: _finish_reason(c)
    return [{**delta_choice(endpoint, choice_index(job, prompt_index, c["index"]), "", finish(job, c)),
             "stop_reason": c.get("stop_reason")} for c in job.output or []]
