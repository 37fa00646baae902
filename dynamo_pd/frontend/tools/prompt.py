"""Tools into the prompt. A chat template that reads `tools` gets them as transformers and vLLM pass them
(`tools=[{"type": "function", "function": {...}}]`, assistant `tool_calls` with their arguments as objects). A
template without a tools section (SmolLM2's) gets the fallback: the Hermes / Qwen 2.5 tool prompt in the
system message, past assistant calls written back as `<tool_call>` blocks and tool results as user messages in
`<tool_response>` tags, all rendered by the model's own template; `chatml_tools.jinja` beside this file is the
same prompt as a ChatML template, for a server that renders templates itself (vLLM's `--chat-template`)."""

from __future__ import annotations

import json
from typing import Any

from jinja2 import Environment, meta

FALLBACK_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\n"
                   "<tools>")
FALLBACK_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and "
                   "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                   "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def reads_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools`."""
    return template is not None and "tools" in meta.find_undeclared_variables(Environment().parse(template))


def for_template(template: str | None, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages and tools to render with `template`: the tools for a template that reads them, the
    fallback for one that does not."""
    if not tools:
        return template_messages(messages), []
    if reads_tools(template):
        return template_messages(messages), tools
    return fallback_messages(messages, tools), []


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant calls' arguments as objects, as HF templates expect them (vLLM hands them so too)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(message)
    return out


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the tools described in its system message and calls and results as text."""
    listing = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    system = FALLBACK_HEADER + listing + FALLBACK_FOOTER
    out: list[dict[str, Any]] = []
    if messages and messages[0]["role"] == "system":
        out.append({**messages[0], "content": f"{messages[0]['content']}\n\n{system}"})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": system})
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            blocks = [f"<tool_call>\n{json.dumps(_call(c), ensure_ascii=False)}\n</tool_call>"
                      for c in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif message["role"] == "tool":
            result = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_responses"):  # consecutive results share one user message
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result, "tool_responses": True})
        else:
            out.append({**message, "content": message.get("content") or ""})
    return [{k: v for k, v in m.items() if k != "tool_responses"} for m in out]


def _call(call: dict[str, Any]) -> dict[str, Any]:
    function = _with_object_arguments(call)["function"]
    return {"name": function.get("name"), "arguments": function.get("arguments")}


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function = {**function, "arguments": json.loads(arguments)}
        except ValueError:
            pass  # not JSON: the template gets it as the client sent it
    return {**call, "function": function}
