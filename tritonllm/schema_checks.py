"""What a JSON guide holds that no grammar should be built from, found without recursion.

- **Depth.** The JSON Schema checks and XGrammar's conversion recurse per level: a schema
  a few hundred levels deep exhausts Python's stack (an internal error, not a refusal).
  :func:`json_depth` measures the nesting of the guide's text before anything parses it
  recursively.
- **External references.** A ``$ref`` outside the schema (``http://``, ``file://``, a
  relative file) is never fetched: the grammar would hold whatever XGrammar makes of an
  unresolved reference, not the schema the client meant.
- **Keywords the grammar does not enforce.** XGrammar 0.2 compiles these into nothing: an
  answer that violates them is still accepted (each one checked against the version the
  Makefile pins). A client that asks for ``strict`` is told which ones, not misled.

Written by hand: these are rules about this grammar compiler, which no JSON Schema
library knows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# Nesting of arrays and objects a JSON guide may hold: about 30 levels of subschemas (an
# object's schema is two levels: itself and its "properties"). OpenAI's structured outputs
# take 10 levels of a strict schema's nesting.
MAX_DEPTH = 64

# Keywords XGrammar compiles into nothing: an answer violating them is accepted.
# ``allOf`` with a single subschema is enforced (it is that subschema).
UNENFORCED = (
    "allOf",
    "not",
    "if",
    "then",
    "else",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
)

# Keywords whose values are data, not subschemas (an "enum" member may be any object).
_DATA = frozenset({"enum", "const", "default", "examples", "required"})
# Keywords whose values map names to subschemas (the names are not keywords).
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})

_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (strings skipped)."""
    depth = deepest = 0
    for token in _STRING_OR_BRACKET.finditer(text):
        char = token.group()
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def external_refs(document: Any) -> list[str]:
    """Every ``$ref`` in ``document`` that points outside it (not ``#...``)."""
    refs = []
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                refs.append(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return refs


def unenforced_keywords(schema: Any) -> list[str]:
    """Where ``schema`` uses a keyword the grammar will not enforce, as JSON pointers
    (``/properties/tags/uniqueItems``), depth first."""
    return list(_keyword_pointers(schema))


def _keyword_pointers(schema: Any) -> Iterator[str]:
    stack = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):  # a boolean schema
            continue
        children = []
        for key, value in node.items():
            here = f"{path}/{_escape(key)}"
            if key in UNENFORCED and not (key == "allOf" and _one(value)):
                yield here
            if key in _DATA:
                continue
            if key in _NAMED and isinstance(value, dict):
                children += [(sub, f"{here}/{_escape(name)}") for name, sub in value.items()]
            elif isinstance(value, dict):
                children.append((value, here))
            elif isinstance(value, list):
                children += [(sub, f"{here}/{i}") for i, sub in enumerate(value)]
        stack.extend(reversed(children))


def _one(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 1


def _escape(key: str) -> str:
    """A JSON pointer's token (RFC 6901)."""
    return str(key).replace("~", "~0").replace("/", "~1")
