"""``make bench-structured``: what a ``json_schema`` constraint costs, side by side.

One stack (``serve run`` of serve/config.yaml's LLM over the default model repository,
or ``--repository``; its own local Ray), one seeded set of chat prompts ("Give me a
person as JSON." and the like), ``--streams`` concurrent streams, ``--max-tokens`` per
answer, temperature ``--temperature`` with a seed per prompt. Two conditions on the
same prompts:

- ``free``: no ``response_format``;
- ``json_schema``: ``response_format: {"type": "json_schema", ...}`` with
  :data:`PERSON_SCHEMA` (strings, integers, an enum, a list, a nested object), which
  the engine enforces with XGrammar (a token bitmask per constrained sequence, filled
  and applied to the logits every step).

The conditions alternate for ``--rounds`` rounds (free, json_schema, free, ...), so
whatever else the machine does hits both. Per condition, pooled over its rounds:
output tokens/s (tokens from ``usage``), ITL p50/p99 (the gaps between streamed content
chunks, as bench/loadgen.py measures them), TTFT p50, output tokens per answer, the
share of answers that ended with ``stop`` and, for both, the share that parse as JSON
and that match the schema; TPOT p50 (first to last chunk per token, per request, which
chunks that reach the client together do not skew); and the CPU each process role
spent per output token (bench/cpu.py). The ratio json_schema/free of tokens/s and ITL
p50 is checked against the target: at most ``--max-cost`` (10%) cost.

The conditions' answers may differ in length (a JSON answer ends when its object
does), and in a closed loop shorter answers spend a larger share of their time queued
and in prefill: tokens/s then compares different work (the report says so), and
``--free-min-tokens`` evens the lengths; ITL, TPOT and CPU per token are per token.

Before the stack starts, in this process: the time to compile a generated
``--schema-fields``-field schema (and the bench's own) with
:class:`tritonllm.guided.GuideCompiler` over the repository's tokenizer, cold (a fresh
compiler, a schema it has not seen) and cached (the same schema again), and the API's
tokenizer-free check, :func:`tritonllm.guided.grammar`; medians of
``--compile-repeats``. Writes ``results.json`` under ``--out`` and prints the tables last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

from rich.console import Console
from rich.table import Table

from bench import cpu
from bench.capacity import stack_config
from bench.common import ROOT, checkpoint_dir, stop_on_sigterm
from bench.loadgen import OpenAITarget, RequestRecord, run_level, summarize
from bench.serving import MODEL, machine, serve_run
from serve.launch import SERVE_MODES

console = Console(soft_wrap=True, width=160)
CONDITIONS = ("free", "json_schema")
SCHEMA_NAME = "person"

# What an application asks a model for: 9 fields, strings, integers, an enum, a
# boolean, a list and a nested object, all required.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "occupation": {"type": "string"},
        "role": {"type": "string", "enum": ["engineer", "teacher", "artist", "doctor", "other"]},
        "active": {"type": "boolean"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "integer"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "rating": {"type": "number"},
    },
    "required": [
        "name",
        "age",
        "email",
        "occupation",
        "role",
        "active",
        "hobbies",
        "address",
        "rating",
    ],  # fmt: skip
    "additionalProperties": False,
}

TEMPLATES = (
    "Give me a person as JSON.",
    "Describe a {job} from {city} as a JSON object.",
    "Write a JSON record for a new {job}.",
    "Invent someone who lives in {city}. Answer in JSON.",
    "Give me the profile of a {job} as JSON.",
    "Make up a customer from {city} and return it as JSON.",
)
JOBS = ("teacher", "nurse", "pilot", "engineer", "baker", "painter", "doctor", "farmer")
CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Austin", "Pune", "Porto")


class ChatPrompt(NamedTuple):
    text: str
    seed: int  # the request's sampling seed: the same in both conditions


def chat_prompts(count: int, seed: int = 0) -> list[ChatPrompt]:
    """``count`` varied requests for a person as JSON, each with its own sampling seed;
    the same for a seed."""
    rng = random.Random(seed)
    return [
        ChatPrompt(
            rng.choice(TEMPLATES).format(job=rng.choice(JOBS), city=rng.choice(CITIES)),
            rng.randrange(2**31),
        )
        for _ in range(count)
    ]


def wide_schema(fields: int, salt: int = 0) -> dict:
    """A flat-ish object schema of ``fields`` required fields, cycling through strings,
    integers, numbers, booleans, enums, string lists and small nested objects; ``salt``
    renames the fields (another schema, the same shape: a cold compile each)."""
    kinds = (
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "string", "enum": ["low", "medium", "high", "unknown"]},
        {"type": "array", "items": {"type": "string"}},
        {
            "type": "object",
            "properties": {"label": {"type": "string"}, "count": {"type": "integer"}},
            "required": ["label", "count"],
            "additionalProperties": False,
        },
    )
    properties = {f"field_{salt}_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "schema": schema}}


class ChatTarget(OpenAITarget):
    """``POST /v1/chat/completions``, streamed: one user message, sampled with the
    prompt's seed, ``response_format`` when given; answers end when the model (or its
    grammar) says so, ``max_tokens`` at most."""

    path = "/v1/chat/completions"

    def __init__(
        self, name, base_url, model, temperature: float, response_format=None, min_tokens=0
    ):
        super().__init__(name, base_url, model)
        self.temperature = temperature
        self.response_format = response_format
        self.min_tokens = min_tokens

    def body(self, prompt: ChatPrompt, output_len: int) -> dict:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": output_len,
            "temperature": self.temperature,
            "seed": prompt.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.response_format is not None:
            body["response_format"] = self.response_format
        if self.min_tokens:
            body["min_tokens"] = min(self.min_tokens, output_len)
        return body

    def check(self, record: RequestRecord, output_len: int) -> None:
        if record.error is None and not record.rejected and not record.tokens:
            record.error = "no tokens"


def answer_figures(records: list[RequestRecord], schema: dict) -> dict:
    """Of the completed answers: tokens per answer, and the shares that ended with
    ``stop``, that parse as JSON and that match ``schema``."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    ok = [r for r in records if r.ok]
    parsed = []
    for r in ok:
        try:
            parsed.append(json.loads(r.text))
        except ValueError:
            continue
    share = (lambda n: n / len(ok)) if ok else (lambda n: float("nan"))
    return {
        "tokens_per_answer": sum(r.tokens for r in ok) / len(ok) if ok else float("nan"),
        "stop_share": share(sum(r.finish_reason == "stop" for r in ok)),
        "json_share": share(len(parsed)),
        "schema_valid_share": share(sum(validator.is_valid(value) for value in parsed)),
    }


