"""A throwaway Prometheus server on loopback: scrapes given targets into a temp dir, answers PromQL over HTTP."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

PROMETHEUS_BINARY = "prometheus"


def prometheus_binary() -> str | None:
    """Path of the prometheus executable (Debian's `prometheus` package), or None when it is not installed."""
    return shutil.which(PROMETHEUS_BINARY)


class PrometheusServer:
    """A Prometheus process on 127.0.0.1:`port` scraping `targets` (job → host:port list) every `scrape_interval_s`."""

    def __init__(self, targets: dict[str, list[str]], port: int, scrape_interval_s: float = 1.0) -> None:
        binary = prometheus_binary()
        if binary is None:
            raise FileNotFoundError(f"no {PROMETHEUS_BINARY} executable on PATH (apt-get install prometheus)")
        self.workdir = Path(tempfile.mkdtemp(prefix="pagedserve-prometheus-"))
        self.base_url = f"http://127.0.0.1:{port}"
        interval = f"{round(scrape_interval_s * 1000)}ms"  # Prometheus durations take no decimals
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]}
                               for job, hosts in targets.items()],
        }
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(self.workdir / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [binary, f"--config.file={self.workdir / 'prometheus.yml'}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.base_url, timeout=10)

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _api(self, path: str, **params: Any) -> Any:
        body = self.client.get(f"/api/v1/{path}", params=params).raise_for_status().json()
        assert body["status"] == "success", body
        return body["data"]

    def wait_until_targets_up(self, timeout_s: float = 30) -> None:
        """Block until every configured target has been scraped successfully at least once."""
        deadline = time.monotonic() + timeout_s
        targets: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}; see {self.log.name}")
            try:
                targets = self._api("targets")["activeTargets"]
                if targets and all(t["health"] == "up" for t in targets):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus targets not up after {timeout_s} s: "
                           f"{[(t['scrapeUrl'], t['health'], t['lastError']) for t in targets]}")

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Result of an instant PromQL query (at a unix time, default now)."""
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        return self._api("query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        """Result matrix of a range PromQL query."""
        return self._api("query_range", query=expr, start=start, end=end, step=step_s)["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        """Values of a label over the series matching a selector (Grafana's label_values())."""
        return self._api(f"label/{label}/values", **{"match[]": match})

    def stop(self) -> None:
        """Kill the server and delete its config and data."""
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
