"""A choice's ``logprobs`` in the shape of its endpoint, chunk by chunk: the tokens'
texts (from the model's tokenizer), their log probabilities and alternatives, and for
completions where each starts in the text. Chat completions, completions and the
Responses API (whose output text takes chat's token entries) read them here.
"""

from __future__ import annotations

from serve.api.common.backend import Backend
from serve.api.openai.endpoints import CHAT, Endpoint
from serve.api.openai.shapes import (
    ChatLogProbs,
    CompletionLogProbs,
)
from serve.config import ModelConfig
from serve.generation import GenerateParams, GenerationChunk, TopLogProbs


class LogProbs:
    """Each choice's ``logprobs``, chunk by chunk, in the shape of its endpoint: its
    tokens (the end token last, where it ended the answer: the chunk carries its log
    probability, one beyond its ``token_ids``), with completions' echo the prompt's
    tokens first, and for completions where each starts in the choice's text."""

    def __init__(self, backend: Backend, model: ModelConfig, endpoint: Endpoint, echoes):
        self._tokens = backend.token_texts(model)
        self._endpoint = endpoint
        self._echoes = echoes
        self._offsets = None  # each choice's, its answer after its echoed prompt
        if endpoint.text_offsets:
            self._offsets = [self._tokens.answer_offsets(len(echo)) for echo in echoes]

    def __call__(self, index: int, chunk: GenerationChunk) -> ChatLogProbs | CompletionLogProbs:
        ids = chunk.token_ids
        if chunk.logs_end_token:
            ids += (self._tokens.end_id,)
        tokens = self._tokens.texts(ids)
        log_probs = list(chunk.token_log_probs)
        alternatives = [self._alternatives(top) for top in chunk.top_log_probs]
        alternatives = alternatives or [[] for _ in tokens]
        offsets = self._answer_offsets(index, chunk)
        if chunk.prompt is not None:  # completions' echo: the prompt's tokens first
            prompt = chunk.prompt
            tokens = self._tokens.texts(prompt.token_ids) + tokens
            log_probs = list(prompt.log_probs) + log_probs
            tops = prompt.top_log_probs or [None, *([[]] * (len(prompt.token_ids) - 1))]
            alternatives = [self._alternatives(t) for t in tops] + alternatives
            if offsets is not None:
                echoed = self._echoes[index]
                offsets = self._tokens.prompt_offsets(prompt.token_ids, echoed) + offsets
        return self._endpoint.logprobs(tokens, log_probs, alternatives, offsets)

    def _answer_offsets(self, index: int, chunk: GenerationChunk) -> list[int] | None:
        """Where the chunk's tokens start; the end token, never in the text, at its end."""
        if self._offsets is None:
            return None
        answer = self._offsets[index]
        starts = answer.add(chunk.token_ids)
        return starts + [answer.position] if chunk.logs_end_token else starts

    def _alternatives(self, top: TopLogProbs | list | None):
        if top is None or isinstance(top, list):  # none (a prompt's first) or not asked
            return top
        return list(zip(self._tokens.texts(top.token_ids), top.log_probs, strict=True))


def chat_entries(backend: Backend, model: ModelConfig, params: GenerateParams):
    """A chunk's tokens' log probabilities as chat's entries, which the Responses API's
    output text takes; None where the request did not ask for them."""
    if not params.return_log_probs:
        return None
    shaped = LogProbs(backend, model, CHAT, [""])
    return lambda chunk: shaped(0, chunk).content
