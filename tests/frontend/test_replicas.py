"""Two frontends' routers share their placements on the deployment's event plane (ZMQ and NATS)."""

from dynamo_pd.frontend.replicas import EventPlaneReplicaSync
from tests.router.test_replica_sync import check_shared_load, linked, replica


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
