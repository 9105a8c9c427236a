"""LoRA adapters on the Serve side: the config, the names clients send, /v1/models, the
codec's tensors, the adapter directory and the checks of an adapter against its base."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from serve.adapters import AdapterCatalog, list_adapters, read_adapter
from serve.api.common.errors import NotFound
from serve.config import AppConfig, ModelConfig
from serve.engines.triton.requests import AdapterInputs, ensemble_inputs
from serve.generation import GenerateParams, GenerationChunk, GenerationError, StreamPacing
from tests.support.fakes import FakeBackend, client, error_of
from tritonllm import contract, lora

BASE = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1}
BASE |= {"intermediate_size": 12, "num_hidden_layers": 2}


def lora_model(path="adapters", **lora_fields) -> dict:
    return {"id": "base", "lora": {"dynamic_lora_loading_path": str(path), **lora_fields}}


def write_adapter(directory, rank=2, hidden=8, layers=2, config=None, modules=("q_proj",)):
    """A PEFT-style adapter of a BASE-like model (q_proj: hidden -> hidden)."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(rank)
    state = {}
    for layer in range(layers):
        for module in modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
            state[f"{prefix}.lora_B.weight"] = torch.randn(hidden, rank, generator=generator)
    save_file(state, str(directory / lora.ADAPTER_WEIGHTS))
    config = config or {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    (directory / lora.ADAPTER_CONFIG).write_text(json.dumps(config))
    return directory


# -- config -------------------------------------------------------------------------


def test_lora_section_takes_ray_serve_llm_names_and_defaults():
    model = ModelConfig.model_validate(lora_model("s3://bucket/adapters/"))
    assert model.lora.max_num_adapters_per_replica == 16  # Ray Serve LLM's default
    assert model.lora.max_lora_rank == 64
    assert model.lora.adapters_url() == "s3://bucket/adapters"
    local = ModelConfig.model_validate(lora_model("adapters")).lora.adapters_url()
    assert local.endswith("/adapters") and local.startswith("/")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"task": "embed"}, "task: generate"),
        ({"variants": ["ft-a"]}, "lora and variants do not mix"),
    ],
)
def test_lora_is_refused_where_it_cannot_serve(extra, message):
    with pytest.raises(ValidationError, match=message):
        ModelConfig.model_validate(lora_model() | extra)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_num_adapters_per_replica": 0},
        {"max_lora_rank": 0},
        {"aliases": {"nice": "a/b"}},  # a path, not a directory name
        {"bogus": 1},
    ],
)
def test_bad_lora_fields_are_named(fields):
    with pytest.raises(ValidationError):
        ModelConfig.model_validate(lora_model(**fields))


def test_an_alias_may_not_take_another_models_id():
    models = [lora_model(aliases={"other": "a"}), {"id": "other"}]
    with pytest.raises(ValidationError, match="unique: other"):
        AppConfig.model_validate({"models": models})


# -- naming ---------------------------------------------------------------------------

CONFIG = AppConfig.model_validate(
    {"models": [lora_model(aliases={"support": "support-v2"}), {"id": "plain"}]}
)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("base", ("base", None)),
        ("base:support-v2", ("base", "support-v2")),
        ("support", ("base", "support-v2")),
        ("plain", ("plain", None)),
        ("plain:x", None),  # plain has no lora section
        ("base:../x", None),  # an adapter name is a directory name
        ("base:", None),
        ("nope:x", None),
    ],
)
def test_names_resolve_to_the_base_and_its_adapter(name, expected):
    resolved = CONFIG.resolve(name)
    assert (resolved and (resolved[0].id, resolved[1])) == expected


class LoraBackend(FakeBackend):
    config = CONFIG
    found = ["support-v2", "tone"]

    async def adapters(self, model):
        return list(self.found)


def test_models_lists_the_adapters_found_with_their_parent():
    cards = client(LoraBackend()).get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["base", "base:support-v2", "base:tone", "support", "plain"]
    assert {c["id"]: c.get("parent") for c in cards}["base:tone"] == "base"
    assert all(c["parent"] == c["root"] == "base" for c in cards[1:4])
    assert "parent" not in cards[0]
    assert client(LoraBackend()).get("/v1/models/base:tone").json()["parent"] == "base"
    error_of(client(LoraBackend()).get("/v1/models/base:nope"), 404)


