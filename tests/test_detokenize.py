"""Incremental detokenization gives exactly the text of decoding all tokens at once, on multi-byte text, byte
fallback, random token streams, and the real models' tokenizers."""

import pytest
import torch
from transformers import AutoTokenizer

import sparsegen
from sparsegen.detokenize import Detokenizer
from sparsegen.models.gguf import checkpoint_folder
from tests.models.test_real_models import _installed

TEXTS = ["Héllo, naïve café — 東京で会いましょう 🎉🎉 and “quotes” ok", "  two  spaces\n\nnew lines\t tab",
         "emoji split: 👩‍👩‍👧‍👦 done", "plain ascii words only"]


def _streamed(tokenizer, ids):
    text = Detokenizer(tokenizer)
    pieces = [text.add(token) for token in ids] + [text.flush()]
    assert "".join(pieces) == text.text and text.length == len(text.text)
    return text


def _tokenizers():
    yield pytest.param("reference", id="reference")
    for name in ("smollm2", "gemma3-270m"):
        yield pytest.param(name, id=name, marks=pytest.mark.skipif(not _installed(name), reason=f"{name} absent"))


@pytest.fixture(scope="module", params=list(_tokenizers()))
def tokenizer(request):
    if request.param == "reference":
        return sparsegen.load("reference")[1]
    return AutoTokenizer.from_pretrained(checkpoint_folder(request.param))


@pytest.mark.heavy
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_decoding_all_at_once(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert _streamed(tokenizer, ids).text == tokenizer.decode(ids, skip_special_tokens=True)


def test_random_token_streams_equal_decoding_all_at_once(tokenizer):
    """Random ids include byte-fallback and partial-character tokens, in any order."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, len(tokenizer), (60,), generator=generator).tolist()
        assert _streamed(tokenizer, ids).text == tokenizer.decode(ids, skip_special_tokens=True)


def test_an_incomplete_character_is_held_back_until_it_completes():
    class Bytes:  # one token per UTF-8 byte, as a byte-level tokenizer may split a character
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    text = Detokenizer(Bytes())
    assert [text.add(b) for b in "é!".encode()] == ["", "é", "!"]
    assert [text.add(b) for b in b"\xff\xfe"] == ["", ""] and text.flush() == "\ufffd\ufffd"


def test_each_token_decodes_a_bounded_window(tokenizer):
    """O(1) per token: decode is asked about a few tokens however long the reply is."""
    longest = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            longest.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer(" ".join(TEXTS) * 20, add_special_tokens=False)["input_ids"]
    assert len(ids) > 400
    _streamed(Counting(), ids)
    assert max(longest) <= 10
