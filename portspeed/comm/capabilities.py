"""Deprecated: ``portspeed.comm.capabilities`` is ``portspeed.accelerator.capabilities`` (removal after 2027-06-30).

Adapters import ``BackendGaps`` and the collective names from ``portspeed.vendor``. This old name
was in the adapter guide, so third-party adapters copied it: it keeps working until then, as the
same module object (patching an attribute through it patches the one module), and importing it
warns once (DeprecationWarning, at the importing line).
"""

from __future__ import annotations

import sys
import warnings

from portspeed.accelerator import capabilities as _capabilities

#: the date after which this name is removed
REMOVAL = "2027-06-30"

warnings.warn(f"portspeed.comm.capabilities is deprecated and will be removed after {REMOVAL}; import BackendGaps "
              "and the collective names from portspeed.vendor", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _capabilities
