"""The trtllm-pytorch target on CPU: which target `auto` picks, the configs and options it
writes, and that they parse as Triton's ModelConfig on our tensor contract.

TensorRT-LLM itself is not here: its presence is faked where the choice of target is
under test (an installed package folder with a version.py, ``trtllm-build`` on PATH or
not); what the LLM API then does with the options needs a GPU (scripts/gpu_smoke.sh).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import shutil

import pytest
import yaml
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from build_engines import cli
from build_engines.repository import ModelRepository
from build_engines.targets import auto_target, choose_target
from build_engines.targets.base import BuildSpec
from build_engines.targets.trtllm_engine import TrtllmTarget
from build_engines.targets.trtllm_pytorch import TrtllmPytorchTarget
from build_engines.trtllm_settings import SettingsError, TrtllmSettings, llm_api_options
from serve.engines.triton import repository as serve_repository
from tests.conftest import REPOSITORY
from tritonllm import contract
from tritonllm.llmapi import OPTIONS_FILE
from tritonllm.model_args import ModelArgs


class Quiet:
    def stage(self, text):
        pass

    def steps(self, total):
        return lambda *_: None


@pytest.fixture
def repo(tmp_path) -> ModelRepository:
    return ModelRepository(REPOSITORY).copy_layout(tmp_path / "model_repository")


@pytest.fixture
def fake_tensorrt_llm(tmp_path, monkeypatch):
    """Makes ``tensorrt_llm`` look installed at a version, ``trtllm-build`` present or not."""
    package = tmp_path / "site" / "tensorrt_llm"
    package.mkdir(parents=True)
    real_find_spec, real_which = importlib.util.find_spec, shutil.which
    state = {"trtllm_build": True}

    def find_spec(name, *args, **kwargs):
        if name == "tensorrt_llm":
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(package)]
            return spec
        return real_find_spec(name, *args, **kwargs)

    def which(command, *args, **kwargs):
        if command == "trtllm-build":
            return "/usr/local/bin/trtllm-build" if state["trtllm_build"] else None
        return real_which(command, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(shutil, "which", which)

    def install(version: str, trtllm_build: bool) -> None:
        (package / "version.py").write_text(f'__version__ = "{version}"\n')
        state["trtllm_build"] = trtllm_build

    return install


def test_auto_picks_the_engine_build_only_where_trtllm_build_exists(fake_tensorrt_llm):
    fake_tensorrt_llm("1.2.1", trtllm_build=True)  # the 26.07 image
    assert auto_target() == "trtllm"
    fake_tensorrt_llm("1.4.0", trtllm_build=False)  # after the TensorRT backend's removal
    assert auto_target() == "trtllm-pytorch"
    reason = TrtllmTarget().unavailable_reason()
    assert "1.4.0" in reason and "TARGET=trtllm-pytorch" in reason and "removed" in reason
    fake_tensorrt_llm("0.21.0", trtllm_build=False)  # too old for either: the torch engine
    assert auto_target() == "torch"
    assert "predates" in TrtllmPytorchTarget().unavailable_reason()


def test_without_tensorrt_llm_the_target_says_where_to_build():
    reason = TrtllmPytorchTarget().unavailable_reason()
    assert "TensorRT-LLM is not installed" in reason and "TARGET=torch" in reason
    assert choose_target("trtllm-pytorch").name == "trtllm-pytorch"
    assert cli.main(["--target", "trtllm-pytorch", "--only", "llm"]) == 2


def parse(repo: ModelRepository, model: str) -> model_config_pb2.ModelConfig:
    text = repo.config_path(model).read_text()
    assert "${" not in text, f"{model}: unfilled placeholder"
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_the_llmapi_config_is_a_python_model_on_our_contract(repo, checkpoint_dir):
    report = TrtllmPytorchTarget(version=lambda: "1.4.0").build(
        BuildSpec(model=checkpoint_dir), repo, Quiet()
    )
    assert report.target == "trtllm-pytorch" and not report.skipped
    config = parse(repo, contract.TENSORRT_LLM)
    assert config.backend == "python" and config.default_model_filename == "llmapi.py"
    assert config.model_transaction_policy.decoupled
    inputs, outputs = contract.MODELS[contract.TENSORRT_LLM]
    # Without our engine extensions but why a sequence ended (the adapter's): the API
    # refuses what needs the others for this target.
    inputs = [t for t in inputs if not t.engine_extension]
    outputs = [t for t in outputs if not t.engine_extension or t == contract.FINISH_REASON]
    assert [(t.name, t.dims, t.optional) for t in config.input] == [
        (t.name, list(t.dims), t.optional) for t in inputs
    ]
    assert [t.name for t in config.output] == [t.name for t in outputs]
    ensemble = parse(repo, contract.ENSEMBLE)
    engine_step = next(
        s for s in ensemble.ensemble_scheduling.step if s.model_name == "tensorrt_llm"
    )
    assert engine_step.output_map[contract.FINISH_REASON.name] == contract.FINISH_REASON.name
    types = {t.name: model_config_pb2.DataType.Name(t.data_type) for t in config.input}
    assert types == {t.name: t.triton_dtype for t in inputs}
    for model in contract.MODELS:  # every config of the repository parses
        assert parse(repo, model).max_batch_size == TrtllmSettings().max_batch_size
    # The adapter finds what it needs the way it will inside Triton.
    args = ModelArgs(
        {
            "model_config": json.dumps(
                json_format.MessageToDict(config, preserving_proto_field_name=True)
            ),
            "model_repository": str(repo.model_dir(contract.TENSORRT_LLM)),
        }
    )
    # The checkpoint is linked into the repository: it is whole where it is mounted.
    assert config.parameters["engine_dir"].string_value == "tensorrt_llm/1/hf_model"
    served = args.path("engine_dir")
    assert served == repo.default_checkpoint_dir
    assert (served / "config.json").read_bytes() == (checkpoint_dir / "config.json").read_bytes()
    options_path = args.path("llm_api_options")
    assert options_path == repo.engine_version_dir / OPTIONS_FILE
    assert yaml.safe_load(options_path.read_text()) == llm_api_options(TrtllmSettings())
    assert args.int("max_batch_size") == 64 and args.int("max_queue_size") == 256
    assert args.int("max_input_len") == 2048 and args.int("max_seq_len") == 4096
    assert float(args.str("stream_chunks_per_s")) == 1000  # the response thread's budget
    # No engine: the checkpoint, the options and the tracked adapters.
    assert sorted(p.name for p in repo.engine_version_dir.iterdir()) == [
        "hf_model",
        "llm_api_options.yaml",
        "llmapi.py",
        "model.py",
    ]
    # The Serve app reads its batch size, tokenizer and KV-cache share from here.
    assert serve_repository.engine_batch_size(repo.root) == 64
    assert serve_repository.kv_cache_fraction(repo.root) == 0.85
    assert serve_repository.tokenizer_dir(repo.root) == repo.root / "tensorrt_llm/1/hf_model"


def test_options_come_from_trtllm_yaml_and_rebuilds_are_configs_only(repo, checkpoint_dir):
    target = TrtllmPytorchTarget(version=lambda: "1.4.0")
    spec = BuildSpec(model=checkpoint_dir)
    assert not target.build(spec, repo, Quiet()).skipped
    assert target.build(spec, repo, Quiet()).skipped  # nothing changed
    changed = BuildSpec(model=checkpoint_dir, overrides={"max_batch_size": 8})
    assert not target.build(changed, repo, Quiet()).skipped
    options = yaml.safe_load((repo.engine_version_dir / OPTIONS_FILE).read_text())
    assert options["max_batch_size"] == 8
    assert options["kv_cache_config"] == {
        "free_gpu_memory_fraction": 0.85,
        "enable_block_reuse": True,  # KvCacheConfig(enable_block_reuse=True): prefix reuse
    }
    assert options["scheduler_config"] == {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}
    assert parse(repo, contract.TENSORRT_LLM).max_batch_size == 8


def test_settings_the_pytorch_backend_cannot_serve_are_refused():
    with pytest.raises(SettingsError, match="max_beam_width"):
        llm_api_options(TrtllmSettings(max_beam_width=2))
    no_cap = llm_api_options(TrtllmSettings(max_seq_len=0, max_input_len=2048))
    assert "max_seq_len" not in no_cap  # the model's own context length


def test_a_checkpoint_inside_the_version_folder_is_refused(repo, checkpoint_dir):
    inside = repo.engine_version_dir / "my_model"
    shutil.copytree(checkpoint_dir, inside)
    with pytest.raises(ValueError, match="copy the checkpoint elsewhere"):
        TrtllmPytorchTarget(version=lambda: "1.4.0").build(BuildSpec(model=inside), repo, Quiet())
