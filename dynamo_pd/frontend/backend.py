"""RemoteBackend: the frontend's view of the deployment: discovery -> router -> workers over RPC.

Disaggregated path of one request:
  1. the router places it (router.service.Placement): a decode worker by load (and by overlap, when
     it may prefill locally), and a prefill worker by overlap and load unless the uncached part of
     the prompt is at most `local_prefill_tokens` (the decode worker prefills it itself);
  2. the prefill worker returns the first token, which goes to the client at once;
  3. what the prefill worker registered decides the rest (dynamo_pd.handoff), never its engine's name:
     no offer (pull-like): the first output's hand-off (a PullHandoff, or an engine's own) goes to
           the decode worker with the request; it loads the KV and streams the rest;
     an offer (push-like): `offer.for_request(...)` went to prefill and decode together, under the
           same request id; the decode worker reserved blocks, the prefill worker wrote the KV and
           the first token into them, and the decode worker streams the rest.
     The client gets the prefill's first token, or the decode side's when the hand-off says the
     decode side samples it again (`first_token_from_decode`, vLLM).
A remote prefill or a transfer that fails falls back to local prefill on the decode worker
(counted in dynamo_pd_prefill_fallbacks) or fails the request, as configured; a decode (or
aggregated) worker that fails it is kept out of routing for a while (the router's circuit breaker)
and the request retried elsewhere before its first token, migrated after (frontend/migration.py). The
placement is the one object the request's life is told to: the client's first token, each worker's
success or failure (its load and circuit breaker) and the end, so the router's load follows the request.
Workers register their KV block size; the first one sets the router's, and a worker with another
is refused (an ERROR line, dynamo_pd_workers_refused{reason="block_size"}).
A route whose prefix comes from a peer (the router's fetch-or-recompute plan, RouteDecision.source "peer")
sends its worker the peer's KV endpoint (EngineRequest.kv_prefix); a request migrated from a draining worker
is offered that worker's KV the same way (router.consider_peer), which it keeps serving while it drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from dynamo_pd import tracing
from dynamo_pd.frontend.kv_events import KvEventFollower
from dynamo_pd.frontend.membership import Membership
from dynamo_pd.frontend.replicas import EventPlaneReplicaSync
from dynamo_pd.frontend.resubscribe import follow_subject
from dynamo_pd.metrics import Metrics
from dynamo_pd.handoff import together_timeouts
from dynamo_pd.protocol import (EngineOutput, EngineRequest, LoadMetrics, OverloadedError, PeerPrefix, Usage,
                                WorkerInfo)
from dynamo_pd.frontend.migration import Journey, WorkerFailure, failure_reason
from dynamo_pd.runtime import Discovery, EventPlane, RequestCancelledError, RequestContext, RpcClient, RpcError
from dynamo_pd.runtime.tasks import cancel_and_wait
from router.service import KvRouter, LayoutMismatch, Placement, RouteDecision, RoutingError
from router.worker import Role

log = logging.getLogger("dynamo_pd.frontend")

_output_decoder = msgspec.msgpack.Decoder(EngineOutput)
_load_decoder = msgspec.msgpack.Decoder(LoadMetrics)
_encoder = msgspec.msgpack.Encoder()
_DEPARTED_KEPT = 256  # workers that left, remembered for the KV a draining one still serves


class KVLoadFailedError(RuntimeError):
    """The decode worker could not import the prompt's KV."""


@dataclass
class BackendConfig:
    local_prefill_tokens: int = 0  # decode prefills locally when the uncached prompt is at most this
    on_prefill_failure: Literal["local", "fail"] = "local"
    inter_token_timeout_s: float = 60.0  # a worker silent this long after its first output is wedged
    migration_limit: int = 3  # moves of one request to another worker after a failure (0: none)


