"""Fair share between API keys: how long a light key's jobs wait behind a heavy key's backlog at the same priority.

    python -m benchmarks.tenant_fairness --backlog 400 --light-jobs 8 [--base REV]

Starts `pagedserve up` (fresh data directory, its own embedded Redis, `--max-num-seqs` slots) and makes a second
API key. The heavy key (up's own) queues a backlog at once through POST /v1/jobs/batch; then the light key
submits one job every `--light-interval-s`. A job's queue wait is started_at - created_at. In the same run, the
light key's median wait is divided by the heavy key's (over the heavy jobs that started): first in first out
makes a light job wait for the whole backlog ahead of it, longer than most heavy jobs (a ratio above 1); fair
share gives it about one turn (well below 1). Once the light jobs are done the backlog's queued jobs are
cancelled. With `--base REV` the same run is made on a git worktree of that revision too. Writes JSON (with the
machine), a table and a bar chart.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import RESULTS_DIR, machine, percentile, print_table, save_bar_chart, write_json
from benchmarks.kernel_revisions import checked_out, resolve_revision
from benchmarks.serve import checkout_env, pagedserve_up, positive_int

BATCH_LIMIT = 1000  # jobs per POST /v1/jobs/batch
IDS_PER_READ = 500  # jobs per GET /v1/jobs?ids=...
FINAL = {"succeeded", "failed", "cancelled"}


def _body(args: argparse.Namespace, text: str) -> dict[str, Any]:
    return {"prompt": text, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}


async def _queue_backlog(http: httpx.AsyncClient, args: argparse.Namespace) -> list[str]:
    ids: list[str] = []
    while len(ids) < args.backlog:
        count = min(BATCH_LIMIT, args.backlog - len(ids))
        jobs = [_body(args, f"Backlog job {len(ids) + i}: say something") for i in range(count)]
        response = await http.post("/v1/jobs/batch", json={"jobs": jobs})
        response.raise_for_status()
        ids += [job["id"] for job in response.json()["data"]]
    return ids


async def _submit_light(http: httpx.AsyncClient, args: argparse.Namespace) -> list[str]:
    ids = []
    for index in range(args.light_jobs):
        response = await http.post("/v1/jobs", json=_body(args, f"Light job {index}: say something"))
        response.raise_for_status()
        ids.append(response.json()["id"])
        await asyncio.sleep(args.light_interval_s)
    return ids


async def _jobs(http: httpx.AsyncClient, ids: list[str]) -> list[dict[str, Any]]:
    jobs = []
    for start in range(0, len(ids), IDS_PER_READ):
        response = await http.get("/v1/jobs", params={"ids": ",".join(ids[start:start + IDS_PER_READ])})
        response.raise_for_status()
        jobs += response.json()["data"]
    return jobs


def _waits_s(jobs: list[dict[str, Any]]) -> list[float]:
    return [(datetime.fromisoformat(j["started_at"]) - datetime.fromisoformat(j["created_at"])).total_seconds()
            for j in jobs if j["started_at"]]


async def measure(args: argparse.Namespace, url: str, heavy_key: str, light_key: str) -> dict[str, Any]:
    """Queue the backlog, trickle the light jobs in, wait for them, cancel what the backlog has left; measure."""
    def client(key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120)

    async with client(heavy_key) as heavy, client(light_key) as light:
        started = time.perf_counter()
        heavy_ids = await _queue_backlog(heavy, args)
        light_ids = await _submit_light(light, args)
        deadline = time.monotonic() + args.timeout_s
        light_jobs = await _jobs(light, light_ids)
        while not all(j["status"] in FINAL for j in light_jobs) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            light_jobs = await _jobs(light, light_ids)
        light_done_s = time.perf_counter() - started
        heavy_jobs = await _jobs(heavy, heavy_ids)
        for job in heavy_jobs:
            if job["status"] == "queued":
                await heavy.post(f"/v1/jobs/{job['id']}/cancel")
    light_waits, heavy_waits = _waits_s(light_jobs), _waits_s(heavy_jobs)
    return {
        "light_finished": sum(j["status"] == "succeeded" for j in light_jobs),
        "light_wait_p50_s": percentile(light_waits, 50), "light_wait_max_s": max(light_waits, default=float("nan")),
        "heavy_started": len(heavy_waits), "heavy_wait_p50_s": percentile(heavy_waits, 50),
        "light_over_heavy_wait_p50": percentile(light_waits, 50) / percentile(heavy_waits, 50),
        "light_done_s": light_done_s,
    }


def _light_key(source: Path | None, data_dir: Path) -> str:
    made = subprocess.run([sys.executable, "-m", "cli.main", "keys", "create", "--name", "light", "--data-dir",
                           str(data_dir)], capture_output=True, text=True, check=True, **checkout_env(source))
    return made.stdout.splitlines()[0]


def run_side(args: argparse.Namespace, side: str, source: Path | None) -> dict[str, Any]:
    """One run on a fresh `pagedserve up` of the checkout `source` (this one when None)."""
    with tempfile.TemporaryDirectory(prefix="tenant-fairness-") as scratch:
        work_dir = Path(scratch)
        flags = ["--max-num-seqs", str(args.max_num_seqs), *shlex.split(args.pagedserve_flags)]
        with pagedserve_up(args.model, flags, work_dir, source=source) as service:
            light_key = _light_key(source, work_dir / "data")
            result = asyncio.run(measure(args, service.target.base_url, service.target.api_key, light_key))
    return {"side": side, "backlog": args.backlog, **result}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or HF folder")
    parser.add_argument("--max-num-seqs", type=positive_int, default=16, help="the worker's slots")
    parser.add_argument("--pagedserve-flags", default="", help="more `pagedserve up` flags, e.g. '--dtype float32'")
    parser.add_argument("--backlog", type=positive_int, default=400, help="jobs the heavy key queues at once")
    parser.add_argument("--light-jobs", type=positive_int, default=8)
    parser.add_argument("--light-interval-s", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=positive_int, default=8, help="output tokens of every job")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up waiting for the light jobs")
    parser.add_argument("--base", help="also run a git revision (checked out into a temporary worktree)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="tenant_fairness", help="file names of the results: <name>.json, .png")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the working tree (and the base revision), print the table, write JSON and the chart."""
    args = parse_args(argv)
    rows = [run_side(args, "head", None)]
    base = resolve_revision(args.base) if args.base else None
    if base:
        with checked_out(base) as worktree:
            rows.append(run_side(args, f"base {base[:12]}", worktree))
    print_table("queue wait behind another key's backlog", rows,
                ["side", "backlog", "light_finished", "light_wait_p50_s", "light_wait_max_s", "heavy_started",
                 "heavy_wait_p50_s", "light_over_heavy_wait_p50", "light_done_s"])
    payload = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "base_commit": base,
               "rows": rows}
    print("wrote", write_json(args.name, payload, args.out))
    save_bar_chart([f"{r['side']}: {who}" for r in rows for who in ("light p50", "heavy p50")],
                   [r[f"{who}_wait_p50_s"] for r in rows for who in ("light", "heavy")], "queue wait (s)",
                   f"Queue wait behind a {args.backlog}-job backlog of another key", args.out / f"{args.name}.png")
    return payload


if __name__ == "__main__":
    main()
