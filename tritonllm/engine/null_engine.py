"""The null engine: a benchmark instrument for the ``tensorrt_llm`` slot, no model math.

It measures the serving path, not a model. The scheduler, the response thread, the
tensor contract, Triton, pre/postprocessing and everything in front of them run as
they do for the torch engine; only the forward passes are replaced by a sleep of a
fixed step time (a GPU step keeps the CPU free in the same way) and the sampler by a
script of real token ids of the model's tokenizer, so detokenization is real work.
What the stack then spends in CPU per token is serving overhead alone, at token
rates a CPU model never reaches (vLLM's dummy weights and Ray Serve LLM's mock
engine play the same role).

The scheduler still honours ``max_tokens``, ``min_tokens``, stop words, ``end_id``
(the script ends with it after ``answer_tokens``, when that is set) and
cancellation, exactly as for a real model.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

from tritonllm.engine.request import GenerationRequest

# What the script says: words of several lengths, multi-byte characters and spaces,
# so the incremental detokenizer does the same work as on real text.
SCRIPT_TEXT = (
    "The robot writes a long letter to the old town, and the teacher reads it every "
    "morning by the window. Many small servers answer requests near the sea; the café "
    "opens at nine, naïve tourists ask for crème brûlée, and a cat sleeps in the sun. "
)


class NullCache:
    """The engine's KV cache interface with nothing behind it."""

    def move(self, source: int, destination: int, length: int) -> None:
        pass


class NullRunner:
    """:class:`tritonllm.engine.runner.CausalLMRunner`'s interface, sleeping instead of
    computing: one ``step_s`` per prefill and per batched decode, whatever the batch."""

    def __init__(self, engine_dir: str | Path, step_s: float, answer_tokens: int = 0):
        from tritonllm.tokenization import load_tokenizer

        engine_dir = Path(engine_dir)
        config = json.loads((engine_dir / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.max_position_embeddings = int(config.get("max_position_embeddings") or 2048)
        self.step_s = step_s
        self.answer_tokens = answer_tokens
        tokenizer = load_tokenizer(str(engine_dir))
        self.script = tuple(tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))

    def new_cache(self, num_slots: int, max_len: int) -> NullCache:
        return NullCache()

    def new_prefix_cache(self, cache: NullCache, budget_mb: float, block_size: int) -> None:
        return None  # no keys and values to keep

    def prefill(
        self,
        cache: NullCache,
        slots: list[int],
        prompts: list[list[int]],
        starts=None,
        every_position: bool = False,
        adapters=None,  # always None: the null engine serves no adapters
    ) -> list[None]:
        time.sleep(self.step_s)
        return [None] * len(prompts)

    def decode(
        self, cache: NullCache, token_ids: list[int], positions: list[int], adapters=None
    ) -> list[None]:
        time.sleep(self.step_s)
        return [None] * len(token_ids)

    def sampler(self, request: GenerationRequest) -> ScriptedSampler:
        return ScriptedSampler(self.script, request, self.answer_tokens)


class ScriptedSampler:
    """The token after ``generated`` tokens: the script read from an offset that the
    prompt decides (equal prompts, equal answers), then ``end_id`` once the answer is
    ``answer_tokens`` long (never before ``min_tokens``; 0: no end but max_tokens)."""

    def __init__(self, script: tuple[int, ...], request: GenerationRequest, answer_tokens: int):
        self._script = script
        self._offset = zlib.crc32(str(request.input_ids).encode()) % len(script)
        end_id = request.end_id  # negative: no end id (ignore_eos)
        self._end_id = end_id if end_id is not None and end_id >= 0 else None
        self._end_at = max(answer_tokens, request.sampling.min_tokens) if answer_tokens else 0

    def __call__(self, logits, history: list[int], generated: int) -> int:
        if self._end_at and generated >= self._end_at and self._end_id is not None:
            return self._end_id
        return self._script[(self._offset + generated) % len(self._script)]
