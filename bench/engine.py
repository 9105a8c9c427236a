"""``make bench-engine``: the torch engine through Triton against one-at-a-time generate().

One run, one machine, the same ~30M-parameter bench model and prompts:

1. baseline: transformers' ``generate()`` in this process, one request after another;
2. (``--with-hf-cb``) transformers' own continuous batching, ``generate_batch``;
3. this engine behind Triton's ensemble, streamed over gRPC, at each concurrency
   (closed loop: every client sends its next request when the last one ends).

Every request asks for exactly ``--output-len`` tokens (``min_tokens`` equals
``max_tokens``, so a random-weight model's early EOS cannot shorten one).
Figures: output tokens/s over the wall time of a level, time to first token
(TTFT) and inter-token latency (ITL) percentiles. Writes JSON next to the
scratch repository.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import (
    ROOT,
    build_bench_repository,
    checkpoint_dir,
    make_prompts,
    percentile,
    stop_on_sigterm,
)

console = Console(soft_wrap=True, width=132)


@dataclass
class Level:
    name: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    errors: int
    queued_ahead_p50: float = 0.0  # requests sent earlier still without a first token

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


# -- the engine through Triton ------------------------------------------------------


def one_request(url: str, prompt: str, output_len: int) -> tuple[float, float, list[float], int]:
    """Send one streamed request; return its send time, first-token time, inter-token
    gaps and the tokens received."""
    from serve.engines.triton.client import Stream, ensemble_values
    from tritonllm import contract

    values = ensemble_values(
        prompt,
        output_len,
        stream=True,
        min_tokens=output_len,
        exclude_input_in_output=True,
        return_num_output_tokens=True,
    )
    with Stream(url) as stream:
        start = time.perf_counter()
        stream.send(contract.ENSEMBLE, values, uuid.uuid4().hex)
        arrivals, tokens = [], 0
        for arrived, result in stream.timed_responses(timeout_s=300):
            if result.get_response().outputs:
                arrivals.append(arrived)
                tokens = int(result.as_numpy(contract.NUM_OUTPUT_TOKENS.name).reshape(-1)[0])
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return start, arrivals[0], gaps, tokens


def queued_ahead(spans: list[tuple[float, float]]) -> list[int]:
    """For each (sent, first token) span: requests sent before it and still waiting."""
    return [sum(1 for sent, first in spans if sent < r_sent < first) for r_sent, _ in spans]


def run_level(url: str, prompts: list[str], concurrency: int, output_len: int) -> Level:
    todo = list(prompts)
    lock = threading.Lock()
    spans, gaps, tokens, errors = [], [], [0], [0]

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop()
            try:
                sent, first, request_gaps, received = one_request(url, prompt, output_len)
            except Exception as exc:  # counted and shown; the level goes on
                console.print(f"[red]request failed:[/] {exc}")
                with lock:
                    errors[0] += 1
                continue
            with lock:
                spans.append((sent, first))
                gaps.extend(request_gaps)
                tokens[0] += received

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ttfts = [first - sent for sent, first in spans]
    return Level(
        name="engine, Triton",
        concurrency=concurrency,
        requests=len(prompts),
        output_tokens=tokens[0],
        seconds=time.perf_counter() - start,
        ttft_p50_ms=1000 * percentile(ttfts, 0.5),
        ttft_p90_ms=1000 * percentile(ttfts, 0.9),
        itl_p50_ms=1000 * percentile(gaps, 0.5),
        errors=errors[0],
        queued_ahead_p50=percentile(queued_ahead(spans), 0.5),
    )


# -- the baselines in this process --------------------------------------------------


def load_model(checkpoint: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    return model.eval(), AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)


def one_at_a_time_generate(checkpoint: Path, prompts: list[str], output_len: int) -> Level:
    """transformers' generate(), one request after another: the loop a plain server runs."""
    import torch

    model, tokenizer = load_model(checkpoint)
    ttfts, tokens = [], 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            ttfts.append(time.perf_counter() - t0)
            out = model.generate(
                ids,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            tokens += out.shape[1] - ids.shape[1]
    # The TTFT probes ran too; count only the full generations' time.
    seconds = time.perf_counter() - start - sum(ttfts)
    return Level(
        name="generate() 1 by 1",
        concurrency=1,
        requests=len(prompts),
        output_tokens=tokens,
        seconds=seconds,
        ttft_p50_ms=1000 * percentile(ttfts, 0.5),
        ttft_p90_ms=1000 * percentile(ttfts, 0.9),
        # Each full generation also paid about one TTFT before its first token.
        itl_p50_ms=1000 * (seconds - sum(ttfts)) / max(tokens - len(prompts), 1),
        errors=0,
    )


def hf_continuous_batching(checkpoint: Path, prompts: list[str], output_len: int) -> Level:
    """transformers' generate_batch (paged attention, continuous batching), all at once."""
    from transformers import GenerationConfig

    model, tokenizer = load_model(checkpoint)
    config = GenerationConfig(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
        max_batch_tokens=512,
        num_blocks=512,
        block_size=32,
    )
    inputs = [tokenizer.encode(p) for p in prompts]
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=inputs, generation_config=config)
    seconds = time.perf_counter() - start
    nan = float("nan")
    return Level(
        name="generate_batch",
        concurrency=len(prompts),
        requests=len(prompts),
        output_tokens=sum(len(o.generated_tokens) for o in outputs.values()),
        seconds=seconds,
        ttft_p50_ms=nan,
        ttft_p90_ms=nan,
        itl_p50_ms=nan,
        errors=0,
    )


