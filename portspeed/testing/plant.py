"""TEST-ONLY: a planted divergence, to prove that `portspeed compare` and layer statistics find real bugs.

Why: a parity harness that has only ever said "match" proves nothing; it must also catch
a wrong run and point at the right place. This module declares one deliberately wrong
patch, in the same form as every real one (a `Patch` registered into
``portspeed.manager()``), so the proof exercises the real patch machinery too.

Contract
- ``plant(from_iteration, layer, factor)`` registers ``PATCH_NAME``: a wrapper of
  Megatron-Core's ``TransformerLayer.forward`` that, on the layer whose 0-based global
  index is ``layer`` (``decoder.layers.<layer>`` in a PP1 model), multiplies the gradient
  flowing back into that layer's output by ``factor``, in every iteration ``>=
  from_iteration``. Everything after that layer (in forward order) is untouched; the
  layer's own last module (``mlp.linear_fc2``: its output is summed with the residual into
  the layer output) sees the scaled gradient first, and every parameter of this layer and
  the ones before it gets a wrong gradient.
- ``set_iteration(n)`` tells the patch which iteration is running (the trainer calls it).
- Consequences a test can predict: the loss of iteration N is computed before N's update,
  so the **first diverging lm loss is ``from_iteration + 1``** while the first diverging
  grad norm is ``from_iteration``; at ``from_iteration`` every activation agrees and the
  first differing gradient (backward statistics) is ``decoder.layers.<layer>.mlp.linear_fc2``.

Never enable this outside tests: it makes training wrong on purpose.

Example::

    from portspeed.testing import plant
    plant.plant(from_iteration=3, layer=1, factor=3.0)
    for it in range(1, 9):
        plant.set_iteration(it); train_step(...)
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from portspeed.errors import PortspeedError
from portspeed.patching.record import WRAP, Patch

__all__ = ["PATCH_NAME", "PlantError", "plant", "set_iteration", "make_patch"]

log = logging.getLogger("portspeed.testing.plant")

PATCH_NAME = "portspeed.testing.plant_divergence"
_TARGET = "megatron.core.transformer.transformer_layer:TransformerLayer.forward"

_state: dict[str, Any] = {"from": None, "layer": None, "factor": 1.0, "iteration": None}


class PlantError(PortspeedError, ValueError):
    """A planted divergence was asked for with arguments that would plant nothing."""


def set_iteration(n: int) -> None:
    """The iteration now running (the planted scaling starts at ``from_iteration``)."""
    _state["iteration"] = int(n)


def _active_on(instance: Any) -> bool:
    it, start = _state["iteration"], _state["from"]
    if it is None or start is None or it < start:
        return False
    return getattr(instance, "layer_number", None) == _state["layer"] + 1  # Megatron numbers layers from 1


def _scale_output_grad(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = wrapped(*args, **kwargs)
    if _active_on(instance):
        hidden = out[0] if isinstance(out, tuple) else out
        if getattr(hidden, "requires_grad", False):
            factor = _state["factor"]
            hidden.register_hook(lambda g: g * factor)
    return out


def make_patch() -> Patch:
    """The declared (deliberately wrong) patch."""
    return Patch(
        name=PATCH_NAME,
        target=_TARGET,
        kind=WRAP,
        impl=_scale_output_grad,
        distribution="megatron-core",
        reason=("TEST-ONLY planted divergence: scales the gradient flowing back into one transformer layer, "
                "so tests can prove that portspeed compare and layer statistics catch and localise a bug"),
    )


def plant(from_iteration: int, layer: int = 1, factor: float = 3.0) -> Patch:
    """Register the planted divergence into ``portspeed.manager()`` (applied at once if the manager is active)."""
    if from_iteration < 1:
        raise PlantError(f"plant(from_iteration={from_iteration}): iterations start at 1; pass 1 or more")
    if layer < 0:
        raise PlantError(f"plant(layer={layer}): a 0-based decoder layer index (0, 1, ...) is needed")
    if factor == 1.0:
        raise PlantError("plant(factor=1.0) would change nothing; pass another factor, e.g. 3.0")
    import portspeed

    _state.update({"from": int(from_iteration), "layer": int(layer), "factor": float(factor)})
    patch = make_patch()
    mgr = portspeed.manager()
    if PATCH_NAME not in {r.patch.name for r in mgr.records()}:
        mgr.register([patch])
    mgr.apply()
    log.warning("TEST-ONLY planted divergence active: decoder layer %d output gradient x%g from iteration %d",
                layer, factor, from_iteration)
    return patch
