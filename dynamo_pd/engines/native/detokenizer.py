"""Incremental detokenization with stop strings.

Each new token decodes a small window (a few tokens of context before the unread ones), so
text grows in O(1) per token, and a token that ends mid-character waits for the next one.
Text that could still turn out to be the start of a stop string is held back from the stream
until it is ruled out, so a stop string never leaks into the output.
"""

from __future__ import annotations

from collections.abc import Sequence

_CONTEXT_TOKENS = 6  # prompt tokens decoded ahead of the first output, for correct leading spaces


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str]):
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = list(stop)
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str | None:
        """Append a token; return the stop string it completed (the text is cut before it), or None."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing printable yet (a special token, or half a UTF-8 character)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        found = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[:index]
        return stop

    def delta(self, finished: bool) -> str:
        """Text not yet streamed; while running, keep back what might begin a stop string."""
        end = len(self.text) if finished else max(self._sent, len(self.text) - self._holdback)
        out = self.text[self._sent:end]
        self._sent = end
        return out
