"""The tool-call fixtures (tests/frontend/tool_fixtures/<family>.json) and how both parsers, ours and vLLM's,
are driven over them: the whole output at once, and token by token as a stream is (each piece the text its
tokens add, with those token ids), each tokenized by a real tokenizer: SmolLM2's with the family's marker
tokens added as special tokens, or harmony's own encoding for gpt-oss."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from dynamo_pd.frontend.tools import TOOL_PARSERS
from dynamo_pd.frontend.tools.harmony import encoding

FIXTURES = Path(__file__).parent / "tool_fixtures"
FAMILIES = sorted(p.stem for p in FIXTURES.glob("*.json"))
PARSER = {"mistral_pre_v11": "mistral"}  # the parser a fixture file is for, where its name is not one
VLLM_PARSER = {"harmony": "openai", "mistral_pre_v11": "mistral"}


def load(family: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{family}.json").read_text())


def markers(family: str) -> tuple[str, ...]:
    if family == "mistral_pre_v11":
        return ("[TOOL_CALLS]",)  # no [ARGS]: the vocabulary of a tokenizer before v11
    if family in ("hermes", "qwen3_coder"):
        return ("<tool_call>", "</tool_call>")  # added tokens in Qwen's and Hermes' vocabularies
    return TOOL_PARSERS[PARSER.get(family, family)].markers


class Codec:
    """encode / decode of the family's tokenizer, and its vocabulary."""

    def __init__(self, family: str, model_dir: Path):
        if family == "harmony":
            enc = encoding()
            self.encode: Callable[[str], list[int]] = lambda text: enc.encode(text, allowed_special="all")
            self.decode: Callable[[list[int]], str] = enc.decode
            self.vocab: set[str] = set()
        else:
            tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers(family)])
            self.tokenizer = tok
            self.encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self.decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
            self.vocab = set(tok.get_vocab())
            self.vocab_id: Callable[[str], int | None] = tok.token_to_id

    def pieces(self, text: str) -> list[tuple[str, list[int]]]:
        """`text` as a stream delivers it: a piece per token (one ending mid-character waits for the next)."""
        ids = self.encode(text)
        assert self.decode(ids) == text, "the fixture does not round-trip through its tokenizer"
        out, sent, start = [], "", 0
        for i in range(len(ids)):
            full = self.decode(ids[:i + 1])
            if full.endswith("\ufffd") and i + 1 < len(ids):
                continue
            out.append((full[len(sent):], ids[start:i + 1]))
            sent, start = full, i + 1
        return out


def arguments(text: str) -> Any:
    """Arguments compared as the JSON they are (vLLM and we may space them differently), else as text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def answer(content: str | None, calls: list[tuple[str | None, str]], reasoning: str | None = None) -> dict:
    out = {"content": content or None,
           "tool_calls": [{"name": n, "arguments": arguments(a)} for n, a in calls]}
    if reasoning:
        out["reasoning"] = reasoning
    return out


def joined(deltas: list[tuple[str, str, list[tuple[int, str | None, str | None, str]]]]) -> dict:
    """Streamed deltas (content, reasoning, [(index, id, name, arguments)]) joined as a client joins them;
    asserts each call's first delta, and only it, carries its id and name."""
    content, reasoning, calls = "", "", {}
    for c, r, pieces in deltas:
        content, reasoning = content + c, reasoning + r
        for index, id_, name, args in pieces:
            if index not in calls:
                assert id_ and name is not None, f"call {index}'s first delta has no id or name"
                calls[index] = [name, ""]
            else:
                assert id_ is None and name is None, f"call {index} got a second id or name"
            calls[index][1] += args
    assert sorted(calls) == list(range(len(calls))), f"call indexes {sorted(calls)}"
    return answer(content, [tuple(calls[i]) for i in range(len(calls))], reasoning)


def expected(case: dict, mode: str) -> dict:
    return case["expected"].get(mode, case["expected"]["whole"])
