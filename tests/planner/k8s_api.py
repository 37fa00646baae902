"""A Kubernetes API server's deployments/scale subresource, answering as the real one does: the bodies are
the official client's own models (autoscaling/v1 Scale, v1 Status) as JSON, the errors the API server's
(404 NotFound naming the deployment, 415 for a patch type it does not take, 422 for a negative count, and
whatever a test queues for the next GET or PATCH: 409 Conflict, 500, 403 Forbidden). Every request is
recorded."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from aiohttp import web
from kubernetes.aio.client import V1ObjectMeta, V1Scale, V1ScaleSpec, V1ScaleStatus, V1Status, V1StatusDetails

PATH = "/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale"
PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json",
               "application/strategic-merge-patch+json", "application/apply-patch+yaml")


@dataclass
class Request:
    method: str
    path: str
    content_type: str
    body: object


@dataclass
class FakeApiServer:
    namespace: str
    replicas: dict[str, int]  # deployment name -> spec.replicas
    failures: list[tuple[str, int, str, str]] = field(default_factory=list)  # method, code, reason, message
    requests: list[Request] = field(default_factory=list)
    url: str = ""
    _version: int = 1

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("GET", PATH, self._get)
        app.router.add_route("PATCH", PATH, self._patch)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        await self._runner.cleanup()

    def _scale(self, name: str) -> web.Response:
        n = self.replicas[name]
        scale = V1Scale(api_version="autoscaling/v1", kind="Scale",
                        metadata=V1ObjectMeta(name=name, namespace=self.namespace,
                                              resource_version=str(self._version), uid=f"uid-{name}"),
                        spec=V1ScaleSpec(replicas=n),
                        status=V1ScaleStatus(replicas=n, selector=f"app.kubernetes.io/component={name}"))
        return web.json_response(text=scale.to_json())

    @staticmethod
    def _status(code: int, reason: str, message: str, name: str = "") -> web.Response:
        details = V1StatusDetails(name=name, group="apps", kind="deployments")
        status = V1Status(api_version="v1", kind="Status", status="Failure", code=code, reason=reason,
                          message=message, details=details)
        return web.json_response(text=status.to_json(), status=code)

    async def _answer(self, request: web.Request) -> web.Response | None:
        """The error this request gets, if any."""
        body = await request.text()
        self.requests.append(Request(request.method, request.path, request.content_type,
                                     json.loads(body) if body else None))
        name, namespace = request.match_info["name"], request.match_info["namespace"]
        if self.failures and self.failures[0][0] == request.method:
            _, code, reason, message = self.failures.pop(0)
            return self._status(code, reason, message, name)
        if namespace != self.namespace or name not in self.replicas:
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found', name)
        return None

    async def _get(self, request: web.Request) -> web.Response:
        return await self._answer(request) or self._scale(request.match_info["name"])

    async def _patch(self, request: web.Request) -> web.Response:
        error = await self._answer(request)
        if error is not None:
            return error
        name, patch = request.match_info["name"], self.requests[-1].body
        if request.content_type not in PATCH_TYPES:
            return self._status(415, "UnsupportedMediaType", "the body of the request was in an unknown "
                                f"format - accepted media types include: {', '.join(PATCH_TYPES)}", name)
        if request.content_type == "application/merge-patch+json":
            replicas = patch.get("spec", {}).get("replicas", self.replicas[name])
        else:  # JSON patch: [{"op": "replace", "path": "/spec/replicas", "value": n}]
            replicas = next(op["value"] for op in patch if op["path"] == "/spec/replicas")
        if not isinstance(replicas, int) or replicas < 0:
            return self._status(422, "Invalid", f'Scale.autoscaling "{name}" is invalid: spec.replicas: '
                                f"Invalid value: {replicas}: must be greater than or equal to 0", name)
        self.replicas[name] = replicas
        self._version += 1
        return self._scale(name)
