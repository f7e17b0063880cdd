"""Structured outputs on the executor: constraints compiled against the model's vocabulary (xgrammar), cached, and
one matcher per constrained request, next to the sampler.

NOTE: the matcher lives here, not on the scheduler: the token bitmask (a bit per vocabulary entry, 6 KiB a row at
49k tokens) never crosses the wire, and the matcher advances with each sampled token as the executor appends it,
so it is right one step ahead under async scheduling too. A request sent in full (``NewRequest``: first admission,
or again after recompute, swap-in, migration, a rejected plan or a resume) gets a fresh matcher that replays the
output tokens the plan carries (``GrammarEngine.state``): the state is a function of the tokens so far, nothing
else, so it is rebuilt exactly wherever the request goes.

Compilation: ``GrammarEngine`` compiles on its own threads (xgrammar releases the GIL while it compiles) and caches
each compiled grammar by its constraint (the tokenizer is the executor's own). The scheduler asks for it before
it places a request (``CheckConstraint``: an invalid constraint or one that compiles longer than the bound is
refused there, before anything runs), so a plan finds it in the cache. A plan that does not (this executor
started after the request was checked, or the cache let it go) compiles it before its step runs, bounded by the
same timeout.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch

from executor_svc.grammar_mask import GrammarMask
from pagedkv.executor.v1 import executor_pb2 as pb

FIELD = "sampling.constraint"
DEFAULT_COMPILE_TIMEOUT = 5.0  # seconds (--grammar-compile-timeout)
CACHE_BYTES = 512 << 20  # compiled grammars kept, by xgrammar's own size figure (least recently used go first)
TOO_SLOW_KEPT = 1024  # constraints remembered as too slow to compile (refused at once when they come again)
# NOTE: xgrammar 0.2.9's length-bounded JSON string rule (minLength/maxLength) lets control characters through,
# which JSON forbids inside strings (its unbounded rule excludes them): the converted grammar is patched.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


class ConstraintError(Exception):
    """A constraint the executor cannot use: invalid, or too slow to compile. The message names the field."""


Key = tuple[str, str, bool]


def constraint_key(c: pb.Constraint) -> Key:
    """What identifies a compiled grammar: the constraint's kind, its text and strict (not its end tokens, which
    each request's matcher sets)."""
    kind = c.WhichOneof("kind")
    if kind is None:
        raise ConstraintError(f"{FIELD}: no kind set (json_schema, json_object, regex, choice or grammar)")
    text = json.dumps(list(c.choice.choices), ensure_ascii=False) if kind == "choice" else \
        "" if kind == "json_object" else getattr(c, kind)
    return kind, text, c.strict and kind == "json_schema"


def _xgrammar():
    """The xgrammar module, or ConstraintError saying it is not installed (a checkout installed without the
    Makefile: structured outputs are then refused with that message; everything else runs)."""
    try:
        import xgrammar
    except ImportError as e:
        raise ConstraintError(f"{FIELD}: structured outputs need xgrammar, which this executor lacks ({e}); "
                              "install it with `pip install --no-deps xgrammar==0.2.9`") from None
    return xgrammar


