"""The Kubernetes connector through the official client against the API's own request and response shapes
(tests/planner/k8s_api.py): what it reads and patches, and that a failed call changes nothing."""

import http

import pytest
from kubernetes.aio import client

from dynamo_pd.planner.connectors import ConnectorError
from dynamo_pd.planner.connectors.kubernetes import MERGE_PATCH, KubernetesConnector
from tests.planner.k8s_api import FakeApiServer

POOLS = ("prefill", "decode")


@pytest.fixture
async def api():
    server = FakeApiServer("serving", {"llm-prefill": 1, "llm-decode": 3})
    await server.start()
    yield server
    await server.close()


@pytest.fixture
async def connector(api):
    connector = KubernetesConnector(client.ApiClient(client.Configuration(host=api.url)), "serving", "llm",
                                    POOLS)
    yield connector
    await connector.close()


async def test_reads_each_pools_deployment_scale(api, connector):
    assert await connector.replicas() == {"prefill": 1, "decode": 3}
    assert [(r.method, r.path) for r in api.requests] == [
        ("GET", "/apis/apps/v1/namespaces/serving/deployments/llm-prefill/scale"),
        ("GET", "/apis/apps/v1/namespaces/serving/deployments/llm-decode/scale")]


async def test_scales_with_a_merge_patch_of_spec_replicas(api, connector):
    await connector.set_replicas("decode", 5)
    (patch,) = api.requests
    assert patch.method == "PATCH"
    assert patch.path == "/apis/apps/v1/namespaces/serving/deployments/llm-decode/scale"
    assert (patch.content_type, patch.body) == (MERGE_PATCH, {"spec": {"replicas": 5}})
    assert api.replicas == {"llm-prefill": 1, "llm-decode": 5}
    await connector.set_replicas("decode", 0)  # a pool may go to none (the planner's minimums decide)
    assert api.replicas["llm-decode"] == 0


@pytest.mark.parametrize("code, reason, message", [
    (409, "Conflict", 'Operation cannot be fulfilled on deployments.apps "llm-decode": the object has been '
                      "modified; please apply your changes to the latest version and try again"),
    (500, "InternalError", "Internal error occurred: etcdserver: request timed out"),
    (403, "Forbidden", 'deployments.apps "llm-decode" is forbidden: User '
                       '"system:serviceaccount:serving:llm-planner" cannot patch resource '
                       '"deployments/scale" in API group "apps"'),
])
async def test_an_api_error_changes_nothing(api, connector, code, reason, message):
    api.failures.append(("PATCH", code, reason, message))
    with pytest.raises(ConnectorError) as caught:
        await connector.set_replicas("decode", 6)
    phrase = http.HTTPStatus(code).phrase  # the status line's; the Status body carries `message`
    assert str(caught.value) == (f"scaling llm-decode to 6 in namespace serving: HTTP {code} {phrase}: "
                                 f"{message}")
    assert api.replicas == {"llm-prefill": 1, "llm-decode": 3}
    await connector.set_replicas("decode", 6)  # tried again, it goes through
    assert api.replicas["llm-decode"] == 6


async def test_a_missing_deployment_is_named(api):
    connector = KubernetesConnector(client.ApiClient(client.Configuration(host=api.url)), "serving", "other",
                                    POOLS)
    try:
        missing = 'HTTP 404 Not Found: deployments.apps "other-prefill" not found'
        with pytest.raises(ConnectorError, match=missing):
            await connector.replicas()
    finally:
        await connector.close()


async def test_an_unreachable_api_server_is_a_connector_error(api, connector):
    await api.close()
    with pytest.raises(ConnectorError, match="scaling llm-prefill to 2 in namespace serving: "):
        await connector.set_replicas("prefill", 2)
