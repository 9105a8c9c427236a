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
import openai
import pytest
import yaml

from serve.config import ROOT, AppConfig
from tests.integration.test_production import Load, assert_survived, wait_for

pytestmark = pytest.mark.integration
TRITON, VLLM = "tritonllm-default", "vllm-default"
VLLM_DEPLOYMENT = f"vLLM-{VLLM}"
PROMPTS = ["The cat", "Where is the train?", "Once upon a time", "The dog finds"]
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
    cluster.deploy(config)
    cluster.wait_running(timeout_s=600)  # a first vLLM start compiles the model (~1 min)
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
    messages = [{"role": "user", "content": "Where is the cat?"}]
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
