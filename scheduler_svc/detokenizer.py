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
window is decoded once to find out, and the two decodes run until text is emitted. Any other kind of
tokenizer (sentencepiece decoders strip and merge by context) always takes the two decodes.
tests/test_detokenizer.py checks the streamed text against the two-decode rule on random token
sequences. (``decode_batch`` over a step's requests was measured slower than one decode per request
for windows this short, so decodes are not batched.)

The final text is kept as ``_head`` (chunks already streamed that no stop search can reach) and
``_win`` (the rest), so appending and stop checks cost what the new text costs, not the output's
length; the ids before the window are dropped from ``ids`` now and then (at take).
"""

from __future__ import annotations

import weakref
from functools import partial

PROMPT_CONTEXT_TOKENS = 5  # a few prompt tokens before the output, for tokenizers whose spacing depends on them
COMPACT_CHARS = 256  # _win longer than this moves its streamed part into _head (at take)
MAX_RUN, MAX_RUNS = 8, 1 << 16  # _Pieces.run remembers runs of at most MAX_RUN tokens, MAX_RUNS of them

_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its _Pieces (or None)


class _Pieces(dict):
    """token id -> the text appending it appends when nothing is pending (a byte-level tokenizer), filled on
    first use: ``""`` for a special token (decode skips it), None where only a real decode knows (a token that
    is not whole characters alone, an added or unknown token)."""

    def __init__(self, backend) -> None:
        super().__init__()
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        self.special = {i for i, t in added.items() if t.special}
        self.added = set(added)
        self.runs: dict[tuple[int, ...], str] = {}

    def __missing__(self, token):
        piece = None
        if token in self.special:
            piece = ""
        elif token not in self.added:
            try:
                if self.backend.id_to_token(token) is not None:
                    piece = self.backend.decode([token], skip_special_tokens=True)
            except (OverflowError, TypeError, ValueError):
                pass
            if not piece or "\ufffd" in piece:
                piece = None
        self[token] = piece
        return piece

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


def _pieces_for(tokenizer, backend) -> _Pieces | None:
    """The piece table of a byte-level fast tokenizer (shared by its detokenizers), else None."""
    if backend is None:
        return None
    try:
        from tokenizers import decoders
    except ImportError:
        return None
    try:
        return _TABLES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: a table of its own
        return _Pieces(backend) if isinstance(getattr(backend, "decoder", None), decoders.ByteLevel) else None
    table = _Pieces(backend) if isinstance(getattr(backend, "decoder", None), decoders.ByteLevel) else None
    _TABLES[tokenizer] = table
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
        self._quiet = True  # ids[read_offset:] decodes to nothing (empty, or special tokens only)
        self._clean: bool | None = None  # the window's bytes end with a whole character (None: not known yet)

    def fresh(self) -> IncrementalDetokenizer:
        """A new detokenizer for the same prompt and stop strings (for a fork)."""
        return IncrementalDetokenizer(self.tokenizer, self._prompt_context, self.stop, self.include_stop)

    @property
    def text(self) -> str:
        """All final output text so far."""
        return "".join(self._head) + self._win if self._head else self._win

    def add(self, token_id: int, emit_text: bool = True) -> None:
        """Appends one token; sets ``stopped_by`` when a stop string completes."""
        ids = self.ids
        ids.append(token_id)
        if self._quiet and self._pieces is not None:
            piece = self._pieces[token_id]
            if piece and emit_text:  # what the two decodes would add (see the module doc)
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                self._prefix_text = piece
                if self.stop:
                    self._append(piece)
                else:
                    self._win += piece
                return
            if piece == "":  # a special token: pending, and still nothing to decode
                return
        if not emit_text:
            self._quiet = False
            return
        if self._pieces is not None:
            if self._clean is None:
                self._clean = not self._window_text().endswith("\ufffd")
            if self._clean:  # the text adds what the pending tokens decode to alone (see the module doc)
                new = self._pieces.run(ids[self.read_offset:])
                if not new or new.endswith("\ufffd"):
                    self._quiet = False
                    return
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                self._prefix_text = new
                self._quiet = True
                self._append(new)
                return
        prefix = self._window_text()
        full = self._decode(ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            self._quiet = False
            return
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self._prefix_text = None
        self._quiet = self._clean = True
        self._append(new)

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
            self._quiet = self._clean = True  # (an empty window)
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
        if end > COMPACT_CHARS:  # move what no take or stop search reaches again into _head
            cut = min(end, len(win) - self.hold)
            if cut > 0:
                self._head.append(win[:cut])
                self._win = win[cut:]
                self._base += cut
            if self.prefix_offset > COMPACT_CHARS:  # and forget the ids before the window (none decodes them)
                del self.ids[:self.prefix_offset]
                self.read_offset -= self.prefix_offset
                self.prefix_offset = 0
        return out
