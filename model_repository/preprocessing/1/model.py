"""Preprocessing: pb_utils <-> tritonllm.preprocess (tokenize, word lists, end/pad ids)."""

import triton_python_backend_utils as pb_utils

from tritonllm import contract, tokenization
from tritonllm.model_args import ModelArgs
from tritonllm.preprocess import ARGUMENTS, preprocess
from tritonllm.triton_errors import triton_error


class TritonPythonModel:
    def initialize(self, args):
        model_args = ModelArgs(args)
        self.tokenizer = tokenization.load_tokenizer(
            str(model_args.path("tokenizer_dir")), model_args.str("tokenizer_class")
        )
        self.add_special_tokens = model_args.bool("add_special_tokens", True)

    def execute(self, requests):
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        kwargs = {}
        for name, arg in ARGUMENTS.items():
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
