"""The engine loop: in-flight batching of many requests over one model.

Every iteration (a "step") drops cancelled requests, admits queued ones into
free slots within the token budget and prefills them, then runs one decode
forward for all running sequences together. New requests therefore start
between two decode steps, and a finished, stopped or cancelled one leaves at
once and frees its slot: TensorRT-LLM's in-flight batching, on PyTorch.

With chunked context (TensorRT-LLM's ``enable_chunked_context``, vLLM's chunked
prefill) ``max_num_tokens`` bounds every step: a long prompt is prefilled a chunk
per step, so a short prompt, or a prefix cache hit's short tail, arriving behind
it gets its first token after one chunk, not after the whole prompt, and the
running sequences keep decoding meanwhile.

Why not transformers' own continuous batching (``generate_batch`` /
``init_continuous_batching``): on the bench model it made a fraction of this
engine's tokens/s through Triton (``make bench-engine BENCH_ARGS=--with-hf-cb``
runs both), and its sampling settings belong to the manager, not to each request
with its own seeded generator.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tritonllm import guided
from tritonllm.engine.guide_compiles import (
    DEFAULT_TIMEOUT_S,
    CompilersBusy,
    GuideCompiles,
    GuideTooSlow,
    PendingGuide,
)
from tritonllm.engine.lora import Adapter, LoraCacheFull
from tritonllm.engine.null_engine import NullRunner
from tritonllm.engine.prefix_cache import ROOT
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.sampling import TokenLogProbs, TokenSampler, log_probs
from tritonllm.guided import GuideCompiler
from tritonllm.lora import AdapterError
from tritonllm.tokenization import InvalidRequest

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
    # The end token ended it ("stop"): counted in num_output_tokens, not in token_ids;
    # with log probabilities asked, its entry is the last of log_probs (and top_log_probs).
    ended_by_end_id: bool = False
    # With num_top_log_probs: each token's alternatives.
    top_log_probs: list[TokenLogProbs] = field(default_factory=list)
    # A request's first response only: the prefix cache's share of the prompt, and
    # with return_prompt_log_probs the prompt's log probabilities (none for its first).
    num_cached_tokens: int | None = None
    prompt_log_probs: list[TokenLogProbs] | None = None
    prompt_ids: tuple[int, ...] = ()

    def merged(self, later: GenerationChunk) -> GenerationChunk | None:
        """One streamed response standing for this one and the ``later`` one of the same
        request (None where they cannot join: this one was final). Counts and the
        cumulative log prob are the later one's, being totals."""
        if self.finished:
            return None
        return GenerationChunk(
            token_ids=self.token_ids + later.token_ids,
            log_probs=self.log_probs + later.log_probs,
            cum_log_prob=later.cum_log_prob,
            num_input_tokens=later.num_input_tokens,
            num_output_tokens=later.num_output_tokens,
            finished=later.finished,
            finish_reason=later.finish_reason,
            ended_by_end_id=later.ended_by_end_id,
            top_log_probs=self.top_log_probs + later.top_log_probs,
            num_cached_tokens=self.num_cached_tokens,
            prompt_log_probs=self.prompt_log_probs,
            prompt_ids=self.prompt_ids,
        )


def merge_chunks(earlier, later):
    """The response thread's merge: two chunks of one request (errors never join)."""
    if isinstance(earlier, GenerationChunk) and isinstance(later, GenerationChunk):
        return earlier.merged(later)
    return None


def is_final_chunk(item) -> bool:
    """The response thread's test for a request's last item (an error is one too)."""
    return not isinstance(item, GenerationChunk) or item.finished


class ResponseSink(Protocol):
    """Where a request's chunks go (Triton's response sender in production)."""

    def send(self, chunk: GenerationChunk) -> None: ...

    def fail(self, message: str, code: str = "INTERNAL") -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass(frozen=True)
class StepStats:
    """What one engine step did, for metrics."""

    running: int  # sequences in the batch after the step
    queued: int
    prefill_tokens: int  # prompt tokens computed (cached prefixes are not)
    generated_tokens: int  # one per prefill and one per decoded row
    seconds: float
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens found there (not prefilled)
    guides: GuideStats | None = None  # the guides settled since the last step


@dataclass
class GuideStats:
    """Guides whose requests stopped waiting: compiled, refused, or past the limit."""

    compiled: int = 0
    compile_seconds: float = 0.0  # their compiles' time on the workers
    wait_seconds: float = 0.0  # their requests' wait, from arrival to ready
    refused: int = 0  # invalid, or past the compile limit
    too_slow: int = 0  # of those, past the limit


