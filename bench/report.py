"""``make bench``'s report: ratios, the performance targets, the table, the plot.

Input is the list of per-level results the load generator produced, each a dict with
``system`` and ``concurrency`` beside :func:`bench.loadgen.summarize`'s figures.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

# (key, label in the table and the plot)
SYSTEMS = {
    "pipeline": "(a) Serve + transformers pipeline",
    "triton": "(b) Triton alone (gRPC)",
    "stack": "(c) this stack (Serve + Triton)",
    "rayllm": "(d) Ray Serve LLM + vLLM",
    "stack-vllm": "(e) this stack + vLLM",
}


def _by(results: list[dict], system: str) -> dict[int, dict]:
    return {r["concurrency"]: r for r in results if r["system"] == system}


def ratios(results: list[dict]) -> list[dict]:
    """Per concurrency: (c)/(a), (c)/(b) and (c)/(d) output tokens/s, what the front door
    adds to (b)'s p50 TTFT, and the stack's p50 TTFT less (d)'s; (e)/(d) and (e)'s p50
    TTFT less (d)'s: the stack's serving layer against Ray Serve LLM's, both over vLLM."""
    stack, pipeline, triton, rayllm, stack_vllm = (
        _by(results, s) for s in ("stack", "pipeline", "triton", "rayllm", "stack-vllm")
    )
    rows = []
    for c in sorted(stack.keys() | stack_vllm.keys()):
        row = {"concurrency": c}
        if c in stack and c in pipeline:
            row["stack_over_pipeline"] = _ratio(stack[c], pipeline[c])
        if c in stack and c in triton:
            row["stack_over_triton"] = _ratio(stack[c], triton[c])
            row["ttft_p50_added_ms"] = stack[c]["ttft_p50_ms"] - triton[c]["ttft_p50_ms"]
        if c in stack and c in rayllm:
            row["stack_over_rayllm"] = _ratio(stack[c], rayllm[c])
            row["ttft_p50_vs_rayllm_ms"] = stack[c]["ttft_p50_ms"] - rayllm[c]["ttft_p50_ms"]
        if c in stack_vllm and c in rayllm:
            row["stack_vllm_over_rayllm"] = _ratio(stack_vllm[c], rayllm[c])
            row["ttft_p50_stack_vllm_vs_rayllm_ms"] = (
                stack_vllm[c]["ttft_p50_ms"] - rayllm[c]["ttft_p50_ms"]
            )
        rows.append(row)
    return rows


