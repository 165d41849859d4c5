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

from api.metrics import StoreCollector
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).parents[2]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
METRIC_NAME = re.compile(r"\bpagedserve_[a-z0-9_]+\b")
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


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_provisionable_grafana_json(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    datasource_uid = _load_yaml("grafana", "provisioning", "datasources", "prometheus.yml")["datasources"][0]["uid"]
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    assert "id" not in dashboard or dashboard["id"] is None  # provisioning assigns ids
    panel_ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    for panel in dashboard["panels"]:
        assert panel["type"] in {"timeseries", "table", "stat"} and set(panel["gridPos"]) == {"x", "y", "w", "h"}
        assert panel["targets"] and all(t["datasource"]["uid"] == datasource_uid for t in panel["targets"])
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def test_engine_dashboard_shows_every_worker_series_the_issue_names() -> None:
    used = {n for e in dashboard_expressions(json.loads(DASHBOARDS[0].read_text())) for n in METRIC_NAME.findall(e)}
    for name in ("kv_cache_usage_ratio", "kv_cache_waste_ratio", "kv_cache_blocks", "batch_size_bucket",
                 "num_requests_running", "num_requests_waiting", "num_requests_swapped", "preemptions_total",
                 "swapped_blocks_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "prefix_cache_hits_total", "prefix_cache_queries_total"):
        assert f"pagedserve_{name}" in used, name


def test_grafana_provider_reads_the_folder_compose_mounts_the_dashboards_into() -> None:
    provider = _load_yaml("grafana", "provisioning", "dashboards", "pagedserve.yml")["providers"][0]
    grafana = _load_yaml("docker-compose.yml")["services"]["grafana"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]


def test_prometheus_scrapes_the_api_and_every_worker_on_their_ports() -> None:
    from api.settings import Settings

    jobs = {job["job_name"]: job for job in _load_yaml("prometheus", "prometheus.yml")["scrape_configs"]}
    api_sd = jobs["pagedserve-api"]["dns_sd_configs"]
    assert api_sd == [{"names": ["api"], "type": "A", "port": 8000}]
    worker_sd = jobs["pagedserve-worker"]["dns_sd_configs"]
    assert {name for sd in worker_sd for name in sd["names"]} == {"worker", "worker-cpu"}
    assert {sd["port"] for sd in worker_sd} == {Settings.model_fields["metrics_port"].default}
