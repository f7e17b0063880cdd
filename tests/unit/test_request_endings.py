"""Every request ending goes through one door (#51): ``outputs.final`` builds a request's last message and marks it
finished, whoever ends it (its planner, the unplaced queue, the grammar hold, shutdown, a revoked key). The scan below
finds any other place in scheduler_svc that builds a final ``Output`` or marks a request finished; the other tests
pin what each kind of ending says, as before the door, and the unplaced queue (unplaced.py) and the in-flight counts
(``Request.count``/``uncount``) on their own."""

from __future__ import annotations

import ast
import asyncio
import tempfile
from pathlib import Path

import pytest

from scheduler_svc.outputs import Ending, final
from scheduler_svc.request import Finish
from scheduler_svc.unplaced import UnplacedQueue
from tests.support.fake_cluster import Box, new_cluster, until, up_cluster
from tests.support.fake_executor import make_request
from tests.support.recording_log import RecordingLog

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# (module, function) allowed to build an Output with a finish: the door, and the stream's reader, which joins a
# run of tokens with the final message right behind it (the door built that one)
BUILDS_FINAL = {("scheduler_svc.outputs", "final"), ("scheduler_svc.request", "get_nowait")}
# (module, function) allowed to set ``req.finish``: the door, and the planner's queues as the request leaves them
MARKS_FINISHED = {("scheduler_svc.outputs", "final"), ("scheduler_svc.queues", "finish")}


