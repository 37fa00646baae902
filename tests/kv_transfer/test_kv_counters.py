"""KVTransferAgent.counters(), what a worker's /metrics renders of its KV agent: real transfers between two
agents over ZMQ in this process, each side counting what it moved and why a hand-off failed."""

import asyncio

import pytest
import zmq
import zmq.asyncio
from kv_peer import filled_memory, make_layout
from tests.kv_transfer.cases import needs_nixl
from tests.waits import until

from kv_transfer import (BlocksFreedError, CompatError, KVMemory, KVTransferAgent, LeaseExpiredError, PeerLostError,
                         TransferConfig)
from kv_transfer.agent import FAILURE_REASONS


class Releases:
    """on_release callbacks that a test can await."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}
        self._changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def __call__(self, rid, reason, _payload) -> None:
        def note() -> None:
            self.seen[rid] = reason.value
            self._changed.set()
        self._loop.call_soon_threadsafe(note)

    async def wait(self, rid: str, timeout_s: float = 10.0) -> str:
        async def poll() -> str:
            while rid not in self.seen:
                self._changed.clear()
                await self._changed.wait()
            return self.seen[rid]
        return await asyncio.wait_for(poll(), timeout_s)


def agents(model: str = "smol") -> tuple[KVTransferAgent, KVTransferAgent]:
    layout = make_layout("native", 16)
    return (KVTransferAgent("prefill", filled_memory(layout, 1), TransferConfig("zmq")),
            KVTransferAgent("decode", KVMemory.allocate(make_layout("native", 16, model=model)), TransferConfig("zmq")))


async def test_both_sides_count_each_pull_and_push_once_with_the_same_bytes():
    prefill, decode = agents()
    block_bytes = prefill.memory.layout.block_bytes
    async with prefill, decode:
        held, reserved = Releases(), Releases()
        desc = prefill.hold("pull-1", [1, 2, 3], 40, held)
        pulled = await decode.pull(desc, [4, 5], skip_prefix_blocks=1)  # a prefix hit: 2 of the 3 blocks move
        assert await held.wait("pull-1") == "done"
        target = decode.hold("push-1", [6, 7], 32, reserved, writable=True)
        await decode.reserve(prefill.endpoint, target)
        pushed = await prefill.push(await prefill.wait_push_target("push-1", 10.0), [8, 9])
        assert await reserved.wait("push-1") == "done"
        p, d = prefill.counters(), decode.counters()
    assert (pulled, pushed) == (2 * block_bytes, 2 * block_bytes)
    assert p.transport == d.transport == "zmq"
    # out of the prefill: the pull it held (bytes from the puller's Finish) and the push it ran
    assert (p.moved["out"].count, p.moved["out"].bytes) == (2, pulled + pushed)
    assert (d.moved["in"].count, d.moved["in"].bytes) == (2, pulled + pushed)
    assert p.moved["out"].seconds > 0 and d.moved["in"].seconds > 0
    assert p.moved["in"].count == d.moved["out"].count == 0
    assert not any(p.failures.values()) and not any(d.failures.values())
    assert (p.malformed_requests, p.malformed_replies, p.nixl_agents_torn_down) == (0, 0, None)


async def test_failures_are_counted_by_reason_on_the_side_that_saw_them():
    prefill, decode = agents()
    _, other_model = agents(model="another-model")
    async with prefill, decode, other_model:
        releases = Releases()
        late = prefill.hold("late", [1], 16, releases, lease_s=0.05)
        assert await releases.wait("late") == "expired"
        with pytest.raises(LeaseExpiredError):
            await decode.pull(late, [2])
        with pytest.raises(CompatError):
            await other_model.pull(prefill.hold("other", [1], 16, releases), [2])
        assert await releases.wait("other") == "error"  # the puller's Finish(ok=False)
        dropped = prefill.hold("dropped", [3], 16, releases)
        assert prefill.release("dropped")
        with pytest.raises(BlocksFreedError):
            await decode.pull(dropped, [4])
        with pytest.raises(PeerLostError):
            await prefill.wait_push_target("nobody-reserved", 0.05)
        p, d, o = prefill.counters(), decode.counters(), other_model.counters()
    assert set(p.failures) == set(FAILURE_REASONS)
    assert {k: v for k, v in p.failures.items() if v} == {"hold_expired": 1, "hold_error": 1, "hold_cancelled": 1,
                                                         "peer_lost": 1}
    assert {k: v for k, v in d.failures.items() if v} == {"lease_expired": 1, "blocks_freed": 1}
    assert {k: v for k, v in o.failures.items() if v} == {"compat": 1}
    assert p.moved["out"].count == d.moved["in"].count == 0  # nothing moved


async def test_unreadable_side_channel_messages_are_counted():
    prefill, _ = agents()
    async with prefill:
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(prefill.endpoint)
        try:
            await raw.send_multipart([b"id", b"not msgpack"])
            await asyncio.wait_for(raw.recv_multipart(), 10)  # answered as a bad request
            await until(lambda: prefill.counters().malformed_requests == 1)
        finally:
            raw.close(linger=0)


@pytest.mark.nixl
@needs_nixl
async def test_a_nixl_agent_reports_its_torn_down_agents():
    layout = make_layout("native", 16)
    async with KVTransferAgent("n", KVMemory.allocate(layout), TransferConfig("nixl")) as agent:
        assert agent.counters().nixl_agents_torn_down == agent.transport.torn_down == 0
