"""The frontend's streaming path, in process, at the ASGI level: one write per output (the role chunk with
the first, usage and the end with the last), a client that leaves before or after its first token closes
the backend's stream, the API key and body limit as plain ASGI, and outputs that arrived together joined
into one."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from dynamo_pd.frontend.app import FrontendConfig, create_app
from dynamo_pd.frontend.backend import _joined
from dynamo_pd.frontend.tokenizer import load_tokenizer
from dynamo_pd.handoff_kinds import EngineHandoff
from dynamo_pd.metrics import Metrics
from dynamo_pd.protocol import EngineOutput, TokenLogprob, Usage

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}}
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)[0]


class Backend:
    """Answers `outputs`; with `hold`, waits for it to be set after `hold_after` outputs. Records whether its
    stream was closed before it ended."""

    model_name, max_model_len = MODEL, 8192

    def __init__(self, tokenizer, outputs: list[EngineOutput], hold_after: int | None = None):
        self.tokenizer, self.outputs, self.hold_after = tokenizer, outputs, hold_after
        self.hold = asyncio.Event()
        self.closed_early = asyncio.Event()

    def ready(self) -> bool:
        return True

    def refresh_metrics(self) -> None:
        pass

    async def generate(self, request, context):
        finished = False
        try:
            for i, out in enumerate(self.outputs):
                if i == self.hold_after:
                    await self.hold.wait()
                yield out
            finished = True
        finally:
            if not finished:
                self.closed_early.set()


def step(text: str, **fields) -> EngineOutput:
    return EngineOutput(request_id="r", token_ids=[7] * len(text), text=text, **fields)


async def call(app, body: bytes, headers: dict[bytes, bytes] | None = None, leave_after: int | None = None,
               chunks: list[bytes] | None = None) -> list[dict]:
    """Run one POST through the ASGI app; the messages it sends. The client leaves once `leave_after` body
    messages arrived (0: before any), if given. `chunks`: the body in these pieces, no length declared."""
    headers = {b"content-type": b"application/json", **(headers or {})}
    if chunks is None:
        headers[b"content-length"] = str(len(body)).encode()
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)] if chunks is not None else [
        {"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []
    leave = asyncio.Event()
    if leave_after == 0:
        leave.set()

    async def receive():
        if incoming:
            return incoming.pop(0)
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if leave_after is not None and sum(m["type"] == "http.response.body" for m in sent) >= leave_after:
            leave.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "headers": list(headers.items()),
             "client": ("127.0.0.1", 5000),
             "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), 2 * TIMEOUT_S)
    return sent


def events(body: bytes) -> list:
    return [json.loads(e[len(b"data: "):]) if e != b"data: [DONE]" else "[DONE]"
            for e in body.split(b"\n\n") if e]


async def test_one_write_per_output_the_role_with_the_first_and_usage_and_the_end_with_the_last(tokenizer):
    outputs = [step("Hel"), step("lo"),
               step("!", finish_reason="stop", usage=Usage(prompt_tokens=9, completion_tokens=6))]
    sent = await call(create_app(Backend(tokenizer, outputs), FrontendConfig()), json.dumps(CHAT).encode())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m["body"] for m in sent[1:] if m["body"]]
    assert len(bodies) == len(outputs)
    first, middle, last = (events(b) for b in bodies)
    assert [e["choices"][0]["delta"] for e in first] == [{"role": "assistant"}, {"content": "Hel"}]
    assert [e["choices"][0]["delta"] for e in middle] == [{"content": "lo"}]
    assert last[0]["choices"][0] == {"index": 0, "finish_reason": "stop", "delta": {"content": "!"}}
    assert last[1]["choices"] == [] and last[1]["usage"]["total_tokens"] == 15 and last[2] == "[DONE]"
    envelope = {k: v for k, v in first[0].items() if k != "choices"}
    assert envelope["object"] == "chat.completion.chunk" and envelope["model"] == MODEL
    assert all({k: v for k, v in e.items() if k not in ("choices", "usage")} == envelope
               for b in (first, middle, last) for e in b if e != "[DONE]")
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


@pytest.mark.parametrize("leave_after", [0, 1])
async def test_a_client_that_leaves_closes_the_backend_stream(tokenizer, leave_after):
    """Before its first token (0: the backend holds it back) or after it (1: the role and first token sent):
    either way the backend's stream is closed, so every worker holding the request cancels it."""
    backend = Backend(tokenizer, [step("a"), step("b"), step("c", finish_reason="stop")],
                      hold_after=0 if leave_after == 0 else 1)
    metrics = Metrics()
    app = create_app(backend, FrontendConfig(), metrics)
    answering = asyncio.create_task(call(app, json.dumps(CHAT).encode(), leave_after=leave_after))
    await asyncio.wait_for(backend.closed_early.wait(), TIMEOUT_S)  # while the app still runs (its bound: 2x)
    sent = await answering
    if leave_after == 0:
        assert sent[0]["status"] == 499
    else:
        assert sent[0]["status"] == 200 and [m["body"] for m in sent[1:]][0].count(b"data: ") == 2
    assert metrics.requests.labels("chat", "499")._value.get() == 1


async def test_the_api_key_and_the_body_limit(tokenizer):
    app = create_app(Backend(tokenizer, [step("a", finish_reason="stop")]),
                     FrontendConfig(api_key="k" * 16, max_body_bytes=1000))
    body = json.dumps(CHAT).encode()
    auth = {b"authorization": b"Bearer " + b"k" * 16}
    for headers, status in (({}, 401), ({b"authorization": b"Bearer wrong"}, 401), (auth, 200)):
        assert (await call(app, body, headers))[0]["status"] == status
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}).encode()
    assert (await call(app, big, auth))[0]["status"] == 413  # declared
    assert (await call(app, big, auth, chunks=[big[:600], big[600:]]))[0]["status"] == 413  # chunked
    sent = await call(app, body, auth, chunks=[body[:20], body[20:]])  # chunked, under the limit
    assert sent[0]["status"] == 200 and b"data: [DONE]" in b"".join(m.get("body", b"") for m in sent)


def test_outputs_that_arrived_together_are_joined_where_they_can_be():
    lp = [TokenLogprob(7, -0.5, [])]
    a, b = step("ab", logprobs=lp * 2), step("c", logprobs=lp, finish_reason="length", stop_reason=None,
                                              usage=Usage(prompt_tokens=3, completion_tokens=3))
    joined = _joined(a, b)
    assert joined == msgspec.structs.replace(b, token_ids=[7, 7, 7], text="abc", logprobs=lp * 3)
    handoff = EngineHandoff(worker_id="p0")
    plain = step("a")
    assert _joined(plain, step("b")) == step("ab")
    for refused in ((b, a),  # after the end
                    (step("a", handoff=handoff), plain), (plain, step("b", handoff=handoff)),  # a hand-off
                    (plain, step("", finish_reason="error", error="boom")),  # an error
                    (plain, step("b", logprobs=lp))):  # logprobs on one side only
        assert _joined(*refused) is None, refused
