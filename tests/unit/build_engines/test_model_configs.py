"""Every filled config.pbtxt (both repositories) parses into Triton's ModelConfig and
matches the contract; the dynamic_batching blocks come from the build options."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build_engines.embeddings import EmbeddingsOptions, fill_config
from build_engines.repository import EmbeddingRepository, ModelRepository
from build_engines.targets.base import BuildSpec, DynamicBatching, EngineOptions
from build_engines.targets.torch_engine import TorchTarget
from build_engines.templates import TemplateError
from tritonllm import contract

DTYPES = {v: k for k, v in model_config_pb2.DataType.items()}


def parse(repo: ModelRepository, model: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(repo.config_path(model).read_text(), model_config_pb2.ModelConfig())


def llm_configs(root, options: EngineOptions) -> dict[str, model_config_pb2.ModelConfig]:
    """Fill the tracked templates into a scratch copy (no model build needed)."""
    from tests.conftest import REPOSITORY

    repo = ModelRepository(REPOSITORY).copy_layout(root)
    spec = BuildSpec(model=None, options=options)
    TorchTarget()._fill_configs(spec, repo, "tensorrt_llm/1/hf_model", "")
    return {model: parse(repo, model) for model in contract.MODELS}


def embeddings_config(root, options: EmbeddingsOptions) -> model_config_pb2.ModelConfig:
    from tests.conftest import EMBEDDING_REPOSITORY

    repo = EmbeddingRepository(EMBEDDING_REPOSITORY).copy_layout(root)
    fill_config(options, repo, "embeddings/1/hf_model")
    return parse(repo, contract.EMBEDDINGS)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Every model of both repositories, with the default build options."""
    root = tmp_path_factory.mktemp("repos")
    parsed = llm_configs(root / "model_repository", EngineOptions())
    parsed[contract.EMBEDDINGS] = embeddings_config(
        root / "embedding_repository", EmbeddingsOptions()
    )
    return parsed


@pytest.mark.parametrize("model", list(contract.ALL_MODELS))
def test_tensors_match_the_contract(configs, model):
    config = configs[model]
    inputs, outputs = contract.ALL_MODELS[model]
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
    # Opt-in, as in TensorRT-LLM (docs/cpu-engine.md): it cost more than it bought on CPU.
    assert config.parameters["enable_chunked_context"].string_value == "false"
    # LoRA under TensorRT-LLM's parameter names: its default rank limit, a 256 MiB cache.
    assert config.parameters["max_lora_rank"].string_value == "64"
    assert config.parameters["lora_cache_host_memory_bytes"].string_value == str(256 * 2**20)


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


@pytest.mark.parametrize(
    "tensors",
    [
        {
            "guided_decoding_guide_type": ("TYPE_STRING", (1,)),
            "guided_decoding_guide": ("TYPE_STRING", (1,)),
        },
        {
            "lora_task_id": ("TYPE_UINT64", (1,)),
            "lora_weights": ("TYPE_FP16", (-1, -1)),
            "lora_config": ("TYPE_INT32", (-1, 3)),
        },
    ],
    ids=["guided_decoding", "lora"],
)
def test_upstream_request_tensors_go_straight_to_the_engine(configs, tensors):
    ensemble = configs[contract.ENSEMBLE]
    engine_step = next(
        s for s in ensemble.ensemble_scheduling.step if s.model_name == contract.TENSORRT_LLM
    )
    for name, (dtype, dims) in tensors.items():
        assert engine_step.input_map[name] == name
        for model in (contract.ENSEMBLE, contract.TENSORRT_LLM):
            spec = contract.tensor(model, name)
            assert (spec.triton_dtype, spec.dims, spec.optional) == (dtype, dims, True)
            assert not spec.engine_extension  # TensorRT-LLM's backends take them
    for step in ensemble.ensemble_scheduling.step:
        if step.model_name != contract.TENSORRT_LLM:
            assert not set(tensors) & set(step.input_map.values())


def test_the_embeddings_model_batches_and_names_its_weights(configs):
    config = configs[contract.EMBEDDINGS]
    assert config.backend == "python"
    assert config.max_batch_size == EmbeddingsOptions().max_batch_size > 1
    assert not config.model_transaction_policy.decoupled
    assert config.parameters["model_dir"].string_value == "embeddings/1/hf_model"
    assert config.parameters["device"].string_value == "auto"
    assert config.HasField("dynamic_batching")
    batching = DynamicBatching()
    assert config.dynamic_batching.max_queue_delay_microseconds == batching.max_queue_delay_us
    assert tuple(config.dynamic_batching.preferred_batch_size) == batching.preferred_batch_sizes


def test_pre_and_postprocessing_batch_ragged_requests(configs):
    for model in (contract.PREPROCESSING, contract.POSTPROCESSING):
        config = configs[model]
        assert config.HasField("dynamic_batching"), model
        ragged = {t.name for t in config.input if t.allow_ragged_batch}
        assert ragged == {t.name for t in contract.MODELS[model][0] if -1 in t.dims}, model
    # The engine and the ensemble have their own schedulers.
    assert not configs[contract.TENSORRT_LLM].HasField("dynamic_batching")
    # Streamed chunks are detokenized in order only with one postprocessing instance.
    assert [g.count for g in configs[contract.POSTPROCESSING].instance_group] == [1]


def test_build_options_reach_every_dynamic_batcher(tmp_path):
    batching = DynamicBatching(preferred_batch_sizes=(4, 8), max_queue_delay_us=2500)
    llm = llm_configs(tmp_path / "llm", EngineOptions(dynamic_batching=batching))
    options = EmbeddingsOptions(max_batch_size=8, dynamic_batching=batching)
    embeddings = embeddings_config(tmp_path / "emb", options)
    assert embeddings.max_batch_size == 8
    for config in (llm[contract.PREPROCESSING], llm[contract.POSTPROCESSING], embeddings):
        assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
        assert config.dynamic_batching.max_queue_delay_microseconds == 2500


def test_the_off_switch_leaves_no_dynamic_batcher(tmp_path):
    off = DynamicBatching(enabled=False)
    llm = llm_configs(tmp_path / "llm", EngineOptions(dynamic_batching=off))
    embeddings = embeddings_config(tmp_path / "emb", EmbeddingsOptions(dynamic_batching=off))
    for config in (llm[contract.PREPROCESSING], llm[contract.POSTPROCESSING], embeddings):
        assert not config.HasField("dynamic_batching")
    assert embeddings.max_batch_size == EmbeddingsOptions().max_batch_size


def test_preferred_sizes_over_the_max_batch_size_are_refused(tmp_path):
    batching = DynamicBatching(preferred_batch_sizes=(16, 64))
    with pytest.raises(TemplateError, match=r"\[64\] must lie in 1..32.*--preferred-batch-sizes"):
        embeddings_config(tmp_path, EmbeddingsOptions(dynamic_batching=batching))
