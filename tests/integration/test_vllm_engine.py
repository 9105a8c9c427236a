"""One app, both engines: the default checkpoint through Triton and through vLLM (Ray Serve
LLM's LLMServer in the vLLM environment), behind the same ingress, on a real cluster.

serve/config.vllm.yaml as shipped, deployed once for the module; the vLLM environment
is the one ``make vllm-env`` builds (``make test`` builds it first).
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import jsonschema
import openai
import pytest
import yaml

from serve.config import ROOT, AppConfig
from tests.integration.test_production import Load, assert_survived, wait_for

pytestmark = pytest.mark.integration
TRITON, VLLM = "tritonllm-default", "vllm-default"
VLLM_DEPLOYMENT = f"vLLM-{VLLM}"
PROMPTS = ["The cat", "Where is the train?", "Once upon a time", "The dog finds"]
MESSAGES = [{"role": "user", "content": "Where is the cat?"}]
CONFIG = ROOT / "serve" / "config.vllm.yaml"


@pytest.fixture(scope="module")
def both_engines(cluster, built_repository):
    config = yaml.safe_load(CONFIG.read_text())
    model = AppConfig.model_validate(config["applications"][0]["args"]).models[1]
    if not model.vllm.python_path().exists():
        pytest.fail(f"no vLLM environment at {model.vllm.python_path()}: run `make vllm-env`")
    # Quick health checks: the kill test waits for Serve to notice a dead replica.
    for args in config["applications"][0]["args"]["models"]:
        args["deployment"] |= {"health_check_period_s": 1, "health_check_timeout_s": 30}
    # Eager: torch.compile costs each vLLM start ~13 s of this 2-core machine (twice
    # here: the kill test starts another), and what these tests compare is the answers.
    llm_config = config["applications"][0]["args"]["models"][1]["vllm"]["llm_config"]
    llm_config["engine_kwargs"]["enforce_eager"] = True
    cluster.deploy(config)
    cluster.wait_running(timeout_s=600)
    return cluster.url


def complete(url: str, model: str, prompt: str, **body) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 24, **body}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_text(url: str, model: str, prompt: str) -> tuple[str, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "stream": True}
    text, finish = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return "".join(text), finish


def test_both_engines_answer_the_same_greedy_text_streamed_and_not(both_engines):
    answered = 0
    for prompt in PROMPTS:
        triton, vllm = (complete(both_engines, m, prompt) for m in (TRITON, VLLM))
        answered += bool(triton["choices"][0]["text"])  # the tiny model may stop at once
        assert vllm["choices"][0]["text"] == triton["choices"][0]["text"], prompt
        assert vllm["choices"][0]["finish_reason"] == triton["choices"][0]["finish_reason"]
        assert vllm["usage"] == triton["usage"], prompt
        streamed = streamed_text(both_engines, VLLM, prompt)
        assert streamed == (triton["choices"][0]["text"], triton["choices"][0]["finish_reason"])
    assert answered >= 2, "compare real answers, not empty ones"


def test_the_vllm_model_is_listed_and_answers_the_openai_sdk(both_engines):
    client = openai.OpenAI(base_url=f"{both_engines}/v1", api_key="unused", max_retries=0)
    assert {m.id for m in client.models.list()} == {TRITON, VLLM}
    messages = MESSAGES
    answers = {}
    for model in (TRITON, VLLM):
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16)
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert chat.model == model and streamed == chat.choices[0].message.content
        answers[model] = chat.choices[0].message.content
    # The ingress renders the chat template for both: the same prompt, the same answer.
    assert answers[VLLM] == answers[TRITON] and answers[VLLM]
    raw = client.completions.with_raw_response.create(model=VLLM, prompt="The cat", max_tokens=4)
    assert raw.headers.get("x-request-id"), raw.headers


def test_a_prompt_past_the_context_gets_the_same_error_object_from_both(both_engines):
    prompt = " ".join(["cat"] * 2000)  # far past max_model_len (512 tokens)
    errors = {}
    for model in (TRITON, VLLM):
        body = {"model": model, "prompt": prompt, "max_tokens": 8}
        response = httpx.post(f"{both_engines}/v1/completions", json=body, timeout=60)
        errors[model] = (response.status_code, response.json())
    status, error = errors[VLLM]
    assert status == errors[TRITON][0] == 400, errors
    assert set(error) == {"error"} and error["error"]["type"] == "invalid_request_error"
    assert {k: v for k, v in error["error"].items() if k != "message"} == {
        k: v for k, v in errors[TRITON][1]["error"].items() if k != "message"
    }
    assert "Traceback" not in error["error"]["message"]


def events(url: str, path: str, body: dict) -> list[dict]:
    """A streamed answer's SSE events, parsed (without the closing [DONE])."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def chat_log_probs(url: str, model: str, stream: bool) -> tuple[list[dict], str, dict]:
    """A greedy chat answer's ``logprobs.content`` (3 alternatives per token), its
    finish reason and usage, streamed or whole."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": 12}
    body |= {"logprobs": True, "top_logprobs": 3}
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        choice = answer["choices"][0]
        return choice["logprobs"]["content"], choice["finish_reason"], answer["usage"]
    content, finish, usage = [], None, None
    for event in events(url, "/v1/chat/completions", body):
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            content += (choice["logprobs"] or {}).get("content") or []
            finish = choice["finish_reason"] or finish
    return content, finish, usage


def assert_every_token_listed(tokens: list[str], usage: dict, finish: str) -> None:
    """An answer lists every token it counts, the end token last where it stopped the
    answer (its log probability, as vLLM's own API lists it; never in the text)."""
    assert len(tokens) == usage["completion_tokens"]
    assert (tokens[-1] == "</s>") == (finish == "stop")


def assert_same_log_probs(entries: list[dict], reference: list[dict]) -> None:
    """Chat ``logprobs.content`` of two answers: the same tokens and alternatives, the
    same log probabilities (to float error)."""
    assert [e["token"] for e in entries] == [r["token"] for r in reference]
    assert [e["logprob"] for e in entries] == pytest.approx(
        [r["logprob"] for r in reference], abs=1e-3
    )
    for entry, ref in zip(entries, reference, strict=True):
        assert [t["token"] for t in entry["top_logprobs"]] == [
            t["token"] for t in ref["top_logprobs"]
        ]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in ref["top_logprobs"]], abs=1e-3
        )


