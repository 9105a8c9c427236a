"""Guided decoding on the default model: does it finish what a grammar makes it write?

Loads a built default-model checkpoint with transformers and samples at temperature
1.0 (no top-k, no top-p) with XGrammar constraining generation, prompting through
the checkpoint's chat template:

- JSON schemas (compiled with any_whitespace=False): how many answers end with EOS
  within --max-tokens and validate against their schema;
- tool calls, tool_choice="required" (the qwen_3 structural tag): how many end and
  parse as calls of a listed tool with arguments that validate;
- tool_choice="auto" (the same tag, at_least_one false): how often the model calls a
  tool on its own when the question asks for one, and answers in plain text when no
  tool is listed (and when the listed tools do not fit the question).

    .venv/bin/python scripts/verify_guided_default_model.py [CHECKPOINT] [--samples 6]

CHECKPOINT defaults to model_repository/tensorrt_llm/1/hf_model (`make engines`).
Takes about a minute on 2 cores. Exit status 1 when a constrained answer fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = ROOT / "model_repository" / "tensorrt_llm" / "1" / "hf_model"

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}  # noqa: E741 (short: the schemas below)
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]


def obj(required: list[str] | None = None, **properties) -> dict:
    schema = {"type": "object", "properties": properties}
    schema["required"] = list(properties) if required is None else required
    return schema


# (what the user asks for, the schema its answer must follow)
SCHEMAS = [
    ("a person", obj(name=S, age=I)),
    ("a book", obj(title=S, author=S, year=I, tags={"type": "array", "items": S})),
    ("a product", obj(name=S, price=N, available=B, color={"enum": ["red", "green", "blue"]})),
    ("a user with an address", obj(name=S, address=obj(city=S, zip=S))),
    ("an order", obj(id=I, items={"type": "array", "items": obj(name=S, quantity=I)}, total=N)),
    ("the weather", obj(city=S, temperature=N, sky={"enum": ["sunny", "cloudy", "rainy"]})),
    ("a task", obj(["title"], title=S, note=S, priority={"enum": ["low", "medium", "high"]})),
    ("a labelled value", obj(value={"anyOf": [S, I]}, label=S)),
    ("some scores", obj(scores={"type": "array", "items": I})),
    ("a user", obj(user=obj(name=S, settings=obj(enabled=B, level={"enum": ["low", "high"]})))),
    ("a nickname", obj(name=S, nickname={"type": ["string", "null"]})),
    ("a checklist item", obj(done=B, urgent=B, count=I)),
    (
        "an event",
        obj(title=S, day={"enum": DAYS}, hour={"type": "integer", "minimum": 0, "maximum": 23}),
    ),
    ("two people", obj(people={"type": "array", "items": obj(name=S, age=I)})),
    ("a planet", obj(planet=S, moons=I, habitable=B)),
    ("a pet", {"anyOf": [obj(cat=S, lives=I), obj(dog=S, good=B)]}),
    ("a book record", obj(kind={"const": "book"}, title=S)),
    ("a small matrix", obj(matrix={"type": "array", "items": {"type": "array", "items": I}})),
    ("a place", obj(city=S, coordinates=obj(lat=N, lon=N))),
    ("a review", obj(rating=N, tags={"type": "array", "items": {"enum": ["good", "bad", "fun"]}})),
    ("a summary", obj(["summary"], summary=S, words=I, language=S)),
]
JSON_PROMPTS = ["Give me {} as JSON.", "Describe {} in JSON.", "Return {} in JSON format."]


def fn(name: str, description: str, **properties) -> dict:
    required = [k for k in properties if not k.endswith("_")]
    properties = {k.rstrip("_"): v for k, v in properties.items()}
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


WEATHER = fn("get_weather", "Get the current weather in a city.", city=S)
BOOKS = fn("search_books", "Search books about a topic.", query=S, limit_=I)
ALARM = fn("set_alarm", "Set an alarm clock.", hour=I, minute=I)
MESSAGE = fn("send_message", "Send a text message to a person.", to=S, text=S)
TIME = fn("get_time", "Get the local time in a city.", city=S)
# Two the corpus never lists: names and parameters the model has to copy.
PIZZA = fn(
    "order_pizza",
    "Order a pizza.",
    size={"enum": ["small", "large"]},
    toppings={"type": "array", "items": S},
)
FLIGHT = fn("lookup_flight", "Look up a flight by its number.", number=S)

# (tools listed, the question, the tool that answers it)
TOOL_CASES = [
    ([WEATHER, BOOKS], "What is the weather in Paris?", "get_weather"),
    ([BOOKS, ALARM, WEATHER], "Find books about space.", "search_books"),
    ([ALARM, MESSAGE], "Wake me up at 7:30.", "set_alarm"),
    ([MESSAGE, TIME], "Tell Anna that dinner is ready.", "send_message"),
    ([TIME, WEATHER], "What time is it in Tokyo?", "get_time"),
    ([WEATHER, MESSAGE, TIME], "Is it cold in Oslo today?", "get_weather"),
    ([PIZZA, WEATHER], "I want a large pizza with cheese.", "order_pizza"),
    ([FLIGHT, TIME], "Where is flight LH 404?", "lookup_flight"),
]
PLAIN_QUESTIONS = [
    "Where is the cat?",
    "What does the teacher see?",
    "Hello!",
    "Can you tell me about the old book?",
    "Why does a dog like the red ball?",
]


class Sampler:
    """The checkpoint under transformers, sampling --samples answers at temperature 1.0
    (no top-k, no top-p) through its chat template, with a grammar where given."""

    def __init__(self, args: argparse.Namespace):
        import torch
        import xgrammar as xgr
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(2)
        self.args = args
        self.tok = AutoTokenizer.from_pretrained(args.checkpoint)
        self.model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
        self.model.eval()
        vocab_size = self.model.config.vocab_size
        info = xgr.TokenizerInfo.from_huggingface(self.tok, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info)

    def tool_grammar(self, tools: list[dict], choice: str):
        """The qwen_3 structural tag for ``tools`` under ``tool_choice=choice``."""
        import xgrammar as xgr

        tag = xgr.get_model_structural_tag(
            "qwen_3", tools=tools, tool_choice=choice, reasoning=False
        )
        return self.compiler.compile_structural_tag(tag)

    def sample(self, messages, tools=None, grammar=None, seed=0) -> list[tuple[str, bool]]:
        """--samples answers: (text, ended with EOS)."""
        import torch
        from xgrammar.contrib.hf import LogitsProcessor

        tok, args = self.tok, self.args
        prompt = tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")
        torch.manual_seed(args.seed * 1000 + seed)
        with torch.inference_mode():
            out = self.model.generate(
                **ids,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_tokens,
                num_return_sequences=args.samples,
                logits_processor=[LogitsProcessor(grammar)] if grammar is not None else None,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        answers = []
        for row in out[:, ids["input_ids"].shape[1] :].tolist():
            ended = tok.eos_token_id in row
            row = row[: row.index(tok.eos_token_id)] if ended else row
            answers.append((tok.decode(row, skip_special_tokens=True), ended))
        return answers

    def show(self, title: str, texts: list[str]) -> None:
        for text in texts[: self.args.show]:
            print(f"    {title}: {text!r}")


def json_schemas(sampler: Sampler) -> bool:
    """Whether every answer under a JSON schema's grammar ended and validates."""
    import jsonschema

    ok = total = 0
    for i, (what, schema) in enumerate(SCHEMAS):
        grammar = sampler.compiler.compile_json_schema(schema, any_whitespace=False)
        messages = [{"role": "user", "content": JSON_PROMPTS[i % len(JSON_PROMPTS)].format(what)}]
        if i % 2:
            messages.insert(0, {"role": "system", "content": "Answer in JSON."})
        answers = sampler.sample(messages, grammar=grammar, seed=i)
        for text, ended in answers:
            total += 1
            try:
                jsonschema.validate(json.loads(text), schema)
                ok += ended
                if not ended:
                    print(f"  no EOS ({what}): {text!r}")
            except (ValueError, jsonschema.ValidationError):
                print(f"  invalid ({what}): {text!r}")
        if i < sampler.args.show:
            sampler.show(what, [t for t, _ in answers])
    print(
        f"JSON schemas: {ok}/{total} answers ended with EOS and validate ({100 * ok / total:.1f}%)"
    )
    return ok == total


