"""The frontend's answers to bad requests and failed workers, in process on the real tokenizer: the
client's fault is a 400 refused before any backend work, the server's a 5xx naming no internal
endpoint; tokenization runs off the event loop (but for small bodies)."""

from __future__ import annotations

import copy
import threading

import httpx
import pytest
from transformers import AutoTokenizer

from dynamo_pd.frontend.app import FrontendConfig, create_app
from dynamo_pd.protocol import EngineOutput, InvalidRequestError, OverloadedError, PromptTooLongError
from dynamo_pd.runtime.errors import FirstResponseTimeoutError, RemoteError, StreamStalledError, WorkerGoneError

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


class Backend:
    """A backend that answers `outputs`, or raises `error`; records the threads tokenization ran on."""

    model_name, max_model_len = MODEL, 8192

    def __init__(self, tokenizer, error: Exception | None = None, outputs: list[EngineOutput] | None = None):
        self.tokenizer, self.error, self.outputs = _ThreadRecorder(tokenizer), error, outputs
        self.requests = []

    def ready(self) -> bool:
        return True

    def refresh_metrics(self) -> None:
        pass

    async def generate(self, request, context):
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        for out in self.outputs or []:
            yield out


class _ThreadRecorder:
    def __init__(self, tokenizer):
        self._tokenizer, self.threads = tokenizer, set()

    def __call__(self, *args, **kwargs):
        self.threads.add(threading.get_ident())
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.threads.add(threading.get_ident())
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self._tokenizer.decode(*args, **kwargs)


async def post(backend: Backend, path: str, body: dict | bytes) -> tuple[int, dict]:
    app = create_app(backend, FrontendConfig())
    content = body if isinstance(body, bytes) else None
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as client:
        response = await client.post(path, json=None if content else body, content=content,
                                     headers={"content-type": "application/json"})
    return response.status_code, response.json()


def _with(body: dict, **fields) -> dict:
    return {**body, **fields}


