"""The trtllm target: TensorRT-LLM engines for NVIDIA's tensorrtllm backend (GPU boxes).

One build is two commands from one config (:mod:`build_engines.trtllm_settings`):
checkpoint conversion (:mod:`build_engines.trtllm_convert`) into a scratch folder,
then ``trtllm-build`` into ``model_repository/tensorrt_llm/1/``. The tokenizer is
copied next to the engine (``tensorrt_llm/1/tokenizer``) so the repository is whole
on its own, and the four configs are filled for the tensorrtllm backend. A build is
skipped while the engine on disk matches the config, the checkpoint and the
installed TensorRT-LLM version (``FORCE=1`` rebuilds).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from build_engines import default_model, templates
from build_engines.repository import ModelRepository, write_if_changed
from build_engines.targets.base import BuildReport, BuildSpec, DynamicBatching, Reporter
from build_engines.targets.torch_engine import (
    RAGGED,
    TOKENIZER_FILES,
    model_fingerprint,
    tokenizer_step_values,
    validate_checkpoint,
)
from build_engines.trtllm_lora import render_backend_parameters
from build_engines.trtllm_settings import (
    CLI_OVERRIDES,
    SettingsError,
    TrtllmSettings,
    build_command,
    convert_command,
    engine_mismatch,
)
from tritonllm import contract
from tritonllm.tokenization import tokenizer_class_of

TOKENIZER_DIR = "tokenizer"  # inside tensorrt_llm/1/, next to the engine
# The tokenizer as XGrammar reads it, for the C++ backend's guided decoding.
XGRAMMAR_TOKENIZER_INFO = "xgrammar_tokenizer_info.json"  # in the tokenizer copy
_TOKENIZER_FILES = (
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",  # some tokenizers are chosen by the model_type
)


class TargetUnavailable(RuntimeError):
    pass


def run_command(command: list[str]) -> None:
    """Run a build step with its output on this terminal; fail with the command."""
    result = subprocess.run(command, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:3])} ... exited with code {result.returncode} (output above)"
        )


def installed_version() -> str | None:
    """TensorRT-LLM's ``__version__``, read from its file: importing the package would
    load torch, TensorRT and MPI just to name a version."""
    spec = importlib.util.find_spec("tensorrt_llm")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    match = re.search(r"__version__\s*=\s*[\"']([^\"']+)", version_file.read_text())
    return match.group(1) if match else None


# Why a TensorRT-LLM target cannot build here, and the fix (both TensorRT-LLM targets).
NOT_INSTALLED = (
    "TensorRT-LLM is not installed (no `tensorrt_llm` Python package): build inside "
    "the GPU image (docker/Dockerfile.gpu, on nvcr.io/nvidia/tritonserver:"
    "<yy.mm>-trtllm-python-py3) or use TARGET=torch for the CPU/torch engine"
)


class TrtllmTarget:
    name = "trtllm"

    def __init__(
        self,
        run: Callable[[list[str]], None] = run_command,
        version: Callable[[], str | None] = installed_version,
    ):
        self._run = run
        self._version = version

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("tensorrt_llm") is None:
            return NOT_INSTALLED
        if shutil.which("trtllm-build") is None:
            return (
                f"TensorRT-LLM {self._version() or '(version unknown)'} is installed without "
                "`trtllm-build`: its TensorRT engine backend was removed upstream (PyTorch is "
                "its only backend now); use TARGET=trtllm-pytorch (TARGET=auto picks it)"
            )
        return None

    def build(self, spec: BuildSpec, repo: ModelRepository, reporter: Reporter) -> BuildReport:
        start = time.monotonic()
        settings = load_settings(spec)
        checkpoint = validate_checkpoint(spec.model) if spec.model else repo.default_checkpoint_dir
        if spec.model and checkpoint.is_relative_to(repo.engine_version_dir):
            raise ValueError(
                f"MODEL={checkpoint} lies among the files a build replaces "
                f"({repo.engine_version_dir}): copy the checkpoint elsewhere first"
            )
        fingerprint = self._fingerprint(spec, settings)
        stale = self.stale_reason(repo, fingerprint, settings)
        skipped = stale is None and not spec.force
        if not skipped:
            reporter.stage(f"building the TensorRT-LLM engine: {stale or 'forced'}")
            repo.clean()
            if not spec.model:
                default_model.write_default_model(checkpoint, spec.size, reporter)
            self._build_engine(settings, checkpoint, repo, reporter)
            copy_tokenizer(checkpoint, repo.engine_version_dir / TOKENIZER_DIR)
        info = repo.engine_version_dir / TOKENIZER_DIR / XGRAMMAR_TOKENIZER_INFO
        if not skipped or not info.is_file():
            write_xgrammar_tokenizer_info(repo.engine_version_dir / TOKENIZER_DIR, info)
        reporter.stage("filling the model configs")
        fill_configs(
            settings,
            repo,
            spec.options.preprocessing_instance_count,
            spec.options.dynamic_batching,
            tokenizer_class_of(str(repo.engine_version_dir / TOKENIZER_DIR)),
        )
        repo.write_manifest(fingerprint)
        return BuildReport(
            self.name,
            str(repo.engine_version_dir),
            repo.reference(repo.engine_version_dir / TOKENIZER_DIR),
            skipped,
            time.monotonic() - start,
            repo.size_bytes(),
        )

    def _fingerprint(self, spec: BuildSpec, settings: TrtllmSettings) -> dict:
        model = model_fingerprint(spec)
        return {
            "target": self.name,
            "model": model,
            "build": settings.build_settings(),
            "tensorrt_llm": self._version(),
        }

    def stale_reason(
        self, repo: ModelRepository, fingerprint: dict, settings: TrtllmSettings
    ) -> str | None:
        """Why the repository's engine must be rebuilt (None: it is current)."""
        manifest = repo.read_manifest() or {}
        for key, what in (("target", "target"), ("model", "checkpoint"), ("build", "settings")):
            if manifest.get(key) != fingerprint[key]:
                return f"the {what} changed" if manifest else "no engine built yet"
        if not (repo.engine_version_dir / TOKENIZER_DIR).is_dir():
            return "the tokenizer copy is missing"
        return engine_mismatch(repo.engine_version_dir, settings, fingerprint["tensorrt_llm"])

    def _build_engine(self, settings, checkpoint: Path, repo: ModelRepository, reporter) -> None:
        # The converted checkpoint is as large as the model: a scratch folder beside
        # the repository (same disk, and Triton never sees it), removed afterwards.
        with tempfile.TemporaryDirectory(prefix="trtllm-checkpoint-", dir=repo.root.parent) as tmp:
            reporter.stage("converting the checkpoint for TensorRT-LLM")
            self._run(convert_command(settings, checkpoint, Path(tmp)))
            reporter.stage("trtllm-build (minutes for a large model)")
            self._run(build_command(settings, Path(tmp), repo.engine_version_dir))


