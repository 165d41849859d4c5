"""Client commands of `pagedserve`: submit one prompt, or a JSONL file of jobs with a progress bar.

submit-file sends lines to POST /v1/jobs/batch in chunks and reads states with GET /v1/jobs?ids=...,
many jobs per request; 429 and 503 are retried after their Retry-After, and --state makes it resumable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import httpx

from core.settings import Settings

CHUNK_LINES = 100  # lines per POST /v1/jobs/batch
POLL_IDS = 500  # jobs per GET /v1/jobs?ids=... (the API's most)
POLL_INTERVAL_S = 0.5
FINAL = {"succeeded", "failed", "cancelled"}
RETRY_STATUSES = {429, 503}  # the API is busy or a dependency is down: the same request may succeed later
MAX_BACKOFF_S = 30.0


def _client(settings: Settings, args: argparse.Namespace) -> httpx.Client:
    token = args.api_key or os.environ.get("PAGEDSERVE_API_KEY")
    key_file = settings.data_dir.expanduser() / "dev-api-key"
    if not token and key_file.exists():
        token = key_file.read_text().strip()
    base_url = args.api_url or f"http://{settings.host}:{settings.port}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=60)


def _check(response: httpx.Response) -> Any:
    if response.status_code == 401:
        sent = "the key sent was refused" if response.request.headers.get("Authorization") else "no key was sent"
        sys.exit(f"error 401: {response.text}\n{sent}: pass --api-key KEY or set PAGEDSERVE_API_KEY (a token the "
                 "server was started with, or one from `pagedserve keys create`)")
    if response.is_error:
        sys.exit(f"error {response.status_code}: {response.text}")
    return response.json()


def cmd_submit(settings: Settings, args: argparse.Namespace) -> None:
    """Submit one prompt; with --wait stream its tokens and print the final job."""
    body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": args.temperature}
    with _client(settings, args) as client:
        job = _check(client.post("/v1/jobs", json=body))
        if not args.wait:
            print(json.dumps(job, indent=2))
            return
        with client.stream("GET", f"/v1/jobs/{job['id']}/events", timeout=None) as response:
            event = None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: ") and event == "token":
                    print(json.loads(line.removeprefix("data: "))["text"], end="", flush=True)
                elif line.startswith("data: ") and event == "restart":  # the text printed so far is void
                    attempt = json.loads(line.removeprefix("data: "))["attempt"]
                    print(f"\n[the job started over after a worker failure (attempt {attempt}); its text follows "
                          "anew]", file=sys.stderr, flush=True)
        print()
        print(json.dumps(_check(client.get(f"/v1/jobs/{job['id']}")), indent=2), file=sys.stderr)


def _lines_of(path: str) -> tuple[list[str], list[int]]:
    """The non-blank lines of a JSONL file, each checked to be a JSON object (exits naming the first that is not),
    and each one's line number in the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        sys.exit(f"{path}: cannot read it as a UTF-8 JSONL file: {exc}")
    numbered = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    for number, line in numbered:
        try:
            if not isinstance(json.loads(line), dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            sys.exit(f"{path}: line {number} is not a JSON object with a job: {exc}")
    return [line for _, line in numbered], [number for number, _ in numbered]


def _refused_line(response: httpx.Response, path: str, numbers: list[int]) -> str | None:
    """For a chunk refused because of one of its jobs (`jobs.<i>.<field>`), which line of the file, and why."""
    if response.status_code not in (400, 422):
        return None
    try:
        error = response.json()["error"]
        index, field = str(error["field"]).removeprefix("jobs.").split(".", 1)
        number = numbers[int(index)]
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    message = str(error["message"]).replace(f"jobs.{index}.", "")
    return f"{path}: line {number} was refused ({field}): {message}; lines {numbers[0]} on were not submitted"


def retry_delay_s(response: httpx.Response | None, attempt: int) -> float:
    """How long to wait before retry `attempt` (0 first): Retry-After (seconds or an HTTP date), else a backoff."""
    header = response.headers.get("Retry-After", "") if response is not None else ""
    try:
        return max(0.0, float(header))
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(header) - datetime.now(UTC)).total_seconds())
    except (TypeError, ValueError):
        return min(MAX_BACKOFF_S, 0.5 * 2**attempt)


def send(client: httpx.Client, method: str, url: str, retry_for_s: float,
         explain: Callable[[httpx.Response], str | None] | None = None, **kwargs: Any) -> Any:
    """The JSON answer of a request retried on 429, 503 and refused connections for up to retry_for_s seconds; an
    error that `explain` puts in words exits with those words."""
    deadline, attempt = time.monotonic() + retry_for_s, 0
    while True:
        response = None
        try:
            response = client.request(method, url, **kwargs)
            if response.status_code not in RETRY_STATUSES:
                if explain is not None and (why_not := explain(response)) is not None:
                    sys.exit(why_not)
                return _check(response)
            why = f"HTTP {response.status_code}"
        except httpx.ConnectError as exc:  # nothing reached the API, so sending again cannot duplicate jobs
            why = f"connection failed ({exc})"
        delay = retry_delay_s(response, attempt)
        if time.monotonic() + delay > deadline:
            sys.exit(f"{method} {url}: still {why} after retrying for {retry_for_s:g} s")
        print(f"{method} {url}: {why}; retrying in {delay:g} s", file=sys.stderr)
        time.sleep(delay)
        attempt += 1


