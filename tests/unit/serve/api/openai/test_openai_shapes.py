"""The OpenAI request shapes current clients send, over the HTTP layer and a fake backend:
content parts, the developer role, n, echo, stop strings cut from the text (whole and
streamed), vLLM's extensions, and errors that are always error objects."""

from __future__ import annotations

import json

import pytest
from ray.exceptions import RayTaskError

from serve.api.common.errors import Overloaded
from serve.api.common.sampling import GREEDY, SamplingDefaults, resolve
from serve.api.common.stops import StopStringCutter
from serve.deployments.api_backend import as_api_error
from serve.generation import GenerationError
from tests.support.fakes import FakeBackend, client, error_of


def chat(content, role="user", **extra) -> dict:
    return {"model": "llm", "messages": [{"role": role, "content": content}], **extra}


def stream_events(api, path: str, body: dict) -> list[dict]:
    with api.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_text_content_parts_are_joined_and_the_developer_role_is_a_system_message():
    backend = FakeBackend()
    api = client(backend)
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    answer = api.post("/v1/chat/completions", json=chat(parts, max_tokens=2)).json()
    assert answer["choices"][0]["message"]["content"] == " one two"
    api.post("/v1/chat/completions", json=chat("be brief", role="developer"))
    assert backend.params[-1].prompt == "be brief"


def test_an_image_part_is_a_400_naming_the_part():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = chat([{"type": "text", "text": "a"}, image])
    error = error_of(client().post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "messages.0.content"
    assert "part 1 has type 'image_url'" in error["message"]


def test_n_choices_each_with_its_own_seed_in_openai_order():
    backend = FakeBackend()
    api = client(backend)
    body = {"model": "llm", "prompt": ["a b", "c d"], "n": 2, "seed": 7, "max_tokens": 1}
    answer = api.post("/v1/completions", json=body).json()
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [
        (0, " a"),
        (1, " a"),
        (2, " c"),
        (3, " c"),
    ]
    assert [p.seed for p in backend.params] == [7, 8, 7, 8]
    unseeded = {"model": "llm", "prompt": "a", "n": 3, "temperature": 1.0}
    api.post("/v1/completions", json=unseeded)
    assert len({p.seed for p in backend.params[-3:]}) == 3  # every sample its own
    assert answer["usage"]["completion_tokens"] == 4
    events = stream_events(api, "/v1/chat/completions", chat("x y", n=3, max_tokens=1))
    roles = [e["choices"][0]["index"] for e in events if "role" in e["choices"][0]["delta"]]
    assert roles == [0, 1, 2]  # every choice opens with its role


def test_echo_puts_the_prompt_before_each_answer():
    api = client()
    body = {"model": "llm", "prompt": "a b", "echo": True, "max_tokens": 1}
    assert api.post("/v1/completions", json=body).json()["choices"][0]["text"] == "a b a"
    events = stream_events(api, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events) == "a b a"


def test_stop_strings_are_cut_from_whole_and_streamed_answers():
    backend = FakeBackend()
    api = client(backend)
    body = {"model": "llm", "prompt": "alpha beta gamma delta", "stop": ["mm", "zz"]}
    whole = api.post("/v1/completions", json=body).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"]) == (" alpha beta ga", "stop")
    events = stream_events(api, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events) == " alpha beta ga"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    kept = {**body, "include_stop_str_in_output": True}
    assert api.post("/v1/completions", json=kept).json()["choices"][0]["text"] == " alpha beta gamm"
    assert backend.params[-1].stop == ("mm", "zz")  # the engine stops on them too


def test_a_streamed_tail_that_may_become_a_stop_string_is_held_back():
    cutter = StopStringCutter(("STOP",))
    assert cutter.feed("abc ST") == "abc "  # "ST" may start STOP
    assert cutter.feed("ILL") == "STILL"  # it did not
    assert cutter.feed(" S") == " "
    assert (cutter.feed("TOP and more"), cutter.stopped) == ("", True)
    unfinished = StopStringCutter(("STOP",))
    assert unfinished.feed("end ST") == "end " and unfinished.flush() == "ST"
    kept = StopStringCutter(("STOP",), include_stop=True)
    assert (kept.feed("a STOP b STOP"), kept.stop) == ("a STOP", "STOP")


def test_vllm_extensions_are_accepted():
    backend = FakeBackend()
    api = client(backend)
    body = {
        "model": "llm",
        "prompt": "a b c",
        "ignore_eos": True,
        "min_tokens": 1,
        "top_k": 3,
        "repetition_penalty": 1.1,
        "response_format": {"type": "text"},
    }
    assert api.post("/v1/completions", json=body).status_code == 200
    assert backend.params[-1].ignore_eos and backend.params[-1].top_k == 3
    usage_everywhere = {"include_usage": True, "continuous_usage_stats": True}
    events = stream_events(api, "/v1/completions", {**body, "stream_options": usage_everywhere})
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 3


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "llm", "prompt": "\\ud800"}',
        b'{"model": "llm", "messages": [{"role": "user", "content": "a\\udc00b"}]}',
        b'{"model": "llm", "prompt": "x", "stop": ["\\udfff"]}',
    ],
)
def test_a_lone_surrogate_is_a_400_error_object(raw):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    response = client().post(path, content=raw, headers={"content-type": "application/json"})
    assert "surrogate" in error_of(response, 400)["message"]


