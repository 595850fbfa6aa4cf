"""The portspeed test device: an out-of-tree accelerator on PrivateUse1, and its CCL.

It is a TEST DEVICE, NOT HARDWARE. It exists so that portspeed (and any porting layer) can
be proven on a device that is not the host, on machines without an accelerator: device
tensors carry the device type ``testdev``, ops that mix host and device tensors fail,
every host/device move is a real copy, each device has its own generator, and collectives
go through its own c10d backend ``testccl``, which declares gaps like a vendor CCL.

Importing this package does nothing to torch. ``import portspeed.testing.testdev.runtime``
does what importing a vendor's torch extension does (build if needed, load, register the
device and its CCL), and cannot be undone in a process: it happens only when the adapter
is selected by name (``PORTSPEED_ACCELERATOR=testdev``), or when a program imports it.

Modules: ``runtime`` (registration), ``build`` (the C++ extension: ``python -m
portspeed.testing.testdev build``), ``device_module`` (``torch.testdev``), ``ccl`` (the
backend's registration), ``adapter`` (the portspeed adapter, an entry point), ``kernels`` (its
vendor-slot kernel, ``rms_norm``; its fused attention is C++ only, ``csrc/fused.cpp``).
"""

DEVICE_TYPE = "testdev"
BACKEND_NAME = "testccl"

__all__ = ["BACKEND_NAME", "DEVICE_TYPE"]
