import pytest

from tritonllm.detokenize import IncrementalDetokenizer, StreamDetokenizers

TEXTS = [
    "The cat sees the red ball in the park.",
    "日本語は難しい。 Привет, мир! Crème brûlée, s'il vous plaît 🙂🚀",
    "  leading spaces and   gaps\nnew line",
]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_join_into_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_split_multibyte_character_is_held_back_until_complete(tokenizer):
    # A character the byte-level BPE never merged: several tokens for one character.
    char = next(c for c in "𝔘𝔫𝔦𝔠𝔬𝔡𝔢♞⚗" if len(tokenizer.encode(c, add_special_tokens=False)) > 1)
    ids = tokenizer.encode(char, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == char


def test_per_request_state_is_kept_apart(tokenizer):
    streams = StreamDetokenizers(tokenizer)
    a = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    b = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    out = {"a": "", "b": ""}
    for i in range(max(len(a), len(b))):
        if i < len(a):
            out["a"] += streams.add("a", a[i : i + 1])
        if i < len(b):
            out["b"] += streams.add("b", b[i : i + 1])
    assert out == {"a": TEXTS[0], "b": TEXTS[1]}


def test_state_is_bounded(tokenizer):
    streams = StreamDetokenizers(tokenizer, max_entries=3)
    for i in range(10):
        streams.add(str(i), [5])
    assert len(streams) == 3
