"""make bench-lora's own parts: the mix of adapters, the stack's config, the figures."""

from __future__ import annotations

import math

from bench.lora import AdapterMix, lora_config, summary
from serve.config import AppConfig
from tests.conftest import REPOSITORY


def test_each_request_of_the_mix_names_the_next_adapter():
    mix = AdapterMix("adapters", "http://127.0.0.1:1", ["m:a", "m:b", "m:c"])
    models = [mix.body("p", 4)["model"] for _ in range(4)]
    assert models == ["m:a", "m:b", "m:c", "m:a"]
    assert mix.body("p", 4)["min_tokens"] == 4  # the loadgen's body otherwise


def test_the_stack_serves_the_adapter_directory_and_its_config_validates(tmp_path):
    config = lora_config(REPOSITORY, tmp_path, 8123, streams=16)
    args = config["applications"][0]["args"]
    (model,) = args["models"]
    assert model["lora"] == {"dynamic_lora_loading_path": str(tmp_path)}
    assert model["deployment"]["num_replicas"] == 1
    assert AppConfig.model_validate(args).models[0].lora.adapters_url() == str(tmp_path)


def test_tokens_per_s_are_pooled_over_rounds_and_ttfts_are_medians():
    levels = [
        {"system": "base", "output_tokens_per_s": 100.0, "seconds": 10.0},
        {"system": "adapters", "output_tokens_per_s": 80.0, "seconds": 10.0},
        {"system": "base", "output_tokens_per_s": 200.0, "seconds": 5.0},
        {"system": "adapters", "output_tokens_per_s": 100.0, "seconds": 10.0},
    ]
    for level in levels:
        level |= {"errors": 0, "rejected_503": 0}
    levels[1]["errors"] = 1
    ttfts = [{"cold_ms": c, "cached_ms": c / 10, "base_ms": 5.0} for c in (300.0, 100.0, 200.0)]
    s = summary(levels, ttfts)
    assert s["base_tokens_per_s"] == 2000 / 15 and s["adapters_tokens_per_s"] == 90.0
    assert math.isclose(s["ratio"], 90.0 / (2000 / 15))
    assert (s["ttft_cold_ms"], s["ttft_cached_ms"], s["ttft_base_ms"]) == (200.0, 20.0, 5.0)
    assert s["errors"] == 1
