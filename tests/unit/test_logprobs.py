"""Log-probabilities on the executor: the batched sampler's top-N (``sample``'s ``top``, ``token_logprobs``) against
log_softmax and topk of each row on its own, for rows that ask and rows that do not, greedy and sampled, with logits
controls that must not touch them; and the runner's prompt rows (``SamplingParams.prompt_logprobs``) against one
full forward of the prompt, chunked, resent after a recompute, for a fork parent that never samples, and through a
captured decode graph's step (which then runs eager)."""

from __future__ import annotations

import pytest
import torch

from executor_svc.batch import prompt_rows
from executor_svc.plan_check import RequestState, Scheduled
from executor_svc.sampler import SamplingParams, sample, token_logprobs
from pagedkv.executor.v1 import executor_pb2 as pb
from tests.support.fake_executor import samples

pytestmark = pytest.mark.unit

VOCAB = 300


def _reference(raw: torch.Tensor, token: int, k: int) -> tuple[float, list[int], list[float]]:
    lp = torch.log_softmax(raw, -1)
    top = torch.topk(lp, k) if k else None
    return float(lp[token]), (top.indices.tolist() if k else []), (top.values.tolist() if k else [])


def test_top_logprobs_of_the_rows_that_ask_equal_each_row_alone():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, VOCAB, generator=g) * 3
    params = [SamplingParams(logprobs=True, top_logprobs=5), SamplingParams(),
              SamplingParams(temperature=0.8, seed=4, logprobs=True, top_logprobs=20),
              SamplingParams(logprobs=True), SamplingParams(temperature=1.2, seed=9, top_p=0.9),
              SamplingParams(logprobs=True, top_logprobs=1, repetition_penalty=1.5),
              SamplingParams(temperature=0.7, seed=1, logprobs=True, top_logprobs=3, logit_bias=((7, 100.0),)),
              SamplingParams(logprobs=True, top_logprobs=2, allowed_token_ids=(11, 12)),
              SamplingParams(temperature=0.5, seed=2), SamplingParams(logprobs=True, top_logprobs=VOCAB)]
    from executor_svc.sampler import History

    history = History(torch.tensor([0, 0]), torch.tensor([5, 6]), torch.tensor([1, 0]))  # (the penalised row's)
    got = sample(logits, params, [2] * 10, history)
    assert got.top is not None
    for i, p in enumerate(params):
        lp, ids, values = _reference(logits[i], got.tokens[i], p.top_logprobs)
        if p.logprobs or p.top_logprobs:
            assert got.logprobs[i] == pytest.approx(lp, abs=1e-6)  # the raw distribution's, controls or not
        else:
            assert got.logprobs[i] == 0.0
        assert got.top.top_ids[i] == ids and got.top.top_logprobs[i] == pytest.approx(values, abs=1e-6)
        alone = sample(logits[i:i + 1], [p], [2], history if i == 5 else None)
        assert alone.tokens[0] == got.tokens[i]
        assert (alone.top.top_ids[0] if alone.top else []) == ids
    # the controls drew these tokens; the log-probabilities stay the raw logits' (checked against them above)
    assert got.tokens[6] == 7 and got.tokens[7] in (11, 12) and got.top.top_ids[7] != [11, 12]
    assert len(got.top.top_ids[9]) == VOCAB  # the whole vocabulary, sorted


def test_no_row_asking_costs_no_top_and_rows_without_top_get_none():
    logits = torch.randn(4, VOCAB)
    assert sample(logits, [SamplingParams()] * 4, [0] * 4).top is None
    only_logprobs = sample(logits, [SamplingParams(logprobs=True)] * 4, [0] * 4)
    assert only_logprobs.top is None and all(lp < 0 for lp in only_logprobs.logprobs)