# -- the report ---------------------------------------------------------------------


def report(baseline: Level, levels: list[Level], extra: list[Level]) -> Table:
    table = Table(title="torch engine through Triton vs one-at-a-time generate() (bench model)")
    for column in (
        "run",
        "conc.",
        "reqs",
        "out tok/s",
        "x generate",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "ITL p50 ms",
        "queued p50",
        "errors",
    ):
        table.add_column(column, justify="left" if column == "run" else "right")
    for level in [baseline, *extra, *levels]:
        table.add_row(
            level.name,
            str(level.concurrency),
            str(level.requests),
            f"{level.tokens_per_s:.0f}",
            f"{level.tokens_per_s / baseline.tokens_per_s:.2f}",
            f"{level.ttft_p50_ms:.0f}",
            f"{level.ttft_p90_ms:.0f}",
            f"{level.itl_p50_ms:.1f}",
            f"{level.queued_ahead_p50:.0f}",
            str(level.errors),
        )
    return table


def check_targets(baseline: Level, levels: list[Level]) -> list[str]:
    """The engine's targets at concurrency 16 (5x one-at-a-time tokens/s, a TTFT bound),
    as pass/fail lines."""
    by_c = {level.concurrency: level for level in levels}
    if 16 not in by_c or 1 not in by_c:
        return []
    c16, c1 = by_c[16], by_c[1]
    speedup = c16.tokens_per_s / baseline.tokens_per_s
    # A request waits for the prefills queued ahead of it: one decode step each.
    ttft_bound = 1.5 * c1.ttft_p50_ms + c16.queued_ahead_p50 * c16.itl_p50_ms
    return [
        f"{'PASS' if speedup >= 5 else 'MISS'} tokens/s at concurrency 16: "
        f"{speedup:.2f}x one-at-a-time generate() (target >= 5x)",
        f"{'PASS' if c16.ttft_p50_ms <= ttft_bound else 'MISS'} TTFT p50 at concurrency 16: "
        f"{c16.ttft_p50_ms:.0f} ms (bound 1.5 x {c1.ttft_p50_ms:.0f} ms + "
        f"{c16.queued_ahead_p50:.0f} queued prefills x one decode step {c16.itl_p50_ms:.0f} ms"
        f" = {ttft_bound:.0f} ms)",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels")
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--baseline-requests", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=24, help="about 1.3 tokens per word")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument(
        "--num-threads", type=int, default=0, help="engine torch threads (0: the engine's split)"
    )
    p.add_argument(
        "--with-hf-cb",
        action="store_true",
        help="also time transformers' generate_batch on 16 prompts",
    )
    p.add_argument("--scratch", type=Path, default=ROOT / "build" / "bench-engine")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    import torch

    from serve.engines.triton.launcher import TritonProcess

    args = parse_args(argv)
    levels_c = [int(c) for c in args.concurrency.split(",")]
    repository = build_bench_repository(args.scratch, args.max_batch_size, args.num_threads)
    checkpoint = checkpoint_dir(repository)
    prompts = make_prompts(max(levels_c) * args.requests_per_client + 8, args.prompt_words)
    console.log(f"torch {torch.__version__}, {torch.get_num_threads()} threads; baseline")
    baseline = one_at_a_time_generate(
        checkpoint, prompts[: args.baseline_requests], args.output_len
    )
    extra = []
    if args.with_hf_cb:
        console.log("transformers generate_batch")
        extra.append(hf_continuous_batching(checkpoint, prompts[:16], args.output_len))
    levels = []
    triton_log = args.scratch / "triton.log"
    with (
        triton_log.open("w") as log_file,
        TritonProcess(repository).start(timeout_s=300, stdout=log_file) as server,
    ):
        run_level(server.grpc_url, prompts[:4], 2, args.output_len)  # warm-up
        for c in levels_c:
            console.log(f"concurrency {c}")
            batch = prompts[: c * args.requests_per_client]
            levels.append(run_level(server.grpc_url, batch, c, args.output_len))
    console.print(report(baseline, levels, extra))
    for line in check_targets(baseline, levels):
        console.print(line)
    results = {
        "output_len": args.output_len,
        "prompt_words": args.prompt_words,
        "runs": [
            {**asdict(level), "tokens_per_s": level.tokens_per_s}
            for level in [baseline, *extra, *levels]
        ],
    }
    out = args.scratch / "results.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.log(f"wrote {out}; Triton's log: {triton_log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
