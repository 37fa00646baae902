"""OpenAI request bodies (pydantic, for validation and the served OpenAPI schema) and their
translation into engine requests; response chunks built from engine outputs."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from dynamo_pd.frontend.tools.output import OutputReader, delta_calls, message_calls
from dynamo_pd.frontend.tools.request import ToolChoice, ToolSpec
from dynamo_pd.frontend.structured import ResponseFormat, StructuredOutputs
from dynamo_pd.protocol import (
    EngineOutput, Guided, InvalidRequestError, SamplingParams, StopConditions, TokenLogprob, Usage,
)


def _unicode(text: str) -> str:
    text.encode("utf-8")  # a lone surrogate (valid JSON) is text no tokenizer or msgpack takes: a 400
    return text


Text = Annotated[str, AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]  # the wire's u32; the engine checks its vocabulary


class ChatMessage(BaseModel):
    # Every other key (name, tool_call_id, tool_calls, ...) goes to the model's chat template as it came, as
    # vLLM and transformers hand it: the template is what reads or ignores it.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]]

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
        parts = [p.get("text") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content) or not all(isinstance(p, str) for p in parts):
            raise InvalidRequestError("only text content parts ({'type': 'text', 'text': str}) are supported",
                                      "messages")
        try:
            return _unicode("".join(parts))
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(f"content is not valid Unicode: {exc.reason}", "messages") from None


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
    stop: Text | list[Text] | None = None  # bounds: StopConditions.validate
    stop_token_ids: list[TokenId] | None = None
    n: int = Field(default=1, ge=1, le=1)
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

    def sampling(self, logprobs: int | None, guided: Guided | None = None) -> SamplingParams:
        return SamplingParams(
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

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: Text | list[TokenId]
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def logprob_count(self) -> int | None:
        return self.logprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


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


def completion_logprobs(items: list[TokenLogprob], decode) -> dict[str, Any]:
    return {
        "tokens": [decode(lp.token_id) for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{decode(t): v for t, v in lp.top} for lp in items],
    }


def finish_reason(out: EngineOutput) -> str | None:
    if out.finish_reason is None:
        return None
    return "length" if out.finish_reason == "length" else "stop"


def chunk_envelope(kind: str, rid: str, model: str, choice: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def whole_body(kind: str, rid: str, model: str, decode, outputs: list[EngineOutput],
               reader: OutputReader | None = None) -> dict[str, Any]:
    """The non-streaming response: every output's text and logprobs joined, the last one's usage; with a
    reader, the text read into content, tool calls and reasoning."""
    last = outputs[-1]
    logprobs = [lp for o in outputs for lp in (o.logprobs or [])]
    wants_logprobs = outputs[0].logprobs is not None
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(last)}
    text = "".join(o.text for o in outputs)
    if kind == "chat" and reader is not None:
        parsed = reader.whole(text, [t for o in outputs for t in o.token_ids])
        choice["message"] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            choice["message"]["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            choice["message"]["tool_calls"] = message_calls(parsed.calls)
            choice["finish_reason"] = _called(choice["finish_reason"])
        choice["logprobs"] = chat_logprobs(logprobs, decode) if wants_logprobs else None
    elif kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = chat_logprobs(logprobs, decode) if wants_logprobs else None
    else:
        choice["text"] = text
        choice["logprobs"] = completion_logprobs(logprobs, decode) if wants_logprobs else None
    body = chunk_envelope(kind, rid, model, choice)
    body["object"] = "chat.completion" if kind == "chat" else "text_completion"
    if last.usage is not None:
        body["usage"] = usage_body(last.usage)
    return body


def _called(reason: str | None) -> str | None:
    """The finish reason of an answer that called tools (a call cut by max_tokens still says length)."""
    return "tool_calls" if reason == "stop" else reason


def stream_choice(kind: str, out: EngineOutput, decode,
                  reader: OutputReader | None = None) -> dict[str, Any] | None:
    """One streamed chunk's choice, or None when the output carries nothing to send."""
    if not (out.text or out.finish_reason or out.logprobs or (reader is not None and out.token_ids)):
        return None  # (a reader sees token ids: a tool-call marker is a special token, and not in the text)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(out)}
    if kind == "chat" and reader is not None:
        read = reader.feed(out.text, out.token_ids, final=out.finish_reason is not None)
        parts = (("content", read.content), ("reasoning_content", read.reasoning))
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
        choice["delta"] = {"content": out.text} if out.text else {}
        if out.logprobs is not None:
            choice["logprobs"] = chat_logprobs(out.logprobs, decode)
    else:
        choice["text"] = out.text
        if out.logprobs is not None:
            choice["logprobs"] = completion_logprobs(out.logprobs, decode)
    return choice


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
