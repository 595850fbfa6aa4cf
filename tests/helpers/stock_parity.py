"""Layouts of one stock model against its single-process run, from one shared checkpoint.

Why a checkpoint: pipeline stages and expert-parallel ranks seed their initialisation
differently (on GPU too), so a layout is comparable with TP1 only from the same weights. A
TP1 process trains 3 iterations with the model's flags and saves; every run then fine-tunes
``ITERS`` iterations from it (``--load --finetune``) and its per-iteration losses are read
from the log. The launcher is ``helpers.stock.run_stock_gpt`` (mock data, Megatron's
defaults, ``--distributed-backend nccl``); ``model`` flags come after its own, so they win.

Example::

    shared = SharedCheckpoint(tmp_path, LLAMA, num_layers=2)
    ref = shared.finetune("tp1", 1)
    run = shared.finetune("tp2", 2, "--tensor-model-parallel-size", "2")
    worst = max_diff(ref, run)  # (iteration, |d|) of the largest lm-loss difference
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from helpers.stock import run_stock_gpt

from portspeed.parity.losslog import LossRecord, parse_megatron_log

__all__ = ["ITERS", "SharedCheckpoint", "max_diff", "field_diff", "venv_python_first", "stock_run"]

ITERS = 10
INIT_ITERS = 3


@contextmanager
def venv_python_first() -> Iterator[None]:
    """This venv's bin first on PATH: a checkout of another release than the wheel builds its dataset helpers
    with `make`, which runs the ``python3`` on PATH and needs its pybind11 (the ``stock`` extra)."""
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), old))
    try:
        yield
    finally:
        os.environ["PATH"] = old


def stock_run(nproc: int, log: Path, *flags: str, num_layers: int = 2) -> str:
    """``helpers.stock.run_stock_gpt`` with this venv's python first on PATH."""
    with venv_python_first():
        return run_stock_gpt(nproc, log, *flags, num_layers=num_layers)


class SharedCheckpoint:
    """A TP1 checkpoint of ``model`` after INIT_ITERS iterations in ``work``, and fine-tuning runs from it."""

    def __init__(self, work: Path, model: Sequence[str], num_layers: int = 2, init: Sequence[str] = ()) -> None:
        self.work, self.model, self.num_layers = work, list(model), num_layers
        self.ckpt = work / "ckpt"
        self.logs: dict[str, str] = {}
        self.init_log = stock_run(1, work / "init.log", *self.model, "--train-iters", str(INIT_ITERS),
                                      "--eval-interval", str(INIT_ITERS), "--save", str(self.ckpt),
                                      "--save-interval", str(INIT_ITERS), *init, num_layers=num_layers)
        saved = (self.ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
        assert saved == str(INIT_ITERS), f"the shared checkpoint was saved at iteration {saved}"

    def finetune(self, name: str, nproc: int, *flags: str, iters: int = ITERS) -> LossRecord:
        """Fine-tune ``iters`` iterations on ``nproc`` ranks with ``flags``; the parsed log (text in ``logs[name]``)."""
        text = stock_run(nproc, self.work / f"{name}.log", *self.model, "--train-iters", str(iters),
                             "--eval-interval", str(iters), "--load", str(self.ckpt), "--finetune", *flags,
                             num_layers=self.num_layers)
        self.logs[name] = text
        record = parse_megatron_log(text, source=name)
        assert [it.iteration for it in record.iterations] == list(range(1, iters + 1)), (
            f"{name}: logged iterations {[it.iteration for it in record.iterations]}")
        return record


def max_diff(ref: LossRecord, run: LossRecord) -> tuple[int, float]:
    """The iteration with the largest |lm loss difference| and that difference (inf if one side is missing)."""
    return field_diff(ref, run, "lm_loss")


def field_diff(ref: LossRecord, run: LossRecord, field: str) -> tuple[int, float]:
    """As max_diff for ``field``: ``lm_loss``, ``grad_norm`` or a key of ``extra`` (``load_balancing_loss``)."""
    def value(rec: object) -> float | None:
        if field in ("lm_loss", "grad_norm"):
            return getattr(rec, field)
        return rec.extra.get(field)  # type: ignore[attr-defined]

    a, b = ref.by_iteration(), run.by_iteration()
    worst, where = -1.0, -1
    for it in sorted(a):
        x, y = value(a[it]), value(b[it]) if it in b else None
        d = float("inf") if x is None or y is None else abs(x - y)
        if d > worst:
            worst, where = d, it
    return where, worst
