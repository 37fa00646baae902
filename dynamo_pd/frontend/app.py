"""The OpenAI-compatible HTTP frontend: validate, tokenize, hand the request to its model's Backend,
stream back.

Errors are OpenAI error bodies: 400 the client's fault (never retried; context overflow too, as
OpenAI answers it), 401 bad key, 404 unknown model (naming the served ones), 413 body too large, 503
overloaded or a worker gone or silent (retry), 500 anything else. Server errors name no internal endpoint:
the log has the details. A client that goes away, from the moment its request arrives, cancels the request on
every worker holding it. Tokenization and the chat template run off the event loop (for a body over 8 KiB;
a smaller one costs less than a thread's hand-off).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from jinja2 import TemplateError

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from dynamo_pd import tracing
from dynamo_pd.runtime import RequestContext
from dynamo_pd.frontend import openai as oai, structured
from dynamo_pd.frontend.fields import FieldPolicy
from dynamo_pd.frontend.gateway import ModelNotFoundError
from dynamo_pd.frontend.tools import prompt, request as tool_request
from dynamo_pd.frontend.tools.output import OutputReader, Readers, choice_schema
from dynamo_pd.frontend.limits import Limiter, LimitsConfig, QueueFullError, RateLimitedError, client_key, queued
from dynamo_pd.frontend.sse import DONE, Chunks, EventStream
from dynamo_pd.metrics import Metrics
from dynamo_pd.runtime.errors import RemoteError, RpcError, StreamStalledError
from dynamo_pd.protocol import (
    EngineOutput,
    EngineRequest,
    Guided,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
)

log = logging.getLogger("dynamo_pd.frontend")
T = TypeVar("T")


class Backend(Protocol):
    """Whatever serves engine requests: local engines, or the router and remote workers."""

    model_name: str
    tokenizer: Any  # a Hugging Face tokenizer with the model's chat template
    max_model_len: int

    def ready(self) -> bool: ...

    def refresh_metrics(self) -> None:
        """Set the gauges that are read off live state rather than counted as requests pass."""

    def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]: ...


class Models(Protocol):
    """The served models and each one's Backend (dynamo_pd.frontend.gateway.Gateway)."""

    limiter: Limiter  # rate limits and queue caps

    def served(self) -> list[str]: ...

    def ready(self) -> bool: ...

    def lookup(self, name: str) -> Backend:
        """The model's backend; ModelNotFoundError when it is not served."""

    def health_report(self) -> dict[str, dict]:
        """Per model: {"ready": bool, ...}."""

    def chain(self, name: str) -> list[str]:
        """The models to try for `name`, in order: it, then its fallbacks."""

    def fell_back(self, model: str, answered_by: str) -> None:
        """Count a request for `model` that `answered_by` answered."""

    def refresh_metrics(self) -> None: ...


class OneModel:
    """One backend as Models (an in-process backend, tests)."""

    def __init__(self, backend: Backend):
        self.backend, self.limiter = backend, Limiter(LimitsConfig())

    def served(self) -> list[str]:
        return [self.backend.model_name] if self.backend.ready() else []

    def ready(self) -> bool:
        return self.backend.ready()

    def lookup(self, name: str) -> Backend:
        if name != self.backend.model_name:
            raise ModelNotFoundError(name, self.served())
        return self.backend

    def health_report(self) -> dict[str, dict]:
        return {self.backend.model_name: {"ready": self.backend.ready()}}

    def chain(self, name: str) -> list[str]:
        self.lookup(name)
        return [name]

    def fell_back(self, model: str, answered_by: str) -> None:
        pass

    def refresh_metrics(self) -> None:
        self.backend.refresh_metrics()


@dataclass
class FrontendConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 256
    tool_call_parser: str | None = None  # every model's tool-call format; None: each its own (tools.detect)
    reasoning_parser: str | None = None  # "think": <think>...</think> is reasoning_content


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 retry_after: str = "1"):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.retry_after = status, type_, param, code, retry_after


