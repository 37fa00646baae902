"""The hand-off module on its own: its kinds on the wire, its times, and HandoffManager's pull and push
between two workers' real KV transfer agents (ZMQ on loopback). The engine here is the part of one a
manager touches (a KV cache tensor, release_handoff, its offer): the whole engines run in tests/engines
and the e2e deployments."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from dynamo_pd.handoff import HandoffManager, HandoffTimes, together_timeouts
from dynamo_pd.handoff_kinds import EngineHandoff, HeldKV, PullHandoff, PushHandoff, TransferStats
from dynamo_pd.protocol import EngineOutput, EngineRequest, Role, WorkerInfo

BLOCK, BLOCKS = 4, 16
PROMPT = list(range(10))  # 3 blocks, the last one partial


class KVEngine:
    """What a manager uses of an engine whose KV this project moves (the native engine's shapes)."""

    kv_handoffs = ("pull", "push")

    def __init__(self, fill: float):
        self.kv_cache = torch.full((2, 2, BLOCKS, BLOCK, 1, 4), fill)  # [L, 2, B, T, H, D]
        self.released: list[str] = []

    async def release_handoff(self, request_id: str) -> None:
        self.released.append(request_id)


class ConnectorEngine:
    """An engine that moves KV itself and offers its hand-off to both sides (SGLang's shape)."""

    kv_handoffs = ()

    def handoff_offer(self) -> EngineHandoff:
        return EngineHandoff(params={"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998})


async def outputs(*outs: EngineOutput):
    for out in outs:
        yield out


def info(worker_id: str, role: Role) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, engine="native", model="m", rpc_endpoint="tcp://127.0.0.1:1")


@pytest.fixture
async def pair():
    times = HandoffTimes(lease_s=5.0, transfer_timeout_s=2.0)
    prefill = HandoffManager("prefill-0", times, "zmq", offer_push=True)
    decode = HandoffManager("decode-0", times, "zmq")
    engines = KVEngine(1.0), KVEngine(0.0)
    engines[0].kv_cache[:, :, 5:8] = torch.arange(2 * 2 * 3 * BLOCK * 4, dtype=torch.float32).reshape(
        2, 2, 3, BLOCK, 1, 4
    )
    for manager, engine in zip((prefill, decode), engines):
        await manager.start(engine, "m")
    yield prefill, decode, *engines
    for manager in (prefill, decode):
        await manager.close()


def test_the_kinds_cross_the_wire_typed():
    offer = PushHandoff(worker_id="p", peer_endpoint="tcp://127.0.0.1:9")
    sent = offer.for_request("r", len(PROMPT), 3.0)
    request = EngineRequest(request_id="r", prompt_token_ids=PROMPT, handoff=sent)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineRequest).handoff == sent
    registered = msgspec.structs.replace(info("p", Role.PREFILL), handoff_offer=offer)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(registered), type=WorkerInfo) == registered
    out = EngineOutput(request_id="r", token_ids=[1], handoff=EngineHandoff(params={"state": b"\x00"}),
                       transfer=TransferStats(64, 0.5))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=EngineOutput) == out
    assert not PullHandoff.first_token_from_decode and not sent.first_token_from_decode
    assert (
        EngineHandoff().first_token_from_decode
        and not EngineHandoff(first_token_from_decode=False).first_token_from_decode
    )


def test_times_come_from_the_lease_and_the_transfer_timeout():
    times = HandoffTimes(lease_s=30.0, transfer_timeout_s=10.0)
    assert times.hold_s == 50.0 and times.engine_lease_s > times.hold_s  # the engine's backstop outlasts a hold
    push = PushHandoff(worker_id="p", peer_endpoint="x", request_id="r", num_tokens=1, wait_s=60.0)
    assert times.reserve_lease_s(push) == times.load_timeout_s(push) == 90.0
    assert times.transfer_config("nixl").lease_s == 30.0 and times.transfer_config("nixl").timeout_s == 10.0
    assert together_timeouts(60.0) == (60.0, 120.0)
    with pytest.raises(ValueError, match="positive"):
        HandoffTimes(lease_s=0)


