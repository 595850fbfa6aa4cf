"""The probe's reading: dumps read, a run's entries paired with the reference's, bands, the first divergence.

Floor: parity (the foundation only: ``portspeed.errors``); no torch, no device, no recording code, so
`portspeed compare --probe` reads two folders anywhere they can be read.

- ``dumps``    reading probe dumps (``portspeed run --probe DIR``; docs/probe-format.md).
- ``pairing``  a run's probe entries put on the reference's layout (split joined, copies kept apart).
- ``bands``    bands per statistic, scaled to the tensor, per dtype and kind of pair.
- ``compare``  `portspeed compare --probe REF RUN`: the first divergence in one line.
"""

from __future__ import annotations

from portspeed.lazy import lazy_exports

_PUBLIC = {
    "read_dump": ".dumps",
    "compare_dumps": ".compare",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
