"""TensorRT-LLM's LLM API (its PyTorch backend) in the ``tensorrt_llm`` slot.

TensorRT-LLM's PyTorch backend loads a Hugging Face checkpoint directly (no engine
build) and serves it through the LLM API: ``LLM(model=...)``, ``generate_async(prompt,
SamplingParams, streaming)`` giving a ``RequestOutput`` per step and ``abort()`` to stop
one. Here that API sits behind our tensor contract, so the ensemble, the
pre/postprocessing and the Serve app stay as they are:

- :func:`sampling_kwargs`: a :class:`~tritonllm.engine.request.GenerationRequest` (read
  from the contract's tensors by :mod:`tritonllm.engine.tensors`) as ``SamplingParams``
  keyword arguments, with the torch engine's semantics (greedy unless asked otherwise;
  a temperature alone samples).
- :class:`OutputTracker`: the LLM API's outputs as our :class:`GenerationChunk` s (new
  tokens when streaming, everything at the end; stop words ended on, as the torch
  engine does).
- :class:`LLMAPIEngine`: the torch engine's verbs (``submit``, ``cancel``,
  ``shutdown``) over an ``LLM`` object, on an asyncio loop of its own, with the queue
  bound and the cancellation the slot promises.
- LoRA: the contract's ``lora_task_id`` (and the packed weights on first use) as the
  LLM API's ``LoRARequest(name, id, path)``: each task id's adapter is written once as
  a PEFT directory (:mod:`tritonllm.lora_dirs`, :func:`lora_adapters`); an id not held
  answers TensorRT-LLM's cache miss, as the C++ backend does.

Nothing here imports ``tensorrt_llm`` or ``triton_python_backend_utils``:
``model_repository/tensorrt_llm/1/llmapi.py`` passes the LLM in, and the unit tests a
fake one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.scheduler import EngineBusy, GenerationChunk
from tritonllm.guided import grammar
from tritonllm.lora import AdapterError, llama_module_shapes
from tritonllm.lora_dirs import AdapterDirectories
from tritonllm.tokenization import InvalidRequest

log = logging.getLogger(__name__)

# Written by `make engines TARGET=trtllm-pytorch` next to the model's adapter: the LLM
# API's own options (the keys of trtllm-serve's extra_llm_api_options YAML).
OPTIONS_FILE = "llm_api_options.yaml"
# TensorRT-LLM's finish reasons; a timeout ends the answer as max_tokens would.
_FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "timeout": "length",
    "cancelled": "cancelled",
}
# How often running requests are checked for a cancelled client (queued ones included).
CANCEL_POLL_S = 0.05


def load_options(path: Path) -> dict[str, Any]:
    import yaml

    options = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(options, dict):
        raise ValueError(f"{path}: expected a mapping of LLM API options")
    return options


def llm_kwargs(model_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**...)`` for ``model_dir`` with the build's options. Nested options
    (``kv_cache_config``, ``scheduler_config``) become TensorRT-LLM's config objects
    through its own converter, the one trtllm-serve and NVIDIA's Triton model use."""
    # Guided decoding with XGrammar, as the torch engine (the options may say otherwise).
    base = {"model": str(model_dir), "guided_decoding_backend": "xgrammar"}
    try:
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict
    except ImportError:  # an older layout: LLM's pydantic args take the dicts themselves
        return {**base, **options}
    return update_llm_args_with_extra_dict(base, options)


def lora_adapters(model_dir: Path, options: dict[str, Any], root: Path):
    """The adapter directories of an LLM whose options enable LoRA (``lora_config``,
    written from build_engines/trtllm.yaml's ``lora:``), or None. Adapters are checked
    against the checkpoint's module shapes; twice as many are kept on disk as the LLM
    API keeps in host memory (``max_cpu_loras``), least recently used removed first."""
    lora = options.get("lora_config")
    if not lora:
        return None
    import json

    shapes, layers = llama_module_shapes(json.loads((Path(model_dir) / "config.json").read_text()))
    held = int(lora.get("max_cpu_loras") or lora.get("max_loras") or 8)
    return AdapterDirectories(
        root, shapes, layers, int(lora["max_lora_rank"]), 2 * held, str(model_dir)
    )


