"""Several models in one application, and a pool of variants multiplexed over replicas.

Real cluster (``ray start --head`` + ``serve deploy``), real Triton per replica. The
variants are the default model with seeded changes to its weights, so each writes
its own text; every answer is checked against transformers' ``generate()`` of that
variant's own checkpoint.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.cluster import app_config, triton_http_url, triton_index
from tests.integration.repositories import repository_with_limits
from tests.integration.test_prefix_routing import OPENINGS, prefix_counters, served_by
from tests.integration.variants import build_pool, write_variants
from tests.reference import hf_greedy

pytestmark = pytest.mark.integration
PROMPT = "The cat"
POOL = "tritonllm-pool"
FIXED = {"autoscaling_config": None, "num_replicas": 1, "health_check_period_s": 2}


@pytest.fixture(scope="module")
def variants(checkpoint_dir, tmp_path_factory):
    return write_variants(
        checkpoint_dir, tmp_path_factory.mktemp("variants"), ["ft-a", "ft-b", "ft-c", "other"]
    )


@pytest.fixture(scope="module")
def expected(variants, tokenizer):
    """Each variant's greedy continuation of PROMPT, as text."""
    from transformers import AutoModelForCausalLM

    texts = {}
    for name, path in variants.items():
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
        ids = hf_greedy(model, tokenizer, PROMPT, 12)
        texts[name] = tokenizer.decode(ids, skip_special_tokens=True)
    assert len(set(texts.values())) == len(texts), texts  # the variants do differ
    return texts


@pytest.fixture(scope="module")
def pool_repository(variants, tmp_path_factory):
    pool = {name: variants[name] for name in ("ft-a", "ft-b", "ft-c")}
    return build_pool(pool, tmp_path_factory.mktemp("pool") / "repository")


def complete(cluster, model: str, headers: dict | None = None) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12}
    return httpx.post(f"{cluster.url}/v1/completions", json=body, headers=headers, timeout=120)


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def pool_model(repository, replicas: int, **extra) -> dict:
    return {
        "id": POOL,
        "triton": {"model_repository": str(repository)},
        "variants": ["ft-a", "ft-b", "ft-c"],
        "max_models_per_replica": 2,
        "deployment": {**FIXED, "num_replicas": replicas},
        **extra,
    }


def loaded_variants(index: dict[str, str]) -> set[str]:
    return {
        n.removeprefix("ensemble-")
        for n, s in index.items()
        if n.startswith("ensemble-") and s == "READY"
    }