def cpu_per_token(spent: dict[str, float], tokens: int) -> dict:
    """CPU ms per output token: each role's (the load generator's apart), the front
    door's and the serving path's (engine to proxy)."""
    return {
        "cpu_ms_per_token": cpu.own_ms_per_token(spent, tokens),
        "front_door_cpu_ms_per_token": cpu.front_door_ms_per_token(spent, tokens),
        "serving_cpu_ms_per_token": cpu.ms_per_token(spent, tokens, cpu.SERVING_PATH),
    }


def pooled(condition: str, rounds: list[dict], schema: dict) -> dict:
    """One condition's figures over all its rounds: their records and seconds together,
    their CPU seconds summed."""
    mine = [r for r in rounds if r["condition"] == condition]
    records = [rec for r in mine for rec in r["records"]]
    seconds = sum(r["seconds"] for r in mine)
    spent: dict[str, float] = {}
    for r in mine:
        for role, s in r["cpu_s"].items():
            spent[role] = round(spent.get(role, 0.0) + s, 2)
    tokens = sum(rec.tokens for rec in records if rec.ok)
    return {
        "condition": condition,
        "rounds": len(mine),
        **summarize(records, seconds),
        **answer_figures(records, schema),
        "cpu_s": spent,
        **cpu_per_token(spent, tokens),
    }


