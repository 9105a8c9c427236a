"""What one generation request asks of the engine, validated before any work."""

from __future__ import annotations

from dataclasses import dataclass, field

from tritonllm.contract import MAX_TOP_LOG_PROBS
from tritonllm.engine.sampling import SamplingParams
from tritonllm.guided import check_guide
from tritonllm.lora import LoraTensors
from tritonllm.tokenization import InvalidRequest


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    input_ids: tuple[int, ...]
    max_tokens: int
    end_id: int | None = None
    pad_id: int | None = None
    stop_words: tuple[tuple[int, ...], ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    streaming: bool = False
    exclude_input_in_output: bool = False
    return_log_probs: bool = False
    num_top_log_probs: int = 0  # alternatives per generated token (with return_log_probs)
    return_prompt_log_probs: bool = False
    # Guided decoding (TensorRT-LLM's guided_decoding_guide_type / _guide): one of
    # tritonllm.contract.GUIDE_TYPES, or None for none; the guide's text.
    guide_type: str | None = None
    guide: str = ""
    # LoRA (TensorRT-LLM's lora_task_id): the adapter's id, and its weights
    # (lora_weights, lora_config) when the engine may not hold it yet.
    lora_task_id: int | None = None
    lora: LoraTensors | None = field(default=None, compare=False, repr=False)
    # The last this-many input ids are the request's own earlier output (a request
    # resumed on another replica; tritonllm.contract's resumed_output_len).
    resumed_output_len: int = 0
    # Lower is admitted first when the engine is full (tritonllm.contract's priority).
    priority: int = 0

    @property
    def resumed_ids(self) -> tuple[int, ...]:
        return self.input_ids[len(self.input_ids) - self.resumed_output_len :]

    def check(self) -> None:
        """Reject what the contract's tensors must never hold, whichever engine reads them
        (the torch engine's :meth:`validate`, and the LLM API target's submit)."""
        if not self.input_ids:
            raise InvalidRequest("input_ids is empty: the prompt must contain at least one token")
        if self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be > 0, got {self.max_tokens}")
        if not 0 <= self.resumed_output_len < len(self.input_ids):
            raise InvalidRequest(
                f"resumed_output_len must be in [0, {len(self.input_ids)}) (the input's "
                f"length), got {self.resumed_output_len}"
            )
        if not 0 <= self.num_top_log_probs <= MAX_TOP_LOG_PROBS:
            raise InvalidRequest(
                f"num_top_log_probs must be in [0, {MAX_TOP_LOG_PROBS}], "
                f"got {self.num_top_log_probs}"
            )
        if self.lora is not None and self.lora_task_id is None:
            raise InvalidRequest(
                "lora_weights and lora_config came without lora_task_id: "
                "send the adapter's task id with its weights"
            )

    def validate(self, max_seq_len: int, vocab_size: int) -> None:
        """Reject what the torch engine cannot serve, naming the limit (before any compute)."""
        self.check()
        bad = [t for t in self.input_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"input_ids contains ids outside [0, {vocab_size}): {bad[:5]}")
        biased = [t for t, _ in self.sampling.logit_bias if t >= vocab_size]
        if biased:
            raise InvalidRequest(
                f"embedding_bias is longer than the vocabulary ({vocab_size} tokens)"
            )
        if self.guide_type is not None:
            check_guide(self.guide_type, self.guide)  # the grammar itself: at compilation
        total = len(self.input_ids) + self.max_tokens
        if total > max_seq_len:
            raise InvalidRequest(
                f"prompt ({len(self.input_ids)} tokens) + max_tokens ({self.max_tokens}) = "
                f"{total} exceeds the maximum sequence length of {max_seq_len} tokens; "
                "shorten the prompt or lower max_tokens"
            )
