"""The alert rules shipped with the stack: valid for promtool, unit-tested on synthetic series, loaded by compose."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.observability.test_dashboards import METRIC_NAME, exported_metric_names

ROOT = Path(__file__).parents[2]
PROMETHEUS_DIR = ROOT / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts_test.yml"
ISSUE_ALERTS = {"PagedserveWorkerDown", "PagedserveEngineStalled", "PagedserveKvCachePressure",
                "PagedserveQueueAgeGrowing", "PagedserveWebhookFailures", "PagedserveHttpErrorRate",
                "PagedserveJobFailureRate"}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: scripts/ensure-services.sh installs Debian's prometheus package"
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_promtool_accepts_the_rules_and_the_config_that_loads_them() -> None:
    checked = _promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(_rules())} rules found" in checked.stdout


def test_every_alert_fires_and_stays_silent_as_its_unit_tests_expect() -> None:
    tested = _promtool("test", "rules", str(ALERT_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_alerts_the_issue_names_exist_and_each_has_a_unit_test() -> None:
    names = {rule["alert"] for rule in _rules()}
    assert ISSUE_ALERTS <= names
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert names == tested  # each alert has a case where it fires


def test_alerts_use_only_metrics_the_code_exports() -> None:
    used = {name for rule in _rules() for name in METRIC_NAME.findall(rule["expr"])}
    assert used - exported_metric_names() == set()


def test_alerts_name_only_scrape_jobs_prometheus_has() -> None:
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    used = {job for rule in _rules() for job in re.findall(r'job="([^"]+)"', rule["expr"])}
    assert used and used <= jobs


@pytest.mark.parametrize("name", ["prometheus.yml", "alerts.yml"])
def test_compose_mounts_the_rule_file_beside_the_config_that_names_it(name: str) -> None:
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    prometheus = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["prometheus"]
    assert f"./prometheus/{name}:/etc/prometheus/{name}:ro" in prometheus["volumes"]
