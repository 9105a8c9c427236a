"""The trtllm target's one config and the commands built from it.

Flags and values are those TensorRT-LLM 1.2 documents for ``trtllm-build``
(``tensorrt_llm/commands/build.py`` and ``add_plugin_argument`` in
``tensorrt_llm/plugin/plugin.py``: plugins take a dtype, ``auto`` or ``disable``;
features take ``enable``/``disable``; ``--kv_cache_type paged`` replaces the
deprecated ``--paged_kv_cache``). Tensor/pipeline parallelism is fixed at checkpoint
conversion (the checkpoint's ``mapping``), not by ``trtllm-build``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from build_engines.trtllm_lora import LoraSettings, LoraSettingsError

DEFAULT_CONFIG = Path(__file__).with_name("trtllm.yaml")

# Build settings: a change means a new engine. The rest only refill config.pbtxt.
BUILD_FIELDS = (
    "dtype",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "max_batch_size",
    "max_input_len",
    "max_seq_len",
    "max_num_tokens",
    "max_beam_width",
    "kv_cache_type",
    "remove_input_padding",
    "context_fmha",
    "gemm_plugin",
    "gpt_attention_plugin",
)
# The engine options of ``python -m build_engines`` that override the file.
CLI_OVERRIDES = (
    "max_batch_size",
    "max_queue_size",
    "max_num_tokens",
    "max_seq_len",
    "dtype",
    "enable_chunked_context",
    "stream_chunks_per_s",  # trtllm-pytorch's response thread (the C++ backend's ignore it)
)
DTYPES = ("auto", "float16", "bfloat16", "float32")
PLUGIN_DTYPES = ("auto", "float16", "bfloat16", "float32", "disable")
SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")


class SettingsError(ValueError):
    pass


_DEFAULT_LORA = LoraSettings()


@dataclass(frozen=True)
class TrtllmSettings:
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_batch_size: int = 64
    max_input_len: int = 2048
    max_seq_len: int = 4096
    max_num_tokens: int = 8192
    max_beam_width: int = 1
    kv_cache_type: str = "paged"
    remove_input_padding: bool = True
    context_fmha: bool = True
    gemm_plugin: str = "auto"
    gpt_attention_plugin: str = "auto"
    triton_max_batch_size: int = 0  # 0: the engine's max_batch_size
    max_queue_size: int = 256
    max_queue_delay_microseconds: int = 100
    kv_cache_free_gpu_mem_fraction: float = 0.85
    batch_scheduler_policy: str = "guaranteed_no_evict"
    enable_kv_cache_reuse: bool = True
    enable_chunked_context: bool = False
    exclude_input_in_output: bool = False
    stream_chunks_per_s: float = 1000.0  # trtllm-pytorch: tritonllm/response_thread.py
    # LoRA adapters (build_engines/trtllm_lora.py); None: the engine takes none.
    lora: LoraSettings | None = _DEFAULT_LORA

    @classmethod
    def load(cls, path: Path | None = None, overrides: dict | None = None) -> TrtllmSettings:
        """The YAML file (default ``build_engines/trtllm.yaml``), then ``overrides``."""
        import yaml

        path = Path(path or DEFAULT_CONFIG)
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise SettingsError(f"trtllm config {path} does not exist") from None
        if not isinstance(values, dict):
            raise SettingsError(f"{path}: expected a mapping of settings")
        return cls.from_dict({**values, **(overrides or {})}, source=str(path))

    @classmethod
    def from_dict(cls, values: dict, source: str = "trtllm settings") -> TrtllmSettings:
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise SettingsError(f"{source}: unknown setting(s) {', '.join(unknown)}")
        values = dict(values)
        if "lora" in values and not isinstance(values["lora"], LoraSettings):
            try:
                values["lora"] = LoraSettings.from_value(values["lora"], source)
            except LoraSettingsError as error:
                raise SettingsError(str(error)) from None
        for name, value in values.items():
            if name == "lora":
                continue
            if not _is_type(value, known[name]):
                raise SettingsError(f"{source}: {name} must be a {known[name]}, not {value!r}")
        settings = cls(**values)
        settings.validate(source)
        return settings

    def validate(self, source: str = "trtllm settings") -> None:
        for problem in self._problems():
            raise SettingsError(f"{source}: {problem}")

    def _problems(self):  # noqa: C901 - one flat list of independent checks
        if self.dtype not in DTYPES:
            yield f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}"
        for name in ("gemm_plugin", "gpt_attention_plugin"):
            if getattr(self, name) not in PLUGIN_DTYPES:
                yield f"{name} must be one of {', '.join(PLUGIN_DTYPES)}"
        # The tensorrtllm backend's inflight_fused_batching runs only engines built
        # with packed inputs, the paged KV cache and the attention plugin.
        if self.kv_cache_type != "paged":
            yield "kv_cache_type must be paged (in-flight batching needs the paged KV cache)"
        if not self.remove_input_padding:
            yield "remove_input_padding must be true (in-flight batching packs the inputs)"
        if self.gpt_attention_plugin == "disable":
            yield "gpt_attention_plugin cannot be disable (in-flight batching needs it)"
        if min(self.tensor_parallel_size, self.pipeline_parallel_size, self.max_beam_width) < 1:
            yield "tensor/pipeline parallel sizes and max_beam_width must be >= 1"
        if self.max_seq_len and self.max_input_len >= self.max_seq_len:
            yield (
                f"max_input_len ({self.max_input_len}) must be below max_seq_len "
                f"({self.max_seq_len}): the rest is room for the output"
            )
        if self.max_num_tokens < self.max_input_len and not self.enable_chunked_context:
            yield (
                f"max_num_tokens ({self.max_num_tokens}) < max_input_len ({self.max_input_len}): "
                "a long prompt could never be scheduled; raise it or enable_chunked_context"
            )
        if self.max_batch_size < 1 or not 0 <= self.triton_max_batch_size <= self.max_batch_size:
            yield (
                f"triton_max_batch_size ({self.triton_max_batch_size}) must be at most the "
                f"engine's max_batch_size ({self.max_batch_size}, itself >= 1)"
            )
        if not 0.0 < self.kv_cache_free_gpu_mem_fraction <= 1.0:
            yield "kv_cache_free_gpu_mem_fraction must be in (0, 1]"
        if self.batch_scheduler_policy not in SCHEDULER_POLICIES:
            yield f"batch_scheduler_policy must be one of {', '.join(SCHEDULER_POLICIES)}"
        if self.paged_context_fmha and not self.context_fmha:
            yield (
                "enable_kv_cache_reuse and enable_chunked_context run on the paged context "
                "FMHA: set context_fmha: true, or turn both off"
            )
        if self.max_queue_size < 0 or self.max_queue_delay_microseconds < 0:
            yield "max_queue_size and max_queue_delay_microseconds must be >= 0"
        if self.stream_chunks_per_s < 0:
            yield "stream_chunks_per_s must be >= 0 (0: no budget)"

    @property
    def triton_batch(self) -> int:
        """Triton's max_batch_size for every model of the repository."""
        return self.triton_max_batch_size or self.max_batch_size

    @property
    def paged_context_fmha(self) -> bool:
        """``--use_paged_context_fmha``: KV cache block reuse and chunked context both
        need it (TensorRT-LLM's kv-cache-reuse and chunked-context docs): prefill then
        reads cached or earlier-chunk keys and values from the paged cache."""
        return self.enable_kv_cache_reuse or self.enable_chunked_context

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def build_settings(self) -> dict:
        return {
            **{name: getattr(self, name) for name in BUILD_FIELDS},
            "paged_context_fmha": self.paged_context_fmha,
            "lora": self.lora.build_settings() if self.lora else None,
        }

    def template_flags(self) -> dict[str, str]:
        """The flat settings as config.pbtxt template values (booleans lower-case)."""
        return {
            f.name: str(getattr(self, f.name)).lower()
            if isinstance(getattr(self, f.name), bool)
            else getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "lora"
        }


