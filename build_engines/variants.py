"""A model repository for a pool of variants (Serve's model multiplexing).

Several fine-tuned checkpoints of one base model share one tokenizer, so they share
``preprocessing`` and ``postprocessing``; each variant gets its own engine step
``tensorrt_llm-<variant>`` and its own ``ensemble-<variant>`` wiring the three. The
Serve replica starts Triton with the shared steps only (explicit model control) and
loads a variant's ensemble, which loads its engine, on the variant's first request.

    python -m build_engines --repository build/variants \\
        --variant support=/ckpt/support --variant legal=/ckpt/legal

The configs are filled from the same templates as the single-model repository and
renamed as protobuf messages (not by text substitution), so they stay valid configs.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build_engines import templates
from build_engines.repository import ModelRepository, write_if_changed
from build_engines.targets.base import BuildReport, EngineOptions, Reporter
from build_engines.targets.torch_engine import (
    RAGGED,
    TOKENIZER_FILES,
    config_values,
    validate_checkpoint,
)
from tritonllm import contract
from tritonllm.tokenization import tokenizer_class_of

SHARED = (contract.PREPROCESSING, contract.POSTPROCESSING)


def parse_variants(specs: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` pairs, as given on the command line."""
    variants: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not re.match(contract.VARIANT_NAME, name):
            raise ValueError(
                f"--variant {spec!r}: write NAME=DIR, NAME of letters, digits, '.', '_', '-'"
            )
        if name in variants:
            raise ValueError(f"--variant {name} is given twice")
        variants[name] = Path(path)
    return variants


def _tokenizer_digest(checkpoint: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = checkpoint / name
        if path.is_file():
            digest.update(name.encode() + path.read_bytes())
    return digest.hexdigest()


def check_one_tokenizer(checkpoints: dict[str, Path]) -> None:
    """Variants share pre/postprocessing, so they must share their tokenizer."""
    digests = {name: _tokenizer_digest(path) for name, path in checkpoints.items()}
    if len(set(digests.values())) > 1:
        first = next(iter(digests))
        differ = [n for n, d in digests.items() if d != digests[first]]
        raise ValueError(
            f"variants {', '.join(differ)} have another tokenizer than {first}: a pool of "
            "variants shares one tokenizer (fine-tunes of one base model)"
        )


def _renamed(text: str, name: str, engine: str | None = None) -> str:
    """A filled config with its model name (and an ensemble's engine step) replaced."""
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    config.name = name
    for step in config.ensemble_scheduling.step:
        if step.model_name == contract.TENSORRT_LLM and engine is not None:
            step.model_name = engine
    return text_format.MessageToString(config)


def build_variants(
    source: ModelRepository,
    root: Path,
    variants: dict[str, Path],
    options: EngineOptions,
    reporter: Reporter,
) -> BuildReport:
    """Write the pool's repository under ``root`` (replaced), from ``source``'s templates
    and adapters (the project's ``model_repository``)."""
    start = time.monotonic()
    if root.resolve() == source.root:
        raise ValueError(
            f"--variant builds a repository of its own: pass --repository <another dir> "
            f"than {source.root}, which holds the templates it is built from"
        )
    checkpoints = {name: validate_checkpoint(path) for name, path in variants.items()}
    check_one_tokenizer(checkpoints)
    reporter.stage(f"writing a repository for {len(checkpoints)} variants")
    shutil.rmtree(root, ignore_errors=True)
    repo = ModelRepository(root)
    first = next(iter(checkpoints.values()))
    values = config_values(options, str(first), tokenizer_class=tokenizer_class_of(str(first)))
    for model in SHARED:
        shutil.copytree(
            source.model_dir(model),
            repo.model_dir(model),
            ignore=shutil.ignore_patterns("*.in", "config.pbtxt", "__pycache__"),
        )
        template = source.template_path(model, "torch")
        text = templates.fill(template, model, values[model], ragged=model in RAGGED)
        write_if_changed(repo.config_path(model), text)
    for name, checkpoint in checkpoints.items():
        _write_variant(source, repo, name, checkpoint, options)
    repo.write_manifest({"variants": {n: str(p) for n, p in checkpoints.items()}})
    ref = ", ".join(f"{n}={p}" for n, p in checkpoints.items())
    seconds = time.monotonic() - start
    return BuildReport("torch", ref, str(first), False, seconds, repo.size_bytes())


def _write_variant(
    source: ModelRepository,
    repo: ModelRepository,
    name: str,
    checkpoint: Path,
    options: EngineOptions,
) -> None:
    values = config_values(options, str(checkpoint))
    engine, ensemble = contract.variant_engine(name), contract.variant_ensemble(name)
    adapter = source.engine_version_dir / "model.py"
    (repo.model_dir(engine) / "1").mkdir(parents=True)
    shutil.copy2(adapter, repo.model_dir(engine) / "1" / "model.py")
    text = templates.fill(
        source.template_path(contract.TENSORRT_LLM, "torch"),
        contract.TENSORRT_LLM,
        values[contract.TENSORRT_LLM],
    )
    write_if_changed(repo.config_path(engine), _renamed(text, engine))
    (repo.model_dir(ensemble) / "1").mkdir(parents=True)
    text = templates.fill(
        source.template_path(contract.ENSEMBLE, "torch"),
        contract.ENSEMBLE,
        values[contract.ENSEMBLE],
    )
    write_if_changed(repo.config_path(ensemble), _renamed(text, ensemble, engine))