def _ignores_eos(request: GenerationRequest) -> bool:
    return request.end_id is not None and request.end_id < 0


def _greedy(request: GenerationRequest) -> bool:
    s = request.sampling
    if s.temperature == 0 or s.top_k == 1:
        return True
    return s.temperature is None and s.top_k == 0 and s.top_p is None


def sampling_kwargs(request: GenerationRequest) -> dict[str, Any]:
    """``tensorrt_llm.SamplingParams`` keyword arguments for ``request``.

    Our outputs are token ids (postprocessing detokenizes), so the LLM API neither
    detokenizes nor adds special tokens (preprocessing did). Stop words are matched
    here, on the ids (:class:`OutputTracker`): the LLM API takes multi-token stop
    sequences only as strings it would tokenize again.
    """
    s = request.sampling
    bad = [w for w in s.bad_words if w]
    if any(len(w) > 1 for w in bad):
        raise InvalidRequest(
            "bad words of more than one token are not supported by TensorRT-LLM's PyTorch "
            "backend here; give single-token bad words"
        )
    kwargs: dict[str, Any] = {
        "max_tokens": request.max_tokens,
        # TensorRT-LLM's "no end id" (-1, what ignore_eos sends) is the LLM API's flag.
        "end_id": request.end_id if not _ignores_eos(request) else None,
        "ignore_eos": _ignores_eos(request),
        "pad_id": request.pad_id,
        "seed": s.seed,
        "min_tokens": s.min_tokens or None,
        "repetition_penalty": s.repetition_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "bad_token_ids": [w[0] for w in bad] or None,
        "logprobs": 1 if request.return_log_probs else None,
        "detokenize": False,
        "add_special_tokens": False,
    }
    if _greedy(request):
        kwargs["top_k"] = 1
    else:
        # top_k 0 is "no top-k": TensorRT-LLM decodes greedily when neither top_k nor
        # top_p is set, even with a temperature; the torch engine samples then.
        kwargs.update(top_k=s.top_k, top_p=s.top_p, temperature=s.temperature)
    return {k: v for k, v in kwargs.items() if v is not None}


# Our guide types (TensorRT-LLM's tensor values) as GuidedDecodingParams' fields.
_GUIDE_FIELDS = {
    "json_schema": "json",
    "regex": "regex",
    "ebnf_grammar": "grammar",
    "structural_tag": "structural_tag",
}


def guided_decoding_kwargs(request: GenerationRequest) -> dict[str, Any] | None:
    """``tensorrt_llm.sampling_params.GuidedDecodingParams`` keyword arguments for the
    request's guide (None: no guide). The guide is checked here first
    (:func:`tritonllm.guided.grammar`), so a bad one is the request's InvalidRequest."""
    if request.guide_type is None:
        return None
    grammar(request.guide_type, request.guide)
    if request.guide_type == "json":
        return {"json_object": True}
    return {_GUIDE_FIELDS[request.guide_type]: request.guide}


def prompt(request: GenerationRequest) -> dict[str, list[int]]:
    """The LLM API's ``TokensPrompt``: the ids preprocessing made."""
    return {"prompt_token_ids": list(request.input_ids)}


def _token_log_probs(tokens: Sequence[int], logprobs) -> list[float]:
    """The sampled tokens' log probabilities from the LLM API's ``logprobs`` (a float per
    token, or per token a dict of candidate id -> ``Logprob``/float)."""
    values = []
    for token, entry in zip(tokens, logprobs or (), strict=False):
        if isinstance(entry, dict):
            entry = entry.get(token, max(entry.values(), key=_logprob, default=0.0))
        values.append(_logprob(entry))
    return values + [0.0] * (len(tokens) - len(values))


