"""SGLang behind the contract, without a GPU: argument mapping into SGLang's real ServerArgs, request
translation checked against its real SamplingParams and against Engine.async_generate's signature and
GenerateReqInput's fields (read from SGLang's installed source: those modules import torchvision, which
the CPU venv leaves out), its output dicts into EngineOutputs, generate() and cancellation against a fake
shaped like sglang.Engine, and KV events from SGLang's real ZMQ publisher into the router's ingest.
sglang.Engine itself needs CUDA: test_real_engine runs it where one is."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

# sglang's own requirements pull CUDA: the CPU test venv holds it --no-deps in a directory of its own
# (pip check stays clean), as ./dev.sh test installs it
NODEPS = Path(sys.prefix) / "sglang-nodeps"
if NODEPS.is_dir() and str(NODEPS) not in sys.path:
    sys.path.append(str(NODEPS))
sglang = pytest.importorskip("sglang", reason=f"needs sglang: pip install --no-deps --target {NODEPS} sglang==0.5.23")

from sglang.srt.disaggregation.kv_events import (  # noqa: E402
    BlockRemoved as SglBlockRemoved,
    BlockStored as SglBlockStored,
    KVEventBatch as SglKVEventBatch,
    KVEventsConfig,
    ZmqEventPublisher,
)
from sglang.srt.sampling.sampling_params import TOP_K_ALL, SamplingParams as SglSamplingParams  # noqa: E402

from dynamo_pd.engines.base import EngineConfig, EngineRole, EngineUnavailableError  # noqa: E402
from dynamo_pd.engines.sglang import SglangEngine, StreamReader, bootstrap_room  # noqa: E402
from dynamo_pd.handoff_kinds import EngineHandoff  # noqa: E402
from dynamo_pd.protocol import EngineRequest, SamplingParams, StopConditions  # noqa: E402
from dynamo_pd.runtime import RequestContext  # noqa: E402
from dynamo_pd.runtime.kv_events import ZmqBatchSource  # noqa: E402
from router.hashing import block_hashes  # noqa: E402
from router.indexer import KvIndexer  # noqa: E402
from router.ingest import EventIngestor  # noqa: E402


SGLANG_SRC = Path(importlib.util.find_spec("sglang").origin).parent / "srt"


def _source_class(path: str, name: str) -> ast.ClassDef:
    tree = ast.parse((SGLANG_SRC / path).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def async_generate_params() -> set[str]:
    """sglang.Engine.async_generate's keyword parameters (srt/entrypoints/engine.py)."""
    fn = next(n for n in _source_class("entrypoints/engine.py", "Engine").body
              if isinstance(n, ast.AsyncFunctionDef) and n.name == "async_generate")
    return {a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs}


def request_fields() -> set[str]:
    """GenerateReqInput's fields (srt/managers/io_struct.py), which async_generate fills from its keywords."""
    return {n.target.id for n in _source_class("managers/io_struct.py", "GenerateReqInput").body
            if isinstance(n, ast.AnnAssign)}


# meta_info["finish_reason"] as SGLang's FINISH_* classes' to_json() give it (srt/managers/schedule_batch.py)
def stop_str(matched: str) -> dict:
    return {"type": "stop", "matched": matched}


def length(n: int) -> dict:
    return {"type": "length", "length": n}


def abort(message: str) -> dict:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def engine(role: EngineRole, **extra) -> SglangEngine:
    return SglangEngine(EngineConfig(role=role, block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
                                     seed=3, extra=extra))


def request(**kw) -> EngineRequest:
    kw.setdefault("sampling", SamplingParams(temperature=0.5, top_p=0.9, top_k=0, seed=7, logprobs=2))
    kw.setdefault("stop", StopConditions(max_tokens=20, stop=["\n\n"], stop_token_ids=[2]))
    return EngineRequest(request_id="r-1", prompt_token_ids=[1, 2, 3, 4], cache_salt="tenant", **kw)


