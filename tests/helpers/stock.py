"""Running Megatron-LM's stock ``pretrain_gpt.py`` under `portspeed run` in tests.

``SKIP_REASON`` is None when ``MEGATRON_LM_ROOT`` points at a Megatron-LM checkout and the
packages its training code imports are installed; otherwise it says what is missing.
``run_stock_gpt`` launches a tiny GPT with a GPU user's command line minus Transformer
Engine and apex (Megatron's defaults, ``--distributed-backend nccl`` included).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import free_port

__all__ = ["SKIP_REASON", "run_stock_gpt", "bad_rows"]

RUN_TIMEOUT = 600  # seconds per launch: a hang fails the test instead of hanging CI


def _skip_reason() -> str | None:
    root = os.environ.get("MEGATRON_LM_ROOT", "").strip()
    if not root:
        return "MEGATRON_LM_ROOT is not set; point it at a Megatron-LM checkout (tag core_v0.16.1)"
    if not (Path(root) / "megatron" / "training" / "__init__.py").is_file():
        return f"MEGATRON_LM_ROOT={root} has no megatron/training: not a Megatron-LM checkout"
    for mod, pkg in (("six", "six"), ("regex", "regex"), ("yaml", "pyyaml"), ("megatron.core", "megatron-core")):
        try:
            found = importlib.util.find_spec(mod) is not None
        except ImportError:
            found = False
        if not found:
            return f"{pkg} is not installed (Megatron-LM's training code imports it): pip install -e '.[stock]'"
    return None


SKIP_REASON = _skip_reason()


def run_stock_gpt(nproc: int, log: Path, *flags: str, num_layers: int = 2, accelerator: str = "cpu") -> str:
    """Train the tiny stock GPT on ``nproc`` local ranks; write the output to ``log`` and return it (exit 0 asserted)."""
    root = os.environ["MEGATRON_LM_ROOT"]
    cmd = [sys.executable, "-m", "portspeed.cli", "run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), f"{root}/pretrain_gpt.py",
           "--transformer-impl", "local", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
           "--num-layers", str(num_layers), "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
           "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
           "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--lr-decay-iters", "10",
           "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
           "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--log-interval", "1",
           "--eval-iters", "0", "--num-workers", "0", *flags]
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


def bad_rows(result) -> list[tuple]:
    """The out-of-band iterations of a portspeed.parity comparison, for assertion messages."""
    return [(r.iteration, r.ref, r.value, r.reason) for r in result.rows if not r.ok]
