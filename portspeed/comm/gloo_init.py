"""Gloo groups that connect their ranks when first used, not when created (torch's lazy Gloo init).

Why: Megatron creates dozens of process groups at start-up (``initialize_model_parallel``
builds every TP, PP, DP, CP, EP group and their combinations, plus a Gloo twin of the
data-parallel ones), and a Gloo group created eagerly connects a full mesh of TCP pairs
between its members before ``new_group`` returns, each connection going through the
store. On a host backend with many ranks on few cores that mesh-building is where the
time goes (Megatron-LM's own 8-rank unit tests on 2 cores: see docs/megatron-unit-tests.md
and ``benchmarks/bench_gloo_lazy_init.py``), while most of those groups carry few or no
collectives. torch (from 2.8, the ``TORCH_GLOO_LAZY_INIT`` environment variable; documented
under "Improving initialization time") can instead connect each pair on its first use. torch
reads the variable when a group's ``ProcessGroupGloo._Options()`` is made (torch 2.13: options
made before the variable is set give an eager group), so code that builds a Gloo group itself
must make its options inside ``lazy_gloo`` too (the test device's CCL does).

What portspeed does: the group wrappers (``portspeed.comm.groups``) create every group
whose real backend includes Gloo inside ``lazy_gloo(backend)``, which sets
``TORCH_GLOO_LAZY_INIT=1`` for the construction and puts the previous value back after.

- ``PORTSPEED_GLOO_LAZY_INIT=0`` turns it off (eager, torch's default);
- an explicit ``TORCH_GLOO_LAZY_INIT`` in the environment wins (the user's choice);
- torch releases before 2.8 ignore the variable: groups are eager, as without portspeed
  (run on 2.7.1, 2.8.0 and 2.13.0 with ``benchmarks/check_torch_gloo_lazy.py``).

Behaviour differences torch documents for lazy Gloo: a connection error shows at the
first collective instead of at ``new_group``; ``recv`` from any source cannot connect on
demand (Megatron does not use it).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from portspeed.config import settings

__all__ = ["TORCH_ENV", "lazy_gloo", "wants_lazy"]

#: torch's own switch, read by ProcessGroupGloo's constructor
TORCH_ENV = "TORCH_GLOO_LAZY_INIT"


def wants_lazy(backend: object) -> bool:
    """Whether a group on ``backend`` (a real backend string such as 'gloo' or 'cpu:gloo,cuda:nccl')
    should be created lazily: it runs on Gloo, portspeed's setting allows it, the user did not choose."""
    return (isinstance(backend, str) and "gloo" in backend.lower() and TORCH_ENV not in os.environ
            and settings().gloo_lazy_init)


@contextlib.contextmanager
def lazy_gloo(backend: object) -> Iterator[bool]:
    """Create the groups made inside this block lazily when ``wants_lazy(backend)``; yields whether it did."""
    if not wants_lazy(backend):
        yield False
        return
    os.environ[TORCH_ENV] = "1"
    try:
        yield True
    finally:
        os.environ.pop(TORCH_ENV, None)
