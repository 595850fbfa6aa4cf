"""Start child Pythons for tests: a snippet in a fresh interpreter, or torchrun on 127.0.0.1 with a free port.

Every child runs with ``OMP_NUM_THREADS=1`` (the CI machine has 2 cores shared by many
jobs), ``PYTHONWARNINGS=ignore``, ``PYTHONFAULTHANDLER=1`` and ``PORTSPEED_TIMEOUT``
(collective/rendezvous timeout) unless the caller sets it, on top of this process's
environment; ``drop`` leaves inherited variables out (a deliberately clean environment).
It is killed as a process group when ``timeout`` passes, so a hang fails the test instead
of hanging CI. A child Python (``sys.executable``) is forked from the session's warm Python
(``portspeed.testing.warm``: torch imported once; tests/conftest.py starts it, ``--cold-python`` or the
``cold_python`` marker turns it off), and so are the ranks torchrun starts for it. When a process
of the job dies of SIGABRT, the native backtrace of every thread (its core file, read by gdb:
``portspeed.testing.cores``) is kept in the result's ``native`` and in ``ABORTS``, which tests/conftest.py
attaches to the test's report when the test fails.

    got = child_json('''
        import json, portspeed
        print(json.dumps({"n": len(portspeed.report())}))     # the last stdout line: JSON
    ''', timeout=180, env={"PORTSPEED_ACCELERATOR": "cpu"})
    res = run_snippet("import sys; sys.exit(3)", timeout=60)   # unchecked: look at res.returncode
    res = torchrun("examples/pretrain_gpt.py", nproc=2, args=["--tp", "2"], timeout=240)
    losses = parse_losses(res.stdout)     # {iteration: (lm_loss, grad_norm)}
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from portspeed.testing import cores, warm

__all__ = ["ABORTS", "REPO", "Result", "child_json", "free_port", "parse_losses", "run_command", "run_python",
           "run_snippet", "start_warm", "stop_warm", "torchrun"]

REPO = Path(__file__).resolve().parents[2]
#: the native backtraces of this test's aborted children (tests/conftest.py empties it per test, reports it on failure)
ABORTS: list[str] = []
#: the session's warm Python (None: every child starts cold), and whether the running test may use it
WARM: warm.WarmPython | None = None
USE_WARM = True
_LOSS = re.compile(r"iteration (\d+) \| lm loss: (\S+) \| grad norm: (\S+)")


@dataclasses.dataclass
class Result:
    """What a finished job left: exit status and both streams."""

    returncode: int
    stdout: str
    stderr: str
    cmd: list[str]
    native: str = ""  # a process aborted: the native backtrace of every thread (from its core file)

    def _native(self) -> str:
        return f"\n--- native backtraces ---\n{self.native[-16000:]}" if self.native else ""

    def check(self) -> "Result":
        """Raise with the command and the tail of stderr when the job failed."""
        if self.returncode != 0:
            raise AssertionError(
                f"command failed with exit status {self.returncode}: {' '.join(self.cmd)}\n"
                f"--- stderr (tail) ---\n{self.stderr[-4000:]}\n--- stdout (tail) ---\n{self.stdout[-2000:]}"
                f"{self._native()}"
            )
        return self

    def last_json(self) -> Any:
        """The JSON value on the last non-empty stdout line (what a child prints last); fail showing the output."""
        lines = self.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            raise AssertionError(
                f"no JSON on the last stdout line of: {' '.join(self.cmd)}\n"
                f"--- stdout (tail) ---\n{self.stdout[-2000:]}\n--- stderr (tail) ---\n{self.stderr[-4000:]}"
                f"{self._native()}"
            ) from None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(extra: Mapping[str, str] | None, drop: Iterable[str] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PORTSPEED_TIMEOUT", "120")
    env["PYTHONWARNINGS"] = "ignore"
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a rank that aborts leaves its Python stacks
    patterns = tuple(drop)
    for name in [n for n in env if any(fnmatchcase(n, p) for p in patterns)]:
        del env[name]
    env.update(extra or {})
    return env


def start_warm(folder: Path) -> None:
    """Start the session's warm Python (tests/conftest.py, once per session)."""
    global WARM
    WARM = warm.start(sys.executable, _env(None), folder)


def stop_warm() -> None:
    global WARM
    if WARM is not None:
        WARM.close()
        WARM = None


def python_for_children() -> tuple[str, dict[str, str]]:
    """The interpreter a test hands to a script that starts Pythons itself (``PYTHON=...``), and the variables that
    make torchrun's ranks follow it: the warm launcher while the session's warm Python runs, else this one."""
    if WARM is not None and USE_WARM:
        return WARM.python, dict(WARM.env)
    return sys.executable, {}


def run_python(args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
               cwd: Path = REPO, *, drop: Iterable[str] = ()) -> Result:
    """Run ``python args...`` in its own process group; kill the group at ``timeout``.

    The child gets this process's environment and the defaults above, minus the variables
    matching a ``drop`` pattern (fnmatch: ``"PORTSPEED_*"``, or an exact name), plus ``env``.
    """
    return run_command([sys.executable, *args], timeout, _env(env, drop), cwd)


def run_command(cmd: Sequence[str], timeout: float, env: Mapping[str, str], cwd: Path = REPO) -> Result:
    """Run ``cmd`` with exactly ``env`` in its own session; at ``timeout`` kill the whole group (a launcher and
    the ranks it started) and fail with the tail of both streams."""
    cmd = [str(c) for c in cmd]
    started = time.time()
    run, env = cmd, dict(env)
    if WARM is not None and USE_WARM and cmd[0] == sys.executable:
        run, env = [WARM.python, *cmd[1:]], {**env, **WARM.env}
    proc = subprocess.Popen(run, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=cores.enable_cores)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout}s (killed): {' '.join(cmd)}\n--- stderr (tail) ---\n{err[-3000:]}"
            f"\n--- stdout (tail) ---\n{out[-2000:]}"
        ) from None
    native = ""
    if cores.aborted(proc.returncode, err):  # a process of the job died of SIGABRT: every thread's native stack
        native = cores.collect(Path(cwd), started) or "no core file was found\n"
        ABORTS.append(f"{' '.join(cmd)}\n{native}")
    return Result(proc.returncode, out, err, cmd, native)


def run_snippet(code: str, *, timeout: float, env: Mapping[str, str] | None = None, cwd: Path = REPO,
                drop: Iterable[str] = ()) -> Result:
    """``python -c code`` (dedented) in a fresh interpreter, through ``run_python``; not checked."""
    return run_python(["-c", textwrap.dedent(code)], timeout=timeout, env=env, cwd=cwd, drop=drop)


def run_ok(code: str, *, timeout: float = 300, env: Mapping[str, str] | None = None) -> str:
    """``python -c code`` (dedented); fail with both streams unless it exits 0 and prints ``OK`` last; its stdout."""
    res = run_python(["-c", textwrap.dedent(code) + "\nprint('OK')\n"], timeout=timeout, env=env)
    assert res.returncode == 0 and res.stdout.rstrip().endswith("OK"), (
        f"exit {res.returncode}\n--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-5000:]}")
    return res.stdout


def child_json(code: str, *, timeout: float, env: Mapping[str, str] | None = None, cwd: Path = REPO,
               drop: Iterable[str] = ()) -> Any:
    """Run the snippet (``run_snippet``), fail with the tail of stderr unless it exits 0, return its last-line JSON."""
    return run_snippet(code, timeout=timeout, env=env, cwd=cwd, drop=drop).check().last_json()


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
