"""Engine targets for the ``tensorrt_llm`` slot, by name."""

from __future__ import annotations

from build_engines.targets.base import BuildReport, BuildSpec, EngineOptions, Target
from build_engines.targets.torch_engine import NullTarget, TorchTarget
from build_engines.targets.trtllm_engine import TrtllmTarget
from build_engines.targets.trtllm_pytorch import TrtllmPytorchTarget

# null: a benchmark instrument (no model math), never chosen by auto.
TARGETS: dict[str, type[Target]] = {
    "torch": TorchTarget,
    "trtllm": TrtllmTarget,
    "trtllm-pytorch": TrtllmPytorchTarget,
    "null": NullTarget,
}


def auto_target() -> str:
    """What this machine's TensorRT-LLM serves best: TensorRT engines where the image
    still has ``trtllm-build``, else its PyTorch backend (newer TensorRT-LLM, where the
    engine backend was removed), else the torch engine (no TensorRT-LLM)."""
    for name in ("trtllm", "trtllm-pytorch"):
        if TARGETS[name]().unavailable_reason() is None:
            return name
    return "torch"


def choose_target(name: str) -> Target:
    """``auto``: see :func:`auto_target`; any other name must be a registered target."""
    if name == "auto":
        name = auto_target()
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of auto, {', '.join(TARGETS)}")
    return TARGETS[name]()


__all__ = [
    "BuildReport",
    "BuildSpec",
    "EngineOptions",
    "Target",
    "TARGETS",
    "auto_target",
    "choose_target",
]
