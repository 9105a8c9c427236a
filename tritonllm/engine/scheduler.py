"""The engine loop: admit queued requests, step running ones, retire finished ones.

New requests join between two decode steps and finished, stopped or cancelled
ones leave at once (in-flight batching semantics). Each step here advances every
running sequence by one token, one forward pass per sequence; batching those
passes into one forward is the next step of this design and keeps its interface.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.sampling import TokenSampler

log = logging.getLogger(__name__)


class EngineBusy(RuntimeError):
    """The queue is full; the client should retry later."""


@dataclass
class GenerationChunk:
    """One response of a request: new tokens when streaming, all of them at the end."""

    token_ids: list[int]
    log_probs: list[float]
    cum_log_prob: float
    num_input_tokens: int
    num_output_tokens: int
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"


class ResponseSink(Protocol):
    """Where a request's chunks go (Triton's response sender in production)."""

    def send(self, chunk: GenerationChunk) -> None: ...

    def fail(self, message: str) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class Sequence:
    request: GenerationRequest
    sink: ResponseSink
    sampler: TokenSampler
    history: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    past_key_values: object = None
    next_logits: torch.Tensor | None = None
    finish_reason: str | None = None
    sent: int = 0  # generated tokens already streamed


class Engine:
    """Owns the model and one scheduler thread; thread-safe ``submit``/``cancel``."""

    def __init__(
        self,
        runner: CausalLMRunner,
        max_batch_size: int = 8,
        max_queue_size: int = 256,
        max_seq_len: int | None = None,
    ):
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.max_seq_len = min(
            max_seq_len or runner.max_position_embeddings, runner.max_position_embeddings
        )
        self._pending: queue.Queue[Sequence] = queue.Queue(maxsize=max_queue_size)
        self._running: list[Sequence] = []
        self._cancelled: set[str] = set()
        self._active: set[str] = set()  # ids queued or running, so cancel() cannot leak
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, sink: ResponseSink) -> None:
        """Validate and queue a request; raises InvalidRequest or EngineBusy."""
        request.validate(self.max_seq_len, self.runner.vocab_size)
        sampler = TokenSampler(request.sampling, request.end_id)
        seq = Sequence(request, sink, sampler, history=list(request.input_ids))
        try:
            self._pending.put_nowait(seq)
            with self._lock:
                self._active.add(request.request_id)
        except queue.Full:
            raise EngineBusy(
                f"engine queue is full ({self._pending.maxsize} requests waiting); retry later"
            ) from None

    def cancel(self, request_id: str) -> None:
        """End a queued or running request within one step; unknown ids are ignored."""
        with self._lock:
            if request_id in self._active:
                self._cancelled.add(request_id)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout_s)

    # -- the loop -------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._admit()
            if not self._running:
                continue
            for seq in list(self._running):
                self._advance(seq)
            self._retire()

    def _retire(self) -> None:
        done = [s.request.request_id for s in self._running if s.finish_reason is not None]
        self._running = [s for s in self._running if s.finish_reason is None]
        with self._lock:
            self._active.difference_update(done)
            self._cancelled.difference_update(done)

    def _admit(self) -> None:
        block = not self._running
        while len(self._running) < self.max_batch_size:
            try:
                seq = self._pending.get(timeout=0.05) if block else self._pending.get_nowait()
            except queue.Empty:
                return
            block = False
            self._running.append(seq)

    def _advance(self, seq: Sequence) -> None:
        try:
            if self._is_cancelled(seq):
                self._finish(seq, "cancelled")
                return
            self._forward(seq)
            self._sample(seq)
        except Exception as exc:  # keep serving the others; this request gets the error
            log.exception("request %s failed", seq.request.request_id)
            seq.finish_reason = "error"
            seq.sink.fail(f"generation failed: {exc}")

    def _is_cancelled(self, seq: Sequence) -> bool:
        with self._lock:
            stopped = seq.request.request_id in self._cancelled
            self._cancelled.discard(seq.request.request_id)
        return stopped or seq.sink.is_cancelled()

    def _forward(self, seq: Sequence) -> None:
        if seq.past_key_values is None:
            logits, past = self.runner.prefill(seq.history)
        else:
            logits, past = self.runner.decode(seq.history[-1], seq.past_key_values)
        seq.next_logits, seq.past_key_values = logits, past

    def _sample(self, seq: Sequence) -> None:
        token, log_prob = seq.sampler(seq.next_logits, seq.history, len(seq.generated))
        request = seq.request
        if token == request.end_id:
            self._finish(seq, "stop")
            return
        seq.history.append(token)
        seq.generated.append(token)
        seq.log_probs.append(log_prob)
        reason = None
        if _ends_with_stop_word(seq.generated, request.stop_words):
            reason = "stop"
        elif len(seq.generated) >= request.max_tokens:
            reason = "length"
        if reason:
            self._finish(seq, reason)
        elif request.streaming:
            seq.sink.send(self._chunk(seq, [token], [log_prob], finished=False))
            seq.sent = len(seq.generated)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.past_key_values = None
        request = seq.request
        if request.streaming:
            tokens, log_probs = seq.generated[seq.sent :], seq.log_probs[seq.sent :]
        elif request.exclude_input_in_output:
            tokens, log_probs = seq.generated, seq.log_probs
        else:
            tokens, log_probs = list(request.input_ids) + seq.generated, seq.log_probs
        seq.sink.send(self._chunk(seq, tokens, log_probs, finished=True))

    @staticmethod
    def _chunk(seq: Sequence, tokens, log_probs, finished: bool) -> GenerationChunk:
        return GenerationChunk(
            token_ids=list(tokens),
            log_probs=list(log_probs),
            cum_log_prob=float(sum(seq.log_probs)),
            num_input_tokens=len(seq.request.input_ids),
            num_output_tokens=len(seq.generated),
            finished=finished,
            finish_reason=seq.finish_reason,
        )


def _ends_with_stop_word(generated: list[int], stop_words) -> bool:
    return any(
        len(w) <= len(generated) and tuple(generated[-len(w) :]) == tuple(w) for w in stop_words
    )
