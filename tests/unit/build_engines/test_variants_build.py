"""The repository of a pool of variants: names, shared steps, renamed configs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build_engines.repository import ModelRepository
from build_engines.targets.base import EngineOptions
from build_engines.variants import build_variants, parse_variants
from tests.conftest import ROOT


class Quiet:
    def stage(self, text):
        pass

    def steps(self, total):
        return lambda *_: None


def parse(path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_variant_specs_are_name_equals_dir():
    assert parse_variants(["a=/x", "b.2=/y"]) == {
        "a": Path("/x"),
        "b.2": Path("/y"),
    }
    for bad in (["a"], ["../a=/x"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError):
            parse_variants(bad)


def test_a_pool_shares_pre_and_postprocessing_and_renames_each_variant(checkpoint_dir, tmp_path):
    second = tmp_path / "second"
    shutil.copytree(checkpoint_dir, second)
    source = ModelRepository(ROOT / "model_repository")
    root = tmp_path / "pool"
    build_variants(source, root, {"a": checkpoint_dir, "b": second}, EngineOptions(), Quiet())
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [
        "ensemble-a",
        "ensemble-b",
        "postprocessing",
        "preprocessing",
        "tensorrt_llm-a",
        "tensorrt_llm-b",
    ]
    ensemble = parse(root / "ensemble-b" / "config.pbtxt")
    assert ensemble.name == "ensemble-b"
    steps = [s.model_name for s in ensemble.ensemble_scheduling.step]
    assert steps == ["preprocessing", "tensorrt_llm-b", "postprocessing"]
    engine = parse(root / "tensorrt_llm-b" / "config.pbtxt")
    assert engine.name == "tensorrt_llm-b"
    assert engine.parameters["engine_dir"].string_value == str(second.resolve())
    assert (root / "tensorrt_llm-b" / "1" / "model.py").is_file()


def test_variants_with_another_tokenizer_are_refused(checkpoint_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(checkpoint_dir, other)
    (other / "tokenizer.json").write_text("{}")
    source = ModelRepository(ROOT / "model_repository")
    with pytest.raises(ValueError, match="another tokenizer"):
        build_variants(
            source, tmp_path / "pool", {"a": checkpoint_dir, "b": other}, EngineOptions(), Quiet()
        )
    with pytest.raises(ValueError, match="repository of its own"):
        build_variants(source, source.root, {"a": checkpoint_dir}, EngineOptions(), Quiet())