def test_stream_options_without_a_stream_is_a_400():
    body = {"model": "llm", "prompt": "a", "stream_options": {"include_usage": True}}
    assert "stream" in error_of(client().post("/v1/completions", json=body), 400)["message"]


def test_a_stream_that_fails_after_its_first_byte_still_reports_usage():
    api = client(FakeBackend(fail_after=2, error=Overloaded("replica lost")))
    body = {"model": "llm", "prompt": "a b c", "stream_options": {"include_usage": True}}
    events = stream_events(api, "/v1/completions", body)
    assert events[-2]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert events[-1]["error"]["message"] == "replica lost"


def test_an_unexpected_error_mid_stream_is_an_error_event_without_details():
    api = client(FakeBackend(fail_after=1, error=RuntimeError("/secret/path.py pid 42")))
    events = stream_events(api, "/v1/completions", {"model": "llm", "prompt": "a b"})
    assert events[-1]["error"]["type"] == "server_error"
    assert "secret" not in json.dumps(events)


def _crossed_ray(error: Exception) -> Exception:
    """``error`` as the ingress receives it from a replica: a RayTaskError whose text is
    the remote traceback."""
    try:
        raise error
    except Exception as raised:
        return RayTaskError("generate", "Traceback: /srv/replica.py, pid=4242", raised)


def test_a_replica_error_reaches_the_client_without_the_ray_traceback():
    too_long = GenerationError(
        "prompt (5000 tokens) + max_tokens (16) = 5016 exceeds the maximum sequence length "
        "of 2048 tokens; shorten the prompt or lower max_tokens",
        GenerationError.INVALID,
    )
    error = as_api_error(_crossed_ray(too_long).as_instanceof_cause())
    assert error.status == 400 and error.code == "context_length_exceeded"
    assert error.message == str(too_long) and "pid" not in error.message
    lost = as_api_error(_crossed_ray(GenerationError("gone", GenerationError.UNAVAILABLE)))
    assert lost.status == 503 and lost.message == "gone"


@pytest.mark.parametrize(
    "fields, defaults, expected",
    [
        ({}, GREEDY, (None, None, 1)),
        ({"temperature": 0}, GREEDY, (None, None, 1)),
        # A temperature alone samples, on every engine (TensorRT-LLM alone would not).
        ({"temperature": 0.7}, GREEDY, (0.7, 1.0, 0)),
        ({"top_p": 0.9}, GREEDY, (1.0, 0.9, 0)),
        ({"temperature": 0.7, "top_k": 1}, GREEDY, (None, None, 1)),
        ({}, SamplingDefaults(do_sample=True, temperature=0.6, top_p=0.9), (0.6, 0.9, 0)),
        ({"temperature": 0}, SamplingDefaults(do_sample=True, temperature=0.6), (None, None, 1)),
        ({"temperature": 1.0}, SamplingDefaults(top_k=40), (1.0, 1.0, 40)),
    ],
)
def test_sampling_is_resolved_into_explicit_engine_parameters(fields, defaults, expected):
    resolved = resolve(
        fields.get("temperature"), fields.get("top_p"), fields.get("top_k"), None, defaults
    )
    assert (resolved.temperature, resolved.top_p, resolved.top_k) == expected


def test_the_checkpoints_generation_config_sets_the_defaults(tmp_path):
    assert SamplingDefaults.from_checkpoint(tmp_path) == GREEDY
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": 2})
    )
    defaults = SamplingDefaults.from_checkpoint(tmp_path)
    assert defaults == SamplingDefaults(do_sample=True, temperature=0.6, top_p=0.9)
    backend = FakeBackend()
    backend.defaults = defaults
    client(backend).post("/v1/completions", json={"model": "llm", "prompt": "a"})
    params = backend.params[-1]
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 0)


