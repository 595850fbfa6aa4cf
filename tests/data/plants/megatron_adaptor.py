"""TEST-ONLY: an adaptor that plants one fault in stock Megatron-LM, with no edit to ``pretrain_gpt.py``.

The example trainer plants its faults with ``--plant-*`` flags; a stock script has no such flags, so
this adaptor brings ``portspeed.testing.plant``'s plants in through `portspeed run`'s ``--adaptor``:
it imports ``portspeed.megatron_adaptor`` (what ``--adaptor megatron`` does), registers the fault
``PORTSPEED_PLANT`` names, and tells the plant which iteration runs (Megatron-LM's
``args.curr_iteration + 1`` at each ``train_step``: the number Megatron prints, the probe's step).

``PORTSPEED_PLANT`` (the example trainer's flags, same meaning):

- ``reduce-avg:LAYER[:ITER]``: decoder layer LAYER's row-parallel all_reduce averaged in ITER (default 1);
  TP >= 2, ``--transformer-impl local``;
- ``nan:ITER:LAYER``: one NaN in decoder layer LAYER's output in ITER (micro-batch 0);
- ``slow:LAYER:MS[:RANK]``: decoder layer LAYER's MLP forward sleeps MS milliseconds (LAYER ``*``: every layer's), on
  global rank RANK only when given (``--perf``'s slow module, or slow rank);
- ``item:LAYER:COUNT``: COUNT ``.item()`` host round trips in each forward of decoder layer LAYER's MLP.

Run with the folder on the workers' path::

    PORTSPEED_PLANT=reduce-avg:1:1 PYTHONPATH=$MEGATRON_LM_ROOT:tests/data portspeed run \\
        --adaptor plants.megatron_adaptor --probe DIR --nproc-per-node 2 $MEGATRON_LM_ROOT/pretrain_gpt.py ...
"""

import os
import sys
from typing import Any, Callable

import portspeed.megatron_adaptor  # noqa: F401  (first: what --adaptor megatron sets up)
import portspeed
from portspeed.patching.record import WRAP, Patch
from portspeed.testing import plant

ITERATION_PATCH = "tests.plants.megatron_adaptor.iteration"


def _numbers(text: str, lo: int, hi: int) -> list[int]:
    parts = text.split(":")
    if not lo <= len(parts) <= hi or not all(p.isdigit() for p in parts):
        raise ValueError(text)
    return [int(p) for p in parts]


def _plant(spec: str) -> None:
    kind, _, rest = spec.partition(":")
    try:
        if kind == "reduce-avg":
            layer, *it = _numbers(rest, 1, 2)
            plant.plant_reduce_avg(layer, iteration=it[0] if it else 1)
        elif kind == "nan":
            it, layer = _numbers(rest, 2, 2)
            plant.plant_nan(it, layer=layer)
        elif kind == "slow":
            head, _, tail = rest.partition(":")
            ms, *rank = _numbers(tail, 1, 2)
            layer = None if head == "*" else _numbers(head, 1, 1)[0]
            plant.plant_slow(layer, ms, rank=rank[0] if rank else None)
        elif kind == "item":
            layer, count = _numbers(rest, 2, 2)
            plant.plant_item(layer, count)
        else:
            raise ValueError(spec)
    except (ValueError, plant.PlantError) as e:
        print(f"plants.megatron_adaptor: PORTSPEED_PLANT={spec!r} is not reduce-avg:LAYER[:ITER], nan:ITER:LAYER, "
              f"slow:LAYER|*:MS[:RANK] or item:LAYER:COUNT ({e})", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _tell_iteration(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    from megatron.training.global_vars import get_args

    plant.set_iteration(get_args().curr_iteration + 1)
    return wrapped(*args, **kwargs)


_plant(os.environ.get("PORTSPEED_PLANT", ""))
portspeed.manager().register([Patch(name=ITERATION_PATCH, target="megatron.training.training:train_step", kind=WRAP,
                                    impl=_tell_iteration, distribution="megatron-core",
                                    reason="TEST-ONLY: tells the planted fault which Megatron-LM iteration runs")])
portspeed.manager().apply()
