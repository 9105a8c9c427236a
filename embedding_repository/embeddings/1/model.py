"""Embeddings: pb_utils <-> tritonllm.embeddings (encoder, mean pooling, normalisation)."""

import triton_python_backend_utils as pb_utils

from tritonllm import contract
from tritonllm.embeddings import SentenceEncoder, embed_requests
from tritonllm.model_args import ModelArgs
from tritonllm.tokenization import InvalidRequest
from tritonllm.triton_errors import triton_error


class TritonPythonModel:
    def initialize(self, args):
        model_args = ModelArgs(args)
        self.encoder = SentenceEncoder(
            model_args.path("model_dir"), device=model_args.str("device", "auto")
        )

    def execute(self, requests):
        # The dynamic batcher may hand over several requests: one forward for all of them.
        name = contract.EMBEDDINGS_TEXT.name
        texts = [pb_utils.get_input_tensor_by_name(r, name).as_numpy() for r in requests]
        return [self._response(answer) for answer in embed_requests(self.encoder, texts)]

    def _response(self, answer):
        if isinstance(answer, InvalidRequest):
            return pb_utils.InferenceResponse(error=triton_error(pb_utils, str(answer)))
        tensors = [
            pb_utils.Tensor(spec.name, answer[spec.name].astype(spec.numpy_dtype))
            for spec in contract.EMBEDDINGS_OUTPUTS
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)
