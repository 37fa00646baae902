"""Event plane: many publishers and subscribers, prefix filtering, late joiners; ZMQ and real NATS."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_pd.runtime.discovery import connect_discovery
from dynamo_pd.runtime.discovery_server import DiscoveryServer
from dynamo_pd.runtime.errors import EventPlaneError
from dynamo_pd.runtime.events import connect_event_plane
from tests.servers import free_port


async def publish_until_received(subs, publish, want, timeout_s: float = 10.0):
    """Publish (again) until each subscription has seen its `want` set; return what each saw.

    Delivery starts shortly after subscribe returns (a ZMQ SUB connects asynchronously), so the
    publishers repeat themselves, as periodic state publishers do.
    """
    got = [set() for _ in subs]

    async def drain(sub, seen):
        while True:
            seen.add(await sub.__anext__())

    drains = [asyncio.create_task(drain(sub, seen)) for sub, seen in zip(subs, got)]
    try:
        async with asyncio.timeout(timeout_s):
            while not all(w <= g for w, g in zip(want, got)):
                await publish()
                await asyncio.sleep(0.05)
    finally:
        for task in drains:
            task.cancel()
    return got


async def test_many_publishers_and_subscribers_with_prefix_filtering(new_plane):
    publishers = [await new_plane() for _ in range(3)]
    consumer_a, consumer_b = await new_plane(), await new_plane()
    load_sub = await consumer_a.subscribe("load")
    all_sub = await consumer_b.subscribe("")
    kv_sub = await consumer_b.subscribe("kv.events")

    async def publish():
        for i, plane in enumerate(publishers):
            await plane.publish(f"load.w{i}", b"load-%d" % i)
            await plane.publish("loadx", b"not load")
            await plane.publish(f"kv.events.w{i}", b"kv-%d" % i)
        await publishers[0].publish("load", b"bare")

    load = {(f"load.w{i}", b"load-%d" % i) for i in range(3)} | {("load", b"bare")}
    kv = {(f"kv.events.w{i}", b"kv-%d" % i) for i in range(3)}
    everything = load | kv | {("loadx", b"not load")}
    got_load, got_all, got_kv = await publish_until_received(
        [load_sub, all_sub, kv_sub], publish, [load, everything, kv])
    assert got_load == load  # "loadx" shares the bytes but not the token
    assert got_all == everything
    assert got_kv == kv
    assert load_sub.dropped == 0


async def test_late_joining_publisher_is_heard(new_plane):
    consumer = await new_plane()
    sub = await consumer.subscribe("metrics")
    late = await new_plane()  # starts after the subscription exists

    async def publish():
        await late.publish("metrics.late", b"hello")

    (got,) = await publish_until_received([sub], publish, [{("metrics.late", b"hello")}])
    assert got == {("metrics.late", b"hello")}


async def test_closed_subscription_ends_iteration(new_plane):
    plane = await new_plane()
    sub = await plane.subscribe("a.b")
    reader = asyncio.create_task(anext(sub, "ended"))
    await asyncio.sleep(0.05)
    await sub.close()
    assert await asyncio.wait_for(reader, 5) == "ended"


async def test_bad_subjects_are_rejected(new_plane):
    plane = await new_plane()
    for subject in ["", "a..b", "a.*", "a b", "a.>"]:
        with pytest.raises(ValueError, match="subject must be"):
            await plane.publish(subject, b"x")
    with pytest.raises(ValueError, match="subject must be"):
        await plane.subscribe("load.")


async def test_unreachable_nats_and_missing_discovery_are_clear_errors():
    with pytest.raises(EventPlaneError, match="cannot connect to NATS"):
        await connect_event_plane(f"nats://127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    with pytest.raises(ValueError, match="pass `discovery`"):
        await connect_event_plane(None)
    with pytest.raises(ValueError, match="event plane url"):
        await connect_event_plane("kafka://x")


async def test_zmq_subscription_fails_clearly_when_discovery_is_gone():
    server = DiscoveryServer()
    await server.start()
    discovery = await connect_discovery(server.url, ttl_s=1.0, keepalive_s=0.3, request_timeout_s=0.5)
    discovery.reconnect_timeout_s = 1.0
    plane = await connect_event_plane(None, discovery)
    sub = await plane.subscribe("load")
    await server.close()
    with pytest.raises(EventPlaneError, match="lost track of publishers"):
        async with asyncio.timeout(10):
            async for _ in sub:
                pass
    await plane.close()
    await discovery.close()
