"""The portspeed adapter of the test device, written as a third-party vendor would write one.

It reaches the engine only through the public adapter contract: it is an ``Accelerator``
subclass registered in the ``portspeed.adapters`` entry-point group (see pyproject.toml),
its vendor module is the test device package (imported only when this adapter is
selected), and it declares what its CCL lacks. ``detect()`` is False: the test device is
chosen only by name, ``PORTSPEED_ACCELERATOR=testdev``, so CPU runs never switch to it.
"""

from __future__ import annotations

from typing import ClassVar

from portspeed.accelerator import Accelerator

__all__ = ["TestdevAccelerator"]


class TestdevAccelerator(Accelerator):
    """portspeed's test device (PrivateUse1 'testdev', collectives on 'testccl'): a test device, not hardware."""

    name: ClassVar[str] = "testdev"
    device_type: ClassVar[str] = "testdev"
    backend: ClassVar[str] = "testccl"
    vendor_modules: ClassVar[tuple[str, ...]] = ("portspeed.testing.testdev",)
    vendor_package: ClassVar[str | None] = "portspeed's test device (build: python -m portspeed.testing.testdev build)"

    @classmethod
    def detect(cls) -> bool:
        return False
