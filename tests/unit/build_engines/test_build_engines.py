"""build_engines: errors that name the fix, targets, the generated-file policy."""

from __future__ import annotations

import json

import pytest

from build_engines.cli import main
from build_engines.repository import write_if_changed
from build_engines.targets import choose_target
from build_engines.targets.torch_engine import CheckpointError, validate_checkpoint
from build_engines.targets.trtllm_engine import TrtllmTarget


def test_missing_model_dir_names_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist.*local Hugging Face checkpoint"):
        validate_checkpoint(tmp_path / "nope")


def test_dir_without_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        validate_checkpoint(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(CheckpointError, match="not a causal LM"):
        validate_checkpoint(tmp_path)


def test_checkpoint_without_weights(tmp_path, checkpoint_dir):
    (tmp_path / "config.json").write_text((checkpoint_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no weights"):
        validate_checkpoint(tmp_path)


def test_a_real_checkpoint_validates(checkpoint_dir):
    assert validate_checkpoint(checkpoint_dir) == checkpoint_dir.resolve()


def test_trtllm_target_says_what_is_missing():
    reason = TrtllmTarget().unavailable_reason()
    assert reason is not None and "TensorRT-LLM is not installed" in reason
    assert "TARGET=torch" in reason


def test_auto_picks_torch_without_tensorrt_llm():
    assert choose_target("auto").name == "torch"


def test_cli_reports_errors_with_exit_code_2(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--target", "trtllm"]) == 2
    assert "TensorRT-LLM is not installed" in capsys.readouterr().err


def test_copy_layout_takes_the_tracked_files_and_nothing_a_build_wrote(built_repository, tmp_path):
    from build_engines.repository import ModelRepository

    copy = ModelRepository(built_repository).copy_layout(tmp_path / "repo")
    files = {p.relative_to(copy.root).as_posix() for p in copy.root.rglob("*") if p.is_file()}
    assert "tensorrt_llm/1/model.py" in files and "tensorrt_llm/config.pbtxt.torch.in" in files
    assert not [f for f in files if f.endswith("config.pbtxt") or "hf_model" in f]
    assert ".build.json" not in files


@pytest.fixture
def embedding_copy(tmp_path):
    from build_engines.repository import EmbeddingRepository
    from tests.conftest import EMBEDDING_REPOSITORY

    return EmbeddingRepository(EMBEDDING_REPOSITORY).copy_layout(tmp_path / "embedding_repository")


def test_cli_fills_the_embeddings_repository_from_the_package(
    embedding_copy, embedding_model_dir, capsys
):
    args = ["--only", "embeddings", "--embedding-repository", str(embedding_copy.root)]
    assert main(args) == 0
    weights = embedding_copy.default_checkpoint_dir / "model.safetensors"
    assert weights.read_bytes() == (embedding_model_dir / "model.safetensors").read_bytes()
    assert "dynamic_batching {" in embedding_copy.config_path("embeddings").read_text()
    assert "built in" in capsys.readouterr().err
    assert main([*args, "--no-dynamic-batching"]) == 0
    assert "up to date" in capsys.readouterr().err  # options refill the config only
    assert "dynamic_batching {" not in embedding_copy.config_path("embeddings").read_text()
    assert main([*args, "--clean"]) == 0
    files = {p.relative_to(embedding_copy.root).as_posix() for p in embedding_copy.root.rglob("*")}
    assert files == {
        "embeddings",
        "embeddings/1",
        "embeddings/1/model.py",
        "embeddings/config.pbtxt.in",
    }


def test_cli_refuses_what_the_embeddings_server_cannot_run(embedding_copy, tmp_path, capsys):
    args = ["--only", "embeddings", "--embedding-repository", str(embedding_copy.root)]
    assert main([*args, "--embeddings-model", str(tmp_path)]) == 2
    assert "no modules.json" in capsys.readouterr().err
    assert main([*args, "--preferred-batch-sizes", "8,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main([*args, "--preferred-batch-sizes", "64"]) == 2
    assert "must lie in 1..32" in capsys.readouterr().err


def test_the_null_target_fills_the_torch_configs_with_the_null_engine(
    built_repository, checkpoint_dir, tmp_path, capsys
):
    from build_engines.repository import ModelRepository

    copy = ModelRepository(built_repository).copy_layout(tmp_path / "repo")
    args = ["--only", "llm", "--repository", str(copy.root), "--model", str(checkpoint_dir)]
    assert main([*args, "--target", "null", "--null-step-ms", "2.5"]) == 0
    config = copy.config_path("tensorrt_llm").read_text()
    assert 'key: "engine" value: { string_value: "null" }' in config
    assert 'key: "null_step_ms" value: { string_value: "2.5" }' in config
    assert 'key: "stream_chunks_per_s" value: { string_value: "1000.0" }' in config
    # The same template, the model's engine; a build option refills the config.
    assert main([*args, "--target", "torch", "--stream-chunks-per-s", "0"]) == 0
    config = copy.config_path("tensorrt_llm").read_text()
    assert 'key: "engine" value: { string_value: "torch" }' in config
    assert 'key: "stream_chunks_per_s" value: { string_value: "0.0" }' in config
    assert main([*args, "--target", "torch", "--stream-chunks-per-s", "-5"]) == 2
    assert "give 0 (no budget) or more" in capsys.readouterr().err
    assert 'key: "guide_compile_timeout_s" value: { string_value: "5.0" }' in config
    assert main([*args, "--target", "torch", "--guide-compile-timeout-s", "0"]) == 2
    assert "--guide-compile-timeout-s 0.0: give a time in seconds above 0" in (
        capsys.readouterr().err
    )


def test_a_config_is_written_only_when_it_changes_and_never_half(tmp_path):
    """An up-to-date build leaves its files as they were (two test runs side by side
    refill one repository while Tritons read it)."""
    path = tmp_path / "config.pbtxt"
    write_if_changed(path, "a")
    before = path.stat()
    write_if_changed(path, "a")
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    write_if_changed(path, "b")
    assert path.read_text() == "b" and path.stat().st_ino != before.st_ino  # renamed over
    assert [p.name for p in tmp_path.iterdir()] == ["config.pbtxt"]
