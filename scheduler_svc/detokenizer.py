"""Incremental detokenization and stop strings.

Text is emitted only once it is final: never half of a multi-byte character (a decode that ends
in U+FFFD waits for the next token) and never the first characters of what may turn out to be a
stop string (the last ``max(len(stop)) - 1`` characters are held back until they can't be).

The rule (vLLM's): keep two offsets into the token ids. ``ids[prefix_offset:read_offset]`` is the
window of the text last emitted, ``ids[read_offset:]`` the tokens not emitted yet. On each token,
decode the window with and without them; what the longer decode adds is new text, unless it ends
in U+FFFD (an unfinished character) or adds nothing. Each step decodes a few tokens, never the
whole output.

Cost per token (the scheduler runs this for every running request every step): two decodes through
the tokenizer's Python binding. Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2, the built-in
tiny-llama) mostly skip them. Their decode is the UTF-8 decode (bad bytes as U+FFFD) of the tokens'
bytes joined, special tokens skipped, and UTF-8 starts afresh after each whole character, so when the
window's bytes end with a whole character -- always once text was emitted, as emitted text does not
end in U+FFFD -- the longer decode is the window's text followed by what the pending tokens decode to
alone:

- nothing pending but special tokens, and a token whose bytes are whole characters alone: what is
  added is that token's own text, ``decode([token])``, looked up once per token id (``_Pieces``)
  (this holds whatever the window ends with: broken bytes before a whole character are one U+FFFD
  with or without it);
- otherwise (a character split over byte tokens, a token that decodes to U+FFFD, an added token):
  the pending tokens' own decode, remembered per short run of ids (``_Pieces.run``: the bytes of one
  character, mostly), one decode the first time a run is seen.

Before anything was emitted the window is the prompt's last tokens, which may end mid-character: the
window is decoded once to find out, and the two decodes run until text is emitted.

Sentencepiece-style decoders (Llama 2, Mistral, Gemma: spaces as U+2581, byte fallback, one leading space
stripped from the whole text; or Metaspace) map one token at a time, except that the text's (or the first
token's) leading space is stripped and byte-fallback tokens merge into characters. So after a window whose
decode is not empty, a token that is not a byte adds what it adds after any other such window: its piece is
measured once after an anchor token (``decode([anchor, t])`` less ``decode([anchor])``). A character spelt in
byte-fallback tokens adds its bytes as UTF-8 once they are complete (``_Pieces.byte_run``), when the window's text
before it ends with a whole character (ByteFallback decodes the window's last bytes and the run's together, and
whole plus whole is whole). Added tokens and tokens whose text alone is empty take the two decodes. Any other
decoder always takes the two decodes.
tests/test_detokenizer.py checks the streamed text against the two-decode rule on random token
sequences. (``decode_batch`` over a step's requests was measured slower than one decode per request
for windows this short, so decodes are not batched.)

The final text is kept as ``_head`` (chunks already streamed that no stop search can reach) and
``_win`` (the rest), so appending and stop checks cost what the new text costs, not the output's
length; the ids before the window are dropped from ``ids`` now and then (at take).
"""

from __future__ import annotations

import json
import re
import weakref
from functools import partial

PROMPT_CONTEXT_TOKENS = 5  # a few prompt tokens before the output, for tokenizers whose spacing depends on them
COMPACT_CHARS = 256  # _win longer than this moves its streamed part into _head (at take)
MAX_RUN, MAX_RUNS = 8, 1 << 16  # _Pieces.run remembers runs of at most MAX_RUN tokens, MAX_RUNS of them

_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its _Pieces (or None)


