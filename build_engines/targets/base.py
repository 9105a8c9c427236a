"""What every target takes and gives back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from build_engines.repository import ModelRepository


@dataclass(frozen=True)
class DynamicBatching:
    """Triton's ``dynamic_batching`` on the Python-backend steps (preprocessing,
    postprocessing, embeddings): requests queued while a model instance is busy are
    handed to one ``execute`` together. Off, each request is its own execute."""

    enabled: bool = True
    # Batch sizes Triton sends at once when the queue holds them; empty: wait for
    # max_batch_size or the queue delay, whichever comes first.
    preferred_batch_sizes: tuple[int, ...] = ()
    # How long the oldest queued request may wait for others while a batch is short.
    max_queue_delay_us: int = 100


@dataclass(frozen=True)
class EngineOptions:
    """Serving limits written into the configs (the same names as TensorRT-LLM's)."""

    triton_max_batch_size: int = 64  # the batch dimension Triton accepts per request
    max_batch_size: int = 8  # sequences the engine runs at once
    max_queue_size: int = 256  # requests waiting for a slot before "busy"
    max_num_tokens: int = 8192  # prefill + decode tokens per engine step
    # On: a prompt over max_num_tokens is prefilled a chunk per step (off: refused).
    # Off by default, as in TensorRT-LLM: on CPU its chunks cost more than they bought
    # on make bench-prefix (docs/cpu-engine.md).
    enable_chunked_context: bool = False
    max_seq_len: int = 0  # prompt + output cap; 0: the model's max_position_embeddings
    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu
    dtype: str = "auto"  # auto: float32 on cpu, bfloat16 on cuda
    num_threads: int = 0  # engine torch threads; 0: all cores for prefill, all but one for decode
    # torch engine: MiB of keys and values kept for prompt prefixes (0: off), in blocks
    # of this many tokens (docs/prefix-caching.md)
    prefix_cache_mb: float = 256.0
    prefix_cache_block_size: int = 16
    # Responses a second the engine's requests share under load: each request's leave at
    # most every (requests in flight / this) s, with all tokens made since (0: no budget;
    # tritonllm/response_thread.py). 1,000: as serve/config.py's stream_chunks_per_s.
    stream_chunks_per_s: float = 1000.0
    # torch engine: a guide (structured outputs) whose compile takes longer is refused
    # (tritonllm/engine/guide_compiles.py); its request waits meanwhile, the batch does not.
    guide_compile_timeout_s: float = 5.0
    null_step_ms: float = 5.0  # null target (a benchmark instrument): the time of one step
    preprocessing_instance_count: int = 1
    dynamic_batching: DynamicBatching = field(default_factory=DynamicBatching)

    def __post_init__(self):
        if self.stream_chunks_per_s < 0:  # else Triton would refuse the model at load
            raise ValueError(
                f"--stream-chunks-per-s {self.stream_chunks_per_s}: give 0 (no budget) or more"
            )
        if self.guide_compile_timeout_s <= 0:
            raise ValueError(
                f"--guide-compile-timeout-s {self.guide_compile_timeout_s}: give a time in "
                "seconds above 0"
            )


@dataclass(frozen=True)
class BuildSpec:
    model: Path | None  # a local HF checkpoint dir; None builds the default model
    size: str = "tiny"  # default model size: tiny | bench
    options: EngineOptions = field(default_factory=EngineOptions)
    force: bool = False
    trtllm_config: Path | None = None  # trtllm target: its settings file (None: the default)
    overrides: dict = field(default_factory=dict)  # options given explicitly on the command line


@dataclass(frozen=True)
class BuildReport:
    target: str
    engine_dir: str
    tokenizer_dir: str
    skipped: bool
    seconds: float
    repository_bytes: int


class Reporter(Protocol):
    def stage(self, text: str) -> None: ...

    def steps(self, total: int): ...


class Target(Protocol):
    name: str

    def unavailable_reason(self) -> str | None:
        """None when this target can build here, else what is missing and the fix."""

    def build(self, spec: BuildSpec, repo: ModelRepository, reporter: Reporter) -> BuildReport: ...
