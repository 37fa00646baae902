"""The Kubernetes connector: each pool is the Deployment `python -m dynamo_pd.deploy k8s` renders for it,
`<name>-<pool>` in `<namespace>`, scaled through its scale subresource with the official client's
asyncio API (kubernetes.aio), as the manifests' `<name>-planner` ServiceAccount may (get and patch of
deployments/scale).

    replicas()        GET   /apis/apps/v1/namespaces/<ns>/deployments/<name>-<pool>/scale   spec.replicas
    set_replicas()    PATCH the same, {"spec": {"replicas": n}} as a JSON merge patch

Shrinking is Kubernetes's: it sends the pods it removes SIGTERM, and a worker drains on SIGTERM within the
terminationGracePeriodSeconds the manifests give it (--drain-timeout-s + 15). A pod counts for the planner's
model once it registered in discovery, which is what the planner's observer reads. A failed call (an API
error, the server unreachable) raises ConnectorError: nothing was changed, the planner tries again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo_pd.planner.connectors import Connector, ConnectorError

if TYPE_CHECKING:
    from kubernetes.aio.client import ApiClient

REQUEST_TIMEOUT_S = 10.0
MERGE_PATCH = "application/merge-patch+json"


class KubernetesConnector(Connector):
    def __init__(self, api: ApiClient, namespace: str, name: str, pools: tuple[str, ...]) -> None:
        from kubernetes.aio import client

        self._api, self._apps = api, client.AppsV1Api(api)
        self.namespace, self.deployments = namespace, {pool: f"{name}-{pool}" for pool in pools}

    async def replicas(self) -> dict[str, int]:
        counts = {}
        for pool, deployment in self.deployments.items():
            scale = await self._call(f"reading the scale of {deployment}",
                                     self._apps.read_namespaced_deployment_scale(
                                         deployment, self.namespace, _request_timeout=REQUEST_TIMEOUT_S))
            counts[pool] = (scale.spec.replicas if scale.spec is not None else None) or 0
        return counts

    async def set_replicas(self, pool: str, count: int) -> None:
        deployment = self.deployments[pool]
        await self._call(f"scaling {deployment} to {count}", self._apps.patch_namespaced_deployment_scale(
            deployment, self.namespace, {"spec": {"replicas": count}}, _content_type=MERGE_PATCH,
            _request_timeout=REQUEST_TIMEOUT_S))

    async def close(self) -> None:
        await self._api.close()

    async def _call(self, what: str, call):
        import aiohttp
        from kubernetes.aio.client.exceptions import ApiException

        try:
            return await call
        except ApiException as exc:
            raise ConnectorError(f"{what} in namespace {self.namespace}: HTTP {exc.status} {exc.reason}: "
                                 f"{_message(exc.body)}") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ConnectorError(f"{what} in namespace {self.namespace}: {exc!r}") from None


def _message(body: str | None) -> str:
    """The Status object's message the API server answers an error with, else the body."""
    import json

    try:
        return json.loads(body or "")["message"]
    except (ValueError, KeyError, TypeError):
        return (body or "")[:300]


async def connect(namespace: str, name: str, pools: tuple[str, ...], kubeconfig: str | None = None,
                  context: str | None = None) -> KubernetesConnector:
    """In a pod, its ServiceAccount's credentials; elsewhere the kubeconfig (default ~/.kube/config)."""
    try:
        from kubernetes.aio import client, config
    except ImportError:
        raise SystemExit("error: the Kubernetes connector needs the kubernetes client: "
                         "pip install 'dynamo-pd[k8s]'") from None
    configuration = client.Configuration()
    try:
        if kubeconfig is None and context is None:
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException:
                await config.load_kube_config(client_configuration=configuration)
        else:
            await config.load_kube_config(config_file=kubeconfig, context=context,
                                          client_configuration=configuration)
    except (config.ConfigException, OSError) as exc:
        raise SystemExit(f"error: no Kubernetes credentials: not in a pod, and no usable kubeconfig ({exc}); "
                         f"give --kubeconfig") from None
    return KubernetesConnector(client.ApiClient(configuration), namespace, name, pools)
