"""``python -m build_engines``: fill the model repository for this machine.

Examples::

    python -m build_engines                         # default model, best target here
    python -m build_engines --model ~/ckpt/llama-3.2-1b --target torch
    python -m build_engines --size bench            # the ~30M benchmark model
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from build_engines import default_model
from build_engines.repository import ModelRepository
from build_engines.targets import TARGETS, BuildSpec, EngineOptions, choose_target

console = Console(stderr=True, soft_wrap=True)
_OPTION_FIELDS = {f.name for f in dataclasses.fields(EngineOptions)}


class RichReporter:
    """Stages as log lines, long loops as a progress bar."""

    def __init__(self):
        self._progress: Progress | None = None

    def stage(self, text: str) -> None:
        self._close()
        console.log(text)

    def steps(self, total: int):
        self._close()
        self._progress = Progress(
            TextColumn("training the default model"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
            TimeElapsedColumn(),
            console=console,
        )
        task = self._progress.add_task("train", total=total, loss=float("nan"))
        self._progress.start()
        return lambda _step, loss: self._progress.update(task, advance=1, loss=loss)

    def _close(self) -> None:
        if self._progress:
            self._progress.stop()
            self._progress = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m build_engines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        default="auto",
        choices=["auto", *TARGETS],
        help="engine for the tensorrt_llm slot (auto: trtllm if installed, else torch)",
    )
    p.add_argument(
        "--model",
        type=Path,
        help="local Hugging Face checkpoint directory "
        "(default: build the project's small default model)",
    )
    p.add_argument(
        "--size",
        default="tiny",
        choices=sorted(default_model.SIZES),
        help="default model size when --model is not given",
    )
    p.add_argument(
        "--repository",
        type=Path,
        default=Path("model_repository"),
        help="the model repository to fill",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--clean", action="store_true", help="remove everything a build wrote")
    # Engine options default to None so a build can tell what was given: the torch
    # target fills the rest from EngineOptions, the trtllm target from its config file.
    defaults = EngineOptions()
    for flag, kind, text in (
        ("--max-batch-size", int, "sequences the engine runs at once"),
        ("--max-queue-size", int, "queued requests before the engine answers busy"),
        ("--max-num-tokens", int, "tokens per engine step (longer prompts are rejected)"),
        ("--max-seq-len", int, "cap on prompt + output tokens (0: the model's context)"),
        ("--num-threads", int, "torch engine threads (0: all cores prefill, all but one decode)"),
        ("--device", str, "torch engine: auto | cpu | cuda[:N]"),
        ("--dtype", str, "auto | float32 | float16 | bfloat16"),
    ):
        field = flag[2:].replace("-", "_")
        default = getattr(defaults, field)
        p.add_argument(flag, type=kind, default=None, help=f"{text} (default {default})")
    p.add_argument(
        "--trtllm-config",
        type=Path,
        default=None,
        help="trtllm target: its settings file (default build_engines/trtllm.yaml)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="build a repository for a pool of variants (model multiplexing) instead: "
        "one per fine-tuned checkpoint of one base model, repeatable (torch target)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    repo = ModelRepository(args.repository)
    try:
        if args.variant:
            return _report(_build_variants(args), repo)
        repo.check_layout()
        if args.clean:
            removed = repo.clean()
            console.log(f"removed {len(removed)} generated paths from {repo.root}")
            return 0
        target = choose_target(args.target)
        reason = target.unavailable_reason()
        if reason:
            raise RuntimeError(f"target {target.name} cannot build here: {reason}")
        overrides = {k: v for k, v in vars(args).items() if k in _OPTION_FIELDS and v is not None}
        spec = BuildSpec(
            model=args.model,
            size=args.size,
            options=EngineOptions(**overrides),
            force=args.force,
            trtllm_config=args.trtllm_config,
            overrides=overrides,
        )
        report = target.build(spec, repo, RichReporter())
    except (OSError, ValueError, RuntimeError) as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2
    return _report(report, repo)


def _build_variants(args: argparse.Namespace):
    from build_engines import variants

    overrides = {k: v for k, v in vars(args).items() if k in _OPTION_FIELDS and v is not None}
    return variants.build_variants(
        ModelRepository(Path(__file__).resolve().parent.parent / "model_repository"),
        args.repository,
        variants.parse_variants(args.variant),
        EngineOptions(**overrides),
        RichReporter(),
    )


def _report(report, repo: ModelRepository) -> int:
    verb = "up to date" if report.skipped else f"built in {report.seconds:.1f} s"
    console.print(
        f"[green]{repo.root}[/]: target {report.target}, engine_dir {report.engine_dir}, "
        f"{verb}, {report.repository_bytes / 2**20:.1f} MiB"
        + (" (FORCE=1 rebuilds)" if report.skipped else "")
    )
    return 0
