"""The API layer without Ray: config validation, request schemas, tensors, chat prompts."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from serve.api.common.chat_template import render_chat_prompt
from serve.api.common.errors import APIError
from serve.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from serve.config import AppConfig
from serve.engines.triton import repository
from serve.engines.triton.requests import (
    ResponseReader,
    ensemble_inputs,
    ensemble_outputs,
    inferred_finish_reason,
)
from serve.engines.triton.sidecar import classify
from serve.generation import GenerateParams, GenerationChunk, GenerationError
from tests.conftest import ROOT
from tritonllm import contract

VLLM_MODEL = {"id": "v", "engine": "vllm", "vllm": {"checkpoint": "/c"}}


@pytest.mark.parametrize(
    "args, field",
    [
        ({"models": [{"id": "m", "max_tokens_cap": 0}]}, "models.0.max_tokens_cap"),
        ({"models": [{"id": "m", "triton": {"mode": "gpu-magic"}}]}, "models.0.triton.mode"),
        ({"models": [{"id": "../etc/passwd"}]}, "models.0.id"),
        ({"models": [{"id": "m", "deployment": {"max_ongoing_requests": 0}}]}, "max_ongoing"),
        ({"models": [{"id": "m", "deployment": {"ray_actor_options": {"gpus": 1}}}]}, "gpus"),
        ({"models": [{"id": "m"}, {"id": "m"}]}, "unique"),
        ({"models": [{"id": "e", "task": "embed"}]}, "task: generate"),
        ({"models": []}, "models"),
        ({"unknown_key": 1}, "unknown_key"),
        ({"layout": "direct", "models": [{"id": "a"}, {"id": "b"}]}, "2 models"),
        ({"layout": "direct", "models": [{"id": "m", "routing": "prefix_aware"}]}, "routing"),
        ({"layout": "direct", "models": [{"id": "m", "variants": ["v"]}]}, "variants"),
        ({"layout": "sideways"}, "layout"),
        ({"models": [VLLM_MODEL | {"deployment": {"access_log": False}}]}, "access_log"),
    ],
)
def test_config_errors_name_the_bad_field(args, field):
    with pytest.raises(ValidationError, match=field):
        AppConfig.model_validate(args)


def test_the_shipped_serve_config_validates():
    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    args = AppConfig.model_validate(config["applications"][0]["args"])
    assert args.default_target[0].id == "tritonllm-default"


@pytest.mark.parametrize(
    "access_log, answers_http, logged",
    [(None, False, False), (None, True, True), (True, False, True), (False, True, False)],
)
def test_a_triton_replica_logs_access_lines_where_it_answers_http_unless_told(
    access_log, answers_http, logged
):
    from serve.engines.triton.replica import logs_access

    deployment = {} if access_log is None else {"access_log": access_log}
    config = AppConfig.model_validate({"models": [{"id": "m", "deployment": deployment}]})
    assert logs_access(config.models[0], answers_http) is logged


def test_access_log_is_not_passed_to_serve(built_repository):
    from serve.app import replica_options

    model = {"id": "m", "triton": {"model_repository": str(built_repository)}}
    config = AppConfig.model_validate({"models": [model | {"deployment": {"access_log": True}}]})
    assert "access_log" not in replica_options(config.models[0])  # Serve would refuse it


def test_the_access_line_filter_drops_serves_access_lines_alone():
    import logging

    from serve.engines.triton.replica import not_an_access_line

    def record(**extra) -> logging.LogRecord:
        line = logging.LogRecord("ray.serve", logging.INFO, __file__, 1, "msg", None, None)
        line.__dict__.update(extra)
        return line

    assert not not_an_access_line(record(serve_access_log=True, request_id="r1"))
    assert not_an_access_line(record(request_id="r1"))  # another line of the request
    assert not_an_access_line(record(serve_access_log=None))


def test_the_tokenizer_comes_from_the_preprocessing_config(built_repository, checkpoint_dir):
    assert repository.tokenizer_dir(built_repository).resolve() == checkpoint_dir.resolve()


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 65},
        {"tools": []},
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_schema"}},  # without its json_schema
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},  # one constraint only
        {"stream_options": {"include_usage": True}},  # without stream: true
        {"prompt": "\ud800"},
        {"stop": "a\udfff"},
        {"logprobs": 21},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"5": 101}},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"stop": [""]},
        {"temperature": -1},
        {"top_p": 0},
    ],
)
def test_unsupported_or_invalid_parameters_are_rejected(extra):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **extra})


def test_parameters_map_onto_generate_params_with_the_cap():
    request = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "stop": "\n", "top_k": 5, "seed": 3, "max_tokens": 7}
    )
    params = request.params(request.prompt, request.max_tokens, cap=10, default=4, request_id="r")
    assert (params.prompt, params.max_tokens, params.stop, params.top_k) == ("x", 7, ("\n",), 5)
    with pytest.raises(APIError, match="cap of 5") as info:
        request.params(request.prompt, request.max_tokens, cap=5, default=4, request_id="r")
    assert info.value.param == "max_tokens"


def test_max_completion_tokens_wins_over_max_tokens():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    request = ChatCompletionRequest.model_validate(
        {**body, "max_tokens": 5, "max_completion_tokens": 9}
    )
    assert request.requested_max_tokens == 9


def test_ensemble_inputs_follow_the_contract():
    params = GenerateParams(
        "hi", 5, temperature=0.5, top_k=3, seed=2**63, stop=("x",), return_log_probs=True
    )
    inputs = ensemble_inputs(params)
    for name, array in inputs.items():
        spec = contract.tensor(contract.ENSEMBLE, name)  # KeyError: not an ensemble input
        assert spec in contract.ENSEMBLE_INPUTS, name
        assert array.dtype == spec.numpy_dtype, name
        assert array.ndim == len(spec.dims) + 1, name  # the batch dimension first
    assert int(inputs[contract.SEED.name][0, 0]) == 2**63
    assert contract.RESUMED_OUTPUT_LEN.name not in inputs
    resumed = GenerateParams("", 5, prompt_token_ids=(1, 7, 8), resumed_tokens=2)
    inputs = ensemble_inputs(resumed)
    assert inputs[contract.RESUMED_OUTPUT_LEN.name].tolist() == [[2]]
    assert inputs[contract.INPUT_IDS.name].tolist() == [[1, 7, 8]]
    assert contract.PRIORITY.name not in inputs  # 0, the engine's default: not sent
    urgent = ensemble_inputs(GenerateParams("hi", 5, priority=-2))
    assert urgent[contract.PRIORITY.name].tolist() == [[-2]]
    output_names = {spec.name for spec in contract.ENSEMBLE_OUTPUTS}
    assert set(ensemble_outputs(params)) <= output_names


def test_without_the_engines_reason_length_is_read_only_at_max_tokens():
    params = GenerateParams("hi", 5)
    assert inferred_finish_reason(GenerationChunk("", 1, 5), params) == "length"
    assert inferred_finish_reason(GenerationChunk("", 1, 3), params) == "stop"
    assert inferred_finish_reason(None, params) == "stop"


def outputs(ids: list[int], produced: int, reason: int | None = None) -> dict:
    arrays = {
        "text_output": np.array([b"x"], dtype=object),
        "output_ids": np.array([[ids]], dtype=np.int32),
        "num_input_tokens": np.array([[3]], dtype=np.int32),
        "num_output_tokens": np.array([[produced]], dtype=np.int32),
    }
    return arrays | ({} if reason is None else {"finish_reason": np.array([[reason]])})


@pytest.mark.parametrize(("code", "reason"), [(1, "stop"), (2, "stop"), (3, "length")])
def test_the_engines_reason_ends_the_stream(code, reason):
    """A stop word on the max_tokens-th token is the engine's "stop" (inferred, it
    would read "length")."""
    reader = ResponseReader(GenerateParams("hi", 2))
    first = reader.chunk(outputs([7], 1))
    last = reader.chunk(outputs([8], 2, code))
    assert (first.token_ids, last.token_ids, first.finish_reason) == ((7,), (8,), None)
    end = reader.end()
    assert (end.finish_reason, end.num_output_tokens, end.text) == (reason, 2, "")


@pytest.mark.parametrize(("code", "logged"), [(1, 2), (2, 1), (None, 1)])
def test_the_end_tokens_log_probability_is_read_where_the_engine_ended_on_it(code, logged):
    """FINISH_END_ID: one log probability (and row of alternatives) beyond output_ids, the
    end token's (tritonllm.contract); otherwise what lies beyond the ids is padding."""
    params = GenerateParams("hi", 8, return_log_probs=True, top_log_probs=2)
    response = outputs([8], 2, code) | {
        "output_log_probs": np.array([[[-0.5, -0.25]]], dtype=np.float32),
        "top_log_probs": np.array([[[-0.5, -1.0], [-0.25, -3.0]]], dtype=np.float32),
        "top_token_ids": np.array([[[8, 9], [2, 4]]], dtype=np.int32),
    }
    chunk = ResponseReader(params).chunk(response)
    assert chunk.token_ids == (8,) and chunk.logs_end_token == (logged == 2)
    assert chunk.token_log_probs == (-0.5, -0.25)[:logged]
    assert [t.token_ids for t in chunk.top_log_probs] == [(8, 9), (2, 4)][:logged]


