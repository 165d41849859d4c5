"""The layer rules in pyproject's [tool.importlinter] hold (cli > api | worker > core; the engine under the worker),
and each rule catches an import that breaks it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("cli", "core", "api", "worker", "engine", "paged_kernels")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept() -> None:
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "forbidden_import", "broken_contract"), [
    ("core/_probe.py", "import api.app", "core is torch-free and stands on no other pagedserve package"),
    ("api/_probe.py", "import worker.tasks", "the API imports neither torch"),
    ("api/_probe.py", "import engine", "the API imports neither torch"),
    ("worker/_probe.py", "import api.schemas", "the worker imports neither the API nor the CLI"),
    ("engine/_probe.py", "import core.db", "the engine and kernels know nothing of the service"),
    ("core/_probe.py", "import cli.main", "cli above api and worker"),
])
def test_a_forbidden_import_breaks_its_contract(
    tmp_path: Path, module: str, forbidden_import: str, broken_contract: str
) -> None:
    # a copy of the packages with one bad import added: the shared checkout stays untouched
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / module).write_text(f"{forbidden_import}\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    report = " ".join(result.stdout.split())  # lint-imports wraps long contract names
    assert f"{_contract_named(broken_contract)} BROKEN" in report, result.stdout


def _contract_named(prefix: str) -> str:
    """The full name of the pyproject contract whose name starts with `prefix`."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (name,) = [contract["name"] for contract in contracts if contract["name"].startswith(prefix)]
    return name
