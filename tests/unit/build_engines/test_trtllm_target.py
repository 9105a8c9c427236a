"""The trtllm target on CPU: its config, its commands, its configs, skip and force.

What NVIDIA documents is written down here as test data, with where it was read:

- NVIDIA/TensorRT-LLM ``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/
  config.pbtxt`` (commit 0c8de69a1ca6): names, types, dims and attributes of the
  tensorrtllm backend's tensors (``UPSTREAM_TENSORS``), the same names the backend
  reads in ``triton_backend/inflight_batcher_llm/src/utils.h`` (InputFieldsNames).
- NVIDIA/TensorRT-LLM ``tensorrt_llm/commands/build.py`` (1.x, commit 65f1d1536e18) and
  ``add_plugin_argument`` in ``tensorrt_llm/plugin/plugin.py`` (pydantic PluginConfig):
  the ``trtllm-build`` flags and their choices (``TRTLLM_BUILD_FLAGS``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build_engines.repository import ModelRepository
from build_engines.targets.base import BuildSpec
from build_engines.targets.trtllm_engine import (
    TOKENIZER_DIR,
    TrtllmTarget,
    fill_configs,
    load_settings,
)
from build_engines.trtllm_convert import parse_args as parse_convert_args
from build_engines.trtllm_lora import LoraSettings
from build_engines.trtllm_settings import (
    SettingsError,
    TrtllmSettings,
    build_command,
    convert_command,
    engine_mismatch,
)
from tests.conftest import REPOSITORY
from tritonllm import contract
from tritonllm.lora import HF_TO_TRTLLM_MODULES

DTYPES = {v: k for k, v in model_config_pb2.DataType.items()}
R, G = "reshape", "ragged"  # reshape: { shape: [ ] } / allow_ragged_batch: true

UPSTREAM_TENSORS = {
    "input_ids": ("TYPE_INT32", (-1,), G),
    "input_lengths": ("TYPE_INT32", (1,), R),
    "request_output_len": ("TYPE_INT32", (1,), R),
    "end_id": ("TYPE_INT32", (1,), R),
    "pad_id": ("TYPE_INT32", (1,), R),
    "stop_words_list": ("TYPE_INT32", (2, -1), G),
    "bad_words_list": ("TYPE_INT32", (2, -1), G),
    "beam_width": ("TYPE_INT32", (1,), R),
    "temperature": ("TYPE_FP32", (1,), R),
    "runtime_top_k": ("TYPE_INT32", (1,), R),
    "runtime_top_p": ("TYPE_FP32", (1,), R),
    "len_penalty": ("TYPE_FP32", (1,), R),
    "repetition_penalty": ("TYPE_FP32", (1,), R),
    "min_tokens": ("TYPE_INT32", (1,), R),
    "presence_penalty": ("TYPE_FP32", (1,), R),
    "frequency_penalty": ("TYPE_FP32", (1,), R),
    "seed": ("TYPE_UINT64", (1,), R),
    "return_log_probs": ("TYPE_BOOL", (1,), R),
    "return_num_input_tokens": ("TYPE_BOOL", (1,), R),
    "return_num_output_tokens": ("TYPE_BOOL", (1,), R),
    "exclude_input_in_output": ("TYPE_BOOL", (1,), R),
    "stop": ("TYPE_BOOL", (1,), R),
    "embedding_bias": ("TYPE_FP32", (-1,), G),
    "streaming": ("TYPE_BOOL", (1,), R),
    "guided_decoding_guide_type": ("TYPE_STRING", (1,), None),
    "guided_decoding_guide": ("TYPE_STRING", (1,), None),
    "lora_task_id": ("TYPE_UINT64", (1,), R),
    "lora_weights": ("TYPE_FP16", (-1, -1), G),
    "lora_config": ("TYPE_INT32", (-1, 3), G),
    "output_ids": ("TYPE_INT32", (-1, -1), None),
    "sequence_length": ("TYPE_INT32", (-1,), None),
    "cum_log_probs": ("TYPE_FP32", (-1,), None),
    "output_log_probs": ("TYPE_FP32", (-1, -1), None),
    "batch_index": ("TYPE_INT32", (1,), None),
    "num_input_tokens": ("TYPE_INT32", (1,), None),
    "num_output_tokens": ("TYPE_INT32", (1,), None),
}

_SWITCH = {"enable", "disable"}
TRTLLM_BUILD_FLAGS = {
    "--checkpoint_dir": "path",
    "--output_dir": "path",
    "--max_batch_size": int,
    "--max_input_len": int,
    "--max_seq_len": int,
    "--max_beam_width": int,
    "--max_num_tokens": int,
    "--kv_cache_type": {"continuous", "paged", "disabled"},
    "--remove_input_padding": _SWITCH,
    "--context_fmha": _SWITCH,
    "--use_paged_context_fmha": _SWITCH,
    "--gemm_plugin": {"auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4", "disable"},
    "--gpt_attention_plugin": {"auto", "float16", "float32", "bfloat16", "int32", "disable"},
    # LoRA: the plugin is a dtype plugin; the modules are LoraManager.LORA_MODULE_IDS.
    "--lora_plugin": {"auto", "float16", "float32", "bfloat16", "disable"},
    "--lora_target_modules": set(contract.LORA_MODULE_IDS),
    "--max_lora_rank": int,
}


def parse_build(command: list[str]) -> dict[str, str | list[str]]:
    """trtllm-build's arguments as its parser reads them (``--lora_target_modules``
    takes several values, nargs='+'); a flag given twice is an error."""
    assert command[0] == "trtllm-build"
    args: dict[str, str | list[str]] = {}
    flag = None
    for word in command[1:]:
        if word.startswith("--"):
            assert word not in args, f"{word} appears twice"
            flag, args[word] = word, []
        else:
            args[flag].append(word)
    for name, values in args.items():
        many = name == "--lora_target_modules"
        assert len(values) >= 1 if many else len(values) == 1, (name, values)
        args[name] = values if many else values[0]
    return args


@pytest.fixture
def repo(tmp_path) -> ModelRepository:
    return ModelRepository(REPOSITORY).copy_layout(tmp_path / "model_repository")


def parse_config(repo: ModelRepository, model: str):
    text = repo.config_path(model).read_text()
    assert "${" not in text, f"{model}: unfilled placeholder"
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_our_tensorrt_llm_contract_is_nvidias():
    """Upstream's tensors, and ours marked as engine extensions (left out for TensorRT-LLM)."""
    inputs, outputs = contract.MODELS[contract.TENSORRT_LLM]
    inputs = [t for t in inputs if not t.engine_extension]
    outputs = [t for t in outputs if not t.engine_extension]
    for tensor in (*inputs, *outputs):
        dtype, dims, _ = UPSTREAM_TENSORS[tensor.name]
        assert (tensor.triton_dtype, tensor.dims) == (dtype, dims), tensor.name
    assert {t.name for t in (*inputs, *outputs)} == set(UPSTREAM_TENSORS)


