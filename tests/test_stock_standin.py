"""Stock Megatron-LM asked for NCCL runs on the stand-in vendor CCL, rewrites included, and matches Gloo.

The stand-in (``portspeed.testing.standin_ccl``, a Python c10d backend named as a stand-in)
lacks ReduceOp.AVG, which Megatron's distributed optimizer uses for its gradient
reduce-scatter with ``--ddp-average-in-collective``. The router must rewrite that call
inside real training (the log names the rewrite once), and the per-iteration losses must
equal those of the same command on Gloo within 1e-5 (fp32). Needs a Megatron-LM checkout
in ``MEGATRON_LM_ROOT`` (tag core_v0.16.1) and six/regex/pyyaml; skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from portspeed.losslog import parse_megatron_log
from portspeed.parity import compare, tolerance_for

pytestmark = [pytest.mark.megatron, pytest.mark.stock, pytest.mark.multiproc]

RUN_TIMEOUT = 600


def _reason() -> str | None:
    root = os.environ.get("MEGATRON_LM_ROOT", "").strip()
    if not root:
        return "MEGATRON_LM_ROOT is not set; point it at a Megatron-LM checkout (tag core_v0.16.1)"
    if not (Path(root) / "megatron" / "training" / "__init__.py").is_file():
        return f"MEGATRON_LM_ROOT={root} has no megatron/training: not a Megatron-LM checkout"
    for mod, pkg in (("six", "six"), ("regex", "regex"), ("yaml", "pyyaml"), ("megatron.core", "megatron-core")):
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{pkg} is not installed (Megatron-LM's training code imports it)"
        except ImportError:
            return f"{pkg} is not installed (Megatron-LM's training code imports it)"
    return None


REASON = _reason()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stock(accelerator: str, log: Path) -> str:
    root = os.environ["MEGATRON_LM_ROOT"]
    cmd = [sys.executable, "-m", "portspeed.cli", "run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), f"{root}/pretrain_gpt.py",
           "--transformer-impl", "local", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
           "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
           "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-3", "--min-lr", "1e-4",
           "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--lr-decay-iters", "10",
           "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
           "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--log-interval", "1",
           "--eval-iters", "0", "--eval-interval", "6", "--num-workers", "0",
           "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-average-in-collective"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PORTSPEED_ACCELERATOR=accelerator,
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("PORTSPEED_BACKEND", None)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"stock run on {accelerator} hung for {RUN_TIMEOUT}s: {' '.join(cmd)}\n{exc.stdout}\n{exc.stderr}")
    text = proc.stdout + proc.stderr
    log.write_text(text)
    assert proc.returncode == 0, f"stock run on {accelerator} failed (exit {proc.returncode}); log {log}:\n{text[-4000:]}"
    return text


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_stock_distributed_optimizer_on_standin_matches_gloo(tmp_path: Path) -> None:
    gloo = _stock("cpu", tmp_path / "gloo.log")
    standin = _stock("standin", tmp_path / "standin.log")
    assert "distributed_backend ............................. nccl" in standin  # Megatron asked for NCCL
    rewrites = [line for line in standin.splitlines() if "rewritten (avg_as_sum)" in line]
    assert rewrites and all("reduce_scatter_tensor" in line for line in rewrites), \
        "the stand-in lacks AVG: the router must have rewritten Megatron's reduce-scatter"
    assert "rewritten" not in gloo  # Gloo on torch 2.13 does AVG itself: nothing to rewrite
    ref = parse_megatron_log(gloo, source="gloo")
    run = parse_megatron_log(standin, source="standin")
    assert len(ref.iterations) == 6
    result = compare(ref, run, tolerance_for("fp32"))
    assert result.ok, result
