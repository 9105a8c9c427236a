"""The ``lora:`` section of ``build_engines/trtllm.yaml``: LoRA adapters on both
TensorRT-LLM targets.

One section drives three things:

- the engine build (``trtllm``): ``trtllm-build --lora_plugin auto --lora_target_modules
  ... --max_lora_rank N`` (TensorRT-LLM's ``tensorrt_llm/commands/build.py``);
- the tensorrtllm backend's adapter cache (``trtllm``): ``lora_cache_*`` parameters in
  ``tensorrt_llm/config.pbtxt``, as NVIDIA's backend reads them
  (``getPeftCacheConfigFromParams`` in its ``model_instance_state.cc``);
- the LLM API (``trtllm-pytorch``): ``lora_config`` in ``llm_api_options.yaml``
  (TensorRT-LLM's ``LoraConfig``: ``lora_target_modules``, ``max_lora_rank``,
  ``max_loras``, ``max_cpu_loras``).

The module names are TensorRT-LLM's; the adapters reach either engine as the contract's
``lora_task_id``/``lora_weights``/``lora_config`` tensors, which
:mod:`tritonllm.lora` packs from PEFT's names (``HF_TO_TRTLLM_MODULES``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tritonllm.lora import HF_TO_TRTLLM_MODULES

# What tritonllm.lora packs a PEFT adapter into (TensorRT-LLM's names for Llama-style
# q/k/v/o and gate/up/down projections); the fused attn_qkv is never sent.
SERVED_MODULES = tuple(HF_TO_TRTLLM_MODULES.values())


class LoraSettingsError(ValueError):
    pass


@dataclass(frozen=True)
class LoraSettings:
    # Build settings (a change rebuilds the engine).
    max_rank: int = 64
    target_modules: tuple[str, ...] = SERVED_MODULES
    # Serving settings: the C++ backend's adapter cache (config.pbtxt) ...
    cache_gpu_memory_fraction: float = 0.05  # of the GPU memory left after weights + KV cache
    cache_host_memory_bytes: int = 1 << 30
    cache_optimal_adapter_size: int = 8  # the rank a cache page is sized for
    # ... and the LLM API's (trtllm-pytorch): adapters on the GPU / in host memory.
    max_loras: int = 8
    max_cpu_loras: int = 32

    @classmethod
    def from_value(cls, value, source: str) -> LoraSettings | None:
        """The YAML's ``lora:`` value: a mapping, or null for no LoRA."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise LoraSettingsError(f"{source}: lora must be a mapping or null, not {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise LoraSettingsError(f"{source}: unknown lora setting(s) {', '.join(unknown)}")
        values = dict(value)
        if "target_modules" in values:
            modules = values["target_modules"]
            if not isinstance(modules, list | tuple) or not all(
                isinstance(m, str) for m in modules
            ):
                raise LoraSettingsError(f"{source}: lora.target_modules must be a list of names")
            values["target_modules"] = tuple(modules)
        for name in sorted(names - {"target_modules"}):
            kind = float if "fraction" in name else int
            if name in values and not _is_number(values[name], kind):
                raise LoraSettingsError(
                    f"{source}: lora.{name} must be a number, not {values[name]!r}"
                )
        settings = cls(**values)
        for problem in settings._problems():
            raise LoraSettingsError(f"{source}: lora.{problem}")
        return settings

    def _problems(self):
        unknown = [m for m in self.target_modules if m not in SERVED_MODULES]
        if unknown or not self.target_modules:
            yield (
                f"target_modules {list(self.target_modules)}: name some of "
                f"{', '.join(SERVED_MODULES)} (the modules a PEFT adapter is packed into)"
            )
        if len(set(self.target_modules)) != len(self.target_modules):
            yield "target_modules names a module twice"
        if self.max_rank < 1:
            yield "max_rank must be >= 1"
        if not 1 <= self.cache_optimal_adapter_size <= self.max_rank:
            yield f"cache_optimal_adapter_size must be in 1..max_rank ({self.max_rank})"
        if not 0.0 < self.cache_gpu_memory_fraction <= 1.0:
            yield "cache_gpu_memory_fraction must be in (0, 1]"
        if self.cache_host_memory_bytes < 0:
            yield "cache_host_memory_bytes must be >= 0"
        if not 1 <= self.max_loras <= self.max_cpu_loras:
            yield "max_loras must be >= 1 and at most max_cpu_loras"

    def build_settings(self) -> dict:
        return {"max_rank": self.max_rank, "target_modules": list(self.target_modules)}

    def build_flags(self) -> list[str]:
        """``trtllm-build``'s LoRA flags (the plugin in the model's dtype)."""
        return [
            "--lora_plugin",
            "auto",
            "--lora_target_modules",
            *self.target_modules,
            "--max_lora_rank",
            str(self.max_rank),
        ]

    def backend_parameters(self) -> dict[str, str]:
        """The tensorrtllm backend's adapter cache parameters. A cache page holds one
        module-layer row of the largest rank the engine takes (max_adapter_size)."""
        return {
            "lora_cache_optimal_adapter_size": str(self.cache_optimal_adapter_size),
            "lora_cache_max_adapter_size": str(self.max_rank),
            "lora_cache_gpu_memory_fraction": str(self.cache_gpu_memory_fraction),
            "lora_cache_host_memory_bytes": str(self.cache_host_memory_bytes),
        }

    def llm_api_config(self) -> dict:
        """``LLM(lora_config=LoraConfig(**...))``: no adapter directories at start, so
        the target modules are named (the LLM API requires them then)."""
        return {
            "lora_target_modules": list(self.target_modules),
            "max_lora_rank": self.max_rank,
            "max_loras": self.max_loras,
            "max_cpu_loras": self.max_cpu_loras,
        }

    def engine_mismatch(self, build_config: dict) -> str | None:
        """Why an engine's ``build_config`` (its config.json) was not built for these
        settings (None: it was)."""
        plugins = build_config.get("plugin_config", {})
        if not plugins.get("lora_plugin"):
            return "engine built without the LoRA plugin, the config enables lora"
        built = build_config.get("lora_config") or {}
        rank = built.get("max_lora_rank")
        if rank != self.max_rank:
            return f"engine max_lora_rank is {rank}, the config says {self.max_rank}"
        modules, wanted = (
            sorted(built.get("lora_target_modules") or []),
            sorted(self.target_modules),
        )
        if modules != wanted:
            return f"engine lora_target_modules are {modules}, the config says {wanted}"
        return None


def render_backend_parameters(lora: LoraSettings | None) -> str:
    """config.pbtxt ``parameters`` lines for the adapter cache ('' without LoRA: the
    backend then keeps its defaults, unused by an engine without the plugin)."""
    if lora is None:
        return ""
    return "\n".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        for key, value in lora.backend_parameters().items()
    )


def _is_number(value, kind) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int | float) if kind is float else isinstance(value, int)