def test_an_adapters_request_carries_it_and_is_answered_as_base_colon_adapter():
    backend = LoraBackend()
    body = {"model": "support", "prompt": "a b", "max_tokens": 2}
    answer = client(backend).post("/v1/completions", json=body).json()
    assert answer["model"] == "base:support-v2"
    (params,) = backend.params
    assert (params.adapter, params.variant) == ("support-v2", None)


# -- the codec ------------------------------------------------------------------------


def test_codec_sends_the_task_id_and_the_weights_only_when_given():
    tensors = lora.LoraTensors(
        np.arange(12, dtype=np.float16).reshape(2, 6), np.array([[0, 0, 2], [1, 0, 2]], np.int32)
    )
    params = GenerateParams(prompt="p", max_tokens=1)
    plain = ensemble_inputs(params)
    assert not {"lora_task_id", "lora_weights", "lora_config"} & set(plain)
    by_id = ensemble_inputs(params, AdapterInputs(2**63 - 1))
    assert by_id["lora_task_id"].dtype == np.uint64 and by_id["lora_task_id"].shape == (1, 1)
    assert by_id["lora_task_id"][0, 0] == 2**63 - 1 and "lora_weights" not in by_id
    both = ensemble_inputs(params, AdapterInputs(7, tensors))
    assert both["lora_weights"].shape == (1, 2, 6) and both["lora_weights"].dtype == np.float16
    assert both["lora_config"].shape == (1, 2, 3) and both["lora_config"].dtype == np.int32
    assert (both["lora_weights"][0] == tensors.weights).all()


# -- the directory and the checks ------------------------------------------------------


def test_catalog_lists_adapter_directories_and_sees_new_ones_after_its_ttl(tmp_path):
    write_adapter(tmp_path / "a")
    (tmp_path / "not-an-adapter").mkdir()
    catalog = AdapterCatalog(str(tmp_path), ttl_s=0.2)

    async def names_before_and_after_copy():
        before = await catalog.names()
        shutil.copytree(tmp_path / "a", tmp_path / "b")
        cached = await catalog.names()
        await asyncio.sleep(0.25)
        return before, cached, await catalog.names()

    before, cached, after = asyncio.run(names_before_and_after_copy())
    assert before == cached == {"a"} and after == {"a", "b"}
    assert list_adapters(f"file://{tmp_path}") == {"a", "b"}


def test_task_id_is_stable_for_the_same_files_and_new_for_changed_ones(tmp_path):
    write_adapter(tmp_path / "a")
    first, again = read_adapter(str(tmp_path), "a"), read_adapter(str(tmp_path), "a")
    assert first.task_id == again.task_id and 0 < first.task_id < 2**63
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert read_adapter(str(tmp_path), "b").task_id != first.task_id  # another name
    shutil.rmtree(tmp_path / "a")
    write_adapter(tmp_path / "a", rank=3)
    assert read_adapter(str(tmp_path), "a").task_id != first.task_id  # other files
    with pytest.raises(FileNotFoundError):
        read_adapter(str(tmp_path), "missing")


SHAPES, LAYERS = lora.llama_module_shapes(BASE)


def test_llama_module_shapes_follow_grouped_query_attention():
    assert SHAPES["q_proj"] == (8, 8) and SHAPES["k_proj"] == SHAPES["v_proj"] == (8, 4)
    assert SHAPES["o_proj"] == (8, 8) and SHAPES["down_proj"] == (12, 8) and LAYERS == 2


def test_an_adapter_that_fits_passes(tmp_path):
    adapter = read_adapter(str(write_adapter(tmp_path / "a").parent), "a")
    lora.check_fits(adapter.tensors, SHAPES, LAYERS, max_rank=64)


@pytest.mark.parametrize(
    "kwargs, max_rank, message",
    [
        ({"rank": 8}, 4, "rank 8; this server serves ranks up to 4"),
        ({"hidden": 6}, 64, "another base"),
        ({"hidden": 16}, 64, "another base"),
        ({"layers": 3}, 64, "layer 2; the model has 2 layers"),
        ({"config": {"peft_type": "IA3"}}, 64, "IA3 adapter"),
    ],
)
def test_an_adapter_that_does_not_fit_is_named(tmp_path, kwargs, max_rank, message):
    write_adapter(tmp_path / "a", **kwargs)
    with pytest.raises(lora.AdapterError, match=message):
        lora.check_fits(read_adapter(str(tmp_path), "a").tensors, SHAPES, LAYERS, max_rank)


