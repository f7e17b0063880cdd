"""Requests' own chat templates, in one process: the bounded sandbox the worker renders in (template_sandbox), and
the pool's time limit, replacement of a killed worker, bound per tenant and shutdown, over in-process workers
(tests/support/template_workers.py). The worker processes themselves: tests/e2e/test_template_workers_e2e.py."""

from __future__ import annotations

import asyncio

import pytest

from pagedkv.bounds import InvalidRequest
from scheduler_svc.template_pool import TemplateLimits, TemplatePool, WorkerGone
from scheduler_svc.template_sandbox import MAX_POWER_BITS, RenderLimit, render_job
from scheduler_svc.template_worker import reply
from tests.support.chat_template import TOOL_TEMPLATE
from tests.support.template_workers import HeldWorker, InlineWorker, OutOfMemoryWorker, pool

pytestmark = pytest.mark.unit

MAX_BYTES = 64 << 10
NESTED_LOOP = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
BIG_STRING = "{{ 'x'*10**7 }}"


def job(template: str, max_bytes: int = MAX_BYTES, **fields) -> dict:
    return {"template": template, "messages": [{"role": "user", "content": "Hi"}], "tools": None, "kwargs": {},
            "add_generation_prompt": True, "continue_final_message": False, "special_tokens": {"bos_token": "<s>"},
            "max_bytes": max_bytes, **fields}


@pytest.mark.parametrize("template, message", [
    (BIG_STRING, "a string of 10000000 characters with '*'"),
    ("{{ 10**7 * 'x' }}", "a string of 10000000 characters with '*'"),
    ("{{ ['a'] * 10**6 }}", "a list of 1000000 items with '*'"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
     "a string of 131072 characters with '+'"),
    ("{{ 2**100000 }}", f"an integer of about 200000 bits with '**'; at most {MAX_POWER_BITS}"),
    ("{% for a in range(2000) %}{% for b in range(2000) %}x{% endfor %}{% endfor %}",
     f"the rendered text passes {MAX_BYTES} characters"),
], ids=["str-times", "times-str", "list-times", "doubling-plus", "power", "output"])
def test_the_sandbox_stops_blow_ups_before_they_take_the_memory(template, message):
    """Each is refused as the operator is about to build it (or as the text passes the bound), not after."""
    with pytest.raises(RenderLimit) as e:
        render_job(job(template))
    assert message in str(e.value)
    assert reply(job(template)) == {"error": str(e.value), "limit": "output"}


def test_the_sandbox_renders_as_transformers_does():
    """The same variables (special tokens, tools, kwargs) and continue_final_message as transformers' own
    rendering, and ordinary arithmetic untouched."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "user", "content": "Weather?", "name": "ann"},
                {"role": "assistant", "content": "Let me", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}]}]
    for options in [dict(add_generation_prompt=True, kwargs={"enable_thinking": False}),
                    dict(add_generation_prompt=False, continue_final_message=True, kwargs={})]:
        text = render_job(job(TOOL_TEMPLATE, messages=messages, **options))
        kwargs = options.pop("kwargs")
        (want,), _ = render_jinja_template([messages], chat_template=TOOL_TEMPLATE, bos_token="<s>", **options,
                                           **kwargs)
        assert text == want
    assert want.endswith("Let me") and "<think>" not in want  # (the continued one)
    assert render_job(job("{{ 'ab' * 3 }} {{ 2**10 }} {{ [1] + [2] }} {{ 'a' + 'b' }} {{ 3 * 4 }}")) == \
        "ababab 1024 [1, 2] ab 12"
    assert reply(job("{{ raise_exception('no tools here') }}")) == {"error": "no tools here", "limit": "template"}


def test_limits_name_their_flags():
    for kw, flag in [({"timeout_s": 0}, "--chat-template-timeout"), ({"workers": 0}, "--chat-template-workers"),
                     ({"memory_bytes": 1 << 20}, "--chat-template-memory")]:
        with pytest.raises(ValueError, match=flag):
            TemplateLimits(**kw)
    assert [TemplateLimits(workers=n).per_tenant for n in (1, 2, 4, 5)] == [1, 1, 2, 2]


def test_a_render_past_its_time_is_refused_and_its_worker_replaced():
    async def scenario():
        p = pool(HeldWorker, timeout_s=0.05, workers=2)
        with pytest.raises(InvalidRequest) as e:
            await p.render(job(HeldWorker.HOLD), "a", "prompt.chat")
        first = HeldWorker.started[0]
        ok = await p.render(job("{{ messages[0].content }}"), "a", "prompt.chat")
        return str(e.value), first, ok, list(HeldWorker.started), p.workers, p.killed

    message, first, ok, started, alive, killed = asyncio.run(scenario())
    assert message == ("prompt.chat.chat_template: rendering took more than 0.05 s; at most 0.05 s "
                       "(--chat-template-timeout)")
    assert first.stopped and ok == "Hi" and len(started) == 2 and not started[1].stopped
    assert (alive, killed) == (1, 1)


def test_a_tenant_over_its_bound_waits_while_another_tenant_renders():
    """workers 2: a tenant renders one at a time. Tenant a's slow template holds its one; a's next request waits
    for it, while tenant b's request is answered; a's go on once its render ends."""
    async def scenario():
        p = pool(HeldWorker, timeout_s=30, workers=2)
        done: list[str] = []

        async def render(template: str, tenant: str, name: str) -> None:
            await p.render(job(template), tenant, "prompt.chat")
            done.append(name)

        slow = asyncio.create_task(render(HeldWorker.HOLD, "a", "a-slow"))
        await HeldWorker.rendering.wait()
        a_next = asyncio.create_task(render("{{ 1 }}", "a", "a-next"))
        await render("{{ 2 }}", "b", "b")
        waited = not a_next.done()
        HeldWorker.release.set()
        await asyncio.gather(slow, a_next)
        return done, waited, len(HeldWorker.started)

    done, waited, started = asyncio.run(scenario())
    assert done == ["b", "a-slow", "a-next"] and waited
    assert started == 2  # (a's next took a's worker back; b had the other)


def test_a_caller_that_goes_away_mid_render_takes_the_worker_with_it():
    """Its reply would otherwise be read as the next job's."""
    async def scenario():
        p = pool(HeldWorker, workers=2)
        task = asyncio.create_task(p.render(job(HeldWorker.HOLD), "a", "prompt.chat"))
        await HeldWorker.rendering.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return HeldWorker.started[0].stopped, p.workers

    assert asyncio.run(scenario()) == (True, 0)


