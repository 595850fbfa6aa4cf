"""TEST-ONLY: planted faults, to prove that portspeed's parity tools find real bugs and name where they are.

Why: a parity harness that has only ever said "match" proves nothing; it must also catch
a wrong run and point at the right place. This module declares deliberately wrong patches,
in the same form as every real one (``Patch`` records registered into ``portspeed.manager()``),
so the proof exercises the real patch machinery too. Three faults, one per kind of bug a port
meets (the example trainer's ``--plant-*`` flags call them):

- ``plant(from_iteration, layer, factor)``, a wrong gradient: a wrapper of Megatron-Core's
  ``TransformerLayer.forward`` that, on the layer whose 0-based global index is ``layer``
  (``decoder.layers.<layer>`` in a PP1 model), multiplies the gradient flowing back into that
  layer's output by ``factor``, in every iteration ``>= from_iteration``. The loss of iteration
  N is computed before N's update, so the **first diverging lm loss is ``from_iteration + 1``**
  while the first diverging grad norm is ``from_iteration``; at ``from_iteration`` every
  activation agrees and the first differing gradient is ``decoder.layers.<layer>.mlp.linear_fc2``.
- ``plant_reduce_avg(layer, iteration)``, a wrong collective: in iteration ``iteration``, the
  tensor-parallel all_reduce of decoder layer ``layer``'s ``self_attention.linear_proj``
  (Megatron's ``RowParallelLinear``, local spec, no sequence parallelism) is issued with
  ``ReduceOp.AVG`` instead of a sum, **on every TP rank** (so the ranks still agree with each
  other: the output is the sum / TP on all of them, a full copy that is wrong everywhere). It
  happens in every micro-batch of that iteration (the one call site, once per forward of the
  layer); nothing else changes. Wrappers: ``Attention.forward`` arms the layer's ``linear_proj``,
  ``RowParallelLinear.forward`` flags that module's call, and ``tensor_parallel.mappings._reduce``
  averages the one flagged reduce (it goes through ``torch.distributed.all_reduce``, so the
  router rewrites the AVG where the backend lacks it, as for any caller). The loss moves at
  ``iteration`` itself (the forward is wrong). TP1 has no such reduce: plant it at TP >= 2.
- ``plant_nan(iteration, layer)``, a non-finite value: the first forward call of decoder layer
  ``layer``'s ``TransformerLayer`` in ``iteration`` (micro-batch 0) returns its hidden states with
  element ``[0, 0, 0]`` (first position, first sequence, first channel of this rank's tensor) set
  to NaN; the module path is ``decoder.layers.<layer>`` (class ``TransformerLayer``), and its
  sub-modules' outputs stay finite. The lm loss of ``iteration`` is NaN (an activation recompute of
  that micro-batch is not poisoned).

``set_iteration(n)`` tells the patches which iteration is running (the trainer calls it);
``planted()`` says what the active plant changed in this process so far (one line, or '').

Never enable these outside tests: they make training wrong on purpose.

Example::

    from portspeed.testing import plant
    plant.plant_reduce_avg(layer=1, iteration=1)
    for it in range(1, 4):
        plant.set_iteration(it); train_step(...)
    print(plant.planted())   # "TEST-ONLY plant: 4 all_reduce call(s) averaged ..."
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from portspeed.errors import PortspeedError
from portspeed.patching.record import WRAP, Patch

__all__ = ["NAN_PATCH", "PATCH_NAME", "PlantError", "REDUCE_AVG_PATCHES", "make_patch", "plant", "plant_nan",
           "plant_reduce_avg", "plant_slow", "plant_item", "planted", "set_iteration", "SLOW_PATCHES"]

log = logging.getLogger("portspeed.testing.plant")

PATCH_NAME = "portspeed.testing.plant_divergence"
REDUCE_AVG_PATCHES = ("portspeed.testing.plant_reduce_avg.arm", "portspeed.testing.plant_reduce_avg.flag",
                      "portspeed.testing.plant_reduce_avg.reduce")
NAN_PATCH = "portspeed.testing.plant_nan"
_LAYER = "megatron.core.transformer.transformer_layer:TransformerLayer.forward"
_ATTENTION = "megatron.core.transformer.attention:Attention.forward"
_ROW_PARALLEL = "megatron.core.tensor_parallel.layers:RowParallelLinear.forward"
_REDUCE = "megatron.core.tensor_parallel.mappings:_reduce"

_state: dict[str, Any] = {"from": None, "layer": None, "factor": 1.0, "iteration": None,
                          "avg_layer": None, "avg_iteration": None, "proj": None, "avg_now": False, "averaged": 0,
                          "nan_layer": None, "nan_iteration": None, "nan_done": None}


class PlantError(PortspeedError, ValueError):
    """A planted fault was asked for with arguments that would plant nothing."""


def set_iteration(n: int) -> None:
    """The iteration now running (each plant acts in its own iterations only)."""
    _state["iteration"] = int(n)


def _is_layer(instance: Any, layer: int | None) -> bool:
    return layer is not None and getattr(instance, "layer_number", None) == layer + 1  # Megatron numbers from 1


# ------------------------------------------------------------------ a wrong gradient
def _active_on(instance: Any) -> bool:
    it, start = _state["iteration"], _state["from"]
    if it is None or start is None or it < start:
        return False
    return _is_layer(instance, _state["layer"])


def _scale_output_grad(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = wrapped(*args, **kwargs)
    if _active_on(instance):
        hidden = out[0] if isinstance(out, tuple) else out
        if getattr(hidden, "requires_grad", False):
            factor = _state["factor"]
            hidden.register_hook(lambda g: g * factor)
    return out


def make_patch() -> Patch:
    """The declared (deliberately wrong) gradient patch."""
    return Patch(
        name=PATCH_NAME,
        target=_LAYER,
        kind=WRAP,
        impl=_scale_output_grad,
        distribution="megatron-core",
        reason=("TEST-ONLY planted divergence: scales the gradient flowing back into one transformer layer, "
                "so tests can prove that portspeed compare and layer statistics catch and localise a bug"),
    )


def _register(patches: list[Patch]) -> None:
    import portspeed

    mgr = portspeed.manager()
    known = {r.patch.name for r in mgr.records()}
    mgr.register([p for p in patches if p.name not in known])
    mgr.apply()


def plant(from_iteration: int, layer: int = 1, factor: float = 3.0) -> Patch:
    """Register the planted divergence into ``portspeed.manager()`` (applied at once if the manager is active)."""
    if from_iteration < 1:
        raise PlantError(f"plant(from_iteration={from_iteration}): iterations start at 1; pass 1 or more")
    if layer < 0:
        raise PlantError(f"plant(layer={layer}): a 0-based decoder layer index (0, 1, ...) is needed")
    if factor == 1.0:
        raise PlantError("plant(factor=1.0) would change nothing; pass another factor, e.g. 3.0")
    _state.update({"from": int(from_iteration), "layer": int(layer), "factor": float(factor)})
    patch = make_patch()
    _register([patch])
    log.warning("TEST-ONLY planted divergence active: decoder layer %d output gradient x%g from iteration %d",
                layer, factor, from_iteration)
    return patch


# ------------------------------------------------------------------ a wrong collective
def _arm_linear_proj(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Attention.forward of the planted layer in the planted iteration: its linear_proj is the one to flag."""
    if _state["iteration"] != _state["avg_iteration"] or not _is_layer(instance, _state["avg_layer"]):
        return wrapped(*args, **kwargs)
    _state["proj"] = getattr(instance, "linear_proj", None)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _state["proj"] = None


