"""The layers import only downwards: router/ is a pure library, the runtime knows no domain module.

Read from the source with `ast` (every import statement, at any depth), so nothing is imported to check.
Imports are followed through the project's own modules: a module that imports X, which imports Y,
imports Y. Not followed: the parent packages' `__init__` that Python also runs (the top packages keep
theirs free of eager imports).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _source(root: Path, module: str) -> Path | None:
    """The project file that defines `module`, or None for one from outside (the standard library, zmq)."""
    base = root.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, path: Path) -> set[str]:
    """Every module the file at `path` imports, by full name; `from P import n` names P.n too when that
    is one of the project's modules."""
    package = _module_name(root, path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module or ""]))
            names.add(module)
            names.update(sub for alias in node.names if _source(root, sub := f"{module}.{alias.name}"))
    return names


def offending(package: str, forbidden: set[str], root: Path = ROOT) -> dict[str, dict[str, str]]:
    """file -> {forbidden module it reaches: the shortest route, "a -> b -> c" from the file's own module}.
    Modules of `package` itself are never forbidden; a route ends at the first forbidden module."""
    own = package.replace("/", ".")

    def bad(name: str) -> bool:
        return not (name == own or name.startswith(own + ".")) and any(
            name == f or name.startswith(f + ".") for f in forbidden)

    paths = sorted((root / package).rglob("*.py"))
    assert paths, f"no modules under {package}"
    found = {}
    for path in paths:
        start = _module_name(root, path)
        route, todo = {start: start}, deque([(start, path)])
        while todo:
            module, source = todo.popleft()
            for name in sorted(imports(root, source)):
                if name not in route:
                    route[name] = f"{route[module]} -> {name}"
                    if not bad(name) and (found_at := _source(root, name)) is not None:
                        todo.append((name, found_at))
        if hits := {name: how for name, how in route.items() if bad(name)}:
            found[path.relative_to(root).as_posix()] = hits
    return found


@pytest.mark.parametrize("package, forbidden", [
    ("router", {"zmq", "nats", "dynamo_pd", "threading"}),
    # the runtime connects processes; what they say to each other (protocol, hand-off, engines) is above it
    ("dynamo_pd/runtime", {"dynamo_pd", "router", "kv_transfer"}),
])
def test_layers_import_only_downwards(package, forbidden):
    assert offending(package, forbidden) == {}


def test_the_check_sees_nested_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f():\n    import nats.errors\n    from zmq import asyncio\n")
    assert offending("pkg", {"zmq", "nats"}, tmp_path) == {"pkg/m.py": {"nats.errors": "pkg.m -> nats.errors",
                                                                         "zmq": "pkg.m -> zmq"}}


def test_the_check_follows_imports_through_the_project(tmp_path):
    """runtime -> protocol -> router: the runtime reaches router through a module outside it, by way of
    a submodule named in `from P import n` and a relative import; its own modules are allowed."""
    for name, text in {
        "app/__init__.py": "",
        "app/protocol.py": "def f():\n    from router.worker import Role\n",
        "app/runtime/__init__.py": "",
        "app/runtime/base.py": "",
        "app/runtime/disc.py": "from app.runtime import base\nfrom .wire import X\n",
        "app/runtime/wire.py": "from app import protocol\n",
        "router/__init__.py": "",
        "router/worker.py": "",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    wire = "app.runtime.wire -> app.protocol"
    assert offending("app/runtime", {"router"}, tmp_path) == {
        "app/runtime/disc.py": {"router.worker": f"app.runtime.disc -> {wire} -> router.worker"},
        "app/runtime/wire.py": {"router.worker": f"{wire} -> router.worker"},
    }
    assert offending("app/runtime", {"app"}, tmp_path) == {
        "app/runtime/disc.py": {"app": "app.runtime.disc -> app.runtime.wire -> app",
                                "app.protocol": f"app.runtime.disc -> {wire}"},
        "app/runtime/wire.py": {"app": "app.runtime.wire -> app", "app.protocol": wire},
    }