def as_http_error(exc: Exception, request_id: str) -> HTTPError:
    """What the client is told about `exc`: its kind, and no internal endpoint or traceback."""
    if isinstance(exc, ModelNotFoundError):
        return HTTPError(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, InvalidRequestError):
        return HTTPError(400, str(exc), "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, RateLimitedError):
        return HTTPError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded", retry_after=exc.retry_after)
    if isinstance(exc, QueueFullError):
        return HTTPError(503, str(exc), "overloaded_error", code="queue_full")
    if isinstance(exc, OverloadedError):
        return HTTPError(503, str(exc), "overloaded_error", code="overloaded")
    if isinstance(exc, StreamStalledError):
        log.warning("request %s: %s", request_id, exc)
        return HTTPError(503, "the worker serving this request stopped producing output; the request was ended",
                         "service_unavailable", code="worker_stalled")
    if isinstance(exc, RpcError) and not isinstance(exc, RemoteError):  # gone or silent: another may serve
        log.warning("request %s: %s", request_id, exc)
        return HTTPError(503, "the worker serving this request failed or stopped answering",
                         "service_unavailable", code="worker_unavailable")
    log.error("request %s failed", request_id, exc_info=exc)
    return HTTPError(500, f"internal error while serving request {request_id}", "server_error")


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   retry_after: str = "1") -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    headers = {"Retry-After": retry_after} if status in (429, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)


_OPEN_ROUTES = {"/health", "/ready"}
# A body up to this size (~500 tokens) is templated and tokenized on the event loop, in under a millisecond;
# a larger one in a thread, where the tokenizer releases the GIL (tokenizer.py): a burst of long prompts
# (Mooncake's rows arrive several at a time) tokenizes beside the loop instead of holding every stream
# ~2 ms per 1,000 tokens.
_INLINE_BODY_BYTES = 2 << 10
_PROCESS = str(os.getpid())  # the frontend process that answered (one of --frontend-processes)


def _body_too_large(limit: int) -> JSONResponse:
    return error_response(413, f"request body over {limit} bytes", "invalid_request_error")


