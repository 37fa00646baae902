"""Structs every process shares. One struct per message, defined once here."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from dynamo_pd.handoff_kinds import Handoff, HandoffOffer, TransferStats
from dynamo_pd.runtime.errors import InvalidRequestError, PromptTooLongError
from router.worker import LoadMetrics, Role

# Defined below this module (router/; the request plane, which rebuilds these errors on the caller's
# side), shared by every process through here.
__all__ = ["InvalidRequestError", "LoadMetrics", "PromptTooLongError", "Role"]

FinishReason = Literal["stop", "length", "abort", "error", "prefill_done"]


GREEDY_BELOW = 1e-5  # temperatures below it sample greedily
# OpenAI's bounds: n (and best_of) at most 128 choices, logit_bias at most 300 tokens.
MAX_N, MAX_LOGIT_BIAS = 128, 300

GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]


class Guided(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must match (structured output), compiled by dynamo_pd.guided. `spec`: the JSON schema,
    regex, EBNF grammar or structural tag as text, a JSON list of strings for "choice", "" for "json_object".
    `param` names the request field it came from, so an error about it names that field. Frozen: it keys
    the caches of compiled grammars."""

    kind: GuidedKind
    spec: str = ""
    param: str = "response_format"


class SamplingParams(msgspec.Struct, kw_only=True):
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # number of top alternatives per sampled token; None disables
    guided: Guided | None = None  # constrained output; None: free text
    n: int = 1  # choices sampled from the one prompt (one prefill; Engine.forks); seeded choice i uses seed + i
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before sampling (Engine.logit_bias)
    prompt_logprobs: int | None = None  # top alternatives per prompt token, on the first output; None disables

    def validate(self) -> None:
        def check(ok: bool, param: str, what: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{param} {what}, got {getattr(self, param)!r}", param)

        check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k >= 0 or self.top_k == -1, "top_k", "must be >= 0 (0 or -1 disables)")
        check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]")
        check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
              "must be in [0, 20]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got "
                                      f"{len(self.logit_bias)}", "logit_bias")
        if not all(-100 <= b <= 100 for b in self.logit_bias.values()):  # NaN too
            raise InvalidRequestError("logit_bias values must be in [-100, 100]", "logit_bias")

    @property
    def greedy(self) -> bool:
        # vLLM's rule (_SAMPLING_EPS): a temperature this small is greedy; dividing logits by it overflows
        return self.temperature < GREEDY_BELOW


# Every step checks each stop string and stop token of every running request: one request's lists
# must not slow its whole batch.
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 64


class StopConditions(msgspec.Struct, kw_only=True):
    max_tokens: int = 16
    stop_token_ids: list[int] = []
    stop: list[str] = []  # stop strings; matched on detokenized text and not included in it
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings of at most "
                                      f"{MAX_STOP_STRING_CHARS} characters each", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
                                      "stop_token_ids")


class PeerPrefix(msgspec.Struct, kw_only=True, frozen=True):
    """A prefix of the request's tokens (prompt, then resumed ones) whose KV a peer worker holds: read from it
    before the rest is computed, because the router predicted that to be sooner than recomputing it (or a
    drained worker hands a migrated request its KV)."""

    worker_id: str
    endpoint: str  # the peer's KV transfer agent (its side channel)
    num_blocks: int  # leading full blocks it holds


class EngineRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stop: StopConditions = msgspec.field(default_factory=StopConditions)
    cache_salt: str | None = None  # isolates prefix caching (LoRA name, tenant)
    handoff: Handoff | None = None  # decode role: KV computed elsewhere; prefill: an offered hand-off
    first_token_id: int | None = None  # decode role, pull hand-off: the token the prefill sampled
    # tokens generated on a worker that failed (migration): computed with the prompt, then continued as
    # though sampled here (max_tokens, penalties, seeded draws, stop strings, the text already streamed)
    resume_token_ids: list[int] = []
    fork_token_ids: list[int] = []  # decode role, n > 1: the first tokens of choices 1..n-1 (as first_token_id)
    kv_prefix: PeerPrefix | None = None  # the worker that prefills reads this prefix from a peer first
    probe: bool = False  # a health canary: served, but not counted in the output lengths a worker reports

    def validate(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        self.sampling.validate()
        self.stop.validate()

    def check_fits(self, max_model_len: int, vocab_size: int | None = None) -> None:
        """validate(), then the model's own bounds: prompt + max_tokens within its context and, given the
        vocabulary's size, every token id in it."""
        self.validate()
        prompt = self.prompt_token_ids
        if vocab_size is not None:
            bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})",
                                          "prompt")
            if self.first_token_id is not None and not 0 <= self.first_token_id < vocab_size:
                raise InvalidRequestError(f"first_token_id {self.first_token_id} is outside the vocabulary",
                                          "first_token_id")
            if any(not 0 <= t < vocab_size for t in self.fork_token_ids):
                raise InvalidRequestError("a fork_token_ids entry is outside the vocabulary", "fork_token_ids")
            bad = next((t for t in self.sampling.logit_bias if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})",
                                          "logit_bias")
        total = len(prompt) + self.stop.max_tokens
        if total > max_model_len:
            raise PromptTooLongError(f"prompt ({len(prompt)} tokens) plus max_tokens ({self.stop.max_tokens}) is "
                                     f"{total} tokens, more than this model's context of {max_model_len} tokens",
                                     "prompt")


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob) of the most likely alternatives


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class EngineOutput(msgspec.Struct, kw_only=True):
    """One step's worth of one choice's output: new tokens and text, its finish_reason on its last one. The
    request ends with the output that finishes its last choice (`ends`), which carries the usage of all of
    them; with n == 1, the output with a finish_reason."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    usage: Usage | None = None
    handoff: Handoff | None = None  # prefill role: how the prompt's KV reaches the decode side
    error: str | None = None
    transfer: TransferStats | None = None  # decode role, first output: the KV moved for this request
    index: int = 0  # the choice (SamplingParams.n > 1)
    choices_left: int = 0  # choices still generating after this output (n > 1)
    # the request's first output, when SamplingParams.prompt_logprobs asks: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def ends(self) -> bool:
        """The request's last output: it finishes a choice and none is left."""
        return self.finish_reason is not None and not self.choices_left


class WorkerInfo(msgspec.Struct, kw_only=True):
    """What a worker registers in discovery (under a lease)."""

    worker_id: str
    role: Role
    engine: str
    model: str  # the name clients ask for
    rpc_endpoint: str  # request plane
    model_path: str = ""  # where the frontend loads the model's tokenizer and config (a directory, .gguf or name)
    kv_events_endpoint: str = ""  # ZMQ publisher of KV events ("" when events go over NATS)
    kv_events_replay_endpoint: str = ""  # where a router catches up on missed event batches
    kv_events_subject: str = ""  # NATS subject of KV events ("" when events go over ZMQ)
    kv_project_hashes: bool = False  # its KV events name blocks by router.hashing's hashes: indexed unhashed
    kv_layout: bytes | None = None  # encoded kv_transfer layout, for compatibility checks
    kv_endpoint: str = ""  # the worker's KV agent side channel ("" for engines without one)
    handoff_offer: HandoffOffer | None = None  # prefill: sent to prefill and decode at once; None: pull-like
    block_size: int = 16
    num_kv_blocks: int = 0
    max_num_seqs: int = 0
    max_model_len: int = 0
    resumes: bool = False  # its engine continues a migrated request (EngineRequest.resume_token_ids)
    kv_peer_prefixes: bool = False  # it lends its cached prefixes to peers and reads theirs (kv_prefix)
    metrics_endpoint: str = ""  # http://HOST:PORT serving its /metrics, /health and /ready ("": none)


class OverloadedError(RuntimeError):
    """Every eligible worker is over its busy threshold (HTTP 503 with Retry-After)."""
