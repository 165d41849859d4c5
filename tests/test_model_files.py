"""Torch-free model lookup (core.model_files): cache paths, what counts as prepared, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.model_files import (
    DEFAULT_MODEL,
    FINGERPRINT_BYTES,
    ModelNotPreparedError,
    cache_dir,
    converted_dir,
    prepared_folder,
)


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


def _gguf(path: Path, middle: bytes, tail: bytes) -> str:
    """A stand-in GGUF of two MiB and more (nothing reads it as one here): a header, `middle`, and `tail` last."""
    path.write_bytes(b"GGUF" + bytes(FINGERPRINT_BYTES) + middle + bytes(FINGERPRINT_BYTES) + tail)
    return str(path)


def test_a_gguf_replaced_at_the_same_path_is_converted_anew_and_a_copy_shares_the_conversion(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    model = _gguf(tmp_path / "m.gguf", b"x", b"old weights")
    first = converted_dir(model, cache)
    assert first is not None and first.name.startswith("m-")
    first.mkdir(parents=True)
    (first / "config.json").write_text("{}")
    assert prepared_folder(model, cache) == first
    _gguf(tmp_path / "m.gguf", b"x", b"new weights")  # same size, new weights at the end
    with pytest.raises(ModelNotPreparedError) as raised:
        prepared_folder(model, cache)
    assert raised.value.folder != first
    _gguf(tmp_path / "m.gguf", b"xy", b"old weights")  # one byte longer
    assert converted_dir(model, cache) != first
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    _gguf(tmp_path / "m.gguf", b"x", b"old weights")
    assert converted_dir(_gguf(copy / "m.gguf", b"x", b"old weights"), cache) == first  # another host's copy
