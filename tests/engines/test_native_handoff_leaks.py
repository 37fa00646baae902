"""No KV block outlives a cancelled request: real native engines behind HandoffManagers (ZMQ agents),
cancelled the way the RPC server does it (the context, then the handler's task). Every wait for the
blocks to come back is far shorter than the leases (30 s agent, 60 s engine backstop), so a block that
only the backstop frees fails the test."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.engines.native.engine import NativeEngine
from dynamo_pd.handoff import HandoffManager, HandoffTimes
from dynamo_pd.handoff_kinds import PushHandoff
from dynamo_pd.protocol import EngineRequest, SamplingParams, StopConditions
from dynamo_pd.runtime import RequestContext

pytestmark = pytest.mark.slow

TIMES = HandoffTimes(lease_s=30.0, transfer_timeout_s=10.0)


def request(rid: str, ids: list[int], **kw) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                         stop=StopConditions(max_tokens=8, ignore_eos=True), **kw)


class ObservedEngine(NativeEngine):
    """The native engine, telling the test when its step thread has handed a request an output (queued
    it to the request's loop with call_soon_threadsafe): the moment a test may cancel the request at."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.submitted: dict[str, asyncio.Event] = {}  # the request reached the step thread's queue
        self.handed_over: dict[str, threading.Event] = {}

    def _sink(self, rid: str, inbox: asyncio.Queue) -> Callable[[Any], None]:
        deliver, handed_over = super()._sink(rid, inbox), threading.Event()
        self.handed_over[rid] = handed_over
        self.submitted.setdefault(rid, asyncio.Event()).set()  # generate() queues it right after this

        def observed(item: Any) -> None:
            deliver(item)
            handed_over.set()

        return observed


@pytest.fixture
async def pd():
    """A prefill and a decode worker's engine and hand-off manager, in this process."""
    prefill = ObservedEngine(EngineConfig(role=EngineRole.PREFILL, num_kv_blocks=64,
                                          max_num_batched_tokens=32, handoff=TIMES))
    pre = HandoffManager("prefill-0", TIMES, "zmq")
    dec = HandoffManager("decode-0", TIMES, "zmq")
    decode = NativeEngine(EngineConfig(role=EngineRole.DECODE, num_kv_blocks=64, handoff=TIMES),
                          kv_loader=dec.load_kv)
    for engine, manager in ((prefill, pre), (decode, dec)):
        await engine.start()
        await manager.start(engine, "m")
    yield prefill, pre, decode, dec
    for engine, manager in ((prefill, pre), (decode, dec)):
        await manager.close()
        await engine.stop()


async def all_free(engine: NativeEngine, manager: HandoffManager, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine.stats
        if s.num_free_blocks == s.num_total_blocks and s.num_held == s.num_running == s.num_loading == 0:
            assert manager.agent.holding() == []
            return
        assert time.monotonic() < deadline, f"{manager.worker_id} still holds blocks: {s}"
        await asyncio.sleep(0.05)


async def cancel_like_the_rpc_server(task: asyncio.Task, *contexts: RequestContext) -> None:
    for context in contexts:
        context.cancel()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_prefill_done_that_never_reached_its_consumer_is_freed(pd, prompt_ids):
    """The engine finished the prefill and queued its output (the blocks now held for a hand-off),
    but the handler was cancelled before it took it: the HeldKV reached nobody, so the engine frees it."""
    prefill, pre, _, _ = pd
    req = request("raced", prompt_ids[3])
    context = RequestContext(req.request_id)

    async def handler():
        async for _ in pre.serve(req, prefill.generate(req, context)):
            raise AssertionError("the loop was blocked until the cancel: no output can have arrived")

    task = asyncio.create_task(handler())
    submitted = prefill.submitted.setdefault(req.request_id, asyncio.Event())
    await asyncio.wait_for(submitted.wait(), 10)  # the handler waits for its first output now
    # Block the loop: the step thread queues the output to it, and nothing on it can take it.
    assert prefill.handed_over[req.request_id].wait(60), "the prefill never finished"
    assert prefill.stats.num_held == 1
    await cancel_like_the_rpc_server(task, context)
    await all_free(prefill, pre)


async def test_push_stream_closed_before_the_push_started_frees_the_blocks(pd, prompt_ids):
    """The first output is out and its push task created, not yet run, when the caller goes away."""
    prefill, pre, _, _ = pd
    ids = prompt_ids[3]
    offer = PushHandoff(worker_id="prefill-0", peer_endpoint=pre.agent.endpoint).for_request("push", len(ids),
                                                                                             10.0)
    req = request("push", ids, handoff=offer)
    stream = pre.serve(req, prefill.generate(req, RequestContext(req.request_id)))
    first = await anext(stream)
    assert first.finish_reason == "prefill_done" and first.handoff == offer
    await stream.aclose()
    await all_free(prefill, pre)


async def one_pd_request(pd, rid: str, ids: list[int], push: bool) -> None:
    """The frontend's dispatch: pull (decode after the prefill's first output, the prefill stream open
    until it has read) or push (both at once, under the request id)."""
    prefill, pre, decode, dec = pd
    pctx, dctx = RequestContext(rid), RequestContext(rid)

    async def run_decode(dreq: EngineRequest) -> None:
        async for _ in dec.serve(dreq, decode.generate(dreq, dctx)):
            pass

    if push:
        push_to = PushHandoff(worker_id="prefill-0", peer_endpoint=pre.agent.endpoint)
        offer = push_to.for_request(rid, len(ids), 10.0)
        preq = request(rid, ids, handoff=offer)

        async def run_prefill() -> None:
            async for _ in pre.serve(preq, prefill.generate(preq, pctx)):
                pass

        work = asyncio.gather(run_prefill(), run_decode(request(rid, ids, handoff=offer)))
    else:
        async def pull() -> None:
            preq = request(rid, ids)
            async with contextlib.aclosing(pre.serve(preq, prefill.generate(preq, pctx))) as stream:
                first = await anext(stream)
                dreq = request(rid, ids, handoff=first.handoff, first_token_id=first.token_ids[0])
                await asyncio.gather(run_decode(dreq), anext(stream, None))

        work = pull()
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:  # the client went away: both workers see it
        await cancel_like_the_rpc_server(task, pctx, dctx)
        raise


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
async def test_cancelled_at_random_points_in_prefill_transfer_and_decode(pd, prompt_ids, push):
    rng = random.Random(0)
    gate = asyncio.Semaphore(4)

    async def one(i: int) -> None:
        async with gate:
            task = asyncio.ensure_future(one_pd_request(pd, f"r{i}", prompt_ids[i % len(prompt_ids)], push))
            await asyncio.wait({task}, timeout=rng.uniform(0.0, 0.8))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    await asyncio.gather(*(one(i) for i in range(32)))
    prefill, pre, decode, dec = pd
    await all_free(prefill, pre)
    await all_free(decode, dec)
