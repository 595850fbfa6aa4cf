"""``--probe-nan``: name the first module (at op level, the op) whose output or gradient turned non-finite.

Why portspeed's own: msprobe's NaN check imports ``torch_npu``; this one runs on every device.
It is cheap enough to leave on for a whole run: on every iteration each module output and each
gradient of one gets its Max and Min queued on the device (one ``aminmax``; both finite exactly when
every element is: ``portspeed.probe.stats``), and the sums are read once, at the iteration's end. The first
non-finite record in this rank's recording order (forward outputs as modules finish, then
gradients as they arrive) is the answer: a NaN made inside a module shows first at that module,
before its parent and the modules that read it.

Then: the iteration's dump is written (full statistics when the iteration was in
``--probe-iterations``, else the flags: ``Max``, ``Min`` and ``ps_finite`` per tensor), one line goes to
stderr, and the process exits with ``NAN_EXIT``; under ``portspeed run`` (torchrun) the other ranks
are ended by the launcher. The line (one line; folded here)::

    portspeed probe: non-finite at iteration 3, micro-batch 0, rank 0, forward: decoder.layers.1 (TransformerLayer)
        output 0 is not finite (Max nan, Min nan); dump: DIR/step3/rank0

(``has 1 NaN, 0 Inf`` where the iteration was recorded in full.)

Collective inputs on C++ backends are covered by torch's own ``TORCH_DIST_NAN_CHECK=1`` from torch
2.15 (a check before each collective, raising on the rank that sends a NaN); it does not name a
module, misses values that never reach a collective, and sees no Python backend.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["NAN_EXIT", "describe", "stop"]

#: the exit status of a rank that found a non-finite value
NAN_EXIT = 86


def describe(found: tuple[str, str, Any, dict[str, Any]], entry: dict[str, Any], rank: int, folder: str) -> str:
    """The one line naming where the first non-finite value was made."""
    key, field, index, rec = found
    phase = entry.get("ps_phase", "forward")
    where = entry.get("ps_module") or "(outside any module)"
    what = f"{where} ({entry.get('ps_class')})"
    if entry.get("ps_op"):
        what += f" op {key.rsplit('.', 2)[0]} #{entry.get('ps_op_index')}"
    part = {"output": "output", "input": "output gradient"}.get(field, field)
    if phase in ("parameters_grad", "parameters_updated"):
        part = f"parameter {field}"
    counts = (f"has {rec['ps_nan']} NaN, {rec['ps_inf']} Inf" if rec.get("ps_nan") is not None
              else f"is not finite (Max {rec.get('Max')!r}, Min {rec.get('Min')!r})")
    mb = entry.get("ps_micro_batch", -1)
    return (f"portspeed probe: non-finite at iteration {entry.get('ps_iteration')}, micro-batch {mb}, rank {rank}, "
            f"{phase}: {what} {part} {index} {counts}; dump: {folder}")


def stop(line: str) -> None:
    """Print ``line`` to stderr and end this process with NAN_EXIT (no clean-up that could wait on other ranks)."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    os._exit(NAN_EXIT)