def ratios(free: dict, constrained: dict) -> dict:
    """json_schema over free: output tokens/s, ITL p50, TPOT p50, TTFT p50, tokens per
    answer, and the engine's CPU per token where both have it."""
    keys = {
        "tokens_per_s": "output_tokens_per_s",
        "itl_p50": "itl_p50_ms",
        "tpot_p50": "tpot_p50_ms",
        "ttft_p50": "ttft_p50_ms",
        "tokens_per_answer": "tokens_per_answer",
    }
    out = {name: _over(constrained[key], free[key]) for name, key in keys.items()}
    engine = [c.get("cpu_ms_per_token", {}).get("engine") for c in (constrained, free)]
    if all(engine):
        out["engine_cpu_per_token"] = engine[0] / engine[1]
    return out


def _over(a: float, b: float) -> float:
    return a / b if b else float("nan")


def comparable_lengths(ratio: dict, tolerance: float = 0.2) -> bool:
    """Whether both conditions' answers are about as long (within ``tolerance``): only
    then does tokens/s compare the same work (in a closed loop a shorter answer spends
    a larger share of its time waiting and in prefill)."""
    return abs(ratio["tokens_per_answer"] - 1) <= tolerance


def check_targets(ratio: dict, max_cost: float = 0.10) -> list[dict]:
    """The constraint's cost against the target: tokens/s at least ``1 - max_cost`` of
    free's, ITL p50 at most ``1 + max_cost`` of free's (a NaN fails)."""
    tokens, itl = ratio["tokens_per_s"], ratio["itl_p50"]
    return [
        _check("json_schema/free output tokens/s", tokens, f">= {1 - max_cost:.2f}",
               tokens >= 1 - max_cost),
        _check("json_schema/free ITL p50", itl, f"<= {1 + max_cost:.2f}", itl <= 1 + max_cost),
    ]  # fmt: skip


def _check(name: str, value: float, target: str, passed: bool) -> dict:
    return {"name": name, "value": value, "target": target, "pass": bool(passed)}


def _median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def compile_times(tokenizer_dir: Path, vocab_size: int, schemas, repeats: int) -> dict:
    """Milliseconds (medians of ``repeats``) to make a :class:`GuideCompiler` over the
    tokenizer, to compile a schema it has not seen (cold), the same schema again
    (cached), and :func:`tritonllm.guided.grammar`'s check alone. ``schemas(i)``
    gives repeat ``i``'s schema (each repeat's new to any cache)."""
    import xgrammar  # noqa: F401  (its import, ~2 s, is not a compile)

    from tritonllm.guided import GuideCompiler, grammar

    timings: dict[str, list[float]] = {"setup": [], "cold": [], "cached": [], "check": []}
    for i in range(repeats):
        text = json.dumps(schemas(i))
        start = time.perf_counter()
        compiler = GuideCompiler.from_tokenizer_dir(tokenizer_dir, vocab_size)
        timings["setup"].append(time.perf_counter() - start)
        for key in ("cold", "cached"):
            start = time.perf_counter()
            compiler.compile("json_schema", text)
            timings[key].append(time.perf_counter() - start)
        start = time.perf_counter()
        grammar("json_schema", text)
        timings["check"].append(time.perf_counter() - start)
    return {
        "fields": len(schemas(0)["properties"]),
        "schema_bytes": len(json.dumps(schemas(0))),
        **{f"{key}_ms": _median_ms(values) for key, values in timings.items()},
        "cold_first_ms": 1000 * timings["cold"][0],
        "repeats": repeats,
    }


def vocab_size(repository: Path) -> int:
    return int(json.loads((checkpoint_dir(repository) / "config.json").read_text())["vocab_size"])