def _is_type(value, type_name: str) -> bool:
    """YAML values against the field types (``from __future__`` makes them strings)."""
    if type_name == "bool":
        return isinstance(value, bool)
    if type_name == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)


def _switch(on: bool) -> str:
    return "enable" if on else "disable"


def convert_command(settings: TrtllmSettings, model_dir: Path, checkpoint_dir: Path) -> list[str]:
    """HF checkpoint -> TensorRT-LLM checkpoint (``build_engines.trtllm_convert``)."""
    return [
        sys.executable,
        "-m",
        "build_engines.trtllm_convert",
        "--model_dir",
        str(model_dir),
        "--output_dir",
        str(checkpoint_dir),
        "--dtype",
        settings.dtype,
        "--tp_size",
        str(settings.tensor_parallel_size),
        "--pp_size",
        str(settings.pipeline_parallel_size),
    ]


def build_command(settings: TrtllmSettings, checkpoint_dir: Path, engine_dir: Path) -> list[str]:
    """``trtllm-build`` for the tensorrtllm backend's in-flight batching."""
    command = [
        "trtllm-build",
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--output_dir",
        str(engine_dir),
        "--max_batch_size",
        str(settings.max_batch_size),
        "--max_input_len",
        str(settings.max_input_len),
        "--max_num_tokens",
        str(settings.max_num_tokens),
        "--max_beam_width",
        str(settings.max_beam_width),
        "--kv_cache_type",
        settings.kv_cache_type,
        "--remove_input_padding",
        _switch(settings.remove_input_padding),
        "--context_fmha",
        _switch(settings.context_fmha),
        "--gemm_plugin",
        settings.gemm_plugin,
        "--gpt_attention_plugin",
        settings.gpt_attention_plugin,
    ]
    if settings.max_seq_len:  # else trtllm-build takes the model's context length
        command += ["--max_seq_len", str(settings.max_seq_len)]
    if settings.paged_context_fmha:
        command += ["--use_paged_context_fmha", "enable"]
    if settings.lora is not None:
        command += settings.lora.build_flags()
    return command


