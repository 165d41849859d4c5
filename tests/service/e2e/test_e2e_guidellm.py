"""guidellm (the vLLM project's serving benchmark) against live API and worker processes, offline, with no errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NUM_REQUESTS = 4


@pytest.fixture(scope="module")
def database_url(postgresql_url: str) -> str:
    """PostgreSQL only: one service start-up serves both runs."""
    return postgresql_url


def _guidellm(live_api: str, token: str, model_dir: Path, endpoint: str, stream: bool, out: Path) -> dict:
    """Run guidellm synchronously for NUM_REQUESTS synthetic requests; its JSON report."""
    backend = (f"kind=openai_http,target={live_api},model={model_dir},request_format={endpoint},"
               f"api_key={token},stream={str(stream).lower()},timeout=120")
    command = [
        sys.executable, "-m", "guidellm", "run", "--backend", backend,
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
        "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--tokenizer", f"kind=hf_auto,model={model_dir}",  # the model folder's tokenizer: nothing downloads
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_runs_without_errors(
    live_api: str, auth_headers: dict[str, str], service_model_dir: Path, tmp_path: Path, endpoint: str, stream: bool
) -> None:
    token = auth_headers["Authorization"].removeprefix("Bearer ")
    report = _guidellm(live_api, token, service_model_dir, endpoint, stream, tmp_path / "report.json")
    (benchmark,) = report["benchmarks"]
    # every request guidellm's scheduler made succeeded; its metrics count only those inside its measured window (a
    # full-suite run once left the last of the 4 outside it), and none of those failed either
    made = benchmark["scheduler_metrics"]["requests_made"]
    assert made == {"successful": NUM_REQUESTS, "errored": 0, "incomplete": 0, "total": NUM_REQUESTS}
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] == totals["total"] >= 1
    assert benchmark["metrics"]["output_token_count"]["successful"]["total_sum"] > 0