def test_filled_configs_parse_and_carry_the_settings(repo):
    settings = TrtllmSettings(max_batch_size=32, max_queue_size=17, enable_kv_cache_reuse=True)
    fill_configs(settings, repo)
    configs = {m: parse_config(repo, m) for m in contract.MODELS}
    assert {c.max_batch_size for c in configs.values()} == {32}
    trt = configs[contract.TENSORRT_LLM]
    params = {k: v.string_value for k, v in trt.parameters.items()}
    assert trt.backend == "tensorrtllm" and trt.model_transaction_policy.decoupled
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert Path(params["gpt_model_path"]) == repo.engine_version_dir
    assert Path(params["gpt_model_path"]).is_absolute()
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.85"
    assert params["enable_kv_cache_reuse"] == "true"
    assert params["batch_scheduler_policy"] == "guaranteed_no_evict"
    assert trt.dynamic_batching.default_queue_policy.max_queue_size == 17
    assert trt.dynamic_batching.max_queue_delay_microseconds == 100
    # Guided decoding with XGrammar, as tensorrtllm_backend's docs/guided_decoding.md.
    tokenizer_dir = repo.engine_version_dir / TOKENIZER_DIR
    assert params["guided_decoding_backend"] == "xgrammar"
    assert Path(params["tokenizer_dir"]) == tokenizer_dir
    info = Path(params["xgrammar_tokenizer_info_path"])
    assert info == tokenizer_dir / "xgrammar_tokenizer_info.json"
    for model in (contract.PREPROCESSING, contract.POSTPROCESSING):
        tokenizer = configs[model].parameters["tokenizer_dir"].string_value
        assert tokenizer == f"tensorrt_llm/1/{TOKENIZER_DIR}"


