"""What a model would answer to scheduler_overhead.py's plans, without the model: ``_result_for`` (one token for every
request that caught up), and the no-op executor that answers with it over gRPC (``--serve-noop``, a process of its
own)."""

from __future__ import annotations

from pagedkv import grpc_common
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedkv.wire import EXECUTOR_PROTOCOL

BLOCK = 16


def _result_for(plan: pb.StepPlan, known: dict[str, list[int]]) -> pb.StepResult:
    """What a model would answer, without the model: one token for every request that caught up."""
    result = pb.StepResult(step_id=plan.step_id)
    for rid in plan.forget:
        known.pop(rid, None)
    for new in plan.new_requests:
        known[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
    sampled = []
    items = [(r.request_id, r.num_scheduled_tokens) for r in plan.new_requests]
    items += [(c.request_id, c.num_scheduled_tokens) for c in plan.continuing]
    for row, (rid, n) in enumerate(items):
        total, done = known[rid]
        done += n
        if done == total:
            total += 1
            sampled.append(row)
        known[rid] = [total, done]
    for row, rid in enumerate(plan.decodes, len(items)):  # caught up by definition: one more token
        st = known[rid]
        st[0] += 1
        st[1] += 1
        sampled.append(row)
    result.num_computed_tokens = sum(n for _, n in items) + len(plan.decodes)
    result.sampled_rows.extend(sampled)  # (rows: new_requests, continuing, then decodes)
    result.sampled_token_ids.extend([7] * len(sampled))
    result.sampled_logprobs.extend([0.0] * len(sampled))
    return result


# ---- the no-op executor ------------------------------------------------------------------------------
class NoopExecutor(pb_grpc.ExecutorServicer):
    def __init__(self, num_pages: int) -> None:
        self.describe = pb.DescribeResponse(model="noop", protocol=EXECUTOR_PROTOCOL,
                                            num_device_pages=num_pages, block_size=BLOCK,
                                            vocab_size=259, max_position_embeddings=1 << 20, executor_id="noop")

    async def Describe(self, request, context):  # noqa: N802
        return self.describe

    async def Run(self, request_iterator, context):  # noqa: N802
        known: dict[str, list[int]] = {}
        async for plan in request_iterator:
            yield _result_for(plan, known)


async def serve_noop(port: int, num_pages: int) -> None:
    server = grpc_common.new_server()
    pb_grpc.add_ExecutorServicer_to_server(NoopExecutor(num_pages), server)
    health = grpc_common.add_health_and_reflection(server, [pb.DESCRIPTOR.services_by_name["Executor"].full_name])
    grpc_common.bind(server, "127.0.0.1", port)
    await server.start()
    await grpc_common.set_serving(health, [pb.DESCRIPTOR.services_by_name["Executor"].full_name], True)
    print("noop_ready", flush=True)
    await server.wait_for_termination()
