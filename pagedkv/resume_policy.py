"""How a broken Generate stream is resumed (pagedkv.resumable_stream's resumable_generate): the policy, and the
command-line flags that set it for `pagedkv generate` and the gateway."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class ResumePolicy:
    """How a broken Generate stream is resumed. A break starts an outage; it ends when a call delivers a message.
    Within one outage at most ``attempts`` calls are made after the one that broke, the n-th after a backoff of
    ``backoff_s`` x 2^(n-1) (at most ``max_backoff_s``) and, once the channel has no scheduler to talk to, after one
    answers again; ``timeout_s`` after the break the outage is over and the last error is raised. ``window_s``: how
    long an outage is waited out when every call is refused at once (a scheduler that answers UNAVAILABLE "no executor
    is up" while its executor restarts): the backoffs of ``attempts`` calls, at most ``timeout_s``.
    ``queue_full_at_start``: a full queue before anything arrived is waited out too (False: raised at once, for a
    front that passes it on, as the gateway answers 429 with Retry-After); once tokens arrived it always is.

    The defaults' window is ``timeout_s``, 60 s (their attempts would last longer: the timeout ends an outage first).
    It covers an executor that ``pagedkv serve`` restarts: its supervisor waits 1 s after a crash, doubling up to 30 s
    while the executor keeps crashing, and then the executor starts (tiny-llama, three kills -9 in a row: serving
    again after 3.8, 4.8, 6.8 s on an idle 2-core machine, 6.9, 9.0, 9.9 s on a busy one; bench/executor_restart.py),
    with 20 s left for a larger model's start. The scheduler's refusal carries no retry hint: it cannot know when an
    executor will be back (serve's supervisor, Kubernetes or compose restarts it, or nobody)."""

    attempts: int = 40
    timeout_s: float = 60.0
    backoff_s: float = 0.25
    max_backoff_s: float = 2.0
    queue_full_at_start: bool = True

    def backoff(self, failures: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))

    @property
    def window_s(self) -> float:
        """Seconds from a break to the last call of an outage whose every call is refused at once."""
        return min(self.timeout_s, sum(self.backoff(n) for n in range(1, self.attempts + 1)))


DEFAULT_RESUME = ResumePolicy()  # Client's, pagedkv generate's and the gateway's


def add_resume_args(p: argparse.ArgumentParser, note: str = "") -> None:
    """--resume-attempts, --resume-timeout: how a stream whose scheduler went away is resumed (pagedkv.client);
    ``note``: what the command does otherwise, added to the help."""
    d = DEFAULT_RESUME
    p.add_argument("--resume-attempts", type=int, default=d.attempts, metavar="N",
                   help="a stream that breaks before its end (its scheduler killed or restarting, no executor up "
                   "while one restarts, the connection lost, a full queue) is resumed on any scheduler the address "
                   f"reaches, with the tokens received so far: nothing is lost or repeated.{note} At most N new calls "
                   f"per break (until one delivers a token), the n-th after {d.backoff_s:g} s x 2^(n-1), at most "
                   f"{d.max_backoff_s:g} s: where every call is refused at once, 5 calls give up after "
                   f"{replace(d, attempts=5).window_s:g} s, the default's outlast --resume-timeout (0: never resume; "
                   "default: %(default)s)")
    p.add_argument("--resume-timeout", type=float, default=d.timeout_s, metavar="S",
                   help="seconds from a break until resuming gives up: how long a scheduler or executor restart is "
                   "waited out (pagedkv serve restarts a killed executor after 1 s, up to 30 s while it keeps "
                   "crashing, plus its start); fewer --resume-attempts give up sooner (default: %(default)s)")


def resume_policy(args: argparse.Namespace) -> ResumePolicy | None:
    """The ResumePolicy that --resume-attempts and --resume-timeout ask for (None: never resume)."""
    if args.resume_attempts < 0:
        raise ValueError(f"--resume-attempts {args.resume_attempts}: must be >= 0 (0: never resume)")
    if not args.resume_timeout > 0:
        raise ValueError(f"--resume-timeout {args.resume_timeout}: must be > 0")
    return ResumePolicy(attempts=args.resume_attempts, timeout_s=args.resume_timeout) if args.resume_attempts else None
