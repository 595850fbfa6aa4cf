"""A one-file adapter that forgets ``device_type`` (tests/test_bad_inputs.py: refused when defined, naming it)."""

from portspeed.vendor import PrivateUse1Accelerator


class NoDeviceType(PrivateUse1Accelerator):
    name = "no-device-type"
