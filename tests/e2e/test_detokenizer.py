from __future__ import annotations

import pytest

from scheduler_svc.detokenizer import COMPACT_CHARS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer

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

class ReferenceDetokenizer:
    def __init__(self, tokenizer, prompt_ids, stop, include_stop):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text, self.emitted, self.stopped_by = "", 0, None

    def _decode(self, ids):
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id, emit_text=True):
        self.ids.append(token_id)
        if not emit_text:
            return
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._append(full[len(prefix):])

    def _append(self, new):
        start = max(0, len(self.text) - self.hold)
        self.text += new
        for s in self.stop:
            at = self.text.find(s, start)
            if at >= 0 and (self.stopped_by is None or at < self._stop_at):
                self.stopped_by, self._stop_at = s, at
        if self.stopped_by is not None:
            self.text = self.text[:self._stop_at + (len(self.stopped_by) if self.include_stop else 0)]

    def flush(self):
        if self.stopped_by is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            self.prefix_offset = self.read_offset = len(self.ids)
            if len(full) > len(prefix):
                self._append(full[len(prefix):])

    def take(self, final):
        end = len(self.text) if final or self.stopped_by is not None else max(self.emitted,
                                                                                len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


class Wrapped:
    """What the detokenizer asks of a fast tokenizer: its backend."""

    def __init__(self, backend):
        self.backend_tokenizer = backend


class DecodeOnly:
    """A tokenizer without a backend (decode only): every token a letter, 0 skipped as special."""

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i == 0))


def byte_level_bpe():
    """A byte-level BPE vocabulary with what the piece table must tell apart: whole characters, parts of one, a
    token that ends or starts mid-character, a literal U+FFFD, special and added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    from pagedkv.tools.random_model import SPECIAL_TOKENS, byte_to_char

    b2c = byte_to_char()
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[b2c[b]] = len(vocab)
    for w in ["he", "llo", " world", "你", "你".encode()[:2], "é", b"a" + "é".encode()[:1], "é".encode()[1:] + b"x",
              "\ufffd", "好的", "STOP", " ST", "OP"]:
        vocab.setdefault("".join(b2c[b] for b in (w.encode() if isinstance(w, str) else w)), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<|im_end|>")])
    tok.add_tokens([AddedToken("<tool>", special=False)])
    return Wrapped(tok)


def sentencepiece_style(decoder: str = "llama2"):
    """A sentencepiece-style vocabulary (spaces as ▁, byte fallback; pieces of only a space, a letter that is
    also a byte, a stop string over pieces) with one of the decoders released checkpoints use: Llama 2 / Mistral
    (one leading space stripped from the whole text), Gemma (nothing stripped), Metaspace (the first token's
    leading ▁ stripped)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for w in ["▁", "▁hello", "▁wor", "ld", "▁STOP", "S", "T", "O", "P", "你", "▁é", "▁▁", "a", "▁a"]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = {
        "llama2": decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)]),
        "gemma": decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
        "metaspace": decoders.Metaspace(replacement="▁", prepend_scheme="always"),
        "right-strip": decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 0, 1)]),
    }[decoder]
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>")])
    tok.add_tokens([AddedToken("<tool>", special=False)])
    return Wrapped(tok)


TOKENIZERS = {"tiny-llama": None, "byte-level-bpe": byte_level_bpe, "sentencepiece-style": sentencepiece_style,
              "gemma-style": lambda: sentencepiece_style("gemma"),
              "metaspace": lambda: sentencepiece_style("metaspace"), "decode-only": DecodeOnly}


@pytest.fixture(scope="module")
def tokenizers(tiny_llama_dir):
    from scheduler_svc.tokenizer import load_tokenizer

    made = {name: make() for name, make in TOKENIZERS.items() if make is not None}
    made["tiny-llama"] = load_tokenizer(tiny_llama_dir)
    return made


def _interesting_ids(tok) -> list[int]:
    """Ids worth drawing often: specials, ASCII, UTF-8 lead and continuation bytes, the merged tokens."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return list(range(8))
    size = backend.get_vocab_size()
    ascii_ids = [backend.token_to_id(c) for c in "a STOP!é"]
    picked = [0, 1, 2, *[i for i in ascii_ids if i is not None], *range(259, size)]
    lead_and_continuation = [3 + b for b in (0xC3, 0xA9, 0xE4, 0xBD, 0xA0, 0x80, 0xFF, 0xEF, 0xBF)]
    return sorted({i for i in picked + lead_and_continuation if i < size})


def run_both(tok, prompt, tokens, stop, include, stop_ids, takes, keep_going, flush, push=False):
    """Feeds both detokenizers the same calls (as OutputProcessor does); the streamed pieces of each. With
    ``push``, the new one takes an add followed by take(final=False) as push() where push takes it."""
    new, ref = IncrementalDetokenizer(tok, prompt, stop, include), ReferenceDetokenizer(tok, prompt, stop, include)
    streams = ([], [])
    for i, t in enumerate(tokens):
        for d, out in zip((new, ref), streams):
            take = takes[i % len(takes)]
            if push and d is new and take == 1 and t not in stop_ids:
                text = d.push(t)
                if text is not None:
                    out.append(text)
                    continue
            d.add(t, emit_text=t not in stop_ids)
            if take == 3:  # (a flush before the end: nothing does that, but the two must agree on it too)
                d.flush()
            if take:
                out.append(d.take(final=take == 2))
        assert new.stopped_by == ref.stopped_by
        if not keep_going and (t in stop_ids or new.stopped_by):
            break
    for d, out in zip((new, ref), streams):
        if flush:
            d.flush()
        out.append(d.take(final=True))
    assert new.text == ref.text
    return streams


def _case(draw, tok):
    from hypothesis import strategies as st

    backend = getattr(tok, "backend_tokenizer", None)
    size = backend.get_vocab_size() if backend is not None else 40
    ids = st.one_of(st.sampled_from(_interesting_ids(tok)), st.integers(0, size - 1))
    chars = st.sampled_from(["a", " ", "S", "T", "O", "P", "é", "你", "\ufffd", "l", "o", "!", "x"])
    return dict(
        prompt=draw(st.lists(ids, max_size=7)),
        tokens=draw(st.lists(ids, max_size=60)),
        stop=draw(st.lists(st.text(chars, max_size=4), max_size=3)),
        include=draw(st.booleans()),
        stop_ids=set(draw(st.lists(ids, max_size=2))),
        takes=draw(st.lists(st.sampled_from([0, 1, 1, 1, 2, 3]), min_size=1, max_size=4)),
        keep_going=draw(st.booleans()),
        flush=draw(st.booleans()),
        push=draw(st.booleans()),
    )


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
