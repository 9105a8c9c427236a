"""scripts/gpu_smoke.sh stays the one script for a GPU box, with the PyTorch-backend part."""

from __future__ import annotations

import subprocess

from tests.conftest import ROOT
from tests.gpu import smoke_llmapi

SCRIPT = ROOT / "scripts" / "gpu_smoke.sh"


def test_the_script_runs_every_part_and_fails_when_one_does():
    text = SCRIPT.read_text()
    assert '-m bench.gpu_smoke "$@" || status=$?' in text
    assert "-m tests.gpu.smoke_llmapi" in text and text.rstrip().endswith('exit "$status"')
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_without_tensorrt_llm_the_pytorch_backend_steps_are_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(smoke_llmapi.Smoke, "gpu", lambda self: "a GPU (pretended)")
    assert smoke_llmapi.main(["--scratch", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "PyTorch backend: build" in table and "TensorRT-LLM is not installed" in table
    assert table.count("skipped") == 2
