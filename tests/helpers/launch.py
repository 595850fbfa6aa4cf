"""Start real multi-rank jobs for tests: torchrun on 127.0.0.1, a free port, a hard time limit.

Every job runs with ``OMP_NUM_THREADS=1`` (the CI machine has 2 cores shared by many
jobs) and ``PORTSPEED_TIMEOUT`` (collective/rendezvous timeout) unless the caller sets it,
and is killed as a process group when ``timeout`` passes, so a hang fails the test
instead of hanging CI.

    res = torchrun("examples/pretrain_gpt.py", nproc=2, args=["--tp", "2"], timeout=240)
    losses = parse_losses(res.stdout)     # {iteration: (lm_loss, grad_norm)}
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["REPO", "Result", "free_port", "parse_losses", "run_python", "torchrun"]

REPO = Path(__file__).resolve().parents[2]
_LOSS = re.compile(r"iteration (\d+) \| lm loss: (\S+) \| grad norm: (\S+)")


@dataclasses.dataclass
class Result:
    """What a finished job left: exit status and both streams."""

    returncode: int
    stdout: str
    stderr: str
    cmd: list[str]

    def check(self) -> "Result":
        """Raise with the command and the tail of stderr when the job failed."""
        if self.returncode != 0:
            raise AssertionError(
                f"command failed with exit status {self.returncode}: {' '.join(self.cmd)}\n"
                f"--- stderr (tail) ---\n{self.stderr[-4000:]}\n--- stdout (tail) ---\n{self.stdout[-2000:]}"
            )
        return self


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PORTSPEED_TIMEOUT", "120")
    env["PYTHONWARNINGS"] = "ignore"
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a rank that aborts leaves its Python stacks
    env.update(extra or {})
    return env


def run_python(args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
               cwd: Path = REPO) -> Result:
    """Run ``python args...`` in its own process group; kill the group at ``timeout``."""
    cmd = [sys.executable, *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout}s (killed): {' '.join(cmd)}\n--- stderr (tail) ---\n{err[-3000:]}"
        ) from None
    return Result(proc.returncode, out, err, cmd)


def torchrun(script: str, nproc: int, args: Sequence[str] = (), timeout: float = 300,
             env: Mapping[str, str] | None = None) -> Result:
    """``python -m torch.distributed.run`` with ``nproc`` local ranks on a free port (retries a taken port once)."""
    for attempt in range(2):
        cmd = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), script, *args]
        res = run_python(cmd, timeout=timeout, env=env)
        if res.returncode != 0 and "EADDRINUSE" in res.stderr and attempt == 0:
            continue  # another job took the port between free_port() and the bind
        return res
    return res


def parse_losses(text: str) -> dict[int, tuple[float, float | None]]:
    """``iteration N | lm loss: X | grad norm: Y`` lines -> {N: (X, Y)}."""
    out: dict[int, tuple[float, float | None]] = {}
    for m in _LOSS.finditer(text):
        gn = None if m.group(3) == "None" else float(m.group(3))
        out[int(m.group(1))] = (float(m.group(2)), gn)
    return out
