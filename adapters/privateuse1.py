"""The generic adapter's old name: ``PrivateUse1Accelerator`` lives in ``portspeed.accelerator.privateuse1``.

Why it moved: it is the base every out-of-tree device subclasses, so it belongs to the contract
that ``portspeed.vendor`` presents (and ``portspeed.vendor`` may not import the plugins, whose
adapters import it). Vendors import it from ``portspeed.vendor``; this name stays importable for
adapters written before, and holds the same objects.
"""

from __future__ import annotations

from portspeed.vendor import ModuleGenerator, PrivateUse1Accelerator, registered_backend

__all__ = ["ModuleGenerator", "PrivateUse1Accelerator", "registered_backend"]
