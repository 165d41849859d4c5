"""PAGEDSERVE_LOG_FORMAT: text lines or one JSON object per line, and a bad value stops a process at startup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.logging import configure_logging, log_event

ROOT = Path(__file__).parents[2]
LOG_EVENT = ("import logging; from core.logging import configure_logging, log_event; configure_logging({fmt!r}); "
             "log_event(logging.getLogger('pagedserve.test'), 'job.transition', job_id='job_1', name='clash', n=3)")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.fixture(autouse=True)
def text_logging_afterwards() -> Iterator[None]:
    """Leave this process's logging as the other tests expect it."""
    yield
    configure_logging("text")


def test_json_format_logs_one_object_per_line_with_the_event_and_its_fields() -> None:
    stderr = _python(LOG_EVENT.format(fmt="json")).stderr.strip()
    record = json.loads(stderr)
    assert record["event"] == "job.transition" and record["job_id"] == "job_1" and record["n"] == 3
    assert record["name"] == "pagedserve.test" and record["name_"] == "clash"  # a field never overwrites the logger's
    assert record["levelname"] == "INFO" and record["timestamp"] and record["message"].startswith("job.transition")


def test_text_format_logs_the_event_then_key_value_pairs() -> None:
    line = _python(LOG_EVENT.format(fmt="text")).stderr.strip()
    assert line.endswith("INFO pagedserve.test job.transition job_id=job_1 name=clash n=3")


def test_a_bad_log_format_flag_stops_the_command_naming_the_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "cli.main", "worker", "--log-format", "xml"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "--log-format" in result.stderr


def test_a_bad_log_format_variable_stops_the_api_factory_naming_the_setting() -> None:
    result = _python("from api.app import create_app; create_app()", PAGEDSERVE_LOG_FORMAT="xml")
    assert result.returncode != 0 and "log_format" in result.stderr and "'text' or 'json'" in result.stderr


def test_configure_logging_refuses_an_unknown_format_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="log_format must be 'text' or 'json', got 'xml'"):
        configure_logging("xml")  # type: ignore[arg-type]


def test_log_event_keeps_a_field_named_like_a_record_attribute(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="pagedserve.test"):
        log_event(logging.getLogger("pagedserve.test"), "probe", module="m")
    assert caplog.records[-1].module_ == "m" and caplog.messages[-1] == "probe module=m"


def test_importing_the_model_code_logs_no_third_party_warnings_but_keeps_their_errors() -> None:
    code = ("import logging; from core.logging import configure_logging; configure_logging('text'); "
            "from transformers import LlamaForCausalLM; logging.getLogger('torchao').error('still shown')")
    stderr = _python(code).stderr
    assert [line for line in stderr.splitlines() if " WARNING " in line or line.startswith("W1")] == [], stderr
    assert "ERROR torchao still shown" in stderr
