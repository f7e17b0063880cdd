"""Structured outputs on the executor: constraints compiled against the model's vocabulary (xgrammar), cached per
tenant, and one matcher per constrained request, next to the sampler.

NOTE: the matcher lives here, not on the scheduler: the token bitmask (a bit per vocabulary entry, 6 KiB a row at
49k tokens) never crosses the wire, and the matcher advances with each sampled token as the executor appends it,
so it is right one step ahead under async scheduling too. A request sent in full (``NewRequest``: first admission,
or again after recompute, swap-in, migration, a rejected plan or a resume) gets a fresh matcher that replays the
output tokens the plan carries: the state is a function of the tokens so far, nothing else, so it is rebuilt
exactly wherever the request goes. The matchers' work runs on threads of their own within CPU budgets
(grammar_jobs.py).

Compilation (grammar_compile.py): first in worker processes under a CPU and a memory limit that the kernel enforces,
taken in turn across tenants; what compiled within them is compiled again here, on a thread of its own. The
scheduler asks for a constraint (``CheckConstraint``) before it places a request, after its queue bounds: an invalid
constraint, or one past a limit, is refused there, before anything runs; a compiled one is then held in the cache
for the request (``HOLD_S`` after its last check or use; while a request holds it, it is pinned). Nothing compiles
on the step loop: a plan whose constraint is not cached ends that request alone.

Everything is per scope (``Constraint.scope``, the tenant's tag): the cache key, the memory of constraints refused
for a limit (for ``REFUSED_S``), the compile queue. A tenant cannot tell which constraints another used (a cached
constraint answers faster) nor make another's refused.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pagedkv.executor.v1 import executor_pb2 as pb

FIELD = "sampling.constraint"
DEFAULT_COMPILE_TIMEOUT = 5.0  # CPU seconds of one compile (--grammar-compile-timeout)
DEFAULT_COMPILE_MEMORY_MB = 2048  # memory one compile may add to its worker (--grammar-compile-memory-mb)
DEFAULT_STEP_BUDGET_MS = 20.0  # CPU of one request's matcher in one step (--grammar-step-budget-ms)
DEFAULT_TENANT_BUDGET_MS = 50.0  # CPU of one tenant's matchers together in one step (--grammar-tenant-step-budget-ms)
CACHE_BYTES = 512 << 20  # compiled grammars kept, by xgrammar's own size figure (least recently used go first)
HOLD_S = 1800.0  # a checked grammar stays (for the scheduler's queued requests) this long after its last check or use
REFUSED_S = 600.0  # a constraint refused for a limit is refused at once, in its scope, for this long
REFUSED_KEPT = 256  # such constraints remembered per scope
COMPILE_NICE = 10  # compiles (workers, and the thread that compiles again here) yield the cores to the steps
# NOTE: xgrammar 0.2.9's length-bounded JSON string rule (minLength/maxLength) lets control characters through,
# which JSON forbids inside strings (its unbounded rule excludes them): the converted grammar is patched.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


class ConstraintError(Exception):
    """A constraint the executor cannot use: invalid, or past a limit. The message names the field."""


class Key(NamedTuple):
    """What identifies a compiled grammar: whose it is, the constraint's kind, its text and strict (not its end
    tokens, which each request's matcher sets)."""

    scope: str
    kind: str
    text: str
    strict: bool


class CompileLimit(ConstraintError):
    """A compile stopped by a limit: ``what`` "cpu" (``limit`` seconds) or "memory" (``limit`` MiB)."""

    def __init__(self, key: Key, what: str, used: float, limit: float) -> None:
        if what == "cpu":
            text = (f"{FIELD}.{key.kind}: compiling it takes more than the executor's limit of {limit:g} s of CPU "
                    "(--grammar-compile-timeout); simplify it")
        else:
            text = (f"{FIELD}.{key.kind}: compiling it needs more than the executor's limit of {limit:g} MiB "
                    "(--grammar-compile-memory-mb); simplify it")
        super().__init__(text)
        self.what, self.used = what, used