class _Guard:
    """The API key and the body size limit, as plain ASGI: no task group or stream copy per request and
    per streamed chunk, as Starlette's BaseHTTPMiddleware costs. Declared lengths are refused up front; a
    body that declares none (a chunked upload) is read up to the limit, then handed to the app at once."""

    def __init__(self, app, api_key: str | None, limit: int):
        self.app, self.limit = app, limit
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # the request's arrival (its headers read, not its body), where its trace starts
        scope.setdefault("state", {})["arrival_ns"] = time.time_ns()
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in _OPEN_ROUTES and \
                not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            refused = error_response(401, "invalid or missing API key", "authentication_error",
                                     code="invalid_api_key")
            return await refused(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                return await _body_too_large(self.limit)(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await _body_too_large(self.limit)(scope, receive, send)
            more = message.get("more_body", False)
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is None:
                return await receive()  # after the body: disconnect notices
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)


def create_app(models: Models | Backend, config: FrontendConfig, metrics: Metrics | None = None) -> FastAPI:
    models = models if hasattr(models, "lookup") else OneModel(models)
    app = FastAPI(title="dynamo-pd", version="0.1.0")
    metrics = metrics or Metrics()
    app.state.metrics = metrics
    fields = FieldPolicy(metrics.unknown_fields)
    readers = Readers(config.tool_call_parser, config.reasoning_parser)

    app.add_middleware(_Guard, api_key=config.api_key, limit=config.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"{param or 'body'}: {first['msg']}", "invalid_request_error", param)

    @app.exception_handler(HTTPError)
    async def http_error(_request: Request, exc: HTTPError):
        return error_response(exc.status, str(exc), exc.type, exc.param, exc.code, exc.retry_after)

    @app.exception_handler(InvalidRequestError)  # raised while reading the body (content parts)
    async def invalid_request(_request: Request, exc: InvalidRequestError):
        return error_response(400, str(exc), "invalid_request_error", exc.param, exc.code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        error = as_http_error(exc, f"{request.method} {request.url.path}")
        return error_response(error.status, str(error), error.type, error.param, error.code)

    @app.get("/health")
    async def health() -> dict[str, Any]:  # the process is up; each model's readiness beside
        return {"status": "ok", "models": models.health_report()}

    @app.get("/ready")
    async def ready() -> Response:
        if models.ready():
            return JSONResponse({"status": "ready", "models": models.served()})
        return error_response(503, "no workers ready", "service_unavailable")

    @app.get("/metrics")
    async def prometheus() -> Response:
        models.refresh_metrics()
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models() -> Response:
        # A model is listed once a worker serves it: clients that poll this route for readiness (as vLLM's
        # and SGLang's servers allow, which listen only when ready) must not ask before then.
        if not models.ready():
            return error_response(503, "no workers ready", "service_unavailable")
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "dynamo-pd"}
                                                        for name in models.served()]})

    @app.post("/v1/chat/completions")
    async def chat(body: oai.ChatCompletionRequest, request: Request) -> Response:
        fields.check("chat", body.model_extra)
        tools, choice = tool_request.checked(body.tools, body.tool_choice)
        messages = [m.for_template() for m in body.messages]

        def tokenize(tokenizer: Any) -> list[int]:
            shown, given = prompt.for_template(getattr(tokenizer, "chat_template", None), messages,
                                               tools if choice != "none" else [])
            try:
                ids = tokenizer.apply_chat_template(shown, add_generation_prompt=True, tokenize=True,
                                                    **({"tools": given} if given else {}))
            except TemplateError as exc:  # the model's template refuses these messages (roles, order)
                raise InvalidRequestError(f"the chat template refused the messages: {exc}", "messages") from None
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

        def reader(backend: Backend, ids: list[int]) -> OutputReader | None:
            return readers.reader(backend.tokenizer, tools, choice, body.parallel_tool_calls, ids)

        # "required" or a named function: the output is constrained to the calls' JSON, which the reader reads
        schema = choice_schema(tools, choice, body.parallel_tool_calls is not False)
        forced = structured.json_schema(schema, "tool_choice") if schema is not None else None
        return await serve("chat", body, tokenize, request, reader, forced)

    @app.post("/v1/completions")
    async def completions(body: oai.CompletionRequest, request: Request) -> Response:
        fields.check("completion", body.model_extra)
        return await serve("completion", body, body.prompt_ids, request)

    async def serve(kind: str, body: oai._Common, tokenize: Callable[[Any], list[int]], http: Request,
                    reader_for: Callable[[Backend, list[int]], OutputReader | None] | None = None,
                    forced: Guided | None = None) -> Response:
        rid = oai.new_id("chatcmpl" if kind == "chat" else "cmpl")
        # the trace's root (or the client's traceparent's child); NOOP when tracing is off or not sampled
        span = tracing.request_span(http.headers, {"dynamo_pd.request_id": rid, "dynamo_pd.kind": kind,
                                                   "dynamo_pd.model": body.model,
                                                   "dynamo_pd.stream": bool(body.stream)},
                                    http.scope.get("state", {}).get("arrival_ns"))
        admission = tracing.start("admission", tracing.under(span))
        key = client_key(http.headers, http.client.host if http.client else "")
        gone = asyncio.ensure_future(_wait_disconnect(http))  # watched from the request's arrival on
        inline = int(http.headers.get("content-length") or _INLINE_BODY_BYTES + 1) <= _INLINE_BODY_BYTES
        stream: AsyncIterator[EngineOutput] | None = None
        status = "200"  # counted here unless a streamed response took the stream (it counts itself)
        charged = False
        shape: oai.Shape | None = None  # how the outputs become choices (a chat's: its tool calls read out)

        async def start(name: str) -> tuple[Backend, AsyncIterator[EngineOutput], EngineOutput,
                                            RequestContext]:
            """`name`'s backend, its stream, the stream's first output and the request's context (a model
            without a ready worker, a full queue or a worker that failed before any output raise, and its
            fallback is tried)."""
            nonlocal stream, charged, shape
            backend = models.lookup(name)
            if not backend.ready():
                raise OverloadedError(f"model {name!r} has no worker ready")
            if inline:  # a small prompt templates and tokenizes in less than a thread's hand-off costs
                ids = tokenize(backend.tokenizer)
            else:  # 4 MiB takes seconds
                ids = await _unless_gone(gone, asyncio.to_thread(tokenize, backend.tokenizer))
            request = EngineRequest(request_id=rid, prompt_token_ids=ids,
                                    sampling=body.sampling(body.logprob_count(), guided),
                                    stop=body.stop_conditions(config.default_max_tokens))
            request.validate()
            if len(ids) + request.stop.max_tokens > backend.max_model_len:
                raise PromptTooLongError(
                    f"prompt ({len(ids)} tokens) plus max_tokens ({request.stop.max_tokens}) exceeds the "
                    f"model's context of {backend.max_model_len} tokens", "messages" if kind == "chat" else "prompt")
            if not charged:  # limits count the model asked for, once
                models.limiter.check(key, body.model, tokens=len(ids) + request.stop.max_tokens)
                charged = True
            choice_readers = [reader_for(backend, ids) for _ in range(body.n)] if reader_for is not None else []
            shape = body.shape(backend.tokenizer.decode, ids, choice_readers)  # each choice reads its own output
            if admission.is_recording():  # admitted: the first model's admission (a fallback's is a retry's)
                admission.set_attributes({"dynamo_pd.model": name, "dynamo_pd.prompt_tokens": len(ids),
                                          "dynamo_pd.max_tokens": request.stop.max_tokens})
                tracing.end(admission)
            context = RequestContext(rid, tracing.carrier(span))  # the backend's spans are the request's
            stream = _timed(queued(backend.generate(request, context), models.limiter, name), metrics, span)
            first = await _unless_gone(gone, anext(stream))  # errors before it: HTTP errors
            return backend, stream, first, context

        try:
            chain = models.chain(body.model)
            models.limiter.check(key, body.model, requests=1)
            guided = structured.from_request(body)
            if forced is not None and guided is not None:
                raise InvalidRequestError("a required or named tool_choice constrains the output to its calls: it "
                                          f"cannot be combined with {guided.param}", "tool_choice")
            guided = forced or guided
            if guided is not None:  # a spec that does not compile is a 400 before any worker sees it
                await _unless_gone(gone, structured.check(guided))
            failures: list[Exception] = []
            for name in chain:
                try:
                    backend, stream, first, context = await start(name)
                    break
                except Exception as exc:
                    if not _unavailable(exc):
                        raise
                    failures.append(exc)
                    if stream is not None:
                        await stream.aclose()
                        stream = None
            else:
                raise failures[0]  # the error of the model the client asked for
            if name != body.model:
                models.fell_back(body.model, name)
            headers = {"x-dynamo-pd-model": name, "x-dynamo-pd-frontend": _PROCESS}
            if context.worker_id is not None:  # the worker streaming the answer (decode, aggregated) at its start
                headers["x-dynamo-pd-worker"] = context.worker_id
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                sse = _sse(shape, rid, backend, _chain(first, stream), include_usage, metrics, body.n, span)
                response = EventStream(sse, gone, headers)
                # the response owns them: it notices a client leaving, counts the request and ends its span
                stream, status, gone = None, None, None
                return response
            outputs = [first, *await _unless_gone(gone, _collect(stream))]
            whole = oai.whole_body(shape, rid, backend.model_name, outputs)
            return JSONResponse(whole, headers=headers)
        except _ClientGone:  # the request is cancelled everywhere already
            log.info("request %s: the client went away", rid)
            status = "499"
            return Response(status_code=499)
        except Exception as exc:  # StopAsyncIteration too: no first output
            error = as_http_error(exc, rid)
            status = str(error.status)
            raise error from exc
        finally:
            if gone is not None:
                gone.cancel()
            if stream is not None:
                await stream.aclose()
            tracing.end(admission)  # refused before it was admitted
            if status is not None:
                metrics.requests.labels(kind, status).inc()
                _end_span(span, status)

    return app


