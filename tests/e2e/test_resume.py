"""The resume defaults of `pagedkv generate`, the gateway and the Client (its gRPC channel makes this e2e; the
rest of the resume tests are tests/unit/test_resume.py and test_resume_client.py, the real thing
tests/e2e/test_resume_e2e.py)."""

from __future__ import annotations

import asyncio

import pytest

from pagedkv.client import Client, ResumePolicy

pytestmark = pytest.mark.e2e


def test_generate_and_the_gateway_resume_by_default():
    """pagedkv generate: ResumePolicy's defaults unless told; 0 attempts: never; a negative count is refused. The
    gateway's: the same, except that a full queue before anything was sent is passed on (its 429)."""
    from pagedkv.cli import build_parser
    from pagedkv.gateway.upstream import GATEWAY_RESUME
    from pagedkv.resume_policy import DEFAULT_RESUME, resume_policy

    parse = build_parser().parse_args
    assert resume_policy(parse(["generate", "hi"])) == DEFAULT_RESUME == ResumePolicy()
    assert resume_policy(parse(["generate", "hi", "--resume-attempts", "0"])) is None
    assert resume_policy(parse(["generate", "hi", "--resume-attempts", "2", "--resume-timeout", "9"])) == ResumePolicy(
        attempts=2, timeout_s=9.0)
    for bad in (["--resume-attempts", "-1"], ["--resume-timeout", "0"]):
        with pytest.raises(ValueError, match="--resume-"):
            resume_policy(parse(["generate", "hi", *bad]))
    assert resume_policy(parse(["gateway"])) == DEFAULT_RESUME and not GATEWAY_RESUME.queue_full_at_start

    async def client_default() -> ResumePolicy | None:
        async with Client("127.0.0.1:1") as client:
            return client.resume
    assert asyncio.run(client_default()) == DEFAULT_RESUME
