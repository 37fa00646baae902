"""mistral.rs behind the engine contract: aggregated only, its text equal to mistral.rs's own completion,
KV events of the prompts its prefix cache keeps."""

import asyncio
import subprocess
import sys

import pytest

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.protocol import EngineRequest, InvalidRequestError, SamplingParams, StopConditions
from dynamo_pd.runtime import RequestContext
from router.indexer import KvIndexer
from router.ingest import EventIngestor
from router.hashing import block_hashes

mistralrs = pytest.importorskip("mistralrs")
from dynamo_pd.engines.mistralrs import MistralRsEngine  # noqa: E402


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_prefill_and_decode_are_refused_in_one_line(role):
    with pytest.raises(SystemExit, match=f"mistralrs runs aggregated workers only, not {role}"):
        MistralRsEngine(EngineConfig(role=EngineRole(role)))
    run = subprocess.run([sys.executable, "-m", f"dynamo_pd.{role}", "--engine", "mistralrs"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: --engine mistralrs runs aggregated workers only, not {role}: mistral.rs's Python API exports no KV "
        "or sequence state to hand over (use --engine llamacpp or native for prefill/decode)"]


@pytest.fixture(scope="module")
def engine():
    engine = MistralRsEngine(EngineConfig(block_size=4, extra={"prefix_cache_n": 2}))
    asyncio.run(engine.start())  # it keeps no loop-bound state: each test's loop may drive it
    yield engine
    asyncio.run(engine.stop())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat(tokenizer, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                              add_generation_prompt=True)["input_ids"])


async def run(engine, rid, prompt, **stop):
    request = EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(temperature=0),
                            stop=StopConditions(**stop))
    return [out async for out in engine.generate(request, RequestContext(rid))]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [[], ["Paris"]])
async def test_streamed_text_is_mistralrs_own_completion(engine, tokenizer, stop):
    prompt = chat(tokenizer, "What is the capital of France? Answer in one sentence.")
    outs = await run(engine, f"r-{len(stop)}", prompt, max_tokens=24, stop=stop)
    text = "".join(o.text for o in outs)
    own = engine._runner.send_completion_request(mistralrs.CompletionRequest(
        prompt=tokenizer.decode(prompt), model="default", max_tokens=24, temperature=0.0, stop_seqs=stop or None))
    assert text == own.choices[0].text and text
    assert len(outs) > 3 and all(o.finish_reason is None for o in outs[:-1])  # streamed, token by token
    assert outs[-1].finish_reason == "stop" and outs[-1].usage.prompt_tokens == len(prompt)
    assert (text.endswith("Paris") is False) if stop else "Paris" in text


@pytest.mark.slow
async def test_kv_events_follow_its_prefix_cache(engine, tokenizer):
    """prefix_cache_n=2: the indexer holds the prompts of the last two requests, in project hashes."""
    ingestor = EventIngestor(KvIndexer(), 4)
    ingestor.apply_events("w", engine.drain_kv_events())  # what earlier tests left cached
    prompts = [chat(tokenizer, f"Tell me about the number {n}.") for n in (1, 2, 3)]
    hashes = [block_hashes(p, 4) for p in prompts]
    for i, prompt in enumerate(prompts):
        await run(engine, f"ev-{i}", prompt, max_tokens=2)
        ingestor.apply_events("w", engine.drain_kv_events())
        held = set(hashes[i]) | set(hashes[i - 1] if i else ())
        assert ingestor.indexer.find_matches(hashes[i])["w"] == len(hashes[i])
        if i:
            assert ingestor.indexer.blocks_of("w") == len(held)
    shared = next(n for n, (a, b) in enumerate(zip(hashes[0], hashes[1])) if a != b)
    assert ingestor.indexer.find_matches(hashes[0])["w"] == shared  # its own blocks left with it


@pytest.mark.slow
async def test_what_it_cannot_do_is_a_client_error(engine, tokenizer):
    prompt = chat(tokenizer, "Hi")
    for sampling in (SamplingParams(seed=3), SamplingParams(logprobs=2)):
        with pytest.raises(InvalidRequestError):
            request = EngineRequest(request_id="bad", prompt_token_ids=prompt, sampling=sampling)
            [out async for out in engine.generate(request, RequestContext("bad"))]