def _accepted_before(state_path: Path | None, lines: list[str]) -> list[str]:
    """Job ids of the lines a previous run with this state file had accepted (a prefix of the file)."""
    if state_path is None or not state_path.exists():
        return []
    try:
        state = json.loads(state_path.read_text())
        job_ids, recorded = [str(job_id) for job_id in state["job_ids"]], str(state["prefix_sha256"])
    except (ValueError, KeyError, TypeError) as exc:
        sys.exit(f"--state {state_path}: not a submit-file state file ({exc!r})")
    if len(job_ids) > len(lines) or _prefix_digest(lines[:len(job_ids)]).hexdigest() != recorded:
        sys.exit(f"--state {state_path}: the {len(job_ids)} lines it records as accepted are not the first lines "
                 "of this file; give another --state (or delete it) to submit the file anew")
    return job_ids


def _prefix_digest(lines: list[str]) -> Any:
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode() + b"\n")
    return digest


def _save_state(state_path: Path, digest: Any, job_ids: list[str]) -> None:
    # written whole then renamed, so a crash leaves the previous state, never half of one
    partial = state_path.with_name(state_path.name + ".partial")
    partial.write_text(json.dumps({"prefix_sha256": digest.hexdigest(), "job_ids": job_ids}))
    partial.replace(state_path)


def _wait_all(client: httpx.Client, job_ids: list[str], retry_for_s: float) -> dict[str, dict[str, Any]]:
    """Each job once final, read POLL_IDS jobs per request, with a progress bar."""
    from tqdm import tqdm

    results: dict[str, dict[str, Any]] = {}
    with tqdm(total=len(job_ids), desc="jobs", unit="job", file=sys.stderr) as bar:
        while True:
            pending = [job_id for job_id in job_ids if job_id not in results]
            for start in range(0, len(pending), POLL_IDS):
                ids = ",".join(pending[start:start + POLL_IDS])
                for job in send(client, "GET", "/v1/jobs", retry_for_s, params={"ids": ids})["data"]:
                    if job["status"] in FINAL:
                        results[job["id"]] = job
                        bar.update(1)
            if len(results) == len(job_ids):
                return results
            time.sleep(POLL_INTERVAL_S)


def _check_output(path: str | None, input_path: str) -> None:
    """Exit before anything is submitted unless the results can be written to `path` (its folder exists and lets us
    write, and it is not the input); nothing there is truncated yet."""
    if path is None:
        return
    target = Path(path)
    if target.exists() and Path(input_path).exists() and target.samefile(input_path):
        sys.exit(f"--output {path}: is the input file; give another path")
    try:
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        sys.exit(f"--output {path}: cannot write it: {exc}")


def _write_results(path: str | None, lines: list[str]) -> None:
    """The results as JSONL, to stdout or written whole then renamed into `path` (an interrupted run leaves an
    earlier run's results)."""
    if path is None:
        sys.stdout.writelines(lines)
        return
    partial = Path(path).with_name(Path(path).name + ".partial")
    partial.write_text("".join(lines), encoding="utf-8")
    partial.replace(path)


def cmd_submit_file(settings: Settings, args: argparse.Namespace) -> None:
    """Submit every line of a JSONL file as a job (resumably with --state), wait for all, write results as JSONL."""
    lines, numbers = _lines_of(args.path)
    state_path = Path(args.state) if args.state else None
    job_ids = _accepted_before(state_path, lines)
    if job_ids:
        print(f"resuming: {len(job_ids)} of {len(lines)} lines were accepted by an earlier run", file=sys.stderr)
    digest = _prefix_digest(lines[:len(job_ids)])
    _check_output(args.output, args.path)
    with _client(settings, args) as client:
        # a chunk is accepted all or none, in file order, so the accepted lines are always a prefix of the file
        for start in range(len(job_ids), len(lines), CHUNK_LINES):
            chunk = lines[start:start + CHUNK_LINES]
            accepted = send(client, "POST", "/v1/jobs/batch", args.retry_for,
                            lambda response: _refused_line(response, args.path, numbers[start:]),
                            json={"jobs": [json.loads(line) for line in chunk]})
            job_ids += [job["id"] for job in accepted["data"]]
            digest.update("".join(line + "\n" for line in chunk).encode())
            if state_path is not None:
                _save_state(state_path, digest, job_ids)
        results = _wait_all(client, job_ids, args.retry_for)
    _write_results(args.output, [json.dumps(results[job_id]) + "\n" for job_id in job_ids])


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:  # nan too
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


def add_client_commands(commands: argparse._SubParsersAction) -> None:
    """Register submit and submit-file on the CLI."""
    submit = commands.add_parser("submit", help=cmd_submit.__doc__)
    submit.add_argument("prompt")
    submit.add_argument("--wait", action="store_true", help="stream tokens and wait for the result")
    submit.add_argument("--max-tokens", type=int, default=64)
    submit.add_argument("--temperature", type=float, default=0.0)
    submit.set_defaults(handler=cmd_submit)
    submit_file = commands.add_parser("submit-file", help=cmd_submit_file.__doc__)
    submit_file.add_argument("path", help="JSONL file, one POST /v1/jobs body per line")
    submit_file.add_argument("--output", help="where to write the final jobs as JSONL (default: stdout)")
    submit_file.add_argument("--state", help="file recording the lines accepted so far; a rerun with it resumes")
    submit_file.add_argument("--retry-for", type=_positive_seconds, default=600.0, metavar="SECONDS",
                             help="keep retrying a request answered 429/503 or refused this long (default: 600)")
    submit_file.set_defaults(handler=cmd_submit_file)
    for sub in (submit, submit_file):
        sub.add_argument("--api-url", help="API base URL (default: http://HOST:PORT from the settings)")
        sub.add_argument("--api-key", help="API key (default: $PAGEDSERVE_API_KEY, else the dev key of `up`)")