class _ClientGone(Exception):
    pass


def _unavailable(exc: Exception) -> bool:
    """The model cannot take the request now (its fallback may): unknown, no worker ready or routable
    (circuits open), its queue full, or a worker gone or silent before the first output."""
    return isinstance(exc, (ModelNotFoundError, OverloadedError, QueueFullError)) or (
        isinstance(exc, RpcError) and not isinstance(exc, RemoteError))


async def _unless_gone(gone: asyncio.Future, work: Awaitable[T]) -> T:
    """`work`'s result; or, when the client disconnects first, `work` cancelled where it waits and
    _ClientGone raised. `work` runs in the caller's task, which a callback on `gone` cancels: no task and
    no asyncio.wait per call."""
    task = asyncio.current_task()
    waiting = True

    def left(disconnect: asyncio.Future) -> None:
        if waiting and not disconnect.cancelled():  # a callback run late finds the wait over
            task.cancel()

    gone.add_done_callback(left)
    try:
        return await work
    except asyncio.CancelledError:
        if gone.done() and not gone.cancelled() and task.cancelling():
            task.uncancel()
            raise _ClientGone from None
        raise
    finally:
        waiting = False
        gone.remove_done_callback(left)


async def _chain(first: EngineOutput, rest: AsyncIterator[EngineOutput]) -> AsyncIterator[EngineOutput]:
    yield first
    async for out in rest:
        yield out


