"""tritonllm.embeddings with the real all-MiniLM-L6-v2, no Triton: the pipeline read from
the checkpoint, pooling, input checks, and parity with sentence-transformers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tritonllm.embeddings import (
    SentencePipeline,
    UnsupportedModel,
    decode_texts,
    embed_requests,
    mean_pool,
    read_pipeline,
)
from tritonllm.tokenization import InvalidRequest

SENTENCES = [
    "The cat sits on the mat.",
    "A cat is sitting on a mat.",
    "Stock markets fell sharply after the announcement.",
    "Ünïcödé text: 東京は晴れです 🙂",
    "word " * 400,  # over max_seq_length: truncated to 256 tokens, as sentence-transformers
]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_pipeline_is_read_from_the_checkpoint(embedding_model_dir):
    # modules.json: Transformer -> Pooling (mean) -> Normalize; sentence_bert_config: 256.
    assert read_pipeline(embedding_model_dir) == SentencePipeline(256, normalize=True)


@pytest.fixture
def checkpoint_copy(embedding_model_dir, tmp_path):
    """The checkpoint's small files (not the weights), to edit."""
    copy = tmp_path / "model"
    shutil.copytree(embedding_model_dir, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    return copy


def test_a_pipeline_without_normalize(checkpoint_copy):
    modules = json.loads((checkpoint_copy / "modules.json").read_text())
    (checkpoint_copy / "modules.json").write_text(json.dumps(modules[:2]))
    assert read_pipeline(checkpoint_copy) == SentencePipeline(256, normalize=False)


def test_other_pooling_modes_are_refused(checkpoint_copy):
    config = checkpoint_copy / "1_Pooling" / "config.json"
    pooling = json.loads(config.read_text())
    config.write_text(json.dumps({**pooling, "pooling_mode_cls_token": True}))
    with pytest.raises(UnsupportedModel, match="mean pooling over the attention mask only"):
        read_pipeline(checkpoint_copy)


def test_other_module_chains_are_refused(checkpoint_copy):
    modules = json.loads((checkpoint_copy / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (checkpoint_copy / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(UnsupportedModel, match="'Dense'.* not supported"):
        read_pipeline(checkpoint_copy)


def test_a_plain_transformers_checkpoint_is_refused_with_the_fix(checkpoint_copy):
    (checkpoint_copy / "modules.json").unlink()
    with pytest.raises(UnsupportedModel, match="no modules.json.*sentence-transformers"):
        read_pipeline(checkpoint_copy)


def test_mean_pool_leaves_padding_out():
    tokens = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert mean_pool(tokens, mask).tolist() == [[2.0, 3.0]]


def test_decode_texts_refuses_empty_input():
    assert decode_texts(np.array([[b"a"], ["b"]], dtype=object)) == ["a", "b"]
    with pytest.raises(InvalidRequest, match="text is empty"):
        decode_texts(np.array([[b"fine"], [b""]], dtype=object))
    with pytest.raises(InvalidRequest, match="at least one input"):
        decode_texts(np.empty((0, 1), dtype=object))
    with pytest.raises(InvalidRequest, match="UTF-8"):
        decode_texts(np.array([[b"\xff"]], dtype=object))


def test_embeddings_equal_sentence_transformers(sentence_encoder, sentence_transformer):
    ours = sentence_encoder.encode(SENTENCES)
    reference = sentence_transformer.encode(SENTENCES, convert_to_numpy=True)
    assert ours.vectors.shape == (len(SENTENCES), 384) and ours.vectors.dtype == np.float32
    assert (cosine(ours.vectors, reference) > 0.9999).all()
    np.testing.assert_allclose(np.linalg.norm(ours.vectors, axis=1), 1.0, atol=1e-5)


def test_token_counts_include_special_tokens_and_stop_at_max_seq_length(sentence_encoder):
    counts = sentence_encoder.encode(SENTENCES).num_tokens
    tokenizer = sentence_encoder.tokenizer
    assert counts[0] == len(tokenizer("The cat sits on the mat.")["input_ids"])  # [CLS] .. [SEP]
    assert counts[-1] == 256
    assert counts.dtype == np.int32


def test_a_padded_batch_gives_each_text_its_own_vector(sentence_encoder):
    together = sentence_encoder.encode(SENTENCES).vectors
    alone = np.stack([sentence_encoder.encode([s]).vectors[0] for s in SENTENCES])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_similar_sentences_score_higher_than_unrelated_ones(sentence_encoder):
    cat, cat2, stocks = sentence_encoder.encode(SENTENCES[:3]).vectors
    assert cosine(cat, cat2)[0] > 0.8 > cosine(cat, stocks)[0] + 0.5


def test_embed_requests_answers_each_request_in_its_rows(sentence_encoder):
    requests = [
        np.array([[s.encode()] for s in SENTENCES[:3]], dtype=object),  # three texts
        np.array([[b""]], dtype=object),  # refused alone
        np.array([[SENTENCES[3].encode()]], dtype=object),
    ]
    answers = embed_requests(sentence_encoder, requests)
    alone = sentence_encoder.encode(SENTENCES[:4])
    assert answers[0]["embedding"].shape == (3, 384)
    assert answers[0]["num_tokens"].shape == (3, 1)
    np.testing.assert_allclose(answers[0]["embedding"], alone.vectors[:3], atol=1e-5)
    assert isinstance(answers[1], InvalidRequest) and "text is empty" in str(answers[1])
    np.testing.assert_allclose(answers[2]["embedding"], alone.vectors[3:], atol=1e-5)
    assert answers[2]["num_tokens"].tolist() == [[alone.num_tokens[3]]]


def test_embed_requests_with_only_bad_requests_answers_each_with_its_error(sentence_encoder):
    answers = embed_requests(sentence_encoder, [np.array([[b""]], dtype=object)])
    assert len(answers) == 1 and isinstance(answers[0], InvalidRequest)
