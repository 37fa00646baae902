"""RemoteBackend when a worker fails a request, over real RPC servers: a retry before the first token,
a migration after it (the client's stream goes on from the tokens it has), the circuit breaker, client
errors never retried, and the requests that cannot move. Each worker is a real RpcServer whose handler
plays an engine that resumes: output i is token 1000 + i, so a continuation is checkable."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec
import pytest

from dynamo_pd.frontend.backend import BackendConfig, RemoteBackend
from dynamo_pd.metrics import Metrics
from dynamo_pd.frontend.migration import Journey
from dynamo_pd.protocol import (EngineOutput, EngineRequest, InvalidRequestError, SamplingParams, StopConditions, Usage,
                               WorkerInfo)
from dynamo_pd.runtime import RequestContext, RpcServer
from dynamo_pd.runtime.errors import StreamStalledError, WorkerGoneError
from router.replica_sync import ReplicaSync
from router.service import KvRouter, RouterConfig
from router.worker import Role

PROMPT = list(range(1, 33))
_decode = msgspec.msgpack.Decoder(EngineRequest)
_encode = msgspec.msgpack.Encoder()


@dataclass
class FakeWorker:
    """Streams token 1000 + i for output i, from where resume_token_ids left off. `fault` applies to the
    original request id only (its first attempt): ("die" | "stall" | "drain" | "invalid", after n outputs)."""

    worker_id: str
    fault: tuple[str, int] | None = None
    resumes: bool = True
    seen: list[EngineRequest] = field(default_factory=list)
    server: RpcServer | None = None

    async def handler(self, payload: bytes, context: RequestContext):
        request = _decode.decode(payload)
        self.seen.append(request)
        start = len(request.resume_token_ids)
        assert request.resume_token_ids == [1000 + i for i in range(start)]
        fault = self.fault if "-" not in request.request_id else None
        for i in range(start, request.stop.max_tokens):
            if fault is not None and i == fault[1]:
                await self.misbehave(fault[0])
            # a fault past the end: every token goes out, then the worker fails before its final output
            last = i == request.stop.max_tokens - 1 and not (fault is not None and fault[1] >= i + 1)
            yield _encode.encode(EngineOutput(
                request_id=request.request_id, token_ids=[1000 + i], text=f" t{i}",
                finish_reason="length" if last else None,
                usage=Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1,
                            cached_tokens=8) if last else None))
            await asyncio.sleep(0.01)
        if fault is not None and fault[1] >= request.stop.max_tokens:
            await self.misbehave(fault[0])

    async def misbehave(self, how: str) -> None:
        if how == "die":  # the process goes: its socket closes under the open stream
            asyncio.get_running_loop().create_task(self.server.close())
            await asyncio.sleep(30)
        elif how == "stall":
            await asyncio.sleep(30)
        elif how == "drain":
            asyncio.get_running_loop().create_task(self.server.drain(0))
            await asyncio.sleep(30)
        elif how == "invalid":
            raise InvalidRequestError("max_tokens is too large for this worker", "max_tokens")


@pytest.fixture
async def deployment():
    made: list[tuple[FakeWorker, RpcServer]] = []
    backends: list[RemoteBackend] = []

    async def make(*workers: FakeWorker, migration_limit: int = 3, inter_token_timeout_s: float = 60.0):
        router = KvRouter(RouterConfig(block_size=16, policy="round_robin"))
        backend = RemoteBackend("model", None, 8192, None, None, router, Metrics(),
                                BackendConfig(migration_limit=migration_limit,
                                              inter_token_timeout_s=inter_token_timeout_s))
        backends.append(backend)
        for worker in workers:
            worker.server = server = RpcServer(worker.handler)
            await server.start()
            made.append((worker, server))
            router.add_worker(worker.worker_id, Role.AGGREGATED, capacity_blocks=100, block_size=16)
            backend.workers[worker.worker_id] = WorkerInfo(
                worker_id=worker.worker_id, role=Role.AGGREGATED, engine="fake", model="model",
                rpc_endpoint=server.endpoint, block_size=16, resumes=worker.resumes)
        return backend

    yield make
    for backend in backends:
        await backend.rpc.close()
    for _, server in made:
        await server.close()


async def run(backend: RemoteBackend, max_tokens: int = 8) -> list[EngineOutput]:
    request = EngineRequest(request_id="r", prompt_token_ids=PROMPT, stop=StopConditions(max_tokens=max_tokens))
    async with asyncio.timeout(20):
        return [out async for out in backend.generate(request, RequestContext("r"))]


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def count(counter, reason: str) -> float:
    return counter.labels(reason)._value.get()


@pytest.mark.parametrize("fault, reason", [("die", "worker_gone"), ("stall", "stalled"), ("drain", "draining")])
async def test_a_worker_failing_mid_stream_hands_the_request_on_and_the_stream_goes_on(deployment, fault, reason):
    a, b = FakeWorker("a", fault=(fault, 3)), FakeWorker("b")
    backend = await deployment(a, b, inter_token_timeout_s=0.5)
    outs = await run(backend)
    assert tokens(outs) == [1000 + i for i in range(8)] and "".join(o.text for o in outs) == "".join(
        f" t{i}" for i in range(8))
    (resumed,) = b.seen
    assert resumed.resume_token_ids == [1000, 1001, 1002] and resumed.prompt_token_ids == PROMPT
    assert resumed.request_id == "r-1"
    usage = outs[-1].usage  # the whole request, once
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 8)
    assert count(backend.metrics.migrations, reason) == 1 and count(backend.metrics.retries, reason) == 0
    assert backend.router.breaker.is_open("a")
    # every worker's predicted load for it is gone
    assert all(backend.router.load.load(w).requests == 0 for w in ("a", "b"))


async def test_a_failure_before_the_first_token_is_retried_on_another_worker(deployment):
    a, b = FakeWorker("a", fault=("die", 0)), FakeWorker("b")
    backend = await deployment(a, b)
    outs = await run(backend)
    assert tokens(outs) == [1000 + i for i in range(8)]
    (retried,) = b.seen
    assert retried.resume_token_ids == [] and retried.request_id == "r-1"
    assert count(backend.metrics.retries, "worker_gone") == 1 and count(backend.metrics.migrations, "worker_gone") == 0
    # the breaker keeps "a" out of the next placements while b serves
    for _ in range(3):
        assert tokens(await run(backend, max_tokens=2)) == [1000, 1001]
    assert len(a.seen) == 1


async def test_a_client_error_is_never_retried(deployment):
    a, b = FakeWorker("a", fault=("invalid", 0)), FakeWorker("b", fault=("invalid", 0))
    backend = await deployment(a, b)
    with pytest.raises(InvalidRequestError, match="too large"):
        await run(backend)
    assert len(a.seen) + len(b.seen) == 1 and not backend.router.breaker.is_open("a")


async def test_requests_that_cannot_move_end_with_the_workers_error(deployment, caplog):
    # the limit is 0
    backend = await deployment(FakeWorker("a", fault=("die", 2)), FakeWorker("b"), migration_limit=0)
    with pytest.raises(WorkerGoneError):
        await run(backend)
    # no other worker whose engine resumes
    backend = await deployment(FakeWorker("c", fault=("stall", 2)), FakeWorker("d", resumes=False),
                               inter_token_timeout_s=0.3)
    with pytest.raises(StreamStalledError):
        await run(backend)
    assert "no other worker whose engine resumes" in caplog.text
    # every token of max_tokens sent, only the final output lost
    backend = await deployment(FakeWorker("e", fault=("die", 4)), FakeWorker("f"))
    with pytest.raises(WorkerGoneError):
        await run(backend, max_tokens=4)
    assert "all 4 of its max_tokens were generated" in caplog.text


async def test_a_request_moves_at_most_migration_limit_times(deployment):
    workers = [FakeWorker(f"w{i}") for i in range(3)]
    backend = await deployment(*workers, migration_limit=2)

    async def failing(self, payload, context):  # every attempt, wherever it lands, dies after one more token
        request = _decode.decode(payload)
        i = len(request.resume_token_ids)
        yield _encode.encode(EngineOutput(request_id=request.request_id, token_ids=[1000 + i]))
        await asyncio.sleep(0.05)
        asyncio.get_running_loop().create_task(self.server.close())
        await asyncio.sleep(30)

    for worker in workers:
        worker.server._handler = failing.__get__(worker)
    with pytest.raises(WorkerGoneError):
        await run(backend)
    assert count(backend.metrics.migrations, "worker_gone") == 2


async def test_a_request_that_streamed_to_its_end_reports_what_its_client_saw(deployment):
    """The router's finish carries the TTFT and mean ITL the client saw (the planner's measurements), after
    a migration too; a request that failed reports none."""
    updates = []
    for workers, fails in (((FakeWorker("a"),), False), ((FakeWorker("b", fault=("die", 3)), FakeWorker("c")), False),
                           ((FakeWorker("d", fault=("die", 2)),), True)):
        backend = await deployment(*workers, migration_limit=1)
        sync = ReplicaSync(backend.router.load, "frontend", send=updates.append)
        backend.router.attach_replica_sync(sync)
        updates.clear()
        if fails:
            with pytest.raises(WorkerGoneError):
                await run(backend)
        else:
            await run(backend)
        *moved, finish = [u for u in updates if u.kind == "finish"]  # the last placement's (r-1 after a move)
        assert all((u.ttft_s, u.itl_s) == (0.0, 0.0) for u in moved)
        if fails:
            assert (finish.ttft_s, finish.itl_s) == (0.0, 0.0)
        else:  # the workers wait 10 ms after each token
            assert finish.ttft_s > 0 and finish.itl_s >= 0.009, finish


def test_the_itl_of_n_choices_is_one_choices_gap_between_its_tokens():
    request = EngineRequest(request_id="r", prompt_token_ids=PROMPT, stop=StopConditions(max_tokens=5),
                            sampling=SamplingParams(n=2))
    journey = Journey(request, limit=0)
    for i in range(10):  # two choices of 5 tokens, side by side
        journey.sent_output(EngineOutput(request_id="r", token_ids=[i], index=i % 2,
                                         finish_reason="length" if i >= 8 else None, choices_left=int(i < 9)))
    journey.started, journey.first_token_at, journey.last_token_at = 0.0, 0.1, 0.5
    assert journey.latencies() == (0.1, pytest.approx(0.1))  # 0.4 s over each choice's 4 gaps