def test_memory_and_output_refusals_name_their_limits():
    async def scenario():
        errors = []
        for worker, template, max_bytes in [(OutOfMemoryWorker, "{{ 1 }}", MAX_BYTES), (InlineWorker, BIG_STRING, 100)]:
            p = pool(worker, memory_bytes=256 << 20)
            with pytest.raises(InvalidRequest) as e:
                await p.render(job(template, max_bytes), "a", "chat")
            errors.append((str(e.value), worker.started[0].stopped, p.workers))
        return errors

    memory, output = asyncio.run(scenario())
    assert memory == ("chat.chat_template: rendering needed more than 256 MiB of memory; at most 256 MiB "
                      "(--chat-template-memory)", True, 0)
    assert output == ("chat.chat_template: the template would build a string of 10000000 characters with '*'; at "
                      "most 100 bytes of text (--max-prompt-bytes: a rendered chat is a prompt)", False, 1)


def test_close_kills_idle_and_rendering_workers_and_refuses_later_renders():
    async def scenario():
        p = pool(HeldWorker, workers=4)
        held = asyncio.create_task(p.render(job(HeldWorker.HOLD), "b", "prompt.chat"))
        await HeldWorker.rendering.wait()
        await p.render(job("{{ 1 }}"), "a", "prompt.chat")  # (a second worker, idle after)
        await p.close()
        with pytest.raises(InvalidRequest) as in_flight:
            await held
        with pytest.raises(InvalidRequest) as later:
            await p.render(job("{{ 1 }}"), "a", "prompt.chat")
        return [w.stopped for w in HeldWorker.started], p.workers, str(in_flight.value), str(later.value)

    stopped, alive, in_flight, later = asyncio.run(scenario())
    assert stopped == [True, True] and alive == 0
    assert in_flight.startswith("prompt.chat.chat_template: its render ended without an answer")
    assert later == "prompt.chat.chat_template: the scheduler is shutting down"


def test_a_worker_that_fails_to_start_is_tried_again():
    tries: list[bool] = []

    async def flaky(limits: TemplateLimits) -> InlineWorker:  # (fails its first start, then works)
        tries.append(True)
        if len(tries) == 1:
            raise WorkerGone("exit code -11")
        return await InlineWorker.start(limits)

    gone: list[bool] = []

    async def broken(limits: TemplateLimits) -> InlineWorker:  # (never starts: three tries, then the error)
        gone.append(True)
        raise WorkerGone("exit code -11")

    async def scenario():
        text = await TemplatePool(start_worker=flaky).render(job("{{ 2 + 3 }}"), "a", "prompt.chat")
        with pytest.raises(RuntimeError, match="the chat template worker did not start: exit code -11"):
            await TemplatePool(start_worker=broken).render(job("{{ 1 }}"), "a", "prompt.chat")
        return text

    assert asyncio.run(scenario()) == "5" and len(tries) == 2 and len(gone) == 3
