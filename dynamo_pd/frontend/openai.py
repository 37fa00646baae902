"""OpenAI request bodies (pydantic, for validation and the served OpenAPI schema) and their
translation into engine requests; response chunks built from engine outputs."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from dynamo_pd.frontend.structured import ResponseFormat, StructuredOutputs
from dynamo_pd.frontend.tools.output import OutputReader, delta_calls, message_calls
from dynamo_pd.frontend.tools.request import ToolChoice, ToolSpec
from dynamo_pd.protocol import (
    MAX_LOGIT_BIAS, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, EngineOutput, Guided,
    InvalidRequestError, SamplingParams, StopConditions, TokenLogprob, Usage,
)


def _unicode(text: str) -> str:
    text.encode("utf-8")  # a lone surrogate (valid JSON) is text no tokenizer or msgpack takes: a 400
    return text


Text = Annotated[str, AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]  # the wire's u32; the engine checks its vocabulary
# The stop limits StopConditions.validate enforces (with its own message), published in the schema too.
Stop = Annotated[Text | list[Text] | None, Field(json_schema_extra={"anyOf": [
    {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS},
    {"type": "array", "maxItems": MAX_STOP_STRINGS,
     "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}},
    {"type": "null"}]})]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    # Every other key (name, tool_call_id, tool_calls, ...) goes to the model's chat template as it came, as
    # vLLM and transformers hand it: the template is what reads or ignores it.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart]

    @model_validator(mode="before")
    @classmethod
    def _calls_need_no_content(cls, data: Any) -> Any:
        # OpenAI's assistant message that only calls tools has content null (or none)
        if isinstance(data, dict) and data.get("content") is None and data.get("role") == "assistant" and \
                data.get("tool_calls"):
            return {**data, "content": ""}
        return data

    def for_template(self) -> dict[str, Any]:
        return {**(self.model_extra or {}), "role": self.role, "content": self.text()}

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # vLLM's continuous_usage_stats is not served: a 400 names it

    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted: no effect on the text (we send no obfuscation padding)


class _Common(BaseModel):
    # Undeclared fields are kept for dynamo_pd.frontend.fields, which refuses or counts each (never drops one).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, lt=1 << 31)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)  # a torch generator's int64
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = Field(default=None, json_schema_extra={"maxItems": MAX_STOP_TOKEN_IDS})
    n: int = Field(default=1, ge=1, le=MAX_N)
    # token id (a string, as OpenAI's JSON keys are) -> bias; the bounds are SamplingParams.validate's
    logit_bias: dict[str, float] | None = Field(default=None, json_schema_extra={
        "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's: not with stream, as vLLM
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    ignore_eos: bool = False
    user: str | None = None  # accepted, no effect on the output (fields.ALLOWED), as is:
    session_id: str | None = None  # vLLM's identity of related requests
    # structured output (structured.py reads them into one Guided)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    guided_decoding_backend: str | None = None

    def stop_conditions(self, default_max_tokens: int) -> StopConditions:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return StopConditions(
            max_tokens=self.requested_max_tokens() or default_max_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
        )

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    kind: ClassVar[str]

    def samples(self) -> int:
        """The choices the engine generates."""
        return self.n

    def shape(self, decode: Callable[..., str], prompt_ids: list[int],
              readers: list[OutputReader | None]) -> Shape:
        return Shape(self.kind, decode, readers, logprobs=self.logprob_count() is not None,
                     prompt_logprobs=self.prompt_logprobs is not None)

    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def sampling(self, logprobs: int | None, guided: Guided | None = None) -> SamplingParams:
        """The engine's sampling; InvalidRequestError naming a field whose value the others rule out."""
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs are not streamed (as vLLM): send them with stream false",
                                      "prompt_logprobs")
        return SamplingParams(
            n=self.samples(),
            logit_bias=_logit_bias(self.logit_bias),
            prompt_logprobs=self.engine_prompt_logprobs(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=logprobs,
            guided=guided,
        )


class ChatCompletionRequest(_Common):
    kind: ClassVar[str] = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # accepted, no effect on the output (fields.ALLOWED)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    # tool calling (dynamo_pd.frontend.tools)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False  # vLLM's: a last message of the answer's role (assistant) before each choice's content

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def shape(self, decode: Callable[..., str], prompt_ids: list[int],
              readers: list[OutputReader | None]) -> Shape:
        last = self.messages[-1]
        echo = last.text() if self.echo and last.role == "assistant" else None
        return Shape(self.kind, decode, readers, logprobs=self.logprobs, echo=echo,
                     prompt_logprobs=self.prompt_logprobs is not None)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    kind: ClassVar[str] = "completion"
    prompt: Annotated[Text, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)  # >= n: the n of highest cumulative logprob
    echo: bool = False  # the prompt before each choice's text (with logprobs, the prompt's logprobs too)
    suffix: Text | None = None  # fill in the middle, for a model with FIM tokens (else a 400 saying so)

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        """The prompt's tokens; with a suffix, the fill-in-the-middle prompt the model was trained on, prefix
        first (PSM, as llama.cpp's infill builds it): [FIM prefix] prompt [FIM suffix] suffix [FIM middle]."""
        if not self.suffix:
            return list(self.prompt) if isinstance(self.prompt, list) else tokenizer(self.prompt).input_ids
        marks = fim_tokens(tokenizer)
        if marks is None:
            raise InvalidRequestError("suffix: fill-in-the-middle needs a model trained with FIM tokens "
                                      f"({', '.join(family[0] for family in _FIM_FAMILIES)}, ...); this one has none",
                                      "suffix")
        prefix = list(self.prompt) if isinstance(self.prompt, list) else \
            tokenizer(self.prompt, add_special_tokens=False).input_ids
        added = tokenizer("").input_ids  # what the tokenizer puts before any text (a BOS), before it all
        pre, suf, mid = marks
        return [*added, pre, *prefix, suf, *tokenizer(self.suffix, add_special_tokens=False).input_ids, mid]

    def samples(self) -> int:
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise InvalidRequestError("best_of > n chooses among finished choices: it cannot be streamed",
                                      "best_of")
        return self.best_of or self.n

    def logprob_count(self) -> int | None:
        if self.logprobs is None and self.samples() > self.n:
            return 0  # best_of ranks the choices by their tokens' logprobs
        return self.logprobs

    def shape(self, decode: Callable[..., str], prompt_ids: list[int],
              readers: list[OutputReader | None]) -> Shape:
        echo = None if not self.echo else self.prompt if isinstance(self.prompt, str) else decode(prompt_ids)
        return Shape(self.kind, decode, readers, logprobs=self.logprobs is not None,
                     best=self.n if self.samples() > self.n else 0, echo=echo, echo_ids=prompt_ids,
                     prompt_logprobs=self.prompt_logprobs is not None)

    def engine_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs  # echo's logprobs are the prompt's
        return self.prompt_logprobs


# Fill-in-the-middle tokens (prefix, suffix, middle) of the model families that have them: StarCoder and SmolLM,
# Qwen2.5-Coder, DeepSeek-Coder, Code Llama.
_FIM_FAMILIES = [("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                 ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
                 ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), ("▁<PRE>", "▁<SUF>", "▁<MID>")]


@functools.cache
def fim_tokens(tokenizer: Any) -> tuple[int, int, int] | None:
    """The ids of the tokenizer's fill-in-the-middle tokens; None when it has none."""
    vocab = tokenizer.get_vocab()
    for family in _FIM_FAMILIES:
        if all(token in vocab for token in family):
            return vocab[family[0]], vocab[family[1]], vocab[family[2]]
    return None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    try:
        return {int(token): value for token, value in (bias or {}).items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids", "logit_bias") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass
class Shape:
    """How one request's engine outputs become its answer's choices, whole or streamed (one per request: a
    stream's echo state is kept here)."""

    kind: str  # "chat" or "completion"
    decode: Callable[..., str]  # token id(s) -> text
    readers: list[OutputReader | None]  # per choice: tool calls and reasoning read out of a chat's text
    logprobs: bool = False  # the client asked for logprobs (best_of asks the engine for them regardless)
    best: int = 0  # best_of > n: answer the `best` choices of highest cumulative logprob, in that order
    echo: str | None = None  # echo: the prompt's text (a chat's: its last message's) before each choice's
    echo_ids: list[int] = field(default_factory=list)  # the prompt's tokens: echo's logprobs are theirs
    prompt_logprobs: bool = False  # answer vLLM's prompt_logprobs
    scores: list[TokenLogprob | None] | None = None  # the prompt's logprobs, once an output brought them
    echoed: set[int] = field(default_factory=set)  # streamed choices whose echo went out

    def _scores(self, out: EngineOutput) -> list[TokenLogprob | None] | None:
        if out.prompt_logprobs is not None:
            self.scores = out.prompt_logprobs
        return self.scores

    def _reader(self, index: int) -> OutputReader | None:
        return self.readers[index] if index < len(self.readers) else None


def chat_logprobs(items: list[TokenLogprob], decode) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": decode(lp.token_id),
                "logprob": lp.logprob,
                "top_logprobs": [{"token": decode(t), "logprob": v} for t, v in lp.top],
            }
            for lp in items
        ]
    }


