"""Deprecated: the collective router moved to ``portspeed.comm`` (removal after 2027-06-30).

``portspeed.router.real_backend(group)`` keeps working until then and is the same function
as ``portspeed.comm.real_backend(group)``, its documented successor; so are the other
names below. Importing this module warns once (DeprecationWarning).
"""

from __future__ import annotations

import warnings

from portspeed.comm.backends import map_backend, real_backend, requested_backend
from portspeed.comm.groups import capabilities_of, use_capabilities
from portspeed.comm.rewrites import reset_stats, stats
from portspeed.comm.router import COLLECTIVE_ROUTES, reset
from portspeed.comm.work import RewriteWork

__all__ = [
    "COLLECTIVE_ROUTES",
    "RewriteWork",
    "capabilities_of",
    "map_backend",
    "real_backend",
    "requested_backend",
    "reset",
    "reset_stats",
    "stats",
    "use_capabilities",
]

#: the date after which this module is removed
REMOVAL = "2027-06-30"

warnings.warn(f"portspeed.router is deprecated and will be removed after {REMOVAL}; "
              "use portspeed.comm (portspeed.comm.real_backend)", DeprecationWarning, stacklevel=2)
