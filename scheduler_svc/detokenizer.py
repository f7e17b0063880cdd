"""Incremental detokenization and stop strings.

Text is emitted only once it is final: never half of a multi-byte character (a decode that ends
in U+FFFD waits for the next token) and never the first characters of what may turn out to be a
stop string (the last ``max(len(stop)) - 1`` characters are held back until they can't be).

The rule (vLLM's): keep two offsets into the token ids. ``ids[prefix_offset:read_offset]`` is the
window of the text last emitted, ``ids[read_offset:]`` the tokens not emitted yet. On each token,
decode the window with and without them; what the longer decode adds is new text, unless it ends
in U+FFFD (an unfinished character) or adds nothing. Each step decodes a few tokens, never the
whole output.

Cost per token (the scheduler runs this for every running request every step): two decodes through the
tokenizer's Python binding, which most tokens skip: what a token adds is looked up in a table of its tokenizer's
pieces (detok_pieces.py) when that table knows.

The final text is kept as ``_head`` (chunks already streamed that no stop search can reach) and
``_win`` (the rest), so appending and stop checks cost what the new text costs, not the output's
length; the ids before the window are dropped from ``ids`` now and then (at take).
"""

from __future__ import annotations

from functools import partial

from scheduler_svc.detok_pieces import pieces_for

PROMPT_CONTEXT_TOKENS = 5  # a few prompt tokens before the output, for tokenizers whose spacing depends on them
COMPACT_CHARS = 256  # _win longer than this moves its streamed part into _head (at take)


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
        self._pieces = pieces_for(tokenizer, backend)
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
        elif self._pieces is not None and self._pieces.has_byte_tokens:  # (sentencepiece-style: a character as bytes)
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