def test_prefill_server_args_are_sglangs_own(tmp_path):
    pub = f"ipc://{tmp_path}/kv"
    e = engine(EngineRole.PREFILL, kv_events_endpoint=pub, kv_events_replay_endpoint=pub + ".replay",
               gpu_memory_utilization=0.4)
    args = e.server_args
    assert (args.disaggregation_mode, args.disaggregation_transfer_backend) == ("prefill", "nixl")
    assert (args.page_size, args.max_running_requests, args.chunked_prefill_size) == (16, 8, 512)
    assert (args.random_seed, args.mem_fraction_static, args.device) == (3, 0.4, "cpu")
    assert args.disaggregation_bootstrap_port != 8998  # a free port: two prefill workers on one host
    events = KVEventsConfig.from_cli(args.kv_events_config)  # as SGLang's scheduler parses it
    assert (events.publisher, events.endpoint, events.replay_endpoint, events.topic) == (
        "zmq",
        pub,
        pub + ".replay",
        "",
    )
    offer = e.handoff_offer()
    assert offer.params == {"bootstrap_host": "127.0.0.1", "bootstrap_port": args.disaggregation_bootstrap_port}
    assert offer.first_token_from_decode


def test_decode_and_aggregated_server_args():
    decode = engine(EngineRole.DECODE)
    assert decode.server_args.disaggregation_mode == "decode" and decode.handoff_offer() is None
    aggregated = engine(EngineRole.AGGREGATED, disable_cuda_graph=True)
    assert aggregated.server_args.disaggregation_mode == "null" and aggregated.server_args.disable_cuda_graph


def test_transfer_backend_choice_is_checked():
    with pytest.raises(ValueError, match="must be one of nixl, mooncake"):
        engine(EngineRole.DECODE, disaggregation_transfer_backend="tcp")
    with pytest.raises(EngineUnavailableError, match="mooncake-transfer-engine"):  # not installed here
        engine(EngineRole.DECODE, disaggregation_transfer_backend="mooncake")
    with pytest.raises(ValueError, match="cumulative"):
        engine(EngineRole.AGGREGATED, incremental_streaming_output=True)


def test_generate_args_fit_sglangs_request_and_sampling_classes():
    offer = engine(EngineRole.PREFILL).handoff_offer().for_request("r-1", 4, 5.0)
    for role in (EngineRole.PREFILL, EngineRole.DECODE):
        args = engine(role).generate_args(request(handoff=offer))
        assert set(args) <= async_generate_params() and set(args) <= request_fields()
        sampling = SglSamplingParams(**args["sampling_params"])
        sampling.verify(vocab_size=49152)
        assert (sampling.top_k, sampling.max_new_tokens, sampling.stop_strs) == (TOP_K_ALL, 20, ["\n\n"])
        assert (sampling.temperature, sampling.sampling_seed, sampling.stop_token_ids) == (0.5, 7, {2})
        assert args["bootstrap_room"] == bootstrap_room("r-1") > 0
        assert (args["bootstrap_host"], args["top_logprobs_num"], args["cache_salt"]) == ("127.0.0.1", 2, "tenant")
    assert bootstrap_room("r-1") != bootstrap_room("r-2")
    assert "bootstrap_room" not in engine(EngineRole.AGGREGATED).generate_args(request())


def test_disaggregated_request_without_the_offer_is_refused():
    with pytest.raises(ValueError, match="needs the bootstrap hand-off"):
        engine(EngineRole.DECODE).generate_args(request())


def out(ids, text, reason=None, **meta):
    return {"text": text, "output_ids": ids, "meta_info": {
        "id": "r-1", "finish_reason": reason, "prompt_tokens": 4,
        "completion_tokens": len(ids), "cached_tokens": 2, **meta}}


