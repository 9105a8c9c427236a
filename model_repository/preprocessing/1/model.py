"""Preprocessing: pb_utils <-> tritonllm.preprocess (tokenize, word lists, end/pad ids)."""

import triton_python_backend_utils as pb_utils

from tritonllm import contract, tokenization
from tritonllm.model_args import ModelArgs
from tritonllm.preprocess import preprocess
from tritonllm.triton_errors import triton_error

_INPUTS = {
    "QUERY": "query",
    "REQUEST_OUTPUT_LEN": "request_output_len",
    "INPUT_IDS": "prompt_ids",
    "BAD_WORDS_DICT": "bad_words",
    "STOP_WORDS_DICT": "stop_words",
    "END_ID": "end_id",
    "PAD_ID": "pad_id",
    "EMBEDDING_BIAS_WORDS": "bias_words",
    "EMBEDDING_BIAS_WEIGHTS": "bias_weights",
    "EMBEDDING_BIAS_TOKEN_IDS": "bias_token_ids",
}


class TritonPythonModel:
    def initialize(self, args):
        model_args = ModelArgs(args)
        self.tokenizer = tokenization.load_tokenizer(str(model_args.path("tokenizer_dir")))
        self.add_special_tokens = model_args.bool("add_special_tokens", True)

    def execute(self, requests):
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        kwargs = {}
        for name, arg in _INPUTS.items():
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            kwargs[arg] = None if tensor is None else tensor.as_numpy()
        try:
            outputs = preprocess(
                self.tokenizer, add_special_tokens=self.add_special_tokens, **kwargs
            )
        except tokenization.InvalidRequest as exc:
            return pb_utils.InferenceResponse(error=triton_error(pb_utils, str(exc)))
        tensors = [
            pb_utils.Tensor(spec.name, outputs[spec.name].astype(spec.numpy_dtype))
            for spec in contract.PREPROCESSING_OUTPUTS
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)
