"""The requests of one benchmark run, drawn from a seed: arrival times, lengths, prompts, tenants.

Prompts are token ids (the API takes them as given, so the client needs no tokenizer): uniform random ids
in a range that avoids special tokens, after the server's BOS when its tokenizer adds one. A request's
*input length* is the number of tokens of its own (BOS included); a request given a shared prefix gets
that prefix (BOS included) in front instead of the BOS, so its prompt is ``prefix_len + input_len - 1``
tokens. Requests are then fitted to the server's ``max_model_len``: the prompt is cut to leave room for one
output token, and the output to what is left (such requests are counted as ``fitted``).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

LENGTH_KINDS = ("fixed", "uniform", "lognormal")
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
ARRIVALS = ("poisson", "burst")


class WorkloadError(ValueError):
    """A workload option out of range; the message names the option and the limit."""


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Token lengths: ``fixed:N`` (or ``N``), ``uniform:LO:HI`` (inclusive), or ``lognormal:MEAN:SIGMA[:MAX]``
    (log-normal with the given mean in tokens and sigma of the log, ShareGPT-like; rounded, at least 1,
    at most MAX when given)."""

    kind: str
    a: float  # fixed: N; uniform: LO; lognormal: mean
    b: float = 0.0  # uniform: HI; lognormal: sigma
    cap: int = 0  # lognormal: most tokens (0: no cap)

    @classmethod
    def parse(cls, spec: str, option: str) -> LengthDist:
        parts = spec.strip().split(":")
        kind, nums = ("fixed", parts) if parts[0].isdigit() else (parts[0], parts[1:])
        try:
            vals = [float(x) for x in nums]
        except ValueError:
            raise WorkloadError(f"{option}: {spec!r}: numbers expected after the kind") from None
        if kind == "fixed" and len(vals) == 1:
            d = cls("fixed", vals[0])
        elif kind == "uniform" and len(vals) == 2:
            d = cls("uniform", vals[0], vals[1])
        elif kind == "lognormal" and len(vals) in (2, 3):
            d = cls("lognormal", vals[0], vals[1], int(vals[2]) if len(vals) == 3 else 0)
        else:
            raise WorkloadError(f"{option}: {spec!r}: expected N, fixed:N, uniform:LO:HI or lognormal:MEAN:SIGMA[:MAX]")
        d.validate(option)
        return d

    def validate(self, option: str) -> None:
        if self.kind not in LENGTH_KINDS:
            raise WorkloadError(f"{option}: kind {self.kind!r}; must be one of {', '.join(LENGTH_KINDS)}")
        if self.kind in ("fixed", "uniform") and (self.a != int(self.a) or self.a < 1):
            raise WorkloadError(f"{option}: {self.describe()}: lengths must be whole numbers >= 1")
        if self.kind == "uniform" and (self.b != int(self.b) or self.b < self.a):
            raise WorkloadError(f"{option}: {self.describe()}: HI must be a whole number >= LO")
        if self.kind == "lognormal":
            if not math.isfinite(self.a) or self.a < 1:
                raise WorkloadError(f"{option}: {self.describe()}: MEAN must be >= 1")
            if not math.isfinite(self.b) or not 0 <= self.b <= 4:
                raise WorkloadError(f"{option}: {self.describe()}: SIGMA must be in [0, 4]")
            if self.cap < 0:
                raise WorkloadError(f"{option}: {self.describe()}: MAX must be >= 1 (0 or absent: no cap)")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        mu = math.log(self.a) - self.b * self.b / 2  # so that E[X] = a
        n = max(1, round(rng.lognormvariate(mu, self.b)))
        return min(n, self.cap) if self.cap else n

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"lognormal:{self.a:g}:{self.b:g}" + (f":{self.cap}" if self.cap else "")


def check_arrivals(num: int, rate: float, kind: str = "poisson", burst_size: int = 1) -> None:
    if num < 1:
        raise WorkloadError(f"--num-prompts: {num}; must be >= 1")
    if math.isnan(rate) or rate <= 0:
        raise WorkloadError(f"--request-rate: {rate}; must be > 0 (inf: all requests at once)")
    if kind not in ARRIVALS:
        raise WorkloadError(f"--arrival: {kind!r}; must be one of {', '.join(ARRIVALS)}")
    if burst_size < 1:
        raise WorkloadError(f"--burst-size: {burst_size}; must be >= 1")


