"""The runtime: discovery, event plane and request plane that connect frontends, routers and workers.

Discovery (leases; a dead worker is gone within ~TTL = 3 s):
    server = DiscoveryServer(); await server.start()         # embedded default, hosted in-process
    discovery = await connect_discovery(server.url)          # or "etcd://127.0.0.1:2379"
    reg = await discovery.register(worker_info); await reg.close()
    await discovery.list(WorkerInfo)                         # what workers register: the caller's struct
    async for kind, info in discovery.watch(WorkerInfo): ...  # "added" | "removed"

Event plane (at-most-once, prefix subscriptions on dot-separated subjects; one per process, so one NATS
connection carries its load reports, router-replica updates and KV events):
    events = await connect_event_plane(None, discovery)      # ZMQ; or "nats://127.0.0.1:4222"
    await events.publish("load.w1", payload); sub = await events.subscribe("load")

KV event streams (kv_events.py: numbered batches with replay; vLLM's ZMQ wire, or on the event plane):
    pub = ZmqBatchPublisher(endpoint, replay_endpoint) | PlaneBatchPublisher(events, subject)
    source = ZmqBatchSource(endpoint, replay_endpoint) | await PlaneBatchSource.subscribe(events, subject)

Request plane (streaming RPC over ZMQ, cancellation both ways, typed errors):
    server = RpcServer(handler); await server.start()   # handler(payload, context) -> AsyncIterator[bytes]
    async for chunk in RpcClient().stream(server.endpoint, payload, RequestContext(rid)): ...

Everything binds 127.0.0.1 unless given another address (a server bound on 0.0.0.0 advertises
`advertise_host`, see ports.py), and every wait is bounded. Security (security.py): an optional cluster
secret makes every ZMQ socket CURVE and refuses peers without it; every ZMQ socket has a size limit;
NATS and etcd take credentials and TLS. `configure(Security(...))` once per process sets the default every
constructor here takes (`security=` overrides it). Run the process under uvloop: `uvloop.run(main())`.
"""

from dynamo_pd.runtime.context import RequestContext
from dynamo_pd.runtime.discovery import Discovery, Registration, connect_discovery
from dynamo_pd.runtime.discovery_server import DiscoveryServer
from dynamo_pd.runtime.errors import (
    DiscoveryUnavailableError,
    EventPlaneError,
    FirstResponseTimeoutError,
    RemoteError,
    RequestCancelledError,
    RpcError,
    RuntimePlaneError,
    WorkerGoneError,
)
from dynamo_pd.runtime.events import EventPlane, Subscription, connect_event_plane
from dynamo_pd.runtime.rpc_client import RpcClient
from dynamo_pd.runtime.rpc_server import RpcServer

__all__ = [
    "Discovery", "DiscoveryServer", "DiscoveryUnavailableError", "EventPlane", "EventPlaneError",
    "FirstResponseTimeoutError", "Registration", "RemoteError", "RequestCancelledError", "RequestContext",
    "RpcClient", "RpcError", "RpcServer", "RuntimePlaneError", "Subscription", "WorkerGoneError", "connect_discovery",
    "connect_event_plane",
]