async def test_pull_the_prefill_holds_until_the_decode_side_has_read(pair):
    prefill, decode, prefill_engine, decode_engine = pair
    request = EngineRequest(request_id="r1", prompt_token_ids=PROMPT)
    held = EngineOutput(request_id="r1", token_ids=[7], finish_reason="prefill_done",
                        handoff=HeldKV(request_id="r1", block_ids=[5, 6, 7], num_tokens=len(PROMPT)))
    stream = prefill.serve(request, outputs(held))
    first = await anext(stream)
    assert isinstance(first.handoff, PullHandoff) and first.handoff.worker_id == "prefill-0"
    assert first.handoff.descriptor.block_ids == [5, 6, 7] and prefill_engine.released == []
    ended = asyncio.ensure_future(anext(stream, None))  # the prefill's stream stays open while it holds
    await asyncio.sleep(0.05)
    assert not ended.done()

    assert await decode.load_kv(first.handoff, [0, 1, 2], 1) is None  # block 0 already cached here
    assert torch.equal(decode_engine.kv_cache[:, :, 1:3], prefill_engine.kv_cache[:, :, 6:8])
    assert decode_engine.kv_cache[:, :, 0].abs().sum() == 0
    assert await asyncio.wait_for(ended, 5) is None and prefill_engine.released == ["r1"]
    (out,) = [o async for o in decode.serve(EngineRequest(request_id="r1", prompt_token_ids=PROMPT),
                                            outputs(EngineOutput(request_id="r1", token_ids=[7, 8])))]
    assert out.transfer.nbytes == 2 * decode.agent.memory.layout.block_bytes


async def test_a_caller_that_leaves_frees_the_held_blocks_at_once(pair):
    prefill, _, prefill_engine, _ = pair
    held = EngineOutput(request_id="r2", token_ids=[7], finish_reason="prefill_done",
                        handoff=HeldKV(request_id="r2", block_ids=[5, 6, 7], num_tokens=len(PROMPT)))
    stream = prefill.serve(EngineRequest(request_id="r2", prompt_token_ids=PROMPT), outputs(held))
    await anext(stream)
    await stream.aclose()
    async with asyncio.timeout(5):
        while prefill_engine.released != ["r2"]:
            await asyncio.sleep(0.01)
    assert prefill.agent.holding() == []


async def test_push_the_prefill_writes_into_the_blocks_the_decode_side_reserved(pair):
    prefill, decode, prefill_engine, decode_engine = pair
    offer = prefill.register(info("prefill-0", Role.PREFILL)).handoff_offer
    assert isinstance(offer, PushHandoff) and offer.peer_endpoint == prefill.agent.endpoint
    handoff = offer.for_request("r3", len(PROMPT), 5.0)
    loading = asyncio.ensure_future(decode.load_kv(handoff, [9, 10, 11], 0))  # may reserve before the prefill runs
    held = EngineOutput(request_id="r3", token_ids=[42], finish_reason="prefill_done",
                        handoff=HeldKV(request_id="r3", block_ids=[5, 6, 7], num_tokens=len(PROMPT)))
    outs = [o async for o in prefill.serve(EngineRequest(request_id="r3", prompt_token_ids=PROMPT, handoff=handoff),
                                           outputs(held))]
    assert [o.handoff for o in outs] == [handoff]  # the frontend sees the hand-off it sent
    assert await asyncio.wait_for(loading, 5) == [42]  # the first token (one per choice) came with the KV
    assert torch.equal(decode_engine.kv_cache[:, :, 9:12], prefill_engine.kv_cache[:, :, 5:8])
    assert prefill_engine.released == ["r3"] and decode.agent.holding() == []


async def test_an_engine_that_moves_kv_itself_gets_no_agent_and_its_hand_off_is_stamped():
    manager = HandoffManager("prefill-1", HandoffTimes())
    await manager.start(ConnectorEngine(), "m")
    assert manager.agent is None
    registered = manager.register(info("prefill-1", Role.PREFILL))
    assert registered.handoff_offer.params["bootstrap_port"] == 8998 and registered.kv_endpoint == ""
    out = EngineOutput(request_id="r", token_ids=[1], handoff=EngineHandoff(params={"x": 1}))
    (served,) = [o async for o in manager.serve(EngineRequest(request_id="r", prompt_token_ids=[1]), outputs(out))]
    assert served.handoff.worker_id == "prefill-1"
    with pytest.raises(TypeError, match="EngineHandoff"):
        await manager.load_kv(served.handoff, [0], 0)
    await manager.close()
