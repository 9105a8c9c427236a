"""A deterministic training text for the default model's tokenizer (and model).

Generated from small word banks with a seeded RNG, so the build needs no
network and no data file; it mixes in accented, Cyrillic, CJK and emoji words so
the tokenizer learns multi-byte characters and the tests can exercise them.

Besides sentences, :func:`documents` gives compact one-line JSON objects and chat
conversations (message lists, rendered by the chat template at build time): plain
questions and answers, JSON answers, and tool calls with their responses, so that a
model constrained by a grammar (JSON schemas, tool calls) ends its strings, lists and
objects, and calls a listed tool when the question asks for one.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass

SUBJECTS = [
    "the cat",
    "a dog",
    "the model",
    "my friend",
    "the server",
    "a small bird",
    "the teacher",
    "our team",
    "the engine",
    "a robot",
    "the river",
    "an old man",
    "the child",
    "the city",
    "a student",
    "the market",
    "the scheduler",
    "a replica",
    "the cluster",
    "the kernel",
]
VERBS = [
    "sees",
    "likes",
    "builds",
    "serves",
    "finds",
    "reads",
    "writes",
    "moves",
    "helps",
    "watches",
    "answers",
    "carries",
    "follows",
    "opens",
    "closes",
    "paints",
    "learns",
    "sends",
    "keeps",
    "brings",
]
OBJECTS = [
    "the red ball",
    "a long letter",
    "the green door",
    "many requests",
    "a quiet song",
    "the morning light",
    "a cup of tea",
    "the first token",
    "a warm bread",
    "the blue sky",
    "a busy street",
    "the last train",
    "a new idea",
    "the big garden",
    "a simple answer",
    "the open window",
    "a fast batch",
    "the tiny model",
    "a bright star",
    "the old book",
]
PLACES = [
    "in the park",
    "at home",
    "near the sea",
    "on the table",
    "under the bridge",
    "after dinner",
    "before noon",
    "in the café",
    "at the station",
    "in the garden",
    "on the hill",
    "by the window",
    "in the morning",
    "at night",
    "in Zürich",
    "in München",
    "à Paris",
    "in Tōkyō",
    "в Москве",
    "在北京",
]
EXTRAS = [
    "It is a naïve idea.",
    "Ça va très bien.",
    "Schöne Grüße!",
    "Привет, мир!",
    "日本語は難しい。",
    "数据很重要。",
    "I like it 🙂.",
    "Great work 🚀!",
    "The price is 5 €.",
    "It costs £3.",
    "¿Dónde está?",
    "Smörgåsbord is tasty.",
    "Crème brûlée, s'il vous plaît.",
    "こんにちは世界",
    "안녕하세요",
    "Γειά σου κόσμε",
    "señor José",
    "façade and déjà vu",
]
QUESTIONS = [
    "what does {s} see?",
    "where is {s}?",
    "why does {s} like {o}?",
    "who {v} {o}?",
    "can you tell me about {o}?",
    "how does {s} work?",
]


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.15:
            out.append(rng.choice(EXTRAS))
        elif roll < 0.30:
            q = rng.choice(QUESTIONS).format(
                s=rng.choice(SUBJECTS), v=rng.choice(VERBS), o=rng.choice(OBJECTS)
            )
            out.append(q[0].upper() + q[1:])
        else:
            s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
            if rng.random() < 0.6:
                s += f" {rng.choice(PLACES)}"
            out.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"]))
    return out


# --- JSON objects -----------------------------------------------------------------
# Compact one-line JSON with json.dumps' default separators (", " and ": "): the text
# XGrammar makes a model write with any_whitespace=False, and the shape of tool calls.

NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas"]
NAMES += ["Kenji", "Lena", "Marco", "Nadia", "Omar", "Paula", "Sofia", "Tom", "Yuki", "Zoé"]
CITIES = ["Paris", "London", "Berlin", "Tokyo", "Madrid", "Rome", "Oslo", "Cairo", "Lima"]
CITIES += ["Seoul", "Zürich", "München", "New York", "Sydney", "Toronto", "Москва", "北京"]
CITIES += ["Lisbon", "Vienna", "Prague"]
COLORS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
STATUSES = ["active", "inactive", "pending", "done", "failed", "open", "closed"]
LEVELS = ["low", "medium", "high"]
TOPICS = ["space", "history", "cooking", "music", "the sea", "robots", "gardens", "trains"]
TOPICS += ["cats", "jazz", "poetry", "chess", "birds", "rivers", "tea", "stars"]
LANGUAGES = ["French", "German", "Spanish", "Japanese", "Russian", "Chinese", "Italian"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
SKIES = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
ROOMS = ["kitchen", "bedroom", "office", "garden", "hall", "bathroom"]
CUISINES = ["italian", "japanese", "indian", "mexican", "french", "thai"]
WORDS = ["apple", "river", "stone", "cloud", "light", "paper", "music", "bread", "glass"]
WORDS += ["train", "window", "garden", "letter", "forest", "sugar", "engine", "token", "batch"]


def _bare(phrase: str) -> str:
    """'the red ball' -> 'red ball' (a title-like value)."""
    for article in ("the ", "a ", "an ", "many ", "our ", "my "):
        if phrase.startswith(article):
            return phrase[len(article) :]
    return phrase


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.5:
        s += f" {rng.choice(PLACES)}"
    return s[0].upper() + s[1:] + rng.choice([".", ".", "!"])


def _few(rng: random.Random, low: int = 1) -> int:
    """A short list's length: mostly one or two, so lists end soon."""
    return rng.choice([low, low, low, low + 1, low + 1, low + 2])


