"""The request fields of tool calling, as OpenAI's chat schema has them, and their checks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dynamo_pd.protocol import InvalidRequestError


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: required and named choices follow the schema either way


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def checked(tools: list[ToolSpec] | None, choice: ToolChoice | None) -> tuple[list[dict[str, Any]], Any]:
    """The tools as the template takes them, the choice as "none" / "auto" / "required" / {"function": ...};
    a choice that names no given tool is a 400 naming tool_choice."""
    given = [t.model_dump(exclude_none=True) for t in tools or []]
    if choice is None:
        return given, "auto" if given else "none"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t["function"]["name"] for t in given}:
            raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, which is not in "
                                      "tools", "tool_choice")
        return given, choice.model_dump()
    if choice == "required" and not given:
        raise InvalidRequestError("tool_choice 'required' needs tools", "tool_choice")
    return given, choice
