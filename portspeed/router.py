"""Deprecated: the collective router moved to ``portspeed.comm`` (removal after 2027-06-30).

``portspeed.router.real_backend(group)`` keeps working until then; use
``portspeed.comm.real_backend(group)``.
"""

from __future__ import annotations

import warnings

from portspeed.comm.router import *  # noqa: F401,F403
from portspeed.comm.router import map_backend, real_backend, requested_backend, stats  # noqa: F401

warnings.warn("portspeed.router is deprecated and will be removed after 2027-06-30; "
              "use portspeed.comm (portspeed.comm.real_backend)", DeprecationWarning, stacklevel=2)
