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

And it lets the others end on their own first. torchrun's agent SIGTERMs every worker still running
at the first poll (every 0.1 s) that finds one failed, so how a survivor ended (its own error, dumped
as "RuntimeError ended the rank", or the launcher's SIGTERM) and which closing lines followed depended
on whether the agent saw the first death before the survivor's error (a rank that Gloo aborts in C++
and a peer that raises on the broken connection a moment later: CI's stand-in op mismatch). Once a
worker has failed, the agent's poll is held back until every worker has ended, or ``GRACE_S`` passed
(or the hang watchdog ended the job); only then does torchrun stop what is left. The first failure is
the one whose script failed first: each worker notes that time beside torchrun's error file
(``worker.note_failure_time``); a worker that died without a Python exception (a signal, ``os._exit``) is
placed by the poll that first saw it ended, then torchrun's order below. A rank whose error says a peer
went away (Gloo's "Connection reset by peer") comes after a rank that died of a signal without Python: it
noted its time, the dead rank could not, and under load the launcher's poll saw the death later than the
peer noted its error (the stand-in op mismatch, 4 times in 750 fault cases, 2026-11-29).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import time
from typing import Any, Iterator

__all__ = ["Failure", "watch_failures", "describe", "summary_line", "GRACE_S"]

#: once a worker failed, how long the others may take to end on their own before torchrun stops them (seconds)
GRACE_S = 10.0


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


def _let_the_rest_end(agent: Any, ended: dict[int, float]) -> None:
    """When a worker has failed and others still run, wait (``GRACE_S`` at most) until every worker has ended,
    noting in ``ended`` (local rank -> ns since the epoch) when each was first seen ended. Reads the agent's
    subprocess handles (``Popen.poll``: what torchrun's own poll reads); anything else: torchrun as it is."""
    handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None)
    if not isinstance(handlers, dict):
        return
    procs = {lr: getattr(h, "proc", None) for lr, h in handlers.items()}
    if not all(hasattr(p, "poll") for p in procs.values()):
        return

    def look() -> bool:  # whether one has failed
        failed, now = False, time.time_ns()  # those seen ended in the same look are tied
        for lr, p in procs.items():
            code = p.poll()
            if code is not None and lr not in ended:
                ended[lr] = now
                if code != 0:
                    _reap(int(p.pid))  # its helpers go now, not after the others' grace
            failed = failed or (code is not None and code != 0)
        return failed

    if not look():
        return
    deadline = time.monotonic() + GRACE_S
    while len(ended) < len(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
        look()


def _failed_at(error_file: str | None) -> tuple[int | None, bool]:
    """When the worker's script failed (ns since the epoch), as the worker noted it beside its error file, and
    whether its error said a peer went away (``worker.PEER_GONE``)."""
    from portspeed.cli.worker import FAILED_AT_FILE

    if not error_file or error_file == os.devnull:
        return None, False
    try:
        with open(os.path.join(os.path.dirname(error_file), FAILED_AT_FILE)) as f:
            ns, _, word = f.read().strip().partition(" ")
            return int(ns), word == "peer-gone"
    except (OSError, ValueError):
        return None, False


def _error_files(agent: Any) -> dict[int, str]:
    """local rank -> the error file torchrun gave that worker (``TORCHELASTIC_ERROR_FILE``). Read from the agent's
    process context: a failure's own ``error_file`` is torchrun's "<N/A>" when the script wrote none (no
    ``@record``), which is most scripts."""
    files = getattr(getattr(agent, "_pcontext", None), "error_files", None)
    return {int(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def _order(failures: dict[int, Any], ended: dict[int, float], files: dict[int, str]) -> list[tuple[int, Any]]:
    """The failures of one attempt, root cause first: a SIGTERM exit after any other (the agent stops the rest with
    it); a rank whose error says a peer went away after one that died without Python (a C++ abort, a signal: it
    wrote no time of its own, and the peer's error can be noted before the launcher's poll sees the death); then
    the one whose script failed first, else the one seen ending first (torchrun's timestamps are whole seconds)."""
    noted = {rank: _failed_at(files.get(int(f.local_rank))) for rank, f in failures.items()}
    hard = [rank for rank, f in failures.items()
            if noted[rank][0] is None and f.exitcode < 0 and f.exitcode != -signal.SIGTERM]

    def key(kv: Any) -> tuple:
        rank, failure = kv
        at, peer_gone = noted[rank]
        return (failure.exitcode == -signal.SIGTERM, peer_gone and any(h != rank for h in hard),
                at or ended.get(int(failure.local_rank), float("inf")), failure.timestamp, rank)

    return sorted(failures.items(), key=key)


@contextlib.contextmanager
def watch_failures() -> Iterator[list[Failure]]:
    """Collect every failed worker the local agent sees, attempt by attempt, while the block runs."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    seen: list[Failure] = []
    original = LocalElasticAgent._monitor_workers

    def monitor(self: Any, worker_group: Any) -> Any:
        ended: dict[int, float] = {}  # local rank -> when first seen ended (this poll's workers)
        _let_the_rest_end(self, ended)
        result = original(self, worker_group)
        if result.failures:
            restarts = worker_group.spec.max_restarts
            attempt = restarts - getattr(self, "_remaining_restarts", restarts)
            for rank, failure in _order(result.failures, ended, _error_files(self)):  # root cause first
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
        return ("portspeed run: every worker finished" if ok
                else "portspeed run: the launch failed (no worker failure seen)")
    firsts: dict[int, Failure] = {}
    for f in failures:
        firsts.setdefault(f.attempt, f)
    told = "; ".join(f"attempt {a + 1}: {describe(f)}" for a, f in sorted(firsts.items()))
    if ok:
        n = len(firsts)
        return f"portspeed run: finished after {n} restart{'s' if n != 1 else ''} ({told})"
    return f"portspeed run: failed, no restarts left ({told})"
