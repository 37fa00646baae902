"""Typed errors of the runtime: discovery, event plane and request plane.

A worker's handler error crosses the request plane with its kind: the client's fault
(`InvalidRequestError`, from validation) arrives as that error again, never retried;
anything else is the server's fault and arrives as `RemoteError`.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad client input; `param` names the offending field (HTTP 400, never retried). It crosses the
    request plane as itself (rpc_client rebuilds it); dynamo_pd.protocol shares it with every process."""

    code: str | None = None  # the OpenAI error code

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """Prompt (plus requested output) does not fit the model's context or the KV cache (HTTP 400)."""

    code = "context_length_exceeded"


class RuntimePlaneError(RuntimeError):
    """Base of every error the runtime raises."""


class DiscoveryUnavailableError(RuntimePlaneError):
    """The discovery backend (embedded server or etcd) did not answer in time."""


class EventPlaneError(RuntimePlaneError):
    """The event plane could not connect, publish or subscribe."""


class RpcError(RuntimePlaneError):
    """Base of the request plane's errors."""


class WorkerGoneError(RpcError):
    """The worker's connection dropped (or never came up) while a stream was open."""


class WorkerDrainingError(RpcError):
    """The worker is shutting down: it refused a new stream, or ended one its drain timeout cut short.
    Nothing is wrong with the request; another worker may serve (or continue) it."""


class FirstResponseTimeoutError(RpcError):
    """The worker sent nothing within the first-response timeout; the stream was cancelled."""


class StreamStalledError(RpcError):
    """The worker sent nothing within the inter-response timeout after its first response (its engine
    is wedged); the stream was cancelled."""


class RequestCancelledError(RpcError):
    """The caller's RequestContext was cancelled while the stream was open."""


class RemoteError(RpcError):
    """The worker's handler failed (the server's fault); `error_type` is the remote exception's class name."""

    def __init__(self, error_type: str, message: str, endpoint: str = ""):
        where = f" on worker {endpoint}" if endpoint else ""
        super().__init__(f"{error_type}{where}: {message}")
        self.error_type = error_type
        self.remote_message = message
        self.endpoint = endpoint
