"""Typed access to the ``args`` Triton passes to a Python model's ``initialize``."""

from __future__ import annotations

import json
from pathlib import Path


class ModelArgs:
    def __init__(self, args: dict):
        self.config = json.loads(args["model_config"])
        # args["model_repository"] is this model's folder inside the repository.
        self.repository_root = Path(args["model_repository"]).resolve().parent
        self._params = {
            k: v.get("string_value", "") for k, v in self.config.get("parameters", {}).items()
        }

    def str(self, key: str, default: str = "") -> str:
        value = self._params.get(key, "")
        return default if value == "" or value.startswith("${") else value

    def int(self, key: str, default: int = 0) -> int:
        return int(self.str(key, str(default)))

    def bool(self, key: str, default: bool = False) -> bool:
        return self.str(key, str(default)).lower() in ("1", "true", "yes", "on")

    def path(self, key: str) -> Path:
        """A path parameter, absolute or relative to the model repository root."""
        value = self.str(key)
        if not value:
            raise ValueError(f"parameter {key} is not set: run `make engines`")
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.repository_root / path