def _ratio(a: dict, b: dict) -> float:
    return a["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else 0.0


def check_targets(results: list[dict], max_concurrency: int = 64) -> list[dict]:
    """The targets the stack is held to on 2-core machines, each
    ``{name, value, target, pass}``: against Triton alone, at most 5% fewer tokens/s
    (every level) and 3 ms more TTFT p50 at one client; 5x the pipeline's tokens/s at 16;
    over vLLM, 1.1x Ray Serve LLM's tokens/s at 64 and a lower TTFT p50 at one client;
    no errors."""
    targets = []
    for row in ratios(results):
        c = row["concurrency"]
        if c == 16 and "stack_over_pipeline" in row:
            value = row["stack_over_pipeline"]
            targets.append(_target(f"(c)/(a) tokens/s at c={c}", value, ">= 5x", value >= 5))
        if "stack_over_triton" in row:
            cost = 1 - row["stack_over_triton"]
            targets.append(
                _target(f"front door cost, tokens/s at c={c}", cost, "<= 5%", cost <= 0.05)
            )
        if c == 1 and "ttft_p50_added_ms" in row:
            added = row["ttft_p50_added_ms"]
            targets.append(
                _target(f"front door TTFT p50 added at c={c}", added, "<= 3 ms", added <= 3)
            )
        if c == 64 and "stack_vllm_over_rayllm" in row:
            value = row["stack_vllm_over_rayllm"]
            targets.append(_target(f"(e)/(d) tokens/s at c={c}", value, ">= 1.1x", value >= 1.1))
        if c == 1 and "ttft_p50_stack_vllm_vs_rayllm_ms" in row:
            value = row["ttft_p50_stack_vllm_vs_rayllm_ms"]
            targets.append(_target(f"(e) TTFT p50 less (d)'s at c={c}", value, "< 0 ms", value < 0))
    for system, label in (("stack", "(c)"), ("stack-vllm", "(e)")):
        levels = [
            r for r in results if r["system"] == system and r["concurrency"] <= max_concurrency
        ]
        if levels:
            errors = sum(r["errors"] for r in levels)
            targets.append(
                _target(f"{label} errors up to c={max_concurrency}", errors, "0", errors == 0)
            )
    return targets


def _target(name: str, value: float, target: str, passed: bool) -> dict:
    return {"name": name, "value": value, "target": target, "pass": bool(passed)}


def format_target(t: dict) -> str:
    value = t["value"]
    if "cost" in t["name"]:
        shown = f"{100 * value:.1f}%"
    elif "x" in t["target"]:
        shown = f"{value:.2f}x"
    elif "ms" in t["target"]:
        shown = f"{value:+.1f} ms"
    else:
        shown = f"{value:g}"
    return f"{'PASS' if t['pass'] else 'MISS'}  {t['name']}: {shown} (target {t['target']})"


def table(results: list[dict], title: str) -> Table:
    table = Table(title=title)
    columns = (
        "system", "conc.", "req/s", "out tok/s", "TTFT p50", "p90", "p99",
        "ITL p50", "p99", "e2e p50", "p99", "err", "503",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "system" else "right")
    order = {key: i for i, key in enumerate(SYSTEMS)}
    for r in sorted(results, key=lambda r: (r["concurrency"], order.get(r["system"], 9))):
        table.add_row(
            r["system"],
            str(r["concurrency"]),
            f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:.0f}",
            *(f"{r[k]:.0f}" for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")),
            *(f"{r[k]:.1f}" for k in ("itl_p50_ms", "itl_p99_ms")),
            *(f"{r[k]:.0f}" for k in ("e2e_p50_ms", "e2e_p99_ms")),
            str(r["errors"]),
            str(r["rejected_503"]),
        )
    return table


def markdown_table(results: list[dict]) -> str:
    """The same table as Markdown, for the README (times in ms)."""
    head = (
        "| system | conc. | req/s | out tok/s | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | "
        "ITL p99 | e2e p50 | e2e p99 | errors | 503 |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    order = {key: i for i, key in enumerate(SYSTEMS)}
    rows = sorted(results, key=lambda r: (r["concurrency"], order.get(r["system"], 9)))
    return head + "".join(
        f"| {r['system']} | {r['concurrency']} | {r['requests_per_s']:.2f} | "
        f"{r['output_tokens_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
        f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
        f"{r['e2e_p50_ms']:.0f} | {r['e2e_p99_ms']:.0f} | {r['errors']} | "
        f"{r['rejected_503']} |\n"
        for r in rows
    )


def cpu_markdown(results: list[dict]) -> str:
    """CPU ms per output token by role, one column per (system, concurrency) level that
    has ``cpu_ms_per_token`` (each system's own processes only), as Markdown."""
    order = {key: i for i, key in enumerate(SYSTEMS)}
    levels = sorted(
        (r for r in results if r.get("cpu_ms_per_token")),
        key=lambda r: (r["concurrency"], order.get(r["system"], 9)),
    )
    roles = sorted({role for r in levels for role in r["cpu_ms_per_token"]})
    head = "| CPU ms/token | " + " | ".join(f"{r['system']} c={r['concurrency']}" for r in levels)
    lines = [head + " |", "|---|" + "---:|" * len(levels)]
    for role in roles:
        cells = (r["cpu_ms_per_token"].get(role) for r in levels)
        lines.append(
            f"| {role} | " + " | ".join("" if v is None else f"{v:.2f}" for v in cells) + " |"
        )
    totals = (sum(r["cpu_ms_per_token"].values()) for r in levels)
    lines.append("| **total** | " + " | ".join(f"**{v:.2f}**" for v in totals) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path, title: str) -> None:
    """Output tokens/s and TTFT p50 against concurrency, one line per system."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in SYSTEMS.items():
        levels = sorted(_by(results, key).items())
        if not levels:
            continue
        xs = [c for c, _ in levels]
        throughput.plot(xs, [r["output_tokens_per_s"] for _, r in levels], "o-", label=label)
        ttft.plot(xs, [r["ttft_p50_ms"] for _, r in levels], "o-", label=label)
    throughput.set(ylabel="output tokens/s", title="throughput")
    ttft.set(ylabel="time to first token p50 (ms)", title="time to first token", yscale="log")
    concurrencies = sorted({r["concurrency"] for r in results})
    for ax in (throughput, ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("concurrent clients")
        ax.grid(True, which="both", alpha=0.3)
    throughput.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