def test_tensorrt_llm_tensors_carry_nvidias_attributes(repo):
    fill_configs(TrtllmSettings(), repo)
    trt = parse_config(repo, contract.TENSORRT_LLM)
    declared = [*trt.input, *trt.output]
    assert [t.name for t in declared] == [
        t.name
        for t in (*contract.TENSORRT_LLM_INPUTS, *contract.TENSORRT_LLM_OUTPUTS)
        if not t.engine_extension
    ]
    ensemble = parse_config(repo, contract.ENSEMBLE)
    engine_step = next(s for s in ensemble.ensemble_scheduling.step if s.model_name == trt.name)
    mapped = {*engine_step.input_map, *engine_step.output_map}
    assert mapped <= {t.name for t in declared}
    engine_outputs = set(engine_step.output_map.values()) - {"_SEQUENCE_LENGTH"}
    assert {o.name for o in ensemble.output} == engine_outputs | {"text_output"}
    for tensor in declared:
        dtype, dims, attribute = UPSTREAM_TENSORS[tensor.name]
        assert (DTYPES[tensor.data_type], tuple(tensor.dims)) == (dtype, dims)
        reshaped = tensor in trt.input and tensor.HasField("reshape")
        assert reshaped == (attribute == R), tensor.name
        if reshaped:
            assert list(tensor.reshape.shape) == []
        assert getattr(tensor, "allow_ragged_batch", False) == (attribute == G), tensor.name


def test_the_xgrammar_tokenizer_info_is_what_xgrammar_reads(tmp_path, checkpoint_dir, tokenizer):
    import json

    import xgrammar as xgr

    from build_engines.targets.trtllm_engine import write_xgrammar_tokenizer_info

    path = tmp_path / "xgrammar_tokenizer_info.json"
    write_xgrammar_tokenizer_info(checkpoint_dir, path)
    info = json.loads(path.read_text())
    assert len(info["encoded_vocab"]) == len(tokenizer)
    assert info["stop_token_ids"] == [tokenizer.eos_token_id]
    # The C++ backend decodes the vocabulary by the type XGrammar detects for the tokenizer.
    expected = xgr.TokenizerInfo.from_huggingface(tokenizer)
    assert json.loads(info["tokenizer_str"])["model"]["type"] == "BPE"
    rebuilt = xgr.TokenizerInfo(info["encoded_vocab"], vocab_type=expected.vocab_type)
    assert rebuilt.decoded_vocab == expected.decoded_vocab


def test_build_command_uses_only_documented_flags():
    settings = TrtllmSettings(enable_chunked_context=True, gemm_plugin="bfloat16")
    command = build_command(settings, Path("/ckpt"), Path("/engine"))
    pairs = parse_build(command)
    for flag, value in pairs.items():
        allowed = TRTLLM_BUILD_FLAGS[flag]
        if allowed is int:
            assert int(value) > 0
        elif isinstance(allowed, set):
            assert set(value if isinstance(value, list) else [value]) <= allowed, (flag, value)
    assert pairs["--checkpoint_dir"] == "/ckpt" and pairs["--output_dir"] == "/engine"
    assert pairs["--kv_cache_type"] == "paged" and pairs["--remove_input_padding"] == "enable"
    assert pairs["--max_seq_len"] == "4096" and pairs["--use_paged_context_fmha"] == "enable"
    assert "--max_seq_len" not in build_command(TrtllmSettings(max_seq_len=0), Path("c"), Path("e"))


