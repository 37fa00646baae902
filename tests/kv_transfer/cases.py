"""Transport cases shared by the kv_transfer tests (importable, unlike a conftest)."""

import importlib.util

import pytest

NIXL_MISSING = importlib.util.find_spec("nixl") is None
needs_nixl = pytest.mark.skipif(
    NIXL_MISSING, reason="nixl not importable: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

TRANSPORTS = [
    "zmq-tcp",
    "zmq-ipc",
    pytest.param("nixl", marks=[pytest.mark.nixl, needs_nixl]),
    pytest.param("nixl-etcd", marks=[pytest.mark.nixl, needs_nixl]),
]
