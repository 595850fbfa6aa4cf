"""Test helpers that stand in for hardware portspeed's CI does not have, and a rank launcher.

Everything here is a stand-in and is named as one: ``standin_ccl`` is a real c10d
backend written in Python (its collectives are rings of point-to-point messages on an
inner Gloo group) that declares the gaps a vendor CCL has, plus ``StandinAccelerator``,
the CPU adapter that uses it. Import ``portspeed.testing.standin_ccl`` to register the
``"standin"`` backend with torch.distributed.

``run_ranks`` starts one real process per rank on 127.0.0.1 with a free port and a hard
timeout, so a hung collective fails a test instead of hanging it; a rank that aborts has the native
backtrace of every thread appended to its stderr (``portspeed.testing.cores``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from portspeed.testing import cores

__all__ = ["RankResult", "free_port", "print_rank0", "run_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class RankResult:
    """One rank's exit status and output."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str


def run_ranks(argv: Sequence[str], world_size: int, timeout: float = 240.0,
              env: dict[str, str] | None = None, ranks_per_node: int | None = None) -> list[RankResult]:
    """Run ``python argv...`` once per rank with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set.

    ``ranks_per_node`` (default: all ranks on one node) splits the ranks into nodes as a multi-node
    launcher would (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK per node), all on this machine: 1 makes
    every rank a node of its own. Every rank gets OMP_NUM_THREADS=1 and PYTHONFAULTHANDLER=1. After
    ``timeout`` seconds the remaining ranks are killed and their returncode is None.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    per_node = world_size if ranks_per_node is None else ranks_per_node
    if per_node < 1 or world_size % per_node:
        raise ValueError(f"ranks_per_node {ranks_per_node} must divide the world size {world_size}")
    port = free_port()
    started = time.time()
    procs = []
    for rank in range(world_size):
        e = dict(os.environ)
        e.update(env or {})
        e.update({"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(world_size),
                  "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
        e.setdefault("PYTHONFAULTHANDLER", "1")  # a rank that aborts leaves its Python stacks
        procs.append(subprocess.Popen([sys.executable, *argv], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, preexec_fn=cores.enable_cores))
    deadline = time.monotonic() + timeout
    results = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(RankResult(rank, p.returncode, out, err))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            out, err = p.communicate()
            results.append(RankResult(rank, None, out, err + f"\n[killed after {timeout:.0f} s]"))
    if any(cores.aborted(r.returncode, r.stderr) for r in results):  # every thread's native stack, on the failure
        native = cores.collect(Path.cwd(), started)
        for r in results:
            if cores.aborted(r.returncode, r.stderr):
                r.stderr += "\n" + native
                break
    return results


def print_rank0(results: list[RankResult]) -> int:
    """Print rank 0's stdout and return 0, or the first failed rank's stderr tail (to stderr) and return 1.

    The ending of a benchmark or tool that launched itself on ``run_ranks``.
    """
    for r in results:
        if r.returncode != 0:
            print(f"rank {r.rank} failed ({r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
    print(results[0].stdout.strip())
    return 0