def test_chat_logprobs_name_each_chosen_token_and_the_end_token_whole_and_streamed():
    api = client()
    body = chat("a b c", logprobs=True, top_logprobs=0)  # three words, then the end token
    answer = api.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    assert [(t["token"], t["logprob"]) for t in answer["content"]] == [
        ("<0>", 0.0),
        ("<1>", -1.0),
        ("<2>", -2.0),
        ("</s>", -9.0),
    ]
    assert (
        answer["content"][1]["bytes"] == list(b"<1>") and answer["content"][1]["top_logprobs"] == []
    )
    events = stream_events(api, "/v1/chat/completions", body)
    streamed = [
        t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["content"]
    ]
    assert streamed == answer["content"]
    assert (
        client().post("/v1/chat/completions", json=chat("a")).json()["choices"][0]["logprobs"]
        is None
    )


def test_completion_logprobs_carry_tokens_their_offsets_and_the_chosen_one_in_top():
    body = {"model": "llm", "prompt": "a b", "logprobs": 0}
    logprobs = client().post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert logprobs == {
        "tokens": ["<0>", "<1>", "</s>"],
        "token_logprobs": [0.0, -1.0, -9.0],
        # logprobs 0: the chosen token only
        "top_logprobs": [{"<0>": 0.0}, {"<1>": -1.0}, {"</s>": -9.0}],
        # The end token is not in the text (special tokens are skipped): at its end.
        "text_offset": [0, 3, 6],
    }
    capped = {"model": "llm", "prompt": "a b c", "logprobs": 0, "max_tokens": 2}
    logprobs = client().post("/v1/completions", json=capped).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<0>", "<1>"]  # max_tokens ended it: no end token


def test_chat_top_logprobs_list_the_alternatives_of_each_token():
    body = chat("a b", logprobs=True, top_logprobs=2)
    content = client().post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    second = content["content"][1]
    assert (second["token"], second["logprob"]) == ("<1>", -1.0)
    assert second["top_logprobs"] == [
        {"token": "<1>", "logprob": -1.0, "bytes": list(b"<1>")},
        {"token": "<2>", "logprob": -2.0, "bytes": list(b"<2>")},
    ]


def test_completions_echo_with_logprobs_lists_the_prompt_tokens_first():
    # A token-id prompt is echoed as its tokens' text: "<50><51>", then the answer.
    body = {"model": "llm", "prompt": [50, 51], "logprobs": 1, "echo": True, "max_tokens": 1}
    for stream in (False, True):
        answer = client().post("/v1/completions", json=body | {"stream": stream})
        if stream:
            answer = [json.loads(e) for e in _events(answer.text)][0]
        else:
            answer = answer.json()
        logprobs = answer["choices"][0]["logprobs"]
        assert logprobs["tokens"] == ["<50>", "<51>", "<0>"]
        assert logprobs["token_logprobs"] == [None, -0.5, 0.0]
        assert logprobs["top_logprobs"] == [None, {"<51>": -0.5}, {"<0>": 0.0}]
        assert logprobs["text_offset"] == [0, 4, 8]


def test_an_echo_with_max_tokens_0_scores_the_prompt_alone_whole_and_streamed():
    body = {"model": "llm", "prompt": [50, 51, 52], "echo": True, "max_tokens": 0, "logprobs": 1}
    backend = FakeBackend()
    api = client(backend)
    whole = api.post("/v1/completions", json=body).json()
    (choice,) = whole["choices"]
    assert choice["text"] == "<50><51><52>" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["<50>", "<51>", "<52>"],
        "token_logprobs": [None, -0.5, -0.5],
        "top_logprobs": [None, {"<51>": -0.5}, {"<52>": -0.5}],
        "text_offset": [0, 4, 8],
    }
    assert whole["usage"]["prompt_tokens"] == 3 and whole["usage"]["completion_tokens"] == 0
    assert backend.params[-1].max_tokens == 1  # the engines generate one; it is dropped
    events = stream_events(
        api, "/v1/completions", body | {"stream_options": {"include_usage": True}, "stream": True}
    )
    streamed = [c for e in events for c in e["choices"]]
    assert [c["text"] for c in streamed] == ["<50><51><52>"]
    assert streamed[0]["logprobs"] == choice["logprobs"]
    assert events[-1]["usage"]["completion_tokens"] == 0
    text = api.post("/v1/completions", json=body | {"prompt": "a b", "logprobs": None}).json()
    assert text["choices"][0]["text"] == "a b" and text["choices"][0]["logprobs"] is None


