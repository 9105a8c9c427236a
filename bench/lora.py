"""``make bench-lora``: what serving LoRA adapters costs, side by side, on one stack.

One ``serve run`` of serve/config.yaml's LLM over the default model repository (or
``--repository``), one Triton replica, with a ``lora:`` section over a scratch adapter
directory. ``--adapters`` adapters (PEFT, rank ``--rank`` on ``--modules``, random
weights) are made on the repository's checkpoint in this process. Then, alternated for
``--rounds`` rounds on the same seeded prompts, ``--streams`` closed-loop streams of
``--output-len`` tokens each (``min_tokens`` = ``max_tokens``):

- ``base``: every request to the base model;
- ``adapters``: the requests spread round-robin over the adapters (each stream's next
  request names the next adapter), so every engine batch mixes them.

Output tokens/s of each (pooled over its rounds) and the ratio adapters/base, checked
against ``--target`` (0.8). Then, alone on the stack after each round, for
``--cold-per-round`` adapters: the time to first token of a *cold* adapter (copied into
the directory just before, once the listing shows it: the replica reads, packs and
checks it, and the engine takes its weights) and of the same adapter *cached* (the next
request), beside the base's; medians over all. Writes ``results.json``
under ``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from bench.capacity import stack_config
from bench.common import ROOT, make_prompts, stop_on_sigterm
from bench.loadgen import OpenAITarget, run_level, summarize
from bench.serving import MODEL, machine, serve_run
from serve.engines.triton import repository as repo
from serve.engines.triton.launcher import free_port
from serve.launch import SERVE_MODES

console = Console(soft_wrap=True, width=150)


class AdapterMix(OpenAITarget):
    """Each request names the next of ``models`` (one stream's requests cycle over them)."""

    def __init__(self, name: str, base_url: str, models: list[str]):
        super().__init__(name, base_url, models[0])
        self._models = itertools.cycle(models)

    def body(self, prompt: str, output_len: int) -> dict:
        return {**super().body(prompt, output_len), "model": next(self._models)}


def make_adapters(checkpoint: Path, out: Path, count: int, rank: int, modules: list[str]) -> None:
    """``count`` PEFT adapters of ``checkpoint``, ``adapter-0`` ... under ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
        config = LoraConfig(
            r=rank, lora_alpha=rank, target_modules=modules, init_lora_weights=False
        )
        get_peft_model(base, config).save_pretrained(out / f"adapter-{i}")


def lora_config(repository: Path, adapters: Path, port: int, streams: int) -> dict:
    config = stack_config(repository, port, streams, 0)
    model = config["applications"][0]["args"]["models"][0]
    model["lora"] = {"dynamic_lora_loading_path": str(adapters)}
    return config


async def ttft_ms(target: OpenAITarget, model: str, prompt: str, output_len: int) -> float:
    """One streamed request to ``model`` alone on the stack: its time to first token
    (over ``target``'s open connection)."""
    target.model = model
    records, _ = await run_level(target, [prompt], 1, output_len)
    (record,) = records
    if not record.ok:
        raise RuntimeError(f"{model}: {record.error}")
    return 1000 * (record.arrivals[0] - record.sent)


async def wait_listed(url: str, model: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while (await client.get(f"/v1/models/{model}")).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{model} was not listed within {timeout_s} s")
            await asyncio.sleep(0.2)


async def run(args, url: str, adapters: Path) -> dict:
    names = [f"{MODEL}:adapter-{i}" for i in range(args.adapters)]
    prompts = make_prompts(args.streams * args.requests_per_stream, args.prompt_words)
    targets = {
        "base": OpenAITarget("base", url, MODEL),
        "adapters": AdapterMix("adapters", url, names),
    }
    single = OpenAITarget("single", url, MODEL)  # the TTFTs of requests alone
    # Connections, and every adapter loaded in the replica and the engine, first.
    await run_level(targets["adapters"], make_prompts(args.adapters, 8, 99), args.streams, 4)
    await run_level(targets["base"], make_prompts(2, 8, 98), 2, 4)
    await run_level(single, make_prompts(1, 8, 97), 1, 4)
    levels, first_tokens = [], []
    for round_ in range(args.rounds):
        for system, target in targets.items():
            records, seconds = await run_level(target, prompts, args.streams, args.output_len)
            level = {"system": system, "round": round_, **summarize(records, seconds)}
            console.log(
                f"round {round_} {system:>8}: {level['output_tokens_per_s']:.1f} tok/s, "
                f"TTFT p50 {level['ttft_p50_ms']:.0f} ms, errors {level['errors']}"
            )
            levels.append(level)
        for k in range(args.cold_per_round):
            cold = f"cold-{round_}-{k}"
            shutil.copytree(adapters / "adapter-0", adapters / cold)
            # Listed first: the figure is the replica's load and the engine's upload,
            # not the ingress's listing interval.
            await wait_listed(url, f"{MODEL}:{cold}")
            # Fresh prompts of one length: no prefix cache hit helps any of the three.
            fresh = make_prompts(3, args.prompt_words, seed=1000 + 10 * round_ + k)
            first_tokens.append(
                {
                    "round": round_,
                    "cold_ms": await ttft_ms(single, f"{MODEL}:{cold}", fresh[0], args.output_len),
                    "cached_ms": await ttft_ms(
                        single, f"{MODEL}:{cold}", fresh[1], args.output_len
                    ),
                    "base_ms": await ttft_ms(single, MODEL, fresh[2], args.output_len),
                }
            )
            console.log(f"round {round_} TTFT: {first_tokens[-1]}")
    for target in [*targets.values(), single]:
        await target.aclose()
    return {"levels": levels, "first_token": first_tokens, "summary": summary(levels, first_tokens)}


def summary(levels: list[dict], first_tokens: list[dict]) -> dict:
    """Tokens/s of each system pooled over its rounds (tokens over seconds), the ratio,
    and the medians of the alone-on-the-stack TTFTs."""
    rates = {}
    for system in ("base", "adapters"):
        mine = [lv for lv in levels if lv["system"] == system]
        tokens = sum(lv["output_tokens_per_s"] * lv["seconds"] for lv in mine)
        rates[system] = tokens / sum(lv["seconds"] for lv in mine) if mine else float("nan")
    result = {
        "base_tokens_per_s": rates["base"],
        "adapters_tokens_per_s": rates["adapters"],
        "ratio": rates["adapters"] / rates["base"] if rates["base"] else float("nan"),
        "errors": sum(lv["errors"] + lv["rejected_503"] for lv in levels),
    }
    for key in ("cold_ms", "cached_ms", "base_ms"):
        values = [t[key] for t in first_tokens]
        result[f"ttft_{key}"] = statistics.median(values) if values else float("nan")
    return result


def table(result: dict, target: float) -> Table:
    s = result["summary"]
    out = Table(title="LoRA adapters vs the base, one stack")
    for column in ("figure", "value"):
        out.add_column(column)
    out.add_row("base tokens/s", f"{s['base_tokens_per_s']:.1f}")
    out.add_row("adapters tokens/s", f"{s['adapters_tokens_per_s']:.1f}")
    verdict = "met" if s["ratio"] >= target else "missed"
    out.add_row("ratio adapters/base", f"{s['ratio']:.2f} (target >= {target}: {verdict})")
    out.add_row("TTFT cold adapter (median)", f"{s['ttft_cold_ms']:.0f} ms")
    out.add_row("TTFT cached adapter (median)", f"{s['ttft_cached_ms']:.0f} ms")
    out.add_row("TTFT base (median)", f"{s['ttft_base_ms']:.0f} ms")
    out.add_row("errors", str(s["errors"]))
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m bench.lora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--modules", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=40)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--cold-per-round", type=int, default=5, help="cold adapters timed after each round"
    )
    p.add_argument("--target", type=float, default=0.8, help="adapters/base tokens/s")
    p.add_argument(
        "--serve-mode",
        choices=SERVE_MODES,
        default="throughput",
        help="throughput: as make run ships it; default: Ray Serve as it comes",
    )
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench-lora")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    args = parse_args(argv)
    args.out = args.out.resolve()
    adapters = args.out / "adapters"
    shutil.rmtree(adapters, ignore_errors=True)
    adapters.mkdir(parents=True)
    checkpoint = repo.tokenizer_dir(args.repository.resolve())
    make_adapters(checkpoint, adapters, args.adapters, args.rank, args.modules.split(","))
    config = lora_config(args.repository.resolve(), adapters, free_port(), args.streams)
    with serve_run(config, args.out, args.serve_mode, ready_paths=("/v1/models",)) as url:
        result = asyncio.run(run(args, url, adapters))
    result = {
        "command": " ".join(["python -m bench.lora", *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        **result,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    console.log(f"wrote {args.out / 'results.json'}")
    console.print(table(result, args.target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
