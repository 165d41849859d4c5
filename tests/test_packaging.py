"""pagedserve's top-level packages are its own: no other installed distribution ships one of the same name.

transformers (5.25 on) depends on Hugging Face's ``kernels`` distribution and imports it when it is installed; a
package of ours named ``kernels`` shadowed it from the checkout and every import of a transformers model failed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _shipped_packages() -> list[str]:
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return [pattern.rstrip("*") for pattern in find["include"]]


@pytest.mark.parametrize("package", _shipped_packages())
def test_no_other_installed_distribution_ships_the_package(package: str) -> None:
    owners = set(importlib.metadata.packages_distributions().get(package, []))
    assert owners <= {"pagedserve"}, f"{package!r} is also shipped by {sorted(owners - {'pagedserve'})}"
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).is_relative_to(REPO), f"{package!r} imports from {spec.origin}, not this checkout"


def test_transformers_models_import_from_the_checkout() -> None:
    """The failure this guards, end to end: transformers' activations import its hub-kernels integration."""
    result = subprocess.run([sys.executable, "-c", "from transformers import LlamaForCausalLM"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