class RemoteBackend:
    def __init__(self, model_name: str, tokenizer: Any, max_model_len: int, discovery: Discovery,
                 events: EventPlane, router: KvRouter, metrics: Metrics, config: BackendConfig | None = None,
                 namespace: str = "dynamo_pd"):
        self.model_name, self.tokenizer, self._max_model_len = model_name, tokenizer, max_model_len
        self.discovery, self.events, self.router, self.metrics = discovery, events, router, metrics
        self.config = config or BackendConfig()
        self._load_subject = f"{namespace}.load"
        self.workers: dict[str, WorkerInfo] = {}
        self.rpc = RpcClient(inter_response_timeout_s=self.config.inter_token_timeout_s)
        self.last_output: dict[str, float] = {}  # worker -> when it last streamed an output (health checks)
        self._refused: set[str] = set()  # registered workers this frontend cannot serve, refused once
        self._departed: OrderedDict[str, WorkerInfo] = OrderedDict()  # recently left: a drained one's KV
        self.replicas = EventPlaneReplicaSync(router.load, events, namespace)
        self.kv_events = KvEventFollower(router.ingestor, events)
        self.membership = Membership(discovery, self._joined, self._left)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.replicas.start()
        self.router.attach_replica_sync(self.replicas)
        self._tasks = [asyncio.create_task(self._watch_workers()), asyncio.create_task(self._follow_load())]

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        await self.replicas.stop()
        await self.kv_events.close()
        await self.rpc.close()

    @property
    def max_model_len(self) -> int:
        lengths = [w.max_model_len for w in self.workers.values() if w.max_model_len]
        return min(lengths, default=self._max_model_len)

    def ready(self) -> bool:
        return any(w.role is not Role.PREFILL for w in self.workers.values())

    def refresh_metrics(self) -> None:
        for worker_id in self.workers:
            self.metrics.indexed_blocks.labels(worker_id).set(self.router.indexed_blocks(worker_id))
        self.metrics.replica_updates.set(self.replicas.applied)
        self.metrics.replica_expired.set(self.replicas.expired)
        self.metrics.rpc_connections.set(self.rpc.num_connections)

    # ---- membership

    async def _watch_workers(self) -> None:
        await self.membership.run()  # for good: removals and changed registrations across outages too

    def _left(self, info: WorkerInfo) -> None:
        self._refused.discard(info.worker_id)
        self.last_output.pop(info.worker_id, None)
        if (left := self.workers.pop(info.worker_id, None)) is not None:
            self._departed[left.worker_id] = left
            while len(self._departed) > _DEPARTED_KEPT:
                self._departed.popitem(last=False)
            self.rpc.release(left.rpc_endpoint)
            self.kv_events.forget(info.worker_id)
            self.router.remove_worker(info.worker_id)
            self.metrics.forget_worker(info.worker_id)
            log.info("worker %s left", info.worker_id)

    async def _joined(self, info: WorkerInfo) -> None:
        if info.model != self.model_name:
            self._refuse(info, "model", f"it serves {info.model!r}, not {self.model_name!r}")
            return
        try:
            self.router.add_worker(info.worker_id, info.role, capacity_blocks=info.num_kv_blocks or 1 << 30,
                                   block_size=info.block_size, lends_prefixes=info.kv_peer_prefixes)
        except LayoutMismatch:  # its KV events and prompts would hash to other blocks than the pool's
            self._refuse(info, "block_size", f"its KV block size is {info.block_size}, the pool's is "
                                             f"{self.router.block_size}; start it with --block-size "
                                             f"{self.router.block_size}")
            return
        try:
            await self.kv_events.follow(info)
        except Exception:  # noqa: BLE001 - the worker still serves; routing just lacks its cache view
            log.exception("could not follow KV events of %s", info.worker_id)
        self.workers[info.worker_id] = info
        log.info("worker %s joined (%s, %s)", info.worker_id, info.role, info.engine)

    def _refuse(self, info: WorkerInfo, reason: str, why: str) -> None:
        self._refused.add(info.worker_id)
        self.metrics.workers_refused.labels(reason).inc()
        log.error("refusing worker %s (%s, %s): %s", info.worker_id, info.role.value, info.engine, why)

    async def _follow_load(self) -> None:
        await follow_subject(self.events, self._load_subject, self._on_load)

    def _on_load(self, _subject: str, payload: bytes) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            load = _load_decoder.decode(payload)
            if load.worker_id in self.workers:
                self.router.update_load_metrics(load)
                self.metrics.record_load(load.worker_id, load.num_running, load.num_free_blocks,
                                         load.num_total_blocks)

    # ---- requests

    async def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        """Stream the request from where the router places it; a worker that fails it hands it on
        (dynamo_pd.frontend.migration: a retry before the client's first token, a migration after).
        Traced (context.metadata holds the request's span): a span per attempt (the first, each retry or
        migration), the routing under it, and the workers' spans under that (the calls carry it)."""
        trace = tracing.extract(context.metadata)
        journey = Journey(request, self.config.migration_limit)
        span = tracing.start("attempt", trace, {"dynamo_pd.move": 0})
        try:
            placement, attempt = self._place(journey, span)
        except RoutingError as exc:
            tracing.end(span, exc)
            raise OverloadedError(str(exc)) from exc
        try:
            while True:
                context.worker_id = placement.decode.worker_id
                context.metadata = tracing.carrier(span)
                try:
                    async for out in self._attempt(placement, attempt, journey, context):
                        yield out
                    return
                except WorkerFailure as failure:
                    tracing.end(span, failure)
                    if journey.finished:  # the client has the whole answer; only the stream's end was lost
                        return
                    out_s = placement.failed(placement.decode.pool)  # the failure is the streaming worker's
                    placement.finished()
                    span = tracing.start("migration" if journey.sent else "retry", trace, {
                        "dynamo_pd.move": journey.moves + 1, "dynamo_pd.reason": failure.reason,
                        "dynamo_pd.failed_worker": failure.worker_id,
                        "dynamo_pd.tokens_sent": len(journey.sent)})
                    placement, attempt = self._move(journey, failure, out_s, span)
        finally:
            placement.finished(*journey.latencies())
            tracing.end(span)

    def _place(self, journey: Journey, span: Any = tracing.NOOP) -> tuple[Placement, EngineRequest]:
        """Place the next attempt, never on a worker that failed the request; a migration goes to a
        worker that resumes and prefills prompt + the client's tokens itself (its prefix cache helps).
        Traced, a route span under `span` holds the candidates each pool weighed and its choice."""
        request = journey.attempt()
        tokens, local, exclude = request.prompt_token_ids, self.config.local_prefill_tokens, set(journey.failed)
        if request.resume_token_ids:
            tokens = tokens + request.resume_token_ids
            local = len(tokens)
            exclude |= {w for w, info in self.workers.items() if not info.resumes}
        route = tracing.start("route", tracing.under(span))
        try:
            placement = self.router.place(request.request_id, tokens, request.cache_salt,
                                          local_prefill_tokens=local, exclude=exclude,
                                          explain=route.is_recording())
        except RoutingError as exc:
            tracing.end(route, exc)
            raise
        if route.is_recording():
            route.set_attributes(_route_attributes(placement, self.router.config.policy))
            tracing.end(route)
        return placement, request

    def _move(self, journey: Journey, failure: WorkerFailure, out_s: float,
              span: Any = tracing.NOOP) -> tuple[Placement, EngineRequest]:
        """Place the request anew (the failed worker is out of routing for `out_s`); raise the worker's
        error when the request cannot move."""
        rid, kind = journey.request.request_id, "migration" if journey.sent else "retry"
        why = journey.why_not(failure)
        if why is None:
            journey.moves += 1
            try:
                placed = self._place(journey, span)
            except RoutingError as exc:
                why = f"no other worker can take it ({exc})" if not journey.sent else \
                    f"no other worker whose engine resumes a request can take it ({exc})"
        if why is not None:
            log.warning("request %s: %s; it cannot move: %s", rid, failure, why)
            tracing.end(span, f"it cannot move: {why}")
            raise failure.cause
        (self.metrics.migrations if journey.sent else self.metrics.retries).labels(failure.reason).inc()
        log.warning("request %s: %s (kept out of routing %gs); %s %d to %s after %d tokens", rid, failure, out_s,
                    kind, journey.moves, placed[0].decode.worker_id, len(journey.sent))
        return placed

    async def _attempt(self, placement: Placement, request: EngineRequest, journey: Journey,
                       context: RequestContext) -> AsyncIterator[EngineOutput]:
        if request.resume_token_ids:
            self._migrated_kv(placement, request, journey)
        decode = placement.decode
        if placement.prefill_refused is not None:  # every prefill worker busy: prefill locally, or fail
            stream = self._fallback(placement, request, context, None, "prefill_failed", placement.prefill_refused)
        elif placement.prefill is None:
            stream = self._stream(placement, decode.pool, request, context)
        else:
            stream = self._disaggregated(placement, request, context)
        first = True
        async for out in stream:
            if out.finish_reason == "error":
                raise WorkerFailure(decode.worker_id, "engine_error", RuntimeError(out.error or "generation failed"))
            if first and out.token_ids:
                placement.first_token()
                first = False
            yield journey.sent_output(out)
        placement.succeeded(decode.pool)

    async def _stream(self, placement: Placement, role: Role, request: EngineRequest, context: RequestContext,
                      first_response_timeout_s: float | None = None) -> AsyncIterator[EngineOutput]:
        """One worker's stream; its failures are WorkerFailures (a client's error or cancellation passes)."""
        worker_id = placement.routes[role].worker_id
        worker = self.workers.get(worker_id)
        if worker is None:
            raise WorkerFailure(worker_id, "worker_left", OverloadedError("the worker left before the request "
                                                                          "reached it"))
        request = self._with_peer_prefix(placement.routes[role], request)
        try:
            batches = self.rpc.stream_batches(worker.rpc_endpoint, _encoder.encode(request), context,
                                              first_response_timeout_s=first_response_timeout_s)
            async for chunks in batches:
                if worker_id in self.workers:  # one that left keeps no entry
                    self.last_output[worker_id] = time.monotonic()
                out = None  # the outputs that arrived together, joined where they can: one step for the client
                for chunk in chunks:
                    got = _output_decoder.decode(chunk)
                    if got.transfer is not None:
                        self.metrics.transfer_bytes.inc(got.transfer.nbytes)
                        self.metrics.transfer_seconds.observe(got.transfer.seconds)
                    if out is None:
                        out = got
                    elif (joined := _joined(out, got)) is not None:
                        out = joined
                    else:
                        yield out
                        out = got
                yield out
        except RequestCancelledError:
            raise
        except RpcError as exc:
            raise WorkerFailure(worker_id, failure_reason(exc), exc) from exc

    def _with_peer_prefix(self, route: RouteDecision, request: EngineRequest) -> EngineRequest:
        """The request as the route's worker gets it: where it computes the prompt and the router planned a
        peer's prefix for it, with that peer's KV endpoint (a worker that left is found among the departed)."""
        if route.source != "peer" or request.handoff is not None:
            return request
        peer = self.workers.get(route.peer) or self._departed.get(route.peer)
        if peer is None or not peer.kv_endpoint:
            return request
        return msgspec.structs.replace(request, kv_prefix=PeerPrefix(worker_id=peer.worker_id,
                                                                     endpoint=peer.kv_endpoint,
                                                                     num_blocks=route.peer_blocks))

    def _migrated_kv(self, placement: Placement, request: EngineRequest, journey: Journey) -> None:
        """A migrated request: a draining worker still serves the KV it computed for it, offered to the new
        worker (router.consider_peer weighs it); counted by where its context's KV comes from."""
        route = placement.decode  # a migration resumes where it streams: that worker computes the context
        drained = None
        if journey.drained is not None:
            drained = self.workers.get(journey.drained) or self._departed.get(journey.drained)
        if drained is not None and drained.kv_peer_prefixes:
            tokens = request.prompt_token_ids + request.resume_token_ids
            held = (len(tokens) - 1) // drained.block_size  # the last token's KV was never computed there
            route = self.router.consider_peer(route, tokens, request.cache_salt, drained.worker_id, held)
            placement.routes[route.pool] = route
        kv = "moved" if route.source == "peer" else "local" if route.cached_tokens else "recomputed"
        self.metrics.migration_kv.labels(kv).inc()

    async def _disaggregated(self, placement: Placement, request: EngineRequest,
                             context: RequestContext) -> AsyncIterator[EngineOutput]:
        prefill = self.workers.get(placement.prefill.worker_id)
        prefill_context = RequestContext(request.request_id, context.metadata)
        prefill_stream = decode_stream = decode_started = None
        try:
            try:
                if prefill is None:
                    raise RuntimeError("the chosen prefill worker left before the request reached it")
                to_prefill = request
                if prefill.handoff_offer is not None:  # to both at once: decode gets ready while the prefill runs
                    wait_s, decode_first_s = together_timeouts(self.rpc.first_response_timeout_s)
                    offered = prefill.handoff_offer.for_request(request.request_id, len(request.prompt_token_ids),
                                                                wait_s)
                    to_prefill = msgspec.structs.replace(request, handoff=offered)
                    decode_stream = self._stream(placement, Role.DECODE, to_prefill, context, decode_first_s)
                    decode_started = asyncio.ensure_future(anext(decode_stream))
                prefill_stream = self._stream(placement, Role.PREFILL, to_prefill, prefill_context)
                firsts = [await anext(prefill_stream)]
                while not firsts[-1].ends:  # n > 1: each choice's first token, the hand-off with the last
                    firsts.append(await anext(prefill_stream))
                first = firsts[-1]
                firsts.sort(key=lambda out: out.index)
                if first.handoff is None and first.finish_reason not in ("stop", "length"):
                    raise RuntimeError(first.error or f"prefill ended with {first.finish_reason} and no KV hand-off")
            except (RpcError, RuntimeError, StopAsyncIteration) as exc:
                placement.failed(Role.PREFILL)
                if decode_stream is not None:  # the decode worker frees what it reserved
                    await cancel_and_wait([decode_started])
                    await decode_stream.aclose()
                    # it may not have ended the reserving request yet: prefill locally under a new id
                    request = msgspec.structs.replace(request, request_id=f"{request.request_id}-local")
                async for out in self._fallback(placement, request, context, None, "prefill_failed", exc):
                    yield out
                return
            placement.succeeded(Role.PREFILL)
            if first.handoff is None:  # the first tokens ended the request (stop, EOS, max_tokens): the answer
                for out in firsts:
                    yield out
                return
            resampled = first.handoff.first_token_from_decode  # then the decode side's first token is the one
            if not resampled:
                for out in _first_tokens(firsts):
                    yield out
            if decode_stream is None:
                decode_stream = self._stream(placement, Role.DECODE, _continued(request, firsts, first.handoff),
                                             context)
            try:
                async for out in self._decode_after_handoff(decode_stream, first, decode_started,
                                                            [] if resampled else firsts):
                    yield out
            except KVLoadFailedError as exc:
                sent = [] if resampled else firsts
                async for out in self._fallback(placement, request, context, sent, "transfer_failed", exc):
                    yield out
        finally:
            prefill_context.cancel()  # frees the prefill's held blocks if the decode side never read them
            if decode_started is not None:
                await cancel_and_wait([decode_started])
            for stream in (decode_stream, prefill_stream):
                if stream is not None:
                    await stream.aclose()

    async def _decode_after_handoff(self, decode_stream: AsyncIterator[EngineOutput], first: EngineOutput,
                                    decode_started: asyncio.Future | None,
                                    sent: list[EngineOutput]) -> AsyncIterator[EngineOutput]:
        """The decode stream (its first output already awaited in `decode_started`, push mode), minus what
        repeats the `sent` first tokens (none when the decode side samples the first token again), with the
        prefill's prompt usage."""

        async def outputs() -> AsyncIterator[EngineOutput]:
            if decode_started is not None:
                yield await decode_started
            async for item in decode_stream:
                yield item

        started = False

        async def checked() -> AsyncIterator[EngineOutput]:
            nonlocal started
            async for out in outputs():
                if out.finish_reason == "error" and not started:
                    raise KVLoadFailedError(out.error or "KV import failed")
                started = started or bool(out.token_ids)
                yield out

        async for out in _after_first_tokens(checked(), sent):
            if out.usage is not None and first.usage is not None:
                out = msgspec.structs.replace(out, usage=Usage(
                    prompt_tokens=first.usage.prompt_tokens, completion_tokens=out.usage.completion_tokens,
                    cached_tokens=first.usage.cached_tokens))
            yield out

    async def _fallback(self, placement: Placement, request: EngineRequest, context: RequestContext,
                        sent: list[EngineOutput] | None, reason: str,
                        exc: Exception) -> AsyncIterator[EngineOutput]:
        """Prefill on the decode worker instead; after the first tokens the client has (`sent`, one per choice),
        the decode engine prefills the prompt and continues from them (echoing them, as after a hand-off)."""
        if self.config.on_prefill_failure == "fail":
            raise RuntimeError(f"remote prefill failed ({reason}): {exc}") from exc
        log.warning("request %s: %s (%s); prefilling on the decode worker", request.request_id, reason, exc)
        self.metrics.fallbacks.labels(reason).inc()
        local = _continued(request, sent) if sent else request
        async for out in _after_first_tokens(self._stream(placement, Role.DECODE, local, context), sent or []):
            yield out


