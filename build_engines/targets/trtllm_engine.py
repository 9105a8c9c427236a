"""The trtllm target: TensorRT-LLM engines for the tensorrtllm backend (GPU boxes).

The engine build itself (checkpoint conversion, ``trtllm-build``, the backend's
configs) is the GPU issue's work; until then this target says so plainly, and
where TensorRT-LLM is missing it says what to install.
"""

from __future__ import annotations

import importlib.util

from build_engines.repository import ModelRepository
from build_engines.targets.base import BuildReport, BuildSpec, Reporter


class TargetUnavailable(RuntimeError):
    pass


class TrtllmTarget:
    name = "trtllm"

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("tensorrt_llm") is None:
            return (
                "TensorRT-LLM is not installed (no `tensorrt_llm` Python package): build inside "
                "the GPU image (docker/Dockerfile.gpu, on nvcr.io/nvidia/tritonserver:"
                "<yy.mm>-trtllm-python-py3) or use TARGET=torch for the CPU/torch engine"
            )
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed, which TensorRT-LLM's checkpoint conversion needs"
        return None

    def build(self, spec: BuildSpec, repo: ModelRepository, reporter: Reporter) -> BuildReport:
        reason = self.unavailable_reason()
        if reason:
            raise TargetUnavailable(reason)
        raise TargetUnavailable(
            "TensorRT-LLM engine builds are not implemented yet in this version; "
            "use TARGET=torch, which serves the same checkpoint through the same model repository"
        )
