"""Two frontends' routers share their placements on the deployment's event plane (ZMQ and NATS)."""

from dynamo_pd.frontend.replicas import EventPlaneReplicaSync
from router.load import LoadKey
from router.replica_sync import decode
from router.worker import Role
from tests.router.test_replica_sync import PROMPT, check_shared_load, linked, replica
from tests.waits import until


async def test_frontends_on_one_namespace_share_their_routers_load(new_plane):
    a, b = replica(), replica()
    sync_a = EventPlaneReplicaSync(a.load, await new_plane(), "ns")
    sync_b = EventPlaneReplicaSync(b.load, await new_plane(), "ns")
    elsewhere = EventPlaneReplicaSync(replica().load, await new_plane(), "other-ns")
    for sync, router in ((sync_a, a), (sync_b, b), (elsewhere, None)):
        await sync.start()
        if router is not None:
            router.attach_replica_sync(sync)
    try:
        assert sync_a.router_id != sync_b.router_id
        await linked(sync_a, sync_b)
        await linked(sync_b, sync_a)
        await check_shared_load(a, b)
        assert elsewhere.applied == 0  # another namespace's frontends are not this deployment's
    finally:
        for sync in (sync_a, sync_b, elsewhere):
            await sync.stop()


async def test_the_updates_of_one_turn_of_the_loop_are_one_message(new_plane):
    """A message per update cost a frontend more than the rest of the update (issue 34's profile)."""
    sync_a = EventPlaneReplicaSync(replica().load, await new_plane(), "ns")
    sync_b = EventPlaneReplicaSync(replica().load, await new_plane(), "ns")
    for sync in (sync_a, sync_b):
        await sync.start()
    try:
        await linked(sync_a, sync_b)
        messages, apply = [], sync_b.apply
        sync_b.apply = lambda data: (messages.append([u.key for u in decode(data)]), apply(data))
        for i in range(5):
            sync_a.publish("finish", LoadKey(f"turn{i}", Role.PREFILL))
        await until(lambda: any("prefill:turn0" in keys for keys in messages))
        assert [keys for keys in messages if "prefill:turn0" in keys] == [[f"prefill:turn{i}" for i in range(5)]]
    finally:
        for sync in (sync_a, sync_b):
            await sync.stop()


async def test_a_lone_frontend_publishes_no_updates_until_another_says_hello(new_plane):
    """Serve's default is one frontend: its updates had no reader but itself (~4% of its CPU, issue 34)."""
    lone_plane = await new_plane()
    published: list[str] = []
    publish = lone_plane.publish

    async def recording(subject: str, payload: bytes) -> None:
        published.append(subject)
        await publish(subject, payload)

    lone_plane.publish = recording
    lone = EventPlaneReplicaSync(replica().load, lone_plane, "ns", hello_s=0.1)
    await lone.start()
    other = None
    try:
        await until(lambda: len(published) >= 3)  # hellos, and time for an update to have gone out
        for i in range(3):
            lone.publish("finish", LoadKey(f"alone{i}", Role.PREFILL))
        await until(lambda: len(published) >= 6)
        assert not lone.has_peers
        assert set(published) == {f"ns.router.load.hello.{lone.router_id}"}

        other = EventPlaneReplicaSync(replica().load, await new_plane(), "ns", hello_s=0.1)
        await other.start()
        await until(lambda: lone.has_peers)
        await linked(lone, other)  # now its updates go out, and reach the other
        assert "ns.router.load" in published
    finally:
        for sync in (lone, other):
            if sync is not None:
                await sync.stop()


async def test_a_gone_peers_placements_expire_once_no_reader_is_left(new_plane):
    """The replica that placed them died before their finish: a frontend left alone still drops them in time."""
    a, b = replica(), replica()
    sync_a = EventPlaneReplicaSync(a.load, await new_plane(), "ns", hello_s=0.1)
    sync_b = EventPlaneReplicaSync(b.load, await new_plane(), "ns", hello_s=0.1)
    for sync, router in ((sync_a, a), (sync_b, b)):
        await sync.start()
        router.attach_replica_sync(sync)
    stopped = False
    try:
        await linked(sync_a, sync_b)
        sync_b.placement_ttl_s = 0.5
        first = a.route("prefill", "r1", PROMPT)
        await until(lambda: b.load.load(first.worker_id).requests == 1)
        await sync_a.stop()  # a dies: no finish, no more hellos
        stopped = True
        await until(lambda: not sync_b.has_peers, timeout_s=10)
        b.route("prefill", "r2", PROMPT)  # b's own work goes on, alone
        assert sync_b.expired == 1
        assert sum(b.load.load(w).requests for w in ("w0", "w1")) == 1  # b's own request only
    finally:
        if not stopped:
            await sync_a.stop()
        await sync_b.stop()
