"""How a broken Generate stream is resumed (pagedkv.client's resumable_generate): the policy, and the command-line
flags that set it for `pagedkv generate` and the gateway."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ResumePolicy:
    """How a broken Generate stream is resumed. A break starts an outage; it ends when a call delivers a message.
    Within one outage at most ``attempts`` calls are made after the one that broke, the n-th after a backoff of
    ``backoff_s`` x 2^(n-1) (at most ``max_backoff_s``) and, once the channel has no scheduler to talk to, after one
    answers again; ``timeout_s`` after the break the outage is over and the last error is raised.
    ``queue_full_at_start``: a full queue before anything arrived is waited out too (False: raised at once, for a
    front that passes it on, as the gateway answers 429 with Retry-After); once tokens arrived it always is."""

    attempts: int = 5
    timeout_s: float = 60.0
    backoff_s: float = 0.25
    max_backoff_s: float = 4.0
    queue_full_at_start: bool = True

    def backoff(self, failures: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))


DEFAULT_RESUME = ResumePolicy()  # Client's, pagedkv generate's and the gateway's


def add_resume_args(p: argparse.ArgumentParser, note: str = "") -> None:
    """--resume-attempts, --resume-timeout: how a stream whose scheduler went away is resumed (pagedkv.client);
    ``note``: what the command does otherwise, added to the help."""
    p.add_argument("--resume-attempts", type=int, default=DEFAULT_RESUME.attempts, metavar="N",
                   help="a stream that breaks before its end (its scheduler killed or restarting, the connection "
                   "lost, a full queue) is resumed on any scheduler the address reaches, with the tokens received "
                   f"so far: nothing is lost or repeated.{note} At most N new calls per break (until one delivers "
                   "a token), with backoff (0: never resume; default: %(default)s)")
    p.add_argument("--resume-timeout", type=float, default=DEFAULT_RESUME.timeout_s, metavar="S",
                   help="seconds from a break until resuming gives up (default: %(default)s)")


def resume_policy(args: argparse.Namespace) -> ResumePolicy | None:
    """The ResumePolicy that --resume-attempts and --resume-timeout ask for (None: never resume)."""
    if args.resume_attempts < 0:
        raise ValueError(f"--resume-attempts {args.resume_attempts}: must be >= 0 (0: never resume)")
    if not args.resume_timeout > 0:
        raise ValueError(f"--resume-timeout {args.resume_timeout}: must be > 0")
    return ResumePolicy(attempts=args.resume_attempts, timeout_s=args.resume_timeout) if args.resume_attempts else None
