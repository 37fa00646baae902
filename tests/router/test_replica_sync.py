"""Two router replicas share placements and so spread the load (the event-plane transport:
tests/frontend/test_replicas.py)."""

import asyncio

from msgspec import msgpack

from router.replica_sync import LoadUpdate, ReplicaSync, encode
from router.load import LoadKey
from router.service import KvRouter, RouterConfig
from router.worker import Role
from tests.waits import until

PROMPT = list(range(64))


def replica() -> KvRouter:
    router = KvRouter(RouterConfig(block_size=16, seed=0))
    for w in ("w0", "w1"):
        router.add_worker(w, "prefill", capacity_blocks=100)
    return router


async def linked(sender, receiver):
    """ZMQ drops what a PUB sends before the peer's subscription forms: probe until one arrives."""
    for _ in range(200):
        sender.publish("finish", LoadKey("probe", Role.PREFILL))  # finishing an unknown request changes no load
        await asyncio.sleep(0.05)
        if receiver.applied:
            return
    raise AssertionError(f"no update from {sender.router_id} reached {receiver.router_id}")


async def check_shared_load(a: KvRouter, b: KvRouter):
    first = a.route("prefill", "r1", PROMPT)
    await until(lambda: b.load.load(first.worker_id).requests == 1)
    # b sees a's request and picks the other worker, as a single router would
    second = b.route("prefill", "r1", PROMPT)  # same id from another replica is a different request
    assert second.worker_id != first.worker_id
    await until(lambda: a.load.load(second.worker_id).requests == 1)
    a.mark_prefill_done("r1")
    await until(lambda: b.load.load(first.worker_id).prefill_tokens == 0)
    a.mark_finished("r1")
    b.mark_finished("r1")
    await until(lambda: all(r.load.load(w).requests == 0 for r in (a, b) for w in ("w0", "w1")))


async def test_replicas_share_their_placements_through_the_transport_they_are_given(caplog):
    a, b = replica(), replica()
    sync_a = ReplicaSync(a.load, "a", send=lambda update: sync_b.apply(encode([update])))
    sync_b = ReplicaSync(b.load, "b", send=lambda update: sync_a.apply(encode([update])))
    a.attach_replica_sync(sync_a)
    b.attach_replica_sync(sync_b)
    await check_shared_load(a, b)
    assert (sync_a.applied, sync_b.applied) == (2, 3)  # b placed and finished; a placed, prefilled, finished
    a.route("prefill", "r2", PROMPT)
    before = [a.load.load(w) for w in ("w0", "w1")]
    with caplog.at_level("WARNING", logger="router.replica_sync"):
        sync_a.apply(b"garbage")
    assert [a.load.load(w) for w in ("w0", "w1")] == before and sync_a.applied == 2  # nothing applied
    assert "ignored a malformed load update (7 bytes)" in caplog.text


async def test_a_remote_placement_whose_finish_was_lost_expires(monkeypatch):
    """Router b placed r1 and r2 on w0; the finish of r1 never reaches a. After placement_ttl_s, a's
    next update (received or sent) drops it; r2, finished in time, is not counted again."""
    now = [1000.0]
    monkeypatch.setattr("router.replica_sync.time.monotonic", lambda: now[0])
    a = replica()
    sent: list[LoadUpdate] = []
    sync = ReplicaSync(a.load, "a", send=sent.append, placement_ttl_s=60)
    for key in ("r1", "r2"):
        sync.apply(encode([LoadUpdate("b", "place", f"prefill:{key}", "w0", 64, 4)]))
    sync.apply(encode([LoadUpdate("b", "finish", "prefill:r2")]))
    assert a.load.load("w0").requests == 1
    now[0] += 59
    sync.apply(encode([LoadUpdate("b", "finish", "prefill:unknown")]))
    assert a.load.load("w0").requests == 1 and sync.expired == 0
    now[0] += 2
    sync.publish("finish", LoadKey("local", Role.PREFILL))
    assert a.load.load("w0") == ("w0", 0, 0, 0, 100) and sync.expired == 1
    assert msgpack.decode(encode(sent)) == [["a", "finish", "prefill:local", "", 0, 0, 0.0, 0.0, []]]  # no latencies


async def test_a_prefix_requests_of_both_replicas_share_on_one_worker_counts_once():
    a, b = replica(), replica()
    sync_a = ReplicaSync(a.load, "a", send=lambda update: sync_b.apply(encode([update])))
    sync_b = ReplicaSync(b.load, "b", send=lambda update: sync_a.apply(encode([update])))
    a.attach_replica_sync(sync_a)
    b.attach_replica_sync(sync_b)
    w = a.route("prefill", "r1", PROMPT).worker_id
    other = {"w0", "w1"} - {w}
    assert b.route("prefill", "r2", PROMPT, exclude=other).worker_id == w
    assert [r.load.load(w).blocks for r in (a, b)] == [4, 4]  # the prompt's 4 blocks, held once
    a.mark_finished("r1")
    assert [r.load.load(w).blocks for r in (a, b)] == [4, 4]  # r2 still holds them
    b.mark_finished("r2")
    assert [r.load.load(w).blocks for r in (a, b)] == [0, 0]