def test_token_logprobs_of_mixed_ks():
    g = torch.Generator().manual_seed(5)
    raw = torch.randn(6, VOCAB, generator=g)
    targets, ks = [1, 2, 3, 4, 5, 6], [0, 4, 0, 1, 20, 0]
    got = token_logprobs(raw, targets, ks)
    for i in range(6):
        lp, ids, values = _reference(raw[i], targets[i], ks[i])
        assert got.logprobs[i] == pytest.approx(lp, abs=1e-6)
        assert got.top_ids[i] == ids and got.top_logprobs[i] == pytest.approx(values, abs=1e-6)
    none = token_logprobs(raw, targets, [0] * 6)
    assert none.top_ids == [[]] * 6 and none.logprobs == pytest.approx(got.logprobs) and none.ranks is None
    lp = torch.log_softmax(raw, -1)
    ranked = token_logprobs(raw, targets, ks, ranks=True).ranks
    assert ranked == [int((lp[i] > lp[i, t]).sum()) + 1 for i, t in enumerate(targets)]
    top1 = lp.argmax(-1).tolist()
    assert token_logprobs(raw, top1, ks, ranks=True).ranks == [1] * 6


# ---- the runner's prompt rows ---------------------------------------------------------------------------
def test_prompt_rows_are_the_positions_before_the_prompt_end():
    def item(tokens: int, outputs: int, start: int, count: int, ask: bool = True) -> Scheduled:
        st = RequestState(list(range(tokens)), start, [0], SamplingParams(prompt_logprobs=ask), outputs,
                          num_prompt=tokens - outputs)
        return Scheduled("r", st, start, count)

    scheduled = [item(10, 0, 0, 4), item(10, 0, 4, 6, ask=False), item(10, 0, 4, 6), item(12, 2, 0, 12),
                 item(10, 0, 9, 1), item(5, 0, 4, 1)]
    rows = prompt_rows(scheduled)
    # (row, first token, count): positions 0-3 give tokens 1-4; 4-8 give 5-9 (position 9 predicts the output);
    # a recomputed request's outputs are not prompt; a decode at the prompt's last position has none
    assert rows.spans == [(0, 1, 4), (2, 5, 5), (3, 1, 9)]
    assert rows.flat == [0, 1, 2, 3, 10, 11, 12, 13, 14, *range(16, 25)]  # (tokens lie in plan order)
    assert prompt_rows([item(10, 0, 0, 10, ask=False)]) is None


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    from tests.support.inprocess import InProcessServer

    return InProcessServer(tiny_llama_dir, num_pages=32).runner