def build_grammar(key: Key):
    """The xgrammar Grammar of a constraint (no vocabulary needed yet); ConstraintError naming the field."""
    xgr = _xgrammar()

    kind, text, strict = key
    field = f"{FIELD}.{kind}"
    try:
        if kind in ("json_schema", "json_object"):
            schema = text if kind == "json_schema" else '{"type": "object"}'
            converted = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
            return xgr.Grammar.from_ebnf(converted.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            if not choices or not all(choices):
                raise ConstraintError(f"{field}: give at least one choice, none empty")
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        return xgr.Grammar.from_ebnf(text)
    except ConstraintError:
        raise
    except Exception as err:  # noqa: BLE001 -- xgrammar's parse errors (RuntimeError, ValueError, InvalidJSONError)
        raise ConstraintError(f"{field}: not usable: {_xgrammar_message(err)}") from None


def _xgrammar_message(err: Exception) -> str:
    """xgrammar's error without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:94: Check failed: ... is false:")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(err).strip())
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)[:500]


class GrammarState:
    """One request's matcher: the grammar's state after the tokens it accepted."""

    __slots__ = ("matcher",)

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    @property
    def terminated(self) -> bool:
        """It accepted an end token: nothing follows (a step planned one ahead samples the row unconstrained;
        the scheduler ended the request on that token and drops what comes after)."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)


class GrammarEngine:
    """The executor's constraint compiler and cache, for one model's vocabulary. ``tokenizer_dir`` holds the
    tokenizer (the model's directory); ``vocab_size`` is the width of the model's logits."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, compile_timeout: float = DEFAULT_COMPILE_TIMEOUT,
                 threads: int = 2, cache_bytes: int = CACHE_BYTES) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self.cache_bytes = cache_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[Key, object] = OrderedDict()  # key -> CompiledGrammar (most recent last)
        self._cached_bytes = 0
        self._compiling: dict[Key, Future] = {}
        self._too_slow: OrderedDict[Key, None] = OrderedDict()
        self._bitmask: torch.Tensor | None = None  # [rows, words] int32, reused step after step
        self._compiler = self._pool.submit(self._load, Path(tokenizer_dir), threads)  # (off the loop: ~0.5 s)

    def _load(self, path: Path, threads: int):
        xgr = _xgrammar()
        from transformers import AutoTokenizer

        info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(path), vocab_size=self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- compiling -------------------------------------------------------------------------------------
    def cached(self, c: pb.Constraint) -> bool:
        with self._lock:
            return constraint_key(c) in self._cache

    def submit(self, c: pb.Constraint) -> Future:
        """The compiled grammar of ``c``, as a future: done at once when cached, else compiling on the engine's
        threads (one compile per constraint however many ask)."""
        key = constraint_key(c)
        with self._lock:
            if key in self._too_slow:
                done: Future = Future()
                done.set_exception(self._too_slow_error(key))
                return done
            if key in self._cache:
                self._cache.move_to_end(key)
                done = Future()
                done.set_result(self._cache[key])
                return done
            running = self._compiling.get(key)
            if running is None:
                running = self._compiling[key] = self._pool.submit(self._compile, key)
            return running

    def _compile(self, key: Key):
        try:
            try:
                compiler = self._compiler.result()
            except Exception as err:  # noqa: BLE001 -- no xgrammar, or the tokenizer would not load
                raise ConstraintError(f"{FIELD}: this executor cannot compile constraints: {err}") from None
            started = time.perf_counter()
            compiled = compiler.compile_grammar(build_grammar(key))
            took = time.perf_counter() - started
            with self._lock:
                if took > self.compile_timeout:
                    self._remember_too_slow(key)
                    raise self._too_slow_error(key)
                self._cache[key] = compiled
                self._cached_bytes += compiled.memory_size_bytes
                while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.memory_size_bytes
            return compiled
        finally:
            with self._lock:
                self._compiling.pop(key, None)

    def _remember_too_slow(self, key: Key) -> None:
        self._too_slow[key] = None
        while len(self._too_slow) > TOO_SLOW_KEPT:
            self._too_slow.popitem(last=False)

    def _too_slow_error(self, key: Key) -> ConstraintError:
        return ConstraintError(f"{FIELD}.{key[0]}: compiling it takes longer than the executor's limit of "
                               f"{self.compile_timeout:g} s (--grammar-compile-timeout); simplify it")

    def timed_out(self, c: pb.Constraint) -> ConstraintError:
        """The error for a compile not done within the timeout; a constraint that compiled that long is
        remembered and refused at once from then on."""
        key = constraint_key(c)
        with self._lock:
            self._remember_too_slow(key)
        return self._too_slow_error(key)

    def compiled(self, c: pb.Constraint):
        """The compiled grammar of ``c``, waiting for it (the step loop's path when a plan brings a constraint that
        is not cached); ConstraintError when invalid or not compiled within the timeout."""
        future = self.submit(c)
        try:
            return future.result(timeout=self.compile_timeout)
        except FutureTimeout:
            raise self.timed_out(c) from None

    # ---- requests --------------------------------------------------------------------------------------
    def state(self, c: pb.Constraint, outputs: Sequence[int], request_id: str) -> GrammarState:
        """A request's matcher after its ``outputs`` (the tokens it sampled so far), or ConstraintError when the
        constraint is unusable or the outputs do not follow it (a resumed request's client sent others)."""
        xgr = _xgrammar()

        matcher = xgr.GrammarMatcher(self.compiled(c), override_stop_tokens=list(c.end_token_ids) or None)
        for i, token in enumerate(outputs):
            if not matcher.accept_token(token):
                raise ConstraintError(f"request {request_id}: output token {i} ({token}) does not follow its "
                                      f"{FIELD}")
        return GrammarState(matcher)

    def masks(self, states: Sequence[GrammarState | None]) -> GrammarMask | None:
        """The allowed tokens of each row with a live matcher (``states[i]`` None: an unconstrained row), packed as
        xgrammar fills them; None when no row has one."""
        rows = [i for i, st in enumerate(states) if st is not None and not st.terminated]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or len(self._bitmask) < len(rows):
            grown = 2 * len(self._bitmask) if self._bitmask is not None else 0
            self._bitmask = torch.empty(max(len(rows), grown), words, dtype=torch.int32)
        bitmask = self._bitmask[: len(rows)]
        for j, i in enumerate(rows):  # (a plain loop: BatchGrammarMatcher's threads measured slower on 2 cores)
            states[i].matcher.fill_next_token_bitmask(bitmask, j)
        return GrammarMask(rows, bitmask)

    @staticmethod
    def advance(states: Sequence[GrammarState], tokens: Sequence[int]) -> list[int]:
        """Each live matcher accepts its row's sampled token; returns the indices whose token it refused (none
        unless a bug: the mask allowed only what it accepts)."""
        return [i for i, (st, token) in enumerate(zip(states, tokens)) if not st.terminated and not st.accept(token)]
