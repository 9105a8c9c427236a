"""The vLLM replica: Ray Serve LLM's own ``LLMServer``, speaking our replica interface.

This module runs only in the vLLM environment (``make vllm-env``: vLLM and
``ray.serve.llm`` beside this package installed without its dependencies); the
project's environment never imports it (vLLM's numpy and protobuf floors conflict with
Triton's client there). :mod:`serve.engines.vllm.deployment` names it by import path.

Why a subclass with a ``generate`` method, and not the ingress calling LLMServer's
``completions``: the ingress cannot unpickle vLLM's pydantic request and response
types (no vLLM in its environment), and the OpenAI layer is already ours (chat
template, validation, SSE, errors, metrics). So this replica takes the same
``GenerateParams`` and streams the same ``GenerationChunk`` as a Triton replica, and
the ingress treats both alike. Everything else is LLMServer's: the engine it builds
and starts from the ``LLMConfig``, its placement bundles, health check, shutdown and
LoRA multiplexing. A request goes straight to that engine's ``AsyncLLM.generate``
(vLLM's engine API, the call vLLM's own OpenAI server makes after its HTTP layer),
with deltas as vLLM produces them: no OpenAI JSON is encoded here only to be parsed
again in the ingress.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.llm import LLMConfig
from ray.serve.llm.deployment import LLMServer
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from serve.engines.vllm.params import ChunkReader, sampling_kwargs
from serve.generation import (
    GenerateParams,
    GenerationChunk,
    GenerationError,
    StreamPacing,
    coalesce,
)


class VLLMServer(LLMServer):
    """``LLMServer`` plus the replica interface of :class:`TritonReplica`
    (``generate``); built from a plain ``LLMConfig`` dict, because the
    process that builds the application cannot import ``ray.serve.llm``."""

    async def __init__(
        self,
        llm_config: dict[str, Any],
        stream_interval_ms: float = 0,
        stream_chunks_per_s: float = 0,
    ):
        self._pacing = StreamPacing(stream_interval_ms, stream_chunks_per_s)
        await super().__init__(LLMConfig.model_validate(llm_config))

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerationChunk]:
        # As a Triton replica's: what vLLM produces while Ray's hop is busy leaves as one.
        async for chunk in coalesce(self._generate(params), self._pacing):
            yield chunk

    async def _generate(self, params: GenerateParams) -> AsyncIterator[GenerationChunk]:
        kwargs = sampling_kwargs(params)
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        sampling = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
        # A prompt the client tokenized itself goes in as its ids, as vLLM takes them.
        prompt = (
            {"prompt_token_ids": list(params.prompt_token_ids)}
            if params.prompt_token_ids
            else params.prompt
        )
        read = ChunkReader(params)
        lora = await self._lora_request(params)
        # Closed with this generator: an abandoned generation stops in vLLM at once.
        async with contextlib.aclosing(self._outputs(prompt, sampling, params, lora)) as outputs:
            async for output in outputs:
                yield read(output)

    async def _lora_request(self, params: GenerateParams):
        """The adapter's ``LoRARequest`` (None: the base), loaded as Ray Serve LLM's own
        requests load it: downloaded by its multiplexed loader under the request's
        multiplexed id (``<model>:<adapter>``, set by the ingress), then added to vLLM."""
        if params.adapter is None:
            return None
        try:
            await self._maybe_resolve_lora_from_multiplex()
        except (ValueError, FileNotFoundError) as error:
            message = f"adapter {params.adapter!r}: {error}"
            raise GenerationError(message, GenerationError.INVALID) from None
        return self.engine._oai_models.lora_requests[serve.get_multiplexed_model_id()]

    async def _outputs(self, prompt, sampling: SamplingParams, params: GenerateParams, lora):
        """vLLM's ``RequestOutput`` deltas, its client errors as ours."""
        outputs = self.engine._engine_client.generate(
            prompt, sampling, params.request_id, lora_request=lora
        )
        try:
            async for output in outputs:
                if output.outputs[0].finish_reason == "abort":
                    raise GenerationError("vLLM aborted the request", GenerationError.UNAVAILABLE)
                yield output
        except (ValueError, VLLMClientError) as error:
            # vLLM's own validation (a prompt past max_model_len: VLLMValidationError), the
            # errors Ray Serve LLM's VLLMEngine also answers as the client's.
            raise GenerationError(str(error), GenerationError.INVALID) from None
        finally:
            # Closing the generator early (the client went away) aborts the request in
            # vLLM (AsyncLLM.generate aborts on GeneratorExit/cancellation).
            await outputs.aclose()
