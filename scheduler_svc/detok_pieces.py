"""What one token adds to a stream's text, per tokenizer: the piece tables of incremental detokenization
(detokenizer.py), which let most tokens skip the two decodes.

Cost per token (the scheduler runs this for every running request every step): two decodes through
the tokenizer's Python binding. Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2, the built-in
tiny-llama) mostly skip them. Their decode is the UTF-8 decode (bad bytes as U+FFFD) of the tokens'
bytes joined, special tokens skipped, and UTF-8 starts afresh after each whole character, so when the
window's bytes end with a whole character -- always once text was emitted, as emitted text does not
end in U+FFFD -- the longer decode is the window's text followed by what the pending tokens decode to
alone:

- nothing pending but special tokens, and a token whose bytes are whole characters alone: what is
  added is that token's own text, ``decode([token])``, looked up once per token id (``Pieces``)
  (this holds whatever the window ends with: broken bytes before a whole character are one U+FFFD
  with or without it);
- otherwise (a character split over byte tokens, a token that decodes to U+FFFD, an added token):
  the pending tokens' own decode, remembered per short run of ids (``Pieces.run``: the bytes of one
  character, mostly), one decode the first time a run is seen.

Before anything was emitted the window is the prompt's last tokens, which may end mid-character: the
window is decoded once to find out, and the two decodes run until text is emitted.

Sentencepiece-style decoders (Llama 2, Mistral, Gemma: spaces as U+2581, byte fallback, one leading space
stripped from the whole text; or Metaspace) map one token at a time, except that the text's (or the first
token's) leading space is stripped and byte-fallback tokens merge into characters. So after a window whose
decode is not empty, a token that is not a byte adds what it adds after any other such window: its piece is
measured once after an anchor token (``decode([anchor, t])`` less ``decode([anchor])``). A character spelt in
byte-fallback tokens adds its bytes as UTF-8 once they are complete (``Pieces.byte_run``), when the window's text
before it ends with a whole character (ByteFallback decodes the window's last bytes and the run's together, and
whole plus whole is whole). Added tokens and tokens whose text alone is empty take the two decodes. Any other
decoder always takes the two decodes.
tests/e2e/test_detokenizer.py checks the streamed text against the two-decode rule on random token
sequences. (``decode_batch`` over a step's requests was measured slower than one decode per request
for windows this short, so decodes are not batched.)
"""

from __future__ import annotations

import json
import re
import weakref

MAX_RUN, MAX_RUNS = 8, 1 << 16  # Pieces.run remembers runs of at most MAX_RUN tokens, MAX_RUNS of them

_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its Pieces (or None)


