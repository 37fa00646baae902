"""A request's journey across the workers that serve it, when one fails.

A worker fails a request when its stream breaks: the process died or the connection dropped
(`worker_gone`), it sent nothing for --inter-token-timeout-s (`stalled`) or before its first output
(`timeout`), it is shutting down (`draining`), its handler or engine failed (`worker_error`,
`engine_error`), or it left discovery before the request reached it (`worker_left`). A client error
(InvalidRequestError) is never one of these: it ends the request as it is.

  - before the client has a token: the request is *retried* on a new placement, without that worker;
  - after: it *migrates*: a new placement on a decode (or aggregated) worker of an engine that resumes
    (WorkerInfo.resumes) prefills prompt + the tokens the client has (the prefix cache serves what it
    holds) and continues as though it had sampled them (EngineRequest.resume_token_ids), so the client's
    stream goes on where it stopped, greedy text and seeded draws as an unfailed run's.
    Its context's KV need not be recomputed: the router plans it like any prompt's (the new worker's pool
    and tiers, or a peer's pool it reads from), and a worker that failed it by draining still serves the KV
    it computed, which the new worker is offered (`drained`, RemoteBackend._migrated_kv).
Both count against --migration-limit moves per request. A request cannot move when the limit is
spent, no other worker can take it (or, after the first token, none whose engine resumes), its
max_tokens are all generated, or it has n > 1 choices and the client has tokens of them (they are retried,
never migrated: a resumed request continues one sequence): it ends with the worker's error, of its kind
(worker_stalled, ...), and the frontend's log names why it could not move.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from dynamo_pd.protocol import EngineOutput, EngineRequest, Usage
from dynamo_pd.runtime.errors import (
    FirstResponseTimeoutError,
    RemoteError,
    RpcError,
    StreamStalledError,
    WorkerDrainingError,
)


class WorkerFailure(RpcError):
    """A worker broke a request (not the client's fault): which one, why, and the error it gave."""

    def __init__(self, worker_id: str, reason: str, cause: Exception):
        super().__init__(f"worker {worker_id} failed the request ({reason}): {cause}")
        self.worker_id, self.reason, self.cause = worker_id, reason, cause


def failure_reason(exc: RpcError) -> str:
    if isinstance(exc, WorkerDrainingError):
        return "draining"
    if isinstance(exc, StreamStalledError):
        return "stalled"
    if isinstance(exc, FirstResponseTimeoutError):
        return "timeout"
    if isinstance(exc, RemoteError):
        return "worker_error"
    return "worker_gone"


@dataclass
class Journey:
    """One client request: what the client has, which workers failed it, how often it moved."""

    request: EngineRequest
    limit: int  # moves allowed (retries and migrations)
    sent: list[int] = field(default_factory=list)  # token ids the client has
    failed: set[str] = field(default_factory=set)
    moves: int = 0
    finished: bool = False  # the client has the final output: a failure after it loses nothing
    drained: str | None = None  # the worker that failed it last, when it failed it by draining
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None  # when the client's first token left, and its last
    last_token_at: float | None = None

    def attempt(self) -> EngineRequest:
        """The request as the next worker gets it: its own id after a move (workers that saw the first
        may still hold it), and the tokens the client has."""
        if not self.moves:
            return self.request
        sampling = self.request.sampling
        if self.sent:  # the client has the prompt's logprobs: they came with the first output
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
        return msgspec.structs.replace(self.request, request_id=f"{self.request.request_id}-{self.moves}",
                                       resume_token_ids=list(self.sent), sampling=sampling)

    def sent_output(self, out: EngineOutput) -> EngineOutput:
        """Record an output on its way to the client; after a migration its usage is the whole request's."""
        if out.token_ids:
            self.last_token_at = time.monotonic()
            self.first_token_at = self.first_token_at or self.last_token_at
        self.sent += out.token_ids
        self.finished = out.ends
        if self.moves and out.usage is not None:
            prompt = len(self.request.prompt_token_ids)
            out = msgspec.structs.replace(out, usage=Usage(
                prompt_tokens=prompt, completion_tokens=len(self.sent),
                cached_tokens=min(out.usage.cached_tokens, prompt)))
        return out

    def latencies(self) -> tuple[float, float]:
        """(TTFT, mean ITL) of the outputs sent to the client, timed from the tokenized request's start here
        (its HTTP parsing and tokenizing come before), once it has the whole answer; 0 where it has not or
        (ITL) one token a choice. The n choices of a request stream side by side: a choice's gaps are its tokens'."""
        if not self.finished or self.first_token_at is None:
            return 0.0, 0.0
        gaps = len(self.sent) / self.request.sampling.n - 1
        return (self.first_token_at - self.started,
                (self.last_token_at - self.first_token_at) / gaps if gaps > 0 else 0.0)

    def why_not(self, failure: WorkerFailure) -> str | None:
        """Why the request cannot move after `failure`; None: it can (the router may still find no worker)."""
        self.failed.add(failure.worker_id)
        self.drained = failure.worker_id if failure.reason == "draining" else None
        if self.moves >= self.limit:
            return f"it may move {self.limit} times (--migration-limit) and moved {self.moves}"
        if self.sent and self.request.sampling.n > 1:
            return f"its {self.request.sampling.n} choices (n) do not migrate once the client has their tokens"
        if len(self.sent) >= self.request.stop.max_tokens:
            return f"all {len(self.sent)} of its max_tokens were generated"
        return None
