"""The torch target: a Hugging Face checkpoint served by tritonllm.engine."""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from pathlib import Path

from build_engines import default_model, templates
from build_engines.repository import ModelRepository, write_if_changed
from build_engines.targets.base import (
    BuildReport,
    BuildSpec,
    DynamicBatching,
    EngineOptions,
    Reporter,
)
from tritonllm import contract
from tritonllm.tokenization import tokenizer_class_of

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
# A checkpoint has a tokenizer when it holds one of these (trtllm copies more files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


# Python-backend steps that read each request's tensors apart, so a dynamic batch may
# mix shapes (stop words of different lengths, streamed and whole token batches).
RAGGED = (contract.PREPROCESSING, contract.POSTPROCESSING)

# The torch engine's LoRA adapters: TensorRT-LLM's max_lora_rank default, and an adapter
# cache that holds ~50 adapters of rank 64 on all 7 projections of the default model.
MAX_LORA_RANK = 64
LORA_CACHE_HOST_MEMORY_BYTES = 256 * 2**20


class CheckpointError(ValueError):
    pass


def validate_checkpoint(model_dir: Path) -> Path:
    """A local causal-LM checkpoint transformers can load, or an error naming the fix."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_dir = model_dir.expanduser().resolve()
    if not model_dir.is_dir():
        raise CheckpointError(
            f"MODEL={model_dir} does not exist: pass a local Hugging Face checkpoint directory "
            "(this build never downloads weights)"
        )
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(
            f"{model_dir} has no config.json: MODEL must be a Hugging Face checkpoint directory "
            "(the folder save_pretrained() writes)"
        )
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CheckpointError(
            f"{model_dir}: model_type {config.model_type!r} is not a causal LM transformers "
            "can generate with; the torch target serves decoder-only models "
            "(llama, mistral, qwen2, gpt2, ...)"
        )
    if not any(any(model_dir.glob(p)) for p in _WEIGHT_PATTERNS):
        raise CheckpointError(f"{model_dir} has no weights (*.safetensors or pytorch_model*.bin)")
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(
            f"{model_dir} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): "
            "save the tokenizer next to the weights"
        )
    return model_dir


def model_fingerprint(spec: BuildSpec) -> dict:
    """What identifies the checkpoint a build serves: its path, or the default model's
    description and source (a change to either rebuilds it)."""
    if spec.model:
        return {"checkpoint": str(spec.model.expanduser().resolve())}
    return {"default": default_model.describe(spec.size), "source": source_digest()}


def source_digest() -> str:
    """Changes to the default model's code rebuild it."""
    digest = hashlib.sha256()
    for module in (default_model, default_model.corpus):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


class TorchTarget:
    name = "torch"
    engine = "torch"  # what the tensorrt_llm model runs (its "engine" parameter)

    def unavailable_reason(self) -> str | None:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as exc:
            return f"{exc.name} is not installed: run `make venv` (or pip install -e .)"
        return None

    def _fingerprint(self, spec: BuildSpec) -> dict:
        model = model_fingerprint(spec)
        return {"target": self.name, "model": model, "options": asdict(spec.options)}

    def build(self, spec: BuildSpec, repo: ModelRepository, reporter: Reporter) -> BuildReport:
        """Write the default checkpoint unless it is current; configs are always refilled."""
        start = time.monotonic()
        checkpoint = validate_checkpoint(spec.model) if spec.model else repo.default_checkpoint_dir
        fingerprint = self._fingerprint(spec)
        skipped = repo.holds(fingerprint["model"], checkpoint) and not spec.force
        if not skipped:
            repo.clean()
            if not spec.model:
                default_model.write_default_model(checkpoint, spec.size, reporter)
        reporter.stage("filling the model configs")
        ref = repo.reference(checkpoint)
        self._fill_configs(spec, repo, ref, tokenizer_class_of(str(checkpoint)))
        repo.write_manifest(fingerprint)
        return BuildReport(
            self.name, ref, ref, skipped, time.monotonic() - start, repo.size_bytes()
        )

    def _fill_configs(
        self, spec: BuildSpec, repo: ModelRepository, checkpoint_ref: str, tokenizer_class: str
    ) -> None:
        values_of = config_values(spec.options, checkpoint_ref, self.engine, tokenizer_class)
        for model, values in values_of.items():
            template = repo.template_path(model, TorchTarget.name)
            text = templates.fill(template, model, values, ragged=model in RAGGED)
            write_if_changed(repo.config_path(model), text)


def tokenizer_step_values(
    triton_batch: int,
    batching: DynamicBatching,
    tokenizer_ref: str,
    preprocessing_instances: int,
    tokenizer_class: str = "",
) -> dict[str, dict]:
    """The template values of the ensemble and the pre/postprocessing steps, the same
    for every target: only the engine in the tensorrt_llm slot differs.
    ``tokenizer_class``: the tokenizer's class (tritonllm.tokenization.tokenizer_class_of),
    which the steps then load without AutoTokenizer; empty: AutoTokenizer's choice."""
    common = {"triton_max_batch_size": triton_batch}
    dynamic_batching = templates.render_dynamic_batching(batching, triton_batch)
    return {
        contract.ENSEMBLE: common,
        contract.PREPROCESSING: {
            **common,
            "dynamic_batching": dynamic_batching,
            "tokenizer_dir": tokenizer_ref,
            "tokenizer_class": tokenizer_class,
            "add_special_tokens": "true",
            "preprocessing_instance_count": preprocessing_instances,
        },
        contract.POSTPROCESSING: {
            **common,
            "dynamic_batching": dynamic_batching,
            "tokenizer_dir": tokenizer_ref,
            "tokenizer_class": tokenizer_class,
            "skip_special_tokens": "true",
        },
    }


class NullTarget(TorchTarget):
    """The null engine (``tritonllm/engine/null_engine.py``), a benchmark instrument:
    the torch target's repository, its checkpoint's tokenizer, and no model math
    (``--null-step-ms`` per engine step). ``make bench-capacity`` builds it."""

    name = "null"
    engine = "null"


def config_values(
    o: EngineOptions, checkpoint_ref: str, engine: str = "torch", tokenizer_class: str = ""
) -> dict[str, dict]:
    """The template values of the four models for a checkpoint served by the torch engine
    (or by the null engine, ``engine="null"``)."""
    common = {"triton_max_batch_size": o.triton_max_batch_size}
    steps = tokenizer_step_values(
        o.triton_max_batch_size,
        o.dynamic_batching,
        checkpoint_ref,
        o.preprocessing_instance_count,
        tokenizer_class,
    )
    return {
        **steps,
        contract.TENSORRT_LLM: {
            **common,
            "engine_dir": checkpoint_ref,
            "engine_max_batch_size": o.max_batch_size,
            "max_queue_size": o.max_queue_size,
            "max_num_tokens": o.max_num_tokens,
            "enable_chunked_context": str(o.enable_chunked_context).lower(),
            "max_seq_len": o.max_seq_len,
            "device": o.device,
            "dtype": o.dtype,
            "num_threads": o.num_threads,
            "prefix_cache_mb": o.prefix_cache_mb,
            "prefix_cache_block_size": o.prefix_cache_block_size,
            "stream_chunks_per_s": o.stream_chunks_per_s,
            "guide_compile_timeout_s": o.guide_compile_timeout_s,
            "engine": engine,
            "null_step_ms": o.null_step_ms,
            "null_answer_tokens": 0,
            "max_lora_rank": MAX_LORA_RANK,
            "lora_cache_host_memory_bytes": LORA_CACHE_HOST_MEMORY_BYTES,
        },
    }