def test_chat_top_logprobs_are_3_alternatives_the_greedy_token_first(both_engines):
    answers = {}
    for model in (TRITON, VLLM):
        for stream in (False, True):
            content, finish, usage = chat_log_probs(both_engines, model, stream)
            assert_every_token_listed([t["token"] for t in content], usage, finish)
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
            for entry in content:
                top = entry["top_logprobs"]
                assert len(top) == 3, (model, stream, entry)
                values = [t["logprob"] for t in top]
                assert values == sorted(values, reverse=True) and values[0] <= 0
                # Greedy: the chosen token is the most likely one, its log probability
                # the same number.
                assert (top[0]["token"], top[0]["logprob"]) == (entry["token"], entry["logprob"])
            answers[model, stream] = content, finish, usage
    reference, finish, usage = answers[TRITON, False]
    for (model, stream), (content, their_finish, their_usage) in answers.items():
        assert (their_finish, their_usage) == (finish, usage), (model, stream)
        assert_same_log_probs(content, reference)


def completion_echo(url: str, model: str, stream: bool) -> tuple[dict, str, str, dict]:
    """``echo`` with ``logprobs: 1``: the choice's logprobs, text, finish reason and usage."""
    body = {"model": model, "prompt": PROMPTS[2], "max_tokens": 8, "echo": True, "logprobs": 1}
    if not stream:
        answer = complete(url, model, PROMPTS[2], max_tokens=8, echo=True, logprobs=1)
        choice = answer["choices"][0]
        return choice["logprobs"], choice["text"], choice["finish_reason"], answer["usage"]
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    text, finish, usage = [], None, None
    for event in events(url, "/v1/completions", body):
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
            for key, values in joined.items():
                values += (choice["logprobs"] or {}).get(key) or []
    return joined, "".join(text), finish, usage


