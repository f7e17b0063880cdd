from __future__ import annotations

import pytest

from scheduler_svc.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def stream(tokenizer, text: str, stop=(), include=False):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer, [1], list(stop), include)
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.take(final=False))
        if d.stopped_by:
            break
    d.flush()
    pieces.append(d.take(final=True))
    return pieces, d


def test_multibyte_characters_never_split(tokenizer):
    text = "héllo wörld 你好 🎉!"
    pieces, _ = stream(tokenizer, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) > len(text)  # bytes, not characters


def test_stop_string_split_across_tokens_is_cut_and_never_streamed(tokenizer):
    pieces, d = stream(tokenizer, "abc STOP here", stop=["STOP"])
    assert d.stopped_by == "STOP"
    assert "".join(pieces) == "abc "
    assert not any("S" in p for p in pieces)  # the first letters of the stop string were held back


def test_stop_string_included_on_request(tokenizer):
    pieces, _ = stream(tokenizer, "abc STOP here", stop=["STOP"], include=True)
    assert "".join(pieces) == "abc STOP"


def test_earliest_stop_string_wins(tokenizer):
    pieces, d = stream(tokenizer, "one two three", stop=["three", "two"])
    assert d.stopped_by == "two" and "".join(pieces) == "one "


def test_broken_utf8_at_the_end_is_flushed_as_replacement(tokenizer):
    ids = tokenizer("é", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer, [1], [], False)
    d.add(ids[0])  # only the first byte of a two-byte character
    assert d.take(final=False) == ""
    d.flush()
    assert d.take(final=True) == "\ufffd"
