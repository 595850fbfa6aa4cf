"""The perf recording of one process: which iterations and ranks are timed, and a timed iteration's life.

Why the probe's shape: the places that know where an iteration begins and ends are the same as for the
accuracy probe (Megatron's schedule and optimizer, an own loop's documented call), so the perf
recording is driven by the same three calls: ``begin(n, chunks)`` when the schedule starts,
``forward_backward_done()`` when it returns, ``end()`` after the optimizer's step. With
``PORTSPEED_PERF`` unset ``current()`` is None and nothing is installed anywhere (no patch is even
declared: ``patches/perf.py``).

A timed iteration (``A <= n <= B`` of ``--perf-iterations`` on a rank of ``--perf-ranks``) gets, from
``begin`` to ``forward_backward_done``: the module spans' hooks (``spans``), what counts host syncs and
copies (at module level the Tensor methods, ``syncs``; at op level or on a PrivateUse1 device, whose CPU
fallbacks are counted too, the dispatch mode, ``dispatch``), the collective timer (``collectives``), the
portable TE's kernel calls with the implementation that ran (``te_kernels``). Nothing
is synchronized per module; ``end`` reads the clock once and appends one line to
``DIR/rank<R>.jsonl`` (``writer``), with ``host_rung``: the aten ops portspeed's host rung computed on the host over
the iteration (``portspeed.accelerator.host_rung``; they have a kernel, so they are no fallback).
"""

from __future__ import annotations

import atexit
import time
from typing import Any, Sequence

import torch

from portspeed.errors import ConfigError
from portspeed.perf import collectives, te_kernels, writer
from portspeed.perf.clock import Clock, make_clock
from portspeed.perf.dispatch import HostWatch
from portspeed.perf.spans import SpanHooks
from portspeed.perf.syncs import MethodWatch
from portspeed.probe import meta
from portspeed.probe.modules import ModuleTable
from portspeed.probe.sessions import ProcessSession

__all__ = ["PerfSession", "current", "reset"]

_ONE: ProcessSession["PerfSession"] = ProcessSession("perf_dir", lambda settings: PerfSession(settings))


def current() -> "PerfSession | None":
    """This process's perf session, made on first use; None when ``PORTSPEED_PERF`` is not set."""
    return _ONE.current()


def reset() -> None:
    """Forget the session (tests; an open iteration is ended first)."""
    _ONE.reset()


