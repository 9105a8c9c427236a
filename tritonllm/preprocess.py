"""The preprocessing step: prompts and word lists to token tensors."""

from __future__ import annotations

import numpy as np

from tritonllm import contract, tokenization
from tritonllm.tokenization import InvalidRequest

# The preprocessing model's inputs (contract.PREPROCESSING_INPUTS) as :func:`preprocess`'s
# arguments: the Triton model and the replica's own steps (serve/engines/triton/steps.py) use it.
ARGUMENTS = {
    spec.name: argument
    for spec, argument in (
        (contract.PRE_QUERY, "query"),
        (contract.PRE_REQUEST_OUTPUT_LEN, "request_output_len"),
        (contract.PRE_INPUT_IDS, "prompt_ids"),
        (contract.PRE_BAD_WORDS_DICT, "bad_words"),
        (contract.PRE_STOP_WORDS_DICT, "stop_words"),
        (contract.PRE_END_ID, "end_id"),
        (contract.PRE_PAD_ID, "pad_id"),
        (contract.PRE_EMBEDDING_BIAS_WORDS, "bias_words"),
        (contract.PRE_EMBEDDING_BIAS_WEIGHTS, "bias_weights"),
        (contract.PRE_EMBEDDING_BIAS_TOKEN_IDS, "bias_token_ids"),
    )
}


def _scalar_column(values: np.ndarray | None, batch: int, default: int) -> np.ndarray:
    if values is None:
        return np.full((batch, 1), default, dtype=np.int32)
    return np.asarray(values, dtype=np.int32).reshape(batch, 1)


def _word_lists(tokenizer, values: np.ndarray | None, batch: int) -> np.ndarray:
    if values is None:  # the common case: "no words", [[0], [-1]], for every request
        out = np.zeros((batch, 2, 1), dtype=np.int32)
        out[:, 1, :] = -1
        return out
    rows = [
        tokenization.to_word_list(tokenizer, tokenization.decode_words(values[i]))
        for i in range(batch)
    ]
    width = max(r.shape[1] for r in rows)
    out = np.zeros((batch, 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for i, row in enumerate(rows):
        out[i, :, : row.shape[1]] = row
    return out


def preprocess(
    tokenizer,
    query,
    request_output_len,
    bad_words=None,
    stop_words=None,
    end_id=None,
    pad_id=None,
    add_special_tokens: bool = True,
    prompt_ids=None,
    bias_words=None,
    bias_weights=None,
    bias_token_ids=None,
) -> dict[str, np.ndarray]:
    """Batch of requests (leading dim) to the tensors the ensemble feeds tensorrt_llm.

    ``prompt_ids`` ([batch, length]), when given, is the prompt as the client
    tokenized it: used as it is, ``query`` ignored."""
    batch = query.shape[0]
    output_len = np.asarray(request_output_len, dtype=np.int32).reshape(batch, 1)
    # Kept though our engines check it too: our only guard before TensorRT-LLM's C++ backend.
    if (output_len <= 0).any():
        raise InvalidRequest(
            f"max_tokens must be > 0, got {int(output_len.min())}: ask for at least one token"
        )
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id  # each a lookup by name
    eos = -1 if eos is None else eos
    pad = eos if pad is None else pad
    end_ids = _scalar_column(end_id, batch, eos)
    pad_ids = _scalar_column(pad_id, batch, pad)

    if prompt_ids is not None:
        ids = [row.tolist() for row in np.asarray(prompt_ids).reshape(batch, -1)]
    else:
        prompts = tokenization.decode_words(query)
        if len(prompts) != batch:
            raise InvalidRequest("text_input is empty: send a non-empty prompt")
        ids = [tokenization.encode_prompt(tokenizer, p, add_special_tokens) for p in prompts]
    width = max(len(x) for x in ids)
    input_ids = np.empty((batch, width), dtype=np.int32)
    for i, row in enumerate(ids):
        input_ids[i, :] = pad_ids[i, 0]
        input_ids[i, : len(row)] = row
    return {
        contract.PRE_INPUT_ID.name: input_ids,
        contract.PRE_REQUEST_INPUT_LEN.name: np.array([[len(x)] for x in ids], dtype=np.int32),
        contract.PRE_BAD_WORDS_IDS.name: _word_lists(tokenizer, bad_words, batch),
        contract.PRE_STOP_WORDS_IDS.name: _word_lists(tokenizer, stop_words, batch),
        contract.PRE_REQUEST_OUTPUT_LEN.name: output_len,
        contract.PRE_OUT_END_ID.name: end_ids,
        contract.PRE_OUT_PAD_ID.name: pad_ids,
        contract.PRE_EMBEDDING_BIAS.name: embedding_bias(
            tokenizer, batch, bias_words, bias_weights, bias_token_ids
        ),
    }


def embedding_bias(tokenizer, batch: int, words=None, weights=None, token_ids=None) -> np.ndarray:
    """The ``[batch, vocabulary]`` logit biases of each request (``[batch, 0]`` for none,
    as upstream's preprocessing sends it): each weight added to its token's logit, or, for
    a word (upstream's ``embedding_bias_words``), to the logit of every token of the word."""
    if weights is None or (words is None and token_ids is None):
        return np.zeros((batch, 0), dtype=np.float32)
    weights = np.asarray(weights, dtype=np.float32).reshape(batch, -1)
    vocab = len(tokenizer)
    bias = np.zeros((batch, vocab), dtype=np.float32)
    for row in range(batch):
        targets = _bias_targets(tokenizer, batch, row, words, token_ids)
        if len(targets) != weights.shape[1]:
            raise InvalidRequest(
                f"embedding_bias_weights holds {weights.shape[1]} values for {len(targets)} "
                "words or token ids: send one weight for each"
            )
        for ids, weight in zip(targets, weights[row], strict=True):
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                raise InvalidRequest(
                    f"embedding_bias_token_ids holds ids outside the vocabulary [0, {vocab}): "
                    f"{outside[:5]}"
                )
            np.add.at(bias[row], ids, weight)
    return bias


def _bias_targets(tokenizer, batch: int, row: int, words, token_ids) -> list[list[int]]:
    """Each weight's token ids: one id each, or the tokens of each word."""
    if token_ids is not None:
        return [[int(t)] for t in np.asarray(token_ids).reshape(batch, -1)[row]]
    texts = tokenization.decode_words(np.asarray(words, dtype=object).reshape(batch, -1)[row])
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]
