"""Shared fixtures: a hermetic model cache, small HF models, and real server processes on loopback."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from pagedkv.local_server import ROOT, TEST_EXECUTOR_SECRET, LocalServer
from pagedkv.security import EXECUTOR_SECRET_ENV
from tests.support import tiers

__all__ = ["ROOT", "Server", "wait_until"]

# Every property test, not only the adversarial ones (tests/support/adversarial_profiles.py): no per-example deadline (a
# clock, which a loaded machine misses) and the same examples every run; PAGEDKV_ADVERSARIAL=long explores.
settings.register_profile("ci", deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", deadline=None)
settings.load_profile("long" if os.environ.get("PAGEDKV_ADVERSARIAL", "") == "long" else "ci")

# The servers tests start log each request (DEBUG since #48: INFO has the periodic stats line instead), which many
# tests read; a test of the INFO level passes --log-level itself.
os.environ.setdefault("PAGEDKV_LOG_LEVEL", "debug")
# The executors tests start run one torch thread (--threads auto would take every core since #49): the suite runs
# servers beside pytest and each other, where spinning OpenMP threads on the same cores slow every step many times
# (executor_svc/threads.py). A test of --threads passes it itself.
os.environ.setdefault("PAGEDKV_THREADS", "1")

# Tiers (tests/README.md): every test module sets its own with `pytestmark` (unit, e2e or gpu; slow may be added)
# and sits in its tier's folder (tests/unit/, tests/e2e/, tests/gpu/; tests/adversarial/ holds unit and e2e).
# Collection stops on a module that does not; a unit test that starts a process or opens a socket fails.


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    tiers.check_tiers(items)


def pytest_configure(config) -> None:
    tiers.GUARD.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if not tiers.is_unit(item):
        return (yield)
    with tiers.GUARD.run(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not tiers.is_unit(item):
        return (yield)
    with tiers.GUARD.run(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    if not tiers.is_unit(item):
        return (yield)
    with tiers.GUARD.run(item):
        return (yield)


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory) -> Path:
    """Every test (and every process it starts) builds tiny-llama into a fresh cache of its own. Models fetched from
    a package registry (smollm2-135m-instruct) stay in the user's cache ($PAGEDKV_MODEL_CACHE, else the
    PAGEDKV_CACHE_DIR or ~/.cache/pagedkv the suite started with): fetched once per machine."""
    from pagedkv.models import cache_dir

    os.environ.setdefault("PAGEDKV_MODEL_CACHE", str(cache_dir()))
    path = tmp_path_factory.mktemp("pagedkv-cache")
    os.environ["PAGEDKV_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def executor_secret() -> str:
    """Executors and schedulers that tests start as plain subprocesses share the test secret (ServiceProcess
    sets it too; pagedkv serve makes its own per run)."""
    os.environ.setdefault(EXECUTOR_SECRET_ENV, TEST_EXECUTOR_SECRET)
    return os.environ[EXECUTOR_SECRET_ENV]


@pytest.fixture(scope="session")
def tiny_llama_dir(model_cache) -> Path:
    from pagedkv.models import resolve_model

    return resolve_model("tiny-llama")


@pytest.fixture(scope="session")
def smollm2_dir(model_cache) -> Path:
    """The built-in real model (30 layers, a 49,152-token vocabulary, a ChatML template), fetched on first use."""
    from pagedkv.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    """A random Qwen2-style model (qkv bias, tied embeddings) built and saved by the test itself."""
    from pagedkv.tools.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("qwen2-tiny"), arch="qwen2", seed=7, hidden_size=192,
                              intermediate_size=512, num_layers=3, num_heads=6, num_kv_heads=2)


class Server(LocalServer):
    pass


@pytest.fixture
def start_server():
    servers: list[Server] = []

    def start(*args: str) -> Server:
        s = Server(*args)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def start_servers():
    """``start_servers(args, args, ...)``: servers started side by side (start-up is most of a short e2e test's
    time), returned in that order; stopped at teardown (those that started, when one fails to)."""
    servers: list[Server] = []

    def start(*arg_lists: tuple[str, ...]) -> list[Server]:
        with ThreadPoolExecutor(len(arg_lists)) as pool:
            starting = [pool.submit(Server, *args) for args in arg_lists]
        servers.extend(f.result() for f in starting if not f.exception())
        for f in starting:
            if f.exception():
                raise f.exception()
        return [f.result() for f in starting]

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def boxes(monkeypatch):
    """Cluster tests in one process: FakeClients (tests/support/fake_cluster.py) stand in for the gRPC executor client;
    the Boxes (what runs at each address) by address, empty."""
    from tests.support.fake_cluster import install_fake_clients

    return install_fake_clients(monkeypatch)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
