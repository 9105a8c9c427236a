"""Between our contract and vLLM's (no vLLM import here: both directions are
unit-tested in the project's environment, used in the vLLM one).

Going in, ``GenerateParams`` as vLLM ``SamplingParams`` keyword arguments. The same
request must mean the same decoding on either engine: the API has already resolved
sampling into explicit parameters (:mod:`serve.api.common.sampling`: greedy is ``top_k=1``),
which are translated here, not vLLM's defaults taken (vLLM would sample at
temperature 1); unset penalties stay neutral.

Coming back, vLLM's ``RequestOutput`` deltas (``RequestOutputKind.DELTA``) as
``GenerationChunk``s, in the Triton path's terms: log probabilities are the model's
own (vLLM's default ``logprobs_mode``, ``raw_logprobs``: before temperature,
penalties and logit_bias, as the torch engine computes them), alternatives are exactly
the ``k`` most likely tokens, and the end token is counted and its log probability
kept, but it is not among the tokens (TensorRT-LLM leaves it out of output_ids, and so
does the torch engine): ``GenerationChunk.logs_end_token``.
"""

from __future__ import annotations

import math
from typing import Any

from serve.generation import GenerateParams, GenerationChunk, PromptLogProbs, TopLogProbs


def sampling_kwargs(params: GenerateParams) -> dict[str, Any]:
    greedy = params.greedy
    log_probs = params.top_log_probs if params.return_log_probs else None
    kwargs: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": 0.0 if greedy else (params.temperature or 1.0),
        "top_p": params.top_p or 1.0,
        "top_k": 0 if greedy else params.top_k or 0,  # 0: the whole vocabulary
        "stop": list(params.stop),
        "ignore_eos": params.ignore_eos,
        # vLLM returns, per token, the chosen token's log probability and the k most
        # likely ones' (0: the chosen one's only), and the cumulative log probability
        # (which Triton's ensemble reports when asked) once any are requested.
        "logprobs": log_probs,
    }
    optional = {
        "seed": params.seed,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "min_tokens": params.min_tokens,
        # The prompt's tokens', with as many alternatives (vLLM then computes the whole
        # prompt: it skips its prefix cache, as the torch engine does).
        "prompt_logprobs": params.top_log_probs if params.prompt_log_probs else None,
        # A SamplingParams field (vLLM builds its logit-bias logits processor from it,
        # as its own OpenAI server passes the request's logit_bias).
        "logit_bias": dict(params.logit_bias) or None,
        "structured_outputs": structured_outputs(params),
    }
    return kwargs | {k: v for k, v in optional.items() if v is not None}


def structured_outputs(params: GenerateParams) -> dict[str, Any] | None:
    """The guide as vLLM's ``StructuredOutputsParams`` keyword arguments (its XGrammar
    backend compiles the same grammar the torch engine does): JSON without free
    whitespace, as the torch engine compiles it."""
    kind, guide = params.guide_type, params.guide
    if kind is None:
        return None
    if kind == "json":
        return {"json_object": True, "disable_any_whitespace": True}
    if kind == "json_schema":
        return {"json": guide, "disable_any_whitespace": True}
    key = {"regex": "regex", "ebnf_grammar": "grammar", "structural_tag": "structural_tag"}
    return {key[kind]: guide}


class ChunkReader:
    """One request's vLLM ``RequestOutput`` deltas as ``GenerationChunk``s, in order.

    vLLM's shapes (0.29, ``vllm.outputs`` and ``vllm.logprobs``): ``output.outputs[0]``
    (a ``CompletionOutput``) holds the delta's ``token_ids``, ``text``, ``logprobs`` (one
    ``{token id: Logprob}`` per new token: the chosen token first, then the top ``k``,
    the chosen one listed once, with the rank it has among the top ``k`` if it is
    there, so ``k + 1`` entries when it is not), ``cumulative_logprob`` and
    ``finish_reason``; ``output.prompt_logprobs`` (the first delta only) holds None for
    the prompt's first token, then one such dict per prompt token;
    ``output.num_cached_tokens`` the prompt tokens vLLM's prefix cache held. An answer
    that the end token ended has it last (``finish_reason`` "stop", ``stop_reason``
    None).
    """

    def __init__(self, params: GenerateParams):
        self.params = params
        self.generated = 0  # output tokens so far, the end token included (as vLLM's)

    def __call__(self, output) -> GenerationChunk:
        completion = output.outputs[0]
        self.generated += len(completion.token_ids)
        positions = completion.logprobs  # None unless log probabilities were asked
        steps = [] if positions is None else list(zip(completion.token_ids, positions, strict=True))
        ended_by_end_token = completion.finish_reason == "stop" and completion.stop_reason is None
        ids = list(completion.token_ids)
        if ended_by_end_token and ids:
            # vLLM returns the end token among its ids; the Triton path leaves it out, as
            # TensorRT-LLM does, and keeps its log probability after the others.
            ids.pop()
        return GenerationChunk(
            text=completion.text,
            num_input_tokens=len(output.prompt_token_ids or ()),
            num_output_tokens=self.generated,
            cum_log_prob=completion.cumulative_logprob,
            finish_reason=completion.finish_reason if output.finished else None,
            num_cached_tokens=output.num_cached_tokens or 0,
            token_ids=tuple(ids),  # always: a lost replica's answer resumes from them
            **self._log_probs(steps, positions is not None),
            prompt=self._prompt(output),
        )

    def _log_probs(self, steps: list, returned: bool) -> dict[str, Any]:
        """The new tokens (``steps``: each one's id and vLLM's dict of its position), each
        one's log probability and, when asked, its alternatives."""
        if not self.params.return_log_probs or not returned:
            return {}
        k = self.params.top_log_probs
        return {
            "token_log_probs": tuple(position[token].logprob for token, position in steps),
            "top_log_probs": tuple(top(position, k) for _, position in steps) if k else (),
        }

    def _prompt(self, output) -> PromptLogProbs | None:
        """The prompt's log probabilities, where vLLM gives them (its first delta)."""
        positions = output.prompt_logprobs
        if not self.params.prompt_log_probs or not positions:
            return None
        ids = tuple(output.prompt_token_ids)
        chosen = list(zip(ids[1:], positions[1:], strict=True))  # the first has none
        k = self.params.top_log_probs
        return PromptLogProbs(
            token_ids=ids,
            log_probs=(None, *(position[token].logprob for token, position in chosen)),
            top_log_probs=(None, *(top(p, k) for _, p in chosen)) if k else (),
        )


def top(position: dict, k: int) -> TopLogProbs:
    """The ``k`` most likely tokens of one position's vLLM dict, most likely first: the
    chosen token (always first in the dict) only if it is one of them."""
    entries = list(position.items())
    if len(entries) > k:  # the chosen token is outside the top k: not an alternative
        entries = entries[1:]
    # The top k come in rank order, but the chosen token, first, may be any of them.
    entries.sort(key=lambda entry: (_rank(entry[1]), -entry[1].logprob))
    return TopLogProbs(
        token_ids=tuple(token for token, _ in entries),
        log_probs=tuple(logprob.logprob for _, logprob in entries),
    )


def _rank(logprob) -> float:
    return math.inf if logprob.rank is None else logprob.rank