def test_without_the_engines_reason_the_stream_ends_by_inference():
    reader = ResponseReader(GenerateParams("hi", 2))
    reader.chunk(outputs([7], 1))
    reader.chunk(outputs([8], 2))
    assert reader.end().finish_reason == "length"


def test_a_chat_prompt_gets_exactly_one_bos(tokenizer):
    prompt = render_chat_prompt(tokenizer, [{"role": "user", "content": "Where is the cat?"}])
    ids = tokenizer.encode(prompt)  # as preprocessing does, with special tokens
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert prompt.endswith("<|assistant|>\n")


@pytest.mark.parametrize(
    "message, kind",
    [
        ("in ensemble 'ensemble', max_tokens must be > 0, got 0", GenerationError.INVALID),
        ("prompt (1201 tokens) + max_tokens (8) exceeds the maximum", GenerationError.INVALID),
        ("the engine's queue is full (256 waiting): retry later", GenerationError.UNAVAILABLE),
        ("Cannot process new request: max queue size reached", GenerationError.UNAVAILABLE),
        ("CUDA error: an illegal memory access was encountered", GenerationError.INTERNAL),
    ],
)
def test_sidecar_errors_are_classified_by_their_message(message, kind):
    error = classify(message)
    assert (error.kind, str(error)) == (kind, message)


