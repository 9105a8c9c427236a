import json
import subprocess
import sys

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


@pytest.fixture(params=["as built", "GPT2Tokenizer"])
def tokenizer_dir(request, checkpoint_dir, tmp_path):
    """The default checkpoint's tokenizer, and the same files naming a model's own class
    (AutoTokenizer then loads that class, as for most checkpoints of the hub)."""
    if request.param == "as built":
        return checkpoint_dir
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((checkpoint_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(config | {"tokenizer_class": request.param})
    )
    return tmp_path


def test_a_tokenizer_loaded_by_its_recorded_class_is_autotokenizers_without_torch(tokenizer_dir):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    recorded = tokenization.tokenizer_class_of(str(tokenizer_dir))
    assert recorded == f"{type(auto).__module__}:{type(auto).__name__}"
    # A fresh interpreter, as a Triton stub is: the class alone, and no torch imported.
    code = (
        "import json, sys\n"
        "from tritonllm import tokenization\n"
        f"t = tokenization.load_tokenizer({str(tokenizer_dir)!r}, {recorded!r})\n"
        f"texts = {TEXTS!r}\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'class': type(t).__name__,\n"
        "    'ids': [t.encode(x) for x in texts], 'special': t.all_special_ids,\n"
        "    'text': [t.decode(t.encode(x), skip_special_tokens=True) for x in texts]}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert loaded["torch"] is False
    assert loaded["class"] == type(auto).__name__
    assert loaded["ids"] == [auto.encode(text) for text in TEXTS]
    assert loaded["special"] == auto.all_special_ids
    assert loaded["text"] == [auto.decode(auto.encode(t), skip_special_tokens=True) for t in TEXTS]


def test_a_recorded_class_outside_transformers_is_refused(checkpoint_dir):
    with pytest.raises(ValueError, match="not a transformers class"):
        tokenization.load_tokenizer(str(checkpoint_dir), "os:system")


def test_a_recorded_class_this_transformers_lacks_is_autotokenizer_s_choice(checkpoint_dir):
    built_elsewhere = "transformers.models.gone.tokenization_gone:GoneTokenizer"
    loaded = tokenization.load_tokenizer(str(checkpoint_dir), built_elsewhere)
    assert loaded.encode(TEXTS[0]) == tokenization.load_tokenizer(str(checkpoint_dir)).encode(
        TEXTS[0]
    )


def test_make_engines_records_the_class_for_both_tokenizer_steps(built_repository, checkpoint_dir):
    recorded = tokenization.tokenizer_class_of(str(checkpoint_dir))
    line = f'key: "tokenizer_class" value: {{ string_value: "{recorded}" }}'
    for step in ("preprocessing", "postprocessing"):
        assert line in (built_repository / step / "config.pbtxt").read_text()