class EngineObserver(Protocol):
    def on_step(self, stats: StepStats) -> None: ...


@dataclass
class Sequence:
    request: GenerationRequest
    sink: ResponseSink
    sampler: TokenSampler | None  # or any callable of its shape; None: a guide compiling
    history: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    log_probs: list[TokenLogProbs] = field(default_factory=list)  # if the request asks
    cum_log_prob: float = 0.0  # their sum
    prompt_log_probs: list[TokenLogProbs] = field(default_factory=list)  # tokens 1..
    slot: int = -1  # its row in the KV cache while running
    cached: int = 0  # tokens whose keys and values are in the cache
    cache_hit: int = 0  # of those, the prompt tokens the prefix cache held at admission
    finish_reason: str | None = None
    sent: int = 0  # generated tokens already streamed
    answered: bool = False  # its first response is out
    ended_by_end_id: bool = False  # the end token came (counted, not in generated)
    adapter: Adapter | None = None  # its LoRA adapter, held from submit until it leaves
    guide: PendingGuide | None = None  # its guide, until compiled (then in its sampler)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prefilling(self) -> bool:
        """Some of its prompt is not in the cache yet (chunked context: more chunks)."""
        return self.cached < len(self.request.input_ids)

    @property
    def uncached(self) -> int:
        return len(self.history) - self.cached

    @property
    def prefix_root(self):
        """Its chain in the prefix cache: a prefix's keys and values are its adapter's."""
        return ROOT if self.adapter is None else self.adapter.prefix_root