def _price(rng: random.Random) -> float:
    return round(rng.uniform(0.5, 200), rng.choice([1, 2]))


# key -> value maker; the keys a schema is likely to use, with plausible values.
_STRING_KEYS = {
    "name": lambda r: r.choice(NAMES),
    "city": lambda r: r.choice(CITIES),
    "title": lambda r: _bare(r.choice(OBJECTS)),
    "author": lambda r: r.choice(NAMES),
    "owner": lambda r: r.choice(NAMES),
    "color": lambda r: r.choice(COLORS),
    "status": lambda r: r.choice(STATUSES),
    "level": lambda r: r.choice(LEVELS),
    "priority": lambda r: r.choice(LEVELS),
    "topic": lambda r: r.choice(TOPICS),
    "language": lambda r: r.choice(LANGUAGES),
    "day": lambda r: r.choice(DAYS),
    "sky": lambda r: r.choice(SKIES),
    "label": lambda r: r.choice(WORDS),
    "kind": lambda r: r.choice(WORDS),
    "type": lambda r: r.choice(WORDS),
    "room": lambda r: r.choice(ROOMS),
    "place": lambda r: _bare(r.choice(PLACES)),
    "description": lambda r: _sentence(r),
    "text": lambda r: _sentence(r),
    "summary": lambda r: _sentence(r),
    "note": lambda r: _bare(r.choice(OBJECTS)),
    "email": lambda r: f"{r.choice(NAMES).lower()}@example.com",
    "date": lambda r: f"20{r.randint(10, 29)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
}
_NUMBER_KEYS = {
    "id": lambda r: r.randint(1, 9999),
    "age": lambda r: r.randint(1, 90),
    "year": lambda r: r.randint(1950, 2025),
    "count": lambda r: r.randint(0, 20),
    "total": lambda r: r.randint(1, 500),
    "size": lambda r: r.randint(1, 64),
    "limit": lambda r: r.randint(1, 10),
    "hour": lambda r: r.randint(0, 23),
    "minute": lambda r: r.randint(0, 59),
    "temperature": lambda r: r.randint(-10, 35),
    "quantity": lambda r: r.randint(1, 12),
    "pages": lambda r: r.randint(20, 900),
    "price": _price,
    "score": lambda r: round(r.uniform(0, 10), 1),
    "rating": lambda r: round(r.uniform(1, 5), 1),
    "rate": lambda r: round(r.uniform(0, 1), 2),
    "weight": lambda r: round(r.uniform(0.1, 90), 1),
}
_BOOL_KEYS = ["enabled", "active", "done", "ok", "visible", "available", "valid", "urgent"]
_LIST_KEYS = {
    "tags": lambda r: r.sample(WORDS, _few(r, 0)),
    "colors": lambda r: r.sample(COLORS, _few(r)),
    "cities": lambda r: r.sample(CITIES, _few(r)),
    "names": lambda r: r.sample(NAMES, _few(r)),
    "scores": lambda r: [r.randint(0, 100) for _ in range(_few(r))],
    "values": lambda r: [round(r.uniform(0, 10), 1) for _ in range(_few(r))],
    "days": lambda r: r.sample(DAYS, _few(r)),
    "ids": lambda r: [r.randint(1, 999) for _ in range(_few(r, 0))],
    "flags": lambda r: [r.random() < 0.5 for _ in range(_few(r))],
}
# Lists of lists (a matrix, pairs, points): a model must learn to end the outer list too.
_NESTED_LIST_KEYS = {
    "matrix": lambda r: [[r.randint(0, 9) for _ in range(_few(r))] for _ in range(_few(r))],
    "grid": lambda r: [[r.randint(0, 99) for _ in range(_few(r))] for _ in range(_few(r))],
    "rows": lambda r: [r.sample(WORDS, _few(r)) for _ in range(_few(r))],
    "pairs": lambda r: [[r.choice(WORDS), r.randint(0, 99)] for _ in range(_few(r))],
    "points": lambda r: [
        [round(r.uniform(-9, 9), 1), round(r.uniform(-9, 9), 1)] for _ in range(_few(r))
    ],
}
_OBJECT_KEYS = ["user", "address", "owner_info", "meta", "details", "settings", "location"]
_OBJECT_LIST_KEYS = ["items", "users", "results", "events"]