def _logprob(entry) -> float:
    return float(getattr(entry, "logprob", entry))


@dataclass
class OutputTracker:
    """One request's LLM API outputs -> our chunks (the torch engine's shapes)."""

    request: GenerationRequest
    sent: int = 0  # streamed tokens sent so far
    checked: int = 0  # tokens searched for a stop word
    done: bool = False
    cum_log_prob: float = 0.0  # of the streamed tokens so far

    def update(
        self,
        token_ids: Sequence[int],
        logprobs=None,
        finish_reason: str | None = None,
        finished: bool = False,
    ) -> tuple[GenerationChunk | None, bool]:
        """The chunk to send for the request's output so far (``token_ids``: all the
        generated ones) and whether the engine must stop it now (a stop word ended it)."""
        if self.done:
            return None, False
        tokens = list(token_ids)
        cut, by_end_id = self._stop_at(tokens)
        abort = False
        end = None  # the end token's id, where it ended the answer and is logged
        if cut is not None:
            if by_end_id and len(logprobs or ()) > cut:
                end = tokens[cut]
            tokens, abort, finished, finish_reason = tokens[:cut], not finished, True, "stop"
        elif len(tokens) >= self.request.max_tokens:
            tokens, finished = tokens[: self.request.max_tokens], True
            finish_reason = finish_reason if finish_reason in ("stop", "length") else "length"
        if finished:
            self.done = True
            reason = _FINISH_REASONS.get(finish_reason or "stop", "stop")
            return self._chunk(tokens, logprobs, reason, end), abort
        if not self.request.streaming or len(tokens) == self.sent:
            return None, False
        return self._chunk(tokens, logprobs, None), False

    def _stop_at(self, tokens: list[int]) -> tuple[int | None, bool]:
        """Where the answer ends, and whether the end id ended it: after a stop word
        (kept, as the torch engine keeps it) or before the end id (never part of the
        answer)."""
        request = self.request
        for i in range(self.checked, len(tokens)):  # each token once, however long
            if request.end_id is not None and tokens[i] == request.end_id:
                return i, True
            for word in request.stop_words:
                if len(word) <= i + 1 and tuple(tokens[i + 1 - len(word) : i + 1]) == word:
                    return i + 1, False
        self.checked = len(tokens)
        return None, False

    def _chunk(
        self, tokens: list[int], logprobs, reason: str | None, end: int | None = None
    ) -> GenerationChunk:
        """The chunk of ``tokens`` (all the answer's so far); ``end``: the end token,
        which ended it, whose log probability the LLM API returned: counted and logged
        last (the tensor contract's FINISH_END_ID), never among the tokens."""
        logged = tokens + ([end] if end is not None else [])
        if self.request.streaming:  # only the new tokens' log probabilities are read
            new = tokens[self.sent :]
            new_log_probs = _token_log_probs(
                logged[self.sent :], (logprobs or [])[self.sent : len(logged)]
            )
            self.sent = len(tokens)
            self.cum_log_prob += sum(new_log_probs)
            cum = self.cum_log_prob
        else:
            new_log_probs = _token_log_probs(logged, logprobs)
            cum = sum(new_log_probs)
            prompt = [] if self.request.exclude_input_in_output else list(self.request.input_ids)
            new = prompt + tokens
        return GenerationChunk(
            token_ids=new,
            log_probs=new_log_probs,
            cum_log_prob=float(cum),
            num_input_tokens=len(self.request.input_ids),
            num_output_tokens=len(logged),
            finished=reason is not None,
            finish_reason=reason,
            ended_by_end_id=end is not None,
        )


