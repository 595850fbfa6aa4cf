"""TEST-ONLY: examples/pretrain_gpt.py with one planted fault: rank 1 skips one tensor-parallel all_reduce.

Why: the hang users meet most on a new port is a rank that issues one collective fewer. This
wraps ``megatron.core.tensor_parallel.mappings._reduce`` (the all_reduce of Megatron's TP
forward: RowParallelLinear's output, the vocab-parallel embedding) so that on rank 1 its
``PLANT_SKIP_REDUCE``-th call (default 3) returns its input without reducing, then runs the
example trainer unchanged (its arguments are this script's), or ``PLANT_SCRIPT`` (a stock
Megatron-LM ``pretrain_gpt.py``, docs/reliability.md). ``tests/test_trace_megatron.py``
runs it under ``portspeed run --hang-timeout`` and reads the closing lines.
"""

import portspeed.megatron_adaptor  # noqa: F401  (first, as in the example: patches before Megatron loads)

import os
import runpy
import sys

from megatron.core.tensor_parallel import mappings

#: the training script to run (default: the example trainer; a stock Megatron-LM pretrain_gpt.py by hand)
EXAMPLE = os.environ.get("PLANT_SCRIPT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                         "examples", "pretrain_gpt.py")
SKIP_AT = int(os.environ.get("PLANT_SKIP_REDUCE", "3"))
_real_reduce = mappings._reduce
_calls = [0]


def _reduce(input_, *args, **kwargs):
    _calls[0] += 1
    if os.environ.get("RANK") == "1" and _calls[0] == SKIP_AT:
        print(f"trace_megatron_skip: rank 1 skips _reduce call {SKIP_AT}", file=sys.stderr, flush=True)
        return input_  # the planted fault
    return _real_reduce(input_, *args, **kwargs)


mappings._reduce = _reduce
sys.path.insert(0, os.path.dirname(os.path.abspath(EXAMPLE)))
sys.argv = [EXAMPLE, *sys.argv[1:]]
runpy.run_path(EXAMPLE, run_name="__main__")
