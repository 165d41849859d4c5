"""Torch-free model lookup (core.model_files): cache paths, what counts as prepared, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.model_files import DEFAULT_MODEL, ModelNotPreparedError, cache_dir, prepared_folder


def test_cache_dir_expands_home_in_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", "~/converted")
    assert cache_dir() == Path.home() / "converted"


def test_an_unconverted_builtin_is_not_prepared_and_names_its_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelNotPreparedError, match="pagedserve prepare") as raised:
        prepared_folder(DEFAULT_MODEL, tmp_path)
    assert raised.value.folder == tmp_path / DEFAULT_MODEL


def test_a_converted_builtin_is_found_in_the_cache(tmp_path: Path) -> None:
    (tmp_path / DEFAULT_MODEL).mkdir()
    (tmp_path / DEFAULT_MODEL / "config.json").write_text("{}")
    assert prepared_folder(DEFAULT_MODEL, tmp_path) == tmp_path / DEFAULT_MODEL


@pytest.mark.parametrize("model", ["/no/such/folder", "/no/such/model.gguf"])
def test_an_unknown_model_is_a_value_error_naming_it(model: str) -> None:
    with pytest.raises(ValueError, match=model):
        prepared_folder(model)
