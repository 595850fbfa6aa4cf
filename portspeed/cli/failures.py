"""Which rank died and why, for the last line `portspeed run` prints.

Why: torchrun's elastic agent restarts a failed worker group (``--max-restarts``) without
saying which rank failed, and when it gives up it prints a multi-line report whose root
cause is in the middle. A user (and a test) wants one closing line: the rank, its exit
code or signal, and whether the group was restarted.

``watch_failures()`` observes the agent's own monitoring in this launcher process only
(the result of ``LocalElasticAgent._monitor_workers``, read, never changed; put back on
exit); the workers and the training script are untouched.

It also reaps what a dead worker left behind. torchrun starts each worker in its own process
group and, after a failure, signals the groups of the workers still running, not of the one
that died. A worker that dies hard (killed, ``os._exit``) leaves its helpers orphaned: Megatron's
checkpoint writer, for one, starts a multiprocessing Manager (``filesystem_async``) that then
runs forever, holding the launcher's output pipes open. So the process group of every failed
worker is sent SIGKILL as soon as the agent reports it (found in a fault test of this issue).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
from typing import Any, Iterator

__all__ = ["Failure", "watch_failures", "describe", "summary_line"]


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failed worker of one attempt (attempt 0 is the first start)."""

    attempt: int
    rank: int
    local_rank: int
    exitcode: int
    host: str

    def why(self) -> str:
        if self.exitcode < 0:
            try:
                return f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"killed by signal {-self.exitcode}"
        return f"exit code {self.exitcode}"


def describe(f: Failure) -> str:
    return f"rank {f.rank} (local rank {f.local_rank} on {f.host}) {f.why()}"


def _reap(pid: int) -> None:
    """SIGKILL what is left of the process group a failed worker led (its pid is its group's id)."""
    if pid <= 0 or not hasattr(os, "killpg"):
        return
    try:
        if os.getpgid(pid) != pid:  # the worker still runs and is not a group leader: nothing of ours
            return
    except ProcessLookupError:
        pass  # the worker is gone; its group lives on while any member does
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def watch_failures() -> Iterator[list[Failure]]:
    """Collect every failed worker the local agent sees, attempt by attempt, while the block runs."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    seen: list[Failure] = []
    original = LocalElasticAgent._monitor_workers

    def monitor(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        if result.failures:
            attempt = worker_group.spec.max_restarts - getattr(self, "_remaining_restarts", worker_group.spec.max_restarts)
            # the root cause first: the agent stops the others with SIGTERM after the first failure,
            # and timestamps are whole seconds, so a SIGTERM exit sorts after any other failure
            def order(kv: Any) -> tuple:
                return (kv[1].exitcode == -signal.SIGTERM, kv[1].timestamp, kv[0])

            for rank, failure in sorted(result.failures.items(), key=order):
                seen.append(Failure(attempt, int(rank), int(failure.local_rank), int(failure.exitcode),
                                    socket.gethostname()))
                _reap(int(failure.pid))
        return result

    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]


def summary_line(failures: list[Failure], ok: bool) -> str:
    """The closing line: what failed first in each attempt, and how the run ended."""
    if not failures:
        return "portspeed run: every worker finished" if ok else "portspeed run: the launch failed (no worker failure seen)"
    firsts: dict[int, Failure] = {}
    for f in failures:
        firsts.setdefault(f.attempt, f)
    told = "; ".join(f"attempt {a + 1}: {describe(f)}" for a, f in sorted(firsts.items()))
    if ok:
        n = len(firsts)
        return f"portspeed run: finished after {n} restart{'s' if n != 1 else ''} ({told})"
    return f"portspeed run: failed, no restarts left ({told})"
