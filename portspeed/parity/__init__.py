"""The loss-parity toolkit: loss records, tolerance bands, comparisons, run matrices.

Layer: beside the engine, depending only on the foundation (``portspeed.errors``); it never
imports torch at package import, a device adapter, a patch or a framework, so a
comparison can run anywhere the records can be read.

- ``losslog``        Megatron log parsing and JSON loss records (read, and written: ``open_loss_log``).
- ``tolerance``      tolerance bands, first divergence, largest deviation.
- ``compare``        `portspeed compare` (``--probe``: ``portspeed.probe.reading.compare``).
- ``runspec``        specs that launch a backend x layout matrix of runs.
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
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
