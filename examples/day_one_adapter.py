"""Day one of a new vendor's device, in one file: portspeed's bare test device, as a vendor first meets it.

The bare test device (``PORTSPEED_TESTDEV_BARE``, ``portspeed/testing/testdev/bare.py``) is portspeed's test
device with what a new vendor's device often lacks turned off: no memory info, no shallow-copy kernel, a wrong
fused SDPA, random ops on the host generator (and a CCL that moves no data, ``stub-ccl``). It is a TEST DEVICE,
NOT HARDWARE. This class is what a vendor writes first: names only. Then:

    PORTSPEED_TESTDEV_BARE=no-memory-info,no-shallow-copy,wrong-sdpa,host-rng \\
        portspeed conformance --adapter examples/day_one_adapter.py:DayOneAccelerator --suites device,kernels

names each fault and ends with the lines to paste at the end of the class below; with them pasted it exits 0,
and the example GPT trains in TP2 on the bare device equal to CPU TP1 (tests/test_bare_device.py;
docs/writing-an-adapter.md, "Day one"). With the stub CCL too (PORTSPEED_TESTDEV_BARE=all, and --suites
device,kernels,collectives) one more line is printed, backend = "staged": every collective through the host on
Gloo (portspeed.comm.staged); without it a multi-rank job on this file ends when its default group is made,
naming the stub's wrong collective (portspeed.comm.ccl_check).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from portspeed.vendor import BackendGaps, PrivateUse1Accelerator


class DayOneAccelerator(PrivateUse1Accelerator):
    """The bare test device (PrivateUse1 'testdev', collectives on 'testccl'): a test device, not hardware."""

    name = "day-one"
    device_type = "testdev"
    backend = "testccl"
    vendor_modules = ("portspeed.testing.testdev.runtime",)  # imported when selected: registers device and CCL
    vendor_package = "portspeed's test device (make testdev)"
    auto_detect = False  # chosen only by name
    backend_gaps = BackendGaps(  # what testccl lacks (the collectives suite prints this line when it is left out)
        unsupported_ops=[dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM],
        unsupported_dtypes=[("reduce_scatter", torch.bfloat16), ("reduce_scatter_tensor", torch.bfloat16)],
        chunk_shaped_all_gather=True,
        groups_hold_host_threads=True,
        note="testccl, the test device's CCL",
    )
    # conformance's lines go here, at the end of the class body
