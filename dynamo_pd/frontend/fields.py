"""What the frontend does with every request field it is sent: nothing is dropped without a word.

- *served*: a declared field of the request model (`openai.py`), in the OpenAPI schema;
- *allowed*: no effect on the output (`user`, `metadata`, ...), declared too, accepted and not used;
- *refused*: a field of OpenAI's or vLLM's request schemas this server does not serve: a 400 naming it, unless it
  holds the value that asks for nothing (`min_p: 0`, `use_beam_search: false`, `bad_words: []`, ...),
  which clients send explicitly;
- anything else is accepted as vLLM accepts it, logged once per name and counted in
  `dynamo_pd_request_fields_unknown_total{field}`, so an operator sees what clients send that nothing reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dynamo_pd.protocol import InvalidRequestError

log = logging.getLogger("dynamo_pd.frontend")

NoOp = Callable[[Any], bool]  # True when the value asks for nothing


def _absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _is(*noops: Any) -> NoOp:
    return lambda value: value is None or any(value == n and type(value) is type(n) for n in noops)


def _text_only(value: Any) -> bool:
    return value is None or value == ["text"]


# vLLM's extra sampling and serving fields (its protocol's ChatCompletionRequest / CompletionRequest), with the
# value each takes when it asks for nothing. The ones it shares with what we serve (top_k, repetition_penalty,
# stop_token_ids, ignore_eos) are declared fields instead.
_VLLM_COMMON: dict[str, NoOp] = {
    "use_beam_search": _is(False), "length_penalty": _is(1.0, 1), "min_p": _is(0.0, 0), "min_tokens": _is(0),
    "include_stop_str_in_output": _is(False), "skip_special_tokens": _is(True),
    "spaces_between_special_tokens": _is(True), "truncate_prompt_tokens": _absent,
    "allowed_token_ids": _empty, "bad_words": _empty, "guided_whitespace_pattern": _absent, "priority": _is(0),
    "request_id": _absent, "logits_processors": _empty,
    "return_tokens_as_token_ids": _is(False), "return_token_ids": _is(False), "cache_salt": _absent,
    "kv_transfer_params": _absent, "vllm_xargs": _empty, "mm_processor_kwargs": _empty, "prompt_embeds": _absent,
    "repetition_detection": _absent, "truncation_side": _absent,
    "routed_experts_prompt_start": _is(0), "stream_interval": _absent, "return_token_offsets": _is(False),
    "watermarking": _absent, "return_mm_kwargs": _absent, "ec_transfer_params": _absent, "media_io_kwargs": _empty,
    "logprob_token_ids": _empty, "mm_payload": _is("tensors"), "thinking_token_budget": _absent,
}

# Refused fields per route: OpenAI's own first, then vLLM's.
REFUSED: dict[str, dict[str, NoOp]] = {
    "chat": {
        # the deprecated forms of tools and tool_choice stay refused: a 400 that names them points to those
        "functions": _empty, "function_call": _is("none"),
        "audio": _absent, "modalities": _text_only, "prediction": _absent, "reasoning_effort": _absent,
        "verbosity": _absent, "web_search_options": _absent, "moderation": _absent,
        **_VLLM_COMMON,
        "add_generation_prompt": _is(True), "continue_final_message": _is(False),
        "add_special_tokens": _is(False), "documents": _empty, "chat_template": _absent,
        "chat_template_kwargs": _empty, "reasoning_parser": _absent,
        "return_prompt_text": _absent, "include_reasoning": _is(True),
    },
    "completion": {
        **_VLLM_COMMON,
        "add_special_tokens": _is(True),
    },
}

# Declared in the request models (so in the schema), accepted, and read by nothing: none changes the output.
ALLOWED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
           "prompt_cache_options", "prompt_cache_retention", "session_id")

_MAX_LABELS = 64  # distinct unknown names counted by name; beyond, as "(other)": a client cannot grow the metric


class FieldPolicy:
    """Applies the table above to one request's undeclared fields; remembers the unknown names it logged."""

    def __init__(self, unknown_counter) -> None:
        self._counter = unknown_counter  # a prometheus Counter labelled by route and field
        self._seen: set[str] = set()

    def check(self, route: str, extra: dict[str, Any] | None) -> None:
        """Raise InvalidRequestError naming the first refused field that asks for something; count the rest."""
        refused = REFUSED[route]
        for name, value in (extra or {}).items():
            noop = refused.get(name)
            if noop is not None:
                if not noop(value):
                    raise InvalidRequestError(f"Unsupported parameter: '{name}' is not served by this server "
                                              f"(send it without a value, or with {_noop_hint(name)})", name)
                continue
            self._unknown(route, name)

    def _unknown(self, route: str, name: str) -> None:
        if name not in self._seen:
            if len(self._seen) >= _MAX_LABELS:
                name = "(other)"
            else:
                log.warning("request field %r (%s) is not a field this server knows: accepted and ignored, as "
                            "vLLM does; counted in dynamo_pd_request_fields_unknown_total", name, route)
                self._seen.add(name)
        self._counter.labels(route, name).inc()


def _noop_hint(name: str) -> str:
    hints = {"tool_choice": '"none"', "function_call": '"none"', "modalities": '["text"]'}
    return hints.get(name, "its default")
