"""KV events over real ZMQ sockets (and a real nats-server's event plane), followed as the frontend does
(KvEventFollower -> EventIngestor.follow): delivery, late join, gaps, replay, rebuild."""

import asyncio

import pytest
import zmq
import zmq.asyncio

from dynamo_pd.frontend.kv_events import KvEventFollower
from dynamo_pd.protocol import WorkerInfo
from dynamo_pd.runtime import connect_event_plane
from dynamo_pd.runtime.kv_events import PlaneBatchPublisher, ZmqBatchPublisher, ZmqBatchSource
from router.events import BlockRemoved, BlockStored, encode_batch
from router.hashing import block_hashes
from router.service import KvRouter, RouterConfig
from tests.waits import until

BS = 4
PROMPTS = [[p * 1000 + i for i in range(4 * BS)] for p in range(12)]


def stored(p: int) -> bytes:
    """One engine step: prompt p's 4 blocks, named by a foreign (non-project) hash."""
    return encode_batch([BlockStored([f"{p}-{i}".encode() for i in range(4)], None, PROMPTS[p], BS)])


def worker(worker_id: str = "w", endpoint: str = "", replay: str | None = "", subject: str = "") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="prefill", engine="native", model="m", rpc_endpoint="",
                      kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay or "", kv_events_subject=subject)


def matches(router: KvRouter, p: int) -> dict:
    return router.indexer.find_matches(block_hashes(PROMPTS[p], BS))


def new_router(events=None) -> tuple[KvRouter, KvEventFollower]:
    router = KvRouter(RouterConfig(block_size=BS))
    router.add_worker("w", "prefill", capacity_blocks=1000)
    return router, KvEventFollower(router.ingestor, events, replay_timeout_s=1.0)


