"""The layers import only downwards: router/ is a pure library, the runtime knows neither router nor engines.

Read from the source with `ast` (every import statement, at any depth), so nothing is imported to check.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imports(root: Path, package: str) -> dict[str, set[str]]:
    """file -> the top two levels of every module it imports ("dynamo_pd.engines", "zmq", "router")."""
    found: dict[str, set[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        found[path.relative_to(root).as_posix()] = {".".join(name.split(".")[:2]) for name in names}
    return found


def offending(package: str, forbidden: set[str], root: Path = ROOT) -> dict[str, set[str]]:
    def bad(name: str) -> bool:
        return any(name == f or name.startswith(f + ".") for f in forbidden)

    found = {path: {n for n in names if bad(n)} for path, names in imports(root, package).items()}
    assert found, f"no modules under {package}"
    return {path: names for path, names in found.items() if names}


@pytest.mark.parametrize("package, forbidden", [
    ("router", {"zmq", "nats", "dynamo_pd", "threading"}),
    ("dynamo_pd/runtime", {"router", "dynamo_pd.engines"}),
])
def test_layers_import_only_downwards(package, forbidden):
    assert offending(package, forbidden) == {}


def test_the_check_sees_nested_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f():\n    import nats.errors\n    from zmq import asyncio\n")
    assert offending("pkg", {"zmq", "nats"}, tmp_path) == {"pkg/m.py": {"nats.errors", "zmq"}}