def calls_in(text: str) -> list:
    return [json.loads(m) for m in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)]


def valid_calls(text: str, tools: list[dict]) -> bool:
    import jsonschema

    specs = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    try:
        calls = calls_in(text)
    except ValueError:
        return False
    for call in calls:
        if set(call) != {"name", "arguments"} or call["name"] not in specs:
            return False
        try:
            jsonschema.validate(call["arguments"], specs[call["name"]])
        except jsonschema.ValidationError:
            return False
    return bool(calls)


def tool_calls(sampler: Sampler, choice: str) -> bool:
    """Whether every answer under ``tool_choice=choice`` ended and (where it called)
    parses as calls of listed tools with valid arguments."""
    ok = total = called = right = 0
    for i, (tools, question, answer_tool) in enumerate(TOOL_CASES):
        grammar = sampler.tool_grammar(tools, choice)
        answers = sampler.sample([{"role": "user", "content": question}], tools, grammar, 100 + i)
        for text, ended in answers:
            total += 1
            if "<tool_call>" not in text:
                ok += ended and choice == "auto"
                continue
            called += 1
            good = ended and valid_calls(text, tools)
            ok += good
            right += good and calls_in(text)[0]["name"] == answer_tool
            if not good:
                print(f"  bad call ({choice}, {question}): {text!r} ended={ended}")
        if i < sampler.args.show:
            sampler.show(question, [t for t, _ in answers])
    print(
        f"tool_choice={choice}: {ok}/{total} answers ended with EOS and parse; "
        f"{called}/{total} ({100 * called / total:.1f}%) call a tool, "
        f"{right} the one the question asks for"
    )
    return ok == total