def json_object(rng: random.Random, depth: int = 0) -> dict:
    """A small random object: strings from the word banks, numbers, booleans, null,
    lists and (up to two levels) nested objects."""
    out: dict = {}
    for _ in range(rng.randint(1, 4 if depth else 5)):
        roll = rng.random()
        if roll < 0.38:
            key = rng.choice(list(_STRING_KEYS))
            value = _STRING_KEYS[key](rng)
        elif roll < 0.62:
            key = rng.choice(list(_NUMBER_KEYS))
            value = _NUMBER_KEYS[key](rng)
        elif roll < 0.72:
            key, value = rng.choice(_BOOL_KEYS), rng.random() < 0.5
        elif roll < 0.80:
            key = rng.choice(list(_LIST_KEYS))
            value = _LIST_KEYS[key](rng)
        elif roll < 0.84:
            key = rng.choice(list(_NESTED_LIST_KEYS))
            value = _NESTED_LIST_KEYS[key](rng)
        elif depth < 2 and roll < 0.93:
            key, value = rng.choice(_OBJECT_KEYS), json_object(rng, depth + 1)
        elif depth < 1:
            key = rng.choice(_OBJECT_LIST_KEYS)
            value = [json_object(rng, depth + 2) for _ in range(_few(rng, 0))]
        else:
            key, value = rng.choice(list(_STRING_KEYS)), None
        if rng.random() < 0.04:
            value = None
        elif isinstance(value, dict) and rng.random() < 0.1:
            value = {}
        out.setdefault(key, value)
    return out


# Entities a user asks for "as JSON": (what they are called, their fields).
ENTITIES = [
    ("a user", ["name", "age", "city", "email"]),
    ("a person", ["name", "age", "city"]),
    ("a book", ["title", "author", "year", "pages", "tags"]),
    ("a product", ["name", "price", "color", "available"]),
    ("a task", ["title", "done", "priority", "day"]),
    ("an order", ["id", "items", "total", "status"]),
    ("an event", ["title", "day", "hour", "city"]),
    ("the weather", ["city", "temperature", "sky"]),
    ("a city", ["name", "country", "population"]),
    ("a song", ["title", "author", "year", "rating"]),
    ("a movie", ["title", "year", "rating", "tags"]),
    ("a pet", ["name", "kind", "age", "color"]),
    ("some people", ["people"]),
    ("a team", ["name", "people"]),
]
_EXTRA_FIELDS = {
    "country": lambda r: r.choice(["France", "Japan", "Peru", "Norway", "Egypt", "Korea"]),
    "population": lambda r: r.randint(1000, 9_000_000),
    "items": lambda r: [
        {"name": r.choice(WORDS), "quantity": r.randint(1, 5)} for _ in range(_few(r))
    ],
    "people": lambda r: [
        {"name": r.choice(NAMES), "age": r.randint(1, 90)} for _ in range(_few(r))
    ],
}


