"""A generation that outlives its replica: resumed on another one where it was cut.

The caller of a model's replicas (the ingress) sees every chunk it passes on, so when
the replica serving a request is lost mid-answer it knows the prompt and every token
the client has been sent. It resubmits the request as its prompt's ids followed by
those tokens, for what remains of ``max_tokens``: the engine prefills them (reading
from its prefix cache what that replica served before, a shared system prompt say) and
goes on from the next token. The client's stream continues without a marker.

Exactness. Greedy decoding depends only on the token sequence, so a greedy
continuation equals an undisturbed run. The resumed text is decoded here from the
token ids, seeded with the delivered ids, with the detokenizer the postprocessing runs
(:class:`tritonllm.detokenize.IncrementalDetokenizer`): a character or a word-initial
space split across the cut comes out as the undisturbed run wrote it. Stop strings
spanning the cut are the API layer's (it cuts on the whole answer's text, above this).

The torch engine takes more: the contract's ``resumed_output_len`` (an extension)
tells it how many of the prompt's ids are the answer so far, so it replays a guide's
grammar over them, counts them for the presence and frequency penalties, and draws the
next token as the seed's draw for that position. Engines without it (TensorRT-LLM,
vLLM) get the plain continuation, and what would not continue exactly there is not
migrated (the client gets the replica's error, as without migration): a guided
request, seeded sampling, and presence or frequency penalties. Written by hand:
neither Ray Serve nor Triton resumes a generation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from serve.generation import GenerateParams, GenerationChunk
from tritonllm.detokenize import IncrementalDetokenizer


class CannotResume(Exception):
    """The lost request cannot continue on another replica (why: the message)."""


def resume_refusal(params: GenerateParams, engine_resumes: bool) -> str | None:
    """Why ``params`` would not continue exactly on another replica (None: it would);
    ``engine_resumes``: the engine takes ``resumed_output_len``."""
    if engine_resumes:
        return None
    if params.guide_type:
        return "a guided request's grammar state cannot be carried to another replica"
    if params.presence_penalty or params.frequency_penalty:
        return "presence and frequency penalties count only the new replica's tokens"
    if params.seed is not None and not params.greedy:
        return "seeded sampling would restart its random sequence on another replica"
    return None


class Resumable:
    """One request's answer as the client has been sent it, and how to continue it.

    :meth:`deliver` passes each chunk of the current attempt on, as one answer with the
    earlier attempts' (counts, text, log probability); :meth:`resume` gives the request
    that continues it on another replica.
    """

    def __init__(
        self,
        params: GenerateParams,
        tokenizer_of: Callable[[], object],
        max_migrations: int,
        engine_resumes: bool = False,
    ):
        self.params = params
        self._engine_resumes = engine_resumes
        self.migrations = 0
        self.stalled = False  # the last move delivered nothing before it was lost too
        self._delivered_at_move = 0
        self._tokenizer_of = tokenizer_of  # called on the first migration only
        self._max_migrations = max_migrations
        self._ids: list[int] = []  # every token the client has been sent, in order
        self._first: GenerationChunk | None = None  # prompt count, cache count, echo
        self._cum_log_prob: float | None = None  # the answer's so far
        # Where the current attempt starts: the tokens and log probability before it.
        self._base_tokens = 0
        self._base_cum = 0.0
        self._detokenizer: IncrementalDetokenizer | None = None  # after a migration
        self._untracked_text = False  # text came without its ids (an older ensemble)

    @property
    def delivered(self) -> int:
        return len(self._ids)

    def deliver(self, chunk: GenerationChunk) -> GenerationChunk:
        """``chunk`` of the current attempt as a chunk of the whole answer."""
        if self._first is None:
            self._first = chunk
        elif self._detokenizer is not None:  # a resumed attempt's
            text = self._detokenizer.add(chunk.token_ids)
            cum = chunk.cum_log_prob
            chunk = dataclasses.replace(
                chunk,
                text=text,
                num_input_tokens=self._first.num_input_tokens,
                num_output_tokens=self._base_tokens + chunk.num_output_tokens,
                num_cached_tokens=self._first.num_cached_tokens,
                cum_log_prob=None if cum is None else self._base_cum + cum,
                prompt=None,
            )
        self._ids += chunk.token_ids
        self._untracked_text = self._untracked_text or bool(chunk.text and not chunk.token_ids)
        if chunk.cum_log_prob is not None:
            self._cum_log_prob = chunk.cum_log_prob
        return chunk

    def resume(self) -> GenerateParams:
        """The request that continues this answer on another replica. Raises
        :class:`CannotResume` when it may not (the bound reached, or a request that
        would not continue exactly)."""
        if self.migrations >= self._max_migrations:
            raise CannotResume(
                f"it was moved to another replica {self.migrations} time(s), the most allowed"
            )
        self.stalled = self.migrations > 0 and self.delivered == self._delivered_at_move
        self._delivered_at_move = self.delivered
        self.migrations += 1
        request_id = f"{self.params.request_id}.m{self.migrations}"
        if self._first is None:  # nothing sent yet: the request again, as it was
            return dataclasses.replace(self.params, request_id=request_id)
        refusal = resume_refusal(self.params, self._engine_resumes)
        if self._untracked_text:
            refusal = "the model's ensemble does not return output_ids to resume from"
        if refusal:
            raise CannotResume(refusal)
        if self._detokenizer is None:
            self._start_decoding()
        self._base_tokens, self._base_cum = self.delivered, self._cum_log_prob or 0.0
        remaining = self.params.max_tokens - self.delivered
        min_tokens = self.params.min_tokens
        return dataclasses.replace(
            self.params,
            # The ids are what the engine reads; the prompt's text stays for the routers
            # (prefix-aware routing matches it against the replicas' prefix trees).
            prompt_token_ids=self._prompt_ids() + tuple(self._ids),
            max_tokens=max(remaining, 1),
            min_tokens=None if min_tokens is None else max(min_tokens - self.delivered, 0),
            prompt_log_probs=False,  # the first attempt's first chunk carried them
            resumed_tokens=self.delivered if self._engine_resumes else 0,
            request_id=request_id,
        )

    @property
    def finished(self) -> bool:
        """Every token asked for was delivered: nothing is left to resume."""
        return self.delivered >= self.params.max_tokens

    def final_chunk(self) -> GenerationChunk:
        """The end of an answer cut after its last token (``finished``)."""
        first = self._first
        return GenerationChunk(
            text="",
            num_input_tokens=first.num_input_tokens if first else 0,
            num_output_tokens=self.delivered,
            num_cached_tokens=first.num_cached_tokens if first else 0,
            cum_log_prob=self._cum_log_prob,
            finish_reason="length",
        )

    def _start_decoding(self) -> None:
        """From now on text is decoded here from the ids, by a detokenizer fed the
        delivered ones as the postprocessing was: what it holds back (an incomplete
        character) it had held back there too, and the next token completes it."""
        self._detokenizer = IncrementalDetokenizer(self._tokenizer_of())
        for token in self._ids:
            self._detokenizer.add([token])

    def _prompt_ids(self) -> tuple[int, ...]:
        if self.params.prompt_token_ids:
            return self.params.prompt_token_ids
        from tritonllm.tokenization import encode_prompt

        ids = tuple(encode_prompt(self._tokenizer_of(), self.params.prompt))
        expected = self._first.num_input_tokens
        if expected and len(ids) != expected:
            raise CannotResume(
                f"the prompt tokenizes to {len(ids)} tokens here, {expected} in the engine"
            )
        return ids
