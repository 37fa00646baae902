"""`--reasoning-parser think`: the text between `<think>` and `</think>` is `reasoning_content`, the rest
content. An output starts in reasoning when it opens with `<think>` or when the prompt ends inside an open
`<think>` (the templates of Qwen3 and DeepSeek-R1 write the opening tag themselves)."""

from __future__ import annotations

from dynamo_pd.frontend.tools.base import held_back

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class ThinkSplitter:
    """Splits the output as it streams: `feed` returns (reasoning, content) deltas."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self._text = ""
        self._started = in_reasoning
        self._reasoning = self._content = 0  # characters of each returned

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._text += text
        reasoning, content = self.split(final)
        out = reasoning[self._reasoning:], content[self._content:]
        self._reasoning, self._content = len(reasoning), len(content)
        return out

    def split(self, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) settled so far."""
        text = self._text
        if not self._started:
            stripped = text.lstrip()
            if not stripped.startswith(OPEN):
                if not final and OPEN.startswith(stripped):
                    return "", ""  # it may still open with the tag
                return "", text
            text = stripped[len(OPEN):]
        end = text.find(CLOSE)
        if end < 0:
            return (text if final else text[:len(text) - held_back(text, CLOSE)]), ""
        return text[:end], text[end + len(CLOSE):]
