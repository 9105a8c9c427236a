"""Requests and answers several API tests send or script: a tool of each dialect's shape,
a model's call of it, schemas."""

from __future__ import annotations

import json

# One tool, the weather in a city, in each dialect's shape.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
_WEATHER = {"name": "get_weather", "description": "the weather in a city"}
CHAT_WEATHER = {"type": "function", "function": {**_WEATHER, "parameters": WEATHER_PARAMETERS}}
MESSAGES_WEATHER = {**_WEATHER, "input_schema": WEATHER_PARAMETERS}
RESPONSES_WEATHER = {"type": "function", **_WEATHER, "parameters": WEATHER_PARAMETERS}

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)

USER = [{"role": "user", "content": "weather in Paris?"}]

ASK = [{"role": "user", "content": "weather in Paris?"}]

DEEP = json.loads('{"items":' * 100 + "{}" + "}" * 100)  # 101 levels of objects

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
