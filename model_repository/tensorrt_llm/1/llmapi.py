"""TensorRT-LLM's PyTorch backend in the tensorrt_llm slot: pb_utils <-> tritonllm.llmapi.

Loaded instead of model.py when `make engines TARGET=trtllm-pytorch` wrote the config
(``default_model_filename: "llmapi.py"``). Same tensors, decoupled, streaming.
"""

import tempfile
from pathlib import Path

import triton_python_backend_utils as pb_utils

from tritonllm.decoupled import DecoupledEngineModel, print_stacks_on_crash, response_thread
from tritonllm.llmapi import LLMAPIEngine, llm_kwargs, load_options, lora_adapters
from tritonllm.model_args import ModelArgs


class TritonPythonModel(DecoupledEngineModel):
    pb_utils = pb_utils

    def initialize(self, args):
        print_stacks_on_crash()
        model_args = ModelArgs(args)
        # Imported here: loading TensorRT-LLM initialises CUDA and MPI.
        from tensorrt_llm import LLM, SamplingParams

        try:
            from tensorrt_llm.sampling_params import GuidedDecodingParams
        except ImportError:  # a TensorRT-LLM without guided decoding: such requests refused
            GuidedDecodingParams = None  # noqa: N806

        options = load_options(model_args.path("llm_api_options"))
        model_dir = model_args.path("engine_dir")
        # LoRA adapters arrive as tensors; the LLM API loads them from PEFT directories.
        self.lora_root = tempfile.TemporaryDirectory(prefix="tritonllm-lora-")
        adapters = lora_adapters(model_dir, options, Path(self.lora_root.name))
        LoRARequest = None  # noqa: N806
        if adapters is not None:
            from tensorrt_llm.executor.request import LoRARequest  # noqa: N806
        llm = LLM(**llm_kwargs(model_dir, options))
        self.responses = response_thread(model_args)
        self.engine = LLMAPIEngine(
            llm,
            SamplingParams,
            max_batch_size=model_args.int("max_batch_size", 64),
            max_queue_size=model_args.int("max_queue_size", 256),
            max_input_len=model_args.int("max_input_len", 0),
            max_seq_len=model_args.int("max_seq_len", 0),
            guided_decoding_params_cls=GuidedDecodingParams,
            adapters=adapters,
            lora_request_cls=LoRARequest,
        )

    def finalize(self):
        try:
            super().finalize()
        finally:
            self.lora_root.cleanup()