class Pieces(dict):
    """token id -> the text appending it appends when nothing is pending, filled on first use: ``""`` for a
    special token (decode skips it), None where only a real decode knows (a token that is not whole characters
    alone, an added or unknown token; for sentencepiece-style decoders also a byte-fallback token).

    Byte-level decoders (``anchor`` None): a token's text is ``decode([token])``. Sentencepiece-style decoders
    (``anchor``: a token whose text is one plain character): a token's text is what it adds after the anchor,
    ``decode([anchor, token])`` less ``decode([anchor])``; it holds after any window whose decode is not empty
    (the decoders that strip a leading space, Strip and Metaspace, strip it from the window's start)."""

    def __init__(self, backend, anchor: int | None = None, byte_fallback: bool = False) -> None:
        super().__init__()
        self._backend = backend
        self._anchor = anchor
        self._anchor_text = backend.decode([anchor], skip_special_tokens=True) if anchor is not None else ""
        added = backend.get_added_tokens_decoder()
        self._special = {i for i, t in added.items() if t.special}
        self._added = set(added)
        self._runs: dict[tuple[int, ...], str] = {}
        # sentencepiece-style with a ByteFallback decoder: byte-fallback token -> its byte
        self._bytes: dict[int, int] = {}
        if byte_fallback:
            for b in range(256):
                token = backend.token_to_id(f"<0x{b:02X}>")
                if token is not None and token not in added:
                    self._bytes[token] = b

    @property
    def anchor(self) -> int | None:
        """The anchor token (None: a byte-level table)."""
        return self._anchor

    @property
    def has_byte_tokens(self) -> bool:
        """Sentencepiece-style with byte-fallback tokens (``byte_run`` knows their characters)."""
        return bool(self._bytes)

    def __missing__(self, token):
        piece = None
        if token in self._special:
            piece = ""
        elif token not in self._added:
            try:
                name = self._backend.id_to_token(token)
                if name is None:
                    pass
                elif self._anchor is None:
                    piece = self._backend.decode([token], skip_special_tokens=True)
                elif not _BYTE_TOKEN.fullmatch(name):  # (byte-fallback bytes merge with their neighbours)
                    both = self._backend.decode([self._anchor, token], skip_special_tokens=True)
                    # (and its text alone, a window's once it was streamed, must not be empty: see _anchored)
                    if both.startswith(self._anchor_text) and self._backend.decode([token], skip_special_tokens=True):
                        piece = both[len(self._anchor_text):]
            except (OverflowError, TypeError, ValueError):
                pass
            if not piece or "\ufffd" in piece:
                piece = None
        self[token] = piece
        return piece

    def byte_run(self, ids: list[int]) -> str | None:
        """Sentencepiece-style: the text a run of byte-fallback tokens (special tokens skipped) adds after a window
        whose text ends with a whole character: their bytes as UTF-8 (ByteFallback decodes the run with the
        window's whole bytes before it, and whole plus whole is whole). '' while the last character is not
        complete; None when the run holds another token, or bytes that are not UTF-8."""
        data = bytearray()
        for token in ids:
            b = self._bytes.get(token)
            if b is None:
                if token in self._special:
                    continue
                return None
            data.append(b)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            return "" if err.reason == "unexpected end of data" else None

    def run(self, ids: list[int]) -> str:
        """What ``ids`` decode to, remembered for short runs (the bytes of one character, mostly)."""
        if len(ids) > MAX_RUN:
            return self._backend.decode(ids, skip_special_tokens=True)
        key = tuple(ids)
        text = self._runs.get(key)
        if text is None:
            text = self._backend.decode(ids, skip_special_tokens=True)
            if len(self._runs) < MAX_RUNS:
                self._runs[key] = text
        return text


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
ANCHORS = ("a", "e", "x", "A", "0")  # a sentencepiece table's anchor: the first of these (else of the vocabulary)
# that decodes alone to itself, one character
# Sentencepiece-style decoder steps (tokenizers' serialized names): before a Fuse, maps of one token at a time (the
# first token's leading space stripped by Metaspace); after it, only left strips of the whole text.
_PER_TOKEN_STEPS = {"Replace", "ByteFallback", "Metaspace", "Strip"}
_AFTER_FUSE_STEPS = {"Metaspace", "Strip"}


def _sentencepiece_steps(decoder) -> list[str] | None:
    """The decoder's steps if a token's text is the same after any window whose decode is not empty (see
    Pieces), else None."""
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
    fused = False
    for step in steps:
        kind = step.get("type")
        if kind == "Strip" and step.get("stop", 0):  # (a right strip changes the end: the new token's text)
            return None
        if kind == "Replace" and "String" not in step.get("pattern", {}):
            return None
        if kind == "Fuse" and not fused:
            fused = True
        elif kind not in (_AFTER_FUSE_STEPS if fused else _PER_TOKEN_STEPS):
            return None
    return [step.get("type") for step in steps] or None


def _new_table(backend) -> Pieces | None:
    from tokenizers import decoders

    decoder = getattr(backend, "decoder", None)
    if isinstance(decoder, decoders.ByteLevel):
        return Pieces(backend)
    steps = _sentencepiece_steps(decoder) if decoder is not None else None
    if steps is None:
        return None
    added = backend.get_added_tokens_decoder()

    def plain(token: int | None) -> bool:  # one character, not a space, decoded alone
        if token is None or token in added or _BYTE_TOKEN.fullmatch(backend.id_to_token(token) or ""):
            return False
        text = backend.decode([token], skip_special_tokens=True)
        return len(text) == 1 and not text.isspace() and text != "\ufffd"
    candidates = [backend.token_to_id(text) for text in ANCHORS]
    for anchor in (*candidates, *sorted(backend.get_vocab().values())):  # (the vocabulary only if none of those)
        if plain(anchor):
            return Pieces(backend, anchor, byte_fallback="ByteFallback" in steps)
    return None


def pieces_for(tokenizer, backend) -> Pieces | None:
    """The piece table of a fast tokenizer with a byte-level or a sentencepiece-style decoder (shared by its
    detokenizers), else None."""
    if backend is None:
        return None
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return None
    try:
        return _TABLES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: a table of its own
        return _new_table(backend)
    table = _TABLES[tokenizer] = _new_table(backend)
    return table
