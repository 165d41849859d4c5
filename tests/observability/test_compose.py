"""docker-compose.yml: the production shape, cross-checked against the Dockerfile, the settings and the repo."""

from __future__ import annotations

import json
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from core.settings import Settings

ROOT = Path(__file__).parents[2]
SERVICES = {"postgres", "redis", "migrate", "api", "worker", "worker-cpu", "prometheus", "grafana"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The compose file, anchors and merge keys resolved."""
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_is_valid_against_the_compose_specification(compose: dict[str, Any]) -> None:
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator_class(schema, format_checker=validator_class.FORMAT_CHECKER).iter_errors(compose)]
    assert errors == []


def test_compose_has_the_production_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == SERVICES


def test_every_long_running_service_has_a_healthcheck_and_restarts(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if name == "migrate":
            continue
        assert service["healthcheck"]["test"][0] == "CMD", name
        assert service["restart"] == "unless-stopped", name


def test_gpu_worker_reserves_a_gpu_and_the_cpu_variant_sits_behind_a_profile(compose: dict[str, Any]) -> None:
    services = compose["services"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert services["worker-cpu"]["profiles"] == ["cpu"] and "deploy" not in services["worker-cpu"]
    assert services["worker-cpu"]["environment"] == services["worker"]["environment"]


def test_build_targets_exist_in_the_dockerfile_and_the_gpu_one_has_a_cuda_base(compose: dict[str, Any]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    base_of = {stage: image for image, stage in re.findall(r"^FROM (\S+) AS (\S+)$", dockerfile, re.MULTILINE)}
    targets = {s["build"]["target"] for s in compose["services"].values() if "build" in s}
    assert targets == {"api", "worker", "worker-cpu"} and targets <= set(base_of)
    assert "CUDA_IMAGE" in base_of["worker"] and "nvidia/cuda:" in dockerfile


def test_the_image_copies_every_package_pyproject_installs() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) /app/\1$", dockerfile, re.MULTILINE))
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    installed = {pattern.rstrip("*") for pattern in find["include"]}
    assert "cli" in installed and installed <= copied, installed - copied


def test_data_lives_in_declared_named_volumes(compose: dict[str, Any]) -> None:
    named = {v.split(":")[0] for s in compose["services"].values() for v in s.get("volumes", [])
             if not v.startswith(".")}
    assert named == set(compose["volumes"])
    assert {"postgres-data", "redis-data", "prometheus-data", "grafana-data"} <= named


def test_bind_mounts_point_at_files_in_the_repository(compose: dict[str, Any]) -> None:
    binds = [v.split(":")[0] for s in compose["services"].values() for v in s.get("volumes", []) if v.startswith(".")]
    assert binds and all((ROOT / b).exists() for b in binds)


def test_pagedserve_variables_are_settings_fields(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for variable in service.get("environment", {}):
            if variable.startswith("PAGEDSERVE_"):
                assert variable.removeprefix("PAGEDSERVE_").lower() in Settings.model_fields, f"{name}: {variable}"


def test_api_runs_several_processes_in_prometheus_multiprocess_mode(compose: dict[str, Any]) -> None:
    api = compose["services"]["api"]
    multiproc_dir = api["environment"]["PROMETHEUS_MULTIPROC_DIR"]
    assert any(mount.startswith(multiproc_dir + ":") for mount in api["tmpfs"])
    assert "UVICORN_WORKERS" in api["environment"]


def test_services_start_after_what_they_need(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker", "worker-cpu"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_only_the_api_is_published_beyond_this_host(compose: dict[str, Any]) -> None:
    published = {name: service.get("ports", []) for name, service in compose["services"].items()}
    assert published["postgres"] == [] and published["redis"] == []
    assert published["prometheus"] == ["127.0.0.1:9090:9090"] and published["grafana"] == ["127.0.0.1:3000:3000"]
    for name, ports in published.items():
        assert name == "api" or all(port.startswith("127.0.0.1:") for port in ports), name


def test_passwords_have_no_defaults_and_are_required_from_the_environment() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for variable in ("POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD"):
        uses = re.findall(r"\$\{" + variable + r"(\W[^}]*)?\}", text)
        assert uses and all(use.startswith(":?") for use in uses), variable
    services = yaml.safe_load(text)["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
