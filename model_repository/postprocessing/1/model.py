"""Postprocessing: pb_utils <-> tritonllm.postprocess (incremental detokenization)."""

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonllm import contract, tokenization
from tritonllm.detokenize import StreamDetokenizers
from tritonllm.model_args import ModelArgs
from tritonllm.postprocess import postprocess


class TritonPythonModel:
    def initialize(self, args):
        model_args = ModelArgs(args)
        self.tokenizer = tokenization.load_tokenizer(
            str(model_args.path("tokenizer_dir")), model_args.str("tokenizer_class")
        )
        self.skip_special_tokens = model_args.bool("skip_special_tokens", True)
        self.streams = StreamDetokenizers(self.tokenizer)

    def execute(self, requests):
        responses = []
        for request in requests:
            text = postprocess(
                self.tokenizer,
                self.streams,
                pb_utils.get_input_tensor_by_name(
                    request, contract.POST_TOKENS_BATCH.name
                ).as_numpy(),
                pb_utils.get_input_tensor_by_name(
                    request, contract.POST_SEQUENCE_LENGTH.name
                ).as_numpy(),
                request_id=request.request_id(),
                skip_special_tokens=self.skip_special_tokens,
            )
            output = pb_utils.Tensor(contract.POST_OUTPUT.name, text.astype(np.object_))
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses
