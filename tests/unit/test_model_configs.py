"""Every filled config.pbtxt parses into Triton's ModelConfig and matches the contract."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build_engines.repository import ModelRepository
from build_engines.targets.base import BuildSpec
from build_engines.targets.torch_engine import TorchTarget
from tritonllm import contract

DTYPES = {v: k for k, v in model_config_pb2.DataType.items()}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Fill the tracked templates into a scratch copy (no model build needed)."""
    import shutil

    from tests.conftest import REPOSITORY

    root = tmp_path_factory.mktemp("repo") / "model_repository"
    shutil.copytree(REPOSITORY, root, ignore=shutil.ignore_patterns("hf_model", "config.pbtxt"))
    repo = ModelRepository(root)
    TorchTarget()._fill_configs(BuildSpec(model=None), repo, "tensorrt_llm/1/hf_model")
    parsed = {}
    for model in contract.MODELS:
        parsed[model] = text_format.Parse(
            repo.config_path(model).read_text(), model_config_pb2.ModelConfig()
        )
    return parsed


@pytest.mark.parametrize("model", list(contract.MODELS))
def test_tensors_match_the_contract(configs, model):
    config = configs[model]
    inputs, outputs = contract.MODELS[model]
    assert config.name == model
    for declared, expected in ((config.input, inputs), (config.output, outputs)):
        assert [t.name for t in declared] == [t.name for t in expected]
        for tensor, spec in zip(declared, expected, strict=True):
            assert DTYPES[tensor.data_type] == spec.triton_dtype
            assert tuple(tensor.dims) == spec.dims
            assert getattr(tensor, "optional", False) == spec.optional


def test_tensorrt_llm_is_decoupled_with_its_parameters(configs):
    config = configs[contract.TENSORRT_LLM]
    assert config.model_transaction_policy.decoupled
    assert config.parameters["engine_dir"].string_value == "tensorrt_llm/1/hf_model"
    keys = ("max_batch_size", "max_queue_size", "max_num_tokens", "max_seq_len", "device", "dtype")
    for key in keys:
        assert not config.parameters[key].string_value.startswith("$")


def test_pre_and_postprocessing_name_the_tokenizer(configs):
    for model in (contract.PREPROCESSING, contract.POSTPROCESSING):
        assert configs[model].parameters["tokenizer_dir"].string_value == "tensorrt_llm/1/hf_model"


def test_ensemble_wiring_uses_real_tensor_names(configs):
    ensemble = configs[contract.ENSEMBLE]
    ensemble_names = {t.name for t in (*contract.ENSEMBLE_INPUTS, *contract.ENSEMBLE_OUTPUTS)}
    produced = set()
    for step in ensemble.ensemble_scheduling.step:
        inputs, outputs = contract.MODELS[step.model_name]
        assert set(step.input_map) <= {t.name for t in inputs}
        assert set(step.output_map) <= {t.name for t in outputs}
        required = {t.name for t in inputs if not t.optional}
        assert required <= set(step.input_map), step.model_name
        for value in step.input_map.values():
            assert value in ensemble_names or value in produced, value
        produced |= set(step.output_map.values())
    assert {t.name for t in contract.ENSEMBLE_OUTPUTS} <= produced
