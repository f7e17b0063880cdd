"""Executor plans for tests of the executor itself: tiny-llama's limits and a NewRequest builder."""

from __future__ import annotations

from pagedkv.executor.v1 import executor_pb2 as pb

VOCAB, MAX_POSITIONS, BLOCK = 259, 2048, 16  # tiny-llama


def new_request(rid: str, tokens: list[int], pages: list[int], computed: int = 0, **sampling) -> pb.NewRequest:
    return pb.NewRequest(request_id=rid, token_ids=tokens, num_computed_tokens=computed,
                         num_scheduled_tokens=len(tokens) - computed, page_ids=pages,
                         sampling=pb.SamplingParams(**sampling))
