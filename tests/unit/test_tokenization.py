import numpy as np
import pytest

from tritonllm import tokenization
from tritonllm.preprocess import preprocess
from tritonllm.tokenization import InvalidRequest, from_word_list, to_word_list

TEXTS = [
    "The cat sat on the mat.",
    "  leading spaces, trailing spaces  ",
    "日本語と emoji 🙂 and a split é",
    "special tokens as text: <s> </s> <|endoftext|>",
    "tabs\tand\nnewlines\r\n",
    "",
]


def test_word_list_round_trip(tokenizer):
    words = ["the cat", ".", "日本語"]
    word_list = to_word_list(tokenizer, words)
    assert word_list.shape[0] == 2 and word_list.dtype == np.int32
    assert from_word_list(word_list) == [
        tokenizer.encode(w, add_special_tokens=False) for w in words
    ]


def test_empty_word_list_means_no_words(tokenizer):
    assert to_word_list(tokenizer, []).tolist() == [[0], [-1]]
    assert from_word_list(to_word_list(tokenizer, [])) == []


def test_malformed_word_list_is_rejected():
    with pytest.raises(InvalidRequest):
        from_word_list(np.array([[1, 2, 3], [2, 1, -1]]))
    with pytest.raises(InvalidRequest):
        from_word_list(np.array([1, 2, 3]))


def test_preprocess_adds_bos_and_fills_end_and_pad_from_the_tokenizer(tokenizer):
    out = preprocess(tokenizer, np.array([[b"The cat"]], dtype=object), np.array([[8]]))
    ids = out["INPUT_ID"][0].tolist()
    assert ids[0] == tokenizer.bos_token_id and ids == tokenizer.encode("The cat")
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(ids)]]
    assert out["OUT_END_ID"].tolist() == [[tokenizer.eos_token_id]]
    assert out["OUT_PAD_ID"].tolist() == [[tokenizer.pad_token_id]]
    for name in ("BAD_WORDS_IDS", "STOP_WORDS_IDS"):  # none sent: "no words"
        assert out[name].dtype == np.int32
        assert out[name].tolist() == [to_word_list(tokenizer, []).tolist()]


def test_preprocess_keeps_request_end_id_and_encodes_stop_words(tokenizer):
    out = preprocess(
        tokenizer,
        np.array([[b"The cat"]], dtype=object),
        np.array([[8]]),
        stop_words=np.array([[b"ball", b"."]], dtype=object),
        end_id=np.array([[7]], dtype=np.int32),
    )
    assert out["OUT_END_ID"].tolist() == [[7]]
    assert out["STOP_WORDS_IDS"].shape[:2] == (1, 2)
    assert len(from_word_list(out["STOP_WORDS_IDS"][0])) == 2


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_preprocess_rejects_non_positive_max_tokens(tokenizer, max_tokens):
    with pytest.raises(InvalidRequest, match="max_tokens must be > 0"):
        preprocess(tokenizer, np.array([[b"hi"]], dtype=object), np.array([[max_tokens]]))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_gives_the_tokenizers_own_ids(tokenizer, text, add_special_tokens):
    assert tokenization._rust_tokenizer(tokenizer) is not None  # the fast path is taken
    expected = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert tokenization.encode(tokenizer, text, add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_gives_the_tokenizers_own_text(tokenizer, text, skip_special_tokens):
    ids = [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]
    ids.append(tokenizer.eos_token_id)
    for end in range(len(ids) + 1):  # every prefix: split characters included
        expected = tokenizer.decode(ids[:end], skip_special_tokens=skip_special_tokens)
        assert tokenization.decode(tokenizer, ids[:end], skip_special_tokens) == expected


def test_a_tokenizer_whose_wrapper_changes_the_result_is_called_through_it(checkpoint_dir):
    cleaning = tokenization.load_tokenizer(str(checkpoint_dir))
    cleaning.clean_up_tokenization_spaces = True
    assert tokenization._rust_tokenizer(cleaning) is None
    # Truncation set on the Rust tokenizer (as a call with truncation=True leaves it):
    # transformers turns it off for a call that asks for none, and so must encode().
    truncating = tokenization.load_tokenizer(str(checkpoint_dir))
    truncating.backend_tokenizer.enable_truncation(max_length=2)
    ids = tokenization.encode(truncating, TEXTS[0])
    assert ids == tokenization.load_tokenizer(str(checkpoint_dir)).encode(TEXTS[0])
    assert len(ids) > 2
