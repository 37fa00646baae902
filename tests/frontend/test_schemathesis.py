"""A real 1 prefill + 1 decode deployment: requests generated from its own /openapi.json never get a
5xx, and the client errors only a worker can find (its vocabulary, its KV cache) come back as 400s,
never retried on another worker and never counted as prefill fallbacks."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.e2e.conftest import MODEL, Deployment

pytestmark = pytest.mark.slow
EXAMPLES = 30  # per operation and mode: bounds the run (each valid completion runs the engine)


def _reaching_the_engine(case) -> None:
    """The model name fixed, so cases pass the 404 and reach the engine; output kept short unless
    the case is about overflowing the context."""
    body = case.body
    if case.operation.method.upper() != "POST" or not isinstance(body, dict):
        return
    body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and 2 < body[key] < 4096:
            body[key] = 2
    body.setdefault("max_tokens", 2)


def test_generated_requests_never_get_a_server_error(small_disagg: Deployment):
    schema = schemathesis.openapi.from_url(small_disagg.url + "/openapi.json")
    server_errors = []
    seen: dict[str, int] = {}  # status class -> cases, for the summary line
    operations = 0
    for result in schema.get_all_operations():
        operations += 1
        operation = result.ok()
        has_body = operation.method.upper() == "POST"  # the others take nothing a negative case could break
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):

            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case) -> None:
                _reaching_the_engine(case)
                response = case.call(base_url=small_disagg.url, timeout=120)
                kind = f"{response.status_code // 100}xx"
                seen[kind] = seen.get(kind, 0) + 1
                if response.status_code >= 500:
                    server_errors.append((operation.label, mode.value, case.body, response.status_code,
                                          response.text[:300]))

            check()
    print(f"schemathesis: {operations} operations, {sum(seen.values())} cases: "
          + ", ".join(f"{k} {v}" for k, v in sorted(seen.items())) + f"; server errors {len(server_errors)}")
    assert server_errors == []
    assert small_disagg.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason="prefill_failed") == 0


def test_a_token_outside_the_vocabulary_is_a_400_from_the_worker_not_a_fallback(small_disagg: Deployment):
    status, body = small_disagg.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 49152], "max_tokens": 2})
    assert status == 400, body
    assert body["error"]["param"] == "prompt" and "vocabulary" in body["error"]["message"]
    assert "tcp://" not in body["error"]["message"]
    assert small_disagg.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason="prefill_failed") == 0


def test_a_prompt_larger_than_the_workers_kv_cache_is_a_400_context_length_exceeded(small_disagg: Deployment):
    status, body = small_disagg.post("/v1/completions", {"model": MODEL, "prompt": [42] * 1500, "max_tokens": 2})
    assert status == 400, body
    assert body["error"]["code"] == "context_length_exceeded" and "KV cache" in body["error"]["message"]
    assert small_disagg.rendered_metric("dynamo_pd_prefill_fallbacks_total", reason="prefill_failed") == 0