class Engine:
    """Owns the model and one scheduler thread; ``submit``/``cancel`` are thread-safe."""

    def __init__(
        self,
        runner: CausalLMRunner | NullRunner,
        max_batch_size: int = 8,
        max_queue_size: int = 256,
        max_seq_len: int | None = None,
        max_num_tokens: int = 8192,
        observer: EngineObserver | None = None,
        num_threads: int = 0,
        prefix_cache_mb: float = 0,
        prefix_block_size: int = 16,
        enable_chunked_context: bool = False,
        guide_compiler: GuideCompiler | None = None,
        max_lora_rank: int = 64,
        lora_cache_bytes: int = 256 * 2**20,
        guide_compile_timeout_s: float = DEFAULT_TIMEOUT_S,
        kv_events_endpoints: str = "",
    ):
        """``kv_events_endpoints``: "PUB,REPLAY" ZMQ endpoints to publish the prefix
        cache's KV cache events on (kv_events.py); empty: none published."""
        self.runner = runner
        self._set_threads(num_threads)
        self.max_batch_size = max_batch_size
        self.max_queue_size = max_queue_size
        self.max_seq_len = min(
            max_seq_len or runner.max_position_embeddings, runner.max_position_embeddings
        )
        self.max_num_tokens = max_num_tokens
        self.chunked_context = enable_chunked_context
        self._observer = observer
        self._make_caches(prefix_cache_mb, prefix_block_size, max_lora_rank, lora_cache_bytes)
        self.kv_events = self._publish_kv_events(kv_events_endpoints)
        self._pending: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # _running[i].slot == i between steps
        # Ids queued or running (counted: clients may reuse one), so cancel() cannot leak.
        self._active: Counter[str] = Counter()
        self._cancelled: set[str] = set()
        self._lock = threading.Condition()
        self._stopping = False
        # Guided decoding's compiler, made on the first guided request (XGrammar's import
        # alone takes seconds): from the runner's checkpoint directory, which holds the
        # tokenizer, for the logits' width.
        self._guides = guide_compiler
        self._guides_lock = threading.Lock()
        # Guides compile off this loop: their requests wait in the queue meanwhile.
        self._compiles = GuideCompiles(
            self._guide_compiler, guide_compile_timeout_s, on_ready=self._wake
        )
        self._compiling: list[Sequence] = []  # the queued whose guide is compiling
        self._guide_stats = GuideStats()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def _set_threads(self, num_threads: int) -> None:
        """torch's intra-op thread count is per OS thread (a thread started inside
        Triton's Python stub gets 1), so the loop sets its own. Decode is bound by
        memory bandwidth and does better leaving a core to Triton's own threads, the
        pre/postprocessing models and gRPC; prefill is compute-bound and short and gets
        every core. On a small machine that split beats one thread count for both
        (make bench-engine BENCH_ARGS='--num-threads N' runs the others)."""
        cores = len(os.sched_getaffinity(0))
        self.decode_threads = num_threads or max(1, cores - 1)
        self.prefill_threads = num_threads or cores

    def _make_caches(
        self, prefix_cache_mb: float, block_size: int, max_lora_rank: int, lora_bytes: int
    ) -> None:
        """The sequences' KV cache, the prefix cache (None: off, a budget of 0 or a
        runner with no keys and values to keep) and the LoRA adapters' (TensorRT-LLM's
        max_lora_rank, lora_cache_host_memory_bytes; None: a runner that serves none,
        the null engine)."""
        runner = self.runner
        self._cache = runner.new_cache(self.max_batch_size, self.max_seq_len)
        self._prefix = None
        if prefix_cache_mb > 0:
            self._prefix = runner.new_prefix_cache(self._cache, prefix_cache_mb, block_size)
        self._adapters = None
        if hasattr(runner, "new_adapter_cache"):
            self._adapters = runner.new_adapter_cache(max_lora_rank, lora_bytes)

    def _publish_kv_events(self, endpoints: str):
        """The prefix cache's event publisher (None: no endpoints, or no prefix cache,
        whose engine holds no block past its request)."""
        if not endpoints or self._prefix is None:
            return None
        from tritonllm.engine.kv_events import publisher_at  # zmq: only where published

        self._prefix.events = publisher_at(endpoints, self._prefix.block_size)
        return self._prefix.events

    # -- the API --------------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: ResponseSink) -> None:
        """Validate and queue a request; raises InvalidRequest or EngineBusy."""
        request.validate(self.max_seq_len, self.runner.vocab_size)
        if len(request.input_ids) > self.max_num_tokens and not self.chunked_context:
            raise InvalidRequest(
                f"prompt of {len(request.input_ids)} tokens exceeds the engine's max_num_tokens "
                f"({self.max_num_tokens} per step, chunked context off); shorten the prompt"
            )
        guide = self._start_guide(request)
        sampler = None if guide else self._sampler(request)
        adapter = self._acquire_adapter(request)
        seq = Sequence(
            request, sink, sampler, list(request.input_ids), adapter=adapter, guide=guide
        )
        with self._lock:
            if len(self._pending) >= self.max_queue_size:
                self._release_adapter(seq)
                self._abandon_guide(seq)
                raise EngineBusy(
                    f"engine queue is full ({self.max_queue_size} requests waiting); retry later"
                )
            self._queue(seq)
            if guide is not None:
                self._compiling.append(seq)
            self._active[request.request_id] += 1
            self._lock.notify()

    def _queue(self, seq: Sequence) -> None:
        """Behind every queued request of its priority or a lower one (vLLM's order:
        lower first; equals first come, first served). Under the lock."""
        pending, priority = self._pending, seq.request.priority
        place = len(pending)
        while place and pending[place - 1].request.priority > priority:
            place -= 1  # the common case, one priority for all, looks at one request
        pending.insert(place, seq)

    def cancel(self, request_id: str) -> None:
        """End a queued or running request within one step; unknown and empty ids
        (a client that sent none) are ignored."""
        with self._lock:
            if request_id and request_id in self._active:
                self._cancelled.add(request_id)
                self._lock.notify()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests still queued or running get a cancelled final chunk."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout_s)
        self._compiles.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify()

    def _start_guide(self, request: GenerationRequest) -> PendingGuide | None:
        """The request's guide, checked (an invalid one is its InvalidRequest, before any
        scheduling) and its compile started off the loop; None without one, or for a
        runner that picks tokens itself (it checks the guide, and follows none)."""
        if request.guide_type is None:
            return None
        guided.check(request.guide_type, request.guide)
        if hasattr(self.runner, "sampler"):
            return None
        return self._compiles.start(request.guide_type, request.guide)

    def _sampler(self, request: GenerationRequest, compiled=None):
        """The request's own sampler, following its ``compiled`` guide; a runner that
        picks tokens itself (the null engine, a benchmark instrument) gives its own."""
        if hasattr(self.runner, "sampler"):
            return self.runner.sampler(request)
        resumed = request.resumed_ids
        if compiled is None:
            return TokenSampler(request.sampling, request.end_id, resumed=resumed)
        compiler = self._guide_compiler()
        matcher = compiler.matcher(compiled, request.end_id)
        return TokenSampler(
            request.sampling, request.end_id, matcher, compiler.vocab_size, resumed=resumed
        )

    def _acquire_adapter(self, request: GenerationRequest) -> Adapter | None:
        """The request's LoRA adapter, loaded from its weights or found in the cache and
        held until the sequence leaves; a bad adapter, or TensorRT-LLM's cache miss (the
        caller resends with the weights), is the request's InvalidRequest."""
        if request.lora_task_id is None:
            return None
        if self._adapters is None:
            raise InvalidRequest("LoRA adapters (lora_task_id) are not served by this engine")
        try:
            return self._adapters.acquire(request.lora_task_id, request.lora)
        except AdapterError as error:
            raise InvalidRequest(str(error)) from None
        except LoraCacheFull as error:
            raise EngineBusy(str(error)) from None

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            self._adapters.release(seq.adapter)

    @property
    def adapters(self):
        """The adapter cache (None: this engine serves no adapters)."""
        return self._adapters

    def _guide_compiler(self) -> GuideCompiler:
        with self._guides_lock:
            if self._guides is None:
                engine_dir = getattr(self.runner, "engine_dir", None)
                if engine_dir is None:
                    raise InvalidRequest("guided decoding is not supported by this engine")
                self._guides = GuideCompiler.from_tokenizer_dir(
                    engine_dir, self.runner.vocab_size, max_threads=self.prefill_threads
                )
            return self._guides

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._pending)

    # -- the loop -------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_num_threads(self.decode_threads)
        while self._wait_for_work():
            try:
                self.step()
            except Exception as exc:  # a bug here must not leave requests hanging
                log.exception("engine step failed; failing the running requests")
                for seq in self._running:
                    self._fail(seq, f"engine step failed: {exc}")
                self._compact()
        for seq in [*self._running, *self._pending]:
            self._abandon_guide(seq)
            self._finish(seq, "cancelled")

    def _wait_for_work(self) -> bool:
        """Until there is something to step: a running sequence, or a queued request
        that can start or end (a guide still compiling keeps its request waiting; it is
        looked at again when a compile ends, and every 0.1 s for a limit passed or a
        client that left)."""
        with self._lock:
            while not (self._stopping or self._running or self._cancelled):
                now = time.monotonic()
                waiting = self._compiling
                if len(waiting) < len(self._pending) or any(s.guide.ready(now) for s in waiting):
                    break
                if any(_disconnected(s) for s in waiting):
                    break
                self._lock.wait(0.1 if waiting else None)
            return not self._stopping

    def step(self) -> None:
        start = time.perf_counter()
        self._drop_cancelled()
        self._settle_guides()
        self._compact()
        admitted = self._admit()
        prompt_tokens = sum(len(s.request.input_ids) for s in admitted)
        hits = sum(s.cached for s in admitted)  # before the prefill: the cached prefixes
        chunks = self._prefill_chunks()
        for group in _prefill_groups(chunks):
            self._guarded([seq for seq, _ in group], self._prefill, group)
        prefilled = sum(not seq.prefilling and seq.finish_reason != "error" for seq, _ in chunks)
        self._compact()
        decoding = sum(not seq.prefilling for seq in self._running)
        if decoding:
            self._guarded(list(self._running), self._decode)
        self._compact()
        if self._observer:
            stats = StepStats(
                running=len(self._running),
                queued=len(self._pending),
                prefill_tokens=sum(n for _, n in chunks),
                generated_tokens=prefilled + decoding,
                seconds=time.perf_counter() - start,
                prefix_queried_tokens=prompt_tokens if self._prefix is not None else 0,
                prefix_hit_tokens=hits,
                guides=self._take_guide_stats(),
            )
            try:
                self._observer.on_step(stats)
            except Exception:  # metrics must never stop generation
                log.exception("engine observer failed")

    def _drop_cancelled(self) -> None:
        with self._lock:
            stopped, self._cancelled = self._cancelled, set()
            queued = [s for s in self._pending if s.request_id in stopped or _disconnected(s)]
            for seq in queued:
                self._pending.remove(seq)
        for seq in queued:
            self._abandon_guide(seq)
            self._finish(seq, "cancelled")
            self._forget(seq)
        for seq in self._running:
            if seq.request_id in stopped or _disconnected(seq):
                self._finish(seq, "cancelled")

    def _settle_guides(self) -> None:
        """Queued requests whose guide is ready get their sampler; a guide XGrammar
        refuses, or one past the compile limit, fails its request (a 400)."""
        if not self._compiling:
            return
        now = time.monotonic()
        ready, waiting = [], []
        with self._lock:
            for seq in self._compiling:  # one look each: a compile may end meanwhile
                (ready if seq.guide.ready(now) else waiting).append(seq)
            self._compiling = waiting
        for seq in ready:
            guide, seq.guide = seq.guide, None
            stats = self._guide_stats
            stats.wait_seconds += now - guide.arrived
            try:
                compiled = self._compiles.settle(guide)
                seq.sampler = self._sampler(seq.request, compiled.grammar)
            except Exception as error:
                stats.refused += 1
                stats.too_slow += isinstance(error, GuideTooSlow)
                with self._lock:
                    self._pending.remove(seq)
                self._fail(seq, str(error), _triton_code(error))
                self._forget(seq)
                continue
            stats.compiled += 1
            stats.compile_seconds += compiled.seconds

    def _abandon_guide(self, seq: Sequence) -> None:
        if seq.guide is not None:
            self._compiles.abandon(seq.guide)
            seq.guide = None
            with self._lock:
                if seq in self._compiling:
                    self._compiling.remove(seq)

    def _take_guide_stats(self) -> GuideStats | None:
        stats, self._guide_stats = self._guide_stats, GuideStats()
        return stats if stats.compiled or stats.refused else None

    def _admit(self) -> list[Sequence]:
        """Move queued requests (by priority, then first come, first served) into free
        slots; each starts with the longest prefix the prefix cache holds already in its
        slot. Without chunked context, only while their whole prompts fit the step's
        token budget. A request whose guide still compiles keeps its place; the others
        pass it."""
        budget = self.max_num_tokens - len(self._running)
        admitted = []
        with self._lock:
            waiting = deque()  # passed over: their guides compile
            while self._pending and len(self._running) < self.max_batch_size:
                seq = self._pending.popleft()
                if seq.sampler is None:
                    waiting.append(seq)
                    continue
                history = seq.history
                # A prompt's log probabilities need its logits: none come from the cache.
                reads_cache = not seq.request.return_prompt_log_probs
                chain = (
                    self._prefix.match(history, seq.prefix_root)
                    if self._prefix and reads_cache
                    else []
                )
                computed = len(history) - (len(chain) * self._prefix.block_size if chain else 0)
                if computed > budget and not self.chunked_context:
                    self._pending.appendleft(seq)
                    break
                budget -= computed
                seq.slot = len(self._running)
                # Loaded at once: nothing is saved (so nothing evicted) in between.
                if chain:
                    seq.cached = seq.cache_hit = self._prefix.load(self._cache, seq.slot, chain)
                self._running.append(seq)
                admitted.append(seq)
            self._pending.extendleft(reversed(waiting))
        return admitted

    def _guarded(self, seqs: list[Sequence], fn, *args) -> None:
        """Run one forward; if it fails, its sequences get the error and the others go on."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("generation failed for %s", [s.request_id for s in seqs])
            for seq in seqs:
                self._fail(seq, f"generation failed: {exc}")

    def _prefill_chunks(self) -> list[tuple[Sequence, int]]:
        """The prompt tokens each prefilling sequence computes this step. Without chunked
        context, whole prompts (admission kept them within the budget). With it, the
        step's budget, less a token per decoding row, goes to the shortest remaining
        prompts first: a short one gets its first token now rather than after a long
        one, and a long one goes on a chunk per step with what the short ones leave.
        Slots bound the short ones that can go first, so a long prompt is not starved."""
        prefilling = sorted((s for s in self._running if s.prefilling), key=lambda s: s.uncached)
        if not self.chunked_context:
            return [(seq, seq.uncached) for seq in prefilling]
        budget = self.max_num_tokens - (len(self._running) - len(prefilling))
        chunks = []
        for seq in prefilling:
            size = min(seq.uncached, budget)
            if size <= 0:
                break
            chunks.append((seq, size))
            budget -= size
        return chunks

    def _prefill(self, group: list[tuple[Sequence, int]]) -> None:
        """Each sequence's next ``size`` prompt tokens (all the rest, or a chunk)."""
        every_position = group[0][0].request.return_prompt_log_probs  # then alone
        torch.set_num_threads(self.prefill_threads)
        try:
            logits = self.runner.prefill(
                self._cache,
                [seq.slot for seq, _ in group],
                [seq.history[: seq.cached + size] for seq, size in group],
                [seq.cached for seq, _ in group],
                every_position=every_position,
                adapters=[seq.adapter for seq, _ in group],
            )
        finally:
            torch.set_num_threads(self.decode_threads)
        if every_position:
            logits = [self._read_prompt(group[0][0], group[0][1], logits[0])]
        for (seq, size), row_logits in zip(group, logits, strict=True):
            seq.cached += size
            if seq.prefilling:  # a chunk: its logits are not the prompt's last
                continue
            if self._prefix is not None:  # now, so that a request admitted next step finds it
                self._prefix.save(self._cache, seq.slot, seq.history, seq.prefix_root)
            self._sample(seq, row_logits)

    def _read_prompt(self, seq: Sequence, size: int, logits):
        """Keep the log probabilities of the prompt tokens that a prefilled chunk's
        logits ``[size, vocab]`` predict; return the last position's logits."""
        start = seq.cached  # the chunk's first position
        predicted = seq.request.input_ids[start + 1 : start + size + 1]  # within the prompt
        if predicted:
            rows = logits[: len(predicted)] if logits is not None else None
            seq.prompt_log_probs += self._log_probs(seq, rows, list(predicted))
        return None if logits is None else logits[-1]

    def _log_probs(self, seq: Sequence, logits, chosen: list[int]) -> list[TokenLogProbs]:
        k = seq.request.num_top_log_probs
        if logits is None:  # a runner with no logits (the null engine): a stand-in
            return [TokenLogProbs(0.0, (0,) * k, (0.0,) * k)] * len(chosen)
        return log_probs(logits, chosen, k)

    def _decode(self) -> None:
        """One token for every running sequence (rows are slots, so all of them run).

        A row still prefilling (chunked context) runs along with its next prompt token
        at its next column, and its output is dropped: its next chunk writes that
        column again. One wasted row is cheaper than a forward over a subset of rows,
        which would gather the cache's rows instead of reading a view of them."""
        rows = self._running
        logits = self.runner.decode(
            self._cache,
            [s.history[s.cached] for s in rows],
            [s.cached for s in rows],
            adapters=[s.adapter for s in rows],
        )
        for seq, row_logits in zip(rows, logits, strict=True):
            if seq.prefilling:
                continue
            seq.cached += 1
            self._sample(seq, row_logits)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        token = seq.sampler(logits, seq.history, len(seq.generated))
        request = seq.request
        if request.return_log_probs:
            self._log_token(seq, logits, token)
        if token == request.end_id:
            # Counted as a generated token (usage and billing count it, as vLLM does), its
            # log probability kept (lm-eval reads it), but not among the tokens:
            # TensorRT-LLM leaves the end id out of output_ids, so no detokenizer ever sees
            # it, special token or not.
            seq.ended_by_end_id = True
            self._finish(seq, "stop")
            return
        seq.generated.append(token)
        seq.history.append(token)
        if _ends_with_stop_word(seq.generated, request.stop_words):
            self._finish(seq, "stop")
        elif getattr(seq.sampler, "guide_terminated", False):
            # Its grammar is complete and admits nothing more, with no end token to
            # choose (a request without an end id): the answer is whole.
            self._finish(seq, "stop")
        elif len(seq.generated) >= request.max_tokens:
            self._finish(seq, "length")
        elif request.streaming:
            self._deliver(seq, self._chunk(seq, [token], finished=False))
            seq.sent = len(seq.generated)

    def _log_token(self, seq: Sequence, logits: torch.Tensor | None, token: int) -> None:
        rows = None if logits is None else logits[None]
        (chosen,) = self._log_probs(seq, rows, [token])
        seq.log_probs.append(chosen)
        seq.cum_log_prob += chosen.chosen

    def _compact(self) -> None:
        """Drop finished sequences; move rows from the end into the freed slots."""
        keep = [s for s in self._running if s.finish_reason is None]
        if len(keep) == len(self._running):
            return
        for seq in self._running:
            if seq.finish_reason is not None:
                self._forget(seq)
                # Saved before its row is reused; an error may have left it half written.
                if self._prefix is not None and seq.finish_reason != "error":
                    self._prefix.save(
                        self._cache, seq.slot, seq.history[: seq.cached], seq.prefix_root
                    )
        holes = sorted(s.slot for s in self._running if s.finish_reason and s.slot < len(keep))
        movers = [s for s in keep if s.slot >= len(keep)]
        for seq, hole in zip(movers, holes, strict=True):
            self._cache.move(seq.slot, hole, seq.cached)
            seq.slot = hole
        self._running = sorted(keep, key=lambda s: s.slot)

    def _forget(self, seq: Sequence) -> None:
        self._release_adapter(seq)
        with self._lock:
            self._active[seq.request_id] -= 1
            if self._active[seq.request_id] <= 0:
                del self._active[seq.request_id]
                self._cancelled.discard(seq.request_id)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        request = seq.request
        if request.streaming:
            tokens = seq.generated[seq.sent :]
        elif request.exclude_input_in_output:
            tokens = seq.generated
        else:
            tokens = list(request.input_ids) + seq.generated
        self._deliver(seq, self._chunk(seq, tokens, finished=True))

    def _deliver(self, seq: Sequence, chunk: GenerationChunk) -> None:
        """Send a chunk; a sink that cannot take it ends only its own request."""
        try:
            seq.sink.send(chunk)
        except Exception:
            log.exception("could not send a response of %s; dropping it", seq.request_id)
            seq.finish_reason = "error"

    def _fail(self, seq: Sequence, message: str, code: str = "INTERNAL") -> None:
        if seq.finish_reason is not None:  # its final response is already out
            return
        seq.finish_reason = "error"
        try:
            seq.sink.fail(message, code)
        except Exception:
            log.exception("could not send the error of %s", seq.request_id)

    @staticmethod
    def _chunk(seq: Sequence, tokens, finished: bool) -> GenerationChunk:
        """A response with ``tokens``: the generated ones from ``seq.sent`` on (a prompt
        echoed before them has no log probabilities here), and the log probabilities
        from there on, the end token's last where it came."""
        request = seq.request
        new = seq.log_probs[seq.sent :] if request.return_log_probs else []
        chunk = GenerationChunk(
            token_ids=list(tokens),
            log_probs=[p.chosen for p in new],
            cum_log_prob=seq.cum_log_prob,
            num_input_tokens=len(request.input_ids),
            num_output_tokens=len(seq.generated) + seq.ended_by_end_id,
            finished=finished,
            finish_reason=seq.finish_reason,
            ended_by_end_id=finished and seq.ended_by_end_id,
            top_log_probs=new if request.num_top_log_probs else [],
        )
        if not seq.answered:
            seq.answered = True
            chunk.num_cached_tokens = seq.cache_hit
            if request.return_prompt_log_probs:
                chunk.prompt_ids = request.input_ids
                chunk.prompt_log_probs = seq.prompt_log_probs
        return chunk