def constraint_key(c: pb.Constraint) -> Key:
    kind = c.WhichOneof("kind")
    if kind is None:
        raise ConstraintError(f"{FIELD}: no kind set (json_schema, json_object, regex, choice or grammar)")
    text = json.dumps(list(c.choice.choices), ensure_ascii=False) if kind == "choice" else \
        "" if kind == "json_object" else getattr(c, kind)
    return Key(c.scope, kind, text, c.strict and kind == "json_schema")


def _xgrammar():
    """The xgrammar module, or ConstraintError saying it is not installed (a checkout installed without the
    Makefile: structured outputs are then refused with that message; everything else runs)."""
    try:
        import xgrammar
    except ImportError as e:
        raise ConstraintError(f"{FIELD}: structured outputs need xgrammar, which this executor lacks ({e}); "
                              "install it with `pip install --no-deps xgrammar==0.2.9`") from None
    return xgrammar


def build_grammar(kind: str, text: str, strict: bool):
    """The xgrammar Grammar of a constraint (no vocabulary needed yet); ConstraintError naming the field."""
    xgr = _xgrammar()
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
    except RecursionError:
        raise ConstraintError(f"{field}: nested too deeply to parse") from None
    except Exception as err:  # noqa: BLE001 -- xgrammar's parse errors (RuntimeError, ValueError, InvalidJSONError)
        if "bad_alloc" in str(err):  # (its C++ allocations past the compile worker's memory limit)
            raise MemoryError(str(err)) from None
        raise ConstraintError(f"{field}: not usable: {_xgrammar_message(err)}") from None


def new_matcher(compiled, end_token_ids):
    """A fresh matcher of a compiled grammar; ``end_token_ids`` end it (the request's EOS and stop tokens)."""
    return _xgrammar().GrammarMatcher(compiled, override_stop_tokens=list(end_token_ids) or None)


