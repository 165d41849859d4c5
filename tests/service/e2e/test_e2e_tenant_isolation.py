"""One tenant's hostile inputs never fail another tenant's jobs: real API and worker processes, the tiny model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.e2e.support import offline_greedy, wait_final
from tests.service.procs import wait_until

VICTIM_PROMPTS = [f"Victim job {i} keeps writing about the number {i * 3}" for i in range(16)]
VICTIM_MAX_TOKENS = 400


@pytest.fixture(scope="module")
def database_url(postgresql_url: str) -> str:
    """PostgreSQL, the production store (where a NUL in text used to be a 500)."""
    return postgresql_url


@pytest.fixture(scope="module")
def vocab_size(service_model_dir: Path) -> int:
    """Rows of the model's embedding table."""
    return int(json.loads((service_model_dir / "config.json").read_text())["vocab_size"])


def _refused_inputs(vocab_size: int) -> list[tuple[dict[str, Any], str]]:
    """Inputs the engine cannot run safely, each with the field its 4xx must name."""
    return [
        ({"prompt": "Hi", "max_tokens": 4, "stop_token_ids": [1000000000], "min_tokens": 1}, "stop_token_ids"),
        ({"prompt": "Hi", "max_tokens": 4, "stop_token_ids": [vocab_size], "min_tokens": 4}, "stop_token_ids"),
        ({"prompt": "Hi", "max_tokens": 4, "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "Hi\u0000there", "max_tokens": 4}, "prompt"),
        ({"prompt": "Hi", "max_tokens": 4, "stop": ["\u0000"]}, "stop"),
        ({"prompt": "Hi", "max_tokens": 4, "repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"prompt": "Hi", "max_tokens": 4, "temperature": 1e300}, "temperature"),
        ({"prompt": "Hi", "max_tokens": 4, "top_k": 10**12}, "top_k"),
        ({"prompt": "Hi", "max_tokens": 4, "logprobs": 10**6}, "logprobs"),
        ({"prompt": "Hi", "max_tokens": 4, "seed": 2**64}, "seed"),
        ({"prompt": "Hi", "max_tokens": 4, "n": 10**6}, "n"),
        ({"prompt": "Hi", "max_tokens": 10**9}, "max_tokens"),
        ({"prompt": "Hi", "max_tokens": 4, "logit_bias": {str(vocab_size): 5.0}}, "logit_bias"),
        ({"prompt": "Hi", "max_tokens": 4, "logit_bias": {"-1": 5.0}}, "logit_bias"),
        ({"prompt": "Hi", "max_tokens": 4, "allowed_token_ids": [vocab_size]}, "allowed_token_ids"),
        ({"prompt": "Hi", "max_tokens": 4, "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": "word " * 600, "max_tokens": 4}, "prompt"),
    ]


# Inputs at the edge of the math that must run (greedy where a temperature is too small to divide by).
ACCEPTED_INPUTS: list[dict[str, Any]] = [
    {"prompt": "Hi", "max_tokens": 4, "temperature": 1e-40},
    {"prompt": "Hi", "max_tokens": 1, "temperature": 1e-40},
    {"prompt": "Hi", "max_tokens": 4, "temperature": 5e-324, "top_p": 5e-324},
    {"prompt": "Hi", "max_tokens": 4, "temperature": 10.0, "min_p": 1.0, "top_k": 100_000},
    {"prompt": "Hi", "max_tokens": 4, "repetition_penalty": 0.01, "presence_penalty": 2.0,
     "frequency_penalty": -2.0},
    {"prompt": "Hi", "max_tokens": 4, "stop_token_ids": [0], "min_tokens": 4, "logprobs": 20, "n": 4},
    {"prompt": "Hi", "max_tokens": 4, "beam_width": 4, "length_penalty": -10.0},
    # every token masked but the one biased to -inf's edge: still a token of the vocabulary
    {"prompt": "Hi", "max_tokens": 4, "allowed_token_ids": [0], "logit_bias": {"0": -100.0}, "temperature": 10.0},
]


def _attack(attacker: httpx.Client, model: str, vocab_size: int) -> tuple[list[tuple[str, str, int, str]], list[str]]:
    """Every refused input through /v1/jobs and /v1/completions as (route, field, status, field blamed);
    and the ids of the jobs made of the accepted inputs."""
    refused = []
    for body, field in _refused_inputs(vocab_size):
        job = attacker.post("/v1/jobs", json=body)
        refused.append(("/v1/jobs", field, job.status_code, job.json()["error"]["field"]))
        completion = attacker.post("/v1/completions", json={**body, "model": model})
        refused.append(("/v1/completions", field, completion.status_code, completion.json()["error"]["param"]))
    nan = attacker.post("/v1/jobs", content='{"prompt": "Hi", "max_tokens": 4, "temperature": NaN}',
                        headers={"Content-Type": "application/json"})
    refused.append(("/v1/jobs", "temperature", nan.status_code, nan.json()["error"]["field"]))
    ids = attacker.post("/v1/completions", json={"model": model, "prompt": [vocab_size], "max_tokens": 2})
    refused.append(("/v1/completions", "prompt", ids.status_code, ids.json()["error"]["param"]))
    accepted = [attacker.post("/v1/jobs", json=body) for body in ACCEPTED_INPUTS]
    assert [r.status_code for r in accepted] == [202] * len(ACCEPTED_INPUTS), [r.text for r in accepted]
    return refused, [r.json()["id"] for r in accepted]


def test_hostile_inputs_from_one_tenant_leave_another_tenants_jobs_intact(
    live_api: str, auth_headers: dict[str, str], new_auth_headers: Any, service_model_dir: Path, vocab_size: int
) -> None:
    victim_body = {"max_tokens": VICTIM_MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
    with httpx.Client(base_url=live_api, headers=auth_headers, timeout=60) as victim, \
            httpx.Client(base_url=live_api, headers=new_auth_headers("attacker"), timeout=60) as attacker:
        with ThreadPoolExecutor(max_workers=8) as pool:
            submitted = list(pool.map(lambda p: victim.post("/v1/jobs", json={**victim_body, "prompt": p}),
                                      VICTIM_PROMPTS))
        victim_ids = [r.json()["id"] for r in submitted]
        wait_until(lambda: victim.get(f"/v1/jobs/{victim_ids[-1]}").json()["first_token_at"], 60,
                   "the victim's jobs to be generating")
        model = attacker.get("/v1/models").json()["data"][0]["id"]
        refused, accepted_ids = _attack(attacker, model, vocab_size)
        in_flight_after_attack = [victim.get(f"/v1/jobs/{j}").json()["status"] for j in victim_ids]
        victims = [wait_final(victim, job_id) for job_id in victim_ids]
        accepted = [wait_final(attacker, job_id) for job_id in accepted_ids]
    assert "running" in in_flight_after_attack  # the attack overlapped the victim's engine steps
    assert [job["status"] for job in victims] == ["succeeded"] * len(VICTIM_PROMPTS), [j["error"] for j in victims]
    expected = offline_greedy(service_model_dir, VICTIM_PROMPTS, VICTIM_MAX_TOKENS)
    assert [job["choices"][0]["token_ids"] for job in victims] == expected
    assert [(route, field) for route, field, status, blamed in refused
            if not (400 <= status < 500 and blamed and blamed.startswith(field))] == []
    assert [job["status"] for job in accepted] == ["succeeded"] * len(ACCEPTED_INPUTS), [j["error"] for j in accepted]
    token_ids = [t for job in accepted for choice in job["choices"] for t in choice["token_ids"]]
    assert token_ids and all(0 <= t < vocab_size for t in token_ids)