def _prefill_groups(
    chunks: list[tuple[Sequence, int]],
) -> list[list[tuple[Sequence, int]]]:
    """(sequence, tokens to prefill) of similar lengths, batched so that padding is at
    most half of a group's forward."""
    groups: list[list[tuple[Sequence, int]]] = [
        [chunk] for chunk in chunks if chunk[0].request.return_prompt_log_probs
    ]  # alone: their forwards keep every position's logits
    alone = len(groups)
    real = 0
    plain = [chunk for chunk in chunks if not chunk[0].request.return_prompt_log_probs]
    for seq, length in sorted(plain, key=lambda chunk: chunk[1]):
        # ``length``: the longest of its group so far (sorted)
        if len(groups) > alone and (len(groups[-1]) + 1) * length <= 2 * (real + length):
            groups[-1].append((seq, length))
            real += length
        else:
            groups.append([(seq, length)])
            real = length
    return groups


def _triton_code(error: Exception) -> str:
    """The Triton error code of a request's refusal: the client's mistake (a 400), a
    retry (a 503), or the server's fault (a 500)."""
    if isinstance(error, InvalidRequest):
        return "INVALID_ARG"
    return "UNAVAILABLE" if isinstance(error, CompilersBusy) else "INTERNAL"


def _disconnected(seq: Sequence) -> bool:
    try:
        return seq.sink.is_cancelled()
    except Exception:  # the request is gone on Triton's side: treat it as cancelled
        return True


def _ends_with_stop_word(generated: list[int], stop_words) -> bool:
    return any(
        len(w) <= len(generated) and tuple(generated[-len(w) :]) == tuple(w) for w in stop_words
    )