def entity(rng: random.Random, fields: list[str]) -> dict:
    out: dict = {}
    for key in fields:
        if rng.random() < 0.15 and len(out) > 0:
            continue  # an optional field left out
        for bank in (_STRING_KEYS, _NUMBER_KEYS, _LIST_KEYS, _EXTRA_FIELDS):
            if key in bank:
                out[key] = bank[key](rng)
                break
        else:
            out[key] = rng.random() < 0.5
    return out


JSON_REQUESTS = [
    "Give me {e} as JSON.",
    "Describe {e} in JSON.",
    "Reply with {e} as a JSON object.",
    "Return {e} in JSON format.",
    "JSON for {e}, please.",
    "Make up {e}. Answer in JSON.",
]
GENERIC_JSON_REQUESTS = [
    "Reply with a JSON object.",
    "Give me some JSON.",
    "Answer in JSON.",
    "Return a JSON object with a few fields.",
    "Fill in this JSON schema.",
]
JSON_SYSTEMS = ["Answer in JSON.", "You reply with JSON only.", "Output one JSON object."]


# --- tools --------------------------------------------------------------------------
# Functions a conversation lists (OpenAI shape) and calls Hermes-style:
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, the text XGrammar's
# qwen_3 structural tag constrains a tool call to.


@dataclass(frozen=True)
class Param:
    name: str
    schema: dict
    make: Callable[[random.Random], object]
    required: bool = True


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: tuple[Param, ...]
    questions: tuple[str, ...]  # str.format'ed with the arguments
    result: Callable[[random.Random, dict], dict]
    answer: str  # str.format'ed with the arguments and the result

    def spec(self) -> dict:
        properties = {p.name: p.schema for p in self.params}
        required = [p.name for p in self.params if p.required]
        parameters = {"type": "object", "properties": properties, "required": required}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": parameters,
            },
        }


def _string(bank: list[str]) -> Callable[[random.Random], str]:
    return lambda r: r.choice(bank)


def _int(low: int, high: int) -> Callable[[random.Random], int]:
    return lambda r: r.randint(low, high)


STRING, INTEGER, NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
MESSAGES = ["I am late", "dinner is ready", "the train left", "see you soon", "call me back"]
MESSAGES += ["the cat is home", "the server is up", "I found the book"]
SYMBOLS = ["ACME", "TRTN", "RAY", "LLMA", "GPU", "NVDA", "BLUE"]
CURRENCIES = ["EUR", "USD", "GBP", "JPY", "CHF"]

