"""LoRA adapters in the configured directory (``lora.dynamic_lora_loading_path``): which
there are (the ingress: ``/v1/models`` and the 404 of an unknown one), and one read and
packed for the engine (the replica). The directory is a local path or any fsspec URL.

An adapter is a subdirectory holding PEFT's ``adapter_config.json`` and
``adapter_model.safetensors``; its name is the subdirectory's. Adapters are found at
runtime: one copied into the directory is servable once the listing is refreshed.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass

import fsspec

from tritonllm import lora

# How long a listing of the directory is reused: an adapter copied in answers within
# this (plus one listing), and a burst of requests lists the directory once.
LISTING_TTL_S = 3.0


def _filesystem(url: str):
    return fsspec.core.url_to_fs(url)


class AdapterCatalog:
    """The adapters found in one directory, listed at most once per ``ttl_s``."""

    def __init__(self, url: str, ttl_s: float = LISTING_TTL_S):
        # Opened now: a URL fsspec cannot open (an unknown protocol, its package such
        # as s3fs not installed) fails the ingress's start naming why, not each request.
        _filesystem(url)
        self.url = url
        self.ttl_s = ttl_s
        self._names: frozenset[str] = frozenset()
        self._listed_at = -float("inf")
        self._lock = asyncio.Lock()

    async def names(self) -> frozenset[str]:
        async with self._lock:  # one listing at a time; the others reuse it
            if time.monotonic() - self._listed_at > self.ttl_s:
                # fsspec's calls block (a remote store answers in 100s of ms).
                self._names = await asyncio.to_thread(list_adapters, self.url)
                self._listed_at = time.monotonic()
            return self._names


def list_adapters(url: str) -> frozenset[str]:
    """The names of the subdirectories of ``url`` that hold an adapter config."""
    fs, root = _filesystem(url)
    fs.invalidate_cache()  # remote filesystems cache listings themselves
    found = fs.glob(f"{root.rstrip('/')}/*/{lora.ADAPTER_CONFIG}")
    return frozenset(path.rstrip("/").split("/")[-2] for path in found)


@dataclass(frozen=True)
class Adapter:
    """An adapter packed for the engine, with its task id: stable for the same name
    and files, new when either changes (the engine caches adapters by task id)."""

    name: str
    task_id: int
    tensors: lora.LoraTensors


def read_adapter(url: str, name: str) -> Adapter:
    """Read and pack adapter ``name`` (blocking). Raises :class:`FileNotFoundError` when
    it is not there and :class:`tritonllm.lora.AdapterError` when it cannot be served."""
    fs, root = _filesystem(url)
    digest = hashlib.sha256(name.encode() + b"\0")

    def read_bytes(file: str) -> bytes:
        data = fs.cat_file(f"{root.rstrip('/')}/{name}/{file}")
        digest.update(data)
        return data

    tensors = lora.read_peft_dir(read_bytes)
    # 63 bits: a task id travels as UINT64, and some clients hold it as a signed int.
    task_id = int.from_bytes(digest.digest()[:8], "big") >> 1
    return Adapter(name, task_id, tensors)
