"""The detokenizer's oracle (tests/e2e/test_detokenizer.py): ReferenceDetokenizer is the rule as it stood before the
piece table (two decodes per token, whole text kept); the tokenizers it is checked with (byte-level BPE,
sentencepiece-style with the decoders released checkpoints use, one that only decodes); both detokenizers fed the
same calls; and random cases for hypothesis."""

from __future__ import annotations

from scheduler_svc.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer


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


def interesting_ids(tok) -> list[int]:
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


def draw_case(draw, tok):
    from hypothesis import strategies as st

    backend = getattr(tok, "backend_tokenizer", None)
    size = backend.get_vocab_size() if backend is not None else 40
    ids = st.one_of(st.sampled_from(interesting_ids(tok)), st.integers(0, size - 1))
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