class PerfSession:
    """See the module docstring."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.level = settings.perf_level
        self.last = 0  # the last iteration begun
        self.explicit = False
        self.open = False
        self._tables: dict[tuple[int, ...], ModuleTable] = {}
        self._clock: Clock | None = None
        self._memory: Any = None  # (read, reset) of the device's peak counter; () where it has none
        self._checked = False
        #: host syncs and copies are watched (the Tensor methods at module level, the dispatch mode at op level or
        #: on a PrivateUse1 device); a benchmark turns it off to measure the spans alone (benchmarks/bench_perf.py)
        self.host_watch = True
        self.sees = "off"
        atexit.register(self.end)

    @property
    def rank(self) -> int:
        return meta._world()[0]

    def wants(self, n: int) -> bool:
        """Whether iteration ``n`` is timed on this rank."""
        a, b = self.settings.perf_iterations
        ranks = self.settings.perf_ranks
        return a <= n <= b and (ranks is None or self.rank in ranks)

    def _check_folder(self) -> None:
        if self._checked:
            return
        self._checked = True
        path = writer.rank_file(self.settings.perf_dir, self.rank)
        if writer.exists(path):
            raise ConfigError(f"PORTSPEED_PERF={self.settings.perf_dir!r} already holds a perf recording of rank "
                              f"{self.rank} ({path}); remove it or choose another folder")

    # ------------------------------------------------------------ an iteration's life
    def begin(self, n: int, chunks: Sequence[torch.nn.Module], *, framework: str, explicit: bool = False) -> None:
        """Iteration ``n`` begins on ``chunks`` (the model, or Megatron's model chunks in order)."""
        if self.open:
            if self.explicit and not explicit:
                return  # an integration inside the documented call: one iteration
            self.end()
        self.last, self.explicit = n, explicit
        if not self.wants(n):
            return
        self._check_folder()
        from portspeed import get_accelerator

        if self._clock is None:
            self._clock = make_clock()
        clock = self._clock
        key = tuple(id(c) for c in chunks)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = ModuleTable(chunks, None)
        self.framework, self.table, self.chunks = framework, table, list(chunks)
        clock.start()
        self.wall0 = time.time()
        self.t_begin = clock.stamp()
        self.t_fb = self.t_end = None
        self._host0 = _host_rung_calls()
        if self._memory is None:
            self._memory = _memory_counter()
        self.spans = SpanHooks(chunks, table, clock, self._memory or None).install()
        self.timer = collectives.CollectiveTimer(self.spans.current, clock.stamp)
        collectives.SLOT.target = self.timer
        self._stop_kernels = te_kernels.watch(self.spans.current)
        self.watch: HostWatch | None = None
        self.methods: MethodWatch | None = None
        device = get_accelerator().device_type
        self.sees = "off"
        if self.level == "op" or device == torch._C._get_privateuse1_backend_name():
            self.watch = HostWatch(self.spans.current, device, self.level == "op", clock.stamp)
            self.watch.__enter__()
            self.sees = "dispatch"
        elif self.host_watch:
            self.methods = MethodWatch(self.spans.current, device).install()
            self.sees = "tensor-methods"
        self.open = True

    def forward_backward_done(self) -> None:
        """The schedule returned: spans close, the dispatch mode and the collective timer stop."""
        if not self.open or self.t_fb is not None:
            return
        self.t_fb = self._clock.stamp()
        self.spans.close_all()
        self.spans.remove()
        collectives.SLOT.target = None
        self._stop_kernels()
        if self.watch is not None:
            self.watch.__exit__(None, None, None)
            self.watch = None
        if self.methods is not None:
            self.methods.remove()
            self.methods = None

    def end(self) -> None:
        """The iteration is over (after the optimizer's step): one read of the clock, one line written."""
        if not self.open:
            return
        self.forward_backward_done()
        self.t_end = self._clock.stamp()
        self.open = False
        parallel = meta.parallel_of(self.table, self.chunks)
        record = writer.iteration_record(
            iteration=self.last, rank=self.rank, world=meta._world()[1], framework=self.framework,
            clock=self._clock, begin=self.t_begin, fb_done=self.t_fb, end=self.t_end, spans=self.spans.spans,
            calls=self.timer.calls, level=self.level, wall0=self.wall0, syncs_seen_by=self.sees,
            layout={"tp": parallel.tp, "cp": parallel.cp, "ep": parallel.ep, "dp": parallel.dp, "sp": parallel.sp,
                    "pp": _pp(), "ranks": meta.megatron_ranks()})
        record.update(_link())
        record["host_rung"] = {op: n - self._host0.get(op, 0) for op, n in _host_rung_calls().items()
                               if n > self._host0.get(op, 0)}
        from portspeed import get_accelerator

        record["device"] = get_accelerator().name  # the adapter: what `compare --perf --png` titles each run with
        writer.append(self.settings.perf_dir, self.rank, record)


def _host_rung_calls() -> dict[str, int]:
    """The aten ops portspeed's host rung ran so far (ops the adapter declares wrong: they have a kernel, so the
    dispatch mode does not count them as fallbacks; the line's ``host_rung`` is their count over the iteration)."""
    from portspeed.accelerator import host_rung

    return host_rung.calls()


def _memory_counter() -> Any:
    """The active adapter's peak-memory counter as (read, reset), or () where it keeps none (the CPU adapter, an
    adapter whose statistics fail)."""
    from portspeed import get_accelerator

    acc = get_accelerator()
    if getattr(acc, "device_is_host", False):
        return ()
    try:
        acc.max_memory_allocated()
        acc.reset_peak_memory_stats()
    except Exception:  # no allocator statistics on this device
        return ()
    return (acc.max_memory_allocated, acc.reset_peak_memory_stats)


def _link() -> dict[str, Any]:
    """The adapter, the default group's real backend and the host: the key of the link bandwidth table
    (``portspeed.perf.reading.links``) that `compare --perf` reads beside RUN's collectives."""
    import socket

    import torch.distributed as dist

    from portspeed import comm, get_accelerator

    backend = None
    if dist.is_available() and dist.is_initialized():
        try:
            backend = comm.real_backend()
        except ValueError:  # the default group is gone
            backend = None
    return {"adapter": get_accelerator().name, "backend": backend, "host": socket.gethostname()}


def _pp() -> int:
    ps = meta._ps()
    return int(ps.get_pipeline_model_parallel_world_size()) if ps is not None else 1