class _Pieces(dict):
    """token id -> the text appending it appends when nothing is pending, filled on first use: ``""`` for a
    special token (decode skips it), None where only a real decode knows (a token that is not whole characters
    alone, an added or unknown token; for sentencepiece-style decoders also a byte-fallback token).

    Byte-level decoders (``anchor`` None): a token's text is ``decode([token])``. Sentencepiece-style decoders
    (``anchor``: a token whose text is one plain character): a token's text is what it adds after the anchor,
    ``decode([anchor, token])`` less ``decode([anchor])``; it holds after any window whose decode is not empty
    (the decoders that strip a leading space, Strip and Metaspace, strip it from the window's start)."""

    def __init__(self, backend, anchor: int | None = None, byte_fallback: bool = False) -> None:
        super().__init__()
        self.backend = backend
        self.anchor = anchor
        self.anchor_text = backend.decode([anchor], skip_special_tokens=True) if anchor is not None else ""
        added = backend.get_added_tokens_decoder()
        self.special = {i for i, t in added.items() if t.special}
        self.added = set(added)
        self.runs: dict[tuple[int, ...], str] = {}
        # sentencepiece-style with a ByteFallback decoder: byte-fallback token -> its byte
        self.bytes: dict[int, int] = {}
        if byte_fallback:
            for b in range(256):
                token = backend.token_to_id(f"<0x{b:02X}>")
                if token is not None and token not in added:
                    self.bytes[token] = b

    def __missing__(self, token):
        piece = None
        if token in self.special:
            piece = ""
        elif token not in self.added:
            try:
                name = self.backend.id_to_token(token)
                if name is None:
                    pass
                elif self.anchor is None:
                    piece = self.backend.decode([token], skip_special_tokens=True)
                elif not _BYTE_TOKEN.fullmatch(name):  # (byte-fallback bytes merge with their neighbours)
                    both = self.backend.decode([self.anchor, token], skip_special_tokens=True)
                    # (and its text alone, a window's once it was streamed, must not be empty: see _anchored)
                    if both.startswith(self.anchor_text) and self.backend.decode([token], skip_special_tokens=True):
                        piece = both[len(self.anchor_text):]
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
            b = self.bytes.get(token)
            if b is None:
                if token in self.special:
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
            return self.backend.decode(ids, skip_special_tokens=True)
        key = tuple(ids)
        text = self.runs.get(key)
        if text is None:
            text = self.backend.decode(ids, skip_special_tokens=True)
            if len(self.runs) < MAX_RUNS:
                self.runs[key] = text
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
    _Pieces), else None."""
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


def _new_table(backend) -> _Pieces | None:
    from tokenizers import decoders

    decoder = getattr(backend, "decoder", None)
    if isinstance(decoder, decoders.ByteLevel):
        return _Pieces(backend)
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
            return _Pieces(backend, anchor, byte_fallback="ByteFallback" in steps)
    return None


def _pieces_for(tokenizer, backend) -> _Pieces | None:
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


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prompt_context = list(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset] (changes with them)
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        # the final output text so far is "".join(_head) + _win; _win starts at character _base
        self._head: list[str] = []
        self._win = ""
        self._base = 0
        self.emitted = 0  # characters of the text already streamed
        self.stopped_by: str | None = None
        self._stop_at = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer: skip HF's wrapper
        if backend is not None:
            self._decode = partial(backend.decode, skip_special_tokens=True)
        else:
            self._decode = partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        self._pieces = _pieces_for(tokenizer, backend)
        self._plain = self._pieces is not None and not self.stop  # push() may take the common case
        # a piece is also its token's text alone, the window's text once the offsets moved past it (byte-level)
        self._piece_alone = self._pieces is not None and self._pieces.anchor is None
        self._clean: bool | None = None  # the window's bytes end with a whole character (None: not known yet)
        # The piece table says what the next token adds: nothing is pending (ids[read_offset:] decodes to nothing:
        # empty, or special tokens only), and for a sentencepiece-style table the window decodes to some text.
        self._run_after_text = False  # (sentencepiece-style) the pending byte run began after an anchored window
        self._fast = self._pieces is not None and self._anchored()

    def fresh(self) -> IncrementalDetokenizer:
        """A new detokenizer for the same prompt and stop strings (for a fork)."""
        return IncrementalDetokenizer(self.tokenizer, self._prompt_context, self.stop, self.include_stop)

    def replay(self, token_ids: list[int]) -> str:
        """Feeds tokens a stream already delivered (a resumed request: GenerateRequest.continuation) as the stream
        fed them, one ``add`` and ``take(False)`` each, so that the next token adds exactly what it would have added
        in an undisturbed run (text held back for a stop string or an unfinished character included). Returns the
        text streamed meanwhile; sets ``stopped_by`` when a stop string completes (the stream would have ended)."""
        streamed = []
        for token_id in token_ids:
            self.add(token_id)
            if self.stopped_by is not None:
                break
            streamed.append(self.take(False))
        return "".join(streamed)

    @property
    def text(self) -> str:
        """All final output text so far."""
        return "".join(self._head) + self._win if self._head else self._win

    def push(self, token_id: int) -> str | None:
        """``add(token_id)`` then ``take(False)`` in one call, for the common case: a tokenizer with a piece table,
        no stop strings (nothing held back), nothing pending, and a token whose text the table knows. Returns the
        text to stream now; None when the case does not hold, having done nothing (then add and take)."""
        if self._fast and self._plain:
            piece = self._pieces[token_id]
            if piece:
                ids = self.ids
                ids.append(token_id)
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                self._prefix_text = piece if self._piece_alone else None
                win = self._win = self._win + piece
                base = self._base
                out = win[self.emitted - base:]  # (what take would return: no hold, no stop string)
                self.emitted = base + len(win)
                if len(win) > COMPACT_CHARS:
                    self._compact(len(win))
                return out
        return None

    def add(self, token_id: int, emit_text: bool = True) -> None:
        """Appends one token; sets ``stopped_by`` when a stop string completes."""
        ids = self.ids
        ids.append(token_id)
        if self._fast:
            piece = self._pieces[token_id]
            if piece and emit_text:  # what the two decodes would add (see the module doc)
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                self._prefix_text = piece if self._piece_alone else None
                if self.stop:
                    self._append(piece)
                else:
                    self._win += piece
                return
            if piece == "":  # a special token: pending, and still nothing to decode
                return
        if not emit_text:
            self._fast = False
            return
        if self._piece_alone:  # (byte-level)
            if self._clean is None:
                self._clean = not self._window_text().endswith("\ufffd")
            if self._clean:  # the text adds what the pending tokens decode to alone (see the module doc)
                new = self._pieces.run(ids[self.read_offset:])
                if not new or new.endswith("\ufffd"):
                    self._fast = False
                    return
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                self._prefix_text = new
                self._fast = True
                self._append(new)
                return
        elif self._pieces is not None and self._pieces.bytes:  # (sentencepiece-style: a character as bytes)
            if self._fast:  # the run starts after a window with text that ends with a whole character
                self._run_after_text = True
            new = self._pieces.byte_run(ids[self.read_offset:])
            if new == "" and self._run_after_text:  # not complete yet: the two decodes would wait too
                self._fast = False
                return
            if new and self._run_after_text and not new.endswith("\ufffd"):
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                self._prefix_text = None  # (the run alone may decode otherwise: a leading space stripped)
                self._clean, self._run_after_text = True, False
                # (the run alone decodes to some text unless it is all spaces: one may be stripped)
                self._fast = not new.isspace() or self._anchored()
                self._append(new)
                return
            self._run_after_text = False
        prefix = self._window_text()
        full = self._decode(ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            self._fast = False
            return
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self._prefix_text = None
        self._clean = True
        self._fast = self._pieces is not None and self._anchored()
        self._append(new)

    def _anchored(self) -> bool:
        """Whether a table's piece is what a token adds after the window: always for a byte-level table; for a
        sentencepiece-style one when the window decodes to some text (a leading space is stripped from it) that
        ends with a whole character (bytes after it would merge with its last ones)."""
        if self._piece_alone:
            return True
        window = self._window_text()
        return bool(window) and not window.endswith("\ufffd")

    def _window_text(self) -> str:
        """The decode of ids[prefix_offset:read_offset]."""
        prefix = self._prefix_text
        if prefix is None:  # NOTE: the same ids decode the same way: once per move of the offsets, not per token
            prefix = self._prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        return prefix

    def _append(self, new: str) -> None:
        hold = self.hold
        if self._base and len(self._win) < hold:  # (only after a stop string cut the text) search it all
            self._unsplit()
        win, base = self._win, self._base
        start = max(0, len(win) - hold)
        win += new
        for s in self.stop:
            at = win.find(s, start)
            if at >= 0 and (self.stopped_by is None or base + at < self._stop_at):
                self.stopped_by, self._stop_at = s, base + at
        if self.stopped_by is not None:
            end = self._stop_at + (len(self.stopped_by) if self.include_stop else 0)
            win = win[:end - base]
        self._win = win

    def _unsplit(self) -> None:
        self._win, self._head, self._base = self.text, [], 0

    def flush(self) -> None:
        """At the end of a request: whatever is still pending becomes final (even a broken character)."""
        if self.stopped_by is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            self.prefix_offset = self.read_offset = len(self.ids)
            self._prefix_text = None
            self._clean = True  # (an empty window)
            self._run_after_text = False
            self._fast = self._pieces is not None and self._anchored()
            if len(full) > len(prefix):
                self._append(full[len(prefix):])

    def take(self, final: bool) -> str:
        """The text that became safe to stream since the last call."""
        win = self._win
        start = self.emitted - self._base  # (positions in _win from here on)
        if start < 0:  # (only after a stop string cut the text below what was streamed)
            self._unsplit()
            win, start = self._win, self.emitted
        end = len(win)
        if self.hold and not final and self.stopped_by is None:
            end -= self.hold
            if end < start:
                end = start
        out = win[start:end]
        self.emitted = self._base + end
        if end > COMPACT_CHARS:
            self._compact(end)
        return out

    def _compact(self, end: int) -> None:
        """Moves what no take or stop search reaches again (``_win`` up to ``end``, streamed) into _head, and
        forgets the ids before the window (none decodes them)."""
        win = self._win
        cut = min(end, len(win) - self.hold)
        if cut > 0:
            self._head.append(win[:cut])
            self._win = win[cut:]
            self._base += cut
        if self.prefix_offset > COMPACT_CHARS:
            del self.ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