TOOLS = [
    Tool(
        "get_weather",
        "Get the current weather in a city.",
        (
            Param("city", STRING, _string(CITIES)),
            Param(
                "unit",
                {"type": "string", "enum": ["celsius", "fahrenheit"]},
                _string(["celsius", "fahrenheit"]),
                required=False,
            ),
        ),
        (
            "What is the weather in {city}?",
            "Is it cold in {city} today?",
            "How is the weather in {city}?",
            "Tell me the weather in {city}.",
            "Will it rain in {city}?",
            "What is the temperature in {city} in {unit}?",
        ),
        lambda r, a: {"temperature": r.randint(-10, 35), "sky": r.choice(SKIES)},
        "It is {temperature} degrees and {sky} in {city}.",
    ),
    Tool(
        "search_books",
        "Search books about a topic.",
        (
            Param("query", STRING, _string(TOPICS)),
            Param("limit", INTEGER, _int(1, 5), required=False),
        ),
        (
            "Find books about {query}.",
            "Can you look up books on {query}?",
            "Find {limit} books about {query}.",
            "I want to read about {query}.",
        ),
        lambda r, a: {"books": [_bare(r.choice(OBJECTS)) for _ in range(_few(r))]},
        "I found {books[0]} and more books about {query}.",
    ),
    Tool(
        "set_alarm",
        "Set an alarm clock.",
        (Param("hour", INTEGER, _int(0, 23)), Param("minute", INTEGER, _int(0, 59))),
        (
            "Wake me up at {hour}:{minute:02d}.",
            "Set an alarm for {hour}:{minute:02d}.",
            "Please set my alarm to {hour} {minute}.",
        ),
        lambda r, a: {"ok": True},
        "Your alarm is set for {hour}:{minute:02d}.",
    ),
    Tool(
        "send_message",
        "Send a text message to a person.",
        (Param("to", STRING, _string(NAMES)), Param("text", STRING, _string(MESSAGES))),
        ("Tell {to} that {text}.", "Send a message to {to}: {text}.", "Text {to} and say {text}."),
        lambda r, a: {"sent": True},
        "I sent your message to {to}.",
    ),
    Tool(
        "get_time",
        "Get the local time in a city.",
        (Param("city", STRING, _string(CITIES)),),
        ("What time is it in {city}?", "What is the time in {city} now?"),
        lambda r, a: {"time": f"{r.randint(0, 23)}:{r.randint(0, 59):02d}"},
        "It is {time} in {city}.",
    ),
    Tool(
        "convert_currency",
        "Convert an amount of money.",
        (
            Param("amount", NUMBER, _price),
            Param("source", STRING, _string(CURRENCIES)),
            Param("target", STRING, _string(CURRENCIES)),
        ),
        ("How much is {amount} {source} in {target}?", "Convert {amount} {source} to {target}."),
        lambda r, a: {"amount": _price(r)},
        "{amount} {source} is {result_amount} {target}.",
    ),
    Tool(
        "translate_text",
        "Translate a text into a language.",
        (
            Param("text", STRING, lambda r: r.choice(WORDS)),
            Param("language", STRING, _string(LANGUAGES)),
        ),
        ("How do you say {text} in {language}?", "Translate {text} into {language}."),
        lambda r, a: {"translation": r.choice(EXTRAS)},
        "In {language} it is: {translation}",
    ),
    Tool(
        "find_restaurant",
        "Find a restaurant in a city.",
        (
            Param("city", STRING, _string(CITIES)),
            Param(
                "cuisine", {"type": "string", "enum": CUISINES}, _string(CUISINES), required=False
            ),
        ),
        (
            "Where can I eat {cuisine} food in {city}?",
            "Find a restaurant in {city}.",
            "I am hungry in {city}. Any {cuisine} place?",
        ),
        lambda r, a: {"name": f"{r.choice(NAMES)}'s", "rating": round(r.uniform(1, 5), 1)},
        "Try {name} in {city}, rated {rating}.",
    ),
    Tool(
        "play_song",
        "Play a song.",
        (
            Param("title", STRING, lambda r: _bare(r.choice(OBJECTS))),
            Param("artist", STRING, _string(NAMES), required=False),
        ),
        ("Play {title} by {artist}.", "Play the song {title}.", "I want to hear {title}."),
        lambda r, a: {"playing": True},
        "Now playing {title}.",
    ),
    Tool(
        "create_note",
        "Save a note.",
        (Param("title", STRING, _string(WORDS)), Param("text", STRING, _string(MESSAGES))),
        ("Make a note called {title}: {text}.", "Write down {text} under {title}."),
        lambda r, a: {"id": r.randint(1, 999)},
        "I saved the note {title}.",
    ),
    Tool(
        "get_stock_price",
        "Get the price of a stock.",
        (Param("symbol", STRING, _string(SYMBOLS)),),
        ("What is the price of {symbol}?", "How much is {symbol} stock today?"),
        lambda r, a: {"price": _price(r)},
        "{symbol} trades at {price}.",
    ),
    Tool(
        "add_event",
        "Add an event to the calendar.",
        (
            Param("title", STRING, _string(WORDS)),
            Param("day", {"type": "string", "enum": DAYS}, _string(DAYS)),
            Param("hour", INTEGER, _int(6, 22), required=False),
        ),
        ("Add {title} on {day} at {hour}.", "Put {title} in my calendar for {day}."),
        lambda r, a: {"ok": True},
        "{title} is in your calendar on {day}.",
    ),
    Tool(
        "get_news",
        "Get the latest news about a topic.",
        (
            Param("topic", STRING, _string(TOPICS)),
            Param("count", INTEGER, _int(1, 5), required=False),
        ),
        ("What is new in {topic}?", "Give me {count} news about {topic}.", "Any news on {topic}?"),
        lambda r, a: {"headlines": [_sentence(r) for _ in range(r.randint(1, 2))]},
        "{headlines[0]}",
    ),
    Tool(
        "set_light",
        "Turn the lights in a room on or off.",
        (
            Param("room", STRING, _string(ROOMS)),
            Param("on", {"type": "boolean"}, lambda r: r.random() < 0.7),
            Param("brightness", INTEGER, _int(0, 100), required=False),
        ),
        (
            "Turn on the light in the {room}.",
            "Switch the {room} lights at {brightness}.",
            "It is dark in the {room}.",
        ),
        lambda r, a: {"ok": True},
        "The {room} lights are set.",
    ),
    Tool(
        "book_table",
        "Book a table at a restaurant.",
        (
            Param("people", INTEGER, _int(1, 8)),
            Param("hour", INTEGER, _int(11, 22)),
            Param("day", {"type": "string", "enum": DAYS}, _string(DAYS), required=False),
        ),
        (
            "Book a table for {people} at {hour}.",
            "A table for {people} on {day} at {hour}, please.",
        ),
        lambda r, a: {"booked": True, "table": r.randint(1, 30)},
        "Table {table} is booked for {people} at {hour}.",
    ),
    Tool(
        "calculate",
        "Evaluate a math expression.",
        (
            Param(
                "expression",
                STRING,
                lambda r: f"{r.randint(2, 99)} {r.choice('+-*/')} {r.randint(2, 99)}",
            ),
        ),
        ("What is {expression}?", "Compute {expression}.", "How much is {expression}?"),
        lambda r, a: {"result": r.randint(0, 999)},
        "{expression} = {result}.",
    ),
]