def test_rows_wider_than_this_models_modules_need_are_another_bases():
    # Rows are padded to the widest: a smaller base's adapter fits them, but none fills one.
    weights = np.zeros((1, 40), np.float16)  # rank 2 of an 8x8 q_proj needs 32
    tensors = lora.LoraTensors(
        weights, np.array([[lora.LORA_MODULE_IDS["attn_q"], 0, 2]], np.int32)
    )
    with pytest.raises(lora.AdapterError, match="are 40 wide; .* would be 32"):
        lora.check_fits(tensors, SHAPES, LAYERS, max_rank=64)


@pytest.mark.parametrize(
    "file, content, message",
    [
        (lora.ADAPTER_CONFIG, b"{not json", "not valid JSON"),
        (lora.ADAPTER_WEIGHTS, b"\x10\x00\x00\x00\x00\x00\x00\x00{", "cannot be read"),
    ],
)
def test_a_corrupt_file_is_an_adapter_error(tmp_path, file, content, message):
    (write_adapter(tmp_path / "a") / file).write_bytes(content)
    with pytest.raises(lora.AdapterError, match=message):
        read_adapter(str(tmp_path), "a")


def test_the_ingress_answers_404_naming_an_adapter_not_in_the_directory(tmp_path):
    from serve.deployments.api_backend import ApiBackend, ServedModel

    write_adapter(tmp_path / "a")
    config = AppConfig.model_validate(
        {"models": [lora_model(tmp_path)], "responses": {"store": "none"}}
    )
    catalog = AdapterCatalog(str(tmp_path))
    served = ServedModel(engine=None, token_texts=None, sampling=None, adapters=catalog)
    ingress = ApiBackend(config, channel=None, served={"base": served})
    model = config.models[0]
    assert asyncio.run(ingress.adapters(model)) == ["a"]
    asyncio.run(ingress._require_adapter(model, "a"))
    with pytest.raises(NotFound, match="'base:b' does not exist: 'base' has no adapter 'b'"):
        asyncio.run(ingress._require_adapter(model, "b"))


# -- the replica: weights once, the id after, the weights again on a cache miss ---------


class EngineHost:
    """Answers like the torch engine: a cache miss for an id it does not hold."""

    def __init__(self):
        self.held: set[int] = set()
        self.sent: list[GenerateParams] = []

    async def generate(self, params, route, adapter=None):
        self.sent.append((params, adapter))
        if adapter.tensors is not None:
            self.held.add(adapter.task_id)
        elif adapter.task_id not in self.held:
            raise GenerationError(contract.lora_cache_miss(adapter.task_id), "invalid")
        yield GenerationChunk("x", 1, 1)

    def stop(self):
        pass


def test_the_replica_sends_the_weights_once_and_again_when_the_engine_lost_them(tmp_path):
    from serve.engines.triton.replica import LoadedAdapter, TritonReplica

    write_adapter(tmp_path / "a")
    loaded = LoadedAdapter(read_adapter(str(tmp_path), "a"))
    replica = object.__new__(TritonReplica)
    model = lora_model(tmp_path) | {"triton": {"pipeline": "ensemble"}}
    replica.model = ModelConfig.model_validate(model)
    replica.host = host = EngineHost()
    replica._routes = {}
    replica.pacing = StreamPacing()

    async def adapter(adapter_id):
        assert adapter_id == "base:a"  # the multiplexed model id the ingress routes by
        return loaded

    replica._adapter = adapter

    async def ask():
        params = GenerateParams(prompt="p", max_tokens=1, adapter="a", request_id="r")
        return [c.text async for c in replica.generate(params)]

    assert asyncio.run(ask()) == ["x"]  # the weights with the first request
    assert asyncio.run(ask()) == ["x"]  # the id alone
    host.held.clear()  # the engine's cache evicted it
    assert asyncio.run(ask()) == ["x"]  # a miss, then the weights again
    weights = [adapter.tensors is not None for _, adapter in host.sent]
    assert weights == [True, False, False, True]
    assert {adapter.task_id for _, adapter in host.sent} == {loaded.adapter.task_id}
    assert host.sent[-1][0].request_id == "r.w"  # a new Triton request id for the resend


def test_a_directory_url_fsspec_cannot_open_fails_at_start():
    # As a URL whose filesystem package (s3fs, gcsfs, ...) is not installed.
    with pytest.raises(ValueError, match="Protocol not known: nosuchprotocol"):
        AdapterCatalog("nosuchprotocol://bucket/adapters")
