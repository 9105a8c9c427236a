"""Sentence embeddings: a BERT-style encoder, mean pooling, L2 normalisation.

This is what sentence-transformers runs for all-MiniLM-L6-v2, whose ``modules.json``
chains ``Transformer`` (max_seq_length 256) -> ``Pooling`` (mean over the attention
mask, ``1_Pooling/config.json``) -> ``Normalize``. The three steps are written out over
transformers rather than calling ``SentenceTransformer.encode`` because the server
needs what ``encode`` does not give: the token count of each text (OpenAI's
``usage``) and one forward over the texts of several Triton requests at once. The
pipeline is read from the checkpoint's own sentence-transformers files, and anything
this module does not implement (another pooling mode, a Dense layer) is refused at
load rather than served wrong. The tests hold the output to sentence-transformers'
own (cosine > 0.9999).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tritonllm import contract
from tritonllm.tokenization import InvalidRequest

# sentence-transformers' module classes, by the last part of their type name (older
# releases write ``sentence_transformers.models.Pooling``, newer ones other packages).
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"
_MEAN_ONLY = {
    "pooling_mode_mean_tokens": True,
    "pooling_mode_cls_token": False,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
}


class UnsupportedModel(ValueError):
    """The checkpoint's sentence-transformers pipeline is not one this module runs."""


@dataclass(frozen=True)
class SentencePipeline:
    """The parts of a sentence-transformers checkpoint the encoder follows."""

    max_seq_length: int  # longer texts are truncated, as sentence-transformers does
    normalize: bool  # a Normalize module follows the pooling


def _module_kinds(model_dir: Path) -> list[tuple[str, str]]:
    path = model_dir / "modules.json"
    if not path.is_file():
        raise UnsupportedModel(
            f"{model_dir} has no modules.json: pass a sentence-transformers checkpoint "
            "directory (the folder SentenceTransformer.save() writes)"
        )
    return [(m["type"].rsplit(".", 1)[-1], m.get("path", "")) for m in json.loads(path.read_text())]


def _check_mean_pooling(pooling_dir: Path) -> None:
    config = json.loads((pooling_dir / "config.json").read_text())
    modes = {key: bool(config.get(key, False)) for key in _MEAN_ONLY}
    if modes != _MEAN_ONLY:
        raise UnsupportedModel(
            f"{pooling_dir}: pooling {modes} is not supported; this server implements mean "
            "pooling over the attention mask only"
        )


def _max_seq_length(model_dir: Path) -> int:
    """sentence_bert_config.json's max_seq_length, else the position embeddings' size."""
    bert_config = model_dir / "sentence_bert_config.json"
    if bert_config.is_file():
        value = json.loads(bert_config.read_text()).get("max_seq_length")
        if value:
            return int(value)
    return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])


def read_pipeline(model_dir: Path | str) -> SentencePipeline:
    """Transformer -> mean Pooling [-> Normalize], or an :class:`UnsupportedModel` error."""
    model_dir = Path(model_dir)
    kinds = _module_kinds(model_dir)
    names = [kind for kind, _ in kinds]
    if names not in ([_TRANSFORMER, _POOLING], [_TRANSFORMER, _POOLING, _NORMALIZE]):
        raise UnsupportedModel(
            f"{model_dir}: modules {names} are not supported; this server runs "
            "Transformer -> Pooling (mean) -> Normalize (optional)"
        )
    _check_mean_pooling(model_dir / kinds[1][1])
    return SentencePipeline(_max_seq_length(model_dir), normalize=len(names) == 3)


def mean_pool(token_embeddings, attention_mask):
    """The mean of each row's token vectors where the mask is 1 (padding left out)."""
    mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)
    summed = (token_embeddings * mask).sum(dim=1)
    # sentence-transformers clamps the count the same way (a row is never all padding).
    return summed / mask.sum(dim=1).clamp(min=1e-9)


def decode_texts(array: np.ndarray) -> list[str]:
    """One request's ``text`` tensor ([B, 1] bytes) to strings; empty input is refused."""
    values = np.asarray(array, dtype=object).reshape(-1)
    if values.size == 0:
        raise InvalidRequest("text is empty: send at least one input text")
    texts = []
    for value in values:
        try:
            text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError:
            raise InvalidRequest("text must be UTF-8") from None
        if not text:
            raise InvalidRequest("text is empty: every input must be a non-empty string")
        texts.append(text)
    return texts


@dataclass
class Embeddings:
    vectors: np.ndarray  # float32 [N, dimension]
    num_tokens: np.ndarray  # int32 [N], special tokens included, after truncation


class SentenceEncoder:
    """A local sentence-transformers checkpoint, run with transformers (never the hub)."""

    def __init__(self, model_dir: Path | str, device: str = "auto"):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.model_dir = Path(model_dir)
        self.pipeline = read_pipeline(self.model_dir)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        model = AutoModel.from_pretrained(self.model_dir, local_files_only=True)
        self.model = model.to(self.device).eval()

    @property
    def dimension(self) -> int:
        return int(self.model.config.hidden_size)

    def encode(self, texts: Sequence[str]) -> Embeddings:
        """One padded forward over ``texts``; each row equals that text encoded alone."""
        import torch

        batch = self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.pipeline.max_seq_length,
            return_tensors="pt",
        ).to(self.device)
        with torch.inference_mode():
            tokens = self.model(**batch).last_hidden_state
            vectors = mean_pool(tokens, batch["attention_mask"])
            if self.pipeline.normalize:
                vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return Embeddings(
            vectors.float().cpu().numpy(),
            batch["attention_mask"].sum(dim=1).to(torch.int32).cpu().numpy(),
        )


def embed_requests(
    encoder: SentenceEncoder, texts: Sequence[np.ndarray]
) -> list[dict[str, np.ndarray] | InvalidRequest]:
    """The ``text`` tensors of the requests Triton gave one ``execute``, answered with
    one forward: per request its output tensors, or the error that request alone gets."""
    decoded: list[list[str] | InvalidRequest] = []
    for array in texts:
        try:
            decoded.append(decode_texts(array))
        except InvalidRequest as error:
            decoded.append(error)
    flat = [t for request in decoded if not isinstance(request, InvalidRequest) for t in request]
    result = encoder.encode(flat) if flat else None
    answers, row = [], 0
    for request in decoded:
        if isinstance(request, InvalidRequest):
            answers.append(request)
            continue
        rows = slice(row, row + len(request))
        row += len(request)
        answers.append(
            {
                contract.EMBEDDINGS_VECTOR.name: result.vectors[rows],
                contract.EMBEDDINGS_NUM_TOKENS.name: result.num_tokens[rows].reshape(-1, 1),
            }
        )
    return answers
