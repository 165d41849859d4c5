"""Client commands of `pagedserve`: submit one prompt, or a JSONL file of jobs with a progress bar."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from api.settings import Settings

BATCH_SIZE = 100
FINAL = {"succeeded", "failed", "cancelled"}


def _client(settings: Settings, args: argparse.Namespace) -> httpx.Client:
    token = args.api_key or os.environ.get("PAGEDSERVE_API_KEY")
    key_file = settings.data_dir.expanduser() / "dev-api-key"
    if not token and key_file.exists():
        token = key_file.read_text().strip()
    base_url = args.api_url or f"http://{settings.host}:{settings.port}"
    return httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def _check(response: httpx.Response) -> Any:
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
        print()
        print(json.dumps(_check(client.get(f"/v1/jobs/{job['id']}")), indent=2), file=sys.stderr)


def cmd_submit_file(settings: Settings, args: argparse.Namespace) -> None:
    """Submit every line of a JSONL file as a job, wait for all with a progress bar, write the results as JSONL."""
    from tqdm import tqdm

    lines = [json.loads(line) for line in Path(args.path).read_text().splitlines() if line.strip()]
    with _client(settings, args) as client:
        ids: list[str] = []
        for start in range(0, len(lines), BATCH_SIZE):
            batch = _check(client.post("/v1/jobs/batch", json={"jobs": lines[start:start + BATCH_SIZE]}))
            ids += [job["id"] for job in batch["data"]]
        results: dict[str, dict[str, Any]] = {}
        with tqdm(total=len(ids), desc="jobs", unit="job", file=sys.stderr) as bar:
            while len(results) < len(ids):
                for job_id in [i for i in ids if i not in results]:
                    job = _check(client.get(f"/v1/jobs/{job_id}"))
                    if job["status"] in FINAL:
                        results[job_id] = job
                        bar.update(1)
                time.sleep(0.5)
    out = open(args.output, "w") if args.output else sys.stdout
    for job_id in ids:
        out.write(json.dumps(results[job_id]) + "\n")


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
    submit_file.set_defaults(handler=cmd_submit_file)
    for sub in (submit, submit_file):
        sub.add_argument("--api-url", help="API base URL (default: http://HOST:PORT from the settings)")
        sub.add_argument("--api-key", help="API key (default: $PAGEDSERVE_API_KEY, else the dev key of `up`)")
