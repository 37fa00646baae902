"""Rate limits and admission: token buckets per API key and per model (requests/s, tokens/s) on a
fake clock, and through the HTTP app on the real tokenizer: a bounded burst sees exactly the
allowed count pass and 429 with Retry-After for the rest; a full queue is a 503."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from transformers import AutoTokenizer

from dynamo_pd.frontend.app import FrontendConfig, OneModel, create_app
from dynamo_pd.frontend.limits import Limit, Limiter, LimitsConfig, QueueFullError, RateLimitedError
from dynamo_pd.protocol import EngineOutput, Usage

MODEL = "SmolLM2-135M-Instruct"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_buckets_per_key_and_per_model_refill_at_their_rate_and_a_refusal_costs_nothing():
    clock = Clock()
    limiter = Limiter(LimitsConfig(per_key=Limit(requests_per_s=2), per_model=Limit(tokens_per_s=100),
                                   keys={"vip": Limit(requests_per_s=10)}), clock=clock)
    limiter.check("a", "m", requests=1)
    limiter.check("a", "m", requests=1)
    with pytest.raises(RateLimitedError) as refused:
        limiter.check("a", "m", requests=1)
    assert refused.value.limit == "key_requests" and refused.value.retry_after_s == pytest.approx(0.5)
    assert refused.value.retry_after == "1"
    limiter.check("b", "m", requests=1)  # another key has its own bucket
    for _ in range(10):
        limiter.check("vip", "m", requests=1)  # an override
    clock.now = 0.5
    limiter.check("a", "m", requests=1)  # refilled one

    limiter.check("a", "m", tokens=150)  # over the bucket: waits for a full one, then leaves it in debt
    with pytest.raises(RateLimitedError) as refused:
        limiter.check("c", "m", tokens=10)
    assert refused.value.limit == "model_tokens" and refused.value.retry_after_s == pytest.approx(0.6)
    clock.now = 1.1
    limiter.check("c", "m", tokens=10)


def test_a_request_refused_by_one_bucket_is_not_charged_to_the_others():
    clock = Clock()
    limiter = Limiter(LimitsConfig(per_key=Limit(requests_per_s=5), per_model=Limit(requests_per_s=1)), clock=clock)
    limiter.check("a", "m", requests=1)
    for _ in range(3):
        with pytest.raises(RateLimitedError):
            limiter.check("a", "m", requests=1)  # the model's bucket refuses; the key's keeps its 4
    for model in ("m2", "m3", "m4", "m5"):
        limiter.check("a", model, requests=1)


def test_the_queue_cap_per_model():
    limiter = Limiter(LimitsConfig(max_queued=2))
    limiter.enqueue("m")
    limiter.enqueue("m")
    with pytest.raises(QueueFullError, match="model 'm' has 2 requests waiting"):
        limiter.enqueue("m")
    limiter.enqueue("other")
    limiter.dequeue("m")
    limiter.enqueue("m")


class Backend:
    model_name, max_model_len = MODEL, 8192

    def __init__(self, tokenizer, gate: asyncio.Event | None = None):
        self.tokenizer, self.gate = tokenizer, gate

    def ready(self) -> bool:
        return True

    def refresh_metrics(self) -> None:
        pass

    async def generate(self, request, context):
        if self.gate is not None:
            await self.gate.wait()
        yield EngineOutput(request_id=request.request_id, token_ids=[42], text="hi", finish_reason="stop",
                           usage=Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=1))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def served(backend: Backend, limits: LimitsConfig) -> OneModel:
    models = OneModel(backend)
    models.limiter = Limiter(limits, clock=Clock())  # time stands still: no bucket refills during the burst
    return models


async def test_a_burst_sees_exactly_the_allowed_count_pass_and_429s_with_retry_after(tokenizer):
    app = create_app(served(Backend(tokenizer), LimitsConfig(per_key=Limit(requests_per_s=2), burst_s=2.5)),
                     FrontendConfig())
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as client:
        answers = await asyncio.gather(*(client.post("/v1/completions", json=body,
                                                     headers={"authorization": "Bearer key-a"}) for _ in range(12)))
        other = await client.post("/v1/completions", json=body, headers={"authorization": "Bearer key-b"})
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] * 5 + [429] * 7  # 2.5 s of 2 requests/s
    for refused in (a for a in answers if a.status_code == 429):
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "2 requests/s for this API key" in refused.json()["error"]["message"]
    assert other.status_code == 200


async def test_tokens_per_s_counts_prompt_and_max_tokens(tokenizer):
    app = create_app(served(Backend(tokenizer), LimitsConfig(per_model=Limit(tokens_per_s=100))), FrontendConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as client:
        first = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 10, "max_tokens": 80})
        second = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 10, "max_tokens": 80})
    assert first.status_code == 200 and second.status_code == 429
    assert second.headers["retry-after"] == "1" and "100 tokens/s for model" in second.json()["error"]["message"]


async def test_requests_beyond_the_queue_cap_are_a_clear_503(tokenizer):
    gate = asyncio.Event()
    models = served(Backend(tokenizer, gate), LimitsConfig(max_queued=2))
    app = create_app(models, FrontendConfig())
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as client:
        waiting = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(2)]
        async with asyncio.timeout(30):
            while models.limiter.queued.get(MODEL) != 2:
                await asyncio.sleep(0.01)
        full = await client.post("/v1/completions", json=body)
        gate.set()
        done = await asyncio.gather(*waiting)
        after = await client.post("/v1/completions", json=body)
    assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
    assert "waiting for their first token" in full.json()["error"]["message"] and full.headers["retry-after"]
    assert [d.status_code for d in done] == [200, 200] and after.status_code == 200