def test_a_pool_of_variants_resolves_by_variant_and_loads_on_demand():
    config = AppConfig.model_validate(
        {"models": [{"id": "base"}, {"id": "pool", "variants": ["a", "b"]}]}
    )
    pool = config.model("pool")
    assert config.resolve("a") == (pool, "a") and config.resolve("base")[1] is None
    assert config.resolve("pool") == (pool, None) and config.resolve("zzz") is None
    assert config.served_ids() == ["base", "a", "b"]
    assert pool.entry_models() == ["ensemble-a", "ensemble-b"]
    assert pool.startup_models() == ("preprocessing", "postprocessing")
    assert config.model("base").startup_models() == ("*",)
    with pytest.raises(ValidationError, match="unique"):
        AppConfig.model_validate({"models": [{"id": "a"}, {"id": "pool", "variants": ["a"]}]})
    with pytest.raises(ValidationError, match="variants"):
        AppConfig.model_validate({"models": [{"id": "p", "variants": ["x/../y"]}]})


def test_the_direct_layout_is_one_deployment_whose_replicas_serve_the_api(built_repository):
    from serve.app import build_app
    from serve.deployments.direct import DirectReplica

    model = {"id": "llm", "triton": {"model_repository": str(built_repository)}}
    app = build_app({"layout": "direct", "models": [model]})
    deployment = app._bound_deployment
    assert deployment.name == "Triton-llm"
    assert deployment.func_or_class.__name__ == DirectReplica.__name__
    assert hasattr(deployment.func_or_class, "__serve_build_asgi_app__")  # the ingress
    routed = build_app({"models": [model]})._bound_deployment
    assert routed.name == "OpenAIIngress"


