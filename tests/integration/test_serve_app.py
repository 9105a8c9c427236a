"""The whole stack: `serve run` of the Serve config, real Triton, real HTTP, the openai SDK."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import yaml

from serve.engines.triton.launcher import free_port
from tests import aiperf_env, lm_eval_env, lm_eval_harness
from tests.conftest import ROOT
from tests.integration.abandon import IDLE_WITHIN_S, SHORT_WITHIN_S, abandon_then_serve
from tests.integration.repositories import repository_with_limits
from tests.unit.tritonllm.test_embeddings import SENTENCES, cosine

# quiet: the engine freed within seconds of a client leaving is a time bound.
pytestmark = [pytest.mark.integration, pytest.mark.quiet]
MODEL = "tritonllm-default"


@pytest.fixture(scope="module")
def one_slot_repository(checkpoint_dir, tmp_path_factory) -> Path:
    """The default model with one engine slot (it makes "the abandoned request was
    freed" observable)."""
    scratch = tmp_path_factory.mktemp("one_slot")
    return repository_with_limits(
        checkpoint_dir, scratch / "model_repository", "--max-batch-size", "1"
    )


# Every test of this module runs against both layouts (serve/config.py's ``layout``):
# an ingress in front of the model's replicas, and the replicas serving the API
# themselves, which serve one model (the embeddings tests skip there).
@pytest.fixture(scope="module", params=["ingress", "direct"])
def layout(request) -> str:
    return request.param


@pytest.fixture
def embeddings_served(layout):
    if layout == "direct":
        pytest.skip("layout: direct serves one model; the embeddings model needs an ingress")


@pytest.fixture(scope="module")
def app_url(layout, one_slot_repository, built_embedding_repository, tmp_path_factory):
    """`serve run` on the project's config, over a one-slot repository of the default model."""
    scratch = tmp_path_factory.mktemp("serve")
    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    model = args["models"][0]
    model["triton"]["model_repository"] = str(one_slot_repository)
    if layout == "direct":
        args |= {"layout": "direct", "models": [model]}
    (scratch / "config.yaml").write_text(yaml.safe_dump(config))
    # What `make run` runs, in the Serve mode it ships.
    with launched(scratch / "config.yaml", port, scratch / "serve.log") as url:
        yield url


@contextlib.contextmanager
def launched(config_path: Path, port: int, log_path: Path, *launch_args: str):
    """`python -m serve.launch [launch_args] config_path` until every model is ready; the
    URL, then Ctrl-C (Serve, Ray, HAProxy, Triton), SIGKILL after a minute."""
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "serve.launch", *launch_args, str(config_path)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, log_path)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def wait_ready(url: str, process, log_path: Path, timeout_s: float = 300) -> None:
    """Until ``/health`` says every model has a running replica (``/v1/models`` answers
    as soon as the ingress is up, before any Triton has started)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"serve run not ready: {log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def client(app_url):
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Where is the cat?"}]


def test_models_are_listed_in_openai_format(client, layout):
    served = [MODEL, "all-MiniLM-L6-v2"] if layout == "ingress" else [MODEL]
    assert [m.id for m in client.models.list().data] == served
    assert client.models.retrieve(MODEL).id == MODEL


def test_streamed_chat_concatenates_to_the_non_streamed_answer(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_finish_reason_is_length_when_max_tokens_ends_the_answer(client):
    short = client.completions.create(model=MODEL, prompt="The cat", max_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
    long = client.completions.create(model=MODEL, prompt="The cat", max_tokens=200)
    assert long.choices[0].finish_reason == "stop" and long.usage.completion_tokens < 200


def test_a_list_of_prompts_gets_one_choice_each_streamed_or_not(client):
    prompts = ["The cat", "Where is the river?", "Hello"]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10)
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=10).choices[0].text
        for p in prompts
    ]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == alone
    streamed = ["", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == alone


def test_generate_get_and_post_match_completions(app_url, client):
    text = client.completions.create(model=MODEL, prompt="The cat", max_tokens=12).choices[0].text
    got = httpx.get(f"{app_url}/generate", params={"query": "The cat", "max_new_tokens": 12})
    posted = httpx.post(f"{app_url}/generate", json={"prompt": "The cat", "max_new_tokens": 12})
    assert got.json() == posted.json() == {"text": text}


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "tools": []}, 400, "tools"),
        ({"model": MODEL, "prompt": "x", "n": 65}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_error_objects_and_the_app_serves_on(
    app_url, client, body, status, param
):
    response = httpx.post(f"{app_url}/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


def test_an_oversized_body_is_a_413_and_the_app_serves_on(app_url, client):
    body = {"model": MODEL, "prompt": "x" * (2 << 20), "max_tokens": 2}
    response = httpx.post(f"{app_url}/v1/completions", json=body)
    assert response.status_code == 413
    assert "exceeds" in response.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


def test_an_over_long_prompt_is_a_400_context_length_exceeded_without_internals(app_url):
    body = {"model": MODEL, "prompt": "The cat sat. " * 200, "max_tokens": 8}
    for stream in (False, True):
        response = httpx.post(f"{app_url}/v1/completions", json={**body, "stream": stream})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert "maximum sequence length of" in error["message"]
        for internal in ("Traceback", ".py", "pid", "actor", "127.0.0.1"):
            assert internal not in error["message"], error["message"]


def test_metrics_hold_the_apis_figures_and_tritons_with_the_replicas_labels(app_url, client):
    """Either layout publishes the API's request figures and its Triton's (in direct, one
    process publishes both), every sample labelled with the process it came from."""
    client.completions.create(model=MODEL, prompt="The cat", max_tokens=4)
    deadline = time.monotonic() + 30  # pushed every few seconds (serve/metrics.py)
    while time.monotonic() < deadline:
        text = httpx.get(f"{app_url}/metrics", timeout=10).text
        names = {"tritonllm_generated_tokens_total", "tritonllm_engine_generated_tokens_total"}
        lines = [line for line in text.splitlines() if line.split("{")[0] in names]
        if {line.split("{")[0] for line in lines} == names:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"not every figure is in /metrics: {lines}")
    assert "nv_inference_request_success" in text
    assert all('replica="' in line and 'deployment="' in line for line in lines), lines


def test_a_client_that_disconnects_mid_stream_frees_the_engine(app_url, client):
    body = {"model": MODEL, "prompt": "The cat", "max_tokens": 480, "min_tokens": 480}
    start = time.monotonic()
    client.completions.create(  # the whole thing, for scale
        model=MODEL, prompt="The cat", max_tokens=480, extra_body={"min_tokens": 480}
    )
    full_s = time.monotonic() - start
    events = []
    with httpx.stream("POST", f"{app_url}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
            if len(events) >= 3:
                break  # leaving the block closes the connection mid-stream
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    # One engine slot: this waits for the abandoned request unless it was stopped.
    start = time.monotonic()
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text
    assert time.monotonic() - start < full_s / 2, (time.monotonic() - start, full_s)


def test_clients_that_give_up_on_whole_answers_free_the_engine_at_once(
    app_url, one_slot_repository
):
    """Through HAProxy (the shipped mode): each client's close reaches its ingress
    replica, whose Serve cancels the request down to the engine. Before HAProxy ran
    without splicing, about half of them ran to their end: 30 x 400 tokens on one slot."""
    idle_s, short_s = abandon_then_serve(app_url, one_slot_repository)
    assert idle_s < IDLE_WITHIN_S and short_s < SHORT_WITHIN_S, (idle_s, short_s)


EMBEDDINGS = "all-MiniLM-L6-v2"


def test_embeddings_equal_the_models_own_output_and_rank_similar_sentences(
    client, embedding_model_dir, embeddings_served
):
    from sentence_transformers import SentenceTransformer

    sentences = SENTENCES[:4]
    reply = client.embeddings.create(model=EMBEDDINGS, input=sentences)  # base64 on the wire
    vectors = np.array([d.embedding for d in reply.data])
    reference = SentenceTransformer(str(embedding_model_dir), device="cpu").encode(sentences)
    assert [d.index for d in reply.data] == [0, 1, 2, 3]
    assert (cosine(vectors, reference) > 0.9999).all()
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(sentences)
    similar, unrelated = cosine(vectors[0], vectors[1]), cosine(vectors[0], vectors[2])
    assert similar > unrelated + 0.3
    one = client.embeddings.create(model=EMBEDDINGS, input=sentences[0], encoding_format="float")
    assert cosine(np.array(one.data[0].embedding), vectors[0]) > 0.9999
    assert EMBEDDINGS in [m.id for m in client.models.list().data]


def test_a_long_input_list_is_split_over_requests_in_order(client, embeddings_served):
    texts = [f"sentence number {i} about a cat" for i in range(150)]  # > max_batch_size
    reply = client.embeddings.create(model=EMBEDDINGS, input=texts)
    alone = client.embeddings.create(model=EMBEDDINGS, input=texts[137]).data[0].embedding
    assert len(reply.data) == 150
    assert cosine(np.array(reply.data[137].embedding), np.array(alone)) > 0.9999


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": EMBEDDINGS, "input": ""}, 400, "input"),
        ({"model": EMBEDDINGS, "input": [1, 2, 3]}, 400, "input"),
        ({"model": EMBEDDINGS, "input": "x", "dimensions": 8}, 400, "dimensions"),
        ({"model": MODEL, "input": "x"}, 404, "model"),
        ({"model": EMBEDDINGS, "prompt": "x"}, 404, "model"),
    ],
)
def test_bad_embedding_requests_get_error_objects(
    app_url, client, body, status, param, embeddings_served
):
    path = "/v1/completions" if "prompt" in body else "/v1/embeddings"
    response = httpx.post(f"{app_url}{path}", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert client.embeddings.create(model=EMBEDDINGS, input="still serving").data


# -- OpenAI conformance: the shapes current clients send, the SDK's own types -----------

# On the default model the first generated token for this prompt is end-of-sequence.
ENDS_AT_ONCE = "What is the capital of France?"


def post(app_url: str, path: str, body: dict) -> httpx.Response:
    response = httpx.post(f"{app_url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def sse_events(app_url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{app_url}{path}", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_every_answer_parses_with_the_openai_sdks_own_types(app_url, layout):
    from openai.types import Completion, CreateEmbeddingResponse, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "n": 2, "seed": 1}
    usage = {"stream_options": {"include_usage": True}}
    ChatCompletion.model_validate(post(app_url, "/v1/chat/completions", chat).json())
    for event in sse_events(app_url, "/v1/chat/completions", {**chat, **usage}):
        ChatCompletionChunk.model_validate(event)
    text = {"model": MODEL, "prompt": ["The cat", ENDS_AT_ONCE], "max_tokens": 8, "echo": True}
    Completion.model_validate(post(app_url, "/v1/completions", text).json())
    for event in sse_events(app_url, "/v1/completions", {**text, **usage}):
        # The SDK reads completion chunks as Completion objects without validating
        # them: finish_reason is null until a choice's last chunk (as OpenAI sends it).
        finished = [c for c in event["choices"] if c["finish_reason"]]
        Completion.model_validate({**event, "choices": finished})
    Model.model_validate(httpx.get(f"{app_url}/v1/models/{MODEL}").json())
    if layout == "ingress":  # the one with an embeddings model
        body = {"model": EMBEDDINGS, "input": ["a cat"], "encoding_format": "float"}
        CreateEmbeddingResponse.model_validate(post(app_url, "/v1/embeddings", body).json())


def test_usage_counts_the_prompt_when_the_first_token_ends_the_answer(client):
    whole = client.completions.create(model=MODEL, prompt=ENDS_AT_ONCE, max_tokens=16)
    assert whole.choices[0].text == "" and whole.choices[0].finish_reason == "stop"
    assert whole.usage.prompt_tokens > 5
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=ENDS_AT_ONCE,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # ignore_eos (vLLM's extension): the same prompt now runs to max_tokens.
    forced = client.completions.create(
        model=MODEL, prompt=ENDS_AT_ONCE, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert forced.usage.completion_tokens == 5 and forced.choices[0].finish_reason == "length"


def test_stop_strings_are_cut_from_whole_and_streamed_answers(client):
    free = client.completions.create(model=MODEL, prompt="The cat", max_tokens=24, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2 :][:3]  # three characters from the middle of the answer
    expected = text[: text.index(stop)]
    cut = client.completions.create(
        model=MODEL, prompt="The cat", max_tokens=24, temperature=0, stop=[stop]
    )
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    streamed = client.completions.create(
        model=MODEL, prompt="The cat", max_tokens=24, temperature=0, stop=[stop], stream=True
    )
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in streamed if c.choices]
    assert "".join(p for p, _ in pieces) == expected and pieces[-1][1] == "stop"


def test_n_seeded_choices_differ_and_repeat(client):
    def sample():
        answer = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=11, n=3
        )
        return [c.message.content for c in answer.choices]

    first = sample()
    assert len(set(first)) > 1 and sample() == first


def test_content_parts_and_the_developer_role_read_as_text_and_system(client):
    def answer(messages) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0
        )
        return reply.choices[0].message.content

    as_text = answer([{"role": "system", "content": "Be brief."}, *MESSAGES])
    as_parts = answer(
        [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]},
        ]
    )
    assert as_parts == as_text


def test_langchain_chat_openai_invokes_streams_and_batches(app_url, client):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL, base_url=f"{app_url}/v1", api_key="unused", temperature=0, max_tokens=12
    )
    expected = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    expected = expected.choices[0].message.content
    question = MESSAGES[0]["content"]
    assert chat.invoke(question).content == expected
    assert "".join(part.content for part in chat.stream(question)) == expected
    assert [m.content for m in chat.batch([question, question])] == [expected, expected]


# The default model's plain completions are a few words; as a chat turn it writes a
# whole sentence (which one depends on the machine that trained the model).
LONG_ANSWER_PROMPT = "<|user|>\nTell me about the red ball.</s>\n<|assistant|>\n"


def test_logprobs_of_the_chosen_tokens_whole_and_streamed(client):
    asked = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**asked)
    tokens = whole.choices[0].logprobs.content
    ended = whole.choices[0].finish_reason == "stop"  # the end token: listed last, no text
    names = [t.token for t in tokens]
    assert (names[-1] == "</s>") == ended and len(tokens) == whole.usage.completion_tokens
    assert "".join(names[: len(names) - ended]) == whole.choices[0].message.content
    assert all(t.logprob <= 0 for t in tokens)
    streamed = [
        t
        for chunk in client.chat.completions.create(**asked, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [
        (t.token, round(t.logprob, 4)) for t in tokens
    ]
    completion = client.completions.create(  # a prompt the model answers at length
        model=MODEL, prompt=LONG_ANSWER_PROMPT, max_tokens=8, temperature=0, logprobs=0
    )
    logprobs, text = completion.choices[0].logprobs, completion.choices[0].text
    ended = completion.choices[0].finish_reason == "stop"
    answer = logprobs.tokens[: len(logprobs.tokens) - ended]
    assert "".join(answer) == text and len(logprobs.tokens) == completion.usage.completion_tokens
    # Each token where its text starts in the answer; the end token at the text's end.
    starts = [len("".join(answer[:i])) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == starts


def test_top_logprobs_list_alternatives_whole_and_streamed(client):
    asked = dict(model=MODEL, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**asked, temperature=0)
    tokens = whole.choices[0].logprobs.content
    for token in tokens:  # greedy: the chosen token is the most likely one
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
        assert [t.logprob for t in token.top_logprobs] == sorted(
            (t.logprob for t in token.top_logprobs), reverse=True
        )
    streamed = [
        t
        for chunk in client.chat.completions.create(**asked, temperature=0, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert [[a.token for a in t.top_logprobs] for t in streamed] == [
        [a.token for a in t.top_logprobs] for t in tokens
    ]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, checkpoint_dir):
    """lm-eval's loglikelihood requests: token ids, echo, logprobs 1, one token."""
    from tritonllm.tokenization import load_tokenizer

    ids = load_tokenizer(str(checkpoint_dir)).encode("The cat sits on the mat")
    answer = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(p <= 0 for p in logprobs.token_logprobs[1:])
    greedy = logprobs.top_logprobs[-1]  # the generated token: greedy, so the top one
    assert max(greedy, key=greedy.get) == logprobs.tokens[-1]


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory) -> Path:
    return lm_eval_harness.write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def lm_eval_reference(lm_eval_tasks, checkpoint_dir, tmp_path_factory):
    """lm-eval's own ``hf`` model on the checkpoint the stack serves (float32, as the
    torch engine runs it on the CPU)."""
    return lm_eval_harness.evaluate(
        lm_eval_env.ensure(),  # made by make test beforehand, else here
        lm_eval_tasks,
        tmp_path_factory.mktemp("lm_eval_hf"),
        "hf",
        f"pretrained={checkpoint_dir},dtype=float32",
    )


