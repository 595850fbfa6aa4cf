"""``portspeed.comm.capabilities`` is ``portspeed.accelerator.capabilities`` (the same module object).

Why it moved: the capability vocabulary (``Capabilities``, ``BackendGaps``, the backend names) is
what an adapter declares, so it lives with the adapter contract; ``portspeed.comm`` uses it and
asks ``portspeed.accelerator`` for the adapter, and nothing in ``portspeed.accelerator`` imports
``portspeed.comm``: the import graph of the sub-packages has no cycle (``tests/test_layers.py``).
This name stays importable, and patching an attribute through it patches the one module.
"""

from __future__ import annotations

import sys

from portspeed.accelerator import capabilities as _capabilities

sys.modules[__name__] = _capabilities
