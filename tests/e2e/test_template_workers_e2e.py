"""Requests' own chat templates through real processes (#46 F5): a scheduler with --trust-request-chat-template and
two tenants. A template that loops for minutes is refused within --chat-template-timeout (its worker process
killed), one that builds a 10 MB string is refused by the output bound, each naming the request's chat_template
field and the limit; another tenant's chat, sent while the loop renders, is answered first; and no worker process
outlives its scheduler, stopped or killed."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from pagedkv.client import Client
from pagedkv.tenancy import hash_key
from tests.support import procs
from tests.support.chat_template import TEMPLATE

pytestmark = pytest.mark.e2e

TIMEOUT_S = 3.0  # --chat-template-timeout
ATTACKER, BYSTANDER = "key-attacker", "key-bystander"
TENANTS = f"""
[tenants.attacker]
keys = ["{hash_key(ATTACKER)}"]

[tenants.bystander]
keys = ["{hash_key(BYSTANDER)}"]
"""
NESTED_LOOP = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"  # 10^10 iterations
BIG_STRING = "{{ 'x'*10**7 }}"
WORKER_MODULE = b"scheduler_svc.template_worker"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """An executor over a small random model whose checkpoint has a chat template, and a tenants file."""
    from transformers import AutoTokenizer

    from pagedkv.tools.random_model import build_random_model

    tmp = tmp_path_factory.mktemp("template-workers")
    path = build_random_model(tmp / "model", seed=3, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    (tmp / "tenants.toml").write_text(TENANTS)
    executor = procs.executor("--model", str(path), "--num-pages", "64")
    yield executor, tmp / "tenants.toml"
    executor.stop()


def start_scheduler(stack, workers: int = 2) -> procs.Proc:
    executor, tenants = stack
    return procs.scheduler(executor.address, args=(
        "--max-model-len", "256", "--tenants-file", str(tenants), "--trust-request-chat-template",
        "--chat-template-timeout", str(TIMEOUT_S), "--chat-template-workers", str(workers)))


@pytest.fixture(scope="module")
def scheduler(stack):
    s = start_scheduler(stack)
    yield s
    s.stop()


def workers_of(pid: int) -> list[int]:
    """The scheduler's template worker processes now, from /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        found += [c for c in children if running_worker(c)]
    return found


def running_worker(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return WORKER_MODULE in argv and state != "Z"


async def until(check, timeout: float = 60.0, what: str = "", attack: asyncio.Task | None = None):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        ended = f"; the attack ended: {attack.result()[0].details()}" if attack is not None and attack.done() else ""
        assert time.monotonic() < deadline and not ended, f"timed out waiting for {what}{ended}"
        await asyncio.sleep(0.05)
    return found


async def refused(address: str, key: str, template: str, tokenize: bool = False) -> tuple[grpc.aio.AioRpcError, float]:
    """The refusal of a chat rendered with ``template``, and the seconds it took."""
    t0 = time.monotonic()
    async with Client(address, api_key=key, resume=None) as c:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            if tokenize:
                await c.tokenize(messages=[("user", "hi")], chat_template=template)
            else:
                await c.complete(messages=[("user", "hi")], chat_template=template, max_tokens=1)
    return e.value, time.monotonic() - t0


async def attack_and_answer(address: str, pid: int, bystander_template: str | None):
    """The attacker's looping template in flight (its worker running), then the bystander's one-token chat (with
    the model's template, or its own): the bystander's answer, whether the attack was still pending when it came,
    the attack's refusal and its seconds, and whether the attack's worker is gone after."""
    attack = asyncio.create_task(refused(address, ATTACKER, NESTED_LOOP))
    (worker,) = await until(lambda: workers_of(pid), what="the attacker's template worker", attack=attack)
    options = {"chat_template": bystander_template} if bystander_template else {}
    async with Client(address, api_key=BYSTANDER, resume=None) as c:
        answer = await c.complete(messages=[("user", "hi")], max_tokens=1, **options)
    attack_pending = not attack.done()
    err, took = await attack
    gone = await until(lambda: not running_worker(worker), 10, "the killed worker to go")
    return answer, attack_pending, err, took, gone


def test_a_looping_template_is_refused_in_its_time_while_another_tenant_is_answered(scheduler):
    answer, attack_pending, err, took, gone = asyncio.run(
        attack_and_answer(scheduler.address, scheduler.proc.pid, None))
    assert attack_pending, "the bystander's chat was answered only after the attacker's template"
    assert len(answer.token_ids) == 1
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == (f"prompt.chat.chat_template: rendering took more than {TIMEOUT_S:g} s; at most "
                             f"{TIMEOUT_S:g} s (--chat-template-timeout)")
    assert TIMEOUT_S <= took < TIMEOUT_S + 20  # (20 s: a worker's start on a loaded machine; the loop needs minutes)
    assert gone


def test_another_tenants_own_template_is_rendered_while_the_loop_runs(scheduler):
    answer, attack_pending, err, _, _ = asyncio.run(
        attack_and_answer(scheduler.address, scheduler.proc.pid, "{{ messages[0].content }}!"))
    assert answer.prompt_tokens == len("hi!") and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert attack_pending, "the bystander's own template waited for the attacker's render"


def test_a_huge_string_is_refused_by_the_output_bound(scheduler):
    async def scenario():
        return (await refused(scheduler.address, ATTACKER, BIG_STRING),
                await refused(scheduler.address, ATTACKER, BIG_STRING, tokenize=True))

    (generate, took), (tokenize, _) = asyncio.run(scenario())
    for err, field in [(generate, "prompt.chat.chat_template"), (tokenize, "chat.chat_template")]:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith(f"{field}: the template would build a string of 10000000 characters")
        assert "(--max-prompt-bytes" in err.details()
    assert took < TIMEOUT_S


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_no_worker_outlives_its_scheduler(stack, stop):
    """Stopped (its shutdown kills the workers) or killed (they die with it: parent-death signal), with one worker
    rendering a loop and one idle. (Through Tokenize, which needs no executor: the module's scheduler holds it.)"""
    s = start_scheduler(stack, workers=4)  # (2 a tenant: the attacker's and the bystander's at once)
    try:
        async def scenario():
            attack = asyncio.create_task(refused(s.address, ATTACKER, NESTED_LOOP, tokenize=True))
            await until(lambda: workers_of(s.proc.pid), what="the attacker's template worker", attack=attack)
            async with Client(s.address, api_key=BYSTANDER, resume=None) as c:
                await c.tokenize(messages=[("user", "hi")], chat_template="{{ messages[0].content }}")
            workers = workers_of(s.proc.pid)
            if stop == "SIGTERM":
                code = await asyncio.to_thread(s.stop)
            else:
                s.proc.send_signal(signal.SIGKILL)
                code = await asyncio.to_thread(s.proc.wait, 30)
            err, _ = await attack
            return workers, code, err

        workers, code, err = asyncio.run(scenario())
        assert len(workers) == 2 and code is not None and err.code() != grpc.StatusCode.OK, s.log()[-3000:]
        deadline = time.monotonic() + 10
        while any(map(running_worker, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(running_worker, workers)), f"template workers {workers} outlived the scheduler"
    finally:
        s.kill()