def test_cumulative_outputs_become_deltas_with_stop_string_holdback():
    reader = StreamReader(request(), EngineRole.DECODE)
    first = reader.read(out([5], "Hi"))
    assert (first.token_ids, first.text) == ([5], "H")  # "i" could still start "\n\n"
    second = reader.read(out([5, 6], "Hi\n"))
    assert (second.token_ids, second.text) == ([6], "i")
    last = reader.read(out([5, 6, 7], "Hi", stop_str("\n\n")))  # SGLang trimmed the stop string
    assert (last.token_ids, last.text, last.finish_reason, last.stop_reason) == ([7], "", "stop", "\n\n")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (4, 3, 2)
    assert "".join(o.text for o in (first, second, last)) == "Hi" and reader.finished


def test_logprobs_are_translated():
    reader = StreamReader(request(), EngineRole.AGGREGATED)
    chosen = [(-0.1, 5, None), (-0.7, 6, None)]
    tops = [[(-0.1, 5, None), (-2.5, 9, None)], [(-3.0, 8, None), (-0.7, 6, None)]]
    reader.read(out([5], "a", output_token_logprobs=chosen[:1], output_top_logprobs=tops[:1]))
    last = reader.read(out([5, 6], "ab", length(2), output_token_logprobs=chosen, output_top_logprobs=tops))
    assert [(lp.token_id, lp.logprob, lp.top) for lp in last.logprobs] == [(6, -0.7, [(6, -0.7), (8, -3.0)])]
    assert last.finish_reason == "length"


def test_prefill_ends_with_the_offered_handoff_and_aborts_are_errors():
    offer = EngineHandoff(params={"bootstrap_host": "h", "bootstrap_port": 1}, request_id="r-1",
                          first_token_from_decode=True)
    done = StreamReader(request(handoff=offer), EngineRole.PREFILL).read(out([5], "Hi", length(0)))
    assert (done.finish_reason, done.handoff, done.token_ids) == ("prefill_done", offer, [5])
    failed = StreamReader(request(), EngineRole.DECODE).read(out([], "", abort("KV transfer failed")))
    assert (failed.finish_reason, failed.error) == ("error", "KV transfer failed")


class FakeTokenizerManager:
    def __init__(self):
        self.aborted: list[str] = []
        self.context_len = 2048

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.aborted.append(rid)


class FakeSglangEngine:
    """Shaped like sglang 0.5.23's sglang.Engine (srt/entrypoints/engine.py): `async_generate(prompt=None,
    sampling_params=None, input_ids=None, ..., stream=False, bootstrap_host=None, bootstrap_port=None,
    bootstrap_room=None, ..., rid=None, ..., *, cache_salt=None)` returns, with stream=True, an async generator
    of cumulative output dicts; `tokenizer_manager.abort_request(rid=...)`; `shutdown()`."""

    def __init__(self, steps, hang=False):
        self.steps, self.hang = steps, hang
        self.hanging = asyncio.Event()  # every step streamed, waiting forever (hang=True)
        self.tokenizer_manager = FakeTokenizerManager()
        self.calls: list[dict] = []

    async def async_generate(self, **kwargs):
        assert set(kwargs) <= async_generate_params(), set(kwargs) - async_generate_params()
        self.calls.append(kwargs)

        async def stream():
            for step in self.steps:
                yield step
            if self.hang:
                self.hanging.set()
                await asyncio.Event().wait()

        return stream()

    def shutdown(self):
        pass


async def run(e: SglangEngine, fake: FakeSglangEngine, req: EngineRequest, context: RequestContext):
    e._engine = fake
    return [o async for o in e.generate(req, context)]