class Sink(Protocol):
    """Where a request's chunks go (the adapter's Triton response sender)."""

    def send(self, chunk: GenerationChunk) -> None: ...

    def fail(self, message: str, code: str = "INTERNAL") -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class _Running:
    request: GenerationRequest
    sink: Sink
    output: Any = None  # the LLM API's RequestOutput once submitted
    aborted: bool = False
    lora: Any = None  # the LLM API's LoRARequest, or None for the base model
    tracker: OutputTracker = field(init=False)

    def __post_init__(self):
        self.tracker = OutputTracker(self.request)


class LLMAPIEngine:
    """The torch engine's verbs over TensorRT-LLM's ``LLM`` (its own in-flight batching).

    ``generate_async`` runs on one asyncio loop in a thread of its own; Triton's
    ``execute`` only hands requests over. At most ``max_batch_size + max_queue_size``
    requests are held; past that a request is refused busy (the Serve app answers 503),
    as the torch engine and the tensorrtllm backend do.
    """

    def __init__(
        self,
        llm,
        sampling_params_cls,
        max_batch_size: int,
        max_queue_size: int,
        max_input_len: int = 0,
        max_seq_len: int = 0,
        guided_decoding_params_cls=None,
        adapters: AdapterDirectories | None = None,
        lora_request_cls=None,
    ):
        self._llm = llm
        self._sampling_params_cls = sampling_params_cls
        # LoRA (None: requests naming an adapter are refused): where each task id's
        # adapter is written, and tensorrt_llm's LoRARequest.
        self._adapters = adapters
        self._lora_request_cls = lora_request_cls
        # tensorrt_llm's GuidedDecodingParams (None: guided requests are refused).
        self._guided_decoding_params_cls = guided_decoding_params_cls
        self._capacity = max_batch_size + max_queue_size
        self._max_input_len = max_input_len
        self._max_seq_len = max_seq_len
        self._running: dict[int, _Running] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="llmapi", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._reap_cancelled(), self._loop)

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Start ``request``; raises InvalidRequest or EngineBusy before any work."""
        self._validate(request)
        params = self._sampling_params(request)
        lora = self._lora_request(request)
        entry = _Running(request, sink, lora=lora)
        with self._lock:
            if len(self._running) >= self._capacity:
                raise EngineBusy(
                    f"{len(self._running)} requests running or queued, the engine's limit "
                    "(max_batch_size + max_queue_size): retry later"
                )
            self._running[id(entry)] = entry
        asyncio.run_coroutine_threadsafe(self._run(entry, params), self._loop)

    def cancel(self, request_id: str) -> None:
        """Stop every running request with ``request_id`` (the contract's ``stop`` input)."""
        with self._lock:
            entries = [e for e in self._running.values() if e.request.request_id == request_id]
        for entry in entries:
            self._loop.call_soon_threadsafe(self._abort, entry)

    def active(self) -> int:
        with self._lock:
            return len(self._running)

    def shutdown(self) -> None:
        with self._lock:
            entries = list(self._running.values())
        for entry in entries:
            self._loop.call_soon_threadsafe(self._abort, entry)
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        shutdown = getattr(self._llm, "shutdown", None)
        if shutdown is not None:
            shutdown()

    async def _close(self) -> None:
        """End the cancellation poll and what still runs, on the loop itself."""
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _validate(self, request: GenerationRequest) -> None:
        request.check()  # the contract's own rules, as the torch engine checks them
        length = len(request.input_ids)
        if self._max_input_len and length > self._max_input_len:
            raise InvalidRequest(
                f"the prompt has {length} tokens, more than max_input_len "
                f"({self._max_input_len}); shorten it"
            )
        if self._max_seq_len and length + request.max_tokens > self._max_seq_len:
            raise InvalidRequest(
                f"prompt ({length} tokens) + max_tokens ({request.max_tokens}) exceeds "
                f"max_seq_len ({self._max_seq_len}); shorten the prompt or lower max_tokens"
            )

    def _lora_request(self, request: GenerationRequest):
        """The request's adapter as a ``LoRARequest`` (None: the base model). Raises
        InvalidRequest: TensorRT-LLM's cache miss for an id alone that is not held
        (the caller resends it with the weights), or an adapter that does not fit."""
        if request.lora_task_id is None:  # (weights without an id: refused by check())
            return None
        if self._adapters is None or self._lora_request_cls is None:
            raise InvalidRequest(
                "this model serves no LoRA adapters: build it with a lora: section in "
                "build_engines/trtllm.yaml (`make engines TARGET=trtllm-pytorch`)"
            )
        task_id = request.lora_task_id
        try:
            path = self._adapters.path(task_id, request.lora)
        except AdapterError as error:
            raise InvalidRequest(str(error)) from None
        return self._lora_request_cls(f"task-{task_id}", task_id, str(path))

    def _sampling_params(self, request: GenerationRequest):
        kwargs = sampling_kwargs(request)
        guide = guided_decoding_kwargs(request)
        if guide is not None:
            if self._guided_decoding_params_cls is None:
                raise InvalidRequest("guided decoding is not available in this TensorRT-LLM")
            kwargs["guided_decoding"] = self._guided_decoding_params_cls(**guide)
        try:
            return self._sampling_params_cls(**kwargs)
        except (ValueError, TypeError) as error:  # TensorRT-LLM's own validation
            raise InvalidRequest(f"invalid sampling parameters: {error}") from None

    async def _run(self, entry: _Running, params) -> None:
        request, sink = entry.request, entry.sink
        try:
            # Stop words need every step to be seen (and the request aborted on one),
            # so the LLM API streams whenever there are any; the tracker still sends a
            # non-streamed request one answer at the end.
            stream = request.streaming or bool(request.stop_words)
            lora = {"lora_request": entry.lora} if entry.lora is not None else {}
            entry.output = self._llm.generate_async(
                prompt(request), sampling_params=params, streaming=stream, **lora
            )
            if entry.aborted:  # cancelled while it was being submitted
                self._abort(entry, force=True)
            if stream:
                async for result in entry.output:
                    if self._deliver(entry, result):
                        break
            else:
                self._deliver(entry, await entry.output.aresult())
            if not entry.tracker.done:  # aborted: the LLM API ended it without a reason
                sink.send(entry.tracker.update([], finished=True, finish_reason="cancelled")[0])
        except Exception as error:
            if entry.aborted and not entry.tracker.done:
                sink.send(entry.tracker.update([], finished=True, finish_reason="cancelled")[0])
            elif not entry.tracker.done:
                log.exception("request %s failed in the LLM API", request.request_id)
                code = "INVALID_ARG" if isinstance(error, ValueError) else "INTERNAL"
                sink.fail(f"TensorRT-LLM: {error}", code)
        finally:
            with self._lock:
                self._running.pop(id(entry), None)

    def _deliver(self, entry: _Running, result) -> bool:
        """Send what ``result`` adds; True when the request has ended here."""
        completion = result.outputs[0]
        chunk, abort = entry.tracker.update(
            completion.token_ids,
            getattr(completion, "logprobs", None),
            getattr(completion, "finish_reason", None),
            bool(getattr(result, "finished", False)),
        )
        if chunk is not None:
            entry.sink.send(chunk)
        if abort:
            self._abort(entry)
        return entry.tracker.done

    def _abort(self, entry: _Running, force: bool = False) -> None:
        if entry.aborted and not force:
            return
        entry.aborted = True
        if entry.output is not None:
            try:
                entry.output.abort()
            except Exception:  # already finished
                log.debug("abort of %s: nothing to stop", entry.request.request_id)

    async def _reap_cancelled(self) -> None:
        """Stop the requests whose client went away (queued ones too: they produce no
        output to notice it on)."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            with self._lock:
                entries = list(self._running.values())
            for entry in entries:
                if not entry.aborted and entry.sink.is_cancelled():
                    self._abort(entry)
