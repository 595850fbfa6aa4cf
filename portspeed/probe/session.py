"""The probe of one process: which iterations, ranks and modules it records, and an iteration's life.

Why one object: the integrations (Megatron's schedule and optimizer, DeepSpeed's engine, the HF
Trainer) and the documented call for an own loop all say the same three things: an iteration
begins (with the model chunks), its forward/backward is over, the optimizer is about to step and
has stepped. The session turns them into hooks, installed when an iteration to record begins and
removed when it ends, and into one dump per iteration and rank. With probing off
(``PORTSPEED_PROBE_DIR`` unset) ``current()`` is None and nothing is installed anywhere.

An iteration ``n`` is recorded in full when ``A <= n <= B`` (``--probe-iterations``) on a rank in
``--probe-ranks``; with ``--probe-nan`` every other iteration is watched with flags
(``portspeed.probe.nan``). Its end reads every queued statistic in one transfer, writes
``DIR/step<n>/rank<R>/`` and, with ``--probe-nan``, stops the job at the first non-finite value.
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Sequence

import torch

from portspeed import config
from portspeed.errors import ConfigError
from portspeed.probe import collectives, meta, nan, writer
from portspeed.probe.entries import IterationRecord
from portspeed.probe.modules import ModuleHooks, ModuleTable
from portspeed.probe.ops import OpRecorder
from portspeed.probe.params import record_params
from portspeed.probe.sessions import ProcessSession

__all__ = ["ProbeSession", "current", "reset"]

_ONE: ProcessSession["ProbeSession"] = ProcessSession("probe_dir", lambda settings: ProbeSession(settings))


def current() -> "ProbeSession | None":
    """This process's probe session, made on first use; None when probing is not configured."""
    return _ONE.current()


def reset() -> None:
    """Forget the session (tests; an open iteration is ended first)."""
    _ONE.reset()