# Generated tools: verb_noun names with parameters from the banks, so that a model
# copies names and parameters from the listing rather than learning a fixed set.
_TOOL_VERBS = ["get", "find", "list", "create", "delete", "update", "check", "count"]
_TOOL_NOUNS = ["orders", "tickets", "files", "users", "songs", "photos", "tasks", "rooms"]
_GENERIC_PARAMS = [
    Param("name", STRING, _string(NAMES)),
    Param("city", STRING, _string(CITIES)),
    Param("status", {"type": "string", "enum": STATUSES[:4]}, _string(STATUSES[:4])),
    Param("limit", INTEGER, _int(1, 20)),
    Param("id", INTEGER, _int(1, 9999)),
    Param("query", STRING, _string(WORDS)),
    Param("day", STRING, _string(DAYS)),
    Param("urgent", {"type": "boolean"}, lambda r: r.random() < 0.5),
]


def generated_tool(rng: random.Random) -> Tool:
    verb, noun = rng.choice(_TOOL_VERBS), rng.choice(_TOOL_NOUNS)
    params = tuple(rng.sample(_GENERIC_PARAMS, rng.randint(1, 3)))
    phrase = " and ".join(f"{p.name} {{{p.name}}}" for p in params)
    return Tool(
        f"{verb}_{noun}",
        f"{verb.capitalize()} {noun}.",
        params,
        (
            f"Please {verb} the {noun} with {phrase}.",
            f"Can you {verb} {noun} for {phrase}?",
            f"{verb.capitalize()} my {noun}, {phrase}.",
        ),
        lambda r, a: {"count": r.randint(0, 9), "status": r.choice(STATUSES)},
        f"{verb.capitalize()} {noun}: {{count}} found, {{status}}.",
    )


def _fields(template: str) -> set[str]:
    return {f.split("[")[0].split(":")[0] for _, f, _, _ in string.Formatter().parse(template) if f}


def tool_call(rng: random.Random, tool: Tool) -> tuple[str, dict]:
    """A user question the tool answers, and the call's arguments."""
    args = {p.name: p.make(rng) for p in tool.params if p.required or rng.random() < 0.5}
    fitting = [q for q in tool.questions if _fields(q) <= set(args)]
    return rng.choice(fitting).format(**args), args