def completion_logprobs(items: list[TokenLogprob], decode, echo_ids: list[int] | None = None,
                        scores: list[TokenLogprob | None] | None = None) -> dict[str, Any]:
    """OpenAI's completion logprobs; with echo, the prompt's tokens first (`scores`: theirs, the first None)."""
    prompt = list(zip(echo_ids or [], scores or []))
    return {
        "tokens": [decode(t) for t, _ in prompt] + [decode(lp.token_id) for lp in items],
        "token_logprobs": [None if lp is None else lp.logprob for _, lp in prompt] + [lp.logprob for lp in items],
        "top_logprobs": [None if lp is None else {decode(t): v for t, v in lp.top} for _, lp in prompt]
        + [{decode(t): v for t, v in lp.top} for lp in items],
    }


def prompt_logprobs_body(scores: list[TokenLogprob | None], decode) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token (the first None), its own and its top alternatives' logprobs by
    token id."""
    return [None if lp is None else {str(t): {"logprob": v, "rank": None, "decoded_token": decode(t)}
                                     for t, v in [(lp.token_id, lp.logprob), *lp.top]} for lp in scores]


def finish_reason(out: EngineOutput) -> str | None:
    if out.finish_reason is None:
        return None
    return "length" if out.finish_reason == "length" else "stop"


def chunk_envelope(kind: str, rid: str, model: str, choice: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def whole_body(shape: Shape, rid: str, model: str, outputs: list[EngineOutput]) -> dict[str, Any]:
    """The non-streaming response: each choice's outputs' text and logprobs joined (with a reader, its text
    read into content, tool calls and reasoning), the usage of the output that ended the request."""
    by_index: dict[int, list[EngineOutput]] = {}
    for out in outputs:
        by_index.setdefault(out.index, []).append(out)
        shape._scores(out)
    order = sorted(by_index)
    if shape.best:
        order = sorted(order, key=lambda i: -sum(lp.logprob for o in by_index[i] for lp in o.logprobs or []))
        order = order[:shape.best]
    choices = [_whole_choice(shape, index, by_index[i], shape._reader(i)) for index, i in enumerate(order)]
    body = {**chunk_envelope(shape.kind, rid, model, {}), "choices": choices,
            "object": "chat.completion" if shape.kind == "chat" else "text_completion"}
    if shape.prompt_logprobs and shape.kind == "chat" and shape.scores is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(shape.scores, shape.decode)
    if outputs[-1].usage is not None:
        body["usage"] = usage_body(outputs[-1].usage)
    return body


def _whole_choice(shape: Shape, index: int, outputs: list[EngineOutput],
                  reader: OutputReader | None) -> dict[str, Any]:
    decode = shape.decode
    logprobs = [lp for o in outputs for lp in (o.logprobs or [])]
    wants_logprobs = shape.logprobs and outputs[0].logprobs is not None
    choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason(outputs[-1])}
    text = "".join(o.text for o in outputs)
    if shape.kind == "chat" and reader is not None:
        parsed = reader.whole(text, [t for o in outputs for t in o.token_ids])
        content = parsed.content if shape.echo is None else shape.echo + (parsed.content or "")
        choice["message"] = {"role": "assistant", "content": content}
        if parsed.reasoning is not None:
            choice["message"]["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            choice["message"]["tool_calls"] = message_calls(parsed.calls)
            choice["finish_reason"] = _called(choice["finish_reason"])
        choice["logprobs"] = chat_logprobs(logprobs, decode) if wants_logprobs else None
    elif shape.kind == "chat":
        choice["message"] = {"role": "assistant", "content": (shape.echo or "") + text}
        choice["logprobs"] = chat_logprobs(logprobs, decode) if wants_logprobs else None
    else:
        echo = shape.echo is not None
        choice["text"] = (shape.echo or "") + text
        choice["logprobs"] = completion_logprobs(logprobs, decode, shape.echo_ids if echo else None,
                                                 shape.scores if echo else None) if wants_logprobs else None
        if shape.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_body(shape.scores or [], decode)
    return choice


def _called(reason: str | None) -> str | None:
    """The finish reason of an answer that called tools (a call cut by max_tokens still says length)."""
    return "tool_calls" if reason == "stop" else reason


def stream_choice(shape: Shape, out: EngineOutput) -> dict[str, Any] | None:
    """One streamed chunk's choice, or None when the output carries nothing to send."""
    reader, decode, kind = shape._reader(out.index), shape.decode, shape.kind
    scores = shape._scores(out)
    echo = shape.echo is not None and out.index not in shape.echoed  # before the choice's first text
    if not (out.text or out.finish_reason or out.logprobs or echo or (reader is not None and out.token_ids)):
        return None  # (a reader sees token ids: a tool-call marker is a special token, and not in the text)
    choice: dict[str, Any] = {"index": out.index, "finish_reason": finish_reason(out)}
    if echo:
        shape.echoed.add(out.index)
    if kind == "chat" and reader is not None:
        read = reader.feed(out.text, out.token_ids, final=out.finish_reason is not None)
        parts = (("content", (shape.echo if echo else "") + read.content), ("reasoning_content", read.reasoning))
        choice["delta"] = {k: v for k, v in parts if v}
        if read.calls:
            choice["delta"]["tool_calls"] = delta_calls(read.calls)
        if reader.called:
            choice["finish_reason"] = _called(choice["finish_reason"])
        if out.logprobs is not None:
            choice["logprobs"] = chat_logprobs(out.logprobs, decode)
        if not (choice["delta"] or out.finish_reason or out.logprobs):
            return None  # held back: it may be the start of a call
    elif kind == "chat":
        content = (shape.echo if echo else "") + out.text
        choice["delta"] = {"content": content} if content else {}
        if out.logprobs is not None:
            choice["logprobs"] = chat_logprobs(out.logprobs, decode)
    else:
        choice["text"] = (shape.echo if echo else "") + out.text
        if out.logprobs is not None:
            choice["logprobs"] = completion_logprobs(out.logprobs, decode, shape.echo_ids if echo else None,
                                                     scores if echo else None)
    return choice


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