async def test_generate_streams_and_cancels():
    steps = [out([5], "H"), out([5, 6], "Hi"), out([5, 6, 7], "Hi!", length(3))]
    e = engine(EngineRole.AGGREGATED)
    fake = FakeSglangEngine(steps)
    outs = await run(e, fake, request(stop=StopConditions(max_tokens=3)), RequestContext("r-1"))
    assert [o.token_ids for o in outs] == [[5], [6], [7]] and "".join(o.text for o in outs) == "Hi!"
    assert fake.calls[0]["input_ids"] == [1, 2, 3, 4] and fake.calls[0]["rid"] == "r-1"

    hanging = FakeSglangEngine(steps[:1], hang=True)
    context = RequestContext("r-1")
    task = asyncio.ensure_future(run(e, hanging, request(), context))
    await asyncio.wait_for(hanging.hanging.wait(), 5)  # cancelled mid-stream, after its first output
    context.cancel()
    outs = await asyncio.wait_for(task, 5)
    assert outs[-1].finish_reason == "abort" and hanging.tokenizer_manager.aborted == ["r-1"]


async def test_kv_events_from_sglangs_publisher_reach_the_indexer(tmp_path):
    """SGLang's own ZmqEventPublisher (PUB + replay ROUTER) -> the project's ZMQ source and router ingest."""
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv.replay"
    publisher = ZmqEventPublisher(attn_dp_rank=0, endpoint=endpoint, replay_endpoint=replay)
    source = ZmqBatchSource(endpoint, replay)
    try:
        tokens = list(range(100, 132))
        a, b = block_hashes(tokens, 16)  # SGLang's hashes differ from the project's: ingest maps them
        stored = [SglBlockStored(block_hashes=[11], parent_block_hash=None, token_ids=tokens[:16], block_size=16,
                                 lora_id=None, medium="GPU", cache_salt=None, session_id="s"),
                  SglBlockStored(block_hashes=[12], parent_block_hash=11, token_ids=tokens[16:], block_size=16,
                                 lora_id=None)]
        indexer = KvIndexer()
        ingest = EventIngestor(indexer, block_size=16)

        async def deliver_next() -> int:
            batch = await source.next(timeout_s=5)
            assert batch is not None, "a batch SGLang published did not arrive"
            ingest.deliver("w", *batch)
            return batch[0]

        # PUB drops what it sends before the SUB's subscription reaches it (ZMQ's slow joiner): empty
        # batches until one arrives; from then on nothing is lost
        probes = 0
        while await source.next(timeout_s=0.05) is None:
            assert probes < 200, "no batch from SGLang's publisher reached the subscriber"
            publisher.publish(SglKVEventBatch(ts=time.time(), events=[]))
            probes += 1
        publisher.publish(SglKVEventBatch(ts=time.time(), events=stored))  # seq `probes`
        publisher.publish(SglKVEventBatch(ts=time.time(), events=[SglBlockRemoved(block_hashes=[12])]))
        while await deliver_next() < probes:  # probes that were still on their way
            pass
        assert indexer.find_matches([a, b]).to_dict() == {"w": 2}
        assert ingest.stats.rejected == 0
        assert await deliver_next() == probes + 1
        assert indexer.find_matches([a, b]).to_dict() == {"w": 1}
        replayed = await source.replay(0)  # SGLang's replay socket speaks the same protocol
        assert [seq for seq, _ in replayed] == list(range(probes + 2))
    finally:
        publisher.shutdown()
        await source.close()


@pytest.mark.slow
@pytest.mark.hardware
@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="sglang.Engine needs an NVIDIA GPU")
async def test_real_engine(model_dir):
    e = SglangEngine(EngineConfig(role=EngineRole.AGGREGATED, device="cuda", dtype="bfloat16",
                                  extra={"mem_fraction_static": 0.5}))
    await e.start()
    try:
        req = EngineRequest(request_id="real-1", prompt_token_ids=[1, 504, 3458, 282, 4649, 314],
                            sampling=SamplingParams(temperature=0), stop=StopConditions(max_tokens=8))
        outs = [o async for o in e.generate(req, RequestContext("real-1"))]
        assert sum(len(o.token_ids) for o in outs) == 8 and outs[-1].finish_reason == "length"
        assert outs[-1].usage.prompt_tokens == 6 and json.dumps(outs[-1].text)
    finally:
        await e.stop()
