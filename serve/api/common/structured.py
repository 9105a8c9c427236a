"""Structured outputs and tools in a request, as one guide for the engine.

Every way a client asks for constrained output becomes one of TensorRT-LLM's guide
types (``tritonllm.contract.GUIDE_TYPES``), the ensemble's
``guided_decoding_guide_type``/``guided_decoding_guide``:

- OpenAI's ``response_format``: ``json_object`` (any JSON object), ``json_schema``;
- vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``, ``structural_tag``) and its older ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- ``tools`` with ``tool_choice``: XGrammar's structural tag for the model's call syntax
  (``serve.api.common.tool_parsers``), so a call's name is one of the tools and its arguments
  match the tool's parameters (``required`` and a named function force a call; ``auto``
  lets the model write text or a call, the call held to the schemas).

A guide is checked here, without a tokenizer (:func:`tritonllm.guided.grammar`), so a
schema XGrammar cannot compile or a regex that does not compile is a 400 naming the
field before any replica sees the request.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve.api.common.errors import APIError
from serve.api.common.tool_parsers import CallSyntax

# OpenAI's rule for function names.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
# A JSON object, as OpenAI's json_object promises (TensorRT-LLM's "json" allows any value).
_ANY_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class Guide:
    type: str  # one of tritonllm.contract.GUIDE_TYPES
    text: str
    param: str  # the request field it came from (errors name it)


# -- OpenAI's response_format ------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    # "schema" shadows a BaseModel attribute: the field is named apart, aliased.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # The schema is always enforced; strict also refuses keywords the grammar would not
    # enforce (tritonllm/schema_checks.py).
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")
]


# -- vLLM's structured_outputs ---------------------------------------------------------


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # vLLM's knobs with nothing to choose here: the engine compiles with XGrammar,
    # and JSON without free whitespace (docs/structured-outputs.md).
    backend: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self):
        if len(self.constraints()) != 1:
            raise ValueError(
                "set exactly one of json, regex, choice, grammar, json_object, structural_tag"
            )
        return self

    def constraints(self) -> dict[str, Any]:
        kinds = ("json_", "regex", "choice", "grammar", "json_object", "structural_tag")
        return {k.rstrip("_"): getattr(self, k) for k in kinds if getattr(self, k)}


# -- tools -------------------------------------------------------------------------------


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # as JSONSchemaFormat's


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tool_choice(calls: bool, named: str | None, tools: set[str]) -> None:
    """A tool choice that lets the model call (``calls``) needs tools, and the one it
    names (``named``) must be one of them; every dialect's rule, in its own shapes."""
    if not calls:
        return
    if not tools:
        raise ValueError("tool_choice is only allowed when tools are given")
    if named is not None and named not in tools:
        raise ValueError(f"names {named!r}, which is not one of the tools")


# -- guides ------------------------------------------------------------------------------


def guide_of(
    response_format: Any,
    structured_outputs: StructuredOutputs | None,
    legacy: dict[str, Any],
) -> Guide | None:
    """The one guide a request's structured-output fields ask for (None: free text);
    two of them at once is a 400."""
    guides = []
    if response_format is not None and response_format.type != "text":
        guides.append(_response_format_guide(response_format))
    if structured_outputs is not None:
        ((kind, value),) = structured_outputs.constraints().items()
        guides.append(_vllm_guide(kind, value, f"structured_outputs.{kind}"))
    for name, value in legacy.items():
        if value is not None:
            guides.append(_vllm_guide(name.removeprefix("guided_"), value, name))
    if len(guides) > 1:
        fields = ", ".join(g.param for g in guides)
        raise APIError(f"set one structured-output constraint, not several ({fields})", fields)
    return checked(guides[0]) if guides else None


def _response_format_guide(response_format) -> Guide:
    if response_format.type == "json_object":
        return Guide("json_schema", _ANY_OBJECT, "response_format")
    schema = response_format.json_schema.schema_
    param = "response_format.json_schema.schema"
    if response_format.json_schema.strict and schema is not None:
        check_strict(schema, param)
    text = _ANY_OBJECT if schema is None else json.dumps(schema)
    return Guide("json_schema", text, param)


def _vllm_guide(kind: str, value: Any, param: str) -> Guide:
    if kind == "json":
        return Guide("json_schema", value if isinstance(value, str) else json.dumps(value), param)
    if kind == "json_object":
        return Guide("json_schema", _ANY_OBJECT, param)
    if kind == "choice":
        return Guide("ebnf_grammar", choice_grammar(value), param)
    if kind == "grammar":
        return Guide("ebnf_grammar", value, param)
    return Guide(kind, value, param)  # regex, structural_tag


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON's string escapes
    are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tool_guide(
    tools: list[ChatTool], tool_choice, parallel_tool_calls: bool, syntax: CallSyntax
) -> Guide | None:
    """XGrammar's structural tag for calls in the model's own syntax (None: no calls)."""
    if not tools or tool_choice == "none":
        return None
    import xgrammar

    if not hasattr(xgrammar, "get_model_structural_tag"):  # older than the one we pin
        version = getattr(xgrammar, "__version__", "unknown")
        raise APIError(
            f"tool calling needs XGrammar 0.2 or newer in the serving environment (it has "
            f"{version}): install the version the Makefile pins",
            "tools",
        )
    for i, tool in enumerate(tools):  # each schema on its own: the 400 names the tool
        if tool.function.parameters is not None:
            param = f"tools.{i}.function.parameters"
            if tool.function.strict:
                check_strict(tool.function.parameters, param)
            checked(Guide("json_schema", json.dumps(tool.function.parameters), param))
    choice = tool_choice.model_dump() if isinstance(tool_choice, BaseModel) else tool_choice
    tag = xgrammar.get_model_structural_tag(
        syntax.xgrammar_format,
        tools=[tool.model_dump(exclude_none=True) for tool in tools],
        tool_choice=choice or "auto",
        reasoning=False,
        parallel_tool_calls=parallel_tool_calls,
        # One whitespace character at most between JSON tokens: free whitespace lets a
        # model loop on spaces and newlines until max_tokens.
        max_whitespace_cnt=1,
    )
    return checked(Guide("structural_tag", tag.model_dump_json(), "tools"))


def check_strict(schema: Any, param: str) -> None:
    """A schema sent with ``strict: true`` holds no keyword the grammar would not enforce
    (a 400 naming where they are); without strict they are served as what XGrammar makes
    of them, listed in docs/structured-outputs.md."""
    from tritonllm.schema_checks import unenforced_keywords

    found = unenforced_keywords(schema)
    if found:
        where = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise APIError(
            f"{param}: strict is true, but this server's grammar does not enforce {where}: "
            "remove them, or set strict to false to have the schema served without them",
            param,
        )


def checked(guide: Guide) -> Guide:
    """The guide, after XGrammar has compiled it (a 400 naming its field otherwise)."""
    error = _grammar_error(guide.type, guide.text)
    if error:
        raise APIError(f"{guide.param}: {error}", guide.param)
    return guide


@functools.lru_cache(maxsize=512)  # clients send the same schema again and again
def _grammar_error(guide_type: str, text: str) -> str | None:
    from tritonllm.guided import InvalidGuide, grammar

    try:
        grammar(guide_type, text)
    except InvalidGuide as error:
        return str(error)
    return None