def test_lm_eval_scores_the_stack_as_it_scores_the_checkpoint(
    app_url, layout, client, checkpoint_dir, lm_eval_tasks, lm_eval_reference, tmp_path
):
    """lm-eval's local-completions (tokenized requests with the BOS its hf model adds;
    log-likelihoods by echo, logprobs 1, max_tokens 1, the last entry dropped as the
    generated token's) against its hf model: equal accuracy, log-likelihoods within
    1e-3, the same greedy generations. On the default layout: the direct one answers
    through the same completions code (the log probability tests above run on both)."""
    if layout != "ingress":
        pytest.skip("lm-eval runs on the default layout; both share the completions code")
    started = time.monotonic()
    served = lm_eval_harness.evaluate(
        lm_eval_env.ensure(),
        lm_eval_tasks,
        tmp_path,
        "local-completions",
        f"model={MODEL},base_url={app_url}/v1/completions,tokenizer={checkpoint_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True,max_retries=1",
    )
    seconds = time.monotonic() - started
    reference = lm_eval_reference
    assert served.generations == reference.generations
    differences = np.abs(np.subtract(served.log_likelihoods, reference.log_likelihoods))
    print(
        f"lm-eval: {len(differences)} log-likelihoods, max |difference| {differences.max():.2e}, "
        f"{seconds:.1f} s against the stack"
    )
    assert len(differences) == 400 and differences.max() < 1e-3
    choice = lm_eval_harness.CHOICE_TASK
    assert served.results[choice]["acc,none"] == reference.results[choice]["acc,none"]
    # The task holds what the check is about: answers whose generated token is the end one.
    scored = client.completions.create(
        model=MODEL, prompt="The cat sat on the mat.", max_tokens=1, echo=True, logprobs=1
    )
    assert scored.choices[0].logprobs.tokens[-1] == "</s>"


