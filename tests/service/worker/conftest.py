"""Worker tests run the real engine on the tiny random Llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.settings import Settings
from worker.engine_service import EngineService
from worker.service import engine_service


@pytest.fixture(scope="module")
def service_model_dir(tiny_model_dir: Path) -> Path:
    """The tiny random Llama with SmolLM2's tokenizer."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def service(service_settings: Settings) -> EngineService:
    """This process's engine service (loaded once, shared by the worker test modules)."""
    return engine_service()
