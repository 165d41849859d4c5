"""scripts/gpu_check.sh stays in step with the code: its Python helpers compile, and every name they import from
pagedserve's packages exists (the GPU machine is lent rarely; a stale import would waste its one run)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
OWN_PACKAGES = ("engine", "paged_kernels", "core")


def _python_helpers() -> dict[str, str]:
    """The heredocs the script writes out as Python files, by file name."""
    found = re.findall(r'cat > "\$W/(\w+\.py)" <<\'EOF\'\n(.*?)\nEOF\n', SCRIPT.read_text(), re.S)
    return dict(found)


def _exists(module_name: str, name: str) -> bool:
    """``from module_name import name`` would work: an attribute, or a submodule of a package."""
    module = importlib.import_module(module_name)
    if hasattr(module, name):
        return True
    return hasattr(module, "__path__") and importlib.util.find_spec(f"{module_name}.{name}") is not None


def test_the_script_parses_as_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_script_writes_its_python_helpers() -> None:
    assert set(_python_helpers()) == {"smoke.py", "e2e.py", "micro.py", "one_decode.py", "hostprof.py"}


@pytest.mark.parametrize(("name", "source"), sorted(_python_helpers().items()))
def test_helper_imports_exist(name: str, source: str) -> None:
    tree = ast.parse(source, filename=name)
    checked = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OWN_PACKAGES:
            for alias in node.names:
                assert _exists(node.module, alias.name), f"{name}: {node.module} has no {alias.name}"
                checked += 1
    assert checked, f"{name} imports nothing of pagedserve: the pattern no longer finds its imports"


def test_one_line_imports_exist() -> None:
    """The ``python -c`` one-liners of the steps import from pagedserve too (a renamed function once failed
    the install step on the GPU machine)."""
    found = re.findall(r"from ((?:engine|paged_kernels|core)[\w.]*) import ([^;'\n]+)", SCRIPT.read_text())
    assert found
    for module_name, names in found:
        for name in (part.split()[0] for part in names.split(",")):
            assert _exists(module_name, name), f"{module_name} has no {name}"


def test_every_step_is_a_name_skip_knows() -> None:
    text = SCRIPT.read_text()
    steps = re.findall(r"^ *step (\w+) ", text, re.M)
    known = re.search(r'^STEPS=" (.*) "$', text, re.M)
    assert known is not None and steps == known.group(1).split()
