"""Incremental detokenization equals a full decode, including multi-byte characters."""

from __future__ import annotations

import random

import pytest

from pagellm.config import resolve_model_source
from pagellm.detokenizer import IncrementalDetokenizer, find_stop_string
from pagellm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(resolve_model_source(None))


TEXTS = ["Hello, world! Ünïcödé façade — naïve café.", "数学 は 楽しい 🙂🚀 emoji", "  leading spaces\n\ttabs",
         "def f(x):\n    return x ** 2  # comment"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Prompt text:", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [d.step([t]) for t in ids]
    assert "".join(pieces) == d.text == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_chunks_of_tokens_give_the_text_one_at_a_time_gives(tokenizer, text):
    """Several tokens in one step (a run of accepted drafts) emit what one at a time would: a
    multi-byte character cut at the chunk's end holds back only its own bytes."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    one = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    ref = [one.step([t]) for t in ids]
    rng = random.Random(1)
    for _ in range(10):
        d, i, pieces, cuts = IncrementalDetokenizer(tokenizer, [1, 2, 3]), 0, [], []
        while i < len(ids):
            n = rng.randint(2, 4)
            pieces.append(d.step(ids[i:i + n]))
            i += n
            cuts.append(i)
        assert "".join(pieces) == d.text == one.text
        # After each chunk, the text is what the single steps had emitted up to its last token.
        assert [len(p) for p in pieces] == [len("".join(ref[a:b])) for a, b in zip([0, *cuts], cuts, strict=False)]


def test_random_tokens_never_emit_broken_text(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(30)]
        d = IncrementalDetokenizer(tokenizer, [1, 2, 3])
        for t in ids:
            d.step([t])
        full = tokenizer.decode(ids)
        assert full.startswith(d.text.rstrip("\ufffd")) or d.text == full


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers_decode(tokenizer, skip_special_tokens):
    """The backend's decode, called directly, gives what ``transformers``' ``decode`` gives (the
    oracle): random ids, special tokens among them, one at a time and in runs."""
    assert tokenizer._decode is not None  # (the bundled tokenizer takes the direct call)
    rng = random.Random(2)
    special = sorted(tokenizer.hf.all_special_ids)
    for n in [1, 1, 2, 3, 7, 30, 200]:
        for _ in range(20):
            ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(tokenizer.vocab_size)
                   for _ in range(n)]
            assert tokenizer.decode(ids, skip_special_tokens) == tokenizer.hf.decode(
                ids, skip_special_tokens=skip_special_tokens)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tokenizer, monkeypatch):
    from pagellm.tokenizer import _backend_decode

    monkeypatch.setattr(tokenizer.hf, "clean_up_tokenization_spaces", True)
    assert _backend_decode(tokenizer.hf) is None


def test_find_stop_string():
    assert find_stop_string("abc STOP def", 8, ["STOP"], False) == ("STOP", 4)
    assert find_stop_string("abc STOP def", 8, ["STOP"], True) == ("STOP", 8)
    assert find_stop_string("abc STOP def", 2, ["STOP"], False) is None  # ended before the new text
    assert find_stop_string("xxSTyyST", 3, ["ST", "yy"], False) == ("yy", 4)