def plain_questions(sampler: Sampler, label: str, tools: list[dict] | None) -> None:
    """How often questions no tool answers get plain text, with ``tools`` listed."""
    plain = ended_n = total = 0
    grammar = sampler.tool_grammar(tools, "auto") if tools else None
    examples = []
    for i, question in enumerate(PLAIN_QUESTIONS):
        messages = [{"role": "user", "content": question}]
        for text, ended in sampler.sample(messages, tools, grammar, seed=200 + i):
            total += 1
            plain += "<tool_call>" not in text
            ended_n += ended
            examples.append(text)
    sampler.show(label, examples)
    print(
        f"plain questions, {label}: {plain}/{total} ({100 * plain / total:.1f}%) answered in "
        f"plain text, {ended_n}/{total} ended with EOS"
    )


def unconstrained_json(sampler: Sampler) -> None:
    """Without a grammar: does the model write JSON when asked for it on its own?"""
    parsed = total = 0
    for i, (what, _schema) in enumerate(SCHEMAS):
        question = JSON_PROMPTS[i % len(JSON_PROMPTS)].format(what)
        for text, ended in sampler.sample([{"role": "user", "content": question}], seed=300 + i):
            total += 1
            try:
                json.loads(text)
                parsed += ended
            except ValueError:
                pass
    print(
        f"unconstrained JSON requests: {parsed}/{total} ({100 * parsed / total:.1f}%) parse as JSON"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--samples", type=int, default=6, help="samples per schema / question")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=2, help="example answers printed per section")
    sampler = Sampler(p.parse_args())
    started = time.monotonic()
    passed = json_schemas(sampler)
    passed &= tool_calls(sampler, "required")
    passed &= tool_calls(sampler, "auto")
    plain_questions(sampler, "no tools", None)
    plain_questions(sampler, "unfitting tools", [ALARM, BOOKS])
    unconstrained_json(sampler)
    print(f"({time.monotonic() - started:.0f} s)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