def _xgrammar_message(err: Exception) -> str:
    """xgrammar's error without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:94: Check failed: ... is false:")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(err).strip())
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)[:500]


@dataclass(slots=True)
class _Entry:
    compiled: object  # xgrammar's CompiledGrammar
    size: int
    pins: int = 0  # requests of the mirror that use it
    held_until: float = 0.0  # monotonic: kept for queued requests until then


class Compiled(NamedTuple):
    grammar: object  # CompiledGrammar
    cpu_s: float  # its compile's CPU (0: it was cached)


class GrammarEngine:
    """The executor's constraint compiler and cache for one model's vocabulary (``tokenizer_dir``: the model's
    directory; ``vocab_size``: the width of its logits). ``compile_workers``: worker processes (0: threads here)."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, compile_timeout: float = DEFAULT_COMPILE_TIMEOUT,
                 compile_workers: int = 2, compile_memory_mb: int = DEFAULT_COMPILE_MEMORY_MB, per_scope: int = 1,
                 cache_bytes: int = CACHE_BYTES) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[Key, _Entry] = OrderedDict()  # most recent last
        self._cached_bytes = 0
        self._compiling: dict[Key, Future] = {}
        self._refused: dict[str, OrderedDict[Key, tuple[float, ConstraintError]]] = {}
        self.compile_cpu_s = 0.0
        self._ready: Future = Future()  # -> (TokenizerInfo, CompilePool), loaded off the loop (~0.5 s)
        self._local = None  # this process's GrammarCompiler (what a worker proved compiles, compiled here)
        settings = (compile_workers, compile_memory_mb, per_scope)
        threading.Thread(target=self._load, args=(Path(tokenizer_dir), settings), name="grammar-load",
                         daemon=True).start()

    def _load(self, path: Path, settings: tuple[int, int, int]) -> None:
        from executor_svc.grammar_compile import CompilePool

        try:
            xgr = _xgrammar()
            from transformers import AutoTokenizer

            info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(path), vocab_size=self.vocab_size)
            workers, memory_mb, per_scope = settings
            self._local = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            pool = CompilePool(info.serialize_json(), self.compile_timeout, memory_mb, workers, per_scope,
                               self._local if workers == 0 else None)
            self._ready.set_result((info, pool))
        except Exception as err:  # noqa: BLE001 -- no xgrammar, or the tokenizer would not load
            self._ready.set_exception(ConstraintError(f"{FIELD}: this executor cannot compile constraints: {err}"))

    def pool(self):
        """The compile pool (waits for the engine to load); ConstraintError when it could not."""
        return self._ready.result()[1]

    def close(self) -> None:
        if self._ready.done() and self._ready.exception() is None:
            self._ready.result()[1].close()

    # ---- compiling -------------------------------------------------------------------------------------
    def cached(self, c: pb.Constraint) -> bool:
        with self._lock:
            return constraint_key(c) in self._cache

    def submit(self, c: pb.Constraint) -> Future:
        """``c`` compiled (a ``Compiled``), as a future, and held for ``HOLD_S``: done at once when cached or refused
        in its scope, else compiling in the pool (one compile per constraint however many ask)."""
        key = constraint_key(c)
        with self._lock:
            refused = self._refused_now(key)
            entry = self._cache.get(key)
            if refused is None and entry is not None:
                self._cache.move_to_end(key)
                entry.held_until = time.monotonic() + HOLD_S
            if refused is not None or entry is not None:
                done: Future = Future()
                done.set_exception(refused) if refused is not None else done.set_result(Compiled(entry.compiled, 0.0))
                return done
            running = self._compiling.get(key)
            if running is None:
                running = self._compiling[key] = Future()
                threading.Thread(target=self._compile, args=(key, running), name="grammar-submit", daemon=True).start()
            return running

    def _compile(self, key: Key, out: Future) -> None:
        try:
            _, pool = self._ready.result()
            compiled, cpu_s = pool.submit(key).result()
            if compiled is None:  # (a worker proved it compiles within the limits: compiled here now, as costly)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)  # (this thread only)
                started = time.thread_time()
                compiled = self._local.compile_grammar(build_grammar(key.kind, key.text, key.strict))
                cpu_s += time.thread_time() - started
            with self._lock:
                self.compile_cpu_s += cpu_s
                self._cache[key] = _Entry(compiled, compiled.memory_size_bytes, held_until=time.monotonic() + HOLD_S)
                self._cached_bytes += compiled.memory_size_bytes
                self._evict()
            out.set_result(Compiled(compiled, cpu_s))
        except ConstraintError as err:
            if isinstance(err, CompileLimit):
                with self._lock:
                    self.compile_cpu_s += err.used
                    self._remember_refused(key, err)
            out.set_exception(err)
        except Exception as err:  # noqa: BLE001 -- never leave a caller waiting
            out.set_exception(ConstraintError(f"{FIELD}: the compile failed ({type(err).__name__}: {err})"))
        finally:
            with self._lock:
                self._compiling.pop(key, None)

    def _evict(self) -> None:
        """Least recently used first, while over ``cache_bytes``; never a pinned or held grammar."""
        now = time.monotonic()
        for key in [k for k, e in self._cache.items() if not e.pins and e.held_until <= now]:
            if self._cached_bytes <= self.cache_bytes:
                return
            self._cached_bytes -= self._cache.pop(key).size

    def _refused_now(self, key: Key) -> ConstraintError | None:
        memo = self._refused.get(key.scope)
        got = memo.get(key) if memo else None
        if got is None:
            return None
        if got[0] <= time.monotonic():
            del memo[key]
            return None
        return got[1]

    def _remember_refused(self, key: Key, err: ConstraintError) -> None:
        memo = self._refused.setdefault(key.scope, OrderedDict())
        memo[key] = (time.monotonic() + REFUSED_S, err)
        while len(memo) > REFUSED_KEPT:
            memo.popitem(last=False)

    # ---- what the mirror uses --------------------------------------------------------------------------
    def lookup(self, c: pb.Constraint) -> tuple[Key, object | None]:
        """``c``'s key and compiled grammar, None when it is not cached here (nothing compiles on this path)."""
        key = constraint_key(c)
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                return key, None
            self._cache.move_to_end(key)
            return key, entry.compiled

    def pin(self, key: Key) -> None:
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                entry.pins += 1

    def unpin(self, key: Key) -> None:
        """A request let go of it: held for ``HOLD_S`` more (it may come back, swapped in or recomputed)."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and entry.pins:
                entry.pins -= 1
                entry.held_until = max(entry.held_until, time.monotonic() + HOLD_S)