def _flag_row_parallel(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """RowParallelLinear.forward: only the armed module's call has its output reduce averaged."""
    if _state["proj"] is None or instance is not _state["proj"]:
        return wrapped(*args, **kwargs)
    _state["avg_now"] = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        _state["avg_now"] = False


def _reduce_args(input_: Any, group: Any) -> tuple[Any, Any]:
    return input_, group  # mappings._reduce's parameters, bound by name or position


def _reduce_as_average(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """mappings._reduce(input_, group): the flagged call all-reduces with AVG (once), every other call is untouched."""
    if not _state["avg_now"]:
        return wrapped(*args, **kwargs)
    import torch.distributed as dist

    input_, group = _reduce_args(*args, **kwargs)
    if group is None or group.size() == 1:
        return wrapped(*args, **kwargs)
    _state["avg_now"] = False  # ONE all_reduce per flagged forward call
    out = input_.contiguous()
    dist.all_reduce(out, op=dist.ReduceOp.AVG, group=group)
    _state["averaged"] += 1
    return out


def plant_reduce_avg(layer: int, iteration: int = 1) -> list[Patch]:
    """Register the planted AVG all_reduce of decoder layer ``layer``'s linear_proj in ``iteration`` (TP >= 2)."""
    if iteration < 1:
        raise PlantError(f"plant_reduce_avg(iteration={iteration}): iterations start at 1; pass 1 or more")
    if layer < 0:
        raise PlantError(f"plant_reduce_avg(layer={layer}): a 0-based decoder layer index (0, 1, ...) is needed")
    _state.update({"avg_layer": int(layer), "avg_iteration": int(iteration), "averaged": 0})
    why = "TEST-ONLY planted fault: one row-parallel all_reduce averaged instead of summed"
    patches = [Patch(name=name, target=target, kind=WRAP, impl=impl, distribution="megatron-core",
                     reason=f"{why} ({role})")
               for name, target, impl, role in zip(
                   REDUCE_AVG_PATCHES, (_ATTENTION, _ROW_PARALLEL, _REDUCE),
                   (_arm_linear_proj, _flag_row_parallel, _reduce_as_average),
                   ("arms the planted layer's linear_proj", "flags that module's forward",
                    "issues the flagged all_reduce with ReduceOp.AVG"))]
    _register(patches)
    log.warning("TEST-ONLY planted fault active: decoder layer %d self_attention.linear_proj all_reduce is an "
                "average in iteration %d", layer, iteration)
    return patches


# ------------------------------------------------------------------ a non-finite value
def _nan_in_output(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = wrapped(*args, **kwargs)
    it = _state["iteration"]
    if it != _state["nan_iteration"] or _state["nan_done"] == it or not _is_layer(instance, _state["nan_layer"]):
        return out
    _state["nan_done"] = it  # the first call of the iteration only: micro-batch 0
    hidden = out[0] if isinstance(out, tuple) else out
    poisoned = hidden.clone()  # out of place: autograd sees a copy with one element replaced
    poisoned.view(-1)[0] = float("nan")
    return (poisoned, *out[1:]) if isinstance(out, tuple) else poisoned


def plant_nan(iteration: int, layer: int) -> Patch:
    """Register the planted NaN in decoder layer ``layer``'s output, in ``iteration`` (micro-batch 0)."""
    if iteration < 1:
        raise PlantError(f"plant_nan(iteration={iteration}): iterations start at 1; pass 1 or more")
    if layer < 0:
        raise PlantError(f"plant_nan(layer={layer}): a 0-based decoder layer index (0, 1, ...) is needed")
    _state.update({"nan_layer": int(layer), "nan_iteration": int(iteration), "nan_done": None})
    patch = Patch(name=NAN_PATCH, target=_LAYER, kind=WRAP, impl=_nan_in_output, distribution="megatron-core",
                  reason="TEST-ONLY planted fault: one element of one transformer layer's output set to NaN")
    _register([patch])
    log.warning("TEST-ONLY planted fault active: decoder layer %d output gets a NaN in iteration %d", layer, iteration)
    return patch


# ------------------------------------------------------------------ a slow module, a host round trip (perf)
SLOW_PATCHES = ("portspeed.testing.plant_slow.arm", "portspeed.testing.plant_slow.mlp")
_MLP = "megatron.core.transformer.mlp:MLP.forward"
_slow: dict[str, Any] = {"layer": None, "ms": 0.0, "rank": None, "items": 0, "item_ms": 0.0, "in_layer": None,
                         "slowed": 0, "synced": 0}


def _arm_layer(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """TransformerLayer.forward: which decoder layer's MLP runs now (0-based), for the MLP wrapper."""
    number = getattr(instance, "layer_number", None)
    outer = _slow["in_layer"]
    _slow["in_layer"] = number - 1 if isinstance(number, int) else None
    try:
        return wrapped(*args, **kwargs)
    finally:
        _slow["in_layer"] = outer


def _this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _slow_mlp(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """MLP.forward of the planted layer (on the planted rank): the planted sleep, or the planted .item() calls."""
    import time

    if (_slow["in_layer"] is None or _slow["layer"] is not None and _slow["in_layer"] != _slow["layer"]
            or _slow["rank"] is not None and _this_rank() != _slow["rank"]):
        return wrapped(*args, **kwargs)
    hidden = args[0] if args else kwargs.get("hidden_states")
    if _slow["items"]:
        for _ in range(_slow["items"]):
            hidden.detach().abs().sum().item()  # a host round trip: the host waits for the device's answer
            time.sleep(_slow["item_ms"] / 1e3)  # what a device's queue draining costs (the test device has none)
            _slow["synced"] += 1
    if _slow["ms"]:
        time.sleep(_slow["ms"] / 1e3)
        _slow["slowed"] += 1
    return wrapped(*args, **kwargs)


def _register_slow() -> list[Patch]:
    why = "TEST-ONLY planted slowness"
    patches = [Patch(name=SLOW_PATCHES[0], target=_LAYER, kind=WRAP, impl=_arm_layer, distribution="megatron-core",
                     reason=f"{why} (notes which decoder layer runs)"),
               Patch(name=SLOW_PATCHES[1], target=_MLP, kind=WRAP, impl=_slow_mlp, distribution="megatron-core",
                     reason=f"{why} (the planted layer's MLP forward waits, or makes host round trips)")]
    _register(patches)
    return patches


def plant_slow(layer: int | None, ms: float, rank: int | None = None) -> list[Patch]:
    """Register a sleep of ``ms`` milliseconds in each forward of decoder layer ``layer``'s MLP (None: every
    layer's), on global rank ``rank`` only or every rank: a module that is slow, or a rank that is."""
    if layer is not None and layer < 0:
        raise PlantError(f"plant_slow(layer={layer}): a 0-based decoder layer index (0, 1, ...) is needed")
    if not ms > 0:
        raise PlantError(f"plant_slow(ms={ms}) would change nothing; pass a positive number of milliseconds")
    _slow.update({"layer": None if layer is None else int(layer), "ms": float(ms), "rank": rank})
    log.warning("TEST-ONLY planted slowness: decoder layer %s's MLP forward sleeps %g ms%s", layer, ms,
                "" if rank is None else f" on rank {rank}")
    return _register_slow()


def plant_item(layer: int, count: int, ms: float = 2.0) -> list[Patch]:
    """Register ``count`` host round trips (``.item()`` of a reduction of its input, each followed by ``ms``
    milliseconds standing for a device's queue draining, which the synchronous test device does not have) in each
    forward of decoder layer ``layer``'s MLP."""
    if layer < 0 or count < 1:
        raise PlantError(f"plant_item(layer={layer}, count={count}): a 0-based decoder layer and at least one call")
    _slow.update({"layer": int(layer), "items": int(count), "item_ms": float(ms)})
    log.warning("TEST-ONLY planted host round trips: decoder layer %d's MLP forward calls .item() %d times", layer,
                count)
    return _register_slow()


def planted() -> str:
    """What the planted faults changed in this process so far, in one line ('' when nothing)."""
    done = []
    if _state["averaged"]:
        done.append(f"{_state['averaged']} all_reduce call(s) averaged (decoder layer {_state['avg_layer']} "
                    f"self_attention.linear_proj, iteration {_state['avg_iteration']})")
    if _state["nan_done"] is not None:
        done.append(f"NaN set in decoder.layers.{_state['nan_layer']} output, iteration {_state['nan_done']}")
    if _slow["slowed"]:
        where = "every decoder layer's" if _slow["layer"] is None else f"decoder.layers.{_slow['layer']}"
        done.append(f"{where} mlp slept {_slow['ms']:g} ms in {_slow['slowed']} forward(s)")
    if _slow["synced"]:
        done.append(f"{_slow['synced']} .item() round trip(s) in decoder.layers.{_slow['layer']}.mlp")
    return "TEST-ONLY plant: " + "; ".join(done) if done else ""
