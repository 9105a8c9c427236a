"""Per-request sampling: logits processing, the token choice and its log-prob.

Each sequence owns a :class:`TokenSampler` with its own ``torch.Generator``, so
a seeded request draws the same tokens whatever else shares the batch. The seed
advances with the answer: the token at answer position ``i`` is drawn by the generator
seeded with ``seed + i * SEED_STRIDE`` (mod 2**64), so a request resumed at position
``i`` on another replica (``resumed``, the answer so far) draws what the uncut one would.

Guided decoding: a constrained sequence's sampler holds an XGrammar matcher and a
bitmask of the tokens its grammar allows next. The mask applies after the logit bias
and the penalties, before the greedy choice or the temperature/top-k/top-p warpers;
the chosen token is then fed to the matcher. Where the bias, bad words or min_tokens
leave none of the tokens the grammar allows (min_tokens once the grammar is complete
and allows only the end token), the grammar wins: the choice is made among its tokens
from the model's own logits, so min_tokens never forces text past a completed grammar.
Unconstrained sequences have no matcher and do none of this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tritonllm.tokenization import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request, with TensorRT-LLM's defaults.

    As in TensorRT-LLM, a request that sets none of temperature, top_k and top_p
    is decoded greedily; so is one with ``temperature == 0`` or ``top_k == 1``.
    Unlike TensorRT-LLM, a request that sets only a temperature samples from the
    whole distribution instead of silently staying greedy.
    """

    temperature: float | None = None
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = field(default=())
    # (token id, bias) added to the token's logit before anything else (TensorRT-LLM's
    # embedding_bias, OpenAI's logit_bias; -100 bans a token, +100 all but forces it).
    logit_bias: tuple[tuple[int, float], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.temperature is not None and self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0.0 <= self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in [0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        unset = self.temperature is None and self.top_k == 0 and not self.top_p
        return unset or self.temperature == 0 or self.top_k == 1


_NO_IDS = torch.empty((1, 0), dtype=torch.long)

# Between the seeds of consecutive answer positions (2**64 / golden ratio: positions of
# one seed, and nearby seeds, get far-apart generator seeds).
SEED_STRIDE = 0x9E3779B97F4A7C15


class TokenSampler:
    """Chooses the next token of one sequence from its last logits.

    ``matcher`` (an ``xgrammar.GrammarMatcher``, from
    :meth:`tritonllm.guided.GuideCompiler.matcher`) constrains the choice to its grammar,
    compiled for ``vocab_size`` tokens (the logits' width). ``resumed``: the answer so
    far of a request resumed on another replica (the end of its prompt), taken as
    generated: the grammar is replayed over it, the penalties count it, and the seed
    continues after it.
    """

    def __init__(
        self,
        params: SamplingParams,
        end_id: int | None,
        matcher=None,
        vocab_size: int = 0,
        resumed: tuple[int, ...] = (),
    ):
        self.params = params
        self._matcher = matcher
        self._resumed = len(resumed)
        # A negative end id (-1, TensorRT-LLM's "no end id": ignore_eos) ends nothing.
        self._end_id = end_id if end_id is not None and end_id >= 0 else None
        # The grammar admits no further token (complete, and no end token to choose):
        # the scheduler ends the sequence with "stop".
        self.guide_terminated = False
        if matcher is not None:
            import xgrammar as xgr

            self._xgr = xgr
            self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
            self._device_bitmask = self._bitmask
            self._replay(resumed)
            self._fill_bitmask()
        self._processors = _build_processors(params)
        self._reads_history = bool(
            params.repetition_penalty != 1.0
            or params.presence_penalty
            or params.frequency_penalty
            or params.bad_words
        )
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self._bias_ids = torch.tensor(ids, dtype=torch.long)
            self._bias_values = torch.tensor(values, dtype=torch.float32)
        self._generator = torch.Generator(device="cpu")
        if params.seed is None:
            self._generator.seed()

    def __call__(self, logits: torch.Tensor, history, num_generated: int) -> int:
        """The next token for 1-D ``logits`` given the ids so far.

        ``history`` (prompt + generated ids) becomes a tensor only for the
        penalties that read it, so plain greedy/top-k/top-p decoding does no
        O(sequence length) work per token. The log probabilities a request asks for
        are the model's own (:func:`log_probs`), as vLLM reports them by default.
        """
        scores = logits.to(torch.float32, copy=True).unsqueeze(0)
        if self.params.logit_bias:
            if self._bias_ids.device != scores.device:  # once: the logits' device
                self._bias_ids = self._bias_ids.to(scores.device)
                self._bias_values = self._bias_values.to(scores.device)
            scores[0].index_add_(0, self._bias_ids, self._bias_values)
        if self._reads_history:
            history = torch.as_tensor(history, dtype=torch.long)
            scores = self._penalize(scores, history, num_generated)
        elif num_generated < self.params.min_tokens and self._end_id is not None:
            scores[:, self._end_id] = float("-inf")
        if self._matcher is not None:
            scores = self._constrain(scores, logits, num_generated)
        if self.params.greedy:
            token = int(torch.argmax(scores, dim=-1))
        else:
            # Temperature, top-k and top-p warpers ignore input_ids.
            scores = self._processors(_NO_IDS, scores)
            probs = torch.softmax(scores, dim=-1)
            if self.params.seed is not None:
                position = self._resumed + num_generated
                self._generator.manual_seed((self.params.seed + position * SEED_STRIDE) % 2**64)
            token = int(torch.multinomial(probs.cpu(), 1, generator=self._generator))
        if self._matcher is not None:
            self._accept(token)
        return token

    # -- guided decoding --------------------------------------------------------

    def _fill_bitmask(self) -> None:
        """The tokens the grammar allows next (filled once per token, right after the
        previous one is accepted); none left means the grammar has ended."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._device_bitmask = self._bitmask
        if self._matcher.is_terminated() and not bool(self._bitmask.any()):
            self.guide_terminated = True

    def _constrain(self, scores: torch.Tensor, logits: torch.Tensor, num_generated: int):
        """``scores`` with every token the grammar forbids at -inf (in place)."""
        if self._device_bitmask.device != scores.device:  # once per token: CUDA logits
            self._device_bitmask = self._bitmask.to(scores.device, non_blocking=True)
        vocab = scores.shape[-1]
        self._xgr.apply_token_bitmask_inplace(scores, self._device_bitmask, vocab_size=vocab)
        # Only bad words and min_tokens set a score to -inf (a bias is at most -100), so
        # only they can have banned every token the grammar allows.
        bans = self.params.bad_words or num_generated < self.params.min_tokens
        if bans and torch.isneginf(scores).all():
            # Bias, bad words or min_tokens banned every token the grammar allows: the
            # grammar wins, over the model's own logits.
            scores = logits.to(torch.float32, copy=True).unsqueeze(0)
            self._xgr.apply_token_bitmask_inplace(scores, self._device_bitmask, vocab_size=vocab)
        return scores

    def _replay(self, resumed: tuple[int, ...]) -> None:
        """The grammar's state after the answer so far (a resumed request's)."""
        for at, token in enumerate(resumed):
            if token == self._end_id or not self._matcher.accept_token(token):
                raise InvalidRequest(
                    f"invalid resumed output: it leaves the guide's grammar at its token {at} "
                    f"({token})"
                )

    def _accept(self, token: int) -> None:
        if token == self._end_id:
            return  # the sequence ends here; nothing follows to constrain
        if not self._matcher.accept_token(token):  # cannot happen with the mask applied
            raise RuntimeError(f"token {token} is outside the request's grammar")
        self._fill_bitmask()

    def _penalize(self, scores: torch.Tensor, history: torch.Tensor, num_generated: int):
        p = self.params
        if p.repetition_penalty != 1.0:
            scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
                history.unsqueeze(0), scores
            )
        answered = self._resumed + num_generated  # a resumed request's earlier ones too
        if (p.presence_penalty or p.frequency_penalty) and answered:
            # OpenAI's presence/frequency penalties over the generated tokens;
            # transformers has no processor for them.
            generated = history[-answered:]
            counts = torch.bincount(generated, minlength=scores.shape[-1]).to(scores.dtype)
            scores = scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        if num_generated < p.min_tokens and self._end_id is not None:
            scores[:, self._end_id] = float("-inf")
        for word in p.bad_words:
            if len(word) == 1 or history[-(len(word) - 1) :].tolist() == list(word[:-1]):
                scores[:, word[-1]] = float("-inf")
        return scores


@dataclass(frozen=True)
class TokenLogProbs:
    """One position's log probabilities: the chosen token's and the ``k`` most likely."""

    chosen: float
    top_ids: tuple[int, ...] = ()
    top_values: tuple[float, ...] = ()


def log_probs(logits: torch.Tensor, chosen: list[int], k: int) -> list[TokenLogProbs]:
    """The log-softmax of the model's ``[positions, vocab]`` logits at each position's
    ``chosen`` token, and its ``k`` most likely tokens (before penalties, biases and
    temperature: what the model itself predicts, as vLLM's default ``raw_logprobs``)."""
    table = torch.log_softmax(logits.to(torch.float32), dim=-1)
    index = torch.tensor(chosen, dtype=torch.long, device=table.device)[:, None]
    picked = table.gather(1, index)[:, 0].tolist()
    if not k:
        return [TokenLogProbs(p) for p in picked]
    values, ids = torch.topk(table, k, dim=-1)
    return [
        TokenLogProbs(p, tuple(i), tuple(v))
        for p, i, v in zip(picked, ids.tolist(), values.tolist(), strict=True)
    ]


def _build_processors(params: SamplingParams) -> LogitsProcessorList:
    processors = LogitsProcessorList()
    if params.greedy:
        return processors
    if params.temperature is not None and params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p is not None and 0.0 < params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    return processors
