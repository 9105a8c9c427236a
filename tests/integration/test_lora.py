"""LoRA adapters through the whole stack: real cluster, real Triton, the default model.

Five adapters are made with PEFT on the default model (tests/lora_adapters.py) and put
in the adapter directory; each one's greedy output through the HTTP API (the openai
SDK), whole and streamed, mixed with the other adapters and the base, must equal PEFT's
own. One application serves two models over that directory, deployed once for the
module: the default model (adapters up to rank 16) and ``lora-small``, whose replica
keeps 2 adapters and whose engine's adapter cache holds about 2 (the eviction test).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import openai
import pytest

from bench.common import set_engine_parameter
from tests.integration.cluster import app_config, descendants
from tests.lora_adapters import make_adapter, make_adapters, other_base
from tests.reference import hf_greedy
from tritonllm import lora

pytestmark = pytest.mark.integration

BASE = "tritonllm-default"
SMALL = "lora-small"
PROMPT = "The cat"
TOKENS = 16
ALIAS = "support"  # an alias of adapter-2
FIXED = {"autoscaling_config": None, "num_replicas": 1, "health_check_period_s": 2}


def peft_greedy(model, tokenizer, prompt: str, tokens: int) -> str:
    """PEFT's own greedy continuation of ``prompt``, ``tokens`` long whatever the end
    token (the requests say ignore_eos), as text."""
    generated = hf_greedy(model, tokenizer, prompt, tokens, ignore_eos=True)
    assert len(generated) == tokens
    return tokenizer.decode(generated, skip_special_tokens=True)


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def adapters(checkpoint_dir, adapters_dir):
    """adapter-0 .. adapter-4 (ranks 4 to 16), made and saved by PEFT."""
    made = make_adapters(checkpoint_dir, adapters_dir)
    return {f"adapter-{i}": adapter for i, adapter in enumerate(made)}


@pytest.fixture(scope="module")
def expected(adapters, hf_model, tokenizer):
    texts = {name: peft_greedy(a.model, tokenizer, PROMPT, TOKENS) for name, a in adapters.items()}
    texts[None] = peft_greedy(hf_model, tokenizer, PROMPT, TOKENS)
    assert len(set(texts.values())) == len(texts), texts  # every adapter changes the output
    return texts


@pytest.fixture(scope="module")
def bad_adapters(checkpoint_dir, adapters, adapters_dir, tmp_path_factory):
    """Adapters in the directory that the default model cannot serve, by name."""
    scratch = tmp_path_factory.mktemp("bad")
    other = other_base(scratch / "other-base")
    spec = adapters["adapter-0"].spec
    make_adapter(other, spec, 7, adapters_dir / "other-base", task_id=99)
    big = type(spec)(32, 32, ("q_proj",), 1.0)
    make_adapter(checkpoint_dir, big, 8, adapters_dir / "rank-32", task_id=98)
    shutil.copytree(adapters_dir / "adapter-0", adapters_dir / "bad-json")
    (adapters_dir / "bad-json" / lora.ADAPTER_CONFIG).write_text("{ not json")
    shutil.copytree(adapters_dir / "adapter-0", adapters_dir / "truncated")
    weights = adapters_dir / "truncated" / lora.ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return {
        "other-base": "another base",
        "rank-32": "rank 32; this server serves ranks up to 16",
        "bad-json": "is not valid JSON",
        "truncated": "cannot be read",
    }


def engine_bytes(tensors: lora.LoraTensors, checkpoint_dir) -> int:
    """An adapter's size in the torch engine's cache (float32 A and B)."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    shapes, layers = lora.llama_module_shapes(config)
    return sum(4 * (d.a.size + d.b.size) for d in lora.unpack(tensors, shapes, layers))


@pytest.fixture(scope="module")
def stack(
    cluster,
    built_repository,
    checkpoint_dir,
    adapters,
    bad_adapters,
    adapters_dir,
    tmp_path_factory,
):
    """One application for the module: the default model and lora-small."""
    small_repository = tmp_path_factory.mktemp("small") / "repository"
    shutil.copytree(built_repository, small_repository)
    used = [engine_bytes(adapters[f"adapter-{i}"].tensors, checkpoint_dir) for i in EVICTION]
    budget = sum(sorted(used)[-2:])  # the two largest of the four fit, never all four
    set_engine_parameter(small_repository, "lora_cache_host_memory_bytes", budget)
    lora_section = {"dynamic_lora_loading_path": str(adapters_dir)}
    cluster.deploy(
        app_config(
            [
                {
                    "id": BASE,
                    "triton": {"model_repository": str(built_repository)},
                    "lora": {**lora_section, "max_lora_rank": 16, "aliases": {ALIAS: "adapter-2"}},
                    "deployment": FIXED,
                },
                {
                    "id": SMALL,
                    "triton": {"model_repository": str(small_repository)},
                    "lora": {**lora_section, "max_num_adapters_per_replica": 2},
                    "deployment": FIXED,
                },
            ]
        )
    )
    cluster.wait_running()
    return cluster


