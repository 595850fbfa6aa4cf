"""Training check of the conformance kit: the example GPT on the adapter against CPU losses.

Runs ``examples/pretrain_gpt.py`` (megatron-core alone) with TP2 on 2 ranks, fp32, from its
seeded CPU initialisation (no checkpoint needed: the weights are made on the host from one
seed on every device), and compares each iteration's lm loss with the CPU record shipped in
``golden/`` for the installed megatron-core release, within 1e-5. Where no record matches
the installed release, a CPU run on the same machine is the reference, and the check says so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from portspeed.conformance.report import Report

__all__ = ["GOLDEN_DIR", "TRAINER_ARGS", "run_training_check", "trainer_path"]

SUITE = "training"
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
TOLERANCE = 1e-5
ITERS = 5
#: the iteration whose host fallbacks are named (the first after the warm-up one)
PERF_ITERATION = 2
TRAINER_ARGS = ["--tp", "2", "--iters", str(ITERS), "--num-layers", "2", "--hidden-size", "64",
                "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128",
                "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "1e-3", "--seed", "1234"]
_LOSS = re.compile(r"iteration (\d+) \| lm loss: (\S+) \|")


def trainer_path() -> Path:
    """examples/pretrain_gpt.py of the source tree portspeed runs from."""
    return Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"


def _megatron_minor() -> str:
    from portspeed.versions import distribution_version

    v = distribution_version("megatron-core")
    return f"{v.major}.{v.minor}" if v is not None else "none"


def golden_path() -> Path:
    return GOLDEN_DIR / f"gpt_tp2_fp32-mcore{_megatron_minor()}.json"


def train(adapter: str, timeout: float = 600, perf_dir: str | None = None) -> dict[int, float]:
    """Run the trainer on ``adapter`` (2 ranks); its lm loss per iteration. With ``perf_dir``, rank 0 records
    iteration ``PERF_ITERATION`` there (the perf recording: its CPU fallbacks, ``portspeed.perf``)."""
    from portspeed.testing import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(trainer_path()), *TRAINER_ARGS]
    env = {**os.environ, "PORTSPEED_ACCELERATOR": adapter, "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    if perf_dir is not None:
        env.update(PORTSPEED_PERF=perf_dir, PORTSPEED_PERF_ITERATIONS=str(PERF_ITERATION), PORTSPEED_PERF_RANKS="0")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"the trainer failed on {adapter!r} (exit {res.returncode}): {res.stderr[-1500:]}")
    losses = {int(m.group(1)): float(m.group(2)) for m in _LOSS.finditer(res.stdout)}
    if sorted(losses) != list(range(1, ITERS + 1)):
        raise RuntimeError(f"the trainer printed iterations {sorted(losses)}, expected 1..{ITERS}")
    return losses


def run_training_check(adapter: str, report: Report) -> None:
    """Append the training check of ``adapter`` to ``report``."""
    if not trainer_path().exists():
        report.add(SUITE, "example GPT TP2 matches the CPU losses", False,
                   f"{trainer_path()} is missing: run the kit from a portspeed source tree")
        return
    golden = golden_path()
    try:
        if golden.exists():
            want = {int(k): float(v) for k, v in json.loads(golden.read_text())["lm_loss"].items()}
            source = f"CPU record {golden.name}"
        else:
            want = train("cpu")
            source = f"a CPU run here (no record for megatron-core {_megatron_minor()})"
        with tempfile.TemporaryDirectory(prefix="portspeed-conformance-perf-") as perf_dir:
            got = train(adapter, perf_dir=perf_dir)
            report.note(host_fallbacks_line(perf_dir))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        report.add(SUITE, "example GPT TP2 matches the CPU losses", False, str(exc))
        return
    worst = max(abs(got[i] - want[i]) for i in want)
    report.add(SUITE, f"example GPT TP2 matches {source} within {TOLERANCE:g}", worst <= TOLERANCE,
               f"max |diff| {worst:.3g}: " + ", ".join(f"it {i}: {got[i]!r} vs {want[i]!r}" for i in sorted(want)))


def host_fallbacks_line(perf_dir: str) -> str:
    """The line naming the ops rank 0 ran on the host in iteration ``PERF_ITERATION`` (the CPU fallback's, and
    portspeed's host rung's), read from the perf recording the training run wrote in ``perf_dir``."""
    from portspeed.perf.reading.host_fallbacks import PREFIX, fallback_line

    path = Path(perf_dir) / "rank0.jsonl"
    lines = [json.loads(t) for t in path.read_text().splitlines() if t.strip()] if path.exists() else []
    line = next((ln for ln in lines if ln.get("iteration") == PERF_ITERATION), None)
    if line is None:
        return f"{PREFIX}: not recorded (rank 0 wrote no perf line of iteration {PERF_ITERATION} in {perf_dir})"
    if line.get("syncs_seen_by") != "dispatch":
        return (f"{PREFIX}: not counted (torch's CPU fallback is watched on a PrivateUse1 device only; this "
                f"device is {line.get('device')!r})")
    return fallback_line(line, f"iteration {PERF_ITERATION}, rank 0 of TP2")


def write_golden() -> Path:
    """Record the CPU losses for the installed megatron-core (maintainers run this module: ``python -m ...``)."""
    from portspeed.versions import distribution_version

    losses = train("cpu")
    GOLDEN_DIR.mkdir(exist_ok=True)
    path = golden_path()
    import torch

    path.write_text(json.dumps({"trainer": "examples/pretrain_gpt.py", "args": TRAINER_ARGS, "adapter": "cpu",
                                "torch": torch.__version__, "megatron-core": str(distribution_version("megatron-core")),
                                "lm_loss": {str(k): v for k, v in sorted(losses.items())}}, indent=1) + "\n")
    return path


if __name__ == "__main__":
    print(write_golden())
