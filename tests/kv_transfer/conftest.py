from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def ipc_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ipc")