def client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120
    )


async def whole(sdk, model: str) -> str:
    answer = await sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=TOKENS, extra_body={"ignore_eos": True}
    )
    assert answer.usage.completion_tokens == TOKENS
    return answer.choices[0].text


async def streamed(sdk, model: str) -> str:
    stream = await sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=TOKENS, stream=True, extra_body={"ignore_eos": True}
    )
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def test_each_adapter_mixed_with_others_and_the_base_equals_peft_whole_and_streamed(
    stack, expected
):
    names = {f"{BASE}:adapter-{i}": f"adapter-{i}" for i in (0, 1, 3, 4)}
    names |= {ALIAS: "adapter-2", BASE: None}

    async def all_at_once():
        sdk = client(stack)
        calls = [call(sdk, model) for model in names for call in (whole, streamed)]
        return await asyncio.gather(*calls)

    answers = asyncio.run(all_at_once())
    got = dict(
        zip([(m, kind) for m in names for kind in ("whole", "streamed")], answers, strict=True)
    )
    for (model, kind), text in got.items():
        assert text == expected[names[model]], (model, kind)


def test_models_lists_the_adapters_with_their_parent(stack, adapters):
    cards = httpx.get(f"{stack.url}/v1/models", timeout=30).json()["data"]
    by_id = {c["id"]: c for c in cards}
    for name in adapters:
        for model in (BASE, SMALL):
            assert by_id[f"{model}:{name}"]["parent"] == model
            assert by_id[f"{model}:{name}"]["root"] == model
    assert by_id[ALIAS]["parent"] == BASE and "parent" not in by_id[BASE]
    one = httpx.get(f"{stack.url}/v1/models/{BASE}:adapter-1", timeout=30).json()
    assert one["parent"] == BASE


def test_an_adapter_copied_into_the_directory_answers_within_10_s(stack, adapters_dir, expected):
    model = f"{BASE}:late"
    sdk = client(stack)
    with pytest.raises(openai.NotFoundError):
        asyncio.run(whole(sdk, model))
    shutil.copytree(adapters_dir / "adapter-1", adapters_dir / "late.tmp")
    copied = time.monotonic()
    (adapters_dir / "late.tmp").rename(adapters_dir / "late")  # whole, as a deploy tool would
    while True:
        try:
            text = asyncio.run(whole(client(stack), model))
            break
        except openai.NotFoundError:
            assert time.monotonic() - copied < 10, "the copied adapter was not found in 10 s"
            time.sleep(0.2)
    assert time.monotonic() - copied < 10
    assert text == expected["adapter-1"]


EVICTION = (0, 2, 3, 4)  # the adapters lora-small uses in turn


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/statm").read().split()
        except OSError:
            continue
        total += int(fields[1]) * 4096
    return total


def test_a_replica_of_two_adapters_serves_four_in_turn_correctly_within_bounded_memory(
    stack, expected
):
    (replica,) = stack.running_replicas("llm", f"Triton-{SMALL}")
    pids = [replica["pid"], *descendants([replica["pid"]])]
    logs = list((stack.logs_dir() / "serve").glob(f"replica_llm_Triton-{SMALL}_*.log"))

    def loads() -> int:
        return sum(p.read_text().count("loaded adapter") for p in logs)

    sdk_answers = []
    before = loads()
    resident = []
    for _ in range(3):
        for i in EVICTION:
            sdk_answers.append((i, asyncio.run(whole(client(stack), f"{SMALL}:adapter-{i}"))))
        resident.append(rss_bytes(pids))
    for i, text in sdk_answers:
        assert text == expected[f"adapter-{i}"], i
    # Four adapters in turn through two slots: the least recently used is always the
    # next one asked, so every request loads its adapter (and one leaves).
    assert loads() - before == 3 * len(EVICTION)
    # Two more rounds of loads, evictions and engine uploads leave memory where it was.
    assert resident[2] - resident[0] < 48 * 2**20, resident


def test_bad_adapters_are_refused_naming_why_and_the_replica_keeps_serving(
    stack, bad_adapters, expected
):
    (replica,) = stack.running_replicas("llm", f"Triton-{BASE}")
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True}

    def post(model: str) -> httpx.Response:
        return httpx.post(f"{stack.url}/v1/completions", json={"model": model, **body}, timeout=120)

    unknown = post(f"{BASE}:nope")
    assert unknown.status_code == 404, unknown.text
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found" and "'nope'" in error["message"]
    for name, why in bad_adapters.items():
        answer = post(f"{BASE}:{name}")
        assert answer.status_code == 400, (name, answer.text)
        assert (
            name in answer.json()["error"]["message"] and why in answer.json()["error"]["message"]
        )
        for model, key in ((f"{BASE}:adapter-0", "adapter-0"), (BASE, None)):
            served = post(model)
            assert (
                served.status_code == 200 and served.json()["choices"][0]["text"] == expected[key]
            )
    (after,) = stack.running_replicas("llm", f"Triton-{BASE}")
    assert after["replica_id"] == replica["replica_id"]