def test_max_tokens_0_without_echo_is_a_400_naming_the_field():
    api = client()
    for body in (
        {"model": "llm", "prompt": "a", "max_tokens": 0},
        {"model": "llm", "messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
    ):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        assert error_of(api.post(path, json=body), 400)["param"] == "max_tokens"
    assert api.post("/v1/completions", json={"model": "llm", "prompt": "a"}).status_code == 200


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", chat("a", logprobs=True, top_logprobs=2), "top_logprobs"),
        ("/v1/completions", {"model": "llm", "prompt": "a", "logprobs": 3}, "logprobs"),
        ("/v1/completions", {"model": "llm", "prompt": "a", "logprobs": 0, "echo": True}, "echo"),
    ],
)
def test_alternatives_and_prompt_logprobs_of_a_tensorrt_llm_model_are_400s(path, body, param):
    backend = FakeBackend()
    backend.alternatives = False
    api = client(backend)
    error = error_of(api.post(path, json=body), 400)
    assert error["param"] == param and "TensorRT-LLM" in error["message"]
    chosen_only = {"top_logprobs": 0} if "chat" in path else {"logprobs": 0, "echo": False}
    assert api.post(path, json={**body, **chosen_only}).status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", chat("a", top_logprobs=0), None),  # without logprobs
        ("/v1/chat/completions", chat("a", logprobs=True, top_logprobs=21), "top_logprobs"),
        ("/v1/completions", {"model": "llm", "prompt": "a", "logprobs": 21}, "logprobs"),
    ],
)
def test_log_probability_fields_out_of_range_are_400s(path, body, param):
    error = error_of(client().post(path, json=body), 400)
    assert error["param"] == param and "log" in error["message"]


def test_logit_bias_reaches_the_engine_as_token_ids():
    backend = FakeBackend()
    body = {"model": "llm", "prompt": "a", "logit_bias": {"7": 100, "9": -100}}
    assert client(backend).post("/v1/completions", json=body).status_code == 200
    assert backend.params[-1].logit_bias == ((7, 100.0), (9, -100.0))


def test_logit_bias_keys_outside_the_vocabulary_are_one_400_naming_each():
    one = {"model": "llm", "prompt": "a", "logit_bias": {"7": 1, "100": 1}}
    error = error_of(client().post("/v1/completions", json=one), 400)
    assert error["param"] == "logit_bias"
    assert "key '100' is not a token id of this model's vocabulary [0, 100)" in error["message"]
    several = chat("a", logit_bias={"250": 1, "7": 1, "100": -1})
    error = error_of(client().post("/v1/chat/completions", json=several), 400)
    assert "keys '250', '100' are not token ids" in error["message"]


def test_token_id_prompts_go_to_the_engine_as_they_are():
    backend = FakeBackend()
    api = client(backend)
    body = {"model": "llm", "prompt": [[5, 6], [7]], "max_tokens": 1, "echo": True}
    answer = api.post("/v1/completions", json=body).json()
    assert [c["text"] for c in answer["choices"]] == ["<5><6> t5", "<7> t7"]
    assert [(p.prompt, p.prompt_token_ids) for p in backend.params] == [("", (5, 6)), ("", (7,))]
    api.post("/v1/completions", json={"model": "llm", "prompt": [9, 8, 7]})
    assert backend.params[-1].prompt_token_ids == (9, 8, 7)


@pytest.mark.parametrize(
    "prompt, words",
    [([3, 100], "outside the vocabulary [0, 100): [100]"), ([-1], "greater than or equal to 0")],
)
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_it(prompt, words):
    response = client().post("/v1/completions", json={"model": "llm", "prompt": prompt})
    error = error_of(response, 400)
    assert error["param"].startswith("prompt") and words in error["message"]


@pytest.mark.parametrize("field, value", [("min_p", 0.1), ("tools", [])])
def test_a_known_field_we_refuse_says_why(field, value):
    body = {"model": "llm", "prompt": "a", field: value}
    error = error_of(client().post("/v1/completions", json=body), 400)
    assert error["param"] == field and error["message"].startswith(f"{field}: not supported: ")


def test_an_unknown_field_is_a_400_naming_it():
    body = {"model": "llm", "prompt": "a", "nonsense": 1}
    error = error_of(client().post("/v1/completions", json=body), 400)
    assert error["param"] == "nonsense" and "not permitted" in error["message"]


def test_the_apis_bound_on_alternatives_is_within_the_engines():
    """OpenAI's bound is the API's own; the engines' contract must take as many."""
    from serve.api.openai.fields import (
        MAX_TOP_LOG_PROBS,
    )
    from tritonllm import contract

    assert MAX_TOP_LOG_PROBS <= contract.MAX_TOP_LOG_PROBS
