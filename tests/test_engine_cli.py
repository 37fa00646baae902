"""Without an engine's package, a worker exits at once with one line naming what to install and the
hardware it needs, no traceback: every registered engine that needs a package, through the real CLI in a
subprocess, its package hidden (a finder ahead of every other fails its import as if it were absent)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys

import pytest

from dynamo_pd.engines.base import _REGISTRY

_OURS = {"dynamo_pd", "router", "kv_transfer"}


def engine_package(module_name: str) -> str:
    """The first third-party package the engine's module imports: the one its registry hint installs."""
    tree = ast.parse(open(importlib.util.find_spec(module_name).origin).read())
    for node in tree.body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in _OURS and top != "__future__":
                return top
    raise AssertionError(f"{module_name} imports no third-party package")


NEEDS_PACKAGE = sorted((name, entry.target.split(":")[0])
                       for name, entry in _REGISTRY.items() if entry.install)


def run_worker(role: str, engine: str, hide: str) -> subprocess.CompletedProcess:
    code = f"""
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == {hide!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hide())
sys.argv = ["dynamo_pd.{role}", "--engine", {engine!r}, "--discovery", "tcp://127.0.0.1:9"]
from dynamo_pd.{role} import main
main()
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


def assert_one_line(result: subprocess.CompletedProcess, engine: str, package: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
    line = lines[0]
    assert line.startswith(f"error: engine {engine!r} needs the package {package!r}: pip install"), line
    assert "GPU" in line or "CPU" in line, f"no hardware named: {line}"


def test_every_engine_that_needs_a_package_is_covered():
    assert {"vllm", "sglang", "trtllm"} <= {name for name, _ in NEEDS_PACKAGE}
    # the package the registry checks for without importing is the one the engine's module imports
    assert all(_REGISTRY[name].package == engine_package(module) for name, module in NEEDS_PACKAGE)


def test_the_launcher_checks_the_engine_without_importing_it():
    code = ("import sys; from dynamo_pd.serve import parse_args; parse_args(['--engine', 'native']); "
            "print(sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]


@pytest.mark.parametrize(("engine", "module"), NEEDS_PACKAGE)
def test_missing_package_is_one_line(engine, module):
    package = engine_package(module)
    assert_one_line(run_worker("prefill", engine, hide=package), engine, package)


def test_trtllm_as_the_design_card_types_it():
    """`python -m dynamo_pd.prefill --engine trtllm` where tensorrt_llm is not installed (here: never)."""
    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed here")
    result = subprocess.run([sys.executable, "-m", "dynamo_pd.decode", "--engine", "trtllm", "--discovery",
                             "tcp://127.0.0.1:9"], capture_output=True, text=True, timeout=180)
    assert_one_line(result, "trtllm", "tensorrt_llm")
