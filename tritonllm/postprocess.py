"""The postprocessing step: token tensors to text."""

from __future__ import annotations

import numpy as np

from tritonllm import tokenization
from tritonllm.detokenize import StreamDetokenizers


def postprocess(
    tokenizer,
    streams: StreamDetokenizers,
    tokens_batch,
    sequence_length,
    request_id: str = "",
    skip_special_tokens: bool = True,
) -> np.ndarray:
    """``TOKENS_BATCH [B, beam, T]`` and ``SEQUENCE_LENGTH [B, beam]`` to ``OUTPUT [B, beam]``.

    A single sequence with a request id goes through that request's incremental
    detokenizer, so streamed chunks join into the right text (a non-streamed
    response is one chunk, and decodes the same). Without an id each chunk is
    decoded on its own, as upstream does. Triton forbids feeding the ensemble's
    ``stream`` flag to this step (its inputs must all come from the decoupled
    tensorrt_llm), so the step cannot tell a stream from a single response.
    """
    tokens_batch = np.asarray(tokens_batch)
    lengths = np.asarray(sequence_length).reshape(tokens_batch.shape[:2])
    out = np.empty(tokens_batch.shape[:2], dtype=object)
    for b in range(tokens_batch.shape[0]):
        for beam in range(tokens_batch.shape[1]):
            ids = tokens_batch[b, beam, : lengths[b, beam]].tolist()
            if request_id and tokens_batch.shape[:2] == (1, 1):
                text = streams.add(request_id, ids)
            else:
                text = tokenization.decode(tokenizer, ids, skip_special_tokens)
            out[b, beam] = text.encode("utf-8")
    return out
