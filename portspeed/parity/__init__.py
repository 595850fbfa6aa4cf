"""The loss-parity toolkit: loss records, tolerance bands, comparisons, run matrices, probe dumps compared.

Layer: beside the engine, depending only on the foundation (``portspeed.errors``); it never
imports torch at package import, a device adapter, a patch or a framework, so a
comparison can run anywhere the records can be read.

- ``losslog``        Megatron log parsing and JSON loss records (read, and written: ``open_loss_log``).
- ``tolerance``      tolerance bands, first divergence, largest deviation.
- ``compare``        `portspeed compare`.
- ``runspec``        specs that launch a backend x layout matrix of runs.
- ``probe_format``   reading probe dumps (``portspeed run --probe DIR``; docs/probe-format.md).
- ``probe_layout``   a run's probe entries put on the reference's layout (split joined, copies kept apart).
- ``probe_bands``    bands per statistic, scaled to the tensor, per dtype and kind of pair.
- ``probe_compare``  `portspeed compare --probe REF RUN`: the first divergence in one line.
- ``plot``           loss curves (matplotlib, optional).
- ``pytest_plugin``  the ``pytest11`` entry point: loss-parity fixtures.
"""

from __future__ import annotations

from portspeed.lazy import lazy_exports

_PUBLIC = {
    "Tolerance": ".tolerance",
    "Comparison": ".tolerance",
    "compare_many": ".tolerance",
    "tolerance_for": ".tolerance",
    "LossRecord": ".losslog",
    "read_record": ".losslog",
    "read_dump": ".probe_format",
    "compare_dumps": ".probe_compare",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
