"""The bare variant of the test device: the things a new vendor's device often does not do, as runtime switches.

The test device quietly does what a vendor's first PrivateUse1 device often leaves out (PyTorch's own reference
device, OpenReg, on torch 2.13 among them), and so hides the faults a port meets there. The bare variant turns
each of those off, in the same built library, by name:

``PORTSPEED_TESTDEV_BARE=no-memory-info,no-shallow-copy,wrong-sdpa,host-rng,stub-ccl,wrong-gelu,wrong-layer-norm``
(a comma list; ``all``: every fault), read once when the library loads; unset or empty: the full test device, as before.

==================  =====================================================================================
fault               what the device then does
==================  =====================================================================================
no-memory-info      ``torch.accelerator.get_memory_info`` raises NotImplementedError (total memory unknown)
no-shallow-copy     no PrivateUse1 kernel for ``_has_compatible_shallow_copy_type``: ``module.to(device)``
                    makes new Parameter objects (their attributes lost), ``param.data = t`` host to device raises
wrong-sdpa          its fused SDPA (forward and backward) returns memory it never wrote
host-rng            random ops draw from the host's default generator through the CPU fallback; a device
                    generator passed as ``generator=`` is refused (the device generators still seed and save)
stub-ccl            testccl moves no data: all_reduce hands the input back, broadcast does nothing,
                    all_gather / reduce_scatter / all_to_all leave zeros
wrong-gelu          ``aten::gelu`` and ``gelu_backward`` answer 1.25x the right value (a torch op with no
                    other rung in the portable TE: portspeed's host rung serves it, ``wrong_torch_ops``)
wrong-layer-norm    ``aten::native_layer_norm`` and ``native_layer_norm_backward`` answer 1.25x the right value
                    (torch's layer_norm, which Megatron's local path calls: the host rung serves it there)
==================  =====================================================================================

A test device, not hardware: this module only names the switches and checks a value; the C++ library
(``csrc/``) reads the same variable when it loads.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "FAULTS", "BareValueError", "faults"]

ENV = "PORTSPEED_TESTDEV_BARE"

#: fault -> what the bare device then does (one line each); the C++ library knows the same names (device.cpp)
FAULTS: dict[str, str] = {
    "no-memory-info": "torch.accelerator.get_memory_info raises NotImplementedError",
    "no-shallow-copy": "no PrivateUse1 _has_compatible_shallow_copy_type kernel (module.to(device) makes new "
                       "Parameters)",
    "wrong-sdpa": "its fused SDPA returns memory it never wrote",
    "host-rng": "random ops on the device draw from the host generator",
    "stub-ccl": "testccl moves no data",
    "wrong-gelu": "its gelu (forward and backward) answers 1.25x the right value",
    "wrong-layer-norm": "its layer_norm (forward and backward) answers 1.25x the right value",
}


class BareValueError(ValueError):
    """PORTSPEED_TESTDEV_BARE names something that is not a fault of the bare variant."""


def faults(value: str | None = None) -> tuple[str, ...]:
    """The faults ``value`` (default: the environment's PORTSPEED_TESTDEV_BARE) names, in FAULTS' order.

    Raises BareValueError, in one line listing the accepted names, for a name that is not one.
    """
    raw = os.environ.get(ENV, "") if value is None else value
    items = {item.strip() for item in raw.split(",") if item.strip()}
    unknown = sorted(items - set(FAULTS) - {"all"})
    if unknown:
        raise BareValueError(f"{ENV}={raw!r}: {', '.join(map(repr, unknown))} is not a fault of the bare test "
                             f"device; give a comma list of {', '.join(FAULTS)}, or all")
    return tuple(FAULTS) if "all" in items else tuple(f for f in FAULTS if f in items)
