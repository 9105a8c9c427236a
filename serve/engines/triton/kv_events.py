"""routing: kv_aware, the Triton replica's side: where its engine publishes its KV
cache events, and what the replica tells the router of them through Serve's routing
stats (serve/routing/kv_aware.py reads them)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray

from serve.config import ModelConfig
from serve.engines.triton import repository
from serve.engines.triton.launcher import free_port
from serve.routing.kv_index import KV_EVENT_METADATA
from tritonllm import contract


@dataclass(frozen=True)
class KvEventEndpoints:
    port: int  # the engine's PUB socket
    replay_port: int  # its ROUTER socket (what a late subscriber missed)
    block_size: int
    max_num_batched_tokens: int

    @classmethod
    def open(cls, model: ModelConfig) -> KvEventEndpoints | None:
        """Ports for the replica's engine, set where its Triton's Python stubs read them
        (call before Triton starts); None for an engine that publishes none (the app
        routed that model as prefix_aware: serve/app.py's kv_aware_router)."""
        path, engine = model.triton.repository_path(), model.engine_model()
        block_size = repository.kv_event_block_size(path, engine)
        if block_size is None:
            return None
        parameters = repository.read_config(path, engine).parameters
        batched = (
            parameters["max_num_tokens"].string_value if "max_num_tokens" in parameters else ""
        )
        # Free now, bound by the engine seconds later (one taken meanwhile: the engine
        # logs it and publishes nothing, and the model routes by load).
        port, replay_port = free_port(), free_port()
        os.environ[contract.KV_EVENTS_ENDPOINTS_ENV] = f"tcp://*:{port},tcp://*:{replay_port}"
        return cls(port, replay_port, block_size, int(batched) if batched.isdigit() else 8192)

    def routing_stats(self, adapters: dict[str, int]) -> dict:
        """The replica's ``record_routing_stats``: where to subscribe, and the name its
        engine gives each loaded adapter's blocks (the adapter's task id)."""
        host = ray.util.get_node_ip_address()
        return {
            KV_EVENT_METADATA: {
                "endpoint": f"tcp://{host}:{self.port}",
                "replay_endpoint": f"tcp://{host}:{self.replay_port}",
                "block_size": self.block_size,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "adapters": {name: str(task_id) for name, task_id in adapters.items()},
            }
        }
