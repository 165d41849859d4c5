"""Bounded load test of a running service: many jobs from concurrent clients, then wait until every one finished.

    python -m benchmarks.service_load --url http://127.0.0.1:8000 --api-key psk_... --jobs 2000 --clients 8

Use a fresh API key (completion is judged by that key's queued and running jobs). Prints and writes
accepted jobs/s, p50/p99 submit latency, and end-to-end completion time.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import RESULTS_DIR, machine, percentile, print_table, write_json


async def _client(http: httpx.AsyncClient, next_index: list[int], total: int, max_tokens: int,
                  latencies_s: list[float], stats: dict[str, int]) -> None:
    while next_index[0] < total:
        index = next_index[0]
        next_index[0] += 1
        body = {"prompt": f"Load test job {index}: say something", "max_tokens": max_tokens}
        while True:
            started = time.perf_counter()
            response = await http.post("/v1/jobs", json=body)
            if response.status_code != 429:
                break
            stats["throttled"] += 1
            await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
        latencies_s.append(time.perf_counter() - started)
        stats["accepted" if response.status_code == 202 else "refused"] += 1


async def _unfinished(http: httpx.AsyncClient) -> int:
    counts = [len((await http.get("/v1/jobs", params={"status": s, "limit": 1})).json()["data"])
              for s in ("queued", "running")]
    return sum(counts)


async def _final_jobs(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    jobs, cursor = [], None
    while True:
        params = {"limit": 500, **({"cursor": cursor} if cursor else {})}
        page = (await http.get("/v1/jobs", params=params)).json()
        jobs += page["data"]
        cursor = page["next_cursor"]
        if not cursor:
            return jobs


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Submit, wait, and measure."""
    headers = {"Authorization": f"Bearer {args.api_key}"}
    limits = httpx.Limits(max_connections=args.clients * 2)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=60, limits=limits) as http:
        latencies_s: list[float] = []
        stats = {"accepted": 0, "refused": 0, "throttled": 0}
        started = time.perf_counter()
        next_index = [0]  # shared by the clients: each takes the next job number
        await asyncio.gather(*[_client(http, next_index, args.jobs, args.max_tokens, latencies_s, stats)
                               for _ in range(args.clients)])
        submit_s = time.perf_counter() - started
        deadline = time.monotonic() + args.timeout_s
        while await _unfinished(http) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        completion_s = time.perf_counter() - started
        jobs = await _final_jobs(http)
    states = ("succeeded", "failed", "cancelled", "queued", "running")
    statuses = {s: sum(j["status"] == s for j in jobs) for s in states}
    e2e_s = [(datetime.fromisoformat(j["finished_at"]) - datetime.fromisoformat(j["created_at"])).total_seconds()
             for j in jobs if j["finished_at"]]
    return {
        "jobs": args.jobs, "clients": args.clients, "max_tokens": args.max_tokens, **stats,
        "accepted_jobs_per_s": stats["accepted"] / submit_s, "submit_s": submit_s,
        "submit_latency_p50_ms": percentile(latencies_s, 50) * 1000,
        "submit_latency_p99_ms": percentile(latencies_s, 99) * 1000,
        "completion_s": completion_s, "job_e2e_p50_s": percentile(e2e_s, 50), "job_e2e_p99_s": percentile(e2e_s, 99),
        "statuses": statuses, "machine": machine(),
    }


def main() -> None:
    """Parse arguments, run the load, print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True, help="a fresh key: completion is judged by its jobs")
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8, help="concurrent submitting clients")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up waiting for completion after this")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    columns = ["accepted", "refused", "throttled", "accepted_jobs_per_s", "submit_latency_p50_ms",
               "submit_latency_p99_ms", "completion_s", "job_e2e_p50_s", "job_e2e_p99_s"]
    print_table("service load", [result], columns)
    print("statuses:", result["statuses"])
    print("wrote", write_json("service_load", result, args.out))


if __name__ == "__main__":
    main()
