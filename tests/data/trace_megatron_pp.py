"""TEST-ONLY: examples/pretrain_gpt.py at PP2, one planted fault: stage 1 receives the activations in another shape.

Why: the pipeline hang users meet on a new port is a stage whose receive does not match what its
neighbour sends (a wrong ``--seq-length`` or micro-batch size on one side, a shape computed
differently per stage). This wraps Megatron's ``P2PCommunicator._communicate`` (the one place both
megatron-core 0.16 and 0.19 allocate a stage's receive buffer, from ``tensor_shape``) so that on
rank 1 its ``PLANT_RECV_AT``-th receive from the previous stage (default 1) is posted with
``PLANT_RECV_SEQ`` (default: half the sequence length) as its first dimension; the send side and
everything else run unchanged. Then it runs the example trainer (its arguments are this script's).
``tests/test_trace_megatron.py`` runs it under ``portspeed run --hang-timeout`` and reads the
closing lines.
"""

import portspeed.megatron_adaptor  # noqa: F401  (first, as in the example: patches before Megatron loads)

import os
import runpy
import sys

from megatron.core.pipeline_parallel import p2p_communication

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "pretrain_gpt.py")
RECV_AT = int(os.environ.get("PLANT_RECV_AT", "1"))
_real_communicate = p2p_communication.P2PCommunicator._communicate
_recvs = [0]


def _communicate(self, *args, **kwargs):
    if os.environ.get("RANK") == "1" and kwargs.get("recv_prev"):
        _recvs[0] += 1
        shape = kwargs.get("tensor_shape")
        if _recvs[0] == RECV_AT and shape is not None:
            seq = int(os.environ.get("PLANT_RECV_SEQ") or max(1, shape[0] // 2))
            kwargs["tensor_shape"] = (seq, *shape[1:])  # the planted fault
            print(f"trace_megatron_pp: rank 1 posts receive {RECV_AT} from the previous stage as "
                  f"{list(kwargs['tensor_shape'])} instead of {list(shape)}", file=sys.stderr, flush=True)
    return _real_communicate(self, *args, **kwargs)


p2p_communication.P2PCommunicator._communicate = _communicate
sys.path.insert(0, os.path.dirname(os.path.abspath(EXAMPLE)))
sys.argv = [EXAMPLE, *sys.argv[1:]]
runpy.run_path(EXAMPLE, run_name="__main__")