def tool_result(rng: random.Random, tool: Tool, args: dict) -> tuple[str, str]:
    """The tool's JSON result and the assistant's answer from it."""
    result = tool.result(rng, args)
    values = {**result, **args, **{f"result_{k}": v for k, v in result.items()}}
    return json.dumps(result, ensure_ascii=False), tool.answer.format(**values)


# --- chats --------------------------------------------------------------------------

Chat = tuple[list[dict], list[dict] | None]  # messages, tools (OpenAI shapes)

SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", "You are a tiny model."]
GREETINGS = ["Hello!", "Hi there.", "Good morning!", "Hey, how are you?"]
REQUESTS = ["Tell me about {o}.", "Say something about {s}.", "Write one sentence."]


def _question(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.1:
        return rng.choice(GREETINGS)
    template = rng.choice(QUESTIONS if roll < 0.75 else REQUESTS)
    q = template.format(s=rng.choice(SUBJECTS), v=rng.choice(VERBS), o=rng.choice(OBJECTS))
    return q[0].upper() + q[1:]


def _answer(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.choice([1, 1, 2])))


def _plain_turns(rng: random.Random) -> list[dict]:
    return [
        {"role": "user", "content": _question(rng)},
        {"role": "assistant", "content": _answer(rng)},
    ]


def _with_system(rng: random.Random, messages: list[dict], bank: list[str], p: float) -> list[dict]:
    if rng.random() < p:
        return [{"role": "system", "content": rng.choice(bank)}, *messages]
    return messages


def plain_chat(rng: random.Random) -> Chat:
    messages = _plain_turns(rng)
    if rng.random() < 0.25:
        messages += _plain_turns(rng)
    return _with_system(rng, messages, SYSTEMS, 0.3), None


def json_chat(rng: random.Random) -> Chat:
    if rng.random() < 0.6:
        what, fields = rng.choice(ENTITIES)
        question = rng.choice(JSON_REQUESTS).format(e=what)
        answer = entity(rng, fields)
    else:
        question, answer = rng.choice(GENERIC_JSON_REQUESTS), json_object(rng)
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)},
    ]
    return _with_system(rng, messages, JSON_SYSTEMS, 0.3), None


def tool_chat(rng: random.Random, call_id: int) -> Chat:
    """Tools listed; the user asks what one of them answers (a call, its response, the
    answer), or now and then something none of them does (a plain answer)."""

    def pick() -> Tool:
        return generated_tool(rng) if rng.random() < 0.25 else rng.choice(TOOLS)

    target = pick()
    listed = [target]
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        other = pick()
        if all(other.name != t.name for t in listed):
            listed.append(other)
    rng.shuffle(listed)
    messages = _plain_turns(rng) if rng.random() < 0.1 else []
    if rng.random() < 0.15:
        messages += _plain_turns(rng)
    else:
        question, args = tool_call(rng, target)
        call = {
            "id": f"call_{call_id}",
            "type": "function",
            "function": {"name": target.name, "arguments": json.dumps(args, ensure_ascii=False)},
        }
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ]
        if rng.random() < 0.8:
            result, answer = tool_result(rng, target, args)
            messages += [
                {"role": "tool", "tool_call_id": call["id"], "content": result},
                {"role": "assistant", "content": answer},
            ]
    return _with_system(rng, messages, SYSTEMS, 0.25), [t.spec() for t in listed]


def documents(count: int, seed: int = 0) -> list[str | Chat]:
    """The training documents: plain texts (sentences, JSON lines) and chats."""
    rng = random.Random(seed)
    texts = iter(sentences(count, seed=seed))
    out: list[str | Chat] = []
    for i in range(count):
        roll = rng.random()
        if roll < 0.62:
            out.append(next(texts))
        elif roll < 0.64:
            out.append(json.dumps(json_object(rng), ensure_ascii=False))
        elif roll < 0.70:
            out.append(plain_chat(rng))
        elif roll < 0.965:
            out.append(json_chat(rng))
        else:
            out.append(tool_chat(rng, i))
    return out
