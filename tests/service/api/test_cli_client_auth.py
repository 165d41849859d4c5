"""`pagedserve submit` against the real app without a valid key: a 401 says what to pass, not just the status."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from cli import client as cli_client
from core.settings import Settings


@pytest.mark.parametrize(("headers", "said"), [
    ({}, "no key was sent"),
    ({"Authorization": "Bearer ps_not-a-key"}, "the key sent was refused"),
])
def test_a_refused_submit_says_how_to_pass_a_key(
    service_settings: Settings, monkeypatch: pytest.MonkeyPatch, headers: dict[str, str], said: str,
) -> None:
    app = create_app(service_settings)
    monkeypatch.setattr(cli_client, "_client", lambda _settings, _args: TestClient(app, headers=headers))
    args = argparse.Namespace(prompt="Hello", max_tokens=4, temperature=0.0, wait=False, api_key=None, api_url=None)
    with pytest.raises(SystemExit) as stopped:
        cli_client.cmd_submit(service_settings, args)
    message = str(stopped.value)
    assert message.startswith("error 401") and said in message
    assert "--api-key" in message and "PAGEDSERVE_API_KEY" in message


def test_the_client_sends_no_authorization_header_without_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    settings = Settings(data_dir=tmp_path)
    with cli_client._client(settings, argparse.Namespace(api_key=None, api_url=None)) as client:
        assert "Authorization" not in client.headers