def arrival_times(num: int, rate: float, rng: random.Random, kind: str = "poisson", burst_size: int = 1) -> list[float]:
    """Send times in seconds from the start, averaging ``rate`` requests/s (``inf``: all at 0).

    poisson: exponential gaps of mean 1/rate, the first request at 0. burst: groups of ``burst_size``
    requests sent together every ``burst_size / rate`` seconds (same mean rate, no randomness)."""
    check_arrivals(num, rate, kind, burst_size)
    if math.isinf(rate):
        return [0.0] * num
    if kind == "burst":
        return [(i // burst_size) * burst_size / rate for i in range(num)]
    times, t = [], 0.0
    for i in range(num):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


@dataclass(frozen=True, slots=True)
class Tenant:
    """One API key of a multi-tenant mix; ``name`` labels it in the report (the key is never written out)."""

    name: str
    key: str
    weight: float = 1.0

    @classmethod
    def parse(cls, spec: str, index: int) -> Tenant:
        """``[NAME=]KEY[:WEIGHT]``. NAME is a tenant-like name (letters, digits, ``._-``). A key that
        could read as NAME=... or that ends in ``:<number>`` needs a NAME= in front and an explicit :WEIGHT."""
        name, sep, rest = spec.partition("=")
        if not sep or not _NAME_RE.match(name) or not rest or rest.startswith("="):
            name, rest = f"tenant{index}", spec
        key, weight = rest, 1.0
        head, sep, tail = rest.rpartition(":")
        if sep:
            try:
                key, weight = head, float(tail)
            except ValueError:
                key, weight = rest, 1.0
        if not key:
            raise WorkloadError(f"--tenant: {spec!r}: empty API key")
        if not math.isfinite(weight) or weight <= 0:
            raise WorkloadError(f"--tenant: {spec!r}: weight {weight}; must be > 0")
        return cls(name, key, weight)


@dataclass(frozen=True, slots=True)
class SharedPrefixes:
    """``fraction`` of the requests (rounded to a whole number of them) start with one of ``count`` prefixes
    of ``length`` tokens each, chosen uniformly."""

    fraction: float = 0.0
    count: int = 1
    length: int = 0

    def validate(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise WorkloadError(f"--shared-prefix-fraction: {self.fraction}; must be in [0, 1]")
        if self.count < 1:
            raise WorkloadError(f"--num-shared-prefixes: {self.count}; must be >= 1")
        if self.fraction > 0 and self.length < 1:
            raise WorkloadError(f"--shared-prefix-len: {self.length}; must be >= 1 when --shared-prefix-fraction > 0")


@dataclass(frozen=True, slots=True)
class TokenSpace:
    """Where prompt ids come from: uniform in [lo, hi), after ``bos`` (the server's BOS, or nothing)."""

    lo: int
    hi: int
    bos: tuple[int, ...] = ()

    def validate(self, vocab_size: int) -> None:
        if not 0 <= self.lo < self.hi <= vocab_size:
            raise WorkloadError(f"--token-id-range: [{self.lo}, {self.hi}); must satisfy 0 <= LO < HI <= "
                                f"vocab_size={vocab_size}")

    def draw(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.lo, self.hi) for _ in range(n)]


def default_token_space(vocab_size: int, bos: tuple[int, ...]) -> TokenSpace:
    """Ids in [3, 0.9 * vocab): past the ids most tokenizers put first (pad/BOS/EOS) and below the special
    tokens many put last (Llama 3 from 128000 of 128256, Qwen2 from 151643 of 151936)."""
    return TokenSpace(min(3, vocab_size - 1), max(min(3, vocab_size - 1) + 1, int(vocab_size * 0.9)), bos)


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    send_at_s: float  # seconds after the start of the run
    prompt: list[int]
    max_tokens: int
    tenant: str  # Tenant.name, or "default"
    prefix: int  # index of its shared prefix, -1 for none
    fitted: bool  # shortened to fit max_model_len


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_prompts: int
    input_len: LengthDist
    output_len: LengthDist
    request_rate: float = math.inf
    arrival: str = "poisson"
    burst_size: int = 1
    shared: SharedPrefixes = SharedPrefixes()
    tenants: tuple[Tenant, ...] = ()
    seed: int = 0


def _choose_tenant(tenants: tuple[Tenant, ...], rng: random.Random) -> str:
    if not tenants:
        return "default"
    return rng.choices(tenants, weights=[t.weight for t in tenants])[0].name


def make_workload(spec: WorkloadSpec, tokens: TokenSpace, max_model_len: int) -> list[PlannedRequest]:
    """The requests of a run; the same spec, token space and limit always give the same list."""
    spec.shared.validate()
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len: {max_model_len}; the server must allow at least 2 tokens")
    if spec.shared.fraction > 0 and spec.shared.length >= max_model_len:
        raise WorkloadError(f"--shared-prefix-len: {spec.shared.length}; must be shorter than the server's "
                            f"max_model_len={max_model_len}")
    # One generator per concern, so the same seed gives the same prompts at any rate or tenant mix.
    rng = random.Random(f"prompts/{spec.seed}")
    times = arrival_times(spec.num_prompts, spec.request_rate, random.Random(f"arrivals/{spec.seed}"), spec.arrival,
                          spec.burst_size)
    tenant_rng = random.Random(f"tenants/{spec.seed}")
    prefixes = [list(tokens.bos) + tokens.draw(rng, spec.shared.length - len(tokens.bos))
                for _ in range(spec.shared.count)] if spec.shared.fraction > 0 else []
    num_shared = round(spec.shared.fraction * spec.num_prompts)
    shared_at = set(rng.sample(range(spec.num_prompts), num_shared))
    out = []
    for i, t in enumerate(times):
        in_len, out_len = spec.input_len.sample(rng), spec.output_len.sample(rng)
        prefix = rng.randrange(spec.shared.count) if i in shared_at else -1
        head = prefixes[prefix] if prefix >= 0 else list(tokens.bos)
        wanted = max(in_len - len(tokens.bos) if prefix < 0 else in_len - 1, 0 if head else 1)
        own = min(wanted, max_model_len - 1 - len(head))  # room for one output token
        prompt = head + tokens.draw(rng, own)
        max_tokens = min(out_len, max_model_len - len(prompt))
        fitted = own < wanted or max_tokens < out_len
        out.append(PlannedRequest(i, t, prompt, max_tokens, _choose_tenant(spec.tenants, tenant_rng), prefix, fitted))
    return out
