"""The scheduler's incremental detokenizer (scheduler_svc/detokenizer.py): multi-byte characters never split, stop
strings cut and never streamed (or included on request), broken UTF-8 flushed as U+FFFD; the piece table streams
exactly what the two decodes stream (against tests/support/detokenizer_reference.py, for six tokenizers); and a
resumed stream's replay goes on exactly."""

from __future__ import annotations

import pytest

from scheduler_svc.detokenizer import COMPACT_CHARS, IncrementalDetokenizer
from tests.support.detokenizer_reference import TOKENIZERS, ReferenceDetokenizer, run_both, sentencepiece_style
from tests.support.detokenizer_reference import draw_case as _case

pytestmark = pytest.mark.e2e  # in-process, but about 15 s here (property runs, six tokenizers): over the unit budget


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


# ---- the piece table streams exactly what the two decodes stream ------------------------------------------------
# ReferenceDetokenizer is the rule as it stood before the piece table (two decodes per token, whole text kept):
# on random token sequences the detokenizer must stream the same pieces, stop on the same string and end with the
# same text, for byte-level tokenizers (the piece table) and others (the two decodes alone).

@pytest.fixture(scope="module")
def tokenizers(tiny_llama_dir):
    from scheduler_svc.tokenizer import load_tokenizer

    made = {name: make() for name, make in TOKENIZERS.items() if make is not None}
    made["tiny-llama"] = load_tokenizer(tiny_llama_dir)
    return made


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_streams_exactly_what_the_two_decodes_stream(tokenizers, name):
    from unittest import mock

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from scheduler_svc import detokenizer

    tok = tokenizers[name]

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(st.data(), st.sampled_from([0, 3, detokenizer.COMPACT_CHARS]))
    def check(data, compact):
        case = _case(data.draw, tok)
        with mock.patch.object(detokenizer, "COMPACT_CHARS", compact):
            new, ref = run_both(tok, **case)
        assert new == ref

    check()


def test_the_piece_table_is_used_for_byte_level_and_sentencepiece_style_decoders_only(tokenizers):
    for name in ("tiny-llama", "byte-level-bpe", "sentencepiece-style", "gemma-style", "metaspace"):
        assert IncrementalDetokenizer(tokenizers[name], [1], [], False)._pieces is not None, name
    assert IncrementalDetokenizer(tokenizers["decode-only"], [1], [], False)._pieces is None
    # a right strip changes what the last token adds (not in the oracle test: tokenizers 0.23 panics decoding it)
    assert IncrementalDetokenizer(sentencepiece_style("right-strip"), [1], [], False)._pieces is None


@pytest.mark.parametrize("name", ["sentencepiece-style", "gemma-style", "metaspace"])
def test_sentencepiece_style_pieces_skip_the_decodes(tokenizers, name):
    """Words after a window with text take the table (no decode); a byte-fallback character still decodes."""
    tok = tokenizers[name]
    backend = tok.backend_tokenizer
    ids = [backend.token_to_id(w) for w in ["▁hello", "▁wor", "ld", "▁a", "a", "▁é"]]
    d = IncrementalDetokenizer(tok, [1, backend.token_to_id("▁hello")], [], False)
    calls = []
    d._decode = lambda ids, _real=d._decode: calls.append(list(ids)) or _real(ids)
    pieces = [d.push(t) for t in ids]
    assert None not in pieces and not calls
    assert "".join(pieces) == backend.decode([1, ids[0], *ids], skip_special_tokens=True)[len(
        backend.decode([1, ids[0]], skip_special_tokens=True)):]
    assert d.push(3 + 0xE4) is None  # a byte: the two decodes


def test_long_outputs_keep_a_short_window(tokenizers):
    """Appending and stop checks cost the new text, not the output so far: the searched window stays short."""
    tok = tokenizers["tiny-llama"]
    ids = tok("the quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, [1], ["STOP"], False)
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.take(final=False))
    d.flush()
    pieces.append(d.take(final=True))
    assert "".join(pieces) == d.text == "the quick brown fox jumps over the lazy dog. " * 40
    assert len(d._win) <= 2 * COMPACT_CHARS and len(d.ids) <= 2 * COMPACT_CHARS
    plain = IncrementalDetokenizer(tok, [1], [], False)  # no stop strings: push() takes nearly every token
    pieces = [plain.push(t) for t in ids]
    assert pieces.count(None) <= 1  # (the first: the window was not known to end with a whole character)
    assert len(plain._win) <= 2 * COMPACT_CHARS and len(plain.ids) <= 2 * COMPACT_CHARS


@pytest.mark.parametrize("name", ["tiny-llama", "byte-level-bpe"])
def test_a_flush_in_the_middle_of_a_character(tokenizers, name):
    """After a flush streams half a character as U+FFFD, the rest of it decodes as the two decodes decode it."""
    tok = tokenizers[name]
    lead, *rest = tok.backend_tokenizer.encode("你", add_special_tokens=False).ids if name == "tiny-llama" else [
        3 + 0xE4, 3 + 0xBD, 3 + 0xA0]
    calls = [("add", lead), ("flush", None), *[("add", t) for t in rest], ("add", 3 + ord("A")), ("flush", None)]
    new, ref = IncrementalDetokenizer(tok, [1], [], False), ReferenceDetokenizer(tok, [1], [], False)
    for d in (new, ref):
        for op, t in calls:
            d.add(t) if op == "add" else d.flush()
    assert new.text == ref.text and new.take(final=True) == ref.take(final=True)


# ---- a resumed stream (GenerateRequest.continuation) --------------------------------------------------------------
def _stream_as_served(d: IncrementalDetokenizer, tokens: list[int]) -> list[str]:
    """What OutputProcessor.on_token streams for tokens that end nothing: push, else add then take."""
    pieces = []
    for t in tokens:
        text = d.push(t)
        if text is None:
            d.add(t)
            if d.stopped_by is not None:
                break
            text = d.take(final=False)
        pieces.append(text)
    return pieces


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_replayed_stream_goes_on_exactly(tokenizers, name):
    """A detokenizer that replayed the first k tokens a client received streams, for the tokens after them, exactly
    what the undisturbed one streamed (no character duplicated or lost: a multi-byte character split across the cut,
    text held back for a stop string), and its replay returns the text the client had."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tok = tokenizers[name]

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(st.data())
    def check(data):
        case = _case(data.draw, tok)
        prompt, tokens, stop, include = case["prompt"], case["tokens"], case["stop"], case["include"]
        whole = IncrementalDetokenizer(tok, prompt, stop, include)
        pieces = _stream_as_served(whole, tokens)
        done = len(pieces)  # tokens streamed before a stop string ended it (all of them otherwise)
        cut = data.draw(st.integers(0, done))
        resumed = IncrementalDetokenizer(tok, prompt, stop, include)
        assert resumed.replay(tokens[:cut]) == "".join(pieces[:cut]) and resumed.stopped_by is None
        assert _stream_as_served(resumed, tokens[cut:]) == pieces[cut:]
        assert resumed.stopped_by == whole.stopped_by
        for d in (whole, resumed):
            d.flush()
        assert resumed.take(final=True) == whole.take(final=True) and resumed.text == whole.text

    check()


def test_a_replay_that_completes_a_stop_string_says_so(tokenizers):
    tok = tokenizers["tiny-llama"]
    ids = tok("abc STOP here", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, [1], ["STOP"], False)
    assert d.replay(ids) == "abc " and d.stopped_by == "STOP"
