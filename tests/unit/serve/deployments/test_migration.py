"""A generation whose replica is lost resumes on another where it was cut.

The ingress's own stream (``ApiBackend._stream`` over Serve's handles) over stand-in
replicas that decode greedily from a fixed answer, as an engine would: the resumed
request's prompt is the prompt's ids and the delivered ones, and the text the client
gets equals an undisturbed run's, also where the cut splits a character.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from ray.exceptions import ActorDiedError

from serve.api.common.errors import Overloaded
from serve.api.common.sampling import SamplingDefaults
from serve.api.common.token_texts import TokenTexts
from serve.config import AppConfig, ModelConfig
from serve.deployments.api_backend import ApiBackend, ServedModel
from serve.deployments.ingress import HandleChannel
from serve.engines.facts import EngineFacts
from serve.generation import GenerateParams, GenerationChunk, GenerationError
from serve.migration import CannotResume, Resumable, resume_refusal
from tritonllm.detokenize import IncrementalDetokenizer
from tritonllm.tokenization import encode_prompt

PROMPT = "Say it:"
ANSWER = "Naïve café, 日本語 and more words after them."


class Engine:
    """Continues ``answer`` greedily from wherever a request's prompt left it, one token
    per chunk, text from its own detokenizer (as the postprocessing); ``lose_after``
    chunks into a request, its replica is lost with ``error``."""

    def __init__(self, tokenizer, answer_ids: list[int], lose_after: list[int], error):
        self.tokenizer = tokenizer
        self.prompt_ids = encode_prompt(tokenizer, PROMPT)
        self.answer_ids = answer_ids
        self.lose_after = list(lose_after)
        self.error = error
        self.requests: list[GenerateParams] = []

    async def generate(self, params: GenerateParams):
        self.requests.append(params)
        prompt = list(params.prompt_token_ids) or encode_prompt(self.tokenizer, params.prompt)
        done = len(prompt) - len(self.prompt_ids)
        assert prompt == self.prompt_ids + self.answer_ids[:done], "not a continuation"
        todo = self.answer_ids[done : done + params.max_tokens]
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        lose_after = self.lose_after.pop(0) if self.lose_after else None
        for produced, token in enumerate(todo, 1):
            if produced - 1 == lose_after:
                raise self.error
            yield GenerationChunk(
                text=detokenizer.add([token]),
                num_input_tokens=len(prompt),
                num_output_tokens=produced,
                cum_log_prob=-0.5 * produced,
                token_ids=(token,),
            )
        finish = "length" if len(todo) == params.max_tokens else "stop"
        yield GenerationChunk("", len(prompt), len(todo), -0.5 * len(todo), finish)


class Handle:
    """A DeploymentHandle's streaming call, on ``engine``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, params):
        return Responses(self.engine.generate(params))


class Responses:
    def __init__(self, chunks):
        self._chunks = chunks

    def __aiter__(self):
        return self._chunks

    def cancel(self):
        pass


def ingress_over(
    engine: Engine, max_migrations: int = 2, engine_resumes: bool = False
) -> tuple[ApiBackend, ModelConfig]:
    """The ingress's backend over a handle to ``engine``."""
    model = ModelConfig(id="m", max_migrations=max_migrations)
    config = AppConfig(models=[model], responses={"store": "none"})
    facts = EngineFacts(
        engine.tokenizer,
        checkpoint=Path("."),
        skips_special_tokens=True,
        adds_special_tokens=True,
        extensions=engine_resumes,
        takes_priority=False,
    )
    served = ServedModel(facts, TokenTexts(engine.tokenizer), SamplingDefaults(), None)
    channel = HandleChannel({"m": Handle(engine)}, config)
    return ApiBackend(config, channel, {"m": served}), model


async def answer(ingress, model, params) -> list[GenerationChunk]:
    return [chunk async for chunk in ingress._stream(model, params)]


