"""The application's configuration: Serve YAML ``args``, validated once with pydantic.

Errors name the bad field (pydantic's own messages). Serve's own deployment
options (autoscaling_config, max_ongoing_requests, ray_actor_options, ...) pass
through unchanged to ``.options()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ROOT = Path(__file__).resolve().parent.parent


class TritonConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_repository: Path = Field(
        ROOT / "model_repository",
        description="the built model repository (make engines); relative to the project root",
    )
    mode: Literal["auto", "in_process", "sidecar"] = Field(
        "auto",
        description="auto: in-process where the tritonserver API loads, else sidecar; "
        "in_process or sidecar force one (serve/triton/select.py)",
    )
    start_timeout_s: float = Field(300.0, gt=0, description="how long Triton may take to load")

    def repository_path(self) -> Path:
        path = self.model_repository.expanduser()
        return path if path.is_absolute() else ROOT / path


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: str = Field(
        "tritonllm-default",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$",
        description="the name clients send as `model`",
    )
    triton: TritonConfig = Field(default_factory=TritonConfig)
    max_tokens_cap: int = Field(512, gt=0, description="largest max_tokens a request may ask")
    default_max_tokens: int = Field(64, gt=0, description="max_tokens when a request sets none")
    max_body_bytes: int = Field(
        1 << 20, gt=0, description="larger request bodies get a 413 before they are read"
    )
    replica_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Serve deployment options of the Triton replicas (autoscaling_config, "
        "max_ongoing_requests, ray_actor_options, ...)",
    )
    ingress_options: dict[str, Any] = Field(
        default_factory=dict, description="Serve deployment options of the HTTP ingress"
    )

    def tokenizer_dir(self) -> Path:
        """The tokenizer the repository's preprocessing model uses (one source of truth)."""
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2

        repository = self.triton.repository_path()
        path = repository / "preprocessing" / "config.pbtxt"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: run `make engines` first")
        config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        tokenizer_dir = Path(config.parameters["tokenizer_dir"].string_value)
        return tokenizer_dir if tokenizer_dir.is_absolute() else repository / tokenizer_dir