def test_convert_command_is_our_converters_own_arguments():
    settings = TrtllmSettings(dtype="bfloat16", tensor_parallel_size=2, pipeline_parallel_size=2)
    command = convert_command(settings, Path("/hf"), Path("/ckpt"))
    assert command[1:3] == ["-m", "build_engines.trtllm_convert"]
    args = parse_convert_args(command[3:])
    assert (args.model_dir, args.output_dir) == (Path("/hf"), Path("/ckpt"))
    assert (args.dtype, args.tp_size, args.pp_size) == ("bfloat16", 2, 2)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_batch_sizes": 4}, "unknown setting"),
        ({"max_batch_size": "8"}, "max_batch_size must be a int"),
        ({"remove_input_padding": "yes"}, "must be a bool"),
        ({"kv_cache_type": "continuous"}, "paged KV cache"),
        ({"gpt_attention_plugin": "disable"}, "needs it"),
        ({"max_input_len": 4096, "max_seq_len": 4096}, "room for the output"),
        ({"max_num_tokens": 1024, "max_input_len": 2048}, "could never be scheduled"),
        ({"max_batch_size": 8, "triton_max_batch_size": 16}, "at most the engine's"),
        ({"kv_cache_free_gpu_mem_fraction": 1.5}, r"\(0, 1\]"),
        ({"dtype": "fp8"}, "dtype 'fp8'"),
    ],
)
def test_bad_settings_are_named(values, message):
    with pytest.raises(SettingsError, match=message):
        TrtllmSettings.from_dict(values)


def test_the_shipped_config_is_valid_and_flags_override_it(tmp_path):
    shipped = TrtllmSettings.load()
    assert shipped == TrtllmSettings()  # the file and the dataclass defaults agree
    spec = BuildSpec(model=None, overrides={"max_batch_size": 8, "dtype": "float16"})
    settings = load_settings(spec)
    assert (settings.max_batch_size, settings.dtype, settings.triton_batch) == (8, "float16", 8)
    chunked = load_settings(BuildSpec(model=None, overrides={"enable_chunked_context": True}))
    assert chunked.enable_chunked_context and chunked.paged_context_fmha
    paced = load_settings(BuildSpec(model=None, overrides={"stream_chunks_per_s": 250}))
    assert paced.stream_chunks_per_s == 250  # trtllm-pytorch's response thread
    with pytest.raises(SettingsError, match="num_threads apply to the torch target"):
        load_settings(BuildSpec(model=None, overrides={"num_threads": 2}))
    (tmp_path / "t.yaml").write_text("max_batch_size: 4\nmax_num_tokens: 4096\n")
    from_file = load_settings(BuildSpec(model=None, trtllm_config=tmp_path / "t.yaml"))
    assert (from_file.max_batch_size, from_file.max_num_tokens) == (4, 4096)


def engine_config(settings: TrtllmSettings, version: str) -> dict:
    """The shape of the config.json trtllm-build writes (EngineConfig.to_dict, 1.x)."""
    return {
        "version": version,
        "pretrained_config": {
            "architecture": "LlamaForCausalLM",
            "dtype": "float16",
            "mapping": {"world_size": settings.world_size, "tp_size": 1, "pp_size": 1},
        },
        "build_config": {
            "max_batch_size": settings.max_batch_size,
            "max_input_len": settings.max_input_len,
            "max_seq_len": settings.max_seq_len,
            "max_num_tokens": settings.max_num_tokens,
            "max_beam_width": settings.max_beam_width,
            "kv_cache_type": "PAGED",
            "plugin_config": {
                "remove_input_padding": True,
                "context_fmha": True,
                "use_paged_context_fmha": settings.paged_context_fmha,
                "lora_plugin": "float16" if settings.lora else None,
            },
            # BuildConfig.lora_config (tensorrt_llm.lora_manager.LoraConfig), as
            # build_model sets it from --max_lora_rank and --lora_target_modules.
            "lora_config": {
                "lora_dir": [],
                "lora_ckpt_source": "hf",
                "max_lora_rank": settings.lora.max_rank if settings.lora else 64,
                "lora_target_modules": list(settings.lora.target_modules) if settings.lora else [],
                "trtllm_modules_to_hf_modules": {},
            },
        },
    }