def engine_mismatch(engine_dir: Path, settings: TrtllmSettings, version: str) -> str | None:
    """Why the engine in ``engine_dir`` does not match ``settings`` (None: it does).

    Reads the ``config.json`` that ``trtllm-build`` writes beside ``rank<N>.engine``
    (``version``, ``pretrained_config``, ``build_config``). An engine of another
    TensorRT-LLM version does not load, so the version counts too.
    """
    try:
        engine = json.loads((engine_dir / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return f"no engine config in {engine_dir}"
    if engine.get("version") != version:
        return f"engine built by TensorRT-LLM {engine.get('version')}, this is {version}"
    for rank in range(settings.world_size):
        if not (engine_dir / f"rank{rank}.engine").exists():
            return f"rank{rank}.engine is missing"
    build = engine.get("build_config", {})
    pretrained = engine.get("pretrained_config", {})
    expected = {
        "max_batch_size": settings.max_batch_size,
        "max_input_len": settings.max_input_len,
        "max_num_tokens": settings.max_num_tokens,
        "max_beam_width": settings.max_beam_width,
    }
    if settings.max_seq_len:
        expected["max_seq_len"] = settings.max_seq_len
    for key, value in expected.items():
        if build.get(key) != value:
            return f"engine {key} is {build.get(key)}, the config says {value}"
    return _plugin_and_mapping_mismatch(build, pretrained, settings)


def _plugin_and_mapping_mismatch(build: dict, pretrained: dict, settings: TrtllmSettings):
    plugins = build.get("plugin_config", {})
    for key, want in (
        ("remove_input_padding", settings.remove_input_padding),
        ("context_fmha", settings.context_fmha),
        ("use_paged_context_fmha", settings.paged_context_fmha),
    ):
        if bool(plugins.get(key)) != want:
            return f"engine {key} is {plugins.get(key)}, the config says {want}"
    if "paged" not in str(build.get("kv_cache_type", "")).lower():
        return f"engine kv_cache_type is {build.get('kv_cache_type')}, the config says paged"
    mapping = pretrained.get("mapping", {})
    for key, value in (
        ("tp_size", settings.tensor_parallel_size),
        ("pp_size", settings.pipeline_parallel_size),
    ):
        if mapping.get(key, 1) != value:
            return f"engine {key} is {mapping.get(key, 1)}, the config says {value}"
    if settings.dtype != "auto" and pretrained.get("dtype") != settings.dtype:
        return f"engine dtype is {pretrained.get('dtype')}, the config says {settings.dtype}"
    if settings.lora is not None:
        return settings.lora.engine_mismatch(build)
    if plugins.get("lora_plugin"):
        return "engine built with the LoRA plugin, the config has lora: null"
    return None


# The trtllm.yaml settings that shape a TensorRT engine only: TensorRT-LLM's PyTorch
# backend (the trtllm-pytorch target) has no engine build and ignores them.
ENGINE_ONLY_FIELDS = (
    "kv_cache_type",
    "remove_input_padding",
    "context_fmha",
    "gemm_plugin",
    "gpt_attention_plugin",
)
_CAPACITY_POLICIES = {
    "guaranteed_no_evict": "GUARANTEED_NO_EVICT",
    "max_utilization": "MAX_UTILIZATION",
}


def llm_api_options(settings: TrtllmSettings) -> dict:
    """The LLM API's options for TensorRT-LLM's PyTorch backend, from the same settings
    as the engine build (the keys of trtllm-serve's ``extra_llm_api_options`` YAML)."""
    if settings.max_beam_width != 1:
        raise SettingsError("max_beam_width must be 1 for the trtllm-pytorch target")
    options = {
        "tensor_parallel_size": settings.tensor_parallel_size,
        "pipeline_parallel_size": settings.pipeline_parallel_size,
        "dtype": settings.dtype,
        "max_batch_size": settings.max_batch_size,
        "max_num_tokens": settings.max_num_tokens,
        "enable_chunked_prefill": settings.enable_chunked_context,
        "kv_cache_config": {
            "free_gpu_memory_fraction": settings.kv_cache_free_gpu_mem_fraction,
            "enable_block_reuse": settings.enable_kv_cache_reuse,
        },
        "scheduler_config": {
            "capacity_scheduler_policy": _CAPACITY_POLICIES[settings.batch_scheduler_policy],
        },
    }
    if settings.max_seq_len:  # else the model's context length
        options["max_seq_len"] = settings.max_seq_len
    if settings.lora is not None:
        options["lora_config"] = settings.lora.llm_api_config()
    return options