def test_completions_echo_with_logprobs_lists_the_prompt_tokens_first_none_first(both_engines):
    answers = {}
    for model in (TRITON, VLLM):
        for stream in (False, True):
            log_probs, text, finish, usage = completion_echo(both_engines, model, stream)
            prompt = usage["prompt_tokens"]  # the prompt's tokens, its BOS included
            tokens = log_probs["tokens"]
            assert_every_token_listed(tokens[prompt:], usage, finish)
            answer = tokens[prompt : len(tokens) - (finish == "stop")]
            assert text.startswith(PROMPTS[2]) and text == PROMPTS[2] + "".join(answer)
            assert log_probs["token_logprobs"][0] is None and log_probs["top_logprobs"][0] is None
            for token, value, top in zip(
                tokens[1:],
                log_probs["token_logprobs"][1:],
                log_probs["top_logprobs"][1:],
                strict=True,
            ):
                # The most likely token, and the token itself (OpenAI's and vLLM's shape).
                assert value <= 0 and top[token] == value and 1 <= len(top) <= 2
                assert max(top.values()) >= value
            answers[model, stream] = log_probs, text, finish, usage
    reference = answers[TRITON, False]
    for key, (log_probs, text, finish, usage) in answers.items():
        assert (text, finish, usage) == reference[1:], key
        assert log_probs["tokens"] == reference[0]["tokens"], key
        values, expected = log_probs["token_logprobs"], reference[0]["token_logprobs"]
        assert values[0] is None and values[1:] == pytest.approx(expected[1:], abs=1e-3)
        tops = zip(log_probs["top_logprobs"][1:], reference[0]["top_logprobs"][1:], strict=True)
        for top, ref in tops:
            assert top == pytest.approx(ref, abs=1e-3), key


def test_logit_bias_forces_and_bans_tokens_alike_on_both(both_engines, tokenizer):
    def token_id(text: str) -> int:
        # The API lists tokens as the ingress decodes them, one by one: back to the id.
        (found,) = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == text]
        return found

    forced = tokenizer.encode(" river", add_special_tokens=False)[0]
    answers = {}
    for model in (TRITON, VLLM):
        free = complete(both_engines, model, PROMPTS[0], max_tokens=6, logprobs=2)
        first, second = sorted(
            free["choices"][0]["logprobs"]["top_logprobs"][0].items(), key=lambda t: -t[1]
        )
        assert free["choices"][0]["logprobs"]["tokens"][0] == first[0]
        banned = complete(
            both_engines,
            model,
            PROMPTS[0],
            max_tokens=6,
            logprobs=0,
            logit_bias={str(token_id(first[0])): -100},
        )["choices"][0]
        # The otherwise greedy first token banned: the runner-up comes, with the model's
        # own log probability (the bias is not in it).
        assert banned["logprobs"]["tokens"][0] == second[0], model
        assert banned["logprobs"]["token_logprobs"][0] == pytest.approx(second[1], abs=1e-4)
        pushed = complete(
            both_engines,
            model,
            PROMPTS[0],
            max_tokens=4,
            logprobs=0,
            logit_bias={str(forced): 100},
        )["choices"][0]
        assert (
            pushed["text"] == tokenizer.decode([forced] * 4) and pushed["finish_reason"] == "length"
        )
        assert pushed["logprobs"]["tokens"] == [tokenizer.decode([forced])] * 4
        assert max(pushed["logprobs"]["token_logprobs"]) < -1  # the model's own: unlikely
        answers[model] = banned, pushed
    for triton, vllm in zip(answers[TRITON], answers[VLLM], strict=True):
        assert vllm["text"] == triton["text"]
        assert vllm["logprobs"]["token_logprobs"] == pytest.approx(
            triton["logprobs"]["token_logprobs"], abs=1e-3
        )