def _full_logprobs(runner, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of the prompt, in one forward (its own pages)."""
    plan = pb.StepPlan(step_id=1000)
    plan.new_requests.add(request_id="ref", token_ids=prompt, num_scheduled_tokens=len(prompt),
                          page_ids=list(range(20, 20 + -(-len(prompt) // 16))))
    scheduled = runner.mirror.apply(plan)
    ids, positions, meta, _ = runner._build_batch(scheduled)
    logits = runner.model.forward(ids, positions, meta, runner.pool, runner.attention,
                                  torch.arange(len(prompt)))
    runner.mirror.apply(pb.StepPlan(step_id=1001, forget=["ref"]))
    return torch.log_softmax(logits, -1)


def _entries(result: pb.StepResult) -> dict[int, tuple[int, list[float], list[int], list[float]]]:
    for e in result.prompt_logprobs:
        assert len(e.ranks) == len(e.logprobs) and min(e.ranks) >= 1
    return {e.row: (e.first_token, list(e.logprobs), list(e.top_token_ids), list(e.top_logprobs))
            for e in result.prompt_logprobs}


def test_chunked_prompt_logprobs_equal_one_forward_of_the_prompt(runner):
    prompt = [1] + [3 + (i * 37) % 250 for i in range(40)]
    ref = _full_logprobs(runner, prompt)
    k = 3
    sampling = pb.SamplingParams(logprobs=True, prompt_logprobs=True, prompt_top_logprobs=k)
    first = pb.StepPlan(step_id=1)
    first.new_requests.add(request_id="a", token_ids=prompt, num_scheduled_tokens=17, page_ids=[0, 1, 2],
                           sampling=sampling)
    first.new_requests.add(request_id="b", token_ids=prompt[:9], num_scheduled_tokens=9, page_ids=[3])  # asks none
    second = pb.StepPlan(step_id=2, decodes=["b"])
    second.continuing.add(request_id="a", num_scheduled_tokens=len(prompt) - 17)
    got: dict[int, tuple[float, list[int], list[float]]] = {}
    for plan in (first, second):
        result = runner.step(plan)
        assert not result.error, result.error
        entries = _entries(result)
        assert set(entries) == {0}  # row 0 (a) only: b asked for none
        first_token, lps, ids, values = entries[0]
        for j, lp in enumerate(lps):
            got[first_token + j] = (lp, ids[j * k:(j + 1) * k], values[j * k:(j + 1) * k])
    assert [s[0] for s in samples(second, result)] == ["a", "b"]  # a sampled at its prompt's end, as ever
    assert sorted(got) == list(range(1, len(prompt)))  # every prompt token after the first, once
    for t, (lp, ids, values) in got.items():
        row = ref[t - 1]
        assert lp == pytest.approx(float(row[prompt[t]]), abs=1e-4)
        top = torch.topk(row, k)
        assert ids == top.indices.tolist() and values == pytest.approx(top.values.tolist(), abs=1e-4)
    runner.mirror.apply(pb.StepPlan(step_id=3, forget=["a", "b"]))
    assert not runner.mirror.prompt_logprobs


def test_a_resent_request_gets_its_prompts_rows_only_and_a_parent_never_samples(runner):
    prompt = [1] + [5 + (i * 11) % 200 for i in range(20)]
    ref = _full_logprobs(runner, prompt)
    sampling = pb.SamplingParams(prompt_logprobs=True)
    plan = pb.StepPlan(step_id=10)
    # recomputed after a preemption: prompt + 3 outputs; a fork parent: its whole prompt, all but the last computed
    plan.new_requests.add(request_id="re", token_ids=prompt + [7, 8, 9], num_scheduled_tokens=len(prompt) + 3,
                          page_ids=[0, 1], sampling=sampling, num_output_tokens=3)
    plan.new_requests.add(request_id="parent", token_ids=prompt, num_scheduled_tokens=len(prompt) - 1,
                          page_ids=[2, 3], sampling=sampling)
    result = runner.step(plan)
    assert not result.error, result.error
    assert [s[0] for s in samples(plan, result)] == ["re"]  # the parent stopped one short of its tokens
    entries = _entries(result)
    for row in (0, 1):
        first_token, lps, ids, values = entries[row]
        assert first_token == 1 and len(lps) == len(prompt) - 1 and ids == [] and values == []
        assert lps == pytest.approx([float(ref[t - 1][prompt[t]]) for t in range(1, len(prompt))], abs=1e-4)
    runner.mirror.apply(pb.StepPlan(step_id=11, forget=["re", "parent"]))


def test_prompt_rows_in_a_decode_only_step_run_eager_beside_a_graph(tiny_llama_dir):
    """One-token prompt chunks that would ride a captured decode graph: their prompt rows need logits the graph does
    not give, so the step runs eager, and its samples equal the graph runner's without prompt log-probabilities."""
    from tests.unit.test_cuda_graphs import _graph_server

    graphed = _graph_server(tiny_llama_dir, 8, max_batch=4, captures=[]).runner
    plain = _graph_server(tiny_llama_dir, 8, max_batch=4, captures=[]).runner
    replays = {"graphed": 0, "plain": 0}
    for name, r in (("graphed", graphed), ("plain", plain)):
        def counted(rows, run=r.graphs.run, name=name):
            replays[name] += 1
            return run(rows)
        r.graphs.run = counted
    prompt = [1, 9, 4, 7, 5]

    def plans(ask: bool) -> list[pb.StepPlan]:
        out = []
        for step in range(len(prompt)):
            plan = pb.StepPlan(step_id=step + 1)
            if step == 0:
                plan.new_requests.add(request_id="a", token_ids=prompt, num_scheduled_tokens=1, page_ids=[0],
                                      sampling=pb.SamplingParams(prompt_logprobs=ask))
            else:
                plan.decodes.append("a")
            out.append(plan)
        return out

    got = [graphed.step(p) for p in plans(True)]
    want = [plain.step(p) for p in plans(False)]
    assert [len(r.prompt_logprobs) for r in got] == [1, 1, 1, 1, 0]
    assert [r.prompt_logprobs[0].first_token for r in got[:4]] == [1, 2, 3, 4]
    assert [list(r.sampled_token_ids) for r in got] == [list(r.sampled_token_ids) for r in want]
    assert replays == {"graphed": 1, "plain": 5}  # (the steps with prompt rows ran eager)
