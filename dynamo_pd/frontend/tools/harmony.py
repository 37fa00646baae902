"""gpt-oss harmony, read from token ids with `openai_harmony` (PyPI's `oss-harmony` or `openai-harmony`): a
message to `functions.NAME` is a call (its text the arguments), the `analysis` channel is reasoning, `final`
(and `commentary` to no one) content. An output that ends mid-message gives that message's text as content, as
vLLM's harmony parser recovers it."""

from __future__ import annotations

import functools
from collections.abc import Container, Sequence
from typing import Any

from dynamo_pd.frontend.tools.base import (INVALID, Parsed, PartialCall, Scan, ToolCall, ToolParser, dumps,
                                           loads)

_BUILTIN = ("browser", "python", "container")  # recipients that are the model's own tools, not the client's


@functools.cache
def encoding():
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


class HarmonyParser(ToolParser):
    name = "harmony"

    def __init__(self, tools: Sequence[dict[str, Any]] = (), vocab: Container[str] = frozenset()) -> None:
        from openai_harmony import Role, StreamableParser

        super().__init__(tools, vocab)
        self._parser = StreamableParser(encoding(), role=Role.ASSISTANT)
        self._fed = self._done = 0  # token ids processed, messages completed
        self._open: list[int] = []  # the current message's token ids (its text if the output ends inside it)
        self._recovered = ""

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        scan = self.scan(text, token_ids, final=True)
        calls = []
        for call in scan.calls:
            value = loads(call.arguments)
            calls.append(ToolCall(call.name or "", call.arguments if value is INVALID else dumps(value)))
        return Parsed(scan.content or None, calls, scan.reasoning or None)

    def scan(self, text: str, token_ids: Sequence[int], final: bool) -> Scan:
        from openai_harmony import HarmonyError

        for token in token_ids[self._fed:]:
            try:
                self._parser.process(token)
            except HarmonyError:
                continue
            done = len(self._parser.messages)
            self._open = [] if done > self._done else [*self._open, token]
            self._done = done
        self._fed = len(token_ids)
        messages = [_message(m) for m in self._parser.messages]
        parser = self._parser
        current = (parser.current_channel, parser.current_recipient, parser.current_content or "")
        if final and not self._recovered:
            try:
                self._parser.process_eos()
                messages = [_message(m) for m in self._parser.messages]
            except HarmonyError:
                self._recovered = encoding().decode(self._open)
            current = (None, None, "")
        elif final:
            current = (None, None, "")
        content, reasoning, calls = [], [], []
        for channel, recipient, body in [*messages, current]:
            recipient = _recipient(recipient)
            if recipient and _is_function(recipient):
                calls.append(PartialCall(recipient.removeprefix("functions."), body))
            elif channel == "analysis" and body:
                reasoning.append(body)
            elif (channel == "final" or (channel == "commentary" and recipient is None)) and body:
                content.append(body)
        if self._recovered:
            content.append(self._recovered)
        return Scan("\n".join(content), calls, "\n".join(reasoning))


def _message(message) -> tuple[str | None, str | None, str]:
    return message.channel, message.recipient, "".join(c.text for c in message.content)


def _recipient(recipient: str | None) -> str | None:
    # older harmony releases read "<|constrain|>json" into the recipient
    if recipient is None or "<|constrain|>" not in recipient:
        return recipient
    return recipient[:recipient.index("<|constrain|>")].rstrip() or None


def _is_function(recipient: str) -> bool:
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return not (recipient.startswith("<|") or recipient == "assistant" or recipient.split(".")[0] in _BUILTIN)
