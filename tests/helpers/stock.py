"""Running Megatron-LM's stock ``pretrain_gpt.py`` under `portspeed run` in tests.

``SKIP_REASON`` is None when ``MEGATRON_LM_ROOT`` points at a Megatron-LM checkout, and
otherwise says why not: the only reason a stock test skips. The packages Megatron-LM's
training code imports are the set-up's to install (``pip install -e '.[stock]'``, which
``make test-stock`` runs): ``require_stock_packages()`` fails a test, naming them, when one
is missing. ``run_stock_gpt`` launches a tiny GPT with a GPU user's command line minus
Transformer Engine and apex (Megatron's defaults, ``--distributed-backend nccl`` included).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.launch import free_port, run_python
from helpers.requires import importable

__all__ = ["SKIP_REASON", "checkout_skip_reason", "require_stock_packages", "run_stock_gpt", "bad_rows"]

RUN_TIMEOUT = 600  # seconds per launch: a hang fails the test instead of hanging CI


#: module -> (distribution, how to install it): what Megatron-LM's training code imports
STOCK_PACKAGES = {
    "megatron.core": ("megatron-core", "pip install -e '.[megatron]'"),
    "six": ("six", "pip install -e '.[stock]'"),
    "regex": ("regex", "pip install -e '.[stock]'"),
    "yaml": ("pyyaml", "pip install -e '.[stock]'"),
}


def checkout_skip_reason(needed: tuple[str, ...] = ("megatron/training/__init__.py",)) -> str | None:
    """Why there is no Megatron-LM checkout (``MEGATRON_LM_ROOT`` unset, or ``needed`` missing); None if there is."""
    root = os.environ.get("MEGATRON_LM_ROOT", "").strip()
    if not root:
        return "MEGATRON_LM_ROOT is not set; point it at a Megatron-LM checkout (tags core_v0.16.1 to core_v0.19.0)"
    for path in needed:
        if not (Path(root) / path).is_file():
            return f"MEGATRON_LM_ROOT={root} is not a Megatron-LM checkout: {path} is missing"
    return None


def require_stock_packages() -> None:
    """Fail, naming what to install, when a package Megatron-LM's training code imports is missing."""
    missing: dict[str, list[str]] = {}  # how to install -> distributions
    for mod, (dist, how) in STOCK_PACKAGES.items():
        if not importable(mod):
            missing.setdefault(how, []).append(dist)
    if missing:
        pytest.fail("Megatron-LM's training code imports packages that are not installed: "
                    + "; ".join(f"{', '.join(dists)} ({how})" for how, dists in missing.items())
                    + "; make test-stock installs them", pytrace=False)


SKIP_REASON = checkout_skip_reason()


def run_stock_gpt(nproc: int, log: Path, *flags: str, num_layers: int = 2, accelerator: str = "cpu",
                  transformer_impl: str | None = "local") -> str:
    """Train the tiny stock GPT on ``nproc`` local ranks; write the output to ``log`` and return it (exit 0 asserted).

    ``transformer_impl`` is passed as ``--transformer-impl``; None passes no such flag (Megatron's
    default, Transformer Engine: portspeed's portable one off CUDA).
    """
    require_stock_packages()
    root = os.environ["MEGATRON_LM_ROOT"]
    args = ["-m", "portspeed.cli", "run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), f"{root}/pretrain_gpt.py",
           *(("--transformer-impl", transformer_impl) if transformer_impl else ()),
           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
           "--num-layers", str(num_layers), "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
           "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
           "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--lr-decay-iters", "10",
           "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
           "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--log-interval", "1",
           "--eval-iters", "0", "--num-workers", "0", *flags]
    env = {"PORTSPEED_ACCELERATOR": accelerator,
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    # run_python kills the launcher's whole process group (the ranks too) when the time is up
    proc = run_python(args, timeout=RUN_TIMEOUT, env=env, drop=("PORTSPEED_BACKEND",))
    text = proc.stdout + proc.stderr
    log.write_text(text)
    assert proc.returncode == 0, (
        f"stock run on {accelerator} failed (exit {proc.returncode}); log {log}:\n{text[-4000:]}")
    return text


def bad_rows(result) -> list[tuple]:
    """The out-of-band iterations of a portspeed.parity comparison, for assertion messages."""
    return [(r.iteration, r.ref, r.value, r.reason) for r in result.rows if not r.ok]
