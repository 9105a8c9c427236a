"""Engine targets for the ``tensorrt_llm`` slot, by name."""

from __future__ import annotations

from build_engines.targets.base import BuildReport, BuildSpec, EngineOptions, Target
from build_engines.targets.torch_engine import NullTarget, TorchTarget
from build_engines.targets.trtllm_engine import TrtllmTarget

# null: a benchmark instrument (no model math), never chosen by auto.
TARGETS: dict[str, type[Target]] = {
    "torch": TorchTarget,
    "trtllm": TrtllmTarget,
    "null": NullTarget,
}


def choose_target(name: str) -> Target:
    """``auto`` is trtllm where TensorRT-LLM is installed, torch elsewhere."""
    if name == "auto":
        name = "trtllm" if TrtllmTarget().unavailable_reason() is None else "torch"
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of auto, {', '.join(TARGETS)}")
    return TARGETS[name]()


__all__ = ["BuildReport", "BuildSpec", "EngineOptions", "Target", "TARGETS", "choose_target"]