def test_two_models_side_by_side_each_with_its_own_resources_and_output(
    cluster, built_repository, variants, expected, tmp_path
):
    other = repository_with_limits(variants["other"], tmp_path / "other")
    cluster.deploy(
        app_config(
            [
                {
                    "id": "tritonllm-default",
                    "triton": {"model_repository": str(built_repository)},
                    "deployment": FIXED,
                },
                {
                    "id": "tritonllm-other",
                    "triton": {"model_repository": str(other)},
                    "deployment": {**FIXED, "ray_actor_options": {"num_cpus": 0.5}},
                },
            ]
        )
    )
    details = cluster.wait_running()
    listed = httpx.get(f"{cluster.url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in listed] == ["tritonllm-default", "tritonllm-other"]
    assert text(complete(cluster, "tritonllm-other")) == expected["other"]
    default = text(complete(cluster, "tritonllm-default"))
    assert default != expected["other"] and default
    unknown = complete(cluster, "tritonllm-nope")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    actor = details["deployments"]["Triton-tritonllm-other"]["deployment_config"]
    assert actor["ray_actor_options"]["num_cpus"] == 0.5
    default_actor = details["deployments"]["Triton-tritonllm-default"]["deployment_config"]
    assert default_actor["ray_actor_options"]["num_cpus"] == 1


def test_one_replica_loads_variants_on_first_use_and_unloads_the_least_recently_used(
    cluster, pool_repository, expected
):
    cluster.deploy(app_config([pool_model(pool_repository, replicas=1)]))
    cluster.wait_running()
    (replica,) = cluster.running_replicas("llm", f"Triton-{POOL}")
    assert loaded_variants(triton_index(replica)) == set()
    listed = [m["id"] for m in httpx.get(f"{cluster.url}/v1/models", timeout=30).json()["data"]]
    assert listed == ["ft-a", "ft-b", "ft-c"]

    steps = [  # (variant asked, variants loaded after it, least recently used first)
        ("ft-a", {"ft-a"}),
        ("ft-b", {"ft-a", "ft-b"}),
        ("ft-c", {"ft-b", "ft-c"}),  # ft-a was the least recently used
        ("ft-b", {"ft-b", "ft-c"}),  # already loaded: no load
        ("ft-a", {"ft-a", "ft-b"}),  # ft-c is now the least recently used
    ]
    for variant, loaded in steps:
        assert text(complete(cluster, variant)) == expected[variant]
        index = triton_index(replica)
        assert loaded_variants(index) == loaded, (variant, index)
    logs = (cluster.logs_dir() / "serve").glob(f"replica_llm_Triton-{POOL}_*.log")
    log_text = "".join(p.read_text() for p in logs)
    assert log_text.count("loading variant ft-b") == 1  # the second ft-b loaded nothing

    # Serve's own header names the variant as `model` does.
    header = complete(cluster, POOL, headers={"serve_multiplexed_model_id": "ft-c"})
    assert text(header) == expected["ft-c"]
    bare = complete(cluster, POOL)
    assert bare.status_code == 404 and "ft-a, ft-b, ft-c" in bare.json()["error"]["message"]


def test_two_replicas_route_each_variant_to_a_replica_that_holds_it(
    cluster, pool_repository, expected
):
    cluster.deploy(app_config([pool_model(pool_repository, replicas=2)]))
    cluster.wait_running()
    replicas = cluster.running_replicas("llm", f"Triton-{POOL}")
    assert len(replicas) == 2
    for variant in ("ft-a", "ft-b", "ft-c"):
        assert text(complete(cluster, variant)) == expected[variant]
    before = [loaded_variants(triton_index(r)) for r in replicas]
    assert set().union(*before) == {"ft-a", "ft-b", "ft-c"}
    assert all(len(held) <= 2 for held in before)
    for _ in range(3):
        for variant in ("ft-a", "ft-b", "ft-c"):
            assert text(complete(cluster, variant)) == expected[variant]
    after = [loaded_variants(triton_index(r)) for r in replicas]
    assert after == before  # every request went to a replica already holding its variant


def test_prefix_aware_routing_keeps_each_variant_on_a_replica_that_holds_it(
    cluster, pool_repository, variants, tokenizer
):
    """routing: prefix_aware over a pool: each request goes to a replica already holding
    its variant (no second load of any variant), answers with that variant's own text,
    and a variant's conversation reuses its replica's prefix cache."""
    from transformers import AutoModelForCausalLM

    cluster.deploy(app_config([pool_model(pool_repository, replicas=2, routing="prefix_aware")]))
    cluster.wait_running()
    replicas = cluster.running_replicas("llm", f"Triton-{POOL}")
    urls = [triton_http_url(r, port="metrics") for r in replicas]
    models = {
        v: AutoModelForCausalLM.from_pretrained(variants[v], local_files_only=True).eval()
        for v in ("ft-a", "ft-b", "ft-c")
    }
    served, loaded = {}, None
    for turn in range(3):
        for variant, opening in zip(models, OPENINGS, strict=False):
            prompt = opening + "".join(f" Question {t}: where next?" for t in range(turn + 1))
            before = [prefix_counters(u) for u in urls]
            body = {"model": variant, "prompt": prompt, "max_tokens": 6}
            response = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
            ids = hf_greedy(models[variant], tokenizer, prompt, 6)
            want = tokenizer.decode(ids, skip_special_tokens=True)
            assert text(response) == want, (variant, turn)
            served.setdefault(variant, set()).add(served_by(urls, before))
        held = [loaded_variants(triton_index(r)) for r in replicas]
        if loaded is None:  # after each variant's first request: each loaded once
            loaded = held
            assert set().union(*held) == set(models), held
            time.sleep(2)  # the replicas' pushes of what they hold reach the router
        assert held == loaded, (turn, held)  # no variant was loaded again anywhere
    assert all(len(s) == 1 for s in served.values()), served
    assert all(variant in loaded[min(s)] for variant, s in served.items()), (served, loaded)
    hits = sum(prefix_counters(u)[1] for u in urls)
    assert hits >= len(models) * 2 * 16  # turns 2 and 3 reused at least a block each
