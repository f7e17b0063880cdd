"""Constraint compiles in worker processes that a limit ends (issue #46, F2): a compile past its CPU limit is
stopped (its worker killed and replaced) and refused, one past its memory limit refused, and the next compile runs
on a fresh worker; nothing is left running after the pool closes. (e2e: the pool starts processes.)"""

from __future__ import annotations

import json

import pytest
import xgrammar
from transformers import AutoTokenizer

from executor_svc.grammar import CompileLimit, Key
from executor_svc.grammar_compile import CompilePool

pytestmark = pytest.mark.e2e

VOCAB = 320
# ~62 KB; its compile takes ~1.3 s of CPU against tiny-llama's vocabulary (the sessions' 2-core machine)
SLOW = json.dumps({"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": "^[a-z]{3,9}-[0-9]{2,5}(x|y|z){1,4}$"} for i in range(800)}})


@pytest.fixture(scope="module")
def tokenizer_info(tiny_llama_dir) -> str:
    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_llama_dir), vocab_size=VOCAB)
    return info.serialize_json()


def _pids(pool: CompilePool) -> list[int]:
    return [w.proc.pid for w in pool._workers if w.proc is not None]


def test_a_compile_past_its_cpu_limit_is_stopped_and_the_worker_replaced(tokenizer_info):
    pool = CompilePool(tokenizer_info, timeout_s=0.2, memory_mb=2048, workers=1)
    try:
        with pytest.raises(CompileLimit, match=r"more than the executor's limit of 0.2 s of CPU") as err:
            pool.submit(Key("a", "json_schema", SLOW, False)).result(timeout=120)
        assert err.value.what == "cpu" and pool.killed == 1
        compiled, cpu_s = pool.submit(Key("b", "regex", "[0-9]{3}", False)).result(timeout=120)
        assert compiled is None and cpu_s < 0.2 and pool.started == 2  # (proved on a fresh worker)
        pids = _pids(pool)
    finally:
        pool.close()
    import os

    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # (reaped: no worker left behind)


def test_a_compile_past_its_memory_limit_is_refused_naming_the_flag(tokenizer_info):
    pool = CompilePool(tokenizer_info, timeout_s=30.0, memory_mb=30, workers=1)
    try:
        with pytest.raises(CompileLimit, match=r"needs more than the executor's limit of 30 MiB "
                                               r"\(--grammar-compile-memory-mb\)"):
            pool.submit(Key("a", "json_schema", SLOW, False)).result(timeout=120)
        assert pool.submit(Key("a", "regex", "[0-9]{3}", False)).result(timeout=120)[1] < 1.0
    finally:
        pool.close()
