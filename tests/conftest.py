import os
from pathlib import Path

import pytest

from dynamo_pd.runtime.discovery import connect_discovery
from dynamo_pd.runtime.discovery_server import DiscoveryServer
from dynamo_pd.runtime.events import connect_event_plane
from tests.servers import etcd_server, nats_server

# vLLM's CPU KV cache defaults to a large share of memory; tests need little.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


# A skip is a failure unless the test is marked `hardware`: a broken vLLM, NIXL, etcd or NATS install must fail
# the run, not turn its tests into skips (a module skipped while it is collected counts too).
_unexpected_skips: list[str] = []


def _skip_reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def pytest_collectreport(report):
    if report.skipped:
        _unexpected_skips.append(f"{report.nodeid}: {_skip_reason(report)}")


# From the reports, not the items: with pytest-xdist (-n) the process that ends the run only gets those
# (report.keywords holds the item's marker names).
def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail") and "hardware" not in report.keywords:
        _unexpected_skips.append(f"{report.nodeid}: {_skip_reason(report)}")


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _unexpected_skips:
        terminalreporter.section("skips that fail the run (mark a test `hardware` only if it needs a GPU or a CPU "
                                 "feature)", red=True)
        for line in _unexpected_skips:
            terminalreporter.line(line)


def _xdist_unit(nodeid: str) -> str:
    """What one pytest-xdist worker takes at a time: all the whole deployments (e2e) together, since they
    take both cores between them; anything else by its file (a file's module fixtures start once)."""
    path = Path(nodeid.split("::")[0])
    return "deployments" if path.parent.name == "e2e" or path.stem.endswith("e2e") else str(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`./dev.sh test` runs two workers: one runs the deployments one after another from the start (they
    come first in the collection, below), the other everything else, file by file."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_unit(nodeid)

    config.option.loadscopereorder = False  # keep the collection's order of units
    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker
        items.sort(key=lambda item: _xdist_unit(item.nodeid) != "deployments")  # stable


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


@pytest.fixture(params=["zmq", pytest.param("nats", marks=pytest.mark.nats)])
async def new_plane(request):
    """A factory of event planes, each as a separate process would have it (own discovery client)."""
    planes, discoveries = [], []
    server = None
    if request.param == "nats":
        url = request.getfixturevalue("nats_url")

        async def make():
            planes.append(await connect_event_plane(url))
            return planes[-1]
    else:
        server = DiscoveryServer()
        await server.start()

        async def make():
            discoveries.append(await connect_discovery(server.url, ttl_s=2.0, keepalive_s=0.5))
            planes.append(await connect_event_plane(None, discoveries[-1]))
            return planes[-1]

    yield make
    for plane in planes:
        await plane.close()
    for discovery in discoveries:
        await discovery.close()
    if server is not None:
        await server.close()