def test_engine_mismatch_reads_the_engines_own_config(tmp_path):
    settings = TrtllmSettings()
    assert "no engine config" in engine_mismatch(tmp_path, settings, "1.2.1")
    (tmp_path / "config.json").write_text(json.dumps(engine_config(settings, "1.2.1")))
    assert engine_mismatch(tmp_path, settings, "1.2.1") == "rank0.engine is missing"
    (tmp_path / "rank0.engine").write_bytes(b"plan")
    assert engine_mismatch(tmp_path, settings, "1.2.1") is None
    assert "TensorRT-LLM 1.2.1, this is 1.3.0" in engine_mismatch(tmp_path, settings, "1.3.0")
    bigger = TrtllmSettings(max_batch_size=128)
    assert "max_batch_size is 64, the config says 128" in engine_mismatch(tmp_path, bigger, "1.2.1")
    bf16 = TrtllmSettings(dtype="bfloat16")
    assert "dtype is float16" in engine_mismatch(tmp_path, bf16, "1.2.1")
    no_reuse = TrtllmSettings(enable_kv_cache_reuse=False)  # built for reuse: rebuild
    assert "use_paged_context_fmha is True" in engine_mismatch(tmp_path, no_reuse, "1.2.1")


def test_kv_cache_block_reuse_is_on_by_default_with_what_the_engine_build_needs(repo):
    settings = TrtllmSettings.load()  # build_engines/trtllm.yaml
    assert settings.enable_kv_cache_reuse and settings.context_fmha
    pairs = parse_build(build_command(settings, Path("/ckpt"), Path("/engine")))
    assert pairs["--use_paged_context_fmha"] == "enable" and pairs["--kv_cache_type"] == "paged"
    fill_configs(settings, repo)
    params = parse_config(repo, contract.TENSORRT_LLM).parameters
    assert params["enable_kv_cache_reuse"].string_value == "true"
    off = TrtllmSettings(enable_kv_cache_reuse=False)
    assert "--use_paged_context_fmha" not in build_command(off, Path("c"), Path("e"))
    with pytest.raises(SettingsError, match="context_fmha: true"):
        TrtllmSettings.from_dict({"context_fmha": False})


class FakeTrtllmBuild:
    """Stands in for the two GPU commands (their orchestration is under test, not
    TensorRT-LLM): records them and writes what trtllm-build leaves behind."""

    def __init__(self, version: str = "1.2.1"):
        self.version = version
        self.commands: list[list[str]] = []

    def __call__(self, command: list[str]) -> None:
        self.commands.append(command)
        if command[0] == "trtllm-build":
            args = parse_build(command)
            lora = None
            if "--lora_plugin" in args:
                lora = LoraSettings(
                    max_rank=int(args["--max_lora_rank"]),
                    target_modules=tuple(args["--lora_target_modules"]),
                )
            settings = TrtllmSettings(max_batch_size=int(args["--max_batch_size"]), lora=lora)
            out = Path(args["--output_dir"])
            (out / "config.json").write_text(json.dumps(engine_config(settings, self.version)))
            (out / "rank0.engine").write_bytes(b"plan")


class Quiet:
    def stage(self, text):
        pass

    def steps(self, total):
        return lambda *_: None