def test_a_deployment_that_serves_the_api_closes_its_backend_then_its_triton():
    """Serve deletes a replica after draining it: the API's metrics publisher stops,
    and a direct replica's Triton stops with it (the Triton replica's own __del__)."""
    from serve.deployments.api_backend import ServesTheApi

    closed = []

    class Backend:
        def close(self):
            closed.append("backend")

    class Triton:
        def __del__(self):
            closed.append("triton")

    class Direct(ServesTheApi, Triton):
        pass

    class Ingress(ServesTheApi):
        pass

    deployments = [Direct(), Ingress(), Direct()]
    for deployment in deployments[:2]:
        deployment.backend = Backend()
        deployment.__del__()
    deployments[2].__del__()  # one whose __init__ failed before it had a backend
    assert closed == ["backend", "triton", "backend", "triton"]


def test_an_unbuilt_optional_model_is_left_out_and_a_built_one_kept(tmp_path, caplog):
    from serve.app import servable

    def config(repository):
        return AppConfig.model_validate(
            {
                "models": [
                    {"id": "llm"},
                    {
                        "id": "emb",
                        "task": "embed",
                        "optional": True,
                        "triton": {"model_repository": str(repository)},
                    },
                ]
            }
        )

    with caplog.at_level("WARNING", logger="ray.serve"):
        assert [m.id for m in servable(config(tmp_path / "unbuilt")).models] == ["llm"]
    assert "emb left out (optional: true)" in caplog.text and "does not exist" in caplog.text
    (tmp_path / "embeddings").mkdir()
    (tmp_path / "embeddings" / "config.pbtxt").write_text('name: "embeddings" backend: "python"')
    assert [m.id for m in servable(config(tmp_path)).models] == ["llm", "emb"]
    only_optional = AppConfig.model_validate({"models": [{"id": "llm", "optional": True}]})
    only_optional.models[0].triton.model_repository = tmp_path / "unbuilt"
    with pytest.raises(repository.RepositoryError, match="no generate model"):
        servable(only_optional)


@pytest.mark.parametrize(
    ("fraction", "per_replica", "gpus", "fits"),
    [(0.85, 2, 1, False), (0.4, 2, 1, True), (0.85, 1, 1, True), (0.85, 2, 0, True)],
)
def test_engines_sharing_a_gpu_must_fit_their_kv_cache_fractions(
    tmp_path, fraction, per_replica, gpus, fits
):
    from serve.app import check_gpu_memory

    for variant in ("a", "b"):
        for name, extra in ((f"ensemble-{variant}", ""), (f"tensorrt_llm-{variant}", fraction)):
            (tmp_path / name).mkdir()
            parameter = (
                f'parameters {{ key: "kv_cache_free_gpu_mem_fraction" '
                f'value: {{ string_value: "{extra}" }} }}'
                if extra
                else ""
            )
            (tmp_path / name / "config.pbtxt").write_text(f'name: "{name}" {parameter}')
    model = AppConfig.model_validate(
        {
            "models": [
                {
                    "id": "pool",
                    "variants": ["a", "b"],
                    "max_models_per_replica": per_replica,
                    "triton": {"model_repository": str(tmp_path)},
                    "deployment": {"ray_actor_options": {"num_gpus": gpus}},
                }
            ]
        }
    ).models[0]
    if fits:
        check_gpu_memory(model)
    else:
        with pytest.raises(repository.RepositoryError, match=r"0\.85 \+ 0\.85.*max_models_per"):
            check_gpu_memory(model)


def test_the_engines_refusal_of_a_guide_names_the_field_it_came_from():
    from serve.api.common.errors import APIError
    from serve.deployments.api_backend import _name_the_guide

    guided = GenerateParams("p", 4, guide_type="regex", guide="a+", guide_field="guided_regex")
    refusal = APIError("compiling this regex guide exceeds the limit of 5 s")
    _name_the_guide(refusal, guided)
    assert refusal.param == "guided_regex" and refusal.message.startswith("guided_regex: ")
    other = APIError("prompt (900 tokens) + max_tokens (8) exceeds the maximum sequence length")
    _name_the_guide(other, guided)
    assert other.param is None  # not the guide's
    plain = APIError("invalid regex guide: XGrammar cannot compile it")
    _name_the_guide(plain, GenerateParams("p", 4))
    assert plain.param is None
