"""Dashboards, provisioning and scrape config agree with each other and with the metrics the code exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import Metric

import core.job_metrics  # noqa: F401  (registers the job counters in REGISTRY, as the API and workers do)
import worker.webhook_metrics  # noqa: F401  (registers the webhook counter in REGISTRY, as workers do)
from api.metrics import StoreCollector
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).parents[2]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
METRIC_NAME = re.compile(r"\bpagedserve_[a-z0-9_]+\b")
DATASOURCE_VARIABLE = "${datasource}"
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                   "info": ("_info",)}


def _exposed_names(families: Iterable[Metric]) -> set[str]:
    return {f.name + suffix for f in families if f.name.startswith("pagedserve_") for suffix in SAMPLE_SUFFIXES[f.type]}


def exported_metric_names() -> set[str]:
    """Every pagedserve_* sample name a worker or the API can export."""
    worker = CollectorRegistry()
    WorkerMetrics("model", worker)
    return _exposed_names(worker.collect()) | _exposed_names(REGISTRY.collect()) | _exposed_names(
        StoreCollector().describe())


def dashboard_expressions(dashboard: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression of a dashboard: panel targets, then template variable queries."""
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            yield target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["query"]["query"]


def _load_yaml(*parts: str) -> Any:
    return yaml.safe_load((ROOT.joinpath(*parts)).read_text())


def test_the_engine_and_service_dashboards_exist() -> None:
    assert [p.name for p in DASHBOARDS] == ["engine.json", "service.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_uses_only_metrics_the_code_exports(path: Path) -> None:
    used = {name for expr in dashboard_expressions(json.loads(path.read_text())) for name in METRIC_NAME.findall(expr)}
    assert used, "a dashboard without pagedserve metrics"
    assert used - exported_metric_names() == set()


def _datasource_refs(node: Any) -> Iterator[dict[str, Any]]:
    """Every datasource reference in a dashboard: panels, targets, template variables."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource" and isinstance(value, dict):
                yield value
            else:
                yield from _datasource_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _datasource_refs(value)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_picks_its_prometheus_through_a_datasource_variable(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    provisioned = _load_yaml("grafana", "provisioning", "datasources", "prometheus.yml")["datasources"][0]
    assert variables["datasource"]["current"]["value"] == provisioned["uid"]  # the default is the compose one
    refs = list(_datasource_refs(dashboard))
    assert refs and all(ref == {"type": "prometheus", "uid": DATASOURCE_VARIABLE} for ref in refs)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_provisionable_grafana_json(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    assert "id" not in dashboard or dashboard["id"] is None  # provisioning assigns ids
    panel_ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    for panel in dashboard["panels"]:
        assert panel["type"] in {"timeseries", "table", "stat"} and set(panel["gridPos"]) == {"x", "y", "w", "h"}
        assert panel["targets"] and all(t["datasource"]["uid"] == DATASOURCE_VARIABLE for t in panel["targets"])
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def test_engine_dashboard_shows_every_worker_series_the_issue_names() -> None:
    used = {n for e in dashboard_expressions(json.loads(DASHBOARDS[0].read_text())) for n in METRIC_NAME.findall(e)}
    for name in ("kv_cache_usage_ratio", "kv_cache_waste_ratio", "kv_cache_blocks", "batch_size_bucket",
                 "num_requests_running", "num_requests_waiting", "num_requests_swapped", "preemptions_total",
                 "swapped_blocks_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "prefix_cache_hits_total", "prefix_cache_queries_total",
                 "engine_stalled_seconds", "engine_last_step_timestamp_seconds"):
        assert f"pagedserve_{name}" in used, name


def test_every_engine_panel_selects_the_chosen_models_and_workers() -> None:
    dashboard = json.loads(DASHBOARDS[0].read_text())
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model_name", "instance"}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            selectors = re.findall(r"pagedserve_\w+\{([^}]*)\}", target["expr"])
            assert selectors and all('model_name=~"$model_name"' in s and 'instance=~"$instance"' in s
                                     for s in selectors), panel["title"]


def test_service_dashboard_shows_job_latency_from_acceptance_and_the_queue_age() -> None:
    used = {n for e in dashboard_expressions(json.loads(DASHBOARDS[1].read_text())) for n in METRIC_NAME.findall(e)}
    for name in ("job_time_to_first_token_seconds_bucket", "job_latency_seconds_bucket", "queue_oldest_age_seconds"):
        assert f"pagedserve_{name}" in used, name


def test_grafana_provider_reads_the_folder_compose_mounts_the_dashboards_into() -> None:
    provider = _load_yaml("grafana", "provisioning", "dashboards", "pagedserve.yml")["providers"][0]
    grafana = _load_yaml("docker-compose.yml")["services"]["grafana"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]


def test_prometheus_scrapes_the_api_and_every_worker_on_their_ports() -> None:
    from core.settings import Settings

    jobs = {job["job_name"]: job for job in _load_yaml("prometheus", "prometheus.yml")["scrape_configs"]}
    api_sd = jobs["pagedserve-api"]["dns_sd_configs"]
    assert api_sd == [{"names": ["api"], "type": "A", "port": 8000}]
    worker_sd = jobs["pagedserve-worker"]["dns_sd_configs"]
    assert {name for sd in worker_sd for name in sd["names"]} == {"worker", "worker-cpu"}
    assert {sd["port"] for sd in worker_sd} == {Settings.model_fields["metrics_port"].default}
