"""A warm Python for test suites: torch imported once per session, each child Python forked from it.

Why: on the 2-core CI machine a child that imports torch and Megatron-Core spends 4-6 s before its first line
of work, and the suite starts over a thousand such children (launchers, ranks, ``python -c`` probes). The
forked children skip torch's import and nothing else: portspeed, Megatron, DeepSpeed and the script are still
imported by each child, in the order a user's process imports them (``server.py`` says what is preloaded and
what still differs from a fresh interpreter).

    warm = start(sys.executable, env, folder)     # two servers, ready in a few seconds
    subprocess.run([warm.python, "-c", "import torch"], env={**env, **warm.env})
    warm.close()

``warm.python`` is an executable that behaves as the interpreter; ``warm.env`` sets ``PYTHON_EXEC`` to it, so
torchrun (and ``portspeed run``) start their ranks through it too. A request the server cannot serve as a
fresh interpreter would start (other interpreter options, a start-up variable that differs) runs the real
interpreter instead, as does every request when the servers are gone.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Mapping

from portspeed.testing import cores  # core files on in the servers: a child raises its limit to its client's

__all__ = ["WarmPython", "start"]

_HERE = Path(__file__).resolve().parent


class WarmPython:
    """Running warm servers and the launcher script that reaches them."""

    def __init__(self, python: Path, servers: list[subprocess.Popen], log: Path) -> None:
        self.python = str(python)
        self.servers = servers
        self.log = log

    @property
    def env(self) -> dict[str, str]:
        """What a child's environment needs so that torchrun starts its ranks warm too."""
        return {"PYTHON_EXEC": self.python}

    def summary(self) -> str:
        """One line: how many child Pythons were forked warm, how many ran cold and the commonest reason."""
        lines = self.log.read_text(errors="replace").splitlines() if self.log.is_file() else []
        warm = sum(ln.startswith("warm python: warm:") for ln in lines)
        cold = [ln.split("cold: ", 1)[1] for ln in lines if ln.startswith("warm python: cold:")]
        reasons: dict[str, int] = {}
        for c in cold:
            key = c.split(" -")[0][:80]
            reasons[key] = reasons.get(key, 0) + 1
        top = max(reasons, key=reasons.__getitem__) if reasons else ""
        return (f"warm python: {warm} child Pythons forked warm, {len(cold)} started cold"
                + (f" (most often: {top})" if top else ""))

    def close(self) -> None:
        """Stop the servers (their running children are not affected) and remove their folder."""
        for s in self.servers:
            s.terminate()
        for s in self.servers:
            try:
                s.wait(timeout=30)
            except subprocess.TimeoutExpired:
                s.kill()
        shutil.rmtree(self.log.parent, ignore_errors=True)


def start(executable: str, env: Mapping[str, str], folder: Path, servers: int = 2,
          wait_s: float = 120.0) -> WarmPython:
    """Start ``servers`` warm servers of ``executable`` with ``env`` (their start-up environment) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "warm-python.log"
    sockets = [folder / f"warm-{i}.sock" for i in range(servers)]
    procs = []
    with open(log, "ab") as out:
        for sock in sockets:
            sock.unlink(missing_ok=True)
            procs.append(subprocess.Popen([executable, str(_HERE / "server.py"), str(sock)], env=dict(env),
                                          stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, preexec_fn=cores.enable_cores))
    python = folder / "python"
    args = " ".join(f"'{s}'" for s in sockets)
    python.write_text(f"#!/bin/sh\nexec '{executable}' -I -S '{_HERE / 'client.py'}' '{executable}' {args} -- \"$@\"\n")
    python.chmod(0o755)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(s.exists() for s in sockets):
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    return WarmPython(python, procs, log)