def load_settings(spec: BuildSpec) -> TrtllmSettings:
    """The config file, with the engine options given on the command line on top."""
    torch_only = sorted(set(spec.overrides) - set(CLI_OVERRIDES))
    if torch_only:
        raise SettingsError(
            f"{', '.join(torch_only)} apply to the torch target only; "
            "the trtllm target takes its settings from --trtllm-config"
        )
    return TrtllmSettings.load(spec.trtllm_config, spec.overrides)


def copy_tokenizer(checkpoint: Path, destination: Path) -> None:
    destination.mkdir(parents=True, exist_ok=True)
    copied = [
        shutil.copy2(checkpoint / name, destination / name)
        for name in _TOKENIZER_FILES
        if (checkpoint / name).is_file()
    ]
    if not any(Path(p).name.startswith("tokenizer") for p in copied):
        raise RuntimeError(f"{checkpoint} has no tokenizer files to copy next to the engine")


def write_xgrammar_tokenizer_info(tokenizer_dir: Path, path: Path) -> None:
    """The JSON TensorRT-LLM's C++ backend reads for XGrammar (``xgrammar_tokenizer_info_path``),
    in the form of TensorRT-LLM's examples/generate_xgrammar_tokenizer_info.py."""
    import json

    from tritonllm.guided import xgrammar_tokenizer_info
    from tritonllm.tokenization import load_tokenizer

    info = xgrammar_tokenizer_info(load_tokenizer(str(tokenizer_dir)))
    path.write_text(json.dumps(info))


def fill_configs(
    settings: TrtllmSettings,
    repo: ModelRepository,
    preprocessing_instances: int = 1,
    batching: DynamicBatching | None = None,
    tokenizer_class: str = "",
):
    """The four configs for the tensorrtllm backend, all from ``settings`` (and the
    pre/postprocessing's dynamic batching and tokenizer class)."""
    tokenizer_dir = repo.engine_version_dir / TOKENIZER_DIR
    tokenizer_ref = repo.reference(tokenizer_dir)
    flags = settings.template_flags()
    flags["triton_max_batch_size"] = settings.triton_batch
    steps = tokenizer_step_values(
        settings.triton_batch,
        batching or DynamicBatching(),
        tokenizer_ref,
        preprocessing_instances,
        tokenizer_class,
    )
    values = {
        **steps,
        contract.TENSORRT_LLM: {
            **flags,
            "engine_dir": str(repo.engine_version_dir),
            # Absolute, as engine_dir: the C++ backend opens them itself.
            "tokenizer_dir": str(tokenizer_dir),
            "guided_decoding_backend": "xgrammar",
            "xgrammar_tokenizer_info_path": str(tokenizer_dir / XGRAMMAR_TOKENIZER_INFO),
            "lora_parameters": render_backend_parameters(settings.lora),
        },
    }
    for model, model_values in values.items():
        template = repo.template_path(model, TrtllmTarget.name)
        text = templates.fill(
            template,
            model,
            model_values,
            tensorrtllm=model == contract.TENSORRT_LLM,
            ragged=model in RAGGED,
            engine_extensions=(),
        )
        write_if_changed(repo.config_path(model), text)