@pytest.fixture()
def answer_ids(tokenizer) -> list[int]:
    return tokenizer.encode(ANSWER, add_special_tokens=False)


def split_character_cut(tokenizer, ids: list[int]) -> int:
    """A cut after which the detokenizer still holds part of a character back."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    for at, token in enumerate(ids, 1):
        if not detokenizer.add([token]) and at > 1:
            return at
    pytest.skip("this tokenizer writes every character of the answer in one token")


LOSSES = [ActorDiedError(), GenerationError("Triton exited", GenerationError.UNAVAILABLE)]


@pytest.mark.parametrize("error", LOSSES)
def test_a_lost_stream_resumes_with_the_undisturbed_text_and_counts(tokenizer, answer_ids, error):
    cut = split_character_cut(tokenizer, answer_ids)
    engine = Engine(tokenizer, answer_ids, lose_after=[cut, 3], error=error)
    ingress, model = ingress_over(engine)
    params = GenerateParams(prompt=PROMPT, max_tokens=len(answer_ids), min_tokens=len(answer_ids))
    chunks = asyncio.run(answer(ingress, model, params))

    assert "".join(c.text for c in chunks) == tokenizer.decode(answer_ids)
    assert [t for c in chunks for t in c.token_ids] == answer_ids
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert last.num_output_tokens == len(answer_ids)
    assert last.num_input_tokens == len(engine.prompt_ids)  # the client's prompt, once
    assert last.cum_log_prob == pytest.approx(-0.5 * len(answer_ids))
    first, second, third = engine.requests
    assert second.prompt_token_ids == tuple(engine.prompt_ids + answer_ids[:cut])
    assert second.prompt == PROMPT  # the text, for the routers (prefix-aware routing)
    assert second.max_tokens == second.min_tokens == len(answer_ids) - cut
    assert third.max_tokens == len(answer_ids) - cut - 3
    assert len({r.request_id for r in engine.requests}) == 3
    resumed = ingress.metrics.migrations.labels("m", "resumed")._value.get()
    assert resumed == 2


def test_past_max_migrations_the_client_gets_the_error(tokenizer, answer_ids):
    engine = Engine(tokenizer, answer_ids, lose_after=[2, 2, 2], error=ActorDiedError())
    ingress, model = ingress_over(engine, max_migrations=2)
    params = GenerateParams(prompt=PROMPT, max_tokens=len(answer_ids))
    with pytest.raises(Overloaded, match="moved to another replica 2 time"):
        asyncio.run(answer(ingress, model, params))
    assert len(engine.requests) == 3
    assert ingress.metrics.migrations.labels("m", "refused")._value.get() == 1


def test_a_move_lost_before_it_sent_anything_waits_before_the_next(tokenizer, answer_ids):
    answer_state = Resumable(GenerateParams(prompt=PROMPT, max_tokens=9), lambda: tokenizer, 3)
    prompt_length = len(encode_prompt(tokenizer, PROMPT))
    answer_state.deliver(GenerationChunk("x", prompt_length, 1, token_ids=(answer_ids[0],)))
    answer_state.resume()
    assert not answer_state.stalled  # the first move goes at once
    answer_state.deliver(GenerationChunk("y", prompt_length + 1, 1, token_ids=(answer_ids[1],)))
    answer_state.resume()
    assert not answer_state.stalled  # the last move made progress
    answer_state.resume()
    assert answer_state.stalled  # nothing since the last move: its replica died too


def test_max_migrations_zero_keeps_todays_error(tokenizer, answer_ids):
    engine = Engine(tokenizer, answer_ids, lose_after=[0], error=ActorDiedError())
    ingress, model = ingress_over(engine, max_migrations=0)
    with pytest.raises(Overloaded, match="died"):
        asyncio.run(answer(ingress, model, GenerateParams(prompt=PROMPT, max_tokens=4)))


def test_a_request_lost_before_its_first_token_goes_again_as_it_was(tokenizer, answer_ids):
    engine = Engine(tokenizer, answer_ids, lose_after=[0], error=ActorDiedError())
    ingress, model = ingress_over(engine)
    params = GenerateParams(prompt=PROMPT, max_tokens=5)
    chunks = asyncio.run(answer(ingress, model, params))
    assert "".join(c.text for c in chunks) == tokenizer.decode(answer_ids[:5])
    retry = engine.requests[1]
    assert retry.prompt == PROMPT and not retry.prompt_token_ids and retry.max_tokens == 5


def test_a_stream_lost_after_its_last_token_just_ends(tokenizer, answer_ids):
    answer_state = Resumable(GenerateParams(prompt=PROMPT, max_tokens=2), lambda: tokenizer, 2)
    for token in answer_ids[:2]:
        answer_state.deliver(GenerationChunk("x", 3, 1, token_ids=(token,)))
    assert answer_state.finished
    end = answer_state.final_chunk()
    assert end.finish_reason == "length" and end.num_output_tokens == 2
    assert end.num_input_tokens == 3


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"guide_type": "json"}, "grammar"),
        ({"presence_penalty": 0.5}, "penalties"),
        ({"frequency_penalty": 0.5}, "penalties"),
        ({"seed": 7, "temperature": 0.8}, "seeded sampling"),
    ],
)
def test_without_the_engines_resume_what_would_not_continue_exactly_is_not_resumed(
    tokenizer, change, why
):
    params = dataclasses.replace(GenerateParams(prompt=PROMPT, max_tokens=8), **change)
    assert why in resume_refusal(params, engine_resumes=False)
    answer_state = Resumable(params, lambda: tokenizer, 2)
    answer_state.deliver(GenerationChunk("x", 3, 1, token_ids=(5,)))
    with pytest.raises(CannotResume, match=why):
        answer_state.resume()


@pytest.mark.parametrize(
    "change",
    [{}, {"seed": 7}, {"seed": 7, "temperature": 0.0}, {"temperature": 0.8}, {"top_k": 1}],
)
def test_greedy_seeded_greedy_and_unseeded_sampling_resume_on_any_engine(change):
    params = dataclasses.replace(GenerateParams(prompt=PROMPT, max_tokens=8), **change)
    assert resume_refusal(params, engine_resumes=False) is None


def test_an_engine_that_resumes_gets_the_answer_so_far_named_and_resumes_anything(
    tokenizer, answer_ids
):
    engine = Engine(tokenizer, answer_ids, lose_after=[6], error=ActorDiedError())
    ingress, model = ingress_over(engine, engine_resumes=True)
    params = GenerateParams(
        prompt=PROMPT, max_tokens=10, seed=3, temperature=0.7, presence_penalty=0.4
    )
    chunks = asyncio.run(answer(ingress, model, params))
    assert "".join(c.text for c in chunks) == tokenizer.decode(answer_ids[:10])
    first, resumed = engine.requests
    assert first.resumed_tokens == 0
    assert resumed.resumed_tokens == 6 and resumed.prompt_token_ids[-6:] == tuple(answer_ids[:6])
    assert (resumed.seed, resumed.presence_penalty) == (3, 0.4)  # as sent: the engine continues


def test_a_prompt_the_engine_counted_otherwise_is_not_resumed(tokenizer):
    """The ingress tokenizes the prompt to resume it: where the engine's count differs
    (another tokenizer), the continuation would not be exact, and is refused."""
    answer_state = Resumable(GenerateParams(prompt=PROMPT, max_tokens=9), lambda: tokenizer, 2)
    engine_count = len(encode_prompt(tokenizer, PROMPT)) + 1
    answer_state.deliver(GenerationChunk("x", engine_count, 1, token_ids=(5,)))
    with pytest.raises(CannotResume, match="tokenizes to .* tokens here, .* in the engine"):
        answer_state.resume()
