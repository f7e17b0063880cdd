"""Incremental detokenization and stop strings.

Text is emitted only once it is final: never half of a multi-byte character (a decode that ends
in U+FFFD waits for the next token) and never the first characters of what may turn out to be a
stop string (the last ``max(len(stop)) - 1`` characters are held back until they can't be).
"""

from __future__ import annotations

PROMPT_CONTEXT_TOKENS = 5  # a few prompt tokens before the output, for tokenizers whose spacing depends on them


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
        self.text = ""  # all final output text so far
        self.emitted = 0  # characters of self.text already streamed
        self.stopped_by: str | None = None

    def fresh(self) -> IncrementalDetokenizer:
        """A new detokenizer for the same prompt and stop strings (for a fork)."""
        return IncrementalDetokenizer(self.tokenizer, self._prompt_context, self.stop, self.include_stop)

    def _decode(self, ids: list[int]) -> str:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # a fast tokenizer: skip HF's wrapper
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int, emit_text: bool = True) -> None:
        """Appends one token; sets ``stopped_by`` when a stop string completes."""
        self.ids.append(token_id)
        if not emit_text:
            return
        prefix = self._prefix_text
        if prefix is None:  # NOTE: the same ids decode the same way: once per move of the offsets, not per token
            prefix = self._prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._prefix_text = None
        self._append(new)

    def _append(self, new: str) -> None:
        start = max(0, len(self.text) - self.hold)
        self.text += new
        for s in self.stop:
            at = self.text.find(s, start)
            if at >= 0 and (self.stopped_by is None or at < self._stop_at):
                self.stopped_by, self._stop_at = s, at
        if self.stopped_by is not None:
            end = self._stop_at + (len(self.stopped_by) if self.include_stop else 0)
            self.text = self.text[:end]

    def flush(self) -> None:
        """At the end of a request: whatever is still pending becomes final (even a broken character)."""
        if self.stopped_by is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            self.prefix_offset = self.read_offset = len(self.ids)
            self._prefix_text = None
            if len(full) > len(prefix):
                self._append(full[len(prefix):])

    def take(self, final: bool) -> str:
        """The text that became safe to stream since the last call."""
        end = len(self.text) if final or self.stopped_by is not None else max(self.emitted,
                                                                                len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
