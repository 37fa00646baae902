"""DeepSeek-V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`, the arguments kept as written. Content is
the text before the calls."""

from __future__ import annotations

import re
from collections.abc import Sequence

from dynamo_pd.frontend.tools.base import Parsed, PartialCall, Scan, ToolCall, ToolParser, held_back

CALLS, CALL, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
CALL_END, CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
FENCE, FENCE_END = "\n```json\n", "\n```"
# vLLM's pattern without DOTALL drops arguments that span lines (a documented difference: we keep them)
_CALL = re.compile(f"{re.escape(CALL)}(.*?){re.escape(SEP)}(.*?)\n```json\n(.*?)\n```{re.escape(CALL_END)}",
                   re.DOTALL)


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    markers = (CALLS, CALL, SEP, CALL_END, CALLS_END)

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        if CALLS not in text:
            return Parsed(text, [])
        calls = [ToolCall(name, arguments) for _, name, arguments in _CALL.findall(text)]
        return Parsed(text[:text.index(CALLS)] or None, calls)

    def scan(self, text: str, token_ids: Sequence[int], final: bool) -> Scan:
        first = text.find(CALLS)
        if first < 0:
            return Scan(text if final else text[:len(text) - held_back(text, CALLS)])
        calls = []
        for piece in text[first:].split(CALL)[1:]:
            if SEP not in piece or "\n" not in piece.split(SEP, 1)[1]:
                break  # the name runs to its newline
            name, rest = piece.split(SEP, 1)[1].split("\n", 1)
            rest = "\n" + rest
            if not rest.startswith(FENCE):
                calls.append(PartialCall(name.strip()))
                if FENCE.startswith(rest):
                    break
                continue
            arguments = rest[len(FENCE):]
            end = arguments.find(FENCE_END + CALL_END)
            if end >= 0:
                arguments = arguments[:end]
            elif not final:
                arguments = arguments[:len(arguments) - held_back(arguments, FENCE_END + CALL_END)]
            calls.append(PartialCall(name.strip(), arguments))
        return Scan(text[:first], calls)