def test_a_repeated_prompt_reports_its_cached_tokens_on_both(both_engines):
    # Longer than a KV block (vLLM on CPU: 128 tokens; the torch engine: 16).
    prompt = " ".join(["The teacher sends a long letter to the robot near the sea."] * 16)
    for model in (TRITON, VLLM):
        first, again = (
            complete(both_engines, model, f"{model}: {prompt}", max_tokens=2) for _ in "12"
        )
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}, model
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < again["usage"]["prompt_tokens"], (model, again["usage"])
        assert {k: v for k, v in again["usage"].items() if k != "prompt_tokens_details"} == {
            k: v for k, v in first["usage"].items() if k != "prompt_tokens_details"
        }


def test_a_killed_vllm_replica_is_replaced_and_nothing_hangs(both_engines, cluster):
    victim = cluster.running_replicas("llm", VLLM_DEPLOYMENT)[0]
    # Requests sent while no replica runs wait in Serve's queue for the new one (a vLLM
    # start takes minutes on 2 busy cores): the clients wait as long.
    with Load(both_engines, clients=2, model=VLLM, max_tokens=16, timeout_s=300) as load:
        time.sleep(3)
        os.kill(victim["pid"], signal.SIGKILL)

        def replaced():
            running = cluster.running_replicas("llm", VLLM_DEPLOYMENT)
            return running and victim["replica_id"] not in {r["replica_id"] for r in running}

        wait_for(replaced, 300, "the vLLM replica replaced")
        recovered_at = time.monotonic()
        time.sleep(5)
    assert_survived(load, recovered_at)


def test_logprobs_and_token_id_prompts_mean_the_same_on_both(both_engines, checkpoint_dir):
    from tritonllm.tokenization import load_tokenizer

    answers = {m: complete(both_engines, m, PROMPTS[0], logprobs=0) for m in (TRITON, VLLM)}
    triton, vllm = (answers[m]["choices"][0]["logprobs"] for m in (TRITON, VLLM))
    assert vllm["tokens"] == triton["tokens"] and triton["tokens"]
    assert vllm["token_logprobs"] == pytest.approx(triton["token_logprobs"], abs=1e-3)
    ids = load_tokenizer(str(checkpoint_dir)).encode(PROMPTS[0])
    by_ids = {m: complete(both_engines, m, ids)["choices"][0]["text"] for m in (TRITON, VLLM)}
    assert by_ids[VLLM] == by_ids[TRITON] == answers[TRITON]["choices"][0]["text"]


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_both_engines_hold_answers_to_a_schema_and_to_the_tools(both_engines):
    """Guided decoding on either engine (the torch engine's XGrammar, vLLM's structured
    outputs): greedy answers are the same schema-valid object and the same tool call;
    sampled ones (temperature 1) are valid too."""
    client = openai.OpenAI(base_url=f"{both_engines}/v1", api_key="unused", max_retries=0)
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    messages = [{"role": "user", "content": "Who lives in Paris?"}]
    greedy, calls = {}, {}
    for model in (TRITON, VLLM):
        for seed in (None, 1, 2, 3):
            sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
            answer = client.chat.completions.create(
                model=model,
                messages=messages,
                response_format=response_format,
                max_tokens=200,
                **sampling,
            )
            choice = answer.choices[0]
            assert choice.finish_reason == "stop", (model, seed, choice)
            value = json.loads(choice.message.content)
            jsonschema.validate(value, PERSON)
            greedy.setdefault(model, value)
        call = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            max_tokens=200,
            temperature=0,
        ).choices[0]
        assert call.finish_reason == "tool_calls", (model, call)
        (tool_call,) = call.message.tool_calls
        jsonschema.validate(
            json.loads(tool_call.function.arguments), WEATHER_TOOL["function"]["parameters"]
        )
        calls[model] = (tool_call.function.name, json.loads(tool_call.function.arguments))
    assert greedy[VLLM] == greedy[TRITON]
    assert calls[VLLM] == calls[TRITON]