def _route_attributes(placement: Placement, policy: str) -> dict[str, Any]:
    """A route span's attributes: per pool, the worker chosen, its overlap and the candidates it was chosen
    among (their overlap, and the policy's score of each where it scores them: the lowest won)."""
    attributes: dict[str, Any] = {"dynamo_pd.route.policy": policy}
    for role, decision in placement.routes.items():
        key = f"dynamo_pd.route.{role.value}"
        candidates = decision.candidates
        attributes.update({f"{key}.worker": decision.worker_id,
                           f"{key}.overlap_blocks": decision.overlap_blocks,
                           f"{key}.cached_tokens": decision.cached_tokens,
                           f"{key}.candidates": [c.worker_id for c in candidates],
                           f"{key}.candidate_overlap_blocks": [c.overlap_blocks for c in candidates]})
        costs = [c.cost for c in candidates]
        if costs and None not in costs:
            attributes[f"{key}.candidate_costs"] = costs
            chosen = next(c for c in candidates if c.worker_id == decision.worker_id)
            attributes[f"{key}.predicted_cost"] = chosen.cost
        attributes["dynamo_pd.prompt_tokens"] = decision.prompt_tokens
    if placement.prefill_refused is not None:
        attributes["dynamo_pd.route.prefill_refused"] = str(placement.prefill_refused)
    return attributes


