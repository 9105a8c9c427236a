"""What the Serve application reads from a built model repository (the configs only).

``build_app`` checks a repository before any replica starts, so a repository that
was never built fails the deployment at once with the fix, instead of each replica
starting a Triton that finds nothing to load.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from tritonllm import contract, tokenization


class RepositoryError(RuntimeError):
    pass


def read_config(repository: Path, model: str) -> model_config_pb2.ModelConfig:
    path = repository / model / "config.pbtxt"
    if not path.is_file():
        raise RepositoryError(
            f"{path} is missing: the model repository {repository} is not built; "
            "run `make engines` (or python -m build_engines --repository ...)"
        )
    try:
        return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except text_format.ParseError as error:
        raise RepositoryError(f"{path} is not a valid Triton model config: {error}") from None


def check_built(repository: Path, models: tuple[str, ...]) -> None:
    """Every model's config parses (the weights are Triton's to check, at load)."""
    if not repository.is_dir():
        raise RepositoryError(f"model repository {repository} does not exist")
    for model in models:
        read_config(repository, model)


def _parameter(config: model_config_pb2.ModelConfig, key: str) -> str:
    return config.parameters[key].string_value if key in config.parameters else ""


def flag(config: model_config_pb2.ModelConfig, key: str) -> bool:
    """A boolean parameter as the Python models read it (``tritonllm.model_args``; true
    when unset or left a template placeholder)."""
    value = _parameter(config, key)
    if value == "" or value.startswith("${"):
        return True
    return value.lower() in ("1", "true", "yes", "on")


def adds_special_tokens(repository: Path) -> bool:
    """Whether the preprocessing encodes prompts with the tokenizer's special tokens."""
    return flag(read_config(repository, contract.PREPROCESSING), "add_special_tokens")


def skips_special_tokens(repository: Path) -> bool:
    """Whether the postprocessing leaves special tokens out of the answers' text."""
    return flag(read_config(repository, contract.POSTPROCESSING), "skip_special_tokens")


def tokenizer_dir(repository: Path) -> Path:
    """The tokenizer the preprocessing model uses (one source of truth for chat templates)."""
    value = _parameter(read_config(repository, contract.PREPROCESSING), "tokenizer_dir")
    path = Path(value)
    return path if path.is_absolute() else repository / path


def load_tokenizer(repository: Path):
    """The preprocessing model's tokenizer, loaded as it loads it: by the class ``make
    engines`` recorded (no torch imported), else by AutoTokenizer's choice."""
    value = _parameter(read_config(repository, contract.PREPROCESSING), "tokenizer_class")
    recorded = "" if value.startswith("${") else value
    return tokenization.load_tokenizer(str(tokenizer_dir(repository)), recorded)


def engine_batch_size(repository: Path, engine: str = contract.TENSORRT_LLM) -> int:
    """Sequences the engine runs at once: the torch engine's and TensorRT-LLM's
    ``max_batch_size`` parameter, else the model's own ``max_batch_size``."""
    config = read_config(repository, engine)
    value = _parameter(config, "max_batch_size")
    return int(value) if value.isdigit() and int(value) > 0 else max(config.max_batch_size, 1)


def kv_event_block_size(repository: Path, engine: str = contract.TENSORRT_LLM) -> int | None:
    """The block size of the KV cache events the engine publishes when told where
    (tritonllm/engine/kv_events.py): the torch engine's prefix cache's; None for an
    engine that publishes none (TensorRT-LLM's, the null engine, a cache turned off)."""
    config = read_config(repository, engine)
    budget = _parameter(config, "prefix_cache_mb")
    if _parameter(config, "engine") == "null" or not budget or budget.startswith("${"):
        return None
    if float(budget) <= 0:
        return None
    return int(_parameter(config, "prefix_cache_block_size") or 16)


def kv_cache_fraction(repository: Path, engine: str = contract.TENSORRT_LLM) -> float | None:
    """The share of GPU memory the engine takes for its KV cache when it loads
    (TensorRT-LLM's ``kv_cache_free_gpu_mem_fraction``); None for engines without one."""
    value = _parameter(read_config(repository, engine), "kv_cache_free_gpu_mem_fraction")
    try:
        return float(value) if value else None
    except ValueError:
        return None


def serves_engine_extensions(repository: Path, engine: str = contract.TENSORRT_LLM) -> bool:
    """Whether the engine step declares our extensions of the contract (top-k log
    probabilities, the prompt's, the prefix cache's count): the torch engine does, a
    repository built for TensorRT-LLM does not (``tritonllm.contract``)."""
    declared = {output.name for output in read_config(repository, engine).output}
    return contract.TOP_LOG_PROBS.name in declared


def takes_priority(repository: Path, engine: str = contract.TENSORRT_LLM) -> bool:
    """Whether the engine step (and so its ensemble, built with it) takes a request's
    ``priority``: the torch engine's repositories built since it has one, not
    TensorRT-LLM's."""
    declared = {tensor.name for tensor in read_config(repository, engine).input}
    return contract.PRIORITY.name in declared