def endings_outside_the_door(root: Path = ROOT, package: str = "scheduler_svc") -> list[str]:
    """Where a module of ``package`` builds an ``Output`` with a finish (its fourth argument, or ``finish=``), or sets
    a ``.finish`` attribute, outside the functions allowed to."""
    if not (root / package).is_dir():  # (a scan of nothing finds nothing: a wrong root must not pass)
        raise FileNotFoundError(f"{root / package}: no such package")
    found = []
    for path in sorted((root / package).glob("*.py")):
        mod = f"{package}.{path.stem}"
        tree = ast.parse(path.read_text(), str(path))
        owner = {}  # node -> the innermost function holding it
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    owner[node] = fn.name  # (inner functions are walked later: they win)
        for node in ast.walk(tree):
            where = (mod, owner.get(node, ""))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Output"
                    and (len(node.args) > 3 or any(k.arg == "finish" for k in node.keywords))
                    and where not in BUILDS_FINAL):
                found.append(f"{mod}:{node.lineno}: a final Output built in {where[1] or 'the module'}")
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                if (isinstance(t, ast.Attribute) and t.attr == "finish" and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self") and where not in MARKS_FINISHED):
                    found.append(f"{mod}:{node.lineno}: a request marked finished in {where[1] or 'the module'}")
    return sorted(found)


def test_every_ending_goes_through_the_door():
    assert endings_outside_the_door() == []


def test_the_scan_sees_an_ending_outside_the_door():
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "scheduler_svc"
        pkg.mkdir()
        (pkg / "outputs.py").write_text("def final(req, finish):\n    req.finish = finish\n"
                                        "    return Output('', [], [], finish)\n")
        (pkg / "shutdown.py").write_text("def end(req, error):\n    req.finish = Finish.ABORT\n"
                                         "    return Output('', [], [], Finish.ABORT, error=error)\n"
                                         "def token(req):\n    return Output('x', [1], [], index=req.index)\n"
                                         "def cut(req):\n    return Output('', [], [], finish=Finish.ABORT)\n")
        assert endings_outside_the_door(Path(tmp)) == [
            "scheduler_svc.shutdown:2: a request marked finished in end",
            "scheduler_svc.shutdown:3: a final Output built in end",
            "scheduler_svc.shutdown:7: a final Output built in cut",
        ]


# ---- what each ending says (as each path said before the door) -----------------------------------
def test_an_ending_by_the_planner_has_the_text_left_and_the_usage_with_cached_tokens():
    req = make_request(1, 8, 4, index=2, num_cached_tokens=4, output_ids=[7, 7])
    out = final(req, Finish.LENGTH, "", "")
    assert req.finish is Finish.LENGTH
    assert (out.finish, out.index, out.prompt_tokens, out.completion_tokens, out.cached_tokens, out.error) == (
        Finish.LENGTH, 2, 8, 2, 4, "")


def test_an_ending_before_any_planner_has_its_usage_but_no_text_nor_cached_tokens():
    req = make_request(1, 8, 4, index=1, num_cached_tokens=4, output_ids=[7])
    out = final(req, Finish.ABORT, error="refused", error_code="INVALID_ARGUMENT", ending=Ending.UNPLACED)
    assert req.finish is Finish.ABORT
    assert (out.text, out.finish, out.error, out.error_code, out.index) == (
        "", Finish.ABORT, "refused", "INVALID_ARGUMENT", 1)
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (8, 1, 0)


def test_a_cut_stream_says_its_error_alone_and_leaves_the_request_to_its_planner():
    req = make_request(1, 8, 4, index=3, output_ids=[7])
    out = final(req, Finish.ABORT, error="revoked", ending=Ending.CUT)
    assert req.finish is None
    assert (out.text, out.finish, out.error, out.index, out.prompt_tokens, out.completion_tokens) == (
        "", Finish.ABORT, "revoked", 3, 0, 0)


# ---- the unplaced queue ------------------------------------------------------------------------
def test_the_unplaced_queue_holds_in_order_and_counts_by_tenant():
    log = RecordingLog()
    q = UnplacedQueue(30.0, log)
    a, b, c = make_request(1, 4, 4, tenant="t"), make_request(2, 4, 4), make_request(3, 4, 4, tenant="t")
    q.hold(a)
    q.hold(b, deadline=5.0)
    q.hold(c, front=True)
    assert len(q) == 3 and q.queued("t") == (2, 3) and q.queued("u") == (0, 3)
    assert [e for e, _ in log.lines] == ["request_unplaced"] * 3
    q.abort(b.group)
    assert q.queued("default") == (0, 2)
    taken = q.take_all()
    assert [r for r, _ in taken] == [c, a] and len(q) == 0 and q.queued("t") == (0, 0)


def test_held_requests_end_at_their_deadline_with_their_usage():
    q = UnplacedQueue(2.5, RecordingLog())
    late, early = make_request(1, 6, 4, output_ids=[7, 7]), make_request(2, 4, 4)
    q.hold(early, deadline=10.0)
    q.hold(late, deadline=20.0)
    q.expire(5.0)
    assert len(q) == 2 and early.outbox.empty()
    q.expire(10.0)
    assert len(q) == 1 and late.outbox.empty() and early.finish is Finish.ABORT
    out = early.outbox.get_nowait()
    assert out.error == "no executor that can hold this request was available for 2.5s"
    assert (out.finish, out.prompt_tokens, out.completion_tokens) == (Finish.ABORT, 4, 0)
    q.fail(lambda _deadline: True, "shut down")
    out = late.outbox.get_nowait()
    assert len(q) == 0 and (out.error, out.prompt_tokens, out.completion_tokens) == ("shut down", 6, 2)


# ---- the in-flight counts ----------------------------------------------------------------------
def test_a_step_counted_then_uncounted_leaves_only_what_it_computed():
    req = make_request(1, 4, 4)
    assert req.count(3, now=7) == (req, 3, False)  # (a prefill chunk short of the prompt: no sample)
    assert req.count(1, now=8) == (req, 1, True)  # the last prompt token: it samples
    assert (req.num_computed, req.num_inflight_tokens, req.num_pending, req.last_scheduled) == (4, 4, 1, 8)
    req.uncount(3, False)
    req.uncount(1, True)
    assert (req.num_computed, req.num_inflight_tokens, req.num_pending, req.in_flight) == (4, 0, 0, False)


# ---- shutdown: Cluster.fail_all -----------------------------------------------------------------
def test_shutdown_cuts_live_streams_and_ends_held_requests(boxes):
    """A request on a stopped executor gets the error alone (its planner is gone: the request stays as it was); one
    held unplaced ends with its usage, as each did before the door."""
    def last(req):
        outs = []
        while not req.outbox.empty():
            outs.append(req.outbox.get_nowait())
        return outs[-1]

    async def scenario():
        boxes["a:1"] = Box(64)
        boxes["a:1"].delay = 0.05
        c = await up_cluster({"a:1"})
        live = make_request(1, 8, 1000)
        c.add_request(live)
        await until(lambda: live.output_ids)
        await c.stop()
        c.fail_all("shut down")
        held = make_request(2, 6, 4)
        idle = new_cluster()
        idle.add_request(held)
        assert idle.reports.num_unplaced == 1 and idle.queued("default") == (1, 1)
        idle.fail_all("shut down")
        assert idle.reports.num_unplaced == 0
        return last(live), last(held), live, held

    cut, ended, live, held = asyncio.run(scenario())
    assert (cut.finish, cut.error, cut.text, cut.prompt_tokens, cut.completion_tokens) == (
        Finish.ABORT, "shut down", "", 0, 0) and live.finish is None
    assert (ended.finish, ended.error, ended.prompt_tokens, ended.completion_tokens) == (
        Finish.ABORT, "shut down", 6, 0) and held.finish is Finish.ABORT
