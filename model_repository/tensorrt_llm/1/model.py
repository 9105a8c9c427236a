"""The torch engine in TensorRT-LLM's slot: pb_utils <-> tritonllm.engine (decoupled)."""

import os

import triton_python_backend_utils as pb_utils

from tritonllm import contract
from tritonllm.decoupled import DecoupledEngineModel, print_stacks_on_crash, response_thread
from tritonllm.engine.null_engine import NullRunner
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.scheduler import Engine
from tritonllm.model_args import ModelArgs
from tritonllm.triton_metrics import EngineMetrics


def _runner(model_args):
    """The torch engine's model, or the null engine (a benchmark instrument: no model
    math, a fixed step time) when the repository was built with ``--target null``."""
    if model_args.str("engine", "torch") == "null":
        return NullRunner(
            model_args.path("engine_dir"),
            step_s=float(model_args.str("null_step_ms", "5")) / 1000,
            answer_tokens=model_args.int("null_answer_tokens", 0),
        )
    return CausalLMRunner(
        model_args.path("engine_dir"),
        device=model_args.str("device", "auto"),
        dtype=model_args.str("dtype", "auto"),
    )


class TritonPythonModel(DecoupledEngineModel):
    pb_utils = pb_utils

    def initialize(self, args):
        print_stacks_on_crash()
        model_args = ModelArgs(args)
        self.responses = response_thread(model_args)
        runner = _runner(model_args)
        self.metrics = EngineMetrics(pb_utils, args["model_name"])
        self.engine = Engine(
            runner,
            max_batch_size=model_args.int("max_batch_size", 8),
            max_queue_size=model_args.int("max_queue_size", 256),
            max_seq_len=model_args.int("max_seq_len", 0) or None,
            max_num_tokens=model_args.int("max_num_tokens", 8192),
            enable_chunked_context=model_args.bool("enable_chunked_context", False),
            observer=self.metrics,
            num_threads=model_args.int("num_threads", 0),
            prefix_cache_mb=float(model_args.str("prefix_cache_mb", "0")),
            prefix_block_size=model_args.int("prefix_cache_block_size", 16),
            max_lora_rank=model_args.int("max_lora_rank", 64),
            lora_cache_bytes=model_args.int("lora_cache_host_memory_bytes", 256 * 2**20),
            guide_compile_timeout_s=float(model_args.str("guide_compile_timeout_s", "5")),
            # The Triton replica's (routing: kv_aware), inherited from its process.
            kv_events_endpoints=os.environ.get(contract.KV_EVENTS_ENDPOINTS_ENV, ""),
        )

    def finalize(self):
        super().finalize()
        self.metrics.close()  # while the stub still talks to the server