def test_build_skips_a_current_engine_and_rebuilds_on_change(repo, checkpoint_dir):
    fake = FakeTrtllmBuild()
    target = TrtllmTarget(run=fake, version=lambda: fake.version)
    spec = BuildSpec(model=checkpoint_dir)

    report = target.build(spec, repo, Quiet())
    assert not report.skipped and [c[0] for c in fake.commands][-1] == "trtllm-build"
    assert (repo.engine_version_dir / TOKENIZER_DIR / "tokenizer.json").is_file()
    assert (repo.engine_version_dir / "model.py").is_file()  # the tracked adapter stays
    assert [c[3:5] for c in fake.commands if "-m" in c] == [["--model_dir", str(checkpoint_dir)]]

    def builds(**change) -> int:
        before = len(fake.commands)
        target.build(BuildSpec(**{"model": checkpoint_dir, **change}), repo, Quiet())
        return (len(fake.commands) - before) // 2

    assert builds() == 0  # current: nothing runs
    assert builds(force=True) == 1
    assert builds(overrides={"max_queue_size": 9}) == 0  # a serving setting: configs only
    assert (
        parse_config(repo, "tensorrt_llm").dynamic_batching.default_queue_policy.max_queue_size == 9
    )
    assert builds(overrides={"max_batch_size": 16}) == 1
    fake.version = "1.3.0"
    assert builds(overrides={"max_batch_size": 16}) == 1  # another TensorRT-LLM
    os.remove(repo.engine_version_dir / "rank0.engine")
    assert builds(overrides={"max_batch_size": 16}) == 1


def test_a_checkpoint_inside_the_engine_folder_is_refused(repo, checkpoint_dir):
    import shutil

    inside = repo.engine_version_dir / "my_model"
    shutil.copytree(checkpoint_dir, inside)
    target = TrtllmTarget(run=FakeTrtllmBuild(), version=lambda: "1.2.1")
    with pytest.raises(ValueError, match="copy the checkpoint elsewhere"):
        target.build(BuildSpec(model=inside), repo, Quiet())
    assert (inside / "config.json").is_file()  # nothing was cleaned


def test_unavailable_here_names_the_image():
    reason = TrtllmTarget().unavailable_reason()
    assert reason is not None and "nvcr.io/nvidia/tritonserver" in reason


# -- LoRA --------------------------------------------------------------------------------
# NVIDIA's tensorrtllm backend reads these four parameters for its adapter cache
# (getPeftCacheConfigFromParams in inflight_batcher_llm/src/model_instance_state.cc;
# documented in tensorrtllm_backend's docs/lora.md with the defaults 8, 64, 0.05, 1 GiB).
LORA_CACHE_PARAMETERS = {
    "lora_cache_optimal_adapter_size": int,
    "lora_cache_max_adapter_size": int,
    "lora_cache_gpu_memory_fraction": float,
    "lora_cache_host_memory_bytes": int,
}


def test_the_shipped_config_builds_with_lora_on_every_module_a_peft_adapter_packs_into():
    settings = TrtllmSettings.load()
    args = parse_build(build_command(settings, Path("/ckpt"), Path("/engine")))
    assert args["--lora_plugin"] == "auto" and args["--max_lora_rank"] == "64"
    # Every module tritonllm.lora packs a PEFT adapter into, and nothing else.
    assert sorted(args["--lora_target_modules"]) == sorted(HF_TO_TRTLLM_MODULES.values())
    off = TrtllmSettings.from_dict({"lora": None})
    assert not {"--lora_plugin", "--lora_target_modules", "--max_lora_rank"} & set(
        parse_build(build_command(off, Path("/ckpt"), Path("/engine")))
    )
    small = TrtllmSettings.from_dict({"lora": {"max_rank": 16, "target_modules": ["attn_q"]}})
    args = parse_build(build_command(small, Path("/ckpt"), Path("/engine")))
    assert (args["--max_lora_rank"], args["--lora_target_modules"]) == ("16", ["attn_q"])
    assert small.lora.max_loras == LoraSettings().max_loras  # the rest keep their defaults