def _end_span(span: Any, status: str) -> None:
    """The request's span ends with its HTTP status; a server error (5xx) marks it failed."""
    if span is not tracing.NOOP:
        span.set_attribute("http.response.status_code", int(status))
        tracing.end(span, f"HTTP {status}" if status >= "500" else None)


async def _timed(stream: AsyncIterator[EngineOutput], metrics: Metrics, span: Any = tracing.NOOP,
                 ) -> AsyncIterator[EngineOutput]:
    """Record TTFT, ITL and usage, and count the request in flight while it is; the TTFT is a span of the
    request's trace too (first_token: from the frontend having the token until the response took it, a
    streamed chunk sent, as the client's TTFT ends)."""
    start = last = time.perf_counter()
    first = True
    delivering = tracing.NOOP  # the first token's span, open until the consumer asks for the next output
    metrics.inflight.inc()
    metrics.queued.inc()
    try:
        async for out in stream:
            now = time.perf_counter()
            if out.token_ids:
                if first:
                    metrics.ttft.observe(now - start)
                    metrics.queued.dec()
                    first = False
                    delivering = tracing.start("first_token", tracing.under(span), {
                        "dynamo_pd.ttft_s": now - start, "dynamo_pd.tokens": len(out.token_ids)})
                else:
                    metrics.itl.observe((now - last) / len(out.token_ids))
                last = now
            if out.usage is not None:
                metrics.record_usage(out.usage.prompt_tokens, out.usage.cached_tokens, out.usage.completion_tokens)
            if out.finish_reason == "error":
                raise RuntimeError(out.error or "generation failed")
            yield out
            if delivering is not tracing.NOOP:
                tracing.end(delivering)
                delivering = tracing.NOOP
    finally:
        tracing.end(delivering)
        if first:
            metrics.queued.dec()
        metrics.inflight.dec()
        await stream.aclose()


async def _collect(stream: AsyncIterator[EngineOutput]) -> list[EngineOutput]:
    return [out async for out in stream]


async def _wait_disconnect(http: Request) -> None:
    """Return when the client disconnects. Its body is read already, so the next message is that
    (`Request.is_disconnected` never sees it behind a BaseHTTPMiddleware: it polls under a cancelled scope)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _sse(shape: oai.Shape, rid: str, backend: Backend, stream: AsyncIterator[EngineOutput],
               include_usage: bool, metrics: Metrics, n: int = 1, span: Any = tracing.NOOP,
               ) -> AsyncIterator[bytes]:
    """The response's events, those of one output in one item (with the first, each choice's role chunk;
    with the last, the usage chunk and the end). The choices' chunks interleave, each with its index."""
    kind = shape.kind
    chunks = Chunks(kind, rid, backend.model_name)
    status = "200"
    roles = [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None} for i in range(n)]
    data = b"".join(chunks.choice(role) for role in roles) if kind == "chat" else b""
    done = False
    try:
        async for out in stream:
            choice = oai.stream_choice(shape, out)
            if choice is not None:
                data += chunks.choice(choice)
            if out.usage is not None and include_usage:
                data += chunks.usage(oai.usage_body(out.usage))
            if out.ends:  # the request's last output
                data, done = data + DONE, True
            if data:
                yield data
                data = b""
    except asyncio.CancelledError:
        status = "499"  # the client went away; closing `stream` cancels the request everywhere
        log.info("request %s: the client went away mid-stream", rid)
        raise
    except Exception as exc:  # noqa: BLE001 - a stream already started can only report in-band
        error = as_http_error(exc, rid)
        status = str(error.status)
        data += oai.sse_event({"error": {"message": str(error), "type": error.type, "param": error.param,
                                         "code": error.code}})
    finally:
        metrics.requests.labels(kind, status).inc()
        await stream.aclose()
        _end_span(span, status)
    if not done:
        yield data + DONE
