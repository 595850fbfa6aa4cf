"""Figures for docs/reliability.md: how long after a fault the job exits, or trains again.

Not a test and not part of `make bench` (tests assert no times): it runs the example trainer
under `portspeed run` on 2 ranks (TP2), timestamps every output line as it arrives, and
prints, per fault, the seconds from the dying rank's own message to the launcher's exit
(crash during save, a dead rank without restarts) or to the first loss line of the restarted
group (restart: includes the new workers' imports and the checkpoint load).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fault_timings.py
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "128", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "1e-3", "--seed", "1234"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(args: list[str], launcher: tuple[str, ...] = ()) -> tuple[list[tuple[float, str]], float, int]:
    """(timestamped lines, end time, exit code) of one `portspeed run` of the trainer on 2 ranks."""
    cmd = [sys.executable, "-m", "portspeed.cli", "run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_port()), *launcher, "examples/pretrain_gpt.py", *MODEL, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               PORTSPEED_TIMEOUT="60")
    lines = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:  # type: ignore[union-attr]
            lines.append((time.monotonic(), line.rstrip("\n")))
        code = p.wait()
    return lines, time.monotonic(), code


def _first(lines: list[tuple[float, str]], text: str, after: float = 0.0) -> float:
    return next(t for t, ln in lines if text in ln and t >= after)


def main() -> int:
    work = pathlib.Path(tempfile.mkdtemp(prefix="portspeed-faults-"))
    init = str(work / "init")
    subprocess.run([sys.executable, "-m", "portspeed.cli", "run", "--nproc-per-node", "1", "examples/pretrain_gpt.py",
                    *MODEL, "--iters", "0", "--save", init], cwd=ROOT, check=True, capture_output=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    base = ["--tp", "2", "--load", init, "--finetune", "--save-interval", "2", "--resume", "--train-iters", "6"]

    lines, end, code = timed(["--iters", "4", "--tp", "2", "--load", init, "--finetune", "--fail-at", "1:2"])
    print(f"dead rank (no restart): exit {code}, {end - _first(lines, 'exiting on purpose'):.2f} s from the death "
          "to the launcher's exit")
    lines, end, code = timed([*base, "--save", str(work / "a"), "--fail-at", "1:4:save"])
    print(f"crash during save: exit {code}, {end - _first(lines, 'dying while writing'):.2f} s from the death "
          "to the launcher's exit")
    t0 = time.monotonic()
    lines, end, code = timed([*base, "--save", str(work / "a")])
    print(f"resume after the crash: exit {code}, {_first(lines, 'iteration 3 |') - t0:.2f} s from the command to "
          "iteration 3 (a fresh start: imports, load of checkpoint 2)")
    lines, end, code = timed([*base, "--save", str(work / "b"), "--fail-at", "1:3"], ("--max-restarts", "1"))
    died = _first(lines, "exiting on purpose")
    print(f"restart: exit {code}, {_first(lines, 'iteration 3 |', died) - died:.2f} s from the death to the "
          f"restarted group's iteration 3; last line: {lines[-1][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
