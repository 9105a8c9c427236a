"""The trtllm-pytorch target: TensorRT-LLM's PyTorch backend through its LLM API (GPU boxes).

TensorRT-LLM removed its TensorRT engine backend upstream (its migration guide,
"TensorRT Backend Removed"): the PyTorch backend is then its only one, it loads a
Hugging Face checkpoint directly and there is no ``trtllm-build``. This target writes
no engine: the ``tensorrt_llm`` model becomes a Python-backend model
(``tensorrt_llm/1/llmapi.py`` over :mod:`tritonllm.llmapi`) that serves the checkpoint
with the LLM API, on the same tensor contract, so the ensemble and the Serve app are
unchanged. Its settings come from ``build_engines/trtllm.yaml`` like the engine
build's (the engine-only ones are ignored), written to ``tensorrt_llm/1/``
``llm_api_options.yaml``. The checkpoint is hard-linked (copied across file systems)
into ``tensorrt_llm/1/hf_model``, so the repository is whole on its own, like one
holding an engine: the serving containers mount only the repositories.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable

import yaml

from build_engines import default_model, templates
from build_engines.repository import ModelRepository, link_or_copy, write_if_changed
from build_engines.targets.base import BuildReport, BuildSpec, DynamicBatching, Reporter
from build_engines.targets.torch_engine import (
    RAGGED,
    model_fingerprint,
    tokenizer_step_values,
    validate_checkpoint,
)
from build_engines.targets.trtllm_engine import NOT_INSTALLED, installed_version, load_settings
from build_engines.trtllm_settings import TrtllmSettings, llm_api_options
from tritonllm import contract
from tritonllm.llmapi import OPTIONS_FILE
from tritonllm.tokenization import tokenizer_class_of

# The LLM API on the PyTorch backend is TensorRT-LLM's default from 1.0 on.
MIN_VERSION = (1, 0)
# Of our tensors of the contract, those the LLM API adapter serves: why a sequence ended
# (with its end token's log probability, where the LLM API returns it); it has no
# alternatives, prompt log probabilities or cache count to give.
EXTENSIONS = (contract.FINISH_REASON,)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class TrtllmPytorchTarget:
    name = "trtllm-pytorch"

    def __init__(self, version: Callable[[], str | None] | None = None):
        self._version = version or (lambda: installed_version())

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("tensorrt_llm") is None:
            return NOT_INSTALLED
        version = self._version() or "unknown"
        if _version_tuple(version) < MIN_VERSION:
            return (
                f"TensorRT-LLM {version} predates the PyTorch backend's LLM API "
                f"({'.'.join(map(str, MIN_VERSION))}): use TARGET=trtllm (the engine build) "
                "or an image with a newer TensorRT-LLM"
            )
        return None

    def build(self, spec: BuildSpec, repo: ModelRepository, reporter: Reporter) -> BuildReport:
        """No engine to build: the checkpoint (the default model is written once), the
        LLM API options and the configs."""
        start = time.monotonic()
        settings = load_settings(spec)
        options = llm_api_options(settings)
        source = validate_checkpoint(spec.model) if spec.model else None
        checkpoint = repo.default_checkpoint_dir  # what Triton serves, inside the repository
        if source is not None and source.is_relative_to(repo.engine_version_dir):
            raise ValueError(
                f"MODEL={source} lies among the files a build replaces "
                f"({repo.engine_version_dir}): copy the checkpoint elsewhere first"
            )
        fingerprint = self._fingerprint(spec, options)
        manifest = repo.read_manifest() or {}
        skipped = manifest == fingerprint and not spec.force
        if manifest.get("target") != self.name or spec.force:
            repo.clean()  # another target's engine, weights or configs
        if not repo.holds(fingerprint["model"], checkpoint):
            if source is None:
                default_model.write_default_model(checkpoint, spec.size, reporter)
            else:
                reporter.stage(f"linking {source} into {checkpoint}")
                files = sorted(p for p in source.rglob("*") if p.is_file())
                link_or_copy(source, checkpoint, files)
        reporter.stage("writing the LLM API options and the model configs")
        (repo.engine_version_dir / OPTIONS_FILE).write_text(
            "# Written by `make engines TARGET=trtllm-pytorch` from build_engines/trtllm.yaml:\n"
            "# TensorRT-LLM's LLM API options (tritonllm/llmapi.py passes them to LLM()).\n"
            + yaml.safe_dump(options, sort_keys=False)
        )
        ref = repo.reference(checkpoint)
        options_ = spec.options
        fill_configs(
            settings,
            repo,
            ref,
            options_.preprocessing_instance_count,
            options_.dynamic_batching,
            tokenizer_class_of(str(checkpoint)),
        )
        repo.write_manifest(fingerprint)
        return BuildReport(
            self.name, ref, ref, skipped, time.monotonic() - start, repo.size_bytes()
        )

    def _fingerprint(self, spec: BuildSpec, options: dict) -> dict:
        model = model_fingerprint(spec)
        return {
            "target": self.name,
            "model": model,
            "llm_api_options": options,
            "tensorrt_llm": self._version(),
        }


def fill_configs(
    settings: TrtllmSettings,
    repo: ModelRepository,
    checkpoint_ref: str,
    preprocessing_instances: int = 1,
    batching: DynamicBatching | None = None,
    tokenizer_class: str = "",
) -> None:
    """The four configs: pre/postprocessing read the checkpoint's tokenizer (by its
    class, where given), the tensorrt_llm model is the LLM API adapter over the same
    checkpoint."""
    common = {"triton_max_batch_size": settings.triton_batch}
    flags = settings.template_flags()
    steps = tokenizer_step_values(
        settings.triton_batch,
        batching or DynamicBatching(),
        checkpoint_ref,
        preprocessing_instances,
        tokenizer_class,
    )
    values = {
        **steps,
        contract.TENSORRT_LLM: {
            **flags,
            **common,
            "engine_dir": checkpoint_ref,
            "llm_api_options": repo.reference(repo.engine_version_dir / OPTIONS_FILE),
        },
    }
    for model, model_values in values.items():
        template = repo.template_path(model, TrtllmPytorchTarget.name)
        text = templates.fill(
            template, model, model_values, ragged=model in RAGGED, engine_extensions=EXTENSIONS
        )
        write_if_changed(repo.config_path(model), text)