def test_the_backends_lora_cache_parameters_are_filled_from_the_lora_section(repo):
    lora = {"max_rank": 32, "cache_gpu_memory_fraction": 0.1, "cache_host_memory_bytes": 1 << 28}
    fill_configs(TrtllmSettings.from_dict({"lora": lora}), repo)
    trt = parse_config(repo, contract.TENSORRT_LLM)
    params = {k: v.string_value for k, v in trt.parameters.items()}
    values = {k: cast(params[k]) for k, cast in LORA_CACHE_PARAMETERS.items()}
    assert values == {
        "lora_cache_optimal_adapter_size": 8,
        "lora_cache_max_adapter_size": 32,  # a cache page fits a row of the largest rank
        "lora_cache_gpu_memory_fraction": 0.1,
        "lora_cache_host_memory_bytes": 1 << 28,
    }
    inputs = {t.name: t for t in trt.input}  # the contract's LoRA inputs, as upstream's
    for name in ("lora_task_id", "lora_weights", "lora_config"):
        dtype, dims, _ = UPSTREAM_TENSORS[name]
        assert (DTYPES[inputs[name].data_type], tuple(inputs[name].dims)) == (dtype, dims)
        assert inputs[name].optional
    fill_configs(TrtllmSettings(lora=None), repo)
    params = parse_config(repo, contract.TENSORRT_LLM).parameters
    assert not set(LORA_CACHE_PARAMETERS) & set(params)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ([64], "lora must be a mapping or null"),
        ({"max_ranks": 8}, "unknown lora setting"),
        ({"max_rank": 0}, "max_rank must be >= 1"),
        ({"max_rank": "64"}, "lora.max_rank must be a number"),
        ({"target_modules": ["attn_qkv"]}, "attn_qkv.*name some of attn_q"),
        ({"target_modules": []}, "name some of"),
        ({"target_modules": ["attn_q", "attn_q"]}, "twice"),
        ({"target_modules": "attn_q"}, "list of names"),
        ({"max_rank": 4}, r"cache_optimal_adapter_size must be in 1..max_rank \(4\)"),
        ({"cache_gpu_memory_fraction": 0}, r"\(0, 1\]"),
        ({"max_loras": 8, "max_cpu_loras": 4}, "at most max_cpu_loras"),
    ],
)
def test_bad_lora_settings_are_named(lora, message):
    with pytest.raises(SettingsError, match=message):
        TrtllmSettings.from_dict({"lora": lora})


def test_an_engine_is_rebuilt_when_its_lora_build_settings_change(tmp_path):
    settings = TrtllmSettings()
    (tmp_path / "config.json").write_text(json.dumps(engine_config(settings, "1.2.1")))
    (tmp_path / "rank0.engine").write_bytes(b"plan")
    assert engine_mismatch(tmp_path, settings, "1.2.1") is None
    rank8 = TrtllmSettings.from_dict({"lora": {"max_rank": 8}})
    assert "max_lora_rank is 64, the config says 8" in engine_mismatch(tmp_path, rank8, "1.2.1")
    attention = TrtllmSettings.from_dict({"lora": {"target_modules": ["attn_q", "attn_v"]}})
    assert "lora_target_modules are" in engine_mismatch(tmp_path, attention, "1.2.1")
    off = TrtllmSettings(lora=None)
    assert "with the LoRA plugin" in engine_mismatch(tmp_path, off, "1.2.1")
    (tmp_path / "config.json").write_text(json.dumps(engine_config(off, "1.2.1")))
    assert "without the LoRA plugin" in engine_mismatch(tmp_path, settings, "1.2.1")


def test_lora_cache_settings_refill_configs_and_rank_settings_rebuild(
    repo, checkpoint_dir, tmp_path
):
    fake = FakeTrtllmBuild()
    target = TrtllmTarget(run=fake, version=lambda: fake.version)

    def builds(lora: dict) -> int:
        config = tmp_path / "trtllm.yaml"
        config.write_text(json.dumps({"lora": lora}))  # JSON is YAML
        before = len(fake.commands)
        target.build(BuildSpec(model=checkpoint_dir, trtllm_config=config), repo, Quiet())
        return (len(fake.commands) - before) // 2

    assert builds({}) == 1
    assert builds({"cache_gpu_memory_fraction": 0.2, "max_loras": 4}) == 0  # serving only
    params = parse_config(repo, contract.TENSORRT_LLM).parameters
    assert params["lora_cache_gpu_memory_fraction"].string_value == "0.2"
    assert builds({"max_rank": 16}) == 1
    assert builds({"max_rank": 16}) == 0
    assert parse_build(fake.commands[-1])["--max_lora_rank"] == "16"