def test_logit_bias_forces_and_bans_a_token(client, checkpoint_dir):
    from tritonllm.tokenization import load_tokenizer

    river = load_tokenizer(str(checkpoint_dir)).encode(" river", add_special_tokens=False)[0]
    asked = dict(model=MODEL, prompt="The cat", max_tokens=4, temperature=0, logprobs=0)
    asked |= {"extra_body": {"ignore_eos": True}}
    free = client.completions.create(**asked)
    forced = client.completions.create(**asked, logit_bias={str(river): 100})
    assert forced.choices[0].text == " river" * 4
    first = free.choices[0].logprobs.tokens[0]
    first_id = load_tokenizer(str(checkpoint_dir)).encode(first, add_special_tokens=False)[0]
    banned = client.completions.create(**asked, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    with pytest.raises(openai.BadRequestError, match="10000000"):
        client.completions.create(**asked, logit_bias={"10000000": 5})


def test_usage_reports_the_prompt_tokens_read_from_the_prefix_cache(client):
    prompt = " ".join(["The teacher sends a long letter to the robot near the sea."] * 5)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens - 16 <= cached < again.usage.prompt_tokens


def test_a_token_id_prompt_answers_as_its_text_does(app_url, client, checkpoint_dir):
    from tritonllm.tokenization import load_tokenizer

    ids = load_tokenizer(str(checkpoint_dir)).encode("The cat")  # with BOS, as preprocessing
    as_text = client.completions.create(model=MODEL, prompt="The cat", max_tokens=10)
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage.prompt_tokens == as_text.usage.prompt_tokens == len(ids)
    both = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=4)
    assert both.choices[0].text == as_text.choices[0].text[: len(both.choices[0].text)]
    response = httpx.post(f"{app_url}/v1/completions", json={"model": MODEL, "prompt": [1, 10**6]})
    assert response.status_code == 400 and "vocabulary" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def aiperf() -> Path:
    return aiperf_env.ensure()  # made by make test beforehand, else here


def test_an_aiperf_run_completes_without_errors(app_url, layout, aiperf, checkpoint_dir, tmp_path):
    if layout == "direct":  # a client of the API, which the ingress layout's run checks
        pytest.skip("the same API as in the ingress layout, where aiperf runs")
    command = [
        str(aiperf), "profile", "--model", MODEL, "--url", app_url,
        "--endpoint-type", "chat", "--streaming", "--tokenizer", str(checkpoint_dir),
        "--request-count", "16", "--concurrency", "4", "--isl", "32", "--osl", "16",
        "--extra-inputs", "ignore_eos:true", "--artifact-dir", str(tmp_path),
        "--ui-type", "none",
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert report["is_complete"] and not report["error_summary"]
    assert report["request_count"]["avg"] == 16 and report["time_to_first_token"]["count"] == 16
    # The server's own usage: 16 tokens each (ignore_eos), prompts counted.
    completion = report["usage_completion_tokens"]
    assert completion["min"] == completion["max"] == 16
    assert report["usage_prompt_tokens"]["min"] > 0