class ProbeSession:
    """See the module docstring; integrations call ``begin`` / ``forward_backward_done`` / ``before_step`` /
    ``after_step`` / ``end``, an own loop ``portspeed.probe.iteration()``."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self.level = settings.probe_level
        self.last = 0  # the last iteration begun
        self.record: IterationRecord | None = None
        self.explicit = False
        self._tables: dict[tuple[int, ...], ModuleTable] = {}
        self._checked = False
        self._hooks: ModuleHooks | None = None
        self._ops: OpRecorder | None = None
        self._colls: collectives.CollectiveRecorder | None = None
        self._optimizer_hooks: list[Any] = []
        atexit.register(self.end)

    # ------------------------------------------------------------ what is recorded
    @property
    def rank(self) -> int:
        return meta._world()[0]

    def wants(self, n: int) -> bool:
        """Whether iteration ``n`` is recorded in full on this rank."""
        a, b = self.settings.probe_iterations
        ranks = self.settings.probe_ranks
        return a <= n <= b and (ranks is None or self.rank in ranks)

    def watching(self, n: int) -> bool:
        """Whether iteration ``n`` gets any hook (in full, or flags for --probe-nan)."""
        return self.wants(n) or self.settings.probe_nan

    def _check_folder(self) -> None:
        """Once per process: this rank's earlier dumps are not overwritten (the launcher checks every rank's)."""
        if self._checked:
            return
        self._checked = True
        found = writer.existing_dumps(self.settings.probe_dir, self.rank)
        if found:
            raise ConfigError(f"PORTSPEED_PROBE_DIR={self.settings.probe_dir!r} already holds a probe dump of rank "
                              f"{self.rank} ({found[0]}); remove it or choose another folder")

    def _table(self, chunks: Sequence[torch.nn.Module]) -> ModuleTable:
        key = tuple(id(c) for c in chunks)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = ModuleTable(chunks, self.settings.probe_modules)
        return table

    # ------------------------------------------------------------ an iteration's life
    def begin(self, n: int, chunks: Sequence[torch.nn.Module], *, framework: str, explicit: bool = False,
              context: dict[str, Any] | None = None) -> None:
        """Iteration ``n`` begins on ``chunks`` (the model, or Megatron's model chunks in order)."""
        if self.record is not None:
            if self.explicit and not explicit:
                self.context.update(context or {})  # an integration inside the documented call: one iteration
                return
            self.end()
        self.last, self.explicit = n, explicit
        if not self.watching(n):
            return
        self._check_folder()
        full = self.wants(n)
        self.framework, self.context = framework, dict(context or {})
        self.chunks = list(chunks)
        self.table = self._table(chunks)
        self.parallel = meta.parallel_of(self.table, chunks)
        self.record = rec = IterationRecord(n, self.rank, full=full, tensors=self.settings.probe_tensors)
        self._params = {"parameters_grad": False, "parameters_updated": False}
        self._hooks = ModuleHooks(self.table, rec, self.parallel, inputs=self.settings.probe_inputs,
                                  op_level=self.level == "op", on_micro_batch=self._micro_batch).install()
        if self.level == "op":
            self._ops = OpRecorder(rec, self._hooks.innermost, self.parallel,
                                   selected=lambda info: info.selected or not full).start()
            if full:
                self._colls = collectives.CollectiveRecorder(rec, self._hooks.innermost, self._ops, self.parallel)
                collectives.set_target(self._colls)

    def first_micro_batch(self, chunk: int) -> None:
        """The iteration began inside ``chunk``'s forward (after its pre-hook would have run): count it."""
        self._micro_batch(chunk)

    def _micro_batch(self, chunk: int) -> None:
        rec = self.record
        if rec is None:
            return
        rec.chunk = chunk
        rec.micro_batch = rec.micro_batches.get(chunk, 0)
        rec.micro_batches[chunk] = rec.micro_batch + 1

    def forward_backward_done(self) -> None:
        """The forward/backward of the iteration is over: ops and collectives are no longer recorded."""
        if self._ops is not None:
            self._ops.stop()
        collectives.set_target(None)

    def before_step(self, optimizer: Any = None) -> None:
        """The optimizer is about to step: every parameter's gradient (Megatron's main_grad, dist-opt shards)."""
        self._params_entry("parameters_grad", optimizer)

    def after_step(self, optimizer: Any = None) -> None:
        """The optimizer stepped: every parameter's new value."""
        self._params_entry("parameters_updated", optimizer)
        if optimizer is not None and self.record is not None:
            scale = getattr(optimizer, "get_loss_scale", None)
            try:
                value = scale() if callable(scale) else None
            except Exception:  # an optimizer without a scaler of its own
                value = None
            if isinstance(value, torch.Tensor):
                self.record.meta_slots["loss_scale"] = self.record.batch.add_value(value)

    def _params_entry(self, phase: str, optimizer: Any) -> None:
        rec = self.record
        if rec is None or self._params[phase] or (not rec.full and phase != "parameters_grad"):
            return  # the NaN watch checks gradients (a NaN reduced in from another rank shows there), not values
        self._params[phase] = True
        self.forward_backward_done()
        record_params(rec, self.table, self.parallel, phase, optimizer)

    def end(self) -> None:
        """The iteration is over: hooks off, one read of every statistic, the dump, the NaN check."""
        rec = self.record
        if rec is None:
            return
        self.record = None
        self.forward_backward_done()
        ops, colls, hooks = self._ops, self._colls, self._hooks
        self._ops = self._colls = self._hooks = None
        if hooks is not None:
            hooks.remove()
            hooks.detach()
        for h in self._optimizer_hooks:
            h.remove()
        self._optimizer_hooks.clear()
        entries = rec.finish()
        found = rec.first_nonfinite() if self.settings.probe_nan else None
        folder = writer.step_folder(self.settings.probe_dir, rec.iteration, rec.rank)
        if rec.full or found is not None:
            self._write(rec, entries, hooks, ops, colls)
        if found is not None:
            nan.stop(nan.describe(found, entries[found[0]], rec.rank, folder))

    def _write(self, rec: IterationRecord, entries: dict, hooks: ModuleHooks | None, ops: OpRecorder | None,
               colls: collectives.CollectiveRecorder | None) -> None:
        construct: dict[str, str | None] = {}
        for part in (hooks, ops, colls):
            if part is not None:
                construct.update(part.parents)
        mb = max(rec.micro_batches.values()) if rec.micro_batches else 0
        run = meta.run_meta(iteration=rec.iteration, level=self.level, framework=self.framework, table=self.table,
                            chunks=self.chunks, parallel=self.parallel, context=self.context, micro_batches=mb,
                            nan_check=self.settings.probe_nan, loss_scale=getattr(rec, "meta_values", {}).get(
                                "loss_scale"))
        folder = writer.step_folder(self.settings.probe_dir, rec.iteration, rec.rank)
        rec.save_tensors(os.path.join(folder, "tensors"))
        writer.write_dump(self.settings.probe_dir, rec.iteration, rec.rank, level=self.level, meta=run,
                          entries=entries, construct=construct, stacks=hooks.stacks if hooks is not None else {},
                          tensor_files=os.path.isdir(os.path.join(folder, "tensors")))

    # ------------------------------------------------------------ own loops
    def watch_torch_optimizers(self) -> None:
        """An own loop: any torch optimizer's step inside the iteration records the parameters around it."""
        if self.record is None or not self.record.full:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._optimizer_hooks = [register_optimizer_step_pre_hook(lambda opt, args, kwargs: self.before_step()),
                                 register_optimizer_step_post_hook(lambda opt, args, kwargs: self.after_step())]

