"""What a logprobs answer says of its tokens, with the default model's tokenizer: each
token's text and where it starts in the answer's text (completions' text_offset)."""

from __future__ import annotations

import pytest

from serve.api.common.token_texts import TokenTexts
from tritonllm import tokenization

# The default tokenizer splits the rocket into three tokens (" \\xf0\\x9f", "\\x9a", "\\x80").
PROMPTS = [
    "The cat sat on the mat. Héllo wörld",
    "Smörgåsbord 🚀 ok",
    "<|user|>\nhi</s>\n<|assistant|>\n",  # special tokens written in the text
]


@pytest.fixture(scope="module")
def texts(tokenizer) -> TokenTexts:
    return TokenTexts(tokenizer)


def assert_each_token_starts_at_its_offset(tokens: list[str], offsets: list[int], text: str):
    """A token whose text is whole where it stands starts there; one that adds nothing
    (a special token skipped, a character's first bytes) points at what follows."""
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    for token, offset in zip(tokens, offsets, strict=True):
        if "\ufffd" not in token and text.startswith(token, offset):
            continue
        assert token in ("<s>", "</s>") or "\ufffd" in token, (token, offset, text)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_text_prompts_tokens_point_into_the_text_as_sent(texts, tokenizer, prompt):
    ids = tokenizer.encode(prompt)  # with the BOS the text does not hold
    offsets = texts.prompt_offsets(ids, prompt)
    tokens = texts.texts(ids)
    assert tokens[0] == "<s>" and offsets[:2] == [0, 0]
    assert_each_token_starts_at_its_offset(tokens, offsets, prompt)
    ok = prompt.find(" ok")
    if ok >= 0:  # after the split character, offsets are exact again
        assert offsets[tokens.index(" o")] == ok


def test_a_token_prompt_is_echoed_with_its_special_tokens(texts, tokenizer):
    ids = tokenizer.encode(PROMPTS[2])
    echoed = texts.prompt_text(ids)
    assert echoed == "<s>" + PROMPTS[2]
    offsets = texts.prompt_offsets(ids, echoed)
    assert offsets[:3] == [0, 3, 11]  # "<s>", "<|user|>", "\n"
    assert_each_token_starts_at_its_offset(texts.texts(ids), offsets, echoed)


def test_an_answers_offsets_follow_its_text_chunk_by_chunk(texts, tokenizer):
    answer = tokenizer.encode(" hi</s> there 🚀 done", add_special_tokens=False)
    text = tokenization.decode(tokenizer, answer, skip_special_tokens=True)
    assert "</s>" not in text  # the postprocessing's text skips special tokens
    offsets = texts.answer_offsets(start=5)
    starts = offsets.add(answer[:3]) + offsets.add(answer[3:])  # two chunks
    assert_each_token_starts_at_its_offset(texts.texts(answer), [s - 5 for s in starts], text)
    assert offsets.position == 5 + len(text)
    tokens = texts.texts(answer)
    assert starts[tokens.index("</s>")] == 5 + len(" hi")  # where the next text starts


def test_the_end_token_is_named_as_the_tokenizer_names_it(texts, tokenizer):
    assert texts.end_id == tokenizer.eos_token_id
    assert texts.texts([texts.end_id]) == ["</s>"]
