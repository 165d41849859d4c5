"""A real Prometheus scrapes a live API and worker; every PromQL expression of both dashboards returns data."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest

from benchmarks.prometheus_server import PrometheusServer
from core.settings import Settings
from tests.observability.test_dashboards import DASHBOARDS, dashboard_expressions
from tests.service.e2e.support import wait_final
from tests.service.procs import free_port, wait_until
from tests.service.receiver import WebhookReceiver

# a shared prefix of several full blocks, so the prefix cache is queried and hit
PROMPTS = [f"{'The operators watch the memory of the engine. ' * 6}Job {i} asks about {i * 7}." for i in range(12)]
MAX_TOKENS = 48  # with a prompt, 7 of the budget's 8 blocks: one job fits, two overlapping jobs outgrow it
LABEL_VALUES = re.compile(r"^label_values\((?P<match>.+),\s*(?P<label>\w+)\)$")
GRAFANA_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")
EXPRESSIONS = [(path.stem, expr) for path in DASHBOARDS for expr in dashboard_expressions(json.loads(path.read_text()))]


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """One store is enough: this module checks the metrics path, not the store."""
    return sqlite_url


@pytest.fixture(scope="module")
def service_settings(service_settings: Settings) -> Settings:
    """The module's settings with a worker metrics port of its own and a KV budget tight enough to preempt."""
    return service_settings.model_copy(update={"metrics_port": free_port(), "kv_cache_memory": "64KiB",
                                               "swap_space": 1 << 20, "preemption_mode": "swap"})


@dataclass(frozen=True)
class Scraped:
    """A Prometheus that scraped a whole workload, and the PromQL window that covers it."""

    prometheus: PrometheusServer
    evaluated_at: float
    rate_interval: str


@pytest.fixture(scope="module")
def scraped(live_api: str, service_settings: Settings, auth_headers: dict[str, str]) -> Iterator[Scraped]:
    """Prometheus scraping the API and worker every second while 12 jobs and one retried webhook run."""
    targets = {"pagedserve-api": [urlsplit(live_api).netloc],
               "pagedserve-worker": [f"127.0.0.1:{service_settings.metrics_port}"]}
    receiver = WebhookReceiver(statuses=[500]).start()  # one retrying attempt, then delivered
    with PrometheusServer(targets, port=free_port()) as prometheus:
        prometheus.wait_until_targets_up(timeout_s=60)  # the worker serves metrics once its engine is loaded
        started = time.time()
        with httpx.Client(base_url=live_api, headers=auth_headers, timeout=60) as client:
            body = {"max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "temperature": 0.0}
            jobs = [{**body, "prompt": p} for p in PROMPTS] + [{**body, "prompt": "Hook", "webhook_url": receiver.url}]
            submitted = [client.post("/v1/jobs", json=jobs[0]).json()["id"]]
            wait_final(client, submitted[0])  # its prefix blocks are cached before the others look them up
            # a scrape between this job and the rest: each route's latency series then rises inside the
            # window, even when the whole workload runs between two scrapes
            wait_until(lambda: prometheus.query('pagedserve_http_request_duration_seconds_count{route="/v1/jobs"}'),
                       30, "Prometheus to scrape the first job's requests")
            # the rest in one request: queued together, they run together in the engine and outgrow its budget
            # (any two of them overlapping must preempt), however slowly a loaded host would take them one by one
            batch = client.post("/v1/jobs/batch", json={"jobs": jobs[1:]})
            assert batch.status_code == 202, batch.text
            submitted += [job["id"] for job in batch.json()["data"]]
            assert {wait_final(client, job_id)["status"] for job_id in submitted} == {"succeeded"}
        wait_until(lambda: len(receiver.received) == 2, 30, "the webhook to be retried and delivered")

        def saw_everything() -> bool:
            finished = prometheus.query("sum(pagedserve_request_success_total)")
            delivered = prometheus.query('sum(pagedserve_webhook_deliveries_total{outcome="delivered"})')
            return bool(finished and delivered) and float(finished[0]["value"][1]) == len(jobs) and \
                float(delivered[0]["value"][1]) == 1

        wait_until(saw_everything, 30, "Prometheus to scrape the finished workload")
        evaluated_at = time.time()
        yield Scraped(prometheus, evaluated_at, f"{math.ceil(evaluated_at - started) + 2}s")
    receiver.stop()


def grafana_to_promql(expr: str, rate_interval: str) -> str:
    """Substitute the Grafana variables the dashboards use, as Grafana would for a range covering the run."""
    values = {"__rate_interval": rate_interval, "__range": rate_interval, "__interval": "1s", "instance": ".*",
              "model_name": ".*"}
    promql = GRAFANA_VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], expr)
    assert "$" not in promql, promql
    return promql


def _total(scraped: Scraped, metric: str) -> float:
    return float(scraped.prometheus.query(f"sum({metric})", at=scraped.evaluated_at)[0]["value"][1])


def test_the_tight_kv_budget_preempted_sequences(scraped: Scraped) -> None:
    assert _total(scraped, "pagedserve_preemptions_total") > 0


def test_the_shared_prompt_prefix_hit_the_prefix_cache(scraped: Scraped) -> None:
    assert _total(scraped, "pagedserve_prefix_cache_hits_total") > 0


@pytest.mark.parametrize(("dashboard", "expr"), EXPRESSIONS, ids=[f"{d}:{e[:60]}" for d, e in EXPRESSIONS])
def test_dashboard_expression_returns_data(scraped: Scraped, dashboard: str, expr: str) -> None:
    promql = grafana_to_promql(expr, scraped.rate_interval)
    if match := LABEL_VALUES.match(promql):  # a Grafana template function, answered by the labels API
        assert scraped.prometheus.label_values(match["label"], match["match"])
        return
    result = scraped.prometheus.query(promql, at=scraped.evaluated_at)
    assert result, f"{dashboard}: no series for {promql}"
    values = [float(sample["value"][1]) for sample in result]
    assert any(math.isfinite(v) for v in values), f"{dashboard}: only NaN/Inf for {promql}: {values}"