async def run_rounds(url: str, args, prompts: list[ChatPrompt]) -> list[dict]:
    """The conditions alternated ``args.rounds`` times after a warm-up of each (first
    loads, connections, the schema's compile in the engine)."""
    targets = {
        "free": ChatTarget("free", url, MODEL, args.temperature, min_tokens=args.free_min_tokens),
        "json_schema": ChatTarget(
            "json_schema", url, MODEL, args.temperature, response_format(PERSON_SCHEMA)
        ),
    }
    for target in targets.values():
        await run_level(target, chat_prompts(4, seed=args.seed + 1000), 4, 16)
    rounds = []
    for round_ in range(args.rounds):
        for condition in CONDITIONS:
            before = cpu.snapshot()
            records, seconds = await run_level(
                targets[condition], prompts, args.streams, args.max_tokens
            )
            spent = cpu.by_role(before, cpu.snapshot(), client_pid=os.getpid())
            figures = summarize(records, seconds)
            rounds.append(
                {"round": round_, "condition": condition, "records": records, "seconds": seconds,
                 "cpu_s": spent, **figures, **answer_figures(records, PERSON_SCHEMA)}
            )  # fmt: skip
            console.log(
                f"round {round_} {condition:>11}: {figures['output_tokens_per_s']:6.1f} tok/s  "
                f"ITL p50 {figures['itl_p50_ms']:6.1f} ms  TTFT p50 "
                f"{figures['ttft_p50_ms']:6.0f} ms  errors {figures['errors']}"
                + (f"  {figures['first_errors']}" if figures["first_errors"] else "")
            )
            if not figures["completed"]:
                raise RuntimeError(f"{condition} answered nothing: {figures['first_errors']}")
    for target in targets.values():
        await target.aclose()
    return rounds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.structured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--streams", type=int, default=16, help="concurrent streams")
    p.add_argument("--requests-per-stream", type=int, default=2, help="per round and condition")
    p.add_argument("--rounds", type=int, default=3, help="of each condition, alternated")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--free-min-tokens",
        type=int,
        default=0,
        help="min_tokens of the free condition's answers (0: none): as long as the JSON "
        "answers, tokens/s compares the same work",
    )
    p.add_argument("--seed", type=int, default=0, help="of the prompts and their seeds")
    p.add_argument("--max-cost", type=float, default=0.10, help="the target: 0.10 is 10%%")
    p.add_argument("--schema-fields", type=int, default=20, help="of the compile-time schema")
    p.add_argument("--compile-repeats", type=int, default=5)
    p.add_argument(
        "--serve-mode",
        choices=SERVE_MODES,
        default="throughput",
        help="throughput: as make run ships it; default: Ray Serve as it comes",
    )
    p.add_argument(
        "--repository",
        type=Path,
        default=ROOT / "model_repository",
        help="a built model repository (torch or null target: its hf_model has the tokenizer)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench-structured")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    from serve.engines.triton.launcher import free_port

    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    repository = args.repository.resolve()
    tokenizer_dir, vocab = checkpoint_dir(repository), vocab_size(repository)
    console.log(f"compile times over {tokenizer_dir} (vocabulary {vocab})")
    compile_figures = [
        {"schema": f"generated, {args.schema_fields} fields"}
        | compile_times(
            tokenizer_dir, vocab, lambda i: wide_schema(args.schema_fields, i), args.compile_repeats
        ),
        {"schema": "the bench's person schema"}
        | compile_times(tokenizer_dir, vocab, lambda _: PERSON_SCHEMA, args.compile_repeats),
    ]
    prompts = chat_prompts(args.streams * args.requests_per_stream, args.seed)
    config = stack_config(repository, free_port(), args.streams, 0)
    console.log(f"starting the stack over {repository}")
    with serve_run(config, args.out, args.serve_mode, ready_paths=("/v1/models",)) as url:
        rounds = asyncio.run(run_rounds(url, args, prompts))
    conditions = [pooled(c, rounds, PERSON_SCHEMA) for c in CONDITIONS]
    ratio = ratios(*conditions)
    host = machine()
    data = {
        "command": " ".join(
            ["python -m bench.structured", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": host,
        "settings": {k: str(v) for k, v in vars(args).items()} | {"vocab_size": vocab},
        "schema": PERSON_SCHEMA,
        "conditions": conditions,
        "ratios": ratio,
        "targets": check_targets(ratio, args.max_cost),
        "comparable_lengths": comparable_lengths(ratio),
        "compile": compile_figures,
        "rounds": [{k: v for k, v in r.items() if k != "records"} for r in rounds],
        "examples": {
            c: [r.text for r in rounds[i]["records"][:3]] for i, c in enumerate(CONDITIONS)
        },
    }
    (args.out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    console.log(f"wrote {args.out / 'results.json'}")
    print_report(data, args, host)
    return 0


def print_report(data: dict, args, host: dict) -> None:
    for check in data["targets"]:
        console.print(
            f"{'PASS' if check['pass'] else 'MISS'}  {check['name']}: {check['value']:.3f} "
            f"(target {check['target']})"
        )
    if not data["comparable_lengths"]:
        free, constrained = (c["tokens_per_answer"] for c in data["conditions"])
        console.print(
            f"NOTE  the answers differ in length ({free:.1f} free, {constrained:.1f} "
            "json_schema tokens): tokens/s compares different work; ITL, TPOT and CPU per "
            "token are per token (--free-min-tokens evens the lengths)"
        )
    console.print(compile_table(data["compile"]))
    title = (
        f"make bench-structured: {args.streams} streams, max_tokens {args.max_tokens}, "
        f"temperature {args.temperature:g}, {args.rounds} rounds each; "
        f"{host['cores']} cores, {host['cpu']}"
    )
    console.print(conditions_table(data["conditions"], data["ratios"], title))


def compile_table(rows: list[dict]) -> Table:
    table = Table(title="json_schema compile time, ms (medians)")
    columns = (
        "schema", "bytes", "compiler setup", "cold compile", "cold, first in process",
        "cached", "grammar() check",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "schema" else "right")
    for r in rows:
        table.add_row(
            r["schema"],
            str(r["schema_bytes"]),
            *(f"{r[k]:.3f}" for k in ("setup_ms", "cold_ms", "cold_first_ms", "cached_ms")),
            f"{r['check_ms']:.3f}",
        )
    return table


def conditions_table(conditions: list[dict], ratio: dict, title: str) -> Table:
    table = Table(title=title)
    columns = (
        "condition", "out tok/s", "ITL p50 ms", "ITL p99 ms", "TPOT p50 ms", "TTFT p50 ms",
        "tok/answer",
        "stop", "JSON", "schema-valid", "err", "engine CPU ms/tok", "serving CPU ms/tok",
    )  # fmt: skip
    for column in columns:
        left = column == "condition"
        table.add_column(column, justify="left" if left else "right", no_wrap=left)
    for c in conditions:
        engine = c["cpu_ms_per_token"].get("engine")
        serving = c["serving_cpu_ms_per_token"]
        table.add_row(
            c["condition"],
            f"{c['output_tokens_per_s']:.1f}",
            *(f"{c[k]:.1f}" for k in ("itl_p50_ms", "itl_p99_ms", "tpot_p50_ms")),
            f"{c['ttft_p50_ms']:.0f}",
            f"{c['tokens_per_answer']:.1f}",
            *(f"{100 * c[k]:.0f}%" for k in ("stop_share", "json_share", "schema_valid_share")),
            str(c["errors"]),
            "" if engine is None else f"{engine:.2f}",
            "" if serving is None else f"{serving:.2f}",
        )
    engine_ratio = ratio.get("engine_cpu_per_token")
    table.add_row(
        "json/free",
        f"{ratio['tokens_per_s']:.3f}",
        f"{ratio['itl_p50']:.3f}",
        "",
        *(f"{ratio[k]:.3f}" for k in ("tpot_p50", "ttft_p50", "tokens_per_answer")),
        *([""] * 4),
        "" if engine_ratio is None else f"{engine_ratio:.3f}",
        "",
    )
    return table


if __name__ == "__main__":
    sys.exit(main())