def _first_tokens(firsts: list[EngineOutput]) -> list[EngineOutput]:
    """The prefill's outputs (one per choice) as the client gets them before the decode side's: a choice its
    first token ended is over; the request is not."""
    going = sum(out.finish_reason == "prefill_done" for out in firsts)
    return [msgspec.structs.replace(out, usage=None, handoff=None, choices_left=going,
                                    finish_reason=None if out.finish_reason == "prefill_done" else out.finish_reason)
            for out in firsts]


def _continued(request: EngineRequest, firsts: list[EngineOutput], handoff: Any = None) -> EngineRequest:
    """The request for the decode side, which continues every choice from the first token the client has
    (the prompt's logprobs went with them)."""
    return msgspec.structs.replace(
        request, handoff=handoff, first_token_id=firsts[0].token_ids[0],
        fork_token_ids=[out.token_ids[0] for out in firsts[1:]],
        sampling=msgspec.structs.replace(request.sampling, prompt_logprobs=None))


async def _after_first_tokens(stream: AsyncIterator[EngineOutput],
                              sent: list[EngineOutput]) -> AsyncIterator[EngineOutput]:
    """A decode side's stream after the client has the `sent` first tokens: each choice's echo of its token
    dropped, and nothing of a choice its first token ended (the decode side ends it at that echo, alongside
    choices that go on: never the request's last output)."""
    echoing = {out.index for out in sent if out.finish_reason == "prefill_done"}
    ended = {out.index for out in sent} - echoing
    async for out in stream:
        if out.index in ended:
            continue
        if out.index in echoing and out.token_ids:
            echoing.discard(out.index)
            out = _drop_echo(out)
        if out.token_ids or out.text or out.finish_reason:
            yield out


def _joined(a: EngineOutput, b: EngineOutput) -> EngineOutput | None:
    """`a` then `b` as one output, where `a` is a plain step (no end, usage, hand-off or error) and `b`
    carries no hand-off, error, transfer figures or prompt logprobs, both of one choice, with logprobs or
    neither; else None."""
    if (a.index != b.index or a.finish_reason is not None or a.usage is not None or a.handoff is not None
            or a.error is not None or b.handoff is not None or b.error is not None or b.transfer is not None
            or b.prompt_logprobs is not None or (a.logprobs is None) != (b.logprobs is None)):
        return None
    return msgspec.structs.replace(b, token_ids=a.token_ids + b.token_ids, text=a.text + b.text,
                                   logprobs=None if a.logprobs is None else a.logprobs + b.logprobs,
                                   transfer=a.transfer, prompt_logprobs=a.prompt_logprobs)


def _drop_echo(out: EngineOutput) -> EngineOutput:
    """The decode engine's first output repeats the first token, which the client already has. Its text
    starts where the prefill side's stopped (both apply the same holdback rule), so only the id goes."""
    return msgspec.structs.replace(out, token_ids=out.token_ids[1:],
                                   logprobs=out.logprobs[1:] if out.logprobs else out.logprobs)