REFUSED = [  # (path, body, the param the 400 names)
    ("/v1/chat/completions", _with(CHAT, messages=[{"role": "system", "content": [{}]}]), "messages"),  # schemathesis
    ("/v1/chat/completions", _with(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
     "messages"),
    ("/v1/chat/completions", _with(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages"),
    ("/v1/completions", _with(COMPLETION, prompt=[1, -1]), "prompt"),
    ("/v1/completions", _with(COMPLETION, prompt=[1, 1 << 32]), "prompt"),
    ("/v1/completions", _with(COMPLETION, prompt=[(1 << 64) + 1]), "prompt"),
    ("/v1/completions", _with(COMPLETION, seed=(1 << 64) + 1), "seed"),
    ("/v1/completions", _with(COMPLETION, stop_token_ids=[(1 << 64) + 1]), "stop_token_ids"),
    ("/v1/completions", _with(COMPLETION, top_k=1 << 40), "top_k"),
    ("/v1/completions", _with(COMPLETION, stop=["x"] * 17), "stop"),
    ("/v1/completions", _with(COMPLETION, stop=["x" * 257]), "stop"),
    ("/v1/completions", _with(COMPLETION, stop_token_ids=list(range(65))), "stop_token_ids"),
]


@pytest.mark.parametrize("path, body, param", REFUSED)
async def test_bad_input_is_a_400_naming_its_field_before_any_backend_work(tokenizer, path, body, param):
    backend = Backend(tokenizer)
    status, answer = await post(backend, path, body)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"].split(".")[0] == param, answer
    assert backend.requests == []


@pytest.mark.parametrize("raw", [
    b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800", "max_tokens": 4}',  # lone surrogate: valid JSON
    b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": [{"type": "text", '
    b'"text": "\\ud800"}]}]}',
    b'{"model": "\\ud800", "prompt": "hi"}',
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "temperature": NaN}',
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "repetition_penalty": 1e999}',
])
async def test_text_no_tokenizer_takes_and_non_finite_numbers_are_400s(tokenizer, raw):
    backend = Backend(tokenizer)
    status, answer = await post(backend, "/v1/chat/completions" if b"messages" in raw else "/v1/completions", raw)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert backend.requests == []


async def test_limits_are_named_in_the_400(tokenizer):
    status, answer = await post(Backend(tokenizer), "/v1/completions", _with(COMPLETION, stop=["x"] * 17))
    assert status == 400 and "at most 16 stop strings" in answer["error"]["message"]
    status, answer = await post(Backend(tokenizer), "/v1/completions", _with(COMPLETION, stop_token_ids=[1] * 65))
    assert status == 400 and "at most 64 stop_token_ids" in answer["error"]["message"]


async def test_a_chat_template_that_refuses_the_messages_is_a_400(tokenizer):
    strict = copy.deepcopy(tokenizer)  # a template like Mistral's, which insists on alternating roles
    strict.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                            "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    backend = Backend(strict)
    status, answer = await post(backend, "/v1/chat/completions",
                                _with(CHAT, messages=[{"role": "user", "content": "a"}] * 2))
    assert status == 400 and answer["error"]["param"] == "messages", answer
    assert "roles must alternate" in answer["error"]["message"]
    assert backend.requests == []


async def test_context_overflow_is_a_400_as_openai_answers_it(tokenizer):
    backend = Backend(tokenizer)
    status, answer = await post(backend, "/v1/completions", _with(COMPLETION, max_tokens=8192))
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded" and answer["error"]["param"] == "prompt"
    assert backend.requests == []


INTERNAL = "tcp://10.1.2.3:5555"
FAILURES = [  # what the backend raised -> status, code
    (InvalidRequestError("prompt token id 50000 is outside the vocabulary [0, 49152)", "prompt"), 400, None),
    (PromptTooLongError("prompt plus max_tokens is 2000 tokens, more than the whole KV cache", "prompt"), 400,
     "context_length_exceeded"),
    (OverloadedError("all 1 decode workers are busy"), 503, "overloaded"),
    (WorkerGoneError(f"connection to worker {INTERNAL} dropped"), 503, "worker_unavailable"),
    (FirstResponseTimeoutError(f"worker {INTERNAL} sent nothing within 60s"), 503, "worker_unavailable"),
    (StreamStalledError(f"worker {INTERNAL} sent nothing within 60s"), 503, "worker_stalled"),
    (RemoteError("CudaError", "device lost", INTERNAL), 500, None),
    (RuntimeError(f"remote prefill failed: {INTERNAL}"), 500, None),
]


@pytest.mark.parametrize(
    "error, status, code", FAILURES, ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None
)
async def test_a_backend_error_keeps_its_kind_and_names_no_internal_endpoint(tokenizer, error, status, code):
    got, answer = await post(Backend(tokenizer, error), "/v1/chat/completions", CHAT)
    assert got == status and answer["error"]["code"] == code, answer
    assert INTERNAL not in answer["error"]["message"] and "Traceback" not in answer["error"]["message"]


async def test_a_stream_that_fails_after_its_first_token_reports_the_kind_in_band(tokenizer):
    class Stalls(Backend):
        async def generate(self, request, context):
            yield EngineOutput(request_id=request.request_id, token_ids=[42], text="hi")
            raise StreamStalledError(f"worker {INTERNAL} sent nothing within 60s")

    app = create_app(Stalls(tokenizer), FrontendConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as client:
        response = await client.post("/v1/chat/completions", json=_with(CHAT, stream=True))
    assert response.status_code == 200
    assert '"code":"worker_stalled"' in response.text and INTERNAL not in response.text
    assert response.text.endswith("data: [DONE]\n\n")


async def test_tokenization_and_the_chat_template_run_off_the_event_loop(tokenizer):
    """Off the loop for a body over 64 KiB; a smaller one is templated and tokenized on the loop, where it
    costs less than a thread's hand-offs."""
    text = "=" * (66 << 10)  # 66 KiB, ~1,100 tokens (a run of one symbol tokenizes in 64-character pieces)
    for bodies, off_the_loop in (((CHAT, COMPLETION), False),
                                 (({**CHAT, "messages": [{"role": "user", "content": text}]},
                                   {**COMPLETION, "prompt": text}), True)):
        backend = Backend(tokenizer, outputs=[EngineOutput(request_id="r", token_ids=[42], text="hi",
                                                           finish_reason="stop")])
        for path, body in zip(("/v1/chat/completions", "/v1/completions"), bodies):
            status, answer = await post(backend, path, body)
            assert status == 200, answer
        assert len(backend.requests) == 2 and backend.tokenizer.threads
        loop_thread = threading.get_ident()  # the test's loop runs the app
        assert (loop_thread not in backend.tokenizer.threads) == off_the_loop, off_the_loop