async def test_events_reach_the_indexer_and_a_late_joiner_replays_what_it_missed():
    pub = ZmqBatchPublisher(replay_endpoint="tcp://127.0.0.1:0")
    await pub.publish(stored(0))
    await pub.publish(stored(1))
    router, follower = new_router()
    await follower.follow(worker(endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await until(lambda: matches(router, 1) == {"w": 4})
    assert matches(router, 0) == {"w": 4}
    await pub.publish(encode_batch([BlockRemoved([b"0-2"])]))
    await until(lambda: matches(router, 0) == {"w": 2})
    assert router.ingestor.expected_seq("w") == 3 and router.ingestor.stats.resets == 0
    await follower.close()
    await pub.close()


class LossyLink:
    """Forwards a publisher's messages to a second PUB socket, dropping the sequence numbers in `drop`;
    messages from `hold_from` on wait until `release()`, so a test decides what the replay buffer holds.
    That socket is an XPUB: it hands the test each subscription, so a test can wait until one is live."""

    def __init__(self, source: str, drop: set[int], hold_from: int | None = None):
        ctx = zmq.asyncio.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(source)
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.drop = drop
        self.hold_from = hold_from
        self.received = 0
        self.held: list = []
        self.released = asyncio.Event()
        self.task = asyncio.create_task(self._forward())

    async def _forward(self):
        while True:
            frames = await self.sub.recv_multipart()
            self.received += 1
            seq = int.from_bytes(frames[1], "big")
            if self.hold_from is not None and seq >= self.hold_from and not self.released.is_set():
                self.held.append(frames)
            elif seq not in self.drop:
                await self.pub.send_multipart(frames)

    async def subscribed(self):
        """Once the XPUB has read a subscription, what it sends after reaches that subscriber."""
        assert (await asyncio.wait_for(self.pub.recv(), 5))[0] == 1

    async def release(self):
        self.released.set()
        for frames in self.held:
            if int.from_bytes(frames[1], "big") not in self.drop:
                await self.pub.send_multipart(frames)

    async def close(self):
        self.task.cancel()
        self.sub.close(linger=0)
        self.pub.close(linger=0)


async def probe(pub: ZmqBatchPublisher, arrived) -> int:
    """Publish probe batches (prompt 11) until `arrived()`, since ZMQ drops what a PUB sends before a
    subscription forms; returns the next batch's sequence number."""
    for published in range(1, 200):
        await pub.publish(stored(11))
        try:
            await until(arrived, "a probe batch", 0.05)
            return published
        except AssertionError:
            continue
    raise AssertionError("no probe batch arrived")


async def connected(router: KvRouter, follower: KvEventFollower, pub: ZmqBatchPublisher, link: LossyLink) -> int:
    """Probe until the link's subscription is live, then follow the link (with replay) until the router's
    subscription is live too and it has every probe; returns the next batch's sequence number."""
    first = await probe(pub, lambda: link.received > 0)
    await follower.follow(worker(endpoint=link.endpoint, replay=pub.replay_endpoint))
    await link.subscribed()
    await until(lambda: router.ingestor.expected_seq("w") == first)  # the probes, replayed
    return first


@pytest.mark.parametrize("buffer_steps, recovered_by", [(100, "replay"), (2, "rebuild")])
async def test_a_lost_batch_is_replayed_or_the_worker_rebuilt(buffer_steps, recovered_by):
    pub = ZmqBatchPublisher(replay_endpoint="tcp://127.0.0.1:0", buffer_steps=buffer_steps)
    link = LossyLink(pub.endpoint, drop=set())
    router, follower = new_router()
    first = await connected(router, follower, pub, link)
    link.drop, link.hold_from = {first + 2}, first + 1
    for p in range(6):  # prompt 0 arrives; of prompts 1..5, held until released, prompt 2 is lost
        await pub.publish(stored(p))
    await until(lambda: matches(router, 0) == {"w": 4} and len(link.held) == 5)  # the buffer is final
    await link.release()
    await until(lambda: matches(router, 5) == {"w": 4})
    stats = router.ingestor.stats
    assert stats.gaps >= 1
    if recovered_by == "replay":
        assert [matches(router, p) for p in range(6)] == [{"w": 4}] * 6
        assert stats.resets == 0
    else:  # the buffer (2 batches) no longer holds prompt 2's: state dropped, rebuilt from prompt 4 on
        assert stats.resets == 1
        assert [matches(router, p) for p in range(6)] == [{}, {}, {}, {}, {"w": 4}, {"w": 4}]
    await link.close()
    await follower.close()
    await pub.close()


async def test_the_last_batch_of_a_burst_lost_on_the_way_is_found_once_the_stream_is_quiet():
    """No later batch reveals the gap, so the quiet stream itself asks the replay buffer."""
    pub = ZmqBatchPublisher(replay_endpoint="tcp://127.0.0.1:0")
    link = LossyLink(pub.endpoint, drop=set())
    router, follower = new_router()
    first = await connected(router, follower, pub, link)
    link.drop = {first + 1}
    await pub.publish(stored(1))
    await pub.publish(stored(2))  # the last one never arrives live
    await until(lambda: matches(router, 2) == {"w": 4})
    assert matches(router, 1) == {"w": 4} and router.ingestor.stats.resets == 0
    await link.close()
    await follower.close()
    await pub.close()


async def test_without_replay_a_gap_drops_the_worker_state_and_rebuilds():
    pub = ZmqBatchPublisher()
    link = LossyLink(pub.endpoint, drop=set())
    router, follower = new_router()
    await follower.follow(worker(endpoint=link.endpoint))
    first = await probe(pub, lambda: router.ingestor.expected_seq("w") is not None)
    await until(lambda: router.ingestor.expected_seq("w") == first)  # probes in flight arrived
    link.drop = {first + 2}
    for p in range(5):  # seq first..first+4; prompt 2's batch is lost on the way
        await pub.publish(stored(p))
    await until(lambda: matches(router, 4) == {"w": 4})
    # what came before the gap may have been evicted in the lost batch: it is forgotten, never guessed
    assert [matches(router, p) for p in range(5)] == [{}, {}, {}, {"w": 4}, {"w": 4}]
    assert router.ingestor.stats.resets == 1
    await link.close()
    await follower.close()
    await pub.close()


async def test_a_worker_that_left_is_no_longer_followed_and_is_forgotten():
    pub = ZmqBatchPublisher(replay_endpoint="tcp://127.0.0.1:0")
    await pub.publish(stored(0))
    router, follower = new_router()
    witness = KvRouter(RouterConfig(block_size=BS))
    witness.add_worker("v", "prefill", capacity_blocks=1000)  # follows the same stream, and stays
    witness_follower = KvEventFollower(witness.ingestor, None)
    await follower.follow(worker(endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await witness_follower.follow(worker("v", endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await until(lambda: matches(router, 0) == {"w": 4} and matches(witness, 0) == {"v": 4})
    follower.forget("w")  # as the frontend does when the worker leaves discovery
    router.remove_worker("w")
    await until(lambda: all(t.get_name() != "kv-events-w" for t in asyncio.all_tasks()))  # unsubscribed
    await pub.publish(stored(1))
    await until(lambda: matches(witness, 1) == {"v": 4})  # the batch went out
    assert matches(router, 0) == {} and matches(router, 1) == {}
    await witness_follower.close()
    await follower.close()
    await pub.close()


async def test_a_replay_that_never_answers_times_out():
    silent = zmq.asyncio.Context.instance().socket(zmq.ROUTER)  # takes the request, answers nothing
    silent.bind("tcp://127.0.0.1:0")
    source = ZmqBatchSource("tcp://127.0.0.1:1", silent.getsockopt_string(zmq.LAST_ENDPOINT), replay_timeout_s=0.2)
    try:
        assert await source.replay(0) is None
    finally:
        await source.close()
        silent.close(linger=0)


async def test_publisher_rejects_use_after_close():
    pub = ZmqBatchPublisher()
    await pub.close()
    with pytest.raises(RuntimeError, match="is closed"):
        await pub.publish(stored(0))


async def test_events_ride_the_nats_event_plane(nats_url):
    """One connection per process: the worker's publisher and the frontend's subscription use its plane."""
    worker_plane, frontend_plane = await connect_event_plane(nats_url), await connect_event_plane(nats_url)
    router, follower = new_router(frontend_plane)
    try:
        await follower.follow(worker(subject="kv.w"))  # live on the server once this returns
        pub = PlaneBatchPublisher(worker_plane, "kv.w")
        for p in range(3):
            await pub.publish(stored(p))
        await until(lambda: matches(router, 2) == {"w": 4})
        assert [matches(router, p) for p in range(3)] == [{"w": 4}] * 3
        # the event plane has no replay: a gap in the sequence drops the worker's state and rebuilds from there
        await worker_plane.publish("kv.w", (9).to_bytes(8, "big") + stored(5))
        await until(lambda: matches(router, 5) == {"w": 4})
        assert matches(router, 0) == {} and router.ingestor.stats.resets == 1
    finally:
        await follower.close()
        await worker_plane.close()
        await frontend_plane.close()
